//! The questions DNS-01 asks before and after a TXT record is written:
//! where `_acme-challenge.<name>` really lives (its CNAMEs followed), the
//! zone that holds it, that zone's authoritative servers, and whether each
//! of them serves the values yet. Resolvers (`--acme-dns-resolvers`, else
//! `/etc/resolv.conf`) find the zone and its servers; the servers
//! themselves are asked whether they serve the record, as the CA will.

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use hickory_proto::op::{Message, ResponseCode};
use hickory_proto::rr::{Name, RecordType};
use tokio::time::Instant;

use super::DnsError;
use super::transport::exchange;
use super::wire::{self, rcode_name};
use crate::config::DNS_PORT;

/// Most CNAMEs followed from `_acme-challenge.<name>`.
const MAX_CNAME_HOPS: usize = 8;
/// The first pause between two rounds of the propagation check; doubled
/// each round up to [`MAX_PAUSE`].
const FIRST_PAUSE: Duration = Duration::from_millis(100);
const MAX_PAUSE: Duration = Duration::from_secs(2);
/// The resolver configuration read when no resolver is given.
const RESOLV_CONF: &str = "/etc/resolv.conf";

/// A random message id.
fn id() -> u16 {
    rand::random()
}

/// The recursive resolvers DNS-01 asks.
#[derive(Clone, Debug)]
pub(crate) struct Resolvers(Vec<SocketAddr>);

impl Resolvers {
    /// `given`, else the `nameserver` lines of `/etc/resolv.conf`.
    pub(crate) fn new(given: &[SocketAddr]) -> Result<Self, DnsError> {
        if !given.is_empty() {
            return Ok(Self(given.to_vec()));
        }
        let text = std::fs::read_to_string(RESOLV_CONF).map_err(|e| {
            DnsError::Config(format!(
                "no DNS resolver: --acme-dns-resolvers is not set and {RESOLV_CONF} cannot be \
                 read ({e})"
            ))
        })?;
        let found = resolv_conf(&text);
        if found.is_empty() {
            return Err(DnsError::Config(format!(
                "no DNS resolver: --acme-dns-resolvers is not set and {RESOLV_CONF} names no \
                 nameserver"
            )));
        }
        Ok(Self(found))
    }

    /// The answer of the first resolver that gives one (`NOERROR` or
    /// `NXDOMAIN`) to `name`'s records of `rtype`.
    async fn ask(&self, name: &Name, rtype: RecordType) -> Result<Message, DnsError> {
        let mut why = Vec::new();
        for server in &self.0 {
            match exchange(*server, &wire::query(id(), name, rtype, true)).await {
                Ok(answer)
                    if matches!(
                        answer.metadata.response_code,
                        ResponseCode::NoError | ResponseCode::NXDomain
                    ) =>
                {
                    return Ok(answer);
                }
                Ok(answer) => why.push(format!(
                    "{server}: {}",
                    rcode_name(answer.metadata.response_code)
                )),
                Err(e) => why.push(format!("{server}: {e}")),
            }
        }
        Err(DnsError::Lookup {
            name: name.to_string(),
            rtype: rtype.to_string(),
            detail: why.join("; "),
        })
    }

    /// Where the TXT record proving `host` goes: `_acme-challenge.<host>`
    /// (a wildcard's `*.` dropped), or where its CNAMEs lead.
    pub(crate) async fn challenge_name(&self, host: &str) -> Result<Name, DnsError> {
        let base = host.strip_prefix("*.").unwrap_or(host);
        let mut name = Name::from_ascii(format!("_acme-challenge.{base}."))
            .map_err(|e| DnsError::Config(format!("{host}: not a DNS name: {e}")))?;
        for _ in 0..MAX_CNAME_HOPS {
            let answer = self.ask(&name, RecordType::CNAME).await?;
            match wire::cname_target(&answer, &name) {
                Some(target) => name = target,
                None => return Ok(name),
            }
        }
        Err(DnsError::Lookup {
            name: format!("_acme-challenge.{base}."),
            rtype: "CNAME".to_owned(),
            detail: format!("more than {MAX_CNAME_HOPS} CNAMEs in a row (a loop?)"),
        })
    }

