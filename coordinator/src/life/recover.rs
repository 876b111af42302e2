//! Elastic recovery (docs/recovery.md). When a launched job loses a node (its lease
//! ends, or an operator drains it) or a rank fails, and the job has budget left
//! (`max_preemptions`, `max_restarts`, counted apart), it moves to `recovering` in one
//! transaction with the budget it spends. Then one task of the leader per recovering job:
//!
//! 1. stops what is left of the old launch (its GPUs come back);
//! 2. waits while no GPU it may use is free on a live node (every node lost or drained at
//!    once, up to `PINNED_WAIT_INTERVALS`; event `recovery_waiting`), then plans the job
//!    again on what it can use now, the plan it replaces seeding the search
//!    (`planning::plan_for_recovery`); an event `plan` says why when GPUs it may use stay idle;
//! 3. picks the newest checkpoint step whose every file can be read now (the bitmap);
//! 4. plans the restore (`restore_plan`: local reads first, peers, each missing byte from the
//!    cloud once) and sends each node of the new plan its `Restore`; event `recovery_planned`;
//! 5. waits for every node's `RestoreResult`: a node of the new plan lost meanwhile, or a
//!    restore that failed, starts again from 2 (at most `ATTEMPTS` times);
//! 6. launches the next generation from the restored step (`MOTLEY_CKPT_RESTORE_STEP`, the
//!    agents point MOTLEY_CKPT_RESTORE at what they restored); event `recovery_done`.
//!
//! Nothing of a recovery in flight is durable but the job's state: a new leader finds the job
//! `recovering` and starts at 1; agents keep the files they restored that verify, so the
//! second restore skips them.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use motley_proto::v1::{instruction, Instruction, RestoreResult};
use serde_json::json;

use super::Life;
use crate::agents::launch;
use crate::error::{CoordinatorError, Result};
use crate::job::spec::JobSpec;
use crate::job::JobState;
use crate::planning::restore_plan::{self, Mode, NodeInfo, StepChoice};
use crate::state::fleet::Fleet;
use crate::state::signals::JobSignals;
use crate::store::{JobRecord, Store};

/// The recovery room's memory: the jobs this leader's recovery tasks work on, the launches
/// with a failed rank (classified after one lease), the restore requests numbered, and the
/// wake-up of the reconcile tick when one begins.
pub struct Recoveries {
    in_flight: Mutex<HashSet<i64>>,
    failed_ranks: Mutex<HashMap<(i64, i64), Instant>>,
    /// The last restore request number handed out (see `Restore.request`).
    requests: AtomicI64,
    kick: tokio::sync::Notify,
}

impl Default for Recoveries {
    fn default() -> Recoveries {
        Recoveries {
            in_flight: Mutex::default(),
            failed_ranks: Mutex::default(),
            // Unique across leaders: a new leader's numbers start past the old one's.
            requests: AtomicI64::new(crate::store::now_ms() * 1000),
            kick: tokio::sync::Notify::new(),
        }
    }
}

impl Recoveries {
    /// A recovery began: start its task now rather than at the next interval.
    pub fn kick(&self) {
        self.kick.notify_one();
    }

    pub(super) async fn kicked(&self) {
        self.kick.notified().await
    }

    /// True if no task of this leader works on job `id` yet; it does from now on.
    pub(super) fn begin(&self, id: i64) -> bool {
        self.in_flight.lock().expect("recovering").insert(id)
    }

    pub(super) fn end(&self, id: i64) {
        self.in_flight.lock().expect("recovering").remove(&id);
    }

    /// When a failed rank of launch `key` was first seen (now, if this is the first time).
    pub(super) fn rank_failed_since(&self, key: (i64, i64)) -> Instant {
        *self.failed_ranks.lock().expect("failed ranks").entry(key).or_insert_with(Instant::now)
    }

    pub(super) fn forget_failed_rank(&self, key: (i64, i64)) {
        self.failed_ranks.lock().expect("failed ranks").remove(&key);
    }

