//! `motley plan --explain/--bandwidth` and `motley replan` as a user runs them: the real
//! binary, the example files, exit codes and the `comm_groups` JSON contract.

use crate::common;
use common::{json, motley, write_temp};

const HYBRID: [&str; 10] = [
    "--cluster",
    "examples/holmes/hybrid-4.yaml",
    "--model",
    "examples/holmes/gpt-3.6b.yaml",
    "--global-batch",
    "64",
    "--tp",
    "1",
    "--max-stages",
    "2",
];

#[test]
fn comm_groups_are_part_of_the_plan_json() {
    for cluster in ["examples/mixed-nics.yaml", "examples/lab.yaml", "examples/holmes/hybrid-4.yaml"] {
        let v = json(&["plan", "--cluster", cluster, "--model", "llama-7b", "--global-batch", "128"]);
        let groups = v["comm_groups"].as_array().expect("top-level comm_groups list");
        assert!(!groups.is_empty(), "{cluster}");
        for g in groups {
            let kind = g["kind"].as_str().unwrap();
            assert!(["tp", "pp", "dp"].contains(&kind), "{g}");
            let transport = g["transport"].as_str().unwrap();
            assert!(["nvlink", "pcie", "ib", "roce", "socket"].contains(&transport), "{g}");
            let gpus = g["gpus"].as_array().unwrap();
            assert!(gpus.len() >= 2);
            for gpu in gpus {
                assert!(gpu["node"].is_string() && gpu["index"].is_u64(), "{gpu}");
            }
            assert!(g["nics"].is_array());
            let env = g["env"].as_object().unwrap();
            assert!(!env.is_empty() && env.keys().all(|k| k.starts_with("NCCL_")) && env.values().all(|x| x.is_string()), "{g}");
            if ["ib", "roce", "socket"].contains(&transport) {
                assert!(!g["nics"].as_array().unwrap().is_empty(), "an inter-node group names its NICs: {g}");
            }
        }
    }
}

#[test]
fn explain_lists_every_group_with_its_link_and_nccl_settings() {
    let out = motley(&[
        "plan",
        "--cluster",
        "examples/holmes/hybrid-4.yaml",
        "--model",
        "examples/holmes/gpt-3.6b.yaml",
        "--global-batch",
        "768",
        "--explain",
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.contains("Communication groups"), "{text}");
    assert!(text.contains("NCCL_IB_HCA==mlx5_0:1"), "{text}");
    assert!(text.contains("NCCL_IB_GID_INDEX=3"), "RoCE ring: {text}");
    assert!(text.contains("NCCL_SOCKET_IFNAME==eth0"), "Ethernet hop: {text}");
    assert!(text.contains("s/iter"));
}

#[test]
fn measured_bandwidth_changes_the_plan_and_bad_files_name_the_field() {
    let nominal = json(&[&["plan"][..], &HYBRID[..]].concat());
    let halved = json(&[&["plan"][..], &HYBRID[..], &["--bandwidth", "examples/bandwidth/hybrid-4-ib-halved.yaml"][..]].concat());
    assert!(halved["iteration_time_s"].as_f64().unwrap() > nominal["iteration_time_s"].as_f64().unwrap());
    // A group joining the two InfiniBand nodes runs at 21.25 GB/s nominal, at no more than the
    // measured 10.6 after.
    let crossing = |v: &serde_json::Value| -> Vec<f64> {
        v["comm_groups"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|g| ["hybrid-0", "hybrid-1"].iter().all(|n| g["gpus"].as_array().unwrap().iter().any(|x| x["node"] == *n)))
            .map(|g| g["link_gb_per_s"].as_f64().unwrap())
            .collect()
    };
    assert!(crossing(&nominal).iter().any(|&b| (b - 21.25).abs() < 1e-9), "{:?}", crossing(&nominal));
    assert!(crossing(&halved).iter().all(|&b| b <= 10.6 + 1e-9), "{:?}", crossing(&halved));

    let bad = write_temp("bad-bw.yaml", "pairs:\n  - {a: hybrid-0, b: nowhere, gb_per_s: 3}\n");
    let out = motley(&[&["plan"][..], &HYBRID[..], &["--bandwidth", bad.to_str().unwrap()][..]].concat());
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("pairs[0].b: unknown node 'nowhere'"), "{err}");
    let typo = write_temp("typo-bw.yaml", "pairs:\n  - {a: hybrid-0, b: hybrid-1, gbps: 3}\n");
    let out = motley(&[&["plan"][..], &HYBRID[..], &["--bandwidth", typo.to_str().unwrap()][..]].concat());
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown field `gbps`"), "{}", String::from_utf8_lossy(&out.stderr));
}

#[test]
fn replan_says_whether_to_switch_and_what_moves() {
    let current = motley(&[&["plan"][..], &HYBRID[..], &["-o", "json"][..]].concat());
    assert!(current.status.success());
    let path = write_temp("current.json", &String::from_utf8(current.stdout).unwrap());
    let base =
        [&["replan", "--current", path.to_str().unwrap(), "--bandwidth", "examples/bandwidth/hybrid-4-ib-halved.yaml"][..], &HYBRID[..]]
            .concat();
    let v = json(&base);
    for field in ["current_planned_s", "current_now_s", "new_iteration_time_s", "gain", "switch_bytes", "switch_seconds"] {
        assert!(v[field].is_number(), "{field}: {v}");
    }
    assert!(v["worth_switching"].is_boolean() && v["reason"].is_string());
    assert!(v["current_now_s"].as_f64().unwrap() > v["current_planned_s"].as_f64().unwrap());
    assert!(v["new_iteration_time_s"].as_f64().unwrap() <= v["current_now_s"].as_f64().unwrap());
    assert!(!v["moves"].as_array().unwrap().is_empty());
    assert!(v["new_plan"]["comm_groups"].is_array());
    // A low enough bar makes the same change worth a switch.
    let eager = json(&[&base[..], &["--min-gain", "0.01"][..]].concat());
    assert_eq!(eager["worth_switching"], true, "{}", eager["reason"]);
    let table = motley(&[&base[..], &["--min-gain", "0.01"][..]].concat());
    let text = String::from_utf8(table.stdout).unwrap();
    assert!(text.starts_with("SWITCH: "), "{text}");
    assert!(text.contains("layers before"), "{text}");
    assert!(motley(&[&base[..], &["--min-gain", "-1"][..]].concat()).status.code() == Some(2));
}

#[test]
fn replan_refuses_a_plan_file_it_cannot_read() {
    let broken = write_temp("broken.json", "{\"global_batch\": 64, \"micro_batch\": 2, \"iteration_time_s\": 1.0}\n");
    let out = motley(&[&["replan", "--current", broken.to_str().unwrap()][..], &HYBRID[..]].concat());
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("missing field `replicas`"), "{err}");
}
