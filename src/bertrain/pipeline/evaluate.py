"""The evaluate stage of `bertrain run`: every fine-tuning run's dev-set scores, per task and initialisation, with
their mean and spread over seeds, the majority-class baseline, the BERT paper's figure where one exists, and the
verdict on the task's primary metric (`bertrain.pipeline.verdict`: does pretraining help, with its interval and the
chance level).

The scores themselves come from the fine-tuning stages (`run_glue` / `run_squad` score the dev set with the
official metrics and write eval_results.json); this stage only collects them, so its results.json is the same
bytes whenever the runs are (no timings in it). It also records how the dev set was used to select: each task's
search (every trial, the chosen settings: `bertrain.pipeline.search`) and whether each run's final model is its
best dev evaluation (eval.final: best) or stopped where a dev evaluation said (eval.patience, eval.target:
`stopped_on_dev`), since each makes the dev scores optimistic.
"""
from __future__ import annotations

import dataclasses
import json
import math
import statistics
from pathlib import Path
from typing import Any

from bertrain.pipeline import search
from bertrain.pipeline.recipe import Recipe, TaskSection
from bertrain.pipeline.verdict import decide
from bertrain.tasks.glue import get_task
from bertrain.tasks.metrics import PRIMARY_METRIC

# The figures of Devlin et al. 2019 (BERT), in the units our metrics use (GLUE: fractions; SQuAD: percent).
# GLUE: Table 1, the GLUE server's TEST sets (we score dev: a dev score is usually a point or two higher).
# SQuAD v1.1: Table 2, dev, single model; SQuAD v2.0: Table 3, dev, single model (BERT-large only).
PAPER_SOURCE = {"glue": "BERT paper, Table 1 (GLUE test server)", "squad": "BERT paper, Tables 2-3 (dev)"}
BERT_PAPER: dict[tuple[str, str, str], float] = {
    ("base", "mnli-m", "accuracy"): 0.846, ("base", "mnli-mm", "accuracy"): 0.834, ("base", "qqp", "f1"): 0.712,
    ("base", "qnli", "accuracy"): 0.905, ("base", "sst2", "accuracy"): 0.935, ("base", "cola", "mcc"): 0.521,
    ("base", "stsb", "spearmanr"): 0.858, ("base", "mrpc", "f1"): 0.889, ("base", "rte", "accuracy"): 0.664,
    ("large", "mnli-m", "accuracy"): 0.867, ("large", "mnli-mm", "accuracy"): 0.859, ("large", "qqp", "f1"): 0.721,
    ("large", "qnli", "accuracy"): 0.927, ("large", "sst2", "accuracy"): 0.949, ("large", "cola", "mcc"): 0.605,
    ("large", "stsb", "spearmanr"): 0.865, ("large", "mrpc", "f1"): 0.893, ("large", "rte", "accuracy"): 0.701,
    ("base", "squad1.1", "exact_match"): 80.8, ("base", "squad1.1", "f1"): 88.5,
    ("large", "squad1.1", "exact_match"): 84.1, ("large", "squad1.1", "f1"): 90.9,
    ("large", "squad2.0", "exact"): 78.7, ("large", "squad2.0", "f1"): 81.9,
}

# The metrics shown per GLUE task beside its primary one (PRIMARY_METRIC, shown first).
OTHER_GLUE_METRICS = {"mrpc": ("accuracy",), "qqp": ("accuracy",), "stsb": ("spearmanr",)}


def _primary(task: str) -> str:
    return PRIMARY_METRIC.get(task, "accuracy")


def _spread(values: dict[str, float]) -> dict[str, Any]:
    """Mean, sample sd, min and max over seeds. A seed that scored NaN or inf (e.g. the Pearson correlation of
    constant predictions) makes every one of them NaN — `statistics.stdev` raised AttributeError on it, and min/max
    depended on the order of the seeds — and `not_finite` counts such seeds."""
    v = list(values.values())
    bad = sum(not math.isfinite(x) for x in v)
    if bad:
        return {"seeds": values, "mean": math.nan, "std": math.nan, "min": math.nan, "max": math.nan,
                "not_finite": bad}
    return {"seeds": values, "mean": statistics.fmean(v), "std": statistics.stdev(v) if len(v) > 1 else 0.0,
            "min": min(v), "max": max(v)}


def _scores(kind: str, results: dict[str, Any]) -> dict[tuple[str, str], float]:
    """(split, metric) -> value of one eval_results.json."""
    if kind == "squad":
        split = f"squad{results.get('version', '1.1')}"
        keys = ("exact", "f1") if results.get("version") == "2.0" else ("exact_match", "f1")
        return {(split, k): float(results[k]) for k in keys if k in results}
    out = {}
    for split, m in results.items():
        if isinstance(m, dict) and "examples" in m:  # an evaluation split: dev (MNLI: mnli-m, mnli-mm)
            for metric in (_primary(results["task"]), *OTHER_GLUE_METRICS.get(results["task"], ())):
                if metric in m:
                    out[(split, metric)] = float(m[metric])
    return out


def _paper_key(kind: str, task: str, split: str) -> str:
    """The task/split name of BERT_PAPER: the GLUE task for its dev split, else the split (mnli-m, squad1.1)."""
    return task if kind == "glue" and split == "dev" else split


def _positive_class_f1(predictions_tsv: Path, positive: str) -> float | None:
    """F1 of always predicting the positive class: precision = its share p of the dev labels, recall 1, so
    2p / (1 + p). The labels are read from run_glue's dev predictions file (None when it is absent)."""
    try:
        lines = predictions_tsv.read_text(encoding="utf-8").splitlines()[1:]  # index, prediction, label, text...
    except OSError:
        return None
    labels = [line.split("\t")[2] for line in lines if line]
    p = sum(label == positive for label in labels) / len(labels) if labels else 0.0
    return 2 * p / (1 + p)


