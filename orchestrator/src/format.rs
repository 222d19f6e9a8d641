//! How numbers read wherever a person sees them (`top`, `report`, `status`, the progress line,
//! the memory plan): counts, rates, bytes, durations and times. Thin wrappers over `indicatif`'s
//! `HumanBytes` and `HumanFloatCount` where those read right.

use indicatif::{HumanBytes, HumanFloatCount};

/// A number in a few characters, for chart axes and tables: `1.5k`, `2M`, `0.25`, `12`.
pub fn compact(v: f64) -> String {
    let a = v.abs();
    let (scaled, suffix) = if a >= 1e9 {
        (v / 1e9, "G")
    } else if a >= 1e6 {
        (v / 1e6, "M")
    } else if a >= 1e4 {
        (v / 1e3, "k")
    } else {
        (v, "")
    };
    let text = if scaled == scaled.round() || scaled.abs() >= 100.0 {
        format!("{scaled:.0}")
    } else if scaled.abs() >= 10.0 {
        format!("{scaled:.1}")
    } else if scaled.abs() >= 0.1 {
        format!("{scaled:.2}")
    } else {
        format!("{scaled:.3}")
    };
    let text = if text.contains('.') {
        text.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        text
    };
    format!("{text}{suffix}")
}

/// A count with its digits grouped: 12345678 as `12,345,678` (negative counts read 0).
pub fn grouped(v: f64) -> String {
    format!("{:.0}", HumanFloatCount(v.max(0.0)))
}

/// A rate at a glance with its unit: `950 tok/s`, `1.2 Ktok/s`, `3.4 M` (an empty unit).
pub fn rate(v: f64, unit: &str) -> String {
    let (scaled, prefix) = match v.abs() {
        a if a >= 1e9 => (v / 1e9, "G"),
        a if a >= 1e6 => (v / 1e6, "M"),
        a if a >= 1e3 => (v / 1e3, "K"),
        _ => (v, ""),
    };
    match (prefix, unit) {
        ("", "") => format!("{v:.0}"),
        ("", _) => format!("{v:.0} {unit}"),
        _ => format!("{scaled:.1} {prefix}{unit}"),
    }
}

/// A size in binary units: `512 B`, `50.00 MiB`.
pub fn bytes(b: u64) -> String {
    HumanBytes(b).to_string()
}

/// A size in GiB with two decimals, as memory plans compare them: `71.52 GiB`.
pub fn gib(n: u64) -> String {
    format!("{:.2} GiB", n as f64 / f64::from(1u32 << 30))
}

/// A span in a few characters, days and hours for multi-day runs: `2d07h`, `5h12m`, `3m05s`
/// (for ETAs, uptimes; a negative or unknown span reads `0m00s`).
pub fn clock(seconds: f64) -> String {
    let seconds = if seconds.is_finite() {
        seconds.clamp(0.0, 1e12) as u64
    } else {
        0
    };
    span(seconds, ["d", "h", "m", "s"], "", 2)
}

/// A span spelled out, for reports: `12.5 s`, `3 min 05 s`, `1 h 02 min 03 s`,
/// `2 d 07 h 04 min` (`-` when unknown).
pub fn duration(seconds: f64) -> String {
    if !seconds.is_finite() || seconds < 0.0 {
        return "-".into();
    }
    if seconds < 60.0 {
        return format!("{seconds:.1} s");
    }
    span(seconds.round() as u64, [" d", " h", " min", " s"], " ", 3)
}

/// `seconds` in days, hours, minutes and seconds: `parts` of them from the largest that is not
/// zero (minutes at least), each with its unit, the later ones on two digits.
fn span(seconds: u64, units: [&str; 4], separator: &str, parts: usize) -> String {
    let values = [
        seconds / 86_400,
        seconds / 3600 % 24,
        seconds / 60 % 60,
        seconds % 60,
    ];
    let first = values[..2].iter().position(|&v| v > 0).unwrap_or(2);
    (first..(first + parts).min(4))
        .map(|i| {
            if i == first {
                format!("{}{}", values[i], units[i])
            } else {
                format!("{:02}{}", values[i], units[i])
            }
        })
        .collect::<Vec<_>>()
        .join(separator)
}

