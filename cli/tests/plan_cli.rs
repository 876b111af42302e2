//! `motley plan` as a user runs it: the real binary, real files, exit codes and output.

use std::collections::HashSet;

use crate::common;
use common::{json, motley, repo, write_temp};
use std::process::Command;

/// Every structural promise of the JSON contract.
fn check_contract(v: &serde_json::Value, layers: u64) {
    let gb = v["global_batch"].as_u64().unwrap();
    let t = v["iteration_time_s"].as_f64().unwrap();
    assert!(t > 0.0);
    let tps = v["tokens_per_s"].as_f64().unwrap();
    assert!((tps - gb as f64 * v["seq_len"].as_f64().unwrap() / t).abs() / tps < 1e-9);
    let mut samples = 0;
    let mut seen = HashSet::new();
    for r in v["replicas"].as_array().unwrap() {
        samples += r["samples"].as_u64().unwrap();
        assert_eq!(r["samples"].as_u64().unwrap(), r["micro_batches"].as_u64().unwrap() * v["micro_batch"].as_u64().unwrap());
        let mut next = 0;
        for s in r["stages"].as_array().unwrap() {
            let l = s["layers"].as_array().unwrap();
            assert_eq!(l[0].as_u64().unwrap(), next, "stages are contiguous");
            next = l[1].as_u64().unwrap();
            let (tp, dp) = (s["tp"].as_u64().unwrap() as usize, s["dp"].as_u64().unwrap() as usize);
            let gpus = s["gpus"].as_array().unwrap();
            assert_eq!(gpus.len(), tp * dp);
            for group in gpus.chunks(tp) {
                assert!(group.iter().all(|g| g["node"] == group[0]["node"]), "a TP group stays in one node");
            }
            for g in gpus {
                assert!(seen.insert((g["node"].as_str().unwrap().to_string(), g["index"].as_u64().unwrap())), "a GPU is used once");
            }
            assert!(s["memory_gib_per_gpu"].as_f64().unwrap() <= s["memory_capacity_gib"].as_f64().unwrap());
        }
        assert_eq!(next, layers, "every replica holds the whole model");
    }
    assert_eq!(samples, gb, "samples add up to the global batch");
    // The typed reading every other part uses (motley-contract) takes the document whole.
    let doc: motley_contract::PlanDocument = serde_json::from_value(v.clone()).expect("the plan document reads as the contract type");
    assert_eq!(doc.placements().len() as u64, v["gpus_used"].as_u64().unwrap(), "one rank per GPU used");
    assert_eq!(doc.comm_groups.len(), v["comm_groups"].as_array().unwrap().len());
    assert_eq!(doc.model_spec.as_ref().map(|m| u64::from(m.layers)), Some(layers), "the plan carries its model");
    // How the ranks run, as the rank library reads it too (`motley_torch.plan`).
    let flags = |k: &str| v[k].as_bool().unwrap_or_else(|| panic!("{k} is a boolean: {}", v[k]));
    assert_eq!((doc.recompute, doc.compiled, doc.zero1), (flags("recompute"), flags("compiled"), flags("zero1")));
    // Motley's own plan (not a baseline's, `--baseline`) is never slower than a baseline.
    if v["search"]["baseline"].is_null() {
        for b in ["megatron", "whale", "fast-only"] {
            if let Some(bt) = v["baselines"][b]["iteration_time_s"].as_f64() {
                assert!(t <= bt * (1.0 + 1e-12), "never slower than {b}");
            }
        }
    }
}

#[test]
fn a_baselines_plan_is_a_whole_plan_document_that_says_which_baseline() {
    let lab = ["plan", "--cluster", "examples/lab.yaml", "--model", "llama-13b"];
    let ours = json(&lab);
    assert!(ours["search"].get("baseline").is_none(), "Motley's own plan names no baseline");
    for b in ["megatron", "whale", "fast-only"] {
        let v = json(&[&lab[..], &["--baseline", b]].concat());
        check_contract(&v, 40);
        assert_eq!((v["search"]["mode"].as_str(), v["search"]["baseline"].as_str()), (Some("baseline"), Some(b)));
        let compared = ours["baselines"][b]["iteration_time_s"].as_f64().unwrap();
        assert!((v["iteration_time_s"].as_f64().unwrap() - compared).abs() <= 1e-9 * compared, "{b}: {v} against {compared}");
        assert!(ours["iteration_time_s"].as_f64().unwrap() < compared, "{b}: Motley is faster on the lab");
    }
    let out = motley(&[&lab[..], &["--baseline", "fast-only", "--compare"]].concat());
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.contains("the fast-only baseline's plan, not Motley's"), "{text}");
    assert!(text.contains("this plan is") && !text.contains("motley is"), "{text}");
}

