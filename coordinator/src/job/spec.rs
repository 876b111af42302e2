//! The job file (YAML, shaped like a SkyPilot task) and its validation.
//!
//! ```yaml
//! name: hello
//! model: gpt3-1.3b            # a catalog name, a model entry {name, layers, hidden, ...} or a
//!                             # Hugging Face model directory
//! global_batch: 16
//! seq_len: 2048               # tokens per sequence (optional; default: the model's seq_len, for
//!                             # a Hugging Face model the smaller of max_position_embeddings and 4096)
//! resources:
//!   gpus: 8                   # at most this many GPUs (optional)
//!   nodes: [a100-0, a100-1]   # only these nodes (optional)
//! run: python train.py        # started once per rank
//! envs: {DATA: /data/c4}
//! max_restarts: 0             # relaunches after a rank fails (from the newest checkpoint)
//! max_preemptions: 0          # recoveries after a node is lost or drained (needs `checkpoint`)
//! user: alice                 # the ranks run as this user where the agent runs as root (optional)
//! plan_options:               # the `motley plan` flags a job may pin (all optional)
//!   tp: 2                     # only this tensor-parallel degree
//!   max_stages: 4             # longest pipeline
//!   micro_batch: 2            # sequences per micro-batch
//!   seq_len: 2048             # as the top-level seq_len (either one; if both, they agree)
//!   search: exact             # auto | exact | fast
//!   recompute: true           # full activation recomputation
//!   zero1: false              # shard optimizer states over a stage's data-parallel GPUs
//!   reserve_gib: 1.5          # GiB kept free on every GPU
//!   efficiency: 0.5           # roofline: fraction of peak a layer reaches
//!   host_layer_ms: 0.7        # roofline: the host's launch of a layer's forward per micro-batch (0: none)
//!   p2p_blocking: false       # pipeline sends block the stage (Megatron-LM's 1F1B)
//!   precision: auto           # auto | bf16 | fp16 | fp32 (auto: bf16 where every GPU has bf16 tensor cores)
//! checkpoint:                 # checkpoints (optional; docs/checkpoint.md)
//!   every: 100                # ranks save every 100 steps (MOTLEY_CKPT_EVERY) into MOTLEY_CKPT_DIR
//!   keep: 2                   # complete steps each agent keeps on local disk (MOTLEY_CKPT_KEEP)
//!   cloud: file:///ckpt       # object store the agents upload to (MOTLEY_CKPT_CLOUD; s3:// gs:// az://)
//! profiling:                  # measured layer profiles (optional)
//!   mode: auto                # auto: measure what is missing where agents can, else roofline
//!                             # only: plan from measured profiles only (wait; fail if one cannot be had)
//!                             # off: roofline only
//!   dtype: fp32               # what the profiler measures in: fp32 | bf16 | fp16
//! steps: 100000               # training steps in all (optional): the work left a re-plan weighs
//! replan:                     # re-plan when links change (optional; `off` never; docs/network.md)
//!   threshold: 0.3            # a link more than 30% away from what the plan assumed ...
//!   hold: 60s                 # ... for longer than this has changed
//!   horizon: 1h               # without `steps`: the work left a switch must pay for itself within
//!   cooldown: 10m             # no second switch within this of the last
//! ```
//!
//! Limits (a rank gets `run` as one argument and each env value as one string, and Linux
//! refuses any single one over 128 KiB, so a bigger one would make every rank fail with 127):
//! `name` at most 253 characters, `run` at most 64 KiB, each env value at most 32 KiB, all
//! envs together at most 256 KiB, at most 256 env variables, `resources.nodes` at most 16,384
//! names. No control characters in `name` (tables print it).

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

use crate::error::{CoordinatorError, Result};
use motley_solver::PlanDocument;
use motley_solver::{Model, ModelSpec, PlanOptions, PrecisionChoice, SearchMode};

mod replan;
pub use replan::{ReplanPolicy, ReplanSettings, ReplanSpec};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum ModelRef {
    Name(String),
    Spec(ModelSpec),
}

#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Resources {
    #[serde(default)]
    pub gpus: Option<u32>,
    #[serde(default)]
    pub nodes: Vec<String>,
}

