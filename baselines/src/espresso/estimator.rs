//! Espresso's per-plan estimator (`StagePlacer.estimater` -> llm-analysis `portal.train` ->
//! DeepSpeed's 1F1B order, priced as `GPUAllocator.callMapper`), reproduced operation for
//! operation so that times and costs equal Espresso's to the last bit (golden values from its
//! own code: `examples/espresso/estimator_golden.tsv`). Its quirks are kept on purpose; each
//! is named where it happens. A plan is an ordered list of (GPU, layers) stages run by `dp`
//! identical replicas with `M = gradient_accumulation_steps` micro-batches of
//! `global_batch // (dp * M)` sequences.

use super::input::{Job, ModelConfig};

/// One GPU type as the estimator reads it.
#[derive(Debug, Clone, PartialEq)]
pub struct EstimatorGpu {
    pub name: String,
    /// $ per GPU-hour (`espresso_gpu_config.json`).
    pub price: f64,
    /// llm-analysis hardware spec.
    pub peak_tflops: f64,
    pub hbm_gbps: f64,
    pub inter_node_gbps: f64,
    pub memory_gb: f64,
    /// `portal_gpu_efficiency.json` (not the placer's table: Espresso's two disagree).
    pub flops_efficiency: f64,
    pub hbm_efficiency: f64,
}

/// Espresso's sentinel for a plan out of memory (`inf = 10000000000` in `StagePlacer`).
pub const OOM_TIME: f64 = 1e10;

const GIB: f64 = 1073741824.0;

/// What one layer, the embedding and a hop cost on one GPU type at one micro-batch size.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LayerTerms {
    pub t_f: f64,
    pub emb_in: f64,
    pub emb_out: f64,
    pub comm: f64,
    /// Weights + optimizer + gradients of one layer, bytes.
    pub layer_state: f64,
    pub act_layer: f64,
    pub w_layer: f64,
    pub e_w: f64,
    /// Embedding state of the first stage; the last stage adds the logits.
    pub emb_first: f64,
    pub emb_last: f64,
    pub capacity: f64,
}

/// Exact integer products, rounded once to f64 as Python's int / int does.
fn int(x: u128) -> f64 {
    x as f64
}

/// The model dimensions the estimator reads (from the model config only, never the job).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Dims {
    pub s: u64,
    pub h: u64,
    pub nh: u64,
    pub v: u64,
}

impl Dims {
    pub fn new(job: &Job, mc: &ModelConfig) -> Dims {
        Dims { s: job.seq_len, h: mc.hidden_dim, nh: mc.n_head as u64, v: mc.vocab_size }
    }
}

/// The fitted memory correction `total = a * raw + b GiB`, chosen by a substring of the
/// job's `model_name` ("ViT": by micro-batch, "llama": by sequence length, else (1, 0)),
/// linear through two fitted points.
pub fn memory_fit(model_name: &str, s: u64, b: u64) -> (f64, f64) {
    let line = |x: u64, p: [(u64, f64, f64); 2]| {
        for (k, a, bb) in p {
            if x == k {
                return (a, bb);
            }
        }
        let [(x1, a1, b1), (x2, a2, b2)] = p;
        let sa = (a2 - a1) / (x2 - x1) as f64;
        let sb = (b2 - b1) / (x2 - x1) as f64;
        let ia = a1 - sa * x1 as f64;
        let ib = b1 - sb * x1 as f64;
        (sa * x as f64 + ia, sb * x as f64 + ib)
    };
    if model_name.contains("ViT") {
        line(b, [(16, 0.9036, 1.6228), (32, 0.8229, 1.4408)])
    } else if model_name.contains("llama") {
        line(s, [(1500, 1.3810, 1.0666), (1800, 1.3685, 1.2096)])
    } else {
        (1.0, 0.0)
    }
}

