//! Motley's coordinator: the cluster inventory, jobs, plans and launches, kept in SQLite (the
//! embedded default) or PostgreSQL. Its rooms, top to bottom; each may call only the rooms
//! below it (docs/architecture.md draws them):
//!
//! | room | holds | calls |
//! |---|---|---|
//! | `service::{rest, control, agent}` | translate requests and streams, errors into status codes | the rooms below |
//! | `control` | the operations behind both APIs: declare, submit, cancel, drain, plan | life, planning, launch, store, fleet, signals |
//! | `life` | a job's life in one place: the queue, each launched job's step, recovery, notices, scale-up, a new leader's takeover; the leader's memory of work in flight | planning, launch, checkpoints, restore_plan, store, fleet, facts |
//! | `planning` | the offer (what a job may use now), profiles, the solver, rank numbering | profiling, store, fleet |
//! | `launch` | launch instructions out, stops, fenced job moves | store, fleet, signals |
//! | `reports` | an agent's status applied: rank reports committed, the ranks to stop, holdings, profile and restore results | profiling, store, facts, signals |
//! | `profiling` | which layer profiles a plan needs; runs sent to agents and their results (durable) | store, signals |
//! | `rank_logs` | ranks' logs from their agents; a job's training curves | store, fleet |
//! | `checkpoints` | the checkpoint-location bitmap as people and recovery read it | store |
//! | `net` | the live link matrix as people read it: measured links beside the declared rates | store, fleet, catalog |
//! | `restore_plan` | pure: from the bitmap and a new plan to each agent's restore | nothing stateful |
//! | `facts` | what agents told: data planes and rates, restore results (in memory) | nothing |
//! | `signals` | job signals (in memory): the queue's wake-up, the launches sent, the jobs just reported | nothing |
//! | `cluster` | pure: this cluster's identity and the checkpoint-cloud prefix it gives each job | nothing |
//! | `catalog` | the GPU types the configuration declares beyond the planner's (set at start-up) | nothing |
//! | `fleet` | live agents: leases, addresses, load, an outbox of instructions per node (in memory) | links |
//! | `links` | the live link matrix agents measure: per (node, node, NIC kind) a short history (in memory) | nothing |
//! | `store` | every durable read and write, each job move fenced (state, generation, term) in SQL | the database |
//! | `leader`, `supervise`, `metrics`, `telemetry`, `tls` | who leads; the leader's tasks; counters; traces; certificates | store, fleet |
//!
//! One error type (`error`) maps to both a gRPC and an HTTP status.

pub mod api;
pub mod catalog;
pub mod checkpoints;
pub mod cluster;
pub mod control;
pub mod error;
pub mod facts;
pub mod fleet;
pub mod job;
pub mod jobspec;
pub mod launch;
pub mod leader;
pub mod life;
pub mod links;
pub mod load;
pub mod metrics;
pub mod net;
pub mod planning;
pub mod profiling;
pub mod rank_logs;
pub mod reports;
pub mod restore_plan;
pub mod service;
pub mod signals;
pub mod store;
pub mod supervise;
pub mod telemetry;
pub mod tls;
pub mod validate;

pub use error::{CoordinatorError, Result};
pub use job::JobState;
pub use store::{Event, JobRecord, NodeRecord, NodeState, RankAssignment, RankRecord, Store};
