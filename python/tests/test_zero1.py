"""ZeRO-1 on CPU ranks (gloo): the fp32 master weights and AdamW state sharded over each layer
segment's dp ring give the losses of the unsharded run (fp32: within float rounding; bf16:
close), every block of a checkpoint is written once by its owner with the sharding recorded,
a restore onto another dp re-shards, and the memory line shows the optimizer state divided."""

from __future__ import annotations

import functools
import json
import subprocess
from pathlib import Path

import pytest
import yaml
from safetensors import safe_open

from launcher import DATA, PYTHON, check_ok, hand_plan, launch, python_env
from tolerance import EPS_BF16, assert_half_steps_close, assert_steps_close

from motley_torch.distributed.zero import partition

MODEL = DATA / "tiny-llama.yaml"
SPEC = yaml.safe_load(MODEL.read_text())
LAYERS = SPEC["layers"]


def steps(stdout: str):
    return [d for d in map(json.loads, stdout.splitlines()) if "loss" in d]


def memory(res):
    return {r.rank: json.loads(x)["memory"] for r in res for x in r.stdout.splitlines() if x.startswith('{"memory"')}


def two_replicas():
    """Two replicas of two stages each: every segment's ring has two members."""
    return hand_plan(SPEC, 8, 2, [dict(micro_batches=2, stages=[
        dict(layers=[0, 2], tp=1, dp=1, gpus=[(n, 0)]), dict(layers=[2, 4], tp=1, dp=1, gpus=[(n, 1)])])
        for n in ("a", "b")])


def asymmetric():
    """A one-stage replica beside a two-stage one with dp 2 on its first stage: rings of three
    members (layers 0-1) and two (layers 2-3)."""
    return hand_plan(SPEC, 8, 2, [
        dict(micro_batches=2, stages=[dict(layers=[0, 4], tp=1, dp=1, gpus=[("a", 0)])]),
        dict(micro_batches=2, stages=[dict(layers=[0, 2], tp=1, dp=2, gpus=[("b", 0), ("b", 1)]),
                                      dict(layers=[2, 4], tp=1, dp=1, gpus=[("c", 0)])])])


def tp2():
    """Two one-stage replicas at TP 2: one ring per TP rank."""
    return hand_plan(SPEC, 8, 2, [dict(micro_batches=2, stages=[
        dict(layers=[0, 4], tp=2, dp=1, gpus=[(n, 0), (n, 1)])]) for n in ("a", "b")])


def one_replica():
    return hand_plan(SPEC, 8, 2, [dict(micro_batches=4, stages=[
        dict(layers=[0, 2], tp=1, dp=1, gpus=[("a", 0)]), dict(layers=[2, 4], tp=1, dp=1, gpus=[("a", 1)])])])


@functools.lru_cache(maxsize=None)
def single(*extra):
    """The single process's steps with these flags, one run per set of flags for the module (the
    reference several plans are held to)."""
    r = subprocess.run([PYTHON, "-m", "motley_torch.train", "--single-process", "--model", str(MODEL),
                        "--global-batch", "8", "--seq-len", "16", "--seed", "4", *extra], capture_output=True,
                       text=True, env=python_env(OMP_NUM_THREADS="1"), timeout=300)
    assert r.returncode == 0, r.stderr
    return steps(r.stdout)


def test_partition_cuts_contiguous_runs_with_the_smallest_largest_run():
    assert partition([4, 4, 4, 4], 2) == [0, 0, 1, 1]
    assert partition([10, 1, 1, 1, 1, 10], 3) == [0, 1, 1, 1, 1, 2]
    assert partition([5, 5], 4) == [0, 1], "fewer blocks than members: the last members own nothing"
    assert partition([0, 3, 3, 0], 2) == [0, 0, 1, 1]
    sizes = [7, 2, 9, 4, 4, 4, 1, 8]
    parts = partition(sizes, 3)
    assert parts == sorted(parts) and max(parts) <= 2
    loads = [sum(s for s, p in zip(sizes, parts) if p == k) for k in range(3)]
    import itertools

    best = min(max(sum(sizes[a:b]) for a, b in zip((0, *cut), (*cut, len(sizes))))
               for cut in itertools.combinations(range(1, len(sizes)), 2))
    assert max(loads) == best


@pytest.mark.parametrize("plan_name", ["two_replicas", "asymmetric", "tp2"])
def test_zero1_gives_the_unsharded_losses_and_divides_the_optimizer_state(tmp_path, plan_name):
    plan = {"two_replicas": two_replicas, "asymmetric": asymmetric, "tp2": tp2}[plan_name]()
    base = ["--steps", "5", "--seed", "4", "--bucket-mb", "0.01"]
    sharded = launch(plan, base + ["--zero1"], tmp_path / "zero1")
    check_ok(sharded)
    b = steps(sharded[0].stdout)
    assert len(b) == 5
    assert_steps_close([d["loss"] for d in b], [d["loss"] for d in single("--steps", "5")], LAYERS,
                       f"ZeRO-1 on {plan_name}: losses against the single process's")
    assert all("motley-zero1 on" in r.log for r in sharded)
    if plan_name != "two_replicas":
        return
    # The unsharded run, and ZeRO-1 reducing after the backward pass: the same losses.
    plain = launch(plan, base, tmp_path / "plain")
    late = launch(plan, base + ["--zero1", "--no-overlap"], tmp_path / "late")
    check_ok(plain)
    check_ok(late)
    a, c = steps(plain[0].stdout), steps(late[0].stdout)
    # Rings of two: a reduce-scatter's a + b is the all-reduce's, and AdamW is elementwise, on a
    # shard as on the whole tensor: the same bits.
    assert [d["loss"] for d in b] == [d["loss"] for d in a], (a, b)
    assert [d["loss"] for d in c] == [d["loss"] for d in b], (b, c)
    before, after = memory(plain), memory(sharded)
    # Every ring's optimizer state is cut into runs of whole blocks: summed over the ranks it
    # is what one copy per ring holds, and no rank keeps everything where its ring has two.
    total_before = sum(m["optimizer_mb"] for m in before.values())
    total_after = sum(m["optimizer_mb"] for m in after.values())
    assert total_after < 0.75 * total_before, (before, after)
    assert all(after[k]["params_mb"] == pytest.approx(before[k]["params_mb"]) for k in before), "fp32: no extra masters"