/// llm-analysis's per-layer numbers for one GPU at micro-batch `b` (tp = 1, w16a16e16, full
/// recomputation, ffn = 4h, no GQA).
pub fn layer_terms(d: Dims, g: &EstimatorGpu, b: u64) -> LayerTerms {
    let (s, h, nh, v) = (d.s as u128, d.h as u128, d.nh as u128, d.v as u128);
    let b128 = b as u128;
    let hf = d.h as f64;
    let tf = g.peak_tflops * g.flops_efficiency;
    let bw = g.hbm_gbps * g.hbm_efficiency;
    let ffn = h * 4;
    let groups = 1.0; // n_head / kv_heads
                      // 2*h**2 + 2*h*(h*(max(kvh/1, 1)*1)/nh), kvh = nh: int + int * float.
    let kvh = d.nh as f64;
    let p_attn = int(2 * h * h) + int(2 * h) * (hf * (kvh.max(1.0) * 1.0) / d.nh as f64);
    let p_mlp = int(2 * h * ffn);
    let p_ln = int(2 * h);
    let w_layer = p_attn * 16.0 / 8.0 + p_mlp * 16.0 / 8.0 + p_ln * 16.0 / 8.0;
    let o_layer = 12.0 * p_mlp + 12.0 * (p_attn + 0.0 + p_ln);
    let g_layer = p_mlp * 4.0 + (p_attn + 0.0 + p_ln) * 4.0;
    let e_w = int(h * v) * 2.0;
    let e_o = int(12 * h * v);
    let e_g = int(4 * h * v);
    let act_layer = int(s * b128 * h * 16) / 8.0;
    let act_out = int(2 * v * b128 * s * 16) / 8.0;
    // Attention: the recompute flag lands in llm-analysis's flash_attn slot, so the activation
    // bytes are the no-recompute flash-attention ones (Espresso quirk).
    let fl_attn = int(4 * b128 * s * h * h) + int(4 * b128 * s * h * h) / groups + int(4 * b128 * s * s * h);
    let c_attn = fl_attn / (tf * 1e12);
    let w_attn = (p_attn * 16.0 / 8.0) / (bw * 1e9);
    let mut act_attn = (int(s * b128 * h) + int(4 * s * b128 * h)) * 2.0 + int(2 * s * b128 * h + 4 * nh * s * b128) * 2.0;
    act_attn += int(s * b128 * h);
    let m_attn = w_attn + act_attn / (bw * 1e9);
    let t_attn = c_attn.max(m_attn);
    let c_mlp = int(16 * b128 * s * h * h) / (tf * 1e12);
    let m_mlp = (p_mlp * 16.0 / 8.0) / (bw * 1e9) + 0.0 / (bw * 1e9);
    let t_mlp = c_mlp.max(m_mlp);
    let t_ln = int(s * b128 * h) * 4.0 / (bw * 1e9);
    let t_f = t_attn + t_mlp + 2.0 * t_ln + 0.0;
    let emb_in = int(v * h) * 2.0 / (bw * 1e9) + 0.0;
    let emb_out = int(2 * s * b128 * v * h) / (tf * 1e12);
    // Activation bits taken for bytes: the hop is priced 8x too slow (Espresso quirk).
    let comm = int(s * b128 * h * 16) / (g.inter_node_gbps * 1.0 * 1e9);
    let emb_first = 0.5 * GIB + e_w + e_o + e_g;
    LayerTerms {
        t_f,
        emb_in,
        emb_out,
        comm,
        layer_state: w_layer + o_layer + g_layer,
        act_layer,
        w_layer,
        e_w,
        emb_first,
        emb_last: emb_first + act_out,
        capacity: g.memory_gb * GIB,
    }
}

/// Bytes a stage of `layers` layers needs on one GPU with `inflight` micro-batches in flight,
/// after the fitted correction. The first and the last stage both hold the whole embedding
/// and 0.5 GiB (the last one wins when one stage is both), the last also one micro-batch's
/// logits (Espresso quirks).
pub fn stage_memory(t: &LayerTerms, layers: u32, inflight: usize, first: bool, last: bool, fit: (f64, f64)) -> f64 {
    let l = layers as f64;
    let emb_mem = if last {
        t.emb_last
    } else if first {
        t.emb_first
    } else {
        0.0
    };
    let raw = t.layer_state * l + t.act_layer * l * inflight as f64 + emb_mem;
    fit.0 * raw + (fit.1 + 0.0) * GIB
}

