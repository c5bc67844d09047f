"""The report stage of `bertrain run`: report.md and one self-contained report.html (no network: the plots are
matplotlib SVGs written into the page; report.md shows the same SVG files, saved beside it).

Sections: the verdict (per task, on its primary metric: does pretraining help — the difference with its 95% interval
over seeds, the seeds per side and the chance level; `bertrain.pipeline.verdict`), the results (each task's dev
scores from pretrained and from random weights, mean +- spread over seeds, the majority baseline, the BERT paper's
figure where one exists), how the dev set was used to select (a search's trials and chosen settings, a final model
chosen on dev: both make the dev scores optimistic, and the report says so), the stages (wall time, throughput),
the pretraining curves of each phase (loss, MLM and NSP accuracy on the training batches and on the held-out
documents, lr, grad norm, loss scale, seq/s), the fine-tuning curves (each run's dev metric and training loss, each
search trial's dev curve), and what it ran on: the exact recipe, package versions and hardware.
"""
from __future__ import annotations

import html
import io
import json
import math
import os
import platform
import re
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

import yaml

from bertrain.pipeline.recipe import Recipe, recipe_dict
from bertrain.pipeline.search import describe
from bertrain.pipeline.verdict import INCONCLUSIVE
from bertrain.utils.io import atomic_write_text

CURVES = (("loss", "loss (MLM + NSP)"), ("mlm_acc", "MLM accuracy"), ("nsp_acc", "NSP accuracy"), ("lr", "learning rate"),
          ("grad_norm", "grad norm"), ("loss_scale", "loss scale"), ("seq_per_s", "sequences / s"))
PACKAGES = ("bertrain", "torch", "numpy", "tokenizers", "safetensors", "scikit-learn", "scipy", "matplotlib",
            "PyYAML", "transformers", "optuna")
# The held-out evaluation's numbers drawn on the panel of the training curve they correspond to.
HELDOUT = {"loss": ("mlm_loss", "nsp_loss"), "mlm_acc": ("mlm_acc",), "nsp_acc": ("nsp_acc",)}
INIT_COLOURS = {"pretrained": "#1f77b4", "random": "#d62728"}
HELDOUT_COLOUR = "#ff7f0e"


# ----------------------------------------------------------------------------------------------- facts

def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue  # a line cut by a kill: the rest is still worth plotting
    return rows


def _metrics_rows(path: Path) -> list[dict[str, Any]]:
    """The training records of a metrics.jsonl."""
    return [r for r in _jsonl(path) if "step" in r and "loss" in r and r.get("event") is None]


def _eval_rows(path: Path) -> list[dict[str, Any]]:
    """The evaluation records of a metrics.jsonl (held-out or dev: train/evaluation.py)."""
    return [r for r in _jsonl(path) if r.get("event") == "eval" and isinstance(r.get("metrics"), dict)]


def package_versions() -> dict[str, str]:
    out = {"python": sys.version.split()[0]}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


def hardware() -> dict[str, str]:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {"platform": platform.platform(), "cpu": cpu, "cpus": str(os.cpu_count())}
    if hasattr(os, "sched_getaffinity"):
        info["cpus usable"] = str(len(os.sched_getaffinity(0)))
    try:
        mem = next(line for line in Path("/proc/meminfo").read_text().splitlines() if line.startswith("MemTotal"))
        info["memory"] = f"{int(mem.split()[1]) / 2**20:.1f} GiB"
    except (OSError, StopIteration, ValueError):
        pass
    info["threads (torch)"] = str(torch.get_num_threads())
    info["OMP_NUM_THREADS"] = os.environ.get("OMP_NUM_THREADS", "(unset)")
    if torch.cuda.is_available():
        info["gpus"] = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
        info["cuda"] = str(torch.version.cuda)
    else:
        info["gpus"] = "none (CPU)"
    world = os.environ.get("WORLD_SIZE") or os.environ.get("SLURM_NTASKS") or os.environ.get("OMPI_COMM_WORLD_SIZE")
    info["processes"] = world or "1"
    return info


