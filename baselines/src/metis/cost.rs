//! Metis's cost model (`HeteroCostEstimator.get_cost` and the `LayerLoadBalancer` memory
//! check), reproduced term by term so a plan costs here what it costs in Metis's own code.
//! The formulas are in `solver/README.md` ("Metis's cost model"); the quirks it keeps by
//! default are switches in [`Quirks`]. A plan (`plan.rs`, the JSON form) is checked against
//! the inputs here (`MetisPlan::validate`) before it is priced. Calls `input`, `plan` and
//! `error`.

use serde::Serialize;

use super::input::{MetisCluster, MetisProfiles};
use super::plan::MetisPlan;
use crate::error::{BaselineError, Result};

const MIB: f64 = 1024.0 * 1024.0;

/// Where Metis's code departs from what it documents. `Quirks::default()` follows the code,
/// so costs match Metis's output; `Quirks::fixed()` is what we would ship.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Quirks {
    /// `get_inter_bandwidth` returns the intra-node bandwidth: every link is priced at the
    /// slowest involved type's intra-node bandwidth.
    pub inter_bandwidth_is_intra: bool,
    /// A data-parallel replica that spans GPU types is priced at its first GPU's speed
    /// (instead of its slowest GPU's).
    pub first_gpu_prices_replica: bool,
    /// Stage memory demand is read from the profiles of the cluster's first GPU type
    /// (instead of the stage's own types).
    pub memory_of_first_type: bool,
}

impl Default for Quirks {
    fn default() -> Self {
        Quirks { inter_bandwidth_is_intra: true, first_gpu_prices_replica: true, memory_of_first_type: true }
    }
}

impl Quirks {
    pub fn fixed() -> Self {
        Quirks { inter_bandwidth_is_intra: false, first_gpu_prices_replica: false, memory_of_first_type: false }
    }
}

/// Metis's command-line model settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MetisSettings {
    pub global_batch: u32,
    pub layers: usize,
    pub hidden: f64,
    pub seq: f64,
    pub vocab: f64,
}

/// Which GPU type holds each global rank: types take ranks one type after another in
/// `order` (Metis's node sequence, or any order of whole nodes in the union space).
#[derive(Debug, Clone, PartialEq)]
pub struct Layout {
    /// Type of each node, in rank order.
    pub node_types: Vec<usize>,
    pub gpus_per_node: u32,
}

impl Layout {
    pub fn by_type_sequence(cluster: &MetisCluster, order: &[usize]) -> Layout {
        let n = cluster.gpus_per_node;
        let node_types = order.iter().flat_map(|&t| std::iter::repeat_n(t, (cluster.types[t].gpus / n) as usize)).collect();
        Layout { node_types, gpus_per_node: n }
    }

    pub fn gpus(&self) -> u32 {
        self.node_types.len() as u32 * self.gpus_per_node
    }

    pub fn type_of(&self, rank: u32) -> usize {
        self.node_types[(rank / self.gpus_per_node) as usize]
    }
}

