"""Fine-tuning settings chosen on the dev set, as the BERT paper chose its learning rate and epochs: a recipe
task's `search`, its trials, the pruner, and the choice.

A task (`recipe.TaskSection`) may give one search, with dotted `bertrain finetune` keys:

    search:
      grid:                                # every combination; trial k is the k-th in order (the last key varies
        optim.lr: [5.0e-5, 3.0e-5, 2.0e-5] # fastest; a value added later keeps the started trials' numbers)
        train.epochs: [2, 3, 4]
      pruner: {name: median}               # optional: stop a trial whose dev curve is below the others' median

    search:
      optuna:                              # Optuna's sampler proposes each trial from the finished ones
        trials: 12
        sampler: tpe                       # tpe | random
        params:
          optim.lr: {low: 1.0e-5, high: 1.0e-4, log: true}
          train.epochs: {choices: [2, 3, 4]}
          train.global_batch_size: {choices: [16, 32]}
      pruner: {name: median, startup_trials: 2, min_evals: 1}

The objective of a trial is the dev value of the run's selection metric (`eval.metric`, by default the task's
primary metric) for the model the run ends with (`eval.final`). The pruner is Optuna's `MedianPruner`, fed by the
run's dev evaluations through `run_glue`/`run_squad`'s `on_eval`, one report per evaluation (its k-th evaluation is
Optuna's step k, so trials with other batch sizes still compare epoch with epoch).

Resumable and deterministic: each trial is a stage of `bertrain run`. The study is never stored; it is rebuilt from
the finished trials' records (trial.json in each trial's folder) whenever it is needed, and trial k's sampler is
seeded with `seed + k`, so trial k's parameters are a pure function of the recipe and of trials 1..k-1. A killed
pipeline therefore skips the finished trials and resumes the cut one (the engine's `--resume auto`); a pruning
decision is recomputed from the records the same way on resume.

This module is pure apart from Optuna: recipe sections in, parameters, pruning decisions and the choice out.
`bertrain.pipeline.stages` turns trials into stages.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from bertrain.config import flatten, from_dict

TRIAL_FILE = "trial.json"
PRUNED_FILE = "pruned.json"

# Keys a search may not vary (the pipeline's own; the selection rule itself, which would make trials incomparable;
# the process group every stage shares; the task's data, hashed once per task).
FIXED_KEYS = ("init", "output_dir", "seed", "eval", "distributed", "do_train", "do_eval", "data.task",
              "data.data_dir", "data.train_file", "data.dev_file")


@dataclass
class ParamRange:
    """The values Optuna may propose for one key: `choices`, or a range `low`..`high`."""

    choices: Optional[list[Any]] = None
    """Pick one of these values (numbers, strings or booleans)."""
    low: Optional[float] = None
    """Smallest value of the range (integer-valued keys such as train.global_batch_size: a whole number)."""
    high: Optional[float] = None
    """Largest value of the range."""
    log: bool = False
    """Sample on a log scale (learning rates); needs low > 0."""
    step: Optional[float] = None
    """Only values low, low + step, ... (none: any value in the range)."""


@dataclass
class OptunaSection:
    trials: int = 0
    """How many trials to run (pruned ones included)."""
    sampler: Literal["tpe", "random"] = "tpe"
    """How trial k's parameters are proposed: TPE (models the finished trials) or uniformly at random."""
    startup_trials: int = 4
    """TPE: the first trials are drawn at random before TPE models the finished ones (Optuna's n_startup_trials)."""
    seed: int = 0
    """Trial k's sampler is seeded with seed + k: its parameters depend only on the finished trials."""
    params: dict[str, Any] = field(default_factory=dict)
    """Dotted `bertrain finetune` keys -> {choices: [...]} or {low, high, log, step}."""


@dataclass
class PrunerSection:
    name: Literal["none", "median"] = "none"
    """median: Optuna's MedianPruner stops a trial whose best dev value so far is worse than the median of the
    finished trials' values at the same evaluation; none: every trial runs to its end."""
    startup_trials: int = 2
    """No pruning until this many trials have finished unpruned (at least 1: there is then always a finished trial
    to choose). Fine-tuning searches are short, so the default is lower than Optuna's 5."""
    min_evals: int = 1
    """A trial is pruned at its min_evals-th dev evaluation at the earliest (1: from its first)."""


