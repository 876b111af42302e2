//! Motley's cost model: one training iteration of a plan, and the memory of every GPU.
//! The formulas are stated in `solver/README.md`; this file implements them.

use crate::calibration::Calibration;
use crate::error::{Result, SolverError};
use crate::hardware::{Cluster, GpuType, Precision};
use crate::limits::{self, MAX_GLOBAL_BATCH, MAX_MICRO_BATCH, MAX_STAGES};
use crate::model::Model;
use crate::profile::ProfileSet;

pub mod activations;
pub mod contention;

const GIB: f64 = 1024.0 * 1024.0 * 1024.0;
/// The host's launch time of one layer's forward per micro-batch, the roofline's default: on an
/// H200 each micro-batch of a compiled 8-layer llama cost 16-20 ms that did not shrink with its
/// size (1 x 32 sequences 0.035 s a step, 4 x 8 0.061-0.101 s, 32 x 1 0.59-0.73 s; BENCHMARKS.md,
/// "What each micro-batch costs on a GPU"): about 2.1 ms a layer, 0.7 forward and 1.4 backward.
pub const HOST_LAYER_MS: f64 = 0.7;

/// Planner knobs that are not part of the cluster or the model.
#[derive(Debug, Clone, PartialEq)]
pub struct PlanOptions {
    /// Sequences per iteration.
    pub global_batch: u32,
    /// Sequences per micro-batch of a pipeline; None lets the planner choose.
    pub micro_batch: Option<u32>,
    /// Fraction of peak tensor FLOPS a transformer layer reaches (roofline estimate).
    pub efficiency: f64,
    /// Milliseconds the host takes to launch one layer's forward for one micro-batch (its
    /// backward twice that): the roofline's floor on a layer's pass, however little work the
    /// micro-batch holds (BENCHMARKS.md, "What each micro-batch costs on a GPU"). 0: no floor.
    pub host_layer_ms: f64,
    /// Full activation recomputation.
    pub recompute: bool,
    /// Price the eager runtime's saved activations (`--compile off`, CPU runs) instead of
    /// compiled blocks' (`--compile auto` on a GPU): activations.rs.
    pub eager: bool,
    /// Shard optimizer states over a stage's data-parallel GPUs (ZeRO-1).
    pub zero1: bool,
    /// Memory kept free on every GPU for the CUDA context, NCCL buffers and fragmentation.
    pub reserve_gib: f64,
    /// Longest pipeline the search considers (0 = automatic).
    pub max_stages: u32,
    /// Restrict the search to one tensor-parallel degree.
    pub tp: Option<u32>,
    /// Pipeline sends and receives block the stage (Megatron-LM's non-interleaved 1F1B, which
    /// Holmes runs on): every micro-batch pays its stage's hops on top of its compute. Off, a
    /// hop overlaps compute and only the slowest stage or hop sets the pace.
    pub p2p_blocking: bool,
    /// The data type the run computes in: which of a GPU's peaks its layers reach.
    pub precision: Precision,
    /// Measured per-GPU-type efficiency, overriding `efficiency` where an entry exists.
    pub calibration: Calibration,
}

impl Default for PlanOptions {
    fn default() -> Self {
        PlanOptions {
            global_batch: 256,
            micro_batch: None,
            efficiency: 0.5,
            host_layer_ms: HOST_LAYER_MS,
            recompute: false,
            eager: false,
            zero1: false,
            reserve_gib: 1.5,
            max_stages: 0,
            tp: None,
            p2p_blocking: false,
            precision: Precision::Fp16,
            calibration: Calibration::default(),
        }
    }
}

impl PlanOptions {
    /// The sizes that drive the planner's work within `limits` (the coordinator's job files
    /// and the CLI's flags both come through here), named as a job file names them.
    pub fn validate(&self) -> Result<()> {
        if self.global_batch == 0 {
            return Err(SolverError::invalid("global_batch", "must be at least 1"));
        }
        limits::at_most("global_batch", self.global_batch as u64, MAX_GLOBAL_BATCH as u64, "sequences an iteration may have")?;
        if let Some(b) = self.micro_batch {
            if b == 0 {
                return Err(SolverError::invalid("micro_batch", "must be at least 1"));
            }
            limits::at_most("micro_batch", b as u64, MAX_MICRO_BATCH as u64, "sequences a micro-batch may have")?;
        }
        if self.tp.is_some_and(|t| t == 0 || !t.is_power_of_two()) {
            return Err(SolverError::invalid("tp", "must be a power of two (1, 2, 4, 8)"));
        }
        if !(self.efficiency > 0.0 && self.efficiency <= 1.0) {
            return Err(SolverError::invalid("efficiency", "must be in (0, 1]"));
        }
        if !(self.host_layer_ms >= 0.0 && self.host_layer_ms <= 1000.0) {
            return Err(SolverError::invalid("host_layer_ms", "must be a number of milliseconds in [0, 1000] (0: no floor)"));
        }
        if !(self.reserve_gib >= 0.0 && self.reserve_gib.is_finite()) {
            return Err(SolverError::invalid("reserve_gib", "must be a non-negative number of GiB"));
        }
        limits::at_most("max_stages", self.max_stages as u64, MAX_STAGES as u64, "pipeline stages the search may consider")?;
        self.calibration.validate(None)?;
        Ok(())
    }

