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

use motley_checkpoint::{FileEntry, Manifest, RankEntry, UnitEntry, FORMAT};
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
        match complete(&usable_files) {
            Ok(()) => return StepChoice::Restore { step: *step, files: usable_files.into_iter().cloned().collect() },
            Err(e) => why.push(format!("step {step}: {e}")),
        }
    }
    StepChoice::Lost(format!("no checkpoint step has every file on a live node or in the cloud ({})", why.join("; ")))
}

/// The format's completeness rule over the distinct files held.
fn complete(files: &[&Holding]) -> std::result::Result<(), String> {
    let Some(first) = files.first() else { return Err("no file of it is held".into()) };
    let mut m = Manifest {
        format: FORMAT.into(),
        step: first.step as u64,
        layers: first.layers as u32,
        world_size: first.world_size as u32,
        units: vec![],
        ranks: vec![],
    };
    let mut seen = BTreeSet::new();
    for h in files.iter().filter(|h| seen.insert(h.file.clone())) {
        let file = FileEntry { file: h.file.clone(), bytes: h.bytes as u64, chunk_bytes: 0, crc32c: vec![] };
        if h.rank >= 0 {
            m.ranks.push(RankEntry { rank: h.rank as u32, file });
        } else {
            let key = motley_checkpoint::UnitKey {
                block: h.block.parse().map_err(|e| format!("{}: {e}", h.file))?,
                part: h.part.parse().map_err(|e| format!("{}: {e}", h.file))?,
                tp_rank: h.tp_rank as u32,
                tp_size: h.tp_size as u32,
            };
            m.units.push(UnitEntry { key, file, tensors: Default::default() });
        }
    }
    m.check_complete().map_err(|e| e.to_string())
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
        nodes.get(n).cloned().unwrap_or(NodeInfo { data_url: String::new(), disk_read_mb_s: 0.0, nic_mb_s: 0.0, mem_copy_mb_s: 0.0 })
    };
    let or = |v: f64, d: f64| if v > 0.0 { v } else { d };
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
            let r = (t.offset / w) as u32;
            let Some(f) = unit_files.get(&(t.layer.clone(), part.to_string(), r)) else { continue };
            let start = t.offset - u64::from(r) * w;
            let end = (start + t.bytes).min(f.entry.bytes);
            if start >= end {
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
                },
            };
            ranges.entry((t.to.clone(), f.entry.file.clone())).or_default().push(FetchRange {
                offset: start,
                bytes: end - start,
                source: Some(source),
                rate_mb_s: t.rate_mb_s,
            });
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
                        FetchSource { kind: "peer".into(), node: n.clone(), data_url: rates(n).data_url, tier: tier.clone() }
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
            },
        );
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
