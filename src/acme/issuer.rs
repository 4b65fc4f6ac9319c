//! One ACME order, start to finish: new order, HTTP-01 challenges
//! published to the shared store *before* the CA is told to validate
//! (so any replica can answer), polling, finalization with a fresh
//! ECDSA P-256 key, and the certificate chain.
//!
//! The [`Issuer`] decides nothing about *what* to order or *when*: the
//! caller holds the hostname's order lease and passes its "still held"
//! signal, and an order stops as soon as that flips (someone else may be
//! ordering the same hostnames now). Tokens are withdrawn from the store
//! at the end of every order, successful or not (and, should the caller
//! drop the order future, by a background task; they expire anyway).
//!
//! Every order runs inside its own [`RetryAfterCapture`] scope, so an
//! [`AcmeError`] carries the `Retry-After` the CA sent with the response
//! that caused it, even though all orders share one account and client.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use instant_acme::{
    AuthorizationHandle, AuthorizationStatus, CertificateIdentifier, ChallengeType, Identifier,
    NewOrder, Order, OrderStatus, RetryPolicy,
};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, Der};
use tokio::sync::watch;
use x509_parser::extensions::ParsedExtension;

use super::account::one_line;
pub use super::account::{AcmeAccount, AcmeError};
use super::challenge::ChallengeBook;
use super::dns01::Dns01Order;
use super::http_client::RetryAfterCapture;

/// How long a published key authorization lives in the store: longer than
/// any order takes, short enough that a crashed replica's tokens vanish.
pub(crate) const CHALLENGE_TTL: Duration = Duration::from_secs(600);

/// The default polling of an order: first look after 100 ms (a CA that
/// validates at once is seen at once), then 1.5x longer each time, for at
/// most 2 minutes. A `Retry-After` from the CA replaces the computed delay.
pub(crate) const DEFAULT_POLL: RetryPolicy = RetryPolicy::new()
    .initial_delay(Duration::from_millis(100))
    .backoff(1.5)
    .timeout(Duration::from_secs(120));

/// How an order proves its names to the CA.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Proof<'a> {
    /// HTTP-01: key authorizations published to the shared challenge book,
    /// answered by whichever replica the CA reaches.
    Http01,
    /// DNS-01: TXT records written by this replica (the lock holder)
    /// through the `dns01` provider, noted in the unit's ledger.
    Dns01(&'a Dns01Order<'a>),
}

/// A certificate just issued.
#[derive(Clone, PartialEq, Eq)]
pub struct Issued {
    /// The identifiers ordered (lowercase, deduplicated, in order).
    pub hosts: Vec<String>,
    /// Leaf first, then the intermediates, PEM.
    pub chain_pem: String,
    /// The leaf's private key: ECDSA P-256, PKCS#8 PEM.
    pub key_pem: String,
    /// The order URL at the CA (for logs).
    pub order_url: String,
}

impl fmt::Debug for Issued {
    // Never print the private key.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Issued")
            .field("hosts", &self.hosts)
            .field("order_url", &self.order_url)
            .finish_non_exhaustive()
    }
}

/// The CA's suggested renewal window for a certificate (ARI, RFC 9773).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RenewalWindow {
    /// Start of the window, unix seconds.
    pub start_unix: u64,
    /// End of the window, unix seconds.
    pub end_unix: u64,
    /// When to ask the CA again (its `Retry-After`).
    pub check_again_after: Duration,
    /// The CA's explanation of the window, when it changed it.
    pub explanation_url: Option<String>,
}

/// Orders certificates through the cluster's account, publishing HTTP-01
/// challenges to a [`ChallengeBook`] that every replica answers from.
/// Orders may run concurrently.
pub struct Issuer {
    account: AcmeAccount,
    book: Arc<ChallengeBook>,
    node_id: String,
    poll: RetryPolicy,
    challenge_ttl: Duration,
}

impl fmt::Debug for Issuer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Issuer")
            .field("account", &self.account)
            .field("node_id", &self.node_id)
            .finish_non_exhaustive()
    }
}

impl Issuer {
    /// An issuer ordering through `account` and publishing challenges to
    /// `book`; `node_id` names this replica in logs.
    pub fn new(account: AcmeAccount, book: Arc<ChallengeBook>, node_id: impl Into<String>) -> Self {
        Self {
            account,
            book,
            node_id: node_id.into(),
            poll: DEFAULT_POLL,
            challenge_ttl: CHALLENGE_TTL,
        }
    }

