"""A Hugging Face directory out (--save-hf, `python -m motley_torch.export --out`) is a whole
one and replaces nothing unasked: it is written into a new or empty directory (a non-empty one
is refused, naming the option and --replace), and it carries the tokenizer files and
generation_config.json of the model it came from, so that transformers' AutoTokenizer and
AutoModelForCausalLM both load it."""

from __future__ import annotations

import os
import re
import sys
from typing import Iterable, List

from .hf import HFError
from ..spec import PlanError

# What a Hugging Face model directory holds besides config.json and the weights, by the names
# transformers' AutoTokenizer and GenerationConfig read: the tokenizer in whichever format the
# model has (fast: tokenizer.json; SentencePiece: tokenizer.model / spiece.model; BPE:
# vocab.json + merges.txt; WordPiece: vocab.txt), its settings and added tokens, the chat
# template, and the generation defaults.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "tokenizer.model", "spiece.model", "vocab.json", "merges.txt", "vocab.txt",
                   "chat_template.jinja", "chat_template.json", "generation_config.json")

# Names Motley itself leaves in a directory it writes into while writing (the stages' staging
# files of a distributed --save-hf, write_hf's shards and JSON files before their rename): not
# what "a non-empty directory" means.
_OUR_TEMPORARIES = re.compile(r"^(\.motley-stage\d+\.safetensors|\.shard-\d+\.safetensors\.tmp|[\w.-]+\.json\.tmp|"
                              r"\.motley-copy\.[\w.-]+)$")


def check_out_dir(out_dir: str, replace: bool, flag: str):
    """A Hugging Face directory is written into a new or empty directory: one holding anything
    else is refused (naming `flag`, the option that named it) unless `replace`, and even then
    one holding a directory, which a model directory never does (--replace given a tree, such
    as a home directory, by mistake)."""
    if not os.path.lexists(out_dir):
        return
    if not os.path.isdir(out_dir):
        raise HFError(f"{flag}: {out_dir} exists and is not a directory; give a new or empty directory")
    held = sorted(n for n in os.listdir(out_dir) if not _OUR_TEMPORARIES.match(n))
    if not held:
        return
    if not replace:
        shown = ", ".join(held[:3]) + (f" and {len(held) - 3} more" if len(held) > 3 else "")
        raise HFError(f"{flag}: {out_dir} is not empty (it holds {shown}); give a new or empty directory, or pass "
                      f"--replace to replace what it holds")
    trees = [n for n in held if os.path.isdir(os.path.join(out_dir, n)) and not os.path.islink(os.path.join(out_dir, n))]
    if trees:
        raise HFError(f"{flag}: {out_dir} holds the directory {trees[0]}; --replace replaces a model directory's "
                      f"files, never a tree: give a new or empty directory")


def clear_out_dir(out_dir: str, flag: str, keep: Iterable[str] = ()):
    """--replace: remove the files and links `out_dir` holds (after check_out_dir), but `keep`."""
    check_out_dir(out_dir, True, flag)
    if not os.path.isdir(out_dir):
        return
    keep = set(keep)
    for n in os.listdir(out_dir):
        if n not in keep:
            os.remove(os.path.join(out_dir, n))


def copy_tokenizer(src_dir: str, out_dir: str) -> List[str]:
    """Copy the tokenizer files and generation_config.json that `src_dir` has (TOKENIZER_FILES;
    links followed, as in a Hugging Face cache snapshot) into `out_dir`, each through a
    temporary name renamed when whole. Returns the names copied, none when `src_dir` has none."""
    import shutil

    copied = []
    for name in TOKENIZER_FILES:
        src = os.path.join(src_dir, name)
        if not os.path.isfile(src):
            continue
        tmp = os.path.join(out_dir, f".motley-copy.{name}")
        shutil.copyfile(src, tmp)
        os.replace(tmp, os.path.join(out_dir, name))
        copied.append(name)
    return copied


def add_tokenizer(out_dir: str, tokenizer_from) -> str:
    """After the weights: copy the tokenizer from `tokenizer_from` (None: there is none to copy);
    returns what `out_dir` now has of it, for the line that reports the directory written."""
    if tokenizer_from is None:
        return "no tokenizer (none given: start from --init-from-hf DIR, or copy one with --tokenizer-from DIR)"
    copied = copy_tokenizer(tokenizer_from, out_dir)
    if not copied:
        return f"no tokenizer: {tokenizer_from} has none of {', '.join(TOKENIZER_FILES)}"
    return f"{', '.join(copied)} from {tokenizer_from}"


# ---- the trainer's options ------------------------------------------------------------------


def check_args(args):
    """Before training: --save-hf's directory is new or empty, or --replace says to replace it
    (check_out_dir); --replace and --tokenizer-from only with --save-hf."""
    for flag, given in (("--replace", args.replace), ("--tokenizer-from", args.tokenizer_from)):
        if given and not args.save_hf:
            raise PlanError(f"{flag}: only with --save-hf DIR (it concerns the Hugging Face directory written)")
    if args.tokenizer_from and not os.path.isdir(args.tokenizer_from):
        raise PlanError(f"--tokenizer-from: {args.tokenizer_from} is not a directory")
    if args.save_hf:
        check_out_dir(args.save_hf, args.replace, "--save-hf")


def prepare(args, keep=()):
    """Just before the weights are written: checked again (another writer may have come since
    the start), and emptied under --replace but for `keep` (the stages' staging files)."""
    if args.replace:
        clear_out_dir(args.save_hf, "--save-hf", keep)
    else:
        check_out_dir(args.save_hf, False, "--save-hf")


def finish(args):
    """After the weights: the tokenizer (--tokenizer-from, else --init-from-hf's), and one line."""
    note = add_tokenizer(args.save_hf, args.tokenizer_from or args.init_from_hf)
    print(f"motley_torch.train: --save-hf: wrote {args.save_hf}; {note}", file=sys.stderr, flush=True)
