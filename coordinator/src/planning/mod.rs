//! Planning a job onto what it may use now: the offer (active nodes within its resources, live
//! ones for a launch, minus the GPUs other launches and profile runs hold), the measured
//! profiles, the solver within the job's deadline, and the rank numbering. Below the job's
//! life (`life`): it stores a first launch (`plan_job`) or returns a recovery's plan
//! (`plan_for_recovery`), and decides nothing else. Links the agents measured between the
//! offered nodes (`Fleet.links`) are in force where there are any (`Cluster::with_measurements`),
//! and every plan says which rates it assumed (`PlanDocument.network`).

pub mod membership;
pub mod profiling;
pub mod restore_plan;
pub mod substitute;

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

use motley_solver::bandwidth::{plan_network as links_of, BandwidthSpec, PlanNetwork};
use motley_solver::hardware::NodeSpec;
use motley_solver::placement::GpuId;
use motley_solver::replan::{ReplanReport, SwitchPolicy};
use motley_solver::{Cluster, ClusterSpec, PlanDocument, PlanRequest, ProfileSet};

use crate::error::{CoordinatorError, Result};
use crate::job::spec::{JobSpec, ProfilingMode};
use crate::job::JobState;
use crate::planning::profiling::Prepared;
use crate::state::fleet::Fleet;
use crate::store::{JobRecord, NodeState, RankAssignment, Store};

/// How long planning the job may take: its `plan_timeout_s`, or the coordinator's.
fn deadline(fleet: &Fleet, spec: &JobSpec) -> std::time::Duration {
    spec.plan_timeout_s.map_or(fleet.plan_deadline, |s| std::time::Duration::from_secs(u64::from(s)))
}

/// Plan a job file without storing anything, on the declared inventory (active nodes, live or
/// not: operators plan before the agents are up).
pub async fn dry_run(store: &Store, fleet: &Fleet, spec: &JobSpec) -> Result<(PlanDocument, Vec<RankAssignment>)> {
    check_plan_gpus(store, spec).await?;
    let offer = offer(store, spec, None).await?;
    let profiles = crate::planning::profiling::stored_for(store, spec).await?;
    let measured = measured(fleet, &offer);
    solve(spec, offer, profiles, measured, None, deadline(fleet, spec)).await.map(|s| (s.report, s.ranks))
}

/// The links measured among the offer's nodes, in the `--bandwidth` file's schema; None when
/// none was.
fn measured(fleet: &Fleet, offer: &Offer) -> Option<BandwidthSpec> {
    let names: Vec<String> = offer.nodes.iter().map(|n| n.name.clone()).collect();
    fleet.links.bandwidth_spec(&names)
}

/// GPUs no new launch may use: those of every launched job's current launch, those of ranks
/// still reported running on a live node, and those a profile run measures on now.
pub async fn taken(store: &Store, fleet: &Fleet, jobs: &[JobRecord]) -> Result<Taken> {
    let launched: HashSet<i64> = jobs
        .iter()
        .filter(|j| matches!(j.state, JobState::Launching | JobState::Running | JobState::Degraded | JobState::Recovering))
        .map(|j| j.id)
        .collect();
    let mut taken = Taken::new();
    for h in store.held_gpus().await? {
        if launched.contains(&h.job) || (h.running && fleet.live(&h.node)) {
            taken.entry(h.node).or_default().insert(h.gpu as u32, h.job);
        }
    }
    // GPUs a profile run measures on now (job 0: no job holds them; see PROFILING).
    for (node, gpu) in crate::planning::profiling::gpus_in_use(store).await? {
        taken.entry(node).or_default().entry(gpu).or_insert(PROFILING);
    }
    Ok(taken)
}

/// GPUs held by launched jobs (launching or running): node -> GPU index -> job.
pub type Taken = HashMap<String, BTreeMap<u32, i64>>;

/// The "job" in `Taken` of a GPU a profile run measures on.
pub const PROFILING: i64 = 0;

