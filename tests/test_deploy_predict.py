"""Prediction inputs (deploy/predict.py `read_items`). `Predictor` on each backend: test_deploy_onnx.py,
test_deploy_serve.py; `bertrain predict` end to end: test_cli_reliability.py, test_tasks_finetune.py."""
from __future__ import annotations

import io

import pytest

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
