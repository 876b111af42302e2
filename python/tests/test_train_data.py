"""The trainer on a tokenized dataset: the samples each step takes follow the training order
across a checkpoint restored onto a plan with another replica count (none repeated, none
skipped), the losses equal the single process's, and the eval loss (first N samples, padded
last chunk) is the same on every plan."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import yaml

from launcher import DATA, PYTHON, check_ok, eval_losses, hand_plan, launch, losses, python_env
from tolerance import assert_steps_close, layers_of

MODEL = DATA / "tiny-llama.yaml"
SEED, GB = 3, 8


def dataset(path: Path, tokens: int = 16 * 20 + 1) -> Path:
    rng = np.random.default_rng(0)
    # A learnable stream: runs of consecutive ids.
    starts = rng.integers(0, 64, tokens // 8 + 1)
    stream = (starts[:, None] + np.arange(8)[None, :]).reshape(-1)[:tokens] % 64
    stream.astype("<u2").tofile(path)
    return path


def samples(path: Path):
    return {d["step"]: d["samples"] for d in map(json.loads, path.read_text().splitlines())}


def test_restore_onto_another_replica_count_continues_the_sample_order(tmp_path):
    data = dataset(tmp_path / "tokens.bin")
    common = ["--seed", str(SEED), "--data", str(data), "--eval-data", str(data), "--eval-samples", "5",
              "--eval-every", "2"]
    spec = yaml.safe_load(MODEL.read_text())
    # Plan A: two one-stage replicas; plan B: one two-stage replica.
    a = hand_plan(spec, GB, 2, [dict(micro_batches=2, stages=[dict(layers=[0, 4], tp=1, dp=1, gpus=[("a", 0)])]),
                               dict(micro_batches=2, stages=[dict(layers=[0, 4], tp=1, dp=1, gpus=[("b", 0)])])])
    b = hand_plan(spec, GB, 2, [dict(micro_batches=4, stages=[dict(layers=[0, 2], tp=1, dp=1, gpus=[("a", 0)]),
                                                              dict(layers=[2, 4], tp=1, dp=1, gpus=[("b", 0)])])])
    ckpt = tmp_path / "ckpt"
    ra = launch(a, ["--steps", "4", "--ckpt-dir", str(ckpt), "--ckpt-every", "2", "--ckpt-sync", *common,
                    "--sample-log", str(tmp_path / "a.samples")], tmp_path / "a")
    check_ok(ra)
    step2 = sorted(str(p) for p in (ckpt / "step-00000002").iterdir() if p.name.endswith(".safetensors"))
    rb = launch(b, ["--steps", "6", "--ckpt-restore", json.dumps(step2), *common,
                    "--sample-log", str(tmp_path / "b.samples")], tmp_path / "b")
    check_ok(rb)
    one = subprocess.run([PYTHON, "-m", "motley_torch.train", "--single-process", "--model", str(MODEL),
                          "--global-batch", str(GB), "--steps", "6", "--sample-log", str(tmp_path / "s.samples"),
                          *common], capture_output=True, text=True, env=python_env(OMP_NUM_THREADS="1"), timeout=300)
    assert one.returncode == 0, one.stderr

    sa, sb, ss = samples(tmp_path / "a.samples"), samples(tmp_path / "b.samples"), samples(tmp_path / "s.samples")
    assert sorted(sa) == [0, 1, 2, 3] and sorted(sb) == [2, 3, 4, 5] and sorted(ss) == list(range(6))
    resumed = [sa[0], sa[1], sb[2], sb[3], sb[4], sb[5]]
    assert resumed == [ss[i] for i in range(6)], "the restored run takes exactly the next samples"
    flat = [i for step in resumed for i in step]
    n = 20  # samples of seq_len 16 in 321 tokens
    for e in range(len(flat) // n):
        assert sorted(flat[e * n:(e + 1) * n]) == list(range(n)), f"epoch {e} is a permutation"
    assert flat[:n] != list(range(n)), "shuffled"

    la, lb, ls = losses(ra[0].stdout), losses(rb[0].stdout), losses(one.stdout)
    assert len(la) == 4 and len(lb) == 4 and len(ls) == 6
    layers = layers_of(MODEL)
    # Plan a (two replicas), then plan b (two stages) from a's step 2, against one process:
    # the same sums in other orders.
    assert_steps_close(la + lb[2:], ls, layers, "losses of plans a then b against the single process's")
    ea, eb, es = dict(eval_losses(ra[0].stdout)), dict(eval_losses(rb[0].stdout)), dict(eval_losses(one.stdout))
    assert sorted(ea) == [0, 2, 4] and sorted(eb) == [2, 4, 6] and sorted(es) == [0, 2, 4, 6]
    assert_steps_close([ea[k] for k in (0, 2, 4)], [es[k] for k in (0, 2, 4)], layers,
                       "plan a's eval losses", steps=(0, 2, 4))
    assert_steps_close([eb[k] for k in (2, 4, 6)], [es[k] for k in (2, 4, 6)], layers,
                       "plan b's eval losses", steps=(2, 4, 6))
    assert es[6] < es[0], "the eval loss falls"


def test_bad_data_exits_2_naming_the_file(tmp_path):
    data = tmp_path / "odd.bin"
    data.write_bytes(b"\x01\x00\x02")
    r = subprocess.run([PYTHON, "-m", "motley_torch.train", "--single-process", "--model", str(MODEL),
                        "--global-batch", "2", "--steps", "1", "--data", str(data)],
                       capture_output=True, text=True, env=python_env(), timeout=120)
    assert r.returncode == 2 and str(data) in r.stderr.strip().splitlines()[-1], r.stderr
    big = tmp_path / "big.bin"
    np.full(200, 70, dtype="<u2").tofile(big)
    r = subprocess.run([PYTHON, "-m", "motley_torch.train", "--single-process", "--model", str(MODEL),
                        "--global-batch", "2", "--steps", "1", "--data", str(big)],
                       capture_output=True, text=True, env=python_env(), timeout=120)
    assert r.returncode == 2 and "70" in r.stderr and "64" in r.stderr, r.stderr
