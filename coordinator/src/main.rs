//! `motley-coordinator`: the control API (REST and gRPC) and the agents' service over the
//! durable store. With no flags it keeps its state in `./motley-data/coordinator.db` (SQLite)
//! and its bearer token in `./motley-data/token`, and listens on 127.0.0.1:7070 (REST) and
//! 127.0.0.1:7071 (gRPC). Several coordinators may share one database: one leads, the others
//! wait as standbys and name the leader (see `leader.rs`).

use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Context;
use clap::Parser;
use std::sync::Arc;

use motley_coordinator::life::Life;
use motley_coordinator::server::leader::{self, Contender, LeaderInfo, Role};
use motley_coordinator::server::metrics::Metrics;
use motley_coordinator::server::tls::TlsFiles;
use motley_coordinator::service::agent::AgentService;
use motley_coordinator::service::control::ControlService;
use motley_coordinator::service::rest::hosts::{url_host, ServedHosts};
use motley_coordinator::service::rest::{router, AppState};
use motley_coordinator::service::Tokens;
use motley_coordinator::state::facts::Facts;
use motley_coordinator::state::fleet::Fleet;
use motley_coordinator::Store;
use motley_proto::v1::agent_server::AgentServer;
use motley_proto::v1::control_server::ControlServer;
use motley_server::config;

#[derive(Clone, Copy, clap::ValueEnum)]
enum RestoreMode {
    Planned,
    CloudOnly,
}

