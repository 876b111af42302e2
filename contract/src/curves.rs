//! Training curves as points: what rank 0 of a job prints, read line by line (the picture is
//! `motley_draw::curves`'s).
//!
//! The lines (a contract with the rank library, `motley_torch`): rank 0 prints one JSON object
//! a line to stdout,
//! * `{"step": s, "loss": x, "tokens_per_s": t, "step_s": w}` (older runs: only step and loss),
//! * `{"step": s, "eval_loss": x}`;
//!
//! every other line (not JSON, or JSON without these keys) is ignored. Python's `json` writes
//! a NaN or infinite loss as `NaN`/`Infinity`, which is not JSON: such losses (and any loss
//! that is not a finite number) are skipped and counted. A step printed twice in one
//! generation keeps its last line. A recovered job relaunches under a new generation, and
//! rank 0 has one log per generation ([`parse_generation`] reads one).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// A job's curves: one entry per generation of rank 0's log, oldest first
/// (`GET /api/v1/jobs/{id}/curves`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "utoipa", derive(utoipa::ToSchema))]
pub struct Curves {
    pub generations: Vec<GenerationCurves>,
}

/// What one generation's rank 0 printed.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "utoipa", derive(utoipa::ToSchema))]
pub struct GenerationCurves {
    pub generation: i64,
    /// Training steps, by step.
    pub points: Vec<StepPoint>,
    /// Evaluations, by step.
    pub evals: Vec<EvalPoint>,
    /// Lines whose loss or eval loss is not a finite number (NaN, inf), skipped.
    #[serde(default)]
    pub non_finite: u64,
    /// Bytes at the start of the log that were not read (only its tail is).
    #[serde(default)]
    pub skipped_bytes: u64,
    /// Why the log could not be read (its node's agent is gone, say); no points from it then
    /// (a generation read from two logs keeps the other's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// One training step.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "utoipa", derive(utoipa::ToSchema))]
pub struct StepPoint {
    pub step: i64,
    pub loss: f64,
    #[serde(default)]
    pub tokens_per_s: Option<f64>,
    /// Seconds the step took.
    #[serde(default)]
    pub step_s: Option<f64>,
}

/// One evaluation.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "utoipa", derive(utoipa::ToSchema))]
pub struct EvalPoint {
    pub step: i64,
    pub eval_loss: f64,
}

/// One JSON object line; Python's `NaN`/`Infinity` read as null (a loss that is not finite).
fn object(line: &str) -> Option<Map<String, Value>> {
    match serde_json::from_str::<Map<String, Value>>(line) {
        Ok(m) => Some(m),
        Err(_) if line.contains("NaN") || line.contains("Infinity") => {
            let fixed = line.replace("-Infinity", "null").replace("Infinity", "null").replace("NaN", "null");
            serde_json::from_str(&fixed).ok()
        }
        Err(_) => None,
    }
}

fn finite(v: Option<&Value>) -> Option<f64> {
    v.and_then(Value::as_f64).filter(|x| x.is_finite())
}

fn step_of(v: &Value) -> Option<i64> {
    v.as_i64().or_else(|| v.as_f64().filter(|f| f.is_finite() && f.fract() == 0.0 && f.abs() < 9e15).map(|f| f as i64))
}

/// What one line of rank 0's log says: a step's point, an evaluation, and how many of its
/// losses are not finite (see the module's documentation). A later line of the same step
/// replaces an earlier one's point or evaluation.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct LineReading {
    pub point: Option<StepPoint>,
    pub eval: Option<EvalPoint>,
    pub non_finite: u64,
}

/// One line of rank 0's log read (without its line end).
pub fn read_line(line: &str) -> LineReading {
    let mut r = LineReading::default();
    let line = line.trim();
    if !line.starts_with('{') {
        return r;
    }
    let Some(o) = object(line) else { return r };
    let Some(step) = o.get("step").and_then(step_of) else { return r };
    if o.contains_key("loss") {
        match finite(o.get("loss")) {
            Some(loss) => {
                let (tokens_per_s, step_s) = (finite(o.get("tokens_per_s")), finite(o.get("step_s")));
                r.point = Some(StepPoint { step, loss, tokens_per_s, step_s });
            }
            None => r.non_finite += 1,
        }
    }
    if o.contains_key("eval_loss") {
        match finite(o.get("eval_loss")) {
            Some(eval_loss) => r.eval = Some(EvalPoint { step, eval_loss }),
            None => r.non_finite += 1,
        }
    }
    r
}

/// Rank 0's log of one generation read into points (see the module's documentation).
pub fn parse_generation(generation: i64, log: &str) -> GenerationCurves {
    let mut points: BTreeMap<i64, StepPoint> = BTreeMap::new();
    let mut evals: BTreeMap<i64, f64> = BTreeMap::new();
    let mut non_finite = 0;
    for line in log.lines() {
        let r = read_line(line);
        if let Some(p) = r.point {
            points.insert(p.step, p);
        }
        if let Some(e) = r.eval {
            evals.insert(e.step, e.eval_loss);
        }
        non_finite += r.non_finite;
    }
    GenerationCurves {
        generation,
        points: points.into_values().collect(),
        evals: evals.into_iter().map(|(step, eval_loss)| EvalPoint { step, eval_loss }).collect(),
        non_finite,
        skipped_bytes: 0,
        error: None,
    }
}

