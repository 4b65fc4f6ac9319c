//! `docs/` stays true to the sidecar:
//! - every subcommand, long flag and environment variable that
//!   `sbmesh-sidecar ... --help` prints is in `docs/reference.md`, each
//!   variable on its flag's line;
//! - every metric a live sidecar exposes on `/metrics` (in both exposition
//!   formats) is in `docs/reference.md`, with its labels on its line;
//! - the `/admin/cluster/status` JSON of a live 3-node mesh validates
//!   against `docs/status.schema.json`, and the schema refuses a wrong
//!   `membership_state`;
//! - every link between the docs (and from the README) lands on a file and
//!   a heading that exist, and the runbook anchors others link to (alert
//!   rules) are there.
//!
//! Addresses: 127.0.102.* (metrics) and 127.0.103.* (the 3-node mesh).

mod common;
mod doc_check;

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;

use common::{Cluster, http_raw, total_nodes, write_atomic};
use doc_check::{
    anchors, docs_dir, env_char, link_targets, mentions, name_char, read_doc, undocumented_options,
};
use serde_json::Value;

/// ACME on (so the ACME, certificate and store series appear) against a
/// directory where nothing listens (nothing is ever issued, nothing leaves
/// the machine), a pod-local store (so a node with peers refuses to order
/// and says so in status), a wildcard origin (listed as not eligible) and
/// certificates applied as files only.
const SB_YML: &str = "\
proxy:
  admin:
    enabled: true
    port: 9090
  extensions:
    sbmesh:
      acme:
        enabled: true
        email: ops@example.test
        directory_url: http://127.0.0.1:9/directory
        storage_backend: memory
        certificates: per_host
        apply: none
origins:
  \"a.example.test\": {}
  \"*.example.test\": {}
";

fn reference() -> String {
    read_doc("reference.md")
}

#[test]
fn every_flag_and_variable_of_the_help_is_documented() {
    let bin = common::sidecar_bin();
    let missing =
        undocumented_options(&bin, &["run", "validate", "status", "keygen"], &reference());
    assert!(
        missing.is_empty(),
        "docs/reference.md lacks:\n  {}",
        missing.join("\n  ")
    );
}

/// `GET /metrics` with an `Accept` header.
fn scrape(addr: SocketAddr, accept: &str) -> Option<String> {
    let request = format!(
        "GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nAccept: {accept}\r\n\r\n"
    );
    let response = http_raw(addr, request.as_bytes()).ok()?;
    (response.status == 200).then(|| response.text())
}

/// Metric names of an exposition, with the label names seen on each:
/// every sample's name, and every `# TYPE` family (a counter family
/// named without `_total`, as OpenMetrics writes it, under its sample
/// name).
fn exposed(text: &str) -> BTreeMap<String, BTreeSet<String>> {
    let mut names: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut histograms = BTreeSet::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let mut words = rest.split_whitespace();
            let (Some(name), Some(kind)) = (words.next(), words.next()) else {
                continue;
            };
            if kind == "histogram" {
                histograms.insert(name.to_owned());
            }
            let name = if kind == "counter" && !name.ends_with("_total") {
                format!("{name}_total")
            } else {
                name.to_owned()
            };
            names.entry(name).or_default();
        } else if !line.starts_with('#') && !line.trim().is_empty() {
            let sample: String = line.chars().take_while(|&c| name_char(c)).collect();
            // A histogram's samples stand under its family's name, `le`
            // aside: the reference documents the family.
            let histogram = ["_bucket", "_sum", "_count", "_created"]
                .iter()
                .find_map(|suffix| sample.strip_suffix(suffix))
                .filter(|family| histograms.contains(*family))
                .map(str::to_owned);
            let labels = names.entry(histogram.unwrap_or(sample)).or_default();
            if let Some(set) = line
                .split_once('{')
                .and_then(|(_, rest)| rest.split_once('}'))
            {
                for pair in set.0.split(',') {
                    if let Some((label, _)) = pair.split_once('=')
                        && label.trim() != "le"
                    {
                        labels.insert(label.trim().to_owned());
                    }
                }
            }
        }
    }
    names
}

