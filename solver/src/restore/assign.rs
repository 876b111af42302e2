//! The restore planner's greedy assignments (each reader's source, a budget on the busiest
//! resource, an order of preference among equal sources) and their paced schedules: what
//! `plan_restore` runs several times and compares (docs/restore.md).

use super::*;

/// One flow of a schedule: node `d` reads segments `s..e` (one unit, one source, one file).
#[derive(Debug, Clone, Copy)]
pub(super) struct Flow {
    pub(super) d: usize,
    pub(super) s: usize,
    pub(super) e: usize,
    pub(super) shard: Option<(u32, u32)>,
}

/// A greedy run's assignment paced: its flows, makespan and bytes.
pub(super) struct Schedule {
    pub(super) choice: Vec<Vec<Option<Choice>>>,
    pub(super) busiest: usize,
    /// The busiest resource's load over its rate.
    pub(super) m: f64,
    pub(super) makespan: f64,
    pub(super) bytes: BytesBySource,
    pub(super) by_tier: BytesByTier,
    pub(super) flows: Vec<Flow>,
}

pub(super) fn kind_of(c: Choice, d: usize) -> Kind {
    match c.from {
        None => Kind::Cloud,
        Some(v) if v == d => Kind::Local,
        Some(_) => Kind::Peer,
    }
}

/// The paced schedule of an assignment: every flow at bytes / M, plus a chunk of lag per relay
/// hop; flows joined over the following segments of a unit with the same source and file.
pub(super) fn schedule(inst: &Instance, rate: &[f64], chunk: f64, choice: Vec<Vec<Option<Choice>>>, load: Vec<f64>) -> Schedule {
    let (n, ns) = (inst.nodes(), inst.segments.len());
    let cloud_r = 4 * n;
    let (busiest, m) =
        load.iter().zip(rate).enumerate().map(|(r, (l, q))| (r, l / q)).fold((cloud_r, 0.0), |a, b| if b.1 > a.1 { b } else { a });
    let mut makespan = m;
    let mut bytes = BytesBySource::default();
    let mut by_tier = BytesByTier::default();
    let mut flows = Vec::new();
    for d in 0..n {
        let mut s = 0;
        while s < ns {
            let Some(c) = choice[d][s] else {
                s += 1;
                continue;
            };
            let seg = inst.segments[s];
            let shard = |seg_i: usize| match (c.from, c.tier, c.relay) {
                (Some(v), SourceTier::Memory, false) => {
                    inst.shard_of.get(&(v, Tier::Memory, seg_i)).or_else(|| inst.shard_of.get(&(v, Tier::Disk, seg_i))).copied()
                }
                (Some(v), SourceTier::Disk, false) => inst.shard_of.get(&(v, Tier::Disk, seg_i)).copied(),
                _ => None,
            };
            let first_shard = shard(s);
            let mut e = s + 1;
            while e < ns && inst.segments[e].unit == seg.unit && choice[d][e] == Some(c) && shard(e) == first_shard {
                e += 1;
            }
            let len = inst.segments[e - 1].end - seg.start;
            if c.depth > 0 {
                // A relay forwards a chunk once it has it: each hop before this one delays the
                // flow by one chunk at the slowest rate on this flow's path.
                let slowest = match c.from {
                    Some(v) => rate[4 * v + R_OUT].min(rate[4 * d + R_IN]),
                    None => rate[cloud_r].min(rate[4 * d + R_IN]),
                };
                makespan = makespan.max(m + f64::from(c.depth) * chunk.min(seg.bytes()) / slowest);
            }
            let kind = kind_of(c, d);
            match (kind, c.tier) {
                (Kind::Local, SourceTier::Memory) => by_tier.local_memory += len,
                (Kind::Local, _) => by_tier.local_disk += len,
                (Kind::Peer, SourceTier::Disk) => by_tier.peer_disk += len,
                (Kind::Peer, _) => by_tier.peer_memory += len,
                (Kind::Cloud, _) => by_tier.cloud += len,
            }
            match kind {
                Kind::Local => bytes.local += len,
                Kind::Peer => bytes.peer += len,
                Kind::Cloud => bytes.cloud += len,
            }
            flows.push(Flow { d, s, e, shard: first_shard });
            s = e;
        }
    }
    Schedule { choice, busiest, m, makespan, bytes, by_tier, flows }
}

/// Which source a greedy run takes among equally good ones.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Prefer {
    /// Local memory, a peer's memory (relays included), local disk, a peer's disk, the cloud:
    /// the slow disks spared.
    PeerMemory,
    /// Local memory, local disk, a peer's memory, a peer's disk, the cloud: the NICs spared.
    Local,
}

