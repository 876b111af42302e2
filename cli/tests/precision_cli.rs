//! `--precision` and `--calibration` (solver/README.md, "Precision and calibration"), and the
//! per-stage times of `-o json`: the real binary, real files, exit code 2 with the field named
//! on bad input.

use crate::common;
use common::{json, motley, write_temp};

const V100: &str = "name: v\nnodes:\n  - {name: v, gpu: V100-32G, gpus: 4}\n";
const A100: &str = "name: a\nnodes:\n  - {name: a, gpu: A100-80G, gpus: 4}\n";

fn plan(cluster: &std::path::Path, extra: &[&str]) -> serde_json::Value {
    let c = cluster.to_str().unwrap();
    let mut args = vec!["plan", "--cluster", c, "--model", "gpt3-1.3b", "--global-batch", "16", "--tp", "1", "--micro-batch", "2"];
    args.extend_from_slice(extra);
    json(&args)
}

fn time(v: &serde_json::Value) -> f64 {
    v["iteration_time_s"].as_f64().unwrap()
}

#[test]
fn bf16_is_slow_only_where_there_are_no_bf16_tensor_cores() {
    let v100 = write_temp("v100.yaml", V100);
    let a100 = write_temp("a100.yaml", A100);
    let (v16, vbf) = (plan(&v100, &[]), plan(&v100, &["--precision", "bf16"]));
    assert!(time(&vbf) > 3.0 * time(&v16), "V100 bf16 runs on the fp32 pipes: {} vs {}", time(&vbf), time(&v16));
    let (a16, abf) = (plan(&a100, &[]), plan(&a100, &["--precision", "bf16"]));
    assert_eq!(time(&a16), time(&abf), "A100 has bf16 tensor cores at the fp16 rate");
    let a32 = plan(&a100, &["--precision", "fp32"]);
    assert!(time(&a32) > 5.0 * time(&a16));
    // The default (auto) is fp16 on V100s: the flag spelled out changes nothing.
    assert_eq!(time(&plan(&v100, &["--precision", "fp16"])), time(&v16));
}

#[test]
fn auto_precision_is_bf16_only_where_every_gpu_has_bf16_tensor_cores_and_the_plan_says_which() {
    let a100 = write_temp("a100auto.yaml", A100);
    let mixed =
        write_temp("mixedauto.yaml", "name: m\nnodes:\n  - {name: a, gpu: A100-80G, gpus: 4}\n  - {name: v, gpu: V100-32G, gpus: 4}\n");
    let v100 = write_temp("v100auto.yaml", V100);
    assert_eq!(plan(&a100, &[])["precision"], "bf16", "A100s have bf16 tensor cores");
    assert_eq!(plan(&a100, &["--precision", "auto"])["precision"], "bf16");
    assert_eq!(plan(&mixed, &[])["precision"], "fp16", "a V100 among them: fp16");
    assert_eq!(plan(&v100, &[])["precision"], "fp16");
    // Explicit values are kept, whatever the GPUs.
    for p in ["fp16", "bf16", "fp32"] {
        assert_eq!(plan(&a100, &["--precision", p])["precision"], p);
        assert_eq!(plan(&mixed, &["--precision", p])["precision"], p);
    }
}

#[test]
fn a_calibration_sets_the_efficiency_of_the_types_it_lists() {
    let a100 = write_temp("a100c.yaml", A100);
    let slow = write_temp("slow.yaml", "gpus:\n  - {gpu: a100-80g, efficiency: 0.25, source: a test}\n");
    let other = write_temp("other.yaml", "gpus:\n  - {gpu: T4, efficiency: 0.25}\n");
    let at_bf16 = write_temp("bf16only.yaml", "gpus:\n  - {gpu: A100-80G, precision: bf16, efficiency: 0.25}\n");
    // At fp16 (auto would be bf16 on A100s), where the bf16-only entry does not apply.
    let base = plan(&a100, &["--precision", "fp16"]);
    let cal = plan(&a100, &["--precision", "fp16", "--calibration", slow.to_str().unwrap()]);
    let st = &cal["replicas"][0]["stages"][0];
    let st0 = &base["replicas"][0]["stages"][0];
    // Half the default efficiency: the compute-bound layers take twice as long.
    let (f, f0) = (st["fwd_s"].as_f64().unwrap(), st0["fwd_s"].as_f64().unwrap());
    assert!(f > 1.5 * f0 && st["bwd_s"].as_f64().unwrap() > 1.5 * st0["bwd_s"].as_f64().unwrap(), "{f} vs {f0}");
    assert_eq!(
        time(&plan(&a100, &["--precision", "fp16", "--calibration", other.to_str().unwrap()])),
        time(&base),
        "T4's entry does not apply to A100s"
    );
    assert_eq!(
        time(&plan(&a100, &["--precision", "fp16", "--calibration", at_bf16.to_str().unwrap()])),
        time(&base),
        "a bf16 entry does not apply at fp16"
    );
    assert!(time(&plan(&a100, &["--calibration", at_bf16.to_str().unwrap(), "--precision", "bf16"])) > 1.5 * time(&base));
    // Per-stage and per-hop times are in the JSON for every plan.
    for r in base["replicas"].as_array().unwrap() {
        assert_eq!(r["hops_s"].as_array().unwrap().len() + 1, r["stages"].as_array().unwrap().len());
    }
}

