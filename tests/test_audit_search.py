"""Audit of evaluation while training, the best model, early stopping and `bertrain run`'s dev-chosen settings:
each test fails without its fix (see the report of the audit)."""
from __future__ import annotations

import logging
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from bertrain.train.config import EvalConfig
from bertrain.train.distributed import DistInfo
from bertrain.train.evaluation import Evaluator


class _ScriptedTask:
    """A task whose dev evaluations return the scripted values of its selection metric, in order."""

    primary_metric = "pearson"

    def __init__(self, values: list[float]) -> None:
        self.values = list(values)

    def evaluate(self, model, dist, precision):
        return {"pearson": self.values.pop(0)}


def _evaluator(tmp_path: Path, values: list[float], **cfg) -> Evaluator:
    dist = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), is_main=True)
    return Evaluator(EvalConfig(interval=1, **cfg), _ScriptedTask(values), dist, None, tmp_path / "out",
                     total_steps=len(values), steps_per_epoch=len(values))


def test_nan_evaluations_before_any_best_log_and_stop_early_without_a_crash(tmp_path, caplog):
    # STS-B's Pearson correlation of constant predictions is NaN: with eval.patience the stop message formatted the
    # missing best as a number (TypeError out of the training loop), and every such evaluation's log line was a
    # "--- Logging error ---" traceback
    ev = _evaluator(tmp_path, [math.nan, math.nan, 0.5], patience=2, final="last")
    model = nn.Linear(2, 2)
    with caplog.at_level(logging.INFO, logger="bertrain.train.evaluation"):
        first = ev.evaluate(model, 1, 0)
        ev.evaluate(model, 2, 0)
        messages = [r.getMessage() for r in caplog.records]  # a bad format raises here
    assert first["improved"] is False and first["best_step"] is None
    assert ev.history.stop_reason == ("early stopping: 2 evaluations without an improvement of pearson by more than "
                                      "eval.min_delta = 0 (eval.patience = 2; no best yet: every evaluation so far "
                                      "scored NaN or inf)")
    assert "no best yet" in messages[0] and len(messages) == 2
    assert ev.summary()["best_step"] is None


# ----------------------------------------------------------------------------------------------- the search

def _recipe(tmp_path: Path, grid: dict):
    import yaml

    from bertrain.pipeline.recipe import load_recipe
    from distributed import REPO

    data = yaml.safe_load((REPO / "configs" / "recipes" / "pydoc-small.yaml").read_text(encoding="utf-8"))
    data["output_dir"] = str(tmp_path / "run")
    data["finetune"][0]["search"] = {"grid": grid}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    return load_recipe(path, [])


def test_a_value_added_to_a_later_grid_key_keeps_the_trials_already_run(tmp_path):
    # before: trial k was always the k-th grid point, so epochs [2, 3] -> [2, 3, 4] moved (3e-5, 2) from trial 3 to
    # trial 4 and (3e-5, 3) from 4 to 5: both finished trials ran again under new numbers
    import json

    from bertrain.pipeline.stages import build_stages

    first = build_stages(_recipe(tmp_path, {"optim.lr": [5.0e-5, 3.0e-5], "train.epochs": [2, 3]}))
    trials = [s for s in first if s.name.startswith("search-pydoc-topics-pretrained-t")]
    for s in trials:  # the first run started (here: as good as finished) every trial
        s.folder.mkdir(parents=True)
        (s.folder / "stage-started.json").write_text(json.dumps({"hash": s.hash, "parts": s.parts}))
    again = {s.name: s for s in build_stages(_recipe(tmp_path, {"optim.lr": [5.0e-5, 3.0e-5],
                                                                "train.epochs": [2, 3, 4]}))}
    assert [again[s.name].hash for s in trials] == [s.hash for s in trials]
    new = [again[f"search-pydoc-topics-pretrained-t{k}"].config for k in (5, 6)]
    assert [(c.optim.lr, c.train.epochs) for c in new] == [(5e-5, 4), (3e-5, 4)]


def test_stable_grid_points_keep_the_started_prefix_and_list_every_point_once():
    from bertrain.pipeline import search

    grid = search.parse_search({"grid": {"a": [1, 2], "b": ["x", "y", "z"]}}, "s")
    points = search.grid_points(grid)
    started = [{"a": 1, "b": "x"}, {"a": 1, "b": "y"}, {"a": 2, "b": "x"}, {"a": 2, "b": "y"}]
    got = search.stable_grid_points(grid, started)
    assert got[:4] == started and got[4:] == [{"a": 1, "b": "z"}, {"a": 2, "b": "z"}]
    # a started point no longer in the grid (a value removed) ends the kept run; nothing started: the grid order
    assert search.stable_grid_points(grid, [{"a": 1, "b": "x"}, {"a": 3, "b": "x"}, {"a": 1, "b": "z"}]) == points
    assert search.stable_grid_points(grid, [None, None]) == points
    assert sorted(map(repr, got)) == sorted(map(repr, points))


# ----------------------------------------------------------------------------------------------- the report

def test_the_verdict_line_says_no_number_for_a_side_with_a_nan_seed():
    import dataclasses

    from bertrain.pipeline.report import _verdict_line
    from bertrain.pipeline.verdict import decide

    v = decide([math.nan, 0.8], [0.7, 0.72], 0.68, "majority class")
    line = _verdict_line({"name": "mrpc", "kind": "glue"}, {"split": "dev", "metric": "f1", **dataclasses.asdict(v)})
    assert line == ("mrpc (f1): inconclusive (1 pretrained seed scored no number (NaN or inf)); pretrained no "
                    "number, random 71.0, chance 68.0 (majority class)")
    assert "nan" not in line.replace("NaN", "")


def _log(step: int, seq_per_s: float, elapsed_s: float) -> str:
    import json

    return json.dumps({"step": step, "loss": 0.5, "seq_per_s": seq_per_s, "elapsed_s": elapsed_s})


def test_a_resumed_finetune_stage_reports_the_throughput_of_every_attempt_and_squad_counts_examples(tmp_path):
    # before: the stage took the engine's train_examples_per_second, which covers the last attempt of a resumed
    # run only (10 of 40 steps here, dev evaluations included), and for SQuAD counts windows as examples
    from bertrain.pipeline.report import _throughput
    from bertrain.pipeline.stages import _run_summary

    rows = [_log(10, 100.0, 4.0), _log(20, 100.0, 4.0), _log(30, 100.0, 4.0),  # the first attempt, to step 30
            '{"step": 30, "event": "eval", "metrics": {"f1": 0.5}}', _log(40, 50.0, 8.0)]  # the resumed one
    (tmp_path / "metrics.jsonl").write_text("\n".join(rows) + "\n", encoding="utf-8")
    glue = {"train_steps": 40, "train_seconds": 30.0, "train_examples_per_second": 13.3}  # the last attempt's
    s = _run_summary(glue, tmp_path)
    assert s["train_examples_per_second"] == pytest.approx((3 * 400 + 400) / 20.0)  # 1600 examples in 20 s
    assert s["train_seconds"] == 20.0 and s["train_steps"] == 40
    assert _throughput("finetune-mrpc-pretrained-s1", s, 0) == "80.0 examples/s (40 steps)"
    squad = {**glue, "train_examples": 100, "train_features": 125}
    s = _run_summary(squad, tmp_path)
    assert _throughput("finetune-squad-pretrained-s1", s, 0) == "64.0 examples/s (80.0 windows/s, 40 steps)"
    assert _run_summary(glue, tmp_path / "absent")["train_examples_per_second"] == 13.3  # no log: the engine's
