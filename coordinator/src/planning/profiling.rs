//! Layer profiles: which measured profiles a job's plan needs, asking agents to measure the
//! missing ones, and storing what they report.
//!
//! A profile is keyed by (GPU type, model hash, tp, micro-batch, sequence length, data type)
//! and, in the store, the torch version that measured it. Before a queued job is planned
//! (`planning::plan_job`), `prepare` looks up the stored profiles of its model and, for every
//! (GPU type, tp, micro-batch) the planner's search would price on the GPUs offered, sends a
//! `Profile` instruction to a live agent that can profile (it registered `can_profile`) and has
//! `tp` free GPUs of that type, one run per node at a time. The job waits while runs are out;
//! a run that fails (or times out, `PROFILE_INTERVALS` base intervals) is remembered for as
//! long, and the job is planned with the roofline for that key (`profiling.mode: auto`) or
//! fails with the reason (`only`).
//!
//! Durable: the profiles (`layer_profiles`) and the runs (`profile_runs`): a new leader knows
//! the runs out, takes their reports, and remembers the failures (docs/state.md).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::Duration;

use motley_proto::v1::{instruction, Instruction, Profile};
use motley_solver::hardware::NodeSpec;
use motley_solver::profile::LayerProfile;
use motley_solver::{Model, ModelSpec, PlanOptions, ProfileSet, SearchMode};
use sha2::{Digest, Sha256};

use crate::error::{CoordinatorError, Result};
use crate::job::spec::{JobSpec, ProfilingMode};
use crate::state::fleet::Fleet;
use crate::store::{NewProfile, ProfileRecord, RunKey, Store};

/// A profile run may take this many base intervals before it counts as failed (the agent is
/// told the same, less a margin for the report); a failure is remembered for as long.
pub const PROFILE_INTERVALS: u32 = 600;

/// The sha256 (hex) of the model's canonical JSON (`canonical_json`); what `python -m
/// motley_torch.profile` writes as `model_hash`.
pub fn model_hash(spec: &ModelSpec) -> String {
    let text = canonical_json(spec);
    Sha256::digest(text.as_bytes()).iter().map(|b| format!("{b:02x}")).collect()
}

/// The model file the profiler is given: the whole spec, defaults filled in (the profiler
/// builds the family's layer from it).
pub fn profiler_model_json(spec: &ModelSpec) -> String {
    ascii(serde_json::to_string(&spec.resolved()).expect("a model spec serialises"))
}

/// What the hash covers, keys sorted, no spaces, non-ASCII escaped: the nine fields a gpt model
/// has always had (defaults filled in), so existing gpt profiles keep their hash, plus for the
/// llama family `family` and `qkv_bias`, and `o_bias` when true (so a model without one keeps
/// its hash). No floats (Python and Rust print them differently). The rank library's
/// `motley_torch.tools.profile.canonical_spec` is the same.
pub fn canonical_json(spec: &ModelSpec) -> String {
    let mut m: BTreeMap<&str, serde_json::Value> = BTreeMap::new();
    m.insert("name", spec.name.clone().into());
    m.insert("layers", spec.layers.into());
    m.insert("hidden", spec.hidden.into());
    m.insert("heads", spec.heads.into());
    m.insert("seq_len", spec.seq_len.into());
    m.insert("vocab", spec.vocab.into());
    m.insert("ffn_hidden", spec.ffn_hidden.unwrap_or(4 * spec.hidden).into());
    m.insert("kv_heads", spec.kv_heads.unwrap_or(spec.heads).into());
    m.insert("gated_mlp", spec.gated_mlp.into());
    if spec.family == motley_solver::model::Family::Llama {
        m.insert("family", "llama".into());
        m.insert("qkv_bias", spec.qkv_bias.into());
        if spec.o_bias {
            m.insert("o_bias", true.into());
        }
    }
    ascii(serde_json::to_string(&m).expect("a map of plain values serialises"))
}

/// Python's json.dumps escapes non-ASCII (ensure_ascii): so must we, or the hashes differ.
fn ascii(text: String) -> String {
    text.chars().fold(String::with_capacity(text.len()), |mut out, c| {
        if c.is_ascii() {
            out.push(c);
        } else {
            let mut units = [0u16; 2];
            for u in c.encode_utf16(&mut units) {
                out.push_str(&format!("\\u{u:04x}"));
            }
        }
        out
    })
}