def _throughput(name: str, summary: dict[str, Any], wall_s: float) -> str:
    s = summary or {}
    if name.startswith("pretrain") and s.get("seq_per_s"):
        return f"{s['seq_per_s']:,.1f} seq/s, {s.get('tokens_per_s', 0):,.0f} tokens/s ({s.get('steps')} steps)"
    if name == "prepare" and s.get("tokens_per_s"):
        return f"{s['tokens_per_s']:,.0f} tokens/s, {s.get('input_mb_per_s', 0):.2f} MB/s ({s.get('num_tokens'):,} tokens)"
    if name == "vocab" and s.get("words"):
        return f"{s['words'] / max(wall_s, 1e-9):,.0f} words/s ({s.get('tokens')} WordPieces)"
    if name.startswith(("finetune", "search")) and s.get("train_examples_per_second"):
        windows = f"{s['train_windows_per_second']:,.1f} windows/s, " if s.get("train_windows_per_second") else ""
        return f"{s['train_examples_per_second']:,.1f} examples/s ({windows}{s.get('train_steps')} steps)"
    if name.startswith("data-") and s.get("train"):
        return f"{s['train']} train / {s.get('dev')} dev examples"
    return ""


def _fmt_s(s: float | None) -> str:
    if s is None:
        return "—"
    return f"{s:.1f} s" if s < 120 else f"{int(s // 60)} min {s % 60:02.0f} s"


def _fmt(v: float | None, pct: bool) -> str:
    if v is None:
        return "—"
    if not math.isfinite(v):  # a seed or trial that scored NaN or inf: a mean over it is no number ("nan" before)
        return "no number"
    return f"{100 * v:.1f}" if pct else f"{v:.1f}"


# ----------------------------------------------------------------------------------------------- plots

def _svg(fig: Any) -> str:
    import matplotlib.pyplot as plt

    buf = io.StringIO()
    fig.savefig(buf, format="svg", bbox_inches="tight")
    plt.close(fig)
    text = buf.getvalue()
    text = text[text.index("<svg"):]  # drop the XML prologue and doctype: the page embeds the element
    # its natural size (width/height in pt), shrunk to the page when narrower (the viewBox keeps the aspect)
    return text.replace("<svg ", '<svg style="max-width:100%;height:auto" ', 1)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # no display: files only
    matplotlib.rcParams["svg.fonttype"] = "none"  # text stays text: smaller, selectable
    matplotlib.rcParams["svg.hashsalt"] = "bertrain"  # stable element ids: the same run gives the same file
    import matplotlib.pyplot as plt
    return plt


def _line(ax: Any, xs: list[float], ys: list[float], **kw: Any) -> None:
    """A curve; a short one's few points stay visible as markers."""
    ax.plot(xs, ys, lw=kw.pop("lw", 1.2), marker=kw.pop("marker", "o" if len(xs) < 20 else None),
            ms=kw.pop("ms", 3), **kw)


def _axes_style(ax: Any, title: str, xlabel: str) -> None:
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(xlabel, fontsize=8)
    ax.tick_params(labelsize=8)
    ax.grid(alpha=0.3)


