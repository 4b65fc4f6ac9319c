//! The `exec` provider: the user's command, called as
//! `COMMAND present|cleanup FQDN VALUE` (FQDN with its trailing dot), for
//! every DNS service without a provider of its own. Exit status 0 is
//! success; anything else fails the step with the end of its stderr.

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use super::DnsError;
use crate::config::Dns01Section;

/// How long one call may take before it is killed and counts as failed.
const CALL_LIMIT: Duration = Duration::from_secs(120);
/// How much of the command's stderr an error quotes (its end).
const STDERR_QUOTED: usize = 400;

pub(super) struct Exec {
    command: PathBuf,
}

impl Exec {
    pub(super) fn new(section: &Dns01Section) -> Result<Self, DnsError> {
        let command = section
            .command
            .clone()
            .ok_or_else(|| DnsError::Config("provider exec needs dns01.command".to_owned()))?;
        Ok(Self { command })
    }

    /// Calls `command present|cleanup fqdn value`.
    pub(super) async fn run(&self, add: bool, fqdn: &str, value: &str) -> Result<(), DnsError> {
        let op = if add { "present" } else { "cleanup" };
        let failed = |detail: String| DnsError::Hook {
            command: self.command.display().to_string(),
            op,
            detail,
        };
        let child = tokio::process::Command::new(&self.command)
            .args([op, fqdn, value])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| failed(format!("cannot run it: {e}")))?;
        let output = tokio::time::timeout(CALL_LIMIT, child.wait_with_output())
            .await
            .map_err(|_| failed(format!("still running after {CALL_LIMIT:?}; killed")))?
            .map_err(|e| failed(e.to_string()))?;
        if output.status.success() {
            return Ok(());
        }
        let stderr = String::from_utf8_lossy(&output.stderr);
        let stderr = stderr.trim();
        let tail: String = {
            let chars: Vec<char> = stderr.chars().collect();
            chars[chars.len().saturating_sub(STDERR_QUOTED)..]
                .iter()
                .collect()
        };
        Err(failed(format!(
            "{}{}",
            output.status,
            if tail.is_empty() {
                String::new()
            } else {
                format!(": {}", tail.replace('\n', " | "))
            }
        )))
    }
}