    /// Whether the CA offers ACME Renewal Information (its directory has
    /// `renewalInfo`).
    pub fn offers_ari(&self) -> bool {
        self.account.offers_ari()
    }

    /// Orders one certificate for `hosts` (DNS names; wildcards are
    /// refused: HTTP-01 cannot prove them).
    ///
    /// `lease_held` is the caller's "I still hold the order lease" signal
    /// (e.g. [`crate::store::lock::LeaseKeeper::held`]); when it turns
    /// `false`, or its sender is dropped, the order is abandoned with
    /// [`AcmeError::LeaseLost`].
    pub async fn order(
        &self,
        hosts: &[String],
        lease_held: Option<watch::Receiver<bool>>,
    ) -> Result<Issued, AcmeError> {
        self.order_replacing(hosts, lease_held, None, Proof::Http01)
            .await
    }

    /// [`Issuer::order`] for a renewal: `replaces` names the certificate
    /// it replaces ([`certificate_identifier`] of the old leaf), sent as
    /// the ARI `replaces` field when the CA offers renewal information
    /// (and left out when it does not: the CA would refuse the order).
    /// `proof` is how the names are proven: HTTP-01 through the book, or
    /// DNS-01 (wildcards then allowed).
    pub(crate) async fn order_replacing(
        &self,
        hosts: &[String],
        lease_held: Option<watch::Receiver<bool>>,
        replaces: Option<CertificateIdentifier<'static>>,
        proof: Proof<'_>,
    ) -> Result<Issued, AcmeError> {
        let hosts = normalize_hosts(hosts, matches!(proof, Proof::Dns01(_)))?;
        let replaces = replaces.filter(|_| self.offers_ari());
        let capture = RetryAfterCapture::new();
        let mut tokens = Tokens::new(Arc::clone(&self.book));
        let started = tokio::time::Instant::now();
        let result = {
            let work = capture.scope(self.run(&hosts, replaces, &mut tokens, &capture, proof));
            match lease_held {
                None => work.await,
                Some(mut held) => {
                    tokio::select! {
                        biased;
                        // Err: the sender is gone, nobody renews the lease.
                        _ = held.wait_for(|held| !*held) => Err(AcmeError::LeaseLost {
                            hosts: hosts.clone(),
                        }),
                        result = work => result,
                    }
                }
            }
        };
        tokens.withdraw_all().await;
        if let Proof::Dns01(dns) = proof {
            // Ours to remove whatever happened, a lost lease included.
            dns.cleanup_all().await;
        }
        match &result {
            Ok(issued) => tracing::info!(
                node = %self.node_id,
                hosts = ?hosts,
                order = %issued.order_url,
                elapsed_ms = started.elapsed().as_millis() as u64,
                "certificate issued"
            ),
            // The caller reports failures (the manager summarises them,
            // so a CA that is down does not write a line per hostname).
            Err(e) => tracing::debug!(
                node = %self.node_id,
                hosts = ?hosts,
                error = %one_line(&e.to_string()),
                retry_after = ?e.retry_after(),
                "ACME order failed"
            ),
        }
        result
    }

