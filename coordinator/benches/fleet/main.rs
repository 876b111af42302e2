//! The running system under a simulated fleet: many agents in this one process talk real gRPC
//! over loopback to a real `motley-coordinator` child process. It measures
//!
//! * the coordinator's CPU (utime+stime from /proc/PID/stat over a steady window) and RSS while
//!   N agents heartbeat on the default 1 s interval, after they all registered;
//! * the launch of an R-rank job on that fleet (8 GPUs a node): submit over REST -> planning ->
//!   launching (plan and rank assignments stored) -> Launch instructions out -> every agent
//!   reports its ranks `running` at once (as `motley-agent` does) -> the job is `running`; phases from the
//!   job's events (`at_ms`) and this process's clock (the same machine's wall clock).
//!
//! on SQLite (a file in a temporary directory) and on PostgreSQL (a fresh database per fleet,
//! `motley_bench_<pid>_<n>`, dropped at the end even on error). It prints tables on stdout and
//! writes nothing else; it exits non-zero if an agent is refused or loses its stream, or a job
//! does not reach `running`.
//!
//! ```sh
//! cargo build --release -p motley-coordinator
//! cp target/release/motley-coordinator /tmp/motley-coordinator-bench
//! MOTLEY_COORDINATOR_BIN=/tmp/motley-coordinator-bench cargo bench -p motley-coordinator --bench fleet
//! cargo bench -p motley-coordinator --bench fleet -- --quick
//! cargo bench -p motley-coordinator --bench fleet -- --agents 250,2000 --ranks 1024 --window 20 --db sqlite,postgres
//! ```
//!
//! Flags (or environment variables): `--coordinator PATH` (`MOTLEY_COORDINATOR_BIN`, default
//! `target/release/motley-coordinator`), `--agents LIST` (`MOTLEY_FLEET_AGENTS`, default
//! 250,500,1000,2000), `--ranks LIST` (`MOTLEY_FLEET_RANKS`, default 128,256,512,1024; a size
//! larger than the fleet's GPUs is skipped), `--window S` (`MOTLEY_FLEET_WINDOW`, default 20),
//! `--db LIST` (`MOTLEY_FLEET_DB`, sqlite,postgres), `--postgres URL` (`MOTLEY_TEST_POSTGRES`,
//! default postgres://postgres@127.0.0.1:5432/postgres, the admin database), `--channels K`
//! (`MOTLEY_FLEET_CHANNELS`, default 0: one HTTP/2 connection per agent, as real agents have;
//! K > 0 multiplexes the agents over K shared connections), `--quick` (128 agents, 128 and 1024
//! ranks, a 5 s window). Agents heartbeat on phases spread uniformly over the interval (a
//! fleet whose agents started at random times); `--burst` (`MOTLEY_FLEET_BURST=1`) puts them
//! all on the same instant, the worst case (every agent reconnecting at once).

// `..Default::default()` on protobuf messages: fields others add to the contract keep their defaults.
#![allow(clippy::needless_update)]

use std::process::Stdio;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use serde_json::Value;
use sqlx::Connection;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::task::JoinSet;
use tonic::transport::{Channel, Endpoint};

mod agents;
use agents::{agent, now_ms, Shared, INVENTORY};

const GPUS_PER_NODE: usize = 8;

struct Config {
    coordinator: String,
    agents: Vec<usize>,
    ranks: Vec<usize>,
    window: u64,
    dbs: Vec<String>,
    postgres: String,
    channels: usize,
    burst: bool,
}

fn list(s: &str) -> Result<Vec<usize>> {
    s.split(',').filter(|x| !x.trim().is_empty()).map(|x| x.trim().parse().with_context(|| format!("'{x}' is not a number"))).collect()
}

