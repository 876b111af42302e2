//! From the checkpoint-location bitmap and a job's new plan to what each agent must do to
//! restore it (issue 15; docs/recovery.md). Pure: no store, no fleet.
//!
//! 1. [`choose_step`]: the newest step whose every file is held where it can be read now (a
//!    live node's memory or disk, or the cloud), by the format's own rule
//!    (`Manifest::check_complete`).
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

use std::collections::{BTreeMap, BTreeSet};

use motley_checkpoint::FileEntry;
use motley_contract::{GpuRef, RankPlacement};
use motley_proto::v1::{FetchRange, FetchSource, MakeUnit, Restore, RestoreFile};
use motley_solver::restore::{self as rp, CloudSpec, Demand, NodeRates, Part, PartBytes, RestoreScenario, ShardSet, Tier, UnitSizes};

use crate::error::{CoordinatorError, Result};
use crate::store::Holding;

/// Rates the planner assumes for a node that reported none (MB/s): NVMe, 100 Gbit/s, memcpy.
pub const DEFAULT_DISK_MB_S: f64 = 3500.0;
pub const DEFAULT_NIC_MB_S: f64 = 12_500.0;
pub const DEFAULT_MEM_MB_S: f64 = 10_000.0;

/// A live node as the restore sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct NodeInfo {
    pub data_url: String,
    /// The node's RDMA domain when its agent reported an RDMA device (peers in the same domain
    /// fetch from it over RDMA).
    pub rdma_domain: Option<String>,
    pub disk_read_mb_s: f64,
    pub nic_mb_s: f64,
    pub mem_copy_mb_s: f64,
}

/// What the bitmap offers a recovery.
#[derive(Debug, Clone, PartialEq)]
pub enum StepChoice {
    /// Restore this step from these copies (live nodes' and the cloud's).
    Restore { step: i64, files: Vec<Holding> },
    /// No checkpoint was ever reported: start over from step 0.
    Fresh,
    /// Checkpoints were reported but no step can be read whole now: why.
    Lost(String),
}

/// Whether a copy can be read now: in the cloud, or on a live node.
fn usable(h: &Holding, live: &dyn Fn(&str) -> bool) -> bool {
    h.tier == "cloud" || ((h.tier == "memory" || h.tier == "disk") && live(&h.node))
}

