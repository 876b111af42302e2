"""Layer profiler: `python -m motley_torch.profile`, Motley's profiles file (`motley plan --profiles`).

    python -m motley_torch.profile --model m.yaml --tp 2 --micro-batch 4 [--seq-len 1024]
        [--gpu A100-80G] [--output profiles.yaml] [--warmup 3] [--runs 10] [--dtype bf16]

Times the forward and the backward of n = 1, 2, 4, 8 consecutive transformer layers (AutoHet's
eq. 5: any other depth is a sum of these blocks, 3 = 2+1, 5 = 4+1, 6 = 4+2, 7 = 4+2+1), built
with motley_torch's own layer code (`model.Block`, Megatron-split over the TP group) at TP
degree --tp: for tp > 1 the tp ranks run together as tp processes on localhost (gloo on the
CPU, NCCL on CUDA, as the trainer does), every rank running the same layers on its shard, and
rank 0 (this process) records its own times and writes the file. Each time is the median of
--runs runs after --warmup runs: CUDA events on a GPU, the thread's CPU time
(`time.thread_time()`) on the CPU, where each rank computes with one intra-op thread so that the
calling thread's CPU time is all of its compute (the gloo all-reduces run in gloo's threads:
on the CPU their time is not in the layer's time). `--clock wall` times the CPU by the wall
clock instead, and keeps the mean: an emulated GPU (docs/emulation.md) is a CPU share the kernel
enforces by stopping the process every few milliseconds, time that the thread's CPU clock does
not count; a pass may fall between two stops or across one, so only the mean over many runs
converges on the share (the agent of an emulating node asks for the wall clock and 20 runs).

Also measured: the activation memory of one layer for one micro-batch (bytes of the tensors
autograd saves for backward, over `saved_tensors_hooks`, each storage counted once and the
parameters not at all; on CUDA cross-checked against `torch.cuda.memory_allocated` /
`max_memory_allocated`, a warning on stderr when they disagree), the fixed memory of one layer's
TP shard (parameters + gradients + AdamW's two moments, in the parameter dtype as the trainer
keeps them), the embedding's and the final LN + head + loss' forward/backward times, and the
AdamW step per layer, timed over eight layers' parameters at once as a stage steps them, each
step after a backward pass over them (`optimizer_layers`: fewer where a GPU's free memory could
not hold eight layers' state).

One entry per (gpu, tp, micro_batch) under `profiles:`; with --output FILE an existing entry for
the same key is replaced and the others kept (written to a temporary name, then renamed);
without --output the YAML goes to stdout.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

from ..components.cpu_share import CpuShareError, enter_share

BLOCKS = (1, 2, 4, 8)
DTYPE_NAMES = ("fp32", "bf16", "fp16")
MIB = float(1 << 20)
PROG = "python -m motley_torch.profile"


class ProfileError(Exception):
    """Bad input; the message starts with the flag at fault."""


# ---------------------------------------------------------------------------------------------
# Arguments, model, hash
# ---------------------------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Measure per-layer forward/backward times and memory of a Motley model at a TP degree "
                    "and micro-batch size, and write them as a Motley profiles file (motley plan --profiles).")
    p.add_argument("--model", required=True, metavar="M", help="model YAML file (name, layers, hidden, heads, "
                   "seq_len, vocab, optional ffn_hidden, kv_heads, gated_mlp)")
    p.add_argument("--tp", required=True, type=int, metavar="T", help="tensor-parallel degree (a power of two); "
                   "tp > 1 runs T processes on localhost")
    p.add_argument("--micro-batch", required=True, type=int, metavar="B", help="sequences per micro-batch")
    p.add_argument("--seq-len", type=int, metavar="S", help="tokens per sequence (default: the model's seq_len)")
    p.add_argument("--gpu", metavar="NAME", help="GPU type name the entry is for (default: the CUDA device's "
                   "name, or CPU)")
    p.add_argument("--output", metavar="FILE", help="profiles file to create or update (default: print to stdout)")
    p.add_argument("--warmup", type=int, default=2, metavar="W", help="untimed runs first (default 2)")
    p.add_argument("--runs", type=int, default=5, metavar="R", help="timed runs; the median is kept (default 5)")
    p.add_argument("--clock", choices=("auto", "wall"), default="auto",
                   help="auto: CUDA events on a GPU, the thread's CPU time on the CPU; wall: the wall clock on "
                        "the CPU (an emulated GPU, whose CPU share the kernel enforces by stopping the process)")
    p.add_argument("--dtype", choices=DTYPE_NAMES, default="fp32", help="parameter and activation type (default fp32)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds the TP ranks wait for each other")
    p.add_argument("--compile", choices=("auto", "on", "off"), default="auto",
                   help="time the blocks compiled as the trainer runs them (its --compile; auto: on for CUDA)")
    # Internal: the extra TP ranks this command starts for tp > 1.
    p.add_argument("--worker-rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--store-port", type=int, default=0, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def load_spec(ref: str):
    """The model spec of a model file (or, when `ref` does not look like a path, a catalog
    name resolved by `motley model show`)."""
    from ..model_source import load_model
    from ..spec import PlanError

    looks_like_path = os.sep in ref or ref.endswith((".yaml", ".yml", ".json"))
    if looks_like_path and not os.path.isfile(ref) and not os.path.isdir(ref):
        raise ProfileError(f"--model: no such model file or Hugging Face directory: {ref}")
    try:
        return load_model(ref)
    except PlanError as e:
        msg = str(e)
        raise ProfileError(msg if msg.startswith("--model") else f"--model: {msg}")
    except Exception as e:  # unreadable YAML and the like
        raise ProfileError(f"--model: cannot read {ref}: {e}")


def canonical_spec(spec) -> dict:
    """What the hash covers: the nine shape fields, defaults filled in (ffn_hidden 4*hidden,
    kv_heads heads, gated_mlp false), plus `family` and `qkv_bias` for family llama (so a gpt
    model's hash is what it always was) and `o_bias` when true (so a model without one keeps its
    hash). No floats: Python and Rust print them differently, and norm_eps or the rotary
    settings change no time or memory. coordinator/src/planning/profiling.rs canonical_json is the same."""
    d = spec.to_dict()
    out = {k: d[k] for k in ("name", "layers", "hidden", "heads", "seq_len", "vocab", "ffn_hidden",
                             "kv_heads", "gated_mlp")}
    if d.get("family", "gpt") != "gpt":
        out["family"] = d["family"]
        out["qkv_bias"] = d["qkv_bias"]
        if d.get("o_bias"):
            out["o_bias"] = True
    return out


def model_hash(spec) -> str:
    """sha256 hex of the spec as canonical JSON (sorted keys, no spaces)."""
    text = json.dumps(canonical_spec(spec), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def validate(args, spec) -> int:
    """Checks that need no torch; returns the sequence length."""
    if args.tp < 1 or args.tp & (args.tp - 1):
        raise ProfileError(f"--tp: {args.tp} is not a power of two")
    if args.micro_batch < 1:
        raise ProfileError(f"--micro-batch: {args.micro_batch}, must be at least 1")
    seq = spec.seq_len if args.seq_len is None else args.seq_len
    if seq < 1:
        raise ProfileError(f"--seq-len: {seq}, must be at least 1")
    if args.warmup < 0:
        raise ProfileError(f"--warmup: {args.warmup}, must be at least 0")
    if args.runs < 1:
        raise ProfileError(f"--runs: {args.runs}, must be at least 1")
    for what, n in (("heads", spec.heads), ("kv_heads", spec.kv_heads), ("ffn_hidden", spec.ffn_hidden)):
        if n % args.tp:
            raise ProfileError(f"--tp: {args.tp} does not divide the model's {what} ({n})")
    if args.output is not None and os.path.isdir(args.output):
        raise ProfileError(f"--output: {args.output} is a directory")
    return seq


# ---------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------


class Timer:
    """Milliseconds of a callable: CUDA events on a GPU, the thread's CPU time on the CPU (the
    wall clock there with `wall`)."""

    def __init__(self, device, wall: bool = False):
        import torch

        self.torch = torch
        self.clock = time.perf_counter if wall else time.thread_time
        # What a measurement keeps of its runs: the median, robust to a stray slow run; on the
        # wall clock of an emulated device the mean (module docstring).
        self.keep = statistics.mean if wall else statistics.median
        self.cuda = device.type == "cuda"

    def sync(self):
        if self.cuda:
            self.torch.cuda.synchronize()

    def __call__(self, fn: Callable[[], object]) -> Tuple[float, object]:
        if self.cuda:
            a = self.torch.cuda.Event(enable_timing=True)
            b = self.torch.cuda.Event(enable_timing=True)
            a.record()
            out = fn()
            b.record()
            b.synchronize()
            return float(a.elapsed_time(b)), out
        t0 = self.clock()
        out = fn()
        return (self.clock() - t0) * 1e3, out


class Ctx:
    """What every measurement needs: device, dtype, TP group, the shape of a micro-batch."""

    def __init__(self, args, spec, seq: int, rank: int, group):
        import torch

        self.args, self.spec, self.seq, self.rank, self.group = args, spec, seq, rank, group
        self.tp = args.tp
        self.dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        self.timer = Timer(self.device, wall=getattr(args, "clock", "auto") == "wall")
        # The trainer's --compile rule, so a profile times what runs.
        from ..components.stage_init import compiles

        choice = getattr(args, "compile", "off")
        self.compiled = compiles(choice, self.device)
        self.gen = torch.Generator(device="cpu").manual_seed(1234)

    def randn(self, *shape, requires_grad=False):
        import torch

        t = torch.randn(*shape, generator=self.gen).to(device=self.device, dtype=self.dtype)
        return t.requires_grad_(requires_grad)

    def align(self):
        """All TP ranks start a timed run together (untimed)."""
        import torch
        import torch.distributed as dist

        self.timer.sync()
        if self.tp > 1:
            dist.all_reduce(torch.zeros(1, device=self.device), group=self.group)
            self.timer.sync()

    def blocks(self, n: int):
        import torch
        from torch import nn

        from ..models.transformer import Block

        torch.manual_seed(1000 + n)
        m = nn.Sequential(*[Block(self.spec, self.group, self.rank, self.tp) for _ in range(n)])
        m = m.to(device=self.device, dtype=self.dtype)
        if self.compiled:
            for blk in m:
                blk.compile(dynamic=False)
        return m


def median_fwd_bwd(ctx: Ctx, make_fwd: Callable[[], object], bwd: Callable[[object], None],
                   zero: Callable[[], None], collective: bool = True) -> Tuple[float, float]:
    """Median forward and backward milliseconds over --runs runs after --warmup runs.
    `collective`: every TP rank runs this (TP layers); else rank 0 alone (replicated parts)."""
    sync = ctx.align if collective else ctx.timer.sync
    fw, bw = [], []
    for i in range(ctx.args.warmup + ctx.args.runs):
        zero()
        sync()
        tf, out = ctx.timer(make_fwd)
        sync()
        tb, _ = ctx.timer(lambda: bwd(out))
        del out
        if i >= ctx.args.warmup:
            fw.append(tf)
            bw.append(tb)
    return ctx.timer.keep(fw), ctx.timer.keep(bw)


def _zero_grads(module):
    def zero():
        for p in module.parameters():
            p.grad = None
    return zero


def time_blocks(ctx: Ctx, n: int) -> Tuple[float, float]:
    m = ctx.blocks(n)
    b, s, h = ctx.args.micro_batch, ctx.seq, ctx.spec.hidden
    x = ctx.randn(b, s, h, requires_grad=True)
    dy = ctx.randn(b, s, h)

    def fwd():
        x.grad = None
        return m(x)

    return median_fwd_bwd(ctx, fwd, lambda y: y.backward(dy), _zero_grads(m))


def time_embedding(ctx: Ctx) -> Tuple[float, float]:
    """The first stage's extra: token + position embeddings (replicated over TP)."""
    import torch

    from ..models.transformer import GPTStage

    torch.manual_seed(7)
    emb = GPTStage(ctx.spec, ctx.seq, (0, 0)).to(device=ctx.device, dtype=ctx.dtype)
    tokens = torch.randint(0, ctx.spec.vocab, (ctx.args.micro_batch, ctx.seq), generator=ctx.gen).to(ctx.device)
    dy = ctx.randn(ctx.args.micro_batch, ctx.seq, ctx.spec.hidden)
    return median_fwd_bwd(ctx, lambda: emb(tokens), lambda y: y.backward(dy), _zero_grads(emb), collective=False)


