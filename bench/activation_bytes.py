#!/usr/bin/env python3
"""The bytes one transformer layer of the rank runtime saves for backward, counted tensor by
tensor (motley_torch.tools.saved), for the layouts the cost model prices
(solver/src/cost/activations.rs): fp32; bf16 under autocast over fp32 weights; bf16 weights
(ZeRO-1 in half precision). Per token, in units of h bytes, and the fixed bytes per layer
parameter (autocast's half copies of fp32 weights).

    .venv/bin/python bench/activation_bytes.py [--hidden 1024 --heads 16 --kv-heads 8 --ffn 2816]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))

from motley_torch.spec import ModelSpec  # noqa: E402
from motley_torch.tools.saved import layer_token_bytes  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--ffn", type=int, default=2816)
    p.add_argument("--seq", type=int, default=256)
    a = p.parse_args()
    print(f"command: {' '.join(sys.argv)}\n")
    print("| family | layout | bytes per token / h | bytes per token and key / heads | fixed bytes per layer parameter |")
    print("|---|---|---:|---:|---:|")
    for family in ("llama", "gpt"):
        d = {"name": "count", "family": family, "layers": 1, "hidden": a.hidden, "heads": a.heads,
             "kv_heads": a.kv_heads if family == "llama" else a.heads,
             "ffn_hidden": a.ffn if family == "llama" else 4 * a.hidden, "seq_len": 2 * a.seq, "vocab": 1000,
             "gated_mlp": family == "llama"}
        spec = ModelSpec.from_dict(d)
        for name, precision, hw in (("fp32", "fp32", False), ("bf16, fp32 weights", "bf16", False),
                                    ("bf16 weights (ZeRO-1)", "bf16", True)):
            r = layer_token_bytes(spec, precision, hw, a.seq)
            print(f"| {family} | {name} | {r['per_token'] / a.hidden:.2f} | {r['per_token_key'] / a.heads:.2f} | "
                  f"{r['fixed_per_param']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
