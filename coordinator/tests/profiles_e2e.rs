//! Layer profiles through the real system: a coordinator and two agents as processes on
//! loopback, one agent given a `--python` (a stand-in for `python -m motley_torch.profile` that
//! writes the profiles file the real one would, timing nothing: the real profiler runs in the
//! Python suite, python/tests/test_dev_up.py). A job that plans from profiles only waits while
//! its profile is measured, is planned with it, and the next job of the model measures nothing;
//! a run that fails fails an `only` job with the profiler's words and leaves an `auto` job on
//! the roofline; a node whose agent cannot profile is named; `motley profile` lists, shows and
//! runs profiles. On SQLite and on PostgreSQL.

use crate::common;

use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::process::Command;

use common::{sibling, Agent, Coordinator, Proc, TestDb};
use serde_json::Value;

const HEARTBEAT_MS: u64 = 300;

struct System {
    coordinator: Coordinator,
    _agents: Vec<Proc>,
    dir: PathBuf,
}

/// What the stand-in profiler writes: 40 ms forward and 90 ms backward per layer, the model
/// hash of `MODEL` (`@HASH@`, what the real profiler computes from the model file it is given,
/// which must be the whole spec: it fails on a file without `family`), and its flags and
/// CUDA_VISIBLE_DEVICES appended to `calls.log`. Micro-batch 4 fails.
const FAKE_PROFILER: &str = r#"#!/bin/sh
here="$(dirname "$0")"
echo "$* CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES" >> "$here/calls.log"
while [ $# -gt 0 ]; do
  case "$1" in
    --model) model="$2"; shift;; --tp) tp="$2"; shift;; --micro-batch) mb="$2"; shift;;
    --seq-len) seq="$2"; shift;; --gpu) gpu="$2"; shift;; --dtype) dtype="$2"; shift;;
    --output) out="$2"; shift;;
  esac
  shift
done
if [ "$mb" = 4 ]; then echo "RuntimeError: CUDA out of memory (stand-in)" >&2; exit 1; fi
grep -q '"family":"gpt"' "$model" || { echo "the model file is not the whole spec" >&2; exit 1; }
hash=@HASH@
cat > "$out" <<EOF
profiles:
  - {gpu: $gpu, tp: $tp, micro_batch: $mb, fwd_ms: 40.0, bwd_ms: 90.0, act_mib: 1.0, model: tiny, model_hash: $hash, seq_len: $seq, dtype: $dtype, torch: 2.15.0-standin, device: cpu}
EOF
"#;

fn start(database_url: Option<&str>) -> System {
    let dir = common::scratch("motley_profiles_e2e");
    let python = dir.join("python");
    let spec: motley_solver::ModelSpec = serde_norway::from_str(MODEL).unwrap();
    std::fs::write(&python, FAKE_PROFILER.replace("@HASH@", &motley_coordinator::planning::profiling::model_hash(&spec))).unwrap();
    std::fs::set_permissions(&python, std::fs::Permissions::from_mode(0o755)).unwrap();
    let heartbeat = HEARTBEAT_MS.to_string();
    let mut flags = vec!["--insecure", "--heartbeat-ms", &heartbeat];
    if let Some(url) = database_url {
        flags.extend(["--database-url", url]);
    }
    // Its own directory: the coordinator makes every file in its data directory private.
    let coordinator = Coordinator::start(&dir.join("coordinator"), &flags);
    let mut agents = vec![];
    for (i, python) in [Some(&python), None].into_iter().enumerate() {
        let mut agent =
            Agent::new(&coordinator.grpc_url(), &format!("node-{i}"), "examples/nodes/a100.yaml", &dir.join(format!("agent-{i}")))
                .arg("--allow-root-ranks")
                .env_remove("MOTLEY_PYTHON");
        if let Some(p) = python {
            agent = agent.arg("--python").arg(p);
        }
        agents.push(agent.spawn());
    }
    let s = System { coordinator, _agents: agents, dir };
    s.until(|s| s.get("/api/v1/nodes").as_array().unwrap().iter().filter(|n| n["live"] == true).count() == 2, "agents registered");
    s
}

impl System {
    fn http(&self, method: &str, path: &str, body: &str) -> (u16, Value) {
        let c = common::call(&self.coordinator.addr, None, method, path, body);
        (c.0, serde_json::from_str(&c.1).unwrap_or_else(|_| panic!("{method} {path}: {}", c.1)))
    }

    fn get(&self, path: &str) -> Value {
        self.http("GET", path, "").1
    }

