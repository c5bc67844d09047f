"""The recipe of `bertrain run`: one YAML file from raw text to an evaluated model.

A recipe names the corpus, the vocabulary, the two pretraining phases and the fine-tuning tasks. Its engine
sections are the keys of the commands that run them, so nothing is spelled twice:

    data.prepare            keys of `bertrain prepare`          (bertrain.data.prepare.PrepareConfig)
    pretrain, phase1/2      keys of `bertrain pretrain`         (PretrainConfig; a phase's keys win over pretrain's)
    finetune[i].config      keys of `bertrain finetune glue|squad` (GlueFinetuneConfig / SquadFinetuneConfig)
    finetune[i].search      dotted keys of the same, searched on the dev set (bertrain.pipeline.search)

`load_recipe` is strict: the recipe's own keys are checked by `bertrain.config.from_dict`, and every engine
config a stage will run is built (and so validated by the engine's own checks) before any work starts. An error
names the recipe key, e.g. `recipe key 'phase1.optim.lr': ...`. Keys the pipeline sets itself (the paths between
stages, the fine-tuning seed) are refused in a recipe, naming the key.
"""
from __future__ import annotations

import copy
import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

import yaml

from bertrain.config import (deep_merge, describe_yaml_error, expand_paths, flatten, from_dict, load_config, load_file,
                            set_dotted, to_dict, upgrade_keys)
from bertrain.data.prepare import PrepareConfig
from bertrain.data.readers import CorpusConfig
from bertrain.pipeline.downstream import TASK_NAME
from bertrain.pipeline.search import SearchSection, check_search, parse_search
from bertrain.tasks.finetune import GlueFinetuneConfig, SquadFinetuneConfig
from bertrain.tasks.pretraining import PretrainConfig
from bertrain.train.config import DistributedConfig
from bertrain.utils.errors import UserError


# ----------------------------------------------------------------------------------------------- sections

@dataclass
class DataSection:
    input: list[str] = field(default_factory=list)
    """Raw corpus inputs: files, folders, globs, Wikipedia dumps (.xml.bz2), JSONL, or builtin:python-docs."""
    corpus: CorpusConfig = field(default_factory=CorpusConfig)
    """How the inputs are read and cleaned (format, JSONL field, encoding, minimum document length, dedupe)."""
    do_lower_case: bool = True
    """Lower-case and strip accents (uncased BERT): the vocabulary, the data and the fine-tuning tokenizer."""
    vocab_file: Optional[str] = None
    """Bring a vocab.txt (e.g. Google's uncased 30522) instead of training one: the vocab stage copies it."""
    vocab_size: int = 30522
    """Tokens of the trained WordPiece vocabulary (an upper bound on a small corpus)."""
    min_frequency: int = 2
    """Minimum pair frequency for a WordPiece merge."""
    prepare: dict[str, Any] = field(default_factory=dict)
    """More keys of `bertrain prepare` (masking, dupe_factor, seed, workers, shard_tokens, sample, ...)."""

    def __post_init__(self) -> None:
        if not self.input:
            raise ValueError("config key 'data.input' must list at least one corpus input (e.g. builtin:python-docs)")
        if self.vocab_size < 8:
            raise ValueError(f"config key 'data.vocab_size' must be >= 8, got {self.vocab_size}")


