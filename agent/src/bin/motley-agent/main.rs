//! `motley-agent`: registers its node with the coordinator (hardware from `--inventory FILE`, a
//! cluster-file node entry, or discovered: NVML and sysfs), holds the node's lease by
//! heartbeating on the coordinator's base interval, launches, supervises and stops the ranks
//! it is told to (they survive an agent restart and are adopted again), and serves their logs
//! over HTTP. `motley-agent discover` prints the discovered entry. Settings: flags, `MOTLEY_*`
//! environment, `/etc/motley/agent.toml` (`--config`), in that order.

mod connect;
mod session;
mod settings;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use motley_agent::checkpoints::dataplane::{self, Access, Arriving, ClientTls, DataKey, DirResolver, Pacer, Resolve, Root};
use motley_agent::checkpoints::holdings::Holdings;
use motley_agent::checkpoints::restorer::Restorer;
use motley_agent::checkpoints::tiers::Tierer;
use motley_agent::net::{Meter, Pacing};
use motley_agent::node::discover::entry_value;
use motley_agent::profiler::Profiler;
use motley_agent::ranks::environment::RankEnv;
use motley_agent::ranks::Supervisor;

use crate::session::Workers;
use crate::settings::{discovered, fnv1a, inventory_json, node_name, settings, Args, Command, Output};

fn main() {
    let argv: Vec<String> = std::env::args().collect();
    // The rank wrapper (see ranks/wrapper.rs): no config, no runtime, just the rank.
    if argv.get(1).map(String::as_str) == Some("__rank-wrapper") {
        std::process::exit(rank_wrapper(&argv[2..]));
    }
    if let Err(e) = run() {
        eprintln!("motley-agent: {e:#}");
        std::process::exit(2);
    }
}

/// `__rank-wrapper EXIT_FILE [--lease LEASE_FILE] -- PROGRAM ARGS...` (see ranks/wrapper.rs).
fn rank_wrapper(argv: &[String]) -> i32 {
    let a: Vec<&str> = argv.iter().map(String::as_str).collect();
    let (exit_file, lease, rest) = match a.as_slice() {
        [exit, "--lease", lease, "--", rest @ ..] => (exit, Some(Path::new(lease)), rest),
        [exit, "--", rest @ ..] => (exit, None, rest),
        _ => (&"", None, &[][..]),
    };
    let Some((program, args)) = rest.split_first() else {
        eprintln!("usage: motley-agent __rank-wrapper EXIT_FILE [--lease LEASE_FILE] -- PROGRAM ARGS...");
        return 2;
    };
    let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
    motley_agent::ranks::wrapper::wrapper_main(Path::new(exit_file), lease, program, &args)
}