def curves_svg(rows: list[dict[str, Any]], title: str, evals: list[dict[str, Any]] | None = None,
               heldout: str = "") -> str:
    """A pretraining phase's curves: the training records, and beside them on the loss and accuracy panels the
    held-out evaluations (`evals`; `heldout` says what the held-out set is)."""
    plt = _pyplot()
    evals = evals or []
    fig, axes = plt.subplots(2, 4, figsize=(13, 5.2))
    steps = [r["step"] for r in rows]
    for ax, (key, label) in zip(axes.flat, CURVES):
        pts = [(s, r[key]) for s, r in zip(steps, rows) if r.get(key) is not None]
        held = [(e["step"], sum(e["metrics"][k] for k in HELDOUT[key])) for e in evals
                if key in HELDOUT and all(e["metrics"].get(k) is not None for k in HELDOUT[key])]
        if pts:
            _line(ax, [p[0] for p in pts], [p[1] for p in pts], color=INIT_COLOURS["pretrained"],
                  label="training batches" if held else None)
        if held:
            _line(ax, [p[0] for p in held], [p[1] for p in held], color=HELDOUT_COLOUR, marker="s", ms=3.5,
                  label="held-out")
            ax.legend(fontsize=7)
        if not pts and not held:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes, color="grey")
        _axes_style(ax, label, "step")
    last = axes.flat[-1]
    last.axis("off")
    if rows:
        r = rows[-1]
        lines = [f"{title}", f"steps: {r['step']}", f"final loss: {r['loss']:.3f}"]
        lines += [f"final {k}: {r[k]:.3f}" for k in ("mlm_acc", "nsp_acc") if r.get(k) is not None]
        if evals:
            m = evals[-1]["metrics"]
            lines += [f"held-out at step {evals[-1]['step']}:"] + [f"  {k}: {m[k]:.3f}" for k in
                                                                  ("mlm_acc", "nsp_acc") if m.get(k) is not None]
            lines += [heldout] if heldout else []
        else:
            lines += ["no held-out evaluation", "(no held-out set, or eval off)"]
        last.text(0.0, 0.98, "\n".join(lines), va="top", fontsize=9, transform=last.transAxes)
    fig.suptitle(title, fontsize=12)
    fig.tight_layout()
    return _svg(fig)


def finetune_curves_svg(task: str, runs: list[dict[str, Any]], trials: list[dict[str, Any]],
                        chance: float | None, scale: float) -> str:
    """A task's fine-tuning curves: each run's dev metric (its evaluations) and training loss by step, and each
    search trial's dev curve by evaluation (pruned ones dashed, the chosen one thick). `runs`/`trials`: label, init,
    evals, rows (trials: state, chosen)."""
    plt = _pyplot()
    metric = next((e["metric"] for r in runs + trials for e in r["evals"]), "dev metric")
    n = 2 + (1 if trials else 0)
    fig, axes = plt.subplots(1, n, figsize=(4.6 * n, 3.8), squeeze=False)
    dev, loss = axes[0][0], axes[0][1]
    styles = ["-", "--", ":", "-."]
    for i, r in enumerate(runs):
        colour = INIT_COLOURS.get(r["init"], "grey")
        style = styles[r["index"] % len(styles)]
        if r["evals"]:
            _line(dev, [e["step"] for e in r["evals"]], [scale * e["value"] for e in r["evals"]], color=colour,
                  ls=style, label=r["label"])
        if r["rows"]:
            _line(loss, [x["step"] for x in r["rows"]], [x["loss"] for x in r["rows"]], color=colour, ls=style,
                  label=r["label"], marker=None)
    if chance is not None:
        dev.axhline(scale * chance, color="grey", ls="--", lw=1, label="chance")
    _axes_style(dev, f"{task}: dev {metric}", "step")
    _axes_style(loss, f"{task}: training loss", "step")
    for ax in (dev, loss):
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    if trials:
        ax = axes[0][2]
        for t in trials:
            colour = INIT_COLOURS.get(t["init"], "grey")
            ys = [scale * e["value"] for e in t["evals"]]
            _line(ax, list(range(1, len(ys) + 1)), ys, color=colour, lw=2.4 if t["chosen"] else 0.9,
                  ls="--" if t["state"] == "pruned" else "-", marker="x" if t["state"] == "pruned" else "o",
                  label=t["label"] if t["chosen"] else None)
        if chance is not None:
            ax.axhline(scale * chance, color="grey", ls="--", lw=1)
        _axes_style(ax, f"search trials: dev {metric} (dashed: pruned)", "evaluation")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.tight_layout()
    return _svg(fig)


