//! The leader's background work (the lease clock, the reconcile tick, the job queue) runs as tasks;
//! a task that panics or returns would leave a leader that answers `/ready` but schedules
//! nothing. `watch` waits on all of them and returns the first that ends, with why: the caller
//! ends the leadership and the process, loudly (systemd starts it again, as a standby if
//! another coordinator took over meanwhile).

use std::future::Future;

use tokio::task::JoinHandle;

/// The first of `tasks` to end, as an error naming it and how it ended. A task that should run
/// for the whole term and finishes early counts as a failure too. Tasks that may finish (the
/// takeover, once every job is resumed) are given as `may_finish`.
pub async fn watch(tasks: Vec<(&'static str, JoinHandle<()>)>, may_finish: &[&str]) -> String {
    let mut tasks: Vec<(&'static str, JoinHandle<()>)> = tasks;
    loop {
        if tasks.is_empty() {
            return std::future::pending().await;
        }
        let (result, i) = first_to_end(&mut tasks).await;
        let (name, _) = tasks.remove(i);
        match result {
            Ok(()) if may_finish.contains(&name) => continue,
            Ok(()) => return format!("the leader's {name} task ended"),
            Err(e) if e.is_panic() => {
                let payload = e.into_panic();
                let why = payload
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| payload.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "(no message)".into());
                return format!("the leader's {name} task panicked: {why}");
            }
            Err(e) => return format!("the leader's {name} task was cancelled: {e}"),
        }
    }
}

/// Wait for the first of the handles to finish: its result and index.
async fn first_to_end(tasks: &mut [(&'static str, JoinHandle<()>)]) -> (Result<(), tokio::task::JoinError>, usize) {
    std::future::poll_fn(|cx| {
        for (i, (_, h)) in tasks.iter_mut().enumerate() {
            if let std::task::Poll::Ready(r) = std::pin::Pin::new(h).poll(cx) {
                return std::task::Poll::Ready((r, i));
            }
        }
        std::task::Poll::Pending
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn a_panicking_task_is_named_with_its_message() {
        let forever = tokio::spawn(std::future::pending::<()>());
        let boom = tokio::spawn(async {
            tokio::time::sleep(Duration::from_millis(10)).await;
            panic!("queue exploded");
        });
        let why = watch(vec![("lease watcher", forever), ("job queue", boom)], &[]).await;
        assert_eq!(why, "the leader's job queue task panicked: queue exploded");
    }

    #[tokio::test]
    async fn a_task_that_may_finish_is_not_a_failure_but_one_that_must_not_is() {
        let takeover = tokio::spawn(async {});
        let queue = tokio::spawn(async {
            tokio::time::sleep(Duration::from_millis(20)).await;
        });
        let why = watch(vec![("takeover", takeover), ("job queue", queue)], &["takeover"]).await;
        assert_eq!(why, "the leader's job queue task ended");
    }
}
