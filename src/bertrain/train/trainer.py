"""The one training engine: pretraining and every fine-tuning task run through `Trainer.fit`.

A `Task` supplies only what differs between them: its model, its micro-batch loader (built on the shared rank
partition of `bertrain.data.sampler`), how many loss targets a micro-batch holds, and its loss as sums
(`bertrain.model.losses`). The Trainer owns everything else: distributed set-up, the batch plan, precision,
optimizer and schedule, metrics / progress bar / stop signal, the one checkpoint layout and the one resume path.

The parts that are easy to get wrong:

* **Loss normalisation.** Each loss group's sum over the micro-batch (e.g. MLM: summed token losses) is divided
  by that group's target count over the *global* batch, so 1 process x accumulation k == k processes x 1, even
  when micro-batches hold different numbers of targets. The counts are all-reduced once per step, before the
  forward passes; each micro-step back-propagates `sum / global_count * world_size`, because DDP *averages*
  gradients over ranks.
* **Accumulation.** All but the last micro-step run under `no_sync` (no all-reduce); the last backward
  all-reduces every gradient.
* **Clipping** happens in `optimizer_step`, which runs only after the micro-step loop has finished, so it always
  sees the all-reduced gradients (asserted).
* **Agreement.** One small all-reduce per step carries the target counts, whether every rank still has a full
  step of data (the epoch ends for all ranks together: uneven data cannot hang) and whether any rank got
  SIGTERM/SIGINT (all ranks then save the same step and exit).
* **Resume.** Rank 0 chooses the checkpoint (newest complete and verified one for "auto") and broadcasts the
  choice; every rank restores weights, optimizer, scheduler, loss scaler, loader position and its own RNG state,
  so a resumed run is bitwise the straight one.
* **Strategy.** `parallelism.strategy` ddp wraps the model in DDP; fsdp shards it in place with FSDP2
  (`train/parallel.py`) before the optimizer is built, so the optimizer holds only this rank's shards. The step
  is the same code: `no_sync` skips the reduce-scatter instead of the all-reduce, FSDP2 also averages over
  ranks, norms of sharded tensors are reduced over the ranks. Checkpoints are then written by every rank
  (`train/dcp.py`), and the returned model is gathered back into one plain module.
"""
from __future__ import annotations

import contextlib
import logging
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator, Protocol

import torch
from torch import nn
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from bertrain import __version__
from bertrain.config import save_config
from bertrain.model.options import apply_model_options
from bertrain.model.unpad import to_device as to_device_tensor
from bertrain.train import checkpoint as ckpt
from bertrain.train import schedules
from bertrain.train.config import BatchPlan, TrainConfig, TrainerConfig, resolve_batch
from bertrain.train.dcp import save_sharded_checkpoint
from bertrain.train.evaluation import Evaluator, OnEval
from bertrain.train.distributed import (
    DistInfo, all_reduce_sum, gather_objects, grads_are_synced, no_sync, on_rank0, wrap_model,
)
from bertrain.train.metrics import MetricsLogger
from bertrain.train.optim import build_optimizer
from bertrain.train.parallel import ParallelDims, apply_fsdp, gather_full_model, is_sharded, meta_copy
from bertrain.train.precision import Precision
from bertrain.train.profiling import StepProfiler
from bertrain.train.resume import NUMERICS, find_resume_checkpoint, init_optimizer_state, restore
from bertrain.train.schedules import build_scheduler
from bertrain.train.states import Clock, Stateful, TrainState, saved_entries, training_states
from bertrain.train.trackers import TrackerIds, Trackers, open_trackers, run_status
from bertrain.train.watchdog import StopSignal, Watchdog
from bertrain.utils.errors import OutputError, UserError, writing
from bertrain.utils.memory import release_freed_memory

log = logging.getLogger(__name__)

Batch = dict[str, torch.Tensor]


