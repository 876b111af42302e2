//! `motley-rank-probe` as real processes: three ranks meet at MASTER_ADDR and all exit 0; a
//! rank with a wrong environment says what is wrong and exits non-zero.

use std::process::{Command, Output};

use crate::common;
use common::free_port;

fn plan_file(tag: &str) -> std::path::PathBuf {
    let p = std::env::temp_dir().join(format!("motley-probe-plan-{tag}-{}.json", std::process::id()));
    std::fs::write(&p, r#"{"replicas": []}"#).unwrap();
    p
}

fn probe(rank: u32, world: u32, port: u16, plan: &std::path::Path, extra: &[(&str, &str)]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_motley-rank-probe"));
    c.args(["--timeout-ms", "20000"]).env_clear().envs([
        ("RANK", rank.to_string()),
        ("WORLD_SIZE", world.to_string()),
        ("LOCAL_RANK", rank.to_string()),
        ("LOCAL_WORLD_SIZE", world.to_string()),
        ("MASTER_ADDR", "127.0.0.1".into()),
        ("MASTER_PORT", port.to_string()),
        ("CUDA_VISIBLE_DEVICES", rank.to_string()),
        ("MOTLEY_JOB", "7".into()),
        ("MOTLEY_GENERATION", "1".into()),
        ("MOTLEY_PLAN", plan.display().to_string()),
        ("MOTLEY_LAYER_START", (rank * 4).to_string()),
        ("MOTLEY_LAYER_END", (rank * 4 + 4).to_string()),
    ]);
    c.envs(extra.iter().copied());
    c
}

fn text(o: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

#[test]
fn three_ranks_meet_at_master_addr() {
    let (port, plan) = (free_port(), plan_file("ok"));
    // The joiners first: they must retry until rank 0 listens.
    let joiners: Vec<_> = (1..3).map(|r| probe(r, 3, port, &plan, &[]).spawn().unwrap()).collect();
    let zero = probe(0, 3, port, &plan, &[]).output().unwrap();
    assert!(zero.status.success(), "rank 0: {}", text(&zero));
    assert!(text(&zero).contains("rank 0 of 3: environment and rendezvous ok"), "{}", text(&zero));
    for (i, j) in joiners.into_iter().enumerate() {
        let o = j.wait_with_output().unwrap();
        assert!(o.status.success(), "rank {}: {}", i + 1, text(&o));
    }
}

#[test]
fn a_wrong_environment_is_named_and_fails() {
    let plan = plan_file("bad");
    let o = probe(1, 3, free_port(), &plan, &[("MOTLEY_LAYER_START", "8"), ("MOTLEY_LAYER_END", "4"), ("RANK", "5")]).output().unwrap();
    assert!(!o.status.success());
    let t = text(&o);
    assert!(t.contains("MOTLEY_LAYER_START=8 is not below MOTLEY_LAYER_END=4"), "{t}");
    assert!(t.contains("RANK=5 is not below WORLD_SIZE=3"), "{t}");
    let o = probe(0, 2, free_port(), std::path::Path::new("/nonexistent/plan.json"), &[]).output().unwrap();
    assert!(!o.status.success() && text(&o).contains("MOTLEY_PLAN=/nonexistent/plan.json"), "{}", text(&o));
}

#[test]
fn rank_zero_alone_times_out_when_a_rank_never_comes() {
    let plan = plan_file("timeout");
    let o = probe(0, 2, free_port(), &plan, &[]).args(["--timeout-ms", "300"]).output().unwrap();
    assert!(!o.status.success());
    assert!(text(&o).contains("timed out"), "{}", text(&o));
}
