//! A job's membership after a lost replica (docs/keep-going.md), as pure rules: which replicas
//! a loss takes, how the survivors split the same global batch (the planner's allocator, by
//! the speeds it priced), and where the new epoch's store is. The job's life (`life::keep_going`)
//! decides when; this only computes.

use std::collections::{BTreeMap, BTreeSet};

use motley_contract::PlanDocument;
use motley_solver::search::alloc::allocate;
use motley_solver::search::shapes::Point;
use serde::{Deserialize, Serialize};

/// The event a new membership is recorded as (its message: the document below, as JSON).
pub const EVENT: &str = "membership_changed";

/// Where an epoch's ranks meet (its rendezvous store).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StoreAddr {
    pub host: String,
    pub port: u32,
}

/// A membership as the ranks read it (`motley_torch.distributed.membership`) and the event
/// records it. `micro_batches` is keyed by replica index as a string (JSON object keys).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Membership {
    pub epoch: i64,
    pub replicas: Vec<u32>,
    pub lost: Vec<u32>,
    pub micro_batches: BTreeMap<String, u32>,
    pub store: StoreAddr,
    /// The lowest global rank of the members training on (none `joining`, where it can be
    /// helped): it hosts the store and prints the progress.
    pub leader: u32,
    pub reason: String,
    /// What the planner's prices make of the members' share of the plan's throughput (the
    /// plan's iteration time over the members' with the new split; 0 where the plan has none).
    #[serde(default)]
    pub throughput_share: f64,
    /// Member replicas that come back in this epoch: their ranks start afresh in the same launch
    /// and take their state from the others' live state (docs/keep-going.md).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub joining: Vec<u32>,
}

impl Membership {
    /// What the job's view shows of it.
    pub fn view(&self) -> motley_contract::views::MembershipView {
        motley_contract::views::MembershipView {
            epoch: self.epoch,
            replicas: self.replicas.clone(),
            lost: self.lost.clone(),
            throughput_share: self.throughput_share,
            reason: self.reason.clone(),
        }
    }
}

/// Whether a job with this plan keeps going through a lost replica: the job file allows it
/// (`keep_going`, default yes), the plan has replicas to lose, and its optimizer state is not
/// sharded across them (ZeRO-1: a lost replica takes shards with it, so those jobs recover
/// whole from a checkpoint).
pub fn keeps_going(allowed: Option<bool>, plan: &PlanDocument) -> bool {
    allowed.unwrap_or(true) && plan.replicas.len() >= 2 && !plan.zero1
}

/// Epoch 0: every replica of the plan, its split, the launch's own store.
pub fn initial(plan: &PlanDocument, master: StoreAddr) -> Membership {
    Membership {
        epoch: 0,
        replicas: (0..plan.replicas.len() as u32).collect(),
        lost: vec![],
        micro_batches: plan.replicas.iter().enumerate().map(|(i, r)| (i.to_string(), r.micro_batches)).collect(),
        store: master,
        leader: 0,
        reason: String::new(),
        throughput_share: 1.0,
        joining: vec![],
    }
}

/// The first global rank of each replica (ranks are numbered replica by replica, stage by
/// stage, as `PlanDocument::placements`).
fn first_ranks(plan: &PlanDocument) -> Vec<u32> {
    let mut next = 0;
    plan.replicas
        .iter()
        .map(|r| {
            let first = next;
            next += r.stages.iter().map(|s| s.gpus.len() as u32).sum::<u32>();
            first
        })
        .collect()
}

/// Why a job cannot keep going through a loss: it recovers whole instead.
#[derive(Debug, Clone, PartialEq)]
pub struct CannotKeepGoing(pub String);

