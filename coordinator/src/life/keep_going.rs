//! A lost replica stops nobody else (docs/keep-going.md). When a rank of a running job fails, or
//! a node of it is lost, and the job keeps going (`planning::membership::keeps_going`), the
//! replicas with nothing on the loss go on: a new membership (the next epoch: the members, their
//! split of the same global batch, the epoch's store) is recorded as a `membership_changed`
//! event, the job moves to `degraded`, and the agents hand the membership to their ranks and
//! stop the lost replicas' ranks still running. No rank restarts, nothing is restored, and the
//! generation stays: the survivors re-form their rings among themselves (`motley_torch.
//! distributed.keep_going`). When no replica survives whole the job recovers whole, as before.
//!
//! Durable: the memberships (events). Rebuilt: which epoch this leader sent to the agents (a
//! new leader sends the current one again; agents refuse an older epoch than they hold), and
//! what each joining rank copied (`Facts`: an agent's session opens with every rank, with it).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Mutex;

use motley_contract::views::MembershipView;
use motley_contract::PlanDocument;
use motley_proto::v1::{instruction, Instruction, Membership as MembershipMsg};
use motley_solver::hardware::NodeSpec;

use super::Life;
use crate::agents::launch;
use crate::error::Result;
use crate::job::spec::JobSpec;
use crate::job::JobState;
use crate::planning::membership::{self, CannotKeepGoing, Membership, StoreAddr};
use crate::planning::substitute;
use crate::store::{JobRecord, NodeRecord, RankRecord};

/// The event of a replica back in the job (its message: epoch, replica, ranks, bytes, seconds,
/// copy_seconds).
pub const REJOINED: &str = "rejoined";

/// The room's memory: one membership change at a time (two reports of one loss must not open
/// two epochs), and the epoch this leader last sent per launch.
#[derive(Default)]
pub struct Memberships {
    changing: tokio::sync::Mutex<()>,
    sent: Mutex<HashMap<(i64, i64), i64>>,
}

/// A rank that ended badly: lost, or exited with a code other than 0.
pub fn failed(r: &RankRecord) -> bool {
    r.state == "lost" || (r.state == "exited" && r.exit_code != Some(0))
}

/// A launch's plan, the membership in force and its ranks.
pub(super) struct Launched {
    pub plan: PlanDocument,
    pub membership: Membership,
    pub ranks: Vec<RankRecord>,
}

impl Launched {
    /// The ranks of the member replicas.
    pub fn members(&self) -> impl Iterator<Item = &RankRecord> {
        self.ranks.iter().filter(|r| self.membership.replicas.contains(&(r.assignment.replica as u32)))
    }
}

impl Life {
    /// Launch (job, generation) as it stands: None when the job does not keep going.
    pub(super) async fn launched(&self, job: &JobRecord) -> Result<Option<Launched>> {
        let Ok(spec) = serde_json::from_str::<JobSpec>(&job.spec) else { return Ok(None) };
        let Ok(plan) = PlanDocument::from_json(&self.store.plan(job.id, job.generation).await?) else { return Ok(None) };
        if !membership::keeps_going(spec.keep_going, &plan) {
            return Ok(None);
        }
        let ranks = self.store.ranks(job.id, job.generation).await?;
        let membership = match self.store.last_event(job.id, job.generation, membership::EVENT).await? {
            Some(e) => serde_json::from_str(&e.message)
                .map_err(|err| crate::error::CoordinatorError::Conflict(format!("stored {}: {err}", membership::EVENT)))?,
            None => {
                let host = ranks.first().and_then(|r| self.fleet.address(&r.assignment.node)).unwrap_or_else(|| "127.0.0.1".into());
                let port = launch::master_port(self.fleet.master_port_base, job.id, job.generation);
                membership::initial(&plan, StoreAddr { host, port })
            }
        };
        Ok(Some(Launched { plan, membership, ranks }))
    }