fn config() -> Result<Config> {
    let env = |k: &str| std::env::var(k).ok();
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("workspace root").to_path_buf();
    let target = env("CARGO_TARGET_DIR").map(std::path::PathBuf::from).unwrap_or_else(|| root.join("target"));
    let mut c = Config {
        coordinator: env("MOTLEY_COORDINATOR_BIN").unwrap_or_else(|| target.join("release/motley-coordinator").display().to_string()),
        agents: list(&env("MOTLEY_FLEET_AGENTS").unwrap_or_else(|| "250,500,1000,2000".into()))?,
        ranks: list(&env("MOTLEY_FLEET_RANKS").unwrap_or_else(|| "128,256,512,1024".into()))?,
        window: env("MOTLEY_FLEET_WINDOW").map_or(Ok(20), |w| w.parse()).context("MOTLEY_FLEET_WINDOW")?,
        dbs: env("MOTLEY_FLEET_DB").unwrap_or_else(|| "sqlite,postgres".into()).split(',').map(|s| s.trim().to_string()).collect(),
        postgres: env("MOTLEY_TEST_POSTGRES").unwrap_or_else(|| "postgres://postgres@127.0.0.1:5432/postgres".into()),
        channels: env("MOTLEY_FLEET_CHANNELS").map_or(Ok(0), |w| w.parse()).context("MOTLEY_FLEET_CHANNELS")?,
        burst: env("MOTLEY_FLEET_BURST").is_some_and(|v| v == "1"),
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = || args.next().ok_or_else(|| anyhow!("{a} needs a value"));
        match a.as_str() {
            // `cargo bench` passes --bench to a harness-less bench.
            "--bench" => {}
            "--quick" => {
                c.agents = vec![128];
                c.ranks = vec![128, 1024];
                c.window = 5;
            }
            "--coordinator" => c.coordinator = value()?,
            "--agents" => c.agents = list(&value()?)?,
            "--ranks" => c.ranks = list(&value()?)?,
            "--window" => c.window = value()?.parse()?,
            "--db" => c.dbs = value()?.split(',').map(|s| s.trim().to_string()).collect(),
            "--postgres" => c.postgres = value()?,
            "--channels" => c.channels = value()?.parse()?,
            "--burst" => c.burst = true,
            other => bail!("unknown argument '{other}' (see the comment at the top of coordinator/benches/fleet.rs)"),
        }
    }
    for db in &c.dbs {
        if db != "sqlite" && db != "postgres" {
            bail!("--db: '{db}' is neither sqlite nor postgres");
        }
    }
    if !std::path::Path::new(&c.coordinator).is_file() {
        bail!(
            "no coordinator binary at {}: run `cargo build --release -p motley-coordinator` first, or pass --coordinator PATH",
            c.coordinator
        );
    }
    Ok(c)
}

// ---- the coordinator process ----

struct Coordinator {
    _child: tokio::process::Child,
    pid: u32,
    rest: String,
    grpc: String,
}

async fn start_coordinator(bin: &str, dir: &std::path::Path, db_url: Option<&str>) -> Result<Coordinator> {
    let mut cmd = tokio::process::Command::new(bin);
    cmd.args(["--insecure", "--listen", "127.0.0.1:0", "--grpc-listen", "127.0.0.1:0", "--data-dir"]).arg(dir);
    if let Some(url) = db_url {
        cmd.args(["--database-url", url]);
    }
    let mut child =
        cmd.stdout(Stdio::piped()).stderr(Stdio::inherit()).kill_on_drop(true).spawn().with_context(|| format!("starting {bin}"))?;
    let pid = child.id().context("coordinator pid")?;
    let mut out = BufReader::new(child.stdout.take().context("stdout")?).lines();
    // "motley-coordinator listening on http://ADDR", "motley-coordinator agents on http://ADDR".
    let (mut rest, mut grpc) = (None, None);
    while rest.is_none() || grpc.is_none() {
        let line = out.next_line().await?.context("the coordinator exited before printing its addresses")?;
        let addr = line.rsplit("http://").next().unwrap_or_default().trim().to_string();
        if line.contains(" listening on http://") {
            rest = Some(addr);
        } else if line.contains(" agents on http://") {
            grpc = Some(addr);
        }
    }
    let (rest, grpc) = (rest.unwrap_or_default(), grpc.unwrap_or_default());
    // Keep reading so the pipe never fills.
    tokio::spawn(async move { while let Ok(Some(_)) = out.next_line().await {} });
    Ok(Coordinator { _child: child, pid, rest, grpc })
}

/// utime + stime of a process, in seconds.
fn cpu_s(pid: u32) -> Result<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    let after = stat.rsplit_once(')').context("/proc/PID/stat")?.1;
    let f: Vec<&str> = after.split_whitespace().collect();
    // Fields 14 and 15 of proc(5); `after` starts at field 3.
    let ticks: f64 = f[11].parse::<f64>()? + f[12].parse::<f64>()?;
    Ok(ticks / clock_ticks())
}

