use super::*;
use crate::error::CoordinatorError;
use motley_checkpoint::manifest::{rank_file_name, unit_file_name};
use motley_checkpoint::{Block, Part as CkPart, UnitKey};
use motley_contract::{GpuRef, RankPlacement};
use motley_proto::v1::FetchSource;

const GEN: i64 = 3;

fn block_of(b: &str) -> Block {
    b.parse().unwrap()
}

fn unit_name(block: &str, part: &str, tp_rank: u32, tp_size: u32) -> String {
    unit_file_name(&UnitKey { block: block_of(block), part: part.parse::<CkPart>().unwrap(), tp_rank, tp_size })
}

/// One file of a step with no holder yet (`node`, `tier` empty).
#[allow(clippy::too_many_arguments)]
fn file(step: i64, name: &str, bytes: i64, block: &str, part: &str, tp: (u32, u32), rank: i64, layers: u32, world: u32) -> Holding {
    Holding {
        job_id: 1,
        generation: GEN,
        step,
        file: name.into(),
        node: String::new(),
        tier: String::new(),
        bytes,
        block: block.into(),
        part: part.into(),
        tp_rank: i64::from(tp.0),
        tp_size: i64::from(tp.1),
        rank,
        layers: i64::from(layers),
        world_size: i64::from(world),
        chunk_bytes: 1024,
        // One crc per 1 KiB chunk (any values: nothing here reads the bytes).
        crc32c: serde_json::to_string(&vec![name.len() as u64 + step as u64; (bytes as u64).div_ceil(1024) as usize]).unwrap(),
    }
}

/// Every file of a complete step (embed, layer.0..L-1, head; model and optimizer; `tp`
/// shards each; one rank file per rank of `world`), `bytes` each, not held anywhere yet.
fn step_files(step: i64, layers: u32, tp: u32, world: u32, bytes: i64) -> Vec<Holding> {
    let mut blocks = vec!["embed".to_string()];
    blocks.extend((0..layers).map(|l| format!("layer.{l}")));
    blocks.push("head".into());
    let mut out = vec![];
    for b in &blocks {
        for part in ["model", "optimizer"] {
            for r in 0..tp {
                out.push(file(step, &unit_name(b, part, r, tp), bytes, b, part, (r, tp), -1, layers, world));
            }
        }
    }
    for r in 0..world {
        out.push(file(step, &rank_file_name(r), bytes / 4, "", "", (0, 0), i64::from(r), layers, world));
    }
    out
}

/// Those files held on each of `held` (node, tier).
fn on(files: &[Holding], held: &[(&str, &str)]) -> Vec<Holding> {
    held.iter()
        .flat_map(|(node, tier)| files.iter().map(move |f| Holding { node: node.to_string(), tier: tier.to_string(), ..f.clone() }))
        .collect()
}

/// A complete step held on each of `held`.
fn step(step: i64, layers: u32, tp: u32, world: u32, held: &[(&str, &str)]) -> Vec<Holding> {
    on(&step_files(step, layers, tp, world, 4096), held)
}

fn live_of(names: &'static [&'static str]) -> impl Fn(&str) -> bool {
    move |n: &str| names.contains(&n)
}

// ---- choose_step

#[test]
fn choose_step_takes_the_newest_complete_step() {
    let mut all = step(10, 2, 2, 2, &[("n0", "disk")]);
    all.extend(step(20, 2, 2, 2, &[("n0", "memory"), ("n1", "disk")]));
    let newest: Vec<Holding> = all.iter().filter(|h| h.step == 20).cloned().collect();
    assert_eq!(choose_step(&all, &live_of(&["n0", "n1"])), StepChoice::Restore { step: 20, generation: GEN, files: newest });
}

#[test]
fn choose_step_skips_a_step_with_a_file_only_on_a_dead_node() {
    let mut all = step(10, 2, 2, 2, &[("n0", "disk"), ("n1", "disk")]);
    let lone = unit_name("layer.1", "optimizer", 1, 2);
    let mut twenty = step(20, 2, 2, 2, &[("n0", "memory"), ("n1", "memory")]);
    twenty.retain(|h| !(h.node == "n0" && h.file == lone));
    all.extend(twenty);
    // n1 is dead: step 20 misses one file; step 10 is whole on n0, and only n0's copies count.
    let ten_on_n0: Vec<Holding> = all.iter().filter(|h| h.step == 10 && h.node == "n0").cloned().collect();
    assert_eq!(ten_on_n0.len(), 4 * 2 * 2 + 2);
    assert_eq!(choose_step(&all, &live_of(&["n0"])), StepChoice::Restore { step: 10, generation: GEN, files: ten_on_n0 });
    // With n1 alive, step 20 is whole again.
    assert!(matches!(choose_step(&all, &live_of(&["n0", "n1"])), StepChoice::Restore { step: 20, .. }));
}

