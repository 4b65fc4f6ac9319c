//! Seeds: the `--seeds` names and every A/AAAA record of the headless
//! Service, re-resolved periodically. A name that does not resolve yet is
//! kept and retried (pods of a StatefulSet appear one by one).

use std::net::SocketAddr;
use std::time::Duration;

use tracing::debug;

/// How long one name may take to resolve.
const LOOKUP_TIMEOUT: Duration = Duration::from_secs(2);

/// Where seeds come from.
#[derive(Clone, Debug, Default)]
#[non_exhaustive]
pub struct SeedSource {
    /// `host:port` entries; a bare host gets the gossip port.
    pub seeds: Vec<String>,
    /// FQDN of the headless Service, resolved on the gossip port.
    pub mesh_service: Option<String>,
    /// Port appended to names without one.
    pub gossip_port: u16,
}

impl SeedSource {
    /// Resolves every name now, returning the union of the addresses
    /// (deduplicated, in a stable order). Failures are logged and skipped.
    pub(crate) async fn resolve(&self) -> Vec<SocketAddr> {
        let mut names: Vec<String> = self
            .seeds
            .iter()
            .map(|s| with_port(s, self.gossip_port))
            .collect();
        if let Some(svc) = &self.mesh_service {
            names.push(with_port(svc, self.gossip_port));
        }
        let mut out = Vec::new();
        for name in names {
            if let Ok(addr) = name.parse::<SocketAddr>() {
                out.push(addr);
                continue;
            }
            match tokio::time::timeout(LOOKUP_TIMEOUT, tokio::net::lookup_host(name.as_str())).await
            {
                Ok(Ok(addrs)) => out.extend(addrs),
                Ok(Err(e)) => debug!(seed = %name, error = %e, "seed does not resolve yet"),
                Err(_) => debug!(seed = %name, "seed lookup timed out"),
            }
        }
        out.sort();
        out.dedup();
        out
    }
}

/// `host` → `host:port`; `host:p`, `[v6]:p` and `ip:p` stay as they are.
fn with_port(s: &str, port: u16) -> String {
    let s = s.trim();
    if s.parse::<SocketAddr>().is_ok() {
        return s.to_owned();
    }
    if let Ok(ip) = s.parse::<std::net::IpAddr>() {
        return SocketAddr::new(ip, port).to_string();
    }
    if s.starts_with('[')
        || s.rsplit_once(':')
            .is_some_and(|(_, p)| p.parse::<u16>().is_ok())
    {
        return s.to_owned();
    }
    format!("{s}:{port}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ports_are_added_only_when_missing() {
        assert_eq!(with_port("a.b.svc", 7946), "a.b.svc:7946");
        assert_eq!(with_port("a.b.svc:1", 7946), "a.b.svc:1");
        assert_eq!(with_port("10.0.0.1", 7946), "10.0.0.1:7946");
        assert_eq!(with_port("::1", 7946), "[::1]:7946");
        assert_eq!(with_port("[::1]:5", 7946), "[::1]:5");
    }

    #[tokio::test]
    async fn unresolvable_seed_is_skipped_not_fatal() {
        let src = SeedSource {
            seeds: vec![
                "127.0.0.9:7946".into(),
                "does-not-exist.invalid".into(),
                "localhost:7000".into(),
            ],
            mesh_service: None,
            gossip_port: 7946,
        };
        let got = src.resolve().await;
        assert!(got.contains(&"127.0.0.9:7946".parse().unwrap()));
        assert!(got.iter().any(|a| a.port() == 7000 && a.ip().is_loopback()));
        assert!(
            got.iter()
                .all(|a| a.port() != 7946 || a.ip().to_string() == "127.0.0.9")
        );
    }
}
