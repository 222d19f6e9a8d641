//! Length workloads: the synthetic, seed-shaped one and the `--lengths FILE` parser.

use std::fmt;

use crate::planner::rng::{PlanRng, Purpose};

/// Median, log-sigma and clip range of the synthetic workload: the shape of the 902K-sample
/// dataset of the original pipeline (about 20% of samples between 3296 and 8192 tokens).
pub const SYNTHETIC_MEDIAN: f64 = 1500.0;
pub const SYNTHETIC_SIGMA: f64 = 0.944;
pub const SYNTHETIC_MIN: u32 = 16;
pub const SYNTHETIC_MAX: u32 = 8192;

/// `n` lengths drawn log-normal (median 1500, sigma 0.944), rounded, clipped to [16, 8192].
pub fn synthetic_lengths(n: usize, seed: u64) -> Vec<u32> {
    let mut rng = PlanRng::stream(seed, 0, Purpose::Synthetic);
    let mu = SYNTHETIC_MEDIAN.ln();
    (0..n)
        .map(|_| {
            let x = (mu + SYNTHETIC_SIGMA * rng.standard_normal()).exp().round();
            x.clamp(f64::from(SYNTHETIC_MIN), f64::from(SYNTHETIC_MAX)) as u32
        })
        .collect()
}

/// A line of a lengths file that is not a length.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub struct LengthsError {
    /// 1-based line number.
    pub line: usize,
    pub reason: LengthsErrorKind,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LengthsErrorKind {
    Negative(String),
    NotAnInteger(String),
    TooLarge(String),
    NotUtf8,
}

impl fmt::Display for LengthsError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "line {}: ", self.line)?;
        match &self.reason {
            LengthsErrorKind::Negative(v) => write!(f, "negative length {v:?}"),
            LengthsErrorKind::NotAnInteger(v) => {
                write!(f, "{v:?} is not a non-negative integer")
            }
            LengthsErrorKind::TooLarge(v) => {
                write!(f, "length {v:?} is too large (at most {})", u32::MAX)
            }
            LengthsErrorKind::NotUtf8 => f.write_str("not valid UTF-8 text"),
        }
    }
}

/// Parses one non-negative integer per line. Blank lines and surrounding whitespace are allowed;
/// anything else names its line.
pub fn parse_lengths(bytes: &[u8]) -> Result<Vec<u32>, LengthsError> {
    let mut out = Vec::with_capacity(bytes.len() / 5);
    for (i, raw) in bytes.split(|&b| b == b'\n').enumerate() {
        let line = i + 1;
        let text = std::str::from_utf8(raw).map_err(|_| LengthsError {
            line,
            reason: LengthsErrorKind::NotUtf8,
        })?;
        let text = text.trim();
        if text.is_empty() {
            continue;
        }
        if let Some(v) = fast_parse(text.as_bytes()) {
            out.push(v);
            continue;
        }
        let shown: String = text.chars().take(40).collect();
        let reason = if text.starts_with('-') && text[1..].bytes().all(|b| b.is_ascii_digit()) {
            LengthsErrorKind::Negative(shown)
        } else if !text.is_empty() && text.bytes().all(|b| b.is_ascii_digit()) {
            LengthsErrorKind::TooLarge(shown)
        } else {
            LengthsErrorKind::NotAnInteger(shown)
        };
        return Err(LengthsError { line, reason });
    }
    Ok(out)
}

/// Decimal digits to u32, `None` on anything else or overflow (an optional leading `+` is fine).
fn fast_parse(s: &[u8]) -> Option<u32> {
    let digits = s.strip_prefix(b"+").unwrap_or(s);
    if digits.is_empty() {
        return None;
    }
    let mut v: u32 = 0;
    for &b in digits {
        if !b.is_ascii_digit() {
            return None;
        }
        v = v.checked_mul(10)?.checked_add(u32::from(b - b'0'))?;
    }
    Some(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn synthetic_has_the_seed_shape() {
        let l = synthetic_lengths(200_000, 0);
        let mut s = l.clone();
        s.sort_unstable();
        let median = s[s.len() / 2];
        assert!((1450..1550).contains(&median), "median {median}");
        assert!(*s.first().unwrap() >= SYNTHETIC_MIN);
        assert_eq!(*s.last().unwrap(), SYNTHETIC_MAX);
        let long = l.iter().filter(|&&x| x > 3296).count() as f64 / l.len() as f64;
        assert!((0.18..0.22).contains(&long), "long share {long}");
        assert_eq!(l, synthetic_lengths(200_000, 0));
        assert_ne!(l, synthetic_lengths(200_000, 1));
    }

    #[test]
    fn parses_good_lines() {
        assert_eq!(
            parse_lengths(b"1\n 22 \r\n\n+3\n0").unwrap(),
            vec![1, 22, 3, 0]
        );
        assert_eq!(parse_lengths(b"").unwrap(), Vec::<u32>::new());
    }

    #[test]
    fn rejects_bad_lines_with_their_number() {
        let e = parse_lengths(b"1\n2\n-5\n").unwrap_err();
        assert_eq!(e.line, 3);
        assert!(e.to_string().contains("negative"), "{e}");
        let e = parse_lengths(b"1\n2.5\n").unwrap_err();
        assert_eq!(
            (e.line, e.to_string().contains("not a non-negative integer")),
            (2, true)
        );
        let e = parse_lengths(b"abc").unwrap_err();
        assert_eq!(e.line, 1);
        let e = parse_lengths(b"1\n99999999999\n").unwrap_err();
        assert!(e.to_string().contains("too large"), "{e}");
        let e = parse_lengths(b"1\n\xff\xfe\n").unwrap_err();
        assert_eq!((e.line, e.reason), (2, LengthsErrorKind::NotUtf8));
        assert!(parse_lengths(b"1 2\n").is_err());
        assert!(parse_lengths(b"-\n").is_err());
        assert!(parse_lengths(b"+\n").is_err());
    }
}
