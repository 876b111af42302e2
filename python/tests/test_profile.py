"""`python -m motley_torch.profile`: the profiles file it writes (fields, TP shard, model hash,
--output merge), bad input, and `motley plan --profiles` reading it. No timing assertions:
times are only checked to be positive numbers."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from launcher import DATA, REPO, python_env

from motley_torch.tools import profile as prof
from motley_torch.spec import ModelSpec

PY = sys.executable
FIELDS = ("gpu", "tp", "micro_batch", "fwd_ms", "bwd_ms", "act_mib", "model", "model_hash", "seq_len", "dtype",
          "torch", "device", "blocks", "fixed_mib", "embed_fwd_ms", "embed_bwd_ms", "head_fwd_ms", "head_bwd_ms",
          "optimizer_ms")
TIMES = ("fwd_ms", "bwd_ms", "embed_fwd_ms", "embed_bwd_ms", "head_fwd_ms", "head_bwd_ms", "optimizer_ms")
MB = 2  # micro-batch of the runs below
GPU = "tiny-gpu"  # the GPU type of tests/data/uniform-4x2.yaml


def run_profile(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    cmd = [PY, "-m", "motley_torch.profile", *args]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=str(REPO),
                         env=python_env(OMP_NUM_THREADS="1"))
    if check and out.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {out.returncode}: {out.stderr}")
    return out


def layer_params(spec: ModelSpec, tp: int) -> int:
    """One layer's parameter count on one TP rank, by hand: the two layer norms and the
    row-parallel biases are replicated, everything else is split by tp."""
    h, f, hd = spec.hidden, spec.ffn_hidden, spec.hidden // spec.heads
    q, kv = spec.heads * hd, spec.kv_heads * hd
    n = 2 * 2 * h                                   # ln1, ln2 (weight + bias)
    n += (h * q + q) // tp + 2 * (h * kv + kv) // tp  # q, k, v (column-split, bias split)
    n += q * h // tp + h                            # o (row-split; bias whole)
    if spec.gated_mlp:
        n += 3 * h * f // tp                        # gate, up, down; no biases
    else:
        n += (h * f + f) // tp + f * h // tp + h    # fc1 (column), fc2 (row; bias whole)
    return n


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """tp 1 and tp 2 (two processes) profiles of tests/data/tiny4.yaml merged into one file that
    already holds a foreign entry (kept) and a stale entry for the tp 1 key (replaced)."""
    d = tmp_path_factory.mktemp("profile")
    out = d / "profiles.yaml"
    foreign = {"gpu": "A100-80G", "tp": 1, "micro_batch": MB, "fwd_ms": 1.5, "bwd_ms": 3.0, "act_mib": 10.0}
    stale = {"gpu": GPU.upper(), "tp": 1, "micro_batch": MB, "fwd_ms": 999.0, "bwd_ms": 999.0, "act_mib": 1.0}
    out.write_text(yaml.safe_dump({"profiles": [foreign, stale]}))
    model = DATA / "tiny4.yaml"
    common = ["--model", str(model), "--micro-batch", str(MB), "--gpu", GPU, "--warmup", "1", "--runs", "2",
              "--output", str(out)]
    run_profile("--tp", "1", *common)
    run_profile("--tp", "2", *common)
    doc = yaml.safe_load(out.read_text())
    return dict(path=out, doc=doc, model=model, spec=prof.load_spec(str(model)), foreign=foreign)


def entry(doc, tp):
    es = [e for e in doc["profiles"] if e["gpu"] == GPU and e["tp"] == tp and e["micro_batch"] == MB]
    assert len(es) == 1, doc
    return es[0]


def check_entry(e: dict, spec: ModelSpec, tp: int):
    import torch

    assert list(e) == list(FIELDS)
    assert (e["gpu"], e["tp"], e["micro_batch"]) == (GPU, tp, MB)
    for k in TIMES:
        assert isinstance(e[k], float) and e[k] > 0, (k, e[k])
    assert [b["layers"] for b in e["blocks"]] == [1, 2, 4, 8]
    for b in e["blocks"]:
        assert set(b) == {"layers", "fwd_ms", "bwd_ms"}
        assert b["fwd_ms"] > 0 and b["bwd_ms"] > 0
    b8 = e["blocks"][-1]
    # Both rounded to the 6th decimal (profile._ms): one such rounding apart.
    assert e["fwd_ms"] == pytest.approx(b8["fwd_ms"] / 8, rel=0, abs=1e-6)
    assert e["bwd_ms"] == pytest.approx(b8["bwd_ms"] / 8, rel=0, abs=1e-6)
    assert isinstance(e["act_mib"], float) and e["act_mib"] > 0
    # Parameters + gradients + AdamW's two moments, fp32: 16 bytes a parameter, exactly.
    assert e["fixed_mib"] == layer_params(spec, tp) * 16 / 2**20
    assert e["model"] == spec.name == "tiny4"
    assert e["seq_len"] == spec.seq_len and e["dtype"] == "fp32"
    assert e["torch"] == str(torch.__version__)
    assert isinstance(e["device"], str) and e["device"]
    canon = json.dumps(dict(name="tiny4", layers=4, hidden=32, heads=4, seq_len=16, vocab=64, ffn_hidden=128,
                            kv_heads=4, gated_mlp=False), sort_keys=True, separators=(",", ":"))
    assert e["model_hash"] == hashlib.sha256(canon.encode()).hexdigest()


def test_every_field_tp1(run):
    check_entry(entry(run["doc"], 1), run["spec"], 1)


def test_tp2_shard(run):
    e1, e2 = entry(run["doc"], 1), entry(run["doc"], 2)
    check_entry(e2, run["spec"], 2)
    assert 0.45 < e2["fixed_mib"] / e1["fixed_mib"] < 0.55
    assert e2["act_mib"] < e1["act_mib"]  # the attention and MLP activations are split too


def test_output_merge_keeps_other_entries(run):
    ps = run["doc"]["profiles"]
    assert ps[0] == run["foreign"]
    assert [(p["gpu"], p["tp"]) for p in ps] == [("A100-80G", 1), (GPU, 1), (GPU, 2)]
    assert entry(run["doc"], 1)["fwd_ms"] != 999.0  # the stale tiny-gpu entry was replaced
    assert not [p for p in os.listdir(run["path"].parent) if p.endswith(".tmp")]


def test_merge_unit():
    old = {"profiles": [{"gpu": "a", "tp": 1, "micro_batch": 1, "x": 1}, {"gpu": "b", "tp": 2, "micro_batch": 4, "x": 2},
                        {"gpu": "a", "tp": 2, "micro_batch": 1, "x": 3}]}
    new = {"gpu": "B", "tp": 2, "micro_batch": 4, "x": 9}
    assert prof.merge(old, new)["profiles"] == [old["profiles"][0], new, old["profiles"][2]]
    other = {"gpu": "b", "tp": 2, "micro_batch": 8, "x": 5}
    assert prof.merge(old, other)["profiles"] == old["profiles"] + [other]
    assert prof.merge(None, new) == {"profiles": [new]}
    with pytest.raises(prof.ProfileError, match="--output"):
        prof.merge({"something": 1, "profiles": 3}, new)


def test_model_hash_stable_and_changes(run, tmp_path):
    spec = run["spec"]
    h = prof.model_hash(spec)
    assert h == prof.model_hash(prof.load_spec(str(run["model"]))) == entry(run["doc"], 1)["model_hash"]
    assert h == entry(run["doc"], 2)["model_hash"]
    base = dict(name="tiny4", layers=4, hidden=32, heads=4, seq_len=16, vocab=64)
    explicit = tmp_path / "explicit.yaml"  # the defaults written out: same model, same hash
    explicit.write_text(yaml.safe_dump(dict(base, ffn_hidden=128, kv_heads=4, gated_mlp=False)))
    assert prof.model_hash(prof.load_spec(str(explicit))) == h
    for change in (dict(hidden=64), dict(layers=5), dict(vocab=65), dict(name="tiny4b"), dict(gated_mlp=True),
                   dict(kv_heads=2), dict(ffn_hidden=96), dict(seq_len=32)):
        f = tmp_path / "changed.yaml"
        f.write_text(yaml.safe_dump(dict(base, **change)))
        assert prof.model_hash(prof.load_spec(str(f))) != h, change


def test_a_llama_hash_covers_o_bias_only_when_set():
    """o_bias joins the hashed fields only when true: every model hashed before it keeps its
    hash (the same rule as coordinator/src/planning/profiling.rs canonical_json, whose test pins it)."""
    llama = ModelSpec.from_dict(yaml.safe_load((DATA / "tiny-llama.yaml").read_text()))
    assert prof.canonical_spec(llama) == dict(name="tiny-llama", layers=4, hidden=32, heads=4, seq_len=16, vocab=64,
                                              ffn_hidden=64, kv_heads=2, gated_mlp=True, family="llama",
                                              qkv_bias=False)
    biased = ModelSpec.from_dict(dict(llama.to_dict(), qkv_bias=True, o_bias=True))
    assert prof.canonical_spec(biased) == dict(prof.canonical_spec(llama), qkv_bias=True, o_bias=True)
    assert prof.model_hash(biased) != prof.model_hash(ModelSpec.from_dict(dict(biased.to_dict(), o_bias=False)))


@pytest.mark.parametrize("args,flag", [
    (["--model", "no/such/model.yaml", "--tp", "1", "--micro-batch", "1"], "--model"),
    (["--model", "{tiny}", "--tp", "3", "--micro-batch", "1"], "--tp"),
    (["--model", "{tiny}", "--tp", "0", "--micro-batch", "1"], "--tp"),
    (["--model", "{tiny}", "--tp", "8", "--micro-batch", "1"], "--tp"),  # 4 heads
    (["--model", "{tiny}", "--tp", "1", "--micro-batch", "0"], "--micro-batch"),
    (["--model", "{tiny}", "--tp", "1", "--micro-batch", "1", "--seq-len", "0"], "--seq-len"),
    (["--model", "{tiny}", "--tp", "1", "--micro-batch", "1", "--dtype", "fp8"], "--dtype"),
    (["--model", "{tiny}", "--micro-batch", "1"], "--tp"),
])
def test_bad_input_names_the_flag(args, flag, tmp_path):
    out = tmp_path / "p.yaml"
    args = [a.replace("{tiny}", str(DATA / "tiny4.yaml")) for a in args] + ["--output", str(out)]
    r = run_profile(*args, check=False)
    assert r.returncode != 0
    assert flag in r.stderr, r.stderr
    assert not out.exists()


def motley_bin():
    for b in (os.environ.get("MOTLEY_BIN"), str(REPO / "target" / "ci" / "motley"),
              str(REPO / "target" / "release" / "motley")):
        if b and os.path.isfile(b) and os.access(b, os.X_OK):
            return b
    return None


def motley_plan(profiles: Path = None) -> subprocess.CompletedProcess:
    b = motley_bin()
    if b is None:
        pytest.skip("no motley binary ($MOTLEY_BIN, target/ci/motley, target/release/motley)")
    cmd = [b, "plan", "--cluster", str(DATA / "uniform-4x2.yaml"), "--model", str(DATA / "tiny4.yaml"),
           "--global-batch", "8", "--tp", "2", "--micro-batch", str(MB), "--max-stages", "2", "--reserve-gib", "0",
           "-o", "json"] + (["--profiles", str(profiles)] if profiles else [])
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def test_motley_plan_reads_the_file(run):
    r = motley_plan(run["path"])
    if r.returncode != 0 and "unknown field" in r.stderr:
        pytest.skip(f"this motley binary does not know the profiler's extra fields yet: {r.stderr.strip()[:200]}")
    assert r.returncode == 0, r.stderr
    json.loads(r.stdout)


def test_motley_plan_reads_the_required_fields(run, tmp_path):
    """The fields every motley binary knows (gpu, tp, micro_batch, fwd_ms, bwd_ms, act_mib)."""
    core = {"profiles": [{k: p[k] for k in FIELDS[:6] if k in p} for p in run["doc"]["profiles"]]}
    f = tmp_path / "core.yaml"
    f.write_text(yaml.safe_dump(core))
    r = motley_plan(f)
    assert r.returncode == 0, r.stderr
    plain = motley_plan()
    assert plain.returncode == 0, plain.stderr
    # The plan is priced with the measured tp 2 layer, not the roofline estimate.
    assert json.loads(r.stdout)["iteration_time_s"] != json.loads(plain.stdout)["iteration_time_s"]


def test_the_wall_clock_counts_time_the_thread_is_stopped_and_keeps_the_mean():
    """An emulated GPU is a CPU share the kernel enforces by stopping the process: the CPU
    default (the thread's CPU time) does not see a stop, `--clock wall` does, and keeps the mean
    of its runs (a pass may fall between two stops or across one)."""
    import time as _time

    import torch

    cpu = torch.device("cpu")
    stopped = lambda: _time.sleep(0.05)  # noqa: E731 (a stop: no CPU time, 50 ms of wall time)
    thread_ms, _ = prof.Timer(cpu)(stopped)
    wall_ms, _ = prof.Timer(cpu, wall=True)(stopped)
    assert thread_ms < 10 and wall_ms >= 50, (thread_ms, wall_ms)
    assert prof.parse_args(["--model", "m", "--tp", "1", "--micro-batch", "1"]).clock == "auto"
    args = prof.parse_args(["--model", "m", "--tp", "2", "--micro-batch", "1", "--clock", "wall"])
    assert args.clock == "wall"
    worker = prof._worker_argv(args, 1234, 1)
    assert worker[worker.index("--clock") + 1] == "wall", "the TP workers time as rank 0 does"

    import types

    ctx = types.SimpleNamespace(
        args=prof.parse_args(["--model", "m", "--tp", "1", "--micro-batch", "1", "--warmup", "0", "--runs", "3"]),
        timer=prof.Timer(cpu, wall=True), align=lambda: None)
    sleeps = iter([0.0, 0.0, 0.0, 0.0, 0.09, 0.0])  # forward, backward, three times: one stopped forward
    f, b = prof.median_fwd_bwd(ctx, lambda: _time.sleep(next(sleeps)), lambda _: _time.sleep(next(sleeps)), lambda: None)
    assert 25 <= f < 80 and b < 10, (f, b)  # the mean of 0, 0 and 90 ms, not the median 0


def test_the_optimizer_is_timed_over_eight_layers_unless_a_gpu_cannot_hold_them():
    """One layer's AdamW step, repeated, keeps its state in the cache; a stage's step does not
    (profile.optimizer_layers): eight layers on the CPU, fewer where a GPU's free memory could
    not hold four copies of them within half of it."""
    layer = 100 << 20
    assert prof.optimizer_layers(layer, None) == 8
    assert prof.optimizer_layers(layer, 64 * layer) == 8
    assert prof.optimizer_layers(layer, 63 * layer) == 4
    assert prof.optimizer_layers(layer, 8 * layer) == 1
    assert prof.optimizer_layers(layer, layer) == 1  # never fewer than one layer
    with pytest.raises(ValueError):
        prof.optimizer_layers(0, None)
