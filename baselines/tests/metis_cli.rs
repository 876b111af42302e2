//! `motley-baselines metis eval|search` as checks outside the repository call them: the real binary,
//! the anchor data in examples/metis, the JSON fields of the contract, and clear errors.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

fn motley(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_motley-baselines")).args(args).current_dir(repo()).env_remove("MOTLEY_OUTPUT").output().unwrap()
}

/// The contract's common flags for one Table 1 row.
fn inputs(layers: u32, n: u32) -> Vec<String> {
    [
        "--profiles".into(),
        format!("examples/metis/synth_L{layers}"),
        "--hostfile".into(),
        format!("examples/metis/cluster/hostfile_{n}"),
        "--clusterfile".into(),
        "examples/metis/cluster/clusterfile.json".into(),
        "--layers".into(),
        layers.to_string(),
        "--global-batch".into(),
        "128".into(),
    ]
    .to_vec()
}

fn run_json(cmd: &[&str], layers: u32, n: u32, extra: &[&str]) -> serde_json::Value {
    let mut a: Vec<String> = cmd.iter().map(|s| s.to_string()).collect();
    a.extend(inputs(layers, n));
    a.extend(extra.iter().map(|s| s.to_string()));
    a.extend(["-o".into(), "json".into()]);
    let refs: Vec<&str> = a.iter().map(|s| s.as_str()).collect();
    let out = motley(&refs);
    assert!(out.status.success(), "motley {a:?}: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).expect("valid JSON")
}

fn run_err(args: &[String]) -> String {
    let refs: Vec<&str> = args.iter().map(|s| s.as_str()).collect();
    let out = motley(&refs);
    assert_eq!(out.status.code(), Some(2), "expected exit 2 for {args:?}, stdout {}", String::from_utf8_lossy(&out.stdout));
    String::from_utf8_lossy(&out.stderr).into_owned()
}

const PARITY_PLAN: &str = r#"{"node_sequence":["V100","A100"],"device_groups":[8,8,16],"strategies":[[4,2],[1,8],[2,8]],"batches":1,"layer_partition":[0,4,8,10]}"#;

#[test]
fn eval_prices_a_plan_as_metis_does() {
    let v = run_json(&["metis", "eval"], 10, 16, &["--plan", PARITY_PLAN, "--constants-from", "DeviceType.A100_tp4_bs4.json"]);
    assert!((v["cost_ms"].as_f64().unwrap() - 14093.8829).abs() < 0.01, "{v}");
    assert_eq!(v["fits"], true);
    for term in ["execution_ms", "fb_sync_ms", "pp_ms", "dp_ms", "update_ms", "batch_generator_ms"] {
        assert!(v["terms"][term].as_f64().is_some(), "terms.{term} missing: {v}");
    }
    let sum: f64 = ["execution_ms", "fb_sync_ms", "pp_ms", "dp_ms", "update_ms", "batch_generator_ms"]
        .iter()
        .map(|t| v["terms"][t].as_f64().unwrap())
        .sum();
    assert!((sum - v["cost_ms"].as_f64().unwrap()).abs() < 1e-6);
}

#[test]
fn eval_reads_the_plan_from_a_file_too() {
    let p = std::env::temp_dir().join(format!("motley-metis-plan-{}.json", std::process::id()));
    std::fs::write(&p, PARITY_PLAN).unwrap();
    let v = run_json(&["metis", "eval"], 10, 16, &["--plan", p.to_str().unwrap()]);
    assert!(v["cost_ms"].as_f64().unwrap() > 0.0);
}

#[test]
fn search_matches_or_beats_metis_in_its_space_and_the_union() {
    for space in ["metis", "union"] {
        let v = run_json(&["metis", "search"], 10, 16, &["--space", space]);
        let cost = v["cost_ms"].as_f64().unwrap();
        assert!(cost <= 1793.60 + 0.01, "{space}: {cost}");
        assert!(v["plans_costed"].as_u64().unwrap() > 0);
        assert_eq!(v["proven_optimal"], true);
        let plan = &v["plan"];
        for f in ["node_sequence", "device_groups", "strategies", "batches", "layer_partition"] {
            assert!(!plan[f].is_null(), "plan.{f} missing: {v}");
        }
        // The plan it prints costs what it says when evaluated on its own.
        let again = run_json(&["metis", "eval"], 10, 16, &["--plan", &plan.to_string()]);
        assert!((again["cost_ms"].as_f64().unwrap() - cost).abs() < 1e-6);
    }
}

#[test]
fn metis_walk_counts_its_effort() {
    let v = run_json(&["metis", "search"], 10, 16, &["--method", "metis"]);
    assert_eq!(v["plans_costed"], 206);
    assert!((v["cost_ms"].as_f64().unwrap() - 1793.60).abs() < 0.01);
    let improved = run_json(&["metis", "search"], 10, 16, &["--method", "improved-metis"]);
    assert!(improved["counters"]["count"].as_u64().unwrap() < v["counters"]["count"].as_u64().unwrap());
}

#[test]
fn motley_cost_model_prices_metis_winner_as_what_it_is_and_beats_it() {
    let winner = r#"{"node_sequence":["A100","V100"],"device_groups":[32],"strategies":[[1,32]],"batches":1,"layer_partition":[0,10]}"#;
    let priced = run_json(&["metis", "eval"], 10, 16, &["--plan", winner, "--cost-model", "motley"]);
    let notes = priced["notes"].to_string();
    assert!(notes.contains("spans 8 nodes") && notes.contains("slowest"), "{priced}");
    let ours = run_json(&["metis", "search"], 10, 16, &["--cost-model", "motley", "--space", "union"]);
    assert!(ours["cost_ms"].as_f64().unwrap() * 5.0 < priced["cost_ms"].as_f64().unwrap(), "{ours} vs {priced}");
    let metis_space = run_json(&["metis", "search"], 10, 16, &["--cost-model", "motley", "--space", "metis"]);
    assert!(metis_space["cost_ms"].as_f64().unwrap() >= ours["cost_ms"].as_f64().unwrap() - 1e-6);
    assert_eq!(metis_space["plan_form"], "metis");
}

fn with(extra: &[&str], layers: u32, n: u32) -> Vec<String> {
    let mut a: Vec<String> = ["metis", "eval"].iter().map(|s| s.to_string()).collect();
    a.extend(inputs(layers, n));
    a.extend(extra.iter().map(|s| s.to_string()));
    a
}

#[test]
fn bad_inputs_name_the_field_and_the_fix() {
    let bad_plan = PARITY_PLAN.replace("[4,2]", "[4,4]");
    assert!(run_err(&with(&["--plan", &bad_plan], 10, 16)).contains("plan.strategies[0]"));
    let short = PARITY_PLAN.replace("[0,4,8,10]", "[0,4,8,9]");
    assert!(run_err(&with(&["--plan", &short], 10, 16)).contains("plan.layer_partition"));
    let typo = PARITY_PLAN.replace("batches", "batch");
    assert!(run_err(&with(&["--plan", &typo], 10, 16)).contains("--plan"));
    // Wrong --layers: the arrays say 10.
    let mut a = with(&["--plan", PARITY_PLAN], 10, 16);
    let i = a.iter().position(|x| x == "--layers").unwrap();
    a[i + 1] = "12".into();
    let e = run_err(&a);
    assert!(e.contains("has 10 entries") && e.contains("--layers"), "{e}");

    let dir = std::env::temp_dir().join(format!("motley-metis-bad-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let host = dir.join("hostfile");
    std::fs::write(&host, "0.0.0.9 slots=4\n").unwrap();
    let mut a = with(&["--plan", PARITY_PLAN], 10, 16);
    let i = a.iter().position(|x| x == "--hostfile").unwrap();
    a[i + 1] = host.to_string_lossy().into_owned();
    let e = run_err(&a);
    assert!(e.contains("hostfile line 1") && e.contains("0.0.0.9"), "{e}");

    // A profile file cut short is reported, never read as a whole one.
    let prof = dir.join("profiles");
    std::fs::create_dir_all(&prof).unwrap();
    let src = repo().join("examples/metis/synth_L10/DeviceType.A100_tp1_bs1.json");
    let text = std::fs::read_to_string(src).unwrap();
    std::fs::write(prof.join("DeviceType.A100_tp1_bs1.json"), &text[..text.len() / 2]).unwrap();
    let mut a = with(&["--plan", PARITY_PLAN], 10, 16);
    let i = a.iter().position(|x| x == "--profiles").unwrap();
    a[i + 1] = prof.to_string_lossy().into_owned();
    let e = run_err(&a);
    assert!(e.contains("DeviceType.A100_tp1_bs1.json") && e.contains("cut short"), "{e}");

    let mut a = with(&["--plan", PARITY_PLAN], 10, 16);
    let i = a.iter().position(|x| x == "--profiles").unwrap();
    a[i + 1] = "does/not/exist".into();
    assert!(run_err(&a).contains("does/not/exist"));
}
