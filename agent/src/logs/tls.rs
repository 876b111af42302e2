//! The log service over TLS when the agent is given a certificate and its key (PEM files,
//! `--tls-cert`/`--tls-key`): rank logs and the agent token then never cross the network in
//! the clear. The files and the serving loop are `motley_server::serve`'s, the same as the
//! coordinator's REST API.

use std::sync::Arc;

pub use motley_server::serve::TlsFiles;
use tokio_rustls::rustls::ServerConfig;

/// Serve the router over TLS until the process ends.
pub async fn serve(listener: tokio::net::TcpListener, app: axum::Router, config: Arc<ServerConfig>) -> std::io::Result<()> {
    motley_server::serve::serve_tls(listener, app, config, "logs").await
}
