//! The coordinator as an operator runs it: the real binary as a separate process on loopback,
//! its REST API over real HTTP, on SQLite and on the PostgreSQL at 127.0.0.1:5432; kill -9 and
//! restart lose nothing committed.

use crate::common;

use std::path::Path;

use serde_json::Value;

use common::{temp_dir, wait_for_state, Coordinator, TestDb};

const NODE: &str =
    "gpu: A100-80G\ngpus: 8\nnics: [{name: mlx5_0, kind: ib, gbps: 200}, {name: eth0, kind: ethernet, gbps: 25}]\nrdma_domain: lab\n";
const JOB: &str = "name: hello\nmodel: gpt3-1.3b\nglobal_batch: 32\nrun: python -c 'print(1)'\n";

/// Declare nodes, submit a job, see it planned on the live inventory and launched as
/// generation 1, cancel it; then kill -9 the coordinator and restart it: everything is there.
fn the_operator_story(data_dir: &Path, extra: &[&str]) {
    let c = Coordinator::start(data_dir, extra);
    for n in ["a100-0", "a100-1"] {
        let v = c.json("PUT", &format!("/api/v1/nodes/{n}"), NODE, 200);
        assert_eq!(v["agent_epoch"], 1);
    }
    let nodes = c.json("GET", "/api/v1/nodes", "", 200);
    assert_eq!(nodes.as_array().unwrap().len(), 2);
    assert_eq!(nodes[0]["inventory"]["gpus"], 8);
    assert_eq!(c.json("POST", "/api/v1/nodes/a100-1/drain", "", 200)["state"], "draining");
    assert_eq!(c.json("POST", "/api/v1/nodes/a100-1/undrain", "", 200)["state"], "active");

    // A dry run plans on the declared inventory and stores nothing.
    let plan = c.json("POST", "/api/v1/plan", JOB, 200);
    let ranks = plan["ranks"].as_array().unwrap();
    assert_eq!(ranks.len() as u64, plan["plan"]["gpus_used"].as_u64().unwrap(), "one rank per GPU of the plan");
    assert!(ranks.iter().all(|r| ["a100-0", "a100-1"].contains(&r["node"].as_str().unwrap())));
    assert!(plan["plan"]["comm_groups"].is_array());
    assert_eq!(c.json("GET", "/api/v1/jobs", "", 200).as_array().unwrap().len(), 0);
    // A job may pin the planner's options: every stage of this plan has TP 4.
    let pinned = c.json("POST", "/api/v1/plan", &format!("{JOB}plan_options: {{tp: 4, search: fast}}\n"), 200);
    let stages: Vec<&Value> = pinned["plan"]["replicas"].as_array().unwrap().iter().flat_map(|r| r["stages"].as_array().unwrap()).collect();
    assert!(!stages.is_empty() && stages.iter().all(|s| s["tp"] == 4), "{}", pinned["plan"]);
    let e = error_of(&c, "POST", "/api/v1/plan", &format!("{JOB}plan_options: {{tp: 3}}\n"), 400);
    assert!(e.contains("plan_options.tp"), "{e}");
    carried_plans_run_as_given(&c, &pinned["plan"]);

    let job = c.json("POST", "/api/v1/jobs", JOB, 201);
    let id = job["id"].as_i64().unwrap();
    assert_eq!(job["state"], "submitted");
    // A launch plans on live nodes only: with no agent running (tests/agents_e2e.rs runs
    // them), planning fails with that reason and nothing is launched.
    let done = wait_for_state(&c, id, &["failed"]);
    assert_eq!(done["generation"], 0);
    assert!(done["reason"].as_str().unwrap().contains("no live node"), "{done}");
    assert_eq!(c.call("GET", &format!("/api/v1/jobs/{id}/plan"), "").0, 404, "no plan was stored");

    let again = c.call("POST", &format!("/api/v1/jobs/{id}/cancel"), "");
    assert_eq!(again.0, 409, "a failed job cannot be cancelled: {}", again.1);
    let events = c.json("GET", &format!("/api/v1/jobs/{id}/events"), "", 200);
    let kinds: Vec<&str> = events.as_array().unwrap().iter().map(|e| e["kind"].as_str().unwrap()).collect();
    assert_eq!(kinds, ["submitted", "planning", "failed"]);

    // kill -9 and restart on the same state: nothing committed is lost.
    c.kill9();
    let c = Coordinator::start(data_dir, extra);
    assert_eq!(c.json("GET", "/api/v1/nodes", "", 200).as_array().unwrap().len(), 2);
    let j = c.json("GET", &format!("/api/v1/jobs/{id}"), "", 200);
    assert_eq!((j["state"].as_str(), j["generation"].as_i64()), (Some("failed"), Some(0)));
    let after = c.json("GET", &format!("/api/v1/jobs/{id}/events?after={}", events[1]["seq"]), "", 200);
    assert_eq!(after.as_array().unwrap().len(), 1);
}