fn run() -> anyhow::Result<()> {
    let args = settings()?;
    let node = node_name(&args);
    if let Some(Command::Discover { output }) = args.command {
        let (d, checked) = discovered(&args, &node);
        for n in &d.notes {
            eprintln!("motley-agent discover: {n}");
        }
        // Printed even when the coordinator would refuse it: a starting point for --inventory.
        let entry = entry_value(&d.entry);
        print!(
            "{}",
            match output {
                Output::Yaml => serde_norway::to_string(&entry)?,
                Output::Json => serde_json::to_string_pretty(&entry)? + "\n",
            }
        );
        return Ok(checked?);
    }
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).with_ansi(ansi).init();
    let inventory = match &args.inventory {
        Some(path) => inventory_json(path)?,
        None => {
            let (d, checked) = discovered(&args, &node);
            for n in &d.notes {
                tracing::info!(node = %node, "discovery: {n}");
            }
            checked?;
            let mut v = entry_value(&d.entry);
            v.as_object_mut().map(|m| m.remove("name"));
            v.to_string()
        }
    };
    let given = args.work_dir.clone().unwrap_or_else(|| Path::new("motley-agent").join(&node));
    // Held (open) for the agent's whole life: the lock goes with the process.
    let (work_dir, _lock) = motley_agent::workdir::open_work_dir(&given)?;
    let rt = tokio::runtime::Runtime::new()?;
    rt.block_on(agent(args, work_dir, node, inventory))
}
async fn agent(args: Args, work_dir: PathBuf, node: String, inventory: String) -> anyhow::Result<()> {
    let logs_url = serve_logs(&args, &node, &work_dir).await?;
    let supervisor = supervisor(&args, &node, &work_dir, &inventory)?;
    let profiler = match args.python.as_deref().filter(|p| !p.is_empty()) {
        Some(python) => {
            tracing::info!(node = %node, "layer profiles measured with {python} -m motley_torch.profile when the coordinator asks");
            Some(Profiler::new(python, &work_dir, &node)?.confined(supervisor.cpu_confine()))
        }
        None => None,
    };
    match motley_agent::ranks::users::euid() {
        0 if args.allow_root_ranks => tracing::warn!(node = %node, "allow_root_ranks: jobs that name no user run their ranks as root"),
        0 => tracing::info!(node = %node, "running as root: ranks run as their job's user; jobs that name none are refused"),
        // A Slurm allocation's agent (docs/slurm.md): everything works but what needs root.
        uid => tracing::info!(
            node = %node,
            "running as uid {uid}, not root: ranks run as this user (a job naming another user is refused), in rank cgroups only where this user may make them"
        ),
    }
    motley_agent::checkpoints::file_roots::configure(&args.cloud_file_root, args.allow_root_ranks)?;
    if motley_agent::ranks::lease::clear_if_lapsed(&work_dir) {
        tracing::info!(node = %node, "the lease file an earlier agent left had run out; removed (renewed on the first acknowledgement)");
    }
    for n in supervisor.adopt() {
        tracing::info!(node = %node, "{n}");
    }
    // Finished launches' files go after --keep-finished-hours; looked for a few times per
    // period (at least every 10 minutes), off the async workers.
    let keep = Duration::from_secs_f64(args.keep_finished_hours * 3600.0);
    let sweeper = (supervisor.clone(), node.clone());
    tokio::spawn(async move {
        let mut tick = tokio::time::interval((keep / 4).clamp(Duration::from_secs(1), Duration::from_secs(600)));
        loop {
            tick.tick().await;
            let s = sweeper.0.clone();
            for n in tokio::task::spawn_blocking(move || s.prune(keep)).await.unwrap_or_default() {
                tracing::info!(node = %sweeper.1, "{n}");
            }
        }
    });
    let load = {
        let s = supervisor.clone();
        motley_agent::node::load::sampler(work_dir.clone(), move || s.running())
    };
    let holdings = Arc::new(Holdings::with_memory_root(supervisor.memory_root()));
    let tierer = Arc::new(Tierer::new(work_dir.clone(), supervisor.memory_root()));
    spawn_tier_passes(&tierer, &node, &supervisor);
    let data_key = DataKey::default();
    let (data_url, restorer, client_tls) = serve_data_plane(&args, &node, &work_dir, &tierer, supervisor.memory_root(), &data_key).await?;
    let meter = Arc::new(Meter::new(&node, &settings::sysfs(&args)));
    let pacing = Pacing { duty: args.probe_duty, target: Duration::from_millis(args.probe_target_ms) };
    if pacing.enabled() {
        tracing::info!(node = %node, "link probes to the launches' peers: at most {} of the time on the wire, {} ms each", pacing.duty, args.probe_target_ms);
    }
    let running = {
        let s = supervisor.clone();
        move || s.running_launches()
    };
    tokio::spawn(motley_agent::net::probe::run(meter.clone(), pacing, data_key.clone(), client_tls, running));
    let workers = Workers {
        supervisor: &supervisor,
        profiler: profiler.as_ref(),
        holdings: &holdings,
        tierer: &tierer,
        restorer: &restorer,
        data_key: &data_key,
        meter: &meter,
    };
    session::keep_registered(&args, &work_dir, &node, &inventory, (&logs_url, &data_url), workers, &load).await
}

/// Serve the rank logs (over TLS with `--tls-cert`/`--tls-key`); the URL the coordinator is given.
async fn serve_logs(args: &Args, node: &str, work_dir: &Path) -> anyhow::Result<String> {
    // Read and checked before anything listens: a bad certificate is a start-up error.
    let tls = motley_agent::logs::tls::TlsFiles::from_flags(args.tls_cert.clone(), args.tls_key.clone())?;
    let tls = tls.as_ref().map(motley_agent::logs::tls::TlsFiles::server_config).transpose()?;
    let listener = match tokio::net::TcpListener::bind(&args.logs_listen).await {
        Ok(l) => l,
        // Several agents on one machine (tests, `motley dev up`) cannot all have the default.
        Err(e) if e.kind() == std::io::ErrorKind::AddrInUse && args.logs_listen == "0.0.0.0:7072" => {
            tracing::warn!(node = %node, "--logs-listen 0.0.0.0:7072 is taken; serving logs on a free port instead");
            tokio::net::TcpListener::bind("0.0.0.0:0").await?
        }
        Err(e) => return Err(e).with_context(|| format!("--logs-listen {}: cannot listen", args.logs_listen)),
    };
    let scheme = if tls.is_some() { "https" } else { "http" };
    let logs_url = format!("{scheme}://{}:{}", args.address, listener.local_addr()?.port());
    tracing::info!(node = %node, "rank logs at {logs_url}/logs/JOB/GENERATION/RANK");
    tokio::spawn(motley_agent::logs::serve(listener, work_dir.to_path_buf(), args.token.clone(), tls));
    Ok(logs_url)
}