#[test]
fn choose_step_counts_cloud_copies_whatever_node_reported_them() {
    // n9 (dead) reported step 20 in the cloud and in its memory; n0 (live) holds step 10.
    let mut all = step(10, 1, 1, 1, &[("n0", "disk")]);
    all.extend(step(20, 1, 1, 1, &[("n9", "cloud"), ("n9", "memory")]));
    let cloud: Vec<Holding> = all.iter().filter(|h| h.step == 20 && h.tier == "cloud").cloned().collect();
    assert_eq!(choose_step(&all, &live_of(&["n0"])), StepChoice::Restore { step: 20, generation: GEN, files: cloud });
    // A tier that is neither memory, disk nor cloud is not readable.
    let odd = step(30, 1, 1, 1, &[("n0", "tape")]);
    assert_eq!(
        choose_step(&odd, &live_of(&["n0"])),
        StepChoice::Lost(
            "no checkpoint step has every file of one generation on a live node or in the cloud \
             (step 30: generation 3: no file of it is held)"
                .into()
        )
    );
}

#[test]
fn choose_step_takes_a_step_from_one_generation_never_a_mix() {
    // Generation 3 saved step 20 whole; generation 4 (restored from step 10, trained on) saved
    // step 20 again and lost a node mid-save: its copy lacks layer.1's optimizer shard 1.
    let lone = unit_name("layer.1", "optimizer", 1, 2);
    let g3 = step(20, 2, 2, 2, &[("n0", "disk")]);
    let g4: Vec<Holding> =
        step(20, 2, 2, 2, &[("n1", "memory")]).into_iter().filter(|h| h.file != lone).map(|h| Holding { generation: 4, ..h }).collect();
    let all: Vec<Holding> = g3.iter().chain(&g4).cloned().collect();
    // G+1 incomplete, G complete: G's copy, whole, and none of G+1's files.
    assert_eq!(choose_step(&all, &live_of(&["n0", "n1"])), StepChoice::Restore { step: 20, generation: GEN, files: g3.clone() });
    // Both complete: the newest generation.
    let g4_whole: Vec<Holding> = step(20, 2, 2, 2, &[("n1", "memory")]).into_iter().map(|h| Holding { generation: 4, ..h }).collect();
    let both: Vec<Holding> = g3.iter().chain(&g4_whole).cloned().collect();
    assert_eq!(choose_step(&both, &live_of(&["n0", "n1"])), StepChoice::Restore { step: 20, generation: 4, files: g4_whole });
    // Neither complete alone (G lacks the shard G+1 has, G+1 lacks another): not restorable,
    // although the union names every file.
    let other = unit_name("head", "model", 0, 2);
    let g3_part: Vec<Holding> = g3.iter().filter(|h| h.file != other).cloned().collect();
    let g4_part: Vec<Holding> =
        step(20, 2, 2, 2, &[("n1", "memory")]).into_iter().filter(|h| h.file != lone).map(|h| Holding { generation: 4, ..h }).collect();
    let mixed: Vec<Holding> = g3_part.into_iter().chain(g4_part).collect();
    match choose_step(&mixed, &live_of(&["n0", "n1"])) {
        StepChoice::Lost(why) => {
            assert!(why.contains("generation 4: step 20 is not restorable: unit layer.1 optimizer tp 1/2"), "{why}");
            assert!(why.contains("generation 3: step 20 is not restorable: unit head model tp 0/2"), "{why}");
            assert!(why.contains("whole only as a mix of generations, which is not restorable"), "{why}");
        }
        other => panic!("a step whole only as a mix of generations is not restorable: {other:?}"),
    }
}

