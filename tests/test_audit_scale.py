"""The data path at real scale (English Wikipedia + BookCorpus: ~3.5 billion tokens, ~150M sentences, 100M+
samples), tested without such a corpus: what grew with the corpus (a document without blank lines held whole, the
per-process copies of the store's offsets and blocks, the loader's epoch order and its list of micro-batches), and
the arithmetic past 2**31 and 2**32 tokens on sparse shards of that size."""
from __future__ import annotations

import fcntl
import json
import logging
import os
import types
from pathlib import Path

import numpy as np
import pytest

from bertrain.data import readers, samples, store as store_mod
from bertrain.data.prepare import _store_meta, prepare
from bertrain.data.pretraining import PretrainingDataset, PretrainingLoader
from bertrain.data.readers import CorpusConfig, SkipReport, iter_raw_documents
from bertrain.data.samples import InstanceBuilder, SampleConfig
from bertrain.data.sampler import RankSampler, epoch_permutation
from bertrain.data.store import HEADER_SIZE, MAGIC, VERSION, TokenStore, _HEADER, _pad8
from bertrain.data.tokenizer import read_vocab
from helpers import TINY_VOCAB, prepare_config


# ----------------------------------------------------------------------------------------------- documents

def _lines_without_blank_lines(path: Path, n_lines: int) -> str:
    text = "".join(f"Sentence number {i} of a book written one sentence per line.\n" for i in range(n_lines))
    path.write_text(text, encoding="utf-8")
    return text


def test_a_file_without_blank_lines_is_cut_into_bounded_documents(tmp_path, monkeypatch, caplog):
    """A BookCorpus-style file without blank lines was one document: held whole by the reader, then cleaned and
    tokenized by one worker (100 MB of text: 4 GB in that worker, 0.9 GB in the main process)."""
    cap = 1 << 18
    monkeypatch.setattr(readers, "MAX_DOCUMENT_CHARS", cap, raising=False)
    text = _lines_without_blank_lines(tmp_path / "books.txt", 60_000)  # ~3.7 MB: blocks of 1 MiB
    for fmt in ("text", "lines"):
        report = SkipReport()
        with caplog.at_level(logging.WARNING):
            docs = list(iter_raw_documents([str(tmp_path / "books.txt")], CorpusConfig(input_format=fmt), report))
        assert len(docs) >= 3
        assert "".join(d.text for d in docs) == text  # cut at line ends, nothing lost
        assert all(d.text.endswith("\n") for d in docs[:-1])
        assert max(len(d.text) for d in docs) <= cap + (1 << 20)  # the cap plus at most one block of lines
        assert report.totals()["long_document_cuts"] == sum(len(d.text) >= cap for d in docs)  # ended by the cap
        assert "without a blank line" in caplog.text


def test_documents_under_the_cap_are_read_as_before(tmp_path):
    text = "First document line one.\nline two.\n\n\nSecond document.\n  \nThird\n"
    (tmp_path / "a.txt").write_text(text, encoding="utf-8")
    report = SkipReport()
    docs = list(iter_raw_documents([str(tmp_path / "a.txt")], CorpusConfig(), report))
    assert [d.text for d in docs] == ["First document line one.\nline two.\n", "Second document.\n", "Third\n"]
    assert "long_document_cuts" not in report.totals()


def test_prepare_of_a_file_without_blank_lines_spreads_it_over_documents(tmp_path, monkeypatch):
    monkeypatch.setattr(readers, "MAX_DOCUMENT_CHARS", 1 << 18, raising=False)
    _lines_without_blank_lines(tmp_path / "books.txt", 40_000)
    stats = prepare(prepare_config(tmp_path / "out", inputs=[str(tmp_path / "books.txt")], masking="none",
                                   heldout_fraction=0, shard_tokens=1 << 20, chunk_bytes=1 << 18))
    assert stats["num_documents"] >= 3  # (was 1: one worker, and no random-next segment from another document)
    assert stats["skipped"]["totals"]["long_document_cuts"] >= stats["num_documents"] - 1


# ----------------------------------------------------------------------------------------------- epoch order

def test_the_epoch_order_is_the_same_in_half_the_memory():
    for n in (0, 1, 7, 1000, 65_537):
        for epoch in (0, 3):
            order = epoch_permutation(n, 12345, epoch)
            np.testing.assert_array_equal(order, np.random.default_rng([12345, epoch, 0x10AD]).permutation(n))
            assert order.dtype == np.uint32  # (was int64: 8 bytes per sample on every rank, every epoch)
    from bertrain.data.sampler import order_dtype
    assert order_dtype(1 << 32) == np.uint32 and order_dtype((1 << 32) + 1) == np.int64


