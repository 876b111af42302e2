//! Networks that change (docs/network.md, "Decide"): a running job whose links moved away from
//! what its plan assumed is re-planned on the links measured now, and switches to the new plan
//! at its next complete checkpoint, by the recovery path, when the time the new plan saves over
//! the work left beats what the switch costs.
//!
//! Every base interval, for each `running` job with a complete checkpoint, no carried plan and
//! `replan` not `off`:
//!
//! 1. **Change.** Each link of its plan (`PlanDocument.network`) against the live estimate
//!    (`Fleet.links`): more than `replan.threshold` away, every sample since the deviation
//!    began deviating, for at least `replan.hold` (by the samples' own times), is a change:
//!    event `network_changed {link: {a, b, nic_kind}, was, now}`, once per change (a link
//!    that moves on past the threshold from the estimate reported is a change again).
//! 2. **Weigh.** On a change, the solver's `replan` (`planning::replan_running`): the saving per
//!    iteration (the running plan priced on the measured links minus the new plan's time) times
//!    the iterations left (`steps` minus the newest complete step, else `replan.horizon` over
//!    the iteration time) against the switch (the bytes that move, priced by the solver, plus a
//!    relaunch: the job's own last recovery, else `RELAUNCH_INTERVALS` base intervals). Event
//!    `replan_considered {gain_s, cost_s, decision, reason, plan_before, plan_after, at_step}`.
//!    Within `replan.cooldown` of the last `switch` (read from the durable events, so a new
//!    leader keeps it) the decision is `keep`.
//! 3. **Switch.** At the next complete checkpoint step after the decision's, the job recovers
//!    (`RecoveryCause::Replan`, no budget spent): its ranks stop and the recovery task plans it
//!    again (on the measured links) and restores that step.

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;
use std::time::Duration;

use motley_solver::bandwidth::PlanNetwork;
use motley_solver::PlanDocument;
use serde_json::{json, Value};

use super::Life;
use crate::error::Result;
use crate::job::spec::{JobSpec, ReplanPolicy};
use crate::job::JobState;
use crate::state::links::{LinkKey, Sample};
use crate::store::{Event, JobRecord, RecoveryCause, Store};

/// The event kind that says why a launch's links are not watched.
pub const UNWATCHED: &str = "replan";

/// A relaunch's cost, in base intervals, for a job that never recovered: a stop (up to 10
/// intervals), a plan, the restore's start and the ranks' start and first heartbeats.
pub const RELAUNCH_INTERVALS: u32 = 30;

/// What this leader remembers of a launch (job, generation): the links whose change it
/// reported, when it first saw each link deviate, the plan's links, and the newest complete
/// step when it decided to switch.
#[derive(Debug, Default)]
pub(super) struct Watched {
    /// Per link (a, b) whose change was reported, the estimate reported: a link that moves on
    /// past the threshold from there (up 40%, then down ten-fold) is a change again.
    reported: HashMap<(String, String), f64>,
    /// Per link, when this leader first saw it deviate from the plan (and from what was
    /// reported): a fast link's 64 samples may span less than the hold.
    first_seen: HashMap<(String, String), i64>,
    moved_seen: HashMap<(String, String), i64>,
    /// The plan's `network` section, read once per launch.
    network: Option<Option<PlanNetwork>>,
    switch_after: Option<i64>,
    /// Whether the launch's durable events were read (a switch decided by an earlier leader).
    resumed: bool,
    /// Whether the job was told why this launch is not watched (event `replan`).
    told_unwatched: bool,
}

impl Life {
    pub(super) async fn watch_networks(&self, jobs: &[JobRecord]) -> Result<()> {
        self.fleet.links.forget_before(crate::store::now_ms());
        {
            let keep: HashSet<(i64, i64)> = jobs.iter().filter(|j| j.state == JobState::Running).map(|j| (j.id, j.generation)).collect();
            self.network.lock().retain(|k, _| keep.contains(k));
        }
        for j in jobs.iter().filter(|j| j.state == JobState::Running) {
            let Ok(spec) = serde_json::from_str::<JobSpec>(&j.spec) else { continue };
            let Ok(Some(policy)) = spec.replan() else { continue };
            if spec.checkpoint.is_none() || spec.plan.is_some() {
                continue; // nothing to resume from, or a plan the job carries (never re-planned)
            }
            let newest = crate::views::checkpoints::newest_complete(&self.store, j.id).await?;
            if newest < 0 {
                continue;
            }
            if let Err(e) = self.watch_job(j, &spec, policy, newest, jobs).await {
                tracing::warn!(job = j.id, "network: {e}");
            }
        }
        Ok(())
    }

