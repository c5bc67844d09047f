"""Fine-tuning on SQuAD and GLUE with the shared training engine, and distributed evaluation.

The loop is the pretraining engine's: `init_distributed` / `wrap_model` (DDP), `Precision` (fp32/bf16/fp16 with
loss scaling), `build_optimizer` (AdamW as BERT's references use it, or RAdam/LAMB), `build_scheduler` (linear
decay after 10% warmup by default), `save_checkpoint` / `latest_checkpoint` (resume with `resume: auto`).

Data order is a pure function of (seed, epoch): each epoch's permutation is padded by wrapping around to a
multiple of the global batch (as DistributedSampler pads), and micro-batch m of rank r in an optimizer step takes
its slice of that step's global batch. Resuming at step k therefore needs only k.

Evaluation is sharded the same way (indices padded to a multiple of the world size, strided over ranks); every
rank's (index, output) pairs are gathered and the padded duplicates dropped by index, so each example is scored
exactly once whatever the world size.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch

from bertrain.train.config import (CheckpointConfig, DistributedConfig, OptimConfig, PrecisionConfig,
                                   ScheduleConfig)

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------------------- configs

@dataclass
class FinetuneTrainConfig:
    epochs: float = 2.0
    """Epochs over the training features (ignored when max_steps > 0)."""
    max_steps: int = 0
    """Optimizer steps to run; 0: derived from epochs."""
    micro_batch_size: int = 32
    """Examples per forward/backward on one rank."""
    accumulation: int = 1
    """Micro-steps per optimizer step; global batch = micro_batch_size x accumulation x world size."""
    eval_batch_size: int = 64
    """Examples per forward pass at evaluation / prediction, per rank."""
    log_interval: int = 10
    """Log loss and LR every this many steps."""
    trim_padding: bool = True
    """Drop padding columns beyond each batch's longest sequence (same result, less compute)."""
    do_train: bool = True
    """Fine-tune (false: only evaluate the --init model)."""
    do_eval: bool = True
    """Evaluate on the dev set after training and write eval_results.json."""

    def __post_init__(self) -> None:
        for key in ("micro_batch_size", "accumulation", "eval_batch_size", "log_interval"):
            if getattr(self, key) < 1:
                raise ValueError(f"config key 'train.{key}' must be >= 1, got {getattr(self, key)}")
        if self.max_steps < 0 or self.epochs < 0 or (self.do_train and self.max_steps == 0 and self.epochs == 0):
            raise ValueError("config keys 'train.epochs'/'train.max_steps': set a positive one")


def _optim_default() -> OptimConfig:
    # BERT's fine-tuning recipe: AdamW, lr 3e-5 (2e-5..5e-5), weight decay 0.01, eps 1e-6.
    return OptimConfig(name="adamw", lr=3e-5, weight_decay=0.01, eps=1e-6, max_grad_norm=1.0)


def _schedule_default() -> ScheduleConfig:
    return ScheduleConfig(name="linear", warmup=0.1)


def _checkpoint_default() -> CheckpointConfig:
    return CheckpointConfig(save_interval=0, keep_last=1, export_final=True)


@dataclass
class FinetuneBase:
    init: str = ""
    """The model to fine-tune: an HF-format folder or a bertrain checkpoint folder (weights + vocab.txt)."""
    output_dir: str = ""
    """Folder for predictions, eval_results.json, checkpoints (step-N), metrics.jsonl and the final model."""
    resume: str = ""
    """'auto': continue from the newest complete checkpoint in output_dir (if any); or a checkpoint folder."""
    seed: int = 42
    """Seed of the head initialisation, data order and dropout."""
    train: FinetuneTrainConfig = field(default_factory=FinetuneTrainConfig)
    """Epochs, batch sizes, logging."""
    optim: OptimConfig = field(default_factory=_optim_default)
    """Optimizer (adamw | radam | lamb | nvlamb)."""
    schedule: ScheduleConfig = field(default_factory=_schedule_default)
    """Learning-rate schedule."""
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    """Numeric precision (fp32 | tf32 | bf16 | fp16)."""
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    """Process group and device."""
    checkpoint: CheckpointConfig = field(default_factory=_checkpoint_default)
    """Checkpoint folders (save_interval 0: only the final export)."""

    def _check_base(self) -> None:
        if not self.init:
            raise ValueError("config key 'init' must name a model folder (--init)")
        if not self.output_dir:
            raise ValueError("config key 'output_dir' must not be empty (--output)")


