"""The GLUE distribution's files, written down column for column (glue_data/<TASK>/ as download_glue_data.py
leaves them), read as google-research/bert's run_classifier.py and transformers' glue processors read them: which
columns are the texts, the label and the index, the label ids, and the GLUE server's submission file per task."""
from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest

from conftest import ASSETS

from bertrain.tasks.common import load_task_tokenizer
from bertrain.tasks.glue import (DIAGNOSTIC_SUBMISSION, TASKS, build_features, model_label_ids, read_diagnostic,
                                 read_split, write_submission)

MNLI_COLS = "index\tpromptID\tpairID\tgenre\tsentence1_binary_parse\tsentence2_binary_parse\tsentence1_parse\t" \
            "sentence2_parse\tsentence1\tsentence2"
MNLI_ROW = "0\t31193\t31193n\tgovernment\t( ( A ) )\t( ( B ) )\t(ROOT (S A))\t(ROOT (S B))\tA man sleeps .\t" \
           "A person rests ."
STSB_COLS = "index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2"
STSB_ROW = "0\tmain-captions\tMSRvid\t2012test\t0001\tnone\tnone\tA plane is taking off .\tAn air plane is taking off ."

# task -> {file: its lines}, in the official layouts. CoLA's train/dev have no header line (source, label, the
# author's mark, sentence); every test file has one and an index column; MNLI's dev files carry five annotator
# labels before gold_label; QQP's test has only id, question1, question2.
OFFICIAL = {
    "cola": {"train.tsv": ["gj04\t1\t\tOur friends won't buy this analysis ."],
             "dev.tsv": ["gj04\t0\t*\tThey drank the pub ."],
             "test.tsv": ["index\tsentence", "0\tBill whistled past the house ."]},
    "sst2": {"train.tsv": ["sentence\tlabel", "hide new secretions from the parental units \t0"],
             "dev.tsv": ["sentence\tlabel", "it 's a charming and often affecting journey . \t1"],
             "test.tsv": ["index\tsentence", "0\tuneasy mishmash of styles and genres ."]},
    "mrpc": {"train.tsv": ["\ufeffQuality\t#1 ID\t#2 ID\t#1 String\t#2 String", "1\t702876\t702977\tAmrozi .\tReferring ."],
             "dev.tsv": ["\ufeffQuality\t#1 ID\t#2 ID\t#1 String\t#2 String", "0\t1355540\t1355592\tHe said .\tThe foods ."],
             "test.tsv": ["index\t#1 ID\t#2 ID\t#1 String\t#2 String", "0\t1089874\t1089925\tPCCW 's .\tCurrent ."]},
    "stsb": {"train.tsv": [STSB_COLS + "\tscore", STSB_ROW + "\t5.000"],
             "dev.tsv": [STSB_COLS + "\tscore", STSB_ROW + "\t3.800"],
             "test.tsv": [STSB_COLS, STSB_ROW]},
    "qqp": {"train.tsv": ["id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate",
                          "133273\t213221\t213222\tHow is the life of a math student ?\tWhich level of math ?\t0",
                          # one of the two rows of GLUE's own QQP train.tsv whose question2 is empty
                          "201841\t303951\t174363\tHow can I create an Android app ?\t\t0"],
             "dev.tsv": ["id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate",
                         "201359\t303345\t201835\tWhy are African - Americans so beautiful ?\tWhy are hispanics ?\t1"],
             "test.tsv": ["id\tquestion1\tquestion2", "0\tWould the idea of Trump work ?\tWhat is your opinion ?"]},
    "mnli": {"train.tsv": [MNLI_COLS + "\tlabel1\tgold_label", MNLI_ROW + "\tneutral\tneutral"],
             "dev_matched.tsv": [MNLI_COLS + "\tlabel1\tlabel2\tlabel3\tlabel4\tlabel5\tgold_label",
                                 MNLI_ROW + "\tneutral\tentailment\tentailment\tentailment\tneutral\tentailment"],
             "dev_mismatched.tsv": [MNLI_COLS + "\tlabel1\tlabel2\tlabel3\tlabel4\tlabel5\tgold_label",
                                    MNLI_ROW + "\tcontradiction\tcontradiction\tneutral\tcontradiction\t"
                                               "contradiction\tcontradiction"],
             "test_matched.tsv": [MNLI_COLS, MNLI_ROW], "test_mismatched.tsv": [MNLI_COLS, MNLI_ROW]},
    "qnli": {"train.tsv": ["index\tquestion\tsentence\tlabel", "0\tWhen ?\tIn 1990 .\tentailment"],
             "dev.tsv": ["index\tquestion\tsentence\tlabel", "0\tWhat ?\tA cat .\tnot_entailment"],
             "test.tsv": ["index\tquestion\tsentence", "0\tWho ?\tA man ."]},
    "rte": {"train.tsv": ["index\tsentence1\tsentence2\tlabel", "0\tA dog runs .\tAn animal runs .\tentailment"],
            "dev.tsv": ["index\tsentence1\tsentence2\tlabel", "0\tA dog runs .\tA cat sleeps .\tnot_entailment"],
            "test.tsv": ["index\tsentence1\tsentence2", "0\tA man .\tA person ."]},
    "wnli": {"train.tsv": ["index\tsentence1\tsentence2\tlabel", "0\tI stuck a pin .\tThe pin had a hole .\t1"],
             "dev.tsv": ["index\tsentence1\tsentence2\tlabel", "0\tThe drain is clogged .\tThe hair is .\t0"],
             "test.tsv": ["index\tsentence1\tsentence2", "0\tMaude and Dora .\tDora had seen ."]},
}