class Loader(Protocol):
    """A rank's micro-batches (see `bertrain.data.sampler.ResumableLoader`)."""

    def __iter__(self) -> Iterator[Batch]: ...
    def __len__(self) -> int: ...
    def set_epoch(self, epoch: int) -> None: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class Task(Protocol):
    """What a task supplies to the Trainer."""

    name: str
    loss_groups: tuple[str, ...]
    """Each group `g` is normalised by its own global target count: `forward` returns `{g}_loss_sum`."""

    def build_loader(self, dist: DistInfo, plan: BatchPlan) -> Loader:
        """This rank's micro-batches of `plan.micro_batch_size` (CPU tensors)."""

    def build_model(self) -> nn.Module:
        """The model on CPU; called with the same torch seed on every rank."""

    def target_counts(self, batch: Batch) -> list[int]:
        """Targets of each loss group in one micro-batch (known before the forward pass)."""

    def forward(self, model: nn.Module, batch: Batch) -> dict[str, torch.Tensor]:
        """`{g}_loss_sum` for each group (differentiable) and other sums to log (e.g. correct predictions)."""

    def metrics(self, sums: dict[str, float]) -> dict[str, Any]:
        """Derived numbers for a log record from the summed outputs of `forward` over an interval."""

    # Optional, for evaluation while training (train/evaluation.py): `primary_metric: str` and
    # `evaluate(model, dist, precision) -> {metric: value}` (the plain model in eval mode under no_grad; the same
    # numbers on every rank); `can_evaluate: bool` (False: no evaluation data, e.g. a store without held-out set).


@dataclass
class RunResult:
    """What `Trainer.fit` returns (on every rank)."""
    state: TrainState
    model: nn.Module
    """The trained (unwrapped) model of this rank."""
    total_steps: int
    plan: BatchPlan
    seconds: float = 0.0
    """Wall time of the steps run by this process (not counting set-up)."""
    stopped_by_signal: bool = False
    last_metrics: dict[str, Any] = field(default_factory=dict)
    start_step: int = 0
    """The step this process started at (> 0 after a resume)."""
    evaluation: dict[str, Any] = field(default_factory=dict)
    """`Evaluator.summary()`: the selection metric, the best step and value, why the run stopped early, every
    evaluation (empty when the task does not evaluate)."""
    stop_reason: str | None = None
    """Why the run ended before its step count (the time budget), None otherwise."""
    trackers: Trackers = field(default_factory=lambda: Trackers([], enabled=False))
    """The run's trackers, still open after a finished run: the caller logs its results and artifacts and calls
    `finish` (closed already after a stop by signal or an error)."""

    @property
    def ended_early(self) -> str | None:
        """Why the run ended before its step count: the time budget, an early stop, a target, a search; or None."""
        return self.stop_reason or self.evaluation.get("stop_reason")

    @contextlib.contextmanager
    def closing_on_error(self) -> Iterator[None]:
        """Around what the caller does between `fit` and `finish` (the final evaluation, the export): an error
        there ends the trackers' runs FAILED (KILLED for a stop); they stayed RUNNING."""
        try:
            yield
        except BaseException as e:
            self.trackers.close(run_status(e))
            raise

    def finish(self, results: dict[str, Any] | None = None, *artifacts: Path | None) -> None:
        """Hand the final results and the output folders/files to the trackers and close them (rank 0 logs;
        elsewhere a no-op)."""
        if results:
            self.trackers.results(results)
        for path in artifacts:
            if path is not None and Path(path).exists():
                self.trackers.artifact(path)
        self.trackers.close()