/// What a profile measures: the model (by hash), the sequence length and data type, and the
/// GPU type, tp and micro-batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProfileKey {
    pub gpu: String,
    pub model_hash: String,
    pub tp: u32,
    pub micro_batch: u32,
    pub seq_len: u64,
    pub dtype: String,
}

impl std::fmt::Display for ProfileKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} tp {} micro-batch {} (seq {}, {})", self.gpu, self.tp, self.micro_batch, self.seq_len, self.dtype)
    }
}

pub use crate::store::{ProfileRun, RunState};

/// How long a run may take, and a failure is remembered.
pub fn run_limit(fleet: &Fleet) -> Duration {
    fleet.base * PROFILE_INTERVALS
}

impl ProfileKey {
    fn as_run_key(&self) -> RunKey<'_> {
        RunKey {
            gpu: &self.gpu,
            model_hash: &self.model_hash,
            tp: self.tp,
            micro_batch: self.micro_batch,
            seq_len: self.seq_len,
            dtype: &self.dtype,
        }
    }
}

/// Ask a node's agent to measure `key` on `gpus`: the run, recorded (durably) before it is sent.
pub async fn send_run(
    store: &Store,
    fleet: &Fleet,
    node: &str,
    gpus: Vec<u32>,
    model: &ModelSpec,
    key: &ProfileKey,
    gpu_name: &str,
) -> Result<ProfileRun> {
    if !fleet.can_profile(node) {
        return Err(CoordinatorError::Conflict(format!(
            "node {node} has no live agent that can profile (start its agent with --python, a Python with motley_torch and torch)"
        )));
    }
    let limit = run_limit(fleet);
    let timeout_s = (limit.as_secs().saturating_sub(fleet.base.as_secs() * 10)).clamp(1, u32::MAX as u64) as u32;
    let run_key = RunKey { gpu: gpu_name, ..key.as_run_key() };
    let run = store.start_profile_run(&run_key, &model.name, node, &gpus).await?;
    let profile = Profile {
        request: run.request,
        gpu: gpu_name.to_string(),
        model_json: profiler_model_json(model),
        tp: key.tp,
        micro_batch: key.micro_batch,
        seq_len: key.seq_len,
        dtype: key.dtype.clone(),
        gpus,
        timeout_s,
    };
    if !fleet.send(node, Instruction { kind: Some(instruction::Kind::Profile(profile)) }) {
        let failed = RunState::Failed { reason: format!("node {node}'s agent has no open heartbeat stream") };
        return Ok(store.finish_profile_run(run.request, &failed).await?.unwrap_or(run));
    }
    Ok(run)
}

/// Every run kept, newest first (runs out too long fail first; old ended ones are forgotten).
pub async fn runs(store: &Store, fleet: &Fleet) -> Result<Vec<ProfileRun>> {
    store.expire_profile_runs(run_limit(fleet).as_millis() as i64).await?;
    store.profile_runs().await
}

/// One run kept.
pub async fn run(store: &Store, fleet: &Fleet, request: i64) -> Result<Option<ProfileRun>> {
    store.expire_profile_runs(run_limit(fleet).as_millis() as i64).await?;
    store.profile_run(request).await
}

/// The GPUs of the runs going on now (no job may be placed on them meanwhile).
pub async fn gpus_in_use(store: &Store) -> Result<Vec<(String, u32)>> {
    Ok(store.running_profile_runs().await?.into_iter().flat_map(|r| r.gpus.into_iter().map(move |g| (r.node.clone(), g))).collect())
}

/// The most sequences per GPU a profile run measures when the job leaves the micro-batch to
/// the planner (`wanted_configs`).
pub const PROFILED_MAX_SEQUENCES: u32 = 8;

/// What the planner may use for a job, or why it waits.
#[derive(Debug)]
pub enum Prepared {
    /// The stored profiles of the job's model (possibly none), and the keys it is planned
    /// without (by the roofline) with why.
    Ready { profiles: ProfileSet, without: Vec<(ProfileKey, String)> },
    /// Runs are out for these keys.
    Waiting(String),
}