# What run_classifier.py / transformers' processors take from those rows: [(text_a, text_b, label)] per split.
EXPECTED = {
    "cola": {"train": [("Our friends won't buy this analysis .", None, "1")],
             "dev": [("They drank the pub .", None, "0")], "test": [("Bill whistled past the house .", None, None)]},
    "sst2": {"train": [("hide new secretions from the parental units ", None, "0")],
             "dev": [("it 's a charming and often affecting journey . ", None, "1")],
             "test": [("uneasy mishmash of styles and genres .", None, None)]},
    "mrpc": {"train": [("Amrozi .", "Referring .", "1")], "dev": [("He said .", "The foods .", "0")],
             "test": [("PCCW 's .", "Current .", None)]},
    "stsb": {"train": [("A plane is taking off .", "An air plane is taking off .", 5.0)],
             "dev": [("A plane is taking off .", "An air plane is taking off .", 3.8)],
             "test": [("A plane is taking off .", "An air plane is taking off .", None)]},
    "qqp": {"train": [("How is the life of a math student ?", "Which level of math ?", "0"),
                      ("How can I create an Android app ?", "", "0")],
            "dev": [("Why are African - Americans so beautiful ?", "Why are hispanics ?", "1")],
            "test": [("Would the idea of Trump work ?", "What is your opinion ?", None)]},
    "mnli": {"train": [("A man sleeps .", "A person rests .", "neutral")],
             "dev": [("A man sleeps .", "A person rests .", "entailment"),
                     ("A man sleeps .", "A person rests .", "contradiction")],
             "test": [("A man sleeps .", "A person rests .", None)] * 2},
    "qnli": {"train": [("When ?", "In 1990 .", "entailment")], "dev": [("What ?", "A cat .", "not_entailment")],
             "test": [("Who ?", "A man .", None)]},
    "rte": {"train": [("A dog runs .", "An animal runs .", "entailment")],
            "dev": [("A dog runs .", "A cat sleeps .", "not_entailment")], "test": [("A man .", "A person .", None)]},
    "wnli": {"train": [("I stuck a pin .", "The pin had a hole .", "1")],
             "dev": [("The drain is clogged .", "The hair is .", "0")],
             "test": [("Maude and Dora .", "Dora had seen .", None)]},
}

# The label lists of run_classifier.py (CoLA, MRPC, MNLI) and transformers' glue_processors (all nine): a class id
# of a model trained with either means the same class here.
REFERENCE_LABELS = {"cola": ("0", "1"), "sst2": ("0", "1"), "mrpc": ("0", "1"), "stsb": None, "qqp": ("0", "1"),
                    "mnli": ("contradiction", "entailment", "neutral"), "qnli": ("entailment", "not_entailment"),
                    "rte": ("entailment", "not_entailment"), "wnli": ("0", "1")}


def write_task(root: Path, name: str) -> Path:
    d = root / TASKS[name].folder
    d.mkdir(parents=True)
    for fn, lines in OFFICIAL[name].items():
        (d / fn).write_text("\n".join(lines) + "\n", encoding="utf-8")
    return d