    async fn run(
        &self,
        hosts: &[String],
        replaces: Option<CertificateIdentifier<'static>>,
        tokens: &mut Tokens,
        capture: &RetryAfterCapture,
        proof: Proof<'_>,
    ) -> Result<Issued, AcmeError> {
        let failed = |op: &'static str| move |e| AcmeError::from_acme(op, e, capture);
        let identifiers: Vec<Identifier> =
            hosts.iter().map(|h| Identifier::Dns(h.clone())).collect();
        let mut order = self
            .account
            .account()
            .new_order(&new_order(&identifiers, replaces))
            .await
            .map_err(failed("create the order"))?;

        // DNS-01: the names to prove and their values, written once all
        // are known (a wildcard and its apex share one name).
        let mut dns_values: Vec<(String, String)> = Vec::new();
        let mut authorizations = order.authorizations();
        while let Some(next) = authorizations.next().await {
            let mut authz = next.map_err(failed("fetch an authorization"))?;
            let (host, wildcard) = authorized_host(&authz)?;
            match authz.status {
                AuthorizationStatus::Pending => {}
                AuthorizationStatus::Valid => continue,
                status => {
                    return Err(AcmeError::Protocol {
                        op: "fetch an authorization",
                        message: format!("the authorization for {host} is already {status:?}"),
                    });
                }
            }
            let kind = match proof {
                Proof::Http01 => ChallengeType::Http01,
                Proof::Dns01(_) => ChallengeType::Dns01,
            };
            let Some(mut challenge) = authz.challenge(kind.clone()) else {
                return Err(AcmeError::Protocol {
                    op: "fetch an authorization",
                    message: format!("the CA offers no {} challenge for {host}", kind_name(&kind)),
                });
            };
            if let Proof::Dns01(_) = proof {
                let name = if wildcard { format!("*.{host}") } else { host };
                dns_values.push((name, challenge.key_authorization().dns_value()));
                continue;
            }
            let key_authorization = challenge.key_authorization();
            let token = challenge.token.clone();
            // Store first: only a published token may be declared ready.
            self.book
                .publish(
                    &token,
                    &host,
                    key_authorization.as_str(),
                    self.challenge_ttl,
                )
                .await
                .map_err(|source| AcmeError::Store {
                    op: "publish the challenge",
                    source,
                })?;
            tokens.push(token);
            challenge
                .set_ready()
                .await
                .map_err(failed("mark the challenge ready"))?;
        }
        if let Proof::Dns01(dns) = proof
            && !dns_values.is_empty()
        {
            dns01_ready(&mut order, dns, dns_values, capture).await?;
        }

        match order.poll_ready(&self.poll).await {
            Ok(OrderStatus::Ready) => {}
            Ok(status) => {
                return Err(explain(&mut order, proof)
                    .await
                    .unwrap_or(AcmeError::Protocol {
                        op: "wait for validation",
                        message: format!("the order became {status:?} without a reason"),
                    }));
            }
            Err(e) => {
                let mapped = failed("wait for validation")(e);
                return Err(explain(&mut order, proof).await.unwrap_or(mapped));
            }
        }
        self.finish(&mut order, hosts, capture).await
    }

    /// Finalizes a ready order and downloads its certificate.
    async fn finish(
        &self,
        order: &mut Order,
        hosts: &[String],
        capture: &RetryAfterCapture,
    ) -> Result<Issued, AcmeError> {
        let failed = |op: &'static str| move |e| AcmeError::from_acme(op, e, capture);
        let key_pem = order
            .finalize()
            .await
            .map_err(failed("finalize the order"))?;
        // A CA that issues at once (Pebble, often Let's Encrypt) is read
        // without waiting for the first poll interval.
        let chain_pem = match order
            .certificate()
            .await
            .map_err(failed("download the certificate"))?
        {
            Some(chain) => chain,
            None => order
                .poll_certificate(&self.poll)
                .await
                .map_err(failed("download the certificate"))?,
        };
        Ok(Issued {
            hosts: hosts.to_vec(),
            chain_pem,
            key_pem,
            order_url: order.url().to_owned(),
        })
    }

    /// The CA's suggested renewal window for the leaf of `chain_pem`, as
    /// unix seconds; `None` when the CA offers no ARI, or the question
    /// failed (logged; the caller then uses its own schedule).
    pub async fn renewal_window(&self, chain_pem: &str) -> Option<(u64, u64)> {
        match self.renewal_info(chain_pem).await {
            Ok(window) => window.map(|w| (w.start_unix, w.end_unix)),
            Err(e) => {
                tracing::warn!(error = %e, "ACME renewal information unavailable");
                None
            }
        }
    }

    /// Asks the CA for the renewal window of the leaf of `chain_pem` (ARI);
    /// `Ok(None)` when the CA does not offer ARI.
    pub async fn renewal_info(&self, chain_pem: &str) -> Result<Option<RenewalWindow>, AcmeError> {
        if !self.offers_ari() {
            return Ok(None);
        }
        let id = certificate_identifier(chain_pem)?;
        let capture = RetryAfterCapture::new();
        let (info, check_again_after) = capture
            .scope(self.account.account().renewal_info(&id))
            .await
            .map_err(|e| AcmeError::from_acme("fetch renewal information", e, &capture))?;
        let unix = |t: i64| u64::try_from(t).unwrap_or(0);
        Ok(Some(RenewalWindow {
            start_unix: unix(info.suggested_window.start.unix_timestamp()),
            end_unix: unix(info.suggested_window.end.unix_timestamp()),
            check_again_after,
            explanation_url: info.explanation_url,
        }))
    }
}

/// The DNS name an authorization is for, and whether it is a wildcard's.
fn authorized_host(authz: &AuthorizationHandle<'_>) -> Result<(String, bool), AcmeError> {
    let id = authz.identifier();
    match id.identifier {
        Identifier::Dns(name) => Ok((name.clone(), id.wildcard)),
        other => Err(AcmeError::Protocol {
            op: "fetch an authorization",
            message: format!("the CA returned a non-DNS identifier {other:?}"),
        }),
    }
}

