//! The probe loop on tokio's paused clock with fake probes: sizes, the duty bound over many
//! probes, round-robin, failures, and peers that come and go with launches.

use std::collections::BTreeSet;
use std::sync::Mutex;

use motley_proto::v1::PeerDataPlane;

use super::*;
use crate::error::AgentError;
use crate::net::MAX_PENDING_LINKS;

const MIB: u64 = 1 << 20;

#[test]
fn probes_are_sized_to_the_target_at_the_last_rate_within_bounds() {
    let p = Pacing::default();
    assert_eq!(p.size(None), MIN_PROBE_BYTES);
    assert_eq!(p.size(Some(2e6)), 100_000, "50 ms at 2 MB/s");
    assert_eq!(p.size(Some(1e3)), MIN_PROBE_BYTES);
    assert_eq!(p.size(Some(25e9)), 8 * MIB);
    assert_eq!(p.size(Some(f64::NAN)), MIN_PROBE_BYTES);
    assert_eq!(p.gap(Duration::from_millis(50)), Duration::from_millis(4950));
    assert_eq!(Pacing { duty: 0.5, ..p }.gap(Duration::from_millis(50)), Duration::from_millis(50));
    assert_eq!(p.charge(Duration::from_secs(2), 0), p.target, "a probe that moved nothing counts at most the target");
    assert_eq!(p.charge(Duration::from_secs(2), 1), Duration::from_secs(2));
    assert!(!Pacing { duty: 0.0, ..p }.enabled() && !Pacing { duty: f64::NAN, ..p }.enabled());
}

fn peer(node: &str) -> PeerDataPlane {
    PeerDataPlane { node: node.into(), data_url: format!("{node}.example:7073") }
}

/// One fake probe as the loop made it.
#[derive(Clone, Debug)]
struct Made {
    node: String,
    bytes: u64,
    start: Instant,
    end: Instant,
    ok: bool,
}

/// A fake data plane: each peer's link at its rate (bytes/s) with a 1 ms round trip; a peer of
/// rate 0 never answers (the probe fails after `PROBE_TIMEOUT` with nothing moved).
fn fake(
    rates: &'static [(&'static str, f64)],
    log: Arc<Mutex<Vec<Made>>>,
) -> impl FnMut(&PeerPlane, u64) -> futures_util::future::BoxFuture<'static, Result<Probed, ProbeFailed>> {
    move |peer: &PeerPlane, bytes: u64| {
        let (node, log) = (peer.node.clone(), log.clone());
        let rate = rates.iter().find(|(n, _)| *n == node).map_or(0.0, |r| r.1);
        Box::pin(async move {
            let start = Instant::now();
            let latency = Duration::from_millis(1);
            if rate == 0.0 {
                tokio::time::sleep(PROBE_TIMEOUT).await;
                log.lock().unwrap().push(Made { node: node.clone(), bytes, start, end: Instant::now(), ok: false });
                return Err(ProbeFailed { error: AgentError::Probe { peer: node, message: "no answer".into() }, moved: 0 });
            }
            tokio::time::sleep(latency + Duration::from_secs_f64(bytes as f64 / rate)).await;
            log.lock().unwrap().push(Made { node, bytes, start, end: Instant::now(), ok: true });
            let measured = Measured { bytes, latency, rate_bytes_s: Some(rate), local: None };
            Ok(Probed { measured, nic_kind: "eth" })
        })
    }
}

/// Runs the loop for `secs` of paused time.
async fn run_for(
    meter: &Meter,
    pacing: Pacing,
    secs: u64,
    running: impl Fn() -> BTreeSet<(i64, i64)>,
    probe: impl FnMut(&PeerPlane, u64) -> futures_util::future::BoxFuture<'static, Result<Probed, ProbeFailed>>,
) {
    let ran = tokio::time::timeout(Duration::from_secs(secs), probe_loop(meter, pacing, running, probe)).await;
    assert!(ran.is_err(), "the loop runs until stopped");
}

fn all() -> impl Fn() -> BTreeSet<(i64, i64)> {
    || BTreeSet::from([(1, 1), (2, 1)])
}

