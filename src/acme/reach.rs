//! Before the CA is told to validate: will its HTTP-01 request find an
//! answer? (docs/reference.md#the-challenge-check)
//!
//! A CA that finds no answer records a failed validation (Let's Encrypt
//! limits those per account and hostname per hour) and the order backs off
//! (SPEC 5: a minute, doubling). On a fresh deploy that is the rule, not the
//! exception: the Service in front of the replicas has no ready endpoint
//! for the first seconds. So an order first publishes a *probe* token for
//! each of its names, exactly as a real one (the store, with an expiry),
//! and fetches it where the CA's request lands, as reached from this pod:
//! `--acme-check-url`, which the operator sets to the SBProxy's Service.
//! Only an answer with the probe's key authorization lets the order go on;
//! anything else ends the attempt as [`Unanswered`], which the scheduler
//! waits out with a short, capped delay (no failure, no back-off, nothing
//! sent to the CA), and `status` and `sbmesh_acme_orders_waiting` say why.
//!
//! Unlike a self-check at the public name (cert-manager's), this works in
//! a cluster whose load balancer does not hairpin: it goes through the
//! Service (kube-proxy), so it proves the part that changes under a deploy
//! (a ready endpoint, its challenge listener, the shared store) and not
//! the DNS and load balancer in front, which the CA alone can see.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use base64::Engine;
use bytes::Bytes;
use http_body_util::{BodyExt, Empty, Limited};
use hyper::Request;
use hyper::header;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

use crate::acme::challenge::{CHALLENGE_PATH_PREFIX, ChallengeBook};
use crate::acme::http_client::error_chain;
use crate::http::passthrough::Upstream;
use crate::metrics::Metrics;

/// How long a probe token lives in the store should its withdrawal fail.
const PROBE_TTL: Duration = Duration::from_secs(60);

/// The whole probe request: connect, answer and body.
const PROBE_TIMEOUT: Duration = Duration::from_secs(5);

/// A key authorization is small; a larger body is not one.
const MAX_ANSWER_BYTES: usize = 4096;

/// Why a probe token was not answered where the CA's request lands.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Unanswered {
    /// No HTTP answer: refused, timed out, not resolved (no ready endpoint
    /// behind the Service, or no route to it).
    Unreachable {
        /// The name whose probe was fetched.
        host: String,
        /// Where.
        target: String,
        /// What failed, with its causes.
        error: String,
    },
    /// An answer, but not the probe's key authorization (another listener
    /// on that port, a replica without the shared store).
    WrongAnswer {
        /// The name whose probe was fetched.
        host: String,
        /// Where.
        target: String,
        /// The answer's status.
        status: u16,
    },
    /// The probe could not be published to the store.
    Store {
        /// What the store said.
        error: String,
    },
}

impl Unanswered {
    /// The label of `sbmesh_acme_challenge_checks_total`.
    pub(crate) fn result(&self) -> &'static str {
        match self {
            Unanswered::Unreachable { .. } => "unreachable",
            Unanswered::WrongAnswer { .. } => "wrong_answer",
            Unanswered::Store { .. } => "store",
        }
    }
}

impl fmt::Display for Unanswered {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Unanswered::Unreachable {
                host,
                target,
                error,
            } => write!(
                f,
                "the challenge for {host} is not answered at {target} ({error}): no ready \
                 replica behind it yet, or no route to it; the order waits instead of letting \
                 the CA fail the validation"
            ),
            Unanswered::WrongAnswer {
                host,
                target,
                status,
            } => write!(
                f,
                "the challenge for {host} is answered at {target} with status {status}, not with \
                 its key authorization: the replicas behind it must run the sidecar's challenge \
                 listener on the shared store; the order waits instead of letting the CA fail \
                 the validation"
            ),
            Unanswered::Store { error } => {
                write!(f, "the challenge probe cannot be published: {error}")
            }
        }
    }
}

