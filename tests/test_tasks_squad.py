"""SQuAD reading, validation, sliding-window features, caching and answer postprocessing."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from conftest import ASSETS, shared_file

from bertrain.tasks.common import load_task_tokenizer
from bertrain.tasks.squad import (SquadExample, SquadFeatureConfig, SquadPostprocessConfig, apply_null_threshold,
                                  build_features, load_or_build_features, postprocess_predictions, read_squad)


@pytest.fixture(scope="module")
def tiny_tok(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    (d / "vocab.txt").write_bytes((ASSETS / "vocab-tiny.txt").read_bytes())
    (d / "tokenizer_config.json").write_text(json.dumps({"do_lower_case": True}))
    return load_task_tokenizer(d)


@pytest.fixture(scope="module")
def minilm_tok(minilm_path):
    return load_task_tokenizer(minilm_path)


def write(tmp_path: Path, obj, name="d.json") -> Path:
    p = tmp_path / name
    p.write_text(obj if isinstance(obj, str) else json.dumps(obj, indent=1))
    return p


def squad(context: str, qas: list[dict], version="1.1") -> dict:
    return {"version": version, "data": [{"title": "t", "paragraphs": [{"context": context, "qas": qas}]}]}


# ----------------------------------------------------------------------------------------------- bad input

def test_malformed_json_names_file_and_line(tmp_path):
    p = write(tmp_path, '{"version": "1.1",\n "data": [\n  {"title": "x",, }\n]}')
    with pytest.raises(ValueError, match=rf"{p}: malformed JSON at line 3"):
        read_squad(p)


def test_answer_start_mismatch_names_question(tmp_path):
    p = write(tmp_path, squad("The cat sat on the mat.", [
        {"id": "good", "question": "Who sat?", "answers": [{"text": "The cat", "answer_start": 0}]},
        {"id": "q-bad", "question": "Where?", "answers": [{"text": "the mat", "answer_start": 10}]}]))
    with pytest.raises(ValueError, match=r"question id q-bad: answer 'the mat' does not match the context at "
                                         r"answer_start 10"):
        read_squad(p)


@pytest.mark.parametrize("context", ["", "   \n"])
def test_empty_context_names_question(tmp_path, context):
    p = write(tmp_path, squad(context, [{"id": "q7", "question": "?", "answers": [{"text": "a", "answer_start": 0}]}]))
    with pytest.raises(ValueError, match=r"question id q7: empty context"):
        read_squad(p)


def test_other_structural_errors(tmp_path):
    ok = {"id": "q1", "question": "Who?", "answers": [{"text": "Ann", "answer_start": 0}]}
    with pytest.raises(ValueError, match="duplicate question id"):
        read_squad(write(tmp_path, squad("Ann ran.", [ok, ok])))
    with pytest.raises(ValueError, match="not a SQuAD file"):
        read_squad(write(tmp_path, "[1, 2]"))
    imp = {"id": "q2", "question": "Why?", "answers": [], "is_impossible": True}
    with pytest.raises(ValueError, match="question id q2: unanswerable question in a file read as SQuAD v1.1"):
        read_squad(write(tmp_path, squad("Ann ran.", [ok, imp])), version_2_with_negative=False)
    with pytest.raises(ValueError, match="question id q3: no answers and not marked is_impossible"):
        read_squad(write(tmp_path, squad("Ann ran.", [{"id": "q3", "question": "Who?", "answers": []}])))
    bad_plausible = {"id": "q4", "question": "Why?", "answers": [], "is_impossible": True,
                     "plausible_answers": [{"text": "ran", "answer_start": 0}]}
    with pytest.raises(ValueError, match="question id q4: plausible answer 'ran' does not match"):
        read_squad(write(tmp_path, squad("Ann ran.", [bad_plausible], "v2.0")))


def test_v2_reader(tmp_path):
    p = write(tmp_path, squad("Ann ran home.", [
        {"id": "a", "question": "Who ran?", "answers": [{"text": "Ann", "answer_start": 0}], "is_impossible": False},
        {"id": "n", "question": "Who flew?", "answers": [], "is_impossible": True,
         "plausible_answers": [{"text": "home", "answer_start": 8}]}], "v2.0"))
    ex = read_squad(p, version_2_with_negative=True)
    assert [(e.qid, e.is_impossible, len(e.plausible_answers)) for e in ex] == [("a", False, 0), ("n", True, 1)]


# ----------------------------------------------------------------------------------------------- features

def test_real_xquad_answers_map_back_exactly(minilm_tok):
    """Every answerable question of the real file: the labelled token span, mapped back through the offsets, is
    the answer text — exactly, unless the gold answer ends inside a WordPiece token (then the span is the
    smallest token-aligned superset)."""
    path = shared_file("squad/xquad-en-part1.json")
    examples = read_squad(path)
    feats = build_features(examples, minilm_tok, SquadFeatureConfig(), is_training=True)
    covered = set()
    exact = superset = 0
    for i in range(len(feats["input_ids"])):
        s, e = int(feats["start_positions"][i]), int(feats["end_positions"][i])
        if s == 0:
            assert e == 0
            continue
        ex = examples[feats["example_index"][i]]
        a = ex.answers[0]
        c0, c1 = feats["offsets"][i][s][0], feats["offsets"][i][e][1]
        text = ex.context[c0:c1]
        if text == a["text"]:
            exact += 1
        else:  # token-aligned superset of the answer, never shorter or shifted
            assert c0 <= a["answer_start"] and c1 >= a["answer_start"] + len(a["text"]), (ex.qid, text)
            assert c1 - c0 - len(a["text"]) < 5, (ex.qid, text)
            superset += 1
        covered.add(ex.qid)
    assert len(covered) == len(examples) == 632  # at 384 tokens every answer lies inside some window
    assert exact >= 0.99 * (exact + superset)


def test_doc_stride_windows_cover_the_context(minilm_tok):
    path = shared_file("squad/xquad-en-part1.json")
    examples = read_squad(path)[:80]
    cfg = SquadFeatureConfig(max_seq_length=128, doc_stride=32, max_query_length=32)
    feats = build_features(examples, minilm_tok, cfg, is_training=False)
    n_tokens = {i: len(e.ids) for i, e in enumerate(minilm_tok.encode_plain([e.context for e in examples]))}
    multi = 0
    for ei, ex in enumerate(examples):
        rows = np.flatnonzero(feats["example_index"] == ei)
        multi += len(rows) > 1
        starts = []
        max_ctx_count: dict[tuple[int, int], int] = {}
        for r in rows:
            ctx = feats["offsets"][r][:, 0] >= 0
            # window layout: [CLS] q [SEP] context [SEP] pad; context tokens are contiguous and typed 1
            assert (feats["token_type_ids"][r][ctx] == 1).all()
            assert feats["input_ids"][r][0] == minilm_tok.cls_id
            spans = [tuple(o) for o in feats["offsets"][r][ctx]]
            starts.append(spans)
            for sp, is_max in zip(spans, feats["max_context"][r][ctx]):
                max_ctx_count[sp] = max_ctx_count.get(sp, 0) + int(is_max)
        # the union of the windows is every context token, and each token is "max context" in exactly one
        assert len(max_ctx_count) == n_tokens[ei]
        assert set(max_ctx_count.values()) == {1}
        # consecutive windows start doc_stride tokens apart
        all_spans = sorted(max_ctx_count)
        for w in range(1, len(starts)):
            assert all_spans.index(starts[w][0]) - all_spans.index(starts[w - 1][0]) == cfg.doc_stride
    assert multi > 10  # the check above actually exercised several windows


def test_question_truncation_and_out_of_window_labels(tiny_tok):
    context = " ".join(f"w{i}" for i in range(200)) + " target end"
    ex = SquadExample("q", "what " * 100, context, [{"text": "target", "answer_start": context.index("target")}])
    cfg = SquadFeatureConfig(max_seq_length=64, doc_stride=16, max_query_length=8)
    f = build_features([ex], tiny_tok, cfg, is_training=True)
    assert (f["token_type_ids"][:, 1:9] == 0).all() and (f["input_ids"][:, 9] == tiny_tok.sep_id).all()
    labelled = np.flatnonzero(f["start_positions"] > 0)
    assert len(labelled) >= 1 and len(f["input_ids"]) > len(labelled)  # other windows point at [CLS]
    for r in labelled:
        s, e = f["start_positions"][r], f["end_positions"][r]
        assert context[f["offsets"][r][s][0]:f["offsets"][r][e][1]] == "target"


def test_feature_cache(tmp_path, tiny_tok):
    data = write(tmp_path, squad("Ann ran home today.", [
        {"id": "a", "question": "Who ran?", "answers": [{"text": "Ann", "answer_start": 0}]}]))
    examples = read_squad(data)
    cfg = SquadFeatureConfig(max_seq_length=32, doc_stride=8, max_query_length=8)
    f1, p1 = load_or_build_features(data, examples, tiny_tok, cfg, True, tmp_path / "cache")
    assert p1.is_file()
    f2, p2 = load_or_build_features(data, examples, tiny_tok, cfg, True, tmp_path / "cache")
    assert p2 == p1 and all(np.array_equal(f1[k], f2[k]) for k in f1)
    # different settings, tokenizer casing or data -> a different key
    _, p3 = load_or_build_features(data, examples, tiny_tok, SquadFeatureConfig(32, 4, 8), True, tmp_path / "cache")
    assert p3 != p1
    data.write_text(data.read_text().replace("today", "now"))
    _, p4 = load_or_build_features(data, read_squad(data), tiny_tok, cfg, True, tmp_path / "cache")
    assert p4 != p1
    assert not list((tmp_path / "cache").glob(".*.tmp"))  # atomic writes leave no temporaries


# ----------------------------------------------------------------------------------------------- postprocess

def _one_window(tok, context: str, question="who?"):
    ex = SquadExample("q1", question, context, [])
    feats = build_features([ex], tok, SquadFeatureConfig(max_seq_length=64, doc_stride=16, max_query_length=16),
                           is_training=False)
    return ex, feats


def _token_index(feats, context: str, word: str, row: int = 0, last: bool = False) -> int:
    """The first token of `word` in the window (or its last token: the tiny vocab splits words into pieces)."""
    c0 = context.index(word)
    if last:
        return int(np.flatnonzero(feats["offsets"][row][:, 1] == c0 + len(word))[0])
    return int(np.flatnonzero(feats["offsets"][row][:, 0] == c0)[0])


def test_postprocess_picks_best_valid_span(tiny_tok):
    context = "the quick brown fox jumps over the lazy dog"
    ex, feats = _one_window(tiny_tok, context)
    L = feats["input_ids"].shape[1]
    start, end = np.zeros((1, L), np.float32), np.zeros((1, L), np.float32)
    s, e = _token_index(feats, context, "brown"), _token_index(feats, context, "fox", last=True)
    start[0, s], end[0, e] = 5.0, 4.0
    end[0, s - 1] = 9.0   # end before start: invalid
    start[0, 1] = 9.0     # a question token: invalid
    preds, nbest, _ = postprocess_predictions([ex], feats, start, end, SquadPostprocessConfig(), False)
    assert preds["q1"] == "brown fox"
    assert nbest["q1"][0]["text"] == "brown fox" and nbest["q1"][0]["char_start"] == context.index("brown")
    assert sum(p["probability"] for p in nbest["q1"]) == pytest.approx(1.0)
    assert len({p["text"] for p in nbest["q1"]}) == len(nbest["q1"]) <= 20
    # max_answer_length in tokens
    end[:] = 0
    end[0, _token_index(feats, context, "dog", last=True)] = 9.0
    preds, _, _ = postprocess_predictions([ex], feats, start, end, SquadPostprocessConfig(max_answer_length=3), False)
    assert "dog" not in preds["q1"]


def test_postprocess_v2_null_answer(tiny_tok):
    context = "the quick brown fox"
    ex, feats = _one_window(tiny_tok, context)
    L = feats["input_ids"].shape[1]
    start, end = np.zeros((1, L), np.float32), np.zeros((1, L), np.float32)
    s, e = _token_index(feats, context, "fox"), _token_index(feats, context, "fox", last=True)
    start[0, s], end[0, e] = 2.0, 2.0
    start[0, 0], end[0, 0] = 3.0, 3.5   # null score 6.5 > span 4.0
    preds, nbest, odds = postprocess_predictions([ex], feats, start, end, SquadPostprocessConfig(), True)
    assert preds["q1"] == "" and odds["q1"] == pytest.approx(2.5)
    assert "" in [p["text"] for p in nbest["q1"]]
    # the same scores with a higher threshold answer the span
    assert apply_null_threshold(nbest, odds, 3.0)["q1"] == "fox"
    preds, _, _ = postprocess_predictions([ex], feats, start, end, SquadPostprocessConfig(null_score_diff_threshold=3.0),
                                          True)
    assert preds["q1"] == "fox"


@pytest.mark.parametrize("context, answer", [
    ("The letter was written by Jose\u0301 Marti\u0301 in Havana.", "Jose\u0301 Marti\u0301"),  # NFD text
    ("\u0930\u093e\u091c\u0927\u093e\u0928\u0940 \u0926\u093f\u0932\u094d\u0932\u0940 \u0939\u0948",
     "\u0939\u0948"),  # Devanagari: the word's final vowel sign (U+0948) is a nonspacing mark
])
def test_an_answer_keeps_the_combining_marks_after_its_last_letter(tiny_tok, context, answer):
    """An uncased tokenizer strips accents, so a token's offsets stop before a combining mark that follows its
    last letter; the answer must still be the context's text (before: 'Jose\u0301 Marti', exact match 0)."""
    from bertrain.tasks.metrics import evaluate_squad

    ex, feats = _one_window(tiny_tok, context)
    L = feats["input_ids"].shape[1]
    c0, c1 = context.index(answer), context.index(answer) + len(answer)
    offs = feats["offsets"][0]
    s = int(np.flatnonzero(offs[:, 0] == c0)[0])
    e = int(np.flatnonzero((offs[:, 0] >= 0) & (offs[:, 1] <= c1))[-1])
    assert offs[e, 1] < c1  # the tokenizer's own span stops before the mark: what this test is about
    start, end = np.zeros((1, L), np.float32), np.zeros((1, L), np.float32)
    start[0, s], end[0, e] = 5.0, 5.0
    for v2 in (False, True):
        preds, nbest, _ = postprocess_predictions([ex], feats, start, end, SquadPostprocessConfig(), v2)
        assert preds["q1"] == answer
        assert (nbest["q1"][0]["char_start"], nbest["q1"][0]["char_end"]) == (c0, c1)
    dataset = squad(context, [{"id": "q1", "question": "who?", "answers": [{"text": answer, "answer_start": c0}]}])
    assert evaluate_squad(dataset, preds, version="1.1") == {"exact_match": 100.0, "f1": 100.0}


