"""The held-out set of `prepare`: no held-out text in training (on the real corpora), the rule and its record,
the same split whatever the workers, chunks, input order or a kill, the fixed evaluation set, stores prepared
before held-out sets existed, and `prepare --add-heldout`."""
from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import numpy as np
import pytest
import torch

import bertrain.data.prepare as prep
from bertrain.cli import main as cli_main
from bertrain.data.prepare import PrepareConfig, heldout_cut, prepare
from bertrain.data.pretraining import HeldoutEvalSet, PretrainingDataset
from bertrain.data.readers import CorpusConfig, SkipReport, iter_documents
from bertrain.data.samples import ROW_HEADER, SampleConfig
from bertrain.data.store import ShardWriter, TokenStore, document_hashes, heldout_status
from bertrain.data.tokenizer import load_tokenizer
from conftest import ASSETS, shared_file

TINY_VOCAB = str(ASSETS / "vocab-tiny.txt")
SHAKESPEARE = "text/tiny-shakespeare.txt"
WIKI = "wiki/enwiki-sample-pages-articles.xml.bz2"
SAMPLE = SampleConfig(max_seq_length=64, max_predictions_per_seq=10)


def prepare_config(out: Path, **kw) -> PrepareConfig:
    """One process, small shards, the tiny vocabulary, the python-docs corpus unless `kw` says otherwise."""
    return PrepareConfig(**{"inputs": ["builtin:python-docs"], "output": str(out), "vocab_file": TINY_VOCAB,
                            "workers": 1, "dupe_factor": 1, "shard_tokens": 30_000, **kw})


def shakespeare_config(out: Path, **kw) -> PrepareConfig:
    """Tiny Shakespeare (6,962 documents: ~70 held out by the default 1%) in 100k-token shards, static instances."""
    return prepare_config(out, **{"inputs": [str(shared_file(SHAKESPEARE))], "shard_tokens": 100_000, **kw})


def data_digest(folder: Path) -> dict[str, str]:
    """The sha256 of every file but stats.json (timings) and the blocks caches (built on first use: the evaluation
    set adds one to a shared fixture)."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != "stats.json" and "cache" not in p.relative_to(folder).parts}


def store_documents(folder: Path) -> list[tuple[int, ...]]:
    store = TokenStore(folder)
    return [tuple(np.concatenate(store.document(d)).tolist()) for d in range(store.num_documents)]


def token_hash(ids: tuple[int, ...]) -> int:
    """The rule's hash, written out again: BLAKE2b-64 of the ids as stored (uint16 for the tiny vocab)."""
    return int.from_bytes(hashlib.blake2b(np.asarray(ids, np.uint16).tobytes(), digest_size=8).digest(), "big")


