//! Espresso's own files, read as they are: a job (`jobs/*.json`), an optional llm-analysis
//! model config (`models/*.json`, `jobs/this_run/*.model_config.json`), the GPU table the
//! allocator uses (`gpu/espresso_gpu_config.json`, price and efficiencies per GPU) and the
//! hardware specs of llm-analysis (`gpu/llm_analysis_gpu_configs/<name>.json`). Fields and
//! units: `../shared/anchors/espresso/DATA.md`. The caller does the I/O.

use std::collections::BTreeMap;

use serde::Deserialize;

use crate::error::{BaselineError, Result};

/// An Espresso job (`Model(**json)` in its code). `tp_size` and `dp_size` are overwritten by
/// the search; `gradient_accumulation_steps` is the number of pipeline micro-batches.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct Job {
    pub model_name: String,
    pub gradient_accumulation_steps: u32,
    pub seq_len: u64,
    #[serde(default)]
    pub model_layer: Option<u32>,
    pub global_batch_size: u32,
    #[serde(default = "one")]
    pub dp_size: u32,
    #[serde(default = "one")]
    pub tp_size: u32,
    pub num_layers: u32,
    pub n_head: u32,
    pub hidden_dim: u64,
    pub vocab_size: u64,
    pub max_seq_len: u64,
    /// Seconds per iteration the plan must beat.
    pub slo: f64,
}

fn one() -> u32 {
    1
}

/// An llm-analysis model config.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct ModelConfig {
    pub name: String,
    pub num_layers: u32,
    pub n_head: u32,
    pub hidden_dim: u64,
    pub vocab_size: u64,
    pub max_seq_len: u64,
    #[serde(default)]
    pub model_type: Option<String>,
}

/// One row of `espresso_gpu_config.json`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct GpuOffer {
    pub flops_efficiency: f64,
    pub hbm_memory_efficiency: f64,
    /// $ per GPU-hour.
    pub cost: f64,
    pub mem_per_gpu_in_gb: f64,
    pub peak_fp16_tflops: f64,
}

/// An llm-analysis hardware spec.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct GpuSpec {
    pub name: String,
    #[serde(rename = "mem_per_GPU_in_GB")]
    pub mem_per_gpu_in_gb: f64,
    #[serde(rename = "hbm_bandwidth_in_GB_per_sec")]
    pub hbm_bandwidth_in_gb_per_sec: f64,
    #[serde(rename = "intra_node_bandwidth_in_GB_per_sec")]
    pub intra_node_bandwidth_in_gb_per_sec: f64,
    pub intra_node_min_message_latency: f64,
    #[serde(rename = "peak_fp16_TFLOPS")]
    pub peak_fp16_tflops: f64,
    #[serde(rename = "inter_node_bandwidth_in_GB_per_sec")]
    pub inter_node_bandwidth_in_gb_per_sec: f64,
}

/// The GPU table, in file order (Espresso's cost-tree level order).
#[derive(Debug, Clone, PartialEq)]
pub struct GpuTable {
    pub names: Vec<String>,
    pub offers: Vec<GpuOffer>,
    pub specs: Vec<GpuSpec>,
}

fn parse<T: serde::de::DeserializeOwned>(text: &str, origin: &str) -> Result<T> {
    serde_json::from_str(text)
        .map_err(|e| BaselineError::invalid(origin, format!("{e} (Espresso's file format; a file cut short fails here too)")))
}

pub fn parse_job(text: &str, origin: &str) -> Result<Job> {
    let job: Job = parse(text, origin)?;
    let bad = |f: &str, m: &str| Err(BaselineError::invalid(format!("{origin}: {f}"), m));
    if job.gradient_accumulation_steps == 0 {
        return bad("gradient_accumulation_steps", "must be at least 1 (it is the number of micro-batches)");
    }
    if job.global_batch_size == 0 || !job.global_batch_size.is_multiple_of(job.gradient_accumulation_steps) {
        return bad("global_batch_size", "must be a positive multiple of gradient_accumulation_steps");
    }
    for (f, v) in
        [("num_layers", job.num_layers as u64), ("n_head", job.n_head as u64), ("hidden_dim", job.hidden_dim), ("seq_len", job.seq_len)]
    {
        if v == 0 {
            return bad(f, "must be a positive integer");
        }
    }
    if job.model_layer == Some(0) {
        return bad("model_layer", "must be a positive number of layers to place (or leave it out to place num_layers)");
    }
    if !(job.slo.is_finite() && job.slo > 0.0) {
        return bad("slo", "must be a positive number of seconds per iteration");
    }
    Ok(job)
}

pub fn parse_model_config(text: &str, origin: &str) -> Result<ModelConfig> {
    let mc: ModelConfig = parse(text, origin)?;
    for (f, v) in [
        ("num_layers", mc.num_layers as u64),
        ("n_head", mc.n_head as u64),
        ("hidden_dim", mc.hidden_dim),
        ("vocab_size", mc.vocab_size),
        ("max_seq_len", mc.max_seq_len),
    ] {
        if v == 0 {
            return Err(BaselineError::invalid(format!("{origin}: {f}"), "must be a positive integer"));
        }
    }
    Ok(mc)
}

/// Field `k` of GPU entry `name`: a positive number, or an error naming `name.k`.
fn positive(v: &serde_json::Value, origin: &str, name: &str, k: &str) -> Result<f64> {
    v.get(k)
        .and_then(serde_json::Value::as_f64)
        .filter(|x| x.is_finite() && *x > 0.0)
        .ok_or_else(|| BaselineError::invalid(format!("{origin}: {name}.{k}"), "must be a positive number"))
}

