//! Scale-up: nodes that come back (or are added) take a running job up at its next complete
//! checkpoint, by the recovery path (docs/recovery.md). A degraded job (docs/keep-going.md)
//! goes back to full strength without either: once a lost replica's node is back, the replica
//! rejoins from the members' live state (`keep_going::rejoin_lost`).

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;

use super::{usable_nodes, Life};
use crate::error::Result;
use crate::job::spec::JobSpec;
use crate::job::JobState;
use crate::store::{JobRecord, RecoveryCause};

/// A running launch's live nodes when first seen, and the newest complete step when more were.
type Seen = (usize, Option<i64>);

/// The scale-up room's memory: per launch, the live nodes it could use when first seen.
#[derive(Default)]
pub(super) struct Memory(Mutex<HashMap<(i64, i64), Seen>>);

impl Memory {
    pub(super) fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<(i64, i64), Seen>> {
        self.0.lock().expect("scale")
    }
}

/// Nodes that come back (or are added) take a running job up at its next checkpoint: once more
/// live nodes are within its resources than when its launch was first seen, and at the next
/// complete checkpoint step the planner would give it more GPUs than it has, it moves to
/// `recovering` (spending no budget), and the recovery plans it onto what it can use then and
/// restores that step.
impl Life {
    pub(super) async fn scale_up(&self, jobs: &[JobRecord]) -> Result<()> {
        let (store, fleet) = (&self.store, &*self.fleet);
        let running: Vec<&JobRecord> = jobs.iter().filter(|j| matches!(j.state, JobState::Running | JobState::Degraded)).collect();
        {
            let launched = jobs.iter().filter(|j| matches!(j.state, JobState::Launching | JobState::Running | JobState::Degraded));
            let keep: HashSet<(i64, i64)> = launched.map(|j| (j.id, j.generation)).collect();
            self.scale.lock().retain(|k, _| keep.contains(k));
        }
        if running.is_empty() {
            return Ok(());
        }
        let nodes = store.nodes().await?;
        for j in running {
            let Ok(spec) = serde_json::from_str::<JobSpec>(&j.spec) else { continue };
            let degraded = j.state == JobState::Degraded;
            if degraded {
                // A lost replica whose node is back rejoins from the members' live state, without
                // a checkpoint or a restart (docs/keep-going.md).
                self.rejoin_lost(j, &nodes).await?;
                continue;
            }
            if spec.checkpoint.is_none() || spec.plan.is_some() {
                // Nothing to resume from, or a plan the job carries (never re-planned).
                continue;
            }
            let live = usable_nodes(&nodes, fleet, &spec);
            let key = (j.id, j.generation);
            let seen = *self.scale.lock().entry(key).or_insert((live, None));
            // A running launch grows once more nodes are live than when it was first seen.
            let ranks = match live.cmp(&seen.0) {
                std::cmp::Ordering::Less => {
                    self.scale.lock().insert(key, (live, None));
                    continue;
                }
                std::cmp::Ordering::Equal => continue,
                std::cmp::Ordering::Greater => store.ranks(j.id, j.generation).await?.len(),
            };
            if spec.resources.gpus.is_some_and(|g| ranks as u32 >= g) {
                continue; // already at its GPU budget
            }
            let newest = crate::views::checkpoints::newest_complete(store, j.id).await?;
            match seen.1 {
                None => {
                    self.scale.lock().insert(key, (seen.0, Some(newest)));
                }
                Some(then) if newest > then => {
                    // Only if the planner would use more GPUs now: otherwise the restart buys nothing,
                    // and the launch's node count is what it is compared with from here on.
                    let taken = crate::planning::taken(store, fleet, jobs).await?;
                    let more = match crate::planning::plan_for_recovery(store, fleet, j, &taken).await {
                        Ok(crate::planning::RecoveryPlan { ranks: new_ranks, .. }) => {
                            if new_ranks.len() <= ranks {
                                tracing::info!(
                                    job = j.id,
                                    "no scale-up: with {live} live nodes the planner gives it {} GPUs, it has {ranks}",
                                    new_ranks.len(),
                                );
                            }
                            new_ranks.len() > ranks
                        }
                        Err(e) => {
                            tracing::info!(job = j.id, "no scale-up: {e}");
                            false
                        }
                    };
                    if !more {
                        self.scale.lock().insert(key, (live, None));
                        continue;
                    }
                    let reason =
                        format!("{live} live nodes can take it (it was launched when {} were); scaling up from step {newest}", seen.0);
                    if store.begin_recovery(j.id, j.generation, RecoveryCause::ScaleUp, 0, &reason).await.is_ok() {
                        tracing::info!(job = j.id, "{reason}");
                        crate::agents::launch::stop_job(store, fleet, &self.signals, j.id, j.generation, "scaling up").await;
                        self.recoveries.kick();
                    }
                }
                Some(_) => {}
            }
        }
        Ok(())
    }
}
