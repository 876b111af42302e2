//! A coordinator and four agents as separate processes on loopback, each agent with its
//! inventory file: a job whose ranks check their environment succeeds; a cancelled job leaves
//! no rank process behind; an agent killed with -9 loses its lease and fails its job with the
//! reason; jobs share the GPUs without ever sharing one, and a job waits for its share.

use crate::common;

use std::io::Read;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{signal, Agent, Coordinator, Proc};
use serde_json::Value;

// Generous for a loaded 2-core CI machine: a lease lasts 1.5 s.
const HEARTBEAT_MS: u64 = 500;

struct Cluster {
    coordinator: Coordinator,
    agents: Vec<Option<Proc>>,
    dir: PathBuf,
}

fn start(agents: usize) -> Cluster {
    start_with(vec![PathBuf::from("examples/nodes/a100.yaml"); agents], None)
}

/// Agents `node-0`, `node-1`, ... with these inventory files (relative to the repository or
/// absolute), in `dir` when given.
fn start_with(inventories: Vec<PathBuf>, dir: Option<PathBuf>) -> Cluster {
    let dir = dir.unwrap_or_else(|| common::scratch("motley_agents_e2e"));
    let heartbeat = HEARTBEAT_MS.to_string();
    let port_base = common::master_port_base();
    let coordinator = Coordinator::start(&dir, &["--insecure", "--heartbeat-ms", &heartbeat, "--master-port-base", &port_base]);
    let count = inventories.len();
    let agents = inventories
        .iter()
        .enumerate()
        .map(|(i, inventory)| {
            let node = format!("node-{i}");
            Some(Agent::new(&coordinator.grpc_url(), &node, inventory, &dir.join(format!("agent-{i}"))).arg("--allow-root-ranks").spawn())
        })
        .collect();
    let c = Cluster { coordinator, agents, dir };
    c.until(|c| c.get("/api/v1/nodes").as_array().unwrap().iter().filter(|n| n["live"] == true).count() == count, "agents registered");
    c
}

impl Cluster {
    fn http(&self, method: &str, path: &str, body: &str) -> Value {
        let (_, text) = common::call(&self.coordinator.addr, None, method, path, body);
        serde_json::from_str(&text).unwrap_or_else(|_| panic!("{method} {path}: {text}"))
    }

    fn get(&self, path: &str) -> Value {
        self.http("GET", path, "")
    }

    fn until(&self, ok: impl Fn(&Cluster) -> bool, what: &str) {
        common::until(what, || ok(self).then_some(()));
    }

    fn job_state(&self, id: i64) -> String {
        self.get(&format!("/api/v1/jobs/{id}"))["state"].as_str().unwrap().to_string()
    }
}

/// Kills the ranks carrying the marker when dropped (a failed assertion leaves none behind).
struct Reaper(String);

impl Drop for Reaper {
    fn drop(&mut self) {
        let _ = Command::new("pkill").args(["-f", &self.0]).status();
    }
}

/// Processes whose command line contains `marker`.
fn processes_with(marker: &str) -> usize {
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| std::fs::read(e.ok()?.path().join("cmdline")).ok())
        .filter(|c| String::from_utf8_lossy(c).contains(marker))
        .count()
}