fn clock_ticks() -> f64 {
    static TICKS: std::sync::OnceLock<f64> = std::sync::OnceLock::new();
    *TICKS.get_or_init(|| {
        std::process::Command::new("getconf")
            .arg("CLK_TCK")
            .output()
            .ok()
            .and_then(|o| String::from_utf8_lossy(&o.stdout).trim().parse().ok())
            .unwrap_or(100.0)
    })
}

/// (VmRSS, VmHWM) in MiB.
fn rss_mib(pid: u32) -> Result<(f64, f64)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let field = |name: &str| -> f64 {
        status
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
            / 1024.0
    };
    Ok((field("VmRSS:"), field("VmHWM:")))
}

// ---- REST ----

async fn http(addr: &str, method: &str, path: &str, body: &str) -> Result<Value> {
    let mut s = tokio::net::TcpStream::connect(addr).await.with_context(|| format!("REST {addr}"))?;
    let req = format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}", body.len());
    s.write_all(req.as_bytes()).await?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).await?;
    let raw = String::from_utf8_lossy(&raw);
    let (head, body) = raw.split_once("\r\n\r\n").with_context(|| format!("{method} {path}: no HTTP response"))?;
    let status: u16 = head.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    if !(200..300).contains(&status) {
        bail!("{method} {path}: HTTP {status}: {body}");
    }
    serde_json::from_str(body).with_context(|| format!("{method} {path}: {body}"))
}

async fn live_nodes(rest: &str) -> Result<usize> {
    let nodes = http(rest, "GET", "/api/v1/nodes", "").await?;
    Ok(nodes.as_array().context("node list")?.iter().filter(|n| n["live"] == true).count())
}

/// Every event of a job (the endpoint pages by 1000).
async fn events(rest: &str, job: i64) -> Result<Vec<Value>> {
    let mut all: Vec<Value> = vec![];
    loop {
        let after = all.last().and_then(|e| e["seq"].as_i64()).unwrap_or(0);
        let page = http(rest, "GET", &format!("/api/v1/jobs/{job}/events?after={after}"), "").await?;
        let page = page.as_array().context("events")?.clone();
        if page.is_empty() {
            return Ok(all);
        }
        all.extend(page);
    }
}

// ---- one fleet ----

struct CpuRow {
    db: String,
    agents: usize,
    register_s: f64,
    cpu_pct: f64,
    beats_per_s: f64,
    rss_mib: f64,
    hwm_mib: f64,
    bench_cpu_pct: f64,
}

struct LaunchRow {
    db: String,
    agents: usize,
    asked: usize,
    ranks: usize,
    nodes: usize,
    /// submit (this clock) -> the `planning` event: the job queue picks the job up and the
    /// solver plans it on the live inventory (a job moves to `planning` once it has a plan)
    to_planning: f64,
    /// `planning` -> `launching` events: the launch's transaction
    planning_to_launching: f64,
    /// `launching` event -> the last agent got its Launch
    dispatch: f64,
    /// the last Launch got -> the last agent sent its ranks running
    report_wait: f64,
    /// the last report sent -> the `running` event
    reports_to_running: f64,
    /// submit -> `running`
    total: f64,
    /// cancel -> every rank stored exited
    stop_s: f64,
}

struct Pg {
    admin: String,
    db: String,
}

impl Pg {
    async fn create(admin: &str, n: usize) -> Result<Pg> {
        // Only digits and underscores after a fixed prefix: safe to splice into DDL.
        let db = format!("motley_bench_{}_{n}", std::process::id());
        let mut c = sqlx::PgConnection::connect(admin).await.with_context(|| format!("PostgreSQL at {admin}"))?;
        sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {db}"))).execute(&mut c).await?;
        Ok(Pg { admin: admin.to_string(), db })
    }

    fn url(&self) -> String {
        let base = self.admin.rsplit_once('/').map_or(self.admin.as_str(), |(b, _)| b);
        format!("{base}/{}", self.db)
    }

