#!/usr/bin/env python3
"""Peak memory of `python -m motley_torch.data prepare` against the size of its input.

Trains a small byte-level BPE tokenizer on text every Debian machine has (or takes
--tokenizer), writes JSON Lines inputs of each --mb size (documents of --doc-kb of text; with
--huge-line also one line holding a single document of that size) and runs prepare on each in
a fresh process, printing the process's peak RSS (VmHWM) and the throughput. Streaming keeps
the peak near the baseline plus a chunk (--chunk-mb) and the largest document, whatever the
input size.

    python bench/prepare_memory.py --mb 8 64 256 [--huge-line] [--workers 2]
"""

import argparse
import glob
import json
import os
import random
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
PKG = os.path.join(os.path.dirname(HERE), "python")

CHILD = r"""
import sys, time
from motley_torch.components.prepare import prepare
tok, out, chunk, workers = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4])
t = time.monotonic()
r = prepare(tok, [out + ".jsonl"], out, chunk_bytes=int(chunk * 2**20), workers=workers, progress=None, summary=None)
with open("/proc/self/status") as f:
    hwm = int(next(l for l in f if l.startswith("VmHWM:")).split()[1])
print(hwm, r["tokens"], r["documents"], time.monotonic() - t)
"""


def train_tokenizer(path):
    import pydoc_data.topics
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    texts = [open(p, encoding="utf-8", errors="replace").read()
             for p in sorted(glob.glob("/usr/share/common-licenses/*")) if os.path.isfile(p)]
    texts += list(pydoc_data.topics.topics.values())
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=4000, special_tokens=["<|endoftext|>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(path)
    return texts


def write_input(path, mb, doc_kb, huge_line, texts):
    rng = random.Random(mb)
    words = " ".join(texts).split()
    size = 0
    with open(path, "w", encoding="utf-8") as f:
        if huge_line:
            line = json.dumps({"text": " ".join(rng.choices(words, k=int(mb * 2**20 / 6)))}) + "\n"
            f.write(line)
            return len(line)
        while size < mb * 2**20:
            line = json.dumps({"text": " ".join(rng.choices(words, k=max(1, doc_kb * 1024 // 6)))}) + "\n"
            f.write(line)
            size += len(line)
    return size


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, nargs="+", default=[1, 16, 64])
    ap.add_argument("--doc-kb", type=int, default=8)
    ap.add_argument("--huge-line", action="store_true", help="each input is one line, one document")
    ap.add_argument("--chunk-mb", type=float, default=1.0)
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--tokenizer")
    args = ap.parse_args()
    env = dict(os.environ, PYTHONPATH=PKG + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    with tempfile.TemporaryDirectory() as d:
        tok = args.tokenizer or os.path.join(d, "tokenizer.json")
        texts = train_tokenizer(tok) if not args.tokenizer else [open(p, encoding="utf-8", errors="replace").read()
                                                                  for p in sorted(glob.glob("/usr/share/common-licenses/*"))
                                                                  if os.path.isfile(p)]
        print(f"{'input MB':>9} {'documents':>10} {'tokens':>11} {'peak RSS MB':>12} {'MB/s':>6}")
        for mb in args.mb:
            out = os.path.join(d, f"in{mb}")
            size = write_input(out + ".jsonl", mb, args.doc_kb, args.huge_line, texts)
            r = subprocess.run([sys.executable, "-c", CHILD, tok, out, str(args.chunk_mb), str(args.workers)],
                               env=env, capture_output=True, text=True)
            if r.returncode != 0:
                sys.exit(r.stderr)
            hwm, tokens, docs, secs = r.stdout.split()
            print(f"{size / 2**20:9.1f} {docs:>10} {tokens:>11} {int(hwm) / 1024:12.1f} {size / 2**20 / float(secs):6.1f}")
            for ext in (".jsonl", ".bin", ".idx"):
                os.unlink(out + ext)


if __name__ == "__main__":
    main()
