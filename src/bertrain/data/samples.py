"""Pretraining samples from the token store: MLM + NSP (static / dynamic) or MLM-only packing, as instance rows.

Samples follow google-research/bert's create_pretraining_data.py: `[CLS] A [SEP] B [SEP]`, B the actual next
segment or (50%) a segment of another document, pair truncation, `round(len * masked_lm_prob)` predictions capped
at `max_predictions_per_seq`, 80% `[MASK]` / 10% original / 10% random token, optional whole-word masking.

How we make that fast and replayable (the parts that differ from the reference, on purpose):

* **Blocks.** Each document's sentences are grouped greedily into *blocks* of about `max_seq_length - 3` tokens
  (a block's target is shorter with probability `short_seq_prob`, drawn per block rather than per document, keyed by
  the block's first sentence) once per (store, length, seed) and cached in the folder. A sample is built from one
  block: A is its first 1..n-1 sentences, B the rest (IsNext), or B is taken from a random block of another
  document (random next: whole sentences from a random sentence of that block until B reaches the block's target
  minus len(A), as the reference). The reference draws the random document uniformly over documents, we over
  blocks; and it "puts back" the unused rest of a random-next block to start the next one, we do not (fixed
  blocks): an epoch has fewer samples than a reference pass (4230 vs ~5650 on the Wikipedia sample, 7328 vs ~8560
  on Tiny Shakespeare) and uses ~65% of the corpus's tokens as A or IsNext B (the reference ~89%); other epochs
  split the blocks differently, so every token still serves over a few epochs.
* **Counter-based randomness.** Every random number of a sample is a hash (splitmix64) of
  (seed, epoch, block index, slot), not a draw from a sequential RNG. So sample `i` of epoch `e` is the same
  whichever process, worker or batch builds it, any epoch can be replayed exactly, and a whole batch is built with
  a handful of vectorised numpy operations (the reference's per-token Python loops run at ~0.24 MB/s).
* **Static = dynamic, materialised.** Static instance `d * n_blocks + j` is exactly dynamic sample `j` of epoch
  `d` (d < dupe_factor): the two modes share one code path and one test suite. Static instances live in
  `DIR/static-.../` (`instances.bin` rows + `instances.json`, which records the sample settings and seed).
* **MLM-only packing** (`next_sentence=False`): blocks run over document boundaries: `[CLS] tokens... [SEP]`,
  token types 0, `next_sentence_labels` -100. The packed stream is the corpus's tokens with one `[SEP]` between two
  documents (`document_separator`, the default; none after the last document), as RoBERTa's FULL-SENTENCES ("add
  an extra separator token between documents") and HF run_mlm's group_texts (every text `[CLS] ... [SEP]`) mark
  them: a row that crosses documents reads `[CLS] ...end of one [SEP] start of the next... [SEP]`. A separator
  takes a slot of the block, is never a masking candidate and is not counted in `round(len * masked_lm_prob)`;
  one that falls on a block's first or last slot is left out (the row's `[CLS]` / final `[SEP]` marks that
  boundary: never `[CLS] [SEP]` nor `[SEP] [SEP]`, so such a block is a slot short). Stream positions map to
  tokens with one `searchsorted` over the separators' positions (`document_boundaries`, `stream_separators`), so
  the builder stays vectorised; `document_separator=False` gives the rows of before, documents unmarked (old
  static records read so). By default (`split_sentences`) a block is the next `max_seq_length - 2` positions of
  the stream, cutting a sentence where the block ends, as group_texts and FULL-SENTENCES do: every block is full
  (but the last, the short-target ones and those that lose an edge separator). `split_sentences=False` packs whole
  sentences only, which left ~19% of the slots empty on the shipped corpora (BENCHMARKS.md, packing): with
  unpadding empty slots cost little time, but each step then learns from that many fewer tokens.
* **Whole-word masking** picks words in random order and, as the reference, skips a word that no longer fits in the
  budget and tries later ones (a loop over words, vectorised over the samples).

numpy only (no torch): `prepare` and its workers build and write instances with it; `bertrain.data.pretraining`
turns rows into training batches.
"""
from __future__ import annotations

import array
import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bertrain.data.store import TokenStore, cache_lock, save_npy_atomic
from bertrain.utils.io import atomic_write_json

