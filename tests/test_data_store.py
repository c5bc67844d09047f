"""prepare + token store: stats, determinism, overwrite refusal, resume after a kill, corruption detection."""
from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest

import bertrain.data.prepare as prep
from bertrain.cli import main as cli_main
from bertrain.data.prepare import prepare
from bertrain.data.pretraining import PretrainingDataset
from bertrain.data.store import ShardWriter, TokenStore
from bertrain.data.tokenizer import load_tokenizer
from helpers import TINY_VOCAB, digest, prepare_config


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ref") / "data"
    prepare(prepare_config(out))
    return out


def test_stats_and_store_contents(reference):
    stats = json.loads((reference / "stats.json").read_text())
    for k in ("num_documents", "num_sentences", "num_tokens", "num_instances", "seconds", "input_bytes"):
        assert k in stats
    store = TokenStore(reference)
    assert stats["num_documents"] == store.num_documents == 79
    assert stats["num_tokens"] == store.num_tokens > 100_000
    assert stats["num_sentences"] == store.num_sentences
    assert len(store.shards) == stats["num_shards"] >= 3  # 30k-token shards
    ds = PretrainingDataset(reference, masking="dynamic")
    assert stats["num_instances"] == 2 * len(ds)
    # token ids decode back to the text of the first document
    first = load_tokenizer(TINY_VOCAB).decode(np.concatenate(store.document(0)).tolist())
    assert "assert" in first.split()[:5]


def test_same_seed_same_bytes_whatever_the_worker_count(reference, tmp_path):
    out = tmp_path / "again"
    prepare(prepare_config(out, workers=2))
    assert digest(out) == digest(reference)
    other = tmp_path / "seed"
    prepare(prepare_config(other, seed=1))
    a, b = digest(other), digest(reference)
    inst = [[v for k, v in d.items() if k.endswith("instances.bin")] for d in (a, b)]
    assert inst[0] != inst[1]  # another seed, other samples
    assert [v for k, v in a.items() if "shards/" in k] == [v for k, v in b.items() if "shards/" in k]


def test_refuses_to_overwrite_unless_asked(reference, tmp_path):
    out = tmp_path / "d"
    prepare(prepare_config(out, masking="dynamic"))
    before = digest(out)
    with pytest.raises(ValueError, match="--overwrite"):
        prepare(prepare_config(out, masking="dynamic"))
    assert digest(out) == before
    prepare(prepare_config(out, overwrite=True))  # replaced, now with static instances
    assert digest(out) == digest(reference)


def test_killed_prepare_resumes_and_matches(reference, tmp_path, monkeypatch, caplog):
    out = tmp_path / "k"
    real_close = ShardWriter.close
    calls = {"n": 0}

    def dying_close(self):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt("killed")
        return real_close(self)

    monkeypatch.setattr(ShardWriter, "close", dying_close)
    with pytest.raises(KeyboardInterrupt):
        prepare(prepare_config(out))
    assert not out.exists()  # nothing half-written looks complete
    partial = out.with_name("k.partial")
    assert len(list((partial / "shards").glob("*.bts"))) == 2 and not list((partial / "shards").glob(".*tmp"))
    with pytest.raises(ValueError, match="interrupted prepare"):
        PretrainingDataset(out)
    monkeypatch.setattr(ShardWriter, "close", real_close)
    processed = []
    real_tok = prep._tokenize_chunk
    monkeypatch.setattr(prep, "_tokenize_chunk", lambda c: processed.append(1) or real_tok(c))
    with caplog.at_level(logging.INFO):
        prepare(prepare_config(out))
    assert "resuming" in caplog.text and "2 shards" in caplog.text
    assert digest(out) == digest(reference)
    assert not partial.exists()
    resumed = len(processed)
    prepare(prepare_config(tmp_path / "fresh"))
    total = len(processed) - resumed
    assert 0 < resumed <= total - 4, (resumed, total)  # the chunks of the 2 finished shards were not redone