    async fn watch_job(&self, j: &JobRecord, spec: &JobSpec, policy: ReplanPolicy, newest: i64, jobs: &[JobRecord]) -> Result<()> {
        let (store, fleet) = (&self.store, &*self.fleet);
        let key = (j.id, j.generation);
        if !self.network.lock().get(&key).is_some_and(|w| w.resumed) {
            let events = job_events(store, j.id).await?;
            let pending = pending_switch(&events, j.generation);
            let told = events.iter().any(|e| e.kind == UNWATCHED && e.generation == Some(j.generation));
            let mut memory = self.network.lock();
            let w = memory.entry(key).or_default();
            w.resumed = true;
            w.switch_after = w.switch_after.or(pending);
            w.told_unwatched |= told;
        }
        let cached = self.network.lock().get(&key).and_then(|w| w.network.clone());
        let network = match cached {
            Some(n) => n,
            None => {
                let n = plan_network(&store.plan(j.id, j.generation).await?);
                self.network.lock().entry(key).or_default().network = Some(n.clone());
                n
            }
        };
        let network = match network {
            Some(n) if !n.links.is_empty() => n,
            other => {
                // Nothing to watch in this launch; a later one (after a recovery or scale-up
                // onto more nodes) may have links. A job that asked for `replan:` is told why.
                let told = self.network.lock().get(&key).is_some_and(|w| w.told_unwatched);
                if spec.replan.is_some() && !told {
                    let why = match other {
                        None => "its plan does not say which links it assumed (planned by an older coordinator)",
                        Some(_) => "it runs on one node: no link between nodes to watch",
                    };
                    let message =
                        format!("this launch's links are not watched for re-planning: {why}; a later launch over several nodes is");
                    store.record_event(Some(j.id), Some(j.generation), UNWATCHED, &message).await?;
                    self.network.lock().entry(key).or_default().told_unwatched = true;
                }
                return Ok(());
            }
        };
        let pending = self.network.lock().get(&key).and_then(|w| w.switch_after);
        if let Some(then) = pending {
            if newest > then {
                // The links may have come back while the job ran to its checkpoint: a
                // relaunch for nothing is not made.
                let still = network.links.iter().any(|l| {
                    fleet
                        .links
                        .between(&l.a, &l.b)
                        .is_some_and(|v| l.gb_per_s > 0.0 && (v.gb_per_s / l.gb_per_s - 1.0).abs() > policy.threshold)
                });
                if !still {
                    let message = json!({"gain_s": 0.0, "cost_s": 0.0, "decision": "keep",
                        "reason": "the links came back to what the plan assumed before the checkpoint the switch waited for",
                        "plan_before": Value::Null, "plan_after": Value::Null, "at_step": newest, "changes": []});
                    store.record_event(Some(j.id), Some(j.generation), "replan_considered", &message.to_string()).await?;
                    let mut memory = self.network.lock();
                    let w = memory.entry(key).or_default();
                    w.switch_after = None;
                    w.reported.clear();
                    return Ok(());
                }
                let reason = format!("a plan for the measured links pays for the switch; switching at step {newest}");
                if store.begin_recovery(j.id, j.generation, RecoveryCause::Replan, 0, &reason).await.is_ok() {
                    tracing::info!(job = j.id, "{reason}");
                    crate::agents::launch::stop_job(store, fleet, &self.signals, j.id, j.generation, "re-planning").await;
                    self.recoveries.kick();
                }
            }
            return Ok(());
        }
        let hold_ms = policy.hold.as_millis() as i64;
        let mut changes = vec![];
        for l in &network.links {
            let live = fleet.links.between(&l.a, &l.b);
            let mut memory = self.network.lock();
            let w = memory.entry(key).or_default();
            let pair = (l.a.clone(), l.b.clone());
            let Some(v) = live else {
                w.first_seen.remove(&pair);
                w.moved_seen.remove(&pair);
                continue;
            };
            let newest_at = v.updated_unix_ms;
            let dev = deviating_since(&v.history, l.gb_per_s, v.gb_per_s, policy.threshold);
            if !held(&mut w.first_seen, &pair, dev, newest_at, hold_ms) {
                w.reported.remove(&pair);
                w.moved_seen.remove(&pair);
                continue;
            }
            // New, or moved on from what was reported for as long as the hold.
            let again = match w.reported.get(&pair) {
                None => true,
                Some(&told) => {
                    let moved = deviating_since(&v.history, told, v.gb_per_s, policy.threshold);
                    held(&mut w.moved_seen, &pair, moved, newest_at, hold_ms)
                }
            };
            if again {
                w.reported.insert(pair.clone(), v.gb_per_s);
                w.moved_seen.remove(&pair);
                changes.push((v.key, l.gb_per_s, v.gb_per_s));
            }
        }
        if changes.is_empty() {
            return Ok(());
        }
        for (link, was, now) in &changes {
            let message = change_message(link, *was, *now);
            store.record_event(Some(j.id), Some(j.generation), "network_changed", &message.to_string()).await?;
            tracing::info!(job = j.id, "network changed: {message}");
        }
        self.consider(j, spec, policy, newest, jobs, &changes).await
    }