    /// FLOP/s a transformer layer of `gpu` reaches forward and backward: the peak at the
    /// run's precision times the calibrated efficiency of the type, else `efficiency`.
    /// Bytes of one activation or gradient element on the wire: 4 in fp32, else 2 (mixed
    /// precision keeps fp16/bf16 copies for communication).
    pub fn wire_bytes(&self) -> f64 {
        match self.precision {
            Precision::Fp32 => 4.0,
            Precision::Fp16 | Precision::Bf16 => 2.0,
        }
    }

    /// Bytes of weights, gradients and optimizer state per parameter on one GPU, as the rank
    /// runtime holds them (`python/motley_torch/distributed/zero.py`). Without ZeRO-1: fp32 weights, fp32
    /// gradients and AdamW's two fp32 moments, 16, plus in bf16/fp16 the half copy autocast
    /// makes of each weight and keeps for the step (`schedule.Pipeline.step`), 18 (as
    /// Megatron-LM's mixed precision without a distributed optimizer). With it: the weights in
    /// the compute type, the fp32 gradient buffers the reduction fills, and the fp32 master
    /// (its own copy only in half precision) and moments divided over the `dp` GPUs holding
    /// the layer: 6 + 12/dp in bf16/fp16 (Megatron-LM's distributed optimizer with fp32
    /// gradients), 8 + 8/dp in fp32.
    pub fn state_bytes_per_param(&self, dp: u32) -> f64 {
        let dp = dp.max(1) as f64;
        match (self.zero1, self.precision) {
            (false, Precision::Fp32) => 16.0,
            (false, Precision::Fp16 | Precision::Bf16) => 18.0,
            (true, Precision::Fp32) => 8.0 + 8.0 / dp,
            (true, Precision::Fp16 | Precision::Bf16) => 6.0 + 12.0 / dp,
        }
    }

    pub fn layer_flops(&self, gpu: &GpuType) -> (f64, f64) {
        let peak = gpu.peak_tflops(self.precision).unwrap_or(gpu.tflops) * 1e12;
        match self.calibration.lookup(&gpu.name, self.precision) {
            Some(c) => (peak * c.efficiency, peak * c.backward_efficiency.unwrap_or(c.efficiency)),
            None => (peak * self.efficiency, peak * self.efficiency),
        }
    }
}

/// A stage as the cost model sees it: where it runs and how it splits its work.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StageKind {
    pub class: usize,
    pub tp: u32,
    pub dp: u32,
}

/// Per-layer numbers of one stage kind at one micro-batch size.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LayerCost {
    /// Seconds per layer per micro-batch, TP all-reduces included.
    pub fwd: f64,
    pub bwd: f64,
    /// Forward and backward seconds of 1, 2, 4 and 8 consecutive layers when a profile measured
    /// them (AutoHet eq. 5: a stage's layers cost the blocks of their count's binary digits).
    pub blocks: Option<[(f64, f64); 4]>,
    /// Extra (forward, backward) seconds when the stage holds the embedding / the output head,
    /// as measured where the profile has them: the runtime's head computes the loss's gradient
    /// inside its forward pass (models/head_loss.py), so its measured forward holds most of its
    /// time, and a 1F1B schedule's critical path depends on which pass carries it.
    pub embed: (f64, f64),
    pub head: (f64, f64),
    /// Bytes per GPU: weights+grads+optimizer of one layer, activations of one layer per
    /// in-flight micro-batch, and the extras of the first / last stage.
    pub layer_state: f64,
    pub layer_act: f64,
    pub embed_state: f64,
    pub head_state: f64,
    pub head_act: f64,
    pub capacity: f64,
    /// Parameters of one layer per GPU (for the optimizer step).
    pub layer_params_gpu: f64,
    /// Seconds of the optimizer step of one layer's parameters on one GPU, when a profile
    /// measured it (`optimizer_ms`, without ZeRO-1).
    pub optimizer_layer: Option<f64>,
    /// Parameters per GPU of the first stage's embedding, the last stage's norm and head, and
    /// the matrix they share when tied (held once by a stage that is both).
    pub embed_params_gpu: f64,
    pub head_params_gpu: f64,
    pub tied_params_gpu: f64,
    /// Bytes per GPU of the tied matrix's state (0 when untied).
    pub tied_state: f64,
    pub mem_bw: f64,
}

