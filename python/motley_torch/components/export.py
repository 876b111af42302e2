"""`python -m motley_torch.export --ckpt DIR --step S --out DIR`: a Hugging Face directory
(config.json, safetensors shards of at most 5 GB, the index) from any checkpoint step, whatever
TP/PP layout wrote it.

The step's manifest.json (docs/checkpoint.md) lists every unit with its TP rank and size and
every tensor's global shape and layout; each full tensor is put back together from its TP
shards along that layout (sub-blocks and granules respected), one tensor at a time, and
streamed into the shards. The model is the one the rank files recorded (`--model` overrides,
for steps written before they did). Every file's crc32c is checked first. A step written across
nodes (as the agents upload it to the object store) may have its manifest pieces and no
merged manifest.json: their merge is used, one piece per rank required.

The directory out is whole (hf_out): the tokenizer files and generation_config.json come from
--tokenizer-from DIR, else from the Hugging Face directory the run started from (--init-from-hf,
recorded in the rank files), else there is none and it says so; --out must be new or empty
unless --replace.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Dict, List, Optional, Tuple

from .checkpoint import CheckpointError, block_label, block_of, read_header, step_dir_name, step_manifest
from ..model_source import load_model
from ..spec import ModelSpec, PlanError


def _units_by_block(manifest: dict, sdir: str) -> Dict[str, Tuple[int, List[str]]]:
    """block label -> (tp size, [file of TP rank 0, 1, ...]) of its `model` part; the lowest TP
    size with every rank present."""
    by: Dict[str, Dict[int, Dict[int, str]]] = {}
    for u in manifest["units"]:
        if u["part"] == "model":
            by.setdefault(u["block"], {}).setdefault(u["tp_size"], {})[u["tp_rank"]] = os.path.join(sdir, u["file"])
    out = {}
    for block, sizes in by.items():
        whole = [t for t, ranks in sorted(sizes.items()) if sorted(ranks) == list(range(t))]
        if not whole:
            raise CheckpointError(f"{sdir}: block {block}: no TP size with all its shards; "
                                  f"`motley-ckpt verify {sdir}` names what is missing")
        t = whole[0]
        out[block] = (t, [sizes[t][r] for r in range(t)])
    return out


def join_shards(shards: list, layout: dict):
    """The full tensor from its TP shards (docs/checkpoint.md, layouts)."""
    import torch

    if layout["kind"] == "replicated" or len(shards) == 1:
        return shards[0]
    if layout["kind"] != "split":
        raise CheckpointError(f"layout {layout['kind']!r}: this exporter joins split and replicated tensors only")
    axis, t = layout["axis"], len(shards)
    blocks = layout.get("blocks")
    if not blocks:
        return torch.cat(shards, dim=axis)
    parts = [torch.split(s, [b // t for b in blocks], dim=axis) for s in shards]
    return torch.cat([torch.cat([p[i] for p in parts], dim=axis) for i in range(len(blocks))], dim=axis)


def step_spec(manifest: dict, sdir: str, model: Optional[str]) -> ModelSpec:
    if model:
        return load_model(model)
    for r in manifest["ranks"]:
        h = read_header(os.path.join(sdir, r["file"]))
        if "model" in h:
            return ModelSpec.from_dict(h["model"], where=f"{r['file']}: model")
    raise PlanError(f"{sdir}: the rank files do not record the model (written before they did); pass --model")


def step_tokenizer(manifest: dict, sdir: str, given: Optional[str], none: bool) -> Optional[str]:
    """Where the tokenizer comes from: --tokenizer-from, else the --init-from-hf directory the
    rank files record (it must still be there: else say how to name another or none), else
    nowhere (None)."""
    if none:
        return None
    if given:
        if not os.path.isdir(given):
            raise PlanError(f"--tokenizer-from: {given} is not a directory")
        return given
    for r in manifest["ranks"]:
        source = read_header(os.path.join(sdir, r["file"])).get("init_from_hf")
        if source:
            if not os.path.isdir(source):
                raise PlanError(f"--tokenizer-from: the run started from {source} (--init-from-hf), which is not "
                                f"here to copy the tokenizer from; pass --tokenizer-from DIR (a directory with its "
                                f"tokenizer files) or --no-tokenizer")
            return source
    return None


def export(ckpt: str, step: int, out: str, model: Optional[str] = None, max_shard_bytes: Optional[int] = None,
           tokenizer_from: Optional[str] = None, no_tokenizer: bool = False, replace: bool = False) -> str:
    """Write step `step` of `ckpt` as the Hugging Face directory `out`; returns what was
    written, in one line."""
    from safetensors import safe_open

    from ..models import hf_out
    from ..models.hf import MAX_SHARD_BYTES, motley_order, write_hf

    hf_out.check_out_dir(out, replace, "--out")
    sdir = os.path.join(ckpt, step_dir_name(step))
    if not os.path.isdir(sdir):
        raise PlanError(f"--step: {sdir} does not exist; `ls {ckpt}` shows the steps written")
    manifest = step_manifest(sdir)
    spec = step_spec(manifest, sdir, model)
    tokenizer = step_tokenizer(manifest, sdir, tokenizer_from, no_tokenizer)
    units = _units_by_block(manifest, sdir)

    def tensors():
        for name in motley_order(spec):
            label = block_label(block_of(name))
            if label not in units:
                raise CheckpointError(f"{sdir}: no unit of block {label} (for {name})")
            _, files = units[label]
            shards, layout = [], None
            for f in files:
                with safe_open(f, framework="pt") as h:
                    if name not in h.keys():
                        raise CheckpointError(f"{f}: no tensor {name}")
                    shards.append(h.get_tensor(name))
                layout = read_header(f)["tensors"][name]["layout"]
            full = join_shards(shards, layout)
            del shards
            yield name, full.float()

    if replace:
        hf_out.clear_out_dir(out, "--out")
    names = write_hf(out, spec, tensors(), max_shard_bytes or MAX_SHARD_BYTES)
    note = "no tokenizer (--no-tokenizer)" if no_tokenizer else hf_out.add_tokenizer(out, tokenizer)
    return f"wrote {out} ({len(names)} shard{'s' if len(names) != 1 else ''}); {note}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m motley_torch.export",
                                description="Write a checkpoint step as a Hugging Face model directory.")
    p.add_argument("--ckpt", required=True, help="the checkpoint directory (holding step-SSSSSSSS/)")
    p.add_argument("--step", required=True, type=int, help="the step to export")
    p.add_argument("--out", required=True, help="the Hugging Face directory to write")
    p.add_argument("--model", help="the model (file, catalog name or HF directory) when the rank files lack it")
    p.add_argument("--max-shard-gb", type=float, default=5.0, help="largest safetensors shard, GB (default 5)")
    p.add_argument("--tokenizer-from", metavar="DIR",
                   help="copy the tokenizer files and generation_config.json from DIR (default: the --init-from-hf "
                        "directory the run started from, as the rank files record it)")
    p.add_argument("--no-tokenizer", action="store_true", help="write the weights and config.json alone")
    p.add_argument("--replace", action="store_true", help="replace the files of a non-empty --out (default: refuse it)")
    a = p.parse_args(argv)
    try:
        if a.max_shard_gb <= 0:
            raise PlanError("--max-shard-gb: must be positive")
        if a.tokenizer_from and a.no_tokenizer:
            raise PlanError("--tokenizer-from, --no-tokenizer: give one of them")
        said = export(a.ckpt, a.step, a.out, a.model, int(a.max_shard_gb * 1e9), a.tokenizer_from, a.no_tokenizer,
                      a.replace)
    except (PlanError, CheckpointError, OSError) as e:
        print(f"motley_torch.export: {e}", file=sys.stderr)
        return 2
    print(f"motley_torch.export: {said}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