#[test]
fn choose_step_skips_copies_without_crcs() {
    // Step 20's copies on n0 report no crcs (an agent of another version): they cannot be
    // verified, so step 10 is restored; the reason names what was skipped.
    let mut all = step(10, 1, 1, 1, &[("n0", "disk")]);
    all.extend(step(20, 1, 1, 1, &[("n0", "memory")]).into_iter().map(|h| Holding { crc32c: "[]".into(), ..h }));
    assert!(matches!(choose_step(&all, &live_of(&["n0"])), StepChoice::Restore { step: 10, .. }));
    let only: Vec<Holding> = all.into_iter().filter(|h| h.step == 20).collect();
    match choose_step(&only, &live_of(&["n0"])) {
        StepChoice::Lost(why) => assert!(
            why.contains("generation 3: no file of it is held (7 copies reported without a crc32c per chunk were skipped, e.g. "),
            "{why}"
        ),
        other => panic!("copies without crcs are not restorable: {other:?}"),
    }
}

#[test]
fn choose_step_without_reports_starts_fresh() {
    assert_eq!(choose_step(&[], &live_of(&["n0"])), StepChoice::Fresh);
}

#[test]
fn choose_step_lost_names_each_step_and_its_missing_file() {
    // Step 10 lacks rank 1's file; step 20's head optimizer shard 1 is on dead n1 only;
    // step 30 is on dead n1 only.
    let mut all = step(10, 2, 2, 2, &[("n0", "disk")]);
    all.retain(|h| h.file != rank_file_name(1));
    let shard = unit_name("head", "optimizer", 1, 2);
    let twenty = step(20, 2, 2, 2, &[("n0", "memory"), ("n1", "memory")]);
    all.extend(twenty.into_iter().filter(|h| !(h.node == "n0" && h.file == shard)));
    all.extend(step(30, 2, 2, 2, &[("n1", "disk")]));
    assert_eq!(
        choose_step(&all, &live_of(&["n0"])),
        StepChoice::Lost(
            "no checkpoint step has every file of one generation on a live node or in the cloud (\
             step 30: generation 3: no file of it is held; \
             step 20: generation 3: step 20 is not restorable: unit head optimizer tp 1/2 was never reported; restore the previous complete step; \
             step 10: generation 3: step 10 is not restorable: the rank file of rank 1 was never reported; restore the previous complete step)"
                .into()
        )
    );
}

// ---- needs

/// Rank `rank` on `node`'s GPU `gpu`: stage `stage` of `pp` (layers), TP rank of `tp`.
fn place(rank: u32, node: &str, gpu: u32, stage: u32, pp: u32, tp: (u32, u32), layers: [u32; 2]) -> (GpuRef, RankPlacement) {
    (
        GpuRef { node: node.into(), index: gpu },
        RankPlacement {
            rank,
            replica: 0,
            stage,
            tp_rank: tp.0,
            tp_size: tp.1,
            stage_dp_rank: 0,
            stage_dp_size: 1,
            pp_size: pp,
            replicas: 1,
            layers,
        },
    )
}

fn counts(names: &[String], n: u32) -> BTreeMap<String, u32> {
    names.iter().map(|f| (f.clone(), n)).collect()
}

/// The unit files of `blocks` (both parts) at TP shards `ranks` of `tp`.
fn units_of(blocks: &[&str], ranks: &[u32], tp: u32) -> Vec<String> {
    let mut out = vec![];
    for b in blocks {
        for part in ["model", "optimizer"] {
            for &r in ranks {
                out.push(unit_name(b, part, r, tp));
            }
        }
    }
    out
}