/// What planning a queued job came to.
#[derive(Debug)]
pub enum Planned {
    /// Planned and stored as a new launch (`launching`).
    Launched(JobRecord),
    /// Its share of GPUs is not free yet; nothing changed. The reason names what it waits for.
    Waiting(String),
    /// The planner (or the inventory) said no: the job is `failed` with the reason.
    Failed(JobRecord),
}

/// Plan a queued job on the live inventory (active nodes with a live agent, within the job's
/// resources) minus the GPUs `taken` by other launches, and store its first launch:
/// `submitted -> planning -> launching` with generation 1, or `failed` with the planner's
/// reason. A job waits (nothing changes) while fewer GPUs are free than it would get on an
/// idle cluster: it is gang-scheduled, whole or not at all.
#[tracing::instrument(skip(store, fleet, taken))]
pub async fn plan_job(store: &Store, fleet: &Fleet, id: i64, taken: &Taken) -> Result<Planned> {
    let job = store.job(id).await?;
    let spec: JobSpec = serde_json::from_str(&job.spec).map_err(|e| CoordinatorError::Conflict(format!("stored job spec: {e}")))?;
    if let Err(e) = check_plan_gpus(store, &spec).await {
        return fail_planning(store, &job, e).await;
    }
    let offer = match offer(store, &spec, Some((fleet, taken))).await {
        Ok(o) => o,
        Err(e) => return fail_planning(store, &job, e).await,
    };
    let holders = || {
        let name = |j: &i64| if *j == PROFILING { "a profile run".to_string() } else { j.to_string() };
        offer.holders.iter().map(name).collect::<Vec<_>>().join(", ")
    };
    // A carried plan names its GPUs: it waits for those (below), not for a share.
    if spec.plan.is_none() && offer.free < offer.wanted {
        return Ok(Planned::Waiting(format!(
            "waiting for {} GPUs: {} of the {} it may use are free; job(s) {} hold the rest",
            offer.wanted,
            offer.free,
            offer.capacity,
            holders()
        )));
    }
    let (partial, free, held_by) = (offer.free < offer.capacity, offer.free, holders());
    // Measured layer profiles: stored ones, and runs sent for what is missing (the job waits).
    let offered: Vec<(NodeSpec, Vec<u32>)> =
        offer.nodes.iter().map(|n| (n.clone(), offer.real.get(&n.name).cloned().unwrap_or_default())).collect();
    let (profiles, without) = match crate::planning::profiling::prepare(store, fleet, id, &spec, &offered).await {
        Ok(Prepared::Waiting(why)) => return Ok(Planned::Waiting(why)),
        Ok(Prepared::Ready { profiles, without }) => (profiles, without),
        Err(e @ CoordinatorError::Database(_)) => return Err(e),
        Err(e) => return fail_planning(store, &job, e).await,
    };
    let measured = measured(fleet, &offer);
    let wanted = offer.wanted;
    match solve(&spec, offer, profiles, measured, None, deadline(fleet, &spec)).await {
        Ok(Solved { report, ranks, .. }) => {
            if !without.is_empty() {
                store.record_event(Some(id), None, "profiling", &crate::planning::profiling::roofline_summary(&without)).await?;
            }
            if let Some(why) = unused_gpus(&spec, &report, wanted) {
                store.record_event(Some(id), None, "plan", &why).await?;
            }
            // A job found in `planning` was left there by a coordinator that stopped.
            if job.state != JobState::Planning {
                store.transition(id, JobState::Planning, None).await?;
            }
            let plan = serde_json::to_string(&report).expect("a plan serialises");
            match store.start_generation(id, &plan, &ranks).await {
                // Another claim (a lost replica's move) landed since this pass looked: the
                // next pass plans on what is free then.
                Err(CoordinatorError::GpusHeld(why)) => return Ok(Planned::Waiting(why)),
                done => done?,
            };
            Ok(Planned::Launched(store.job(id).await?))
        }
        // Other jobs hold some of its GPUs: what is free may not fit it (too few per node for
        // its layers, say), but all of them might once those jobs end.
        // A plan out of time fails whatever is free: waiting would spend the deadline again on
        // every pass.
        // A wrong field will not come right by waiting either.
        Err(e) if partial && !matches!(e, CoordinatorError::DeadlineExceeded(_) | CoordinatorError::InvalidInput { .. }) => {
            Ok(Planned::Waiting(format!("waiting for more GPUs: the {free} free do not fit it ({e}); job(s) {held_by} hold the rest")))
        }
        Err(e) => fail_planning(store, &job, e).await,
    }
}

