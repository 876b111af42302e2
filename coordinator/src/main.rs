//! `motley-coordinator`: the REST control API over the durable store. With no flags it keeps
//! its state in `./motley-data/coordinator.db` (SQLite) and its bearer token in
//! `./motley-data/token`, and listens on 127.0.0.1:7070.

use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Context;
use clap::Parser;
use motley_coordinator::agents::{watch_leases, AgentService, Fleet};
use motley_coordinator::rest::{router, AppState};
use motley_coordinator::Store;
use motley_proto::v1::agent_server::AgentServer;

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
    /// Bearer token for the control API (default: read or generate DATA_DIR/token).
    #[arg(long, env = "MOTLEY_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// Serve the control API without a token (local use only).
    #[arg(long)]
    insecure: bool,
    /// Address of the agents' gRPC service (port 0 picks a free one; it is printed).
    #[arg(long, env = "MOTLEY_GRPC_LISTEN", default_value = "127.0.0.1:7071")]
    grpc_listen: SocketAddr,
    /// The base interval: agents heartbeat on it, a lease expires after 3 of them.
    #[arg(long, env = "MOTLEY_HEARTBEAT_MS", default_value_t = 1000)]
    heartbeat_ms: u64,
}

/// The token: given, or read from DATA_DIR/token, or generated there (mode 0600).
fn token(args: &Args) -> anyhow::Result<Option<String>> {
    if args.insecure {
        return Ok(None);
    }
    if let Some(t) = &args.token {
        anyhow::ensure!(!t.trim().is_empty(), "--token: must not be empty; pass --insecure to serve without one");
        return Ok(Some(t.clone()));
    }
    let path = args.data_dir.join("token");
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
    eprintln!("motley-coordinator: generated a bearer token in {}", path.display());
    Ok(Some(t))
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    std::fs::create_dir_all(&args.data_dir).with_context(|| format!("--data-dir: cannot create {}", args.data_dir.display()))?;
    let url = args.database_url.clone().unwrap_or_else(|| format!("sqlite://{}", args.data_dir.join("coordinator.db").display()));
    let store = Store::open(&url).await.map_err(|e| anyhow::anyhow!("{e}"))?;
    let token = token(&args)?;
    anyhow::ensure!((10..=3_600_000).contains(&args.heartbeat_ms), "--heartbeat-ms: must be between 10 and 3600000 (one hour)");
    let fleet = Fleet::new(std::time::Duration::from_millis(args.heartbeat_ms));
    let listener = tokio::net::TcpListener::bind(args.listen).await.with_context(|| format!("--listen: cannot bind {}", args.listen))?;
    let addr = listener.local_addr()?;
    let grpc = tokio::net::TcpListener::bind(args.grpc_listen)
        .await
        .with_context(|| format!("--grpc-listen: cannot bind {}", args.grpc_listen))?;
    let grpc_addr = grpc.local_addr()?;
    // A closed stdout (a supervisor that read the addresses and left) must not stop the service.
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "motley-coordinator listening on http://{addr}");
    let _ = writeln!(out, "motley-coordinator agents on http://{grpc_addr}");
    let _ = out.flush();
    drop(out);
    let service = AgentService { store: store.clone(), fleet: fleet.clone(), token: token.clone() };
    tokio::spawn(async move {
        let incoming = tokio_stream::wrappers::TcpListenerStream::new(grpc);
        if let Err(e) = tonic::transport::Server::builder().add_service(AgentServer::new(service)).serve_with_incoming(incoming).await {
            eprintln!("motley-coordinator: agent service stopped: {e}");
        }
    });
    tokio::spawn(watch_leases(store.clone(), fleet.clone()));
    let app = router(AppState { store: store.clone(), fleet, token });
    axum::serve(listener, app).with_graceful_shutdown(shutdown()).await?;
    store.close().await;
    Ok(())
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
