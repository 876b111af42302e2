//! Espresso's stage placer (`StagePlacer.StageGPUmapper`), replayed step for step: given a
//! multiset of GPUs (listed in GPU-table order) and `dp`, it decides the pipeline's stage
//! order and layers and returns the fastest of its candidates as priced by the estimator.
//! Checked against 4185 placements made by Espresso's own code
//! (`examples/espresso/placer_golden.tsv`).
//!
//! In short: a *flop share* per GPU type (`int(peak / total_peak * L)`, the GPU table's peaks),
//! a *memory cap* per (type, depth, stage) (most layers whose memory fits with
//! `min(pp - stage, M)` micro-batches in flight), per-layer compute times at the *placer's*
//! efficiencies (`espresso_gpu_config.json`; infinite once weights and optimizer states alone
//! overflow), and DP all-reduce times (zero when dp = 1). For every stage-0 layer count `now`
//! it builds a pipeline greedily: stage 0 goes to the type with the smallest flop share whose
//! stage-0 cap holds `now`; each later stage to the type with the smallest
//! `share - min(hidable layers, cap)`, where "hidable" is how many layers' all-reduce still
//! hides under the earlier stages' backward time (2.7 x compute). Ties go to the earlier type.
//! Leftover layers go one by one to the stage most below `min(hidable, cap)` (no memory check:
//! such candidates come back out of memory, and the layer total may exceed `L`; both are
//! Espresso's behaviour, kept). The loop stops at the first `now` no type can hold.

use super::estimator::{estimate_with, layer_terms, memory_fit, stage_memory, Estimate, Estimator, EstimatorGpu, LayerTerms, OOM_TIME};

const GIB: f64 = 1073741824.0;

/// The placer's view of one job at one `dp`: tables shared by every allocation.
pub struct Placer<'a> {
    pub est: &'a Estimator,
    pub dp: u32,
    /// Layers the placer places (`model_layer`, else `num_layers`).
    pub layers: u32,
    /// The GPU table's peaks (flop shares) and the placer's efficiencies, per GPU type.
    table_peaks: Vec<f64>,
    /// Estimator terms (pricing) and placer terms (compute tables), per GPU type.
    pub(crate) est_terms: Vec<LayerTerms>,
    comp: Vec<Vec<f64>>,
    ar_mid: Vec<f64>,
    ar_first: Vec<f64>,
    pub(crate) fit: (f64, f64),
}

/// One placement: stage order (GPU indices), layers per stage, and its price.
#[derive(Debug, Clone)]
pub struct Placement {
    pub order: Vec<usize>,
    pub layers: Vec<u32>,
    pub estimate: Estimate,
}

