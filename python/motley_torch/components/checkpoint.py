"""Checkpoints in Motley's format (docs/checkpoint.md): ranks write their units (one safetensors
file per block, part and TP shard), a per-rank file and their piece of the step's manifest into
$MOTLEY_CKPT_DIR; on a restart they read exactly the files $MOTLEY_CKPT_RESTORE lists.

    save(view, model, optimizer, step, directory, seed=..., global_batch=..., lr=...)  # collective
    finish(view)            # collective: after the last save (saves are written in the background)
    notice = save_notice.SaveNotice.from_env()  # $MOTLEY_CKPT_NOTICE (components/save_notice.py)
    if notice is not None and notice.due(view): save(...)  # collective: once per step, every rank
    step = restore(view, model, optimizer, restore_list(os.environ["MOTLEY_CKPT_RESTORE"]))
    verify_step(step_dir)   # every file's size and chunk crc32c against manifest.json

The re-slicing of units for another TP degree, and the reading of manifests by agents and the
coordinator, are the Rust crate `motley-checkpoint` (tool: `motley-ckpt`).
"""

from __future__ import annotations

import json
import os
import sys
import threading
from typing import Dict, List, Optional, Tuple

import torch

FORMAT = "motley-checkpoint/1"
CHUNK_BYTES = 16 << 20
MANIFEST = "manifest.json"
META_KEY = "motley"
# The generation whose files of the step a recovery's ranks load (set by the coordinator on a
# recovery's launch): a file another generation wrote is refused (docs/checkpoint.md).
RESTORE_GENERATION_ENV = "MOTLEY_CKPT_RESTORE_GENERATION"

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


def require_modules():
    """Checkpoints need the crc32c package (every file's chunks are checksummed): checked when
    the rank starts, not at its first save an interval later (a Python without it would lose
    every step up to there, and so would each restart)."""
    try:
        import crc32c  # noqa: F401
    except ImportError as e:
        raise CheckpointError(f"checkpoints need the crc32c package, which this Python ({sys.executable}) cannot "
                              f"import ({e}): pip install crc32c (python/README.md, \"What a rank's Python "
                              f"needs\")") from None


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
    from ..models.tp import ColumnParallelLinear, RowParallelLinear

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


def _units(model, optimizer, zero=None, masters=None) -> Dict[Tuple[object, str], Dict[str, Tuple[dict, torch.Tensor]]]:
    """(block, part) -> {tensor name: (spec, local tensor)}. Under ZeRO-1 (`zero`: a
    zero.ZeroOne), only the blocks this rank owns, from their fp32 masters; with half weights
    (`masters`: parameter -> its fp32 master, `half_weights.HalfWeights.master`), every block
    from its masters."""
    specs = param_specs(model)
    units: Dict[Tuple[object, str], Dict[str, Tuple[dict, torch.Tensor]]] = {}
    named = list(model.named_parameters())
    if getattr(model, "tied_here", False):
        # A tied head held by the embedding's stage is the embedding: written under head.weight
        # too, so that every checkpoint has the head's unit whatever stages restore it.
        specs["head.weight"] = specs["embed.weight"]
        named.append(("head.weight", model.embed.weight))
    held = zero.master if zero is not None else masters
    for name, p in named:
        b = block_of(name)
        spec = specs[name]
        if zero is not None and not zero.owns(b):
            continue
        if held is not None:
            p = held[p]
            spec = dict(spec, dtype=_DTYPES[p.dtype])
        units.setdefault((b, "model"), {})[name] = (spec, p)
        st = optimizer.state.get(p, {})
        for k in ("exp_avg", "exp_avg_sq"):
            if k in st:
                units.setdefault((b, "optimizer"), {})[f"{name}.{k}"] = (spec, st[k])
        if "step" in st:
            step = st["step"] if torch.is_tensor(st["step"]) else torch.tensor(float(st["step"]))
            units.setdefault((b, "optimizer"), {})[f"{name}.step"] = (
                {"shape": [], "dtype": "F32", "layout": {"kind": "replicated"}}, step.float().reshape(()))
    return units


