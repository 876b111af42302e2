//! `motley-baselines espresso eval|search`: Espresso's own files, priced by its estimator and searched
//! exactly. The flags and the `-o json` fields are a contract (README.md, `motley-baselines espresso`);
//! more may be added, none renamed.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::espresso::{
    self, Estimate, Estimator, EstimatorGpu, GpuTable, Job, ModelConfig, Placer, Search, SpaceLimits, DEFAULT_EFFICIENCY_TABLE,
};
use clap::{Args, Subcommand, ValueEnum};
use serde_json::{json, Value};

use motley::inputs::{InputError, Output};

#[derive(Args)]
pub struct EspressoArgs {
    #[command(subcommand)]
    pub command: EspressoCommand,
}

#[derive(Subcommand)]
pub enum EspressoCommand {
    /// Price one plan with Espresso's estimator.
    Eval(EvalArgs),
    /// The cheapest plan meeting the job's SLO, under Espresso's estimator.
    Search(SearchArgs),
}

/// Espresso's inputs, as its files are.
#[derive(Args)]
pub struct EspressoInputs {
    /// Espresso job (`jobs/*.json`).
    #[arg(long, env = "MOTLEY_ESPRESSO_JOB")]
    pub job: PathBuf,
    /// llm-analysis model config; default: the one whose `name` is the job's `model_name`,
    /// from a `models/` (or `model_configs/`) folder above the job or the GPU table.
    #[arg(long)]
    pub model_config: Option<PathBuf>,
    /// Espresso's GPU table (`espresso_gpu_config.json`), with `llm_analysis_gpu_configs/`
    /// beside it (and optionally `portal_gpu_efficiency.json`).
    #[arg(long, env = "MOTLEY_ESPRESSO_GPUS")]
    pub gpus: PathBuf,
    /// Seconds per iteration to meet (default: the job's `slo`).
    #[arg(long)]
    pub slo: Option<f64>,
    /// Output format.
    #[arg(short = 'o', long, value_enum, default_value_t = Output::Table, env = "MOTLEY_OUTPUT")]
    pub output: Output,
}

#[derive(Args)]
pub struct EvalArgs {
    #[command(flatten)]
    pub inputs: EspressoInputs,
    /// The plan, JSON text or a file: `[["a6000-pcie4-48gb", 11], ["3090-pcie4-24gb", 3]]`,
    /// stages in pipeline order.
    #[arg(long)]
    pub plan: String,
    /// Data-parallel replicas of the pipeline (default: the job's `dp_size`).
    #[arg(long)]
    pub dp: Option<u32>,
}

#[derive(Clone, Copy, ValueEnum, PartialEq, Eq)]
pub enum SpaceArg {
    Placer,
    Full,
}

#[derive(Clone, Copy, ValueEnum, PartialEq, Eq)]
pub enum Method {
    /// Exact branch and bound over the declared space.
    Exact,
    /// Espresso's own allocator (cost tree, its pruning, its bug), replayed.
    Espresso,
}

#[derive(Args)]
pub struct SearchArgs {
    #[command(flatten)]
    pub inputs: EspressoInputs,
    /// Place every allocation of the space instead of searching (the oracle).
    #[arg(long)]
    pub exhaustive: bool,
    #[arg(long, value_enum, default_value_t = Method::Exact)]
    pub method: Method,
    /// GPUs that can be had, `NAME=N` (repeatable); default Espresso's 16, 8, 16, 16 in table
    /// order (16 for any further type).
    #[arg(long = "quota", value_name = "NAME=N")]
    pub quotas: Vec<String>,
    /// placer: each allocation placed by Espresso's placer (its space; `--exhaustive` checks
    /// it); full: every stage order and layer split of each allocation (cheaper or equal).
    #[arg(long, value_enum, default_value_t = SpaceArg::Placer)]
    pub space: SpaceArg,
    /// Longest pipeline (default: the model's layer count; Espresso's search stops at 7).
    #[arg(long, default_value_t = 0)]
    pub max_stages: u32,
    /// Data-parallel degrees, comma-separated (default: every divisor of global batch / M).
    #[arg(long, value_delimiter = ',')]
    pub dp: Vec<u32>,
}

