//! `motley node ...` and `motley job ...`: the coordinator's REST API (through `client`) for
//! people (tables) and scripts (`-o json`).

use std::path::PathBuf;
use std::time::Duration;

use motley_contract::views::{JobView, NodeLoad, NodeView};
use serde_json::Value;

use crate::inputs::{InputError, Output};
use crate::{exit, Outcome};

pub(crate) use crate::client::path_segment;
pub use crate::client::{Client, Remote, DEFAULT_TIMEOUT_S};

#[derive(clap::Subcommand)]
pub enum NodeCommand {
    /// Every node of the inventory.
    List(Remote),
    /// One node's inventory and state.
    Describe {
        name: String,
        #[command(flatten)]
        remote: Remote,
    },
    /// Declare a node from a cluster-file node entry (YAML), as an agent's --inventory would.
    Add {
        name: String,
        /// The node entry: gpu, gpus, nics, rdma_domain, ...
        entry: PathBuf,
        #[command(flatten)]
        remote: Remote,
    },
    /// Give the node no new ranks. Jobs that checkpoint and have max_preemptions left move off
    /// it; the others keep running there.
    Drain {
        /// One node, or several at once (a whole allocation).
        #[arg(required = true, value_name = "NAME")]
        names: Vec<String>,
        /// The node goes away after this long (a preemption notice: `90s`, `2m`): the jobs there
        /// save a checkpoint at their next step first and move off from it.
        #[arg(long, value_parser = humantime::parse_duration, value_name = "DURATION")]
        deadline: Option<std::time::Duration>,
        /// With --deadline: wait until every job with a rank on the nodes has saved a new step
        /// (whole in its checkpoint cloud when it names one) or ended; exit 1 if one saved
        /// nothing by the deadline (it resumes from its older step).
        #[arg(long, requires = "deadline")]
        wait: bool,
        #[command(flatten)]
        remote: Remote,
    },
    /// Let the node take ranks again.
    Undrain {
        name: String,
        #[command(flatten)]
        remote: Remote,
    },
    /// Forget the node (refused while ranks of an unfinished job are on it). An agent that
    /// registers under the name later declares it again.
    Remove {
        name: String,
        #[command(flatten)]
        remote: Remote,
    },
}

#[derive(clap::Subcommand)]
pub enum JobCommand {
    /// Submit a job file (YAML); planning starts on the live inventory.
    Submit {
        file: PathBuf,
        /// Plan the job on the live inventory and print the plan; store and launch nothing.
        #[arg(long)]
        dry_run: bool,
        #[command(flatten)]
        remote: Remote,
    },
    /// Every job.
    List(Remote),
    /// One job, with its current plan's ranks once launched.
    Show {
        id: i64,
        #[command(flatten)]
        remote: Remote,
    },
    /// The job's current plan and ranks (`-o json`: the plan document with its ranks).
    Plan {
        id: i64,
        /// Also draw the plan as a picture (SVG) into FILE, as `GET /api/v1/jobs/{id}/plan.svg`.
        #[arg(long, value_name = "FILE")]
        svg: Option<std::path::PathBuf>,
        #[command(flatten)]
        remote: Remote,
    },
    /// Print the job's events as they happen until it is over; exit 0 if it succeeded, 1 if it
    /// failed, 3 if it was cancelled, 75 if SIGTERM or SIGUSR1 stopped the watch first.
    #[command(after_help = crate::exit::HELP)]
    Watch {
        id: i64,
        #[command(flatten)]
        remote: Remote,
    },
    /// The ranks' output (stdout and stderr), fetched through the coordinator from their nodes.
    Logs {
        id: i64,
        /// Only this rank (default: every rank of the launch, each line prefixed with its rank).
        #[arg(long)]
        rank: Option<i64>,
        /// An older launch (default: the current one).
        #[arg(long)]
        generation: Option<i64>,
        /// Keep printing new output until the job is over.
        #[arg(short, long)]
        follow: bool,
        #[command(flatten)]
        remote: Remote,
    },
    /// Cancel the job.
    Cancel {
        id: i64,
        #[command(flatten)]
        remote: Remote,
    },
}