impl LayerCost {
    /// Parameters per GPU a stage holds besides its layers (`Model::ends_params` split by tp).
    pub fn ends_params_gpu(&self, first: bool, last: bool) -> f64 {
        let mut p = 0.0;
        if first {
            p += self.embed_params_gpu;
        }
        if last {
            p += self.head_params_gpu;
        }
        if first && last {
            p -= self.tied_params_gpu;
        }
        p
    }
}

/// What the iteration time of a replica depends on outside the replica itself: how many
/// replicas share each gradient ring, and which links those rings cross.
#[derive(Debug, Clone, PartialEq)]
pub struct SyncContext {
    pub replicas: u32,
    pub rings: Rings,
}

/// Which links the gradient rings of a plan cross.
#[derive(Debug, Clone, PartialEq)]
pub enum Rings {
    /// A uniform plan (every replica the same stages with the same layers): the ring of a
    /// layer holds the stage holding it in every replica, so it stays inside that stage's node
    /// class and crosses only that class's links (Holmes: one NIC kind per DP group, whatever
    /// the pipeline crosses). `gpus[c]` counts the plan's GPUs of class c: a ring stays inside
    /// one node when they fit in one.
    PerStage { gpus: Vec<u32> },
    /// Replicas differ: a layer's ring may join any classes the plan uses, so every ring is
    /// priced on the slowest link between them (GB/s) — over Ethernet when they mix IB and RoCE.
    Shared { bw: f64, intra: bool },
}

pub struct CostModel<'a> {
    pub cluster: &'a Cluster,
    pub model: &'a Model,
    pub profiles: &'a ProfileSet,
    pub opts: &'a PlanOptions,
}

/// The time terms of one replica under a layer split.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ReplicaTime {
    /// One micro-batch through the whole pipeline (stage times plus p2p hops).
    pub latency: f64,
    /// The 1F1B steady-state period (`CostModel::period`).
    pub period: f64,
    /// Gradient sync not hidden behind earlier stages' backward passes (Espresso eq. 9).
    pub exposed_sync: f64,
    pub optimizer: f64,
}

impl ReplicaTime {
    pub fn total(&self, micro_batches: u32) -> f64 {
        self.latency + (micro_batches.saturating_sub(1)) as f64 * self.period + self.exposed_sync + self.optimizer
    }
}

impl<'a> CostModel<'a> {
    pub fn layer_cost(&self, k: StageKind, micro_batch: u32) -> LayerCost {
        let class = &self.cluster.classes[k.class];
        let gpu = &class.gpu;
        let t = k.tp as f64;
        let m = micro_batch as f64 / k.dp as f64; // sequences per GPU
        let s = self.model.seq_len as f64;
        let h = self.model.hidden();
        let (peak, peak_bwd) = self.opts.layer_flops(gpu);
        let mem_bw = gpu.mem_bw_gbps * 1e9;
        // A TP group inside a node all-reduces over NVLink/PCIe; one spanning nodes (only
        // plans from other planners have them, see metis/motley_view.rs) over the NIC.
        let tp_bw = if k.tp > class.gpus_per_node { self.cluster.inter_bw(k.class, k.class) } else { self.cluster.intra_bw(k.class) } * 1e9;
        // Two all-reduces of the layer's activations forward, two backward (Megatron TP).
        let tp_allreduce = if k.tp > 1 { 2.0 * (t - 1.0) / t * m * s * h * self.opts.wire_bytes() / tp_bw } else { 0.0 };
        let (profiled, scale) = match self.profiles.lookup_scaled(&gpu.name, k.tp, m) {
            Some((p, scale)) => (Some(p), scale),
            None => (None, 1.0),
        };
        let (fwd, bwd) = match profiled {
            Some(p) => (scale * p.fwd_ms / 1e3, scale * p.bwd_ms / 1e3),
            None => {
                let compute = m * self.model.layer_fwd_flops / t / peak;
                let compute_bwd = m * self.model.layer_fwd_flops / t / peak_bwd;
                let bytes = 2.0 * self.model.layer_params / t + 34.0 * m * s * h / t;
                // A pass is its GPU work or its launches on the host, whichever is longer.
                let host = self.opts.host_layer_ms / 1e3;
                let fwd = compute.max(bytes / mem_bw).max(host) + 2.0 * tp_allreduce;
                (fwd, 2.0 * compute_bwd.max(bytes / mem_bw).max(host) + 2.0 * tp_allreduce)
            }
        };
        let bwd = if self.opts.recompute { bwd + fwd } else { bwd };
        let recompute = self.opts.recompute;
        let blocks = profiled
            .filter(|p| !p.blocks.is_empty())
            .map(|p| p.block_ms().map(|(f, b)| (scale * f / 1e3, scale * if recompute { (b + f) / 1e3 } else { b / 1e3 })));
        let head_fwd = m * self.model.head_fwd_flops / t / peak;
        let embed_bytes = m * s * h * 2.0;
        let opt_bytes_per_param = self.opts.state_bytes_per_param(k.dp);
        let layer_params_gpu = self.model.layer_params / t;
        // The rank runtime replicates the embedding and the head over the TP group (no
        // vocabulary-parallel split): every TP rank holds them whole.
        let embed_params_gpu = self.model.embed_params;
        let head_params_gpu = self.model.head_params;
        let tied_params_gpu = self.model.tied_params;
        let (precision, zero1) = (self.opts.precision, self.opts.zero1);
        let layer_act = match profiled.and_then(|p| p.act_mib) {
            Some(mib) => scale * mib * 1024.0 * 1024.0,
            None if self.opts.recompute => 2.0 * s * m * h,
            // What the runtime saves per token (activations.rs, counted on it); the half
            // copies of the weights are one per step, in the state bytes.
            None => s * m * activations::layer_token_bytes(self.model, precision, zero1, s, !self.opts.eager).per_gpu(t),
        };
        // Measured extras where the profile has them, each pass as measured; else the roofline's
        // forward and twice that backward.
        let measured = |f: Option<f64>, b: Option<f64>| Some((scale * f? / 1e3, scale * b? / 1e3));
        let embed_bytes_s = embed_bytes / mem_bw;
        let embed = profiled.and_then(|p| measured(p.embed_fwd_ms, p.embed_bwd_ms)).unwrap_or((embed_bytes_s, 2.0 * embed_bytes_s));
        let head = profiled.and_then(|p| measured(p.head_fwd_ms, p.head_bwd_ms)).unwrap_or((head_fwd, 2.0 * head_fwd));
        LayerCost {
            fwd,
            bwd,
            blocks,
            embed,
            head,
            layer_state: layer_params_gpu * opt_bytes_per_param,
            layer_act,
            embed_state: embed_params_gpu * opt_bytes_per_param,
            head_state: head_params_gpu * opt_bytes_per_param,
            tied_state: tied_params_gpu * opt_bytes_per_param,
            // The loss's peak over the micro-batch, whole on every TP rank (the head is
            // replicated).
            head_act: activations::head_bytes(self.model, precision, zero1, s * m),
            capacity: (gpu.memory_gib - self.opts.reserve_gib) * GIB,
            layer_params_gpu,
            embed_params_gpu,
            head_params_gpu,
            tied_params_gpu,
            optimizer_layer: profiled.and_then(|p| p.optimizer_ms).map(|ms| ms / 1e3),
            mem_bw,
        }
    }