# ---- save --------------------------------------------------------------------------------------
#
# A save stalls the rank only for a memory copy: save() snapshots every tensor of the checkpoint
# (and the RNG state) into host memory and hands the snapshot to one background writer thread,
# which serialises, crcs and writes the files (each atomically) and the rank's piece. At most one
# save is in flight: the next save() (or finish()) first waits for it, so memory is bounded by one
# copy. The merged manifest.json needs every rank's piece, hence a collective; collectives never
# run in the writer thread: the next save() / finish() joins the writer, then all ranks agree
# (one all-reduce, which is also the barrier) whether every rank's write succeeded, and rank 0
# merges the pieces. A failed write is raised there, on every rank (CheckpointError), so training
# ends non-zero. MOTLEY_CKPT_ASYNC=0 (or save(..., asynchronous=False)) writes in the caller, as
# before: no snapshot, the files, the all-reduce, the manifest, then return.


class _Pending:
    """The rank's one save in flight (or written but not yet agreed on); `pieces`: the ranks
    whose pieces make the step (every rank, or an epoch's members where the job kept going
    without a replica: the leader's piece lists the lost ranks' rank files)."""

    def __init__(self, step: int, sdir: str, pieces: List[int], rank: int):
        self.step, self.sdir, self.pieces, self.rank = step, sdir, pieces, rank
        self.thread = None  # threading.Thread while writing in the background
        self.error: BaseException = None


_pending: _Pending = None


def async_default() -> bool:
    """MOTLEY_CKPT_ASYNC: 0/false/no/off writes checkpoints synchronously; default asynchronous."""
    v = os.environ.get("MOTLEY_CKPT_ASYNC", "1").strip().lower()
    if v in ("0", "false", "no", "off"):
        return False
    if v in ("", "1", "true", "yes", "on"):
        return True
    raise CheckpointError(f"MOTLEY_CKPT_ASYNC: {v!r} is not 0 or 1")


