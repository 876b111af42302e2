//! Elastic recovery (issue 15; docs/recovery.md). When a launched job loses a node (its lease
//! ends, or an operator drains it) or a rank fails, and the job has budget left
//! (`max_preemptions`, `max_restarts`, counted apart), it moves to `recovering` in one
//! transaction with the budget it spends. Then one task of the leader per recovering job:
//!
//! 1. stops what is left of the old launch (its GPUs come back);
//! 2. plans the job again on what it can use now (`control::plan_for_recovery`);
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
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use motley_proto::v1::{instruction, Instruction, RestoreResult};
use serde_json::json;

use crate::error::{CoordinatorError, Result};
use crate::fleet::Fleet;
use crate::job::JobState;
use crate::jobspec::JobSpec;
use crate::restore_plan::{self, Mode, NodeInfo, StepChoice};
use crate::store::{JobRecord, RecoveryCause, Store};

/// The launch environment variable naming the step a recovery's ranks resume from.
pub const RESTORE_STEP_ENV: &str = "MOTLEY_CKPT_RESTORE_STEP";

/// Plans and restores one recovery tries before the job fails.
pub const ATTEMPTS: u32 = 3;
/// Base intervals the old launch's ranks get to stop before the recovery plans without them.
pub const STOP_INTERVALS: u32 = 10;

/// What recoveries share with the agents' sessions: each node's data plane and rates, the
/// restores agents reported, and the jobs a task is recovering now. In memory only.
pub struct Restores {
    nodes: Mutex<HashMap<String, NodeInfo>>,
    results: Mutex<HashMap<(i64, i64, String), RestoreResult>>,
    changed: tokio::sync::Notify,
    kick: tokio::sync::Notify,
    active: Mutex<HashSet<i64>>,
    settings: Mutex<Settings>,
    /// Launches with a failed rank, and when it was first seen: classified after one lease.
    failed_ranks: Mutex<HashMap<(i64, i64), Instant>>,
    /// The last restore request number handed out (see `Restore.request`).
    requests: std::sync::atomic::AtomicI64,
    /// Per running launch: the live nodes it could use when first seen, and, once more are
    /// live, the newest complete checkpoint step then (it scales up at the next one).
    scale: Mutex<HashMap<(i64, i64), ScaleSeen>>,
}

/// A running launch's live nodes when first seen, and the newest complete step when more were.
type ScaleSeen = (usize, Option<i64>);

/// The coordinator's recovery settings (flags).
#[derive(Debug, Clone, Copy)]
pub struct Settings {
    /// The object store's egress, shared by all nodes (MB/s): the restore planner's cloud rate.
    pub cloud_egress_mb_s: f64,
    pub mode: Mode,
}

impl Default for Settings {
    fn default() -> Settings {
        Settings { cloud_egress_mb_s: 1200.0, mode: Mode::Planned }
    }
}

impl Default for Restores {
    fn default() -> Restores {
        Restores {
            nodes: Mutex::default(),
            results: Mutex::default(),
            changed: tokio::sync::Notify::new(),
            kick: tokio::sync::Notify::new(),
            active: Mutex::default(),
            settings: Mutex::new(Settings::default()),
            failed_ranks: Mutex::default(),
            scale: Mutex::default(),
            // Unique across leaders: a new leader's numbers start past the old one's.
            requests: std::sync::atomic::AtomicI64::new(crate::store::now_ms() * 1000),
        }
    }
}

impl Restores {
    pub fn configure(&self, s: Settings) {
        *self.settings.lock().expect("settings") = s;
    }

    fn settings(&self) -> Settings {
        *self.settings.lock().expect("settings")
    }

    /// A registration told the node's data plane and rates.
    pub fn set_node(&self, node: &str, info: NodeInfo) {
        self.nodes.lock().expect("nodes").insert(node.to_string(), info);
    }

    /// An agent reported how a restore ended.
    pub fn reported(&self, node: &str, r: RestoreResult) {
        self.results.lock().expect("results").insert((r.job, r.generation, node.to_string()), r);
        self.changed.notify_waiters();
    }

    fn result(&self, job: i64, generation: i64, node: &str) -> Option<RestoreResult> {
        self.results.lock().expect("results").get(&(job, generation, node.to_string())).cloned()
    }

    fn forget(&self, job: i64) {
        self.results.lock().expect("results").retain(|(j, _, _), _| *j != job);
    }

    fn info(&self, node: &str) -> Option<NodeInfo> {
        self.nodes.lock().expect("nodes").get(node).cloned()
    }
}