/// `espresso_gpu_config.json` plus, for every GPU it lists, `<name>.json` from the hardware
/// spec directory (`specs` maps file names to contents).
pub fn parse_gpu_table(text: &str, origin: &str, specs: &BTreeMap<String, String>) -> Result<GpuTable> {
    // Keep the file's key order: it is the order of Espresso's cost-tree levels.
    let raw: OrderedEntries = parse(text, origin)?;
    let mut t = GpuTable { names: vec![], offers: vec![], specs: vec![] };
    for (name, v) in raw.0 {
        let o = |k: &str| positive(&v, origin, &name, k);
        let offer = GpuOffer {
            flops_efficiency: o("flops_efficiency")?,
            hbm_memory_efficiency: o("hbm_memory_efficiency")?,
            cost: o("cost")?,
            mem_per_gpu_in_gb: o("mem_per_GPU_in_GB")?,
            peak_fp16_tflops: o("peak_fp16_TFLOPS")?,
        };
        let file = format!("{name}.json");
        let spec_text = specs.get(&file).ok_or_else(|| {
            BaselineError::invalid(
                format!("{origin}: {name}"),
                format!("no hardware spec {file} beside it (llm_analysis_gpu_configs/); add the file"),
            )
        })?;
        let spec: GpuSpec = parse(spec_text, &file)?;
        for (k, v) in [
            ("mem_per_GPU_in_GB", spec.mem_per_gpu_in_gb),
            ("hbm_bandwidth_in_GB_per_sec", spec.hbm_bandwidth_in_gb_per_sec),
            ("inter_node_bandwidth_in_GB_per_sec", spec.inter_node_bandwidth_in_gb_per_sec),
            ("peak_fp16_TFLOPS", spec.peak_fp16_tflops),
        ] {
            if !(v.is_finite() && v > 0.0) {
                return Err(BaselineError::invalid(format!("{file}: {k}"), "must be a positive number"));
            }
        }
        t.names.push(name);
        t.offers.push(offer);
        t.specs.push(spec);
    }
    if t.names.is_empty() {
        return Err(BaselineError::invalid(origin, "lists no GPU"));
    }
    Ok(t)
}

/// `portal_gpu_efficiency.json`: the efficiencies the estimator uses, per GPU name.
pub fn parse_efficiency_table(text: &str, origin: &str) -> Result<BTreeMap<String, (f64, f64)>> {
    let raw: OrderedEntries = parse(text, origin)?;
    let mut out = BTreeMap::new();
    for (name, v) in raw.0 {
        let o = |k: &str| positive(&v, origin, &name, k);
        out.insert(name.clone(), (o("flops_efficiency")?, o("hbm_memory_efficiency")?));
    }
    Ok(out)
}

/// Espresso's own estimator efficiencies (llm-analysis `gpu_efficiency.json`), used when no
/// `portal_gpu_efficiency.json` sits beside the GPU table.
pub const DEFAULT_EFFICIENCY_TABLE: &str = include_str!("../../../examples/espresso/gpu/portal_gpu_efficiency.json");

impl GpuTable {
    /// The GPUs as the estimator reads them: hardware from the llm-analysis specs, price from
    /// the table, efficiencies from the estimator's own table (`efficiency`).
    pub fn estimator_gpus(&self, efficiency: &BTreeMap<String, (f64, f64)>, origin: &str) -> Result<Vec<super::EstimatorGpu>> {
        self.names
            .iter()
            .enumerate()
            .map(|(i, name)| {
                let &(fe, he) = efficiency.get(name).ok_or_else(|| {
                    BaselineError::invalid(
                        format!("{origin}: {name}"),
                        "has no entry in portal_gpu_efficiency.json (llm-analysis gpu_efficiency.json); add flops_efficiency and hbm_memory_efficiency for it",
                    )
                })?;
                let spec = &self.specs[i];
                Ok(super::EstimatorGpu {
                    name: name.clone(),
                    price: self.offers[i].cost,
                    peak_tflops: spec.peak_fp16_tflops,
                    hbm_gbps: spec.hbm_bandwidth_in_gb_per_sec,
                    inter_node_gbps: spec.inter_node_bandwidth_in_gb_per_sec,
                    memory_gb: spec.mem_per_gpu_in_gb,
                    flops_efficiency: fe,
                    hbm_efficiency: he,
                })
            })
            .collect()
    }
}

impl GpuTable {
    /// The placer's view: the same GPUs at the placer's efficiencies (this table's, not the
    /// estimator's), and this table's peaks (the flop shares).
    pub fn placer_view(&self, est_gpus: &[super::EstimatorGpu]) -> (Vec<super::EstimatorGpu>, Vec<f64>) {
        let gpus = est_gpus
            .iter()
            .zip(&self.offers)
            .map(|(g, o)| super::EstimatorGpu {
                flops_efficiency: o.flops_efficiency,
                hbm_efficiency: o.hbm_memory_efficiency,
                ..g.clone()
            })
            .collect();
        (gpus, self.offers.iter().map(|o| o.peak_fp16_tflops).collect())
    }
}

/// A JSON object's entries in file order (serde_json's map sorts its keys).
struct OrderedEntries(Vec<(String, serde_json::Value)>);

impl<'de> Deserialize<'de> for OrderedEntries {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct Entries;
        impl<'de> serde::de::Visitor<'de> for Entries {
            type Value = OrderedEntries;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("an object of GPU name -> GPU entry")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(self, mut m: A) -> std::result::Result<OrderedEntries, A::Error> {
                let mut out = vec![];
                while let Some(e) = m.next_entry()? {
                    out.push(e);
                }
                Ok(OrderedEntries(out))
            }
        }
        d.deserialize_map(Entries)
    }
}
