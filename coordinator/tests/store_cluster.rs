//! The cluster's identity in the store (migration 0011), on SQLite and on the PostgreSQL at
//! 127.0.0.1:5432, as `store_conformance` runs: made once, kept across restarts and shared by
//! coordinators opening one database at once; another database is another cluster; and a
//! database that already numbered jobs keeps their checkpoint prefix.

use crate::common;

use std::future::Future;

use motley_coordinator::Store;

fn run<F: Future>(f: F) -> F::Output {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap().block_on(f)
}

/// One test, twice: `name::sqlite` and `name::postgres`, each given fresh database URLs (two:
/// for a test that needs a second cluster).
macro_rules! on_both {
    ($name:ident, $body:expr) => {
        mod $name {
            use super::*;
            #[test]
            fn sqlite() {
                let dir = common::temp_dir();
                let url = |n: &str| format!("sqlite://{}", dir.join(n).display());
                run($body(url("one.db"), url("two.db")));
                let _ = std::fs::remove_dir_all(&dir);
            }
            #[test]
            fn postgres() {
                let (one, two) = (common::TestDb::create("motley_cluster"), common::TestDb::create("motley_cluster"));
                run($body(one.url.clone(), two.url.clone()));
            }
        }
    };
}

on_both!(the_identity_is_made_once_and_kept_across_restarts, |one: String, two: String| async move {
    // Coordinators opening a migrated database at once (HA, first start): one identity.
    sqlx::any::install_default_drivers();
    let pool = sqlx::any::AnyPoolOptions::new().max_connections(1).connect(&sqlite_rwc(&one)).await.unwrap();
    motley_coordinator::store::migrator().run(&pool).await.unwrap();
    pool.close().await;
    let opened = futures_join((0..3).map(|_| {
        let url = one.clone();
        async move { Store::open(&url).await }
    }))
    .await;
    let stores: Vec<Store> = opened.into_iter().map(|s| s.unwrap()).collect();
    let first = stores[0].cluster().clone();
    assert!(first.id.len() == 16 && first.id.bytes().all(|b| b.is_ascii_hexdigit()), "{first:?}");
    assert_eq!(first.first_job, 1, "a new database: every job's prefix carries the identity");
    assert!(stores.iter().all(|s| *s.cluster() == first), "one identity, whoever named it");
    stores[0].submit_job("j", "{}").await.unwrap();
    for s in &stores {
        s.close().await;
    }
    // A restart reads it back.
    let again = Store::open(&one).await.unwrap();
    assert_eq!(*again.cluster(), first);
    again.close().await;
    // Another database is another cluster.
    let other = Store::open(&two).await.unwrap();
    assert_ne!(other.cluster().id, first.id);
    other.close().await;
});

on_both!(jobs_numbered_before_the_identity_keep_their_checkpoint_prefix, |one: String, _two: String| async move {
    // A database as the version before the identity left it: three jobs numbered.
    sqlx::any::install_default_drivers();
    let pool = sqlx::any::AnyPoolOptions::new().max_connections(1).connect(&sqlite_rwc(&one)).await.unwrap();
    motley_coordinator::store::migrator().run_to(10, &pool).await.unwrap();
    sqlx::query("UPDATE counters SET value = 3 WHERE name = 'job_id'").execute(&pool).await.unwrap();
    pool.close().await;

    let s = Store::open(&one).await.unwrap();
    let cluster = s.cluster().clone();
    assert_eq!(cluster.first_job, 4);
    let job = s.submit_job("after", "{}").await.unwrap();
    assert_eq!(job.id, 4);
    let url = "file:///srv/ckpt";
    assert_eq!(cluster.job_cloud(url, 3), url, "job 3's steps are where it put them");
    assert_eq!(cluster.job_cloud(url, job.id), format!("{url}/{}", cluster.id));
    s.close().await;
    // The rule survives a restart.
    assert_eq!(Store::open(&one).await.unwrap().cluster().first_job, 4);
});

/// `Store::open`'s SQLite URL for a pool opened here (create the file if missing).
fn sqlite_rwc(url: &str) -> String {
    if url.starts_with("sqlite://") {
        format!("{url}?mode=rwc")
    } else {
        url.to_string()
    }
}

/// All of `futures`, run at once.
async fn futures_join<T: Send + 'static, F: Future<Output = T> + Send + 'static>(futures: impl Iterator<Item = F>) -> Vec<T> {
    let handles: Vec<_> = futures.map(tokio::spawn).collect();
    let mut out = vec![];
    for h in handles {
        out.push(h.await.unwrap());
    }
    out
}
