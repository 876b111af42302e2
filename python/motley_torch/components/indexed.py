"""Tokenized datasets on disk, read by memory map: Megatron-LM's indexed dataset and flat token files.

Pure numpy (no torch). Two formats:

* Megatron-LM's indexed dataset (`megatron/core/datasets/indexed_dataset.py`, also NeMo's):
  `PREFIX.bin` holds the tokens, `PREFIX.idx` is, little-endian,
  `MMIDIDX\\x00\\x00`, <Q version 1, <B dtype code (1 uint8, 2 int8, 3 int16, 4 int32, 5 int64,
  6 float64, 7 float32, 8 uint16), <Q sequence count n, <Q document-index count m (the number of
  documents + 1: Megatron's `_IndexWriter` writes `len(document_indices)`), then n int32 sequence
  lengths (tokens), n int64 sequence pointers (byte offsets into .bin), m int64 document indices
  (sequence indices, starting with 0 and ending with n). Megatron's multimodal variant appends n
  int8 sequence modes; it is refused (its sequences need not be text tokens).
* A flat token file: `FILE.bin` without an `.idx` next to it, little-endian uint16 (or uint32).

The token stream is the sequences in index order (for a flat file: the file). Sample i of
sequence length S is the stream's tokens [i*S, i*S+S+1) (inputs the first S, targets shifted by
one); there are (num_tokens - 1) // S samples.
"""

from __future__ import annotations

import os
import struct
from typing import BinaryIO, Optional, Sequence, Tuple

import numpy as np

from ..spec import PlanError

MAGIC = b"MMIDIDX\x00\x00"
HEADER_BYTES = 9 + 8 + 1 + 8 + 8  # magic, version, dtype code, sequence count, document-index count

# Megatron's DType enum (megatron/core/datasets/indexed_dataset.py).
CODE_DTYPES = {1: "uint8", 2: "int8", 3: "int16", 4: "int32", 5: "int64", 6: "float64", 7: "float32", 8: "uint16"}
DTYPE_CODES = {v: k for k, v in CODE_DTYPES.items()}
FLAT_DTYPES = ("uint16", "uint32")


class DataError(PlanError):
    """A dataset the trainer cannot read; the message names the file, the field and the fix."""


def megatron_dtype(vocab_size: int) -> np.dtype:
    """The token dtype Megatron's tools/preprocess_data.py picks (`DType.optimal_dtype`)."""
    return np.dtype(np.uint16) if vocab_size < 65500 else np.dtype(np.int32)


# ---------------------------------------------------------------------------------------------
# Writing (what Megatron's IndexedDatasetBuilder / _IndexWriter write)
# ---------------------------------------------------------------------------------------------


def write_index(f: BinaryIO, dtype, sequence_lengths, document_indices=None) -> None:
    """Write a .idx for sequences stored back to back in the .bin (pointers from the lengths).

    `document_indices` defaults to one sequence per document (0, 1, ..., n)."""
    dt = np.dtype(dtype)
    code = DTYPE_CODES.get(dt.name)
    if code is None:
        raise ValueError(f"dtype {dt.name} has no Megatron DType code")
    lengths = np.asarray(sequence_lengths, dtype=np.int64)
    if lengths.size and (lengths.min() < 0 or lengths.max() > np.iinfo(np.int32).max):
        raise ValueError("sequence lengths must fit int32 and be >= 0")
    n = int(lengths.size)
    docs = np.arange(n + 1, dtype=np.int64) if document_indices is None else np.asarray(document_indices, np.int64)
    pointers = np.zeros(n, dtype=np.int64)
    if n > 1:
        np.cumsum(lengths[:-1] * dt.itemsize, out=pointers[1:])
    f.write(MAGIC)
    f.write(struct.pack("<Q", 1))
    f.write(struct.pack("<B", code))
    f.write(struct.pack("<Q", n))
    f.write(struct.pack("<Q", int(docs.size)))
    f.write(lengths.astype("<i4").tobytes(order="C"))
    f.write(pointers.astype("<i8").tobytes(order="C"))
    f.write(docs.astype("<i8").tobytes(order="C"))