fn table(header: Vec<&str>, rows: Vec<Vec<String>>) -> String {
    crate::table::simple(header, rows)
}

/// A JSON value as text for people, its control characters escaped (see `table::escape`):
/// names, reasons and messages come from whoever registered the node or submitted the job.
pub(crate) fn s(v: &Value) -> String {
    match v {
        Value::String(x) => crate::table::escape(x).into_owned(),
        Value::Null => String::new(),
        other => other.to_string(),
    }
}

/// Text for people, its control characters escaped.
fn e(x: &str) -> String {
    crate::table::escape(x).into_owned()
}

/// An answer read as the coordinator's view type (motley-contract), or an error naming it.
pub(crate) fn typed<T: serde::de::DeserializeOwned>(v: &Value, what: &str) -> Result<T, InputError> {
    T::deserialize(v).map_err(|err| {
        InputError(format!("the coordinator's {what} does not read as this CLI's ({err}); are the CLI and the coordinator one version?"))
    })
}

fn nodes_table(nodes: &[NodeView]) -> String {
    let rows = nodes
        .iter()
        .map(|n| {
            let inv = &n.inventory;
            let nics: Vec<String> = inv["nics"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|x| format!("{} {} {}G", s(&x["name"]), s(&x["kind"]), x["gbps"].as_f64().unwrap_or(0.0)))
                .collect();
            let mut row = vec![
                e(&n.name),
                n.state.as_str().to_string(),
                if n.live { "yes" } else { "no" }.to_string(),
                // An emulated node's GPUs are CPU shares: said beside them, never taken for real.
                match inv["emulate"]["cpu"].as_f64() {
                    Some(cpu) => format!("{} x {} (emulated, {cpu} CPU each)", s(&inv["gpus"]), s(&inv["gpu"])),
                    None => format!("{} x {}", s(&inv["gpus"]), s(&inv["gpu"])),
                },
            ];
            row.extend(load_cells(n.load.as_ref()));
            row.extend([nics.join(", "), s(&inv["rdma_domain"]), n.agent_epoch.to_string()]);
            row
        })
        .collect();
    let header =
        ["node", "state", "live", "gpus", "ranks", "gpu util", "gpu memory", "work dir free", "load", "nics", "rdma domain", "agent epoch"];
    table(header.to_vec(), rows)
}

/// A node's last reported load as table cells: ranks, mean GPU utilisation, GPU memory used of
/// total, free disk in the work directory, load average ("-" where nothing was reported).
fn load_cells(load: Option<&NodeLoad>) -> [String; 5] {
    let Some(load) = load else { return ["-", "-", "-", "-", "-"].map(String::from) };
    let gpus = &load.gpus;
    let (util, memory) = if gpus.is_empty() {
        ("-".to_string(), "-".to_string())
    } else {
        let used: u64 = gpus.iter().map(|g| g.memory_used_bytes).sum();
        let total: u64 = gpus.iter().map(|g| g.memory_total_bytes).sum();
        let util: u64 = gpus.iter().map(|g| u64::from(g.utilization_percent)).sum();
        (format!("{}%", util / gpus.len() as u64), format!("{} / {}", bytes(used), bytes(total)))
    };
    [load.ranks_running.to_string(), util, memory, bytes(load.work_dir_free_bytes), format!("{:.2}", load.load_1m)]
}

/// Bytes for people: 1 GiB = 2^30 B.
fn bytes(b: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let (mut v, mut unit) = (b as f64, 0);
    while v >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{b} B")
    } else {
        format!("{v:.1} {}", UNITS[unit])
    }
}

