#!/usr/bin/env python3
"""Loading Hugging Face weights into a rank (`--init-from-hf`), side by side with transformers.

    .venv/bin/python bench/hf_load.py [--dir DIR] [--layers 4] [--hidden 2048] [--ffn 5632]
                                      [--vocab 32000] [--shard-gb 0.5]

Initialises a LlamaForCausalLM with transformers (random, fp32; 1.35 GB with the defaults) and
saves it sharded (`--shard-gb` per file, with the index) unless DIR already holds it. Then, each
in a fresh process, one after the other:
- transformers' `AutoModelForCausalLM.from_pretrained` of the whole model (the baseline);
- Motley ranks of three layouts (1 stage TP 1; 2 stages x TP 2, the rank holding stage 0 TP 0
  and the one holding stage 1 TP 1; 1 stage TP 4, rank 0): each builds its GPTStage and calls
  `load_hf`, which reads only its layers and its TP slices through safetensors' lazy slices.
Per process: the load's wall seconds, peak RSS (getrusage ru_maxrss), the baseline RSS (the
interpreter with torch imported, before the stage is built: PyPI's CUDA build of torch alone is
about 540 MB on this machine, on the CPU), and the rank's shard bytes (its parameters, which the
load fills). Goal: peak RSS over the baseline at most 1.25 x shard + 300 MB. Prints one JSON
line per run and a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def child_transformers(d: str) -> dict:
    import torch
    import transformers

    before = rss_mb()  # the interpreter with torch imported: the baseline
    t0 = time.perf_counter()
    m = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    wall = time.perf_counter() - t0
    shard = sum(p.numel() * p.element_size() for p in m.parameters())
    return dict(who="transformers from_pretrained", wall_s=wall, shard_mb=shard / 1e6, rss_before_mb=before,
                peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)


def child_motley(d: str, layers: str, tp_rank: int, tp_size: int) -> dict:
    import torch

    from motley_torch.models.transformer import GPTStage
    from motley_torch.model_source import load_model

    torch.set_num_threads(1)
    before = rss_mb()  # the interpreter with torch imported: the baseline
    spec = load_model(d)
    l0, l1 = map(int, layers.split("-"))
    with torch.device("meta"):
        m = GPTStage(spec, 128, (l0, l1), tp_rank=tp_rank, tp_size=tp_size)
    m = m.to_empty(device="cpu")  # allocated, not initialised: the load writes every byte
    shard = sum(p.numel() * p.element_size() for p in m.parameters())
    t0 = time.perf_counter()
    m.load_hf(d)
    wall = time.perf_counter() - t0
    return dict(who=f"motley layers {l0}-{l1} tp {tp_rank}/{tp_size}", wall_s=wall, shard_mb=shard / 1e6,
                rss_before_mb=before, peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)


def make(d: str, a) -> None:
    if os.path.exists(os.path.join(d, "config.json")):
        return
    import torch
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.ffn,
                                   num_hidden_layers=a.layers, num_attention_heads=16, num_key_value_heads=8,
                                   max_position_embeddings=2048)
    torch.manual_seed(0)
    m = transformers.LlamaForCausalLM(cfg)
    m.save_pretrained(d, max_shard_size=f"{int(a.shard_gb * 1000)}MB")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", default="/tmp/motley-bench-hf")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--ffn", type=int, default=5632)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--shard-gb", type=float, default=0.5)
    p.add_argument("--child", nargs="*")
    a = p.parse_args()
    if a.child:
        kind, *rest = a.child
        out = child_transformers(a.dir) if kind == "hf" else child_motley(a.dir, rest[0], int(rest[1]), int(rest[2]))
        print(json.dumps(out))
        return 0
    make(a.dir, a)
    total = sum(os.path.getsize(os.path.join(a.dir, f)) for f in os.listdir(a.dir) if f.endswith(".safetensors"))
    half = a.layers // 2
    runs = [["hf"], ["motley", f"0-{a.layers}", "0", "1"], ["motley", f"0-{half}", "0", "2"],
            ["motley", f"{half}-{a.layers}", "1", "2"], ["motley", f"0-{a.layers}", "0", "4"]]
    rows = []
    for r in runs:
        out = subprocess.run([sys.executable, __file__, "--dir", a.dir, "--child", *r], capture_output=True, text=True,
                             env=dict(os.environ, OMP_NUM_THREADS="1"))
        if out.returncode != 0:
            print(out.stderr, file=sys.stderr)
            return 1
        row = json.loads(out.stdout.strip().splitlines()[-1])
        row["goal_mb"] = 1.25 * row["shard_mb"] + 300
        row["over_baseline_mb"] = row["peak_rss_mb"] - row["rss_before_mb"]
        row["ok"] = row["over_baseline_mb"] <= row["goal_mb"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"\nmodel: {total / 1e9:.2f} GB of safetensors in {a.dir}\n")
    print("| process | load wall s | shard MB | baseline RSS MB | peak RSS MB | peak over baseline MB | "
          "goal MB (1.25 x shard + 300) | goal met |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        print(f"| {r['who']} | {r['wall_s']:.2f} | {r['shard_mb']:.0f} | {r['rss_before_mb']:.0f} | "
              f"{r['peak_rss_mb']:.0f} | {r['over_baseline_mb']:.0f} | {r['goal_mb']:.0f} | "
              f"{'yes' if r['ok'] else 'no'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