def results_svg(task: dict[str, Any]) -> str:
    """Each seed's score, pretrained vs random initialisation, with the majority baseline and the paper's figure."""
    plt = _pyplot()
    metrics = task["metrics"]
    scale = 1.0 if task["kind"] == "squad" else 100.0  # the table's units: percent
    fig, axes = plt.subplots(1, len(metrics), figsize=(max(6.0, 4.0 * len(metrics)), 4.0), squeeze=False)
    for ax, m in zip(axes[0], metrics):
        inits = list(m["by_init"])
        for x, init in enumerate(inits):
            s = m["by_init"][init]
            vals = [scale * v for v in s["seeds"].values()]
            colour = INIT_COLOURS.get(init, "grey")
            ax.bar(x, scale * s["mean"], width=0.6, color=colour, alpha=0.35)
            ax.errorbar(x, scale * s["mean"], yerr=scale * s["std"], color=colour, capsize=6, lw=1.5)
            ax.scatter([x] * len(vals), vals, color=colour, zorder=3, s=18)
        if m.get("majority_baseline") is not None:
            ax.axhline(scale * m["majority_baseline"], color="grey", ls="--", lw=1, label="majority class")
        if m.get("paper") is not None:
            ax.axhline(scale * m["paper"], color="green", ls=":", lw=1.5, label=f"BERT-{m['paper_model']} (paper)")
        ax.set_xticks(range(len(inits)), [f"{i}\n({len(m['by_init'][i]['seeds'])} seeds)" for i in inits])
        ax.set_title(f"{task['name']}: {m['metric']} ({m['split']})", fontsize=10)
        # from zero, or lower: a correlation (MCC, Pearson) of a model that learned nothing may be below zero, and
        # a floor at 0 hid those bars and seeds (NaN or inf scores, from a constant prediction, are not drawn)
        low = min([0.0] + [scale * v for s in m["by_init"].values() for v in s["seeds"].values()
                           if math.isfinite(v)])
        ax.set_ylim(bottom=low * 1.1 if low < 0 else 0)
        ax.grid(axis="y", alpha=0.3)
        if m.get("majority_baseline") is not None or m.get("paper") is not None:
            ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    return _svg(fig)


# ----------------------------------------------------------------------------------------------- the report

def _results_rows(results: dict[str, Any]) -> list[list[str]]:
    rows = []
    for task in results.get("tasks", []):
        for m in task["metrics"]:
            pct = m["metric"] not in ("exact", "exact_match", "f1") or task["kind"] != "squad"
            cells = [task["name"], m["split"], m["metric"]]
            for init in ("pretrained", "random"):
                s = m["by_init"].get(init)
                n = len(s["seeds"]) if s is not None else 0
                if s is None:
                    cells.append("—")
                elif s.get("not_finite"):  # evaluate._spread: no mean or spread over a NaN score
                    cells.append(f"no number: {s['not_finite']} of {n} seeds scored NaN or inf")
                elif n == 1:  # one seed has no spread: "± 0.0" would claim a spread of zero
                    cells.append(f"{_fmt(s['mean'], pct)} (n=1: no spread)")
                else:
                    cells.append(f"{_fmt(s['mean'], pct)} ± {_fmt(s['std'], pct)} "
                                 f"({_fmt(s['min'], pct)}–{_fmt(s['max'], pct)}, n={n})")
            cells.append(_fmt(m.get("majority_baseline"), pct))
            cells.append(f"{_fmt(m['paper'], pct)} (BERT-{m['paper_model']})" if m.get("paper") is not None else "—")
            rows.append(cells)
    return rows


RESULT_HEADER = ["task", "split", "metric", "pretrained: mean ± sd (min–max, n)", "random init: mean ± sd",
                 "majority class", "BERT paper"]