logger = logging.getLogger(__name__)

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

@dataclass
class SampleConfig:
    """What a pretraining sample is (the seed is passed beside it); recorded with static instances and checked
    when they are loaded."""

    max_seq_length: int = 128
    """Tokens per sample, [CLS] and [SEP]s included."""
    max_predictions_per_seq: int = 20
    """Most masked positions per sample."""
    masked_lm_prob: float = 0.15
    """Fraction of a sample's tokens to mask (at least 1, at most max_predictions_per_seq)."""
    short_seq_prob: float = 0.1
    """Probability that a block aims at a random shorter length instead of max_seq_length."""
    whole_word_masking: bool = False
    """Mask every WordPiece of a word together."""
    next_sentence: bool = True
    """NSP pairs [CLS] A [SEP] B [SEP]; false = MLM-only packing across documents."""
    split_sentences: bool = True
    """MLM-only packing: blocks are full windows of the token stream that may cut a sentence (run_mlm, RoBERTa
    FULL-SENTENCES); false = whole sentences only. Ignored with next_sentence."""
    document_separator: bool = True
    """MLM-only packing: a [SEP] between two documents in the token stream (RoBERTa FULL-SENTENCES' extra separator
    token), so a block that crosses a document boundary marks it; the separator takes a slot, is never masked and is
    not counted in the number of predictions. false = documents run into each other unmarked (as before this
    setting existed). Ignored with next_sentence."""

    def __post_init__(self) -> None:
        errors = []
        if not 8 <= self.max_seq_length <= 65535:
            errors.append(f"max_seq_length must be in [8, 65535], got {self.max_seq_length}")
        if not 1 <= self.max_predictions_per_seq <= self.max_seq_length:
            errors.append(f"max_predictions_per_seq must be in [1, max_seq_length], got {self.max_predictions_per_seq}")
        if not 0.0 < self.masked_lm_prob < 1.0:
            errors.append(f"masked_lm_prob must be in (0, 1), got {self.masked_lm_prob}")
        if not 0.0 <= self.short_seq_prob <= 1.0:
            errors.append(f"short_seq_prob must be in [0, 1], got {self.short_seq_prob}")
        if errors:
            raise ValueError("; ".join(errors))


# ----------------------------------------------------------------------------------------------- blocks

_BLOCK_DOMAIN = (1 << 63) | 0xB10C  # the "epoch" of block-target keys: no real epoch reaches it


