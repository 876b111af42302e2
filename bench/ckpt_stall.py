#!/usr/bin/env python3
"""Checkpoint save stall (docs/checkpoint.md): how long `motley_torch.components.checkpoint.save` holds up the rank
that calls it, against a plain memory copy of the same bytes and against the old synchronous
save.

For the reference trainer's model (motley_torch.models.transformer.GPTStage, fp32 on the CPU, AdamW state
present) at a few widths, in one process (a gloo world of 1, the whole model as one TP-1 stage,
so this rank writes every unit):

  stall_s   save() returning, asynchronous (the default), the previous save already written
            (steady state): finish the previous one (all-reduce), copy every tensor + RNG
            state to host memory, start the writer thread
  memcpy_s  the cheaper of: cloning every tensor the checkpoint holds, and torch.cat of them
            into one buffer (the same bytes, one plain memory copy)
  sync_s    save(asynchronous=False): the old path, serialise + crc + write + fsync in the call
  write_s   the background writer's remaining time after save() returned (flush())

Each the median of --reps runs. Prints a table; `-o json` prints one JSON line per size.

    python bench/ckpt_stall.py [--widths 128,384,832] [--reps 5] [--threads N] [--dir DIR] [-o json]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "python"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from motley_torch import checkpoint  # noqa: E402
from motley_torch.models.transformer import GPTStage  # noqa: E402
from motley_torch.spec import ModelSpec  # noqa: E402

LAYERS, HEADS, SEQ, VOCAB = 4, 4, 128, 1024


def build(width: int):
    spec = ModelSpec.from_dict(dict(name=f"w{width}", layers=LAYERS, hidden=width, heads=HEADS, seq_len=SEQ,
                                    vocab=VOCAB))
    model = GPTStage(spec, SEQ, (0, LAYERS))
    model.init_from_seed(1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, VOCAB, (1, SEQ + 1), generator=torch.Generator().manual_seed(0))
    logits = model(tokens[:, :-1])
    torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1)).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return model, opt


def state_tensors(model, opt):
    return [t for unit in checkpoint._units(model, opt).values() for _, t in unit.values()]


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure(width: int, reps: int, root: Path) -> dict:
    model, opt = build(width)
    tensors = state_tensors(model, opt)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    view = SimpleNamespace(replica=0, stage_dp_rank=0, tp_rank=0, tp_size=1, world_size=1, rank=0,
                           device=torch.device("cpu"))
    kw = dict(seed=1, global_batch=1, lr=1e-3)
    adir, sdir = root / f"w{width}-async", root / f"w{width}-sync"
    stall, write, clone, cat, sync = [], [], [], [], []
    step = 0
    # One untimed asynchronous save first: every timed one then finds a previous save to finish.
    checkpoint.save(view, model, opt, step, str(adir), asynchronous=True, **kw)
    checkpoint.flush()
    for _ in range(reps):
        step += 1
        stall.append(timed(lambda: checkpoint.save(view, model, opt, step, str(adir), asynchronous=True, **kw)))
        write.append(timed(checkpoint.flush))
        shutil.rmtree(adir / checkpoint.step_dir_name(step - 1))
        clone.append(timed(lambda: [t.detach().clone() for t in tensors]))
        cat.append(timed(lambda: torch.cat([t.detach().reshape(-1) for t in tensors])))
        sync.append(timed(lambda: checkpoint.save(view, model, opt, step, str(sdir), asynchronous=False, **kw)))
        shutil.rmtree(sdir / checkpoint.step_dir_name(step))
    checkpoint.finish(view)
    # The files of an asynchronous save are those of a synchronous one (the tests check it byte
    # for byte; here a spot check that the bench wrote what it claims).
    checkpoint.verify_step(str(adir / checkpoint.step_dir_name(step)))
    shutil.rmtree(adir)
    med = statistics.median
    return dict(width=width, size_mb=round(nbytes / 1e6, 1), tensors=len(tensors), stall_s=med(stall),
                memcpy_s=min(med(clone), med(cat)), clone_s=med(clone), cat_s=med(cat), sync_s=med(sync),
                write_s=med(write), stall_over_memcpy=med(stall) / min(med(clone), med(cat)),
                runs=dict(stall_s=stall, clone_s=clone, cat_s=cat, sync_s=sync))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--widths", default="128,384,832", help="hidden sizes (4 layers, vocab 1024): ~13/95/420 MB")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dir", help="where to write (default: a temporary directory, removed)")
    ap.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's; a rank of the tests: 1)")
    ap.add_argument("-o", dest="output", choices=["table", "json"], default="table")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    root = Path(args.dir or tempfile.mkdtemp(prefix="ckpt-stall-"))
    root.mkdir(parents=True, exist_ok=True)
    store = dist.FileStore(str(root / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    rows = []
    try:
        for w in (int(x) for x in args.widths.split(",")):
            r = measure(w, args.reps, root)
            rows.append(r)
            if args.output == "json":
                print(json.dumps(r), flush=True)
    finally:
        dist.destroy_process_group()
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    if args.output == "table":
        print(f"torch {torch.__version__}, {torch.get_num_threads()} intra-op threads, median of {args.reps}")
        print("| width | state MB | tensors | stall s | memcpy s (clone / cat) | stall / memcpy | sync save s | "
              "background write s |")
        print("|---:|---:|---:|---:|---|---:|---:|---:|")
        for r in rows:
            print(f"| {r['width']} | {r['size_mb']} | {r['tensors']} | {r['stall_s']:.4f} | {r['memcpy_s']:.4f} "
                  f"({r['clone_s']:.4f} / {r['cat_s']:.4f}) | {r['stall_over_memcpy']:.2f} | {r['sync_s']:.3f} | "
                  f"{r['write_s']:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