/// Fetches probe tokens where the CA's request lands (module docs).
pub(crate) struct ReachCheck {
    target: Upstream,
    client: Client<HttpConnector, Empty<Bytes>>,
    metrics: Arc<Metrics>,
}

impl fmt::Debug for ReachCheck {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ReachCheck")
            .field("target", &self.target)
            .finish_non_exhaustive()
    }
}

impl ReachCheck {
    /// Checks at `target`, counting in `metrics`.
    pub(crate) fn new(target: Upstream, metrics: Arc<Metrics>) -> Self {
        let mut connector = HttpConnector::new();
        connector.set_connect_timeout(Some(PROBE_TIMEOUT));
        // One fresh connection per probe: kube-proxy picks an endpoint per
        // connection, and a kept one would always ask the same replica.
        let client = Client::builder(TokioExecutor::new())
            .pool_max_idle_per_host(0)
            .build(connector);
        Self {
            target,
            client,
            metrics,
        }
    }

    /// Publishes a probe token for each of `hosts` through `book` and
    /// fetches it at the target with that `Host`; `Ok` once every one was
    /// answered with its key authorization. Probes are withdrawn whatever
    /// the outcome.
    pub(crate) async fn check(
        &self,
        book: &ChallengeBook,
        hosts: &[String],
    ) -> Result<(), Unanswered> {
        for host in hosts {
            let result = self.probe(book, host).await;
            let label = match &result {
                Ok(()) => "answered",
                Err(e) => e.result(),
            };
            self.metrics.acme.challenge_check(label);
            result?;
        }
        Ok(())
    }

    async fn probe(&self, book: &ChallengeBook, host: &str) -> Result<(), Unanswered> {
        let token = format!("sbmesh-check-{}", random_b64(16));
        let key_authorization = format!("{token}.{}", random_b64(32));
        book.publish(&token, host, &key_authorization, PROBE_TTL)
            .await
            .map_err(|e| Unanswered::Store {
                error: e.to_string(),
            })?;
        let answer = tokio::time::timeout(PROBE_TIMEOUT, self.fetch(host, &token)).await;
        book.withdraw(&token).await;
        let target = self.target.to_string();
        let unreachable = |error: String| Unanswered::Unreachable {
            host: host.to_owned(),
            target: target.clone(),
            error,
        };
        match answer {
            Err(_) => Err(unreachable(format!(
                "no answer within {} s",
                PROBE_TIMEOUT.as_secs()
            ))),
            Ok(Err(error)) => Err(unreachable(error)),
            Ok(Ok((200, body))) if body == key_authorization.as_bytes() => Ok(()),
            Ok(Ok((status, _))) => Err(Unanswered::WrongAnswer {
                host: host.to_owned(),
                target,
                status,
            }),
        }
    }

    /// `GET <target>/.well-known/acme-challenge/<token>` with `Host: host`:
    /// the status and (bounded) body, or the transport error's chain.
    async fn fetch(&self, host: &str, token: &str) -> Result<(u16, Bytes), String> {
        let uri = format!("{}{CHALLENGE_PATH_PREFIX}{token}", self.target);
        let request = Request::get(uri)
            .header(header::HOST, host)
            .header(
                header::USER_AGENT,
                concat!("sbmesh/", env!("CARGO_PKG_VERSION")),
            )
            .body(Empty::new())
            .map_err(|e| e.to_string())?;
        let response = self
            .client
            .request(request)
            .await
            .map_err(|e| error_chain(&e))?;
        let status = response.status().as_u16();
        let body = Limited::new(response.into_body(), MAX_ANSWER_BYTES)
            .collect()
            .await
            .map_err(|e| e.to_string())?
            .to_bytes();
        Ok((status, body))
    }
}

/// `n` random bytes, base64url without padding: token characters.
fn random_b64(n: usize) -> String {
    let bytes: Vec<u8> = (0..n).map(|_| rand::random::<u8>()).collect();
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes)
}