    /// The ranks `hit` took (a failed rank's, a lost node's) end their replicas: the other
    /// members keep going under a new membership. True when the job goes on without them (or
    /// they were no member's), false when the caller should recover or fail it whole.
    pub(super) async fn keep_going(&self, job: &JobRecord, hit: impl Fn(&RankRecord) -> bool, reason: &str) -> bool {
        let _one_at_a_time = self.memberships.changing.lock().await;
        match self.change_membership(job, hit, reason).await {
            Ok(kept) => kept,
            Err(e) => {
                tracing::warn!(job = job.id, "keeping going: {e}; the job recovers whole");
                false
            }
        }
    }

    async fn change_membership(&self, job: &JobRecord, hit: impl Fn(&RankRecord) -> bool, reason: &str) -> Result<bool> {
        let store = &self.store;
        // Read again under the lock: a change just made is this one's starting point.
        let job = store.job(job.id).await?;
        if !matches!(job.state, JobState::Running | JobState::Degraded) {
            return Ok(false); // a launch not yet whole recovers whole
        }
        let Some(now) = self.launched(&job).await? else { return Ok(false) };
        let lost: BTreeSet<u32> = now.members().filter(|r| hit(r)).map(|r| r.assignment.replica as u32).collect();
        if lost.is_empty() {
            return Ok(true); // nothing of the members: a lost replica's rank, or nothing at all
        }
        let (id, generation) = (job.id, job.generation);
        let ports = (
            launch::master_port(self.fleet.master_port_base, id, generation),
            launch::master_port(self.fleet.master_port_base, id, generation + 1),
        );
        let node_of = |rank: u32| now.ranks.iter().find(|r| r.assignment.rank == i64::from(rank)).map(|r| r.assignment.node.clone());
        let host = |rank: u32| node_of(rank).and_then(|n| self.fleet.address(&n)).unwrap_or_else(|| "127.0.0.1".into());
        let next = match membership::next(&now.plan, &now.membership, &lost, reason, host, ports) {
            Ok(m) => m,
            Err(CannotKeepGoing(why)) => {
                store.record_event(Some(id), Some(generation), "keep_going", &format!("{why}: the job recovers whole")).await?;
                return Ok(false);
            }
        };
        let doc = serde_json::to_string(&next).map_err(|e| crate::error::CoordinatorError::Conflict(e.to_string()))?;
        store.record_event(Some(id), Some(generation), membership::EVENT, &doc).await?;
        tracing::warn!(job = id, epoch = next.epoch, "replicas {:?} lost, {:?} keep going: {reason}", next.lost, next.replicas);
        if job.state == JobState::Running {
            launch::move_job(store, id, generation, JobState::Degraded, Some(reason)).await;
        }
        self.send_membership(id, generation, &next, &now.ranks);
        Ok(true)
    }

    /// Hand membership `m` to the agents: every node with a member's rank gets the document;
    /// a live node still running a lost replica's ranks is told to stop them.
    fn send_membership(&self, id: i64, generation: i64, m: &Membership, ranks: &[RankRecord]) {
        let document = serde_json::to_string(m).unwrap_or_default();
        let mut by_node: BTreeMap<&str, (bool, Vec<i64>)> = BTreeMap::new();
        for r in ranks {
            let entry = by_node.entry(r.assignment.node.as_str()).or_default();
            if m.replicas.contains(&(r.assignment.replica as u32)) {
                entry.0 = true;
            } else if r.state == "running" || r.state == "assigned" {
                entry.1.push(r.assignment.rank);
            }
        }
        let mut all = true;
        for (node, (member, stop_ranks)) in by_node {
            if !member && stop_ranks.is_empty() {
                continue;
            }
            let msg = MembershipMsg { job: id, generation, epoch: m.epoch, document: document.clone(), stop_ranks };
            all &= self.fleet.send(node, Instruction { kind: Some(instruction::Kind::Membership(msg)) }) || !member;
        }
        if all {
            self.memberships.sent.lock().expect("memberships").insert((id, generation), m.epoch);
        }
    }

