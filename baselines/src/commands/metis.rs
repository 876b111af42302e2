//! `motley-baselines metis eval|search`: Metis's inputs, priced and searched by Motley. The flags and
//! the `-o json` fields are a contract (README.md, `motley-baselines metis`); more may be added, none renamed.
//! The inputs are read by `metis_inputs`; `--cost-model motley` is `metis_motley`'s.

use std::path::Path;

use crate::metis::{self, MetisPlan, Space};
use clap::{Args, Subcommand, ValueEnum};
use serde_json::json;

use super::metis_inputs::{load, read, Loaded, MetisInputs};
use motley::inputs::InputError;
pub use motley::inputs::Output;

#[derive(Args)]
pub struct MetisArgs {
    #[command(subcommand)]
    pub command: MetisCommand,
}

#[derive(Subcommand)]
pub enum MetisCommand {
    /// Price one plan (Metis's JSON form) under Metis's cost model.
    Eval(EvalArgs),
    /// Find the cheapest plan of Metis's space or of its union with Motley's.
    Search(SearchArgs),
}

#[derive(Args)]
pub struct EvalArgs {
    #[command(flatten)]
    pub inputs: MetisInputs,
    /// The plan: JSON text, or a file holding it.
    #[arg(long)]
    pub plan: String,
    /// metis: Metis's estimator (default); motley: Motley's, pricing the plan as what it
    /// physically is (TP across nodes over the NIC, mixed replicas at their slowest GPU).
    #[arg(long, value_enum, default_value_t = CostModelArg::Metis)]
    pub cost_model: CostModelArg,
}

#[derive(Clone, Copy, ValueEnum, PartialEq, Eq)]
pub enum SpaceArg {
    Metis,
    Union,
}

#[derive(Clone, Copy, ValueEnum, PartialEq, Eq)]
pub enum CostModelArg {
    Metis,
    Motley,
}

#[derive(Args)]
pub struct SearchArgs {
    #[command(flatten)]
    pub inputs: MetisInputs,
    #[arg(long, value_enum, default_value_t = SpaceArg::Metis)]
    pub space: SpaceArg,
    #[arg(long, value_enum, default_value_t = CostModelArg::Metis)]
    pub cost_model: CostModelArg,
    /// Metis's --min_group_scale_variance: stage groups are at least this x max(N/S, S/N).
    #[arg(long, default_value_t = 1.0)]
    pub variance: f64,
    /// Most partial plans the search may visit before it stops with the best so far
    /// (default 200M under Metis's model, 5M under Motley's, whose plans cost more to price).
    #[arg(long)]
    pub budget: Option<u64>,
    /// exact: Motley's branch and bound. metis / improved-metis: replay Metis's own walk with
    /// Metis's or ImprovedMetis's out-of-memory repair rule (Metis's space only).
    #[arg(long, value_enum, default_value_t = Method::Exact)]
    pub method: Method,
}

#[derive(Clone, Copy, ValueEnum, PartialEq, Eq)]
pub enum Method {
    Exact,
    Metis,
    ImprovedMetis,
}

fn parse_plan(arg: &str) -> Result<MetisPlan, InputError> {
    let text = if arg.trim_start().starts_with('{') { arg.to_string() } else { read(Path::new(arg), "plan")? };
    let de = &mut serde_json::Deserializer::from_str(&text);
    serde_path_to_error::deserialize(de).map_err(|e| {
        let path = e.path().to_string();
        InputError(format!("--plan: {path}: {}", e.into_inner()))
    })
}

fn cost_table(cost: &metis::MetisCost) -> String {
    let t = &cost.terms;
    let mut out = format!(
        "cost {:.2} ms per iteration under Metis's model; memory {}\n",
        cost.cost_ms,
        if cost.fits { "fits" } else { "DOES NOT FIT" }
    );
    out += &format!(
        "  execution {:.2}  fb_sync {:.2}  pp {:.2}  dp {:.2}  update {:.2}  batch generator {:.2}\n",
        t.execution_ms, t.fb_sync_ms, t.pp_ms, t.dp_ms, t.update_ms, t.batch_generator_ms
    );
    for (s, ((ms, mem), cap)) in t.stage_ms.iter().zip(&t.stage_memory_mb).zip(&t.stage_capacity_mb).enumerate() {
        out += &format!("  stage {s}: {ms:.2} ms per micro-batch, memory {mem:.0} of {cap:.0} MiB\n");
    }
    out
}