/// Why a plan leaves GPUs the job may use idle, when it does (a carried plan names its own):
/// a job asking for 3 GPUs and running on 2 is told why, naming `resources.gpus` and
/// `global_batch`.
pub fn unused_gpus(spec: &JobSpec, report: &PlanDocument, wanted: u32) -> Option<String> {
    if spec.plan.is_some() || report.gpus_used >= wanted {
        return None;
    }
    let (used, idle) = (report.gpus_used, wanted - report.gpus_used);
    let may = match spec.resources.gpus {
        Some(g) => format!("the {wanted} GPUs it may use (resources.gpus: {g})"),
        None => format!("the {wanted} GPUs of its nodes"),
    };
    let why = if spec.global_batch < wanted {
        format!(
            "global_batch is {}: a data-parallel GPU takes at least one whole sequence of each batch, and no faster plan \
             uses the rest as pipeline stages or tensor-parallel ranks; raise global_batch or lower resources.gpus",
            spec.global_batch
        )
    } else {
        "the search found no faster plan that uses them".to_string()
    };
    let stay = if idle == 1 { "stays" } else { "stay" };
    Some(format!("the plan uses {used} of {may}; {idle} {stay} idle: {why}"))
}

/// What a recovery plans: the plan document, its ranks, and why it leaves GPUs idle that the
/// job may use, when it does (an event of the recovery).
pub struct RecoveryPlan {
    pub plan: String,
    pub ranks: Vec<RankAssignment>,
    pub fewer_gpus: Option<String>,
}

/// The GPUs a recovering job could be planned on now (what `plan_for_recovery` offers it): none
/// while every node it may use is lost, drained or held by other jobs (an offer that cannot be
/// made counts as none: `plan_for_recovery` then says why).
pub async fn free_for_recovery(store: &Store, fleet: &Fleet, job: &JobRecord, taken: &Taken) -> Result<u32> {
    match recovery_offer(store, fleet, job, taken).await {
        Ok((_, offer)) => Ok(offer.free),
        Err(CoordinatorError::Conflict(_)) => Ok(0),
        Err(e) => Err(e),
    }
}

/// A recovering job's spec and what it is offered now: every GPU of a live, active node within
/// its resources that no other job holds (its own old launch's included: its ranks were stopped).
async fn recovery_offer(store: &Store, fleet: &Fleet, job: &JobRecord, taken: &Taken) -> Result<(JobSpec, Offer)> {
    let spec: JobSpec = serde_json::from_str(&job.spec).map_err(|e| CoordinatorError::Conflict(format!("stored job spec: {e}")))?;
    let mut others = taken.clone();
    for gpus in others.values_mut() {
        gpus.retain(|_, j| *j != job.id);
    }
    let offer = offer(store, &spec, Some((fleet, &others))).await?;
    Ok((spec, offer))
}

