//! The documents Motley's parts hand each other, as types: the plan document (what
//! `motley plan -o json` prints, what the coordinator stores and launches, what a rank reads
//! at `MOTLEY_PLAN`), a rank's groups file (`MOTLEY_NCCL_GROUPS`), and the node and job views
//! of the API (`views`, with the job's states in `job`; the link matrix in `net`). The
//! coordinator, the agent and the CLI read them through these types, never by indexing untyped JSON. The config files under
//! `/etc/motley/` have one loader for every binary (`config`). A plan document is drawn as a picture
//! (SVG) by one pure renderer (`svg`), for the CLI's `--svg` and the coordinator's `plan.svg`;
//! rank 0's training lines (step, loss, tokens/s, eval loss) are read and drawn by `curves`.
//! The data plane's capabilities (what a fetching agent shows a serving one) are minted and
//! checked by `capability`, the coordinator's and the agents' one format.
//!
//! The solver writes the plan document (`motley_solver::report::PlanReport`; of this crate the
//! solver uses only `timeline`, for the 1F1B period its cost model prices with, not the
//! document types), and `cli/tests/plan_cli.rs` reads every plan it makes back through
//! `PlanDocument`, which keeps the two in step. Field names are a contract (docs/plan.md):
//! fields may be added, never renamed. Readers ignore fields they do not know, so a newer
//! writer never breaks an older reader.

pub mod auth;
pub mod capability;
pub mod config;
pub mod curves;
pub mod groups;
pub mod job;
pub mod net;
pub mod plan;
#[cfg(feature = "serve")]
pub mod serve;
pub mod svg;
pub mod timeline;
pub mod views;

pub use groups::{for_rank, RankGroup};
pub use plan::{CommGroupDoc, GpuRef, GroupKind, ModelDoc, PlanDocument, RankPlacement, ReplicaDoc, StageDoc};
