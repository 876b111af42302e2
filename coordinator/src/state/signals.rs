//! Job signals: in-memory nudges between the rooms that move jobs, none of them state (a new
//! leader rebuilds each: it looks at the queue, sends launching launches again, and reads every
//! launched job's ranks on its first tick). Kept apart from the fleet, which knows agents, not
//! jobs: the queue's wake-up (a submit, a job's end, a profile that came in), the launches this
//! leader has sent, and the jobs whose rank reports were just committed. A bottom room: it
//! calls nothing.

use std::collections::{BTreeSet, HashSet};
use std::sync::{Arc, Mutex};

#[derive(Default)]
pub struct JobSignals {
    /// Something the job queue waits on changed.
    queue: tokio::sync::Notify,
    /// Launches (job, generation) this leader has sent out.
    sent: Mutex<HashSet<(i64, i64)>>,
    /// Jobs whose ranks' reports were committed: the job step looks at them next.
    reported: Mutex<BTreeSet<i64>>,
    reports: tokio::sync::Notify,
}

impl JobSignals {
    pub fn new() -> Arc<JobSignals> {
        Arc::new(JobSignals::default())
    }

    /// Have the job queue look again (a job was submitted or ended).
    pub fn kick_queue(&self) {
        self.queue.notify_one();
    }

    /// Resolves at the next `kick_queue` (or at once if one came since the last wait).
    pub async fn queue_changed(&self) {
        self.queue.notified().await
    }

    /// Claim the sending of a launch: true for the one caller that is to send it (the queue
    /// and the reconcile tick's step may both find it unsent; a launch sent twice costs
    /// every node a second Launch).
    pub fn claim_send(&self, job: i64, generation: i64) -> bool {
        self.sent().insert((job, generation))
    }

    /// The claimed launch was not sent after all: the next look tries again.
    pub fn unclaim_send(&self, job: i64, generation: i64) {
        self.sent().remove(&(job, generation));
    }

    /// Whether the launch was sent by this leader.
    pub fn was_sent(&self, job: i64, generation: i64) -> bool {
        self.sent().contains(&(job, generation))
    }

    /// Send every launching launch again on the next look (a session changed under it).
    pub fn resend_launches(&self) {
        self.sent().clear();
    }

    /// Forget the launches that are no longer launching.
    pub fn keep_sent(&self, launching: &[(i64, i64)]) {
        self.sent().retain(|k| launching.contains(k));
    }

    /// Rank reports of these jobs were committed: have the job step look at them.
    pub fn reported(&self, jobs: &[i64]) {
        if jobs.is_empty() {
            return;
        }
        self.reported.lock().expect("reported lock").extend(jobs.iter().copied());
        self.reports.notify_one();
    }

    /// The jobs reported since the last call (waits for the first if there are none).
    pub async fn take_reported(&self) -> Vec<i64> {
        loop {
            let jobs: Vec<i64> = std::mem::take(&mut *self.reported.lock().expect("reported lock")).into_iter().collect();
            if !jobs.is_empty() {
                return jobs;
            }
            self.reports.notified().await;
        }
    }

    fn sent(&self) -> std::sync::MutexGuard<'_, HashSet<(i64, i64)>> {
        self.sent.lock().expect("sent lock")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_launch_is_claimed_for_sending_once() {
        let signals = JobSignals::new();
        assert!(signals.claim_send(7, 1), "the first to look sends it");
        assert!(!signals.claim_send(7, 1), "the queue and the recheck never both send it");
        assert!(signals.claim_send(7, 2), "another generation is another launch");
        signals.unclaim_send(7, 1);
        assert!(signals.claim_send(7, 1), "a send that failed is tried again");
        signals.resend_launches();
        assert!(signals.claim_send(7, 1), "a new session sends it again");
    }

    #[test]
    fn launches_no_longer_launching_are_forgotten() {
        let s = JobSignals::new();
        assert!(s.claim_send(1, 1) && !s.claim_send(1, 1) && s.was_sent(1, 1));
        s.unclaim_send(1, 1);
        assert!(!s.was_sent(1, 1) && s.claim_send(1, 1));
        s.keep_sent(&[(2, 1)]);
        assert!(!s.was_sent(1, 1));
        assert!(s.claim_send(2, 1));
        s.resend_launches();
        assert!(!s.was_sent(2, 1));
    }

    #[tokio::test]
    async fn reported_jobs_are_taken_once_in_order() {
        let s = JobSignals::new();
        s.reported(&[3, 1]);
        s.reported(&[]);
        s.reported(&[3]);
        assert_eq!(s.take_reported().await, vec![1, 3]);
        let waiting = tokio::time::timeout(std::time::Duration::from_millis(20), s.take_reported()).await;
        assert!(waiting.is_err(), "nothing reported since: it waits");
    }
}
