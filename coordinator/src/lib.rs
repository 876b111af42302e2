//! Motley's coordinator: the cluster inventory, jobs, plans and launches, kept in SQLite (the
//! embedded default) or PostgreSQL. This crate so far holds the domain (the job life cycle,
//! generation fencing, one error type for gRPC and REST) and the durable store; the gRPC and
//! REST services, leases and the binary come on top of it (issue 6).

pub mod error;
pub mod job;
pub mod store;

pub use error::{CoordinatorError, Result};
pub use job::JobState;
pub use store::{Event, JobRecord, NodeRecord, NodeState, RankAssignment, RankRecord, Store};
