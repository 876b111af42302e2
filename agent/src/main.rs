//! `motley-agent`: registers its node with the coordinator (hardware from `--inventory FILE`, a
//! cluster-file node entry, or discovered: NVML and sysfs), holds the node's lease by
//! heartbeating on the coordinator's base interval, launches, supervises and stops the ranks
//! it is told to (they survive an agent restart and are adopted again), and serves their logs
//! over HTTP. `motley-agent discover` prints the discovered entry. Settings: flags, `MOTLEY_*`
//! environment, `/etc/motley/agent.toml` (`--config`), in that order.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, Subcommand, ValueEnum};
use motley_agent::discover::{default_sysfs, discover, entry_value};
use motley_agent::profiler::Profiler;
use motley_agent::ranks::Supervisor;
use motley_agent::AgentError;
use motley_contract::config;
use motley_proto::v1::agent_client::AgentClient;
use motley_proto::v1::{instruction, AgentStatus, RegisterReply, RegisterRequest};
use tokio_stream::wrappers::ReceiverStream;

#[derive(Parser)]
#[command(name = "motley-agent", version, about = "Motley's per-node agent")]
struct Args {
    /// The config file (TOML; keys are these flags' long names with '_'). Default
    /// /etc/motley/agent.toml, which may be absent.
    #[arg(long, env = "MOTLEY_CONFIG", global = true)]
    config: Option<PathBuf>,
    /// The coordinator's agent (gRPC) address(es), comma-separated, tried in order.
    #[arg(long, env = "MOTLEY_COORDINATOR_GRPC", default_value = "http://127.0.0.1:7071")]
    coordinator: String,
    /// This node's name (default: the host name).
    #[arg(long, env = "MOTLEY_NODE", global = true)]
    node: Option<String>,
    /// The node's hardware as a cluster-file node entry (YAML); without it, discovered.
    #[arg(long, env = "MOTLEY_INVENTORY")]
    inventory: Option<PathBuf>,
    /// The shared agent token (also required by the logs endpoint when set).
    #[arg(long, env = "MOTLEY_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// Where rank logs, plan files and rank records go (default: motley-agent/NODE, so that
    /// agents of several nodes on one machine never share one). Made absolute at start; one
    /// agent per directory.
    #[arg(long, env = "MOTLEY_WORK_DIR")]
    work_dir: Option<PathBuf>,
    /// Hours a finished launch's files (rank logs, plan, records) are kept after its ranks'
    /// ends were reported and nothing in them changed; then they are deleted (0: at once).
    #[arg(long, env = "MOTLEY_KEEP_FINISHED_HOURS", default_value_t = 72.0)]
    keep_finished_hours: f64,
    /// The address other nodes reach this one at (MASTER_ADDR when rank 0 runs here, and the
    /// host of the logs URL).
    #[arg(long, env = "MOTLEY_ADDRESS", default_value = "127.0.0.1")]
    address: String,
    /// Where the rank logs are served over HTTP (port 0: any free port). When the default
    /// port is taken (several agents on one machine) a free one is used instead.
    #[arg(long, env = "MOTLEY_LOGS_LISTEN", default_value = "0.0.0.0:7072")]
    logs_listen: String,
    /// The sysfs root discovery reads NICs from.
    #[arg(long, env = "MOTLEY_SYSFS_ROOT", default_value = "/sys", global = true)]
    sysfs_root: PathBuf,
    /// The RDMA domain of a discovered node (nodes whose RDMA NICs reach each other share one).
    #[arg(long, env = "MOTLEY_RDMA_DOMAIN", global = true)]
    rdma_domain: Option<String>,
    /// The CA certificate (PEM) an https coordinator's certificate is checked against
    /// (default: the system's roots).
    #[arg(long, env = "MOTLEY_CA_CERT")]
    ca_cert: Option<PathBuf>,
    /// Serve the rank logs over TLS with this certificate chain (PEM); needs --tls-key. The
    /// logs URL sent to the coordinator is then https://ADDRESS:PORT.
    #[arg(long, env = "MOTLEY_TLS_CERT")]
    tls_cert: Option<PathBuf>,
    /// The private key (PEM) of --tls-cert.
    #[arg(long, env = "MOTLEY_TLS_KEY")]
    tls_key: Option<PathBuf>,
    /// Let ranks run as root: when the agent runs as root, a job that names no `user` runs its
    /// ranks as root (without it they are refused, exit 126), and so does one naming a uid-0
    /// user. Off by default: a job file alone must not run code as root on every node.
    #[arg(long, env = "MOTLEY_ALLOW_ROOT_RANKS")]
    allow_root_ranks: bool,
    /// A Python (path, or a command on PATH) with motley_torch and torch installed: the agent
    /// then measures layer profiles when the coordinator asks (`python -m motley_torch.profile`,
    /// run as the agent's user on the GPUs the coordinator names). Without it the node is never
    /// asked to profile.
    #[arg(long, env = "MOTLEY_PYTHON")]
    python: Option<String>,
    /// The memory tier ranks write checkpoints into (a tmpfs; default
    /// /dev/shm/motley-agent-NODE-HASH, HASH naming the work directory; empty: ranks write on the
    /// work directory's disk). The agent keeps each job's newest
    /// complete step there and copies every complete step to disk.
    #[arg(long, env = "MOTLEY_SHM_DIR")]
    shm_dir: Option<String>,
    /// Where this agent serves checkpoint files to peers (the data plane; port 0: any free port).
    /// When the default port is taken (several agents on one machine) a free one is used.
    #[arg(long, env = "MOTLEY_DATA_LISTEN", default_value = "0.0.0.0:7073")]
    data_listen: String,
    /// The rate checkpoint bytes leave and enter this node's NIC (MB/s; 0: unpaced). The agent
    /// holds its data plane to it and the restore planner plans with it.
    #[arg(long, env = "MOTLEY_CKPT_NIC_MB_S", default_value_t = 0.0)]
    ckpt_nic_mb_s: f64,
    /// The rate checkpoint files are read from this node's disk (MB/s; 0: unpaced).
    #[arg(long, env = "MOTLEY_CKPT_DISK_MB_S", default_value_t = 0.0)]
    ckpt_disk_mb_s: f64,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand)]
