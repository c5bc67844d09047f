"""BERT pretraining loop: data parallel, gradient accumulation, mixed precision, exact resume.

`train(cfg)` reads as the algorithm; the pieces are plain functions below it. The parts that are easy to get wrong:

* **Loss normalisation.** The MLM loss of a step is the sum of per-token losses over every masked token of the
  global batch divided by their global count (likewise NSP), so 1 process x accumulation k == k processes x 1.
  The count is all-reduced once per step, before the forward passes; each micro-step back-propagates
  `sum_loss / global_count * world_size`, because DDP *averages* gradients over ranks.
* **Accumulation.** All but the last micro-step run under `no_sync` (no all-reduce); the last backward
  all-reduces every gradient.
* **Clipping** happens in `optimizer_step`, which runs only after the micro-step loop has finished, so it always
  sees the all-reduced gradients (Horovod's clip-before-aggregation pitfall cannot happen here; it is also
  asserted).
* **Agreement.** One small all-reduce per step carries the token counts, whether every rank still has data (the
  epoch ends for all ranks together: uneven data cannot hang) and whether any rank got SIGTERM/SIGINT (all ranks
  then save the same step and exit).
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from bertrain.config import save_config
from bertrain.train import checkpoint as ckpt
from bertrain.train.config import BatchPlan, PretrainConfig, resolve_batch
from bertrain.train.distributed import (
    DistInfo, all_reduce_sum, barrier, broadcast_object, cleanup, gather_objects, grads_are_synced,
    init_distributed, no_sync, unwrap_model, wrap_model,
)
from bertrain.train.metrics import MetricsLogger, plot_metrics
from bertrain.train.optim import build_optimizer
from bertrain.train.precision import Precision
from bertrain.train.schedules import build_scheduler

log = logging.getLogger(__name__)

BATCH_KEYS = ("input_ids", "token_type_ids", "attention_mask", "masked_positions", "masked_labels",
              "next_sentence_labels")


@dataclass
class TrainState:
    """Progress counters saved in every checkpoint."""
    step: int = 0
    """Optimizer steps done (including fp16-skipped ones: their data was consumed)."""
    epoch: int = 0
    samples: int = 0
    """Global samples consumed by completed steps."""
    skipped_steps: int = 0


@dataclass
class RunResult:
    """What `train` returns (on every rank)."""
    state: TrainState
    output_dir: Path
    stopped_by_signal: bool = False
    final_dir: Path | None = None
    last_metrics: dict[str, Any] = field(default_factory=dict)
    model: nn.Module | None = None
    """The trained (unwrapped) model of this rank."""


# ----------------------------------------------------------------------------------------------- the algorithm

def train(cfg: PretrainConfig, resume: str | None = None) -> RunResult:
    """Pretrain BERT as configured; `resume` is None, "auto" (newest complete checkpoint) or a checkpoint path."""
    dist = init_distributed(cfg.distributed)
    try:
        out = Path(cfg.output_dir)
        plan = resolve_batch(cfg.train, dist.world_size)
        data = build_data(cfg, dist, plan)
        torch.manual_seed(cfg.seed)  # same initial weights on every rank (DDP also broadcasts rank 0's)
        model = build_model(cfg, data.vocab_size, data.tokenizer_files).to(dist.device)
        model.bert.gradient_checkpointing = cfg.model.gradient_checkpointing
        model.bert.jagged_attention = cfg.model.jagged_attention
        if cfg.model.compile:
            model.bert.compile_layers()
        total_steps = resolve_total_steps(cfg, data.loader, plan)
        lr = scaled_lr(cfg, plan)
        optimizer = build_optimizer(model, cfg.optim, lr)
        scheduler = build_scheduler(optimizer, cfg.schedule, total_steps)
        precision = Precision(cfg.precision, dist.device)
        state = TrainState()
        seed_rank_rng(cfg.seed, dist.rank, 0)  # dropout differs per rank, reproducibly
        start = find_resume_checkpoint(resume, out)
        if start is not None:
            state = restore(start, model, optimizer, scheduler, precision, data.loader, dist, cfg)
        else:
            data.loader.set_epoch(0)
        ddp_model = wrap_model(model, dist, cfg.distributed)
        if dist.is_main:
            save_config(cfg, out / "config.yaml")
            log.info("pretraining %s: %d steps, global batch %d = micro %d x accumulation %d x world %d, lr %g, "
                     "%s, %s", cfg.model.preset, total_steps, plan.global_batch_size, plan.micro_batch_size,
                     plan.accumulation, plan.world_size, lr, cfg.optim.name, cfg.precision.mode)
        with StopSignal() as stop, MetricsLogger(out, dist.is_main, resume_step=state.step if start else None) as ml, \
                log_through_bar(show_bar(dist)):
            stopped, last = run_steps(ddp_model, data, optimizer, scheduler, precision, state, total_steps, plan,
                                      cfg, dist, stop, ml)
            if stopped or state.step % max(1, cfg.checkpoint.save_interval) != 0 or cfg.checkpoint.save_interval == 0:
                save(out, model, optimizer, scheduler, precision, data.loader, state, cfg, dist, plan)
        result = RunResult(state, out, stopped, last_metrics=last, model=model)
        if dist.is_main and not stopped:
            result.final_dir = finish(out, model, cfg)
        barrier()
        return result
    finally:
        cleanup()


def run_steps(model: nn.Module, data: "PretrainData", optimizer: torch.optim.Optimizer, scheduler: Any,
              precision: Precision, state: TrainState, total_steps: int, plan: BatchPlan, cfg: PretrainConfig,
              dist: DistInfo, stop: "StopSignal", metrics_log: MetricsLogger) -> tuple[bool, dict[str, Any]]:
    """Optimizer steps until `total_steps` or a stop signal; returns (stopped_by_signal, last logged metrics)."""
    params = [p for p in model.parameters() if p.requires_grad]
    vocab_size = data.vocab_size
    meter = Meter(dist.device)
    batches_iter = iter(data.loader)
    empty_epochs = 0  # epochs in a row that ended before a single step: data too small for one global batch
    bar = progress_bar(total_steps, state.step, dist)
    last: dict[str, Any] = {}
    steps_this_epoch = 0
    while state.step < total_steps:
        t0 = time.perf_counter()
        micro_batches = take(batches_iter, plan.accumulation)
        meter.data_time += time.perf_counter() - t0
        flags = step_flags(micro_batches, plan.accumulation, stop.requested, dist)
        if flags["ranks_with_data"] < dist.world_size:
            # some rank has no full step left: every rank ends the epoch here together (no hang on uneven data)
            empty_epochs = empty_epochs + 1 if steps_this_epoch == 0 else 0
            if empty_epochs > 1:  # one is fine: a resume exactly at the end of an epoch
                raise ValueError(f"an epoch of data does not fill one optimizer step of {plan.global_batch_size} "
                                 "samples: lower 'train.global_batch_size' or add data")
            state.epoch += 1
            data.loader.set_epoch(state.epoch)
            batches_iter = iter(data.loader)
            steps_this_epoch = 0
            continue
        steps_this_epoch += 1
        micro_batches = [to_device(trim(mb) if cfg.train.trim_padding else mb, dist.device) for mb in micro_batches]
        loss_sums = forward_backward(model, micro_batches, flags, precision, vocab_size, dist.world_size, meter)
        grad_norm, stepped = optimizer_step(model, params, optimizer, precision, cfg.optim.max_grad_norm)
        if stepped:
            scheduler.step()
        else:
            state.skipped_steps += 1
        state.step += 1
        state.samples += plan.global_batch_size
        meter.add_step(loss_sums, grad_norm, stepped)
        bar.update(1)
        if state.step % cfg.train.log_interval == 0 or state.step == total_steps or flags["stop"]:
            last = meter.flush(state, optimizer, precision, dist)
            metrics_log.log(last)
            bar.set_postfix(loss=f"{last['loss']:.3f}", mlm_acc=f"{last['mlm_acc']:.3f}")
            log.info("step %d/%d loss %.4f mlm_acc %.4f nsp_acc %s lr %.3g grad_norm %.3g %.1f seq/s",
                     state.step, total_steps, last["loss"], last["mlm_acc"],
                     "-" if last["nsp_acc"] is None else f"{last['nsp_acc']:.3f}", last["lr"], last["grad_norm"],
                     last["seq_per_s"])
        if flags["stop"]:
            log.warning("stop requested (signal): saving step %d and exiting", state.step)
            bar.close()
            return True, last
        if cfg.checkpoint.save_interval and state.step % cfg.checkpoint.save_interval == 0:
            save(Path(cfg.output_dir), unwrap_model(model), optimizer, scheduler, precision, data.loader, state, cfg,
                 dist, plan)
    bar.close()
    return False, last


def forward_backward(model: nn.Module, micro_batches: list[dict[str, torch.Tensor]], flags: dict[str, Any],
                     precision: Precision, vocab_size: int, world_size: int, meter: "Meter") -> torch.Tensor:
    """Forward and backward of every micro-batch; the all-reduce happens only in the last backward.

    Each micro-step's loss is its summed per-target losses over the *global* target counts, times the world size
    (DDP averages gradients over ranks), so the accumulated gradient is that of the global-batch mean loss.
    Returns this rank's share of [loss, mlm_loss, nsp_loss] for the step (detached; summed over ranks they give
    the step's global losses).
    """
    mlm_count = max(flags["mlm_count"], 1)
    nsp_count = max(flags["nsp_count"], 1)
    shares = torch.zeros(3, device=micro_batches[0]["input_ids"].device)
    for i, mb in enumerate(micro_batches):
        last = i == len(micro_batches) - 1
        with no_sync(model, enabled=not last):
            with precision.autocast():
                out = model(input_ids=mb["input_ids"], token_type_ids=mb["token_type_ids"],
                            attention_mask=mb["attention_mask"], masked_positions=mb["masked_positions"])
            sums = pretraining_sums(out.prediction_logits, out.seq_relationship_logits, mb, vocab_size)
            mlm, nsp = sums["mlm_loss_sum"] / mlm_count, sums["nsp_loss_sum"] / nsp_count
            precision.backward((mlm + nsp) * world_size)
        shares += torch.stack([mlm + nsp, mlm, nsp]).detach()
        meter.add_micro(sums, mb)
    return shares


def optimizer_step(model: nn.Module, params: list[nn.Parameter], optimizer: torch.optim.Optimizer,
                   precision: Precision, max_grad_norm: float) -> tuple[torch.Tensor, bool]:
    """Unscale, clip (on the all-reduced gradients) and step; returns (grad norm, stepped)."""
    assert grads_are_synced(model), "clipping must see all-reduced gradients (called inside no_sync)"
    grad_norm = precision.unscale_and_clip(optimizer, params, max_grad_norm)
    stepped = precision.step(optimizer)
    optimizer.zero_grad(set_to_none=True)
    return grad_norm.detach(), stepped


def pretraining_sums(prediction_logits: torch.Tensor, nsp_logits: torch.Tensor, mb: dict[str, torch.Tensor],
                     vocab_size: int) -> dict[str, torch.Tensor]:
    """Summed (not averaged) MLM and NSP losses and correct counts of one micro-batch, in fp32."""
    logits = prediction_logits[..., :vocab_size].float()  # padded vocab rows are never targets
    labels = mb["masked_labels"]
    mlm_sum = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100,
                              reduction="sum")
    nsp_labels = mb["next_sentence_labels"]
    nsp_sum = F.cross_entropy(nsp_logits.float(), nsp_labels, ignore_index=-100, reduction="sum")
    with torch.no_grad():
        valid = labels != -100
        nsp_valid = nsp_labels != -100
        mlm_correct = ((logits.argmax(-1) == labels) & valid).sum()
        nsp_correct = ((nsp_logits.argmax(-1) == nsp_labels) & nsp_valid).sum()
    return {"mlm_loss_sum": mlm_sum, "nsp_loss_sum": nsp_sum, "mlm_correct": mlm_correct,
            "mlm_count": valid.sum(), "nsp_correct": nsp_correct, "nsp_count": nsp_valid.sum()}


def step_flags(micro_batches: list[dict[str, torch.Tensor]], accumulation: int, stop: bool,
               dist: DistInfo) -> dict[str, Any]:
    """One all-reduce per step: global MLM/NSP target counts, ranks with a full step of data, stop requests."""
    full = len(micro_batches) == accumulation
    mlm = sum(int((mb["masked_labels"] != -100).sum()) for mb in micro_batches) if full else 0
    nsp = sum(int((mb["next_sentence_labels"] != -100).sum()) for mb in micro_batches) if full else 0
    v = torch.tensor([mlm, nsp, int(full), int(stop)], dtype=torch.float64, device=dist.device)
    if dist.device.type == "cuda" or dist.world_size > 1:
        v = all_reduce_sum(v)
    mlm, nsp, ranks, stops = (int(x) for x in v.tolist())
    return {"mlm_count": mlm, "nsp_count": nsp, "ranks_with_data": ranks, "stop": stops > 0}


def take(it: Iterator, n: int) -> list:
    """Up to `n` items of `it` (fewer at the end of the epoch)."""
    out = []
    for _ in range(n):
        try:
            out.append(next(it))
        except StopIteration:
            break
    return out


def trim(mb: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop padding columns beyond the longest sequence (attention is masked there, so results are the same)."""
    longest = int(mb["attention_mask"].sum(1).max())
    if longest == mb["input_ids"].shape[1]:
        return mb
    out = dict(mb)
    for k in ("input_ids", "token_type_ids", "attention_mask"):
        out[k] = mb[k][:, :longest]
    return out