    /// A degraded launch's look: send its membership where this leader has not (a new leader,
    /// an agent that was away; and the joining ranks' launch with it), and return its members'
    /// ranks.
    pub(super) async fn degraded_members(&self, job: &JobRecord) -> Result<Option<Vec<RankRecord>>> {
        let Some(now) = self.launched(job).await? else { return Ok(None) };
        let key = (job.id, job.generation);
        let sent = self.memberships.sent.lock().expect("memberships").get(&key).copied();
        if now.membership.epoch > 0 && sent != Some(now.membership.epoch) {
            self.send_membership(job.id, job.generation, &now.membership, &now.ranks);
            self.send_joining(job, &now).await?;
        }
        Ok(Some(now.members().cloned().collect()))
    }

    /// Lost replicas whose nodes are back (live, registered after the membership that lost
    /// them, their old ranks ended) rejoin a degraded job from the members' live state
    /// (docs/keep-going.md): the next epoch names them `joining`, their ranks are assigned again
    /// and started afresh in the same launch; no member stops, nothing is restored. True when
    /// the job was handed such an epoch.
    pub(super) async fn rejoin_lost(&self, job: &JobRecord, nodes: &[NodeRecord]) -> Result<bool> {
        let _one_at_a_time = self.memberships.changing.lock().await;
        let job = self.store.job(job.id).await?;
        if job.state != JobState::Degraded {
            return Ok(false);
        }
        let Some(now) = self.launched(&job).await? else { return Ok(false) };
        if now.membership.lost.is_empty() {
            return Ok(false);
        }
        let Some(changed) = self.store.last_event(job.id, job.generation, membership::EVENT).await? else { return Ok(false) };
        let back_nodes: BTreeSet<&str> =
            nodes.iter().filter(|n| self.fleet.live(&n.name) && n.registered_at_ms > changed.at_ms).map(|n| n.name.as_str()).collect();
        let of = |replica: u32| now.ranks.iter().filter(move |r| r.assignment.replica as u32 == replica);
        let back: BTreeSet<u32> = now
            .membership
            .lost
            .iter()
            .copied()
            .filter(|&r| of(r).next().is_some() && of(r).all(|x| back_nodes.contains(x.assignment.node.as_str()) && x.state != "running"))
            .collect();
        if back.is_empty() {
            // Its nodes away: another node of their shape may take the replica.
            return self.rejoin_elsewhere(&job, now, nodes).await;
        }
        let mut names: Vec<&str> = back.iter().flat_map(|&r| of(r).map(|x| x.assignment.node.as_str())).collect();
        names.sort_unstable();
        names.dedup();
        let reason = format!(
            "node(s) {} of replica(s) {} are back: they rejoin from the members' live state",
            names.join(", "),
            back.iter().map(u32::to_string).collect::<Vec<_>>().join(", ")
        );
        let next = match membership::rejoin(&now.plan, &now.membership, &back, &reason) {
            Ok(Some(m)) => m,
            Ok(None) => return Ok(false),
            Err(CannotKeepGoing(why)) => {
                tracing::warn!(job = job.id, "no rejoin: {why}");
                return Ok(false);
            }
        };
        let ranks: Vec<i64> = back.iter().flat_map(|&r| of(r).map(|x| x.assignment.rank)).collect();
        // The ranks and the epoch in one transaction.
        let doc = serde_json::to_string(&next).map_err(|e| crate::error::CoordinatorError::Conflict(e.to_string()))?;
        self.store.reassign_ranks(job.id, job.generation, &ranks, next.epoch, (membership::EVENT, &doc)).await?;
        tracing::info!(job = job.id, epoch = next.epoch, "{reason}");
        let now = Launched { membership: next, ranks: self.store.ranks(job.id, job.generation).await?, plan: now.plan };
        self.send_membership(job.id, job.generation, &now.membership, &now.ranks);
        self.send_joining(&job, &now).await?;
        Ok(true)
    }

