"""Deployment: what a fine-tuned model becomes after training.

* `onnx_export.py`  `bertrain export --format onnx`: the padded inference graph through `torch.onnx.export`
                    (dynamic batch and sequence axes), verified against PyTorch on real tokenised text, written
                    beside its tokenizer files and `onnx.json`; optionally as a Triton model repository.
* `predict.py`      `Predictor` (`bertrain predict`, `bertrain serve`): tokenisation, batching and post-processing
                    around a backend, one code path for every backend; `read_items` reads input files;
                    `run_task_file`: THE rule for a model folder's task.json (a step-N folder: its run's), which
                    `bertrain export` writes and `Predictor` reads.
* `backends.py`     the one small interface `Predictor` runs (`TorchBackend`, `OnnxRuntimeBackend`): numpy
                    features in, named numpy outputs back.
* `server.py`       `bertrain serve`: FastAPI + uvicorn, `POST /predict`, `GET /health`, micro-batching of
                    concurrent requests, a request size limit, graceful shutdown.
* `config.py`       `ServeConfig` (no web framework imported, so `bertrain serve --help` is quick).
* `loadtest.py`     concurrent clients against a running server (benchmarks/serve_load.py, tests).

The packages (onnx, onnxruntime, fastapi, uvicorn, httpx) are the optional extra `bertrain[deploy]`;
`require` turns a missing one into a one-line error naming the extra; they are imported only where used, so
`import bertrain.deploy.predict` and `bertrain --help` work without them.

Deployment sits above the tasks: modules here import `bertrain.tasks` and `bertrain.model` at the top; nothing in
tasks/, data/, model/ or train/ imports `bertrain.deploy` (tests/test_imports.py checks the graph).
"""
from __future__ import annotations

import importlib
from types import ModuleType

from bertrain.utils.errors import UserError

EXTRA = 'pip install "bertrain[deploy]"'


def require(module: str, what: str) -> ModuleType:
    """Import an optional package of the deploy extra, or raise a `UserError` (exit 2) that says how to get it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise UserError(f"{what} needs the Python package {module.split('.')[0]!r}, which is not installed "
                        f"({e}): {EXTRA}") from None