/// One greedy assignment. Each reader takes the source whose busiest resource would be least
/// busy after the move, counting any time up to `target` as free; ties (and every option
/// within `target`) go to the preferred source (`Prefer`); then fewer relay hops.
pub(super) fn greedy(inst: &Instance, rate: &[f64], target: f64, prefer: Prefer) -> (Vec<Vec<Option<Choice>>>, Vec<f64>) {
    // Rank of each source among equals: local memory, local disk, peer memory, peer disk, cloud.
    let (local_disk, peer_memory) = match prefer {
        Prefer::PeerMemory => (2, 1),
        Prefer::Local => (1, 2),
    };
    let n = inst.nodes();
    let ns = inst.segments.len();
    let cloud_r = 4 * n;
    let mut load = vec![0.0f64; 4 * n + 1];
    // `in_memory[v][s]`: the depth at which node v has segment s in memory (0: held, or read
    // from its disk during this restore; k: received over k hops).
    let mut in_memory: Vec<Vec<Option<u32>>> =
        inst.held.iter().map(|h| h.iter().map(|&f| (f & HELD_MEMORY != 0).then_some(0)).collect()).collect();
    let mut fetched = vec![false; ns];
    let mut choice: Vec<Vec<Option<Choice>>> = vec![vec![None; ns]; n];

    // Local memory first: nothing is cheaper.
    for (d, chosen) in choice.iter_mut().enumerate() {
        for (s, c) in chosen.iter_mut().enumerate() {
            if inst.needs[d][s] && inst.held[d][s] & HELD_MEMORY != 0 {
                load[4 * d + R_MEM] += inst.segments[s].bytes();
                *c = Some(Choice { from: Some(d), tier: SourceTier::Memory, relay: false, depth: 0 });
            }
        }
    }
    // The rest segment by segment (so a segment's first copy fans out to its other readers),
    // each reader taking the source that keeps its busiest resource least busy.
    let holders: Vec<Vec<usize>> = (0..ns).map(|s| (0..n).filter(|&h| inst.held[h][s] != 0).collect()).collect();
    let mut order: Vec<usize> = (0..ns).collect();
    // Segments with fewer holders first: they have fewer choices.
    order.sort_by_key(|&s| (holders[s].len(), s));
    let mut options: Vec<(Choice, [usize; 3], usize)> = Vec::new();
    for &s in &order {
        let b = inst.segments[s].bytes();
        // Readers holding it on their own disk first (their read also makes it available).
        let mut readers: Vec<usize> = (0..n).filter(|&d| inst.needs[d][s] && choice[d][s].is_none()).collect();
        readers.sort_by_key(|&d| (inst.held[d][s] & HELD_DISK == 0, d));
        for d in readers {
            options.clear();
            if in_memory[d][s].is_some() {
                // Read from its disk already, for a peer: copy it from memory.
                options.push((
                    Choice { from: Some(d), tier: SourceTier::Memory, relay: false, depth: 0 },
                    [4 * d + R_MEM, usize::MAX, usize::MAX],
                    0,
                ));
            } else if inst.held[d][s] & HELD_DISK != 0 {
                options.push((
                    Choice { from: Some(d), tier: SourceTier::Disk, relay: false, depth: 0 },
                    [4 * d + R_DISK, usize::MAX, usize::MAX],
                    local_disk,
                ));
            }
            for (v, has) in in_memory.iter().enumerate() {
                if v == d {
                    continue;
                }
                if let Some(depth) = has[s] {
                    let relay = inst.held[v][s] == 0 || (depth > 0);
                    options.push((
                        Choice { from: Some(v), tier: SourceTier::Memory, relay, depth },
                        [4 * v + R_OUT, 4 * d + R_IN, usize::MAX],
                        peer_memory,
                    ));
                } else if inst.held[v][s] & HELD_DISK != 0 {
                    options.push((
                        Choice { from: Some(v), tier: SourceTier::Disk, relay: false, depth: 0 },
                        [4 * v + R_DISK, 4 * v + R_OUT, 4 * d + R_IN],
                        3,
                    ));
                }
            }
            if inst.cloud_holds && !fetched[s] {
                options.push((
                    Choice { from: None, tier: SourceTier::Cloud, relay: false, depth: 0 },
                    [cloud_r, 4 * d + R_IN, usize::MAX],
                    4,
                ));
            }
            let cost = |res: &[usize; 3]| res.iter().filter(|&&r| r != usize::MAX).map(|&r| (load[r] + b) / rate[r]).fold(0.0, f64::max);
            let best = options
                .iter()
                .min_by(|a, b2| {
                    cost(&a.1).max(target).total_cmp(&cost(&b2.1).max(target)).then(a.2.cmp(&b2.2)).then(a.0.depth.cmp(&b2.0.depth))
                })
                .copied()
                .expect("a segment no node holds is in the cloud (checked)");
            for &r in best.1.iter().filter(|&&r| r != usize::MAX) {
                load[r] += b;
            }
            let got_depth = match best.0.tier {
                SourceTier::Cloud => {
                    fetched[s] = true;
                    1
                }
                _ if best.0.from == Some(d) => 0,
                SourceTier::Memory => best.0.depth + 1,
                SourceTier::Disk => {
                    in_memory[best.0.from.expect("a peer")][s] = Some(0);
                    1
                }
            };
            in_memory[d][s] = Some(in_memory[d][s].map_or(got_depth, |x| x.min(got_depth)));
            choice[d][s] = Some(best.0);
        }
    }

    (choice, load)
}
