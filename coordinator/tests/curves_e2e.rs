//! Training curves through the REST API: a coordinator (with tokens) and an agent as real
//! processes; a job whose rank 0 prints the training lines (`{"step", "loss", "tokens_per_s",
//! "step_s"}`, `{"step", "eval_loss"}`, with a NaN loss and other output among them) runs,
//! and `GET /api/v1/jobs/{id}/curves` answers its points, `/curves.svg` draws them; a job not
//! launched has none; a generation whose agent is gone says why; curves read while rank 0's log
//! grows answer what a fresh read would; a job that keeps going after rank 0's replica is lost
//! draws on from the new leader's log.

use crate::common;

use std::time::Duration;

use common::{wait_for_state, Agent, Coordinator};
use serde_json::{json, Value};

fn until(what: &str, mut ok: impl FnMut() -> bool) {
    common::until_every(what, Duration::from_millis(100), || ok().then_some(()));
}

/// A coordinator (with tokens) and one live agent, `node-0` (eight A100s), that runs ranks as root.
fn coordinator_and_agent(dir: &std::path::Path) -> (Coordinator, common::Proc) {
    let port_base = common::master_port_base();
    let c = Coordinator::start(dir, &["--heartbeat-ms", "500", "--master-port-base", &port_base]);
    let agent_token = c.agent_token.clone().or_else(|| c.token.clone()).unwrap();
    let agent = Agent::new(&c.grpc_url(), "node-0", "examples/nodes/a100.yaml", &dir.join("agent"))
        .arg("--allow-root-ranks")
        .args(["--token", &agent_token])
        .spawn();
    until("the agent registered", || c.json("GET", "/api/v1/nodes", "", 200)[0]["live"] == true);
    (c, agent)
}

const LINES: &str = r#"[ "$RANK" = 0 ] || exit 0
echo "loading the model"
printf '%s\n' '{"step": 1, "loss": 4.5, "tokens_per_s": 1000.5, "step_s": 0.25}' \
  '{"step": 2, "loss": 4.0, "tokens_per_s": 1100, "step_s": 0.2}' \
  '{"step": 2, "eval_loss": 4.25}' \
  '{"step": 3, "loss": NaN, "tokens_per_s": 900}' \
  '{"step": 3, "loss": 3.5, "tokens_per_s": 1200, "step_s": 0.3}' \
  '{"note": "not a step"}' 'step 4 loss 3.0'
"#;