/// Espresso's allocator limits (`GPUAllocator.py`), by table position.
const ESPRESSO_QUOTAS: [u32; 4] = [16, 8, 16, 16];

pub struct Loaded {
    pub estimator: Estimator,
    pub table: GpuTable,
}

impl Loaded {
    pub fn placer_view(&self) -> (Vec<EstimatorGpu>, Vec<f64>) {
        self.table.placer_view(&self.estimator.gpus)
    }
}

fn read(path: &Path, what: &str) -> Result<String, InputError> {
    std::fs::read_to_string(path).map_err(|e| InputError(format!("{}: cannot read {what}: {e}", path.display())))
}

fn solver_err(e: crate::BaselineError) -> InputError {
    InputError(e.to_string())
}

/// Read the job, the model config and the GPU table with what sits beside it.
pub fn load(i: &EspressoInputs) -> Result<Loaded, InputError> {
    let job_origin = i.job.display().to_string();
    let mut job: Job = espresso::parse_job(&read(&i.job, "Espresso job")?, &job_origin).map_err(solver_err)?;
    if let Some(slo) = i.slo {
        if !(slo.is_finite() && slo > 0.0) {
            return Err(InputError("--slo: must be a positive number of seconds per iteration".into()));
        }
        job.slo = slo;
    }
    let gpu_dir = i.gpus.parent().unwrap_or(Path::new("."));
    let spec_dir = ["llm_analysis_gpu_configs", "gpu_configs"].iter().map(|d| gpu_dir.join(d)).find(|d| d.is_dir()).ok_or_else(|| {
        InputError(format!(
            "{}: no llm_analysis_gpu_configs/ folder beside the GPU table; put llm-analysis's GPU spec files there",
            i.gpus.display()
        ))
    })?;
    let mut specs = BTreeMap::new();
    for e in std::fs::read_dir(&spec_dir).map_err(|e| InputError(format!("{}: {e}", spec_dir.display())))? {
        let p = e.map_err(|e| InputError(e.to_string()))?.path();
        if p.extension().is_some_and(|x| x == "json") {
            specs.insert(p.file_name().unwrap().to_string_lossy().into_owned(), read(&p, "GPU spec")?);
        }
    }
    let gpus_origin = i.gpus.display().to_string();
    let table = espresso::parse_gpu_table(&read(&i.gpus, "GPU table")?, &gpus_origin, &specs).map_err(solver_err)?;
    let eff_file = gpu_dir.join("portal_gpu_efficiency.json");
    let (eff_text, eff_origin) = if eff_file.is_file() {
        (read(&eff_file, "efficiency table")?, eff_file.display().to_string())
    } else {
        (DEFAULT_EFFICIENCY_TABLE.to_string(), "built-in portal_gpu_efficiency.json".to_string())
    };
    let eff = espresso::parse_efficiency_table(&eff_text, &eff_origin).map_err(solver_err)?;
    let gpus = table.estimator_gpus(&eff, &gpus_origin).map_err(solver_err)?;
    let mc = match &i.model_config {
        Some(p) => espresso::parse_model_config(&read(p, "model config")?, &p.display().to_string()).map_err(solver_err)?,
        None => find_model_config(&job, &[&i.job, &i.gpus])?,
    };
    let estimator = Estimator::new(job, &mc, gpus).map_err(|e| InputError(format!("{job_origin}: {e}")))?;
    Ok(Loaded { estimator, table })
}

