"""The stages of `bertrain run`, when each is skipped, resumed or redone, and the loop that runs them.

    vocab -> prepare -> pretrain-phase1 -> pretrain-phase2 -> [data-TASK] -> [search-TASK-INIT-tK ...] ->
    finetune-TASK-INIT-sSEED ... -> evaluate -> report

Each stage owns the folder RUN/NAME. It writes `stage-started.json` (its hash) before any work and `stage.json`
(hash, output identity, wall time, throughput) last: a folder with `stage.json` is complete.

The hash of a stage is the sha256 of its resolved engine config (minus the keys that cannot change its result:
logging, checkpoint interval, workers, how the model runs — `train.resume.EXACT_KEYS` but `RESULT_KEYS`; paths inside the run
folder written as `$RUN`), the identity of its external inputs (the content of corpus files and task data, size
and time for files over 256 MiB) and the hashes of the stages it depends on. So a change anywhere redoes that
stage and every stage that depends on it, and nothing else. A stage is

* skipped: complete, the same hash, its output files still have the recorded sha256, and every stage it depends
  on is skipped too;
* resumed: started with the same hash but not complete (killed, stopped): the engine continues from its newest
  complete checkpoint (`--resume auto`), prepare from its finished shards — bitwise the uninterrupted run on CPU;
* redone: anything else. A folder with another hash is moved aside to NAME.replaced-<time> first, never deleted.

A task with a `search` (bertrain.pipeline.search) has trial stages before its runs. Some settings are known only
once earlier stages are done (an Optuna trial's parameters, the settings the trials chose): such a stage has a
`resolve` that reads them from those stages' outputs when the loop reaches it, so its hash covers the settings it
really runs with. A dry run shows it as waiting for the search until its trials are complete.

Under torchrun / srun / mpirun every rank runs the loop: rank 0 decides each stage and tells the others;
engine stages (pretraining, fine-tuning) run on every rank; one-process stages (vocab, prepare, task data,
evaluate, report) run on rank 0 while the others wait in the rendezvous store (no time limit: prepare on a
Wikipedia dump takes hours). One process group serves every stage.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import importlib.util
import json
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch
import yaml

from bertrain.config import flatten, save_config, to_dict
from bertrain.data.build import ensure_prepared, ensure_vocab
from bertrain.data.readers import BUILTIN_PYTHON_DOCS, resolve_inputs
from bertrain.data.tokenizer import read_vocab
from bertrain.model.bert import BertForPreTraining
from bertrain.model.hf import tokenizer_files_from_vocab
from bertrain.pipeline import downstream, search, verdict
from bertrain.pipeline.evaluate import summarize
from bertrain.pipeline.recipe import (Recipe, TaskSection, check_process_group, finetune_config, prepare_config,
                                     pretrain_config, process_group_config, recipe_dict)
from bertrain.pipeline.report import write_report
from bertrain.tasks.finetune import run_glue, run_squad
from bertrain.tasks.glue import get_task
from bertrain.tasks.metrics import PRIMARY_METRIC
from bertrain.tasks.pretraining import build_model, model_positions, run_pretraining
from bertrain.train.checkpoint import sha256_file
from bertrain.train.config import DistributedConfig, resolve_batch
from bertrain.train.distributed import DistInfo, distributed_context, on_rank0
from bertrain.train.evaluation import maximises
from bertrain.train.launch import launch_env
from bertrain.train.resume import ADDED_KEYS, EXACT_KEYS, PACKING_ONLY_KEYS, check_shared_output
from bertrain.train.trackers import pipeline_parent
from bertrain.utils.errors import RunStopped, UserError
from bertrain.utils.io import atomic_dir, atomic_write_bytes, atomic_write_json, atomic_write_text
from bertrain.utils.rundir import OutputLock, claim_run_folder, holds_run, move_aside, read_run

log = logging.getLogger(__name__)

STAGE_FILE = "stage.json"
STARTED_FILE = "stage-started.json"
HASH_FULL_BYTES = 256 << 20  # inputs up to this size are identified by content, larger ones by size and time


# ----------------------------------------------------------------------------------------------- identity

def input_identity(spec: str) -> str:
    """What an external input is: the sha256 of its content (or size + time when huge), 'missing' if absent."""
    if spec == BUILTIN_PYTHON_DOCS:
        origin = importlib.util.find_spec("pydoc_data.topics").origin
        return f"builtin sha256:{sha256_file(Path(origin))}"
    try:
        files = resolve_inputs([spec])
    except (ValueError, OSError):
        return "missing"
    parts = []
    for f in files:
        st = os.stat(f)
        parts.append(f"sha256:{sha256_file(Path(f))}" if st.st_size <= HASH_FULL_BYTES
                     else f"size:{st.st_size},mtime:{int(st.st_mtime)}")
    return parts[0] if len(parts) == 1 else "sha256:" + hashlib.sha256("\n".join(parts).encode()).hexdigest()


RESULT_KEYS = ("train.max_time", "eval.enabled", "eval.interval", "eval.each_epoch", "do_eval", "data.predict_test",
               "data.dev_file", "data.dev_articles", "data.n_best_size", "data.max_answer_length",
               "data.null_score_diff_threshold")
"""Keys a resume may take unchanged (`EXACT_KEYS`: the steps taken are the same) that still change what a finished
stage leaves behind: where a time budget stopped it, which evaluations ran (and so which model eval.final = best
kept, and the curves of the report), the dev and test results. They count in a stage's hash."""


NEUTRAL_KEYS: dict[str, Callable[[Any, dict[str, Any]], bool]] = {
    "optim.init_state": lambda value, flat: value is None,
    "sample.document_separator": lambda value, flat: flat.get("sample.next_sentence", True) is not False,
}
"""Keys added to the engine after run folders existed, and when they change nothing (unset; a packing key in an NSP
run): then left out of the hash, so that a run folder of an older bertrain is not redone for a key it could not
have had. A value that changes the result is hashed (a packing run's separators: its rows change)."""


def _settings(cfg: Any, run_dir: Path, drop: tuple[str, ...] = ()) -> dict[str, Any]:
    """The hashed part of an engine config: flat keys, without those that keep the result exact (EXACT_KEYS but
    RESULT_KEYS), with the run folder written as $RUN (moving a run folder redoes nothing)."""
    root = str(run_dir)
    out = {}
    flat = flatten(to_dict(cfg))
    for key, value in flat.items():
        if key not in RESULT_KEYS and \
                any(key == k or (k.endswith(".") and key.startswith(k)) for k in EXACT_KEYS + drop):
            continue
        if key in NEUTRAL_KEYS and NEUTRAL_KEYS[key](value, flat):
            continue
        if isinstance(value, str) and value.startswith(root):
            value = "$RUN" + value[len(root):]
        out[key] = value
    return out


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


# ----------------------------------------------------------------------------------------------- stages

