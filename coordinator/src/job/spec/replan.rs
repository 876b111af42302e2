//! `replan:` in the job file: whether and when a running job is re-planned because its links
//! changed (docs/network.md, "Decide").
//!
//! ```yaml
//! replan: {threshold: 0.3, hold: 60s, horizon: 1h, cooldown: 10m}   # the defaults
//! replan: off                                                        # never
//! ```
//!
//! Absent, the job re-plans with the defaults. Durations are humantime strings (`90s`, `10m`,
//! `1h 30m`), as `--deadline` takes them; a bare number is seconds.

use std::time::Duration;

use serde::de::{self, MapAccess, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::error::{CoordinatorError, Result};

/// Relative change of a link (|now/was - 1|) that counts as a change.
pub const DEFAULT_THRESHOLD: f64 = 0.3;
pub const DEFAULT_HOLD: Duration = Duration::from_secs(60);
pub const DEFAULT_HORIZON: Duration = Duration::from_secs(3600);
pub const DEFAULT_COOLDOWN: Duration = Duration::from_secs(600);
/// The longest duration any of the fields takes (a year).
const MAX_DURATION: Duration = Duration::from_secs(365 * 86_400);

/// `replan:` as written: `off`, or the settings (each optional).
#[derive(Debug, Clone, PartialEq)]
pub enum ReplanSpec {
    Off,
    On(ReplanSettings),
}

#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReplanSettings {
    /// A link more than this fraction away from what the plan assumed has changed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub threshold: Option<f64>,
    /// ... for longer than this.
    #[serde(default, skip_serializing_if = "Option::is_none", deserialize_with = "duration_text")]
    pub hold: Option<String>,
    /// Without `steps`, the work left that a switch must pay for itself within.
    #[serde(default, skip_serializing_if = "Option::is_none", deserialize_with = "duration_text")]
    pub horizon: Option<String>,
    /// No second switch within this of the last one.
    #[serde(default, skip_serializing_if = "Option::is_none", deserialize_with = "duration_text")]
    pub cooldown: Option<String>,
}

/// The settings in force (the defaults filled in).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ReplanPolicy {
    pub threshold: f64,
    pub hold: Duration,
    pub horizon: Duration,
    pub cooldown: Duration,
}

impl Default for ReplanPolicy {
    fn default() -> ReplanPolicy {
        ReplanPolicy { threshold: DEFAULT_THRESHOLD, hold: DEFAULT_HOLD, horizon: DEFAULT_HORIZON, cooldown: DEFAULT_COOLDOWN }
    }
}

/// The policy of `replan:` (absent: the defaults); None when it is `off`. Errors name the
/// field (`replan.hold`) and the fix.
pub fn policy(spec: Option<&ReplanSpec>) -> Result<Option<ReplanPolicy>> {
    let settings = match spec {
        None => return Ok(Some(ReplanPolicy::default())),
        Some(ReplanSpec::Off) => return Ok(None),
        Some(ReplanSpec::On(s)) => s,
    };
    let d = ReplanPolicy::default();
    let threshold = settings.threshold.unwrap_or(d.threshold);
    if !(threshold.is_finite() && threshold > 0.0 && threshold < 1.0) {
        return Err(CoordinatorError::invalid(
            "replan.threshold",
            format!("is {threshold}; give the fraction a link may move from what the plan assumed, above 0 and below 1 (0.3 = 30%; a drop moves a link by less than 100%)"),
        ));
    }
    let duration = |field: &str, text: &Option<String>, default: Duration, least: Duration| -> Result<Duration> {
        let Some(text) = text else { return Ok(default) };
        let name = format!("replan.{field}");
        let d = humantime::parse_duration(text.trim()).map_err(|e| {
            CoordinatorError::invalid(
                name.clone(),
                format!("'{}' is not a duration ({e}); write it as 90s, 10m or 1h 30m", text.escape_default()),
            )
        })?;
        if d < least || d > MAX_DURATION {
            return Err(CoordinatorError::invalid(
                name,
                format!(
                    "is {}; give between {} and {}",
                    humantime::format_duration(d),
                    humantime::format_duration(least),
                    humantime::format_duration(MAX_DURATION)
                ),
            ));
        }
        Ok(d)
    };
    Ok(Some(ReplanPolicy {
        threshold,
        hold: duration("hold", &settings.hold, d.hold, Duration::ZERO)?,
        horizon: duration("horizon", &settings.horizon, d.horizon, Duration::from_secs(1))?,
        cooldown: duration("cooldown", &settings.cooldown, d.cooldown, Duration::ZERO)?,
    }))
}

impl Serialize for ReplanSpec {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        match self {
            ReplanSpec::Off => s.serialize_str("off"),
            ReplanSpec::On(settings) => settings.serialize(s),
        }
    }
}

