"""Time to quality: bertrain vs the Hugging Face Trainer, pretraining the same small BERT on the same data for the
same wall-clock budget; every checkpoint of both scored afterwards by ONE held-out evaluator. Not a test: run by
hand on an idle machine, numbers go to BENCHMARKS.md (issue "Time to quality").

    python benchmarks/time_to_quality.py pretrain --out runs/ttq --budget 10m --seeds 1 2
    python benchmarks/time_to_quality.py score runs/ttq        # re-score every checkpoint of an existing DIR
    python benchmarks/time_to_quality.py report runs/ttq       # re-make ttq_pretrain.png and summary.md
    python benchmarks/time_to_quality.py finetune ...          # benchmarks/ttq_finetune.py (its own options)

Proved end to end with this smoke run (2-core CPU; a tiny model, far too short to mean anything):

    python benchmarks/time_to_quality.py pretrain --out /tmp/ttq-pretrain-smoke --budget 30s --seeds 1 2 --layers 2 \
        --hidden 64 --heads 2 --intermediate 128 --vocab-size 2000 --save-every 20 --warmup 10

What users pay for is the time to a quality, not steps/s, so the output is held-out MLM accuracy against wall time
for both (DIR/ttq_pretrain.png), the time each needs to reach HF's final accuracy, and their ratio
(DIR/summary.md; goal: bertrain <= 0.5x HF's time). Everything is in DIR/results.json.

Method and fairness:

* Data, prepared once before any timing (DIR/data): the Wikipedia sample of ../shared/data plus the built-in
  python-docs text (the corpus of `bertrain run`'s main recipe, configs/recipes/pydoc-small.yaml); one WordPiece
  vocabulary (`bertrain vocab`'s trainer and default size); `bertrain prepare` with MLM-only packing, dynamic
  masking, no short sequences (run_mlm has none) and the default held-out split (whole documents set aside in
  DIR/data/prepared/heldout, never trained on by either side). The HF side trains on exactly bertrain's training
  documents and token ids: each document of the prepared TRAINING store becomes [CLS] ids [SEP] (what the tokenizer
  gives run_mlm per text), all are concatenated and cut into chunks of --seq tokens, the remainder dropped
  (run_mlm's group_texts; run_mlm groups per `datasets.map` batch of 1000 texts, which drops at most one partial
  chunk more per 1000 documents). bertrain packs the same token stream into [CLS] ... [SEP] blocks of --seq tokens.
* Masking rate: 15% on both sides, 80/10/10. HF's DataCollatorForLanguageModeling draws each non-special token
  with probability 0.15; bertrain masks round(0.15 x length) tokens per sample (at most ceil(0.15 x seq): never the
  cap at the lengths used here), so the expected number of targets per sample is the same.
* Model: one config.json (DIR/data/model_config.json) for both: the given layers/hidden/heads/intermediate, 512
  positions, dropout 0.1, init std 0.02. HF: `BertForMaskedLM` (its MLM head scores every position, as run_mlm's
  does); bertrain: `BertForPreTraining` as it ships (unpadding, the MLM head on the masked positions only).
* Optimisation, the same numbers on both: AdamW (torch's fused kernel on both: HF's default adamw_torch_fused,
  bertrain's adamw), betas (0.9, 0.999), eps 1e-6, weight decay 0.01 (not on biases and LayerNorm, on both), grad
  clipping at 1.0, --lr, --schedule over --warmup steps (HF's warmup starts at lr 0, bertrain's at lr/warmup: one
  step apart), batch --batch with no accumulation; --precision on both (auto: fp32 on CPU, bf16 autocast on
  CUDA); `torch.set_num_threads
  (--threads)` and OMP_NUM_THREADS in both processes; data loading in the training process on both sides (HF
  dataloader_num_workers=0, bertrain data.num_workers=0: on a 2-core machine a loader process would only take
  cores from the model's threads).
* Wall time: each side runs as its own process; time zero is taken just before the process is launched, so its
  start-up (imports, model and data set-up) counts against it. bertrain stops with train.max_time = --budget (its
  budget counts from its first step, so it ends its startup's seconds later than HF; the curves and times to
  target are all measured from launch); HF stops through a TrainerCallback at --budget after launch. Both save a
  full, resumable checkpoint (weights, optimizer, schedule, RNG) every --save-every steps and at the end.
* Checkpoint times: the wall time since launch when the checkpoint was complete: for HF, a TrainerCallback's
  on_save (called after the folder is written) appends {step, wall_s} to saves.jsonl; for bertrain, the mtime of
  the step-N folder's COMPLETE marker, written last, a few milliseconds before the folder is renamed into place.
* Order: per seed the sides alternate A B, B A, ... (bertrain s1, HF s1, HF s2, bertrain s2), so a drift of the
  machine's speed does not favour one side; recorded in results.json with the load average at each launch.
* Scoring (after all training, on --device): ONE evaluator for every checkpoint of both sides: bertrain's fixed
  held-out set (`HeldoutEvalSet`, --eval-samples samples; the default 2048 is bertrain's own eval.max_samples, all
  of the held-out blocks of this corpus) through bertrain's training-time evaluation (`Evaluator.evaluate` ->
  `PretrainingTask.evaluate`); HF checkpoints are converted into the same bertrain model (bertrain.model.hf), so
  both go through the same forward pass and metric. bertrain's own in-training evaluation is off (it would cost
  bertrain time that HF does not pay). The chance level is the accuracy of always predicting the training store's
  most frequent token on the same masked positions.
* Verdict: the target is the mean over HF seeds of each seed's final accuracy; per seed, the ratio of the two
  sides' times to reach it (a side that never reaches it only bounds the ratio). Goal met when every seed's ratio
  is <= 0.5, missed when every one is above, inconclusive otherwise or with one seed.

Checkpoints: every --save-every steps on both sides, so the side with faster steps writes more of them (each
write, and bertrain's checksums of it, counts against that side: a handicap for the faster one). Each holds the
optimizer state (~12 bytes per parameter): with the defaults (~11M parameters with a 30k vocabulary) about 135 MB,
some 5-11 GB for 2 seeds x 2 sides in 10 minutes on 2 cores.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import logging
import math
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

# Only numpy and the standard library at import: both training processes import this file, and neither side
# should pay for the other's imports (the HF process never imports bertrain, the bertrain process never imports
# transformers).
if TYPE_CHECKING:
    from bertrain.data.samples import SampleConfig
    from bertrain.data.store import TokenStore

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("BERTRAIN_SHARED_DATA", REPO.parent / "shared" / "data"))
WIKI = "wiki/enwiki-sample-pages-articles.xml.bz2"
BUILTIN_TEXT = "builtin:python-docs"  # the corpus of `bertrain run configs/recipes/pydoc-small.yaml`
SIDES = ("bertrain", "hf")
PRECISIONS = ("fp32", "bf16")
SIDE_NAMES = {"bertrain": "bertrain", "hf": "HF Trainer"}
GOAL_RATIO = 0.5
SCHEDULES = {"constant_with_warmup": "constant", "linear": "linear"}  # HF name -> bertrain name

# The settings both sides share and the CLI does not change (bertrain's defaults, given to HF explicitly).
BETAS = (0.9, 0.999)
EPS = 1e-6
WEIGHT_DECAY = 0.01
MAX_GRAD_NORM = 1.0
MLM_PROBABILITY = 0.15
MAX_POSITIONS = 512
DROPOUT = 0.1
LOG_INTERVAL = 10
LOADER_WORKERS = 0
NO_STEP_LIMIT = 10 ** 9  # HF's max_steps when only the time budget ends the run

RESULTS, PLOT, SUMMARY = "results.json", "ttq_pretrain.png", "summary.md"

log = logging.getLogger("ttq")


# ----------------------------------------------------------------------------------------------- shared helpers
# (benchmarks/ttq_finetune.py imports these two)

def time_to_reach(curve: list[tuple[float, float]], target: float) -> float | None:
    """The first time of `curve` ((wall seconds, metric) points sorted by time) whose metric is >= `target`, with
    no interpolation between points; None if the curve never gets there."""
    times = [t for t, _ in curve]
    if times != sorted(times):
        raise ValueError("time_to_reach: the curve's points must be sorted by time")
    for t, value in curve:
        if value >= target:
            return t
    return None


def plot_curves(curves: dict[str, list[tuple[float, float]]], path: str | Path, ylabel: str, title: str,
                target: float | None = None) -> None:
    """One line per label of `curves` ((wall seconds, metric) points) against wall time, with a dashed horizontal
    line at `target`; written to `path` with matplotlib's Agg backend (no display needed)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 5))
    FigureCanvasAgg(fig)  # the Agg backend, without pyplot's global state
    ax = fig.add_subplot()
    colours: dict[str, str] = {}
    styles = ["-", "--", ":", "-."]
    for label, points in curves.items():
        if points:
            # the seeds of one side ("bertrain s1", "bertrain s2") share a colour, each with its own line style
            group = re.sub(r" s\d+$", "", label)
            colour = colours.setdefault(group, f"C{len(colours)}")
            style = styles[sum(1 for k in curves if re.sub(r" s\d+$", "", k) == group and k < label) % len(styles)]
            xs, ys = zip(*points)
            ax.plot(xs, ys, marker="o", markersize=3, color=colour, linestyle=style, label=label)
    if target is not None:
        ax.axhline(target, linestyle="--", color="grey", label=f"target {target:.4g}")
    ax.set_xlabel("wall-clock time since launch (s)")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(str(path), dpi=120)