@dataclass
class Stage:
    name: str
    what: str
    """One line for the dry-run and the report."""
    parallel: bool
    """Runs on every rank (the engine's stages); else on rank 0 while the others wait."""
    deps: tuple[str, ...]
    settings: dict[str, Any]
    """The resolved config that decides the result (hashed)."""
    inputs: dict[str, str]
    """External inputs: name -> identity (hashed)."""
    outputs: tuple[str, ...]
    """Files (relative to the stage folder) whose sha256 is the stage's output identity."""
    work: Callable[["Stage", DistInfo], dict[str, Any]]
    """Does the stage; returns its summary (e.g. throughput) for stage.json and the report."""
    folder: Path = Path()
    setup: Optional[Callable[["Stage"], None]] = None
    """Rank 0 only, before `work` on every rank (e.g. a random initialisation everyone then loads)."""
    config: Any = None
    """The engine config (saved as stage-config.yaml beside the outputs)."""
    hash: str = ""
    parts: dict[str, Any] = field(default_factory=dict)
    resolve: Optional[Callable[["Stage"], tuple[Any, dict[str, Any], str]]] = None
    """Settings that come from earlier stages' outputs (a search): rank 0 calls it when those stages are done and
    it returns the stage's (config, settings, what); None once known."""
    variants: tuple[Any, ...] = ()
    """Other engine configs the stage may end up running (a search's candidates), checked like `config` first."""


def stage_hash(stage: Stage, by_name: dict[str, Stage]) -> None:
    """The hash chain: the stage's settings, inputs and the hashes of the stages it depends on."""
    stage.parts = {"settings": stage.settings, "inputs": stage.inputs,
                   "upstream": {n: by_name[n].hash for n in stage.deps}}
    stage.hash = _digest(stage.parts)


def apply_resolved(stage: Stage, resolved: tuple[Any, dict[str, Any], str]) -> None:
    stage.config, stage.settings, stage.what = resolved
    stage.resolve = None


def build_stages(recipe: Recipe) -> list[Stage]:
    """Every stage of the recipe with its engine config built (so validated) and its hash computed."""
    run = recipe.run_dir
    vocab_file = run / "vocab" / "vocab.txt"
    stages = [vocab_stage(recipe), prepare_stage(recipe, vocab_file)]
    phases = pretrain_stages(recipe, vocab_file, Path(stages[-1].config.output))
    stages += phases
    pretrained = stages[-1]  # the last pretraining phase: fine-tuning starts from its final/ weights
    architecture = architecture_config([p.config for p in phases])
    check_phase_lengths(phases, architecture)
    finetunes: list[Stage] = []
    for i in range(len(recipe.finetune)):
        task_stages = finetune_stages(recipe, i, pretrained, vocab_file, architecture)
        stages += task_stages
        finetunes += [s for s in task_stages if s.parallel]
    if finetunes:
        stages.append(evaluate_stage(recipe, finetunes))
    stages.append(report_stage(recipe, stages))
    by_name = {t.name: t for t in stages}
    for s in stages:  # a stage still to resolve has a provisional hash; the loop computes the real one
        s.folder = run / s.name
        stage_hash(s, by_name)
    return stages


# One builder per stage kind: each returns the stage(s) with what decides their result (settings, inputs) and
# their work, a module-level function with its arguments bound (functools.partial), never a closure.

def vocab_stage(recipe: Recipe) -> Stage:
    """Train the WordPiece vocabulary on the corpus (or copy the recipe's vocab_file)."""
    d = recipe.data
    settings = {"input": list(d.input), "corpus": to_dict(d.corpus), "do_lower_case": d.do_lower_case,
                "vocab_size": d.vocab_size, "min_frequency": d.min_frequency, "vocab_file": d.vocab_file}
    inputs = ({f"data.vocab_file: {d.vocab_file}": input_identity(d.vocab_file)} if d.vocab_file
              else corpus_inputs(recipe))
    return Stage("vocab", "train the WordPiece vocabulary" if not d.vocab_file else "copy the vocabulary", False, (),
                 settings, inputs, ("vocab.txt",), functools.partial(_vocab_work, d))


def _vocab_work(d: Any, stage: Stage, dist: DistInfo) -> dict[str, Any]:
    if d.vocab_file:
        out = stage.folder / "vocab.txt"
        atomic_write_bytes(out, Path(d.vocab_file).read_bytes())
        return {"tokens": len(read_vocab(out))}
    stats = ensure_vocab(d.input, stage.folder, d.vocab_size, d.do_lower_case, d.corpus, d.min_frequency)
    return {"tokens": stats.get("num_tokens"), "words": stats.get("num_words")}


def corpus_inputs(recipe: Recipe) -> dict[str, str]:
    return {f"data.input: {s}": input_identity(s) for s in recipe.data.input}


def prepare_stage(recipe: Recipe, vocab_file: Path) -> Stage:
    """Tokenize the corpus into the token store both phases build their samples from."""
    pcfg = prepare_config(recipe, recipe.run_dir, vocab_file)
    return Stage("prepare", f"tokenize the corpus into a token store ({pcfg.masking} masking)", False, ("vocab",),
                 _settings(pcfg, recipe.run_dir, drop=("workers",)), corpus_inputs(recipe),
                 ("data/stats.json", "data/store.json"), functools.partial(_prepare_work, pcfg), config=pcfg)


def _prepare_work(pcfg: Any, stage: Stage, dist: DistInfo) -> dict[str, Any]:
    stats = ensure_prepared(pcfg)
    return {k: stats.get(k) for k in ("num_documents", "num_tokens", "input_bytes", "tokens_per_s", "input_mb_per_s")}


def pretrain_stages(recipe: Recipe, vocab_file: Path, prepared: Path) -> list[Stage]:
    """Pretraining phase 1, then phase 2 (if the recipe has one) from phase 1's final weights."""
    run = recipe.run_dir
    stages: list[Stage] = []
    for phase in [1, 2] if recipe.phase2 is not None else [1]:
        init = run / f"pretrain-phase{phase - 1}" / "final" if phase > 1 else None
        cfg = pretrain_config(recipe, phase, run, vocab_file, prepared, init)
        length = f"{cfg.train.steps or cfg.train.epochs} {'steps' if cfg.train.steps else 'epochs'}"
        deps = ("vocab", "prepare") + ((stages[-1].name,) if stages else ())
        stages.append(Stage(f"pretrain-phase{phase}", f"pretrain MLM+NSP at sequence length "
                            f"{cfg.sample.max_seq_length}, {length}", True, deps, _settings(cfg, run), {},
                            MODEL_FILES, functools.partial(_pretrain_work, cfg), config=cfg))
    return stages


def check_phase_lengths(phases: list[Stage], architecture: Any) -> None:
    """Each phase's sample length against the positions of the model the phases train, before any work (as
    fine-tuning's max_seq_length is): phase 2's model comes from phase 1's weights, so the engine found a length
    over them only when phase 2 began, after phase 1 (hours for BERT-base), naming its own key."""
    positions = model_positions(architecture)
    for stage in phases:
        length = stage.config.sample.max_seq_length
        if positions is not None and length > positions:
            phase = stage.name.removeprefix("pretrain-")
            raise UserError(f"recipe key {phase}.sample.max_seq_length: {length} exceeds the {positions} positions "
                            "(max_position_embeddings) of the model the pretraining phases train: use "
                            f"{positions} or less, or a model with more positions (phase1.model / "
                            "pretrain.model.max_position_embeddings)")