@dataclass
class TaskSection:
    name: str = ""
    """Short name of the task in stage names (finetune-NAME-pretrained-s42) and the report."""
    kind: Literal["glue", "squad", "pydoc-topics"] = "glue"
    """glue (any GLUE task: config.data.task, config.data.data_dir), squad (v1.1/v2.0 files in config.data), or
    pydoc-topics: the built-in offline task (bertrain.pipeline.downstream), built from the standard library."""
    config: dict[str, Any] = field(default_factory=dict)
    """Keys of `bertrain finetune glue|squad` (without init, output_dir and seed, which the pipeline sets)."""
    seeds: list[int] = field(default_factory=lambda: [42])
    """One fine-tuning run per seed (head initialisation, data order, dropout); the report shows the spread."""
    random_init: bool = False
    """Also fine-tune the same architecture from random initialisation: what pretraining is worth on this task."""
    reinit_pooler: bool = False
    """Re-initialise the pretrained pooler (the [CLS] projection that NSP trained, which a new task must first
    unlearn) before fine-tuning, as Zhang et al. 2021 ("Revisiting few-sample BERT fine-tuning") advise for small
    data; a random-init model has a fresh pooler anyway, so the two then differ only in the encoder."""
    search: Optional[SearchSection] = None
    """Choose fine-tuning settings on the dev set first (a grid, or an Optuna search with an optional pruner; see
    bertrain.pipeline.search): trials on the first seed, for each initialisation separately, then every seed runs
    with the settings its initialisation chose."""

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[a-z0-9][a-z0-9_.-]*", self.name or ""):
            raise ValueError(f"config key 'name' must be a short lower-case name (letters, digits, - _ .), got "
                             f"{self.name!r}")
        if not self.seeds:
            raise ValueError("config key 'seeds' must list at least one seed")
        if len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"config key 'seeds' lists a seed twice: {self.seeds}")


@dataclass
class ReportSection:
    title: str = ""
    """Title of report.md / report.html (default: the recipe's name)."""
    paper_model: Optional[Literal["base", "large"]] = None
    """Compare the fine-tuning results with the BERT paper's figures for this model size (none: no comparison)."""


@dataclass
class Recipe:
    """`bertrain run RECIPE`: vocabulary -> prepare -> pretrain phase 1 -> phase 2 -> fine-tune -> evaluate -> report."""

    name: str = ""
    """Name of the run (the default run folder is runs/NAME)."""
    description: str = ""
    """What the recipe is for, one paragraph (shown at the top of the report)."""
    output_dir: str = ""
    """The run folder: one sub-folder per stage, report.md and report.html (default runs/NAME)."""
    data: DataSection = field(default_factory=DataSection)
    """The corpus, the vocabulary and the prepare settings."""
    pretrain: dict[str, Any] = field(default_factory=dict)
    """`bertrain pretrain` keys shared by both phases: model, optim, schedule, precision, checkpoint, seed, ..."""
    phase1: dict[str, Any] = field(default_factory=dict)
    """`bertrain pretrain` keys of phase 1 (e.g. sample.max_seq_length 128, train.steps, optim.lr)."""
    phase2: Optional[dict[str, Any]] = field(default_factory=dict)
    """`bertrain pretrain` keys of phase 2, started from phase 1's weights (e.g. sample.max_seq_length 512)."""
    finetune: list[TaskSection] = field(default_factory=list)
    """The tasks to fine-tune and evaluate, each over its seeds."""
    report: ReportSection = field(default_factory=ReportSection)
    """What the report compares with."""

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", self.name or ""):
            raise ValueError(f"config key 'name' must be a name for the run folder (letters, digits, - _ .), got "
                             f"{self.name!r}")
        names = [t.name for t in self.finetune]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"config key 'finetune': task name(s) {', '.join(dup)} used twice")
        for i, task in enumerate(self.finetune):
            if task.search is not None:
                check_search(task.search, f"finetune[{i}].search")

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir or f"runs/{self.name}")


# ----------------------------------------------------------------------------------------------- engine configs

# Keys each stage's engine config gets from the pipeline (the paths between stages): a recipe may not set them.
PIPELINE_PRETRAIN_KEYS = ("data.prepared", "data.input", "data.vocab_file", "data.do_lower_case",
                          "data.synthetic_samples", "output_dir", "model.init")
PIPELINE_FINETUNE_KEYS = ("init", "output_dir", "seed")
PIPELINE_PREPARE_KEYS = ("inputs", "output", "vocab_file", "do_lower_case", "corpus", "overwrite")


def _merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    return copy.deepcopy(deep_merge(a, b))  # recipe sections are reused by several stages: never share leaves


def _refuse_pipeline_keys(data: dict[str, Any], keys: tuple[str, ...], section: str, why: str) -> None:
    for key in flatten(data):
        for k in keys:
            if key == k or key.startswith(k + "."):
                raise UserError(f"recipe key '{section}.{key}' is set by bertrain run ({why}); remove it")