/// Unix seconds as `2025-01-31 12:00:05 UTC` (`-` when out of range).
pub fn utc(t: f64) -> String {
    if !t.is_finite() || !(0.0..1e11).contains(&t) {
        return "-".into();
    }
    let secs = t.floor() as i64;
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // Days since 1970-01-01 to a civil date (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02} {:02}:{:02}:{:02} UTC",
        rem / 3600,
        rem / 60 % 60,
        rem % 60
    )
}

/// Outside text (a server's body, a worker's last words) for an error message: at most `max`
/// bytes of it, cut at a character boundary, saying how long the whole was.
pub fn clip(text: &str, max: usize) -> String {
    if text.len() <= max {
        return text.to_owned();
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}… ({} bytes in all)", &text[..end], text.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outside_text_is_clipped_at_a_character_boundary() {
        assert_eq!(clip("short", 10), "short");
        let long = "é".repeat(1000);
        let c = clip(&long, 101);
        assert!(
            c.starts_with(&"é".repeat(50)) && c.ends_with("(2000 bytes in all)"),
            "{c}"
        );
        assert!(c.len() < 140);
    }

    #[test]
    fn numbers_read_compactly() {
        assert_eq!(compact(1500.0), "1500");
        assert_eq!(compact(15_000.0), "15k");
        assert_eq!(compact(2_000_000.0), "2M");
        assert_eq!(compact(1_500_000.0), "1.5M");
        assert_eq!(compact(250_000.0), "250k");
        assert_eq!(compact(0.25), "0.25");
        assert_eq!(compact(0.0123), "0.012");
        assert_eq!(grouped(12_345_678.4), "12,345,678");
        assert_eq!(grouped(999.0), "999");
        assert_eq!(grouped(-3.0), "0");
        assert_eq!(rate(950.0, "tok/s"), "950 tok/s");
        assert_eq!(rate(123_456.0, "tok/s"), "123.5 Ktok/s");
        assert_eq!(rate(123_456.0, ""), "123.5 K");
        assert_eq!(rate(950.0, ""), "950");
        assert_eq!(bytes(52_428_800), "50.00 MiB");
        assert_eq!(bytes(512), "512 B");
        assert_eq!(gib(3 << 29), "1.50 GiB");
    }

    #[test]
    fn durations_read_in_days_and_hours_for_long_runs() {
        assert_eq!(clock(185.0), "3m05s");
        assert_eq!(clock(5.0 * 3600.0 + 12.0 * 60.0 + 59.0), "5h12m");
        assert_eq!(clock(2.0 * 86_400.0 + 7.0 * 3600.0 + 1.0), "2d07h");
        assert_eq!(clock(86_400.0), "1d00h");
        assert_eq!(clock(f64::NAN), "0m00s");
        assert_eq!(clock(-5.0), "0m00s");
        assert_eq!(duration(12.54), "12.5 s");
        assert_eq!(duration(185.0), "3 min 05 s");
        assert_eq!(duration(3723.0), "1 h 02 min 03 s");
        assert_eq!(
            duration(2.0 * 86_400.0 + 7.0 * 3600.0 + 240.0),
            "2 d 07 h 04 min"
        );
        assert_eq!(duration(86_400.0 + 300.0), "1 d 00 h 05 min");
        assert_eq!(duration(60.0), "1 min 00 s");
        assert_eq!(duration(f64::NAN), "-");
        assert_eq!(utc(0.0), "1970-01-01 00:00:00 UTC");
        assert_eq!(utc(1_738_324_805.0), "2025-01-31 12:00:05 UTC");
        assert_eq!(utc(1_700_000_000.5), "2023-11-14 22:13:20 UTC");
        assert_eq!(utc(951_782_400.0), "2000-02-29 00:00:00 UTC");
        assert_eq!(utc(-1.0), "-");
    }
}
