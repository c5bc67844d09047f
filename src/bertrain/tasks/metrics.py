"""Task metrics: the official SQuAD v1.1 / v2.0 evaluation scripts, and the GLUE metrics.

The SQuAD functions are transcriptions of `evaluate-v1.1.py` and `evaluate-v2.0.py` (the scripts distributed with
the datasets) — same normalisation, same F1 edge cases, same handling of missing predictions — so that numbers
from `bertrain evaluate squad` can be compared with published ones. The two scripts differ in small ways that
matter and are kept apart on purpose:

* v1.1 counts a missing prediction as 0 (it stays in the total); v2.0 skips it (it leaves the total).
* v1.1 F1 is 0 when either side normalises to no tokens; v2.0 F1 is 1 when both are empty, 0 when one is.
* v2.0 drops gold answers that normalise to "" and treats a question without answers as "only '' is right".

GLUE metrics use scikit-learn / scipy, as the GLUE reference implementations (and HF's `glue_compute_metrics`) do.
"""
from __future__ import annotations

import collections
import logging
import re
import string
from typing import Any, Iterable, Mapping, Sequence

# scikit-learn and scipy are imported inside the GLUE metric functions that use them: together they take about a
# second to import, which every `bertrain` command would otherwise pay (SQuAD's metrics need neither).

log = logging.getLogger(__name__)

import numpy as np

from bertrain.tasks.glue import TASKS

# The one metric a task is judged by (the report's verdict; fine-tuning's selection metric), by task name ("squad"
# for both SQuAD versions): the figure GLUE's leaderboard leads with (STS-B: Pearson, listed first of its
# "Pearson/Spearman"; the BERT paper's Table 1 reports Spearman for STS-B, which the report shows beside it and
# compares with the paper). A task not listed (SST-2, MNLI, QNLI, RTE, WNLI, a task registered beside GLUE's) is
# judged by accuracy.
SQUAD_V1_METRICS = ("exact_match", "f1")
SQUAD_V2_METRICS = ("exact", "f1", "total", "HasAns_exact", "HasAns_f1", "HasAns_total", "NoAns_exact", "NoAns_f1",
                    "NoAns_total", "best_exact", "best_exact_thresh", "best_f1", "best_f1_thresh")
"""The numbers evaluate-v1.1.py / evaluate-v2.0.py report (v2.0: HasAns_/NoAns_ only when the dev set has such
questions), for checking eval.metric before any work."""
PRIMARY_METRIC: dict[str, str] = {"squad": "f1", "cola": "mcc", "mrpc": "f1", "qqp": "f1", "stsb": "pearson"}

# ----------------------------------------------------------------------------------------------- SQuAD, shared

_ARTICLES = re.compile(r"\b(a|an|the)\b", re.UNICODE)
_PUNCT = set(string.punctuation)


def normalize_answer(s: str) -> str:
    """Lower text and remove punctuation, articles and extra whitespace (identical in v1.1 and v2.0)."""

    def remove_articles(text: str) -> str:
        return _ARTICLES.sub(" ", text)

    def white_space_fix(text: str) -> str:
        return " ".join(text.split())

    def remove_punc(text: str) -> str:
        return "".join(ch for ch in text if ch not in _PUNCT)

    return white_space_fix(remove_articles(remove_punc(s.lower())))


def report_missing(missing: Sequence[str], total: int, consequence: str) -> None:
    """One warning for every question without a prediction (the official scripts print one line per question:
    316 lines for a predictions file that lacks one article)."""
    if missing:
        shown = ", ".join(missing[:3]) + (", ..." if len(missing) > 3 else "")
        log.warning("%d of %d questions have no prediction (%s), e.g. %s", len(missing), total, consequence, shown)


# ----------------------------------------------------------------------------------------------- SQuAD v1.1

def f1_score_v1(prediction: str, ground_truth: str) -> float:
    """evaluate-v1.1.py `f1_score`: bag-of-tokens F1 after normalisation; 0 when nothing is shared."""
    prediction_tokens = normalize_answer(prediction).split()
    ground_truth_tokens = normalize_answer(ground_truth).split()
    common = collections.Counter(prediction_tokens) & collections.Counter(ground_truth_tokens)
    num_same = sum(common.values())
    if num_same == 0:
        return 0.0
    precision = 1.0 * num_same / len(prediction_tokens)
    recall = 1.0 * num_same / len(ground_truth_tokens)
    return (2 * precision * recall) / (precision + recall)


def exact_match_score_v1(prediction: str, ground_truth: str) -> bool:
    """evaluate-v1.1.py `exact_match_score`."""
    return normalize_answer(prediction) == normalize_answer(ground_truth)


