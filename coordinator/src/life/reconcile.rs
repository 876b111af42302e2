//! The job controller's one loop (docs/architecture.md, "One job's life"): every base interval a
//! reconcile tick reads the unfinished jobs once and dispatches each by its state.
//!
//! | state | what the tick does |
//! |---|---|
//! | `submitted`, `planning` | wakes the queue's worker (`queue`): it plans queued jobs one at a time, oldest first |
//! | `launching` | a new leader's grace (`takeover`); the launch sent if this leader has not; failed if never acknowledged; moved on from its ranks (`Life::step`) |
//! | `running` | the grace; moved on from its ranks; then the running jobs' watch: notices, scale-up, re-plans on changed links (`notice`, `scale`, `network`) |
//! | `degraded` | the grace (its members' nodes); moved on from its members' ranks, its membership sent where not yet (`keep_going`) |
//! | `recovering` | a recovery task started if none runs (`recover`) |
//!
//! Between ticks, a node whose lease ended (`lease_clock`) and the jobs whose ranks just
//! reported (`JobSignals::reported`) are looked at at once, and a recovery that begins wakes
//! the tick. Work that can take as long as a plan (the queue's planning, a scale-up's or a
//! re-plan's solver run, a recovery) runs on a worker the tick hands it to, so a plan never
//! delays a lease, a launch timeout or a report. The workers have no clock of their own.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Instant;

use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;

use super::{Life, GRACE_INTERVALS};
use crate::job::JobState;
use crate::state::fleet::Fleet;
use crate::store::JobRecord;

/// The leader's tasks, started when leadership is won (the supervisor watches them; every one
/// runs for the whole term).
pub fn spawn(life: Arc<Life>) -> Vec<(&'static str, JoinHandle<()>)> {
    let (lost, lost_nodes) = mpsc::unbounded_channel();
    let (to_watch, running) = watch::channel(Arc::new(Vec::new()));
    vec![
        ("lease clock", tokio::spawn(lease_clock(life.fleet.clone(), lost))),
        ("reconcile", tokio::spawn(run(life.clone(), lost_nodes, to_watch))),
        ("job queue", tokio::spawn(super::queue::run(life.clone()))),
        ("running jobs' watch", tokio::spawn(watch_running(life, running))),
    ]
}

/// The lease clock: every base interval, expire leases older than `LEASE_INTERVALS` intervals
/// (judged by this process's own continuity, `Fleet::expire`) and hand the lost nodes to the
/// tick's loop. No database work here: a slow database must neither delay an expiry nor look
/// like a pause of the coordinator.
pub async fn lease_clock(fleet: Arc<Fleet>, lost: mpsc::UnboundedSender<String>) {
    let mut tick = tokio::time::interval(fleet.base);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        for node in fleet.expire() {
            if lost.send(node).is_err() {
                return;
            }
        }
    }
}

/// What the tick remembers over a term: when it began, when it first saw each launch
/// launching (a takeover starts that clock afresh rather than trusting another process's
/// timestamps), and the launched jobs it inherited, still waiting for their nodes (`takeover`).
struct Term {
    began: Instant,
    launching: HashMap<(i64, i64), Instant>,
    inherited: Option<HashSet<(i64, i64)>>,
}

/// The reconcile loop, for as long as this coordinator leads.
async fn run(life: Arc<Life>, mut lost: mpsc::UnboundedReceiver<String>, to_watch: watch::Sender<Arc<Vec<JobRecord>>>) {
    let mut tick = tokio::time::interval(life.fleet.base);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut term = Term { began: Instant::now(), launching: HashMap::new(), inherited: None };
    // The notices an earlier leader gave (durable events) are this one's to finish.
    if let Err(e) = life.resume_notices().await {
        tracing::warn!("taking over preemption notices: {e}");
    }
    loop {
        tokio::select! {
            node = lost.recv() => match node {
                Some(node) => life.node_lost(&node).await,
                None => return,
            },
            jobs = life.signals.take_reported() => {
                for id in jobs {
                    if let Err(e) = life.progress(id).await {
                        tracing::warn!(job = id, "progress: {e}");
                    }
                }
            }
            _ = tick.tick() => reconcile(&life, &mut term, &to_watch).await,
            _ = life.recoveries.kicked() => reconcile(&life, &mut term, &to_watch).await,
        }
    }
}

