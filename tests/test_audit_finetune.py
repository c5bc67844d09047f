"""Fine-tuning and evaluation against the references, where the earlier reference tests do not reach: SQuAD v2.0
on real questions made unanswerable (evaluate-v2.0.py written out below, verbatim but for the I/O), char offsets
of accented / decomposed / oddly spaced contexts, STS-B's regression head against transformers + scipy, the
evaluation-only path (`do_train false`), and the refusals of bad inputs (one line, exit 2)."""
from __future__ import annotations

import collections
import json
import random
import re
import string
import unicodedata
from pathlib import Path

import numpy as np
import pytest

from conftest import shared_file
from helpers import TINY, save_tiny_model, squad_v2_fixture, write_rte_like

from bertrain.cli import main
from bertrain.tasks.glue import TASKS, read_glue_tsv

XQUAD = "squad/xquad-en-part1.json"


# ----------------------------------------------------------------------------------------------- evaluate-v2.0.py

def _normalize_answer(s):
    def remove_articles(text):
        return re.sub(re.compile(r'\b(a|an|the)\b', re.UNICODE), ' ', text)

    def white_space_fix(text):
        return ' '.join(text.split())

    def remove_punc(text):
        exclude = set(string.punctuation)
        return ''.join(ch for ch in text if ch not in exclude)

    return white_space_fix(remove_articles(remove_punc(s.lower())))


def _get_tokens(s):
    return _normalize_answer(s).split() if s else []


def _compute_f1(a_gold, a_pred):
    gold_toks, pred_toks = _get_tokens(a_gold), _get_tokens(a_pred)
    common = collections.Counter(gold_toks) & collections.Counter(pred_toks)
    num_same = sum(common.values())
    if len(gold_toks) == 0 or len(pred_toks) == 0:
        return int(gold_toks == pred_toks)
    if num_same == 0:
        return 0
    precision, recall = num_same / len(pred_toks), num_same / len(gold_toks)
    return (2 * precision * recall) / (precision + recall)


def _find_best_thresh(preds, scores, na_probs, qid_to_has_ans):
    cur_score = best_score = sum(1 for k in qid_to_has_ans if not qid_to_has_ans[k])
    best_thresh = 0.0
    for qid in sorted(na_probs, key=lambda k: na_probs[k]):
        if qid not in scores:
            continue
        diff = scores[qid] if qid_to_has_ans[qid] else (-1 if preds[qid] else 0)
        cur_score += diff
        if cur_score > best_score:
            best_score, best_thresh = cur_score, na_probs[qid]
    return 100.0 * best_score / len(scores), best_thresh


def official_v2(dataset_json, preds, na_probs=None, na_prob_thresh=1.0):
    """evaluate-v2.0.py's main(): the dict it prints."""
    dataset = dataset_json["data"]
    have_na = na_probs is not None
    na_probs = na_probs if have_na else {k: 0.0 for k in preds}
    qid_to_has_ans = {qa["id"]: bool(qa["answers"]) for a in dataset for p in a["paragraphs"] for qa in p["qas"]}
    exact_raw, f1_raw = {}, {}
    for a in dataset:
        for p in a["paragraphs"]:
            for qa in p["qas"]:
                gold = [x["text"] for x in qa["answers"] if _normalize_answer(x["text"])] or [""]
                if qa["id"] in preds:
                    exact_raw[qa["id"]] = max(int(_normalize_answer(g) == _normalize_answer(preds[qa["id"]]))
                                              for g in gold)
                    f1_raw[qa["id"]] = max(_compute_f1(g, preds[qa["id"]]) for g in gold)

    def thresholded(scores):
        return {q: float(not qid_to_has_ans[q]) if na_probs[q] > na_prob_thresh else s for q, s in scores.items()}

    exact_t, f1_t = thresholded(exact_raw), thresholded(f1_raw)

    def eval_dict(qids=None):
        qids = qids or list(exact_t)
        return {"exact": 100.0 * sum(exact_t[k] for k in qids) / len(qids),
                "f1": 100.0 * sum(f1_t[k] for k in qids) / len(qids), "total": len(qids)}

    out = eval_dict()
    for prefix, want in (("HasAns", True), ("NoAns", False)):
        qids = [k for k, v in qid_to_has_ans.items() if v == want]
        if qids:
            out.update({f"{prefix}_{k}": v for k, v in eval_dict(qids).items()})
    if have_na:
        out["best_exact"], out["best_exact_thresh"] = _find_best_thresh(preds, exact_raw, na_probs, qid_to_has_ans)
        out["best_f1"], out["best_f1_thresh"] = _find_best_thresh(preds, f1_raw, na_probs, qid_to_has_ans)
    return out