/// One stage's verdict and times.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StageEstimate {
    /// Bytes after the fitted correction.
    pub memory: f64,
    pub memory_left: f64,
    /// Forward without the hop term, forward and backward as simulated, all-reduce.
    pub f0: f64,
    pub fwd: f64,
    pub bwd: f64,
    pub allreduce: f64,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Estimate {
    pub fits: bool,
    /// Seconds; `OOM_TIME` when a stage is out of memory, as Espresso says.
    pub iteration_time: f64,
    /// $ per iteration: `money * T / 3600` with `money = sum of price * dp` in stage order.
    pub cost: f64,
    pub money_per_hour: f64,
    pub micro_batch: u64,
    /// Espresso's "excess memory" when out of memory: MiB over capacity summed, plus 500.
    pub oom_excess_mib: f64,
    pub stages: Vec<StageEstimate>,
}

/// Per-stage terms (`terms[i]` for stage i's GPU at this plan's micro-batch) to a price.
pub fn estimate_with(job: &Job, terms: &[LayerTerms], prices: &[f64], layers: &[u32], dp: u32, fit: (f64, f64)) -> Estimate {
    let m = job.gradient_accumulation_steps as usize;
    let pp = terms.len();
    let mut stages = Vec::with_capacity(pp);
    for (i, t) in terms.iter().enumerate() {
        let (first, last) = (i == 0, i + 1 == pp);
        let l = layers[i] as f64;
        let inflight = (pp - i).min(m);
        let memory = stage_memory(t, layers[i], inflight, first, last, fit);
        // pp == 1: the output head overwrites the input embedding's latency (Espresso quirk).
        let emb_lat = if last {
            t.emb_out
        } else if first {
            t.emb_in
        } else {
            0.0
        };
        let f0 = l * t.t_f + emb_lat;
        let mut ar = t.w_layer * 8.0 * l;
        if first || last {
            ar += t.e_w * 8.0;
        }
        stages.push(StageEstimate {
            memory,
            memory_left: t.capacity - memory,
            f0,
            fwd: f0 + t.comm * (pp - 1) as f64 * 0.8,
            bwd: f0 * 3.0,
            allreduce: if dp > 1 { ar / (2.5 * GIB) } else { 0.0 },
        });
    }
    let mut money = 0.0;
    for p in prices {
        money += p * dp as f64 * 1.0;
    }
    let micro_batch = job.global_batch_size as u64 / (dp as u64 * m as u64);
    let fits = stages.iter().all(|s| s.memory_left >= 0.0);
    if !fits {
        let excess: f64 = stages.iter().filter(|s| s.memory_left < 0.0).map(|s| -s.memory_left).sum();
        return Estimate {
            fits,
            iteration_time: OOM_TIME,
            cost: money * OOM_TIME / 3600.0,
            money_per_hour: money,
            micro_batch,
            oom_excess_mib: excess / 1024.0 / 1024.0 + 500.0,
            stages,
        };
    }
    let fwd: Vec<f64> = stages.iter().map(|s| s.fwd).collect();
    let bwd: Vec<f64> = stages.iter().map(|s| s.bwd).collect();
    let last = simulate_1f1b(&fwd, &bwd, m);
    let mut t = 0.0f64;
    for i in 0..pp {
        t = t.max(last[i] + stages[i].allreduce);
    }
    Estimate { fits, iteration_time: t, cost: money * t / 3600.0, money_per_hour: money, micro_batch, oom_excess_mib: 0.0, stages }
}