/// The (tp, sequences per GPU) pairs the planner's search prices for one GPU type with up to
/// `gpus_per_node` GPUs a node: its (tp, micro-batch) space (`motley_solver`'s own), each
/// micro-batch split over a stage's dp of 1, 2, 4 or 8 GPUs (a profile's `micro_batch` is
/// sequences per GPU). Unless the job pins its micro-batch, at most `PROFILED_MAX_SEQUENCES`
/// per GPU are measured: the larger sizes the search tries are priced from the largest
/// measured, scaled linearly (`ProfileSet::lookup_scaled`), so a profile never prices more
/// sequences cheaper per sequence than it measured, and the runs stay short.
pub fn wanted_configs(model: &Model, opts: &PlanOptions, mode: SearchMode, gpus_per_node: u32) -> Vec<(u32, u32)> {
    let space = motley_solver::search::tp_micro_batch_space(model.spec.heads, gpus_per_node, opts, mode);
    let most = if opts.micro_batch.is_some() { u32::MAX } else { PROFILED_MAX_SEQUENCES };
    let mut out: Vec<(u32, u32)> = space
        .iter()
        .flat_map(|&(t, b)| [1u32, 2, 4, 8].into_iter().filter(move |&d| b.is_multiple_of(d)).map(move |d| (t, b / d)))
        .filter(|&(_, per_gpu)| per_gpu <= most)
        .collect();
    out.sort_unstable();
    out.dedup();
    out
}

/// The stored profiles of the job's model and, unless the job says `off`, runs sent for what
/// is missing on the GPUs offered (`offered`: node entry and its free GPU indices).
pub async fn prepare(store: &Store, fleet: &Fleet, job: i64, spec: &JobSpec, offered: &[(NodeSpec, Vec<u32>)]) -> Result<Prepared> {
    let profiling = spec.profiling();
    if profiling.mode == ProfilingMode::Off {
        return Ok(Prepared::Ready { profiles: ProfileSet::default(), without: vec![] });
    }
    let model = spec.model()?;
    let (opts, mode) = spec.plan_options()?;
    let hash = model_hash(&model.spec);
    let dtype = profiling.dtype().to_string();
    let stored = store.profiles_for(&hash, model.seq_len as i64, &dtype).await?;
    let profiles = profile_set(&stored);
    // A carried plan is priced with what is stored; nothing is measured for it.
    if spec.plan.is_some() {
        return Ok(Prepared::Ready { profiles, without: vec![] });
    }
    let mut per_type: BTreeMap<String, (String, u32)> = BTreeMap::new();
    for (node, _) in offered {
        let e = per_type.entry(node.gpu.to_ascii_lowercase()).or_insert((node.gpu.clone(), 0));
        e.1 = e.1.max(node.gpus);
    }
    let (mut out, mut without, mut sent) = (vec![], vec![], vec![]);
    store.expire_profile_runs(run_limit(fleet).as_millis() as i64).await?;
    let running = store.running_profile_runs().await?;
    let busy = |node: &str| running.iter().any(|r| r.node == node);
    for (gpu_name, per_node) in per_type.values() {
        for (tp, micro_batch) in wanted_configs(&model, &opts, mode, *per_node) {
            if profiles.lookup(gpu_name, tp, micro_batch).is_some() {
                continue;
            }
            let key = ProfileKey {
                gpu: gpu_name.clone(),
                model_hash: hash.clone(),
                tp,
                micro_batch,
                seq_len: model.seq_len,
                dtype: dtype.clone(),
            };
            match store.latest_profile_run(&key.as_run_key()).await?.map(|r| (r.state.clone(), r)) {
                Some((RunState::Running, r)) => out.push(format!("{key} on node {} (request {})", r.node, r.request)),
                Some((RunState::Failed { reason }, _)) => without.push((key, reason)),
                // Stored since this pass read the store: the next pass plans with it.
                Some((RunState::Stored { .. }, _)) => out.push(format!("{key} (just stored)")),
                None => {
                    let node = offered.iter().find(|(n, free)| {
                        n.gpu.eq_ignore_ascii_case(gpu_name) && free.len() >= tp as usize && fleet.can_profile(&n.name) && !busy(&n.name)
                    });
                    match node {
                        Some((n, free)) => {
                            let gpus = free[..tp as usize].to_vec();
                            let run = send_run(store, fleet, &n.name, gpus, &model.spec, &key, gpu_name).await?;
                            sent.push(format!("{key} on node {} (request {})", n.name, run.request));
                            out.push(format!("{key} on node {}", n.name));
                        }
                        None if offered.iter().any(|(n, free)| {
                            n.gpu.eq_ignore_ascii_case(gpu_name) && free.len() >= tp as usize && fleet.can_profile(&n.name)
                        }) =>
                        {
                            out.push(format!("{key} (its nodes are busy profiling)"));
                        }
                        None => {
                            let why = if offered.iter().any(|(n, _)| n.gpu.eq_ignore_ascii_case(gpu_name) && fleet.can_profile(&n.name)) {
                                format!("no {gpu_name} node whose agent can profile has {tp} free GPUs")
                            } else {
                                format!("no live agent of the {gpu_name} nodes can profile (start agents with --python)")
                            };
                            without.push((key, why))
                        }
                    }
                }
            }
        }
    }
    for s in &sent {
        store.record_event(Some(job), None, "profiling", &format!("measuring {s}")).await?;
    }
    if !out.is_empty() {
        return Ok(Prepared::Waiting(format!("waiting for {} layer profile(s): {}", out.len(), out.join("; "))));
    }
    if profiling.mode == ProfilingMode::Only && !without.is_empty() {
        let why: Vec<String> = without.iter().map(|(k, r)| format!("{k}: {r}")).collect();
        return Err(CoordinatorError::invalid(
            "profiling.mode",
            format!(
                "is only, but no profile can be had for {}; fix that or use mode auto (the roofline for what is missing)",
                why.join("; ")
            ),
        ));
    }
    Ok(Prepared::Ready { profiles, without })
}