@dataclass
class SquadDataConfig:
    train_file: Optional[str] = None
    """SQuAD JSON to fine-tune on."""
    dev_file: Optional[str] = None
    """SQuAD JSON to evaluate on (official metrics)."""
    train_articles: str = ""
    """Use only these articles of train_file, as a Python slice 'start:stop' (e.g. '0:18'); empty = all."""
    dev_articles: str = ""
    """Use only these articles of dev_file, as 'start:stop' (e.g. '18:'); empty = all."""
    version_2_with_negative: bool = False
    """SQuAD v2.0: questions may be unanswerable (null answer = [CLS])."""
    max_seq_length: int = 384
    """Tokens per window."""
    doc_stride: int = 128
    """Tokens between the starts of consecutive context windows."""
    max_query_length: int = 64
    """Questions are cut to this many tokens."""
    n_best_size: int = 20
    """Candidate answers kept per question."""
    max_answer_length: int = 30
    """Longest answer in tokens."""
    null_score_diff_threshold: float = 0.0
    """v2.0: predict no answer when score(null) - score(best span) is above this."""
    cache_dir: Optional[str] = None
    """Feature cache folder (default $BERTRAIN_CACHE/features or ~/.cache/bertrain/features); '' disables."""


@dataclass
class SquadFinetuneConfig(FinetuneBase):
    """Fine-tune on SQuAD v1.1/v2.0; writes predictions.json, nbest_predictions.json, null_odds.json (v2.0), eval_results.json."""

    data: SquadDataConfig = field(default_factory=SquadDataConfig)
    """SQuAD files and feature settings."""

    def __post_init__(self) -> None:
        self._check_base()
        if self.train.do_train and not self.data.train_file:
            raise ValueError("config key 'data.train_file' is required to fine-tune (--train)")
        if self.train.do_eval and not self.data.dev_file:
            raise ValueError("config key 'data.dev_file' is required to evaluate (--dev)")


@dataclass
class GlueDataConfig:
    task: str = ""
    """GLUE task: cola, sst2, mrpc, stsb, qqp, mnli, qnli, rte, wnli."""
    data_dir: str = ""
    """The task's folder with train.tsv, dev.tsv (MNLI: dev_matched/dev_mismatched) and test.tsv."""
    max_seq_length: int = 128
    """Tokens per example, pairs truncated longest-first."""
    max_train_examples: int = 0
    """Train on a seeded random subset of this many examples (0: all) — for CPU-sized runs."""
    predict_test: bool = True
    """Write GLUE-server test predictions ({TASK}.tsv) when the test file exists."""


@dataclass
class GlueFinetuneConfig(FinetuneBase):
    """Fine-tune on a GLUE task; writes eval_results.json and the GLUE-server test predictions ({TASK}.tsv)."""

    data: GlueDataConfig = field(default_factory=GlueDataConfig)
    """GLUE task and data."""

    def __post_init__(self) -> None:
        self._check_base()
        if not self.data.task:
            raise ValueError("config key 'data.task' is required (--task)")
        from bertrain.tasks.glue import get_task
        get_task(self.data.task)
        if not self.data.data_dir:
            raise ValueError("config key 'data.data_dir' is required (--data-dir)")


# ----------------------------------------------------------------------------------------------- sampling

def epoch_order(n: int, global_batch: int, seed: int, epoch: int) -> np.ndarray:
    """Example indices of one epoch: a seeded permutation padded (by wrapping) to a multiple of the global batch."""
    perm = np.random.default_rng([seed, epoch]).permutation(n)
    steps = math.ceil(n / global_batch)
    pad = steps * global_batch - n
    return np.concatenate([perm, perm[np.arange(pad) % n]]) if pad else perm


def micro_batch_indices(step_order: np.ndarray, micro: int, rank: int, world: int,
                        micro_batch_size: int) -> np.ndarray:
    """Indices of micro-batch `micro` of `rank` within one optimizer step's global batch `step_order`.

    Micro-batch m of rank r holds global slots [(m*W + r)*b, (m*W + r + 1)*b), as in the pretraining loader: for
    a fixed global batch every step sees the same examples whatever the world size.
    """
    start = (micro * world + rank) * micro_batch_size
    return step_order[start:start + micro_batch_size]