/// Everything about one stage placement (start rank, GPUs, dp, tp, micro-batches) that does
/// not depend on its layers, so a layer range is priced in O(replicas).
#[derive(Debug, Clone, PartialEq)]
pub struct StageTable {
    pub dp: u32,
    pub tp: u32,
    /// Samples per replica per micro-batch, as Metis computes it: gbs // dp // batches.
    pub mbs: u32,
    /// Prefix sums over layers of each distinct replica's per-micro-batch time.
    time_prefix: Vec<Vec<f64>>,
    /// Prefix sums of 5 x the memory profile of every batch piece, MiB.
    mem_prefix: Vec<f64>,
    pub capacity_mb: f64,
    /// ms per parameter byte of the gradient all-reduce.
    dp_coef: f64,
    /// M x slowest fb_sync over the stage's types (used when the stage is last).
    pub fb_sync_total: Result<f64>,
    pub update_per_layer: f64,
    pub homogeneous: bool,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CostTerms {
    /// (M - 1) x slowest stage + sum of stages.
    pub execution_ms: f64,
    pub fb_sync_ms: f64,
    pub pp_ms: f64,
    pub dp_ms: f64,
    pub update_ms: f64,
    pub batch_generator_ms: f64,
    pub stage_ms: Vec<f64>,
    pub stage_memory_mb: Vec<f64>,
    pub stage_capacity_mb: Vec<f64>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct MetisCost {
    pub cost_ms: f64,
    pub fits: bool,
    pub terms: CostTerms,
}

/// Metis's estimator over one set of inputs.
pub struct MetisModel<'a> {
    pub profiles: &'a MetisProfiles,
    pub cluster: &'a MetisCluster,
    pub settings: MetisSettings,
    pub quirks: Quirks,
}

fn missing(ty: &str, tp: u32, bs: u32) -> BaselineError {
    BaselineError::invalid(
        "plan",
        format!("no profile DeviceType.{ty}_tp{tp}_bs{bs}.json: Metis skips such a plan (KeyError); pick a measured (tp, batch)"),
    )
}

/// Metis's `DataLoadBalancer.partition_data`: split `bs` samples over replicas in
/// proportion to their speed, remainder to the largest fractional parts (stable order).
pub fn split_samples(speeds: &[f64], bs: u32) -> Vec<u32> {
    let total: f64 = speeds.iter().sum();
    let share: Vec<f64> = speeds.iter().map(|s| bs as f64 * (s / total)).collect();
    let mut h: Vec<u32> = share.iter().map(|x| x.trunc() as u32).collect();
    let rem = bs.saturating_sub(h.iter().sum());
    let mut order: Vec<usize> = (0..h.len()).collect();
    order.sort_by(|&a, &b| (share[b] - share[b].trunc()).total_cmp(&(share[a] - share[a].trunc())));
    for &i in order.iter().take(rem as usize) {
        h[i] += 1;
    }
    h
}

/// The powers of two that make up `h` (Metis runs a replica's batch as its binary digits).
pub fn binary_pieces(h: u32) -> impl Iterator<Item = u32> {
    (0..32).rev().map(|k| 1u32 << k).filter(move |b| h & b != 0)
}

impl<'a> MetisModel<'a> {
    fn type_name(&self, t: usize) -> &str {
        &self.profiles.types[t]
    }

    fn layer_prefix(&self, t: usize, tp: u32, bs: u32, pick: impl Fn(&super::input::DeviceProfile) -> &Vec<f64>) -> Result<Vec<f64>> {
        let p = self.profiles.get(t, tp, bs).ok_or_else(|| missing(self.type_name(t), tp, bs))?;
        let mut acc = vec![0.0];
        for x in pick(p) {
            acc.push(acc.last().unwrap() + x);
        }
        Ok(acc)
    }

    /// Replica types and sample counts of a stage whose ranks have `types`, Metis's way.
    fn replicas(&self, types: &[usize], dp: u32, tp: u32, bs: u32) -> Result<Vec<(usize, u32)>> {
        let group = types.len() / dp as usize;
        let reps: Vec<Vec<usize>> = (0..dp as usize).map(|i| types[i * group..(i + 1) * group].to_vec()).collect();
        let mut speeds = vec![];
        let mut rep_types = vec![];
        for r in &reps {
            // Metis prices a replica at its first GPU; the fix prices it at its slowest.
            let t = if self.quirks.first_gpu_prices_replica {
                r[0]
            } else {
                let mut best = (r[0], 0.0);
                for &t in r {
                    let total: f64 = self.profiles.get(t, tp, 1).ok_or_else(|| missing(self.type_name(t), tp, 1))?.layer_ms.iter().sum();
                    if total > best.1 {
                        best = (t, total);
                    }
                }
                best.0
            };
            let total: f64 = self.profiles.get(t, tp, 1).ok_or_else(|| missing(self.type_name(t), tp, 1))?.layer_ms.iter().sum();
            speeds.push(1.0 / total);
            rep_types.push(t);
        }
        Ok(rep_types.into_iter().zip(split_samples(&speeds, bs)).collect())
    }

