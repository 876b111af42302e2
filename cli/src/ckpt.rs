//! `motley ckpt list JOB` and `motley ckpt show JOB [--step S]`: the coordinator's
//! checkpoint-location bitmap of a job (which file of which step each node holds, in which
//! tier), over the REST API.

use std::collections::BTreeSet;

use serde_json::Value;

use crate::inputs::InputError;
use crate::remote::{render, s, Client, Remote};

#[derive(clap::Subcommand)]
pub enum CkptCommand {
    /// The job's checkpoint steps some node holds, newest first: files, bytes, nodes, and
    /// whether the step is complete (restorable).
    List {
        job: i64,
        #[command(flatten)]
        remote: Remote,
    },
    /// One step as a grid: a row per unit (layers, part, TP shard) and rank file, a column per
    /// node, the tier each node holds it in (default step: the newest complete one).
    Show {
        job: i64,
        #[arg(long)]
        step: Option<i64>,
        #[command(flatten)]
        remote: Remote,
    },
}

fn steps_table(v: &Value) -> String {
    let rows: Vec<Vec<String>> = v
        .as_array()
        .into_iter()
        .flatten()
        .map(|st| {
            let nodes: Vec<String> = st["nodes"].as_array().into_iter().flatten().map(s).collect();
            let complete = if st["complete"] == true { "yes".to_string() } else { format!("no: {}", s(&st["missing"])) };
            vec![s(&st["step"]), s(&st["files"]), bytes(st["bytes"].as_i64().unwrap_or(0)), nodes.join(","), complete]
        })
        .collect();
    if rows.is_empty() {
        return "no node holds a checkpoint of this job".into();
    }
    crate::table::simple(vec!["step", "files", "bytes", "nodes", "complete"], rows)
}

fn grid_table(v: &Value) -> String {
    let nodes: Vec<String> = v["nodes"].as_array().into_iter().flatten().map(s).collect();
    let mut header = vec!["unit", "bytes"];
    header.extend(nodes.iter().map(String::as_str));
    let rows: Vec<Vec<String>> = v["rows"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|r| {
            let mut row = vec![s(&r["unit"]), bytes(r["bytes"].as_i64().unwrap_or(0))];
            for n in &nodes {
                let tiers: BTreeSet<String> = r["held"][n].as_array().into_iter().flatten().map(s).collect();
                row.push(if tiers.is_empty() { "-".into() } else { tiers.into_iter().collect::<Vec<_>>().join("+") });
            }
            row
        })
        .collect();
    let complete = if v["complete"] == true { "complete".to_string() } else { format!("incomplete: {}", s(&v["missing"])) };
    format!("step {} ({complete})\n{}", s(&v["step"]), crate::table::simple(header, rows))
}

fn bytes(b: i64) -> String {
    match b {
        b if b >= 1 << 30 => format!("{:.1} GiB", b as f64 / (1u64 << 30) as f64),
        b if b >= 1 << 20 => format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64),
        b if b >= 1 << 10 => format!("{:.1} KiB", b as f64 / 1024.0),
        b => format!("{b} B"),
    }
}

pub fn run(cmd: CkptCommand) -> Result<String, InputError> {
    match cmd {
        CkptCommand::List { job, remote } => {
            let v = Client::new(&remote)?.call("GET", &format!("/jobs/{job}/checkpoints"), None)?;
            Ok(render(remote.output, &v, steps_table))
        }
        CkptCommand::Show { job, step, remote } => {
            let query = step.map_or(String::new(), |s| format!("?step={s}"));
            let v = Client::new(&remote)?.call("GET", &format!("/jobs/{job}/checkpoints/grid{query}"), None)?;
            Ok(render(remote.output, &v, grid_table))
        }
    }
}
