"""Checkpoints (docs/checkpoint.md): a 2-stage x TP-2 run writes steps 3 and 6; a fresh run
restored from step 3 prints the uninterrupted run's losses for steps 3..5; the manifest's crcs
verify (here and with the Rust reader, `motley-ckpt verify`); the step re-sliced to TP 1 by
`motley-ckpt reslice` restores a TP-1 plan to the same losses; bad restore lists are refused
naming the fix."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml

from launcher import DATA, REPO, check_ok, hand_plan, launch, losses
from tolerance import assert_steps_close, layers_of

from motley_torch.components import checkpoint

STEPS, EVERY, SEED = 6, 3, 3
LAYERS = layers_of(DATA / "tiny4.yaml")


def ckpt_bin() -> str:
    b = Path(os.environ.get("MOTLEY_BIN") or REPO / "target" / "ci" / "motley").parent / "motley-ckpt"
    if not os.access(b, os.X_OK):
        raise AssertionError(f"no {b}: build it (cargo build --profile ci -p motley-checkpoint)")
    return str(b)


def plan(tp: int) -> dict:
    spec = yaml.safe_load((DATA / "tiny4.yaml").read_text())
    stages = [dict(layers=[0, 2], tp=tp, dp=1, gpus=[("a", i) for i in range(tp)]),
              dict(layers=[2, 4], tp=tp, dp=1, gpus=[("b", i) for i in range(tp)])]
    return hand_plan(spec, 4, 2, [dict(micro_batches=2, stages=stages)])


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The uninterrupted run: 6 steps, a checkpoint after steps 3 and 6."""
    root = tmp_path_factory.mktemp("ckpt")
    res = launch(plan(2), ["--steps", str(STEPS), "--seed", str(SEED), "--ckpt-every", str(EVERY)], root / "full",
                 extra_env={"MOTLEY_CKPT_DIR": str(root / "ckpt")})
    check_ok(res)
    return root, losses(res[0].stdout)


def step_files(step_dir: Path):
    m = json.loads((step_dir / "manifest.json").read_text())
    return [str(step_dir / e["file"]) for e in [*m["units"], *m["ranks"]]]