pub fn run_eval(a: EvalArgs) -> Result<String, InputError> {
    let loaded = load(&a.inputs)?;
    let plan = parse_plan(&a.plan)?;
    if a.cost_model == CostModelArg::Motley {
        return super::metis_motley::eval(&loaded, &plan, a.inputs.output == Output::Json);
    }
    let cost = loaded.model().evaluate(&plan).map_err(|e| InputError(e.to_string()))?;
    Ok(match a.inputs.output {
        Output::Json => serde_json::to_string_pretty(&json!({
            "cost_ms": cost.cost_ms, "fits": cost.fits, "terms": cost.terms, "quirks": loaded.quirks,
            "constants_from": loaded.profiles.constants.source,
        }))
        .expect("serialises"),
        Output::Table => cost_table(&cost),
    })
}

pub fn run_search(a: SearchArgs) -> Result<String, InputError> {
    if !(a.variance >= 0.0 && a.variance.is_finite()) {
        return Err(InputError("--variance: must be a non-negative number (Metis uses 1; 0 removes the floor)".into()));
    }
    let loaded = load(&a.inputs)?;
    if a.cost_model == CostModelArg::Motley {
        if a.method != Method::Exact {
            return Err(InputError("--method: Metis's walk prices with Metis's model; use --cost-model metis".into()));
        }
        let budget = a.budget.unwrap_or(5_000_000);
        return super::metis_motley::run(&loaded, a.space == SpaceArg::Union, a.variance, budget, a.inputs.output == Output::Json);
    }
    if a.method != Method::Exact {
        return run_walk(&loaded, &a);
    }
    let space = match a.space {
        SpaceArg::Metis => Space::Metis { variance: a.variance },
        SpaceArg::Union => Space::Union,
    };
    let model = loaded.model();
    let out = metis::search(&model, space, a.budget.unwrap_or(200_000_000));
    let Some((plan, cost)) = &out.best else {
        return Err(InputError("no plan of this space fits in memory with the profiled (tp, batch) sizes".into()));
    };
    Ok(match a.inputs.output {
        Output::Json => serde_json::to_string_pretty(&json!({
            "cost_ms": cost.cost_ms, "plans_costed": out.plans_costed, "plan": plan,
            "fits": cost.fits, "terms": cost.terms, "space": space, "cost_model": "metis",
            "nodes": out.nodes, "tasks": out.tasks, "tasks_pruned": out.tasks_pruned,
            "proven_optimal": out.proven_optimal, "quirks": loaded.quirks,
        }))
        .expect("serialises"),
        Output::Table => format!(
            "{}plan {}\nsearched {} plans costed, {} partial plans, {} of {} tasks cut by the bound; {}\n",
            cost_table(cost),
            serde_json::to_string(plan).expect("serialises"),
            out.plans_costed,
            out.nodes,
            out.tasks_pruned,
            out.tasks,
            if out.proven_optimal { "no plan of the space is cheaper" } else { "budget reached: best found, not proven" }
        ),
    })
}

fn run_walk(loaded: &Loaded, a: &SearchArgs) -> Result<String, InputError> {
    if a.space != SpaceArg::Metis {
        return Err(InputError("--method: Metis's walk searches only Metis's space; use --space metis or --method exact".into()));
    }
    let repair = if a.method == Method::Metis { metis::walk::Repair::Metis } else { metis::walk::Repair::MostOutOfMemory };
    let model = loaded.model();
    let out = metis::walk::walk(&model, a.variance, repair);
    let Some((plan, _)) = &out.best else {
        return Err(InputError("Metis's walk found no plan that fits".into()));
    };
    let cost = model.evaluate(plan).map_err(|e| InputError(e.to_string()))?;
    let c = &out.counters;
    Ok(match a.inputs.output {
        Output::Json => serde_json::to_string_pretty(&json!({
            "cost_ms": cost.cost_ms, "plans_costed": c.plans_costed, "plan": plan, "fits": cost.fits, "terms": cost.terms,
            "space": Space::Metis { variance: a.variance }, "cost_model": "metis", "method": repair, "counters": c,
            "proven_optimal": false, "quirks": loaded.quirks,
        }))
        .expect("serialises"),
        Output::Table => format!(
            "{}plan {}\nMetis's walk ({}): {} plans costed, {} search steps, {} inter-stage plans, {} mutations, {} failed memory checks\n",
            cost_table(&cost),
            serde_json::to_string(plan).expect("serialises"),
            if repair == metis::walk::Repair::Metis { "Metis's repair" } else { "ImprovedMetis's repair" },
            c.plans_costed,
            c.count,
            c.inter_stage_plans,
            c.strategy_mutations,
            c.failed_memory_checks
        ),
    })
}