    /// A lost replica whose nodes are all away rejoins on live nodes with GPUs free
    /// (`planning::substitute`; one replica per look, the lowest): of their shape where there
    /// are, else of the GPU type that prices the job fastest. The plan is amended for it (and
    /// priced again: the links, and on another type the replica's times and the batch's split)
    /// and its ranks move there in one transaction, then it rejoins as on its own nodes.
    async fn rejoin_elsewhere(&self, job: &JobRecord, now: Launched, nodes: &[NodeRecord]) -> Result<bool> {
        let Ok(spec) = serde_json::from_str::<JobSpec>(&job.spec) else { return Ok(false) };
        let mine = |n: &str| spec.resources.nodes.is_empty() || spec.resources.nodes.iter().any(|m| m == n);
        let shape = |n: &NodeRecord| serde_json::from_str::<NodeSpec>(&n.inventory).ok();
        // Every rank's GPU in the store (other jobs', this job's), and those profile runs measure on.
        let mut held: BTreeSet<(String, i64)> = self.store.held_gpus().await?.into_iter().map(|g| (g.node, g.gpu)).collect();
        held.extend(crate::planning::profiling::gpus_in_use(&self.store).await?.into_iter().map(|(n, g)| (n, g as i64)));
        let candidates: Vec<substitute::Candidate> = nodes
            .iter()
            .filter(|n| n.state == crate::store::NodeState::Active && self.fleet.live(&n.name) && mine(&n.name))
            .filter_map(|n| {
                let spec = shape(n)?;
                let free = (0..spec.gpus).filter(|&i| !held.contains(&(n.name.clone(), i as i64))).collect();
                Some(substitute::Candidate { name: n.name.clone(), spec, free })
            })
            .collect();
        for &replica in &now.membership.lost {
            let away: BTreeSet<&str> =
                now.ranks.iter().filter(|r| r.assignment.replica as u32 == replica).map(|r| r.assignment.node.as_str()).collect();
            if away.is_empty() || !away.iter().all(|n| !self.fleet.live(n) && self.fleet.lapsed(n)) {
                continue; // its own nodes are there (a rank failed), or only just gone: not moved
            }
            let lost: BTreeMap<String, NodeSpec> =
                nodes.iter().filter(|n| away.contains(n.name.as_str())).filter_map(|n| Some((n.name.clone(), shape(n)?))).collect();
            let Some(Substitute { plan, moves, retyped }) = self.substitute(job, &spec, &now.plan, replica, &lost, &candidates).await
            else {
                continue;
            };
            let mut to: BTreeMap<&str, BTreeSet<&str>> = BTreeMap::new();
            for (from, onto) in &moves {
                to.entry(from.node.as_str()).or_default().insert(onto.node.as_str());
            }
            let said: Vec<String> =
                to.iter().map(|(f, t)| format!("{f} -> {}", t.iter().copied().collect::<Vec<_>>().join(", "))).collect();
            let how = match &retyped {
                None => "of their shape".to_string(),
                Some(gpu) => format!("of another shape, {gpu} GPUs: the replica priced there and the batch split again"),
            };
            let reason = format!(
                "node(s) of replica {replica} are away: it rejoins from the members' live state on node(s) {how} ({})",
                said.join("; ")
            );
            let next = match membership::rejoin(&plan, &now.membership, &BTreeSet::from([replica]), &reason) {
                Ok(Some(m)) => m,
                Ok(None) => return Ok(false),
                Err(CannotKeepGoing(why)) => {
                    tracing::warn!(job = job.id, "no rejoin elsewhere: {why}");
                    return Ok(false);
                }
            };
            let assigned = moved_ranks(&plan, replica, &now.ranks);
            let text = serde_json::to_string(&plan).map_err(|e| crate::error::CoordinatorError::Conflict(e.to_string()))?;
            // The ranks, the plan and the epoch in one transaction.
            let doc = serde_json::to_string(&next).map_err(|e| crate::error::CoordinatorError::Conflict(e.to_string()))?;
            self.store.move_ranks(job.id, job.generation, &assigned, &text, next.epoch, (membership::EVENT, &doc)).await?;
            tracing::info!(job = job.id, epoch = next.epoch, "{reason}");
            let now = Launched { membership: next, ranks: self.store.ranks(job.id, job.generation).await?, plan };
            self.send_membership(job.id, job.generation, &now.membership, &now.ranks);
            self.send_joining(job, &now).await?;
            return Ok(true);
        }
        Ok(false)
    }

