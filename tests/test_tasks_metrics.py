"""Official SQuAD v1.1/v2.0 metric definitions on hand-computed cases, the evaluate command, GLUE metrics."""
from __future__ import annotations

import json

import numpy as np
import pytest
from scipy.stats import pearsonr, spearmanr
from sklearn.metrics import f1_score, matthews_corrcoef

from bertrain.cli import main
from bertrain.tasks import metrics as M


def _squad(qas: list[dict], version: str = "1.1") -> dict:
    return {"version": version, "data": [{"title": "t", "paragraphs": [{"context": "irrelevant here", "qas": qas}]}]}


# ----------------------------------------------------------------------------------------------- normalisation

@pytest.mark.parametrize("raw, norm", [
    ("The Cat", "cat"),
    ("a  dog!", "dog"),
    ("An apple, the pie.", "apple pie"),
    ("theatre", "theatre"),           # articles only as whole words
    ("Anne's  (big)\tday", "annes big day"),
    ("", ""),
    ("the", ""),
])
def test_normalize_answer(raw, norm):
    assert M.normalize_answer(raw) == norm


# ----------------------------------------------------------------------------------------------- v1.1

V1_QAS = [
    {"id": "q1", "question": "?", "answers": [{"text": "The Cat", "answer_start": 0}, {"text": "a dog", "answer_start": 0}]},
    {"id": "q2", "question": "?", "answers": [{"text": "New York City", "answer_start": 0}]},
    {"id": "q3", "question": "?", "answers": [{"text": "an apple", "answer_start": 0}, {"text": "apple pie", "answer_start": 0}]},
    {"id": "q4", "question": "?", "answers": [{"text": "x", "answer_start": 0}]},
]
V1_PREDS = {"q1": "cat", "q2": "the new york!", "q3": "Pie, apple."}  # q4 missing


def test_v1_hand_computed():
    # q1: EM 1 F1 1 (articles, case). q2: EM 0, F1 2*1*(2/3)/(5/3) = 0.8. q3: max over golds: "pie apple" vs
    # "apple pie" -> F1 1 (bag of tokens) but EM 0 (order). q4: missing -> 0 but counted in the total (v1.1 rule).
    out = M.evaluate_v1(_squad(V1_QAS)["data"], V1_PREDS)
    assert out == pytest.approx({"exact_match": 25.0, "f1": 70.0})


def test_v1_vs_v2_empty_answer_rules():
    # Prediction "the" normalises to "": v1.1 EM compares "" == "" (1) but F1 has no common tokens (0);
    # v2.0 F1 counts empty-vs-empty as 1.
    assert M.exact_match_score_v1("the", "a") is True
    assert M.f1_score_v1("the", "a") == 0.0
    assert M.compute_f1("a", "the") == 1.0
    assert M.compute_f1("", "cat") == 0.0 and M.compute_f1("cat", "") == 0.0
    assert M.compute_f1("the big cat", "big dog") == pytest.approx(0.5)  # P 1/2, R 1/2


# ----------------------------------------------------------------------------------------------- v2.0

V2_QAS = [
    {"id": "a1", "question": "?", "answers": [{"text": "Paris", "answer_start": 0}], "is_impossible": False},
    {"id": "a2", "question": "?", "answers": [{"text": "big red dog", "answer_start": 0}], "is_impossible": False},
    {"id": "n1", "question": "?", "answers": [], "is_impossible": True},
    {"id": "n2", "question": "?", "answers": [], "is_impossible": True},
]
V2_PREDS = {"a1": "paris", "a2": "red dog", "n1": "", "n2": "something"}
V2_NA = {"a1": 0.1, "a2": 0.2, "n2": 0.3, "n1": 0.9}


def test_v2_hand_computed():
    out = M.evaluate_v2(_squad(V2_QAS, "v2.0")["data"], V2_PREDS, V2_NA)
    # raw: a1 (1, 1), a2 (0, 0.8), n1 (1, 1), n2 (0, 0); na_prob_thresh 1.0 changes nothing.
    expected = {
        "exact": 50.0, "f1": 70.0, "total": 4,
        "HasAns_exact": 50.0, "HasAns_f1": 90.0, "HasAns_total": 2,
        "NoAns_exact": 50.0, "NoAns_f1": 50.0, "NoAns_total": 2,
        # sweep from "all unanswered" (score 2): a1 +1 -> 3 @0.1, a2 +0 (EM) / +0.8 (F1) -> 3 / 3.8 @0.2,
        # n2 answered wrongly -1, n1 answered "" 0.
        "best_exact": 75.0, "best_exact_thresh": 0.1, "best_f1": 95.0, "best_f1_thresh": 0.2,
    }
    assert out == pytest.approx(expected)
    assert list(out)[:3] == ["exact", "f1", "total"]  # the official key order