def test_postprocess_null_score_is_min_over_windows(tiny_tok):
    context = " ".join(f"w{i}" for i in range(80))
    ex = SquadExample("q1", "who?", context, [])
    feats = build_features([ex], tiny_tok, SquadFeatureConfig(max_seq_length=32, doc_stride=8, max_query_length=8),
                           is_training=False)
    n, L = feats["input_ids"].shape
    assert n > 2
    start, end = np.zeros((n, L), np.float32), np.zeros((n, L), np.float32)
    start[:, 0] = np.arange(n) + 1.0   # null scores 2, 3, 4, ... -> min is window 0's: 1 + 0
    _, _, odds = postprocess_predictions([ex], feats, start, end, SquadPostprocessConfig(), True)
    assert odds["q1"] == pytest.approx(1.0 - 0.0)


def test_the_best_f1_threshold_answers_nothing_when_that_scores_best():
    """evaluate-v2.0.py leaves best_f1_thresh at 0.0 when no question improves on answering nothing; with null
    odds (negative where answering is favoured) 0.0 would answer both questions here and score 0, not best_f1."""
    from bertrain.tasks.metrics import evaluate_squad
    from bertrain.tasks.squad import at_best_f1_threshold

    context = "Paris is the capital of France."
    dataset = {"version": "v2.0", "data": [{"title": "t", "paragraphs": [{"context": context, "qas": [
        {"id": "none", "question": "What is the capital of Spain?", "answers": [], "is_impossible": True},
        {"id": "paris", "question": "What is the capital of France?", "is_impossible": False,
         "answers": [{"text": "Paris", "answer_start": 0}]}]}]}]}
    nbest = {"none": [{"text": "France"}, {"text": ""}], "paris": [{"text": "capital"}, {"text": ""}]}
    null_odds = {"none": -2.0, "paris": -1.0}
    preds = apply_null_threshold(nbest, null_odds, 0.0)  # the model's own choice: answer both (wrongly)
    official = evaluate_squad(dataset, preds, null_odds, version="2.0")
    assert (official["f1"], official["best_f1"], official["best_f1_thresh"]) == (0.0, 50.0, 0.0)
    threshold, best_preds, scores = at_best_f1_threshold(dataset, nbest, null_odds, official)
    assert threshold == -3.0 and best_preds == {"none": "", "paris": ""} and scores["f1"] == official["best_f1"]
    # a real threshold from the sweep is kept as it is: answering 'paris' alone (the lower odds) when it is right
    nbest["paris"][0]["text"] = "Paris"
    null_odds = {"none": -1.0, "paris": -2.0}
    official = evaluate_squad(dataset, apply_null_threshold(nbest, null_odds, 0.0), null_odds, version="2.0")
    threshold, best_preds, scores = at_best_f1_threshold(dataset, nbest, null_odds, official)
    assert threshold == official["best_f1_thresh"] == -2.0 and scores["f1"] == official["best_f1"] == 100.0
    assert best_preds == {"none": "", "paris": "Paris"}


def _google_is_max_context(spans, cur, position):
    """google-research/bert run_squad.py `_check_is_max_context`, as written there (the reference)."""
    best_score, best_index = None, None
    for i, (start, length) in enumerate(spans):
        end = start + length - 1
        if position < start or position > end:
            continue
        score = min(position - start, end - position) + 0.01 * length
        if best_score is None or score > best_score:
            best_score, best_index = score, i
    return cur == best_index


@pytest.mark.parametrize("n_tokens, max_doc, stride", [(1, 5, 2), (37, 10, 3), (200, 61, 32), (500, 128, 128),
                                                       (301, 100, 7)])
def test_max_context_window_is_googles_rule(n_tokens, max_doc, stride):
    from bertrain.tasks.squad import max_context_window

    spans, start = [], 0
    while True:  # the windows build_features makes
        length = min(n_tokens - start, max_doc)
        spans.append((start, length))
        if start + length == n_tokens:
            break
        start += min(length, stride)
    owner = max_context_window(spans, n_tokens)
    for si, (s, length) in enumerate(spans):
        for p in range(s, s + length):
            assert (owner[p] == si) == _google_is_max_context(spans, si, p)