/// Plan a recovering job again on what it can use now: live, active nodes within its
/// resources, every GPU no other job holds (its own old launch's included: its ranks were
/// stopped). The plan it replaces seeds the search when all its GPUs are offered again, so the
/// new plan is never slower than it on what is known now (measured links and profiles may
/// price it otherwise than when it was made). Nothing is stored; the recovery launches it once
/// the restore is in place.
#[tracing::instrument(skip(store, fleet, taken))]
pub async fn plan_for_recovery(store: &Store, fleet: &Fleet, job: &JobRecord, taken: &Taken) -> Result<RecoveryPlan> {
    let (spec, offer) = recovery_offer(store, fleet, job, taken).await?;
    if offer.free == 0 {
        return Err(CoordinatorError::Conflict("no free GPU on a live node: nothing to recover onto".into()));
    }
    // A plan it cannot read, or one on GPUs not offered now (a node lost), seeds nothing.
    let replaced: Option<PlanDocument> = store.plan(job.id, job.generation).await.ok().and_then(|p| serde_json::from_str(&p).ok());
    let seed = replaced.as_ref().and_then(|p| in_offer_numbers(p, &offer.real).ok());
    let profiles = crate::planning::profiling::stored_for(store, &spec).await?;
    let measured = measured(fleet, &offer);
    let may_use = offer.wanted.min(offer.free);
    let solved = solve(&spec, offer, profiles, measured, seed, deadline(fleet, &spec)).await?;
    let fewer_gpus = unused_gpus(&spec, &solved.report, may_use).map(|why| match (&replaced, solved.replaced_now_s) {
        (Some(old), Some(now)) => format!(
            "{why}; the plan it replaces, on its {} GPUs, takes {now:.3e} s per iteration on the links and profiles known \
             now (it was priced at {:.3e} s when it was made), this one {:.3e} s",
            old.replicas.iter().flat_map(|r| &r.stages).map(|s| s.gpus.len()).sum::<usize>(),
            old.iteration_time_s,
            solved.report.iteration_time_s
        ),
        _ => format!("{why}; the plan it replaces held GPUs that are not offered now"),
    });
    Ok(RecoveryPlan { plan: serde_json::to_string(&solved.report).expect("a plan serialises"), ranks: solved.ranks, fewer_gpus })
}

/// A running job's plan priced on the links measured now beside a plan made afresh on them (the
/// solver's `replan`, seeded with the running plan), on what a recovery would offer it. Nothing
/// is stored: the job's life decides whether to switch (`life::network`).
#[tracing::instrument(skip(store, fleet, taken))]
pub async fn replan_running(store: &Store, fleet: &Fleet, job: &JobRecord, taken: &Taken) -> Result<ReplanReport> {
    let spec: JobSpec = serde_json::from_str(&job.spec).map_err(|e| CoordinatorError::Conflict(format!("stored job spec: {e}")))?;
    let mut others = taken.clone();
    for gpus in others.values_mut() {
        gpus.retain(|_, j| *j != job.id);
    }
    let offer = offer(store, &spec, Some((fleet, &others))).await?;
    let current: PlanDocument = serde_json::from_str(&store.plan(job.id, job.generation).await?)
        .map_err(|e| CoordinatorError::Conflict(format!("stored plan: {e}")))?;
    let current = in_offer_numbers(&current, &offer.real)?;
    let profiles = crate::planning::profiling::stored_for(store, &spec).await?;
    let measured = measured(fleet, &offer);
    let declared =
        Cluster::from_spec(&ClusterSpec { name: "live".into(), nodes: offer.nodes, gpu_types: crate::state::catalog::declared() })
            .map_err(|e| CoordinatorError::Conflict(format!("inventory: {e}")))?;
    let (cluster, _) = with_measurements(&declared, measured);
    let model = spec.model()?;
    let (mut opts, mode) = spec.plan_options()?;
    opts.precision = spec.precision(&cluster);
    let deadline = deadline(fleet, &spec);
    let planner = tokio::task::spawn_blocking(move || {
        let req =
            PlanRequest { cluster: &cluster, model: &model, profiles: &profiles, opts: &opts, mode, exhaustive: false, seeds: vec![] };
        // Every faster plan is reported; whether it pays is the caller's to weigh.
        motley_solver::replan::replan(&req, &current, SwitchPolicy { min_gain: 0.0, horizon: f64::INFINITY })
    });
    let planned = tokio::time::timeout(deadline, planner)
        .await
        .map_err(|_| CoordinatorError::DeadlineExceeded(format!("re-planning took longer than {} ms", deadline.as_millis())))?;
    planned
        .map_err(|e| CoordinatorError::Conflict(format!("planner: {e}")))?
        .map_err(|e| CoordinatorError::Conflict(format!("re-plan: {e}")))
}

