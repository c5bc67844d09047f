"""Batched inference with a fine-tuned model: extractive QA and sentence(-pair) classification.

    >>> p = Predictor("runs/squad/final")
    >>> p.predict_qa([{"question": "Who?", "context": "Ann wrote it."}])
    [{'id': '0', 'answer': 'Ann', 'score': 0.93, 'start': 0, 'end': 3, ...}]

The model folder is what `bertrain finetune` exports (`OUTPUT/final`, HF format) or any HF folder with a QA or
classification head. `task.json`, written beside the weights by the fine-tuning run, supplies the label names and
the feature settings (a run's step-N checkpoint has none: its run's, `run_task_file`, as `bertrain export` writes
them); without it, the head in config.json decides the task (a warning says the settings are the defaults), and the
labels are config.json's id2label names (a model fine-tuned with transformers) or, where it has only LABEL_0,
LABEL_1, ..., the indices.

The forward pass is a backend (`bertrain.deploy.backends`): PyTorch on the model folder, or ONNX Runtime on the folder
`bertrain export --format onnx` writes (`Predictor(onnx_dir, backend="onnxruntime")`). Tokenisation, batching and
post-processing are this module's (on top of `bertrain.tasks.squad`'s features and span decoding), one code path
for every backend.

This is deployment, above the tasks: it imports `bertrain.tasks` and `bertrain.model`; nothing under them imports
`bertrain.deploy` (tests/test_imports.py).
"""
from __future__ import annotations

import json
import logging
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, TextIO

import numpy as np
import torch

from bertrain.deploy.backends import INPUT_NAMES, TASK_OUTPUTS, open_backend, parse_device
from bertrain.model.bert import (BertForPreTraining, BertForQuestionAnswering, BertForSequenceClassification,
                                 BertModel)
from bertrain.model.hf import model_class_for
from bertrain.tasks.common import load_task_tokenizer
from bertrain.tasks.glue import TASKS as GLUE_TASKS
from bertrain.tasks.squad import (SquadExample, SquadFeatureConfig, SquadPostprocessConfig, build_features,
                                  load_dataset_json, postprocess_predictions, refuse_lone_surrogates)
from bertrain.utils.errors import UserError

log = logging.getLogger(__name__)

TASK_FILE = "task.json"
QA_DECODING = {"n_best_size": 20, "max_answer_length": 30, "null_score_diff_threshold": 0.0}
"""SQuAD answer decoding: the defaults of fine-tuning's data config; task.json may say what its run used."""


@dataclass
class Throughput:
    examples: int = 0
    seconds: float = 0.0
    truncated: int = 0
    """Classification inputs longer than max_seq_length: the model read only their first tokens (as in training)."""

    @property
    def per_second(self) -> float:
        return self.examples / self.seconds if self.seconds > 0 else 0.0