class Trainer:
    """`Trainer(cfg, dist).fit(task, resume)`: train `task` as configured; `resume` is None, "auto" (newest
    complete checkpoint in `cfg.output_dir`, else from scratch) or a checkpoint folder."""

    def __init__(self, cfg: TrainerConfig, dist: DistInfo) -> None:
        self.cfg = cfg
        self.dist = dist
        self.out = Path(cfg.output_dir)

    def fit(self, task: Task, resume: str | None = None, allow_config_change: bool = False,
            on_eval: OnEval | None = None) -> RunResult:
        """`on_eval(step, value)`: called after each evaluation (train/evaluation.py); True stops the run."""
        cfg, dist = self.cfg, self.dist
        plan = resolve_batch(cfg.train, dist.world_size)
        dims = ParallelDims.from_config(cfg, dist.world_size)  # refuses a strategy that does not fit the job
        loader = task.build_loader(dist, plan)
        ckpt.use_deterministic_kernels(cfg.train.deterministic)
        torch.manual_seed(cfg.seed)  # same initial weights on every rank (DDP also broadcasts rank 0's)
        model = apply_model_options(task.build_model(), cfg.model_options).to(dist.device)
        template = None
        if dims.fsdp_enabled:  # before the optimizer: fully_shard replaces the parameters with this rank's shards
            template = meta_copy(model)
            apply_fsdp(model, cfg, dist)
        per_epoch = min(gather_objects(len(loader))) // plan.accumulation  # the shortest rank decides, as the loop
        total_steps = resolve_total_steps(cfg.train, per_epoch, plan)
        lr = scaled_lr(cfg, plan)
        optimizer = build_optimizer(model, cfg.optim, lr)
        scheduler = build_scheduler(optimizer, cfg.schedule, total_steps)
        precision = Precision(cfg.precision, dist.device)
        ckpt.seed_rank_rng(cfg.seed, dist.rank, 0)  # dropout differs per rank, reproducibly
        state, changes = TrainState(), {}
        evaluator = Evaluator(cfg.eval, task, dist, precision, self.out, total_steps, per_epoch, template, on_eval)
        tracker_ids = TrackerIds()
        states = training_states(model, optimizer, scheduler, precision, loader, state, cfg.seed, dist,
                                 evaluator.history, Clock(), tracker_ids, Meter(task, dist))
        start = find_resume_checkpoint(resume, self.out, dist)
        if start is not None:
            changes = restore(start, states, dist, cfg, plan, allow_config_change)
        else:
            if cfg.optim.init_state:  # another run's moments (NVIDIA's phase 2); a resume has its own
                init_optimizer_state(cfg, model, optimizer, dist)
            loader.set_epoch(0)
        ddp_model = model if dims.fsdp_enabled else wrap_model(model, dist, cfg.distributed)
        if dist.is_main:
            save_config(cfg, self.out / "config.yaml")
            length = "until the time budget" if total_steps == NO_STEP_LIMIT else f"{total_steps} steps"
            if cfg.train.max_time:
                length += f" (at most {cfg.train.max_time} of training time)"
            log.info("%s: %s, global batch %d = micro %d x accumulation %d x %d ranks, lr %g, %s, %s", task.name,
                     length, plan.global_batch_size, plan.micro_batch_size, plan.accumulation, plan.world_size, lr,
                     cfg.optim.name, cfg.precision.mode)
            if cfg.schedule.on_time:
                log.warning("schedule.on_time: the learning rate follows the wall clock, so this run is not "
                            "bit-reproducible (nor is a resumed one equal to a straight one)")
        start_step = state.step
        run = _Run(self, task, ddp_model, states, total_steps, plan, evaluator)
        t0 = time.perf_counter()
        resume_step = state.step if start else None
        trackers = open_trackers(cfg, self.out, dist.is_main, task.name, resume_step, tracker_ids)
        with contextlib.ExitStack() as on_error:
            # closed here on an error (FAILED; KILLED for a stop the watchdog raises); on success the caller
            # finishes them (RunResult.finish)
            on_error.push(trackers.close_after_error)
            stopped, last = self._train(run, state, changes, resume_step, trackers)
            on_error.pop_all()
        if stopped:
            trackers.close("KILLED")  # saved, resumable: `--resume auto` continues the same tracker runs
        if template is not None:  # one plain module again (every rank) for evaluation and the HF export
            # (the copy keeps the options' flags but not a compiled layer's compiled call: applied again)
            model = apply_model_options(gather_full_model(model, template, dist.device), cfg.model_options)
        if not stopped:
            model = evaluator.final_model(model, state.step)
        return RunResult(state, model, total_steps, plan, time.perf_counter() - t0, stopped, last, start_step,
                         evaluator.summary() if evaluator.enabled else {}, run.stop_reason, trackers)

    def _train(self, run: "_Run", state: TrainState, changes: dict[str, Any], resume_step: int | None,
               trackers: Trackers) -> tuple[bool, dict[str, Any]]:
        """The step loop under the stop signal, the watchdog and the metrics log; the last checkpoint."""
        cfg, dist = self.cfg, self.dist
        with StopSignal() as stop, Watchdog(dist, cfg.distributed, stop, self.out) as watchdog, \
                MetricsLogger(self.out, dist.is_main, resume_step, trackers) as ml, \
                _log_through_bar(_show_bar(dist)):
            if changes:
                ml.log({"step": state.step, "event": "config_change",
                        "changes": {k: {"old": a, "new": b} for k, (a, b) in changes.items()}})
            stopped, last = run.steps(stop, ml, watchdog)
            watchdog.steps_over()  # no step in flight: the stop grace must not cut the last save
            interval = cfg.checkpoint.save_interval
            if stopped or interval == 0 or state.step % interval != 0:
                run.save()
        return stopped, last