/// A running launch's plan amended in place (a lost replica moved onto other nodes,
/// `substitute`), checked and priced as given on the nodes it names now (their whole
/// inventories, the links measured among them), in the precision it runs in: its stages'
/// times, its communication groups' settings and its `network` section are those of where its
/// GPUs are now. Refused, naming the field, where a moved stage does not fit its new GPUs'
/// memory or their type lacks the plan's precision. Nothing is stored.
pub async fn price_amended(store: &Store, fleet: &Fleet, spec: &JobSpec, plan: &PlanDocument) -> Result<PlanDocument> {
    let names: BTreeSet<&str> = plan.replicas.iter().flat_map(|r| &r.stages).flat_map(|s| &s.gpus).map(|g| g.node.as_str()).collect();
    let mut nodes = vec![];
    for n in store.nodes().await?.into_iter().filter(|n| names.contains(n.name.as_str())) {
        let entry: NodeSpec = serde_json::from_str(&n.inventory)
            .map_err(|e| CoordinatorError::Conflict(format!("node {}: stored inventory: {e}", n.name)))?;
        nodes.push(entry);
    }
    let listed: Vec<String> = nodes.iter().map(|n| n.name.clone()).collect();
    let measured = fleet.links.bandwidth_spec(&listed);
    // A job planned on measured profiles only moves where they were measured.
    let only_measured = (spec.profiling().mode == ProfilingMode::Only).then(|| nodes.clone());
    let declared = Cluster::from_spec(&ClusterSpec { name: "live".into(), nodes, gpu_types: crate::state::catalog::declared() })
        .map_err(|e| CoordinatorError::Conflict(format!("inventory: {e}")))?;
    let (cluster, measured) = with_measurements(&declared, measured);
    let model = spec.model()?;
    let (mut opts, mode) = spec.plan_options()?;
    opts.precision = plan.precision.unwrap_or_else(|| spec.precision(&cluster));
    let profiles = crate::planning::profiling::stored_for(store, spec).await?;
    let doc = plan.clone();
    let deadline = deadline(fleet, spec);
    let pricer = tokio::task::spawn_blocking(move || {
        let req =
            PlanRequest { cluster: &cluster, model: &model, profiles: &profiles, opts: &opts, mode, exhaustive: false, seeds: vec![] };
        motley_solver::report::given(&req, &doc).map(|report| (report, profiles))
    });
    let priced = tokio::time::timeout(deadline, pricer)
        .await
        .map_err(|_| CoordinatorError::DeadlineExceeded(format!("pricing the amended plan took longer than {} ms", deadline.as_millis())))?
        .map_err(|e| CoordinatorError::Conflict(format!("pricer: {e}")))?;
    let (mut report, profiles) = priced.map_err(|e| match e {
        motley_solver::SolverError::InvalidInput { field, message } => CoordinatorError::invalid(field, message),
        other => CoordinatorError::Conflict(other.to_string()),
    })?;
    if let Some(nodes) = &only_measured {
        crate::planning::profiling::check_measured(&report, nodes, &profiles)?;
    }
    report.network = plan_network(&report, &declared, measured.as_ref());
    Ok(report)
}

/// A plan naming real GPU indices, in the offer's numbers (the solver numbers its free GPUs
/// 0..n); refused naming the first GPU the offer does not hold.
fn in_offer_numbers(plan: &PlanDocument, real: &HashMap<String, Vec<u32>>) -> Result<PlanDocument> {
    let mut plan = plan.clone();
    for (ri, r) in plan.replicas.iter_mut().enumerate() {
        for (si, st) in r.stages.iter_mut().enumerate() {
            for (gi, g) in st.gpus.iter_mut().enumerate() {
                let number = real.get(&g.node).and_then(|free| free.iter().position(|&i| i == g.index));
                let Some(number) = number else {
                    return Err(CoordinatorError::Conflict(format!(
                        "plan.replicas[{ri}].stages[{si}].gpus[{gi}]: GPU {}:{} is held by another job, or its node is draining or has no live agent",
                        g.node, g.index
                    )));
                };
                g.index = number as u32;
            }
        }
    }
    Ok(plan)
}

/// `planning` (as a record that it was tried), then `failed` with the reason.
async fn fail_planning(store: &Store, job: &JobRecord, e: CoordinatorError) -> Result<Planned> {
    if job.state != JobState::Planning {
        store.transition(job.id, JobState::Planning, None).await?;
    }
    Ok(Planned::Failed(store.transition(job.id, JobState::Failed, Some(&e.to_string())).await?))
}

