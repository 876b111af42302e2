//! Re-slicing: for TP t -> t' in {1, 2, 4, 8}, every layout kind and several element widths,
//! re-slicing the shards of t equals sharding the full tensor for t' directly (with a sharder
//! written here from the layout's definition, element by element).

use motley_checkpoint::{reslice, shard_full, unshard, CkptError, Dtype, Layout, TensorSpec};
use proptest::prelude::*;

const TPS: [u32; 4] = [1, 2, 4, 8];

/// The layout's definition, element by element: which rank holds global axis index g, and where.
fn place(layout: &Layout, len: u64, tp: u64, g: u64) -> Vec<(u64, u64)> {
    match layout {
        Layout::Replicated => (0..tp).map(|r| (r, g)).collect(),
        Layout::Split { blocks, .. } => {
            let blocks = if blocks.is_empty() { vec![len] } else { blocks.clone() };
            let (mut off, mut before) = (0, 0);
            for b in blocks {
                let piece = b / tp;
                if g < off + b {
                    let j = g - off;
                    return vec![(j / piece, before + j % piece)];
                }
                off += b;
                before += piece;
            }
            unreachable!()
        }
        Layout::Vocab { multiple, .. } => {
            let padded = len.div_ceil(multiple * tp) * multiple * tp;
            let local = padded / tp;
            vec![(g / local, g % local)]
        }
    }
}

fn local_len(layout: &Layout, len: u64, tp: u64) -> u64 {
    match layout {
        Layout::Replicated => len,
        Layout::Split { .. } => len / tp,
        Layout::Vocab { multiple, .. } => len.div_ceil(multiple * tp) * multiple,
    }
}

fn naive_shards(spec: &TensorSpec, full: &[u8], tp: u32) -> Vec<Vec<u8>> {
    let w = (spec.dtype.bitsize() / 8) as u64;
    let shape = &spec.shape;
    let axis = match &spec.layout {
        Layout::Replicated => 0,
        Layout::Split { axis, .. } | Layout::Vocab { axis, .. } => *axis,
    };
    let (t, len) = (u64::from(tp), shape[axis]);
    let outer: u64 = shape[..axis].iter().product();
    let inner: u64 = shape[axis + 1..].iter().product();
    let ll = local_len(&spec.layout, len, t);
    let mut out = vec![vec![0u8; (outer * ll * inner * w) as usize]; tp as usize];
    for o in 0..outer {
        for g in 0..len {
            for i in 0..inner {
                let src = (((o * len + g) * inner + i) * w) as usize;
                for (r, l) in place(&spec.layout, len, t, g) {
                    let dst = (((o * ll + l) * inner + i) * w) as usize;
                    out[r as usize][dst..dst + w as usize].copy_from_slice(&full[src..src + w as usize]);
                }
            }
        }
    }
    out
}

fn dtype_of(width: usize) -> Dtype {
    match width {
        1 => Dtype::U8,
        2 => Dtype::BF16,
        4 => Dtype::F32,
        _ => Dtype::F64,
    }
}

/// A tensor spec every TP degree of `TPS` can hold, and its full bytes.
fn tensor() -> impl Strategy<Value = (TensorSpec, Vec<u8>)> {
    let dims = prop::collection::vec(1u64..4, 0..3);
    let kind = prop_oneof![
        Just(0u8), // replicated
        Just(1u8), // split, one block
        Just(2u8), // split with sub-blocks (fused QKV, gate+up)
        Just(3u8), // vocabulary split
    ];
    (
        dims,
        kind,
        0usize..3,
        prop::sample::select(vec![1usize, 2, 4, 8]),
        1u64..4,
        prop::collection::vec(1u64..3, 1..4),
        1u64..40,
        1u64..5,
        any::<u64>(),
    )
        .prop_map(|(mut dims, kind, axis_pick, width, granule, block_units, vocab, multiple, seed)| {
            let axis = axis_pick.min(dims.len());
            let (layout, len) = match kind {
                0 => (Layout::Replicated, block_units[0] * 3),
                1 => {
                    let len = block_units[0] * 8 * granule;
                    (Layout::Split { axis, blocks: vec![], granule }, len)
                }
                2 => {
                    let blocks: Vec<u64> = block_units.iter().map(|k| k * 8 * granule).collect();
                    let len = blocks.iter().sum();
                    (Layout::Split { axis, blocks, granule }, len)
                }
                _ => (Layout::Vocab { axis, multiple }, vocab),
            };
            dims.insert(axis, len);
            let spec = TensorSpec { shape: dims, dtype: dtype_of(width), layout };
            let n = spec.shape.iter().product::<u64>() as usize * width;
            let mut x = seed | 1;
            let full = (0..n)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    (x >> 24) as u8
                })
                .collect();
            (spec, full)
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn restoring_equals_sharding_the_full_tensor((spec, full) in tensor()) {
        for t in TPS {
            let direct = shard_full("w", &spec, &full, t).unwrap();
            prop_assert_eq!(&direct, &naive_shards(&spec, &full, t), "shard_full at tp {}", t);
            let refs: Vec<&[u8]> = direct.iter().map(Vec::as_slice).collect();
            prop_assert_eq!(&unshard("w", &spec, &refs, t).unwrap(), &full, "unshard from tp {}", t);
            for t2 in TPS {
                let got = reslice("w", &spec, &refs, t, t2).unwrap();
                prop_assert_eq!(&got, &naive_shards(&spec, &full, t2), "{:?}: tp {} -> {}", spec, t, t2);
            }
        }
    }
}