enum Command {
    /// Print this node's discovered hardware as a cluster-file node entry.
    Discover {
        #[arg(short, long, value_enum, default_value = "yaml")]
        output: Output,
    },
}

#[derive(Clone, Copy, ValueEnum)]
enum Output {
    Yaml,
    Json,
}

/// FNV-1a (64 bits): a stable short name for a path (not a security boundary).
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3))
}

/// The agent's config file when `--config` names none (it may be absent).
const DEFAULT_CONFIG: &str = "/etc/motley/agent.toml";

/// Flags, then the environment, then the config file, then the defaults.
fn settings() -> anyhow::Result<Args> {
    let args: Args = config::parse(DEFAULT_CONFIG)?;
    anyhow::ensure!(
        args.keep_finished_hours.is_finite() && args.keep_finished_hours >= 0.0,
        "keep_finished_hours: must be a number of hours, 0 or more (e.g. 72)"
    );
    for (flag, v) in [("ckpt_nic_mb_s", args.ckpt_nic_mb_s), ("ckpt_disk_mb_s", args.ckpt_disk_mb_s)] {
        anyhow::ensure!(v.is_finite() && v >= 0.0, "{flag}: must be a rate in MB/s, 0 (unpaced) or more");
    }
    Ok(args)
}

fn node_name(args: &Args) -> String {
    args.node.clone().unwrap_or_else(|| {
        std::fs::read_to_string("/proc/sys/kernel/hostname").map(|h| h.trim().to_string()).unwrap_or_else(|_| "localhost".into())
    })
}

