//! Lays out the functions an idle sidecar runs next to each other in the
//! release binary (`link/hot-functions.txt`, written by
//! `scripts/hot-functions`). The kernel maps a binary's code 64 KiB around
//! every page that faults in, so steady-state code scattered over the 13 MB
//! text kept several MiB of it resident (BENCHMARKS.md, "RSS per sidecar:
//! the steady-state code together").
//!
//! Only where rustc links with LLD (x86-64 Linux, Rust 1.90 and later, the
//! default): other linkers do not know `--symbol-ordering-file`. Names the
//! binary does not have (another toolchain or Cargo.lock) are skipped.
//! `SBMESH_NO_SYMBOL_ORDER=1` turns it off.

use std::path::Path;
use std::process::Command;

fn main() {
    let list = Path::new(env!("CARGO_MANIFEST_DIR")).join("link/hot-functions.txt");
    println!("cargo:rerun-if-changed={}", list.display());
    println!("cargo:rerun-if-env-changed=SBMESH_NO_SYMBOL_ORDER");
    let env = |k: &str| std::env::var(k).unwrap_or_default();
    let wanted = env("PROFILE") == "release"
        && env("TARGET") == "x86_64-unknown-linux-gnu"
        && env("SBMESH_NO_SYMBOL_ORDER").is_empty()
        && list.is_file()
        && links_with_lld(&env("RUSTC"), &env("CARGO_ENCODED_RUSTFLAGS"));
    if wanted {
        for arg in [
            format!("-Wl,--symbol-ordering-file={}", list.display()),
            "-Wl,--no-warn-symbol-ordering".to_owned(),
        ] {
            println!("cargo:rustc-link-arg-bin=sbmesh-sidecar={arg}");
        }
    }
}

/// rustc 1.90 and later link x86-64 Linux with its own LLD unless the
/// flags name another linker.
fn links_with_lld(rustc: &str, rustflags: &str) -> bool {
    if rustflags.contains("linker") && !rustflags.contains("lld") {
        return false;
    }
    let Ok(out) = Command::new(if rustc.is_empty() { "rustc" } else { rustc })
        .arg("--version")
        .output()
    else {
        return false;
    };
    // "rustc 1.95.0 (59807616e 2026-04-14)"
    let version = String::from_utf8_lossy(&out.stdout);
    let mut parts = version
        .split_whitespace()
        .nth(1)
        .unwrap_or("")
        .split('.')
        .map(|p| p.parse::<u32>().unwrap_or(0));
    let (major, minor) = (parts.next().unwrap_or(0), parts.next().unwrap_or(0));
    (major, minor) >= (1, 90)
}
