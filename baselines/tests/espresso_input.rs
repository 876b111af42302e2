//! Espresso's own files (copied to examples/espresso) parse as they are, in the GPU table's
//! key order (Espresso's cost-tree levels), and bad files are refused with the field named.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use motley_baselines::espresso::{parse_gpu_table, parse_job, parse_model_config};

fn data() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/espresso")
}

fn specs() -> BTreeMap<String, String> {
    std::fs::read_dir(data().join("gpu/llm_analysis_gpu_configs"))
        .unwrap()
        .map(|e| {
            let p = e.unwrap().path();
            (p.file_name().unwrap().to_string_lossy().into_owned(), std::fs::read_to_string(&p).unwrap())
        })
        .collect()
}

#[test]
fn reads_espresso_files_as_they_are() {
    let text = std::fs::read_to_string(data().join("gpu/espresso_gpu_config.json")).unwrap();
    let t = parse_gpu_table(&text, "espresso_gpu_config.json", &specs()).unwrap();
    assert_eq!(t.names, ["a30-pcie-24gb", "a6000-pcie4-48gb", "a4000-pcie4-16gb", "3090-pcie4-24gb"]);
    assert_eq!(t.offers.iter().map(|o| o.cost).collect::<Vec<_>>(), [4.0, 6.0, 2.0, 2.5]);
    assert_eq!(t.specs[3].inter_node_bandwidth_in_gb_per_sec, 1.0);
    assert_eq!(t.specs[1].hbm_bandwidth_in_gb_per_sec, 768.0);

    let job = parse_job(&std::fs::read_to_string(data().join("jobs/upstream_examples/open_llama_3b_v2.json")).unwrap(), "job").unwrap();
    assert_eq!((job.num_layers, job.gradient_accumulation_steps, job.global_batch_size, job.seq_len), (26, 4, 64, 3000));
    for m in ["llama_1.3b", "llama_3b", "llama_7b", "ViT"] {
        let f = data().join(format!("jobs/this_run/{m}.model_config.json"));
        let c = parse_model_config(&std::fs::read_to_string(&f).unwrap(), m).unwrap();
        assert!(c.num_layers > 0 && c.hidden_dim > 0);
        let j = parse_job(&std::fs::read_to_string(data().join(format!("jobs/this_run/{m}.json"))).unwrap(), m).unwrap();
        assert_eq!(j.num_layers, c.num_layers);
    }
}

#[test]
fn bad_files_name_the_field() {
    let text = std::fs::read_to_string(data().join("gpu/espresso_gpu_config.json")).unwrap();
    let mut s = specs();
    s.remove("3090-pcie4-24gb.json");
    let e = parse_gpu_table(&text, "gpus", &s).unwrap_err().to_string();
    assert!(e.contains("3090-pcie4-24gb.json"), "{e}");
    let e = parse_gpu_table(&text.replace("\"cost\":4", "\"cost\":-4"), "gpus", &specs()).unwrap_err().to_string();
    assert!(e.contains("a30-pcie-24gb.cost"), "{e}");
    let job = std::fs::read_to_string(data().join("jobs/this_run/llama_3b.json")).unwrap();
    let e = parse_job(&job.replace("\"slo\": 100", "\"slo\": 0"), "job").unwrap_err().to_string();
    assert!(e.contains("slo"), "{e}");
    let e = parse_job(&job[..job.len() / 2], "job").unwrap_err().to_string();
    assert!(e.contains("cut short"), "{e}");
}