def build_blocks(store: TokenStore, sample: SampleConfig, seed: int) -> np.ndarray:
    """Group sentences into blocks: int64 array (n_blocks, 3) of [first sentence, end sentence, document].

    Greedy like the reference: add sentences until the block reaches its target length or the document ends.
    With `next_sentence=False` blocks run across documents (packing). Deterministic in (store, sample, seed).

    Vectorised: a block's target is keyed by its first sentence (a counter-based draw, like every other random
    number here), so the end of a block that *would* start at any sentence is one `searchsorted` on the token
    offsets for all sentences at once; the blocks are then the chain of those ends from each document's start
    (followed for all documents at once) or, when packing, from sentence 0 (a list walk). The Python loop over
    sentences this replaces was serial time in `prepare`, between its two parallel stages (BENCHMARKS.md, blocks).
    """
    cum = np.asarray(store.sentence_starts, dtype=np.int64)  # token offset of each sentence, and the end
    n_sent = len(cum) - 1
    if n_sent == 0:
        return np.zeros((0, 3), np.int64)
    max_tokens = sample.max_seq_length - (3 if sample.next_sentence else 2)
    if splits_sentences(sample):
        return _token_windows(store, sample, seed, max_tokens)
    doc_starts = np.asarray(store.document_starts, dtype=np.int64)
    bounds, tail = np.zeros(0, np.int64), cum
    if not sample.next_sentence:
        bounds = document_boundaries(store, sample)
        if len(bounds):
            tail = np.searchsorted(bounds, cum)  # (in place: one array of the sentences' size less at the peak)
            tail += cum
    # The ends are computed a slice of sentences at a time: the same numbers (each sentence's end depends on its own
    # key and offsets only), while the temporaries of all sentences at once (keys, draws, targets, documents) took
    # ~50 bytes per sentence at the peak: ~10 GB for Wikipedia + BookCorpus, in every rank that built the blocks.
    end = np.empty(n_sent, np.int64)
    for lo in range(0, n_sent, _END_SLICE):
        hi = min(lo + _END_SLICE, n_sent)
        start = np.arange(lo, hi)
        target = block_targets(sample, seed, start)
        if sample.next_sentence:
            # Sentences are added until the total reaches the target (sentence lengths are >= 1, so the first index
            # whose offset reaches start + target is past `start`), or the document ends.
            doc_end = doc_starts[np.searchsorted(doc_starts, start, side="right")]
            end[lo:hi] = np.minimum(np.searchsorted(cum, cum[lo:hi] + target, side="left"), doc_end)
        else:
            # Whole sentences while they fit (at least one), across documents. With document separators a block's
            # length is in stream positions: from its first token to the end of its last sentence, the separators
            # between its documents included (one at its edges is left out, as in `_token_windows`).
            head = cum[lo:hi]
            if len(bounds):
                head = head + np.searchsorted(bounds, head, side="right")
            end[lo:hi] = np.maximum(start + 1, np.searchsorted(tail, head + target, side="right") - 1)
    del tail  # (the stream offsets: not needed by the walk below)
    if sample.next_sentence:  # every document starts a chain: follow all documents' chains together
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
        # Walked through a memoryview of `end` into an int64 array: end.tolist() and a list of the firsts cost
        # ~40 bytes per sentence and block as Python ints (~6 GB at Wikipedia's 150M sentences), and were slower.
        nxt = memoryview(np.ascontiguousarray(end, dtype=np.int64))
        firsts = array.array("q")
        s = 0
        while s < n_sent:
            firsts.append(s)
            s = nxt[s]
        first = np.frombuffer(firsts, dtype=np.int64) if len(firsts) else np.zeros(0, np.int64)
    doc_of_first = np.searchsorted(doc_starts, first, side="right") - 1  # (the document holding each first)
    return np.stack([first, end[first], doc_of_first], axis=1)


_END_SLICE = 1 << 20
"""Sentences per slice of `build_blocks`' vectorised part."""


def block_targets(sample: SampleConfig, seed: int, first: np.ndarray) -> np.ndarray:
    """The target length (tokens, specials excluded) of a sentence block that starts at sentence `first`: the
    reference's target_seq_length, max_seq_length - 3 (or - 2 when packing), or with probability `short_seq_prob`
    randint(2, that). Keyed by the block's first sentence, so `build_blocks` and `InstanceBuilder.build` (which
    needs it for a random next segment's length) draw the same number."""
    max_tokens = sample.max_seq_length - (3 if sample.next_sentence else 2)
    keys = sample_keys(seed, _BLOCK_DOMAIN, np.asarray(first, dtype=np.int64))
    short_len = 2 + np.floor(_uniform(keys, 1) * (max_tokens - 1)).astype(np.int64)  # randint(2, max_tokens)
    return np.where(_uniform(keys, 0) < sample.short_seq_prob, short_len, max_tokens)


def document_boundaries(store: TokenStore, sample: SampleConfig) -> np.ndarray:
    """Token offsets where a document starts, the corpus's first excluded (int64, ascending): a separator precedes
    each of them in `sample`'s packing stream. Empty when there are no separators (NSP, `document_separator` false).
    Empty documents have no tokens and so no separator of their own (never two separators in a row)."""
    if sample.next_sentence or not sample.document_separator:
        return np.zeros(0, np.int64)
    ss = np.asarray(store.sentence_starts, dtype=np.int64)
    b = np.unique(ss[np.asarray(store.document_starts, dtype=np.int64)[1:-1]])
    return b[(b > 0) & (b < ss[-1])]


def stream_separators(boundaries: np.ndarray) -> np.ndarray:
    """Stream positions of the separators before `boundaries` (`document_boundaries`): the k-th sits at
    boundaries[k] + k. Token t is at stream position t + #(boundaries <= t)."""
    return boundaries + np.arange(len(boundaries), dtype=np.int64)


