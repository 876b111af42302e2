//! Shared by the Espresso tests: the example data and estimators for its jobs.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use motley_baselines::espresso::{
    parse_efficiency_table, parse_gpu_table, parse_job, parse_model_config, Estimator, EstimatorGpu, GpuTable, ModelConfig,
};

pub fn data() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/espresso")
}

pub fn read(p: &Path) -> String {
    std::fs::read_to_string(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// Espresso's lookup of a model config by its `name` field when no config is passed.
fn config_by_name(name: &str) -> ModelConfig {
    for e in std::fs::read_dir(data().join("models")).unwrap() {
        let p = e.unwrap().path();
        if let Ok(c) = parse_model_config(&read(&p), "model") {
            if c.name == name {
                return c;
            }
        }
    }
    panic!("no model config named {name}");
}

pub fn gpu_table() -> GpuTable {
    let specs: BTreeMap<String, String> = std::fs::read_dir(data().join("gpu/llm_analysis_gpu_configs"))
        .unwrap()
        .map(|e| {
            let p = e.unwrap().path();
            (p.file_name().unwrap().to_string_lossy().into_owned(), read(&p))
        })
        .collect();
    parse_gpu_table(&read(&data().join("gpu/espresso_gpu_config.json")), "gpus", &specs).unwrap()
}

/// The placer's GPUs (its efficiencies) and the table's peaks.
pub fn placer_inputs(est: &Estimator) -> (Vec<EstimatorGpu>, Vec<f64>) {
    gpu_table().placer_view(&est.gpus)
}

pub fn estimator_for(job_file: &str, config_file: &str) -> Estimator {
    let table = gpu_table();
    let eff = parse_efficiency_table(&read(&data().join("gpu/portal_gpu_efficiency.json")), "eff").unwrap();
    let gpus = table.estimator_gpus(&eff, "gpus").unwrap();
    let job = parse_job(&read(&data().join(job_file)), job_file).unwrap();
    let mc = if config_file == "-" {
        config_by_name(&job.model_name)
    } else {
        parse_model_config(&read(&data().join(config_file)), config_file).unwrap()
    };
    Estimator::new(job, &mc, gpus).unwrap()
}