fn spec(layout: Layout, shape: &[u64]) -> TensorSpec {
    TensorSpec { shape: shape.to_vec(), dtype: Dtype::F32, layout }
}

#[test]
fn a_tp_that_does_not_divide_the_heads_is_refused_naming_the_tensor_and_the_fix() {
    // 2 KV heads of head_dim 4: tp 4 cannot split them.
    let s = spec(Layout::Split { axis: 0, blocks: vec![], granule: 4 }, &[8, 3]);
    let full = vec![0u8; 8 * 3 * 4];
    let shards = shard_full("layers.0.attn.k.weight", &s, &full, 2).unwrap();
    let refs: Vec<&[u8]> = shards.iter().map(Vec::as_slice).collect();
    let e = reslice("layers.0.attn.k.weight", &s, &refs, 2, 4).unwrap_err();
    assert!(matches!(e, CkptError::Granule { tp: 4, count: 2, granule: 4, .. }), "{e:?}");
    let msg = e.to_string();
    assert!(msg.contains("layers.0.attn.k.weight") && msg.contains("tp 4 does not divide the 2 granules"), "{msg}");
    assert!(msg.contains("use a tp that divides 2"), "{msg}");
    // A fused tensor names the sub-block at fault.
    let fused = spec(Layout::Split { axis: 0, blocks: vec![16, 8, 8], granule: 4 }, &[32, 2]);
    let e = shard_full("qkv", &fused, &vec![0u8; 32 * 2 * 4], 4).unwrap_err();
    assert!(e.to_string().contains("in sub-block 1"), "{e}");
}

#[test]
fn missing_and_wrong_sized_shards_are_named() {
    let s = spec(Layout::Split { axis: 1, blocks: vec![], granule: 1 }, &[2, 8]);
    let full = vec![1u8; 2 * 8 * 4];
    let shards = shard_full("o", &s, &full, 4).unwrap();
    let refs: Vec<&[u8]> = shards.iter().take(3).map(Vec::as_slice).collect();
    let e = reslice("o", &s, &refs, 4, 2).unwrap_err();
    assert!(matches!(e, CkptError::MissingShard { rank: 3, tp: 4, .. }), "{e:?}");
    assert!(e.to_string().contains("shard 3 of tp 4 is missing"), "{e}");
    let mut refs: Vec<&[u8]> = shards.iter().map(Vec::as_slice).collect();
    refs[1] = &shards[1][..8];
    let e = reslice("o", &s, &refs, 4, 2).unwrap_err();
    assert!(matches!(e, CkptError::ShardSize { rank: 1, got: 8, want: 16, .. }), "{e:?}");
    let bad = spec(Layout::Split { axis: 2, blocks: vec![], granule: 1 }, &[2, 8]);
    let e = shard_full("o", &bad, &full, 2).unwrap_err();
    assert!(e.to_string().contains("layout.axis: 2 is out of range"), "{e}");
    let bad = spec(Layout::Split { axis: 1, blocks: vec![4, 2], granule: 1 }, &[2, 8]);
    assert!(shard_full("o", &bad, &full, 2).unwrap_err().to_string().contains("layout.blocks"));
    let f4 = TensorSpec { dtype: Dtype::F4, ..s };
    assert!(matches!(shard_full("o", &f4, &full, 2).unwrap_err(), CkptError::Dtype { bits: 4, .. }));
}

#[test]
fn a_vocabulary_split_pads_per_tp_degree() {
    // V = 10 rows of 1 float, padded to a multiple of 4 * t.
    let s = spec(Layout::Vocab { axis: 0, multiple: 4 }, &[10, 1]);
    let full: Vec<u8> = (0..10u32).flat_map(|x| (x as f32 + 1.0).to_le_bytes()).collect();
    let t2 = shard_full("embed", &s, &full, 2).unwrap();
    assert_eq!(s.layout.shard_shape(&s.shape, 2), vec![8, 1]); // 16 rows padded, 8 each
    let rows = |b: &[u8]| b.chunks(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect::<Vec<_>>();
    assert_eq!(rows(&t2[1]), vec![9.0, 10.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]);
    let refs: Vec<&[u8]> = t2.iter().map(Vec::as_slice).collect();
    let t1 = reslice("embed", &s, &refs, 2, 1).unwrap();
    assert_eq!(rows(&t1[0]).len(), 12); // padded to 12 at tp 1
    assert_eq!(unshard("embed", &s, &refs, 2).unwrap(), full);
}

#[test]
fn layouts_read_and_write_as_the_doc_shows() {
    let text = r#"[{"kind":"replicated"},{"kind":"split","axis":0,"blocks":[64,16,16],"granule":8},
                   {"kind":"split","axis":1},{"kind":"vocab","axis":0,"multiple":128}]"#;
    let ls: Vec<Layout> = serde_json::from_str(text).unwrap();
    assert_eq!(ls[1], Layout::Split { axis: 0, blocks: vec![64, 16, 16], granule: 8 });
    assert_eq!(ls[2], Layout::Split { axis: 1, blocks: vec![], granule: 1 });
    assert_eq!(serde_json::to_string(&ls[2]).unwrap(), r#"{"kind":"split","axis":1}"#);
    let e = serde_json::from_str::<Layout>(r#"{"kind":"split","axis":0,"granul":2}"#).unwrap_err();
    assert!(e.to_string().contains("granul"), "{e}");
}
