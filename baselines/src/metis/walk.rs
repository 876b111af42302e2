//! Metis's own search, replayed: its inter-stage generator, its intra-stage strategy walk
//! with out-of-memory repair, and its greedy layer balancer, step for step, so its search
//! effort (plans costed, ImprovedMetis's "search steps") can be measured next to ours and
//! the repair rule of ImprovedMetis can be compared with Metis's.
//!
//! The walk: for each (node sequence, stage count, device-group vector, micro-batch count
//! M in descending divisors of gbs), start every stage at (dp, tp) = (g, 1); balance layers
//! by stage speed; if a stage is out of memory, move compute share away from it and
//! rebalance (at most 3 attempts); a plan that fits is costed, and if it fitted at the first
//! attempt the group vector is done. Otherwise mutate one stage (dp, tp) -> (dp/2, 2tp):
//! the stage with the least memory headroom that still has dp > 1. Metis reads headroom
//! from the last partition that fitted (or 1/dp); ImprovedMetis (`Repair::MostOutOfMemory`)
//! from the first failed attempt, so the stage most out of memory changes first.
//! ImprovedMetis's code is not public (its fork is not reachable from here), so its rule is
//! rebuilt from the paper: when the first partition attempt runs out of memory and the
//! stage most out of memory can still halve its dp, that stage is changed at once instead
//! of rebalancing layers around it; otherwise it repairs as Metis does. Replicas without
//! samples (a mixed stage's batch split can give a slow replica none) are skipped, as in
//! Metis's `get_cost`. Metis's bug that under-costs plans after a node-sequence switch is
//! not replayed. With these, the replay reproduces Metis's plans costed and best costs on
//! all three Table 1 rows (BENCHMARKS.md).

use std::collections::HashMap;

use serde::Serialize;

use super::cost::{Layout, MetisModel, StageTable};
use super::plan::MetisPlan;

const MIB: f64 = 1024.0 * 1024.0;
const SUB_LAYERS: usize = 7;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Repair {
    /// Metis: least headroom of the last partition that fitted, else least 1/dp.
    Metis,
    /// ImprovedMetis (`--use_strat`): least headroom of the first failed attempt.
    MostOutOfMemory,
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct WalkCounters {
    pub inter_stage_plans: u64,
    pub strategy_mutations: u64,
    pub partition_calls: u64,
    pub failed_memory_checks: u64,
    /// Plans priced (Metis's cost_evals), KeyError plans included.
    pub plans_costed: u64,
    /// ImprovedMetis's "search steps": mutations plus failed memory checks, over the calls
    /// that yielded a plan.
    pub count: u64,
}

#[derive(Debug, Clone, Serialize)]
pub struct WalkOutcome {
    /// Cheapest plan the walk priced, with its cost (Metis prints all, sorted).
    pub best: Option<(MetisPlan, f64)>,
    pub counters: WalkCounters,
}

/// Metis's `LayerComputeBalancer`: layers split into 7 sub-units, a greedy forward fill, a
/// backward fill of the last stage, neighbours for the rest, majority vote, 3 adjustments.
struct Balancer<'d> {
    stages: usize,
    sub_layers: usize,
    capa_bak: Vec<f64>,
    capa: Vec<f64>,
    demand: &'d [f64],
    expanded: Vec<f64>,
    alloc: Vec<Vec<usize>>,
    unassigned: Vec<usize>,
}

impl<'d> Balancer<'d> {
    fn run(capa: Vec<f64>, demand: &'d [f64]) -> Option<Vec<usize>> {
        let expanded = demand.iter().flat_map(|d| std::iter::repeat_n(d / SUB_LAYERS as f64, SUB_LAYERS)).collect();
        let stages = capa.len();
        let mut b = Balancer {
            stages,
            sub_layers: demand.len() * SUB_LAYERS,
            capa_bak: capa.clone(),
            capa,
            demand,
            expanded,
            alloc: vec![vec![]; stages],
            unassigned: vec![],
        };
        b.forward();
        b.backward();
        b.unassigned_pass()?;
        b.real_value();
        b.adjust();
        let mut partition = vec![0];
        for s in 0..stages {
            partition.push(partition[s] + b.alloc[s].len());
        }
        Some(partition)
    }

