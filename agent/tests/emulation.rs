//! Emulated GPUs (docs/emulation.md): an agent whose inventory says `emulate: {cpu: F}` runs
//! each rank confined to F of one core by the kernel's CPU bandwidth controller (cgroup v2
//! `cpu.max`, or v1 `cpu.cfs_quota_us` where the cpu controller is on v1, as on the CI
//! machine), the kernel throttles a rank that spins, and the rank's cgroup goes with it. On v1 a
//! rank enters its share once started (`MOTLEY_CPU_SHARE_PROCS`), or its agent moves it there
//! after the start-up allowance. A share that is no share stops the agent at start, naming the
//! field.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use motley_proto::v1::{instruction, Launch, RankLaunch, Stop};

use crate::common;
use crate::common::fake_coordinator::FakeCoordinator;
use common::root_only::{self, Need};
use common::{scratch, wait_exit};

struct AgentProc(Child);
impl Drop for AgentProc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The example A100 node's entry with `emulate: {cpu: SHARE}` added, written into `dir`.
fn inventory(dir: &Path, share: &str) -> PathBuf {
    let example = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/nodes/a100.yaml")).unwrap();
    let path = dir.join("node.yaml");
    std::fs::write(&path, format!("{example}emulate: {{cpu: {share}}}\n")).unwrap();
    path
}

fn agent(fake_url: &str, dir: &Path, inventory: &Path) -> Command {
    std::fs::write(dir.join("agent.toml"), "logs_listen = \"127.0.0.1:0\"\nallow_root_ranks = true\n").unwrap();
    let log = std::fs::OpenOptions::new().create(true).append(true).open(dir.join("agent.log")).unwrap();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_motley-agent"));
    cmd.args(["--coordinator", fake_url, "--node", "n0", "--token", "s3cret", "--inventory"])
        .arg(inventory)
        .arg("--work-dir")
        .arg(dir.join("work"))
        .arg("--shm-dir")
        .arg(dir.join("shm"))
        .current_dir(dir)
        .env("MOTLEY_CONFIG", dir.join("agent.toml"))
        .env_remove("MOTLEY_WORK_DIR")
        .stdout(Stdio::null())
        .stderr(log);
    cmd
}

fn launch(job: i64, run: &str) -> instruction::Kind {
    instruction::Kind::Launch(Launch {
        job,
        generation: 1,
        run: run.into(),
        plan_json: r#"{"global_batch": 1, "micro_batch": 1, "seq_len": 8, "model": "m", "replicas": []}"#.into(),
        master_addr: "127.0.0.1".into(),
        master_port: common::free_port() as u32,
        world_size: 1,
        ranks: vec![RankLaunch { rank: 0, local_rank: 0, local_world_size: 1, layer_end: 4, ..Default::default() }],
        ..Default::default()
    })
}

/// The directory of the cgroup that limits `pid`'s CPU and the limit it holds, as
/// (directory, quota us, period us): the v2 cgroup's `cpu.max` when it has one, else the v1
/// cpu hierarchy's quota.
fn cpu_limit_of(pid: i32) -> (PathBuf, i64, i64) {
    let own = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap();
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    let mount = |pred: &dyn Fn(&str) -> bool| -> Option<String> {
        mountinfo.lines().find(|l| l.split_once(" - ").is_some_and(|(_, r)| pred(r))).map(|l| l.split_whitespace().nth(4).unwrap().into())
    };
    if let (Some(path), Some(m)) = (own.lines().find_map(|l| l.strip_prefix("0::")), mount(&|r| r.starts_with("cgroup2 "))) {
        let dir = Path::new(&m).join(path.trim_start_matches('/'));
        if let Ok(max) = std::fs::read_to_string(dir.join("cpu.max")) {
            let mut it = max.split_whitespace().map(|x| x.parse::<i64>().unwrap_or(-1));
            return (dir, it.next().unwrap(), it.next().unwrap());
        }
    }
    let path = own
        .lines()
        .find_map(|l| {
            let mut p = l.splitn(3, ':');
            let (_, c, path) = (p.next()?, p.next()?, p.next()?);
            c.split(',').any(|c| c == "cpu").then(|| path.to_string())
        })
        .expect("the rank is in a v1 cpu cgroup");
    let m = mount(&|r| r.starts_with("cgroup ") && r.split_whitespace().nth(2).is_some_and(|o| o.split(',').any(|o| o == "cpu"))).unwrap();
    let dir = Path::new(&m).join(path.trim_start_matches('/'));
    let read = |f: &str| std::fs::read_to_string(dir.join(f)).unwrap().trim().parse::<i64>().unwrap();
    let (quota, period) = (read("cpu.cfs_quota_us"), read("cpu.cfs_period_us"));
    (dir, quota, period)
}

/// Launch job `job`'s one rank: `enter`, then it writes its pid and spins; its pid.
fn spinning_rank(fake: &FakeCoordinator, dir: &Path, job: i64, enter: &str) -> i32 {
    fake.send(launch(job, &format!("{enter}echo $$ > rank.pid.tmp && mv rank.pid.tmp rank.pid; while :; do :; done")));
    let pid_file = dir.join(format!("work/jobs/{job}/1/rank.pid"));
    fake.until("the rank's pid", |_| std::fs::read_to_string(&pid_file).ok().filter(|t| t.ends_with('\n'))).trim().parse().unwrap()
}