#[test]
fn ranks_get_their_environment_and_the_job_succeeds() {
    let c = start(4);
    // Every rank runs the workspace's probe: it checks the torchrun and Motley variables and
    // the plan file, and meets every other rank at MASTER_ADDR:MASTER_PORT.
    let probe = common::sibling("motley-rank-probe");
    let job = format!(
        "name: check\nmodel: gpt3-1.3b\nglobal_batch: 16\nresources: {{gpus: 8}}\nrun: 'test \"$HELLO\" = world && test \"$MOTLEY_TP_RANK\" -lt \"$MOTLEY_TP_SIZE\" && test \"$MOTLEY_DP_RANK\" -lt \"$MOTLEY_DP_SIZE\" && test \"$MOTLEY_PP_RANK\" -lt \"$MOTLEY_PP_SIZE\" && grep -q kind \"$MOTLEY_NCCL_GROUPS\" && {} && echo \"rank $RANK ok\"'\nenvs: {{HELLO: world}}\n",
        probe.display()
    );
    let id = c.http("POST", "/api/v1/jobs", &job)["id"].as_i64().unwrap();
    c.until(|c| ["succeeded", "failed"].contains(&c.job_state(id).as_str()), "the job ends");
    let j = c.get(&format!("/api/v1/jobs/{id}"));
    assert_eq!(j["state"], "succeeded", "{j}");
    let kinds: Vec<String> =
        c.get(&format!("/api/v1/jobs/{id}/events")).as_array().unwrap().iter().map(|e| e["kind"].as_str().unwrap().to_string()).collect();
    assert!(kinds.contains(&"running".to_string()) && kinds.last().unwrap() == "succeeded", "{kinds:?}");
    let logs: Vec<PathBuf> = (0..4).map(|i| c.dir.join(format!("agent-{i}/jobs/{id}/1"))).filter(|p| p.exists()).collect();
    assert!(!logs.is_empty());
    let text: String =
        logs.iter().flat_map(|d| std::fs::read_dir(d).unwrap()).filter_map(|e| std::fs::read_to_string(e.unwrap().path()).ok()).collect();
    assert!(text.contains("rank 0 ok"), "{text}");

    // A drained node's agent is told (it marks its work directory); undraining clears it.
    let flag = c.dir.join("agent-1/draining");
    c.http("POST", "/api/v1/nodes/node-1/drain", "");
    c.until(|_| flag.exists(), "node-1's agent marks itself draining");
    c.http("POST", "/api/v1/nodes/node-1/undrain", "");
    c.until(|_| !flag.exists(), "node-1's agent clears the mark");

    // A rank that fails fails the job, with the rank and its exit code.
    let id = c.http("POST", "/api/v1/jobs", "name: bad\nmodel: gpt3-1.3b\nglobal_batch: 8\nresources: {gpus: 2}\nrun: 'exit 3'\n")["id"]
        .as_i64()
        .unwrap();
    c.until(|c| ["succeeded", "failed"].contains(&c.job_state(id).as_str()), "the bad job ends");
    let j = c.get(&format!("/api/v1/jobs/{id}"));
    assert_eq!(j["state"], "failed");
    assert!(j["reason"].as_str().unwrap().contains("exited with code 3"), "{j}");
}

#[test]
fn cancel_kills_every_rank_and_a_lost_agent_fails_its_job() {
    let mut c = start(4);
    let marker = format!("motley-e2e-marker-{}", std::process::id());
    let job = format!("name: sleeper\nmodel: gpt3-1.3b\nglobal_batch: 16\nresources: {{gpus: 4}}\nrun: 'sleep 600; echo {marker}'\n");
    let id = c.http("POST", "/api/v1/jobs", &job)["id"].as_i64().unwrap();
    c.until(|c| c.job_state(id) == "running", "the sleeper runs");
    assert!(processes_with(&marker) > 0);
    assert_eq!(c.http("POST", &format!("/api/v1/jobs/{id}/cancel"), "")["state"], "cancelled");
    c.until(|_| processes_with(&marker) == 0, "every rank process is gone after cancel");

    // A second sleeper on node-0 only; then node-0's agent dies.
    let job = format!(
        "name: doomed\nmodel: gpt3-1.3b\nglobal_batch: 8\nresources: {{gpus: 2, nodes: [node-0]}}\nrun: 'sleep 600; echo {marker}'\n"
    );
    let id = c.http("POST", "/api/v1/jobs", &job)["id"].as_i64().unwrap();
    c.until(|c| c.job_state(id) == "running", "the doomed job runs");
    let mut agent = c.agents[0].take().unwrap();
    agent.0.kill().unwrap(); // SIGKILL
    agent.0.wait().unwrap();
    c.until(|c| c.job_state(id) == "failed", "the lost node's job fails");
    let j = c.get(&format!("/api/v1/jobs/{id}"));
    assert!(j["reason"].as_str().unwrap().contains("node node-0 lost: no heartbeat"), "{j}");
    let live: Vec<bool> = c.get("/api/v1/nodes").as_array().unwrap().iter().map(|n| n["live"] == true).collect();
    assert_eq!(live, [false, true, true, true]);
    // The orphaned ranks of the dead agent are not ours to reap here: kill them by marker.
    let _ = Command::new("pkill").args(["-f", &marker]).status();
}