/// Recover launched job `job` if it checkpoints and has `cause`'s budget left: true if it is
/// now `recovering` (by this call or another), false if the caller should fail it.
pub async fn try_recover(store: &Store, fleet: &Fleet, job: &JobRecord, cause: RecoveryCause, reason: &str) -> bool {
    let Ok(spec) = serde_json::from_str::<JobSpec>(&job.spec) else { return false };
    let budget = match cause {
        RecoveryCause::Preemption => spec.max_preemptions,
        RecoveryCause::Restart => spec.max_restarts,
        RecoveryCause::ScaleUp => 1, // spends nothing (see `scale_up`)
    };
    if spec.checkpoint.is_none() || budget == 0 {
        return false;
    }
    match store.begin_recovery(job.id, job.generation, cause, budget, reason).await {
        Ok(_) => {
            tracing::warn!(job = job.id, "recovering: {reason}");
            crate::lifecycle::stop_job(store, fleet, job.id, job.generation, reason).await;
            fleet.restores.kick.notify_one();
            true
        }
        Err(e) => {
            tracing::info!(job = job.id, "no recovery: {e}");
            store.job(job.id).await.is_ok_and(|j| j.state == JobState::Recovering)
        }
    }
}

/// A rank of launched `job` failed. A node that vanishes makes its peers' collectives fail
/// before its lease ends, so a job that could recover from a lost node waits one lease (the
/// lease watcher's `node_leaving` moves it first if a node of the launch is lost meanwhile);
/// then the failure spends a restart, or fails the job. Called on every look at the job.
pub async fn rank_failed(store: &Store, fleet: &Fleet, job: &JobRecord, reason: &str) {
    let preemptible = serde_json::from_str::<JobSpec>(&job.spec).is_ok_and(|s| s.checkpoint.is_some() && s.max_preemptions > 0);
    if preemptible {
        let first = *fleet.restores.failed_ranks.lock().expect("failed ranks").entry((job.id, job.generation)).or_insert_with(Instant::now);
        if first.elapsed() <= fleet.base * (crate::fleet::LEASE_INTERVALS + 1) {
            return; // the job queue looks again next interval
        }
    }
    fleet.restores.failed_ranks.lock().expect("failed ranks").remove(&(job.id, job.generation));
    if !try_recover(store, fleet, job, RecoveryCause::Restart, reason).await {
        crate::lifecycle::fail(store, fleet, job.id, job.generation, reason).await;
    }
}

/// A node is leaving (its lease ended, `lost`; or it is draining): every launched job with
/// ranks there recovers if it can; a lost node's others fail, a draining node's keep running.
/// A drain with a `deadline` asks each job to save first (`notice::give`) where it can.
pub async fn node_leaving(store: &Store, fleet: &Fleet, node: &str, reason: &str, lost: bool, deadline: Option<Duration>) {
    let jobs = match store.unfinished_jobs().await {
        Ok(j) => j,
        Err(e) => return tracing::warn!(node, "cannot read the jobs of a leaving node: {e}"),
    };
    for j in jobs.into_iter().filter(|j| matches!(j.state, JobState::Launching | JobState::Running)) {
        let on_node = store.ranks(j.id, j.generation).await.is_ok_and(|r| r.iter().any(|r| r.assignment.node == node));
        if !on_node {
            continue;
        }
        if let Some(d) = deadline.filter(|_| !lost) {
            if crate::notice::give(store, fleet, &j, node, d).await {
                continue; // recovers once its ranks saved, or at the deadline (`notice::check`)
            }
        }
        if !try_recover(store, fleet, &j, RecoveryCause::Preemption, reason).await && lost {
            crate::lifecycle::fail(store, fleet, j.id, j.generation, reason).await;
        }
    }
    // A recovering job whose restore waits on this node re-plans (its task watches liveness).
    fleet.restores.changed.notify_waiters();
}