#[derive(Parser)]
#[command(name = "motley-coordinator", version, about = "Motley's coordinator: inventory, jobs, plans and launches")]
struct Args {
    /// Address to listen on (port 0 picks a free one; the chosen address is printed).
    #[arg(long, env = "MOTLEY_LISTEN", default_value = "127.0.0.1:7070")]
    listen: SocketAddr,
    /// Where the SQLite database and the generated token live.
    #[arg(long, env = "MOTLEY_DATA_DIR", default_value = "motley-data")]
    data_dir: PathBuf,
    /// sqlite://PATH or postgres://USER@HOST:PORT/DB (default: SQLite in --data-dir).
    #[arg(long, env = "MOTLEY_DATABASE_URL")]
    database_url: Option<String>,
    /// Bearer token for the control API, the operators' (default: read or generate
    /// DATA_DIR/token).
    #[arg(long, env = "MOTLEY_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// The agents' token: it opens the agent service (and the agents' log service) only; the
    /// control API refuses it (default: read or generate DATA_DIR/agent-token).
    #[arg(long, env = "MOTLEY_AGENT_TOKEN", hide_env_values = true)]
    agent_token: Option<String>,
    /// How long planning one job may take before it fails (a job file's plan_timeout_s wins).
    #[arg(long, env = "MOTLEY_PLAN_TIMEOUT_MS", default_value_t = 60_000)]
    plan_timeout_ms: u64,
    /// Serve the control API without a token (local use only). `--insecure=false` turns off a
    /// config file's `insecure = true`.
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true", default_value_t = false, action = clap::ArgAction::Set)]
    insecure: bool,
    /// Address of the agents' gRPC service (port 0 picks a free one; it is printed).
    #[arg(long, env = "MOTLEY_GRPC_LISTEN", default_value = "127.0.0.1:7071")]
    grpc_listen: SocketAddr,
    /// The base interval: agents heartbeat on it, a lease expires after 3 of them.
    #[arg(long, env = "MOTLEY_HEARTBEAT_MS", default_value_t = 1000)]
    heartbeat_ms: u64,
    /// The first of the ports ranks meet at (MASTER_PORT): job J's launch of generation G gets
    /// BASE + 2 (J mod 512) + (G mod 2), so jobs less than 512 apart never share one; 1,024
    /// ports from BASE are used (open them between the nodes).
    #[arg(long, env = "MOTLEY_MASTER_PORT_BASE", default_value_t = 29500)]
    master_port_base: u16,
    /// The object store's egress shared by all nodes (MB/s): what the restore planner assumes
    /// for checkpoint bytes only the cloud holds.
    #[arg(long, env = "MOTLEY_CLOUD_EGRESS_MB_S", default_value_t = 1200.0)]
    cloud_egress_mb_s: f64,
    /// How recoveries restore: `planned` (local reads, peers, each missing byte from the cloud
    /// once) or `cloud-only` (every rank fetches its own shards from the cloud, Varuna's way: the
    /// benchmark's baseline).
    #[arg(long, env = "MOTLEY_RESTORE_MODE", value_enum, default_value = "planned")]
    restore_mode: RestoreMode,
    /// The host name or address published for the CLI and agents when this coordinator leads
    /// (default: the listen address, or the host name when listening on a wildcard).
    #[arg(long, env = "MOTLEY_ADVERTISE_HOST")]
    advertise_host: Option<String>,
    /// The URLs operators and browsers reach this coordinator at (a DNS name, a load
    /// balancer's), comma-separated: the REST API answers requests for their host names, IP
    /// addresses, localhost, this machine's host name and --advertise-host, and no others
    /// (a page on another name that resolves here, DNS rebinding, is refused).
    #[arg(long, env = "MOTLEY_PUBLIC_URL", value_delimiter = ',')]
    public_url: Vec<String>,
    /// Serve REST and gRPC over TLS with this certificate chain (PEM); needs --tls-key.
    #[arg(long, env = "MOTLEY_TLS_CERT")]
    tls_cert: Option<PathBuf>,
    /// The private key (PEM) of --tls-cert.
    #[arg(long, env = "MOTLEY_TLS_KEY")]
    tls_key: Option<PathBuf>,
    /// The CA certificate(s) (PEM) the agents' log-service certificates are checked against
    /// when their logs URL is https (default: the public web roots ureq ships).
    #[arg(long, env = "MOTLEY_AGENT_CA_CERT")]
    agent_ca_cert: Option<PathBuf>,
    /// Export spans over OTLP/gRPC to this collector (e.g. http://otel-collector:4317).
    #[arg(long, env = "MOTLEY_OTLP_ENDPOINT")]
    otlp_endpoint: Option<String>,
    /// The checkpoint cloud (file:///ABSOLUTE/PATH, s3://, gs://, az://) of every job whose
    /// `checkpoint:` names none: a Slurm allocation's shared storage (docs/slurm.md).
    #[arg(long, env = "MOTLEY_CHECKPOINT_CLOUD")]
    checkpoint_cloud: Option<String>,
    /// GPU types beyond the planner's catalog: a YAML file with the cluster file's `gpu_types:`
    /// list (a cluster file will do). Nodes may then name them.
    #[arg(long, env = "MOTLEY_GPU_TYPES")]
    gpu_types: Option<PathBuf>,
    /// A TOML file with any of these options (flags and MOTLEY_* variables win over it).
    #[arg(long, env = "MOTLEY_CONFIG", default_value = "/etc/motley/coordinator.toml")]
    config: PathBuf,
}

