//! `motley profile ...`: the layer profiles the coordinator stores (measured by agents with
//! `python -m motley_torch.profile`) and profile runs on agents, over the REST API.

use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::inputs::{InputError, Output};
use crate::remote::{render, s, Client, Remote};

#[derive(clap::Subcommand)]
pub enum ProfileCommand {
    /// Every stored profile (newest first).
    List {
        /// Only the profiles of this model (its name).
        #[arg(long)]
        model: Option<String>,
        #[command(flatten)]
        remote: Remote,
    },
    /// One stored profile: a profiles file (`motley plan --profiles`) holding its entry, or with
    /// -o json its whole record.
    Show {
        id: i64,
        #[command(flatten)]
        remote: Remote,
    },
    /// Measure a profile now on a live agent that can profile (one started with --python).
    Run {
        /// A catalog model name or a model file (YAML, `motley plan --model`'s schema).
        #[arg(long)]
        model: String,
        /// Tensor-parallel degree (the TP ranks run together on one node).
        #[arg(long)]
        tp: u32,
        /// Sequences per micro-batch.
        #[arg(long)]
        micro_batch: u32,
        /// Tokens per sequence (default: the model's).
        #[arg(long)]
        seq_len: Option<u64>,
        /// What the profiler measures in: fp32, bf16 or fp16 (default fp32).
        #[arg(long)]
        dtype: Option<String>,
        /// Only a node of this GPU type.
        #[arg(long)]
        gpu: Option<String>,
        /// Only this node.
        #[arg(long)]
        node: Option<String>,
        /// Wait until the run has ended; exit 1 if it failed.
        #[arg(long)]
        wait: bool,
        #[command(flatten)]
        remote: Remote,
    },
    /// The profile runs the leading coordinator sent, newest first.
    Runs(Remote),
}

/// The model as the request carries it: a catalog name as it is, a file's fields as JSON.
fn model_value(name_or_file: &str) -> Result<Value, InputError> {
    if motley_solver::model::model_by_name(name_or_file).is_some() || !Path::new(name_or_file).exists() {
        return Ok(Value::String(name_or_file.to_string()));
    }
    // A Hugging Face directory here: its spec inline (the coordinator may be elsewhere).
    if let Some(hf) = crate::inputs::hf_model(Path::new(name_or_file)) {
        return Ok(serde_json::to_value(hf?.0).expect("a model serialises"));
    }
    let text = std::fs::read_to_string(name_or_file).map_err(|e| InputError(format!("--model: cannot read {name_or_file}: {e}")))?;
    let spec: motley_solver::ModelSpec = crate::inputs::parse_yaml(&text, name_or_file)?;
    Ok(serde_json::to_value(spec).expect("a model serialises"))
}

fn profiles_table(v: &Value, model: Option<&str>) -> String {
    let rows = v
        .as_array()
        .into_iter()
        .flatten()
        .filter(|p| model.is_none_or(|m| p["model"].as_str().is_some_and(|n| n.eq_ignore_ascii_case(m))))
        .map(|p| {
            let hash = p["model_hash"].as_str().unwrap_or("");
            let entry = &p["entry"];
            vec![
                s(&p["id"]),
                s(&p["gpu"]),
                format!("{} ({})", s(&p["model"]), &hash[..hash.len().min(8)]),
                s(&p["tp"]),
                s(&p["micro_batch"]),
                s(&p["seq_len"]),
                s(&p["dtype"]),
                format!("{:.3}", entry["fwd_ms"].as_f64().unwrap_or(f64::NAN)),
                format!("{:.3}", entry["bwd_ms"].as_f64().unwrap_or(f64::NAN)),
                s(&p["torch"]),
                s(&p["node"]),
            ]
        })
        .collect();
    crate::table::simple(
        vec!["id", "gpu", "model (hash)", "tp", "micro-batch", "seq", "dtype", "fwd ms/layer", "bwd ms/layer", "torch", "node"],
        rows,
    )
}

fn run_line(v: &Value) -> String {
    let state = match v["state"].as_str() {
        Some("stored") => format!("stored as profile {}", s(&v["profile"])),
        Some("failed") => format!("failed: {}", s(&v["reason"])),
        other => other.unwrap_or("?").to_string(),
    };
    format!(
        "request {}: {} tp {} micro-batch {} of {} on node {} (GPUs {}): {state}",
        s(&v["request"]),
        s(&v["gpu"]),
        s(&v["tp"]),
        s(&v["micro_batch"]),
        s(&v["model"]),
        s(&v["node"]),
        v["gpus"].as_array().map(|g| g.iter().map(s).collect::<Vec<_>>().join(",")).unwrap_or_default()
    )
}

/// Run a `motley profile` command; the output, and whether it succeeded (`run --wait` of a run
/// that failed did not).
pub fn run(cmd: ProfileCommand) -> Result<(String, bool), InputError> {
    match cmd {
        ProfileCommand::List { model, remote } => {
            let v = Client::new(&remote)?.call("GET", "/profiles", None)?;
            Ok((render(remote.output, &v, |v| profiles_table(v, model.as_deref())), true))
        }
        ProfileCommand::Show { id, remote } => {
            let v = Client::new(&remote)?.call("GET", &format!("/profiles/{id}"), None)?;
            let text = render(remote.output, &v, |v| {
                let file = serde_json::json!({ "profiles": [v["entry"].clone()] });
                format!(
                    "# profile {} measured on node {} (torch {}, {})\n{}",
                    s(&v["id"]),
                    s(&v["node"]),
                    s(&v["torch"]),
                    s(&v["device"]),
                    serde_norway::to_string(&file).expect("YAML serialises")
                )
            });
            Ok((text, true))
        }
        ProfileCommand::Runs(remote) => {
            let v = Client::new(&remote)?.call("GET", "/profiles/runs", None)?;
            let text = render(remote.output, &v, |v| {
                let lines: Vec<String> = v.as_array().into_iter().flatten().map(run_line).collect();
                if lines.is_empty() {
                    "no profile runs".into()
                } else {
                    lines.join("\n")
                }
            });
            Ok((text, true))
        }
        ProfileCommand::Run { model, tp, micro_batch, seq_len, dtype, gpu, node, wait, remote } => {
            let body = serde_json::json!({
                "model": model_value(&model)?, "tp": tp, "micro_batch": micro_batch, "seq_len": seq_len,
                "dtype": dtype, "gpu": gpu, "node": node,
            });
            let client = Client::new(&remote)?;
            let mut v = client.call("POST", "/profiles/runs", Some(&body.to_string()))?;
            if wait {
                let interval = Duration::from_millis(500);
                let mut said = Instant::now();
                while v["state"] == "running" {
                    if remote.output == Output::Table && said.elapsed() > Duration::from_secs(10) {
                        eprintln!("{}", run_line(&v));
                        said = Instant::now();
                    }
                    std::thread::sleep(interval);
                    v = client.call("GET", &format!("/profiles/runs/{}", s(&v["request"])), None)?;
                }
            }
            let ok = v["state"] != "failed";
            Ok((render(remote.output, &v, run_line), ok))
        }
    }
}