def test_v2_na_prob_thresh_and_missing_file():
    data = _squad(V2_QAS, "v2.0")["data"]
    # Threshold 0.15: a2 (0.2) and n2 (0.3) are forced to no-answer: a2 -> 0, n2 -> 1.
    out = M.evaluate_v2(data, V2_PREDS, V2_NA, na_prob_thresh=0.15)
    assert out["exact"] == pytest.approx(75.0) and out["f1"] == pytest.approx(75.0)
    # Without an na-prob file: all na_probs 0 and no best_* keys, as the official script.
    plain = M.evaluate_v2(data, V2_PREDS)
    assert "best_f1" not in plain and plain["f1"] == pytest.approx(70.0)


def test_v2_gold_answers_that_normalise_to_empty_are_dropped():
    qas = [{"id": "q", "question": "?", "answers": [{"text": "the", "answer_start": 0}, {"text": "cat", "answer_start": 0}]}]
    assert M.evaluate_v2(_squad(qas, "v2.0")["data"], {"q": ""})["exact"] == 0.0
    assert M.evaluate_v2(_squad(qas, "v2.0")["data"], {"q": "a cat"})["exact"] == 100.0


def test_missing_predictions_are_one_summary_line(caplog):
    """The official scripts print one line per unanswered question (316 for a file that lacks one article): one
    warning counts them and names a few; the numbers stay the official ones."""
    qas = [{"id": f"q{i:03d}", "question": "?", "answers": [{"text": "cat", "answer_start": 0}]} for i in range(320)]
    preds = {f"q{i:03d}": "cat" for i in range(4)}
    with caplog.at_level("WARNING", logger="bertrain.tasks.metrics"):
        out = M.evaluate_v1(_squad(qas)["data"], preds)
    assert out == pytest.approx({"exact_match": 100 * 4 / 320, "f1": 100 * 4 / 320})  # missing scores 0
    assert [r.getMessage() for r in caplog.records] == [
        "316 of 320 questions have no prediction (score 0), e.g. q004, q005, q006, ..."]
    caplog.clear()
    with caplog.at_level("WARNING", logger="bertrain.tasks.metrics"):
        with pytest.raises(ValueError, match="316 missing in all"):  # v2.0: a KeyError in the official script
            M.evaluate_v2(_squad(qas, "v2.0")["data"], preds)
    assert [r.getMessage() for r in caplog.records] == [
        "316 of 320 questions have no prediction (left out of the total, as evaluate-v2.0.py does), "
        "e.g. q004, q005, q006, ..."]


def test_evaluate_squad_version_detection():
    assert M.is_squad_v2(_squad(V2_QAS, "v2.0")) and not M.is_squad_v2(_squad(V1_QAS))
    assert set(M.evaluate_squad(_squad(V1_QAS), V1_PREDS)) == {"exact_match", "f1"}
    assert "HasAns_exact" in M.evaluate_squad(_squad(V2_QAS, "v2.0"), V2_PREDS)