    /// Bytes one GPU of a stage needs, holding `n` layers with `inflight` micro-batches.
    pub fn stage_memory(c: &LayerCost, n: u32, first: bool, last: bool, inflight: u32, recompute: bool) -> f64 {
        let n = n as f64;
        let mut bytes = n * c.layer_state;
        let live_act = if recompute {
            // Checkpointed inputs of every in-flight micro-batch, plus one layer recomputed.
            n * c.layer_act * inflight as f64 + c.layer_act * 17.0
        } else {
            n * c.layer_act * inflight as f64
        };
        bytes += live_act;
        if first {
            bytes += c.embed_state;
        }
        if last {
            bytes += c.head_state + c.head_act;
        }
        if first && last {
            bytes -= c.tied_state;
        }
        bytes
    }

    /// Seconds of one micro-batch through `n` layers of a stage, forward and backward.
    pub fn stage_time(c: &LayerCost, n: u32, first: bool, last: bool) -> (f64, f64) {
        let (mut f, mut b) = match &c.blocks {
            Some(blocks) => (crate::profile::layers_time(&blocks.map(|x| x.0), n), crate::profile::layers_time(&blocks.map(|x| x.1), n)),
            None => (n as f64 * c.fwd, n as f64 * c.bwd),
        };
        if first {
            f += c.embed.0;
            b += c.embed.1;
        }
        if last {
            f += c.head.0;
            b += c.head.1;
        }
        (f, b)
    }

    /// Seconds of every pipeline hop of a replica whose stages are `kinds`: one micro-batch's
    /// activations forward and their gradients back. Consecutive stages of one class (a run)
    /// are packed into nodes in order: a run that fits in a node shares it, a longer one fills
    /// node after node, a stage never straddles two nodes unless it is larger than one. A hop
    /// stays on NVLink/PCIe only between two stages packed into the same node; otherwise it
    /// crosses the best link between the two classes. `placement.rs` lays GPUs out the same way.
    pub fn hop_times(&self, kinds: &[StageKind], micro_batch: u32) -> Vec<f64> {
        let bytes = micro_batch as f64 * self.model.seq_len as f64 * self.model.hidden() * self.opts.wire_bytes();
        let same = same_node_hops(self.cluster, kinds);
        // Cross-node hops that share a node's NIC divide it (docs/network.md, "Contention in
        // the cost model"; the dynamic-network paper's eq. 7).
        let shares = contention::hop_shares(&contention::node_groups(self.cluster, kinds), &same);
        same.iter()
            .enumerate()
            .map(|(i, &same)| {
                let (a, b) = (kinds[i].class, kinds[i + 1].class);
                let bw = if same { self.cluster.intra_bw(a) } else { self.cluster.inter_bw(a, b) };
                2.0 * bytes / (bw * 1e9) * shares[i]
            })
            .collect()
    }

