//! `motley dev up`: the README's one command for the whole system on one machine.

use std::path::{Path, PathBuf};
use std::process::Command;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

fn processes_with(marker: &str) -> usize {
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| std::fs::read(e.ok()?.path().join("cmdline")).ok())
        .filter(|c| String::from_utf8_lossy(c).contains(marker))
        .count()
}

#[test]
fn dev_up_runs_the_example_job_to_the_end_and_stops_everything() {
    let dir = std::env::temp_dir().join(format!("motley-dev-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir); // pids are reused: an earlier run's database would hold job 1
    let out = Command::new(env!("CARGO_BIN_EXE_motley"))
        .args(["dev", "up", "examples/clusters/lab.yaml", "examples/jobs/hello.yaml", "--dir", dir.to_str().unwrap()])
        .current_dir(repo())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{text}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(text.contains("3 agents live: a100-0, a100-1, v100"), "{text}");
    assert!(text.contains("[running]") && text.contains("job 1 succeeded"), "{text}");
    // The ranks' own output, streamed with node and rank: 16 GPUs allowed by the job.
    assert!(text.contains("rank-0: rank 0 of 16") && text.contains("HELLO=world"), "{text}");
    assert_eq!(processes_with(dir.to_str().unwrap()), 0, "coordinator and agents are stopped");
}

/// `motley dev up` of this cluster file and job file (written into a fresh directory named
/// from `prefix`), its state in DIR/state: the directory and the command's output.
fn dev_up_files(prefix: &str, cluster: &str, job: &str) -> (std::path::PathBuf, std::process::Output) {
    dev_up_files_with(prefix, cluster, job, &[])
}

/// `dev_up_files`, from a shell with the variables `env` set (and no MOTLEY_RANK_ENV).
fn dev_up_files_with(prefix: &str, cluster: &str, job: &str, env: &[(&str, &str)]) -> (std::path::PathBuf, std::process::Output) {
    let dir = std::env::temp_dir().join(format!("{prefix}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let (cluster_file, job_file) = (dir.join("cluster.yaml"), dir.join("job.yaml"));
    std::fs::write(&cluster_file, cluster).unwrap();
    std::fs::write(&job_file, job).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_motley"))
        .args(["dev", "up", cluster_file.to_str().unwrap(), job_file.to_str().unwrap(), "--dir", dir.join("state").to_str().unwrap()])
        .current_dir(repo())
        .env_remove("MOTLEY_RANK_ENV")
        .envs(env.iter().copied())
        .output()
        .unwrap();
    (dir, out)
}

#[test]
fn dev_up_of_a_failing_job_exits_1() {
    let (dir, out) = dev_up_files(
        "motley-dev-fail",
        "name: one\nnodes:\n  - {name: solo, gpu: A100-80G, gpus: 2}\n",
        "name: failing\nmodel: gpt3-1.3b\nglobal_batch: 8\nresources: {gpus: 2}\nrun: 'exit 7'\n",
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("job 1 failed"), "{text}\n{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert_eq!(processes_with(dir.join("state").to_str().unwrap()), 0, "coordinator and agents are stopped");
}

/// A cluster file's own GPU types reach the coordinator: its nodes register and the job is
/// planned on them.
#[test]
fn dev_up_passes_the_cluster_files_gpu_types_to_the_coordinator() {
    let (dir, out) = dev_up_files(
        "motley-dev-types",
        "name: toy\nnodes:\n  - {name: toy, gpu: Toy-GPU, gpus: 2}\ngpu_types:\n  - {name: Toy-GPU, memory_gib: 80, tflops: 100, mem_bw_gbps: 2000}\n",
        "name: toy\nmodel: gpt3-1.3b\nglobal_batch: 8\nresources: {gpus: 2}\nrun: 'echo toy-ok'\n",
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{text}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(text.contains("1 agents live: toy") && text.contains("job 1 succeeded") && text.contains("toy-ok"), "{text}");
    assert_eq!(processes_with(dir.join("state").to_str().unwrap()), 0, "coordinator and agents are stopped");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The ranks' Python gets what the shell has (python/README.md, "What a rank's Python needs"):
/// its PYTHONPATH and VIRTUAL_ENV reach the ranks, a job's own `envs:` win over them, and
/// nothing else of the shell's does.
#[test]
fn dev_up_passes_the_shells_python_variables_to_the_ranks() {
    let (dir, out) = dev_up_files_with(
        "motley-dev-python-env",
        "name: one\nnodes:\n  - {name: solo, gpu: A100-80G, gpus: 2}\n",
        "name: env\nmodel: gpt3-1.3b\nglobal_batch: 8\nresources: {gpus: 2}\n\
         run: 'echo \"pp=$PYTHONPATH ve=$VIRTUAL_ENV key=$AWS_SECRET_ACCESS_KEY\"'\nenvs: {VIRTUAL_ENV: /from/job}\n",
        &[("PYTHONPATH", "/from/shell/python"), ("VIRTUAL_ENV", "/from/shell/venv"), ("AWS_SECRET_ACCESS_KEY", "shell-secret")],
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{text}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(text.contains("ranks inherit this shell's PATH and PYTHONPATH, VIRTUAL_ENV"), "{text}");
    for rank in ["rank-0", "rank-1"] {
        assert!(text.contains(&format!("{rank}: pp=/from/shell/python ve=/from/job key=\n")), "{text}");
    }
    assert!(!text.contains("shell-secret"), "{text}");
    assert_eq!(processes_with(dir.join("state").to_str().unwrap()), 0, "coordinator and agents are stopped");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn dev_up_refuses_bad_files_before_starting_anything() {
    let out = Command::new(env!("CARGO_BIN_EXE_motley"))
        .args(["dev", "up", "examples/nope.yaml", "examples/jobs/hello.yaml"])
        .current_dir(repo())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot read cluster file"));
}

#[test]
fn ctrl_c_cancels_the_job_and_leaves_no_process_behind() {
    use std::io::{BufRead, BufReader};
    let dir = std::env::temp_dir().join(format!("motley-dev-ctrlc-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let marker = format!("motley-ctrlc-marker-{}", std::process::id());
    let job = dir.join("sleeper.yaml");
    std::fs::write(
        &job,
        format!("name: sleeper\nmodel: gpt3-1.3b\nglobal_batch: 8\nresources: {{gpus: 4}}\nrun: 'sleep 600; echo {marker}'\n"),
    )
    .unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_motley"))
        .args(["dev", "up", "examples/clusters/lab.yaml", job.to_str().unwrap(), "--dir", dir.join("state").to_str().unwrap()])
        .current_dir(repo())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut seen = String::new();
    loop {
        let mut line = String::new();
        assert!(out.read_line(&mut line).unwrap() > 0, "dev up ended before the job ran:\n{seen}");
        seen.push_str(&line);
        if line.contains("[running]") {
            break;
        }
    }
    assert!(processes_with(&marker) > 0, "the ranks run");
    // What a terminal's Ctrl-C sends.
    assert!(Command::new("kill").args(["-INT", &child.id().to_string()]).status().unwrap().success());
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut out, &mut rest).unwrap();
    let status = child.wait().unwrap();
    // The job was cancelled: exit code 3, not a success.
    assert_eq!(status.code(), Some(3), "{seen}{rest}");
    assert!(rest.contains("interrupted: cancelling job 1") && rest.contains("job 1 cancelled"), "{rest}");
    assert_eq!(processes_with(&marker), 0, "no rank is left behind");
    assert_eq!(processes_with(dir.join("state").to_str().unwrap()), 0, "coordinator and agents are stopped");
}

/// Two runs checkpointing to one cloud say where their job 1 goes: each under its own cluster's
/// identity, never the same place (docs/recovery.md, "Where checkpoint bytes live").
#[test]
fn two_dev_ups_sharing_a_cloud_put_their_job_1_apart() {
    let cloud = std::env::temp_dir().join(format!("motley-dev-cloud-{}", std::process::id()));
    let job = format!(
        "name: saver\nmodel: gpt3-1.3b\nglobal_batch: 8\nresources: {{gpus: 2}}\ncheckpoint: {{every: 100, cloud: 'file://{}'}}\nrun: 'true'\n",
        cloud.display()
    );
    let mut places = vec![];
    for run in ["motley-dev-cloud-a", "motley-dev-cloud-b"] {
        let (dir, out) = dev_up_files(run, "name: one\nnodes:\n  - {name: solo, gpu: A100-80G, gpus: 2}\n", &job);
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        assert_eq!(out.status.code(), Some(0), "{text}\n{}", String::from_utf8_lossy(&out.stderr));
        let line = text.lines().find(|l| l.contains("job 1 checkpoints to")).unwrap_or_else(|| panic!("{text}"));
        let place = line.rsplit(' ').next().unwrap().to_string();
        let cluster = place
            .strip_prefix(&format!("file://{}/", cloud.display()))
            .and_then(|p| p.strip_suffix("/jobs/1/GENERATION/step-S"))
            .unwrap_or_else(|| panic!("{line}"));
        assert!(cluster.len() == 16 && cluster.bytes().all(|b| b.is_ascii_hexdigit()), "{line}");
        places.push(place);
        let _ = std::fs::remove_dir_all(&dir);
    }
    assert_ne!(places[0], places[1], "each run is its own cluster");
}

/// `--emulate`: every GPU type at its relative speed on this machine's cores, each node's agent
/// given the share in its inventory (its ranks confined to it: agent/tests/emulation.rs), and
/// the job runs to the end. The agents set CPU quotas in cgroups: root only (CI runs as root).
#[test]
fn dev_up_emulate_gives_each_gpu_type_its_share_of_a_core() {
    let uid = Command::new("id").arg("-u").output().unwrap();
    if String::from_utf8_lossy(&uid.stdout).trim() != "0" {
        assert!(std::env::var_os("CI").is_none(), "dev_up_emulate_gives_each_gpu_type_its_share_of_a_core needs root (cgroup CPU quotas)");
        return;
    }
    let dir = std::env::temp_dir().join(format!("motley-dev-emulate-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let (cluster, job) = (dir.join("cluster.yaml"), dir.join("job.yaml"));
    std::fs::write(&cluster, "name: emu\nnodes:\n  - {name: fast, gpu: A100-80G, gpus: 1}\n  - {name: slow, gpu: V100-32G, gpus: 1}\n")
        .unwrap();
    std::fs::write(&job, "name: emu\nmodel: gpt3-1.3b\nglobal_batch: 8\nresources: {gpus: 2}\nrun: 'echo emulated-ok'\n").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_motley"))
        .args(["dev", "up", cluster.to_str().unwrap(), job.to_str().unwrap(), "--emulate", "--dir", dir.join("state").to_str().unwrap()])
        .current_dir(repo())
        .env_remove("MOTLEY_RANK_ENV")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{text}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(text.contains("emulating A100-80G on") && text.contains("emulating V100-32G on"), "{text}");
    assert!(text.contains("job 1 succeeded") && text.contains("emulated-ok"), "{text}");
    let share = |node: &str| -> f64 {
        let entry: serde_json::Value =
            serde_norway::from_str(&std::fs::read_to_string(dir.join(format!("state/nodes/{node}.yaml"))).unwrap()).unwrap();
        entry["emulate"]["cpu"].as_f64().unwrap()
    };
    // fp16 peaks (a V100 has no bf16): 312 and 125 TFLOPS.
    let (fast, slow) = (share("fast"), share("slow"));
    assert!((fast / slow - 312.0 / 125.0).abs() < 0.05 && fast <= 1.0, "{fast} {slow}");
    assert_eq!(processes_with(dir.join("state").to_str().unwrap()), 0, "coordinator and agents are stopped");
    let _ = std::fs::remove_dir_all(&dir);
}