def _chance(metric: str, task: str, split: str, majority: float | None, results: dict[str, Any],
            out_dir: Path) -> tuple[float | None, str]:
    """(the score of a model that learned nothing, what that model does); the level is None when unknown."""
    if metric in ("mcc", "pearson", "spearmanr"):
        return 0.0, "no correlation"
    if metric == "accuracy":
        return majority, "majority class"
    if task == "squad":  # answering nothing: F1 0 in v1.1; in v2.0 each unanswerable question scores 1
        return 100.0 * results.get("NoAns_total", 0) / results.get("total", 1), "no answer"
    return _positive_class_f1(out_dir / f"{split}_predictions.tsv", get_task(task).labels[1]), "always positive"


def search_summary(task: TaskSection, run_dir: Path) -> dict[str, Any] | None:
    """Each initialisation's trials (settings, dev curve and value, pruned or not) and the settings chosen."""
    if task.search is None:
        return None
    by_init = {}
    for init in ("pretrained", "random") if task.random_init else ("pretrained",):
        trials = [json.loads((run_dir / search.trial_stage_name(task.name, init, k) / search.TRIAL_FILE)
                             .read_text(encoding="utf-8")) for k in range(1, search.n_trials(task.search) + 1)]
        best = search.best_trial(trials, trials[0]["maximise"])
        by_init[init] = {"metric": best["metric"], "maximise": best["maximise"], "seed": best["seed"],
                         "chosen": best["trial"], "params": best["params"], "value": best["value"], "trials": trials}
    return {"method": "grid" if task.search.grid else f"optuna {task.search.optuna.sampler}",
            "pruner": task.search.pruner.name, "keys": search.search_keys(task.search), "by_init": by_init}


def summarize(recipe: Recipe, run_dir: Path) -> dict[str, Any]:
    """results.json of the evaluate stage (see the module docstring)."""
    tasks = []
    for task in recipe.finetune:
        per: dict[tuple[str, str], dict[str, dict[str, float]]] = {}
        baselines: dict[str, float] = {}
        examples: dict[str, int] = {}
        final_model: dict[str, Any] | None = None  # how each run chose its final model (the same for every run)
        inits = ("pretrained", "random") if task.random_init else ("pretrained",)
        for init in inits:
            for seed in task.seeds:
                path = run_dir / f"finetune-{task.name}-{init}-s{seed}" / "out" / "eval_results.json"
                results = json.loads(path.read_text(encoding="utf-8"))
                task_name = "squad" if task.kind == "squad" else results["task"]
                dev_counts = results  # what every run of the task shares: SQuAD v2.0's count of unanswerables
                if "selection" in results:
                    final_model = {**{k: results["selection"][k] for k in ("metric", "final")},
                                   **(final_model or {})}
                    # early stopping or eval.target: a dev evaluation decided where the run stopped, so even its
                    # last model was chosen on dev (before, the report said the dev set did not choose it)
                    reason = results["selection"].get("stop_reason")
                    if reason:
                        final_model.setdefault("stopped_on_dev", {})[f"{init} seed {seed}"] = reason
                for key, value in _scores(task.kind, results).items():
                    per.setdefault(key, {}).setdefault(init, {})[str(seed)] = value
                for split, m in results.items():
                    if isinstance(m, dict) and "examples" in m:
                        examples[split] = m["examples"]
                        if "majority_baseline_accuracy" in m:
                            baselines[split] = m["majority_baseline_accuracy"]
                if task.kind == "squad":
                    examples[f"squad{results.get('version', '1.1')}"] = results.get("eval_examples")
        metrics = []
        for (split, metric), by_init in per.items():
            glue_task = get_task((task.config.get("data") or {}).get("task", "")).name if task.kind == "glue" else ""
            paper = BERT_PAPER.get((recipe.report.paper_model or "", _paper_key(task.kind, glue_task, split), metric))
            metrics.append({"split": split, "metric": metric, "examples": examples.get(split),
                            "by_init": {init: _spread(v) for init, v in by_init.items()},
                            "majority_baseline": baselines.get(split) if metric == "accuracy" else None,
                            "paper": paper, "paper_model": recipe.report.paper_model if paper is not None else None,
                            "paper_source": PAPER_SOURCE["squad" if task.kind == "squad" else "glue"]
                            if paper is not None else None})
        # the verdict: the primary metric of each evaluation split (MNLI: matched and mismatched)
        verdicts = []
        for m in metrics:
            if m["metric"] == _primary(task_name):
                seeds = {init: list(s["seeds"].values()) for init, s in m["by_init"].items()}
                chance, source = _chance(m["metric"], task_name, m["split"], m["majority_baseline"], dev_counts,
                                         run_dir / f"finetune-{task.name}-pretrained-s{task.seeds[0]}" / "out")
                v = decide(seeds.get("pretrained", []), seeds.get("random", []), chance, source,
                           points_per_unit=1.0 if task.kind == "squad" else 100.0)
                verdicts.append({"split": m["split"], "metric": m["metric"], **dataclasses.asdict(v)})
        tasks.append({"name": task.name, "kind": task.kind, "seeds": list(task.seeds), "metrics": metrics,
                      "verdicts": verdicts, "final_model": final_model, "search": search_summary(task, run_dir)})
    return {"tasks": tasks}
