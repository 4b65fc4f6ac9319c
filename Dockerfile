# syntax=docker/dockerfile:1.7
# One image with both binaries: sbmesh-sidecar (the default entrypoint) and
# sbmesh-operator (the operator Deployment and every rendered pod name their
# binary explicitly). Build: docker build -t sbmesh .

# The toolchain sidecar/link/hot-functions.txt was made with: its names carry
# a hash of it, and another one builds a binary without that layout (more RSS,
# BENCHMARKS.md, "The steady-state code together").
FROM rust:1.95-bookworm AS builder
WORKDIR /src

# Dependency layer: the manifests and the lockfile, with stub sources, so the
# dependencies build once and stay cached until Cargo.lock or a manifest changes.
COPY Cargo.toml Cargo.lock ./
COPY sidecar/Cargo.toml sidecar/Cargo.toml
COPY operator/Cargo.toml operator/Cargo.toml
# A workspace member (the test stand-in of sbproxy): not built here, but cargo
# needs every member's manifest to load the workspace.
COPY standin/Cargo.toml standin/Cargo.toml
RUN <<'STUBS'
set -eu
# A stub for every target the manifests declare, at its path or cargo's default.
for manifest in Cargo.toml sidecar/Cargo.toml operator/Cargo.toml standin/Cargo.toml; do
  dir=$(dirname "$manifest")
  awk '
    function flush() {
      if (kind == "") return
      if (path == "") {
        if (kind == "lib") path = "src/lib.rs"
        else if (kind == "bin") path = "src/bin/" name ".rs"
        else if (kind == "bench") path = "benches/" name ".rs"
        else if (kind == "test") path = "tests/" name ".rs"
        else path = "examples/" name ".rs"
      }
      print kind, path
      kind = ""
    }
    /^\[\[(bin|bench|test|example)\]\]/ { flush(); kind = $0; gsub(/[][ ]/, "", kind); name = ""; path = ""; next }
    /^\[lib\]/ { flush(); kind = "lib"; name = ""; path = ""; next }
    /^\[/ { flush(); next }
    kind != "" && /^[ \t]*name[ \t]*=/ { name = $0; sub(/^[^"]*"/, "", name); sub(/".*/, "", name) }
    kind != "" && /^[ \t]*path[ \t]*=/ { path = $0; sub(/^[^"]*"/, "", path); sub(/".*/, "", path) }
    END { flush() }
  ' "$manifest" | while read -r kind path; do
    mkdir -p "$dir/$(dirname "$path")"
    if [ "$kind" = lib ]; then : >"$dir/$path"; else echo 'fn main() {}' >"$dir/$path"; fi
  done
done
# The root package is the library, found by convention.
mkdir -p src && : >src/lib.rs
cargo build --release --locked -p sbmesh-sidecar -p sbmesh-operator
STUBS

# The real sources. Drop the stub builds of the workspace's own crates so they
# are rebuilt from these files whatever their timestamps.
COPY . .
RUN cargo clean --release -p sbmesh -p sbmesh-sidecar -p sbmesh-operator \
 && cargo build --release --locked -p sbmesh-sidecar -p sbmesh-operator \
 && install -D -m 0755 target/release/sbmesh-sidecar /out/sbmesh-sidecar \
 && install -D -m 0755 target/release/sbmesh-operator /out/sbmesh-operator \
 && install -d -o 65532 -g 65532 /out/var/lib/sbproxy/certs /out/var/lib/sbproxy/sidecar

# glibc, libgcc, CA certificates and a nonroot user (65532); no shell.
FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=builder /out/sbmesh-sidecar /usr/local/bin/sbmesh-sidecar
COPY --from=builder /out/sbmesh-operator /usr/local/bin/sbmesh-operator
# Default --state-dir and --cert-dir, writable without a volume mounted.
COPY --from=builder --chown=65532:65532 /out/var/lib/sbproxy /var/lib/sbproxy
USER 65532:65532
# Sidecar: gossip (UDP), transport (TCP), admin, ACME HTTP-01 responder.
# The operator's /metrics and /healthz (8080) are declared by its Deployment.
EXPOSE 7946/udp 8946/tcp 9091/tcp 8089/tcp
ENTRYPOINT ["/usr/local/bin/sbmesh-sidecar"]
CMD ["run"]
