//! A lost replica stops nobody else (docs/keep-going.md), the coordinator's side: a real
//! coordinator process and a stand-in agent over gRPC (four A100s on n0) run a job pinned to
//! three replicas (a two-stage pipeline, then one GPU each). A failed rank ends only its
//! replica: a `membership_changed` event with the members' split and the epoch's store, the
//! job `degraded` under the same generation, the agent handed the membership (and told to stop
//! a lost replica's ranks still running); the members alone decide the job's end. When no
//! replica survives whole the job ends as it would have (no checkpoint: failed), saying why.
//! A pinned plan's whole-job recovery waits for the node it lost.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::common::{temp_dir, Coordinator};
use crate::job_events_e2e::{call, events, ran, FakeAgent};
use motley_proto::v1::{instruction, AgentStatus, Membership, RankRejoined, RankStatus};
use serde_json::Value;

const MODEL: &str = "{name: four, layers: 4, hidden: 64, heads: 4, seq_len: 32, vocab: 128}";

fn job(extra: &str) -> String {
    let stage = |layers: &str, gpu: u32| format!("{{layers: {layers}, gpu: A100-80G, tp: 1, dp: 1, gpus: [{{node: n0, index: {gpu}}}]}}");
    format!(
        "name: kg\nmodel: {MODEL}\nglobal_batch: 12\nrun: 'true'\n{extra}plan: {{global_batch: 12, micro_batch: 2, replicas: [\
         {{samples: 6, micro_batches: 3, stages: [{}, {}]}}, {{samples: 4, micro_batches: 2, stages: [{}]}}, \
         {{samples: 2, micro_batches: 1, stages: [{}]}}]}}\n",
        stage("[0, 2]", 0),
        stage("[2, 4]", 1),
        stage("[0, 4]", 2),
        stage("[0, 4]", 3)
    )
}

