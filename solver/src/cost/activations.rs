//! Bytes of activations the rank runtime (`python/motley_torch/models/transformer.py`) keeps for the
//! backward pass, per token, as counted tensor by tensor with
//! `torch.autograd.graph.saved_tensors_hooks` (`motley_torch.tools.saved`; `bench/activation_bytes.py`
//! prints the counts, and the tests here and in `python/tests/test_activation_bytes.py` hold
//! the estimate and the runtime to the same numbers). Korthikanti et al.'s 34·h bytes per token assume every
//! tensor in 16 bits and one cast of each input; the runtime differs:
//! - without ZeRO-1 the weights are fp32 and autocast computes in the half type, so the
//!   residual stream and the norms stay fp32 and every linear saves its own half copy of its
//!   input; autocast's half copy of each weight is kept once for the whole step (2 bytes per
//!   parameter, priced with the state: `PlanOptions::state_bytes_per_param`);
//! - with ZeRO-1 in half precision the weights themselves are half: no weight copies, a half
//!   residual stream;
//! - llama attention runs through SDPA (flash: q, k and v at all heads, the output and the
//!   log-sum-exp), gpt attention materialises its probabilities (bytes per head and key).
//!
//! On a GPU the runtime compiles every block (`--compile auto`), and `torch.compile`'s
//! partitioner saves less: the block's input, the two norms' outputs (the linears' inputs), q,
//! k, v and the attention output at all heads, the output projection's input and the MLP's
//! three intermediates, recomputing the norms' and rotary's elementwise work in the backward
//! pass (34.6 h bytes per token and layer in bf16 against the eager runtime's 52.3, on the
//! llama counted below). Plans are priced compiled unless `--eager` asks for the eager
//! runtime's counts (a run with `--compile off`, and every CPU run).

use crate::model::{Family, Model};
use crate::Precision;

/// Where the bytes of one token of one layer go: kept whole on every TP rank (norms, the
/// residual stream, the linears' input copies) or split over it (attention and MLP
/// intermediates).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TokenBytes {
    pub replicated: f64,
    pub split: f64,
}

impl TokenBytes {
    pub fn per_gpu(&self, tp: f64) -> f64 {
        self.replicated + self.split / tp
    }
}

/// The layout the weights and the stream have: `half` compute, `half_weights` under ZeRO-1.
fn layout(precision: Precision, zero1: bool) -> (bool, bool) {
    let half = !matches!(precision, Precision::Fp32);
    (half, half && zero1)
}

/// Saved bytes of one token in one layer, at sequence length `seq`, by compiled blocks
/// (`compiled`) or eager ones.
pub fn layer_token_bytes(model: &Model, precision: Precision, zero1: bool, seq: f64, compiled: bool) -> TokenBytes {
    let s = &model.spec;
    let h = s.hidden as f64;
    let f = s.ffn_hidden.unwrap_or(4 * s.hidden) as f64;
    let heads = s.heads as f64;
    let hd = h / heads;
    let (half, half_weights) = layout(precision, zero1);
    // Coefficients per h and per f, as counted (see the module comment): (replicated h,
    // split h, per f of a gated MLP, per f of a plain one).
    let (rep_h, split_h, gated_f, plain_f) = match (compiled, s.family, half, half_weights) {
        // Compiled: the same for both families (the block's input in the stream's type, the
        // norms' outputs, and the rest in the compute type).
        (true, _, false, _) => (12.0, 20.0, 12.0, 8.0),
        (true, _, true, false) => (8.0, 10.0, 6.0, 4.0),
        (true, _, true, true) => (6.0, 10.0, 6.0, 4.0),
        (false, Family::Llama, false, _) => (24.0, 12.0, 16.0, 8.0),
        (false, Family::Llama, true, false) => (26.0, 4.0, 8.0, 4.0),
        (false, Family::Llama, true, true) => (12.0, 8.0, 8.0, 4.0),
        (false, Family::Gpt, false, _) => (16.0, 16.0, 16.0, 8.0),
        (false, Family::Gpt, true, false) => (14.0, 10.0, 8.0, 4.0),
        (false, Family::Gpt, true, true) => (8.0, 8.0, 8.0, 4.0),
    };
    let elem = if half { 2.0 } else { 4.0 };
    let mlp = if s.gated_mlp { gated_f } else { plain_f } * f;
    let attention = match s.family {
        // Compiled: the two norms' fp32 rstd (rotary is recomputed); the fp32 log-sum-exp per
        // head.
        Family::Llama if compiled => (8.0, 4.0 * heads),
        // Rotary cos and sin (hd each, in the stream's type, whole) and the fp32 log-sum-exp
        // per head.
        Family::Llama => (2.0 * elem * hd, 4.0 * heads),
        // The two LayerNorms' fp32 mean and rstd, the causal mask (a byte per key), and the
        // probabilities per head and key.
        Family::Gpt => (16.0 + seq, elem * heads * seq),
    };
    TokenBytes { replicated: rep_h * h + attention.0, split: split_h * h + mlp + attention.1 }
}