STAGE_HEADER = ["stage", "what", "wall time", "throughput", "finished"]


def _verdict_line(task: dict[str, Any], v: dict[str, Any]) -> str:
    """One task's verdict (`bertrain.pipeline.verdict`) in words, with its numbers in the table's units."""
    scale = 1.0 if task["kind"] == "squad" else 100.0
    n_p, n_r = v["seeds"]["pretrained"], v["seeds"]["random"]
    seeds = (f"{n_p} seed{'s' * (n_p != 1)} per side" if n_p == n_r
             else f"{n_p} pretrained / {n_r} random-init seed{'s' * (n_r != 1)}")
    what = v["metric"] if v["split"] == "dev" else f"{v['split']} {v['metric']}"
    line = f"{task['name']} ({what}): {v['outcome']}"
    if v["outcome"] == INCONCLUSIVE:
        line += f" ({v['reason']})"
    if v["difference"] is not None:
        line += f": {scale * v['difference']:+.1f} points"
        if v["interval"] is not None:
            lo, hi = v["interval"]
            line += f" ({100 * v['confidence']:g}% CI {scale * lo:+.1f} to {scale * hi:+.1f}, Welch, {seeds})"
        else:
            line += f" ({seeds})"
    sides = [f"{init} {_fmt(mean, scale == 100.0)}" for init, mean in v["means"].items() if mean is not None]
    chance = ("chance level unknown" if v["chance"] is None
              else f"chance {scale * v['chance']:.1f} ({v['chance_source']})")
    return line + "; " + ", ".join(sides + [chance])


def _verdict(results: dict[str, Any]) -> list[str]:
    """One line per task (per evaluation split of its primary metric) from the evaluate stage's verdicts."""
    return [_verdict_line(task, v) for task in results.get("tasks", []) for v in task.get("verdicts", [])]


def _selection_notes(results: dict[str, Any]) -> list[str]:
    """How each task used its dev set to select, in words: a search, a final model chosen on dev, or neither."""
    notes = []
    for task in results.get("tasks", []):
        fm, sr = task.get("final_model"), task.get("search")
        if sr:
            by_init = sr["by_init"]
            first = next(iter(by_init.values()))
            chosen = "; ".join(f"from {init} weights {describe(b['params'])} (trial {b['chosen']})"
                               for init, b in by_init.items())
            notes.append(f"{task['name']}: the fine-tuning settings were chosen on the dev set ({sr['method']} search "
                         f"over {', '.join(sr['keys'])}, {len(first['trials'])} trials per initialisation on seed "
                         f"{first['seed']}, pruner: {sr['pruner']}; each initialisation chose its own): {chosen}. "
                         "The dev scores of the chosen settings are therefore optimistic — the dev set that scores "
                         f"them also chose them (seed {first['seed']}'s run repeats the chosen trial); an unbiased "
                         "figure needs data that took no part in the choice.")
        if fm and fm["final"] == "best":
            notes.append(f"{task['name']}: each run ends with its best dev evaluation (eval.final: best, by "
                         f"{fm['metric']}): the dev set chose the model it then scores, so these dev scores are "
                         "optimistic.")
        elif fm and fm.get("stopped_on_dev"):
            stopped = fm["stopped_on_dev"]
            notes.append(f"{task['name']}: each run ends with its last model (eval.final: last), but "
                         f"{len(stopped)} run{'s' * (len(stopped) != 1)} stopped early on a dev evaluation "
                         f"({', '.join(stopped)}; {next(iter(stopped))}: {next(iter(stopped.values()))}): the dev "
                         "set chose where they stopped, so their dev scores are optimistic.")
        elif fm:
            notes.append(f"{task['name']}: each run ends with its last model (eval.final: last): the dev set did not "
                         "choose it; the dev evaluations while training are shown as curves only.")
    return notes


SEARCH_HEADER = ["trial", "settings", "dev value", "evaluations", "state"]


