//! A batch of rank reports as the store commits it, run against SQLite (a temporary file) and
//! against the PostgreSQL on 127.0.0.1:5432 (a fresh database per test, dropped after), as
//! `store_conformance.rs` runs the rest of the store: a launch whose ranks all started moves
//! `running` in the same commit, its event before the ranks' later exits; a launch that lost a
//! replica moves `degraded` and its newest membership is read back (docs/keep-going.md); a
//! degraded job is unfinished, holds its GPUs and keeps its nodes.

use crate::common;

use std::future::Future;

use motley_coordinator::{CoordinatorError, JobState, RankAssignment, Store};

fn run<F: Future>(f: F) -> F::Output {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap().block_on(f)
}

/// One test, twice: `name::sqlite` (a temporary file) and `name::postgres` (a fresh database,
/// `common::TestDb`, dropped after).
macro_rules! conformance {
    ($name:ident, $body:expr) => {
        mod $name {
            use super::*;
            #[test]
            fn sqlite() {
                let dir = common::temp_dir();
                run($body(format!("sqlite://{}", dir.join("state.db").display())));
                let _ = std::fs::remove_dir_all(&dir);
            }
            #[test]
            fn postgres() {
                let db = common::TestDb::create("motley_test");
                run($body(db.url.clone()));
            }
        }
    };
}

fn ranks(nodes: &[&str]) -> Vec<RankAssignment> {
    nodes
        .iter()
        .enumerate()
        .map(|(i, n)| RankAssignment {
            rank: i as i64,
            node: n.to_string(),
            local_rank: 0,
            gpu: 0,
            replica: 0,
            stage: i as i64,
            layer_start: 4 * i as i64,
            layer_end: 4 * (i as i64 + 1),
        })
        .collect()
}

conformance!(a_launch_is_running_before_the_exits_reported_with_its_start, |url: String| async move {
    use motley_coordinator::store::RankReport;
    let s = Store::open(&url).await.unwrap();
    s.register_node("n0", "{}").await.unwrap();
    let report =
        |job: i64, rank: i64, state: &str, exit_code: Option<i64>| RankReport { job, generation: 1, rank, state: state.into(), exit_code };
    let launched = |name: &'static str, s: Store| async move {
        let job = s.submit_job(name, "{}").await.unwrap();
        s.transition(job.id, JobState::Planning, None).await.unwrap();
        s.start_generation(job.id, "{}", &ranks(&["n0", "n0"])).await.unwrap();
        job.id
    };
    let kinds = |s: Store, id: i64| async move {
        s.events(Some(id), 0, 100).await.unwrap().into_iter().map(|e| format!("{} {}", e.kind, e.message)).collect::<Vec<_>>()
    };
    // Both ranks started and ended between two heartbeats: one report says it all, and the
    // events tell it in the order it happened.
    let id = launched("quick", s.clone()).await;
    let all = vec![
        report(id, 0, "running", None),
        report(id, 1, "running", None),
        report(id, 0, "exited", Some(0)),
        report(id, 1, "exited", Some(0)),
    ];
    s.report_ranks_from(Some(("n0", 1)), all).await.unwrap();
    assert_eq!(s.job(id).await.unwrap().state, JobState::Running);
    assert_eq!(
        kinds(s.clone(), id).await[3..],
        [
            format!("rank job {id}: rank 0 running"),
            format!("rank job {id}: rank 1 running"),
            format!("running job {id}: launching -> running"),
            format!("rank job {id}: rank 0 exited (exit code 0)"),
            format!("rank job {id}: rank 1 exited (exit code 0)"),
        ]
    );
    // The leader's look finds it running already: no second move, no second event.
    assert!(s.transition(id, JobState::Running, None).await.is_err());
    s.transition(id, JobState::Succeeded, None).await.unwrap();

    // A start completed by a later report moves there; a rank that exited counts as started.
    let id = launched("later", s.clone()).await;
    s.report_ranks_from(Some(("n0", 1)), vec![report(id, 0, "running", None), report(id, 0, "exited", Some(0))]).await.unwrap();
    assert_eq!(s.job(id).await.unwrap().state, JobState::Launching, "rank 1 has not started");
    s.report_ranks_from(Some(("n0", 1)), vec![report(id, 1, "running", None), report(id, 1, "exited", Some(0))]).await.unwrap();
    let events = kinds(s.clone(), id).await;
    let moved = events.iter().position(|e| e.starts_with("running ")).expect("moved running");
    assert_eq!(events[moved - 1], format!("rank job {id}: rank 1 running"));
    assert_eq!(events[moved + 1], format!("rank job {id}: rank 1 exited (exit code 0)"));
    // Its GPU is its own until the leader ends it (a launch holds its GPUs, store::ranks).
    s.transition(id, JobState::Succeeded, None).await.unwrap();

    // A failed rank is the leader's to decide on (restart or fail): no move.
    let id = launched("failing", s.clone()).await;
    s.report_ranks_from(Some(("n0", 1)), vec![report(id, 0, "exited", Some(1)), report(id, 1, "running", None)]).await.unwrap();
    assert_eq!(s.job(id).await.unwrap().state, JobState::Launching);
    assert!(!kinds(s.clone(), id).await.iter().any(|e| e.starts_with("running ")));
    s.transition(id, JobState::Failed, Some("rank 0 exited with code 1")).await.unwrap();

    // A coordinator that no longer leads moves nothing; the reports still apply.
    let term = s.claim_leadership("http://old", "http://old").await.unwrap();
    s.fence(term);
    let id = launched("fenced", s.clone()).await;
    let other = Store::open(&url).await.unwrap();
    other.claim_leadership("http://new", "http://new").await.unwrap();
    s.report_ranks_from(Some(("n0", 1)), vec![report(id, 0, "running", None), report(id, 1, "running", None)]).await.unwrap();
    assert_eq!(s.job(id).await.unwrap().state, JobState::Launching);
    assert_eq!(s.rank_summary(id, 1).await.unwrap().started, 2);
    other.close().await;
    s.close().await;
});