def time_head(ctx: Ctx) -> Tuple[float, float]:
    """The last stage's extra: final LN + head + the trainer's token-summed cross-entropy (its
    chunked head loss, models/head_loss.py)."""
    import torch

    from ..models.transformer import GPTStage

    torch.manual_seed(8)
    L = ctx.spec.layers
    head = GPTStage(ctx.spec, ctx.seq, (L, L)).to(device=ctx.device, dtype=ctx.dtype)
    head.compiled = ctx.compiled
    b, s = ctx.args.micro_batch, ctx.seq
    x = ctx.randn(b, s, ctx.spec.hidden, requires_grad=True)
    tgt = torch.randint(0, ctx.spec.vocab, (b * s,), generator=ctx.gen).to(ctx.device)
    scale = 1.0 / (b * s)

    def fwd():
        x.grad = None
        return head.loss(x, tgt, grad_scale=scale) * scale

    return median_fwd_bwd(ctx, fwd, lambda loss: loss.backward(), _zero_grads(head), collective=False)


def optimizer_layers(layer_bytes: int, free_bytes: Optional[int]) -> int:
    """How many layers the optimizer step is timed over: the deepest of BLOCKS whose parameters,
    gradients and AdamW's two moments (4 x `layer_bytes` a layer) take at most half of
    `free_bytes` (a GPU's free memory; None on the CPU, where the blocks' timing already held
    them). A stage steps all its layers at once, far more than any cache holds, and one layer's
    step run again and again keeps its state in the cache: timed that way on a 2-core Xeon a
    layer of bench/mixed/model.yaml stepped in 2.5-2.75 ms of CPU, where the trainer's step of
    eight took 3.9 ms a layer and the same step over eight layers here, each after a backward
    pass, 3.55-4.0 (bench/optimizer_probe.py; BENCHMARKS.md, "The optimizer step as a stage runs
    it")."""
    if layer_bytes <= 0:
        raise ValueError("layer_bytes must be positive")
    fits = [n for n in BLOCKS if free_bytes is None or 4 * n * layer_bytes <= free_bytes // 2]
    return max(fits, default=BLOCKS[0])


def optimizer_and_fixed(ctx: Ctx) -> Tuple[float, int, int]:
    """(AdamW step ms per layer, timed over `optimizer_layers` layers' parameters at once; one
    layer's fixed bytes: parameters + gradients + AdamW's exp_avg and exp_avg_sq; one layer's
    parameter count of the shard)."""
    from types import SimpleNamespace

    import torch

    from ..components.stage_init import make_optimizer

    n = optimizer_layers(1, None)  # on the CPU: the blocks' timing already held the deepest stack
    if ctx.device.type == "cuda":
        one = ctx.blocks(1)
        layer_bytes = sum(p.numel() * p.element_size() for p in one.parameters())
        del one
        torch.cuda.empty_cache()
        n = optimizer_layers(layer_bytes, torch.cuda.mem_get_info(ctx.device)[0])
        # The TP ranks run the stack's forward and backward together: one depth for all of them.
        if ctx.tp > 1:
            import torch.distributed as dist

            t = torch.tensor([n], device=ctx.device)
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=ctx.group)
            n = int(t.item())
    m = ctx.blocks(n)
    x = ctx.randn(ctx.args.micro_batch, ctx.seq, ctx.spec.hidden)
    zero = _zero_grads(m)

    def backward():
        zero()
        m(x).float().square().mean().backward()

    backward()
    # The trainer's optimizer and kernel (stage_init.make_optimizer), state in the parameter dtype.
    opt = make_optimizer(m.parameters(), SimpleNamespace(lr=1e-3, weight_decay=0.01))
    times = []
    for i in range(ctx.args.warmup + ctx.args.runs):
        # Each step after a backward pass over the stack, as a step comes after the last
        # micro-batch's backward (untimed): what the step reads is where a training step finds it.
        backward()
        ctx.timer.sync()
        t, _ = ctx.timer(opt.step)
        if i >= ctx.args.warmup:
            times.append(t / n)
    fixed, count = 0, 0
    for p in m[0].parameters():
        count += p.numel()
        fixed += p.numel() * p.element_size() + p.grad.numel() * p.grad.element_size()
        st = opt.state[p]
        for k in ("exp_avg", "exp_avg_sq"):
            fixed += st[k].numel() * st[k].element_size()
    return ctx.timer.keep(times), fixed, count