def metric_max_over_ground_truths(metric_fn, prediction: str, ground_truths: Sequence[str]) -> float:
    """The best score of `prediction` against any of the gold answers."""
    return max(metric_fn(prediction, gt) for gt in ground_truths)


def evaluate_v1(dataset: list[dict[str, Any]], predictions: Mapping[str, str]) -> dict[str, float]:
    """evaluate-v1.1.py `evaluate`: {'exact_match', 'f1'} on a 0-100 scale over every question in `dataset`.

    `dataset` is the JSON file's `data` list. A question without a prediction scores 0 (one warning counts them).
    """
    f1 = exact_match = 0.0
    total = 0
    missing: list[str] = []
    for article in dataset:
        for paragraph in article["paragraphs"]:
            for qa in paragraph["qas"]:
                total += 1
                if qa["id"] not in predictions:
                    missing.append(qa["id"])
                    continue
                ground_truths = [x["text"] for x in qa["answers"]]
                if not ground_truths:  # the script's max() over no answers: a ValueError without a word of why
                    raise ValueError(f"question id {qa['id']} has no gold answers (an unanswerable SQuAD v2.0 "
                                     "question): evaluate-v1.1.py cannot score it; score the file as v2.0 "
                                     "(--version 2.0)")
                prediction = predictions[qa["id"]]
                exact_match += metric_max_over_ground_truths(exact_match_score_v1, prediction, ground_truths)
                f1 += metric_max_over_ground_truths(f1_score_v1, prediction, ground_truths)
    if total == 0:
        raise ValueError("the SQuAD dataset has no questions")
    report_missing(missing, total, "score 0")
    return {"exact_match": 100.0 * exact_match / total, "f1": 100.0 * f1 / total}


# ----------------------------------------------------------------------------------------------- SQuAD v2.0

def get_tokens(s: str) -> list[str]:
    if not s:
        return []
    return normalize_answer(s).split()


def compute_exact(a_gold: str, a_pred: str) -> int:
    """evaluate-v2.0.py `compute_exact`."""
    return int(normalize_answer(a_gold) == normalize_answer(a_pred))


def compute_f1(a_gold: str, a_pred: str) -> float:
    """evaluate-v2.0.py `compute_f1`: if either side is no-answer, F1 is 1 when they agree and 0 otherwise."""
    gold_toks = get_tokens(a_gold)
    pred_toks = get_tokens(a_pred)
    common = collections.Counter(gold_toks) & collections.Counter(pred_toks)
    num_same = sum(common.values())
    if len(gold_toks) == 0 or len(pred_toks) == 0:
        return float(gold_toks == pred_toks)
    if num_same == 0:
        return 0.0
    precision = 1.0 * num_same / len(pred_toks)
    recall = 1.0 * num_same / len(gold_toks)
    return (2 * precision * recall) / (precision + recall)


def make_qid_to_has_ans(dataset: list[dict[str, Any]]) -> dict[str, bool]:
    qid_to_has_ans = {}
    for article in dataset:
        for p in article["paragraphs"]:
            for qa in p["qas"]:
                qid_to_has_ans[qa["id"]] = bool(qa["answers"])
    return qid_to_has_ans


def get_raw_scores(dataset: list[dict[str, Any]], preds: Mapping[str, str]) -> tuple[dict[str, int], dict[str, float]]:
    exact_scores: dict[str, int] = {}
    f1_scores: dict[str, float] = {}
    missing: list[str] = []
    total = 0
    for article in dataset:
        for p in article["paragraphs"]:
            for qa in p["qas"]:
                qid = qa["id"]
                total += 1
                gold_answers = [a["text"] for a in qa["answers"] if normalize_answer(a["text"])]
                if not gold_answers:
                    # For unanswerable questions, only correct answer is empty string
                    gold_answers = [""]
                if qid not in preds:
                    missing.append(qid)
                    continue
                a_pred = preds[qid]
                exact_scores[qid] = max(compute_exact(a, a_pred) for a in gold_answers)
                f1_scores[qid] = max(compute_f1(a, a_pred) for a in gold_answers)
    report_missing(missing, total, "left out of the total, as evaluate-v2.0.py does")
    return exact_scores, f1_scores


def apply_no_ans_threshold(scores: Mapping[str, float], na_probs: Mapping[str, float],
                           qid_to_has_ans: Mapping[str, bool], na_prob_thresh: float) -> dict[str, float]:
    new_scores = {}
    for qid, s in scores.items():
        pred_na = na_probs[qid] > na_prob_thresh
        if pred_na:
            new_scores[qid] = float(not qid_to_has_ans[qid])
        else:
            new_scores[qid] = s
    return new_scores


