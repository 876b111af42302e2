//! Motley's solver: a pure library (no I/O, no async, no clock) that takes a cluster of mixed
//! GPUs, a transformer model and optional profiles, and returns the fastest 3D-parallel plan
//! under Motley's cost model. The planning problem, the plan model and the cost model are
//! stated in `solver/README.md`, which is this crate's documentation.
#![doc = include_str!("../README.md")]

pub mod bandwidth;
pub mod baselines;
pub mod calibration;
pub mod cost;
pub mod error;
pub mod given_plan;
pub mod hardware;
pub mod limits;
pub mod model;
pub mod network;
pub mod oracle;
pub mod placement;
pub mod plan;
pub mod profile;
pub mod provision;
pub mod replan;
pub mod report;
pub mod restore;
pub mod search;

pub use calibration::Calibration;
pub use cost::{CostModel, PlanOptions};
pub use error::{Result, SolverError};
pub use hardware::{Cluster, ClusterSpec, Precision, PrecisionChoice};
pub use model::{Model, ModelSpec};
pub use profile::ProfileSet;
pub use report::{plan, PlanDocument, PlanRequest};
pub use search::SearchMode;
