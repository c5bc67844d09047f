"""`prepare`: corpora -> token store (+ static instances), streaming, on every core, atomic and resumable.

Stage 1 (tokenize): the main process reads raw documents (decompression, XML parsing, optional de-duplication)
and cuts them into ~256 KB chunks; a pool of worker processes cleans and sentence-splits each chunk in one pass
(`clean_documents`) and tokenizes it (`FastBertEncoder`: HF `tokenizers`' exact ids, cached per word); the main
process appends results, in input order, to the current shard and closes it atomically when it reaches
`shard_tokens`. Memory is bounded by the shard size and the pool's queue, not by the corpus.

Held-out split (`heldout_fraction` > 0): a deterministic set of whole documents is moved out of the finished shards
into `OUTPUT/heldout/` (a token store of the same layout), never trained on: see `heldout_cut` for the rule (a
64-bit hash of each document's token ids, so the same document is on the same side whatever the worker count,
chunk size or input order, and the rule applies to any store: `add_heldout` gives a store prepared without one
the same split). Done after stage 1, not inside it, because the minimum count and the small-corpus rule need every
document's hash: the documents' hashes (8 bytes each) are all the split holds in memory; it rewrites, shard by
shard, only the shards that hold held-out documents (~1x the token store's bytes read and written, against stage
1's tokenizing) and records each shard in `progress.json` before replacing it, so a kill anywhere resumes to the
same bytes. With `heldout_fraction=0`, or a corpus too small for the set, no shard is touched.

Stage 2 (`masking="static"`): `dupe_factor` x blocks instance rows, built in parallel (by the same pool) by the
vectorised `InstanceBuilder` (identical to dynamic epochs 0..dupe_factor-1); each worker writes its rows in place
into one pre-sized fixed-width file.

Everything is built in `OUTPUT.partial/`, renamed to `OUTPUT` only when complete (with `stats.json` written last);
with `overwrite` an existing `OUTPUT` is moved aside to `OUTPUT.replaced-<time>` then, never deleted. The output is
locked for the whole command (`OutputLock`: a second prepare on it fails at once, naming the first).
`progress.json` records the finished shards; a re-run of the same command after a kill skips the chunks already
in finished shards (their input is re-read, not re-processed). A different command discards the partial folder.

Failures: bad input (not text, no text left, ...) is a `UserError` and removes the partial folder (the inputs must
change to get past it, and that restarts the build anyway). A write error (disk full, no permission) is one line
(`OutputError`): what was being written, free and needed space, and what was kept: the unfinished file is deleted,
the finished shards stay in `OUTPUT.partial` (resumable; deleting it frees their space).
"""
from __future__ import annotations

import errno
import hashlib
import json
import logging
import math
import multiprocessing
import os
import signal
import shutil
import time
from collections import Counter, defaultdict, deque
from dataclasses import dataclass, field
from itertools import groupby
from operator import itemgetter
from pathlib import Path
from typing import Any, Callable, Iterator, Literal

import numpy as np

from bertrain.data.cleaning import clean_documents
from bertrain.data.progress import Progress
from bertrain.data.readers import (CorpusConfig, RawDocument, SkipReport, doc_hash, input_fingerprint,
                                   input_size, iter_raw_documents, resolve_inputs)
from bertrain.data.samples import (InstanceBuilder, SampleConfig, sample_from_record, sample_record, static_dir_name,
                                   write_static_meta)
from bertrain.data.store import (HELDOUT_DIR, STORE_FORMAT, STORE_VERSION, ShardWriter, TokenStore, document_hashes,
                                 heldout_status, open_shard, read_store_meta, token_dtype)
from bertrain.data.tokenizer import FastBertEncoder, check_vocab_casing, read_vocab, tokenizer_identity
from bertrain.utils.errors import OutputError, UserError, describe_os_error
from bertrain.utils.io import atomic_write_json, fsync_dir
from bertrain.utils.memory import keep_freed_memory
from bertrain.utils.rundir import OutputLock, move_aside

logger = logging.getLogger(__name__)


