//! Step 3 of a restore: the restore planner's scenario (`motley_solver::restore`, which chooses
//! the source of every byte: local first, peers spread over sources and links, each missing
//! byte from the cloud once, fanned out by relays) and its transfers turned into one `Restore`
//! instruction per node, with every other holder as a fallback.
//!
//! In order: the units' sizes as the planner sees them (`widths`, `unit_sizes`), the
//! scenario (holdings, demands, node rates), the plan, its transfers cut into byte ranges of
//! files (`Restoring::fetch_ranges`), each node's files with their fallbacks
//! (`Restoring::restore_files`), and the cloud's share of unscheduled reads.

use std::collections::{BTreeMap, BTreeSet};

use motley_proto::v1::{FetchRange, FetchSource, Restore, RestoreFile};
use motley_solver::restore::{self as rp, CloudSpec, Demand, NodeRates, Part, PartBytes, RestoreScenario, ShardSet, Tier, UnitSizes};

use super::{index, Built, Mode, NodeInfo, NodeNeeds, StepFile, DEFAULT_DISK_MB_S, DEFAULT_MEM_MB_S, DEFAULT_NIC_MB_S};
use crate::error::{CoordinatorError, Result};
use crate::store::Holding;

/// Each unit's planner width, by (block, part): the degree it was written at, and its longest file.
type Widths = BTreeMap<(String, String), (u32, u64)>;

/// Byte ranges to fetch, by (destination node, file).
type Ranges = BTreeMap<(String, String), Vec<FetchRange>>;

/// The step's unit files by (planner label, part, TP rank).
type UnitFiles<'a> = BTreeMap<(String, String, u32), &'a StepFile>;

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
    let restoring = Restoring { idx: index(files), needs, nodes, cloud_egress_mb_s, mode };
    let layers = files.first().map_or(0, |h| h.layers as u32);
    let width = widths(&restoring.idx);
    let units = unit_sizes(&width, layers);
    let scenario = restoring.scenario(format!("job {job} step {step}"), units.clone());
    if mode == Mode::CloudOnly && !restoring.idx.values().all(|f| f.in_cloud) {
        return Err(CoordinatorError::Conflict(format!("step {step} is not whole in the cloud: a cloud-only restore cannot read it")));
    }
    let plan = rp::plan_restore(&scenario).map_err(|e| CoordinatorError::Conflict(format!("restore plan of step {step}: {e}")))?;
    let mut ranges = match mode {
        Mode::Planned => restoring.fetch_ranges(&plan.transfers, &width, &units),
        Mode::CloudOnly => Ranges::new(),
    };
    let mut restores = BTreeMap::new();
    for (node, need) in needs {
        restores.insert(
            node.clone(),
            Restore {
                job,
                generation,
                step: step as u64,
                files: restoring.restore_files(node, need, &mut ranges),
                make: need.make.clone(),
                cloud_url: cloud_url.to_string(),
                timeout_s,
                request: 0, // numbered by the recovery when it sends them
                cloud_share_mb_s: 0.0,
            },
        );
    }
    share_cloud(&mut restores, cloud_egress_mb_s);
    Ok(Built { plan, restores })
}

/// What every step of one `build` reads.
struct Restoring<'a> {
    idx: BTreeMap<String, StepFile>,
    needs: &'a BTreeMap<String, NodeNeeds>,
    nodes: &'a BTreeMap<String, NodeInfo>,
    cloud_egress_mb_s: f64,
    mode: Mode,
}

