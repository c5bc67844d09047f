"""Pretraining samples from the token store: MLM + NSP (static / dynamic) or MLM-only packing, and the loader.

Samples follow google-research/bert's create_pretraining_data.py: `[CLS] A [SEP] B [SEP]`, B the actual next
segment or (50%) a segment of another document, pair truncation, `round(len * masked_lm_prob)` predictions capped
at `max_predictions_per_seq`, 80% `[MASK]` / 10% original / 10% random token, optional whole-word masking.

How we make that fast and replayable (the parts that differ from the reference, on purpose):

* **Blocks.** Each document's sentences are grouped greedily into *blocks* of about `max_seq_length - 3` tokens
  (a block's target is shorter with probability `short_seq_prob`, drawn per block rather than per document, keyed by
  the block's first sentence) once
  per (store, length, seed) and cached in the folder. A sample is built from one block: A is its first
  1..n-1 sentences, B the rest (IsNext), or B is taken from a random block of another document (random next).
* **Counter-based randomness.** Every random number of a sample is a hash (splitmix64) of
  (seed, epoch, block index, slot), not a draw from a sequential RNG. So sample `i` of epoch `e` is the same
  whichever process, worker or batch builds it, any epoch can be replayed exactly, and a whole batch is built with
  a handful of vectorised numpy operations (the reference's per-token Python loops run at ~0.24 MB/s).
* **Static = dynamic, materialised.** Static instance `d * n_blocks + j` is exactly dynamic sample `j` of epoch
  `d` (d < dupe_factor): the two modes share one code path and one test suite.
* **MLM-only packing** (`next_sentence=False`): blocks run over document boundaries, filling `max_seq_length - 2`
  tokens with whole sentences: `[CLS] sentences... [SEP]`, token types 0, `next_sentence_labels` -100.
* **Whole-word masking** picks words in random order and stops at the first word that no longer fits in the
  budget (the reference skips it and tries later words), so it can mask a few tokens fewer.
"""
from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass, asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Literal

import numpy as np

from bertrain.data.store import TokenStore, read_store_meta
from bertrain.utils.io import atomic_write_bytes, atomic_write_json

if TYPE_CHECKING:  # torch is imported where batches are made: `prepare` (and its workers) never need it
    import torch

logger = logging.getLogger(__name__)

Masking = Literal["static", "dynamic"]
NSP_NONE = 2  # stored code for "no NSP" (label -100)
ROW_HEADER = 4  # total_len, a_len (number of type-0 tokens), nsp code, n_predictions


