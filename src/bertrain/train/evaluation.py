"""Evaluation while training, for every task of the engine: when to evaluate, the selection metric, the best
model (OUTPUT/best), early stopping and the evaluation history that a checkpoint carries.

A task that can evaluate has `evaluate(model, dist, precision) -> {metric: value}` (the same numbers on every
rank: pretraining all-reduces its held-out sums, fine-tuning scores the gathered dev predictions) and
`primary_metric`. The Trainer calls `Evaluator.maybe_evaluate` after each step; everything it decides is a pure
function of the history (`EvalHistory.update`), which is one entry of the checkpoint registry (`train/states.py`),
so a killed and resumed run makes the same decisions — the same best step, the same stop — as the straight one.

The best model is written to OUTPUT/best (HF format + best.json naming its step and value) when the selection
metric improves. A run killed after writing OUTPUT/best but before its next checkpoint goes back to the older
history on resume and, being bitwise the straight run, writes the same OUTPUT/best again when it gets there.
"""
from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from collections.abc import Iterable
from typing import Any, Callable, Optional

import torch
from torch import nn

from bertrain.train import checkpoint as ckpt
from bertrain.train.config import EvalConfig
from bertrain.train.distributed import DistInfo, on_rank0, unwrap_model
from bertrain.train.parallel import gather_full_model, is_sharded, meta_copy
from bertrain.train.precision import Precision
from bertrain.utils.io import atomic_dir, atomic_write_json

log = logging.getLogger(__name__)

BEST = "best"
BEST_JSON = "best.json"

OnEval = Callable[[int, float], bool]
"""Called after each evaluation with (step, selection value) on every rank; True stops the run (e.g. a search's
pruner). It must return the same on every rank."""


def maximises(metric: str) -> bool:
    """Losses and perplexities are minimised, every other metric (accuracy, F1, MCC, Pearson, exact match)
    maximised."""
    return not metric.endswith(("loss", "perplexity"))


@dataclass
class EvalHistory:
    """Every evaluation of the run and what was decided from them (an entry of the checkpoint registry)."""
    records: list[dict[str, Any]] = field(default_factory=list)
    """One per evaluation: step, epoch, the task's metrics."""
    best_step: Optional[int] = None
    best_value: Optional[float] = None
    since_best: int = 0
    """Evaluations in a row without an improvement of at least min_delta."""
    stop_reason: Optional[str] = None
    """Why the run stopped early (early stopping, target reached, pruned), None while it goes on."""

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for k, v in state.items():
            setattr(self, k, v)

    def update(self, step: int, epoch: int, metrics: dict[str, float], metric: str, cfg: EvalConfig) -> bool:
        """Record one evaluation; returns whether it is a new best (stop_reason is set when the run should stop)."""
        if metric not in metrics:
            raise ValueError(metric_error(metric, metrics))
        value = float(metrics[metric])
        sign = 1.0 if maximises(metric) else -1.0
        improved = math.isfinite(value) and (self.best_value is None or
                                             sign * (value - self.best_value) > cfg.min_delta)
        self.records.append({"step": step, "epoch": epoch, **metrics})
        if improved:
            self.best_step, self.best_value, self.since_best = step, value, 0
        else:
            self.since_best += 1
        self.stop_reason = self._stop(value, metric, cfg) or self.stop_reason
        return improved

    def _stop(self, value: float, metric: str, cfg: EvalConfig) -> str | None:
        """Why the run stops after an evaluation that scored `value`, or None."""
        sign = 1.0 if maximises(metric) else -1.0
        if cfg.target is not None and sign * (value - cfg.target) >= 0:
            return f"{metric} {value:.4g} reached the target eval.target = {cfg.target:g}"
        if cfg.patience and self.since_best >= cfg.patience:
            return (f"early stopping: {self.since_best} evaluations without an improvement of {metric} by more "
                    f"than eval.min_delta = {cfg.min_delta:g} (eval.patience = {cfg.patience}; {self.best_text()})")
        return None

    def best_text(self) -> str:
        """`best 0.8123 at step 40`, or why there is none: every evaluation so far scored NaN or inf (e.g. the
        Pearson correlation of constant predictions), which formatting the missing best as a number crashed on."""
        if self.best_value is None:
            return "no best yet: every evaluation so far scored NaN or inf"
        return f"best {self.best_value:.4g} at step {self.best_step}"

    def recheck_stop(self, metric: str, cfg: EvalConfig) -> None:
        """On resume from the checkpoint of an early stop: the decision again, from the last evaluation, under
        eval.target and eval.patience as they are now (changed with --allow-config-change, they used to be reported
        as applied and ignored: the run stopped again at once). eval.min_delta counts from the next evaluation on;
        a search's stop stands."""
        if not self.stop_reason or self.stop_reason.startswith(SEARCH_STOP) or not self.records:
            return
        last = self.records[-1].get(metric)
        if last is not None:
            self.stop_reason = self._stop(float(last), metric, cfg)


SEARCH_STOP = "stopped by the search"


def metric_error(metric: str, known: Iterable[str]) -> str:
    return f"config key 'eval.metric': {metric!r} is not one of this task's metrics ({', '.join(sorted(known))})"


