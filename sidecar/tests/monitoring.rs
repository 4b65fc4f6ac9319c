//! What operators plug into Prometheus and Grafana, checked against a real
//! sidecar and promtool:
//!
//! - `deploy/prometheus/sbmesh.rules.yml` passes `promtool check rules`, and
//!   its unit tests `sbmesh.rules.test.yml` pass `promtool test rules`;
//! - `/metrics` answers OpenMetrics to a client that asks for it first
//!   (Prometheus does) and the Prometheus text format 0.0.4 otherwise, and
//!   `promtool check metrics` finds nothing in the text form but the name of
//!   `mesh_peer_count` (fixed by docs/reference.md#metrics) (127.0.101.1);
//! - every metric the dashboard `deploy/grafana/sbmesh.json` and the rules
//!   query is one a live sidecar exposes (127.0.101.2).
//!
//! `scripts/test` installs promtool (Debian's `prometheus` package) and
//! exports `SBMESH_TEST_PROMTOOL`. Without it the promtool checks print SKIP,
//! unless `SBMESH_TEST_REQUIRE_SERVERS=1` (or `CI`), where they fail.

mod common;

use std::collections::BTreeSet;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use common::*;
use serde_json::Value;

const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";
const TEXT_004: &str = "text/plain; version=0.0.4; charset=utf-8";

/// The `Accept` Prometheus sends with its default `scrape_protocols`.
const PROMETHEUS_ACCEPT: &str = "application/openmetrics-text;version=1.0.0;q=0.5,\
    application/openmetrics-text;version=0.0.1;q=0.4,text/plain;version=0.0.4;q=0.3,*/*;q=0.2";
/// What Prometheus sends with `scrape_protocols: [PrometheusText0.0.4, OpenMetricsText1.0.0]`.
const PROMETHEUS_TEXT_FIRST_ACCEPT: &str = "text/plain;version=0.0.4;q=0.5,\
    application/openmetrics-text;version=1.0.0;q=0.4,*/*;q=0.3";

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("sidecar/ is inside the repository")
        .to_path_buf()
}

fn rules_dir() -> PathBuf {
    repo_root().join("deploy/prometheus")
}

fn promtool() -> Option<PathBuf> {
    match std::env::var_os("SBMESH_TEST_PROMTOOL") {
        Some(path) if !path.is_empty() => Some(PathBuf::from(path)),
        _ => required::missing(
            "monitoring",
            "SBMESH_TEST_PROMTOOL is not set",
            "scripts/test installs promtool and sets it",
        ),
    }
}

fn run(tool: &Path, args: &[&str], dir: &Path, stdin: Option<&str>) -> Output {
    let mut child = Command::new(tool)
        .args(args)
        .current_dir(dir)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", tool.display()));
    let mut input = child.stdin.take().expect("piped stdin");
    input
        .write_all(stdin.unwrap_or_default().as_bytes())
        .expect("write promtool's stdin");
    drop(input);
    child.wait_with_output().expect("wait for promtool")
}

fn printed(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

// ---------------------------------------------------------------------------
// A live sidecar
// ---------------------------------------------------------------------------

/// One sidecar alone on `127.0.101.<i>`, answering `/metrics`.
fn start_sidecar(i: u8) -> Cluster {
    let mut c = Cluster::new("127.0.101");
    let opts = c.default_opts(i, i);
    let opts = NodeOpts {
        seeds: vec![c.gossip_addr(i)],
        ..opts
    };
    c.spawn(opts);
    c.wait_until("the sidecar answers /metrics", || {
        c.nodes[0].metrics().is_some()
    });
    c
}

/// `GET /metrics` with this `Accept` header (none when `None`).
fn get_metrics(node: &Node, accept: Option<&str>) -> HttpResponse {
    let addr = node.admin_addr();
    let accept = accept.map_or(String::new(), |a| format!("Accept: {a}\r\n"));
    let req = format!("GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n{accept}\r\n");
    let r = http_raw(addr, req.as_bytes()).expect("GET /metrics");
    assert_eq!(r.status, 200, "GET /metrics: {}", r.text());
    r
}

/// Metric names a scrape carries: every sample's name, and each declared
/// family's name (OpenMetrics declares counters without `_total`), with the
/// suffixes of its samples for histograms and summaries.
fn exposed_names(text: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let mut parts = rest.split_whitespace();
            let (Some(family), Some(kind)) = (parts.next(), parts.next()) else {
                continue;
            };
            names.insert(family.to_owned());
            let suffixes: &[&str] = match kind {
                "counter" => &["_total"],
                "histogram" | "gaugehistogram" => &["_bucket", "_sum", "_count"],
                "summary" => &["_sum", "_count"],
                _ => &[],
            };
            for s in suffixes {
                if !family.ends_with(s) {
                    names.insert(format!("{family}{s}"));
                }
            }
        } else if let Some((name, _, _)) = parse_sample(line) {
            names.insert(name.to_owned());
        }
    }
    names
}