#[test]
fn a_baseline_that_is_not_one_or_cannot_apply_is_refused() {
    let lab = ["plan", "--cluster", "examples/lab.yaml", "--model", "llama-13b"];
    let out = motley(&[&lab[..], &["--baseline", "ddp"]].concat());
    let err = String::from_utf8(out.stderr).unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(err.contains("--baseline") && err.contains("megatron") && err.contains("fast-only"), "{err}");
    let out = motley(&[&lab[..], &["--baseline", "megatron", "--exhaustive"]].concat());
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8(out.stderr).unwrap().contains("cannot be used with"));
    let out = motley(&["plan", "--cluster", "examples/lab.yaml", "--model", "llama-70b", "--baseline", "whale"]);
    let err = String::from_utf8(out.stderr).unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(err.contains("no whale plan fits"), "{err}");
    let current = write_temp("baseline-current.json", &serde_json::to_string(&json(&lab)).unwrap());
    let out = motley(&[
        "replan",
        "--current",
        current.to_str().unwrap(),
        "--cluster",
        "examples/lab.yaml",
        "--model",
        "llama-13b",
        "--baseline",
        "megatron",
    ]);
    let err = String::from_utf8(out.stderr).unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(err.contains("--baseline: replan weighs"), "{err}");
}

#[test]
fn plans_every_example_cluster() {
    for (cluster, model, layers) in [
        ("examples/a100-h800.yaml", "gpt3-6.7b", 32),
        ("examples/a100x4-h800x2.yaml", "llama-7b", 32),
        ("examples/a100x1-h20x4.yaml", "llama-7b", 32),
        ("examples/lab.yaml", "llama-13b", 40),
        ("examples/lab.yaml", "examples/tiny-gpt.yaml", 12),
    ] {
        let v = json(&["plan", "--cluster", cluster, "--model", model]);
        check_contract(&v, layers);
        assert_eq!(v["split_hops"], 0, "placement matches the cost model's packing");
        assert_eq!(v["gpus_total"].as_u64().unwrap(), if cluster.contains("lab") { 40 } else { v["gpus_total"].as_u64().unwrap() });
    }
}

#[test]
fn beats_megatron_on_a_mixed_cluster() {
    let v = json(&["plan", "--cluster", "examples/a100-h800.yaml", "--model", "gpt3-6.7b"]);
    let speedup = v["baselines"]["megatron"]["speedup"].as_f64().unwrap();
    assert!(speedup > 1.2, "asymmetric plans should beat symmetric Megatron clearly, got {speedup}");
}

#[test]
fn table_output_shows_the_plan_and_baselines() {
    let out = motley(&["plan", "--cluster", "examples/a100-h800.yaml", "--model", "gpt3-6.7b", "--compare"]);
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.contains("iteration") && text.contains("tokens/s"));
    assert!(text.contains("H800") && text.contains("A100-80G"));
    assert!(text.contains("megatron") && text.contains("whale"));
}

#[test]
fn options_change_the_plan_as_asked() {
    let v = json(&[
        "plan",
        "--cluster",
        "examples/a100-h800.yaml",
        "--model",
        "gpt3-6.7b",
        "--global-batch",
        "64",
        "--micro-batch",
        "2",
        "--tp",
        "2",
        "--seq-len",
        "1024",
    ]);
    check_contract(&v, 32);
    assert_eq!(v["global_batch"], 64);
    assert_eq!(v["micro_batch"], 2);
    assert_eq!(v["seq_len"], 1024);
    for r in v["replicas"].as_array().unwrap() {
        assert!(r["stages"].as_array().unwrap().iter().all(|s| s["tp"] == 2));
    }
}