#[test]
fn every_exposed_metric_is_documented() {
    let mut cluster = Cluster::new("127.0.102");
    std::fs::write(&cluster.config, SB_YML).expect("write sb.yml");
    let opts = cluster.default_opts(1, 1);
    let i = cluster.spawn(opts);
    let addr = cluster.nodes[i].admin_addr();
    // Series with dynamic labels appear once the store is open.
    cluster.wait_until("the store's series are exposed", || {
        scrape(addr, "*/*").is_some_and(|t| t.contains("store_operations_total{"))
    });

    let reference = reference();
    let lines: Vec<&str> = reference.lines().collect();
    let mut missing = Vec::new();
    let mut seen = 0;
    for accept in [
        "*/*",
        "text/plain",
        "application/openmetrics-text; version=1.0.0",
    ] {
        let text = scrape(addr, accept).unwrap_or_else(|| panic!("/metrics ({accept})"));
        for (name, labels) in exposed(&text) {
            seen += 1;
            let Some(line) = lines
                .iter()
                .find(|l| l.starts_with("| `") && mentions(l, &format!("`{name}`"), name_char))
            else {
                missing.push(format!("the metric {name} (Accept: {accept})"));
                continue;
            };
            for label in labels {
                if !mentions(line, &format!("`{label}`"), name_char) {
                    missing.push(format!("the label {label} of {name}"));
                }
            }
        }
    }
    assert!(seen > 10, "too few metrics found to be a real scrape");
    missing.sort();
    missing.dedup();
    assert!(
        missing.is_empty(),
        "docs/reference.md (a table row per metric, labels in backquotes) lacks:\n  {}",
        missing.join("\n  ")
    );
}

fn schema() -> jsonschema::Validator {
    doc_check::status_schema()
}

fn problems(validator: &jsonschema::Validator, status: &Value) -> Vec<String> {
    validator
        .iter_errors(status)
        .map(|e| format!("{}: {e}", e.instance_path()))
        .collect()
}

/// Which optional parts of the shape a status exercises, for the log.
fn optional_parts(status: &Value) -> BTreeSet<&'static str> {
    let mut parts = BTreeSet::new();
    for node in status["nodes"].as_array().into_iter().flatten() {
        for key in ["clock_skew", "acme", "proxy", "key_id"] {
            if node.get(key).is_some() {
                parts.insert(key);
            }
        }
        if !node["last_reload"].is_null() {
            parts.insert("last_reload");
        }
        if node["acme"].get("refusal").is_some() {
            parts.insert("acme.refusal");
        }
        for cert in node["certificates"].as_array().into_iter().flatten() {
            parts.insert("certificates");
            if cert.get("placeholder").is_some() {
                parts.insert("certificates.placeholder");
            }
        }
    }
    parts
}

#[test]
fn the_status_of_a_live_mesh_matches_the_schema() {
    let validator = schema();
    let mut cluster = Cluster::new("127.0.103");
    std::fs::write(&cluster.config, SB_YML).expect("write sb.yml");
    for i in 1..=3 {
        let opts = cluster.default_opts(i, 3);
        cluster.spawn(opts);
    }
    let all = cluster.all();
    cluster.wait_until(
        "every node shows total_nodes 3 and every member's metadata",
        || {
            all.iter().all(|&i| {
                cluster.nodes[i].status().is_some_and(|s| {
                    total_nodes(&s) == Some(3)
                        && s["nodes"]
                            .as_array()
                            .is_some_and(|n| n.iter().all(|n| n["version"].is_string()))
                })
            })
        },
    );
    // A config change makes a reload attempt (nobody listens at the
    // reload URL), so `last_reload` is an object, not null.
    write_atomic(
        &cluster.config,
        &format!("{SB_YML}# changed by the docs test\n"),
    );
    cluster.wait_until("node-1 reports its last reload", || {
        cluster.nodes[0]
            .status()
            .is_some_and(|s| !s["nodes"][0]["last_reload"].is_null())
    });

    for node in &cluster.nodes {
        let status = node.status().expect("status answers");
        let found = problems(&validator, &status);
        assert!(
            found.is_empty(),
            "{}: /admin/cluster/status does not match docs/status.schema.json:\n  {}\n{}",
            node.id(),
            found.join("\n  "),
            serde_json::to_string_pretty(&status).unwrap_or_default()
        );
        eprintln!(
            "{}: valid; optional parts present: {:?}",
            node.id(),
            optional_parts(&status)
        );
    }

    // The schema can fail: a state the code never writes, and a field it
    // does not have.
    let status = cluster.nodes[0].status().expect("status answers");
    let mut wrong_state = status.clone();
    wrong_state["nodes"][0]["membership_state"] = Value::from("gone");
    assert!(
        !problems(&validator, &wrong_state).is_empty(),
        "the schema accepts membership_state \"gone\""
    );
    let mut extra_field = status;
    extra_field["summary"]["unknown_nodes"] = Value::from(0);
    assert!(
        !problems(&validator, &extra_field).is_empty(),
        "the schema accepts a summary field the code does not write"
    );
}

#[test]
fn names_are_found_only_whole() {
    // The helpers the checks above rest on.
    assert!(mentions(
        "`--cluster-key-file`",
        "--cluster-key-file",
        doc_check::flag_char
    ));
    assert!(!mentions(
        "`--cluster-key-file`",
        "--cluster-key",
        doc_check::flag_char
    ));
    assert!(!mentions("SBPROXY_POD_NAME", "POD_NAME", env_char));
    assert!(mentions("| `POD_NAME` |", "POD_NAME", env_char));
    assert_eq!(
        doc_check::slug(" Moving from sbproxy's own `ACME` and mesh"),
        "moving-from-sbproxys-own-acme-and-mesh"
    );
    assert_eq!(
        anchors("# A\n```\n# not a heading\n```\n## A\n"),
        ["a", "a-1"]
    );
}