    /// Seconds of the gradient all-reduce of `params` parameters held by a stage of kind `k`,
    /// its ring alone on the links it crosses (`sync_coefficients` adds the rings it shares
    /// NICs with).
    pub fn sync_time(&self, ctx: &SyncContext, k: StageKind, params: f64) -> f64 {
        let n = self.ring_members(ctx, k) as f64;
        if n <= 1.0 {
            return 0.0;
        }
        // Gradients in the wire type, whole layer: tp shard rings run side by side.
        let grad_bytes = self.opts.wire_bytes() * params;
        let (bw, shards_share_link) = self.ring_link(ctx, k);
        let bytes_on_link = if shards_share_link { grad_bytes } else { grad_bytes / k.tp as f64 };
        2.0 * (n - 1.0) / n * bytes_on_link / (bw * 1e9)
    }

    /// GB/s of the slowest link the gradient ring of a stage of kind `k` crosses, and whether
    /// that link is a NIC the stage's TP shards share (false inside a node).
    pub fn ring_link(&self, ctx: &SyncContext, k: StageKind) -> (f64, bool) {
        match &ctx.rings {
            Rings::PerStage { gpus } => {
                let gpn = self.cluster.classes[k.class].gpus_per_node;
                if (ctx.replicas == 1 && k.dp * k.tp <= gpn) || gpus[k.class] <= gpn {
                    (self.cluster.intra_bw(k.class), false)
                } else {
                    (self.cluster.inter_bw(k.class, k.class), true)
                }
            }
            Rings::Shared { bw, intra } => (*bw, !intra),
        }
    }
    /// Seconds of the optimizer step of a stage of kind `k` holding `layers` layers (and the
    /// embedding or head when `first` or `last`). The search's shapes and the evaluation of a
    /// whole plan both price the step here, so the plan the search keeps is priced as reported.
    pub fn optimizer_time(&self, c: &LayerCost, k: StageKind, layers: u32, first: bool, last: bool) -> f64 {
        // Adam reads and writes ~28 bytes per parameter (fp32 master, m, v; fp16 w, g);
        // ZeRO-1 steps 1/dp of the states. A profile's measured step per layer replaces the
        // estimate (scaled the same way under ZeRO-1), for the embedding and head too: the
        // step is elementwise, so the device's measured seconds per parameter price every
        // parameter it steps, where the catalog's peak memory bandwidth is never reached (and
        // says nothing of an emulated device).
        let per_param = if self.opts.zero1 { 4.0 + 24.0 / k.dp as f64 } else { 28.0 };
        let stage_params_gpu = layers as f64 * c.layer_params_gpu + c.ends_params_gpu(first, last);
        match c.optimizer_layer {
            Some(o) if c.layer_params_gpu > 0.0 => stage_params_gpu * o / c.layer_params_gpu * per_param / 28.0,
            _ => stage_params_gpu * per_param / c.mem_bw,
        }
    }

    /// Time terms of a replica with stage kinds `kinds`, `layers[i]` layers on stage i.
    pub fn replica_time(
        &self,
        ctx: &SyncContext,
        kinds: &[StageKind],
        costs: &[LayerCost],
        layers: &[u32],
        micro_batch: u32,
    ) -> ReplicaTime {
        let p = kinds.len();
        let mut latency = 0.0;
        let mut pre_bwd = 0.0;
        let mut busy = Vec::with_capacity(p);
        let mut exposed: f64 = 0.0;
        let mut optimizer: f64 = 0.0;
        let hops = self.hop_times(kinds, micro_batch);
        // Rings of stages that share a node's NIC in the sync phase divide it (eq. 7).
        let ring_shares = self.ring_contention(ctx, kinds);
        for i in 0..p {
            let (first, last) = (i == 0, i + 1 == p);
            let (f, b) = Self::stage_time(&costs[i], layers[i], first, last);
            latency += f + b;
            busy.push(f + b);
            if i + 1 < p {
                latency += hops[i];
            }
            let params = layers[i] as f64 * self.model.layer_params + self.model.ends_params(first, last);
            exposed = exposed.max(self.sync_time(ctx, kinds[i], params) * ring_shares[i] - pre_bwd);
            pre_bwd += b;
            optimizer = optimizer.max(self.optimizer_time(&costs[i], kinds[i], layers[i], first, last));
        }
        ReplicaTime { latency, period: self.period(&busy, &hops), exposed_sync: exposed.max(0.0), optimizer }
    }

