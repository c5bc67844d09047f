"""Fine-tuning tasks and their metrics, audited as a user meets them: GLUE files in the official layouts that
cannot be scored, SQuAD files whose text the tokenizer drops, and the official SQuAD scripts' numbers."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from helpers import TINY, one_line_error, run_cli, save_tiny_model

from bertrain.tasks.metrics import glue_compute_metrics

STSB_COLS = "index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2"


def _stsb_row(i: int, score: float | None) -> str:
    words = "the cat dog sat on a mat in house".split()
    row = (f"{i}\tmain-captions\tMSRvid\t2012test\t{i:04d}\tnone\tnone\t{' '.join(words[i % 9:] + words[:i % 9])} ."
           f"\tA {words[(2 * i) % 9]} sat on a mat .")
    return row if score is None else f"{row}\t{score:.3f}"


def _write_stsb(d: Path, n_train: int, n_dev: int) -> Path:
    d.mkdir(parents=True)
    (d / "train.tsv").write_text("\n".join([STSB_COLS + "\tscore"] + [_stsb_row(i, i % 5) for i in range(n_train)])
                                 + "\n", encoding="utf-8")
    (d / "dev.tsv").write_text("\n".join([STSB_COLS + "\tscore"] + [_stsb_row(i, 4.2 - i) for i in range(n_dev)])
                               + "\n", encoding="utf-8")
    return d


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


# ----------------------------------------------------------------------------------------------- STS-B

def test_stsb_dev_split_of_one_example_is_refused_before_training_naming_the_file(tmp_path, tiny_model, capsys):
    """Pearson/Spearman of one example are undefined: scipy's "`x` and `y` must have length at least 2." came after
    the training, naming neither the file nor the task, and left a run folder the corrected command refused. Now
    the dev file is refused while the splits are read, and the corrected command runs in the same folder."""
    data = _write_stsb(tmp_path / "STS-B", n_train=8, n_dev=1)
    out = tmp_path / "out"
    argv = ["finetune", "glue", "--task", "stsb", "--data-dir", data, "--init", tiny_model, "--output", out,
            "--data.max_seq_length", "32", "--train.steps", "1", "--metrics.report_to", "[]", *TINY]
    code, _, err = run_cli(capsys, *argv)
    line = one_line_error(err)
    assert code == 2
    assert f"{data / 'dev.tsv'}: 1 example to score" in line and "at least 2" in line
    assert not (out / "config.yaml").exists() and not list(out.glob("step-*"))

    _write_stsb(tmp_path / "fixed" / "STS-B", n_train=8, n_dev=3)
    code, _, err = run_cli(capsys, *argv[:5], tmp_path / "fixed" / "STS-B", *argv[6:])
    assert code == 0, err
    dev = json.loads((out / "eval_results.json").read_text())["dev"]
    assert dev["examples"] == 3
    # the dev predictions file holds the scores eval_results.json's correlations were computed from
    rows = [line.split("\t") for line in (out / "dev_predictions.tsv").read_text().splitlines()[1:]]
    again = glue_compute_metrics("stsb", [float(r[1]) for r in rows], [float(r[2]) for r in rows])
    assert again["pearson"] == pytest.approx(dev["pearson"], abs=1e-6)


def test_stsb_dev_predictions_are_the_scored_values_not_the_submissions_clipped_strings(tmp_path):
    """The dev predictions file used the GLUE-server strings (clipped to [0, 5], 3 decimals): a model's -0.8 read
    0.000, and close scores (0.0301, 0.0304) the same 0.030, so a Pearson recomputed from the file differed from
    eval_results.json's. The test submission keeps the server's format."""
    from bertrain.tasks.glue import TASKS, GlueExample, write_dev_predictions, write_submission

    task = TASKS["stsb"]
    preds = np.asarray([-0.8, 0.0301, 0.0304, 5.7, 2.5], dtype=np.float32)
    labels = [0.2, 1.0, 1.4, 4.8, 2.0]
    examples = [GlueExample(f"f:{i}", "a b", "c d", y, str(i)) for i, y in enumerate(labels)]
    write_dev_predictions(tmp_path / "dev.tsv", task, examples, preds)
    rows = [line.split("\t") for line in (tmp_path / "dev.tsv").read_text().splitlines()[1:]]
    assert [float(r[1]) for r in rows] == pytest.approx(preds.tolist(), abs=1e-7)
    from_file = glue_compute_metrics("stsb", [float(r[1]) for r in rows], labels)
    assert from_file["pearson"] == pytest.approx(glue_compute_metrics("stsb", preds.tolist(), labels)["pearson"],
                                                 abs=1e-9)
    write_submission(tmp_path / "STS-B.tsv", task, examples, preds)
    assert (tmp_path / "STS-B.tsv").read_text().splitlines() == [
        "index\tprediction", "0\t0.000", "1\t0.030", "2\t0.030", "3\t5.000", "4\t2.500"]


def test_stsb_correlations_of_too_few_values_name_the_counts():
    with pytest.raises(ValueError, match="at least 2: got 1 predictions for 1 labels"):
        glue_compute_metrics("stsb", [1.0], [2.0])
    with pytest.raises(ValueError, match="2 predictions for 3 labels"):
        glue_compute_metrics("stsb", [1.0, 2.0], [2.0, 3.0, 1.0])


# ----------------------------------------------------------------------------------------------- SQuAD files

def _squad_file(path: Path, context: str, answer: str) -> Path:
    ok = {"context": "Ada wrote it .", "qas": [{"id": "ok1", "question": "who wrote it ?",
                                                "answers": [{"text": "Ada", "answer_start": 0}]}]}
    odd = {"context": context, "qas": [{"id": "zw1", "question": "what ?",
                                        "answers": [{"text": answer, "answer_start": context.index(answer)}]}]}
    path.write_text(json.dumps({"version": "1.1", "data": [{"title": "t", "paragraphs": [ok, odd]}]}),
                    encoding="utf-8")
    return path


@pytest.mark.parametrize("context, answer, message", [
    ("\u200b\u200b \ufeff", "\u200b", "question id zw1: the context has no tokens"),
    ("Ada \u200b wrote it .", "\u200b", "question id zw1: the answer '\\u200b' covers no token"),
])
def test_squad_text_the_tokenizer_drops_is_an_error_naming_the_file(tmp_path, tiny_model, capsys, context, answer,
                                                                    message):
    """A context (or an answer) of zero-width characters passes the reader's empty checks, but has no token: the
    error named only the question id, not which of the run's two files (--train, --dev) holds it."""
    good = _squad_file(tmp_path / "good.json", "Ann sat on a mat .", "mat")
    bad = _squad_file(tmp_path / "bad.json", context, answer)
    code, _, err = run_cli(capsys, "finetune", "squad", "--train", bad, "--dev", good, "--init", tiny_model,
                           "--output", tmp_path / "out", "--train.steps", "1", "--data.max_seq_length", "32",
                           "--data.max_query_length", "8", "--data.cache_dir", "", "--metrics.report_to", "[]", *TINY)
    line = one_line_error(err)
    assert code == 2
    assert f"error: {bad}: {message}" in line and "fix or remove" in line
