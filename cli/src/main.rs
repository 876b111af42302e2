//! `motley`, the operator's CLI. Today: `motley plan`, `motley provision`, `motley metis` and
//! `motley espresso`, which work offline.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use motley_solver::{PlanOptions, PlanRequest, SearchMode, SolverError};

use motley::inputs::{self, InputError, Mode, Output};
use motley::table;

#[derive(Parser)]
#[command(name = "motley", version, about = "Plan and run LLM training on clusters of mixed GPUs")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Find the fastest data/tensor/pipeline-parallel plan for a model on a cluster (offline).
    Plan(PlanArgs),
    /// Metis's profiles, hostfile and clusterfile: price plans as Metis does, search its space.
    Metis(motley::metis::MetisArgs),
    /// Espresso's job, model and GPU files: price plans as Espresso does, search its space exactly.
    Espresso(motley::espresso::EspressoArgs),
    /// Which GPUs to rent, and how many, to meet an iteration-time SLO for the least money.
    Provision(motley::provision::ProvisionArgs),
}

#[derive(clap::Args)]
struct PlanArgs {
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
    /// Sequence length (overrides the model's).
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
    /// Shard optimizer states across a stage's data-parallel GPUs (ZeRO-1).
    #[arg(long)]
    zero1: bool,
    /// Fraction of peak tensor FLOPS a layer reaches in the roofline estimate.
    #[arg(long, default_value_t = 0.5)]
    efficiency: f64,
    /// GiB kept free on every GPU (CUDA context, NCCL buffers, fragmentation).
    #[arg(long, default_value_t = 1.5)]
    reserve_gib: f64,
    /// Output format.
    #[arg(short = 'o', long, value_enum, default_value_t = Output::Table, env = "MOTLEY_OUTPUT")]
    output: Output,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Plan(args) => run_plan(args),
        Command::Provision(a) => motley::provision::run(a),
        Command::Espresso(e) => match e.command {
            motley::espresso::EspressoCommand::Eval(a) => motley::espresso::run_eval(a),
            motley::espresso::EspressoCommand::Search(a) => motley::espresso::run_search(a),
        },
        Command::Metis(m) => match m.command {
            motley::metis::MetisCommand::Eval(a) => motley::metis::run_eval(a),
            motley::metis::MetisCommand::Search(a) => motley::metis::run_search(a),
        },
    };
    match result {
        Ok(text) => {
            use std::io::Write;
            // A closed pipe (`motley plan ... | head`) is not an error worth a panic.
            let _ = writeln!(std::io::stdout().lock(), "{text}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(2)
        }
    }
}

fn check_options(a: &PlanArgs) -> Result<(), InputError> {
    let bad = |flag: &str, msg: &str| Err(InputError(format!("{flag}: {msg}")));
    if a.global_batch == 0 {
        return bad("--global-batch", "must be at least 1");
    }
    if let Some(b) = a.micro_batch {
        if b == 0 || !a.global_batch.is_multiple_of(b) {
            return bad("--micro-batch", "must be a positive divisor of --global-batch");
        }
    }
    if let Some(t) = a.tp {
        if t == 0 || !t.is_power_of_two() {
            return bad("--tp", "must be a power of two (1, 2, 4, 8)");
        }
    }
    if a.max_stages > 0 && a.max_stages > 4096 {
        return bad("--max-stages", "must be at most 4096 (0 chooses automatically)");
    }
    if !(a.efficiency > 0.0 && a.efficiency <= 1.0) {
        return bad("--efficiency", "must be in (0, 1]");
    }
    if !(a.reserve_gib >= 0.0 && a.reserve_gib.is_finite()) {
        return bad("--reserve-gib", "must be a non-negative number");
    }
    if a.seq_len == Some(0) {
        return bad("--seq-len", "must be at least 1");
    }
    Ok(())
}

fn run_plan(a: PlanArgs) -> Result<String, InputError> {
    check_options(&a)?;
    let cluster = inputs::load_cluster(&a.cluster)?;
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
    let opts = PlanOptions {
        global_batch: a.global_batch,
        micro_batch: a.micro_batch,
        efficiency: a.efficiency,
        recompute: a.recompute,
        zero1: a.zero1,
        reserve_gib: a.reserve_gib,
        max_stages: a.max_stages,
        tp: a.tp,
    };
    let mode: SearchMode = a.search.into();
    let req = PlanRequest { cluster: &cluster, model: &model, profiles: &profiles, opts: &opts, mode, exhaustive: a.exhaustive };
    let report = motley_solver::plan(&req).map_err(|e| match e {
        SolverError::DoesNotFit(m) => InputError(format!("{}: model does not fit: {m}", a.cluster.display())),
        other => InputError(other.to_string()),
    })?;
    Ok(match a.output {
        Output::Json => serde_json::to_string_pretty(&report).expect("report serialises"),
        Output::Table => table::render(&report, a.compare),
    })
}