fn inventory_json(path: &Path) -> anyhow::Result<String> {
    let text = std::fs::read_to_string(path).map_err(|err| AgentError::Read { flag: "--inventory", path: path.into(), err })?;
    let mut v: serde_norway::Value =
        serde_norway::from_str(&text).map_err(|e| AgentError::Inventory { path: path.into(), message: e.to_string() })?;
    if let Some(m) = v.as_mapping_mut() {
        // The node's name is the agent's; a cluster file's `count` does not apply to one node.
        m.remove("name");
        m.remove("count");
    }
    Ok(serde_json::to_string(&v)?)
}

/// Discover the node; the entry, and whether the coordinator would take it.
fn discovered(args: &Args, node: &str) -> (motley_agent::discover::Discovered, motley_agent::Result<()>) {
    let (gpus, why) = motley_agent::nvml::gpus();
    let sysfs = if args.sysfs_root.as_os_str().is_empty() { default_sysfs() } else { args.sysfs_root.clone() };
    let (mut d, checked) = discover(node, &sysfs, &gpus);
    d.entry.rdma_domain = args.rdma_domain.clone();
    d.notes.extend(why);
    (d, checked)
}

fn main() {
    let argv: Vec<String> = std::env::args().collect();
    // The rank wrapper (see rankfiles.rs): no config, no runtime, just the rank.
    if argv.get(1).map(String::as_str) == Some("__rank-wrapper") {
        std::process::exit(rank_wrapper(&argv[2..]));
    }
    if let Err(e) = run() {
        eprintln!("motley-agent: {e:#}");
        std::process::exit(2);
    }
}

/// `__rank-wrapper EXIT_FILE [--lease LEASE_FILE] -- PROGRAM ARGS...` (see rankfiles.rs).
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
    motley_agent::rankfiles::wrapper_main(Path::new(exit_file), lease, program, &args)
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
    let (work_dir, _lock) = motley_agent::rankfiles::open_work_dir(&given)?;
    let rt = tokio::runtime::Runtime::new()?;
    rt.block_on(agent(args, work_dir, node, inventory))
}

/// How many sessions in a row the coordinator may refuse as stale before the agent gives up:
/// another agent keeps registering as this node (a re-registration gives this one a new
/// epoch; if it is refused again, someone else's registration came in between).
const STALE_SESSIONS: u32 = 3;

