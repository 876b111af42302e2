//! One conformance suite for the store, run unchanged against SQLite (a temporary file) and
//! against the PostgreSQL on 127.0.0.1:5432 (a fresh database per test, dropped after).
//! `MOTLEY_TEST_POSTGRES` overrides the server URL (default
//! `postgres://postgres@127.0.0.1:5432/postgres`).

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};

use motley_coordinator::{CoordinatorError, JobState, NodeState, RankAssignment, Store};
use sqlx::Connection;

static NEXT: AtomicUsize = AtomicUsize::new(0);

fn unique(prefix: &str) -> String {
    format!(
        "{prefix}_{}_{}_{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed),
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() % 1_000_000_000_000
    )
}

fn server() -> String {
    std::env::var("MOTLEY_TEST_POSTGRES").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into())
}

/// Run `body` with a fresh store URL on SQLite.
async fn on_sqlite<F, Fut>(body: F)
where
    F: FnOnce(String) -> Fut,
    Fut: Future<Output = ()>,
{
    let dir = std::env::temp_dir().join(unique("motley_store"));
    std::fs::create_dir_all(&dir).unwrap();
    let url = format!("sqlite://{}", dir.join("state.db").display());
    body(url).await;
    let _ = std::fs::remove_dir_all(&dir);
}

/// Run `body` with a fresh database on the PostgreSQL server, dropped afterwards.
async fn on_postgres<F, Fut>(body: F)
where
    F: FnOnce(String) -> Fut,
    Fut: Future<Output = ()>,
{
    let admin_url = server();
    // Only digits and underscores after a fixed prefix: safe to splice into DDL.
    let db = unique("motley_test");
    let mut admin = sqlx::PgConnection::connect(&admin_url).await.expect("PostgreSQL on 127.0.0.1:5432 (see the README) must be up");
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {db}"))).execute(&mut admin).await.unwrap();
    let base = admin_url.rsplit_once('/').map_or(admin_url.as_str(), |(b, _)| b).to_string();
    body(format!("{base}/{db}")).await;
    sqlx::query(sqlx::AssertSqlSafe(format!("DROP DATABASE IF EXISTS {db} WITH (FORCE)"))).execute(&mut admin).await.unwrap();
}

