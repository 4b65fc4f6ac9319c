//! Who this member is and how to name its peers: pod name to node id and
//! cluster id, the mesh Service's DNS name, seed and advertise addresses.
//!
//! Pure functions; the sidecar's settings feed them flags, environment and
//! `sb.yml`.

use std::net::{IpAddr, SocketAddr};

/// The longest node or cluster id accepted (the length of a DNS name).
pub(crate) const MAX_ID_LEN: usize = 253;

/// Splits a StatefulSet pod name `<statefulset>-<ordinal>` into its parts.
///
/// `demo-proxy-0` → `("demo-proxy", 0)`. `None` when the name has no `-`,
/// an empty StatefulSet part, or an ordinal that is not a plain decimal
/// number (leading zeros are not an ordinal Kubernetes would write).
pub(crate) fn statefulset_of(pod_name: &str) -> Option<(&str, u32)> {
    let (set, ordinal) = pod_name.rsplit_once('-')?;
    if set.is_empty()
        || ordinal.is_empty()
        || !ordinal.bytes().all(|b| b.is_ascii_digit())
        || (ordinal.len() > 1 && ordinal.starts_with('0'))
    {
        return None;
    }
    Some((set, ordinal.parse().ok()?))
}

/// The node id when none is configured: the pod name when known (and not
/// empty), else the host name.
pub fn default_node_id(pod_name: Option<&str>, hostname: &str) -> String {
    pod_name
        .map(str::trim)
        .filter(|name| !name.is_empty())
        .unwrap_or(hostname.trim())
        .to_string()
}

/// The cluster id by precedence: `explicit` (flag or environment), else
/// `from_yml` (`proxy.cluster.cluster_id`), else the StatefulSet name taken
/// from `pod_name`. Empty values count as absent. `None` when nothing
/// applies; the caller picks the final fallback.
pub fn default_cluster_id(
    explicit: Option<&str>,
    from_yml: Option<&str>,
    pod_name: Option<&str>,
) -> Option<String> {
    fn non_empty(v: Option<&str>) -> Option<&str> {
        v.map(str::trim).filter(|v| !v.is_empty())
    }
    non_empty(explicit)
        .or(non_empty(from_yml))
        .or_else(|| {
            non_empty(pod_name)
                .and_then(statefulset_of)
                .map(|(set, _)| set)
        })
        .map(str::to_string)
}

/// The DNS name of a headless Service: `<svc>.<namespace>.svc.<domain>`.
///
/// A trailing dot on `domain` is dropped. A `svc` that already contains a
/// dot is taken as a name someone qualified themselves and returned as is.
pub fn mesh_service_fqdn(svc: &str, namespace: &str, domain: &str) -> String {
    let svc = svc.trim().trim_end_matches('.');
    if svc.contains('.') {
        return svc.to_string();
    }
    format!(
        "{svc}.{}.svc.{}",
        namespace.trim(),
        domain.trim().trim_end_matches('.')
    )
}

/// A node or cluster id that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum IdError {
    /// The id is empty.
    #[error("{kind} is empty; expected 1 to 253 characters of A-Z, a-z, 0-9, '.', '_' or '-'")]
    Empty {
        /// `node id` or `cluster id`.
        kind: &'static str,
    },
    /// The id is longer than `MAX_ID_LEN`.
    #[error("{kind} is {len} characters long; expected at most 253")]
    TooLong {
        /// `node id` or `cluster id`.
        kind: &'static str,
        /// Its length in characters.
        len: usize,
    },
    /// The id contains a character outside `[A-Za-z0-9._-]`.
    #[error(
        "{kind} {id:?} contains {found:?}; expected only A-Z, a-z, 0-9, '.', '_' or '-' (1 to 253 characters)"
    )]
    InvalidChar {
        /// `node id` or `cluster id`.
        kind: &'static str,
        /// The id as given.
        id: String,
        /// The first character not allowed.
        found: char,
    },
}

/// Checks a node id: 1 to 253 characters of `[A-Za-z0-9._-]`.
pub fn validate_node_id(id: &str) -> Result<(), IdError> {
    validate_id("node id", id)
}

/// Checks a cluster id: 1 to 253 characters of `[A-Za-z0-9._-]`.
pub fn validate_cluster_id(id: &str) -> Result<(), IdError> {
    validate_id("cluster id", id)
}

