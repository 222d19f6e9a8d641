//! Ranges of numeric options, checked when the command line is parsed: a value out of range
//! exits with code 2 and a message naming the option and its range, before any work starts.

use clap::builder::TypedValueParser;

/// A real number in `[lo, hi]` (finite); `unit` follows the number in the message.
pub fn real(lo: f64, hi: f64, unit: &'static str) -> impl TypedValueParser<Value = f64> {
    clap::builder::StringValueParser::new().try_map(move |s: String| parse_real(&s, lo, hi, unit))
}

/// A real number in `(0, hi]`.
pub fn positive(hi: f64, unit: &'static str) -> impl TypedValueParser<Value = f64> {
    clap::builder::StringValueParser::new().try_map(move |s: String| {
        let v = parse_real(&s, 0.0, hi, unit)?;
        if v > 0.0 {
            Ok(v)
        } else {
            Err(format!("must be above 0 and at most {hi}{unit}"))
        }
    })
}

/// `--gamma`: the recipe's value for the block size, none (uniform), or a value.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum GammaChoice {
    Auto,
    Uniform,
    Is(f64),
}

impl GammaChoice {
    /// The decay for blocks of `block_size` (`None`: uniform).
    pub fn resolve(self, block_size: usize) -> Option<f64> {
        match self {
            GammaChoice::Auto => Some(dflash_common::dflash::default_gamma(block_size)),
            GammaChoice::Uniform => None,
            GammaChoice::Is(g) => Some(g),
        }
    }
}

/// `auto`, `none` or a decay above 0 and at most 1e6.
pub fn gamma_choice() -> impl TypedValueParser<Value = GammaChoice> {
    clap::builder::StringValueParser::new().try_map(|s: String| match s.trim() {
        "auto" => Ok(GammaChoice::Auto),
        "none" => Ok(GammaChoice::Uniform),
        other => match parse_real(other, 0.0, 1e6, "") {
            Ok(v) if v > 0.0 => Ok(GammaChoice::Is(v)),
            _ => Err(format!(
                "{other:?} is not auto, none or a number above 0 and at most 1e6"
            )),
        },
    })
}

fn parse_real(s: &str, lo: f64, hi: f64, unit: &str) -> Result<f64, String> {
    let v: f64 = s
        .trim()
        .parse()
        .map_err(|_| format!("{s:?} is not a number (expected {lo} to {hi}{unit})"))?;
    if v.is_finite() && (lo..=hi).contains(&v) {
        Ok(v)
    } else {
        Err(format!("{s} is out of range: must be {lo} to {hi}{unit}"))
    }
}

/// The range of every job deadline (`--job-timeout` of `launch`, `eval` and `generate`): 1 s to
/// 7 days. One range wherever the option appears.
pub const JOB_TIMEOUT_S: (f64, f64) = (1.0, 604_800.0);

/// The range of every refresh or sampling interval (`top --interval`, `status --watch`,
/// `launch --monitor-interval`): 0.05 s to 1 hour. Below it a watcher only burns CPU.
pub const INTERVAL_S: (f64, f64) = (0.05, 3600.0);

/// A job deadline in seconds, inside [`JOB_TIMEOUT_S`].
pub fn job_timeout() -> impl TypedValueParser<Value = f64> {
    real(JOB_TIMEOUT_S.0, JOB_TIMEOUT_S.1, " seconds")
}

/// A refresh interval in seconds, inside [`INTERVAL_S`].
pub fn interval() -> impl TypedValueParser<Value = f64> {
    real(INTERVAL_S.0, INTERVAL_S.1, " seconds")
}

/// `--job-timeout`: `auto` or seconds in `[lo, hi]`.
pub fn seconds_or_auto(lo: f64, hi: f64) -> impl TypedValueParser<Value = JobTimeout> {
    clap::builder::StringValueParser::new().try_map(move |s: String| {
        if s.trim() == "auto" {
            return Ok(JobTimeout::Auto);
        }
        parse_real(&s, lo, hi, " seconds, or auto").map(JobTimeout::Seconds)
    })
}

/// A job deadline as given on the command line.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum JobTimeout {
    Auto,
    Seconds(f64),
}