@dataclass
class PrepareConfig:
    """Settings of `bertrain prepare` (names follow google-research/bert's create_pretraining_data.py)."""

    inputs: list[str] = field(default_factory=list)
    """Input files, folders, globs or builtin:python-docs."""
    output: str = ""
    """Output folder (built as OUTPUT.partial and renamed when complete)."""
    vocab_file: str = ""
    """WordPiece vocab.txt (from `bertrain vocab` or a pretrained model)."""
    sample: SampleConfig = field(default_factory=SampleConfig)
    """Static instances: what a sample is (dynamic samples are built at training time with the trainer's)."""
    dupe_factor: int = 5
    """Static instances: number of differently masked copies of the corpus."""
    masking: Literal["static", "dynamic", "none"] = "static"
    """static: also materialise instances; dynamic/none: token store only (samples are built at training time)."""
    do_lower_case: bool = True
    """Lower-case (and strip accents) before WordPiece: must match the vocab."""
    seed: int = 12345
    """Seed of blocks, masking and NSP pairing."""
    workers: int = 0
    """Worker processes (0 = every core)."""
    overwrite: bool = False
    """Replace an existing output folder (moved aside to OUTPUT.replaced-<time> once the new one is complete)."""
    corpus: CorpusConfig = field(default_factory=CorpusConfig)
    """How inputs are read and cleaned (format, JSONL field, encoding, minimum length, dedupe)."""
    shard_tokens: int = 1 << 25
    """Tokens per shard (32M tokens = 64 MB with a < 65536 vocab)."""
    chunk_bytes: int = 1 << 18
    """Text per worker task (256 KB: the first task starts sooner and the last ones balance better than with 1 MB,
    4-8% faster on the shared corpora; measured in BENCHMARKS.md)."""
    heldout_fraction: float = 0.01
    """Share of the documents set aside in OUTPUT/heldout/ for evaluation, never trained on, chosen by a hash of
    each document's content (`heldout_cut`); at most 0.5; 0 = no held-out set. 1% of a Wikipedia-sized corpus is
    tens of thousands of documents, far more than an evaluation needs and a negligible loss for training."""
    heldout_min_documents: int = 10
    """At least this many held-out documents (the next-smallest hashes top the set up), so a small corpus still
    gets a usable evaluation set; a corpus where that would hold out more than 10% of its documents gets none
    (a warning, and stats.json says why). 0 = no minimum."""

    def __post_init__(self) -> None:
        errors = []
        if not self.inputs:
            errors.append("inputs: give at least one input")
        if not self.output:
            errors.append("output: required")
        if not self.vocab_file:
            errors.append("vocab_file: required")
        def name(field: str) -> str:  # the setting, and the flag of `bertrain prepare` that sets it
            return f"{field} (--{field.replace('_', '-')})"
        if self.dupe_factor < 1:
            errors.append(f"{name('dupe_factor')} must be >= 1, got {self.dupe_factor}")
        if self.workers < 0:
            errors.append(f"{name('workers')} must be >= 0, got {self.workers}")
        if self.shard_tokens < 1:
            errors.append(f"{name('shard_tokens')} must be positive, got {self.shard_tokens}")
        if self.chunk_bytes < 1:
            errors.append(f"chunk_bytes must be positive, got {self.chunk_bytes}")
        if not 0.0 <= self.heldout_fraction <= 0.5:
            errors.append(f"{name('heldout_fraction')} must be in [0, 0.5], got {self.heldout_fraction}")
        if self.heldout_min_documents < 0:
            errors.append(f"{name('heldout_min_documents')} must be >= 0, got {self.heldout_min_documents}")
        if errors:
            raise ValueError("; ".join(errors))


# ----------------------------------------------------------------------------------------------- workers

_W: dict[str, Any] = {}


def _init_tokenize_worker(vocab_file: str, lower: bool, min_chars: int, dtype: str) -> None:
    _W.update(enc=FastBertEncoder.from_vocab_file(vocab_file, lower), min_chars=max(1, min_chars),
              dtype=np.dtype(dtype))


def _tokenize_chunk(docs: list[tuple[str, str, str]]) -> tuple[np.ndarray, np.ndarray, np.ndarray, dict, int]:
    """Clean, split and tokenize a chunk of raw documents -> (ids, sentence lengths, sentences per doc, skips,
    cleaned text bytes)."""
    sentences: list[str] = []
    per_doc: list[int] = []
    skipped: dict[str, Counter] = defaultdict(Counter)
    for (kind, group) in groupby(docs, key=itemgetter(1)):
        group = list(group)
        for (_, _, file), sents in zip(group, clean_documents([d[0] for d in group], kind)):
            if sum(map(len, sents)) < _W["min_chars"]:
                skipped[file]["short_documents"] += 1
                continue
            sentences.extend(sents)
            per_doc.append(len(sents))
    if not sentences:
        return np.zeros(0, _W["dtype"]), np.zeros(0, np.int64), np.zeros(0, np.int64), dict(skipped), 0
    text_bytes = len("\n".join(sentences).encode("utf-8")) + 1  # each sentence and its newline
    ids, lens = _W["enc"].encode_sentences(sentences)  # == HF tokenizers' ids, see FastBertEncoder
    ids = ids.astype(_W["dtype"])
    doc_of = np.repeat(np.arange(len(per_doc)), per_doc)
    keep = lens > 0  # a sentence of only control/unknown-free whitespace gives no ids
    counts = np.bincount(doc_of[keep], minlength=len(per_doc))
    empty_docs = int((counts == 0).sum())
    if empty_docs:
        skipped["(all inputs)"]["documents_without_tokens"] += empty_docs
    return ids, lens[keep], counts[counts > 0], {k: dict(v) for k, v in skipped.items()}, text_bytes


def _static_setup(data_dir: str, sample: SampleConfig, seed: int, out_path: str) -> None:
    """A worker's static-instance state, made on its first static task (the pool is the one that tokenized:
    a second pool cost serial start-up and shutdown between the stages)."""
    _close_static()  # (the word caches stay: freeing them takes time, and they are bounded by max_cache)
    _W["builder"] = InstanceBuilder(TokenStore(data_dir, verify=False, require_complete=False), sample, seed)
    _W["out_fd"] = os.open(out_path, os.O_WRONLY)
    _W["static_setup"] = (data_dir, sample, seed, out_path)


def _close_static() -> None:
    if "out_fd" in _W:
        os.close(_W.pop("out_fd"))
    _W.pop("builder", None)
    _W.pop("static_setup", None)


def _static_rows(task: tuple[int, int, int, str, tuple[str, SampleConfig, int, str]]) -> int:
    """Build rows [lo, hi) of epoch `epoch` and write them in place into the pre-sized instances file.

    Workers write their own rows (os.pwrite at the row's fixed offset) instead of sending them back: piping
    ~100 MB of rows per 9 MB of text through the main process cost it ~0.3 CPU s (a quarter of the stage)."""
    epoch, lo, hi, dtype, setup = task
    if _W.get("static_setup") != setup:
        _static_setup(*setup)
    builder = _W["builder"]
    rows = builder.build(epoch, np.arange(lo, hi), dtype=np.dtype(dtype))
    offset = (epoch * builder.n_blocks + lo) * rows.shape[1] * rows.itemsize
    data = memoryview(rows).cast("B")
    while len(data):
        n = os.pwrite(_W["out_fd"], data, offset)
        data, offset = data[n:], offset + n
    return len(rows)


