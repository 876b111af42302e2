//! Motley's coordinator: the cluster inventory, jobs, plans and launches, kept in SQLite (the
//! embedded default) or PostgreSQL. This crate so far holds the domain (the job life cycle,
//! generation fencing, one error type for gRPC and REST), the durable store, the control
//! operations (declare nodes, submit and plan jobs on the live inventory, cancel) and their
//! REST edge; agents over gRPC, leases and launches come next (issue 6).

pub mod agents;
pub mod control;
pub mod error;
pub mod job;
pub mod jobspec;
pub mod rest;
pub mod store;

pub use error::{CoordinatorError, Result};
pub use job::JobState;
pub use store::{Event, JobRecord, NodeRecord, NodeState, RankAssignment, RankRecord, Store};
