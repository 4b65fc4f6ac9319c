//! Reading `docs/reference.md` and a binary's `--help` for the tests that
//! keep the documentation true (`sidecar/tests/docs.rs`,
//! `operator/tests/docs.rs`, which includes this file by path).
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;

/// The repository's `docs/` directory (both crates sit one level below the
/// workspace root).
pub fn docs_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs")
}

/// The text of `docs/<name>`.
pub fn read_doc(name: &str) -> String {
    let path = docs_dir().join(name);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
}

/// The schema of `/admin/cluster/status` (`docs/status.schema.json`).
pub fn status_schema() -> jsonschema::Validator {
    let text = read_doc("status.schema.json");
    let schema: serde_json::Value =
        serde_json::from_str(&text).expect("status.schema.json is JSON");
    jsonschema::draft202012::new(&schema).expect("status.schema.json compiles")
}

/// Whether `needle` occurs in `text` as a whole token: the characters on
/// either side are not `word` characters, so `--cluster-key` is not found
/// inside `--cluster-key-file`, nor `POD_NAME` inside `SBPROXY_POD_NAME`.
pub fn mentions(text: &str, needle: &str, word: fn(char) -> bool) -> bool {
    text.match_indices(needle).any(|(at, _)| {
        let before = text[..at].chars().next_back();
        let after = text[at + needle.len()..].chars().next();
        !before.is_some_and(word) && !after.is_some_and(word)
    })
}

/// Characters of a long flag: `--` followed by `[a-z0-9-]`.
pub fn flag_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '-'
}

/// Characters of an environment variable name.
pub fn env_char(c: char) -> bool {
    c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_'
}

/// Characters of a metric or field name.
pub fn name_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

/// `bin args...` with an empty environment (so clap prints no values of
/// the variables it reads); its stdout, which must be a success.
pub fn run_help(bin: &Path, args: &[&str]) -> String {
    let out = Command::new(bin)
        .args(args)
        .env_clear()
        .output()
        .unwrap_or_else(|e| panic!("run {} {args:?}: {e}", bin.display()));
    assert!(
        out.status.success(),
        "{} {args:?} failed: {}\n{}",
        bin.display(),
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("help is UTF-8")
}

/// One option of a help text: its long flag (`--config`) and the
/// environment variable clap says stands in for it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HelpOption {
    pub long: String,
    pub env: Option<String>,
}

/// The options of a clap help text (`--help`, long form): every option
/// line (indented at most 6 columns, starting with `-`) opens a block that
/// runs to the next one; the block's `[env: NAME=...]` is its variable.
pub fn help_options(help: &str) -> Vec<HelpOption> {
    let mut blocks: Vec<String> = Vec::new();
    let mut in_options = false;
    for line in help.lines() {
        let trimmed = line.trim_start();
        let indent = line.len() - trimmed.len();
        if !line.starts_with(' ') {
            // A section header: `Options:`, `Arguments:`, `Commands:`.
            in_options = line.trim_end().ends_with("Options:");
            continue;
        }
        if !in_options {
            continue;
        }
        if indent <= 6 && trimmed.starts_with('-') {
            blocks.push(trimmed.to_owned());
        } else if let Some(block) = blocks.last_mut() {
            block.push(' ');
            block.push_str(trimmed);
        }
    }
    blocks
        .iter()
        .filter_map(|block| {
            let head = block.split_whitespace().find(|w| w.starts_with("--"))?;
            let long: String = head
                .trim_end_matches(',')
                .chars()
                .take_while(|&c| flag_char(c))
                .collect();
            let env = block.split("[env: ").nth(1).map(|rest| {
                rest.chars()
                    .take_while(|&c| env_char(c))
                    .collect::<String>()
            });
            Some(HelpOption { long, env })
        })
        .collect()
}

/// The subcommands a clap help text lists under `Commands:` (not `help`).
pub fn help_subcommands(help: &str) -> Vec<String> {
    let mut names = Vec::new();
    let mut in_commands = false;
    for line in help.lines() {
        if !line.starts_with(' ') {
            in_commands = line.trim_end() == "Commands:";
            continue;
        }
        if in_commands
            && let Some(name) = line.split_whitespace().next()
            && name != "help"
        {
            names.push(name.to_owned());
        }
    }
    names
}

/// What `reference` lacks of `bin`'s command line: every subcommand (by
/// its `--help`), each long flag it prints, and each flag's environment
/// variable on the same line as the flag (a table row). `expected` are the
/// subcommands the contract fixes; the help must list at least those.
pub fn undocumented_options(bin: &Path, expected: &[&str], reference: &str) -> Vec<String> {
    let name = bin
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let top = run_help(bin, &["--help"]);
    let subcommands = help_subcommands(&top);
    for want in expected {
        assert!(
            subcommands.iter().any(|s| s == want),
            "{name} --help does not list the subcommand {want}: {subcommands:?}\n{top}"
        );
    }
    let mut missing = Vec::new();
    let mut helps = vec![(String::new(), top)];
    for sub in &subcommands {
        helps.push((format!(" {sub}"), run_help(bin, &[sub, "--help"])));
    }
    let lines: Vec<&str> = reference.lines().collect();
    for (sub, help) in &helps {
        if !sub.is_empty() && !mentions(reference, &format!("{name}{sub}"), flag_char) {
            missing.push(format!("the command `{name}{sub}`"));
        }
        let options = help_options(help);
        assert!(
            !options.is_empty(),
            "no options found in `{name}{sub} --help`:\n{help}"
        );
        for option in options {
            if !mentions(reference, &option.long, flag_char) {
                missing.push(format!("{name}{sub}: the flag {}", option.long));
                continue;
            }
            if let Some(env) = &option.env {
                let row = lines
                    .iter()
                    .any(|l| mentions(l, &option.long, flag_char) && mentions(l, env, env_char));
                if !row {
                    missing.push(format!(
                        "{name}{sub}: {} with its environment variable {env} on one line",
                        option.long
                    ));
                }
            }
        }
    }
    missing
}

/// The anchor GitHub gives a heading: lowercase, punctuation other than
/// `-` and `_` dropped, spaces as `-`.
pub fn slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|&c| c.is_alphanumeric() || c == '-' || c == '_' || c == ' ')
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

/// The anchors of a Markdown text's headings (outside code blocks), with
/// GitHub's `-1`, `-2`, ... for repeated ones.
pub fn anchors(markdown: &str) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    let mut in_code = false;
    for line in markdown.lines() {
        if line.trim_start().starts_with("```") {
            in_code = !in_code;
            continue;
        }
        if in_code || !line.starts_with('#') {
            continue;
        }
        let base = slug(line.trim_start_matches('#'));
        let mut anchor = base.clone();
        let mut n = 0;
        while out.contains(&anchor) {
            n += 1;
            anchor = format!("{base}-{n}");
        }
        out.push(anchor);
    }
    out
}

/// The targets of a Markdown text's inline links, `[text](target)`.
pub fn link_targets(markdown: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = markdown;
    while let Some(at) = rest.find("](") {
        rest = &rest[at + 2..];
        if let Some(end) = rest.find(')') {
            out.push(rest[..end].to_owned());
            rest = &rest[end..];
        }
    }
    out
}