/// The `profiling` event of a job priced (in part) by the roofline: one clause per GPU type and
/// reason, its configurations counted, not one per configuration (a job on a cluster without
/// profiling agents would otherwise open with a paragraph).
pub fn roofline_summary(without: &[(ProfileKey, String)]) -> String {
    let mut groups: Vec<((&str, &str), Vec<&ProfileKey>)> = vec![];
    for (key, why) in without {
        let at = (key.gpu.as_str(), why.as_str());
        match groups.iter_mut().find(|(g, _)| *g == at) {
            Some((_, keys)) => keys.push(key),
            None => groups.push((at, vec![key])),
        }
    }
    let clauses: Vec<String> = groups
        .iter()
        .map(|((gpu, why), keys)| {
            let mut tps: Vec<u32> = keys.iter().map(|k| k.tp).collect();
            tps.sort_unstable();
            tps.dedup();
            let tps: Vec<String> = tps.iter().map(u32::to_string).collect();
            let (low, high) = keys.iter().fold((u32::MAX, 0), |(l, h), k| (l.min(k.micro_batch), h.max(k.micro_batch)));
            let batches = if low == high { low.to_string() } else { format!("{low}-{high}") };
            let n = keys.len();
            let configs = if n == 1 { "1 configuration".to_string() } else { format!("{n} configurations") };
            format!("{gpu} ({configs}: tp {}, micro-batch {batches}): {why}", tps.join(", "))
        })
        .collect();
    let (seq, dtype) = without.first().map_or((0, ""), |(k, _)| (k.seq_len, k.dtype.as_str()));
    format!("priced by the roofline, not measured (seq {seq}, {dtype}): {}", clauses.join("; "))
}

/// The stored profiles a job is planned with, measuring nothing (dry runs).
pub async fn stored_for(store: &Store, spec: &JobSpec) -> Result<ProfileSet> {
    let profiling = spec.profiling();
    if profiling.mode == ProfilingMode::Off {
        return Ok(ProfileSet::default());
    }
    let model = spec.model()?;
    Ok(profile_set(&store.profiles_for(&model_hash(&model.spec), model.seq_len as i64, profiling.dtype()).await?))
}

/// The profiles file entries of stored rows (rows whose entry does not read are skipped).
pub fn profile_set(rows: &[ProfileRecord]) -> ProfileSet {
    let profiles = rows
        .iter()
        .filter_map(|r| match serde_json::from_str::<LayerProfile>(&r.profile.entry) {
            Ok(p) => Some(p),
            Err(e) => {
                tracing::warn!(profile = r.id, "stored profile entry does not read ({e}); planning without it");
                None
            }
        })
        .collect();
    ProfileSet { profiles }
}

