"""Checkpoints in Motley's format (docs/checkpoint.md): ranks write their units (one safetensors
file per block, part and TP shard), a per-rank file and their piece of the step's manifest into
$MOTLEY_CKPT_DIR; on a restart they read exactly the files $MOTLEY_CKPT_RESTORE lists.

    save(view, model, optimizer, step, directory, seed=..., global_batch=..., lr=...)  # collective
    step = restore(view, model, optimizer, restore_list(os.environ["MOTLEY_CKPT_RESTORE"]))
    verify_step(step_dir)   # every file's size and chunk crc32c against manifest.json

The re-slicing of units for another TP degree, and the reading of manifests by agents and the
coordinator, are the Rust crate `motley-checkpoint` (tool: `motley-ckpt`).
"""

from __future__ import annotations

import json
import os
from typing import Dict, List, Tuple

import torch

FORMAT = "motley-checkpoint/1"
CHUNK_BYTES = 16 << 20
MANIFEST = "manifest.json"
META_KEY = "motley"

_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
           torch.int64: "I64", torch.int32: "I32", torch.uint8: "U8", torch.int8: "I8", torch.bool: "BOOL"}


class CheckpointError(ValueError):
    """A checkpoint that cannot be written or restored; the message names the file or field and the fix."""


# ---- names -----------------------------------------------------------------------------------


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def block_label(block) -> str:
    return f"layer.{block}" if isinstance(block, int) else block


def unit_file_name(block, part: str, tp_rank: int, tp_size: int) -> str:
    b = f"layer.{block:05d}" if isinstance(block, int) else block
    return f"{b}.{part}.tp{tp_rank}-{tp_size}.safetensors"


def rank_file_name(rank: int) -> str:
    return f"rank.{rank:05d}.safetensors"


def piece_file_name(rank: int) -> str:
    return f"manifest.rank.{rank:05d}.json"


def block_of(name: str):
    """The block of a parameter: its layer (int), 'embed' or 'head'."""
    if name.startswith("layers."):
        return int(name.split(".")[1])
    if name.startswith(("embed.", "pos.")):
        return "embed"
    return "head"


# ---- files -------------------------------------------------------------------------------------


def chunk_crcs(data: bytes, chunk: int = CHUNK_BYTES) -> List[int]:
    import crc32c

    mv = memoryview(data)
    return [crc32c.crc32c(mv[i:i + chunk]) for i in range(0, len(data), chunk)]


def file_entry(name: str, data: bytes) -> dict:
    return {"file": name, "bytes": len(data), "chunk_bytes": CHUNK_BYTES, "crc32c": chunk_crcs(data)}


def write_atomic(path: str, data: bytes):
    """Written to PATH.tmp.PID (mode 0600: weights and optimizer state are the job's own),
    fsynced, renamed, the directory fsynced: never seen half-written."""
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


def _safetensors_bytes(tensors: Dict[str, torch.Tensor], header: dict) -> bytes:
    from safetensors.torch import save

    return save({k: v.detach().cpu().contiguous() for k, v in tensors.items()},
                metadata={META_KEY: json.dumps(header, sort_keys=True)})


def read_header(path: str) -> dict:
    """The `motley` header of a unit or rank file (its safetensors metadata), without its data."""
    from safetensors import safe_open

    try:
        with safe_open(path, framework="pt") as f:
            meta = f.metadata() or {}
    except Exception as e:  # safetensors raises its own types
        raise CheckpointError(f"{path}: not a safetensors file ({e})") from e
    if META_KEY not in meta:
        raise CheckpointError(f"{path}: no __metadata__.{META_KEY} header: not a Motley checkpoint file")
    h = json.loads(meta[META_KEY])
    if h.get("format") != FORMAT:
        raise CheckpointError(f"{path}: format {h.get('format')!r}, this reader reads {FORMAT!r}")
    return h


# ---- layouts of the reference model ---------------------------------------------------------


def param_specs(model) -> Dict[str, dict]:
    """Every parameter of a GPTStage: its global shape, dtype and layout (docs/checkpoint.md)."""
    from .tp import ColumnParallelLinear, RowParallelLinear

    hd = model.spec.hidden // model.spec.heads
    out = {}
    for name, p, tp_mod, attr in model.full_params():
        shape = list(model.full_shape(name, p, tp_mod))
        granule = hd if ".attn." in name else 1
        if isinstance(tp_mod, ColumnParallelLinear):
            layout = {"kind": "split", "axis": 0}
        elif isinstance(tp_mod, RowParallelLinear) and attr == "weight":
            layout = {"kind": "split", "axis": 1}
        else:
            layout = {"kind": "replicated"}
        if layout["kind"] == "split" and granule != 1:
            layout["granule"] = granule
        out[name] = {"shape": shape, "dtype": _DTYPES[p.dtype], "layout": layout}
    return out