def _search_tables(results: dict[str, Any]) -> list[tuple[str, list[list[str]]]]:
    """(caption, rows) of every trial of each task's search, per initialisation; the chosen trial is marked."""
    out = []
    for task in results.get("tasks", []):
        sr = task.get("search")
        for init, b in (sr or {}).get("by_init", {}).items():
            pct = task["kind"] != "squad"
            rows = []
            for t in b["trials"]:
                state = (f"pruned at evaluation {t['pruned']['evaluation']}" if t["state"] == "pruned"
                         else "complete")
                rows.append([f"{t['trial']}{' (chosen)' if t['trial'] == b['chosen'] else ''}",
                             describe(t["params"]), _fmt(t["value"], pct), str(len(t["curve"])), state])
            best = _fmt(b["value"], pct)
            out.append((f"{task['name']} from {init} weights: best on dev {b['metric']} {best} with "
                        f"{describe(b['params'])} (trial {b['chosen']} of {len(b['trials'])}, seed {b['seed']}, "
                        f"{'higher' if b['maximise'] else 'lower'} is better)", rows))
    return out


def _run_curves(stages: list[Any], task: str, results_task: dict[str, Any] | None) -> tuple[list, list]:
    """The fine-tuning runs and search trials of `task`, with their evaluations and training records."""
    runs, trials = [], []
    seeds_seen: dict[str, int] = {}
    chosen = {init: b["chosen"] for init, b in
              ((results_task or {}).get("search") or {}).get("by_init", {}).items()}
    for s in stages:
        for prefix, into, kind in ((f"finetune-{task}-", runs, "s"), (f"search-{task}-", trials, "t")):
            # the whole name: a prefix alone took task `a-b`'s stages into task `a`'s curves as well
            match = re.fullmatch(re.escape(prefix) + rf"(pretrained|random)-({kind}-?\d+)", s.name)
            if match is None or s.config is None:
                continue
            init, tail = match.groups()
            metrics = Path(s.config.output_dir) / "metrics.jsonl"
            entry = {"init": init, "evals": _eval_rows(metrics), "rows": _metrics_rows(metrics)}
            if into is runs:
                entry.update(label=f"{init} seed {tail[1:]}", index=seeds_seen.get(init, 0))
                seeds_seen[init] = seeds_seen.get(init, 0) + 1
            else:
                rec = _read_json(s.folder / "trial.json") or {}
                k = int(tail[1:])
                entry.update(label=f"{init}: trial {k} (chosen)", state=rec.get("state", "running"),
                             chosen=chosen.get(init) == k)
            if entry["evals"] or entry["rows"]:
                into.append(entry)
    return runs, trials


def _chance_of(results_task: dict[str, Any] | None, metric: str) -> float | None:
    for v in (results_task or {}).get("verdicts", []):
        if v["metric"] == metric:
            return v["chance"]
    return None


def _heldout_note(stage: Any) -> str:
    """What a pretraining phase's held-out set is (from its prepared store's stats.json)."""
    stats = _read_json(Path(stage.config.data.prepared) / "stats.json") or {}
    h = stats.get("heldout") or {}
    if not h.get("dir"):
        return ""
    return f"held-out: {h.get('num_documents')} documents, {h.get('num_tokens'):,} tokens"