# Pool workers keep freed memory (numpy temporaries of every task) instead of returning it to the kernel after each
# task and page-faulting it back in for the next: ~230k minor faults and ~0.4 CPU s of system time per 8.8 MB of
# text with 2 workers, where one process had ~26k. Only in pool workers, never in the caller's process.
_WORKER_MMAP_THRESHOLD = 64 << 20
_WORKER_TRIM_THRESHOLD = 128 << 20


def _start_worker(initializer, initargs) -> None:
    # The parent's SIGTERM handler (the CLI's, a training loop's) is no worker's: one that inherited a Python handler
    # could outlive the end of the pool and hang its join.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    # A stop signal to the whole process group (Ctrl-C in a terminal, `kill -TERM -PGID`, Slurm's or systemd's stop,
    # which signal every process of the job) is the parent's alone: a worker that died of it mid-read of a task, or
    # holding the task queue's lock, hung the parent's Pool.terminate for good (and printed a traceback per worker
    # for Ctrl-C). The parent stops (KeyboardInterrupt / the CLI's SIGTERM) and ends the workers with SIGKILL
    # (`_Worker.terminate`), which no mask holds back.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    keep_freed_memory(_WORKER_MMAP_THRESHOLD, _WORKER_TRIM_THRESHOLD)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one process per core already; no nested thread pools
    if initializer is not None:
        initializer(*initargs)


class _ForkWorker(multiprocessing.context.ForkProcess):
    """A pool worker that `Pool.terminate` ends with SIGKILL: it holds SIGTERM back (`_start_worker`)."""

    def terminate(self) -> None:
        self.kill()


class _SpawnWorker(multiprocessing.context.SpawnProcess):
    """As `_ForkWorker`, for platforms without fork."""

    def terminate(self) -> None:
        self.kill()


class _ForkContext(multiprocessing.context.ForkContext):
    Process = _ForkWorker


class _SpawnContext(multiprocessing.context.SpawnContext):
    Process = _SpawnWorker


def _pool(workers: int, initializer, initargs):
    """A process pool, or None for one worker (then the work runs in this process).

    With fork (Linux) the worker state is built once here, before forking, and inherited: building it in each
    worker (loading the tokenizer) delayed the first task. With spawn each worker builds its own.
    The caller ends it with `_end_pool`."""
    if workers <= 1:
        initializer(*initargs)
        return None
    if "fork" in multiprocessing.get_all_start_methods():
        initializer(*initargs)
        return _ForkContext().Pool(workers, initializer=_start_worker, initargs=(None, ()))
    return _SpawnContext().Pool(workers, initializer=_start_worker, initargs=(initializer, initargs))


# ----------------------------------------------------------------------------------------------- stage 1

def _chunks(docs: Iterator[RawDocument], chunk_bytes: int, dedupe: bool,
            report: SkipReport) -> Iterator[list[tuple[str, str, str]]]:
    seen: set[bytes] = set()
    chunk: list[tuple[str, str, str]] = []
    size = 0
    for d in docs:
        if dedupe:
            h = doc_hash(d.text)
            if h in seen:
                report.add(d.file, "duplicate_documents")
                continue
            seen.add(h)
        chunk.append((d.text, d.kind, d.file))
        size += len(d.text)
        if size >= chunk_bytes:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


def _fingerprint(cfg: PrepareConfig, identity: str) -> dict[str, Any]:
    files = input_fingerprint(cfg.inputs)
    corpus = ("input_format", "text_field", "min_document_chars", "dedupe", "skip_disambiguation")
    keys = ("shard_tokens", "chunk_bytes", "do_lower_case", "heldout_fraction", "heldout_min_documents")
    return {"inputs": files, "tokenizer": identity, **{k: getattr(cfg.corpus, k) for k in corpus},
            **{k: getattr(cfg, k) for k in keys}, "encoding": cfg.corpus.encoding}


def _end_pool(pool, finished: bool = False) -> None:
    """End the pool: `finished` (every task done), the workers take the pool's end-of-work sentinel and exit; else
    (an error, tasks in flight) they are terminated. Not terminate on success: it hung a full test run for good —
    it signals workers that may still wait on the task queue's lock, which it holds from then on, and a worker whose
    SIGTERM did not end it waited there for ever (terminate now ends a worker with SIGKILL: `_ForkWorker`)."""
    if pool is not None:
        if finished:
            pool.close()
        else:
            pool.terminate()
        pool.join()
    _close_static()  # this process's state (one worker, or built here before forking)
    _W.clear()


@dataclass
class _Status:
    """What the build is writing now (for the one line of a failed write) and how much more it needs."""

    doing: str = ""
    needed: Callable[[], int | None] = lambda: None
    owns_partial: bool = False  # the partial folder is this command's (resumed or started afresh)