    // `k` is read when each stage's loop starts, as in Metis's Python.
    #[allow(clippy::mut_range_bound)]
    fn forward(&mut self) {
        let mut k = 0;
        let end = self.sub_layers.saturating_sub(1 + SUB_LAYERS);
        for s in 0..self.stages - 1 {
            for l in k..end {
                if self.capa[s] > self.expanded[l] {
                    self.capa[s] -= self.expanded[l];
                    self.alloc[s].push(l);
                    k = l + 1;
                } else {
                    self.unassigned.push(l);
                    k = l + 1;
                    break;
                }
            }
        }
        self.unassigned.extend(k..self.sub_layers);
        self.unassigned.sort_unstable();
        self.unassigned.dedup();
    }

    fn backward(&mut self) {
        let last = self.stages - 1;
        let mut order = self.unassigned.clone();
        order.reverse();
        for l in order {
            if self.alloc[last].len() < SUB_LAYERS {
                self.capa[last] -= self.expanded[l];
                self.alloc[last].push(l);
                self.unassigned.retain(|&x| x != l);
                continue;
            }
            if Some(&(l + 1)) != self.alloc[last].iter().min() {
                continue;
            }
            if self.capa[last] > self.expanded[l] {
                self.capa[last] -= self.expanded[l];
                self.alloc[last].push(l);
                self.unassigned.retain(|&x| x != l);
            }
        }
    }

    fn unassigned_pass(&mut self) -> Option<()> {
        for l in self.unassigned.clone() {
            let (mut lo, mut hi) = (0, self.stages - 1);
            let (mut below, mut above) = (f64::NEG_INFINITY, f64::INFINITY);
            for (s, group) in self.alloc.iter().enumerate() {
                let (Some(&mn), Some(&mx)) = (group.iter().min(), group.iter().max()) else { continue };
                if l > mx && (mx as f64) > below {
                    lo = s;
                    below = mx as f64;
                }
                if l < mn && (mn as f64) < above {
                    hi = s;
                    above = mn as f64;
                }
            }
            let mut stage = None;
            let mut most = f64::NEG_INFINITY;
            for s in lo..=hi {
                if self.capa[s] > most {
                    most = self.capa[s];
                    stage = Some(s);
                }
            }
            let s = stage?;
            self.capa[s] -= self.expanded[l];
            self.alloc[s].push(l);
        }
        self.unassigned.clear();
        for g in &mut self.alloc {
            g.sort_unstable();
        }
        Some(())
    }

    fn real_value(&mut self) {
        for g in &mut self.alloc {
            let real: Vec<usize> = g.iter().map(|l| l / SUB_LAYERS).collect();
            let mut kept: Vec<usize> =
                real.iter().copied().filter(|x| real.iter().filter(|y| *y == x).count() as f64 > SUB_LAYERS as f64 / 2.0).collect();
            kept.sort_unstable();
            kept.dedup();
            *g = kept;
        }
        self.capa = (0..self.stages)
            .map(|s| match (self.alloc[s].first(), self.alloc[s].last()) {
                (Some(&a), Some(&b)) => self.capa_bak[s] - self.demand[a..=b].iter().sum::<f64>(),
                _ => self.capa_bak[s],
            })
            .collect();
    }

    fn adjust(&mut self) {
        let mut opt_capa = self.capa.clone();
        let mut opt_alloc = self.alloc.clone();
        let mut searches = 0;
        loop {
            searches += 1;
            // The stage with the most spare capacity (first on ties).
            let mut stage = 0;
            for (i, c) in opt_capa.iter().enumerate() {
                if *c > opt_capa[stage] {
                    stage = i;
                }
            }
            let mut near = None;
            let mut least = f64::INFINITY;
            if stage >= 1 && opt_capa[stage - 1] < least {
                near = Some(stage - 1);
                least = opt_capa[stage - 1];
            }
            if stage + 1 < opt_capa.len() && opt_capa[stage + 1] < least {
                near = Some(stage + 1);
            }
            if near.is_some_and(|n| self.alloc[n].len() == 1) {
                near = None;
            }
            if let Some(n) = near.filter(|&n| !opt_alloc[n].is_empty()) {
                let layer = if stage > n { opt_alloc[n].pop().unwrap() } else { opt_alloc[n].remove(0) };
                opt_alloc[stage].push(layer);
                opt_alloc[stage].sort_unstable();
                opt_capa[stage] -= self.demand[layer];
                opt_capa[n] += self.demand[layer];
            }
            let max = |v: &[f64]| v.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            if max(&opt_capa) > max(&self.capa) || searches > 3 {
                break;
            }
            self.alloc = opt_alloc.clone();
            self.capa = opt_capa.clone();
        }
    }
}