    async fn drop_db(&self) -> Result<()> {
        let mut c = sqlx::PgConnection::connect(&self.admin).await?;
        sqlx::query(sqlx::AssertSqlSafe(format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", self.db))).execute(&mut c).await?;
        Ok(())
    }
}

async fn fleet(cfg: &Config, db: &str, n: usize, run: usize, cpu: &mut Vec<CpuRow>, launches: &mut Vec<LaunchRow>) -> Result<()> {
    let dir = std::env::temp_dir().join(format!("motley-fleet-bench-{}-{run}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let pg = if db == "postgres" { Some(Pg::create(&cfg.postgres, run).await?) } else { None };
    let result = async {
        let coord = start_coordinator(&cfg.coordinator, &dir, pg.as_ref().map(|p| p.url()).as_deref()).await?;
        let r = fleet_on(cfg, db, n, &coord, cpu, launches).await;
        drop(coord);
        r
    }
    .await;
    // Give the killed coordinator's connections a moment, then drop everything it had.
    tokio::time::sleep(Duration::from_millis(200)).await;
    if let Some(pg) = &pg {
        if let Err(e) = pg.drop_db().await {
            eprintln!("fleet bench: dropping database {}: {e:#}", pg.db);
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    result
}

async fn fleet_on(
    cfg: &Config,
    db: &str,
    n: usize,
    coord: &Coordinator,
    cpu: &mut Vec<CpuRow>,
    launches: &mut Vec<LaunchRow>,
) -> Result<()> {
    let shared = Arc::new(Shared { burst: cfg.burst, ..Shared::default() });
    let url = format!("http://{}", coord.grpc);
    let endpoint = Endpoint::from_shared(url.clone())?.tcp_nodelay(true);
    let shared_channels: Vec<Channel> =
        if cfg.channels > 0 { (0..cfg.channels).map(|_| endpoint.connect_lazy()).collect() } else { vec![] };
    let gate = Arc::new(tokio::sync::Semaphore::new(32));
    let started = Instant::now();
    let mut set = JoinSet::new();
    for i in 0..n {
        let channel = if cfg.channels > 0 {
            shared_channels[i % cfg.channels].clone()
        } else {
            // One connection per agent, as real agents have; connected under the gate.
            let _p = gate.acquire().await?;
            endpoint.connect().await.with_context(|| format!("connecting agent {i} to {url}"))?
        };
        set.spawn(agent(i, channel, shared.clone(), gate.clone()));
    }
    // Every agent registered and its stream open, and the coordinator sees them all live.
    loop {
        shared.check()?;
        if shared.registered.load(Ordering::Relaxed) as usize == n && live_nodes(&coord.rest).await? == n {
            break;
        }
        if started.elapsed() > Duration::from_secs(300) {
            bail!("{} of {n} agents registered after 300 s", shared.registered.load(Ordering::Relaxed));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let register_s = started.elapsed().as_secs_f64();
    // Settle (registration's work done, every agent on its own heartbeat phase), then measure.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let (c0, b0, h0, t0) = (cpu_s(coord.pid)?, cpu_s(std::process::id())?, shared.heartbeats.load(Ordering::Relaxed), Instant::now());
    tokio::time::sleep(Duration::from_secs(cfg.window)).await;
    let (c1, b1, h1, wall) =
        (cpu_s(coord.pid)?, cpu_s(std::process::id())?, shared.heartbeats.load(Ordering::Relaxed), t0.elapsed().as_secs_f64());
    let (rss, hwm) = rss_mib(coord.pid)?;
    shared.check()?;
    let live = live_nodes(&coord.rest).await?;
    if live != n {
        bail!("{live} of {n} nodes live after the window: a lease was lost");
    }
    let row = CpuRow {
        db: db.into(),
        agents: n,
        register_s,
        cpu_pct: 100.0 * (c1 - c0) / wall,
        beats_per_s: (h1 - h0) as f64 / wall,
        rss_mib: rss,
        hwm_mib: hwm,
        bench_cpu_pct: 100.0 * (b1 - b0) / wall,
    };
    println!(
        "  {db} {n} agents: registered in {register_s:.1} s; coordinator {:.1}% of a core, {:.0} heartbeats/s, RSS {rss:.0} MiB; bench {:.1}%",
        row.cpu_pct, row.beats_per_s, row.bench_cpu_pct
    );
    cpu.push(row);

    for &r in cfg.ranks.iter().filter(|&&r| r <= n * GPUS_PER_NODE) {
        let row = launch(coord, &shared, db, n, r).await?;
        println!(
            "  {db} {n} agents, {r} GPUs: {} ranks on {} nodes running {:.0} ms after submit (planning->launching (store) {:.0} ms, dispatch {:.0} ms, ranks reported {:.0} ms later, reports->running {:.0} ms)",
            row.ranks, row.nodes, row.total, row.planning_to_launching, row.dispatch, row.report_wait, row.reports_to_running
        );
        launches.push(row);
    }
    shared.check()?;
    shared.stopping.store(true, Ordering::Relaxed);
    set.shutdown().await;
    Ok(())
}

async fn launch(coord: &Coordinator, shared: &Shared, db: &str, n: usize, gpus: usize) -> Result<LaunchRow> {
    let job = format!("name: fleet-{gpus}\nmodel: gpt3-1.3b\nglobal_batch: {}\nresources: {{gpus: {gpus}}}\nrun: 'true'\n", gpus.max(32));
    let t_submit = now_ms();
    let id = http(&coord.rest, "POST", "/api/v1/jobs", &job).await?["id"].as_i64().context("job id")?;
    let started = Instant::now();
    loop {
        let j = http(&coord.rest, "GET", &format!("/api/v1/jobs/{id}"), "").await?;
        match j["state"].as_str().unwrap_or_default() {
            "running" => break,
            "failed" | "cancelled" | "succeeded" => bail!("job {id} ({gpus} GPUs) did not reach running: {j}"),
            _ => {}
        }
        shared.check()?;
        if started.elapsed() > Duration::from_secs(120) {
            bail!("job {id} ({gpus} GPUs) not running after 120 s: {j}");
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let ev = events(&coord.rest, id).await?;
    let at = |kind: &str| -> Result<f64> {
        ev.iter().find(|e| e["kind"] == kind).and_then(|e| e["at_ms"].as_f64()).with_context(|| format!("job {id}: no '{kind}' event"))
    };
    let (planning, launching, running) = (at("planning")?, at("launching")?, at("running")?);
    let seen = shared.jobs.lock().unwrap().get(&id).copied().unwrap_or_default();
    let nodes = seen.launches;
    if seen.running_sent != seen.ranks || seen.ranks == 0 {
        bail!("job {id}: {} ranks launched, {} reported running", seen.ranks, seen.running_sent);
    }
    // Cancel; every agent's ranks are then reported exited.
    let t_cancel = Instant::now();
    http(&coord.rest, "POST", &format!("/api/v1/jobs/{id}/cancel"), "").await?;
    loop {
        let plan = http(&coord.rest, "GET", &format!("/api/v1/jobs/{id}/plan"), "").await?;
        let ranks = plan["ranks"].as_array().context("ranks")?;
        if ranks.iter().all(|r| r["state"] == "exited") {
            break;
        }
        shared.check()?;
        if t_cancel.elapsed() > Duration::from_secs(120) {
            bail!("job {id}: ranks not all exited 120 s after cancel");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let stop_s = t_cancel.elapsed().as_secs_f64();
    // Let the last exited reports' heartbeats pass before the next launch.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    Ok(LaunchRow {
        db: db.into(),
        agents: n,
        asked: gpus,
        ranks: seen.ranks,
        nodes,
        to_planning: planning - t_submit,
        planning_to_launching: launching - planning,
        dispatch: seen.last_launch_ms - launching,
        report_wait: seen.last_running_sent_ms - seen.last_launch_ms,
        reports_to_running: running - seen.last_running_sent_ms,
        total: running - t_submit,
        stop_s,
    })
}

/// The solver alone on the same cluster and job (what planning costs inside the launch).
fn solver_ms(gpus: usize) -> Result<(f64, u32)> {
    use motley_solver::hardware::NodeSpec;
    use motley_solver::{Cluster, ClusterSpec, PlanOptions, PlanRequest, ProfileSet, SearchMode};
    let nodes = gpus.div_ceil(GPUS_PER_NODE);
    let node: NodeSpec = serde_json::from_str(&format!(r#"{{"name":"n","count":{nodes},{}"#, &INVENTORY[1..]))?;
    let cluster = Cluster::from_spec(&ClusterSpec { name: "live".into(), nodes: vec![node], gpu_types: vec![] })?;
    let spec = motley_coordinator::job::spec::JobSpec::parse(&format!(
        "name: fleet\nmodel: gpt3-1.3b\nglobal_batch: {}\nresources: {{gpus: {gpus}}}\nrun: 'true'\n",
        gpus.max(32)
    ))?;
    let model = spec.model()?;
    let opts = PlanOptions { global_batch: spec.global_batch, ..PlanOptions::default() };
    let profiles = ProfileSet::default();
    let req = PlanRequest {
        cluster: &cluster,
        model: &model,
        profiles: &profiles,
        opts: &opts,
        mode: SearchMode::Auto,
        exhaustive: false,
        seeds: vec![],
    };
    let t = Instant::now();
    let report = motley_solver::plan(&req)?;
    Ok((t.elapsed().as_secs_f64() * 1000.0, report.gpus_used))
}

fn main() {
    let code = match real_main() {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("fleet bench FAILED: {e:#}");
            1
        }
    };
    std::process::exit(code);
}

fn real_main() -> Result<()> {
    let cfg = config()?;
    println!(
        "fleet bench: coordinator {}; agents {:?}, ranks {:?} (8 GPUs a node), CPU window {} s, databases {:?}, {}, heartbeats {}",
        cfg.coordinator,
        cfg.agents,
        cfg.ranks,
        cfg.window,
        cfg.dbs,
        if cfg.channels == 0 {
            "one HTTP/2 connection per agent".to_string()
        } else {
            format!("{} shared HTTP/2 connections", cfg.channels)
        },
        if cfg.burst { "all at once (--burst)" } else { "on spread phases" }
    );
    let mut solver = vec![];
    for &r in &cfg.ranks {
        solver.push((r, solver_ms(r)?));
    }
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let (mut cpu, mut launches) = (vec![], vec![]);
    let mut run = 0;
    let mut failure = None;
    'all: for db in &cfg.dbs {
        for &n in &cfg.agents {
            run += 1;
            // A panic in the run is an error too (the database is still dropped).
            let r = rt.block_on(async {
                let mut c = vec![];
                let mut l = vec![];
                let r = fleet(&cfg, db, n, run, &mut c, &mut l).await;
                (r, c, l)
            });
            cpu.extend(r.1);
            launches.extend(r.2);
            if let Err(e) = r.0 {
                failure = Some(e.context(format!("{db}, {n} agents")));
                break 'all;
            }
        }
    }
    drop(rt);

    println!("\nHeartbeats: the coordinator's CPU over the window (utime+stime from /proc/PID/stat), after every agent registered");
    println!("| database | agents | all registered and live (s) | heartbeats/s | coordinator CPU (% of one core) | coordinator RSS MiB (peak) | bench process CPU (%) |");
    println!("|---|---:|---:|---:|---:|---:|---:|");
    for r in &cpu {
        println!(
            "| {} | {} | {:.1} | {:.0} | {:.1} | {:.0} ({:.0}) | {:.1} |",
            r.db, r.agents, r.register_s, r.beats_per_s, r.cpu_pct, r.rss_mib, r.hwm_mib, r.bench_cpu_pct
        );
    }
    println!("\nLaunches: ms from submit (this process's clock, before the POST) and between the job's events");
    println!("| database | agents | GPUs asked | ranks | nodes | submit -> planning (queue + solver) | planning -> launching (store) | launching -> last Launch at an agent | -> last ranks reported | -> running | submit -> running | cancel -> all exited (s) |");
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for r in &launches {
        println!(
            "| {} | {} | {} | {} | {} | {:.0} | {:.0} | {:.0} | {:.0} | {:.0} | **{:.0}** | {:.1} |",
            r.db,
            r.agents,
            r.asked,
            r.ranks,
            r.nodes,
            r.to_planning,
            r.planning_to_launching,
            r.dispatch,
            r.report_wait,
            r.reports_to_running,
            r.total,
            r.stop_s
        );
    }
    println!("\nThe solver alone (this process, same cluster and job):");
    println!("| GPUs | solver ms | GPUs used |");
    println!("|---:|---:|---:|");
    for (g, (ms, used)) in &solver {
        println!("| {g} | {ms:.0} | {used} |");
    }
    if let Some(e) = failure {
        return Err(e);
    }
    Ok(())
}
