//! Espresso (cost-efficient provisioning of heterogeneous GPUs) on its own ground: its job,
//! model and GPU files read as they are, its per-plan estimator reproduced bit for bit, its
//! stage placer and allocator replayed, and an exact search over its space.

pub mod allocator;
pub mod estimator;
pub mod full;
pub mod input;
pub mod placer;
pub mod search;

pub use allocator::{replay, AllocatorCounters, AllocatorResult};
pub use estimator::{estimate_with, layer_terms, memory_fit, simulate_1f1b, Dims, Estimate, Estimator, EstimatorGpu, LayerTerms, OOM_TIME};
pub use input::{
    parse_efficiency_table, parse_gpu_table, parse_job, parse_model_config, GpuOffer, GpuSpec, GpuTable, Job, ModelConfig,
    DEFAULT_EFFICIENCY_TABLE,
};
pub use placer::{Placement, Placer};
pub use search::{EspressoPlan, Search, SearchCounters, SearchOutcome, SpaceLimits};
