"""The token store: sharded, memory-mapped token ids with sentence and document boundaries.

Layout of a prepared folder::

    DIR/store.json               index: format, version, tokenizer identity, shards with sizes and CRC32s, totals
    DIR/shards/shard-00000.bts   one shard (below)
    DIR/static-.../              materialised static instances (bertrain.data.samples)
    DIR/heldout/                 the held-out documents (never trained on): a token store of the same layout, its
                                 stats.json the record of the split (`heldout_status`; absent in older folders)
    DIR/stats.json               written last: its presence marks a complete folder

A shard file is a 64-byte header followed by three arrays, each starting at an 8-byte aligned offset::

    header   magic b"BRTSHRD1", version u32, token itemsize u32, n_tokens u64, n_sentences u64,
             n_documents u64, body crc32 u32, header crc32 u32 (over the 44 bytes before it), zero padding
    tokens   n_tokens ids (uint16 when the vocab has < 65536 entries, else uint32)
    sent     n_sentences + 1 int64: token offset of each sentence start (last = n_tokens)
    docs     n_documents + 1 int64: sentence index of each document start (last = n_sentences)

Shards are written to a temporary name, fsynced and renamed, so a shard that exists is complete; the header CRC
catches a damaged header at open and the body CRC (checked by `verify`) a damaged body.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from bertrain.utils.io import atomic_open, fsync_dir

logger = logging.getLogger(__name__)

MAGIC = b"BRTSHRD1"
VERSION = 1
HEADER_SIZE = 64
_HEADER = struct.Struct("<8sIIQQQI")  # magic, version, itemsize, n_tokens, n_sentences, n_documents, body crc
STORE_FORMAT = "bertrain-token-store"
STORE_VERSION = 1
HELDOUT_DIR = "heldout"


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size < 65536 else np.dtype(np.uint32)


def _pad8(n: int) -> int:
    return (n + 7) // 8 * 8


class ShardWriter:
    """Streams one shard to `path` (via a temporary file): `add` chunks of documents, then `close()` -> info."""

    def __init__(self, path: str | os.PathLike, dtype: np.dtype):
        self.path = Path(path)
        self.dtype = np.dtype(dtype)
        self.tmp = self.path.with_name(f".{self.path.name}.tmp")
        self.f = open(self.tmp, "wb")
        self.f.write(b"\0" * HEADER_SIZE)
        self.crc = 0
        self.n_tokens = 0
        self.sentence_lengths: list[np.ndarray] = []
        self.doc_sentence_counts: list[np.ndarray] = []

    def add(self, tokens: np.ndarray, sentence_lengths: np.ndarray, doc_sentence_counts: np.ndarray) -> None:
        """Append a chunk of documents: their concatenated ids, the length of each sentence, sentences per doc."""
        assert int(sentence_lengths.sum()) == len(tokens) and int(doc_sentence_counts.sum()) == len(sentence_lengths)
        data = np.ascontiguousarray(tokens, dtype=self.dtype).tobytes()
        self.f.write(data)
        self.crc = zlib.crc32(data, self.crc)
        self.n_tokens += len(tokens)
        self.sentence_lengths.append(np.asarray(sentence_lengths, dtype=np.int64))
        self.doc_sentence_counts.append(np.asarray(doc_sentence_counts, dtype=np.int64))

    def close(self) -> dict[str, Any]:
        """Finish the file (offsets, header), fsync and rename it into place; returns its index entry."""
        lens = np.concatenate(self.sentence_lengths) if self.sentence_lengths else np.zeros(0, np.int64)
        counts = np.concatenate(self.doc_sentence_counts) if self.doc_sentence_counts else np.zeros(0, np.int64)
        sent = np.zeros(len(lens) + 1, np.int64)
        np.cumsum(lens, out=sent[1:])
        docs = np.zeros(len(counts) + 1, np.int64)
        np.cumsum(counts, out=docs[1:])
        pad = _pad8(self.n_tokens * self.dtype.itemsize) - self.n_tokens * self.dtype.itemsize
        tail = b"\0" * pad + sent.tobytes() + docs.tobytes()
        self.f.write(tail)
        self.crc = zlib.crc32(tail, self.crc)
        head = _HEADER.pack(MAGIC, VERSION, self.dtype.itemsize, self.n_tokens, len(lens), len(counts), self.crc)
        head += struct.pack("<I", zlib.crc32(head))
        self.f.seek(0)
        self.f.write(head.ljust(HEADER_SIZE, b"\0"))
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
        os.replace(self.tmp, self.path)
        fsync_dir(self.path.parent)
        return {"file": self.path.name, "n_tokens": self.n_tokens, "n_sentences": len(lens),
                "n_documents": len(counts), "bytes": self.path.stat().st_size, "crc32": self.crc}

    def abort(self) -> None:
        try:
            self.f.close()  # (flushes: fails again on a full disk)
        except OSError:
            pass
        self.tmp.unlink(missing_ok=True)


@dataclass
class Shard:
    """One opened (memory-mapped) shard."""

    path: Path
    tokens: np.ndarray
    sentence_offsets: np.ndarray
    document_offsets: np.ndarray
    crc32: int


def read_shard_header(path: Path) -> tuple[int, int, int, int, int]:
    """(itemsize, n_tokens, n_sentences, n_documents, body_crc) or a `ValueError` naming the file and the problem."""
    with open(path, "rb") as f:
        head = f.read(HEADER_SIZE)
    if len(head) < HEADER_SIZE:
        raise ValueError(f"corrupt shard {path}: {len(head)} bytes, shorter than its {HEADER_SIZE}-byte header")
    fields = _HEADER.unpack_from(head)
    (stored_crc,) = struct.unpack_from("<I", head, _HEADER.size)
    if fields[0] != MAGIC:
        raise ValueError(f"{path} is not a bertrain token shard (magic {fields[0]!r}, expected {MAGIC!r})")
    if zlib.crc32(head[: _HEADER.size]) != stored_crc:
        raise ValueError(f"corrupt shard {path}: header checksum mismatch (re-run prepare with --overwrite)")
    if fields[1] != VERSION:
        raise ValueError(f"{path} has shard format version {fields[1]}; this bertrain reads version {VERSION}")
    return fields[2], fields[3], fields[4], fields[5], fields[6]


def open_shard(path: str | os.PathLike, verify: bool = False) -> Shard:
    """Memory-map a shard; with `verify` the body CRC32 is checked too (reads the whole file once)."""
    path = Path(path)
    itemsize, n_tok, n_sent, n_doc, crc = read_shard_header(path)
    dtype = np.dtype(np.uint16 if itemsize == 2 else np.uint32)
    tok_bytes = _pad8(n_tok * itemsize)
    expected = HEADER_SIZE + tok_bytes + 8 * (n_sent + 1) + 8 * (n_doc + 1)
    size = path.stat().st_size
    if size != expected:
        raise ValueError(f"corrupt shard {path}: {size} bytes, its header promises {expected} "
                         f"(truncated or overwritten; re-run prepare with --overwrite)")
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    if verify:
        actual = 0
        step = 1 << 26
        for i in range(HEADER_SIZE, size, step):  # in pieces: memory stays flat for big shards
            actual = zlib.crc32(mm[i: min(i + step, size)], actual)
        if actual != crc:
            raise ValueError(f"corrupt shard {path}: body checksum {actual:#010x} != {crc:#010x} "
                             f"(damaged on disk or copied incompletely; re-run prepare with --overwrite)")
    tokens = mm[HEADER_SIZE: HEADER_SIZE + n_tok * itemsize].view(dtype)
    off = HEADER_SIZE + tok_bytes
    sent = mm[off: off + 8 * (n_sent + 1)].view(np.int64)
    off += 8 * (n_sent + 1)
    docs = mm[off: off + 8 * (n_doc + 1)].view(np.int64)
    return Shard(path, tokens, sent, docs, crc)


class TokenStore:
    """All shards of a prepared folder, with global (concatenated) sentence and document offsets.

    `tokens_at(idx)` gathers ids at global token positions across shards; `sentence_starts` (n_sentences + 1,
    global token offsets) and `document_starts` (n_documents + 1, global sentence indices) are in memory
    (8 bytes per sentence), the ids stay memory-mapped.
    """

    def __init__(self, data_dir: str | os.PathLike, verify: bool = True, require_complete: bool = True):
        self.dir = Path(data_dir)
        self.meta = read_store_meta(self.dir, require_complete)
        self.vocab_size: int = self.meta["vocab_size"]
        self.shards: list[Shard] = []
        for entry in self.meta["shards"]:
            shard = open_shard(self.dir / "shards" / entry["file"], verify=verify)
            if len(shard.tokens) != entry["n_tokens"] or shard.crc32 != entry["crc32"]:
                raise ValueError(f"corrupt store {self.dir}: shard {entry['file']} does not match store.json "
                                 f"(re-run prepare with --overwrite)")
            self.shards.append(shard)
        tok_base = np.cumsum([0] + [len(s.tokens) for s in self.shards])
        sent_base = np.cumsum([0] + [len(s.sentence_offsets) - 1 for s in self.shards])
        self.shard_token_starts = tok_base
        self.sentence_starts = self._global_offsets("sentence-starts", [s.sentence_offsets for s in self.shards],
                                                    tok_base)
        self.document_starts = self._global_offsets("document-starts", [s.document_offsets for s in self.shards],
                                                    sent_base)
        self.num_tokens = int(tok_base[-1])
        self.num_sentences = len(self.sentence_starts) - 1
        self.num_documents = len(self.document_starts) - 1

    def _global_offsets(self, name: str, local: list[np.ndarray], base: np.ndarray) -> np.ndarray:
        """The shards' offset arrays (`local`, each ending with its shard's total) made global: each plus its
        shard's `base`, and the grand total last (int64, len = sum of entries + 1).

        In memory for a small store. From `OFFSETS_CACHE_MIN` entries on, memory-mapped from DIR/cache/NAME-KEY.npy
        (KEY: the shards' identity), written by the first process that needs it: every process that opens the
        store (each training rank and its loader workers, each prepare worker) held its own copy, 8 bytes per
        sentence (~1.2 GB per process for English Wikipedia); the map is one copy in the page cache for all. A
        folder that cannot be written (read-only) keeps the in-memory copy."""
        n = sum(len(a) - 1 for a in local)
        if n < OFFSETS_CACHE_MIN:
            return _concat_offsets(local, base)
        key = hashlib.sha256(json.dumps([[e["file"], e["n_tokens"], e["n_sentences"], e["n_documents"], e["crc32"]]
                                         for e in self.meta["shards"]]).encode()).hexdigest()[:16]
        path = self.dir / "cache" / f"{name}-{key}.npy"
        cached = _cached_offsets(path, local, base)
        if cached is not None:
            return cached
        with cache_lock(path):  # ranks that start together: one writes, the others wait and map its file
            cached = _cached_offsets(path, local, base)
            if cached is not None:
                return cached
            offsets = _concat_offsets(local, base)
            try:
                save_npy_atomic(path, offsets)
            except OSError as e:  # a read-only data folder still works, with a copy per process
                logger.warning("cannot cache %s in %s: %s (each process keeps its own copy in memory)", name, path,
                               e)
                return offsets
        return np.load(path, mmap_mode="r")

    def tokens_at(self, idx: np.ndarray, dtype: np.dtype = np.dtype(np.int64)) -> np.ndarray:
        """Token ids at global positions `idx` (any shape), as `dtype` (int64 unless asked)."""
        if len(self.shards) == 1:
            return self.shards[0].tokens[idx].astype(dtype, copy=False)
        flat = idx.ravel()
        out = np.empty(flat.shape, dtype)
        which = np.searchsorted(self.shard_token_starts, flat, side="right") - 1
        # Positions grouped by shard with one counting sort (stable argsort of 16-bit keys is a radix sort): a
        # comparison mask per shard cost O(positions x shards), a third of the static-instance stage's time at
        # Wikipedia's ~110 shards of 32M tokens (np.unique's sort as much again).
        keys = which.astype(np.uint16) if len(self.shards) <= 1 << 16 else which
        order = np.argsort(keys, kind="stable")
        bounds = np.concatenate([[0], np.cumsum(np.bincount(which, minlength=len(self.shards)))])
        for s in np.flatnonzero(np.diff(bounds)):
            sel = order[bounds[s]: bounds[s + 1]]
            out[sel] = self.shards[s].tokens[flat[sel] - self.shard_token_starts[s]]
        return out.reshape(idx.shape)

    def document(self, d: int) -> list[np.ndarray]:
        """The sentences (id arrays) of document `d` (for inspection and tests)."""
        s0, s1 = self.document_starts[d], self.document_starts[d + 1]
        return [self.tokens_at(np.arange(self.sentence_starts[s], self.sentence_starts[s + 1])) for s in range(s0, s1)]


OFFSETS_CACHE_MIN = 1 << 20
"""`TokenStore`: global offset arrays of at least this many entries (8 MB) are memory-mapped from the folder's cache."""


def _concat_offsets(local: list[np.ndarray], base: np.ndarray) -> np.ndarray:
    out = np.empty(sum(len(a) - 1 for a in local) + 1, np.int64)
    at = 0
    for a, b in zip(local, base):
        np.add(a[:-1], b, out=out[at: at + len(a) - 1])
        at += len(a) - 1
    out[-1] = base[-1]
    return out


def _cached_offsets(path: Path, local: list[np.ndarray], base: np.ndarray) -> np.ndarray | None:
    """The global offsets cached at `path`, memory-mapped, or None (missing; unreadable or stale: a warning)."""
    if not path.is_file():
        return None
    try:
        cached = np.load(path, mmap_mode="r")
        if _offsets_match(cached, local, base):
            return cached
    except (OSError, ValueError):
        pass
    logger.warning("cache %s is unreadable or stale; rebuilding it", path)
    return None


@contextlib.contextmanager
def cache_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive lock (flock on the folder of the cache file `path`: no lock file is left behind) while
    building `path`, so that processes started together (the ranks of a job) build it once, not once each at the
    same time. Where the folder cannot be made or the file system has no locks, no lock: each builds its own."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path.parent, os.O_RDONLY)
    except OSError:
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:  # (ENOLCK: a network file system without locks)
            pass
        yield
    finally:
        os.close(fd)  # (releases the lock)


def _offsets_match(cached: np.ndarray, local: list[np.ndarray], base: np.ndarray) -> bool:
    """Whether a cached global offset array is the shards' offsets plus their bases, entry for entry (compared a
    shard at a time: memory stays at one shard's offsets; a damaged cache file is rebuilt, never trusted)."""
    if cached.dtype != np.int64 or cached.ndim != 1 or len(cached) != sum(len(a) - 1 for a in local) + 1:
        return False
    at = 0
    for a, b in zip(local, base):
        n = len(a) - 1
        if not np.array_equal(cached[at: at + n], np.add(a[:-1], b)):
            return False
        at += n
    return int(cached[-1]) == int(base[-1])


def save_npy_atomic(path: Path, arr: np.ndarray) -> None:
    """`arr` as a .npy file at `path`, written through a temporary sibling and renamed (never a torn file; ranks may
    write at once), streamed from the array (atomic_write_bytes would need a second copy of it in memory)."""
    with atomic_open(path, "wb") as f:
        np.save(f, arr)


def document_hashes(shard: Shard) -> np.ndarray:
    """One 64-bit content hash per document of `shard` (uint64): the first 8 bytes (big-endian) of the BLAKE2b of
    the document's token ids as stored. What decides the held-out split (`bertrain.data.prepare`): the same for the
    same document whatever the worker count, chunk size or input order, equal for equal documents (duplicates are
    on the same side), and computable from any store, one prepared before held-out sets existed included."""
    tok_at = np.asarray(shard.sentence_offsets)[np.asarray(shard.document_offsets)] * shard.tokens.itemsize
    data = memoryview(shard.tokens).cast("B") if len(shard.tokens) else memoryview(b"")
    digests = b"".join(hashlib.blake2b(data[a:b], digest_size=8).digest()
                       for a, b in zip(tok_at[:-1].tolist(), tok_at[1:].tolist()))
    return np.frombuffer(digests, dtype=">u8").astype(np.uint64)


@dataclass
class HeldoutStatus:
    """Whether a prepared folder has a held-out set: `dir` (its token store) or None and `reason` (why not)."""

    dir: Path | None
    reason: str = ""
    record: dict[str, Any] = field(default_factory=dict)
    """stats.json's "heldout" entry: the rule, fraction, minimum, counts and the digest of the documents' hashes."""


def heldout_status(data_dir: str | os.PathLike) -> HeldoutStatus:
    """The held-out set of a complete prepared folder, or why it has none: prepared before held-out sets existed
    (train on it, without evaluation, or add one: `bertrain prepare --add-heldout DIR`), disabled, or a corpus too
    small for one. A `ValueError` if the folder is not a complete prepared folder."""
    data_dir = Path(data_dir)
    read_store_meta(data_dir)
    try:
        stats = json.loads((data_dir / "stats.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read {data_dir / 'stats.json'}: {e} (re-run prepare with --overwrite)") from None
    record = stats.get("heldout")
    if record is None:
        return HeldoutStatus(None, f"{data_dir} was prepared before held-out sets existed (its stats.json has no "
                                   f"'heldout' entry): add one with `bertrain prepare --add-heldout {data_dir}`")
    if not record.get("dir"):
        return HeldoutStatus(None, f"{data_dir} has no held-out set: {record.get('reason')}", record)
    path = data_dir / record["dir"]
    read_store_meta(path)  # complete, or a ValueError naming what is wrong
    return HeldoutStatus(path, "", record)


def read_store_meta(data_dir: Path, require_complete: bool = True) -> dict[str, Any]:
    """store.json of a complete prepared folder, or a `ValueError` saying what is wrong and what to do."""
    meta_path = data_dir / "store.json"
    if not data_dir.is_dir():
        partial = data_dir.with_name(data_dir.name + ".partial")
        hint = f" (an interrupted prepare left {partial}: re-run the same prepare command to finish it)" \
            if partial.exists() else " (run `bertrain prepare` first)"
        raise ValueError(f"prepared data folder {data_dir} does not exist{hint}")
    if not meta_path.is_file() or (require_complete and not (data_dir / "stats.json").is_file()):
        raise ValueError(f"{data_dir} is not a complete prepared folder (store.json/stats.json missing); "
                         f"re-run `bertrain prepare`")
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"corrupt {meta_path}: {e} (re-run prepare with --overwrite)") from None
    if meta.get("format") != STORE_FORMAT:
        raise ValueError(f"{meta_path} is not a bertrain token store index")
    if meta.get("version") != STORE_VERSION:
        raise ValueError(f"{meta_path} has store version {meta.get('version')}; this bertrain reads {STORE_VERSION}")
    return meta
