//! Running the real `motley` binary from the repository root, for the CLI test files.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

/// `motley ARGS` in the repository root, with none of the flags' environment variables set.
pub fn motley(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_motley"))
        .args(args)
        .current_dir(repo())
        .env_remove("MOTLEY_CLUSTER")
        .env_remove("MOTLEY_MODEL")
        .env_remove("MOTLEY_BANDWIDTH")
        .output()
        .unwrap()
}

/// `motley ARGS -o json`, which must succeed.
pub fn json(args: &[&str]) -> serde_json::Value {
    let mut a = args.to_vec();
    a.extend(["-o", "json"]);
    let out = motley(&a);
    assert!(out.status.success(), "motley {args:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).expect("valid JSON")
}

/// A file in this test process's temporary folder.
pub fn write_temp(name: &str, text: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("motley-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}