def splits_sentences(sample: SampleConfig) -> bool:
    """Whether `sample`'s blocks are token windows (rows [stream start, stream end, document]: token offsets, or with
    document separators positions in the stream of tokens and separators) rather than sentence ranges (rows [first
    sentence, end sentence, document])."""
    return not sample.next_sentence and sample.split_sentences


def _block_kind(sample: SampleConfig) -> str:
    """The kind of blocks in cache and static-folder names ("packed" = whole sentences, its name from before;
    "-sep": document separators, so packing without them keeps the names it had before they existed)."""
    if sample.next_sentence:
        return "nsp"
    return ("packed-split" if sample.split_sentences else "packed") + ("-sep" if sample.document_separator else "")


def _token_windows(store: TokenStore, sample: SampleConfig, seed: int, max_tokens: int) -> np.ndarray:
    """Packed blocks as consecutive windows of the token stream over the whole corpus: [stream start, stream end,
    document of the first token]. Window k's length is its target (`max_tokens`, or with `short_seq_prob` a random
    shorter one), keyed by k; the last window takes what is left. The stream is the corpus's tokens with, when
    `document_separator`, a separator between documents (none after the last): positions are then stream
    positions, not token offsets, and a separator at a window's first or last position is left out of the window
    (the row's [CLS] or final [SEP] already marks that boundary: never `[CLS] [SEP]` nor `[SEP] [SEP]`)."""
    seps = stream_separators(document_boundaries(store, sample))
    n_tokens = int(store.sentence_starts[-1]) + len(seps)  # the stream's length
    lengths = []
    k, covered = 0, 0
    while covered < n_tokens:  # a few rounds at most: each draws targets for the windows still expected
        count = max(16, int((n_tokens - covered) / max(1.0, max_tokens * (1 - sample.short_seq_prob / 2))) + 16)
        keys = sample_keys(seed, _BLOCK_DOMAIN, np.arange(k, k + count))
        short_len = 2 + np.floor(_uniform(keys, 1) * (max_tokens - 1)).astype(np.int64)
        lengths.append(np.where(_uniform(keys, 0) < sample.short_seq_prob, short_len, max_tokens))
        k += count
        covered += int(lengths[-1].sum())
    ends = np.cumsum(np.concatenate(lengths))
    n_windows = int(np.searchsorted(ends, n_tokens, side="left")) + 1
    end = np.minimum(ends[:n_windows], n_tokens)
    start = np.concatenate([[0], end[:-1]])
    first_token = start
    if len(seps):  # a window never starts or ends with a separator (it has >= 2 slots, separators never touch)
        j = np.searchsorted(seps, start, side="left")  # the separators before the window
        at_start = seps[np.minimum(j, len(seps) - 1)] == start
        at_end = seps[np.minimum(np.searchsorted(seps, end - 1, side="left"), len(seps) - 1)] == end - 1
        start, end = start + at_start, end - at_end
        first_token = start - (j + at_start)
    # The document of a window's first token: its sentence, then that sentence's document.
    sent = np.searchsorted(store.sentence_starts, first_token, side="right") - 1
    doc = np.searchsorted(np.asarray(store.document_starts, dtype=np.int64), sent, side="right") - 1
    return np.stack([start, end, doc], axis=1).astype(np.int64)


def load_blocks(store: TokenStore, sample: SampleConfig, seed: int) -> np.ndarray:
    """`build_blocks`, cached in the prepared folder (atomic write; rebuilt if missing or unreadable)."""
    name = f"blocks-v3-s{sample.max_seq_length}-short{sample.short_seq_prob:g}-{_block_kind(sample)}-seed{seed}.npy"
    path = store.dir / "cache" / name
    last = (store.num_tokens + len(document_boundaries(store, sample)) if splits_sentences(sample)
            else store.num_sentences)
    blocks = _cached_blocks(path, last)
    if blocks is not None:
        return blocks
    with cache_lock(path):  # ranks that start together: one builds, the others wait and map its file
        blocks = _cached_blocks(path, last)
        if blocks is not None:
            return blocks
        blocks = build_blocks(store, sample, seed)
        try:
            save_npy_atomic(path, blocks)
        except OSError as e:  # a read-only data folder still works, only slower to open
            logger.warning("cannot cache blocks in %s: %s", path, e)
            return blocks
    return np.load(path, mmap_mode="r")  # (the copy built here is freed: every process reads the same pages)


