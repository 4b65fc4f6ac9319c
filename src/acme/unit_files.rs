//! A unit's certificate files in `--cert-dir`, read and written: what is
//! there ([`read_local`]), the CA's certificate installed ([`install`]),
//! and the self-signed placeholder written until it arrives
//! ([`write_placeholder`], and [`write_startup_placeholders`] before
//! anything else runs). Where the files go is [`CertUnit::dir`]; the
//! atomic writes are [`crate::acme::deliver`]'s.

use std::io;
use std::path::Path;

use crate::acme::certs::{CertRecord, parse_chain};
use crate::acme::deliver::{read_pair, write_pair};
use crate::acme::outcome::PlaceholderError;
use crate::acme::placeholder::{self, is_placeholder};
use crate::acme::unit::{CertUnit, Local, needs_placeholder, wanted_units};
use crate::config::SbConfig;
use crate::store::now_unix_ms;

/// Reads what is on disk for `unit`: `None` when nothing readable is.
pub(crate) fn read_local(unit: &CertUnit, cert_dir: &Path) -> Option<Local> {
    let (chain, _key) = read_pair(&unit.dir(cert_dir).ok()?)?;
    let facts = parse_chain(&chain).ok()?;
    Some(Local {
        placeholder: is_placeholder(&chain),
        serial: facts.serial,
        not_after_unix: facts.not_after_unix,
        names: facts.dns_names,
    })
}

/// Writes `record`'s certificate as `unit`'s files: what is on disk then,
/// and whether the files changed.
pub(crate) fn install(
    unit: &CertUnit,
    cert_dir: &Path,
    record: &CertRecord,
) -> io::Result<(Local, bool)> {
    let changed = write_pair(&unit.dir(cert_dir)?, &record.chain_pem, &record.key_pem)?;
    let local = Local {
        serial: record.serial.clone(),
        not_after_unix: record.not_after_unix,
        names: record.hosts.clone(),
        placeholder: false,
    };
    Ok((local, changed))
}

/// Writes a self-signed placeholder for `unit` into `cert_dir`.
pub(crate) fn write_placeholder(
    unit: &CertUnit,
    cert_dir: &Path,
    now: u64,
) -> Result<Local, PlaceholderError> {
    let (chain, key) = placeholder::generate(&unit.names, now).map_err(PlaceholderError::Make)?;
    let dir = unit.dir(cert_dir).map_err(PlaceholderError::Write)?;
    write_pair(&dir, &chain, &key).map_err(PlaceholderError::Write)?;
    let facts = parse_chain(&chain).map_err(PlaceholderError::Read)?;
    Ok(Local {
        serial: facts.serial,
        not_after_unix: facts.not_after_unix,
        names: facts.dns_names,
        placeholder: true,
    })
}

/// Writes a placeholder for every certificate `config` asks for that has
/// nothing usable in `cert_dir` yet, before anything else runs: a proxy
/// that reads its certificate files at start-up (sbproxy with
/// `tls_cert_file`) can then start while the store, the mesh and the CA
/// are still on their way. The manager does the same later for new
/// origins. Returns the units written, or the first error (`<unit id>:
/// <why>`, for the start-up log).
pub(crate) fn write_startup_placeholders(
    config: &SbConfig,
    cert_dir: &Path,
) -> Result<usize, String> {
    let now = now_unix_ms() / 1000;
    let mut written = 0;
    for unit in wanted_units(config).0 {
        if needs_placeholder(&unit, read_local(&unit, cert_dir).as_ref(), now) {
            write_placeholder(&unit, cert_dir, now).map_err(|e| format!("{}: {e}", unit.id))?;
            written += 1;
        }
    }
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn a_placeholder_on_disk_is_recognised_after_a_restart() {
        let dir = tempfile::tempdir().unwrap();
        let san = CertUnit::san(names(&["a.example.com", "b.example.com"])).unwrap();
        let (chain, key) = placeholder::generate(&san.names, now_unix_ms() / 1000).unwrap();
        write_pair(dir.path(), &chain, &key).unwrap();
        let local = read_local(&san, dir.path()).unwrap();
        assert!(local.placeholder);
        assert!(
            !local.is_real_for(&san),
            "a placeholder is not the CA's certificate"
        );
        // Per host: its own directory, nothing there yet.
        assert!(read_local(&CertUnit::per_host("a.example.com"), dir.path()).is_none());
    }
}