/// A rank assignment as a table row: rank, node, gpu, replica, stage, layers.
fn assignment_row(a: &Value) -> Vec<String> {
    vec![
        s(&a["rank"]),
        s(&a["node"]),
        s(&a["gpu"]),
        s(&a["replica"]),
        s(&a["stage"]),
        format!("{}-{}", s(&a["layer_start"]), s(&a["layer_end"])),
    ]
}

fn jobs_table(jobs: &[JobView]) -> String {
    let rows = jobs
        .iter()
        .map(|j| {
            vec![
                j.id.to_string(),
                e(&j.name),
                match &j.membership {
                    // A degraded job: the share of the plan's throughput its members keep.
                    Some(m) => format!("{} {:.0}%", j.state, m.throughput_share * 100.0),
                    None => j.state.to_string(),
                },
                j.generation.to_string(),
                j.reason.as_deref().map(e).unwrap_or_default(),
            ]
        })
        .collect();
    table(vec!["id", "name", "state", "generation", "reason"], rows)
}

pub(crate) fn render(out: Output, v: &Value, human: impl Fn(&Value) -> String) -> String {
    match out {
        Output::Json => serde_json::to_string_pretty(v).expect("JSON serialises"),
        Output::Table => human(v),
    }
}

pub fn run_node(cmd: NodeCommand) -> Result<Outcome, InputError> {
    if let NodeCommand::Drain { names, deadline: Some(deadline), wait: true, remote } = cmd {
        let (text, saved) = crate::drain::drain_and_wait(&Client::new(&remote)?, &names, deadline)?;
        return Ok(Outcome { text, code: if saved { exit::SUCCESS } else { exit::JOB_FAILED } });
    }
    node_text(cmd).map(Outcome::from)
}

fn node_text(cmd: NodeCommand) -> Result<String, InputError> {
    match cmd {
        NodeCommand::List(r) => {
            let v = Client::new(&r)?.call("GET", "/nodes", None)?;
            let nodes: Vec<NodeView> = typed(&v, "node list")?;
            Ok(render(r.output, &v, |_| nodes_table(&nodes)))
        }
        NodeCommand::Describe { name, remote } => {
            let v = Client::new(&remote)?.call("GET", &format!("/nodes/{}", path_segment(&name)), None)?;
            Ok(render(remote.output, &v, |v| serde_json::to_string_pretty(v).expect("JSON serialises")))
        }
        NodeCommand::Add { name, entry, remote } => {
            let text =
                std::fs::read_to_string(&entry).map_err(|e| InputError(format!("{}: cannot read node entry: {e}", entry.display())))?;
            let v = Client::new(&remote)?.call("PUT", &format!("/nodes/{}", path_segment(&name)), Some(&text))?;
            Ok(render(remote.output, &v, |v| format!("node {} registered (agent epoch {})", s(&v["name"]), s(&v["agent_epoch"]))))
        }
        NodeCommand::Drain { names, deadline, remote, .. } => {
            // Whole seconds, at least one: a deadline is never sent as "none".
            let query = deadline.map_or(String::new(), |d| format!("?deadline_s={}", d.as_secs_f64().ceil().max(1.0) as u64));
            let c = Client::new(&remote)?;
            let mut out = vec![];
            for name in &names {
                let v = c.call("POST", &format!("/nodes/{}/drain{query}", path_segment(name)), None)?;
                out.push(render(remote.output, &v, |v| format!("node {} is {}", s(&v["name"]), s(&v["state"]))));
            }
            Ok(out.join("\n"))
        }
        NodeCommand::Undrain { name, remote } => {
            let v = Client::new(&remote)?.call("POST", &format!("/nodes/{}/undrain", path_segment(&name)), None)?;
            Ok(render(remote.output, &v, |v| format!("node {} is {}", s(&v["name"]), s(&v["state"]))))
        }
        NodeCommand::Remove { name, remote } => {
            let v = Client::new(&remote)?.call("DELETE", &format!("/nodes/{}", path_segment(&name)), None)?;
            Ok(render(remote.output, &v, |v| format!("node {} removed", s(&v["name"]))))
        }
    }
}