def test_steps_are_written_complete_and_verify(run):
    root, full = run
    assert len(full) == STEPS
    dirs = sorted(p.name for p in (root / "ckpt").iterdir())
    assert dirs == ["step-00000003", "step-00000006"]
    sdir = root / "ckpt" / "step-00000003"
    m = checkpoint.verify_step(str(sdir))
    assert (m["format"], m["step"], m["layers"], m["world_size"]) == ("motley-checkpoint/1", 3, 4, 4)
    # embed and head once (replicated, tp 0-1), each of 4 layers per TP rank; both parts.
    assert len(m["units"]) == 2 * (1 + 4 * 2 + 1)
    assert [r["rank"] for r in m["ranks"]] == [0, 1, 2, 3]
    names = sorted(os.listdir(sdir))
    assert "layer.00002.optimizer.tp1-2.safetensors" in names and "embed.model.tp0-1.safetensors" in names
    assert not [n for n in names if ".tmp." in n]
    # Weights and optimizer state are the job's own: every file 0600.
    assert {oct(os.stat(sdir / n).st_mode & 0o777) for n in names} == {oct(0o600)}
    q = next(u for u in m["units"] if u["block"] == "layer.1" and u["part"] == "model" and u["tp_rank"] == 1)
    assert q["tensors"]["layers.1.attn.q.weight"] == {
        "shape": [32, 32], "dtype": "F32", "layout": {"kind": "split", "axis": 0, "granule": 8}}
    assert q["tensors"]["layers.1.attn.o.weight"]["layout"] == {"kind": "split", "axis": 1, "granule": 8}
    assert q["tensors"]["layers.1.mlp.fc1.weight"]["layout"] == {"kind": "split", "axis": 0}
    assert q["tensors"]["layers.1.ln1.weight"]["layout"] == {"kind": "replicated"}
    assert all(len(u["crc32c"]) == 1 and u["chunk_bytes"] == 16 << 20 for u in m["units"])
    # The Rust reader: complete, every crc.
    out = subprocess.run([ckpt_bin(), "verify", str(sdir)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["units"] == 20


def test_a_restored_run_continues_with_the_same_losses(run, tmp_path):
    root, full = run
    files = step_files(root / "ckpt" / "step-00000003")
    res = launch(plan(2), ["--steps", str(STEPS), "--seed", str(SEED)], tmp_path,
                 extra_env={"MOTLEY_CKPT_RESTORE": json.dumps(files)})
    check_ok(res)
    lines = [d for d in map(json.loads, res[0].stdout.splitlines()) if "loss" in d]
    assert [x["step"] for x in lines] == [3, 4, 5]
    # The same plan, the state restored to the bit, every sum in the same order: the same bits.
    assert [x["loss"] for x in lines] == full[EVERY:], (lines, full)
    assert all("motley-restore step 3" in r.log for r in res)


def test_a_step_resliced_to_tp1_restores_a_tp1_plan(run, tmp_path):
    root, full = run
    out_dir = tmp_path / "tp1" / "step-00000003"
    out = subprocess.run([ckpt_bin(), "reslice", str(root / "ckpt" / "step-00000003"), "--tp", "1", "--out",
                          str(out_dir)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    m = checkpoint.verify_step(str(out_dir))
    assert {u["tp_size"] for u in m["units"]} == {1} and len(m["units"]) == 2 * 6
    # Every file records the launch that wrote it (the launcher's MOTLEY_GENERATION), the cut
    # units their sources' (a restore refuses a mix of generations).
    assert {checkpoint.read_header(p).get("generation") for p in step_files(out_dir)} == {0}
    # The list in a file this time (the other form of MOTLEY_CKPT_RESTORE).
    lst = tmp_path / "restore.json"
    lst.write_text(json.dumps(step_files(out_dir)))
    res = launch(plan(1), ["--steps", str(STEPS), "--seed", str(SEED)], tmp_path / "run",
                 extra_env={"MOTLEY_CKPT_RESTORE": str(lst)})
    check_ok(res)
    got = losses(res[0].stdout)
    assert len(got) == STEPS - EVERY
    # TP 1 sums in another order than TP 2: equal up to fp32 rounding.
    assert_steps_close(got, full[EVERY:], LAYERS, "TP 1 restored against TP 2 uninterrupted",
                       steps=range(EVERY, STEPS))


def test_a_restore_list_without_the_ranks_tp_shard_is_refused(run, tmp_path):
    root, _ = run
    sdir = root / "ckpt" / "step-00000003"
    # TP-2 units handed to a TP-1 plan: the error names the unit and says to re-slice.
    res = launch(plan(1), ["--steps", str(STEPS), "--seed", str(SEED)], tmp_path / "a",
                 extra_env={"MOTLEY_CKPT_RESTORE": json.dumps(step_files(sdir))})
    assert all(r.returncode == 2 for r in res), [r.log[-2000:] for r in res]
    assert "no unit of layer.0 model for tp rank 0/1" in res[0].log
    assert "only tp 0/2, 1/2 listed: re-slice it for tp 1 (motley-ckpt reslice)" in res[0].log
    # A unit left out.
    files = [f for f in step_files(sdir) if "layer.00003.optimizer.tp1-2" not in f]
    res = launch(plan(2), ["--steps", str(STEPS), "--seed", str(SEED)], tmp_path / "b",
                 extra_env={"MOTLEY_CKPT_RESTORE": json.dumps(files)})
    assert res[3].returncode == 2 and "no unit of layer.3 optimizer for tp rank 1/2" in res[3].log, res[3].log


def test_restore_lists_and_corruption_are_named(run, tmp_path):
    root, _ = run
    with pytest.raises(checkpoint.CheckpointError, match=r"MOTLEY_CKPT_RESTORE\[1\]: 'rel/x' is not an absolute path"):
        checkpoint.restore_list('["/a", "rel/x"]')
    with pytest.raises(checkpoint.CheckpointError, match="neither a JSON list of paths nor a file"):
        checkpoint.restore_list(str(tmp_path / "missing.json"))
    f = tmp_path / "l.json"
    f.write_text("{oops")
    with pytest.raises(checkpoint.CheckpointError, match=r"MOTLEY_CKPT_RESTORE \(.*l.json\): not JSON"):
        checkpoint.restore_list(str(f))
    f.write_text('["/x/y"]')
    assert checkpoint.restore_list(str(f)) == ["/x/y"]
    # A flipped byte: both readers name the unit and the chunk.
    import shutil

    sdir = tmp_path / "step-00000006"
    shutil.copytree(root / "ckpt" / "step-00000006", sdir)
    victim = sdir / "layer.00001.model.tp0-2.safetensors"
    data = bytearray(victim.read_bytes())
    data[-5] ^= 0x10
    victim.write_bytes(bytes(data))
    with pytest.raises(checkpoint.CheckpointError, match=r"unit layer.00001.model.tp0-2.safetensors: chunk 0 has crc32c"):
        checkpoint.verify_step(str(sdir))
    out = subprocess.run([ckpt_bin(), "verify", str(sdir)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert "unit layer.00001.model.tp0-2.safetensors: chunk 0 (bytes 0.." in out.stderr, out.stderr
    assert "fetch the unit again from another holder" in out.stderr


def test_a_python_without_crc32c_is_refused_when_the_rank_starts(tmp_path):
    """Checkpoints checksum every file with crc32c: a rank whose Python cannot import it ends at
    its start (exit 2, naming the package and the fix), before any step, rather than at its
    first save an interval later (every restart would lose the same steps again)."""
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    (shadow / "crc32c.py").write_text('raise ImportError("no crc32c in this Python (the test\'s stand-in)")\n')
    pythonpath = os.pathsep.join([str(shadow), str(REPO / "python"), os.environ.get("PYTHONPATH", "")])
    res = launch(plan(1), ["--steps", str(STEPS), "--seed", str(SEED), "--ckpt-every", str(EVERY)], tmp_path / "run",
                 extra_env={"MOTLEY_CKPT_DIR": str(tmp_path / "ckpt"), "PYTHONPATH": pythonpath})
    for r in res:
        assert r.returncode == 2, (r.rank, r.returncode, r.log[-2000:])
        assert "checkpoints need the crc32c package" in r.log and "pip install crc32c" in r.log, r.log[-2000:]
        assert losses(r.stdout) == [], "no step was taken"