def test_evaluate_command(tmp_path, capsys):
    data, preds, na = tmp_path / "d.json", tmp_path / "p.json", tmp_path / "na.json"
    data.write_text(json.dumps(_squad(V2_QAS, "v2.0")))
    preds.write_text(json.dumps(V2_PREDS))
    na.write_text(json.dumps(V2_NA))
    assert main(["evaluate", "squad", "--data", str(data), "--predictions", str(preds),
                 "--na-prob-file", str(na)]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["best_f1"] == pytest.approx(95.0) and printed["HasAns_f1"] == pytest.approx(90.0)

    data.write_text(json.dumps(_squad(V1_QAS)))
    preds.write_text(json.dumps(V1_PREDS))
    assert main(["evaluate", "squad", "--data", str(data), "--predictions", str(preds)]) == 0
    assert json.loads(capsys.readouterr().out) == pytest.approx({"exact_match": 25.0, "f1": 70.0})

    preds.write_text('{"q1": "cat",')  # malformed JSON: one clear line naming the file and the line
    assert main(["evaluate", "squad", "--data", str(data), "--predictions", str(preds)]) == 2
    err = capsys.readouterr().err
    assert str(preds) in err and "line 1" in err


@pytest.mark.parametrize("data, version, message", [
    ({"version": "1.1", "data": [{"title": "t"}]}, None, "d.json: article 0 has no 'paragraphs' list"),
    ({"version": "1.1", "data": [{"paragraphs": [{"context": "c"}]}]}, None,
     "d.json: article 0 paragraph 0 has no 'qas' list"),
    ({"version": "1.1", "data": [{"paragraphs": [{"qas": [{"question": "q", "answers": []}]}]}]}, None,
     "d.json: article 0 paragraph 0: a question without an 'id'"),
    (_squad([{"id": "q1", "question": "who?"}]), None,
     "d.json: question id q1: 'answers' must be a list of objects with a 'text' string"),
    (_squad([{"id": "q1", "answers": ["cat"]}]), None,
     "d.json: question id q1: 'answers' must be a list of objects with a 'text' string"),
    (_squad(V2_QAS, "v2.0"), "1.1", "question id n1 has no gold answers (an unanswerable SQuAD v2.0 question): "
                                    "evaluate-v1.1.py cannot score it; score the file as v2.0 (--version 2.0)"),
])
def test_evaluate_refuses_a_malformed_data_file_in_one_line(tmp_path, capsys, data, version, message):
    """Before: a KeyError traceback and exit 1 ('please report it') for a data file without the nesting the
    official scripts read; 'max() arg is an empty sequence' for v2.0 data scored as v1.1."""
    (tmp_path / "d.json").write_text(json.dumps(data))
    (tmp_path / "p.json").write_text(json.dumps({"q1": "cat", **V2_PREDS}))
    argv = ["evaluate", "squad", "--data", str(tmp_path / "d.json"), "--predictions", str(tmp_path / "p.json"),
            "--output", str(tmp_path / "scores.json")]
    assert main(argv + (["--version", version] if version else [])) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert message in err[-1] and "Traceback" not in "\n".join(err)
    assert not (tmp_path / "scores.json").exists()


# ----------------------------------------------------------------------------------------------- GLUE

PREDS = [1, 1, 0, 0, 1, 0, 1, 1]
LABELS = [1, 0, 0, 1, 1, 0, 1, 0]


def test_glue_classification_metrics_hand_and_sklearn():
    # TP 3, FP 2, FN 1, TN 2: acc 5/8, F1 2*3/(2*3+2+1) = 6/9, MCC (3*2-2*1)/sqrt(5*4*3*4) = 4/sqrt(240)
    mrpc = M.glue_compute_metrics("mrpc", PREDS, LABELS)
    assert mrpc["accuracy"] == pytest.approx(5 / 8)
    assert mrpc["f1"] == pytest.approx(6 / 9) == pytest.approx(f1_score(LABELS, PREDS))
    assert mrpc["acc_and_f1"] == pytest.approx((5 / 8 + 6 / 9) / 2)
    cola = M.glue_compute_metrics("cola", PREDS, LABELS)
    assert cola["mcc"] == pytest.approx(4 / np.sqrt(240)) == pytest.approx(matthews_corrcoef(LABELS, PREDS))
    for task in ("sst2", "mnli", "mnli-mm", "qnli", "rte", "wnli"):
        assert M.glue_compute_metrics(task, PREDS, LABELS) == {"accuracy": pytest.approx(5 / 8)}


def test_glue_stsb_metrics_vs_scipy():
    rng = np.random.default_rng(0)
    labels = rng.uniform(0, 5, 50)
    preds = labels + rng.normal(0, 1, 50)
    out = M.glue_compute_metrics("stsb", preds.tolist(), labels.tolist())
    assert out["pearson"] == pytest.approx(pearsonr(preds, labels)[0])
    assert out["spearmanr"] == pytest.approx(spearmanr(preds, labels)[0])
    assert out["corr"] == pytest.approx((out["pearson"] + out["spearmanr"]) / 2)
    # Spearman is rank-based: a monotone transform of the predictions leaves it unchanged.
    assert M.glue_compute_metrics("stsb", np.exp(preds).tolist(), labels.tolist())["spearmanr"] == pytest.approx(
        out["spearmanr"])


def test_glue_metrics_reject_bad_input():
    with pytest.raises(ValueError, match="unknown GLUE task"):
        M.glue_compute_metrics("squad", [1], [1])
    with pytest.raises(ValueError, match="2 predictions for 3 labels"):
        M.glue_compute_metrics("sst2", [1, 0], [1, 0, 1])


@pytest.mark.parametrize("task", ["cola", "sst2", "mrpc", "qqp", "stsb", "mnli", "mnli-mm", "qnli", "rte", "wnli"])
def test_glue_metric_names_are_the_keys_of_the_metrics(task):
    rng = np.random.default_rng(0)
    labels = rng.random(20) * 5 if task == "stsb" else rng.integers(0, 2, 20)
    preds = labels + rng.random(20) if task == "stsb" else rng.integers(0, 2, 20)
    assert tuple(M.glue_compute_metrics(task, preds.tolist(), labels.tolist())) == M.glue_metric_names(task)