def architecture_config(phases: list[Any]) -> Any:
    """The config that builds the model the last pretraining phase ends with, from no weights: phase 1's model
    section (a later phase starts from the earlier one's weights, which keep their shape: its architecture keys are
    not read) with the dropout of the last phase that sets one (a later phase's dropout applies to the loaded
    model). The random initialisation copies it, and fine-tuning checks its positions, before any phase has run.
    Before, phase 2's own model section was used: with the architecture set under phase1 (phase1.model.*), the
    random-init model was the preset's, not the pretrained one's (4 layers against 2), and with phase 2's weights
    not there yet its positions were unknown, so a max_seq_length over them was not refused before any work."""
    first = phases[0]
    model = dataclasses.replace(first.model, init=None)
    for cfg in phases[1:]:
        if cfg.model.dropout is not None:
            model = dataclasses.replace(model, dropout=cfg.model.dropout)
    return dataclasses.replace(first, model=model)


# An engine stage resumes with allow_config_change: the pipeline resumes a stage only when its hash is the same,
# and the hash covers every key the engine's resume check guards (EXACT_KEYS are left out of both), except the
# paths inside the run folder, written as $RUN. So all the engine can find changed are those paths: a run folder
# moved, or named otherwise (relative / absolute) since the stage was cut. Refused, the stage could never resume,
# and the engine's advice (--allow-config-change) is no flag of `bertrain run`.
RESUME = {"resume": "auto", "allow_config_change": True}
CONTINUE = "run the same `bertrain run` again to continue"


def _pretrain_work(cfg: Any, stage: Stage, dist: DistInfo) -> dict[str, Any]:
    result = run_pretraining(cfg, **RESUME)
    if result.stopped_by_signal:
        step = result.state.step
        raise RunStopped(f"stopped by a signal in stage {stage.name} at step {step} (saved {cfg.output_dir}"
                         f"/step-{step}); {CONTINUE}",
                         checkpoint=Path(cfg.output_dir) / f"step-{step}")
    return _pretrain_summary(Path(cfg.output_dir)) if dist.is_main else {}


def _pretrain_summary(out: Path) -> dict[str, Any]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "seq_per_s" in r]
    if not rows:
        return {}
    last = rows[-1]
    # each log interval's rate weighted by its time: the sequences (tokens) of all intervals over their time. The
    # plain mean of the rates (before) weighs a slow interval as much as a fast one of the same length, so it
    # overstated the throughput whenever the rate varied (e.g. 100 then 50 seq/s over 100 sequences each: 66.7
    # seq/s, not 75).
    weights = [r.get("elapsed_s") or 0.0 for r in rows]
    if not all(w > 0 for w in weights):
        weights = [1.0] * len(rows)  # records without a time: the plain mean

    def rate(key: str) -> float:
        return sum(w * (r.get(key) or 0.0) for w, r in zip(weights, rows)) / sum(weights)

    return {"steps": last.get("step"), "seq_per_s": rate("seq_per_s"), "tokens_per_s": rate("tokens_per_s"),
            "final_loss": last.get("loss"), "mlm_acc": last.get("mlm_acc"), "nsp_acc": last.get("nsp_acc")}


def finetune_stages(recipe: Recipe, index: int, pretrained: Stage, vocab_file: Path,
                    architecture: Any = None) -> list[Stage]:
    """Task `index`: its data stage (built-in task only), its search trials (with a `search`), then one fine-tuning
    run per initialisation (pretrained, and random with `random_init`) and seed. `architecture`: the config that
    builds the pretrained model's architecture from no weights (`architecture_config`; default: the last phase's)."""
    task, run = recipe.finetune[index], recipe.run_dir
    stages: list[Stage] = []
    data_dir = None
    if task.kind == "pydoc-topics":
        data_dir = run / f"data-{task.name}" / "data"
        stages.append(Stage(f"data-{task.name}", "build the topic-of-docstring task from the standard library",
                            False, (), {"task": downstream.TASK_NAME, "topics": downstream.TOPICS,
                                        "min_chars": downstream.MIN_CHARS},
                            {"python": f"{sys.version.split()[0]} {sys.platform}"},
                            ("data/train.tsv", "data/dev.tsv"), functools.partial(_task_data_work, data_dir)))
    ctx = _TaskContext(recipe, index, task, data_dir, pretrained, vocab_file, tuple(s.name for s in stages),
                       architecture if architecture is not None else architecture_config([pretrained.config]))
    for init_kind in ("pretrained", "random") if task.random_init else ("pretrained",):
        # Why this design: each initialisation chooses its own settings (a random-init model may want another
        # learning rate; settings chosen for one side only would tilt the comparison), the trials run on the first
        # seed only (a search per seed would multiply its cost by the seeds), and then every seed runs with the
        # chosen settings, so the spread over seeds (and the verdict) still measures seeds, not settings.
        plan_ = _search_plan(ctx, init_kind) if task.search is not None else None
        trials = search_stages(ctx, init_kind, plan_) if plan_ is not None else []
        stages += trials
        for seed in task.seeds:
            stages.append(_finetune_stage(ctx, init_kind, seed, plan_))
    return stages