#[test]
fn operator_story_on_sqlite() {
    the_operator_story(&temp_dir(), &[]);
}

#[test]
fn operator_story_on_postgres() {
    let db = TestDb::create("motley_e2e");
    the_operator_story(&temp_dir(), &["--database-url", &db.url]);
}

#[test]
fn tokens_bad_input_and_unplannable_jobs_get_clear_errors() {
    let dir = temp_dir();
    let c = Coordinator::start(&dir, &[]);
    assert_eq!(c.call_as(None, "GET", "/live", "").0, 200, "liveness needs no token");
    assert_eq!(c.call_as(None, "GET", "/ready", "").0, 200);
    let (status, body) = c.call_as(None, "GET", "/api/v1/jobs", "");
    assert_eq!(status, 401);
    assert!(body.contains("bearer token"), "{body}");
    assert_eq!(c.call_as(Some("wrong"), "GET", "/api/v1/jobs", "").0, 401);

    let bad_node = c.call("PUT", "/api/v1/nodes/x", "gpu: Z9000\ngpus: 8\n");
    assert_eq!(bad_node.0, 400);
    assert!(bad_node.1.contains("unknown GPU type 'Z9000'"), "{}", bad_node.1);
    let bad_job = c.call("POST", "/api/v1/jobs", &JOB.replace("global_batch: 32", "global_batch: 0"));
    assert_eq!(bad_job.0, 400);
    assert!(bad_job.1.contains("global_batch: must be at least 1"), "{}", bad_job.1);
    assert!(c.call("POST", "/api/v1/jobs", "name: [").1.contains("job file"));
    assert_eq!(c.call("GET", "/api/v1/jobs/77", "").0, 404);
    assert_eq!(c.call("GET", "/api/v1/jobs/abc", "").0, 400);
    assert_eq!(c.call("POST", "/api/v1/nodes/ghost/drain", "").0, 404);
    assert!(c.json("GET", "/api/v1/jobs", "", 200).as_array().unwrap().is_empty(), "nothing was stored");

    // No node can hold LLaMA-70B: the dry run answers with the planner's reason.
    c.json("PUT", "/api/v1/nodes/small", "gpu: T4\ngpus: 1\n", 200);
    let (status, body) = c.call("POST", "/api/v1/plan", &JOB.replace("gpt3-1.3b", "llama-70b"));
    assert_eq!(status, 409, "{body}");
    assert!(body.contains("does not fit"), "{body}");
    drop(c);

    // --insecure serves without a token; an explicit --token is honoured.
    let c = Coordinator::start(&temp_dir(), &["--insecure"]);
    assert_eq!(c.call_as(None, "GET", "/api/v1/jobs", "").0, 200);
    let c2 = Coordinator::start(&temp_dir(), &["--token", "s3cret"]);
    assert_eq!(c2.call_as(Some("s3cret"), "GET", "/api/v1/nodes", "").0, 200);
    assert_eq!(c2.call_as(None, "GET", "/api/v1/nodes", "").0, 401);
}