def _cached_blocks(path: Path, last: int) -> np.ndarray | None:
    """The blocks cached at `path`, memory-mapped, or None (missing; unreadable or stale: a warning). Mapped: one
    copy in the page cache for every process that opens the store (training ranks and their loader workers,
    prepare's workers) instead of 24 bytes per block in each (~1 GB per process for Wikipedia + BookCorpus)."""
    if not path.is_file():
        return None
    try:
        blocks = np.load(path, mmap_mode="r")
        if blocks.ndim == 2 and blocks.shape[1] == 3 and (len(blocks) == 0 or blocks[-1, 1] == last):
            return blocks
    except (OSError, ValueError):
        pass
    logger.warning("cache %s is unreadable; rebuilding it", path)
    return None


# ----------------------------------------------------------------------------------------------- instances

class InstanceBuilder:
    """Builds fixed-width instance rows for (epoch, block ids), vectorised over the whole batch.

    A row is `[total_len, a_len, nsp_code, n_pred, ids (T), positions (P), labels (P)]` (int64 here; stored as
    uint16/uint32 for static instances): `ids` already carry the masking.
    """

    def __init__(self, store: TokenStore, sample: SampleConfig, seed: int):
        self.store = store
        self.sample = sample
        self.seed = seed
        self.blocks = load_blocks(store, sample, seed)
        meta = store.meta
        self.special = meta["special_ids"]
        self.vocab_size = int(meta["vocab_size"])
        self.is_subword = np.zeros(self.vocab_size + 1, bool)
        if sample.whole_word_masking:
            self.is_subword[np.asarray(meta["subword_ids"], dtype=np.int64)] = True
        docs = self.blocks[:, 2]
        n_docs = store.num_documents
        # First block of each document and its count: to draw a random block from *another* document.
        self.doc_first_block = np.searchsorted(docs, np.arange(n_docs + 1))
        self.n_blocks = len(self.blocks)
        # Packing with document separators: the stream positions of the separators (empty otherwise).
        self.boundaries = document_boundaries(store, sample)
        self.separators = stream_separators(self.boundaries)

    @property
    def row_width(self) -> int:
        return ROW_HEADER + self.sample.max_seq_length + 2 * self.sample.max_predictions_per_seq

    def build(self, epoch: int, block_ids: np.ndarray, dtype: np.dtype = np.dtype(np.int64)) -> np.ndarray:
        """Rows for (epoch, block ids). `dtype`: the rows' integer type (static instances are built straight in
        their stored uint16/uint32, which also halves the builder's memory traffic; the values are the same)."""
        sample = self.sample
        T = sample.max_seq_length
        ids = np.asarray(block_ids, dtype=np.int64)
        n = len(ids)
        keys = sample_keys(self.seed, epoch, ids)
        ss = self.store.sentence_starts
        first, end, doc = self.blocks[ids, 0], self.blocks[ids, 1], self.blocks[ids, 2]
        n_sent = end - first
        if splits_sentences(sample):  # token windows (stream positions)
            block_start, block_end = first, end
        else:
            block_start, block_end = ss[first], ss[end]
            if len(self.boundaries):  # packing with separators: stream positions of the block's first token and end
                block_start = block_start + np.searchsorted(self.boundaries, block_start, side="right")
                block_end = block_end + np.searchsorted(self.boundaries, block_end, side="left")

        if sample.next_sentence:
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
            r_doc_end = self.store.document_starts[self.blocks[r, 2] + 1]  # a sentence index
            # Reference: target_b = target_seq_length - len(A), then B takes whole sentences of the other document
            # until it holds >= target_b tokens (at least one sentence) or that document ends; pair truncation
            # below trims the excess. The target, not the block's length: a block that ends with its document, or
            # a one-sentence block, is shorter than its target, and B cut to the block's length was then a single
            # token (68% of Tiny Shakespeare's samples: a one-token B that gave the NSP label away).
            target_b = block_targets(sample, self.seed, first) - (a_end - a_start)
            rb_start = ss[r_sent]
            rb_end = ss[np.minimum(np.searchsorted(ss, rb_start + np.maximum(target_b, 1), side="left"), r_doc_end)]
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
        sample = self.sample
        T, P = sample.max_seq_length, sample.max_predictions_per_seq
        n = len(keys)
        # Assemble [CLS] A [SEP] B [SEP] on an (n, W) grid by gathering: position p of A reads a_start + p - 1,
        # of B b_start + p - la - 2; everything else (CLS, SEPs, padding) reads a clipped dummy and is overwritten.
        # Written in place into the output rows.
        pos = np.arange(W)[None, :]
        candidate = (pos >= 1) & (pos <= la[:, None])  # in A
        src = np.add(a_start[:, None] - 1, pos)
        if sample.next_sentence:
            in_b = (pos >= la[:, None] + 2) & (pos < total[:, None] - 1)
            src += in_b * (b_start - a_start - la - 1)[:, None]
            candidate |= in_b
        sep_at, n_sep = None, 0
        if len(self.separators):
            # Packing with document separators: A is a window of the stream. A stream position is a separator or
            # token `position - #(separators before it)`: the separators of each row's window are marked on the
            # grid (a scatter), and a cumulative sum along the row counts them.
            seps = self.separators
            j0 = np.searchsorted(seps, a_start, side="left")
            n_sep = np.searchsorted(seps, a_start + la, side="left") - j0
            src -= j0[:, None]
            if n_sep.any():
                r = np.repeat(np.arange(n), n_sep)
                k = np.arange(len(r)) - np.repeat(np.cumsum(n_sep) - n_sep, n_sep) + j0[r]
                sep_at = (r, seps[k] - a_start[r] + 1)  # (row, grid position) of every separator
                is_sep = np.zeros((n, W), np.int64)
                is_sep[sep_at] = 1
                src -= np.cumsum(is_sep, axis=1, out=is_sep)
                candidate[sep_at] = False
        np.clip(src, 0, max(self.store.num_tokens - 1, 0), out=src)
        rows[:, ROW_HEADER + W: ROW_HEADER + T] = self.special["[PAD]"]
        tokens = rows[:, ROW_HEADER: ROW_HEADER + W]
        np.copyto(tokens, self.store.tokens_at(src, tokens.dtype))
        tokens[~candidate] = self.special["[PAD]"]
        if sep_at is not None:
            tokens[sep_at] = self.special["[SEP]"]
        tokens[:, 0] = self.special["[CLS]"]
        rows_idx = np.arange(n)
        if sample.next_sentence:
            tokens[rows_idx, la + 1] = self.special["[SEP]"]
        tokens[rows_idx, total - 1] = self.special["[SEP]"]

        # The number of predictions is the reference's round(len(tokens) * masked_lm_prob), [CLS] and [SEP] counted
        # but not the document separators (what the row would hold without them).
        positions, n_pred = self._choose_masked(keys, tokens, candidate, total - n_sep)
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
        """Sorted masked positions (n, P) (garbage beyond n_pred) and n_pred (n,). `total`: the length whose
        `round(total * masked_lm_prob)` is the number of predictions (capped at P and at the candidates)."""
        sample = self.sample
        n, T = tokens.shape
        P = sample.max_predictions_per_seq
        n_cand = candidate.sum(1)
        # Python's round() (the reference) and np.round both round half to even.
        n_pred = np.minimum(np.minimum(P, np.maximum(1, np.round(total * sample.masked_lm_prob).astype(np.int64))),
                            n_cand)
        # Integer keys: the same order as the uniform doubles they stand for; 2**53 (> any key) = not a candidate.
        key = _uniform_bits(keys, np.arange(sample.max_seq_length, sample.max_seq_length + T))  # T: the grid's width
        never = np.uint64(1 << 53)
        if sample.whole_word_masking:
            pos = np.arange(T)[None, :]
            starts = candidate & ~self.is_subword[tokens]
            starts[:, 0] = False
            word_start = np.maximum.accumulate(np.where(starts | ~candidate, pos, 0), axis=1)
            key = np.take_along_axis(key, word_start, axis=1)  # every token of a word shares its start's key
            key[~candidate] = never
            order = np.argsort(key, axis=1, kind="stable")  # words contiguous and in position order
            ws_sorted = np.take_along_axis(word_start, order, axis=1)
            cand_sorted = np.take_along_axis(candidate, order, axis=1)
            first_of_word = np.ones((n, T), bool)
            first_of_word[:, 1:] = ws_sorted[:, 1:] != ws_sorted[:, :-1]
            first_of_word &= cand_sorted
            word_rank = np.cumsum(first_of_word, axis=1) - 1  # the k-th word in random order (candidates only)
            n_words = first_of_word.sum(1)
            r_idx, k_idx = np.nonzero(cand_sorted)
            lengths = np.zeros((n, T), np.int64)  # lengths[r, k]: tokens of row r's k-th word
            np.add.at(lengths, (r_idx, word_rank[r_idx, k_idx]), 1)
            # The reference's greedy fill: words in random order, one that would overshoot n_pred is skipped and
            # later (shorter) words are still tried, until n_pred tokens are masked.
            count = np.zeros(n, np.int64)
            taken = np.zeros((n, T), bool)
            for k in range(int(n_words.max(initial=0))):
                fits = (lengths[:, k] > 0) & (count + lengths[:, k] <= n_pred)
                taken[:, k] = fits
                count += fits * lengths[:, k]
                if np.all((count >= n_pred) | (k + 1 >= n_words)):
                    break
            take = cand_sorted & np.take_along_axis(taken, np.maximum(word_rank, 0), axis=1)
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
    (n, P). Same result as sorting each row (keys are uniform 53-bit integers), cheaper: only keys below a
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

