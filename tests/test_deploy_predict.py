"""Prediction inputs (deploy/predict.py `read_items`). `Predictor` on each backend: test_deploy_onnx.py,
test_deploy_serve.py; `bertrain predict` end to end: test_cli_reliability.py, test_tasks_finetune.py."""
from __future__ import annotations

import io

from bertrain.deploy.predict import read_items


def test_predict_numbers_inputs_from_0():
    jsonl = io.StringIO('{"text": "a"}\n\n{"text": "b", "id": 17}\n{"text": "c"}\n')
    assert [it["id"] for it in read_items(jsonl, "x.jsonl", "jsonl", "classification")] == ["0", "17", "2"]
    tsv = io.StringIO("who ?\tann sat .\n\nwhat ?\tthe mat .\n")
    assert [it["id"] for it in read_items(tsv, "x.tsv", "tsv", "qa")] == ["0", "1"]