async fn agent(args: Args, work_dir: PathBuf, node: String, inventory: String) -> anyhow::Result<()> {
    // Read and checked before anything listens: a bad certificate is a start-up error.
    let tls = motley_agent::tls::TlsFiles::from_flags(args.tls_cert.clone(), args.tls_key.clone())?;
    let tls = tls.as_ref().map(motley_agent::tls::TlsFiles::server_config).transpose()?;
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
    tokio::spawn(motley_agent::logs::serve(listener, work_dir.clone(), args.token.clone(), tls));
    let wrapper = std::env::current_exe().context("cannot find this executable (the rank wrapper)")?;
    let cgroups = match motley_agent::cgroup::RankCgroups::detect(&node, &work_dir) {
        Ok(c) => Some(c),
        Err(why) => {
            tracing::warn!("ranks run without a cgroup of their own ({why}): a stop reaches their process groups only");
            None
        }
    };
    let shm = match &args.shm_dir {
        Some(p) if p.is_empty() => None,
        // Ranks are handed paths under it (MOTLEY_CKPT_DIR): absolute, whatever was given.
        Some(p) => Some(std::path::absolute(p).with_context(|| format!("--shm-dir {p}: cannot make it an absolute path"))?),
        // One per work directory (agents of several nodes, or of several test runs, on one
        // machine must not read each other's checkpoints): the node and a hash of the directory.
        None => Some(Path::new("/dev/shm").join(format!("motley-agent-{node}-{:016x}", fnv1a(work_dir.as_os_str().as_encoded_bytes())))),
    };
    let supervisor = Supervisor::new(work_dir.clone(), node.clone(), wrapper)
        .allow_root_ranks(args.allow_root_ranks)
        .rank_cgroups(cgroups)
        .shm_root(shm);
    let profiler = match args.python.as_deref().filter(|p| !p.is_empty()) {
        Some(python) => {
            tracing::info!(node = %node, "layer profiles measured with {python} -m motley_torch.profile when the coordinator asks");
            Some(motley_agent::profiler::Profiler::new(python, &work_dir, &node)?)
        }
        None => None,
    };
    if motley_agent::users::euid() == 0 {
        match args.allow_root_ranks {
            true => tracing::warn!(node = %node, "allow_root_ranks: jobs that name no user run their ranks as root"),
            false => tracing::info!(node = %node, "running as root: ranks run as their job's user; jobs that name none are refused"),
        }
    }
    if motley_agent::lease::clear_if_lapsed(&work_dir) {
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
        motley_agent::load::sampler(work_dir.clone(), move || s.running())
    };
    let holdings = std::sync::Arc::new(motley_agent::holdings::Holdings::with_memory_root(supervisor.memory_root()));
    // Checkpoint tiers: memory -> disk (keep K) -> the cloud, every base interval.
    let tierer = std::sync::Arc::new(motley_agent::tiers::Tierer::new(work_dir.clone(), supervisor.memory_root()));
    {
        let (t, n, s) = (tierer.clone(), node.clone(), supervisor.clone());
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(s.interval()).await;
                let pass = t.clone();
                for note in tokio::task::spawn_blocking(move || pass.tier_pass()).await.unwrap_or_default() {
                    tracing::info!(node = %n, "{note}");
                }
            }
        });
        let (t, n, s) = (tierer.clone(), node.clone(), supervisor.clone());
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(s.interval()).await;
                for note in t.cloud_pass().await {
                    tracing::info!(node = %n, "{note}");
                }
            }
        });
    }
    // The data plane: this node's checkpoint files to peers, paced to the node's NIC and disk.
    let rate = |mb_s: f64| std::sync::Arc::new(motley_agent::dataplane::Pacer::new(mb_s * 1e6));
    let (nic_out, nic_in, disk) = (rate(args.ckpt_nic_mb_s), rate(args.ckpt_nic_mb_s), rate(args.ckpt_disk_mb_s));
    let arriving = motley_agent::dataplane::Arriving::new(Duration::from_secs(600));
    let mut roots: Vec<motley_agent::dataplane::Root> =
        supervisor.memory_root().into_iter().map(|dir| motley_agent::dataplane::Root { dir, read_pacer: None }).collect();
    roots.push(motley_agent::dataplane::Root { dir: work_dir.clone(), read_pacer: Some(disk.clone()) });
    let resolver: std::sync::Arc<dyn motley_agent::dataplane::Resolve> =
        std::sync::Arc::new(motley_agent::dataplane::DirResolver::new(roots).with_arriving(arriving.clone()));
    let data = match tokio::net::TcpListener::bind(&args.data_listen).await {
        Ok(l) => l,
        Err(e) if e.kind() == std::io::ErrorKind::AddrInUse && args.data_listen == "0.0.0.0:7073" => {
            tracing::warn!(node = %node, "--data-listen 0.0.0.0:7073 is taken; serving checkpoint files on a free port instead");
            tokio::net::TcpListener::bind("0.0.0.0:0").await?
        }
        Err(e) => return Err(e).with_context(|| format!("--data-listen {}: cannot listen", args.data_listen)),
    };
    let data_url = format!("{}:{}", args.address, data.local_addr()?.port());
    tracing::info!(node = %node, "checkpoint data plane at {data_url}");
    tokio::spawn(motley_agent::dataplane::serve(data, resolver.clone(), args.token.clone(), nic_out));
    let restorer = motley_agent::restorer::Restorer::new(&work_dir, &node, args.token.clone(), resolver, arriving, nic_in, disk)
        .with_tierer(tierer.clone());
    let mut backoff = Duration::from_millis(200);
    let mut stale = 0;
    // Since when registrations are refused as held by another agent.
    let mut held_since: Option<std::time::Instant> = None;
    // Each pass is one session: register (a new epoch), then heartbeat until the stream
    // breaks; ranks keep running across sessions and are reported again in the next one.
    loop {
        let began = std::time::Instant::now();
        let workers =
            Workers { supervisor: &supervisor, profiler: profiler.as_ref(), holdings: &holdings, tierer: &tierer, restorer: &restorer };
        let e = match session(&args, &work_dir, &node, &inventory, (&logs_url, &data_url), workers, &load).await {
            Ended::Fatal(e) => return Err(e),
            Ended::Held(e) => {
                let since = *held_since.get_or_insert_with(std::time::Instant::now);
                // Longer than the coordinator's lease of a session it has not yet seen close
                // (3 base intervals), and at least 10 s.
                let window = (supervisor.interval() * 4).max(Duration::from_secs(10));
                if since.elapsed() > window {
                    return Err(e);
                }
                e
            }
            Ended::Stale(message) => {
                stale += 1;
                if stale >= STALE_SESSIONS {
                    anyhow::bail!(
                        "node {node}: the coordinator refused this agent's heartbeats as stale {stale} sessions in a row ({message}): \
                         another agent is registering as node {node}; stop it, or start this one with another --node"
                    );
                }
                anyhow::anyhow!("heartbeat refused: {message}")
            }
            Ended::Retry(e) => {
                stale = 0;
                held_since = None;
                e
            }
        };
        // A session that ran a while ended by a coordinator restart or failover: find the
        // (new) leader at once rather than after an old backoff.
        if began.elapsed() > Duration::from_secs(10) {
            backoff = Duration::from_millis(200);
        }
        tracing::warn!(node = %node, "{e:#}; reconnecting in {} ms", backoff.as_millis());
        tokio::time::sleep(backoff).await;
        // Capped low: a standby takes over within a couple of base intervals and the agents
        // must find it before their jobs' grace period ends.
        backoff = (backoff * 2).min(Duration::from_secs(1));
    }
}