/// For as long as this coordinator leads: start a task for every `recovering` job that has none
/// (a new leader's included), every base interval and whenever a recovery begins.
pub async fn run(store: Store, fleet: Arc<Fleet>) {
    let mut tick = tokio::time::interval(fleet.base);
    let began = Instant::now();
    // The notices an earlier leader gave (durable events) are this one's to finish.
    if let Err(e) = crate::notice::resume(&store, &fleet).await {
        tracing::warn!("taking over preemption notices: {e}");
    }
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = fleet.restores.kick.notified() => {}
        }
        let jobs = match store.unfinished_jobs().await {
            Ok(j) => j,
            Err(e) => {
                tracing::warn!("recovery: {e}");
                continue;
            }
        };
        crate::notice::check(&store, &fleet).await;
        if let Err(e) = scale_up(&store, &fleet, &jobs).await {
            tracing::warn!("scale-up: {e}");
        }
        // Early in a term (a failover, a restart) agents are still finding this leader: a
        // recovery planned now would see no live node. Wait, up to the takeover's grace, for the
        // job's nodes to come back.
        let settling = began.elapsed() < fleet.base * crate::takeover::GRACE_INTERVALS;
        for j in jobs.into_iter().filter(|j| j.state == JobState::Recovering) {
            if settling && crate::control::missing_nodes(&store, &fleet, &j).await.is_ok_and(|m| !m.is_empty()) {
                continue;
            }
            if !fleet.restores.active.lock().expect("active").insert(j.id) {
                continue;
            }
            let (store, fleet) = (store.clone(), fleet.clone());
            tokio::spawn(async move {
                let id = j.id;
                if let Err(e) = recover(&store, &fleet, j).await {
                    // The database, say: the next pass starts the recovery again.
                    tracing::warn!(job = id, "recovery: {e}");
                }
                fleet.restores.active.lock().expect("active").remove(&id);
            });
        }
    }
}

/// Nodes that come back (or are added) take a running job up at its next checkpoint: once more
/// live nodes are within its resources than when its launch was first seen, and at the next
/// complete checkpoint step the planner would give it more GPUs than it has, it moves to
/// `recovering` (spending no budget), and the recovery plans it onto what it can use then and
/// restores that step.
async fn scale_up(store: &Store, fleet: &Fleet, jobs: &[JobRecord]) -> Result<()> {
    let running: Vec<&JobRecord> = jobs.iter().filter(|j| j.state == JobState::Running).collect();
    {
        let launched = jobs.iter().filter(|j| matches!(j.state, JobState::Launching | JobState::Running));
        let keep: HashSet<(i64, i64)> = launched.map(|j| (j.id, j.generation)).collect();
        fleet.restores.scale.lock().expect("scale").retain(|k, _| keep.contains(k));
    }
    if running.is_empty() {
        return Ok(());
    }
    let nodes = store.nodes().await?;
    for j in running {
        let Ok(spec) = serde_json::from_str::<JobSpec>(&j.spec) else { continue };
        if spec.checkpoint.is_none() || spec.plan.is_some() {
            continue; // nothing to resume from, or a plan the job carries (never re-planned)
        }
        let live = usable_nodes(&nodes, fleet, &spec);
        let key = (j.id, j.generation);
        let seen = *fleet.restores.scale.lock().expect("scale").entry(key).or_insert((live, None));
        if live < seen.0 {
            fleet.restores.scale.lock().expect("scale").insert(key, (live, None));
            continue;
        }
        if live == seen.0 {
            continue;
        }
        let ranks = store.ranks(j.id, j.generation).await?;
        if spec.resources.gpus.is_some_and(|g| ranks.len() as u32 >= g) {
            continue; // already at its GPU budget
        }
        let newest = crate::checkpoints::newest_complete(store, j.id).await?;
        match seen.1 {
            None => {
                fleet.restores.scale.lock().expect("scale").insert(key, (seen.0, Some(newest)));
            }
            Some(then) if newest > then => {
                // Only if the planner would use more GPUs now: otherwise the restart buys nothing,
                // and the launch's node count is what it is compared with from here on.
                let taken = crate::scheduler::taken(store, fleet, jobs).await?;
                let more = match crate::control::plan_for_recovery(store, fleet, j, &taken).await {
                    Ok((_, new_ranks)) => {
                        if new_ranks.len() <= ranks.len() {
                            tracing::info!(
                                job = j.id,
                                "no scale-up: with {live} live nodes the planner gives it {} GPUs, it has {}",
                                new_ranks.len(),
                                ranks.len()
                            );
                        }
                        new_ranks.len() > ranks.len()
                    }
                    Err(e) => {
                        tracing::info!(job = j.id, "no scale-up: {e}");
                        false
                    }
                };
                if !more {
                    fleet.restores.scale.lock().expect("scale").insert(key, (live, None));
                    continue;
                }
                let reason =
                    format!("{} live nodes can take it (it was launched when {} were); scaling up from step {newest}", live, seen.0);
                if store.begin_recovery(j.id, j.generation, RecoveryCause::ScaleUp, 0, &reason).await.is_ok() {
                    tracing::info!(job = j.id, "{reason}");
                    crate::lifecycle::stop_job(store, fleet, j.id, j.generation, "scaling up").await;
                    fleet.restores.kick.notify_one();
                }
            }
            Some(_) => {}
        }
    }
    Ok(())
}

