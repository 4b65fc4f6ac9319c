//! Content negotiation of `/metrics`: which [`Exposition`] a request's
//! `Accept` header asks for.

use axum::http::{HeaderMap, header};

use crate::metrics::Exposition;

/// The format to answer a request with these headers in
/// ([`from_accept`] of its `Accept` lines).
pub(crate) fn exposition_for(headers: &HeaderMap) -> Exposition {
    // Several Accept lines mean one list; a line that is not text is ignored.
    let accept: Vec<&str> = headers
        .get_all(header::ACCEPT)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .collect();
    from_accept((!accept.is_empty()).then(|| accept.join(",")).as_deref())
}

/// The format to answer a request with this `Accept` header (several
/// header lines joined with `,`): OpenMetrics when the client lists
/// `application/openmetrics-text` with a q-value above zero and at least
/// that of anything text 0.0.4 would satisfy (`text/plain`, `text/*`,
/// `*/*`); the text format otherwise, including no header, `*/*` alone
/// and a header that cannot be read.
///
/// Prometheus lists OpenMetrics first with the highest q by default
/// (`scrape_protocols`), so it gets OpenMetrics; curl and browsers get
/// the text format.
fn from_accept(accept: Option<&str>) -> Exposition {
    let Some(accept) = accept else {
        return Exposition::PrometheusText;
    };
    let mut openmetrics = 0.0_f32;
    let mut text = 0.0_f32;
    for range in accept.split(',') {
        let Some(range) = MediaRange::parse(range) else {
            continue;
        };
        let (kind, sub) = (range.kind.as_str(), range.subtype.as_str());
        if (kind, sub) == ("application", "openmetrics-text") {
            openmetrics = openmetrics.max(range.q);
        } else if (kind, sub) == ("text", "plain") || (kind == "text" || kind == "*") && sub == "*"
        {
            text = text.max(range.q);
        }
    }
    if openmetrics > 0.0 && openmetrics >= text {
        Exposition::OpenMetrics
    } else {
        Exposition::PrometheusText
    }
}

/// One element of an `Accept` header: `type/subtype;param=value;q=0.5`,
/// type and subtype lowercased, `q` in 0..=1 (1 when absent).
struct MediaRange {
    kind: String,
    subtype: String,
    q: f32,
}

impl MediaRange {
    /// `None` for an element that is not `type/subtype`; a q-value that is
    /// not a number makes the range unacceptable (q = 0).
    fn parse(element: &str) -> Option<Self> {
        let mut parts = element.split(';');
        let (kind, subtype) = parts.next()?.trim().split_once('/')?;
        let (kind, subtype) = (kind.trim(), subtype.trim());
        if kind.is_empty() || subtype.is_empty() {
            return None;
        }
        let mut q = 1.0;
        for param in parts {
            if let Some((name, value)) = param.split_once('=')
                && name.trim().eq_ignore_ascii_case("q")
            {
                q = value
                    .trim()
                    .parse::<f32>()
                    .ok()
                    .filter(|q| q.is_finite())
                    .map_or(0.0, |q| q.clamp(0.0, 1.0));
            }
        }
        Some(MediaRange {
            kind: kind.to_ascii_lowercase(),
            subtype: subtype.to_ascii_lowercase(),
            q,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Prometheus' own `Accept` (default `scrape_protocols`, 2.49 and later).
    const PROMETHEUS_ACCEPT: &str = "application/openmetrics-text;version=1.0.0;q=0.5,\
        application/openmetrics-text;version=0.0.1;q=0.4,text/plain;version=0.0.4;q=0.3,*/*;q=0.2";

    #[test]
    fn accept_chooses_openmetrics_only_when_asked_for_first() {
        use Exposition::{OpenMetrics, PrometheusText};
        for (accept, want) in [
            (None, PrometheusText),
            (Some(""), PrometheusText),
            (Some("*/*"), PrometheusText),
            (Some("text/plain"), PrometheusText),
            (Some("text/plain;version=0.0.4"), PrometheusText),
            (
                Some("text/html,application/xhtml+xml,*/*;q=0.8"),
                PrometheusText,
            ),
            (Some(PROMETHEUS_ACCEPT), OpenMetrics),
            // Prometheus 2.0 to 2.48.
            (
                Some(
                    "application/openmetrics-text; version=0.0.1,text/plain;version=0.0.4;q=0.5,*/*;q=0.1",
                ),
                OpenMetrics,
            ),
            (Some("application/openmetrics-text"), OpenMetrics),
            (
                Some("Application/OpenMetrics-Text; Version=1.0.0"),
                OpenMetrics,
            ),
            (
                Some("application/openmetrics-text;version=1.0.0;charset=utf-8"),
                OpenMetrics,
            ),
            // Prometheus with `scrape_protocols: [PrometheusText0.0.4, ...]`.
            (
                Some(
                    "text/plain;version=0.0.4;q=0.5,application/openmetrics-text;version=1.0.0;q=0.4,*/*;q=0.3",
                ),
                PrometheusText,
            ),
            // The highest q wins wherever it is listed; a tie goes to the
            // format named explicitly.
            (
                Some("text/plain;q=0.2, application/openmetrics-text;q=0.9"),
                OpenMetrics,
            ),
            (
                Some("application/openmetrics-text;q=0.3, text/*;q=0.4"),
                PrometheusText,
            ),
            (
                Some("application/openmetrics-text;q=0.5, */*;q=0.5"),
                OpenMetrics,
            ),
            (
                Some("application/openmetrics-text ; q = 0.7 , */* ; q=0.6"),
                OpenMetrics,
            ),
            // q=0 means "not acceptable"; a malformed q too.
            (Some("application/openmetrics-text;q=0"), PrometheusText),
            (Some("application/openmetrics-text;q=high"), PrometheusText),
            (Some("application/openmetrics-text;q=NaN"), PrometheusText),
            // Ranges that match neither, and garbage, are ignored.
            (Some("application/json"), PrometheusText),
            (Some("application/*"), PrometheusText),
            (Some(",,;;/,application/openmetrics-text"), OpenMetrics),
            (Some("openmetrics"), PrometheusText),
        ] {
            assert_eq!(from_accept(accept), want, "Accept: {accept:?}");
        }
    }
}