# ----------------------------------------------------------------------------------------------- settings

def resolve_precision(precision: str | None, device: str) -> str:
    """Both benchmarks' --precision: auto (or none given, as in a results.json from before the option) is fp32 on a
    CPU and bf16 autocast on CUDA."""
    return precision if precision and precision != "auto" else ("bf16" if device == "cuda" else "fp32")


@dataclass
class Settings:
    """What one comparison runs with (the `pretrain` options); stored in results.json."""
    budget: str = "10m"
    seeds: list[int] = field(default_factory=lambda: [1, 2])
    device: str = "cpu"
    threads: int = 2
    save_every: int = 10
    vocab_size: int = 30522
    layers: int = 4
    hidden: int = 256
    heads: int = 4
    intermediate: int = 1024
    batch: int = 32
    seq: int = 128
    lr: float = 5e-4
    warmup: int = 100
    schedule: str = "constant_with_warmup"
    steps: int = 0
    eval_samples: int = 2048
    sides: list[str] = field(default_factory=lambda: list(SIDES))
    precision: str = "auto"
    """fp32 or bf16 (autocast) on both sides; auto: fp32 on CPU, bf16 on CUDA."""

    def __post_init__(self) -> None:
        from bertrain.train.config import parse_duration

        self.budget_s = parse_duration("--budget", self.budget)  # raises naming the option
        errors = [f"--{k.replace('_', '-')} must be >= 1, got {getattr(self, k)}"
                  for k in ("threads", "save_every", "vocab_size", "layers", "hidden", "heads", "intermediate",
                            "batch", "eval_samples") if getattr(self, k) < 1]
        if not 8 <= self.seq <= MAX_POSITIONS:
            errors.append(f"--seq must be in [8, {MAX_POSITIONS}], got {self.seq}")
        if self.hidden % self.heads:
            errors.append(f"--hidden ({self.hidden}) must be a multiple of --heads ({self.heads})")
        if self.lr <= 0 or self.warmup < 0 or self.steps < 0:
            errors.append("--lr must be > 0, --warmup and --steps >= 0")
        if self.schedule not in SCHEDULES:
            errors.append(f"--schedule {self.schedule!r}: choose one of {', '.join(SCHEDULES)}")
        elif self.schedule == "linear" and not self.steps:
            errors.append("--schedule linear decays over --steps S: give --steps (both sides stop there at the latest)")
        if not self.seeds or len(set(self.seeds)) != len(self.seeds):
            errors.append(f"--seeds must be distinct, got {self.seeds}")
        unknown = [s for s in self.sides if s not in SIDES]
        if unknown or not self.sides:
            errors.append(f"--sides {','.join(self.sides)}: choose from {','.join(SIDES)}")
        if self.device not in ("cpu", "cuda"):
            errors.append(f"--device {self.device!r}: choose cpu or cuda")
        if self.precision != "auto" and self.precision not in PRECISIONS:
            errors.append(f"--precision {self.precision!r}: choose auto, {' or '.join(PRECISIONS)}")
        self.precision = resolve_precision(self.precision, self.device)
        if errors:
            raise ValueError("; ".join(errors))

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "budget_s": self.budget_s}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Settings:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


@dataclass(frozen=True)
class DataPaths:
    """The files of DIR/data that both sides and the scorer read."""
    root: Path

    @property
    def vocab(self) -> Path:
        return self.root / "vocab" / "vocab.txt"

    @property
    def prepared(self) -> Path:
        return self.root / "prepared"

    @property
    def model_config(self) -> Path:
        return self.root / "model_config.json"

    @property
    def hf(self) -> Path:
        return self.root / "hf"


