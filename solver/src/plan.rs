//! The plan: replicas of pipelines of stages, how it is priced as a whole, and whether its
//! layers and batch add up. Below `placement` (where its GPUs physically are, and whether the
//! cluster holds it): calls only `cost`.

use crate::cost::{CostModel, LayerCost, ReplicaTime, StageKind};

/// One pipeline stage: contiguous layers `[start, end)` on `dp` TP groups of `tp` GPUs of
/// one node class.
#[derive(Debug, Clone, PartialEq)]
pub struct StagePlan {
    pub kind: StageKind,
    pub layers: (u32, u32),
}

/// One data-parallel replica: a pipeline and its share of the global batch.
#[derive(Debug, Clone, PartialEq)]
pub struct ReplicaPlan {
    pub stages: Vec<StagePlan>,
    pub micro_batches: u32,
}

/// A plan before placement: everything the cost model prices.
#[derive(Debug, Clone, PartialEq)]
pub struct PlanStructure {
    /// Sequences per micro-batch of every pipeline.
    pub micro_batch: u32,
    pub replicas: Vec<ReplicaPlan>,
}

impl PlanStructure {
    pub fn total_micro_batches(&self) -> u32 {
        self.replicas.iter().map(|r| r.micro_batches).sum()
    }

    /// Every replica has the same stages with the same layers (its gradient rings stay inside
    /// each stage's node class, see `cost::Rings`).
    pub fn is_uniform(&self) -> bool {
        self.replicas.windows(2).all(|w| w[0].stages == w[1].stages)
    }

    /// GPUs of each node class the plan uses.
    pub fn gpus_per_class(&self, classes: usize) -> Vec<u32> {
        let mut g = vec![0u32; classes];
        for r in &self.replicas {
            for s in &r.stages {
                g[s.kind.class] += s.kind.dp * s.kind.tp;
            }
        }
        g
    }
}

/// The price of a plan.
#[derive(Debug, Clone, PartialEq)]
pub struct Evaluation {
    pub iteration_time: f64,
    pub replica_times: Vec<f64>,
    /// Each replica's time terms (`replica_times[i]` is `terms[i].total(micro_batches)`).
    pub terms: Vec<ReplicaTime>,
    /// Bytes per GPU, per replica, per stage.
    pub memory: Vec<Vec<f64>>,
    /// Usable bytes per GPU, per replica, per stage.
    pub capacity: Vec<Vec<f64>>,
    pub fits: bool,
}

impl<'a> CostModel<'a> {
    /// Price a whole plan. Structural validity (layers cover the model, batch adds up, GPUs
    /// exist) is checked by `check_structure` (placement.rs, since it asks whether the cluster's
    /// nodes hold the plan).
    pub fn evaluate(&self, plan: &PlanStructure) -> Evaluation {
        let gpus = plan.gpus_per_class(self.cluster.classes.len());
        let ctx = self.sync_context(plan.replicas.len() as u32, &gpus, plan.is_uniform());
        let max_inflight = plan.total_micro_batches();
        let mut out =
            Evaluation { iteration_time: 0.0, replica_times: vec![], terms: vec![], memory: vec![], capacity: vec![], fits: true };
        // Plans repeat a few stage kinds many times: price each kind once.
        let mut known: Vec<(StageKind, LayerCost)> = vec![];
        let mut cost_of = |k: StageKind| match known.iter().find(|(x, _)| *x == k) {
            Some((_, c)) => *c,
            None => {
                let c = self.layer_cost(k, plan.micro_batch);
                known.push((k, c));
                c
            }
        };
        for r in &plan.replicas {
            let kinds: Vec<StageKind> = r.stages.iter().map(|s| s.kind).collect();
            let costs: Vec<LayerCost> = kinds.iter().map(|&k| cost_of(k)).collect();
            let layers: Vec<u32> = r.stages.iter().map(|s| s.layers.1 - s.layers.0).collect();
            let terms = self.replica_time(&ctx, &kinds, &costs, &layers, plan.micro_batch);
            let t = terms.total(r.micro_batches);
            let mem = self.replica_memory(&costs, &layers, max_inflight);
            let cap: Vec<f64> = costs.iter().map(|c| c.capacity).collect();
            out.fits &= mem.iter().zip(&cap).all(|(m, c)| m <= c);
            out.iteration_time = out.iteration_time.max(t);
            out.replica_times.push(t);
            out.terms.push(terms);
            out.memory.push(mem);
            out.capacity.push(cap);
        }
        out
    }

    /// Everything `check_structure` (placement.rs) checks but whether the cluster's nodes hold
    /// the plan.
    pub fn check_layers_and_batch(&self, plan: &PlanStructure) -> Result<(), String> {
        if plan.replicas.is_empty() {
            return Err("a plan needs at least one replica".into());
        }
        if plan.micro_batch == 0 || plan.total_micro_batches() * plan.micro_batch != self.opts.global_batch {
            return Err(format!(
                "micro-batches x micro-batch size = {} x {} must equal the global batch {}",
                plan.total_micro_batches(),
                plan.micro_batch,
                self.opts.global_batch
            ));
        }
        for (ri, r) in plan.replicas.iter().enumerate() {
            if r.micro_batches == 0 {
                return Err(format!("replica {ri} has no micro-batches"));
            }
            let mut next = 0;
            for s in &r.stages {
                if s.layers.0 != next || s.layers.1 <= s.layers.0 {
                    return Err(format!("replica {ri}: stage layers must be contiguous and non-empty"));
                }
                if !plan.micro_batch.is_multiple_of(s.kind.dp) {
                    return Err(format!("replica {ri}: stage dp {} does not divide the micro-batch", s.kind.dp));
                }
                next = s.layers.1;
            }
            if next != self.model.layers() {
                return Err(format!("replica {ri} covers {next} of {} layers", self.model.layers()));
            }
        }
        Ok(())
    }
}