#[test]
fn environment_variables_stand_in_for_flags() {
    let out = Command::new(env!("CARGO_BIN_EXE_motley"))
        .args(["plan", "-o", "json"])
        .current_dir(repo())
        .env("MOTLEY_CLUSTER", "examples/a100x1-h20x4.yaml")
        .env("MOTLEY_MODEL", "llama-7b")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["cluster"], "a100x1-h20x4");
}

#[test]
fn exhaustive_oracle_agrees_with_the_search() {
    let cluster = write_temp(
        "small.yaml",
        "name: small\nnodes:\n  - {name: a, gpu: A100-40G, gpus: 2}\n  - {name: t, gpu: T4, gpus: 2, intra: pcie}\n",
    );
    let model = write_temp("m.yaml", "name: m\nlayers: 6\nhidden: 1024\nheads: 16\nseq_len: 512\nvocab: 8000\n");
    let args = ["plan", "--cluster", cluster.to_str().unwrap(), "--model", model.to_str().unwrap(), "--global-batch", "4"];
    let fast = json(&args);
    let mut ex = args.to_vec();
    ex.push("--exhaustive");
    let slow = json(&ex);
    assert_eq!(slow["search"]["mode"], "exhaustive");
    assert!(fast["search"]["proven_optimal"].as_bool().unwrap());
    let (a, b) = (fast["iteration_time_s"].as_f64().unwrap(), slow["iteration_time_s"].as_f64().unwrap());
    assert!((a - b).abs() <= 1e-9 * b, "search {a} vs oracle {b}");
}

#[test]
fn profiles_replace_the_roofline() {
    let base = json(&["plan", "--cluster", "examples/a100-h800.yaml", "--model", "gpt3-6.7b", "--tp", "1", "--micro-batch", "1"]);
    let slow = write_temp(
        "slow.yaml",
        "profiles:\n  - {gpu: A100-80G, tp: 1, micro_batch: 1, fwd_ms: 100, bwd_ms: 200}\n  - {gpu: H800, tp: 1, micro_batch: 1, fwd_ms: 100, bwd_ms: 200}\n",
    );
    let prof = json(&[
        "plan",
        "--cluster",
        "examples/a100-h800.yaml",
        "--model",
        "gpt3-6.7b",
        "--tp",
        "1",
        "--micro-batch",
        "1",
        "--profiles",
        slow.to_str().unwrap(),
    ]);
    assert!(prof["iteration_time_s"].as_f64().unwrap() > 3.0 * base["iteration_time_s"].as_f64().unwrap());
    let ok = json(&["plan", "--cluster", "examples/a100-h800.yaml", "--model", "gpt3-6.7b", "--profiles", "examples/profiles.yaml"]);
    check_contract(&ok, 32);
}

/// Bad input: one line on stderr naming the file and the field, exit code 2.
fn refused(args: &[&str], must_contain: &[&str]) {
    let out = motley(args);
    assert_eq!(out.status.code(), Some(2), "{args:?} should exit 2; stderr: {}", String::from_utf8_lossy(&out.stderr));
    let err = String::from_utf8(out.stderr).unwrap();
    assert_eq!(err.trim_end().lines().count(), 1, "one line: {err}");
    assert!(!err.contains("panicked"));
    for m in must_contain {
        assert!(err.contains(m), "{err:?} should mention {m:?}");
    }
}