/// Name and labels of every sample.
/// Every series of an exposition, its labels sorted by name and a
/// histogram's `le` as a number: the two formats order and spell those
/// differently (`le="1.0"` first in OpenMetrics, `le="1"` last in text).
fn series(text: &str) -> BTreeSet<(String, Vec<(String, String)>)> {
    text.lines()
        .filter_map(parse_sample)
        .map(|(name, mut labels, _)| {
            for (label, value) in &mut labels {
                if label == "le"
                    && let Ok(bound) = value.parse::<f64>()
                {
                    *value = bound.to_string();
                }
            }
            labels.sort();
            (name.to_owned(), labels)
        })
        .collect()
}

// ---------------------------------------------------------------------------
// Metric names in PromQL, loosely
// ---------------------------------------------------------------------------

/// Words of PromQL that are not metric names where they stand without `(`
/// right after them: keywords, and aggregations (`sum by (x) (...)`).
const PROMQL_WORDS: &[&str] = &[
    "and",
    "or",
    "unless",
    "bool",
    "offset",
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "inf",
    "nan",
    "atan2",
    "sum",
    "min",
    "max",
    "avg",
    "group",
    "stddev",
    "stdvar",
    "count",
    "count_values",
    "bottomk",
    "topk",
    "quantile",
    "limitk",
    "limit_ratio",
];

/// The metric names an expression selects: identifiers outside strings,
/// label matchers `{...}`, ranges `[...]` and grouping lists, that are not
/// function calls, keywords or numbers.
fn metric_names_in(expr: &str) -> BTreeSet<String> {
    // Blank out strings, `{...}` and `[...]` (they hold label names, values
    // and durations, never metric names).
    let mut plain = String::with_capacity(expr.len());
    let mut depth = 0usize;
    let mut quote: Option<char> = None;
    let mut escaped = false;
    for c in expr.chars() {
        if let Some(q) = quote {
            if escaped {
                escaped = false;
            } else if c == '\\' {
                escaped = true;
            } else if c == q {
                quote = None;
            }
            plain.push(' ');
            continue;
        }
        match c {
            '"' | '\'' | '`' => {
                quote = Some(c);
                plain.push(' ');
            }
            '{' | '[' => {
                depth += 1;
                plain.push(' ');
            }
            '}' | ']' => {
                depth = depth.saturating_sub(1);
                plain.push(' ');
            }
            _ if depth > 0 => plain.push(' '),
            _ => plain.push(c),
        }
    }
    let chars: Vec<char> = plain.chars().collect();
    let mut names = BTreeSet::new();
    let mut i = 0;
    let mut skip_list = false;
    while i < chars.len() {
        let c = chars[i];
        let starts_ident = c.is_ascii_alphabetic() || c == '_' || c == ':';
        // Part of a number, a duration or a `$variable`: not a name.
        let glued = i > 0 && (chars[i - 1].is_ascii_alphanumeric() || chars[i - 1] == '$');
        if !starts_ident || glued {
            if skip_list && c == ')' {
                skip_list = false;
            }
            i += 1;
            continue;
        }
        let start = i;
        while i < chars.len()
            && (chars[i].is_ascii_alphanumeric() || chars[i] == '_' || chars[i] == ':')
        {
            i += 1;
        }
        let word: String = chars[start..i].iter().collect();
        let next = chars[i..].iter().find(|c| !c.is_whitespace());
        if skip_list {
            continue;
        }
        let lower = word.to_ascii_lowercase();
        if matches!(
            lower.as_str(),
            "by" | "without" | "on" | "ignoring" | "group_left" | "group_right"
        ) {
            // The label list that follows holds label names.
            skip_list = next == Some(&'(');
            continue;
        }
        if next == Some(&'(') || PROMQL_WORDS.contains(&lower.as_str()) {
            continue;
        }
        names.insert(word);
    }
    names
}