    fn next_request(&self) -> i64 {
        self.requests.fetch_add(1, Ordering::SeqCst) + 1
    }
}

/// Plans and restores one recovery tries before the job fails.
pub const ATTEMPTS: u32 = 3;
/// Base intervals the old launch's ranks get to stop before the recovery plans without them.
pub const STOP_INTERVALS: u32 = 10;
/// Base intervals a recovery waits for the nodes its pinned plan names before it fails: a
/// spot node that vanished comes back (docs/recovery.md, "A pinned plan's nodes").
pub const PINNED_WAIT_INTERVALS: u32 = 120;

impl Life {
    /// One recovery, from the old launch's stop to the next launch (or the job's failure).
    pub(super) async fn recover(&self, job: JobRecord) -> Result<()> {
        let (store, fleet) = (&self.store, &*self.fleet);
        let began = Instant::now();
        let (id, old) = (job.id, job.generation);
        let next = old + 1;
        let spec: JobSpec = serde_json::from_str(&job.spec).map_err(|e| CoordinatorError::Conflict(format!("stored job spec: {e}")))?;
        launch::stop_job(store, fleet, &self.signals, id, old, "the job is recovering").await;
        wait_stopped(store, fleet, id, old).await?;
        self.facts.forget_restores(id);
        let mut last_error = String::new();
        for attempt in 1..=ATTEMPTS {
            if store.job(id).await?.state != JobState::Recovering {
                return Ok(()); // cancelled, or another leader moved it
            }
            let gone = self.wait_for_pinned_nodes(&job, &spec).await?;
            if store.job(id).await?.state != JobState::Recovering {
                return Ok(());
            }
            if !gone.is_empty() {
                let why = format!(
                    "recovery: the pinned plan's node(s) {} did not come back within {} s; bring them back and submit the job \
                     again, or remove plan: to let the planner use what is there",
                    gone.join(", "),
                    (fleet.base * PINNED_WAIT_INTERVALS).as_secs()
                );
                return fail(store, fleet, &self.signals, id, old, &why).await;
            }
            self.wait_for_free_gpus(&job).await?;
            if store.job(id).await?.state != JobState::Recovering {
                return Ok(());
            }
            let jobs = store.unfinished_jobs().await?;
            let taken = crate::planning::taken(store, fleet, &jobs).await?;
            let (plan, ranks) = match crate::planning::plan_for_recovery(store, fleet, &job, &taken).await {
                Ok(p) => {
                    if let Some(why) = &p.fewer_gpus {
                        store.record_event(Some(id), Some(old), "plan", why).await?;
                    }
                    (p.plan, p.ranks)
                }
                Err(e @ CoordinatorError::Database(_)) => return Err(e),
                Err(e) => return fail(store, fleet, &self.signals, id, old, &format!("recovery cannot re-plan the job: {e}")).await,
            };
            let holdings = store.holdings(id).await?;
            let live = |n: &str| fleet.live(n);
            let (step, files) = match restore_plan::choose_step(&holdings, &live) {
                StepChoice::Restore { step, generation, files } => (Some((step, generation)), files),
                StepChoice::Fresh => (None, vec![]),
                StepChoice::Lost(why) => return fail(store, fleet, &self.signals, id, old, &format!("recovery: {why}")).await,
            };
            let Some((step, source_generation)) = step else {
                store
                    .record_event(Some(id), Some(old), "recovery_planned", "no checkpoint was reported: the job starts over from step 0")
                    .await?;
                return self.relaunch(id, &plan, &ranks, None, began, 0.0).await;
            };
            let doc =
                motley_contract::PlanDocument::from_json(&plan).map_err(|e| CoordinatorError::Conflict(format!("the new plan: {e}")))?;
            let built = restore_plan::needs(&files, &doc.placements()).and_then(|needs| {
                let nodes: BTreeMap<String, NodeInfo> = self.node_infos(&files, &needs);
                let s = &self.settings;
                // Where the job's launches uploaded (`launch::dispatch`): this cluster's prefix.
                let cloud = store.cluster().checkpoint_cloud(&spec, id).unwrap_or_default();
                restore_plan::build(id, next, step, &files, &needs, &nodes, s.cloud_egress_mb_s, &cloud, s.mode, 0)
            });
            let mut built = match built {
                Ok(b) => b,
                Err(e) => return fail(store, fleet, &self.signals, id, old, &format!("recovery cannot restore step {step}: {e}")).await,
            };
            // The restore may take what its schedule says, several times over (fetches retried from
            // other holders, slow disks), and at least a minute.
            let expected = match self.settings.mode {
                Mode::Planned => built.plan.makespan_s,
                Mode::CloudOnly => built.plan.cloud_only_s,
            };
            let timeout = restore_timeout(fleet, expected);
            for r in built.restores.values_mut() {
                r.timeout_s = timeout.as_secs() as u32;
                if let Some(key) = &self.settings.data_plane_key {
                    super::capabilities::grant(r, key, motley_server::capability::now_unix_s())?;
                }
            }
            let p = &built.plan;
            let planned = json!({
                "step": step,
                "lower_bound_s": p.lower_bound_s,
                "makespan_s": p.makespan_s,
                "cloud_only_s": p.cloud_only_s,
                "bottleneck": p.bottleneck,
                "bytes": {"local": p.bytes.local, "peer": p.bytes.peer, "cloud": p.bytes.cloud},
                "nodes": built.restores.keys().collect::<Vec<_>>(),
                "attempt": attempt,
            });
            store.record_event(Some(id), Some(old), "recovery_planned", &planned.to_string()).await?;
            // A retry asks again under the same generation: the last attempt's results are not this one's.
            self.facts.forget_restores(id);
            let request = self.recoveries.next_request();
            for r in built.restores.values_mut() {
                r.request = request;
            }
            let mut sent = true;
            for (node, r) in &built.restores {
                sent &= fleet.send(node, Instruction { kind: Some(instruction::Kind::Restore(r.clone())) });
            }
            let outcome = if sent {
                self.wait_restored(id, next, request, built.restores.keys().cloned().collect(), timeout).await
            } else {
                Waited::NodeGone
            };
            match outcome {
                Waited::Done(results) => {
                    let transfer_s = results.iter().map(|r| r.transfer_s).fold(0.0, f64::max);
                    return self.relaunch(id, &plan, &ranks, Some(((step, source_generation), &results)), began, transfer_s).await;
                }
                Waited::NodeGone => last_error = "a node of the new plan left during the restore".into(),
                Waited::Failed(node, e) => last_error = format!("node {node}: {e}"),
                Waited::TimedOut(nodes) => last_error = format!("no restore result from {} in time", nodes.join(", ")),
            }
            tracing::warn!(job = id, attempt, "restore failed: {last_error}; planning again");
            store.record_event(Some(id), Some(old), "recovery_retry", &format!("attempt {attempt}: {last_error}")).await?;
        }
        fail(store, fleet, &self.signals, id, old, &format!("recovery failed {ATTEMPTS} times; last: {last_error}")).await
    }
}

