//! `motley provision`: the cheapest mix of rented GPUs that meets an iteration-time SLO. The
//! flags and the `-o json` fields are a contract (README.md, `motley provision`); more may be added, none renamed.

use std::path::PathBuf;

use clap::Args;
use comfy_table::{presets::UTF8_FULL_CONDENSED, Table};
use motley_solver::provision::{self, AllocationLine, Offers, OffersSpec, ProvisionReport, ProvisionRequest, Search};
use motley_solver::{PlanOptions, SolverError};

use crate::inputs::{self, in_file, InputError, Mode, Output};

#[derive(Args)]
pub struct ProvisionArgs {
    /// Offers file (YAML): per GPU type its price, quota, GPUs per instance, links and NICs.
    #[arg(long, env = "MOTLEY_OFFERS")]
    pub offers: PathBuf,
    /// Built-in model name or a model file (YAML).
    #[arg(long, env = "MOTLEY_MODEL")]
    pub model: String,
    /// Sequences per iteration.
    #[arg(long, env = "MOTLEY_GLOBAL_BATCH")]
    pub global_batch: u32,
    /// The SLO: seconds per iteration the plan must meet.
    #[arg(long, env = "MOTLEY_SLO")]
    pub slo: f64,
    /// Iterations of the job, for the total cost and time.
    #[arg(long, default_value_t = 1)]
    pub iterations: u64,
    /// Sequences per micro-batch (default: the planner chooses).
    #[arg(long, env = "MOTLEY_MICRO_BATCH")]
    pub micro_batch: Option<u32>,
    /// Sequence length (overrides the model's).
    #[arg(long)]
    pub seq_len: Option<u64>,
    /// Measured per-layer profiles (format in solver/README.md).
    #[arg(long, env = "MOTLEY_PROFILES")]
    pub profiles: Option<PathBuf>,
    /// Also print the best homogeneous allocation and Espresso-style placement on this one.
    #[arg(long)]
    pub compare: bool,
    /// Plan every allocation within the quotas instead of searching (the oracle).
    #[arg(long)]
    pub exhaustive: bool,
    /// Print the Pareto frontier of (iteration time, cost) over allocations costing up to
    /// --frontier-cap times the optimum.
    #[arg(long)]
    pub frontier: bool,
    #[arg(long, default_value_t = 2.0, requires = "frontier")]
    pub frontier_cap: f64,
    /// Also bound an allocation's time by the time planned on a larger one: 10-160x less CPU on
    /// Espresso's GPUs (BENCHMARKS.md),
    /// but it assumes more GPUs never slow the planner down, which the exact planner
    /// guarantees and the fast one does not, so the answer is then the best found.
    #[arg(long)]
    pub superset_bound: bool,
    /// The planner's mode on each allocation.
    #[arg(long, value_enum, default_value_t = Mode::Fast)]
    pub search: Mode,
    /// Full activation recomputation.
    #[arg(long)]
    pub recompute: bool,
    /// Fraction of peak tensor FLOPS a layer reaches in the roofline estimate.
    #[arg(long, default_value_t = 0.5)]
    pub efficiency: f64,
    /// Milliseconds the host takes to launch one layer's forward per micro-batch (backward
    /// twice): the roofline's floor on a layer's pass, as `motley plan`'s; 0 turns it off.
    #[arg(long, default_value_t = motley_solver::cost::HOST_LAYER_MS)]
    pub host_layer_ms: f64,
    /// GiB kept free on every GPU.
    #[arg(long, default_value_t = 1.5)]
    pub reserve_gib: f64,
    /// Output format.
    #[arg(short = 'o', long, value_enum, default_value_t = Output::Table, env = "MOTLEY_OUTPUT")]
    pub output: Output,
}

