//! The reload POST to the proxy's admin API, mapped to a [`PostOutcome`].

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty, Limited};
use hyper::header::{AUTHORIZATION, CONTENT_LENGTH, HeaderValue};
use hyper::{Method, Request, StatusCode, Uri};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

use super::ReloadError;
use super::machine::PostOutcome;

/// How much of an error answer's body is kept for the log.
const MAX_ERROR_BODY: usize = 4 * 1024;

/// POSTs reloads to one URL with one `Authorization` header.
#[derive(Clone, Debug)]
pub(crate) struct Poster {
    client: Client<HttpConnector, Empty<Bytes>>,
    url: Uri,
    authorization: Option<HeaderValue>,
    timeout: Duration,
}

impl Poster {
    /// A poster for `url` (plain `http://`: the proxy's admin API is on
    /// loopback), sending `authorization` as the full header value.
    pub(crate) fn new(
        url: &str,
        authorization: Option<&str>,
        timeout: Duration,
    ) -> Result<Self, ReloadError> {
        let url: Uri = url.parse().map_err(|e| ReloadError::InvalidUrl {
            url: url.to_string(),
            reason: format!("{e}"),
        })?;
        if url.scheme_str() != Some("http") || url.host().is_none() {
            return Err(ReloadError::InvalidUrl {
                url: url.to_string(),
                reason: "expected http://host:port/path".into(),
            });
        }
        let authorization = authorization
            .map(|value| {
                let mut value =
                    HeaderValue::from_str(value).map_err(|_| ReloadError::InvalidAuthorization)?;
                value.set_sensitive(true);
                Ok::<_, ReloadError>(value)
            })
            .transpose()?;
        let client = Client::builder(TokioExecutor::new()).build_http();
        Ok(Self {
            client,
            url,
            authorization,
            timeout,
        })
    }

    /// Sends one POST and waits for the answer (within the timeout).
    pub(crate) async fn post(&self) -> PostOutcome {
        let mut request = Request::builder()
            .method(Method::POST)
            .uri(self.url.clone())
            .header(CONTENT_LENGTH, "0");
        if let Some(value) = &self.authorization {
            request = request.header(AUTHORIZATION, value.clone());
        }
        let request = match request.body(Empty::new()) {
            Ok(request) => request,
            Err(e) => {
                tracing::warn!(error = %e, "reload: cannot build the request");
                return PostOutcome::Failed { status: None };
            }
        };
        let exchange = async {
            let response = self.client.request(request).await?;
            let status = response.status();
            let body = if status.is_success() {
                Bytes::new()
            } else {
                // The reason is only logged; a body that is too large or
                // broken just goes unlogged.
                Limited::new(response.into_body(), MAX_ERROR_BODY)
                    .collect()
                    .await
                    .map(|b| b.to_bytes())
                    .unwrap_or_default()
            };
            Ok::<_, hyper_util::client::legacy::Error>((status, body))
        };
        match tokio::time::timeout(self.timeout, exchange).await {
            Err(_) => {
                tracing::warn!(url = %self.url, timeout = ?self.timeout, "reload: the proxy did not answer in time");
                PostOutcome::Failed { status: None }
            }
            Ok(Err(e)) => {
                tracing::warn!(url = %self.url, error = %e, "reload: cannot reach the proxy");
                PostOutcome::Failed { status: None }
            }
            Ok(Ok((status, body))) => {
                let outcome = outcome_of(status);
                if outcome != PostOutcome::Delivered {
                    tracing::warn!(
                        url = %self.url,
                        status = status.as_u16(),
                        body = %String::from_utf8_lossy(&body),
                        "reload: the proxy did not accept the reload"
                    );
                }
                outcome
            }
        }
    }
}

/// What a status means: `2xx` delivered, `409` busy, `400` refused, anything
/// else failed.
pub(crate) fn outcome_of(status: StatusCode) -> PostOutcome {
    match status.as_u16() {
        200..=299 => PostOutcome::Delivered,
        409 => PostOutcome::Busy,
        400 => PostOutcome::Refused,
        other => PostOutcome::Failed {
            status: Some(other),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_map_to_outcomes() {
        assert_eq!(outcome_of(StatusCode::OK), PostOutcome::Delivered);
        assert_eq!(outcome_of(StatusCode::CONFLICT), PostOutcome::Busy);
        assert_eq!(outcome_of(StatusCode::BAD_REQUEST), PostOutcome::Refused);
        assert_eq!(
            outcome_of(StatusCode::INTERNAL_SERVER_ERROR),
            PostOutcome::Failed { status: Some(500) }
        );
        assert_eq!(
            outcome_of(StatusCode::UNAUTHORIZED),
            PostOutcome::Failed { status: Some(401) }
        );
    }

    #[test]
    fn rejects_bad_urls_and_headers() {
        let t = Duration::from_secs(1);
        assert!(Poster::new("https://127.0.0.1:9090/admin/reload", None, t).is_err());
        assert!(Poster::new("not a url", None, t).is_err());
        assert!(Poster::new("/admin/reload", None, t).is_err());
        assert!(Poster::new("http://127.0.0.1:9090/admin/reload", Some("a\nb"), t).is_err());
        assert!(Poster::new("http://127.0.0.1:9090/admin/reload", Some("Basic eDp5"), t).is_ok());
    }
}