@dataclass(frozen=True)
class _TaskContext:
    """What every fine-tuning stage of one task shares."""
    recipe: Recipe
    index: int
    task: TaskSection
    data_dir: Optional[Path]
    pretrained: Stage
    vocab_file: Path
    task_deps: tuple[str, ...]
    architecture: Any
    """The config that builds the pretrained model's architecture from no weights (`architecture_config`)."""

    def init(self, init_kind: str, seed: int, folder: Path) -> tuple[Path, Optional[Callable[[Stage], None]],
                                                                       dict[str, Any], tuple[str, ...]]:
        """(the model to start from, the setup that writes it, the settings that describe it, the dependencies)
        of a run from `init_kind` weights with `seed`."""
        run = self.recipe.run_dir
        final = run / self.pretrained.name / "final"
        arch_cfg = self.architecture  # the architecture a random initialisation copies
        deps = (("vocab",) if init_kind == "random" else (self.pretrained.name,)) + self.task_deps
        if init_kind == "random":  # the architecture of the pretrained model, initialised with the seed
            return (folder / "init", functools.partial(_random_init, folder / "init", arch_cfg, seed, self.vocab_file),
                    {"random_init.model": dict(to_dict(arch_cfg.model), init=None)}, deps)
        if self.task.reinit_pooler:
            return (folder / "init", functools.partial(_reinit_pooler, folder / "init", final, seed),
                    {"reinit_pooler": True}, deps)
        return final, None, {}, deps

    def config(self, init: Path, folder: Path, seed: int, params: dict[str, Any] | None = None,
               params_key: str = "") -> Any:
        cfg = finetune_config(self.recipe, self.index, init, folder / "out", seed, self.data_dir, params, params_key)
        if cfg.eval.metric:  # refused now, not when the first fine-tuning stage starts after pretraining
            from bertrain.tasks.glue import get_task
            from bertrain.tasks.metrics import SQUAD_V1_METRICS, SQUAD_V2_METRICS, glue_metric_names
            known = (SQUAD_V2_METRICS if cfg.data.version_2_with_negative else SQUAD_V1_METRICS) \
                if self.task.kind == "squad" else glue_metric_names(get_task(cfg.data.task).name)
            if cfg.eval.metric not in known:
                raise UserError(f"recipe key finetune[{self.index}].config.eval.metric: {cfg.eval.metric!r} is not "
                                f"one of this task's metrics ({', '.join(known)})")
        positions = model_positions(self.architecture)  # the same check, for the model pretraining makes
        length = getattr(cfg.data, "max_seq_length", None)
        if positions is not None and length is not None and length > positions:
            raise UserError(f"recipe key finetune[{self.index}].config.data.max_seq_length: {length} exceeds the "
                            f"{positions} positions (max_position_embeddings) of the model {self.pretrained.name} "
                            f"trains: use {positions} or less, or pretrain a model with more positions "
                            "(pretrain.model.max_position_embeddings)")
        return cfg

    def inputs(self, cfg: Any) -> dict[str, str]:
        """The task's files (the built-in task's come from its data stage)."""
        if self.task.kind == "pydoc-topics":
            return {}
        files = [cfg.data.train_file, cfg.data.dev_file] if self.task.kind == "squad" else [cfg.data.data_dir]
        found = {f"finetune[{self.index}] data: {f}": input_identity(f) for f in files if f}
        if self.task.kind == "glue" and cfg.data.data_dir and Path(cfg.data.data_dir).is_dir():
            from bertrain.tasks.glue import get_task, has_split
            needed = [s for s, used in (("train", cfg.do_train), ("dev", cfg.do_eval)) if used]
            for split in needed:  # a folder without its dev file would fail after pretraining, not before
                if not has_split(cfg.data.data_dir, get_task(cfg.data.task), split):
                    found[f"finetune[{self.index}].config.data.data_dir: the {split} split of "
                          f"{cfg.data.data_dir}"] = "missing"
        return found


def _finetune_stage(ctx: _TaskContext, init_kind: str, seed: int, plan_: Optional["_SearchPlan"]) -> Stage:
    """One fine-tuning run; after a search, with the settings its trials chose (resolved when they are done, so
    the stage's hash covers them)."""
    task, run = ctx.task, ctx.recipe.run_dir
    name = f"finetune-{task.name}-{init_kind}-s{seed}"
    folder = run / name
    init, setup, extra, deps = ctx.init(init_kind, seed, folder)
    cfg = ctx.config(init, folder, seed)
    what = f"fine-tune {task.name} from {init_kind} weights, seed {seed}"
    settings = {**_settings(cfg, run), **extra}
    resolve = None
    if plan_ is not None:
        settings["search.chosen"] = "pending: chosen by the search"
        resolve = functools.partial(_resolve_chosen, ctx, plan_, init, folder, seed, extra, what)
        what += ", with the settings chosen on dev"
        deps += plan_.trials
    return Stage(name, what, True, deps, settings, ctx.inputs(cfg),
                 tuple(f"out/{f}" for f in MODEL_FILES) + ("out/final/task.json", "out/eval_results.json"),
                 functools.partial(_finetune_work, task.kind), setup=setup, config=cfg, resolve=resolve)


# ----------------------------------------------------------------------------------------------- search trials

@dataclass(frozen=True)
class _SearchPlan:
    """One initialisation's search of a task, as its stages see it."""
    search: search.SearchSection
    """The recipe's search with every value as the engine reads it (a YAML 1.1 '1e-4' string is the float 1e-4)."""
    params_key: str
    """The recipe key the trial settings come from (errors name it)."""
    maximise: bool
    integer_keys: frozenset[str]
    trials: tuple[str, ...]
    """The trial stages, in order."""
    variants: tuple[Any, ...]
    """The engine config of every candidate (every grid point; each choice and range end): built, so checked."""


def _search_plan(ctx: _TaskContext, init_kind: str) -> _SearchPlan:
    """Check task `ctx.index`'s search against the engine (every candidate value is built into a config now, so a
    bad one stops the run before any work, naming its recipe key) and name its trial stages."""
    s, run, key = ctx.task.search, ctx.recipe.run_dir, f"finetune[{ctx.index}].search"
    params_key = f"{key}.grid" if s.grid else f"{key}.optuna.params"
    trials = tuple(search.trial_stage_name(ctx.task.name, init_kind, k) for k in range(1, search.n_trials(s) + 1))
    build = functools.partial(ctx.config, run / trials[0] / "init", run / trials[0], ctx.task.seeds[0],
                              params_key=params_key)
    base = build()
    if not (base.do_train and base.do_eval):
        raise UserError(f"recipe key '{key}': a search chooses settings on the dev set, so the task must train and "
                        f"evaluate (finetune[{ctx.index}].config.do_train and do_eval true)")
    if search.needs_optuna(s):
        try:
            search.require_optuna(key)
        except ValueError as e:
            raise UserError(str(e).replace("config key", "recipe key")) from None

    def typed(name: str, value: Any) -> Any:
        return flatten(to_dict(build({name: value})))[name]

    if s.grid:
        canonical = dataclasses.replace(s, grid={k: [typed(k, v) for v in vs] for k, vs in s.grid.items()})
    else:
        params = {k: dataclasses.replace(r, choices=None if r.choices is None else [typed(k, v) for v in r.choices],
                                         low=None if r.low is None else typed(k, r.low),
                                         high=None if r.high is None else typed(k, r.high))
                  for k, r in s.optuna.params.items()}
        canonical = dataclasses.replace(s, optuna=dataclasses.replace(s.optuna, params=params))
    metric = base.eval.metric or PRIMARY_METRIC.get("squad" if ctx.task.kind == "squad"
                                                    else get_task(base.data.task).name, "accuracy")
    flat = flatten(to_dict(base))
    integer = frozenset(k for k in search.search_keys(s) if isinstance(flat.get(k), int)
                        and not isinstance(flat.get(k), bool))
    variants = tuple(build(p) for p in search.candidate_points(canonical, integer))
    return _SearchPlan(canonical, params_key, maximises(metric), integer, trials, variants)