#[test]
fn replan_prices_the_current_plan_stage_by_stage() {
    let a100 = write_temp("a100r.yaml", A100);
    let current = plan(&a100, &[]);
    let f = write_temp("current.json", &current.to_string());
    let r = json(&["replan", "--current", f.to_str().unwrap(), "--cluster", a100.to_str().unwrap(), "--model", "gpt3-1.3b"]);
    let cur = &r["current_plan"];
    assert_eq!(cur["search"]["mode"], "given");
    assert!((time(cur) - r["current_now_s"].as_f64().unwrap()).abs() < 1e-9);
    assert_eq!(cur["replicas"][0]["stages"][0]["fwd_s"], current["replicas"][0]["stages"][0]["fwd_s"]);
}

fn refused(args: &[&str], must_contain: &[&str]) {
    let out = motley(args);
    assert_eq!(out.status.code(), Some(2), "{args:?} should exit 2; stderr: {}", String::from_utf8_lossy(&out.stderr));
    let err = String::from_utf8(out.stderr).unwrap();
    assert_eq!(err.trim_end().lines().count(), 1, "one line: {err}");
    for m in must_contain {
        assert!(err.contains(m), "{err:?} should mention {m:?}");
    }
}

#[test]
fn bad_calibrations_and_precisions_are_refused_naming_the_field() {
    let a100 = write_temp("a100b.yaml", A100);
    let c = a100.to_str().unwrap();
    let cases: &[(&str, &[&str])] = &[
        ("gpus:\n  - {gpu: A100-80G, efficiency: 1.5}\n", &["calibration.gpus[0].efficiency", "(0, 1]"]),
        ("gpus:\n  - {gpu: A100-80G, efficiency: 0.4, backward_efficiency: 0}\n", &["calibration.gpus[0].backward_efficiency"]),
        ("gpus:\n  - {gpu: B300, efficiency: 0.4}\n", &["calibration.gpus[0].gpu", "unknown GPU type 'B300'", "gpu_types"]),
        ("gpus:\n  - {gpu: T4, efficiency: 0.4}\n  - {gpu: t4, efficiency: 0.5}\n", &["calibration.gpus[1].gpu", "twice"]),
        ("gpus:\n  - {gpu: T4, eff: 0.4}\n", &["unknown field `eff`", "spelling"]),
        ("gpus:\n  - {gpu: T4, efficiency: 0.4, precision: fp8}\n", &["precision", "fp8"]),
        ("gpus:\n  - {gpu: T4}\n", &["missing field `efficiency`", "add it"]),
    ];
    for (i, (text, needles)) in cases.iter().enumerate() {
        let f = write_temp(&format!("badcal{i}.yaml"), text);
        let name = f.file_name().unwrap().to_str().unwrap().to_string();
        let mut must = needles.to_vec();
        must.push(&name);
        refused(&["plan", "--cluster", c, "--model", "gpt3-1.3b", "--calibration", f.to_str().unwrap()], &must);
    }
    refused(&["plan", "--cluster", c, "--model", "gpt3-1.3b", "--calibration", "/nonexistent/cal.yaml"], &["cannot read calibration file"]);
    // clap's own refusal (several lines, with the possible values), exit code 2 as well.
    let out = motley(&["plan", "--cluster", c, "--model", "gpt3-1.3b", "--precision", "fp8"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("auto, fp16, bf16, fp32"));
    let mine = write_temp(
        "mine.yaml",
        "name: m\nnodes:\n  - {name: a, gpu: Mine, gpus: 2}\ngpu_types:\n  - {name: Mine, memory_gib: 80, tflops: 100, mem_bw_gbps: 1000}\n",
    );
    refused(
        &["plan", "--cluster", mine.to_str().unwrap(), "--model", "gpt3-1.3b", "--precision", "fp32"],
        &["--precision", "Mine", "fp32_tflops"],
    );
    let bad_type = write_temp(
        "badtype.yaml",
        "name: m\nnodes:\n  - {name: a, gpu: Mine, gpus: 2}\ngpu_types:\n  - {name: Mine, memory_gib: 80, tflops: 100, mem_bw_gbps: 1000, bf16_tflops: -3}\n",
    );
    refused(&["plan", "--cluster", bad_type.to_str().unwrap(), "--model", "gpt3-1.3b"], &["gpu_types[0].bf16_tflops", "positive"]);
}

#[test]
fn the_plan_says_whether_it_was_priced_with_recomputation() {
    let a100 = write_temp("a100recompute.yaml", A100);
    assert_eq!(plan(&a100, &[])["recompute"], false);
    assert_eq!(plan(&a100, &["--recompute"])["recompute"], true, "the ranks recompute as the plan assumes");
}

#[test]
fn the_plan_says_whether_it_was_priced_for_compiled_blocks() {
    let a100 = write_temp("a100compiled.yaml", A100);
    let compiled = plan(&a100, &[]);
    let eager = plan(&a100, &["--eager"]);
    assert_eq!(compiled["compiled"], true, "the runtime compiles its blocks on a GPU by default");
    assert_eq!(eager["compiled"], false, "--eager: ranks that run --compile off");
    let mem = |v: &serde_json::Value| v["replicas"][0]["stages"][0]["memory_gib_per_gpu"].as_f64().unwrap();
    assert!(mem(&eager) > mem(&compiled), "eager blocks save more: {} <= {}", mem(&eager), mem(&compiled));
}
