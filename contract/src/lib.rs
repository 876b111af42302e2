//! The documents Motley's parts hand each other, as types: the plan document (what
//! `motley plan -o json` prints, what the coordinator stores and launches, what a rank reads
//! at `MOTLEY_PLAN`), a rank's groups file (`MOTLEY_NCCL_GROUPS`), the node and job views of
//! the API (`views`, with the job's states in `job`; the link matrix in `net`), the cluster file
//! (`cluster`: GPU types, NICs, node entries and their checks), rank 0's
//! training lines as points (`curves`), and the 1F1B schedule of one pipeline replica
//! (`timeline`) that the cost model prices and the plan picture draws. The coordinator, the
//! agent and the CLI read them through these types, never by indexing untyped JSON. This crate
//! is the vocabulary at the bottom of the house: it depends on serde (and schemars, for the
//! plan document's schema) alone; pictures are `motley_draw`'s, the servers' shared plumbing
//! `motley_server`'s.
//!
//! The plan document is one type, `PlanDocument`: the solver writes it, the coordinator, the
//! agent and the pictures read it, and the rank library's `Plan` is held to its JSON schema
//! (`docs/plan.schema.json`). Field names are a contract (docs/plan.md): fields may be added, never
//! renamed. Readers ignore fields they do not know, so a newer writer never breaks an older
//! reader.

pub mod cluster;
pub mod curves;
pub mod error;
pub mod groups;
pub mod job;
pub mod model;
pub mod net;
pub mod plan;
pub mod timeline;
pub mod views;

pub use error::ContractError;
pub use groups::{for_rank, RankGroup};
pub use model::ModelSpec;
pub use plan::{
    BaselineDoc, CommGroupDoc, GpuRef, GroupKind, NetworkSource, PlanDocument, PlanLink, PlanNetwork, RankPlacement, ReplicaDoc, SearchDoc,
    StageDoc, Transport,
};
