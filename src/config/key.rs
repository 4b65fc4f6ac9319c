//! Cluster keys: where a key ring comes from, how it is written, and how a
//! fresh key is made.
//!
//! A key is 32 bytes written as 64 hex characters. A key ring is one or more
//! keys separated by commas or newlines; the first key seals, every key
//! unseals, so a key can be rotated in without a restart.

use std::fmt;
use std::path::{Path, PathBuf};

use super::{EnvLookup, Problem};

/// What every message about a malformed key asks for.
const KEY_FORM: &str =
    "expected 64 hex characters (32 bytes), as printed by `sbmesh-sidecar keygen`";

/// Where a key ring comes from, as written in `proxy.cluster.security.shared_key`
/// (or `--cluster-key`).
#[derive(Clone, PartialEq, Eq)]
pub enum KeySource {
    /// `env:NAME`: the value of an environment variable.
    Env(String),
    /// `file:/path`: the contents of a file.
    File(PathBuf),
    /// Anything else: the key ring itself.
    Literal(String),
}

impl KeySource {
    /// Classifies `text` by its prefix. Never fails; whether the source is
    /// usable is decided by [`KeySource::check`] and [`resolve_key_source`].
    pub(crate) fn parse(text: &str) -> KeySource {
        let text = text.trim();
        if let Some(name) = text.strip_prefix("env:") {
            KeySource::Env(name.trim().to_string())
        } else if let Some(path) = text.strip_prefix("file:") {
            KeySource::File(PathBuf::from(path.trim()))
        } else {
            KeySource::Literal(text.to_string())
        }
    }

    /// The checks possible without the environment or the file system: an
    /// `env:` name is a valid variable name, a `file:` path is not empty, and
    /// a literal is a well-formed key ring.
    pub(crate) fn check(&self) -> Result<(), String> {
        match self {
            KeySource::Env(name) => {
                let valid = name
                    .chars()
                    .next()
                    .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
                    && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
                if valid {
                    Ok(())
                } else {
                    Err(format!(
                        "env:{name} does not name an environment variable; expected env:NAME with NAME made of letters, digits and _"
                    ))
                }
            }
            KeySource::File(path) if path.as_os_str().is_empty() => Err(
                "file: names no file; expected file:/path/to/key (one key per line, first is primary)"
                    .to_string(),
            ),
            KeySource::File(_) => Ok(()),
            KeySource::Literal(text) => parse_key_ring(text).map(drop),
        }
    }
}

impl fmt::Debug for KeySource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KeySource::Env(name) => f.debug_tuple("Env").field(name).finish(),
            KeySource::File(path) => f.debug_tuple("File").field(path).finish(),
            KeySource::Literal(_) => f.debug_tuple("Literal").field(&"<redacted>").finish(),
        }
    }
}

/// Resolves a key source (`env:NAME`, `file:/path`, or the key ring itself)
/// to the key ring text, checking its format.
///
/// `path` locates the setting in problems (`proxy.cluster.security.shared_key`
/// or `--cluster-key`). `read_file` is `std::fs::read_to_string` in
/// production. The returned text is what [`parse_key_ring`] accepts; key
/// material never appears in a problem message.
pub fn resolve_key_source(
    path: &str,
    source: &str,
    env: &EnvLookup<'_>,
    read_file: &dyn Fn(&Path) -> std::io::Result<String>,
) -> Result<String, Problem> {
    let parsed = KeySource::parse(source);
    if let KeySource::Env(_) | KeySource::File(_) = parsed {
        parsed.check().map_err(|m| Problem::error(path, m))?;
    }
    let (origin, text) = match parsed {
        KeySource::Env(name) => {
            let value = env(&name).filter(|v| !v.trim().is_empty()).ok_or_else(|| {
                Problem::error(
                    path,
                    format!(
                        "environment variable {name} (named by env:{name}) is not set or empty"
                    ),
                )
            })?;
            (
                Some(format!("the key in environment variable {name}")),
                value,
            )
        }
        KeySource::File(file) => {
            let value = read_file(&file).map_err(|e| {
                Problem::error(
                    path,
                    format!("cannot read key file {}: {e}", file.display()),
                )
            })?;
            (Some(format!("the key in file {}", file.display())), value)
        }
        KeySource::Literal(text) => (None, text),
    };
    parse_key_ring(&text).map_err(|m| match origin {
        Some(origin) => Problem::error(path, format!("{origin}: {m}")),
        None => Problem::error(path, m),
    })?;
    Ok(text)
}