/// Fp32 logits one chunk of the head's loss may hold (`CHUNK_BYTES` of
/// `python/motley_torch/models/head_loss.py`).
pub const HEAD_CHUNK_BYTES: f64 = 512.0 * 1024.0 * 1024.0;

/// Bytes of logit gradients, in the compute type, the head keeps for one weight-gradient matmul
/// (`models/head_loss.py` GROUP_BYTES).
pub const HEAD_GROUP_BYTES: f64 = 1024.0 * 1024.0 * 1024.0;

/// Tokens per chunk of the head's loss for a micro-batch of `tokens` (head_loss.chunk_tokens).
pub fn head_chunk_tokens(tokens: f64, vocab: f64) -> f64 {
    tokens.min((HEAD_CHUNK_BYTES / (4.0 * vocab)).floor().max(128.0))
}

/// Tokens per weight-gradient group: whole chunks within HEAD_GROUP_BYTES of logit gradients
/// of `element` bytes (head_loss.group_tokens).
pub fn head_group_tokens(tokens: f64, vocab: f64, element: f64) -> f64 {
    let chunk = head_chunk_tokens(tokens, vocab);
    tokens.min(chunk * (HEAD_GROUP_BYTES / (chunk * vocab * element)).floor().max(1.0))
}

/// Peak bytes of the head and loss over a micro-batch of `tokens`, whole on every TP rank.
/// The runtime never holds the micro-batch's logits (`models/head_loss.py`): a chunk of tokens
/// at a time, it keeps per token the final norm's saves and the gradient into the head's input
/// (in the stream's type), for the micro-batch the fp32 weight-gradient accumulator (vocabulary
/// x hidden), for one group of chunks their logit gradients in the compute type, and the larger
/// of one chunk's logits with their gradient (the fused, compiled kernel of a GPU run; the CPU's
/// eager kernels are not priced) and the group's weight gradient in the compute type before it
/// is added to the accumulator.
pub fn head_bytes(model: &Model, precision: Precision, zero1: bool, tokens: f64) -> f64 {
    let h = model.spec.hidden as f64;
    let v = model.spec.vocab as f64;
    let (half, half_weights) = layout(precision, zero1);
    let element = if half { 2.0 } else { 4.0 };
    let norm = if half_weights { 6.0 } else { 8.0 } * h;
    let kept = if half_weights { 2.0 } else { 4.0 } * h;
    let chunk_tokens = head_chunk_tokens(tokens, v);
    let chunk = chunk_tokens * v * 2.0 * element;
    // A group of one chunk keeps that chunk's gradient itself, already counted.
    let group_tokens = head_group_tokens(tokens, v, element);
    let group = if group_tokens > chunk_tokens { group_tokens * v * element } else { 0.0 };
    tokens * (norm + kept) + 4.0 * v * h + group + chunk.max(element * v * h)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{model_by_name, Model};

    /// The counts `bench/activation_bytes.py` makes on the runtime (h 1024, 16 heads, 8 KV
    /// heads, ffn 2816), in h bytes per token of one layer; `tests/test_activation_bytes.py`
    /// holds the runtime to the same numbers.
    /// A 128k vocabulary at 8,192 tokens: the chunked loss holds one chunk of 1,046 tokens'
    /// logits and gradient, not 12 bytes per token and vocabulary entry (11.8 GiB).
    #[test]
    fn the_head_holds_one_chunk_of_logits() {
        let mut spec = model_by_name("llama-7b").unwrap();
        spec.hidden = 2048;
        spec.vocab = 128_256;
        let m = Model::new(spec, None).unwrap();
        assert_eq!(head_chunk_tokens(8192.0, 128_256.0), 1046.0);
        assert_eq!(head_chunk_tokens(100.0, 32_000.0), 100.0, "never more than the micro-batch");
        // 1 GiB of bf16 logit gradients: 4 chunks a group.
        assert_eq!(head_group_tokens(8192.0, 128_256.0, 2.0), 4184.0);
        assert_eq!(head_group_tokens(8192.0, 128_256.0, 4.0), 2092.0);
        let want = 8192.0 * (8.0 + 4.0) * 2048.0 + 4.0 * 128_256.0 * 2048.0 + 4184.0 * 128_256.0 * 2.0 + 1046.0 * 128_256.0 * 4.0;
        assert_eq!(head_bytes(&m, Precision::Bf16, false, 8192.0), want);
        assert!(head_bytes(&m, Precision::Bf16, false, 8192.0) < 3.0 * 1024f64.powi(3));
        let fp32 = head_bytes(&m, Precision::Fp32, false, 8192.0);
        assert_eq!(fp32 - want, 1046.0 * 128_256.0 * 4.0, "fp32 logits and gradient: 8 bytes a chunk entry");
        // One chunk, one group: the chunk's gradient is the group's.
        // (The group's bf16 weight gradient, 2 x 128256 x 2048, outweighs 1,000 tokens' logits
        // and gradient, 4,000 x 128256.)
        let one = 1000.0 * (8.0 + 4.0) * 2048.0 + 4.0 * 128_256.0 * 2048.0 + 2.0 * 128_256.0 * 2048.0;
        assert_eq!(head_bytes(&m, Precision::Bf16, false, 1000.0), one);
    }

    #[test]
    fn the_estimate_is_the_runtimes_count() {
        let mut spec = model_by_name("llama-7b").unwrap();
        spec.hidden = 1024;
        spec.heads = 16;
        spec.kv_heads = Some(8);
        spec.ffn_hidden = Some(2816);
        spec.seq_len = 512;
        let llama = Model::new(spec, None).unwrap();
        let count = |p, z| layer_token_bytes(&llama, p, z, 512.0, false).per_gpu(1.0) / 1024.0;
        assert!((count(Precision::Fp32, false) - 80.57).abs() < 0.1, "{}", count(Precision::Fp32, false));
        assert!((count(Precision::Bf16, false) - 52.32).abs() < 0.1, "{}", count(Precision::Bf16, false));
        assert!((count(Precision::Bf16, true) - 42.32).abs() < 0.1, "{}", count(Precision::Bf16, true));
        assert_eq!(count(Precision::Fp32, true), count(Precision::Fp32, false), "fp32 weights either way");
        // Compiled blocks (python/tests/test_activation_bytes.py counts them on the runtime).
        let compiled = |p, z| layer_token_bytes(&llama, p, z, 512.0, true).per_gpu(1.0) / 1024.0;
        assert!((compiled(Precision::Fp32, false) - 65.07).abs() < 0.01, "{}", compiled(Precision::Fp32, false));
        assert!((compiled(Precision::Bf16, false) - 34.57).abs() < 0.01, "{}", compiled(Precision::Bf16, false));
        assert!((compiled(Precision::Bf16, true) - 32.57).abs() < 0.01, "{}", compiled(Precision::Bf16, true));
    }

    #[test]
    fn tp_splits_the_attention_and_mlp_but_not_the_norms() {
        let m = Model::new(model_by_name("llama-7b").unwrap(), None).unwrap();
        let b = layer_token_bytes(&m, Precision::Bf16, false, 4096.0, false);
        assert!(b.per_gpu(2.0) < b.per_gpu(1.0) && b.per_gpu(2.0) > b.per_gpu(1.0) / 2.0);
        assert_eq!(b.per_gpu(2.0), b.replicated + b.split / 2.0);
    }
}