def test_corrupt_or_truncated_shard_is_reported_with_its_name(reference, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(reference, bad)
    shard = sorted((bad / "shards").glob("*.bts"))[1]
    data = bytearray(shard.read_bytes())
    data[200] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=rf"corrupt shard .*{shard.name}.*checksum"):
        TokenStore(bad)
    TokenStore(bad, verify=False)  # header and size are fine: only the full check sees it
    shard.write_bytes(bytes(data[:-100]))
    with pytest.raises(ValueError, match=rf"corrupt shard .*{shard.name}.*bytes"):
        TokenStore(bad, verify=False)
    data[10] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="header checksum"):
        TokenStore(bad, verify=False)
    inst = next(bad.glob("static-*/instances.bin"))
    inst.write_bytes(inst.read_bytes()[:-7])
    with pytest.raises(ValueError, match="corrupt static instances"):
        PretrainingDataset(bad, masking="static", verify=False).get_rows(0, np.arange(2))
    (bad / "stats.json").unlink()
    with pytest.raises(ValueError, match="not a complete prepared folder"):
        TokenStore(bad)


def test_bad_inputs_reported_in_stats_and_empty_corpus_refused(tmp_path):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.txt").write_bytes(b"A good sentence here. Another \xff one follows.\n\n" * 50
                                            + b"Plain text that is fine. " * 200)  # 50 bad bytes of 7400: < 1%
    (tmp_path / "in" / "empty.txt").write_bytes(b"")
    stats = prepare(prepare_config(tmp_path / "o", inputs=[str(tmp_path / "in")]))
    problems = stats["skipped"]["problems"]
    assert problems[str(tmp_path / "in" / "a.txt")]["replaced_characters"] == 50
    assert problems[str(tmp_path / "in" / "empty.txt")]["empty_files"] == 1
    with pytest.raises(ValueError, match="no text left"):
        prepare(prepare_config(tmp_path / "o2", inputs=[str(tmp_path / "in" / "empty.txt")]))
    assert not (tmp_path / "o2").exists()


def test_cli_vocab_prepare_inspect(tmp_path, capsys):
    assert cli_main(["vocab", "--input", "builtin:python-docs", "--output", str(tmp_path / "v"),
                     "--vocab-size", "800"]) == 0
    vocab = tmp_path / "v" / "vocab.txt"
    assert len(vocab.read_text().splitlines()) == 800
    capsys.readouterr()
    assert cli_main(["prepare", "--input", "builtin:python-docs", "--output", str(tmp_path / "p"),
                     "--vocab-file", str(vocab), "--max-seq-length", "64", "--max-predictions-per-seq", "10",
                     "--dupe-factor", "1", "--masking", "static", "--random-seed", "3", "--workers", "2"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["num_instances"] > 1000 and stats["num_documents"] == 79
    assert cli_main(["prepare", "--input", "builtin:python-docs", "--output", str(tmp_path / "p"),
                     "--vocab-file", str(vocab)]) == 2  # exists: refused with a one-line error
    assert "--overwrite" in capsys.readouterr().err
    assert cli_main(["inspect", str(tmp_path / "p"), "--samples", "4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["samples"]) == 4 and out["stats"]["num_tokens"] == stats["num_tokens"]
    s = out["samples"][0]
    assert s["tokens"][0] == "[CLS]" and s["tokens"][-1] == "[SEP]" and len(s["input_ids"]) <= 64
    assert len(s["tokens"]) == len(s["token_type_ids"]) and 1 <= len(s["masked_positions"]) <= 10
    assert s["next_sentence_label"] in (0, 1)
    assert cli_main(["prepare", "--input", "builtin:python-docs", "--output", str(tmp_path / "m"),
                     "--vocab-file", str(vocab), "--masking", "none"]) == 0
    capsys.readouterr()
    assert not list((tmp_path / "m").glob("static-*"))
    assert cli_main(["inspect", str(tmp_path / "m"), "--samples", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["masking"] == "dynamic"


def _sigterm_is_default(_: int) -> bool:
    import signal

    return signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def test_prepare_workers_die_of_sigterm_whatever_handler_the_parent_had() -> None:
    """A full test run hung for good in prepare's Pool.terminate: a forked worker waiting on the task queue's lock
    had inherited a Python SIGTERM handler and outlived the SIGTERM meant to end it. Workers now reset SIGTERM to its
    default, and a finished prepare ends its pool without signals (close, not terminate)."""
    import signal

    from bertrain.data import prepare

    previous = signal.signal(signal.SIGTERM, lambda *a: None)  # a handler that does not end the process
    try:
        pool = prepare._pool(2, lambda: None, ())
        try:
            assert pool.map(_sigterm_is_default, range(8)) == [True] * 8
        finally:
            prepare._end_pool(pool, finished=True)
    finally:
        signal.signal(signal.SIGTERM, previous)
