//! The dashboard in a real browser: Debian's headless `chromium`, driven through
//! `chromedriver`'s W3C WebDriver HTTP API (a small client below), against a real coordinator
//! (with a token) and two agents: a wrong token is refused; the nodes appear with their load; a
//! job submitted from the CLI shows up and moves to succeeded with its events; the plan picture
//! has one block per stage; the training curves draw rank 0's loss lines; a rank's log tail
//! shows its output; drain from the page reaches the agent; cancel from the page cancels; a
//! standby sends the page to the leader; the network page draws the link matrix. Screenshots of each page land in
//! `CARGO_TARGET_TMPDIR/dashboard-screenshots/` (docs/screenshots/ holds a copy of each).
//!
//! Needs `chromium` and `chromium-driver` (`apt-get install -y chromium chromium-driver`;
//! `.ci/run` installs them): without them this test fails saying so.

use crate::common;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use common::{repo, Agent, Coordinator, Proc};
use serde_json::{json, Value};

/// [`common::until`], every 100 ms (each try is a WebDriver round trip).
fn until<T>(what: &str, f: impl FnMut() -> Option<T>) -> T {
    common::until_every(what, Duration::from_millis(100), f)
}

/// chromedriver and one browser session; both end when this is dropped.
struct Browser {
    _driver: Proc,
    base: String,
    session: String,
    http: ureq::Agent,
    shots: PathBuf,
}

fn missing(what: &str) -> ! {
    panic!(
        "{what} is missing: the dashboard's browser tests need Debian's chromium and chromedriver; install them with \
         `apt-get update && apt-get install -y chromium chromium-driver` (.ci/run does)"
    )
}

/// The W3C name of an element reference in WebDriver answers.
const ELEMENT: &str = "element-6066-11e4-a52e-4f735466cecf";

impl Browser {
    fn start(profile: &Path) -> Browser {
        if Command::new("chromium").arg("--version").stdout(Stdio::null()).stderr(Stdio::null()).status().is_err() {
            missing("chromium");
        }
        let port = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().port()
        };
        let mut child = Command::new("chromedriver")
            .arg(format!("--port={port}"))
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|_| missing("chromedriver"));
        let out = child.stdout.take().unwrap();
        // Drain its output so it never blocks on a full pipe.
        std::thread::spawn(move || for _ in BufReader::new(out).lines() {});
        let driver = Proc(child);
        let http: ureq::Agent =
            ureq::Agent::config_builder().http_status_as_error(false).timeout_global(Some(Duration::from_secs(60))).build().into();
        let base = format!("http://127.0.0.1:{port}");
        until("chromedriver answers", || {
            let mut r = http.get(&format!("{base}/status")).call().ok()?;
            let v: Value = serde_json::from_str(&r.body_mut().read_to_string().ok()?).ok()?;
            v["value"]["ready"].as_bool().filter(|r| *r)
        });
        let args = [
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--disable-dev-shm-usage",
            "--window-size=1280,1000",
        ];
        let mut args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
        args.push(format!("--user-data-dir={}", profile.display()));
        let caps = json!({"capabilities": {"alwaysMatch": {"browserName": "chrome",
            "goog:chromeOptions": {"binary": "/usr/bin/chromium", "args": args}}}});
        let v = send(&http, "POST", &format!("{base}/session"), Some(&caps));
        let session = v["sessionId"].as_str().unwrap_or_else(|| panic!("no browser session: {v}")).to_string();
        let shots = Path::new(env!("CARGO_TARGET_TMPDIR")).join("dashboard-screenshots");
        std::fs::create_dir_all(&shots).unwrap();
        Browser { _driver: driver, base, session, http, shots }
    }

    fn call(&self, method: &str, path: &str, body: Option<&Value>) -> Value {
        send(&self.http, method, &format!("{}/session/{}{path}", self.base, self.session), body)
    }

    fn go(&self, url: &str) {
        self.call("POST", "/url", Some(&json!({ "url": url })));
    }

    /// Run `script` (a function body) in the page; its return value.
    fn js(&self, script: &str) -> Value {
        self.call("POST", "/execute/sync", Some(&json!({"script": script, "args": []})))
    }

    fn find(&self, css: &str) -> String {
        until(&format!("an element {css}"), || {
            let v = self.call("POST", "/element", Some(&json!({"using": "css selector", "value": css})));
            v[ELEMENT].as_str().map(str::to_string)
        })
    }

    /// Click `css` (found again if the page redrew it between finding and clicking).
    fn click(&self, css: &str) {
        until(&format!("a click on {css}"), || {
            let e = self.find(css);
            let url = format!("{}/session/{}/element/{e}/click", self.base, self.session);
            match try_send(&self.http, "POST", &url, Some(&json!({}))) {
                Ok(_) => Some(()),
                Err(e) if e.starts_with("stale element reference") => None,
                Err(e) => panic!("click on {css}: {e}"),
            }
        })
    }

    fn type_into(&self, css: &str, text: &str) {
        let e = self.find(css);
        self.call("POST", &format!("/element/{e}/clear"), Some(&json!({})));
        self.call("POST", &format!("/element/{e}/value"), Some(&json!({ "text": text })));
    }

    /// Wait until `script` returns something other than null/false; that value.
    fn wait(&self, what: &str, script: &str) -> Value {
        until(what, || Some(self.js(script)).filter(|v| !v.is_null() && *v != Value::Bool(false)))
    }

    fn screenshot(&self, name: &str) {
        let v = self.call("GET", "/screenshot", None);
        let png = base64(v.as_str().expect("a screenshot"));
        assert!(png.starts_with(b"\x89PNG"), "a PNG");
        let path = self.shots.join(format!("{name}.png"));
        std::fs::write(&path, png).unwrap();
        eprintln!("screenshot: {}", path.display());
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        let _ = self.http.delete(&format!("{}/session/{}", self.base, self.session)).call();
    }
}

