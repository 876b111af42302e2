//! The job file's parsing and validation.

use super::*;

const GOOD: &str = "name: hello\nmodel: gpt3-1.3b\nglobal_batch: 16\nrun: python train.py\nenvs: {DATA: /data}\n";

#[test]
fn a_good_file_parses() {
    let j = JobSpec::parse(GOOD).unwrap();
    assert_eq!((j.name.as_str(), j.global_batch, j.max_restarts), ("hello", 16, 0));
    assert_eq!(j.model().unwrap().spec.name, "gpt3-1.3b");
}

#[test]
fn a_hugging_face_directory_is_a_model_read_once() {
    let dir = std::env::temp_dir().join(format!("motley-hf-{}", std::process::id())).join("Tiny-Llama");
    std::fs::create_dir_all(&dir).unwrap();
    let config = r#"{"architectures": ["LlamaForCausalLM"], "hidden_size": 256, "intermediate_size": 688,
        "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 2, "vocab_size": 1000,
        "max_position_embeddings": 512, "rope_theta": 500000.0, "tie_word_embeddings": true}"#;
    std::fs::write(dir.join("config.json"), config).unwrap();
    for given in [dir.clone(), dir.join("config.json")] {
        let j = JobSpec::parse(&GOOD.replace("gpt3-1.3b", given.to_str().unwrap())).unwrap();
        let ModelRef::Spec(s) = &j.model else { panic!("the job keeps the spec inline: {:?}", j.model) };
        assert_eq!(
            (s.name.as_str(), s.family, s.layers, s.kv_heads, s.tie_embeddings),
            ("Tiny-Llama", motley_solver::model::Family::Llama, 2, Some(2), true)
        );
        let m = resolve_model(&ModelRef::Name(given.to_str().unwrap().into()), Some(256), "seq_len").unwrap();
        assert_eq!((m.spec.rope_theta, m.seq_len), (5e5, 256));
    }
    std::fs::write(dir.join("config.json"), config.replace("LlamaForCausalLM", "GPT2LMHeadModel")).unwrap();
    let e = JobSpec::parse(&GOOD.replace("gpt3-1.3b", dir.to_str().unwrap())).unwrap_err().to_string();
    assert!(e.starts_with("model: ") && e.contains("config.json: architectures: 'GPT2LMHeadModel'"), "{e}");
    std::fs::remove_file(dir.join("config.json")).unwrap();
    let e = JobSpec::parse(&GOOD.replace("gpt3-1.3b", dir.to_str().unwrap())).unwrap_err().to_string();
    assert!(e.contains("config.json: no such file"), "{e}");
    std::fs::remove_dir_all(dir.parent().unwrap()).unwrap();
}

#[test]
fn bad_files_name_the_field() {
    let err = |t: &str| JobSpec::parse(t).unwrap_err().to_string();
    assert!(err("name: x\nglobal_batch: 1\nrun: a\n").contains("missing field `model`"));
    assert!(err(&GOOD.replace("global_batch: 16", "global_batch: 0")).starts_with("global_batch:"));
    assert!(err(&GOOD.replace("gpt3-1.3b", "gpt-9000")).starts_with("model: unknown model 'gpt-9000'"));
    assert!(err(&GOOD.replace("DATA", "RANK")).starts_with("envs.RANK: is set by the agent"));
    assert!(err(&GOOD.replace("DATA", "MOTLEY_X")).starts_with("envs.MOTLEY_X"));
    assert!(err(&GOOD.replace("DATA", "1BAD")).starts_with("envs.1BAD: is not a valid"));
    assert!(err(&format!("{GOOD}colour: red\n")).contains("unknown field `colour`"));
    assert!(err(&GOOD.replace("python train.py", "\"  \"")).starts_with("run:"));
}

