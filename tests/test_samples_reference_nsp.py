"""NSP pairs against google-research/bert's create_pretraining_data.py, on a corpus whose every token id is its own
corpus position (id = OFFSET + position), so each token of a sample says exactly where in the corpus it came from.

The reference's random next segment: `target_b_length = target_seq_length - len(tokens_a)`, then B takes whole
sentences of another document, from a random sentence, until it holds >= target_b_length tokens (at least one
sentence, since the check follows the first append) or that document ends; `truncate_seq_pair` then trims the pair
to max_seq_length - 3.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from bertrain.data.samples import _BLOCK_DOMAIN, ROW_HEADER, InstanceBuilder, SampleConfig, _uniform, sample_keys
from bertrain.data.store import TokenStore
from helpers import POSITIONAL_OFFSET, write_positional_store

OFFSET = POSITIONAL_OFFSET  # ids below are specials; corpus token p has id OFFSET + p
T, P = 64, 10
MAX_TOKENS = T - 3


@pytest.fixture(scope="module")
def positional_store(tmp_path_factory) -> Path:
    """300 documents of 1-5 sentences of 3-40 tokens: many one-sentence blocks and blocks that end with their
    document (both shorter than their target), and documents shorter than a random B's target."""
    rng = np.random.default_rng(7)
    counts = rng.integers(1, 6, 300)
    lengths = rng.integers(3, 41, int(counts.sum()))
    return write_positional_store(tmp_path_factory.mktemp("positional"), counts, lengths)


@pytest.mark.parametrize("short_seq_prob", [0.0, 0.3])
def test_random_next_segment_is_whole_sentences_up_to_the_target_like_the_reference(positional_store, short_seq_prob):
    store = TokenStore(positional_store)
    sample = SampleConfig(T, P, short_seq_prob=short_seq_prob)
    seed = 12345
    builder = InstanceBuilder(store, sample, seed)
    blocks = builder.blocks
    ids = np.arange(len(blocks))
    ss = np.asarray(store.sentence_starts)
    ds = np.asarray(store.document_starts)
    doc_of_sentence = np.repeat(np.arange(store.num_documents), np.diff(ds))
    # Each block's target_seq_length, drawn as `build_blocks` draws it (keyed by the block's first sentence).
    keys = sample_keys(seed, _BLOCK_DOMAIN, blocks[:, 0])
    short = 2 + np.floor(_uniform(keys, 1) * (MAX_TOKENS - 1)).astype(np.int64)
    targets = np.where(_uniform(keys, 0) < short_seq_prob, short, MAX_TOKENS)
    seen = {"untruncated": 0, "one_sentence_block": 0, "b_several_sentences": 0, "b_to_doc_end": 0, "truncated": 0}
    for epoch in range(3):
        rows = builder.build(epoch, ids)
        for i, row in enumerate(rows):
            total, a_len, nsp, n_pred = (int(v) for v in row[:ROW_HEADER])
            if nsp != 1:
                continue
            tok = row[ROW_HEADER: ROW_HEADER + total].copy()
            tok[row[ROW_HEADER + T: ROW_HEADER + T + n_pred]] = row[ROW_HEADER + T + P: ROW_HEADER + T + P + n_pred]
            a = tok[1: a_len - 1] - OFFSET
            b = tok[a_len: total - 1] - OFFSET
            assert len(a) >= 1 and len(b) >= 1
            assert np.all(np.diff(a) == 1) and np.all(np.diff(b) == 1)  # contiguous corpus text
            sb = int(np.searchsorted(ss, b[0], side="right") - 1)  # the sentence B starts in
            b_doc = doc_of_sentence[sb]
            assert b_doc != blocks[i, 2]  # random next: another document
            if len(a) + len(b) == MAX_TOKENS:  # truncate_seq_pair cut the pair to exactly max_num_tokens
                seen["truncated"] += 1
                continue
            # Not truncated: A is the block's first whole sentences, B whole sentences from a sentence start,
            # stopping at the first sentence end where it reaches target - len(A), or at its document's end.
            seen["untruncated"] += 1
            seen["one_sentence_block"] += int(blocks[i, 1] - blocks[i, 0] == 1)
            assert a[0] == ss[blocks[i, 0]] and np.isin(a[-1] + 1, ss)
            assert b[0] == ss[sb], "B must start at a sentence start"
            need = max(int(targets[i]) - len(a), 1)
            doc_end_sentence = ds[b_doc + 1]
            end_sentence = min(int(np.searchsorted(ss, b[0] + need, side="left")), int(doc_end_sentence))
            assert b[-1] + 1 == ss[end_sentence], (i, len(a), len(b), need)
            seen["b_several_sentences"] += int(end_sentence - sb >= 2)
            seen["b_to_doc_end"] += int(end_sentence == doc_end_sentence)
    # every branch of the rule was exercised, many times
    assert min(seen.values()) >= 30, seen