    /// Slowest bandwidth (MiB/ms) of a group of ranks: intra-node if on one node.
    fn group_bandwidth(&self, layout: &Layout, ranks: impl Iterator<Item = u32>) -> f64 {
        let mut nodes: Vec<u32> = ranks.map(|r| r / layout.gpus_per_node).collect();
        nodes.sort_unstable();
        nodes.dedup();
        if nodes.len() == 1 {
            return self.cluster.types[layout.node_types[nodes[0] as usize]].intra_bw;
        }
        nodes
            .iter()
            .map(|&n| {
                let t = &self.cluster.types[layout.node_types[n as usize]];
                if self.quirks.inter_bandwidth_is_intra {
                    t.intra_bw_min
                } else {
                    t.inter_bw
                }
            })
            .fold(f64::INFINITY, f64::min)
    }

    /// Bandwidth of the pipeline hop between a stage at ranks [r0, r1) and the next ending at r2.
    pub fn pp_bandwidth(&self, layout: &Layout, r0: u32, r2: u32) -> f64 {
        self.group_bandwidth(layout, r0..r2)
    }

    /// Elements Metis sends from a stage ending at layer `end`.
    pub fn activation(&self, end: usize, mbs: u32, tp: u32) -> f64 {
        let s = &self.settings;
        if end == s.layers - 1 {
            mbs as f64 * s.seq * s.vocab / tp as f64
        } else {
            mbs as f64 * s.seq * s.hidden
        }
    }

    /// Parameter bytes per GPU of layers [a, b).
    pub fn stage_params(&self, tp: u32, a: usize, b: usize) -> f64 {
        let c = &self.profiles.constants;
        let t = tp as f64;
        let mut n = (b - a) as f64;
        let mut p = 0.0;
        if a == 0 {
            p += c.params_first / t;
            n -= 1.0;
        }
        if b == self.settings.layers {
            p += c.params_last / t;
            n -= 1.0;
        }
        p + c.params_layer / t * n
    }

