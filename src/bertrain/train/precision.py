"""Numeric precision: fp32, TF32, bf16 autocast, fp16 autocast with dynamic loss scaling.

fp16 uses `torch.amp.GradScaler`, whose semantics are the ones we want: `unscale_` records whether any gradient
is inf/NaN, `step` then skips `optimizer.step()` (weights and optimizer state untouched) and `update` halves the
scale. A skipped step is reported by `Precision.step` returning False, so the caller does not advance the LR
schedule. A scale that keeps collapsing (below `min_loss_scale` for `max_consecutive_skips` overflowing steps in a
row) means the run has diverged; we stop with an error instead of training on NaNs.

fp32, TF32 and bf16 have no scaler: nothing skips a step whose gradients are inf/NaN, and the weights after it are
lost (NaN from then on). `watch` records the first such step on the device (no host sync in the step: the GPU issue
pins a sync-free step), and `check_finite`, called where the run reads the device anyway before it writes anything
from those weights (a log line, an evaluation, a checkpoint, the end), stops it with `Diverged`: no NaN checkpoint
replaces a good one (keep_last), no NaN model is exported, and the error names the step and the last checkpoint.
The gradient norm is that of the all-reduced gradients, so every rank stops at the same check.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable, Iterable

import torch
from torch.distributed.tensor import DTensor

from bertrain.train.config import PrecisionConfig
from bertrain.utils.errors import UserError

log = logging.getLogger(__name__)


class Diverged(UserError):
    """Training went to inf/NaN: settings to change (lr, warmup, precision), not a bug, so one line and exit 2."""


class LossScaleCollapse(Diverged):
    """fp16 training has overflowed repeatedly at a tiny loss scale."""


class Precision:
    """Autocast, backward, unscale+clip and (possibly skipped) optimizer step for one precision mode."""

    def __init__(self, cfg: PrecisionConfig, device: torch.device) -> None:
        self.cfg = cfg
        self.device = torch.device(device)
        self.dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.mode)
        if self.device.type == "cuda":
            # TF32 matmuls/convolutions on Ampere and newer. Process-wide flags, so only set where they mean
            # something (on CPU tf32 is plain fp32), and set by every mode: a run after a tf32 one in the same
            # process (a pipeline's stages, a search's trials) would otherwise keep TF32 matmuls under fp32.
            tf32 = cfg.mode == "tf32"
            torch.backends.cuda.matmul.allow_tf32 = tf32
            if tf32:
                torch.backends.cudnn.allow_tf32 = True  # torch's default already; BERT has no convolutions
            torch.set_float32_matmul_precision("high" if tf32 else "highest")
        self.scaler = torch.amp.GradScaler(self.device.type, init_scale=cfg.initial_loss_scale,
                                           growth_interval=cfg.growth_interval, enabled=cfg.mode == "fp16")
        self.consecutive_skips = 0
        self.skipped_steps = 0
        self.first_nonfinite: torch.Tensor | None = None  # the first step with an inf/NaN gradient norm; -1: none

    @property
    def loss_scale(self) -> float:
        return float(self.scaler.get_scale()) if self.scaler.is_enabled() else 1.0

    def autocast(self) -> contextlib.AbstractContextManager:
        """The forward-pass context: autocast to bf16/fp16, or nothing for fp32/tf32."""
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.dtype)

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of the (scaled, for fp16) loss."""
        self.scaler.scale(loss).backward()

    def unscale_and_clip(self, optimizer: torch.optim.Optimizer, params: Iterable[torch.nn.Parameter],
                         max_norm: float) -> torch.Tensor:
        """Unscale the gradients (fp16) and clip them to `max_norm` (0: measure only); returns the global norm.

        Call once per optimizer step, after the last micro-step's backward, i.e. on the all-reduced gradients.
        Under FSDP2 the gradients are DTensor shards: torch's norm reduces the shards' norms over the ranks
        (the global norm, as DDP's) and GradScaler's inf/NaN check is reduced over the ranks by DTensor (`max`
        of the per-shard flags), so every rank skips the same steps.
        """
        self.scaler.unscale_(optimizer)
        params = [p for p in params if p.grad is not None]
        if max_norm > 0:
            norm = torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
        else:
            norm = torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True) if params else torch.zeros(())
        return norm.full_tensor() if isinstance(norm, DTensor) else norm  # replicated: no communication

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Optimizer step; False when fp16 found inf/NaN gradients and skipped it (the schedule must not advance)."""
        if not self.scaler.is_enabled():
            optimizer.step()
            return True
        before = self.scaler.get_scale()
        self.scaler.step(optimizer)
        # the inf/NaN flags GradScaler skipped (or, for a fused optimizer, made skip) optimizer.step() on, read
        # before update() clears them. Not "the scale went down": a scale of 0 (min_loss_scale 0) or inf halves to
        # itself, and those skipped steps were counted as taken (the schedule advanced, the run "finished").
        found_inf = self.scaler._found_inf_per_device(optimizer)
        stepped = not any(bool(flag.item()) for flag in found_inf.values())
        self.scaler.update()
        after = self.scaler.get_scale()
        if stepped:
            self.consecutive_skips = 0
            return True
        self.consecutive_skips += 1
        self.skipped_steps += 1
        log.warning("fp16 overflow: step skipped, loss scale %g -> %g", before, after)
        if after < self.cfg.min_loss_scale and self.consecutive_skips >= self.cfg.max_consecutive_skips:
            raise LossScaleCollapse(
                f"fp16 loss scale collapsed to {after:g} (< precision.min_loss_scale={self.cfg.min_loss_scale:g}) "
                f"after {self.consecutive_skips} consecutive overflowing steps: the gradients are inf/NaN even "
                "unscaled, so the run has diverged. Resume from an earlier checkpoint with a lower optim.lr or a "
                "longer schedule.warmup, or use precision.mode=bf16 (no loss scaling needed) or fp32.")
        return False

    def watch(self, grad_norm: torch.Tensor, step: int) -> None:
        """Record `step` if its gradient norm is inf/NaN and none was before (device ops only: no host sync). fp16
        needs none of it: its scaler skipped such a step and left the weights as they were."""
        if self.scaler.is_enabled():
            return
        if self.first_nonfinite is None:
            self.first_nonfinite = torch.full((), -1, dtype=torch.int64, device=grad_norm.device)
        first = self.first_nonfinite
        self.first_nonfinite = torch.where(~torch.isfinite(grad_norm) & (first < 0), step, first)

    def check_finite(self, step: int, kept: Callable[[], str]) -> None:
        """Raise `Diverged` if a watched step had an inf/NaN gradient norm (one host read of one number); `kept()`
        says what the user still has (the last checkpoint)."""
        first = -1 if self.first_nonfinite is None else int(self.first_nonfinite)
        if first < 0:
            return
        what = kept()
        # a checkpoint to continue from, or none (Trainer.kept: "... is intact" / "no checkpoint was written before")
        again = "Continue from it with --resume auto --allow-config-change" if "intact" in what else \
            "Start again with --overwrite"
        raise Diverged(
            f"training diverged: the gradient norm was inf/NaN at step {first} ({self.cfg.mode} has no loss scaling "
            f"to skip such a step), so the weights of steps {first}-{step} are not usable and nothing of them was "
            f"written; {what}. {again} and a lower optim.lr, a longer schedule.warmup or a smaller "
            "optim.max_grad_norm (the same settings diverge the same way), or look at the data of that step")

    def state_dict(self) -> dict[str, Any]:
        return {"scaler": self.scaler.state_dict(), "consecutive_skips": self.consecutive_skips,
                "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("scaler") and self.scaler.is_enabled():
            self.scaler.load_state_dict(state["scaler"])
            # GradScaler's state carries its growth_interval: the config's wins (equal on an exact resume; a value
            # changed with --allow-config-change is applied, as the log says, instead of silently dropped)
            self.scaler.set_growth_interval(self.cfg.growth_interval)
        self.consecutive_skips = int(state.get("consecutive_skips", 0))
        self.skipped_steps = int(state.get("skipped_steps", 0))

