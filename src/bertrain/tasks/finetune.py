"""Fine-tuning on SQuAD and GLUE as tasks of the training engine, then evaluation with the official metrics.

A fine-tuning task is a `FeatureTask`: the model to fine-tune (`init`, with a new head), its features as arrays
(loaded by `ArrayLoader` on the shared rank partition, each epoch padded by wrapping to a multiple of the global
batch so no example is dropped) and its loss sums. Batch plan, precision, optimizer, schedule, checkpoints and
resume are `bertrain.train.trainer.Trainer`'s, exactly as in pretraining. Evaluation is `tasks/evaluate.py`.
"""
from __future__ import annotations

import contextlib
import functools
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch
from torch import nn

from bertrain.config import save_config
from bertrain.data.sampler import ArrayLoader
from bertrain.model.bert import BertForQuestionAnswering, BertForSequenceClassification
from bertrain.model.hf import model_dir_or_name
from bertrain.model.losses import classification_loss_sums, qa_loss_sums
from bertrain.model.options import apply_model_options
from bertrain.tasks.common import load_task_tokenizer
from bertrain.tasks.evaluate import distributed_forward
from bertrain.tasks.glue import (DIAGNOSTIC_SUBMISSION, build_features as glue_features, get_task, has_split,
                                 model_label_ids, read_diagnostic, read_split, write_dev_predictions,
                                 write_submission)
from bertrain.tasks.metrics import PRIMARY_METRIC, evaluate_squad, glue_compute_metrics, glue_metric_names
from bertrain.tasks.squad import (SquadFeatureConfig, SquadPostprocessConfig, at_best_f1_threshold,
                                  load_dataset_json, load_or_build_features, postprocess_predictions, read_squad,
                                  write_prediction_files)
from bertrain.train import checkpoint as ckpt
from bertrain.train.config import (BatchPlan, CheckpointConfig, EvalConfig, OptimConfig, ScheduleConfig, TrainConfig,
                                   TrainerConfig)
from bertrain.train.distributed import DistInfo, distributed_context, on_rank0, same_paths_on_every_rank
from bertrain.train.precision import Precision
from bertrain.train.resume import checkpoint_for_gone_init, run_folder
from bertrain.train.evaluation import OnEval
from bertrain.train.trainer import NO_STEP_LIMIT, RunResult, Trainer
from bertrain.utils.errors import RunStopped
from bertrain.utils.io import atomic_write_json

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------------------- configs

def _train_default() -> TrainConfig:
    return TrainConfig(epochs=2.0, micro_batch_size=32)


def _optim_default() -> OptimConfig:
    # BERT's fine-tuning recipe: AdamW, lr 3e-5 (2e-5..5e-5), weight decay 0.01, eps 1e-6.
    return OptimConfig(name="adamw", lr=3e-5, weight_decay=0.01, eps=1e-6, max_grad_norm=1.0)


def _schedule_default() -> ScheduleConfig:
    return ScheduleConfig(name="linear", warmup=0.1)


def _checkpoint_default() -> CheckpointConfig:
    return CheckpointConfig(save_interval=0, keep_last=1, export_final=True)


def _eval_default() -> EvalConfig:
    # as HF Trainer's eval_strategy="epoch" + load_best_model_at_end: a dev evaluation each epoch, end on the best
    return EvalConfig(each_epoch=True, final="best")


@dataclass
class FinetuneConfig(TrainerConfig):
    """The engine's sections with fine-tuning defaults, plus the model to start from and evaluation."""

    init: str = ""
    """The model to fine-tune: an HF-format or bertrain model/checkpoint folder (weights + vocab.txt), a Google TF or
    NVIDIA checkpoint folder, or a Hub model id in the local Hugging Face cache."""
    do_train: bool = True
    """Fine-tune (false: only evaluate the --init model)."""
    do_eval: bool = True
    """Evaluate on the dev set after training and write eval_results.json."""
    eval_batch_size: int = 64
    """Examples per forward pass at evaluation / prediction, per rank."""
    train: TrainConfig = field(default_factory=_train_default)
    """Epochs or steps, batch sizes, logging."""
    optim: OptimConfig = field(default_factory=_optim_default)
    """Optimizer (adamw | radam | lamb | nvlamb)."""
    schedule: ScheduleConfig = field(default_factory=_schedule_default)
    """Learning-rate schedule."""
    checkpoint: CheckpointConfig = field(default_factory=_checkpoint_default)
    """Checkpoint folders (save_interval 0: one at the end, for --resume and inspection) and the final export."""
    eval: EvalConfig = field(default_factory=_eval_default)
    """Dev evaluation while training (each epoch by default), the selection metric, the best model (the final one
    by default), early stopping."""
    seed: int = 42
    """Seed of the head initialisation, data order and dropout."""

    def __post_init__(self) -> None:
        if not self.init:
            raise ValueError("config key 'init' must name a model folder (--init)")
        if not self.output_dir:
            raise ValueError("config key 'output_dir' must not be empty (--output)")
        super().__post_init__()
        if self.eval_batch_size < 1:
            raise ValueError(f"config key 'eval_batch_size' must be >= 1, got {self.eval_batch_size}")