def search_stages(ctx: _TaskContext, init_kind: str, plan_: _SearchPlan) -> list[Stage]:
    """The trials of task `ctx.index`'s search from `init_kind` weights, each a stage on the task's first seed.

    Grid trials know their settings now; Optuna trial k's are resolved from trials 1..k-1 when they are done. Trial
    k depends on trial k-1: the sampler and the pruner read the earlier trials."""
    task, run = ctx.task, ctx.recipe.run_dir
    seed, n = task.seeds[0], len(plan_.trials)
    points = search.stable_grid_points(plan_.search, _started_params(run, plan_.trials)) if plan_.search.grid else None
    stages = []
    for k, name in enumerate(plan_.trials, start=1):
        folder = run / name
        init, setup, extra, deps = ctx.init(init_kind, seed, folder)
        what = f"search trial {k}/{n}: fine-tune {task.name} from {init_kind} weights, seed {seed}"
        trial = functools.partial(_trial_settings, ctx, plan_, init, folder, seed, extra, what)
        resolve = None
        if points is not None:  # a grid: trial k is the k-th point (those started before keep their numbers)
            cfg, settings, what = trial(points[k - 1])
        else:
            cfg = ctx.config(init, folder, seed)
            settings = {**_settings(cfg, run), **extra, "search.params": "pending: proposed from the earlier trials"}
            resolve = functools.partial(_resolve_trial, plan_, k, trial)
        stages.append(Stage(name, what, True, deps + plan_.trials[:k - 1][-1:], settings, ctx.inputs(cfg),
                            ("out/eval_results.json", search.TRIAL_FILE),
                            functools.partial(_trial_work, task.kind, plan_, k), setup=setup, config=cfg,
                            resolve=resolve, variants=plan_.variants if k == 1 else ()))
    return stages


def _started_params(run: Path, trials: tuple[str, ...]) -> list[Any]:
    """The settings each trial folder began with in an earlier run of the pipeline (None: not started), so that a
    value added to the grid keeps the trials already run in their places (`search.stable_grid_points`)."""
    out = []
    for name in trials:
        started = _read_json(run / name / STARTED_FILE) or {}
        out.append(((started.get("parts") or {}).get("settings") or {}).get("search.params"))
    return out


def _trial_settings(ctx: _TaskContext, plan_: _SearchPlan, init: Path, folder: Path, seed: int,
                    extra: dict[str, Any], what: str, params: dict[str, Any]) -> tuple[Any, dict[str, Any], str]:
    """A trial's config, hashed settings and description. What decides its result: its config (the parameters
    in it), the pruner, and the earlier trials the pruner compares with (the stage depends on trial k-1, so on
    all). Not the rest of the search: a value added to the grid redoes no started trial (they keep their numbers,
    the new points come after them: `search.stable_grid_points`)."""
    cfg = ctx.config(init, folder, seed, params, plan_.params_key)
    settings = {**_settings(cfg, ctx.recipe.run_dir), **extra, "search.params": params,
                "search.pruner": to_dict(plan_.search.pruner)}
    return cfg, settings, f"{what}: {search.describe(params)}"


def _read_trials(run_dir: Path, names: tuple[str, ...]) -> list[dict[str, Any]]:
    return [json.loads((run_dir / n / search.TRIAL_FILE).read_text(encoding="utf-8")) for n in names]


def _resolve_trial(plan_: _SearchPlan, k: int, trial: Callable[[dict[str, Any]], tuple[Any, dict[str, Any], str]],
                   stage: Stage) -> tuple[Any, dict[str, Any], str]:
    """Optuna trial k's settings, proposed by the sampler from the records of trials 1..k-1."""
    finished = _read_trials(stage.folder.parent, plan_.trials[:k - 1])
    return trial(search.trial_params(plan_.search, finished, k, plan_.maximise, set(plan_.integer_keys)))


def _resolve_chosen(ctx: _TaskContext, plan_: _SearchPlan, init: Path, folder: Path, seed: int,
                    extra: dict[str, Any], what: str, stage: Stage) -> tuple[Any, dict[str, Any], str]:
    """A seed's run with the settings of the best finished trial of its initialisation."""
    best = search.best_trial(_read_trials(stage.folder.parent, plan_.trials), plan_.maximise)
    cfg = ctx.config(init, folder, seed, best["params"], plan_.params_key)
    settings = {**_settings(cfg, ctx.recipe.run_dir), **extra, "search.chosen": best["params"]}
    return cfg, settings, f"{what}, with {search.describe(best['params'])} (trial {best['trial']}, chosen on dev)"


def _trial_work(kind: str, plan_: _SearchPlan, k: int, stage: Stage, dist: DistInfo) -> dict[str, Any]:
    """Run trial k, its pruner fed by each dev evaluation; rank 0 then writes trial.json (what later trials and
    the choice are computed from)."""
    cfg = stage.config
    finished = on_rank0("read the finished trials",
                        functools.partial(_read_trials, stage.folder.parent, plan_.trials[:k - 1]))
    on_eval = None
    if plan_.search.pruner.name != "none":
        on_eval = functools.partial(_ask_pruner, plan_, finished, Path(cfg.output_dir) / "metrics.jsonl",
                                    stage.folder / search.PRUNED_FILE)
    with _stage_stop(stage):
        results = (run_squad if kind == "squad" else run_glue)(cfg, **RESUME, on_eval=on_eval)

    def record() -> None:
        selection = json.loads((Path(cfg.output_dir) / "eval_results.json").read_text(encoding="utf-8"))["selection"]
        # pruned.json counts only if the run ended at that evaluation: one written before a kill, by a decision
        # the resumed run did not take again, is stale
        pruned = _read_json(stage.folder / search.PRUNED_FILE)
        last = selection["history"][-1]["step"] if selection["history"] else None
        rec = search.trial_record(k, stage.settings["search.params"], cfg.seed, selection,
                                  pruned if pruned is not None and pruned["step"] == last else None)
        atomic_write_json(stage.folder / search.TRIAL_FILE, rec)
        log.info("stage %s: %s %s %s%s", stage.name, search.describe(rec["params"]), rec["metric"],
                 "—" if rec["value"] is None else f"{rec['value']:.4g}", " (pruned)" if rec["pruned"] else "")

    on_rank0("record the trial", record, long=True)
    return _run_summary(results, Path(cfg.output_dir))


def _ask_pruner(plan_: _SearchPlan, finished: list[dict[str, Any]], metrics: Path, pruned_file: Path, step: int,
                value: float) -> bool:
    """`on_eval` of a trial: rank 0 asks the pruner, every rank learns the answer (so all stop together)."""
    return on_rank0("ask the search's pruner",
                    functools.partial(_prune_decision, plan_, finished, metrics, pruned_file, step, value))


def _prune_decision(plan_: _SearchPlan, finished: list[dict[str, Any]], metrics: Path, pruned_file: Path, step: int,
                    value: float) -> bool:
    # The trial's earlier evaluations are read from its metrics.jsonl (which a resumed run has cut back to its
    # checkpoint), so a resumed trial is judged on the same curve as the straight one.
    curve = [r["value"] for r in _eval_records(metrics) if r["step"] < step] + [value]
    prune = search.should_prune(plan_.search, finished, curve, plan_.maximise, set(plan_.integer_keys))
    if prune:
        atomic_write_json(pruned_file, {"evaluation": len(curve), "step": step, "value": value,
                                        "pruner": to_dict(plan_.search.pruner)})
    return prune