def shard_for_eval(n: int, rank: int, world: int) -> np.ndarray:
    """This rank's evaluation indices: 0..n-1 padded by wrapping to a multiple of `world`, strided by rank."""
    total = math.ceil(n / world) * world
    return (np.arange(total) % n)[rank::world] if n else np.zeros(0, dtype=np.int64)


def merge_gathered(parts: list[tuple[np.ndarray, Any]], n: int) -> list[np.ndarray]:
    """Join every rank's (indices, outputs) into outputs in index order, dropping padded duplicates.

    `outputs` is a tuple of arrays with the same first dimension as `indices`. Raises if an index is missing.
    """
    indices = np.concatenate([p[0] for p in parts])
    uniq, first = np.unique(indices, return_index=True)  # first occurrence of each index, sorted by index
    if len(uniq) != n or (n and (uniq[0] != 0 or uniq[-1] != n - 1)):
        raise RuntimeError(f"distributed evaluation covered {len(uniq)} of {n} examples")
    n_out = len(parts[0][1])
    merged = []
    for k in range(n_out):
        arr = np.concatenate([p[1][k] for p in parts])
        merged.append(arr[first])
    return merged


# ----------------------------------------------------------------------------------------------- model

def load_model(kind: str, path: str | Path, num_labels: int = 2) -> torch.nn.Module:
    """bertrain's BertForQuestionAnswering / BertForSequenceClassification from an HF or checkpoint folder."""
    from bertrain.model.bert import BertForQuestionAnswering, BertForSequenceClassification

    path = Path(path)
    if not (path / "config.json").is_file():
        raise ValueError(f"model folder {path} has no config.json (need an HF-format or bertrain checkpoint folder)")
    if kind == "qa":
        return BertForQuestionAnswering.from_pretrained(path)
    return BertForSequenceClassification.from_pretrained(path, num_labels=num_labels)


def _to_batch(feats: dict[str, np.ndarray], idx: np.ndarray, keys: tuple[str, ...], device: torch.device,
              trim: bool) -> dict[str, torch.Tensor]:
    batch = {k: torch.from_numpy(np.ascontiguousarray(feats[k][idx])) for k in keys}
    if trim:
        # Padding sits at the end of every row: cut the columns no example of this batch uses.
        length = int(batch["attention_mask"].sum(dim=1).max())
        for k in ("input_ids", "token_type_ids", "attention_mask"):
            batch[k] = batch[k][:, :length]
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


@torch.no_grad()
def distributed_forward(model: torch.nn.Module, feats: dict[str, np.ndarray], outputs: Callable[[Any], tuple],
                        dist, batch_size: int, precision=None, trim: bool = True) -> list[np.ndarray]:
    """Run `model` over all of `feats`, sharded over ranks; every rank gets all outputs in example order.

    `outputs(model_output)` picks the tensors to keep, each (B, ...); columns cut by trimming come back as
    -10000 so that per-token outputs (QA logits) keep the full width and never win an argmax.
    """
    from bertrain.train.distributed import gather_objects

    n = len(feats["input_ids"])
    L = feats["input_ids"].shape[1]
    mine = shard_for_eval(n, dist.rank, dist.world_size)
    model.eval()
    chunks: list[list[np.ndarray]] = []
    for s in range(0, len(mine), batch_size):
        idx = mine[s:s + batch_size]
        batch = _to_batch(feats, idx, ("input_ids", "token_type_ids", "attention_mask"), dist.device, trim)
        ctx = precision.autocast() if precision is not None else torch.autocast("cpu", enabled=False)
        with ctx:
            out = outputs(model(**batch))
        arrs = []
        for t in out:
            t = t.float().cpu().numpy()
            if t.ndim == 2 and t.shape[1] < L and t.shape[1] == batch["input_ids"].shape[1]:
                t = np.concatenate([t, np.full((t.shape[0], L - t.shape[1]), -10000.0, np.float32)], axis=1)
            arrs.append(t)
        chunks.append(arrs)
    k = len(chunks[0]) if chunks else 0
    local = tuple(np.concatenate([c[j] for c in chunks]) for j in range(k))
    parts = gather_objects((mine, local))
    return merge_gathered(parts, n)


# ----------------------------------------------------------------------------------------------- training loop