    /// Where lost `replica` goes (its nodes `lost`, away): onto candidates of their shape, the
    /// plan amended and priced again for its links (the settings as they were where pricing
    /// fails: the same shape runs as planned); else onto candidates of one other GPU type, the
    /// replica's stages and layers kept, priced on that type, the global batch split again by
    /// the new prices and priced once more: of the types that fit (memory, precision, measured
    /// profiles where the job asks for them), the fastest plan. None where nothing fits.
    async fn substitute(
        &self,
        job: &JobRecord,
        spec: &JobSpec,
        plan: &PlanDocument,
        replica: u32,
        lost: &BTreeMap<String, NodeSpec>,
        candidates: &[substitute::Candidate],
    ) -> Option<Substitute> {
        let (store, fleet) = (&self.store, &*self.fleet);
        if let Some(moves) = substitute::places(plan, replica, lost, candidates, |l, c| substitute::same_shape(l, &c.spec)) {
            let amended = substitute::moved(plan, &moves);
            let plan = match crate::planning::price_amended(store, fleet, spec, &amended).await {
                Ok(priced) => priced,
                Err(e) => {
                    tracing::warn!(job = job.id, "the moved replica {replica}'s plan kept unpriced: {e}");
                    amended
                }
            };
            return Some(Substitute { plan, moves, retyped: None });
        }
        let types: BTreeSet<&str> = candidates.iter().map(|c| c.spec.gpu.as_str()).collect();
        let mut best: Option<Substitute> = None;
        for gpu in types {
            let fits = |l: &NodeSpec, c: &substitute::Candidate| c.spec.gpu == gpu && substitute::alike(l, &c.spec);
            let Some(moves) = substitute::places(plan, replica, lost, candidates, fits) else { continue };
            let amended = substitute::retyped(&substitute::moved(plan, &moves), replica, gpu);
            let priced = match crate::planning::price_amended(store, fleet, spec, &amended).await {
                Ok(p) => membership::split_all(&p).map_err(|CannotKeepGoing(why)| why),
                Err(e) => Err(e.to_string()),
            };
            let priced = match priced {
                Ok(split) => crate::planning::price_amended(store, fleet, spec, &split).await.map_err(|e| e.to_string()),
                Err(why) => Err(why),
            };
            match priced {
                Ok(p) if best.as_ref().is_none_or(|b| p.iteration_time_s < b.plan.iteration_time_s) => {
                    best = Some(Substitute { plan: p, moves, retyped: Some(gpu.to_string()) });
                }
                Ok(_) => {}
                Err(why) => tracing::debug!(job = job.id, "replica {replica} does not move onto {gpu} GPUs: {why}"),
            }
        }
        best
    }

    /// The joining replicas' ranks not started yet, sent to their nodes with the epoch's document.
    async fn send_joining(&self, job: &JobRecord, now: &Launched) -> Result<()> {
        let m = &now.membership;
        let ranks: Vec<i64> = now
            .ranks
            .iter()
            .filter(|r| m.joining.contains(&(r.assignment.replica as u32)) && r.state == "assigned")
            .map(|r| r.assignment.rank)
            .collect();
        if ranks.is_empty() {
            return Ok(());
        }
        let doc = serde_json::to_string(m).map_err(|e| crate::error::CoordinatorError::Conflict(e.to_string()))?;
        if !launch::send_rejoin(&self.store, &self.fleet, job, &ranks, m.epoch, &doc).await? {
            // Sent again at the next look (`degraded_members`).
            self.memberships.sent.lock().expect("memberships").remove(&(job.id, job.generation));
        }
        Ok(())
    }

