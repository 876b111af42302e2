"""Asynchronous checkpoint saves (docs/checkpoint.md: a save stalls the rank only for a memory copy).

In this process (a gloo world of 1, the tiny model as one TP-1 stage): an asynchronous save
writes the same bytes as a synchronous one; the values written are those at save() even when
the parameters, the optimizer state and the RNG change right after (the writer is held back
until they have); a failing write is raised by the next save() and by finish(). Through the
trainer (2 stages x TP 2, 4 ranks): the default (asynchronous) and --ckpt-sync / MOTLEY_CKPT_ASYNC=0
runs write byte-identical units and print the same losses; a write failing on one rank ends
every rank with exit 2, the failing one naming the file; a preemption notice seen by one rank
makes every rank save that step, once, and a notice file that is not one ends the run with exit 2
naming MOTLEY_CKPT_NOTICE."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import yaml
from safetensors.torch import load_file

from launcher import DATA, check_ok, hand_plan, launch, losses

from motley_torch.components import checkpoint
from motley_torch.models.transformer import GPTStage
from motley_torch.spec import ModelSpec

KW = dict(seed=7, global_batch=4, lr=1e-3)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    if not dist.is_initialized():
        store = dist.FileStore(str(tmp_path_factory.mktemp("store") / "s"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield SimpleNamespace(replica=0, stage_dp_rank=0, tp_rank=0, tp_size=1, world_size=1, rank=0,
                          device=torch.device("cpu"))
    dist.destroy_process_group()


@pytest.fixture
def view(world):
    yield world
    t = checkpoint._pending and checkpoint._pending.thread
    if t is not None:
        t.join()
    checkpoint._pending = None


def trained():
    spec = ModelSpec.from_dict(yaml.safe_load((DATA / "tiny4.yaml").read_text()))
    model = GPTStage(spec, spec.seq_len, (0, spec.layers))
    model.init_from_seed(3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, spec.vocab, (2, spec.seq_len + 1), generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        logits = model(tokens[:, :-1])
        torch.nn.functional.cross_entropy(logits.reshape(-1, spec.vocab), tokens[:, 1:].reshape(-1)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model, opt


def files(d: Path):
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def test_an_async_save_writes_the_bytes_of_a_sync_save(view, tmp_path):
    model, opt = trained()
    torch.manual_seed(11)
    sdir = checkpoint.save(view, model, opt, 2, str(tmp_path / "async"), asynchronous=True, **KW)
    checkpoint.finish(view)
    torch.manual_seed(11)
    checkpoint.save(view, model, opt, 2, str(tmp_path / "sync"), asynchronous=False, **KW)
    a, s = files(Path(sdir)), files(tmp_path / "sync" / "step-00000002")
    assert "manifest.json" in a and "rank.00000.safetensors" in a and len(a) == 2 * 6 + 3
    assert sorted(a) == sorted(s)
    for name in a:
        assert a[name] == s[name], name
    checkpoint.verify_step(sdir)


def test_the_values_written_are_those_at_save_time(view, tmp_path, monkeypatch):
    model, opt = trained()
    want = {n: p.detach().clone() for n, p in model.named_parameters()}
    want_opt = {n: {k: v.clone() for k, v in opt.state[p].items()} for n, p in model.named_parameters()}
    torch.manual_seed(5)
    want_rng = torch.get_rng_state()
    # Hold the writer back until the state has changed under it.
    go, started = threading.Event(), threading.Event()
    real = checkpoint._safetensors_bytes

    def gated(tensors, header):
        started.set()
        assert go.wait(60)
        return real(tensors, header)

    monkeypatch.setattr(checkpoint, "_safetensors_bytes", gated)
    sdir = Path(checkpoint.save(view, model, opt, 2, str(tmp_path), asynchronous=True, **KW))
    assert started.wait(60)
    assert not list(sdir.glob("*.safetensors")), "save() returned after writing: not asynchronous"
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
            for v in opt.state[p].values():
                v.add_(3.0)  # exp_avg, exp_avg_sq and the step tensor, in place
    torch.rand(100)
    go.set()
    checkpoint.finish(view)
    for n, p in model.named_parameters():
        b = checkpoint.block_of(n)
        label = f"layer.{b:05d}" if isinstance(b, int) else b
        got = load_file(str(sdir / f"{label}.model.tp0-1.safetensors"))[n]
        assert torch.equal(got, want[n]), n
        got_opt = load_file(str(sdir / f"{label}.optimizer.tp0-1.safetensors"))
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(got_opt[f"{n}.{k}"], want_opt[n][k]), (n, k)
        assert float(got_opt[f"{n}.step"]) == float(want_opt[n]["step"]) == 2.0
    assert torch.equal(load_file(str(sdir / "rank.00000.safetensors"))["rng.torch"], want_rng)
    checkpoint.verify_step(str(sdir))


def test_a_failing_write_is_raised_by_the_next_save_and_by_finish(view, tmp_path, monkeypatch):
    model, opt = trained()
    real = checkpoint.write_atomic

    def failing(path, data):
        if "layer.00002.optimizer" in path:
            raise OSError(28, "No space left on device")
        return real(path, data)

    monkeypatch.setattr(checkpoint, "write_atomic", failing)
    checkpoint.save(view, model, opt, 1, str(tmp_path), asynchronous=True, **KW)  # returns: the write is later
    with pytest.raises(checkpoint.CheckpointError,
                       match=r"rank 0: writing checkpoint step 1 to .*step-00000001 failed: OSError: .*No space left"):
        checkpoint.save(view, model, opt, 2, str(tmp_path), asynchronous=True, **KW)
    assert not (tmp_path / "step-00000001" / "manifest.json").exists()
    # Raised once: the failed save is forgotten; the next one fails the same way, at finish().
    checkpoint.save(view, model, opt, 3, str(tmp_path), asynchronous=True, **KW)
    with pytest.raises(checkpoint.CheckpointError, match=r"writing checkpoint step 3 .* No space left"):
        checkpoint.finish(view)
    checkpoint.finish(view)  # nothing in flight any more
    # Synchronous: raised by the save itself.
    with pytest.raises(checkpoint.CheckpointError, match=r"writing checkpoint step 4 .* No space left"):
        checkpoint.save(view, model, opt, 4, str(tmp_path), asynchronous=False, **KW)


def test_a_save_whose_agreement_failed_is_not_agreed_on_again(view, tmp_path, monkeypatch):
    """A member lost during a save's agreement (a job that keeps going): the all-reduce may fail on
    this rank and end on its peers. The save is given up here, so the next save runs the one
    agreement its peers run, not a second one for the step given up (which left the peers in
    the next step's pipeline and this rank in an all-reduce of its own: a deadlock)."""
    model, opt = trained()
    real, calls = checkpoint._agree_max, []

    def lost_member(v, values):
        calls.append(values)
        if len(calls) == 1:
            raise RuntimeError("Connection reset by peer")
        return real(v, values)

    monkeypatch.setattr(checkpoint, "_agree_max", lost_member)
    with pytest.raises(RuntimeError, match="Connection reset"):
        checkpoint.save(view, model, opt, 3, str(tmp_path), asynchronous=False, **KW)
    checkpoint.save(view, model, opt, 4, str(tmp_path), asynchronous=False, **KW)
    assert len(calls) == 2, f"one agreement per save: {calls}"
    assert (tmp_path / "step-00000004" / "manifest.json").exists()


def test_a_bad_MOTLEY_CKPT_ASYNC_is_named(monkeypatch):
    monkeypatch.setenv("MOTLEY_CKPT_ASYNC", "maybe")
    with pytest.raises(checkpoint.CheckpointError, match="MOTLEY_CKPT_ASYNC: 'maybe' is not 0 or 1"):
        checkpoint.async_default()
    monkeypatch.setenv("MOTLEY_CKPT_ASYNC", "0")
    assert checkpoint.async_default() is False
    monkeypatch.delenv("MOTLEY_CKPT_ASYNC")
    assert checkpoint.async_default() is True


# ---- through the trainer ---------------------------------------------------------------------


def plan() -> dict:
    spec = yaml.safe_load((DATA / "tiny4.yaml").read_text())
    stages = [dict(layers=[0, 2], tp=2, dp=1, gpus=[("a", 0), ("a", 1)]),
              dict(layers=[2, 4], tp=2, dp=1, gpus=[("b", 0), ("b", 1)])]
    return hand_plan(spec, 4, 2, [dict(micro_batches=2, stages=stages)])


ARGS = ["--steps", "4", "--seed", "3", "--ckpt-every", "2"]


def test_the_trainer_writes_the_same_steps_async_and_sync(tmp_path):
    a = launch(plan(), ARGS, tmp_path / "a", extra_env={"MOTLEY_CKPT_DIR": str(tmp_path / "ca")})
    s = launch(plan(), ARGS + ["--ckpt-sync"], tmp_path / "s", extra_env={"MOTLEY_CKPT_DIR": str(tmp_path / "cs")})
    e = launch(plan(), ARGS, tmp_path / "e", extra_env={"MOTLEY_CKPT_DIR": str(tmp_path / "ce"),
                                                       "MOTLEY_CKPT_ASYNC": "0"})
    for res in (a, s, e):
        check_ok(res)
    assert losses(a[0].stdout) == losses(s[0].stdout) == losses(e[0].stdout)
    for step in ("step-00000002", "step-00000004"):
        fa, fs, fe = (files(tmp_path / c / step) for c in ("ca", "cs", "ce"))
        assert "manifest.json" in fa and len(fa) == 2 * 10 + 4 + 4 + 1
        assert sorted(fa) == sorted(fs) == sorted(fe)
        # Units byte for byte. The rank files hold the process's torch RNG state, which the
        # trainer never seeds (its data and weights come from their own generators), so it
        # differs from run to run in either mode: their headers, and the manifests' units.
        for name in fa:
            if name.endswith(".safetensors") and not name.startswith("rank."):
                assert fa[name] == fs[name] == fe[name], (step, name)
            elif name.startswith("rank."):
                assert len({checkpoint.read_header(str(tmp_path / c / step / name)).__repr__()
                            for c in ("ca", "cs", "ce")}) == 1, name
            else:
                assert len({json.dumps(json.loads(f[name])["units"]) for f in (fa, fs, fe)}) == 1, name
        checkpoint.verify_step(str(tmp_path / "ca" / step))


def test_a_write_failing_on_one_rank_ends_every_rank_with_exit_2(tmp_path):
    ckpt = tmp_path / "ckpt"
    # Rank 3 (stage 1, TP rank 1) cannot put its unit of layer 3 in place: a directory is there.
    (ckpt / "step-00000002" / "layer.00003.model.tp1-2.safetensors").mkdir(parents=True)
    res = launch(plan(), ARGS, tmp_path / "run", extra_env={"MOTLEY_CKPT_DIR": str(ckpt)})
    assert [r.returncode for r in res] == [2, 2, 2, 2], [r.log[-1500:] for r in res]
    assert "rank 3: writing checkpoint step 2 to" in res[3].log and "layer.00003.model.tp1-2" in res[3].log
    assert "checkpoint step 2" in res[0].log and "another rank's write failed" in res[0].log
    assert not (ckpt / "step-00000004").exists()  # the failure stopped training at the next save
    assert not (ckpt / "step-00000002" / "manifest.json").exists()


def test_a_notice_seen_by_one_rank_makes_every_rank_save_that_step_once(tmp_path):
    """Only rank 3's MOTLEY_CKPT_NOTICE exists (as when one node's agent got the notice first):
    the ranks agree on it after step 0 and all save step 1 (not a multiple of --ckpt-every),
    complete and verifying; the notice stays in place and no step is saved for it again."""
    ckpt, notice = tmp_path / "ckpt", tmp_path / "notice-3.json"
    notice.write_text(json.dumps({"notice": 5, "deadline_unix_ms": 0}))
    per_rank = {r: {"MOTLEY_CKPT_NOTICE": str(tmp_path / f"notice-{r}.json")} for r in range(4)}
    res = launch(plan(), ARGS, tmp_path / "run", extra_env={"MOTLEY_CKPT_DIR": str(ckpt)}, rank_env=per_rank)
    check_ok(res)
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-00000001", "step-00000002", "step-00000004"]
    for step in ("step-00000001", "step-00000002", "step-00000004"):
        checkpoint.verify_step(str(ckpt / step))
    for r in res:
        assert r.log.count("motley-notice 5: saving step 1") == 1, r.log[-2000:]


def test_a_notice_file_that_is_not_one_ends_the_run_with_exit_2(tmp_path):
    """Only rank 2's notice file is bad (each node has its own): it names the file, and the
    other ranks, which agreed with it in the same all-reduce, end too instead of waiting."""
    notice = tmp_path / "notice-2.json"
    notice.write_text("{half")
    per_rank = {r: {"MOTLEY_CKPT_NOTICE": str(tmp_path / f"notice-{r}.json")} for r in range(4)}
    res = launch(plan(), ARGS, tmp_path / "run", extra_env={"MOTLEY_CKPT_DIR": str(tmp_path / "ckpt")},
                 rank_env=per_rank, timeout=120)
    assert [r.returncode for r in res] == [2, 2, 2, 2], [r.log[-1500:] for r in res]
    assert f"MOTLEY_CKPT_NOTICE ({notice}): not a preemption notice" in res[2].log
    assert "another rank could not read its preemption notice" in res[0].log


def test_ranks_that_left_a_notices_agreement_differently_all_save_at_the_next(tmp_path, monkeypatch):
    """A member lost during the notice's all-reduce may leave it finished on some ranks only (they
    marked the notice handled, the others gave that boundary up): at the next boundary every rank
    must still decide the same, or the ones saving wait in the save's agreement for the others.
    The all-reduce is replaced by the maximum with the other rank's values."""
    from motley_torch.components import save_notice

    (tmp_path / "notice.json").write_text(json.dumps({"notice": 3, "deadline_unix_ms": 0}))
    finished, given_up = (save_notice.SaveNotice(str(tmp_path / "notice.json")) for _ in range(2))
    finished.handled = 3  # its agreement on notice 3 finished; the other's failed

    def with_other(notice):  # what `notice`'s rank puts in the same all-reduce
        other = [notice.seen(), 0, -notice.handled]
        return lambda view, values: [max(a, b) for a, b in zip(values, other)]

    monkeypatch.setattr(save_notice, "_agree_max", with_other(given_up))
    assert finished.due(None) is True
    monkeypatch.setattr(save_notice, "_agree_max", with_other(SimpleNamespace(seen=lambda: 3, handled=3)))
    assert given_up.due(None) is True
    assert finished.handled == given_up.handled == 3
    monkeypatch.setattr(save_notice, "_agree_max", with_other(given_up))
    assert finished.due(None) is False and given_up.due(None) is False  # and once only
