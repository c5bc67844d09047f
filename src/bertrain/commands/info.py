"""`bertrain info`: a model's configuration, parameter counts and training FLOPs, without loading weights; for a
run folder (`bertrain pretrain` / `finetune`, or a `bertrain run` pipeline) first what the run did: its state, its
checkpoints, its last training and evaluation numbers and results, read from the files the run wrote."""
from __future__ import annotations

import argparse
import dataclasses
import fcntl
import json
import logging
import os
import re
from pathlib import Path
from typing import Any

from bertrain.commands.export import resolve_checkpoint

HELP = ("show a model's config, parameter counts and FLOPs per token (a preset name or a model folder); for a run "
        "folder also its state, checkpoints and results")

_STEP_DIR = re.compile(r"step-(\d+)")
# the numbers of a training log line worth showing (the rest, seq_per_s, lr, ..., is in metrics.jsonl)
_LOG_KEYS = ("loss", "mlm_loss", "nsp_loss", "mlm_acc", "nsp_acc", "acc", "lr")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="tiny",
                        help="a preset (tiny, mini, small, medium, base, large), an HF/bertrain model or checkpoint "
                             "folder, or a run folder: a `bertrain pretrain` / `finetune` output folder (its state, "
                             "checkpoints and results, then its model) or a `bertrain run` folder (its stages and "
                             "results, then the pretrained model); default: tiny")
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON")


def flops_per_token(config: Any, seq_len: int, training: bool = True) -> float:
    """Approximate matmul FLOPs per token of BertForPreTraining with the MLM head on every token
    (2 per multiply-add; training = forward + backward = 3x forward)."""
    H, I, L, V = config.hidden_size, config.intermediate_size, config.num_hidden_layers, config.padded_vocab_size
    per_layer = 2 * (4 * H * H + 2 * H * I) + 2 * 2 * seq_len * H    # projections + FFN, then QK^T and AV
    forward = L * per_layer + 2 * (H * H + H * V)                    # + MLM transform and decoder
    return float(3 * forward if training else forward)


def describe(model: str) -> dict[str, Any]:
    """What `bertrain info --model MODEL --json` prints: for a run folder, `run` (`run_summary`) and then, where the
    run has one, its model's config and sizes."""
    from bertrain.model.bert import PRESETS, BertConfig
    from bertrain.model.hf import computed_config, config_from_json_file, find_config_file

    run = None
    if Path(model).exists():  # a folder the user made wins over a preset of the same name (said below)
        if model in PRESETS:
            logging.getLogger(__name__).warning("--model %s: the folder %s, not the preset %s (run `bertrain info` "
                                                "elsewhere for the preset)", model, Path(model).resolve(), model)
        run = run_summary(Path(model))
        folder = Path(run["model"]) if run and run.get("model") else resolve_checkpoint(Path(model))
        if run is not None and not run.get("model"):
            return {"run": run, "source": None}  # a run that has no model yet: what it did is all there is
        config_file = find_config_file(folder)
        # as the folder's weights are computed: Google's and NVIDIA's checkpoints change their config's "gelu"
        config, source = computed_config(folder, config_from_json_file(config_file), config_file), str(config_file)
    elif model in PRESETS:
        config, source = BertConfig.from_preset(model), f"preset {model}"
    else:
        raise ValueError(f"--model {model!r} is neither a preset ({', '.join(PRESETS)}) nor an existing folder")
    return {**({"run": run} if run else {}), **model_sizes(config, source)}


def model_sizes(config: Any, source: str) -> dict[str, Any]:
    """The config, parameter counts and FLOPs per token of a model of `config` (`source`: where it was read)."""
    # torch and the model only when run: `bertrain --help` and `bertrain info --help` import nothing heavy
    import torch

    from bertrain.model.bert import BertForPreTraining, BertModel

    with torch.device("meta"):  # shapes only: instant even for BERT-Large
        encoder, pretraining = BertModel(config), BertForPreTraining(config)
    H = config.hidden_size
    embeddings = sum(p.numel() for p in encoder.embeddings.parameters()) - (
        config.padded_vocab_size - config.vocab_size) * H
    return {
        "source": source,
        "config": dataclasses.asdict(config),
        "padded_vocab_size": config.padded_vocab_size,
        "parameters": {
            "BertModel": encoder.num_parameters(),
            "BertForPreTraining": pretraining.num_parameters(),
            "embeddings": embeddings,
            "encoder_layers": sum(p.numel() for p in encoder.encoder.parameters()),
        },
        "train_flops_per_token": {str(t): flops_per_token(config, t) for t in (128, 512)
                                  if t <= config.max_position_embeddings},
    }


# ----------------------------------------------------------------------------------------------- run folders