/// The `expr:` of every rule in a rules file (plain one-line values, or
/// `|`/`>` blocks).
fn rule_exprs(yaml: &str) -> Vec<String> {
    let lines: Vec<&str> = yaml.lines().collect();
    let mut exprs = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        let line = lines[i];
        let trimmed = line.trim_start();
        i += 1;
        let Some(value) = trimmed.strip_prefix("expr:") else {
            continue;
        };
        let value = value.trim();
        if value.starts_with('|') || value.starts_with('>') {
            let indent = line.len() - trimmed.len();
            let mut block = String::new();
            while i < lines.len() {
                let l = lines[i];
                let ind = l.len() - l.trim_start().len();
                if !l.trim().is_empty() && ind <= indent {
                    break;
                }
                block.push_str(l.trim());
                block.push('\n');
                i += 1;
            }
            exprs.push(block);
        } else {
            let unquoted = value
                .strip_prefix('\'')
                .and_then(|v| v.strip_suffix('\''))
                .or_else(|| value.strip_prefix('"').and_then(|v| v.strip_suffix('"')))
                .unwrap_or(value);
            exprs.push(unquoted.to_owned());
        }
    }
    exprs
}

/// Every `expr` of the dashboard's panels and every `query` of its query
/// variables, wherever they are nested (rows hold panels too).
fn dashboard_exprs(v: &Value, out: &mut Vec<String>) {
    match v {
        Value::Object(map) => {
            for (k, val) in map {
                match (k.as_str(), val) {
                    ("expr", Value::String(s)) => out.push(s.clone()),
                    // `label_values(selector, label)`: the selector.
                    ("definition", Value::String(s)) => {
                        if let Some((selector, _label)) = s
                            .strip_prefix("label_values(")
                            .and_then(|rest| rest.rsplit_once(','))
                        {
                            out.push(selector.to_owned());
                        }
                    }
                    _ => dashboard_exprs(val, out),
                }
            }
        }
        Value::Array(items) => items.iter().for_each(|i| dashboard_exprs(i, out)),
        _ => {}
    }
}

