//! The checkpoint files this node holds and moves: where steps are (`steps`), what is held and
//! reported (`holdings`), the tiers memory -> disk -> cloud (`tiers`, `cloud`), the data plane
//! that serves and fetches them between nodes (`dataplane`, over `rdma` with the cargo feature
//! `rdma`), and restores for a recovery's launch (`restorer`). docs/checkpoint.md and
//! docs/recovery.md describe the files and the protocol.
//!
//! Below `ranks` (which asks where ranks write and what a launch restores) and above `node`
//! (free space) and `workdir`: nothing here starts, signals or knows a rank.
//!
//! Inside, arrows run: `restorer` -> `tiers`, `dataplane`, `cloud`, `steps`; `tiers` ->
//! `cloud`, `file_roots`, `steps`; `holdings` -> `cloud`, `steps`; `cloud` -> `steps`; `dataplane` ->
//! `rdma`, `steps`.

pub mod cloud;
pub mod dataplane;
pub mod file_roots;
pub mod holdings;
#[cfg(feature = "rdma")]
pub mod rdma;
pub mod restorer;
pub mod steps;
pub mod tiers;
