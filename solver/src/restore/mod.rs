//! The restore planner (docs/restore.md): which bytes of a checkpoint step each node of a new plan
//! must hold, who already holds them where, and how to move them; with a lower bound on the
//! time any transfer schedule needs, printed side by side. The problem is stated in
//! `solver/README.md` ("Restore planning"); in short:
//!
//! * A step's **units** (a layer, the embedding or the head; model or optimizer part) are
//!   byte strings; a TP shard `r` of degree `t` is the `r`-th of `t` equal slices. Every unit
//!   is cut into the slices of the least common multiple of the TP degrees that name it
//!   (**segments**), so a demand for TP `t'` is served from the TP `t` shards that cover its
//!   slice (re-slicing).
//! * Each node needs a set of segments (what its ranks of the new plan load; a segment two of
//!   its ranks need is read once per node). Each node holds segments in memory or on disk;
//!   the cloud holds the whole step (unless `holds_step: false`).
//! * Rates: per node NIC in, NIC out, disk read, memory copy; the cloud's egress, shared.
//!   A local memory copy costs memory-copy time, a local disk read disk time; a peer's byte
//!   costs the sender's NIC out (and its disk, once, if it is not yet in its memory) and the
//!   receiver's NIC in; a cloud byte costs cloud egress and the receiver's NIC in. A byte a
//!   node has read or received is in its memory and can be forwarded (fan-out).
//!
//! **The lower bound** (`lower_bound_s`) is the exact optimum of a fluid relaxation, the larger
//! of two max-flow horizons (each found by Dinkelbach's iteration on min cuts, [`flow`]):
//! *delivery* (every needed byte reaches its node through local memory copy, local disk
//! read or the NIC in, and all network arrivals leave some NIC or the cloud) and *origin*
//! (every needed segment no node holds in memory is read at least once from a disk holding it
//! or fetched once from the cloud). Every schedule satisfies both, whatever its relays, so no
//! schedule is faster. **The plan** assigns every needed segment a source (local memory, local
//! disk, a peer or relay, the cloud once per segment) greedily, each choice the one that
//! keeps the busiest resource least busy (with the bound as a budget within which memory
//! sources are preferred, `greedy`; the best of seven runs); its `makespan_s` is the paced
//! schedule's: every flow
//! runs at `bytes / M`, `M` the busiest resource's load over its rate, plus, per relay hop
//! before a flow, the time of one chunk at the flow's slowest link (a relay forwards a chunk
//! once it has it whole and verified). The best run is the one with the least makespan, then
//! the fewest cloud bytes, then the fewest peer bytes (makespans within `MAKESPAN_TIE` of each
//! other are equal): cloud bytes cost egress and share one link among every job, peer bytes
//! share the nodes' NICs, and a restore whose pace one node's link sets gains nothing from
//! either (docs/recovery.md, step 5).

mod assign;
pub mod flow;
pub mod scenario;

use std::collections::{BTreeMap, HashMap};

use serde::Serialize;

use assign::{greedy, kind_of, schedule, Flow, Prefer, Schedule};
pub use scenario::{CloudSpec, Demand, Holding, NodeRates, Part, PartBytes, RestoreScenario, ShardSet, Tier, UnitSizes};
use scenario::{Shard, UnitId, MAX_SLICES};

use crate::error::{Result, SolverError};

const MB: f64 = 1e6;
const DEFAULT_CHUNK: u64 = 16 << 20;

/// Makespans within this fraction of the least one are a tie, settled by bytes. Two runs that
/// put the same bytes on the same bottleneck differ by rounding only (sums in another order,
/// ~1e-16 relative); a real difference is a chunk, a byte or more at MB/s rates, far above
/// one part in a billion of a makespan.
pub const MAKESPAN_TIE: f64 = 1e-9;

/// One unit of the step and how finely it is cut.
#[derive(Debug, Clone)]
pub struct UnitInfo {
    pub id: UnitId,
    pub bytes: u64,
    pub slices: u64,
    pub first_seg: usize,
}