    /// The zone that holds `fqdn`: the owner of the SOA record the
    /// resolver returns with it.
    pub(crate) async fn zone_of(&self, fqdn: &Name) -> Result<Name, DnsError> {
        let answer = self.ask(fqdn, RecordType::SOA).await?;
        wire::soa_owner(&answer).ok_or_else(|| DnsError::Lookup {
            name: fqdn.to_string(),
            rtype: "SOA".to_owned(),
            detail: "no SOA record in the answer: the zone cannot be found".to_owned(),
        })
    }

    /// The authoritative servers of `zone`: each NS name with its
    /// addresses (glue, else asked for).
    pub(crate) async fn authorities(&self, zone: &Name) -> Result<Vec<Authority>, DnsError> {
        let answer = self.ask(zone, RecordType::NS).await?;
        let names = wire::ns_names(&answer);
        if names.is_empty() {
            return Err(DnsError::Lookup {
                name: zone.to_string(),
                rtype: "NS".to_owned(),
                detail: "the zone names no name server".to_owned(),
            });
        }
        let mut out = Vec::with_capacity(names.len());
        for ns in names {
            let mut ips = wire::addresses(&answer, &ns);
            if ips.is_empty() {
                for rtype in [RecordType::A, RecordType::AAAA] {
                    if let Ok(a) = self.ask(&ns, rtype).await {
                        ips.extend(wire::addresses(&a, &ns));
                    }
                }
            }
            if ips.is_empty() {
                return Err(DnsError::Lookup {
                    name: ns.to_string(),
                    rtype: "A/AAAA".to_owned(),
                    detail: format!("the name server of {zone} has no address"),
                });
            }
            out.push(Authority { name: ns, ips });
        }
        Ok(out)
    }
}

/// One authoritative server of a zone.
#[derive(Clone, Debug)]
pub(crate) struct Authority {
    pub(crate) name: Name,
    pub(crate) ips: Vec<IpAddr>,
}

/// The `nameserver` addresses of a resolv.conf text.
fn resolv_conf(text: &str) -> Vec<SocketAddr> {
    text.lines()
        .filter_map(|line| {
            let mut words = line.split_whitespace();
            (words.next()? == "nameserver").then(|| words.next())?
        })
        .filter_map(|ip| {
            // A zone index (fe80::1%eth0) is not ours to resolve.
            ip.parse::<IpAddr>().ok()
        })
        .map(|ip| SocketAddr::new(ip, DNS_PORT))
        .collect()
}

/// Waits until every address of every server in `authorities` serves each
/// of `values` at `fqdn`, asking each without recursion until it does;
/// `Err` naming the servers that do not yet when `timeout` passes.
pub(crate) async fn wait_served(
    authorities: &[Authority],
    fqdn: &Name,
    values: &[String],
    timeout: Duration,
) -> Result<(), DnsError> {
    let deadline = Instant::now() + timeout;
    let mut pending: Vec<(String, SocketAddr)> = authorities
        .iter()
        .flat_map(|a| {
            a.ips
                .iter()
                .map(|ip| (a.name.to_string(), SocketAddr::new(*ip, DNS_PORT)))
        })
        .collect();
    let mut last: Vec<String> = Vec::new();
    let mut pause = FIRST_PAUSE;
    loop {
        last.clear();
        let mut still = Vec::new();
        for (name, server) in pending {
            let question = wire::query(id(), fqdn, RecordType::TXT, false);
            let seen = match exchange(server, &question).await {
                Ok(answer) => {
                    let served = wire::txt_values(&answer, fqdn);
                    if values.iter().all(|v| served.contains(v)) {
                        continue;
                    }
                    format!(
                        "{} TXT values, {} of them ours",
                        served.len(),
                        values.iter().filter(|v| served.contains(v)).count()
                    )
                }
                Err(e) => e.to_string(),
            };
            last.push(format!("{name} ({server}): {seen}"));
            still.push((name, server));
        }
        pending = still;
        if pending.is_empty() {
            return Ok(());
        }
        if Instant::now() + pause > deadline {
            return Err(DnsError::NotPropagated {
                fqdn: fqdn.to_string(),
                timeout,
                pending: last.join("; "),
            });
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(MAX_PAUSE);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resolv_conf_names_its_nameservers() {
        let text = "# generated\nsearch svc.cluster.local\nnameserver 10.96.0.10\n\
                    nameserver  fd00::a\nnameserver fe80::1%eth0\noptions ndots:5\n";
        assert_eq!(
            resolv_conf(text),
            vec![
                "10.96.0.10:53".parse::<SocketAddr>().unwrap(),
                "[fd00::a]:53".parse().unwrap()
            ]
        );
    }
}