/// A job file whose `model:` names a Hugging Face model directory (or config.json) on this
/// machine (as given, else beside the job file) is sent with the model's spec inline, so a
/// coordinator on another machine plans it; any other file is sent as it is.
pub fn inline_hf_model(text: &str, file: &std::path::Path) -> Result<String, InputError> {
    let Ok(mut job) = serde_norway::from_str::<Value>(text) else { return Ok(text.to_string()) };
    let Some(name) = job.get("model").and_then(Value::as_str) else { return Ok(text.to_string()) };
    if motley_solver::model::model_by_name(name).is_some() {
        return Ok(text.to_string());
    }
    let given = std::path::Path::new(name);
    let beside = file.parent().filter(|_| given.is_relative()).map(|d| d.join(given));
    let Some(hf) = std::iter::once(given.to_path_buf()).chain(beside).find_map(|p| crate::inputs::hf_model(&p)) else {
        return Ok(text.to_string());
    };
    let (spec, _) = hf.map_err(|e| InputError(format!("{}: model: {}", file.display(), e.0)))?;
    job["model"] = serde_json::to_value(spec).expect("a model serialises");
    Ok(serde_json::to_string_pretty(&job).expect("a job serialises"))
}

pub fn run_job(cmd: JobCommand) -> Result<Outcome, InputError> {
    let text = match cmd {
        // The one command whose exit code is the job's outcome.
        JobCommand::Watch { id, remote } => return watch(id, &remote),
        JobCommand::Submit { file, dry_run, remote } => {
            let text = std::fs::read_to_string(&file).map_err(|e| InputError(format!("{}: cannot read job file: {e}", file.display())))?;
            let text = inline_hf_model(&text, &file)?;
            if dry_run {
                let v = Client::new(&remote)?
                    .call("POST", "/plan", Some(&text))
                    .map_err(|e| InputError(format!("{}: {}", file.display(), e.0)))?;
                render(remote.output, &v, |v| {
                    let rows = v["ranks"].as_array().into_iter().flatten().map(assignment_row).collect();
                    format!(
                        "dry run: {} GPUs, {:.3} s per iteration (nothing stored)\n{}",
                        s(&v["plan"]["gpus_used"]),
                        v["plan"]["iteration_time_s"].as_f64().unwrap_or(f64::NAN),
                        table(vec!["rank", "node", "gpu", "replica", "stage", "layers"], rows)
                    )
                })
            } else {
                let v = Client::new(&remote)?
                    .call("POST", "/jobs", Some(&text))
                    .map_err(|e| InputError(format!("{}: {}", file.display(), e.0)))?;
                render(remote.output, &v, |v| {
                    format!("job {} ({}) submitted; `motley job watch {}` follows it", s(&v["id"]), s(&v["name"]), s(&v["id"]))
                })
            }
        }
        JobCommand::List(r) => {
            let v = Client::new(&r)?.call("GET", "/jobs", None)?;
            let jobs: Vec<JobView> = typed(&v, "job list")?;
            render(r.output, &v, |_| jobs_table(&jobs))
        }
        JobCommand::Show { id, remote } => {
            let c = Client::new(&remote)?;
            let mut v = c.call("GET", &format!("/jobs/{id}"), None)?;
            if v["generation"].as_i64().unwrap_or(0) > 0 {
                v["launch"] = c.call("GET", &format!("/jobs/{id}/plan"), None)?;
            }
            let job: JobView = typed(&v, "job")?;
            render(remote.output, &v, |v| {
                let mut out = jobs_table(std::slice::from_ref(&job));
                if let Some(m) = &job.membership {
                    out.push_str(&format!("\nmembership: {}: {}", e(&m.summary()), e(&m.reason)));
                }
                if let Some(url) = &job.checkpoint_cloud {
                    out.push_str(&format!("\ncheckpoints: {}/GENERATION/step-S", e(url)));
                }
                if let Some(ranks) = v["launch"]["ranks"].as_array() {
                    let rows = ranks
                        .iter()
                        .map(|r| {
                            let mut row = assignment_row(&r["assignment"]);
                            row.push(s(&r["state"]));
                            row
                        })
                        .collect();
                    out.push('\n');
                    out.push_str(&table(vec!["rank", "node", "gpu", "replica", "stage", "layers", "state"], rows));
                }
                out
            })
        }
        JobCommand::Plan { id, svg, remote } => {
            let v = Client::new(&remote)?.call("GET", &format!("/jobs/{id}/plan"), None)?;
            if let Some(path) = &svg {
                crate::plan::write_svg(path, &v["plan"])?;
            }
            render(remote.output, &v, |v| {
                let rows = v["ranks"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .map(|r| {
                        let mut row = assignment_row(&r["assignment"]);
                        row.extend([s(&r["state"]), s(&r["exit_code"])]);
                        row
                    })
                    .collect();
                format!(
                    "job {} generation {}: {} GPUs, {:.3} s per iteration\n{}",
                    s(&v["job"]),
                    s(&v["generation"]),
                    s(&v["plan"]["gpus_used"]),
                    v["plan"]["iteration_time_s"].as_f64().unwrap_or(f64::NAN),
                    table(vec!["rank", "node", "gpu", "replica", "stage", "layers", "state", "exit code"], rows)
                )
            })
        }
        JobCommand::Logs { id, rank, generation, follow, remote } => logs(id, rank, generation, follow, &remote)?,
        JobCommand::Cancel { id, remote } => {
            let v = Client::new(&remote)?.call("POST", &format!("/jobs/{id}/cancel"), None)?;
            render(remote.output, &v, |v| format!("job {} is {}", s(&v["id"]), s(&v["state"])))
        }
    };
    Ok(Outcome::from(text))
}

/// The most log bytes the coordinator answers with at once (its `LOG_CHUNK`).
const LOG_CHUNK: usize = 4 << 20;

/// Print the ranks' logs from where each left off; with `follow`, poll until the job is over.
fn logs(id: i64, rank: Option<i64>, generation: Option<i64>, follow: bool, remote: &Remote) -> Result<String, InputError> {
    use std::io::Write;
    let c = Client::new(remote)?;
    let job = c.call("GET", &format!("/jobs/{id}"), None)?;
    let generation = generation.unwrap_or_else(|| job["generation"].as_i64().unwrap_or(0));
    if generation == 0 {
        return Err(InputError(format!("job {id} is {} and has no ranks yet; try `motley job watch {id}`", s(&job["state"]))));
    }
    let ranks: Vec<i64> = match rank {
        Some(r) => vec![r],
        None => {
            let plan = c.call("GET", &format!("/jobs/{id}/plan"), None)?;
            plan["ranks"].as_array().into_iter().flatten().filter_map(|r| r["assignment"]["rank"].as_i64()).collect()
        }
    };
    let mut offsets = vec![0usize; ranks.len()];
    // Partial lines wait for their end, so prefixes never land mid-line.
    let mut pending = vec![Vec::<u8>::new(); ranks.len()];
    loop {
        let over =
            ["succeeded", "failed", "cancelled"].contains(&c.call("GET", &format!("/jobs/{id}"), None)?["state"].as_str().unwrap_or(""));
        let mut more = false;
        for (i, r) in ranks.iter().enumerate() {
            let (status, bytes) =
                c.request("GET", &format!("/jobs/{id}/ranks/{r}/logs?generation={generation}&offset={}", offsets[i]), None)?;
            if status >= 400 {
                let msg = serde_json::from_slice::<Value>(&bytes).ok().and_then(|v| v["error"].as_str().map(str::to_string));
                let msg = msg.unwrap_or_else(|| String::from_utf8_lossy(&bytes).into_owned());
                // A rank not started yet has no log: wait for it when following.
                if status == 404 && follow && !over {
                    continue;
                }
                return Err(InputError(format!("rank {r}: coordinator ({status}): {msg}")));
            }
            offsets[i] += bytes.len();
            // The coordinator answers at most LOG_CHUNK bytes: a full answer means more.
            more |= bytes.len() >= LOG_CHUNK;
            pending[i].extend_from_slice(&bytes);
            let mut out = std::io::stdout().lock();
            while let Some(end) = pending[i].iter().position(|&b| b == b'\n') {
                let line: Vec<u8> = pending[i].drain(..=end).collect();
                if rank.is_none() {
                    let _ = write!(out, "[rank {r}] ");
                }
                let _ = out.write_all(&line);
            }
            if (!follow || over) && bytes.len() < LOG_CHUNK && !pending[i].is_empty() {
                let _ = writeln!(
                    out,
                    "{}{}",
                    if rank.is_none() { format!("[rank {r}] ") } else { String::new() },
                    String::from_utf8_lossy(&pending[i])
                );
                pending[i].clear();
            }
        }
        if more {
            continue;
        }
        if !follow || over {
            return Ok(String::new());
        }
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// One event as `motley job watch` prints it: `[kind] generation G: message`, the generation
/// left out where the event has none (a job's own events before its first launch).
fn event_line(e: &Value) -> String {
    let message = match membership_of(e) {
        Some(m) => crate::table::escape(&format!("{}: {}", m.summary(), m.reason)).into_owned(),
        None => s(&e["message"]),
    };
    match e["generation"].as_i64().filter(|&g| g > 0) {
        Some(g) => format!("[{}] generation {g}: {message}", s(&e["kind"])),
        None => format!("[{}] {message}", s(&e["kind"])),
    }
}

/// A `membership_changed` event's document (its message, JSON), read as the job's view shows it.
fn membership_of(e: &Value) -> Option<motley_contract::views::MembershipView> {
    if e["kind"].as_str() != Some("membership_changed") {
        return None;
    }
    serde_json::from_str(e["message"].as_str()?).ok()
}

/// Poll the job's events (every 200 ms) and print each once, until the job is over; the exit
/// code says how it ended (`exit::for_job_state`), or `exit::PREEMPTED` when SIGTERM or SIGUSR1
/// stopped the watch first (the machine it runs on is being taken; the job is not over).
fn watch(id: i64, remote: &Remote) -> Result<Outcome, InputError> {
    use std::io::Write;
    let stopped = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    for signal in [signal_hook::consts::SIGTERM, signal_hook::consts::SIGUSR1] {
        signal_hook::flag::register(signal, stopped.clone()).map_err(|e| InputError(format!("cannot handle signal {signal}: {e}")))?;
    }
    let c = Client::new(remote)?;
    let mut after = 0i64;
    loop {
        // The state first, the events after: a state change and its event commit together, so
        // once the state is final every event up to it is in this batch.
        let job = c.call("GET", &format!("/jobs/{id}"), None)?;
        let events = c.call("GET", &format!("/jobs/{id}/events?after={after}"), None)?;
        // A full page (the API answers at most 1000) means more are waiting: no pause, no end.
        let full = events.as_array().map_or(0, Vec::len) >= 1000;
        for e in events.as_array().into_iter().flatten() {
            after = after.max(e["seq"].as_i64().unwrap_or(after));
            let line = match remote.output {
                Output::Json => e.to_string(),
                Output::Table => event_line(e),
            };
            let _ = writeln!(std::io::stdout().lock(), "{line}");
        }
        if full {
            continue;
        }
        let state = job["state"].as_str().unwrap_or("");
        if ["succeeded", "failed", "cancelled"].contains(&state) {
            let reason = job["reason"].as_str().map_or(String::new(), |r| format!(": {}", crate::table::escape(r)));
            return Ok(Outcome { text: format!("job {id} {}{reason}", s(&job["state"])), code: exit::for_job_state(state) });
        }
        if stopped.load(std::sync::atomic::Ordering::SeqCst) {
            return Ok(Outcome {
                text: format!(
                    "job {id} is {}: the watch was stopped by a signal (preempted); the job resumes from its newest complete step",
                    s(&job["state"])
                ),
                code: exit::PREEMPTED,
            });
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_job_naming_a_local_hugging_face_directory_is_sent_with_the_spec_inline() {
        let root = std::env::temp_dir().join(format!("motley-submit-{}", std::process::id()));
        let dir = root.join("Tiny-Qwen");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(
            dir.join("config.json"),
            r#"{"architectures": ["Qwen2ForCausalLM"], "hidden_size": 256, "intermediate_size": 688, "num_attention_heads": 4,
                "num_hidden_layers": 2, "vocab_size": 1000, "max_position_embeddings": 512}"#,
        )
        .unwrap();
        let job_file = root.join("job.yaml");
        // Relative to the job file's folder.
        let text = "name: q\nmodel: Tiny-Qwen\nglobal_batch: 8\nrun: python train.py  # the trainer\n";
        let sent: Value = serde_json::from_str(&inline_hf_model(text, &job_file).unwrap()).unwrap();
        assert_eq!((sent["model"]["name"].as_str(), sent["model"]["family"].as_str()), (Some("Tiny-Qwen"), Some("llama")));
        assert_eq!(
            (sent["model"]["qkv_bias"].as_bool(), sent["run"].as_str(), sent["global_batch"].as_u64()),
            (Some(true), Some("python train.py"), Some(8))
        );
        let spec: motley_solver::ModelSpec = serde_json::from_value(sent["model"].clone()).unwrap();
        assert_eq!(spec.layers, 2, "the coordinator reads it as an inline model entry");
        // As given (an absolute path).
        let abs = text.replace("Tiny-Qwen", dir.to_str().unwrap());
        assert!(inline_hf_model(&abs, std::path::Path::new("/elsewhere/job.yaml")).unwrap().contains("\"qkv_bias\": true"));
        // Catalog names, inline entries and names that are no directory go as they are.
        for same in [
            text.replace("Tiny-Qwen", "gpt3-1.3b"),
            text.replace("Tiny-Qwen", "nowhere"),
            "model: {name: x}\n".into(),
            ": bad yaml [".into(),
        ] {
            assert_eq!(inline_hf_model(&same, &job_file).unwrap(), same);
        }
        std::fs::write(dir.join("config.json"), r#"{"architectures": ["BertModel"]}"#).unwrap();
        let e = inline_hf_model(text, &job_file).unwrap_err().0;
        assert!(e.contains("job.yaml: model: ") && e.contains("architectures: 'BertModel'"), "{e}");
        std::fs::remove_dir_all(root).unwrap();
    }

    #[test]
    fn an_event_without_a_generation_prints_none() {
        let e = |generation: Value| serde_json::json!({"seq": 3, "kind": "profiling", "generation": generation, "message": "priced by the roofline"});
        assert_eq!(event_line(&e(Value::Null)), "[profiling] priced by the roofline");
        assert_eq!(event_line(&e(0.into())), "[profiling] priced by the roofline");
        assert_eq!(event_line(&e(2.into())), "[profiling] generation 2: priced by the roofline");
        assert!(!event_line(&e(Value::Null)).contains("generation :"));
    }

    #[test]
    fn node_names_stay_one_path_segment() {
        assert_eq!(path_segment("a100-0.rack_1~x"), "a100-0.rack_1~x");
        assert_eq!(path_segment("../jobs/1"), "..%2Fjobs%2F1");
        assert_eq!(path_segment(".."), "%2E%2E");
        assert_eq!(path_segment("a b?c#d\n"), "a%20b%3Fc%23d%0A");
        assert_eq!(path_segment("nœud"), "n%C5%93ud");
    }

    #[test]
    fn table_cells_and_texts_escape_control_characters() {
        let job = |name: &str, reason: Option<&str>| JobView {
            id: 1,
            name: name.into(),
            state: motley_contract::job::JobState::Failed,
            generation: 1,
            reason: reason.map(str::to_string),
            created_at_ms: 0,
            updated_at_ms: 0,
            spec: Value::Null,
            checkpoint_cloud: None,
            membership: None,
        };
        let out = jobs_table(&[job("evil\u{1b}]0;owned\u{7}\nsecond line", Some("exit\tcode \u{9b}2J"))]);
        assert!(!out.chars().any(|c| c.is_control() && c != '\n'), "{out:?}");
        assert!(out.contains("evil\\x1b]0;owned\\x07\\nsecond line"), "{out}");
        assert!(out.contains("exit\\tcode \\u{9b}2J"), "{out}");
        assert_eq!(out.lines().count(), jobs_table(&[job("j", None)]).lines().count(), "one line per row");
        assert_eq!(s(&serde_json::json!("a\u{1b}b")), "a\\x1bb");
    }

    #[test]
    fn a_degraded_job_shows_its_members_share_and_watch_reads_the_membership() {
        let doc = r#"{"epoch": 1, "replicas": [0, 2], "lost": [1], "micro_batches": {"0": 8, "2": 4},
            "store": {"host": "10.0.0.1", "port": 29400}, "leader": 0, "reason": "rank 3 on node n1 exited with code -9",
            "throughput_share": 0.666}"#;
        let membership: motley_contract::views::MembershipView = serde_json::from_str(doc).unwrap();
        let job = JobView {
            id: 4,
            name: "j".into(),
            state: motley_contract::job::JobState::Degraded,
            generation: 1,
            reason: None,
            created_at_ms: 0,
            updated_at_ms: 0,
            spec: Value::Null,
            checkpoint_cloud: None,
            membership: Some(membership),
        };
        assert!(jobs_table(&[job]).contains("degraded 67%"));
        let event = serde_json::json!({"kind": "membership_changed", "generation": 1, "message": doc});
        assert_eq!(
            event_line(&event),
            "[membership_changed] generation 1: epoch 1: replicas 0, 2 train (1 lost); 67% of the plan's throughput: \
             rank 3 on node n1 exited with code -9"
        );
        // Any other event, or a message that is no membership, prints as it is.
        let other = serde_json::json!({"kind": "membership_changed", "generation": 1, "message": "not json"});
        assert_eq!(event_line(&other), "[membership_changed] generation 1: not json");
    }

    #[test]
    fn load_cells_average_gpus_and_size_bytes() {
        let gib = 1u64 << 30;
        let load = serde_json::json!({
            "gpus": [
                {"index": 0, "utilization_percent": 90, "memory_used_bytes": 60 * gib, "memory_total_bytes": 80 * gib},
                {"index": 1, "utilization_percent": 10, "memory_used_bytes": 20 * gib, "memory_total_bytes": 80 * gib}
            ],
            "work_dir_free_bytes": 1536 * gib, "load_1m": 2.5, "mem_available_bytes": 0, "ranks_running": 2, "age_ms": 10
        });
        let load: NodeLoad = serde_json::from_value(load).unwrap();
        assert_eq!(load_cells(Some(&load)), ["2", "50%", "80.0 GiB / 160.0 GiB", "1.5 TiB", "2.50"].map(String::from));
        let no_gpus = NodeLoad { work_dir_free_bytes: 512, ..Default::default() };
        assert_eq!(load_cells(Some(&no_gpus)), ["0", "-", "-", "512 B", "0.00"].map(String::from));
        assert_eq!(load_cells(None), ["-"; 5].map(String::from));
    }
}