/// A slice `k` of `slices` of a unit: bytes `[start, end)` of it.
#[derive(Debug, Clone, Copy)]
pub struct Segment {
    pub unit: usize,
    pub k: u64,
    pub start: u64,
    pub end: u64,
}

impl Segment {
    pub fn bytes(&self) -> f64 {
        (self.end - self.start) as f64
    }
}

/// The scenario resolved into segments: what the bound and the plan work on.
#[derive(Debug, Clone)]
pub struct Instance {
    pub units: Vec<UnitInfo>,
    pub segments: Vec<Segment>,
    /// `held[n][s]`: bit 1 memory, bit 2 disk.
    pub held: Vec<Vec<u8>>,
    /// `needs[n][s]`: node `n` must hold segment `s`.
    pub needs: Vec<Vec<bool>>,
    /// Bytes each node's demand entries list, duplicates counted (every rank its own).
    pub listed_bytes: Vec<f64>,
    /// Rates in bytes/s: memory copy, disk read, NIC in, NIC out.
    pub mem: Vec<f64>,
    pub disk: Vec<f64>,
    pub nic_in: Vec<f64>,
    pub nic_out: Vec<f64>,
    pub cloud: f64,
    pub cloud_holds: bool,
    /// The shard file a holder serves a segment from: `(node, tier, segment) -> (rank, size)`.
    pub shard_of: HashMap<(usize, Tier, usize), (u32, u32)>,
}

pub const HELD_MEMORY: u8 = 1;
pub const HELD_DISK: u8 = 2;

fn gcd(a: u64, b: u64) -> u64 {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

impl Instance {
    /// Resolve a scenario; errors name the field and the fix.
    pub fn new(sc: &RestoreScenario) -> Result<Instance> {
        sc.validate()?;
        let n = sc.nodes.len();
        // Expand every shard set once, remembering where it came from.
        let mut expanded: Vec<(usize, Option<Tier>, Shard, String)> = Vec::new();
        for (i, h) in sc.holdings.iter().enumerate() {
            let node = sc.node_index(&h.node, &format!("holdings[{i}].node"))?;
            for (j, set) in h.shards.iter().enumerate() {
                let f = format!("holdings[{i}].shards[{j}]");
                for s in set.expand(&sc.units, &f)? {
                    expanded.push((node, Some(h.tier), s, f.clone()));
                }
            }
        }
        for (i, d) in sc.demands.iter().enumerate() {
            let node = sc.node_index(&d.node, &format!("demands[{i}].node"))?;
            for (j, set) in d.shards.iter().enumerate() {
                let f = format!("demands[{i}].shards[{j}]");
                for s in set.expand(&sc.units, &f)? {
                    expanded.push((node, None, s, f.clone()));
                }
            }
        }
        // Slices per unit: the lcm of the TP degrees naming it.
        let mut slices: BTreeMap<UnitId, u64> = BTreeMap::new();
        for (_, _, s, f) in &expanded {
            let l = slices.entry(s.unit).or_insert(1);
            let t = u64::from(s.tp_size);
            *l = *l / gcd(*l, t) * t;
            if *l > MAX_SLICES {
                return Err(SolverError::invalid(
                    format!("{f}.tp_size"),
                    format!("the TP degrees naming layer {} cut it into more than {MAX_SLICES} slices; use degrees that divide one another (powers of two)", sc.units.label(s.unit.pos)),
                ));
            }
        }
        let mut units = Vec::new();
        let mut segments = Vec::new();
        let mut unit_index = HashMap::new();
        for (&id, &l) in &slices {
            let bytes = sc.units.bytes(id).expect("expanded shards name existing units");
            unit_index.insert(id, units.len());
            units.push(UnitInfo { id, bytes, slices: l, first_seg: segments.len() });
            for k in 0..l {
                let at = |k: u64| (u128::from(bytes) * u128::from(k) / u128::from(l)) as u64;
                segments.push(Segment { unit: units.len() - 1, k, start: at(k), end: at(k + 1) });
            }
        }
        let ns = segments.len();
        let mut held = vec![vec![0u8; ns]; n];
        let mut needs = vec![vec![false; ns]; n];
        let mut listed_bytes = vec![0.0; n];
        let mut shard_of = HashMap::new();
        for (node, tier, s, _) in &expanded {
            let u = &units[unit_index[&s.unit]];
            let per = u.slices / u64::from(s.tp_size);
            let first = u.first_seg + (u64::from(s.tp_rank) * per) as usize;
            for seg in first..first + per as usize {
                match tier {
                    Some(t) => {
                        held[*node][seg] |= if *t == Tier::Memory { HELD_MEMORY } else { HELD_DISK };
                        shard_of.entry((*node, *t, seg)).or_insert((s.tp_rank, s.tp_size));
                    }
                    None => {
                        needs[*node][seg] = true;
                        listed_bytes[*node] += segments[seg].bytes();
                    }
                }
            }
        }
        if !sc.cloud.holds_step {
            for s in 0..ns {
                if (0..n).any(|d| needs[d][s]) && (0..n).all(|h| held[h][s] == 0) {
                    let u = &units[segments[s].unit];
                    return Err(SolverError::invalid(
                        "cloud.holds_step",
                        format!(
                            "is false and no node holds bytes {}..{} of layer {} ({:?}): the step cannot be restored; restore an earlier step or set holds_step: true if the cloud has it",
                            segments[s].start,
                            segments[s].end,
                            sc.units.label(u.id.pos),
                            u.id.part
                        ),
                    ));
                }
            }
        }
        Ok(Instance {
            units,
            segments,
            held,
            needs,
            listed_bytes,
            mem: sc.nodes.iter().map(|x| x.mem_copy_mb_s * MB).collect(),
            disk: sc.nodes.iter().map(|x| x.disk_read_mb_s * MB).collect(),
            nic_in: sc.nodes.iter().map(|x| x.nic_in_mb_s * MB).collect(),
            nic_out: sc.nodes.iter().map(|x| x.nic_out() * MB).collect(),
            cloud: sc.cloud.egress_mb_s * MB,
            cloud_holds: sc.cloud.holds_step,
            shard_of,
        })
    }

    pub fn nodes(&self) -> usize {
        self.held.len()
    }
}

/// The two horizons whose larger is the lower bound.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Bound {
    /// Every needed byte through local memory, local disk or NIC in; network arrivals from
    /// some NIC out or the cloud.
    pub delivery_s: f64,
    /// Every needed segment no node holds in memory read once from a disk holding it or
    /// fetched once from the cloud.
    pub origin_s: f64,
}