#[test]
fn bad_cluster_files_are_refused_with_the_field_and_fix() {
    let cases: &[(&str, &[&str])] = &[
        ("name: x\nnodes:\n  - {name: a, gpu: B300, gpus: 8}\n", &["nodes[0].gpu", "B300", "gpu_types"]),
        ("name: x\nnodes:\n  - {name: a, gpu: H100}\n", &["nodes[0]", "missing field `gpus`", "add it"]),
        ("name: x\nnodes:\n  - {name: a, gpu: H100, gpus: 0}\n", &["nodes[0].gpus", "at least 1"]),
        ("name: x\nnodes:\n  - {name: a, gpu: H100, gpus: 8}\n  - {name: a, gpu: H100, gpus: 8}\n", &["nodes[1].name", "duplicate node name 'a'"]),
        ("name: x\nnodes:\n  - {name: a, count: 2, gpu: H100, gpus: 8}\n  - {name: a-1, gpu: H100, gpus: 8}\n", &["duplicate node name 'a-1'"]),
        ("name: x\nnodes: []\n", &["nodes", "no nodes"]),
        ("name: x\nnodes:\n  - {name: a, gpu: H100, gpus: eight}\n", &["nodes[0].gpus", "invalid"]),
        ("name: x\nnodes:\n  - {name: a, gpu: H100, gpus: 8, gpu_count: 3}\n", &["unknown field `gpu_count`", "spelling"]),
        ("name: x\nnodes:\n  - {name: a, gpu: RTX4090, gpus: 8, intra: nvlink}\n", &["nodes[0].intra", "pcie"]),
        ("name: x\nnodes:\n  - {name: a, gpu: H100, gpus: 8, nics: [{name: m, kind: ib, gbps: -1}]}\n", &["nodes[0].nics[0].gbps"]),
        ("name: x\nnodes:\n  - {name: a, gpu: H100, gpus: 8, nics: [{name: m, kind: omnipath, gbps: 100}]}\n", &["nodes[0].nics[0].kind", "omnipath"]),
        ("name: x\nnodes:\n  - {name: a, gpu: Mine, gpus: 8}\ngpu_types:\n  - {name: Mine, memory_gib: 0, tflops: 10, mem_bw_gbps: 100}\n", &["gpu_types[0].memory_gib"]),
        ("nodes: [\n", &["bad.yaml"]),
    ];
    for (i, (text, needles)) in cases.iter().enumerate() {
        let f = write_temp(&format!("bad{i}.yaml"), text);
        let mut must: Vec<&str> = needles.to_vec();
        let name = f.file_name().unwrap().to_str().unwrap().to_string();
        let path = f.to_str().unwrap().to_string();
        must.push(&name);
        let _ = &path;
        refused(
            &["plan", "--cluster", &path, "--model", "gpt3-1.3b"],
            &must.iter().map(|s| if *s == "bad.yaml" { name.as_str() } else { s }).collect::<Vec<_>>(),
        );
    }
}

#[test]
fn bad_models_and_flags_are_refused() {
    refused(&["plan", "--cluster", "examples/lab.yaml", "--model", "gpt5"], &["--model", "gpt5", "llama-7b"]);
    let m = write_temp("badmodel.yaml", "name: m\nlayers: 4\nhidden: 1000\nheads: 16\nseq_len: 512\nvocab: 8000\n");
    refused(&["plan", "--cluster", "examples/lab.yaml", "--model", m.to_str().unwrap()], &["badmodel.yaml", "hidden", "divisible"]);
    let m = write_temp("badmodel2.yaml", "name: m\nlayers: 0\nhidden: 1024\nheads: 16\nseq_len: 512\nvocab: 8000\n");
    refused(&["plan", "--cluster", "examples/lab.yaml", "--model", m.to_str().unwrap()], &["badmodel2.yaml", "layers"]);
    refused(&["plan", "--cluster", "examples/lab.yaml", "--model", "gpt3-1.3b", "--micro-batch", "3"], &["--micro-batch", "divisor"]);
    refused(&["plan", "--cluster", "examples/lab.yaml", "--model", "gpt3-1.3b", "--global-batch", "0"], &["--global-batch"]);
    refused(&["plan", "--cluster", "examples/lab.yaml", "--model", "gpt3-1.3b", "--tp", "3"], &["--tp", "power of two"]);
    refused(
        &["plan", "--cluster", "examples/lab.yaml", "--model", "gpt3-1.3b", "--host-layer-ms=-1"],
        &["--host-layer-ms", "milliseconds"],
    );
    refused(&["plan", "--cluster", "examples/lab.yaml", "--model", "gpt3-1.3b", "--tp", "16"], &["--tp", "largest node (8 GPUs)"]);
    refused(&["plan", "--cluster", "examples/lab.yaml", "--model", "examples/tiny-gpt.yaml", "--tp", "8"], &["--tp", "12 attention heads"]);
    refused(&["plan", "--cluster", "/nonexistent/c.yaml", "--model", "gpt3-1.3b"], &["/nonexistent/c.yaml", "cannot read"]);
    let p = write_temp("badprof.yaml", "profiles:\n  - {gpu: H800, tp: 3, micro_batch: 1, fwd_ms: 1, bwd_ms: 2}\n");
    refused(
        &["plan", "--cluster", "examples/lab.yaml", "--model", "gpt3-1.3b", "--profiles", p.to_str().unwrap()],
        &["badprof.yaml", "profiles[0].tp"],
    );
}