impl Restoring<'_> {
    /// A node's reported rates (all zero for a node that is not live).
    fn rates(&self, n: &str) -> NodeInfo {
        self.nodes.get(n).cloned().unwrap_or(NodeInfo {
            data_url: String::new(),
            rdma_domain: None,
            disk_read_mb_s: 0.0,
            nic_mb_s: 0.0,
            mem_copy_mb_s: 0.0,
        })
    }

    /// RDMA between two nodes of one RDMA domain whose agents both have a device; TCP otherwise.
    fn transport(&self, from: &str, to: &str) -> String {
        match (self.rates(from).rdma_domain, self.rates(to).rdma_domain) {
            (Some(a), Some(b)) if a == b => "rdma".into(),
            _ => String::new(),
        }
    }

    /// The planner's scenario: the holdings of live nodes (none for a cloud-only restore), the
    /// demands, and the rates of every node that holds or needs something.
    fn scenario(&self, name: String, units: UnitSizes) -> RestoreScenario {
        let held = self.held();
        let demands = self.demands();
        let mut names: BTreeSet<String> = self.needs.keys().cloned().collect();
        names.extend(held.keys().map(|(n, _)| n.clone()));
        RestoreScenario {
            name,
            cloud: CloudSpec { egress_mb_s: self.cloud_egress_mb_s, holds_step: self.idx.values().any(|f| f.in_cloud) },
            units,
            nodes: names.iter().map(|n| self.node_rates(n)).collect(),
            holdings: match self.mode {
                Mode::Planned => held
                    .into_iter()
                    .map(|((node, tier), shards)| rp::Holding {
                        node,
                        tier: if tier == "memory" { Tier::Memory } else { Tier::Disk },
                        shards,
                    })
                    .collect(),
                Mode::CloudOnly => vec![],
            },
            demands,
            chunk_bytes: None,
        }
    }

    /// Holdings of unit files on live nodes, by node and tier.
    fn held(&self) -> BTreeMap<(String, String), Vec<ShardSet>> {
        let mut held: BTreeMap<(String, String), Vec<ShardSet>> = BTreeMap::new();
        for f in self.idx.values().filter(|f| f.rank < 0) {
            for (node, tier) in &f.holders {
                if self.nodes.contains_key(node) {
                    held.entry((node.clone(), tier.clone())).or_default().push(shard(f));
                }
            }
        }
        held
    }

    /// What each node needs of the units, one entry per rank's worth: the cloud-only baseline
    /// counts every copy.
    fn demands(&self) -> Vec<Demand> {
        let mut demands = vec![];
        for (node, need) in self.needs {
            let copies = need.files.values().copied().max().unwrap_or(1);
            for c in 1..=copies {
                let shards: Vec<ShardSet> = need
                    .files
                    .iter()
                    .filter(|(_, n)| **n >= c)
                    .filter_map(|(name, _)| self.idx.get(name))
                    .filter(|f| f.rank < 0)
                    .map(shard)
                    .collect();
                if !shards.is_empty() {
                    demands.push(Demand { node: node.clone(), shards });
                }
            }
        }
        demands
    }

    /// A node's rates for the planner, the defaults where it reported none.
    fn node_rates(&self, n: &str) -> NodeRates {
        let r = self.rates(n);
        NodeRates {
            name: n.to_string(),
            nic_in_mb_s: rate_or(r.nic_mb_s, DEFAULT_NIC_MB_S),
            nic_out_mb_s: None,
            disk_read_mb_s: rate_or(r.disk_read_mb_s, DEFAULT_DISK_MB_S),
            mem_copy_mb_s: rate_or(r.mem_copy_mb_s, DEFAULT_MEM_MB_S),
        }
    }

    /// The planner's flows, as byte ranges of files, per destination node.
    fn fetch_ranges(&self, transfers: &[rp::Transfer], width: &Widths, units: &UnitSizes) -> Ranges {
        let mut ranges = Ranges::new();
        let unit_files: UnitFiles = self
            .idx
            .values()
            .filter(|f| f.rank < 0)
            .map(|f| ((label(&f.block).unwrap_or_default(), f.part.clone(), f.tp_rank), f))
            .collect();
        for t in transfers {
            let part = match t.part {
                Part::Model => "model",
                Part::Optimizer => "optimizer",
            };
            let block = if t.layer == "embed" || t.layer == "head" { t.layer.clone() } else { format!("layer.{}", t.layer) };
            let Some(&(degree, _)) = width.get(&(block.clone(), part.to_string())) else { continue };
            let w = unit_len(units, &block, part) / u64::from(degree);
            if w == 0 {
                continue;
            }
            cut_flow(t, w, part, &self.source_of(t), &unit_files, &mut ranges);
        }
        ranges
    }

    /// Where a transfer reads from.
    fn source_of(&self, t: &rp::Transfer) -> FetchSource {
        match t.kind {
            rp::Kind::Local => FetchSource { kind: "local".into(), ..Default::default() },
            rp::Kind::Cloud => FetchSource { kind: "cloud".into(), tier: "cloud".into(), ..Default::default() },
            rp::Kind::Peer => FetchSource {
                kind: "peer".into(),
                node: t.from.clone(),
                data_url: self.rates(&t.from).data_url,
                tier: if t.relay { "relay".into() } else { format!("{:?}", t.tier).to_lowercase() },
                transport: self.transport(&t.from, &t.to),
                capability: String::new(), // signed by the recovery when it sends the restore
            },
        }
    }

    /// One node's files: each with its planned ranges (the gaps from the first fallback), or,
    /// cloud-only, one copy per rank read whole from the cloud; and every other copy as a
    /// fallback. Takes the node's ranges out of `ranges`.
    fn restore_files(&self, node: &str, need: &NodeNeeds, ranges: &mut Ranges) -> Vec<RestoreFile> {
        let mut list = vec![];
        for (name, count) in &need.files {
            let f = &self.idx[name];
            let fallbacks = self.fallbacks(f, node);
            let (planned, copies) = match self.mode {
                Mode::Planned => {
                    let mut r = ranges.remove(&(node.to_string(), name.clone())).unwrap_or_default();
                    r.sort_by_key(|x| x.offset);
                    (fill_gaps(r, f.entry.bytes, fallbacks.first()), 1)
                }
                Mode::CloudOnly => (
                    vec![FetchRange {
                        offset: 0,
                        bytes: f.entry.bytes,
                        source: Some(FetchSource { kind: "cloud".into(), tier: "cloud".into(), ..Default::default() }),
                        rate_mb_s: self.cloud_flows(node),
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
        list
    }

    /// Every copy of a file `node` can read: its own, live peers', then the cloud's.
    fn fallbacks(&self, f: &StepFile, node: &str) -> Vec<FetchSource> {
        f.holders
            .iter()
            .filter(|(n, _)| self.nodes.contains_key(n))
            .map(|(n, tier)| {
                if n == node {
                    FetchSource { kind: "local".into(), tier: tier.clone(), ..Default::default() }
                } else {
                    FetchSource {
                        kind: "peer".into(),
                        node: n.clone(),
                        data_url: self.rates(n).data_url,
                        tier: tier.clone(),
                        transport: self.transport(n, node),
                        capability: String::new(), // as above
                    }
                }
            })
            .chain(f.in_cloud.then(|| FetchSource { kind: "cloud".into(), tier: "cloud".into(), ..Default::default() }))
            .collect()
    }

    /// Cloud-only: every node's flows share the cloud's egress and its own NIC.
    fn cloud_flows(&self, n: &str) -> f64 {
        let total: usize = self.needs.values().map(|x| x.files.values().map(|c| *c as usize).sum::<usize>()).sum();
        let mine: usize = self.needs.get(n).map_or(0, |x| x.files.values().map(|c| *c as usize).sum());
        (self.cloud_egress_mb_s / total.max(1) as f64).min(rate_or(self.rates(n).nic_mb_s, DEFAULT_NIC_MB_S) / mine.max(1) as f64)
    }
}

/// Each unit's planner width: degree x longest file (`unit_sizes` rounds it up so every degree
/// divides it).
fn widths(idx: &BTreeMap<String, StepFile>) -> Widths {
    let mut width = Widths::new();
    for f in idx.values().filter(|f| f.rank < 0) {
        let w = width.entry((f.block.clone(), f.part.clone())).or_insert((f.tp_size, 0));
        w.1 = w.1.max(f.entry.bytes);
    }
    width
}

/// The units as the planner sees them: every layer as long as the longest layer unit, and the
/// embedding and head where the step has them.
fn unit_sizes(width: &Widths, layers: u32) -> UnitSizes {
    let unit_bytes = |block: &str, part: &str| width.get(&(block.to_string(), part.to_string())).map(|(t, b)| round_up(u64::from(*t) * b));
    let max_of = |pred: &dyn Fn(&str) -> bool, part: &str| {
        width.iter().filter(|((b, p), _)| pred(b) && p == part).filter_map(|((b, p), _)| unit_bytes(b, p)).max().unwrap_or(0)
    };
    let pb = |pred: &dyn Fn(&str) -> bool| PartBytes { model: max_of(pred, "model"), optimizer: max_of(pred, "optimizer") };
    UnitSizes {
        layers,
        layer: pb(&is_layer),
        embed: width.contains_key(&("embed".to_string(), "model".to_string())).then(|| pb(&|b: &str| b == "embed")),
        head: width.contains_key(&("head".to_string(), "model".to_string())).then(|| pb(&|b: &str| b == "head")),
    }
}

/// A transformer layer's block (not the embedding or the head).
fn is_layer(block: &str) -> bool {
    block.starts_with("layer.")
}

/// A unit's length as the planner sees it.
fn unit_len(units: &UnitSizes, block: &str, part: &str) -> u64 {
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
}

/// A unit file as the planner's shard.
fn shard(f: &StepFile) -> ShardSet {
    ShardSet {
        layers: label(&f.block).unwrap_or_default(),
        parts: Some(vec![part_of(&f.part)]),
        tp_size: f.tp_size,
        tp_ranks: Some(f.tp_rank.to_string()),
    }
}

/// A flow from the cloud or a relay may span several shard files (the planner merges a node's
/// adjacent slices with one source): cut it at every file's boundary (`w`: a shard's planner
/// length) into ranges of the files, each clipped to its file's real length.
fn cut_flow(t: &rp::Transfer, w: u64, part: &str, source: &FetchSource, unit_files: &UnitFiles, ranges: &mut Ranges) {
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

/// Unscheduled cloud reads (a failed source's fallbacks) share the egress equally.
fn share_cloud(restores: &mut BTreeMap<String, Restore>, cloud_egress_mb_s: f64) {
    let share = if cloud_egress_mb_s > 0.0 { cloud_egress_mb_s / restores.len().max(1) as f64 } else { 0.0 };
    for r in restores.values_mut() {
        r.cloud_share_mb_s = share;
    }
}

/// A rate the node reported, else the default.
fn rate_or(v: f64, d: f64) -> f64 {
    if v > 0.0 {
        v
    } else {
        d
    }
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