impl Bound {
    pub fn value(&self) -> f64 {
        self.delivery_s.max(self.origin_s)
    }
}

/// The fluid lower bound of an instance (see the module documentation).
pub fn lower_bound(inst: &Instance) -> Bound {
    let n = inst.nodes();
    // Delivery: per node, its needed bytes by where it holds them.
    let mut net = flow::Network::new();
    let (s, t) = (net.node(), net.node());
    let pool = net.node();
    let out_total: f64 = inst.nic_out.iter().sum::<f64>() + if inst.cloud_holds { inst.cloud } else { 0.0 };
    net.edge(pool, t, 0.0, out_total);
    let mut required = 0.0;
    for d in 0..n {
        // Needed bytes by what the node holds them in: neither, memory, disk, both.
        let mut by_flags = [0.0f64; 4];
        for (seg, need) in inst.needs[d].iter().enumerate() {
            if *need {
                by_flags[usize::from(inst.held[d][seg] & (HELD_MEMORY | HELD_DISK))] += inst.segments[seg].bytes();
            }
        }
        let total: f64 = by_flags.iter().sum();
        if total == 0.0 {
            continue;
        }
        required += total;
        let (nic, mem, disk) = (net.node(), net.node(), net.node());
        net.edge(nic, pool, 0.0, inst.nic_in[d]);
        net.edge(mem, t, 0.0, inst.mem[d]);
        net.edge(disk, t, 0.0, inst.disk[d]);
        for (flags, bytes) in by_flags.iter().enumerate().filter(|(_, b)| **b > 0.0) {
            let c = net.node();
            net.edge(s, c, *bytes, 0.0);
            net.edge(c, nic, f64::INFINITY, 0.0);
            if flags as u8 & HELD_MEMORY != 0 {
                net.edge(c, mem, f64::INFINITY, 0.0);
            }
            if flags as u8 & HELD_DISK != 0 {
                net.edge(c, disk, f64::INFINITY, 0.0);
            }
        }
    }
    let delivery_s = net.min_horizon(s, t, required).unwrap_or(f64::INFINITY);

    // Origin: needed segments held in no memory, grouped by the disks holding them.
    let mut groups: BTreeMap<Vec<usize>, f64> = BTreeMap::new();
    for (seg, sg) in inst.segments.iter().enumerate() {
        if !(0..n).any(|d| inst.needs[d][seg]) || (0..n).any(|h| inst.held[h][seg] & HELD_MEMORY != 0) {
            continue;
        }
        let disks: Vec<usize> = (0..n).filter(|&h| inst.held[h][seg] & HELD_DISK != 0).collect();
        *groups.entry(disks).or_insert(0.0) += sg.bytes();
    }
    let mut net = flow::Network::new();
    let (s, t) = (net.node(), net.node());
    let disk_nodes: Vec<usize> = (0..n)
        .map(|h| {
            let v = net.node();
            net.edge(v, t, 0.0, inst.disk[h]);
            v
        })
        .collect();
    let cloud = net.node();
    if inst.cloud_holds {
        net.edge(cloud, t, 0.0, inst.cloud);
    }
    let mut required = 0.0;
    for (disks, bytes) in &groups {
        let g = net.node();
        net.edge(s, g, *bytes, 0.0);
        for &h in disks {
            net.edge(g, disk_nodes[h], f64::INFINITY, 0.0);
        }
        net.edge(g, cloud, f64::INFINITY, 0.0);
        required += bytes;
    }
    let origin_s = net.min_horizon(s, t, required).unwrap_or(f64::INFINITY);
    Bound { delivery_s, origin_s }
}