conformance!(a_degraded_launch_keeps_its_generation_and_its_newest_membership_reads_back, |url: String| async move {
    let s = Store::open(&url).await.unwrap();
    for n in ["n0", "n1"] {
        s.register_node(n, "{}").await.unwrap();
    }
    let job = s.submit_job("train", "{}").await.unwrap();
    s.transition(job.id, JobState::Planning, None).await.unwrap();
    let g = s.start_generation(job.id, "{}", &ranks(&["n0", "n1"])).await.unwrap();
    assert!(s.last_event(job.id, g, "membership_changed").await.unwrap().is_none());
    s.transition_at(job.id, Some(g), JobState::Running, None).await.unwrap();
    s.record_event(Some(job.id), Some(g), "membership_changed", "{\"epoch\": 1}").await.unwrap();
    s.record_event(Some(job.id), Some(g), "membership_changed", "{\"epoch\": 2}").await.unwrap();
    s.record_event(Some(job.id), Some(g + 1), "membership_changed", "{\"epoch\": 9}").await.unwrap();
    let last = s.last_event(job.id, g, "membership_changed").await.unwrap().unwrap();
    assert_eq!((last.kind.as_str(), last.message.as_str(), last.generation), ("membership_changed", "{\"epoch\": 2}", Some(g)));
    // Every membership of the launch, oldest first (the curves follow each epoch's leader).
    let all = s.launch_events(job.id, g, "membership_changed", 100).await.unwrap();
    assert_eq!(all.iter().map(|e| e.message.as_str()).collect::<Vec<_>>(), ["{\"epoch\": 1}", "{\"epoch\": 2}"]);
    assert_eq!(s.launch_events(job.id, g, "membership_changed", 1).await.unwrap().len(), 1, "at most the limit");
    assert!(s.launch_events(job.id, g, "keep_going", 100).await.unwrap().is_empty());
    let j = s.transition_at(job.id, Some(g), JobState::Degraded, Some("node n1 lost")).await.unwrap();
    assert_eq!((j.state, j.generation, j.reason.as_deref()), (JobState::Degraded, g, Some("node n1 lost")));
    // Its lost replica's ranks assigned again to rejoin (fenced on degraded and the generation);
    // a running rank is left alone.
    s.report_rank(job.id, g, 1, "lost", None).await.unwrap();
    assert!(s.reassign_ranks(job.id, g + 1, &[1], 2, ("membership_changed", "{\"epoch\": 2}")).await.is_err(), "another generation's");
    assert_eq!(s.reassign_ranks(job.id, g, &[0, 1], 2, ("membership_changed", "{\"epoch\": 2}")).await.unwrap(), 1, "the lost one only");
    let states: Vec<String> = s.ranks(job.id, g).await.unwrap().into_iter().map(|r| r.state).collect();
    assert_eq!(states, ["assigned", "assigned"]);
    // Onto another node (its own lease lapsed, its rank there still recorded running): the rank
    // and the launch's plan move together.
    s.report_rank(job.id, g, 1, "running", None).await.unwrap();
    let onto = RankAssignment { rank: 1, node: "n0".into(), local_rank: 1, gpu: 1, replica: 1, stage: 0, layer_start: 0, layer_end: 2 };
    assert!(
        s.move_ranks(job.id, g + 1, std::slice::from_ref(&onto), "{\"moved\": 1}", 2, ("membership_changed", "{\"epoch\": 3}"))
            .await
            .is_err(),
        "another generation's"
    );
    assert_eq!(s.plan(job.id, g).await.unwrap(), "{}", "nothing moved");
    assert_eq!(
        s.move_ranks(job.id, g, std::slice::from_ref(&onto), "{\"moved\": 1}", 2, ("membership_changed", "{\"epoch\": 3}")).await.unwrap(),
        1
    );
    let r1 = s.ranks(job.id, g).await.unwrap().remove(1);
    assert_eq!((r1.assignment.node.as_str(), r1.assignment.gpu, r1.assignment.local_rank, r1.state.as_str()), ("n0", 1, 1, "assigned"));
    assert_eq!(s.plan(job.id, g).await.unwrap(), "{\"moved\": 1}");
    let last = s.last_event(job.id, g, "membership_changed").await.unwrap().unwrap();
    assert_eq!(last.message, "{\"epoch\": 3}", "the epoch with the move");
    // All or nothing: a rank that is not there fails the move, and nothing of it lands.
    let ghost = RankAssignment { rank: 9, node: "n0".into(), local_rank: 2, gpu: 2, replica: 1, stage: 0, layer_start: 0, layer_end: 2 };
    assert!(s.move_ranks(job.id, g, &[ghost], "{\"moved\": 2}", 3, ("membership_changed", "{\"epoch\": 4}")).await.is_err());
    assert_eq!(s.plan(job.id, g).await.unwrap(), "{\"moved\": 1}");
    assert_eq!(s.last_event(job.id, g, "membership_changed").await.unwrap().unwrap().message, "{\"epoch\": 3}");
    // ... and once they run, whole again in place: the loss's reason goes.
    let j = s.transition_at(job.id, Some(g), JobState::Running, None).await.unwrap();
    assert_eq!((j.state, j.generation, j.reason), (JobState::Running, g, None));
    assert!(
        s.reassign_ranks(job.id, g, &[1], 3, ("membership_changed", "{\"epoch\": 3}")).await.is_err(),
        "only a degraded job's replicas rejoin"
    );
    s.transition_at(job.id, Some(g), JobState::Degraded, Some("node n1 lost")).await.unwrap();
    let j = s.transition_at(job.id, Some(g), JobState::Succeeded, None).await.unwrap();
    assert_eq!((j.state, j.reason), (JobState::Succeeded, None), "a job that kept going succeeds with no failure reason");
    s.close().await;
});