#[test]
fn promql_names_are_found_loosely() {
    let names = metric_names_in(
        r#"sum by (namespace, pod) (increase(store_operations_total{result="error", pod=~"$pod"}[$__rate_interval])) > 0
           and on (pod) reloader_reloads_total offset 5m > 0 or time() - (x:recorded_rule > 0)
           or max without (state) (mesh_peer_count{namespace=~"$namespace"}) or histogram_quantile(0.9, rate(h_bucket[5m]))"#,
    );
    let want: BTreeSet<String> = [
        "store_operations_total",
        "reloader_reloads_total",
        "x:recorded_rule",
        "mesh_peer_count",
        "h_bucket",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    assert_eq!(names, want);
    assert_eq!(
        rule_exprs(
            "    - alert: A\n      expr: up == 0\n    - alert: B\n      expr: |\n        sum(x)\n          > 1\n      for: 5m\n"
        ),
        ["up == 0", "sum(x)\n> 1\n"]
    );
}

// ---------------------------------------------------------------------------
// promtool
// ---------------------------------------------------------------------------

#[test]
fn alert_rules_pass_promtool_check_rules() {
    let Some(tool) = promtool() else { return };
    let out = run(
        &tool,
        &["check", "rules", "sbmesh.rules.yml"],
        &rules_dir(),
        None,
    );
    let text = printed(&out);
    assert!(out.status.success(), "promtool check rules failed:\n{text}");
    assert!(text.contains("SUCCESS"), "{text}");
}

#[test]
fn alert_rules_unit_tests_pass_promtool_test_rules() {
    let Some(tool) = promtool() else { return };
    let out = run(
        &tool,
        &["test", "rules", "sbmesh.rules.test.yml"],
        &rules_dir(),
        None,
    );
    let text = printed(&out);
    assert!(out.status.success(), "promtool test rules failed:\n{text}");
    assert!(text.contains("SUCCESS"), "{text}");
}

#[test]
fn every_alert_has_a_unit_test_that_fires_it_and_one_that_does_not() {
    let rules = std::fs::read_to_string(rules_dir().join("sbmesh.rules.yml")).expect("rules");
    let tests =
        std::fs::read_to_string(rules_dir().join("sbmesh.rules.test.yml")).expect("rule tests");
    let alerts: Vec<&str> = rules
        .lines()
        .filter_map(|l| l.trim().strip_prefix("- alert:"))
        .map(str::trim)
        .collect();
    assert!(alerts.len() >= 7, "alerts found: {alerts:?}");
    for alert in alerts {
        // The `alertname:` lines of each check, each followed by its expected alerts.
        let checks: Vec<&str> = tests
            .split("alertname:")
            .skip(1)
            .filter(|c| c.split_whitespace().next() == Some(alert))
            .collect();
        assert!(
            checks.iter().any(|c| c.contains("exp_labels:")),
            "no unit test in sbmesh.rules.test.yml expects {alert} to fire"
        );
        assert!(
            checks.iter().any(|c| {
                c.lines()
                    .find(|l| l.trim_start().starts_with("exp_alerts:"))
                    .is_some_and(|l| l.contains("[]"))
            }),
            "no unit test in sbmesh.rules.test.yml expects {alert} not to fire"
        );
    }
}

/// The text form as promtool lints it: findings other than the one on
/// `mesh_peer_count` (a gauge whose name docs/reference.md#metrics fixes) are failures.
fn assert_promtool_lints_clean(tool: &Path, text: &str) {
    let out = run(tool, &["check", "metrics"], &repo_root(), Some(text));
    let findings: Vec<String> = printed(&out)
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .map(str::to_owned)
        .collect();
    let unexpected: Vec<&String> = findings
        .iter()
        .filter(|l| !l.starts_with("mesh_peer_count "))
        .collect();
    assert!(
        unexpected.is_empty(),
        "promtool check metrics (exit {:?}) found:\n{}\n\nin:\n{text}",
        out.status.code(),
        findings.join("\n")
    );
}

#[test]
fn metrics_answer_the_format_the_accept_header_prefers() {
    let c = start_sidecar(1);
    let node = &c.nodes[0];

    // Prometheus lists OpenMetrics first, with the highest q.
    for accept in [
        Some(PROMETHEUS_ACCEPT),
        Some("application/openmetrics-text; version=1.0.0"),
    ] {
        let r = get_metrics(node, accept);
        assert_eq!(
            r.header("content-type"),
            Some(OPENMETRICS),
            "Accept {accept:?}"
        );
        let body = r.text();
        assert!(
            body.ends_with("# EOF\n"),
            "Accept {accept:?}: no # EOF at the end:\n{body}"
        );
        assert!(
            body.contains("# TYPE mesh_packets_rejected counter\n"),
            "Accept {accept:?}:\n{body}"
        );
    }

    // Anything else gets the Prometheus text format 0.0.4.
    let mut text_bodies = Vec::new();
    for accept in [
        None,
        Some("*/*"),
        Some("text/plain"),
        Some(PROMETHEUS_TEXT_FIRST_ACCEPT),
    ] {
        let r = get_metrics(node, accept);
        assert_eq!(
            r.header("content-type"),
            Some(TEXT_004),
            "Accept {accept:?}"
        );
        let body = r.text();
        assert!(!body.contains("# EOF"), "Accept {accept:?}:\n{body}");
        assert!(
            body.contains("# TYPE mesh_packets_rejected_total counter\n"),
            "Accept {accept:?}:\n{body}"
        );
        text_bodies.push(body);
    }
    // Both forms carry the same series (values move between scrapes).
    assert_eq!(
        series(&get_metrics(node, Some(PROMETHEUS_ACCEPT)).text()),
        series(&text_bodies[0])
    );

    let Some(tool) = promtool() else { return };
    for body in &text_bodies {
        assert_promtool_lints_clean(&tool, body);
    }
}

#[test]
fn dashboard_and_rules_query_only_metrics_the_sidecar_exposes() {
    let root = repo_root();
    let dashboard: Value = serde_json::from_str(
        &std::fs::read_to_string(root.join("deploy/grafana/sbmesh.json")).expect("dashboard"),
    )
    .expect("the dashboard is JSON");

    // The dashboard's frame: a Prometheus data source variable every panel
    // uses, and namespace/pod variables.
    assert!(
        dashboard["schemaVersion"].as_u64().is_some_and(|v| v >= 36),
        "schemaVersion {}",
        dashboard["schemaVersion"]
    );
    let vars = dashboard["templating"]["list"]
        .as_array()
        .expect("templating.list");
    let var = |name: &str| {
        vars.iter()
            .find(|v| v["name"] == name)
            .unwrap_or_else(|| panic!("no ${name} variable"))
    };
    assert_eq!(var("datasource")["type"], "datasource");
    assert_eq!(var("datasource")["query"], "prometheus");
    assert_eq!(var("namespace")["type"], "query");
    assert_eq!(var("pod")["type"], "query");
    let panels = dashboard["panels"].as_array().expect("panels");
    for p in panels.iter().filter(|p| p["type"] != "row") {
        assert_eq!(
            p["datasource"]["uid"], "${datasource}",
            "panel {} does not use the data source variable",
            p["title"]
        );
        for t in p["targets"].as_array().expect("targets") {
            let expr = t["expr"].as_str().unwrap_or_default();
            assert!(
                expr.contains("namespace=~\"$namespace\"") && expr.contains("pod=~\"$pod\""),
                "panel {}: {expr} does not filter by $namespace and $pod",
                p["title"]
            );
        }
    }

    let mut dashboard_names = BTreeSet::new();
    let mut exprs = Vec::new();
    dashboard_exprs(&dashboard, &mut exprs);
    for e in &exprs {
        dashboard_names.extend(metric_names_in(e));
    }
    let rules =
        std::fs::read_to_string(root.join("deploy/prometheus/sbmesh.rules.yml")).expect("rules");
    let mut rule_names = BTreeSet::new();
    for e in rule_exprs(&rules) {
        rule_names.extend(metric_names_in(&e));
    }
    // Not vacuous: the parsers found what the files are about.
    for name in [
        "mesh_peer_count",
        "mesh_packets_rejected_total",
        "sbproxy_cert_expiry_seconds",
        "store_operations_total",
        "reloader_last_reload_successful",
        "sbmesh_proxy_restart_failing",
    ] {
        assert!(
            dashboard_names.contains(name),
            "dashboard: {name} not found in {dashboard_names:?}"
        );
        assert!(
            rule_names.contains(name),
            "rules: {name} not found in {rule_names:?}"
        );
    }

    let c = start_sidecar(2);
    let node = &c.nodes[0];
    // A labelled family (the store's operations and locks) appears with its
    // first sample, which the sidecar's start-up makes a moment after
    // /metrics first answers: read until every queried name is there, or
    // 10 s have passed, then judge.
    let wanted: BTreeSet<&String> = dashboard_names.iter().chain(&rule_names).collect();
    let start = std::time::Instant::now();
    let (exposed, exposed_om) = loop {
        let exposed = exposed_names(&get_metrics(node, None).text());
        let exposed_om = exposed_names(&get_metrics(node, Some(PROMETHEUS_ACCEPT)).text());
        let all = wanted
            .iter()
            .all(|n| exposed.contains(*n) && exposed_om.contains(*n));
        if all || start.elapsed() > std::time::Duration::from_secs(10) {
            break (exposed, exposed_om);
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    };
    for (what, names) in [
        ("deploy/grafana/sbmesh.json", &dashboard_names),
        ("deploy/prometheus/sbmesh.rules.yml", &rule_names),
    ] {
        let unknown: Vec<&String> = names.iter().filter(|n| !exposed.contains(*n)).collect();
        assert!(
            unknown.is_empty(),
            "{what} queries metrics the sidecar does not expose: {unknown:?}\nexposed: {exposed:?}"
        );
        let unknown: Vec<&String> = names.iter().filter(|n| !exposed_om.contains(*n)).collect();
        assert!(
            unknown.is_empty(),
            "{what} queries metrics absent from the OpenMetrics form: {unknown:?}"
        );
    }
}