/// The membership after `current` loses `lost` (replica indices; those not members are
/// ignored). `store_host(rank)`: the address of the node of a global rank; `ports`: the
/// launch's two rendezvous ports (its own and the other parity's). The store stays where it is
/// while its host leads; a new leader hosts it on the port the current one does not use.
pub fn next(
    plan: &PlanDocument,
    current: &Membership,
    lost: &BTreeSet<u32>,
    reason: &str,
    store_host: impl Fn(u32) -> String,
    ports: (u32, u32),
) -> Result<Membership, CannotKeepGoing> {
    let now_lost: BTreeSet<u32> = current.replicas.iter().copied().filter(|r| lost.contains(r)).collect();
    let members: Vec<u32> = current.replicas.iter().copied().filter(|r| !now_lost.contains(r)).collect();
    if members.is_empty() {
        return Err(CannotKeepGoing(format!("no replica survives whole ({reason})")));
    }
    let (split, time) = split(plan, &members)?;
    // A replica that was joining may not hold the job's state yet: it leads only where no
    // other member is left.
    let lead = members.iter().copied().find(|r| !current.joining.contains(r)).unwrap_or(members[0]);
    let leader = first_ranks(plan)[lead as usize];
    let store = if leader == current.leader {
        current.store.clone()
    } else {
        let port = if current.store.port == ports.0 { ports.1 } else { ports.0 };
        StoreAddr { host: store_host(leader), port }
    };
    let mut all_lost: Vec<u32> = current.lost.iter().copied().chain(now_lost).collect();
    all_lost.sort_unstable();
    Ok(Membership {
        epoch: current.epoch + 1,
        replicas: members,
        lost: all_lost,
        micro_batches: split.into_iter().map(|(r, k)| (r.to_string(), k)).collect(),
        store,
        leader,
        reason: reason.to_string(),
        throughput_share: if time > 0.0 && plan.iteration_time_s > 0.0 { plan.iteration_time_s / time } else { 0.0 },
        joining: vec![],
    })
}

/// The membership in which lost replicas `back` (those of `current.lost`) rejoin: members
/// again, named `joining`, the split the planner's allocator gives the members (the plan's own
/// when every replica is a member again), the store and leader as they are (a joining rank has
/// no state to lead with). None when none of `back` is lost.
pub fn rejoin(
    plan: &PlanDocument,
    current: &Membership,
    back: &BTreeSet<u32>,
    reason: &str,
) -> Result<Option<Membership>, CannotKeepGoing> {
    let joining: Vec<u32> = current.lost.iter().copied().filter(|r| back.contains(r)).collect();
    if joining.is_empty() {
        return Ok(None);
    }
    let mut members: Vec<u32> = current.replicas.iter().copied().chain(joining.iter().copied()).collect();
    members.sort_unstable();
    let lost: Vec<u32> = current.lost.iter().copied().filter(|r| !back.contains(r)).collect();
    let (micro_batches, share) = if lost.is_empty() {
        (plan.replicas.iter().enumerate().map(|(i, r)| (i.to_string(), r.micro_batches)).collect(), 1.0)
    } else {
        let (split, time) = split(plan, &members)?;
        let share = if time > 0.0 && plan.iteration_time_s > 0.0 { plan.iteration_time_s / time } else { 0.0 };
        (split.into_iter().map(|(r, k)| (r.to_string(), k)).collect(), share)
    };
    Ok(Some(Membership {
        epoch: current.epoch + 1,
        replicas: members,
        lost,
        micro_batches,
        store: current.store.clone(),
        leader: current.leader,
        reason: reason.to_string(),
        throughput_share: share,
        joining,
    }))
}

/// `plan` with the global batch split again over all its replicas by the speeds it is priced
/// at (a replica re-priced on another GPU type takes the share its new speed earns).
pub fn split_all(plan: &PlanDocument) -> Result<PlanDocument, CannotKeepGoing> {
    let all: Vec<u32> = (0..plan.replicas.len() as u32).collect();
    let (shares, _) = split(plan, &all)?;
    let mut out = plan.clone();
    for (i, r) in out.replicas.iter_mut().enumerate() {
        r.micro_batches = shares[&(i as u32)];
        r.samples = Some(r.micro_batches * plan.micro_batch);
    }
    Ok(out)
}