/// Wait until the kernel has throttled the cgroup's spinning rank.
fn until_throttled(cgroup: &Path) {
    let throttled = || {
        std::fs::read_to_string(cgroup.join("cpu.stat"))
            .unwrap_or_default()
            .lines()
            .find_map(|l| l.strip_prefix("nr_throttled ").map(|n| n.trim().parse::<u64>().unwrap()))
            .unwrap_or(0)
    };
    let start = Instant::now();
    while throttled() == 0 {
        assert!(start.elapsed() < Duration::from_secs(30), "a spinning rank was never throttled: {}", cgroup.display());
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Stop job `job`; its rank's cgroup goes with it.
fn stop(fake: &FakeCoordinator, job: i64, cgroup: &Path) {
    fake.send(instruction::Kind::Stop(Stop { job, generation: 1, reason: "test".into() }));
    assert!(fake.exited(job, 0).is_some());
    let start = Instant::now();
    while cgroup.exists() {
        assert!(start.elapsed() < Duration::from_secs(30), "{} is still there", cgroup.display());
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn an_emulating_agent_runs_each_rank_on_its_share_of_one_core() {
    if !root_only::can_run("an_emulating_agent_runs_each_rank_on_its_share_of_one_core", &[Need::Root]) {
        return;
    }
    let dir = scratch("emulate");
    let fake = FakeCoordinator::start();
    let inv = inventory(&dir, "0.2");
    let _agent = AgentProc(agent(&fake.url, &dir, &inv).spawn().unwrap());
    fake.until("the agent's registration", |s| s.registrations.first().map(|_| ()));
    // The inventory the coordinator is given says so too (the node's view reads it).
    fake.until("an inventory that says emulate", |s| s.registrations[0].inventory_json.contains("\"emulate\"").then_some(()));
    // A rank that spins: the kernel holds it to 5 ms of CPU time every 25 ms. It enters its
    // share itself once started, as motley_torch's ranks do (docs/emulation.md).
    let pid = spinning_rank(&fake, &dir, 1, "echo 0 > \"$MOTLEY_CPU_SHARE_PROCS\" && ");
    let (cgroup, quota, period) = cpu_limit_of(pid);
    assert_eq!((quota, period), (5_000, 25_000), "{}", cgroup.display());
    assert!(cgroup.ends_with("job-1-gen-1-rank-0"), "{}", cgroup.display());
    until_throttled(&cgroup);
    stop(&fake, 1, &cgroup);
    // On a v1 cpu hierarchy the rank enters once started; v2's cgroup, which also tracks what
    // the rank starts, is entered before `exec`.
    let v1 = cgroup.to_string_lossy().contains("/motley-cpu-");
    // A rank that does not enter is moved there by its agent after the start-up allowance
    // (60 base intervals: 3 s at the fake coordinator's 50 ms), with everything it started.
    let pid = spinning_rank(&fake, &dir, 2, "");
    let start = Instant::now();
    let cgroup = loop {
        let (cgroup, quota, period) = cpu_limit_of(pid);
        if cgroup.ends_with("job-2-gen-1-rank-0") {
            assert_eq!((quota, period), (5_000, 25_000), "{}", cgroup.display());
            break cgroup;
        }
        assert!(start.elapsed() < Duration::from_secs(30), "the agent never moved the rank into its share: {}", cgroup.display());
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(!v1 || start.elapsed() >= Duration::from_secs(2), "moved before the allowance: {:?}", start.elapsed());
    until_throttled(&cgroup);
    stop(&fake, 2, &cgroup);
    // The agent's directory goes with its last rank.
    let start = Instant::now();
    while cgroup.parent().unwrap().exists() {
        assert!(start.elapsed() < Duration::from_secs(30), "{} is still there", cgroup.parent().unwrap().display());
        std::thread::sleep(Duration::from_millis(20));
    }
    let log = std::fs::read_to_string(dir.join("agent.log")).unwrap();
    assert!(log.contains("emulated GPUs: each rank runs on 0.2 of one core"), "{log}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_share_that_is_no_share_stops_the_agent_naming_the_field() {
    let dir = scratch("emulate-bad");
    let fake = FakeCoordinator::start();
    for share in ["0", "-1", "65", "fast"] {
        let inv = inventory(&dir, share);
        let mut child = agent(&fake.url, &dir, &inv).spawn().unwrap();
        let status = wait_exit(&mut child, "the agent with a bad emulate");
        assert!(!status.success(), "emulate: {{cpu: {share}}} was taken");
        let log = std::fs::read_to_string(dir.join("agent.log")).unwrap();
        assert!(log.contains("emulate"), "{share}: {log}");
        std::fs::remove_file(dir.join("agent.log")).unwrap();
    }
    let _ = std::fs::remove_dir_all(&dir);
}