@pytest.mark.parametrize("name", list(OFFICIAL))
def test_official_layouts_give_the_reference_fields_labels_and_submission(tmp_path, name, caplog):
    task = TASKS[name]
    assert task.labels == REFERENCE_LABELS[name]
    write_task(tmp_path, name)
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    (tok_dir / "vocab.txt").write_bytes((ASSETS / "vocab-tiny.txt").read_bytes())
    tok = load_task_tokenizer(tok_dir)
    with caplog.at_level(logging.WARNING):
        for split in ("train", "dev", "test"):
            got = [(ex.text_a, ex.text_b, ex.label) for _, exs in read_split(tmp_path, task, split) for ex in exs]
            assert got == EXPECTED[name][split], split
    if name == "qqp":  # the empty question2 is kept (as transformers and datasets keep it), and said once
        assert "1 of 2 qqp rows have an empty sentence (first: " in caplog.text
    (_, train), = read_split(tmp_path, task, "train")
    feats = build_features(train, task, tok, max_seq_length=16)
    if task.labels is not None:  # label ids are the positions in the reference label list
        assert feats["labels"].tolist() == [REFERENCE_LABELS[name].index(ex.label) for ex in train]
    # The GLUE server's files: a header, one line per test example with its index, the label string (a score for
    # STS-B, clipped to its 0..5 range).
    for (_, test), sub in zip(read_split(tmp_path, task, "test"), task.submission):
        preds = np.array([7.5]) if task.is_regression else np.array([task.num_labels - 1])
        write_submission(tmp_path / sub, task, test, preds)
        want = "5.000" if task.is_regression else task.labels[-1]
        assert (tmp_path / sub).read_text() == f"index\tprediction\n0\t{want}\n"


def test_qqp_keeps_the_empty_question_of_its_train_file_other_tasks_refuse_it(tmp_path, caplog):
    """GLUE's QQP train.tsv holds two pairs whose question2 is empty (huggingface/datasets#277): refusing them made
    QQP impossible to fine-tune on its official files. They are kept as transformers and datasets keep them
    ([CLS] q1 [SEP] [SEP]); any other task still refuses an empty sentence (a sign of a misread file)."""
    write_task(tmp_path, "qqp")
    with caplog.at_level(logging.WARNING):
        (_, train), = read_split(tmp_path, TASKS["qqp"], "train")
    assert [ex.text_b for ex in train] == ["Which level of math ?", ""]
    assert f"{tmp_path / 'QQP' / 'train.tsv'}: 1 of 2 qqp rows have an empty sentence " \
           f"(first: {tmp_path / 'QQP' / 'train.tsv'}:3)" in caplog.text
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    (tok_dir / "vocab.txt").write_bytes((ASSETS / "vocab-tiny.txt").read_bytes())
    feats = build_features(train, TASKS["qqp"], load_task_tokenizer(tok_dir), max_seq_length=16)
    types = feats["token_type_ids"][1][feats["attention_mask"][1] == 1]
    assert types[-1] == 1 and (types == 1).sum() == 1  # the empty second segment is its [SEP] alone
    # the Hub's Parquet (nyu-mll/glue qqp/train-*.parquet) has the same row with question2 ""
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa
    (tmp_path / "hub" / "qqp").mkdir(parents=True)
    pq.write_table(pa.table({"question1": ["How ?", "Why ?"], "question2": ["What ?", ""], "label": [1, 0],
                             "idx": [0, 1]}), tmp_path / "hub" / "qqp" / "train-00000-of-00001.parquet")
    (_, hub), = read_split(tmp_path / "hub", TASKS["qqp"], "train")
    assert [(ex.text_b, ex.label) for ex in hub] == [("What ?", "1"), ("", "0")]
    rte = tmp_path / "RTE" / "dev.tsv"
    rte.parent.mkdir()
    rte.write_text("index\tsentence1\tsentence2\tlabel\n0\tA dog .\t \tentailment\n")
    with pytest.raises(ValueError, match=rf"{rte}:2: empty sentence"):
        read_split(rte.parent, TASKS["rte"], "dev")