    /// Build the stage table of ranks [r0, r0 + g) run as (dp, tp) with `batches` micro-batches.
    pub fn stage_table(&self, layout: &Layout, r0: u32, g: u32, dp: u32, tp: u32, batches: u32) -> Result<StageTable> {
        if dp == 0 || tp == 0 || dp * tp != g {
            return Err(BaselineError::invalid("plan.strategies", format!("dp x tp must equal the stage's {g} GPUs")));
        }
        let gbs = self.settings.global_batch;
        let mbs = gbs / dp / batches;
        let types: Vec<usize> = (r0..r0 + g).map(|r| layout.type_of(r)).collect();
        let homogeneous = types.iter().all(|&t| t == types[0]);
        let time_prefix = if homogeneous {
            vec![self.layer_prefix(types[0], tp, mbs, |p| &p.layer_ms)?]
        } else {
            let split = self.replicas(&types, dp, tp, gbs / batches)?;
            let mut pieces: Vec<(usize, u32)> = split.into_iter().filter(|r| r.1 > 0).collect();
            pieces.sort_unstable();
            pieces.dedup();
            let mut out = vec![];
            for (t, h) in pieces {
                let mut acc = vec![0.0; self.settings.layers + 1];
                for b in binary_pieces(h) {
                    for (i, x) in self.layer_prefix(t, tp, b, |p| &p.layer_ms)?.iter().enumerate() {
                        acc[i] += x;
                    }
                }
                out.push(acc);
            }
            out
        };
        // Memory demand: 5 x the profiled layer memory of every batch piece.
        let all: Vec<usize> = (0..layout.gpus()).map(|r| layout.type_of(r)).collect();
        let mem_type = |own: usize| if self.quirks.memory_of_first_type { all[0] } else { own };
        let mut mem_prefix = vec![0.0; self.settings.layers + 1];
        let mut add_mem = |t: usize, bs: u32| -> Result<()> {
            for (i, x) in self.layer_prefix(t, tp, bs, |p| &p.memory_mb)?.iter().enumerate() {
                mem_prefix[i] += 5.0 * x;
            }
            Ok(())
        };
        if homogeneous {
            add_mem(mem_type(types[0]), mbs)?;
        } else {
            // Metis splits the batch over the whole cluster's type list here, not the stage's.
            let basis = if self.quirks.memory_of_first_type { &all } else { &types };
            for (t, h) in self.replicas(basis, dp, tp, gbs / batches)? {
                // A replica without samples holds no activations (Metis's code takes log2 of 0 here).
                for b in binary_pieces(h) {
                    add_mem(mem_type(t), b)?;
                }
            }
        }
        let capacity_mb = types.iter().map(|&t| self.cluster.types[t].memory_gb * 1024.0).sum();
        let dp_coef = if dp > 1 {
            let bw = (0..dp).map(|j| self.group_bandwidth(layout, (0..tp).map(|k| r0 + k * dp + j))).fold(f64::INFINITY, f64::min);
            2.0 * (dp - 1) as f64 / (dp as f64 * bw * MIB)
        } else {
            0.0
        };
        let mut distinct = types.clone();
        distinct.sort_unstable();
        distinct.dedup();
        let fb_sync_total = distinct
            .iter()
            .map(|&t| match self.profiles.get(t, tp, mbs) {
                Some(p) if p.fb_sync_ms != 0.0 => Ok(p.fb_sync_ms),
                _ => Err(missing(self.type_name(t), tp, mbs)),
            })
            .try_fold(f64::NEG_INFINITY, |m, x| x.map(|x| m.max(x)))
            .map(|m| m * batches as f64);
        let update_per_layer = self.profiles.constants.optimizer_ms / tp as f64 / self.settings.layers as f64;
        Ok(StageTable { dp, tp, mbs, time_prefix, mem_prefix, capacity_mb, dp_coef, fb_sync_total, update_per_layer, homogeneous })
    }