#[test]
fn checkpoint_fields_reach_the_ranks_and_bad_ones_are_named() {
    let err = |t: &str| JobSpec::parse(t).unwrap_err().to_string();
    let spec = JobSpec::parse(&format!("{GOOD}checkpoint: {{every: 50}}\n")).unwrap();
    let envs = spec.launch_envs();
    assert_eq!((envs["MOTLEY_CKPT_EVERY"].as_str(), envs["MOTLEY_CKPT_KEEP"].as_str()), ("50", "2"));
    assert_eq!(envs["DATA"], "/data");
    assert!(!envs.contains_key("MOTLEY_CKPT_CLOUD"));
    assert!(!JobSpec::parse(GOOD).unwrap().launch_envs().contains_key("MOTLEY_CKPT_EVERY"));
    let spec = JobSpec::parse(&format!("{GOOD}checkpoint: {{every: 5, keep: 3, cloud: 'file:///srv/ckpt'}}\n")).unwrap();
    let envs = spec.launch_envs();
    assert_eq!((envs["MOTLEY_CKPT_KEEP"].as_str(), envs["MOTLEY_CKPT_CLOUD"].as_str()), ("3", "file:///srv/ckpt"));
    JobSpec::parse(&format!("{GOOD}checkpoint: {{every: 5, cloud: 's3://bucket/prefix'}}\n")).unwrap();
    assert!(err(&format!("{GOOD}checkpoint: {{every: 0}}\n")).starts_with("checkpoint.every:"));
    assert!(err(&format!("{GOOD}checkpoint: {{every: 5, keep: 0}}\n")).starts_with("checkpoint.keep: must be at least 1"));
    assert!(err(&format!("{GOOD}checkpoint: {{every: 5, cloud: 'ftp://x/y'}}\n")).starts_with("checkpoint.cloud: scheme 'ftp'"));
    assert!(err(&format!("{GOOD}checkpoint: {{every: 5, cloud: 'file://rel/dir'}}\n")).contains("absolute path"));
    assert!(err(&format!("{GOOD}checkpoint: {{every: 5, cloud: 's3://'}}\n")).contains("names no bucket"));
    assert!(err(&format!("{GOOD}checkpoint: {{evry: 5}}\n")).contains("evry"));
}

#[test]
fn the_coordinators_default_cloud_goes_only_to_a_job_that_checkpoints_and_names_none() {
    let cloud = |t: &str| {
        let spec = JobSpec::parse(t).unwrap().with_default_cloud(Some("file:///shared/state/cloud"));
        spec.checkpoint.and_then(|c| c.cloud)
    };
    assert_eq!(cloud(&format!("{GOOD}checkpoint: {{every: 5}}\n")).as_deref(), Some("file:///shared/state/cloud"));
    assert_eq!(cloud(&format!("{GOOD}checkpoint: {{every: 5, cloud: 's3://own/x'}}\n")).as_deref(), Some("s3://own/x"));
    assert_eq!(cloud(GOOD), None, "a job that does not checkpoint gets no cloud");
    let none = JobSpec::parse(&format!("{GOOD}checkpoint: {{every: 5}}\n")).unwrap().with_default_cloud(None);
    assert_eq!(none.checkpoint.unwrap().cloud, None);
    assert!(cloud_url("file://relative").is_err() && cloud_url("file:///abs").is_ok(), "the flag is checked as the field is");
}

#[test]
fn relaunch_budgets_need_a_checkpoint() {
    let err = |t: &str| JobSpec::parse(t).unwrap_err().to_string();
    assert!(err(&format!("{GOOD}max_preemptions: 2\n")).starts_with("max_preemptions: a relaunch resumes"));
    assert!(err(&format!("{GOOD}max_restarts: 1\n")).starts_with("max_restarts: a relaunch resumes"));
    let j = JobSpec::parse(&format!("{GOOD}max_restarts: 1\nmax_preemptions: 3\ncheckpoint: {{every: 10}}\n")).unwrap();
    assert_eq!((j.max_restarts, j.max_preemptions), (1, 3));
}

