"""Pretraining samples and the loader: statistics, structure, modes, determinism across ranks, exact resume."""
from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from bertrain.data.prepare import PrepareConfig, prepare
from bertrain.data.pretraining import PretrainingDataset, PretrainingLoader, rows_to_batch
from bertrain.data.samples import (_BLOCK_DOMAIN, NSP_NONE, InstanceBuilder, SampleConfig, _uniform,
                                   build_blocks, find_static, sample_from_record, sample_keys, sample_record,
                                   static_dir_name)
from bertrain.data.store import TokenStore
from bertrain.data.tokenizer import read_vocab
from helpers import POSITIONAL_OFFSET, write_positional_store

ASSETS = Path(__file__).resolve().parent / "assets"
VOCAB = ASSETS / "vocab-tiny.txt"
T, P = 128, 20
SAMPLE = SampleConfig(T, P)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("pd") / "prepared"
    prepare(PrepareConfig(inputs=["builtin:python-docs"], output=str(out), vocab_file=str(VOCAB), dupe_factor=2,
                          workers=2, shard_tokens=40_000))
    return out


def all_rows(ds: PretrainingDataset, epoch: int = 0) -> np.ndarray:
    return ds.get_rows(epoch, np.arange(len(ds)))


def test_sample_structure_and_statistics(prepared):
    ds = PretrainingDataset(prepared, SAMPLE, masking="dynamic")
    vocab = read_vocab(VOCAB)
    cls_, sep, mask, pad = (vocab.index(t) for t in ("[CLS]", "[SEP]", "[MASK]", "[PAD]"))
    b = ds.get_batch(0, np.arange(len(ds)))
    ids, types, att = b["input_ids"].numpy(), b["token_type_ids"].numpy(), b["attention_mask"].numpy()
    pos, labels, nsp = b["masked_positions"].numpy(), b["masked_labels"].numpy(), b["next_sentence_labels"].numpy()
    n = len(ids)
    assert n > 800 and ids.shape == (n, T) and pos.shape == (n, P) and all(v.dtype == torch.int64 for v in b.values())
    length = att.sum(1)
    assert length.max() <= T and (length >= 5).all()
    assert np.all(att == (np.arange(T)[None] < length[:, None]))
    assert np.all(ids[:, 0] == cls_) and np.all(ids[np.arange(n), length - 1] == sep)
    assert np.all(ids[att == 0] == pad) and np.all(types[att == 0] == 0)
    # [CLS] A [SEP] B [SEP]: types 0...0 1...1, the first SEP is the last type-0 token, B non-empty.
    a_len = (types == 0).sum(1) - (T - length)
    assert np.all(np.diff(types * att, axis=1)[att[:, 1:] == 1] >= 0)  # one 0->1 switch
    assert np.all(ids[np.arange(n), a_len - 1] == sep) and np.all(a_len < length - 1)
    # masked fraction and the prediction cap
    n_pred = (labels != -100).sum(1)
    assert n_pred.max() <= P and n_pred.min() >= 1
    expected = np.minimum(P, np.maximum(1, np.round(length * 0.15)))
    assert np.all(n_pred == expected)  # candidates always suffice here
    frac = n_pred.sum() / length.sum()
    assert 0.13 < frac < 0.16, frac
    valid = labels != -100
    # positions sorted, unique, never special tokens or padding
    assert np.all(valid == (np.arange(P)[None] < n_pred[:, None]))  # real slots first, then padding
    assert np.all(np.diff(pos, axis=1)[valid[:, 1:]] > 0)
    rows = np.repeat(np.arange(n)[:, None], P, 1)
    assert np.all(pos[~valid] == 0)
    assert np.all(pos[valid] > 0) and np.all(pos[valid] < length[rows[valid]] - 1)
    assert np.all(pos[valid] != a_len[rows[valid]] - 1)
    assert not np.isin(labels[valid], [cls_, sep, pad]).any()
    # 80 / 10 / 10
    shown = ids[rows[valid], pos[valid]]
    m, keep = (shown == mask).mean(), (shown == labels[valid]).mean()
    assert 0.77 < m < 0.83, m
    assert 0.08 < keep < 0.12, keep
    assert 0.08 < 1 - m - keep < 0.12
    # ~50% random next (a bit more: one-sentence blocks are always random)
    assert set(np.unique(nsp)) == {0, 1}
    assert 0.45 < nsp.mean() < 0.62, nsp.mean()