/// Live, active nodes within the job's resources.
fn usable_nodes(nodes: &[crate::store::NodeRecord], fleet: &Fleet, spec: &JobSpec) -> usize {
    let mine = |n: &str| spec.resources.nodes.is_empty() || spec.resources.nodes.iter().any(|m| m == n);
    nodes.iter().filter(|n| n.state == crate::store::NodeState::Active && mine(&n.name) && fleet.live(&n.name)).count()
}

/// A launch was planned: remember how many nodes it could use then (`scale_up` compares).
pub async fn note_launch(store: &Store, fleet: &Fleet, id: i64, generation: i64) {
    let (Ok(job), Ok(nodes)) = (store.job(id).await, store.nodes().await) else { return };
    let Ok(spec) = serde_json::from_str::<JobSpec>(&job.spec) else { return };
    let live = usable_nodes(&nodes, fleet, &spec);
    fleet.restores.scale.lock().expect("scale").insert((id, generation), (live, None));
}

/// One recovery, from the old launch's stop to the next launch (or the job's failure).
async fn recover(store: &Store, fleet: &Fleet, job: JobRecord) -> Result<()> {
    let began = Instant::now();
    let (id, old) = (job.id, job.generation);
    let next = old + 1;
    let spec: JobSpec = serde_json::from_str(&job.spec).map_err(|e| CoordinatorError::Conflict(format!("stored job spec: {e}")))?;
    crate::lifecycle::stop_job(store, fleet, id, old, "the job is recovering").await;
    wait_stopped(store, fleet, id, old).await?;
    fleet.restores.forget(id);
    let mut last_error = String::new();
    for attempt in 1..=ATTEMPTS {
        if store.job(id).await?.state != JobState::Recovering {
            return Ok(()); // cancelled, or another leader moved it
        }
        let jobs = store.unfinished_jobs().await?;
        let taken = crate::scheduler::taken(store, fleet, &jobs).await?;
        let (plan, ranks) = match crate::control::plan_for_recovery(store, fleet, &job, &taken).await {
            Ok(p) => p,
            Err(e @ CoordinatorError::Database(_)) => return Err(e),
            Err(e) => return fail(store, fleet, id, old, &format!("recovery cannot re-plan the job: {e}")).await,
        };
        let holdings = store.holdings(id).await?;
        let live = |n: &str| fleet.live(n);
        let (step, files) = match restore_plan::choose_step(&holdings, &live) {
            StepChoice::Restore { step, files } => (Some(step), files),
            StepChoice::Fresh => (None, vec![]),
            StepChoice::Lost(why) => return fail(store, fleet, id, old, &format!("recovery: {why}")).await,
        };
        let Some(step) = step else {
            store
                .record_event(Some(id), Some(old), "recovery_planned", "no checkpoint was reported: the job starts over from step 0")
                .await?;
            return launch(store, fleet, id, &plan, &ranks, None, began, 0.0).await;
        };
        let doc = motley_contract::PlanDocument::from_json(&plan).map_err(|e| CoordinatorError::Conflict(format!("the new plan: {e}")))?;
        let built = restore_plan::needs(&files, &doc.placements()).and_then(|needs| {
            let nodes: BTreeMap<String, NodeInfo> = fleet_nodes(fleet, &files, &needs);
            let s = fleet.restores.settings();
            let cloud = spec.checkpoint.as_ref().and_then(|c| c.cloud.clone()).unwrap_or_default();
            restore_plan::build(id, next, step, &files, &needs, &nodes, s.cloud_egress_mb_s, &cloud, s.mode, 0)
        });
        let mut built = match built {
            Ok(b) => b,
            Err(e) => return fail(store, fleet, id, old, &format!("recovery cannot restore step {step}: {e}")).await,
        };
        // The restore may take what its schedule says, several times over (fetches retried from
        // other holders, slow disks), and at least a minute.
        let expected = match fleet.restores.settings().mode {
            Mode::Planned => built.plan.makespan_s,
            Mode::CloudOnly => built.plan.cloud_only_s,
        };
        let timeout = restore_timeout(fleet, expected);
        for r in built.restores.values_mut() {
            r.timeout_s = timeout.as_secs() as u32;
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
        fleet.restores.forget(id);
        let request = fleet.restores.requests.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
        for r in built.restores.values_mut() {
            r.request = request;
        }
        let mut sent = true;
        for (node, r) in &built.restores {
            sent &= fleet.send(node, Instruction { kind: Some(instruction::Kind::Restore(r.clone())) });
        }
        let outcome = if sent {
            wait_restored(fleet, id, next, request, built.restores.keys().cloned().collect(), timeout).await
        } else {
            Waited::NodeGone
        };
        match outcome {
            Waited::Done(results) => {
                let transfer_s = results.iter().map(|r| r.transfer_s).fold(0.0, f64::max);
                return launch(store, fleet, id, &plan, &ranks, Some((step, &results)), began, transfer_s).await;
            }
            Waited::NodeGone => last_error = "a node of the new plan left during the restore".into(),
            Waited::Failed(node, e) => last_error = format!("node {node}: {e}"),
            Waited::TimedOut(nodes) => last_error = format!("no restore result from {} in time", nodes.join(", ")),
        }
        tracing::warn!(job = id, attempt, "restore failed: {last_error}; planning again");
        store.record_event(Some(id), Some(old), "recovery_retry", &format!("attempt {attempt}: {last_error}")).await?;
    }
    fail(store, fleet, id, old, &format!("recovery failed {ATTEMPTS} times; last: {last_error}")).await
}

/// The rates and data planes of the nodes a restore involves.
fn fleet_nodes(
    fleet: &Fleet,
    files: &[crate::store::Holding],
    needs: &BTreeMap<String, restore_plan::NodeNeeds>,
) -> BTreeMap<String, NodeInfo> {
    let mut names: Vec<&String> = needs.keys().collect();
    names.extend(files.iter().filter(|h| h.tier != "cloud").map(|h| &h.node));
    names.into_iter().filter(|n| fleet.live(n)).filter_map(|n| fleet.restores.info(n).map(|i| (n.clone(), i))).collect()
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

/// Wait for every node's result of restore `generation`.
async fn wait_restored(fleet: &Fleet, id: i64, generation: i64, request: i64, nodes: Vec<String>, timeout: Duration) -> Waited {
    // The agents' own deadline first, then a few intervals for their report.
    let until = Instant::now() + timeout + fleet.base * 10;
    loop {
        let changed = fleet.restores.changed.notified();
        let mut done = vec![];
        let mut missing = vec![];
        for n in &nodes {
            // An earlier attempt's answer is not this one's.
            match fleet.restores.result(id, generation, n).filter(|r| r.request == request) {
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

/// The next launch, from `restored` (the step and every node's result) when there is one.
#[allow(clippy::too_many_arguments)]
async fn launch(
    store: &Store,
    fleet: &Fleet,
    id: i64,
    plan: &str,
    ranks: &[crate::store::RankAssignment],
    restored: Option<(i64, &[RestoreResult])>,
    began: Instant,
    transfer_s: f64,
) -> Result<()> {
    let generation = store.start_generation_from(id, plan, ranks, restored.map(|(s, _)| s)).await?;
    note_launch(store, fleet, id, generation).await;
    let (mut local, mut peer, mut cloud, mut repaired, mut skipped) = (0, 0, 0, vec![], 0);
    for r in restored.map(|(_, r)| r).unwrap_or_default() {
        (local, peer, cloud) = (local + r.local_bytes, peer + r.peer_bytes, cloud + r.cloud_bytes);
        repaired.extend(r.repaired.iter().cloned());
        skipped += r.skipped;
    }
    let done = json!({
        "step": restored.map(|(s, _)| s),
        "transfer_s": transfer_s,
        "total_s": began.elapsed().as_secs_f64(),
        "bytes": {"local": local, "peer": peer, "cloud": cloud},
        "repaired": repaired,
        // Files already in place that verified (a restore resumed after a failover).
        "skipped": skipped,
    });
    store.record_event(Some(id), Some(generation), "recovery_done", &done.to_string()).await?;
    fleet.restores.forget(id);
    crate::scheduler::send_out(store, fleet, id, generation).await
}

async fn fail(store: &Store, fleet: &Fleet, id: i64, generation: i64, reason: &str) -> Result<()> {
    tracing::warn!(job = id, "{reason}");
    crate::lifecycle::fail(store, fleet, id, generation, reason).await;
    Ok(())
}