# ---------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------


def resolve(path: str) -> Tuple[str, str, Optional[str]]:
    """(format, bin_path, idx_path) for `--data PATH`: a PREFIX with PREFIX.bin and PREFIX.idx,
    PREFIX.bin or PREFIX.idx whose partner exists (indexed), or FILE.bin without .idx (flat)."""
    fix = "give a PREFIX (PREFIX.bin + PREFIX.idx), PREFIX.bin/.idx, or a flat FILE.bin"
    if not isinstance(path, str) or not path:
        raise DataError(f"--data: no path given; {fix}")
    if path.endswith(".bin") or path.endswith(".idx"):
        prefix = path[:-4]
        bin_path, idx_path = prefix + ".bin", prefix + ".idx"
        if not os.path.isfile(path):
            raise DataError(f"--data {path}: no such file; {fix}")
        if path.endswith(".idx"):
            if not os.path.isfile(bin_path):
                raise DataError(f"--data {path}: its data file {bin_path} is missing; "
                                f"copy it next to the .idx (or re-create both with `python -m motley_torch.data prepare`)")
            return "indexed", bin_path, idx_path
        if os.path.isfile(idx_path):
            return "indexed", bin_path, idx_path
        return "flat", bin_path, None
    bin_path, idx_path = path + ".bin", path + ".idx"
    has_bin, has_idx = os.path.isfile(bin_path), os.path.isfile(idx_path)
    if has_bin and has_idx:
        return "indexed", bin_path, idx_path
    if has_idx:
        raise DataError(f"--data {path}: {idx_path} exists but its data file {bin_path} is missing; "
                        f"copy it next to the .idx (or re-create both with `python -m motley_torch.data prepare`)")
    if has_bin:
        raise DataError(f"--data {path}: {idx_path} is missing (only {bin_path} exists); "
                        f"give --data {bin_path} to read it as a flat token file, or re-create the dataset with prepare")
    if os.path.isfile(path):
        raise DataError(f"--data {path}: not a .bin/.idx file or a dataset prefix; "
                        f"a flat token file must be named FILE.bin (or {fix})")
    raise DataError(f"--data {path}: no such file, and neither {bin_path} nor {idx_path} exists; {fix}")