# ----------------------------------------------------------------------------------------------- randomness

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser, elementwise on uint64 (wraps modulo 2**64 by design)."""
    with np.errstate(over="ignore"):
        x = x + _GOLDEN
        x = (x ^ (x >> np.uint64(30))) * _M1
        x = (x ^ (x >> np.uint64(27))) * _M2
        return x ^ (x >> np.uint64(31))


def sample_keys(seed: int, epoch: int, ids: np.ndarray) -> np.ndarray:
    """One 64-bit key per sample: a pure function of (seed, epoch, sample id)."""
    base = _mix(np.array([(seed & (2**64 - 1))], np.uint64))
    base = _mix(base ^ np.array([epoch & (2**64 - 1)], np.uint64))
    return _mix(base ^ ids.astype(np.uint64))


def _mix_inplace(x: np.ndarray) -> np.ndarray:
    """`_mix` without temporaries (x is overwritten and returned): the (n, T) masking keys are the builder's
    largest cost, and allocating fresh arrays per step doubled it (page faults)."""
    t = np.empty_like(x)
    with np.errstate(over="ignore"):
        x += _GOLDEN
        for shift, mult in ((30, _M1), (27, _M2)):
            np.right_shift(x, np.uint64(shift), out=t)
            x ^= t
            x *= mult
        np.right_shift(x, np.uint64(31), out=t)
        x ^= t
    return x


def _uniform_bits(keys: np.ndarray, slot: np.ndarray) -> np.ndarray:
    """(n, T) uint64 in [0, 2**53): the integers behind `_uniform(keys, slot)` (same order, no float pass)."""
    with np.errstate(over="ignore"):
        s = _mix(np.asarray(slot, dtype=np.uint64) * _GOLDEN + np.uint64(0x632BE59BD9B4E019))
    x = np.bitwise_xor(keys[:, None], s[None, :])
    _mix_inplace(x)
    x >>= np.uint64(11)
    return x


def _uniform(keys: np.ndarray, slot: int | np.ndarray) -> np.ndarray:
    """Uniform [0, 1) doubles for (key, slot): keys (n,) with slot int -> (n,); with slot array (T,) -> (n, T)."""
    if np.ndim(slot):
        return _uniform_bits(keys, slot).astype(np.float64) * (1.0 / (1 << 53))
    with np.errstate(over="ignore"):
        s = _mix(np.asarray(slot, dtype=np.uint64) * _GOLDEN + np.uint64(0x632BE59BD9B4E019))
    x = _mix(keys ^ s)
    return (x >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


# ----------------------------------------------------------------------------------------------- config

@dataclass(frozen=True)
class SampleConfig:
    """What a sample is; recorded with static instances and checked when they are loaded."""

    max_seq_length: int = 128
    max_predictions_per_seq: int = 20
    masked_lm_prob: float = 0.15
    short_seq_prob: float = 0.1
    whole_word_masking: bool = False
    next_sentence: bool = True
    seed: int = 12345

    def __post_init__(self) -> None:
        if not 8 <= self.max_seq_length <= 65535:
            raise ValueError(f"max_seq_length must be in [8, 65535], got {self.max_seq_length}")
        if not 1 <= self.max_predictions_per_seq <= self.max_seq_length:
            raise ValueError(f"max_predictions_per_seq must be in [1, max_seq_length], got {self.max_predictions_per_seq}")
        if not 0.0 < self.masked_lm_prob < 1.0:
            raise ValueError(f"masked_lm_prob must be in (0, 1), got {self.masked_lm_prob}")
        if not 0.0 <= self.short_seq_prob <= 1.0:
            raise ValueError(f"short_seq_prob must be in [0, 1], got {self.short_seq_prob}")


# ----------------------------------------------------------------------------------------------- blocks

_BLOCK_DOMAIN = (1 << 63) | 0xB10C  # the "epoch" of block-target keys: no real epoch reaches it


def build_blocks(store: TokenStore, cfg: SampleConfig) -> np.ndarray:
    """Group sentences into blocks: int64 array (n_blocks, 3) of [first sentence, end sentence, document].

    Greedy like the reference: add sentences until the block reaches its target length or the document ends.
    With `next_sentence=False` blocks run across documents (packing). Deterministic in (store, cfg.seed).

    Vectorised: a block's target is keyed by its first sentence (a counter-based draw, like every other random
    number here), so the end of a block that *would* start at any sentence is one `searchsorted` on the token
    offsets for all sentences at once; the blocks are then the chain of those ends from each document's start
    (followed for all documents at once) or, when packing, from sentence 0 (a list walk, ~0.1 us per block). The
    Python loop over sentences this replaces was a serial ~8 ms per MB of text in `prepare`, between its two
    parallel stages.
    """
    cum = np.asarray(store.sentence_starts, dtype=np.int64)  # token offset of each sentence, and the end
    n_sent = len(cum) - 1
    if n_sent == 0:
        return np.zeros((0, 3), np.int64)
    max_tokens = cfg.max_seq_length - (3 if cfg.next_sentence else 2)
    start = np.arange(n_sent)
    keys = sample_keys(cfg.seed, _BLOCK_DOMAIN, start)
    short_len = 2 + np.floor(_uniform(keys, 1) * (max_tokens - 1)).astype(np.int64)  # randint(2, max_tokens)
    target = np.where(_uniform(keys, 0) < cfg.short_seq_prob, short_len, max_tokens)
    doc_starts = np.asarray(store.document_starts, dtype=np.int64)
    doc_of = np.repeat(np.arange(len(doc_starts) - 1), np.diff(doc_starts))
    if cfg.next_sentence:
        # Sentences are added until the total reaches the target (sentence lengths are >= 1, so the first index
        # whose offset reaches start + target is past `start`), or the document ends.
        end = np.minimum(np.searchsorted(cum, cum[:-1] + target, side="left"), doc_starts[doc_of + 1])
    else:
        # Whole sentences while they fit (at least one), across documents.
        end = np.maximum(start + 1, np.searchsorted(cum, cum[:-1] + target, side="right") - 1)
    if cfg.next_sentence:  # every document starts a chain: follow all documents' chains together
        doc_end = doc_starts[1:]
        parts = []
        head, stop = doc_starts[:-1], doc_end
        while len(head):
            parts.append(head)
            head = end[head]
            live = head < stop
            head, stop = head[live], stop[live]
        first = np.sort(np.concatenate(parts)) if parts else np.zeros(0, np.int64)
    else:  # one chain over the whole corpus
        nxt = end.tolist()
        firsts = []
        s = 0
        while s < n_sent:
            firsts.append(s)
            s = nxt[s]
        first = np.asarray(firsts, dtype=np.int64)
    return np.stack([first, end[first], doc_of[first]], axis=1)


def load_blocks(store: TokenStore, cfg: SampleConfig) -> np.ndarray:
    """`build_blocks`, cached in the prepared folder (atomic write; rebuilt if missing or unreadable)."""
    name = (f"blocks-v2-s{cfg.max_seq_length}-short{cfg.short_seq_prob:g}-"
            f"{'nsp' if cfg.next_sentence else 'packed'}-seed{cfg.seed}.npy")
    path = store.dir / "cache" / name
    if path.is_file():
        try:
            blocks = np.load(path)
            if blocks.ndim == 2 and blocks.shape[1] == 3 and (len(blocks) == 0 or blocks[-1, 1] == store.num_sentences):
                return blocks
        except (OSError, ValueError):
            pass
        logger.warning("cache %s is unreadable; rebuilding it", path)
    blocks = build_blocks(store, cfg)
    import io

    buf = io.BytesIO()
    np.save(buf, blocks)
    try:
        atomic_write_bytes(path, buf.getvalue())
    except OSError as e:  # a read-only data folder still works, only slower to open
        logger.warning("cannot cache blocks in %s: %s", path, e)
    return blocks


# ----------------------------------------------------------------------------------------------- instances

class InstanceBuilder:
    """Builds fixed-width instance rows for (epoch, block ids), vectorised over the whole batch.

    A row is `[total_len, a_len, nsp_code, n_pred, ids (T), positions (P), labels (P)]` (int64 here; stored as
    uint16/uint32 for static instances): `ids` already carry the masking.
    """

    def __init__(self, store: TokenStore, cfg: SampleConfig, vocab: list[str] | None = None,
                 special_ids: dict[str, int] | None = None):
        self.store = store
        self.cfg = cfg
        self.blocks = load_blocks(store, cfg)
        meta = store.meta
        self.special = special_ids or meta["special_ids"]
        self.vocab_size = int(meta["vocab_size"])
        self.is_subword = np.zeros(self.vocab_size + 1, bool)
        if cfg.whole_word_masking:
            self.is_subword[np.asarray(meta["subword_ids"], dtype=np.int64)] = True
        docs = self.blocks[:, 2]
        n_docs = store.num_documents
        # First block of each document and its count: to draw a random block from *another* document.
        self.doc_first_block = np.searchsorted(docs, np.arange(n_docs + 1))
        self.n_blocks = len(self.blocks)

    @property
    def row_width(self) -> int:
        return ROW_HEADER + self.cfg.max_seq_length + 2 * self.cfg.max_predictions_per_seq

    def build(self, epoch: int, block_ids: np.ndarray, dtype: np.dtype = np.dtype(np.int64)) -> np.ndarray:
        """Rows for (epoch, block ids). `dtype`: the rows' integer type (static instances are built straight in
        their stored uint16/uint32, which also halves the builder's memory traffic; the values are the same)."""
        cfg = self.cfg
        T, P = cfg.max_seq_length, cfg.max_predictions_per_seq
        ids = np.asarray(block_ids, dtype=np.int64)
        n = len(ids)
        keys = sample_keys(cfg.seed, epoch, ids)
        ss = self.store.sentence_starts
        first, end, doc = self.blocks[ids, 0], self.blocks[ids, 1], self.blocks[ids, 2]
        n_sent = end - first
        block_start, block_end = ss[first], ss[end]

        if cfg.next_sentence:
            max_tokens = T - 3
            # A = sentences [first, first + a_sents); a_sents uniform in 1..n-1 (or the single sentence).
            a_sents = np.where(n_sent >= 2, 1 + np.floor(_uniform(keys, 1) * np.maximum(n_sent - 1, 1)), 1).astype(np.int64)
            a_start, a_end = block_start, ss[first + a_sents]
            single_doc = self.store.num_documents < 2
            random_next = (n_sent == 1) | (_uniform(keys, 2) < 0.5)
            if single_doc:
                random_next &= n_sent == 1
            # Random block of another document: uniform over the blocks not in `doc`, by index shifting.
            dfirst, dlast = self.doc_first_block[doc], self.doc_first_block[doc + 1]
            others = self.n_blocks - (dlast - dfirst) if not single_doc else np.full(n, self.n_blocks)
            r = np.floor(_uniform(keys, 3) * np.maximum(others, 1)).astype(np.int64)
            if not single_doc:
                r = np.where(r >= dfirst, r + (dlast - dfirst), r)
            r = np.minimum(r, self.n_blocks - 1)
            rf, re_ = self.blocks[r, 0], self.blocks[r, 1]
            r_sent = rf + np.floor(_uniform(keys, 4) * (re_ - rf)).astype(np.int64)
            r_doc_end = ss[self.store.document_starts[self.blocks[r, 2] + 1]]
            # Reference: target_b = target - len(A); the block's own length stands in for its target.
            target_b = np.maximum(block_end - block_start - (a_end - a_start), 1)
            rb_start = ss[r_sent]
            rb_end = np.minimum(r_doc_end, rb_start + np.maximum(target_b, 1))
            b_start = np.where(random_next, rb_start, a_end)
            b_end = np.where(random_next, rb_end, block_end)
            la, lb = a_end - a_start, b_end - b_start
            # Pair truncation (reference: drop one token from the longer side, front or back at random, until it
            # fits). Final lengths in closed form; the front share of the removed tokens is Binomial(k, 1/2).
            excess = np.maximum(la + lb - max_tokens, 0)
            diff = np.abs(la - lb)
            from_longer = np.minimum(excess, diff)
            rest = excess - from_longer
            cut_a = np.where(la > lb, from_longer, 0) + rest // 2
            cut_b = np.where(la > lb, 0, from_longer) + rest - rest // 2
            front_a = _binomial_half(keys, 5, cut_a)
            front_b = _binomial_half(keys, 6, cut_b)
            a_start, a_end = a_start + front_a, a_end - (cut_a - front_a)
            b_start, b_end = b_start + front_b, b_end - (cut_b - front_b)
            la, lb = a_end - a_start, b_end - b_start
            total = la + lb + 3
            nsp = random_next.astype(np.int64)
            a_len = la + 2
        else:
            max_tokens = T - 2
            a_start, a_end = block_start, np.minimum(block_end, block_start + max_tokens)
            la = a_end - a_start
            lb = np.zeros(n, np.int64)
            b_start = a_end
            total = la + 2
            nsp = np.full(n, NSP_NONE, np.int64)
            a_len = total

        # The (n, T) grid work below is most of the builder's time and scales with the grid's width, while short
        # documents give short rows (Tiny Shakespeare: median 27 of 128 tokens). So rows are grouped by length
        # class and each group is built on a grid just wide enough. The result does not depend on the grouping:
        # every random number is keyed by (sample, slot) and positions >= total are never candidates.
        rows = np.empty((n, self.row_width), dtype)
        widths = [w for w in (32, 64) if w < T] + [T]
        cls = np.searchsorted(widths, total) if n >= 256 else np.full(n, len(widths) - 1)
        for c, W in enumerate(widths):
            sel = np.flatnonzero(cls == c)
            if len(sel) == n:
                self._grid(rows, W, keys, a_start, la, b_start, total, a_len, nsp)
            elif len(sel):
                sub = np.empty((len(sel), self.row_width), dtype)
                self._grid(sub, W, keys[sel], a_start[sel], la[sel], b_start[sel], total[sel], a_len[sel], nsp[sel])
                rows[sel] = sub
        return rows

    def _grid(self, rows: np.ndarray, W: int, keys: np.ndarray, a_start: np.ndarray, la: np.ndarray,
              b_start: np.ndarray, total: np.ndarray, a_len: np.ndarray, nsp: np.ndarray) -> None:
        """Fill `rows` (n, row_width) for samples whose `total` length is <= W."""
        cfg = self.cfg
        T, P = cfg.max_seq_length, cfg.max_predictions_per_seq
        n = len(keys)
        # Assemble [CLS] A [SEP] B [SEP] on an (n, W) grid by gathering: position p of A reads a_start + p - 1,
        # of B b_start + p - la - 2; everything else (CLS, SEPs, padding) reads a clipped dummy and is overwritten.
        # Written in place into the output rows.
        pos = np.arange(W)[None, :]
        candidate = (pos >= 1) & (pos <= la[:, None])  # in A
        src = np.add(a_start[:, None] - 1, pos)
        if cfg.next_sentence:
            in_b = (pos >= la[:, None] + 2) & (pos < total[:, None] - 1)
            src += in_b * (b_start - a_start - la - 1)[:, None]
            candidate |= in_b
        np.clip(src, 0, max(self.store.num_tokens - 1, 0), out=src)
        rows[:, ROW_HEADER + W: ROW_HEADER + T] = self.special["[PAD]"]
        tokens = rows[:, ROW_HEADER: ROW_HEADER + W]
        np.copyto(tokens, self.store.tokens_at(src, tokens.dtype))
        tokens[~candidate] = self.special["[PAD]"]
        tokens[:, 0] = self.special["[CLS]"]
        rows_idx = np.arange(n)
        if cfg.next_sentence:
            tokens[rows_idx, la + 1] = self.special["[SEP]"]
        tokens[rows_idx, total - 1] = self.special["[SEP]"]

        positions, n_pred = self._choose_masked(keys, tokens, candidate, total)
        labels = np.take_along_axis(tokens, positions, axis=1)
        valid = np.arange(P)[None, :] < n_pred[:, None]
        positions = np.where(valid, positions, 0)
        labels = np.where(valid, labels, 0)
        # 80% [MASK], 10% keep, 10% random token of the vocabulary (like the reference, any id).
        u = _uniform(keys, np.arange(2 * T + 100, 2 * T + 100 + P))
        ur = _uniform(keys, np.arange(3 * T + 200, 3 * T + 200 + P))
        rand_tok = np.minimum(np.floor(ur * self.vocab_size).astype(np.int64), self.vocab_size - 1)
        replacement = np.where(u < 0.8, self.special["[MASK]"], np.where(u < 0.9, labels, rand_tok))
        r_idx = np.broadcast_to(rows_idx[:, None], positions.shape)
        tokens[r_idx[valid], positions[valid]] = replacement[valid]  # labels were copied out above

        rows[:, 0], rows[:, 1], rows[:, 2], rows[:, 3] = total, a_len, nsp, n_pred
        rows[:, ROW_HEADER + T: ROW_HEADER + T + P] = positions
        rows[:, ROW_HEADER + T + P:] = labels

    def _choose_masked(self, keys: np.ndarray, tokens: np.ndarray, candidate: np.ndarray,
                       total: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Sorted masked positions (n, P) (garbage beyond n_pred) and n_pred (n,)."""
        cfg = self.cfg
        n, T = tokens.shape
        P = cfg.max_predictions_per_seq
        n_cand = candidate.sum(1)
        # Python's round() (the reference) and np.round both round half to even.
        n_pred = np.minimum(np.minimum(P, np.maximum(1, np.round(total * cfg.masked_lm_prob).astype(np.int64))), n_cand)
        # Integer keys: the same order as the uniform doubles they stand for; 2**53 (> any key) = not a candidate.
        key = _uniform_bits(keys, np.arange(cfg.max_seq_length, cfg.max_seq_length + T))  # T: the grid's width
        never = np.uint64(1 << 53)
        if cfg.whole_word_masking:
            pos = np.arange(T)[None, :]
            starts = candidate & ~self.is_subword[tokens]
            starts[:, 0] = False
            word_start = np.maximum.accumulate(np.where(starts | ~candidate, pos, 0), axis=1)
            key = np.take_along_axis(key, word_start, axis=1)  # every token of a word shares its start's key
            key[~candidate] = never
            order = np.argsort(key, axis=1, kind="stable")  # words contiguous and in position order
            ws_sorted = np.take_along_axis(word_start, order, axis=1)
            last_of_word = np.ones((n, T), bool)
            last_of_word[:, :-1] = ws_sorted[:, 1:] != ws_sorted[:, :-1]
            # A word is taken iff its last token ranks below n_pred (ranks count tokens of earlier words).
            rank = np.arange(T)[None, :]
            end_rank = np.where(last_of_word, rank, T)
            end_rank = np.minimum.accumulate(end_rank[:, ::-1], axis=1)[:, ::-1]
            take = (end_rank < n_pred[:, None]) & np.take_along_axis(candidate, order, axis=1)
            n_pred = take.sum(1)
            chosen = np.where(take, order, T)
        else:
            return _smallest_keys(key, candidate, n_pred, P), n_pred
        chosen = np.sort(chosen, axis=1)[:, :P]
        if chosen.shape[1] < P:
            chosen = np.pad(chosen, ((0, 0), (0, P - chosen.shape[1])), constant_values=T)
        return np.where(chosen >= T, 0, chosen), n_pred


def _smallest_keys(key: np.ndarray, candidate: np.ndarray, n_pred: np.ndarray, P: int) -> np.ndarray:
    """Per row, the positions of the `n_pred` smallest keys among the candidates, ascending, padded with 0 to
    (n, P). Same result as sorting each row (keys are uniform 53-bit integers), ~4x cheaper: only keys below a
    per-row threshold that keeps ~n_pred + 2 sigma of them are sorted, in one flat sort of (row, key); a row where
    too few pass (rare) is redone with a full sort."""
    n, T = key.shape
    m = candidate.sum(1)
    q = np.minimum(1.0, (n_pred + 2 * np.sqrt(n_pred) + 1) / np.maximum(m, 1))
    thr = np.minimum(q * float(1 << 53), float(1 << 53)).astype(np.uint64)
    passed = candidate & (key < thr[:, None])
    short = np.flatnonzero(passed.sum(1) < n_pred)
    if len(short):
        passed[short] = candidate[short]
    flat = np.flatnonzero(passed)
    row = flat // T
    order = np.argsort((row.astype(np.uint64) << np.uint64(53)) | key.ravel()[flat]) if n < 2048 else \
        np.lexsort((key.ravel()[flat], row))
    row_sorted = row[order]
    starts = np.searchsorted(row_sorted, np.arange(n))
    take = np.arange(len(order)) - starts[row_sorted] < n_pred[row_sorted]
    chosen = np.sort(flat[order[take]])  # row-major: by row, then by position
    crow = chosen // T
    out = np.zeros((n, P), np.int64)
    out[crow, np.arange(len(chosen)) - np.searchsorted(crow, np.arange(n))[crow]] = chosen - crow * T
    return out


def _binomial_half(keys: np.ndarray, slot: int, k: np.ndarray) -> np.ndarray:
    """Binomial(k, 1/2) per sample from the key: popcount of k hashed bits (normal approximation beyond 64)."""
    h = _mix(keys ^ _mix(np.full(len(keys), slot, np.uint64) * _GOLDEN))
    kk = np.minimum(k, 64).astype(np.uint64)
    mask = np.where(kk >= 64, np.uint64(2**64 - 1), (np.uint64(1) << np.minimum(kk, 63)) - np.uint64(1))
    small = np.bitwise_count(h & mask).astype(np.int64)
    big = np.clip(np.round(k / 2 + np.sqrt(np.maximum(k, 1)) / 2 * (_uniform(keys, slot + 1000) * 2 - 1) * 1.7),
                  0, k).astype(np.int64)
    return np.where(k <= 64, small, big)


def rows_to_batch(rows: np.ndarray, cfg: SampleConfig) -> dict[str, torch.Tensor]:
    """Instance rows -> the batch dict of ARCHITECTURE.md ("Pretraining batches")."""
    import torch

    T, P = cfg.max_seq_length, cfg.max_predictions_per_seq
    rows = rows.astype(np.int64, copy=False)
    total, a_len, nsp, n_pred = rows[:, 0], rows[:, 1], rows[:, 2], rows[:, 3]
    pos = np.arange(T)[None, :]
    attention = pos < total[:, None]
    types = (pos >= a_len[:, None]) & attention
    labels = rows[:, ROW_HEADER + T + P:].copy()
    labels[np.arange(P)[None, :] >= n_pred[:, None]] = -100
    return {
        "input_ids": torch.from_numpy(np.ascontiguousarray(rows[:, ROW_HEADER: ROW_HEADER + T])),
        "token_type_ids": torch.from_numpy(types.astype(np.int64)),
        "attention_mask": torch.from_numpy(attention.astype(np.int64)),
        "masked_positions": torch.from_numpy(np.ascontiguousarray(rows[:, ROW_HEADER + T: ROW_HEADER + T + P])),
        "masked_labels": torch.from_numpy(labels),
        "next_sentence_labels": torch.from_numpy(np.where(nsp == NSP_NONE, -100, nsp)),
    }


# ----------------------------------------------------------------------------------------------- static files

def static_dir_name(cfg: SampleConfig, dupe_factor: int) -> str:
    return (f"static-s{cfg.max_seq_length}-p{cfg.max_predictions_per_seq}-m{cfg.masked_lm_prob:g}"
            f"-short{cfg.short_seq_prob:g}-{'wwm-' if cfg.whole_word_masking else ''}"
            f"{'nsp' if cfg.next_sentence else 'packed'}-d{dupe_factor}-seed{cfg.seed}")


def find_static(data_dir: Path, cfg: SampleConfig) -> tuple[Path, dict]:
    """The static-instance folder matching `cfg` (any dupe factor), or a `ValueError` listing what exists."""
    found = []
    for meta_path in sorted(data_dir.glob("static-*/instances.json")):
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        found.append(meta_path.parent.name)
        if SampleConfig(**meta["sample_config"]) == cfg:
            return meta_path.parent, meta
    raise ValueError(
        f"{data_dir} has no static instances for {cfg} (present: {found or 'none'}); run `bertrain prepare "
        f"--masking static` with these settings, or use masking='dynamic'")


# ----------------------------------------------------------------------------------------------- dataset

class PretrainingDataset:
    """Samples of a prepared folder. `len(ds)` samples per epoch; `get_batch(epoch, sample_ids)` -> batch dict.

    masking='dynamic': sample `i` of epoch `e` is block `i` built and masked with keys (seed, e, i).
    masking='static': sample `i` is the materialised instance `i` (dupe_factor x blocks); `epoch` is ignored.
    Picklable (memory maps are reopened lazily), so it works in DataLoader workers.
    """

    def __init__(self, data_dir: str | os.PathLike, max_seq_length: int = 128, max_predictions_per_seq: int = 20,
                 masking: Masking = "dynamic", seed: int = 12345, masked_lm_prob: float = 0.15,
                 short_seq_prob: float = 0.1, whole_word_masking: bool = False, next_sentence: bool = True,
                 verify: bool = True):
        if masking not in ("static", "dynamic"):
            raise ValueError(f"masking must be 'static' or 'dynamic', got {masking!r}")
        self.data_dir = Path(data_dir)
        self.masking = masking
        self.cfg = SampleConfig(max_seq_length, max_predictions_per_seq, masked_lm_prob, short_seq_prob,
                                whole_word_masking, next_sentence, seed)
        self.meta = read_store_meta(self.data_dir)
        self.tokenizer_identity: str = self.meta["tokenizer_identity"]
        self._verify = verify
        self._store: TokenStore | None = None
        self._builder: InstanceBuilder | None = None
        self._rows: np.ndarray | None = None
        if masking == "static":
            self.static_dir, smeta = find_static(self.data_dir, self.cfg)
            self._len = int(smeta["num_instances"])
        else:
            self._len = len(self._get_builder().blocks)
        if self._len == 0:
            raise ValueError(f"{self.data_dir} yields no samples for {self.cfg} (is the corpus empty?)")

    def __len__(self) -> int:
        return self._len

    def _get_builder(self) -> InstanceBuilder:
        if self._builder is None:
            self._store = TokenStore(self.data_dir, verify=self._verify)
            self._verify = False  # checked once per process
            self._builder = InstanceBuilder(self._store, self.cfg)
        return self._builder

    def _get_rows(self) -> np.ndarray:
        if self._rows is None:
            smeta = json.loads((self.static_dir / "instances.json").read_text(encoding="utf-8"))
            self._rows = open_instances(self.static_dir / "instances.bin", smeta)
        return self._rows

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_store"] = state["_builder"] = state["_rows"] = None
        return state

    def get_rows(self, epoch: int, sample_ids: np.ndarray) -> np.ndarray:
        sample_ids = np.asarray(sample_ids, dtype=np.int64)
        if self.masking == "static":
            return np.asarray(self._get_rows()[sample_ids], dtype=np.int64)
        return self._get_builder().build(epoch, sample_ids)

    def get_batch(self, epoch: int, sample_ids: np.ndarray) -> dict[str, torch.Tensor]:
        return rows_to_batch(self.get_rows(epoch, sample_ids), self.cfg)

    def check_tokenizer(self, vocab_file: str | os.PathLike, do_lower_case: bool) -> None:
        """Raise `ValueError` unless the data was tokenized with `vocab_file` and this casing."""
        from bertrain.data.tokenizer import check_tokenizer_identity

        check_tokenizer_identity(self.tokenizer_identity, vocab_file, do_lower_case, str(self.data_dir))


def open_instances(path: Path, meta: dict) -> np.ndarray:
    """Memory-map static instance rows, checking the size promised by instances.json."""
    dtype = np.dtype(meta["dtype"])
    shape = (int(meta["num_instances"]), int(meta["row_width"]))
    expected = shape[0] * shape[1] * dtype.itemsize
    if not path.is_file() or path.stat().st_size != expected:
        size = path.stat().st_size if path.is_file() else "missing"
        raise ValueError(f"corrupt static instances {path}: {size} bytes, expected {expected} "
                         f"(re-run prepare with --overwrite)")
    if shape[0] == 0:
        return np.zeros(shape, dtype)
    return np.memmap(path, dtype=dtype, mode="r", shape=shape)


# ----------------------------------------------------------------------------------------------- loader

class _BatchFetcher:
    """Map-style adapter for torch's DataLoader: item = (epoch, sample ids) -> batch dict (built in workers)."""

    def __init__(self, ds: PretrainingDataset):
        self.ds = ds

    def __len__(self) -> int:  # not used for sampling (we pass our own sampler)
        return len(self.ds)

    def __getitem__(self, item: tuple[int, np.ndarray]) -> dict[str, torch.Tensor]:
        epoch, ids = item
        return self.ds.get_batch(epoch, ids)


class PretrainingLoader:
    """Distributed, resumable micro-batch loader over a `PretrainingDataset`.

    The epoch's global order is `permutation(len(ds))` seeded by (seed, epoch). Micro-batch `m` of rank `r`
    (world size `W`, micro-batch `b`) holds global positions `[(m*W + r)*b, (m*W + r + 1)*b)`. Every rank gets
    `len(self)` micro-batches: with `drop_last` the tail that does not fill `b*W` is dropped, otherwise the order
    wraps around to its start to fill it (never a hang, never unequal counts).

    Iterating runs from the current position to the end of the epoch, then advances to the next epoch.
    `state_dict()` = {epoch, samples consumed (global), seed}; `load_state_dict` accepts a state saved under any
    world size as long as the consumed count is a multiple of the new `b*W` (true at optimizer-step boundaries
    when the global batch is unchanged).
    """

    def __init__(self, dataset: PretrainingDataset, micro_batch_size: int, rank: int = 0, world_size: int = 1,
                 seed: int = 12345, num_workers: int = 0, drop_last: bool = True, prefetch_factor: int = 2):
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world size {world_size}")
        self.ds = dataset
        self.b, self.rank, self.world = micro_batch_size, rank, world_size
        self.seed, self.num_workers, self.drop_last = seed, num_workers, drop_last
        self.prefetch_factor = prefetch_factor
        per_step = self.b * self.world
        n = len(dataset)
        self._steps = n // per_step if drop_last else math.ceil(n / per_step)
        if self._steps == 0:
            raise ValueError(f"{n} samples are fewer than one global micro-batch ({self.b} x {self.world} ranks); "
                             f"use a smaller micro batch, fewer ranks, drop_last=False, or more data")
        self.epoch = 0
        self.consumed = 0  # global samples consumed in the current epoch

    def __len__(self) -> int:
        """Micro-batches per rank per epoch."""
        return self._steps

    def set_epoch(self, epoch: int) -> None:
        """Jump to the start of `epoch` (no-op if already in it, so a resumed position is kept)."""
        if epoch != self.epoch:
            self.epoch, self.consumed = epoch, 0

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The global order of sample ids in `epoch` (a pure function of seed and epoch)."""
        return np.random.default_rng([self.seed, epoch, 0x10AD]).permutation(len(self.ds))

    def _rank_batches(self, epoch: int, start_step: int) -> Iterator[tuple[int, np.ndarray]]:
        order = self.epoch_order(epoch)
        per_step = self.b * self.world
        need = self._steps * per_step
        if need > len(order):  # wrap around to fill the last global micro-batch
            order = np.concatenate([order, order[: need - len(order)]])
        for m in range(start_step, self._steps):
            lo = (m * self.world + self.rank) * self.b
            yield epoch, order[lo: lo + self.b]

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        per_step = self.b * self.world
        start = self.consumed // per_step
        epoch = self.epoch
        items = list(self._rank_batches(epoch, start)) if self.num_workers > 0 else self._rank_batches(epoch, start)
        if self.num_workers > 0:
            import torch

            dl = torch.utils.data.DataLoader(_BatchFetcher(self.ds), batch_size=None, sampler=items,
                                             num_workers=self.num_workers, prefetch_factor=self.prefetch_factor,
                                             multiprocessing_context="spawn" if os.name != "posix" else None)
            it = iter(dl)
        else:
            it = (self.ds.get_batch(e, ids) for e, ids in items)
        for batch in it:
            self.consumed += per_step
            yield batch
        if self.epoch == epoch and self.consumed >= self._steps * per_step:
            self.epoch, self.consumed = epoch + 1, 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "samples_consumed": self.consumed, "seed": self.seed,
                "num_samples": len(self.ds)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        per_step = self.b * self.world
        if state.get("seed", self.seed) != self.seed:
            raise ValueError(f"loader state was saved with seed {state['seed']}, this loader uses {self.seed}")
        if state.get("num_samples", len(self.ds)) != len(self.ds):
            raise ValueError(f"loader state was saved for {state['num_samples']} samples per epoch, this dataset "
                             f"has {len(self.ds)}: it is a different prepared dataset or sample config")
        consumed = int(state["samples_consumed"])
        if consumed % per_step:
            raise ValueError(f"cannot resume at {consumed} consumed samples with {self.world} ranks x micro batch "
                             f"{self.b}: not a multiple of {per_step} (keep the global batch size when resuming)")
        self.epoch, self.consumed = int(state["epoch"]), consumed


def write_static_meta(out_dir: Path, cfg: SampleConfig, dupe_factor: int, num_instances: int, row_width: int,
                      dtype: np.dtype, seconds: float) -> None:
    atomic_write_json(out_dir / "instances.json", {
        "sample_config": asdict(cfg), "dupe_factor": dupe_factor, "num_instances": num_instances,
        "row_width": row_width, "dtype": np.dtype(dtype).name,  # no timings: same inputs, same bytes
    })
