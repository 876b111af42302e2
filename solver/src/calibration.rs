//! Per-GPU-type efficiency (`motley plan --calibration FILE`): the fraction of a GPU's peak
//! at the run's precision that a transformer layer reaches, forward and backward, measured
//! rather than assumed. Without a calibration every GPU gets `PlanOptions::efficiency` (0.5);
//! measured utilisation spans 0.3-0.7 across GPU types (BENCHMARKS.md, Espresso's traces), so
//! one constant prices some GPUs 2x too fast against others and the search splits layers wrong.
//!
//! ```yaml
//! gpus:
//!   - gpu: A30               # GPU type (catalog name or the cluster's gpu_types)
//!     precision: bf16        # optional: the entry applies at this precision only
//!     efficiency: 0.43       # forward: model FLOPs / (time x peak at the precision)
//!     backward_efficiency: 0.42   # optional, default = efficiency
//!     source: "3 x A30, DeepSpeed, LLaMA h2048 s2000 mb8 (Espresso motivation1_3A30)"
//! ```

use serde::{Deserialize, Serialize};

use crate::error::{Result, SolverError};
use crate::hardware::Precision;

#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Calibration {
    #[serde(default)]
    pub gpus: Vec<GpuCalibration>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GpuCalibration {
    pub gpu: String,
    /// The precision the numbers were measured at; None: any precision.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub precision: Option<Precision>,
    /// Forward: achieved model FLOPS over the peak at the precision, in (0, 1].
    pub efficiency: f64,
    /// Backward (recomputation excluded), in (0, 1]; default `efficiency`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backward_efficiency: Option<f64>,
    /// Where the numbers come from (free text, for the reader).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<String>,
}

impl Calibration {
    /// Every entry sane: efficiencies in (0, 1], one entry per (GPU, precision), and, when
    /// `known` is given, GPU types that exist (a typo would otherwise silently not apply).
    pub fn validate(&self, known: Option<&[String]>) -> Result<()> {
        for (i, e) in self.gpus.iter().enumerate() {
            let f = |x: &str| format!("calibration.gpus[{i}].{x}");
            if e.gpu.trim().is_empty() {
                return Err(SolverError::invalid(f("gpu"), "must name a GPU type (A30, T4, ...)"));
            }
            if let Some(known) = known {
                if !known.iter().any(|k| k.eq_ignore_ascii_case(&e.gpu)) {
                    return Err(SolverError::invalid(
                        f("gpu"),
                        format!(
                            "unknown GPU type '{}'; use one of {} or declare it under the cluster's gpu_types",
                            e.gpu,
                            known.join(", ")
                        ),
                    ));
                }
            }
            for (name, v) in [("efficiency", Some(e.efficiency)), ("backward_efficiency", e.backward_efficiency)] {
                if let Some(v) = v.filter(|v| !(*v > 0.0 && *v <= 1.0)) {
                    return Err(SolverError::invalid(
                        f(name),
                        format!("must be a fraction of peak in (0, 1], got {v}; measured utilisation is typically 0.3-0.7"),
                    ));
                }
            }
            if let Some(j) = self.gpus[..i].iter().position(|o| o.gpu.eq_ignore_ascii_case(&e.gpu) && o.precision == e.precision) {
                return Err(SolverError::invalid(
                    f("gpu"),
                    format!("'{}' is calibrated twice (also gpus[{j}]) at the same precision; keep one entry", e.gpu),
                ));
            }
        }
        Ok(())
    }