@dataclass
class TrainResult:
    steps: int
    seconds: float
    examples_per_second: float
    final_loss: float


def train_loop(cfg: FinetuneBase, model: torch.nn.Module, feats: dict[str, np.ndarray], keys: tuple[str, ...],
               dist, kind: str, num_labels: int = 2) -> tuple[torch.nn.Module, TrainResult]:
    """Fine-tune `model` on `feats` with the shared engine; returns the (unwrapped) trained model."""
    from bertrain.train.checkpoint import (latest_checkpoint, load_model_weights, load_train_state, rng_state,
                                           save_checkpoint, set_rng_state)
    from bertrain.train.distributed import no_sync, unwrap_model, wrap_model
    from bertrain.train.metrics import MetricsLogger
    from bertrain.train.optim import build_optimizer
    from bertrain.train.precision import Precision
    from bertrain.train.schedules import build_scheduler

    out_dir = Path(cfg.output_dir)
    t = cfg.train
    W = dist.world_size
    global_batch = t.micro_batch_size * t.accumulation * W
    n = len(feats["input_ids"])
    steps_per_epoch = math.ceil(n / global_batch)
    total_steps = t.max_steps or max(1, math.ceil(t.epochs * steps_per_epoch))

    start_step = 0
    state: dict[str, Any] | None = None
    ckpt = None
    if cfg.resume:
        ckpt = latest_checkpoint(out_dir) if cfg.resume == "auto" else Path(cfg.resume)
        if ckpt is None:
            log.info("resume=auto: no checkpoint in %s, starting fresh", out_dir)
        else:
            load_model_weights(model, ckpt)
            state = load_train_state(ckpt)
            start_step = int(state["step"])
            if state.get("global_batch") != global_batch:
                raise ValueError(f"checkpoint {ckpt} was trained with global batch {state.get('global_batch')}, "
                                 f"this run has {global_batch}: keep micro_batch_size x accumulation x world size")
            log.info("resuming from %s at step %d", ckpt, start_step)

    model.to(dist.device)
    ddp = wrap_model(model, dist, cfg.distributed)
    optimizer = build_optimizer(model, cfg.optim)
    scheduler = build_scheduler(optimizer, cfg.schedule, total_steps)
    precision = Precision(cfg.precision, dist.device)
    if state is not None:
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        precision.load_state_dict(state["precision"])
        rngs = state.get("rng", [])
        if len(rngs) == W:
            set_rng_state(rngs[dist.rank])

    log.info("fine-tuning %s: %d features, global batch %d (%d x %d x %d ranks), %d steps (%.2f epochs), "
             "lr %g, %s, %s", kind, n, global_batch, t.micro_batch_size, t.accumulation, W, total_steps,
             total_steps / steps_per_epoch, cfg.optim.lr, cfg.optim.name, cfg.precision.mode)
    logger = MetricsLogger(out_dir, enabled=dist.is_main, resume_step=start_step if ckpt else None,
                           tensorboard=False)
    params = [p for p in model.parameters() if p.requires_grad]
    ddp.train()
    t0 = time.perf_counter()
    loss_sum, loss_n, last_loss = 0.0, 0, float("nan")
    order_epoch, order = -1, None
    step = start_step
    try:
        while step < total_steps:
            epoch, in_epoch = divmod(step, steps_per_epoch)
            if epoch != order_epoch:
                order, order_epoch = epoch_order(n, global_batch, cfg.seed, epoch), epoch
            step_loss = torch.zeros((), device=dist.device)
            for m in range(t.accumulation):
                idx = micro_batch_indices(order[in_epoch * global_batch:(in_epoch + 1) * global_batch],
                                          m, dist.rank, W, t.micro_batch_size)
                batch = _to_batch(feats, idx, keys, dist.device, t.trim_padding)
                with no_sync(ddp, m < t.accumulation - 1):
                    with precision.autocast():
                        loss = ddp(**batch).loss / t.accumulation
                    precision.backward(loss)
                step_loss += loss.detach()
            precision.unscale_and_clip(optimizer, params, cfg.optim.max_grad_norm)
            if precision.step(optimizer):
                scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            last_loss = float(step_loss)
            loss_sum += last_loss
            loss_n += 1
            if step % t.log_interval == 0 or step == total_steps:
                elapsed = time.perf_counter() - t0
                rec = {"step": step, "epoch": round(step / steps_per_epoch, 3), "loss": loss_sum / loss_n,
                       "lr": scheduler.get_last_lr()[0],
                       "examples_per_s": (step - start_step) * global_batch / max(elapsed, 1e-9)}
                logger.log(rec)
                log.info("step %d/%d  loss %.4f  lr %.3g  %.1f ex/s", step, total_steps, rec["loss"], rec["lr"],
                         rec["examples_per_s"])
                loss_sum, loss_n = 0.0, 0
            if cfg.checkpoint.save_interval and step % cfg.checkpoint.save_interval == 0 and step < total_steps:
                _save(cfg, step, model, optimizer, scheduler, precision, dist, global_batch,
                      save_checkpoint, rng_state)
    finally:
        logger.close()
    seconds = time.perf_counter() - t0
    result = TrainResult(steps=total_steps, seconds=seconds,
                         examples_per_second=(total_steps - start_step) * global_batch / max(seconds, 1e-9),
                         final_loss=last_loss)
    if cfg.checkpoint.save_interval:
        _save(cfg, total_steps, model, optimizer, scheduler, precision, dist, global_batch, save_checkpoint,
              rng_state)
    return unwrap_model(ddp), result