/// The protocol's name of a challenge type.
fn kind_name(kind: &ChallengeType) -> &'static str {
    match kind {
        ChallengeType::Http01 => "http-01",
        ChallengeType::Dns01 => "dns-01",
        _ => "other",
    }
}

/// DNS-01: every record written and served by every authoritative server
/// of its zone, then the CA told to look at each pending authorization.
async fn dns01_ready(
    order: &mut Order,
    dns: &Dns01Order<'_>,
    values: Vec<(String, String)>,
    capture: &RetryAfterCapture,
) -> Result<(), AcmeError> {
    let failed = |op: &'static str| move |e| AcmeError::from_acme(op, e, capture);
    dns.present_all(values).await?;
    let mut authorizations = order.authorizations();
    while let Some(next) = authorizations.next().await {
        let mut authz = next.map_err(failed("fetch an authorization"))?;
        if authz.status != AuthorizationStatus::Pending {
            continue;
        }
        if let Some(mut challenge) = authz.challenge(ChallengeType::Dns01) {
            challenge
                .set_ready()
                .await
                .map_err(failed("mark the challenge ready"))?;
        }
    }
    Ok(())
}

/// Why an order failed validation: the first challenge error the CA
/// reports, as [`AcmeError::Validation`] (HTTP-01) or
/// [`AcmeError::DnsValidation`].
async fn explain(order: &mut Order, proof: Proof<'_>) -> Option<AcmeError> {
    let dns = matches!(proof, Proof::Dns01(_));
    let validation = |host: String, problem_type: String, detail: String| {
        if dns {
            AcmeError::DnsValidation {
                host,
                problem_type,
                detail,
            }
        } else {
            AcmeError::Validation {
                host,
                problem_type,
                detail,
            }
        }
    };
    let mut authorizations = order.authorizations();
    while let Some(next) = authorizations.next().await {
        let Ok(mut authz) = next else { continue };
        let Ok(state) = authz.refresh().await else {
            continue;
        };
        let host = state.identifier().to_string();
        if let Some(problem) = state.challenges.iter().find_map(|c| c.error.as_ref()) {
            return Some(validation(
                host,
                problem
                    .r#type
                    .as_deref()
                    .map(|t| t.strip_prefix("urn:ietf:params:acme:error:").unwrap_or(t))
                    .unwrap_or("unknown")
                    .to_owned(),
                one_line(problem.detail.as_deref().unwrap_or_default()).into_owned(),
            ));
        }
        if state.status == AuthorizationStatus::Invalid {
            return Some(validation(
                host,
                "unknown".to_owned(),
                "the CA marked the authorization invalid without a challenge error".to_owned(),
            ));
        }
    }
    None
}

/// The newOrder request for `identifiers`, naming the certificate it
/// replaces (ARI) when there is one.
fn new_order<'a>(
    identifiers: &'a [Identifier],
    replaces: Option<CertificateIdentifier<'a>>,
) -> NewOrder<'a> {
    let order = NewOrder::new(identifiers);
    match replaces {
        Some(id) => order.replaces(id),
        None => order,
    }
}

/// Lowercase, trimmed, deduplicated (first occurrence kept); empty names
/// refused, and wildcards unless `wildcards` (DNS-01 proves them).
fn normalize_hosts(hosts: &[String], wildcards: bool) -> Result<Vec<String>, AcmeError> {
    let mut out: Vec<String> = Vec::with_capacity(hosts.len());
    for host in hosts {
        let host = host.trim().trim_end_matches('.').to_ascii_lowercase();
        if host.is_empty() {
            return Err(AcmeError::Config(
                "an empty hostname cannot be ordered".to_owned(),
            ));
        }
        if host.contains('*')
            && !(wildcards && crate::config::hostname::normalize_wildcard(&host).is_ok())
        {
            return Err(AcmeError::Config(format!(
                "{host} is a wildcard: HTTP-01 cannot prove it, so it is never ordered"
            )));
        }
        if !out.contains(&host) {
            out.push(host);
        }
    }
    if out.is_empty() {
        return Err(AcmeError::Config(
            "an order needs at least one hostname".to_owned(),
        ));
    }
    Ok(out)
}