@dataclass
class SearchSection:
    """One of `grid` or `optuna`, and the pruner."""

    grid: dict[str, Any] = field(default_factory=dict)
    """Dotted `bertrain finetune` keys -> lists of values: every combination is a trial."""
    optuna: Optional[OptunaSection] = None
    """An Optuna search: its number of trials, sampler and parameter ranges."""
    pruner: PrunerSection = field(default_factory=PrunerSection)
    """Stop unpromising trials early (Optuna's MedianPruner) or not."""


# ----------------------------------------------------------------------------------------------- the schema

def parse_search(data: Any, key: str) -> SearchSection:
    """A recipe's search section, checked (ValueError naming the full recipe key)."""
    # from_dict reports an error inside an Optional section as "expected Optional[...]": build the optuna section
    # on its own first, so its errors name their key
    if isinstance(data, dict) and isinstance(data.get("optuna"), dict):
        from_dict(OptunaSection, data["optuna"], prefix=f"{key}.optuna")
    section = from_dict(SearchSection, data, prefix=key)
    check_search(section, key)
    return section


def check_search(search: SearchSection, key: str) -> None:
    """Check a search section (`key` is its recipe key, e.g. "finetune[0].search"); ParamRange mappings are
    converted in place. Raises ValueError naming the full recipe key. The values themselves are checked by building
    the fine-tuning configs they give (`bertrain.pipeline.stages`)."""
    search.grid = flatten(search.grid)  # `optim: {lr: [...]}` (as --set writes it) is `optim.lr: [...]`
    if bool(search.grid) == (search.optuna is not None):
        raise ValueError(f"config key '{key}' needs exactly one of 'grid' (lists of values) or 'optuna' (trials, "
                         "params)")
    if search.grid:
        for name, values in search.grid.items():
            _check_name(name, f"{key}.grid")
            if not isinstance(values, list) or not values:
                raise ValueError(f"config key '{key}.grid.{name}': expected a non-empty list of values, got "
                                 f"{values!r}")
            _check_values(values, f"{key}.grid.{name}")
    else:
        o = search.optuna
        if o.trials < 1:
            raise ValueError(f"config key '{key}.optuna.trials' must be >= 1, got {o.trials}")
        if o.startup_trials < 0:
            raise ValueError(f"config key '{key}.optuna.startup_trials' must be >= 0, got {o.startup_trials}")
        if not o.params:
            raise ValueError(f"config key '{key}.optuna.params' must name at least one key to search")
        for name, spec in list(o.params.items()):
            where = f"{key}.optuna.params.{name}"
            _check_name(name, f"{key}.optuna.params")
            r = spec if isinstance(spec, ParamRange) else from_dict(ParamRange, spec, prefix=where)
            _check_range(r, where)
            o.params[name] = r
    p = search.pruner
    if p.startup_trials < 1:
        raise ValueError(f"config key '{key}.pruner.startup_trials' must be >= 1 (a search needs a finished trial "
                         f"to choose), got {p.startup_trials}")
    if p.min_evals < 1:
        raise ValueError(f"config key '{key}.pruner.min_evals' must be >= 1, got {p.min_evals}")


def _check_name(name: str, where: str) -> None:
    if not isinstance(name, str) or not name:
        raise ValueError(f"config key '{where}': expected dotted `bertrain finetune` keys, got {name!r}")
    for k in FIXED_KEYS:
        if name == k or name.startswith(k + "."):
            raise ValueError(f"config key '{where}.{name}' cannot be searched (the pipeline sets it, or it is the "
                             "selection rule, the process group or the task's data)")


def _check_values(values: list[Any], where: str) -> None:
    for v in values:
        if not isinstance(v, (bool, int, float, str)):
            raise ValueError(f"config key '{where}': values must be numbers, strings or booleans, got {v!r}")
    if len({repr(v) for v in values}) != len(values):
        raise ValueError(f"config key '{where}' lists a value twice: {values}")


def _check_range(r: ParamRange, where: str) -> None:
    if r.choices is not None:
        if r.low is not None or r.high is not None or r.log or r.step is not None:
            raise ValueError(f"config key '{where}': give either 'choices' or a range ('low', 'high', 'log', "
                             "'step'), not both")
        if not r.choices:
            raise ValueError(f"config key '{where}.choices' must list at least one value")
        _check_values(r.choices, f"{where}.choices")
        return
    if r.low is None or r.high is None:
        raise ValueError(f"config key '{where}' needs 'choices', or both 'low' and 'high'")
    if not r.low < r.high:
        raise ValueError(f"config key '{where}': 'low' ({r.low:g}) must be below 'high' ({r.high:g})")
    if r.log and r.low <= 0:
        raise ValueError(f"config key '{where}.log': a log scale needs low > 0, got {r.low:g}")
    if r.step is not None and (r.step <= 0 or r.log):
        raise ValueError(f"config key '{where}.step' must be > 0 and cannot be combined with 'log'")