def _snapshot(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", copy=True)


def writer_replica(view) -> int:
    """The replica whose stages write the units: the leader's (rank 0's, replica 0, until a
    membership without it names another leader: docs/keep-going.md). Every replica holds every
    layer, so any one whole replica writes the whole model."""
    leader = getattr(view, "leader", 0)
    # Global rank 0 is replica 0's first stage in every plan (ranks are numbered replica by
    # replica): no plan needed to say so.
    return 0 if leader == 0 else view.plan.stage_of(leader).replica


def _write_job(view, model, optimizer, step: int, sdir: str, seed: int, global_batch: int, lr: float,
               copy: bool, scaler: Optional[dict] = None, zero=None, hf_source: Optional[str] = None,
               lost_ranks: Tuple[int, ...] = (), masters=None):
    """Collect what step `step` writes (copied into host memory when `copy`) and return the
    function that writes it: the rank's units, its rank file (the leader also the lost ranks'),
    then its piece."""
    grab = _snapshot if copy else (lambda t: t)
    # The launch writing it (the agent's MOTLEY_GENERATION): recorded in every file's header, so
    # a restore can tell a step saved twice, by two launches, from one (docs/checkpoint.md).
    written_by = _writing_generation()
    piece = {"format": FORMAT, "step": step, "layers": model.spec.layers, "world_size": view.world_size,
             "units": [], "ranks": []}
    if lost_ranks:
        # Ranks of the plan that wrote nothing (their replica was lost, the job kept going): a
        # node's agent takes its step as whole without their pieces (docs/checkpoint.md).
        piece["lost_ranks"] = sorted(lost_ranks)
    todo = []  # (block, part, tp_rank, tp_size, specs, {name: tensor}, sharding or None)
    # Without ZeRO-1 the writer replica's first TP group writes every unit of its stage; with it,
    # each block's owner in its ring (the ring holds every copy of the block at this TP rank).
    if zero is not None or (view.replica == writer_replica(view) and view.stage_dp_rank == 0):
        for (block, part), tensors in sorted(_units(model, optimizer, zero, masters).items(), key=lambda kv: str(kv[0])):
            replicated = all(s["layout"]["kind"] == "replicated" for s, _ in tensors.values())
            if replicated and view.tp_rank != 0:
                continue
            tp_rank, tp_size = (0, 1) if replicated else (view.tp_rank, view.tp_size)
            todo.append((block, part, tp_rank, tp_size, {n: s for n, (s, _) in tensors.items()},
                         {n: grab(t) for n, (_, t) in tensors.items()},
                         zero.sharding(block) if zero is not None else None))
    rank_header = {"format": FORMAT, "step": step, "rank": view.rank, "world_size": view.world_size, "seed": seed,
                   "data": {"next_step": step, "samples": step * global_batch},
                   "model": model.spec.to_dict(),
                   **({"init_from_hf": hf_source} if hf_source else {}),
                   **({"scaler": scaler} if scaler is not None else {}),
                   "scheduler": {"kind": "constant", "lr": lr},
                   **({"generation": written_by} if written_by is not None else {})}
    rng = torch.get_rng_state()  # a new tensor: already a copy
    rank = view.rank
    # The leader writes each lost rank's rank file: what is not per layer is the same for every
    # rank but the RNG state, which a restore then takes from the leader's (as it takes the
    # lowest rank's where a re-planned job has ranks the step has no file of).
    stand_ins = sorted(lost_ranks) if rank == getattr(view, "leader", 0) else []

    def write():
        os.makedirs(sdir, mode=0o700, exist_ok=True)
        for block, part, tp_rank, tp_size, specs, tensors, sharding in todo:
            header = {"format": FORMAT, "step": step, "block": block_label(block), "part": part,
                      "tp_rank": tp_rank, "tp_size": tp_size, "tensors": specs}
            if written_by is not None:
                header["generation"] = written_by
            if sharding is not None:
                # Who wrote it: the ring's size and the owner's place in it when saved.
                header["sharding"] = sharding
            data = _safetensors_bytes(tensors, header)
            name = unit_file_name(block, part, tp_rank, tp_size)
            write_atomic(os.path.join(sdir, name), data)
            entry = {k: header[k] for k in ("block", "part", "tp_rank", "tp_size")}
            entry.update(file_entry(name, data))
            entry["tensors"] = specs
            piece["units"].append(entry)
            del data
        for r, header in [(rank, rank_header)] + [
                (r, dict(rank_header, rank=r, lost={"epoch": getattr(view, "epoch", 0), "rng_of_rank": rank}))
                for r in stand_ins]:
            data = _safetensors_bytes({"rng.torch": rng}, header)
            write_atomic(os.path.join(sdir, rank_file_name(r)), data)
            piece["ranks"].append(dict(rank=r, **file_entry(rank_file_name(r), data)))
        write_atomic(os.path.join(sdir, piece_file_name(rank)), json.dumps(piece, indent=1).encode())
        todo.clear()  # drop the snapshot as soon as it is written

    return write


def _run(job, p: _Pending):
    try:
        job()
    except BaseException as e:  # kept for the caller: raised on the next save() / finish()
        p.error = e
        print(f"motley_torch.checkpoint: rank {p.rank}: writing {p.sdir} failed: {e!r}", file=sys.stderr, flush=True)


def flush():
    """Wait for this rank's checkpoint write in flight, if any (local; no collective). Raises
    CheckpointError if it failed (and forgets it)."""
    global _pending
    p = _pending
    if p is None:
        return
    if p.thread is not None:
        p.thread.join()
        p.thread = None
    if p.error is not None:
        _pending = None
        raise CheckpointError(f"rank {p.rank}: writing checkpoint step {p.step} to {p.sdir} failed: "
                              f"{type(p.error).__name__}: {p.error}") from p.error


def pending_label() -> str:
    """The step of this rank's save still to be agreed on (`finish`), or "-": what the members of
    a job that keeps going compare when they meet (docs/keep-going.md)."""
    return "-" if _pending is None else str(_pending.step)


def give_up() -> Optional[int]:
    """Forget this rank's save still to be agreed on, once its writer is done (local; no
    collective): the step it was, or None. Its files stay without a manifest: never taken for a
    whole step (docs/checkpoint.md)."""
    global _pending
    p = _pending
    if p is None:
        return None
    try:
        flush()
    except CheckpointError as e:
        print(f"motley_torch.checkpoint: {e}", file=sys.stderr, flush=True)
    _pending = None
    return p.step


def _merge_manifest(sdir: str, ranks: List[int]):
    pieces = [os.path.join(sdir, piece_file_name(r)) for r in ranks]
    if all(os.path.exists(x) for x in pieces):
        write_atomic(os.path.join(sdir, MANIFEST), json.dumps(merge([_read_json(x) for x in pieces]), indent=1).encode())


def _agree_max(view, values: List[int]) -> List[int]:
    """Collective: each value's maximum over every rank (one int64 all-reduce)."""
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.int64, device=getattr(view, "device", "cpu"))
    work = dist.all_reduce(t, op=dist.ReduceOp.MAX, group=getattr(view, "world_group", None), async_op=True)
    view.wait(work) if hasattr(view, "wait") else work.wait()
    return [int(x) for x in t.tolist()]


