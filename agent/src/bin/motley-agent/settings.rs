//! The agent's settings: flags, `MOTLEY_*` environment, the config file, in that order; and
//! what the node says about itself (its name, its inventory or its discovered hardware).

use std::path::{Path, PathBuf};

use clap::{Parser, Subcommand, ValueEnum};
use motley_agent::node::discover::{default_sysfs, discover};
use motley_agent::AgentError;
use motley_server::config;

#[derive(Parser)]
#[command(name = "motley-agent", version, about = "Motley's per-node agent")]
pub(crate) struct Args {
    /// The config file (TOML; keys are these flags' long names with '_'). Default
    /// /etc/motley/agent.toml, which may be absent.
    #[arg(long, env = "MOTLEY_CONFIG", global = true)]
    pub(crate) config: Option<PathBuf>,
    /// The coordinator's agent (gRPC) address(es), comma-separated, tried in order.
    #[arg(long, env = "MOTLEY_COORDINATOR_GRPC", default_value = "http://127.0.0.1:7071")]
    pub(crate) coordinator: String,
    /// This node's name (default: the host name).
    #[arg(long, env = "MOTLEY_NODE", global = true)]
    pub(crate) node: Option<String>,
    /// The node's hardware as a cluster-file node entry (YAML); without it, discovered.
    #[arg(long, env = "MOTLEY_INVENTORY")]
    pub(crate) inventory: Option<PathBuf>,
    /// The shared agent token (also required by the logs endpoint when set).
    #[arg(long, env = "MOTLEY_TOKEN", hide_env_values = true)]
    pub(crate) token: Option<String>,
    /// Where rank logs, plan files and rank records go (default: motley-agent/NODE, so that
    /// agents of several nodes on one machine never share one). Made absolute at start; one
    /// agent per directory.
    #[arg(long, env = "MOTLEY_WORK_DIR")]
    pub(crate) work_dir: Option<PathBuf>,
    /// Hours a finished launch's files (rank logs, plan, records) are kept after its ranks'
    /// ends were reported and nothing in them changed; then they are deleted (0: at once).
    #[arg(long, env = "MOTLEY_KEEP_FINISHED_HOURS", default_value_t = 72.0)]
    pub(crate) keep_finished_hours: f64,
    /// The address other nodes reach this one at (MASTER_ADDR when rank 0 runs here, and the
    /// host of the logs URL).
    #[arg(long, env = "MOTLEY_ADDRESS", default_value = "127.0.0.1")]
    pub(crate) address: String,
    /// Where the rank logs are served over HTTP (port 0: any free port). When the default
    /// port is taken (several agents on one machine) a free one is used instead.
    #[arg(long, env = "MOTLEY_LOGS_LISTEN", default_value = "0.0.0.0:7072")]
    pub(crate) logs_listen: String,
    /// The sysfs root discovery reads NICs from.
    #[arg(long, env = "MOTLEY_SYSFS_ROOT", default_value = "/sys", global = true)]
    pub(crate) sysfs_root: PathBuf,
    /// The RDMA domain of a discovered node (nodes whose RDMA NICs reach each other share one).
    #[arg(long, env = "MOTLEY_RDMA_DOMAIN", global = true)]
    pub(crate) rdma_domain: Option<String>,
    /// The CA certificate (PEM) an https coordinator's certificate is checked against
    /// (default: the system's roots).
    #[arg(long, env = "MOTLEY_CA_CERT")]
    pub(crate) ca_cert: Option<PathBuf>,
    /// Serve the rank logs over TLS with this certificate chain (PEM); needs --tls-key. The
    /// logs URL sent to the coordinator is then https://ADDRESS:PORT.
    #[arg(long, env = "MOTLEY_TLS_CERT")]
    pub(crate) tls_cert: Option<PathBuf>,
    /// The private key (PEM) of --tls-cert.
    #[arg(long, env = "MOTLEY_TLS_KEY")]
    pub(crate) tls_key: Option<PathBuf>,
    /// Let ranks run as root: when the agent runs as root, a job that names no `user` runs its
    /// ranks as root (without it they are refused, exit 126), and so does one naming a uid-0
    /// user. Off by default: a job file alone must not run code as root on every node.
    #[arg(long, env = "MOTLEY_ALLOW_ROOT_RANKS")]
    pub(crate) allow_root_ranks: bool,
    /// More of the agent's environment variables ranks inherit, comma-separated: names, or
    /// prefixes ending in '*' (e.g. LD_LIBRARY_PATH,NCCL_*). Ranks always get PATH, LANG,
    /// LANGUAGE, LC_*, TZ, TERM and TMPDIR, and nothing else of the agent's: its MOTLEY_*
    /// settings and its cloud credentials stay with it (docs/state.md).
    #[arg(long, env = "MOTLEY_RANK_ENV", value_delimiter = ',')]
    pub(crate) rank_env: Vec<String>,
    /// Directories, comma-separated and absolute, where a root agent keeps a file:// checkpoint
    /// cloud (`checkpoint.cloud`) for a job whose ranks run as another user; each must be the
    /// agent's own and writable by no one else. Such a URL elsewhere is refused (its uploads
    /// skipped, restores from it failed): the agent writes there as root (docs/state.md).
    #[arg(long, env = "MOTLEY_CLOUD_FILE_ROOT", value_delimiter = ',')]
    pub(crate) cloud_file_root: Vec<PathBuf>,
    /// A Python (path, or a command on PATH) with motley_torch and torch installed: the agent
    /// then measures layer profiles when the coordinator asks (`python -m motley_torch.profile`,
    /// run as the agent's user on the GPUs the coordinator names). Without it the node is never
    /// asked to profile.
    #[arg(long, env = "MOTLEY_PYTHON")]
    pub(crate) python: Option<String>,
    /// The memory tier ranks write checkpoints into (a tmpfs; default
    /// /dev/shm/motley-agent-NODE-HASH, HASH naming the work directory; empty: ranks write on the
    /// work directory's disk). The agent keeps each job's newest
    /// complete step there and copies every complete step to disk.
    #[arg(long, env = "MOTLEY_SHM_DIR")]
    pub(crate) shm_dir: Option<String>,
    /// Where this agent serves checkpoint files to peers (the data plane; port 0: any free port).
    /// When the default port is taken (several agents on one machine) a free one is used.
    #[arg(long, env = "MOTLEY_DATA_LISTEN", default_value = "0.0.0.0:7073")]
    pub(crate) data_listen: String,
    /// The rate checkpoint bytes leave and enter this node's NIC (MB/s; 0: unpaced). The agent
    /// holds its data plane to it and the restore planner plans with it.
    #[arg(long, env = "MOTLEY_CKPT_NIC_MB_S", default_value_t = 0.0)]
    pub(crate) ckpt_nic_mb_s: f64,
    /// The rate checkpoint files are read from this node's disk (MB/s; 0: unpaced).
    #[arg(long, env = "MOTLEY_CKPT_DISK_MB_S", default_value_t = 0.0)]
    pub(crate) ckpt_disk_mb_s: f64,
    /// The share of time this agent's link probes may hold the wire (docs/network.md,
    /// "Measure (agents)"): after a probe charged d, the next starts no sooner than
    /// d * (1/duty - 1) later. 0 disables probing; else from 0.0001 to 0.5.
    #[arg(long, env = "MOTLEY_PROBE_DUTY", default_value_t = 0.01)]
    pub(crate) probe_duty: f64,
    /// How long each link probe should take (ms): probes are sized to it at the link's last
    /// measured rate, between 64 KiB and 8 MiB, and stop reading at 4 times it.
    #[arg(long, env = "MOTLEY_PROBE_TARGET_MS", default_value_t = 50)]
    pub(crate) probe_target_ms: u64,
    #[command(subcommand)]
    pub(crate) command: Option<Command>,
}