/// One WebDriver command; its `value` (a WebDriver error fails the test with its message).
fn send(http: &ureq::Agent, method: &str, url: &str, body: Option<&Value>) -> Value {
    match try_send(http, method, url, body) {
        Ok(v) => v,
        // "no such element" is how `find` learns to wait; every other error is the test's.
        Err(e) if e.starts_with("no such element") => Value::Null,
        Err(e) => panic!("{method} {url}: {e}"),
    }
}

/// One WebDriver command: its `value`, or its error and message.
fn try_send(http: &ureq::Agent, method: &str, url: &str, body: Option<&Value>) -> Result<Value, String> {
    let res = match method {
        "GET" => http.get(url).call(),
        "DELETE" => http.delete(url).call(),
        _ => http.post(url).header("Content-Type", "application/json").send(body.map(Value::to_string).unwrap_or_default()),
    };
    let mut res = res.unwrap_or_else(|e| panic!("{method} {url}: {e}"));
    let text = res.body_mut().with_config().limit(64 << 20).read_to_string().unwrap();
    let v: Value = serde_json::from_str(&text).unwrap_or_else(|_| panic!("{method} {url}: not JSON: {text}"));
    match v["value"]["error"].as_str() {
        Some(e) => Err(format!("{e}: {}", v["value"]["message"])),
        None => Ok(v["value"].clone()),
    }
}

/// Standard base64 (WebDriver's screenshots).
fn base64(s: &str) -> Vec<u8> {
    let val = |c: u8| match c {
        b'A'..=b'Z' => c - b'A',
        b'a'..=b'z' => c - b'a' + 26,
        b'0'..=b'9' => c - b'0' + 52,
        b'+' => 62,
        b'/' => 63,
        _ => panic!("not base64: {c}"),
    } as u32;
    let bytes: Vec<u8> = s.bytes().filter(|c| !c.is_ascii_whitespace() && *c != b'=').collect();
    let mut out = Vec::with_capacity(bytes.len() * 3 / 4);
    for chunk in bytes.chunks(4) {
        let n = chunk.iter().enumerate().fold(0u32, |n, (i, c)| n | val(*c) << (18 - 6 * i));
        out.extend(&n.to_be_bytes()[1..chunk.len()]);
    }
    out
}

