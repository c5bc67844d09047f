"""`predict --dtype` / `serve --dtype` (torch backend): the whole model cast to bf16 or fp16, its outputs those of
fp32 within the format's precision, on the real MiniLM and real text (MRPC dev pairs, XQuAD questions). The
comparison is of the network's raw outputs (the logits every prediction is made from), as METHOD.md's relative
error ||out - ref|| / ||ref||: bf16 operands land between 1e-3 and 1e-2, fp16 an order of magnitude under."""
from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from bertrain.cli import main
from bertrain.deploy.backends import DTYPES
from bertrain.deploy.predict import Predictor
from conftest import shared_file

pytest.importorskip("onnxruntime", reason="needs the deploy extra: pip install 'bertrain[deploy]'")


def raw_outputs(p: Predictor, items: list[dict]) -> dict[str, np.ndarray]:
    """The backend's outputs for `items`, every batch, as the predictions were made from them."""
    seen: list[dict[str, np.ndarray]] = []
    run = p.backend.run

    def recording(inputs):
        out = run(inputs)
        seen.append(out)
        return out

    p.backend.run = recording
    p.predict(items)
    return {k: np.concatenate([o[k].reshape(-1) for o in seen]) for k in seen[0]}


def relative_error(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


@pytest.mark.parametrize("task", ["classification", "qa"])
def test_bf16_and_fp16_compute_what_fp32_computes_within_their_precision(deploy_models, task, caplog):
    from bertrain.deploy.loadtest import mrpc_items, squad_items

    if task == "classification":
        model, items = deploy_models["cls"], mrpc_items(shared_file("glue/MRPC/dev.tsv"), limit=48)
    else:
        model, items = deploy_models["qa"], squad_items(shared_file("squad/xquad-en-part1.json"), limit=8)
    want = raw_outputs(Predictor(model, batch_size=16), items)
    for dtype, bound in (("bf16", 1e-2), ("fp16", 2e-3)):
        with caplog.at_level(logging.WARNING):
            p = Predictor(model, batch_size=16, dtype=dtype)
        assert {t.dtype for t in p.backend.model.parameters()} == {DTYPES[dtype]}
        got = raw_outputs(p, items)
        assert sorted(got) == sorted(want) and all(got[k].dtype == np.float32 for k in got)  # outputs in fp32
        for name in want:
            err = relative_error(got[name], want[name])
            assert 0 < err < bound, (dtype, name, err)  # > 0: the model really ran in the lower precision
    # fp16 on a CPU works, and says that it is slow there
    assert any("--dtype fp16 on the CPU" in r.getMessage() for r in caplog.records)


def test_predict_dtype_on_the_command_line(deploy_models, capsys):
    cls, onnx = str(deploy_models["cls"]), str(deploy_models["cls_onnx"])
    assert main(["predict", "--model", cls, "--dtype", "bf16", "--text", "a gripping, funny film"]) == 0
    cap = capsys.readouterr()
    assert "classification, torch bf16)" in cap.err and '"label"' in cap.out
    # an ONNX export runs in float32: --dtype is refused in one line, before anything is loaded
    assert main(["predict", "--model", onnx, "--backend", "onnxruntime", "--dtype", "bf16", "--text", "hi"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--dtype bf16: an ONNX export holds float32 weights" in err[0]
    with pytest.raises(SystemExit):  # argparse: not one of the choices
        main(["predict", "--model", cls, "--dtype", "fp8", "--text", "hi"])


def test_serve_reports_its_dtype(deploy_models):
    from fastapi.testclient import TestClient

    from bertrain.deploy.config import ServeConfig
    from bertrain.deploy.server import create_app

    app = create_app(Predictor(deploy_models["cls"], dtype="bf16"), ServeConfig())
    with TestClient(app) as c:
        assert c.get("/health").json()["dtype"] == "bf16"
        r = c.post("/predict", json={"text": "a gripping, funny film"})
        assert r.status_code == 200, r.text
        assert 'dtype="bf16"' in c.get("/metrics").text
    assert torch.get_default_dtype() == torch.float32  # nothing process-wide was changed