/// How hard the planner searches (`motley plan --search`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Search {
    Auto,
    Exact,
    Fast,
}

/// The `motley plan` flags that make sense for a job, pinned by its author; what is absent is
/// the planner's default.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PlanOptionsSpec {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tp: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_stages: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub micro_batch: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seq_len: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub search: Option<Search>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recompute: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub zero1: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reserve_gib: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub efficiency: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_layer_ms: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub p2p_blocking: Option<bool>,
    /// auto (the default), fp16, bf16 or fp32, as `motley plan --precision`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub precision: Option<PrecisionChoice>,
}

/// The job's checkpoints (`checkpoint:`): how often ranks save, how many complete steps agents
/// keep on disk (default 2), and the object store they upload every step to (optional).
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CheckpointSpec {
    /// Save every this many steps.
    pub every: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub keep: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cloud: Option<String>,
}

/// Whether the job is planned from measured layer profiles (`profiling.mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ProfilingMode {
    /// Stored profiles where they exist; missing ones measured by agents that can; the roofline
    /// for what no agent can measure (or whose run failed).
    #[default]
    Auto,
    /// Only measured profiles: the job waits for them and fails if one cannot be had.
    Only,
    /// The roofline only (no stored profile is used, none measured).
    Off,
}

/// The data types the profiler measures in (`python -m motley_torch.profile --dtype`).
pub const PROFILE_DTYPES: [&str; 3] = ["fp32", "bf16", "fp16"];

#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProfilingSpec {
    #[serde(default)]
    pub mode: ProfilingMode,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dtype: Option<String>,
}

