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
fn a_negative_retention_names_the_setting() {
    let out = Command::new(env!("CARGO_BIN_EXE_motley-agent"))
        .args(["--node", "n0", "--keep-finished-hours=-1", "--coordinator", "http://127.0.0.1:9"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("keep_finished_hours: must be a number of hours, 0 or more"), "{err}");
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

/// `motley-agent discover` on an empty sysfs tree: the entry it prints shows which of flag,
/// environment, config file and default won (node name, rdma_domain); no GPU here, so it
/// also says to use --inventory and exits non-zero.
#[test]
fn discover_reads_flag_then_env_then_config_file() {
    let dir = std::env::temp_dir().join(format!("motley-agent-config-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir); // pids are reused: never read an earlier run's files
    std::fs::create_dir_all(dir.join("sys")).unwrap();
    let config = dir.join("agent.toml");
    std::fs::write(
        &config,
        format!("node = \"file-node\"\nrdma_domain = \"file-domain\"\nsysfs_root = \"{}\"\n", dir.join("sys").display()),
    )
    .unwrap();
    let discover = |args: &[&str], env: &[(&str, &str)]| {
        let out = Command::new(env!("CARGO_BIN_EXE_motley-agent"))
            .args(["discover", "-o", "json"])
            .args(args)
            .env_remove("MOTLEY_NODE")
            .env_remove("MOTLEY_RDMA_DOMAIN")
            .env("MOTLEY_CONFIG", &config)
            .envs(env.iter().copied())
            .output()
            .unwrap();
        let entry: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{e}: {out:?}"));
        (entry, out.status.success(), String::from_utf8_lossy(&out.stderr).into_owned())
    };
    let (e, ok, err) = discover(&[], &[]);
    assert_eq!(
        (e["name"].as_str(), e["rdma_domain"].as_str(), e["nics"].as_array().map(Vec::len)),
        (Some("file-node"), Some("file-domain"), Some(0))
    );
    assert!(!ok && err.contains("no GPU found") && err.contains("--inventory FILE"), "{err}");
    let (e, _, _) = discover(&[], &[("MOTLEY_NODE", "env-node")]);
    assert_eq!((e["name"].as_str(), e["rdma_domain"].as_str()), (Some("env-node"), Some("file-domain")));
    let (e, _, _) = discover(&["--node", "flag-node"], &[("MOTLEY_NODE", "env-node"), ("MOTLEY_RDMA_DOMAIN", "env-domain")]);
    assert_eq!((e["name"].as_str(), e["rdma_domain"].as_str()), (Some("flag-node"), Some("env-domain")));
    // An unknown key is refused by name, and a named config file must exist.
    std::fs::write(&config, "node = \"n\"\nlogs_listn = \"x\"\n").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_motley-agent")).arg("discover").env("MOTLEY_CONFIG", &config).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("unknown key 'logs_listn'"), "{err}");
    let out = Command::new(env!("CARGO_BIN_EXE_motley-agent")).args(["--config", "/nonexistent/agent.toml", "discover"]).output().unwrap();
    assert!(String::from_utf8_lossy(&out.stderr).contains("--config: cannot read /nonexistent/agent.toml"));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_tls_cert_without_its_key_names_the_missing_flag() {
    let dir = std::env::temp_dir().join(format!("motley-agent-cli-tls-{}", std::process::id()));
    let inventory = concat!(env!("CARGO_MANIFEST_DIR"), "/../examples/nodes/a100.yaml");
    let out = Command::new(env!("CARGO_BIN_EXE_motley-agent"))
        .args(["--node", "n0", "--inventory", inventory, "--tls-cert", "/c.pem", "--work-dir"])
        .arg(&dir)
        .env("MOTLEY_CONFIG", "/dev/null")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("--tls-key: --tls-cert needs its private key"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}