    /// Re-plan the job on the measured links and decide: event `replan_considered`.
    async fn consider(
        &self,
        j: &JobRecord,
        spec: &JobSpec,
        policy: ReplanPolicy,
        newest: i64,
        jobs: &[JobRecord],
        changes: &[(LinkKey, f64, f64)],
    ) -> Result<()> {
        let (store, fleet) = (&self.store, &*self.fleet);
        let taken = crate::planning::taken(store, fleet, jobs).await?;
        let links: Vec<Value> = changes.iter().map(|(k, was, now)| change_message(k, *was, *now)).collect();
        let report = match crate::planning::replan_running(store, fleet, j, &taken).await {
            Ok(r) => r,
            Err(e @ crate::error::CoordinatorError::Database(_)) => return Err(e),
            Err(e) => {
                // The running plan as it was priced; no new plan to compare.
                let before = serde_json::from_str::<PlanDocument>(&store.plan(j.id, j.generation).await?)
                    .map(|p| json!({"iteration_time_s": p.iteration_time_s, "shape": shape(&p)}))
                    .unwrap_or(Value::Null);
                let message = json!({"gain_s": 0.0, "cost_s": 0.0, "decision": "keep", "reason": format!("cannot re-plan: {e}"),
                    "plan_before": before, "plan_after": Value::Null, "at_step": newest, "changes": links});
                store.record_event(Some(j.id), Some(j.generation), "replan_considered", &message.to_string()).await?;
                return Ok(());
            }
        };
        let events = job_events(store, j.id).await?;
        let relaunch_s = last_recovery_s(&events).unwrap_or_else(|| (fleet.base * RELAUNCH_INTERVALS).as_secs_f64());
        let iterations = remaining_iterations(spec.steps, newest, policy.horizon, report.current_now_s);
        let cooling = cooling(&events, crate::store::now_ms(), policy.cooldown);
        let w = weigh(report.current_now_s - report.new_iteration_time_s, iterations, report.switch_seconds, relaunch_s, cooling);
        let message = json!({
            "gain_s": w.gain_s,
            "cost_s": w.cost_s,
            "decision": if w.switch { "switch" } else { "keep" },
            "reason": w.reason,
            "plan_before": {"iteration_time_s": report.current_now_s, "planned_s": report.current_planned_s,
                "shape": shape(&report.current_plan)},
            "plan_after": {"iteration_time_s": report.new_iteration_time_s, "shape": shape(&report.new_plan)},
            "switch_s": report.switch_seconds,
            "relaunch_s": relaunch_s,
            "iterations_left": iterations,
            "at_step": newest,
            "changes": links,
        });
        store.record_event(Some(j.id), Some(j.generation), "replan_considered", &message.to_string()).await?;
        tracing::info!(job = j.id, "re-plan considered: {message}");
        if w.switch {
            self.network.lock().entry((j.id, j.generation)).or_default().switch_after = Some(newest);
        }
        Ok(())
    }
}