impl ProfilingSpec {
    pub fn dtype(&self) -> &str {
        self.dtype.as_deref().unwrap_or("fp32")
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JobSpec {
    pub name: String,
    pub model: ModelRef,
    pub global_batch: u32,
    /// Tokens per sequence the job trains at (absent: `plan_options.seq_len`, a carried plan's
    /// `seq_len`, else the model's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seq_len: Option<u64>,
    #[serde(default)]
    pub resources: Resources,
    pub run: String,
    #[serde(default)]
    pub envs: BTreeMap<String, String>,
    #[serde(default)]
    pub max_restarts: u32,
    #[serde(default)]
    pub max_preemptions: u32,
    /// How long planning this job may take (default: the coordinator's `--plan-timeout-ms`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub plan_timeout_s: Option<u32>,
    /// The user the ranks run as (a POSIX user name on every node). An agent running as root
    /// refuses a job without one unless its operator allows root ranks; an agent running as
    /// another user refuses any other name (it cannot switch users).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
    /// Planner options the job pins (`motley plan`'s flags).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub plan_options: Option<PlanOptionsSpec>,
    /// A whole plan to run as given (`motley plan -o json`'s document, or its `global_batch`,
    /// `micro_batch` and `replicas` with their stages and GPUs): checked against the live
    /// inventory and the model when the job is planned, never re-planned.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub plan: Option<PlanDocument>,
    /// Measured layer profiles: whether to use and measure them (default `auto`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub profiling: Option<ProfilingSpec>,
    /// Checkpoints: how often ranks save.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoint: Option<CheckpointSpec>,
    /// Training steps in all: the work left that a re-plan's switch is weighed against.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub steps: Option<u64>,
    /// Re-planning when links change (`replan`; absent: on, with the defaults).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replan: Option<ReplanSpec>,
    /// Whether the other replicas keep training when one is lost (docs/keep-going.md; absent:
    /// yes where the plan has two or more replicas and no ZeRO-1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub keep_going: Option<bool>,
}

/// Complete checkpoint steps each agent keeps on disk when the job file does not say.
pub const DEFAULT_KEEP: u32 = 2;

/// An object store URL the agents can upload to: `file:///ABSOLUTE/PATH`, `s3://BUCKET[/PREFIX]`,
/// `gs://BUCKET[/PREFIX]` or `az://CONTAINER[/PREFIX]` (the cloud ones need the agent built with
/// the provider's feature; the agent says which when it is not).
pub fn cloud_url(url: &str) -> std::result::Result<(), String> {
    let fix = "give file:///ABSOLUTE/PATH, s3://BUCKET/PREFIX, gs://BUCKET/PREFIX or az://CONTAINER/PREFIX";
    let Some((scheme, rest)) = url.split_once("://") else { return Err(format!("'{url}' is not a URL; {fix}")) };
    match scheme {
        "file" if rest.starts_with('/') && !rest.split('/').any(|c| c == "..") => Ok(()),
        "file" => Err(format!("'{url}': a file URL needs an absolute path without '..'; {fix}")),
        "s3" | "gs" | "az" if !rest.is_empty() && !rest.starts_with('/') => Ok(()),
        "s3" | "gs" | "az" => Err(format!("'{url}' names no bucket; {fix}")),
        other => Err(format!("scheme '{other}' is not an object store Motley uploads to; {fix}")),
    }
}

/// See the module's doc: the limits a job file is held to.
pub const MAX_NAME: usize = 253;
pub const MAX_RUN_BYTES: usize = 64 * 1024;
pub const MAX_ENV_VALUE_BYTES: usize = 32 * 1024;
pub const MAX_ENVS_BYTES: usize = 256 * 1024;
pub const MAX_ENVS: usize = 256;
pub const MAX_NODES: usize = 16_384;
/// The longest user name accepted (what useradd takes by default).
pub const MAX_USER: usize = 32;

/// A POSIX-ish user name, as useradd takes it: `[a-z_][a-z0-9_-]*[$]?`, at most 32
/// characters. Anything else could never name a user on the nodes (and `-x` would read as
/// an option to the tools an operator checks it with).
fn user_name(name: &str) -> std::result::Result<(), String> {
    let body = name.strip_suffix('$').unwrap_or(name);
    let mut chars = body.chars();
    let first = chars.next().is_some_and(|c| c.is_ascii_lowercase() || c == '_');
    if !first || !chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_' || c == '-') {
        return Err(format!(
            "'{}' is not a user name; use lower-case letters, digits, '_' and '-', starting with a letter or '_' (e.g. alice)",
            name.escape_default()
        ));
    }
    if name.len() > MAX_USER {
        return Err(format!("is {} characters; a user name has at most {MAX_USER}", name.len()));
    }
    Ok(())
}

/// Variables the agent sets for every rank; a job may not override them.
const RESERVED: [&str; 7] = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES"];

impl JobSpec {
    /// Parse and validate a job file; errors name the field and the fix.
    pub fn parse(text: &str) -> Result<JobSpec> {
        let mut spec: JobSpec = parse_yaml(serde_norway::Deserializer::from_str(text), "job file")?;
        // A Hugging Face model directory is read once, here: the job keeps its spec inline.
        if let ModelRef::Name(n) = &spec.model {
            if motley_solver::model::model_by_name(n).is_none() {
                if let Some(hf) = hf_model(n) {
                    spec.model = ModelRef::Spec(hf?);
                }
            }
        }
        spec.validate()?;
        Ok(spec)
    }

    pub fn validate(&self) -> Result<()> {
        self.validate_name()?;
        self.validate_sizes()?;
        self.validate_restarts()?;
        if self.global_batch == 0 {
            return Err(CoordinatorError::invalid("global_batch", "must be at least 1"));
        }
        if self.run.trim().is_empty() {
            return Err(CoordinatorError::invalid("run", "the command each rank runs must not be empty"));
        }
        if let Some(user) = &self.user {
            user_name(user).map_err(|e| CoordinatorError::invalid("user", e))?;
        }
        if self.plan_timeout_s == Some(0) || self.plan_timeout_s.is_some_and(|s| s > 3600) {
            return Err(CoordinatorError::invalid("plan_timeout_s", "must be between 1 and 3600 seconds"));
        }
        if self.resources.gpus == Some(0) {
            return Err(CoordinatorError::invalid("resources.gpus", "must be at least 1; leave it out to allow any number"));
        }
        self.validate_env_names()?;
        self.model()?;
        self.plan_options()?;
        self.replan()?;
        self.replan_can_act()?;
        if self.steps == Some(0) {
            return Err(CoordinatorError::invalid("steps", "must be at least 1 (training steps in all); leave it out if unknown"));
        }
        self.validate_checkpoint()?;
        self.validate_profiling()?;
        if let Some(plan) = &self.plan {
            self.validate_plan(plan)?;
        }
        Ok(())
    }