/// A token: given (`flag` names it), or read from DATA_DIR/FILE, or generated there (0600).
fn token(args: &Args, given: Option<&String>, flag: &str, file: &str) -> anyhow::Result<Option<String>> {
    if args.insecure {
        return Ok(None);
    }
    if let Some(t) = given {
        anyhow::ensure!(!t.trim().is_empty(), "{flag}: must not be empty; pass --insecure to serve without one");
        return Ok(Some(t.clone()));
    }
    let path = args.data_dir.join(file);
    if let Ok(t) = std::fs::read_to_string(&path) {
        if !t.trim().is_empty() {
            return Ok(Some(t.trim().to_string()));
        }
    }
    let mut bytes = [0u8; 24];
    std::fs::File::open("/dev/urandom").and_then(|mut f| std::io::Read::read_exact(&mut f, &mut bytes)).context("reading /dev/urandom")?;
    let t: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    // Write to a temporary file, then rename: a crash never leaves half a token.
    let tmp = path.with_extension("tmp");
    {
        let mut open = std::fs::OpenOptions::new();
        open.write(true).create(true).truncate(true);
        #[cfg(unix)]
        std::os::unix::fs::OpenOptionsExt::mode(&mut open, 0o600);
        let mut f = open.open(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
        f.write_all(t.as_bytes())?;
        f.sync_all()?;
    }
    std::fs::rename(&tmp, &path)?;
    tracing::info!("generated a bearer token in {}", path.display());
    Ok(Some(t))
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = config::parse::<Args>("/etc/motley/coordinator.toml")?;
    let telemetry = motley_coordinator::server::telemetry::init("motley-coordinator", args.otlp_endpoint.as_deref())
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    create_data_dir(&args.data_dir)?;
    let url = args.database_url.clone().unwrap_or_else(|| format!("sqlite://{}", args.data_dir.join("coordinator.db").display()));
    let hosts = Arc::new(served_hosts(&args)?);
    anyhow::ensure!((10..=3_600_000).contains(&args.heartbeat_ms), "--heartbeat-ms: must be between 10 and 3600000 (one hour)");
    let base = std::time::Duration::from_millis(args.heartbeat_ms);
    // Longer than a standby waits for a stale leader, never so short a loaded machine's
    // transactions are cut.
    let idle_in_transaction = (base * leader::STALE_LEADER_INTERVALS).max(std::time::Duration::from_secs(5));
    let store = Store::open_bounded(&url, idle_in_transaction).await.map_err(|e| anyhow::anyhow!("{e}"))?;
    let data_plane_key = data_plane_key(&store).await?;
    let tokens = tokens(&args)?;
    anyhow::ensure!((1..=3_600_000).contains(&args.plan_timeout_ms), "--plan-timeout-ms: must be between 1 and 3600000 (one hour)");
    let tls = TlsFiles::from_flags(args.tls_cert.clone(), args.tls_key.clone()).map_err(|e| anyhow::anyhow!("{e}"))?;
    // Read and checked before anything listens: a bad certificate is a start-up error.
    let rest_tls = tls.as_ref().map(TlsFiles::server_config).transpose().map_err(|e| anyhow::anyhow!("{e}"))?;
    let grpc_tls = grpc_tls(tls.as_ref())?;
    let agent_roots = agent_roots(args.agent_ca_cert.as_deref())?;
    let scheme = if tls.is_some() { "https" } else { "http" };
    check_ports_and_egress(&args)?;
    if let Some(path) = &args.gpu_types {
        declare_gpu_types(path)?;
    }
    let fleet = Fleet::new(base, args.master_port_base, std::time::Duration::from_millis(args.plan_timeout_ms));
    let facts = Arc::new(Facts::default());
    let signals = motley_coordinator::state::signals::JobSignals::new();
    let life = Life::new(store.clone(), fleet.clone(), facts.clone(), signals.clone(), restore_settings(&args, data_plane_key));
    let listener = tokio::net::TcpListener::bind(args.listen).await.with_context(|| format!("--listen: cannot bind {}", args.listen))?;
    let addr = listener.local_addr()?;
    let grpc = tokio::net::TcpListener::bind(args.grpc_listen)
        .await
        .with_context(|| format!("--grpc-listen: cannot bind {}", args.grpc_listen))?;
    let grpc_addr = grpc.local_addr()?;
    let me = leader_info(&args, scheme, addr, grpc_addr);
    let role = Arc::new(Role::default());
    // The leader's tasks, handed to the supervisor below once leadership is won.
    let (led, leading) = tokio::sync::oneshot::channel();
    let mut contender = {
        let (store, life) = (store.clone(), life.clone());
        Contender {
            store: store.clone(),
            lock: leader::lock_for(&url, base),
            base,
            role: role.clone(),
            me,
            on_lead: Some(move |_term| {
                let _ = led.send(motley_coordinator::life::reconcile::spawn(life));
            }),
        }
    };
    let supervised = supervise_leader(leading);
    // The first round before the addresses are printed: a lone coordinator serves as leader
    // from its first request.
    contender.step().await.context("leadership")?;
    if !role.is_leader() {
        tracing::info!(leader = %role.leader().rest_url, "standing by");
    }
    print_addresses(scheme, addr, grpc_addr);
    let metrics = Metrics::new(store.clone(), fleet.clone(), role.clone());
    let agents = AgentService {
        store: store.clone(),
        fleet: fleet.clone(),
        facts,
        signals,
        tokens: tokens.clone(),
        role: role.clone(),
        data_plane_key,
    };
    let control =
        ControlService { store: store.clone(), fleet: fleet.clone(), life: life.clone(), role: role.clone(), tokens: tokens.clone() };
    let grpc_server = serve_grpc(grpc, base, grpc_tls, agents, control);
    let lead = contender.run();
    let curves = Default::default();
    let app = router(AppState { store: store.clone(), fleet, life, tokens, role, metrics, agent_roots, hosts, curves });
    let rest = serve_rest(listener, app, rest_tls);
    let result = tokio::select! {
        r = rest => r.context("REST service"),
        r = grpc_server => r.context("gRPC service"),
        r = lead => r.context("leadership"),
        r = supervised => r.context("leadership"),
    };
    store.close().await;
    telemetry.shutdown();
    result
}

/// Create the data directory, and make everything this process creates (the database and its
/// journal, tokens) the service user's alone: job specs carry their envs.
fn create_data_dir(dir: &std::path::Path) -> anyhow::Result<()> {
    // SAFETY: umask(2) only sets this process's file-creation mask.
    unsafe {
        libc::umask(0o077);
    }
    std::fs::create_dir_all(dir).with_context(|| format!("--data-dir: cannot create {}", dir.display()))?;
    private(dir)
}

/// The operators' and the agents' tokens, which must differ.
fn tokens(args: &Args) -> anyhow::Result<Tokens> {
    let tokens = Tokens {
        operator: token(args, args.token.as_ref(), "--token", "token")?,
        agent: token(args, args.agent_token.as_ref(), "--agent-token", "agent-token")?,
    };
    anyhow::ensure!(
        tokens.operator.is_none() || tokens.operator != tokens.agent,
        "--agent-token: must differ from --token (a GPU node's credential must not open the control API)"
    );
    Ok(tokens)
}

fn check_ports_and_egress(args: &Args) -> anyhow::Result<()> {
    anyhow::ensure!(
        u32::from(args.master_port_base) >= 1024 && u32::from(args.master_port_base) + 1024 <= 65536,
        "--master-port-base: must be between 1024 and 64512 (1,024 ports from it are used)"
    );
    anyhow::ensure!(
        args.cloud_egress_mb_s.is_finite() && args.cloud_egress_mb_s > 0.0,
        "--cloud-egress-mb-s: must be a rate above 0 MB/s (e.g. 1200)"
    );
    if let Some(url) = &args.checkpoint_cloud {
        motley_coordinator::job::spec::cloud_url(url).map_err(|e| anyhow::anyhow!("--checkpoint-cloud: {e}"))?;
    }
    Ok(())
}

/// How recoveries restore (--restore-mode, --cloud-egress-mb-s) and the key their
/// capabilities are signed with.
fn restore_settings(args: &Args, data_plane_key: motley_coordinator::life::DataPlaneKey) -> motley_coordinator::life::Settings {
    motley_coordinator::life::Settings {
        cloud_egress_mb_s: args.cloud_egress_mb_s,
        mode: match args.restore_mode {
            RestoreMode::Planned => motley_coordinator::planning::restore_plan::Mode::Planned,
            RestoreMode::CloudOnly => motley_coordinator::planning::restore_plan::Mode::CloudOnly,
        },
        data_plane_key: Some(data_plane_key),
        default_cloud: args.checkpoint_cloud.clone(),
    }
}

/// What this coordinator publishes when it leads: the addresses it listens on, under
/// --advertise-host when given.
fn leader_info(args: &Args, scheme: &str, addr: SocketAddr, grpc_addr: SocketAddr) -> LeaderInfo {
    let rest_host = args.advertise_host.clone().unwrap_or_else(|| advertised_host(addr.ip()));
    let grpc_host = args.advertise_host.clone().unwrap_or_else(|| advertised_host(grpc_addr.ip()));
    LeaderInfo {
        term: 0,
        rest_url: format!("{scheme}://{rest_host}:{}", addr.port()),
        grpc_url: format!("{scheme}://{grpc_host}:{}", grpc_addr.port()),
    }
}

/// Watch the leader's tasks once leadership is won: one that ends makes
/// this coordinator step down. Never ends while it does not lead.
async fn supervise_leader(leading: tokio::sync::oneshot::Receiver<Vec<(&'static str, tokio::task::JoinHandle<()>)>>) -> anyhow::Result<()> {
    let Ok(tasks) = leading.await else { return std::future::pending().await };
    let why = motley_coordinator::server::supervise::watch(tasks, &[]).await;
    tracing::error!("{why}; stepping down");
    Err::<(), _>(anyhow::anyhow!("{why}"))
}

/// The data plane's key: fresh random bytes, kept only if the database has none yet (a
/// standby and a restart get the one stored first).
async fn data_plane_key(store: &Store) -> anyhow::Result<motley_coordinator::life::DataPlaneKey> {
    let mut candidate = [0u8; motley_server::capability::KEY_BYTES];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut candidate))
        .context("reading /dev/urandom")?;
    let data_plane_key = store.data_plane_key(&candidate).await.map_err(|e| anyhow::anyhow!("{e}"))?;
    motley_coordinator::life::DataPlaneKey::from_slice(&data_plane_key).map_err(|e| anyhow::anyhow!("{e}"))
}