/// `profiling.mode: only`: every stage of the plan is priced from a measured profile.
pub fn check_measured(report: &motley_solver::PlanDocument, nodes: &[NodeSpec], profiles: &ProfileSet) -> Result<()> {
    let gpu_of: HashMap<&str, &str> = nodes.iter().map(|n| (n.name.as_str(), n.gpu.as_str())).collect();
    let mut missing = BTreeSet::new();
    for st in report.replicas.iter().flat_map(|r| &r.stages) {
        // A profile's micro-batch is sequences per GPU: the stage's dp GPUs split one.
        let per_gpu = report.micro_batch / st.dp.max(1);
        for g in &st.gpus {
            let gpu = gpu_of.get(g.node.as_str()).copied().unwrap_or("?");
            // Sizes above what a run measures are priced from the largest it does
            // (`wanted_configs`): that one is the measurement the plan stands on.
            let measured = per_gpu.min(PROFILED_MAX_SEQUENCES);
            if profiles.lookup(gpu, st.tp, measured).is_none() {
                missing.insert(format!("{gpu} tp {} micro-batch {measured}", st.tp));
            }
        }
    }
    if missing.is_empty() {
        return Ok(());
    }
    Err(CoordinatorError::invalid(
        "profiling.mode",
        format!("is only, but the plan prices {} without a measured profile", missing.into_iter().collect::<Vec<_>>().join(", ")),
    ))
}

/// A finished run an agent reported: stored (replacing the same key's row) or recorded as
/// failed. The node's GPU type must be the entry's; a run this leader sent must come back for
/// its own model hash.
pub async fn receive(
    store: &Store,
    signals: &crate::state::signals::JobSignals,
    node: &str,
    request: i64,
    entry_json: &str,
    error: &str,
) -> Result<()> {
    let sent = store.profile_run(request).await?;
    let outcome = match error.is_empty() {
        false => Err(error.to_string()),
        true => checked_entry(store, node, entry_json, sent.as_ref()).await,
    };
    let state = match outcome {
        Ok(new) => {
            let id = store.put_profile(&new).await?;
            tracing::info!(node, request, profile = id, "profile stored: {} tp {} micro-batch {}", new.gpu, new.tp, new.micro_batch);
            RunState::Stored { profile: id }
        }
        Err(reason) => {
            tracing::warn!(node, request, "profile run failed: {reason}");
            store.record_event(None, None, "profile_failed", &format!("profile request {request} on node {node} failed: {reason}")).await?;
            RunState::Failed { reason }
        }
    };
    store.finish_profile_run(request, &state).await?;
    signals.kick_queue();
    Ok(())
}

async fn checked_entry(store: &Store, node: &str, entry_json: &str, sent: Option<&ProfileRun>) -> std::result::Result<NewProfile, String> {
    let entry: LayerProfile = serde_json::from_str(entry_json).map_err(|e| format!("the agent's profile entry does not read: {e}"))?;
    ProfileSet { profiles: vec![entry.clone()] }.validate().map_err(|e| format!("the agent's profile entry: {e}"))?;
    let node_gpu = store
        .node(node)
        .await
        .ok()
        .and_then(|n| serde_json::from_str::<NodeSpec>(&n.inventory).ok())
        .map(|n| n.gpu)
        .ok_or_else(|| format!("node {node} is not in the inventory"))?;
    if !entry.gpu.eq_ignore_ascii_case(&node_gpu) {
        return Err(format!("the entry is for GPU type {} but node {node} has {node_gpu}", entry.gpu));
    }
    let need = |v: Option<String>, what: &str| v.filter(|s| !s.is_empty()).ok_or_else(|| format!("the entry has no {what}"));
    let model_hash = need(entry.model_hash.clone(), "model_hash")?;
    if let Some(run) = sent {
        if run.model_hash != model_hash {
            return Err(format!(
                "the entry's model_hash {model_hash} is not the model's {} (are the node's motley_torch and this coordinator of one release?)",
                run.model_hash
            ));
        }
        if run.tp != entry.tp || run.micro_batch != entry.micro_batch {
            return Err(format!(
                "the entry measures tp {} micro-batch {}, not the tp {} micro-batch {} asked for",
                entry.tp, entry.micro_batch, run.tp, run.micro_batch
            ));
        }
    }
    let seq_len = entry.seq_len.ok_or("the entry has no seq_len")?;
    Ok(NewProfile {
        gpu: node_gpu,
        model: entry.model.clone().unwrap_or_default(),
        model_hash,
        tp: entry.tp as i64,
        micro_batch: entry.micro_batch as i64,
        seq_len: seq_len as i64,
        dtype: need(entry.dtype.clone(), "dtype")?,
        torch: need(entry.torch.clone(), "torch version")?,
        device: entry.device.clone().unwrap_or_default(),
        node: node.to_string(),
        entry: entry_json.to_string(),
    })
}