/// `network_changed`'s message (a contract: `link`, `was`, `now`).
fn change_message(link: &LinkKey, was: f64, now: f64) -> Value {
    json!({"link": {"a": link.a, "b": link.b, "nic_kind": link.nic_kind}, "was": was, "now": now})
}

/// The `network` section of a stored plan, if it has one.
fn plan_network(plan: &str) -> Option<PlanNetwork> {
    let v: Value = serde_json::from_str(plan).ok()?;
    serde_json::from_value(v.get("network")?.clone()).ok()
}

/// Every event of job `id`, oldest first.
async fn job_events(store: &Store, id: i64) -> Result<Vec<Event>> {
    let mut all: Vec<Event> = vec![];
    loop {
        let after = all.last().map_or(0, |e| e.seq);
        let page = store.events(Some(id), after, 1000).await?;
        let done = page.len() < 1000;
        all.extend(page);
        if done {
            return Ok(all);
        }
    }
}

/// A plan's shape, e.g. `2 x [A100-80G tp1 dp2 L0-12 | A100-80G tp1 dp2 L12-24]`: replicas in
/// order, runs of equal ones counted.
pub fn shape(plan: &PlanDocument) -> String {
    let replicas: Vec<String> = plan
        .replicas
        .iter()
        .map(|r| {
            let stages: Vec<String> =
                r.stages.iter().map(|s| format!("{} tp{} dp{} L{}-{}", s.gpu, s.tp, s.dp, s.layers[0], s.layers[1])).collect();
            format!("[{}]", stages.join(" | "))
        })
        .collect();
    let mut out: Vec<String> = vec![];
    let mut i = 0;
    while i < replicas.len() {
        let n = replicas[i..].iter().take_while(|r| **r == replicas[i]).count();
        out.push(if n > 1 { format!("{n} x {}", replicas[i]) } else { replicas[i].clone() });
        i += n;
    }
    out.join(" + ")
}

/// When the deviation of a link began, by its samples (oldest first): its estimate `now` is
/// more than `threshold` away from `was`, and so is every sample since then, on the same side
/// (a slow, contended link's low and high readings are not one run). With it, whether the run
/// reaches the oldest sample kept (then it began no later than that, and maybe earlier).
pub fn deviating_since(history: &[Sample], was: f64, now: f64, threshold: f64) -> Option<(i64, bool)> {
    if was.is_nan() || was <= 0.0 {
        return None;
    }
    let up = now > was;
    let deviates = |x: f64| (x / was - 1.0).abs() > threshold && (x > was) == up;
    if !deviates(now) {
        return None;
    }
    let run = history.iter().rev().take_while(|s| deviates(s.gb_per_s)).count();
    let since = history[history.len() - run..].first()?.at_unix_ms;
    Some((since, run == history.len()))
}

/// Whether a link changed: it deviates (`deviating_since`) and has for at least `hold_ms`
/// before the newest sample, by the samples alone. The time it began, if so.
pub fn changed_since(history: &[Sample], was: f64, now: f64, threshold: f64, hold_ms: i64) -> Option<i64> {
    let (since, _) = deviating_since(history, was, now, threshold)?;
    let newest = history.last()?;
    (newest.at_unix_ms - since >= hold_ms).then_some(since)
}

/// Whether a deviation `dev` (`deviating_since`) has lasted `hold_ms` at `newest_ms`. Where the
/// run reaches the oldest sample kept, when this leader first saw it stands in for its start
/// (`first_seen`, updated here: cleared when the link does not deviate).
pub fn held(
    first_seen: &mut HashMap<(String, String), i64>,
    pair: &(String, String),
    dev: Option<(i64, bool)>,
    newest_ms: i64,
    hold_ms: i64,
) -> bool {
    let Some((start, whole)) = dev else {
        first_seen.remove(pair);
        return false;
    };
    let seen = *first_seen.entry(pair.clone()).or_insert(start);
    let since = if whole { seen.min(start) } else { start };
    if !whole {
        first_seen.insert(pair.clone(), start);
    }
    newest_ms - since >= hold_ms
}