/// Metis's `_adj_compute_performance`: shrink the compute share of out-of-memory stages to
/// 90% of what their memory allows and hand the rest to stages with room.
fn shift_compute(share: &[f64], capacity: &[f64], demand: &[f64]) -> Option<Vec<f64>> {
    let mut adjusted = vec![];
    let mut room = vec![];
    let mut extra = 0.0;
    for ((&c, &cap), &dem) in share.iter().zip(capacity).zip(demand) {
        if cap > dem {
            adjusted.push(c);
            room.push(c * cap / dem - c);
        } else {
            room.push(0.0);
            let a = c * (cap / dem) * 0.9;
            adjusted.push(a);
            extra += c - a;
        }
    }
    if room.iter().sum::<f64>() < extra {
        return None;
    }
    let mut added = vec![0.0; share.len()];
    let mut rounds = 0;
    while extra > 0.01 {
        rounds += 1;
        if rounds > 10_000 {
            return None;
        }
        let total: f64 = room.iter().zip(share).map(|(&a, &c)| if a > 0.001 { c } else { 0.0 }).sum();
        let ratio: Vec<f64> = room.iter().zip(share).map(|(&a, &c)| if a > 0.001 { c / total } else { 0.0 }).collect();
        for i in 0..share.len() {
            let give = if extra * ratio[i] > room[i] { room[i] } else { extra * ratio[i] };
            added[i] += give;
            room[i] -= give;
            extra -= give;
        }
    }
    Some(added.iter().zip(&adjusted).map(|(a, b)| a + b).collect())
}

/// Distinct orders of a multiset of group sizes.
fn distinct_orders(groups: &[u32]) -> Vec<Vec<u32>> {
    fn go(counts: &mut Vec<(u32, usize)>, left: usize, cur: &mut Vec<u32>, out: &mut Vec<Vec<u32>>) {
        if left == 0 {
            out.push(cur.clone());
            return;
        }
        for i in 0..counts.len() {
            if counts[i].1 > 0 {
                counts[i].1 -= 1;
                cur.push(counts[i].0);
                go(counts, left - 1, cur, out);
                cur.pop();
                counts[i].1 += 1;
            }
        }
    }
    let mut counts: Vec<(u32, usize)> = vec![];
    for &g in groups {
        match counts.iter_mut().find(|c| c.0 == g) {
            Some(c) => c.1 += 1,
            None => counts.push((g, 1)),
        }
    }
    let mut out = vec![];
    go(&mut counts, groups.len(), &mut vec![], &mut out);
    out
}

/// Metis's device-group vectors for S stages: power-of-two groups of at least
/// variance x max(N/S, S/N) GPUs summing to N, every distinct order.
pub fn device_groups(n: u32, stages: usize, variance: f64) -> Vec<Vec<u32>> {
    let floor = ((n as usize / stages).max(stages / n as usize)) as f64 * variance;
    let shapes: Vec<u32> = (0..32).map(|k| 1u32 << k).take_while(|&g| g <= n).filter(|&g| g as f64 >= floor).collect();
    fn combos(shapes: &[u32], from: usize, left: u32, parts: usize, cur: &mut Vec<u32>, out: &mut Vec<Vec<u32>>) {
        if parts == 0 {
            if left == 0 {
                out.push(cur.clone());
            }
            return;
        }
        for i in from..shapes.len() {
            if shapes[i] > left {
                break;
            }
            cur.push(shapes[i]);
            combos(shapes, i, left - shapes[i], parts - 1, cur, out);
            cur.pop();
        }
    }
    let mut sorted = vec![];
    combos(&shapes, 0, n, stages, &mut vec![], &mut sorted);
    sorted.iter().flat_map(|c| distinct_orders(c)).collect()
}

/// A partition that fits: boundaries, the attempt it fitted at, per-stage memory headroom.
type Fitted = (Vec<usize>, u32, Vec<f64>);

struct Intra<'w, 'a> {
    m: &'w MetisModel<'a>,
    layout: &'w Layout,
    tables: &'w mut HashMap<(u32, u32, u32), Option<StageTable>>,
    groups: &'w [u32],
    starts: Vec<u32>,
    batches: u32,
    norm: &'w [f64],
}