def _units(model, optimizer) -> Dict[Tuple[object, str], Dict[str, Tuple[dict, torch.Tensor]]]:
    """(block, part) -> {tensor name: (spec, local tensor)}."""
    specs = param_specs(model)
    units: Dict[Tuple[object, str], Dict[str, Tuple[dict, torch.Tensor]]] = {}
    for name, p in model.named_parameters():
        b = block_of(name)
        units.setdefault((b, "model"), {})[name] = (specs[name], p)
        st = optimizer.state.get(p, {})
        for k in ("exp_avg", "exp_avg_sq"):
            if k in st:
                units.setdefault((b, "optimizer"), {})[f"{name}.{k}"] = (specs[name], st[k])
        if "step" in st:
            step = st["step"] if torch.is_tensor(st["step"]) else torch.tensor(float(st["step"]))
            units.setdefault((b, "optimizer"), {})[f"{name}.step"] = (
                {"shape": [], "dtype": "F32", "layout": {"kind": "replicated"}}, step.float().reshape(()))
    return units


# ---- save --------------------------------------------------------------------------------------


def save(view, model, optimizer, step: int, directory: str, seed: int, global_batch: int, lr: float) -> str:
    """Write step `step` (optimizer steps taken) under `directory`/step-S: this rank's units
    (replica 0's first TP group of each stage; all-replicated blocks once, by TP rank 0, as tp
    0-1), its rank file and its manifest piece; then, after a barrier, global rank 0 writes the
    merged manifest.json when every piece is in its directory. Collective: every rank calls it.
    Returns the step directory."""
    import torch.distributed as dist

    sdir = os.path.join(directory, step_dir_name(step))
    os.makedirs(sdir, exist_ok=True)
    piece = {"format": FORMAT, "step": step, "layers": model.spec.layers, "world_size": view.world_size,
             "units": [], "ranks": []}
    if view.replica == 0 and view.stage_dp_rank == 0:
        for (block, part), tensors in sorted(_units(model, optimizer).items(), key=lambda kv: str(kv[0])):
            replicated = all(s["layout"]["kind"] == "replicated" for s, _ in tensors.values())
            if replicated and view.tp_rank != 0:
                continue
            tp_rank, tp_size = (0, 1) if replicated else (view.tp_rank, view.tp_size)
            specs = {n: s for n, (s, _) in tensors.items()}
            header = {"format": FORMAT, "step": step, "block": block_label(block), "part": part,
                      "tp_rank": tp_rank, "tp_size": tp_size, "tensors": specs}
            data = _safetensors_bytes({n: t for n, (_, t) in tensors.items()}, header)
            name = unit_file_name(block, part, tp_rank, tp_size)
            write_atomic(os.path.join(sdir, name), data)
            entry = {k: header[k] for k in ("block", "part", "tp_rank", "tp_size")}
            entry.update(file_entry(name, data))
            entry["tensors"] = specs
            piece["units"].append(entry)
    rank_header = {"format": FORMAT, "step": step, "rank": view.rank, "world_size": view.world_size, "seed": seed,
                   "data": {"next_step": step, "samples": step * global_batch},
                   "scheduler": {"kind": "constant", "lr": lr}}
    data = _safetensors_bytes({"rng.torch": torch.get_rng_state()}, rank_header)
    write_atomic(os.path.join(sdir, rank_file_name(view.rank)), data)
    piece["ranks"].append(dict(rank=view.rank, **file_entry(rank_file_name(view.rank), data)))
    write_atomic(os.path.join(sdir, piece_file_name(view.rank)), json.dumps(piece, indent=1).encode())
    dist.barrier()
    if view.rank == 0:
        pieces = [os.path.join(sdir, piece_file_name(r)) for r in range(view.world_size)]
        if all(os.path.exists(p) for p in pieces):
            write_atomic(os.path.join(sdir, MANIFEST), json.dumps(merge([_read_json(p) for p in pieces]), indent=1).encode())
    return sdir


def _read_json(path: str):
    with open(path) as f:
        return json.load(f)


def merge(pieces: List[dict]) -> dict:
    """The union of one step's pieces (docs/checkpoint.md; `Manifest::merge` in Rust)."""
    head = {k: pieces[0][k] for k in ("format", "step", "layers", "world_size")}
    units, ranks = {}, {}
    for p in pieces:
        for k, v in head.items():
            if p[k] != v:
                raise CheckpointError(f"{k}: {v} here, {p[k]} there; pieces of different steps or jobs were mixed")
        for u in p["units"]:
            units[(u["block"], u["part"], u["tp_rank"], u["tp_size"])] = u
        for r in p["ranks"]:
            ranks[r["rank"]] = r
    return dict(head, units=[units[k] for k in sorted(units)], ranks=[ranks[k] for k in sorted(ranks)])


def verify_step(step_dir: str) -> dict:
    """Every file of manifest.json: size and each chunk's crc32c; returns the manifest."""
    m = _read_json(os.path.join(step_dir, MANIFEST))
    for e in [*m["units"], *m["ranks"]]:
        with open(os.path.join(step_dir, e["file"]), "rb") as f:
            data = f.read()
        if len(data) != e["bytes"]:
            raise CheckpointError(f"unit {e['file']}: {len(data)} bytes, the manifest says {e['bytes']}")
        for i, (got, want) in enumerate(zip(chunk_crcs(data, e["chunk_bytes"]), e["crc32c"])):
            if got != want:
                raise CheckpointError(f"unit {e['file']}: chunk {i} has crc32c {got:08x}, the manifest says {want:08x}")
    return m