impl Life {
    /// The nodes of the job's pinned plan (`plan:`) that are not live: waited for, up to
    /// `PINNED_WAIT_INTERVALS` base intervals, said once in an event `recovery_waiting`.
    /// Returns those still missing then (none once all are back, or for a job the planner plans).
    async fn wait_for_pinned_nodes(&self, job: &JobRecord, spec: &JobSpec) -> Result<Vec<String>> {
        let Some(plan) = &spec.plan else { return Ok(vec![]) };
        let fleet = &self.fleet;
        let nodes: std::collections::BTreeSet<&str> =
            plan.replicas.iter().flat_map(|r| &r.stages).flat_map(|s| &s.gpus).map(|g| g.node.as_str()).collect();
        let missing = || nodes.iter().filter(|n| !fleet.live(n)).map(|n| n.to_string()).collect::<Vec<_>>();
        let mut gone = missing();
        if gone.is_empty() {
            return Ok(gone);
        }
        let wait = fleet.base * PINNED_WAIT_INTERVALS;
        let note = format!("the pinned plan's node(s) {} are not live: waiting up to {} s for them", gone.join(", "), wait.as_secs());
        self.store.record_event(Some(job.id), Some(job.generation), "recovery_waiting", &note).await?;
        let until = Instant::now() + wait;
        while !gone.is_empty() && Instant::now() < until {
            if self.store.job(job.id).await?.state != JobState::Recovering {
                return Ok(vec![]); // cancelled, or another leader moved it: the caller looks again
            }
            tokio::time::sleep(fleet.base).await;
            gone = missing();
        }
        Ok(gone)
    }

