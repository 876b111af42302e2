//! `motley plan` (the offline planner) and `motley replan` (re-planning after bandwidth
//! changes).

use std::path::PathBuf;

use motley_solver::bandwidth::BandwidthSpec;
use motley_solver::replan::{replan, SwitchPolicy};
use motley_solver::PlanDocument;
use motley_solver::{Calibration, Cluster, Model, PlanOptions, PlanRequest, PrecisionChoice, ProfileSet, SolverError};

use crate::inputs::{self, InputError, Mode, Output};
use crate::table;

/// `--baseline`: which baseline's rule makes the plan.
#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum BaselineArg {
    Megatron,
    Whale,
    FastOnly,
}

impl From<BaselineArg> for motley_solver::baselines::Baseline {
    fn from(b: BaselineArg) -> Self {
        match b {
            BaselineArg::Megatron => Self::Megatron,
            BaselineArg::Whale => Self::Whale,
            BaselineArg::FastOnly => Self::FastOnly,
        }
    }
}

#[derive(clap::Args)]
pub struct PlanArgs {
    /// Cluster file (YAML).
    #[arg(long, env = "MOTLEY_CLUSTER")]
    cluster: PathBuf,
    /// Built-in model name or a model file (YAML).
    #[arg(long, env = "MOTLEY_MODEL")]
    model: String,
    /// Sequences per iteration.
    #[arg(long, default_value_t = 256, env = "MOTLEY_GLOBAL_BATCH")]
    global_batch: u32,
    /// Sequences per micro-batch (default: the planner chooses).
    #[arg(long, env = "MOTLEY_MICRO_BATCH")]
    micro_batch: Option<u32>,
    /// Tokens per sequence the plan trains at (default: the model's seq_len; a Hugging Face
    /// model's is the smaller of its max_position_embeddings and 4096, `motley model show`).
    #[arg(long)]
    seq_len: Option<u64>,
    /// Measured per-layer profiles (YAML or JSON; format in solver/README.md).
    #[arg(long, env = "MOTLEY_PROFILES")]
    profiles: Option<PathBuf>,
    /// Print the baselines (Megatron-LM, Whale) next to the plan.
    #[arg(long)]
    compare: bool,
    /// Brute-force every plan of the space instead of searching (a few GPUs only).
    #[arg(long)]
    exhaustive: bool,
    /// Write the best plan of a baseline's rule instead of Motley's, as a plan document a job
    /// can run (`plan:`): megatron (symmetric), whale (shares by speed and memory), fast-only
    /// (symmetric on the fastest GPU type alone, the rest idle).
    #[arg(long, value_enum, conflicts_with = "exhaustive")]
    baseline: Option<BaselineArg>,
    /// Price this plan document (`motley plan -o json`, a job's `plan:`) as given instead of
    /// searching: its GPUs, stages and shares kept, its iteration priced from these inputs
    /// (--profiles, --bandwidth, --calibration), as a job that pins it is priced. Its global
    /// batch, micro-batch, seq_len, precision, recompute, ZeRO-1 and compiled blocks are the
    /// plan's; a flag that contradicts one of them is refused.
    #[arg(long, value_name = "PLAN", conflicts_with_all = ["exhaustive", "baseline"])]
    price: Option<PathBuf>,
    /// Search mode: exact for small clusters, fast for large ones, auto picks.
    #[arg(long, value_enum, default_value_t = Mode::Auto)]
    search: Mode,
    /// Only this tensor-parallel degree.
    #[arg(long)]
    tp: Option<u32>,
    /// Longest pipeline to consider (default: automatic).
    #[arg(long, default_value_t = 0)]
    max_stages: u32,
    /// Full activation recomputation.
    #[arg(long)]
    recompute: bool,
    /// Price the activations eager blocks save (ranks run with --compile off); by default
    /// plans are priced for compiled blocks, the runtime's default on a GPU.
    #[arg(long)]
    eager: bool,
    /// Shard optimizer states across a stage's data-parallel GPUs (ZeRO-1).
    #[arg(long)]
    zero1: bool,
    /// Fraction of peak tensor FLOPS a layer reaches in the roofline estimate.
    #[arg(long, default_value_t = 0.5)]
    efficiency: f64,
    /// Milliseconds the host takes to launch one layer's forward per micro-batch (its backward
    /// twice that): the roofline's floor on a layer's pass; 0 turns it off.
    #[arg(long, default_value_t = motley_solver::cost::HOST_LAYER_MS)]
    host_layer_ms: f64,
    /// GiB kept free on every GPU (CUDA context, NCCL buffers, fragmentation).
    #[arg(long, default_value_t = 1.5)]
    reserve_gib: f64,
    /// Pipeline sends block the stage (Megatron-LM's 1F1B) instead of overlapping compute.
    #[arg(long)]
    p2p_blocking: bool,
    /// The data type the run computes in: which peak of each GPU the roofline uses (V100, T4
    /// and P100 have no bf16 tensor cores: bf16 runs at their fp32 rate). auto: bf16 when
    /// every GPU type of the cluster has bf16 tensor cores, fp16 otherwise; the plan's
    /// `precision` says which.
    #[arg(long, value_enum, default_value_t = PrecisionArg::Auto)]
    precision: PrecisionArg,
    /// Measured efficiency per GPU type (YAML or JSON; format in solver/README.md), in place of
    /// --efficiency for the types it lists.
    #[arg(long, env = "MOTLEY_CALIBRATION")]
    calibration: Option<PathBuf>,
    /// Measured bandwidth between nodes (YAML or JSON: pairs or a matrix of GB/s; format in
    /// solver/README.md) overriding the cluster file's nominal rates.
    #[arg(long, env = "MOTLEY_BANDWIDTH")]
    bandwidth: Option<PathBuf>,
    /// List every communication group: link, NICs, NCCL settings and seconds per iteration.
    #[arg(long)]
    explain: bool,
    /// Output format.
    #[arg(short = 'o', long, value_enum, default_value_t = Output::Table, env = "MOTLEY_OUTPUT")]
    output: Output,
    /// Also draw the plan as a picture (SVG) into FILE: replicas, stages by GPU type, hops,
    /// and a 1F1B timeline of one iteration (replan: the new plan).
    #[arg(long, value_name = "FILE")]
    svg: Option<PathBuf>,
}