    /// Price a whole plan (Metis's `get_cost`, and its memory verdict).
    pub fn evaluate(&self, plan: &MetisPlan) -> Result<MetisCost> {
        let (layout, batches) = plan.validate(self)?;
        let s = plan.device_groups.len();
        let mut starts = vec![0u32];
        for g in &plan.device_groups {
            starts.push(starts.last().unwrap() + g);
        }
        let mut terms = CostTerms {
            execution_ms: 0.0,
            fb_sync_ms: 0.0,
            pp_ms: 0.0,
            dp_ms: 0.0,
            update_ms: 0.0,
            batch_generator_ms: self.profiles.constants.batch_generator_ms * batches as f64,
            stage_ms: vec![],
            stage_memory_mb: vec![],
            stage_capacity_mb: vec![],
        };
        for i in 0..s {
            let [dp, tp] = plan.strategies[i];
            let (a, b) = (plan.layer_partition[i], plan.layer_partition[i + 1]);
            let t = self.stage_table(&layout, starts[i], plan.device_groups[i], dp, tp, batches)?;
            terms.stage_ms.push(t.time(a, b));
            terms.stage_memory_mb.push(t.memory(a, b));
            terms.stage_capacity_mb.push(t.capacity_mb);
            if i == s - 1 {
                terms.fb_sync_ms = t.fb_sync_total.clone()?;
            } else {
                let bw = self.pp_bandwidth(&layout, starts[i], starts[i + 2]);
                terms.pp_ms += self.activation(b, t.mbs, tp) / (bw * MIB);
            }
            terms.dp_ms = terms.dp_ms.max(t.dp_cost(self.stage_params(tp, a, b)));
            terms.update_ms = terms.update_ms.max(t.update_per_layer * (b - a) as f64);
        }
        let max_t = terms.stage_ms.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        terms.execution_ms = (batches - 1) as f64 * max_t + terms.stage_ms.iter().sum::<f64>();
        let cost_ms = terms.execution_ms + terms.fb_sync_ms + terms.update_ms + terms.dp_ms + terms.pp_ms + terms.batch_generator_ms;
        let fits = terms.stage_memory_mb.iter().zip(&terms.stage_capacity_mb).all(|(m, c)| c - m >= 0.0);
        Ok(MetisCost { cost_ms, fits, terms })
    }
}

impl MetisPlan {
    /// Check the plan against the inputs; return its rank layout and micro-batch count.
    pub fn validate(&self, m: &MetisModel) -> Result<(Layout, u32)> {
        let bad = |f: &str, why: String| Err(BaselineError::invalid(format!("plan.{f}"), why));
        let mut order = vec![];
        for (i, name) in self.node_sequence.iter().enumerate() {
            match m.profiles.type_index(&name.to_ascii_uppercase()) {
                Some(t) if m.cluster.types[t].gpus > 0 && !order.contains(&t) => order.push(t),
                _ => return bad(&format!("node_sequence[{i}]"), format!("{name} is not a GPU type of the cluster, or is repeated")),
            }
        }
        if order.len() != m.cluster.present().len() {
            return bad(
                "node_sequence",
                format!(
                    "must list every GPU type of the cluster once: {:?}",
                    m.cluster.present().iter().map(|&t| &m.profiles.types[t]).collect::<Vec<_>>()
                ),
            );
        }
        let s = self.device_groups.len();
        if s == 0 || self.strategies.len() != s || self.layer_partition.len() != s + 1 {
            return bad("device_groups", "needs one group per stage, one [dp, tp] per stage and stages + 1 layer boundaries".into());
        }
        let total: u32 = self.device_groups.iter().sum();
        if total != m.cluster.total_gpus() {
            return bad("device_groups", format!("sum to {total} GPUs but the cluster has {}", m.cluster.total_gpus()));
        }
        for (i, (g, [dp, tp])) in self.device_groups.iter().zip(&self.strategies).enumerate() {
            if dp * tp != *g || *dp == 0 {
                return bad(&format!("strategies[{i}]"), format!("dp x tp = {dp} x {tp} must equal the stage's {g} GPUs"));
            }
        }
        let l = m.settings.layers;
        let p = &self.layer_partition;
        if p[0] != 0 || p[s] != l || p.windows(2).any(|w| w[1] <= w[0]) {
            return bad("layer_partition", format!("must rise strictly from 0 to the model's {l} layers"));
        }
        let gbs = m.settings.global_batch;
        if self.batches == 0 || !gbs.is_multiple_of(self.batches) {
            return bad("batches", format!("must divide the global batch {gbs}"));
        }
        for (i, [dp, _]) in self.strategies.iter().enumerate() {
            if gbs / dp / self.batches == 0 {
                return bad(&format!("strategies[{i}]"), format!("dp {dp} x {} micro-batches exceeds the global batch", self.batches));
            }
        }
        Ok((Layout::by_type_sequence(m.cluster, &order), self.batches))
    }
}

impl StageTable {
    /// Per-micro-batch time of layers [a, b): the slowest replica.
    pub fn time(&self, a: usize, b: usize) -> f64 {
        self.time_prefix.iter().map(|p| p[b] - p[a]).fold(f64::NEG_INFINITY, f64::max)
    }

    /// A lower bound on `time` that is a sum over layers: the fastest replica per layer.
    pub fn layer_floor(&self, l: usize) -> f64 {
        self.time_prefix.iter().map(|p| p[l + 1] - p[l]).fold(f64::INFINITY, f64::min)
    }

    pub fn memory(&self, a: usize, b: usize) -> f64 {
        0.001 + (self.mem_prefix[b] - self.mem_prefix[a])
    }

    pub fn fits(&self, a: usize, b: usize) -> bool {
        self.capacity_mb - self.memory(a, b) >= 0.0
    }

    pub fn dp_cost(&self, params: f64) -> f64 {
        self.dp_coef * params
    }
}