/// Espresso looks a model config up by its `name`; we look in `models/` or `model_configs/`
/// folders above the job and the GPU table.
fn find_model_config(job: &Job, near: &[&Path]) -> Result<ModelConfig, InputError> {
    let mut dirs = vec![];
    for p in near {
        for anc in p.ancestors().skip(1) {
            for d in ["models", "model_configs"] {
                let dir = anc.join(d);
                if dir.is_dir() && !dirs.contains(&dir) {
                    dirs.push(dir);
                }
            }
        }
    }
    for dir in &dirs {
        let Ok(entries) = std::fs::read_dir(dir) else { continue };
        let mut files: Vec<PathBuf> =
            entries.filter_map(|e| e.ok().map(|e| e.path())).filter(|p| p.extension().is_some_and(|x| x == "json")).collect();
        files.sort();
        for f in files {
            if let Ok(c) = espresso::parse_model_config(&std::fs::read_to_string(&f).unwrap_or_default(), "") {
                if c.name == job.model_name {
                    return Ok(c);
                }
            }
        }
    }
    Err(InputError(format!(
        "--model-config: no model config named '{}' (the job's model_name) in {}; pass --model-config FILE",
        job.model_name,
        if dirs.is_empty() {
            "any models/ folder above the job or GPU table".to_string()
        } else {
            dirs.iter().map(|d| d.display().to_string()).collect::<Vec<_>>().join(", ")
        }
    )))
}

fn parse_plan(arg: &str, gpus: &[EstimatorGpu]) -> Result<Vec<(usize, u32)>, InputError> {
    let text = if Path::new(arg).is_file() { read(Path::new(arg), "plan")? } else { arg.to_string() };
    let raw: Vec<(String, u32)> = serde_json::from_str(&text)
        .map_err(|e| InputError(format!("--plan: {e}; give stages in pipeline order as [[\"<gpu name>\", <layers>], ...]")))?;
    if raw.is_empty() {
        return Err(InputError("--plan: has no stage; give at least one [\"<gpu name>\", <layers>]".into()));
    }
    raw.iter()
        .enumerate()
        .map(|(i, (name, l))| {
            let g = gpus.iter().position(|g| &g.name == name).ok_or_else(|| {
                let known: Vec<&str> = gpus.iter().map(|g| g.name.as_str()).collect();
                InputError(format!("--plan: stage {i}: unknown GPU '{name}'; the GPU table lists {}", known.join(", ")))
            })?;
            Ok((g, *l))
        })
        .collect()
}

const GIB: f64 = 1073741824.0;

fn plan_json(l: &Loaded, order: &[usize], layers: &[u32], dp: u32, e: &Estimate) -> Value {
    let g = &l.estimator.gpus;
    json!({
        "iteration_time_s": e.iteration_time,
        "cost_per_iteration": e.cost,
        "dp": dp,
        "pp": order.len(),
        "micro_batch": e.micro_batch,
        "micro_batches": l.estimator.job.gradient_accumulation_steps,
        "fits": e.fits,
        "meets_slo": e.fits && e.iteration_time < l.estimator.job.slo,
        "slo_s": l.estimator.job.slo,
        "money_per_hour": e.money_per_hour,
        "oom_excess_mib": if e.fits { Value::Null } else { json!(e.oom_excess_mib) },
        "stages": order.iter().zip(layers).zip(&e.stages).map(|((&gi, &n), s)| json!({
            "gpu": g[gi].name,
            "layers": n,
            "memory_gib": s.memory / GIB,
            "memory_left_gib": s.memory_left / GIB,
            "fwd_s": s.fwd,
            "bwd_s": s.bwd,
            "allreduce_s": s.allreduce,
        })).collect::<Vec<_>>(),
    })
}

