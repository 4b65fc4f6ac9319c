//! The certificate *unit*, pure: what [`wanted_units`] makes of the
//! configuration (one [`CertUnit`] per eligible origin with `certificates:
//! per_host`, one for all of them with `certificates: san`), where its
//! record, lock and files are ([`CertUnit::store_key`],
//! [`CertUnit::lock_name`], [`CertUnit::dir`]), which certificates serve it
//! ([`CertUnit::names_fit`], `check_record`), what is on its files
//! ([`Local`]) and when that needs a placeholder ([`needs_placeholder`]);
//! and what a node says about its certificates ([`AcmeStatus`], with
//! [`local_store_refusal`]).
//!
//! No store, disk or clock here: the core ([`crate::acme::machine`]) and the
//! shell ([`crate::acme::manager`]) both build on it.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::acme::certs::{CertRecord, key_matches, parse_chain};
use crate::acme::deliver::host_dir;
use crate::acme::layout;
use crate::acme::placeholder::PLACEHOLDER_REFRESH_SECS;
use crate::config::{CertificateMode, SbConfig};
use crate::mesh::{CertificateInfo, OrderFailing, OrderWaiting};

/// Where a unit's files go.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum UnitFiles {
    /// `<cert-dir>/<host>/tls.{crt,key}` (`certificates: per_host`).
    Host(String),
    /// `<cert-dir>/tls.{crt,key}` (`certificates: san`).
    San,
}

/// One certificate the manager keeps ordered, stored and on disk.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CertUnit {
    /// Stable id: the hostname (per host) or `layout::san_unit_id` of the
    /// name set (san). Ownership (rendezvous hashing), the renewal jitter
    /// and the manager's bookkeeping go by it.
    pub id: String,
    /// The names to order, lowercase; sorted and deduplicated for a SAN
    /// unit. Never empty.
    pub names: Vec<String>,
    /// Where the files go.
    pub files: UnitFiles,
}

impl CertUnit {
    /// The unit of one host (`certificates: per_host`).
    pub fn per_host(host: &str) -> Self {
        Self {
            id: host.to_owned(),
            names: vec![host.to_owned()],
            files: UnitFiles::Host(host.to_owned()),
        }
    }

    /// The SAN unit of `names` (sorted and deduplicated here); `None` when
    /// there are none.
    pub(crate) fn san(names: impl IntoIterator<Item = String>) -> Option<Self> {
        let names: Vec<String> = names
            .into_iter()
            .map(|n| n.to_ascii_lowercase())
            .collect::<BTreeSet<_>>()
            .into_iter()
            .collect();
        if names.is_empty() {
            return None;
        }
        Some(Self {
            id: layout::san_unit_id(&layout::hostname_set_id(&names)),
            names,
            files: UnitFiles::San,
        })
    }

    /// The name its store record is filed under ([`CertRecord::host`]) and
    /// status lists as `host`: the host, or the first of the SAN names.
    pub(crate) fn record_host(&self) -> &str {
        &self.names[0]
    }

    /// Its certificate record in the store.
    pub fn store_key(&self) -> String {
        match &self.files {
            UnitFiles::Host(host) => layout::certificate(host),
            UnitFiles::San => layout::san_certificate(&layout::hostname_set_id(&self.names)),
        }
    }

    /// Its order lock.
    pub fn lock_name(&self) -> String {
        match &self.files {
            UnitFiles::Host(host) => layout::order_lock(host),
            UnitFiles::San => layout::san_order_lock(&layout::hostname_set_id(&self.names)),
        }
    }

    /// The directory of its `tls.crt` and `tls.key`.
    pub(crate) fn dir(&self, cert_dir: &Path) -> std::io::Result<PathBuf> {
        match &self.files {
            UnitFiles::Host(host) => host_dir(cert_dir, host),
            UnitFiles::San => Ok(cert_dir.to_owned()),
        }
    }

    /// Whether a certificate naming `dns_names` serves this unit: one that
    /// names the host (per host), or exactly the unit's names (san: a
    /// certificate of another origin set is the old one, to replace).
    pub(crate) fn names_fit(&self, dns_names: &[String]) -> bool {
        match &self.files {
            UnitFiles::Host(host) => dns_names.iter().any(|n| n.eq_ignore_ascii_case(host)),
            UnitFiles::San => {
                let got: BTreeSet<String> =
                    dns_names.iter().map(|n| n.to_ascii_lowercase()).collect();
                got.len() == self.names.len() && got.iter().eq(self.names.iter())
            }
        }
    }