/// `--svg FILE`: the plan's picture, written whole.
pub fn write_svg(path: &std::path::Path, plan: &serde_json::Value) -> Result<(), InputError> {
    let svg =
        motley_draw::svg::plan_svg_value(plan).map_err(|e| InputError(format!("--svg: the plan does not read as a plan document: {e}")))?;
    std::fs::write(path, svg).map_err(|e| InputError(format!("--svg: cannot write {}: {e}", path.display())))
}

/// `--precision auto|fp16|bf16|fp32`.
#[derive(Clone, Copy, PartialEq, Eq, Debug, clap::ValueEnum)]
pub enum PrecisionArg {
    Auto,
    Fp16,
    Bf16,
    Fp32,
}

impl From<PrecisionArg> for PrecisionChoice {
    fn from(p: PrecisionArg) -> Self {
        match p {
            PrecisionArg::Auto => PrecisionChoice::Auto,
            PrecisionArg::Fp16 => PrecisionChoice::Fp16,
            PrecisionArg::Bf16 => PrecisionChoice::Bf16,
            PrecisionArg::Fp32 => PrecisionChoice::Fp32,
        }
    }
}

fn check_options(a: &PlanArgs) -> Result<(), InputError> {
    use motley_solver::limits::{MAX_GLOBAL_BATCH, MAX_MICRO_BATCH, MAX_SEQ_LEN, MAX_STAGES};
    let bad = |flag: &str, msg: &str| Err(InputError(format!("{flag}: {msg}")));
    if a.global_batch == 0 {
        return bad("--global-batch", "must be at least 1");
    }
    // The solver refuses these too (naming the job file's field); here the flag is named.
    if a.global_batch > MAX_GLOBAL_BATCH {
        return bad("--global-batch", &format!("{} is more than the {MAX_GLOBAL_BATCH} sequences an iteration may have", a.global_batch));
    }
    if let Some(b) = a.micro_batch {
        if b == 0 || !a.global_batch.is_multiple_of(b) {
            return bad("--micro-batch", "must be a positive divisor of --global-batch");
        }
        if b > MAX_MICRO_BATCH {
            return bad("--micro-batch", &format!("{b} is more than the {MAX_MICRO_BATCH} sequences a micro-batch may have"));
        }
    }
    if let Some(s) = a.seq_len.filter(|&s| s > MAX_SEQ_LEN) {
        return bad("--seq-len", &format!("{s} is more than the {MAX_SEQ_LEN} tokens a sequence may have"));
    }
    if let Some(t) = a.tp {
        if t == 0 || !t.is_power_of_two() {
            return bad("--tp", "must be a power of two (1, 2, 4, 8)");
        }
    }
    if a.max_stages > MAX_STAGES {
        return bad("--max-stages", &format!("must be at most {MAX_STAGES} (0 chooses automatically)"));
    }
    if !(a.efficiency > 0.0 && a.efficiency <= 1.0) {
        return bad("--efficiency", "must be in (0, 1]");
    }
    if !(a.host_layer_ms >= 0.0 && a.host_layer_ms <= 1000.0) {
        return bad("--host-layer-ms", "must be in [0, 1000] milliseconds (0: no floor)");
    }
    if !(a.reserve_gib >= 0.0 && a.reserve_gib.is_finite()) {
        return bad("--reserve-gib", "must be a non-negative number");
    }
    if a.seq_len == Some(0) {
        return bad("--seq-len", "must be at least 1");
    }
    Ok(())
}

