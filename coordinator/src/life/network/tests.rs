//! The pure parts of the re-plan decision: a change over a link's samples, gain against cost,
//! the cooldown over past events.

use super::*;

fn samples(points: &[(i64, f64)]) -> Vec<Sample> {
    points.iter().map(|&(at, gb)| Sample { at_unix_ms: at, gb_per_s: gb, latency_ms: 0.1 }).collect()
}

fn considered(seq: i64, at_ms: i64, decision: &str, at_step: i64) -> Event {
    Event {
        seq,
        job_id: Some(1),
        generation: Some(1),
        kind: "replan_considered".into(),
        message: json!({"gain_s": 1.0, "cost_s": 0.5, "decision": decision, "at_step": at_step}).to_string(),
        at_ms,
    }
}

#[test]
fn a_ten_fold_drop_held_past_hold_is_a_change_from_when_it_began() {
    // 10 GB/s assumed; one sample a second; from 5 s on the link gives 1 GB/s.
    let mut h: Vec<(i64, f64)> = (0..5).map(|i| (i * 1000, 10.0)).collect();
    h.extend((5..12).map(|i| (i * 1000, 1.0)));
    let h = samples(&h);
    assert_eq!(changed_since(&h, 10.0, 1.0, 0.3, 5_000), Some(5_000), "held 6 s, hold 5 s");
    assert_eq!(changed_since(&h, 10.0, 1.0, 0.3, 6_000), Some(5_000), "held exactly the hold");
    assert_eq!(changed_since(&h, 10.0, 1.0, 0.3, 7_000), None, "not held long enough yet");
    // A rise is a change too (the plan assumed less than there is).
    let up = samples(&[(0, 20.0), (2000, 20.0)]);
    assert_eq!(changed_since(&up, 10.0, 20.0, 0.3, 1000), Some(0));
}

#[test]
fn a_brief_drop_shorter_than_hold_or_within_the_threshold_is_nothing() {
    // Down for 2 s, back, and down again 1 s ago: each run is shorter than the 3 s hold.
    let h = samples(&[(0, 10.0), (1000, 1.0), (2000, 1.0), (3000, 1.0), (4000, 10.0), (5000, 1.0), (6000, 1.0)]);
    assert_eq!(changed_since(&h, 10.0, 1.0, 0.3, 3000), None);
    // The estimate (best of the newest samples) is still near what was assumed: no change
    // whatever the single samples say (a probe that met training's traffic).
    assert_eq!(changed_since(&h, 10.0, 9.0, 0.3, 0), None);
    // 25% down with a 30% threshold: nothing, however long.
    let h = samples(&[(0, 7.5), (60_000, 7.5)]);
    assert_eq!(changed_since(&h, 10.0, 7.5, 0.3, 1000), None);
    assert_eq!(changed_since(&[], 10.0, 1.0, 0.3, 0), None, "no samples, no change");
}

#[test]
fn a_drop_that_pays_switches_and_one_that_does_not_keeps() {
    // 0.5 s saved per iteration over 10,000 iterations (5,000 s) against 100 s of switch.
    let w = weigh(0.5, 10_000.0, 40.0, 60.0, None);
    assert!(w.switch && (w.gain_s, w.cost_s) == (5000.0, 100.0), "{w:?}");
    // The same saving with 100 iterations left (50 s) does not pay for 100 s.
    let w = weigh(0.5, 100.0, 40.0, 60.0, None);
    assert!(!w.switch && w.reason.contains("does not pay"), "{w:?}");
    // Not faster: keep, gain 0.
    let w = weigh(-0.1, 10_000.0, 0.0, 60.0, None);
    assert!(!w.switch && w.gain_s == 0.0 && w.reason.contains("still the fastest"), "{w:?}");
    // Pays, but within the cooldown.
    let w = weigh(0.5, 10_000.0, 40.0, 60.0, Some(Duration::from_secs(300)));
    assert!(!w.switch && w.reason.contains("cooldown (300s left)"), "{w:?}");
}

#[test]
fn the_work_left_is_the_steps_left_else_the_horizons_worth() {
    assert_eq!(remaining_iterations(Some(1000), 400, Duration::from_secs(3600), 2.0), 600.0);
    assert_eq!(remaining_iterations(Some(1000), 1200, Duration::from_secs(3600), 2.0), 0.0);
    assert_eq!(remaining_iterations(None, 400, Duration::from_secs(3600), 2.0), 1800.0);
    assert_eq!(remaining_iterations(None, 400, Duration::from_secs(3600), 0.0), 0.0);
}

#[test]
fn a_flapping_link_switches_at_most_once_per_cooldown() {
    // The link flaps every 2 minutes for an hour; every flap is a change that would pay.
    let cooldown = Duration::from_secs(600);
    let mut events: Vec<Event> = vec![];
    let mut switches = vec![];
    for i in 0..30 {
        let now = i * 120_000;
        let w = weigh(0.5, 10_000.0, 40.0, 60.0, cooling(&events, now, cooldown));
        let decision = if w.switch { "switch" } else { "keep" };
        events.push(considered(i, now, decision, i));
        if w.switch {
            switches.push(now);
        }
    }
    assert_eq!(switches, [0, 600_000, 1_200_000, 1_800_000, 2_400_000, 3_000_000]);
    for pair in switches.windows(2) {
        assert!(pair[1] - pair[0] >= cooldown.as_millis() as i64);
    }
    // Keeps do not restart the cooldown; only switches count.
    assert_eq!(cooling(&[considered(1, 0, "keep", 0)], 1, cooldown), None);
}