fn motley(c: &Coordinator, args: &[&str]) -> std::process::Output {
    Command::new(common::sibling("motley"))
        .args(args)
        .env("MOTLEY_COORDINATOR", format!("http://{}", c.addr))
        .env("MOTLEY_TOKEN", c.token.as_deref().unwrap())
        .env_remove("MOTLEY_OUTPUT")
        .current_dir(repo())
        .output()
        .expect("motley is built beside motley-coordinator by `cargo nextest run --workspace`")
}

#[test]
fn the_dashboard_shows_and_drives_the_cluster() {
    let dir = common::temp_dir();
    let port_base = common::master_port_base();
    let c = Coordinator::start(&dir, &["--heartbeat-ms", "500", "--master-port-base", &port_base]);
    let token = c.token.clone().expect("a generated token");
    let agent_token = c.agent_token.clone().unwrap_or_else(|| token.clone());
    let _agents: Vec<Proc> = (0..2)
        .map(|i| {
            Agent::new(&c.grpc_url(), &format!("node-{i}"), "examples/nodes/a100.yaml", &dir.join(format!("agent-{i}")))
                .arg("--allow-root-ranks")
                .args(["--token", &agent_token])
                .spawn()
        })
        .collect();
    let b = Browser::start(&dir.join("chromium-profile"));
    let url = format!("http://{}/", c.addr);

    // The page asks for the token; a wrong one is refused and nothing is shown.
    b.go(&url);
    b.wait("the token form", "return !document.getElementById('login').hidden");
    b.type_into("#token", "not-the-token");
    b.click("#login-submit");
    let refused = b.wait("the refusal", "return document.getElementById('login-error').textContent || null");
    assert!(refused.as_str().unwrap().contains("refused"), "{refused}");
    assert_eq!(b.js("return document.querySelectorAll('#view table').length"), 0);
    assert_eq!(b.js("return sessionStorage.getItem('motley.token')"), Value::Null, "a refused token is not kept");
    b.screenshot("login-refused");

    // The right one, entered with the keyboard (Enter submits), opens the nodes page.
    b.type_into("#token", &format!("{token}\u{E007}"));
    let live = "return [...document.querySelectorAll('#nodes tbody tr')].filter(r => r.textContent.includes('live') && /iB/.test(r.cells[6].textContent)).length === 2 || null";
    b.wait("both nodes live with their load", live);
    assert_eq!(b.js("return location.href.includes(sessionStorage.getItem('motley.token'))"), false, "the token is never in a URL");
    let row = b.js("return [...document.querySelector('#nodes tbody tr').cells].map(c => c.textContent)");
    assert!(row[3].as_str().unwrap().contains("8 × A100"), "{row}");
    assert!(row[7].as_str().unwrap().parse::<f64>().is_ok(), "load average: {row}");
    b.screenshot("nodes");

    // A job submitted from the CLI shows up and succeeds, with its events.
    let job = dir.join("job.yaml");
    write_planned_job(&dir, &job);
    let out = motley(&c, &["job", "submit", job.to_str().unwrap()]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    b.click("#nav-jobs");
    b.wait("job 1 listed", "return document.querySelector('#jobs tr[data-job=\"1\"]') !== null");
    b.wait("job 1 succeeded in the list", "return document.querySelector('#jobs tr[data-job=\"1\"]').textContent.includes('succeeded')");
    b.click("#job-link-1");
    b.wait("job 1's page says succeeded", "return document.getElementById('job-state')?.textContent === 'succeeded'");
    let kinds = b.wait(
        "the job's events",
        "const k = [...document.querySelectorAll('#events .kind')].map(e => e.textContent); return k.includes('succeeded') ? k : null",
    );
    assert!(kinds.as_array().unwrap().iter().any(|k| k == "running"), "{kinds}");
    // The plan picture: one block per stage of the stored plan.
    let plan = c.json("GET", "/api/v1/jobs/1/plan", "", 200);
    let stages: usize = plan["plan"]["replicas"].as_array().unwrap().iter().map(|r| r["stages"].as_array().unwrap().len()).sum();
    let blocks = b.wait("the plan picture", "return document.querySelectorAll('#plan svg g.stage').length || null");
    assert_eq!(blocks.as_u64(), Some(stages as u64));
    let ranks = b.wait("the ranks table", "const r = document.querySelectorAll('#ranks tbody tr[data-rank]'); return r.length || null");
    assert_eq!(ranks.as_u64(), Some(8));
    assert_eq!(stages, 4);
    let hops = b.js("return [...document.querySelectorAll('#plan svg g.hop')].map(g => g.dataset.transport)");
    assert_eq!(hops.as_array().unwrap().len(), 2, "the cross-node hops are marked: {hops}");
    let rank0 = b.js("return [...document.querySelector('#ranks tr[data-rank=\"0\"]').cells].map(c => c.textContent)");
    assert_eq!((rank0[6].as_str(), rank0[7].as_str()), (Some("exited"), Some("0")), "{rank0}");
    // A rank's log tail, fetched through the coordinator from its agent.
    b.click("#log-toggle-0");
    // Tall enough for the whole page in the screenshot.
    b.call("POST", "/window/rect", Some(&json!({"width": 1280, "height": 2700})));
    // The training curves: rank 0's loss line (3 steps) and its eval marker, drawn once the job ended.
    let points = b.wait("the training curves", "return document.querySelector('#curves svg polyline.loss')?.dataset.points || null");
    assert_eq!(points, "3");
    assert_eq!(b.js("return document.querySelectorAll('#curves svg circle.eval').length"), 1);
    assert_eq!(b.js("return document.querySelector('#curves svg polyline.tokens')?.dataset.points"), "3");
    b.wait("rank 0's log", "return document.getElementById('log-0')?.textContent.includes('hello from rank 0')");
    // The checkpoint-location bitmap: the step node-0 reported, where each file is.
    let cells = b.wait(
        "the checkpoint view",
        "const g = document.getElementById('ckpt-grid'); return g && !document.getElementById('checkpoints').hidden ? [...g.querySelectorAll('tbody tr')].map(r => r.textContent) : null",
    );
    assert_eq!(cells.as_array().unwrap().len(), 2, "{cells}");
    // Ranks write into the agent's memory tier, where the newest step stays (a copy goes to disk).
    assert!(cells[0].as_str().unwrap().contains("layer.0 model tp 0/1") && cells[0].as_str().unwrap().contains("memory"), "{cells}");
    let step = b.js("return document.querySelector('#ckpt-steps tr[data-step=\"2\"]').textContent");
    assert!(step.as_str().unwrap().contains("no: "), "one unit of 24 layers is not restorable: {step}");
    b.screenshot("job");

    b.call("POST", "/window/rect", Some(&json!({"width": 1280, "height": 1000})));

    cancel_from_the_page(&b, &c, &dir, &job, &url);

    drain_from_the_page(&b, &c, &dir);

    // The picture the page shows is the API's contract: GET /api/v1/jobs/1/plan.svg.
    let (status, svg) = c.call("GET", "/api/v1/jobs/1/plan.svg", "");
    assert_eq!(status, 200);
    assert_eq!(svg.matches("<g class=\"stage\"").count(), stages);
    assert_eq!(c.call_as(Some("wrong"), "GET", "/api/v1/jobs/1/plan.svg", "").0, 401);

    other_coordinators_serve_the_page(&b, &c, &dir, &token);
}

/// The network page draws the link matrix: a cell per measured pair of nodes (both ways) with
/// its GB/s, coloured by its ratio to the declared rate (the ratio also written out), the
/// latency and samples in its tooltip; an unmeasured pair says so. Stand-in agents (gRPC)
/// report the samples, so no probe has to run.
#[test]
fn the_network_page_draws_the_link_matrix() {
    use motley_proto::v1::agent_client::AgentClient;
    use motley_proto::v1::{AgentStatus, LinkSample, RegisterRequest};
    let dir = common::temp_dir();
    let c = Coordinator::start(&dir, &["--heartbeat-ms", "1000"]);
    let token = c.token.clone().expect("a generated token");
    let agent_token = c.agent_token.clone().unwrap_or_else(|| token.clone());
    let rt = tokio::runtime::Runtime::new().unwrap();
    let ib = r#"{"gpu": "A100-80G", "gpus": 1, "nics": [{"name": "mlx5_0", "kind": "ib", "gbps": 200}], "rdma_domain": "lab"}"#;
    let grpc = c.grpc_url();
    // Kept until the test ends: the reporting session's stream.
    let (_stream, _answers) = rt.block_on(async {
        let mut agents = AgentClient::connect(grpc).await.unwrap();
        let mut epoch = 0;
        for node in ["n0", "n1", "n2"] {
            let register =
                RegisterRequest { node: node.into(), inventory_json: ib.into(), token: agent_token.clone(), ..Default::default() };
            epoch = agents.register(register).await.unwrap().into_inner().epoch;
        }
        let at_unix_ms = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as i64;
        let sample = |peer: &str, nic_kind: &str, gb_per_s: f64| LinkSample {
            peer: peer.into(),
            nic_kind: nic_kind.into(),
            gb_per_s,
            latency_ms: 0.25,
            at_unix_ms,
        };
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        let links = vec![sample("n0", "eth", 1.25), sample("n0", "ib", 20.0)];
        tx.send(AgentStatus { node: "n2".into(), epoch, seq: 1, full: true, links, ..Default::default() }).await.unwrap();
        let mut request = tonic::Request::new(tokio_stream::wrappers::ReceiverStream::new(rx));
        request.metadata_mut().insert("authorization", format!("Bearer {agent_token}").parse().unwrap());
        let answers = agents.heartbeat(request).await.unwrap().into_inner();
        (tx, answers)
    });
    until("the links in the matrix", || (c.json("GET", "/api/v1/net", "", 200)["links"].as_array()?.len() == 2).then_some(()));

    let b = Browser::start(&dir.join("chromium-profile"));
    b.go(&format!("http://{}/#/net", c.addr));
    b.wait("the token form", "return !document.getElementById('login').hidden");
    b.type_into("#token", &format!("{token}\u{E007}"));
    let cells = b.wait("the matrix's measured cells", "return document.querySelectorAll('#net-matrix td[data-gbps]').length || null");
    // n0-n2, both ways; the pair's slowest kind (Ethernet) is the cell's.
    assert_eq!(cells, 2);
    let cell = b.js("const td = document.querySelector('#net-matrix td[data-a=\"n0\"][data-b=\"n2\"]'); \
         return td && {text: td.textContent, class: td.className, title: td.title}");
    assert!(cell["text"].as_str().unwrap().starts_with("1.25 GB/s"), "{cell}");
    assert!(cell["text"].as_str().unwrap().contains("×0.06 of declared"), "the ratio is written out: {cell}");
    assert!(cell["class"].as_str().unwrap().contains("r-poor"), "{cell}");
    let title = cell["title"].as_str().unwrap();
    assert!(title.contains("eth: 1.25 GB/s (declared 21.25), latency 0.250 ms, 1 samples"), "{title}");
    assert!(title.contains("ib: 20.00 GB/s"), "every kind in the tooltip: {title}");
    let mirror = b.js("return document.querySelector('#net-matrix td[data-a=\"n2\"][data-b=\"n0\"]')?.dataset.gbps");
    assert_eq!(mirror, "1.25");
    let unmeasured = b.js("return [...document.querySelectorAll('#net-matrix tr[data-node=\"n0\"] td')].map(td => td.textContent)");
    assert_eq!(unmeasured[1], "—", "n0-n1 was not measured: {unmeasured}");
    assert_eq!(b.js("return document.getElementById('nav-net').getAttribute('aria-current')"), "page");
    b.screenshot("network");
}

/// Drain from the page reaches the agent (it marks its work directory). Escape in the
/// confirmation (keyboard) drains nothing.
fn drain_from_the_page(b: &Browser, c: &Coordinator, dir: &Path) {
    b.click("#nav-nodes");
    b.click("#nodes tr[data-node=\"node-0\"] button");
    b.wait("the confirmation", "return document.getElementById('confirm').open");
    let no = b.find("#confirm-no");
    b.call("POST", &format!("/element/{no}/value"), Some(&json!({"text": "\u{E00C}"})));
    b.wait("the confirmation closed", "return !document.getElementById('confirm').open");
    assert_eq!(c.json("GET", "/api/v1/nodes/node-0", "", 200)["state"], "active", "Escape cancels");
    b.click("#nodes tr[data-node=\"node-1\"] button");
    b.wait("the confirmation", "return document.getElementById('confirm').open");
    b.click("#confirm-yes");
    let flag = dir.join("agent-1/draining");
    until("node-1's agent marks itself draining", || flag.exists().then_some(()));
    b.wait("node-1 shown draining", "return document.querySelector('#nodes tr[data-node=\"node-1\"]').textContent.includes('draining')");
    b.screenshot("nodes-draining");
    b.click("#nodes tr[data-node=\"node-1\"] button");
    b.click("#confirm-yes");
    until("node-1's agent clears the mark", || (!flag.exists()).then_some(()));
}

/// An --insecure coordinator's page asks for no token, like its API; a standby serves the page
/// and sends it on to the leader.
fn other_coordinators_serve_the_page(b: &Browser, c: &Coordinator, dir: &Path, token: &str) {
    // An --insecure coordinator's page asks for no token, like its API.
    let open_dir = common::temp_dir();
    let open = Coordinator::start(&open_dir, &["--insecure"]);
    b.go(&format!("http://{}/#/nodes", open.addr));
    b.wait(
        "the nodes page without a token",
        "return document.getElementById('login').hidden && document.querySelector('#nodes p, #nodes table') !== null",
    );

    // A standby serves the page and sends it on to the leader.
    let standby = Coordinator::start(dir, &["--heartbeat-ms", "500"]);
    b.go(&format!("http://{}/#/jobs", standby.addr));
    b.type_into("#token", &format!("{token}\u{E007}"));
    let leader = format!("http://{}", c.addr);
    b.wait("the page on the leader", &format!("return location.origin === '{leader}' && location.hash === '#/jobs'"));
}

/// The dashboard's job file: it carries its plan, two replicas, each a pipeline of two TP-2
/// stages across the nodes (a picture with hops worth looking at).
fn write_planned_job(dir: &Path, job: &Path) {
    let stage = |layers: &str, node: &str, a: u32| {
        format!(
            "{{layers: {layers}, gpu: A100-80G, tp: 2, dp: 1, gpus: [{{node: {node}, index: {a}}}, {{node: {node}, index: {}}}]}}",
            a + 1
        )
    };
    let replica = |a: u32| {
        format!("  - {{samples: 8, micro_batches: 4, stages: [{}, {}]}}\n", stage("[0, 10]", "node-0", a), stage("[10, 24]", "node-1", a))
    };
    // Rank 0 also leaves a checkpoint step in MOTLEY_CKPT_DIR, as motley_torch would (one unit
    // and its rank file, listed by its manifest piece), for the checkpoint view, and prints
    // training lines, for the curves.
    let fake_ckpt = dir.join("fake-ckpt.sh");
    std::fs::write(
        &fake_ckpt,
        r#"[ "$RANK" = 0 ] || exit 0
d="$MOTLEY_CKPT_DIR/step-00000002"; mkdir -p "$d"
printf 0123456789 > "$d/layer.00000.model.tp0-1.safetensors"; printf r > "$d/rank.00000.safetensors"
cat > "$d/manifest.rank.00000.json" <<EOF
{"format": "motley-checkpoint/1", "step": 2, "layers": 24, "world_size": 8,
 "units": [{"block": "layer.0", "part": "model", "tp_rank": 0, "tp_size": 1, "file": "layer.00000.model.tp0-1.safetensors",
            "bytes": 10, "chunk_bytes": 16777216, "crc32c": [0], "tensors": {}}],
 "ranks": [{"rank": 0, "file": "rank.00000.safetensors", "bytes": 1, "chunk_bytes": 16777216, "crc32c": [0]}]}
EOF
printf '%s\n' '{"step": 1, "loss": 2.5, "tokens_per_s": 900, "step_s": 0.5}' '{"step": 2, "eval_loss": 2.4}' \
  '{"step": 2, "loss": 2.25, "tokens_per_s": 950, "step_s": 0.45}' '{"step": 3, "loss": 2.0, "tokens_per_s": 1000, "step_s": 0.4}'
"#,
    )
    .unwrap();
    let text = format!(
        "name: dash\nmodel: gpt3-1.3b\nglobal_batch: 16\nrun: 'echo \"hello from rank $RANK\"; sh {}'\nplan:\n  global_batch: 16\n  micro_batch: 2\n  replicas:\n{}{}",
        fake_ckpt.display(),
        replica(0),
        replica(2)
    );
    std::fs::write(job, text).unwrap();
}

/// Cancel from the page, after a confirmation; on the way, a job that waits says why in the
/// list.
fn cancel_from_the_page(b: &Browser, c: &Coordinator, dir: &Path, job: &Path, url: &str) {
    std::fs::write(job, "name: long\nmodel: gpt3-1.3b\nglobal_batch: 16\nresources: {gpus: 2}\nrun: 'sleep 120'\n").unwrap();
    assert!(motley(c, &["job", "submit", job.to_str().unwrap()]).status.success());
    // A job that waits says why in the list (job 2 holds GPUs it needs).
    std::fs::write(dir.join("wide.yaml"), "name: wide\nmodel: gpt3-1.3b\nglobal_batch: 16\nresources: {gpus: 16}\nrun: 'true'\n").unwrap();
    assert!(motley(c, &["job", "submit", dir.join("wide.yaml").to_str().unwrap()]).status.success());
    b.go(&format!("{url}#/jobs"));
    let why = b.wait(
        "job 3's reason in the list",
        "const r = document.querySelector('#jobs tr[data-job=\"3\"]'); return r && /submitted|planning/.test(r.textContent) && r.querySelector('.reason').textContent || null",
    );
    let reason = c.json("GET", "/api/v1/jobs/3", "", 200)["reason"].clone();
    assert!(reason.is_null() || reason == why, "the page shows the job's reason: {why} / {reason}");
    b.screenshot("jobs");
    b.go(&format!("{url}#/jobs/2"));
    b.wait("job 2 running", "return document.getElementById('job-state')?.textContent === 'running'");
    b.click("#cancel");
    b.wait("the confirmation", "return document.getElementById('confirm').open");
    b.screenshot("confirm-cancel");
    b.click("#confirm-yes");
    b.wait("job 2 cancelled", "return document.getElementById('job-state')?.textContent === 'cancelled'");
}
