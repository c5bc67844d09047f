"""`bertrain export --format onnx`: a QA, classification/regression or encoder model as an ONNX graph, verified.

The folder written (or, with `--triton`, `OUT/NAME/1/`):

    model.onnx          inputs input_ids, token_type_ids, attention_mask: int64 (batch, sequence), both axes dynamic
                        (sequence up to max_position_embeddings); outputs as `bertrain.deploy.backends.TASK_OUTPUTS`
    onnx.json           opset, task, inputs/outputs, the verification's max abs difference, versions
    config.json, task.json (when the source has one), vocab.txt + tokenizer files: what `Predictor` reads, so
                        `bertrain predict --backend onnxruntime --model OUT` and `bertrain serve OUT` use it as is
    NAME/config.pbtxt   (--triton) the Triton model configuration, beside NAME/1/

Verification: the exported graph and the PyTorch model in its inference configuration (the path `bertrain predict
--backend torch` runs) score the same real text — the model's own tokenizer on sentences and sentence pairs of
different lengths in batches of different sizes, so padding and both dynamic axes are exercised — and the export
fails (nothing is written) if any output differs by more than `TOLERANCE` (fp32).
"""
from __future__ import annotations

import io
import logging
import os
import warnings
from contextlib import contextmanager, redirect_stdout
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
from torch import nn

from bertrain.deploy import require
from bertrain.deploy.backends import (INPUT_NAMES, ONNX_FILE, ONNX_META, OnnxRuntimeBackend, TorchBackend, output_names,
                                      task_of)
from bertrain.deploy.predict import TASK_FILE
from bertrain.model.hf import fit_model_max_length, hf_config_dict
from bertrain.tasks.common import load_task_tokenizer
from bertrain.utils.errors import UserError
from bertrain.utils.io import atomic_write_bytes, atomic_write_json, atomic_write_text

OPSET = 18
"""ONNX opset of the export: the torch exporter's default, run by every onnxruntime >= 1.14 and Triton >= 23.02."""
TOLERANCE = 1e-4
"""Largest absolute difference allowed between ONNX Runtime's and PyTorch's outputs (fp32)."""
SINGLE_FILE_LIMIT = 1_800_000_000
"""Weights above this many bytes go to model.onnx.data beside model.onnx (protobuf files stop at 2 GiB)."""

# Real text for the verification: sentences of very different lengths, and question/context pairs.
SENTENCES = [
    "Hello.",
    "The cat sat on the mat.",
    "Amrozi accused his brother, whom he called \"the witness\", of deliberately distorting his evidence.",
    "The Normans were the people who in the 10th and 11th centuries gave their name to Normandy, a region in "
    "France. They were descended from Norse raiders and pirates from Denmark, Iceland and Norway who, under "
    "their leader Rollo, agreed to swear fealty to King Charles III of West Francia.",
    "Yucaipa owned Dominick's before selling the chain to Safeway in 1998 for $2.5 billion.",
]
PAIRS = [
    ("Who led the Norse raiders?", SENTENCES[3]),
    ("What did Amrozi do?", SENTENCES[2]),
    ("He said the food was good.", "The food, he said, was good."),
]


class InferenceGraph(nn.Module):
    """What is exported: three int64 (B, T) inputs -> the task's outputs as a tuple, on the padded path.

    The unpadded and jagged fast paths do not export: they gather the real tokens with `nonzero` (a data-dependent
    number of rows, read back to the host to size the grid) and nested tensors, which torch.export cannot turn into
    one static graph. The padded path computes the same values at every real token (tests/test_fastpath.py); QA
    logits at padding positions are set to -10000, as the PyTorch inference path sets them."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.task = task_of(model)
        self.names = output_names(model)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor,
                attention_mask: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = self.model(input_ids, token_type_ids, attention_mask)
        res = [getattr(out, n) for n in self.names]
        if self.task == "qa":
            padding = attention_mask == 0                                  # (B, T)
            res = [t.masked_fill(padding, -10000.0) for t in res]
        return tuple(res)


@contextmanager
def padded_path(model: nn.Module) -> Iterator[None]:
    """Switch the model's encoder to the padded path for the block (see `InferenceGraph`)."""
    encoder = getattr(model, "bert", model)
    saved, encoder.unpad = encoder.unpad, False  # the one unpadding switch (jagged attention is for unpadded runs)
    try:
        yield
    finally:
        encoder.unpad = saved