/// Where a transfer's bytes come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    Local,
    Peer,
    Cloud,
}

/// The tier a transfer reads at its source.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum SourceTier {
    Memory,
    Disk,
    Cloud,
}

/// The shard file a transfer reads, when it reads one (not a relay, not the cloud).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub struct SourceShard {
    pub tp_rank: u32,
    pub tp_size: u32,
    /// Where in that shard file the bytes start.
    pub offset: u64,
}

/// One flow of the plan: `bytes` bytes of a unit from `offset` on, paced at `rate_mb_s`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Transfer {
    pub from: String,
    pub to: String,
    pub kind: Kind,
    pub tier: SourceTier,
    /// The sender received these bytes during this restore and forwards them.
    pub relay: bool,
    pub layer: String,
    pub part: Part,
    pub offset: u64,
    pub bytes: u64,
    pub source_shard: Option<SourceShard>,
    pub rate_mb_s: f64,
}

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Default)]
pub struct BytesBySource {
    pub local: u64,
    pub peer: u64,
    pub cloud: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Default)]
pub struct BytesByTier {
    pub local_memory: u64,
    pub local_disk: u64,
    pub peer_memory: u64,
    pub peer_disk: u64,
    pub cloud: u64,
}

/// What `motley restore-plan` prints (a contract: docs/restore.md).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RestorePlan {
    pub scenario: String,
    pub lower_bound_s: f64,
    pub makespan_s: f64,
    /// Every rank fetching its own shards from the cloud (Varuna's restore).
    pub cloud_only_s: f64,
    pub bound: Bound,
    /// The resource the schedule waits on: `NODE disk|memory|nic_in|nic_out` or `cloud`.
    pub bottleneck: String,
    pub bytes: BytesBySource,
    pub bytes_by_tier: BytesByTier,
    pub transfers: Vec<Transfer>,
}

/// A segment's source in the plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Choice {
    from: Option<usize>,
    tier: SourceTier,
    relay: bool,
    depth: u32,
}

const R_MEM: usize = 0;
const R_DISK: usize = 1;
const R_IN: usize = 2;
const R_OUT: usize = 3;
const R_NAMES: [&str; 4] = ["memory", "disk", "nic_in", "nic_out"];