    /// The name: present, of bounded length, printable.
    fn validate_name(&self) -> Result<()> {
        if self.name.trim().is_empty() {
            return Err(CoordinatorError::invalid("name", "a job needs a name"));
        }
        if self.name.chars().count() > MAX_NAME {
            return Err(CoordinatorError::invalid("name", format!("is {} characters; at most {MAX_NAME}", self.name.chars().count())));
        }
        if self.name.chars().any(char::is_control) {
            return Err(CoordinatorError::invalid("name", "must not hold control characters (newlines, escapes)"));
        }
        Ok(())
    }

    /// The bounds on what a job stores: the command, its variables, its nodes.
    fn validate_sizes(&self) -> Result<()> {
        if self.run.len() > MAX_RUN_BYTES {
            return Err(CoordinatorError::invalid(
                "run",
                format!("is {} bytes; at most {MAX_RUN_BYTES} (put a long command in a script and run that)", self.run.len()),
            ));
        }
        if self.envs.len() > MAX_ENVS {
            return Err(CoordinatorError::invalid("envs", format!("has {} variables; at most {MAX_ENVS}", self.envs.len())));
        }
        for (key, value) in &self.envs {
            if value.len() > MAX_ENV_VALUE_BYTES || key.len() > 256 {
                return Err(CoordinatorError::invalid(
                    format!("envs.{}", key.chars().take(64).collect::<String>()),
                    format!(
                        "is {} bytes; a name may have 256 and a value {MAX_ENV_VALUE_BYTES} at most (pass big data as a file)",
                        value.len()
                    ),
                ));
            }
            if value.contains('\0') {
                return Err(CoordinatorError::invalid(format!("envs.{key}"), "must not hold a NUL character"));
            }
        }
        let total: usize = self.envs.iter().map(|(k, v)| k.len() + v.len()).sum();
        if total > MAX_ENVS_BYTES {
            return Err(CoordinatorError::invalid(
                "envs",
                format!("are {total} bytes in all; at most {MAX_ENVS_BYTES} (pass big data as a file)"),
            ));
        }
        if self.resources.nodes.len() > MAX_NODES {
            return Err(CoordinatorError::invalid(
                "resources.nodes",
                format!("names {} nodes; at most {MAX_NODES}", self.resources.nodes.len()),
            ));
        }
        for (i, n) in self.resources.nodes.iter().enumerate() {
            crate::job::validate::node_name(n).map_err(|e| CoordinatorError::invalid(format!("resources.nodes[{i}]"), e))?;
        }
        Ok(())
    }

    fn validate_restarts(&self) -> Result<()> {
        // A relaunch resumes from a checkpoint: without one it would start over.
        if self.checkpoint.is_none() {
            for (field, n) in [("max_restarts", self.max_restarts), ("max_preemptions", self.max_preemptions)] {
                if n != 0 {
                    return Err(CoordinatorError::invalid(
                        field,
                        "a relaunch resumes from the newest complete checkpoint; add checkpoint: {every: STEPS} or set 0",
                    ));
                }
            }
        }
        Ok(())
    }

    /// Variable names: valid, and none of those the agent sets for every rank.
    fn validate_env_names(&self) -> Result<()> {
        for key in self.envs.keys() {
            let ok = !key.is_empty()
                && key.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
                && !key.starts_with(|c: char| c.is_ascii_digit());
            if !ok {
                return Err(CoordinatorError::invalid(format!("envs.{key}"), "is not a valid environment variable name"));
            }
            if RESERVED.contains(&key.as_str()) || key.starts_with("MOTLEY_") {
                return Err(CoordinatorError::invalid(format!("envs.{key}"), "is set by the agent for every rank; remove it"));
            }
        }
        Ok(())
    }