    /// A degraded launch none of whose replicas is lost any more, every member's rank running
    /// and every joining rank's copy from the members' live state told by its agent: it runs
    /// whole again (`degraded -> running`), and each replica that rejoined is recorded
    /// (`rejoined`: the epoch, the replica, its ranks, the bytes its ranks copied, the seconds
    /// since the epoch opened, and the longest copy).
    pub(super) async fn whole_again(&self, job: &JobRecord, members: &[RankRecord]) -> Result<()> {
        if members.is_empty() || !members.iter().all(|r| r.state == "running") {
            return Ok(());
        }
        let Some(e) = self.store.last_event(job.id, job.generation, membership::EVENT).await? else { return Ok(()) };
        let Ok(m) = serde_json::from_str::<Membership>(&e.message) else { return Ok(()) };
        if !m.lost.is_empty() {
            return Ok(());
        }
        let mut rejoined = vec![];
        for &replica in &m.joining {
            let ranks: Vec<i64> = members.iter().filter(|r| r.assignment.replica as u32 == replica).map(|r| r.assignment.rank).collect();
            let told: Vec<_> =
                ranks.iter().filter_map(|&rank| self.facts.rejoin(job.id, job.generation, rank)).filter(|x| x.epoch == m.epoch).collect();
            // A rank still copying (or whose agent has not told it yet): not whole yet.
            if told.len() < ranks.len() {
                return Ok(());
            }
            let bytes: u64 = told.iter().map(|x| x.bytes).sum();
            let copy_seconds = told.iter().map(|x| x.copy_seconds).fold(0.0, f64::max);
            rejoined.push((replica, ranks, bytes, copy_seconds));
        }
        if launch::move_job(&self.store, job.id, job.generation, JobState::Running, None).await {
            let seconds = (crate::store::now_ms() - e.at_ms) as f64 / 1000.0;
            for (replica, ranks, bytes, copy_seconds) in rejoined {
                let doc = serde_json::json!({
                    "epoch": m.epoch, "replica": replica, "ranks": ranks, "bytes": bytes, "seconds": seconds,
                    "copy_seconds": copy_seconds,
                });
                self.store.record_event(Some(job.id), Some(job.generation), REJOINED, &doc.to_string()).await?;
            }
            self.facts.forget_rejoins(job.id, job.generation);
        }
        Ok(())
    }

    /// A degraded job's membership in force, for its view (docs/keep-going.md); None for a job
    /// in any other state. An event that does not read as a membership is logged and left out
    /// of the view: one job's view does not fail the list.
    pub async fn membership_view(&self, job: &JobRecord) -> Result<Option<MembershipView>> {
        if job.state != JobState::Degraded {
            return Ok(None);
        }
        let Some(e) = self.store.last_event(job.id, job.generation, membership::EVENT).await? else { return Ok(None) };
        match serde_json::from_str::<Membership>(&e.message) {
            Ok(m) => Ok(Some(m.view())),
            Err(err) => {
                tracing::warn!(job = job.id, "stored {} does not read as a membership: {err}", membership::EVENT);
                Ok(None)
            }
        }
    }

    /// The launch has ended (over, or relaunched): forget what was sent for it.
    pub(super) fn forget_membership(&self, id: i64, generation: i64) {
        self.memberships.sent.lock().expect("memberships").remove(&(id, generation));
        self.facts.forget_rejoins(id, generation);
    }
}

/// Where a lost replica goes: the plan amended (and priced) for it, its GPUs' moves, and the
/// GPU type it now computes on where that is not its own.
struct Substitute {
    plan: PlanDocument,
    moves: BTreeMap<motley_contract::GpuRef, motley_contract::GpuRef>,
    retyped: Option<String>,
}

/// The ranks of `replica` as `plan` (amended) places them; their local ranks numbered after the
/// launch's other ranks already on each node (theirs do not change).
fn moved_ranks(plan: &PlanDocument, replica: u32, ranks: &[RankRecord]) -> Vec<crate::store::RankAssignment> {
    let mut next: HashMap<String, i64> = HashMap::new();
    for r in ranks.iter().filter(|r| r.assignment.replica as u32 != replica) {
        let n = next.entry(r.assignment.node.clone()).or_insert(0);
        *n = (*n).max(r.assignment.local_rank + 1);
    }
    let mut out: Vec<_> = crate::planning::ranks_of(plan).into_iter().filter(|a| a.replica as u32 == replica).collect();
    for a in &mut out {
        let n = next.entry(a.node.clone()).or_insert(0);
        a.local_rank = *n;
        *n += 1;
    }
    out
}