#[test]
fn needs_at_the_written_degree_are_each_ranks_own_shards() {
    let files = step(7, 4, 2, 4, &[("n0", "disk")]);
    let plan = [
        place(0, "n0", 0, 0, 2, (0, 2), [0, 2]),
        place(1, "n0", 1, 0, 2, (1, 2), [0, 2]),
        place(2, "n1", 0, 1, 2, (0, 2), [2, 4]),
        place(3, "n1", 1, 1, 2, (1, 2), [2, 4]),
    ];
    let got = needs(&files, &plan).unwrap();
    let mut n0 = units_of(&["embed", "layer.0", "layer.1"], &[0, 1], 2);
    n0.extend([rank_file_name(0), rank_file_name(1)]);
    let mut n1 = units_of(&["layer.2", "layer.3", "head"], &[0, 1], 2);
    n1.extend([rank_file_name(2), rank_file_name(3)]);
    let want: BTreeMap<String, NodeNeeds> = [
        ("n0".to_string(), NodeNeeds { files: counts(&n0, 1), make: vec![] }),
        ("n1".to_string(), NodeNeeds { files: counts(&n1, 1), make: vec![] }),
    ]
    .into();
    assert_eq!(got, want);

    // One rank per node: only its own TP shard; the rank without a rank file of its own
    // takes the lowest one.
    let plan = [place(0, "n0", 0, 0, 2, (1, 2), [0, 3]), place(5, "n1", 0, 1, 2, (0, 2), [3, 4])];
    let got = needs(&files, &plan).unwrap();
    let mut n0 = units_of(&["embed", "layer.0", "layer.1", "layer.2"], &[1], 2);
    n0.push(rank_file_name(0));
    let mut n1 = units_of(&["layer.3", "head"], &[0], 2);
    n1.push(rank_file_name(0));
    assert_eq!(got["n0"], NodeNeeds { files: counts(&n0, 1), make: vec![] });
    assert_eq!(got["n1"], NodeNeeds { files: counts(&n1, 1), make: vec![] });
    assert_eq!(got.len(), 2);
}

#[test]
fn needs_at_another_degree_fetch_every_written_shard_and_cut_once_per_tp_rank() {
    // Written at TP 2; the new plan runs TP 1 with two replicas of stage 0 on n0 (same TP rank),
    // and stage 1 on n1.
    let files = step(7, 4, 2, 4, &[("n0", "disk")]);
    let plan = [place(0, "n0", 0, 0, 2, (0, 1), [0, 2]), place(1, "n0", 1, 0, 2, (0, 1), [0, 2]), place(2, "n1", 0, 1, 2, (0, 1), [2, 4])];
    let got = needs(&files, &plan).unwrap();
    let make = |blocks: &[&str]| -> Vec<MakeUnit> {
        let mut out = vec![];
        for b in blocks {
            for part in ["model", "optimizer"] {
                out.push(MakeUnit {
                    file: unit_name(b, part, 0, 1),
                    sources: vec![unit_name(b, part, 0, 2), unit_name(b, part, 1, 2)],
                    tp_size: 1,
                    tp_rank: 0,
                });
            }
        }
        out
    };
    let mut n0 = counts(&units_of(&["embed", "layer.0", "layer.1"], &[0, 1], 2), 2);
    n0.insert(rank_file_name(0), 1);
    n0.insert(rank_file_name(1), 1);
    let mut n1 = counts(&units_of(&["layer.2", "layer.3", "head"], &[0, 1], 2), 1);
    n1.insert(rank_file_name(2), 1);
    assert_eq!(got["n0"], NodeNeeds { files: n0, make: make(&["layer.0", "layer.1", "embed"]) });
    assert_eq!(got["n1"], NodeNeeds { files: n1, make: make(&["layer.2", "layer.3", "head"]) });
    assert_eq!(got.len(), 2);
}

#[test]
fn needs_list_reslicing_sources_in_tp_order() {
    // TP 16 -> 4: names sort tp10 before tp2; the sources must not.
    let files = step(7, 1, 16, 1, &[("n0", "disk")]);
    let got = needs(&files, &[place(0, "n0", 0, 0, 1, (3, 4), [0, 1])]).unwrap();
    let m = &got["n0"].make;
    assert_eq!(m.len(), 6);
    assert_eq!(m[0].file, "layer.00000.model.tp3-4.safetensors");
    assert_eq!(m[0].sources, (0..16).map(|r| unit_name("layer.0", "model", r, 16)).collect::<Vec<_>>());
    assert_eq!((m[0].tp_size, m[0].tp_rank), (4, 3));
    assert_eq!(got["n0"].files.len(), 6 * 16 + 1);
}

#[test]
fn needs_refuse_a_checkpoint_without_a_unit_the_plan_loads() {
    let files = step(7, 2, 1, 1, &[("n0", "disk")]);
    match needs(&files, &[place(0, "n0", 0, 0, 1, (0, 1), [0, 3])]) {
        Err(CoordinatorError::Conflict(m)) => {
            assert_eq!(m, "the checkpoint has no layer.2 model unit, which rank 0 loads: it is of another model or plan")
        }
        other => panic!("expected a conflict, got {other:?}"),
    }
}