def test_the_diagnostic_set_is_found_beside_mnli_and_submitted_with_mnli_labels(tmp_path):
    """AX.tsv, the eleventh file of a GLUE submission, is the MNLI model's prediction on glue_data/diagnostic/
    diagnostic.tsv (index, sentence1, sentence2), in MNLI's label strings; the Hub has it as ax/test-*.parquet."""
    mnli = write_task(tmp_path, "mnli")
    assert read_diagnostic(mnli) is None  # no diagnostic set: no AX.tsv, nothing refused
    (tmp_path / "diagnostic").mkdir()
    (tmp_path / "diagnostic" / "diagnostic.tsv").write_text(
        "index\tsentence1\tsentence2\n0\tThe cat sat on the mat.\tThe cat did not sit on the mat.\n"
        "1\tThe cat did not sit on the mat.\tThe cat sat on the mat.\n", encoding="utf-8")
    ax = read_diagnostic(mnli)
    assert [(ex.index, ex.text_a, ex.label) for ex in ax] == [("0", "The cat sat on the mat.", None),
                                                               ("1", "The cat did not sit on the mat.", None)]
    write_submission(tmp_path / DIAGNOSTIC_SUBMISSION, TASKS["mnli"], ax, np.array([0, 2]))
    assert (tmp_path / "AX.tsv").read_text() == "index\tprediction\n0\tcontradiction\n1\tneutral\n"
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa
    (tmp_path / "hub" / "ax").mkdir(parents=True)
    (tmp_path / "hub" / "mnli").mkdir()
    pq.write_table(pa.table({"premise": ["A.", "B."], "hypothesis": ["C.", "D."], "label": [-1, -1], "idx": [0, 1]}),
                   tmp_path / "hub" / "ax" / "test-00000-of-00001.parquet")
    assert [(ex.index, ex.text_b) for ex in read_diagnostic(tmp_path / "hub" / "mnli")] == [("0", "C."), ("1", "D.")]


def test_a_models_own_label_names_give_the_task_label_ids():
    """A converted MNLI classifier means by class id 0 what its config's id2label says: `entailment` for one
    fine-tuned with transformers' run_glue.py (the `datasets` order), `contradiction` for run_classifier.py's."""
    mnli = TASKS["mnli"]
    hf_run_glue = {0: "entailment", 1: "neutral", 2: "contradiction"}
    ids = model_label_ids(mnli, hf_run_glue)
    assert [mnli.labels[i] for i in ids[[0, 1, 2]]] == ["entailment", "neutral", "contradiction"]
    roberta_mnli = {0: "CONTRADICTION", 1: "NEUTRAL", 2: "ENTAILMENT"}
    assert [mnli.labels[i] for i in model_label_ids(mnli, roberta_mnli)] == ["contradiction", "neutral", "entailment"]
    assert model_label_ids(mnli, dict(enumerate(mnli.labels))) is None  # bertrain's and run_classifier.py's order
    assert model_label_ids(mnli, {0: "LABEL_0", 1: "LABEL_1", 2: "LABEL_2"}) is None  # names that say nothing
    assert model_label_ids(TASKS["sst2"], {0: "NEGATIVE", 1: "POSITIVE"}) is None
    assert model_label_ids(TASKS["wnli"], {0: "entailment", 1: "not_entailment"}).tolist() == [1, 0]
    assert model_label_ids(TASKS["stsb"], {0: "LABEL_0"}) is None
    with pytest.raises(ValueError, match=r"names the classes \['positive', 'negative', 'neutral'\], which are not "
                                         r"mnli's \['contradiction', 'entailment', 'neutral'\]"):
        model_label_ids(mnli, {0: "positive", 1: "negative", 2: "neutral"})