def _save(cfg, step, model, optimizer, scheduler, precision, dist, global_batch, save_checkpoint, rng_state):
    from bertrain.train.distributed import barrier, gather_objects

    rngs = gather_objects(rng_state())  # every rank's RNG, so dropout continues identically on resume
    if dist.is_main:
        state = {"step": step, "global_batch": global_batch, "optimizer": optimizer.state_dict(),
                 "scheduler": scheduler.state_dict(), "precision": precision.state_dict(), "rng": rngs}
        save_checkpoint(cfg.output_dir, step, model, state, cfg, cfg.checkpoint.keep_last)
    barrier()


def _eval_precision(cfg: FinetuneBase, dist):
    """The run's autocast for evaluation too (bf16/fp16 inference); fp32 stays exact."""
    from bertrain.train.precision import Precision

    return Precision(cfg.precision, dist.device)


def seed_everything(seed: int, rank: int = 0) -> None:
    """Same seed on every rank for the model (DDP also broadcasts rank 0's weights), per-rank for dropout."""
    import random

    random.seed(seed + rank)
    np.random.seed(seed + rank)
    torch.manual_seed(seed + rank)


def _article_slice(spec: str, key: str) -> slice:
    if not spec:
        return slice(None)
    try:
        parts = [int(p) if p.strip() else None for p in spec.split(":")]
    except ValueError:
        raise ValueError(f"config key '{key}': expected 'start:stop', got {spec!r}") from None
    if len(parts) != 2:
        raise ValueError(f"config key '{key}': expected 'start:stop', got {spec!r}")
    return slice(parts[0], parts[1])


def _subset_squad_file(path: str, spec: str, key: str, out_dir: Path, name: str) -> tuple[str, dict]:
    """The SQuAD file restricted to some articles: (path of the file to read, its parsed JSON)."""
    from bertrain.tasks.squad import load_dataset_json
    from bertrain.utils.io import atomic_write_json

    data = load_dataset_json(path)
    if not spec:
        return path, data
    sub = dict(data)
    sub["data"] = data["data"][_article_slice(spec, key)]
    if not sub["data"]:
        raise ValueError(f"config key '{key}' = {spec!r} selects no article of {path}")
    # The subset goes to a file of the run (not the data folder, which may be read-only) so that the reader's
    # error messages and the feature-cache key refer to exactly what was used.
    dest = out_dir / f"{name}-articles-{spec.replace(':', '_')}.json"
    atomic_write_json(dest, sub, indent=None)
    return str(dest), sub


# ----------------------------------------------------------------------------------------------- SQuAD