# ----------------------------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def _xquad_v2(path: Path, articles: slice, seed: int) -> dict:
    """The real XQuAD questions of `articles` as SQuAD v2.0: about 40% made unanswerable (answers [], their old
    answers as plausible_answers), as the official v2.0 files mark them."""
    data = json.loads(shared_file(XQUAD).read_text(encoding="utf-8"))
    rng = random.Random(seed)
    out = {"version": "v2.0", "data": []}
    for article in data["data"][articles]:
        paras = []
        for p in article["paragraphs"]:
            qas = []
            for qa in p["qas"]:
                impossible = rng.random() < 0.4
                qas.append({"id": qa["id"], "question": qa["question"], "is_impossible": impossible,
                            "answers": [] if impossible else qa["answers"],
                            **({"plausible_answers": qa["answers"]} if impossible else {})})
            paras.append({"context": p["context"], "qas": qas})
        out["data"].append({"title": article["title"], "paragraphs": paras})
    path.write_text(json.dumps(out), encoding="utf-8")
    return out


# ----------------------------------------------------------------------------------------------- SQuAD v2.0

@pytest.mark.slow
def test_real_squad_v2_minilm_written_files_are_the_official_scripts_numbers(tmp_path, minilm_path, capsys):
    """MiniLM fine-tuned a few steps on real questions in v2.0 form, windows of 128 tokens 48 apart (most contexts
    take several): eval_results.json equals evaluate-v2.0.py (above) on predictions.json + null_odds.json, every
    prediction follows its null odds, every n-best span is the context's own text at its offsets, the best-F1
    predictions score best_f1, and the exported model evaluated alone gives the same numbers and files."""
    _xquad_v2(tmp_path / "train.json", slice(0, 2), seed=0)
    dev = _xquad_v2(tmp_path / "dev.json", slice(3, 4), seed=1)
    out = tmp_path / "run"
    common = ["--version-2-with-negative", "--dev", str(tmp_path / "dev.json"), "--data.max_seq_length", "128",
              "--data.doc_stride", "48", "--data.cache_dir", ""]
    assert main(["finetune", "squad", "--train", str(tmp_path / "train.json"), "--init", str(minilm_path),
                 "--output", str(out), "--train.steps", "4", "--train.micro_batch_size", "16",
                 "--train.global_batch_size", "16", "--optim.lr", "1e-4", *common]) == 0
    capsys.readouterr()
    results = json.loads((out / "eval_results.json").read_text())
    preds = json.loads((out / "predictions.json").read_text())
    odds = json.loads((out / "null_odds.json").read_text())
    nbest = json.loads((out / "nbest_predictions.json").read_text())
    assert results["eval_features"] > 1.5 * results["eval_examples"]  # several windows per context
    ref = official_v2(dev, preds, odds)
    assert ref["NoAns_total"] > 0 and ref["HasAns_total"] > 0
    for k, v in ref.items():
        assert results[k] == pytest.approx(v, abs=1e-9), k
    contexts = {qa["id"]: p["context"] for a in dev["data"] for p in a["paragraphs"] for qa in p["qas"]}
    for qid, text in preds.items():
        best_non_null = next(e for e in nbest[qid] if e["text"])
        assert text == ("" if odds[qid] > 0.0 else best_non_null["text"])
        for e in nbest[qid]:
            if "char_start" in e:
                assert contexts[qid][e["char_start"]:e["char_end"]] == e["text"]
    best = json.loads((out / "predictions_best_f1_thresh.json").read_text())
    assert official_v2(dev, best)["f1"] == pytest.approx(results["at_best_f1_thresh"]["f1"])
    assert results["at_best_f1_thresh"]["f1"] == pytest.approx(ref["best_f1"])

    again = tmp_path / "eval-only"
    assert main(["finetune", "squad", "--do_train", "false", "--init", str(out / "final"), "--output", str(again),
                 *common]) == 0
    capsys.readouterr()
    alone = json.loads((again / "eval_results.json").read_text())
    for k in ref:
        assert alone[k] == results[k], k
    for name in ("predictions.json", "null_odds.json", "nbest_predictions.json"):
        assert json.loads((again / name).read_text()) == json.loads((out / name).read_text()), name