def _read_progress(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _tokenize_stage(cfg: PrepareConfig, work: Path, identity: str, pool, status: _Status) -> dict[str, Any]:
    vocab = read_vocab(cfg.vocab_file)
    dtype = token_dtype(len(vocab))
    fp = _fingerprint(cfg, identity)
    progress_path = work / "progress.json"
    progress: dict[str, Any] = {"fingerprint": fp, "chunks_done": 0, "shards": [], "worker_skips": {},
                                "text_bytes": 0}
    old = _read_progress(progress_path)
    if old is not None and old.get("fingerprint") == fp:
        progress = old
        logger.info("resuming %s: %d shards (%d chunks) already done", work, len(old["shards"]),
                    old["chunks_done"])
    else:  # another command's (or no) partial build: nothing in it is ours (stale static instances included)
        for f in work.iterdir():
            if f.is_dir():
                shutil.rmtree(f)
            else:
                f.unlink()
    status.owns_partial = True
    status.doing = f"creating {work / 'shards'}"
    (work / "shards").mkdir(parents=True, exist_ok=True)
    for f in (work / "shards").iterdir():  # shards not recorded as finished are redone
        if f.name not in {s["file"] for s in progress["shards"]}:
            f.unlink()

    report = SkipReport()
    opts = cfg.corpus
    # The reader runs ahead of the workers (in the pool's task thread): each chunk carries the input position at
    # its end, and the progress shown is that of the last chunk tokenized.
    reading = Progress("", bar=False, interval=math.inf)
    shown = Progress("prepare: tokenizing", total=input_size(resolve_inputs(cfg.inputs)), log=logger)
    positions: deque[float] = deque()
    chunks = _chunks(iter_raw_documents(cfg.inputs, opts, report, reading), cfg.chunk_bytes, opts.dedupe, report)
    skips: dict[str, Counter] = defaultdict(Counter, {k: Counter(v) for k, v in progress["worker_skips"].items()})
    text_bytes = progress["text_bytes"]
    done = progress["chunks_done"]

    def todo() -> Iterator[list[tuple[str, str, str]]]:
        for i, c in enumerate(chunks):
            if i >= done:
                positions.append(reading.value)
                yield c

    writer: ShardWriter | None = None
    written_at = 0.0  # the input position of the last chunk written

    def needed() -> int | None:  # the rest of the store, estimated from what the input written so far gave
        written = sum(s["bytes"] for s in progress["shards"]) + (writer.n_tokens * dtype.itemsize if writer else 0)
        share = written_at / shown.total if shown.total else 0.0
        return int(written / share - written) if share > 0.01 else None

    status.needed = needed
    chunk_idx = done
    try:
        results = pool.imap(_tokenize_chunk, todo()) if pool else map(_tokenize_chunk, todo())
        for ids, lens, counts, chunk_skips, nbytes in results:
            chunk_idx += 1
            text_bytes += nbytes
            shown.set(positions.popleft())
            for src, c in chunk_skips.items():
                skips[src].update(c)
            if len(counts):
                if writer is None:
                    path = work / "shards" / f"shard-{len(progress['shards']):05d}.bts"
                    status.doing = f"writing the token shard {path}"
                    writer = ShardWriter(path, dtype)
                writer.add(ids, lens, counts)
            written_at = shown.value
            if writer is not None and writer.n_tokens >= cfg.shard_tokens:
                progress["shards"].append(writer.close())
                writer = None
                progress.update(chunks_done=chunk_idx, text_bytes=text_bytes,
                                worker_skips={k: dict(v) for k, v in skips.items()})
                status.doing = f"writing {progress_path}"
                atomic_write_json(progress_path, progress)
        if writer is not None:
            progress["shards"].append(writer.close())
            writer = None
        progress.update(chunks_done=chunk_idx, text_bytes=text_bytes,
                        worker_skips={k: dict(v) for k, v in skips.items()})
        status.doing = f"writing {progress_path}"
        atomic_write_json(progress_path, progress)
    finally:
        shown.close()
        if writer is not None:
            writer.abort()

    for src, c in skips.items():
        for k, v in c.items():
            report.add(src, k, v)
    status.needed = lambda: None
    logger.info("tokenized %.1f MB of text into %d tokens", text_bytes / 1e6,
                sum(s["n_tokens"] for s in progress["shards"]))
    return {"progress": progress, "report": report, "text_bytes": text_bytes}


def _store_meta(vocab: list[str], identity: str, do_lower_case: bool, shards: list[dict]) -> dict[str, Any]:
    """store.json of a token store made of `shards` (the training store, or the held-out one)."""
    special = {t: vocab.index(t) for t in ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")}
    return {
        "format": STORE_FORMAT, "version": STORE_VERSION, "tokenizer_identity": identity,
        "do_lower_case": do_lower_case, "vocab_size": len(vocab), "dtype": token_dtype(len(vocab)).name,
        "special_ids": special, "subword_ids": [i for i, t in enumerate(vocab) if t.startswith("##")],
        "shards": shards,
        "num_tokens": sum(s["n_tokens"] for s in shards),
        "num_sentences": sum(s["n_sentences"] for s in shards),
        "num_documents": sum(s["n_documents"] for s in shards),
    }


def _write_stores(work: Path, vocab_file: str, identity: str, do_lower_case: bool, split: dict[str, Any],
                  status: _Status) -> tuple[dict[str, Any], dict[str, Any]]:
    """vocab.txt and store.json of the training store in `work` and, if the split made one, the held-out store's
    store.json and stats.json in `work/heldout`; returns the training store's meta and the held-out record (the
    "heldout" entry of stats.json)."""
    vocab = read_vocab(vocab_file)
    status.doing = f"writing {work / 'vocab.txt'} and {work / 'store.json'}"
    shutil.copyfile(vocab_file, work / "vocab.txt")
    meta = _store_meta(vocab, identity, do_lower_case, split["train"])
    atomic_write_json(work / "store.json", meta)
    held = _store_meta(vocab, identity, do_lower_case, split["heldout"])
    record = {"dir": HELDOUT_DIR if split["heldout"] else None, "reason": split["reason"], "rule": HELDOUT_RULE,
              "fraction": split["fraction"], "min_documents": split["min_documents"], "cut": split["cut"],
              **{k: held[k] for k in ("num_documents", "num_sentences", "num_tokens")},
              "document_hashes_sha256": split.get("digest")}
    if split["heldout"]:
        status.doing = f"writing {work / HELDOUT_DIR / 'store.json'}"
        atomic_write_json(work / HELDOUT_DIR / "store.json", held)
        atomic_write_json(work / HELDOUT_DIR / "stats.json", record)  # marks the held-out store complete
    return meta, record


# ----------------------------------------------------------------------------------------------- held-out split

HELDOUT_MAX_TOPUP = 0.1
HELDOUT_RULE = ("held out: the documents whose 64-bit token-id hash (store.document_hashes) is < fraction * 2**64, "
                "topped up to min_documents with the next-smallest hashes (equal hashes together), i.e. hash <= cut; "
                "none when the top-up would hold out more than 10% of the documents, or the set would be more than "
                "half of them")


def heldout_cut(hashes: np.ndarray, fraction: float, min_documents: int) -> tuple[int | None, str]:
    """The held-out rule on every document's hash (uint64): held out iff hash <= cut. Returns (cut, "") or
    (None, why there is no held-out set). A function of the set of hashes only, not of their order.

    A hash below `fraction` of the hash range is the streaming part of the rule (each document decides alone);
    the minimum needs the `min_documents` smallest hashes of the whole corpus, which is why the split runs once
    every document is tokenized."""
    n = len(hashes)
    if fraction <= 0:
        return None, "disabled (heldout_fraction 0)"
    cut = min(int(fraction * 2.0**64), 2**64) - 1  # hash < fraction * 2**64
    taken = int(np.count_nonzero(hashes <= np.uint64(cut))) if cut >= 0 else 0
    if taken < min_documents:
        if min_documents > HELDOUT_MAX_TOPUP * n:
            return None, (f"the corpus is too small: holding out heldout_min_documents={min_documents} of its {n} "
                          f"documents would take more than {HELDOUT_MAX_TOPUP:.0%} of them (lower "
                          f"heldout_min_documents, or prepare more text)")
        cut = max(cut, int(np.partition(hashes, min_documents - 1)[min_documents - 1]))
        taken = int(np.count_nonzero(hashes <= np.uint64(cut)))
    if taken == 0:
        return None, f"none of the {n} documents' hashes fell in the held-out share {fraction} (no minimum was set)"
    if taken > n // 2:
        return None, f"the corpus is too small: the rule would hold out {taken} of its {n} documents, over half"
    return cut, ""


def _shard_hashes(path: str) -> np.ndarray:
    return document_hashes(open_shard(path))


def _split_shard(src: Path, held: np.ndarray, train_path: Path, heldout_path: Path) -> tuple[dict | None, dict]:
    """Write the documents of shard `src` that are not `held` (bool per document) to `train_path` and the held ones
    to `heldout_path`, in order (runs of consecutive documents copied straight from the memory map); returns the
    two shards' entries (None for an empty training part)."""
    shard = open_shard(src)
    sent, docs = np.asarray(shard.sentence_offsets), np.asarray(shard.document_offsets)
    entries: list[dict | None] = []
    for keep, path in ((~held, train_path), (held, heldout_path)):
        if not keep.any():
            entries.append(None)
            continue
        writer = ShardWriter(path, shard.tokens.dtype)
        try:
            runs = np.flatnonzero(np.diff(np.concatenate([[0], keep.astype(np.int8), [0]])))
            for d0, d1 in runs.reshape(-1, 2).tolist():
                s0, s1 = docs[d0], docs[d1]
                writer.add(shard.tokens[sent[s0]: sent[s1]], np.diff(sent[s0: s1 + 1]), np.diff(docs[d0: d1 + 1]))
            entries.append(writer.close())
        except BaseException:
            writer.abort()
            raise
    return entries[0], entries[1]


def _split_heldout(work: Path, progress: dict[str, Any], fraction: float, min_documents: int, pool,
                   status: _Status) -> dict[str, Any]:
    """Move the held-out documents out of the finished shards of `work` (`progress["shards"]`, every document)
    into `work/heldout/shards/`, shard by shard, resumable; returns {"train": the training shards' entries,
    "heldout": the held-out shards' entries, "cut", "reason", "digest", "fraction", "min_documents"}.

    The decision (the cut) is recorded in progress.json before any shard changes; then, per shard that holds
    held-out documents: both parts are written (the training part to `work/split/`), the shard is recorded as
    split, and only then does its training part replace it. A re-run finishes the replacements recorded and
    continues with the next shard, so a kill anywhere ends in the same bytes as a straight run."""
    progress_path = work / "progress.json"
    shards = progress["shards"]
    rec = progress.get("heldout")
    hashes: list[np.ndarray] | None = None
    if rec is None:
        status.doing = f"reading the shards of {work} to hash their documents"
        paths = [str(work / "shards" / s["file"]) for s in shards]
        hashes = list(pool.imap(_shard_hashes, paths)) if pool else [_shard_hashes(p) for p in paths]
        every = np.concatenate(hashes) if hashes else np.zeros(0, np.uint64)
        cut, reason = heldout_cut(every, fraction, min_documents)
        rec = {"cut": None if cut is None else f"{cut:#018x}", "reason": reason, "done": []}
        if cut is not None:  # the held-out documents' hashes, sorted: one digest that names the set
            rec["digest"] = hashlib.sha256(np.sort(every[every <= np.uint64(cut)]).astype(">u8").tobytes()).hexdigest()
        elif fraction > 0:  # (an info line: the warning that matters is the trainer's, "no held-out evaluation")
            logger.info("no held-out set in %s: %s", work.with_name(work.name.removesuffix(".partial")), reason)
        progress["heldout"] = rec
        status.doing = f"writing {progress_path}"
        atomic_write_json(progress_path, progress)
    out = {"cut": rec["cut"], "reason": rec["reason"], "digest": rec.get("digest"), "fraction": fraction,
           "min_documents": min_documents}
    if rec["cut"] is None:
        return {**out, "train": shards, "heldout": []}
    cut = np.uint64(int(rec["cut"], 16))
    pending, held_dir = work / "split", work / HELDOUT_DIR / "shards"
    pending.mkdir(exist_ok=True)
    held_dir.mkdir(parents=True, exist_ok=True)
    done = rec["done"]
    recorded = {d["heldout"]["file"] for d in done if d["heldout"] is not None}
    for f in held_dir.iterdir():  # a held-out shard (or its temporary file) of a shard not recorded: redone
        if f.name not in recorded:
            f.unlink()
    for i, entry in enumerate(shards):
        path = work / "shards" / entry["file"]
        if i == len(done):
            status.doing = f"reading {path} to hash its documents"
            held = (hashes[i] if hashes is not None else _shard_hashes(str(path))) <= cut
            if not held.any():
                done.append({"train": entry, "heldout": None})
                continue
            name = f"shard-{sum(d['heldout'] is not None for d in done):05d}.bts"
            status.doing = f"writing the held-out split of {path} ({pending / entry['file']}, {held_dir / name})"
            status.needed = lambda size=entry["bytes"]: size
            train, heldout = _split_shard(path, held, pending / entry["file"], held_dir / name)
            done.append({"train": train, "heldout": heldout})
            status.doing = f"writing {progress_path}"
            atomic_write_json(progress_path, progress)  # shard i is split: from here on, a re-run only finishes it
        if done[i]["heldout"] is not None:  # the training part replaces the shard (or it goes: all held out)
            if (pending / entry["file"]).exists():
                os.replace(pending / entry["file"], path)
            elif done[i]["train"] is None:
                path.unlink(missing_ok=True)
    status.doing, status.needed = f"writing {progress_path}", lambda: None
    atomic_write_json(progress_path, progress)
    shutil.rmtree(pending, ignore_errors=True)
    fsync_dir(work / "shards")
    return {**out, "train": [d["train"] for d in done if d["train"] is not None],
            "heldout": [d["heldout"] for d in done if d["heldout"] is not None]}


def _after_tokenizing(cfg: PrepareConfig, work: Path, identity: str, progress: dict[str, Any], pool, workers: int,
                      status: _Status, refuse_none: str = "") -> tuple[dict[str, Any], dict[str, Any], int | None]:
    """What follows the token shards in `work` (`prepare`'s stage 1, or the shards `add_heldout` starts from): the
    held-out split, store.json (and heldout/), then static instances; returns the training store's meta, the
    held-out record and the number of static instances. `refuse_none`: a `UserError` saying this when the split
    makes no held-out set."""
    split = _split_heldout(work, progress, cfg.heldout_fraction, cfg.heldout_min_documents, pool, status)
    if refuse_none and not split["heldout"]:
        raise UserError(f"{refuse_none}: {split['reason']}")
    meta, heldout = _write_stores(work, cfg.vocab_file, identity, cfg.do_lower_case, split, status)
    num_instances = None
    if cfg.masking == "static":
        num_instances = write_static_instances(work, cfg.sample, cfg.seed, cfg.dupe_factor, pool, workers,
                                               status=status)
    return meta, heldout, num_instances


# ----------------------------------------------------------------------------------------------- stage 2

def write_static_instances(data_dir: Path, sample: SampleConfig, seed: int, dupe_factor: int, pool, workers: int,
                           block_batch: int = 2048, status: _Status | None = None) -> int:
    """Materialise dupe_factor x blocks instance rows into `data_dir/static-.../` (atomic); returns the count.

    `data_dir`: the folder being built (its token store is written, stats.json is not yet). `pool`: a `_pool` of
    `workers` processes (or None: build in this process). The instances file's size is known: a disk without that
    much free space is refused before writing (the file is sparse until written, so it would fail half-way)."""
    out = data_dir / static_dir_name(sample, seed, dupe_factor)
    if (out / "instances.json").is_file():
        meta = json.loads((out / "instances.json").read_text(encoding="utf-8"))
        logger.info("static instances %s already complete", out.name)
        return int(meta["num_instances"])
    store = TokenStore(data_dir, verify=False, require_complete=False)
    builder = InstanceBuilder(store, sample, seed)  # builds and caches the blocks, which the workers then load
    n_blocks = builder.n_blocks
    dtype = np.dtype(np.uint16) if max(store.vocab_size, sample.max_seq_length) < 65536 else np.dtype(np.uint32)
    size = dupe_factor * n_blocks * builder.row_width * dtype.itemsize
    status = status or _Status()
    status.doing, status.needed = f"writing the static instances {out / 'instances.bin'}", lambda: size
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / ".instances.bin.tmp"
    if shutil.disk_usage(out).free < size:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp))
    setup = (str(data_dir), sample, seed, str(tmp))
    tasks = [(d, lo, min(lo + block_batch, n_blocks), dtype.name, setup)
             for d in range(dupe_factor) for lo in range(0, n_blocks, block_batch)]
    n = 0
    try:
        with open(tmp, "wb") as f:
            f.truncate(size)
        # Tasks go out in groups of up to 4 (tasks are short, and one round trip each cost the pool's feeder and
        # result threads much of the main process's CPU), but small enough for every worker to get several.
        chunksize = max(1, min(4, len(tasks) // (4 * workers)))
        results = pool.imap_unordered(_static_rows, tasks, chunksize=chunksize) if pool else map(_static_rows, tasks)
        with open(tmp, "rb+") as f, Progress("prepare: static instances", total=dupe_factor * n_blocks,
                                             unit="rows", log=logger) as progress:
            # The main process only waits here, so it flushes what the workers wrote so far every ~1/8 of the
            # tasks: the final fsync then has little left (it was ~20 ms for 50 MB at the very end, serial).
            for i, rows in enumerate(results, 1):
                n += rows
                progress.update(rows)
                if pool is not None and i % max(1, len(tasks) // 8) == 0:
                    getattr(os, "fdatasync", os.fsync)(f.fileno())  # (macOS has no fdatasync)
            os.fsync(f.fileno())
        os.replace(tmp, out / "instances.bin")
    except BaseException:  # not resumable (a re-run rebuilds the instances): never leave the big file behind
        tmp.unlink(missing_ok=True)
        raise
    finally:
        _close_static()
    write_static_meta(out, sample, seed, dupe_factor, n, builder.row_width, dtype)
    fsync_dir(out)
    return n


# ----------------------------------------------------------------------------------------------- entry

def prepare(cfg: PrepareConfig) -> dict[str, Any]:
    """Run both stages; returns (and writes as OUTPUT/stats.json) the statistics.

    Holds `OutputLock(output)` throughout; see the module docstring for overwrite, resume and failures."""
    t0 = time.perf_counter()
    out = Path(cfg.output)
    work = out.with_name(out.name + ".partial")
    with OutputLock(out, "prepare"):
        if out.exists() and not cfg.overwrite:
            raise UserError(f"output {out} already exists; pass --overwrite to replace it (the old folder is kept "
                            f"until the new one is complete, then moved aside, not deleted)")
        check_vocab_casing(cfg.vocab_file, cfg.do_lower_case,
                           "do_lower_case (`prepare --[no-]do-lower-case`, pretraining's data.do_lower_case)")
        identity = tokenizer_identity(cfg.vocab_file, cfg.do_lower_case)
        resolve_inputs(cfg.inputs)  # a mistyped input: refused before the partial folder is touched
        status = _Status(f"creating {work}")
        stats, moved = _build_in_place_of(out, work, status, lambda: _build(cfg, work, identity, status, t0))
    if moved is not None:
        logger.info("moved the previous %s aside to %s", out, moved)
    logger.info("prepared %s: %d documents, %d sentences, %d tokens%s in %.1f s (%.2f MB/s of text)", out,
                stats["num_documents"], stats["num_sentences"], stats["num_tokens"],
                f", {stats['num_instances']} static instances" if stats["num_instances"] is not None else "",
                stats["seconds"], stats["text_mb_per_s"])
    return stats


def _build_in_place_of(out: Path, work: Path, status: _Status,
                       build: Callable[[], dict[str, Any]]) -> tuple[dict[str, Any], Path | None]:
    """`build()` the folder `work`, then rename it to `out` (a previous `out` moved aside, never deleted); returns
    the stats and where the previous folder went. Failures: see the module docstring."""
    try:
        stats = build()
    except OutputError:
        raise
    except ValueError:  # bad input or settings: the inputs must change, which restarts the build anyway
        if status.owns_partial:
            shutil.rmtree(work, ignore_errors=True)
        raise
    except OSError as e:
        raise OutputError(describe_os_error(e, status.doing, _kept(work), status.needed())) from e
    moved = move_aside(out) if out.exists() else None  # (never deleted: a one-line error if that fails)
    try:
        os.replace(work, out)
    except OSError as e:
        raise OutputError(describe_os_error(e, f"renaming the finished {work} to {out}",
                                            f"the complete new output is {work}")) from e
    fsync_dir(out.parent)
    return stats, moved


def _kept(work: Path) -> str:
    """What a failed write leaves: the finished shards (resumable), or nothing (the partial folder removed)."""
    shards = sorted((work / "shards").glob("*.bts")) if work.is_dir() else []
    if not shards:
        shutil.rmtree(work, ignore_errors=True)
        return "nothing finished was kept (the partial output is removed)"
    size = sum(f.stat().st_size for f in work.rglob("*") if f.is_file())
    n = f"{len(shards)} finished shard" + ("s" if len(shards) > 1 else "")
    return (f"kept {n} ({size / 2**20:,.1f} MiB) in {work}: free space and re-run the same command to resume from "
            "there, or delete that folder to free the space")


def _build(cfg: PrepareConfig, work: Path, identity: str, status: _Status, t0: float) -> dict[str, Any]:
    """Both stages in `work`; returns the statistics, written last as work/stats.json."""
    workers = cfg.workers or os.cpu_count() or 1
    work.mkdir(parents=True, exist_ok=True)
    if (work / "stats.json").exists():  # a finished build that was not renamed (killed at the very end)
        (work / "stats.json").unlink()

    # One pool for both stages (the tokenize workers' state is built before forking; the static one in each
    # worker on its first static task).
    pool = _pool(workers, _init_tokenize_worker, (cfg.vocab_file, cfg.do_lower_case, cfg.corpus.min_document_chars,
                                                  token_dtype(len(read_vocab(cfg.vocab_file))).name))
    finished = False
    try:
        stage = _tokenize_stage(cfg, work, identity, pool, status)
        report = stage["report"]
        if not sum(s["n_tokens"] for s in stage["progress"]["shards"]):
            raise UserError(f"no text left in {cfg.inputs} after reading and cleaning: {report.summary()}")
        t_tok = time.perf_counter() - t0
        meta, heldout, num_instances = _after_tokenizing(cfg, work, identity, stage["progress"], pool, workers, status)
        report.documents = meta["num_documents"] + heldout["num_documents"]
        finished = True
    finally:
        _end_pool(pool, finished)
    seconds = time.perf_counter() - t0
    stats = {
        "num_documents": meta["num_documents"], "num_sentences": meta["num_sentences"],
        "num_tokens": meta["num_tokens"], "num_instances": num_instances, "num_shards": len(meta["shards"]),
        "input_bytes": report.input_bytes, "text_bytes": stage["text_bytes"],
        "replaced_characters": report.totals().get("replaced_characters", 0), "encoding": cfg.corpus.encoding,
        "seconds": round(seconds, 3), "seconds_tokenize": round(t_tok, 3), "workers": workers,
        "text_mb_per_s": round(stage["text_bytes"] / 1e6 / seconds, 3),
        "input_mb_per_s": round(report.input_bytes / 1e6 / seconds, 3),
        "tokens_per_s": round(meta["num_tokens"] / seconds, 1),
        "tokenizer_identity": identity, "masking": cfg.masking,
        "sample_config": sample_record(cfg.sample, cfg.seed) if cfg.masking == "static" else None,
        "dupe_factor": cfg.dupe_factor if cfg.masking == "static" else None,
        "inputs": list(cfg.inputs), "skipped": report.to_dict(), "heldout": heldout,
    }
    report.log(logger, where=f"{cfg.output}/stats.json")
    status.doing, status.needed = f"writing {work / 'stats.json'}", lambda: None
    (work / "progress.json").unlink(missing_ok=True)
    atomic_write_json(work / "stats.json", stats)  # marks the folder complete
    return stats


# ----------------------------------------------------------------------------------------------- add a held-out set

def add_heldout(data_dir: str | os.PathLike, heldout_fraction: float = 0.01, heldout_min_documents: int = 10,
                workers: int = 0) -> dict[str, Any]:
    """Give a store prepared without a held-out set (before held-out sets existed, or with heldout_fraction 0)
    one: `bertrain prepare --add-heldout DIR`. Returns (and writes) the new stats.json.

    The rule needs only the documents' token ids, so this is the split of a fresh `prepare` with these settings,
    applied to the store's own shards: the result has the same bytes as that fresh prepare (stats.json aside), and
    the inputs need not exist any more. It is built in DIR.partial from hard links of the old shards (copies on
    another file system: the split never writes into a file, it replaces it), with static instances rebuilt with
    the recorded settings (the old ones were built on the held-out documents too) and no blocks cache; then the
    old folder is moved aside to DIR.replaced-<time>, never deleted. Locked and resumable like `prepare`; a store
    that already has a held-out set, or a corpus too small for one, is refused."""
    t0 = time.perf_counter()
    out = Path(data_dir)
    work = out.with_name(out.name + ".partial")
    with OutputLock(out, "prepare"):
        meta = read_store_meta(out)
        current = heldout_status(out)
        if current.dir is not None:
            raise UserError(f"{out} already has a held-out set ({current.record.get('num_documents')} documents in "
                            f"{current.dir}); to change it, prepare the inputs again with --overwrite")
        old = json.loads((out / "stats.json").read_text(encoding="utf-8"))
        sample, seed = sample_from_record(old.get("sample_config"))
        cfg = PrepareConfig(inputs=list(old.get("inputs") or [str(out)]), output=str(out),
                            vocab_file=str(out / "vocab.txt"), sample=sample,
                            dupe_factor=old.get("dupe_factor") or 1, masking=old.get("masking", "none"), seed=seed,
                            do_lower_case=meta["do_lower_case"], workers=workers, heldout_fraction=heldout_fraction,
                            heldout_min_documents=heldout_min_documents)
        status = _Status(f"creating {work}")
        stats, moved = _build_in_place_of(out, work, status, lambda: _add_heldout_build(cfg, meta, old, work,
                                                                                        status, t0))
    logger.info("added a held-out set of %d documents to %s (the previous folder is %s)",
                stats["heldout"]["num_documents"], out, moved)
    return stats


def _no_worker_state() -> None:
    pass


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:  # another file system, or links not allowed
        shutil.copyfile(src, dst)


def _add_heldout_build(cfg: PrepareConfig, meta: dict[str, Any], old: dict[str, Any], work: Path, status: _Status,
                       t0: float) -> dict[str, Any]:
    out = Path(cfg.output)
    fp = {"add_heldout": str(out.absolute()), "tokenizer": meta["tokenizer_identity"],
          "shards": [[s["file"], s["crc32"]] for s in meta["shards"]],
          "heldout": [cfg.heldout_fraction, cfg.heldout_min_documents], "masking": cfg.masking}
    progress_path = work / "progress.json"
    work.mkdir(parents=True, exist_ok=True)
    (work / "stats.json").unlink(missing_ok=True)
    progress = _read_progress(progress_path)
    status.owns_partial = True
    if progress is None or progress.get("fingerprint") != fp:  # not ours: start afresh from the old shards
        shutil.rmtree(work)
        (work / "shards").mkdir(parents=True)
        status.doing = f"linking the shards of {out} into {work / 'shards'}"
        for s in meta["shards"]:
            _link_or_copy(out / "shards" / s["file"], work / "shards" / s["file"])
        progress = {"fingerprint": fp, "shards": meta["shards"]}
        atomic_write_json(progress_path, progress)
    else:
        logger.info("resuming %s", work)
    workers = cfg.workers or os.cpu_count() or 1
    pool = _pool(workers, _no_worker_state, ())  # (hashing and static tasks set up their own state)
    finished = False
    try:
        refusal = f"cannot add a held-out set to {out}"
        new, heldout, num_instances = _after_tokenizing(cfg, work, meta["tokenizer_identity"], progress, pool,
                                                        workers, status, refuse_none=refusal)
        finished = True
    finally:
        _end_pool(pool, finished)
    stats = {**old, **{k: new[k] for k in ("num_documents", "num_sentences", "num_tokens")},
             "num_instances": num_instances, "num_shards": len(new["shards"]), "heldout": heldout,
             "heldout_added": {"seconds": round(time.perf_counter() - t0, 3), "workers": workers}}
    status.doing, status.needed = f"writing {work / 'stats.json'}", lambda: None
    progress_path.unlink()
    atomic_write_json(work / "stats.json", stats)  # marks the folder complete
    return stats