impl JobTimeout {
    pub fn seconds(self) -> Option<f64> {
        match self {
            JobTimeout::Auto => None,
            JobTimeout::Seconds(s) => Some(s),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn engines_are_read_for_both_roles_or_each_and_bad_ones_named() {
        use dflash_common::dflash::{Engine, Engines};
        assert_eq!(parse_engine_choice("auto"), Ok(EngineChoice::Auto));
        assert_eq!(
            parse_engine_choice(" torch "),
            Ok(EngineChoice::Is(Engines::both(Engine::Torch)))
        );
        assert_eq!(
            parse_engine_choice("drafter=candle,target=torch"),
            Ok(EngineChoice::Is(Engines {
                target: Engine::Torch,
                drafter: Engine::Candle
            }))
        );
        for (bad, says) in [
            ("", "is not an engine"),
            ("jax", "is not an engine"),
            ("target=torch", "names one role"),
            ("target=torch,target=candle", "named twice"),
            ("target=torch,worker=candle", "is not a role"),
            ("target=torch,drafter", "is not ROLE=ENGINE"),
            ("target=onnx,drafter=candle", "is not an engine"),
        ] {
            let e = parse_engine_choice(bad).unwrap_err();
            assert!(e.contains(says), "{bad:?}: {e}");
        }
    }

    #[test]
    fn a_switch_reads_auto_on_and_off_and_refuses_the_rest() {
        assert_eq!(parse_switch(" on"), Ok(Switch::On));
        assert_eq!(parse_switch("off"), Ok(Switch::Off));
        assert!(parse_switch("auto").unwrap().resolve(true));
        assert!(!parse_switch("auto").unwrap().resolve(false));
        assert!(!Switch::Off.resolve(true));
        for bad in ["", "yes", "1", "On", "\u{0}"] {
            let e = parse_switch(bad).unwrap_err();
            assert!(e.contains("is not auto, on or off"), "{bad:?}: {e}");
        }
    }

    #[test]
    fn out_of_range_and_non_numbers_are_refused_naming_the_range() {
        assert_eq!(parse_real("2.5", 0.1, 10.0, " s"), Ok(2.5));
        for bad in ["1e30", "-1", "nan", "inf", "x", ""] {
            let e = parse_real(bad, 0.1, 10.0, " s").unwrap_err();
            assert!(e.contains("0.1 to 10 s"), "{bad}: {e}");
        }
    }
}

/// A dtype option: `auto` (bf16 on GPUs, f32 on CPUs) or a precision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DtypeChoice {
    Auto,
    Is(dflash_common::dflash::Precision),
}

impl DtypeChoice {
    /// The precision for workers on GPUs (`gpu`) or on CPUs.
    pub fn resolve(self, gpu: bool) -> dflash_common::dflash::Precision {
        use dflash_common::dflash::Precision;
        match self {
            DtypeChoice::Is(p) => p,
            DtypeChoice::Auto if gpu => Precision::Bf16,
            DtypeChoice::Auto => Precision::F32,
        }
    }
}

/// `auto`, `f32` or `bf16`.
pub fn dtype_choice() -> impl TypedValueParser<Value = DtypeChoice> {
    clap::builder::StringValueParser::new().try_map(|s: String| match s.trim() {
        "auto" => Ok(DtypeChoice::Auto),
        other => other.parse().map(DtypeChoice::Is),
    })
}

/// `--engine`: `auto`, one engine for both roles, or one per role.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EngineChoice {
    Auto,
    Is(dflash_common::dflash::Engines),
}

/// Reads `auto`, `candle`, `torch`, or `target=E,drafter=E` (either order, both named).
pub fn parse_engine_choice(s: &str) -> Result<EngineChoice, String> {
    match s.trim() {
        "auto" => Ok(EngineChoice::Auto),
        other => other.parse().map(EngineChoice::Is),
    }
}

/// `--engine`'s value parser.
pub fn engine_choice() -> impl TypedValueParser<Value = EngineChoice> {
    clap::builder::StringValueParser::new().try_map(|s: String| parse_engine_choice(&s))
}

/// A count, or `auto`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CountOrAuto {
    Auto,
    Count(u64),
}

/// A count from `lo` to `hi`, or `auto`.
pub fn count_or_auto(lo: u64, hi: u64) -> impl TypedValueParser<Value = CountOrAuto> {
    clap::builder::StringValueParser::new().try_map(move |s: String| {
        let s = s.trim();
        if s == "auto" {
            return Ok(CountOrAuto::Auto);
        }
        match s.parse::<u64>() {
            Ok(v) if (lo..=hi).contains(&v) => Ok(CountOrAuto::Count(v)),
            _ => Err(format!(
                "{s:?} is not auto or a whole number from {lo} to {hi}"
            )),
        }
    })
}

/// A feature switch: `auto` (decided by the workers' devices), `on` or `off`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Switch {
    Auto,
    On,
    Off,
}

impl Switch {
    /// Whether it is on, `auto` being `when_auto`.
    pub fn resolve(self, when_auto: bool) -> bool {
        match self {
            Switch::Auto => when_auto,
            Switch::On => true,
            Switch::Off => false,
        }
    }
}

/// Reads `auto`, `on` or `off`.
pub fn parse_switch(s: &str) -> Result<Switch, String> {
    match s.trim() {
        "auto" => Ok(Switch::Auto),
        "on" => Ok(Switch::On),
        "off" => Ok(Switch::Off),
        other => Err(format!("{other:?} is not auto, on or off")),
    }
}

/// `auto`, `on` or `off`.
pub fn switch() -> impl TypedValueParser<Value = Switch> {
    clap::builder::StringValueParser::new().try_map(|s: String| parse_switch(&s))
}
