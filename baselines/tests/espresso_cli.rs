//! `motley-baselines espresso eval|search` as checks outside the repository call them: the real binary
//! on Espresso's own files, the contract's JSON fields, RESULTS.md's numbers, clear errors.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

fn motley(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_motley-baselines")).args(args).current_dir(repo()).env_remove("MOTLEY_OUTPUT").output().unwrap()
}

const GPUS: &str = "examples/espresso/gpu/espresso_gpu_config.json";
const README_JOB: &str = "examples/espresso/jobs/upstream_examples/open_llama_3b_v2.json";

fn json_of(args: &[&str]) -> serde_json::Value {
    let out = motley(args);
    assert!(out.status.success(), "motley {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).expect("valid JSON")
}

fn this_run(model: &str) -> (String, String) {
    (format!("examples/espresso/jobs/this_run/{model}.json"), format!("examples/espresso/jobs/this_run/{model}.model_config.json"))
}

#[test]
fn eval_reproduces_the_readme_result() {
    let plan = r#"[["a6000-pcie4-48gb",11],["a6000-pcie4-48gb",12],["3090-pcie4-24gb",3]]"#;
    let v = json_of(&["espresso", "eval", "--job", README_JOB, "--gpus", GPUS, "--plan", plan, "-o", "json"]);
    assert_eq!(format!("{:.3}", v["iteration_time_s"].as_f64().unwrap()), "50.139");
    assert_eq!(format!("{:.5}", v["cost_per_iteration"].as_f64().unwrap()), "0.20195");
    assert_eq!(v["dp"], 1);
    let stages: Vec<(String, u64)> =
        v["stages"].as_array().unwrap().iter().map(|s| (s["gpu"].as_str().unwrap().to_string(), s["layers"].as_u64().unwrap())).collect();
    assert_eq!(stages, [("a6000-pcie4-48gb".to_string(), 11), ("a6000-pcie4-48gb".to_string(), 12), ("3090-pcie4-24gb".to_string(), 3)]);
    assert_eq!(v["meets_slo"], true);
    // The same plan from a file, and as a table.
    let f = std::env::temp_dir().join(format!("motley-espresso-plan-{}.json", std::process::id()));
    std::fs::write(&f, plan).unwrap();
    let v2 = json_of(&["espresso", "eval", "--job", README_JOB, "--gpus", GPUS, "--plan", f.to_str().unwrap(), "-o", "json"]);
    assert_eq!(v2["iteration_time_s"], v["iteration_time_s"]);
    let out = motley(&["espresso", "eval", "--job", README_JOB, "--gpus", GPUS, "--plan", plan]);
    assert!(String::from_utf8_lossy(&out.stdout).contains("50.139"));
}

#[test]
fn eval_says_out_of_memory_as_espresso_does() {
    let (job, mc) = this_run("llama_3b");
    let v = json_of(&[
        "espresso",
        "eval",
        "--job",
        &job,
        "--model-config",
        &mc,
        "--gpus",
        GPUS,
        "--plan",
        r#"[["a6000-pcie4-48gb",42]]"#,
        "-o",
        "json",
    ]);
    assert_eq!(v["fits"], false);
    assert_eq!(v["meets_slo"], false);
    assert_eq!(v["iteration_time_s"].as_f64().unwrap(), 1e10);
    assert!(v["oom_excess_mib"].as_f64().unwrap() > 500.0);
}

#[test]
fn search_finds_the_optima_and_equals_the_oracle() {
    // RESULTS.md's optima (LLaMA-7B: cheaper than its "optimum", which Espresso's pipeline-depth
    // bounds limited), and the exhaustive oracle agrees.
    for (model, cost, first_stage_gpu) in [
        ("llama_1.3b", "0.02288", "3090-pcie4-24gb"),
        ("llama_3b", "0.12990", "a6000-pcie4-48gb"),
        ("llama_7b", "0.48683", "a6000-pcie4-48gb"),
        ("ViT", "0.00878", "3090-pcie4-24gb"),
    ] {
        let (job, mc) = this_run(model);
        let base = ["espresso", "search", "--job", &job, "--model-config", &mc, "--gpus", GPUS, "-o", "json"];
        let v = json_of(&base);
        assert_eq!(format!("{:.5}", v["cost_per_iteration"].as_f64().unwrap()), cost, "{model}");
        assert_eq!(v["stages"][0]["gpu"], first_stage_gpu, "{model}");
        assert_eq!(v["search"]["proven_optimal"], true);
        assert!(v["iteration_time_s"].as_f64().unwrap() < v["slo_s"].as_f64().unwrap());
        // The oracle over pipelines of up to 12 stages (the whole space takes seconds).
        let mut ex = base.to_vec();
        ex.extend(["--exhaustive", "--max-stages", "12"]);
        let o = json_of(&ex);
        let mut short = base.to_vec();
        short.extend(["--max-stages", "12"]);
        assert_eq!(o["cost_per_iteration"], json_of(&short)["cost_per_iteration"], "{model}");
        assert_eq!(o["cost_per_iteration"], v["cost_per_iteration"], "{model}");
        assert_eq!(o["search"]["placed"], o["search"]["allocations"]);
    }
}

#[test]
fn espressos_own_search_is_replayed_with_its_counters() {
    let (job, mc) = this_run("llama_3b");
    let v = json_of(&["espresso", "search", "--job", &job, "--model-config", &mc, "--gpus", GPUS, "--method", "espresso", "-o", "json"]);
    // RESULTS.md: Espresso returns A6000 x3 14/14/14 at $0.1490, placing 426 allocations.
    assert_eq!(format!("{:.4}", v["cost_per_iteration"].as_f64().unwrap()), "0.1490");
    assert_eq!(v["search"]["placed"], 426);
    assert_eq!(v["search"]["memory_test_cuts"], 108);
    assert_eq!(v["search"]["proven_optimal"], false);
}

#[test]
fn quotas_and_slo_are_flags() {
    let (job, mc) = this_run("llama_3b");
    // Without A6000s the plan changes and still meets the SLO.
    let v = json_of(&[
        "espresso",
        "search",
        "--job",
        &job,
        "--model-config",
        &mc,
        "--gpus",
        GPUS,
        "--quota",
        "a6000-pcie4-48gb=0",
        "-o",
        "json",
    ]);
    assert!(v["stages"].as_array().unwrap().iter().all(|s| s["gpu"] != "a6000-pcie4-48gb"));
    assert_eq!(v["allocation"].get("a6000-pcie4-48gb"), None);
    // An SLO nothing meets: the fastest time and its cost, exit 2.
    let out = motley(&["espresso", "search", "--job", &job, "--model-config", &mc, "--gpus", GPUS, "--slo", "0.5"]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("slo") && err.contains("fastest takes") && err.contains("per iteration"), "{err}");
    // Quotas too small for the model: how much memory is missing.
    let out = motley(&[
        "espresso",
        "search",
        "--job",
        &job,
        "--model-config",
        &mc,
        "--gpus",
        GPUS,
        "--quota",
        "a30-pcie-24gb=1",
        "--quota",
        "a6000-pcie4-48gb=0",
        "--quota",
        "a4000-pcie4-16gb=1",
        "--quota",
        "3090-pcie4-24gb=0",
    ]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("GiB missing"), "{err}");
}

#[test]
fn bad_input_names_the_field() {
    let (job, mc) = this_run("llama_3b");
    let run = |args: &[&str]| {
        let out = motley(args);
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        String::from_utf8_lossy(&out.stderr).to_string()
    };
    let e = run(&["espresso", "eval", "--job", &job, "--model-config", &mc, "--gpus", GPUS, "--plan", r#"[["h100",42]]"#]);
    assert!(e.contains("--plan") && e.contains("unknown GPU 'h100'"), "{e}");
    let e = run(&["espresso", "eval", "--job", &job, "--model-config", &mc, "--gpus", GPUS, "--plan", "[[1,2"]);
    assert!(e.contains("--plan"), "{e}");
    // The hashed model name of this_run jobs needs --model-config.
    let e = run(&["espresso", "search", "--job", &job, "--gpus", GPUS]);
    assert!(e.contains("--model-config") && e.contains("llama_3b"), "{e}");
    let e = run(&["espresso", "search", "--job", &job, "--model-config", &mc, "--gpus", GPUS, "--quota", "a30=3"]);
    assert!(e.contains("--quota") && e.contains("unknown GPU 'a30'"), "{e}");
    // A job file cut short is never read as a whole one.
    let dir = std::env::temp_dir().join(format!("motley-espresso-bad-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let text = std::fs::read_to_string(repo().join(&job)).unwrap();
    let cut = dir.join("cut.json");
    std::fs::write(&cut, &text[..text.len() / 2]).unwrap();
    let e = run(&["espresso", "search", "--job", cut.to_str().unwrap(), "--model-config", &mc, "--gpus", GPUS]);
    assert!(e.contains("cut short"), "{e}");
    let e = run(&[
        "espresso",
        "eval",
        "--job",
        &job,
        "--model-config",
        &mc,
        "--gpus",
        GPUS,
        "--plan",
        r#"[["a6000-pcie4-48gb",42]]"#,
        "--dp",
        "64",
    ]);
    assert!(e.contains("--dp"), "{e}");
}