def test_v2_scores_are_those_of_predictions_json_for_a_threshold_above_one(tmp_path, tiny_model, capsys,
                                                                          monkeypatch):
    """With null_score_diff_threshold above 1.0, eval_results.json's exact/f1 are the scores of the
    predictions.json it wrote (evaluate-v2.0.py on it alone; and with null_odds.json at that --na-prob-thresh).
    Before, the scoring took null_odds.json at evaluate-v2.0.py's default --na-prob-thresh 1.0 and counted every
    question with null odds above 1.0 as unanswered, though predictions.json answered it. The model's logits are
    set here: a span of the first two context tokens scores 5 + 5, [CLS] gives each question null odds of -3,
    0.5, 3 or 6 in turn."""
    import bertrain.tasks.finetune as F

    train = squad_v2_fixture(tmp_path / "train.json", 2)
    dev = squad_v2_fixture(tmp_path / "dev.json", 4)
    trained = tmp_path / "trained"
    common = ["--version-2-with-negative", "--data.max_seq_length", "64", "--data.max_query_length", "16",
              "--data.cache_dir", "", *TINY]
    assert main(["finetune", "squad", "--train", str(train), "--do_eval", "false", "--init", str(tiny_model),
                 "--output", str(trained), "--train.steps", "1", *common]) == 0
    odds_of = [-3.0, 0.5, 3.0, 6.0]

    def logits(model, feats, outputs, dist, batch_size, precision=None, trim=True):
        S = np.full(feats["input_ids"].shape, -20.0, dtype=np.float32)
        E = S.copy()
        for r, ei in enumerate(feats["example_index"].tolist()):
            first = int(np.flatnonzero(feats["offsets"][r][:, 0] >= 0)[0])
            S[r, first], E[r, first + 1] = 5.0, 5.0
            S[r, 0] = E[r, 0] = (10.0 + odds_of[ei % 4]) / 2
        return [S, E]

    monkeypatch.setattr(F, "distributed_forward", logits)
    out = tmp_path / "eval"
    assert main(["finetune", "squad", "--do_train", "false", "--dev", str(dev), "--init", str(trained / "final"),
                 "--output", str(out), "--data.null_score_diff_threshold", "4.5", *common]) == 0
    capsys.readouterr()
    results = json.loads((out / "eval_results.json").read_text())
    preds = json.loads((out / "predictions.json").read_text())
    odds = json.loads((out / "null_odds.json").read_text())
    dataset = json.loads(dev.read_text())
    assert sorted(set(np.round(list(odds.values()), 4))) == odds_of
    assert all((preds[q] == "") == (odds[q] > 4.5) for q in preds)
    alone = official_v2(dataset, preds)
    for k in ("exact", "f1", "HasAns_exact", "HasAns_f1", "NoAns_exact", "NoAns_f1"):
        assert results[k] == pytest.approx(alone[k]), k
    at_default = official_v2(dataset, preds, odds)  # the old numbers: odds 3 counted as unanswered
    assert (results["NoAns_exact"], results["HasAns_f1"]) != (at_default["NoAns_exact"], at_default["HasAns_f1"])
    with_odds = official_v2(dataset, preds, odds, na_prob_thresh=4.5)
    for k in ("exact", "f1", "best_exact", "best_exact_thresh", "best_f1", "best_f1_thresh"):
        assert results[k] == pytest.approx(with_odds[k]), k
    # `bertrain evaluate` with that --na-prob-thresh prints the same
    assert main(["evaluate", "squad", "--data", str(dev), "--predictions", str(out / "predictions.json"),
                 "--na-prob-file", str(out / "null_odds.json"), "--na-prob-thresh", "4.5"]) == 0
    printed = json.loads(capsys.readouterr().out)
    for k in with_odds:
        assert printed[k] == pytest.approx(results[k]), k