def activation_bytes(ctx: Ctx) -> int:
    """Bytes autograd keeps for the backward of ONE layer over one micro-batch: every tensor
    saved for backward (the layer's input included), each storage once, parameters excluded."""
    import torch

    m = ctx.blocks(1)
    params = {p.untyped_storage().data_ptr() for p in m.parameters()}
    x = ctx.randn(ctx.args.micro_batch, ctx.seq, ctx.spec.hidden, requires_grad=True)
    seen: Dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        ptr = st.data_ptr()
        if ptr not in params and ptr not in seen:
            seen[ptr] = st.nbytes()
        return t

    cuda = ctx.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = m(x)
    counted = sum(seen.values())
    if cuda:
        torch.cuda.synchronize()
        kept = torch.cuda.memory_allocated() - base - y.untyped_storage().nbytes()
        peak = torch.cuda.max_memory_allocated() - base
        # The input x was allocated before `base`: the allocator's count of what the forward
        # left behind excludes it, the hooks' count includes it.
        kept += x.untyped_storage().nbytes()
        if abs(kept - counted) > max(0.1 * counted, 1 << 20) and ctx.rank == 0:
            print(f"{PROG}: warning: activation memory per layer: saved tensors {counted / MIB:.2f} MiB, "
                  f"CUDA allocator {kept / MIB:.2f} MiB kept after the forward (peak {peak / MIB:.2f} MiB)",
                  file=sys.stderr)
    y.backward(torch.ones_like(y))  # frees the graph on every TP rank alike
    return counted