fn validate_id(kind: &'static str, id: &str) -> Result<(), IdError> {
    let len = id.chars().count();
    if len == 0 {
        return Err(IdError::Empty { kind });
    }
    if len > MAX_ID_LEN {
        return Err(IdError::TooLong { kind, len });
    }
    match id
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')))
    {
        Some(found) => Err(IdError::InvalidChar {
            kind,
            id: id.to_string(),
            found,
        }),
        None => Ok(()),
    }
}

/// A seed or advertise address that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum AddrError {
    /// Nothing was given.
    #[error("empty address; expected {expected}")]
    Empty {
        /// What would be accepted.
        expected: &'static str,
    },
    /// A URL was given where an address was expected.
    #[error("{text:?} has a URL scheme; expected {expected}")]
    Scheme {
        /// The text as given.
        text: String,
        /// What would be accepted.
        expected: &'static str,
    },
    /// The port is not a number from 1 to 65535.
    #[error("{text:?} has port {port:?}; expected a number from 1 to 65535")]
    Port {
        /// The text as given.
        text: String,
        /// The port part.
        port: String,
    },
    /// The host part is not a DNS name or IP address.
    #[error("{text:?} is not a valid address; expected {expected}")]
    Host {
        /// The text as given.
        text: String,
        /// What would be accepted.
        expected: &'static str,
    },
    /// An advertise address that is not an IP address.
    #[error("{text:?} is not an IP address; expected {expected}")]
    NotIp {
        /// The text as given.
        text: String,
        /// What would be accepted.
        expected: &'static str,
    },
    /// An advertise address of 0.0.0.0 or `::`, which no peer can reach.
    #[error(
        "{text:?} is unspecified (0.0.0.0 or ::), which peers cannot reach; expected this pod's IP"
    )]
    Unspecified {
        /// The text as given.
        text: String,
    },
}

const SEED_FORM: &str = "host, host:port, ip, ip:port or [ipv6]:port";
const ADVERTISE_FORM: &str = "ip or ip:port ([ipv6]:port for IPv6)";

/// Normalises a seed to `host:port` (`[ipv6]:port` for IPv6 literals),
/// adding `default_port` when it has none. Names are kept as names: they
/// are re-resolved at run time.
pub fn normalize_seed(text: &str, default_port: u16) -> Result<String, AddrError> {
    let text = text.trim();
    if text.is_empty() {
        return Err(AddrError::Empty {
            expected: SEED_FORM,
        });
    }
    if text.contains("://") {
        return Err(AddrError::Scheme {
            text: text.to_string(),
            expected: SEED_FORM,
        });
    }
    if let Ok(addr) = text.parse::<SocketAddr>() {
        return checked_port(text, addr.port(), &addr.port().to_string()).map(|_| addr.to_string());
    }
    if let Ok(ip) = text.parse::<IpAddr>() {
        return Ok(SocketAddr::new(ip, default_port).to_string());
    }
    if let Some(inner) = text.strip_prefix('[').and_then(|t| t.strip_suffix(']'))
        && let Ok(ip) = inner.parse::<IpAddr>()
    {
        return Ok(SocketAddr::new(ip, default_port).to_string());
    }
    let (host, port) = match text.rsplit_once(':') {
        // An IPv6 literal with a port must be bracketed; anything else with
        // two colons is not an address.
        Some((host, _)) if host.contains(':') => {
            return Err(AddrError::Host {
                text: text.to_string(),
                expected: SEED_FORM,
            });
        }
        Some((host, port)) => (host, parse_port(text, port)?),
        None => (text, default_port),
    };
    if !is_dns_name(host) {
        return Err(AddrError::Host {
            text: text.to_string(),
            expected: SEED_FORM,
        });
    }
    Ok(format!("{host}:{port}"))
}

/// Parses an advertise address, `ip` or `ip:port` (`[ipv6]:port`), adding
/// `default_port` when it has none. Unspecified addresses are refused.
pub fn parse_advertise(text: &str, default_port: u16) -> Result<SocketAddr, AddrError> {
    let text = text.trim();
    if text.is_empty() {
        return Err(AddrError::Empty {
            expected: ADVERTISE_FORM,
        });
    }
    let addr = if let Ok(addr) = text.parse::<SocketAddr>() {
        checked_port(text, addr.port(), &addr.port().to_string())?;
        addr
    } else if let Ok(ip) = text.parse::<IpAddr>() {
        SocketAddr::new(ip, default_port)
    } else if let Some(Ok(ip)) = text
        .strip_prefix('[')
        .and_then(|t| t.strip_suffix(']'))
        .map(str::parse::<IpAddr>)
    {
        SocketAddr::new(ip, default_port)
    } else {
        // Give the port error when the port is what is wrong.
        if let Some((host, port)) = text.rsplit_once(':') {
            let host = host.trim_start_matches('[').trim_end_matches(']');
            if host.parse::<IpAddr>().is_ok() {
                parse_port(text, port)?;
            }
        }
        return Err(AddrError::NotIp {
            text: text.to_string(),
            expected: ADVERTISE_FORM,
        });
    };
    if addr.ip().is_unspecified() {
        return Err(AddrError::Unspecified {
            text: text.to_string(),
        });
    }
    Ok(addr)
}

