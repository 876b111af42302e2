"""Llama-family models started from Hugging Face weights under Motley plans (CPU ranks, gloo):
pipeline stages, TP 1, 2 and 4, replicas of different depths and batch shares, dp changing
across a hop, tied heads across stages. On every plan the first step's loss and every
gradient (after their synchronisation) equal transformers' on the same global batch, and the
next step's loss equals the single process's, each within the rounding its chain of operations
explains (fp32; tolerance.py)."""

from __future__ import annotations

import functools
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")

from hf_models import add_tokenizer, load_hf, make_hf  # noqa: E402
from launcher import PYTHON, check_ok, hand_plan, launch, losses, python_env  # noqa: E402
from tolerance import (assert_close_rel, assert_steps_close, forward_ops, gradient_ops, loss_ops,  # noqa: E402
                       tp_gradient_ops)

from motley_torch.components.data import global_batch_tokens  # noqa: E402
from motley_torch.models.hf import hf_name  # noqa: E402
from motley_torch.model_source import load_model  # noqa: E402

SEED, SEQ, STEPS = 11, 16, 2
MODELS = {
    "llama-gqa": ("llama", {}),
    "qwen2-bias": ("qwen2", {}),
    "llama-attention-bias": ("llama", {"attention_bias": True}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "llama3-tied": ("llama", {"tie_word_embeddings": True, "rope_theta": 500000.0, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8}}),
}


@functools.lru_cache(maxsize=None)
def hf_dir(base: str, name: str) -> Path:
    kind, over = MODELS[name]
    return add_tokenizer(make_hf(Path(base) / name, kind, **over))


def reference(d: Path, global_batch: int):
    """transformers' mean token loss and gradients on step 0's global batch."""
    model = load_hf(d)
    spec = load_model(str(d))
    tokens = global_batch_tokens(SEED, 0, global_batch, SEQ, spec.vocab)
    logits = model(tokens[:, :-1]).logits
    loss = F.cross_entropy(logits.reshape(-1, spec.vocab), tokens[:, 1:].reshape(-1))
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}


def single(d: Path, global_batch: int, out: Path):
    cmd = [PYTHON, "-m", "motley_torch.train", "--single-process", "--init-from-hf", str(d), "--global-batch",
           str(global_batch), "--seq-len", str(SEQ), "--steps", str(STEPS), "--seed", str(SEED),
           "--save-grads", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, env=python_env(OMP_NUM_THREADS="1"), timeout=300)
    assert r.returncode == 0, r.stderr
    return losses(r.stdout)


def plan_for(spec: dict, global_batch: int, micro_batch: int, replicas):
    plan = hand_plan(spec, global_batch, micro_batch, replicas, node_kind={n: "ib" for n in "abcdef"})
    plan["seq_len"] = SEQ
    return plan


def run_plan(name: str, replicas, global_batch: int, micro_batch: int, tmp_path: Path, base: Path, extra=()):
    from safetensors.torch import load_file

    d = hf_dir(str(base), name)
    spec = load_model(str(d))
    plan = plan_for(spec.to_dict(), global_batch, micro_batch, replicas)
    args = ["--steps", str(STEPS), "--seed", str(SEED), "--init-from-hf", str(d), "--save-grads", str(tmp_path / "g"),
            "--save-params", str(tmp_path / "p"), *extra]
    results = launch(plan, args, tmp_path / "run")
    check_ok(results)
    got = losses(results[0].stdout)
    want_loss, want_grads = reference(d, global_batch)
    assert len(got) == STEPS
    # A plan sums the same terms in another order (micro-batches, replicas, a tied head's two
    # halves across stages), which the op counts allow for; TP adds partial sums of its own.
    tp = max(s["tp"] for r in plan["replicas"] for s in r["stages"])
    assert_close_rel(got[0], want_loss, loss_ops(spec.layers), "step 0's loss against transformers'")
    grads = load_file(str(tmp_path / "g" / "grads.safetensors"))
    expected = {n for n in want_grads}
    seen = set()
    for n, g in grads.items():
        h = hf_name(n, spec)
        seen.add(h)
        assert_close_rel(g, want_grads[h], gradient_ops(spec.layers) + tp_gradient_ops(spec.layers, tp),
                         f"gradient of {n} against transformers'")
    assert seen == expected, expected ^ seen
    one = single(d, global_batch, tmp_path / "single")
    assert_steps_close(got, one, spec.layers, "the plan's losses against the single process's")
    return d, spec