def finish(view, _merge_later: bool = False):
    """Complete the checkpoint in flight: wait for this rank's writer, agree with every rank that
    all writes succeeded (an all-reduce: collective, every rank calls it, after its last save),
    then the leader (global rank 0, or the lowest rank of the members where the job kept going
    without a replica) writes the step's manifest.json when every piece is in its directory.
    Raises CheckpointError on every rank if any rank's write failed. No-op without a save.
    (`_merge_later`: return the manifest's writing as a function instead, for save's writer.)"""
    global _pending
    p = _pending
    if p is None:
        return None
    local = None
    try:
        flush()
    except CheckpointError as e:
        local = e
    # Forgotten before the agreement: one that fails (a member lost mid-collective, where a job
    # keeps going) gives the save up on this rank, and the next save must not agree on it again.
    # A collective can end on some ranks and fail on others; a rank still holding this save
    # would run one all-reduce more than its peers at the next save, and they would deadlock.
    _pending = None
    (failed,) = _agree_max(view, [1 if local is not None else 0])
    if local is not None:
        raise local
    if failed:
        raise CheckpointError(f"checkpoint step {p.step} ({p.sdir}): another rank's write failed (see its log); "
                              f"this step is incomplete")
    # The leader now: a step saved before a replica was lost is merged by the new leader, when
    # the pieces of every rank that saved it are there.
    if view.rank != getattr(view, "leader", 0):
        return None
    if _merge_later:
        return lambda: _merge_manifest(p.sdir, p.pieces)
    _merge_manifest(p.sdir, p.pieces)
    return None


def save(view, model, optimizer, step: int, directory: str, seed: int, global_batch: int, lr: float,
         asynchronous: bool = None, scaler: Optional[dict] = None, zero=None, hf_source: Optional[str] = None,
         lost_ranks: Tuple[int, ...] = (), masters=None) -> str:
    """Checkpoint step `step` (optimizer steps taken) under `directory`/step-S: this rank's units
    (the writer replica's first TP group of each stage; all-replicated blocks once, by TP rank
    0, as tp 0-1), its rank file and its manifest piece; the leader writes the merged
    manifest.json when every piece is in its directory. Collective: every rank of the view's
    world group calls it, at the same steps. `lost_ranks`: ranks of the plan that are not members
    (a job that kept going without their replica: docs/keep-going.md); they write nothing, the
    leader writes their rank files and the leader's replica the units. `masters`: as `_units`.

    Asynchronous (default; `asynchronous=False` or MOTLEY_CKPT_ASYNC=0: synchronous): first
    finish() the previous save (wait, agree, merge its manifest; raises if it failed), then copy
    this step's tensors and RNG state into host memory and return; a background thread writes
    them. The values saved are those at the call, whatever the caller does next. Call finish()
    after the last save. Returns the step directory."""
    if asynchronous is None:
        asynchronous = async_default()
    global _pending
    # The previous save: written by every rank (else raise); its manifest is merged by rank 0's
    # writer thread before this step's files (not in the caller's stall).
    merge_prev = finish(view, _merge_later=asynchronous)
    sdir = os.path.join(directory, step_dir_name(step))
    if lost_ranks and zero is not None:
        raise CheckpointError("lost_ranks: a ZeRO-1 step is every ring member's shards; such a job recovers whole "
                              "(docs/keep-going.md)")
    write = _write_job(view, model, optimizer, step, sdir, seed, global_batch, lr, copy=asynchronous, scaler=scaler,
                       zero=zero, hf_source=hf_source, lost_ranks=tuple(lost_ranks), masters=masters)
    job = write if merge_prev is None else (lambda: (merge_prev(), write()))
    lost = set(lost_ranks)
    p = _Pending(step, sdir, [r for r in range(view.world_size) if r not in lost], view.rank)
    _pending = p
    if asynchronous:
        p.thread = threading.Thread(target=_run, args=(job, p), name=f"motley-ckpt-{step}", daemon=False)
        p.thread.start()
    else:
        _run(job, p)
        finish(view)
    return sdir


