//! Logs and spans: `tracing` everywhere, lines on stderr filtered by `RUST_LOG` (default
//! `info`), and — when an OTLP endpoint is configured — the same spans exported over OTLP/gRPC
//! in batches (the SDK honours the standard `OTEL_BSP_*` settings).

use opentelemetry::trace::TracerProvider;
use opentelemetry_otlp::WithExportConfig;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

use crate::error::{CoordinatorError, Result};

/// Keeps the exporter alive; `shutdown` flushes what is still batched.
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
}

/// Install the process's subscriber. Must run inside the Tokio runtime (the OTLP exporter's
/// client is tonic).
pub fn init(service: &'static str, otlp_endpoint: Option<&str>) -> Result<Telemetry> {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let lines = tracing_subscriber::fmt::layer().with_writer(std::io::stderr).with_ansi(ansi);
    let provider = match otlp_endpoint {
        Some(endpoint) => {
            let exporter = opentelemetry_otlp::SpanExporter::builder()
                .with_tonic()
                .with_endpoint(endpoint)
                .build()
                .map_err(|e| CoordinatorError::invalid("--otlp-endpoint", format!("{endpoint}: {e}")))?;
            let resource = opentelemetry_sdk::Resource::builder().with_service_name(service).build();
            Some(SdkTracerProvider::builder().with_batch_exporter(exporter).with_resource(resource).build())
        }
        None => None,
    };
    let spans = provider.as_ref().map(|p| tracing_opentelemetry::layer().with_tracer(p.tracer(service)));
    tracing_subscriber::registry().with(filter).with(lines).with(spans).init();
    if let Some(endpoint) = otlp_endpoint {
        tracing::info!(endpoint, "exporting spans over OTLP");
    }
    Ok(Telemetry { provider })
}

impl Telemetry {
    /// Flush and stop the exporter (spans still batched are sent).
    pub fn shutdown(self) {
        if let Some(p) = self.provider {
            if let Err(e) = p.shutdown() {
                eprintln!("motley: OTLP export did not flush: {e}");
            }
        }
    }
}