/// Record whether the node is draining in `WORK_DIR/draining` (present while it is), so tools
/// on the node — a maintenance script waiting to reboot, say — can see it.
fn mark_draining(work_dir: &Path, node: &str, draining: bool) {
    let flag = work_dir.join("draining");
    let done = if draining {
        motley_agent::rankfiles::replace(&flag, b"draining\n").map_err(|e| e.to_string())
    } else {
        std::fs::remove_file(&flag)
            .or_else(|e| if e.kind() == std::io::ErrorKind::NotFound { Ok(()) } else { Err(e) })
            .map_err(|e| e.to_string())
    };
    match done {
        Ok(()) => tracing::info!(node = %node, draining, "drain state"),
        Err(e) => tracing::warn!(node = %node, "{}: {e}", flag.display()),
    }
}

/// Register with the leading coordinator: the addresses in order, and any leader a standby
/// names (its refusal carries the leader's address in `motley-leader-grpc`).
/// A channel to one coordinator URL; `https://` ones are checked against `ca` (PEM) or the
/// system's roots.
async fn channel(url: &str, ca: Option<&[u8]>) -> anyhow::Result<tonic::transport::Channel> {
    // Bounded connects and HTTP/2 keepalives: a coordinator host that vanished (no RST) is
    // noticed in seconds, so the agent moves on to the next address (or the new leader)
    // before its jobs' grace period ends.
    let mut endpoint = tonic::transport::Endpoint::from_shared(url.to_string())?
        .connect_timeout(Duration::from_secs(2))
        .http2_keep_alive_interval(Duration::from_secs(1))
        .keep_alive_timeout(Duration::from_secs(3))
        .keep_alive_while_idle(true);
    if url.starts_with("https://") {
        let tls = match ca {
            Some(pem) => tonic::transport::ClientTlsConfig::new().ca_certificate(tonic::transport::Certificate::from_pem(pem)),
            None => tonic::transport::ClientTlsConfig::new().with_native_roots(),
        };
        endpoint = endpoint.tls_config(tls)?;
    }
    Ok(endpoint.connect().await?)
}