pub fn run(a: ProvisionArgs) -> Result<String, InputError> {
    let bad = |flag: &str, msg: &str| Err(InputError(format!("{flag}: {msg}")));
    if a.global_batch == 0 {
        return bad("--global-batch", "must be at least 1");
    }
    if !(a.slo.is_finite() && a.slo > 0.0) {
        return bad("--slo", "must be a positive number of seconds per iteration");
    }
    if a.iterations == 0 {
        return bad("--iterations", "must be at least 1");
    }
    if let Some(b) = a.micro_batch {
        if b == 0 || !a.global_batch.is_multiple_of(b) {
            return bad("--micro-batch", "must be a positive divisor of --global-batch");
        }
    }
    if !(a.frontier_cap.is_finite() && a.frontier_cap >= 1.0) {
        return bad("--frontier-cap", "must be at least 1 (a multiple of the optimum's cost)");
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
    let origin = a.offers.display().to_string();
    let text = std::fs::read_to_string(&a.offers).map_err(|e| InputError(format!("{origin}: cannot read offers file: {e}")))?;
    let spec: OffersSpec = inputs::parse_yaml(&text, &origin)?;
    let offers = Offers::from_spec(&spec).map_err(|e| in_file(&origin, e))?;
    let count = offers.allocation_count();
    // Checked by the solver too; here before the model is read.
    if count > motley_solver::limits::MAX_ALLOCATIONS {
        return Err(InputError(format!(
            "{origin}: offers[].quota: {count:.0} allocations are too many to search; lower the quotas or raise gpus_per_node"
        )));
    }
    let model = inputs::load_model(&a.model, a.seq_len)?;
    let profiles = inputs::load_profiles(a.profiles.as_deref())?;
    let opts = PlanOptions {
        global_batch: a.global_batch,
        micro_batch: a.micro_batch,
        efficiency: a.efficiency,
        host_layer_ms: a.host_layer_ms,
        recompute: a.recompute,
        reserve_gib: a.reserve_gib,
        ..PlanOptions::default()
    };
    let progress = Progress::new();
    let report = |p: &provision::Progress| progress.update(p);
    let search = Search {
        offers: &offers,
        model: &model,
        profiles: &profiles,
        opts: &opts,
        mode: a.search.into(),
        slo: a.slo,
        monotone: a.superset_bound,
        progress: Some(&report),
    };
    let req = ProvisionRequest {
        search,
        iterations: a.iterations,
        exhaustive: a.exhaustive,
        compare: a.compare,
        frontier_cap: a.frontier.then_some(a.frontier_cap),
    };
    let result = provision::provision(&req);
    progress.finish();
    let report = result.map_err(|e| match e {
        SolverError::DoesNotFit(m) => InputError(format!("{origin}: model does not fit: {m}")),
        other => InputError(other.to_string()),
    })?;
    Ok(match a.output {
        Output::Json => serde_json::to_string_pretty(&report).expect("report serialises"),
        Output::Table => render(&report),
    })
}

/// Long searches show progress: a bar on a terminal, a log line every few seconds elsewhere
/// (stderr, so `-o json` stays clean).
struct Progress {
    bar: Option<indicatif::ProgressBar>,
    last_log: std::sync::Mutex<std::time::Instant>,
}

impl Progress {
    fn new() -> Progress {
        use std::io::IsTerminal;
        let bar = std::io::stderr().is_terminal().then(|| {
            let b = indicatif::ProgressBar::new(0);
            b.set_style(
                indicatif::ProgressStyle::with_template("{spinner} allocations {pos}/{len} [{bar:30}] {msg} ({elapsed})")
                    .expect("valid template")
                    .progress_chars("=> "),
            );
            b
        });
        Progress { bar, last_log: std::sync::Mutex::new(std::time::Instant::now()) }
    }

    fn update(&self, p: &provision::Progress) {
        let best = p.best_cost.map_or("no allocation meets the SLO yet".to_string(), |c| format!("best ${c:.6} per iteration"));
        match &self.bar {
            Some(b) => {
                b.set_length(p.total);
                b.set_position(p.visited);
                b.set_message(format!("{} planned, {best}", p.planned));
            }
            None => {
                let mut last = self.last_log.lock().expect("progress lock");
                if last.elapsed() >= std::time::Duration::from_secs(5) {
                    *last = std::time::Instant::now();
                    eprintln!("provision: {} of {} allocations looked at, {} planned, {best}", p.visited, p.total, p.planned);
                }
            }
        }
    }

    fn finish(&self) {
        if let Some(b) = &self.bar {
            b.finish_and_clear();
        }
    }
}

/// "4 x A30 + 2 x A6000".
fn alloc_text(lines: &[AllocationLine]) -> String {
    lines.iter().map(|l| format!("{} x {}", l.gpus, crate::table::escape(&l.offer))).collect::<Vec<_>>().join(" + ")
}

fn render(r: &ProvisionReport) -> String {
    let mut out = String::new();
    let alloc = alloc_text(&r.allocation);
    out.push_str(&format!(
        "Rent {alloc} ({} GPUs, ${:.2}/h) for {}: {:.3} s per iteration (SLO {} s), ${:.6} per iteration, ${:.2} for {} iteration(s) ({:.2} h)\n",
        r.gpus, r.price_per_hour, r.model, r.iteration_time_s, r.slo_s, r.cost_per_iteration, r.total_cost, r.iterations, r.total_hours
    ));
    let s = &r.search;
    out.push_str(&format!(
        "search: {} over {} allocations, {} planned ({} cut by memory, {} by time, {} by cost, {} by a planned superset); planner {}{}\n\n",
        s.method,
        s.allocations,
        s.planned,
        s.memory_pruned,
        s.time_pruned,
        s.cost_pruned,
        s.superset_pruned,
        s.planner,
        if s.proven_optimal {
            ", proven optimal"
        } else if s.allocation_search_exact {
            "; exact over allocations given the planner's times"
        } else {
            "; superset bound on a fast planner: best found (drop --superset-bound for the exact allocation search)"
        }
    ));
    out.push_str(&crate::table::render(&r.plan, false));
    if let Some(c) = &r.compare {
        out.push_str("\n\nCompared with (same cost model, same SLO):\n");
        let mut t = Table::new();
        t.load_preset(UTF8_FULL_CONDENSED);
        t.set_header(vec!["strategy", "allocation", "s / iteration", "$ / iteration", "Motley saves"]);
        for (name, p) in [("homogeneous (Sia-style)", &c.homogeneous), ("Espresso-style placement, same GPUs", &c.espresso_placement)] {
            match p {
                Some(p) => t.add_row(vec![
                    name.to_string(),
                    alloc_text(&p.allocation),
                    format!("{:.3}", p.iteration_time_s),
                    format!("{:.6}", p.cost_per_iteration),
                    if p.meets_slo { format!("{:.1}%", p.savings_vs_this.unwrap_or(0.0) * 100.0) } else { "misses the SLO".into() },
                ]),
                None => t.add_row(vec![name.to_string(), "none meets the SLO or fits".into(), "-".into(), "-".into(), "-".into()]),
            };
        }
        out.push_str(&t.to_string());
    }
    if let Some(f) = &r.frontier {
        out.push_str("\n\nPareto frontier (iteration time vs cost):\n");
        let mut t = Table::new();
        t.load_preset(UTF8_FULL_CONDENSED);
        t.set_header(vec!["allocation", "GPUs", "s / iteration", "$ / iteration", "meets SLO"]);
        for p in f {
            t.add_row(vec![
                alloc_text(&p.allocation),
                p.gpus.to_string(),
                format!("{:.3}", p.iteration_time_s),
                format!("{:.6}", p.cost_per_iteration),
                if p.iteration_time_s <= r.slo_s { "yes" } else { "no" }.to_string(),
            ]);
        }
        out.push_str(&t.to_string());
    }
    out
}
