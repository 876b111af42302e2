"""Tokenized datasets: Megatron's indexed format and flat token files, the training order,
prefetching, `python -m motley_torch.data prepare|inspect`, and every refusal."""

import glob
import json
import os
import struct
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch

from motley_torch.components.data import (DataError, TrainBatches, epoch_permutation, eval_tokens, main as data_main,
                               open_tokens)
from motley_torch.spec import PlanError

tokenizers = pytest.importorskip("tokenizers")

PY = sys.executable
ENV = dict(os.environ, OMP_NUM_THREADS="1", RAYON_NUM_THREADS="2")
PKG = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV["PYTHONPATH"] = PKG + os.pathsep + ENV.get("PYTHONPATH", "")

MEGATRON_CODES = {"uint8": 1, "int8": 2, "int16": 3, "int32": 4, "int64": 5, "float64": 6, "float32": 7, "uint16": 8}


def megatron_write(prefix, documents, dtype="int32", modes=False):
    """A dataset written as Megatron's IndexedDatasetBuilder.add_document + finalize does:
    `documents` is a list of documents, each a list of sequences (lists of token ids)."""
    dt = np.dtype(dtype)
    lengths, doc_idx = [], [0]
    with open(prefix + ".bin", "wb") as f:
        for doc in documents:
            for seq in doc:
                f.write(np.array(seq, dtype=dt).tobytes(order="C"))
                lengths.append(len(seq))
            doc_idx.append(len(lengths))
    pointers, p = [], 0
    for n in lengths:
        pointers.append(p)
        p += n * dt.itemsize
    with open(prefix + ".idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00")
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<B", MEGATRON_CODES[dt.name]))
        f.write(struct.pack("<Q", len(lengths)))
        f.write(struct.pack("<Q", len(doc_idx)))
        f.write(np.array(lengths, dtype=np.int32).tobytes(order="C"))
        f.write(np.array(pointers, dtype=np.int64).tobytes(order="C"))
        f.write(np.array(doc_idx, dtype=np.int64).tobytes(order="C"))
        if modes:
            f.write(np.zeros(len(lengths), dtype=np.int8).tobytes(order="C"))
    return prefix


def read_idx(path):
    """The .idx parsed with struct alone (no motley code)."""
    with open(path, "rb") as f:
        b = f.read()
    assert b[:9] == b"MMIDIDX\x00\x00"
    (version,), (code,) = struct.unpack_from("<Q", b, 9), struct.unpack_from("<B", b, 17)
    n, m = struct.unpack_from("<QQ", b, 18)
    off = 34
    lengths = np.frombuffer(b, "<i4", n, off)
    pointers = np.frombuffer(b, "<i8", n, off + 4 * n)
    docs = np.frombuffer(b, "<i8", m, off + 12 * n)
    assert len(b) == off + 12 * n + 8 * m
    return version, code, lengths, pointers, docs


def refused(fn, *parts):
    with pytest.raises(DataError) as e:
        fn()
    msg = str(e.value)
    assert "\n" not in msg, msg
    for p in parts:
        assert p in msg, f"{p!r} not in {msg!r}"
    return msg


# ---------------------------------------------------------------------------------------------
# A tokenizer trained here, on text every Debian machine has
# ---------------------------------------------------------------------------------------------


def corpus():
    import pydoc_data.topics

    texts = []
    for p in sorted(glob.glob("/usr/share/common-licenses/*")):
        if os.path.isfile(p):
            with open(p, encoding="utf-8", errors="replace") as f:
                texts.append(f.read())
    texts += [pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics)]
    return texts


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    d = tmp_path_factory.mktemp("tok")
    texts = corpus()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=800, special_tokens=["<|endoftext|>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(d / "tokenizer.json"))
    # inputs: a JSON Lines file (one pydoc topic a line, a blank line among them) and two text files
    import pydoc_data.topics

    topics = [pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics)][:40]
    with open(d / "topics.jsonl", "w", encoding="utf-8") as f:
        for i, t in enumerate(topics):
            f.write(json.dumps({"id": i, "text": t}) + "\n")
            if i == 5:
                f.write("\n")
    lic = sorted(p for p in glob.glob("/usr/share/common-licenses/*") if os.path.isfile(p))[:2]
    docs = topics + [open(p, encoding="utf-8").read() for p in lic]
    return d, [str(d / "topics.jsonl")] + lic, docs


