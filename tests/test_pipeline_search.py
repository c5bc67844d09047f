"""The fine-tuning search of `bertrain run` (bertrain.pipeline.search): its recipe schema (errors name the recipe
key), its stages (trials on the first seed per initialisation, then every seed with the chosen settings), Optuna's
sampler and pruner on studies rebuilt from the finished trials, a pruned trial recorded as pruned, and a 2-trial
grid on a small real pipeline run that picks the better trial and reports it."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from bertrain.config import load_config
from bertrain.pipeline import search
from bertrain.pipeline.recipe import load_recipe
from bertrain.pipeline.stages import WAITS_FOR_SEARCH, build_stages, plan
from bertrain.utils.errors import UserError
from distributed import REPO, cli_env
from helpers import finetune_data, save_tiny_model

DEFAULT = REPO / "configs" / "recipes" / "pydoc-small.yaml"
GRID = {"grid": {"optim.lr": [5.0e-5, 3.0e-5], "train.epochs": [2, 3]}}


def recipe(tmp_path: Path, search_section: dict | None, *overrides: str, **task):
    data = yaml.safe_load(DEFAULT.read_text(encoding="utf-8"))
    data["output_dir"] = str(tmp_path / "run")
    data["finetune"][0].update(task)
    if search_section is not None:
        data["finetune"][0]["search"] = search_section
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    return load_recipe(path, list(overrides))


# ----------------------------------------------------------------------------------------------- stages

def test_a_grid_runs_its_trials_on_the_first_seed_per_init_then_every_seed_with_the_chosen_settings(tmp_path):
    stages = {s.name: s for s in build_stages(recipe(tmp_path, GRID, seeds=[1, 2]))}
    names = list(stages)
    for init in ("pretrained", "random"):
        trials = [f"search-pydoc-topics-{init}-t{k}" for k in (1, 2, 3, 4)]
        runs = [f"finetune-pydoc-topics-{init}-s{s}" for s in (1, 2)]
        assert [n for n in names if f"-{init}-" in n] == trials + runs
        # trial k is the k-th grid point (the first key varies slowest), on seed 1, and depends on trial k-1
        got = [(stages[t].config.optim.lr, stages[t].config.train.epochs, stages[t].config.seed) for t in trials]
        assert got == [(5e-5, 2.0, 1), (5e-5, 3.0, 1), (3e-5, 2.0, 1), (3e-5, 3.0, 1)]
        assert [stages[t].deps[-1] for t in trials[1:]] == trials[:-1]
        for r in runs:  # the seeds wait for every trial of their own initialisation; settings known only then
            assert set(trials) <= set(stages[r].deps) and stages[r].resolve is not None
            assert not any(f"-{other}-t" in d for d in stages[r].deps
                           for other in {"pretrained", "random"} - {init})
    decisions = plan(list(stages.values()))
    assert decisions["search-pydoc-topics-random-t3"].action == "run"
    assert decisions["finetune-pydoc-topics-random-s2"] == decisions["finetune-pydoc-topics-pretrained-s1"]
    assert decisions["finetune-pydoc-topics-random-s2"].reason == WAITS_FOR_SEARCH


def test_finished_trials_are_kept_when_a_value_is_appended_to_the_grid(tmp_path):
    before = {s.name: s.hash for s in build_stages(recipe(tmp_path, GRID))}
    more = {"grid": {"optim.lr": [5.0e-5, 3.0e-5, 2.0e-5], "train.epochs": [2, 3]}}
    after = {s.name: s.hash for s in build_stages(recipe(tmp_path, more))}
    trials = [f"search-pydoc-topics-pretrained-t{k}" for k in (1, 2, 3, 4)]
    assert [after[t] for t in trials] == [before[t] for t in trials]
    assert "search-pydoc-topics-pretrained-t6" in after and "search-pydoc-topics-pretrained-t5" not in before
    pruned = {"grid": GRID["grid"], "pruner": {"name": "median"}}  # a pruner changes what a trial does
    assert {s.name: s.hash for s in build_stages(recipe(tmp_path, pruned))}[trials[0]] != before[trials[0]]


def test_optuna_trials_wait_for_the_earlier_ones_and_every_candidate_is_checked_first(tmp_path):
    section = {"optuna": {"trials": 3, "sampler": "random", "params": {
        "optim.lr": {"low": 1.0e-5, "high": 1.0e-3, "log": True}, "train.global_batch_size": {"choices": [16, 32]}}}}
    stages = {s.name: s for s in build_stages(recipe(tmp_path, section, random_init=False))}
    t1, t2 = stages["search-pydoc-topics-pretrained-t1"], stages["search-pydoc-topics-pretrained-t2"]
    assert t1.resolve is not None and t2.deps[-1] == t1.name
    # each choice and each range end was built into a config: the batch check sees them all
    assert sorted({v.train.global_batch_size for v in t1.variants}) == [16, 32]
    assert sorted({v.optim.lr for v in t1.variants}) == [1e-5, 5e-4, 1e-3]  # 5e-4: the recipe's own lr


@pytest.mark.parametrize("section, key", [
    ({"grid": {"optim.lr": [1e-4]}, "optuna": {"trials": 2, "params": {"optim.lr": {"choices": [1e-4]}}}},
     "recipe key 'finetune[0].search' needs exactly one of"),
    ({}, "recipe key 'finetune[0].search' needs exactly one of"),
    ({"grid": {"optim.lr": 1e-4}}, "recipe key 'finetune[0].search.grid.optim.lr': expected a non-empty list"),
    ({"grid": {"optim.lr": [1e-4, 1e-4]}}, "recipe key 'finetune[0].search.grid.optim.lr' lists a value twice"),
    ({"grid": {"seed": [1, 2]}}, "recipe key 'finetune[0].search.grid.seed' cannot be searched"),
    ({"grid": {"eval.final": ["best", "last"]}}, "recipe key 'finetune[0].search.grid.eval.final' cannot be"),
    ({"grid": {"optim.lrr": [1e-4]}}, "recipe key 'finetune[0].search.grid.optim.lrr'"),
    ({"grid": {"optim.lr": ["fast"]}}, "recipe key 'finetune[0].search.grid.optim.lr': expected float"),
    ({"grid": {"optim.lr": [1e-4]}, "pruner": {"name": "hyperband"}}, "recipe key 'finetune[0].search.pruner.name'"),
    ({"grid": {"optim.lr": [1e-4]}, "pruner": {"startup_trials": 0}},
     "recipe key 'finetune[0].search.pruner.startup_trials' must be >= 1"),
    ({"grid": {"optim.lr": [1e-4]}, "sampler": "tpe"}, "recipe key 'finetune[0].search.sampler'"),
    ({"optuna": {"trials": 0, "params": {"optim.lr": {"choices": [1e-4]}}}},
     "recipe key 'finetune[0].search.optuna.trials' must be >= 1"),
    ({"optuna": {"trials": 2, "params": {"optim.lr": {"low": 1e-3, "high": 1e-4}}}},
     "recipe key 'finetune[0].search.optuna.params.optim.lr': 'low' (0.001) must be below 'high'"),
    ({"optuna": {"trials": 2, "params": {"optim.lr": {"low": 0.0, "high": 1e-4, "log": True}}}},
     "recipe key 'finetune[0].search.optuna.params.optim.lr.log': a log scale needs low > 0"),
    ({"optuna": {"trials": 2, "params": {"optim.lr": {"choices": [1e-4], "low": 1e-5}}}},
     "recipe key 'finetune[0].search.optuna.params.optim.lr': give either 'choices' or a range"),
    ({"optuna": {"trials": 2, "params": {"optim.lr": {"lowest": 1e-5}}}},
     "recipe key 'finetune[0].search.optuna.params.optim.lr.lowest'"),
    ({"optuna": {"trials": 2, "params": {"train.global_batch_size": {"low": 16.5, "high": 32}}}},
     "recipe key 'finetune[0].search.optuna.params.train.global_batch_size': expected int"),
])
def test_bad_searches_are_refused_naming_the_recipe_key(tmp_path, section, key):
    with pytest.raises(UserError) as e:
        build_stages(recipe(tmp_path, section))
    assert key in str(e.value)


# ----------------------------------------------------------------------------------------------- Optuna

def spec(pruner: dict | None = None, **optuna) -> search.SearchSection:
    section = search.SearchSection(optuna=search.OptunaSection(**{"trials": 6, "params": {
        "optim.lr": {"low": 1e-5, "high": 1e-3, "log": True}, "train.steps": {"low": 10, "high": 40},
        "optim.name": {"choices": ["adamw", "lamb"]}}, **optuna}), pruner=search.PrunerSection(**(pruner or {})))
    search.check_search(section, "search")
    return section


def record(k: int, params: dict, curve: list[float], state: str = "complete") -> dict:
    return {"trial": k, "params": params, "state": state, "value": curve[-1], "curve": curve, "seed": 1,
            "metric": "accuracy", "maximise": True}


@pytest.mark.parametrize("sampler", ["tpe", "random"])
def test_trial_k_parameters_are_a_seeded_function_of_the_finished_trials(sampler):
    s = spec(sampler=sampler, startup_trials=2)
    done: list[dict] = []
    for k in range(1, 5):
        params = search.trial_params(s, done, k, True, {"train.steps"})
        assert params == search.trial_params(s, done, k, True, {"train.steps"})  # what a resumed run recomputes
        assert 1e-5 <= params["optim.lr"] <= 1e-3 and isinstance(params["train.steps"], int)
        assert params["optim.name"] in ("adamw", "lamb")
        done.append(record(k, params, [0.5 + 0.1 * k]))
    assert len({json.dumps(r["params"], sort_keys=True) for r in done}) == 4
    other = search.trial_params(spec(sampler=sampler, startup_trials=2, seed=7), done[:3], 4, True, {"train.steps"})
    assert other != search.trial_params(s, done[:3], 4, True, {"train.steps"})


def test_the_median_pruner_compares_the_running_curve_with_the_finished_trials():
    s = spec({"name": "median", "startup_trials": 2, "min_evals": 1})
    p = {"optim.lr": 1e-4, "train.steps": 20, "optim.name": "adamw"}
    one = [record(1, p, [0.60, 0.70])]
    two = one + [record(2, p, [0.64, 0.80])]
    assert not search.should_prune(s, one, [0.10], True, {"train.steps"})  # fewer finished than startup_trials
    assert search.should_prune(s, two, [0.55], True, {"train.steps"})  # below the median (0.62) at evaluation 1
    assert not search.should_prune(s, two, [0.63], True, {"train.steps"})
    assert search.should_prune(s, two, [0.63, 0.66], True, {"train.steps"})  # below 0.75 at evaluation 2
    # a pruned trial is no finished trial for the median; minimising flips the comparison
    assert not search.should_prune(s, one + [record(2, p, [0.9], "pruned")], [0.1], True, {"train.steps"})
    assert not search.should_prune(s, two, [0.55], False, {"train.steps"})
    late = spec({"name": "median", "startup_trials": 2, "min_evals": 2})
    assert not search.should_prune(late, two, [0.10], True, {"train.steps"})


def test_the_choice_is_the_best_unpruned_trial_earliest_on_ties():
    p = {"optim.lr": 1e-4}
    trials = [record(1, p, [0.5]), record(2, p, [0.9], "pruned"), record(3, p, [0.7]), record(4, p, [0.7])]
    assert search.best_trial(trials, True)["trial"] == 3
    assert search.best_trial(trials, False)["trial"] == 1
    with pytest.raises(ValueError, match="no trial of the search finished"):
        search.best_trial([trials[1]], True)


def test_a_pruned_trial_stops_at_the_pruners_evaluation_and_is_recorded_as_pruned(tmp_path):
    """Trial 2 of a grid, for real (a tiny model, the RTE-like task, 3 epochs with a dev evaluation each), after a
    finished trial 1 whose dev accuracy was 1.0 at every evaluation: the median pruner stops it at its first."""
    from bertrain.pipeline.report import _search_tables
    from bertrain.pipeline.stages import Stage, _SearchPlan, _trial_work
    from bertrain.tasks.finetune import GlueFinetuneConfig

    model, data = save_tiny_model(tmp_path / "model"), finetune_data("glue", tmp_path / "data")
    s = search.SearchSection(grid={"optim.lr": [1e-3, 5e-4]}, pruner=search.PrunerSection("median", 1, 1))
    search.check_search(s, "search")
    names = ("search-rte-pretrained-t1", "search-rte-pretrained-t2")
    first = record(1, {"optim.lr": 1e-3}, [1.0, 1.0, 1.0])
    (tmp_path / names[0]).mkdir()
    (tmp_path / names[0] / search.TRIAL_FILE).write_text(json.dumps(first))
    folder = tmp_path / names[1]
    cfg = load_config(GlueFinetuneConfig, base={
        "init": str(model), "output_dir": str(folder / "out"), "seed": 1, "eval_batch_size": 8,
        "data": {"task": "rte", "data_dir": str(data), "max_seq_length": 32, "predict_test": False},
        "train": {"epochs": 3, "micro_batch_size": 4, "log_interval": 1}, "optim": {"lr": 5e-4}})
    stage = Stage(names[1], "trial 2", True, (names[0],), {"search.params": {"optim.lr": 5e-4}}, {}, (), None,
                  folder=folder, config=cfg)
    _trial_work("glue", _SearchPlan(s, "search.grid", True, frozenset(), names, ()), 2, stage, None)

    rec = json.loads((folder / search.TRIAL_FILE).read_text())
    selection = json.loads((folder / "out" / "eval_results.json").read_text())["selection"]
    assert rec["state"] == "pruned" and rec["pruned"]["evaluation"] == 1 and len(rec["curve"]) == 1
    assert rec["curve"][0] < 1.0 and rec["params"] == {"optim.lr": 5e-4}
    assert selection["steps_run"] == 10 and selection["stop_reason"].startswith("stopped by the search")
    assert search.best_trial([first, rec], True)["trial"] == 1
    results = {"tasks": [{"name": "rte", "kind": "glue", "search": {"by_init": {"pretrained": {
        "trials": [first, rec], "chosen": 1, "params": first["params"], "value": 1.0, "metric": "accuracy",
        "maximise": True, "seed": 1}}}}]}
    (caption, rows), = _search_tables(results)
    assert rows == [["1 (chosen)", "optim.lr=0.001", "100.0", "3", "complete"],
                    ["2", "optim.lr=0.0005", f"{100 * rec['value']:.1f}", "1", "pruned at evaluation 1"]]


# ----------------------------------------------------------------------------------------------- end to end

# The default recipe made small: a short pretraining, its 800 labelled examples for 2 epochs, one seed, pretrained only.
SMALL = ["phase1.train.steps=10", "phase2.train.steps=2", "finetune[0].seeds=[1]", "finetune[0].random_init=false",
         "finetune[0].config.data.max_train_examples=800", "finetune[0].config.train.epochs=2",
         "finetune[0].search={grid: {optim.lr: [1.0e-6, 2.0e-3]}}"]


@pytest.mark.slow
def test_a_two_trial_grid_picks_the_better_trial_runs_it_and_reports_it(tmp_path):
    out = tmp_path / "run"
    sets = [f"output_dir={out}", *SMALL]
    r = subprocess.run([sys.executable, "-m", "bertrain", "run", str(DEFAULT)] + [a for s in sets for a in ("--set", s)],
                       env=cli_env(), cwd=REPO, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    trials = [json.loads((out / f"search-pydoc-topics-pretrained-t{k}" / search.TRIAL_FILE).read_text())
              for k in (1, 2)]
    assert [t["params"]["optim.lr"] for t in trials] == [1e-6, 2e-3]
    assert all(t["state"] == "complete" and len(t["curve"]) == 2 for t in trials)
    # lr 1e-6 barely moves the model in 50 steps; 2e-3 does: the trials differ, and the better one is chosen
    assert trials[1]["value"] > trials[0]["value"]
    final = out / "finetune-pydoc-topics-pretrained-s1"
    assert yaml.safe_load((final / "stage-config.yaml").read_text())["optim"]["lr"] == 2e-3
    own = json.loads((final / "out" / "eval_results.json").read_text())
    assert own["dev"]["accuracy"] == trials[1]["value"]  # seed 1 with the chosen settings repeats trial 2 exactly
    (task,) = json.loads((out / "evaluate" / "results.json").read_text())["tasks"]
    assert task["search"]["by_init"]["pretrained"]["chosen"] == 2
    md = (out / "report" / "report.md").read_text()
    assert "the fine-tuning settings were chosen on the dev set" in md and "optimistic" in md
    assert "| 2 (chosen) | optim.lr=0.002 |" in md and "| 1 | optim.lr=1e-06 |" in md
    assert "](finetune-pydoc-topics.svg)" in md and "held-out" in md
    # run again: the trials' records give the same choice, so the same hashes: nothing to do
    decisions = plan(build_stages(load_recipe(DEFAULT, sets)))
    assert {d.action for d in decisions.values()} == {"skip"}