/// `motley profile run`: measure one key on a node of the GPU type (the given one, or any live
/// agent that can profile), now, whatever is stored.
pub async fn run_now(store: &Store, fleet: &Fleet, req: &RunRequest) -> Result<ProfileRun> {
    let model_ref: crate::job::spec::ModelRef = serde_json::from_value(req.model.clone())
        .map_err(|e| CoordinatorError::invalid("model", format!("{e}; give a catalog name or a model entry")))?;
    let model = crate::job::spec::resolve_model(&model_ref, req.seq_len, "seq_len")?;
    let dtype = req.dtype.clone().unwrap_or_else(|| "fp32".into());
    if !crate::job::spec::PROFILE_DTYPES.contains(&dtype.as_str()) {
        return Err(CoordinatorError::invalid("dtype", format!("use one of {}", crate::job::spec::PROFILE_DTYPES.join(", "))));
    }
    if req.tp == 0 || !req.tp.is_power_of_two() {
        return Err(CoordinatorError::invalid("tp", "must be a power of two (1, 2, 4, 8)"));
    }
    if req.micro_batch == 0 || req.micro_batch > motley_solver::limits::MAX_MICRO_BATCH {
        return Err(CoordinatorError::invalid("micro_batch", format!("must be between 1 and {}", motley_solver::limits::MAX_MICRO_BATCH)));
    }
    // GPUs ranks hold (launched jobs' and any still running) are not profiled on.
    let mut held: Vec<(String, u32)> = store.held_gpus().await?.into_iter().map(|h| (h.node, h.gpu as u32)).collect();
    let running = store.running_profile_runs().await?;
    held.extend(running.iter().flat_map(|r| r.gpus.iter().map(|g| (r.node.clone(), *g))));
    let mut candidates = vec![];
    for n in store.nodes().await? {
        if req.node.as_ref().is_some_and(|want| *want != n.name) {
            continue;
        }
        let Ok(entry) = serde_json::from_str::<NodeSpec>(&n.inventory) else { continue };
        if req.gpu.as_ref().is_some_and(|g| !g.eq_ignore_ascii_case(&entry.gpu)) || entry.gpus < req.tp {
            continue;
        }
        let free: Vec<u32> = (0..entry.gpus).filter(|g| !held.iter().any(|(node, h)| *node == entry.name && h == g)).collect();
        candidates.push((entry, free));
    }
    let what = match (&req.node, &req.gpu) {
        (Some(n), _) => format!("node {n}"),
        (None, Some(g)) => format!("a {g} node"),
        (None, None) => "a node".into(),
    };
    let ready = |(e, free): &&(NodeSpec, Vec<u32>)| {
        fleet.can_profile(&e.name) && !running.iter().any(|r| r.node == e.name) && free.len() >= req.tp as usize
    };
    let Some((entry, free)) = candidates.iter().find(ready) else {
        let why = if candidates.is_empty() {
            format!("no {what} with {} GPUs is in the inventory (motley node list)", req.tp)
        } else if candidates.iter().any(|(e, _)| fleet.can_profile(&e.name)) {
            format!(
                "every {what} that can profile is running a profile, or ranks hold its GPUs; try again when they end (motley profile runs)"
            )
        } else {
            format!("no {what} has a live agent that can profile (start its agent with --python, a Python with motley_torch and torch)")
        };
        return Err(CoordinatorError::Conflict(why));
    };
    let key = ProfileKey {
        gpu: entry.gpu.clone(),
        model_hash: model_hash(&model.spec),
        tp: req.tp,
        micro_batch: req.micro_batch,
        seq_len: model.seq_len,
        dtype,
    };
    send_run(store, fleet, &entry.name, free[..req.tp as usize].to_vec(), &model.spec, &key, &entry.gpu).await
}

