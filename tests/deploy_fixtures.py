"""Models shared by tests/test_deploy_onnx.py and tests/test_deploy_serve.py, built once per session: the real
all-MiniLM-L6-v2 encoder with a classification head and a QA head (initialised with a fixed seed and saved, so they
load as trained), and their ONNX exports (written by `bertrain export --format onnx`, the QA one as a Triton model
repository). conftest.py registers the fixture, so it is built once per session (assigned in each test
module instead, it would be one fixture per module, built once per module)."""
from __future__ import annotations

import contextlib
import io
import pytest

from bertrain.cli import main


@pytest.fixture(scope="session")
def deploy_models(tmp_path_factory, minilm_path) -> dict:
    pytest.importorskip("onnxruntime", reason="needs the deploy extra: pip install 'bertrain[deploy]'")
    pytest.importorskip("onnxscript", reason="needs the deploy extra: pip install 'bertrain[deploy]'")
    from bertrain.deploy.loadtest import seeded_head_model

    root = tmp_path_factory.mktemp("deploy")
    models: dict = {"cls": seeded_head_model(minilm_path, "classification", root / "cls", seed=0),
                    "qa": seeded_head_model(minilm_path, "qa", root / "qa", seed=0)}
    for name, extra in (("cls", []), ("qa", ["--triton"])):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            code = main(["export", str(models[name]), str(root / f"{name}-onnx"), "--format", "onnx", *extra])
        assert code == 0, out.getvalue()
        models[f"{name}_export_output"] = out.getvalue()
    models["cls_onnx"] = root / "cls-onnx"
    models["qa_repository"] = root / "qa-onnx"
    models["qa_onnx"] = root / "qa-onnx" / "bert_qa" / "1"
    return models