def _mnli_folder(root: Path, n: int = 24) -> Path:
    """An MNLI folder in the official layout with `n` rows per split, and glue_data/diagnostic beside it."""
    rng = np.random.default_rng(0)
    words = ["a", "man", "woman", "dog", "sleeps", "runs", "the", "cat", "sat", "on", "mat", "not"]
    labels = ["contradiction", "entailment", "neutral"]

    def row(i: int) -> str:
        s1, s2 = (" ".join(rng.choice(words, 6)) for _ in range(2))
        return f"{i}\t{i}\t{i}n\tfiction\t( a )\t( b )\t(ROOT a)\t(ROOT b)\t{s1}\t{s2}"

    d = root / "MNLI"
    d.mkdir(parents=True)
    dev_head = MNLI_COLS + "\tlabel1\tlabel2\tlabel3\tlabel4\tlabel5\tgold_label"
    (d / "train.tsv").write_text("\n".join([MNLI_COLS + "\tlabel1\tgold_label"] + [
        row(i) + f"\t{labels[i % 3]}\t{labels[i % 3]}" for i in range(n)]) + "\n")
    for name in ("dev_matched.tsv", "dev_mismatched.tsv"):
        (d / name).write_text("\n".join([dev_head] + [row(i) + f"\t{labels[i % 3]}" * 6 for i in range(n)]) + "\n")
    for name in ("test_matched.tsv", "test_mismatched.tsv"):
        (d / name).write_text("\n".join([MNLI_COLS] + [row(i) for i in range(n)]) + "\n")
    (root / "diagnostic").mkdir()
    (root / "diagnostic" / "diagnostic.tsv").write_text(
        "index\tsentence1\tsentence2\n" + "".join(f"{i}\tthe cat sat on the mat\tthe cat did not sit\n"
                                                  for i in range(5)))
    return d


def test_mnli_fine_tuning_writes_ax_and_scores_a_model_by_its_own_label_names(tmp_path, capsys):
    """`finetune glue --task mnli` with the diagnostic set beside MNLI/ writes AX.tsv, the eleventh file of a GLUE
    submission (before: never written). Evaluating a model whose config orders MNLI's classes as transformers'
    run_glue does (entailment, neutral, contradiction; its head permuted to match) gives the same dev accuracy and
    submission as the model it was made from (before: its class 0 was read as contradiction)."""
    import json

    from safetensors.torch import load_file, save_file

    from bertrain.cli import main
    from helpers import TINY, save_tiny_model

    data = _mnli_folder(tmp_path / "glue_data")
    model = save_tiny_model(tmp_path / "tiny")
    out = tmp_path / "ft"
    assert main(["finetune", "glue", "--task", "mnli", "--data-dir", str(data), "--init", str(model), "--output",
                 str(out), "--data.max_seq_length", "32", "--train.steps", "6", *TINY]) == 0
    results = json.loads((out / "eval_results.json").read_text())
    assert results["test_predictions"] == ["MNLI-m.tsv", "MNLI-mm.tsv", "AX.tsv"]
    ax = (out / "AX.tsv").read_text().splitlines()
    assert ax[0] == "index\tprediction" and [r.split("\t")[0] for r in ax[1:]] == [str(i) for i in range(5)]
    assert {r.split("\t")[1] for r in ax[1:]} <= {"contradiction", "entailment", "neutral"}

    # the same model, its classes in transformers' run_glue order: head rows permuted, id2label renamed
    hf = tmp_path / "hf-order"
    hf.mkdir()
    for f in (out / "final").iterdir():
        if f.is_file() and f.name not in ("model.safetensors", "config.json", "task.json"):
            (hf / f.name).write_bytes(f.read_bytes())
    order = ["entailment", "neutral", "contradiction"]
    perm = [TASKS["mnli"].labels.index(name) for name in order]
    weights = load_file(out / "final" / "model.safetensors")
    for k in ("classifier.weight", "classifier.bias"):
        weights[k] = weights[k][perm].contiguous()
    save_file(weights, hf / "model.safetensors")
    config = json.loads((out / "final" / "config.json").read_text())
    config["id2label"] = dict(enumerate(order))
    config["label2id"] = {name: i for i, name in enumerate(order)}
    (hf / "config.json").write_text(json.dumps(config))
    for name, init in (("original", out / "final"), ("hf", hf)):
        assert main(["finetune", "glue", "--task", "mnli", "--data-dir", str(data), "--init", str(init), "--output",
                     str(tmp_path / f"eval-{name}"), "--data.max_seq_length", "32", "--do_train", "false",
                     *TINY]) == 0
    capsys.readouterr()
    a, b = (json.loads((tmp_path / f"eval-{n}" / "eval_results.json").read_text()) for n in ("original", "hf"))
    assert a["mnli-m"]["accuracy"] == b["mnli-m"]["accuracy"] and a["mnli-mm"] == b["mnli-mm"]
    for sub in ("MNLI-m.tsv", "AX.tsv"):
        assert (tmp_path / "eval-hf" / sub).read_text() == (tmp_path / "eval-original" / sub).read_text()