def sample_config(seq: int) -> SampleConfig:
    """What a bertrain sample is here: MLM-only packing (no NSP), no short sequences, 15% masked."""
    from bertrain.bench.batches import max_predictions
    from bertrain.data.samples import SampleConfig

    return SampleConfig(max_seq_length=seq, max_predictions_per_seq=max_predictions(seq),
                        masked_lm_prob=MLM_PROBABILITY, short_seq_prob=0.0, next_sentence=False)


def bertrain_config(s: Settings, seed: int, data: DataPaths, output_dir: Path,
                    evaluate: bool = False) -> dict[str, Any]:
    """The `PretrainConfig` (as a dict) of a bertrain run (`evaluate` false: no evaluation while training); the
    scorer builds its evaluator from the same dict with `evaluate`, so the evaluation set and its micro-batches are
    those a training-time evaluation would use."""
    return {
        "model": {"preset": str(data.model_config)},
        "data": {"prepared": str(data.prepared), "vocab_file": str(data.vocab), "masking": "dynamic",
                 "num_workers": LOADER_WORKERS},
        "sample": asdict(sample_config(s.seq)),
        "train": {"steps": s.steps, "max_time": f"{s.budget_s:g}s", "global_batch_size": s.batch,
                  "micro_batch_size": s.batch, "log_interval": LOG_INTERVAL},
        "optim": {"name": "adamw", "lr": s.lr, "betas": list(BETAS), "eps": EPS, "weight_decay": WEIGHT_DECAY,
                  "max_grad_norm": MAX_GRAD_NORM},
        "schedule": {"name": SCHEDULES[s.schedule], "warmup": float(s.warmup)},
        "precision": {"mode": s.precision},
        "distributed": {"device": s.device},
        "checkpoint": {"save_interval": s.save_every, "keep_last": 0, "export_final": False},
        "eval": {"enabled": evaluate, "max_samples": s.eval_samples},
        "metrics": {"report_to": []},
        "seed": seed,
        "output_dir": str(output_dir),
    }


def hf_arguments(s: Settings, seed: int, output_dir: Path) -> dict[str, Any]:
    """`TrainingArguments` of an HF run: the same optimisation as `bertrain_config`, run_mlm's defaults otherwise."""
    return {
        "output_dir": str(output_dir), "per_device_train_batch_size": s.batch, "gradient_accumulation_steps": 1,
        "learning_rate": s.lr, "weight_decay": WEIGHT_DECAY, "adam_beta1": BETAS[0], "adam_beta2": BETAS[1],
        "adam_epsilon": EPS, "max_grad_norm": MAX_GRAD_NORM, "lr_scheduler_type": s.schedule,
        "warmup_steps": s.warmup, "max_steps": s.steps or NO_STEP_LIMIT, "logging_steps": LOG_INTERVAL,
        "save_strategy": "steps", "save_steps": s.save_every, "save_total_limit": None, "seed": seed,
        "dataloader_num_workers": LOADER_WORKERS, "report_to": "none", "disable_tqdm": True,
        "eval_strategy": "no", "use_cpu": s.device == "cpu", "bf16": s.precision == "bf16",
    }


# ----------------------------------------------------------------------------------------------- data

def shared_wiki() -> Path:
    path = SHARED_DATA / WIKI
    if not path.is_file():
        raise SystemExit(f"the Wikipedia sample {path} is missing (../shared/data beside the repository, or set "
                         "BERTRAIN_SHARED_DATA)")
    return path


def document_sequences(documents: Iterable[np.ndarray], cls_id: int,
                       sep_id: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Each document as run_mlm's tokenizer returns a text: ([CLS] ids [SEP], its special_tokens_mask)."""
    for ids in documents:
        seq = np.concatenate(([cls_id], np.asarray(ids, dtype=np.int64), [sep_id]))
        special = np.zeros(len(seq), dtype=np.uint8)
        special[[0, -1]] = 1
        yield seq, special


def group_texts(sequences: Iterable[np.ndarray], seq: int) -> np.ndarray:
    """run_mlm's group_texts: concatenate the sequences, drop the remainder, cut into rows of `seq` tokens."""
    parts = list(sequences)
    flat = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    n = len(flat) // seq
    return flat[: n * seq].reshape(n, seq)


def store_documents(store: TokenStore) -> Iterator[np.ndarray]:
    """The token ids of each document of a bertrain `TokenStore`, in store order."""
    tokens = store.tokens_at(np.arange(store.num_tokens))
    bounds = store.sentence_starts[store.document_starts]  # a document's first token, and the end
    for a, b in itertools.pairwise(bounds):
        yield tokens[a:b]


def run_mlm_chunks(store: TokenStore, cls_id: int, sep_id: int, seq: int) -> tuple[np.ndarray, np.ndarray]:
    """The HF side's training examples from bertrain's training store: (input_ids, special_tokens_mask), (n, seq)."""
    pairs = list(document_sequences(store_documents(store), cls_id, sep_id))
    ids = group_texts((p[0] for p in pairs), seq).astype(np.int32)
    special = group_texts((p[1] for p in pairs), seq).astype(np.uint8)
    return ids, special


def write_model_config(s: Settings, vocab_size: int, path: Path) -> None:
    """The one config.json both sides build their model from (HF's `BertConfig` fields)."""
    from bertrain.model.bert import BertConfig
    from bertrain.model.hf import config_to_hf_dict
    from bertrain.utils.io import atomic_write_json

    config = BertConfig.from_preset("base", vocab_size=vocab_size, num_hidden_layers=s.layers, hidden_size=s.hidden,
                                    num_attention_heads=s.heads, intermediate_size=s.intermediate,
                                    max_position_embeddings=MAX_POSITIONS, hidden_dropout_prob=DROPOUT,
                                    attention_probs_dropout_prob=DROPOUT, initializer_range=0.02)
    atomic_write_json(path, config_to_hf_dict(config, ["BertForMaskedLM"]))


def prepare_data(s: Settings, data: DataPaths) -> dict[str, Any]:
    """Vocabulary, bertrain's prepared store, the HF examples and the shared model config (untimed); returns facts
    about them for results.json."""
    from bertrain.data.build import ensure_prepared, ensure_vocab
    from bertrain.data.prepare import PrepareConfig
    from bertrain.data.store import TokenStore, heldout_status
    from bertrain.data.tokenizer import read_vocab
    from bertrain.model.hf import tokenizer_files_from_vocab
    from bertrain.utils.io import atomic_write_bytes

    inputs = [str(shared_wiki()), BUILTIN_TEXT]
    vocab_stats = ensure_vocab(inputs, data.vocab.parent, s.vocab_size, lowercase=True)
    stats = ensure_prepared(PrepareConfig(inputs=inputs, output=str(data.prepared), vocab_file=str(data.vocab),
                                          sample=sample_config(s.seq), masking="dynamic"))
    held = heldout_status(data.prepared)
    if held.dir is None:
        raise SystemExit(f"{data.prepared} has no held-out set to score on: {held.reason}")
    vocab = read_vocab(data.vocab)
    write_model_config(s, len(vocab), data.model_config)

    store = TokenStore(data.prepared)
    ids, special = run_mlm_chunks(store, vocab.index("[CLS]"), vocab.index("[SEP]"), s.seq)
    data.hf.mkdir(parents=True, exist_ok=True)
    np.save(data.hf / "input_ids.npy", ids)
    np.save(data.hf / "special_tokens_mask.npy", special)
    for name, content in tokenizer_files_from_vocab(data.vocab, do_lower_case=True).items():
        atomic_write_bytes(data.hf / "tokenizer" / name, content)
    return {"inputs": inputs, "vocab_size": len(vocab), "vocab_requested": s.vocab_size,
            "vocab_documents": vocab_stats.get("read", {}).get("documents"),
            "train_documents": store.num_documents, "train_tokens": store.num_tokens,
            "heldout": held.record, "hf_chunks": len(ids), "hf_tokens": int(ids.size),
            "tokenizer_identity": stats.get("tokenizer_identity"), "prepare_s": stats.get("seconds")}


class ChunkDataset:
    """The HF side's examples, as run_mlm's grouped `datasets` rows (lists of ints; no padding: every chunk is
    full). A plain map-style dataset: Trainer's default random sampler and the collator take it as they are."""

    def __init__(self, folder: Path) -> None:
        self.ids = np.load(folder / "input_ids.npy", mmap_mode="r")
        self.special = np.load(folder / "special_tokens_mask.npy", mmap_mode="r")

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, list[int]]:
        n = self.ids.shape[1]
        return {"input_ids": self.ids[i].tolist(), "token_type_ids": [0] * n, "attention_mask": [1] * n,
                "special_tokens_mask": self.special[i].tolist()}