@pytest.fixture(scope="module")
def shakespeare(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("sh") / "data"
    prepare(shakespeare_config(out))
    return out


@pytest.fixture(scope="module")
def wiki(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wiki") / "data"  # 98 articles: the minimum (5) is what takes documents here
    prepare(prepare_config(out, inputs=[str(shared_file(WIKI))], masking="none", workers=2, shard_tokens=200_000,
                           heldout_min_documents=5))
    return out


# ----------------------------------------------------------------------------------------------- 1. never trained on

def unmasked_text(rows: np.ndarray, sample: SampleConfig) -> str:
    """Instance rows with the masked tokens put back, as one string of ' id id ... ' rows separated by '|'."""
    T, P = sample.max_seq_length, sample.max_predictions_per_seq
    ids = rows[:, ROW_HEADER: ROW_HEADER + T].copy()
    for r, row in enumerate(rows):
        n = row[3]
        ids[r, row[ROW_HEADER + T: ROW_HEADER + T + n]] = row[ROW_HEADER + T + P: ROW_HEADER + T + P + n]
    return "|".join(" " + " ".join(map(str, row[: rows[r, 0]])) + " " for r, row in enumerate(ids))


@pytest.mark.parametrize("corpus", ["shakespeare", "wiki"])
def test_no_heldout_document_text_in_training_samples(corpus, request, tmp_path):
    """The real corpus, read, cleaned and tokenized again here (iter_documents + HF tokenizers): every document is
    in exactly one of the two stores, the held-out ones by the recorded rule; and sentences of held-out documents
    are in no training sample (masks undone), though the same search finds them in the evaluation set and in the
    samples of a store prepared without a held-out set."""
    out: Path = request.getfixturevalue(corpus)
    record = json.loads((out / "stats.json").read_text())["heldout"]
    tok = load_tokenizer(TINY_VOCAB)
    real = {}
    for doc in iter_documents([str(shared_file(SHAKESPEARE if corpus == "shakespeare" else WIKI))], CorpusConfig(),
                              SkipReport()):
        sentences = [tuple(e.ids) for e in tok.encode_batch(doc.sentences, add_special_tokens=False) if e.ids]
        if sentences:
            real[sum(sentences, ())] = sentences
    train, held = set(store_documents(out)), set(store_documents(out / "heldout"))
    assert len(held) >= 5 and not train & held and train | held == set(real)
    assert held == {ids for ids in real if token_hash(ids) <= int(record["cut"], 16)}
    assert record["num_documents"] == len(held)  # (no duplicate among the held-out documents here)

    sample = SampleConfig(64, 10) if corpus == "shakespeare" else SampleConfig(128, 20)
    training = PretrainingDataset(out, sample, masking="dynamic")
    seen = unmasked_text(np.concatenate([training.get_rows(e, np.arange(len(training))) for e in (0, 1)]), sample)
    stream = " " + " ".join(map(str, TokenStore(out).tokens_at(np.arange(TokenStore(out).num_tokens)))) + " "
    probes = sorted(" " + " ".join(map(str, s)) + " " for ids in held for s in real[ids] if len(s) >= 8)
    probes = [p for p in probes[:: max(1, len(probes) // 80)] if p not in stream]  # (80 suffice; a sentence also
    assert len(probes) >= 20  # in a training document proves nothing)
    assert not [p for p in probes if p in seen]
    evaluation = HeldoutEvalSet(out, sample)
    assert sum(p in unmasked_text(evaluation.rows, sample) for p in probes) >= len(probes) // 4
    if corpus == "shakespeare":  # the search would find them, had they been trained on
        prepare(shakespeare_config(tmp_path / "all", heldout_fraction=0, masking="dynamic"))
        every = PretrainingDataset(tmp_path / "all", sample, masking="dynamic")
        seen = unmasked_text(np.concatenate([every.get_rows(e, np.arange(len(every))) for e in (0, 1)]), sample)
        assert sum(p in seen for p in probes) >= len(probes) // 2


# ----------------------------------------------------------------------------------------------- 2. rule, record

def test_rule_is_order_free_with_minimum_ties_and_small_corpus_refusal():
    rng = np.random.default_rng(0)
    hashes = rng.integers(0, 2**63, 5000, dtype=np.uint64) * np.uint64(2)
    cut, why = heldout_cut(hashes, 0.01, 10)
    assert why == "" and cut == int(0.01 * 2.0**64) - 1 and 30 < (hashes <= cut).sum() < 70
    assert heldout_cut(rng.permutation(hashes), 0.01, 10) == (cut, "")
    cut, _ = heldout_cut(hashes, 0.001, 20)  # ~5 below 0.1%: topped up with the next-smallest
    assert (hashes <= cut).sum() == 20 and cut == np.sort(hashes)[19]
    tied = np.concatenate([hashes, np.sort(hashes)[19:20]])  # a duplicate document goes with its twin
    assert (tied <= heldout_cut(tied, 0.001, 20)[0]).sum() == 21
    assert heldout_cut(hashes[:99], 0.01, 10)[0] is None and "too small" in heldout_cut(hashes[:99], 0.01, 10)[1]
    assert heldout_cut(hashes[:100], 0.01, 10)[0] is not None  # 10 of 100: exactly the 10% allowed
    assert heldout_cut(hashes, 0.0, 10) == (None, "disabled (heldout_fraction 0)")
    assert "over half" in heldout_cut(np.array([0, 1, 2**63 + 5], np.uint64), 0.5, 0)[1]


def test_stats_record_and_minimum_on_wikipedia(wiki):
    """98 articles, 1% and a minimum of 5: the 5 smallest hashes; stats.json and heldout/stats.json record it."""
    stats = json.loads((wiki / "stats.json").read_text())
    record = stats["heldout"]
    assert record == json.loads((wiki / "heldout" / "stats.json").read_text())
    assert {k: record[k] for k in ("dir", "reason", "fraction", "min_documents")} == \
        {"dir": "heldout", "reason": "", "fraction": 0.01, "min_documents": 5}
    assert "hash" in record["rule"] and "min_documents" in record["rule"]
    train, held = TokenStore(wiki), TokenStore(wiki / "heldout")
    assert (record["num_documents"], record["num_sentences"], record["num_tokens"]) == \
        (held.num_documents, held.num_sentences, held.num_tokens) and held.num_documents == 5
    assert stats["num_documents"] == train.num_documents == 98 - 5 and stats["num_tokens"] == train.num_tokens
    h_train = np.concatenate([document_hashes(s) for s in train.shards])
    h_held = np.concatenate([document_hashes(s) for s in held.shards])
    assert h_held.max() < h_train.min() and (h_held < np.uint64(2**64 // 100)).sum() < 5  # topped up
    assert record["document_hashes_sha256"] == hashlib.sha256(np.sort(h_held).astype(">u8").tobytes()).hexdigest()
    assert heldout_status(wiki).dir == wiki / "heldout"


def test_too_small_corpus_gets_none_and_fraction_zero_disables(tmp_path, capsys):
    """The built-in python-docs (79 documents): 10 held out would be 13%, so none (training keeps every document,
    the same bytes as without held-out sets); --heldout-fraction 0 says "disabled"."""
    argv = ["prepare", "--input", "builtin:python-docs", "--vocab-file", TINY_VOCAB, "--masking", "none",
            "--workers", "1"]
    assert cli_main(argv + ["--output", str(tmp_path / "small")]) == 0
    capsys.readouterr()
    assert cli_main(argv + ["--output", str(tmp_path / "off"), "--heldout-fraction", "0"]) == 0
    assert json.loads(capsys.readouterr().out)["heldout"]["reason"] == "disabled (heldout_fraction 0)"
    assert data_digest(tmp_path / "small") == data_digest(tmp_path / "off") and TokenStore(tmp_path / "small").num_documents == 79
    status = heldout_status(tmp_path / "small")
    assert status.dir is None and "too small" in status.reason and "79 documents" in status.reason
    assert not (tmp_path / "small" / "heldout").exists()
    with pytest.raises(ValueError, match="too small"):
        HeldoutEvalSet(tmp_path / "small", SAMPLE)
    assert cli_main(["prepare", "--input", "builtin:python-docs", "--vocab-file", TINY_VOCAB]) == 2
    assert "needs --output" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------- 3. determinism

def test_same_split_whatever_workers_chunks_and_input_order(shakespeare, tmp_path):
    prepare(shakespeare_config(tmp_path / "w2", workers=2))
    assert data_digest(tmp_path / "w2") == data_digest(shakespeare)
    record = json.loads((shakespeare / "stats.json").read_text())["heldout"]
    prepare(shakespeare_config(tmp_path / "c", chunk_bytes=20_000, shard_tokens=60_000, masking="none"))
    other = json.loads((tmp_path / "c" / "stats.json").read_text())["heldout"]
    assert other == record and set(store_documents(tmp_path / "c" / "heldout")) == \
        set(store_documents(shakespeare / "heldout"))
    sh = str(shared_file(SHAKESPEARE))
    a = prepare(shakespeare_config(tmp_path / "a", inputs=["builtin:python-docs", sh], masking="none"))["heldout"]
    b = prepare(shakespeare_config(tmp_path / "b", inputs=[sh, "builtin:python-docs"], masking="none"))["heldout"]
    assert a == b and a["num_documents"] >= record["num_documents"]
    assert set(store_documents(tmp_path / "a" / "heldout")) == set(store_documents(tmp_path / "b" / "heldout"))


def _kill_at(monkeypatch, where: str) -> None:
    """Raise KeyboardInterrupt at a point of the build: stage 1's third shard, the second shard split, or the
    second replacement of a shard by its training part (after the split was recorded)."""
    calls = []
    if where == "tokenizing":
        real = ShardWriter.close

        def close(self):
            calls.append(1)
            if len(calls) == 3:
                raise KeyboardInterrupt
            return real(self)
        monkeypatch.setattr(ShardWriter, "close", close)
    elif where == "splitting":
        real = prep._split_shard

        def split(*args):
            calls.append(1)
            if len(calls) == 2:
                raise KeyboardInterrupt
            return real(*args)
        monkeypatch.setattr(prep, "_split_shard", split)
    else:
        real = os.replace

        def replace(src, dst):
            if Path(src).parent.name == "split":
                calls.append(1)
                if len(calls) == 2:
                    raise KeyboardInterrupt
            return real(src, dst)
        monkeypatch.setattr(prep.os, "replace", replace)


@pytest.mark.parametrize("where", ["tokenizing", "splitting", "replacing"])
def test_killed_prepare_resumes_to_the_same_split_and_bytes(shakespeare, tmp_path, monkeypatch, caplog, where):
    out = tmp_path / "data"
    _kill_at(monkeypatch, where)
    with pytest.raises(KeyboardInterrupt):
        prepare(shakespeare_config(out))
    monkeypatch.undo()
    assert not out.exists() and (tmp_path / "data.partial" / "progress.json").is_file()
    with caplog.at_level(logging.INFO):
        prepare(shakespeare_config(out))
    assert "resuming" in caplog.text
    assert data_digest(out) == data_digest(shakespeare) and not (tmp_path / "data.partial").exists()


# ----------------------------------------------------------------------------------------------- 4. evaluation set

def test_eval_set_same_micro_batches_whatever_world_size(shakespeare):
    ev = HeldoutEvalSet(shakespeare, SAMPLE)
    (index, whole), = list(ev.batches(len(ev)))
    assert index == 0
    train = PretrainingDataset(shakespeare, SAMPLE).get_batch(0, np.arange(3))
    def layout(batch):
        return {k: (v.dtype, v.shape[1:]) for k, v in batch.items()}
    assert layout(whole) == layout(train)  # the training loader's batch dict
    assert len(ev) > 50 and (whole["masked_labels"] != -100).sum(1).min() >= 1
    alone = dict(ev.batches(8))
    for world in (1, 2, 3, 7):
        per_rank = [list(ev.batches(8, r, world)) for r in range(world)]
        assert len({len(b) for b in per_rank}) == 1  # every rank runs as many micro-batches
        real = {k: b for bs in per_rank for k, b in bs if k >= 0}
        assert sorted(real) == list(range(ev.num_batches(8)))  # each micro-batch once, the same ones as alone
        assert all(torch.equal(real[k][n], alone[k][n]) for k in real for n in whole)
        for k, b in (kb for bs in per_rank for kb in bs if kb[0] < 0):  # fillers add no target
            assert (b["masked_labels"] == -100).all() and (b["next_sentence_labels"] == -100).all()
        rows = {n: torch.cat([real[k][n] for k in sorted(real)]) for n in whole}
        assert all(torch.equal(rows[n], whole[n]) for n in whole)


def test_eval_set_independent_of_training_seed_and_fixed_by_eval_seed(shakespeare, tmp_path):
    ev = HeldoutEvalSet(shakespeare, SAMPLE)
    prepare(shakespeare_config(tmp_path / "seed7", seed=7))  # other static instances: the same evaluation set
    assert np.array_equal(HeldoutEvalSet(tmp_path / "seed7", SAMPLE).rows, ev.rows)
    assert np.array_equal(HeldoutEvalSet(shakespeare, SAMPLE).rows, ev.rows)  # again, its blocks cached now
    other = HeldoutEvalSet(shakespeare, SAMPLE, eval_seed=1)
    assert not np.array_equal(other.rows[:, ROW_HEADER:], ev.rows[:, ROW_HEADER:])
    some = HeldoutEvalSet(shakespeare, SAMPLE, max_samples=20)
    assert len(some) == 20 and np.array_equal(some.rows, ev.rows[some.block_ids])  # spread over the whole set
    assert some.block_ids[-1] >= len(ev) * 0.9


# ----------------------------------------------------------------------------------------------- 5. older stores

def old_store(path: Path) -> dict[str, str]:
    """A store as prepared before held-out sets existed: held-out disabled has today's bytes; its stats.json had no
    "heldout" entry. Returns its digest."""
    prepare(shakespeare_config(path, heldout_fraction=0))
    stats = json.loads((path / "stats.json").read_text())
    del stats["heldout"]
    (path / "stats.json").write_text(json.dumps(stats))
    return data_digest(path)


def test_old_store_trains_says_no_heldout_and_gets_one_with_add_heldout(shakespeare, tmp_path, capsys, caplog):
    out = tmp_path / "old"
    before = old_store(out)
    assert len(PretrainingDataset(out, SampleConfig(), masking="static")) > 7000  # trains as before
    status = heldout_status(out)
    assert status.dir is None and "before held-out sets existed" in status.reason and "--add-heldout" in status.reason
    with pytest.raises(ValueError, match="before held-out sets existed"):
        HeldoutEvalSet(out, SAMPLE)
    with caplog.at_level("WARNING"):  # flags --add-heldout does not use are named (they were ignored silently)
        assert cli_main(["prepare", "--add-heldout", str(out), "--workers", "1", "--seed", "7",
                         "--max-seq-length", "64"]) == 0
    assert "--max-seq-length, --seed are not used (only --heldout-* and --workers apply)" in caplog.text
    stats = json.loads(capsys.readouterr().out)
    assert data_digest(out) == data_digest(shakespeare)  # what a fresh prepare makes, static instances rebuilt
    assert stats["heldout"] == json.loads((shakespeare / "stats.json").read_text())["heldout"]
    assert stats["num_instances"] == json.loads((shakespeare / "stats.json").read_text())["num_instances"]
    (moved,) = tmp_path.glob("old.replaced-*")
    assert data_digest(moved) == before  # the old folder, moved aside untouched
    assert np.array_equal(HeldoutEvalSet(out, SAMPLE).rows, HeldoutEvalSet(shakespeare, SAMPLE).rows)
    assert cli_main(["prepare", "--add-heldout", str(out)]) == 2
    assert "already has a held-out set" in capsys.readouterr().err


def test_add_heldout_resumes_and_refuses_a_too_small_store(shakespeare, tmp_path, monkeypatch, capsys):
    out = tmp_path / "old"
    old_store(out)
    _kill_at(monkeypatch, "splitting")
    with pytest.raises(KeyboardInterrupt):
        prep.add_heldout(out, workers=1)
    monkeypatch.undo()
    assert (tmp_path / "old.partial" / "progress.json").is_file()
    prep.add_heldout(out, workers=1)
    assert data_digest(out) == data_digest(shakespeare) and not (tmp_path / "old.partial").exists()
    small = tmp_path / "small"
    prepare(prepare_config(small, masking="none", heldout_fraction=0))
    before = data_digest(small)
    assert cli_main(["prepare", "--add-heldout", str(small), "--workers", "1"]) == 2
    assert "too small" in capsys.readouterr().err
    assert data_digest(small) == before and not (tmp_path / "small.partial").exists()
    assert not list(tmp_path.glob("small.replaced-*"))