/// One test, twice: `name_sqlite` and `name_postgres`.
macro_rules! conformance {
    ($name:ident, $body:expr) => {
        mod $name {
            use super::*;
            #[tokio::test]
            async fn sqlite() {
                on_sqlite($body).await;
            }
            #[tokio::test]
            async fn postgres() {
                on_postgres($body).await;
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

conformance!(migrations_are_applied_once_and_reopen_keeps_state, |url: String| async move {
    let s = Store::open(&url).await.unwrap();
    s.register_node("n0", "{\"gpus\": 8}").await.unwrap();
    let job = s.submit_job("hello", "{}").await.unwrap();
    s.close().await;
    // A restarted coordinator: migrations are not re-run, nothing committed is lost.
    let s = Store::open(&url).await.unwrap();
    assert_eq!(s.nodes().await.unwrap().len(), 1);
    assert_eq!(s.job(job.id).await.unwrap().state, JobState::Submitted);
    s.close().await;
});

conformance!(nodes_register_drain_and_fence_old_agent_sessions, |url: String| async move {
    let s = Store::open(&url).await.unwrap();
    assert_eq!(s.register_node("n0", "{\"gpus\": 8}").await.unwrap(), 1);
    assert_eq!(s.register_node("n1", "{\"gpus\": 4}").await.unwrap(), 1);
    s.set_node_state("n0", NodeState::Draining).await.unwrap();
    // The agent restarts: a new epoch, the old session is fenced, the drain survives.
    assert_eq!(s.register_node("n0", "{\"gpus\": 8, \"again\": true}").await.unwrap(), 2);
    let n0 = s.node("n0").await.unwrap();
    assert_eq!((n0.state, n0.agent_epoch, n0.inventory.as_str()), (NodeState::Draining, 2, "{\"gpus\": 8, \"again\": true}"));
    s.check_agent("n0", 2).await.unwrap();
    match s.check_agent("n0", 1).await {
        Err(CoordinatorError::StaleAgent { given: 1, current: 2, .. }) => {}
        other => panic!("expected a stale agent, got {other:?}"),
    }
    s.set_node_state("n0", NodeState::Active).await.unwrap();
    let names: Vec<String> = s.nodes().await.unwrap().into_iter().map(|n| n.name).collect();
    assert_eq!(names, ["n0", "n1"]);
    assert!(matches!(s.set_node_state("ghost", NodeState::Draining).await, Err(CoordinatorError::NotFound { .. })));
    assert!(matches!(s.node("ghost").await, Err(CoordinatorError::NotFound { .. })));
    assert!(matches!(s.register_node(" ", "{}").await, Err(CoordinatorError::InvalidInput { .. })));
    s.close().await;
});

conformance!(a_job_lives_through_generations_and_stale_reports_change_nothing, |url: String| async move {
    let s = Store::open(&url).await.unwrap();
    for n in ["n0", "n1"] {
        s.register_node(n, "{}").await.unwrap();
    }
    let job = s.submit_job("train", "{\"model\": \"llama-7b\"}").await.unwrap();
    assert_eq!((job.state, job.generation), (JobState::Submitted, 0));
    s.transition(job.id, JobState::Planning, None).await.unwrap();
    let g1 = s.start_generation(job.id, "{\"plan\": 1}", &ranks(&["n0", "n1"])).await.unwrap();
    assert_eq!(g1, 1);
    assert_eq!(s.job(job.id).await.unwrap().state, JobState::Launching);
    assert_eq!(s.plan(job.id, 1).await.unwrap(), "{\"plan\": 1}");
    let r = s.ranks(job.id, 1).await.unwrap();
    assert_eq!(r.len(), 2);
    assert_eq!((r[1].assignment.node.as_str(), r[1].assignment.layer_start, r[1].state.as_str()), ("n1", 4, "assigned"));
    s.transition(job.id, JobState::Running, None).await.unwrap();
    s.report_rank(job.id, 1, 0, "running", None).await.unwrap();
    // A relaunch: generation 2; reports of generation 1 are refused and change nothing.
    let g2 = s.start_generation(job.id, "{\"plan\": 2}", &ranks(&["n1"])).await.unwrap();
    assert_eq!(g2, 2);
    match s.report_rank(job.id, 1, 1, "exited", Some(0)).await {
        Err(CoordinatorError::StaleGeneration { given: 1, current: 2, .. }) => {}
        other => panic!("expected a stale generation, got {other:?}"),
    }
    assert_eq!(s.ranks(job.id, 1).await.unwrap()[1].state, "assigned");
    assert!(matches!(s.check_generation(job.id, 1).await, Err(CoordinatorError::StaleGeneration { .. })));
    s.check_generation(job.id, 2).await.unwrap();
    s.transition(job.id, JobState::Running, None).await.unwrap();
    s.report_rank(job.id, 2, 0, "exited", Some(0)).await.unwrap();
    assert_eq!(s.ranks(job.id, 2).await.unwrap()[0].exit_code, Some(0));
    s.transition(job.id, JobState::Succeeded, None).await.unwrap();
    assert!(matches!(s.transition(job.id, JobState::Cancelled, Some("late")).await, Err(CoordinatorError::Conflict(_))));
    // The events tell the story in order.
    let events = s.events(Some(job.id), 0, 100).await.unwrap();
    let kinds: Vec<&str> = events.iter().map(|e| e.kind.as_str()).collect();
    assert_eq!(kinds, ["submitted", "planning", "launching", "running", "rank", "launching", "running", "rank", "succeeded"]);
    assert!(events.windows(2).all(|w| w[0].seq < w[1].seq));
    let after = s.events(Some(job.id), events[4].seq, 100).await.unwrap();
    assert_eq!(after.len(), 4);
    assert!(matches!(s.report_rank(job.id, 2, 0, "bogus", None).await, Err(CoordinatorError::InvalidInput { .. })));
    s.close().await;
});

conformance!(refused_transitions_and_failed_launches_leave_no_trace, |url: String| async move {
    let s = Store::open(&url).await.unwrap();
    s.register_node("n0", "{}").await.unwrap();
    let job = s.submit_job("train", "{}").await.unwrap();
    let before = s.events(None, 0, 1000).await.unwrap().len();
    assert!(matches!(s.transition(job.id, JobState::Running, None).await, Err(CoordinatorError::Conflict(_))));
    s.transition(job.id, JobState::Planning, None).await.unwrap();
    // A launch naming a node that never registered fails as a whole: no plan, no ranks, no
    // generation, no event.
    assert!(s.start_generation(job.id, "{}", &ranks(&["n0", "ghost"])).await.is_err());
    let j = s.job(job.id).await.unwrap();
    assert_eq!((j.state, j.generation), (JobState::Planning, 0));
    assert!(matches!(s.plan(job.id, 1).await, Err(CoordinatorError::NotFound { .. })));
    assert!(s.ranks(job.id, 1).await.unwrap().is_empty());
    assert_eq!(s.events(None, 0, 1000).await.unwrap().len(), before + 1, "only the planning event");
    s.transition(job.id, JobState::Failed, Some("no plan fits")).await.unwrap();
    assert_eq!(s.job(job.id).await.unwrap().reason.as_deref(), Some("no plan fits"));
    assert!(matches!(s.job(9999).await, Err(CoordinatorError::NotFound { .. })));
    s.close().await;
});

conformance!(concurrent_moves_of_one_job_let_exactly_one_win, |url: String| async move {
    let s = Store::open(&url).await.unwrap();
    let job = s.submit_job("race", "{}").await.unwrap();
    let (a, b) = tokio::join!(s.transition(job.id, JobState::Planning, None), s.transition(job.id, JobState::Cancelled, Some("user")));
    assert!(a.is_ok() ^ b.is_ok() || (a.is_ok() && b.is_ok()), "both may succeed only in sequence");
    let end = s.job(job.id).await.unwrap().state;
    match (a.is_ok(), b.is_ok()) {
        (true, true) => assert_eq!(end, JobState::Cancelled, "planning, then cancelled"),
        (true, false) => assert_eq!(end, JobState::Planning),
        (false, true) => assert_eq!(end, JobState::Cancelled),
        (false, false) => panic!("one of them must win"),
    }
    s.close().await;
});

#[tokio::test]
async fn a_bad_database_url_names_the_flag() {
    match Store::open("mysql://nope").await {
        Err(CoordinatorError::InvalidInput { field, .. }) => assert_eq!(field, "--database-url"),
        other => panic!("expected invalid input, got {:?}", other.err()),
    }
}

conformance!(rank_reports_are_fenced_by_agent_session_and_node, |url: String| async move {
    let s = Store::open(&url).await.unwrap();
    for n in ["n0", "n1"] {
        s.register_node(n, "{}").await.unwrap();
    }
    let job = s.submit_job("fenced", "{}").await.unwrap();
    s.transition(job.id, JobState::Planning, None).await.unwrap();
    s.start_generation(job.id, "{}", &ranks(&["n0", "n1"])).await.unwrap();
    // n0's agent re-registers: reports of its first session are refused, nothing changes.
    assert_eq!(s.register_node("n0", "{}").await.unwrap(), 2);
    assert!(matches!(s.report_rank_from(Some(("n0", 1)), job.id, 1, 0, "running", None).await, Err(CoordinatorError::StaleAgent { .. })));
    assert_eq!(s.ranks(job.id, 1).await.unwrap()[0].state, "assigned");
    // A node cannot report another node's rank.
    assert!(matches!(s.report_rank_from(Some(("n1", 1)), job.id, 1, 0, "running", None).await, Err(CoordinatorError::InvalidInput { .. })));
    s.report_rank_from(Some(("n0", 2)), job.id, 1, 0, "exited", Some(0)).await.unwrap();
    // An exited rank stays exited when a late "running" arrives, and a repeat is a no-op.
    let events = s.events(Some(job.id), 0, 100).await.unwrap().len();
    s.report_rank_from(Some(("n0", 2)), job.id, 1, 0, "running", None).await.unwrap();
    s.report_rank_from(Some(("n0", 2)), job.id, 1, 0, "exited", Some(0)).await.unwrap();
    assert_eq!(s.ranks(job.id, 1).await.unwrap()[0].state, "exited");
    assert_eq!(s.events(Some(job.id), 0, 100).await.unwrap().len(), events, "no event for a report that changed nothing");
    // Decisions about generation 1 do not move a job that has relaunched.
    s.transition(job.id, JobState::Running, None).await.unwrap();
    s.start_generation(job.id, "{}", &ranks(&["n1"])).await.unwrap();
    assert!(matches!(s.transition_at(job.id, Some(1), JobState::Failed, Some("old")).await, Err(CoordinatorError::StaleGeneration { .. })));
    assert_eq!(s.job(job.id).await.unwrap().state, JobState::Launching);
    // A cancelled job cannot be launched again.
    s.transition(job.id, JobState::Cancelled, Some("user")).await.unwrap();
    assert!(matches!(s.start_generation(job.id, "{}", &ranks(&["n1"])).await, Err(CoordinatorError::Conflict(_))));
    assert_eq!(s.job(job.id).await.unwrap().generation, 2);
    s.close().await;
});

conformance!(rank_summaries_count_starts_exits_failures_and_lost_ranks, |url: String| async move {
    let s = Store::open(&url).await.unwrap();
    s.register_node("n0", "{}").await.unwrap();
    let job = s.submit_job("summed", "{}").await.unwrap();
    s.transition(job.id, JobState::Planning, None).await.unwrap();
    s.start_generation(job.id, "{}", &ranks(&["n0", "n0", "n0"])).await.unwrap();
    let sum = s.rank_summary(job.id, 1).await.unwrap();
    assert_eq!((sum.total, sum.started, sum.exited, sum.first_failed.clone()), (3, 0, 0, None));
    s.report_rank_from(Some(("n0", 1)), job.id, 1, 0, "exited", Some(0)).await.unwrap();
    s.report_rank_from(Some(("n0", 1)), job.id, 1, 1, "running", None).await.unwrap();
    let sum = s.rank_summary(job.id, 1).await.unwrap();
    assert_eq!((sum.started, sum.exited, sum.first_failed.clone()), (2, 1, None));
    // A rank whose process vanished without an exit code fails the launch like a bad exit.
    s.report_rank_from(Some(("n0", 1)), job.id, 1, 2, "lost", None).await.unwrap();
    let bad = s.rank_summary(job.id, 1).await.unwrap().first_failed.expect("a lost rank is a failure");
    assert_eq!((bad.rank, bad.node.as_str(), bad.exit_code, bad.lost), (2, "n0", None, true));
    s.report_rank_from(Some(("n0", 1)), job.id, 1, 1, "exited", Some(3)).await.unwrap();
    let bad = s.rank_summary(job.id, 1).await.unwrap().first_failed.unwrap();
    assert_eq!((bad.rank, bad.exit_code, bad.lost), (1, Some(3), false), "the lowest failed rank is named");
    s.close().await;
});

conformance!(gpus_are_held_by_launched_jobs_and_by_ranks_still_running, |url: String| async move {
    let s = Store::open(&url).await.unwrap();
    s.register_node("n0", "{}").await.unwrap();
    let held =
        |s: Store| async move { s.held_gpus().await.unwrap().into_iter().map(|h| (h.node, h.gpu, h.job, h.running)).collect::<Vec<_>>() };
    let job = s.submit_job("held", "{}").await.unwrap();
    assert!(held(s.clone()).await.is_empty(), "a queued job holds nothing");
    s.transition(job.id, JobState::Planning, None).await.unwrap();
    let mut two = ranks(&["n0", "n0"]);
    two[1].gpu = 1;
    s.start_generation(job.id, "{}", &two).await.unwrap();
    assert_eq!(held(s.clone()).await, [("n0".into(), 0, job.id, false), ("n0".into(), 1, job.id, false)], "launching: both");
    s.report_rank_from(Some(("n0", 1)), job.id, 1, 0, "running", None).await.unwrap();
    s.report_rank_from(Some(("n0", 1)), job.id, 1, 1, "running", None).await.unwrap();
    // Cancelled: its GPUs stay held until its ranks are reported gone.
    s.transition(job.id, JobState::Cancelled, Some("test")).await.unwrap();
    assert_eq!(held(s.clone()).await.len(), 2);
    s.report_rank_from(Some(("n0", 1)), job.id, 1, 1, "exited", Some(143)).await.unwrap();
    assert_eq!(held(s.clone()).await, [("n0".into(), 0, job.id, true)]);
    s.report_rank_from(Some(("n0", 1)), job.id, 1, 0, "lost", None).await.unwrap();
    assert!(held(s.clone()).await.is_empty());
    s.submit_job("queued", "{}").await.unwrap();
    assert_eq!(s.job_counts().await.unwrap(), [("cancelled".to_string(), 1), ("submitted".to_string(), 1)]);
    s.close().await;
});

conformance!(concurrent_terminal_moves_let_exactly_one_win, |url: String| async move {
    let s = Store::open(&url).await.unwrap();
    s.register_node("n0", "{}").await.unwrap();
    let job = s.submit_job("race", "{}").await.unwrap();
    s.transition(job.id, JobState::Planning, None).await.unwrap();
    s.start_generation(job.id, "{}", &ranks(&["n0"])).await.unwrap();
    // Many movers read `launching` at once (PostgreSQL has several connections); a terminal
    // state can be entered once: without the compare-and-set in SQL, several would "win".
    let moves = (0..16).map(|i| {
        let (s, id) = (s.clone(), job.id);
        async move {
            let to = if i % 2 == 0 { JobState::Failed } else { JobState::Cancelled };
            s.transition_at(id, Some(1), to, Some(&format!("mover {i}"))).await
        }
    });
    let results = join_all(moves.collect()).await;
    let won: Vec<usize> = results.iter().enumerate().filter(|(_, r)| r.is_ok()).map(|(i, _)| i).collect();
    assert_eq!(won.len(), 1, "exactly one move wins: {won:?}");
    let end = s.job(job.id).await.unwrap();
    assert_eq!(end.reason.as_deref(), Some(format!("mover {}", won[0]).as_str()));
    let ends = s.events(Some(job.id), 0, 100).await.unwrap().into_iter().filter(|e| e.kind == "failed" || e.kind == "cancelled").count();
    assert_eq!(ends, 1, "one end event");
    // A move at a generation the job has left is refused.
    assert!(matches!(s.transition_at(job.id, Some(7), JobState::Failed, None).await, Err(CoordinatorError::StaleGeneration { .. })));
    s.close().await;
});

/// Run the futures concurrently (tokio tasks) and collect their outputs in the order given.
async fn join_all<T: Send + 'static>(futures: Vec<impl Future<Output = T> + Send + 'static>) -> Vec<T> {
    let mut set = tokio::task::JoinSet::new();
    for (i, f) in futures.into_iter().enumerate() {
        set.spawn(async move { (i, f.await) });
    }
    let mut done: Vec<(usize, T)> = set.join_all().await;
    done.sort_by_key(|(i, _)| *i);
    done.into_iter().map(|(_, v)| v).collect()
}

conformance!(concurrent_registrations_get_distinct_epochs, |url: String| async move {
    let s = Store::open(&url).await.unwrap();
    let registrations = (0..16).map(|_| {
        let s = s.clone();
        async move { s.register_node("n0", "{}").await.unwrap() }
    });
    let mut epochs = join_all(registrations.collect()).await;
    epochs.sort_unstable();
    assert_eq!(epochs, (1..=16).collect::<Vec<i64>>(), "every registration fences the ones before it");
    s.close().await;
});

conformance!(an_unknown_node_state_is_an_error_not_active, |url: String| async move {
    let s = Store::open(&url).await.unwrap();
    s.register_node("n0", "{}").await.unwrap();
    sqlx::any::install_default_drivers();
    let mut raw = sqlx::AnyConnection::connect(&url).await.unwrap();
    sqlx::query("UPDATE nodes SET state = 'cordoned' WHERE name = 'n0'").execute(&mut raw).await.unwrap();
    match s.node("n0").await {
        Err(e @ CoordinatorError::Conflict(_)) => assert!(e.to_string().contains("'cordoned' is unknown"), "{e}"),
        other => panic!("expected an error, got {other:?}"),
    }
    assert!(s.nodes().await.is_err(), "never listed as active");
    raw.close().await.unwrap();
    s.close().await;
});

conformance!(running_ranks_an_agent_no_longer_knows_are_lost, |url: String| async move {
    let s = Store::open(&url).await.unwrap();
    for n in ["n0", "n1"] {
        s.register_node(n, "{}").await.unwrap();
    }
    let job = s.submit_job("lost", "{}").await.unwrap();
    s.transition(job.id, JobState::Planning, None).await.unwrap();
    s.start_generation(job.id, "{}", &ranks(&["n0", "n0", "n1"])).await.unwrap();
    for (node, rank) in [("n0", 0), ("n0", 1), ("n1", 2)] {
        s.report_rank_from(Some((node, 1)), job.id, 1, rank, "running", None).await.unwrap();
    }
    // n0's agent comes back knowing rank 0 only (rank 1's end was never acknowledged).
    assert!(matches!(s.lose_unknown_ranks("n0", 7, &[(job.id, 1, 0)]).await, Err(CoordinatorError::StaleAgent { .. })), "fenced");
    assert_eq!(s.lose_unknown_ranks("n0", 1, &[(job.id, 1, 0)]).await.unwrap(), vec![job.id]);
    let states: Vec<String> = s.ranks(job.id, 1).await.unwrap().into_iter().map(|r| r.state).collect();
    assert_eq!(states, ["running", "lost", "running"], "n1's rank is not n0's to lose");
    assert!(s.lose_unknown_ranks("n0", 1, &[(job.id, 1, 0)]).await.unwrap().is_empty(), "a repeat changes nothing");
    s.close().await;
});

conformance!(a_node_is_removed_only_without_ranks_and_comes_back_on_registration, |url: String| async move {
    let s = Store::open(&url).await.unwrap();
    for n in ["n0", "n1"] {
        s.register_node(n, "{}").await.unwrap();
    }
    let job = s.submit_job("busy", "{}").await.unwrap();
    s.transition(job.id, JobState::Planning, None).await.unwrap();
    s.start_generation(job.id, "{}", &ranks(&["n0"])).await.unwrap();
    match s.remove_node("n0").await {
        Err(e @ CoordinatorError::Conflict(_)) => assert!(e.to_string().contains(&format!("ranks of job {}", job.id)), "{e}"),
        other => panic!("a busy node is kept: {other:?}"),
    }
    s.remove_node("n1").await.unwrap();
    assert!(matches!(s.node("n1").await, Err(CoordinatorError::NotFound { .. })));
    assert!(matches!(s.remove_node("n1").await, Err(CoordinatorError::NotFound { .. })));
    assert_eq!(s.nodes().await.unwrap().len(), 1);
    // Its agent registers again: back, active, with a newer epoch.
    assert_eq!(s.register_node("n1", "{}").await.unwrap(), 2);
    assert_eq!(s.node("n1").await.unwrap().state, NodeState::Active);
    // Once the job is over, n0 goes too (its old ranks keep naming it).
    s.transition(job.id, JobState::Cancelled, None).await.unwrap();
    s.remove_node("n0").await.unwrap();
    assert_eq!(s.ranks(job.id, 1).await.unwrap()[0].assignment.node, "n0");
    s.close().await;
});

conformance!(profiles_are_kept_per_key_and_the_newest_of_each_is_planned_with, |url: String| async move {
    use motley_coordinator::store::NewProfile;
    let s = Store::open(&url).await.unwrap();
    let p = |gpu: &str, mb: i64, torch: &str, fwd: f64| NewProfile {
        gpu: gpu.into(),
        model: "tiny".into(),
        model_hash: "abc".into(),
        tp: 1,
        micro_batch: mb,
        seq_len: 32,
        dtype: "fp32".into(),
        torch: torch.into(),
        device: "cpu".into(),
        node: "n0".into(),
        entry: format!("{{\"gpu\":\"{gpu}\",\"tp\":1,\"micro_batch\":{mb},\"fwd_ms\":{fwd},\"bwd_ms\":2.0}}"),
    };
    let first = s.put_profile(&p("A100-80G", 2, "2.14", 1.0)).await.unwrap();
    s.put_profile(&p("A100-80G", 1, "2.14", 0.5)).await.unwrap();
    // The same key measured again (same torch): replaces the row.
    let again = s.put_profile(&p("A100-80G", 2, "2.14", 1.5)).await.unwrap();
    assert!(again > first);
    assert!(matches!(s.profile(first).await, Err(CoordinatorError::NotFound { .. })));
    assert_eq!(s.profiles(None).await.unwrap().len(), 2);
    // Another torch version is another row; the planner takes the newest of each
    // (gpu, tp, micro-batch) whatever measured it.
    tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    let newest = s.put_profile(&p("A100-80G", 2, "2.15", 1.25)).await.unwrap();
    assert_eq!(s.profiles(None).await.unwrap().len(), 3);
    let used = s.profiles_for("abc", 32, "fp32").await.unwrap();
    assert_eq!(used.len(), 2, "{used:?}");
    let mb2 = used.iter().find(|r| r.profile.micro_batch == 2).unwrap();
    assert_eq!((mb2.id, mb2.profile.torch.as_str()), (newest, "2.15"));
    assert!(s.profiles_for("abc", 64, "fp32").await.unwrap().is_empty(), "another sequence length");
    assert!(s.profiles_for("abc", 32, "bf16").await.unwrap().is_empty(), "another data type");
    assert!(s.profiles(Some("other")).await.unwrap().is_empty());
    let r = s.profile(newest).await.unwrap();
    assert_eq!((r.profile.gpu.as_str(), r.profile.node.as_str(), r.profile.seq_len), ("A100-80G", "n0", 32));
    assert!(s.events(None, 0, 100).await.unwrap().iter().any(|e| e.kind == "profile_stored"));
    s.close().await;
});

conformance!(holdings_replace_a_nodes_list_under_its_current_epoch_only, |url: String| async move {
    use motley_coordinator::store::Holding;
    let s = Store::open(&url).await.unwrap();
    let e0 = s.register_node("n0", "{}").await.unwrap();
    let e1 = s.register_node("n1", "{}").await.unwrap();
    let job = s.submit_job("ckpt", "{}").await.unwrap();
    let h = |file: &str, step: i64| Holding {
        job_id: job.id,
        generation: 1,
        step,
        file: file.into(),
        node: String::new(),
        tier: "disk".into(),
        bytes: 10,
        block: "layer.0".into(),
        part: "model".into(),
        tp_rank: 0,
        tp_size: 1,
        rank: -1,
        layers: 1,
        world_size: 1,
        chunk_bytes: 16 << 20,
        crc32c: "[7]".into(),
    };
    s.replace_holdings("n0", e0, &[h("a", 4), h("b", 4)]).await.unwrap();
    s.replace_holdings("n1", e1, &[h("a", 4)]).await.unwrap();
    let all = s.holdings(job.id).await.unwrap();
    assert_eq!(all.iter().map(|x| (x.file.as_str(), x.node.as_str())).collect::<Vec<_>>(), [("a", "n0"), ("a", "n1"), ("b", "n0")]);
    assert_eq!(all[0].file_entry().crc32c, [7], "the crcs a restore verifies against are kept");
    assert_eq!(all[0].file_entry().chunk_bytes, 16 << 20);
    // The whole list replaces the node's rows.
    s.replace_holdings("n0", e0, &[h("c", 8)]).await.unwrap();
    let all = s.holdings(job.id).await.unwrap();
    assert_eq!(all.iter().map(|x| (x.step, x.file.as_str(), x.node.as_str())).collect::<Vec<_>>(), [(4, "a", "n1"), (8, "c", "n0")]);
    // A session the node's agent has since replaced: refused, nothing changes.
    let newer = s.register_node("n0", "{}").await.unwrap();
    match s.replace_holdings("n0", e0, &[]).await {
        Err(CoordinatorError::StaleAgent { given, current, .. }) => assert_eq!((given, current), (e0, newer)),
        other => panic!("a stale session's holdings are refused: {other:?}"),
    }
    assert_eq!(s.holdings(job.id).await.unwrap().len(), 2);
    s.replace_holdings("n0", newer, &[]).await.unwrap();
    assert_eq!(s.holdings(job.id).await.unwrap().len(), 1);

    // The same step saved by generation 1 (which lost a node mid-save) and again by
    // generation 2, with other bytes: both copies are kept, each under its generation.
    let g = |file: &str, generation: i64, crc: u32| Holding { generation, crc32c: format!("[{crc}]"), ..h(file, 12) };
    s.replace_holdings("n0", newer, &[g("a", 1, 11), g("a", 2, 22), g("b", 2, 23)]).await.unwrap();
    let twelve: Vec<(i64, String, Vec<u32>)> = s
        .holdings(job.id)
        .await
        .unwrap()
        .into_iter()
        .filter(|x| x.step == 12)
        .map(|x| (x.generation, x.file.clone(), x.file_entry().crc32c))
        .collect();
    assert_eq!(twelve, [(1, "a".into(), vec![11]), (2, "a".into(), vec![22]), (2, "b".into(), vec![23])]);
    // Another node's report of generation 2's copy does not touch generation 1's rows.
    s.replace_holdings("n1", e1, &[g("a", 2, 22)]).await.unwrap();
    let a12: Vec<(i64, String, String)> =
        s.holdings(job.id).await.unwrap().into_iter().filter(|x| x.step == 12).map(|x| (x.generation, x.file, x.node)).collect();
    let want = [(1, "a", "n0"), (2, "a", "n0"), (2, "a", "n1"), (2, "b", "n0")];
    assert_eq!(a12, want.map(|(g, f, n)| (g, f.to_string(), n.to_string())));
    s.close().await;
});

/// The job's last event: (kind, generation, message).
async fn last_event(s: &Store, job: i64) -> (String, Option<i64>, String) {
    let e = s.events(Some(job), 0, 1000).await.unwrap().pop().unwrap();
    (e.kind, e.generation, e.message)
}

/// Job `name` running its first launch (plan `{"plan": 1}`), one rank on node n0.
async fn running_on_n0(s: &Store, name: &str) -> motley_coordinator::store::JobRecord {
    s.register_node("n0", "{}").await.unwrap();
    let job = s.submit_job(name, "{}").await.unwrap();
    s.transition(job.id, JobState::Planning, None).await.unwrap();
    s.start_generation(job.id, "{\"plan\": 1}", &ranks(&["n0"])).await.unwrap();
    s.transition(job.id, JobState::Running, None).await.unwrap();
    job
}

conformance!(a_recovery_spends_its_causes_budget_in_the_move_to_recovering, |url: String| async move {
    use motley_coordinator::store::{RecoveryCause, Spent};
    let s = Store::open(&url).await.unwrap();
    let job = running_on_n0(&s, "elastic").await;
    assert_eq!(s.spent(job.id).await.unwrap(), Spent::default());
    assert_eq!(s.restore_step(job.id, 1).await.unwrap(), None, "a plain launch resumes from no step");

    // running -> recovering: one preemption spent, with an event naming the budget.
    let spent = s.begin_recovery(job.id, 1, RecoveryCause::Preemption, 2, "node n0 lost").await.unwrap();
    assert_eq!(spent, Spent { preemptions: 1, restarts: 0 });
    assert_eq!(s.spent(job.id).await.unwrap(), spent);
    let j = s.job(job.id).await.unwrap();
    assert_eq!((j.state, j.generation, j.reason.as_deref()), (JobState::Recovering, 1, Some("node n0 lost")));
    let id = job.id;
    assert_eq!(
        last_event(&s, id).await,
        ("recovering".into(), Some(1), format!("job {id}: running -> recovering (preemptions 1 of 2): node n0 lost"))
    );
    // Recovering already: a second move is refused and spends nothing.
    match s.begin_recovery(id, 1, RecoveryCause::Preemption, 2, "again").await {
        Err(CoordinatorError::Conflict(m)) => assert_eq!(m, format!("job {id} is recovering; it cannot recover")),
        other => panic!("expected a conflict, got {other:?}"),
    }
    assert_eq!(s.spent(id).await.unwrap(), spent);

    // recovering -> launching from step 40: the next generation, which resumes from it.
    assert_eq!(s.start_generation_from(id, "{\"plan\": 2}", &ranks(&["n0"]), Some((40, 1))).await.unwrap(), 2);
    let j = s.job(id).await.unwrap();
    assert_eq!((j.state, j.generation), (JobState::Launching, 2));
    assert_eq!(s.restore_step(id, 2).await.unwrap(), Some(40));
    assert_eq!(s.restore_generation(id, 2).await.unwrap(), Some(1), "the generation whose files it loads");
    assert_eq!(s.restore_step(id, 1).await.unwrap(), None);
    assert_eq!(s.restore_generation(id, 1).await.unwrap(), None);
    assert_eq!(s.plan(id, 2).await.unwrap(), "{\"plan\": 2}");
    s.transition(id, JobState::Running, None).await.unwrap();

    // A failed rank spends a restart, not a preemption.
    let spent = s.begin_recovery(id, 2, RecoveryCause::Restart, 1, "rank 0 exited 1").await.unwrap();
    assert_eq!(spent, Spent { preemptions: 1, restarts: 1 });
    assert_eq!(
        last_event(&s, id).await,
        ("recovering".into(), Some(2), format!("job {id}: running -> recovering (restarts 1 of 1): rank 0 exited 1"))
    );
    // A plain relaunch (step 0) leaves restore_step unset.
    assert_eq!(s.start_generation(id, "{\"plan\": 3}", &ranks(&["n0"])).await.unwrap(), 3);
    assert_eq!(s.restore_step(id, 3).await.unwrap(), None);
    assert_eq!(s.restore_step(id, 2).await.unwrap(), Some(40), "each launch keeps its own");

    // Launching, restarts spent: refused, nothing changes (state, counters, events).
    let events = s.events(Some(id), 0, 1000).await.unwrap().len();
    match s.begin_recovery(id, 3, RecoveryCause::Restart, 1, "rank 0 exited 1").await {
        Err(CoordinatorError::Conflict(m)) => {
            assert_eq!(m, format!("job {id}: no restarts left (1 allowed) or the job changed concurrently"))
        }
        other => panic!("expected a spent budget, got {other:?}"),
    }
    // A budget of 0 allows none.
    assert!(matches!(s.begin_recovery(id, 3, RecoveryCause::Preemption, 0, "n0 drained").await, Err(CoordinatorError::Conflict(_))));
    // A generation the job has left: refused.
    match s.begin_recovery(id, 2, RecoveryCause::Preemption, 5, "late").await {
        Err(CoordinatorError::StaleGeneration { given, current, .. }) => assert_eq!((given, current), (2, 3)),
        other => panic!("expected a stale generation, got {other:?}"),
    }
    let j = s.job(id).await.unwrap();
    assert_eq!((j.state, j.generation), (JobState::Launching, 3));
    assert_eq!(s.spent(id).await.unwrap(), Spent { preemptions: 1, restarts: 1 });
    assert_eq!(s.events(Some(id), 0, 1000).await.unwrap().len(), events, "a refused recovery writes no event");

    // launching -> recovering with budget left.
    let spent = s.begin_recovery(id, 3, RecoveryCause::Preemption, 2, "n0 drained").await.unwrap();
    assert_eq!(spent, Spent { preemptions: 2, restarts: 1 });
    assert_eq!(
        last_event(&s, id).await,
        ("recovering".into(), Some(3), format!("job {id}: launching -> recovering (preemptions 2 of 2): n0 drained"))
    );
    // Over: cancelled jobs do not recover.
    s.transition(id, JobState::Cancelled, Some("user")).await.unwrap();
    assert!(matches!(s.begin_recovery(id, 3, RecoveryCause::Restart, 9, "late").await, Err(CoordinatorError::Conflict(_))));
    assert_eq!(s.spent(id).await.unwrap(), spent);
    assert!(matches!(s.spent(9999).await, Err(CoordinatorError::NotFound { .. })));
    s.close().await;
});

conformance!(a_job_that_succeeds_after_a_recovery_carries_no_failure_reason, |url: String| async move {
    use motley_coordinator::store::RecoveryCause;
    let s = Store::open(&url).await.unwrap();
    let job = running_on_n0(&s, "elastic").await;
    s.begin_recovery(job.id, 1, RecoveryCause::Restart, 1, "rank 0 on node n0 exited with code 1").await.unwrap();
    s.start_generation(job.id, "{\"plan\": 2}", &ranks(&["n0"])).await.unwrap();
    s.transition(job.id, JobState::Running, None).await.unwrap();
    let done = s.transition(job.id, JobState::Succeeded, None).await.unwrap();
    assert_eq!((done.state, done.reason), (JobState::Succeeded, None), "the recovery's cause is history, not why it ended");
    let kinds: Vec<String> = s.events(Some(job.id), 0, 100).await.unwrap().into_iter().map(|e| e.message).collect();
    assert!(kinds.iter().any(|m| m.contains("exited with code 1")), "the events keep it: {kinds:?}");
    // A failure given with the move is kept.
    let other = s.submit_job("plain", "{}").await.unwrap();
    s.transition(other.id, JobState::Planning, None).await.unwrap();
    let failed = s.transition(other.id, JobState::Failed, Some("no plan fits")).await.unwrap();
    assert_eq!(failed.reason.as_deref(), Some("no plan fits"));
});

conformance!(concurrent_recoveries_of_one_launch_spend_one_budget, |url: String| async move {
    use motley_coordinator::store::{RecoveryCause, Spent};
    let s = Store::open(&url).await.unwrap();
    s.register_node("n0", "{}").await.unwrap();
    let job = s.submit_job("race", "{}").await.unwrap();
    s.transition(job.id, JobState::Planning, None).await.unwrap();
    s.start_generation(job.id, "{}", &ranks(&["n0"])).await.unwrap();
    s.transition(job.id, JobState::Running, None).await.unwrap();
    let moves = (0..8).map(|i| {
        let (s, id) = (s.clone(), job.id);
        let cause = if i % 2 == 0 { RecoveryCause::Preemption } else { RecoveryCause::Restart };
        async move { s.begin_recovery(id, 1, cause, 5, &format!("mover {i}")).await }
    });
    let results = join_all(moves.collect()).await;
    let won: Vec<usize> = results.iter().enumerate().filter(|(_, r)| r.is_ok()).map(|(i, _)| i).collect();
    assert_eq!(won.len(), 1, "exactly one recovery begins: {won:?}");
    let want = if won[0].is_multiple_of(2) { Spent { preemptions: 1, restarts: 0 } } else { Spent { preemptions: 0, restarts: 1 } };
    assert_eq!(s.spent(job.id).await.unwrap(), want);
    let recovering = s.events(Some(job.id), 0, 100).await.unwrap().into_iter().filter(|e| e.kind == "recovering").count();
    assert_eq!(recovering, 1);
    s.close().await;
});

conformance!(profile_runs_are_durable_and_a_new_leader_takes_them_over, |url: String| async move {
    use motley_coordinator::store::{RunKey, RunState};
    let s = Store::open(&url).await.unwrap();
    let key = RunKey { gpu: "A100-80G", model_hash: "abc", tp: 2, micro_batch: 4, seq_len: 32, dtype: "fp32" };
    let run = s.start_profile_run(&key, "tiny", "n0", &[3, 5]).await.unwrap();
    assert_eq!((run.state.clone(), run.node.as_str(), run.gpus.clone()), (RunState::Running, "n0", vec![3, 5]));
    let other = s.start_profile_run(&RunKey { micro_batch: 8, ..key }, "tiny", "n1", &[0]).await.unwrap();
    assert!(other.request > run.request, "request numbers only grow");
    s.close().await;
    // A new leader (a restart, a failover) knows the runs out, their GPUs and their keys.
    let s = Store::open(&url).await.unwrap();
    let running: Vec<(String, Vec<u32>)> = s.running_profile_runs().await.unwrap().into_iter().map(|r| (r.node, r.gpus)).collect();
    assert_eq!(running.len(), 2, "{running:?}");
    assert!(running.contains(&("n0".to_string(), vec![3, 5])));
    let latest = s.latest_profile_run(&RunKey { gpu: "a100-80g", ..key }).await.unwrap().expect("GPU type names match in any case");
    assert_eq!(latest.request, run.request);
    assert!(s.latest_profile_run(&RunKey { dtype: "bf16", ..key }).await.unwrap().is_none());
    // Its report is taken once: a second report of the same run changes nothing.
    let stored = s.finish_profile_run(run.request, &RunState::Stored { profile: 7 }).await.unwrap().unwrap();
    assert_eq!(stored.state, RunState::Stored { profile: 7 });
    let again = s.finish_profile_run(run.request, &RunState::Failed { reason: "late".into() }).await.unwrap().unwrap();
    assert_eq!(again.state, RunState::Stored { profile: 7 });
    assert_eq!(s.running_profile_runs().await.unwrap().len(), 1);
    assert!(s.finish_profile_run(999, &RunState::Stored { profile: 1 }).await.unwrap().is_none(), "an unknown run");
    // Runs out longer than the limit fail; ended runs older than it are forgotten.
    tokio::time::sleep(std::time::Duration::from_millis(30)).await;
    s.expire_profile_runs(20).await.unwrap();
    let late = s.profile_run(other.request).await.unwrap().unwrap();
    assert!(matches!(&late.state, RunState::Failed { reason } if reason.contains("no result from node n1")), "{late:?}");
    assert!(s.profile_run(run.request).await.unwrap().is_none(), "ended 30 ms ago, kept 20 ms");
    tokio::time::sleep(std::time::Duration::from_millis(30)).await;
    s.expire_profile_runs(20).await.unwrap();
    assert!(s.profile_runs().await.unwrap().is_empty());
    s.close().await;
});

conformance!(the_data_plane_key_is_generated_once_and_shared, |url: String| async move {
    let (a, b) = (Store::open(&url).await.unwrap(), Store::open(&url).await.unwrap());
    // Two coordinators racing, each with its own random candidate: both get the one that landed.
    let (ka, kb) = tokio::join!(a.data_plane_key(&[1; 32]), b.data_plane_key(&[2; 32]));
    let (ka, kb) = (ka.unwrap(), kb.unwrap());
    assert_eq!(ka, kb);
    assert!(ka == [1; 32] || ka == [2; 32], "{ka:?}");
    a.close().await;
    b.close().await;
    // A restart keeps it: capabilities minted before a failover still verify after it.
    let s = Store::open(&url).await.unwrap();
    assert_eq!(s.data_plane_key(&[3; 32]).await.unwrap(), ka);
    s.close().await;
});
