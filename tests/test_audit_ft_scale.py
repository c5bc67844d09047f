"""Fine-tuning and inference at real dataset sizes: memory that grew with the data beyond the outputs themselves.

Measured on MNLI-, QQP- and SQuAD-sized inputs (the audit's report): GLUE features of 393k pairs held 7.3 GB at
peak for 1.2 GB of arrays (every tokenizers Encoding at once); SQuAD's train features 3.8 GB for 1.1 GB (Python
lists of rows), and their cache 4.2 GB (an in-memory .npz and its bytes); `bertrain predict --output` kept every
output line to the end (~0.6 KB per input: GBs at 5M inputs). These tests pin the bounded forms on small inputs,
each with the same outputs as before.
"""
from __future__ import annotations

import json
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from helpers import save_tiny_head_model, save_tiny_model

WORDS = ("the cat sat on a mat and it is an object of the state for to be as in th de ex st se cl "
         "alpha beta gamma delta 12 345 , . ! ?").split()


def _text(rng: np.random.Generator, n: int) -> str:
    return " ".join(rng.choice(WORDS, size=n))


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from bertrain.tasks.common import load_task_tokenizer

    return load_task_tokenizer(save_tiny_model(tmp_path_factory.mktemp("tiny")))


class _CountingTokenizer:
    """A `tokenizers.Tokenizer` stand-in recording how many texts each encode_batch call got."""

    def __init__(self, inner) -> None:
        self.inner, self.calls = inner, []

    def encode_batch(self, inputs, *args, **kwargs):
        self.calls.append(len(inputs))
        return self.inner.encode_batch(inputs, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


# ----------------------------------------------------------------------------------------------- GLUE features

def test_glue_features_tokenize_a_chunk_at_a_time_with_the_same_arrays(tok, monkeypatch):
    """build_features encoded every example in one encode_batch call: an Encoding holds ~18 KB at 128 tokens, so
    MNLI's 393k pairs held 7.3 GB at peak for 1.2 GB of features (1.8 GB now). Chunks give the same arrays."""
    import dataclasses

    from bertrain.tasks import glue

    rng = np.random.default_rng(0)
    task = glue.get_task("mnli")
    examples = [glue.GlueExample(f"x:{i}", _text(rng, 5 + i % 40), _text(rng, 3 + i % 25), task.labels[i % 3], str(i))
                for i in range(50)]
    whole = glue.build_features(examples, task, tok, 32)  # one chunk: as before
    monkeypatch.setattr(glue, "ENCODE_CHUNK", 7)
    counting = _CountingTokenizer(tok.tokenizer)
    chunked = glue.build_features(examples, task, dataclasses.replace(tok, tokenizer=counting), 32)
    assert counting.calls and max(counting.calls) <= 7 and sum(counting.calls) == 50
    assert whole.keys() == chunked.keys()
    for k in whole:
        assert whole[k].dtype == chunked[k].dtype and np.array_equal(whole[k], chunked[k]), k
    # the reference: one encode_batch of everything, as build_features did before
    t = tok.tokenizer
    t.enable_truncation(max_length=32, strategy="longest_first")
    t.enable_padding(length=32, pad_id=tok.pad_id, pad_token="[PAD]")
    try:
        encs = t.encode_batch([(e.text_a, e.text_b) for e in examples], add_special_tokens=True)
    finally:
        t.no_truncation()
        t.no_padding()
    assert np.array_equal(chunked["input_ids"], np.asarray([e.ids for e in encs], dtype=np.int64))
    assert np.array_equal(chunked["token_type_ids"], np.asarray([e.type_ids for e in encs], dtype=np.int64))


# ----------------------------------------------------------------------------------------------- SQuAD features

def _squad_examples(n_paragraphs: int, per_paragraph: int, seed: int = 0):
    from bertrain.tasks.squad import SquadExample

    rng = np.random.default_rng(seed)
    out = []
    for p in range(n_paragraphs):
        context = _text(rng, 60 + 25 * (p % 7))
        words = context.split()
        for q in range(per_paragraph):
            k = int(rng.integers(0, len(words) - 3))
            answer = " ".join(words[k:k + 2])
            start = len(" ".join(words[:k])) + (1 if k else 0)
            assert context[start:start + len(answer)] == answer
            out.append(SquadExample(f"p{p}q{q}", _text(rng, 4 + q), context,
                                    [{"text": answer, "answer_start": start}]))
    return out


def _reference_squad_features(examples, tok, cfg, is_training):
    """The row-list form build_features had before (Google's run_squad windows): the expected arrays."""
    from bertrain.tasks.squad import answer_token_span, max_context_window

    L = cfg.max_seq_length
    rows = {k: [] for k in ("input_ids", "token_type_ids", "attention_mask", "start_positions", "end_positions",
                            "example_index", "offsets", "max_context")}
    for ei, ex in enumerate(examples):
        q_ids = tok.encode_plain([ex.question])[0].ids[: cfg.max_query_length]
        c = tok.encode_plain([ex.context])[0]
        tok_start = tok_end = -1
        if is_training and not ex.is_impossible:
            a = ex.answers[0]
            tok_start, tok_end = answer_token_span(c.offsets, a["answer_start"], a["answer_start"] + len(a["text"]))
        max_doc, spans, start = L - len(q_ids) - 3, [], 0
        while True:
            length = min(len(c.ids) - start, max_doc)
            spans.append((start, length))
            if start + length == len(c.ids):
                break
            start += min(length, cfg.doc_stride)
        owner = max_context_window(spans, len(c.ids))
        for si, (start, length) in enumerate(spans):
            ids = [tok.cls_id] + q_ids + [tok.sep_id] + c.ids[start:start + length] + [tok.sep_id]
            n_q = len(q_ids) + 2
            offs = np.full((L, 2), -1, dtype=np.int32)
            offs[n_q:n_q + length] = np.asarray(c.offsets[start:start + length], dtype=np.int32).reshape(length, 2)
            maxc = np.zeros(L, dtype=bool)
            maxc[n_q:n_q + length] = owner[start:start + length] == si
            sp = ep = 0
            if is_training and not ex.is_impossible and start <= tok_start and tok_end <= start + length - 1:
                sp, ep = tok_start - start + n_q, tok_end - start + n_q
            pad = L - len(ids)
            rows["input_ids"].append(ids + [tok.pad_id] * pad)
            rows["token_type_ids"].append([0] * n_q + [1] * (length + 1) + [0] * pad)
            rows["attention_mask"].append([1] * len(ids) + [0] * pad)
            rows["start_positions"].append(sp)
            rows["end_positions"].append(ep)
            rows["example_index"].append(ei)
            rows["offsets"].append(offs)
            rows["max_context"].append(maxc)
    feats = {k: np.asarray(v) for k, v in rows.items()}
    for k in ("input_ids", "token_type_ids", "attention_mask", "start_positions", "end_positions", "example_index"):
        feats[k] = feats[k].astype(np.int64)
    return feats


@pytest.mark.parametrize("is_training", [True, False])
def test_squad_features_are_the_windows_of_before(tok, is_training):
    from bertrain.tasks.squad import SquadFeatureConfig, build_features

    examples = _squad_examples(12, 3)
    examples[4].is_impossible, examples[4].answers = True, []
    cfg = SquadFeatureConfig(48, 16, 12)
    got = build_features(examples, tok, cfg, is_training)
    want = _reference_squad_features(examples, tok, cfg, is_training)
    assert len(got["input_ids"]) > len(examples)  # several windows per context
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape and np.array_equal(got[k], want[k]), k


def _peak_bytes(fn):
    tracemalloc.start()
    try:
        out = fn()
        return out, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_squad_features_are_built_in_their_final_arrays(tok):
    """Features built as Python lists of rows held ~30 KB per 384-token window until the end: SQuAD v1.1's train
    set peaked at 3.8 GB for 1.1 GB of features (1.8 GB now). The peak is now the arrays and a little more."""
    from bertrain.tasks.squad import SquadFeatureConfig, build_features

    examples = _squad_examples(40, 5)
    cfg = SquadFeatureConfig(128, 32, 16)
    build_features(examples[:5], tok, cfg, True)  # (warm up: imports and caches are not the features')
    feats, peak = _peak_bytes(lambda: build_features(examples, tok, cfg, True))
    size = sum(a.nbytes for a in feats.values())
    assert len(feats["input_ids"]) >= 200
    assert peak < 1.5 * size, f"peak {peak / 2**20:.1f} MiB for {size / 2**20:.1f} MiB of features"


def test_the_feature_cache_is_written_without_a_copy_in_memory(tok, tmp_path, monkeypatch):
    """The cache was an .npz built in a BytesIO and written from its bytes: two more copies of the features at once
    (1.1 GB each for SQuAD v1.1's train set). Streamed into the atomic temporary now; the same file bytes."""
    import io

    from bertrain.tasks import squad

    examples = _squad_examples(30, 4)
    cfg = squad.SquadFeatureConfig(128, 32, 16)
    feats = squad.build_features(examples, tok, cfg, True)
    data = tmp_path / "train.json"
    data.write_text("{}")  # (only hashed into the cache key here)
    monkeypatch.setattr(squad, "build_features", lambda *a, **k: feats)
    got, path = squad.load_or_build_features(data, examples, tok, cfg, True, tmp_path / "c")
    assert got is feats and path.is_file()
    buf = io.BytesIO()
    np.savez(buf, **feats)
    assert path.read_bytes() == buf.getvalue()  # the same .npz as before
    assert not [p for p in path.parent.iterdir() if p.name.endswith(".tmp")]
    cached, again = squad.load_or_build_features(data, examples, tok, cfg, True, tmp_path / "c")
    assert again == path and all(np.array_equal(cached[k], feats[k]) for k in feats)


def test_the_feature_cache_write_holds_no_copy_of_the_features(tok, tmp_path, monkeypatch):
    from bertrain.tasks import squad

    examples = _squad_examples(100, 4)
    cfg = squad.SquadFeatureConfig(128, 32, 16)
    feats = squad.build_features(examples, tok, cfg, True)
    data = tmp_path / "train.json"
    data.write_text("{}")
    monkeypatch.setattr(squad, "build_features", lambda *a, **k: feats)
    _, peak = _peak_bytes(lambda: squad.load_or_build_features(data, examples, tok, cfg, True, tmp_path / "c"))
    size = sum(a.nbytes for a in feats.values())
    assert size > 4 << 20
    # np.save copies one array at a time (the largest, offsets: a quarter of the features); before, 2x the features
    assert peak < 0.6 * size, f"writing the cache took {peak / 2**20:.1f} MiB for {size / 2**20:.1f} MiB of features"


# ----------------------------------------------------------------------------------------------- bertrain predict

@pytest.fixture(scope="module")
def cls_model(tmp_path_factory):
    from bertrain.model.bert import BertForSequenceClassification

    return save_tiny_head_model(BertForSequenceClassification, tmp_path_factory.mktemp("cls") / "m",
                                task={"kind": "classification", "task": "sst2", "labels": ["0", "1"],
                                      "max_seq_length": 32})


def _write_items(path: Path, n: int) -> None:
    rng = np.random.default_rng(1)
    path.write_text("".join(json.dumps({"text": _text(rng, 3 + i % 9)}) + "\n" for i in range(n)), encoding="utf-8")


def test_predict_output_is_streamed_into_its_temporary(cls_model, tmp_path, monkeypatch):
    """`--output` kept every line in a list and wrote them at the end (~0.6 KB per input: 5M inputs held GBs, then
    a joined copy and its bytes). The lines now go into the atomic temporary as they are predicted: while the
    second chunk is predicted, the first chunk's lines are in it already, and --output is untouched until the
    end; the file is the same."""
    from bertrain.cli import main
    from bertrain.deploy import predict as predict_mod

    items, out, ref = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "ref.jsonl"
    _write_items(items, 40)
    assert main(["predict", "--model", str(cls_model), "--input", str(items), "--batch-size", "2"]) == 0
    out.write_text("old\n")
    seen = []
    real = predict_mod.Predictor.predict

    def spy(self, chunk, **kw):
        temps = [p for p in tmp_path.iterdir() if p.name.startswith(".out.jsonl.")]
        seen.append((len(chunk), sum(p.read_text().count("\n") for p in temps), out.read_text()))
        return real(self, chunk, **kw)

    monkeypatch.setattr(predict_mod.Predictor, "predict", spy)
    assert main(["predict", "--model", str(cls_model), "--input", str(items), "--batch-size", "2", "--output",
                 str(out)]) == 0
    assert [n for n, _, _ in seen] == [16, 16, 8]
    assert [w for _, w, _ in seen] == [0, 16, 32]  # the earlier chunks' lines were written already
    assert all(o == "old\n" for _, _, o in seen)  # --output itself is replaced only at the end
    monkeypatch.setattr(predict_mod.Predictor, "predict", real)
    assert main(["predict", "--model", str(cls_model), "--input", str(items), "--batch-size", "2", "--output",
                 str(ref)]) == 0
    assert out.read_bytes() == ref.read_bytes()
    assert len(out.read_text().splitlines()) == 40
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_predict_stopped_midway_leaves_the_output_as_it_was(cls_model, tmp_path):
    """A bad line after some predictions (or Ctrl-C): --output is unchanged and its temporary is removed."""
    from bertrain.cli import main

    items, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write_items(items, 40)
    with open(items, "a", encoding="utf-8") as f:
        f.write("{not json\n")
    out.write_text("old\n")
    assert main(["predict", "--model", str(cls_model), "--input", str(items), "--batch-size", "2", "--output",
                 str(out)]) == 2
    assert out.read_text() == "old\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "out.jsonl"]


def test_predict_output_on_a_full_disk_says_so_and_keeps_the_old_file(cls_model, tmp_path, monkeypatch, capsys):
    """The lines are written while predicting now: a full disk midway is still the one-line write error naming
    --output and what was kept (exit 2), and the temporary is removed."""
    import contextlib
    import errno

    from bertrain.cli import main
    from bertrain.utils import io as io_mod

    items, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write_items(items, 40)
    out.write_text("old\n")
    real_open = io_mod.atomic_open

    class Full:
        def __init__(self, f):
            self.f, self.writes = f, 0

        def write(self, s):
            self.writes += 1
            if self.writes == 2:
                raise OSError(errno.ENOSPC, "No space left on device")
            return self.f.write(s)

        def __getattr__(self, name):
            return getattr(self.f, name)

    @contextlib.contextmanager
    def full_open(path, mode="wb", **kw):
        with real_open(path, mode, **kw) as f:
            yield Full(f)

    monkeypatch.setattr(io_mod, "atomic_open", full_open)
    assert main(["predict", "--model", str(cls_model), "--input", str(items), "--batch-size", "2", "--output",
                 str(out)]) == 2
    err = capsys.readouterr().err
    assert f"writing the predictions to {out}" in err and "is unchanged" in err and "Traceback" not in err
    assert out.read_text() == "old\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "out.jsonl"]