    fn validate_checkpoint(&self) -> Result<()> {
        if let Some(c) = &self.checkpoint {
            if c.every == 0 {
                return Err(CoordinatorError::invalid("checkpoint.every", "must be at least 1 (steps between checkpoints)"));
            }
            if c.keep == Some(0) {
                return Err(CoordinatorError::invalid("checkpoint.keep", "must be at least 1 (complete steps kept on each node's disk)"));
            }
            if let Some(url) = &c.cloud {
                cloud_url(url).map_err(|e| CoordinatorError::invalid("checkpoint.cloud", e))?;
            }
        }
        Ok(())
    }

    fn validate_profiling(&self) -> Result<()> {
        if let Some(dtype) = self.profiling.as_ref().and_then(|p| p.dtype.as_deref()) {
            if !PROFILE_DTYPES.contains(&dtype) {
                return Err(CoordinatorError::invalid(
                    "profiling.dtype",
                    format!(
                        "'{}' is not a data type the profiler measures; use one of {}",
                        dtype.escape_default(),
                        PROFILE_DTYPES.join(", ")
                    ),
                ));
            }
        }
        Ok(())
    }

    /// A plan the job carries: it agrees with the job, is not searched, and has GPUs.
    fn validate_plan(&self, plan: &PlanDocument) -> Result<()> {
        if plan.global_batch != self.global_batch {
            return Err(CoordinatorError::invalid(
                "plan.global_batch",
                format!("is {} but the job's global_batch is {}; make them agree", plan.global_batch, self.global_batch),
            ));
        }
        let pinned = self.plan_options.clone().unwrap_or_default();
        for (name, set) in [
            ("tp", pinned.tp.is_some()),
            ("max_stages", pinned.max_stages.is_some()),
            ("micro_batch", pinned.micro_batch.is_some()),
            ("search", pinned.search.is_some()),
        ] {
            if set {
                return Err(CoordinatorError::invalid(
                    format!("plan_options.{name}"),
                    "a job that carries its plan is not searched; drop one of the two",
                ));
            }
        }
        let stages: usize = plan.replicas.iter().map(|r| r.stages.len()).sum();
        if plan.replicas.is_empty() || stages == 0 {
            return Err(CoordinatorError::invalid("plan.replicas", "a plan needs at least one replica with stages"));
        }
        let gpus: usize = plan.replicas.iter().flat_map(|r| &r.stages).map(|s| s.gpus.len()).sum();
        if gpus as u64 > motley_solver::limits::MAX_GPUS {
            return Err(CoordinatorError::invalid("plan", format!("names {gpus} GPUs; at most {}", motley_solver::limits::MAX_GPUS)));
        }
        Ok(())
    }

    /// The planner's options: its defaults, the job's global batch, and what `plan_options`
    /// pins. Checked as the planner checks them, errors naming `plan_options.FIELD`.
    pub fn plan_options(&self) -> Result<(PlanOptions, SearchMode)> {
        let p = self.plan_options.clone().unwrap_or_default();
        let d = PlanOptions::default();
        // Field by field over the planner's defaults: options the planner gains keep theirs.
        let mut opts = d.clone();
        opts.global_batch = self.global_batch;
        opts.micro_batch = p.micro_batch;
        opts.efficiency = p.efficiency.unwrap_or(d.efficiency);
        opts.host_layer_ms = p.host_layer_ms.unwrap_or(d.host_layer_ms);
        opts.recompute = p.recompute.unwrap_or(d.recompute);
        opts.zero1 = p.zero1.unwrap_or(d.zero1);
        opts.reserve_gib = p.reserve_gib.unwrap_or(d.reserve_gib);
        opts.max_stages = p.max_stages.unwrap_or(d.max_stages);
        opts.tp = p.tp;
        opts.p2p_blocking = p.p2p_blocking.unwrap_or(d.p2p_blocking);
        opts.validate().map_err(|e| {
            let text = e.to_string();
            // The planner names its own option (`tp: ...`); the job file's is plan_options.tp.
            match text.split_once(": ") {
                Some((field, why)) if field == "global_batch" => CoordinatorError::invalid(field, why),
                Some((field, why)) if !field.contains(' ') => CoordinatorError::invalid(format!("plan_options.{field}"), why),
                _ => CoordinatorError::invalid("plan_options", text),
            }
        })?;
        let mode = match p.search.unwrap_or(Search::Auto) {
            Search::Auto => SearchMode::Auto,
            Search::Exact => SearchMode::Exact,
            Search::Fast => SearchMode::Fast,
        };
        Ok((opts, mode))
    }

