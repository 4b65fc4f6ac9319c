//! Certificates handed to the proxy (docs/reference.md#certificate-files):
//! `<cert-dir>/<host>/tls.crt` (chain, leaf first, PEM, mode 0644) and
//! `<cert-dir>/<host>/tls.key` (PKCS#8 PEM, mode 0600) per host, or the
//! same pair directly in `<cert-dir>` for the one certificate of
//! `certificates: san` ([`write_pair`] of `<cert-dir>`). Both go through
//! [`write_pair`], so they share everything below.
//!
//! Each file is replaced atomically: written to a temporary file in the same
//! directory (created with its final mode, so the key is never readable by
//! others, not even for a moment), fsynced, renamed over the old one, and
//! the directory fsynced so the rename survives a crash. A file whose
//! content is already on disk is not rewritten, so an unchanged certificate
//! causes no reload.
//!
//! # Order: key first, then chain
//!
//! Two renames cannot be one atomic step, so a reader looking between them
//! sees a new key with the old chain. The key is written first because
//! `tls.crt` is the file proxies and watchers conventionally key on: when
//! the new chain appears, its key is already in place, and the reload the
//! sidecar triggers (docs/reference.md#hot-reload) comes after both. A reader that loads
//! in the gap gets a key that does not match its chain, which TLS libraries
//! refuse at load time (the proxy keeps its old pair) rather than serve.
//! The opposite order would hand the same mismatch to exactly the readers
//! that watch `tls.crt`.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

/// Name of the chain file.
pub const CHAIN_FILE: &str = "tls.crt";
/// Name of the key file.
pub const KEY_FILE: &str = "tls.key";
/// Mode of the key file.
pub(crate) const KEY_MODE: u32 = 0o600;
/// Mode of the chain file (public data).
pub(crate) const CHAIN_MODE: u32 = 0o644;
/// Mode of a host's directory.
const DIR_MODE: u32 = 0o755;
/// Largest file read back (a chain is a few KiB).
const MAX_FILE_BYTES: u64 = 1 << 20;
/// Prefix of temporary files (dot files: no proxy globbing `*.crt` sees them).
const TEMP_PREFIX: &str = ".tmp-";

/// The directory name of `host`: lowercase, and a DNS name of labels of
/// `[a-z0-9_-]` (1 to 63 bytes each, at most 253 in all; a trailing dot
/// ignored), so it can never name anything outside `cert_dir` (`/`, `..`,
/// empty labels and wildcards are refused).
pub(crate) fn host_dir_name(host: &str) -> io::Result<String> {
    let bad = |why: &str| {
        Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "cannot write certificate files for {:?}: {why}; expected a DNS name such as api.example.com",
                host.chars().take(80).collect::<String>()
            ),
        ))
    };
    let name = host.strip_suffix('.').unwrap_or(host).to_ascii_lowercase();
    if name.is_empty() {
        return bad("empty host");
    }
    if name.len() > 253 {
        return bad("longer than 253 bytes");
    }
    for label in name.split('.') {
        if label.is_empty() {
            return bad("empty label (leading, trailing or double dot)");
        }
        if label.len() > 63 {
            return bad("a label is longer than 63 bytes");
        }
        if !label
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        {
            return bad("character outside [a-z0-9._-]");
        }
    }
    Ok(name)
}

/// Reads a file if it exists and is not oversized; `Ok(None)` when absent.
fn read_bounded(path: &Path) -> io::Result<Option<Vec<u8>>> {
    let file = match File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    let mut buf = Vec::new();
    file.take(MAX_FILE_BYTES + 1).read_to_end(&mut buf)?;
    if buf.len() as u64 > MAX_FILE_BYTES {
        return Ok(None);
    }
    Ok(Some(buf))
}