/// A request to measure one profile now (REST `POST /api/v1/profiles/runs`).
#[derive(Debug, Clone, serde::Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RunRequest {
    /// A catalog model name or a model entry {name, layers, hidden, ...}.
    #[schema(value_type = Object)]
    pub model: serde_json::Value,
    pub tp: u32,
    pub micro_batch: u32,
    #[serde(default)]
    pub seq_len: Option<u64>,
    #[serde(default)]
    pub dtype: Option<String>,
    /// Only a node of this GPU type (default: any).
    #[serde(default)]
    pub gpu: Option<String>,
    /// Only this node (default: any that can profile).
    #[serde(default)]
    pub node: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_model_hash_is_motley_torch_s() {
        // python -c 'import hashlib, json; print(hashlib.sha256(json.dumps({...}, sort_keys=True,
        // separators=(",", ":")).encode()).hexdigest())' for examples/tiny-gpt.yaml's fields.
        let spec = ModelSpec::gpt("tiny-gpt", 4, 256, 4, 128, 1024);
        assert_eq!(
            canonical_json(&spec),
            r#"{"ffn_hidden":1024,"gated_mlp":false,"heads":4,"hidden":256,"kv_heads":4,"layers":4,"name":"tiny-gpt","seq_len":128,"vocab":1024}"#
        );
        let mut odd = spec.clone();
        odd.name = "gpt-é".into();
        assert!(canonical_json(&odd).contains(r#""name":"gpt-\u00e9""#), "{}", canonical_json(&odd));
        // Pinned before the spec had a family: existing gpt profiles keep their hash, whatever
        // the new fields (none of them is hashed for gpt).
        let pinned = "f9e16a5dc36c80a68646f56726f51e41a4d2b21875fd9ea1f5b324cb4ce0006c";
        assert_eq!(model_hash(&spec), pinned);
        assert_eq!(model_hash(&ModelSpec { norm_eps: 1e-6, tie_embeddings: true, ..spec.clone() }), pinned);
    }

    #[test]
    fn a_llama_hash_covers_family_and_qkv_bias_and_the_profiler_gets_the_whole_spec() {
        let llama = motley_solver::model::model_by_name("llama3-8b").unwrap();
        assert_eq!(
            canonical_json(&llama),
            r#"{"family":"llama","ffn_hidden":14336,"gated_mlp":true,"heads":32,"hidden":4096,"kv_heads":8,"layers":32,"name":"llama3-8b","qkv_bias":false,"seq_len":8192,"vocab":128256}"#
        );
        // python: sha256 of json.dumps of the dict above, sort_keys, separators (",", ":").
        assert_eq!(model_hash(&llama), "8b396086592d24194f0cf4acb2e7892e4af268fc0e90389b534c47d428284bce");
        assert_ne!(model_hash(&llama), model_hash(&ModelSpec { qkv_bias: true, ..llama.clone() }));
        // o_bias is hashed only when true (every earlier llama keeps its hash above); pinned to
        // python's hash of the same dict (motley_torch.tools.profile.model_hash).
        let biased = ModelSpec { qkv_bias: true, o_bias: true, ..llama.clone() };
        assert_eq!(
            canonical_json(&biased),
            r#"{"family":"llama","ffn_hidden":14336,"gated_mlp":true,"heads":32,"hidden":4096,"kv_heads":8,"layers":32,"name":"llama3-8b","o_bias":true,"qkv_bias":true,"seq_len":8192,"vocab":128256}"#
        );
        assert_eq!(model_hash(&biased), "24d65f4561181c2b79c6e2865b34d4b5e86c87c752e6038ae41e39d205577153");
        let file: serde_json::Value = serde_json::from_str(&profiler_model_json(&llama)).unwrap();
        assert_eq!(
            (file["family"].as_str(), file["rope_theta"].as_f64(), file["norm_eps"].as_f64()),
            (Some("llama"), Some(5e5), Some(1e-5))
        );
        assert_eq!((file["kv_heads"].as_u64(), file["tie_embeddings"].as_bool()), (Some(8), Some(false)));
        assert!(file["rope_scaling"].is_null() && file["sliding_window"].is_null(), "{file}");
        let back: ModelSpec = serde_json::from_value(file).unwrap();
        assert_eq!(back, llama.resolved(), "the file is a model file the planner reads back");
        let gpt: serde_json::Value = serde_json::from_str(&profiler_model_json(&ModelSpec::gpt("g", 4, 256, 4, 128, 1024))).unwrap();
        assert_eq!((gpt["family"].as_str(), gpt["ffn_hidden"].as_u64()), (Some("gpt"), Some(1024)));
    }

    #[test]
    fn the_roofline_event_is_one_clause_per_gpu_type_and_reason() {
        let key = |gpu: &str, tp, micro_batch| ProfileKey {
            gpu: gpu.into(),
            model_hash: "h".into(),
            tp,
            micro_batch,
            seq_len: 2048,
            dtype: "fp32".into(),
        };
        let none = |gpu: &str| format!("no live agent of the {gpu} nodes can profile (start agents with --python)");
        let mut without = vec![];
        for tp in [1, 2, 4, 8] {
            for mb in [1, 2, 4, 8, 16, 32, 64] {
                without.push((key("A100-80G", tp, mb), none("A100-80G")));
                without.push((key("V100-32G", tp, mb), none("V100-32G")));
            }
        }
        without.push((key("H800", 8, 1), "no H800 node whose agent can profile has 8 free GPUs".into()));
        let text = roofline_summary(&without);
        assert_eq!(
            text,
            "priced by the roofline, not measured (seq 2048, fp32): \
             A100-80G (28 configurations: tp 1, 2, 4, 8, micro-batch 1-64): no live agent of the A100-80G nodes can profile (start agents with --python); \
             V100-32G (28 configurations: tp 1, 2, 4, 8, micro-batch 1-64): no live agent of the V100-32G nodes can profile (start agents with --python); \
             H800 (1 configuration: tp 8, micro-batch 1): no H800 node whose agent can profile has 8 free GPUs"
        );
        assert_eq!(text.matches("can profile").count(), 3, "said once per GPU type, not per configuration");
    }

    #[test]
    fn the_search_space_is_what_gets_measured() {
        let model = Model::new(motley_solver::model::model_by_name("gpt3-1.3b").unwrap(), None).unwrap();
        let opts = PlanOptions { global_batch: 4, ..PlanOptions::default() };
        assert_eq!(wanted_configs(&model, &opts, SearchMode::Exact, 2), vec![(1, 1), (1, 2), (1, 4), (2, 1), (2, 2), (2, 4)]);
        // A pinned micro-batch of 4 is 4, 2 or 1 sequences per GPU (dp 1, 2, 4 in a stage).
        let pinned = PlanOptions { tp: Some(2), micro_batch: Some(4), ..opts.clone() };
        assert_eq!(wanted_configs(&model, &pinned, SearchMode::Exact, 8), vec![(2, 1), (2, 2), (2, 4)]);
        // The search tries micro-batches up to 32; a run measures up to 8 sequences a GPU, the
        // rest priced from those. A pinned 16 is measured as pinned (16 to 2 a GPU at dp 1 to 8).
        let large = PlanOptions { global_batch: 64, ..opts };
        let sizes: Vec<u32> = wanted_configs(&model, &large, SearchMode::Exact, 1).into_iter().map(|(_, b)| b).collect();
        assert_eq!(sizes, vec![1, 2, 4, 8]);
        let pinned = PlanOptions { micro_batch: Some(16), ..large };
        assert_eq!(wanted_configs(&model, &pinned, SearchMode::Exact, 1), vec![(1, 2), (1, 4), (1, 8), (1, 16)]);
    }

    #[test]
    fn a_plan_at_more_sequences_than_a_run_measures_stands_on_the_largest_measured() {
        use motley_solver::{plan, Cluster, ClusterSpec, PlanRequest};
        let spec: ClusterSpec = serde_norway::from_str("name: one\nnodes:\n  - {name: g, gpu: H100, gpus: 1}\n").unwrap();
        let cluster = Cluster::from_spec(&spec).unwrap();
        let model = Model::new(motley_solver::model::model_by_name("gpt3-1.3b").unwrap(), None).unwrap();
        let opts = PlanOptions { global_batch: 16, ..PlanOptions::default() };
        // What `profiling.mode: only` has measured: up to 8 sequences a GPU, as `wanted_configs` asks.
        let runs = |sizes: &[u32]| ProfileSet {
            profiles: sizes.iter().map(|&b| LayerProfile::per_layer("H100", 1, b, 0.5 * f64::from(b), f64::from(b), Some(1.0))).collect(),
        };
        let measured = runs(&[1, 2, 4, 8]);
        let request = PlanRequest {
            cluster: &cluster,
            model: &model,
            profiles: &measured,
            opts: &opts,
            mode: SearchMode::Exact,
            exhaustive: false,
            seeds: vec![],
        };
        let doc = plan(&request).unwrap();
        assert_eq!(doc.micro_batch, 16, "16 priced from 8 ties with 2 x 8: the larger is kept");
        check_measured(&doc, &spec.nodes, &measured).unwrap();
        let e = check_measured(&doc, &spec.nodes, &runs(&[1, 2, 4])).unwrap_err().to_string();
        assert!(e.contains("profiling.mode") && e.contains("H100 tp 1 micro-batch 8"), "{e}");
    }
}
