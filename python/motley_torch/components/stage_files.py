"""A run's parameters (or gradients) written out whole: in a distributed run each stage's full
tensors are gathered by one TP group of one replica, then merged by the leader (rank 0, or the
lowest surviving rank of a job that lost replica 0: docs/keep-going.md) into one safetensors
file (`--save-params`, `--save-grads`) or a Hugging Face directory (`--save-hf`).
"""

from __future__ import annotations

import os
import sys

from ..models.transformer import GPTStage
from ..spec import ModelSpec, PlanError
from .checkpoint import writer_replica  # the same replica writes checkpoints' units
from .stage_init import save_file


def hf_names(spec: ModelSpec, state) -> list:
    from ..models.hf import motley_order

    names = motley_order(spec)
    missing = [n for n in names if n not in state]
    if missing:
        raise PlanError(f"--save-hf: the model has no {missing[0]}")
    return names


def save_hf_distributed(view, model: GPTStage, args, zero=None):
    """The stages' full tensors go to staging files in DIR (write_stage_files); the leader then
    streams them into the Hugging Face directory (shards of at most 5 GB) and removes the
    staging files. DIR must be one directory for all stages (one host or a shared file system);
    otherwise this fails naming the missing stage file. `zero`: as write_stage_files."""
    from ..models import hf_out

    out_dir = args.save_hf
    staging = write_stage_files(view, model, out_dir, ".motley-stage{s}.safetensors", zero=zero)
    if view.rank == getattr(view, "leader", 0):
        hf_out.prepare(args, keep={os.path.basename(p) for p in staging})
        from safetensors import safe_open

        from ..models.hf import motley_order, write_hf

        missing = [p for p in staging if not os.path.exists(p)]
        if missing:
            raise PlanError(f"--save-hf: {missing[0]} was written on another node; give a directory all nodes share")
        where = {}
        for p in staging:
            with safe_open(p, framework="pt") as f:
                for k in f.keys():
                    where[k] = p

        def tensors():
            for name in motley_order(view.plan.model):
                if name not in where:
                    raise PlanError(f"--save-hf: no stage holds {name}")
                with safe_open(where[name], framework="pt") as f:
                    yield name, f.get_tensor(name)

        write_hf(out_dir, view.plan.model, tensors())
        for p in staging:
            os.remove(p)
        hf_out.finish(args)



def write_stage_files(view, model: GPTStage, out_dir: str, pattern: str, grads: bool = False, zero=None) -> list:
    """Every rank calls this: the writer replica's (`writer_replica`) first TP group of every
    stage gathers its stage's full tensors (or gradients) and its TP rank 0 writes them to
    DIR/pattern ({s}: the stage); after a barrier of the members, returns the paths of the
    writer replica's stage files (on this node only when DIR is not shared), which the leader
    merges. Under ZeRO-1 (`zero`: a zero.ZeroOne) with half weights the parameters written are
    the fp32 masters, gathered from their owners, as a checkpoint's model units hold them
    (docs/checkpoint.md, "ZeRO-1"), not their bf16/fp16 copies."""
    import torch.distributed as dist

    os.makedirs(out_dir, exist_ok=True)
    writer = writer_replica(view)
    paths = [os.path.join(out_dir, pattern.format(s=s)) for s in range(len(view.plan.replicas[writer].stages))]
    writes = view.replica == writer and view.stage_dp_rank == 0
    values = zero.export_masters(writes) if zero is not None and not grads else None
    if writes:
        tp_pg = view.tp_group.pg if view.tp_group is not None else None
        full = model.gather_full(tp_pg, grads=grads, values=values)
        if view.tp_rank == 0:
            save_file(full, paths[view.stage])
        del full
    dist.barrier(group=getattr(view, "world_group", None))
    return paths


def save_params_distributed(view, model: GPTStage, out_dir: str, grads: bool = False, zero=None):
    """The stages' full tensors (write_stage_files: DIR/params-stage{s}.safetensors); the leader
    then merges them into DIR/params.safetensors (when DIR is shared, as on one host;
    otherwise the stage files stay where they were written). `zero`: as write_stage_files."""
    stem = "grads" if grads else "params"
    parts = write_stage_files(view, model, out_dir, stem + "-stage{s}.safetensors", grads=grads, zero=zero)
    if view.rank == getattr(view, "leader", 0):
        from safetensors.torch import load_file

        if all(os.path.exists(p) for p in parts):
            merged = {}
            for p in parts:
                merged.update(load_file(p))
            save_file(merged, os.path.join(out_dir, f"{stem}.safetensors"))
            for p in parts:
                os.remove(p)
        else:
            print(f"motley_torch.train: stage parameter files are not all in {out_dir} on this node; "
                  f"not merged", file=sys.stderr)
