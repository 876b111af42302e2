//! Unit files, manifests and steps on disk, written with this crate's own writer: pieces merge
//! into a complete manifest, every crc verifies, corruption and missing units are named, and a
//! TP-2 step re-sliced to TP 1 and TP 4 holds the same full tensors (and the generation that
//! wrote it; shards of two generations are not cut together).

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

use motley_checkpoint::crc::{file_entry, verify_bytes};
use motley_checkpoint::manifest::{piece_file_name, rank_file_name, step_dir_name};
use motley_checkpoint::{
    reslice_step, shard_full, unshard, write_atomic, Block, CkptError, Dtype, Layout, Manifest, Part, RankEntry, TensorSpec, Unit, UnitKey,
    CHUNK_BYTES, FORMAT,
};

const LAYERS: u32 = 2;
const HIDDEN: u64 = 8;
const HEADS: u64 = 4;

fn full_bytes(name: &str, spec: &TensorSpec) -> Vec<u8> {
    let n = spec.shape.iter().product::<u64>() as usize;
    let salt = name.bytes().map(u32::from).sum::<u32>();
    (0..n).flat_map(|i| ((i as u32 * 7 + salt) as f32).to_le_bytes()).collect()
}

/// The tensors of one block, as the reference trainer lays them out (q/k/v and fc1 split by
/// rows in heads, o and fc2 by columns; norms, the row-split biases, embeddings and the head
/// replicated), plus a fused QKV to exercise sub-blocks.
fn block_specs(block: Block) -> BTreeMap<String, TensorSpec> {
    let f = |shape: &[u64], layout: Layout| TensorSpec { shape: shape.to_vec(), dtype: Dtype::F32, layout };
    let hd = HIDDEN / HEADS;
    let col = Layout::Split { axis: 0, blocks: vec![], granule: hd };
    let row = Layout::Split { axis: 1, blocks: vec![], granule: hd };
    match block {
        Block::Embed => BTreeMap::from([
            ("embed.weight".into(), f(&[16, HIDDEN], Layout::Replicated)),
            ("pos.weight".into(), f(&[4, HIDDEN], Layout::Replicated)),
        ]),
        Block::Head => BTreeMap::from([
            ("ln_f.weight".into(), f(&[HIDDEN], Layout::Replicated)),
            ("head.weight".into(), f(&[16, HIDDEN], Layout::Replicated)),
        ]),
        Block::Layer(l) => {
            let p = format!("layers.{l}");
            BTreeMap::from([
                (format!("{p}.ln1.weight"), f(&[HIDDEN], Layout::Replicated)),
                (format!("{p}.attn.q.weight"), f(&[HIDDEN, HIDDEN], col.clone())),
                (format!("{p}.attn.q.bias"), f(&[HIDDEN], col.clone())),
                (format!("{p}.attn.qkv.weight"), f(&[3 * HIDDEN, HIDDEN], Layout::Split { axis: 0, blocks: vec![HIDDEN; 3], granule: hd })),
                (format!("{p}.attn.o.weight"), f(&[HIDDEN, HIDDEN], row)),
                (format!("{p}.attn.o.bias"), f(&[HIDDEN], Layout::Replicated)),
                (format!("{p}.mlp.lm.weight"), f(&[20, HIDDEN], Layout::Vocab { axis: 0, multiple: 2 })),
            ])
        }
    }
}

fn blocks() -> Vec<Block> {
    std::iter::once(Block::Embed).chain((0..LAYERS).map(Block::Layer)).chain([Block::Head]).collect()
}

fn units_of(block: Block, part: Part, tp: u32, step: u64) -> Vec<Unit> {
    let specs = block_specs(block);
    let replicated = specs.values().all(|s| s.layout == Layout::Replicated);
    let tp = if replicated { 1 } else { tp };
    (0..tp)
        .map(|r| Unit {
            step,
            generation: Some(2),
            key: UnitKey { block, part, tp_rank: r, tp_size: tp },
            tensors: specs
                .iter()
                .map(|(n, s)| {
                    let mut full = full_bytes(n, s);
                    if part == Part::Optimizer {
                        full.reverse();
                    }
                    (n.clone(), (s.clone(), shard_full(n, s, &full, tp).unwrap().swap_remove(r as usize)))
                })
                .collect(),
        })
        .collect()
}