#[tokio::test(start_paused = true)]
async fn over_many_probes_the_wire_is_held_at_most_the_duty() {
    static RATES: &[(&str, f64)] = &[("a", 1e9), ("b", 1e8), ("c", 1e6), ("dead", 0.0)];
    let meter = Meter::new("self", Path::new("/nonexistent"));
    meter.launched(1, 1, &[peer("a"), peer("b"), peer("self")]);
    meter.launched(2, 1, &[peer("c"), peer("dead")]);
    let log = Arc::new(Mutex::new(vec![]));
    let pacing = Pacing::default();
    let began = Instant::now();
    run_for(&meter, pacing, 3000, all(), fake(RATES, log.clone())).await;
    let made = log.lock().unwrap().clone();
    assert!(made.len() > 100, "{} probes in 3000 s", made.len());
    // Round-robin by node name, this node never.
    let order: Vec<&str> = made.iter().take(8).map(|m| m.node.as_str()).collect();
    assert_eq!(order, ["a", "b", "c", "dead", "a", "b", "c", "dead"]);
    // Sized to 50 ms at each link's last rate, within bounds, after a first small probe.
    for (node, want) in [("a", 8 * MIB), ("b", 5_000_000), ("c", MIN_PROBE_BYTES)] {
        let sizes: Vec<u64> = made.iter().filter(|m| m.node == node).map(|m| m.bytes).collect();
        assert_eq!(sizes[0], MIN_PROBE_BYTES, "{node}");
        assert!(sizes[1..].iter().all(|&s| s == want), "{node}: {sizes:?}");
    }
    // The bound: the time probes held the wire, over any prefix of the run, is at most duty
    // of it plus the probe under way.
    let mut busy = Duration::ZERO;
    for m in made.iter().filter(|m| m.ok) {
        busy += m.end - m.start;
        let elapsed = m.end - began;
        assert!(
            busy.as_secs_f64() <= pacing.duty * elapsed.as_secs_f64() + (m.end - m.start).as_secs_f64() + 1e-6,
            "{busy:?} in {elapsed:?}"
        );
    }
    let total = made.last().unwrap().end - began;
    let share = busy.as_secs_f64() / total.as_secs_f64();
    assert!(share <= pacing.duty && share > pacing.duty / 3.0, "probes held {share} of the time");
    // Each next probe waits d * (1/duty - 1) after one that took d; a dead peer's (nothing
    // moved) counts as the target, not its 2 s timeout.
    for w in made.windows(2) {
        let d = w[0].end - w[0].start;
        let charged = if w[0].ok { d } else { d.min(pacing.target) };
        let gap = w[1].start - w[0].end;
        assert!(gap >= pacing.gap(charged) && gap <= pacing.gap(charged) + Duration::from_millis(5), "{gap:?} after {:?}", w[0]);
    }
    // Every sample kept for the heartbeat: successes only, never a fake 0 for the dead peer.
    let samples = meter.take_links();
    assert_eq!(samples.len(), made.iter().filter(|m| m.ok).count().min(MAX_PENDING_LINKS));
    assert!(samples.iter().all(|s| s.peer != "dead" && s.gb_per_s > 0.0 && (s.latency_ms - 1.0).abs() < 0.01 && s.nic_kind == "eth"));
    assert!(meter.take_links().is_empty(), "each sample is taken once");
}

#[tokio::test(start_paused = true)]
async fn peers_are_probed_only_while_a_running_launch_names_them() {
    static RATES: &[(&str, f64)] = &[("a", 1e8), ("b", 1e8)];
    let meter = Arc::new(Meter::new("self", Path::new("/nonexistent")));
    meter.launched(1, 1, &[peer("a")]);
    meter.launched(2, 1, &[peer("b"), PeerDataPlane { node: "nourl".into(), data_url: String::new() }]);
    let running = Arc::new(Mutex::new(BTreeSet::from([(1, 1), (2, 1)])));
    let log = Arc::new(Mutex::new(vec![]));
    let (r, m) = (running.clone(), meter.clone());
    let stop_b = async move {
        tokio::time::sleep(Duration::from_secs(100)).await;
        // Launch 2's ranks end: its peer goes with it.
        r.lock().unwrap().remove(&(2, 1));
        tokio::time::sleep(Duration::from_secs(100)).await;
        // Launch 1 is stopped.
        m.stopped(1, 1);
        std::future::pending::<()>().await
    };
    let r = running.clone();
    tokio::select! {
        _ = stop_b => {}
        _ = run_for(&meter, Pacing::default(), 300, move || r.lock().unwrap().clone(), fake(RATES, log.clone())) => {}
    }
    let made = log.lock().unwrap().clone();
    let t0 = made[0].start;
    let at = |m: &Made| (m.start - t0).as_secs_f64();
    assert!(made.iter().any(|m| m.node == "b" && at(m) < 100.0));
    // At most the probe already waiting when the launch ended.
    assert!(made.iter().filter(|m| m.node == "b" && at(m) > 100.0).count() <= 1, "{made:?}");
    assert!(made.iter().all(|m| m.node != "b" || at(m) < 106.0));
    assert!(made.iter().all(|m| m.node != "nourl"));
    assert!(made.iter().any(|m| m.node == "a" && at(m) > 150.0));
    assert!(made.iter().all(|m| m.node != "a" || at(m) < 206.0), "{made:?}");
    assert!(meter.peers().is_empty());
}

#[tokio::test(start_paused = true)]
async fn probing_off_probes_nothing() {
    static RATES: &[(&str, f64)] = &[("a", 1e8)];
    let meter = Meter::new("self", Path::new("/nonexistent"));
    meter.launched(1, 1, &[peer("a")]);
    let log = Arc::new(Mutex::new(vec![]));
    run_for(&meter, Pacing { duty: 0.0, ..Pacing::default() }, 100, all(), fake(RATES, log.clone())).await;
    assert!(log.lock().unwrap().is_empty());
}

#[test]
fn pending_samples_are_bounded_and_the_newest_kept() {
    let meter = Meter::new("self", Path::new("/nonexistent"));
    for i in 0..MAX_PENDING_LINKS as i64 + 10 {
        meter.push_link(LinkSample { peer: "a".into(), at_unix_ms: i, ..Default::default() });
    }
    let got = meter.take_links();
    assert_eq!(got.len(), MAX_PENDING_LINKS);
    assert_eq!(got[0].at_unix_ms, 10);
    assert!(meter.take_links().is_empty());
}

#[test]
fn a_launchs_peers_leave_out_this_node_and_name_each_node_once() {
    let meter = Meter::new("self", Path::new("/nonexistent"));
    meter.launched(1, 1, &[peer("b"), peer("self"), peer("a"), peer("b")]);
    meter.launched(2, 1, &[PeerDataPlane { node: "a".into(), data_url: "tls://a.example:7073".into() }]);
    let nodes: Vec<(String, String)> = meter.peers().into_iter().map(|p| (p.node, p.data_url)).collect();
    assert_eq!(nodes, [("a".into(), "tls://a.example:7073".into()), ("b".into(), "b.example:7073".into())]);
    meter.retain_running(&BTreeSet::from([(1, 1)]));
    assert_eq!(meter.peers().iter().map(|p| p.data_url.as_str()).collect::<Vec<_>>(), ["a.example:7073", "b.example:7073"]);
}