def run_summary(folder: Path) -> dict[str, Any] | None:
    """What a run folder holds, read from the files its run wrote (nothing is loaded): a `bertrain run` pipeline
    (`pipeline_summary`), a `bertrain pretrain` / `finetune` output folder (`training_summary`; a pipeline's
    fine-tuning stage folder: its `out/`), else None (a model or checkpoint folder)."""
    from bertrain.utils.rundir import RUN_FILE, read_run

    if not folder.is_dir():
        return None
    if (folder / "recipe.yaml").is_file() or (read_run(folder) or {}).get("command") == "run":
        return pipeline_summary(folder)
    if (folder / "config.json").is_file():
        return None  # a model or checkpoint folder (step-N holds the run's config.yaml too)
    if (folder / "stage-started.json").is_file() and (folder / "out").is_dir():
        return {**training_summary(folder / "out"), "stage": _stage_state(folder)}
    if any((folder / name).exists() for name in ("config.yaml", "metrics.jsonl", RUN_FILE)) or \
            any(_STEP_DIR.fullmatch(p.name) for p in folder.iterdir()):
        return training_summary(folder)
    return None


def training_summary(folder: Path) -> dict[str, Any]:
    """A `bertrain pretrain` / `finetune` output folder: the command, whether it finished, its checkpoints, the last
    training and evaluation records of metrics.jsonl, fine-tuning's results, and the model to describe (final/,
    else the newest complete checkpoint)."""
    from bertrain.model.card import _metrics_records, _read_json, _read_yaml
    from bertrain.train.checkpoint import COMPLETE, list_checkpoints
    from bertrain.train.evaluation import BEST, BEST_JSON
    from bertrain.utils.rundir import read_run

    record = read_run(folder) or {}
    config = _read_yaml(folder / "config.yaml") or {}
    evals, last = _metrics_records(folder / "metrics.jsonl")
    steps = list_checkpoints(folder)
    complete = [n for n, p in steps if (p / COMPLETE).is_file()]
    final = folder / "final" if (folder / "final" / "config.json").is_file() else None
    best = _read_json(folder / BEST / BEST_JSON) if (folder / BEST / "config.json").is_file() else None
    results = _read_json(folder / "eval_results.json")
    train = config.get("train") if isinstance(config.get("train"), dict) else {}
    planned = train.get("steps") or (results or {}).get("planned_steps") or None
    done = last["step"] if last else (complete[-1] if complete else 0)
    summary: dict[str, Any] = {
        "folder": str(folder),
        "command": f"bertrain {record['command']}" if record.get("command") else _command_of(config),
        "run_id": record.get("run_id"), "started": record.get("started"), "host": record.get("host"),
        "state": _training_state(folder, final is not None, complete, done, planned, results),
        "steps_done": done, "planned_steps": planned,
        "samples": last.get("samples") if last else None,
        "checkpoints": [{"step": n, "complete": (p / COMPLETE).is_file(), "path": str(p)} for n, p in steps],
        "final": str(final) if final else None,
        "best": {"path": str(folder / BEST), **best} if best else None,
        "last_log": {k: last[k] for k in ("step", *_LOG_KEYS) if k in last} if last else None,
        "last_eval": {"step": evals[max(evals)]["step"], **evals[max(evals)]["metrics"]} if evals else None,
        "results": _results_of(results) if results else None,
        "model": str(final) if final else (str(dict(steps)[complete[-1]]) if complete else None),
    }
    return summary


def _command_of(config: dict[str, Any]) -> str | None:
    data = config.get("data") if isinstance(config.get("data"), dict) else {}
    if "task" in data:
        return f"bertrain finetune glue {data['task']}"
    if "train_file" in data:
        return "bertrain finetune squad"
    return "bertrain pretrain" if "sample" in config else None


def _training_state(folder: Path, finished: bool, complete: list[int], done: int, planned: int | None,
                    results: dict[str, Any] | None) -> str:
    """One line: running, finished (and why early), or where it stopped and how to continue."""
    holder = _lock_holder(folder)
    if holder:
        return f"running: in use by {holder}"
    of = f" of {planned}" if planned else ""
    if finished:
        why = (results or {}).get("stop_reason")
        return f"finished after step {done}{of}" + (f" (stopped early: {why})" if why else "")
    if complete:
        return (f"not finished: stopped after step {done}{of}; its last complete checkpoint is step-{complete[-1]}: "
                "the same command with --resume auto continues from it")
    return f"not finished: stopped after step {done}{of}, before its first complete checkpoint (no model to resume)"