def engine_config(cls: type, sections: list[tuple[str, dict[str, Any]]], pipeline: dict[str, Any]) -> Any:
    """Build the engine config `cls` from recipe sections (later ones win) and the pipeline's own keys; an error
    names the recipe key that set the offending value (or says it is a default)."""
    sections = [(name, upgrade_keys(section, f"in recipe section {name}")) for name, section in sections]
    data: dict[str, Any] = {}
    for _, section in sections:
        data = _merge(data, section)
    data = _merge(data, pipeline)
    try:
        return load_config(cls, base=data)
    except ValueError as e:
        raise UserError(_recipe_message(str(e), sections)) from None


def _recipe_message(message: str, sections: list[tuple[str, dict[str, Any]]]) -> str:
    """Rewrite the engine's "config key 'optim.lr'" as "recipe key 'phase1.optim.lr'" (the section that set it)."""
    message = re.sub(r" \([^()]*(the base config|not set: the default)[^()]*\)$", "", message)

    blamed: list[str] = []  # the recipe sections named

    def section_of(key: str) -> str | None:
        for name, section in reversed(sections):
            flat = flatten(section)
            if key in flat or any(k.startswith(key + ".") for k in flat):
                return name
        return None

    def blame(m: re.Match) -> str:
        key, name = m.group(2), section_of(m.group(2))
        if name is None:
            return f"{m.group(1)} '{key}' (not set in the recipe: the default)"
        blamed.append(name)
        return f"recipe key '{name}.{key}'"

    out = re.sub(r"(config key|config keys) '([A-Za-z_][\w.]*)'", blame, message)
    if "config keys '" in message:  # the other keys of a list ("..., 'train.epochs' and 'train.max_time'"): those
        # the recipe set are named with their section too (before: only the first, often a default, was)

        def blame_more(m: re.Match) -> str:
            name = section_of(m.group(2))
            if name is None:
                return m.group(0)
            blamed.append(name)
            return f"{m.group(1)}'{name}.{m.group(2)}'"

        out = re.sub(r"(, | and | != )'([A-Za-z_][\w.]*)'", blame_more, out)
    head = re.match(r"([A-Za-z_]\w*): ([A-Za-z_]\w*) ", message)  # "sample: max_predictions_per_seq must be ..."
    if out == message and head and section_of(f"{head.group(1)}.{head.group(2)}"):
        name = section_of(f"{head.group(1)}.{head.group(2)}")
        blamed.append(name)
        out = f"recipe key '{name}.{head.group(1)}.{head.group(2)}': {message[len(head.group(1)) + 2:]}"
    if blamed:  # an unknown key's suggestions, in the section it was written in: 'phase1.train.steps'
        out = re.sub(r"did you mean '[^']+'(?: or '[^']+')*",
                     lambda m: re.sub(r"'([^']+)'", lambda k: f"'{blamed[0]}.{k.group(1)}'", m.group(0)), out)
    if out.startswith(("recipe key", "unknown recipe key")):
        return out
    # nothing the recipe set is named (keys left at their defaults): name the stage's own section, where they go
    return f"recipe section '{sections[-1][0]}': {out}" if sections else f"recipe: {out}"


def prepare_config(recipe: Recipe, run_dir: Path, vocab_file: Path) -> PrepareConfig:
    d = recipe.data
    _refuse_pipeline_keys(d.prepare, PIPELINE_PREPARE_KEYS, "data.prepare", "from data.input, data.corpus, "
                          "data.do_lower_case and the vocab stage")
    base = {"masking": "dynamic"}  # samples of any length from one store: phase 1 and phase 2 share it
    return engine_config(PrepareConfig, [("data.prepare", _merge(base, d.prepare))], {
        "inputs": list(d.input), "output": str(run_dir / "prepare" / "data"), "vocab_file": str(vocab_file),
        "do_lower_case": d.do_lower_case, "corpus": to_dict(d.corpus)})