/// Active nodes within the job's resources whose agent holds no lease now.
pub async fn missing_nodes(store: &Store, fleet: &Fleet, job: &JobRecord) -> Result<Vec<String>> {
    let spec: JobSpec = serde_json::from_str(&job.spec).map_err(|e| CoordinatorError::Conflict(format!("stored job spec: {e}")))?;
    let mine = |n: &str| spec.resources.nodes.is_empty() || spec.resources.nodes.iter().any(|m| m == n);
    Ok(store
        .nodes()
        .await?
        .into_iter()
        .filter(|n| n.state == NodeState::Active && mine(&n.name) && !fleet.live(&n.name))
        .map(|n| n.name)
        .collect())
}

/// The nodes a job may use now, each cut down to its free GPUs and renumbered 0..n for the
/// solver (`real` maps the solver's numbers back).
struct Offer {
    nodes: Vec<NodeSpec>,
    /// Per node, the real GPU index of each solver GPU number.
    real: HashMap<String, Vec<u32>>,
    /// GPUs the job would get on an idle cluster: its budget, or every GPU of its nodes.
    wanted: u32,
    /// GPUs of its nodes (free or not) and how many are free.
    capacity: u32,
    free: u32,
    /// Jobs holding GPUs of its nodes.
    holders: BTreeSet<i64>,
}

/// Active nodes within the job's resources; with `live`, only nodes whose agent holds a lease
/// (a launch on a node that vanished would fail at once) and only their GPUs no launch holds.
async fn offer(store: &Store, spec: &JobSpec, live: Option<(&Fleet, &Taken)>) -> Result<Offer> {
    let mut nodes = vec![];
    for n in store.nodes().await? {
        if n.state != NodeState::Active || (!spec.resources.nodes.is_empty() && !spec.resources.nodes.contains(&n.name)) {
            continue;
        }
        if live.is_some_and(|(f, _)| !f.live(&n.name)) {
            continue;
        }
        let entry: NodeSpec = serde_json::from_str(&n.inventory)
            .map_err(|e| CoordinatorError::Conflict(format!("node {}: stored inventory: {e}", n.name)))?;
        nodes.push(entry);
    }
    if nodes.is_empty() {
        let which = if live.is_some() { "live node (an active node whose agent holds a lease)" } else { "active node" };
        return Err(CoordinatorError::Conflict(format!("no {which} matches the job's resources; start agents, register or undrain nodes")));
    }
    let no_one = Taken::new();
    let taken = live.map_or(&no_one, |(_, t)| t);
    let capacity: u32 = nodes.iter().map(|n| n.gpus).sum();
    // A carried plan is offered every free GPU (it takes the ones it names).
    let wanted = if spec.plan.is_some() { capacity } else { spec.resources.gpus.map_or(capacity, |b| b.min(capacity)) };
    let (mut free, mut holders, mut real) = (0, BTreeSet::new(), HashMap::new());
    let free_of = |n: &NodeSpec| -> Vec<u32> {
        let held = taken.get(&n.name);
        (0..n.gpus).filter(|g| !held.is_some_and(|h| h.contains_key(g))).collect()
    };
    // Emptiest nodes first (whole free nodes before the leftovers of busy ones: fewer jobs
    // split across nodes), then by name.
    nodes.sort_by_cached_key(|n| (std::cmp::Reverse(free_of(n).len()), n.name.clone()));
    // Within a GPU budget, take free GPUs in that order until it is met (the last node only in
    // part): the plan never uses more GPUs than the job may.
    let mut left = wanted;
    nodes.retain_mut(|n| {
        holders.extend(taken.get(&n.name).into_iter().flat_map(|h| h.values().copied()));
        let mut ours = free_of(n);
        free += ours.len() as u32;
        ours.truncate(left as usize);
        left -= ours.len() as u32;
        n.gpus = ours.len() as u32;
        // Rails name GPUs by index: keep those the node still offers, in the solver's numbers.
        for nic in &mut n.nics {
            nic.gpus = nic.gpus.iter().filter_map(|g| ours.iter().position(|o| o == g)).map(|p| p as u32).collect();
        }
        let keep = !ours.is_empty();
        real.insert(n.name.clone(), ours);
        keep
    });
    Ok(Offer { nodes, real, wanted, capacity, free, holders })
}

