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
    let out = Command::new(env!("CARGO_BIN_EXE_motley"))
        .args(["dev", "up", "examples/clusters/lab.yaml", "examples/jobs/hello.yaml", "--dir", dir.to_str().unwrap()])
        .current_dir(repo())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(text.contains("3 agents live: a100-0, a100-1, v100"), "{text}");
    assert!(text.contains("[running]") && text.contains("job 1 succeeded"), "{text}");
    // The ranks' own output, streamed with node and rank: 16 GPUs allowed by the job.
    assert!(text.contains("rank-0: rank 0 of 16") && text.contains("HELLO=world"), "{text}");
    assert_eq!(processes_with(dir.to_str().unwrap()), 0, "coordinator and agents are stopped");
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