/// How a session ended (never well: the agent runs until it is killed).
enum Ended {
    /// Connection trouble, a coordinator going away: register again after a backoff.
    Retry(anyhow::Error),
    /// The coordinator refused the heartbeats as those of a stale session (ABORTED).
    Stale(String),
    /// Refused for good: the agent exits with this error.
    Fatal(anyhow::Error),
    /// The node is held by another live agent (ALREADY_EXISTS). Fatal once it lasts longer than
    /// the coordinator could take to notice that an earlier session of this very agent is gone
    /// (a connection that dropped on this side only stays open there up to a lease).
    Held(anyhow::Error),
}

impl From<anyhow::Error> for Ended {
    fn from(e: anyhow::Error) -> Ended {
        Ended::Retry(e)
    }
}

/// A refused heartbeat stream: stale (the coordinator's ABORTED naming a stale epoch) or not.
fn heartbeat_refused(s: &tonic::Status) -> Ended {
    if s.code() == tonic::Code::Aborted && s.message().contains("stale") {
        Ended::Stale(s.message().to_string())
    } else {
        Ended::Retry(anyhow::anyhow!("heartbeat: {}", s.message()))
    }
}

async fn register(
    list: &str,
    ca: Option<&[u8]>,
    req: RegisterRequest,
) -> Result<(AgentClient<tonic::transport::Channel>, RegisterReply), Ended> {
    let mut urls: Vec<String> = list.split(',').map(str::trim).filter(|s| !s.is_empty()).map(str::to_string).collect();
    let mut last = None;
    let mut i = 0;
    while i < urls.len() {
        let url = urls[i].clone();
        i += 1;
        let mut client = match channel(&url, ca).await {
            Ok(c) => AgentClient::new(c),
            Err(e) => {
                last = Some(format!("{url}: {e}"));
                continue;
            }
        };
        // Bounded: a frozen coordinator's kernel still accepts the connection, and an agent
        // stuck on it would miss the new leader.
        let answer = match tokio::time::timeout(Duration::from_secs(3), client.register(req.clone())).await {
            Ok(a) => a,
            Err(_) => {
                last = Some(format!("{url}: no answer to the registration within 3 s"));
                continue;
            }
        };
        match answer {
            Ok(reply) => return Ok((client, reply.into_inner())),
            Err(s) if s.code() == tonic::Code::Unavailable => {
                let leader = s.metadata().get("motley-leader-grpc").and_then(|v| v.to_str().ok()).map(str::to_string);
                if let Some(l) = leader.filter(|l| !l.is_empty() && !urls.contains(l)) {
                    urls.insert(i, l);
                }
                last = Some(format!("{url}: {}", s.message()));
            }
            // Another agent runs as this node: registering again would only evict it (and
            // then be evicted), so stop (once it lasts, see `Ended::Held`) and say what to do.
            Err(s) if s.code() == tonic::Code::AlreadyExists => {
                // The coordinator says what to do; an older one may not.
                let hint = if s.message().contains("--node") { "" } else { "; stop it or start this one with another --node" };
                return Err(Ended::Held(anyhow::anyhow!("register at {url}: {}{hint}", s.message())));
            }
            // A wrong token or a refused entry will not change by trying again.
            Err(s) if matches!(s.code(), tonic::Code::Unauthenticated | tonic::Code::PermissionDenied | tonic::Code::InvalidArgument) => {
                return Err(Ended::Fatal(anyhow::anyhow!("register at {url}: {}", s.message())));
            }
            Err(s) => return Err(anyhow::anyhow!("register at {url}: {}", s.message()).into()),
        }
    }
    Err(anyhow::anyhow!("no coordinator took the registration ({})", last.unwrap_or_else(|| "--coordinator is empty".into())).into())
}

/// What runs work on the node's behalf: its ranks, and layer profiling if it can.
#[derive(Clone, Copy)]
struct Workers<'a> {
    supervisor: &'a Supervisor,
    profiler: Option<&'a Profiler>,
    holdings: &'a std::sync::Arc<motley_agent::holdings::Holdings>,
    tierer: &'a std::sync::Arc<motley_agent::tiers::Tierer>,
    restorer: &'a motley_agent::restorer::Restorer,
}