    /// Whether a peer's status entry announces a certificate of this unit
    /// (a placeholder never does).
    pub(crate) fn announced_by(&self, info: &CertificateInfo) -> bool {
        if info.placeholder {
            return false;
        }
        match &self.files {
            UnitFiles::Host(host) => info.host == *host,
            UnitFiles::San if info.names.is_empty() => {
                self.names.len() == 1 && info.host == self.names[0]
            }
            UnitFiles::San => self.names_fit(&info.names),
        }
    }
}

/// The units `config` asks for, and the wildcards that are not eligible:
/// one unit per eligible origin (`per_host`), or one for all of them
/// (`san`; none when there is no eligible origin). The config layer
/// refuses more than [`crate::config::MAX_SAN_NAMES`] names for `san`.
pub(crate) fn wanted_units(config: &SbConfig) -> (Vec<CertUnit>, Vec<String>) {
    let (mut hosts, wildcards) = config.acme_hostnames();
    // In name order, whatever the file's order, as every replica sees them.
    hosts.sort();
    let units = match config.certificate_mode() {
        CertificateMode::PerHost => hosts.iter().map(|h| CertUnit::per_host(h)).collect(),
        CertificateMode::San => CertUnit::san(hosts).into_iter().collect(),
    };
    (units, wildcards)
}

/// The certificate on disk.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Local {
    /// Serial, lowercase hex.
    pub serial: String,
    /// End of validity, unix seconds.
    pub not_after_unix: u64,
    /// Its DNS names.
    pub names: Vec<String>,
    /// A self-signed placeholder of ours, not the CA's.
    pub placeholder: bool,
}

impl Local {
    /// Whether this is a real certificate for `unit`'s names (not a
    /// placeholder, not the certificate of an older SAN set).
    pub(crate) fn is_real_for(&self, unit: &CertUnit) -> bool {
        !self.placeholder && unit.names_fit(&self.names)
    }
}

/// Whether a placeholder must be written for `unit`, given what is on disk
/// (`local`) at `now`: when nothing is, or when a placeholder is there for
/// other names or about to expire. Never over a real certificate, even one
/// for another origin set (it is served until the new one arrives).
pub(crate) fn needs_placeholder(unit: &CertUnit, local: Option<&Local>, now: u64) -> bool {
    match local {
        None => true,
        Some(l) if l.placeholder => {
            !unit.names_fit(&l.names) || now + PLACEHOLDER_REFRESH_SECS >= l.not_after_unix
        }
        Some(_) => false,
    }
}

/// A record is used only when it is what it claims: the unit's (filed
/// under its host; a certificate naming the host, or for a SAN unit
/// exactly its names), with a key that matches the leaf.
pub(crate) fn check_record(unit: &CertUnit, record: &CertRecord) -> Result<(), String> {
    let host = unit.record_host();
    if record.host != host {
        return Err(format!("record is for {:?}, not {host:?}", record.host));
    }
    let facts = parse_chain(&record.chain_pem).map_err(|e| e.to_string())?;
    if !unit.names_fit(&facts.dns_names) {
        return Err(match unit.files {
            UnitFiles::Host(_) => format!("certificate does not name {host:?}"),
            UnitFiles::San => format!(
                "certificate names {:?}, not exactly the {} names of the set",
                facts.dns_names,
                unit.names.len()
            ),
        });
    }
    match key_matches(&record.chain_pem, &record.key_pem) {
        Ok(true) => Ok(()),
        Ok(false) => Err("private key does not match the certificate".to_owned()),
        Err(e) => Err(e.to_string()),
    }
}

/// What this node says about its certificates (in its mesh metadata and
/// thus in every node's `/admin/cluster/status`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct AcmeStatus {
    /// Certificates written for the proxy, by host.
    pub certificates: Vec<CertificateInfo>,
    /// Origins that cannot be ordered over HTTP-01 (wildcards).
    pub not_eligible: Vec<String>,
    /// Why this node does not order, when it does not.
    pub refusal: Option<String>,
    /// Orders this node holds back until their challenge is answered.
    pub waiting: Vec<OrderWaiting>,
    /// Orders of this node that failed and back off, with why.
    pub failing: Vec<OrderFailing>,
    /// Every unit's store record was read once and what it held is
    /// written for the proxy, and with peers every unit has the CA's
    /// certificate: a proxy started now serves every stored certificate
    /// and no placeholder a peer's order is about to replace (`/startupz`).
    #[serde(skip)]
    pub settled: bool,
}