def trained_logits(spec, params: Path, tokens):
    from safetensors.torch import load_file

    from motley_torch.models.transformer import GPTStage

    m = GPTStage(spec, SEQ, (0, spec.layers))
    m.load_full_state(load_file(str(params)))
    with torch.no_grad():
        return m(tokens)


def check_hf_dir(out: Path, spec, params: Path, tokenizer: bool = True):
    """transformers loads `out` and computes the trained Motley model's logits; its tokenizer
    (the source's: add_tokenizer's words) loads too."""
    import transformers as tf

    if tokenizer:
        assert tf.AutoTokenizer.from_pretrained(str(out))("w5 w9")["input_ids"] == [5, 9]
        assert (out / "generation_config.json").exists()
    else:
        assert not (out / "tokenizer.json").exists() and not (out / "generation_config.json").exists()
    tokens = global_batch_tokens(SEED, 9, 2, SEQ, spec.vocab)[:, :-1]
    with torch.no_grad():
        theirs = load_hf(out)(tokens).logits
    assert_close_rel(trained_logits(spec, params, tokens), theirs, forward_ops(spec.layers),
                     f"{out}: logits in transformers against Motley's")


def test_two_stages_tp2_checkpoint_exported_to_hf(tmp_path, tmp_path_factory):
    """... and the step the plan checkpointed (2 stages x TP 2 units) exports to a Hugging Face
    directory (shards of at most 60 kB, the index, the tokenizer of the directory the run
    started from) that transformers loads; not into a non-empty directory unless --replace."""
    ckpt = tmp_path / "ckpt"
    d, spec = run_plan("llama-gqa", [dict(micro_batches=2, stages=[
        dict(layers=[0, 2], tp=2, dp=1, gpus=[("a", 0), ("a", 1)]),
        dict(layers=[2, 4], tp=2, dp=1, gpus=[("b", 0), ("b", 1)])])], 4, 2, tmp_path, tmp_path_factory.getbasetemp(),
        extra=["--ckpt-dir", str(ckpt), "--ckpt-every", str(STEPS)])
    out = tmp_path / "hf"
    r = subprocess.run([PYTHON, "-m", "motley_torch.export", "--ckpt", str(ckpt), "--step", str(STEPS), "--out",
                        str(out), "--max-shard-gb", "0.00006"], capture_output=True, text=True, env=python_env(),
                       timeout=300)
    assert r.returncode == 0, r.stderr
    assert (out / "model.safetensors.index.json").exists() and len(list(out.glob("model-*.safetensors"))) > 2
    assert f"tokenizer.json, tokenizer_config.json, generation_config.json from {d}" in r.stderr, r.stderr
    check_hf_dir(out, spec, tmp_path / "p" / "params.safetensors")

    def export(*args):
        return subprocess.run([PYTHON, "-m", "motley_torch.export", "--ckpt", str(ckpt), "--step", str(STEPS), *args],
                              capture_output=True, text=True, env=python_env(), timeout=300)

    again = export("--out", str(out))
    assert again.returncode == 2 and f"--out: {out} is not empty" in again.stderr and "--replace" in again.stderr
    r = export("--out", str(out), "--replace", "--no-tokenizer")
    assert r.returncode == 0 and "no tokenizer (--no-tokenizer)" in r.stderr, r.stderr
    assert not (out / "model.safetensors.index.json").exists(), "one shard now: the old index went with --replace"
    check_hf_dir(out, spec, tmp_path / "p" / "params.safetensors", tokenizer=False)
    # A step written across nodes has its manifest pieces and no manifest.json (as uploaded to
    # the object store): their merge is used; a missing piece is an incomplete step.
    import shutil

    pieces = tmp_path / "pieces"
    shutil.copytree(ckpt, pieces)
    sdir = pieces / f"step-{STEPS:08d}"
    (sdir / "manifest.json").unlink()
    r = subprocess.run([PYTHON, "-m", "motley_torch.export", "--ckpt", str(pieces), "--step", str(STEPS), "--out",
                        str(tmp_path / "hf2")], capture_output=True, text=True, env=python_env(), timeout=300)
    assert r.returncode == 0, r.stderr
    check_hf_dir(tmp_path / "hf2", spec, tmp_path / "p" / "params.safetensors")
    # The directory the run started from is gone (exported on another machine): say how to go on.
    moved = tmp_path / "moved"
    d.rename(moved)
    try:
        gone = export("--out", str(tmp_path / "hf4"))
        assert gone.returncode == 2 and f"the run started from {d} (--init-from-hf), which is not here" in gone.stderr
        assert "--tokenizer-from DIR" in gone.stderr and "--no-tokenizer" in gone.stderr, gone.stderr
        r = export("--out", str(tmp_path / "hf4"), "--tokenizer-from", str(moved))
        assert r.returncode == 0, r.stderr
        check_hf_dir(tmp_path / "hf4", spec, tmp_path / "p" / "params.safetensors")
    finally:
        moved.rename(d)
    (sdir / "manifest.rank.00003.json").unlink()
    r = subprocess.run([PYTHON, "-m", "motley_torch.export", "--ckpt", str(pieces), "--step", str(STEPS), "--out",
                        str(tmp_path / "hf3")], capture_output=True, text=True, env=python_env(), timeout=300)
    assert r.returncode == 2 and "no manifest piece of rank 3" in r.stderr, r.stderr
    bad = subprocess.run([PYTHON, "-m", "motley_torch.export", "--ckpt", str(ckpt), "--step", "7", "--out",
                          str(tmp_path / "x")], capture_output=True, text=True, env=python_env(), timeout=120)
    assert bad.returncode == 2 and "--step: " in bad.stderr and "step-00000007 does not exist" in bad.stderr