# ----------------------------------------------------------------------------------------------- static files

def sample_record(sample: SampleConfig, seed: int) -> dict[str, Any]:
    """The settings recorded with static instances (`instances.json`, `stats.json`): a sample is these and the seed.
    `split_sentences` and `document_separator` only where they mean something (packing), so NSP records are the
    same as before they existed."""
    record = {**asdict(sample), "seed": seed}
    if sample.next_sentence:
        del record["split_sentences"], record["document_separator"]
    return record


def _normalised_record(record: dict[str, Any]) -> dict[str, Any]:
    """A packing record from before `split_sentences` existed packed whole sentences; one from before
    `document_separator` existed packed without separators."""
    if not record.get("next_sentence", True):
        return {"split_sentences": False, "document_separator": False, **record}
    return record


def sample_from_record(record: dict[str, Any] | None, default_seed: int = 12345) -> tuple[SampleConfig, int]:
    """(`SampleConfig`, seed) of a `sample_record` as written by this or an earlier version."""
    settings = _normalised_record(dict(record or {}))
    seed = settings.pop("seed", default_seed)
    return SampleConfig(**settings), seed


def static_dir_name(sample: SampleConfig, seed: int, dupe_factor: int) -> str:
    return (f"static-s{sample.max_seq_length}-p{sample.max_predictions_per_seq}-m{sample.masked_lm_prob:g}"
            f"-short{sample.short_seq_prob:g}-{'wwm-' if sample.whole_word_masking else ''}"
            f"{_block_kind(sample)}-d{dupe_factor}-seed{seed}")


def write_static_meta(out_dir: Path, sample: SampleConfig, seed: int, dupe_factor: int, num_instances: int,
                      row_width: int, dtype: np.dtype) -> None:
    atomic_write_json(out_dir / "instances.json", {
        "sample_config": sample_record(sample, seed), "dupe_factor": dupe_factor, "num_instances": num_instances,
        "row_width": row_width, "dtype": np.dtype(dtype).name,  # no timings: same inputs, same bytes
    })


def find_static(data_dir: Path, sample: SampleConfig, seed: int) -> tuple[Path, dict]:
    """The static-instance folder of (`sample`, `seed`) (any dupe factor), or a `ValueError` listing what exists."""
    found = []
    wanted = sample_record(sample, seed)
    for meta_path in sorted(data_dir.glob("static-*/instances.json")):
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        found.append(meta_path.parent.name)
        if _normalised_record(meta["sample_config"]) == wanted:
            return meta_path.parent, meta
    raise ValueError(
        f"{data_dir} has no static instances for {sample} with seed {seed} (present: {found or 'none'}); run "
        f"`bertrain prepare --masking static` with these settings, or mask dynamically (data.masking: dynamic, "
        "--data.masking dynamic)")


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
