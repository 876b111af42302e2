"""A restore loads one generation's copy of a step (docs/checkpoint.md, "Environment"): a step
saved by a launch that lost a node mid-save and again by the next launch is two copies, and a
list mixing them, or of another generation than $MOTLEY_CKPT_RESTORE_GENERATION names, is
refused naming the files and the fix, before any tensor is loaded."""

from __future__ import annotations

import pytest
import torch

from motley_torch.components import checkpoint


def write(path, step: int, generation, rank: bool = False) -> str:
    header = {"format": checkpoint.FORMAT, "step": step}
    if rank:
        header.update(rank=0, world_size=1, data={"next_step": step, "samples": 0})
    else:
        header.update(block="layer.0", part="model", tp_rank=0, tp_size=1, tensors={})
    if generation is not None:
        header["generation"] = generation
    path.write_bytes(checkpoint._safetensors_bytes({"x": torch.zeros(2)}, header))
    return str(path)


def test_a_restore_mixing_generations_is_refused(tmp_path, monkeypatch):
    monkeypatch.delenv(checkpoint.RESTORE_GENERATION_ENV, raising=False)
    unit = write(tmp_path / "layer.00000.model.tp0-1.safetensors", 20, 3)
    rank = write(tmp_path / "rank.00000.safetensors", 20, 4, rank=True)
    # Refused before the model is looked at (none is given).
    with pytest.raises(checkpoint.CheckpointError, match=r"written by more than one launch \(.*layer.00000.model.tp0-1.safetensors "
                                                         r"by generation 3; .*rank.00000.safetensors by generation 4\); "
                                                         r"a step is restored from the files of one generation"):
        checkpoint.restore(None, None, None, [unit, rank])
    # A file whose writer recorded no generation does not pass for either.
    legacy = write(tmp_path / "rank.00001.safetensors", 20, None, rank=True)
    with pytest.raises(checkpoint.CheckpointError, match=r"by no recorded generation"):
        checkpoint.restore(None, None, None, [unit, legacy])


def test_a_restore_of_another_generation_than_expected_is_refused(tmp_path, monkeypatch):
    unit = write(tmp_path / "layer.00000.model.tp0-1.safetensors", 20, 4)
    rank = write(tmp_path / "rank.00000.safetensors", 20, 4, rank=True)
    headers = {p: checkpoint.read_header(p) for p in (unit, rank)}
    assert checkpoint.check_generation(headers, 4) == 4
    monkeypatch.setenv(checkpoint.RESTORE_GENERATION_ENV, "3")
    with pytest.raises(checkpoint.CheckpointError, match=r"MOTLEY_CKPT_RESTORE_GENERATION is 3, but the files listed were "
                                                         r"written by generation 4 .*restore it again"):
        checkpoint.restore(None, None, None, [unit, rank])
    monkeypatch.setenv(checkpoint.RESTORE_GENERATION_ENV, "three")
    with pytest.raises(checkpoint.CheckpointError, match=r"MOTLEY_CKPT_RESTORE_GENERATION: 'three' is not a generation number"):
        checkpoint.restore(None, None, None, [unit, rank])