/// gRPC's TLS identity: the same certificate and key as REST's.
fn grpc_tls(tls: Option<&TlsFiles>) -> anyhow::Result<Option<tonic::transport::ServerTlsConfig>> {
    match tls {
        Some(files) => {
            let (cert, key) = files.pem().map_err(|e| anyhow::anyhow!("{e}"))?;
            Ok(Some(tonic::transport::ServerTlsConfig::new().identity(tonic::transport::Identity::from_pem(cert, key))))
        }
        None => Ok(None),
    }
}

/// The roots the agents' log-service certificates are checked against: --agent-ca-cert's, or
/// the public web roots.
fn agent_roots(ca_cert: Option<&std::path::Path>) -> anyhow::Result<ureq::tls::RootCerts> {
    let Some(path) = ca_cert else { return Ok(ureq::tls::RootCerts::WebPki) };
    let pem = std::fs::read(path).with_context(|| format!("--agent-ca-cert: cannot read {}", path.display()))?;
    let certs = ureq::tls::parse_pem(&pem)
        .filter_map(|item| match item {
            Ok(ureq::tls::PemItem::Certificate(c)) => Some(Ok(c)),
            Ok(_) => None,
            Err(e) => Some(Err(e)),
        })
        .collect::<Result<Vec<_>, _>>()
        .with_context(|| format!("--agent-ca-cert: {} is not PEM", path.display()))?;
    anyhow::ensure!(
        !certs.is_empty(),
        "--agent-ca-cert: no certificate in {}; give the CA that signed the agents' --tls-cert",
        path.display()
    );
    Ok(ureq::tls::RootCerts::new_with_certs(&certs))
}