/// The supervisor of this node's ranks: each rank under this executable as its wrapper, in its
/// own cgroup where the host allows, its checkpoints in the memory tier.
fn supervisor(args: &Args, node: &str, work_dir: &Path, inventory: &str) -> anyhow::Result<Supervisor> {
    // Opened now, as root: ranks of other users run it through this descriptor
    // (ranks/wrapper_exe.rs), so they need only execute permission on the file itself.
    let wrapper = motley_agent::ranks::wrapper_exe::WrapperExe::own()?;
    if motley_agent::ranks::users::euid() == 0 {
        if let Some(warning) = wrapper.startup_warning() {
            tracing::warn!(node = %node, "{warning}");
        }
    }
    let cgroups = match motley_agent::ranks::cgroup::RankCgroups::detect(node, work_dir) {
        Ok(c) => Some(c),
        Err(why) => {
            tracing::warn!("ranks run without a cgroup of their own ({why}): a stop reaches their process groups only");
            None
        }
    };
    let (cgroups, cpu_v1) = emulation(node, work_dir, inventory, cgroups)?;
    let shm = match &args.shm_dir {
        Some(p) if p.is_empty() => None,
        // Ranks are handed paths under it (MOTLEY_CKPT_DIR): absolute, whatever was given.
        Some(p) => Some(std::path::absolute(p).with_context(|| format!("--shm-dir {p}: cannot make it an absolute path"))?),
        // One per work directory (agents of several nodes, or of several test runs, on one
        // machine must not read each other's checkpoints): the node and a hash of the directory.
        None => Some(Path::new("/dev/shm").join(format!("motley-agent-{node}-{:016x}", fnv1a(work_dir.as_os_str().as_encoded_bytes())))),
    };
    let supervisor = Supervisor::new(work_dir.to_path_buf(), node.to_string(), wrapper)
        .allow_root_ranks(args.allow_root_ranks)
        .rank_env(RankEnv::with_extra(&args.rank_env).map_err(anyhow::Error::msg)?)
        .rank_cgroups(cgroups)
        .cpu_v1(cpu_v1)
        .shm_root(shm);
    Ok(supervisor)
}

/// An emulating node (its inventory's `emulate: {cpu: F}`, docs/emulation.md): each rank
/// confined to F of one core, by cgroup v2's `cpu.max` where the agent's cgroup delegates the
/// cpu controller, else by the v1 cpu hierarchy. Neither: the agent refuses to start, since a
/// node that says it emulates and does not would make every measurement on it a lie.
fn emulation(
    node: &str,
    work_dir: &Path,
    inventory: &str,
    cgroups: Option<motley_agent::ranks::cgroup::RankCgroups>,
) -> anyhow::Result<(Option<motley_agent::ranks::cgroup::RankCgroups>, Option<motley_agent::ranks::cpu_share::CpuV1>)> {
    let entry: serde_json::Value = serde_json::from_str(inventory)?;
    if entry["emulate"].is_null() {
        return Ok((cgroups, None));
    }
    let emulate: motley_contract::cluster::Emulate = serde_json::from_value(entry["emulate"].clone())
        .map_err(|e| anyhow::anyhow!("--inventory: emulate: {e}; give emulate: {{cpu: 0.3}} (each rank's share of one core)"))?;
    emulate.check("--inventory: emulate.cpu")?;
    let v2 = match cgroups.clone().map(|c| c.with_cpu_share(emulate.cpu)) {
        Some(Ok(c)) => {
            tracing::info!(node = %node, "emulated GPUs: each rank runs on {} of one core (cgroup v2 cpu.max)", emulate.cpu);
            return Ok((Some(c), None));
        }
        Some(Err(why)) => why,
        None => "no rank cgroups (above)".to_string(),
    };
    match motley_agent::ranks::cpu_share::CpuV1::detect(node, work_dir, emulate.cpu) {
        Ok(v1) => {
            tracing::info!(node = %node, "emulated GPUs: each rank runs on {} of one core (cgroup v1 cpu.cfs_quota_us)", emulate.cpu);
            Ok((cgroups, Some(v1)))
        }
        Err(v1) => anyhow::bail!(
            "--inventory: emulate.cpu: this agent cannot confine ranks to a CPU share (cgroup v2: {v2}; cgroup v1: {v1}); run it as root on a host with the cpu controller (delegated to the agent's cgroup on v2), or remove emulate"
        ),
    }
}