/// The ARI identifier (authority key id + serial) of the leaf of `chain_pem`.
pub fn certificate_identifier(
    chain_pem: &str,
) -> Result<CertificateIdentifier<'static>, AcmeError> {
    let bad = |message: String| AcmeError::Protocol {
        op: "identify the certificate for renewal information",
        message,
    };
    let leaf = CertificateDer::pem_slice_iter(chain_pem.as_bytes())
        .next()
        .ok_or_else(|| bad("the chain holds no PEM certificate".to_owned()))?
        .map_err(|e| bad(format!("the chain is not valid PEM: {e}")))?;
    let (_, cert) = x509_parser::parse_x509_certificate(leaf.as_ref())
        .map_err(|e| bad(format!("the leaf does not parse: {e}")))?;
    let aki = cert
        .iter_extensions()
        .find_map(|ext| match ext.parsed_extension() {
            ParsedExtension::AuthorityKeyIdentifier(aki) => aki.key_identifier.as_ref(),
            _ => None,
        })
        .ok_or_else(|| bad("the leaf has no authority key identifier".to_owned()))?;
    Ok(CertificateIdentifier::new(
        Der::from_slice(aki.0),
        Der::from_slice(cert.tbs_certificate.raw_serial()),
    )
    .into_owned())
}

/// The tokens an order published, withdrawn when it ends.
struct Tokens {
    book: Arc<ChallengeBook>,
    tokens: Vec<String>,
}

impl Tokens {
    fn new(book: Arc<ChallengeBook>) -> Self {
        Self {
            book,
            tokens: Vec::new(),
        }
    }

    fn push(&mut self, token: String) {
        self.tokens.push(token);
    }

    async fn withdraw_all(&mut self) {
        for token in self.tokens.drain(..) {
            self.book.withdraw(&token).await;
        }
    }
}

impl Drop for Tokens {
    // The order future was dropped mid-way: withdraw in the background
    // (the records expire after the challenge TTL regardless).
    fn drop(&mut self) {
        if self.tokens.is_empty() {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let book = Arc::clone(&self.book);
        let tokens = std::mem::take(&mut self.tokens);
        runtime.spawn(async move {
            for token in tokens {
                book.withdraw(&token).await;
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A leaf with serial `0a0b` signed by a fresh CA, with the authority
    /// key identifier ARI needs.
    fn leaf_pem() -> String {
        use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair, SerialNumber};
        let ca_key = KeyPair::generate().unwrap();
        let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let issuer = Issuer::new(ca_params, ca_key);
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(vec!["a.example.com".to_owned()]).unwrap();
        params.serial_number = Some(SerialNumber::from_slice(&[0x0a, 0x0b]));
        params.use_authority_key_identifier_extension = true;
        params.signed_by(&key, &issuer).unwrap().pem()
    }

    #[test]
    fn a_renewal_order_names_the_certificate_it_replaces() {
        let identifiers = [Identifier::Dns("a.example.com".to_owned())];
        let id = certificate_identifier(&leaf_pem()).unwrap();
        let text = id.to_string();
        // RFC 9773: base64url(authority key id) "." base64url(serial).
        let (aki, serial) = text.split_once('.').expect("two parts");
        assert!(!aki.is_empty() && !aki.contains('='), "{text}");
        assert_eq!(serial, "Cgs", "the serial 0a0b, base64url");
        let body = serde_json::to_value(new_order(&identifiers, Some(id))).unwrap();
        assert_eq!(body["replaces"], serde_json::json!(text), "{body}");
        assert_eq!(body["identifiers"][0]["value"], "a.example.com");
        // A first order (or a CA without ARI): no field at all.
        let body = serde_json::to_value(new_order(&identifiers, None)).unwrap();
        assert!(body.get("replaces").is_none(), "{body}");
        // A placeholder (self-signed, no authority key id) has no ARI id.
        let (placeholder, _) =
            crate::acme::placeholder::generate(&["a.example.com".to_owned()], 1_800_000_000)
                .unwrap();
        assert!(certificate_identifier(&placeholder).is_err());
    }

    #[test]
    fn hosts_are_normalized() {
        let hosts = vec![
            "B.example.com.".to_owned(),
            " a.example.com".to_owned(),
            "b.example.com".to_owned(),
        ];
        assert_eq!(
            normalize_hosts(&hosts, false).unwrap(),
            vec!["b.example.com".to_owned(), "a.example.com".to_owned()]
        );
        assert!(matches!(
            normalize_hosts(&["*.example.com".to_owned()], false),
            Err(AcmeError::Config(_))
        ));
        assert_eq!(
            normalize_hosts(&["*.Example.com".to_owned()], true).unwrap(),
            vec!["*.example.com".to_owned()]
        );
        assert!(normalize_hosts(&["a.*.example.com".to_owned()], true).is_err());
        assert!(normalize_hosts(&[], false).is_err());
    }
}