/// Add --gpu-types' GPU types to the planner's catalog.
fn declare_gpu_types(path: &std::path::Path) -> anyhow::Result<()> {
    let text = std::fs::read_to_string(path).with_context(|| format!("--gpu-types: cannot read {}", path.display()))?;
    let types = motley_coordinator::state::catalog::read(&text, "--gpu-types").map_err(|e| anyhow::anyhow!("{e}"))?;
    tracing::info!("{} GPU types declared in {}", types.len(), path.display());
    motley_coordinator::state::catalog::declare(types).map_err(|e| anyhow::anyhow!("{e}"))
}

/// The two addresses on stdout, the first lines a supervisor reads.
fn print_addresses(scheme: &str, addr: SocketAddr, grpc_addr: SocketAddr) {
    // A closed stdout (a supervisor that read the addresses and left) must not stop the service.
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "motley-coordinator listening on {scheme}://{addr}");
    let _ = writeln!(out, "motley-coordinator agents on {scheme}://{grpc_addr}");
    let _ = out.flush();
}

/// Agents and the control API share the gRPC port.
async fn serve_grpc(
    grpc: tokio::net::TcpListener,
    base: std::time::Duration,
    tls: Option<tonic::transport::ServerTlsConfig>,
    agents: AgentService,
    control: ControlService,
) -> Result<(), tonic::transport::Error> {
    let incoming = tokio_stream::wrappers::TcpListenerStream::new(grpc);
    // Keepalives on the agents' streams: a peer that vanished without closing is dropped
    // within a lease, with its heartbeat task.
    let mut server = tonic::transport::Server::builder()
        .http2_keepalive_interval(Some(base))
        .http2_keepalive_timeout(Some(base * motley_coordinator::state::fleet::LEASE_INTERVALS));
    if let Some(config) = tls {
        server = server.tls_config(config)?;
    }
    server.add_service(AgentServer::new(agents)).add_service(ControlServer::new(control)).serve_with_incoming(incoming).await
}

