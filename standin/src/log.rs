//! One plain-text line per event on stderr, and RFC 3339 timestamps.

use std::time::{SystemTime, UNIX_EPOCH};

/// Writes `<RFC 3339 time> <level> <message>` to stderr.
pub fn line(level: &str, message: &str) {
    eprintln!("{} {level} {message}", rfc3339(SystemTime::now()));
}

macro_rules! info {
    ($($arg:tt)*) => { $crate::log::line("INFO", &format!($($arg)*)) };
}
macro_rules! warning {
    ($($arg:tt)*) => { $crate::log::line("WARN", &format!($($arg)*)) };
}
macro_rules! error {
    ($($arg:tt)*) => { $crate::log::line("ERROR", &format!($($arg)*)) };
}
pub(crate) use {error, info, warning};

/// `t` as `YYYY-MM-DDTHH:MM:SS.mmmZ` (UTC).
pub fn rfc3339(t: SystemTime) -> String {
    let since = t.duration_since(UNIX_EPOCH).unwrap_or_default();
    let secs = since.as_secs();
    let (days, rem) = (secs / 86_400, secs % 86_400);
    let (y, m, d) = civil_from_days(days as i64);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{:03}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60,
        since.subsec_millis()
    )
}

/// Proleptic Gregorian date of day `z` since 1970-01-01.
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    // Shift the epoch to 0000-03-01 so that leap days end each 400-year era.
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn formats_known_instants() {
        assert_eq!(rfc3339(UNIX_EPOCH), "1970-01-01T00:00:00.000Z");
        let t = UNIX_EPOCH + Duration::from_millis(951_782_400_123);
        assert_eq!(rfc3339(t), "2000-02-29T00:00:00.123Z");
        let t = UNIX_EPOCH + Duration::from_secs(1_796_114_068);
        assert_eq!(rfc3339(t), "2026-12-01T08:34:28.000Z");
    }
}