def export_graph(model: nn.Module, path: Path, opset: int = OPSET) -> None:
    """`torch.onnx.export` (the torch.export-based exporter) of `InferenceGraph(model)` into `path`, batch and
    sequence axes dynamic."""
    require("onnx", "ONNX export")
    require("onnxscript", "ONNX export")  # the torch exporter translates to ONNX through it
    model = model.float().eval()
    graph = InferenceGraph(model)
    batch = torch.export.Dim("batch")
    sequence = torch.export.Dim("sequence", max=model.config.max_position_embeddings)
    # An example of 2 x 8 tokens: sizes 0 and 1 would be specialised by torch.export, so neither is used here.
    example = tuple(torch.ones(2, 8, dtype=torch.long) for _ in INPUT_NAMES)
    dynamic = {name: {0: batch, 1: sequence} for name in INPUT_NAMES}
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    quiet = io.StringIO()
    with padded_path(model), torch.no_grad(), warnings.catch_warnings(), redirect_stdout(quiet), _quiet_exporter():
        warnings.simplefilter("ignore")  # the exporter's deprecation and axis-naming notices: nothing to act on
        torch.onnx.export(graph, example, str(path), input_names=list(INPUT_NAMES), output_names=list(graph.names),
                          dynamic_shapes=dynamic, opset_version=opset, dynamo=True, verbose=False,
                          external_data=weights > SINGLE_FILE_LIMIT)


# The exporter's chatter, under the CLI's INFO logging: a warning per torchvision operator it cannot register when
# torchvision is absent, and a line per graph rewrite of onnxscript / onnx_ir (hundreds). Warnings and errors stay.
_CHATTY_LOGGERS = {"torch.onnx._internal.exporter._registration": logging.ERROR, "onnxscript": logging.WARNING,
                   "onnx_ir": logging.WARNING}


@contextmanager
def _quiet_exporter() -> Iterator[None]:
    loggers = {logging.getLogger(name): level for name, level in _CHATTY_LOGGERS.items()}
    saved = {logger: logger.level for logger in loggers}
    for logger, level in loggers.items():
        logger.setLevel(level)
    try:
        yield
    finally:
        for logger, level in saved.items():
            logger.setLevel(level)


# ----------------------------------------------------------------------------------------------- verification

def verification_batches(tok: Any, max_length: int | None = None) -> list[dict[str, np.ndarray]]:
    """Real inputs: `SENTENCES` and `PAIRS` tokenised by the model's tokenizer (a `TaskTokenizer`), padded to the
    longest of each batch, in batches of 1, 2, 3 and 5 rows (lengths from 3 to ~70 tokens with BERT's vocabulary,
    more with a small one), cut to `max_length` (the model's positions: a 64-position model failed its export on
    the longest pair)."""
    t = tok.tokenizer
    groups = [SENTENCES[:1], SENTENCES[1:3], PAIRS, SENTENCES, [SENTENCES[3]]]
    batches = []
    for group in groups:
        t.enable_padding(pad_id=tok.pad_id, pad_token="[PAD]")
        if max_length is not None:
            t.enable_truncation(max_length=max_length, strategy="longest_first")
        try:
            encs = t.encode_batch(group, add_special_tokens=True)
        finally:
            t.no_padding()
            t.no_truncation()
        batches.append({"input_ids": np.asarray([e.ids for e in encs], dtype=np.int64),
                        "token_type_ids": np.asarray([e.type_ids for e in encs], dtype=np.int64),
                        "attention_mask": np.asarray([e.attention_mask for e in encs], dtype=np.int64)})
    return batches


def max_difference(model: nn.Module, onnx_dir: Path, batches: list[dict[str, np.ndarray]]) -> float:
    """Largest |ONNX Runtime - PyTorch| over every output of every batch (PyTorch: the model as `predict` runs it).
    An encoder's hidden states are compared at real tokens only (nothing should read them at padding)."""
    torch_side, ort_side = TorchBackend(model), OnnxRuntimeBackend(onnx_dir)
    worst = 0.0
    for batch in batches:
        a, b = torch_side.run(batch), ort_side.run(batch)
        for name in torch_side.output_names:
            if a[name].shape != b[name].shape:
                raise UserError(f"ONNX export: output {name} has shape {b[name].shape} in ONNX Runtime but "
                                f"{a[name].shape} in PyTorch")
            diff = np.abs(a[name] - b[name])
            if name == "last_hidden_state":
                diff = diff[batch["attention_mask"].astype(bool)]
            worst = max(worst, float(diff.max()))
    return worst


# ----------------------------------------------------------------------------------------------- the folder

