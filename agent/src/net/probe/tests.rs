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
    assert_eq!(p.limit(), Duration::from_millis(200), "4 x the target");
    assert_eq!(p.charge(Duration::from_secs(2), false, 0), p.target, "a failure that moved nothing counts the target");
    assert_eq!(p.charge(Duration::from_millis(1), false, 0), p.target, "an instant refusal counts the whole target");
    assert_eq!(p.charge(Duration::from_secs(2), false, 1), p.limit());
    assert_eq!(p.charge(Duration::from_millis(10), false, 1), p.target);
    assert_eq!(p.charge(Duration::from_millis(60), true, 1), Duration::from_millis(60));
    assert_eq!(p.charge(Duration::from_secs(5), true, 1), p.limit(), "a success reads for at most the limit");
    assert!(!Pacing { duty: 0.0, ..p }.enabled() && !Pacing { duty: f64::NAN, ..p }.enabled());
}

#[test]
fn the_duty_is_0_or_within_its_range_and_no_duty_overflows_the_gap() {
    for ok in [0.0, MIN_DUTY, 0.01, MAX_DUTY] {
        assert!(check_duty(ok).is_ok(), "{ok}");
    }
    for bad in [-0.01, 1e-300, 0.00009, 0.51, 1.0, f64::NAN, f64::INFINITY] {
        let e = check_duty(bad).unwrap_err();
        assert!(e.contains("--probe-duty") && e.contains("0.0001") && e.contains("0.5"), "{e}");
    }
    // A duty beyond the range (a `Pacing` built by hand) is taken as the nearest bound.
    let tiny = Pacing { duty: 1e-300, target: Duration::from_secs(10_000) };
    assert_eq!(tiny.gap(Duration::from_secs(1)), Duration::from_secs(9999));
    assert_eq!(Pacing { duty: 1.0, ..tiny }.gap(Duration::from_secs(1)), Duration::from_secs(1));
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

type Fake = futures_util::future::BoxFuture<'static, Result<Probed, ProbeFailed>>;

/// A fake data plane: each peer's link at its rate (bytes/s) with a 1 ms round trip; a peer of
/// rate 0 never answers (the probe fails after `PROBE_TIMEOUT` with nothing moved).
fn fake(rates: &'static [(&'static str, f64)], log: Arc<Mutex<Vec<Made>>>) -> impl FnMut(&PeerPlane, u64, Duration) -> Fake {
    move |peer: &PeerPlane, bytes: u64, _limit: Duration| {
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
    probe: impl FnMut(&PeerPlane, u64, Duration) -> Fake,
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
        let charged = if w[0].ok { d } else { pacing.target };
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
async fn a_link_that_drops_100_fold_costs_one_probe_cut_at_the_limit_then_probes_resize() {
    // Peer "a" at 200 MB/s, 2 MB/s from 100 s on (an 8 MiB probe then takes 4 s); the fake reads for at most the limit it is
    // given and measures what arrived, as `Probe::run_within` does.
    let meter = Meter::new("self", Path::new("/nonexistent"));
    meter.launched(1, 1, &[peer("a")]);
    let log = Arc::new(Mutex::new(vec![]));
    let (began, l) = (Instant::now(), log.clone());
    let probe = move |peer: &PeerPlane, bytes: u64, limit: Duration| -> Fake {
        let (node, log) = (peer.node.clone(), l.clone());
        Box::pin(async move {
            let start = Instant::now();
            let rate = if start - began < Duration::from_secs(100) { 2e8 } else { 2e6 };
            let latency = Duration::from_millis(1);
            let full = latency + Duration::from_secs_f64(bytes as f64 / rate);
            let took = full.min(limit);
            tokio::time::sleep(took).await;
            let got = if took < full { ((took - latency).as_secs_f64() * rate) as u64 } else { bytes };
            log.lock().unwrap().push(Made { node, bytes, start, end: Instant::now(), ok: true });
            let measured = Measured { bytes: got, latency, rate_bytes_s: Some(got as f64 / took.as_secs_f64()), local: None };
            Ok(Probed { measured, nic_kind: "eth" })
        })
    };
    let pacing = Pacing::default();
    run_for(&meter, pacing, 200, all(), probe).await;
    let made = log.lock().unwrap().clone();
    let after = made.iter().position(|m| m.start - began >= Duration::from_secs(100)).unwrap();
    let (cut, next) = (&made[after], &made[after + 1]);
    assert_eq!(cut.bytes, 8 * MIB, "sized for the old rate");
    assert!(cut.end - cut.start <= pacing.limit(), "cut at the limit, not 5 s: {cut:?}");
    assert!(next.start - cut.end <= pacing.gap(pacing.limit()) + Duration::from_millis(5), "{next:?} after {cut:?}");
    let resized = next.bytes as f64;
    assert!((resized - 2e6 * 0.05).abs() < 2e6 * 0.05 * 0.05, "sized to the new rate: {next:?}");
    assert!(made[after + 1..].iter().all(|m| m.end - m.start < Duration::from_millis(60)), "{made:?}");
}

#[tokio::test(start_paused = true)]
async fn a_refusing_peer_is_asked_ever_less_often_and_not_in_a_spin() {
    // Peer "no" refuses at once; "a" answers. Duty 0.5: a refusal charged what it took would
    // leave about no gap at all.
    let meter = Meter::new("self", Path::new("/nonexistent"));
    meter.launched(1, 1, &[peer("a"), peer("no")]);
    let log = Arc::new(Mutex::new(vec![]));
    let l = log.clone();
    let refused_until = Instant::now() + Duration::from_secs(400);
    let probe = move |peer: &PeerPlane, bytes: u64, _limit: Duration| -> Fake {
        let (node, log) = (peer.node.clone(), l.clone());
        Box::pin(async move {
            let start = Instant::now();
            tokio::time::sleep(Duration::from_millis(1)).await;
            let ok = node == "a" || start >= refused_until;
            log.lock().unwrap().push(Made { node: node.clone(), bytes, start, end: Instant::now(), ok });
            if !ok {
                return Err(ProbeFailed { error: AgentError::Probe { peer: node, message: "refused".into() }, moved: 0 });
            }
            let measured = Measured { bytes, latency: Duration::from_millis(1), rate_bytes_s: Some(1e9), local: None };
            Ok(Probed { measured, nic_kind: "eth" })
        })
    };
    let pacing = Pacing { duty: 0.5, ..Pacing::default() };
    run_for(&meter, pacing, 600, all(), probe).await;
    let made = log.lock().unwrap().clone();
    // After every refusal the next probe, to any peer, waits at least target / duty - target.
    for w in made.windows(2).filter(|w| !w[0].ok) {
        assert!(w[1].start - w[0].end >= pacing.target, "{w:?}");
    }
    // The refusing peer: skipped for 1, 2, 4, ... up to 60 s after each refusal.
    let no: Vec<&Made> = made.iter().filter(|m| m.node == "no").collect();
    let refusals = no.iter().take_while(|m| !m.ok).count();
    assert!((8..=20).contains(&refusals), "{refusals} refusals in 400 s");
    for (i, w) in no.windows(2).take(refusals - 1).enumerate() {
        let backoff = (BACKOFF_FIRST * (1 << i.min(6))).min(BACKOFF_MAX);
        assert!(w[1].start - w[0].end >= backoff, "refusal {i}: {:?} after {:?}", w[1].start - w[0].end, backoff);
    }
    // Once it answers, it is probed as often as the other again.
    let late = |node: &str| made.iter().filter(|m| m.node == node && m.start >= refused_until + BACKOFF_MAX).count();
    assert!(late("no") > 100 && late("no").abs_diff(late("a")) <= 1, "{} / {}", late("no"), late("a"));
    // The answering peer is not held back by the other's refusals: it is probed every ~0.1 s.
    assert!(made.iter().filter(|m| m.node == "a").count() > 2000);
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