#[test]
fn plan_options_pin_the_planners_flags_and_name_bad_ones() {
    let j = JobSpec::parse(&format!(
        "{GOOD}plan_options: {{tp: 2, max_stages: 4, micro_batch: 2, seq_len: 512, search: exact, recompute: true}}\n"
    ))
    .unwrap();
    let (opts, mode) = j.plan_options().unwrap();
    assert_eq!((opts.tp, opts.max_stages, opts.micro_batch, opts.recompute, mode), (Some(2), 4, Some(2), true, SearchMode::Exact));
    assert_eq!((opts.global_batch, opts.reserve_gib), (16, PlanOptions::default().reserve_gib), "the rest: the job's batch, the defaults");
    assert_eq!(j.model().unwrap().seq_len, 512, "seq_len overrides the model's");
    let (opts, mode) = JobSpec::parse(GOOD).unwrap().plan_options().unwrap();
    assert_eq!((opts.tp, mode), (None, SearchMode::Auto));
    let err = |t: &str| JobSpec::parse(&format!("{GOOD}plan_options: {t}\n")).unwrap_err().to_string();
    assert!(err("{tp: 3}").starts_with("plan_options.tp: must be a power of two"), "{}", err("{tp: 3}"));
    assert!(err("{micro_batch: 0}").starts_with("plan_options.micro_batch:"));
    assert!(err("{efficiency: 1.5}").starts_with("plan_options.efficiency:"));
    assert!(err("{reserve_gib: -1}").starts_with("plan_options.reserve_gib:"));
    assert!(err("{host_layer_ms: -0.5}").starts_with("plan_options.host_layer_ms:"));
    let floor = JobSpec::parse(&format!("{GOOD}plan_options: {{host_layer_ms: 0}}\n")).unwrap().plan_options().unwrap().0;
    assert_eq!((floor.host_layer_ms, opts.host_layer_ms), (0.0, motley_solver::cost::HOST_LAYER_MS));
    assert!(err("{max_stages: 100000}").starts_with("plan_options.max_stages:"));
    assert!(err("{seq_len: 0}").starts_with("plan_options.seq_len:"), "{}", err("{seq_len: 0}"));
    assert!(err("{search: thorough}").contains("search"));
    assert!(err("{tpp: 2}").contains("unknown field `tpp`"));
    let e = err("{precision: fp8}");
    assert!(e.contains("plan_options.precision: unknown variant `fp8`") && e.contains("auto"), "{e}");
}

#[test]
fn precision_is_auto_unless_pinned_and_auto_is_bf16_only_where_every_gpu_has_bf16_tensor_cores() {
    use motley_solver::{Cluster, ClusterSpec, Precision};
    let cluster = |gpus: &[&str]| {
        let nodes: Vec<String> =
            gpus.iter().enumerate().map(|(i, g)| format!("  - {{name: n{i}, gpu: {g}, gpus: 2, intra: nvlink}}\n")).collect();
        let spec: ClusterSpec = serde_norway::from_str(&format!("name: c\nnodes:\n{}", nodes.concat())).unwrap();
        Cluster::from_spec(&spec).unwrap()
    };
    let (a100, mixed) = (cluster(&["A100-80G", "A100-80G"]), cluster(&["A100-80G", "V100-32G"]));
    let j = JobSpec::parse(GOOD).unwrap();
    assert_eq!((j.precision(&a100), j.precision(&mixed)), (Precision::Bf16, Precision::Fp16));
    let j = JobSpec::parse(&format!("{GOOD}plan_options: {{precision: auto}}\n")).unwrap();
    assert_eq!(j.precision(&a100), Precision::Bf16);
    for (v, p) in [("fp16", Precision::Fp16), ("bf16", Precision::Bf16), ("fp32", Precision::Fp32)] {
        let j = JobSpec::parse(&format!("{GOOD}plan_options: {{precision: {v}}}\n")).unwrap();
        assert_eq!((j.precision(&a100), j.precision(&mixed)), (p, p), "{v} is kept");
    }
}