_UNICODE_CASES = [
    ("Der Präsident José Müller wohnt in Zürich.", "José Müller"),
    (unicodedata.normalize("NFD", "Der Präsident José Müller wohnt in Zürich."),
     unicodedata.normalize("NFD", "José Müller")),
    ("It  was   built   in\t\t1850  by   the\n\nEiffel   company.", "1850  by   the\n\nEiffel"),
    ("The café\u00a0au\u00a0lait costs 3 €.", "café\u00a0au\u00a0lait"),
    ("Zero\u200bwidth text and soft\u00adhyphen here.", "soft\u00adhyphen"),
    ("Tokyo (東京) is the capital of Japan.", "東京"),
    ("He said 😀 hello to the Æsir of Ísland.", "Æsir of Ísland"),
    ("İstanbul is big. The ﬁnal word.", "İstanbul"),
    ("İstanbul is big. The ﬁnal word.", "ﬁnal"),
    ("A ligature: ǅemal and ß straße.", "straße"),
]


def test_accented_and_spaced_answers_map_back_to_the_original_text_exactly(minilm_path):
    """MiniLM's uncased tokenizer strips accents and splits CJK; the training labels of each answer, read back
    through the windows (64 tokens, 16 apart) and post-processing, give exactly the original characters."""
    from bertrain.tasks.common import load_task_tokenizer
    from bertrain.tasks.squad import (SquadExample, SquadFeatureConfig, SquadPostprocessConfig, build_features,
                                      postprocess_predictions)

    tok = load_task_tokenizer(minilm_path)
    cfg = SquadFeatureConfig(max_seq_length=24, doc_stride=4, max_query_length=8)
    filler = " Some more words come after it to make several windows of this context."
    for i, (context, answer) in enumerate(_UNICODE_CASES):
        context = filler * 2 + " " + context + filler * 2
        ex = SquadExample(f"q{i}", "what is it?", context, [{"text": answer, "answer_start": context.index(answer)}])
        train = build_features([ex], tok, cfg, is_training=True)
        evals = build_features([ex], tok, cfg, is_training=False)
        assert len(evals["input_ids"]) > 3
        labelled = np.flatnonzero(train["start_positions"] > 0)
        assert len(labelled) >= 1, answer
        S = np.full(evals["input_ids"].shape, -10.0)
        E = np.full(evals["input_ids"].shape, -10.0)
        for r in labelled:  # every window holding the answer votes for it; max_context picks one
            S[r, train["start_positions"][r]] = 10.0
            E[r, train["end_positions"][r]] = 10.0
        preds, _, _ = postprocess_predictions([ex], evals, S, E, SquadPostprocessConfig(), False)
        assert preds[ex.qid] == answer


# ----------------------------------------------------------------------------------------------- evaluation only

def test_evaluation_only_refuses_a_model_without_the_tasks_trained_head(tmp_path, tiny_model, capsys):
    """`do_train false` scores the --init model as it is: a pretrained model (no classifier / QA head) or a
    classifier with another number of labels (re-initialised on load) would give numbers and a GLUE submission
    of random weights. Refused (exit 2, one line) before any output, so the corrected command then runs in the
    same folder without --overwrite; a fine-tuned model of the task evaluates as before."""
    rte = write_rte_like(tmp_path / "RTE")
    mnli = write_rte_like(tmp_path / "MNLI", task_labels=("entailment", "neutral", "contradiction"), mnli=True)
    mnli_run = tmp_path / "mnli"
    assert main(["finetune", "glue", "--task", "mnli", "--data-dir", str(mnli), "--init", str(tiny_model),
                 "--output", str(mnli_run), "--data.max_seq_length", "32", "--train.steps", "2", *TINY]) == 0
    out = tmp_path / "eval"
    base = ["finetune", "glue", "--task", "rte", "--data-dir", str(rte), "--output", str(out), "--do_train", "false",
            "--data.max_seq_length", "32", *TINY]
    for init in (tiny_model, mnli_run / "final"):
        capsys.readouterr()
        assert main([*base, "--init", str(init)]) == 2
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert err.startswith(f"bertrain finetune: error: --init {init} has no trained classification head (a "
                              "classification head with 2 output(s) is needed)"), err
        assert not (out / "eval_results.json").exists() and not (out / "RTE.tsv").exists()
    squad = squad_v2_fixture(tmp_path / "squad.json", 2)
    assert main(["finetune", "squad", "--do_train", "false", "--dev", str(squad), "--init", str(tiny_model),
                 "--output", str(tmp_path / "sq"), "--version-2-with-negative", "--data.max_seq_length", "64",
                 "--data.max_query_length", "16", "--data.cache_dir", ""]) == 2
    assert "has no trained QA head" in capsys.readouterr().err

    rte_run = tmp_path / "rte"
    assert main(["finetune", "glue", "--task", "rte", "--data-dir", str(rte), "--init", str(tiny_model),
                 "--output", str(rte_run), "--data.max_seq_length", "32", "--train.steps", "2", *TINY]) == 0
    capsys.readouterr()
    assert main([*base, "--init", str(rte_run / "final")]) == 0  # same folder, no --overwrite needed
    capsys.readouterr()
    trained, alone = (json.loads((d / "eval_results.json").read_text()) for d in (rte_run, out))
    assert alone["dev"] == trained["dev"]
    assert (out / "RTE.tsv").read_text() == (rte_run / "RTE.tsv").read_text()
    assert (out / "config.yaml").is_file()