def run_data(*args):
    return subprocess.run([PY, "-m", "motley_torch.data", *args], env=ENV, capture_output=True, text=True, timeout=120)


def test_prepare_roundtrip_inspect_and_samples(tok_dir, tmp_path):
    from tokenizers import Tokenizer

    d, inputs, docs = tok_dir
    prefix = str(tmp_path / "ds")
    r = run_data("prepare", "--tokenizer", str(d / "tokenizer.json"), "--input", *inputs, "--output", prefix,
                 "--workers", "2")
    assert r.returncode == 0, r.stderr
    assert "prepare:" in r.stderr and "MB/s" in r.stderr and "documents" in r.stderr
    assert "42 documents" in r.stdout
    assert sorted(os.listdir(tmp_path)) == ["ds.bin", "ds.idx"]  # no temporary left

    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    eos = tok.token_to_id("<|endoftext|>")
    want = [tok.encode(t).ids + [eos] for t in docs]
    # the files themselves, parsed with struct: Megatron's layout, one sequence per document
    version, code, lengths, pointers, doc_idx = read_idx(prefix + ".idx")
    assert (version, code) == (1, 8)  # uint16
    assert list(doc_idx) == list(range(len(docs) + 1))
    assert list(lengths) == [len(w) for w in want]
    stream = np.fromfile(prefix + ".bin", dtype="<u2")
    for k, w in enumerate(want):
        assert list(stream[pointers[k] // 2:pointers[k] // 2 + lengths[k]]) == w
        assert tok.decode(w[:-1]) == docs[k]
    # the reader
    ds = open_tokens(prefix, vocab=tok.get_vocab_size())
    assert (ds.format, ds.dtype, ds.num_documents, ds.num_tokens) == ("indexed", "uint16", len(docs), stream.size)
    for k in (0, 6, len(docs) - 1):
        assert list(ds.document(k)) == want[k]
    flat = np.concatenate([np.array(w) for w in want])
    S = 64
    assert ds.num_samples(S) == (flat.size - 1) // S
    for i in (0, 1, 17, ds.num_samples(S) - 1):
        s = ds.sample(i, S)
        assert s.dtype == np.int64 and s.shape == (S + 1,)
        assert np.array_equal(s, flat[i * S:i * S + S + 1])
    # PREFIX.bin and PREFIX.idx name the same dataset
    for p in (prefix + ".bin", prefix + ".idx"):
        assert open_tokens(p).num_tokens == ds.num_tokens

    r = run_data("inspect", prefix, "-o", "json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == {"documents": len(docs), "tokens": int(flat.size), "dtype": "uint16",
                                    "format": "indexed"}
    r = run_data("inspect", prefix + ".bin")
    assert r.returncode == 0 and f"{len(docs)} documents" in r.stdout and f"{flat.size} tokens" in r.stdout


def test_prepare_refusals(tok_dir, tmp_path, capsys):
    from tokenizers import Tokenizer, models

    d, inputs, _ = tok_dir
    tokjs = str(d / "tokenizer.json")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"body": "no text"}) + "\n")
    prefix = str(tmp_path / "out")
    # the exit status and the one line, from a real process
    r = run_data("prepare", "--tokenizer", tokjs, "--input", str(bad), "--output", prefix)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and f"{bad}:2" in lines[0] and '"text"' in lines[0] and "--text-field" in lines[0], r.stderr
    assert os.listdir(tmp_path) == ["bad.jsonl"]  # nothing half-written left behind

    def refuses(argv, *parts):
        assert data_main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1, err
        for p in parts:
            assert p in err[0], err[0]

    refuses(["prepare", "--tokenizer", tokjs, "--input", str(bad), "--output", prefix, "--text-field", "body"],
            f"{bad}:1", '"body"')
    (tmp_path / "arr.jsonl").write_text('["a list"]\n')
    refuses(["prepare", "--tokenizer", tokjs, "--input", str(tmp_path / "arr.jsonl"), "--output", prefix],
            "arr.jsonl:1", "not an object")
    (tmp_path / "broken.jsonl").write_text('{"text": "a"\n')
    refuses(["prepare", "--tokenizer", tokjs, "--input", str(tmp_path / "broken.jsonl"), "--output", prefix],
            "broken.jsonl:1", "JSON")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    refuses(["prepare", "--tokenizer", tokjs, "--input", str(tmp_path / "latin1.txt"), "--output", prefix],
            "latin1.txt", "UTF-8")
    refuses(["prepare", "--tokenizer", tokjs, "--input", inputs[1], "--output", prefix, "--eos-token", "<nope>"],
            "--eos-token", "<nope>")
    refuses(["prepare", "--tokenizer", tokjs, "--input", str(tmp_path / "missing.txt"), "--output", prefix],
            "--input", "missing.txt")
    refuses(["prepare", "--tokenizer", inputs[1], "--input", inputs[1], "--output", prefix], "--tokenizer")
    # a tokenizer with none of the usual end-of-document tokens
    plain = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    plain.save(str(tmp_path / "plain.json"))
    refuses(["prepare", "--tokenizer", str(tmp_path / "plain.json"), "--input", inputs[1], "--output", prefix],
            "--eos-token", "</s>")
    assert not os.path.exists(prefix + ".bin") and not os.path.exists(prefix + ".idx")
    assert not [p for p in os.listdir(tmp_path) if ".tmp" in p]


