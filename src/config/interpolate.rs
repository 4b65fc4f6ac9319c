//! `${VAR}` substitution in `sb.yml`, done on the text before YAML parsing,
//! exactly as sbproxy 1.13 does it, so that the sidecar and the proxy read
//! the same values from the same file.

use super::{EnvLookup, MAX_CONFIG_BYTES, Problem};

/// The result of [`interpolate_report`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Interpolated {
    /// The text with every resolved reference replaced.
    pub text: String,
    /// References whose variable is not set and that have no default,
    /// kept literally in `text`, in file order.
    pub unresolved: Vec<Unresolved>,
    /// The substituted text would be larger than `MAX_CONFIG_BYTES`:
    /// `text` stops before the value that crossed it. A few references to a
    /// large variable must not multiply into gigabytes.
    pub oversized: bool,
}

impl Interpolated {
    /// The error of an [`Interpolated::oversized`] text.
    pub(crate) fn oversized_problem() -> Problem {
        Problem::error(
            "(file)",
            format!(
                "larger than {} MiB once ${{VAR}} references are substituted; \
                 the sidecar parses at most that much (shorten the variables' values \
                 or reference them less often)",
                MAX_CONFIG_BYTES >> 20
            ),
        )
    }
}

/// A `${NAME}` left as written because `NAME` is not set.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unresolved {
    /// The variable's name.
    pub name: String,
    /// 1-based line of the reference in the original text.
    pub line: usize,
    /// 1-based column (in characters).
    pub column: usize,
}

impl Unresolved {
    /// The warning `validate` and `run` print for it.
    pub(crate) fn warning(&self) -> Problem {
        Problem::warning(
            format!("line {}, column {}", self.line, self.column),
            format!(
                "${{{}}} is kept as written: the environment variable {} is not set (the proxy \
                 does the same); set it, or write ${{{}:-default}}",
                self.name, self.name, self.name
            ),
        )
    }
}

/// Replaces environment references in `text`, as [`interpolate_report`]
/// does, and returns the text only.
pub fn interpolate(text: &str, env: &EnvLookup<'_>) -> String {
    interpolate_report(text, env).text
}

/// Replaces environment references in `text`, as the proxy does:
///
/// - `$$` is a literal `$` (so `$${A}` is the text `${A}`);
/// - `${NAME}` becomes the value of `NAME` (empty when it is set but empty);
///   when `NAME` is not set it is **kept as written** and reported in
///   [`Interpolated::unresolved`];
/// - `${NAME:-default}` becomes the value of `NAME`, or `default` when
///   `NAME` is unset *or empty*; `default` runs to the first `}` and is
///   taken literally;
/// - anything else (`$NAME`, `${A-b}`, an unclosed `${`) is kept as it is.
///
/// `NAME` is `[A-Za-z_][A-Za-z0-9_]*`. Substitution happens everywhere in
/// the text, comments included. Never fails: whatever is not a reference
/// is text.
pub fn interpolate_report(text: &str, env: &EnvLookup<'_>) -> Interpolated {
    let limit = usize::try_from(MAX_CONFIG_BYTES).unwrap_or(usize::MAX);
    let mut out = String::with_capacity(text.len().min(limit));
    let mut unresolved = Vec::new();
    let mut here = Cursor::default();
    let mut pos = 0;
    while let Some(found) = text[pos..].find('$') {
        let start = pos + found;
        out.push_str(&text[pos..start]);
        let rest = &text[start..];
        if rest.starts_with("$$") {
            out.push('$');
            pos = start + 2;
            continue;
        }
        match reference(rest) {
            Some((len, name, default)) => {
                let fits = match (env(name), default) {
                    (Some(value), None) => push_bounded(&mut out, &value, limit),
                    (Some(value), Some(_)) if !value.is_empty() => {
                        push_bounded(&mut out, &value, limit)
                    }
                    (_, Some(default)) => push_bounded(&mut out, default, limit),
                    (None, None) => {
                        out.push_str(&rest[..len]);
                        let (line, column) = here.advance(text, start);
                        unresolved.push(Unresolved {
                            name: name.to_owned(),
                            line,
                            column,
                        });
                        true
                    }
                };
                if !fits {
                    return Interpolated {
                        text: out,
                        unresolved,
                        oversized: true,
                    };
                }
                pos = start + len;
            }
            None => {
                out.push('$');
                pos = start + 1;
            }
        }
    }
    out.push_str(&text[pos..]);
    Interpolated {
        oversized: out.len() > limit,
        text: out,
        unresolved,
    }
}

/// Appends `value` unless that takes `out` past `limit`; `false` then
/// (nothing appended: the value may be huge and the result is refused).
fn push_bounded(out: &mut String, value: &str, limit: usize) -> bool {
    let fits = out.len().saturating_add(value.len()) <= limit;
    if fits {
        out.push_str(value);
    }
    fits
}

/// `${NAME}` or `${NAME:-default}` at the start of `text`: its length, the
/// name and the default.
fn reference(text: &str) -> Option<(usize, &str, Option<&str>)> {
    let body = text.strip_prefix("${")?;
    let close = body.find(['}', '\n'])?;
    if body.as_bytes()[close] != b'}' {
        return None;
    }
    let inner = &body[..close];
    let (name, default) = match inner.split_once(":-") {
        Some((name, default)) => (name, Some(default)),
        None => (inner, None),
    };
    is_var_name(name).then_some((close + 3, name, default))
}