fn plan_table(l: &Loaded, order: &[usize], layers: &[u32], dp: u32, e: &Estimate) -> String {
    use comfy_table::{presets::UTF8_FULL_CONDENSED, Table};
    let mut t = Table::new();
    t.load_preset(UTF8_FULL_CONDENSED);
    t.set_header(vec!["stage", "gpu", "layers", "memory GiB", "left GiB", "fwd s", "bwd s", "all-reduce s"]);
    for (i, ((&gi, &n), s)) in order.iter().zip(layers).zip(&e.stages).enumerate() {
        t.add_row(vec![
            i.to_string(),
            motley::table::escape(&l.estimator.gpus[gi].name).into_owned(),
            n.to_string(),
            format!("{:.2}", s.memory / GIB),
            format!("{:.2}", s.memory_left / GIB),
            format!("{:.3}", s.fwd),
            format!("{:.3}", s.bwd),
            format!("{:.3}", s.allreduce),
        ]);
    }
    let verdict = if !e.fits {
        format!(
            "OUT OF MEMORY by {:.0} MiB (Espresso's excess figure); Espresso prices it at its 1e10 s sentinel",
            e.oom_excess_mib - 500.0
        )
    } else {
        format!(
            "{:.6} s per iteration, ${:.8} per iteration (${}/h), SLO {} s {}",
            e.iteration_time,
            e.cost,
            e.money_per_hour,
            l.estimator.job.slo,
            if e.iteration_time < l.estimator.job.slo { "met" } else { "MISSED" }
        )
    };
    format!("dp {dp} x {} stages, micro-batch {}: {verdict}\n{t}", order.len(), e.micro_batch)
}

pub fn run_eval(a: EvalArgs) -> Result<String, InputError> {
    let l = load(&a.inputs)?;
    let plan = parse_plan(&a.plan, &l.estimator.gpus)?;
    let dp = a.dp.unwrap_or(l.estimator.job.dp_size);
    check_dp(&l.estimator.job, dp, "--dp")?;
    let e = l.estimator.estimate(&plan, dp);
    let order: Vec<usize> = plan.iter().map(|p| p.0).collect();
    let layers: Vec<u32> = plan.iter().map(|p| p.1).collect();
    Ok(match a.inputs.output {
        Output::Json => serde_json::to_string_pretty(&plan_json(&l, &order, &layers, dp, &e)).unwrap(),
        Output::Table => plan_table(&l, &order, &layers, dp, &e),
    })
}

fn check_dp(job: &Job, dp: u32, flag: &str) -> Result<(), InputError> {
    if dp == 0 || job.global_batch_size as u64 / (dp as u64 * job.gradient_accumulation_steps as u64) == 0 {
        return Err(InputError(format!(
            "{flag}: {dp} leaves no sequence per micro-batch (global_batch_size {} / (dp x {} micro-batches)); use a dp of at most {}",
            job.global_batch_size,
            job.gradient_accumulation_steps,
            job.global_batch_size / job.gradient_accumulation_steps
        )));
    }
    Ok(())
}

fn quotas(l: &Loaded, args: &[String]) -> Result<Vec<u32>, InputError> {
    let names = &l.table.names;
    let mut q: Vec<u32> = (0..names.len()).map(|i| ESPRESSO_QUOTAS.get(i).copied().unwrap_or(16)).collect();
    for a in args {
        let (name, n) =
            a.split_once('=').ok_or_else(|| InputError(format!("--quota: '{a}' is not NAME=N; e.g. --quota a30-pcie-24gb=16")))?;
        let i = names
            .iter()
            .position(|x| x == name)
            .ok_or_else(|| InputError(format!("--quota: unknown GPU '{name}'; the GPU table lists {}", names.join(", "))))?;
        q[i] = n.parse().map_err(|_| InputError(format!("--quota: '{n}' is not a whole number of GPUs")))?;
    }
    Ok(q)
}