# ----------------------------------------------------------------------------------------------- GLUE

STSB_HEADER = "index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2"


@pytest.mark.parametrize("raw", ["nan", "NaN", "inf", "-inf"])
def test_stsb_non_finite_score_is_refused_naming_file_and_line(tmp_path, raw):
    """float() reads 'nan' and 'inf': an STS-B score like that made the MSE loss NaN. Refused, naming the line."""
    p = tmp_path / "train.tsv"
    p.write_text("\n".join([STSB_HEADER + "\tscore", "0\tmain\tf\t2012\t0\tn\tn\tA man .\tA person .\t3.800",
                            f"1\tmain\tf\t2012\t1\tn\tn\tA dog .\tA cat .\t{raw}"]) + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match=rf"^{re.escape(str(p))}:3: stsb label '{raw}' is not a finite number$"):
        read_glue_tsv(p, TASKS["stsb"], TASKS["stsb"].train)


@pytest.mark.parametrize("value", [float("inf"), float("-inf")])
def test_stsb_infinite_score_in_the_hubs_columns_is_refused(value):
    """The Hub's layout: an infinite STS-B label (NaN was already refused as empty) names the file and row."""
    from bertrain.tasks.glue import _hub_label

    with pytest.raises(ValueError, match=r"^t.parquet: row 3: column 'label' is -?inf, expected a finite "):
        _hub_label(TASKS["stsb"], value, "t.parquet: row 3", False)
    assert _hub_label(TASKS["stsb"], 3.8, "t.parquet: row 3", False) == 3.8


def _stsb_from_mrpc(root: Path) -> Path:
    """An STS-B folder in the official layout from real MRPC pairs: paraphrases score 3.5-5, others 0-3."""
    import csv

    rng = random.Random(0)
    d = root / "STS-B"
    d.mkdir(parents=True)
    for name, src, n, labelled in (("train", "train", 96, True), ("dev", "dev", 40, True), ("test", "test", 12, False)):
        with open(shared_file(f"glue/MRPC/{src}.tsv"), encoding="utf-8-sig", newline="") as f:
            rows = list(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE))[1:n + 1]
        lines = [STSB_HEADER + ("\tscore" if labelled else "")]
        for i, r in enumerate(rows):
            score = 3.5 + 1.5 * rng.random() if r[0] == "1" else 3.0 * rng.random()
            lines.append(f"{i}\tmain-news\theadlines\t2015\t{i:04d}\tnone\tnone\t{r[3]}\t{r[4]}"
                         + (f"\t{score:.3f}" if labelled else ""))
        (d / f"{name}.tsv").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return d


