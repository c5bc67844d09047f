"""Learning-rate schedules as `LambdaLR` multipliers of the peak LR, indexed by optimizer steps taken.

Warmup rises linearly to the peak over `warmup` steps (the first step already uses 1/warmup of the peak, not 0);
then, with p = progress through the remaining steps in [0, 1]:

* linear:   end + (1 - end) (1 - p)                     (BERT paper; end = schedule.min_lr_ratio)
* cosine:   end + (1 - end) (1 + cos(pi p)) / 2
* poly:     NVIDIA's PolyWarmUpScheduler (DeepLearningExamples BERT, power 0.5), whose progress is over ALL steps,
            warmup included: with t = step + 1 (the count DLE's scheduler sees before the step), t / warmup while
            t < warmup, then end + (1 - end) (1 - t / total)^power. So the LR drops at the end of warmup (to
            sqrt(1 - 0.2843) = 0.85 of the peak in the phase-1 recipe) and the last step's LR is `end`.
* constant: 1
* warmup_exp_decay_exp (DeepSpeed bing_bert): (t / warmup)^warmup_power during warmup, then
  decay_rate^((t - warmup) / decay_steps).

A skipped step (fp16 overflow) does not call `scheduler.step()`, so the schedule does not advance.
"""
from __future__ import annotations

import math

import torch
from torch.optim.lr_scheduler import LambdaLR

from bertrain.train.config import ScheduleConfig


class LRMultiplier:
    """Picklable multiplier f(step) -> LR / peak LR (a class, not a closure, so scheduler state saves cleanly)."""

    def __init__(self, cfg: ScheduleConfig, total_steps: int) -> None:
        if total_steps <= 0:
            raise ValueError(f"the schedule needs a positive number of steps, got {total_steps}")
        self.name = cfg.name
        self.total = total_steps
        self.warmup = min(cfg.warmup_steps(total_steps), total_steps)
        self.power = cfg.power
        self.end = cfg.min_lr_ratio
        self.decay_rate = cfg.decay_rate
        self.decay_steps = cfg.decay_steps
        self.warmup_power = cfg.warmup_power

    def __call__(self, step: int) -> float:
        if self.name == "poly":
            # NVIDIA's (1 - t/total)^power, not HF's (1 - p)^power over the steps after warmup: the recipes that
            # name it are NVIDIA's; the two differ by up to 0.15 of the peak LR there (test_optim_reference_schedules)
            t = step + 1
            if t < self.warmup:
                return t / self.warmup
            return self.end + (1.0 - self.end) * max(0.0, 1.0 - t / self.total) ** self.power
        if self.name == "warmup_exp_decay_exp":
            if step < self.warmup:
                return ((step + 1) / self.warmup) ** self.warmup_power
            return self.decay_rate ** ((step - self.warmup) / self.decay_steps)
        if step < self.warmup:
            return (step + 1) / self.warmup
        if self.name == "constant":
            return 1.0
        p = min(1.0, (step - self.warmup) / max(1, self.total - self.warmup))
        if self.name == "linear":
            shape = 1.0 - p
        elif self.name == "cosine":
            shape = 0.5 * (1.0 + math.cos(math.pi * p))
        else:
            raise ValueError(f"config key 'schedule.name': unknown schedule {self.name!r}")
        return self.end + (1.0 - self.end) * shape


ON_TIME_STEPS = 100_000
"""`schedule.on_time`: the budget as this many virtual steps (the LR changes in steps of 1e-5 of the budget)."""


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: ScheduleConfig, total_steps: int) -> LambdaLR:
    """A LambdaLR following `cfg` over `total_steps` optimizer steps (over the time budget with `cfg.on_time`)."""
    if cfg.on_time:
        if cfg.warmup >= 1:
            raise ValueError(f"config key 'schedule.warmup' ({cfg.warmup:g}) must be a fraction (< 1) of the time "
                             "budget with schedule.on_time")
        total_steps = ON_TIME_STEPS
    return LambdaLR(optimizer, LRMultiplier(cfg, total_steps))


def advance(scheduler: LambdaLR, cfg: ScheduleConfig, budget_fraction: float) -> None:
    """One optimizer step taken: the next step's LR, by the step count or, with `cfg.on_time`, by the fraction of
    the time budget spent (the same value on every rank: the trainer averages the ranks' clocks)."""
    if cfg.on_time:
        scheduler.last_epoch = min(ON_TIME_STEPS, int(budget_fraction * ON_TIME_STEPS)) - 1
    scheduler.step()