    /// The 1F1B steady-state period of a pipeline whose stages compute `busy[i]` seconds per
    /// micro-batch (forward and backward) with hops of `hops[i]` seconds between stage i and
    /// i+1 (`pipeline_period`).
    pub fn period(&self, busy: &[f64], hops: &[f64]) -> f64 {
        pipeline_period(busy, hops, self.opts.p2p_blocking)
    }

    /// Peak bytes per GPU of every stage; `max_inflight` caps the micro-batches in flight.
    pub fn replica_memory(&self, costs: &[LayerCost], layers: &[u32], max_inflight: u32) -> Vec<f64> {
        let p = costs.len();
        (0..p)
            .map(|i| {
                let inflight = ((p - i) as u32).min(max_inflight.max(1));
                Self::stage_memory(&costs[i], layers[i], i == 0, i + 1 == p, inflight, self.opts.recompute)
            })
            .collect()
    }

    /// The sync context of a plan that uses `gpus[c]` GPUs of class c in `replicas` replicas;
    /// `uniform` when every replica has the same stages and layers.
    pub fn sync_context(&self, replicas: u32, gpus: &[u32], uniform: bool) -> SyncContext {
        if uniform {
            return SyncContext { replicas, rings: Rings::PerStage { gpus: gpus.to_vec() } };
        }
        let used: Vec<usize> = (0..gpus.len()).filter(|&c| gpus[c] > 0).collect();
        if used.len() == 1 && gpus[used[0]] <= self.cluster.classes[used[0]].gpus_per_node {
            return SyncContext { replicas, rings: Rings::Shared { bw: self.cluster.intra_bw(used[0]), intra: true } };
        }
        let multi: Vec<bool> = used.iter().map(|&c| gpus[c] > self.cluster.classes[c].gpus_per_node).collect();
        let (_, bw) = self.cluster.common_link(&used, &multi);
        SyncContext { replicas, rings: Rings::Shared { bw, intra: false } }
    }
}

/// The 1F1B steady-state period of a pipeline whose stages compute `busy[i]` seconds per
/// micro-batch (forward and backward) with hops of `hops[i]` seconds between stage i and i+1
/// (both directions: half forward, half back).
///
/// With blocking sends (`PlanOptions::p2p_blocking`), the slowest stage with the hops on both
/// its sides. With sends that overlap compute, the slowest stage, the slowest hop (its link
/// carries a micro-batch each way per period), and every window of stages `s..=t` together
/// with the hops between them over its length `t - s + 1`: in 1F1B stage `s` starts a new
/// micro-batch only when the backward of the one `t - s + 1` micro-batches earlier has come back
/// from stage `t`, so each round trip through the window (every stage's forward and backward
/// once, every hop both ways) is shared by `t - s + 1` micro-batches. When the stages of a window
/// have less slack than its hops take, the round trip is not hidden and sets the pace: the
/// longest such cycle of the 1F1B schedule, which the timeline drawn from the plan
/// (`motley_contract::timeline::one_f_one_b`) reaches once its warm-up is over (solver/README.md,
/// "The cost model"). The formula lives beside the drawing, so the two cannot drift.
pub use motley_contract::timeline::pipeline_period;

/// For each hop of a replica with stages `kinds`: whether both stages are packed into one node
/// (see `CostModel::hop_times`).
pub fn same_node_hops(cluster: &Cluster, kinds: &[StageKind]) -> Vec<bool> {
    let node = contention::node_groups(cluster, kinds);
    (0..kinds.len().saturating_sub(1))
        .map(|i| {
            let (a, b) = (kinds[i], kinds[i + 1]);
            let gpn = cluster.classes[a.class].gpus_per_node;
            a.class == b.class && node[i] == node[i + 1] && a.dp * a.tp <= gpn && b.dp * b.tp <= gpn
        })
        .collect()
}

#[cfg(test)]
mod wire_and_optimizer_tests {
    use super::*;
    use crate::hardware::ClusterSpec;
    use crate::profile::LayerProfile;

    fn cluster() -> Cluster {
        let text = "name: t\nnodes:\n  - {name: n, count: 2, gpu: A100-80G, gpus: 1, nics: [{name: eth0, kind: ethernet, gbps: 25}]}\n";
        Cluster::from_spec(&serde_norway::from_str::<ClusterSpec>(text).unwrap()).unwrap()
    }

    #[test]
    fn fp32_moves_four_bytes_an_element_and_mixed_precision_two() {
        let (c, model) = (cluster(), Model::new(crate::model::model_by_name("gpt3-1.3b").unwrap(), None).unwrap());
        let profiles = ProfileSet::default();
        let kinds = [StageKind { class: 0, tp: 1, dp: 1 }, StageKind { class: 0, tp: 1, dp: 1 }];
        let hop = |precision| {
            let opts = PlanOptions { precision, ..PlanOptions::default() };
            CostModel { cluster: &c, model: &model, profiles: &profiles, opts: &opts }.hop_times(&kinds, 2)[0]
        };
        assert_eq!(hop(Precision::Fp16), hop(Precision::Bf16));
        assert!((hop(Precision::Fp32) / hop(Precision::Fp16) - 2.0).abs() < 1e-12);
    }