    /// The entry for `gpu` at `p`: one measured at `p` first, then one for any precision.
    pub fn lookup(&self, gpu: &str, p: Precision) -> Option<&GpuCalibration> {
        let of = |want: Option<Precision>| self.gpus.iter().find(|e| e.gpu.eq_ignore_ascii_case(gpu) && e.precision == want);
        of(Some(p)).or_else(|| of(None))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cost::{CostModel, PlanOptions, StageKind};
    use crate::hardware::{gpu_catalog, Cluster, ClusterSpec, NodeSpec};
    use crate::model::{model_by_name, Model};
    use crate::profile::ProfileSet;

    fn parse(text: &str) -> Calibration {
        serde_norway::from_str(text).unwrap()
    }

    fn names() -> Vec<String> {
        gpu_catalog().into_iter().map(|g| g.name).collect()
    }

    #[test]
    fn parses_and_looks_up_by_type_and_precision() {
        let c = parse(
            "gpus:\n  - {gpu: A30, efficiency: 0.43, backward_efficiency: 0.42, source: traces}\n  - {gpu: a30, precision: bf16, efficiency: 0.4}\n",
        );
        c.validate(Some(&names())).unwrap();
        assert_eq!(c.lookup("A30", Precision::Bf16).unwrap().efficiency, 0.4, "the entry at the precision wins");
        assert_eq!(c.lookup("a30", Precision::Fp16).unwrap().efficiency, 0.43, "else the one for any precision");
        assert!(c.lookup("T4", Precision::Fp16).is_none());
    }

    #[test]
    fn bad_entries_name_the_field_and_the_fix() {
        let err = |text: &str| parse(text).validate(Some(&names())).unwrap_err().to_string();
        let e = err("gpus:\n  - {gpu: A30, efficiency: 0}\n");
        assert!(e.starts_with("calibration.gpus[0].efficiency:") && e.contains("(0, 1]"), "{e}");
        let e = err("gpus:\n  - {gpu: A30, efficiency: 0.5}\n  - {gpu: T4, efficiency: 0.5, backward_efficiency: 1.2}\n");
        assert!(e.starts_with("calibration.gpus[1].backward_efficiency:"), "{e}");
        let e = err("gpus:\n  - {gpu: B300, efficiency: 0.5}\n");
        assert!(e.starts_with("calibration.gpus[0].gpu:") && e.contains("gpu_types"), "{e}");
        let e = err("gpus:\n  - {gpu: T4, precision: bf16, efficiency: 0.5}\n  - {gpu: T4, precision: bf16, efficiency: 0.4}\n");
        assert!(e.starts_with("calibration.gpus[1].gpu:") && e.contains("keep one"), "{e}");
        let e = err("gpus:\n  - {gpu: ' ', efficiency: 0.5}\n");
        assert!(e.starts_with("calibration.gpus[0].gpu:"), "{e}");
        assert!(serde_norway::from_str::<Calibration>("gpus:\n  - {gpu: T4, eff: 0.5}\n").is_err(), "unknown fields are refused");
        // PlanOptions::validate checks the ranges too (a job's options come through it).
        let opts = PlanOptions { calibration: parse("gpus:\n  - {gpu: T4, efficiency: .nan}\n"), ..PlanOptions::default() };
        assert!(opts.validate().unwrap_err().to_string().starts_with("calibration.gpus[0].efficiency"));
    }

    fn layer(gpu: &str, opts: &PlanOptions) -> (f64, f64) {
        let spec = ClusterSpec {
            name: "c".into(),
            nodes: vec![NodeSpec {
                name: "n".into(),
                count: None,
                gpu: gpu.into(),
                gpus: 1,
                intra: None,
                nics: vec![],
                rdma_domain: None,
                spot: false,
                price_per_gpu_hour: None,
                pcie_switch_gbit: None,
                emulate: None,
            }],
            gpu_types: vec![],
        };
        let cluster = Cluster::from_spec(&spec).unwrap();
        let model = Model::new(model_by_name("llama-7b").unwrap(), None).unwrap();
        let profiles = ProfileSet::default();
        let cm = CostModel { cluster: &cluster, model: &model, profiles: &profiles, opts };
        let c = cm.layer_cost(StageKind { class: 0, tp: 1, dp: 1 }, 4);
        (c.fwd, c.bwd)
    }

    #[test]
    fn precision_picks_the_peak_and_calibration_the_efficiency() {
        let d = PlanOptions::default();
        let bf16 = PlanOptions { precision: Precision::Bf16, ..d.clone() };
        // No bf16 tensor cores: bf16 at the fp32 rate, 125 / 15.7 slower than fp16.
        let (f16, _) = layer("V100-32G", &d);
        let (fbf, _) = layer("V100-32G", &bf16);
        assert!((fbf / f16 - 125.0 / 15.7).abs() < 0.01, "{}", fbf / f16);
        assert_eq!(layer("A100-80G", &d), layer("A100-80G", &bf16));
        assert!((layer("T4", &bf16).0 / layer("T4", &d).0 - 65.0 / 8.1).abs() < 1e-6);
        // Forward and backward efficiencies apply separately; default backward = 2 x forward.
        let (f, b) = layer("A30", &d);
        assert!((b / f - 2.0).abs() < 1e-9);
        let cal = PlanOptions { calibration: parse("gpus:\n  - {gpu: A30, efficiency: 0.25, backward_efficiency: 0.125}\n"), ..d.clone() };
        let (fc, bc) = layer("A30", &cal);
        assert!((fc / f - 2.0).abs() < 1e-9 && (bc / b - 4.0).abs() < 1e-9, "{} {}", fc / f, bc / b);
        // Recompute adds a forward to the backward.
        let rc = PlanOptions { recompute: true, ..cal };
        let (fr, br) = layer("A30", &rc);
        assert!((br - (bc + fc)).abs() < 1e-12 && fr == fc);
    }
}
