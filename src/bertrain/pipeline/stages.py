"""The stages of `bertrain run`, when each is skipped, resumed or redone, and the loop that runs them.

    vocab -> prepare -> pretrain-phase1 -> pretrain-phase2 -> [data-TASK] -> finetune-TASK-INIT-sSEED ... ->
    evaluate -> report

Each stage owns the folder RUN/NAME. It writes `stage-started.json` (its hash) before any work and `stage.json`
(hash, output identity, wall time, throughput) last: a folder with `stage.json` is complete.

The hash of a stage is the sha256 of its resolved engine config (minus the keys that cannot change its result:
logging, checkpoint interval, workers, how the model runs — `train.resume.EXACT_KEYS`; paths inside the run
folder written as `$RUN`), the identity of its external inputs (the content of corpus files and task data, size
and time for files over 256 MiB) and the hashes of the stages it depends on. So a change anywhere redoes that
stage and every stage after it, and nothing else. A stage is

* skipped: complete, the same hash, its output files still have the recorded sha256, and every stage it depends
  on is skipped too;
* resumed: started with the same hash but not complete (killed, stopped): the engine continues from its newest
  complete checkpoint (`--resume auto`), prepare from its finished shards — bitwise the uninterrupted run on CPU;
* redone: anything else. A folder with another hash is moved aside to NAME.replaced-<time> first, never deleted.

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
from bertrain.pipeline import downstream, verdict
from bertrain.pipeline.evaluate import summarize
from bertrain.pipeline.recipe import (Recipe, check_process_group, finetune_config, prepare_config, pretrain_config,
                                     process_group_config, recipe_dict)
from bertrain.pipeline.report import write_report
from bertrain.tasks.finetune import run_glue, run_squad
from bertrain.tasks.pretraining import build_model, run_pretraining
from bertrain.train.checkpoint import sha256_file
from bertrain.train.config import resolve_batch
from bertrain.train.distributed import DistInfo, distributed_context, on_rank0
from bertrain.train.launch import launch_env
from bertrain.train.resume import EXACT_KEYS
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


def _settings(cfg: Any, run_dir: Path, drop: tuple[str, ...] = ()) -> dict[str, Any]:
    """The hashed part of an engine config: flat keys, without those that keep the result exact, with the run
    folder written as $RUN (moving a run folder redoes nothing)."""
    root = str(run_dir)
    out = {}
    for key, value in flatten(to_dict(cfg)).items():
        if any(key == k or (k.endswith(".") and key.startswith(k)) for k in EXACT_KEYS + drop):
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


def build_stages(recipe: Recipe) -> list[Stage]:
    """Every stage of the recipe with its engine config built (so validated) and its hash computed."""
    run = recipe.run_dir
    vocab_file = run / "vocab" / "vocab.txt"
    stages = [vocab_stage(recipe), prepare_stage(recipe, vocab_file)]
    stages += pretrain_stages(recipe, vocab_file, Path(stages[-1].config.output))
    pretrained = stages[-1]  # the last pretraining phase: fine-tuning starts from its final/ weights
    finetunes: list[Stage] = []
    for i in range(len(recipe.finetune)):
        task_stages = finetune_stages(recipe, i, pretrained, vocab_file)
        stages += task_stages
        finetunes += [s for s in task_stages if s.parallel]
    if finetunes:
        stages.append(evaluate_stage(recipe, finetunes))
    stages.append(report_stage(recipe, stages))
    by_name = {t.name: t for t in stages}
    for s in stages:  # the hash chain: settings, inputs and the hashes of the stages a stage depends on
        s.folder = run / s.name
        s.parts = {"settings": s.settings, "inputs": s.inputs, "upstream": {n: by_name[n].hash for n in s.deps}}
        s.hash = _digest(s.parts)
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
                            ("final/model.safetensors",), functools.partial(_pretrain_work, cfg), config=cfg))
    return stages


def _pretrain_work(cfg: Any, stage: Stage, dist: DistInfo) -> dict[str, Any]:
    result = run_pretraining(cfg, resume="auto")
    if result.stopped_by_signal:
        step = result.state.step
        raise RunStopped(f"stopped by a signal in stage {stage.name} at step {step} (saved {cfg.output_dir}"
                         f"/step-{step}); run the same `bertrain run` again to continue",
                         checkpoint=Path(cfg.output_dir) / f"step-{step}")
    return _pretrain_summary(Path(cfg.output_dir)) if dist.is_main else {}


def _pretrain_summary(out: Path) -> dict[str, Any]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "seq_per_s" in r]
    if not rows:
        return {}
    last = rows[-1]
    return {"steps": last.get("step"), "seq_per_s": sum(r["seq_per_s"] for r in rows) / len(rows),
            "tokens_per_s": sum(r.get("tokens_per_s", 0.0) for r in rows) / len(rows),
            "final_loss": last.get("loss"), "mlm_acc": last.get("mlm_acc"), "nsp_acc": last.get("nsp_acc")}


def finetune_stages(recipe: Recipe, index: int, pretrained: Stage, vocab_file: Path) -> list[Stage]:
    """Task `index`: its data stage (built-in task only), then one fine-tuning run per initialisation (pretrained,
    and random with `random_init`) and seed."""
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
    task_deps = tuple(s.name for s in stages)
    task_inputs: dict[str, str] = {}
    arch_cfg = pretrained.config  # the architecture a random initialisation copies
    final = run / pretrained.name / "final"
    for init_kind in ("pretrained", "random") if task.random_init else ("pretrained",):
        for seed in task.seeds:
            name = f"finetune-{task.name}-{init_kind}-s{seed}"
            folder = run / name
            own_init = init_kind == "random" or task.reinit_pooler  # weights this stage writes itself
            cfg = finetune_config(recipe, index, folder / "init" if own_init else final, folder / "out", seed,
                                  data_dir)
            if task.kind != "pydoc-topics" and not task_inputs:  # the task's files: once per task
                files = [cfg.data.train_file, cfg.data.dev_file] if task.kind == "squad" else [cfg.data.data_dir]
                task_inputs = {f"finetune[{index}] data: {f}": input_identity(f) for f in files if f}
            settings = _settings(cfg, run)
            setup = None
            if init_kind == "random":  # the architecture of the pretrained model, initialised with the seed
                settings["random_init.model"] = dict(to_dict(arch_cfg.model), init=None)
                setup = functools.partial(_random_init, Path(cfg.init), arch_cfg, seed, vocab_file)
            elif task.reinit_pooler:
                settings["reinit_pooler"] = True
                setup = functools.partial(_reinit_pooler, Path(cfg.init), final, seed)
            deps = (("vocab",) if init_kind == "random" else (pretrained.name,)) + task_deps
            stages.append(Stage(name, f"fine-tune {task.name} from {init_kind} weights, seed {seed}", True, deps,
                                settings, task_inputs, ("out/final/model.safetensors", "out/eval_results.json"),
                                functools.partial(_finetune_work, cfg, task.kind), setup=setup, config=cfg))
    return stages


def _task_data_work(data_dir: Path, stage: Stage, dist: DistInfo) -> dict[str, Any]:
    stats = downstream.write_task(data_dir)
    atomic_write_json(stage.folder / "task-stats.json", stats)
    return stats["examples"]


def _finetune_work(cfg: Any, kind: str, stage: Stage, dist: DistInfo) -> dict[str, Any]:
    results = (run_squad if kind == "squad" else run_glue)(cfg, resume="auto")
    return {k: results.get(k) for k in ("train_examples_per_second", "train_seconds", "train_steps")} \
        if results else {}


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


def _what_changed(old: dict[str, Any], new: dict[str, Any]) -> str:
    """A short account of how two hash parts differ: the first keys, inputs or upstream stages."""
    bits = []
    a, b = old.get("settings", {}), new.get("settings", {})
    keys = [k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
    bits += [f"{k}: {_short(a.get(k))} -> {_short(b.get(k))}" for k in keys[:3]] + (
        [f"{len(keys) - 3} more keys"] if len(keys) > 3 else [])
    ia, ib = old.get("inputs", {}), new.get("inputs", {})
    bits += [f"input {k} changed" for k in sorted(set(ia) | set(ib)) if ia.get(k) != ib.get(k)]
    ua, ub = old.get("upstream", {}), new.get("upstream", {})
    bits += [f"stage {k} changed" for k in sorted(set(ua) | set(ub)) if ua.get(k) != ub.get(k)]
    return "; ".join(bits) or "the stage's definition changed"


def output_identity(stage: Stage) -> dict[str, str] | None:
    """sha256 of each output file; None when one is missing."""
    out = {}
    for rel in stage.outputs:
        p = stage.folder / rel
        if not p.is_file():
            return None
        out[rel] = sha256_file(p)
    return out


def decide(stage: Stage, upstream: dict[str, Decision]) -> Decision:
    """What to do with `stage` now (see the module docstring); `upstream` holds the decisions already taken."""
    done = _read_json(stage.folder / STAGE_FILE)
    started = _read_json(stage.folder / STARTED_FILE)
    moved = [n for n in stage.deps if upstream[n].action != "skip"]
    if done is not None:
        if done.get("hash") != stage.hash:
            return Decision("redo", _what_changed(done.get("parts", {}), stage.parts))
        if moved:
            return Decision("redo", f"stage {moved[0]} runs again")
        if output_identity(stage) != done.get("outputs"):
            return Decision("redo", "an output file was changed or removed since it completed")
        return Decision("skip", "complete; settings and inputs unchanged")
    if started is not None:
        if started.get("hash") == stage.hash:
            return Decision("resume", "interrupted: continues where it stopped")
        return Decision("redo", "interrupted, and since then " + _what_changed(started.get("parts", {}), stage.parts))
    if stage.folder.exists() and any(stage.folder.iterdir()):
        return Decision("redo", "its folder holds something else")
    return Decision("run", "not run yet")


def plan(stages: list[Stage]) -> dict[str, Decision]:
    decisions: dict[str, Decision] = {}
    for s in stages:
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
def pipeline_folder(run_dir: Path, dist: DistInfo, overwrite: bool) -> Iterator[None]:
    """Rank 0 locks the run folder for the whole command and claims it for `bertrain run` (a folder of another
    command is refused unless --overwrite, which moves it aside); every rank learns the outcome."""
    with contextlib.ExitStack() as held:

        def claim() -> None:
            held.enter_context(OutputLock(run_dir, "run"))
            existing = read_run(run_dir)
            foreign = (existing is not None and existing.get("command") != "run") or \
                (existing is None and holds_run(run_dir))
            if foreign and not overwrite:
                raise UserError(f"run folder {run_dir} holds the outputs of another command: choose another "
                                "output_dir, or --overwrite (the old folder is moved aside, not deleted)")
            claim_run_folder(run_dir, "run", None if overwrite else "auto", overwrite)

        on_rank0(f"use the run folder {run_dir}", claim)
        yield


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
        if s.parallel:
            try:
                resolve_batch(s.config.train, world_size)
            except ValueError as e:
                raise UserError(f"stage {s.name}: {e} (on {world_size} process{'es' if world_size > 1 else ''}; "
                                "set its batch keys in the recipe)") from None


def run_stages(recipe: Recipe, stages: list[Stage], overwrite: bool = False) -> dict[str, Decision]:
    """Run the pipeline (every rank calls this); returns the decisions taken."""
    run_dir = recipe.run_dir
    missing = missing_inputs(stages)
    if missing:
        raise UserError("missing inputs: " + "; ".join(missing) + " — fix the recipe keys named, then run again")
    layout = launch_env()
    check_batches(stages, layout.world_size if layout else 1)
    group = process_group_config(recipe)
    check_process_group(group, [(s.name, s.config.distributed) for s in stages if s.parallel])
    decisions: dict[str, Decision] = {}
    with distributed_context(group) as dist, pipeline_folder(run_dir, dist, overwrite):
        if dist.is_main:
            atomic_write_text(run_dir / "recipe.yaml", yaml.safe_dump(recipe_dict(recipe), sort_keys=False))
        for stage in stages:
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
