//! The `rfc2136` provider: one TXT value added or removed by a dynamic
//! update (RFC 2136) to the zone's primary, signed with the TSIG key of
//! `dns01` when there is one. The zone is the one the primary itself says
//! holds the name (the owner of the SOA it returns), so a zone the server
//! does not serve is said as such before any update is sent.

use std::net::SocketAddr;

use hickory_proto::op::ResponseCode;
use hickory_proto::rr::{Name, RecordType};

use super::DnsError;
use super::Env;
use super::transport::exchange;
use super::wire::{self, Change, TsigKey, rcode_name};
use crate::config::{DNS_PORT, Dns01Section, TsigAlgorithm, resolve_field};
use crate::identity::normalize_seed;

pub(super) struct Rfc2136 {
    /// `host` or `host:port`, as written.
    nameserver: String,
    key: Option<KeySource>,
}

/// The TSIG key as configured: its secret is read where `tsig_secret`
/// says at each update, so a rotated Secret applies at once.
struct KeySource {
    name: Name,
    algorithm: TsigAlgorithm,
    /// `env:NAME`, `file:PATH` or the base64 itself.
    secret: String,
    env: Env,
}

impl KeySource {
    fn key(&self) -> Result<TsigKey, DnsError> {
        let path = "proxy.extensions.sbmesh.acme.dns01.tsig_secret";
        let text = resolve_field(path, &self.secret, &self.env, &|p| {
            std::fs::read_to_string(p)
        })
        .map_err(|p| DnsError::Config(p.to_string()))?;
        let secret = crate::config::tsig_secret_bytes(&text).map_err(|e| {
            DnsError::Config(format!(
                "{path}: not base64 ({e}); expected the key's secret as BIND's tsig-keygen \
                 prints it"
            ))
        })?;
        Ok(TsigKey {
            name: self.name.clone(),
            algorithm: self.algorithm,
            secret,
        })
    }
}

impl Rfc2136 {
    /// The provider of `section`; its secret is read once here, so a
    /// missing one is said before any order.
    pub(super) fn new(section: &Dns01Section, env: Env) -> Result<Self, DnsError> {
        let nameserver = section.nameserver.clone().ok_or_else(|| {
            DnsError::Config("provider rfc2136 needs dns01.nameserver".to_owned())
        })?;
        let key = match (&section.tsig_key_name, &section.tsig_secret) {
            (Some(name), Some(secret)) => {
                let mut name = Name::from_ascii(name)
                    .map_err(|e| DnsError::Config(format!("dns01.tsig_key_name {name:?}: {e}")))?;
                name.set_fqdn(true);
                let source = KeySource {
                    name,
                    algorithm: section.tsig_algorithm,
                    secret: secret.clone(),
                    env,
                };
                source.key()?;
                Some(source)
            }
            _ => None,
        };
        Ok(Self { nameserver, key })
    }

    /// The primary's address (its name looked up each time: a Service
    /// that moved is followed).
    async fn server(&self) -> Result<SocketAddr, DnsError> {
        let ns = self.nameserver.as_str();
        // The form the configuration checked (`host:port`, `[v6]:port`).
        let target = normalize_seed(ns, DNS_PORT)
            .map_err(|e| DnsError::Config(format!("dns01.nameserver: {e}")))?;
        if let Ok(addr) = target.parse::<SocketAddr>() {
            return Ok(addr);
        }
        let mut found =
            tokio::net::lookup_host(&target)
                .await
                .map_err(|e| DnsError::Unreachable {
                    server: ns.to_owned(),
                    op: "look up the nameserver's address",
                    detail: e.to_string(),
                })?;
        found.next().ok_or_else(|| DnsError::Unreachable {
            server: ns.to_owned(),
            op: "look up the nameserver's address",
            detail: "no address".to_owned(),
        })
    }

    /// The zone `server` serves that holds `fqdn`.
    async fn zone(&self, server: SocketAddr, fqdn: &Name) -> Result<Name, DnsError> {
        let question = wire::query(rand::random(), fqdn, RecordType::SOA, false);
        let answer = exchange(server, &question)
            .await
            .map_err(|e| DnsError::Unreachable {
                server: server.to_string(),
                op: "find the zone of the record",
                detail: e.to_string(),
            })?;
        let rcode = answer.metadata.response_code;
        let no_zone = |detail: String| DnsError::NoZone {
            server: server.to_string(),
            fqdn: fqdn.to_string(),
            detail,
        };
        if !matches!(rcode, ResponseCode::NoError | ResponseCode::NXDomain) {
            return Err(no_zone(format!("it answers {}", rcode_name(rcode))));
        }
        if !answer.metadata.authoritative {
            return Err(no_zone("its answer is not authoritative".to_owned()));
        }
        wire::soa_owner(&answer).ok_or_else(|| no_zone("it returns no SOA record".to_owned()))
    }

    /// Adds (`add`) or removes the TXT `value` at `fqdn`.
    pub(super) async fn change(&self, fqdn: &Name, value: &str, add: bool) -> Result<(), DnsError> {
        let server = self.server().await?;
        let zone = self.zone(server, fqdn).await?;
        let (change, op) = if add {
            (Change::Add, "add")
        } else {
            (Change::Remove, "remove")
        };
        let mut message =
            wire::update(rand::random(), &zone, fqdn, value, change).ok_or_else(|| {
                DnsError::NoZone {
                    server: server.to_string(),
                    fqdn: fqdn.to_string(),
                    detail: format!("it names the zone {zone}"),
                }
            })?;
        if let Some(source) = &self.key {
            let now = crate::store::now_unix_ms() / 1000;
            wire::sign(&mut message, &source.key()?, now).map_err(|e| {
                DnsError::Config(format!("cannot sign the update with the TSIG key: {e}"))
            })?;
        }
        let answer = exchange(server, &message)
            .await
            .map_err(|e| DnsError::Unreachable {
                server: server.to_string(),
                op: if add {
                    "add the TXT record"
                } else {
                    "remove the TXT record"
                },
                detail: e.to_string(),
            })?;
        wire::update_result(&answer).map_err(|refusal| DnsError::Refused {
            server: server.to_string(),
            op,
            fqdn: fqdn.to_string(),
            why: refusal.explain(),
        })
    }
}