@pytest.mark.slow
def test_stsb_regression_head_scores_as_transformers_and_scipy(tmp_path, minilm_path, capsys):
    """STS-B from MiniLM (real MRPC pairs in STS-B's layout): the exported model loaded by transformers as a
    regression model (problem_type, one output) gives the dev Pearson / Spearman of eval_results.json by scipy;
    the submission is STS-B.tsv with scores in [0, 5]; the exported model evaluated alone gives the same numbers."""
    import torch
    from scipy.stats import pearsonr, spearmanr
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    data = _stsb_from_mrpc(tmp_path)
    out = tmp_path / "run"
    assert main(["finetune", "glue", "--task", "stsb", "--data-dir", str(data), "--init", str(minilm_path),
                 "--output", str(out), "--data.max_seq_length", "64", "--train.steps", "6",
                 "--train.micro_batch_size", "16", "--train.global_batch_size", "16", "--optim.lr", "1e-4"]) == 0
    capsys.readouterr()
    dev = json.loads((out / "eval_results.json").read_text())["dev"]
    config = json.loads((out / "final" / "config.json").read_text())
    assert config["problem_type"] == "regression" and len(config["id2label"]) == 1
    rows = [line.split("\t") for line in (data / "dev.tsv").read_text(encoding="utf-8").splitlines()[1:]]
    tok = AutoTokenizer.from_pretrained(out / "final")
    model = AutoModelForSequenceClassification.from_pretrained(out / "final").eval()
    enc = tok([r[7] for r in rows], [r[8] for r in rows], truncation=True, max_length=64, padding=True,
              return_tensors="pt")
    with torch.no_grad():
        scores = model(**enc).logits[:, 0].double().numpy()
    labels = [float(r[9]) for r in rows]
    assert dev["pearson"] == pytest.approx(pearsonr(scores, labels)[0], abs=1e-5)
    assert dev["spearmanr"] == pytest.approx(spearmanr(scores, labels)[0], abs=1e-5)
    sub = (out / "STS-B.tsv").read_text().splitlines()
    assert sub[0] == "index\tprediction" and [r.split("\t")[0] for r in sub[1:]] == [str(i) for i in range(12)]
    assert all(0.0 <= float(r.split("\t")[1]) <= 5.0 for r in sub[1:])

    alone = tmp_path / "eval"
    assert main(["finetune", "glue", "--task", "stsb", "--data-dir", str(data), "--init", str(out / "final"),
                 "--output", str(alone), "--do_train", "false", "--data.max_seq_length", "64"]) == 0
    capsys.readouterr()
    assert json.loads((alone / "eval_results.json").read_text())["dev"] == dev
    assert (alone / "STS-B.tsv").read_text() == (out / "STS-B.tsv").read_text()