fn parse_port(text: &str, port: &str) -> Result<u16, AddrError> {
    match port.parse::<u16>() {
        Ok(p) if p != 0 => Ok(p),
        _ => Err(AddrError::Port {
            text: text.to_string(),
            port: port.to_string(),
        }),
    }
}

fn checked_port(text: &str, port: u16, shown: &str) -> Result<u16, AddrError> {
    if port == 0 {
        Err(AddrError::Port {
            text: text.to_string(),
            port: shown.to_string(),
        })
    } else {
        Ok(port)
    }
}

/// A DNS name as Kubernetes and resolvers accept it: dot-separated labels of
/// letters, digits, `-` and `_`, each 1 to 63 characters, 253 in all; one
/// trailing dot allowed.
fn is_dns_name(host: &str) -> bool {
    let host = host.strip_suffix('.').unwrap_or(host);
    !host.is_empty()
        && host.len() <= 253
        && host.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && label
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statefulset_split() {
        assert_eq!(statefulset_of("demo-proxy-0"), Some(("demo-proxy", 0)));
        assert_eq!(statefulset_of("web-12"), Some(("web", 12)));
        assert_eq!(statefulset_of("a-4294967295"), Some(("a", u32::MAX)));
        assert_eq!(statefulset_of("a-4294967296"), None);
        assert_eq!(statefulset_of("demo"), None);
        assert_eq!(statefulset_of("-0"), None);
        assert_eq!(statefulset_of("demo-"), None);
        assert_eq!(statefulset_of("demo-01"), None);
        assert_eq!(statefulset_of("demo-7c9f8d-x2kq9"), None);
        assert_eq!(statefulset_of("demo-+1"), None);
        assert_eq!(statefulset_of("demo-١"), None); // non-ASCII digit
        assert_eq!(statefulset_of(""), None);
    }

    #[test]
    fn node_id_defaults() {
        assert_eq!(
            default_node_id(Some("demo-proxy-1"), "host"),
            "demo-proxy-1"
        );
        assert_eq!(default_node_id(None, "host"), "host");
        assert_eq!(default_node_id(Some(""), "host"), "host");
        assert_eq!(default_node_id(Some("  "), " host "), "host");
    }

    #[test]
    fn cluster_id_precedence() {
        assert_eq!(
            default_cluster_id(Some("flag"), Some("yml"), Some("set-0")).as_deref(),
            Some("flag")
        );
        assert_eq!(
            default_cluster_id(None, Some("yml"), Some("set-0")).as_deref(),
            Some("yml")
        );
        assert_eq!(
            default_cluster_id(Some(""), Some(""), Some("demo-proxy-2")).as_deref(),
            Some("demo-proxy")
        );
        assert_eq!(default_cluster_id(None, None, Some("laptop")), None);
        assert_eq!(default_cluster_id(None, None, None), None);
    }

    #[test]
    fn fqdn() {
        assert_eq!(
            mesh_service_fqdn("demo-mesh", "default", "cluster.local"),
            "demo-mesh.default.svc.cluster.local"
        );
        assert_eq!(
            mesh_service_fqdn("m", "ns", "corp.example."),
            "m.ns.svc.corp.example"
        );
        assert_eq!(
            mesh_service_fqdn("m.other.svc.cluster.local.", "ns", "cluster.local"),
            "m.other.svc.cluster.local"
        );
    }

    #[test]
    fn ids() {
        assert!(validate_node_id("demo-proxy-0").is_ok());
        assert!(validate_cluster_id("a.b_c-D9").is_ok());
        assert!(validate_cluster_id(&"a".repeat(253)).is_ok());
        assert_eq!(
            validate_cluster_id(&"a".repeat(254))
                .unwrap_err()
                .to_string(),
            "cluster id is 254 characters long; expected at most 253"
        );
        assert_eq!(
            validate_node_id("").unwrap_err().to_string(),
            "node id is empty; expected 1 to 253 characters of A-Z, a-z, 0-9, '.', '_' or '-'"
        );
        assert_eq!(
            validate_node_id("my node").unwrap_err().to_string(),
            "node id \"my node\" contains ' '; expected only A-Z, a-z, 0-9, '.', '_' or '-' (1 to 253 characters)"
        );
        assert!(matches!(
            validate_node_id("nöde"),
            Err(IdError::InvalidChar { found: 'ö', .. })
        ));
        assert!(validate_node_id("a/b").is_err());
    }

    #[test]
    fn seeds() {
        assert_eq!(normalize_seed("h", 7946).unwrap(), "h:7946");
        assert_eq!(
            normalize_seed(" h.ns.svc:7000 ", 7946).unwrap(),
            "h.ns.svc:7000"
        );
        assert_eq!(normalize_seed("10.0.0.1", 7946).unwrap(), "10.0.0.1:7946");
        assert_eq!(normalize_seed("10.0.0.1:1", 7946).unwrap(), "10.0.0.1:1");
        assert_eq!(normalize_seed("::1", 7946).unwrap(), "[::1]:7946");
        assert_eq!(normalize_seed("[fd00::5]", 7946).unwrap(), "[fd00::5]:7946");
        assert_eq!(normalize_seed("[fd00::5]:9", 7946).unwrap(), "[fd00::5]:9");
        assert_eq!(normalize_seed("host.", 1).unwrap(), "host.:1");

        assert!(matches!(
            normalize_seed("", 1),
            Err(AddrError::Empty { .. })
        ));
        assert!(matches!(
            normalize_seed("udp://h:1", 1),
            Err(AddrError::Scheme { .. })
        ));
        assert!(matches!(
            normalize_seed("h:0", 1),
            Err(AddrError::Port { .. })
        ));
        assert!(matches!(
            normalize_seed("h:70000", 1),
            Err(AddrError::Port { .. })
        ));
        assert!(matches!(
            normalize_seed("h:", 1),
            Err(AddrError::Port { .. })
        ));
        assert!(matches!(
            normalize_seed("10.0.0.1:0", 1),
            Err(AddrError::Port { .. })
        ));
        assert!(matches!(
            normalize_seed("a b:1", 1),
            Err(AddrError::Host { .. })
        ));
        assert!(matches!(
            normalize_seed("a..b", 1),
            Err(AddrError::Host { .. })
        ));
        assert!(matches!(
            normalize_seed("fd00::5:x", 1),
            Err(AddrError::Host { .. })
        ));
        assert_eq!(
            normalize_seed("h:x", 1).unwrap_err().to_string(),
            "\"h:x\" has port \"x\"; expected a number from 1 to 65535"
        );
    }

    #[test]
    fn advertise() {
        assert_eq!(
            parse_advertise("10.0.0.5", 7946).unwrap(),
            "10.0.0.5:7946".parse().unwrap()
        );
        assert_eq!(
            parse_advertise("10.0.0.5:8000", 7946).unwrap(),
            "10.0.0.5:8000".parse().unwrap()
        );
        assert_eq!(
            parse_advertise("fd00::5", 7946).unwrap(),
            "[fd00::5]:7946".parse().unwrap()
        );
        assert_eq!(
            parse_advertise("[fd00::5]", 7946).unwrap(),
            "[fd00::5]:7946".parse().unwrap()
        );
        assert_eq!(
            parse_advertise("[fd00::5]:1", 7946).unwrap(),
            "[fd00::5]:1".parse().unwrap()
        );
        assert!(matches!(
            parse_advertise("", 1),
            Err(AddrError::Empty { .. })
        ));
        assert!(matches!(
            parse_advertise("pod.local", 1),
            Err(AddrError::NotIp { .. })
        ));
        assert!(matches!(
            parse_advertise("10.0.0.5:x", 1),
            Err(AddrError::Port { .. })
        ));
        assert!(matches!(
            parse_advertise("10.0.0.5:0", 1),
            Err(AddrError::Port { .. })
        ));
        assert!(matches!(
            parse_advertise("0.0.0.0", 1),
            Err(AddrError::Unspecified { .. })
        ));
        assert!(matches!(
            parse_advertise("[::]:5", 1),
            Err(AddrError::Unspecified { .. })
        ));
        assert_eq!(
            parse_advertise("pod.local", 1).unwrap_err().to_string(),
            "\"pod.local\" is not an IP address; expected ip or ip:port ([ipv6]:port for IPv6)"
        );
    }
}