# ----------------------------------------------------------------------------------------------- the timed runs

def run_order(seeds: Sequence[int], sides: Sequence[str]) -> list[tuple[str, int]]:
    """(side, seed) in the interleaved order A B, B A, A B, ... so neither side always goes first."""
    order = []
    for i, seed in enumerate(seeds):
        pair = list(sides) if i % 2 == 0 else list(reversed(sides))
        order += [(side, seed) for side in pair]
    return order


def run_name(side: str, seed: int) -> str:
    return f"{side}-s{seed}"


def child_env(threads: int) -> dict[str, str]:
    """The environment of both training processes: the same thread count, nothing fetched from the network."""
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
    return env


def launch(side: str, seed: int, s: Settings, out: Path, data: DataPaths) -> dict[str, Any]:
    """Train one side in its own process; returns its launch record (t0 = time.time() just before the launch)."""
    run_dir = out / "runs" / run_name(side, seed)
    train_dir = run_dir / "train"
    run_dir.mkdir(parents=True)
    job = {"side": side, "seed": seed, "settings": s.to_json(), "data": str(data.root),
           "train_dir": str(train_dir)}
    job["config"] = bertrain_config(s, seed, data, train_dir) if side == "bertrain" else \
        hf_arguments(s, seed, train_dir)
    (run_dir / "job.json").write_text(json.dumps(job, indent=2) + "\n")
    command = [sys.executable, str(Path(__file__).resolve()), "_child", side, str(run_dir / "job.json")]
    load = os.getloadavg()[0]
    log.info("training %s (budget %s) ...", run_name(side, seed), s.budget)
    with open(run_dir / "train.log", "w") as log_file:
        t0 = time.time()
        proc = subprocess.Popen([*command, repr(t0)], stdout=log_file, stderr=subprocess.STDOUT,
                                env=child_env(s.threads), cwd=REPO)
        try:
            code = proc.wait()
        except KeyboardInterrupt:
            proc.wait()  # the child got the same SIGINT: let it save and leave
            raise SystemExit(f"interrupted while training {run_name(side, seed)}")
    record = {"side": side, "seed": seed, "t0": t0, "exit_code": code, "process_s": time.time() - t0,
              "load_average_at_launch": load, "command": [*command, repr(t0)]}
    (run_dir / "launch.json").write_text(json.dumps(record, indent=2) + "\n")
    if code != 0:
        raise SystemExit(f"{run_name(side, seed)} failed (exit code {code}): see {run_dir / 'train.log'}")
    return record


def child_main(side: str, job_path: Path, t0: float) -> int:
    """Entry of a training process (`_child`): one side, one seed, as the job file says."""
    job = json.loads(job_path.read_text())
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    import torch

    torch.set_num_threads(job["settings"]["threads"])
    facts = train_bertrain(job) if side == "bertrain" else train_hf(job, t0)
    facts["threads"] = torch.get_num_threads()
    (job_path.parent / "child.json").write_text(json.dumps(facts, indent=2) + "\n")
    return 0


def train_bertrain(job: dict[str, Any]) -> dict[str, Any]:
    """bertrain as `bertrain pretrain --config` runs it, with `eval.enabled: false`: the scorer evaluates both sides
    afterwards, and an evaluation inside the timed run would cost bertrain time that HF does not pay."""
    from bertrain.config import from_dict
    from bertrain.tasks.pretraining import PretrainConfig, run_pretraining

    cfg = from_dict(PretrainConfig, job["config"])
    result = run_pretraining(cfg)
    run = result.run
    return {"steps": run.state.step, "loop_s": run.seconds, "stop_reason": run.stop_reason,
            "optimizer": "torch.optim.AdamW(fused=True)", "loader_workers": cfg.data.num_workers}