/// (node, GPU) of every rank of the job's current launch; also checks that each rank's
/// CUDA_VISIBLE_DEVICES is its GPU in the plan.
fn gpus_of(c: &Cluster, id: i64) -> Vec<(String, i64)> {
    let plan = c.get(&format!("/api/v1/jobs/{id}/plan"));
    let in_plan: Vec<(String, i64)> = plan["plan"]["replicas"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|r| r["stages"].as_array().unwrap().iter())
        .flat_map(|s| s["gpus"].as_array().unwrap().iter())
        .map(|g| (g["node"].as_str().unwrap().to_string(), g["index"].as_i64().unwrap()))
        .collect();
    let mut ranks: Vec<(String, i64)> = plan["ranks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| (r["assignment"]["node"].as_str().unwrap().to_string(), r["assignment"]["gpu"].as_i64().unwrap()))
        .collect();
    assert_eq!(ranks, in_plan, "ranks are numbered in plan order");
    ranks.sort();
    ranks
}

#[test]
fn jobs_share_the_cluster_but_never_a_gpu_and_a_job_waits_for_its_share() {
    let c = start(2); // 16 GPUs
    let marker = format!("motley-queue-marker-{}", std::process::id());
    let _reaper = Reaper(marker.clone());
    let job = |name: &str, gpus: u32| {
        format!(
            "name: {name}\nmodel: gpt3-1.3b\nglobal_batch: 16\nresources: {{gpus: {gpus}}}\nrun: 'test \"$CUDA_VISIBLE_DEVICES\" -ge 0 && sleep 600; echo {marker}'\n"
        )
    };
    let a = c.http("POST", "/api/v1/jobs", &job("a", 6))["id"].as_i64().unwrap();
    c.until(|c| c.job_state(a) == "running", "a runs");
    let b = c.http("POST", "/api/v1/jobs", &job("b", 8))["id"].as_i64().unwrap();
    c.until(|c| c.job_state(b) == "running", "b runs beside a");
    let (ga, gb) = (gpus_of(&c, a), gpus_of(&c, b));
    assert!(ga.len() <= 6 && gb.len() <= 8, "within their budgets: {ga:?} {gb:?}");
    assert!(ga.iter().all(|g| !gb.contains(g)), "a {ga:?} and b {gb:?} share a GPU");

    // 2 GPUs are left; c wants 6: it waits, saying for what, and changes nothing.
    let cid = c.http("POST", "/api/v1/jobs", &job("c", 6))["id"].as_i64().unwrap();
    c.until(|c| c.get(&format!("/api/v1/jobs/{cid}/events")).as_array().unwrap().iter().any(|e| e["kind"] == "waiting"), "c waits");
    let events = c.get(&format!("/api/v1/jobs/{cid}/events"));
    let waiting = events.as_array().unwrap().iter().find(|e| e["kind"] == "waiting").unwrap();
    let why = waiting["message"].as_str().unwrap();
    let free = 16 - ga.len() - gb.len();
    assert!(free < 6, "the test needs c not to fit: {free} free");
    assert!(why.contains(&format!("waiting for 6 GPUs: {free} of the 16")) && why.contains(&format!("{a}, {b}")), "{why}");
    std::thread::sleep(Duration::from_millis(3 * HEARTBEAT_MS));
    assert_eq!(c.job_state(cid), "submitted");
    // The job itself says why it waits (its reason while queued).
    assert_eq!(c.get(&format!("/api/v1/jobs/{cid}"))["reason"], why);
    // A job submitted behind it waits too, even though it would fit: first come, first served.
    let d = c.http("POST", "/api/v1/jobs", &job("d", 2))["id"].as_i64().unwrap();
    std::thread::sleep(Duration::from_millis(3 * HEARTBEAT_MS));
    assert_eq!(c.job_state(d), "submitted");

    // a ends: c takes GPUs a held, still none of b's.
    assert_eq!(c.http("POST", &format!("/api/v1/jobs/{a}/cancel"), "")["state"], "cancelled");
    c.until(|c| c.job_state(cid) == "running", "c runs once a is gone");
    let gc = gpus_of(&c, cid);
    assert!(!gc.is_empty() && gc.len() <= 6);
    assert!(gc.iter().all(|g| !gb.contains(g)), "c {gc:?} and b {gb:?} share a GPU");
    c.until(|c| c.job_state(d) == "running", "d runs on the last 2");
    let gd = gpus_of(&c, d);
    assert!(gd.iter().all(|g| !gb.contains(g) && !gc.contains(g)), "d {gd:?} overlaps b or c");
    for id in [b, cid, d] {
        c.http("POST", &format!("/api/v1/jobs/{id}/cancel"), "");
    }
    c.until(|_| processes_with(&marker) == 0, "every rank process is gone");
}

#[test]
fn a_coordinator_paused_for_4_seconds_fails_no_job() {
    let c = start(2);
    let marker = format!("motley-pause-marker-{}", std::process::id());
    let _reaper = Reaper(marker.clone());
    let job = format!("name: patient\nmodel: gpt3-1.3b\nglobal_batch: 16\nresources: {{gpus: 16}}\nrun: 'sleep 600; echo {marker}'\n");
    let id = c.http("POST", "/api/v1/jobs", &job)["id"].as_i64().unwrap();
    c.until(|c| c.job_state(id) == "running", "the job runs");
    // A long GC, a VM migration, a slow disk: the coordinator does not run for 4 s, more than
    // its 1.5 s lease. It cannot have seen heartbeats meanwhile, so it judges no lease by them.
    let pid = c.coordinator.child.id();
    signal(pid, "-STOP");
    std::thread::sleep(Duration::from_secs(4));
    signal(pid, "-CONT");
    // Several leases later, the job is still running on both nodes.
    std::thread::sleep(Duration::from_millis(6 * HEARTBEAT_MS));
    let j = c.get(&format!("/api/v1/jobs/{id}"));
    assert_eq!(j["state"], "running", "{j}");
    c.until(|c| c.get("/api/v1/nodes").as_array().unwrap().iter().all(|n| n["live"] == true), "both agents hold leases again");
    let lost = c.get("/api/v1/jobs/0/events");
    assert!(!lost.to_string().contains("node_lost"), "{lost}");
    c.http("POST", &format!("/api/v1/jobs/{id}/cancel"), "");
    c.until(|_| processes_with(&marker) == 0, "every rank process is gone");
}

#[test]
fn a_second_agent_for_a_held_node_is_refused_and_a_node_is_removed_once_free() {
    let mut c = start(1);
    let grpc = c.get("/api/v1/leader")["grpc_url"].as_str().unwrap().to_string();
    // Another agent started with the same --node (its own work dir): refused, loudly, and it stops.
    let mut second = Agent::new(&grpc, "node-0", "examples/nodes/a100.yaml", &c.dir.join("impostor"))
        .arg("--allow-root-ranks")
        .stderr(Stdio::piped())
        .spawn();
    let started = Instant::now();
    let status = loop {
        if let Some(s) = second.0.try_wait().unwrap() {
            break s;
        }
        assert!(started.elapsed() < Duration::from_secs(30), "the second agent for node-0 kept going");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(!status.success());
    let mut err = String::new();
    second.0.stderr.take().unwrap().read_to_string(&mut err).unwrap();
    assert!(err.contains("held by another live agent"), "{err}");
    let node = &c.get("/api/v1/nodes")[0];
    assert_eq!((node["live"].as_bool(), node["agent_epoch"].as_i64()), (Some(true), Some(1)), "the first agent was never evicted: {node}");

    // A node with a live agent is not removed; once its agent is gone, it is.
    let refused = c.http("DELETE", "/api/v1/nodes/node-0", "");
    assert!(refused["error"].as_str().unwrap().contains("live agent"), "{refused}");
    let mut agent = c.agents[0].take().unwrap();
    agent.0.kill().unwrap();
    agent.0.wait().unwrap();
    c.until(|c| c.get("/api/v1/nodes")[0]["live"] == false, "node-0's lease ends");
    assert_eq!(c.http("DELETE", "/api/v1/nodes/node-0", "")["name"], "node-0");
    assert!(c.get("/api/v1/nodes").as_array().unwrap().is_empty());
}

/// A Holmes-style cluster (an InfiniBand island and a RoCE island, Ethernet everywhere) and a
/// TP 2 job: every rank starts with the union of its groups' device lists (NCCL reads
/// NCCL_IB_HCA and NCCL_SOCKET_IFNAME once per process) and the other settings all its groups
/// agree on, as the plan's comm_groups say; even a rank whose first group is NVLink-only.
#[test]
fn every_rank_of_a_hybrid_tp2_plan_starts_with_the_union_of_its_groups_device_lists() {
    let dir = common::scratch("motley_agents_e2e");
    let inventory = |kind: &str, domain: &str| {
        let path = dir.join(format!("{kind}.yaml"));
        let text = format!("gpu: A100-80G\ngpus: 4\nintra: nvlink\nnics:\n  - {{name: mlx5_0, kind: {kind}, gbps: 200}}\n  - {{name: eth0, kind: ethernet, gbps: 25}}\nrdma_domain: {domain}\n");
        std::fs::write(&path, text).unwrap();
        path
    };
    let (ib, roce) = (inventory("ib", "ib-island"), inventory("roce", "roce-island"));
    let c = start_with(vec![ib.clone(), ib, roce.clone(), roce], Some(dir));
    let job = "name: hybrid\nmodel: gpt3-1.3b\nglobal_batch: 16\nresources: {gpus: 16}\nplan_options: {tp: 2}\nrun: '(env | grep ^NCCL_ || true) > nccl-$MOTLEY_NODE-$CUDA_VISIBLE_DEVICES.txt && echo \"rank $RANK ok\"'\n";
    let id = c.http("POST", "/api/v1/jobs", job)["id"].as_i64().unwrap();
    c.until(|c| ["succeeded", "failed"].contains(&c.job_state(id).as_str()), "the job ends");
    let j = c.get(&format!("/api/v1/jobs/{id}"));
    assert_eq!(j["state"], "succeeded", "{j}");
    let plan = c.get(&format!("/api/v1/jobs/{id}/plan"));
    assert_eq!(plan["plan"]["precision"], "bf16", "plan_options.precision defaults to auto: bf16 on A100s");
    let groups = plan["plan"]["comm_groups"].as_array().unwrap().clone();
    assert!(groups.iter().any(|g| g["kind"] == "tp"), "TP 2 makes TP groups: {plan}");
    let transports: Vec<&str> = groups.iter().map(|g| g["transport"].as_str().unwrap()).collect();
    assert!(transports.iter().any(|t| ["ib", "roce"].contains(t)), "RDMA inside an island: {transports:?}");
    let mut with_hca = 0;
    for (node, gpu) in gpus_of(&c, id) {
        let agent = node.trim_start_matches("node-");
        let file = c.dir.join(format!("agent-{agent}/jobs/{id}/1/nccl-{node}-{gpu}.txt"));
        let text = std::fs::read_to_string(&file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
        let got: std::collections::BTreeMap<String, String> =
            text.lines().filter_map(|l| l.split_once('=')).map(|(k, v)| (k.to_string(), v.to_string())).collect();
        // The rank's groups, in plan order, each with its node's overrides.
        let mine: Vec<serde_json::Map<String, Value>> = groups
            .iter()
            .filter(|g| g["gpus"].as_array().unwrap().iter().any(|m| m["node"] == node.as_str() && m["index"] == gpu))
            .map(|g| {
                let mut env = g["env"].as_object().unwrap().clone();
                if let Some(over) = g.get("node_env").and_then(|n| n.get(&node)) {
                    env.extend(over.as_object().unwrap().clone());
                }
                env
            })
            .collect();
        assert!(!mine.is_empty(), "{node}:{gpu} is in some group");
        let mut want = std::collections::BTreeMap::new();
        for (k, v) in &mine[0] {
            if !k.ends_with("_HCA") && !k.ends_with("_IFNAME") && mine.iter().all(|e| e.get(k) == Some(v)) {
                want.insert(k.clone(), v.as_str().unwrap().to_string());
            }
        }
        for key in ["NCCL_IB_HCA", "NCCL_SOCKET_IFNAME"] {
            let mut names: Vec<&str> = vec![];
            for list in mine.iter().filter_map(|e| e.get(key)) {
                let list = list.as_str().unwrap().strip_prefix('=').expect("the planner's lists match exactly");
                for n in list.split(',') {
                    if !names.contains(&n) {
                        names.push(n);
                    }
                }
            }
            if !names.is_empty() {
                want.insert(key.to_string(), format!("={}", names.join(",")));
            }
        }
        assert_eq!(got, want, "{node}:{gpu}, groups {mine:?}");
        with_hca += usize::from(got.contains_key("NCCL_IB_HCA"));
    }
    assert!(with_hca > 0, "ranks in RDMA groups start with their HCAs although their first group is NVLink");
}