def device_name(device) -> str:
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def measure(args, spec, seq: int, rank: int, group) -> Optional[dict]:
    """Every rank runs the same layers (the TP collectives need all of them); rank 0 alone also
    times the replicated parts (embedding, head, optimizer) and returns the entry."""
    import torch

    ctx = Ctx(args, spec, seq, rank, group)
    blocks = []
    for n in BLOCKS:
        f, b = time_blocks(ctx, n)
        blocks.append({"layers": n, "fwd_ms": _ms(f), "bwd_ms": _ms(b)})
    act = activation_bytes(ctx)
    if rank == 0:
        ef, eb = time_embedding(ctx)
        hf, hb = time_head(ctx)
    opt_ms, fixed, _ = optimizer_and_fixed(ctx)
    ctx.align()  # the ranks finish together
    if rank != 0:
        return None
    b8 = next(b for b in blocks if b["layers"] == 8)
    return {
        "gpu": args.gpu or (torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else "CPU"),
        "tp": args.tp,
        "micro_batch": args.micro_batch,
        "fwd_ms": _ms(b8["fwd_ms"] / 8),
        "bwd_ms": _ms(b8["bwd_ms"] / 8),
        "act_mib": act / MIB,
        "model": spec.name,
        "model_hash": model_hash(spec),
        "seq_len": seq,
        "dtype": args.dtype,
        "torch": str(torch.__version__),
        "device": device_name(ctx.device),
        "blocks": blocks,
        "fixed_mib": fixed / MIB,
        "embed_fwd_ms": _ms(ef),
        "embed_bwd_ms": _ms(eb),
        "head_fwd_ms": _ms(hf),
        "head_bwd_ms": _ms(hb),
        "optimizer_ms": _ms(opt_ms),
    }