def train_hf(job: dict[str, Any], t0: float) -> dict[str, Any]:
    """HF Trainer as run_mlm.py drives it: BertForMaskedLM, DataCollatorForLanguageModeling(0.15), Trainer; a
    callback stops it at the budget (since launch) and records each save's wall time."""
    import transformers
    from transformers import (
        AutoTokenizer,
        BertConfig,
        BertForMaskedLM,
        DataCollatorForLanguageModeling,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )

    s = job["settings"]
    data = DataPaths(Path(job["data"]))
    saves = Path(job["train_dir"]).parent / "saves.jsonl"
    budget = float(s["budget_s"])

    class TimeBudget(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if time.time() - t0 >= budget:
                control.should_training_stop = True
                control.should_save = True  # the last state is a checkpoint, as bertrain's is
            return control

        def on_save(self, args, state, control, **kwargs):
            with open(saves, "a") as f:
                f.write(json.dumps({"step": state.global_step, "wall_s": time.time() - t0}) + "\n")
            return control

    transformers.set_seed(job["seed"])  # the initial weights, like bertrain's seed
    model = BertForMaskedLM(BertConfig(**json.loads(data.model_config.read_text())))
    tokenizer = AutoTokenizer.from_pretrained(str(data.hf / "tokenizer"))
    args = TrainingArguments(**job["config"])
    trainer = Trainer(model=model, args=args, train_dataset=ChunkDataset(data.hf), processing_class=tokenizer,
                      data_collator=DataCollatorForLanguageModeling(tokenizer, mlm_probability=MLM_PROBABILITY),
                      callbacks=[TimeBudget()])
    out = trainer.train()
    return {"steps": trainer.state.global_step, "loop_s": out.metrics.get("train_runtime"),
            "optimizer": str(getattr(args.optim, "value", args.optim)), "loader_workers": args.dataloader_num_workers}


# ----------------------------------------------------------------------------------------------- scoring

class Scorer:
    """ONE held-out evaluator for every checkpoint of both sides: bertrain's training-time evaluation
    (`Evaluator.evaluate` -> `PretrainingTask.evaluate` on `HeldoutEvalSet`) of a bertrain `BertForPreTraining`
    loaded from the checkpoint folder (HF checkpoints converted by bertrain.model.hf). Use as a context manager."""

    def __init__(self, s: Settings, data: DataPaths, output_dir: Path) -> None:
        from bertrain.config import from_dict
        from bertrain.tasks.pretraining import PretrainConfig

        self.cfg = from_dict(PretrainConfig, bertrain_config(s, 0, data, output_dir, evaluate=True))

    def __enter__(self) -> Scorer:
        from bertrain.tasks.pretraining import PretrainingTask, resolve_data
        from bertrain.train.distributed import distributed_context
        from bertrain.train.evaluation import Evaluator
        from bertrain.train.precision import Precision

        with contextlib.ExitStack() as stack:  # left again if anything below fails
            self.dist = stack.enter_context(distributed_context(self.cfg.distributed))
            self.task = PretrainingTask(self.cfg, resolve_data(self.cfg, self.dist))
            precision = Precision(self.cfg.precision, self.dist.device)
            self.evaluator = Evaluator(self.cfg.eval, self.task, self.dist, precision, Path(self.cfg.output_dir),
                                       total_steps=1, steps_per_epoch=0)
            self._stack = stack.pop_all()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.__exit__(*exc)

    def score(self, checkpoint: Path, step: int) -> dict[str, float]:
        """Held-out MLM accuracy and loss of the weights in `checkpoint` (a bertrain step-N or an HF checkpoint-N
        folder): {"mlm_acc", "mlm_loss"}."""
        import torch

        from bertrain.model.bert import BertForPreTraining
        from bertrain.model.options import apply_model_options

        torch.manual_seed(0)  # heads an HF checkpoint lacks (pooler, NSP) are initialised; MLM does not read them
        model = BertForPreTraining.from_pretrained(checkpoint)
        model = apply_model_options(model, self.cfg.model_options).to(self.dist.device)
        return self.evaluator.evaluate(model, step, 0)["metrics"]

    def chance_level(self) -> dict[str, Any]:
        """Accuracy of always predicting the training store's most frequent token, on the evaluator's targets."""
        from bertrain.data.pretraining import rows_to_batch
        from bertrain.data.store import TokenStore
        from bertrain.data.tokenizer import read_vocab

        store = TokenStore(self.task.data.data_dir)
        counts = np.bincount(store.tokens_at(np.arange(store.num_tokens)), minlength=store.vocab_size)
        top = int(counts.argmax())
        heldout = self.task.heldout()
        labels = rows_to_batch(heldout.rows, heldout.sample)["masked_labels"].numpy()
        targets = labels[labels != -100]
        return {"token_id": top, "token": read_vocab(self.task.data.vocab_file)[top],
                "accuracy": float((targets == top).mean()),
                "eval_samples": len(heldout), "eval_targets": int(targets.size)}


def checkpoints(side: str, run_dir: Path) -> list[tuple[int, float, Path]]:
    """(step, wall seconds since launch when it was complete, folder) of every checkpoint of one run, by step."""
    from bertrain.train import checkpoint as ckpt

    train_dir = run_dir / "train"
    if side == "bertrain":
        t0 = json.loads((run_dir / "launch.json").read_text())["t0"]
        found = [(step, (path / ckpt.COMPLETE).stat().st_mtime - t0, path)
                 for step, path in ckpt.list_checkpoints(train_dir) if (path / ckpt.COMPLETE).is_file()]
    else:
        saves = [json.loads(line) for line in (run_dir / "saves.jsonl").read_text().splitlines() if line.strip()]
        found = [(r["step"], r["wall_s"], train_dir / f"checkpoint-{r['step']}") for r in saves]
    missing = [str(p) for _, _, p in found if not p.is_dir()]
    if missing:
        raise SystemExit(f"checkpoints recorded but missing: {', '.join(missing)}")
    return sorted(found)


def score_run(side: str, run_dir: Path, scorer: Scorer) -> list[dict[str, Any]]:
    """The curve of one run: every checkpoint's wall_s, step, mlm_acc and mlm_loss, by time."""
    curve = [{"wall_s": wall, "step": step, **scorer.score(path, step)}
             for step, wall, path in checkpoints(side, run_dir)]
    return sorted(curve, key=lambda p: p["wall_s"])


def bertrain_tokens_per_sequence(train_dir: Path) -> float | None:
    """Mean real tokens per bertrain sample over its logged steps (metrics.jsonl: tokens/s and seq/s)."""
    path = train_dir / "metrics.jsonl"
    if not path.is_file():
        return None
    records = [r for r in map(json.loads, path.read_text().splitlines()) if "tokens_per_s" in r]
    seqs = sum(r["seq_per_s"] * r["elapsed_s"] for r in records)
    return sum(r["tokens_per_s"] * r["elapsed_s"] for r in records) / seqs if seqs else None


def run_facts(side: str, run_dir: Path, s: Settings, curve: list[dict[str, Any]]) -> dict[str, Any]:
    """Steps, throughput (from launch to the last checkpoint, and in the training loop alone), the curve, the
    final accuracy of one run."""
    launch_rec = json.loads((run_dir / "launch.json").read_text())
    child = json.loads((run_dir / "child.json").read_text())
    steps = child["steps"]
    per_seq = s.seq if side == "hf" else bertrain_tokens_per_sequence(run_dir / "train")
    end = max((p["wall_s"] for p in curve), default=None)
    seqs = steps * s.batch
    facts = {**launch_rec, **child, "tokens_per_sequence": per_seq, "last_checkpoint_s": end,
             "curve": [[p["wall_s"], p["step"], p["mlm_acc"]] for p in curve],
             "curve_mlm_loss": [p["mlm_loss"] for p in curve],
             "final_acc": curve[-1]["mlm_acc"] if curve else None}
    if end:
        facts["seq_per_s"] = seqs / end
        facts["tokens_per_s"] = seqs * per_seq / end if per_seq else None
    if child.get("loop_s"):
        facts["loop_seq_per_s"] = seqs / child["loop_s"]
        facts["loop_tokens_per_s"] = seqs * per_seq / child["loop_s"] if per_seq else None
    return facts


def score_all(out: Path, results: dict[str, Any], device: str | None = None) -> dict[str, Any]:
    """Score every checkpoint of every run in `out` (after all training) and fill results["runs"] and
    results["chance"]; `device` overrides the device the runs trained on."""
    s = Settings.from_json(results["settings"])
    if device:
        s = dataclasses.replace(s, device=device)
    check_device(s.device)
    data = DataPaths(out / "data")
    with Scorer(s, data, out / "scoring") as scorer:
        results["chance"] = scorer.chance_level()
        results["scoring"] = {"device": s.device, "precision": s.precision, "eval_samples": s.eval_samples,
                              "micro_batch": s.batch, "evaluator": "bertrain Evaluator.evaluate -> "
                              "PretrainingTask.evaluate on HeldoutEvalSet (eval seed fixed)"}
        for name in [n for n in results["order"] if n in results["runs"]]:  # (all but after an interruption)
            side, run_dir = results["runs"][name]["side"], out / "runs" / name
            log.info("scoring %s ...", name)
            results["runs"][name] = run_facts(side, run_dir, s, score_run(side, run_dir, scorer))
    return results


# ----------------------------------------------------------------------------------------------- summary

def ratio_bounds(t_ours: float | None, t_ref: float | None, end_ours: float,
                 end_ref: float) -> tuple[float, float]:
    """One seed's time ratio ours/reference as an interval: exact when both reached the target; a side that never
    did would have needed more than its last checkpoint's time (`end_*`), which only bounds the ratio."""
    if t_ours is not None and t_ref is not None:
        return t_ours / t_ref, t_ours / t_ref
    if t_ours is not None:
        return 0.0, t_ours / end_ref
    if t_ref is not None:
        return end_ours / t_ref, math.inf
    return 0.0, math.inf


def verdict(bounds: Sequence[tuple[float, float]], goal: float = GOAL_RATIO) -> tuple[str, str]:
    """("goal met" | "goal missed" | "inconclusive", why) from each seed's ratio interval."""
    if len(bounds) < 2:
        return "inconclusive", f"{len(bounds)} seed(s): the spread between seeds is unknown"
    lo, hi = min(b[0] for b in bounds), max(b[1] for b in bounds)
    if hi <= goal:
        return "goal met", f"every seed's ratio is <= {goal:g} (at most {hi:.3g})"
    if lo > goal:
        return "goal missed", f"every seed's ratio is above {goal:g} (at least {lo:.3g})"
    return "inconclusive", f"the seeds' ratios ({lo:.3g} to {_fmt_ratio(hi)}) straddle {goal:g}"


def _fmt_ratio(x: float) -> str:
    return "unbounded" if math.isinf(x) else f"{x:.3g}"


def _fmt_range(seed: dict[str, Any]) -> str:
    """One seed's ratio: exact, or the bound a side that never reached the target leaves."""
    lo, hi = seed["ratio_range"]
    if seed["ratio"] is not None:
        return f"{seed['ratio']:.3f}"
    if hi is None:
        return f"> {lo:.3f} (bertrain never reached it)" if lo else "unknown (neither reached it)"
    return f"< {hi:.3f} (HF never reached it)"


def _curve(run: dict[str, Any]) -> list[tuple[float, float]]:
    return [(p[0], p[2]) for p in run["curve"]]


def _spread(values: list[float]) -> dict[str, Any]:
    return {"mean": statistics.fmean(values), "min": min(values), "max": max(values),
            "stdev": statistics.stdev(values) if len(values) > 1 else None, "n": len(values)}


def summarize(results: dict[str, Any]) -> dict[str, Any]:
    """Final accuracies, the target (HF's mean final), each seed's times to it and ratio, the verdict."""
    runs = results["runs"]
    by_side = {side: {r["seed"]: r for r in runs.values() if r["side"] == side and r.get("curve")} for side in SIDES}
    out: dict[str, Any] = {"final_acc": {side: _spread([r["final_acc"] for r in rs.values()])
                                         for side, rs in by_side.items() if rs}}
    if not (by_side["bertrain"] and by_side["hf"]):
        out["verdict"], out["why"] = "inconclusive", "only one side was run"
        return out
    target = out["final_acc"]["hf"]["mean"]
    out["target"] = target
    seeds = sorted(set(by_side["bertrain"]) & set(by_side["hf"]))
    per_seed = {}
    for seed in seeds:
        ours, ref = by_side["bertrain"][seed], by_side["hf"][seed]
        t_ours, t_ref = time_to_reach(_curve(ours), target), time_to_reach(_curve(ref), target)
        lo, hi = ratio_bounds(t_ours, t_ref, ours["last_checkpoint_s"], ref["last_checkpoint_s"])
        per_seed[seed] = {"bertrain_s": t_ours, "hf_s": t_ref, "ratio": hi if lo == hi else None,
                          "ratio_range": [lo, None if math.isinf(hi) else hi]}
    out["per_seed"] = per_seed
    exact = [v["ratio"] for v in per_seed.values() if v["ratio"] is not None]
    out["ratio"] = _spread(exact) if exact else None
    out["verdict"], out["why"] = verdict([(v["ratio_range"][0], math.inf if v["ratio_range"][1] is None
                                           else v["ratio_range"][1]) for v in per_seed.values()])
    return out


def _acc(spread: dict[str, Any] | None) -> str:
    if not spread:
        return "-"
    if spread["n"] == 1:
        return f"{spread['mean']:.4f} (1 seed)"
    return f"{spread['mean']:.4f} ({spread['min']:.4f}-{spread['max']:.4f}, sd {spread['stdev']:.4f}, " \
           f"{spread['n']} seeds)"


def _per_seed(results: dict[str, Any], side: str, key: str, fmt: str) -> str:
    runs = sorted((r for r in results["runs"].values() if r["side"] == side), key=lambda r: r["seed"])
    return ", ".join(f"s{r['seed']} {format(r[key], fmt) if r.get(key) is not None else '-'}" for r in runs) or "-"


def settings_sentence(results: dict[str, Any]) -> str:
    """What was compared, in one paragraph (the head of summary.md)."""
    s, chance = results["settings"], results.get("chance", {})
    steps = f", {s['steps']} steps" if s["steps"] else ""
    return (f"{s['budget']} per run on {results['machine']['device']}, {s['threads']} threads, {s['precision']}; "
            f"BERT {s['layers']} layers x {s['hidden']} ({s['heads']} heads, FFN {s['intermediate']}), vocab "
            f"{results['data']['vocab_size']}, batch {s['batch']} x {s['seq']} tokens, AdamW lr {s['lr']:g} "
            f"{s['schedule']} ({s['warmup']} warmup steps{steps}), checkpoint every {s['save_every']} steps; order "
            f"{', '.join(results['order'])}. One evaluator: {chance.get('eval_samples', '?')} held-out samples "
            f"({chance.get('eval_targets', '?')} masked tokens); chance level "
            f"{chance.get('accuracy', float('nan')):.4f} (always '{chance.get('token', '?')}').")


def summary_markdown(results: dict[str, Any], summary: dict[str, Any]) -> str:
    """summary.md: the settings in a sentence, a table ready for BENCHMARKS.md, the ratio and the verdict."""

    def row(label: str, bertrain: str, hf: str) -> str:
        return f"| {label} | {bertrain} | {hf} |"

    def per_seed(key: str, fmt: str) -> list[str]:
        return [_per_seed(results, side, key, fmt) for side in SIDES]

    final = summary["final_acc"]
    lines = ["## Time to quality: pretraining, bertrain vs HF Trainer", "", settings_sentence(results), "",
             row("", "bertrain", "HF Trainer"), row("---", "---", "---"),
             row("final held-out MLM accuracy, mean (min-max)", _acc(final.get("bertrain")), _acc(final.get("hf"))),
             row("optimizer steps in the budget", *per_seed("steps", "d")),
             row("sequences/s, launch to last checkpoint", *per_seed("seq_per_s", ".2f")),
             row("tokens/s, launch to last checkpoint", *per_seed("tokens_per_s", ".0f")),
             row("sequences/s in the training loop", *per_seed("loop_seq_per_s", ".2f"))]
    if "target" in summary:
        seeds = summary["per_seed"]

        def times(key: str) -> str:
            return ", ".join(f"s{seed} {v[key]:.0f} s" if v[key] is not None else f"s{seed} not reached"
                             for seed, v in seeds.items())
        lines.append(row(f"time to HF's final accuracy ({summary['target']:.4f})", times("bertrain_s"),
                         times("hf_s")))
        r = summary["ratio"]
        mean = (f"mean {r['mean']:.3f} (min {r['min']:.3f}, max {r['max']:.3f}) over the {r['n']} seed(s) where "
                "both reached it; ") if r else ""
        ratios = ", ".join(f"s{seed} {_fmt_range(v)}" for seed, v in seeds.items())
        ratio_line = f"Time ratio bertrain/HF to HF's final accuracy: {mean}per seed {ratios}. Goal: <= {GOAL_RATIO:g}."
        lines += ["", ratio_line]
    lines += ["", f"**Verdict: {summary['verdict']}** ({summary['why']}).", ""]
    return "\n".join(lines)


def write_report(out: Path, results: dict[str, Any]) -> dict[str, Any]:
    """ttq_pretrain.png and summary.md from results.json's runs; the summary also goes into results.json."""
    from bertrain.utils.io import atomic_write_json, atomic_write_text

    summary = summarize(results)
    results["summary"] = summary
    curves = {f"{SIDE_NAMES[r['side']]} s{r['seed']}": _curve(r) for r in results["runs"].values() if r.get("curve")}
    s = results["settings"]
    plot_curves(curves, out / PLOT, "held-out MLM accuracy",
                f"Pretraining time to quality: {s['budget']} budget, {results['machine']['device']}, "
                f"{s['threads']} threads", summary.get("target"))
    atomic_write_text(out / SUMMARY, summary_markdown(results, summary))
    atomic_write_json(out / RESULTS, _finite(results))
    return summary


def _finite(obj: Any) -> Any:
    """JSON has no infinity: None instead."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


# ----------------------------------------------------------------------------------------------- the commands

def check_device(device: str) -> None:
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: CUDA is not available on this machine")


def machine_facts(device: str) -> dict[str, Any]:
    """The pipeline report's hardware facts, the device in words and the load when the comparison starts."""
    import torch

    from bertrain.pipeline.report import hardware

    return {**hardware(), "device": torch.cuda.get_device_name(0) if device == "cuda" else
            f"cpu ({os.cpu_count()} cores)", "load_average_at_start": os.getloadavg()[0]}


def git_state() -> dict[str, Any]:
    """The commit of this checkout and whether tracked files differ from it (None outside git)."""
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                                check=True).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                                    capture_output=True, text=True, check=True).stdout.strip())
    except (OSError, subprocess.CalledProcessError):
        commit, dirty = None, None
    return {"git_commit": commit, "git_dirty": dirty}