/// One session: register (a new epoch), then heartbeat until the stream breaks.
async fn session(
    args: &Args,
    work_dir: &Path,
    node: &str,
    inventory: &str,
    urls: (&str, &str),
    workers: Workers<'_>,
    load: &motley_agent::load::Latest,
) -> Ended {
    match session_inner(args, work_dir, node, inventory, urls, workers, load).await {
        Ok(never) => match never {},
        Err(e) => e,
    }
}

async fn session_inner(
    args: &Args,
    work_dir: &Path,
    node: &str,
    inventory: &str,
    (logs_url, data_url): (&str, &str),
    workers: Workers<'_>,
    load: &motley_agent::load::Latest,
) -> Result<std::convert::Infallible, Ended> {
    let Workers { supervisor, profiler, holdings, restorer, .. } = workers;
    let token = args.token.clone().unwrap_or_default();
    let request = RegisterRequest {
        node: node.to_string(),
        inventory_json: inventory.to_string(),
        token: token.clone(),
        address: args.address.clone(),
        logs_url: logs_url.to_string(),
        can_profile: profiler.is_some(),
        data_url: data_url.to_string(),
        rdma_device: motley_agent::restorer::rdma_device().unwrap_or_default(),
        ckpt_rates: Some(motley_proto::v1::CkptRates {
            disk_read_mb_s: args.ckpt_disk_mb_s,
            nic_mb_s: args.ckpt_nic_mb_s,
            mem_copy_mb_s: 0.0,
        }),
    };
    let ca = match &args.ca_cert {
        Some(p) => Some(std::fs::read(p).with_context(|| format!("--ca-cert: cannot read {}", p.display()))?),
        None => None,
    };
    let (mut client, reply) = register(&args.coordinator, ca.as_deref(), request).await?;
    let epoch = reply.epoch;
    let interval = Duration::from_millis(reply.heartbeat_ms.max(10));
    tracing::info!(node = %node, epoch, "registered; heartbeat every {} ms", interval.as_millis());
    // A lease that ran out while this agent was cut off must not stop the ranks a launch of
    // this session starts before its first acknowledgement renews it.
    if motley_agent::lease::clear_if_lapsed(work_dir) {
        tracing::warn!(node = %node, "the node's lease had run out while the coordinator was away; cleared");
    }
    supervisor.set_interval(interval);
    supervisor.new_session();
    if let Some(p) = profiler {
        p.new_session();
    }
    holdings.new_session();
    restorer.new_session();
    let (tx, rx) = tokio::sync::mpsc::channel::<AgentStatus>(16);
    let mut request = tonic::Request::new(ReceiverStream::new(rx));
    request.metadata_mut().insert("authorization", format!("Bearer {token}").parse().context("token is not a valid header value")?);
    let beat = {
        let (supervisor, node, load, profiler) = (supervisor.clone(), node.to_string(), load.clone(), profiler.cloned());
        let (holdings, work, restorer) = (holdings.clone(), work_dir.to_path_buf(), restorer.clone());
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(interval);
            // Every message has its number (1, 2, ...); the first lists every rank.
            let mut seq = 0;
            loop {
                // On the interval (the lease), and at once when ranks started or ended.
                let beat = tokio::select! {
                    _ = tick.tick() => true,
                    _ = supervisor.changed() => false,
                    _ = async { match &profiler { Some(p) => p.changed().await, None => std::future::pending().await } } => false,
                    _ = restorer.changed() => false,
                };
                let full = seq == 0;
                let ranks = supervisor.report(seq + 1, full);
                let profiles = profiler.as_ref().map(|p| p.report(seq + 1)).unwrap_or_default();
                let restores = restorer.report(seq + 1);
                // Checkpoint files are looked for on the interval (and with every other message).
                let held = match beat || full || !ranks.is_empty() || !profiles.is_empty() || !restores.is_empty() {
                    true => {
                        let (h, w, s) = (holdings.clone(), work.clone(), seq + 1);
                        tokio::task::spawn_blocking(move || h.report(&w, s)).await.unwrap_or(None)
                    }
                    false => None,
                };
                if !beat && !full && ranks.is_empty() && profiles.is_empty() && restores.is_empty() {
                    continue;
                }
                let (holdings_sent, holdings_list) = match held {
                    Some(list) => (true, list),
                    None => (false, vec![]),
                };
                seq += 1;
                // A fresh sample only (a stalled sampler's old one would mislead).
                let fresh = interval.max(motley_agent::load::SAMPLE_EVERY) * 3;
                let load = match beat {
                    true => load.borrow().as_ref().filter(|(_, at)| at.elapsed() <= fresh).map(|(l, _)| l.clone()),
                    false => None,
                };
                let status = AgentStatus {
                    node: node.clone(),
                    epoch,
                    ranks,
                    load,
                    seq,
                    full,
                    profiles,
                    holdings: holdings_list,
                    holdings_sent,
                    restores,
                };
                if tx.send(status).await.is_err() {
                    return;
                }
            }
        })
    };
    let result = heartbeat(&mut client, request, work_dir, node, interval, workers).await;
    beat.abort();
    Err(result)
}