def _tracking(recipe: Recipe, sections: list[tuple[str, dict[str, Any]]], stage: str) -> dict[str, Any]:
    """The trackers' grouping for a stage (`metrics.group` = the recipe's name: an MLflow parent run, a W&B group;
    `metrics.run_name` = the stage), unless the recipe sets them."""
    given = {k for _, section in sections for k in flatten(section)}
    metrics = {k: v for k, v in (("group", recipe.name), ("run_name", stage)) if f"metrics.{k}" not in given}
    return {"metrics": metrics} if metrics else {}


def pretrain_config(recipe: Recipe, phase: int, run_dir: Path, vocab_file: Path, prepared: Path,
                    init: Path | None) -> PretrainConfig:
    section = recipe.phase1 if phase == 1 else (recipe.phase2 or {})
    for name, data in (("pretrain", recipe.pretrain), (f"phase{phase}", section)):
        _refuse_pipeline_keys(data, PIPELINE_PRETRAIN_KEYS, name, "the paths between stages")
    masking = recipe.data.prepare.get("masking", "dynamic")
    pipeline = {"data": {"prepared": str(prepared), "vocab_file": str(vocab_file), "masking": masking,
                         "do_lower_case": recipe.data.do_lower_case},
                "output_dir": str(run_dir / f"pretrain-phase{phase}"),
                "checkpoint": {"export_final": True}}  # the next stage starts from final/
    if init is not None:
        pipeline["model"] = {"init": str(init)}
    sections = [("pretrain", recipe.pretrain), (f"phase{phase}", section)]
    pipeline.update(_tracking(recipe, sections, f"pretrain-phase{phase}"))
    cfg = engine_config(PretrainConfig, sections, pipeline)
    if cfg.optim.init_state == PREVIOUS_PHASE:  # NVIDIA's phase 2: phase 1's moments, from its newest checkpoint
        if phase == 1:
            raise UserError(f"recipe key 'optim.init_state': {PREVIOUS_PHASE!r} (phase 1's optimizer moments) can only "
                            "start phase 2: set it under phase2")
        cfg.optim.init_state = str(run_dir / "pretrain-phase1")
    return cfg


PREVIOUS_PHASE = "phase1"
"""The recipe value of `phase2.optim.init_state` that starts phase 2's optimizer from phase 1's moments (its stage's
newest checkpoint), as NVIDIA's recipe does; unset, the moments start at zero."""


# The one process group of `bertrain run` serves every stage, so the keys that create it cannot differ per stage.
PROCESS_GROUP_KEYS = ("backend", "device", "timeout_s")


def process_group_config(recipe: Recipe) -> DistributedConfig:
    """The settings of the process group every stage shares: the recipe's `pretrain.distributed` keys (the
    section both pretraining phases share), built and checked by the engine's own config."""
    section = recipe.pretrain.get("distributed") or {}
    own = {f.name for f in dataclasses.fields(DistributedConfig)}  # other keys: checked with each stage's config
    try:
        return from_dict(DistributedConfig, {k: v for k, v in section.items() if k in own}, prefix="distributed")
    except ValueError as e:
        raise UserError(_recipe_message(str(e), [("pretrain", recipe.pretrain)])) from None


def check_process_group(group: DistributedConfig, stages: list[tuple[str, DistributedConfig]]) -> None:
    """Refuse a stage whose process-group keys differ from the group's: they could not take effect."""
    for name, cfg in stages:
        for key in PROCESS_GROUP_KEYS:
            if getattr(cfg, key) != getattr(group, key):
                raise UserError(f"stage {name}: distributed.{key} = {getattr(cfg, key)!r} differs from the recipe's "
                                f"pretrain.distributed.{key} ({getattr(group, key)!r}); every stage runs in one "
                                f"process group, created from pretrain.distributed: set the key there only")