    /// Wait, up to `PINNED_WAIT_INTERVALS` base intervals, while no GPU the job may use is free on a
    /// live node (every node of the job lost or drained at once: a whole allocation preempted,
    /// docs/slurm.md), said once in an event `recovery_waiting`. The job keeps its checkpoints
    /// and resumes from them on whatever comes back; still nothing then, the re-plan fails it
    /// as before ("nothing to recover onto"). The clock starts once the old launch's nodes are
    /// gone: drained nodes still live are uploading the step the job resumes from, which may
    /// take longer than the wait.
    async fn wait_for_free_gpus(&self, job: &JobRecord) -> Result<()> {
        let (store, fleet) = (&self.store, &*self.fleet);
        let free = || async {
            let jobs = store.unfinished_jobs().await?;
            let taken = crate::planning::taken(store, fleet, &jobs).await?;
            crate::planning::free_for_recovery(store, fleet, job, &taken).await
        };
        if free().await? > 0 {
            return Ok(());
        }
        let wait = fleet.base * PINNED_WAIT_INTERVALS;
        let note = format!(
            "no free GPU on a live node (its nodes are lost or drained): waiting for nodes, up to {} s once its drained nodes are gone",
            wait.as_secs()
        );
        store.record_event(Some(job.id), Some(job.generation), "recovery_waiting", &note).await?;
        let old: std::collections::BTreeSet<String> =
            store.ranks(job.id, job.generation).await?.into_iter().map(|r| r.assignment.node).collect();
        let mut until = Instant::now() + wait;
        while Instant::now() < until {
            if store.job(job.id).await?.state != JobState::Recovering {
                return Ok(());
            }
            tokio::time::sleep(fleet.base).await;
            if free().await? > 0 {
                return Ok(());
            }
            if old.iter().any(|n| fleet.live(n)) {
                until = Instant::now() + wait;
            }
        }
        Ok(())
    }

    /// The rates and data planes of the nodes a restore involves.
    fn node_infos(&self, files: &[crate::store::Holding], needs: &BTreeMap<String, restore_plan::NodeNeeds>) -> BTreeMap<String, NodeInfo> {
        let fleet = &self.fleet;
        let mut names: Vec<&String> = needs.keys().collect();
        names.extend(files.iter().filter(|h| h.tier != "cloud").map(|h| &h.node));
        names.into_iter().filter(|n| fleet.live(n)).filter_map(|n| self.facts.node(n).map(|i| (n.clone(), i))).collect()
    }