/// The JSON error body's `error`, asserting the status and that the body is the API's shape.
/// A job may carry a whole plan (`plan:`, the document `motley plan -o json` prints): it runs
/// on exactly its GPUs in its order, or is refused with the field named.
fn carried_plans_run_as_given(c: &Coordinator, planned: &Value) {
    let with_plan = |plan: &Value| format!("{JOB}plan: {plan}\n");
    // Its own GPUs, reversed inside each TP group's order: the plan is not re-made.
    let mut plan = planned.clone();
    for r in plan["replicas"].as_array_mut().unwrap() {
        for st in r["stages"].as_array_mut().unwrap() {
            st["gpus"].as_array_mut().unwrap().reverse();
        }
    }
    let ran = c.json("POST", "/api/v1/plan", &with_plan(&plan), 200);
    assert_eq!(ran["plan"]["search"]["mode"], "given");
    for (r, want) in ran["plan"]["replicas"].as_array().unwrap().iter().zip(plan["replicas"].as_array().unwrap()) {
        for (st, w) in r["stages"].as_array().unwrap().iter().zip(want["stages"].as_array().unwrap()) {
            assert_eq!((&st["gpus"], &st["layers"], &st["tp"]), (&w["gpus"], &w["layers"], &w["tp"]));
        }
    }
    assert_eq!(ran["ranks"][0]["node"], plan["replicas"][0]["stages"][0]["gpus"][0]["node"]);
    assert_eq!(ran["ranks"][0]["gpu"], plan["replicas"][0]["stages"][0]["gpus"][0]["index"]);
    // Refused, naming the field: a node that is not there, a GPU it does not have, a TP group
    // across nodes, samples that do not add up, a stage that does not fit, a batch that differs.
    let refused = |plan: &Value, field: &str| {
        let e = error_of(c, "POST", "/api/v1/plan", &with_plan(plan), 400);
        assert!(e.starts_with(field), "want {field}: {e}");
    };
    let mut p = planned.clone();
    p["replicas"][0]["stages"][0]["gpus"][0]["node"] = "nowhere".into();
    refused(&p, "plan.replicas[0].stages[0].gpus[0]");
    let mut p = planned.clone();
    p["replicas"][0]["stages"][0]["gpus"][0]["index"] = 99.into();
    refused(&p, "plan.replicas[0].stages[0].gpus[0]");
    let mut p = planned.clone();
    p["replicas"][0]["stages"][0]["gpus"][0]["node"] =
        if p["replicas"][0]["stages"][0]["gpus"][0]["node"] == "a100-0" { "a100-1" } else { "a100-0" }.into();
    let e = error_of(c, "POST", "/api/v1/plan", &with_plan(&p), 400);
    assert!(e.starts_with("plan.replicas[0].stages[0].gpus"), "{e}");
    let mut p = planned.clone();
    p["replicas"][0]["samples"] = 1.into();
    refused(&p, "plan.replicas[0].samples");
    let mut p = planned.clone();
    p["global_batch"] = 64.into();
    refused(&p, "plan.global_batch");
    // Every layer on one GPU of a 70B model: far beyond 80 GB.
    let big = JOB.replace("gpt3-1.3b", "llama-70b").replace("global_batch: 32", "global_batch: 1");
    let one_gpu = serde_json::json!({"global_batch": 1, "micro_batch": 1, "replicas": [{"micro_batches": 1, "stages": [
        {"layers": [0, 80], "gpu": "A100-80G", "tp": 1, "dp": 1, "gpus": [{"node": "a100-0", "index": 0}]}]}]});
    let e = error_of(c, "POST", "/api/v1/plan", &format!("{big}plan: {one_gpu}\n"), 400);
    assert!(e.starts_with("plan.replicas[0].stages[0]: needs") && e.contains("GiB"), "{e}");
    let mut half = one_gpu.clone();
    half["replicas"][0]["stages"][0]["layers"] = serde_json::json!([0, 40]);
    let e = error_of(c, "POST", "/api/v1/plan", &format!("{big}plan: {half}\n"), 400);
    assert!(e.starts_with("plan.replicas") && e.contains("layers"), "{e}");
}

fn error_of(c: &Coordinator, method: &str, path: &str, body: &str, want: u16) -> String {
    let (status, text) = c.call(method, path, body);
    assert_eq!(status, want, "{method} {}: {text}", &path[..path.len().min(80)]);
    let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("not the JSON error shape ({e}): {text}"));
    assert!(v["grpc_code"].is_i64(), "{text}");
    v["error"].as_str().unwrap().to_string()
}