pub fn run_search(a: SearchArgs) -> Result<String, InputError> {
    let l = load(&a.inputs)?;
    let quotas = quotas(&l, &a.quotas)?;
    for &d in &a.dp {
        check_dp(&l.estimator.job, d, "--dp")?;
    }
    let limits = SpaceLimits { quotas: quotas.clone(), max_stages: a.max_stages, dps: a.dp.clone() };
    let (placer_gpus, peaks) = l.placer_view();
    let search = Search { est: &l.estimator, placer_gpus: &placer_gpus, table_peaks: &peaks, limits: &limits };
    let size = search.space_size();
    if size > 2e7 {
        return Err(InputError(format!(
            "--quota: about {size:.0} allocations are too many to list; lower the quotas (--quota NAME=N) or the pipeline depth (--max-stages)"
        )));
    }
    let start = std::time::Instant::now();
    let (best, fastest, counters_json, method) = match a.method {
        Method::Exact => search_exact(&a, &search)?,
        Method::Espresso => search_espresso(&l, &placer_gpus, &peaks, &quotas),
    };
    let cpu_s = start.elapsed().as_secs_f64();
    let Some(best) = best else {
        let fastest = fastest.or_else(|| search.fastest());
        return Err(no_plan_error(&l, &quotas, fastest.as_ref()));
    };
    let mut out = plan_json(&l, &best.order, &best.layers, best.dp, &best.estimate);
    let alloc: serde_json::Map<String, Value> =
        l.table.names.iter().zip(&best.counts).filter(|(_, &c)| c > 0).map(|(n, &c)| (n.clone(), json!(c * best.dp))).collect();
    out["allocation"] = Value::Object(alloc);
    out["gpus"] = json!(best.counts.iter().sum::<u32>() * best.dp);
    let mut search_json = counters_json;
    search_json["method"] = json!(method);
    search_json["seconds"] = json!(cpu_s);
    search_json["quotas"] = json!(l.table.names.iter().zip(&quotas).map(|(n, q)| (n.clone(), json!(q))).collect::<serde_json::Map<_, _>>());
    search_json["max_stages"] =
        json!(if a.max_stages == 0 { l.estimator.job.model_layer.unwrap_or(l.estimator.job.num_layers) } else { a.max_stages });
    out["search"] = search_json;
    let homogeneous = cheapest_homogeneous(&search, &quotas);
    out["homogeneous"] = match &homogeneous {
        Some(h) => {
            let mut v = plan_json(&l, &h.order, &h.layers, h.dp, &h.estimate);
            v["savings_vs_this"] = json!(1.0 - best.estimate.cost / h.estimate.cost);
            v
        }
        None => Value::Null,
    };
    Ok(match a.inputs.output {
        Output::Json => serde_json::to_string_pretty(&out).unwrap(),
        Output::Table => search_table(&l, &best, homogeneous.as_ref(), &out["search"], method, cpu_s),
    })
}

