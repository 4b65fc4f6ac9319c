//! Origin keys as hostnames a certificate can name
//! (docs/reference.md#sidecar-block): lowercased, IDNs in their A-label
//! (punycode) form, no port, no empty label, labels of at most 63 and names
//! of at most 253 characters.

use std::net::IpAddr;

/// Longest hostname (RFC 1035, without the trailing dot).
pub(crate) const MAX_NAME_LEN: usize = 253;
/// Longest label.
pub(crate) const MAX_LABEL_LEN: usize = 63;

/// The hostname an origin key names, in the form a certificate carries it:
/// trimmed, without a trailing dot, lowercased, IDN labels as A-labels.
/// `Err` says what is wrong and what would be accepted. Wildcards are
/// refused here: [`normalize_wildcard`] reads them where DNS-01 can prove
/// them.
pub(crate) fn normalize(origin: &str) -> Result<String, String> {
    let trimmed = origin.trim();
    let name = trimmed.strip_suffix('.').unwrap_or(trimmed);
    if name.is_empty() {
        return Err("is empty; expected a hostname such as api.example.com".to_owned());
    }
    if name.trim_start_matches('[').parse::<IpAddr>().is_ok()
        || name
            .trim_start_matches('[')
            .split(']')
            .next()
            .is_some_and(|ip| ip.parse::<IpAddr>().is_ok())
    {
        return Err(
            "is an IP address; an HTTP-01 certificate is ordered for a hostname such as \
             api.example.com"
                .to_owned(),
        );
    }
    if let Some((host, port)) = name.rsplit_once(':')
        && !host.is_empty()
    {
        return Err(format!(
            "has a port ({port}); an origin key is a hostname without port, such as {}",
            host.to_ascii_lowercase()
        ));
    }
    if name.contains('*') {
        return Err("is a wildcard; HTTP-01 cannot prove a wildcard".to_owned());
    }
    let ascii = idna::domain_to_ascii(name).map_err(|_| {
        "is not a valid hostname (letters, digits and '-' in dot-separated labels; \
         internationalised names are accepted and converted to punycode)"
            .to_owned()
    })?;
    if ascii.len() > MAX_NAME_LEN {
        return Err(format!(
            "is {} characters long; a hostname has at most {MAX_NAME_LEN}",
            ascii.len()
        ));
    }
    for label in ascii.split('.') {
        if label.is_empty() {
            return Err(
                "has an empty label (two dots in a row, or a leading dot); expected a hostname \
                 such as api.example.com"
                    .to_owned(),
            );
        }
        if label.len() > MAX_LABEL_LEN {
            return Err(format!(
                "has a label of {} characters; a label has at most {MAX_LABEL_LEN}",
                label.len()
            ));
        }
        let valid = label
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
            && !label.starts_with('-')
            && !label.ends_with('-');
        if !valid {
            return Err(format!(
                "has the label {label:?}; a label is letters, digits and '-' (not at its start \
                 or end)"
            ));
        }
    }
    Ok(ascii)
}

/// The prefix of a wildcard name: `*.` then the name it covers one label of.
pub(crate) const WILDCARD_PREFIX: &str = "*.";

/// [`normalize`], with a wildcard (`*.example.com`, the `*` a whole first
/// label) accepted as `*.` and the normalised rest: what DNS-01 orders.
/// A `*` anywhere else is refused, naming the form a CA accepts.
pub(crate) fn normalize_wildcard(origin: &str) -> Result<String, String> {
    let trimmed = origin.trim();
    match trimmed.strip_prefix(WILDCARD_PREFIX) {
        Some(rest) if !rest.contains('*') => {
            let rest = normalize(rest)?;
            if !rest.contains('.') {
                return Err(format!(
                    "covers every name under the top-level label {rest:?}; a CA certifies a \
                     wildcard under a registered domain, such as *.example.com"
                ));
            }
            Ok(format!("{WILDCARD_PREFIX}{rest}"))
        }
        _ if trimmed.contains('*') => Err(
            "has a '*' that is not a whole first label; a wildcard is written *.example.com \
             and covers one label"
                .to_owned(),
        ),
        _ => normalize(trimmed),
    }
}

#[cfg(test)]
mod tests {
    use super::{normalize, normalize_wildcard};

    #[test]
    fn wildcards_are_one_whole_first_label() {
        assert_eq!(
            normalize_wildcard("*.Example.COM.").unwrap(),
            "*.example.com"
        );
        assert_eq!(
            normalize_wildcard("api.example.com").unwrap(),
            "api.example.com"
        );
        for (bad, says) in [
            ("*", "'*'"),
            ("*.com", "top-level"),
            ("a*.example.com", "whole first label"),
            ("*.*.example.com", "whole first label"),
            ("api.*.example.com", "whole first label"),
            ("*.exa mple.com", "label"),
        ] {
            let e = normalize_wildcard(bad).unwrap_err();
            assert!(e.contains(says), "{bad:?}: {e}");
        }
    }

    #[test]
    fn normalises() {
        assert_eq!(normalize("API.Example.COM").unwrap(), "api.example.com");
        assert_eq!(normalize(" api.example.com. ").unwrap(), "api.example.com");
        assert_eq!(
            normalize("bücher.example").unwrap(),
            "xn--bcher-kva.example"
        );
        assert_eq!(
            normalize("xn--bcher-kva.example").unwrap(),
            "xn--bcher-kva.example"
        );
        assert_eq!(normalize("localhost").unwrap(), "localhost");
        assert_eq!(normalize("a-1.test").unwrap(), "a-1.test");
    }

    #[test]
    fn refuses_what_is_not_a_hostname() {
        for (bad, says) in [
            ("", "empty"),
            ("api.example.com:8443", "has a port (8443)"),
            ("a..b", "empty label"),
            (".a.b", "empty label"),
            ("10.0.0.1", "IP address"),
            ("[::1]:80", "IP address"),
            ("::1", "IP address"),
            ("-a.b", "label"),
            ("a_b.c", "label"),
            ("a b.c", "label"),
            ("*.example.com", "wildcard"),
        ] {
            let e = normalize(bad).unwrap_err();
            assert!(e.contains(says), "{bad:?}: {e}");
        }
        let long_label = format!("{}.com", "a".repeat(64));
        assert!(normalize(&long_label).unwrap_err().contains("at most 63"));
        let long_name = vec!["a".repeat(60); 5].join(".");
        assert!(normalize(&long_name).unwrap_err().contains("at most 253"));
    }
}