# ---------------------------------------------------------------------------------------------
# Formats
# ---------------------------------------------------------------------------------------------


def test_megatron_written_dataset(tmp_path):
    docs = [[[5, 6, 7], [8, 9]], [[10]], [[11, 12, 13, 14], [], [15]]]
    p = megatron_write(str(tmp_path / "mg"), docs, dtype="int32")
    ds = open_tokens(p)
    assert (ds.format, ds.dtype, ds.num_documents, ds.num_sequences, ds.num_tokens) == ("indexed", "int32", 3, 6, 11)
    assert list(ds.document(0)) == [5, 6, 7, 8, 9] and list(ds.document(1)) == [10]
    assert list(ds.document(2)) == [11, 12, 13, 14, 15]
    stream = list(range(5, 16))
    for S in (1, 2, 3, 10):
        assert ds.num_samples(S) == (11 - 1) // S
        for i in range(ds.num_samples(S)):
            assert list(ds.sample(i, S)) == stream[i * S:i * S + S + 1]
    with pytest.raises(IndexError):
        ds.sample(ds.num_samples(3), 3)
    # uint16 and the other integer codes read the same
    for dt in ("uint16", "uint8", "int64"):
        q = megatron_write(str(tmp_path / dt), docs, dtype=dt)
        o = open_tokens(q)
        assert o.dtype == dt and list(o.sample(1, 4)) == stream[4:9]