def test_evaluate_names_the_na_prob_file_that_lacks_a_question(tmp_path, capsys):
    """`bertrain evaluate squad --na-prob-file` without a value for a predicted question: one line naming that
    file and the question (before: "the na-prob file has no entry ...", which did not say which file)."""
    dev = squad_v2_fixture(tmp_path / "dev.json", 1)
    (tmp_path / "preds.json").write_text(json.dumps({"p0-who": "ann", "p0-no1": "", "p0-no2": ""}))
    (tmp_path / "odds.json").write_text(json.dumps({"p0-who": -1.0, "p0-no1": 2.0}))
    assert main(["evaluate", "squad", "--data", str(dev), "--predictions", str(tmp_path / "preds.json"),
                 "--na-prob-file", str(tmp_path / "odds.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"bertrain evaluate: error: {tmp_path / 'odds.json'}: no value for question id p0-no2 (1 of the 3 "
                   f"predicted questions lack one): give the null_odds.json written with {tmp_path / 'preds.json'}")


@pytest.mark.parametrize("field, value, message", [
    ("is_impossible", "false", "'is_impossible' must be true or false, got 'false'"),
    ("plausible_answers", None, "'plausible_answers' is not a list, got None"),
])
def test_squad_v2_field_types_are_one_line_errors(tmp_path, field, value, message):
    """`is_impossible: "false"` was read as true (bool of a non-empty string); `plausible_answers: null` stopped
    with a TypeError traceback. Both: a ValueError naming the file and the question."""
    from bertrain.tasks.squad import read_squad

    data = json.loads(squad_v2_fixture(tmp_path / "d.json", 1).read_text())
    data["data"][0]["paragraphs"][0]["qas"][1][field] = value
    (tmp_path / "d.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match=rf"^{re.escape(str(tmp_path / 'd.json'))}: question id p0-no1: "
                                         rf"{re.escape(message)}$"):
        read_squad(tmp_path / "d.json", version_2_with_negative=True)
    data["data"][0]["paragraphs"][0]["qas"][1]["is_impossible"] = True  # JSON's own values still read
    data["data"][0]["paragraphs"][0]["qas"][1]["plausible_answers"] = []
    data["data"][0]["paragraphs"][0]["qas"][0].pop("is_impossible")  # absent: answerable, as in v1.1 files
    (tmp_path / "d.json").write_text(json.dumps(data))
    assert [ex.is_impossible for ex in read_squad(tmp_path / "d.json")] == [False, True, True]


def test_evaluating_with_other_settings_than_the_fine_tuning_warns(tmp_path, tiny_model, capsys, caplog):
    """`do_train false` on an exported model with other feature settings than its task.json records: one warning
    naming them (its numbers differ from those its fine-tuning printed); none with the same settings."""
    rte = write_rte_like(tmp_path / "RTE")
    run = tmp_path / "rte"
    args = ["finetune", "glue", "--task", "rte", "--data-dir", str(rte), *TINY]
    assert main([*args, "--init", str(tiny_model), "--output", str(run), "--data.max_seq_length", "32",
                 "--train.steps", "1"]) == 0
    for length, warned in (("48", True), ("32", False)):
        caplog.clear()
        assert main([*args, "--init", str(run / "final"), "--output", str(tmp_path / f"eval-{length}"),
                     "--do_train", "false", "--data.max_seq_length", length]) == 0
        lines = [r.getMessage() for r in caplog.records if "fine-tuned with other settings" in r.getMessage()]
        assert len(lines) == warned
        if warned:
            assert "data.max_seq_length 32 there, 48 here" in lines[0]
    capsys.readouterr()


@pytest.mark.parametrize("key", ["n_best_size", "max_answer_length"])
def test_squad_postprocessing_settings_below_one_are_refused(tmp_path, tiny_model, capsys, key):
    """data.n_best_size or data.max_answer_length 0 left no span to choose: every prediction was "" (or the nonce
    "empty"), scored as if meant. Refused as a config error before any work."""
    dev = squad_v2_fixture(tmp_path / "dev.json", 1)
    assert main(["finetune", "squad", "--do_train", "false", "--dev", str(dev), "--init", str(tiny_model),
                 "--output", str(tmp_path / "o"), f"--data.{key}", "0"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"bertrain finetune: error: config key 'data.{key}' must be >= 1, got 0 (--data.{key} on the command line)")
    assert not (tmp_path / "o").exists()


def test_a_last_batch_as_short_as_the_number_of_classes_is_scored(tmp_path, tiny_model, capsys):
    """A dev sentence of characters BERT's tokenizer drops (zero-width spaces: [CLS] [SEP], 2 tokens) alone in the
    last evaluation batch: its 2-class logits were widened like QA's per-token logits (the batch is trimmed to 2
    columns) and joining them to the other batches stopped the run ("all the input array dimensions ... must
    match"). Now scored as any other: 9 dev predictions, the same for it whatever the batch size."""
    d = tmp_path / "CoLA"
    d.mkdir()
    words = ["the dog ran .", "a cat sat on the mat .", "people like the house .", "the family sat ."]
    rows = [f"src\t{i % 2}\t\t{words[i % 4]}" for i in range(8)] + ["src\t1\t\t\u200b\u200b"]
    (d / "train.tsv").write_text("\n".join(rows[:8]) + "\n", encoding="utf-8")
    (d / "dev.tsv").write_text("\n".join(rows) + "\n", encoding="utf-8")
    preds = {}
    for batch in ("8", "3"):
        out = tmp_path / f"b{batch}"
        assert main(["finetune", "glue", "--task", "cola", "--data-dir", str(d), "--init", str(tiny_model),
                     "--output", str(out), "--data.max_seq_length", "16", "--train.steps", "1", *TINY,
                     "--eval_batch_size", batch]) == 0
        capsys.readouterr()
        assert json.loads((out / "eval_results.json").read_text())["dev"]["examples"] == 9
        preds[batch] = (out / "dev_predictions.tsv").read_text()
    assert preds["8"] == preds["3"]


@pytest.mark.parametrize("flag, key, extra", [("--dev", "data.dev_file", ["--do_train", "false"]),
                                              ("--train", "data.train_file", ["--do_eval", "false"])])
def test_a_missing_squad_file_names_its_key(tmp_path, tiny_model, capsys, flag, key, extra):
    """A SQuAD file that is not there: one line naming the config key, its flag and the path (before: "No such
    file or directory (PATH); the path does not exist", which said neither which input nor how it was given)."""
    missing = tmp_path / "nothere.json"
    assert main(["finetune", "squad", "--init", str(tiny_model), flag, str(missing), "--output", str(tmp_path / "o"),
                 *extra]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"bertrain finetune: error: config key '{key}' ({flag}): {missing} does not exist")
