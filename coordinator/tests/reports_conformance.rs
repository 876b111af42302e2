//! A batch of rank reports as the store commits it, run against SQLite (a temporary file) and
//! against the PostgreSQL on 127.0.0.1:5432 (a fresh database per test, dropped after), as
//! `store_conformance.rs` runs the rest of the store: a launch whose ranks all started moves
//! `running` in the same commit, its event before the ranks' later exits.

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};

use motley_coordinator::{JobState, RankAssignment, Store};
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

    // A failed rank is the leader's to decide on (restart or fail): no move.
    let id = launched("failing", s.clone()).await;
    s.report_ranks_from(Some(("n0", 1)), vec![report(id, 0, "exited", Some(1)), report(id, 1, "running", None)]).await.unwrap();
    assert_eq!(s.job(id).await.unwrap().state, JobState::Launching);
    assert!(!kinds(s.clone(), id).await.iter().any(|e| e.starts_with("running ")));

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