/// Plan the restore of a scenario: the transfers, their schedule's makespan and the lower bound.
pub fn plan_restore(sc: &RestoreScenario) -> Result<RestorePlan> {
    let inst = Instance::new(sc)?;
    let bound = lower_bound(&inst);
    let n = inst.nodes();
    let cloud_r = 4 * n;
    let mut rate = vec![0.0; 4 * n + 1];
    for v in 0..n {
        rate[4 * v + R_MEM] = inst.mem[v];
        rate[4 * v + R_DISK] = inst.disk[v];
        rate[4 * v + R_IN] = inst.nic_in[v];
        rate[4 * v + R_OUT] = inst.nic_out[v];
    }
    rate[cloud_r] = inst.cloud;
    // Pure min-max, then with the bound (and a little above it) as a budget within which the
    // scarce resources are spared, in two orders of preference (a peer's memory before the
    // local disk, or every local source first); the least makespan wins, then the fewest
    // cloud bytes, then the fewest peer bytes.
    let chunk = sc.chunk_bytes.unwrap_or(DEFAULT_CHUNK) as f64;
    let mut runs = vec![greedy(&inst, &rate, 0.0, Prefer::PeerMemory)];
    for slack in [1.0, 1.05, 1.15] {
        for prefer in [Prefer::PeerMemory, Prefer::Local] {
            runs.push(greedy(&inst, &rate, bound.value() * slack, prefer));
        }
    }
    let runs: Vec<Schedule> = runs.into_iter().map(|(choice, load)| schedule(&inst, &rate, chunk, choice, load)).collect();
    let least = runs.iter().map(|r| r.makespan).fold(f64::INFINITY, f64::min);
    let best = runs
        .into_iter()
        .filter(|r| r.makespan <= least * (1.0 + MAKESPAN_TIE))
        .min_by(|a, b| (a.bytes.cloud, a.bytes.peer).cmp(&(b.bytes.cloud, b.bytes.peer)).then(a.makespan.total_cmp(&b.makespan)))
        .expect("at least one run");
    let Schedule { choice, busiest, m, makespan, bytes, by_tier, flows, .. } = best;

    let mut transfers = Vec::with_capacity(flows.len());
    let names: Vec<&str> = sc.nodes.iter().map(|x| x.name.as_str()).collect();
    for &Flow { d, s, e, shard: first_shard } in &flows {
        let c = choice[d][s].expect("a flow has a source");
        let seg = inst.segments[s];
        let (start, end) = (seg.start, inst.segments[e - 1].end);
        let len = end - start;
        let u = &inst.units[seg.unit];
        transfers.push(Transfer {
            from: c.from.map_or_else(|| "cloud".to_string(), |v| names[v].to_string()),
            to: names[d].to_string(),
            kind: kind_of(c, d),
            tier: c.tier,
            relay: c.relay,
            layer: sc.units.label(u.id.pos),
            part: u.id.part,
            offset: start,
            bytes: len,
            source_shard: first_shard.map(|(r, t)| SourceShard {
                tp_rank: r,
                tp_size: t,
                offset: start - (u128::from(u.bytes) * u128::from(r) / u128::from(t)) as u64,
            }),
            rate_mb_s: if m > 0.0 { len as f64 / m / MB } else { 0.0 },
        });
    }
    let total_listed: f64 = inst.listed_bytes.iter().sum();
    let cloud_only_s = inst.listed_bytes.iter().zip(&inst.nic_in).map(|(b, r)| b / r).fold(total_listed / inst.cloud, f64::max);
    let bottleneck = if m == 0.0 {
        "none".to_string()
    } else if busiest == cloud_r {
        "cloud".to_string()
    } else {
        format!("{} {}", names[busiest / 4], R_NAMES[busiest % 4])
    };
    Ok(RestorePlan {
        scenario: sc.name.clone(),
        lower_bound_s: bound.value(),
        makespan_s: makespan,
        cloud_only_s,
        bound,
        bottleneck,
        bytes,
        bytes_by_tier: by_tier,
        transfers,
    })
}
