//! Motley's coordinator: the cluster inventory, jobs, plans and launches, kept in SQLite (the
//! embedded default) or PostgreSQL. Its rooms, top to bottom, one folder each; a room may call
//! only the rooms below it (docs/architecture.md draws them and names every module):
//!
//! | folder | holds | calls |
//! |---|---|---|
//! | `service` | the edges: REST, gRPC Control and the agents' sessions translate requests, streams and errors | the rooms below |
//! | `api` | the operations both doors serve (request -> response type) and the changes behind them (`api::control`: declare, submit, cancel, drain, plan) | life, planning, agents, views, store, state |
//! | `life` | a job's life in one place: one reconcile tick per base interval dispatches each job by its state to the queue, a launched job's step, recovery, notices, scale-up, network re-plans, a new leader's takeover; each keeps its own memory | planning, agents, views, store, state |
//! | `planning` | the offer (what a job may use now), layer profiles (`profiling`), the solver, rank numbering; restores from the bitmap (`restore_plan`, pure) | store, state |
//! | `agents` | what goes to agents and comes back: launches out, stops, fenced job moves (`launch`); an agent's status applied (`reports`) | planning::profiling, store, state |
//! | `views` | reads as people see them: the checkpoint bitmap (`checkpoints`), the link matrix (`net`), ranks' logs and curves (`rank_logs`) | store, state |
//! | `store` | every durable read and write, each job move fenced (state, generation, term) in SQL | the database, job |
//! | `state` | what lives in memory and is rebuilt from heartbeats: live agents and outboxes (`fleet`), the link matrix (`links`), load (`load`), what agents told (`facts`), job signals (`signals`), the declared GPU types (`catalog`) | nothing stateful |
//! | `job` | a job's vocabulary: its states, the job file (`spec`), names (`validate`), the cluster's identity and checkpoint-cloud prefix (`cluster`) | nothing |
//! | `server` | the process around them: who leads (`leader`), the leader's tasks (`supervise`), `/metrics`, OTLP, certificates | store, state |
//!
//! One error type (`error`) maps to both a gRPC and an HTTP status.

pub mod agents;
pub mod api;
pub mod error;
pub mod job;
pub mod life;
pub mod planning;
pub mod server;
pub mod service;
pub mod state;
pub mod store;
pub mod views;

pub use error::{CoordinatorError, Result};
pub use job::JobState;
pub use store::{Event, JobRecord, NodeRecord, NodeState, RankAssignment, RankRecord, Store};