#[test]
fn a_carried_plan_agrees_with_its_job() {
    let plan = "plan: {global_batch: 16, micro_batch: 16, replicas: [{micro_batches: 1, stages: [{layers: [0, 24], gpu: A100-80G, tp: 1, dp: 1, gpus: [{node: a, index: 0}]}]}]}\n";
    let j = JobSpec::parse(&format!("{GOOD}{plan}")).unwrap();
    assert_eq!(j.plan.as_ref().unwrap().replicas[0].stages[0].gpus[0].node, "a");
    let err = |t: &str| JobSpec::parse(t).unwrap_err().to_string();
    assert!(err(&format!("{GOOD}{}", plan.replace("global_batch: 16", "global_batch: 8"))).starts_with("plan.global_batch: is 8"));
    assert!(err(&format!("{GOOD}{plan}plan_options: {{tp: 2}}\n")).starts_with("plan_options.tp: a job that carries its plan"));
    assert!(JobSpec::parse(&format!("{GOOD}{plan}plan_options: {{recompute: true}}\n")).is_ok(), "pricing options go with a plan");
    assert!(err(&format!("{GOOD}plan: {{global_batch: 16, micro_batch: 16, replicas: []}}\n")).starts_with("plan.replicas"));
}

#[test]
fn the_user_is_a_posix_user_name() {
    let with = |u: &str| JobSpec::parse(&format!("{GOOD}user: \"{u}\"\n"));
    for good in ["alice", "_svc", "a-b_9", "machine$", &"a".repeat(MAX_USER)] {
        assert_eq!(with(good).unwrap().user.as_deref(), Some(good));
    }
    assert_eq!(JobSpec::parse(GOOD).unwrap().user, None, "no user: none");
    for bad in ["", "Alice", "9lives", "-rf", "a b", "a$b", "root\\n", "é", &"a".repeat(MAX_USER + 1)] {
        let e = with(bad).unwrap_err().to_string();
        assert!(e.starts_with("user:"), "{bad:?}: {e}");
    }
    // Stored specs without the field read back, and a spec without a user stores none.
    let j = JobSpec::parse(GOOD).unwrap();
    assert!(!serde_json::to_string(&j).unwrap().contains("user"));
}

const PLAN: &str = "plan: {global_batch: 16, micro_batch: 16, replicas: [{micro_batches: 1, stages: [{layers: [0, 24], gpu: A100-80G, tp: 1, dp: 1, gpus: [{node: a, index: 0}]}]}]}\n";

#[test]
fn the_sequence_length_is_one_field_or_several_that_agree() {
    let seq = |extra: &str| JobSpec::parse(&format!("{GOOD}{extra}")).map(|j| j.model().unwrap().seq_len);
    assert_eq!(seq("").unwrap(), 2048, "the model's");
    assert_eq!(seq("seq_len: 512\n").unwrap(), 512);
    assert_eq!(seq("plan_options: {seq_len: 256}\n").unwrap(), 256);
    assert_eq!(seq("seq_len: 256\nplan_options: {seq_len: 256}\n").unwrap(), 256);
    let e = seq("seq_len: 512\nplan_options: {seq_len: 256}\n").unwrap_err().to_string();
    assert!(e.starts_with("plan_options.seq_len: is 256 but seq_len is 512"), "{e}");
    let e = seq("seq_len: 0\n").unwrap_err().to_string();
    assert!(e.starts_with("seq_len: "), "{e}");
    // Stored and read back.
    let j = JobSpec::parse(&format!("{GOOD}seq_len: 512\n")).unwrap();
    let back: JobSpec = serde_json::from_str(&serde_json::to_string(&j).unwrap()).unwrap();
    assert_eq!(back.model().unwrap().seq_len, 512);
    assert!(!serde_json::to_string(&JobSpec::parse(GOOD).unwrap()).unwrap().contains("seq_len"), "absent stays absent");
}

