#!/usr/bin/env bash
# A 3-node sbmesh cluster on this machine, laid out as pods would be: one
# sidecar on each of 127.0.0.2, 127.0.0.3 and 127.0.0.4, each with gossip on
# 7946/udp, transport on 8946/tcp, admin on 9091 and the ACME responder on
# 8089 of its own address. No proxy runs: reload POSTs go to a port nothing
# listens on, fail, and are retried, which is expected here.
#
#   examples/local-mesh.sh      build, start, wait for the mesh, run until Ctrl-C
#
# SBMESH_SIDECAR_BIN=path uses that binary instead of building one.
# SBMESH_KEEP_TMP=1 keeps the temporary directory (logs, state) after exit.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

NODES=(2 3 4)
SEEDS="127.0.0.2:7946,127.0.0.3:7946,127.0.0.4:7946"
ADMIN="http://127.0.0.2:9091"

if [ -n "${SBMESH_SIDECAR_BIN:-}" ]; then
  BIN="$SBMESH_SIDECAR_BIN"
else
  echo "==> building sbmesh-sidecar (release)"
  cargo build --release -p sbmesh-sidecar
  BIN="${CARGO_TARGET_DIR:-$ROOT/target}/release/sbmesh-sidecar"
fi
[ -x "$BIN" ] || {
  echo "local-mesh: no sidecar binary at $BIN" >&2
  exit 1
}

WORK="$(mktemp -d "${TMPDIR:-/tmp}/sbmesh-local.XXXXXX")"
PIDS=()

# Stops the three nodes this script started, by PID: SIGTERM (a graceful
# leave and drain), then SIGKILL for any still running after 15 s.
cleanup() {
  local rc=$? pid i
  trap - EXIT INT TERM
  set +e
  if [ "${#PIDS[@]}" -gt 0 ]; then
    echo
    echo "==> stopping nodes (pids ${PIDS[*]})"
    kill -TERM "${PIDS[@]}" 2>/dev/null
    for i in $(seq 1 75); do
      for pid in "${PIDS[@]}"; do
        kill -0 "$pid" 2>/dev/null && break
        pid=""
      done
      [ -z "$pid" ] && break
      sleep 0.2
    done
    for pid in "${PIDS[@]}"; do
      if kill -0 "$pid" 2>/dev/null; then
        echo "local-mesh: pid $pid did not stop within 15 s; killing it" >&2
        kill -KILL "$pid" 2>/dev/null
      fi
      wait "$pid" 2>/dev/null
    done
  fi
  if [ "${SBMESH_KEEP_TMP:-0}" = 1 ]; then
    echo "==> kept $WORK"
  else
    rm -rf "$WORK"
  fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

show_logs() {
  local n
  for n in "${NODES[@]}"; do
    echo "--- node local-$n ($WORK/node-$n.log), last lines:" >&2
    tail -n 20 "$WORK/node-$n.log" >&2 || true
  done
}

check_alive() {
  local i
  for i in "${!PIDS[@]}"; do
    if ! kill -0 "${PIDS[$i]}" 2>/dev/null; then
      echo "local-mesh: node local-${NODES[$i]} (pid ${PIDS[$i]}) exited" >&2
      return 1
    fi
  done
}

SBMESH_CLUSTER_KEY="$("$BIN" keygen)"
export SBMESH_CLUSTER_KEY

for n in "${NODES[@]}"; do
  ip="127.0.0.$n"
  mkdir -p "$WORK/node-$n/state" "$WORK/node-$n/certs"
  # A session of its own: Ctrl-C reaches this script only, which then stops
  # each node once, by PID.
  setsid "$BIN" run \
    --config examples/sb-cluster.yml \
    --node-id "local-$n" \
    --cluster-id local \
    --bind "$ip" \
    --gossip-port 7946 \
    --transport-port 8946 \
    --seeds "$SEEDS" \
    --admin-listen "$ip:9091" \
    --challenge-listen "$ip:8089" \
    --state-dir "$WORK/node-$n/state" \
    --cert-dir "$WORK/node-$n/certs" \
    --proxy-reload-url "http://$ip:9090/admin/reload" \
    --log-format text \
    --shutdown-grace-ms 5000 \
    >"$WORK/node-$n.log" 2>&1 </dev/null &
  PIDS+=("$!")
  echo "==> started local-$n on $ip (pid $!)"
done

echo "==> waiting for the three nodes to see each other"
deadline=$((SECONDS + 60))
until curl -fsS -u admin:secret "$ADMIN/admin/cluster/status" 2>/dev/null |
  grep -Eq '"total_nodes"[[:space:]]*:[[:space:]]*3([^0-9]|$)'; do
  if ! check_alive; then
    show_logs
    exit 1
  fi
  if [ "$SECONDS" -ge "$deadline" ]; then
    echo "local-mesh: the mesh did not reach 3 nodes within 60 s" >&2
    curl -sS -u admin:secret "$ADMIN/admin/cluster/status" >&2 || true
    show_logs
    exit 1
  fi
  sleep 1
done

echo
"$BIN" status --admin "$ADMIN" --user admin --password secret || true
cat <<EOF

The mesh is up. Look at it with:
  $BIN status --admin $ADMIN --user admin --password secret
  curl -s -u admin:secret $ADMIN/admin/cluster/status
  curl -s http://127.0.0.3:9091/metrics | grep '^mesh_'
  curl -s http://127.0.0.4:9091/readyz
Logs: $WORK/node-{2,3,4}.log
Try: kill -9 one node's pid (${PIDS[*]}) and watch the others mark it down.

Press Ctrl-C to stop the three nodes.
EOF

# Runs until Ctrl-C, or until every node has exited; says when one exits.
reported=" "
while :; do
  alive=0
  for i in "${!PIDS[@]}"; do
    if kill -0 "${PIDS[$i]}" 2>/dev/null; then
      alive=$((alive + 1))
    elif [[ "$reported" != *" $i "* ]]; then
      reported+="$i "
      echo "==> node local-${NODES[$i]} (pid ${PIDS[$i]}) exited; log: $WORK/node-${NODES[$i]}.log"
    fi
  done
  [ "$alive" -gt 0 ] || break
  sleep 1
done
echo "==> all three nodes have exited"
show_logs