class Predictor:
    """A loaded model plus its tokenizer, for batched QA or classification predictions."""

    def __init__(self, model_dir: str | os.PathLike, task: str | None = None, device: str | torch.device = "cpu",
                 batch_size: int = 32, max_seq_length: int | None = None, backend: str = "torch",
                 dtype: str = "fp32") -> None:
        self.model_dir = Path(model_dir)
        if not (self.model_dir / "config.json").is_file():
            raise ValueError(f"model folder {self.model_dir} has no config.json")
        cls = model_class_for(self.model_dir)
        meta, self.task_source = task_settings(self.model_dir, cls.__name__)
        """`task_source`: the task.json (or a step-N's run's config.yaml) the settings came from; None: defaults."""
        if task is None:
            task = meta.get("kind") or ("qa" if cls is BertForQuestionAnswering
                                        else "classification" if cls is BertForSequenceClassification else None)
        if task == "regression":  # a one-output classification head (STS-B): predict_classification scores it
            task = "classification"
        if task not in ("qa", "classification"):
            raise ValueError(_no_task(self.model_dir, cls.__name__, task))
        _say_settings(self.model_dir, self.task_source, task)
        self.task = task
        self.meta = meta
        self.device = parse_device(device)
        # The forward pass only: tokenisation above it and post-processing below it are this class's, the same
        # for every backend.
        self.backend = open_backend(backend, self.model_dir, task, self.device, dtype)
        self.tok = load_task_tokenizer(self.model_dir)
        self.batch_size = batch_size
        self.max_seq_length = _checked_length(self.model_dir, max_seq_length, meta, task, self.task_source)
        self.labels: list[str] | None = meta.get("labels") or _named_labels(self.model_dir)
        self.version_2_with_negative = bool(meta.get("version_2_with_negative", False))
        self.pair: bool | None = _pair_task(meta.get("task")) if task == "classification" else None
        """True: the GLUE task task.json names reads sentence pairs (MRPC, RTE, ...); False: one sentence (SST-2,
        CoLA); None: unknown (no task.json, or not a GLUE task): any input. Items that do not fit it are refused:
        by `read_items` naming the file and line, here (the API, `serve`: a 422) naming the item."""
        self.throughput = Throughput()
        if task == "qa":
            self._squad_features = _squad_feature_config(self.max_seq_length, meta, max_seq_length is not None)

    # ------------------------------------------------------------------------------------------- forward

    def _forward(self, feats: dict[str, np.ndarray], names: tuple[str, ...]) -> list[np.ndarray]:
        """The backend's outputs `names` for every feature row, batch by batch, each batch trimmed to its longest
        row; per-token outputs are padded back to the features' length with -10000 (never a best span)."""
        outs: list[list[np.ndarray]] = []
        L = feats["input_ids"].shape[1]
        for s in range(0, len(feats["input_ids"]), self.batch_size):
            sl = slice(s, s + self.batch_size)
            length = int(feats["attention_mask"][sl].sum(axis=1).max())  # trim padding columns
            out = self.backend.run({k: feats[k][sl, :length] for k in INPUT_NAMES})
            res = []
            for name in names:
                a = out[name]
                # QA's (B, T) logits only: a classifier's (B, num_labels) logits for a batch trimmed to as many
                # tokens (a text of characters the tokenizer drops alone in the last batch: [CLS] [SEP], 2 tokens)
                # were widened too, and joining them to the other batches failed
                if self.task == "qa" and a.ndim == 2 and a.shape[1] == length and length < L:
                    a = np.concatenate([a, np.full((a.shape[0], L - length), -10000.0, np.float32)], axis=1)
                res.append(a)
            outs.append(res)
        return [np.concatenate([o[j] for o in outs]) for j in range(len(outs[0]))]

    # ------------------------------------------------------------------------------------------- QA

    def predict_qa(self, items: list[dict[str, Any]], n_best_size: int | None = None,
                   max_answer_length: int | None = None,
                   null_score_diff_threshold: float | None = None) -> list[dict[str, Any]]:
        """Answer each {"question", "context"[, "id"]}: answer text, probability among the n-best, character span.

        For a SQuAD v2.0 model the answer is "" when the null score wins (`null_score_diff` says by how much).
        The decoding settings not given are task.json's (those the run evaluated with), else 20, 30 and 0.0.
        """
        if self.task != "qa":
            raise ValueError(f"{self.model_dir} is a {self.task} model, not a QA model")
        if not items:
            return []
        examples = []
        for i, it in enumerate(items):
            q, c = it.get("question"), it.get("context")
            if not isinstance(q, str) or not q.strip():
                raise ValueError(f"item {it.get('id', i)}: empty or missing 'question'")
            if not isinstance(c, str) or not c.strip():
                raise ValueError(f"item {it.get('id', i)}: empty or missing 'context'")
            # Keyed by position: the post-processing gathers each example's windows by this key, and two items
            # may carry the same user id (their answers would be mixed). The user's id goes back on the output.
            examples.append(SquadExample(str(i), q, c, []))
        t0 = time.perf_counter()
        fcfg = self._squad_features
        try:
            feats = build_features(examples, self.tok, fcfg, is_training=False)
        except ValueError as e:  # "question id K: ...": K is the position in this call, not the user's id
            m = re.fullmatch(r"question id (\d+): (.*)", str(e), flags=re.S)
            if m is None:
                raise
            k = int(m[1])
            raise ValueError(f"item {items[k].get('id', k)}: {m[2]} (it holds only characters the tokenizer "
                             "drops: control, zero-width or unassigned ones)") from None
        start, end = self._forward(feats, TASK_OUTPUTS["qa"])
        given = {"n_best_size": n_best_size, "max_answer_length": max_answer_length,
                 "null_score_diff_threshold": null_score_diff_threshold}
        pcfg = SquadPostprocessConfig(**{k: v if v is not None else self.meta.get(k, QA_DECODING[k])
                                         for k, v in given.items()})
        preds, nbest, null_odds = postprocess_predictions(examples, feats, start, end, pcfg,
                                                          self.version_2_with_negative)
        self._count(len(items), time.perf_counter() - t0)
        out = []
        for i, ex in enumerate(examples):
            answer = preds[ex.qid]
            best = next((p for p in nbest[ex.qid] if p["text"] == answer), nbest[ex.qid][0])
            rec = {"id": str(items[i].get("id", i)), "answer": answer, "score": best["probability"],
                   "start": best.get("char_start"), "end": best.get("char_end")}
            if self.version_2_with_negative:
                rec["null_score_diff"] = null_odds[ex.qid]
            out.append(rec)
        return out

    # ------------------------------------------------------------------------------------------- classification

    def predict_classification(self, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Classify each {"text"[, "text_pair"]}: label (name from task.json, else the index) and its probability;
        for a regression head (STS-B) the score itself."""
        if self.task != "classification":
            raise ValueError(f"{self.model_dir} is a {self.task} model, not a classification model")
        if not items:
            return []
        inputs = []
        for i, it in enumerate(items):
            a = it.get("text", it.get("sentence", it.get("sentence1")))
            b = it.get("text_pair", it.get("sentence2"))
            if not isinstance(a, str) or not a.strip():
                raise ValueError(f"item {it.get('id', i)}: empty or missing 'text'")
            if b is not None and (not isinstance(b, str) or not b.strip()):
                raise ValueError(f"item {it.get('id', i)}: 'text_pair' is empty")
            if self.pair is not None and (b is not None) != self.pair:  # an answer whose numbers mean nothing
                raise ValueError(f"item {it.get('id', i)}: {pair_mismatch(self.meta.get('task'), self.pair, tsv=False)}")
            inputs.append((a, b) if b is not None else a)
        t0 = time.perf_counter()
        t = self.tok.tokenizer
        t.enable_truncation(max_length=self.max_seq_length, strategy="longest_first")
        t.enable_padding(pad_id=self.tok.pad_id, pad_token="[PAD]")  # pad to the longest of the call
        try:
            encs = t.encode_batch(inputs, add_special_tokens=True)
        finally:
            t.no_truncation()
            t.no_padding()
        self.throughput.truncated += sum(1 for e in encs if e.overflowing)  # said, not silent (a long document)
        feats = {"input_ids": np.asarray([e.ids for e in encs], dtype=np.int64),
                 "token_type_ids": np.asarray([e.type_ids for e in encs], dtype=np.int64),
                 "attention_mask": np.asarray([e.attention_mask for e in encs], dtype=np.int64)}
        (logits,) = self._forward(feats, TASK_OUTPUTS["classification"])
        self._count(len(items), time.perf_counter() - t0)
        out = []
        for i, row in enumerate(logits):
            rec: dict[str, Any] = {"id": str(items[i].get("id", i))}
            if row.shape[0] == 1:  # regression head
                rec.update(label=None, score=float(row[0]))
            else:
                p = np.exp(row - row.max())
                p /= p.sum()
                k = int(p.argmax())
                names = self.labels if self.labels and len(self.labels) == len(p) else \
                    [str(j) for j in range(len(p))]
                rec.update(label=names[k], score=float(p[k]),
                           probabilities={names[j]: float(p[j]) for j in range(len(p))})
            out.append(rec)
        return out

    def predict(self, items: list[dict[str, Any]], **kwargs: Any) -> list[dict[str, Any]]:
        return self.predict_qa(items, **kwargs) if self.task == "qa" else self.predict_classification(items)

    def _count(self, n: int, seconds: float) -> None:
        self.throughput.examples += n
        self.throughput.seconds += seconds


def read_task_file(path: Path, text: bytes | None = None) -> dict[str, Any]:
    """task.json, checked: a damaged one was a bare JSON message or an int() error naming neither the file nor the
    key, and one that is not an object a traceback. `text`: its bytes, already read (`run_task_file`'s), `path`
    naming where they came from."""
    fix = "fix it, or remove it (the head in config.json then decides the task, with the default lengths)"
    try:
        meta = json.loads(path.read_bytes() if text is None else text)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{path}: not valid JSON ({e}): {fix}") from None
    if not isinstance(meta, dict):
        raise UserError(f"{path}: expected a JSON object, got {type(meta).__name__}: {fix}")
    for key in ("max_seq_length", "doc_stride", "max_query_length", "n_best_size", "max_answer_length"):
        value = meta.get(key)
        if key in meta and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise UserError(f"{path}: '{key}' must be a positive integer, got {value!r}: {fix}")
    threshold = meta.get("null_score_diff_threshold")
    if "null_score_diff_threshold" in meta and (isinstance(threshold, bool) or not isinstance(threshold, (int, float))):
        raise UserError(f"{path}: 'null_score_diff_threshold' must be a number, got {threshold!r}: {fix}")
    if meta.get("kind") is not None and meta["kind"] not in ("qa", "classification", "regression"):
        raise UserError(f"{path}: 'kind' is {meta['kind']!r}, not qa, classification or regression: {fix}")
    labels = meta.get("labels")
    if labels is not None and (not isinstance(labels, list) or not all(isinstance(x, str) for x in labels)):
        raise UserError(f"{path}: 'labels' must be a list of label names (strings), got {labels!r}: {fix}")
    return meta


RUN_CONFIG = "config.yaml"  # a run folder's settings (`bertrain finetune` writes it beside final/ and step-N/)
DECODING_KEYS = tuple(QA_DECODING)


def run_task_file(folder: Path, architecture: str | None) -> tuple[bytes, Path] | None:
    """THE rule for the task.json of a model folder, and where it came from (for `bertrain export`, which writes it
    into the exported folder, and `Predictor`, which reads it): the folder's own (a run's final/ and best/); for a
    step-N folder of a fine-tuning run (none of its own), its run's final/task.json when final/ holds the same
    `architecture` (config.json's class name), else the one the run's config.yaml implies (what `bertrain finetune`
    writes into final/); None outside a fine-tuning run. Without it, predict and serve decoded a step-N folder
    otherwise than its run evaluated it (384/128-token windows, a SQuAD v2.0 model never answering "no answer").
    A QA task.json of an older run gets the answer decoding its run evaluated with (data.n_best_size,
    max_answer_length, null_score_diff_threshold), which `bertrain finetune` did not write into it then."""
    run = folder.parent
    data = _run_data(run / RUN_CONFIG)
    decoding = {k: data[k] for k in DECODING_KEYS if k in data} if data else {}
    own = folder / TASK_FILE
    if not own.is_file() and data is not None and (run / "final" / TASK_FILE).is_file() \
            and _architectures(run / "final") == [architecture]:
        own = run / "final" / TASK_FILE  # the same run's final model: the same task, being the same kind of model
    if own.is_file():
        return _with_decoding(own.read_bytes(), decoding), own
    task = _implied_task(data, architecture) if data else None
    return None if task is None else ((json.dumps(task, indent=2) + "\n").encode(), run / RUN_CONFIG)


def _run_data(config: Path) -> dict[str, Any] | None:
    """The `data` section of a run's config.yaml ({} when it has none); None when there is no readable one."""
    import yaml

    if not config.is_file():
        return None
    try:
        data = (yaml.safe_load(config.read_text(encoding="utf-8")) or {}).get("data") or {}
    except (OSError, UnicodeDecodeError, yaml.YAMLError, AttributeError):
        return None
    return data if isinstance(data, dict) else {}


def _architectures(model_dir: Path) -> Any:
    try:
        return json.loads((model_dir / "config.json").read_text(encoding="utf-8")).get("architectures")
    except (OSError, ValueError, AttributeError):
        return None


def _with_decoding(text: bytes, decoding: dict[str, Any]) -> bytes:
    """A QA task.json's bytes with the run's answer decoding added where it does not say it (an older run's)."""
    try:
        task = json.loads(text)
    except ValueError:
        return text  # as it is: read_task_file names what is wrong with it
    if not isinstance(task, dict) or task.get("kind") != "qa" or all(k in task for k in decoding):
        return text
    return (json.dumps({**task, **{k: v for k, v in decoding.items() if k not in task}}, indent=2) + "\n").encode()


def _implied_task(data: dict[str, Any], architecture: str | None) -> dict[str, Any] | None:
    """The task.json `bertrain finetune` writes into final/, from its config.yaml's data section."""
    if architecture == BertForQuestionAnswering.__name__ and data.get("train_file"):
        return {"kind": "qa", "task": "squad", "version_2_with_negative": bool(data.get("version_2_with_negative")),
                **{k: data[k] for k in ("max_seq_length", "doc_stride", "max_query_length") if k in data},
                **{k: data[k] for k in DECODING_KEYS if k in data}}
    glue = GLUE_TASKS.get(data.get("task")) if isinstance(data.get("task"), str) else None
    if architecture == BertForSequenceClassification.__name__ and glue is not None:
        return {"kind": "regression" if glue.is_regression else "classification", "task": glue.name,
                "labels": list(glue.labels) if glue.labels else None,
                **({"max_seq_length": data["max_seq_length"]} if "max_seq_length" in data else {})}
    return None


def task_settings(model_dir: Path, architecture: str) -> tuple[dict[str, Any], Path | None]:
    """The checked task.json settings of `model_dir` (`run_task_file`: its own, or for a step-N folder its run's)
    and the file they came from; ({}, None) where neither the folder nor its run says."""
    found = run_task_file(model_dir, architecture)
    if found is None:
        return {}, None
    text, source = found
    return read_task_file(source, text), source


def _say_settings(model_dir: Path, source: Path | None, task: str) -> None:
    """One line where the settings do not come from the folder's own task.json: the same model decodes otherwise
    with other settings (a step-N folder of a SQuAD v2.0 run never answered "no answer"), and that was silent."""
    if source is None:
        defaults = ("384-token windows, stride 128, SQuAD v1.1 answers (never 'no answer')" if task == "qa"
                    else "128 tokens, config.json's label names, any sentence or pair")
        log.warning("%s has no %s, nor does a fine-tuning run around it: decoding with the default settings (%s), "
                    "which may not be those the model was trained and evaluated with",
                    model_dir, TASK_FILE, defaults)
    elif source.parent != model_dir:
        log.info("%s has no %s: using its run's settings from %s", model_dir, TASK_FILE, source)


def _no_task(model_dir: Path, architecture: str, task: str | None) -> str:
    """Why there is no task to predict, for a command-line user (whose flag is --task) as for the API."""
    if task is not None:
        return f"task {task!r}: use qa or classification (--task; Python: task=...)"
    if architecture in (BertModel.__name__, BertForPreTraining.__name__):
        return (f"{model_dir} holds a {architecture} without a QA or classification head: fine-tune it first "
                "(bertrain finetune squad|glue ... writes OUTPUT/final, a folder to predict with)")
    return (f"{model_dir}: cannot tell the task from config.json ({architecture}): pass --task qa|classification "
            "(Python: task=...)")


def _pair_task(name: Any) -> bool | None:
    """Whether the GLUE task `name` (task.json's "task") classifies sentence pairs; None for any other name. A pair
    model given one sentence (or the reverse) answers, but with numbers that mean nothing: it is refused."""
    task = GLUE_TASKS.get(name) if isinstance(name, str) else None
    return None if task is None else task.dev.text_b is not None


def pair_mismatch(name: Any, pair: bool, flags: bool = False, tsv: bool = True) -> str:
    """What to do when an item's text_pair does not fit the model's task (`Predictor.pair`); `flags`: said in
    terms of --text / --text-pair; `tsv`: mention the TSV layout (input files)."""
    text, second = ("--text", "--text-pair") if flags else ("'text'", "'text_pair'")
    if pair:
        return (f"the model was fine-tuned on {name}, a sentence-pair task: give {text} and {second}"
                + ("" if flags or not tsv else " (TSV: text<TAB>text_pair)"))
    return f"the model was fine-tuned on {name}, a single-sentence task: give {text} alone, without {second}"


def _squad_feature_config(length: int, meta: dict[str, Any], requested: bool) -> SquadFeatureConfig:
    """The QA windows: `length` tokens, task.json's stride and question length (without task.json, Google's 128
    and 64 question tokens, or half the window where the model's positions cap it). Built when the model is
    loaded: a --max-seq-length that leaves no room for the context failed at the first input (the server blamed
    every request on its client, 422)."""
    query = int(meta.get("max_query_length", min(64, length // 2)))
    try:
        return SquadFeatureConfig(length, int(meta.get("doc_stride", 128)), query)
    except ValueError:
        if not requested or query + 3 < length:
            raise
        given = "max_query_length in task.json" if "max_query_length" in meta else "half the window"
        least = query + 4 if "max_query_length" in meta else 7
        raise UserError(f"--max-seq-length {length} leaves no room for the context after the question (up to "
                        f"{query} tokens: {given}) and 3 special tokens: use --max-seq-length {least} or more") \
            from None


def _named_labels(model_dir: Path) -> list[str] | None:
    """The label names config.json's id2label gives (a model fine-tuned with transformers, e.g. NEGATIVE/POSITIVE),
    None where it has none or only transformers' placeholders LABEL_0, LABEL_1, ... (then the indices are shown)."""
    try:
        id2label = json.loads((model_dir / "config.json").read_text(encoding="utf-8")).get("id2label")
        names = [str(id2label[k]) for k in sorted(id2label, key=int)] if isinstance(id2label, dict) else []
    except (OSError, ValueError, TypeError, AttributeError):
        return None
    if not names or names == [f"LABEL_{i}" for i in range(len(names))] or len(set(names)) != len(names):
        return None
    return names


def _checked_length(model_dir: Path, requested: int | None, meta: dict[str, Any], task: str,
                    source: Path | None = None) -> int:
    """Tokens per input: `requested` (--max-seq-length), else task.json's, else 384 (QA) / 128, never more than the
    model's positions. Checked here because the model only fails on the first input that is that long (a batch
    of a stream, or a request that the server then blames on its client); the default without task.json is
    capped to the positions (a 128-position model answers long contexts in 128-token windows), and so is a
    task.json value written by a fine-tuning run that never met an input that long."""
    positions = None
    try:
        positions = int(json.loads((model_dir / "config.json").read_text(encoding="utf-8"))["max_position_embeddings"])
    except (OSError, ValueError, KeyError, TypeError):
        pass  # the backend reads config.json itself and says what is wrong with it
    if requested is not None and requested < 1:
        raise UserError(f"--max-seq-length must be >= 1, got {requested}")
    if requested is None and "max_seq_length" not in meta:
        default = 384 if task == "qa" else 128
        return min(default, positions) if positions else default
    if requested is None:
        length = int(meta["max_seq_length"])
        if positions is not None and length > positions:  # a run that never met a long enough input wrote it
            log.warning("max_seq_length in %s is %d, more than the %d positions of the model: using %d",
                        source or model_dir / TASK_FILE, length, positions, positions)
            return positions
        return length
    if positions is not None and requested > positions:
        raise UserError(f"--max-seq-length is {requested}, more than the {positions} positions of the model in "
                        f"{model_dir} (max_position_embeddings in config.json): use --max-seq-length {positions} "
                        "or less")
    return requested


# ----------------------------------------------------------------------------------------------- input files

def read_squad_items(path: str) -> list[dict[str, Any]]:
    """The questions of a SQuAD-format file (v1.1 / v2.0 JSON, or the Hub's layouts; answers optional, as in a hidden
    test set) as QA items with their question ids, in file order: what Google's run_squad --do_predict reads, for
    the official predictions.json. A question without text, a paragraph without a context or an id given twice (its
    answers would overwrite each other) is a `ValueError` naming the file and the question."""
    data = load_dataset_json(path, scoring=False)
    items: list[dict[str, Any]] = []
    seen: set[str] = set()
    for ai, article in enumerate(data["data"]):
        for pi, para in enumerate(article["paragraphs"]):
            context = para.get("context")
            if not isinstance(context, str) or not context.strip():
                raise ValueError(f"{path}: article {ai} paragraph {pi}: no 'context' text")
            refuse_lone_surrogates(context, f"{path}: article {ai} paragraph {pi}: 'context'")
            for qa in para["qas"]:
                question = qa.get("question")
                if not isinstance(question, str) or not question.strip():
                    raise ValueError(f"{path}: question id {qa['id']}: no 'question' text")
                refuse_lone_surrogates(question, f"{path}: question id {qa['id']}: 'question'")
                if qa["id"] in seen:
                    raise ValueError(f"{path}: question id {qa['id']} appears twice: its answers would overwrite each "
                                     "other in predictions.json")
                seen.add(qa["id"])
                items.append({"id": qa["id"], "question": question, "context": context})
    return items


def read_items(f: TextIO, name: str, fmt: str, task: str, pair: bool | None = None,
               task_name: str | None = None) -> Iterator[dict[str, Any]]:
    """Items from JSONL (one object per line) or TSV (QA: question<TAB>context; classification:
    text[<TAB>text_pair]); blank lines are skipped; bad lines raise `ValueError` naming the file and line.
    `pair` (`Predictor.pair`): True/False, a classification item must / must not have a text_pair (`task_name`
    names the task in the error).

    An item without an "id" gets its position among the items, from 0 ("0", "1", ... in input order, as the
    reference scripts number examples); a JSON "id" is kept (as a string)."""
    if fmt not in ("jsonl", "tsv"):
        raise ValueError(f"unknown input format {fmt!r} (jsonl or tsv)")
    index = 0
    for lineno, line in _lines(f, name):
        line = line.rstrip("\n").rstrip("\r")
        if lineno == 1:
            line = line.lstrip("\ufeff")
        if not line.strip():
            continue
        where = f"{name}:{lineno}"
        if fmt == "jsonl":
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: malformed JSON: {e.msg}") from None
            if not isinstance(obj, dict):
                raise ValueError(f"{where}: expected a JSON object")
        else:
            cols = line.split("\t")
            if task == "qa":
                if len(cols) != 2:
                    raise ValueError(f"{where}: expected question<TAB>context, got {len(cols)} fields")
                obj = {"question": cols[0], "context": cols[1]}
            else:
                if len(cols) not in (1, 2):
                    raise ValueError(f"{where}: expected text[<TAB>text_pair], got {len(cols)} fields")
                obj = {"text": cols[0]} if len(cols) == 1 else {"text": cols[0], "text_pair": cols[1]}
        if task == "qa":
            fields = {"question": obj.get("question"), "context": obj.get("context")}
            if not all(isinstance(v, str) for v in fields.values()):
                raise ValueError(f"{where}: a QA item needs string 'question' and 'context'")
        else:
            text_key = next((k for k in ("text", "sentence", "sentence1") if k in obj), "text")
            pair_key = next((k for k in ("text_pair", "sentence2") if obj.get(k) is not None), None)
            fields = {text_key: obj.get(text_key), **({pair_key: obj[pair_key]} if pair_key else {})}
            if not isinstance(fields[text_key], str):
                raise ValueError(f"{where}: a classification item needs a string 'text'")
            if pair_key and not isinstance(fields[pair_key], str):
                raise ValueError(f"{where}: '{pair_key}' must be a string")
            if pair is not None and (pair_key is not None) != pair:
                raise ValueError(f"{where}: {pair_mismatch(task_name, pair)}")
        for key, value in fields.items():
            if not value.strip():
                raise ValueError(f"{where}: '{key}' is empty")
            refuse_lone_surrogates(value, f"{where}: '{key}'")
        obj["id"] = str(obj["id"]) if obj.get("id") is not None else str(index)
        index += 1
        yield obj


_UNDECODABLE = re.compile("[\udc80-\udcff]")  # bytes that were not UTF-8, under errors="surrogateescape"


def _lines(f: TextIO, name: str) -> Iterator[tuple[int, str]]:
    """(line number, line) from 1; text that is not UTF-8 is refused naming the file and line (exactly when `f`
    was opened with errors="surrogateescape", as `bertrain predict` does; else the line the decoder reached)."""
    lineno = 0
    it = iter(f)
    while True:
        try:
            line = next(it)
        except StopIteration:
            return
        except UnicodeDecodeError as e:
            raise ValueError(f"{name}: not UTF-8 text after line {lineno} ({e.reason}, byte 0x{e.object[e.start]:02x}): "
                             "convert it to UTF-8 (e.g. iconv -f latin1 -t utf-8)") from None
        lineno += 1
        bad = _UNDECODABLE.search(line)
        if bad:
            raise ValueError(f"{name}:{lineno}: not UTF-8 text (byte 0x{ord(bad.group()) - 0xdc00:02x} at column "
                             f"{bad.start() + 1}): convert the file to UTF-8 (e.g. iconv -f latin1 -t utf-8)")
        yield lineno, line


def batched(it: Iterable[dict[str, Any]], n: int) -> Iterator[list[dict[str, Any]]]:
    chunk: list[dict[str, Any]] = []
    for x in it:
        chunk.append(x)
        if len(chunk) == n:
            yield chunk
            chunk = []
    if chunk:
        yield chunk
