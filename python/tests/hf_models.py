"""Random-init Hugging Face models made with transformers (config -> model -> save_pretrained;
nothing is downloaded), for the tests that compare Motley with transformers."""

from __future__ import annotations

from pathlib import Path

import torch

BASE = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=8,
            num_key_value_heads=4, max_position_embeddings=64, rms_norm_eps=1e-5)


def make_hf(path: Path, kind: str = "llama", std: float = 0.2, seed: int = 0, max_shard_size=None, **over) -> Path:
    """Save a random model of `kind` (llama, qwen2, mistral) to `path`. Weights are drawn with
    std `std` (transformers' 0.02 makes every position look alike, which would hide a wrong
    rotary embedding); norms get random gains too, so a swapped norm shows."""
    import transformers as tf

    kw = dict(BASE, **over)
    cls = {"llama": (tf.LlamaConfig, tf.LlamaForCausalLM), "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
           "mistral": (tf.MistralConfig, tf.MistralForCausalLM)}[kind]
    torch.manual_seed(seed)
    model = cls[1](cls[0](**kw))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            else:
                p.copy_(std * torch.randn_like(p))
    model.eval()
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(str(path), **kwargs)
    return path


def load_hf(path: Path):
    import transformers as tf

    return tf.AutoModelForCausalLM.from_pretrained(str(path), attn_implementation="eager", dtype=torch.float32)


def add_tokenizer(path: Path, vocab: int = 96) -> Path:
    """A word-level tokenizer of `vocab` tokens (<unk>, <s>, </s>, then w3, w4, ...) saved by
    transformers into the model directory `path` (tokenizer.json, tokenizer_config.json):
    what a real model directory carries beside its weights."""
    import transformers as tf
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(3, vocab)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = tf.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(str(path))
    return path