def _ms(x: float) -> float:
    # A CPU thread clock can tick coarser than a tiny layer: never report 0 for work done.
    return max(round(float(x), 6), 1e-6)


# ---------------------------------------------------------------------------------------------
# Processes
# ---------------------------------------------------------------------------------------------


def _setup_device(args, rank: int):
    import torch

    if torch.cuda.is_available():
        if torch.cuda.device_count() < args.tp:
            raise ProfileError(f"--tp: {args.tp} ranks, but only {torch.cuda.device_count()} CUDA devices")
        torch.cuda.set_device(rank)
        return "nccl"
    # One intra-op thread: the calling thread's CPU time is then all of the rank's compute.
    torch.set_num_threads(1)
    return "gloo"


def _worker_argv(args, port: int, rank: int) -> List[str]:
    a = [sys.executable, "-m", "motley_torch.profile", "--model", os.path.abspath(args.model), "--tp", str(args.tp),
         "--micro-batch", str(args.micro_batch), "--warmup", str(args.warmup), "--runs", str(args.runs),
         "--dtype", args.dtype, "--clock", args.clock, "--compile", args.compile, "--timeout", str(args.timeout), "--worker-rank", str(rank), "--store-port", str(port)]
    if args.seq_len is not None:
        a += ["--seq-len", str(args.seq_len)]
    if args.gpu is not None:
        a += ["--gpu", args.gpu]
    return a