def versions() -> dict[str, Any]:
    from bertrain.pipeline.report import package_versions

    return {**package_versions(), **git_state()}


def report_and_print(out: Path, results: dict[str, Any]) -> int:
    summary = write_report(out, results)
    print((out / SUMMARY).read_text())
    print(f"results: {out / RESULTS}, plot: {out / PLOT}; verdict: {summary['verdict']}")
    return 0


def load_results(out: Path) -> dict[str, Any]:
    path = out / RESULTS
    if not path.is_file():
        raise SystemExit(f"{path} does not exist: give the DIR of a `pretrain` run")
    return json.loads(path.read_text())


def cmd_pretrain(args: argparse.Namespace) -> int:
    from bertrain.utils.io import atomic_write_json

    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise SystemExit(f"--out {out} exists and is not empty: give a new folder (another run's output is never "
                         "overwritten)")
    try:
        s = Settings(budget=args.budget, seeds=args.seeds, device=args.device, threads=args.threads,
                     save_every=args.save_every, vocab_size=args.vocab_size, layers=args.layers, hidden=args.hidden,
                     heads=args.heads, intermediate=args.intermediate, batch=args.batch, seq=args.seq, lr=args.lr,
                     warmup=args.warmup, schedule=args.schedule, steps=args.steps or 0,
                     eval_samples=args.eval_samples, sides=[x for x in args.sides.split(",") if x],
                     precision=args.precision)
    except ValueError as e:
        raise SystemExit(f"time_to_quality pretrain: {e}") from None
    check_device(s.device)
    shared_wiki()  # before anything is written
    out.mkdir(parents=True, exist_ok=True)
    data = DataPaths(out / "data")
    order = run_order(s.seeds, s.sides)
    results: dict[str, Any] = {
        "settings": s.to_json(), "versions": versions(), "machine": machine_facts(s.device),
        "order": [run_name(side, seed) for side, seed in order],
        "fairness": {"loader_workers": LOADER_WORKERS, "threads": s.threads, "precision": s.precision,
                     "optimizer": {"name": "AdamW (torch fused)", "betas": BETAS, "eps": EPS,
                                   "weight_decay": WEIGHT_DECAY, "max_grad_norm": MAX_GRAD_NORM},
                     "mlm_probability": MLM_PROBABILITY, "wall_time": "time.time() from just before each training "
                     "process is launched; checkpoint times when the checkpoint was complete"},
    }
    log.info("preparing the data in %s (untimed) ...", data.root)
    results["data"] = prepare_data(s, data)
    atomic_write_json(out / RESULTS, results)
    results["runs"] = {}
    for side, seed in order:
        results["runs"][run_name(side, seed)] = launch(side, seed, s, out, data)
        atomic_write_json(out / RESULTS, results)
    score_all(out, results)
    return report_and_print(out, results)