#[test]
fn a_pending_switch_and_the_last_recovery_come_from_the_events() {
    let ev = |seq, kind: &str, at_ms| Event { seq, job_id: Some(1), generation: Some(1), kind: kind.into(), message: String::new(), at_ms };
    let events = vec![ev(1, "running", 0), ev(2, "recovering", 10_000), ev(3, "launching", 20_000), ev(4, "running", 25_000)];
    assert_eq!(last_recovery_s(&events), Some(15.0));
    assert_eq!(last_recovery_s(&events[..3]), None, "a recovery not over yet says nothing");
    assert_eq!(pending_switch(&[considered(5, 0, "switch", 200)], 1), Some(200));
    assert_eq!(pending_switch(&[considered(5, 0, "switch", 200)], 2), None, "another launch's");
    assert_eq!(pending_switch(&[considered(5, 0, "switch", 200), considered(6, 1, "keep", 300)], 1), None);
}

#[test]
fn a_change_message_carries_the_contract_fields() {
    let m = change_message(&LinkKey::new("n1", "n0", "eth"), 10.0, 1.0);
    assert_eq!(m, json!({"link": {"a": "n0", "b": "n1", "nic_kind": "eth"}, "was": 10.0, "now": 1.0}));
}

#[test]
fn a_shape_counts_runs_of_equal_replicas() {
    let plan: PlanDocument = serde_json::from_value(json!({"global_batch": 8, "micro_batch": 1, "replicas": [
        {"micro_batches": 2, "stages": [{"layers": [0, 12], "gpu": "A100", "tp": 1, "dp": 2, "gpus": []},
                                        {"layers": [12, 24], "gpu": "A100", "tp": 1, "dp": 2, "gpus": []}]},
        {"micro_batches": 2, "stages": [{"layers": [0, 12], "gpu": "A100", "tp": 1, "dp": 2, "gpus": []},
                                        {"layers": [12, 24], "gpu": "A100", "tp": 1, "dp": 2, "gpus": []}]},
        {"micro_batches": 4, "stages": [{"layers": [0, 24], "gpu": "V100", "tp": 2, "dp": 1, "gpus": []}]}]}))
    .unwrap();
    assert_eq!(shape(&plan), "2 x [A100 tp1 dp2 L0-12 | A100 tp1 dp2 L12-24] + [V100 tp2 dp1 L0-24]");
}

#[test]
fn a_link_that_moved_on_from_what_was_reported_is_a_change_again() {
    // Assumed 10; up to 14 (reported as a change), then down to 1 and held: against the plan it
    // deviates all along, but against the reported 14 the drop is a change of its own.
    let mut h: Vec<(i64, f64)> = (0..5).map(|i| (i * 1000, 14.0)).collect();
    h.extend((5..12).map(|i| (i * 1000, 1.0)));
    let h = samples(&h);
    // Up, then down: two runs on either side of the plan, not one.
    assert_eq!(changed_since(&h, 10.0, 1.0, 0.3, 5_000), Some(5_000), "below the plan since the drop");
    assert_eq!(changed_since(&h, 14.0, 1.0, 0.3, 5_000), Some(5_000), "and below what was reported since the drop");
    // Still near what was reported: not again.
    let near = samples(&[(0, 14.0), (5000, 13.0), (9000, 14.5)]);
    assert_eq!(changed_since(&near, 14.0, 14.5, 0.3, 5_000), None);
}

#[test]
fn a_fast_links_deviation_is_held_by_when_it_was_first_seen_when_its_samples_span_less_than_the_hold() {
    // A fast link: 64 samples a few ms apart, all of them ten-fold down. By the samples alone
    // the deviation began at the oldest kept (60 ms ago); this leader saw it 70 s ago.
    let h = samples(&(0..64).map(|i| (100_000 + i, 1.0)).collect::<Vec<_>>());
    let dev = deviating_since(&h, 10.0, 1.0, 0.3);
    assert_eq!(dev, Some((100_000, true)));
    assert_eq!(changed_since(&h, 10.0, 1.0, 0.3, 60_000), None, "the samples alone never hold 60 s");
    let pair = ("a".to_string(), "b".to_string());
    let mut seen = HashMap::new();
    assert!(!held(&mut seen, &pair, Some((30_000, true)), 30_000, 60_000), "first seen at 30 s");
    assert!(held(&mut seen, &pair, dev, 100_063, 60_000), "70 s after it was first seen");
    // The link came back: forgotten, and a new deviation starts afresh.
    assert!(!held(&mut seen, &pair, None, 100_100, 60_000));
    assert!(!held(&mut seen, &pair, dev, 100_063, 60_000));
    // Readings on both sides of the plan are not one deviation.
    let mixed = samples(&[(0, 5.0), (1000, 15.0), (2000, 5.0)]);
    assert_eq!(deviating_since(&mixed, 10.0, 5.0, 0.3), Some((2000, false)));
}