    fn until(&self, ok: impl Fn(&System) -> bool, what: &str) {
        common::until(what, || ok(self).then_some(()));
    }

    fn submit(&self, job: &str) -> i64 {
        let (status, v) = self.http("POST", "/api/v1/jobs", job);
        assert_eq!(status, 201, "{v}");
        v["id"].as_i64().unwrap()
    }

    fn ended(&self, id: i64) -> Value {
        self.until(
            |s| ["succeeded", "failed", "cancelled"].contains(&s.get(&format!("/api/v1/jobs/{id}"))["state"].as_str().unwrap()),
            "the job ends",
        );
        self.get(&format!("/api/v1/jobs/{id}"))
    }

    fn events(&self, id: i64) -> Vec<(String, String)> {
        self.get(&format!("/api/v1/jobs/{id}/events"))
            .as_array()
            .unwrap()
            .iter()
            .map(|e| (e["kind"].as_str().unwrap().to_string(), e["message"].as_str().unwrap().to_string()))
            .collect()
    }

    fn calls(&self) -> Vec<String> {
        std::fs::read_to_string(self.dir.join("calls.log")).unwrap_or_default().lines().map(str::to_string).collect()
    }

    fn motley(&self, args: &[&str]) -> (i32, String, String) {
        let out = Command::new(sibling("motley"))
            .args(args)
            .args(["--coordinator", &format!("http://{}", self.coordinator.addr)])
            .env_remove("MOTLEY_TOKEN")
            .env_remove("MOTLEY_OUTPUT")
            .current_dir(&self.dir)
            .output()
            .expect("motley is built by `cargo nextest run --workspace`");
        (
            out.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }
}

const MODEL: &str = "{name: tiny, layers: 4, hidden: 64, heads: 4, seq_len: 32, vocab: 128}";

fn job(name: &str, micro_batch: u32, mode: &str, nodes: &str) -> String {
    format!(
        "name: {name}\nmodel: {MODEL}\nglobal_batch: 8\nresources: {{gpus: 2, nodes: [{nodes}]}}\nrun: 'true'\n\
         plan_options: {{tp: 1, micro_batch: {micro_batch}, max_stages: 1}}\nprofiling: {{mode: {mode}}}\n"
    )
}

fn profiles_flow(s: &System) {
    // Planned from profiles only: measured first (on node-0, the agent with --python), then
    // planned with the measured 40 + 90 ms per layer. A micro-batch of 2 is 2 sequences per
    // GPU, or 1 where a stage's two GPUs split it: both are measured, one run at a time.
    let id = s.submit(&job("only", 2, "only", "node-0"));
    let j = s.ended(id);
    assert_eq!(j["state"], "succeeded", "{j}");
    let events = s.events(id);
    assert!(
        events.iter().any(|(k, m)| k == "profiling" && m.contains("A100-80G tp 1 micro-batch 2") && m.contains("node-0")),
        "{events:?}"
    );
    assert!(events.iter().any(|(k, m)| k == "waiting" && m.contains("layer profile")), "{events:?}");
    let calls = s.calls();
    assert_eq!(calls.len(), 2, "{calls:?}");
    assert!(calls.iter().all(|c| c.contains("-m motley_torch.profile") && c.contains("--gpu A100-80G --dtype fp32")), "{calls:?}");
    assert!(calls.iter().any(|c| c.contains("--tp 1 --micro-batch 2 --seq-len 32")), "{calls:?}");
    assert!(calls.iter().any(|c| c.contains("--tp 1 --micro-batch 1 --seq-len 32")), "{calls:?}");
    assert!(calls.iter().all(|c| c.ends_with("CUDA_VISIBLE_DEVICES=0")), "{calls:?}");
    let profiles = s.get("/api/v1/profiles");
    assert_eq!(profiles.as_array().unwrap().len(), 2, "{profiles}");
    let p = profiles.as_array().unwrap().iter().find(|p| p["micro_batch"] == 2).unwrap();
    assert_eq!(
        (p["gpu"].as_str(), p["tp"].as_i64(), p["micro_batch"].as_i64(), p["seq_len"].as_i64()),
        (Some("A100-80G"), Some(1), Some(2), Some(32))
    );
    assert_eq!(
        (p["node"].as_str(), p["torch"].as_str(), p["entry"]["fwd_ms"].as_f64()),
        (Some("node-0"), Some("2.15.0-standin"), Some(40.0))
    );
    // The plan prices the stages from them: 4 layers x (40 + 90) ms per micro-batch, 0.52 s
    // at least (a 4-layer model of hidden 64 is microseconds on the roofline).
    let plan = s.get(&format!("/api/v1/jobs/{id}/plan"));
    let t = plan["plan"]["iteration_time_s"].as_f64().unwrap_or_else(|| plan["iteration_time_s"].as_f64().unwrap());
    assert!(t > 0.5, "iteration {t} s is not priced from the profile: {plan}");

    // The same model again: the stored profile is used, nothing measured.
    let id = s.submit(&job("again", 2, "only", "node-0"));
    assert_eq!(s.ended(id)["state"], "succeeded");
    assert_eq!(s.calls().len(), 2, "a stored profile is not measured again");

    // A run that fails: an `only` job fails with the profiler's words...
    let id = s.submit(&job("oom", 4, "only", "node-0"));
    let j = s.ended(id);
    assert_eq!(j["state"], "failed");
    let reason = j["reason"].as_str().unwrap();
    assert!(reason.contains("profiling.mode") && reason.contains("CUDA out of memory (stand-in)"), "{reason}");
    // ... and an `auto` job is planned on the roofline, and says so (the failure is remembered:
    // not measured again).
    let id = s.submit(&job("auto", 4, "auto", "node-0"));
    assert_eq!(s.ended(id)["state"], "succeeded");
    assert!(s.events(id).iter().any(|(k, m)| k == "profiling" && m.contains("priced by the roofline") && m.contains("out of memory")));
    assert_eq!(s.calls().len(), 3, "{:?}", s.calls());

    // A node whose agent cannot profile: named (profiles are per GPU type: those measured on
    // node-0 serve node-1 too, so ask for a micro-batch of 8 that nobody measured).
    let id = s.submit(&job("nowhere", 8, "only", "node-1"));
    let j = s.ended(id);
    assert!(j["reason"].as_str().unwrap().contains("can profile (start agents with --python)"), "{j}");

    // `motley profile ...`.
    let (code, out, err) = s.motley(&["profile", "list"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("A100-80G") && out.contains("tiny") && out.contains("40.000") && out.contains("node-0"), "{out}");
    let pid = profiles.as_array().unwrap()[0]["id"].as_i64().unwrap().to_string();
    let (code, out, _) = s.motley(&["profile", "show", &pid]);
    assert_eq!(code, 0);
    // A profiles file `motley plan --profiles` reads.
    let file = s.dir.join("shown.yaml");
    std::fs::write(&file, &out).unwrap();
    let set: motley_solver::ProfileSet = serde_norway::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"));
    assert_eq!(set.profiles[0].fwd_ms, 40.0);
    let model = s.dir.join("tiny.yaml");
    std::fs::write(&model, MODEL).unwrap();
    let (code, out, err) =
        s.motley(&["profile", "run", "--model", model.to_str().unwrap(), "--tp", "2", "--micro-batch", "1", "--wait", "-o", "json"]);
    assert_eq!(code, 0, "{out}{err}");
    let run: Value = serde_json::from_str(&out).unwrap();
    assert_eq!((run["state"].as_str(), run["node"].as_str()), (Some("stored"), Some("node-0")), "{run}");
    assert!(s.calls().last().unwrap().ends_with("CUDA_VISIBLE_DEVICES=0,1"), "{:?}", s.calls());
    let (code, _, err) = s.motley(&["profile", "run", "--model", model.to_str().unwrap(), "--tp", "1", "--micro-batch", "4", "--wait"]);
    assert_eq!(code, 1, "a failed run is exit 1: {err}");
    let (code, _, err) = s.motley(&["profile", "run", "--model", "tiny-nope", "--tp", "1", "--micro-batch", "1"]);
    assert_eq!(code, 2);
    assert!(err.contains("model") && err.contains("unknown model 'tiny-nope'"), "{err}");
    let (code, _, err) = s.motley(&["profile", "run", "--model", "gpt3-1.3b", "--tp", "1", "--micro-batch", "1", "--node", "node-1"]);
    assert_eq!(code, 2);
    assert!(err.contains("no node node-1 has a live agent that can profile"), "{err}");
    let (code, out, _) = s.motley(&["profile", "runs"]);
    assert_eq!(code, 0);
    assert!(out.contains("stored as profile") && out.contains("failed: the profiler exited"), "{out}");
}

#[test]
fn jobs_plan_from_profiles_agents_measure_sqlite() {
    let s = start(None);
    profiles_flow(&s);
}

#[test]
fn jobs_plan_from_profiles_agents_measure_postgres() {
    let db = TestDb::create("motley_profiles");
    let s = start(Some(&db.url));
    profiles_flow(&s);
}