/// The newest step every file of which has a usable copy.
pub fn choose_step(all: &[Holding], live: &dyn Fn(&str) -> bool) -> StepChoice {
    if all.is_empty() {
        return StepChoice::Fresh;
    }
    let mut steps: BTreeMap<i64, Vec<&Holding>> = BTreeMap::new();
    for h in all {
        steps.entry(h.step).or_default().push(h);
    }
    let mut why = vec![];
    for (step, held) in steps.iter().rev() {
        let usable_files: Vec<&Holding> = held.iter().copied().filter(|h| usable(h, live)).collect();
        if usable_files.is_empty() {
            why.push(format!("step {step}: no file of it is held"));
            continue;
        }
        // The format's rule (`checkpoints::completeness`) over each file once.
        let distinct: BTreeMap<&str, &Holding> = usable_files.iter().map(|h| (h.file.as_str(), *h)).collect();
        match crate::checkpoints::completeness(&distinct.into_values().collect::<Vec<_>>()) {
            None => return StepChoice::Restore { step: *step, files: usable_files.into_iter().cloned().collect() },
            Some(e) => why.push(format!("step {step}: {e}")),
        }
    }
    StepChoice::Lost(format!("no checkpoint step has every file on a live node or in the cloud ({})", why.join("; ")))
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

fn index(files: &[Holding]) -> BTreeMap<String, StepFile> {
    let mut out: BTreeMap<String, StepFile> = BTreeMap::new();
    for h in files {
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
        // A copy that reported its crcs is the one whose manifest entry the restore checks.
        if f.entry.crc32c.is_empty() && !h.crc32c.is_empty() && h.crc32c != "[]" {
            f.entry = h.file_entry();
        }
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

/// Every node's needs under the new plan's placements.
pub fn needs(files: &[Holding], placements: &[(GpuRef, RankPlacement)]) -> Result<BTreeMap<String, NodeNeeds>> {
    let idx = index(files);
    // (block, part) -> the files of the unit, by TP rank, at the degree it was written.
    let mut units: BTreeMap<(String, String), Vec<&StepFile>> = BTreeMap::new();
    let mut rank_files: BTreeMap<i64, &String> = BTreeMap::new();
    for (name, f) in &idx {
        if f.rank >= 0 {
            rank_files.insert(f.rank, name);
        } else {
            units.entry((f.block.clone(), f.part.clone())).or_default().push(f);
        }
    }
    let mut out: BTreeMap<String, NodeNeeds> = BTreeMap::new();
    for (gpu, p) in placements {
        let need = out.entry(gpu.node.clone()).or_default();
        let mut blocks: Vec<String> = (p.layers[0]..p.layers[1]).map(|l| format!("layer.{l}")).collect();
        if p.stage == 0 {
            blocks.push("embed".into());
        }
        if p.stage + 1 == p.pp_size {
            blocks.push("head".into());
        }
        for block in blocks {
            for part in ["model", "optimizer"] {
                let Some(unit) = units.get(&(block.clone(), part.to_string())) else {
                    return Err(CoordinatorError::Conflict(format!(
                        "the checkpoint has no {block} {part} unit, which rank {} loads: it is of another model or plan",
                        p.rank
                    )));
                };
                let written = unit[0].tp_size;
                if written == p.tp_size {
                    let f = unit.iter().find(|f| f.tp_rank == p.tp_rank).expect("a complete step has every TP rank");
                    *need.files.entry(f.entry.file.clone()).or_default() += 1;
                    continue;
                }
                // Another degree: every written shard comes, and the node cuts its own.
                for f in unit {
                    *need.files.entry(f.entry.file.clone()).or_default() += 1;
                }
                let target = motley_checkpoint::manifest::unit_file_name(&motley_checkpoint::UnitKey {
                    block: block.parse().map_err(|e| CoordinatorError::Conflict(format!("{block}: {e}")))?,
                    part: part.parse().map_err(|e| CoordinatorError::Conflict(format!("{part}: {e}")))?,
                    tp_rank: p.tp_rank,
                    tp_size: p.tp_size,
                });
                if !need.make.iter().any(|m| m.file == target) {
                    let mut sources: Vec<&StepFile> = unit.clone();
                    sources.sort_by_key(|f| f.tp_rank);
                    need.make.push(MakeUnit {
                        file: target,
                        sources: sources.iter().map(|f| f.entry.file.clone()).collect(),
                        tp_size: p.tp_size,
                        tp_rank: p.tp_rank,
                    });
                }
            }
        }
        // The rank's own rank file, else the lowest one (same data position and scheduler).
        let rf = rank_files.get(&i64::from(p.rank)).or_else(|| rank_files.values().next()).copied();
        if let Some(rf) = rf {
            *need.files.entry(rf.clone()).or_default() += 1;
        }
    }
    Ok(out)
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

/// The label the planner uses for a block.
fn label(block: &str) -> Option<String> {
    match block {
        "embed" | "head" => Some(block.into()),
        b => b.strip_prefix("layer.").map(str::to_string),
    }
}

fn part_of(part: &str) -> Part {
    if part == "model" {
        Part::Model
    } else {
        Part::Optimizer
    }
}

/// Plan the transfers and write each node's instruction. `generation`: the coming launch.
#[allow(clippy::too_many_arguments)]
pub fn build(
    job: i64,
    generation: i64,
    step: i64,
    files: &[Holding],
    needs: &BTreeMap<String, NodeNeeds>,
    nodes: &BTreeMap<String, NodeInfo>,
    cloud_egress_mb_s: f64,
    cloud_url: &str,
    mode: Mode,
    timeout_s: u32,
) -> Result<Built> {
    let idx = index(files);
    let layers = files.first().map_or(0, |h| h.layers as u32);
    // Each unit's planner width: degree x longest file, rounded up so every degree divides it.
    let mut width: BTreeMap<(String, String), (u32, u64)> = BTreeMap::new();
    for f in idx.values().filter(|f| f.rank < 0) {
        let w = width.entry((f.block.clone(), f.part.clone())).or_insert((f.tp_size, 0));
        w.1 = w.1.max(f.entry.bytes);
    }
    let unit_bytes = |block: &str, part: &str| width.get(&(block.to_string(), part.to_string())).map(|(t, b)| round_up(u64::from(*t) * b));
    let max_of = |pred: &dyn Fn(&str) -> bool, part: &str| {
        width.iter().filter(|((b, p), _)| pred(b) && p == part).filter_map(|((b, p), _)| unit_bytes(b, p)).max().unwrap_or(0)
    };
    let is_layer = |b: &str| b.starts_with("layer.");
    let pb = |pred: &dyn Fn(&str) -> bool| PartBytes { model: max_of(pred, "model"), optimizer: max_of(pred, "optimizer") };
    let units = UnitSizes {
        layers,
        layer: pb(&is_layer),
        embed: width.contains_key(&("embed".to_string(), "model".to_string())).then(|| pb(&|b: &str| b == "embed")),
        head: width.contains_key(&("head".to_string(), "model".to_string())).then(|| pb(&|b: &str| b == "head")),
    };
    let unit_len = |block: &str, part: &str| -> u64 {
        if is_layer(block) {
            if part == "model" {
                units.layer.model
            } else {
                units.layer.optimizer
            }
        } else {
            let p = if block == "embed" { units.embed } else { units.head }.unwrap_or(PartBytes { model: 0, optimizer: 0 });
            if part == "model" {
                p.model
            } else {
                p.optimizer
            }
        }
    };
    let shard = |f: &StepFile| ShardSet {
        layers: label(&f.block).unwrap_or_default(),
        parts: Some(vec![part_of(&f.part)]),
        tp_size: f.tp_size,
        tp_ranks: Some(f.tp_rank.to_string()),
    };
    // Holdings of unit files on live nodes, by node and tier.
    let mut held: BTreeMap<(String, String), Vec<ShardSet>> = BTreeMap::new();
    for f in idx.values().filter(|f| f.rank < 0) {
        for (node, tier) in &f.holders {
            if nodes.contains_key(node) {
                held.entry((node.clone(), tier.clone())).or_default().push(shard(f));
            }
        }
    }
    let all_in_cloud = idx.values().all(|f| f.in_cloud);
    let mut demands = vec![];
    for (node, need) in needs {
        // One entry per rank's worth: the cloud-only baseline counts every copy.
        let copies = need.files.values().copied().max().unwrap_or(1);
        for c in 1..=copies {
            let shards: Vec<ShardSet> = need
                .files
                .iter()
                .filter(|(_, n)| **n >= c)
                .filter_map(|(name, _)| idx.get(name))
                .filter(|f| f.rank < 0)
                .map(shard)
                .collect();
            if !shards.is_empty() {
                demands.push(Demand { node: node.clone(), shards });
            }
        }
    }
    let mut names: BTreeSet<String> = needs.keys().cloned().collect();
    names.extend(held.keys().map(|(n, _)| n.clone()));
    let rates = |n: &str| {
        nodes.get(n).cloned().unwrap_or(NodeInfo {
            data_url: String::new(),
            rdma_domain: None,
            disk_read_mb_s: 0.0,
            nic_mb_s: 0.0,
            mem_copy_mb_s: 0.0,
        })
    };
    let or = |v: f64, d: f64| if v > 0.0 { v } else { d };
    // RDMA between two nodes of one RDMA domain whose agents both have a device; TCP otherwise.
    let transport = |from: &str, to: &str| -> String {
        match (rates(from).rdma_domain, rates(to).rdma_domain) {
            (Some(a), Some(b)) if a == b => "rdma".into(),
            _ => String::new(),
        }
    };
    let scenario = RestoreScenario {
        name: format!("job {job} step {step}"),
        cloud: CloudSpec { egress_mb_s: cloud_egress_mb_s, holds_step: idx.values().any(|f| f.in_cloud) },
        units: units.clone(),
        nodes: names
            .iter()
            .map(|n| {
                let r = rates(n);
                NodeRates {
                    name: n.clone(),
                    nic_in_mb_s: or(r.nic_mb_s, DEFAULT_NIC_MB_S),
                    nic_out_mb_s: None,
                    disk_read_mb_s: or(r.disk_read_mb_s, DEFAULT_DISK_MB_S),
                    mem_copy_mb_s: or(r.mem_copy_mb_s, DEFAULT_MEM_MB_S),
                }
            })
            .collect(),
        holdings: match mode {
            Mode::Planned => held
                .into_iter()
                .map(|((node, tier), shards)| rp::Holding { node, tier: if tier == "memory" { Tier::Memory } else { Tier::Disk }, shards })
                .collect(),
            Mode::CloudOnly => vec![],
        },
        demands,
        chunk_bytes: None,
    };
    if mode == Mode::CloudOnly && !all_in_cloud {
        return Err(CoordinatorError::Conflict(format!("step {step} is not whole in the cloud: a cloud-only restore cannot read it")));
    }
    let plan = rp::plan_restore(&scenario).map_err(|e| CoordinatorError::Conflict(format!("restore plan of step {step}: {e}")))?;
    // The planner's flows, as byte ranges of files, per destination node.
    let mut ranges: BTreeMap<(String, String), Vec<FetchRange>> = BTreeMap::new();
    let unit_files: BTreeMap<(String, String, u32), &StepFile> =
        idx.values().filter(|f| f.rank < 0).map(|f| ((label(&f.block).unwrap_or_default(), f.part.clone(), f.tp_rank), f)).collect();
    let cloud_flows = |n: &str| -> f64 {
        // Cloud-only: every node's flows share the cloud's egress and its own NIC.
        let total: usize = needs.values().map(|x| x.files.values().map(|c| *c as usize).sum::<usize>()).sum();
        let mine: usize = needs.get(n).map_or(0, |x| x.files.values().map(|c| *c as usize).sum());
        (cloud_egress_mb_s / total.max(1) as f64).min(or(rates(n).nic_mb_s, DEFAULT_NIC_MB_S) / mine.max(1) as f64)
    };
    if mode == Mode::Planned {
        for t in &plan.transfers {
            let part = match t.part {
                Part::Model => "model",
                Part::Optimizer => "optimizer",
            };
            let block = if t.layer == "embed" || t.layer == "head" { t.layer.clone() } else { format!("layer.{}", t.layer) };
            let Some(&(degree, _)) = width.get(&(block.clone(), part.to_string())) else { continue };
            let w = unit_len(&block, part) / u64::from(degree);
            if w == 0 {
                continue;
            }
            let source = match t.kind {
                rp::Kind::Local => FetchSource { kind: "local".into(), ..Default::default() },
                rp::Kind::Cloud => FetchSource { kind: "cloud".into(), tier: "cloud".into(), ..Default::default() },
                rp::Kind::Peer => FetchSource {
                    kind: "peer".into(),
                    node: t.from.clone(),
                    data_url: rates(&t.from).data_url,
                    tier: if t.relay { "relay".into() } else { format!("{:?}", t.tier).to_lowercase() },
                    transport: transport(&t.from, &t.to),
                },
            };
            // A flow from the cloud or a relay may span several shard files (the planner merges
            // a node's adjacent slices with one source): cut it at every file's boundary.
            let mut at = t.offset;
            let flow_end = t.offset + t.bytes;
            while at < flow_end {
                let r = (at / w) as u32;
                let base = u64::from(r) * w;
                let piece_end = flow_end.min(base + w);
                let (start, end) = (at - base, piece_end - base);
                at = piece_end;
                let Some(f) = unit_files.get(&(t.layer.clone(), part.to_string(), r)) else { continue };
                // The planner takes the cloud to hold the whole step when it holds any of it; a
                // file it lacks (not uploaded yet) comes from its live holder (the gap fill).
                if t.kind == rp::Kind::Cloud && !f.in_cloud {
                    continue;
                }
                let end = end.min(f.entry.bytes);
                if start >= end {
                    continue;
                }
                ranges.entry((t.to.clone(), f.entry.file.clone())).or_default().push(FetchRange {
                    offset: start,
                    bytes: end - start,
                    source: Some(source.clone()),
                    rate_mb_s: t.rate_mb_s,
                });
            }
        }
    }
    let mut restores = BTreeMap::new();
    for (node, need) in needs {
        let mut list = vec![];
        for (name, count) in &need.files {
            let f = &idx[name];
            let fallbacks: Vec<FetchSource> = f
                .holders
                .iter()
                .filter(|(n, _)| nodes.contains_key(n))
                .map(|(n, tier)| {
                    if n == node {
                        FetchSource { kind: "local".into(), tier: tier.clone(), ..Default::default() }
                    } else {
                        FetchSource {
                            kind: "peer".into(),
                            node: n.clone(),
                            data_url: rates(n).data_url,
                            tier: tier.clone(),
                            transport: transport(n, node),
                        }
                    }
                })
                .chain(f.in_cloud.then(|| FetchSource { kind: "cloud".into(), tier: "cloud".into(), ..Default::default() }))
                .collect();
            let (planned, copies) = match mode {
                Mode::Planned => {
                    let mut r = ranges.remove(&(node.clone(), name.clone())).unwrap_or_default();
                    r.sort_by_key(|x| x.offset);
                    (fill_gaps(r, f.entry.bytes, fallbacks.first()), 1)
                }
                Mode::CloudOnly => (
                    vec![FetchRange {
                        offset: 0,
                        bytes: f.entry.bytes,
                        source: Some(FetchSource { kind: "cloud".into(), tier: "cloud".into(), ..Default::default() }),
                        rate_mb_s: cloud_flows(node),
                    }],
                    *count,
                ),
            };
            list.push(RestoreFile {
                source_generation: f.generation,
                file: name.clone(),
                bytes: f.entry.bytes,
                chunk_bytes: f.entry.chunk_bytes,
                crc32c: f.entry.crc32c.clone(),
                ranges: planned,
                fallbacks,
                copies,
            });
        }
        restores.insert(
            node.clone(),
            Restore {
                job,
                generation,
                step: step as u64,
                files: list,
                make: need.make.clone(),
                cloud_url: cloud_url.to_string(),
                timeout_s,
                request: 0, // numbered by the recovery when it sends them
                cloud_share_mb_s: 0.0,
            },
        );
    }
    // Unscheduled cloud reads (a failed source's fallbacks) share the egress equally.
    let share = if cloud_egress_mb_s > 0.0 { cloud_egress_mb_s / restores.len().max(1) as f64 } else { 0.0 };
    for r in restores.values_mut() {
        r.cloud_share_mb_s = share;
    }
    Ok(Built { plan, restores })
}

/// Round a unit's planner length up to a multiple of 1024 (every power-of-two degree divides it).
fn round_up(b: u64) -> u64 {
    b.div_ceil(1024) * 1024
}

/// The planned ranges, with anything they leave out of `[0, len)` (rank files, which the
/// planner does not see, or bytes lost to clipping) taken from the first fallback.
fn fill_gaps(mut planned: Vec<FetchRange>, len: u64, first: Option<&FetchSource>) -> Vec<FetchRange> {
    let mut out = vec![];
    let mut at = 0;
    planned.sort_by_key(|r| r.offset);
    for r in planned {
        if r.offset > at {
            out.push(FetchRange { offset: at, bytes: r.offset - at, source: first.cloned(), rate_mb_s: 0.0 });
        }
        // Overlaps (never planned) keep the earlier range's bytes.
        let start = r.offset.max(at);
        let end = r.offset + r.bytes;
        if end > start {
            out.push(FetchRange { offset: start, bytes: end - start, ..r });
            at = end;
        }
    }
    if at < len {
        out.push(FetchRange { offset: at, bytes: len - at, source: first.cloned(), rate_mb_s: 0.0 });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use motley_checkpoint::manifest::{rank_file_name, unit_file_name};
    use motley_checkpoint::{Block, Part as CkPart, UnitKey};

    const GEN: i64 = 3;

    fn block_of(b: &str) -> Block {
        b.parse().unwrap()
    }

    fn unit_name(block: &str, part: &str, tp_rank: u32, tp_size: u32) -> String {
        unit_file_name(&UnitKey { block: block_of(block), part: part.parse::<CkPart>().unwrap(), tp_rank, tp_size })
    }

    /// One file of a step with no holder yet (`node`, `tier` empty).
    #[allow(clippy::too_many_arguments)]
    fn file(step: i64, name: &str, bytes: i64, block: &str, part: &str, tp: (u32, u32), rank: i64, layers: u32, world: u32) -> Holding {
        Holding {
            job_id: 1,
            generation: GEN,
            step,
            file: name.into(),
            node: String::new(),
            tier: String::new(),
            bytes,
            block: block.into(),
            part: part.into(),
            tp_rank: i64::from(tp.0),
            tp_size: i64::from(tp.1),
            rank,
            layers: i64::from(layers),
            world_size: i64::from(world),
            chunk_bytes: 1024,
            crc32c: format!("[{}, {step}]", name.len()),
        }
    }

    /// Every file of a complete step (embed, layer.0..L-1, head; model and optimizer; `tp`
    /// shards each; one rank file per rank of `world`), `bytes` each, not held anywhere yet.
    fn step_files(step: i64, layers: u32, tp: u32, world: u32, bytes: i64) -> Vec<Holding> {
        let mut blocks = vec!["embed".to_string()];
        blocks.extend((0..layers).map(|l| format!("layer.{l}")));
        blocks.push("head".into());
        let mut out = vec![];
        for b in &blocks {
            for part in ["model", "optimizer"] {
                for r in 0..tp {
                    out.push(file(step, &unit_name(b, part, r, tp), bytes, b, part, (r, tp), -1, layers, world));
                }
            }
        }
        for r in 0..world {
            out.push(file(step, &rank_file_name(r), bytes / 4, "", "", (0, 0), i64::from(r), layers, world));
        }
        out
    }

    /// Those files held on each of `held` (node, tier).
    fn on(files: &[Holding], held: &[(&str, &str)]) -> Vec<Holding> {
        held.iter()
            .flat_map(|(node, tier)| files.iter().map(move |f| Holding { node: node.to_string(), tier: tier.to_string(), ..f.clone() }))
            .collect()
    }

    /// A complete step held on each of `held`.
    fn step(step: i64, layers: u32, tp: u32, world: u32, held: &[(&str, &str)]) -> Vec<Holding> {
        on(&step_files(step, layers, tp, world, 4096), held)
    }

    fn live_of(names: &'static [&'static str]) -> impl Fn(&str) -> bool {
        move |n: &str| names.contains(&n)
    }

    // ---- choose_step

    #[test]
    fn choose_step_takes_the_newest_complete_step() {
        let mut all = step(10, 2, 2, 2, &[("n0", "disk")]);
        all.extend(step(20, 2, 2, 2, &[("n0", "memory"), ("n1", "disk")]));
        let newest: Vec<Holding> = all.iter().filter(|h| h.step == 20).cloned().collect();
        assert_eq!(choose_step(&all, &live_of(&["n0", "n1"])), StepChoice::Restore { step: 20, files: newest });
    }

    #[test]
    fn choose_step_skips_a_step_with_a_file_only_on_a_dead_node() {
        let mut all = step(10, 2, 2, 2, &[("n0", "disk"), ("n1", "disk")]);
        let lone = unit_name("layer.1", "optimizer", 1, 2);
        let mut twenty = step(20, 2, 2, 2, &[("n0", "memory"), ("n1", "memory")]);
        twenty.retain(|h| !(h.node == "n0" && h.file == lone));
        all.extend(twenty);
        // n1 is dead: step 20 misses one file; step 10 is whole on n0, and only n0's copies count.
        let ten_on_n0: Vec<Holding> = all.iter().filter(|h| h.step == 10 && h.node == "n0").cloned().collect();
        assert_eq!(ten_on_n0.len(), 4 * 2 * 2 + 2);
        assert_eq!(choose_step(&all, &live_of(&["n0"])), StepChoice::Restore { step: 10, files: ten_on_n0 });
        // With n1 alive, step 20 is whole again.
        assert!(matches!(choose_step(&all, &live_of(&["n0", "n1"])), StepChoice::Restore { step: 20, .. }));
    }

    #[test]
    fn choose_step_counts_cloud_copies_whatever_node_reported_them() {
        // n9 (dead) reported step 20 in the cloud and in its memory; n0 (live) holds step 10.
        let mut all = step(10, 1, 1, 1, &[("n0", "disk")]);
        all.extend(step(20, 1, 1, 1, &[("n9", "cloud"), ("n9", "memory")]));
        let cloud: Vec<Holding> = all.iter().filter(|h| h.step == 20 && h.tier == "cloud").cloned().collect();
        assert_eq!(choose_step(&all, &live_of(&["n0"])), StepChoice::Restore { step: 20, files: cloud });
        // A tier that is neither memory, disk nor cloud is not readable.
        let odd = step(30, 1, 1, 1, &[("n0", "tape")]);
        assert_eq!(
            choose_step(&odd, &live_of(&["n0"])),
            StepChoice::Lost("no checkpoint step has every file on a live node or in the cloud (step 30: no file of it is held)".into())
        );
    }

    #[test]
    fn choose_step_without_reports_starts_fresh() {
        assert_eq!(choose_step(&[], &live_of(&["n0"])), StepChoice::Fresh);
    }

    #[test]
    fn choose_step_lost_names_each_step_and_its_missing_file() {
        // Step 10 lacks rank 1's file; step 20's head optimizer shard 1 is on dead n1 only;
        // step 30 is on dead n1 only.
        let mut all = step(10, 2, 2, 2, &[("n0", "disk")]);
        all.retain(|h| h.file != rank_file_name(1));
        let shard = unit_name("head", "optimizer", 1, 2);
        let twenty = step(20, 2, 2, 2, &[("n0", "memory"), ("n1", "memory")]);
        all.extend(twenty.into_iter().filter(|h| !(h.node == "n0" && h.file == shard)));
        all.extend(step(30, 2, 2, 2, &[("n1", "disk")]));
        assert_eq!(
            choose_step(&all, &live_of(&["n0"])),
            StepChoice::Lost(
                "no checkpoint step has every file on a live node or in the cloud (\
                 step 30: no file of it is held; \
                 step 20: step 20 is not restorable: unit head optimizer tp 1/2 was never reported; restore the previous complete step; \
                 step 10: step 10 is not restorable: the rank file of rank 1 was never reported; restore the previous complete step)"
                    .into()
            )
        );
    }

    // ---- needs

    /// Rank `rank` on `node`'s GPU `gpu`: stage `stage` of `pp` (layers), TP rank of `tp`.
    fn place(rank: u32, node: &str, gpu: u32, stage: u32, pp: u32, tp: (u32, u32), layers: [u32; 2]) -> (GpuRef, RankPlacement) {
        (
            GpuRef { node: node.into(), index: gpu },
            RankPlacement {
                rank,
                replica: 0,
                stage,
                tp_rank: tp.0,
                tp_size: tp.1,
                stage_dp_rank: 0,
                stage_dp_size: 1,
                pp_size: pp,
                replicas: 1,
                layers,
            },
        )
    }

    fn counts(names: &[String], n: u32) -> BTreeMap<String, u32> {
        names.iter().map(|f| (f.clone(), n)).collect()
    }

    /// The unit files of `blocks` (both parts) at TP shards `ranks` of `tp`.
    fn units_of(blocks: &[&str], ranks: &[u32], tp: u32) -> Vec<String> {
        let mut out = vec![];
        for b in blocks {
            for part in ["model", "optimizer"] {
                for &r in ranks {
                    out.push(unit_name(b, part, r, tp));
                }
            }
        }
        out
    }

    #[test]
    fn needs_at_the_written_degree_are_each_ranks_own_shards() {
        let files = step(7, 4, 2, 4, &[("n0", "disk")]);
        let plan = [
            place(0, "n0", 0, 0, 2, (0, 2), [0, 2]),
            place(1, "n0", 1, 0, 2, (1, 2), [0, 2]),
            place(2, "n1", 0, 1, 2, (0, 2), [2, 4]),
            place(3, "n1", 1, 1, 2, (1, 2), [2, 4]),
        ];
        let got = needs(&files, &plan).unwrap();
        let mut n0 = units_of(&["embed", "layer.0", "layer.1"], &[0, 1], 2);
        n0.extend([rank_file_name(0), rank_file_name(1)]);
        let mut n1 = units_of(&["layer.2", "layer.3", "head"], &[0, 1], 2);
        n1.extend([rank_file_name(2), rank_file_name(3)]);
        let want: BTreeMap<String, NodeNeeds> = [
            ("n0".to_string(), NodeNeeds { files: counts(&n0, 1), make: vec![] }),
            ("n1".to_string(), NodeNeeds { files: counts(&n1, 1), make: vec![] }),
        ]
        .into();
        assert_eq!(got, want);

        // One rank per node: only its own TP shard; the rank without a rank file of its own
        // takes the lowest one.
        let plan = [place(0, "n0", 0, 0, 2, (1, 2), [0, 3]), place(5, "n1", 0, 1, 2, (0, 2), [3, 4])];
        let got = needs(&files, &plan).unwrap();
        let mut n0 = units_of(&["embed", "layer.0", "layer.1", "layer.2"], &[1], 2);
        n0.push(rank_file_name(0));
        let mut n1 = units_of(&["layer.3", "head"], &[0], 2);
        n1.push(rank_file_name(0));
        assert_eq!(got["n0"], NodeNeeds { files: counts(&n0, 1), make: vec![] });
        assert_eq!(got["n1"], NodeNeeds { files: counts(&n1, 1), make: vec![] });
        assert_eq!(got.len(), 2);
    }

    #[test]
    fn needs_at_another_degree_fetch_every_written_shard_and_cut_once_per_tp_rank() {
        // Written at TP 2; the new plan runs TP 1 with two replicas of stage 0 on n0 (same TP rank),
        // and stage 1 on n1.
        let files = step(7, 4, 2, 4, &[("n0", "disk")]);
        let plan =
            [place(0, "n0", 0, 0, 2, (0, 1), [0, 2]), place(1, "n0", 1, 0, 2, (0, 1), [0, 2]), place(2, "n1", 0, 1, 2, (0, 1), [2, 4])];
        let got = needs(&files, &plan).unwrap();
        let make = |blocks: &[&str]| -> Vec<MakeUnit> {
            let mut out = vec![];
            for b in blocks {
                for part in ["model", "optimizer"] {
                    out.push(MakeUnit {
                        file: unit_name(b, part, 0, 1),
                        sources: vec![unit_name(b, part, 0, 2), unit_name(b, part, 1, 2)],
                        tp_size: 1,
                        tp_rank: 0,
                    });
                }
            }
            out
        };
        let mut n0 = counts(&units_of(&["embed", "layer.0", "layer.1"], &[0, 1], 2), 2);
        n0.insert(rank_file_name(0), 1);
        n0.insert(rank_file_name(1), 1);
        let mut n1 = counts(&units_of(&["layer.2", "layer.3", "head"], &[0, 1], 2), 1);
        n1.insert(rank_file_name(2), 1);
        assert_eq!(got["n0"], NodeNeeds { files: n0, make: make(&["layer.0", "layer.1", "embed"]) });
        assert_eq!(got["n1"], NodeNeeds { files: n1, make: make(&["layer.2", "layer.3", "head"]) });
        assert_eq!(got.len(), 2);
    }

    #[test]
    fn needs_list_reslicing_sources_in_tp_order() {
        // TP 16 -> 4: names sort tp10 before tp2; the sources must not.
        let files = step(7, 1, 16, 1, &[("n0", "disk")]);
        let got = needs(&files, &[place(0, "n0", 0, 0, 1, (3, 4), [0, 1])]).unwrap();
        let m = &got["n0"].make;
        assert_eq!(m.len(), 6);
        assert_eq!(m[0].file, "layer.00000.model.tp3-4.safetensors");
        assert_eq!(m[0].sources, (0..16).map(|r| unit_name("layer.0", "model", r, 16)).collect::<Vec<_>>());
        assert_eq!((m[0].tp_size, m[0].tp_rank), (4, 3));
        assert_eq!(got["n0"].files.len(), 6 * 16 + 1);
    }

    #[test]
    fn needs_refuse_a_checkpoint_without_a_unit_the_plan_loads() {
        let files = step(7, 2, 1, 1, &[("n0", "disk")]);
        match needs(&files, &[place(0, "n0", 0, 0, 1, (0, 1), [0, 3])]) {
            Err(CoordinatorError::Conflict(m)) => {
                assert_eq!(m, "the checkpoint has no layer.2 model unit, which rank 0 loads: it is of another model or plan")
            }
            other => panic!("expected a conflict, got {other:?}"),
        }
    }

    // ---- build

    fn nodes(names: &[&str]) -> BTreeMap<String, NodeInfo> {
        names
            .iter()
            .map(|n| {
                let info =
                    NodeInfo { data_url: format!("{n}:7000"), rdma_domain: None, disk_read_mb_s: 0.0, nic_mb_s: 0.0, mem_copy_mb_s: 0.0 };
                (n.to_string(), info)
            })
            .collect()
    }

    fn build_planned(files: &[Holding], plan: &[(GpuRef, RankPlacement)], live: &[&str]) -> Built {
        let n = needs(files, plan).unwrap();
        build(1, GEN + 1, files[0].step, files, &n, &nodes(live), 1200.0, "s3://b/job", Mode::Planned, 600).unwrap()
    }

    fn local() -> FetchSource {
        FetchSource { kind: "local".into(), ..Default::default() }
    }

    fn cloud() -> FetchSource {
        FetchSource { kind: "cloud".into(), tier: "cloud".into(), ..Default::default() }
    }

    fn peer(node: &str, tier: &str) -> FetchSource {
        FetchSource { kind: "peer".into(), node: node.into(), data_url: format!("{node}:7000"), tier: tier.into(), ..Default::default() }
    }

    /// Every file's ranges, sorted, cover [0, bytes) with no gap and no overlap.
    fn assert_tiles(b: &Built) {
        for (node, r) in &b.restores {
            for f in &r.files {
                let mut at = 0;
                for x in &f.ranges {
                    assert_eq!(x.offset, at, "{node} {}: {:?}", f.file, f.ranges);
                    assert!(x.bytes > 0, "{node} {}: an empty range", f.file);
                    at += x.bytes;
                }
                assert_eq!(at, f.bytes, "{node} {}: the ranges end at {at}", f.file);
            }
        }
    }

    /// (node, file, source) of every range, by bytes.
    fn sources(b: &Built) -> BTreeMap<(String, String), Vec<(FetchSource, u64)>> {
        let mut out: BTreeMap<(String, String), Vec<(FetchSource, u64)>> = BTreeMap::new();
        for (node, r) in &b.restores {
            for f in &r.files {
                for x in &f.ranges {
                    out.entry((node.clone(), f.file.clone())).or_default().push((x.source.clone().unwrap(), x.bytes));
                }
            }
        }
        out
    }

    /// The one source of every range of `node`'s `file` (a local read's tier left out: planned
    /// ranges do not name it, gaps filled from the local fallback do).
    fn only_source(b: &Built, node: &str, file: &str) -> FetchSource {
        let mut s = sources(b)[&(node.to_string(), file.to_string())].clone();
        for (x, _) in &mut s {
            if x.kind == "local" {
                x.tier.clear();
            }
        }
        let first = s[0].0.clone();
        assert!(s.iter().all(|(x, _)| *x == first), "{node} {file}: one source, got {s:?}");
        first
    }

    #[test]
    fn build_reads_what_a_node_holds_from_itself() {
        // In its memory (and in the cloud): all of it from memory, nothing from peers or the cloud.
        let files = step(7, 2, 1, 1, &[("n0", "memory"), ("n1", "disk"), ("n0", "cloud")]);
        let b = build_planned(&files, &[place(0, "n0", 0, 0, 1, (0, 1), [0, 2])], &["n0", "n1"]);
        assert_tiles(&b);
        let r = &b.restores["n0"];
        assert_eq!((r.job, r.generation, r.step, r.cloud_url.as_str(), r.timeout_s), (1, GEN + 1, 7, "s3://b/job", 600));
        assert_eq!(r.files.len(), 4 * 2 + 1);
        let own = FetchSource { kind: "local".into(), tier: "memory".into(), ..Default::default() };
        for f in &r.files {
            assert_eq!(only_source(&b, "n0", &f.file), local(), "{}", f.file);
            assert_eq!(f.fallbacks, [own.clone(), peer("n1", "disk"), cloud()]);
            assert_eq!(f.copies, 1);
        }
        assert_eq!((b.plan.bytes.local, b.plan.bytes.peer, b.plan.bytes.cloud), (8 * 4096, 0, 0));
        // On its disk only: from its disk.
        let files = step(7, 2, 1, 1, &[("n0", "disk")]);
        let b = build_planned(&files, &[place(0, "n0", 0, 0, 1, (0, 1), [0, 2])], &["n0"]);
        assert_tiles(&b);
        for f in &b.restores["n0"].files {
            assert_eq!(only_source(&b, "n0", &f.file), local(), "{}", f.file);
            assert_eq!(f.fallbacks, [FetchSource { kind: "local".into(), tier: "disk".into(), ..Default::default() }]);
        }
        assert_eq!((b.plan.bytes.local, b.plan.bytes.peer, b.plan.bytes.cloud), (8 * 4096, 0, 0));
    }

    #[test]
    fn build_fetches_from_a_live_peer_and_falls_back_on_every_holder_then_the_cloud() {
        // n1 holds the step in memory, n0 on disk, n9 (dead) in memory, the cloud too; n2 needs it.
        let files = step(7, 2, 1, 1, &[("n1", "memory"), ("n0", "disk"), ("n9", "memory"), ("n9", "cloud")]);
        let usable: Vec<Holding> = files.iter().filter(|h| h.node != "n9" || h.tier == "cloud").cloned().collect();
        let b = build_planned(&usable, &[place(0, "n2", 0, 0, 1, (0, 1), [0, 2])], &["n0", "n1", "n2"]);
        assert_tiles(&b);
        let r = &b.restores["n2"];
        assert_eq!(r.files.len(), 9);
        for f in &r.files {
            assert_eq!(only_source(&b, "n2", &f.file), peer("n1", "memory"), "{}", f.file);
            assert_eq!(f.fallbacks, [peer("n1", "memory"), peer("n0", "disk"), cloud()], "{}", f.file);
        }
        assert_eq!((b.plan.bytes.local, b.plan.bytes.peer, b.plan.bytes.cloud), (0, 8 * 4096, 0));
        assert_eq!(b.restores.keys().collect::<Vec<_>>(), ["n2"], "holders that need nothing get no instruction");

        // Only a peer's disk, not in the cloud: from it, with no cloud fallback.
        let files = step(7, 2, 1, 1, &[("n1", "disk")]);
        let b = build_planned(&files, &[place(0, "n2", 0, 0, 1, (0, 1), [0, 2])], &["n1", "n2"]);
        assert_tiles(&b);
        for f in &b.restores["n2"].files {
            assert_eq!(only_source(&b, "n2", &f.file), peer("n1", "disk"));
            assert_eq!(f.fallbacks, [peer("n1", "disk")]);
        }
    }

    #[test]
    fn peers_of_one_rdma_domain_with_devices_are_read_over_rdma() {
        let files = step(7, 2, 1, 1, &[("n1", "memory"), ("n0", "disk")]);
        let plan = [place(0, "n2", 0, 0, 1, (0, 1), [0, 2])];
        let n = needs(&files, &plan).unwrap();
        let mut live = nodes(&["n0", "n1", "n2"]);
        for (name, domain) in [("n1", "ib0"), ("n2", "ib0"), ("n0", "roce1")] {
            live.get_mut(name).unwrap().rdma_domain = Some(domain.into());
        }
        let b = build(1, GEN + 1, 7, &files, &n, &live, 1200.0, "", Mode::Planned, 600).unwrap();
        for f in &b.restores["n2"].files {
            for r in &f.ranges {
                let s = r.source.as_ref().unwrap();
                assert_eq!(s.transport, if s.node == "n1" { "rdma" } else { "" }, "{}: {s:?}", f.file);
            }
            let by_node: BTreeMap<&str, &str> = f.fallbacks.iter().map(|s| (s.node.as_str(), s.transport.as_str())).collect();
            assert_eq!((by_node["n1"], by_node["n0"]), ("rdma", ""), "another domain is read over TCP");
        }
        // No device on the destination: TCP.
        live.get_mut("n2").unwrap().rdma_domain = None;
        let b = build(1, GEN + 1, 7, &files, &n, &live, 1200.0, "", Mode::Planned, 600).unwrap();
        assert!(b.restores["n2"].files.iter().flat_map(|f| &f.fallbacks).all(|s| s.transport.is_empty()));
    }

    #[test]
    fn build_fetches_from_the_cloud_what_no_live_node_holds() {
        // The step is in the cloud; the only node copy is on dead n9 (choose_step left it out).
        let files = step(7, 2, 1, 1, &[("n9", "cloud")]);
        let b = build_planned(&files, &[place(0, "n0", 0, 0, 1, (0, 1), [0, 2])], &["n0"]);
        assert_tiles(&b);
        for f in &b.restores["n0"].files {
            assert_eq!(only_source(&b, "n0", &f.file), cloud(), "{}", f.file);
            assert_eq!(f.fallbacks, [cloud()]);
        }
        assert_eq!((b.plan.bytes.local, b.plan.bytes.peer, b.plan.bytes.cloud), (0, 0, 8 * 4096));
    }

    #[test]
    fn build_never_fetches_from_the_cloud_a_file_that_is_not_there() {
        // A step half uploaded: the units of layer 0 are only in the cloud (their node died), the
        // rest only on n1's slow disk: the cloud is faster, but has none of those.
        let mut files = vec![];
        for h in step_files(7, 2, 1, 1, 1 << 20) {
            let tier = if h.block == "layer.0" { "cloud" } else { "disk" };
            files.push(Holding { node: "n1".into(), tier: tier.into(), ..h });
        }
        let n = needs(&files, &[place(0, "n0", 0, 0, 1, (0, 1), [0, 2])]).unwrap();
        let mut live = nodes(&["n0", "n1"]);
        live.get_mut("n1").unwrap().disk_read_mb_s = 1.0;
        let b = build(1, GEN + 1, 7, &files, &n, &live, 1200.0, "s3://b/job", Mode::Planned, 600).unwrap();
        assert_tiles(&b);
        for f in &b.restores["n0"].files {
            let want = if f.file.starts_with("layer.00000.") { cloud() } else { peer("n1", "disk") };
            assert_eq!(only_source(&b, "n0", &f.file), want, "{}", f.file);
            assert_eq!(f.fallbacks, [want]);
        }
    }

    #[test]
    fn build_tiles_files_of_uneven_lengths_across_degrees() {
        // Written at TP 2 with shards of slightly different lengths, some on n0, some on n1, all
        // in the cloud; restored at TP 1 on n0, n1 and n2.
        let mut files = vec![];
        for (i, h) in step_files(7, 3, 2, 2, 5000).into_iter().enumerate() {
            let bytes = h.bytes - (i as i64 % 7) * 3;
            let node = if i % 3 == 0 { "n0" } else { "n1" };
            files.push(Holding { node: node.into(), tier: if i % 2 == 0 { "memory" } else { "disk" }.into(), bytes, ..h.clone() });
            files.push(Holding { node: "n8".into(), tier: "cloud".into(), bytes, ..h });
        }
        let plan =
            [place(0, "n0", 0, 0, 2, (0, 1), [0, 1]), place(1, "n1", 0, 1, 2, (0, 1), [1, 3]), place(2, "n2", 0, 1, 2, (0, 1), [1, 3])];
        let b = build_planned(&files, &plan, &["n0", "n1", "n2"]);
        assert_tiles(&b);
        assert_eq!(b.restores["n0"].files.len(), 2 * 2 * 2 + 1);
        assert_eq!(b.restores["n2"].files.len(), 3 * 2 * 2 + 1);
    }

    #[test]
    fn build_copies_crcs_chunks_and_the_writers_generation() {
        // n0's copies reported no crcs; n1's did: the restore checks against n1's.
        let all = step_files(7, 1, 1, 1, 4096);
        let mut files = vec![];
        for h in &all {
            files.push(Holding { node: "n0".into(), tier: "disk".into(), chunk_bytes: 0, crc32c: "[]".into(), ..h.clone() });
            files.push(Holding { node: "n1".into(), tier: "disk".into(), ..h.clone() });
        }
        let b = build_planned(&files, &[place(0, "n2", 0, 0, 1, (0, 1), [0, 1])], &["n0", "n1", "n2"]);
        let r = &b.restores["n2"];
        assert_eq!(r.files.len(), all.len());
        for f in &r.files {
            let h = all.iter().find(|h| h.file == f.file).unwrap();
            assert_eq!(
                (f.source_generation, f.bytes, f.chunk_bytes),
                (GEN, 4096 * (1 + u64::from(h.rank < 0) * 3) / 4, 1024),
                "{}",
                f.file
            );
            assert_eq!(f.crc32c, h.file_entry().crc32c, "{}", f.file);
            assert!(!f.crc32c.is_empty());
        }
    }

    #[test]
    fn build_fetches_each_missing_byte_from_the_cloud_once_and_fans_it_out() {
        // Written at TP 2 on a node now dead, in the cloud; two replicas at TP 2, one per node:
        // each node needs both shards of every unit.
        let files = step(7, 2, 2, 4, &[("n9", "cloud")]);
        let plan = [
            place(0, "n0", 0, 0, 1, (0, 2), [0, 2]),
            place(1, "n0", 1, 0, 1, (1, 2), [0, 2]),
            place(2, "n1", 0, 0, 1, (0, 2), [0, 2]),
            place(3, "n1", 1, 0, 1, (1, 2), [0, 2]),
        ];
        let b = build_planned(&files, &plan, &["n0", "n1"]);
        assert_tiles(&b);
        let unit_bytes: u64 = 4 * 2 * 2 * 4096;
        assert_eq!(b.plan.bytes.cloud, unit_bytes, "each byte once from the cloud");
        assert_eq!(b.plan.bytes.peer, unit_bytes, "then from the node that has it");
        // The instructions do as planned: every unit byte from the cloud once, whichever node.
        let mut from_cloud: BTreeMap<String, u64> = BTreeMap::new();
        for ((_, file), s) in sources(&b) {
            for (src, bytes) in s {
                if src.kind == "cloud" && !file.starts_with("rank.") {
                    *from_cloud.entry(file.clone()).or_default() += bytes;
                }
            }
        }
        assert_eq!(from_cloud.len(), 16);
        assert!(from_cloud.values().all(|b| *b == 4096), "{from_cloud:?}");
        // Reads no plan paced (fallbacks) share the 1200 MB/s egress between the two nodes.
        assert!(
            b.restores.values().all(|r| r.cloud_share_mb_s == 600.0),
            "{:?}",
            b.restores.values().map(|r| r.cloud_share_mb_s).collect::<Vec<_>>()
        );
    }

    #[test]
    fn build_cloud_only_fetches_a_copy_per_rank_and_refuses_a_step_not_all_in_the_cloud() {
        let files = step(7, 2, 1, 3, &[("n0", "disk"), ("n0", "cloud")]);
        let plan =
            [place(0, "n0", 0, 0, 1, (0, 1), [0, 2]), place(1, "n0", 1, 0, 1, (0, 1), [0, 2]), place(2, "n1", 0, 0, 1, (0, 1), [0, 2])];
        let n = needs(&files, &plan).unwrap();
        let b = build(1, GEN + 1, 7, &files, &n, &nodes(&["n0", "n1"]), 1200.0, "s3://b/job", Mode::CloudOnly, 600).unwrap();
        assert_tiles(&b);
        for (node, r) in &b.restores {
            for f in &r.files {
                assert_eq!(f.ranges.len(), 1);
                assert_eq!(f.ranges[0].source, Some(cloud()), "{node} {}", f.file);
                assert!(f.ranges[0].rate_mb_s > 0.0);
                let want = if f.file.starts_with("rank.") || node == "n1" { 1 } else { 2 };
                assert_eq!(f.copies, want, "{node} {}", f.file);
            }
        }
        let names =
            |node: &str| b.restores[node].files.iter().filter(|f| f.file.starts_with("rank.")).map(|f| f.file.clone()).collect::<Vec<_>>();
        assert_eq!(names("n0"), [rank_file_name(0), rank_file_name(1)]);
        assert_eq!(names("n1"), [rank_file_name(2)]);
        // One file not in the cloud: refused.
        let mut partial = files.clone();
        let gone = unit_name("head", "optimizer", 0, 1);
        partial.retain(|h| !(h.tier == "cloud" && h.file == gone));
        match build(1, GEN + 1, 7, &partial, &n, &nodes(&["n0", "n1"]), 1200.0, "", Mode::CloudOnly, 600) {
            Err(CoordinatorError::Conflict(m)) => assert_eq!(m, "step 7 is not whole in the cloud: a cloud-only restore cannot read it"),
            other => panic!("expected a refusal, got {other:?}"),
        }
    }
}