def _read_json(path: str):
    with open(path) as f:
        return json.load(f)


def merge(pieces: List[dict]) -> dict:
    """The union of one step's pieces (docs/checkpoint.md; `Manifest::merge` in Rust)."""
    head = {k: pieces[0][k] for k in ("format", "step", "layers", "world_size")}
    units, ranks, lost = {}, {}, set()
    for p in pieces:
        for k, v in head.items():
            if p[k] != v:
                raise CheckpointError(f"{k}: {v} here, {p[k]} there; pieces of different steps or jobs were mixed")
        for u in p["units"]:
            units[(u["block"], u["part"], u["tp_rank"], u["tp_size"])] = u
        for r in p["ranks"]:
            ranks[r["rank"]] = r
        lost.update(p.get("lost_ranks", ()))
    out = dict(head, units=[units[k] for k in sorted(units)], ranks=[ranks[k] for k in sorted(ranks)])
    if lost:
        out["lost_ranks"] = sorted(lost)
    return out


def verify_step(step_dir: str) -> dict:
    """Every file of manifest.json: size and each chunk's crc32c; returns the manifest."""
    return verify_manifest(step_dir, _read_json(os.path.join(step_dir, MANIFEST)))


def step_manifest(step_dir: str) -> dict:
    """The step's manifest: manifest.json, or, where no node had every piece (a step written
    across nodes, as uploaded to the cloud), the merge of its pieces, which must be one per
    rank of the plan that wrote it; every file checked as verify_step does."""
    if os.path.exists(os.path.join(step_dir, MANIFEST)):
        return verify_step(step_dir)
    names = sorted(n for n in os.listdir(step_dir) if n.startswith("manifest.rank.") and n.endswith(".json"))
    if not names:
        raise CheckpointError(f"{step_dir}: neither {MANIFEST} nor manifest pieces: not a checkpoint step")
    m = merge([_read_json(os.path.join(step_dir, n)) for n in names])
    have = {r["rank"] for r in m["ranks"]}
    missing = sorted(set(range(m["world_size"])) - have)
    if missing:
        raise CheckpointError(f"{step_dir}: no manifest piece of rank {missing[0]} ({len(missing)} of "
                              f"{m['world_size']} missing): the step is incomplete; use a complete step")
    return verify_manifest(step_dir, m)


def verify_manifest(step_dir: str, m: dict) -> dict:
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


def _steps_here(zero, model, block) -> bool:
    """Whether the rank keeps a master of some parameter of the block: it owns the block, or
    the block holds the tied embedding/head, which every holder steps."""
    return any(block_of(n) == block and p in zero.master for n, p in model.named_parameters())


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


def _int_env(name: str) -> Optional[int]:
    value = os.environ.get(name, "").strip()
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise CheckpointError(f"{name}: {value!r} is not a generation number; unset it or give an integer") from None


def _writing_generation() -> Optional[int]:
    """The launch this rank runs in (MOTLEY_GENERATION, set by the agent), if any."""
    return _int_env("MOTLEY_GENERATION")