conformance!(no_two_launches_claim_one_gpu_a_launch_and_a_move_alike, |url: String| async move {
    // A queued job planned on what was free when it looked, and a lost replica's move planned
    // on the same: whichever commits second is refused, naming the GPU, and nothing of it lands.
    let s = Store::open(&url).await.unwrap();
    for n in ["n0", "n1"] {
        s.register_node(n, "{}").await.unwrap();
    }
    let on = |rank: i64, node: &str, gpu: i64| RankAssignment {
        rank,
        node: node.into(),
        local_rank: 0,
        gpu,
        replica: rank,
        stage: 0,
        layer_start: 0,
        layer_end: 2,
    };
    let a = s.submit_job("a", "{}").await.unwrap();
    s.transition(a.id, JobState::Planning, None).await.unwrap();
    let g = s.start_generation(a.id, "{}", &[on(0, "n0", 0), on(1, "n1", 0)]).await.unwrap();
    s.transition_at(a.id, Some(g), JobState::Running, None).await.unwrap();
    s.transition_at(a.id, Some(g), JobState::Degraded, Some("node n1 lost")).await.unwrap();
    s.report_rank(a.id, g, 1, "lost", None).await.unwrap();

    let b = s.submit_job("b", "{}").await.unwrap();
    s.transition(b.id, JobState::Planning, None).await.unwrap();
    let e = s.start_generation(b.id, "{\"b\": 1}", &[on(0, "n0", 0)]).await.unwrap_err();
    assert!(matches!(&e, CoordinatorError::GpusHeld(m) if m.contains("n0:0") && m.contains(&format!("job {}", a.id))), "{e}");
    let j = s.job(b.id).await.unwrap();
    assert_eq!((j.state, j.generation), (JobState::Planning, 0), "nothing of the launch landed");
    assert!(s.ranks(b.id, 1).await.unwrap().is_empty());
    // A degraded job holds its lost rank's GPU too (its node may come back): b takes others.
    let e = s.start_generation(b.id, "{\"b\": 1}", &[on(0, "n1", 0)]).await.unwrap_err();
    assert!(matches!(&e, CoordinatorError::GpusHeld(m) if m.contains("n1:0")), "{e}");
    s.start_generation(b.id, "{\"b\": 1}", &[on(0, "n1", 1), on(1, "n0", 1)]).await.unwrap();

    // a's lost replica moves: not onto b's GPU, onto a free one.
    let e = s.move_ranks(a.id, g, &[on(1, "n0", 1)], "{\"moved\": 1}", 2, ("membership_changed", "{\"epoch\": 2}")).await.unwrap_err();
    assert!(matches!(&e, CoordinatorError::GpusHeld(m) if m.contains("n0:1")), "{e}");
    assert_eq!(s.plan(a.id, g).await.unwrap(), "{}", "nothing moved");
    assert!(s.last_event(a.id, g, "membership_changed").await.unwrap().is_none());
    assert_eq!(s.move_ranks(a.id, g, &[on(1, "n0", 2)], "{\"moved\": 1}", 2, ("membership_changed", "{\"epoch\": 2}")).await.unwrap(), 1);
    // A job that is over holds nothing: a later launch takes its GPUs.
    s.transition(b.id, JobState::Cancelled, Some("done with it")).await.unwrap();
    let c = s.submit_job("c", "{}").await.unwrap();
    s.transition(c.id, JobState::Planning, None).await.unwrap();
    s.start_generation(c.id, "{}", &[on(0, "n0", 1)]).await.unwrap();
    s.close().await;
});