class Evaluator:
    """The evaluations of one `Trainer.fit` (see the module docstring)."""

    def __init__(self, cfg: EvalConfig, task: Any, dist: DistInfo, precision: Precision, out: Path,
                 total_steps: int, steps_per_epoch: int, template: nn.Module | None = None,
                 on_eval: OnEval | None = None) -> None:
        self.cfg, self.task, self.dist, self.precision, self.out = cfg, task, dist, precision, out
        self.enabled = cfg.enabled and callable(getattr(task, "evaluate", None)) and getattr(task, "can_evaluate", True)
        self.metric = cfg.metric or getattr(task, "primary_metric", "")
        known = getattr(task, "metric_names", None)  # a task that declares its metrics has them checked now,
        if self.enabled and known is not None and self.metric not in known:  # not after the first evaluation
            raise ValueError(metric_error(self.metric, known))
        self.total_steps, self.steps_per_epoch = total_steps, steps_per_epoch
        self.template = template  # fsdp: a meta copy of the plain model, to gather the best weights into
        self.on_eval = on_eval
        self.history = EvalHistory()

    def due(self, step: int, last: bool = False) -> bool:
        """Evaluate after `step`? (`last`: the loop ends after it for another reason, e.g. the time budget.)"""
        if not self.enabled:
            return False
        return last or step == self.total_steps or (self.cfg.interval > 0 and step % self.cfg.interval == 0) or \
            (self.cfg.each_epoch and self.steps_per_epoch > 0 and step % self.steps_per_epoch == 0)

    def evaluate(self, model: nn.Module, step: int, epoch: int) -> dict[str, Any]:
        """Evaluate `model` (the training module, wrapped or sharded), record it, keep the best; returns the
        record for metrics.jsonl. Every rank calls it."""
        t0 = time.perf_counter()
        plain = unwrap_model(model)  # DDP's forward would sync buffers: evaluation needs none of it
        was_training = plain.training
        plain.eval()
        try:
            with torch.no_grad():
                metrics = {k: float(v) for k, v in self.task.evaluate(plain, self.dist, self.precision).items()}
        finally:
            plain.train(was_training)
        improved = self.history.update(step, epoch, metrics, self.metric, self.cfg)
        if improved and self.cfg.final == "best":
            self.save_best(plain, step)
        value = metrics[self.metric]
        if self.on_eval is not None and self.history.stop_reason is None and self.on_eval(step, value):
            self.history.stop_reason = f"{SEARCH_STOP} after step {step} ({self.metric} {value:.4g})"
        record = {"step": step, "epoch": epoch, "event": "eval", "metrics": metrics, "metric": self.metric,
                  "value": value, "improved": improved, "best_step": self.history.best_step,
                  "best_value": self.history.best_value, "eval_s": round(time.perf_counter() - t0, 3)}
        log.info("eval at step %d: %s (%s: %s)%s", step, " ".join(f"{k} {v:.4g}" for k, v in metrics.items()),
                 self.metric, self.history.best_text(),
                 f"; {self.history.stop_reason}" if self.history.stop_reason else "")
        return record

    def save_best(self, model: nn.Module, step: int) -> None:
        """OUTPUT/best: the weights of `model` (HF format) and best.json, atomically (rank 0 writes; under fsdp every
        rank takes part in gathering the weights first)."""
        if is_sharded(model):
            assert self.template is not None, "fsdp evaluation needs the meta template of the model"
            model = gather_full_model(model, meta_copy(self.template), torch.device("cpu"))
        info = {"step": step, "metric": self.metric, "value": self.history.best_value}

        def write() -> None:
            with atomic_dir(self.out / BEST, overwrite=True) as tmp:
                ckpt.save_model(model, tmp)
                for name, content in getattr(self.task, "model_files", {}).items():  # e.g. task.json, as final/
                    atomic_write_json(tmp / name, content)
                atomic_write_json(tmp / BEST_JSON, info)

        on_rank0(f"write the best model (step {step})", write, long=True)

    def final_model(self, model: nn.Module, step: int) -> nn.Module:
        """The model the run ends with: `model` (the last) or, with eval.final best, the best one loaded from
        OUTPUT/best (every rank reads it)."""
        h = self.history
        if not self.enabled or self.cfg.final != "best" or h.best_step is None:
            return model
        if h.best_step == step:
            log.info("final model: the last one, which is also the best (%s %.4g at step %d)", self.metric,
                     h.best_value, step)
            return model
        best = self.out / BEST
        info = _read_json(best / BEST_JSON)
        if info is None or info.get("step") != h.best_step:
            raise RuntimeError(f"{best} does not hold the best model of this run (step {h.best_step} by the "
                               f"history, {best / BEST_JSON} says {info and info.get('step')}): it was changed "
                               "outside the run; set eval.final: last to end with the last model")
        ckpt.load_model_weights(model, best)
        log.info("final model: the best one, step %d of %d (%s %.4g; eval.final: last keeps the last)",
                 h.best_step, step, self.metric, h.best_value)
        return model

    def summary(self) -> dict[str, Any]:
        """For results files and reports: the selection, the best, the stop and the whole history."""
        h = self.history
        return {"metric": self.metric, "maximise": maximises(self.metric), "final": self.cfg.final,
                "best_step": h.best_step, "best_value": h.best_value, "stop_reason": h.stop_reason,
                "history": list(h.records)}


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