/// A carried plan's GPUs against the inventory (any state): each names a registered node and
/// one of its GPUs, the nodes are within the job's resources, and the plan uses no more GPUs
/// than `resources.gpus`. Whether they are free and live is the offer's business.
async fn check_plan_gpus(store: &Store, spec: &JobSpec) -> Result<()> {
    let Some(plan) = &spec.plan else { return Ok(()) };
    let nodes: HashMap<String, u32> = store
        .nodes()
        .await?
        .into_iter()
        .map(|n| {
            let gpus = serde_json::from_str::<NodeSpec>(&n.inventory).map_or(0, |e| e.gpus);
            (n.name, gpus)
        })
        .collect();
    let mut used = 0u32;
    for (ri, r) in plan.replicas.iter().enumerate() {
        for (si, st) in r.stages.iter().enumerate() {
            for (gi, g) in st.gpus.iter().enumerate() {
                let field = format!("plan.replicas[{ri}].stages[{si}].gpus[{gi}]");
                let Some(&count) = nodes.get(&g.node) else {
                    return Err(CoordinatorError::invalid(field, format!("node '{}' is not in the inventory (motley node list)", g.node)));
                };
                if g.index >= count {
                    return Err(CoordinatorError::invalid(field, format!("node '{}' has GPUs 0..{count}", g.node)));
                }
                if !spec.resources.nodes.is_empty() && !spec.resources.nodes.contains(&g.node) {
                    return Err(CoordinatorError::invalid(field, format!("node '{}' is not in the job's resources.nodes", g.node)));
                }
                used += 1;
            }
        }
    }
    if let Some(budget) = spec.resources.gpus.filter(|&b| used > b) {
        return Err(CoordinatorError::invalid("plan", format!("uses {used} GPUs but resources.gpus allows {budget}")));
    }
    Ok(())
}

/// A plan made, its ranks, and the plan it replaces priced on the same inputs (when `solve`
/// was given one).
struct Solved {
    report: PlanDocument,
    ranks: Vec<RankAssignment>,
    replaced_now_s: Option<f64>,
}