def _eval_records(path: Path) -> list[dict[str, Any]]:
    """The evaluation records of a run's metrics.jsonl (a line cut by a kill is skipped)."""
    out = []
    if path.is_file():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if row.get("event") == "eval":
                out.append(row)
    return out


def _task_data_work(data_dir: Path, stage: Stage, dist: DistInfo) -> dict[str, Any]:
    stats = downstream.write_task(data_dir)
    atomic_write_json(stage.folder / "task-stats.json", stats)
    return stats["examples"]


def _log_rows(path: Path) -> list[dict[str, Any]]:
    """The training log records of a metrics.jsonl (none: no file)."""
    if not path.is_file():
        return []
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [r for r in rows if "seq_per_s" in r]


def _run_summary(results: dict[str, Any] | None, out: Path) -> dict[str, Any]:
    """A fine-tuning stage's throughput for the report: its training rate over every attempt, from metrics.jsonl's
    log records (a resume keeps them up to its checkpoint) weighted by their time, as `_pretrain_summary`. The
    engine's train_examples_per_second (the fallback) covers only the last attempt of a resumed run, dev evaluations
    included; and a SQuAD batch holds windows (features), not examples: the windows per example convert it."""
    if not results:
        return {}
    summary = {k: results.get(k) for k in ("train_examples_per_second", "train_seconds", "train_steps")}
    rows = _log_rows(out / "metrics.jsonl")
    rate = _pretrain_summary(out).get("seq_per_s") if rows else None
    if rate:
        summary["train_examples_per_second"] = rate
        summary["train_seconds"] = round(sum(r.get("elapsed_s") or 0.0 for r in rows), 1)  # training only
    if results.get("train_features") and summary["train_examples_per_second"]:  # SQuAD
        summary["train_windows_per_second"] = summary["train_examples_per_second"]
        summary["train_examples_per_second"] *= results["train_examples"] / results["train_features"]
    return summary


def _finetune_work(kind: str, stage: Stage, dist: DistInfo) -> dict[str, Any]:
    with _stage_stop(stage):
        results = (run_squad if kind == "squad" else run_glue)(stage.config, **RESUME)
    return _run_summary(results, Path(stage.config.output_dir))  # the engine returns {} on ranks other than 0


@contextlib.contextmanager
def _stage_stop(stage: Stage) -> Iterator[None]:
    """A fine-tuning stage stopped by a signal: the engine's advice ("continue with the same command and --resume
    auto") is no `bertrain run` flag; say what the pretraining stages say."""
    try:
        yield
    except RunStopped as e:
        text = str(e).replace("continue with the same command and --resume auto", CONTINUE)
        raise RunStopped(f"stage {stage.name}: {text}", checkpoint=e.checkpoint) from None


def _random_init(folder: Path, arch_cfg: Any, seed: int, vocab_file: Path, stage: Stage) -> None:
    """The same architecture as the pretrained model, randomly initialised (seeded), as an HF model folder."""
    if (folder / "config.json").is_file():  # complete (built under a temporary name, renamed)
        return
    cfg = dataclasses.replace(arch_cfg, model=dataclasses.replace(arch_cfg.model, init=None))
    torch.manual_seed(seed)
    files = tokenizer_files_from_vocab(vocab_file, cfg.data.do_lower_case)
    model = build_model(cfg, len(read_vocab(vocab_file)), files)
    with atomic_dir(folder, overwrite=True) as tmp:
        model.save_pretrained(tmp)


def _reinit_pooler(folder: Path, pretrained: Path, seed: int, stage: Stage) -> None:
    """The pretrained weights with the pooler drawn afresh (seeded), as an HF model folder."""
    if (folder / "config.json").is_file():
        return
    model = BertForPreTraining.from_pretrained(pretrained)
    torch.manual_seed(seed)
    model.init_weights(model.bert.pooler)
    with atomic_dir(folder, overwrite=True) as tmp:
        model.save_pretrained(tmp)


def evaluate_stage(recipe: Recipe, finetunes: list[Stage]) -> Stage:
    """Collect every fine-tuning run's dev results: mean and spread over seeds, baselines."""
    return Stage("evaluate", "collect the dev-set results: mean and spread over seeds, baselines", False,
                 tuple(s.name for s in finetunes),
                 {"tasks": [[t.name, t.kind, t.seeds, t.random_init] for t in recipe.finetune],
                  "search": [to_dict(t.search) for t in recipe.finetune],
                  "paper_model": recipe.report.paper_model, "verdict_rule": verdict.RULE}, {}, ("results.json",),
                 functools.partial(_evaluate_work, recipe))


def _evaluate_work(recipe: Recipe, stage: Stage, dist: DistInfo) -> dict[str, Any]:
    results = summarize(recipe, recipe.run_dir)
    atomic_write_json(stage.folder / "results.json", results)
    return {"tasks": len(results["tasks"])}


def report_stage(recipe: Recipe, stages: list[Stage]) -> Stage:
    """report.md and report.html over every stage before it."""
    # The report shows the whole recipe and the run folder: any change to them (even the log interval) redoes it.
    return Stage("report", "write report.md and report.html", False, tuple(s.name for s in stages),
                 {"recipe": recipe_dict(recipe)}, {}, ("report.md", "report.html"),
                 functools.partial(_report_work, recipe, list(stages)))


def _report_work(recipe: Recipe, stages: list[Stage], stage: Stage, dist: DistInfo) -> dict[str, Any]:
    write_report(recipe, recipe.run_dir, stages + [stage], stage.folder)
    return {}


# ----------------------------------------------------------------------------------------------- decisions

@dataclass
class Decision:
    action: str
    """skip | run | resume | redo"""
    reason: str


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _short(v: Any) -> str:
    """A value in a one-line reason (a whole section would flood the dry-run)."""
    r = repr(v)
    return r if len(r) <= 40 else r[:37] + "..."


def _leaves(value: Any, key: str, out: dict[str, Any]) -> dict[str, Any]:
    """`value` as dotted leaf keys (a list of sections by index, `finetune[0].seeds`, and its length; a list of
    plain values stays one value), so a reason names the key that changed, not a whole section cut at 40 characters
    (before: `recipe: {'name': 'pydoc-small', 'description'... -> {'name': 'pydoc-small', 'description'...`)."""
    if isinstance(value, dict) and value:
        for k, v in value.items():
            _leaves(v, f"{key}.{k}" if key else str(k), out)
    elif isinstance(value, (list, tuple)) and value and any(isinstance(v, (dict, list, tuple)) for v in value):
        for i, v in enumerate(value):
            _leaves(v, f"{key}[{i}]", out)
        out[f"{key} (length)"] = len(value)  # an added or removed element: named first (sorts before `[`)
    else:
        out[key] = value
    return out