def run_worker(args, spec, seq: int) -> int:
    """TP rank > 0, started by rank 0."""
    import datetime

    import torch.distributed as dist

    backend = _setup_device(args, args.worker_rank)
    timeout = datetime.timedelta(seconds=args.timeout)
    store = dist.TCPStore("127.0.0.1", args.store_port, args.tp, False, timeout=timeout)
    dist.init_process_group(backend, store=store, rank=args.worker_rank, world_size=args.tp, timeout=timeout)
    try:
        measure(args, spec, seq, args.worker_rank, dist.group.WORLD)
        dist.barrier()  # every rank is done with its collectives before any tears down
    finally:
        dist.destroy_process_group()
    # Rank 0 has what it needs. Leave without the interpreter's teardown: c10d's store client
    # and gloo threads destroyed in arbitrary order at exit can abort the process
    # ("terminate called without an active exception"), which rank 0 would rightly call a
    # failed rank.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_rank0(args, spec, seq: int) -> dict:
    if args.tp == 1:
        _setup_device(args, 0)
        return measure(args, spec, seq, 0, None)
    import datetime

    import torch.distributed as dist

    backend = _setup_device(args, 0)
    timeout = datetime.timedelta(seconds=args.timeout)
    store = dist.TCPStore("127.0.0.1", 0, args.tp, True, wait_for_workers=False, timeout=timeout)
    env = dict(os.environ)
    pkg_root = str(Path(__file__).resolve().parents[2])  # python/, which holds motley_torch
    env["PYTHONPATH"] = os.pathsep.join(x for x in (pkg_root, env.get("PYTHONPATH")) if x)
    procs = [subprocess.Popen(_worker_argv(args, store.port, r), env=env, stdout=subprocess.DEVNULL)
             for r in range(1, args.tp)]
    done = threading.Event()

    def watch():
        # A rank that dies leaves rank 0 waiting in a collective: stop the whole run.
        while not done.wait(0.2):
            for r, p in enumerate(procs, start=1):
                if p.poll() not in (None, 0):
                    print(f"{PROG}: error: TP rank {r} exited with status {p.returncode}", file=sys.stderr)
                    for q in procs:
                        if q.poll() is None:
                            q.kill()
                    os._exit(1)

    threading.Thread(target=watch, daemon=True).start()
    try:
        dist.init_process_group(backend, store=store, rank=0, world_size=args.tp, timeout=timeout)
        try:
            entry = measure(args, spec, seq, 0, dist.group.WORLD)
            dist.barrier()
            # The other ranks leave first: rank 0 holds the store they tear down against.
            for r, p in enumerate(procs, start=1):
                if p.wait(timeout=args.timeout) != 0:
                    raise ProfileError(f"--tp: TP rank {r} exited with status {p.returncode}")
        finally:
            dist.destroy_process_group()
        return entry
    finally:
        done.set()
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


# ---------------------------------------------------------------------------------------------
# The profiles file
# ---------------------------------------------------------------------------------------------


def _same_key(a: dict, b: dict) -> bool:
    # `motley plan` matches GPU names case-insensitively.
    return (str(a.get("gpu", "")).lower() == str(b.get("gpu", "")).lower()
            and a.get("tp") == b.get("tp") and a.get("micro_batch") == b.get("micro_batch"))


def merge(existing: Optional[dict], entry: dict, path: str = "FILE") -> dict:
    profiles = []
    if existing is not None:
        if not isinstance(existing, dict) or not isinstance(existing.get("profiles", []), list):
            raise ProfileError(f"--output: {path} is not a profiles file (no `profiles:` list)")
        profiles = list(existing.get("profiles") or [])
    out, replaced = [], False
    for p in profiles:
        if isinstance(p, dict) and _same_key(p, entry):
            if not replaced:
                out.append(entry)
                replaced = True
        else:
            out.append(p)
    if not replaced:
        out.append(entry)
    return {"profiles": out}


def render(doc: dict) -> str:
    import yaml

    head = "# Motley layer profiles (python -m motley_torch.profile); motley plan --profiles FILE\n"
    return head + yaml.safe_dump(doc, sort_keys=False, default_flow_style=None, width=120)


def write_output(path: str, entry: dict):
    import yaml

    existing = None
    if os.path.exists(path):
        try:
            with open(path) as f:
                existing = yaml.safe_load(f)
        except (OSError, yaml.YAMLError) as e:
            raise ProfileError(f"--output: cannot read {path}: {e}")
    text = render(merge(existing, entry, path))
    d = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".profile-", suffix=".tmp", dir=d)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        spec = load_spec(args.model)
        seq = validate(args, spec)
        # Loaded (torch and the model's layers), then into the emulated device's share, if any:
        # what is timed after is the device's work alone.
        import torch  # noqa: F401
        from ..models import transformer  # noqa: F401

        enter_share()
        if args.worker_rank:
            return run_worker(args, spec, seq)
        entry = run_rank0(args, spec, seq)
        if args.output:
            write_output(args.output, entry)
        else:
            sys.stdout.write(render({"profiles": [entry]}))
            sys.stdout.flush()
        return 0
    except (ProfileError, CpuShareError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