class TokenData:
    """A tokenized dataset, memory-mapped. Use `open_tokens` to make one."""

    path: str           # the --data path as given
    format: str         # "indexed" or "flat"
    bin_path: str
    idx_path: Optional[str]
    dtype: str          # numpy dtype name of the stored tokens
    num_tokens: int
    num_documents: Optional[int]  # None for a flat file (no document boundaries)
    num_sequences: Optional[int]
    vocab: Optional[int]

    def __init__(self, path: str, dtype: Optional[str] = None, vocab: Optional[int] = None):
        if vocab is not None and (isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 1):
            raise DataError(f"model.vocab: expected a positive integer, got {vocab!r}")
        self.path = path
        self.vocab = vocab
        self.format, self.bin_path, self.idx_path = resolve(path)
        self._stream: Optional[np.ndarray] = None   # the whole token stream when contiguous
        self._starts: Optional[np.ndarray] = None   # gather mode: stream start of every sequence (+ end)
        self._pointers: Optional[np.ndarray] = None
        self._idx_map = None
        self._bin = None
        self._closed = False
        self._document_indices: Optional[np.ndarray] = None
        self._sequence_lengths: Optional[np.ndarray] = None
        if dtype is not None and dtype not in FLAT_DTYPES:
            raise DataError(f"--data-dtype: {dtype!r} is not a flat token file dtype; use uint16 or uint32")
        bin_size = os.path.getsize(self.bin_path)
        if self.format == "flat":
            self._open_flat(dtype, bin_size)
        else:
            self._open_indexed(dtype, bin_size)
        if self.num_tokens < 2:
            raise DataError(f"--data {self.bin_path}: {self.num_tokens} token(s); a sample needs at least 2 "
                            f"(seq_len + 1); fix: use a dataset with more tokens")
        self._signed = np.dtype(self.dtype).kind == "i"

    # -- opening --------------------------------------------------------------------------------

    def _open_flat(self, dtype: Optional[str], bin_size: int) -> None:
        name = "uint16" if dtype is None else dtype
        dt = np.dtype(name).newbyteorder("<")
        if bin_size == 0:
            raise DataError(f"--data {self.bin_path}: the file is empty; fix: give a file of {name} tokens")
        if bin_size % dt.itemsize:
            raise DataError(f"--data {self.bin_path}: {bin_size} bytes is not a whole number of {name} tokens "
                            f"({dt.itemsize} bytes each); fix: the file is truncated or not {name} "
                            f"(--data-dtype uint16|uint32)")
        self.dtype = name
        self.num_tokens = bin_size // dt.itemsize
        self.num_documents = None
        self.num_sequences = None
        self._stream = np.memmap(self.bin_path, dtype=dt, mode="r", shape=(self.num_tokens,))

    def _open_indexed(self, dtype: Optional[str], bin_size: int) -> None:
        idx, binp = self.idx_path, self.bin_path
        remake = "re-create the dataset (python -m motley_torch.data prepare, or Megatron's preprocess_data.py)"
        idx_size = os.path.getsize(idx)
        with open(idx, "rb") as f:
            head = f.read(HEADER_BYTES)
        if head[:9] != MAGIC and not (head and MAGIC.startswith(head)):
            raise DataError(f"--data {idx}: bad magic {head[:9]!r}, expected {MAGIC!r} (Megatron's MMIDIDX); "
                            f"fix: give the .idx of a Megatron-LM/NeMo indexed dataset, or {remake}")
        if len(head) < HEADER_BYTES:
            raise DataError(f"--data {idx}: header truncated ({idx_size} bytes, the header alone is "
                            f"{HEADER_BYTES}); fix: {remake}")
        (version,) = struct.unpack_from("<Q", head, 9)
        (code,) = struct.unpack_from("<B", head, 17)
        n, m = struct.unpack_from("<QQ", head, 18)
        if version != 1:
            raise DataError(f"--data {idx}: header version {version}, only version 1 exists; fix: {remake}")
        if code not in CODE_DTYPES:
            raise DataError(f"--data {idx}: header dtype code {code} is not one of Megatron's "
                            f"(1..8: {', '.join(f'{k} {v}' for k, v in CODE_DTYPES.items())}); fix: {remake}")
        name = CODE_DTYPES[code]
        if name.startswith("float"):
            raise DataError(f"--data {idx}: header dtype {name} (code {code}) holds no token ids; "
                            f"fix: give a dataset of integer tokens")
        if n == 0:
            raise DataError(f"--data {idx}: header sequence count is 0 (no tokens); fix: {remake}")
        if m < 1:
            raise DataError(f"--data {idx}: header document-index count is 0 (Megatron writes documents + 1, "
                            f"starting with 0); fix: {remake}")
        expect = HEADER_BYTES + 4 * n + 8 * n + 8 * m
        if idx_size == expect + n:
            raise DataError(f"--data {idx}: has sequence modes (Megatron's multimodal index); only text "
                            f"datasets are read; fix: give a text dataset's .idx")
        if idx_size != expect:
            raise DataError(f"--data {idx}: {idx_size} bytes, but its header ({n} sequences, {m} document "
                            f"indices) needs {expect}; fix: the .idx is truncated or corrupt, {remake}")
        dt = np.dtype(name).newbyteorder("<")
        isz = dt.itemsize
        mm = np.memmap(idx, dtype=np.uint8, mode="r")
        self._idx_map = mm
        lengths = np.frombuffer(mm, dtype="<i4", count=n, offset=HEADER_BYTES)
        pointers = np.frombuffer(mm, dtype="<i8", count=n, offset=HEADER_BYTES + 4 * n)
        docs = np.frombuffer(mm, dtype="<i8", count=m, offset=HEADER_BYTES + 12 * n)
        if lengths.min() < 0:
            k = int(np.flatnonzero(lengths < 0)[0])
            raise DataError(f"--data {idx}: sequence_lengths[{k}] is {int(lengths[k])} (negative); fix: {remake}")
        if docs[0] != 0 or docs[-1] != n or (m > 1 and np.any(np.diff(docs) < 0)):
            raise DataError(f"--data {idx}: document_indices must rise from 0 to the sequence count {n}, "
                            f"got {int(docs[0])} .. {int(docs[-1])}; fix: {remake}")
        ends = pointers + lengths.astype(np.int64) * isz
        bad = (pointers < 0) | (pointers % isz != 0) | (ends > bin_size)
        if bad.any():
            k = int(np.flatnonzero(bad)[0])
            raise DataError(f"--data {idx}: sequence {k} (bytes {int(pointers[k])}..{int(ends[k])} of {name}) "
                            f"does not lie in {binp} ({bin_size} bytes); fix: this .idx does not belong to "
                            f"that .bin (or the .bin is truncated): {remake}")
        total = int(lengths.sum(dtype=np.int64))
        contiguous = pointers[0] == 0 and (n == 1 or bool(np.array_equal(pointers[1:], ends[:-1])))
        if contiguous and int(ends[-1]) != bin_size:
            raise DataError(f"--data {idx}: its {n} sequences cover {int(ends[-1])} bytes of {name} tokens, "
                            f"but {binp} has {bin_size} bytes; fix: this .idx does not belong to that .bin "
                            f"(or one of them is truncated): {remake}")
        self.dtype = name
        self.num_tokens = total
        self.num_documents = m - 1
        self.num_sequences = n
        self._document_indices = docs
        self._sequence_lengths = lengths
        if bin_size == 0:
            self._stream = np.zeros(0, dtype=dt)
        elif contiguous:
            self._stream = np.memmap(binp, dtype=dt, mode="r", shape=(total,))
        else:
            # Sequences out of byte order or with gaps: read each one where its pointer says.
            self._bin = np.memmap(binp, dtype=dt, mode="r", shape=(bin_size // isz,))
            self._pointers = pointers // isz
            starts = np.zeros(n + 1, dtype=np.int64)
            np.cumsum(lengths, out=starts[1:])
            self._starts = starts

    # -- reading --------------------------------------------------------------------------------

    def read(self, start: int, count: int) -> np.ndarray:
        """The stream's tokens [start, start+count) as stored (not converted, not checked)."""
        if start < 0 or count < 0 or start + count > self.num_tokens:
            raise IndexError(f"tokens [{start}, {start + count}) outside [0, {self.num_tokens})")
        if self._closed:
            raise DataError(f"--data {self.bin_path}: read after close()")
        if self._stream is not None:
            return self._stream[start:start + count]
        out = np.empty(count, dtype=self._bin.dtype)
        starts, ptrs = self._starts, self._pointers
        k = int(np.searchsorted(starts, start, side="right")) - 1
        pos, end = start, start + count
        while pos < end:
            seq_end = int(starts[k + 1])
            take = min(end, seq_end) - pos
            if take > 0:
                off = int(ptrs[k]) + (pos - int(starts[k]))
                out[pos - start:pos - start + take] = self._bin[off:off + take]
                pos += take
            k += 1
        return out

    def tokens(self, start: int, count: int, seq_len: Optional[int] = None) -> np.ndarray:
        """The stream's tokens [start, start+count) as int64, checked against the vocab (a bad id's
        sample is named when `seq_len` is given: the first sample holding its position)."""
        a = self.read(start, count).astype(np.int64)
        last = max(self.num_samples(seq_len) - 1, 0) if seq_len else 0
        self.check_ids(a, lambda j: (start + j, min((start + j) // seq_len, last) if seq_len else None))
        return a

    def document(self, k: int) -> np.ndarray:
        """Document k's tokens (int64) for an indexed dataset."""
        if self._document_indices is None:
            raise DataError(f"--data {self.bin_path}: a flat token file has no documents")
        if not 0 <= k < self.num_documents:
            raise IndexError(f"document {k} outside [0, {self.num_documents})")
        s0, s1 = int(self._document_indices[k]), int(self._document_indices[k + 1])
        starts = self._sequence_starts()
        return self.read(int(starts[s0]), int(starts[s1] - starts[s0])).astype(np.int64)

    def _sequence_starts(self) -> np.ndarray:
        """Stream position of every sequence, and the end (n + 1 entries)."""
        if self._starts is None:
            starts = np.zeros(self.num_sequences + 1, dtype=np.int64)
            np.cumsum(self._sequence_lengths, out=starts[1:])
            self._starts = starts
        return self._starts

    def num_samples(self, seq_len: int) -> int:
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
            raise DataError(f"model.seq_len: expected a positive integer, got {seq_len!r}")
        return (self.num_tokens - 1) // seq_len

    def sample(self, i: int, seq_len: int) -> np.ndarray:
        """Sample i: int64 tokens [i*seq_len, i*seq_len + seq_len + 1), checked against the vocab."""
        n = self.num_samples(seq_len)
        if not 0 <= i < n:
            raise IndexError(f"sample {i} outside [0, {n}) for seq_len {seq_len}")
        out = self.read(i * seq_len, seq_len + 1).astype(np.int64)
        self.check_ids(out, lambda j: (i * seq_len + j, i))
        return out

    def fill(self, out: np.ndarray, ids: Sequence[int], seq_len: int) -> None:
        """Rows of `out` (int64 [len(ids), seq_len+1]) <- samples `ids`, then one vocab check."""
        for r, i in enumerate(ids):
            out[r] = self.read(int(i) * seq_len, seq_len + 1)
        row = seq_len + 1
        self.check_ids(out, lambda j: (int(ids[j // row]) * seq_len + j % row, int(ids[j // row])))

    def check_ids(self, a: np.ndarray, where) -> None:
        """Refuse a token id >= vocab (or negative); `where(flat index) -> (token position, sample)`."""
        if a.size == 0:
            return
        too_big = self.vocab is not None and int(a.max()) >= self.vocab
        negative = self._signed and int(a.min()) < 0
        if not (too_big or negative):
            return
        flat = a.reshape(-1)
        bad = (flat < 0) if self.vocab is None else ((flat < 0) | (flat >= self.vocab))
        j = int(np.flatnonzero(bad)[0])
        pos, sample = where(j)
        v = int(flat[j])
        at = f"token {pos}" + (f" (sample {sample})" if sample is not None else "")
        hint = " (or --data-dtype uint32/uint16 if the file's dtype is not " + self.dtype + ")" if self.format == "flat" else ""
        if v < 0:
            raise DataError(f"--data {self.bin_path}: {at} has the negative token id {v}; "
                            f"fix: the dataset is corrupt, re-create it{hint}")
        raise DataError(f"--data {self.bin_path}: {at} has the token id {v}, but the model's vocab is "
                        f"{self.vocab} (ids 0..{self.vocab - 1}); fix: tokenize with the model's tokenizer or "
                        f"raise model.vocab{hint}")

    def close(self) -> None:
        """Drop the maps (numpy unmaps each once no array read from it is left)."""
        self._stream = self._bin = self._idx_map = None
        self._document_indices = self._sequence_lengths = self._pointers = self._starts = None
        self._closed = True

    def __repr__(self) -> str:
        return (f"TokenData({self.path!r}, format={self.format}, dtype={self.dtype}, tokens={self.num_tokens}, "
                f"documents={self.num_documents})")


def open_tokens(path: str, dtype: Optional[str] = None, vocab: Optional[int] = None) -> TokenData:
    """Open `--data PATH` (see `resolve`); `dtype` is `--data-dtype`, a flat file's dtype (uint16,
    the default, or uint32; an indexed dataset's .idx names its own and `dtype` does not apply);
    `vocab` makes every read refuse token ids >= it."""
    return TokenData(path, dtype=dtype, vocab=vocab)