#[test]
fn bad_names_sizes_and_the_agents_token_are_refused_in_json() {
    let dir = temp_dir();
    let c = Coordinator::start(&dir, &[]);
    // The agents' token is not the operators': the control API answers it 403.
    let agent_token = c.agent_token.clone().expect("an agent token is generated beside the operators'");
    assert_ne!(Some(&agent_token), c.token.as_ref());
    let (status, body) = c.call_as(Some(&agent_token), "GET", "/api/v1/nodes", "");
    assert_eq!(status, 403, "{body}");
    assert!(body.contains("agents' token"), "{body}");

    // Node names that are not DNS-like never get in.
    let long = "a".repeat(5000);
    for bad in ["..%2F..%2Fetc", "a%0Ab", "a%1B%5B31mb", long.as_str(), "-x"] {
        let e = error_of(&c, "PUT", &format!("/api/v1/nodes/{bad}"), "gpu: A100-80G\ngpus: 8\n", 400);
        assert!(e.starts_with("node.name:"), "{e}");
        assert!(!e.contains('\n') && !e.contains('\u{1b}'), "{e}");
    }
    assert!(c.json("GET", "/api/v1/nodes", "", 200).as_array().unwrap().is_empty());

    // Job files: a long name, a huge env value, a huge command, relaunch budgets without a checkpoint to resume from.
    let job = "name: j\nmodel: gpt3-1.3b\nglobal_batch: 8\nrun: 'true'\n";
    let e = error_of(&c, "POST", "/api/v1/jobs", &job.replace("name: j", &format!("name: {}", "n".repeat(254))), 400);
    assert!(e.starts_with("name: is 254 characters; at most 253"), "{e}");
    let e = error_of(&c, "POST", "/api/v1/jobs", &format!("{job}envs: {{BIG: '{}'}}\n", "x".repeat(900_000)), 400);
    assert!(e.starts_with("envs.BIG: is 900000 bytes"), "{e}");
    let e = error_of(&c, "POST", "/api/v1/jobs", &job.replace("run: 'true'", &format!("run: 'echo {}'", "y".repeat(70_000))), 400);
    assert!(e.starts_with("run: is 70005 bytes; at most 65536"), "{e}");
    let e = error_of(&c, "POST", "/api/v1/jobs", &format!("{job}max_restarts: 2\n"), 400);
    assert!(e.starts_with("max_restarts: a relaunch resumes from the newest complete checkpoint"), "{e}");
    let e = error_of(&c, "POST", "/api/v1/jobs", &format!("{job}max_preemptions: 1\n"), 400);
    assert!(e.starts_with("max_preemptions:"), "{e}");
    assert!(c.json("GET", "/api/v1/jobs", "", 200).as_array().unwrap().is_empty(), "nothing was stored");

    // A body over the limit is refused in the API's JSON shape, not axum's text.
    let e = error_of(&c, "POST", "/api/v1/jobs", &"#".repeat(3 << 20), 413);
    assert!(e.contains("request body is over"), "{e}");

    // A node is removed once nothing runs there; a removed one is gone.
    c.json("PUT", "/api/v1/nodes/spare", "gpu: T4\ngpus: 1\n", 200);
    assert_eq!(c.json("DELETE", "/api/v1/nodes/spare", "", 200)["name"], "spare");
    error_of(&c, "GET", "/api/v1/nodes/spare", "", 404);
    error_of(&c, "DELETE", "/api/v1/nodes/spare", "", 404);

    // The data directory and every file in it are the service user's alone.
    use std::os::unix::fs::PermissionsExt;
    let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&dir), 0o700);
    for f in ["coordinator.db", "token", "agent-token"] {
        assert_eq!(mode(&dir.join(f)), 0o600, "{f}");
    }
}

#[test]
fn planning_has_a_deadline() {
    // 1 ms: no plan of a 512-GPU cluster is made that fast.
    let c = Coordinator::start(&temp_dir(), &["--plan-timeout-ms", "1"]);
    for i in 0..64 {
        c.json("PUT", &format!("/api/v1/nodes/a100-{i}"), NODE, 200);
    }
    let e = error_of(&c, "POST", "/api/v1/plan", JOB, 504);
    assert!(e.starts_with("planning took longer than 1 ms"), "{e}");
    assert!(e.contains("plan_timeout_s"), "names the fix: {e}");
    // The job file's own deadline wins over the coordinator's.
    let plan = c.json("POST", "/api/v1/plan", &format!("{JOB}plan_timeout_s: 60\n"), 200);
    assert!(!plan["ranks"].as_array().unwrap().is_empty());
    let e = error_of(&c, "POST", "/api/v1/plan", &format!("{JOB}plan_timeout_s: 0\n"), 400);
    assert!(e.starts_with("plan_timeout_s:"), "{e}");
}
