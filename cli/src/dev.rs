//! `motley dev up CLUSTER JOB`: the whole system on one machine. It starts a coordinator on
//! SQLite and one agent per node of the cluster file (each with that node's entry as its
//! inventory), submits the job, prints its events and its ranks' output as they come, and
//! stops everything when the job ends (or on Ctrl-C, which reaches the whole process group).

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Seek, SeekFrom, Write};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use motley_solver::ClusterSpec;

use crate::inputs::{self, InputError};
use crate::remote::Client;
use crate::table::escape;
use crate::{exit, Outcome};

#[derive(clap::Subcommand)]
pub enum DevCommand {
    /// Start a coordinator and one agent per node of CLUSTER, run JOB, stream it, stop; exit 0
    /// if the job succeeded, 1 if it failed, 3 if it was cancelled (Ctrl-C cancels it).
    #[command(after_help = crate::exit::HELP)]
    Up {
        /// Cluster file (YAML), as for `motley plan`.
        cluster: PathBuf,
        /// Job file (YAML), as for `motley job submit`.
        job: PathBuf,
        /// Where state, inventories and rank logs go (default: a fresh temporary directory).
        #[arg(long)]
        dir: Option<PathBuf>,
        /// Heartbeat interval of this local system, ms (a lease lasts three).
        #[arg(long, default_value_t = 500)]
        heartbeat_ms: u64,
        /// Emulate the cluster's GPUs on this machine's CPUs at their relative speeds: each
        /// node entry without `emulate:` gets a share of one core per GPU proportional to its
        /// type's peak (docs/emulation.md; the agents confine ranks with cgroups: run as root).
        #[arg(long)]
        emulate: bool,
    },
}

