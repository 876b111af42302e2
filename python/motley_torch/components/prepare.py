"""`python -m motley_torch.data prepare`: text files -> a Megatron indexed dataset (PREFIX.bin/.idx).

Documents: a .jsonl/.json file holds one JSON object per line (its `text_field`; blank lines are
skipped), any other file is one document (UTF-8). Each document is encoded with a Hugging Face
`tokenizers` tokenizer (its post-processor's special tokens included unless
`add_special_tokens=False`; truncation and padding off) and followed by the end-of-document
token; it is one sequence and one document of the index, as Megatron's
tools/preprocess_data.py writes without sentence splitting. The dtype is Megatron's:
uint16 for a vocabulary under 65,500, else int32.

Streaming: documents are read one at a time and encoded (`encode_batch`) in chunks of about
`chunk_bytes` of text; each chunk's tokens are appended to a temporary .bin at once, so memory
stays near a chunk plus the largest document (plus 4 bytes a document for the lengths). At
the end the .idx is written; both are fsynced and renamed into place .idx first, then .bin, an
existing PREFIX.bin being removed first: a crash leaves either the whole new dataset or one
that `open_tokens` refuses (a .idx without its .bin, or one that does not match it).
"""

from __future__ import annotations

import json
import os
import sys
import time
from array import array
from typing import IO, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from .indexed import DataError, megatron_dtype, write_index

EOS_CANDIDATES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>")
JSON_SUFFIXES = (".jsonl", ".json")