/// Writes `content` to `dir/name` atomically with `mode`, unless it is
/// already there. Returns whether it wrote. Does not fsync `dir`.
fn replace_file(dir: &Path, name: &str, content: &[u8], mode: u32) -> io::Result<bool> {
    let target = dir.join(name);
    if read_bounded(&target)?.as_deref() == Some(content) {
        // Same bytes; make sure the mode is right too (a key copied in by
        // hand may be too open).
        let meta = fs::metadata(&target)?;
        if meta.permissions().mode() & 0o777 != mode {
            fs::set_permissions(&target, fs::Permissions::from_mode(mode))?;
        }
        return Ok(false);
    }
    let temp = dir.join(format!(
        "{TEMP_PREFIX}{name}-{:016x}",
        rand::random::<u64>()
    ));
    let result = (|| {
        // create_new: never follow a planted symlink or reuse a file; the
        // mode applies at creation (umask can only remove bits).
        let mut file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(mode)
            .open(&temp)?;
        // Exact mode whatever the umask (0644 could have lost bits).
        file.set_permissions(fs::Permissions::from_mode(mode))?;
        file.write_all(content)?;
        file.sync_all()?;
        fs::rename(&temp, &target)
    })();
    if result.is_err() {
        let _ = fs::remove_file(&temp);
    }
    result.map(|()| true)
}

/// Removes temporary files a crash may have left in `dir`.
fn remove_stale_temps(dir: &Path) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        if entry.file_name().to_string_lossy().starts_with(TEMP_PREFIX) {
            let _ = fs::remove_file(entry.path());
        }
    }
}

/// The directory holding `host`'s files.
pub(crate) fn host_dir(cert_dir: &Path, host: &str) -> io::Result<PathBuf> {
    Ok(cert_dir.join(host_dir_name(&crate::acme::layout::host_segment(host))?))
}

/// Writes `<dir>/tls.key` then `tls.crt` (see the module docs for the
/// order), each atomically, creating `dir` when missing; returns whether
/// anything changed (`false`: both files already held these bytes, nothing
/// was written).
pub(crate) fn write_pair(dir: &Path, chain_pem: &str, key_pem: &str) -> io::Result<bool> {
    fs::DirBuilder::new()
        .recursive(true)
        .mode(DIR_MODE)
        .create(dir)?;
    remove_stale_temps(dir);
    let key_changed = replace_file(dir, KEY_FILE, key_pem.as_bytes(), KEY_MODE)?;
    let chain_changed = replace_file(dir, CHAIN_FILE, chain_pem.as_bytes(), CHAIN_MODE)?;
    if key_changed || chain_changed {
        File::open(dir)?.sync_all()?;
    }
    Ok(key_changed || chain_changed)
}

/// What is in `<dir>/tls.crt` and `<dir>/tls.key`: `(chain, key)`, or
/// `None` when either file is missing, unreadable, oversized or not UTF-8.
pub(crate) fn read_pair(dir: &Path) -> Option<(String, String)> {
    let chain = read_bounded(&dir.join(CHAIN_FILE)).ok()??;
    let key = read_bounded(&dir.join(KEY_FILE)).ok()??;
    Some((String::from_utf8(chain).ok()?, String::from_utf8(key).ok()?))
}

/// Writes `<cert_dir>/<host>/tls.key` then `tls.crt` ([`write_pair`]).
/// `host` is lowercased; one that is not a DNS name is an `InvalidInput`
/// error and nothing is touched.
#[cfg(test)]
pub(crate) fn write_cert_files(
    cert_dir: &Path,
    host: &str,
    chain_pem: &str,
    key_pem: &str,
) -> io::Result<bool> {
    write_pair(&host_dir(cert_dir, host)?, chain_pem, key_pem)
}