/// Iterations left: `steps` minus the newest complete step, when the job file says how many;
/// else the horizon's worth at `iteration_s`.
pub fn remaining_iterations(steps: Option<u64>, newest: i64, horizon: Duration, iteration_s: f64) -> f64 {
    match steps {
        Some(total) => total.saturating_sub(newest.max(0) as u64) as f64,
        None if iteration_s > 0.0 => horizon.as_secs_f64() / iteration_s,
        None => 0.0,
    }
}

/// A decision: switch iff the gain beats the cost and no switch was made within the cooldown.
#[derive(Debug, Clone, PartialEq)]
pub struct Weighing {
    pub gain_s: f64,
    pub cost_s: f64,
    pub switch: bool,
    pub reason: String,
}

/// `saved_s` per iteration over `iterations` against the switch (`switch_s` of moving state,
/// `relaunch_s` of stopping and starting); `cooling`: how long the cooldown has left.
pub fn weigh(saved_s: f64, iterations: f64, switch_s: f64, relaunch_s: f64, cooling: Option<Duration>) -> Weighing {
    let gain_s = saved_s.max(0.0) * iterations;
    let cost_s = switch_s + relaunch_s;
    let (switch, reason) = if saved_s <= 0.0 {
        (false, "the running plan is still the fastest found on the measured links".to_string())
    } else if gain_s <= cost_s {
        (
            false,
            format!("saving {saved_s:.3} s per iteration over {iterations:.0} iterations ({gain_s:.0} s) does not pay for the switch ({cost_s:.0} s)"),
        )
    } else if let Some(left) = cooling {
        (
            false,
            format!(
                "it would pay ({gain_s:.0} s against {cost_s:.0} s), but the last switch was within the cooldown ({}s left)",
                left.as_secs()
            ),
        )
    } else {
        (
            true,
            format!(
                "saving {saved_s:.3} s per iteration over {iterations:.0} iterations ({gain_s:.0} s) pays for the switch ({cost_s:.0} s)"
            ),
        )
    };
    Weighing { gain_s, cost_s, switch, reason }
}

/// How long the cooldown after the newest `replan_considered` that decided `switch` has left at
/// `now_ms`; None when it is over or there was none.
pub fn cooling(events: &[Event], now_ms: i64, cooldown: Duration) -> Option<Duration> {
    let last = events.iter().filter(|e| e.kind == "replan_considered" && decided_switch(e)).map(|e| e.at_ms).max()?;
    let left = last + cooldown.as_millis() as i64 - now_ms;
    (left > 0).then(|| Duration::from_millis(left as u64))
}

fn decided_switch(e: &Event) -> bool {
    serde_json::from_str::<Value>(&e.message).is_ok_and(|v| v["decision"] == "switch")
}

/// A switch decided for launch `generation` that has not begun (an earlier leader's): the step
/// it waits to pass.
fn pending_switch(events: &[Event], generation: i64) -> Option<i64> {
    let e = events.iter().rev().find(|e| e.kind == "replan_considered" && e.generation == Some(generation))?;
    let v: Value = serde_json::from_str(&e.message).ok()?;
    (v["decision"] == "switch").then(|| v["at_step"].as_i64()).flatten()
}

/// Seconds the job's newest recovery took, from its `recovering` event to the next `running`.
pub fn last_recovery_s(events: &[Event]) -> Option<f64> {
    let mut last = None;
    let mut began: Option<i64> = None;
    for e in events {
        match e.kind.as_str() {
            "recovering" => began = Some(e.at_ms),
            "running" => {
                if let Some(b) = began.take() {
                    last = Some((e.at_ms - b).max(0) as f64 / 1000.0);
                }
            }
            _ => {}
        }
    }
    last
}

/// The re-plan room's memory: per running launch, what `watch_networks` saw and decided.
#[derive(Default)]
pub(super) struct Memory(Mutex<HashMap<(i64, i64), Watched>>);

impl Memory {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<(i64, i64), Watched>> {
        self.0.lock().expect("network")
    }
}

#[cfg(test)]
mod tests;
