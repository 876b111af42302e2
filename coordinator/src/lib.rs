//! Motley's coordinator: the cluster inventory, jobs, plans and launches, kept in SQLite (the
//! embedded default) or PostgreSQL. Its rooms, and what each may touch:
//!
//! | room | holds | talks to |
//! |---|---|---|
//! | `fleet` | live agents: leases, addresses, load, an outbox of instructions per node | nothing durable |
//! | `lifecycle` | how launched jobs move: rank reports, dispatch, launch and lease timeouts, stops | store, fleet |
//! | `scheduler` | the job queue: which queued job gets which free GPUs, and why a job waits | store, solver, fleet |
//! | `control` | the operations behind both APIs: declare, submit, cancel, plan | store, solver, fleet, lifecycle |
//! | `checkpoints` | the checkpoint-location bitmap as people and recovery read it: steps, completeness, grids | store |
//! | `rank_logs` | ranks' logs from their agents (a chunk, a tail); a job's training curves from rank 0's log per generation | store, fleet, agents' log services |
//! | `profiling` | which layer profiles a job's plan needs; runs sent to agents (in memory); their results stored | store, fleet |
//! | `store` | every durable read and write, each job move fenced (state, generation, term) in SQL | the database |
//! | `leader`, `takeover` | who leads; what a new leader resumes | store |
//! | `service::{rest, control, agent}` | translate requests and streams, errors into status codes | the rooms above |
//!
//! Arrows run from services to domain rooms to the store; a domain room never imports a
//! service. One error type (`error`) maps to both a gRPC and an HTTP status.

pub mod checkpoints;
pub mod control;
pub mod error;
pub mod fleet;
pub mod job;
pub mod jobspec;
pub mod leader;
pub mod lifecycle;
pub mod load;
pub mod metrics;
pub mod notice;
pub mod profiling;
pub mod rank_logs;
pub mod recovery;
pub mod restore_plan;
pub mod scheduler;
pub mod service;
pub mod store;
pub mod supervise;
pub mod takeover;
pub mod telemetry;
pub mod tls;
pub mod validate;

pub use error::{CoordinatorError, Result};
pub use job::JobState;
pub use store::{Event, JobRecord, NodeRecord, NodeState, RankAssignment, RankRecord, Store};
