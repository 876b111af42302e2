//! The asking end against fake servers: the rate clock counts from the request, and a probe
//! cut at its limit measures what arrived.

use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpListener;
use tokio::time::Instant;

use super::*;

/// A fake data plane for one probe: it reads the request line, waits `before_reply`, answers
/// ok for the bytes asked, then sends `chunks` (each after its wait) and holds the connection
/// open for a while.
async fn fake(before_reply: Duration, chunks: Vec<(Duration, usize)>) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    tokio::spawn(async move {
        let (tcp, _) = listener.accept().await.unwrap();
        let mut reader = BufReader::new(tcp);
        let mut request = String::new();
        reader.read_line(&mut request).await.unwrap();
        let asked: serde_json::Value = serde_json::from_str(&request).unwrap();
        let bytes = asked["probe"]["bytes"].as_u64().unwrap();
        tokio::time::sleep(before_reply).await;
        let mut tcp = reader.into_inner();
        tcp.write_all(format!("{{\"ok\":true,\"bytes\":{bytes}}}\n").as_bytes()).await.unwrap();
        for (wait, n) in chunks {
            tokio::time::sleep(wait).await;
            tcp.write_all(&vec![0u8; n]).await.unwrap();
        }
        tokio::time::sleep(Duration::from_secs(30)).await;
    });
    addr
}

fn probe(addr: &str) -> Probe<'_> {
    Probe { addr, token: None, tls: None, timeout: Duration::from_secs(5) }
}

#[tokio::test]
async fn a_probes_rate_counts_from_the_request_so_a_late_burst_is_not_an_absurd_rate() {
    // The peer answers 300 ms late, then all of 1 MiB at once (on loopback: gigabytes a second
    // from the first byte): 1 MiB in 300 ms and more, not the burst's rate.
    let addr = fake(Duration::from_millis(300), vec![(Duration::ZERO, 1 << 20)]).await;
    let m = probe(&addr).run(1 << 20).await.unwrap();
    assert_eq!(m.bytes, 1 << 20);
    let rate = m.rate_bytes_s.unwrap();
    assert!(rate <= (1 << 20) as f64 / 0.3 && rate > (1 << 20) as f64 / 5.0, "{rate}");
    assert!(m.latency >= Duration::from_millis(300));
}

#[tokio::test]
async fn a_probe_cut_at_its_limit_measures_what_arrived() {
    // 256 KiB at once, then a trickle far too slow for the 8 MiB asked.
    let trickle = (0..100).map(|_| (Duration::from_millis(100), 1024));
    let addr = fake(Duration::ZERO, [(Duration::ZERO, 256 << 10)].into_iter().chain(trickle).collect()).await;
    let start = Instant::now();
    let m = probe(&addr).run_within(MAX_PROBE_BYTES, Duration::from_millis(400)).await.unwrap();
    let took = start.elapsed();
    assert!(took >= Duration::from_millis(400) && took < Duration::from_millis(1500), "{took:?}");
    assert!(m.bytes >= 256 << 10 && m.bytes < MAX_PROBE_BYTES, "{}", m.bytes);
    // The bytes over the time from the request to the last of them: under 400 ms.
    let rate = m.rate_bytes_s.unwrap();
    assert!(rate >= m.bytes as f64 / 0.45, "{rate} for {} bytes", m.bytes);
}

#[tokio::test]
async fn a_probe_with_no_payload_by_its_limit_fails_having_moved_nothing() {
    let addr = fake(Duration::from_secs(2), vec![(Duration::ZERO, 1 << 20)]).await;
    let start = Instant::now();
    let failed = probe(&addr).run_within(1 << 20, Duration::from_millis(200)).await.unwrap_err();
    assert!(start.elapsed() < Duration::from_secs(1), "{:?}", start.elapsed());
    assert_eq!(failed.moved, 0);
    assert!(failed.to_string().contains("time limit"), "{failed}");
}
