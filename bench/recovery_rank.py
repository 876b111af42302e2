#!/usr/bin/env python3
"""The rank program of `bench/recovery` (docs/recovery.md): a stand-in for a GPT-3 trainer's rank that
writes one checkpoint step of the right (scaled) sizes in Motley's format (docs/checkpoint.md)
and then waits to be killed; relaunched by a recovery (MOTLEY_CKPT_RESTORE set), it checks that
every file it needs is listed and present, and exits 0.

    recovery_rank.py --model gpt3-6.7b [--scale 1000] [--step 1]

Sizes: 14 bytes per parameter (model part: fp16 weights, 2 B; optimizer part: fp32 master,
exp_avg, exp_avg_sq, 12 B), parameters as bench/restore_plan.py counts them (12h^2 + 13h per
layer, (51200 + 2048) h embedding, 2h head), divided by --scale. Each unit holds one weight
split along axis 0 (every TP rank writes its shard); the head (the final norm) is replicated
and written once, as TP 0 of 1. Only replica 0's first TP group of each stage writes units
(stage_dp_rank 0), every rank writes its rank file and its manifest piece.

No torch: the safetensors files are written by hand (a rank of a 16-GPU emulated cluster on a
2-core machine must start in milliseconds); names, crcs and the atomic write follow
python/motley_torch/components/checkpoint.py.
"""

import argparse
import json
import os
import struct
import sys
import time

FORMAT = "motley-checkpoint/1"
CHUNK_BYTES = 16 << 20
MODELS = {"gpt3-2.7b": (32, 2560), "gpt3-6.7b": (32, 4096), "gpt3-13b": (40, 5120), "gpt3-20b": (44, 6144)}
VOCAB, SEQ = 51200, 2048
GRAIN = 64  # element counts are multiples of this: any TP degree up to 64 divides them


def env_int(name):
    v = os.environ.get(name)
    if v is None:
        sys.exit(f"recovery_rank: {name} is not set (run me as a rank of a Motley job)")
    return int(v)


def params(block, hidden):
    if block == "embed":
        return (VOCAB + SEQ) * hidden
    if block == "head":
        return 2 * hidden
    return 12 * hidden * hidden + 13 * hidden