impl Intra<'_, '_> {
    fn table(&mut self, s: usize, dp: u32) -> Option<StageTable> {
        let (r, g) = (self.starts[s], self.groups[s]);
        let key = (r, g, dp);
        if !self.tables.contains_key(&key) {
            let t = self.m.stage_table(self.layout, r, g, dp, g / dp, self.batches).ok();
            self.tables.insert(key, t);
        }
        self.tables[&key].clone()
    }

    fn valid(&self, strategies: &[(u32, u32)]) -> bool {
        let gbs = self.m.settings.global_batch;
        strategies.iter().all(|&(dp, tp)| {
            let mbs = gbs / dp / self.batches;
            mbs >= 1 && mbs <= self.m.profiles.max_bs && tp <= self.m.profiles.max_tp
        })
    }

    /// Partition layers for `strategies`: Ok((partition, attempts, headroom)) if it fits;
    /// Err(Some(first failed attempt's headroom)) if not; Err(None) where Metis's code
    /// raises (a missing profile, a balancer that places a layer nowhere), which ends the
    /// group vector.
    fn partition(&mut self, strategies: &[(u32, u32)], eager: bool, c: &mut WalkCounters) -> Result<Fitted, Option<Vec<f64>>> {
        let tables: Vec<StageTable> = match strategies.iter().enumerate().map(|(s, &(dp, _))| self.table(s, dp)).collect::<Option<Vec<_>>>()
        {
            Some(t) => t,
            _ => return Err(None),
        };
        c.partition_calls += 1;
        let layers = self.m.settings.layers;
        let speed: Vec<f64> = tables.iter().map(|t| 1.0 / t.time(0, layers)).collect();
        let total: f64 = speed.iter().sum();
        let mut share: Vec<f64> = speed.iter().map(|s| s / total).collect();
        let capacity: Vec<f64> = tables.iter().map(|t| t.capacity_mb).collect();
        let mut first_failed = None;
        for attempt in 1..=3 {
            let Some(p) = Balancer::run(share.clone(), self.norm) else { return Err(None) };
            let demand: Vec<f64> = tables.iter().enumerate().map(|(s, t)| t.memory(p[s], p[s + 1])).collect();
            let headroom: Vec<f64> = capacity.iter().zip(&demand).map(|(c, d)| c - d).collect();
            if headroom.iter().all(|h| *h >= 0.0) {
                return Ok((p, attempt, headroom));
            }
            c.failed_memory_checks += 1;
            // ImprovedMetis: an out-of-memory stage that can still trade dp for tp is changed
            // at once instead of rebalancing layers around it.
            let worst = (0..headroom.len()).min_by(|&a, &b| headroom[a].total_cmp(&headroom[b])).unwrap_or(0);
            if eager && attempt == 1 && strategies[worst].0 > 1 {
                return Err(Some(headroom));
            }
            first_failed.get_or_insert(headroom);
            match shift_compute(&share, &capacity, &demand) {
                Some(s) => share = s,
                None => return Err(Some(first_failed.unwrap_or_default())),
            }
        }
        Err(Some(first_failed.unwrap_or_default()))
    }

    /// Metis's `get_cost` for a partition that may have empty stages.
    fn cost(&mut self, strategies: &[(u32, u32)], p: &[usize]) -> Option<f64> {
        let s = self.groups.len();
        let (mut lens, mut pp, mut dp_max, mut upd_max, mut fb) = (vec![], 0.0, 0.0f64, 0.0f64, 0.0);
        for i in 0..s {
            let (dp, tp) = strategies[i];
            let t = self.table(i, dp)?;
            let (a, b) = (p[i], p[i + 1]);
            lens.push(t.time(a, b));
            if i == s - 1 {
                fb = t.fb_sync_total.clone().ok()?;
            } else {
                let end = self.starts[i] + self.groups[i] + self.groups[i + 1];
                pp += self.m.activation(b, t.mbs, tp) / (self.m.pp_bandwidth(self.layout, self.starts[i], end) * MIB);
            }
            dp_max = dp_max.max(t.dp_cost(self.m.stage_params(tp, a, b)));
            upd_max = upd_max.max(t.update_per_layer * (b as f64 - a as f64));
        }
        let max_t = lens.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let e = (self.batches - 1) as f64 * max_t + lens.iter().sum::<f64>();
        Some(e + fb + upd_max + dp_max + pp + self.m.profiles.constants.batch_generator_ms * self.batches as f64)
    }
}