def test_one_stage_tp4_with_qkv_biases(tmp_path, tmp_path_factory):
    run_plan("qwen2-bias", [dict(micro_batches=2, stages=[
        dict(layers=[0, 4], tp=4, dp=1, gpus=[("a", i) for i in range(4)])])], 4, 2, tmp_path,
        tmp_path_factory.getbasetemp())


def test_two_stages_tp2_with_attention_biases(tmp_path, tmp_path_factory):
    """Llama's attention_bias under TP: q/k/v biases split with their rows, o's whole on every
    rank and added once, after the row-parallel all-reduce (tp.py); its gradient equals
    transformers' on each rank, and --save-hf writes a Llama with attention_bias that
    transformers loads."""
    _, spec = run_plan("llama-attention-bias", [dict(micro_batches=2, stages=[
        dict(layers=[0, 2], tp=2, dp=1, gpus=[("a", 0), ("a", 1)]),
        dict(layers=[2, 4], tp=2, dp=1, gpus=[("a", 2), ("a", 3)])])], 4, 2, tmp_path,
        tmp_path_factory.getbasetemp(), extra=["--save-hf", str(tmp_path / "hf")])
    assert spec.o_bias
    check_hf_dir(tmp_path / "hf", spec, tmp_path / "p" / "params.safetensors")


def test_asymmetric_replicas_dp_changing_across_a_hop_tied_head(tmp_path, tmp_path_factory):
    """A one-stage replica with 2 of 8 samples beside a two-stage one with 6, whose first stage
    has dp 2 feeding dp 1; TP 2; the tied head lives on one stage in one replica and on two in
    the other. --save-hf writes what transformers loads."""
    _, spec = run_plan("llama-tied", [
        dict(micro_batches=1, stages=[dict(layers=[0, 4], tp=2, dp=1, gpus=[("a", 0), ("a", 1)])]),
        dict(micro_batches=3, stages=[
            dict(layers=[0, 1], tp=2, dp=2, gpus=[("b", 0), ("b", 1), ("b", 2), ("b", 3)]),
            dict(layers=[1, 4], tp=2, dp=1, gpus=[("c", 0), ("c", 1)])])], 8, 2, tmp_path,
        tmp_path_factory.getbasetemp(), extra=["--save-hf", str(tmp_path / "hf")])
    check_hf_dir(tmp_path / "hf", spec, tmp_path / "p" / "params.safetensors")


def test_tp1_replicas_of_one_and_three_stages_llama3_scaling(tmp_path, tmp_path_factory):
    run_plan("llama3-tied", [
        dict(micro_batches=1, stages=[dict(layers=[0, 4], tp=1, dp=1, gpus=[("a", 0)])]),
        dict(micro_batches=3, stages=[dict(layers=[0, 1], tp=1, dp=1, gpus=[("b", 0)]),
                                      dict(layers=[1, 3], tp=1, dp=1, gpus=[("c", 0)]),
                                      dict(layers=[3, 4], tp=1, dp=1, gpus=[("d", 0)])])], 8, 2, tmp_path,
        tmp_path_factory.getbasetemp())