# ---- restore -----------------------------------------------------------------------------------


def restore_list(value: str) -> List[str]:
    """MOTLEY_CKPT_RESTORE: a JSON list of absolute paths, or the path of a file holding one."""
    text = value.strip()
    where = "MOTLEY_CKPT_RESTORE"
    if not text.startswith("["):
        if not os.path.isfile(text):
            raise CheckpointError(f"{where}: {text!r} is neither a JSON list of paths nor a file holding one")
        where = f"MOTLEY_CKPT_RESTORE ({text})"
        with open(text) as f:
            text = f.read()
    try:
        paths = json.loads(text)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{where}: not JSON ({e}); give a list of absolute paths") from e
    if not isinstance(paths, list) or not all(isinstance(p, str) for p in paths):
        raise CheckpointError(f"{where}: expected a JSON list of absolute paths (strings)")
    for i, p in enumerate(paths):
        if not os.path.isabs(p):
            raise CheckpointError(f"{where}[{i}]: {p!r} is not an absolute path")
    return paths


def restore(view, model, optimizer, paths: List[str]) -> int:
    """Load this rank's model and optimizer state, and its rank file, from exactly `paths`
    (docs/checkpoint.md, "Environment"); returns the step to resume at."""
    from safetensors.torch import load_file

    headers = {p: read_header(p) for p in paths}
    steps = {h["step"] for h in headers.values()}
    if len(steps) != 1:
        raise CheckpointError(f"MOTLEY_CKPT_RESTORE: files of steps {sorted(steps)}; list the files of one step")
    step = steps.pop()
    units = _units(model, optimizer)
    # The optimizer's state exists only after a step: make it (zeros) so the restore can fill it.
    needed = set(units) | {(b, "optimizer") for b, _ in units}
    chosen: Dict[Tuple[object, str], str] = {}
    for block, part in sorted(needed, key=str):
        label = block_label(block)
        mine, others = None, []
        for p, h in headers.items():
            if h.get("block") != label or h.get("part") != part:
                continue
            replicated = all(s["layout"]["kind"] == "replicated" for s in h["tensors"].values())
            if (h["tp_rank"], h["tp_size"]) == (view.tp_rank, view.tp_size) or (h["tp_size"] == 1 and replicated):
                mine = p
            else:
                others.append(f"{h['tp_rank']}/{h['tp_size']}")
        if mine is None:
            fix = (f"only tp {', '.join(others)} listed: re-slice it for tp {view.tp_size} (motley-ckpt reslice)"
                   if others else "list its unit file")
            raise CheckpointError(f"MOTLEY_CKPT_RESTORE: no unit of {label} {part} for tp rank "
                                  f"{view.tp_rank}/{view.tp_size} among the {len(paths)} files listed; {fix}")
        chosen[(block, part)] = mine
    loaded = {}
    for key, p in chosen.items():
        loaded[key] = load_file(p)
    with torch.no_grad():
        for name, p in model.named_parameters():
            b = block_of(name)
            src = loaded[(b, "model")]
            if name not in src:
                raise CheckpointError(f"{chosen[(b, 'model')]}: no tensor {name}: the checkpoint is of another model")
            t = src[name]
            if tuple(t.shape) != tuple(p.shape):
                raise CheckpointError(f"{chosen[(b, 'model')]}: {name} is {list(t.shape)}, this rank holds "
                                      f"{list(p.shape)}; re-slice for tp {view.tp_size} (motley-ckpt reslice)")
            p.copy_(t.to(dtype=p.dtype, device=p.device))
            opt = loaded[(b, "optimizer")]
            st = {}
            for k in ("exp_avg", "exp_avg_sq"):
                key = f"{name}.{k}"
                if key not in opt:
                    raise CheckpointError(f"{chosen[(b, 'optimizer')]}: no tensor {key}")
                st[k] = opt[key].to(dtype=p.dtype, device=p.device).clone()
            st["step"] = opt[f"{name}.step"].float().reshape(()).clone()
            optimizer.state[p] = st
    rank_files = {h["rank"]: p for p, h in headers.items() if "block" not in h}
    if not rank_files:
        raise CheckpointError("MOTLEY_CKPT_RESTORE: no rank file (rank.RRRRR.safetensors) listed; list one")
    rf = rank_files.get(view.rank, rank_files[min(rank_files)])
    torch.set_rng_state(load_file(rf)["rng.torch"])
    nxt = headers[rf]["data"]["next_step"]
    if nxt != step:
        raise CheckpointError(f"{rf}: data.next_step {nxt} is not the step {step} of the units")
    return step


__all__ = ["CheckpointError", "save", "restore", "restore_list", "verify_step", "merge", "param_specs"]