def write_report(recipe: Recipe, run_dir: Path, stages: list[Any], out_dir: Path) -> Path:
    """Write out_dir/report.md, out_dir/report.html and the SVGs report.md shows; returns the HTML path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    results = _read_json(run_dir / "evaluate" / "results.json") or {"tasks": []}
    title = recipe.report.title or f"bertrain run: {recipe.name}"
    stage_rows, figures = [], []
    for s in stages:
        if s.name == "report":
            continue
        info = _read_json(s.folder / "stage.json") or {}
        wall = info.get("wall_s")
        stage_rows.append([s.name, s.what, _fmt_s(wall), _throughput(s.name, info.get("summary", {}), wall or 0),
                           info.get("finished", "—")])
    for task in results.get("tasks", []):
        if task["metrics"]:
            figures.append((f"results-{task['name']}", f"Fine-tuning results: {task['name']}", results_svg(task)))
    for s in stages:
        if s.name.startswith("pretrain-phase"):
            rows = _metrics_rows(s.folder / "metrics.jsonl")
            if rows:
                seq = s.config.sample.max_seq_length
                figures.append((f"curves-{s.name}", f"Pretraining curves: {s.name} (sequence length {seq}): "
                                "training batches and held-out documents",
                                curves_svg(rows, f"{s.name}, sequence length {seq}",
                                           _eval_rows(s.folder / "metrics.jsonl"), _heldout_note(s))))
    by_task = {t["name"]: t for t in results.get("tasks", [])}
    for task in recipe.finetune:
        runs, trials = _run_curves(stages, task.name, by_task.get(task.name))
        if runs or trials:
            metric = next((e["metric"] for r in runs + trials for e in r["evals"]), "")
            figures.append((f"finetune-{task.name}", f"Fine-tuning curves: {task.name} (dev {metric} at each "
                            "evaluation, training loss)" + (", and the search's trials" if trials else ""),
                            finetune_curves_svg(task.name, runs, trials, _chance_of(by_task.get(task.name), metric),
                                                1.0 if task.kind == "squad" else 100.0)))
    notes, searches = _selection_notes(results), _search_tables(results)
    versions, hw = package_versions(), hardware()
    recipe_yaml = yaml.safe_dump(recipe_dict(recipe), sort_keys=False)
    verdict = _verdict(results)
    written = time.strftime("%Y-%m-%d %H:%M:%S")
    total = sum((_read_json(s.folder / "stage.json") or {}).get("wall_s", 0.0) for s in stages if s.name != "report")

    # ---- markdown
    def md_table(header: list[str], rows: list[list[str]]) -> str:
        esc = lambda c: str(c).replace("|", "\\|")  # noqa: E731
        return "\n".join(["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
                         + ["| " + " | ".join(esc(c) for c in r) + " |" for r in rows])

    md = [f"# {title}", "", recipe.description.strip(), "", f"Run folder `{run_dir}`, report written {written}; "
          f"stages took {_fmt_s(total)} in all (each stage's time is that of its last attempt).", ""]
    if verdict:
        md += ["## Verdict", ""] + [f"- {v}" for v in verdict] + [""]
    md += ["## Fine-tuning results (dev set)", "", md_table(RESULT_HEADER, _results_rows(results)) or "(no tasks)", "",
           "Accuracy-type metrics in percent. GLUE figures of the BERT paper are test-server scores.", ""]
    for name, caption, svg in figures:
        atomic_write_text(out_dir / f"{name}.svg", svg)
        if name.startswith("results-"):
            md += [f"![{caption}]({name}.svg)", ""]
    if notes:
        md += ["## How the dev set was used", ""] + [f"- {n}" for n in notes] + [""]
    for caption, rows in searches:
        md += [f"### Search: {caption}", "", md_table(SEARCH_HEADER, rows), ""]
    md += ["## Stages", "", md_table(STAGE_HEADER, stage_rows), "", "## Pretraining curves", ""]
    md += [f"![{caption}]({name}.svg)" for name, caption, _ in figures if name.startswith("curves-")] + [""]
    if any(name.startswith("finetune-") for name, _, _ in figures):
        md += ["## Fine-tuning curves", ""]
        md += [f"![{caption}]({name}.svg)" for name, caption, _ in figures if name.startswith("finetune-")] + [""]
    md += ["## Environment", "", md_table(["package", "version"], [[k, v] for k, v in versions.items()]), "",
           md_table(["hardware", ""], [[k, v] for k, v in hw.items()]), "", "## Recipe (resolved)", "", "```yaml",
           recipe_yaml.rstrip(), "```", ""]
    atomic_write_text(out_dir / "report.md", "\n".join(md))

    # ---- html: one file, everything inline
    e = html.escape

    def h_table(header: list[str], rows: list[list[str]]) -> str:
        head = "".join(f"<th>{e(h)}</th>" for h in header)
        body = "".join("<tr>" + "".join(f"<td>{e(str(c))}</td>" for c in r) + "</tr>" for r in rows)
        return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"

    def fig(name: str) -> str:
        return "".join(f'<figure>{svg}<figcaption>{e(caption)}</figcaption></figure>'
                       for n, caption, svg in figures if n.startswith(name))

    parts = [f"<h1>{e(title)}</h1>", f"<p>{e(recipe.description.strip())}</p>",
             f"<p class=meta>Run folder <code>{e(str(run_dir))}</code>, report written {e(written)}; stages took "
             f"{e(_fmt_s(total))} in all (each stage's time is that of its last attempt).</p>"]
    if verdict:
        parts += ["<h2>Verdict</h2><ul>" + "".join(f"<li>{e(v)}</li>" for v in verdict) + "</ul>"]
    parts += ["<h2>Fine-tuning results (dev set)</h2>", h_table(RESULT_HEADER, _results_rows(results)),
              "<p class=meta>Accuracy-type metrics in percent. GLUE figures of the BERT paper are test-server "
              "scores.</p>", fig("results-")]
    if notes:
        parts += ["<h2>How the dev set was used</h2><ul>" + "".join(f"<li>{e(n)}</li>" for n in notes) + "</ul>"]
    for caption, rows in searches:
        parts += [f"<h3>Search: {e(caption)}</h3>", h_table(SEARCH_HEADER, rows)]
    parts += ["<h2>Stages</h2>", h_table(STAGE_HEADER, stage_rows), "<h2>Pretraining curves</h2>", fig("curves-")]
    if any(name.startswith("finetune-") for name, _, _ in figures):
        parts += ["<h2>Fine-tuning curves</h2>", fig("finetune-")]
    parts += ["<h2>Environment</h2><div class=row>",
              h_table(["package", "version"], [[k, v] for k, v in versions.items()]),
              h_table(["hardware", ""], [[k, v] for k, v in hw.items()]), "</div>",
              "<h2>Recipe (resolved)</h2>", f"<pre>{e(recipe_yaml)}</pre>"]
    style = ("body{font-family:system-ui,-apple-system,'Segoe UI',sans-serif;max-width:1200px;margin:2em auto;"
             "padding:0 1em;color:#222;background:#fff}h1{font-size:1.6em}h2{border-bottom:1px solid #ddd;"
             "padding-bottom:.2em;margin-top:1.6em}table{border-collapse:collapse;margin:.6em 1.5em .6em 0;"
             "font-size:.9em}th,td{border:1px solid #ccc;padding:.3em .6em;text-align:left;vertical-align:top}"
             "th{background:#f2f4f7}tr:nth-child(even) td{background:#fafbfc}pre{background:#f6f8fa;padding:1em;"
             "overflow:auto;font-size:.8em;border:1px solid #e1e4e8}figure{margin:1em 0}figcaption{color:#555;"
             "font-size:.9em}.meta{color:#555}.row{display:flex;flex-wrap:wrap;align-items:flex-start}"
             "code{background:#f2f4f7;padding:0 .2em}td:first-child,td:last-child{white-space:nowrap}")
    page = (f"<!DOCTYPE html>\n<html lang=en><head><meta charset=utf-8><title>{e(title)}</title>"
            f"<meta name=viewport content='width=device-width, initial-scale=1'><style>{style}</style></head>"
            f"<body>{''.join(parts)}</body></html>\n")
    path = out_dir / "report.html"
    atomic_write_text(path, page)
    return path