/// The cluster (with measurements in force), model, profiles and options a plan command reads.
struct Loaded {
    cluster: Cluster,
    model: Model,
    profiles: ProfileSet,
    opts: PlanOptions,
}

fn load(a: &PlanArgs) -> Result<Loaded, InputError> {
    check_options(a)?;
    let mut cluster = inputs::load_cluster(&a.cluster)?;
    if let Some(path) = &a.bandwidth {
        let origin = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|e| InputError(format!("{origin}: cannot read bandwidth file: {e}")))?;
        let spec: BandwidthSpec = inputs::parse_yaml(&text, &origin)?;
        cluster = cluster.with_measurements(&spec).map_err(|e| inputs::in_file(&origin, e))?;
    }
    let model = inputs::load_model(&a.model, a.seq_len)?;
    let profiles = inputs::load_profiles(a.profiles.as_deref())?;
    if let Some(t) = a.tp {
        let largest = cluster.nodes.iter().map(|n| n.gpus).max().unwrap_or(0);
        if t > largest {
            return Err(InputError(format!(
                "--tp: {t} exceeds the largest node ({largest} GPUs); a TP group stays inside one node, so pass at most {largest}"
            )));
        }
        if !model.spec.heads.is_multiple_of(t) {
            return Err(InputError(format!("--tp: {t} does not divide the model's {} attention heads; pick a divisor", model.spec.heads)));
        }
    }
    let calibration = match &a.calibration {
        Some(path) => inputs::load_calibration(path, &cluster)?,
        None => Calibration::default(),
    };
    let precision = cluster.precision(PrecisionChoice::from(a.precision));
    cluster.check_precision(precision).map_err(|e| InputError(format!("--precision: {e}")))?;
    let opts = PlanOptions {
        global_batch: a.global_batch,
        micro_batch: a.micro_batch,
        efficiency: a.efficiency,
        host_layer_ms: a.host_layer_ms,
        recompute: a.recompute,
        eager: a.eager,
        zero1: a.zero1,
        reserve_gib: a.reserve_gib,
        max_stages: a.max_stages,
        tp: a.tp,
        p2p_blocking: a.p2p_blocking,
        precision,
        calibration,
    };
    Ok(Loaded { cluster, model, profiles, opts })
}

