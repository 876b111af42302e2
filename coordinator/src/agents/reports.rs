//! What an agent's status message tells, applied (below the agent-session edge, which only
//! translates its message into a `NodeReport` and sends the stops this returns): rank reports
//! committed in order, the ranks that must stop (of a job that is over, of a superseded launch,
//! unknown here), the node's checkpoint holdings replaced, profile runs' results, restore
//! results and rejoined ranks handed to the facts, and on a session's full list the ranks it
//! no longer has lost.
//! The job's life moves the reported jobs on (`JobSignals::reported`); this room never calls
//! up into it.

use motley_proto::v1::{RankRejoined, RestoreResult};

use crate::error::CoordinatorError;
use crate::state::facts::Facts;
use crate::state::signals::JobSignals;
use crate::store::{Holding, RankReport, Store};

/// One status message of an agent session, in the store's terms.
#[derive(Debug, Clone, Default)]
pub struct NodeReport {
    pub node: String,
    pub epoch: i64,
    pub ranks: Vec<RankReport>,
    /// The node's checkpoint holdings, when the message carries them (all of them).
    pub holdings: Option<Vec<Holding>>,
    /// Profile runs that ended: (request, the profile's JSON, an error; empty when it ran).
    pub profiles: Vec<(i64, String, String)>,
    pub restores: Vec<RestoreResult>,
    /// Running ranks of a joining replica and what each copied from its peers: (job,
    /// generation, rank, what).
    pub rejoins: Vec<(i64, i64, i64, RankRejoined)>,
    /// The session's full list of ranks: every rank of this node it does not name is gone.
    pub full: bool,
}

/// A launch's ranks on the reporting node to stop, and why.
#[derive(Debug, Clone, PartialEq)]
pub struct StopRanks {
    pub job: i64,
    /// `i64::MAX`: every generation of the job.
    pub generation: i64,
    pub reason: String,
}

/// Apply one status message; the stops to send back to its node.
pub async fn apply(store: &Store, facts: &Facts, signals: &JobSignals, report: NodeReport) -> Result<Vec<StopRanks>, CoordinatorError> {
    let agent = Some((report.node.as_str(), report.epoch));
    let mut stops = vec![];
    let mut stop = |job: i64, generation: i64, reason: &str| stops.push(StopRanks { job, generation, reason: reason.into() });
    let running: Vec<i64> = report.ranks.iter().filter(|r| r.state == "running").map(|r| r.job).collect();
    let alive: std::collections::HashSet<(i64, i64, i64)> =
        report.ranks.iter().filter(|r| r.state == "running").map(|r| (r.job, r.generation, r.rank)).collect();
    let mut unknown = vec![];
    // A full list's ranks, read before the reports are handed to the store.
    let known: Option<Vec<(i64, i64, i64)>> = report.full.then(|| report.ranks.iter().map(|r| (r.job, r.generation, r.rank)).collect());
    let mut jobs = vec![];
    if !report.ranks.is_empty() {
        let done = store.report_ranks_from(agent, report.ranks).await?;
        for j in &done.jobs {
            // Ranks still running for a job that is over (failed or cancelled while their agent
            // was away): stop them, or they hold the GPUs.
            if running.contains(j) && store.job(*j).await.is_ok_and(|job| job.state.is_terminal()) {
                stop(*j, i64::MAX, "the job is over");
            }
        }
        // Ranks of a superseded launch: stop that launch's ranks on this node.
        for (job, given, _) in done.stale {
            stop(job, given, "a newer generation of the job was launched");
        }
        // Ranks the coordinator does not know here: stopped, and acknowledged like the rest so
        // the agent does not resend them forever.
        // One that ended is only acknowledged: its launch may run other ranks here (a replica
        // that rejoined on other nodes leaves its old ranks' ends on the node it left, whose
        // agent reports them in every session).
        for &(job, generation, rank) in &done.unknown {
            if !alive.contains(&(job, generation, rank)) {
                continue;
            }
            tracing::warn!(node = %report.node, job, generation, rank, "a rank this coordinator does not know here; stopping it");
            stop(job, generation, "the coordinator does not know this rank on this node");
        }
        unknown = done.unknown;
        jobs = done.jobs;
    }
    if let Some(held) = &report.holdings {
        store.replace_holdings(&report.node, report.epoch, held).await?;
    }
    for (request, profile_json, error) in &report.profiles {
        crate::planning::profiling::receive(store, signals, &report.node, *request, profile_json, error).await?;
    }
    for r in report.restores {
        facts.restored(&report.node, r);
    }
    // Before the jobs are moved on: a rejoined rank is what lets a degraded job run whole again.
    // (Not a rank this node does not hold: an old process's copy is not the rank's now.)
    for (job, generation, rank, r) in report.rejoins {
        if !unknown.contains(&(job, generation, rank)) {
            facts.rejoined(job, generation, rank, r);
        }
    }
    if let Some(known) = known {
        // A launch queued on the session before this one may never have reached the agent:
        // the reconcile tick sends launching launches again (an agent ignores ranks it has).
        signals.resend_launches();
        jobs.extend(store.lose_unknown_ranks(&report.node, report.epoch, &known).await?);
    }
    // The job's life moves them on (`life::reconcile`); this room only tells it which.
    signals.reported(&jobs);
    Ok(stops)
}
