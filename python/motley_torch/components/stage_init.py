"""A stage made ready to train: its model spec, its modules (allocated, then initialised from a
seed or loaded from a Hugging Face directory), its optimizer, and the one way tensors are
written to a safetensors file (whole or not at all).
"""

from __future__ import annotations

import os

import torch

from ..models.transformer import GPTStage
from .adamw import AdamW
from ..model_source import load_model
from ..spec import ModelSpec, PlanError


def make_optimizer(params, args):
    """AdamW (components/adamw.py) with its state made at once (zeros, as its first step would
    make them): the first step's peak memory is then every later step's (the memory line and the
    cost model compare it), and a stage that does not fit fails before training rather than
    after a step.

    On CUDA the fused kernel (one launch for every tensor, `fused=True`), elsewhere the
    multi-tensor one (`foreach=True`): the same AdamW maths as the per-parameter loop, without
    its Python and launch cost per parameter."""
    params = list(params)
    fused = bool(params) and all(p.device.type == "cuda" for p in params)
    opt = AdamW(params, lr=args.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=args.weight_decay,
                fused=fused, foreach=not fused)
    opt.init_state()
    return opt


COMPILE_CHOICES = ("auto", "on", "off")


def compiles(choice: str, device) -> bool:
    """--compile's rule: `on`, or `auto` on a CUDA device."""
    return choice == "on" or (choice == "auto" and device.type == "cuda")


def compile_stage(model: GPTStage, args, device) -> bool:
    """--compile: `auto` compiles on CUDA (where launch and elementwise costs decide the step)
    and not on the CPU (where compiling costs more than a short run gains). --cuda-graphs also
    captures the compiled blocks with CUDA graphs (mode reduce-overhead)."""
    choice = getattr(args, "compile", "auto") or "auto"
    if choice not in COMPILE_CHOICES:
        raise PlanError(f"--compile: {choice!r}; use one of {', '.join(COMPILE_CHOICES)}")
    on = compiles(choice, device)
    graphs = bool(getattr(args, "cuda_graphs", False))
    if graphs and not (on and device.type == "cuda"):
        raise PlanError("--cuda-graphs: captures compiled blocks on a CUDA device; use it with --compile on|auto "
                        "on a GPU, or drop it")
    if on:
        model.compile_blocks("reduce-overhead" if graphs else None)
    import sys

    print(f"motley-compile {'on' if on else 'off'}{' (cuda graphs)' if graphs else ''} (asked {choice})",
          file=sys.stderr, flush=True)
    return on


def resolve_spec(args) -> ModelSpec:
    """--model, else --init-from-hf's config.json."""
    if args.model:
        return load_model(args.model)
    if args.init_from_hf:
        return load_model(args.init_from_hf)
    raise PlanError("--model: required with --single-process (or --init-from-hf DIR, whose config.json is the model)")


def build_stage(args, *a, **kw) -> GPTStage:
    """The stage, its parameters allocated but not initialised when --init-from-hf will write
    every byte (random init of a large model costs more than loading it)."""
    if args.init_from_hf:
        with torch.device("meta"):
            model = GPTStage(*a, **kw)
        return model.to_empty(device="cpu")
    return GPTStage(*a, **kw)


def init_weights(model: GPTStage, args):
    if args.init_from_hf:
        from ..models.hf import is_hf_model

        if not is_hf_model(args.init_from_hf) or not os.path.isdir(args.init_from_hf):
            raise PlanError(f"--init-from-hf: {args.init_from_hf} is not a Hugging Face model directory "
                            f"(config.json and safetensors weights)")
        model.load_hf(args.init_from_hf)
    else:
        model.init_from_seed(args.seed)


def save_file(tensors, path: str):
    from safetensors.torch import save_file as st_save

    tmp = path + ".tmp"
    st_save({k: v.contiguous() for k, v in tensors.items()}, tmp)
    os.replace(tmp, path)