def _results_of(results: dict[str, Any]) -> dict[str, Any]:
    """Fine-tuning's eval_results.json, its numbers only: each split's metrics (GLUE) or SQuAD's official ones."""
    from bertrain.model.card import SQUAD_METRICS

    splits = {k: {m: v for m, v in values.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
              for k, values in results.items() if isinstance(values, dict) and "examples" in values}
    if splits:
        return splits
    official = {k: v for k, v in results.items() if k in SQUAD_METRICS and isinstance(v, (int, float))}
    if isinstance(results.get("eval_examples"), int):
        official["examples"] = results["eval_examples"]
    return official


def _lock_holder(folder: Path) -> str | None:
    """Who holds the output lock of `folder` (`rundir.OutputLock`) right now, or None: a shared lock is refused
    only while a command holds the exclusive one, and is given back at once."""
    from bertrain.utils.rundir import _read_holder, lock_path

    try:
        fd = os.open(lock_path(folder), os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return _read_holder(fd)
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


# the order in which `bertrain run` runs its stages (bertrain.pipeline.stages), by folder name
_STAGE_ORDER = ("vocab", "prepare", "pretrain-", "data-", "search-", "finetune-", "evaluate", "report")


def _stage_rank(name: str) -> tuple[int, str]:
    return next((i for i, p in enumerate(_STAGE_ORDER) if name == p or name.startswith(p)), len(_STAGE_ORDER)), name


def _stage_state(folder: Path) -> dict[str, Any]:
    from bertrain.model.card import _read_json

    done = _read_json(folder / "stage.json")
    started = _read_json(folder / "stage-started.json") or {}
    return {"name": folder.name, "complete": done is not None, "started": started.get("started"),
            "finished": (done or {}).get("finished"), "wall_s": (done or {}).get("wall_s"),
            "summary": (done or {}).get("summary"), "not_started": False}


def pipeline_summary(folder: Path) -> dict[str, Any]:
    """A `bertrain run` folder: the recipe, each stage that started (complete or not, its summary), the results of
    its evaluate stage (each task's metric per init over seeds, the verdict), the report, and the pretrained model
    (the last pretraining phase's final/)."""
    from bertrain.model.card import _read_json, _read_yaml
    from bertrain.utils.rundir import read_run

    record = read_run(folder) or {}
    recipe = _read_yaml(folder / "recipe.yaml") or {}
    started = sorted((_stage_state(d) for d in folder.iterdir()
                      if d.is_dir() and ".replaced-" not in d.name and (d / "stage-started.json").is_file()),
                     key=lambda st: _stage_rank(st["name"]))
    by_name = {st["name"]: st for st in started}
    # stages.json: the whole plan in its order (written by `bertrain run` since session 18; older folders have
    # only the stages that started, ordered by their names)
    plan = [p.get("name") for p in (_read_json(folder / "stages.json") or {}).get("stages") or []
            if isinstance(p, dict) and isinstance(p.get("name"), str)]
    stages = [by_name.get(name) or {"name": name, "complete": False, "started": None, "finished": None,
                                        "wall_s": None, "summary": None, "not_started": True} for name in plan]
    stages += [st for st in started if st["name"] not in plan]  # a folder of an earlier plan (the recipe changed)
    holder = _lock_holder(folder)
    if holder:
        state = f"running: in use by {holder}"
    elif by_name.get("report", {}).get("complete"):
        state = "finished"
    else:
        left = [st["name"] for st in started if not st["complete"]]
        waiting = sum(bool(st.get("not_started")) for st in stages)
        state = ("not finished" + (f": {', '.join(left)} started but not complete" if left else "")
                 + (f"{'; ' if left else ': '}{waiting} stage{'s' * (waiting != 1)} not started" if waiting else "")
                 + "; the same `bertrain run` command continues it (finished stages are skipped)")
    pretrained = [folder / st["name"] / "final" for st in stages
                  if st["name"].startswith("pretrain-") and st["complete"]]
    report = folder / "report" / "report.html"
    results = _read_json(folder / "evaluate" / "results.json")
    return {
        "folder": str(folder), "command": "bertrain run", "recipe": recipe.get("name"),
        "run_id": record.get("run_id"), "started": record.get("started"), "host": record.get("host"),
        "state": state, "stages": stages,
        "results": _pipeline_results(results) if results else None,
        "report": str(report) if report.is_file() else None,
        "model": str(pretrained[-1]) if pretrained and (pretrained[-1] / "config.json").is_file() else None,
    }


def _pipeline_results(results: dict[str, Any]) -> list[dict[str, Any]]:
    """evaluate/results.json in short: per task and metric, each init's mean, spread and seed count, the majority
    baseline and the verdict."""
    out = []
    for task in results.get("tasks") or []:
        verdicts = {(v.get("split"), v.get("metric")): v for v in task.get("verdicts") or []}
        for m in task.get("metrics") or []:
            verdict = verdicts.get((m.get("split"), m.get("metric"))) or {}
            out.append({
                "task": task.get("name"), "split": m.get("split"), "metric": m.get("metric"),
                "examples": m.get("examples"),
                "by_init": {init: {"mean": v.get("mean"), "std": v.get("std"), "seeds": len(v.get("seeds") or {})}
                            for init, v in (m.get("by_init") or {}).items()},
                "majority_baseline": m.get("majority_baseline"),
                "verdict": {k: verdict.get(k) for k in ("outcome", "reason", "difference", "interval")}
                if verdict else None})
    return out

def run(args: argparse.Namespace) -> int:
    info = describe(args.model)
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    if info.get("run"):
        print("\n".join(run_lines(info["run"])))
    if info["source"] is None:
        return 0
    print(f"model: {info['source']}")
    for k, v in info["config"].items():
        print(f"  {k:30s} {v}")
    print(f"  {'padded_vocab_size':30s} {info['padded_vocab_size']}  (internal)")
    print("parameters (without vocabulary padding):")
    for k, v in info["parameters"].items():
        print(f"  {k:30s} {v:>14,}  ({v / 1e6:.1f}M)")
    print("training FLOPs per token (forward + backward, MLM head on every token):")
    for t, f in info["train_flops_per_token"].items():
        print(f"  seq_len {t:>4s}                   {f:.3e}")
    return 0


def _num(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def _numbers(d: dict[str, Any]) -> str:
    return " ".join(f"{k} {_num(v)}" for k, v in d.items() if k != "step")


def run_lines(run: dict[str, Any]) -> list[str]:
    """`run_summary` as text."""
    who = ", ".join(x for x in (run.get("recipe") and f"recipe {run['recipe']}",
                                run.get("run_id") and f"run {run['run_id']}",
                                run.get("started") and f"started {run['started']}"
                                + (f" on {run['host']}" if run.get("host") else "")) if x)
    lines = [f"run: {run['folder']} ({run.get('command') or 'unknown command'}" + (f"; {who}" if who else "") + ")",
             f"  state: {run['state']}"]
    if "stages" in run:
        lines.append(f"  stages ({sum(st['complete'] for st in run['stages'])} of {len(run['stages'])} complete):")
        for st in run["stages"]:
            summary = _numbers(st.get("summary") or {})
            wall = st.get("wall_s")
            took = (f"{wall:.0f} s" if wall >= 10 else f"{wall:.1f} s") if isinstance(wall, (int, float)) else ""
            mark = "complete" if st["complete"] else "not started" if st.get("not_started") else "NOT COMPLETE"
            lines.append(f"    {st['name']:44s} {mark:12s} {took:>7s}"
                         + (f"  {summary}" if summary else ""))
        for r in run.get("results") or []:
            inits = ", ".join(f"{init} {_num(v['mean'])}" + (f" +- {_num(v['std'])}" if v["seeds"] > 1 else "")
                              + f" ({v['seeds']} seed{'s' * (v['seeds'] != 1)})" for init, v in r["by_init"].items())
            lines.append(f"  {r['task']} {r['split']} {r['metric']}: {inits}; majority class "
                         f"{_num(r['majority_baseline'])}")
            if r.get("verdict"):
                lines.append(f"    verdict: {r['verdict']['outcome']} ({r['verdict']['reason']})")
        if run.get("report"):
            lines.append(f"  report: {run['report']}")
        lines.append(f"  pretrained model: {run['model'] or 'none yet'}")
        return lines
    if run.get("stage"):
        st = run["stage"]
        lines.append(f"  pipeline stage {st['name']}: {'complete' if st['complete'] else 'NOT COMPLETE'}")
    done = [str(c["step"]) for c in run["checkpoints"] if c["complete"]]
    cut = [str(c["step"]) for c in run["checkpoints"] if not c["complete"]]
    lines.append(f"  checkpoints: {'step-' + ', step-'.join(done) if done else 'none complete'}"
                 + (f" (incomplete: step-{', step-'.join(cut)})" if cut else ""))
    if run.get("final"):
        lines.append(f"  final model: {run['final']}")
    if run.get("best"):
        b = run["best"]
        lines.append(f"  best model: {b['path']} (step {b.get('step')}, {b.get('metric')} {_num(b.get('value'))})")
    if run.get("last_log"):
        lines.append(f"  last training log (step {run['last_log']['step']}, {run['samples']:,} samples): "
                     f"{_numbers(run['last_log'])}")
    if run.get("last_eval"):
        lines.append(f"  last evaluation (step {run['last_eval']['step']}): {_numbers(run['last_eval'])}")
    results = run.get("results") or {}
    if results and not any(isinstance(v, dict) for v in results.values()):
        results = {"dev": results}  # SQuAD's official metrics, of its one dev file
    for split, values in results.items():
        examples = values.get("examples")
        lines.append(f"  results (eval_results.json), {split}" + (f" ({examples:,} examples)" if examples else "")
                     + f": {_numbers({k: v for k, v in values.items() if k != 'examples'})}")
    return lines