async fn state_becomes(c: &Arc<Coordinator>, id: i64, want: &str) -> Value {
    let start = Instant::now();
    loop {
        let j = call(c, "GET", &format!("/api/v1/jobs/{id}"), "", 200).await;
        if j["state"] == want {
            return j;
        }
        assert!(start.elapsed() < Duration::from_secs(30), "not {want}: {j}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A job pinned to two one-GPU replicas of a one-layer model (`model`'s other fields), replica
/// 0 on n0's GPU 0 and replica 1 on n1's GPU 0 (each node four A100s on one NIC), the global
/// batch split evenly; both ranks running. Returns the agents and the job.
async fn two_one_gpu_replicas(c: &Arc<Coordinator>, name: &str, model: &str, global_batch: u32) -> (FakeAgent, FakeAgent, i64) {
    let mut n0 = FakeAgent::start_as(c, "n0").await;
    let mut n1 = FakeAgent::start_as(c, "n1").await;
    let k = global_batch / 4;
    let replica = |node: &str| {
        format!(
            "{{samples: {}, micro_batches: {k}, stages: [{{layers: [0, 1], gpu: A100-80G, tp: 1, dp: 1, gpus: [{{node: {node}, index: 0}}]}}]}}",
            2 * k
        )
    };
    let spec = format!(
        "name: {name}\nmodel: {{name: one, layers: 1, {model}}}\nglobal_batch: {global_batch}\nrun: 'true'\n\
         checkpoint: {{every: 100}}\nplan: {{global_batch: {global_batch}, micro_batch: 2, replicas: [{}, {}]}}\n",
        replica("n0"),
        replica("n1")
    );
    let id = call(c, "POST", "/api/v1/jobs", &spec, 201).await["id"].as_i64().unwrap();
    n0.launch().await;
    n1.launch().await;
    n0.send(AgentStatus { ranks: vec![ran(id, 0, "running", None)], ..Default::default() }).await;
    n1.send(AgentStatus { ranks: vec![ran(id, 1, "running", None)], ..Default::default() }).await;
    state_becomes(c, id, "running").await;
    (n0, n1, id)
}

const SMALL: &str = "hidden: 64, heads: 4, seq_len: 32, vocab: 128";

async fn membership(agent: &mut FakeAgent) -> (Membership, Value) {
    let m = agent.next(|k| if let instruction::Kind::Membership(m) = k { Some(m) } else { None }).await;
    let doc: Value = serde_json::from_str(&m.document).unwrap();
    (m, doc)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_rank_ends_only_its_replica_until_none_survives_whole() {
    let c = Arc::new(Coordinator::start(&temp_dir(), &["--heartbeat-ms", "300"]));
    let mut agent = FakeAgent::start(&c).await;
    let id = call(&c, "POST", "/api/v1/jobs", &job(""), 201).await["id"].as_i64().unwrap();
    let launch = agent.launch().await;
    assert_eq!(launch.envs.get("MOTLEY_KEEP_GOING").map(String::as_str), Some("1"), "{:?}", launch.envs);
    agent.send(AgentStatus { ranks: (0..4).map(|r| ran(id, r, "running", None)).collect(), ..Default::default() }).await;
    state_becomes(&c, id, "running").await;

    // Replica 1's rank fails: replicas 0 and 2 keep going, the 6 micro-batches split by the
    // speeds the launched plan priced (a pinned plan is priced when it is checked); rank 0
    // still leads.
    agent.send(AgentStatus { ranks: vec![ran(id, 2, "exited", Some(137))], ..Default::default() }).await;
    let (m, doc) = membership(&mut agent).await;
    assert_eq!((m.job, m.generation, m.epoch), (id, 1, 1));
    assert!(m.stop_ranks.is_empty(), "nothing of replica 1 still runs: {:?}", m.stop_ranks);
    assert_eq!(
        (&doc["replicas"], &doc["lost"], &doc["leader"]),
        (&serde_json::json!([0, 2]), &serde_json::json!([1]), &serde_json::json!(0))
    );
    let split: Vec<u64> = ["0", "2"].iter().map(|r| doc["micro_batches"][r].as_u64().unwrap()).collect();
    assert!(split.iter().sum::<u64>() == 6 && split.iter().all(|&k| k >= 1), "the same 6 micro-batches: {doc}");
    assert!(doc["throughput_share"].as_f64().unwrap() > 0.0, "split by the speeds the launched plan priced: {doc}");
    assert_eq!(doc["store"]["port"].as_u64(), Some(u64::from(launch.master_port)), "the leader's store stays: {doc}");
    assert!(doc["reason"].as_str().unwrap().contains("rank 2 on node n0 exited with code 137"), "{doc}");
    let j = state_becomes(&c, id, "degraded").await;
    assert_eq!(j["generation"], 1, "{j}");
    // The job's view carries the membership in force, the list's too.
    let shown = &j["membership"];
    assert_eq!((&shown["epoch"], &shown["replicas"], &shown["lost"]), (&doc["epoch"], &doc["replicas"], &doc["lost"]), "{j}");
    assert_eq!((&shown["throughput_share"], &shown["reason"]), (&doc["throughput_share"], &doc["reason"]), "{j}");
    let listed = call(&c, "GET", "/api/v1/jobs", "", 200).await;
    assert_eq!(listed.as_array().unwrap().iter().find(|x| x["id"] == id).unwrap()["membership"], *shown);
    let said = events(&c, id).await;
    let changed: Vec<&String> = said.iter().filter(|(k, _)| k == "membership_changed").map(|(_, m)| m).collect();
    assert_eq!(changed.len(), 1, "{said:?}");
    assert_eq!(serde_json::from_str::<Value>(changed[0]).unwrap(), doc);

    // Rank 0 fails: replica 0 goes (rank 1, still running, is stopped); replica 2 alone takes
    // every micro-batch, and its rank 3 leads on the launch's other port.
    agent.send(AgentStatus { ranks: vec![ran(id, 0, "exited", Some(1))], ..Default::default() }).await;
    let (m, doc) = membership(&mut agent).await;
    assert_eq!((m.epoch, m.stop_ranks.clone()), (2, vec![1]));
    assert_eq!(
        (&doc["replicas"], &doc["lost"], &doc["leader"]),
        (&serde_json::json!([2]), &serde_json::json!([0, 1]), &serde_json::json!(3))
    );
    assert_eq!(doc["micro_batches"], serde_json::json!({"2": 6}));
    assert_eq!(doc["store"]["port"].as_u64(), Some(u64::from(launch.master_port) - 1), "{doc}");
    state_becomes(&c, id, "degraded").await;

    // The last member fails: no replica survives whole, and without a checkpoint the job fails.
    agent.send(AgentStatus { ranks: vec![ran(id, 1, "exited", Some(143)), ran(id, 3, "exited", Some(1))], ..Default::default() }).await;
    let j = state_becomes(&c, id, "failed").await;
    assert!(j["reason"].as_str().unwrap().contains("rank 3 on node n0 exited with code 1"), "{j}");
    assert!(j.get("membership").is_none(), "only a degraded job shows one: {j}");
    let said = events(&c, id).await;
    let why = said.iter().find(|(k, _)| k == "keep_going").map(|(_, m)| m.clone()).unwrap_or_default();
    assert!(why.starts_with("no replica survives whole") && why.ends_with("the job recovers whole"), "{said:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_members_alone_end_a_degraded_job_and_keep_going_false_fails_it_at_once() {
    let c = Arc::new(Coordinator::start(&temp_dir(), &["--heartbeat-ms", "300"]));
    let mut agent = FakeAgent::start(&c).await;
    let id = call(&c, "POST", "/api/v1/jobs", &job(""), 201).await["id"].as_i64().unwrap();
    agent.launch().await;
    agent.send(AgentStatus { ranks: (0..4).map(|r| ran(id, r, "running", None)).collect(), ..Default::default() }).await;
    state_becomes(&c, id, "running").await;
    agent.send(AgentStatus { ranks: vec![ran(id, 3, "exited", Some(9))], ..Default::default() }).await;
    membership(&mut agent).await;
    state_becomes(&c, id, "degraded").await;
    agent.send(AgentStatus { ranks: (0..3).map(|r| ran(id, r, "exited", Some(0))).collect(), ..Default::default() }).await;
    let j = state_becomes(&c, id, "succeeded").await;
    assert!(j["reason"].is_null() && j["generation"] == 1, "a job that kept going succeeds with no failure reason: {j}");

    // The same failure with keep_going: false ends the job (no checkpoint, no budget).
    let id = call(&c, "POST", "/api/v1/jobs", &job("keep_going: false\n"), 201).await["id"].as_i64().unwrap();
    let launch = agent.launch().await;
    assert!(!launch.envs.contains_key("MOTLEY_KEEP_GOING"), "{:?}", launch.envs);
    agent.send(AgentStatus { ranks: (0..4).map(|r| ran(id, r, "running", None)).collect(), ..Default::default() }).await;
    state_becomes(&c, id, "running").await;
    agent.send(AgentStatus { ranks: vec![ran(id, 3, "exited", Some(9))], ..Default::default() }).await;
    let j = state_becomes(&c, id, "failed").await;
    assert!(j["reason"].as_str().unwrap().contains("rank 3 on node n0 exited with code 9"), "{j}");
    assert!(!events(&c, id).await.iter().any(|(k, _)| k == "membership_changed"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pinned_plans_recovery_waits_for_its_lost_node_and_goes_on_when_it_is_back() {
    // One replica over n0 and n1, pinned: losing n1 leaves nothing to keep going with, and the
    // plan fits nowhere else. The recovery waits for n1 (docs/recovery.md, "A pinned plan's
    // nodes"), as a spot node comes back, and relaunches onto both once it has.
    let c = Arc::new(Coordinator::start(&temp_dir(), &["--heartbeat-ms", "300"]));
    let mut n0 = FakeAgent::start_as(&c, "n0").await;
    let n1 = FakeAgent::start_as(&c, "n1").await;
    let stage = |layers: &str, node: &str| format!("{{layers: {layers}, gpu: A100-80G, tp: 1, dp: 1, gpus: [{{node: {node}, index: 0}}]}}");
    let spec = format!(
        "name: pinned\nmodel: {MODEL}\nglobal_batch: 4\nrun: 'true'\ncheckpoint: {{every: 10}}\nmax_preemptions: 1\n\
         plan: {{global_batch: 4, micro_batch: 2, replicas: [{{samples: 4, micro_batches: 2, stages: [{}, {}]}}]}}\n",
        stage("[0, 2]", "n0"),
        stage("[2, 4]", "n1")
    );
    let id = call(&c, "POST", "/api/v1/jobs", &spec, 201).await["id"].as_i64().unwrap();
    n0.launch().await;
    n0.send(AgentStatus { ranks: vec![ran(id, 0, "running", None)], ..Default::default() }).await;
    let mut n1 = n1;
    n1.launch().await;
    n1.send(AgentStatus { ranks: vec![ran(id, 1, "running", None)], ..Default::default() }).await;
    state_becomes(&c, id, "running").await;

    drop(n1); // n1 vanishes: its lease lapses after 3 intervals
    state_becomes(&c, id, "recovering").await;
    n0.send(AgentStatus { ranks: vec![ran(id, 0, "exited", Some(143))], ..Default::default() }).await;
    let start = Instant::now();
    let waiting = loop {
        if let Some((_, m)) = events(&c, id).await.into_iter().find(|(k, _)| k == "recovery_waiting") {
            break m;
        }
        assert!(start.elapsed() < Duration::from_secs(30), "no recovery_waiting: {:?}", events(&c, id).await);
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(waiting.contains("n1") && waiting.contains("36 s"), "{waiting}");
    assert_eq!(call(&c, "GET", &format!("/api/v1/jobs/{id}"), "", 200).await["state"], "recovering", "it waits, not fails");

    let mut back = FakeAgent::start_as(&c, "n1").await;
    let relaunched = back.launch().await;
    assert_eq!((relaunched.job, relaunched.generation), (id, 2));
    let j = call(&c, "GET", &format!("/api/v1/jobs/{id}"), "", 200).await;
    assert_eq!((j["state"].as_str(), j["generation"].as_i64()), (Some("launching"), Some(2)), "{j}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_replica_rejoins_when_its_node_returns_not_after_its_own_rank_failed() {
    // Two one-GPU replicas of a one-layer model, pinned: replica 0 on n0, replica 1 on n1.
    let c = Arc::new(Coordinator::start(&temp_dir(), &["--heartbeat-ms", "300"]));
    let (mut n0, mut n1, id) = two_one_gpu_replicas(&c, "back", SMALL, 4).await;

    // Replica 1's own rank fails on n1, which stays up: the job goes on degraded, and nothing
    // brings the replica back (it would fail again, each time for free).
    n1.send(AgentStatus { ranks: vec![ran(id, 1, "exited", Some(1))], ..Default::default() }).await;
    membership(&mut n0).await;
    state_becomes(&c, id, "degraded").await;
    tokio::time::sleep(Duration::from_millis(1500)).await; // five base intervals of scale-up looks
    assert_eq!(call(&c, "GET", &format!("/api/v1/jobs/{id}"), "", 200).await["state"], "degraded");

    // n1's agent registers again after the loss: replica 1 rejoins from the member's live state,
    // no save and no restart. The member's node gets epoch 2 naming it joining; n1 gets rank 1
    // again, in the same launch, with that epoch's document and no restore.
    drop(n1);
    let mut n1 = FakeAgent::start_as(&c, "n1").await;
    let (m, doc) = membership(&mut n0).await;
    assert_eq!(m.epoch, 2, "{doc}");
    assert_eq!(
        (&doc["replicas"], &doc["lost"], &doc["joining"]),
        (&serde_json::json!([0, 1]), &serde_json::json!([]), &serde_json::json!([1]))
    );
    assert_eq!((&doc["leader"], &doc["micro_batches"]), (&serde_json::json!(0), &serde_json::json!({"0": 1, "1": 1})), "{doc}");
    let launch = n1.launch().await;
    assert_eq!((launch.generation, launch.join_epoch), (1, 2));
    assert_eq!(launch.ranks.iter().map(|r| r.rank).collect::<Vec<_>>(), [1]);
    assert_eq!(serde_json::from_str::<Value>(&launch.membership).unwrap(), doc);
    assert!(!launch.envs.contains_key("MOTLEY_CKPT_RESTORE_STEP"), "{:?}", launch.envs);
    let j = call(&c, "GET", &format!("/api/v1/jobs/{id}"), "", 200).await;
    assert_eq!((&j["state"], &j["generation"]), (&serde_json::json!("degraded"), &serde_json::json!(1)), "whole again only once it runs");
    // Its rank runs, but has not copied the members' state yet: still degraded.
    n1.send(AgentStatus { ranks: vec![ran(id, 1, "running", None)], ..Default::default() }).await;
    tokio::time::sleep(Duration::from_millis(900)).await; // three base intervals of looks
    assert_eq!(call(&c, "GET", &format!("/api/v1/jobs/{id}"), "", 200).await["state"], "degraded", "whole only once it copied");
    // A copy told for an older epoch is not this one's.
    let copied = |epoch| RankRejoined { epoch, bytes: 2_613_248, seconds: 4.5, copy_seconds: 0.07 };
    n1.send(AgentStatus { ranks: vec![RankStatus { rejoined: Some(copied(1)), ..ran(id, 1, "running", None) }], ..Default::default() })
        .await;
    tokio::time::sleep(Duration::from_millis(900)).await;
    assert_eq!(call(&c, "GET", &format!("/api/v1/jobs/{id}"), "", 200).await["state"], "degraded", "an older epoch's copy");
    // Its agent tells what it copied in epoch 2: the job is whole again, its reason cleared,
    // the replica recorded as back with the bytes.
    n1.send(AgentStatus { ranks: vec![RankStatus { rejoined: Some(copied(2)), ..ran(id, 1, "running", None) }], ..Default::default() })
        .await;
    let j = state_becomes(&c, id, "running").await;
    assert!(j["reason"].is_null() && j["generation"] == 1, "{j}");
    let said = events(&c, id).await;
    let rejoined: Value = serde_json::from_str(&said.iter().find(|(k, _)| k == "rejoined").expect("a rejoined event").1).unwrap();
    assert_eq!(
        (&rejoined["epoch"], &rejoined["replica"], &rejoined["ranks"], &rejoined["bytes"], &rejoined["copy_seconds"]),
        (&serde_json::json!(2), &serde_json::json!(1), &serde_json::json!([1]), &serde_json::json!(2_613_248), &serde_json::json!(0.07))
    );
    assert!(rejoined["seconds"].as_f64().is_some_and(|s| s >= 0.0), "{rejoined}");
    assert!(!said.iter().any(|(k, _)| k == "recovering"), "{said:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_replica_whose_node_stays_away_rejoins_on_a_free_gpu_of_a_node_of_its_shape() {
    // Two one-GPU replicas of a one-layer model, pinned: replica 0 on n0's GPU 0, replica 1 on
    // n1's GPU 0. Both nodes have four A100s on the same NIC: n0 has three free.
    let c = Arc::new(Coordinator::start(&temp_dir(), &["--heartbeat-ms", "300"]));
    let (mut n0, n1, id) = two_one_gpu_replicas(&c, "away", SMALL, 4).await;

    // n1 vanishes and stays away: replica 1 is lost, then rejoins on n0's lowest free GPU (1),
    // the plan amended for it, under the same generation and store, with nothing restored.
    drop(n1);
    let (m, doc) = membership(&mut n0).await;
    assert_eq!((m.epoch, &doc["lost"]), (1, &serde_json::json!([1])), "{doc}");
    let (m, doc) = membership(&mut n0).await;
    assert_eq!(m.epoch, 2, "{doc}");
    assert_eq!(
        (&doc["replicas"], &doc["lost"], &doc["joining"]),
        (&serde_json::json!([0, 1]), &serde_json::json!([]), &serde_json::json!([1]))
    );
    assert!(doc["reason"].as_str().unwrap().contains("n1 -> n0"), "{doc}");
    let launch = n0.launch().await;
    assert_eq!((launch.generation, launch.join_epoch), (1, 2));
    assert_eq!(launch.ranks.iter().map(|r| (r.rank, r.gpu)).collect::<Vec<_>>(), [(1, 1)]);
    let plan: Value = serde_json::from_str(&launch.plan_json).unwrap();
    assert_eq!(plan["replicas"][1]["stages"][0]["gpus"], serde_json::json!([{"node": "n0", "index": 1}]), "the plan amended");
    assert_eq!(plan["replicas"][0]["stages"][0]["gpus"], serde_json::json!([{"node": "n0", "index": 0}]));
    assert!(!launch.envs.contains_key("MOTLEY_CKPT_RESTORE_STEP"), "{:?}", launch.envs);
    let said = events(&c, id).await;
    assert!(said.iter().any(|(_, m)| m.contains("rank 1 assigned again, to rejoin in epoch 2, on node n0 GPU 1")), "{said:?}");

    // It runs and tells its copy: whole again, generation 1, the rejoined event.
    let copied = RankRejoined { epoch: 2, bytes: 1_000, seconds: 3.0, copy_seconds: 0.01 };
    n0.send(AgentStatus {
        ranks: vec![ran(id, 0, "running", None), RankStatus { rejoined: Some(copied), ..ran(id, 1, "running", None) }],
        ..Default::default()
    })
    .await;
    let j = state_becomes(&c, id, "running").await;
    assert!(j["reason"].is_null() && j["generation"] == 1, "{j}");
    let said = events(&c, id).await;
    let rejoined: Value = serde_json::from_str(&said.iter().find(|(k, _)| k == "rejoined").expect("a rejoined event").1).unwrap();
    assert_eq!((&rejoined["replica"], &rejoined["bytes"]), (&serde_json::json!(1), &serde_json::json!(1_000)));
    assert!(!said.iter().any(|(k, _)| k == "recovering"), "{said:?}");

    // n1 back later: the job is whole, nothing moves back.
    let _n1 = FakeAgent::start_as(&c, "n1").await;
    tokio::time::sleep(Duration::from_millis(900)).await;
    let j = call(&c, "GET", &format!("/api/v1/jobs/{id}"), "", 200).await;
    assert_eq!((&j["state"], &j["generation"]), (&serde_json::json!("running"), &serde_json::json!(1)), "{j}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_replica_with_no_node_of_its_shape_rejoins_on_the_fastest_type_that_fits_priced_and_split_again() {
    // The same two A100 replicas, a model big enough for compute to weigh, twelve sequences:
    // three micro-batches each. n0's other GPUs are taken by a job of their own; a T4 node (no
    // bf16, the plan's precision) and an H100 node are live.
    let c = Arc::new(Coordinator::start(&temp_dir(), &["--heartbeat-ms", "300"]));
    let (mut n0, n1, id) = two_one_gpu_replicas(&c, "retype", "hidden: 2048, heads: 16, seq_len: 1024, vocab: 32000", 12).await;
    let plan_before = call(&c, "GET", &format!("/api/v1/jobs/{id}/plan"), "", 200).await["plan"].clone();
    let precision = plan_before["precision"].clone();
    let one = |gpu: u32| {
        format!("{{samples: 2, micro_batches: 1, stages: [{{layers: [0, 1], gpu: A100-80G, tp: 1, dp: 1, gpus: [{{node: n0, index: {gpu}}}]}}]}}")
    };
    let filler = format!(
        "name: filler\nmodel: {{name: one, layers: 1, {SMALL}}}\nglobal_batch: 6\nrun: 'true'\n\
         plan: {{global_batch: 6, micro_batch: 2, replicas: [{}, {}, {}]}}\n",
        one(1),
        one(2),
        one(3)
    );
    let filler = call(&c, "POST", "/api/v1/jobs", &filler, 201).await["id"].as_i64().unwrap();
    n0.launch().await;
    let both = (0..3).map(|r| ran(filler, r, "running", None)).chain([ran(id, 0, "running", None)]).collect();
    n0.send(AgentStatus { ranks: both, ..Default::default() }).await;
    state_becomes(&c, filler, "running").await;
    let nic = r#""nics": [{"name": "eth0", "kind": "ethernet", "gbps": 25}]"#;
    let _t = FakeAgent::start_with(&c, "t", &format!(r#"{{"gpu": "T4", "gpus": 1, {nic}}}"#)).await;
    let mut h = FakeAgent::start_with(&c, "h", &format!(r#"{{"gpu": "H100", "gpus": 1, {nic}}}"#)).await;

    drop(n1);
    let (m, doc) = membership(&mut n0).await;
    assert_eq!((m.epoch, &doc["lost"]), (1, &serde_json::json!([1])), "{doc}");
    let (m, doc) = membership(&mut n0).await;
    assert_eq!(m.epoch, 2, "{doc}");
    let reason = doc["reason"].as_str().unwrap();
    assert!(reason.contains("of another shape, H100 GPUs") && reason.contains("n1 -> h"), "{doc}");
    let launch = h.launch().await;
    assert_eq!((launch.generation, launch.join_epoch), (1, 2));
    assert_eq!(launch.ranks.iter().map(|r| (r.rank, r.gpu)).collect::<Vec<_>>(), [(1, 0)]);
    let plan: Value = serde_json::from_str(&launch.plan_json).unwrap();
    let stage = &plan["replicas"][1]["stages"][0];
    assert_eq!((&stage["gpu"], &stage["gpus"]), (&serde_json::json!("H100"), &serde_json::json!([{"node": "h", "index": 0}])), "{plan}");
    assert_eq!(plan["precision"], precision, "the plan's precision kept");
    // Priced on the H100 (faster than the A100 it replaces), the batch split again by it: the
    // membership hands out the amended plan's split, every sample once.
    assert!(stage["fwd_s"].as_f64().unwrap() < plan_before["replicas"][1]["stages"][0]["fwd_s"].as_f64().unwrap(), "{plan}");
    let split: Vec<u64> = (0..2).map(|r| plan["replicas"][r]["micro_batches"].as_u64().unwrap()).collect();
    assert_eq!(doc["micro_batches"], serde_json::json!({"0": split[0], "1": split[1]}), "{doc}");
    assert!(split[0] + split[1] == 6 && split[1] > split[0], "the H100 takes more: {split:?}");
    assert_eq!(plan["replicas"][1]["samples"].as_u64(), Some(2 * split[1]));
    // The plan's links name where its GPUs are now.
    let links = plan["network"]["links"].as_array().expect("a network section");
    assert!(links.iter().all(|l| l["a"] != "n1" && l["b"] != "n1") && !links.is_empty(), "{plan}");
}
