//! SigV4's `X-Amz-Date` form, `YYYYMMDDTHHMMSSZ` (UTC), both ways: read from a request head,
//! written into the string an event frame's signature covers.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::calendar::{civil_from_days, days_from_civil};

/// `YYYYMMDDTHHMMSSZ` to a time.
pub fn parse_amz_date(s: &str) -> Option<SystemTime> {
    let b = s.as_bytes();
    if b.len() != 16 || b[8] != b'T' || b[15] != b'Z' {
        return None;
    }
    let num = |r: std::ops::Range<usize>| -> Option<i64> {
        let part = s.get(r)?;
        if !part.bytes().all(|c| c.is_ascii_digit()) {
            return None;
        }
        part.parse().ok()
    };
    let (y, mo, d) = (num(0..4)?, num(4..6)?, num(6..8)?);
    let (h, mi, se) = (num(9..11)?, num(11..13)?, num(13..15)?);
    if !(1..=12).contains(&mo) || !(1..=31).contains(&d) || h > 23 || mi > 59 || se > 60 {
        return None;
    }
    let secs = days_from_civil(y, mo, d) * 86_400 + h * 3600 + mi * 60 + se;
    u64::try_from(secs)
        .ok()
        .map(|s| UNIX_EPOCH + Duration::from_secs(s))
}

/// A time as `YYYYMMDDTHHMMSSZ`, and its day `YYYYMMDD` (whole seconds; before 1970 reads as 1970).
pub fn format_amz_date(at: SystemTime) -> (String, String) {
    let secs = at.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let days = i64::try_from(secs / 86_400).unwrap_or(i64::MAX);
    let (y, m, d) = civil_from_days(days);
    let rest = secs % 86_400;
    let day = format!("{y:04}{m:02}{d:02}");
    let date_time = format!(
        "{day}T{:02}{:02}{:02}Z",
        rest / 3600,
        rest % 3600 / 60,
        rest % 60
    );
    (date_time, day)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dates_read_and_write_back() {
        for text in [
            "20260101T000000Z",
            "20240229T235959Z",
            "19700101T000000Z",
            "21000301T120000Z",
        ] {
            let at = parse_amz_date(text).unwrap();
            let (date_time, day) = format_amz_date(at);
            assert_eq!(date_time, text);
            assert_eq!(day, &text[..8]);
        }
        assert_eq!(parse_amz_date("20260101T000000"), None);
        assert_eq!(parse_amz_date("20261301T000000Z"), None);
        let later = UNIX_EPOCH + Duration::from_millis(1_767_225_600_999);
        assert_eq!(
            format_amz_date(later).0,
            "20260101T000000Z",
            "sub-seconds dropped"
        );
    }
}