def cmd_score(args: argparse.Namespace) -> int:
    out = Path(args.dir)
    results = load_results(out)
    score_all(out, results, args.device)
    return report_and_print(out, results)


def cmd_report(args: argparse.Namespace) -> int:
    out = Path(args.dir)
    results = load_results(out)
    if not any(r.get("curve") for r in results.get("runs", {}).values()):
        raise SystemExit(f"{out / RESULTS} has no scored runs yet: run `score {out}` first")
    return report_and_print(out, results)


def cmd_finetune(argv: list[str]) -> int:
    """Forward to benchmarks/ttq_finetune.py (imported only here, so this file works without it)."""
    here = str(Path(__file__).resolve().parent)
    if here not in sys.path:
        sys.path.insert(0, here)
    try:
        import ttq_finetune
    except ModuleNotFoundError as e:
        if e.name != "ttq_finetune":
            raise
        raise SystemExit(f"finetune: {here}/ttq_finetune.py is not there") from None
    return int(ttq_finetune.main(argv) or 0)


def build_parser() -> argparse.ArgumentParser:
    d = Settings()
    p = argparse.ArgumentParser(prog="time_to_quality.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True, metavar="{pretrain,score,report,finetune}")
    pre = sub.add_parser("pretrain", help="prepare, train both sides in turn, score, report")
    a = pre.add_argument
    a("--out", required=True, metavar="DIR", help="a new (or empty) output folder")
    a("--budget", default=d.budget, help=f"wall-clock budget per run, e.g. 10m, 90s (default {d.budget})")
    a("--seeds", type=int, nargs="+", default=d.seeds, help="one run per side per seed (default 1 2)")
    a("--device", choices=["cpu", "cuda"], default=d.device)
    a("--precision", choices=["auto", *PRECISIONS], default="auto",
      help="both sides: fp32, or bf16 autocast (auto: fp32 on CPU, bf16 on CUDA; bf16 also runs on a CPU, fast "
           "where it has bf16 instructions such as AVX-512 BF16 or AMX)")
    a("--threads", type=int, default=d.threads, help=f"torch threads in both processes (default {d.threads})")
    a("--save-every", type=int, default=d.save_every, metavar="STEPS",
      help=f"checkpoint every this many steps, and at the end (default {d.save_every}: with the default model on 2 "
           "CPU cores, 2-5 s per bertrain step and 5-12 s per HF step, so about 12-30 and 5-12 checkpoints in 10m)")
    a("--vocab-size", type=int, default=d.vocab_size, help="WordPiece vocabulary (default: bertrain vocab's 30522)")
    a("--layers", type=int, default=d.layers)
    a("--hidden", type=int, default=d.hidden)
    a("--heads", type=int, default=d.heads)
    a("--intermediate", type=int, default=d.intermediate)
    a("--batch", type=int, default=d.batch, help="sequences per optimizer step (no accumulation)")
    a("--seq", type=int, default=d.seq, help="tokens per sequence")
    a("--lr", type=float, default=d.lr)
    a("--warmup", type=int, default=d.warmup, help="warmup steps")
    a("--schedule", choices=list(SCHEDULES), default=d.schedule)
    a("--steps", type=int, default=None, help="schedule length in steps (required by linear; a cap on both sides)")
    a("--eval-samples", type=int, default=d.eval_samples,
      help=f"held-out samples the evaluator scores (default {d.eval_samples}, bertrain's eval.max_samples)")
    a("--sides", default=",".join(SIDES), help="which sides to run (default bertrain,hf)")
    pre.set_defaults(run=cmd_pretrain)
    score = sub.add_parser("score", help="re-score every checkpoint of an existing DIR, then report")
    score.add_argument("dir", metavar="DIR")
    score.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: the device it trained on")
    score.set_defaults(run=cmd_score)
    report = sub.add_parser("report", help="re-make the plot and summary.md from DIR/results.json")
    report.add_argument("dir", metavar="DIR")
    report.set_defaults(run=cmd_report)
    sub.add_parser("finetune", help="the fine-tuning comparison (benchmarks/ttq_finetune.py; its own options)",
                   add_help=False)
    child = sub.add_parser("_child", help=argparse.SUPPRESS)
    child.add_argument("side", choices=SIDES)
    child.add_argument("job", type=Path)
    child.add_argument("t0", type=float)
    child.set_defaults(run=lambda args: child_main(args.side, args.job, args.t0))
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["finetune"]:  # everything after it is ttq_finetune's
        return cmd_finetune(argv[1:])
    args = build_parser().parse_args(argv)
    if args.command != "_child":
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