/// Replay Metis's search with the given repair rule.
pub fn walk(m: &MetisModel, variance: f64, repair: Repair) -> WalkOutcome {
    let n = m.cluster.total_gpus();
    let layers = m.settings.layers;
    let gbs = m.settings.global_batch;
    let mut c = WalkCounters::default();
    let mut best: Option<(MetisPlan, f64)> = None;
    // Layer demand: the first file's type at tp1 bs1, normalised.
    let first_type =
        super::input::parse_profile_name(&m.profiles.constants.source).and_then(|(t, _, _)| m.profiles.type_index(&t)).unwrap_or(0);
    let Some(base) = m.profiles.get(first_type, 1, 1) else {
        return WalkOutcome { best: None, counters: c };
    };
    let total: f64 = base.layer_ms.iter().sum();
    let norm: Vec<f64> = base.layer_ms.iter().map(|x| x / total).collect();
    let divisors: Vec<u32> = (1..=gbs).rev().filter(|d| gbs.is_multiple_of(*d)).collect();
    for order in super::search::type_orders(&m.cluster.present()) {
        let layout = Layout::by_type_sequence(m.cluster, &order);
        for stages in 1..=(n as usize).min(layers) {
            for groups in device_groups(n, stages, variance) {
                let mut starts = vec![0];
                for g in &groups {
                    starts.push(starts.last().unwrap() + g);
                }
                for &batches in &divisors {
                    c.inter_stage_plans += 1;
                    let mut tables = HashMap::new();
                    let mut intra =
                        Intra { m, layout: &layout, tables: &mut tables, groups: &groups, starts: starts.clone(), batches, norm: &norm };
                    let mut strategies: Vec<(u32, u32)> = vec![];
                    let mut headroom: Option<Vec<f64>> = None;
                    let mut done = false;
                    while !done {
                        // One has_next() call.
                        let mut steps = 0;
                        let found = loop {
                            if strategies.is_empty() {
                                strategies = groups.iter().map(|&g| (g, 1)).collect();
                            } else {
                                let state: Vec<f64> =
                                    headroom.clone().unwrap_or_else(|| strategies.iter().map(|&(dp, _)| 1.0 / dp as f64).collect());
                                let mut order: Vec<usize> = (0..state.len()).collect();
                                order.sort_by(|&a, &b| state[a].total_cmp(&state[b]));
                                match order.iter().find(|&&s| strategies[s].0 != 1) {
                                    Some(&s) => {
                                        strategies[s] = (strategies[s].0 / 2, strategies[s].1 * 2);
                                        c.strategy_mutations += 1;
                                        steps += 1;
                                    }
                                    None => break None,
                                }
                            }
                            if !intra.valid(&strategies) {
                                continue;
                            }
                            let before = c.failed_memory_checks;
                            let r = intra.partition(&strategies, repair == Repair::MostOutOfMemory, &mut c);
                            steps += c.failed_memory_checks - before;
                            match r {
                                Ok(found) => break Some(found),
                                // Metis's code raises here: the group vector is abandoned.
                                Err(None) => break None,
                                Err(Some(first_failed)) => {
                                    headroom = match repair {
                                        Repair::Metis => None,
                                        Repair::MostOutOfMemory => Some(first_failed).filter(|h| !h.is_empty()),
                                    };
                                }
                            }
                        };
                        let Some((partition, attempts, state)) = found else { break };
                        c.count += steps;
                        headroom = Some(state);
                        c.plans_costed += 1;
                        if let Some(cost) = intra.cost(&strategies, &partition) {
                            if best.as_ref().is_none_or(|b| cost < b.1) {
                                best = Some((
                                    MetisPlan {
                                        node_sequence: order.iter().map(|&t| m.profiles.types[t].clone()).collect(),
                                        device_groups: groups.clone(),
                                        strategies: strategies.iter().map(|&(d, t)| [d, t]).collect(),
                                        batches,
                                        layer_partition: partition,
                                    },
                                    cost,
                                ));
                            }
                        }
                        done = attempts == 1;
                    }
                }
            }
        }
    }
    WalkOutcome { best, counters: c }
}
