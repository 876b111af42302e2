//! `motley restore-plan --scenario FILE` (docs/restore.md): the example scenarios plan, the JSON
//! fields are the documented ones, bad input is one line naming the file and field, exit 2.

use crate::common;
use common::{json, motley, write_temp};

#[test]
fn the_example_plans_and_prints_the_contract_fields() {
    let p = json(&["restore-plan", "--scenario", "examples/restore/small.yaml"]);
    let lb = p["lower_bound_s"].as_f64().unwrap();
    let mk = p["makespan_s"].as_f64().unwrap();
    assert!(lb > 0.0 && mk >= lb * (1.0 - 1e-9), "{lb} {mk}");
    for k in ["local", "peer", "cloud"] {
        assert!(p["bytes"][k].is_u64(), "bytes.{k}");
    }
    assert!(p["bytes"]["cloud"].as_u64().unwrap() > 0, "layers 2-3 on no memory, the cloud helps n1's disk");
    let t = &p["transfers"][0];
    for k in ["from", "to", "kind", "tier", "relay", "layer", "part", "offset", "bytes", "source_shard", "rate_mb_s"] {
        assert!(!t[k].is_null() || k == "source_shard", "transfers[0].{k}: {t}");
    }
    let out = motley(&["restore-plan", "--scenario", "examples/restore/small.yaml"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && text.contains("lower bound") && text.contains("local disk"), "{text}");
    // AutoHet's scenario B: the last third is local, the rest comes from the cloud once.
    let b = json(&["restore-plan", "--scenario", "examples/restore/autohet-b-gpt3-6.7b.json"]);
    let ratio = b["cloud_only_s"].as_f64().unwrap() / b["makespan_s"].as_f64().unwrap();
    assert!((ratio - 3.0).abs() < 0.05, "{ratio}");
}

#[test]
fn bad_scenarios_exit_2_naming_the_file_and_field() {
    let cases = [
        ("cloud:\n  egress_mb_s: 0\n", "missing field `units`; add it"),
        (
            "cloud: {egress_mb_s: 0}\nunits: {layers: 1, layer: {model: 1, optimizer: 1}}\nnodes: [{name: a, nic_in_mb_s: 1, disk_read_mb_s: 1, mem_copy_mb_s: 1}]\ndemands: [{node: a, shards: [{layers: all}]}]\n",
            "cloud.egress_mb_s: 0 is not a rate",
        ),
        (
            "cloud: {egress_mb_s: 1}\nunits: {layers: 1, layer: {model: 1, optimizer: 1}}\nnodes: [{name: a, nic_in_mb_s: 1, disk_read_mb_s: 1, mem_copy_mb_s: 1}]\ndemands: [{node: b, shards: [{layers: all}]}]\n",
            "demands[0].node: 'b' is not in nodes",
        ),
        (
            "cloud: {egress_mb_s: 1}\nunits: {layers: 1, layer: {model: 1, optimizer: 1}}\nnodes: [{name: a, nic_in_mb_s: 1, disk_read_mb_s: 1, mem_copy_mb_s: 1, nic: 3}]\ndemands: []\n",
            "nodes[0]: unknown field `nic`",
        ),
    ];
    for (i, (text, want)) in cases.iter().enumerate() {
        let path = write_temp(&format!("restore-bad-{i}.yaml"), text);
        let out = motley(&["restore-plan", "--scenario", path.to_str().unwrap()]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{err}");
        assert!(err.contains(path.to_str().unwrap()) && err.contains(want), "want {want}: {err}");
        assert_eq!(err.trim().lines().count(), 1, "{err}");
    }
}