impl GenerationCurves {
    /// One generation's curves from two logs of it, `later` the log that went on printing
    /// (keep going: the new leader's after rank 0's replica was lost, docs/keep-going.md): the
    /// steps of both, a step both printed as `later` printed it (a new leader prints the last
    /// committed step again), the counts added, and the reasons of both logs that could not be
    /// read.
    pub fn then(self, later: GenerationCurves) -> GenerationCurves {
        let mut points: BTreeMap<i64, StepPoint> = self.points.into_iter().map(|p| (p.step, p)).collect();
        points.extend(later.points.into_iter().map(|p| (p.step, p)));
        let mut evals: BTreeMap<i64, EvalPoint> = self.evals.into_iter().map(|e| (e.step, e)).collect();
        evals.extend(later.evals.into_iter().map(|e| (e.step, e)));
        let error = match (self.error, later.error) {
            (Some(a), Some(b)) => Some(format!("{a}; {b}")),
            (a, b) => a.or(b),
        };
        GenerationCurves {
            generation: self.generation,
            points: points.into_values().collect(),
            evals: evals.into_values().collect(),
            non_finite: self.non_finite + later.non_finite,
            skipped_bytes: self.skipped_bytes + later.skipped_bytes,
            error,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_generation_read_from_two_logs_keeps_every_step_once_and_the_later_line_of_a_step_both_printed() {
        let rank0 = parse_generation(1, "{\"step\": 1, \"loss\": 4}\n{\"step\": 2, \"loss\": 3.5}\n{\"step\": 2, \"eval_loss\": 3.9}\n");
        let leader = parse_generation(
            1,
            "{\"step\": 2, \"loss\": 3.5, \"again\": true}\n{\"step\": 3, \"loss\": NaN}\n{\"step\": 3, \"loss\": 3.25}\n",
        );
        let both = rank0.then(GenerationCurves { skipped_bytes: 10, ..leader });
        assert_eq!(both.points.iter().map(|p| (p.step, p.loss)).collect::<Vec<_>>(), [(1, 4.0), (2, 3.5), (3, 3.25)]);
        assert_eq!(both.evals, [EvalPoint { step: 2, eval_loss: 3.9 }]);
        assert_eq!((both.generation, both.non_finite, both.skipped_bytes, both.error.as_deref()), (1, 1, 10, None));
        // A log that could not be read says why; the other's steps are kept.
        let gone = GenerationCurves { generation: 1, error: Some("node n0 has no live agent".into()), ..Default::default() };
        let after = gone.clone().then(parse_generation(1, "{\"step\": 4, \"loss\": 3}\n"));
        assert_eq!((after.points.len(), after.error.as_deref()), (1, Some("node n0 has no live agent")));
        let neither = gone.clone().then(GenerationCurves { error: Some("node n2 has no live agent".into()), ..gone });
        assert_eq!(neither.error.as_deref(), Some("node n0 has no live agent; node n2 has no live agent"));
    }

    /// Rank 0's log of one generation: points, an eval, lines to ignore, losses that are not
    /// finite, a cut last line (the drawing's tests read it too).
    const GEN1: &str = include_str!("../tests/data/rank0-generation1.txt");

    #[test]
    fn lines_become_points_and_others_are_ignored() {
        let g = parse_generation(1, GEN1);
        let steps: Vec<i64> = g.points.iter().map(|p| p.step).collect();
        assert_eq!(steps, [1, 2, 5]);
        assert_eq!(g.points[0], StepPoint { step: 1, loss: 4.0, tokens_per_s: Some(1000.0), step_s: Some(0.5) });
        assert_eq!(g.points[1].tokens_per_s, Some(1200.0));
        assert_eq!(g.points[2].step_s, None);
        assert_eq!(g.evals, [EvalPoint { step: 2, eval_loss: 3.7 }]);
        assert_eq!(g.non_finite, 2, "NaN and Infinity");
        // Older runs: step and loss only; a repeated step keeps its last line.
        let old = parse_generation(2, "{\"step\": 7, \"loss\": 2}\n{\"step\": 7, \"loss\": 1.5}\n{\"step\": 8.0, \"loss\": 1}\n");
        assert_eq!(old.points.iter().map(|p| (p.step, p.loss, p.tokens_per_s)).collect::<Vec<_>>(), [(7, 1.5, None), (8, 1.0, None)]);
        // The JSON shape of the API.
        let v = serde_json::to_value(Curves { generations: vec![old] }).unwrap();
        assert_eq!(v["generations"][0]["points"][0], serde_json::json!({"step": 7, "loss": 1.5, "tokens_per_s": null, "step_s": null}));
        assert!(v["generations"][0].get("error").is_none());
    }
}