@dataclass
class SquadDataConfig:
    train_file: Optional[str] = None
    """SQuAD JSON to fine-tune on."""
    dev_file: Optional[str] = None
    """SQuAD JSON to evaluate on (official metrics)."""
    train_articles: str = ""
    """Use only these articles of train_file, as a Python slice 'start:stop' (e.g. '0:18'); empty = all."""
    dev_articles: str = ""
    """Use only these articles of dev_file, as 'start:stop' (e.g. '18:'); empty = all."""
    version_2_with_negative: bool = False
    """SQuAD v2.0: questions may be unanswerable (null answer = [CLS])."""
    max_seq_length: int = 384
    """Tokens per window."""
    doc_stride: int = 128
    """Tokens between the starts of consecutive context windows."""
    max_query_length: int = 64
    """Questions are cut to this many tokens."""
    n_best_size: int = 20
    """Candidate answers kept per question."""
    max_answer_length: int = 30
    """Longest answer in tokens."""
    null_score_diff_threshold: float = 0.0
    """v2.0: predict no answer when score(null) - score(best span) is above this."""
    cache_dir: Optional[str] = None
    """Feature cache folder (default $BERTRAIN_CACHE/features or ~/.cache/bertrain/features); '' disables."""


@dataclass
class SquadFinetuneConfig(FinetuneConfig):
    """Fine-tune on SQuAD v1.1/v2.0; writes predictions.json, nbest_predictions.json, null_odds.json (v2.0), eval_results.json."""

    data: SquadDataConfig = field(default_factory=SquadDataConfig)
    """SQuAD files and feature settings."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.do_train and not self.data.train_file:
            raise ValueError("config key 'data.train_file' is required to fine-tune (--train)")
        if self.do_eval and not self.data.dev_file:
            raise ValueError("config key 'data.dev_file' is required to evaluate (--dev)")
        for key in ("n_best_size", "max_answer_length"):  # 0 gave every question the answer "" (or "empty")
            if getattr(self.data, key) < 1:
                raise ValueError(f"config key 'data.{key}' must be >= 1, got {getattr(self.data, key)}")


@dataclass
class GlueDataConfig:
    task: str = ""
    """GLUE task: cola, sst2, mrpc, stsb, qqp, mnli, qnli, rte, wnli."""
    data_dir: str = ""
    """The task's folder with train.tsv, dev.tsv (MNLI: dev_matched/dev_mismatched) and test.tsv."""
    max_seq_length: int = 128
    """Tokens per example, pairs truncated longest-first."""
    max_train_examples: int = 0
    """Train on a seeded random subset of this many examples (0: all) — for CPU-sized runs."""
    predict_test: bool = True
    """Write GLUE-server test predictions ({TASK}.tsv) when the test file exists."""


@dataclass
class GlueFinetuneConfig(FinetuneConfig):
    """Fine-tune on a GLUE task; writes eval_results.json and the GLUE-server test predictions ({TASK}.tsv)."""

    data: GlueDataConfig = field(default_factory=GlueDataConfig)
    """GLUE task and data."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.data.task:
            raise ValueError("config key 'data.task' is required (--task)")
        get_task(self.data.task)
        if not self.data.data_dir:
            raise ValueError("config key 'data.data_dir' is required (--data-dir)")


# ----------------------------------------------------------------------------------------------- the task

QA_KEYS = ("input_ids", "token_type_ids", "attention_mask", "start_positions", "end_positions")
CLS_KEYS = ("input_ids", "token_type_ids", "attention_mask", "labels")


def load_model(kind: str, path: str | Path, num_labels: int = 2) -> nn.Module:
    """bertrain's BertForQuestionAnswering ("qa") / BertForSequenceClassification from an HF or checkpoint folder,
    or a Hub model id in the local HF cache."""
    from bertrain.model.hf import CONFIG_NAMES, resolve_model_dir

    path = resolve_model_dir(path)
    if not any((path / name).is_file() for name in CONFIG_NAMES):  # config.json, or Google's bert_config.json
        raise ValueError(f"model folder {path} has no config.json (need an HF-format or bertrain checkpoint folder)")
    if kind == "qa":
        return BertForQuestionAnswering.from_pretrained(path)
    return BertForSequenceClassification.from_pretrained(path, num_labels=num_labels)


FLAGS = {"init": "--init", "data.data_dir": "--data-dir", "data.train_file": "--train", "data.dev_file": "--dev"}
"""The command-line flags of the config keys that name a fine-tuning run's inputs (named in their errors)."""