def test_rank_partition_unchanged_with_the_smaller_order():
    """Positions [(m*W + r)*b, ...) of the same order, wrap-around included (drop_last=False)."""
    n, b, w = 1003, 4, 3
    ref = np.random.default_rng([7, 2, 0x10AD]).permutation(n)
    for drop_last in (True, False):
        sampler = RankSampler(n, b, 1, w, seed=7, drop_last=drop_last)
        got = np.concatenate(list(sampler.iter_epoch(2)))
        need = len(sampler) * b * w
        want = ref[np.arange(need) % n].reshape(-1, w, b)[:, 1].ravel()
        np.testing.assert_array_equal(got, want)


@pytest.fixture(scope="module")
def small_store(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("scale") / "prepared"
    prepare(prepare_config(out, masking="none", heldout_fraction=0))
    return out


def test_loader_workers_take_the_epochs_micro_batches_lazily(small_store):
    """With DataLoader workers the loader handed DataLoader list(items): every micro-batch of the rest of the epoch
    made up front at each epoch's start (1.25M items, ~0.5 GB and seconds for 40M samples at micro-batch 32)."""
    ds = PretrainingDataset(small_store, SampleConfig(max_seq_length=64, max_predictions_per_seq=8), verify=False)
    loader = PretrainingLoader(ds, micro_batch_size=2, num_workers=1, prefetch_factor=2)
    taken = []

    def items():
        for m, ids in enumerate(loader.sampler.iter_epoch(0)):
            taken.append(m)
            yield 0, ids

    it = loader.batches(items())
    batch = next(it)
    assert batch["input_ids"].shape == (2, 64)
    del it
    assert len(loader) > 50
    assert len(taken) <= 10, f"{len(taken)} of {len(loader)} micro-batches taken for the first one"


# ----------------------------------------------------------------------------------------------- shared offsets

def test_token_reads_grouped_by_shard_are_the_tokens(small_store):
    """tokens_at groups positions by shard with one counting sort (a mask per shard was O(positions x shards)):
    the same ids, any shape, in any order, empty included."""
    s = TokenStore(small_store, verify=False)
    assert len(s.shards) >= 3
    every = np.concatenate([np.asarray(sh.tokens) for sh in s.shards]).astype(np.int64)
    rng = np.random.default_rng(0)
    for shape in [(0,), (1,), (7, 33), (64, 128)]:
        idx = rng.integers(0, s.num_tokens, shape)
        np.testing.assert_array_equal(s.tokens_at(idx), every[idx])
        np.testing.assert_array_equal(s.tokens_at(idx, np.dtype(np.uint16)), every[idx].astype(np.uint16))


def test_offsets_and_blocks_are_memory_mapped_from_the_cache(small_store, monkeypatch):
    """Each process that opened a store (every rank, loader worker and prepare worker) held its own copy of the
    global sentence offsets (8 bytes per sentence) and the blocks (24 per block): ~2-3 GB per process for
    Wikipedia + BookCorpus. Past OFFSETS_CACHE_MIN they are memory-mapped, one copy in the page cache."""
    sample = SampleConfig(max_seq_length=64, max_predictions_per_seq=8)
    plain = TokenStore(small_store, verify=False)
    assert not isinstance(plain.sentence_starts, np.memmap)  # a small store: in memory, no file written
    rows_plain = InstanceBuilder(plain, sample, 5).build(1, np.arange(40))
    assert len(plain.shards) > 1
    monkeypatch.setattr(store_mod, "OFFSETS_CACHE_MIN", 1, raising=False)
    mapped = TokenStore(small_store, verify=False)
    for name in ("sentence_starts", "document_starts"):
        assert isinstance(getattr(mapped, name), np.memmap), name
        np.testing.assert_array_equal(getattr(mapped, name), getattr(plain, name))
    cached = sorted(p.name for p in (small_store / "cache").glob("*-starts-*.npy"))
    assert [c.split("-")[0] for c in cached] == ["document", "sentence"]
    mtimes = [p.stat().st_mtime_ns for p in (small_store / "cache").glob("*-starts-*.npy")]
    builder = InstanceBuilder(TokenStore(small_store, verify=False), sample, 5)  # a second process: reads them
    assert [p.stat().st_mtime_ns for p in (small_store / "cache").glob("*-starts-*.npy")] == mtimes
    assert isinstance(builder.blocks, np.memmap)
    np.testing.assert_array_equal(builder.build(1, np.arange(40)), rows_plain)


def test_a_damaged_or_unwritable_offsets_cache_falls_back(small_store, monkeypatch, caplog):
    monkeypatch.setattr(store_mod, "OFFSETS_CACHE_MIN", 1, raising=False)
    want = TokenStore(small_store, verify=False).sentence_starts.copy()
    path = next((small_store / "cache").glob("sentence-starts-*.npy"))
    arr = np.load(path)
    arr[len(arr) // 2 + 1] += 1  # one damaged entry inside a shard
    np.save(path, arr)
    with caplog.at_level(logging.WARNING):
        got = TokenStore(small_store, verify=False).sentence_starts
    np.testing.assert_array_equal(got, want)
    assert "rebuilding it" in caplog.text
    np.testing.assert_array_equal(np.load(path), want)  # rewritten

    def read_only(*_):
        raise PermissionError(13, "Permission denied")
    monkeypatch.setattr(store_mod, "save_npy_atomic", read_only, raising=False)
    for p in (small_store / "cache").glob("*-starts-*.npy"):
        p.unlink()
    with caplog.at_level(logging.WARNING):
        got = TokenStore(small_store, verify=False).sentence_starts
    np.testing.assert_array_equal(got, want)
    assert "cannot cache" in caplog.text


def test_one_process_builds_a_cache_while_the_others_wait(small_store, monkeypatch):
    """Ranks that start together each built the blocks (and offsets) at once: 8 x the build's memory at start-up.
    The build holds an exclusive lock on the cache folder; the others wait for it and map the file."""
    seen = []
    real = samples.build_blocks

    def build(store, sample, seed):
        fd = os.open(small_store / "cache", os.O_RDONLY)
        try:  # another process trying the lock now would have to wait
            with pytest.raises(BlockingIOError):
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(fd)
        seen.append(seed)
        return real(store, sample, seed)
    monkeypatch.setattr(samples, "build_blocks", build)
    store = TokenStore(small_store, verify=False)
    InstanceBuilder(store, SampleConfig(max_seq_length=48), 77)
    InstanceBuilder(store, SampleConfig(max_seq_length=48), 77)  # the second finds the file
    assert seen == [77]
    assert not [p for p in (small_store / "cache").iterdir() if p.name.endswith(".lock")]


@pytest.mark.parametrize("kind", ["nsp", "packed", "packed-sep"])
def test_blocks_built_in_slices_are_the_same_and_smaller(kind, monkeypatch):
    """build_blocks' temporaries over all sentences at once peaked at ~48 bytes per sentence (~10 GB for
    Wikipedia + BookCorpus); in slices the same blocks come out at ~10-26. (Packing without splitting sentences
    also walked a Python list of every sentence's end: ~40 more bytes per sentence.)"""
    import tracemalloc
    n = 1_000_000
    monkeypatch.setattr(samples, "_END_SLICE", 1 << 16, raising=False)
    rng = np.random.default_rng(1)
    ss = np.concatenate([[0], np.cumsum(rng.integers(1, 40, n))]).astype(np.int64)
    ds = np.unique(np.concatenate([[0], np.sort(rng.integers(1, n, n // 40)), [n]])).astype(np.int64)
    store = types.SimpleNamespace(sentence_starts=ss, document_starts=ds)
    sample = SampleConfig(next_sentence=kind == "nsp", split_sentences=False, document_separator=kind == "packed-sep")
    tracemalloc.start()
    try:
        blocks = samples.build_blocks(store, sample, 9)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    monkeypatch.setattr(samples, "_END_SLICE", 1 << 40, raising=False)  # everything in one slice: as before
    np.testing.assert_array_equal(samples.build_blocks(store, sample, 9), blocks)
    assert peak / n < 32, f"{peak / n:.0f} bytes per sentence at the peak"  # (was 48 nsp, 83 packed, 99 -sep)


# ----------------------------------------------------------------------------------------------- past 2**32 tokens

GIANT = (1 << 31) + 3  # tokens of one sparse sentence: two shards hold more than 2**32 tokens
SHORT, N_SHORT = 50, 10


def _pattern(positions: np.ndarray) -> np.ndarray:
    return (5 + positions % 97).astype(np.uint16)


def _write_sparse_shard(path: Path, base: int) -> dict:
    """A shard of two documents: one sparse sentence of GIANT tokens (ids 0), then N_SHORT sentences of SHORT
    tokens whose ids follow `_pattern` of their global position (`base`: the shard's first global token)."""
    n_tok = GIANT + SHORT * N_SHORT
    sent = np.concatenate([[0], GIANT + SHORT * np.arange(N_SHORT + 1)]).astype(np.int64)
    docs = np.array([0, 1, N_SHORT + 1], np.int64)
    crc = 0x1234  # not checked (verify=False): a CRC of 4 GB would take seconds
    head = _HEADER.pack(MAGIC, VERSION, 2, n_tok, len(sent) - 1, len(docs) - 1, crc)
    head += (__import__("zlib").crc32(head)).to_bytes(4, "little")
    with open(path, "wb") as f:
        f.write(head.ljust(HEADER_SIZE, b"\0"))
        tail = HEADER_SIZE + _pad8(2 * n_tok)
        f.truncate(tail)  # sparse: no disk used for the giant sentence
        os.pwrite(f.fileno(), _pattern(base + GIANT + np.arange(SHORT * N_SHORT)).tobytes(), HEADER_SIZE + 2 * GIANT)
        os.pwrite(f.fileno(), sent.tobytes() + docs.tobytes(), tail)
    return {"file": path.name, "n_tokens": n_tok, "n_sentences": len(sent) - 1, "n_documents": len(docs) - 1,
            "bytes": path.stat().st_size, "crc32": crc}


@pytest.fixture(scope="module")
def giant_store(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("giant") / "store"
    (d / "shards").mkdir(parents=True)
    per = GIANT + SHORT * N_SHORT
    try:
        entries = [_write_sparse_shard(d / "shards" / f"shard-{i:05d}.bts", i * per) for i in range(2)]
    except OSError as e:
        pytest.skip(f"cannot write 2 x 4 GB sparse files in {d}: {e}")
    meta = _store_meta(read_vocab(TINY_VOCAB), "test", True, entries)
    (d / "store.json").write_text(json.dumps(meta), encoding="utf-8")
    (d / "stats.json").write_text("{}", encoding="utf-8")
    return d


@pytest.mark.parametrize("mapped", [False, True], ids=["in-memory", "memory-mapped"])
def test_offsets_and_token_reads_past_2_to_the_32(giant_store, monkeypatch, mapped):
    monkeypatch.setattr(store_mod, "OFFSETS_CACHE_MIN", 1 if mapped else 1 << 40, raising=False)
    s = TokenStore(giant_store, verify=False)
    per = GIANT + SHORT * N_SHORT
    assert s.num_tokens == 2 * per > 1 << 32
    assert s.num_sentences == 2 * (N_SHORT + 1) and s.num_documents == 4
    assert s.sentence_starts.dtype == np.int64 and s.document_starts.dtype == np.int64
    assert int(s.sentence_starts[N_SHORT + 2]) == per + GIANT  # past 2**32
    np.testing.assert_array_equal(s.document_starts, [0, 1, N_SHORT + 1, N_SHORT + 2, 2 * (N_SHORT + 1)])
    pos = np.array([per + GIANT, 2 * per - 1, GIANT, per - 1], np.int64)  # shard 2 past 2**32, shard 1 past 2**31
    np.testing.assert_array_equal(s.tokens_at(pos), _pattern(pos))
    assert isinstance(s.sentence_starts, np.memmap) == mapped


def test_samples_past_2_to_the_32_read_the_right_tokens(giant_store):
    """Blocks, pairs and masks on a store of > 2**32 tokens: every unmasked token of every row is the one at its
    global position (an int32 wrap would read the zeros of the first giant sentence instead)."""
    sample = SampleConfig(max_seq_length=64, max_predictions_per_seq=8)
    s = TokenStore(giant_store, verify=False)
    builder = InstanceBuilder(s, sample, 3)
    short = np.flatnonzero(builder.blocks[:, 0] >= N_SHORT + 2)  # blocks of the second shard's short sentences
    assert len(short) >= 4
    rows = builder.build(0, short)
    T = sample.max_seq_length
    for row, b in zip(rows, short):
        total, a_len, nsp, n_pred = row[:4]
        ids = row[4: 4 + T]
        masked = set(row[4 + T: 4 + T + n_pred].tolist())
        assert int(s.sentence_starts[builder.blocks[b, 0]]) > 1 << 32
        a = np.array([i for i in range(1, a_len - 1) if i not in masked])  # A's unmasked grid positions
        assert len(a) >= 2 and np.all(np.isin(ids[a], np.arange(5, 102))), "read from the wrong place (zeros)"
        # A is consecutive positions of the store: the ids step through the pattern as the grid positions do
        np.testing.assert_array_equal((ids[a][1:] - ids[a][:-1]) % 97, (a[1:] - a[:-1]) % 97)