def _what_changed(old: dict[str, Any], new: dict[str, Any]) -> str:
    """A short account of how two hash parts differ: the first keys, inputs or upstream stages."""
    bits = []
    a, b = _leaves(old.get("settings", {}), "", {}), _leaves(new.get("settings", {}), "", {})
    keys = [k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
    bits += [f"{k}: {_short(a.get(k))} -> {_short(b.get(k))}" for k in keys[:3]] + (
        [f"{len(keys) - 3} more keys"] if len(keys) > 3 else [])
    ia, ib = old.get("inputs", {}), new.get("inputs", {})
    bits += [f"input {k} changed" for k in sorted(set(ia) | set(ib)) if ia.get(k) != ib.get(k)]
    ua, ub = old.get("upstream", {}), new.get("upstream", {})
    bits += [f"stage {k} changed" for k in sorted(set(ua) | set(ub)) if ua.get(k) != ub.get(k)]
    return "; ".join(bits) or "the stage's definition changed"


MODEL_FILES = ("final/model.safetensors", "final/config.json", "final/vocab.txt", "final/tokenizer_config.json")
"""The files of a model folder that decide what the stages after it compute: the weights, the architecture and
dropout, the tokenizer (before session 18, the weights alone: a final/config.json or vocab.txt edited by hand was
trusted, and the next phase or fine-tuning ran from it)."""


def outputs_intact(stage: Stage, recorded: Any) -> bool:
    """Whether the stage's output files are those its stage.json recorded: each file the record lists unchanged,
    and every output present. A record of an older bertrain lists fewer files (`MODEL_FILES` grew): those it lists
    decide; the others it cannot vouch for are taken as they are."""
    now = output_identity(stage)
    if now is None or not isinstance(recorded, dict):
        return False
    listed = [k for k in recorded if k in now]
    return bool(listed) and all(now[k] == recorded[k] for k in listed)


def output_identity(stage: Stage) -> dict[str, str] | None:
    """sha256 of each output file; None when one is missing."""
    out = {}
    for rel in stage.outputs:
        p = stage.folder / rel
        if not p.is_file():
            return None
        out[rel] = sha256_file(p)
    return out


def _plain(value: Any) -> Any:
    """A value as its record holds it (JSON: tuples are lists)."""
    return json.loads(json.dumps(value, default=str))


def recorded_as_now(stage: Stage, record: dict[str, Any], upstream: dict[str, Decision]) -> bool:
    """Whether a stage's record (stage.json or stage-started.json, of an older bertrain) differs from its parts now
    only by keys the hash did not cover then: a key added to the engine since, at the value that does what the
    bertrain that wrote it did (`train.resume.ADDED_KEYS`; a packing key of an NSP run), or a key hashed since
    (`RESULT_KEYS`) at the value the stage ran with (its stage-config.yaml), or a key no longer hashed (`EXACT_KEYS`
    since); with the same inputs, and each stage it
    read kept, with the hash the record names. Before, every stage of an older run folder was redone after an
    upgrade (its folder moved aside): a week of pretraining for `data.text_column: None -> 'text'`."""
    parts = record.get("parts") or {}
    old, new = parts.get("settings") or {}, _plain(stage.parts.get("settings") or {})
    if parts.get("inputs") != _plain(stage.inputs):
        return False
    if any(key not in RESULT_KEYS and not key.startswith(EXACT_KEYS) for key in set(old) - set(new)):
        return False  # a key the hash still covers, gone: not a key that keeps the result since (metrics.*)
    ran: dict[str, Any] | None = None
    for key, value in new.items():
        if key in old:
            if old[key] != value:
                return False
            continue
        if ran is None:
            try:
                ran = _plain(flatten(yaml.safe_load((stage.folder / "stage-config.yaml").read_text()) or {}))
            except (OSError, yaml.YAMLError):
                ran = {}
        if key in ran:
            same = ran[key] == value
        elif key in ADDED_KEYS:
            same = _plain(ADDED_KEYS[key]) == value
        else:  # a packing key, added since, means nothing to an NSP run
            same = key in PACKING_ONLY_KEYS and new.get("sample.next_sentence", True) is not False
        if not same:
            return False
    recorded = parts.get("upstream") or {}
    if set(recorded) != set(stage.deps):
        return False
    return all(upstream[n].action == "skip" and
               (_read_json(stage.folder.parent / n / STAGE_FILE) or {}).get("hash") == recorded[n]
               for n in stage.deps)


def decide(stage: Stage, upstream: dict[str, Decision]) -> Decision:
    """What to do with `stage` now (see the module docstring); `upstream` holds the decisions already taken."""
    done = _read_json(stage.folder / STAGE_FILE)
    started = _read_json(stage.folder / STARTED_FILE)
    moved = [n for n in stage.deps if upstream[n].action != "skip"]
    if done is not None:
        if done.get("hash") != stage.hash and not recorded_as_now(stage, done, upstream):
            return Decision("redo", _what_changed(done.get("parts", {}), stage.parts))
        if moved:
            return Decision("redo", f"stage {moved[0]} runs again")
        if not outputs_intact(stage, done.get("outputs")):
            return Decision("redo", "an output file was changed or removed since it completed")
        return Decision("skip", "complete; settings and inputs unchanged")
    if started is not None:
        if started.get("hash") == stage.hash or recorded_as_now(stage, started, upstream):
            if moved:  # a stage it read runs again (e.g. an output of it was changed or removed): the cut attempt
                # began from what that stage left before, so it starts over, as a complete one would (before: resumed)
                return Decision("redo", f"interrupted, and stage {moved[0]} runs again")
            return Decision("resume", "interrupted: continues where it stopped")
        return Decision("redo", "interrupted, and since then " + _what_changed(started.get("parts", {}), stage.parts))
    if stage.folder.exists() and any(stage.folder.iterdir()):
        return Decision("redo", "its folder holds something else")
    return Decision("run", "not run yet")


WAITS_FOR_SEARCH = "its settings come from the search, whose trials run first"


def plan(stages: list[Stage]) -> dict[str, Decision]:
    """What a run would do now (the dry run). A stage whose settings come from stages that would run first cannot
    be resolved yet: it would run (or be redone) once they are done."""
    by_name = {s.name: s for s in stages}
    decisions: dict[str, Decision] = {}
    for s in stages:
        if s.resolve is not None and all(decisions[d].action == "skip" for d in s.deps):
            apply_resolved(s, s.resolve(s))
        stage_hash(s, by_name)
        if s.resolve is not None:
            busy = s.folder.exists() and any(s.folder.iterdir())
            decisions[s.name] = Decision("redo" if busy else "run", WAITS_FOR_SEARCH)
        else:
            decisions[s.name] = decide(s, decisions)
    return decisions


def missing_inputs(stages: list[Stage]) -> list[str]:
    """Each absent external input, with the stages that need it."""
    need: dict[str, list[str]] = {}
    for stage in stages:
        for name, ident in stage.inputs.items():
            if ident == "missing":
                need.setdefault(name, []).append(stage.name)
    return [f"{name} (for {', '.join(names)})" for name, names in need.items()]


def format_plan(stages: list[Stage], decisions: dict[str, Decision], run_dir: Path) -> str:
    width = max(len(s.name) for s in stages)
    lines = [f"{len(stages)} stages in {run_dir} ({sum(d.action != 'skip' for d in decisions.values())} to run):"]
    for s in stages:
        d = decisions[s.name]
        lines.append(f"  {s.name:<{width}}  {d.action:<6}  {d.reason}   [{s.what}]")
    missing = missing_inputs(stages)
    if missing:
        lines.append("missing inputs (the run would refuse to start): " + "; ".join(missing))
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------- the loop

@contextlib.contextmanager
def pipeline_folder(run_dir: Path, dist: DistInfo, overwrite: bool) -> Iterator[str]:
    """Rank 0 locks the run folder for the whole command and claims it for `bertrain run` (a folder of another
    command is refused unless --overwrite, which moves it aside); every rank learns the outcome: the folder's run
    id (run.json)."""
    with contextlib.ExitStack() as held:

        def claim() -> str:
            held.enter_context(OutputLock(run_dir, "run"))
            existing = read_run(run_dir)
            foreign = (existing is not None and existing.get("command") != "run") or \
                (existing is None and holds_run(run_dir))
            if foreign and not overwrite:
                raise UserError(f"run folder {run_dir} holds the outputs of another command: choose another "
                                "output_dir, or --overwrite (the old folder is moved aside, not deleted)")
            return claim_run_folder(run_dir, "run", None if overwrite else "auto", overwrite)["run_id"]

        # every stage's folder is inside: a node-local run folder is refused before the first stage, not after
        # the one-process stages ran on rank 0 (the first engine stage's own check would find it then)
        run_id = on_rank0(f"use the run folder {run_dir}", claim)
        check_shared_output(run_dir, run_id, dist)
        yield run_id


def _begin(stage: Stage, decision: Decision) -> None:
    """Rank 0: make the stage folder this attempt's (move a different one aside) and record the hash."""
    if decision.action == "redo" and stage.folder.exists():
        moved = move_aside(stage.folder)
        log.info("stage %s: the previous folder was moved aside to %s", stage.name, moved.name)
    stage.folder.mkdir(parents=True, exist_ok=True)
    if decision.action != "resume":
        atomic_write_json(stage.folder / STARTED_FILE, {"hash": stage.hash, "parts": stage.parts,
                                                        "started": time.strftime("%Y-%m-%dT%H:%M:%S")})
    if stage.config is not None:
        save_config(stage.config, stage.folder / "stage-config.yaml")
    if stage.setup is not None:
        stage.setup(stage)


def _finish(stage: Stage, summary: dict[str, Any], wall_s: float) -> None:
    outputs = output_identity(stage)
    if outputs is None:
        raise RuntimeError(f"stage {stage.name} finished without its outputs {list(stage.outputs)}")
    atomic_write_json(stage.folder / STAGE_FILE, {
        "stage": stage.name, "hash": stage.hash, "parts": stage.parts, "outputs": outputs,
        "wall_s": round(wall_s, 2), "summary": summary,
        "finished": time.strftime("%Y-%m-%dT%H:%M:%S")})


def check_batches(stages: list[Stage], world_size: int) -> None:
    """Every engine stage's batch plan at this world size, checked before any work (the engine checks it only when
    its stage starts, maybe hours in)."""
    for s in stages:
        for i, cfg in enumerate((s.config, *s.variants) if s.parallel else ()):
            try:
                resolve_batch(cfg.train, world_size)
            except ValueError as e:
                which = "" if i == 0 else ", with a value its search may try (change the search's values or range)"
                raise UserError(f"stage {s.name}{which}: {e} (on {world_size} process{'es' if world_size > 1 else ''}"
                                "; set its batch keys in the recipe)") from None


def check_settings(recipe: Recipe, stages: list[Stage]) -> DistributedConfig:
    """The checks of the whole recipe that need no work (every stage's batch plan at this world size, one process
    group for every parallel stage); the dry run makes them too. Returns the process group's settings."""
    layout = launch_env()
    check_batches(stages, layout.world_size if layout else 1)
    group = process_group_config(recipe)
    check_process_group(group, [(s.name, s.config.distributed) for s in stages if s.parallel])
    return group


def run_stages(recipe: Recipe, stages: list[Stage], overwrite: bool = False) -> dict[str, Decision]:
    """Run the pipeline (every rank calls this); returns the decisions taken."""
    run_dir = recipe.run_dir
    missing = missing_inputs(stages)
    if missing:
        raise UserError("missing inputs: " + "; ".join(missing) + " — fix the recipe keys named, then run again")
    group = check_settings(recipe, stages)
    decisions: dict[str, Decision] = {}
    by_name = {s.name: s for s in stages}
    sharded = any(cfg.parallelism.strategy == "fsdp" for s in stages if s.parallel for cfg in (s.config, *s.variants))
    with distributed_context(group, sharded) as dist, pipeline_folder(run_dir, dist, overwrite) as run_id, \
            pipeline_parent(run_id, lambda: [s.config for s in stages if s.config is not None], dist.is_main):
        # the stages' MLflow parent is this run folder's (run.json), ended with the command (train/trackers.py)
        if dist.is_main:
            atomic_write_text(run_dir / "recipe.yaml", yaml.safe_dump(recipe_dict(recipe), sort_keys=False))
            # the plan, in order: `bertrain info` lists the stages not started yet too (commands/info.py)
            atomic_write_text(run_dir / "stages.json", json.dumps(
                {"stages": [{"name": s.name, "what": s.what} for s in stages]}, indent=1) + "\n")
        for stage in stages:
            if stage.resolve is not None:  # the stages it reads are done: its settings are known now
                apply_resolved(stage, on_rank0(f"choose the settings of stage {stage.name}",
                                               functools.partial(stage.resolve, stage)))
            stage_hash(stage, by_name)
            decision = on_rank0(f"decide stage {stage.name}", functools.partial(decide, stage, decisions))
            decisions[stage.name] = decision
            if dist.is_main:
                log.info("stage %s: %s (%s)", stage.name, decision.action, decision.reason)
            if decision.action != "skip":
                _run_stage(stage, decision, dist)
    return decisions


def _run_stage(stage: Stage, decision: Decision, dist: DistInfo) -> None:
    """Set the stage up and run it: on every rank (engine stages) or on rank 0 while the others wait."""
    t0 = time.perf_counter()  # wall time of this attempt (a resumed stage: the rest of its work)
    on_rank0(f"set up stage {stage.name}", functools.partial(_begin, stage, decision), long=True)
    if stage.parallel:
        summary = stage.work(stage, dist)
        on_rank0(f"finish stage {stage.name}", lambda: _finish(stage, summary, time.perf_counter() - t0), long=True)
    else:
        def work_and_finish() -> None:
            _finish(stage, stage.work(stage, dist), time.perf_counter() - t0)
        on_rank0(f"run stage {stage.name}", work_and_finish, long=True)
