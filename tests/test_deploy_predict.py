"""Prediction inputs (deploy/predict.py `read_items`). `Predictor` on each backend: test_deploy_onnx.py,
test_deploy_serve.py; `bertrain predict` end to end: test_cli_reliability.py, test_tasks_finetune.py."""
from __future__ import annotations

import io

import pytest

from helpers import save_tiny_head_model

from bertrain.deploy.predict import read_items


def test_predict_numbers_inputs_from_0():
    jsonl = io.StringIO('{"text": "a"}\n\n{"text": "b", "id": 17}\n{"text": "c"}\n')
    assert [it["id"] for it in read_items(jsonl, "x.jsonl", "jsonl", "classification")] == ["0", "17", "2"]
    tsv = io.StringIO("who ?\tann sat .\n\nwhat ?\tthe mat .\n")
    assert [it["id"] for it in read_items(tsv, "x.tsv", "tsv", "qa")] == ["0", "1"]


@pytest.mark.parametrize("line, task, message", [
    ('{"question": "q", "context": "\\ud800 abc"}', "qa", "'context' holds a lone UTF-16 surrogate (U+D800) at character 1"),
    ('{"text": "ok \\udc80"}', "classification", "'text' holds a lone UTF-16 surrogate (U+DC80) at character 4"),
    ('{"question": "q", "context": "  "}', "qa", "'context' is empty"),
    ('{"question": "", "context": "c"}', "qa", "'question' is empty"),
    ('{"text": "a", "text_pair": ""}', "classification", "'text_pair' is empty"),
    ('{"sentence1": "a", "sentence2": 3}', "classification", "'sentence2' must be a string"),
])
def test_bad_text_is_refused_naming_the_file_and_line(line, task, message):
    f = io.StringIO('{"question": "q", "context": "c", "text": "t"}\n\n' + line + "\n")
    with pytest.raises(ValueError) as e:
        list(read_items(f, "in.jsonl", "jsonl", task))
    assert str(e.value).startswith("in.jsonl:3: ") and message in str(e.value)


def test_a_null_text_pair_is_a_single_text():
    f = io.StringIO('{"text": "a", "text_pair": null}\n')
    assert [it["text"] for it in read_items(f, "in.jsonl", "jsonl", "classification")] == ["a"]


def _tiny_model(cls, folder, positions: int):
    return save_tiny_head_model(cls, folder, positions)


def test_the_sequence_length_never_exceeds_the_models_positions(tmp_path, capsys):
    """A length beyond the model's positions failed only at the first input that long: a QA model without
    task.json (default 384) on a 64-position model answered short contexts and raised on a long one; the server
    answered such requests 422, blaming the client. Now the default is capped to the positions (long contexts are
    read in windows) and a larger --max-seq-length is refused before any input is read."""
    from bertrain.cli import main
    from bertrain.deploy.predict import Predictor
    from bertrain.model.bert import BertForQuestionAnswering, BertForSequenceClassification

    qa = _tiny_model(BertForQuestionAnswering, tmp_path / "qa", positions=64)
    context = " ".join(f"the cat sat on mat number {i} ." for i in range(40))  # ~300 tokens: several windows
    p = Predictor(qa)
    assert p.max_seq_length == 64
    (answer,) = p.predict([{"question": "where did the cat sit ?", "context": context}])
    assert answer["answer"] == context[answer["start"]:answer["end"]] and answer["answer"]

    cls = _tiny_model(BertForSequenceClassification, tmp_path / "cls", positions=64)
    assert Predictor(cls).max_seq_length == 64
    assert Predictor(cls, max_seq_length=32).max_seq_length == 32
    with pytest.raises(ValueError, match=r"--max-seq-length is 128, more than the 64 positions of the model in .*"
                                         r"use --max-seq-length 64 or less"):
        Predictor(cls, max_seq_length=128)
    (cls / "task.json").write_text('{"kind": "classification", "max_seq_length": 100}')
    assert Predictor(cls).max_seq_length == 64  # an older run's task.json: capped, with a warning
    # the command refuses it in one line before reading any input
    capsys.readouterr()
    assert main(["predict", "--model", str(qa), "--max-seq-length", "128",
                 "--input", str(tmp_path / "none.jsonl")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("bertrain predict: error: --max-seq-length is 128, more than the 64 positions")
    assert "Traceback" not in "\n".join(err)


def test_a_folder_without_task_json_shows_the_label_names_of_its_config(tmp_path):
    """A classifier fine-tuned with transformers has its label names in config.json's id2label (no task.json):
    predict shows them, as transformers' pipeline does (before: the indices "0", "1"); transformers' placeholders
    LABEL_0, LABEL_1 still show as the indices."""
    import json

    from bertrain.deploy.predict import Predictor
    from bertrain.model.bert import BertForSequenceClassification

    folder = _tiny_model(BertForSequenceClassification, tmp_path / "cls", positions=64)
    config = json.loads((folder / "config.json").read_text())
    assert not (folder / "task.json").exists() and config["id2label"] == {"0": "LABEL_0", "1": "LABEL_1"}
    (plain,) = Predictor(folder).predict([{"text": "the cat sat"}])
    assert set(plain["probabilities"]) == {"0", "1"}

    config["id2label"] = {"0": "NEGATIVE", "1": "POSITIVE"}
    config["label2id"] = {"NEGATIVE": 0, "POSITIVE": 1}
    (folder / "config.json").write_text(json.dumps(config))
    (named,) = Predictor(folder).predict([{"text": "the cat sat"}])
    assert named["probabilities"] == {"NEGATIVE": plain["probabilities"]["0"], "POSITIVE": plain["probabilities"]["1"]}
    assert named["label"] == {"0": "NEGATIVE", "1": "POSITIVE"}[plain["label"]]


def test_predict_says_how_many_inputs_were_cut_to_the_sequence_length(tmp_path, capsys):
    """A classification input longer than max_seq_length is cut (as in fine-tuning): predict says how many were,
    instead of classifying the first tokens of a long document silently."""
    import json

    from bertrain.cli import main
    from bertrain.model.bert import BertForSequenceClassification

    folder = _tiny_model(BertForSequenceClassification, tmp_path / "cls", positions=64)
    items = tmp_path / "in.jsonl"
    long = " ".join(["the cat sat on the mat ."] * 10)  # 70 tokens
    items.write_text("\n".join(json.dumps(x) for x in [
        {"text": "the cat sat"}, {"text": long}, {"text": "a dog", "text_pair": long}, {"text": "short", "text_pair": "a"}]))
    assert main(["predict", "--model", str(folder), "--input", str(items), "--max-seq-length", "32"]) == 0
    err = capsys.readouterr().err
    assert "2 of 4 inputs were longer than 32 tokens: the model read their first 32" in err
    assert main(["predict", "--model", str(folder), "--text", "the cat sat", "--text-pair", "on the mat"]) == 0
    assert "longer than" not in capsys.readouterr().err