#[test]
fn a_jobs_training_lines_come_back_as_points_and_a_picture() {
    let dir = common::temp_dir();
    let (c, agent) = coordinator_and_agent(&dir);

    let script = dir.join("train.sh");
    std::fs::write(&script, LINES).unwrap();
    let job = format!("name: curvy\nmodel: gpt3-1.3b\nglobal_batch: 16\nresources: {{gpus: 2}}\nrun: 'sh {}'\n", script.display());
    let id = c.json("POST", "/api/v1/jobs", &job, 201)["id"].as_i64().unwrap();
    let done = wait_for_state(&c, id, &["succeeded", "failed"]);
    assert_eq!(done["state"], "succeeded", "{done}");

    let curves = c.json("GET", &format!("/api/v1/jobs/{id}/curves"), "", 200);
    let want = json!({"generations": [{
        "generation": 1,
        "points": [
            {"step": 1, "loss": 4.5, "tokens_per_s": 1000.5, "step_s": 0.25},
            {"step": 2, "loss": 4.0, "tokens_per_s": 1100.0, "step_s": 0.2},
            {"step": 3, "loss": 3.5, "tokens_per_s": 1200.0, "step_s": 0.3}],
        "evals": [{"step": 2, "eval_loss": 4.25}],
        "non_finite": 1,
        "skipped_bytes": 0}]});
    assert_eq!(curves, want);

    let (status, svg) = c.call("GET", &format!("/api/v1/jobs/{id}/curves.svg"), "");
    assert_eq!(status, 200, "{svg}");
    assert!(svg.starts_with("<svg ") && svg.ends_with("</svg>\n"), "{svg}");
    assert!(svg.contains(r#"<polyline class="loss" data-generation="1" data-points="3""#), "{svg}");
    assert!(svg.contains(r#"<polyline class="tokens" data-generation="1" data-points="3""#), "{svg}");
    assert_eq!(svg.matches(r#"class="eval""#).count(), 1);
    assert!(svg.contains("job 1: curvy · steps 1–3 · loss 3.500"), "{svg}");
    assert!(svg.contains("gen 1: 1 losses skipped (not finite: NaN or inf)"), "{svg}");
    assert_eq!(c.call_as(Some("wrong"), "GET", &format!("/api/v1/jobs/{id}/curves.svg"), "").0, 401);

    // A job not launched yet (it waits for 64 GPUs) has no generation: an empty chart.
    let wide = c.json("POST", "/api/v1/jobs", "name: wide\nmodel: gpt3-1.3b\nglobal_batch: 16\nresources: {gpus: 64}\nrun: 'true'\n", 201);
    let wide = wide["id"].as_i64().unwrap();
    assert_eq!(c.json("GET", &format!("/api/v1/jobs/{wide}/curves"), "", 200), json!({"generations": []}));
    assert!(c.call("GET", &format!("/api/v1/jobs/{wide}/curves.svg"), "").1.contains(">no steps yet</text>"));
    assert_eq!(c.call("GET", "/api/v1/jobs/999/curves", "").0, 404);
    assert_eq!(c.call("GET", "/api/v1/jobs/x/curves.svg", "").0, 400);

    // Both are in the OpenAPI document.
    let doc: Value = serde_json::from_str(&c.call_as(None, "GET", "/api/v1/openapi.json", "").1).unwrap();
    for path in ["/api/v1/jobs/{id}/curves", "/api/v1/jobs/{id}/curves.svg"] {
        assert!(doc["paths"][path]["get"].is_object(), "{path} missing from the OpenAPI document");
    }

    // The agent that held rank 0 is gone: the generation is there, saying why (its node has no
    // live agent, or the agent's address refuses the connection, by when the lease lapses).
    drop(agent);
    until("the agent's lease lapsed", || c.json("GET", "/api/v1/nodes", "", 200)[0]["live"] == false);
    let curves = c.json("GET", &format!("/api/v1/jobs/{id}/curves"), "", 200);
    let gen = &curves["generations"][0];
    assert_eq!(gen["points"], json!([]));
    assert!(gen["error"].as_str().unwrap().starts_with("node node-0"), "{curves}");
    let (status, svg) = c.call("GET", &format!("/api/v1/jobs/{id}/curves.svg"), "");
    assert_eq!(status, 200);
    assert!(svg.contains("gen 1: log not read: node node-0") && svg.contains("no steps yet"), "{svg}");
}

/// Rank 0 prints two steps, waits for a file, then prints a step again and a new one: each read
/// of the curves while it runs fetches only what was written since the last (the coordinator
/// keeps what it parsed), and answers what a fresh read of the whole log would.
#[test]
fn curves_read_while_the_log_grows_answer_as_a_fresh_read() {
    let dir = common::temp_dir();
    let (c, _agent) = coordinator_and_agent(&dir);
    let go = dir.join("go");
    let script = dir.join("grow.sh");
    std::fs::write(
        &script,
        format!(
            r#"[ "$RANK" = 0 ] || exit 0
printf '%s\n' '{{"step": 1, "loss": 4.5}}' '{{"step": 2, "loss": 4.0}}'
until [ -e {go} ]; do sleep 0.05; done
printf '%s\n' 'resumed' '{{"step": 2, "loss": 3.75}}' '{{"step": 3, "loss": 3.5}}'
"#,
            go = go.display()
        ),
    )
    .unwrap();
    let job = format!("name: grow\nmodel: gpt3-1.3b\nglobal_batch: 16\nresources: {{gpus: 2}}\nrun: 'sh {}'\n", script.display());
    let id = c.json("POST", "/api/v1/jobs", &job, 201)["id"].as_i64().unwrap();
    let steps = |curves: &Value| -> Vec<(i64, f64)> {
        curves["generations"][0]["points"]
            .as_array()
            .map(|p| p.iter().map(|p| (p["step"].as_i64().unwrap(), p["loss"].as_f64().unwrap())).collect())
            .unwrap_or_default()
    };
    until("the first two steps drawn", || steps(&c.json("GET", &format!("/api/v1/jobs/{id}/curves"), "", 200)).len() == 2);
    assert_eq!(steps(&c.json("GET", &format!("/api/v1/jobs/{id}/curves"), "", 200)), [(1, 4.5), (2, 4.0)]);
    std::fs::write(&go, b"").unwrap();
    assert_eq!(wait_for_state(&c, id, &["succeeded", "failed"])["state"], "succeeded");
    let curves = c.json("GET", &format!("/api/v1/jobs/{id}/curves"), "", 200);
    assert_eq!(steps(&curves), [(1, 4.5), (2, 3.75), (3, 3.5)], "step 2 printed again: its later line; {curves}");
    assert_eq!(curves["generations"][0]["skipped_bytes"], 0);
    assert_eq!(c.json("GET", &format!("/api/v1/jobs/{id}/curves"), "", 200), curves, "read again: the same");
}

/// A job of two replicas (one GPU each) keeps going when rank 0's replica fails
/// (docs/keep-going.md): rank 0 prints steps 1 and 2 and exits 1; rank 1, the next epoch's
/// leader, prints step 2 again (as a new leader does) and step 3. The curve goes on through the
/// loss: steps 1-3 in one generation, each once, from both logs.
#[test]
fn the_curves_go_on_in_the_new_leaders_log_after_rank_0s_replica_is_lost() {
    let dir = common::temp_dir();
    let (c, _agent) = coordinator_and_agent(&dir);
    let go = dir.join("go");
    let script = dir.join("lose0.sh");
    std::fs::write(
        &script,
        format!(
            r#"if [ "$RANK" = 0 ]; then
  printf '%s\n' '{{"step": 1, "loss": 4.5, "epoch": 0}}' '{{"step": 2, "loss": 4.0, "epoch": 0}}'
  until [ -e {go} ]; do sleep 0.05; done
  exit 1
fi
until grep -Eq '"leader": ?1[,}}]' "$MOTLEY_MEMBERSHIP" 2>/dev/null; do sleep 0.05; done
printf '%s\n' '{{"step": 2, "loss": 4.0, "epoch": 1, "again": true}}' '{{"step": 3, "loss": 3.5, "epoch": 1}}'
"#,
            go = go.display()
        ),
    )
    .unwrap();
    let replica = |gpu: u32| {
        format!("{{samples: 2, micro_batches: 2, stages: [{{layers: [0, 4], gpu: A100-80G, tp: 1, dp: 1, gpus: [{{node: node-0, index: {gpu}}}]}}]}}")
    };
    let job = format!(
        "name: lose0\nmodel: {{name: four, layers: 4, hidden: 64, heads: 4, seq_len: 32, vocab: 128}}\nglobal_batch: 4\n\
         run: 'sh {}'\nplan: {{global_batch: 4, micro_batch: 1, replicas: [{}, {}]}}\n",
        script.display(),
        replica(0),
        replica(1)
    );
    let id = c.json("POST", "/api/v1/jobs", &job, 201)["id"].as_i64().unwrap();
    // Rank 0 fails only once every rank runs: a job keeps going from `running`.
    wait_for_state(&c, id, &["running"]);
    std::fs::write(&go, b"").unwrap();
    let done = wait_for_state(&c, id, &["succeeded", "failed"]);
    assert_eq!((done["state"].as_str(), done["generation"].as_i64()), (Some("succeeded"), Some(1)), "{done}");
    let curves = c.json("GET", &format!("/api/v1/jobs/{id}/curves"), "", 200);
    let gens = curves["generations"].as_array().unwrap();
    assert_eq!(gens.len(), 1, "{curves}");
    let steps: Vec<(i64, f64)> =
        gens[0]["points"].as_array().unwrap().iter().map(|p| (p["step"].as_i64().unwrap(), p["loss"].as_f64().unwrap())).collect();
    assert_eq!(steps, [(1, 4.5), (2, 4.0), (3, 3.5)], "{curves}");
    assert!(gens[0].get("error").is_none(), "{curves}");
    let (status, svg) = c.call("GET", &format!("/api/v1/jobs/{id}/curves.svg"), "");
    assert_eq!(status, 200);
    assert!(svg.contains(r#"<polyline class="loss" data-generation="1" data-points="3""#), "{svg}");
}