impl<'a> Placer<'a> {
    /// `placer_gpus[i]` is GPU i with the placer's efficiencies; `table_peaks[i]` its peak in
    /// the GPU table.
    pub fn new(est: &'a Estimator, placer_gpus: &[EstimatorGpu], table_peaks: &[f64], dp: u32) -> Placer<'a> {
        let b = est.micro_batch(dp);
        let layers = est.job.model_layer.unwrap_or(est.job.num_layers);
        let fit = memory_fit(&est.job.model_name, est.dims.s, b);
        let est_terms: Vec<LayerTerms> = est.gpus.iter().map(|g| layer_terms(est.dims, g, b)).collect();
        let comp = placer_gpus
            .iter()
            .map(|g| {
                let t = layer_terms(est.dims, g, b);
                (0..=layers)
                    .map(|l| {
                        if l == 0 {
                            0.0
                        } else if t.capacity - stage_memory(&t, l, 0, false, false, fit) < 0.0 {
                            f64::INFINITY
                        } else {
                            l as f64 * t.t_f + 0.0
                        }
                    })
                    .collect()
            })
            .collect();
        let t0 = est_terms[0];
        let ar = |l: u32, ends: bool| {
            if dp == 1 {
                0.0
            } else {
                (t0.w_layer * 8.0 * l as f64 + if ends { t0.e_w * 8.0 } else { 0.0 }) / (2.5 * GIB)
            }
        };
        Placer {
            est,
            dp,
            layers,
            table_peaks: table_peaks.to_vec(),
            est_terms,
            comp,
            ar_mid: (0..=layers).map(|l| ar(l, false)).collect(),
            ar_first: (0..=layers).map(|l| ar(l, true)).collect(),
            fit,
        }
    }

    /// Most layers a GPU of type `g` holds as stage `st` of a `pp`-stage pipeline (0: none).
    pub fn cap(&self, g: usize, pp: usize, st: usize) -> u32 {
        let t = &self.est_terms[g];
        let inflight = (pp - st).min(self.est.job.gradient_accumulation_steps as usize);
        let mut best = 0;
        for l in 1..=self.layers {
            if t.capacity - stage_memory(t, l, inflight, st == 0, st + 1 == pp, self.fit) < 0.0 {
                break;
            }
            best = l;
        }
        best
    }

    /// The least GPU memory any plan needs, bytes: every layer's states once, the embedding
    /// at one end, the fitted per-stage overhead once (activations not counted).
    pub fn least_memory_bytes(&self) -> f64 {
        let t = &self.est_terms[0];
        self.fit.0 * (t.layer_state * self.layers as f64 + t.emb_first) + self.fit.1 * GIB
    }

    /// Price a plan (GPU index, layers) at this placer's dp.
    pub fn price(&self, order: &[usize], layers: &[u32]) -> Estimate {
        let terms: Vec<LayerTerms> = order.iter().map(|&g| self.est_terms[g]).collect();
        let prices: Vec<f64> = order.iter().map(|&g| self.est.gpus[g].price).collect();
        estimate_with(&self.est.job, &terms, &prices, layers, self.dp, self.fit)
    }

    /// Place an allocation (`counts[i]` GPUs of type i per replica). None when no candidate
    /// fits (Espresso: an empty strategy at time `inf`).
    pub fn place(&self, counts: &[u32]) -> Option<Placement> {
        let pp: usize = counts.iter().map(|&c| c as usize).sum();
        let l_total = self.layers;
        // Types in order of first occurrence in the allocation list = table order.
        let types: Vec<usize> = (0..counts.len()).filter(|&i| counts[i] > 0).collect();
        let mut total_f = 0.0;
        for &t in &types {
            total_f += self.table_peaks[t] * counts[t] as f64;
        }
        let share: Vec<i64> = (0..counts.len()).map(|t| ((self.table_peaks[t] / total_f) * l_total as f64) as i64).collect();
        let caps: Vec<Vec<i64>> = (0..counts.len())
            .map(|t| if counts[t] > 0 { (0..pp).map(|st| self.cap(t, pp, st) as i64).collect() } else { vec![] })
            .collect();
        let mut best: Option<(f64, Vec<usize>, Vec<u32>)> = None;
        for now in 1..=l_total as i64 {
            let mut rem = counts.to_vec();
            let mut table: Vec<[i64; 3]> = Vec::with_capacity(pp);
            let mut order = Vec::with_capacity(pp);
            let mut res = l_total as i64;
            let mut comm = 0.0f64;
            let mut stopped = false;
            for st in 0..pp {
                let mut pick: Option<(i64, i64, i64, usize)> = None;
                let consider = |cand: (i64, i64, i64, usize), pick: &mut Option<(i64, i64, i64, usize)>| {
                    if pick.is_none_or(|p| cand.0 < p.0) {
                        *pick = Some(cand);
                    }
                };
                if st == 0 {
                    for &t in &types {
                        if rem[t] > 0 && caps[t][0] >= now {
                            consider((share[t] - now, now, caps[t][0], t), &mut pick);
                        }
                    }
                } else {
                    let cl = self.comm_layers(res, comm);
                    for &t in &types {
                        if rem[t] > 0 {
                            consider((share[t] - cl.min(caps[t][st]), cl, caps[t][st], t), &mut pick);
                        }
                    }
                }
                let Some((_, c, m, t)) = pick else {
                    stopped = true;
                    break;
                };
                rem[t] -= 1;
                order.push(t);
                table.push([c, m, share[t]]);
                let ml = c.min(m).min(share[t]);
                comm += self.comp[t][ml.max(0) as usize] * 2.7;
                res -= ml;
                if st == 0 {
                    comm += self.ar_first[ml.max(0) as usize];
                }
            }
            if stopped {
                break;
            }
            let mut lay: Vec<i64> = table.iter().map(|r| r[0].min(r[1]).min(r[2])).collect();
            lay[0] = table[0][0];
            let mut r = l_total as i64 - lay.iter().sum::<i64>();
            let mut heap: std::collections::BinaryHeap<std::cmp::Reverse<(i64, i64, usize)>> =
                (0..pp).map(|i| std::cmp::Reverse((lay[i] - table[i][0].min(table[i][1]), lay[i], i))).collect();
            while r > 0 {
                let Some(std::cmp::Reverse((p, l, i))) = heap.pop() else { break };
                lay[i] += 1;
                heap.push(std::cmp::Reverse((p + 1, l + 1, i)));
                r -= 1;
            }
            let layers: Vec<u32> = lay.iter().map(|&x| x.max(0) as u32).collect();
            let e = self.price(&order, &layers);
            let t = if e.fits { e.iteration_time } else { OOM_TIME };
            if t < best.as_ref().map_or(OOM_TIME, |b| b.0) {
                best = Some((t, order, layers));
            }
        }
        let (_, order, layers) = best?;
        let estimate = self.price(&order, &layers);
        Some(Placement { order, layers, estimate })
    }

    /// Largest x in [1, res] whose all-reduce (a middle stage's) still hides under `comm`; 0
    /// if none.
    fn comm_layers(&self, res: i64, comm: f64) -> i64 {
        let (mut cl, mut lo, mut hi) = (0, 1, res);
        while lo <= hi {
            let mid = (lo + hi) / 2;
            if self.ar_mid[mid.min(self.layers as i64) as usize] < comm {
                cl = mid;
                lo = mid + 1;
            } else {
                hi = mid - 1;
            }
        }
        cl
    }
}