/// One tick: every unfinished job, dispatched by its state.
async fn reconcile(life: &Arc<Life>, term: &mut Term, to_watch: &watch::Sender<Arc<Vec<JobRecord>>>) {
    let jobs = match life.store.unfinished_jobs().await {
        Ok(j) => j,
        Err(e) => return tracing::warn!("reconcile: {e}"),
    };
    let launching: Vec<(i64, i64)> = jobs.iter().filter(|j| j.state == JobState::Launching).map(|j| (j.id, j.generation)).collect();
    term.launching.retain(|k, _| launching.contains(k));
    life.signals.keep_sent(&launching);
    let inherited =
        term.inherited.get_or_insert_with(|| jobs.iter().filter(|j| j.state.is_launched()).map(|j| (j.id, j.generation)).collect());
    inherited.retain(|k| jobs.iter().any(|j| (j.id, j.generation) == *k && j.state.is_launched()));
    // Early in a term (a failover, a restart) agents are still finding this leader.
    let grace = life.fleet.base * GRACE_INTERVALS;
    let settling = term.began.elapsed() < grace;
    let mut queued = false;
    for j in &jobs {
        let key = (j.id, j.generation);
        match j.state {
            JobState::Submitted | JobState::Planning => queued = true,
            JobState::Launching | JobState::Running | JobState::Degraded => {
                if inherited.contains(&key) {
                    match life.taken_over(j, !settling).await {
                        Some(true) => {
                            inherited.remove(&key);
                        }
                        Some(false) => continue, // failed: its node did not come back
                        None => {}               // still waiting for its nodes; the step runs meanwhile
                    }
                }
                let since = (j.state == JobState::Launching).then(|| *term.launching.entry(key).or_insert_with(Instant::now));
                if let Err(e) = life.step(j, since).await {
                    tracing::warn!(job = j.id, "step: {e}");
                }
            }
            JobState::Recovering => {
                // A recovery planned now would see no live node: wait, up to the grace, for
                // the job's nodes to come back.
                if settling && crate::planning::missing_nodes(&life.store, &life.fleet, j).await.is_ok_and(|m| !m.is_empty()) {
                    continue;
                }
                if life.recoveries.begin(j.id) {
                    let (life, j) = (life.clone(), j.clone());
                    tokio::spawn(async move {
                        let id = j.id;
                        if let Err(e) = life.recover(j).await {
                            // The database, say: the next tick starts the recovery again.
                            tracing::warn!(job = id, "recovery: {e}");
                        }
                        life.recoveries.end(id);
                    });
                }
            }
            _ => {}
        }
    }
    if queued {
        life.signals.kick_queue();
    }
    // The newest list wins: a watch still busy with an older one looks at this one next.
    let _ = to_watch.send(Arc::new(jobs));
}

/// The running jobs' watch: for every list of jobs the tick hands it, the preemption notices in
/// flight (`notice`), scale-up (`scale`) and re-plans on changed links (`network`). A worker
/// of the tick: it may run the solver, so it runs beside the tick rather than in it.
async fn watch_running(life: Arc<Life>, mut running: watch::Receiver<Arc<Vec<JobRecord>>>) {
    while running.changed().await.is_ok() {
        let jobs = running.borrow_and_update().clone();
        life.check_notices().await;
        if let Err(e) = life.scale_up(&jobs).await {
            tracing::warn!("scale-up: {e}");
        }
        if let Err(e) = life.watch_networks(&jobs).await {
            tracing::warn!("network: {e}");
        }
    }
}