/// The variables of the shell that runs `motley dev up` its ranks inherit through the agents
/// (`--rank-env`), beside what every agent passes (PATH, which picks the `python` a job's `run:`
/// starts, the locale, TZ, ...): where a rank's Python finds its packages and the rank library
/// (python/README.md, "What a rank's Python needs"). Only these, never the whole shell: the
/// agents, root included, still pass nothing else of theirs. A job's own `envs:` win over them.
pub const SHELL_TO_RANKS: &[&str] = &["PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "CONDA_PREFIX"];

/// The agents' `--rank-env`: the shell's own `MOTLEY_RANK_ENV` (which the flag would
/// otherwise replace), then `SHELL_TO_RANKS`.
fn rank_env(shell: Option<&str>) -> String {
    let mut names: Vec<&str> = shell.unwrap_or_default().split(',').map(str::trim).filter(|n| !n.is_empty()).collect();
    for n in SHELL_TO_RANKS {
        if !names.contains(n) {
            names.push(n);
        }
    }
    names.join(",")
}

/// Set by Ctrl-C: the watch loop cancels the job, waits for its ranks and returns.
static INTERRUPTED: AtomicBool = AtomicBool::new(false);

/// Children killed when `motley dev up` returns, whatever the path.
struct Procs(Vec<Child>);

impl Drop for Procs {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn sibling(name: &str) -> Result<PathBuf, InputError> {
    let me = std::env::current_exe().map_err(|e| InputError(format!("cannot find the motley binary: {e}")))?;
    let p = me.with_file_name(name);
    if p.exists() {
        Ok(p)
    } else {
        Err(InputError(format!("{} not found next to motley; build it with `cargo build --release`", p.display())))
    }
}

/// Runs the job to its end; the exit code is the job's outcome (`exit::for_job_state`): a job
/// that failed or was cancelled (Ctrl-C included) is not a success for the script that ran this.
pub fn run(cmd: DevCommand) -> Result<Outcome, InputError> {
    let DevCommand::Up { cluster, job, dir, heartbeat_ms, emulate } = cmd;
    let origin = cluster.display().to_string();
    let text = std::fs::read_to_string(&cluster).map_err(|e| InputError(format!("{origin}: cannot read cluster file: {e}")))?;
    let mut spec: ClusterSpec = inputs::parse_yaml(&text, &origin)?;
    motley_solver::Cluster::from_spec(&spec).map_err(|e| inputs::in_file(&origin, e))?;
    if emulate {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        for (gpu, share) in crate::emulate::fill(&mut spec, cores)? {
            say(&format!("emulating {} on {share} of one core per GPU ({cores} cores here)", escape(&gpu)));
        }
    }
    let job_text = std::fs::read_to_string(&job).map_err(|e| InputError(format!("{}: cannot read job file: {e}", job.display())))?;
    // The default directory is new for every run (pids are reused, so the time is in the name
    // too): an earlier run's database would otherwise come back with its jobs.
    let dir = dir.unwrap_or_else(|| {
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        std::env::temp_dir().join(format!("motley-dev-{}-{}", std::process::id(), now.as_millis()))
    });
    let io = |e: std::io::Error| InputError(format!("{}: {e}", dir.display()));
    std::fs::create_dir_all(dir.join("nodes")).map_err(io)?;

    // Ctrl-C reaches only this process (the children have their own process groups): it stops
    // the job's ranks through the coordinator before the agents and the coordinator go.
    ctrlc::set_handler(|| INTERRUPTED.store(true, Ordering::SeqCst)).map_err(|e| InputError(format!("cannot handle Ctrl-C: {e}")))?;
    let mut procs = Procs(vec![]);
    let (rest, grpc) = start_coordinator(&spec, &dir, heartbeat_ms, &mut procs)?;
    say(&format!("coordinator: REST {rest}, agents {grpc}, state in {}", dir.display()));

    let names = start_agents(&spec, &dir, &grpc, &mut procs)?;
    let client = Client::local(&rest)?;
    wait_for_agents(&client, &names)?;
    say(&format!("{} agents live: {}", names.len(), names.join(", ")));

    let submitted = client.call("POST", "/jobs", Some(&job_text)).map_err(|e| InputError(format!("{}: {}", job.display(), e.0)))?;
    let id = submitted["id"].as_i64().unwrap_or(0);
    say(&format!("job {id} ({}) submitted", submitted["name"].as_str().unwrap_or("")));
    // This cluster's own place in the cloud: another run's job 1 is elsewhere (docs/recovery.md).
    if let Some(url) = submitted["checkpoint_cloud"].as_str() {
        say(&format!("job {id} checkpoints to {}/GENERATION/step-S", escape(url)));
    }
    let followed = follow(&client, id, heartbeat_ms, &dir, names.len());
    if followed.is_err() {
        // Whatever went wrong, the ranks must not outlive this command (they run in their own
        // process groups, which killing the agents does not reach).
        let _ = client.call("POST", &format!("/jobs/{id}/cancel"), None);
        wait_for_ranks(&client, id, heartbeat_ms);
    }
    followed
}

/// Start the coordinator (into `procs`) and read the REST and gRPC addresses it prints.
fn start_coordinator(spec: &ClusterSpec, dir: &Path, heartbeat_ms: u64, procs: &mut Procs) -> Result<(String, String), InputError> {
    let io = |e: std::io::Error| InputError(format!("{}: {e}", dir.display()));
    let mut coordinator = Command::new(sibling("motley-coordinator")?);
    coordinator
        .process_group(0)
        .args(["--listen", "127.0.0.1:0", "--grpc-listen", "127.0.0.1:0", "--insecure", "--heartbeat-ms", &heartbeat_ms.to_string()])
        .arg("--data-dir")
        .arg(dir.join("coordinator"));
    // The cluster file's own GPU types: its nodes name them, and the coordinator checks every
    // node entry (and plans) against the types it knows.
    if !spec.gpu_types.is_empty() {
        let file = dir.join("gpu-types.yaml");
        let text = serde_norway::to_string(&serde_json::json!({ "gpu_types": spec.gpu_types })).expect("GPU types serialise");
        std::fs::write(&file, text).map_err(io)?;
        coordinator.arg("--gpu-types").arg(&file);
    }
    let mut coordinator = coordinator
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .map_err(|e| InputError(format!("starting motley-coordinator: {e}")))?;
    let mut out = BufReader::new(coordinator.stdout.take().expect("piped"));
    procs.0.push(coordinator);
    let (mut rest, mut grpc) = (String::new(), String::new());
    out.read_line(&mut rest).map_err(io)?;
    out.read_line(&mut grpc).map_err(io)?;
    if rest.is_empty() || grpc.is_empty() {
        return Err(InputError("motley-coordinator exited before it printed its addresses (its error is above)".into()));
    }
    let rest = rest.trim().rsplit(' ').next().unwrap_or_default().to_string();
    let grpc = grpc.trim().rsplit(' ').next().unwrap_or_default().to_string();
    Ok((rest, grpc))
}

/// Start one agent per node of the cluster file (into `procs`); the nodes' names.
fn start_agents(spec: &ClusterSpec, dir: &Path, grpc: &str, procs: &mut Procs) -> Result<Vec<String>, InputError> {
    let io = |e: std::io::Error| InputError(format!("{}: {e}", dir.display()));
    // One agent per node, named as the cluster file expands them, its ranks given what this
    // shell has for their Python.
    let rank_env = rank_env(std::env::var("MOTLEY_RANK_ENV").ok().as_deref());
    let passed: Vec<&str> = SHELL_TO_RANKS.iter().copied().filter(|n| std::env::var_os(n).is_some()).collect();
    if !passed.is_empty() {
        say(&format!("ranks inherit this shell's PATH and {} (a job's envs: win)", passed.join(", ")));
    }
    let mut names = vec![];
    for n in &spec.nodes {
        let mut entry = n.clone();
        entry.count = None;
        let expanded: Vec<String> = match n.count {
            Some(k) => (0..k).map(|i| format!("{}-{i}", n.name)).collect(),
            None => vec![n.name.clone()],
        };
        for name in expanded {
            entry.name = name.clone();
            let file = dir.join("nodes").join(format!("{name}.yaml"));
            std::fs::write(&file, serde_norway::to_string(&entry).expect("a node entry serialises")).map_err(io)?;
            let agent = Command::new(sibling("motley-agent")?)
                .arg("--allow-root-ranks")
                .args(["--rank-env", &rank_env])
                .process_group(0)
                .args(["--coordinator", grpc, "--node", &name, "--inventory"])
                .arg(&file)
                .arg("--work-dir")
                .arg(dir.join("agents").join(&name))
                // Checkpoints' memory tier inside the dev directory: gone with it. Several agents
                // on one machine: every data plane on a port of its own.
                .arg("--shm-dir")
                .arg(dir.join("shm").join(&name))
                .args(["--data-listen", "127.0.0.1:0"])
                .stderr(Stdio::null())
                .spawn()
                .map_err(|e| InputError(format!("starting motley-agent for {name}: {e}")))?;
            procs.0.push(agent);
            names.push(name);
        }
    }
    Ok(names)
}

/// Wait until every agent is live: an error after 30 s, or on Ctrl-C.
fn wait_for_agents(client: &Client, names: &[String]) -> Result<(), InputError> {
    let start = Instant::now();
    loop {
        let nodes = client.call("GET", "/nodes", None)?;
        let live = nodes.as_array().map_or(0, |a| a.iter().filter(|n| n["live"] == true).count());
        if live == names.len() {
            break;
        }
        if INTERRUPTED.load(Ordering::SeqCst) {
            return Err(InputError("interrupted before the job was submitted; stopping everything".into()));
        }
        if start.elapsed() > Duration::from_secs(30) {
            return Err(InputError(format!("only {live} of {} agents registered within 30 s", names.len())));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(())
}

/// Stream the job's events and its ranks' output until it is over (or Ctrl-C cancels it).
fn follow(client: &Client, id: i64, heartbeat_ms: u64, dir: &Path, agents: usize) -> Result<Outcome, InputError> {
    let mut after = 0i64;
    let mut offsets: BTreeMap<PathBuf, u64> = BTreeMap::new();
    loop {
        // The state first, the events after (see `motley job watch`): none is missed at the end.
        let j = client.call("GET", &format!("/jobs/{id}"), None)?;
        let events = client.call("GET", &format!("/jobs/{id}/events?after={after}"), None)?;
        // A full page (at most 1000 per answer): more are waiting, read them before deciding.
        let full = events.as_array().map_or(0, Vec::len) >= 1000;
        for e in events.as_array().into_iter().flatten() {
            after = after.max(e["seq"].as_i64().unwrap_or(after));
            say(&format!("[{}] {}", escape(e["kind"].as_str().unwrap_or("")), escape(e["message"].as_str().unwrap_or(""))));
        }
        if full {
            continue;
        }
        print_new_output(&dir.join("agents"), &mut offsets);
        let state = escape(j["state"].as_str().unwrap_or("")).into_owned();
        if INTERRUPTED.load(Ordering::SeqCst) && !["succeeded", "failed", "cancelled"].contains(&state.as_str()) {
            say(&format!("interrupted: cancelling job {id}"));
            // A 409 means it ended meanwhile: nothing to cancel, the ranks are stopping anyway.
            let _ = client.call("POST", &format!("/jobs/{id}/cancel"), None);
            wait_for_ranks(client, id, heartbeat_ms);
            print_new_output(&dir.join("agents"), &mut offsets);
            return Ok(Outcome {
                text: format!("job {id} cancelled; stopping the coordinator and {agents} agents"),
                code: exit::JOB_CANCELLED,
            });
        }
        if ["succeeded", "failed", "cancelled"].contains(&state.as_str()) {
            std::thread::sleep(Duration::from_millis(2 * heartbeat_ms));
            print_new_output(&dir.join("agents"), &mut offsets);
            let reason = j["reason"].as_str().map_or(String::new(), |r| format!(": {}", escape(r)));
            return Ok(Outcome {
                text: format!("job {id} {state}{reason}; stopping the coordinator and {agents} agents"),
                code: exit::for_job_state(&state),
            });
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Until no rank of the job runs (each agent reports its stopped ranks on its next heartbeats),
/// at most a stop's grace period and a few heartbeats more.
fn wait_for_ranks(client: &Client, id: i64, heartbeat_ms: u64) {
    let deadline = Instant::now() + Duration::from_millis(10 * heartbeat_ms);
    while Instant::now() < deadline {
        let Ok(plan) = client.call("GET", &format!("/jobs/{id}/plan"), None) else { return };
        if plan["ranks"].as_array().into_iter().flatten().all(|r| r["state"] != "running") {
            return;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn say(line: &str) {
    let _ = writeln!(std::io::stdout().lock(), "motley dev: {line}");
}

/// New lines of every rank log under `agents/NODE/jobs/JOB/GEN/rank-R.log`, prefixed.
fn print_new_output(agents: &Path, offsets: &mut BTreeMap<PathBuf, u64>) {
    let mut logs = vec![];
    collect_logs(agents, &mut logs);
    logs.sort();
    for log in logs {
        let Ok(mut f) = std::fs::File::open(&log) else { continue };
        let at = *offsets.get(&log).unwrap_or(&0);
        if f.seek(SeekFrom::Start(at)).is_err() {
            continue;
        }
        let mut new = String::new();
        let Ok(n) = f.read_to_string(&mut new) else { continue };
        // Only whole lines; a half-written one waits for the next pass.
        let whole = new.rfind('\n').map_or(0, |i| i + 1);
        offsets.insert(log.clone(), at + whole.min(n) as u64);
        let node = log.iter().rev().nth(4).map(|s| s.to_string_lossy().to_string()).unwrap_or_default();
        let rank = log.file_stem().map(|s| s.to_string_lossy().to_string()).unwrap_or_default();
        for line in new[..whole].lines() {
            let _ = writeln!(std::io::stdout().lock(), "{node} {rank}: {line}");
        }
    }
}

fn collect_logs(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for e in entries.flatten() {
        let p = e.path();
        if p.is_dir() {
            collect_logs(&p, out);
        } else if p.extension().is_some_and(|x| x == "log") {
            out.push(p);
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_agents_pass_the_shells_own_rank_env_and_its_python_variables() {
        assert_eq!(super::rank_env(None), "PYTHONPATH,PYTHONHOME,VIRTUAL_ENV,CONDA_PREFIX");
        assert_eq!(super::rank_env(Some("NCCL_*, PYTHONPATH,,")), "NCCL_*,PYTHONPATH,PYTHONHOME,VIRTUAL_ENV,CONDA_PREFIX");
    }
}