def check_length_fits_model(init: str, max_seq_length: int) -> None:
    """Refuse a `data.max_seq_length` beyond the positions of the model to fine-tune, before any work. Otherwise
    the run builds every feature (minutes on SQuAD), fails at the first batch holding a window that long, and
    leaves a folder the corrected command refuses as a run to resume; or, when no input is that long, exports a
    task.json whose length the model cannot take."""
    from bertrain.model.hf import find_config_file, resolve_model_dir

    try:
        config = json.loads(find_config_file(resolve_model_dir(init)).read_text(encoding="utf-8"))
        positions = int(config["max_position_embeddings"])
    except (OSError, ValueError, KeyError, TypeError):
        return  # load_model names what is wrong with the folder
    if max_seq_length > positions:
        raise ValueError(f"config key 'data.max_seq_length' ({max_seq_length}) exceeds the max_position_embeddings "
                         f"({positions}) of the model to fine-tune ({init}): use {positions} or less")


DevEval = Callable[[nn.Module, DistInfo, Precision], dict[str, float]]


def squad_model_files(d: SquadDataConfig, v2: bool) -> dict[str, Any]:
    """task.json of a SQuAD model (final/, best/): its windows and the answer decoding its dev scores used, so that
    `bertrain predict` and `serve` answer as the run evaluated."""
    return {"task.json": {"kind": "qa", "task": "squad", "version_2_with_negative": v2,
                          "max_seq_length": d.max_seq_length, "doc_stride": d.doc_stride,
                          "max_query_length": d.max_query_length, "n_best_size": d.n_best_size,
                          "max_answer_length": d.max_answer_length,
                          "null_score_diff_threshold": d.null_score_diff_threshold}}


def glue_model_files(task: Any, max_seq_length: int) -> dict[str, Any]:
    """task.json of a GLUE model (final/, best/): label names and the sequence length, for predict and serve."""
    return {"task.json": {"kind": "regression" if task.is_regression else "classification", "task": task.name,
                          "labels": list(task.labels) if task.labels else None, "max_seq_length": max_seq_length}}


