//! From the checkpoint-location bitmap and a job's new plan to what each agent must do to
//! restore it (docs/recovery.md). Pure: no store, no fleet.
//!
//! 1. [`choose_step`]: the newest step whose every file, as one generation wrote it, is held
//!    where it can be read now (a live node's memory or disk, or the cloud) with the crcs a
//!    restore verifies it against, by the format's own rule (`Manifest::check_complete`). A
//!    step is restored from one generation: one saved by a launch that lost a node mid-save
//!    and again by the next launch is two copies, never mixed.
//! 2. [`needs`]: what each node of the new plan must hold: for every rank, the units of its
//!    blocks (its layers, the embedding on a first stage, the head on a last) at its TP shard,
//!    and a rank file. A unit written at another TP degree needs every shard it was written
//!    in, and is re-sliced on the node (`MakeUnit`).
//! 3. [`build`]: the restore planner's scenario (`motley_solver::restore`, which chooses the
//!    source of every byte: local first, peers spread over sources and links, each missing
//!    byte from the cloud once, fanned out by relays) and its transfers turned into one
//!    `Restore` instruction per node, with every other holder as a fallback.
//!
//! The planner sees a unit as a byte string cut into equal shards. A unit's files here are
//! the shards of the degree it was written at; their lengths differ by a few header bytes
//! (tensor names), so a unit counts as `degree x` its longest file (rounded up so every degree
//! divides it) and each range is clipped to its file's real length.
//!
//! Here: the shared types and the index of a step's files; the three steps are the children
//! `step`, `needs` and `build`.

use std::collections::BTreeMap;

use motley_checkpoint::FileEntry;
use motley_proto::v1::{MakeUnit, Restore};
use motley_solver::restore as rp;

use crate::store::Holding;

mod build;
mod needs;
mod step;
pub use build::build;
pub use needs::needs;
pub use step::choose_step;

/// Rates the planner assumes for a node that reported none (MB/s): NVMe, 100 Gbit/s, memcpy.
pub const DEFAULT_DISK_MB_S: f64 = 3500.0;
pub const DEFAULT_NIC_MB_S: f64 = 12_500.0;
pub const DEFAULT_MEM_MB_S: f64 = 10_000.0;

/// A live node as the restore sees it: what its agent told (`state::facts`).
pub use crate::state::facts::NodeInfo;

/// What the bitmap offers a recovery.
#[derive(Debug, Clone, PartialEq)]
pub enum StepChoice {
    /// Restore this step, as generation `generation` wrote it, from these copies (live
    /// nodes' and the cloud's; every one of that generation).
    Restore { step: i64, generation: i64, files: Vec<Holding> },
    /// No checkpoint was ever reported: start over from step 0.
    Fresh,
    /// Checkpoints were reported but no step can be read whole now: why.
    Lost(String),
}

/// One file of the step: its manifest entry, who wrote it, and where it is.
#[derive(Debug, Clone)]
struct StepFile {
    entry: FileEntry,
    generation: i64,
    block: String,
    part: String,
    tp_rank: u32,
    tp_size: u32,
    rank: i64,
    /// Live nodes holding it, with the tier (memory before disk).
    holders: Vec<(String, String)>,
    in_cloud: bool,
}

/// The step's files by name, each with its holders (memory copies first) and whether the cloud
/// has it. `files` are of one generation ([`choose_step`] picks them so).
fn index(files: &[Holding]) -> BTreeMap<String, StepFile> {
    let mut out: BTreeMap<String, StepFile> = BTreeMap::new();
    // A copy without crcs cannot be verified: never a source (choose_step leaves them out too).
    for h in files.iter().filter(|h| h.has_crcs()) {
        let f = out.entry(h.file.clone()).or_insert_with(|| StepFile {
            entry: h.file_entry(),
            generation: h.generation,
            block: h.block.clone(),
            part: h.part.clone(),
            tp_rank: h.tp_rank as u32,
            tp_size: h.tp_size as u32,
            rank: h.rank,
            holders: vec![],
            in_cloud: false,
        });
        match h.tier.as_str() {
            "cloud" => f.in_cloud = true,
            tier => f.holders.push((h.node.clone(), tier.to_string())),
        }
    }
    for f in out.values_mut() {
        f.holders.sort_by_key(|(n, t)| (t != "memory", n.clone()));
    }
    out
}

/// What one node must end up holding.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct NodeNeeds {
    /// Files of the step, whole; `per_rank` counts the ranks that load each (the cloud-only
    /// baseline fetches one copy per rank).
    pub files: BTreeMap<String, u32>,
    pub make: Vec<MakeUnit>,
}

/// How the restore fetches: as planned, or (the benchmark's baseline) every rank its own
/// copy of everything from the cloud.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Planned,
    CloudOnly,
}

/// The planner's verdict and one instruction per node.
#[derive(Debug, Clone)]
pub struct Built {
    pub plan: rp::RestorePlan,
    pub restores: BTreeMap<String, Restore>,
}

#[cfg(test)]
mod tests;