def run_squad(cfg: SquadFinetuneConfig) -> dict[str, Any]:
    """Fine-tune and/or evaluate on SQuAD; rank 0 writes predictions, nbest, null_odds and eval_results."""
    from bertrain.config import save_config
    from bertrain.tasks.common import load_task_tokenizer
    from bertrain.tasks.metrics import evaluate_squad
    from bertrain.tasks.squad import (SquadFeatureConfig, SquadPostprocessConfig, apply_null_threshold,
                                      load_or_build_features, postprocess_predictions, read_squad,
                                      write_prediction_files)
    from bertrain.train.distributed import barrier, distributed_context
    from bertrain.utils.io import atomic_write_json

    d = cfg.data
    out_dir = Path(cfg.output_dir)
    fcfg = SquadFeatureConfig(d.max_seq_length, d.doc_stride, d.max_query_length)
    with distributed_context(cfg.distributed) as dist:
        seed_everything(cfg.seed, dist.rank)
        if dist.is_main:
            out_dir.mkdir(parents=True, exist_ok=True)
            save_config(cfg, out_dir / "finetune_config.yaml")
        tok = load_task_tokenizer(cfg.init)
        model = load_model("qa", cfg.init)
        v2 = d.version_2_with_negative
        results: dict[str, Any] = {"task": "squad", "version": "2.0" if v2 else "1.1", "init": cfg.init}
        if cfg.train.do_train:
            train_path, _ = _subset_squad_file(d.train_file, d.train_articles, "data.train_articles", out_dir, "train")
            examples = read_squad(train_path, version_2_with_negative=v2)
            # rank 0 builds the cache first; the others then read it instead of all tokenizing at once
            if dist.is_main:
                feats, _ = load_or_build_features(train_path, examples, tok, fcfg, True, d.cache_dir)
            barrier()
            if not dist.is_main:
                feats, _ = load_or_build_features(train_path, examples, tok, fcfg, True, d.cache_dir)
            model, tr = train_loop(cfg, model, feats, ("input_ids", "token_type_ids", "attention_mask",
                                                        "start_positions", "end_positions"), dist, "squad")
            results.update(train_examples=len(examples), train_features=len(feats["input_ids"]),
                           train_steps=tr.steps, train_seconds=round(tr.seconds, 1),
                           train_examples_per_second=round(tr.examples_per_second, 2), final_loss=tr.final_loss)
        if cfg.train.do_eval:
            dev_path, dev_json = _subset_squad_file(d.dev_file, d.dev_articles, "data.dev_articles", out_dir, "dev")
            examples = read_squad(dev_path, version_2_with_negative=v2)
            if dist.is_main:
                feats, _ = load_or_build_features(dev_path, examples, tok, fcfg, False, d.cache_dir)
            barrier()
            if not dist.is_main:
                feats, _ = load_or_build_features(dev_path, examples, tok, fcfg, False, d.cache_dir)
            model.to(dist.device)
            t0 = time.perf_counter()
            start, end = distributed_forward(model, feats, lambda o: (o.start_logits, o.end_logits), dist,
                                             cfg.train.eval_batch_size, _eval_precision(cfg, dist),
                                             trim=cfg.train.trim_padding)
            eval_s = time.perf_counter() - t0
            if dist.is_main:
                pcfg = SquadPostprocessConfig(d.n_best_size, d.max_answer_length, d.null_score_diff_threshold)
                preds, nbest, null_odds = postprocess_predictions(examples, feats, start, end, pcfg, v2)
                write_prediction_files(out_dir, preds, nbest, null_odds if v2 else None)
                official = evaluate_squad(dev_json, preds, null_odds if v2 else None,
                                          version="2.0" if v2 else "1.1")
                results.update(official)
                results.update(eval_examples=len(examples), eval_features=len(feats["input_ids"]),
                               eval_seconds=round(eval_s, 1))
                if v2:
                    # The best threshold found on dev (evaluate-v2.0.py's best_f1_thresh) applied to the same
                    # scores: the predictions a tuned run would submit.
                    thr = official["best_f1_thresh"]
                    best_preds = apply_null_threshold(nbest, null_odds, thr)
                    atomic_write_json(out_dir / "predictions_best_f1_thresh.json", best_preds)
                    at_best = evaluate_squad(dev_json, best_preds, None, version="2.0")
                    results["at_best_f1_thresh"] = {"threshold": thr, "exact": at_best["exact"],
                                                    "f1": at_best["f1"]}
                atomic_write_json(out_dir / "eval_results.json", results)
                log.info("SQuAD dev: %s", {k: v for k, v in results.items() if not isinstance(v, dict)})
        if cfg.checkpoint.export_final and cfg.train.do_train and dist.is_main:
            model.save_pretrained(out_dir / "final")
            atomic_write_json(out_dir / "final" / "task.json", {
                "kind": "qa", "task": "squad", "version_2_with_negative": v2, "max_seq_length": d.max_seq_length,
                "doc_stride": d.doc_stride, "max_query_length": d.max_query_length})
        barrier()
        return results if dist.is_main else {}