class _Run:
    """The state of one `fit`: the step loop and the checkpoint writer."""

    def __init__(self, trainer: Trainer, task: Task, model: nn.Module, states: dict[str, Stateful],
                 total_steps: int, plan: BatchPlan, evaluator: Evaluator) -> None:
        self.cfg, self.dist, self.out = trainer.cfg, trainer.dist, trainer.out
        self.task, self.model, self.states = task, model, states  # `model`: wrapped (DDP) for the steps
        self.loader, self.optimizer = states["loader"], states["optimizer"]
        self.scheduler, self.precision, self.state = states["scheduler"], states["precision"], states["state"]
        self.total_steps, self.plan, self.evaluator = total_steps, plan, evaluator
        self.stop_reason: str | None = None
        """Why the loop ended before total_steps (a time budget), None otherwise."""

    def steps(self, stop: StopSignal, metrics_log: MetricsLogger,
              watchdog: Watchdog) -> tuple[bool, dict[str, Any]]:
        """Optimizer steps until `total_steps`, a stop signal, an early stop or the time budget; returns
        (stopped_by_signal, last logged record)."""
        state, history = self.state, self.evaluator.history
        clock, budget = self.states["clock"], self.cfg.train.max_time_s
        history.recheck_stop(self.evaluator.metric, self.cfg.eval)  # eval.target/patience may have changed
        if history.stop_reason:  # resumed from the checkpoint the run stopped early at: nothing left to do
            log.info("the run stopped at step %d: %s", state.step, history.stop_reason)
            return False, {}
        if budget is not None and clock.elapsed() >= budget:  # resumed with no time left (the same on every rank)
            self.stop_reason = f"no training time left: {clock.elapsed():.0f} s of train.max_time = " \
                               f"{self.cfg.train.max_time} were spent before step {state.step}"
            log.warning("%s", self.stop_reason)
            return False, {}
        clock.start()
        profiler = StepProfiler(self.cfg.profile, self.dist, self.out)
        try:
            return self._loop(stop, metrics_log, watchdog, profiler)
        finally:
            profiler.finish()  # a run that ends inside the window still writes it

    def _loop(self, stop: StopSignal, metrics_log: MetricsLogger, watchdog: Watchdog,
              profiler: StepProfiler) -> tuple[bool, dict[str, Any]]:
        cfg, dist, state, plan = self.cfg, self.dist, self.state, self.plan
        clock, budget, history = self.states["clock"], cfg.train.max_time_s, self.evaluator.history
        params = [p for p in self.model.parameters() if p.requires_grad]
        meter = self.states["meter"]
        meter.restart_clock()
        batches = iter(self.loader)
        empty_epochs = 0  # epochs in a row that ended before a single step: data too small for one global batch
        steps_this_epoch = 0
        warned_room = False  # the disk-room warning, once a run
        bar = tqdm(total=None if self.total_steps == NO_STEP_LIMIT else self.total_steps, initial=state.step,
                   desc=self.task.name, unit="step", dynamic_ncols=True, disable=not _show_bar(dist))
        last: dict[str, Any] = {}
        while state.step < self.total_steps:
            t0 = time.perf_counter()
            micro_batches = take(batches, plan.accumulation)
            meter.data_time += time.perf_counter() - t0
            flags = step_flags(self.task, micro_batches, plan.accumulation, stop.requested, dist,
                               clock.elapsed() if budget else 0.0)
            if flags["ranks_with_data"] < dist.world_size:
                # some rank has no full step left: every rank ends the epoch here together (no hang on uneven data)
                empty_epochs = empty_epochs + 1 if steps_this_epoch == 0 else 0
                if empty_epochs > 1:  # one is fine: a resume exactly at the end of an epoch
                    raise ValueError(f"an epoch of data does not fill one optimizer step of "
                                     f"{plan.global_batch_size} samples: lower 'train.global_batch_size' or add data")
                state.epoch += 1
                self.loader.set_epoch(state.epoch)
                batches = iter(self.loader)
                steps_this_epoch = 0
                continue
            steps_this_epoch += 1
            profiler.step_begin(state.step)
            micro_batches = [to_device(trim_padding(mb) if cfg.train.trim_padding else mb, dist.device)
                             for mb in micro_batches]
            shares = self.forward_backward(micro_batches, flags["counts"], meter)
            meter.lr = self.optimizer.param_groups[0]["lr"]  # the lr this step uses (logged as HF Trainer does)
            grad_norm, stepped = optimizer_step(self.model, params, self.optimizer, self.precision,
                                                cfg.optim.max_grad_norm)
            self.precision.watch(grad_norm, state.step + 1)
            if stepped:
                schedules.advance(self.scheduler, cfg.schedule, flags["elapsed"] / budget if budget else 0.0)
            else:
                state.skipped_steps += 1
            state.step += 1
            state.samples += plan.global_batch_size
            profiler.step_end(state.step)
            meter.add_step(shares, grad_norm, stepped)
            bar.update(1)
            out_of_time = budget is not None and flags["elapsed"] >= budget  # the first step past the budget
            log_due = state.step % cfg.train.log_interval == 0 or state.step == self.total_steps or \
                flags["stop"] or out_of_time
            eval_due = self.evaluator.due(state.step, last=out_of_time)
            save_due = bool(cfg.checkpoint.save_interval) and state.step % cfg.checkpoint.save_interval == 0
            if log_due:
                last = meter.flush(state, self.optimizer, self.precision, dist)
                metrics_log.log(last)
                release_freed_memory()  # CPU: the kept heap's free pages back once they outgrow its use (utils/memory.py)
                bar.set_postfix(loss=f"{last['loss']:.3f}")
                of = "" if self.total_steps == NO_STEP_LIMIT else f"/{self.total_steps}"
                log.info("step %d%s %s", state.step, of, _format_record(last))
            if log_due or eval_due or save_due:  # before anything is evaluated or written from these weights
                self.precision.check_finite(state.step, self.kept)
            if flags["stop"]:
                log.warning("stop requested (signal): saving step %d and exiting", state.step)
                bar.close()
                return True, last
            paused = time.perf_counter()
            with profiler.outside_steps():
                if eval_due:  # before the save: the checkpoint holds it
                    metrics_log.log(self.evaluator.evaluate(self.model, state.step, state.epoch))
                if save_due:
                    self.save()
                    if self.dist.is_main and not warned_room:
                        warned_room = self.warn_if_short_of_room()
            # the throughput of the log interval counts training, not the evaluation and the checkpoint in it (they
            # landed in the next interval's seq/s, tokens/s and data wait; the evaluation has its own eval_s)
            meter.t0 += time.perf_counter() - paused
            watchdog.step_done(state.step)
            if out_of_time:
                self.stop_reason = f"stopped at the time budget (train.max_time = {cfg.train.max_time}) after " \
                                   f"{state.step} steps"
                log.warning("%s", self.stop_reason)
                break
            if history.stop_reason:
                if not log_due:  # the steps since the last log line (metrics.jsonl, final_loss, the model card)
                    last = meter.flush(state, self.optimizer, self.precision, dist)
                    metrics_log.log(last)
                of = "" if self.total_steps == NO_STEP_LIMIT else f" of {self.total_steps}"
                log.warning("stopping at step %d%s: %s", state.step, of, history.stop_reason)
                break
        bar.close()
        return False, last

    def forward_backward(self, micro_batches: list[Batch], counts: list[int], meter: "Meter") -> torch.Tensor:
        """Forward and backward of every micro-batch; the all-reduce happens only in the last backward.

        Returns this rank's share of each loss group's step loss (detached; summed over ranks they give the
        step's global losses).
        """
        groups = self.task.loss_groups
        world = self.dist.world_size
        keep_gathered = not self.cfg.parallelism.reshard_after_forward  # fsdp: gather once per optimizer step
        # float64: the micro-steps' losses add exactly, as the ranks' do in the float64 all-reduce (Meter.flush), so
        # the logged loss of 1 rank x 2 micro-steps is that of 2 ranks x 1 bit for bit, as the weights are
        shares = torch.zeros(len(groups), dtype=torch.float64, device=self.dist.device)
        for i, mb in enumerate(micro_batches):
            ckpt.seed_micro_batch(self.cfg.seed, self.state.step, i * world + self.dist.rank)
            with no_sync(self.model, enabled=i < len(micro_batches) - 1, keep_gathered=keep_gathered):
                with self.precision.autocast():
                    sums = self.task.forward(self.model, mb)
                terms = torch.stack([sums[f"{g}_loss_sum"].float() / max(c, 1) for g, c in zip(groups, counts)])
                self.precision.backward(terms.sum() * world)
            shares += terms.detach().double()
            meter.add_micro(sums, mb)
        return shares

    def warn_if_short_of_room(self) -> bool:
        """Rank 0, after a save: warn (once a run) when the checkpoints still to come will not fit on the disk, so
        that a run does not learn it hours later from a failed save. Returns whether it warned."""
        interval = self.cfg.checkpoint.save_interval
        left = None if self.total_steps == NO_STEP_LIMIT else \
            self.total_steps // interval - self.state.step // interval
        try:
            warning = ckpt.room_warning(self.out, ckpt.checkpoint_dir(self.out, self.state.step), left,
                                        self.cfg.checkpoint.keep_last)
        except OSError:  # a check, never a reason to stop the run
            return False
        if warning:
            log.warning("%s", warning)
        return warning is not None

    def kept(self) -> str:
        """What a failure now leaves the user: the last complete checkpoint."""
        complete = [p for _, p in ckpt.list_checkpoints(self.out) if (p / ckpt.COMPLETE).exists()]
        return f"{complete[-1]} (the last complete checkpoint) is intact" if complete else \
            "no checkpoint was written before"

    def save(self) -> None:
        """Write checkpoint step-N from the registry of states (`train/states.py`): every rank contributes (its
        RNG state); rank 0 writes the folder, or under fsdp every rank writes its shards; all learn whether it
        worked."""
        step = self.state.step
        train_state = {"version": 2, "task": self.task.name, "world_size": self.dist.world_size,
                       "batch": asdict(self.plan), "bertrain": __version__, "numerics": NUMERICS,
                       **saved_entries(self.states)}
        kept = self.kept()
        doing = f"writing checkpoint step-{step} in {self.out}"
        model, optimizer = self.states["model"], self.states["optimizer"]
        if is_sharded(model):  # weights and optimizer state: each rank its shards (train/dcp.py)
            error: Exception | None = None
            try:
                with writing(doing, kept=kept, where=self.out):
                    save_sharded_checkpoint(self.out, step, model, optimizer, train_state, self.cfg,
                                            self.cfg.checkpoint.keep_last, self.dist)
            except OutputError as e:
                error = e
            # instead of a barrier: a failed save stops every rank
            if not all(gather_objects(error is None)):
                raise error or UserError(f"a rank could not write its part of checkpoint step-{step} (see its log)")
            return

        def write() -> None:
            with writing(doing, kept=kept, where=self.out):
                ckpt.save_checkpoint(self.out, step, model, {**train_state, "optimizer": optimizer.state_dict()},
                                     self.cfg, self.cfg.checkpoint.keep_last)

        # long: the others wait in the store, not in a collective that fails after distributed.timeout_s (a 4 GB
        # checkpoint, checksummed, on a slow filesystem); the heartbeat still watches rank 0 meanwhile, and the
        # watchdog ends the wait if rank 0 stops answering for longer than that. Without a heartbeat nothing would:
        # then the collective and its time limit, as before.
        on_rank0(f"write checkpoint step-{step}", write, long=self.cfg.distributed.heartbeat_timeout_s > 0)