impl Loaded {
    /// The planning run these inputs and `a`'s search flags describe.
    fn request(&self, a: &PlanArgs) -> PlanRequest<'_> {
        PlanRequest {
            cluster: &self.cluster,
            model: &self.model,
            profiles: &self.profiles,
            opts: &self.opts,
            mode: a.search.into(),
            exhaustive: a.exhaustive,
            seeds: vec![],
        }
    }
}

fn solver_error(a: &PlanArgs, e: SolverError) -> InputError {
    match e {
        SolverError::DoesNotFit(m) => InputError(format!("{}: model does not fit: {m}", a.cluster.display())),
        other => InputError(other.to_string()),
    }
}

pub fn run_plan(mut a: PlanArgs) -> Result<String, InputError> {
    let given = match &a.price {
        Some(path) => Some(read_plan(path)?),
        None => None,
    };
    if let (Some(path), Some(doc)) = (a.price.clone(), &given) {
        take_from_plan(&mut a, doc, &path.display().to_string())?;
    }
    let l = load(&a)?;
    let report = match (&given, a.baseline) {
        (Some(doc), _) => motley_solver::report::given(&l.request(&a), doc).map_err(|e| match e {
            SolverError::InvalidInput { .. } => inputs::in_file(&a.price.as_ref().expect("given").display().to_string(), e),
            other => solver_error(&a, other),
        })?,
        (None, Some(b)) => motley_solver::report::baseline(&l.request(&a), b.into()).map_err(|e| solver_error(&a, e))?,
        (None, None) => motley_solver::plan(&l.request(&a)).map_err(|e| solver_error(&a, e))?,
    };
    if let Some(path) = &a.svg {
        write_svg(path, &serde_json::to_value(&report).expect("report serialises"))?;
    }
    Ok(match a.output {
        Output::Json => serde_json::to_string_pretty(&report).expect("report serialises"),
        Output::Table if a.explain => format!("{}{}", table::render(&report, a.compare), table::render_network(&report.comm_groups)),
        Output::Table => table::render(&report, a.compare),
    })
}

/// A plan document from a file (`motley plan -o json` output; YAML reads too).
fn read_plan(path: &std::path::Path) -> Result<PlanDocument, InputError> {
    let origin = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|e| InputError(format!("{origin}: cannot read plan file: {e}")))?;
    inputs::parse_yaml(&text, &origin)
}

/// `--price`: the settings a plan was made under are the plan's. A flag left out takes the
/// plan's value; one that says otherwise is refused, naming both, so nothing is priced under
/// settings the plan does not run with.
fn take_from_plan(a: &mut PlanArgs, doc: &PlanDocument, origin: &str) -> Result<(), InputError> {
    let clash = |flag: &str, asked: String, has: String| {
        InputError(format!("{flag}: {asked}, but the plan ({origin}) has {has}; drop {flag} or give {has}"))
    };
    // --global-batch has a default, so it cannot tell left out from given: the plan's is used,
    // as `motley replan --current` does.
    a.global_batch = doc.global_batch;
    match a.micro_batch {
        Some(m) if m != doc.micro_batch => return Err(clash("--micro-batch", m.to_string(), doc.micro_batch.to_string())),
        _ => a.micro_batch = Some(doc.micro_batch),
    }
    match (a.seq_len, doc.seq_len) {
        (Some(asked), Some(has)) if asked != has => return Err(clash("--seq-len", asked.to_string(), has.to_string())),
        (None, Some(has)) => a.seq_len = Some(has),
        _ => {}
    }
    if let Some(p) = doc.precision {
        let has = match p {
            motley_solver::Precision::Fp16 => PrecisionArg::Fp16,
            motley_solver::Precision::Bf16 => PrecisionArg::Bf16,
            motley_solver::Precision::Fp32 => PrecisionArg::Fp32,
        };
        if a.precision != PrecisionArg::Auto && a.precision != has {
            return Err(clash("--precision", format!("{:?}", a.precision).to_lowercase(), format!("{p:?}").to_lowercase()));
        }
        a.precision = has;
    }
    for (flag, asked, has, what) in [
        ("--recompute", a.recompute, doc.recompute, "no activation recomputation"),
        ("--zero1", a.zero1, doc.zero1, "optimizer states unsharded"),
        ("--eager", a.eager, !doc.compiled, "compiled blocks"),
    ] {
        if asked && !has {
            return Err(InputError(format!("{flag}: given, but the plan ({origin}) was made with {what}; drop {flag}")));
        }
    }
    a.recompute = doc.recompute;
    a.zero1 = doc.zero1;
    a.eager = !doc.compiled;
    Ok(())
}