/// Parses a key ring: keys of 64 hex characters separated by commas or
/// newlines, primary first. Blank entries and `#` comments (to the end of
/// the line) are ignored; an empty ring is refused.
///
/// The error message says which key is wrong and what is expected; it never
/// contains key material.
pub fn parse_key_ring(text: &str) -> Result<Vec<[u8; 32]>, String> {
    let entries: Vec<&str> = text
        .lines()
        .map(|line| line.split_once('#').map_or(line, |(before, _)| before))
        .flat_map(|line| line.split(','))
        .map(str::trim)
        .filter(|entry| !entry.is_empty())
        .collect();
    if entries.is_empty() {
        return Err(format!(
            "no key found; {KEY_FORM}, or several such keys separated by commas or newlines (primary first)"
        ));
    }
    let several = entries.len() > 1;
    entries
        .iter()
        .enumerate()
        .map(|(index, entry)| {
            decode_key(entry).map_err(|why| {
                if several {
                    format!("key #{} of the ring: {why}", index + 1)
                } else {
                    why
                }
            })
        })
        .collect()
}

fn decode_key(entry: &str) -> Result<[u8; 32], String> {
    let length = entry.chars().count();
    if length != 64 {
        return Err(format!("{KEY_FORM}; found {length} characters"));
    }
    let mut key = [0u8; 32];
    hex::decode_to_slice(entry, &mut key)
        .map_err(|_| format!("{KEY_FORM}; found a character that is not 0-9 or a-f"))?;
    Ok(key)
}

/// The system's random number generator failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("the system random number generator failed; cannot generate a key")]
pub struct KeyGenError;

/// A fresh random 32-byte key.
pub fn generate_key() -> Result<[u8; 32], KeyGenError> {
    let mut key = [0u8; 32];
    aws_lc_rs::rand::fill(&mut key).map_err(|_| KeyGenError)?;
    Ok(key)
}