def test_pointers_out_of_order_follow_the_index(tmp_path):
    # sequence 0 stored after sequence 1 in the .bin: the stream is in index order
    prefix = str(tmp_path / "ooo")
    np.array([3, 4, 1, 2], dtype="<u2").tofile(prefix + ".bin")
    with open(prefix + ".idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, 8, 2, 3))
        f.write(np.array([2, 2], "<i4").tobytes() + np.array([4, 0], "<i8").tobytes() + np.array([0, 1, 2], "<i8").tobytes())
    ds = open_tokens(prefix)
    assert ds.num_tokens == 4 and list(ds.read(0, 4)) == [1, 2, 3, 4]
    assert list(ds.sample(0, 2)) == [1, 2, 3] and list(ds.sample(1, 1)) == [2, 3]


def test_flat_files(tmp_path):
    a = np.arange(1000, dtype="<u2") * 7 % 60000
    a.tofile(tmp_path / "f16.bin")
    ds = open_tokens(str(tmp_path / "f16.bin"))
    assert (ds.format, ds.dtype, ds.num_tokens, ds.num_documents) == ("flat", "uint16", 1000, None)
    assert np.array_equal(ds.sample(3, 100), a[300:401].astype(np.int64))
    b = (np.arange(1000, dtype=np.int64) * 1000 + 70000).astype("<u4")
    b.tofile(tmp_path / "f32.bin")
    ds = open_tokens(str(tmp_path / "f32.bin"), dtype="uint32", vocab=2_000_000)
    assert (ds.dtype, ds.num_tokens) == ("uint32", 1000)
    assert np.array_equal(ds.sample(9, 99), b[891:991].astype(np.int64))
    assert eval_tokens(ds, 99, 2).tolist() == [b[0:100].tolist(), b[99:199].tolist()]
    r = run_data("inspect", str(tmp_path / "f32.bin"), "--data-dtype", "uint32", "-o", "json")
    assert json.loads(r.stdout) == {"documents": None, "tokens": 1000, "dtype": "uint32", "format": "flat"}


def test_refusals(tmp_path):
    good = megatron_write(str(tmp_path / "good"), [[[1, 2, 3]], [[4, 5]]], dtype="uint16")
    # a .idx that does not match its .bin names both files
    megatron_write(str(tmp_path / "short"), [[[1, 2, 3]], [[4, 5]]], dtype="uint16")
    with open(tmp_path / "short.bin", "r+b") as f:
        f.truncate(6)
    refused(lambda: open_tokens(str(tmp_path / "short")), "short.idx", "short.bin", "does not belong")
    megatron_write(str(tmp_path / "long"), [[[1, 2, 3]], [[4, 5]]], dtype="uint16")
    with open(tmp_path / "long.bin", "ab") as f:
        f.write(b"\x00\x00")
    refused(lambda: open_tokens(str(tmp_path / "long")), "long.idx", "long.bin", "does not belong")
    # header fields
    raw = open(good + ".idx", "rb").read()
    for name, blob, parts in [
        ("magic", b"NOTANIDX\x00" + raw[9:], ("magic", "MMIDIDX")),
        ("version", raw[:9] + struct.pack("<Q", 2) + raw[17:], ("version 2",)),
        ("code", raw[:17] + b"\x09" + raw[18:], ("dtype code 9",)),
        ("float", raw[:17] + b"\x07" + raw[18:], ("float32",)),
        ("trunc", raw[:-8], ("bytes", "needs")),
        ("header", raw[:20], ("header truncated",)),
    ]:
        (tmp_path / f"{name}.bin").write_bytes(open(good + ".bin", "rb").read())
        (tmp_path / f"{name}.idx").write_bytes(blob)
        refused(lambda: open_tokens(str(tmp_path / name)), f"{name}.idx", *parts)
    megatron_write(str(tmp_path / "mm"), [[[1, 2]]], modes=True)
    refused(lambda: open_tokens(str(tmp_path / "mm")), "mm.idx", "multimodal")
    # paths
    (tmp_path / "odd.bin").write_bytes(b"\x01\x00\x02")
    refused(lambda: open_tokens(str(tmp_path / "odd.bin")), "odd.bin", "3 bytes", "uint16")
    refused(lambda: open_tokens(str(tmp_path / "odd")), "odd.idx is missing", "odd.bin")
    refused(lambda: open_tokens(str(tmp_path / "nothing")), "--data", "nothing")
    (tmp_path / "lonely.idx").write_bytes(raw)
    refused(lambda: open_tokens(str(tmp_path / "lonely.idx")), "lonely.bin is missing")
    refused(lambda: open_tokens(good, dtype="int32"), "--data-dtype", "uint16 or uint32")
    (tmp_path / "one.bin").write_bytes(b"\x01\x00")
    refused(lambda: open_tokens(str(tmp_path / "one.bin")), "one.bin", "1 token")
    # a token id >= vocab: names the file, the position, the id and the vocab
    ds = open_tokens(good, vocab=5)
    refused(lambda: ds.sample(1, 2), "good.bin", "token 4", "(sample 1)", "id 5", "vocab is 5")
    assert list(ds.sample(0, 2)) == [1, 2, 3]
    refused(lambda: eval_tokens(ds, 2, 2), "good.bin", "token 4 (sample 1)", "id 5")
    neg = megatron_write(str(tmp_path / "neg"), [[[1, 2, -3, 4]]], dtype="int32")
    refused(lambda: open_tokens(neg).sample(0, 3), "neg.bin", "token 2 (sample 0)", "negative token id -3")
    # too many evaluation samples
    ds = open_tokens(good)
    refused(lambda: eval_tokens(ds, 2, 3), "--eval-samples", "3", "2 samples", "good.bin")
    refused(lambda: eval_tokens(ds, 2, 0), "--eval-samples")
    refused(lambda: TrainBatches(ds, 5, 1, 0), "good.bin", "seq_len 5")
    assert issubclass(DataError, PlanError)
    # the CLI: one line, exit 2
    r = run_data("inspect", str(tmp_path / "magic"))
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "magic.idx" in r.stderr


# ---------------------------------------------------------------------------------------------
# The training order
# ---------------------------------------------------------------------------------------------


def counting_dataset(tmp_path, n_samples, S, dtype="<u2"):
    """A flat file whose sample i starts with token i (stream[k] = k // S), so rows name their sample."""
    stream = (np.arange(n_samples * S + 1) // S).astype(dtype)
    path = str(tmp_path / f"count{n_samples}.bin")
    stream.tofile(path)
    return path


def test_epochs_are_permutations_and_batches_match_ids(tmp_path):
    S, n, gb = 4, 37, 8
    ds = open_tokens(counting_dataset(tmp_path, n, S))
    b = TrainBatches(ds, S, gb, seed=3)
    ids = []
    for _ in range(3 * n // gb + 1):
        t, i = b.next()
        assert t.dtype == torch.int64 and t.shape == (gb, S + 1)
        assert t[:, 0].tolist() == i  # row r is sample ids[r]
        for row, sid in zip(t.tolist(), i):
            assert row == ds.sample(sid, S).tolist()
        ids += i
        assert b.samples_consumed == len(ids) and b.last_wait_s >= 0.0
    b.close()
    for e in range(3):
        assert sorted(ids[e * n:(e + 1) * n]) == list(range(n))
        assert ids[e * n:(e + 1) * n] == epoch_permutation(3, e, n).tolist()
    assert ids[:n] != ids[n:2 * n] and ids[:n] != list(range(n))
    # another seed, another order; the same seed, the same order
    assert epoch_permutation(4, 0, n).tolist() != ids[:n]
    with TrainBatches(open_tokens(counting_dataset(tmp_path, n, S)), S, gb, seed=3) as again:
        assert [again.next()[1] for _ in range(3)] == [ids[0:8], ids[8:16], ids[16:24]]


def test_resume_continues_exactly_and_prefetch_is_invisible(tmp_path):
    S, n, gb = 3, 23, 5
    path = counting_dataset(tmp_path, n, S)
    run_a = TrainBatches(open_tokens(path), S, gb, seed=11)
    a = [run_a.next() for _ in range(10)]
    run_a.close()
    first = TrainBatches(open_tokens(path), S, gb, seed=11)
    b = [first.next() for _ in range(5)]
    pos = first.samples_consumed
    first.close()
    assert pos == 25
    second = TrainBatches(open_tokens(path), S, gb, seed=11, samples_consumed=pos)
    b += [second.next() for _ in range(5)]
    second.close()
    assert [x[1] for x in a] == [x[1] for x in b]
    assert all(torch.equal(x[0], y[0]) for x, y in zip(a, b))
    sync = TrainBatches(open_tokens(path), S, gb, seed=11, prefetch=False)
    c = [sync.next() for _ in range(10)]
    assert [x[1] for x in a] == [x[1] for x in c]
    assert all(torch.equal(x[0], y[0]) for x, y in zip(a, c))
    # the next batch is read in another thread
    seen = []
    ds = open_tokens(path)
    orig = ds.fill
    ds.fill = lambda *args: (seen.append(threading.current_thread().name), orig(*args))[1]
    with TrainBatches(ds, S, gb, seed=11) as pre:
        pre.next()
        pre.next()
    assert seen and all(name.startswith("motley-data") for name in seen)


def test_errors_in_the_prefetch_thread_surface_in_next(tmp_path):
    S, n, gb = 2, 12, 4
    stream = (np.arange(n * S + 1) // S).astype("<u2")
    stream[7 * S + 1] = 999  # inside sample 7
    path = str(tmp_path / "poison.bin")
    stream.tofile(path)
    for prefetch in (True, False):
        b = TrainBatches(open_tokens(path, vocab=100), S, gb, seed=0, prefetch=prefetch)
        order = b.sample_ids(0, n)
        bad_batch = order.index(7) // gb
        for _ in range(bad_batch):
            b.next()
        refused(b.next, "poison.bin", "sample 7", f"token {7 * S + 1}", "999", "vocab is 100", "--data-dtype")
        assert b.samples_consumed == bad_batch * gb  # the failed batch was not handed out
        refused(b.next, "sample 7")  # asked again, refused again
        b.close()
    # bad arguments
    ds = open_tokens(path)
    refused(lambda: TrainBatches(ds, S, 0, 0), "global_batch")
    refused(lambda: TrainBatches(ds, S, 2, -1), "--seed")
    refused(lambda: TrainBatches(ds, S, 2, 0, samples_consumed=-2), "samples_consumed")


# ---------------------------------------------------------------------------------------------
# prepare streams: peak memory does not grow with the input
# ---------------------------------------------------------------------------------------------

MEM_CHILD = r"""
import json, random, sys
from tokenizers import Tokenizer
from motley_torch.components.prepare import prepare
tok, out, mb = sys.argv[1], sys.argv[2], float(sys.argv[3])
words = sorted(w[1:] for w in Tokenizer.from_file(tok).get_vocab() if w.startswith("\u0120") and w[1:].isalpha())[:200]
rng = random.Random(0)
size = 0
with open(out + ".jsonl", "w") as f:
    while size < mb * 2**20:
        line = json.dumps({"text": " ".join(rng.choices(words, k=3000))}) + "\n"
        f.write(line)
        size += len(line)
def hwm_kb():  # this process's peak RSS (ru_maxrss would count the forked pytest's)
    with open("/proc/self/status") as f:
        return int(next(l for l in f if l.startswith("VmHWM:")).split()[1])
rss0 = hwm_kb()
r = prepare(tok, [out + ".jsonl"], out, chunk_bytes=256 * 1024, progress=None, summary=None)
print(json.dumps({"bytes": size, "tokens": r["tokens"], "rss0_kb": rss0, "peak_kb": hwm_kb()}))
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs Linux's /proc/self/status (VmHWM)")
def test_prepare_memory_stays_flat(tok_dir, tmp_path):
    d, _, _ = tok_dir
    res = {}
    for mb in (0.5, 12):
        r = subprocess.run([PY, "-c", MEM_CHILD, str(d / "tokenizer.json"), str(tmp_path / f"m{mb}"), str(mb)],
                           env=ENV, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        res[mb] = json.loads(r.stdout)
        # every token is there
        assert open_tokens(str(tmp_path / f"m{mb}")).num_tokens == res[mb]["tokens"]
    grew_kb = res[12]["peak_kb"] - res[0.5]["peak_kb"]
    # reading it whole would hold the text (12 MB) and its encodings (~100 bytes a token) at once
    print(f"peak RSS {res[0.5]['peak_kb']} kB for 0.5 MB of text, {res[12]['peak_kb']} kB for 12 MB")
    assert grew_kb * 1024 < res[12]["bytes"] / 2, res