// ---- build

fn nodes(names: &[&str]) -> BTreeMap<String, NodeInfo> {
    names
        .iter()
        .map(|n| {
            let info =
                NodeInfo { data_url: format!("{n}:7000"), rdma_domain: None, disk_read_mb_s: 0.0, nic_mb_s: 0.0, mem_copy_mb_s: 0.0 };
            (n.to_string(), info)
        })
        .collect()
}

fn build_planned(files: &[Holding], plan: &[(GpuRef, RankPlacement)], live: &[&str]) -> Built {
    let n = needs(files, plan).unwrap();
    build(1, GEN + 1, files[0].step, files, &n, &nodes(live), 1200.0, "s3://b/job", Mode::Planned, 600).unwrap()
}

fn local() -> FetchSource {
    FetchSource { kind: "local".into(), ..Default::default() }
}

fn cloud() -> FetchSource {
    FetchSource { kind: "cloud".into(), tier: "cloud".into(), ..Default::default() }
}

fn peer(node: &str, tier: &str) -> FetchSource {
    FetchSource { kind: "peer".into(), node: node.into(), data_url: format!("{node}:7000"), tier: tier.into(), ..Default::default() }
}

/// Every file's ranges, sorted, cover [0, bytes) with no gap and no overlap.
fn assert_tiles(b: &Built) {
    for (node, r) in &b.restores {
        for f in &r.files {
            let mut at = 0;
            for x in &f.ranges {
                assert_eq!(x.offset, at, "{node} {}: {:?}", f.file, f.ranges);
                assert!(x.bytes > 0, "{node} {}: an empty range", f.file);
                at += x.bytes;
            }
            assert_eq!(at, f.bytes, "{node} {}: the ranges end at {at}", f.file);
        }
    }
}

/// (node, file, source) of every range, by bytes.
fn sources(b: &Built) -> BTreeMap<(String, String), Vec<(FetchSource, u64)>> {
    let mut out: BTreeMap<(String, String), Vec<(FetchSource, u64)>> = BTreeMap::new();
    for (node, r) in &b.restores {
        for f in &r.files {
            for x in &f.ranges {
                out.entry((node.clone(), f.file.clone())).or_default().push((x.source.clone().unwrap(), x.bytes));
            }
        }
    }
    out
}

/// The one source of every range of `node`'s `file` (a local read's tier left out: planned
/// ranges do not name it, gaps filled from the local fallback do).
fn only_source(b: &Built, node: &str, file: &str) -> FetchSource {
    let mut s = sources(b)[&(node.to_string(), file.to_string())].clone();
    for (x, _) in &mut s {
        if x.kind == "local" {
            x.tier.clear();
        }
    }
    let first = s[0].0.clone();
    assert!(s.iter().all(|(x, _)| *x == first), "{node} {file}: one source, got {s:?}");
    first
}

#[test]
fn build_reads_what_a_node_holds_from_itself() {
    // In its memory (and in the cloud): all of it from memory, nothing from peers or the cloud.
    let files = step(7, 2, 1, 1, &[("n0", "memory"), ("n1", "disk"), ("n0", "cloud")]);
    let b = build_planned(&files, &[place(0, "n0", 0, 0, 1, (0, 1), [0, 2])], &["n0", "n1"]);
    assert_tiles(&b);
    let r = &b.restores["n0"];
    assert_eq!((r.job, r.generation, r.step, r.cloud_url.as_str(), r.timeout_s), (1, GEN + 1, 7, "s3://b/job", 600));
    assert_eq!(r.files.len(), 4 * 2 + 1);
    let own = FetchSource { kind: "local".into(), tier: "memory".into(), ..Default::default() };
    for f in &r.files {
        assert_eq!(only_source(&b, "n0", &f.file), local(), "{}", f.file);
        assert_eq!(f.fallbacks, [own.clone(), peer("n1", "disk"), cloud()]);
        assert_eq!(f.copies, 1);
    }
    assert_eq!((b.plan.bytes.local, b.plan.bytes.peer, b.plan.bytes.cloud), (8 * 4096, 0, 0));
    // On its disk only: from its disk.
    let files = step(7, 2, 1, 1, &[("n0", "disk")]);
    let b = build_planned(&files, &[place(0, "n0", 0, 0, 1, (0, 1), [0, 2])], &["n0"]);
    assert_tiles(&b);
    for f in &b.restores["n0"].files {
        assert_eq!(only_source(&b, "n0", &f.file), local(), "{}", f.file);
        assert_eq!(f.fallbacks, [FetchSource { kind: "local".into(), tier: "disk".into(), ..Default::default() }]);
    }
    assert_eq!((b.plan.bytes.local, b.plan.bytes.peer, b.plan.bytes.cloud), (8 * 4096, 0, 0));
}