def _unmask(b, i):
    ids = b["input_ids"][i].clone()
    valid = b["masked_labels"][i] != -100
    ids[b["masked_positions"][i][valid]] = b["masked_labels"][i][valid]
    return ids


def test_is_next_pairs_are_contiguous_text_and_random_pairs_come_from_another_document(prepared):
    ds = PretrainingDataset(prepared, SAMPLE, masking="dynamic")
    store = TokenStore(prepared)
    flat = store.tokens_at(np.arange(store.num_tokens)).astype(np.uint16).tobytes()
    doc_of_token = np.repeat(np.arange(store.num_documents),
                             np.diff(store.sentence_starts[store.document_starts]))
    b = ds.get_batch(3, np.arange(300))
    blocks = ds._get_builder().blocks  # dynamic sample i is built from block i
    checked = {0: 0, 1: 0}
    for i in range(300):
        ids = _unmask(b, i).numpy()
        L = int(b["attention_mask"][i].sum())
        a_len = int((b["token_type_ids"][i][:L] == 0).sum())
        a, bb = ids[1:a_len - 1], ids[a_len:L - 1]
        label = int(b["next_sentence_labels"][i])
        ss = store.sentence_starts
        lo, hi = int(ss[blocks[i, 0]]), int(ss[blocks[i, 1]])
        pa = flat.find(a.astype(np.uint16).tobytes(), 2 * lo) // 2  # A: inside its own block
        assert lo <= pa and pa + len(a) <= hi
        if label == 0:  # B follows A in the block (pair truncation may cut A's end / B's start)
            pb = flat.find(bb.astype(np.uint16).tobytes(), 2 * (pa + len(a))) // 2
            assert pa + len(a) <= pb and pb + len(bb) <= hi
        else:  # B is real text of another document (the docs share some passages: look at every occurrence)
            key, docs, at = bb.astype(np.uint16).tobytes(), set(), flat.find(bb.astype(np.uint16).tobytes())
            assert at >= 0
            while at >= 0:
                if at % 2 == 0:
                    docs.add(int(doc_of_token[at // 2]))
                at = flat.find(key, at + 1)
            assert docs - {int(blocks[i, 2])}
        checked[label] += 1
    assert checked[0] > 100 and checked[1] > 100


def test_whole_word_masking_masks_whole_words(prepared):
    ds = PretrainingDataset(prepared, SampleConfig(T, P, whole_word_masking=True), masking="dynamic")
    vocab = read_vocab(VOCAB)
    sub = np.array([t.startswith("##") for t in vocab])
    b = ds.get_batch(0, np.arange(400))
    words_split = 0
    for i in range(400):
        ids = _unmask(b, i).numpy()
        valid = b["masked_labels"][i] != -100
        masked = set(b["masked_positions"][i][valid].tolist())
        assert 1 <= len(masked) <= P
        for q in masked:
            if q + 1 < T and sub[ids[q + 1]] and b["attention_mask"][i][q + 1]:
                assert q + 1 in masked
                words_split += 1
            if sub[ids[q]] and vocab[ids[q - 1]] not in ("[CLS]", "[SEP]"):  # B may start mid-word
                assert q - 1 in masked
    assert words_split > 50  # the tiny vocab splits many words: the property was really exercised
    frac = (b["masked_labels"] != -100).sum() / b["attention_mask"].sum()
    assert 0.11 < frac < 0.16


def _unmasked_rows(b) -> tuple[torch.Tensor, torch.Tensor]:
    L = b["attention_mask"].sum(1)
    return torch.stack([_unmask(b, i) for i in range(len(L))]), L


@pytest.mark.parametrize("split", [True, False])
def test_mlm_only_packing(prepared, split):
    sample = SampleConfig(T, P, next_sentence=False, split_sentences=split)
    ds = PretrainingDataset(prepared, sample, masking="dynamic")
    b = ds.get_batch(0, np.arange(len(ds)))
    assert torch.all(b["next_sentence_labels"] == -100)
    assert torch.all(b["token_type_ids"] == 0)
    sep = read_vocab(VOCAB).index("[SEP]")
    unmasked, L = _unmasked_rows(b)
    assert torch.all(unmasked[torch.arange(len(L)), L - 1] == sep) and L.max() <= T
    frac = (b["masked_labels"] != -100).sum() / L.sum()
    assert 0.13 < frac < 0.16
    store = TokenStore(prepared)
    # A [SEP] between the documents a row crosses (RoBERTa FULL-SENTENCES): each one just before the first token of
    # a document, never at a row's edge; a boundary at a row's edge has the row's [CLS] / final [SEP] instead.
    boundaries = set(np.asarray(store.sentence_starts)[np.asarray(store.document_starts)[1:-1]].tolist())
    builder = ds._get_builder()
    blocks = builder.blocks
    if split:  # windows of the stream: a stream position less the separators before it is a token offset
        first_token = blocks[:, 0] - np.searchsorted(builder.separators, blocks[:, 0])
    else:
        first_token = np.asarray(store.sentence_starts)[blocks[:, 0]]
    inner_seps = 0
    for i in range(len(L)):
        row = unmasked[i, 1:L[i] - 1].numpy()
        is_sep = row == sep
        assert not is_sep[0] and not is_sep[-1] and not (is_sep[1:] & is_sep[:-1]).any()
        offsets = int(first_token[i]) + np.concatenate([[0], np.cumsum(~is_sep)[:-1]])  # token offset of each
        assert set(offsets[is_sep].tolist()) <= boundaries  # (a separator: the offset of the token after it)
        assert not boundaries & (set(offsets[~is_sep][1:].tolist()) - set(offsets[is_sep].tolist()))
        inner_seps += int(is_sep.sum())
    assert inner_seps > 20  # rows do cross documents here: the property was really exercised
    sep_count = (unmasked == sep).sum(1)
    assert torch.all(sep_count >= 1) and (sep_count > 1).any()
    body = torch.cat([unmasked[i, 1:L[i] - 1] for i in range(len(L))]).numpy()
    body = body[body != sep]
    if split:  # the rows, [CLS] and [SEP]s taken off, are the corpus itself in order: nothing dropped or repeated
        np.testing.assert_array_equal(body, store.tokens_at(np.arange(store.num_tokens)))
        assert inner_seps == len(boundaries - set(first_token.tolist()))  # one per boundary not at a row's start
    else:  # a sentence longer than a block is cut to it, and its rest dropped
        assert 0.8 * store.num_tokens < len(body) < store.num_tokens
    full = (L == T).float().mean().item()
    if split:  # every window full but the short-target ones (10%), the last and a few that end at a document
        assert 0.82 < full < 0.95 and L.float().mean() > 0.92 * T
        # windows cut sentences: some row starts inside a sentence
        starts = np.asarray(ds._get_builder().blocks[:, 0])
        assert not np.isin(starts, store.sentence_starts).all()
    else:  # whole sentences: ~30-token sentences here leave ~12 slots free
        assert full < 0.2 and 0.75 * T < L.float().mean() < 0.93 * T
        starts = np.asarray(store.sentence_starts)[ds._get_builder().blocks[:, 0]]
        assert np.isin(starts, store.sentence_starts).all()


OFFSET = POSITIONAL_OFFSET  # ids below are specials; corpus token p has id OFFSET + p


@pytest.fixture(scope="module")
def positional(tmp_path_factory) -> Path:
    """A store whose every token id is its own corpus position (id = OFFSET + position), so each token of a row says
    where in the corpus it came from: 400 documents of 1-5 sentences of 2-29 tokens (short documents: many rows
    cross several). Every third position is a "##" piece, for whole-word masking."""
    rng = np.random.default_rng(11)
    counts = rng.integers(1, 6, 400)
    lengths = rng.integers(2, 30, int(counts.sum()))
    return write_positional_store(tmp_path_factory.mktemp("positional"), counts, lengths, subword_every=3)


@pytest.mark.parametrize("wwm", [False, True])
@pytest.mark.parametrize("split", [True, False])
def test_packed_rows_separate_documents_like_roberta(positional, split, wwm):
    """RoBERTa FULL-SENTENCES: a row that crosses a document boundary holds a [SEP] exactly between the last token
    of one document and the first of the next; the separator takes a slot, is never masked, and the number of
    predictions is the reference's min(P, max(1, round(len * masked_lm_prob))) with len the row without its
    separators ([CLS] + corpus tokens + [SEP], the reference's len(tokens))."""
    Tp, Pp, prob = 64, 10, 0.15
    store = TokenStore(positional)
    sample = SampleConfig(Tp, Pp, masked_lm_prob=prob, short_seq_prob=0.3, next_sentence=False,
                          split_sentences=split, whole_word_masking=wwm)
    builder = InstanceBuilder(store, sample, 7)
    n = builder.n_blocks
    assert n >= 256  # the builder's width classes are used
    ss, ds = np.asarray(store.sentence_starts), np.asarray(store.document_starts)
    doc_of_token = np.repeat(np.arange(store.num_documents), np.diff(ss[ds]))
    covered = []
    crossing = 0
    for epoch in (0, 1):
        rows = builder.build(epoch, np.arange(n))
        b = rows_to_batch(rows, sample)
        unmasked, L = _unmasked_rows(b)
        ids, labels = b["input_ids"].numpy(), b["masked_labels"].numpy()
        assert np.all(rows[:, 0] <= Tp) and np.all(rows[:, 1] == rows[:, 0]) and np.all(rows[:, 2] == NSP_NONE)
        assert torch.all(b["token_type_ids"] == 0) and torch.all(b["next_sentence_labels"] == -100)
        for i in range(n):
            row = unmasked[i, :L[i]].numpy()
            assert row[0] == 2 and row[-1] == 3
            body = row[1:-1]
            is_sep = body == 3
            assert np.all(is_sep | (body >= OFFSET))  # tokens and separators only
            # never [CLS] [SEP], [SEP] [SEP] (at either end or inside)
            assert not is_sep[0] and not is_sep[-1] and not (is_sep[1:] & is_sep[:-1]).any()
            tok = body[~is_sep] - OFFSET
            assert np.all(np.diff(tok) == 1)  # consecutive corpus text (whole sentences: also none cut inside)
            # a separator exactly where the document changes, and nowhere else
            before_sep = np.flatnonzero(is_sep) - np.arange(is_sep.sum()) - 1  # index in tok of the token before
            changes = np.flatnonzero(np.diff(doc_of_token[tok]) != 0)
            np.testing.assert_array_equal(before_sep, changes)
            assert np.all(doc_of_token[tok[changes] + 1] == doc_of_token[tok[changes]] + 1)
            assert np.all(ss[ds[doc_of_token[tok[changes] + 1]]] == tok[changes] + 1)  # the next document's first
            crossing += len(changes) > 0
            # separators are never masked; the prediction count is on the row without them
            valid = labels[i] != -100
            masked = b["masked_positions"][i].numpy()[valid]
            assert not np.isin(masked, 1 + np.flatnonzero(is_sep)).any() and not np.isin(labels[i][valid], [2, 3]).any()
            assert np.all(ids[i][1 + np.flatnonzero(is_sep)] == 3)
            want = min(Pp, max(1, round((int(L[i]) - int(is_sep.sum())) * prob)))
            assert valid.sum() == want if not wwm else valid.sum() <= want  # (a word may not fit)
            if epoch == 0:
                covered.append(tok)
    assert crossing > n  # most rows cross a document boundary here: the property was really exercised
    if split:  # the windows cover every token of the corpus exactly once, in order
        np.testing.assert_array_equal(np.concatenate(covered), np.arange(store.num_tokens))


# sha256 of the int64 rows of epochs 0 and 1 of every block of the positional store (T 64, P 10, short_seq_prob 0.3,
# seed 7), split_sentences x whole_word_masking, computed by the code before document separators existed.
ROWS_BEFORE_SEPARATORS = {(True, False): "e62145b16aa9c7c4", (True, True): "26f20e75ba3fbce5",
                          (False, False): "b88ef007c22b3437", (False, True): "2506a8cd58635322"}


@pytest.mark.parametrize("split,wwm", sorted(ROWS_BEFORE_SEPARATORS))
def test_packing_without_document_separators_gives_the_rows_of_before(positional, split, wwm):
    store = TokenStore(positional)
    digests = {}
    for separator in (False, True):
        sample = SampleConfig(64, 10, short_seq_prob=0.3, next_sentence=False, split_sentences=split,
                              whole_word_masking=wwm, document_separator=separator)
        builder = InstanceBuilder(store, sample, 7)
        rows = np.concatenate([builder.build(e, np.arange(builder.n_blocks)) for e in (0, 1)])
        digests[separator] = hashlib.sha256(rows.astype(np.int64).tobytes()).hexdigest()[:16]
    assert digests[False] == ROWS_BEFORE_SEPARATORS[split, wwm]
    assert digests[True] != digests[False]


@pytest.mark.parametrize("separator", [True, False])
def test_packing_without_short_targets_fills_every_window(prepared, separator):
    ds = PretrainingDataset(prepared, SampleConfig(T, P, next_sentence=False, short_seq_prob=0.0,
                                                   document_separator=separator), masking="dynamic")
    L = ds.get_batch(0, np.arange(len(ds)))["attention_mask"].sum(1)
    if not separator:
        assert torch.all(L[:-1] == T) and 2 < L[-1] <= T
    else:  # a window that starts or ends at a document boundary leaves that separator out (the row's own marks it)
        blocks = ds._get_builder().blocks
        assert torch.equal(L, torch.from_numpy(blocks[:, 1] - blocks[:, 0] + 2))
        assert torch.all(L[:-1] >= T - 2) and (L[:-1] == T).float().mean() > 0.9


def test_static_instances_are_dynamic_epochs_materialised(prepared):
    static = PretrainingDataset(prepared, SAMPLE, masking="static")
    dynamic = PretrainingDataset(prepared, SAMPLE, masking="dynamic")
    assert len(static) == 2 * len(dynamic)
    nb = len(dynamic)
    ids = np.array([0, 5, nb - 1])
    assert np.array_equal(static.get_rows(0, ids), dynamic.get_rows(0, ids))
    assert np.array_equal(static.get_rows(0, ids + nb), dynamic.get_rows(1, ids))
    assert not np.array_equal(dynamic.get_rows(0, ids), dynamic.get_rows(1, ids))  # epochs differ
    with pytest.raises(ValueError, match="no static instances"):
        PretrainingDataset(prepared, SampleConfig(256, 40), masking="static")


def test_phase2_length_from_the_same_store(prepared):
    ds = PretrainingDataset(prepared, SampleConfig(512, 80), masking="dynamic")
    b = ds.get_batch(0, np.arange(50))
    assert b["input_ids"].shape == (50, 512) and b["masked_positions"].shape == (50, 80)
    assert b["attention_mask"].sum(1).float().mean() > 256


def test_sample_is_independent_of_batch_composition(prepared):
    ds = PretrainingDataset(prepared, SAMPLE, masking="dynamic")
    alone = ds.get_rows(2, np.array([17]))
    inside = ds.get_rows(2, np.array([3, 17, 99]))
    assert np.array_equal(alone[0], inside[1])


def _global(batches_per_rank):
    """Interleave rank batches into global order: step m, rank 0..W-1."""
    out = []
    for step in zip(*batches_per_rank):
        for b in step:
            out.append(b["input_ids"])
    return torch.cat(out)


@pytest.mark.parametrize("masking", ["dynamic", "static"])
def test_one_two_three_ranks_see_the_same_global_order(prepared, masking):
    ds = PretrainingDataset(prepared, SAMPLE, masking=masking)
    orders = {}
    for world, b in ((1, 6), (2, 3), (3, 2)):
        loaders = [PretrainingLoader(ds, b, r, world, seed=7) for r in range(world)]
        assert len({len(l) for l in loaders}) == 1  # equal counts per rank
        per_rank = [list(l) for l in loaders]
        orders[world] = _global(per_rank)
    assert torch.equal(orders[1], orders[2]) and torch.equal(orders[1], orders[3])
    assert len(orders[1]) == (len(ds) // 6) * 6


def test_uneven_tail_drop_or_wrap_gives_equal_counts(prepared):
    ds = PretrainingDataset(prepared, SAMPLE, masking="dynamic")
    n = len(ds)
    for drop in (True, False):
        loaders = [PretrainingLoader(ds, 7, r, 3, drop_last=drop) for r in range(3)]
        counts = [sum(1 for _ in l) for l in loaders]
        expected = n // 21 if drop else -(-n // 21)
        assert counts == [expected] * 3
        assert all(len(l) == expected for l in loaders)
    with pytest.raises(ValueError, match="fewer than one global micro-batch .*lower config key .train.micro_batch_size."):
        PretrainingLoader(ds, n, 0, 2)


def test_epochs_advance_and_replay(prepared):
    ds = PretrainingDataset(prepared, SAMPLE, masking="dynamic")
    loader = PretrainingLoader(ds, 64, seed=3)
    e0 = [b["input_ids"] for b in loader]
    assert loader.state_dict()["epoch"] == 1 and loader.state_dict()["samples_consumed"] == 0
    e1 = [b["input_ids"] for b in loader]
    assert not torch.equal(e0[0], e1[0])
    loader.set_epoch(0)
    again = [b["input_ids"] for b in loader]
    assert all(torch.equal(x, y) for x, y in zip(e0, again))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_mid_epoch_is_exact(prepared, num_workers):
    ds = PretrainingDataset(prepared, SAMPLE, masking="dynamic")
    full = PretrainingLoader(ds, 8, seed=11)
    reference = [b for _, b in zip(range(12), full)]
    first = PretrainingLoader(ds, 8, seed=11, num_workers=num_workers)
    it = iter(first)
    for _ in range(7):
        next(it)
    state = first.state_dict()
    assert state["samples_consumed"] == 56
    resumed = PretrainingLoader(PretrainingDataset(prepared, SAMPLE, masking="dynamic"), 8, seed=11,
                                num_workers=num_workers)
    resumed.load_state_dict(state)
    nxt = [b for _, b in zip(range(5), resumed)]
    for got, want in zip(nxt, reference[7:12]):
        for k in want:
            assert torch.equal(got[k], want[k]), k


def test_resume_under_a_different_world_size(prepared):
    ds = PretrainingDataset(prepared, SAMPLE, masking="static")
    ref = PretrainingLoader(ds, 8, seed=5)
    reference = [b["input_ids"] for _, b in zip(range(6), ref)]
    # 2 ranks x 4: three global steps = 24 samples, then resume on 4 ranks x 2.
    two = [PretrainingLoader(ds, 4, r, 2, seed=5) for r in range(2)]
    for l in two:
        for _, _b in zip(range(3), l):
            pass
    state = two[0].state_dict()
    assert state == two[1].state_dict() and state["samples_consumed"] == 24
    four = [PretrainingLoader(ds, 2, r, 4, seed=5) for r in range(4)]
    for l in four:
        l.load_state_dict(state)
    got = _global([[b for _, b in zip(range(3), l)] for l in four])
    assert torch.equal(got, torch.cat(reference[3:6]))
    three = PretrainingLoader(ds, 5, 0, 3, seed=5)
    with pytest.raises(ValueError, match="not a multiple"):
        three.load_state_dict(state)


def test_tokenizer_identity_checked(prepared, tmp_path):
    ds = PretrainingDataset(prepared, SAMPLE)
    ds.check_tokenizer(VOCAB, True)
    with pytest.raises(ValueError, match="tokenizer mismatch"):
        ds.check_tokenizer(VOCAB, False)
    other = tmp_path / "vocab.txt"
    other.write_text(VOCAB.read_text().replace("\nvalu\n", "\nvalue\n"))
    with pytest.raises(ValueError, match="tokenizer mismatch"):
        ds.check_tokenizer(other, True)


def _greedy_blocks_reference(store: TokenStore, cfg: SampleConfig, targets: np.ndarray) -> np.ndarray:
    """The reference's greedy grouping, one sentence at a time, with the same per-start-sentence targets."""
    lengths = np.diff(store.sentence_starts).tolist()
    ds = store.document_starts.tolist()
    out = []
    if cfg.next_sentence:
        for d in range(len(ds) - 1):
            s, end = ds[d], ds[d + 1]
            while s < end:
                total, e = 0, s
                while e < end:
                    total += lengths[e]
                    e += 1
                    if total >= targets[s]:
                        break
                out.append((s, e, d))
                s = e
    else:
        doc_of = np.repeat(np.arange(len(ds) - 1), np.diff(ds)).tolist()

        def sep(e: int) -> int:  # a document separator before sentence e (inside a block: e is not its first)
            return int(cfg.document_separator and doc_of[e] != doc_of[e - 1])
        s = 0
        while s < len(lengths):
            total, e = 0, s
            while e < len(lengths) and (e == s or total + lengths[e] + sep(e) <= targets[s]):
                total += lengths[e] + (sep(e) if e > s else 0)
                e += 1
            out.append((s, e, doc_of[s]))
            s = e
    return np.asarray(out, np.int64).reshape(-1, 3)


@pytest.mark.parametrize("next_sentence,separator", [(True, True), (False, True), (False, False)])
@pytest.mark.parametrize("seq_len", [16, 128, 512])
def test_vectorised_blocks_equal_the_greedy_loop(prepared, next_sentence, separator, seq_len):
    store = TokenStore(prepared)
    cfg = SampleConfig(max_seq_length=seq_len, max_predictions_per_seq=4, short_seq_prob=0.3,
                       next_sentence=next_sentence, split_sentences=False, document_separator=separator)
    max_tokens = seq_len - (3 if next_sentence else 2)
    seed = 12345
    keys = sample_keys(seed, _BLOCK_DOMAIN, np.arange(store.num_sentences))
    short = _uniform(keys, 0) < cfg.short_seq_prob
    targets = np.where(short, 2 + np.floor(_uniform(keys, 1) * (max_tokens - 1)).astype(np.int64), max_tokens)
    assert 0.25 < short.mean() < 0.35 and targets.min() >= 2 and targets.max() == max_tokens
    blocks = build_blocks(store, cfg, seed)
    np.testing.assert_array_equal(blocks, _greedy_blocks_reference(store, cfg, targets.tolist()))
    assert blocks[0, 0] == 0 and blocks[-1, 1] == store.num_sentences and np.all(blocks[1:, 0] == blocks[:-1, 1])


def test_static_packed_instances_and_records_from_before_split_sentences(tmp_path):
    out = tmp_path / "packed"
    sample = SampleConfig(64, 10, next_sentence=False)
    prepare(PrepareConfig(inputs=["builtin:python-docs"], output=str(out), vocab_file=str(VOCAB), dupe_factor=1,
                          workers=1, sample=sample, heldout_fraction=0.0))
    static = PretrainingDataset(out, sample, masking="static")
    dynamic = PretrainingDataset(out, sample, masking="dynamic")
    assert len(static) == len(dynamic)
    ids = np.arange(len(dynamic))
    assert np.array_equal(static.get_rows(0, ids), dynamic.get_rows(0, ids))
    folder, meta = find_static(out, sample, 12345)
    assert folder.name.endswith("packed-split-sep-d1-seed12345")
    assert meta["sample_config"]["split_sentences"] is True and meta["sample_config"]["document_separator"] is True
    # A record written before document_separator existed is packing without separators, as it was built; one
    # from before split_sentences also is whole-sentence packing.
    record = dict(meta["sample_config"])
    del record["document_separator"]
    (folder / "instances.json").write_text(json.dumps({**meta, "sample_config": record}), encoding="utf-8")
    unmarked = SampleConfig(64, 10, next_sentence=False, document_separator=False)
    assert sample_from_record(record) == (unmarked, 12345)
    assert find_static(out, unmarked, 12345)[0] == folder
    with pytest.raises(ValueError, match="no static instances"):
        find_static(out, sample, 12345)
    del record["split_sentences"]
    (folder / "instances.json").write_text(json.dumps({**meta, "sample_config": record}), encoding="utf-8")
    whole = SampleConfig(64, 10, next_sentence=False, split_sentences=False, document_separator=False)
    assert sample_from_record(record) == (whole, 12345)
    assert find_static(out, whole, 12345)[0] == folder
    with pytest.raises(ValueError, match="no static instances"):
        find_static(out, dataclasses.replace(whole, document_separator=True), 12345)
    # Packing without separators keeps the folder (and blocks) names from before the setting existed.
    assert static_dir_name(unmarked, 12345, 1).endswith("-packed-split-d1-seed12345")
    assert static_dir_name(whole, 12345, 1).endswith("-packed-d1-seed12345")
    # NSP records carry neither setting: the same record as before they existed
    assert not {"split_sentences", "document_separator"} & set(sample_record(SampleConfig(), 1))


def test_whole_word_masking_follows_the_reference_greedy_fill(prepared):
    """google-research/bert create_masked_lm_predictions with do_whole_word_mask: words (a piece and its following
    ## pieces) in random order; a word that would overshoot num_to_predict is skipped and later, shorter words are
    still tried, so a sample gets exactly min(max_predictions, max(1, round(len * prob))) predictions whenever the
    words allow it. Replayed here with the builder's own word order."""
    from bertrain.data.samples import _uniform_bits

    sample = SampleConfig(T, P, whole_word_masking=True)
    ds = PretrainingDataset(prepared, sample, masking="dynamic")
    vocab = read_vocab(VOCAB)
    sub = np.array([t.startswith("##") for t in vocab])
    n = 600
    ids_ = np.arange(n)
    b = ds.get_batch(0, ids_)
    word_key = _uniform_bits(sample_keys(ds.seed, 0, ids_), np.arange(T, 2 * T))
    L = b["attention_mask"].sum(1).numpy()
    a_len = (b["token_type_ids"].numpy() == 0).sum(1) - (T - L)
    short = 0
    for i in range(n):
        tokens = _unmask(b, i).numpy()
        specials = {0, int(a_len[i]) - 1, int(L[i]) - 1}
        words: list[list[int]] = []
        for q in range(1, int(L[i])):
            if q in specials:
                continue
            if sub[tokens[q]] and words and words[-1][-1] == q - 1:
                words[-1].append(q)
            else:
                words.append([q])
        # a word is keyed by its first piece (a B that starts mid-word: by the [SEP] before it)
        words.sort(key=lambda w: (int(word_key[i, w[0] - sub[tokens[w[0]]]]), w[0]))
        num_to_predict = min(P, max(1, int(round(L[i] * 0.15))))
        expected: list[int] = []
        for w in words:
            if len(expected) >= num_to_predict:
                break
            if len(expected) + len(w) > num_to_predict:
                continue
            expected += w
        valid = b["masked_labels"][i] != -100
        got = sorted(b["masked_positions"][i][valid].tolist())
        assert got == sorted(expected), i
        short += len(expected) < num_to_predict
    assert short < n * 0.01  # the count is met but where no word fits the rest


def test_a_casing_mismatch_with_the_same_vocab_says_which_key_to_set(prepared):
    """Data prepared uncased, trained with data.do_lower_case false and the same vocab.txt: the general advice
    (re-run prepare with the model's vocab file) would change nothing; the error names the key and its value."""
    ds = PretrainingDataset(prepared, SAMPLE)
    with pytest.raises(ValueError, match=r"prepared uncased .*'data\.do_lower_case'\): set it to true"):
        ds.check_tokenizer(VOCAB, False)


def test_prepare_no_document_separator_flag(tmp_path, caplog):
    """`bertrain prepare --no-document-separator` writes static packing without separators (the folder name and
    record of before the setting existed); with --masking dynamic the flag is named as unused."""
    import argparse
    import logging

    from bertrain.commands import prepare as command

    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    out = tmp_path / "prepared"
    args = parser.parse_args(["--input", "builtin:python-docs", "--output", str(out), "--vocab-file", str(VOCAB),
                              "--max-seq-length", "64", "--max-predictions-per-seq", "10", "--no-next-sentence",
                              "--no-document-separator", "--dupe-factor", "1", "--workers", "1",
                              "--heldout-fraction", "0"])
    assert args.document_separator is False
    assert command.run(args) == 0
    unmarked = SampleConfig(64, 10, next_sentence=False, document_separator=False)
    folder, meta = find_static(out, unmarked, 12345)
    assert folder.name.endswith("-packed-split-d1-seed12345") and meta["sample_config"]["document_separator"] is False
    sep = read_vocab(VOCAB).index("[SEP]")
    b = PretrainingDataset(out, unmarked, masking="static").get_batch(0, np.arange(200))
    assert torch.all((_unmasked_rows(b)[0] == sep).sum(1) == 1)  # no separators
    assert parser.parse_args(["--input", "x"]).document_separator is True
    with caplog.at_level(logging.WARNING):
        command._warn_unused_sample_flags(SampleConfig(next_sentence=False, document_separator=False), "dynamic")
    assert "--no-document-separator (sample.document_separator: false)" in caplog.text
