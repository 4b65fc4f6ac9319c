//! HTTP Basic for `/admin/*`, compared in constant time.

use std::net::IpAddr;

use aws_lc_rs::constant_time::verify_slices_are_equal;
use aws_lc_rs::digest::{SHA256, digest};
use axum::http::HeaderValue;
use base64::Engine;

/// Who may call `/admin/*`.
#[derive(Clone, Debug)]
pub struct AdminAuth {
    // SHA-256 of "user:password": comparing digests keeps the comparison
    // constant-time whatever the lengths.
    expected: Option<Vec<u8>>,
}

/// What to answer.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Verdict {
    Allow,
    Challenge,
    LoopbackOnly,
}

impl AdminAuth {
    /// Basic credentials; with either missing, only loopback clients are
    /// let in.
    pub(crate) fn new(user: Option<&str>, password: Option<&str>) -> Self {
        let expected = match (user, password) {
            (Some(u), Some(p)) => Some(
                digest(&SHA256, format!("{u}:{p}").as_bytes())
                    .as_ref()
                    .to_vec(),
            ),
            _ => None,
        };
        Self { expected }
    }

    pub(crate) fn check(&self, given: Option<&HeaderValue>, peer: IpAddr) -> Verdict {
        let Some(expected) = &self.expected else {
            return if peer.is_loopback() || peer.to_canonical().is_loopback() {
                Verdict::Allow
            } else {
                Verdict::LoopbackOnly
            };
        };
        let Some(creds) = given
            .and_then(|v| v.to_str().ok())
            .and_then(|v| {
                v.strip_prefix("Basic ")
                    .or_else(|| v.strip_prefix("basic "))
            })
            .and_then(|b| {
                base64::engine::general_purpose::STANDARD
                    .decode(b.trim())
                    .ok()
            })
        else {
            return Verdict::Challenge;
        };
        let got = digest(&SHA256, &creds);
        if verify_slices_are_equal(got.as_ref(), expected).is_ok() {
            Verdict::Allow
        } else {
            Verdict::Challenge
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn basic(s: &str) -> HeaderValue {
        let b = base64::engine::general_purpose::STANDARD.encode(s);
        HeaderValue::from_str(&format!("Basic {b}")).unwrap()
    }

    #[test]
    fn basic_credentials() {
        let a = AdminAuth::new(Some("admin"), Some("secret"));
        let remote: IpAddr = "10.0.0.1".parse().unwrap();
        assert_eq!(
            a.check(Some(&basic("admin:secret")), remote),
            Verdict::Allow
        );
        assert_eq!(
            a.check(Some(&basic("admin:wrong")), remote),
            Verdict::Challenge
        );
        assert_eq!(a.check(None, remote), Verdict::Challenge);
        assert_eq!(
            a.check(Some(&HeaderValue::from_static("Basic !!!")), remote),
            Verdict::Challenge
        );
    }

    #[test]
    fn without_credentials_only_loopback() {
        let a = AdminAuth::new(None, Some("x"));
        assert_eq!(a.check(None, "127.0.0.1".parse().unwrap()), Verdict::Allow);
        assert_eq!(a.check(None, "::1".parse().unwrap()), Verdict::Allow);
        assert_eq!(
            a.check(None, "::ffff:127.0.0.1".parse().unwrap()),
            Verdict::Allow
        );
        assert_eq!(
            a.check(None, "10.1.1.1".parse().unwrap()),
            Verdict::LoopbackOnly
        );
    }
}