    #[test]
    fn a_tied_head_is_held_once_by_a_stage_with_both_ends_and_on_each_end_of_a_pipeline() {
        let c = cluster();
        let spec = crate::model::model_by_name("llama3-8b").unwrap();
        let untied = Model::new(spec.clone(), None).unwrap();
        let tied = Model::new(crate::ModelSpec { tie_embeddings: true, ..spec }, None).unwrap();
        let (profiles, opts) = (ProfileSet::default(), PlanOptions::default());
        let cost = |model: &Model| {
            CostModel { cluster: &c, model, profiles: &profiles, opts: &opts }.layer_cost(StageKind { class: 0, tp: 1, dp: 1 }, 1)
        };
        let (u, t) = (cost(&untied), cost(&tied));
        let matrix = 128256.0 * 4096.0;
        assert_eq!(u.ends_params_gpu(true, true) - t.ends_params_gpu(true, true), matrix);
        let mem = |lc: &LayerCost, first, last| CostModel::stage_memory(lc, 2, first, last, 1, false);
        assert_eq!(mem(&u, true, true) - mem(&t, true, true), matrix * opts.state_bytes_per_param(1), "one stage: the matrix once");
        assert_eq!(mem(&u, true, false), mem(&t, true, false), "first of a pipeline: a copy");
        assert_eq!(mem(&u, false, true), mem(&t, false, true), "last of a pipeline: a copy");
        assert_eq!(u.head_params_gpu, 4096.0 + matrix, "the final RMSNorm and the head");
    }

    #[test]
    fn a_measured_optimizer_step_replaces_the_estimate() {
        let (c, model) = (cluster(), Model::new(crate::model::model_by_name("gpt3-1.3b").unwrap(), None).unwrap());
        let kinds = [StageKind { class: 0, tp: 1, dp: 1 }];
        let opts = PlanOptions::default();
        let optimizer = |profiles: &ProfileSet, layers: u32| {
            let cm = CostModel { cluster: &c, model: &model, profiles, opts: &opts };
            let cost = cm.layer_cost(kinds[0], 1);
            let ctx = cm.sync_context(1, &[1], true);
            cm.replica_time(&ctx, &kinds, &[cost], &[layers], 1).optimizer
        };
        let mut p = LayerProfile::per_layer("A100-80G", 1, 1, 1.0, 2.0, None);
        p.optimizer_ms = Some(40.0);
        let measured = ProfileSet { profiles: vec![p] };
        // The layers take 40 ms each; the embedding and head (first and last stage) the same
        // seconds per parameter, not the catalog bandwidth's estimate.
        let layer_params = model.layer_params;
        let ends = model.ends_params(true, true);
        let want = (24.0 * layer_params + ends) * 0.040 / layer_params;
        assert!((optimizer(&measured, 24) - want).abs() < 1e-9 * want, "{} against {want}", optimizer(&measured, 24));
        assert!((optimizer(&measured, 12) - optimizer(&measured, 6) - 6.0 * 0.040).abs() < 1e-9);
        let estimated_ends = optimizer(&ProfileSet::default(), 24) - 24.0 * optimizer_per_layer(&c, &model);
        assert!(
            ends * 0.040 / layer_params > 10.0 * estimated_ends,
            "a measured device slower than its catalog peak prices its ends slower too"
        );
    }