/// Why this node must not order with this store, if it must not.
pub(crate) fn local_store_refusal(backend: &str, shared: bool, has_peers: bool) -> Option<String> {
    (!shared && has_peers).then(|| {
        format!(
            "not ordering certificates: this node has peers in the mesh but storage_backend \
             \"{backend}\" is local to this pod, so a challenge sent to another replica could \
             not be answered and each replica would order the same hostnames; use a shared \
             store (file on an RWX volume, redis, s3, gcs or azure)"
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wanted_hosts_normalise_and_report_wildcards() {
        let config = crate::config::parse_config(
            "proxy:\n  extensions:\n    sbmesh:\n      acme: { enabled: true, email: a@b.c }\norigins:\n  \"API.example.com.\": {}\n  \"*.example.com\": {}\n  \"b.example.com\": {}\n",
        )
        .unwrap();
        let (hosts, wildcards) = config.acme_hostnames();
        assert_eq!(
            hosts.into_iter().collect::<Vec<_>>(),
            vec!["api.example.com".to_owned(), "b.example.com".to_owned()]
        );
        assert_eq!(wildcards, vec!["*.example.com".to_owned()]);
        let disabled = crate::config::parse_config("origins:\n  a.example.com: {}\n").unwrap();
        assert!(disabled.acme_hostnames().0.is_empty());
    }

    fn config(mode: &str, origins: &[&str]) -> SbConfig {
        let mut text = format!(
            "proxy:\n  extensions:\n    sbmesh:\n      acme: {{ enabled: true, email: a@b.c, certificates: {mode} }}\norigins:\n"
        );
        for o in origins {
            text.push_str(&format!("  \"{o}\": {{}}\n"));
        }
        crate::config::parse_config(&text).unwrap()
    }

    fn names(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn per_host_mode_makes_one_unit_per_origin() {
        let cfg = config(
            "per_host",
            &["B.example.com", "a.example.com", "*.w.example.com"],
        );
        let (units, wildcards) = wanted_units(&cfg);
        assert_eq!(wildcards, names(&["*.w.example.com"]));
        assert_eq!(
            units,
            vec![
                CertUnit::per_host("a.example.com"),
                CertUnit::per_host("b.example.com")
            ]
        );
        let unit = &units[0];
        assert_eq!(unit.id, "a.example.com");
        assert_eq!(unit.store_key(), layout::certificate("a.example.com"));
        assert_eq!(unit.lock_name(), layout::order_lock("a.example.com"));
        assert_eq!(
            unit.dir(Path::new("/certs")).unwrap(),
            Path::new("/certs/a.example.com")
        );
        // The default mode is per host.
        let default = crate::config::parse_config(
            "proxy:\n  extensions:\n    sbmesh:\n      acme: { enabled: true, email: a@b.c }\norigins:\n  a.example.com: {}\n",
        )
        .unwrap();
        assert_eq!(
            wanted_units(&default).0,
            vec![CertUnit::per_host("a.example.com")]
        );
    }

    #[test]
    fn san_mode_makes_one_unit_of_every_eligible_origin() {
        let cfg = config(
            "san",
            &[
                "c.example.com",
                "A.example.com",
                "b.example.com.",
                "*.w.example.com",
            ],
        );
        let (units, wildcards) = wanted_units(&cfg);
        assert_eq!(wildcards, names(&["*.w.example.com"]));
        assert_eq!(units.len(), 1);
        let unit = &units[0];
        let set = names(&["a.example.com", "b.example.com", "c.example.com"]);
        assert_eq!(unit.names, set);
        assert_eq!(unit.files, UnitFiles::San);
        assert_eq!(unit.record_host(), "a.example.com");
        let set_id = layout::hostname_set_id(&set);
        assert_eq!(unit.id, format!("san:{set_id}"));
        assert_eq!(unit.store_key(), layout::san_certificate(&set_id));
        assert_eq!(unit.lock_name(), layout::san_order_lock(&set_id));
        assert_eq!(unit.dir(Path::new("/certs")).unwrap(), Path::new("/certs"));
        // The id does not depend on the order of the origins; another set
        // is another unit.
        let same = config("san", &["b.example.com", "c.example.com", "a.example.com"]);
        assert_eq!(wanted_units(&same).0, units);
        let more = config(
            "san",
            &[
                "a.example.com",
                "b.example.com",
                "c.example.com",
                "d.example.com",
            ],
        );
        assert_ne!(wanted_units(&more).0[0].id, unit.id);
        // No eligible origin: no unit.
        assert!(
            wanted_units(&config("san", &["*.w.example.com"]))
                .0
                .is_empty()
        );
    }

    #[test]
    fn a_san_record_is_valid_only_for_exactly_its_names() {
        let set = names(&["a.example.com", "b.example.com", "c.example.com"]);
        let unit = CertUnit::san(set.clone()).unwrap();
        let record = |cert_names: &[String], host: &str| {
            let (chain_pem, key_pem) =
                crate::acme::placeholder::generate(cert_names, 1_800_000_000).unwrap();
            CertRecord {
                host: host.to_owned(),
                hosts: cert_names.to_vec(),
                chain_pem,
                key_pem,
                not_before_unix: 0,
                not_after_unix: 0,
                serial: "01".into(),
                issued_at_unix: 0,
                issued_by: "n".into(),
            }
        };
        // Same names in another order: valid.
        let reordered = names(&["c.example.com", "a.example.com", "b.example.com"]);
        assert_eq!(
            check_record(&unit, &record(&reordered, "a.example.com")),
            Ok(())
        );
        // A subset or a superset is another set's certificate.
        let fewer = names(&["a.example.com", "b.example.com"]);
        let err = check_record(&unit, &record(&fewer, "a.example.com")).unwrap_err();
        assert!(err.contains("not exactly the 3 names"), "{err}");
        let mut more = set.clone();
        more.push("d.example.com".into());
        assert!(check_record(&unit, &record(&more, "a.example.com")).is_err());
        // Filed under another host.
        assert!(check_record(&unit, &record(&set, "b.example.com")).is_err());
        // A key of another certificate.
        let mut mismatched = record(&set, "a.example.com");
        mismatched.key_pem = record(&set, "a.example.com").key_pem;
        assert!(check_record(&unit, &mismatched).is_err());
        // Per host, a certificate that names the host (among others) does.
        let per_host = CertUnit::per_host("b.example.com");
        assert_eq!(
            check_record(&per_host, &record(&set, "b.example.com")),
            Ok(())
        );
        assert!(check_record(&per_host, &record(&fewer[..1], "b.example.com")).is_err());
    }

    #[test]
    fn a_peer_announces_a_unit_by_host_or_by_its_names() {
        let info = |host: &str, list: &[&str], placeholder: bool| CertificateInfo {
            host: host.into(),
            not_after_unix: 1,
            serial: "0a".into(),
            names: names(list),
            placeholder,
        };
        let host = CertUnit::per_host("a.example.com");
        assert!(host.announced_by(&info("a.example.com", &[], false)));
        assert!(!host.announced_by(&info("a.example.com", &[], true)));
        assert!(!host.announced_by(&info("b.example.com", &[], false)));
        let san = CertUnit::san(names(&["b.example.com", "a.example.com"])).unwrap();
        assert!(san.announced_by(&info(
            "a.example.com",
            &["a.example.com", "b.example.com"],
            false
        )));
        assert!(!san.announced_by(&info("a.example.com", &["a.example.com"], false)));
        assert!(!san.announced_by(&info("a.example.com", &[], false)));
        assert!(!san.announced_by(&info(
            "a.example.com",
            &["a.example.com", "b.example.com"],
            true
        )));
    }

    #[test]
    fn placeholders_fill_only_what_has_no_real_certificate() {
        let now = 1_800_000_000;
        let san = CertUnit::san(names(&["a.example.com", "b.example.com"])).unwrap();
        let local = |list: &[&str], placeholder: bool, not_after_unix: u64| Local {
            serial: "01".into(),
            not_after_unix,
            names: names(list),
            placeholder,
        };
        let week = now + 7 * 86_400;
        assert!(needs_placeholder(&san, None, now));
        // A placeholder for these names, fresh: kept.
        let fresh = local(&["b.example.com", "a.example.com"], true, week);
        assert!(!needs_placeholder(&san, Some(&fresh), now));
        // About to expire, or for another set: written anew.
        assert!(needs_placeholder(&san, Some(&fresh), week - 3600));
        let other = local(&["a.example.com"], true, week);
        assert!(needs_placeholder(&san, Some(&other), now));
        // Never over a real certificate, even the old set's (served until
        // the new one arrives) or an expired one.
        assert!(!needs_placeholder(
            &san,
            Some(&local(&["a.example.com"], false, week)),
            now
        ));
        assert!(!needs_placeholder(
            &san,
            Some(&local(&["a.example.com", "b.example.com"], false, 1)),
            now
        ));
        let host = CertUnit::per_host("a.example.com");
        assert!(needs_placeholder(&host, None, now));
        assert!(!needs_placeholder(
            &host,
            Some(&local(&["a.example.com"], false, week)),
            now
        ));
    }

    #[test]
    fn a_pod_local_store_with_peers_refuses() {
        assert!(local_store_refusal("redb", false, false).is_none());
        assert!(local_store_refusal("redis", true, true).is_none());
        let msg = local_store_refusal("redb", false, true).unwrap();
        assert!(
            msg.contains("\"redb\"") && msg.contains("shared store"),
            "{msg}"
        );
    }
}