/// The members' split of the plan's micro-batches, by the planner's exact allocator
/// (`search::alloc`), and the iteration time it prices. Each member's time for k micro-batches
/// is read off what the plan priced: a period of its slowest stage's forward and backward, and a
/// base that makes its planned share cost its planned iteration time. A plan written by hand
/// (no prices) splits by the planned shares instead.
fn split(plan: &PlanDocument, members: &[u32]) -> Result<(BTreeMap<u32, u32>, f64), CannotKeepGoing> {
    let total: u32 = plan.replicas.iter().map(|r| r.micro_batches).sum();
    let priced = members.iter().all(|&m| {
        let r = &plan.replicas[m as usize];
        r.iteration_time_s > 0.0 && r.stages.iter().all(|s| s.fwd_s + s.bwd_s > 0.0)
    });
    let points: Vec<Point> = members
        .iter()
        .map(|&m| {
            let r = &plan.replicas[m as usize];
            if priced {
                let period = r.stages.iter().map(|s| s.fwd_s + s.bwd_s).fold(0.0, f64::max);
                let base = (r.iteration_time_s - f64::from(r.micro_batches.max(1) - 1) * period).max(period);
                Point { base, period, split: 0 }
            } else {
                // As fast per micro-batch as its planned share says.
                let period = 1.0 / f64::from(r.micro_batches.max(1));
                Point { base: period, period, split: 0 }
            }
        })
        .collect();
    let groups: Vec<(&[Point], u32)> = points.iter().map(|p| (std::slice::from_ref(p), 1)).collect();
    let Some((time, shares)) = allocate(&groups, total) else {
        return Err(CannotKeepGoing(format!(
            "the {} surviving replicas cannot split {total} micro-batches (each takes one at least)",
            members.len()
        )));
    };
    let split = members.iter().zip(shares).map(|(&m, k)| (m, k[0])).collect();
    Ok((split, if priced { time } else { 0.0 }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(shares: &[(u32, f64, usize)]) -> PlanDocument {
        // (micro-batches, seconds per micro-batch, GPUs) per replica, one stage each.
        let replicas: Vec<serde_json::Value> = shares
            .iter()
            .enumerate()
            .map(|(i, &(k, t, g))| {
                let gpus: Vec<_> = (0..g).map(|j| serde_json::json!({"node": format!("n{i}"), "index": j})).collect();
                serde_json::json!({"micro_batches": k, "samples": k * 2, "iteration_time_s": t * f64::from(k),
                    "stages": [{"layers": [0, 4], "gpu": "A100", "tp": 1, "dp": g, "gpus": gpus, "fwd_s": t / 3.0, "bwd_s": 2.0 * t / 3.0}]})
            })
            .collect();
        let total: u32 = shares.iter().map(|s| s.0).sum();
        let doc = serde_json::json!({"cluster": "c", "model": "m", "global_batch": total * 2, "micro_batch": 2,
            "iteration_time_s": shares.iter().map(|s| s.1 * f64::from(s.0)).fold(0.0, f64::max), "replicas": replicas});
        PlanDocument::from_json(&doc.to_string()).unwrap()
    }

    fn master() -> StoreAddr {
        StoreAddr { host: "n0".into(), port: 29502 }
    }

    #[test]
    fn the_survivors_split_the_same_global_batch_by_their_speed() {
        // Replica 0 twice as fast as 1 and 2: 6, 3, 3 micro-batches planned.
        let p = plan(&[(6, 1.0, 1), (3, 2.0, 1), (3, 2.0, 1)]);
        let m0 = initial(&p, master());
        let m1 = next(&p, &m0, &BTreeSet::from([1]), "node n1 lost", |r| format!("host-of-{r}"), (29502, 29503)).unwrap();
        assert_eq!((m1.epoch, m1.replicas.clone(), m1.lost.clone()), (1, vec![0, 2], vec![1]));
        assert_eq!(m1.micro_batches, BTreeMap::from([("0".into(), 8), ("2".into(), 4)]), "12 micro-batches, 2:1 by speed");
        assert_eq!((m1.leader, m1.store.clone()), (0, master()), "the leader stays: so does the store");
        assert!((m1.throughput_share - 6.0 / 8.0).abs() < 1e-9, "{}", m1.throughput_share);
        // The leader's replica next: rank 2 (replica 2's first) leads, on the other port.
        let m2 = next(&p, &m1, &BTreeSet::from([0, 1]), "node n0 lost", |r| format!("host-of-{r}"), (29502, 29503)).unwrap();
        assert_eq!((m2.epoch, m2.replicas.clone(), m2.lost.clone()), (2, vec![2], vec![0, 1]));
        assert_eq!(m2.micro_batches, BTreeMap::from([("2".into(), 12)]));
        assert_eq!((m2.leader, m2.store.clone()), (2, StoreAddr { host: "host-of-2".into(), port: 29503 }));
        let e = next(&p, &m2, &BTreeSet::from([2]), "node n2 lost", |_| String::new(), (29502, 29503)).unwrap_err();
        assert!(e.0.contains("no replica survives whole"), "{e:?}");
    }

    #[test]
    fn a_loss_of_replicas_already_gone_changes_nothing_but_the_reason_and_ranks_count_by_gpus() {
        let p = plan(&[(2, 1.0, 2), (2, 1.0, 3), (2, 1.0, 1)]);
        assert_eq!(first_ranks(&p), vec![0, 2, 5]);
        let m1 = next(&p, &initial(&p, master()), &BTreeSet::from([0]), "x", |r| format!("h{r}"), (29502, 29503)).unwrap();
        assert_eq!((m1.leader, m1.store.port), (2, 29503));
        assert_eq!(m1.micro_batches.values().sum::<u32>(), 6);
        assert!(keeps_going(None, &p) && !keeps_going(Some(false), &p));
        let one = plan(&[(4, 1.0, 1)]);
        assert!(!keeps_going(Some(true), &one), "one replica: nothing to keep going with");
    }

    #[test]
    fn a_lost_replica_rejoins_under_the_same_leader_and_store_and_never_leads_while_joining() {
        let p = plan(&[(6, 1.0, 1), (3, 2.0, 1), (3, 2.0, 1)]);
        let ports = (29502, 29503);
        // Replica 0 (rank 0, the store) lost: rank 1 leads on the other port.
        let m1 = next(&p, &initial(&p, master()), &BTreeSet::from([0]), "n0 lost", |r| format!("h{r}"), ports).unwrap();
        assert_eq!((m1.leader, m1.store.port), (1, 29503));
        assert_eq!(rejoin(&p, &m1, &BTreeSet::from([2]), "x").unwrap(), None, "replica 2 was not lost");
        let m2 = rejoin(&p, &m1, &BTreeSet::from([0]), "n0 back").unwrap().unwrap();
        assert_eq!((m2.epoch, m2.replicas.clone(), m2.lost.clone(), m2.joining.clone()), (2, vec![0, 1, 2], vec![], vec![0]));
        assert_eq!((m2.leader, m2.store.clone()), (1, m1.store.clone()), "the store stays with the rank that holds the state");
        assert_eq!(m2.micro_batches, BTreeMap::from([("0".into(), 6), ("1".into(), 3), ("2".into(), 3)]), "the plan's own split");
        assert_eq!(m2.throughput_share, 1.0);
        let doc = serde_json::to_value(&m2).unwrap();
        assert_eq!(doc["joining"], serde_json::json!([0]));
        assert!(serde_json::to_value(&m1).unwrap().get("joining").is_none(), "absent when none joins");
        // Replica 1 lost while replica 0 still joins: replica 2 leads, not the joining one.
        let m3 = next(&p, &m2, &BTreeSet::from([1]), "n1 lost", |r| format!("h{r}"), ports).unwrap();
        assert_eq!((m3.replicas.clone(), m3.leader, m3.joining.clone()), (vec![0, 2], 2, vec![]));
    }

    #[test]
    fn a_plan_written_by_hand_splits_by_its_planned_shares() {
        let mut p = plan(&[(3, 1.0, 1), (2, 1.0, 1), (1, 1.0, 1)]);
        for r in &mut p.replicas {
            r.iteration_time_s = 0.0;
        }
        let m = next(&p, &initial(&p, master()), &BTreeSet::from([1]), "x", |_| "h".into(), (1, 2)).unwrap();
        // 3:1 speeds over 6 micro-batches: 5 and 1 finish by 5/3 of a time unit, 4 and 2 by 2.
        assert_eq!(m.micro_batches, BTreeMap::from([("0".into(), 5), ("2".into(), 1)]));
        assert_eq!(m.throughput_share, 0.0, "no prices, no predicted share");
    }
}