def search_keys(search: SearchSection) -> list[str]:
    return list(search.grid) if search.grid else list(search.optuna.params)


def n_trials(search: SearchSection) -> int:
    if search.grid:
        return math.prod(len(v) for v in search.grid.values())
    return search.optuna.trials


def grid_points(search: SearchSection) -> list[dict[str, Any]]:
    """Every combination of the grid, in order: the first key varies slowest (trial 1 = every key's first value)."""
    keys = list(search.grid)
    return [dict(zip(keys, values)) for values in itertools.product(*(search.grid[k] for k in keys))]


def stable_grid_points(search: SearchSection, started: list[Any]) -> list[dict[str, Any]]:
    """The grid's trials in order, the trials already started keeping their places: `started[k-1]` is the settings
    trial k ran (or began) with in an earlier run of the pipeline (None: none). The longest run of those from trial 1
    that are still grid points keeps its numbers; every other point follows in `grid_points` order. Before, trial k
    was always the k-th point, so a value added to any key but the first moved the points after it, and finished
    trials ran again under new numbers (lr [a, b] x epochs [2, 3] plus epochs 4: (b, 2) and (b, 3) ran twice)."""
    points = grid_points(search)
    kept: list[dict[str, Any]] = []
    for params in started:
        if not isinstance(params, dict) or params not in points or params in kept:
            break
        kept.append(params)
    kept = [next(p for p in points if p == params) for params in kept]  # the recipe's values, not the record's
    return kept + [p for p in points if p not in kept]


MAX_CHECKED_VALUES = 1024
"""An integer range of at most this many values has every value checked before any work (else its two ends)."""


def candidate_points(search: SearchSection, integer_keys: frozenset[str] | set[str] = frozenset()
                     ) -> list[dict[str, Any]]:
    """Settings to build and check before any work: every grid point, or each choice and each range end of an
    Optuna search (one key at a time); an integer-valued key's range (`integer_keys`), every value Optuna may
    propose (up to MAX_CHECKED_VALUES): before, only its ends were, so `train.global_batch_size: {low: 16, high:
    64}` passed the checks and its trial 1 (36: not a multiple of the micro-batch) failed after pretraining."""
    if search.grid:
        return grid_points(search)

    def values(name: str, r: ParamRange) -> list[Any]:
        if r.choices is not None:
            return list(r.choices)
        if name in integer_keys:
            every = range(int(r.low), int(r.high) + 1, int(r.step or 1))
            if len(every) <= MAX_CHECKED_VALUES:
                return list(every)
        return [r.low, r.high]

    return [{name: v} for name, r in search.optuna.params.items() for v in values(name, r)]


def needs_optuna(search: SearchSection) -> bool:
    """A grid without a pruner needs no library; everything else is Optuna's."""
    return search.optuna is not None or search.pruner.name != "none"


def trial_stage_name(task: str, init_kind: str, k: int) -> str:
    """The stage (and folder) of trial k (1-based) of `task`'s search from `init_kind` weights."""
    return f"search-{task}-{init_kind}-t{k}"


def describe(params: dict[str, Any]) -> str:
    """`optim.lr=3e-05, train.epochs=3`: a trial's settings in one line."""
    return ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in params.items())


# ----------------------------------------------------------------------------------------------- Optuna

def require_optuna(key: str = "search") -> Any:
    """The optuna module (imported here: only a search needs it), or ValueError naming the recipe key."""
    try:
        import optuna
    except ImportError:
        raise ValueError(f"config key '{key}': a search with an Optuna sampler or a pruner needs Optuna: "
                         "pip install 'bertrain[search]'") from None
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # the pipeline logs each trial itself
    return optuna


def distributions(search: SearchSection, integer_keys: set[str]) -> dict[str, Any]:
    """Optuna's distribution of each searched key (integer-valued engine keys get integer ranges)."""
    optuna = require_optuna()
    d = optuna.distributions
    if search.grid:
        return {k: d.CategoricalDistribution(v) for k, v in search.grid.items()}
    out = {}
    for name, r in search.optuna.params.items():
        if r.choices is not None:
            out[name] = d.CategoricalDistribution(r.choices)
        elif name in integer_keys:
            out[name] = d.IntDistribution(int(r.low), int(r.high), log=r.log, step=int(r.step or 1))
        else:
            out[name] = d.FloatDistribution(r.low, r.high, log=r.log, step=r.step)
    return out