/// The REST API, over TLS when it has a certificate, until Ctrl-C or SIGTERM.
async fn serve_rest(
    listener: tokio::net::TcpListener,
    app: axum::Router,
    tls: Option<Arc<tokio_rustls::rustls::ServerConfig>>,
) -> std::io::Result<()> {
    match tls {
        Some(config) => {
            tokio::select! {
                r = motley_coordinator::server::tls::serve_rest(listener, app, config) => r,
                _ = shutdown() => Ok(()),
            }
        }
        None => axum::serve(listener, app).with_graceful_shutdown(shutdown()).await,
    }
}

/// Make the data directory the service user's alone (0700), and its files 0600: an earlier
/// version left them world-readable.
fn private(dir: &std::path::Path) -> anyhow::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
        .with_context(|| format!("--data-dir: cannot chmod {}", dir.display()))?;
    for entry in std::fs::read_dir(dir)?.flatten() {
        if entry.file_type().is_ok_and(|t| t.is_file()) {
            std::fs::set_permissions(entry.path(), std::fs::Permissions::from_mode(0o600))
                .with_context(|| format!("--data-dir: cannot chmod {}", entry.path().display()))?;
        }
    }
    Ok(())
}

/// The names the REST API answers to (`service::rest::hosts`).
fn served_hosts(args: &Args) -> anyhow::Result<ServedHosts> {
    let mut names = vec![machine_host_name()];
    names.extend(args.advertise_host.clone());
    for url in &args.public_url {
        names.push(url_host(url).map_err(anyhow::Error::msg)?);
    }
    Ok(ServedHosts::new(names))
}

fn machine_host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname").map(|h| h.trim().to_string()).unwrap_or_else(|_| "localhost".into())
}

/// The host other machines reach this coordinator at: the listen address unless it is a
/// wildcard, then the host name.
fn advertised_host(ip: std::net::IpAddr) -> String {
    if !ip.is_unspecified() {
        return ip.to_string();
    }
    machine_host_name()
}

/// Ctrl-C or SIGTERM (systemd's stop).
async fn shutdown() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        if let Ok(mut s) = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            s.recv().await;
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
}