/// What a search found: the cheapest plan meeting the SLO, the fastest plan seen, the
/// search's counters (`-o json`'s `search`) and the method's name.
type Searched = (Option<espresso::EspressoPlan>, Option<espresso::EspressoPlan>, Value, &'static str);

/// `--method exact`: branch and bound over the placer's space or the full one, or the oracle
/// (`--exhaustive`).
fn search_exact(a: &SearchArgs, s: &Search) -> Result<Searched, InputError> {
    if a.space == SpaceArg::Full && a.exhaustive {
        return Err(InputError("--exhaustive: the oracle lists the placer space only; drop --space full or --exhaustive".into()));
    }
    let o = if a.exhaustive {
        s.exhaustive()
    } else if a.space == SpaceArg::Full {
        s.run_full()
    } else {
        s.run()
    };
    let c = &o.counters;
    let counters = json!({
        "allocations": c.allocations,
        "placed": c.placed,
        "time_pruned": c.time_pruned,
        "cost_pruned": c.cost_pruned,
        "space": if a.space == SpaceArg::Full { "full" } else { "placer" },
        "proven_optimal": !c.budget_cut,
    });
    let method = if a.exhaustive {
        "exhaustive"
    } else if a.space == SpaceArg::Full {
        "exact-full"
    } else {
        "exact"
    };
    Ok((o.best, o.fastest, counters, method))
}

/// `--method espresso`: Espresso's own allocator, replayed.
fn search_espresso(l: &Loaded, placer_gpus: &[EstimatorGpu], peaks: &[f64], quotas: &[u32]) -> Searched {
    let r = espresso::allocator::replay(&l.estimator, placer_gpus, peaks, quotas);
    let c = &r.counters;
    let counters = json!({
        "allocations": c.placed,
        "placed": c.placed,
        "heap_pops": c.pops,
        "bound_calls": c.bound_calls,
        "cost_pruned": c.cost_pruned,
        "memory_test_cuts": c.memory_cuts,
        "time_pruned": c.time_pruned,
        "proven_optimal": false,
    });
    (r.best, r.fastest, counters, "espresso")
}

/// The cheapest plan on one GPU type only (Sia-style), in the same space and estimator.
fn cheapest_homogeneous(search: &Search, quotas: &[u32]) -> Option<espresso::EspressoPlan> {
    (0..quotas.len())
        .filter_map(|t| {
            let only: Vec<u32> = quotas.iter().enumerate().map(|(i, &q)| if i == t { q } else { 0 }).collect();
            let lim = SpaceLimits { quotas: only, ..search.limits.clone() };
            Search { limits: &lim, ..*search }.run().best
        })
        .min_by(|a, b| a.estimate.cost.total_cmp(&b.estimate.cost))
}

/// `-o table`: the plan, what the search did, and how the mix compares with one GPU type.
fn search_table(
    l: &Loaded,
    best: &espresso::EspressoPlan,
    homogeneous: Option<&espresso::EspressoPlan>,
    s: &Value,
    method: &str,
    cpu_s: f64,
) -> String {
    let homogeneous = match homogeneous {
        Some(h) => format!(
            "\ncheapest on one GPU type: {} x {} (dp {}), ${:.8} per iteration: the mix saves {:.1}%",
            h.order.len(),
            l.estimator.gpus[h.order[0]].name,
            h.dp,
            h.estimate.cost,
            (1.0 - best.estimate.cost / h.estimate.cost) * 100.0
        ),
        None => "\nno plan on one GPU type meets the SLO".to_string(),
    };
    format!(
        "{}\nsearch {}: {} allocations in the space, {} placed, {:.3} s{}{}",
        plan_table(l, &best.order, &best.layers, best.dp, &best.estimate),
        method,
        s["allocations"],
        s["placed"],
        cpu_s,
        if method == "espresso" { " (Espresso's own search, replayed: not exact)" } else { " (optimal in the declared space)" },
        homogeneous
    )
}

/// Nothing meets the SLO: say how fast it can go and what that costs, or how much memory the
/// quotas miss.
fn no_plan_error(l: &Loaded, quotas: &[u32], fastest: Option<&espresso::EspressoPlan>) -> InputError {
    let job = &l.estimator.job;
    match fastest {
        Some(f) => InputError(format!(
            "slo: no plan within the quotas meets {} s per iteration; the fastest takes {:.3} s (dp {}, {} stages) at ${:.6} per iteration; \
             raise the SLO (--slo) to more than {:.3} or raise the quotas (--quota NAME=N)",
            job.slo,
            f.estimate.iteration_time,
            f.dp,
            f.order.len(),
            f.estimate.cost,
            f.estimate.iteration_time
        )),
        None => {
            // The least memory any plan needs: every layer's states once, the embedding at
            // one end, and the fitted per-stage overhead once.
            let placer = Placer::new(&l.estimator, &l.estimator.gpus, &[], 1);
            let need = placer.least_memory_bytes();
            let have: f64 = l.estimator.gpus.iter().zip(quotas).map(|(g, &q)| q as f64 * g.memory_gb * GIB).sum();
            if need > have {
                InputError(format!(
                    "--quota: no allocation within the quotas can hold {}: it needs at least {:.1} GiB of GPU memory but the quotas give {:.1} GiB \
                     ({:.1} GiB missing, activations not counted); raise the quotas (--quota NAME=N)",
                    job.model_name,
                    need / GIB,
                    have / GIB,
                    (need - have) / GIB
                ))
            } else {
                InputError(format!(
                    "--quota: the quotas give {:.1} GiB, more than the {:.1} GiB {} needs in total, but no placement fits every GPU \
                     (activations of in-flight micro-batches, the embedding on the first and last stage); raise the quotas of the \
                     larger GPUs (--quota NAME=N) or allow longer pipelines (--max-stages)",
                    have / GIB,
                    need / GIB,
                    job.model_name
                ))
            }
        }
    }
}
