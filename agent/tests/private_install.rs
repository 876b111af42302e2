//! An agent installed (or built) under a directory the jobs' users cannot pass through, such as
//! root's 0700 home or a `mktemp -d`: a root agent still runs a job's ranks as its user, since
//! it executes each rank's wrapper through a descriptor of its own executable, opened before
//! any user is taken on (agent/src/ranks/wrapper_exe.rs). Where the file itself is not
//! executable by the job's user, the agent says so at start-up and the launch is refused with
//! that reason, never a bare 127. Also: the rule for root-only tests (`root_only`).

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use motley_proto::v1::{instruction, Launch, RankLaunch};

use crate::common;
use crate::common::fake_coordinator::FakeCoordinator;
use common::root_only::{self, Need, Verdict};
use common::scratch;

struct AgentProc(Child);
impl Drop for AgentProc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The agent's binary copied to `to` with `mode`.
fn install(to: &Path, mode: u32) -> PathBuf {
    std::fs::create_dir_all(to.parent().unwrap()).unwrap();
    std::fs::copy(env!("CARGO_BIN_EXE_motley-agent"), to).unwrap();
    std::fs::set_permissions(to, std::fs::Permissions::from_mode(mode)).unwrap();
    to.to_path_buf()
}

/// The agent at `binary` on `fake`, its work directory and log in `dir`.
fn start(binary: &Path, fake: &FakeCoordinator, dir: &Path) -> AgentProc {
    let inventory = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/nodes/a100.yaml");
    std::fs::write(dir.join("agent.toml"), "logs_listen = \"127.0.0.1:0\"\n").unwrap();
    let log = std::fs::OpenOptions::new().create(true).append(true).open(dir.join("agent.log")).unwrap();
    let agent = Command::new(binary)
        .args(["--coordinator", &fake.url, "--node", "n0", "--token", "s3cret", "--inventory"])
        .arg(inventory)
        .arg("--work-dir")
        .arg(dir.join("work"))
        .arg("--shm-dir")
        .arg(dir.join("shm"))
        .current_dir(dir)
        .env("MOTLEY_CONFIG", dir.join("agent.toml"))
        .env_remove("MOTLEY_WORK_DIR")
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .unwrap();
    fake.until("the agent's registration", |s| s.registrations.first().map(|_| ()));
    AgentProc(agent)
}

/// Job `job` (generation 1, rank 0) as `nobody`, running `run`.
fn launch_as_nobody(job: i64, run: &str) -> instruction::Kind {
    instruction::Kind::Launch(Launch {
        user: "nobody".into(),
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

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_default()
}

#[test]
fn an_agent_under_a_private_directory_runs_ranks_as_the_jobs_user() {
    if !root_only::can_run("an_agent_under_a_private_directory_runs_ranks_as_the_jobs_user", &[Need::Root, Need::User("nobody")]) {
        return;
    }
    let nobody = motley_agent::ranks::users::lookup("nobody").unwrap().unwrap();
    let dir = scratch("private-install");
    // The work directory is reachable by the job's user; the binary is not, by path.
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    let private = dir.join("private");
    let binary = install(&private.join("bin/motley-agent"), 0o755);
    std::fs::set_permissions(&private, std::fs::Permissions::from_mode(0o700)).unwrap();
    let fake = FakeCoordinator::start();
    let _agent = start(&binary, &fake, &dir);

    // The rank runs as nobody, and holds no descriptor but its stdio (none of the agent's
    // executable, none the agent inherited).
    let run = r#"id -u; ls /proc/$$/fd"#;
    fake.send(launch_as_nobody(1, run));
    let rank_log = dir.join("work/jobs/1/1/rank-0.log");
    assert_eq!(fake.exited(1, 0), Some(0), "{}\nagent: {}", read(&rank_log), read(&dir.join("agent.log")));
    let text = read(&rank_log);
    assert_eq!(text, format!("{}\n0\n1\n2\n", nobody.uid));
    assert!(!read(&dir.join("agent.log")).contains("chmod o+x"), "no warning: others may execute it");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn an_agent_its_jobs_users_cannot_execute_says_so_and_refuses_their_launches() {
    if !root_only::can_run("an_agent_its_jobs_users_cannot_execute_says_so_and_refuses_their_launches", &[Need::Root, Need::User("nobody")])
    {
        return;
    }
    let dir = scratch("root-only-binary");
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    let binary = install(&dir.join("bin/motley-agent"), 0o700);
    let fake = FakeCoordinator::start();
    let _agent = start(&binary, &fake, &dir);
    let fix = format!("chmod o+x {}", binary.display());
    let agent_log = dir.join("agent.log");
    assert!(read(&agent_log).contains(&fix), "the start-up warning names the file and the fix: {}", read(&agent_log));

    fake.send(launch_as_nobody(1, "echo ran"));
    let rank_log = dir.join("work/jobs/1/1/rank-0.log");
    assert_eq!(fake.exited(1, 0), Some(motley_agent::ranks::users::REFUSED), "{}", read(&rank_log));
    let text = read(&rank_log);
    assert!(text.contains("cannot execute the agent's executable") && text.contains(&fix) && !text.contains("ran\n"), "{text}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The rule itself: a root-only test that cannot run is skipped, except under CI as root,
/// where it fails naming what is missing.
#[test]
fn a_root_only_test_that_cannot_run_fails_under_ci_as_root_and_is_skipped_elsewhere() {
    let missing = ["the machine has no user 'nobody'".to_string()];
    assert_eq!(root_only::verdict("t", true, true, &[]), Verdict::Run);
    assert_eq!(root_only::verdict("t", false, false, &[]), Verdict::Run);
    match root_only::verdict("t", true, true, &missing) {
        Verdict::Fail(why) => assert!(why.contains("t cannot run: the machine has no user 'nobody'") && why.contains("CI"), "{why}"),
        other => panic!("{other:?}"),
    }
    for (ci, root) in [(false, true), (true, false), (false, false)] {
        assert!(matches!(root_only::verdict("t", ci, root, &missing), Verdict::Skip(_)), "CI {ci}, root {root}");
    }
    // A need that is met is not missing; one that cannot be met is, whoever runs the test.
    if root_only::ci() && unsafe { libc::geteuid() } == 0 {
        let failed = std::panic::catch_unwind(|| root_only::can_run("t", &[Need::Root, Need::User("motley-no-such-user")]));
        let why = failed.expect_err("under CI as root a missing need fails");
        let why = why.downcast_ref::<String>().cloned().unwrap_or_default();
        assert!(why.contains("no user 'motley-no-such-user'") && !why.contains("root (uid 0)"), "{why}");
    } else {
        assert!(!root_only::can_run("t", &[Need::User("motley-no-such-user")]));
    }
}