def test_zero1_in_bf16_keeps_half_weights_and_fp32_masters(tmp_path):
    plan = two_replicas()
    base = ["--steps", "4", "--seed", "4", "--dtype", "bf16"]
    plain = launch(plan, base, tmp_path / "plain")
    sharded = launch(plan, base + ["--zero1"], tmp_path / "zero1")
    check_ok(plain)
    check_ok(sharded)
    a, b = steps(plain[0].stdout), steps(sharded[0].stdout)
    # ZeRO-1 keeps bf16 weights where the plain run keeps fp32 ones that autocast rounds per
    # product: the two differ by one bf16 rounding of what autocast leaves in fp32 (norm gains,
    # biases), one unit roundoff of them.
    assert_half_steps_close([d["loss"] for d in b], [d["loss"] for d in a], "ZeRO-1 bf16 losses against plain bf16's",
                            EPS_BF16)
    before, after = memory(plain), memory(sharded)
    total = lambda mem, key: sum(m[key] for m in mem.values())  # noqa: E731
    # Every block has two copies (the rings have two members): without ZeRO-1 both hold fp32
    # weights and AdamW state; with it both hold bf16 weights and one (the owner) the fp32
    # master and the state. So the weights' bytes add up to the same, the state's to half;
    # except the tied embedding/head, outside ZeRO: each of its 4 holders keeps a master (2
    # bytes more per element than its fp32 weights) and the whole state.
    tied = 4 * SPEC["vocab"] * SPEC["hidden"] * 4 / 2**20
    p, o = total(before, "params_mb"), total(before, "optimizer_mb")
    assert total(after, "params_mb") == pytest.approx(p + tied / 2, abs=0.005), (before, after)
    assert total(after, "optimizer_mb") == pytest.approx((o - 2 * tied) / 2 + 2 * tied, abs=0.005), (before, after)


def test_zero1_checkpoints_are_written_by_their_owners_and_restore_onto_another_dp(tmp_path):
    """Saved under ZeRO-1 on two replicas (every block once, by its ring's owner, the sharding
    in its header), restored under ZeRO-1 onto one replica and without it onto two: the losses
    after the restore are the uninterrupted run's."""
    ckpt = tmp_path / "ckpt"
    base = ["--steps", "8", "--seed", "4"]
    first = launch(two_replicas(), base + ["--zero1", "--ckpt-dir", str(ckpt), "--ckpt-every", "4", "--ckpt-sync"],
                   tmp_path / "first")
    check_ok(first)
    got = steps(first[0].stdout)
    sdir = ckpt / "step-00000004"
    manifest = json.loads((sdir / "manifest.json").read_text())
    units = [(u["block"], u["part"]) for u in manifest["units"]]
    assert len(units) == len(set(units)), "every unit written once"
    assert {b for b, _ in units} == {"embed", "head", "layer.0", "layer.1", "layer.2", "layer.3"}
    writers = {}
    for u in manifest["units"]:
        with safe_open(str(sdir / u["file"]), framework="pt") as f:
            head = json.loads(f.metadata()["motley"])
        assert head["sharding"]["kind"] == "zero1" and head["sharding"]["dp"] == 2, head
        writers.setdefault(head["sharding"]["dp_rank"], set()).add(u["block"])
        if u["part"] == "model":
            assert all(s["dtype"] == "F32" for s in u["tensors"].values())
    assert len(writers) == 2, f"both members of the rings own blocks: {writers}"
    files = json.dumps(sorted(str(p) for p in sdir.iterdir() if p.name.endswith(".safetensors")))
    onto_one = launch(one_replica(), base + ["--zero1", "--ckpt-restore", files], tmp_path / "one")
    onto_plain = launch(two_replicas(), base + ["--ckpt-restore", files], tmp_path / "plain")
    check_ok(onto_one)
    check_ok(onto_plain)
    for res in (onto_one, onto_plain):
        resumed = steps(res[0].stdout)
        assert [d["step"] for d in resumed] == [4, 5, 6, 7]
        assert_steps_close([d["loss"] for d in resumed], [d["loss"] for d in got[4:]], LAYERS,
                           "losses after the restore against the uninterrupted run's", steps=range(4, 8))


def test_the_plans_zero1_turns_it_on(tmp_path: Path):
    plan = two_replicas()
    plan["zero1"] = True
    res = launch(plan, ["--steps", "2", "--seed", "4"], tmp_path / "run")
    check_ok(res)
    assert all("motley-zero1 on" in r.log for r in res)
    bad = launch(plan, ["--steps", "2", "--seed", "4", "--save-grads", str(tmp_path / "g")], tmp_path / "bad")
    assert all(r.returncode == 2 for r in bad) and "--save-grads: not with ZeRO-1" in bad[0].log