# ----------------------------------------------------------------------------------------------- step pieces

def optimizer_step(model: nn.Module, params: list[nn.Parameter], optimizer: torch.optim.Optimizer,
                   precision: Precision, max_grad_norm: float) -> tuple[torch.Tensor, bool]:
    """Unscale, clip (on the all-reduced gradients) and step; returns (grad norm, stepped)."""
    assert grads_are_synced(model), "clipping must see all-reduced gradients (called inside no_sync)"
    grad_norm = precision.unscale_and_clip(optimizer, params, max_grad_norm)
    stepped = precision.step(optimizer)
    optimizer.zero_grad(set_to_none=True)
    return grad_norm.detach(), stepped


def step_flags(task: Task, micro_batches: list[Batch], accumulation: int, stop: bool,
               dist: DistInfo, elapsed: float = 0.0) -> dict[str, Any]:
    """One all-reduce per step: global target counts per loss group, ranks with a full step, stop requests, and
    the training time (`elapsed`, the ranks' mean: one number every rank agrees on for a time budget)."""
    full = len(micro_batches) == accumulation
    counts = [0] * len(task.loss_groups)
    if full:
        for mb in micro_batches:
            counts = [a + b for a, b in zip(counts, task.target_counts(mb))]
    v = torch.tensor([*counts, int(full), int(stop), elapsed], dtype=torch.float64, device=dist.device)
    if dist.device.type == "cuda" or dist.world_size > 1:
        v = all_reduce_sum(v)
    *values, elapsed_sum = v.tolist()
    *counts, ranks, stops = (int(x) for x in values)
    return {"counts": counts, "ranks_with_data": ranks, "stop": stops > 0, "elapsed": elapsed_sum / dist.world_size}