    /// The job with `url` (checked at start-up with `cloud_url`) as its checkpoint cloud when it
    /// checkpoints and names none; as it was otherwise.
    pub fn with_default_cloud(mut self, url: Option<&str>) -> JobSpec {
        if let (Some(c), Some(url)) = (self.checkpoint.as_mut(), url) {
            c.cloud.get_or_insert_with(|| url.to_string());
        }
        self
    }

    /// The environment every rank gets from the job: its `envs`, and MOTLEY_CKPT_EVERY when it
    /// checkpoints (the agent adds MOTLEY_CKPT_DIR).
    pub fn launch_envs(&self) -> std::collections::HashMap<String, String> {
        let mut envs: std::collections::HashMap<String, String> = self.envs.clone().into_iter().collect();
        if let Some(c) = &self.checkpoint {
            envs.insert("MOTLEY_CKPT_EVERY".into(), c.every.to_string());
            envs.insert("MOTLEY_CKPT_KEEP".into(), c.keep.unwrap_or(DEFAULT_KEEP).to_string());
            if let Some(url) = &c.cloud {
                envs.insert("MOTLEY_CKPT_CLOUD".into(), url.clone());
            }
        }
        envs
    }

    /// `plan_options.precision` (absent: auto), resolved on the cluster the job is planned on.
    pub fn precision(&self, cluster: &motley_solver::Cluster) -> motley_solver::Precision {
        cluster.precision(self.plan_options.as_ref().and_then(|p| p.precision).unwrap_or_default())
    }

    /// When the job re-plans on changed links (absent: the defaults); None: `replan: off`.
    pub fn replan(&self) -> Result<Option<ReplanPolicy>> {
        replan::policy(self.replan.as_ref())
    }

    /// How the job uses measured profiles (absent: `auto`, fp32).
    pub fn profiling(&self) -> ProfilingSpec {
        self.profiling.clone().unwrap_or_default()
    }

    /// The model, from the catalog or the inline entry, at the job's sequence length.
    pub fn model(&self) -> Result<Model> {
        let seq = self.seq_len()?;
        resolve_model(&self.model, seq.map(|(s, _)| s), seq.map_or("seq_len", |(_, field)| field))
    }