#[test]
fn build_fetches_from_a_live_peer_and_falls_back_on_every_holder_then_the_cloud() {
    // n1 holds the step in memory, n0 on disk, n9 (dead) in memory, the cloud too; n2 needs it.
    let files = step(7, 2, 1, 1, &[("n1", "memory"), ("n0", "disk"), ("n9", "memory"), ("n9", "cloud")]);
    let usable: Vec<Holding> = files.iter().filter(|h| h.node != "n9" || h.tier == "cloud").cloned().collect();
    let b = build_planned(&usable, &[place(0, "n2", 0, 0, 1, (0, 1), [0, 2])], &["n0", "n1", "n2"]);
    assert_tiles(&b);
    let r = &b.restores["n2"];
    assert_eq!(r.files.len(), 9);
    for f in &r.files {
        assert_eq!(only_source(&b, "n2", &f.file), peer("n1", "memory"), "{}", f.file);
        assert_eq!(f.fallbacks, [peer("n1", "memory"), peer("n0", "disk"), cloud()], "{}", f.file);
    }
    assert_eq!((b.plan.bytes.local, b.plan.bytes.peer, b.plan.bytes.cloud), (0, 8 * 4096, 0));
    assert_eq!(b.restores.keys().collect::<Vec<_>>(), ["n2"], "holders that need nothing get no instruction");

    // Only a peer's disk, not in the cloud: from it, with no cloud fallback.
    let files = step(7, 2, 1, 1, &[("n1", "disk")]);
    let b = build_planned(&files, &[place(0, "n2", 0, 0, 1, (0, 1), [0, 2])], &["n1", "n2"]);
    assert_tiles(&b);
    for f in &b.restores["n2"].files {
        assert_eq!(only_source(&b, "n2", &f.file), peer("n1", "disk"));
        assert_eq!(f.fallbacks, [peer("n1", "disk")]);
    }
}

#[test]
fn peers_of_one_rdma_domain_with_devices_are_read_over_rdma() {
    let files = step(7, 2, 1, 1, &[("n1", "memory"), ("n0", "disk")]);
    let plan = [place(0, "n2", 0, 0, 1, (0, 1), [0, 2])];
    let n = needs(&files, &plan).unwrap();
    let mut live = nodes(&["n0", "n1", "n2"]);
    for (name, domain) in [("n1", "ib0"), ("n2", "ib0"), ("n0", "roce1")] {
        live.get_mut(name).unwrap().rdma_domain = Some(domain.into());
    }
    let b = build(1, GEN + 1, 7, &files, &n, &live, 1200.0, "", Mode::Planned, 600).unwrap();
    for f in &b.restores["n2"].files {
        for r in &f.ranges {
            let s = r.source.as_ref().unwrap();
            assert_eq!(s.transport, if s.node == "n1" { "rdma" } else { "" }, "{}: {s:?}", f.file);
        }
        let by_node: BTreeMap<&str, &str> = f.fallbacks.iter().map(|s| (s.node.as_str(), s.transport.as_str())).collect();
        assert_eq!((by_node["n1"], by_node["n0"]), ("rdma", ""), "another domain is read over TCP");
    }
    // No device on the destination: TCP.
    live.get_mut("n2").unwrap().rdma_domain = None;
    let b = build(1, GEN + 1, 7, &files, &n, &live, 1200.0, "", Mode::Planned, 600).unwrap();
    assert!(b.restores["n2"].files.iter().flat_map(|f| &f.fallbacks).all(|s| s.transport.is_empty()));
}

