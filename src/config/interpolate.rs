//! `${VAR}` substitution in `sb.yml`, done on the text before YAML parsing
//! (as the proxy does), so a value can also supply YAML structure.

use super::{EnvLookup, Problem};

/// Replaces environment references in `text`.
///
/// - `${NAME}` becomes the value of `NAME`. **An unset variable becomes the
///   empty string**, as in a shell; the sidecar treats an empty optional
///   value as absent, so `node_id: ${SBPROXY_POD_NAME}` falls back to the
///   default when the variable is unset.
/// - `${NAME:-default}` becomes the value of `NAME`, or `default` when `NAME`
///   is unset *or empty* (shell semantics). The default may itself contain
///   `${...}` references.
/// - `$${` is an escape for a literal `${`.
/// - A `$` not followed by `{` is kept as it is (`$NAME` is not expanded).
///
/// `NAME` is `[A-Za-z_][A-Za-z0-9_]*`. An unterminated `${` (no `}` on the
/// same line), an invalid name or another shell form (`${A-b}`, `${A:?e}`)
/// is a [`Problem`] located as `line L, column C`. Substitution happens
/// everywhere in the text, comments included.
pub fn interpolate(text: &str, env: &EnvLookup<'_>) -> Result<String, Problem> {
    let mut out = String::with_capacity(text.len());
    expand(text, 0, text, env, &mut out)?;
    Ok(out)
}

/// Expands `segment`, which starts at byte `base` of `whole` (for locating problems).
fn expand(
    segment: &str,
    base: usize,
    whole: &str,
    env: &EnvLookup<'_>,
    out: &mut String,
) -> Result<(), Problem> {
    let mut pos = 0;
    while let Some(found) = segment[pos..].find('$') {
        let start = pos + found;
        out.push_str(&segment[pos..start]);
        let rest = &segment[start..];
        if rest.starts_with("$${") {
            out.push_str("${");
            pos = start + 3;
        } else if rest.starts_with("${") {
            let body_start = start + 2;
            let Some(body_len) = closing_brace(&segment[body_start..]) else {
                return Err(located(
                    whole,
                    base + start,
                    "unterminated `${`: close it with `}` on the same line, or write `$${` for a literal `${`",
                ));
            };
            let body = &segment[body_start..body_start + body_len];
            let (name, default) = match body.split_once(":-") {
                Some((name, default)) => (name, Some(default)),
                None => (body, None),
            };
            if !is_var_name(name) {
                return Err(located(
                    whole,
                    base + start,
                    format!(
                        "invalid reference `${{{}}}`; expected ${{NAME}} or ${{NAME:-default}} with NAME made of letters, digits and _ (not starting with a digit)",
                        truncate(body, 60)
                    ),
                ));
            }
            match (env(name).filter(|v| !v.is_empty()), default) {
                (Some(value), _) => out.push_str(&value),
                (None, Some(default)) => {
                    let default_base = base + body_start + name.len() + 2;
                    expand(default, default_base, whole, env, out)?;
                }
                (None, None) => {}
            }
            pos = body_start + body_len + 1;
        } else {
            out.push('$');
            pos = start + 1;
        }
    }
    out.push_str(&segment[pos..]);
    Ok(())
}

/// The length of the body of a `${` whose body starts `body`, up to (not
/// including) its matching `}`, honouring nested `${...}` and `$${` escapes.
/// `None` when the line ends first.
fn closing_brace(body: &str) -> Option<usize> {
    let bytes = body.as_bytes();
    let mut depth = 1usize;
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'\n' => return None,
            b'$' if bytes[i..].starts_with(b"$${") => i += 3,
            b'$' if bytes[i..].starts_with(b"${") => {
                depth += 1;
                i += 2;
            }
            b'}' => {
                depth -= 1;
                if depth == 0 {
                    return Some(i);
                }
                i += 1;
            }
            _ => i += 1,
        }
    }
    None
}

