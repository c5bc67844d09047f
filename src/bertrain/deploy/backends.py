"""What runs the network for `Predictor` (and so for `bertrain predict` and `bertrain serve`): one small interface.

A backend takes the three (B, T) int64 feature arrays and returns the task's outputs as named float32 numpy arrays:

    qa              start_logits (B, T), end_logits (B, T)
    classification  logits (B, num_labels)                     (num_labels == 1: regression)
    encoder         last_hidden_state (B, T, H), pooler_output (B, H)

Tokenisation before and post-processing after (SQuAD spans, softmax and label names) are `Predictor`'s and are the
same code for every backend; a backend is only the forward pass.

* `TorchBackend`: a bertrain model folder, run by PyTorch on any device.
* `OnnxRuntimeBackend`: a folder written by `bertrain export --format onnx` (model.onnx + onnx.json), run by ONNX
  Runtime (CPU, or CUDA when onnxruntime-gpu provides it).
"""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from bertrain.deploy import require
from bertrain.model.bert import BertForQuestionAnswering, BertForSequenceClassification, BertModel
from bertrain.model.hf import model_class_for
from bertrain.utils.errors import UserError

log = logging.getLogger(__name__)

INPUT_NAMES = ("input_ids", "token_type_ids", "attention_mask")
TASK_OUTPUTS = {
    "qa": ("start_logits", "end_logits"),
    "classification": ("logits",),
    "encoder": ("last_hidden_state", "pooler_output"),
}
BACKENDS = ("torch", "onnxruntime")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
"""`--dtype`: what the torch backend's weights and activations are held in."""
ONNX_FILE = "model.onnx"
ONNX_META = "onnx.json"  # written by `bertrain export --format onnx` beside model.onnx


class Backend(Protocol):
    name: str
    output_names: tuple[str, ...]

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """`INPUT_NAMES` -> (B, T) int64 arrays in; `output_names` -> float32 arrays out."""


def task_of(model: torch.nn.Module) -> str:
    """"qa", "classification" or "encoder", from the model's class."""
    for cls, task in ((BertForQuestionAnswering, "qa"), (BertForSequenceClassification, "classification"),
                      (BertModel, "encoder")):
        if isinstance(model, cls):
            return task
    raise UserError(f"a {type(model).__name__} cannot be deployed: give a question-answering, classification "
                    "or encoder model (BertForPreTraining is for pretraining; fine-tune it first)")


def output_names(model: torch.nn.Module) -> tuple[str, ...]:
    names = TASK_OUTPUTS[task_of(model)]
    if task_of(model) == "encoder" and model.pooler is None:
        names = names[:1]
    return names


class TorchBackend:
    """A PyTorch model in inference mode (its speed options as loaded: classification and QA run unpadded).

    `dtype` "bf16" / "fp16" casts the whole model, as `from_pretrained(torch_dtype=...)` does in transformers, rather
    than autocasting it: with no gradients and no optimizer there is nothing to keep in fp32, and every weight is read
    in half the bytes. The outputs are returned in float32 whatever the dtype."""

    name = "torch"

    def __init__(self, model: torch.nn.Module, device: str | torch.device = "cpu", dtype: str = "fp32") -> None:
        self.device = torch.device(device)
        self.dtype = dtype
        self.model = model.to(self.device, DTYPES[dtype]).eval()
        self.output_names = output_names(model)

    @torch.no_grad()
    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        batch = {k: torch.from_numpy(np.ascontiguousarray(inputs[k])).to(self.device) for k in INPUT_NAMES}
        out = self.model(**batch)
        return {n: getattr(out, n).float().cpu().numpy() for n in self.output_names}


def load_torch_model(model_dir: Path, task: str) -> torch.nn.Module:
    """The model of a fine-tuned folder for `task` ("qa" or "classification"); a head without trained weights is
    refused (its predictions would be noise)."""
    if (model_dir / ONNX_FILE).is_file() and not any(model_dir.glob("*.safetensors")) \
            and not (model_dir / "pytorch_model.bin").is_file():
        raise UserError(f"{model_dir} is an ONNX export (model.onnx, no PyTorch weights): run it with "
                        "--backend onnxruntime, or give the PyTorch model folder it was exported from")
    cls = model_class_for(model_dir)
    model = (BertForQuestionAnswering if task == "qa" else BertForSequenceClassification).from_pretrained(model_dir)
    untrained = model.loading_info.get("initialized") or []
    if untrained:
        raise UserError(f"{model_dir} is a {cls.__name__} folder without trained weights for the "
                        f"{', '.join(untrained)} a {task} prediction needs: give a model fine-tuned for {task} "
                        f"(bertrain finetune {'squad' if task == 'qa' else 'glue'} writes OUTPUT/final)")
    return model


def parse_device(device: str | torch.device) -> torch.device:
    """`device` (--device) as a torch.device; a name torch does not know is a `UserError`, not a traceback."""
    try:
        return torch.device(device)
    except (RuntimeError, ValueError, TypeError):
        raise UserError(f"--device {device}: not a device name; use cpu, cuda or cuda:N (the N-th GPU)") from None