def elements(p, scale):
    n = -(-p // scale)
    return -(-n // GRAIN) * GRAIN


# ---- the format's names, crcs and atomic writes (as motley_torch.components.checkpoint) --------------------

def step_dir_name(step):
    return f"step-{step:08d}"


def unit_file_name(block, part, tp_rank, tp_size):
    b = f"layer.{block:05d}" if isinstance(block, int) else block
    return f"{b}.{part}.tp{tp_rank}-{tp_size}.safetensors"


def block_label(block):
    return f"layer.{block}" if isinstance(block, int) else block


def chunk_crcs(data):
    import crc32c

    mv = memoryview(data)
    return [crc32c.crc32c(mv[i:i + CHUNK_BYTES]) for i in range(0, len(data), CHUNK_BYTES)]


def file_entry(name, data):
    return {"file": name, "bytes": len(data), "chunk_bytes": CHUNK_BYTES, "crc32c": chunk_crcs(data)}


def write_atomic(path, data):
    d = os.path.dirname(path) or "."
    os.makedirs(d, mode=0o700, exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


SIZES = {"F16": 2, "F32": 4, "U8": 1}


def safetensors_bytes(tensors, meta):
    """tensors: [(name, dtype, shape, bytes)] -> the safetensors file (header padded to 8)."""
    header = {"__metadata__": {"motley": json.dumps(meta, sort_keys=True)}}
    at = 0
    for name, dtype, shape, data in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [at, at + len(data)]}
        at += len(data)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    return b"".join([struct.pack("<Q", len(h)), h] + [t[3] for t in tensors])


# ---- what this rank writes ----------------------------------------------------------------------

def blocks_of(stage, pp_size, lo, hi):
    out = list(range(lo, hi))
    if stage == 0:
        out.insert(0, "embed")
    if stage + 1 == pp_size:
        out.append("head")
    return out


def unit(block, part, tp_rank, tp_size, hidden, scale, step):
    n = elements(params(block, hidden), scale)
    replicated = block == "head"
    if replicated:
        tp_rank, tp_size = 0, 1
    local = n // tp_size
    layout = {"kind": "replicated"} if replicated else {"kind": "split", "axis": 0}
    base = f"{'layers.' + str(block) if isinstance(block, int) else block}.weight"
    if part == "model":
        names = [(base, "F16")]
    else:
        names = [(f"{base}.master", "F32"), (f"{base}.exp_avg", "F32"), (f"{base}.exp_avg_sq", "F32")]
    specs = {nm: {"shape": [n], "dtype": dt, "layout": layout} for nm, dt in names}
    tensors = [(nm, dt, [local], os.urandom(local * SIZES[dt])) for nm, dt in names]
    header = {"format": FORMAT, "step": step, "block": block_label(block), "part": part,
              "tp_rank": tp_rank, "tp_size": tp_size, "tensors": specs}
    return unit_file_name(block, part, tp_rank, tp_size), header, specs, safetensors_bytes(tensors, header)


def save(args, hidden, layers):
    rank, world = env_int("RANK"), env_int("WORLD_SIZE")
    stage, pp = env_int("MOTLEY_STAGE"), env_int("MOTLEY_PP_SIZE")
    lo, hi = env_int("MOTLEY_LAYER_START"), env_int("MOTLEY_LAYER_END")
    tp_rank, tp_size = env_int("MOTLEY_TP_RANK"), env_int("MOTLEY_TP_SIZE")
    replica, sdp = env_int("MOTLEY_REPLICA"), env_int("MOTLEY_STAGE_DP_RANK")
    sdir = os.path.join(os.environ["MOTLEY_CKPT_DIR"], step_dir_name(args.step))
    piece = {"format": FORMAT, "step": args.step, "layers": layers, "world_size": world, "units": [], "ranks": []}
    t0 = time.time()
    written = 0
    if replica == 0 and sdp == 0:
        for block in blocks_of(stage, pp, lo, hi):
            if block == "head" and tp_rank != 0:
                continue  # replicated: written once
            for part in ("model", "optimizer"):
                name, header, specs, data = unit(block, part, tp_rank, tp_size, hidden, args.scale, args.step)
                write_atomic(os.path.join(sdir, name), data)
                e = {k: header[k] for k in ("block", "part", "tp_rank", "tp_size")}
                e.update(file_entry(name, data))
                e["tensors"] = specs
                piece["units"].append(e)
                written += len(data)
    rank_meta = {"format": FORMAT, "step": args.step, "rank": rank, "world_size": world, "seed": 0,
                 "data": {"next_step": args.step, "samples": args.step * 64},
                 "scheduler": {"kind": "constant", "lr": 1e-4}}
    rname = f"rank.{rank:05d}.safetensors"
    data = safetensors_bytes([("rng.torch", "U8", [16], bytes(16))], rank_meta)
    write_atomic(os.path.join(sdir, rname), data)
    piece["ranks"].append(dict(rank=rank, **file_entry(rname, data)))
    write_atomic(os.path.join(sdir, f"manifest.rank.{rank:05d}.json"), json.dumps(piece, indent=1).encode())
    print(json.dumps({"rank": rank, "saved_step": args.step, "bytes": written, "units": len(piece["units"]),
                      "s": round(time.time() - t0, 3)}), flush=True)


def check_restore(value, hidden):
    text = value
    if not value.lstrip().startswith("["):
        with open(value) as f:
            text = f.read()
    paths = json.loads(text)
    missing = [p for p in paths if not os.path.isfile(p)]
    if missing:
        sys.exit(f"recovery_rank: MOTLEY_CKPT_RESTORE lists {len(missing)} files that are not there: {missing[:3]}")
    names = {os.path.basename(p) for p in paths}
    stage, pp = env_int("MOTLEY_STAGE"), env_int("MOTLEY_PP_SIZE")
    lo, hi = env_int("MOTLEY_LAYER_START"), env_int("MOTLEY_LAYER_END")
    tp_rank, tp_size = env_int("MOTLEY_TP_RANK"), env_int("MOTLEY_TP_SIZE")
    need = []
    for block in blocks_of(stage, pp, lo, hi):
        for part in ("model", "optimizer"):
            mine = unit_file_name(block, part, tp_rank, tp_size)
            if mine not in names and unit_file_name(block, part, 0, 1) not in names:
                need.append(mine)
    if need:
        sys.exit(f"recovery_rank: the restore list lacks {len(need)} of this rank's units: {need[:3]}")
    if not any(n.startswith("rank.") for n in names):
        sys.exit("recovery_rank: the restore list has no rank file")
    print(json.dumps({"rank": env_int("RANK"), "restored_files": len(paths), "units_checked": 2 * len(blocks_of(stage, pp, lo, hi))}),
          flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, choices=sorted(MODELS))
    p.add_argument("--scale", type=int, default=1000, help="bytes are divided by this (default 1000)")
    p.add_argument("--step", type=int, default=1, help="the step the checkpoint is of (default 1)")
    args = p.parse_args()
    layers, hidden = MODELS[args.model]
    restore = os.environ.get("MOTLEY_CKPT_RESTORE")
    if restore:
        check_restore(restore, hidden)
        return
    save(args, hidden, layers)
    while True:  # a long training run: the benchmark kills this node, or the recovery stops it
        time.sleep(3600)


if __name__ == "__main__":
    main()