def finetune_config(recipe: Recipe, index: int, init: Path, output_dir: Path, seed: int,
                    task_data_dir: Path | None, params: dict[str, Any] | None = None,
                    params_key: str = "") -> GlueFinetuneConfig | SquadFinetuneConfig:
    """Task `index`'s engine config; `params` (dotted keys, e.g. a search trial's settings, set by the recipe key
    `params_key`) win over the task's config."""
    t = recipe.finetune[index]
    where = f"finetune[{index}].config"
    _refuse_pipeline_keys(t.config, PIPELINE_FINETUNE_KEYS, where, "the pretrained model, the stage folder and "
                          f"finetune[{index}].seeds")
    pipeline: dict[str, Any] = {"init": str(init), "output_dir": str(output_dir), "seed": seed,
                                "checkpoint": {"export_final": True}}
    if t.kind == "pydoc-topics":
        _refuse_pipeline_keys(t.config, ("data.task", "data.data_dir"), where, "the built-in task's data stage")
        pipeline["data"] = {"task": TASK_NAME, "data_dir": str(task_data_dir), "predict_test": False}
    cls = SquadFinetuneConfig if t.kind == "squad" else GlueFinetuneConfig
    # the process group's keys, set under pretrain.distributed, hold for every stage (one group serves them all):
    # a task inherits them, and only its own different value is refused (check_process_group)
    group = {k: v for k, v in ((recipe.pretrain or {}).get("distributed") or {}).items() if k in PROCESS_GROUP_KEYS}
    sections = ([("pretrain", {"distributed": group})] if group else []) + [(where, t.config)]
    if params:
        nested: dict[str, Any] = {}
        for key, value in params.items():
            set_dotted(nested, key, value)
        sections.append((params_key, nested))
    stage = output_dir.parent.name if output_dir.name == "out" else output_dir.name  # STAGE/out: the stage's name
    pipeline.update(_tracking(recipe, sections, stage))
    return engine_config(cls, sections, pipeline)


# ----------------------------------------------------------------------------------------------- loading

def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """`KEY=VALUE` strings (dotted recipe keys, YAML values: `phase1.train.steps=20`) applied to the recipe data."""
    data = copy.deepcopy(data)
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise UserError(f"--set {item!r}: expected KEY=VALUE, e.g. --set phase1.train.steps=20")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError as e:
            raise UserError(f"--set {item!r}: the value is not valid YAML ({describe_yaml_error(e)})") from None
        key = key.strip()
        m = re.fullmatch(r"finetune\[(\d+)\]\.(.+)", key)  # one task of the list: finetune[0].seeds=[1]
        if m:
            tasks = data.get("finetune") or []
            i = int(m.group(1))
            if i >= len(tasks):
                raise UserError(f"--set {key}: the recipe has {len(tasks)} finetune task(s)")
            set_dotted(tasks[i], m.group(2), value)
        else:
            set_dotted(data, key, value)
    return data


def load_recipe(path: str | Path, overrides: list[str] | None = None) -> Recipe:
    """The recipe at `path` with `KEY=VALUE` overrides; its own keys are checked here, the engine sections when
    the stages are built (`bertrain.pipeline.stages.build_stages`), both before any work."""
    data = apply_overrides(load_file(path), list(overrides or []))
    try:
        data = expand_paths(data)  # `~` and $VAR in the path keys (data.input, output_dir, ...), as the engine's
        for i, task in enumerate(data.get("finetune") or []):
            if isinstance(task, dict) and task.get("search") is not None:
                # first on its own: from_dict reports an error inside an Optional section without its key
                parse_search(task["search"], f"finetune[{i}].search")
            if isinstance(task, dict):  # a task's own checks name 'seeds' / 'name': say which task's
                try:
                    from_dict(TaskSection, task, prefix=f"finetune[{i}]")
                except ValueError as e:
                    raise ValueError(re.sub(r"config key '(?!finetune\[)([\w.]+)'", rf"config key 'finetune[{i}].\1'",
                                            str(e))) from None
        return from_dict(Recipe, data)
    except ValueError as e:
        message = str(e).replace("config key", "recipe key")
        raise UserError(f"{message} (in {path}{' or --set' if overrides else ''})") from None


def recipe_dict(recipe: Recipe) -> dict[str, Any]:
    """The resolved recipe as plain data (saved as recipe.yaml in the run folder, printed in the report)."""
    return to_dict(dataclasses.replace(recipe))