class FeatureTask:
    """Fine-tuning on in-memory features: span extraction ("qa") or sequence classification/regression. `dev`
    scores a model on the dev set (the Trainer's evaluation while training); None: no dev evaluation."""

    loss_groups = ("task",)

    def __init__(self, name: str, kind: str, init: str, feats: dict[str, np.ndarray], seed: int,
                 num_labels: int = 2, labels: tuple[str, ...] | None = None, dev: DevEval | None = None,
                 metric_names: tuple[str, ...] | None = None, model_files: dict[str, Any] | None = None,
                 data_name: str = "the training set") -> None:
        self.name, self.kind, self.init, self.seed, self.num_labels = name, kind, init, seed, num_labels
        self.data_name = data_name
        """The input the features come from, as a resume refused for other features names it."""
        self.model_files = model_files or {}
        """{name: JSON} written beside the weights of every model folder the run keeps (final/, best/): task.json,
        the settings `bertrain predict` and `serve` read."""
        self.labels = labels
        self.arrays = {k: feats[k] for k in (QA_KEYS if kind == "qa" else CLS_KEYS)}
        self.dev = dev
        self.can_evaluate = dev is not None
        self.metric_names = metric_names
        """What `dev` returns: eval.metric is checked against it before the first step."""
        self.primary_metric = PRIMARY_METRIC.get(name, "accuracy")

    def evaluate(self, model: nn.Module, dist: DistInfo, precision: Precision) -> dict[str, float]:
        assert self.dev is not None
        return self.dev(model, dist, precision)

    def build_loader(self, dist: DistInfo, plan: BatchPlan) -> ArrayLoader:
        loader = ArrayLoader(self.arrays, plan.micro_batch_size, dist.rank, dist.world_size, self.seed,
                             pad_multiple=plan.global_batch_size)
        loader.data_name = self.data_name
        return loader

    def build_model(self) -> nn.Module:
        model = load_model(self.kind, self.init, self.num_labels)
        if self.labels:  # the exported config.json then names the classes (id2label), as HF's does
            model.id2label = dict(enumerate(self.labels))
        return model

    def target_counts(self, batch: dict[str, torch.Tensor]) -> list[int]:
        if self.kind == "qa" or batch["labels"].is_floating_point():
            return [batch["input_ids"].shape[0]]
        return [int((batch["labels"] != -100).sum())]

    def forward(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = model(input_ids=batch["input_ids"], token_type_ids=batch["token_type_ids"],
                    attention_mask=batch["attention_mask"])
        if self.kind == "qa":
            sums = qa_loss_sums(out.start_logits, out.end_logits, batch["start_positions"], batch["end_positions"])
        else:
            sums = classification_loss_sums(out.logits, batch["labels"])
        return {f"task_{k}": v for k, v in sums.items()}

    def metrics(self, sums: dict[str, float]) -> dict[str, Any]:
        if "task_correct" in sums:
            return {"acc": sums["task_correct"] / max(sums["task_count"], 1)}
        return {}


def _train_results(run: RunResult) -> dict[str, Any]:
    done = run.state.step - run.start_step
    # the steps run (an early stop, a target or a time budget end before the plan), and the plan
    out = {"train_steps": run.state.step,
           "planned_steps": None if run.total_steps == NO_STEP_LIMIT else run.total_steps,
           "stop_reason": run.ended_early,
           "train_seconds": round(run.seconds, 1),
           "train_examples_per_second": round(done * run.plan.global_batch_size / max(run.seconds, 1e-9), 2),
           "final_loss": run.last_metrics.get("loss")}
    if run.evaluation:  # the dev evaluations while training: what was selected, and on what
        out["selection"] = {**run.evaluation, "steps_run": run.state.step}
    return out


def stopped_message(out_dir: Path, step: int, evaluation: dict[str, Any]) -> str:
    """What a fine-tuning run stopped by a signal says: where it saved, the dev evaluations so far, what is left."""
    evals = evaluation.get("history") or []
    so_far = (f"{len(evals)} dev evaluation{'s' if len(evals) != 1 else ''} so far, best {evaluation['metric']} "
              f"{evaluation['best_value']:.4g} at step {evaluation['best_step']}"
              if evals and evaluation.get("best_step") is not None else "no dev evaluation yet")
    return (f"stopped by a signal at step {step} after saving {out_dir}/step-{step} ({so_far}; the final dev "
            "evaluation and the export are still to come); continue with the same command and --resume auto")


def _stopped(out_dir: Path, run: RunResult) -> RunStopped:
    step = run.state.step
    return RunStopped(stopped_message(out_dir, step, run.evaluation), checkpoint=out_dir / f"step-{step}")


def _start(cfg: FinetuneConfig, dist: DistInfo) -> Path:
    out = Path(cfg.output_dir)
    if dist.is_main:
        out.mkdir(parents=True, exist_ok=True)
    return out


def _record_eval_config(cfg: FinetuneConfig, out: Path) -> None:
    """An evaluation-only run's config.yaml (a training run saves it with its checkpoints), written once the
    evaluation is done: written at the start, it made a run refused on its inputs (a model without the task's head,
    a bad dev file) a run the corrected command had to --overwrite."""
    if not cfg.do_train:
        save_config(cfg, out / "config.yaml")


def eval_model(cfg: FinetuneConfig, kind: str, num_labels: int, dist: DistInfo) -> nn.Module:
    """The `cfg.init` model to evaluate (a bertrain or an HF folder), with the model options, on the device."""
    torch.manual_seed(cfg.seed)
    model = load_model(kind, cfg.init, num_labels)
    # Without training, a head the folder lacks (a pretrained model; a classifier with another number of labels,
    # re-initialised) would be scored at random and its test predictions written as if they meant something.
    needed = ("QA head",) if kind == "qa" else ("classification head", "pooler")
    fresh = [h for h in getattr(model, "loading_info", {}).get("initialized", []) if h in needed]
    if fresh:
        what = "a QA head" if kind == "qa" else f"a classification head with {num_labels} output(s)"
        raise ValueError(f"--init {cfg.init} has no trained {' or '.join(fresh)} ({what} is needed): evaluating "
                         "it (do_train false) would score random weights; fine-tune it first (do_train true), or "
                         "give the folder of a model fine-tuned on this task")
    return apply_model_options(model, cfg.model_options).to(dist.device)


def init_on_resume(cfg: FinetuneConfig, resume: str | None) -> str:
    """The model a run loads before a resume restores its weights: `cfg.init`, or where that folder is gone, the
    run's own checkpoint (an HF folder of the same architecture and task head, with the tokenizer files). Before,
    moving or deleting the pretrained model after a fine-tuning had started left the fine-tuning unresumable. A
    fresh start, or sharded (FSDP) checkpoints without HF weights, keep `cfg.init` and its error."""
    found = checkpoint_for_gone_init(cfg.init, resume, cfg.output_dir, with_weights=True) if cfg.do_train else None
    if found is None:
        return cfg.init
    log.warning("--init %s is gone; resuming from %s, which also gives the model to build (its weights come from "
                "the checkpoint, as on any resume)", cfg.init, found)
    return str(found)


def warn_other_settings(init: str, settings: dict[str, Any]) -> None:
    """One warning when the model to evaluate was fine-tuned with other feature settings (its task.json) than
    this evaluation's: `bertrain finetune ... --do_train false` on an exported model then gives other numbers
    than the fine-tuning printed, without a word of why."""
    from bertrain.model.hf import resolve_model_dir

    try:
        saved = json.loads((resolve_model_dir(init) / "task.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return
    if not isinstance(saved, dict):
        return
    other = [f"data.{k} {saved[k]!r} there, {v!r} here" for k, v in settings.items() if k in saved and saved[k] != v]
    if other:
        log.warning("%s was fine-tuned with other settings than this evaluation's (%s): its dev numbers will differ "
                    "from those its fine-tuning reported; pass those settings to evaluate it as it was",
                    init, "; ".join(other))


def _article_slice(spec: str, key: str) -> slice:
    if not spec:
        return slice(None)
    try:
        parts = [int(p) if p.strip() else None for p in spec.split(":")]
    except ValueError:
        raise ValueError(f"config key '{key}': expected 'start:stop', got {spec!r}") from None
    if len(parts) != 2:
        raise ValueError(f"config key '{key}': expected 'start:stop', got {spec!r}")
    return slice(parts[0], parts[1])


def _subset_squad_file(path: str, spec: str, key: str, out_dir: Path, name: str) -> tuple[str, dict]:
    """The SQuAD file restricted to some articles: (path of the file to read, its parsed JSON)."""
    if not Path(path).exists():
        raise ValueError(f"config key 'data.{name}_file' (--{name}): {path} does not exist")
    data = load_dataset_json(path, scoring=name == "dev")
    if not spec:
        return path, data
    sub = dict(data)
    sub["data"] = data["data"][_article_slice(spec, key)]
    if not sub["data"]:
        raise ValueError(f"config key '{key}' = {spec!r} selects no article of {path}")
    # The subset goes to a file of the run (not the data folder, which may be read-only) so that the reader's
    # error messages and the feature-cache key refer to exactly what was used.
    dest = out_dir / f"{name}-articles-{spec.replace(':', '_')}.json"
    atomic_write_json(dest, sub, indent=None)
    return str(dest), sub


# ----------------------------------------------------------------------------------------------- SQuAD

def run_squad(cfg: SquadFinetuneConfig, resume: str | None = None, overwrite: bool = False,
              allow_config_change: bool = False, on_eval: OnEval | None = None) -> dict[str, Any]:
    """Fine-tune and/or evaluate on SQuAD; rank 0 writes predictions, nbest, null_odds and eval_results."""
    d = cfg.data
    fcfg = SquadFeatureConfig(d.max_seq_length, d.doc_stride, d.max_query_length)
    v2 = d.version_2_with_negative
    init = init_on_resume(cfg, resume)
    check_length_fits_model(init, d.max_seq_length)
    with distributed_context(cfg.distributed, sharded=cfg.parallelism.strategy == "fsdp") as dist, \
            run_folder(Path(cfg.output_dir), "finetune squad", dist, resume, overwrite,
                       {"init": init, "data.train_file": d.train_file if cfg.do_train else "",
                        "data.dev_file": d.dev_file if cfg.do_eval else ""}, models=("init",), flags=FLAGS,
                       cfg=cfg), \
            contextlib.ExitStack() as after_fit:
        same_paths_on_every_rank({"init": model_dir_or_name(init),
                                  "data.train_file": d.train_file if cfg.do_train else "",
                                  "data.dev_file": d.dev_file if cfg.do_eval else ""})
        out_dir = _start(cfg, dist)
        tok = load_task_tokenizer(init)
        results: dict[str, Any] = {"task": "squad", "version": "2.0" if v2 else "1.1", "init": cfg.init}

        def features(path: str, is_training: bool):
            examples = read_squad(path, version_2_with_negative=v2)
            # rank 0 builds the cache first; the others then read it instead of all tokenizing at once
            built = {}

            def build() -> None:
                built["feats"], _ = load_or_build_features(path, examples, tok, fcfg, is_training, d.cache_dir)

            on_rank0("build the features", build, long=True)
            if not dist.is_main:
                build()
            return examples, built["feats"]

        pcfg = SquadPostprocessConfig(d.n_best_size, d.max_answer_length, d.null_score_diff_threshold)
        # evaluate-v2.0.py with null_odds.json as its --na-prob-file scores a question with null odds above its
        # --na-prob-thresh (1.0) as "no answer"; with a null_score_diff_threshold above 1.0 that would score
        # questions predictions.json answers as unanswered. Its threshold then: exact/f1 are predictions.json's.
        na_thresh = max(1.0, d.null_score_diff_threshold)
        dev = None
        if cfg.do_eval:
            dev_path, dev_json = _subset_squad_file(d.dev_file, d.dev_articles, "data.dev_articles", out_dir, "dev")
            dev_examples, dev_feats = features(dev_path, False)

            def dev(model: nn.Module, dist: DistInfo, precision: Precision) -> dict[str, float]:
                start, end = distributed_forward(model, dev_feats, lambda o: (o.start_logits, o.end_logits), dist,
                                                 cfg.eval_batch_size, precision, trim=cfg.train.trim_padding)

                def score() -> dict[str, float]:  # rank 0 scores, every rank learns the numbers
                    preds, _, null_odds = postprocess_predictions(dev_examples, dev_feats, start, end, pcfg, v2)
                    official = evaluate_squad(dev_json, preds, null_odds if v2 else None,
                                              version="2.0" if v2 else "1.1", na_prob_thresh=na_thresh)
                    return {k: float(v) for k, v in official.items() if isinstance(v, (int, float))}

                return on_rank0("score the dev set", score)

            # The official script's keys for this dev set (v2.0: HasAns_/NoAns_ only when it has such questions)
            dummy = {ex.qid: "" for ex in dev_examples}
            metric_names = tuple(k for k, v in evaluate_squad(
                dev_json, dummy, dict.fromkeys(dummy, 0.0) if v2 else None, version="2.0" if v2 else "1.1").items()
                if isinstance(v, (int, float)))

        if cfg.do_train:
            train_path, _ = _subset_squad_file(d.train_file, d.train_articles, "data.train_articles", out_dir, "train")
            examples, feats = features(train_path, True)
            run = Trainer(cfg, dist).fit(FeatureTask("squad", "qa", init, feats, cfg.seed, dev=dev,
                                                     metric_names=metric_names if dev else None,
                                                     model_files=squad_model_files(d, v2),
                                                     data_name=f"the training set (--train {d.train_file}, "
                                                               "tokenized by --init's vocabulary)"),
                                         resume, allow_config_change, on_eval)
            if run.stopped_by_signal:
                raise _stopped(out_dir, run)
            after_fit.enter_context(run.closing_on_error())  # the final evaluation and export: FAILED on an error
            model = run.model
            results.update(train_examples=len(examples), train_features=len(feats["input_ids"]),
                           **_train_results(run))
        else:
            model = eval_model(cfg, "qa", 2, dist)
            if dist.is_main:
                warn_other_settings(cfg.init, {"max_seq_length": d.max_seq_length, "doc_stride": d.doc_stride,
                                               "max_query_length": d.max_query_length,
                                               "version_2_with_negative": v2})
        if cfg.do_eval:
            examples, feats = dev_examples, dev_feats
            t0 = time.perf_counter()
            start, end = distributed_forward(model, feats, lambda o: (o.start_logits, o.end_logits), dist,
                                             cfg.eval_batch_size, Precision(cfg.precision, dist.device),
                                             trim=cfg.train.trim_padding)
            eval_s = time.perf_counter() - t0

            def score() -> None:  # rank 0: post-processing, prediction files and the official metrics
                preds, nbest, null_odds = postprocess_predictions(examples, feats, start, end, pcfg, v2)
                write_prediction_files(out_dir, preds, nbest, null_odds if v2 else None)
                official = evaluate_squad(dev_json, preds, null_odds if v2 else None,
                                          version="2.0" if v2 else "1.1", na_prob_thresh=na_thresh)
                results.update(official)
                results.update(eval_examples=len(examples), eval_features=len(feats["input_ids"]),
                               eval_seconds=round(eval_s, 1))
                if v2:
                    # The best threshold found on dev (evaluate-v2.0.py's best_f1_thresh) applied to the same
                    # scores: the predictions a tuned run would submit.
                    thr, best_preds, at_best = at_best_f1_threshold(dev_json, nbest, null_odds, official)
                    atomic_write_json(out_dir / "predictions_best_f1_thresh.json", best_preds)
                    results["at_best_f1_thresh"] = {"threshold": thr, "exact": at_best["exact"],
                                                    "f1": at_best["f1"]}
                atomic_write_json(out_dir / "eval_results.json", results)
                log.info("SQuAD dev: %s", {k: v for k, v in results.items() if not isinstance(v, dict)})

            on_rank0("score the dev predictions", score, long=True)

        def export() -> None:
            if cfg.checkpoint.export_final and cfg.do_train:
                ckpt.export_final(out_dir, model, squad_model_files(d, v2))

        on_rank0("export the final model", export, long=True)
        on_rank0("record the config", functools.partial(_record_eval_config, cfg, out_dir))
        if cfg.do_train:
            run.finish(results, out_dir / "final", out_dir / "eval_results.json")
        return results if dist.is_main else {}


# ----------------------------------------------------------------------------------------------- GLUE

def _glue_predictions(model: nn.Module, feats: dict[str, np.ndarray], task: Any, cfg: GlueFinetuneConfig,
                      dist: DistInfo, precision: Precision) -> np.ndarray:
    (logits,) = distributed_forward(model, feats, lambda o: (o.logits,), dist, cfg.eval_batch_size, precision,
                                    trim=cfg.train.trim_padding, per_token=False)
    return logits[:, 0] if task.is_regression else logits.argmax(axis=1)


def glue_dev_metrics(feats: dict[str, np.ndarray], task: Any, cfg: GlueFinetuneConfig, model: nn.Module,
                     dist: DistInfo, precision: Precision) -> dict[str, float]:
    """The task's metrics on its (first) dev split: the evaluation while training (every rank gets all
    predictions, so every rank computes the same numbers)."""
    preds = _glue_predictions(model, feats, task, cfg, dist, precision)
    return glue_compute_metrics(task.name, preds.tolist(), feats["labels"].tolist())


def run_glue(cfg: GlueFinetuneConfig, resume: str | None = None, overwrite: bool = False,
             allow_config_change: bool = False, on_eval: OnEval | None = None) -> dict[str, Any]:
    """Fine-tune and/or evaluate on a GLUE task; rank 0 writes eval_results.json and the test submission."""
    d = cfg.data
    task = get_task(d.task)
    init = init_on_resume(cfg, resume)
    check_length_fits_model(init, d.max_seq_length)
    with distributed_context(cfg.distributed, sharded=cfg.parallelism.strategy == "fsdp") as dist, \
            run_folder(Path(cfg.output_dir), f"finetune glue {task.name}", dist, resume, overwrite,
                       {"init": init, "data.data_dir": d.data_dir}, models=("init",), flags=FLAGS, cfg=cfg), \
            contextlib.ExitStack() as after_fit:
        same_paths_on_every_rank({"init": model_dir_or_name(init), "data.data_dir": d.data_dir})
        out_dir = _start(cfg, dist)
        tok = load_task_tokenizer(init)
        results: dict[str, Any] = {"task": task.name, "init": cfg.init, "max_seq_length": d.max_seq_length}
        # Every split is read (and checked) before any training: a bad dev or test file is found in seconds.
        train_split = read_split(d.data_dir, task, "train") if cfg.do_train else []
        dev_splits = read_split(d.data_dir, task, "dev", scored=True) if cfg.do_eval else []
        test_splits, diagnostic = None, None
        if d.predict_test:
            if has_split(d.data_dir, task, "test"):  # TSV, the Hub's Parquet or a datasets folder
                test_splits = read_split(d.data_dir, task, "test")
                # GLUE's diagnostic set (AX.tsv of a submission) is scored by the MNLI model
                diagnostic = read_diagnostic(d.data_dir) if task.name == "mnli" else None
            else:
                log.info("no test file in %s: skipping test predictions", d.data_dir)
        if cfg.do_train:
            (_, examples), = train_split
            n_all = len(examples)
            if d.max_train_examples and d.max_train_examples < n_all:
                keep = np.sort(np.random.default_rng(cfg.seed).permutation(n_all)[: d.max_train_examples])
                examples = [examples[i] for i in keep]
            feats = glue_features(examples, task, tok, d.max_seq_length)
            dev = None
            if cfg.do_eval:  # the first dev split (MNLI: matched) is the one selection looks at
                (_, dev_examples), *_ = dev_splits
                dev = functools.partial(glue_dev_metrics, glue_features(dev_examples, task, tok, d.max_seq_length),
                                        task, cfg)
            run = Trainer(cfg, dist).fit(FeatureTask(task.name, "cls", init, feats, cfg.seed, task.num_labels,
                                                     task.labels, dev, glue_metric_names(task.name),
                                                     glue_model_files(task, d.max_seq_length),
                                                     f"the training split of --data-dir {d.data_dir} (tokenized by "
                                                     "--init's vocabulary)"),
                                         resume, allow_config_change, on_eval)
            if run.stopped_by_signal:
                raise _stopped(out_dir, run)
            after_fit.enter_context(run.closing_on_error())  # the final evaluation and export: FAILED on an error
            model = run.model
            results.update(train_examples=len(examples), train_examples_available=n_all,
                           epochs=cfg.train.epochs if not cfg.train.steps else None, **_train_results(run))
        label_ids = None  # a trained head predicts the task's label ids
        if not cfg.do_train:
            model = eval_model(cfg, "cls", task.num_labels, dist)
            if dist.is_main:
                warn_other_settings(cfg.init, {"max_seq_length": d.max_seq_length})
            # a classifier fine-tuned elsewhere (transformers' run_glue: MNLI as entailment, neutral,
            # contradiction) may order its classes otherwise: its config's label names say how
            label_ids = model_label_ids(task, getattr(model, "id2label", None))

        def predict(examples):
            feats = glue_features(examples, task, tok, d.max_seq_length)
            preds = _glue_predictions(model, feats, task, cfg, dist, Precision(cfg.precision, dist.device))
            return feats, preds if label_ids is None else label_ids[preds]

        if cfg.do_eval:
            for split_name, examples in dev_splits:
                feats, preds = predict(examples)
                metrics = glue_compute_metrics(task.name, preds.tolist(), feats["labels"].tolist())
                results[split_name] = {**metrics, "examples": len(examples)}
                on_rank0("write the dev predictions",  # the dev predictions themselves, for error analysis
                         functools.partial(write_dev_predictions, out_dir / f"{split_name}_predictions.tsv", task,
                                           examples, preds))
                if task.labels is not None:
                    counts = np.bincount(feats["labels"], minlength=task.num_labels)
                    results[split_name]["majority_baseline_accuracy"] = float(counts.max() / counts.sum())
                log.info("%s %s: %s", task.name, split_name, results[split_name])
        if test_splits is not None:
            for (split_name, examples), sub in zip(test_splits, task.submission):
                _, preds = predict(examples)
                on_rank0("write the test submission",
                         functools.partial(write_submission, out_dir / sub, task, examples, preds))
            results["test_predictions"] = list(task.submission)
            if diagnostic is not None:
                _, preds = predict(diagnostic)
                on_rank0("write the diagnostic submission",
                         functools.partial(write_submission, out_dir / DIAGNOSTIC_SUBMISSION, task, diagnostic, preds))
                results["test_predictions"].append(DIAGNOSTIC_SUBMISSION)

        def finish() -> None:
            atomic_write_json(out_dir / "eval_results.json", results)
            if cfg.checkpoint.export_final and cfg.do_train:
                # label names and feature settings for `bertrain predict` / `Predictor`
                ckpt.export_final(out_dir, model, glue_model_files(task, d.max_seq_length))

        on_rank0("write the results and the final model", finish, long=True)
        on_rank0("record the config", functools.partial(_record_eval_config, cfg, out_dir))
        if cfg.do_train:
            run.finish(results, out_dir / "final", out_dir / "eval_results.json")
        return results if dist.is_main else {}