def make_eval_dict(exact_scores: Mapping[str, float], f1_scores: Mapping[str, float],
                   qid_list: Sequence[str] | None = None) -> dict[str, float]:
    if not qid_list:
        total = len(exact_scores)
        if total == 0:
            raise ValueError("no question of the dataset has a prediction")
        return collections.OrderedDict([
            ("exact", 100.0 * sum(exact_scores.values()) / total),
            ("f1", 100.0 * sum(f1_scores.values()) / total),
            ("total", total),
        ])
    total = len(qid_list)
    # Like the official script, a question of the split without a prediction is a KeyError there; we say which.
    missing = [k for k in qid_list if k not in exact_scores]
    if missing:
        raise ValueError(f"no prediction for question id {missing[0]!r} ({len(missing)} missing in all)")
    return collections.OrderedDict([
        ("exact", 100.0 * sum(exact_scores[k] for k in qid_list) / total),
        ("f1", 100.0 * sum(f1_scores[k] for k in qid_list) / total),
        ("total", total),
    ])


def merge_eval(main_eval: dict[str, Any], new_eval: Mapping[str, Any], prefix: str) -> None:
    for k in new_eval:
        main_eval[f"{prefix}_{k}"] = new_eval[k]


def find_best_thresh(preds: Mapping[str, str], scores: Mapping[str, float], na_probs: Mapping[str, float],
                     qid_to_has_ans: Mapping[str, bool]) -> tuple[float, float]:
    """evaluate-v2.0.py `find_best_thresh`: sweep the no-answer threshold over the sorted na_probs.

    Starting from "answer nothing" (score = #no-answer questions), each question whose na_prob is below the
    threshold switches to its prediction: +score for answerable ones, -1 for an unanswerable one answered.
    """
    num_no_ans = sum(1 for k in qid_to_has_ans if not qid_to_has_ans[k])
    cur_score = num_no_ans
    best_score = cur_score
    best_thresh = 0.0
    qid_list = sorted(na_probs, key=lambda k: na_probs[k])
    for qid in qid_list:
        if qid not in scores:
            continue
        if qid_to_has_ans[qid]:
            diff = scores[qid]
        else:
            diff = -1 if preds[qid] else 0
        cur_score += diff
        if cur_score > best_score:
            best_score = cur_score
            best_thresh = na_probs[qid]
    return 100.0 * best_score / len(scores), best_thresh


def find_all_best_thresh(main_eval: dict[str, Any], preds: Mapping[str, str], exact_raw: Mapping[str, float],
                         f1_raw: Mapping[str, float], na_probs: Mapping[str, float],
                         qid_to_has_ans: Mapping[str, bool]) -> None:
    best_exact, exact_thresh = find_best_thresh(preds, exact_raw, na_probs, qid_to_has_ans)
    best_f1, f1_thresh = find_best_thresh(preds, f1_raw, na_probs, qid_to_has_ans)
    main_eval["best_exact"] = best_exact
    main_eval["best_exact_thresh"] = exact_thresh
    main_eval["best_f1"] = best_f1
    main_eval["best_f1_thresh"] = f1_thresh


def evaluate_v2(dataset: list[dict[str, Any]], preds: Mapping[str, str],
                na_probs: Mapping[str, float] | None = None, na_prob_thresh: float = 1.0) -> dict[str, Any]:
    """evaluate-v2.0.py `main` without the I/O: the dict it prints.

    `na_probs` (the `--na-prob-file`, e.g. our null_odds.json) is optional; without it every na_prob is 0 and the
    best_* keys are absent, exactly as in the official script.
    """
    have_na = na_probs is not None
    if na_probs is None:
        na_probs = {k: 0.0 for k in preds}
    qid_to_has_ans = make_qid_to_has_ans(dataset)
    has_ans_qids = [k for k, v in qid_to_has_ans.items() if v]
    no_ans_qids = [k for k, v in qid_to_has_ans.items() if not v]
    exact_raw, f1_raw = get_raw_scores(dataset, preds)
    missing_na = [k for k in exact_raw if k not in na_probs]
    if missing_na:
        raise ValueError(f"the na-prob file has no entry for question id {missing_na[0]!r}")
    exact_thresh = apply_no_ans_threshold(exact_raw, na_probs, qid_to_has_ans, na_prob_thresh)
    f1_thresh = apply_no_ans_threshold(f1_raw, na_probs, qid_to_has_ans, na_prob_thresh)
    out_eval = make_eval_dict(exact_thresh, f1_thresh)
    if has_ans_qids:
        merge_eval(out_eval, make_eval_dict(exact_thresh, f1_thresh, qid_list=has_ans_qids), "HasAns")
    if no_ans_qids:
        merge_eval(out_eval, make_eval_dict(exact_thresh, f1_thresh, qid_list=no_ans_qids), "NoAns")
    if have_na:
        find_all_best_thresh(out_eval, preds, exact_raw, f1_raw, na_probs, qid_to_has_ans)
    return dict(out_eval)


