#!/usr/bin/env python3
"""A small Llama as a Hugging Face directory, for trying the fine-tuning path without a
download: a byte-level BPE tokenizer trained with `tokenizers` on text every Debian machine has
(/usr/share/common-licenses), and a random-init LlamaForCausalLM (transformers: config ->
model -> save_pretrained) of that vocabulary. With a real model, skip this: its directory
already has config.json, the safetensors weights and tokenizer.json.

    python examples/finetune/small_llama.py OUT_DIR [--layers 4] [--hidden 128] [--vocab 2048]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--vocab", type=int, default=2048)
    a = p.parse_args()
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    texts = sorted(str(f) for f in Path("/usr/share/common-licenses").iterdir() if f.is_file())
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train(texts, trainers.BpeTrainer(vocab_size=a.vocab, special_tokens=["<|endoftext|>"],
                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tok.save(str(out / "tokenizer.json"))
    cfg = transformers.LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=a.hidden,
                                   intermediate_size=a.hidden * 8 // 3 // 16 * 16, num_hidden_layers=a.layers,
                                   num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256,
                                   rope_theta=10000.0, tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(str(out))
    print(f"wrote {out}: config.json, model.safetensors, tokenizer.json (vocab {tok.get_vocab_size()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