#[derive(clap::Args)]
pub struct ReplanArgs {
    /// The running plan: `motley plan -o json` output. Its global batch is used (--global-batch
    /// is ignored), and its seq_len (a different --seq-len is refused).
    #[arg(long)]
    current: PathBuf,
    /// Smallest speed-up worth a switch (0.05 = 5%).
    #[arg(long, default_value_t = 0.05)]
    min_gain: f64,
    /// Iterations within which moving the state must pay for itself.
    #[arg(long, default_value_t = 1000.0)]
    horizon: f64,
    #[command(flatten)]
    plan: PlanArgs,
}

pub fn run_replan(mut a: ReplanArgs) -> Result<String, InputError> {
    if !(a.min_gain >= 0.0 && a.min_gain.is_finite()) {
        return Err(InputError("--min-gain: must be a non-negative fraction (0.05 = 5%)".into()));
    }
    if a.horizon.is_nan() || a.horizon <= 0.0 {
        return Err(InputError("--horizon: must be a positive number of iterations".into()));
    }
    if a.plan.price.is_some() {
        return Err(InputError(
            "--price: replan weighs a new plan against the running one (--current); drop --price (motley plan --price prices one plan as given)".into(),
        ));
    }
    if a.plan.baseline.is_some() {
        return Err(InputError(
            "--baseline: replan weighs Motley's new plan against the running one; drop --baseline (motley plan --baseline writes a baseline's plan)".into(),
        ));
    }
    let origin = a.current.display().to_string();
    let text = std::fs::read_to_string(&a.current).map_err(|e| InputError(format!("{origin}: cannot read plan file: {e}")))?;
    let current: PlanDocument = inputs::parse_yaml(&text, &origin)?;
    // The running plan's sequence length is the one re-planned for, as its global batch is.
    match (current.seq_len, a.plan.seq_len) {
        (Some(running), Some(asked)) if running != asked => {
            return Err(InputError(format!(
                "--seq-len: {asked}, but the running plan ({origin}) runs {running}-token sequences; drop --seq-len or give {running}"
            )))
        }
        (Some(running), _) => a.plan.seq_len = Some(running),
        (None, _) => {}
    }
    let mut l = load(&a.plan)?;
    l.opts.global_batch = current.global_batch;
    l.opts.micro_batch = None;
    let policy = SwitchPolicy { min_gain: a.min_gain, horizon: a.horizon };
    let report = replan(&l.request(&a.plan), &current, policy).map_err(|e| match e {
        SolverError::InvalidInput { .. } => inputs::in_file(&origin, e),
        other => solver_error(&a.plan, other),
    })?;
    if let Some(path) = &a.plan.svg {
        write_svg(path, &serde_json::to_value(&report.new_plan).expect("report serialises"))?;
    }
    Ok(match a.plan.output {
        Output::Json => serde_json::to_string_pretty(&report).expect("report serialises"),
        Output::Table => table::render_replan(&report, a.plan.compare),
    })
}