/// What is on disk for `host` ([`read_pair`]); `None` also when `host` is
/// not a DNS name.
#[cfg(test)]
pub(crate) fn read_cert_files(cert_dir: &Path, host: &str) -> Option<(String, String)> {
    read_pair(&host_dir(cert_dir, host).ok()?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    const CHAIN: &str = "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n";
    const KEY: &str = "-----BEGIN PRIVATE KEY-----\nBBBB\n-----END PRIVATE KEY-----\n";

    fn mode(path: &Path) -> u32 {
        fs::metadata(path).unwrap().permissions().mode() & 0o777
    }

    #[test]
    fn writes_reads_and_skips_unchanged() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(read_cert_files(dir.path(), "api.example.com"), None);
        assert!(write_cert_files(dir.path(), "api.example.com", CHAIN, KEY).unwrap());
        let host = dir.path().join("api.example.com");
        assert_eq!(fs::read_to_string(host.join("tls.crt")).unwrap(), CHAIN);
        assert_eq!(fs::read_to_string(host.join("tls.key")).unwrap(), KEY);
        assert_eq!(
            read_cert_files(dir.path(), "API.example.com."),
            Some((CHAIN.to_owned(), KEY.to_owned()))
        );

        // Same content: nothing written (same inodes, same mtimes).
        let ino = fs::metadata(host.join("tls.crt")).unwrap().ino();
        assert!(!write_cert_files(dir.path(), "api.example.com", CHAIN, KEY).unwrap());
        assert_eq!(fs::metadata(host.join("tls.crt")).unwrap().ino(), ino);

        // Only the chain changes: only it is replaced.
        let key_ino = fs::metadata(host.join("tls.key")).unwrap().ino();
        let chain2 = CHAIN.replace("AAAA", "CCCC");
        assert!(write_cert_files(dir.path(), "api.example.com", &chain2, KEY).unwrap());
        assert_ne!(fs::metadata(host.join("tls.crt")).unwrap().ino(), ino);
        assert_eq!(fs::metadata(host.join("tls.key")).unwrap().ino(), key_ino);
        assert_eq!(
            read_cert_files(dir.path(), "api.example.com"),
            Some((chain2, KEY.to_owned()))
        );
        // No temporary file left behind.
        let names: Vec<_> = fs::read_dir(&host)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        assert_eq!(names.len(), 2, "{names:?}");
    }

    #[test]
    fn modes() {
        let dir = tempfile::tempdir().unwrap();
        write_cert_files(dir.path(), "a.example.com", CHAIN, KEY).unwrap();
        let host = dir.path().join("a.example.com");
        assert_eq!(mode(&host.join("tls.key")), 0o600);
        assert_eq!(mode(&host.join("tls.crt")), 0o644);
        // A key loosened by hand is tightened even when its bytes match.
        fs::set_permissions(host.join("tls.key"), fs::Permissions::from_mode(0o644)).unwrap();
        assert!(!write_cert_files(dir.path(), "a.example.com", CHAIN, KEY).unwrap());
        assert_eq!(mode(&host.join("tls.key")), 0o600);
        // A replaced key is 0600 from birth: the temp file is created so.
        let key2 = KEY.replace("BBBB", "DDDD");
        assert!(write_cert_files(dir.path(), "a.example.com", CHAIN, &key2).unwrap());
        assert_eq!(mode(&host.join("tls.key")), 0o600);
    }

    #[test]
    fn atomic_replace_never_shows_a_partial_file() {
        // A reader racing the writer sees either the old or the new file,
        // complete, never a truncated one.
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().to_owned();
        let a = format!("{}\n", "a".repeat(64 * 1024));
        let b = format!("{}\n", "b".repeat(64 * 1024));
        write_cert_files(&path, "r.example.com", &a, KEY).unwrap();
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let reader = {
            let (path, a, b, stop) = (path.clone(), a.clone(), b.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut reads = 0;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let got = fs::read_to_string(path.join("r.example.com/tls.crt")).unwrap();
                    assert!(got == a || got == b, "torn read of {} bytes", got.len());
                    reads += 1;
                }
                reads
            })
        };
        for i in 0..200 {
            let content = if i % 2 == 0 { &b } else { &a };
            assert!(write_cert_files(&path, "r.example.com", content, KEY).unwrap());
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        assert!(reader.join().unwrap() > 0);
    }

    #[test]
    fn a_wildcards_files_go_to_its_spelt_out_folder() {
        let dir = tempfile::tempdir().unwrap();
        assert!(write_cert_files(dir.path(), "*.example.com", CHAIN, KEY).unwrap());
        assert!(
            dir.path()
                .join("wildcard_.example.com")
                .join(CHAIN_FILE)
                .exists()
        );
        assert!(read_cert_files(dir.path(), "*.example.com").is_some());
    }

    #[test]
    fn path_traversal_and_bad_names_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        for host in [
            "",
            ".",
            "..",
            "../etc",
            "a/../../etc",
            "a/b",
            "/abs",
            "a..b",
            ".a.example.com",
            "*.*.example.com",
            "a*.example.com",
            "a b.example.com",
            "a\0b",
            "a\\b",
            "é.example.com",
            &format!("{}.com", "a".repeat(64)),
            &"a.".repeat(128),
        ] {
            let err = write_cert_files(dir.path(), host, CHAIN, KEY).expect_err(host);
            assert_eq!(err.kind(), io::ErrorKind::InvalidInput, "{host:?}");
            assert!(err.to_string().contains("DNS name"), "{err}");
            assert_eq!(read_cert_files(dir.path(), host), None);
        }
        assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 0);
        // Accepted forms.
        assert_eq!(
            host_dir_name("API.Example.COM.").unwrap(),
            "api.example.com"
        );
        assert_eq!(host_dir_name("10.0.0.1").unwrap(), "10.0.0.1");
        assert_eq!(
            host_dir_name("_acme.x-y.example").unwrap(),
            "_acme.x-y.example"
        );
    }

    #[test]
    fn stale_temp_files_are_cleaned() {
        let dir = tempfile::tempdir().unwrap();
        let host = dir.path().join("s.example.com");
        fs::create_dir_all(&host).unwrap();
        fs::write(host.join(".tmp-tls.key-0123"), "half").unwrap();
        write_cert_files(dir.path(), "s.example.com", CHAIN, KEY).unwrap();
        assert!(!host.join(".tmp-tls.key-0123").exists());
    }

    #[test]
    fn the_san_pair_lives_in_cert_dir_beside_host_dirs() {
        let dir = tempfile::tempdir().unwrap();
        let certs = dir.path().join("certs");
        assert_eq!(read_pair(&certs), None);
        // Creates cert_dir itself when missing.
        assert!(write_pair(&certs, CHAIN, KEY).unwrap());
        assert_eq!(fs::read_to_string(certs.join("tls.crt")).unwrap(), CHAIN);
        assert_eq!(mode(&certs.join("tls.key")), 0o600);
        assert_eq!(mode(&certs.join("tls.crt")), 0o644);
        assert!(!write_pair(&certs, CHAIN, KEY).unwrap());
        // Host directories next to it are left alone.
        write_cert_files(&certs, "a.example.com", CHAIN, KEY).unwrap();
        let key2 = KEY.replace("BBBB", "EEEE");
        assert!(write_pair(&certs, CHAIN, &key2).unwrap());
        assert_eq!(read_pair(&certs), Some((CHAIN.to_owned(), key2.clone())));
        assert_eq!(
            read_cert_files(&certs, "a.example.com"),
            Some((CHAIN.to_owned(), KEY.to_owned()))
        );
    }

    #[test]
    fn a_missing_half_reads_as_none() {
        let dir = tempfile::tempdir().unwrap();
        write_cert_files(dir.path(), "m.example.com", CHAIN, KEY).unwrap();
        fs::remove_file(dir.path().join("m.example.com/tls.key")).unwrap();
        assert_eq!(read_cert_files(dir.path(), "m.example.com"), None);
        // Rewriting restores it even though the chain is unchanged.
        assert!(write_cert_files(dir.path(), "m.example.com", CHAIN, KEY).unwrap());
        assert!(read_cert_files(dir.path(), "m.example.com").is_some());
    }
}
