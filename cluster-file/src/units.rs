//! Sizes (`64M`) and durations (`2s`, `500ms`) as written in cluster files and on command lines.

use std::time::Duration;

/// Parses a size in bytes: a number with an optional K, M or G suffix (powers of 1024).
///
/// # Errors
/// A message naming the accepted forms.
pub fn parse_size(text: &str) -> Result<u64, String> {
    let text = text.trim();
    let (digits, multiplier) = match text.chars().last() {
        Some('K' | 'k') => (&text[..text.len() - 1], 1u64 << 10),
        Some('M' | 'm') => (&text[..text.len() - 1], 1 << 20),
        Some('G' | 'g') => (&text[..text.len() - 1], 1 << 30),
        _ => (text, 1),
    };
    digits
        .trim()
        .parse::<u64>()
        .ok()
        .and_then(|number| number.checked_mul(multiplier))
        .ok_or_else(|| format!("`{text}` is not a size: use bytes or a number with K, M or G (for example \"64M\")"))
}

/// Parses a duration: a number with `ms`, `s` or `m`.
///
/// # Errors
/// A message naming the accepted forms.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    let invalid = || {
        format!("`{text}` is not a duration: use a number with us, ms, s or m (for example \"2s\")")
    };
    let (digits, unit) = if let Some(digits) = text.strip_suffix("ms") {
        (digits, Duration::from_millis(1))
    } else if let Some(digits) = text.strip_suffix("us").or_else(|| text.strip_suffix("µs")) {
        (digits, Duration::from_micros(1))
    } else if let Some(digits) = text.strip_suffix('s') {
        (digits, Duration::from_secs(1))
    } else if let Some(digits) = text.strip_suffix('m') {
        (digits, Duration::from_secs(60))
    } else {
        return Err(invalid());
    };
    let number: u32 = digits.trim().parse().map_err(|_| invalid())?;
    Ok(unit * number)
}

/// Formats bytes for tables: `64.0 MiB`.
pub fn format_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_and_durations_parse() {
        assert_eq!(parse_size("64M"), Ok(64 << 20));
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("2g"), Ok(2 << 30));
        assert!(parse_size("lots").unwrap_err().contains("64M"));
        assert_eq!(parse_duration("2s"), Ok(Duration::from_secs(2)));
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("1m"), Ok(Duration::from_secs(60)));
        assert_eq!(parse_duration("30us"), Ok(Duration::from_micros(30)));
        assert_eq!(parse_duration("30µs"), Ok(Duration::from_micros(30)));
        assert!(parse_duration("2").unwrap_err().contains("us, ms, s or m"));
        assert_eq!(format_bytes(64 << 20), "64.0 MiB");
        assert_eq!(format_bytes(12), "12 B");
    }
}