def is_squad_v2(dataset_json: Mapping[str, Any]) -> bool:
    """A SQuAD file is v2.0 when its version says so or any question carries `is_impossible`."""
    version = str(dataset_json.get("version", ""))
    if version.lstrip("v").startswith("2"):
        return True
    return any("is_impossible" in qa for article in dataset_json.get("data", [])
               for p in article.get("paragraphs", []) for qa in p.get("qas", []))


def evaluate_squad(dataset_json: Mapping[str, Any], preds: Mapping[str, str],
                   na_probs: Mapping[str, float] | None = None, version: str | None = None,
                   na_prob_thresh: float = 1.0) -> dict[str, Any]:
    """Official numbers for a parsed SQuAD file: v1.1 script for v1.1 data, v2.0 script for v2.0 data.

    `version`: "1.1" or "2.0" to force one script; by default it follows the file (`is_squad_v2`).
    """
    if version is None:
        version = "2.0" if is_squad_v2(dataset_json) else "1.1"
    if version not in ("1.1", "2.0"):
        raise ValueError(f"SQuAD version must be 1.1 or 2.0, got {version!r}")
    dataset = dataset_json["data"]
    if version == "1.1":
        return evaluate_v1(dataset, preds)
    return evaluate_v2(dataset, preds, na_probs, na_prob_thresh)


# ----------------------------------------------------------------------------------------------- GLUE

def simple_accuracy(preds: Iterable[int], labels: Iterable[int]) -> float:
    p, y = np.asarray(list(preds)), np.asarray(list(labels))
    if p.shape != y.shape:
        raise ValueError(f"predictions ({p.shape}) and labels ({y.shape}) differ in length")
    return float((p == y).mean())


def acc_and_f1(preds: Sequence[int], labels: Sequence[int]) -> dict[str, float]:
    """Accuracy and binary F1 of the positive class (label 1), as reported for MRPC and QQP."""
    from sklearn.metrics import f1_score

    acc = simple_accuracy(preds, labels)
    f1 = float(f1_score(y_true=list(labels), y_pred=list(preds)))
    return {"accuracy": acc, "f1": f1, "acc_and_f1": (acc + f1) / 2}


def pearson_and_spearman(preds: Sequence[float], labels: Sequence[float]) -> dict[str, float]:
    from scipy.stats import pearsonr, spearmanr

    if len(preds) != len(labels) or len(preds) < 2:  # scipy's own error names neither the task nor the counts
        raise ValueError(f"Pearson and Spearman correlations need as many predictions as labels, at least 2: got "
                         f"{len(preds)} predictions for {len(labels)} labels")
    pearson = float(pearsonr(preds, labels)[0])
    spearman = float(spearmanr(preds, labels)[0])
    return {"pearson": pearson, "spearmanr": spearman, "corr": (pearson + spearman) / 2}


def glue_metric_names(task: str) -> tuple[str, ...]:
    """The keys `glue_compute_metrics(task, ...)` returns, known before any prediction (eval.metric is checked
    against them before training; tests/test_tasks_metrics.py keeps the two in step)."""
    if task == "cola":
        return ("mcc", "accuracy")
    if task in ("mrpc", "qqp"):
        return ("accuracy", "f1", "acc_and_f1")
    if task == "stsb":
        return ("pearson", "spearmanr", "corr")
    return ("accuracy",)


def glue_compute_metrics(task: str, preds: Sequence, labels: Sequence) -> dict[str, float]:
    """The GLUE metrics of `task` on one evaluation split (for MNLI call it once per split: mnli / mnli-mm)."""
    from sklearn.metrics import matthews_corrcoef

    if len(preds) != len(labels):
        raise ValueError(f"{task}: {len(preds)} predictions for {len(labels)} labels")
    if task == "cola":
        return {"mcc": float(matthews_corrcoef(list(labels), list(preds))), "accuracy": simple_accuracy(preds, labels)}
    if task in ("mrpc", "qqp"):
        return acc_and_f1(preds, labels)
    if task == "stsb":
        return pearson_and_spearman(preds, labels)
    if task in ("sst2", "mnli", "mnli-mm", "qnli", "rte", "wnli"):
        return {"accuracy": simple_accuracy(preds, labels)}
    if task in TASKS and not TASKS[task].is_regression:  # a classification task registered beside GLUE's nine
        return {"accuracy": simple_accuracy(preds, labels)}
    raise ValueError(f"unknown GLUE task {task!r}")