def take(it: Iterator, n: int) -> list:
    """Up to `n` items of `it` (fewer at the end of the epoch)."""
    out = []
    for _ in range(n):
        try:
            out.append(next(it))
        except StopIteration:
            break
    return out


def trim_padding(batch: Batch) -> Batch:
    """Drop padding columns beyond the longest sequence (padding sits at the end of every row and attention is
    masked there, so results are the same with less compute). Per-row keys (labels, positions) are kept."""
    longest = int(batch["attention_mask"].sum(1).max())
    if longest == batch["input_ids"].shape[1]:
        return batch
    out = dict(batch)
    for k in ("input_ids", "token_type_ids", "attention_mask"):
        out[k] = batch[k][:, :longest]
    return out


def to_device(batch: Batch, device: torch.device) -> Batch:
    """The batch on `device`. On a GPU the copies do not wait (staged in pinned memory: from pageable memory CUDA
    synchronizes the stream first), and the attention mask stays on the host: the model reads the batch's lengths
    from it there (model/unpad.py), where reading a GPU tensor would stall every step."""
    if device.type != "cuda":
        return {k: v.to(device) for k, v in batch.items()}
    return {k: v if k == "attention_mask" else to_device_tensor(v, device) for k, v in batch.items()}


NO_STEP_LIMIT = 2 ** 62
"""total_steps of a run bounded only by train.max_time."""