    /// The sequence length the job asks for and the field that says it: `seq_len`,
    /// `plan_options.seq_len` or a carried plan's `plan.seq_len` (a plan is run at the length it
    /// was made for); None: the model's. Two that disagree are refused naming both.
    pub fn seq_len(&self) -> Result<Option<(u64, &'static str)>> {
        let given = [
            ("seq_len", self.seq_len),
            ("plan_options.seq_len", self.plan_options.as_ref().and_then(|p| p.seq_len)),
            ("plan.seq_len", self.plan.as_ref().and_then(|p| p.seq_len)),
        ];
        let mut chosen: Option<(u64, &'static str)> = None;
        for (field, value) in given {
            let Some(v) = value else { continue };
            match chosen {
                None => chosen = Some((v, field)),
                Some((first, named)) if first != v => {
                    return Err(CoordinatorError::invalid(
                        field,
                        format!("is {v} but {named} is {first}; a job trains at one sequence length: make them agree or give one"),
                    ))
                }
                Some(_) => {}
            }
        }
        Ok(chosen)
    }

    /// `replan:` asked for (not `off`) where it can never act is refused naming what stops it:
    /// a carried plan is never re-planned, and a switch resumes from a complete checkpoint. An
    /// absent `replan:` is the default, not a request: such jobs are simply not watched.
    fn replan_can_act(&self) -> Result<()> {
        if matches!(self.replan, None | Some(ReplanSpec::Off)) {
            return Ok(());
        }
        if self.plan.is_some() {
            return Err(CoordinatorError::invalid(
                "replan",
                "the job carries its plan (plan:), which is run as given and never re-planned; remove replan, or plan to let the planner choose",
            ));
        }
        if self.checkpoint.is_none() {
            return Err(CoordinatorError::invalid(
                "replan",
                "a re-planned job switches to its new plan at a complete checkpoint, and this job has none (checkpoint:); add checkpoint: {every: STEPS} or remove replan",
            ));
        }
        Ok(())
    }
}

/// A model from the catalog or an inline entry, with a sequence length given as `seq_field`.
pub fn resolve_model(model: &ModelRef, seq_len: Option<u64>, seq_field: &str) -> Result<Model> {
    let spec = match model {
        ModelRef::Name(n) => match motley_solver::model::model_by_name(n) {
            Some(m) => m,
            None => hf_model(n).unwrap_or_else(|| {
                let known: Vec<String> = motley_solver::model::model_catalog().into_iter().map(|m| m.name).collect();
                Err(CoordinatorError::invalid(
                    "model",
                    format!(
                        "unknown model '{n}'; use one of {}, an inline model entry or a Hugging Face model directory on the coordinator",
                        known.join(", ")
                    ),
                ))
            })?,
        },
        ModelRef::Spec(s) => s.clone(),
    };
    Model::new(spec, seq_len).map_err(|e| {
        let text = e.to_string();
        match text.strip_prefix("seq_len: ") {
            Some(why) if seq_len.is_some() => CoordinatorError::invalid(seq_field, why),
            _ => CoordinatorError::invalid("model", text),
        }
    })
}

/// A Hugging Face model on this machine: a directory holding `config.json`, or the path of a
/// `config.json`; its spec is named after the directory. None when `path` is neither.
pub fn hf_model(path: &str) -> Option<Result<ModelSpec>> {
    let p = std::path::Path::new(path);
    let (dir, file) = if p.is_dir() {
        (p.to_path_buf(), p.join("config.json"))
    } else if p.is_file() && p.file_name().is_some_and(|f| f == "config.json") {
        (p.parent().map_or_else(|| ".".into(), |d| if d.as_os_str().is_empty() { ".".into() } else { d.to_path_buf() }), p.to_path_buf())
    } else {
        return None;
    };
    let origin = file.display().to_string();
    let fail = |why: String| CoordinatorError::invalid("model", format!("{origin}: {why}"));
    let read = || -> Result<ModelSpec> {
        if !file.is_file() {
            return Err(fail("no such file; a Hugging Face model directory holds config.json".into()));
        }
        let text = std::fs::read_to_string(&file).map_err(|e| fail(format!("cannot read it: {e}")))?;
        let config: serde_json::Value = serde_json::from_str(&text).map_err(|e| fail(format!("is not JSON: {e}")))?;
        let name = dir.canonicalize().ok().and_then(|d| d.file_name().map(|n| n.to_string_lossy().into_owned()));
        let name = name.or_else(|| dir.file_name().map(|n| n.to_string_lossy().into_owned())).unwrap_or_else(|| "model".into());
        motley_solver::model::hf::spec_from_config(&config, &name).map_err(|e| fail(e.to_string()))
    };
    Some(read())
}

/// serde_norway with the path of the failing field in the message.
/// Deserialize YAML (JSON is YAML too) into `T`; the error names `what` and the path of the
/// failing field, as the CLI's `inputs::parse_yaml` does.
pub fn parse_yaml<'de, T: Deserialize<'de>>(de: impl serde::Deserializer<'de>, what: &str) -> Result<T> {
    serde_path_to_error::deserialize(de).map_err(|e| {
        let path = e.path().to_string();
        let msg = e.into_inner().to_string();
        let hint = if msg.contains("missing field") {
            "; add it"
        } else if msg.contains("unknown field") {
            "; remove it or fix its spelling"
        } else {
            ""
        };
        // serde_norway's message may already start with the path.
        if path == "." || path.is_empty() || msg.starts_with(&path) {
            CoordinatorError::invalid(what, format!("{msg}{hint}"))
        } else {
            CoordinatorError::invalid(format!("{what}: {path}"), format!("{msg}{hint}"))
        }
    })
}

#[cfg(test)]
mod tests;
