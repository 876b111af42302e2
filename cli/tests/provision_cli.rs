//! `motley provision` as users and scripts call it: the real binary on the example offers,
//! the contract's JSON fields (the plan in `motley plan`'s shape), comparisons, the frontier,
//! and the errors for an SLO nobody meets or quotas too small for the model.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

fn motley(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_motley")).args(args).current_dir(repo()).env_remove("MOTLEY_OUTPUT").output().unwrap()
}

fn json_of(args: &[&str]) -> serde_json::Value {
    let out = motley(args);
    assert!(out.status.success(), "motley {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).expect("valid JSON")
}

const OFFERS: &str = "examples/espresso-offers.yaml";
const MODEL: &str = "examples/espresso/motley/llama-1.3b.yaml";

/// Espresso's offers with quotas of 4, 2, 4 and 4, written into a directory of the test's own
/// (`name`): the directory (removed by the caller) and the offers file.
fn small_quota_offers(name: &str) -> (PathBuf, String) {
    let dir = std::env::temp_dir().join(format!("motley-provision-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let text = std::fs::read_to_string(repo().join(OFFERS)).unwrap().replace("quota: 16", "quota: 4").replace("quota: 8", "quota: 2");
    let f = dir.join("offers.yaml");
    std::fs::write(&f, text).unwrap();
    let f = f.to_str().unwrap().to_string();
    (dir, f)
}

#[test]
fn provision_prints_allocation_plan_and_costs() {
    let v = json_of(&[
        "provision",
        "--offers",
        OFFERS,
        "--model",
        MODEL,
        "--global-batch",
        "64",
        "--slo",
        "20",
        "--iterations",
        "1000",
        "--compare",
        "-o",
        "json",
    ]);
    let t = v["iteration_time_s"].as_f64().unwrap();
    assert!(t <= 20.0);
    let price: f64 =
        v["allocation"].as_array().unwrap().iter().map(|a| a["gpus"].as_f64().unwrap() * a["price_per_gpu_hour"].as_f64().unwrap()).sum();
    assert!((v["price_per_hour"].as_f64().unwrap() - price).abs() < 1e-9);
    let cost = v["cost_per_iteration"].as_f64().unwrap();
    assert!((cost - t * price / 3600.0).abs() < 1e-12);
    assert!((v["total_cost"].as_f64().unwrap() - 1000.0 * cost).abs() < 1e-9);
    // The plan is `motley plan`'s document on the rented GPUs.
    let plan = &v["plan"];
    assert_eq!(plan["iteration_time_s"], v["iteration_time_s"]);
    assert_eq!(plan["gpus_total"], v["gpus"]);
    assert!(plan["replicas"][0]["stages"][0]["layers"].is_array());
    // Comparisons: never dearer than the best single-type allocation, which meets the SLO too.
    let h = &v["compare"]["homogeneous"];
    assert!(h["iteration_time_s"].as_f64().unwrap() <= 20.0);
    assert!(cost <= h["cost_per_iteration"].as_f64().unwrap() * (1.0 + 1e-12));
    assert_eq!(h["allocation"].as_array().unwrap().len(), 1);
    assert!(v["compare"]["espresso_placement"]["cost_per_iteration"].as_f64().unwrap() >= cost * (1.0 - 1e-12));
}

#[test]
fn the_oracle_agrees_on_smaller_quotas() {
    // Espresso's GPUs with quotas of 4, 2, 4 and 4 (374 allocations): the oracle plans each.
    let (dir, f) = small_quota_offers("oracle");
    let f = f.as_str();
    let base = ["provision", "--offers", f, "--model", MODEL, "--global-batch", "64", "--slo", "8", "-o", "json"];
    let o = json_of(&[&base[..], &["--exhaustive"]].concat());
    assert_eq!(o["search"]["planned"], o["search"]["allocations"]);
    for extra in [&[][..], &["--superset-bound"][..]] {
        let v = json_of(&[&base[..], extra].concat());
        assert_eq!(v["cost_per_iteration"], o["cost_per_iteration"], "{extra:?}");
        assert!(v["search"]["planned"].as_u64().unwrap() < o["search"]["planned"].as_u64().unwrap());
    }
    assert_eq!(json_of(&base)["search"]["allocation_search_exact"], true);
    assert_eq!(json_of(&[&base[..], &["--superset-bound"]].concat())["search"]["allocation_search_exact"], false);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn frontier_shows_what_a_looser_or_tighter_slo_costs() {
    // Espresso's GPUs with quotas of 4, 2, 4 and 4: a frontier of a dozen points in under a
    // second (the full quotas' takes half a minute and shows nothing more).
    let (dir, offers) = small_quota_offers("frontier");
    let offers = offers.as_str();
    let args = ["provision", "--offers", offers, "--model", MODEL, "--global-batch", "64", "--slo", "3", "--frontier", "--superset-bound"];
    let v = json_of(&[&args[..], &["-o", "json"]].concat());
    let f = v["frontier"].as_array().unwrap();
    assert!(f.len() >= 2, "{f:?}");
    // Sorted by time, each faster point dearer: a Pareto frontier.
    for w in f.windows(2) {
        assert!(w[0]["iteration_time_s"].as_f64() < w[1]["iteration_time_s"].as_f64());
        assert!(w[0]["cost_per_iteration"].as_f64() > w[1]["cost_per_iteration"].as_f64());
    }
    // A point slower than the SLO is cheaper than the optimum: what loosening it would save.
    let cost = v["cost_per_iteration"].as_f64().unwrap();
    assert!(f.iter().any(|p| p["iteration_time_s"].as_f64().unwrap() > 3.0 && p["cost_per_iteration"].as_f64().unwrap() < cost));
    let out = motley(&args);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("Pareto frontier"));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn impossible_slo_and_small_quotas_are_explained() {
    // Espresso's GPUs with quotas of 4, 2, 4 and 4.
    let dir = std::env::temp_dir().join(format!("motley-provision-slo-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let text = std::fs::read_to_string(repo().join(OFFERS)).unwrap().replace("quota: 16", "quota: 4").replace("quota: 8", "quota: 2");
    let f = dir.join("offers.yaml");
    std::fs::write(&f, text).unwrap();
    let f = f.to_str().unwrap();
    // Below even the compute bound of the whole quota: refused at once, with that bound.
    let out = motley(&["provision", "--offers", f, "--model", MODEL, "--global-batch", "64", "--slo", "1"]);
    assert_eq!(out.status.code(), Some(2));
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(e.contains("--slo") && e.contains("compute alone takes") && e.contains("raise --slo above"), "{e}");
    // Above the bound but faster than any plan: the fastest allocation planned and its cost.
    let out = motley(&["provision", "--offers", f, "--model", MODEL, "--global-batch", "64", "--slo", "1.6"]);
    assert_eq!(out.status.code(), Some(2));
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(
        e.contains("--slo") && e.contains("the fastest planned") && e.contains("per iteration") && e.contains("raise --slo to at least"),
        "{e}"
    );
    let dir = std::env::temp_dir().join(format!("motley-provision-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let small = dir.join("small.yaml");
    std::fs::write(&small, "name: tiny\noffers:\n  - {gpu: T4, price_per_gpu_hour: 0.3, quota: 2}\n").unwrap();
    let out = motley(&["provision", "--offers", small.to_str().unwrap(), "--model", "llama-7b", "--global-batch", "64", "--slo", "100"]);
    assert_eq!(out.status.code(), Some(2));
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(e.contains("GiB missing") && e.contains("quota"), "{e}");
}

#[test]
fn bad_offers_files_name_the_field() {
    let dir = std::env::temp_dir().join(format!("motley-provision-bad-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cases = [
        ("name: x\noffers:\n  - {gpu: Z80, price_per_gpu_hour: 1, quota: 4}\n", "offers[0].gpu"),
        ("name: x\noffers:\n  - {gpu: T4, price_per_gpu_hour: -1, quota: 4}\n", "offers[0].price_per_gpu_hour"),
        ("name: x\noffers:\n  - {gpu: T4, price_per_gpu_hour: 1, quota: 4, gpus_per_node: 8}\n", "offers[0].quota"),
        ("name: x\noffers:\n  - {gpu: T4, price_per_gpu_hour: 1}\n", "quota"),
        ("name: x\noffers:\n  - {gpu: T4, price_per_gpu_hour: 1, quota: 4, colour: red}\n", "colour"),
        ("name: x\noffers: []\n", "offers"),
        ("name: x\noffers:\n  - {gpu: T4, price_per_gpu_hour: 1, quo", "small.yaml"),
    ];
    for (i, (text, field)) in cases.iter().enumerate() {
        let f = dir.join(if i == cases.len() - 1 { "small.yaml".to_string() } else { format!("bad{i}.yaml") });
        std::fs::write(&f, text).unwrap();
        let out = motley(&["provision", "--offers", f.to_str().unwrap(), "--model", MODEL, "--global-batch", "64", "--slo", "10"]);
        assert_eq!(out.status.code(), Some(2), "{text}");
        let e = String::from_utf8_lossy(&out.stderr);
        assert!(e.contains(field), "{text}: {e}");
    }
    let out = motley(&["provision", "--offers", OFFERS, "--model", MODEL, "--global-batch", "64", "--slo", "-3"]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("--slo"));
}