fn is_var_name(name: &str) -> bool {
    let mut chars = name.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// A problem at byte `offset` of `whole`, located as `line L, column C` (1-based, columns in characters).
fn located(whole: &str, offset: usize, message: impl Into<String>) -> Problem {
    let before = &whole[..offset];
    let line = before.matches('\n').count() + 1;
    let line_start = before.rfind('\n').map_or(0, |i| i + 1);
    let column = before[line_start..].chars().count() + 1;
    Problem::error(format!("line {line}, column {column}"), message)
}

fn truncate(text: &str, max_chars: usize) -> String {
    if text.chars().count() <= max_chars {
        text.to_string()
    } else {
        let cut: String = text.chars().take(max_chars).collect();
        format!("{cut}…")
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

    fn run(text: &str, pairs: &[(&str, &str)]) -> Result<String, Problem> {
        interpolate(text, &env_of(pairs))
    }

    #[test]
    fn replaces_set_variables() {
        assert_eq!(run("a: ${A}", &[("A", "1")]).unwrap(), "a: 1");
        assert_eq!(
            run("${A}${B} and ${A}", &[("A", "x"), ("B", "y")]).unwrap(),
            "xy and x"
        );
        assert_eq!(run("${_A1}", &[("_A1", "ok")]).unwrap(), "ok");
    }

    #[test]
    fn unset_variable_without_default_is_empty() {
        assert_eq!(run("node_id: ${POD}\n", &[]).unwrap(), "node_id: \n");
    }

    #[test]
    fn default_applies_when_unset_or_empty() {
        assert_eq!(run("${A:-d}", &[]).unwrap(), "d");
        assert_eq!(run("${A:-d}", &[("A", "")]).unwrap(), "d");
        assert_eq!(run("${A:-d}", &[("A", "v")]).unwrap(), "v");
        assert_eq!(run("${A:-}", &[]).unwrap(), "");
        assert_eq!(
            run("url: ${U:-http://h:80/x?a=b}", &[]).unwrap(),
            "url: http://h:80/x?a=b"
        );
        // only the first ":-" separates
        assert_eq!(run("${A:-x:-y}", &[]).unwrap(), "x:-y");
    }

    #[test]
    fn defaults_nest() {
        assert_eq!(run("${A:-${B}}", &[("B", "b")]).unwrap(), "b");
        assert_eq!(run("${A:-${B:-c}}", &[]).unwrap(), "c");
        assert_eq!(run("${A:-pre-${B:-c}-post}", &[]).unwrap(), "pre-c-post");
        assert_eq!(run("${A:-${B}}", &[("A", "a"), ("B", "b")]).unwrap(), "a");
    }

    #[test]
    fn escapes() {
        assert_eq!(run("$${A}", &[("A", "1")]).unwrap(), "${A}");
        assert_eq!(
            run("x: $${A:-b} ${A}", &[("A", "1")]).unwrap(),
            "x: ${A:-b} 1"
        );
        assert_eq!(run("${A:-$${lit}}", &[]).unwrap(), "${lit}");
        // an escaped `${` opens nothing, so the next `}` closes the reference
        assert_eq!(run("${A:-a$${b}c}", &[]).unwrap(), "a${bc}");
    }

    #[test]
    fn lone_dollars_are_kept() {
        assert_eq!(
            run("price: $5 $A $$ $", &[("A", "no")]).unwrap(),
            "price: $5 $A $$ $"
        );
        assert_eq!(run("$}", &[]).unwrap(), "$}");
    }

    #[test]
    fn values_are_not_re_expanded() {
        assert_eq!(run("${A}", &[("A", "${B}"), ("B", "no")]).unwrap(), "${B}");
    }

    #[test]
    fn unicode_passes_through() {
        assert_eq!(run("é: ${A} ✓", &[("A", "ü")]).unwrap(), "é: ü ✓");
    }

    #[test]
    fn unterminated_is_located() {
        let p = run("a: 1\nb: x${A\nc: }", &[]).unwrap_err();
        assert_eq!(p.path, "line 2, column 5");
        assert!(p.message.starts_with("unterminated `${`"), "{}", p.message);
        assert!(p.is_error());

        let p = run("ü${", &[]).unwrap_err();
        assert_eq!(p.path, "line 1, column 2");

        let p = run("${A:-${B}", &[]).unwrap_err();
        assert_eq!(p.path, "line 1, column 1");
    }

    #[test]
    fn invalid_names_are_refused() {
        for bad in [
            "${}", "${1A}", "${A-b}", "${A:?e}", "${A B}", "${:-x}", "${A.B}",
        ] {
            let p = run(bad, &[]).unwrap_err();
            assert_eq!(p.path, "line 1, column 1", "{bad}");
            assert!(
                p.message.starts_with("invalid reference"),
                "{bad}: {}",
                p.message
            );
            assert!(p.message.contains("${NAME:-default}"), "{}", p.message);
        }
    }

    #[test]
    fn problems_inside_defaults_are_located_in_the_whole_text() {
        let p = run("x\n  ${A:-${1}}", &[]).unwrap_err();
        assert_eq!(p.path, "line 2, column 8");
    }

    #[test]
    fn long_bad_references_are_truncated_in_messages() {
        let text = format!("${{{}!}}", "A".repeat(500));
        let p = run(&text, &[]).unwrap_err();
        assert!(p.message.len() < 300, "{}", p.message);
    }
}