#[test]
fn build_fetches_from_the_cloud_what_no_live_node_holds() {
    // The step is in the cloud; the only node copy is on dead n9 (choose_step left it out).
    let files = step(7, 2, 1, 1, &[("n9", "cloud")]);
    let b = build_planned(&files, &[place(0, "n0", 0, 0, 1, (0, 1), [0, 2])], &["n0"]);
    assert_tiles(&b);
    for f in &b.restores["n0"].files {
        assert_eq!(only_source(&b, "n0", &f.file), cloud(), "{}", f.file);
        assert_eq!(f.fallbacks, [cloud()]);
    }
    assert_eq!((b.plan.bytes.local, b.plan.bytes.peer, b.plan.bytes.cloud), (0, 0, 8 * 4096));
}

#[test]
fn build_never_fetches_from_the_cloud_a_file_that_is_not_there() {
    // A step half uploaded: the units of layer 0 are only in the cloud (their node died), the
    // rest only on n1's slow disk: the cloud is faster, but has none of those.
    let mut files = vec![];
    for h in step_files(7, 2, 1, 1, 1 << 20) {
        let tier = if h.block == "layer.0" { "cloud" } else { "disk" };
        files.push(Holding { node: "n1".into(), tier: tier.into(), ..h });
    }
    let n = needs(&files, &[place(0, "n0", 0, 0, 1, (0, 1), [0, 2])]).unwrap();
    let mut live = nodes(&["n0", "n1"]);
    live.get_mut("n1").unwrap().disk_read_mb_s = 1.0;
    let b = build(1, GEN + 1, 7, &files, &n, &live, 1200.0, "s3://b/job", Mode::Planned, 600).unwrap();
    assert_tiles(&b);
    for f in &b.restores["n0"].files {
        let want = if f.file.starts_with("layer.00000.") { cloud() } else { peer("n1", "disk") };
        assert_eq!(only_source(&b, "n0", &f.file), want, "{}", f.file);
        assert_eq!(f.fallbacks, [want]);
    }
}

#[test]
fn build_tiles_files_of_uneven_lengths_across_degrees() {
    // Written at TP 2 with shards of slightly different lengths, some on n0, some on n1, all
    // in the cloud; restored at TP 1 on n0, n1 and n2.
    let mut files = vec![];
    for (i, h) in step_files(7, 3, 2, 2, 5000).into_iter().enumerate() {
        let bytes = h.bytes - (i as i64 % 7) * 3;
        let node = if i % 3 == 0 { "n0" } else { "n1" };
        files.push(Holding { node: node.into(), tier: if i % 2 == 0 { "memory" } else { "disk" }.into(), bytes, ..h.clone() });
        files.push(Holding { node: "n8".into(), tier: "cloud".into(), bytes, ..h });
    }
    let plan = [place(0, "n0", 0, 0, 2, (0, 1), [0, 1]), place(1, "n1", 0, 1, 2, (0, 1), [1, 3]), place(2, "n2", 0, 1, 2, (0, 1), [1, 3])];
    let b = build_planned(&files, &plan, &["n0", "n1", "n2"]);
    assert_tiles(&b);
    assert_eq!(b.restores["n0"].files.len(), 2 * 2 * 2 + 1);
    assert_eq!(b.restores["n2"].files.len(), 3 * 2 * 2 + 1);
}

#[test]
fn build_copies_crcs_chunks_and_the_writers_generation() {
    // n0's copies reported no crcs: never a source; n1's did: the restore checks against them.
    let all = step_files(7, 1, 1, 1, 4096);
    let mut files = vec![];
    for h in &all {
        files.push(Holding { node: "n0".into(), tier: "disk".into(), chunk_bytes: 0, crc32c: "[]".into(), ..h.clone() });
        files.push(Holding { node: "n1".into(), tier: "disk".into(), ..h.clone() });
    }
    let b = build_planned(&files, &[place(0, "n2", 0, 0, 1, (0, 1), [0, 1])], &["n0", "n1", "n2"]);
    let r = &b.restores["n2"];
    assert_eq!(r.files.len(), all.len());
    for f in &r.files {
        let h = all.iter().find(|h| h.file == f.file).unwrap();
        assert_eq!((f.source_generation, f.bytes, f.chunk_bytes), (GEN, 4096 * (1 + u64::from(h.rank < 0) * 3) / 4, 1024), "{}", f.file);
        assert_eq!(f.crc32c, h.file_entry().crc32c, "{}", f.file);
        assert!(!f.crc32c.is_empty());
        assert!(f.fallbacks.iter().chain(f.ranges.iter().filter_map(|r| r.source.as_ref())).all(|s| s.node != "n0"), "{f:?}");
    }
}