conformance!(a_degraded_job_is_unfinished_holds_its_gpus_and_keeps_its_nodes, |url: String| async move {
    // A job that goes on without a lost replica (docs/keep-going.md) is as launched as a running
    // one: the tick looks at it, other jobs are not planned onto its GPUs, its nodes stay.
    let s = Store::open(&url).await.unwrap();
    s.register_node("n0", "{}").await.unwrap();
    let job = s.submit_job("degraded", "{}").await.unwrap();
    s.transition(job.id, JobState::Planning, None).await.unwrap();
    s.start_generation(job.id, "{}", &ranks(&["n0"])).await.unwrap();
    s.transition(job.id, JobState::Running, None).await.unwrap();
    s.transition(job.id, JobState::Degraded, Some("node n1 lost")).await.unwrap();
    let unfinished: Vec<i64> = s.unfinished_jobs().await.unwrap().iter().map(|j| j.id).collect();
    assert_eq!(unfinished, [job.id], "a degraded job is unfinished");
    let held: Vec<(String, i64)> = s.held_gpus().await.unwrap().into_iter().map(|h| (h.node, h.job)).collect();
    assert_eq!(held, [("n0".to_string(), job.id)], "its GPUs are held");
    assert!(matches!(s.remove_node("n0").await, Err(CoordinatorError::Conflict(_))), "its node is not removed under it");
    s.close().await;
});