/// Checkpoint tiers: memory -> disk (keep K) -> the cloud, every base interval.
fn spawn_tier_passes(tierer: &Arc<Tierer>, node: &str, supervisor: &Supervisor) {
    let (t, n, s) = (tierer.clone(), node.to_string(), supervisor.clone());
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(s.interval()).await;
            let pass = t.clone();
            for note in tokio::task::spawn_blocking(move || pass.tier_pass()).await.unwrap_or_default() {
                tracing::info!(node = %n, "{note}");
            }
        }
    });
    let (t, n, s) = (tierer.clone(), node.to_string(), supervisor.clone());
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(s.interval()).await;
            for note in t.cloud_pass().await {
                tracing::info!(node = %n, "{note}");
            }
        }
    });
}

/// The data plane: this node's checkpoint files served to peers, paced to the node's NIC and
/// disk, to those with a capability `data_key` verifies, over TLS where the agent has a
/// certificate (and probes whose token names `node`); the restorer that fetches a recovery's
/// files through it; the data plane's address (`tls://HOST:PORT` over TLS) and the client TLS
/// of this agent's own connections to peers' data planes.
async fn serve_data_plane(
    args: &Args,
    node: &str,
    work_dir: &Path,
    tierer: &Arc<Tierer>,
    memory_root: Option<PathBuf>,
    data_key: &DataKey,
) -> anyhow::Result<(String, Restorer, Option<ClientTls>)> {
    // The logs' certificate and key; peers are checked against the CA the coordinator is.
    let tls = motley_agent::logs::tls::TlsFiles::from_flags(args.tls_cert.clone(), args.tls_key.clone())?;
    let server_tls = tls.as_ref().map(|files| files.server_config().map(|c| dataplane::access::server_config(&c))).transpose()?;
    let client_tls = match (&server_tls, &args.ca_cert) {
        (None, _) => None,
        (Some(_), Some(ca)) => {
            let pem = std::fs::read(ca).with_context(|| format!("--ca-cert: cannot read {}", ca.display()))?;
            Some(ClientTls::new(Some(&pem))?)
        }
        (Some(_), None) => Some(ClientTls::new(None)?),
    };
    // The data plane: this node's checkpoint files to peers, paced to the node's NIC and disk.
    let rate = |mb_s: f64| Arc::new(Pacer::new(mb_s * 1e6));
    let (nic_out, nic_in, disk) = (rate(args.ckpt_nic_mb_s), rate(args.ckpt_nic_mb_s), rate(args.ckpt_disk_mb_s));
    let arriving = Arriving::new(Duration::from_secs(600));
    let mut roots: Vec<Root> = memory_root.into_iter().map(|dir| Root { dir, read_pacer: None }).collect();
    roots.push(Root { dir: work_dir.to_path_buf(), read_pacer: Some(disk.clone()) });
    let resolver: Arc<dyn Resolve> = Arc::new(DirResolver::new(roots).with_arriving(arriving.clone()));
    let data = match tokio::net::TcpListener::bind(&args.data_listen).await {
        Ok(l) => l,
        Err(e) if e.kind() == std::io::ErrorKind::AddrInUse && args.data_listen == "0.0.0.0:7073" => {
            tracing::warn!(node = %node, "--data-listen 0.0.0.0:7073 is taken; serving checkpoint files on a free port instead");
            tokio::net::TcpListener::bind("0.0.0.0:0").await?
        }
        Err(e) => return Err(e).with_context(|| format!("--data-listen {}: cannot listen", args.data_listen)),
    };
    let scheme = if server_tls.is_some() { dataplane::access::TLS_SCHEME } else { "" };
    let data_url = format!("{scheme}{}:{}", args.address, data.local_addr()?.port());
    tracing::info!(node = %node, "checkpoint data plane at {data_url}");
    tokio::spawn(dataplane::serve(data, resolver.clone(), Access::new(data_key.clone(), server_tls).with_node(node), nic_out));
    let restorer = Restorer::new(work_dir, node, client_tls.clone(), resolver, arriving, nic_in, disk).with_tierer(tierer.clone());
    Ok((data_url, restorer, client_tls))
}
