//! Command-line values the binaries share, parsed into bounded types at the flag so a bad
//! value is a usage error naming the flag, never a panic deeper in (`Duration::from_secs_f64`
//! panics on infinity, NaN, negatives and anything of 2^64 seconds or more).

use std::time::Duration;

/// The longest wait any flag may ask for: one year.
pub const MAX_SECONDS: f64 = 365.0 * 24.0 * 3600.0;

/// Parses a number of seconds (fractions allowed) between 0 and [`MAX_SECONDS`]; for clap's
/// `value_parser`, which prefixes the flag's name to the error.
pub fn parse_seconds(s: &str) -> Result<Duration, String> {
    let v: f64 = s
        .trim()
        .parse()
        .map_err(|_| format!("`{s}` is not a number of seconds (e.g. 30 or 0.5)"))?;
    if !v.is_finite() || !(0.0..=MAX_SECONDS).contains(&v) {
        return Err(format!(
            "{s} seconds is out of range: give a number from 0 to {MAX_SECONDS} (one year)"
        ));
    }
    Ok(Duration::from_secs_f64(v))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seconds_are_bounded_and_bad_values_named() {
        assert_eq!(parse_seconds("10").unwrap(), Duration::from_secs(10));
        assert_eq!(parse_seconds("0.25").unwrap(), Duration::from_millis(250));
        assert_eq!(parse_seconds("0").unwrap(), Duration::ZERO);
        assert_eq!(
            parse_seconds("31536000").unwrap(),
            Duration::from_secs(31_536_000)
        );
        for bad in [
            "inf",
            "-inf",
            "NaN",
            "1e20",
            "18446744073709551616",
            "-1",
            "31536001",
        ] {
            let e = parse_seconds(bad).unwrap_err();
            assert!(e.contains("out of range") && e.contains(bad), "{bad}: {e}");
        }
        let e = parse_seconds("ten").unwrap_err();
        assert!(e.contains("not a number of seconds"), "{e}");
    }
}
