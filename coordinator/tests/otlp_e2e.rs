//! With `--otlp-endpoint`, the coordinator's spans reach an OTLP collector (a stand-in
//! collector served by this test over the real OTLP/gRPC contract), under the service name
//! `motley-coordinator`.

use crate::common;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{temp_dir, wait_for_state, Coordinator};
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{TraceService, TraceServiceServer};
use opentelemetry_proto::tonic::collector::trace::v1::{ExportTraceServiceRequest, ExportTraceServiceResponse};

#[derive(Clone, Default)]
struct Collector {
    /// (service name, span name) of every span received.
    spans: Arc<Mutex<Vec<(String, String)>>>,
}

#[tonic::async_trait]
impl TraceService for Collector {
    async fn export(
        &self,
        req: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let mut spans = self.spans.lock().unwrap();
        for rs in req.into_inner().resource_spans {
            let service = rs
                .resource
                .iter()
                .flat_map(|r| &r.attributes)
                .find(|a| a.key == "service.name")
                .and_then(|a| a.value.as_ref())
                .map(|v| format!("{:?}", v.value))
                .unwrap_or_default();
            for ss in rs.scope_spans {
                for s in ss.spans {
                    spans.push((service.clone(), s.name));
                }
            }
        }
        Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spans_reach_the_collector() {
    let collector = Collector::default();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = format!("http://{}", listener.local_addr().unwrap());
    let server = collector.clone();
    tokio::spawn(async move {
        tonic::transport::Server::builder()
            .add_service(TraceServiceServer::new(server))
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener))
            .await
    });
    let spans = collector.spans.clone();
    tokio::task::spawn_blocking(move || {
        // Export batches every 100 ms rather than the SDK's default 5 s.
        std::env::set_var("OTEL_BSP_SCHEDULE_DELAY", "100");
        let c = Coordinator::start(&temp_dir(), &["--insecure", "--otlp-endpoint", &endpoint]);
        c.json("PUT", "/api/v1/nodes/a100-0", "gpu: A100-80G\ngpus: 8\n", 200);
        let id =
            c.json("POST", "/api/v1/jobs", "name: traced\nmodel: gpt3-1.3b\nglobal_batch: 8\nrun: 'true'\n", 201)["id"].as_i64().unwrap();
        wait_for_state(&c, id, &["failed"]);
        let start = Instant::now();
        while !spans.lock().unwrap().iter().any(|(_, name)| name == "plan_job") {
            assert!(start.elapsed() < Duration::from_secs(30), "no plan_job span exported: {:?}", spans.lock().unwrap());
            std::thread::sleep(Duration::from_millis(50));
        }
    })
    .await
    .unwrap();
    let spans = collector.spans.lock().unwrap();
    assert!(spans.iter().all(|(service, _)| service.contains("motley-coordinator")), "{spans:?}");
    for name in ["declare_node", "submit"] {
        assert!(spans.iter().any(|(_, n)| n == name), "no {name} span: {spans:?}");
    }
}