#[derive(Subcommand)]
pub(crate) enum Command {
    /// Print this node's discovered hardware as a cluster-file node entry.
    Discover {
        #[arg(short, long, value_enum, default_value = "yaml")]
        output: Output,
    },
}

#[derive(Clone, Copy, ValueEnum)]
pub(crate) enum Output {
    Yaml,
    Json,
}

/// FNV-1a (64 bits): a stable short name for a path (not a security boundary).
pub(crate) fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3))
}

/// The agent's config file when `--config` names none (it may be absent).
const DEFAULT_CONFIG: &str = "/etc/motley/agent.toml";

/// Flags, then the environment, then the config file, then the defaults.
pub(crate) fn settings() -> anyhow::Result<Args> {
    let args: Args = config::parse(DEFAULT_CONFIG)?;
    anyhow::ensure!(
        args.keep_finished_hours.is_finite() && args.keep_finished_hours >= 0.0,
        "keep_finished_hours: must be a number of hours, 0 or more (e.g. 72)"
    );
    for (flag, v) in [("ckpt_nic_mb_s", args.ckpt_nic_mb_s), ("ckpt_disk_mb_s", args.ckpt_disk_mb_s)] {
        anyhow::ensure!(v.is_finite() && v >= 0.0, "{flag}: must be a rate in MB/s, 0 (unpaced) or more");
    }
    motley_agent::net::check_duty(args.probe_duty).map_err(anyhow::Error::msg)?;
    anyhow::ensure!(
        (1..=10_000).contains(&args.probe_target_ms),
        "probe_target_ms: must be a probe's duration in milliseconds, 1 to 10000 (default 50)"
    );
    Ok(args)
}

/// The sysfs root (`--sysfs-root`; empty: /sys).
pub(crate) fn sysfs(args: &Args) -> PathBuf {
    if args.sysfs_root.as_os_str().is_empty() {
        default_sysfs()
    } else {
        args.sysfs_root.clone()
    }
}

pub(crate) fn node_name(args: &Args) -> String {
    args.node.clone().unwrap_or_else(|| {
        std::fs::read_to_string("/proc/sys/kernel/hostname").map(|h| h.trim().to_string()).unwrap_or_else(|_| "localhost".into())
    })
}

pub(crate) fn inventory_json(path: &Path) -> anyhow::Result<String> {
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
pub(crate) fn discovered(args: &Args, node: &str) -> (motley_agent::node::discover::Discovered, motley_agent::Result<()>) {
    let (gpus, why) = motley_agent::node::nvml::gpus();
    let (mut d, checked) = discover(node, &sysfs(args), &gpus);
    d.entry.rdma_domain = args.rdma_domain.clone();
    d.notes.extend(why);
    (d, checked)
}
