"""A Hugging Face directory out is a whole one and replaces nothing unasked (motley_torch.models.hf_out):
a non-empty directory is refused naming the option and --replace; --replace replaces a model
directory's files but never a tree; Motley's own temporaries do not make a directory non-empty;
the tokenizer files and generation_config.json are copied, links followed."""

from __future__ import annotations

import os

import pytest

from motley_torch.models.hf import HFError
from motley_torch.models.hf_out import TOKENIZER_FILES, add_tokenizer, check_out_dir, clear_out_dir, copy_tokenizer


def test_a_new_or_empty_directory_is_taken(tmp_path):
    check_out_dir(str(tmp_path / "new"), False, "--save-hf")
    check_out_dir(str(tmp_path), False, "--save-hf")
    # What an interrupted distributed --save-hf or write_hf leaves is Motley's own.
    for n in (".motley-stage0.safetensors", ".shard-3.safetensors.tmp", "config.json.tmp",
              ".motley-copy.tokenizer.json"):
        (tmp_path / n).write_bytes(b"x")
    check_out_dir(str(tmp_path), False, "--save-hf")


def test_a_non_empty_directory_is_refused_naming_replace(tmp_path):
    for n in ("config.json", "model.safetensors", "tokenizer.json", "notes.txt"):
        (tmp_path / n).write_text("{}")
    with pytest.raises(HFError) as e:
        check_out_dir(str(tmp_path), False, "--out")
    assert str(e.value) == (f"--out: {tmp_path} is not empty (it holds config.json, model.safetensors, notes.txt and "
                            f"1 more); give a new or empty directory, or pass --replace to replace what it holds")
    check_out_dir(str(tmp_path), True, "--out")
    clear_out_dir(str(tmp_path), "--out", keep={"notes.txt"})
    assert os.listdir(tmp_path) == ["notes.txt"]


def test_replace_never_removes_a_tree(tmp_path):
    (tmp_path / "model.safetensors").write_text("x")
    (tmp_path / "projects").mkdir()
    with pytest.raises(HFError, match=f"--save-hf: {tmp_path} holds the directory projects; --replace replaces a "
                                      f"model directory's files, never a tree"):
        clear_out_dir(str(tmp_path), "--save-hf")
    assert (tmp_path / "model.safetensors").exists(), "nothing removed"
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(HFError, match="exists and is not a directory"):
        check_out_dir(str(f), True, "--save-hf")


def test_the_tokenizer_files_that_exist_are_copied_links_followed(tmp_path):
    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    out.mkdir()
    (tmp_path / "blob").write_text('{"tok": 1}')
    os.symlink(tmp_path / "blob", src / "tokenizer.json")  # as in a Hugging Face cache snapshot
    (src / "generation_config.json").write_text('{"eos_token_id": 2}')
    (src / "model.safetensors").write_text("weights are not the tokenizer's")
    assert copy_tokenizer(str(src), str(out)) == ["tokenizer.json", "generation_config.json"]
    assert not (out / "tokenizer.json").is_symlink() and (out / "tokenizer.json").read_text() == '{"tok": 1}'
    assert sorted(os.listdir(out)) == ["generation_config.json", "tokenizer.json"]
    assert add_tokenizer(str(out), None).startswith("no tokenizer (none given: start from --init-from-hf DIR, or "
                                                    "copy one with --tokenizer-from DIR)")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert add_tokenizer(str(out), str(empty)) == f"no tokenizer: {empty} has none of {', '.join(TOKENIZER_FILES)}"