#[test]
fn a_carried_plans_sequence_length_is_run_or_refused_naming_both() {
    let with_seq = PLAN.replace("micro_batch: 16,", "micro_batch: 16, seq_len: 32,");
    let j = JobSpec::parse(&format!("{GOOD}{with_seq}")).unwrap();
    assert_eq!(j.plan.as_ref().unwrap().seq_len, Some(32));
    assert_eq!(j.model().unwrap().seq_len, 32, "the plan's 32, not the model's 2048");
    JobSpec::parse(&format!("{GOOD}seq_len: 32\n{with_seq}")).unwrap();
    let e = JobSpec::parse(&format!("{GOOD}seq_len: 64\n{with_seq}")).unwrap_err().to_string();
    assert!(e.starts_with("plan.seq_len: is 32 but seq_len is 64"), "{e}");
    let e = JobSpec::parse(&format!("{GOOD}plan_options: {{seq_len: 64}}\n{with_seq}")).unwrap_err().to_string();
    assert!(e.starts_with("plan.seq_len: is 32 but plan_options.seq_len is 64"), "{e}");
    // A plan without one runs at the job's (or the model's) length.
    assert_eq!(JobSpec::parse(&format!("{GOOD}seq_len: 64\n{PLAN}")).unwrap().model().unwrap().seq_len, 64);
}

#[test]
fn a_hugging_face_model_trains_at_the_stated_default_unless_the_job_says() {
    let dir = std::env::temp_dir().join(format!("motley-hf-seq-{}", std::process::id())).join("Llama-3.1-8B");
    std::fs::create_dir_all(&dir).unwrap();
    let config = r#"{"architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
        "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "vocab_size": 128256,
        "max_position_embeddings": 131072, "rope_theta": 500000.0}"#;
    std::fs::write(dir.join("config.json"), config).unwrap();
    let job = GOOD.replace("gpt3-1.3b", dir.to_str().unwrap());
    let m = JobSpec::parse(&job).unwrap().model().unwrap();
    assert_eq!((m.seq_len, m.spec.max_position_embeddings), (4096, Some(131072)), "not 131072");
    assert_eq!(JobSpec::parse(&format!("{job}seq_len: 8192\n")).unwrap().model().unwrap().seq_len, 8192);
    let e = JobSpec::parse(&format!("{job}seq_len: 131073\n")).unwrap_err().to_string();
    assert!(e.starts_with("seq_len: 131073 tokens is more than the model's max_position_embeddings (131072)"), "{e}");
    std::fs::remove_dir_all(dir.parent().unwrap()).unwrap();
}

#[test]
fn replan_that_can_never_act_is_refused_naming_what_stops_it() {
    let ckpt = "checkpoint: {every: 10}\n";
    for replan in ["replan: on\n", "replan: {hold: 5s}\n"] {
        let e = JobSpec::parse(&format!("{GOOD}{replan}")).unwrap_err().to_string();
        assert!(e.starts_with("replan: ") && e.contains("(checkpoint:)") && e.contains("add checkpoint"), "{e}");
        let e = JobSpec::parse(&format!("{GOOD}{ckpt}{PLAN}{replan}")).unwrap_err().to_string();
        assert!(e.starts_with("replan: ") && e.contains("(plan:)") && e.contains("never re-planned"), "{e}");
        JobSpec::parse(&format!("{GOOD}{ckpt}{replan}")).unwrap();
    }
    // Off, or left to the default, is no request.
    for fine in ["", "replan: off\n"] {
        JobSpec::parse(&format!("{GOOD}{fine}")).unwrap();
        JobSpec::parse(&format!("{GOOD}{ckpt}{PLAN}{fine}")).unwrap();
    }
}