def documents(path: str, text_field: str = "text") -> Iterator[Tuple[Optional[str], int]]:
    """(text, bytes of the file it took) for every document of `path`; (None, n) for a blank line."""
    if path.lower().endswith(JSON_SUFFIXES):
        with open(path, "rb") as f:
            for lineno, raw in enumerate(f, 1):
                if not raw.strip():
                    yield None, len(raw)
                    continue
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise DataError(f"--input {path}:{lineno}: not UTF-8 (byte {e.start} of the line); "
                                    f"fix: convert the file to UTF-8") from None
                try:
                    obj = json.loads(line)
                except ValueError as e:
                    raise DataError(f"--input {path}:{lineno}: not a JSON object ({getattr(e, 'msg', e)} at column "
                                    f"{getattr(e, 'colno', '?')}); fix: one JSON object per line (JSON Lines)") from None
                if not isinstance(obj, dict):
                    raise DataError(f"--input {path}:{lineno}: a JSON {type(obj).__name__}, not an object; "
                                    f"fix: one JSON object per line, its text in \"{text_field}\"")
                if text_field not in obj:
                    have = ", ".join(sorted(map(str, obj))[:8]) or "none"
                    raise DataError(f"--input {path}:{lineno}: no \"{text_field}\" field (fields: {have}); "
                                    f"fix: --text-field NAME, or give every line a \"{text_field}\"")
                text = obj[text_field]
                if not isinstance(text, str):
                    raise DataError(f"--input {path}:{lineno}: \"{text_field}\" is a JSON {type(text).__name__}, "
                                    f"not a string; fix: put the document's text there")
                del obj, line
                yield text, len(raw)
    else:
        with open(path, "rb") as f:
            data = f.read()
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise DataError(f"--input {path}: not UTF-8 (byte {e.start}); fix: convert the file to UTF-8") from None
        n = len(data)
        del data
        if text.startswith("\ufeff"):
            text = text[1:]
        yield text, n


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(os.path.dirname(os.path.abspath(path)) or ".", os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _load_tokenizer(path: str, workers: Optional[int]):
    if workers is not None:
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise DataError(f"--workers: expected an integer >= 1, got {workers!r}")
        # The tokenizers crate sizes its (rayon) thread pool from these when it first starts it.
        os.environ["RAYON_NUM_THREADS"] = str(workers)
        os.environ["RAYON_RS_NUM_CPUS"] = str(workers)
        if workers == 1:
            os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise DataError("--tokenizer: the `tokenizers` package is not installed; fix: pip install tokenizers") from None
    if not os.path.isfile(path):
        raise DataError(f"--tokenizer {path}: no such file; fix: give a tokenizer.json (Hugging Face tokenizers)")
    try:
        tok = Tokenizer.from_file(path)
    except Exception as e:  # tokenizers raises a plain Exception on bad JSON
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DataError(f"--tokenizer {path}: not a tokenizers JSON ({msg}); "
                        f"fix: give a model's tokenizer.json (Tokenizer.save writes one)") from None
    tok.no_truncation()
    tok.no_padding()
    return tok


def eos_id(tok, eos_token: Optional[str], tokenizer_path: str) -> Tuple[str, int]:
    if eos_token is not None:
        i = tok.token_to_id(eos_token)
        if i is None:
            raise DataError(f"--eos-token: {eos_token!r} is not in the vocabulary of {tokenizer_path}; "
                            f"fix: give one of its tokens")
        return eos_token, i
    for t in EOS_CANDIDATES:
        i = tok.token_to_id(t)
        if i is not None:
            return t, i
    raise DataError(f"--eos-token: {tokenizer_path} has none of {', '.join(EOS_CANDIDATES)}; "
                    f"fix: --eos-token TOKEN naming its end-of-document token")


class _Progress:
    def __init__(self, total_bytes: int, out: Optional[IO], every_s: float = 1.0):
        self.total, self.out, self.every = total_bytes, out, every_s
        self.t0 = self.last = time.monotonic()

    def line(self, done: int, docs: int, tokens: int, final: bool = False) -> Optional[str]:
        now = time.monotonic()
        if not final and now - self.last < self.every:
            return None
        self.last = now
        dt = max(now - self.t0, 1e-9)
        pct = 100.0 * done / self.total if self.total else 100.0
        s = (f"prepare: {done / 1e6:.1f} of {self.total / 1e6:.1f} MB ({pct:.0f}%), {docs} documents, "
             f"{tokens} tokens, {done / 1e6 / dt:.1f} MB/s")
        if self.out is not None:
            print(s, file=self.out, flush=True)
        return s


def prepare(tokenizer: str, inputs: Sequence[str], output: str, eos_token: Optional[str] = None,
            text_field: str = "text", workers: Optional[int] = None, add_special_tokens: bool = True,
            chunk_bytes: int = 1 << 20, progress: Optional[IO] = sys.stderr, summary: Optional[IO] = sys.stdout) -> dict:
    """Tokenize `inputs` into `output`.bin/.idx; returns the summary (documents, tokens, dtype, ...)."""
    if not inputs:
        raise DataError("--input: no files given; fix: --input FILE...")
    if chunk_bytes < 1:
        raise DataError("--chunk-mb: must be > 0")
    total = 0
    for path in inputs:
        if not os.path.isfile(path):
            raise DataError(f"--input {path}: no such file; fix: give existing text/.jsonl files")
        total += os.path.getsize(path)
    if not output or output.endswith("/") or os.path.isdir(output):
        raise DataError(f"--output {output!r}: give a PREFIX (writes PREFIX.bin and PREFIX.idx), not a directory")
    if output.endswith(".bin") or output.endswith(".idx"):
        raise DataError(f"--output {output}: give the PREFIX without .bin/.idx (writes PREFIX.bin and PREFIX.idx)")
    out_dir = os.path.dirname(os.path.abspath(output))
    if not os.path.isdir(out_dir):
        raise DataError(f"--output {output}: the directory {out_dir} does not exist; fix: create it")
    bin_path, idx_path = output + ".bin", output + ".idx"
    for path in inputs:
        if os.path.abspath(path) in (os.path.abspath(bin_path), os.path.abspath(idx_path)):
            raise DataError(f"--output {output}: would overwrite the input {path}; fix: another PREFIX")

    tok = _load_tokenizer(tokenizer, workers)
    eos_tok, eos = eos_id(tok, eos_token, tokenizer)
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    dtype = megatron_dtype(vocab_size).newbyteorder("<")

    # the same ids without offsets (tokenizers >= 0.20): less memory a token, and faster
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)
    tmp_bin, tmp_idx = f"{bin_path}.tmp{os.getpid()}", f"{idx_path}.tmp{os.getpid()}"
    lengths = array("q")
    n_tokens = 0
    done_bytes = 0
    prog = _Progress(total, progress)
    max_len = np.iinfo(np.int32).max
    try:
        with open(tmp_bin, "wb") as fb:
            batch: List[str] = []
            where: List[str] = []  # each document's file (and line)
            batch_bytes = 0

            def flush():
                nonlocal n_tokens, batch, where, batch_bytes
                if not batch:
                    return
                encs = encode(batch, add_special_tokens=add_special_tokens)
                names = where
                batch, where, batch_bytes = [], [], 0
                parts = []
                for e, name in zip(encs, names):
                    ids = e.ids
                    if len(ids) + 1 > max_len:
                        raise DataError(f"--input {name}: a document of {len(ids)} tokens, more than a Megatron "
                                        f"sequence holds (int32 length); fix: split it into smaller documents")
                    a = np.empty(len(ids) + 1, dtype=dtype)
                    a[:-1] = ids
                    a[-1] = eos
                    parts.append(a)
                    lengths.append(a.size)
                del encs
                buf = np.concatenate(parts)
                fb.write(buf.tobytes())
                n_tokens += int(buf.size)

            for path in inputs:
                per_line = path.lower().endswith(JSON_SUFFIXES)
                for lineno, (text, nbytes) in enumerate(documents(path, text_field), 1):
                    done_bytes += nbytes
                    if text is not None:
                        batch.append(text)
                        where.append(f"{path}:{lineno}" if per_line else path)
                        batch_bytes += len(text)
                        if batch_bytes >= chunk_bytes:
                            flush()
                            prog.line(done_bytes, len(lengths), n_tokens)
            flush()
            if not lengths:
                raise DataError(f"--input: no documents in {', '.join(inputs)}; fix: give non-empty files")
            fb.flush()
            os.fsync(fb.fileno())
        with open(tmp_idx, "wb") as fi:
            write_index(fi, dtype, np.frombuffer(lengths, dtype=np.int64))
            fi.flush()
            os.fsync(fi.fileno())
        if os.path.lexists(bin_path):
            os.unlink(bin_path)
        os.replace(tmp_idx, idx_path)
        os.replace(tmp_bin, bin_path)
        _fsync_dir(bin_path)
    finally:
        for t in (tmp_bin, tmp_idx):
            if os.path.exists(t):
                os.unlink(t)
    prog.line(done_bytes, len(lengths), n_tokens, final=True)
    result = {"documents": len(lengths), "tokens": n_tokens, "dtype": dtype.name, "format": "indexed",
              "bin": bin_path, "idx": idx_path, "vocab_size": vocab_size, "eos_token": eos_tok, "eos_id": eos}
    if summary is not None:
        print(f"wrote {bin_path} + {idx_path}: {result['documents']} documents, {n_tokens} tokens, dtype "
              f"{dtype.name} (vocab {vocab_size}), each document ends with {eos_tok} ({eos})", file=summary, flush=True)
    return result
