//! Motley's coordinator: the cluster inventory, jobs, plans and launches, kept in SQLite (the
//! embedded default) or PostgreSQL. The domain (`job`, `jobspec`, `control`: the job life
//! cycle, generation fencing, planning on the live inventory) knows nothing of the edges:
//! REST (`rest`), the gRPC control service (`grpc`) and the agents' service (`agents`: leases,
//! launches, rank reports). `scheduler` is the job queue (gang-scheduled, first come first served, on free GPUs).
//! `leader` decides which of several coordinators leads; `takeover`
//! resumes the work in flight when one starts to lead. One error type (`error`) maps to both a
//! gRPC and an HTTP status.

pub mod agents;
pub mod config;
pub mod control;
pub mod error;
pub mod grpc;
pub mod job;
pub mod jobspec;
pub mod leader;
pub mod load;
pub mod metrics;
pub mod rest;
pub mod scheduler;
pub mod store;
pub mod takeover;
pub mod telemetry;
pub mod tls;

pub use error::{CoordinatorError, Result};
pub use job::JobState;
pub use store::{Event, JobRecord, NodeRecord, NodeState, RankAssignment, RankRecord, Store};