/// Read the coordinator's instructions until the stream breaks; how it broke.
async fn heartbeat(
    client: &mut AgentClient<tonic::transport::Channel>,
    request: tonic::Request<ReceiverStream<AgentStatus>>,
    work_dir: &Path,
    node: &str,
    interval: Duration,
    workers: Workers<'_>,
) -> Ended {
    let Workers { supervisor, profiler, holdings, tierer, restorer } = workers;
    let mut inbound = match client.heartbeat(request).await {
        Ok(r) => r.into_inner(),
        Err(s) => return heartbeat_refused(&s),
    };
    loop {
        match inbound.message().await {
            Ok(Some(i)) => match i.kind {
                Some(instruction::Kind::Launch(l)) => {
                    // Its checkpoint policy (keep, cloud) first: the tiers apply it to the steps its ranks write.
                    if let Err(e) = tierer.launched(&l) {
                        tracing::warn!(node = %node, job = l.job, "{e}; the launch's checkpoints are kept as by default");
                    }
                    supervisor.launch(l)
                }
                Some(instruction::Kind::Stop(s)) => supervisor.stop(s.job, s.generation),
                Some(instruction::Kind::Drain(d)) => mark_draining(work_dir, node, d.draining),
                Some(instruction::Kind::Profile(p)) => match profiler {
                    Some(profiler) => profiler.start(p),
                    None => tracing::warn!(node = %node, request = p.request, "asked to profile, but this agent has no --python; ignored"),
                },
                Some(instruction::Kind::Restore(r)) => restorer.start(r),
                Some(instruction::Kind::SaveNow(s)) => match motley_agent::notice::write(work_dir, &s) {
                    Ok(file) => tracing::info!(node = %node, job = s.job, "preemption notice: the ranks save now ({})", file.display()),
                    Err(e) => tracing::warn!(node = %node, job = s.job, "{e}"),
                },
                Some(instruction::Kind::Ack(a)) => {
                    supervisor.ack(a.seq);
                    if let Some(p) = profiler {
                        p.ack(a.seq);
                    }
                    holdings.ack(a.seq);
                    restorer.ack(a.seq);
                    // The coordinator holds this node's lease: so do its ranks (the switch).
                    if let Err(e) = motley_agent::lease::renew(work_dir, interval) {
                        tracing::warn!(node = %node, "{e}; ranks stop when the lease file's deadline passes");
                    }
                }
                None => {}
            },
            Ok(None) => return Ended::Retry(anyhow::anyhow!("the coordinator closed the heartbeat stream")),
            Err(s) => return heartbeat_refused(&s),
        }
    }
}