def check_generation(headers: Dict[str, dict], expected: Optional[int]) -> Optional[int]:
    """The one generation that wrote every file of `headers` (None: their writers recorded
    none). A step saved by two launches (one lost a node mid-save, the next saved it again) is
    two copies: files of both, or of another generation than `expected`, are refused."""
    by_generation: Dict[Optional[int], List[str]] = {}
    for p, h in headers.items():
        by_generation.setdefault(h.get("generation"), []).append(p)
    recorded = sorted(g for g in by_generation if g is not None)
    if len(by_generation) > 1:
        named = "; ".join(f"{by_generation[g][0]} by " + (f"generation {g}" if g is not None else "no recorded generation")
                          for g in sorted(by_generation, key=lambda g: (g is None, g or 0)))
        raise CheckpointError(f"MOTLEY_CKPT_RESTORE: the files listed were written by more than one launch ({named}); "
                              f"a step is restored from the files of one generation: list one generation's copy")
    found = recorded[0] if recorded else None
    if expected is not None and found is not None and found != expected:
        raise CheckpointError(f"{RESTORE_GENERATION_ENV} is {expected}, but the files listed were written by generation "
                              f"{found} (e.g. {by_generation[found][0]}); the restore placed another generation's copy of "
                              f"the step: restore it again")
    return found


def restore(view, model, optimizer, paths: List[str], position: Optional[dict] = None, zero=None,
            generation: Optional[int] = None, masters=None) -> int:
    """Load this rank's model and optimizer state, and its rank file, from exactly `paths`
    (docs/checkpoint.md, "Environment"); returns the step to resume at. Under ZeRO-1 (`zero`)
    every block's model unit is read, and the optimizer units of the blocks the rank owns now,
    whatever sharding wrote them; with half weights (`masters`, as `_units`) the masters and
    the optimizer state take the units, the half weights their cast. Every file must be of one
    step and one generation: the
    `generation` given, else $MOTLEY_CKPT_RESTORE_GENERATION's where it is set."""
    from safetensors.torch import load_file

    headers = {p: read_header(p) for p in paths}
    steps = {h["step"] for h in headers.values()}
    if len(steps) != 1:
        raise CheckpointError(f"MOTLEY_CKPT_RESTORE: files of steps {sorted(steps)}; list the files of one step")
    step = steps.pop()
    check_generation(headers, generation if generation is not None else _int_env(RESTORE_GENERATION_ENV))
    units = _units(model, optimizer)
    # The optimizer's state exists only after a step: make it (zeros) so the restore can fill it.
    needed = {(b, "model") for b, _ in units} | {(b, "optimizer") for b, _ in units
                                                 if zero is None or _steps_here(zero, model, b)}
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
    held = zero.master if zero is not None else masters
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
            if held is not None:
                if p not in held:
                    continue  # ZeRO-1: another rank steps it
                p = held[p]
                p.copy_(t.to(dtype=p.dtype, device=p.device))
            opt = loaded[(b, "optimizer")]
            st = {}
            for k in ("exp_avg", "exp_avg_sq"):
                key = f"{name}.{k}"
                if key not in opt:
                    raise CheckpointError(f"{chosen[(b, 'optimizer')]}: no tensor {key}")
                st[k] = opt[key].to(dtype=p.dtype, device=p.device).clone()
            st["step"] = opt[f"{name}.step"].float().reshape(()).clone()
            if optimizer.defaults.get("fused"):
                st["step"] = st["step"].to(p.device)  # the fused kernel reads it on the device
            optimizer.state[p] = st
    rank_files = {h["rank"]: p for p, h in headers.items() if "block" not in h}
    if not rank_files:
        raise CheckpointError("MOTLEY_CKPT_RESTORE: no rank file (rank.RRRRR.safetensors) listed; list one")
    rf = rank_files.get(view.rank, rank_files[min(rank_files)])
    torch.set_rng_state(load_file(rf)["rng.torch"])
    nxt = headers[rf]["data"]["next_step"]
    if nxt != step:
        raise CheckpointError(f"{rf}: data.next_step {nxt} is not the step {step} of the units")
    if position is not None:
        samples = headers[rf]["data"].get("samples")
        if isinstance(samples, bool) or not isinstance(samples, int) or samples < 0:
            raise CheckpointError(f"{rf}: data.samples {samples!r} is not a sample count")
        position["samples"] = samples
        position["scaler"] = headers[rf].get("scaler")
    return step


__all__ = ["CheckpointError", "save", "flush", "finish", "restore", "restore_list", "check_generation", "verify_step", "merge",
           "param_specs"]
