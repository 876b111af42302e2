//! `motley restore-plan --scenario FILE`: the restore planner offline. The scenario
//! file (a contract, docs/restore.md) names the nodes and their rates, the step's units, who
//! holds which shards where and what each node of the new plan needs; the command prints the
//! lower bound, the plan's makespan, bytes by source and the transfers.

use std::path::PathBuf;

use motley_solver::restore::{plan_restore, RestorePlan, RestoreScenario};

use crate::inputs::{in_file, parse_yaml, InputError, Output};
use crate::table::{escape, simple};

#[derive(clap::Args)]
pub struct RestorePlanArgs {
    /// Scenario file (YAML or JSON; format in docs/restore.md).
    #[arg(long)]
    scenario: PathBuf,
    /// Output format.
    #[arg(short = 'o', long, value_enum, default_value_t = Output::Table, env = "MOTLEY_OUTPUT")]
    output: Output,
    /// Transfers listed in the table (all of them in JSON).
    #[arg(long, default_value_t = 40)]
    max_rows: usize,
}

/// Parse and plan a scenario's text; `origin` names it in errors.
pub fn plan_text(text: &str, origin: &str) -> Result<RestorePlan, InputError> {
    let sc: RestoreScenario = parse_yaml(text, origin)?;
    plan_restore(&sc).map_err(|e| in_file(origin, e))
}

pub fn run(a: RestorePlanArgs) -> Result<String, InputError> {
    let origin = a.scenario.display().to_string();
    let text = std::fs::read_to_string(&a.scenario).map_err(|e| InputError(format!("{origin}: cannot read scenario file: {e}")))?;
    let plan = plan_text(&text, &origin)?;
    Ok(match a.output {
        Output::Json => serde_json::to_string_pretty(&plan).expect("a restore plan serialises"),
        Output::Table => render(&plan, a.max_rows),
    })
}

fn gb(b: u64) -> String {
    format!("{:.3}", b as f64 / 1e9)
}

fn render(p: &RestorePlan, max_rows: usize) -> String {
    let mut out = String::new();
    let name = if p.scenario.is_empty() { String::new() } else { format!(" {}", escape(&p.scenario)) };
    out.push_str(&format!(
        "Restore{name}: lower bound {:.3} s (delivery {:.3} s, origin {:.3} s) | plan makespan {:.3} s ({:.2}x the bound, bottleneck {}) | cloud-only {:.3} s ({:.2}x the plan)\n",
        p.lower_bound_s,
        p.bound.delivery_s,
        p.bound.origin_s,
        p.makespan_s,
        if p.lower_bound_s > 0.0 { p.makespan_s / p.lower_bound_s } else { 1.0 },
        escape(&p.bottleneck),
        p.cloud_only_s,
        if p.makespan_s > 0.0 { p.cloud_only_s / p.makespan_s } else { 1.0 },
    ));
    let t = &p.bytes_by_tier;
    out.push_str(&simple(
        vec!["GB from", "local memory", "local disk", "peer memory", "peer disk", "cloud"],
        vec![vec!["bytes".into(), gb(t.local_memory), gb(t.local_disk), gb(t.peer_memory), gb(t.peer_disk), gb(t.cloud)]],
    ));
    out.push('\n');
    let rows = p
        .transfers
        .iter()
        .take(max_rows)
        .map(|x| {
            vec![
                x.from.clone(),
                x.to.clone(),
                format!("{:?}{}", x.kind, if x.relay { " (relay)" } else { "" }).to_lowercase(),
                format!("{:?}", x.tier).to_lowercase(),
                x.layer.clone(),
                format!("{:?}", x.part).to_lowercase(),
                x.offset.to_string(),
                gb(x.bytes),
                x.source_shard.map_or_else(String::new, |s| format!("{}/{} +{}", s.tp_rank, s.tp_size, s.offset)),
                format!("{:.0}", x.rate_mb_s),
            ]
        })
        .collect();
    out.push_str(&simple(vec!["from", "to", "kind", "tier", "layer", "part", "offset", "GB", "shard file", "MB/s"], rows));
    if p.transfers.len() > max_rows {
        out.push_str(&format!("\n... {} more transfers (--max-rows, or -o json for all)", p.transfers.len() - max_rows));
    }
    out
}