def resolve_total_steps(train: TrainConfig, per_epoch: int, plan: BatchPlan) -> int:
    """train.steps, or epochs x full steps per epoch, rounded up (NO_STEP_LIMIT: a time budget alone)."""
    if train.steps:
        return train.steps
    if not train.epochs:
        return NO_STEP_LIMIT
    if per_epoch == 0:
        raise ValueError(f"config key 'train.global_batch_size': one epoch has fewer than {plan.global_batch_size} "
                         "samples, so not a single step fits")
    return max(1, math.ceil(train.epochs * per_epoch - 1e-9))


def scaled_lr(cfg: TrainerConfig, plan: BatchPlan) -> float:
    """optim.lr, times global batch / base batch with `optim.scale_lr_with_batch`."""
    if not cfg.optim.scale_lr_with_batch:
        return cfg.optim.lr
    return cfg.optim.lr * plan.global_batch_size / cfg.optim.base_batch_size


# ----------------------------------------------------------------------------------------------- metrics

class Meter:
    """Accumulates per-step numbers on the device; one all-reduce and one host sync per log interval.

    A registry entry (`train/states.py`): a checkpoint between two log lines holds the interval's partial sums, so
    the first record after a resume averages the same steps as a straight run's (its loss, accuracies and grad norm
    the same numbers). The throughput figures (seq/s, tokens/s, data wait) count from the resume: they measure
    this process."""

    def __init__(self, task: Task, dist: DistInfo) -> None:
        self.task, self.dist, self.device = task, dist, dist.device
        self.keys: list[str] | None = None  # the task's sum names, fixed by the first micro-batch
        self.lr: float | None = None
        """The learning rate the interval's last step used (the record's "lr"; the scheduler has moved on since)."""
        self.reset()

    def restart_clock(self) -> None:
        self.tokens, self.seqs, self.data_time = 0, 0, 0.0
        self.t0 = time.perf_counter()

    def state_dict(self) -> list[dict[str, Any]]:
        """Every rank's partial sums (a collective: every rank calls it; each rank's own, as the flush adds them)."""
        return gather_objects({
            "keys": self.keys, "losses": self.losses.tolist(),
            "sums": None if self.sums is None else self.sums.tolist(), "grad_norm": float(self.grad_norm),
            "steps": self.steps, "stepped": self.stepped})

    def load_state_dict(self, states: list[dict[str, Any]]) -> None:
        if len(states) == self.dist.world_size:
            own = states[self.dist.rank]
        else:  # another world size: rank 0 carries the sums of all (the flush adds the ranks' sums anyway)
            own = dict(states[0])
            for key in ("losses", "sums"):
                if own[key] is not None:
                    own[key] = [sum(v) for v in zip(*(s[key] for s in states))] if self.dist.rank == 0 else \
                        [0.0] * len(own[key])
        self.keys = own["keys"]
        self.losses = torch.tensor(own["losses"], dtype=torch.float64, device=self.device)
        self.sums = None if own["sums"] is None else torch.tensor(own["sums"], dtype=torch.float64,
                                                                  device=self.device)
        self.grad_norm = torch.tensor(own["grad_norm"], dtype=torch.float64, device=self.device)
        self.steps, self.stepped = own["steps"], own["stepped"]

    def reset(self) -> None:
        groups = len(self.task.loss_groups)
        self.losses = torch.zeros(groups, dtype=torch.float64, device=self.device)
        self.sums: torch.Tensor | None = None  # allocated at the first micro-batch, once the task's keys are known
        self.tokens, self.seqs = 0, 0  # real tokens and sequences of this rank since the last flush
        self.grad_norm = torch.zeros((), dtype=torch.float64, device=self.device)
        self.steps = 0
        self.stepped = 0
        self.data_time = 0.0
        self.t0 = time.perf_counter()

    def add_micro(self, sums: dict[str, torch.Tensor], batch: Batch) -> None:
        if self.keys is None:
            self.keys = sorted(sums)
        if self.sums is None:
            self.sums = torch.zeros(len(self.keys), dtype=torch.float64, device=self.device)
        self.sums += torch.stack([sums[k].detach().double().reshape(()) for k in self.keys])
        # the mask is on the host (to_device keeps it there): counted without touching the GPU
        self.tokens += int(batch["attention_mask"].sum())
        self.seqs += batch["input_ids"].shape[0]

    def add_step(self, shares: torch.Tensor, grad_norm: torch.Tensor, stepped: bool) -> None:
        self.losses += shares.double()
        self.steps += 1
        if stepped:
            self.stepped += 1
            self.grad_norm += grad_norm.double()

    def flush(self, state: TrainState, optimizer: torch.optim.Optimizer, precision: Precision,
              dist: DistInfo) -> dict[str, Any]:
        assert self.sums is not None and self.keys is not None
        counts = torch.tensor([self.tokens, self.seqs], dtype=torch.float64, device=self.device)
        both = all_reduce_sum(torch.cat([self.losses, self.sums, counts])).tolist()
        groups = self.task.loss_groups
        losses, sums = both[:len(groups)], dict(zip(self.keys, both[len(groups):-2]))
        tokens, seqs = both[-2:]
        wait = torch.tensor([self.data_time], dtype=torch.float64, device=self.device)
        wait = all_reduce_sum(wait).item() / dist.world_size
        elapsed = max(time.perf_counter() - self.t0, 1e-9)
        n = max(self.steps, 1)
        record: dict[str, Any] = {"step": state.step, "epoch": state.epoch, "samples": state.samples,
                                  "loss": sum(losses) / n}
        if len(groups) > 1:
            for g, value in zip(groups, losses):
                record[f"{g}_loss"] = value / n if sums.get(f"{g}_count", 1) else None
        record.update(self.task.metrics(sums))
        record.update({
            "lr": self.lr if self.lr is not None else optimizer.param_groups[0]["lr"],
            "grad_norm": self.grad_norm.item() / self.stepped if self.stepped else float("nan"),
            "loss_scale": precision.loss_scale, "skipped_steps": state.skipped_steps,
            "seq_per_s": seqs / elapsed, "tokens_per_s": tokens / elapsed,
            "data_wait": min(1.0, wait / elapsed), "elapsed_s": elapsed,
        })
        self.reset()
        return record


def _format_record(r: dict[str, Any]) -> str:
    skip = {"step", "epoch", "samples", "elapsed_s", "skipped_steps", "loss_scale", "data_wait"}
    parts = []
    for k, v in r.items():
        if k in skip or v is None:
            continue
        parts.append(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}")
    return " ".join(parts)


def _show_bar(dist: DistInfo) -> bool:
    """tqdm on rank 0 when the output is a terminal."""
    return dist.is_main and sys.stderr.isatty()


def _log_through_bar(enabled: bool) -> contextlib.AbstractContextManager:
    """While a bar is shown, route log lines through tqdm.write so they do not tear the bar."""
    return logging_redirect_tqdm() if enabled else contextlib.nullcontext()
