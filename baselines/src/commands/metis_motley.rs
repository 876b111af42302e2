//! `motley-baselines metis ... --cost-model motley`: Metis's inputs priced and planned with Motley's
//! own cost model (baselines/src/metis/motley_view.rs says how the inputs are translated).

use crate::metis::motley_search::search_metis_space;
use crate::metis::motley_view::{motley_view, MotleyView};
use crate::metis::MetisPlan;
use motley_solver::{PlanOptions, PlanRequest, SearchMode};
use serde_json::json;

use super::metis_inputs::Loaded;
use motley::inputs::InputError;

fn opts(loaded: &Loaded) -> PlanOptions {
    PlanOptions { global_batch: loaded.settings.global_batch, ..PlanOptions::default() }
}

fn view(loaded: &Loaded) -> Result<MotleyView, InputError> {
    motley_view(&loaded.model()).map_err(|e| InputError(e.to_string()))
}

/// `motley-baselines metis eval --cost-model motley`.
pub fn eval(loaded: &Loaded, plan: &MetisPlan, json_out: bool) -> Result<String, InputError> {
    let v = view(loaded)?;
    let price = v.price(&loaded.model(), &opts(loaded), plan).map_err(|e| InputError(format!("Motley's model refuses the plan: {e}")))?;
    Ok(if json_out {
        serde_json::to_string_pretty(&json!({
            "cost_ms": price.iteration_ms, "fits": price.fits, "notes": price.notes, "cost_model": "motley",
        }))
        .expect("serialises")
    } else {
        let mut s = format!(
            "cost {:.2} ms per iteration under Motley's model; memory {}\n",
            price.iteration_ms,
            if price.fits { "fits" } else { "DOES NOT FIT" }
        );
        for n in &price.notes {
            s += &format!("  {n}\n");
        }
        s
    })
}

/// `motley-baselines metis search --cost-model motley`.
pub fn run(loaded: &Loaded, union: bool, variance: f64, budget: u64, json_out: bool) -> Result<String, InputError> {
    let v = view(loaded)?;
    let o = opts(loaded);
    let model = loaded.model();
    let metis_space = search_metis_space(&model, &v, &o, variance, budget);
    let motley = if union {
        let req = PlanRequest {
            cluster: &v.cluster,
            model: &v.model,
            profiles: &v.profiles,
            opts: &o,
            mode: SearchMode::Auto,
            exhaustive: false,
            seeds: vec![],
        };
        motley_solver::plan(&req).ok()
    } else {
        None
    };
    let metis_ms = metis_space.best.as_ref().map(|(_, p)| p.iteration_ms);
    let motley_ms = motley.as_ref().map(|r| r.iteration_time_s * 1e3);
    let use_motley = match (metis_ms, motley_ms) {
        (Some(a), Some(b)) => b < a,
        (None, Some(_)) => true,
        _ => false,
    };
    let space = if union { "union" } else { "metis" };
    if use_motley {
        let r = motley.expect("checked");
        let plans_costed = metis_space.plans_costed + r.search.plans_costed;
        return Ok(if json_out {
            serde_json::to_string_pretty(&json!({
                "cost_ms": r.iteration_time_s * 1e3, "plans_costed": plans_costed, "plan": r, "plan_form": "motley",
                "fits": true, "space": space, "cost_model": "motley", "metis_space_best_ms": metis_ms,
                "proven_optimal": r.search.proven_optimal && metis_space.proven_optimal,
            }))
            .expect("serialises")
        } else {
            format!(
                "cost {:.2} ms per iteration under Motley's model (Motley's plan; best of Metis's space {}):\n{}",
                r.iteration_time_s * 1e3,
                metis_ms.map(|m| format!("{m:.2} ms")).unwrap_or("none".into()),
                motley::table::render(&r, false)
            )
        });
    }
    let Some((plan, price)) = metis_space.best else {
        return Err(InputError("no plan of this space fits in memory under Motley's model".into()));
    };
    Ok(if json_out {
        serde_json::to_string_pretty(&json!({
            "cost_ms": price.iteration_ms, "plans_costed": metis_space.plans_costed, "plan": plan, "plan_form": "metis",
            "fits": price.fits, "notes": price.notes, "space": space, "cost_model": "motley", "nodes": metis_space.nodes,
            "proven_optimal": metis_space.proven_optimal, "motley_plan_ms": motley_ms,
        }))
        .expect("serialises")
    } else {
        format!(
            "cost {:.2} ms per iteration under Motley's model\nplan {}\nsearched {} plans costed, {} partial plans; {}\n",
            price.iteration_ms,
            serde_json::to_string(&plan).expect("serialises"),
            metis_space.plans_costed,
            metis_space.nodes,
            if metis_space.proven_optimal { "no plan of Metis's space is cheaper under Motley's model" } else { "budget reached" }
        )
    })
}