/// A key as 64 lowercase hex characters, the form [`parse_key_ring`] reads.
pub fn key_to_hex(key: &[u8; 32]) -> String {
    hex::encode(key)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io;

    const K1: &str = "000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f";
    const K2: &str = "FFEEDDCCBBAA99887766554433221100ffeeddccbbaa99887766554433221100";

    fn no_env(_: &str) -> Option<String> {
        None
    }

    fn no_file(p: &Path) -> io::Result<String> {
        Err(io::Error::new(
            io::ErrorKind::NotFound,
            format!("no such file {}", p.display()),
        ))
    }

    #[test]
    fn ring_accepts_commas_newlines_comments_and_blanks() {
        let ring = parse_key_ring(&format!("{K1},{K2}")).unwrap();
        assert_eq!(ring.len(), 2);
        assert_eq!(ring[0][1], 1);
        assert_eq!(ring[1][0], 0xff);

        let text = format!("# rotated 2025-01\n\n  {K2}  # new primary\r\n{K1}\n, ,\n");
        let ring = parse_key_ring(&text).unwrap();
        assert_eq!(ring.len(), 2);
        assert_eq!(ring[0][0], 0xff);
        assert_eq!(ring[1][31], 0x1f);
    }

    #[test]
    fn ring_refuses_empty() {
        for empty in ["", " ", "\n\n", "# only a comment\n", ",,"] {
            let e = parse_key_ring(empty).unwrap_err();
            assert!(e.starts_with("no key found"), "{e}");
            assert!(e.contains("sbmesh-sidecar keygen"), "{e}");
        }
    }

    #[test]
    fn ring_refuses_bad_keys_without_echoing_them() {
        let e = parse_key_ring("abcd").unwrap_err();
        assert_eq!(
            e,
            "expected 64 hex characters (32 bytes), as printed by `sbmesh-sidecar keygen`; found 4 characters"
        );
        let bad = format!("{}zz", &K1[..62]);
        let e = parse_key_ring(&bad).unwrap_err();
        assert!(
            e.ends_with("found a character that is not 0-9 or a-f"),
            "{e}"
        );
        assert!(!e.contains(&bad));
        let e = parse_key_ring(&format!("{K1},{}", &K2[..10])).unwrap_err();
        assert!(
            e.starts_with("key #2 of the ring: expected 64 hex characters"),
            "{e}"
        );
        // multi-byte characters count as characters, and never panic
        let e = parse_key_ring(&"é".repeat(32)).unwrap_err();
        assert!(e.contains("found 32 characters"), "{e}");
        let e = parse_key_ring(&"é".repeat(64)).unwrap_err();
        assert!(e.contains("not 0-9 or a-f"), "{e}");
    }

    #[test]
    fn source_classification() {
        assert_eq!(KeySource::parse("env:X"), KeySource::Env("X".into()));
        assert_eq!(
            KeySource::parse(" file: /k "),
            KeySource::File(PathBuf::from("/k"))
        );
        assert_eq!(KeySource::parse(K1), KeySource::Literal(K1.into()));
        assert!(!format!("{:?}", KeySource::parse(K1)).contains(K1));
    }

    #[test]
    fn source_static_checks() {
        assert!(KeySource::parse("env:SBPROXY_CLUSTER_KEY").check().is_ok());
        assert!(
            KeySource::parse("env:")
                .check()
                .unwrap_err()
                .contains("env:NAME")
        );
        assert!(KeySource::parse("env:A-B").check().is_err());
        assert!(
            KeySource::parse("file:")
                .check()
                .unwrap_err()
                .contains("file:/path")
        );
        assert!(KeySource::parse("file:/etc/k").check().is_ok());
        assert!(KeySource::parse(K1).check().is_ok());
        assert!(KeySource::parse("nothex").check().is_err());
    }

    #[test]
    fn resolve_from_env() {
        let env = |name: &str| (name == "KEY").then(|| format!("{K1},{K2}"));
        let text = resolve_key_source("p", "env:KEY", &env, &no_file).unwrap();
        assert_eq!(parse_key_ring(&text).unwrap().len(), 2);

        let p = resolve_key_source("p", "env:MISSING", &env, &no_file).unwrap_err();
        assert_eq!(
            p.to_string(),
            "p: environment variable MISSING (named by env:MISSING) is not set or empty"
        );

        let env = |_: &str| Some("short".to_string());
        let p = resolve_key_source("p", "env:KEY", &env, &no_file).unwrap_err();
        assert!(
            p.message
                .starts_with("the key in environment variable KEY: expected 64 hex characters"),
            "{}",
            p.message
        );
        assert!(!p.message.contains("short"));
    }

    #[test]
    fn resolve_from_file() {
        let read = |p: &Path| {
            if p == Path::new("/keys/ring") {
                Ok(format!("{K2}\n{K1}\n"))
            } else {
                no_file(p)
            }
        };
        let text = resolve_key_source("p", "file:/keys/ring", &no_env, &read).unwrap();
        assert_eq!(parse_key_ring(&text).unwrap()[0][0], 0xff);

        let p = resolve_key_source("--cluster-key", "file:/nope", &no_env, &read).unwrap_err();
        assert_eq!(p.path, "--cluster-key");
        assert!(
            p.message.starts_with("cannot read key file /nope: "),
            "{}",
            p.message
        );

        let read_bad = |_: &Path| Ok("# nothing\n".to_string());
        let p = resolve_key_source("p", "file:/k", &no_env, &read_bad).unwrap_err();
        assert!(
            p.message.starts_with("the key in file /k: no key found"),
            "{}",
            p.message
        );
    }

    #[test]
    fn resolve_literal() {
        assert_eq!(resolve_key_source("p", K1, &no_env, &no_file).unwrap(), K1);
        let p = resolve_key_source("p", "secret", &no_env, &no_file).unwrap_err();
        assert!(p.message.contains("as printed by `sbmesh-sidecar keygen`"));
        assert!(!p.message.contains("secret"));
        let p = resolve_key_source("p", "env:", &no_env, &no_file).unwrap_err();
        assert!(p.message.contains("env:NAME"), "{}", p.message);
    }

    #[test]
    fn generated_keys_round_trip() {
        let a = generate_key().unwrap();
        let b = generate_key().unwrap();
        assert_ne!(a, b);
        let hex = key_to_hex(&a);
        assert_eq!(hex.len(), 64);
        assert!(
            hex.chars()
                .all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase())
        );
        assert_eq!(parse_key_ring(&hex).unwrap(), vec![a]);
    }
}