fn is_var_name(name: &str) -> bool {
    let mut chars = name.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// Line and column of references in file order, each found from the
/// previous one: a file with many unresolved references is scanned once,
/// not once per reference.
#[derive(Default)]
struct Cursor {
    /// Byte offset reached.
    offset: usize,
    /// 0-based line at `offset`.
    line: usize,
    /// Byte offset where that line starts.
    line_start: usize,
}

impl Cursor {
    /// 1-based line and column (in characters) of byte `offset` of
    /// `text`; offsets must not go backwards.
    fn advance(&mut self, text: &str, offset: usize) -> (usize, usize) {
        let span = &text[self.offset..offset];
        self.line += span.matches('\n').count();
        if let Some(i) = span.rfind('\n') {
            self.line_start = self.offset + i + 1;
        }
        self.offset = offset;
        (
            self.line + 1,
            text[self.line_start..offset].chars().count() + 1,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env_of(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> + use<> {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |name| map.get(name).cloned()
    }

    fn run(text: &str, pairs: &[(&str, &str)]) -> String {
        interpolate(text, &env_of(pairs))
    }

    #[test]
    fn replaces_set_variables() {
        assert_eq!(run("a: ${A}", &[("A", "1")]), "a: 1");
        assert_eq!(
            run("${A}${B} and ${A}", &[("A", "x"), ("B", "y")]),
            "xy and x"
        );
        assert_eq!(run("${_A1}", &[("_A1", "ok")]), "ok");
        assert_eq!(run("a: ${A}", &[("A", "")]), "a: ");
    }

    #[test]
    fn unset_variables_are_kept_and_reported() {
        let r = interpolate_report("x: 1\nnode_id: é${POD}\n", &env_of(&[]));
        assert_eq!(r.text, "x: 1\nnode_id: é${POD}\n");
        assert_eq!(
            r.unresolved,
            vec![Unresolved {
                name: "POD".into(),
                line: 2,
                column: 11
            }]
        );
        let w = r.unresolved[0].warning();
        assert!(!w.is_error());
        assert_eq!(w.path, "line 2, column 11");
        assert!(w.message.contains("POD is not set"), "{}", w.message);
    }

    #[test]
    fn default_applies_when_unset_or_empty() {
        assert_eq!(run("${A:-d}", &[]), "d");
        assert_eq!(run("${A:-d}", &[("A", "")]), "d");
        assert_eq!(run("${A:-d}", &[("A", "v")]), "v");
        assert_eq!(run("${A:-}", &[]), "");
        assert_eq!(
            run("url: ${U:-http://h:80/x?a=b}", &[]),
            "url: http://h:80/x?a=b"
        );
        // only the first ":-" separates, and the default is literal
        assert_eq!(run("${A:-x:-y}", &[]), "x:-y");
        assert_eq!(run("${A:-$B}", &[("B", "no")]), "$B");
    }

    #[test]
    fn double_dollar_is_a_dollar() {
        assert_eq!(run("$${A}", &[("A", "1")]), "${A}");
        assert_eq!(run("price: $$5 $$$$", &[]), "price: $5 $$");
        assert_eq!(run("x: $${A:-b} ${A}", &[("A", "1")]), "x: ${A:-b} 1");
    }

    #[test]
    fn other_forms_are_kept_as_written() {
        for text in [
            "price: $5 $A $",
            "${A-b}",
            "${A:?e}",
            "${}",
            "${1A}",
            "${A B}",
            "b: x${A\nc: }",
            "$}",
            "${",
        ] {
            assert_eq!(run(text, &[("A", "no")]), text, "{text}");
        }
    }

    #[test]
    fn values_are_not_re_expanded() {
        assert_eq!(run("${A}", &[("A", "${B}"), ("B", "no")]), "${B}");
    }

    #[test]
    fn unicode_passes_through() {
        assert_eq!(run("é: ${A} ✓", &[("A", "ü")]), "é: ü ✓");
    }
}

/// The name of the first `${NAME}` left in an interpolated value: a
/// variable that was not set (the proxy keeps such a reference as written;
/// one with a default was replaced). Read with `reference`(fn@reference), as
/// [`interpolate_report`] reads them.
pub fn unresolved_in(value: &str) -> Option<&str> {
    value
        .match_indices("${")
        .find_map(|(at, _)| match reference(&value[at..]) {
            Some((_, name, None)) => Some(name),
            _ => None,
        })
}

/// What is wrong with a value the sidecar uses that still holds `${name}`.
pub fn unresolved_message(name: &str) -> String {
    format!(
        "uses ${{{name}}}, but the environment variable {name} is not set; set it, or \
         write ${{{name}:-default}}"
    )
}

#[cfg(test)]
mod unresolved_tests {
    #[test]
    fn the_first_reference_left_is_named() {
        assert_eq!(
            super::unresolved_in("${SBMESH_CLUSTER_KEY}"),
            Some("SBMESH_CLUSTER_KEY")
        );
        assert_eq!(super::unresolved_in("env:${A_1}x${B}"), Some("A_1"));
        assert_eq!(super::unresolved_in("${} $x ${nope"), None);
        assert_eq!(
            super::unresolved_in("${1A} ${B}"),
            Some("B"),
            "a name starts with a letter or _"
        );
        assert_eq!(super::unresolved_in("0123abcd"), None);
    }
}