/// Runbook anchors other files link to (the Prometheus alert rules among
/// them): renaming a heading must not break them silently.
const RUNBOOKS: &[&str] = &[
    "rotate-the-cluster-key",
    "scale",
    "a-pod-is-missing-from-the-mesh",
    "a-member-is-down",
    "a-stuck-acme-order",
    "a-ca-rate-limit",
    "a-certificate-is-expiring",
    "reloads-are-failing",
    "the-config-is-invalid",
    "store-errors",
    "rejected-packets",
    "proxy-restarts-are-failing",
    "moving-from-sbproxys-own-acme-and-mesh",
    "restoring-after-a-lost-store",
];

#[test]
fn runbook_anchors_and_links_between_docs_resolve() {
    let operations = anchors(&read_doc("operations.md"));
    for anchor in RUNBOOKS {
        assert!(
            operations.iter().any(|a| a == anchor),
            "docs/operations.md has no heading for #{anchor}; its anchors: {operations:?}"
        );
    }

    let docs = docs_dir();
    let mut sources: Vec<std::path::PathBuf> = std::fs::read_dir(&docs)
        .expect("list docs/")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "md"))
        .collect();
    sources.push(docs.join("../README.md"));
    let mut broken = Vec::new();
    for source in &sources {
        let text = std::fs::read_to_string(source).expect("read a doc");
        let dir = source.parent().expect("a directory");
        for target in link_targets(&text) {
            if target.contains("://") || target.starts_with("mailto:") {
                continue;
            }
            let (file, anchor) = target.split_once('#').unwrap_or((&target, ""));
            let path = if file.is_empty() {
                source.clone()
            } else {
                dir.join(file)
            };
            if !path.exists() {
                broken.push(format!("{}: {target} (no such file)", source.display()));
                continue;
            }
            if !anchor.is_empty() {
                let content = std::fs::read_to_string(&path).unwrap_or_default();
                if !anchors(&content).iter().any(|a| a == anchor) {
                    broken.push(format!("{}: {target} (no such heading)", source.display()));
                }
            }
        }
    }
    assert!(
        broken.is_empty(),
        "broken links:\n  {}",
        broken.join("\n  ")
    );
}

/// The rows of the flag table under `## Sidecar flags`, by long name:
/// (environment variable, default cell).
fn documented_flag_rows(reference: &str) -> BTreeMap<String, (String, String)> {
    let mut rows = BTreeMap::new();
    let mut in_section = false;
    for line in reference.lines() {
        if line.starts_with("## ") || line.starts_with("### ") {
            in_section = line == "## Sidecar flags";
            continue;
        }
        if !in_section || !line.starts_with("| `--") {
            continue;
        }
        let cells: Vec<&str> = line.split(" | ").collect();
        let unquote = |cell: &str| {
            cell.trim_start_matches('|')
                .trim()
                .trim_matches('`')
                .to_owned()
        };
        if cells.len() >= 3 {
            let long = unquote(cells[0]).trim_start_matches("--").to_owned();
            rows.insert(long, (unquote(cells[1]), cells[2].to_owned()));
        }
    }
    rows
}

/// The flag table of `docs/reference.md` is checked against the one
/// definition of the flags (`sbmesh::Flag::RUN`, which also drives
/// clap, the settings and the operator): the same flags, each with its
/// variable, and each fixed default written as the library's constant.
#[test]
fn the_reference_flag_table_is_the_library_table() {
    use sbmesh::{Flag, FlagDefault};
    let rows = documented_flag_rows(&reference());
    let mut problems = Vec::new();
    for flag in Flag::RUN {
        let Some((env, default_cell)) = rows.get(flag.long) else {
            problems.push(format!("no row for {}", flag.flag()));
            continue;
        };
        if env != flag.env {
            problems.push(format!(
                "{}: the row says {env}, the flag's variable is {}",
                flag.flag(),
                flag.env
            ));
        }
        if let FlagDefault::Value(value) = flag.default {
            let value = format!("`{value}`");
            if !default_cell.contains(&value) {
                problems.push(format!(
                    "{}: the default cell {default_cell:?} does not give {value}",
                    flag.flag()
                ));
            }
        }
    }
    for long in rows.keys() {
        if !Flag::RUN.iter().any(|flag| flag.long == long) {
            problems.push(format!("--{long} is documented but is no flag of run"));
        }
    }
    assert!(
        problems.is_empty(),
        "docs/reference.md#sidecar-flags against sbmesh::Flag::RUN:\n  {}",
        problems.join("\n  ")
    );
}
