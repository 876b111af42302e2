//! `--svg FILE` on `motley plan` and `motley replan`: the plan drawn as a picture, one block
//! per stage (`motley job plan ID --svg` is in remote_cli.rs, against a coordinator).

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

fn temp(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("motley-svg-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

fn stages(plan: &serde_json::Value) -> usize {
    plan["replicas"].as_array().unwrap().iter().map(|r| r["stages"].as_array().unwrap().len()).sum()
}

#[test]
fn plan_svg_draws_one_block_per_stage_and_keeps_stdout() {
    let path = temp("plan.svg");
    let args = [&["plan"][..], &HYBRID[..], &["--svg", path.to_str().unwrap(), "-o", "json"][..]].concat();
    let out = motley(&args);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let plan: serde_json::Value = serde_json::from_slice(&out.stdout).expect("stdout is still the plan");
    let svg = std::fs::read_to_string(&path).unwrap();
    assert!(svg.starts_with("<svg ") && svg.ends_with("</svg>\n"));
    assert_eq!(svg.matches(r#"<g class="stage""#).count(), stages(&plan));
    assert_eq!(svg.matches(r#"<g class="timeline""#).count(), plan["replicas"].as_array().unwrap().len().min(8));
    // The same plan draws the same bytes.
    assert!(motley(&args).status.success());
    assert_eq!(std::fs::read_to_string(&path).unwrap(), svg);
    // A file that cannot be written is named.
    let out = motley(&[&["plan"][..], &HYBRID[..], &["--svg", "/nonexistent/dir/p.svg"][..]].concat());
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--svg: cannot write /nonexistent/dir/p.svg"));
}

#[test]
fn replan_svg_draws_the_new_plan() {
    let current = json(&[&["plan"][..], &HYBRID[..]].concat());
    let file = write_temp("svg-current.json", &current.to_string());
    let path = temp("replan.svg");
    let base = [
        &["replan", "--current", file.to_str().unwrap(), "--bandwidth", "examples/bandwidth/hybrid-4-ib-halved.yaml"][..],
        &HYBRID[..],
        &["--svg", path.to_str().unwrap()][..],
    ]
    .concat();
    let v = json(&base);
    let svg = std::fs::read_to_string(&path).unwrap();
    assert_eq!(svg.matches(r#"<g class="stage""#).count(), stages(&v["new_plan"]));
}
