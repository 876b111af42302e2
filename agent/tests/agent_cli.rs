//! `motley-agent` refuses what it cannot run with, before touching the coordinator. (This
//! integration test also makes `cargo test --workspace` build the agent binary that the
//! coordinator's and the CLI's end-to-end tests start.)

use std::process::Command;

#[test]
fn a_missing_inventory_names_the_flag() {
    let out = Command::new(env!("CARGO_BIN_EXE_motley-agent"))
        .args(["--node", "n0", "--inventory", "/nonexistent/node.yaml", "--coordinator", "http://127.0.0.1:9"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--inventory: cannot read /nonexistent/node.yaml"), "{err}");
}

#[test]
fn an_inventory_that_is_not_yaml_is_refused() {
    let file = std::env::temp_dir().join(format!("motley-agent-bad-{}.yaml", std::process::id()));
    std::fs::write(&file, "gpu: [unclosed\n").unwrap();
    let out =
        Command::new(env!("CARGO_BIN_EXE_motley-agent")).args(["--node", "n0", "--inventory", file.to_str().unwrap()]).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("not YAML"), "{}", String::from_utf8_lossy(&out.stderr));
}
