//! Espresso (cost-efficient provisioning of heterogeneous GPUs) on its own ground: its job,
//! model and GPU files read as they are. The Espresso-compatible estimator and the exact
//! provisioning search of issue 4 build on these types.

pub mod input;

pub use input::{parse_gpu_table, parse_job, parse_model_config, GpuOffer, GpuSpec, GpuTable, Job, ModelConfig};