/// A step at TP 2 written as 2 ranks would: each its units, its rank file and its piece.
fn write_step(root: &Path, step: u64, tp: u32) -> std::path::PathBuf {
    let dir = root.join(step_dir_name(step));
    let mut pieces: Vec<Manifest> = (0..tp)
        .map(|_| Manifest { format: FORMAT.into(), step, layers: LAYERS, world_size: tp, units: vec![], ranks: vec![], lost_ranks: vec![] })
        .collect();
    for b in blocks() {
        for p in [Part::Model, Part::Optimizer] {
            for u in units_of(b, p, tp, step) {
                let r = u.key.tp_rank as usize;
                pieces[r].units.push(u.write(&dir).unwrap());
            }
        }
    }
    for (r, piece) in pieces.iter_mut().enumerate() {
        let bytes = format!("rank state {r}").into_bytes();
        write_atomic(&dir.join(rank_file_name(r as u32)), &bytes).unwrap();
        piece.ranks.push(RankEntry { rank: r as u32, file: file_entry(&rank_file_name(r as u32), &bytes, CHUNK_BYTES) });
        write_atomic(&dir.join(piece_file_name(r as u32)), &serde_json::to_vec(piece).unwrap()).unwrap();
    }
    dir
}

fn tmp(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("motley-ckpt-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn pieces_merge_into_a_complete_verified_manifest() {
    let root = tmp("merge");
    let dir = write_step(&root, 10, 2);
    let m = Manifest::load(&dir).unwrap();
    assert_eq!((m.step, m.layers, m.world_size, m.ranks.len()), (10, LAYERS, 2, 2));
    // embed and head (replicated) once at tp 0/1; each layer twice per part.
    assert_eq!(m.units.len(), 2 * (2 + 2 * LAYERS as usize));
    m.check_complete().unwrap();
    m.verify(&dir).unwrap();
    let u = m.units.iter().find(|u| u.key.block == Block::Layer(1) && u.key.tp_rank == 1).unwrap();
    assert_eq!(u.file.file, "layer.00001.model.tp1-2.safetensors");
    assert_eq!(u.tensors["layers.1.attn.q.weight"].shape, vec![HIDDEN, HIDDEN]);
    // No temporary file is left behind, and every file is the job's own (0600).
    assert!(std::fs::read_dir(&dir).unwrap().all(|e| !e.unwrap().file_name().to_string_lossy().contains(".tmp")));
    for e in std::fs::read_dir(&dir).unwrap() {
        let mode = std::os::unix::fs::PermissionsExt::mode(&e.as_ref().unwrap().metadata().unwrap().permissions());
        assert_eq!(mode & 0o777, 0o600, "{:?}", e.unwrap().path());
    }
    // The JSON is the documented one.
    let text = serde_json::to_value(&m).unwrap();
    let unit = &text["units"][0];
    for k in ["block", "part", "tp_rank", "tp_size", "file", "bytes", "chunk_bytes", "crc32c", "tensors"] {
        assert!(unit.get(k).is_some(), "{k} missing in {unit}");
    }
    std::fs::remove_dir_all(root).unwrap();
}

#[test]
fn a_unit_never_reported_makes_the_step_unrestorable() {
    let root = tmp("incomplete");
    let dir = write_step(&root, 3, 2);
    let mut m = Manifest::load(&dir).unwrap();
    m.units.retain(|u| !(u.key.block == Block::Layer(0) && u.key.part == Part::Optimizer && u.key.tp_rank == 1));
    let e = m.check_complete().unwrap_err();
    assert_eq!(
        e.to_string(),
        "step 3 is not restorable: unit layer.0 optimizer tp 1/2 was never reported; restore the previous complete step"
    );
    let mut m = Manifest::load(&dir).unwrap();
    m.units.retain(|u| u.key.block != Block::Head);
    assert!(m.check_complete().unwrap_err().to_string().contains("unit head model was never reported"));
    let mut m = Manifest::load(&dir).unwrap();
    m.ranks.pop();
    assert!(m.check_complete().unwrap_err().to_string().contains("rank file of rank 1"));
    // Pieces of different steps do not merge.
    let mut other = Manifest::load(&dir).unwrap();
    other.step = 4;
    let e = Manifest::merge([Manifest::load(&dir).unwrap(), other]).unwrap_err();
    assert!(matches!(e, CkptError::Conflict { .. }) && e.to_string().starts_with("step: 3 here, 4 there"), "{e}");
    std::fs::remove_dir_all(root).unwrap();
}

#[test]
fn a_corrupt_chunk_is_named_by_unit_and_chunk() {
    let root = tmp("crc");
    let dir = write_step(&root, 1, 2);
    let m = Manifest::load(&dir).unwrap();
    let u = &m.units[3];
    let path = dir.join(&u.file.file);
    let mut bytes = std::fs::read(&path).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0x40;
    std::fs::write(&path, &bytes).unwrap();
    let e = m.verify(&dir).unwrap_err();
    assert!(matches!(&e, CkptError::Crc { file, chunk: 0, .. } if *file == u.file.file), "{e:?}");
    assert!(e.to_string().contains("fetch the unit again from another holder"), "{e}");
    // With small chunks, the chunk that changed is the one named.
    let entry = file_entry(&u.file.file, &bytes, 64);
    let mut again = bytes.clone();
    again[200] ^= 1;
    let e = verify_bytes(&entry, &again).unwrap_err();
    assert!(matches!(e, CkptError::Crc { chunk: 3, start: 192, end: 256, .. }), "{e:?}");
    let e = verify_bytes(&entry, &again[..100]).unwrap_err();
    assert!(matches!(e, CkptError::Size { got: 100, .. }), "{e:?}");
    // A unit file that is not one: named.
    std::fs::write(&path, b"nonsense").unwrap();
    assert!(matches!(Unit::read(&path).unwrap_err(), CkptError::Format { .. }));
    std::fs::remove_dir_all(root).unwrap();
}

#[test]
fn a_tp2_step_resliced_holds_the_same_full_tensors() {
    let root = tmp("reslice");
    let src = write_step(&root, 5, 2);
    for tp in [1u32, 4] {
        let dst = root.join(format!("tp{tp}")).join(step_dir_name(5));
        let m = reslice_step(&src, &dst, tp).unwrap();
        m.check_complete().unwrap();
        let again = Manifest::load(&dst).unwrap();
        assert_eq!(again, m);
        again.verify(&dst).unwrap();
        for b in blocks() {
            for p in [Part::Model, Part::Optimizer] {
                let mine: Vec<Unit> = m
                    .units
                    .iter()
                    .filter(|u| u.key.block == b && u.key.part == p)
                    .map(|u| Unit::read(&dst.join(&u.file.file)).unwrap())
                    .collect();
                let want_tp = if matches!(b, Block::Layer(_)) { tp } else { 1 };
                assert_eq!(mine.len() as u32, want_tp, "{b} {p}");
                assert!(mine.iter().all(|u| u.generation == Some(2)), "a cut unit keeps its shards' generation");
                let expected = units_of(b, p, want_tp, 5);
                for (name, (spec, _)) in &expected[0].tensors {
                    let mut sorted = mine.clone();
                    sorted.sort_by_key(|u| u.key.tp_rank);
                    let shards: Vec<&[u8]> = sorted.iter().map(|u| u.tensors[name].1.as_slice()).collect();
                    let exp: Vec<&[u8]> = expected.iter().map(|u| u.tensors[name].1.as_slice()).collect();
                    assert_eq!(unshard(name, spec, &shards, want_tp).unwrap(), unshard(name, spec, &exp, want_tp).unwrap());
                    assert_eq!(shards, exp, "{name} at tp {want_tp}");
                }
            }
        }
    }
    // tp 8 cannot split 4 heads: refused before anything is written, naming the tensor.
    let e = reslice_step(&src, &root.join("tp8"), 8).unwrap_err();
    assert!(e.to_string().contains("tp 8 does not divide the 4 granules"), "{e}");
    std::fs::remove_dir_all(root).unwrap();
}

#[test]
fn shards_of_two_generations_are_not_resliced_together() {
    let mut units = units_of(Block::Layer(0), Part::Model, 2, 5);
    units[1].generation = Some(3);
    let e = motley_checkpoint::reslice_unit(&units, 1).unwrap_err().to_string();
    assert!(e.contains("was written by generation Some(3) and") && e.contains("re-slice the shards of one generation"), "{e}");
}

#[test]
fn the_cli_verifies_and_reslices() {
    let root = tmp("cli");
    let src = write_step(&root, 7, 2);
    let bin = env!("CARGO_BIN_EXE_motley-ckpt");
    let out = Command::new(bin).arg("verify").arg(&src).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let line: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!((line["step"].as_u64(), line["ranks"].as_u64()), (Some(7), Some(2)));
    let dst = root.join("one");
    let out = Command::new(bin).args(["reslice"]).arg(&src).args(["--tp", "1", "--out"]).arg(&dst).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(Command::new(bin).arg("verify").arg(&dst).status().unwrap().success());
    let out = Command::new(bin).args(["reslice"]).arg(&src).args(["--tp", "0", "--out"]).arg(&dst).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--tp: \"0\" is not a positive integer"));
    std::fs::remove_file(src.join("manifest.rank.00001.json")).unwrap();
    let out = Command::new(bin).arg("verify").arg(&src).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("was never reported"), "{}", String::from_utf8_lossy(&out.stderr));
    std::fs::remove_dir_all(root).unwrap();
}