#[test]
fn a_model_that_fits_nowhere_says_how_much_it_needs() {
    let c = write_temp("t4.yaml", "name: t4\nnodes:\n  - {name: t, gpu: T4, gpus: 2, intra: pcie}\n");
    refused(&["plan", "--cluster", c.to_str().unwrap(), "--model", "llama-70b"], &["t4.yaml", "does not fit", "GiB", "add GPUs"]);
}

/// Sizes beyond the planner's limits are refused (exit 2) naming the field, before anything
/// is expanded: `count: 100000000` used to grow `motley plan` to 16 GB.
#[test]
fn sizes_beyond_the_limits_are_refused_naming_the_field() {
    let c = write_temp(
        "typo.yaml",
        "name: x\nnodes:\n  - {name: a, gpu: H100, gpus: 8}\n  - {name: g, count: 100000000, gpu: H100, gpus: 8}\n",
    );
    refused(
        &["plan", "--cluster", c.to_str().unwrap(), "--model", "gpt3-1.3b"],
        &["typo.yaml", "nodes[1].count: 100000000 is more than the 65536 nodes a cluster may have", "solver/README.md"],
    );
    let c = write_temp("wide.yaml", "name: x\nnodes:\n  - {name: a, gpu: H100, gpus: 1000}\n");
    refused(&["plan", "--cluster", c.to_str().unwrap(), "--model", "gpt3-1.3b"], &["wide.yaml", "nodes[0].gpus: 1000", "64 GPUs a node"]);
    let m = write_temp("deep.yaml", "name: m\nlayers: 100000000\nhidden: 1024\nheads: 16\nseq_len: 512\nvocab: 8000\n");
    refused(&["plan", "--cluster", "examples/lab.yaml", "--model", m.to_str().unwrap()], &["deep.yaml", "layers: 100000000", "4096"]);
    let lab = ["plan", "--cluster", "examples/lab.yaml", "--model", "gpt3-1.3b"];
    let with = |extra: &[&'static str]| [&lab[..], extra].concat();
    refused(&with(&["--global-batch", "100000000"]), &["--global-batch: 100000000 is more than"]);
    refused(&with(&["--global-batch", "1048576", "--micro-batch", "131072"]), &["--micro-batch: 131072 is more than"]);
    refused(&with(&["--seq-len", "100000000"]), &["--seq-len: 100000000 is more than"]);
    refused(&with(&["--max-stages", "100000"]), &["--max-stages", "at most 4096"]);
}

#[test]
fn a_plan_on_emulated_gpus_says_so_and_a_bad_share_names_the_field() {
    let cluster = |emulate: &str| {
        format!(
            "name: emu\nnodes:\n  - {{name: fast, gpu: A100-80G, gpus: 2{emulate}}}\n  - {{name: slow, gpu: V100-32G, gpus: 2{emulate}}}\n"
        )
    };
    let real = write_temp("emu-real.yaml", &cluster(""));
    let v = json(&["plan", "--cluster", real.to_str().unwrap(), "--model", "gpt3-1.3b", "--global-batch", "16"]);
    assert!(v.get("emulated").is_none(), "a plan on real GPUs says nothing of emulation");
    let emu = write_temp("emu.yaml", &cluster(", emulate: {cpu: 0.3}"));
    let v = json(&["plan", "--cluster", emu.to_str().unwrap(), "--model", "gpt3-1.3b", "--global-batch", "16"]);
    assert_eq!(v["emulated"], true);
    check_contract(&v, 24);
    let text =
        String::from_utf8(motley(&["plan", "--cluster", emu.to_str().unwrap(), "--model", "gpt3-1.3b", "--global-batch", "16"]).stdout)
            .unwrap();
    assert!(text.contains("emulated"), "{text}");
    for bad in ["0", "-0.5", "65", ".nan"] {
        let f = write_temp("emu-bad.yaml", &cluster(&format!(", emulate: {{cpu: {bad}}}")));
        let out = motley(&["plan", "--cluster", f.to_str().unwrap(), "--model", "gpt3-1.3b"]);
        let err = String::from_utf8(out.stderr).unwrap();
        assert_eq!(out.status.code(), Some(2), "{bad}: {err}");
        assert!(err.contains("nodes[0].emulate.cpu"), "{bad}: {err}");
    }
    let f = write_temp("emu-typo.yaml", &cluster(", emulate: {cpus: 0.3}"));
    let err = String::from_utf8(motley(&["plan", "--cluster", f.to_str().unwrap(), "--model", "gpt3-1.3b"]).stderr).unwrap();
    assert!(err.contains("cpus"), "{err}");
}

/// The GPUs of every stage of a plan document, replica by replica: its shape, which `--price`
/// keeps.
fn stage_gpus(v: &serde_json::Value) -> Vec<serde_json::Value> {
    v["replicas"].as_array().unwrap().iter().flat_map(|r| r["stages"].as_array().unwrap().iter().map(|s| s["gpus"].clone())).collect()
}

#[test]
fn a_plan_priced_as_given_keeps_its_shape_and_takes_its_price_from_the_inputs() {
    let lab = ["plan", "--cluster", "examples/lab.yaml", "--model", "llama-13b"];
    let megatron = json(&[&lab[..], &["--baseline", "megatron"]].concat());
    let file = write_temp("priced-megatron.json", &serde_json::to_string(&megatron).unwrap());
    let file = file.to_str().unwrap();
    // The same inputs: the same plan at the same price, searched by nobody.
    let again = json(&[&lab[..], &["--price", file]].concat());
    check_contract(&again, 40);
    assert_eq!(again["search"]["mode"], "given");
    assert_eq!(stage_gpus(&again), stage_gpus(&megatron));
    let (t0, t1) = (megatron["iteration_time_s"].as_f64().unwrap(), again["iteration_time_s"].as_f64().unwrap());
    assert!((t1 - t0).abs() <= 1e-9 * t0, "{t1} against {t0}");
    // Slower devices (half the efficiency): the same plan, priced slower, not re-planned.
    let slow = json(&[&lab[..], &["--price", file, "--efficiency", "0.25"]].concat());
    assert_eq!(stage_gpus(&slow), stage_gpus(&megatron));
    assert!(slow["iteration_time_s"].as_f64().unwrap() > 1.3 * t0, "{slow} against {t0}");
    // The plan's settings are its own: its global batch is used, a contradicting flag refused.
    let other_batch = json(&[&lab[..], &["--price", file, "--global-batch", "512"]].concat());
    assert_eq!(other_batch["global_batch"], megatron["global_batch"]);
    let mb = megatron["micro_batch"].as_u64().unwrap();
    for (flag, value) in [("--micro-batch", (mb * 2).to_string()), ("--seq-len", "1024".to_string())] {
        let out = motley(&[&lab[..], &["--price", file, flag, &value]].concat());
        let err = String::from_utf8(out.stderr).unwrap();
        assert_eq!(out.status.code(), Some(2), "{flag}: {err}");
        assert!(err.contains(flag) && err.contains(&value) && err.contains(file), "{flag}: {err}");
    }
    let out = motley(&[&lab[..], &["--price", file, "--zero1"]].concat());
    let err = String::from_utf8(out.stderr).unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(err.contains("--zero1: given, but the plan"), "{err}");
    let out = motley(&[&lab[..], &["--price", file, "--baseline", "whale"]].concat());
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8(out.stderr).unwrap().contains("cannot be used with"));
    // A plan that is not this cluster's is refused naming the GPU's field and the file.
    let mut moved = megatron.clone();
    for g in moved["replicas"][0]["stages"][0]["gpus"].as_array_mut().unwrap() {
        g["node"] = "nowhere".into();
    }
    let moved_file = write_temp("priced-moved.json", &serde_json::to_string(&moved).unwrap());
    let out = motley(&[&lab[..], &["--price", moved_file.to_str().unwrap()]].concat());
    let err = String::from_utf8(out.stderr).unwrap();
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("replicas[0].stages[0].gpus[0].node") && err.contains("nowhere"), "{err}");
    let out = motley(&["replan", "--current", file, "--cluster", "examples/lab.yaml", "--model", "llama-13b", "--price", file]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8(out.stderr).unwrap().contains("--price: replan weighs"));
}