def triton_config(name: str, model: nn.Module, max_batch_size: int = 64) -> str:
    """config.pbtxt of a Triton model repository entry: the ONNX Runtime backend, the batch axis implicit
    (`max_batch_size`), the sequence axis -1, dynamic batching on."""
    dims = {"start_logits": "[ -1 ]", "end_logits": "[ -1 ]", "logits": f"[ {getattr(model, 'num_labels', 0)} ]",
            "last_hidden_state": f"[ -1, {model.config.hidden_size} ]",
            "pooler_output": f"[ {model.config.hidden_size} ]"}

    def tensor(n: str, dtype: str, shape: str) -> str:
        return f'  {{\n    name: "{n}"\n    data_type: {dtype}\n    dims: {shape}\n  }}'

    inputs = ",\n".join(tensor(n, "TYPE_INT64", "[ -1 ]") for n in INPUT_NAMES)
    outputs = ",\n".join(tensor(n, "TYPE_FP32", dims[n]) for n in output_names(model))
    return (f'name: "{name}"\nplatform: "onnxruntime_onnx"\nmax_batch_size: {max_batch_size}\n'
            f"input [\n{inputs}\n]\noutput [\n{outputs}\n]\ndynamic_batching {{ }}\n")


class OnnxFolder:
    """The ONNX export of `model` as something with `save_pretrained(path)`, so `commands.convert.write_model_folder`
    writes it with the same lock, atomic build and move-aside of an old folder as every other model folder.
    Export and verification run inside the temporary folder: a failed check leaves nothing behind. With
    `triton_name`, `path` is the model's folder in a Triton repository (REPOSITORY/NAME: config.pbtxt and 1/), the
    one the export owns: the repository's other models are not this export's to lock or replace."""

    def __init__(self, model: nn.Module, source: Path, opset: int = OPSET, triton_name: str | None = None,
                 tolerance: float = TOLERANCE, task_file: bytes | None = None) -> None:
        self.model, self.source, self.opset = model, source, opset
        self.triton_name, self.tolerance = triton_name, tolerance
        self.task_file = task_file
        """task.json's bytes (`bertrain export` finds them for a step-N or best/ folder too); None: the source's."""
        self.max_abs_diff: float | None = None

    def save_pretrained(self, path: str | os.PathLike) -> None:
        root = Path(path)
        folder = root / "1" if self.triton_name else root
        folder.mkdir(parents=True, exist_ok=True)
        for name, data in self.model.tokenizer_files.items():
            if name == "tokenizer_config.json":  # as the HF export: tokenizers truncate to the graph's positions
                data = fit_model_max_length(data, self.model.config.max_position_embeddings)
            atomic_write_bytes(folder / name, data)
        if "vocab.txt" not in self.model.tokenizer_files:
            raise UserError(f"{self.source} has no vocab.txt: an exported model needs its tokenizer (and the "
                            "verification tokenises real text with it)")
        atomic_write_json(folder / "config.json", hf_config_dict(self.model))
        task_file = self.task_file
        if task_file is None and (self.source / TASK_FILE).is_file():
            task_file = (self.source / TASK_FILE).read_bytes()
        if task_file is not None:
            atomic_write_bytes(folder / TASK_FILE, task_file)
        export_graph(self.model, folder / ONNX_FILE, self.opset)
        batches = verification_batches(load_task_tokenizer(folder), self.model.config.max_position_embeddings)
        try:
            self.max_abs_diff = max_difference(self.model, folder, batches)
        except Exception as e:  # onnxruntime's own exception classes (Fail, InvalidGraph, ...): not RuntimeErrors
            if not type(e).__module__.startswith("onnxruntime"):
                raise
            ort = require("onnxruntime", "ONNX export")
            said = " ".join(str(e).split())
            said = said if len(said) <= 240 else said[:240] + " ..."
            advice = (f"use the default --opset {OPSET}" if self.opset != OPSET else
                      "please report it with the model's config.json")
            raise UserError(f"ONNX export of {self.source}: ONNX Runtime {ort.__version__} cannot run the opset "
                            f"{self.opset} graph ({type(e).__name__}: {said}); nothing was written: {advice}") \
                from None
        meta = {"format": "onnx", "opset": self.opset, "task": task_of(self.model),
                "architecture": type(self.model).__name__,
                "inputs": {n: {"dtype": "int64", "shape": ["batch", "sequence"]} for n in INPUT_NAMES},
                "outputs": list(output_names(self.model)),
                "max_sequence_length": self.model.config.max_position_embeddings,
                "verification": {"max_abs_diff": self.max_abs_diff, "tolerance": self.tolerance,
                                 "batches": [list(b["input_ids"].shape) for b in batches], "dtype": "float32"},
                "source": str(self.source), "torch": torch.__version__,
                "onnx": require("onnx", "ONNX export").__version__,
                "onnxruntime": require("onnxruntime", "ONNX export").__version__}
        atomic_write_json(folder / ONNX_META, meta)
        if not self.max_abs_diff <= self.tolerance:  # also refuses NaN
            raise UserError(f"ONNX export of {self.source} does not match PyTorch: max abs difference of the "
                            f"outputs on real inputs {self.max_abs_diff:.3g} > {self.tolerance:g} (fp32); nothing "
                            "was written (please report it with the model's config.json)")
        if self.triton_name:
            atomic_write_text(root / "config.pbtxt", triton_config(self.triton_name, self.model))