impl<'de> Deserialize<'de> for ReplanSpec {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<ReplanSpec, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = ReplanSpec;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("off, on, or {threshold, hold, horizon, cooldown}")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> std::result::Result<ReplanSpec, E> {
                match v {
                    "off" => Ok(ReplanSpec::Off),
                    "on" => Ok(ReplanSpec::On(ReplanSettings::default())),
                    other => Err(E::custom(format!(
                        "'{}' is neither off nor on; write replan: off, or replan: {{threshold: 0.3, hold: 60s, horizon: 1h, cooldown: 10m}}",
                        other.escape_default()
                    ))),
                }
            }
            fn visit_bool<E: de::Error>(self, v: bool) -> std::result::Result<ReplanSpec, E> {
                Ok(if v { ReplanSpec::On(ReplanSettings::default()) } else { ReplanSpec::Off })
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> std::result::Result<ReplanSpec, A::Error> {
                ReplanSettings::deserialize(de::value::MapAccessDeserializer::new(map)).map(ReplanSpec::On)
            }
        }
        d.deserialize_any(V)
    }
}

/// A duration as text; a bare number is seconds.
fn duration_text<'de, D: Deserializer<'de>>(d: D) -> std::result::Result<Option<String>, D::Error> {
    struct V;
    impl Visitor<'_> for V {
        type Value = Option<String>;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("a duration such as 90s, 10m or 1h")
        }
        fn visit_str<E: de::Error>(self, v: &str) -> std::result::Result<Option<String>, E> {
            Ok(Some(v.to_string()))
        }
        fn visit_u64<E: de::Error>(self, v: u64) -> std::result::Result<Option<String>, E> {
            Ok(Some(format!("{v}s")))
        }
        fn visit_i64<E: de::Error>(self, v: i64) -> std::result::Result<Option<String>, E> {
            Ok(Some(format!("{v}s")))
        }
        fn visit_f64<E: de::Error>(self, v: f64) -> std::result::Result<Option<String>, E> {
            Ok(Some(format!("{}ms", (v * 1000.0).round() as i64)))
        }
    }
    d.deserialize_any(V)
}

#[cfg(test)]
mod tests {
    use super::super::JobSpec;
    use super::*;

    const GOOD: &str = "name: hello\nmodel: gpt3-1.3b\nglobal_batch: 16\nrun: python train.py\ncheckpoint: {every: 10}\n";

    fn parse(extra: &str) -> Result<JobSpec> {
        JobSpec::parse(&format!("{GOOD}{extra}"))
    }

    #[test]
    fn replan_is_on_with_the_defaults_unless_the_job_file_says_otherwise() {
        let j = parse("").unwrap();
        assert_eq!(j.replan().unwrap(), Some(ReplanPolicy::default()));
        assert_eq!(
            ReplanPolicy::default(),
            ReplanPolicy {
                threshold: 0.3,
                hold: Duration::from_secs(60),
                horizon: Duration::from_secs(3600),
                cooldown: Duration::from_secs(600)
            }
        );
        assert_eq!(j.steps, None);
        for off in ["replan: off\n", "replan: false\n"] {
            let j = parse(off).unwrap();
            assert_eq!(j.replan().unwrap(), None, "{off}");
            // Stored as JSON and read back the same.
            let back: JobSpec = serde_json::from_str(&serde_json::to_string(&j).unwrap()).unwrap();
            assert_eq!(back.replan().unwrap(), None);
        }
        let j = parse("replan: {threshold: 0.5, hold: 1s, cooldown: 2m}\nsteps: 5000\n").unwrap();
        let p = j.replan().unwrap().unwrap();
        assert_eq!((p.threshold, p.hold, p.horizon, p.cooldown), (0.5, Duration::from_secs(1), DEFAULT_HORIZON, Duration::from_secs(120)));
        assert_eq!(j.steps, Some(5000));
        let back: JobSpec = serde_json::from_str(&serde_json::to_string(&j).unwrap()).unwrap();
        assert_eq!(back, j);
        let p = parse("replan: {hold: 5, horizon: '1h 30m'}\n").unwrap().replan().unwrap().unwrap();
        assert_eq!((p.hold, p.horizon), (Duration::from_secs(5), Duration::from_secs(5400)));
        assert_eq!(parse("replan: on\n").unwrap().replan().unwrap(), Some(ReplanPolicy::default()));
        assert!(!serde_json::to_string(&parse("").unwrap()).unwrap().contains("replan"), "absent stays absent");
    }

    #[test]
    fn bad_replan_values_name_the_field_and_the_fix() {
        let err = |t: &str| parse(t).unwrap_err().to_string();
        let e = err("replan: {hold: soon}\n");
        assert!(e.starts_with("replan.hold: 'soon' is not a duration") && e.contains("90s"), "{e}");
        let e = err("replan: {cooldown: -3m}\n");
        assert!(e.starts_with("replan.cooldown:"), "{e}");
        let e = err("replan: {horizon: 0s}\n");
        assert!(e.starts_with("replan.horizon: is 0s; give between 1s"), "{e}");
        for t in ["0", "-0.3", ".nan", "1000"] {
            let e = err(&format!("replan: {{threshold: {t}}}\n"));
            assert!(e.starts_with("replan.threshold: is ") && e.contains("0.3 = 30%"), "{t}: {e}");
        }
        let e = err("replan: {threshhold: 0.2}\n");
        assert!(e.contains("replan") && e.contains("unknown field `threshhold`"), "{e}");
        let e = err("replan: sometimes\n");
        assert!(e.contains("replan") && e.contains("'sometimes' is neither off nor on"), "{e}");
        let e = err("steps: 0\n");
        assert!(e.starts_with("steps: must be at least 1"), "{e}");
    }
}