/// DeepSpeed's `TrainSchedule` on every stage (`w_i = min(pp - i, M)` warm-up forwards, then
/// alternating backward/forward, then the cool-down backwards), each op starting when its
/// stage is free and its dependency is done: forward k after forward k of the previous
/// stage, backward k after backward k of the next stage (the last stage: after its own
/// forward k). Returns each stage's last finish time.
pub fn simulate_1f1b(fwd: &[f64], bwd: &[f64], m: usize) -> Vec<f64> {
    let pp = fwd.len();
    // Forwards run front to back and backwards back to front, so a sweep over stages per
    // "op index" would not respect dependencies in general; instead advance every stage as far
    // as its dependencies allow until all are done (the order does not change any time).
    let mut f_done = vec![vec![f64::NAN; m]; pp];
    let mut b_done = vec![vec![f64::NAN; m]; pp];
    let mut pos = vec![0usize; pp];
    let mut free = vec![0.0f64; pp];
    let (mut kf, mut kb) = (vec![0usize; pp], vec![0usize; pp]);
    let op = |i: usize, j: usize| {
        let w = (pp - i).min(m);
        if j < w {
            true
        } else if j < 2 * m - w {
            (j - w) % 2 == 1
        } else {
            false
        }
    };
    let mut left = 2 * m * pp;
    while left > 0 {
        let mut progressed = false;
        for i in 0..pp {
            while pos[i] < 2 * m {
                let is_f = op(i, pos[i]);
                let ready = if is_f {
                    if i == 0 {
                        0.0
                    } else {
                        f_done[i - 1][kf[i]]
                    }
                } else if i + 1 == pp {
                    f_done[i][kb[i]]
                } else {
                    b_done[i + 1][kb[i]]
                };
                if ready.is_nan() {
                    break;
                }
                let start = if pos[i] == 0 { ready } else { free[i].max(ready) };
                if is_f {
                    free[i] = start + fwd[i];
                    f_done[i][kf[i]] = free[i];
                    kf[i] += 1;
                } else {
                    free[i] = start + bwd[i];
                    b_done[i][kb[i]] = free[i];
                    kb[i] += 1;
                }
                pos[i] += 1;
                left -= 1;
                progressed = true;
            }
        }
        assert!(progressed, "1F1B schedule deadlocked");
    }
    free
}

/// A job ready to price plans: its dimensions, memory fit and GPU table.
#[derive(Debug, Clone)]
pub struct Estimator {
    pub job: Job,
    pub dims: Dims,
    pub gpus: Vec<EstimatorGpu>,
}

impl Estimator {
    pub fn new(job: Job, mc: &ModelConfig, gpus: Vec<EstimatorGpu>) -> crate::Result<Estimator> {
        if job.seq_len > mc.max_seq_len {
            return Err(crate::BaselineError::invalid(
                "seq_len",
                format!("{} exceeds the model config's max_seq_len {}; lower the job's seq_len", job.seq_len, mc.max_seq_len),
            ));
        }
        Ok(Estimator { dims: Dims::new(&job, mc), job, gpus })
    }

    /// Micro-batch of a plan with `dp` replicas (Python floor division, as Espresso).
    pub fn micro_batch(&self, dp: u32) -> u64 {
        self.job.global_batch_size as u64 / (dp as u64 * self.job.gradient_accumulation_steps as u64)
    }

    /// Price `plan` (GPU index into `gpus`, layers) run by `dp` replicas.
    pub fn estimate(&self, plan: &[(usize, u32)], dp: u32) -> Estimate {
        let b = self.micro_batch(dp);
        let terms: Vec<LayerTerms> = plan.iter().map(|&(g, _)| layer_terms(self.dims, &self.gpus[g], b)).collect();
        let prices: Vec<f64> = plan.iter().map(|&(g, _)| self.gpus[g].price).collect();
        let layers: Vec<u32> = plan.iter().map(|&(_, l)| l).collect();
        estimate_with(&self.job, &terms, &prices, &layers, dp, memory_fit(&self.job.model_name, self.dims.s, b))
    }
}