def check_torch_device(device: str | torch.device) -> torch.device:
    """`device` checked usable by PyTorch before a model is moved there (which fails with an AssertionError or a
    RuntimeError deep in torch): a missing GPU or a GPU index beyond the visible ones is one line naming --device."""
    dev = parse_device(device)
    if dev.type == "cpu":
        return dev
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise UserError(f"--device {device}: PyTorch sees no CUDA GPU here (torch.cuda.is_available() is False: "
                            "no GPU, no driver, CUDA_VISIBLE_DEVICES empty or a CPU-only torch); use --device cpu")
        count = torch.cuda.device_count()
        if dev.index is not None and dev.index >= count:
            raise UserError(f"--device {device}: only {count} CUDA GPU(s) are visible (cuda:0"
                            f"{f' to cuda:{count - 1}' if count > 1 else ''}); choose one of them")
        return dev
    try:
        torch.empty(0, device=dev)
    except (RuntimeError, AssertionError):  # (torch's message lists every dispatch key: not one line)
        raise UserError(f"--device {device}: this PyTorch build or machine cannot run on {dev.type}; use --device "
                        "cpu or cuda") from None
    return dev


def onnx_providers(device: str | torch.device) -> list:
    """ONNX Runtime's execution providers for a torch-style device string ("cpu", "cuda", "cuda:1")."""
    ort = require("onnxruntime", "the ONNX Runtime backend")
    dev = parse_device(device)
    if dev.type == "cpu":
        return ["CPUExecutionProvider"]
    if dev.type == "cuda":
        if "CUDAExecutionProvider" not in ort.get_available_providers():
            raise UserError(f"--device {device}: this onnxruntime has no CUDA provider (available: "
                            f"{', '.join(ort.get_available_providers())}); install onnxruntime-gpu instead of "
                            "onnxruntime, or use --device cpu")
        return [("CUDAExecutionProvider", {"device_id": dev.index or 0}), "CPUExecutionProvider"]
    raise UserError(f"--device {device}: ONNX Runtime runs on cpu or cuda")


class OnnxRuntimeBackend:
    """An exported model.onnx in an ONNX Runtime session (as many intra-op threads as torch uses, so the two
    backends are compared on the same cores)."""

    name = "onnxruntime"

    def __init__(self, model_dir: str | os.PathLike, device: str | torch.device = "cpu") -> None:
        ort = require("onnxruntime", "the ONNX Runtime backend")
        model_dir = Path(model_dir)
        path = model_dir / ONNX_FILE
        if not path.is_file():
            raise UserError(f"{model_dir} has no {ONNX_FILE}: export the model first "
                            f"(bertrain export {model_dir} ONNX_DIR --format onnx) and give ONNX_DIR")
        self.meta = json.loads((model_dir / ONNX_META).read_text(encoding="utf-8")) \
            if (model_dir / ONNX_META).is_file() else {}
        options = ort.SessionOptions()
        options.intra_op_num_threads = torch.get_num_threads()
        options.inter_op_num_threads = 1
        options.log_severity_level = 3  # errors only: no per-session warnings about unused initialisers
        self.session = ort.InferenceSession(str(path), options, providers=onnx_providers(device))
        self.input_names = tuple(i.name for i in self.session.get_inputs())
        self.output_names = tuple(o.name for o in self.session.get_outputs())

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        feed = {k: np.ascontiguousarray(inputs[k], dtype=np.int64) for k in self.input_names}
        return dict(zip(self.output_names, self.session.run(list(self.output_names), feed)))


def check_dtype(dtype: str, kind: str, device: torch.device) -> None:
    """`--dtype` checked against the backend and device before a model is loaded."""
    if dtype not in DTYPES:
        raise UserError(f"--dtype {dtype}: choose one of {', '.join(DTYPES)}")
    if dtype != "fp32" and kind != "torch":
        raise UserError(f"--dtype {dtype}: an ONNX export holds float32 weights and runs in float32; --dtype is for "
                        "the torch backend (give the PyTorch model folder with --backend torch)")
    if dtype == "fp16" and device.type == "cpu":
        log.warning("--dtype fp16 on the CPU: CPUs have no fp16 matrix units, so this is several times slower "
                    "than fp32 (bf16 is what a CPU can run faster, where it has AMX or AVX-512 BF16)")


def open_backend(kind: str, model_dir: str | os.PathLike, task: str, device: str | torch.device = "cpu",
                 dtype: str = "fp32") -> TorchBackend | OnnxRuntimeBackend:
    """The backend `kind` ("torch" or "onnxruntime") for the model in `model_dir`, checked to give `task`'s
    outputs; `dtype` (torch only): fp32, bf16 or fp16."""
    model_dir = Path(model_dir)
    check_dtype(dtype, kind, parse_device(device))
    if kind == "torch":
        device = check_torch_device(device)  # before loading the model: a wrong --device fails at once
        backend: TorchBackend | OnnxRuntimeBackend = TorchBackend(load_torch_model(model_dir, task), device, dtype)
    elif kind == "onnxruntime":
        backend = OnnxRuntimeBackend(model_dir, device)
    else:
        raise UserError(f"unknown backend {kind!r}: choose one of {', '.join(BACKENDS)}")
    missing = [n for n in TASK_OUTPUTS[task] if n not in backend.output_names]
    if missing:
        raise UserError(f"{model_dir}: the {backend.name} model has outputs {', '.join(backend.output_names)}, "
                        f"not the {', '.join(missing)} a {task} prediction needs (export the {task} model)")
    return backend