def to_device(mb: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {k: v.to(device, non_blocking=True) for k, v in mb.items()}


# ----------------------------------------------------------------------------------------------- metrics

class Meter:
    """Accumulates per-step numbers on the device; one all-reduce and one host sync per log interval."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.reset()

    def reset(self) -> None:
        # [loss, mlm_loss, nsp_loss, mlm_correct, mlm_count, nsp_correct, nsp_count, real_tokens, sequences]
        self.sums = torch.zeros(9, dtype=torch.float64, device=self.device)
        self.grad_norm = torch.zeros((), dtype=torch.float64, device=self.device)
        self.steps = 0
        self.stepped = 0
        self.data_time = 0.0
        self.t0 = time.perf_counter()

    def add_micro(self, sums: dict[str, torch.Tensor], mb: dict[str, torch.Tensor]) -> None:
        self.sums[3:] += torch.stack([sums["mlm_correct"], sums["mlm_count"], sums["nsp_correct"], sums["nsp_count"],
                                      mb["attention_mask"].sum(), torch.tensor(mb["input_ids"].shape[0],
                                                                               device=self.device)]).double()

    def add_step(self, shares: torch.Tensor, grad_norm: torch.Tensor, stepped: bool) -> None:
        self.sums[:3] += shares.double()
        self.steps += 1
        if stepped:
            self.stepped += 1
            self.grad_norm += grad_norm.double()

    def flush(self, state: TrainState, optimizer: torch.optim.Optimizer, precision: Precision,
              dist: DistInfo) -> dict[str, Any]:
        totals = all_reduce_sum(self.sums.clone()).tolist()
        wait = torch.tensor([self.data_time], dtype=torch.float64, device=self.device)
        wait = all_reduce_sum(wait).item() / dist.world_size
        elapsed = max(time.perf_counter() - self.t0, 1e-9)
        loss, mlm_loss, nsp_loss, mlm_correct, mlm_count, nsp_correct, nsp_count, tokens, seqs = totals
        n = max(self.steps, 1)
        record = {
            "step": state.step, "epoch": state.epoch, "samples": state.samples,
            "loss": loss / n, "mlm_loss": mlm_loss / n, "nsp_loss": nsp_loss / n if nsp_count else None,
            "mlm_acc": mlm_correct / max(mlm_count, 1), "nsp_acc": nsp_correct / nsp_count if nsp_count else None,
            "lr": optimizer.param_groups[0]["lr"],
            "grad_norm": self.grad_norm.item() / self.stepped if self.stepped else float("nan"),
            "loss_scale": precision.loss_scale, "skipped_steps": state.skipped_steps,
            "seq_per_s": seqs / elapsed, "tokens_per_s": tokens / elapsed,
            "data_wait": min(1.0, wait / elapsed), "elapsed_s": elapsed,
        }
        self.reset()
        return record


def progress_bar(total: int, initial: int, dist: DistInfo) -> Any:
    """tqdm on rank 0 when the output is a terminal (disabled, it is a do-nothing object)."""
    from tqdm import tqdm
    return tqdm(total=total, initial=initial, desc="pretrain", unit="step", dynamic_ncols=True,
                disable=not show_bar(dist))


def show_bar(dist: DistInfo) -> bool:
    return dist.is_main and sys.stderr.isatty()


def log_through_bar(enabled: bool) -> contextlib.AbstractContextManager:
    """While a bar is shown, route log lines through tqdm.write so they do not tear the bar."""
    if not enabled:
        return contextlib.nullcontext()
    from tqdm.contrib.logging import logging_redirect_tqdm
    return logging_redirect_tqdm()


# ----------------------------------------------------------------------------------------------- set-up pieces

@dataclass
class PretrainData:
    loader: Any
    """Iterable of micro-batch dicts with set_epoch / state_dict / load_state_dict / __len__."""
    vocab_size: int
    tokenizer_files: dict[str, bytes] | None = None
    identity: str | None = None


def build_data(cfg: PretrainConfig, dist: DistInfo, plan: BatchPlan) -> PretrainData:
    """The micro-batch loader for this rank: synthetic, a prepared folder, or raw input prepared on the fly."""
    d = cfg.data
    if d.source == "synthetic":
        from bertrain.train.synthetic import SyntheticPretrainingLoader
        loader = SyntheticPretrainingLoader(d.synthetic_samples, plan.micro_batch_size, dist.rank, dist.world_size,
                                            cfg.seed, d.max_seq_length, d.max_predictions_per_seq, d.vocab_size,
                                            d.uneven_last_rank)
        return PretrainData(loader, d.vocab_size)
    from bertrain.train import data_setup
    return data_setup.build_real_data(cfg, dist, plan)


def build_model(cfg: PretrainConfig, vocab_size: int, tokenizer_files: dict[str, bytes] | None) -> nn.Module:
    """BertForPreTraining from a preset or config.json, optionally initialised from a checkpoint (weights only)."""
    from bertrain.model.bert import BertConfig, BertForPreTraining
    m = cfg.model
    overrides = m.architecture_overrides()
    if m.init:
        dropout = {k: v for k, v in overrides.items() if k.endswith("dropout_prob")}
        model = BertForPreTraining.from_pretrained(m.init, **dropout)
        for k, v in overrides.items():
            if k not in dropout and getattr(model.config, k) != v:
                raise ValueError(f"config key 'model.{k}' = {v} disagrees with the model.init weights ({m.init} has "
                                 f"{getattr(model.config, k)}); an initialised model keeps its shape")
        init_vocab = model.tokenizer_files.get("vocab.txt")
        if init_vocab and tokenizer_files and tokenizer_files.get("vocab.txt") not in (None, init_vocab):
            raise ValueError(f"config key 'model.init': the vocab.txt of {m.init} differs from the vocabulary the "
                             "data was tokenized with; prepare the data with the model's vocab.txt")
        if model.config.vocab_size != vocab_size:
            raise ValueError(f"config key 'model.init': {m.init} has vocab_size {model.config.vocab_size} but the "
                             f"data's vocabulary has {vocab_size} entries")
        log.info("initialised weights from %s (weights only; optimizer and schedule start fresh)", m.init)
    else:
        if m.preset.endswith(".json") or Path(m.preset).is_file():
            config = BertConfig.from_json_file(m.preset)
            if config.vocab_size != vocab_size:
                raise ValueError(f"config key 'model.preset': {m.preset} has vocab_size {config.vocab_size} but the "
                                 f"data's vocabulary has {vocab_size} entries")
            config = dataclasses.replace(config, **overrides)  # re-validated by BertConfig.__post_init__
        else:
            config = BertConfig.from_preset(m.preset, vocab_size=vocab_size, **overrides)
        model = BertForPreTraining(config)
    if tokenizer_files:
        model.tokenizer_files = dict(tokenizer_files)
    if cfg.data.max_seq_length > model.config.max_position_embeddings:
        raise ValueError(f"config key 'data.max_seq_length' ({cfg.data.max_seq_length}) exceeds the model's "
                         f"max_position_embeddings ({model.config.max_position_embeddings})")
    return model


def resolve_total_steps(cfg: PretrainConfig, loader: Any, plan: BatchPlan) -> int:
    """train.steps, or epochs x full steps per epoch (the shortest rank decides, as the loop does)."""
    if cfg.train.steps:
        return cfg.train.steps
    per_epoch = min(gather_objects(len(loader))) // plan.accumulation
    if per_epoch == 0:
        raise ValueError(f"config key 'train.global_batch_size': one epoch has fewer than {plan.global_batch_size} "
                         "samples, so not a single step fits")
    return max(1, int(cfg.train.epochs * per_epoch))


def scaled_lr(cfg: PretrainConfig, plan: BatchPlan) -> float:
    if not cfg.optim.scale_lr_with_batch:
        return cfg.optim.lr
    return cfg.optim.lr * plan.global_batch_size / cfg.optim.base_batch_size


def seed_rank_rng(seed: int, rank: int, step: int) -> None:
    """Seed this rank's RNGs (dropout) as a function of (seed, rank, step)."""
    import random

    import numpy as np
    s = (seed * 1_000_003 + rank * 7919 + step) % (2**31)
    random.seed(s)
    np.random.seed(s)
    torch.manual_seed(s)


# ----------------------------------------------------------------------------------------------- checkpoints

def find_resume_checkpoint(resume: str | None, output_dir: Path) -> Path | None:
    """Rank 0 decides which checkpoint to resume from and tells the others."""
    choice: str | None = None
    if resume:
        import torch.distributed as td
        problem = None
        if not td.is_initialized() or td.get_rank() == 0:
            if resume == "auto":
                found = ckpt.latest_checkpoint(output_dir)
                if found is None:
                    log.info("--resume auto: no complete checkpoint in %s, starting from scratch", output_dir)
                choice = str(found) if found else None
            else:
                problem = ckpt.verify_checkpoint(resume)
                choice = resume
        # every rank learns the decision (or the error), so none waits forever for a rank that gave up
        choice, problem = broadcast_object((choice, problem))
        if problem:
            raise ValueError(f"--resume {resume}: {problem}")
    return Path(choice) if choice else None


def save(out: Path, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, precision: Precision,
         loader: Any, state: TrainState, cfg: PretrainConfig, dist: DistInfo, plan: BatchPlan) -> None:
    """Every rank contributes its RNG state; rank 0 writes the folder; all wait for it."""
    rngs = gather_objects(ckpt.rng_state())
    if dist.is_main:
        train_state = {
            "version": 1, "state": asdict(state), "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(), "precision": precision.state_dict(), "rng": rngs,
            "loader": loader.state_dict(), "world_size": dist.world_size, "batch": asdict(plan),
        }
        ckpt.save_checkpoint(out, state.step, unwrap_model(model), train_state, cfg, cfg.checkpoint.keep_last)
    barrier()


def restore(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, precision: Precision,
            loader: Any, dist: DistInfo, cfg: PretrainConfig) -> TrainState:
    """Load everything a checkpoint holds; RNG states are per rank when the world size is unchanged."""
    ts = ckpt.load_train_state(path)
    ckpt.load_model_weights(model, path)
    optimizer.load_state_dict(ts["optimizer"])
    scheduler.load_state_dict(ts["scheduler"])
    precision.load_state_dict(ts["precision"])
    loader.load_state_dict(ts["loader"])
    state = TrainState(**ts["state"])
    if ts["world_size"] == dist.world_size:
        ckpt.set_rng_state(ts["rng"][dist.rank])
    else:
        log.warning("resuming on %d ranks from a %d-rank checkpoint: per-rank RNG streams are re-seeded",
                    dist.world_size, ts["world_size"])
        seed_rank_rng(cfg.seed, dist.rank, state.step)
    if ts["batch"]["global_batch_size"] != resolve_batch(cfg.train, dist.world_size).global_batch_size:
        log.warning("the global batch size changed since the checkpoint (%d): the data order differs from a "
                    "straight run", ts["batch"]["global_batch_size"])
    log.info("resumed from %s at step %d (epoch %d, %d samples)", path, state.step, state.epoch, state.samples)
    return state


def finish(out: Path, model: nn.Module, cfg: PretrainConfig) -> Path | None:
    """Rank 0: the plot and the HF export of the final model."""
    jsonl = out / "metrics.jsonl"
    if jsonl.exists():
        try:
            plot_metrics(jsonl, out / "metrics.png")
        except Exception as e:  # a plot must never fail a finished run
            log.warning("could not plot metrics: %s", e)
    if not cfg.checkpoint.export_final:
        return None
    final = out / "final"
    from bertrain.utils.io import atomic_dir
    with atomic_dir(final, overwrite=True) as tmp:
        ckpt.save_model(model, tmp)
    log.info("exported the final model in HF format to %s", final)
    return final


# ----------------------------------------------------------------------------------------------- signals

class StopSignal:
    """SIGTERM / SIGINT set a flag; the loop saves at the end of the step and exits (all ranks agree via the
    per-step all-reduce). A second SIGINT interrupts at once."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = True
        log.warning("received %s: will save a checkpoint at the end of this step and stop",
                    signal.Signals(signum).name)

    def __enter__(self) -> "StopSignal":
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