#[test]
fn build_fetches_each_missing_byte_from_the_cloud_once_and_fans_it_out() {
    // Written at TP 2 on a node now dead, in the cloud; two replicas at TP 2, one per node:
    // each node needs both shards of every unit.
    let files = step(7, 2, 2, 4, &[("n9", "cloud")]);
    let plan = [
        place(0, "n0", 0, 0, 1, (0, 2), [0, 2]),
        place(1, "n0", 1, 0, 1, (1, 2), [0, 2]),
        place(2, "n1", 0, 0, 1, (0, 2), [0, 2]),
        place(3, "n1", 1, 0, 1, (1, 2), [0, 2]),
    ];
    let b = build_planned(&files, &plan, &["n0", "n1"]);
    assert_tiles(&b);
    let unit_bytes: u64 = 4 * 2 * 2 * 4096;
    assert_eq!(b.plan.bytes.cloud, unit_bytes, "each byte once from the cloud");
    assert_eq!(b.plan.bytes.peer, unit_bytes, "then from the node that has it");
    // The instructions do as planned: every unit byte from the cloud once, whichever node.
    let mut from_cloud: BTreeMap<String, u64> = BTreeMap::new();
    for ((_, file), s) in sources(&b) {
        for (src, bytes) in s {
            if src.kind == "cloud" && !file.starts_with("rank.") {
                *from_cloud.entry(file.clone()).or_default() += bytes;
            }
        }
    }
    assert_eq!(from_cloud.len(), 16);
    assert!(from_cloud.values().all(|b| *b == 4096), "{from_cloud:?}");
    // Reads no plan paced (fallbacks) share the 1200 MB/s egress between the two nodes.
    assert!(
        b.restores.values().all(|r| r.cloud_share_mb_s == 600.0),
        "{:?}",
        b.restores.values().map(|r| r.cloud_share_mb_s).collect::<Vec<_>>()
    );
}

#[test]
fn build_cloud_only_fetches_a_copy_per_rank_and_refuses_a_step_not_all_in_the_cloud() {
    let files = step(7, 2, 1, 3, &[("n0", "disk"), ("n0", "cloud")]);
    let plan = [place(0, "n0", 0, 0, 1, (0, 1), [0, 2]), place(1, "n0", 1, 0, 1, (0, 1), [0, 2]), place(2, "n1", 0, 0, 1, (0, 1), [0, 2])];
    let n = needs(&files, &plan).unwrap();
    let b = build(1, GEN + 1, 7, &files, &n, &nodes(&["n0", "n1"]), 1200.0, "s3://b/job", Mode::CloudOnly, 600).unwrap();
    assert_tiles(&b);
    for (node, r) in &b.restores {
        for f in &r.files {
            assert_eq!(f.ranges.len(), 1);
            assert_eq!(f.ranges[0].source, Some(cloud()), "{node} {}", f.file);
            assert!(f.ranges[0].rate_mb_s > 0.0);
            let want = if f.file.starts_with("rank.") || node == "n1" { 1 } else { 2 };
            assert_eq!(f.copies, want, "{node} {}", f.file);
        }
    }
    let names =
        |node: &str| b.restores[node].files.iter().filter(|f| f.file.starts_with("rank.")).map(|f| f.file.clone()).collect::<Vec<_>>();
    assert_eq!(names("n0"), [rank_file_name(0), rank_file_name(1)]);
    assert_eq!(names("n1"), [rank_file_name(2)]);
    // One file not in the cloud: refused.
    let mut partial = files.clone();
    let gone = unit_name("head", "optimizer", 0, 1);
    partial.retain(|h| !(h.tier == "cloud" && h.file == gone));
    match build(1, GEN + 1, 7, &partial, &n, &nodes(&["n0", "n1"]), 1200.0, "", Mode::CloudOnly, 600) {
        Err(CoordinatorError::Conflict(m)) => assert_eq!(m, "step 7 is not whole in the cloud: a cloud-only restore cannot read it"),
        other => panic!("expected a refusal, got {other:?}"),
    }
}