    #[test]
    fn a_measured_type_is_priced_from_its_nearest_micro_batch_never_from_its_peak() {
        let (c, model) = (cluster(), Model::new(crate::model::model_by_name("gpt3-1.3b").unwrap(), None).unwrap());
        let opts = PlanOptions::default();
        let mut p = LayerProfile::per_layer("A100-80G", 1, 2, 30.0, 60.0, Some(8.0));
        p.head_fwd_ms = Some(25.0);
        p.head_bwd_ms = Some(5.0);
        let profiles = ProfileSet { profiles: vec![p, LayerProfile::per_layer("A100-80G", 1, 8, 100.0, 200.0, None)] };
        let cm = CostModel { cluster: &c, model: &model, profiles: &profiles, opts: &opts };
        let cost = |dp, micro_batch| cm.layer_cost(StageKind { class: 0, tp: 1, dp }, micro_batch);
        let close = |a: f64, b: f64| (a - b).abs() < 1e-12;
        let exact = cost(1, 2);
        assert!(close(exact.fwd, 0.030) && close(exact.bwd, 0.060));
        assert!(close(exact.head.0, 0.025) && close(exact.head.1, 0.005), "{exact:?}");
        // The last stage's passes carry the head's measured forward and backward as measured
        // (the runtime's head computes the loss's gradient in its forward: most of its time is
        // there, and the 1F1B critical path depends on which pass holds it).
        let (f, b) = CostModel::stage_time(&exact, 1, false, true);
        assert!(close(f, 0.055) && close(b, 0.065), "{f} {b}");
        // Micro-batch 2 over two GPUs: one sequence each, half the measured pass (not the
        // catalog peak, which would price it in microseconds).
        let split = cost(2, 2);
        assert!(
            close(split.fwd, 0.015) && close(split.bwd, 0.030) && close(split.head.0, 0.0125) && close(split.head.1, 0.0025),
            "{split:?}"
        );
        assert!(close(split.layer_act, 4.0 * 1024.0 * 1024.0));
        // Three sequences: the nearest entry by ratio is micro-batch 2, scaled by 1.5.
        assert!(close(cost(1, 3).fwd, 0.045));
        // Six: micro-batch 8 (6/8 is nearer than 6/2), scaled by 0.75.
        assert!(close(cost(1, 6).fwd, 0.075));
        // A type without a profile stays on the roofline.
        let none = ProfileSet::default();
        let roofline =
            CostModel { cluster: &c, model: &model, profiles: &none, opts: &opts }.layer_cost(StageKind { class: 0, tp: 1, dp: 2 }, 2);
        assert!(roofline.fwd < 0.005, "{}", roofline.fwd);
    }

    #[test]
    fn state_bytes_follow_the_runtime_with_and_without_zero1() {
        let opts = |zero1, precision| PlanOptions { zero1, precision, ..PlanOptions::default() };
        assert_eq!(opts(false, Precision::Bf16).state_bytes_per_param(4), 18.0, "with autocast's half copy");
        assert_eq!(opts(false, Precision::Fp32).state_bytes_per_param(4), 16.0);
        assert_eq!(opts(true, Precision::Bf16).state_bytes_per_param(4), 9.0, "bf16 weights, fp32 grads, (master + moments) / 4");
        assert_eq!(opts(true, Precision::Fp16).state_bytes_per_param(1), 18.0, "a master copy beside half weights");
        assert_eq!(opts(true, Precision::Fp32).state_bytes_per_param(2), 12.0, "the weights are the master");
    }

    #[test]
    fn the_embedding_and_head_are_whole_on_every_tp_rank() {
        let (c, model) = (cluster(), Model::new(crate::model::model_by_name("gpt3-1.3b").unwrap(), None).unwrap());
        let (profiles, opts) = (ProfileSet::default(), PlanOptions::default());
        let cm = CostModel { cluster: &c, model: &model, profiles: &profiles, opts: &opts };
        let (one, two) = (cm.layer_cost(StageKind { class: 0, tp: 1, dp: 1 }, 1), cm.layer_cost(StageKind { class: 0, tp: 2, dp: 1 }, 1));
        assert_eq!((one.embed_state, one.head_state, one.head_act), (two.embed_state, two.head_state, two.head_act));
        assert_eq!(one.layer_state, 2.0 * two.layer_state, "the layers are split");
    }

    #[test]
    fn a_hop_the_stages_cannot_hide_sets_the_period() {
        // Two stages of 3 s and a 1 s hop: a round trip through both (3 + 1 + 3 s) carries the
        // two micro-batches in flight, 3.5 s each; blocking sends pay the hop on each side.
        assert_eq!(pipeline_period(&[3.0, 3.0], &[1.0], false), 3.5);
        assert_eq!(pipeline_period(&[3.0, 3.0], &[1.0], true), 4.0);
        // A stage with 1 s of slack hides half a second of hop: the slowest stage sets it.
        assert_eq!(pipeline_period(&[3.0, 2.0], &[0.5], false), 3.0);
        // The window that cannot hide its hops may be inside the pipeline: stages 1-2 of four.
        assert_eq!(pipeline_period(&[1.0, 3.0, 3.0, 1.0], &[0.1, 2.0, 0.1], false), 4.0);
        // The whole pipeline's round trip: (4 x 2 + 3 x 0.4) / 4.
        assert!((pipeline_period(&[2.0; 4], &[0.4; 3], false) - 2.3).abs() < 1e-12);
        // A hop slower than every stage still sets it alone (its link's throughput).
        assert_eq!(pipeline_period(&[1.0, 1.0], &[5.0], false), 5.0);
        assert_eq!(pipeline_period(&[2.0], &[], false), 2.0);
    }

    /// The roofline estimate of one layer's optimizer step on the cluster's GPU.
    fn optimizer_per_layer(c: &Cluster, model: &Model) -> f64 {
        model.layer_params * 28.0 / (c.classes[0].gpu.mem_bw_gbps * 1e9)
    }
}