# ----------------------------------------------------------------------------------------------- GLUE

def run_glue(cfg: GlueFinetuneConfig) -> dict[str, Any]:
    """Fine-tune and/or evaluate on a GLUE task; rank 0 writes eval_results.json and the test submission."""
    from bertrain.config import save_config
    from bertrain.tasks.common import load_task_tokenizer
    from bertrain.tasks.glue import build_features, get_task, read_split, write_submission
    from bertrain.tasks.metrics import glue_compute_metrics
    from bertrain.train.distributed import barrier, distributed_context
    from bertrain.utils.io import atomic_write_json

    d = cfg.data
    task = get_task(d.task)
    out_dir = Path(cfg.output_dir)
    with distributed_context(cfg.distributed) as dist:
        seed_everything(cfg.seed, dist.rank)
        if dist.is_main:
            out_dir.mkdir(parents=True, exist_ok=True)
            save_config(cfg, out_dir / "finetune_config.yaml")
        tok = load_task_tokenizer(cfg.init)
        model = load_model("cls", cfg.init, num_labels=task.num_labels)
        results: dict[str, Any] = {"task": task.name, "init": cfg.init, "max_seq_length": d.max_seq_length}
        if cfg.train.do_train:
            (_, examples), = read_split(d.data_dir, task, "train")
            n_all = len(examples)
            if d.max_train_examples and d.max_train_examples < n_all:
                keep = np.sort(np.random.default_rng(cfg.seed).permutation(n_all)[: d.max_train_examples])
                examples = [examples[i] for i in keep]
            feats = build_features(examples, task, tok, d.max_seq_length)
            model, tr = train_loop(cfg, model, feats, ("input_ids", "token_type_ids", "attention_mask", "labels"),
                                   dist, task.name, task.num_labels)
            results.update(train_examples=len(examples), train_examples_available=n_all, train_steps=tr.steps,
                           epochs=cfg.train.epochs if not cfg.train.max_steps else None,
                           train_seconds=round(tr.seconds, 1),
                           train_examples_per_second=round(tr.examples_per_second, 2), final_loss=tr.final_loss)
        model.to(dist.device)

        def predict(examples):
            feats = build_features(examples, task, tok, d.max_seq_length)
            (logits,) = distributed_forward(model, feats, lambda o: (o.logits,), dist, cfg.train.eval_batch_size,
                                            _eval_precision(cfg, dist), trim=cfg.train.trim_padding)
            preds = logits[:, 0] if task.is_regression else logits.argmax(axis=1)
            return feats, preds

        if cfg.train.do_eval:
            for split_name, examples in read_split(d.data_dir, task, "dev"):
                feats, preds = predict(examples)
                metrics = glue_compute_metrics(task.name, preds.tolist(), feats["labels"].tolist())
                results[split_name] = {**metrics, "examples": len(examples)}
                if task.labels is not None:
                    counts = np.bincount(feats["labels"], minlength=task.num_labels)
                    results[split_name]["majority_baseline_accuracy"] = float(counts.max() / counts.sum())
                log.info("%s %s: %s", task.name, split_name, results[split_name])
        if d.predict_test:
            test_files = [Path(d.data_dir) / fn for _, fn in task.test_files]
            if all(p.is_file() for p in test_files):
                for (split_name, examples), sub in zip(read_split(d.data_dir, task, "test"), task.submission):
                    _, preds = predict(examples)
                    if dist.is_main:
                        write_submission(out_dir / sub, task, examples, preds)
                results["test_predictions"] = list(task.submission)
            else:
                log.info("no test file in %s: skipping test predictions", d.data_dir)
        if dist.is_main:
            atomic_write_json(out_dir / "eval_results.json", results)
            if cfg.checkpoint.export_final and cfg.train.do_train:
                model.save_pretrained(out_dir / "final")
                # label names and feature settings for `bertrain predict` / `Predictor`
                atomic_write_json(out_dir / "final" / "task.json", {
                    "kind": "classification", "task": task.name,
                    "labels": list(task.labels) if task.labels else None, "max_seq_length": d.max_seq_length})
        barrier()
        return results if dist.is_main else {}