/// The solver on an offer, within `deadline`: the job's own `plan:` checked and priced as
/// given, else the search, seeded with `replaces` (a plan in the offer's GPU numbers) when
/// there is one; the plan and ranks name the real GPU indices. A plan that takes longer is
/// refused (the solver's thread runs on to its end, but nothing waits for it: the job queue
/// and the request move on).
async fn solve(
    spec: &JobSpec,
    offer: Offer,
    profiles: ProfileSet,
    measured: Option<BandwidthSpec>,
    replaces: Option<PlanDocument>,
    deadline: std::time::Duration,
) -> Result<Solved> {
    let Offer { nodes, real, .. } = offer;
    let only_measured = (spec.profiling().mode == ProfilingMode::Only).then(|| (nodes.clone(), profiles.clone()));
    let declared = Cluster::from_spec(&ClusterSpec { name: "live".into(), nodes, gpu_types: crate::state::catalog::declared() })
        .map_err(|e| CoordinatorError::Conflict(format!("inventory: {e}")))?;
    let (cluster, measured) = with_measurements(&declared, measured);
    let model = spec.model()?;
    let (mut opts, mode) = spec.plan_options()?;
    opts.precision = spec.precision(&cluster);
    // A carried plan names real GPU indices; the solver numbers the offer's free GPUs 0..n.
    let given = spec.plan.as_ref().map(|plan| in_offer_numbers(plan, &real)).transpose()?;
    // The solver is pure CPU work: keep it off the async workers.
    let planner = tokio::task::spawn_blocking(move || {
        let req =
            PlanRequest { cluster: &cluster, model: &model, profiles: &profiles, opts: &opts, mode, exhaustive: false, seeds: vec![] };
        match (&given, &replaces) {
            (Some(plan), _) => motley_solver::report::given(&req, plan).map(|r| (r, None)),
            (None, Some(old)) => match motley_solver::replan::replan(&req, old, SwitchPolicy { min_gain: 0.0, horizon: f64::INFINITY }) {
                Ok(r) => Ok((r.new_plan, Some(r.current_now_s))),
                Err(e) => {
                    // Priced otherwise (another sequence length, a GPU type gone): plan afresh.
                    tracing::info!("the plan being replaced seeds nothing: {e}");
                    motley_solver::plan(&req).map(|r| (r, None))
                }
            },
            (None, None) => motley_solver::plan(&req).map(|r| (r, None)),
        }
    });
    let planned = tokio::time::timeout(deadline, planner).await.map_err(|_| {
        CoordinatorError::DeadlineExceeded(format!(
            "planning took longer than {} ms; give the job fewer GPUs or nodes (resources), or more time (plan_timeout_s in the job file, --plan-timeout-ms on the coordinator)",
            deadline.as_millis()
        ))
    })?;
    let (mut report, replaced_now_s) = planned.map_err(|e| CoordinatorError::Conflict(format!("planner: {e}")))?.map_err(|e| match e {
        // A field of the job (its plan, its options) is wrong: the job's fault, named.
        motley_solver::SolverError::InvalidInput { field, message } => CoordinatorError::invalid(field, message),
        other => CoordinatorError::Conflict(other.to_string()),
    })?;
    if let Some((nodes, profiles)) = &only_measured {
        crate::planning::profiling::check_measured(&report, nodes, profiles)?;
    }
    report.network = plan_network(&report, &declared, measured.as_ref());
    let renumber = |g: &mut GpuId| {
        if let Some(i) = real.get(&g.node).and_then(|r| r.get(g.index as usize)) {
            g.index = *i;
        }
    };
    report.replicas.iter_mut().flat_map(|r| r.stages.iter_mut()).flat_map(|s| s.gpus.iter_mut()).for_each(&renumber);
    report.comm_groups.iter_mut().flat_map(|c| c.gpus.iter_mut()).for_each(&renumber);
    let ranks = ranks_of(&report);
    Ok(Solved { report, ranks, replaced_now_s })
}

/// `declared` with the measured links in force, and the measurements it took; the declared
/// cluster alone (logged) when they do not apply.
fn with_measurements(declared: &Cluster, measured: Option<BandwidthSpec>) -> (Cluster, Option<BandwidthSpec>) {
    let Some(spec) = measured else { return (declared.clone(), None) };
    match declared.with_measurements(&spec) {
        Ok(c) => (c, Some(spec)),
        Err(e) => {
            tracing::warn!("planning on the declared links: the measured ones do not apply ({e})");
            (declared.clone(), None)
        }
    }
}

/// The links between the nodes `report` uses, as it assumed them.
fn plan_network(report: &PlanDocument, declared: &Cluster, measured: Option<&BandwidthSpec>) -> Option<PlanNetwork> {
    let nodes: BTreeSet<&str> = report.replicas.iter().flat_map(|r| &r.stages).flat_map(|s| &s.gpus).map(|g| g.node.as_str()).collect();
    let nodes: Vec<&str> = nodes.into_iter().collect();
    links_of(&nodes, declared, measured).map_err(|e| tracing::warn!("the plan's links: {e}")).ok()
}

/// Rank numbering: replicas in order, stages in order, GPUs in order (TP fastest); local ranks
/// count a node's ranks in that order.
pub fn ranks_of(report: &PlanDocument) -> Vec<RankAssignment> {
    let mut out = vec![];
    let mut local: std::collections::HashMap<String, i64> = Default::default();
    for (ri, r) in report.replicas.iter().enumerate() {
        for (si, s) in r.stages.iter().enumerate() {
            for g in &s.gpus {
                let l = local.entry(g.node.clone()).or_insert(0);
                out.push(RankAssignment {
                    rank: out.len() as i64,
                    node: g.node.clone(),
                    local_rank: *l,
                    gpu: g.index as i64,
                    replica: ri as i64,
                    stage: si as i64,
                    layer_start: s.layers[0] as i64,
                    layer_end: s.layers[1] as i64,
                });
                *l += 1;
            }
        }
    }
    out
}
