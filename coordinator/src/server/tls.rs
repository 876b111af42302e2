//! TLS for both APIs when the coordinator is given a certificate and its key (PEM files):
//! gRPC through tonic's rustls support (the PEM texts), REST through `motley_server::serve`,
//! the same rustls (ring provider) and serving loop as the agent's log service.

use std::sync::Arc;

pub use motley_server::serve::TlsFiles;
use tokio_rustls::rustls::ServerConfig;

/// Serve the REST router over TLS until the process stops.
pub async fn serve_rest(listener: tokio::net::TcpListener, app: axum::Router, config: Arc<ServerConfig>) -> std::io::Result<()> {
    motley_server::serve::serve_tls(listener, app, config, "rest").await
}