def _study(search: SearchSection, finished: list[dict[str, Any]], maximise: bool, integer_keys: set[str],
           sampler: Any = None) -> Any:
    """An in-memory study holding the finished trials (their parameters, dev curves, values and states)."""
    optuna = require_optuna()
    p = search.pruner
    pruner = (optuna.pruners.MedianPruner(n_startup_trials=p.startup_trials, n_warmup_steps=p.min_evals)
              if p.name == "median" else optuna.pruners.NopPruner())
    study = optuna.create_study(direction="maximize" if maximise else "minimize", sampler=sampler, pruner=pruner)
    dists = distributions(search, integer_keys)
    State = optuna.trial.TrialState
    if search.grid:
        dists = {}  # a grid needs no sampler: its studies serve the pruner, which reads only the dev curves
    for rec in finished:
        curve = {i + 1: v for i, v in enumerate(rec["curve"]) if v is not None and math.isfinite(v)}
        pruned = rec["state"] == "pruned"
        value = rec["value"]
        if pruned or value is None or not math.isfinite(value):
            state, value = (State.PRUNED if pruned else State.FAIL), (curve[max(curve)] if pruned and curve else None)
        else:
            state = State.COMPLETE
        study.add_trial(optuna.trial.create_trial(
            state=state, value=value, params={k: rec["params"][k] for k in dists}, distributions=dists,
            intermediate_values=curve))
    return study


def trial_params(search: SearchSection, finished: list[dict[str, Any]], k: int, maximise: bool,
                 integer_keys: set[str]) -> dict[str, Any]:
    """The settings of trial k (1-based), given the records of trials 1..k-1."""
    if search.grid:
        return grid_points(search)[k - 1]
    if len(finished) != k - 1:
        raise RuntimeError(f"trial {k} needs the records of trials 1..{k - 1}, got {len(finished)}")
    optuna = require_optuna()
    o = search.optuna
    seed = o.seed + k  # a fresh, seeded sampler per trial: a pure function of the finished trials
    sampler = (optuna.samplers.TPESampler(seed=seed, n_startup_trials=o.startup_trials) if o.sampler == "tpe"
               else optuna.samplers.RandomSampler(seed=seed))
    study = _study(search, finished, maximise, integer_keys, sampler)
    trial = study.ask(distributions(search, integer_keys))
    return {name: trial.params[name] for name in o.params}


def should_prune(search: SearchSection, finished: list[dict[str, Any]], curve: list[float], maximise: bool,
                 integer_keys: set[str]) -> bool:
    """The pruner's decision for a running trial whose dev evaluations so far gave `curve`."""
    if search.pruner.name == "none":
        return False
    study = _study(search, finished, maximise, integer_keys)
    trial = study.ask()
    for i, v in enumerate(curve):
        trial.report(float(v) if v is not None and math.isfinite(v) else float("nan"), i + 1)
    return bool(trial.should_prune())


def best_trial(finished: list[dict[str, Any]], maximise: bool) -> dict[str, Any]:
    """The finished, unpruned trial with the best dev value (ties: the earliest)."""
    done = [r for r in finished if r["state"] == "complete" and r["value"] is not None and math.isfinite(r["value"])]
    if not done:
        raise ValueError("no trial of the search finished with a dev value: nothing to choose from")
    sign = 1.0 if maximise else -1.0
    return max(done, key=lambda r: (sign * r["value"], -r["trial"]))


def trial_record(k: int, params: dict[str, Any], seed: int, selection: dict[str, Any],
                 pruned: dict[str, Any] | None) -> dict[str, Any]:
    """trial.json: what the study is rebuilt from. `selection` is the run's eval_results.json 'selection'."""
    metric = selection["metric"]
    curve = [h.get(metric) for h in selection["history"]]
    if selection["final"] == "best":
        value = selection["best_value"]
    else:
        value = curve[-1] if curve else None
    return {"trial": k, "params": params, "seed": seed, "metric": metric, "maximise": selection["maximise"],
            "state": "pruned" if pruned else "complete", "value": value, "curve": curve,
            "steps": [h["step"] for h in selection["history"]], "final": selection["final"],
            "pruned": pruned, "stop_reason": selection.get("stop_reason")}