    /// Wait for every node's result of restore `generation`.
    async fn wait_restored(&self, id: i64, generation: i64, request: i64, nodes: Vec<String>, timeout: Duration) -> Waited {
        let fleet = &self.fleet;
        // The agents' own deadline first, then a few intervals for their report.
        let until = Instant::now() + timeout + fleet.base * 10;
        loop {
            let changed = self.facts.changed();
            let mut done = vec![];
            let mut missing = vec![];
            for n in &nodes {
                // An earlier attempt's answer is not this one's.
                match self.facts.restore(id, generation, n).filter(|r| r.request == request) {
                    Some(r) if !r.error.is_empty() => return Waited::Failed(n.clone(), r.error),
                    Some(r) => done.push(r),
                    None if !fleet.live(n) => return Waited::NodeGone,
                    None => missing.push(n.clone()),
                }
            }
            if missing.is_empty() {
                return Waited::Done(done);
            }
            if Instant::now() >= until {
                return Waited::TimedOut(missing);
            }
            let _ = tokio::time::timeout(fleet.base, changed).await;
        }
    }

    /// The next launch, from `restored` (the step, the generation that wrote it, and every
    /// node's result) when there is one.
    #[allow(clippy::too_many_arguments)]
    async fn relaunch(
        &self,
        id: i64,
        plan: &str,
        ranks: &[crate::store::RankAssignment],
        restored: Option<((i64, i64), &[RestoreResult])>,
        began: Instant,
        transfer_s: f64,
    ) -> Result<()> {
        let (store, fleet) = (&self.store, &self.fleet);
        let generation = store.start_generation_from(id, plan, ranks, restored.map(|(s, _)| s)).await?;
        self.note_launch(id, generation).await;
        let (mut local, mut peer, mut cloud, mut repaired, mut skipped) = (0, 0, 0, vec![], 0);
        for r in restored.map(|(_, r)| r).unwrap_or_default() {
            (local, peer, cloud) = (local + r.local_bytes, peer + r.peer_bytes, cloud + r.cloud_bytes);
            repaired.extend(r.repaired.iter().cloned());
            skipped += r.skipped;
        }
        let done = json!({
            "step": restored.map(|((s, _), _)| s),
            "source_generation": restored.map(|((_, g), _)| g),
            "transfer_s": transfer_s,
            "total_s": began.elapsed().as_secs_f64(),
            "bytes": {"local": local, "peer": peer, "cloud": cloud},
            "repaired": repaired,
            // Files already in place that verified (a restore resumed after a failover).
            "skipped": skipped,
        });
        store.record_event(Some(id), Some(generation), "recovery_done", &done.to_string()).await?;
        self.facts.forget_restores(id);
        launch::send_out(store, fleet, &self.signals, id, generation).await
    }
}

/// How long a restore whose schedule takes `expected_s` may take: 4 times that plus 10 base
/// intervals, at least a minute, at most a day.
fn restore_timeout(fleet: &Fleet, expected_s: f64) -> Duration {
    let s = if expected_s.is_finite() { expected_s.max(0.0) } else { 86_400.0 };
    (Duration::from_secs_f64(4.0 * s) + fleet.base * 10).clamp(Duration::from_secs(60), Duration::from_secs(86_400))
}

/// Wait until no rank of the old launch is reported running on a live node, or
/// `STOP_INTERVALS` passed (a rank on a node that stopped answering cannot hold us).
async fn wait_stopped(store: &Store, fleet: &Fleet, id: i64, generation: i64) -> Result<()> {
    let until = Instant::now() + fleet.base * STOP_INTERVALS;
    while Instant::now() < until {
        let ranks = store.ranks(id, generation).await?;
        if !ranks.iter().any(|r| r.state == "running" && fleet.live(&r.assignment.node)) {
            return Ok(());
        }
        tokio::time::sleep(fleet.base / 2).await;
    }
    Ok(())
}

enum Waited {
    Done(Vec<RestoreResult>),
    NodeGone,
    Failed(String, String),
    TimedOut(Vec<String>),
}

async fn fail(store: &Store, fleet: &Fleet, signals: &JobSignals, id: i64, generation: i64, reason: &str) -> Result<()> {
    tracing::warn!(job = id, "{reason}");
    launch::fail(store, fleet, signals, id, generation, reason).await;
    Ok(())
}
