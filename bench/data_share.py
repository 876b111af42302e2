#!/usr/bin/env python3
"""The data loader's share of a training step (`--data`), on this CPU.

    OMP_NUM_THREADS=1 .venv/bin/python bench/data_share.py [--steps 30] [--skip 3] [--keep DIR]

Trains a byte-level BPE tokenizer (vocab 4096) with `tokenizers` on text every Debian machine
has (/usr/share/common-licenses, Python's pydoc topics), prepares a Megatron indexed dataset
with `python -m motley_torch.data prepare`, then runs the reference trainer on a llama-family
model (4 layers, hidden 256, seq 256, global batch 8) under a 2-stage plan (two CPU ranks,
gloo) with `--timings`, once on the dataset and once on synthetic data. Reports per rank the
median step wall time, the median time the step waited for its batch (`data_wait_ms`: the
prefetch thread prepares the next batch while the step computes) and its share. Goal: under 2%.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "python" / "tests"))
sys.path.insert(0, str(HERE.parent / "python"))

from launcher import check_ok, hand_plan, launch, python_env  # noqa: E402

MODEL = {"name": "bench-llama", "family": "llama", "layers": 4, "hidden": 256, "heads": 8, "kv_heads": 4,
         "ffn_hidden": 688, "seq_len": 256, "vocab": 4096, "gated_mlp": True}


def corpus(out: Path) -> list:
    import pydoc_data.topics

    files = sorted(p for p in Path("/usr/share/common-licenses").iterdir() if p.is_file())
    topics = out / "pydoc.jsonl"
    with open(topics, "w") as f:
        for k, v in sorted(pydoc_data.topics.topics.items()):
            f.write(json.dumps({"text": v}) + "\n")
    return [str(p) for p in files] + [str(topics)]


def tokenizer(files: list, out: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train(files, trainers.BpeTrainer(vocab_size=4096, special_tokens=["<|endoftext|>"],
                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    path = out / "tokenizer.json"
    tok.save(str(path))
    return path


def run(plan, args, work: Path, timings: Path, skip: int):
    results = launch(plan, args + ["--timings", str(timings) + ".{rank}"], work, timeout=1200)
    check_ok(results)
    out = {}
    for rank in range(len(results)):
        recs = [json.loads(x) for x in Path(f"{timings}.{rank}").read_text().splitlines()][skip:]
        step = statistics.median(r["step_ms"] for r in recs)
        wait = statistics.median(r.get("data_wait_ms", 0.0) for r in recs)
        worst = max(r.get("data_wait_ms", 0.0) / r["step_ms"] for r in recs)
        out[rank] = (step, wait, worst)
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--skip", type=int, default=3)
    p.add_argument("--keep")
    a = p.parse_args()
    work = Path(a.keep or tempfile.mkdtemp(prefix="motley-data-share-"))
    work.mkdir(parents=True, exist_ok=True)
    files = corpus(work)
    tok = tokenizer(files, work)
    prefix = work / "corpus"
    r = subprocess.run([sys.executable, "-m", "motley_torch.data", "prepare", "--tokenizer", str(tok), "--input",
                        *files, "--output", str(prefix)], capture_output=True, text=True, env=python_env())
    if r.returncode != 0:
        print(r.stderr, file=sys.stderr)
        return 1
    info = subprocess.run([sys.executable, "-m", "motley_torch.data", "inspect", str(prefix), "-o", "json"],
                          capture_output=True, text=True, check=True, env=python_env()).stdout
    print(f"dataset: {info.strip()}")
    plan = hand_plan(MODEL, 8, 2, [dict(micro_batches=4, stages=[
        dict(layers=[0, 2], tp=1, dp=1, gpus=[("a", 0)]), dict(layers=[2, 4], tp=1, dp=1, gpus=[("b", 0)])])])
    base = ["--steps", str(a.steps), "--seed", "1"]
    data = run(plan, base + ["--data", str(prefix)], work / "data", work / "t-data", a.skip)
    synth = run(plan, base, work / "synth", work / "t-synth", a.skip)
    print("\n| rank | median step ms (data) | median step ms (synthetic) | median data wait ms | share | worst step's share |")
    print("|---:|---:|---:|---:|---:|---:|")
    for rank in sorted(data):
        s, w, worst = data[rank]
        print(f"| {rank} | {s:.1f} | {synth[rank][0]:.1f} | {w:.3f} | {100 * w / s:.2f}% | {100 * worst:.2f}% |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
