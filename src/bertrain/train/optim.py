"""Optimizers for BERT: LAMB (and NVIDIA's NVLAMB), BERT's AdamW (with or without bias correction), RAdam.

* `Lamb` (You et al., 2019, "Large Batch Optimization for Deep Learning"), written with multi-tensor `foreach`
  ops: Adam moments, an update `m̂/(sqrt(v̂)+eps) + wd·w`, then a per-tensor trust ratio ||w|| / ||update||
  clamped to [min_trust_ratio, max_trust_ratio] (DeepSpeed's min/max coefficients; 1 where either norm is 0).
  `nvlamb=True` is LAMB as NVIDIA's BERT (DeepLearningExamples) runs it, apex `FusedLAMB` with its defaults:
  (1) the gradients' "pre-normalisation" is apex's: they are divided by ||g|| / max_grad_norm only when the global
  norm ||g|| exceeds max_grad_norm (a global-norm clip applied before the moments; the NVLAMB blog's algorithm
  writes g / ||g||, but apex never scales gradients up); (2) parameters without weight decay (biases, LayerNorm)
  take a plain Adam step, trust ratio 1 (apex `use_nvlamb=False`, which DLE's BERT uses). Behind bertrain's
  trainer, which already clips to optim.max_grad_norm, (1) changes nothing; (2) is what sets nvlamb apart.
* `BertAdamW`: google-research/bert's AdamWeightDecayOptimizer (no bias correction); with bias correction we use
  `torch.optim.AdamW` itself. `torch.optim.RAdam` for radam.
* `build_optimizer` puts biases and LayerNorm parameters in a group without weight decay.

Under FSDP2 (`parallelism.strategy: fsdp`) parameters, gradients and moments are `DTensor`s sharded on dim 0.
LAMB and BertAdamW then work on the local shards (the maths is elementwise), except for the norms: a trust ratio
needs ||w|| and ||update|| of the *full* tensor and NVLAMB the global gradient norm, so each rank sums the squares
of its shards and one all-reduce per parameter group adds them up (never a gather of the full tensors).
`torch.optim.AdamW`/`RAdam` handle DTensors themselves.
"""
from __future__ import annotations

from typing import Any, Iterable

import torch
import torch.distributed as torch_dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from bertrain.train.config import OptimConfig


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Two groups: decayed weights, and biases + LayerNorm parameters without weight decay (as BERT does)."""
    decay, no_decay, seen = [], [], set()
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if not p.requires_grad or id(p) in seen:  # tied weights (decoder = word embeddings) appear twice
                continue
            seen.add(id(p))
            if isinstance(module, nn.LayerNorm) or name == "bias" or "layernorm" in type(module).__name__.lower():
                no_decay.append(p)
            else:
                decay.append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (the same storage: in-place updates reach the parameter), else `t`."""
    return t.to_local() if isinstance(t, DTensor) else t


def shard_group(params: list[torch.Tensor]) -> Any:
    """The process group over which `params` are sharded (FSDP2 DTensors), or None for ordinary tensors. Under
    HSDP (placements Replicate, Shard) only the shard dimension's group: the replicas hold the same shards."""
    if not params or not isinstance(params[0], DTensor):
        return None
    placements = params[0].placements
    dims = [i for i, pl in enumerate(placements) if isinstance(pl, Shard)]
    assert len(dims) == 1, f"sharded norms assume one sharded mesh dimension, got {placements}"
    return params[0].device_mesh.get_group(mesh_dim=dims[0])


def full_norms(tensors: list[torch.Tensor], group: Any) -> torch.Tensor:
    """L2 norm of each full tensor, from the local shards: sqrt(all-reduced sum of local squares) when `group`."""
    norms = torch.stack(torch._foreach_norm([_local(t) for t in tensors]))
    if group is None:
        return norms
    squares = norms.square()
    torch_dist.all_reduce(squares, group=group)
    return squares.sqrt()


class Lamb(torch.optim.Optimizer):
    """LAMB (You et al., 2019) with DeepSpeed's trust-ratio clamps; `nvlamb`: NVIDIA's (apex FusedLAMB) gradient
    clip to `max_grad_norm` and no trust ratio for parameters without weight decay (module docstring).

    `foreach`: multi-tensor ops (a few dozen kernel launches per step instead of ~12 per tensor: for CUDA) or one
    tensor at a time (on CPU 2.6x faster on an idle machine: torch's foreach ops on CPU are plain loops that materialise every
    intermediate list, while per-tensor temporaries stay cache-sized; BENCHMARKS.md). None: multi-tensor on CUDA.
    Both compute the same maths in the same order (tested equal)."""

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-6, weight_decay: float = 0.01, bias_correction: bool = True,
                 min_trust_ratio: float = 0.01, max_trust_ratio: float = 10.0, nvlamb: bool = False,
                 max_grad_norm: float = 1.0, foreach: bool | None = None) -> None:
        if lr <= 0 or eps <= 0 or weight_decay < 0 or max_grad_norm < 0 or not all(0 <= b < 1 for b in betas):
            raise ValueError(f"invalid LAMB hyper-parameters lr={lr} eps={eps} wd={weight_decay} betas={betas} "
                             f"max_grad_norm={max_grad_norm}")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, bias_correction=bias_correction,
                        min_trust_ratio=min_trust_ratio, max_trust_ratio=max_trust_ratio)
        super().__init__(params, defaults)
        self.nvlamb = nvlamb
        self.max_grad_norm = max_grad_norm  # nvlamb's pre-normalisation threshold; 0: none (apex would zero g)
        self.foreach = foreach

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad_scale = None
        if self.nvlamb and self.max_grad_norm > 0:
            grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
            if grads:
                global_norm = torch.linalg.vector_norm(full_norms(grads, shard_group(grads)))
                # apex multi_tensor_lamb.cu: g / (||g|| / max) where ||g|| > max, else g unchanged (never scaled up);
                # computed before any moment update
                grad_scale = torch.where(global_norm > self.max_grad_norm, self.max_grad_norm / global_norm,
                                         torch.ones_like(global_norm))
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            if any(p.grad.is_sparse for p in params):
                raise RuntimeError("Lamb does not support sparse gradients")
            states = [self.state[p] for p in params]
            for p, st in zip(params, states):
                if not st:
                    # on the host, as torch's own optimizers keep it: the bias corrections read it as a Python
                    # float, which on a GPU tensor would stall the step on a device-to-host copy
                    st["step"] = torch.zeros((), dtype=torch.float32)
                    st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            foreach = self.foreach if self.foreach is not None else params[0].is_cuda
            (self._group_foreach if foreach else self._group_per_tensor)(group, params, states, grad_scale,
                                                                         shard_group(params))
        return loss

    @staticmethod
    def _bias_corrections(group: dict, step: float) -> tuple[float, float]:
        beta1, beta2 = group["betas"]
        if not group["bias_correction"]:
            return 1.0, 1.0
        return 1 - beta1 ** step, 1 - beta2 ** step

    @staticmethod
    def _trust_ratio(group: dict, w_norm: torch.Tensor, u_norm: torch.Tensor) -> torch.Tensor:
        """||w|| / ||update|| clamped as DeepSpeed does, 1 where either norm is 0 (elementwise over tensors). The
        fallback is not clamped (DeepSpeed's `lamb_coeff = 1.0` outside its `if`): with max_trust_ratio < 1 a
        zero-initialised bias would otherwise take its first step scaled by the clamp."""
        ratio = (w_norm / u_norm.clamp_min(1e-30)).clamp(group["min_trust_ratio"], group["max_trust_ratio"])
        return torch.where((w_norm > 0) & (u_norm > 0), ratio, torch.ones_like(w_norm))

    def _adaptive(self, group: dict) -> bool:
        """Whether the group's steps are scaled by trust ratios: always for LAMB (the paper, DeepSpeed), only with
        weight decay for NVLAMB (apex FusedLAMB's stage 2: `if (use_nvlamb || decay != 0)`, use_nvlamb off in DLE)."""
        return not (self.nvlamb and group["weight_decay"] == 0)

    def _group_foreach(self, group: dict, params: list, states: list, grad_scale: torch.Tensor | None,
                       shards: Any) -> None:
        grads = [_local(p.grad) for p in params]
        params = [_local(p) for p in params]
        if grad_scale is not None:
            grads = torch._foreach_mul(grads, grad_scale)
        steps = [st["step"] for st in states]
        exp_avg = [_local(st["exp_avg"]) for st in states]
        exp_avg_sq = [_local(st["exp_avg_sq"]) for st in states]
        beta1, beta2 = group["betas"]
        torch._foreach_add_(steps, 1.0)
        # m = b1 m + (1 - b1) g ;  v = b2 v + (1 - b2) g^2
        torch._foreach_lerp_(exp_avg, grads, 1 - beta1)
        torch._foreach_mul_(exp_avg_sq, beta2)
        torch._foreach_addcmul_(exp_avg_sq, grads, grads, value=1 - beta2)
        bc1, bc2 = self._bias_corrections(group, float(steps[0]))  # every tensor of a group took the same steps
        # update = (m / bc1) / (sqrt(v / bc2) + eps) + wd * w
        denom = torch._foreach_div(exp_avg_sq, bc2)
        torch._foreach_sqrt_(denom)
        torch._foreach_add_(denom, group["eps"])
        update = torch._foreach_div(exp_avg, denom)
        if bc1 != 1.0:
            torch._foreach_div_(update, bc1)
        if group["weight_decay"] != 0:
            torch._foreach_add_(update, params, alpha=group["weight_decay"])
        if not self._adaptive(group):
            torch._foreach_add_(params, update, alpha=-group["lr"])
            return
        ratio = self._trust_ratio(group, full_norms(params, shards), full_norms(update, shards))
        torch._foreach_mul_(update, list(torch.unbind(ratio * -group["lr"])))
        torch._foreach_add_(params, update)

    def _group_per_tensor(self, group: dict, params: list, states: list, grad_scale: torch.Tensor | None,
                          shards: Any) -> None:
        beta1, beta2 = group["betas"]
        adaptive = self._adaptive(group)
        bc1 = bc2 = None
        sharded: list[tuple[torch.Tensor, torch.Tensor]] = []  # (shard, its update): ratios need full norms first
        for p, st in zip(params, states):
            g = _local(p.grad) if grad_scale is None else _local(p.grad) * grad_scale
            p = _local(p)
            m, v = _local(st["exp_avg"]), _local(st["exp_avg_sq"])
            st["step"].add_(1.0)
            if bc1 is None:
                bc1, bc2 = self._bias_corrections(group, float(st["step"]))
            m.lerp_(g, 1 - beta1)
            v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
            update = torch.div(v, bc2).sqrt_().add_(group["eps"])  # the denominator, then (in place) the update
            torch.div(m, update, out=update)
            if bc1 != 1.0:
                update.div_(bc1)
            if group["weight_decay"] != 0:
                update.add_(p, alpha=group["weight_decay"])
            if not adaptive:
                p.add_(update, alpha=-group["lr"])
                continue
            if shards is not None:
                sharded.append((p, update))
                continue
            ratio = self._trust_ratio(group, torch.linalg.vector_norm(p), torch.linalg.vector_norm(update))
            p.add_(update.mul_(ratio * -group["lr"]))
        if sharded:  # one all-reduce for the group's norms, then the updates
            shard_list, updates = [p for p, _ in sharded], [u for _, u in sharded]
            ratios = self._trust_ratio(group, full_norms(shard_list, shards), full_norms(updates, shards))
            for p, update, ratio in zip(shard_list, updates, ratios.unbind()):
                p.add_(update.mul_(ratio * -group["lr"]))


class BertAdamW(torch.optim.Optimizer):
    """google-research/bert's AdamWeightDecayOptimizer: Adam without bias correction, decoupled weight decay.

    w <- w - lr * (m / (sqrt(v) + eps) + wd * w). Multi-tensor ops throughout.
    """

    def __init__(self, params: Iterable, lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-6, weight_decay: float = 0.01) -> None:
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            grads = [_local(p.grad) for p in params]
            for p in params:
                st = self.state[p]
                if not st:
                    st["exp_avg"] = torch.zeros_like(p)
                    st["exp_avg_sq"] = torch.zeros_like(p)
                # unused by the maths (no bias correction), but kept as torch's Adam keeps it (a host tensor): a run
                # continued with bias correction on (torch.optim.AdamW, --allow-config-change) or started from these
                # moments (optim.init_state) needs it, as torch's AdamW fails on a state without it (KeyError)
                if "step" not in st:
                    st["step"] = torch.zeros((), dtype=torch.float32)
            torch._foreach_add_([self.state[p]["step"] for p in params], 1.0)  # one call, not one op per tensor
            m = [_local(self.state[p]["exp_avg"]) for p in params]
            v = [_local(self.state[p]["exp_avg_sq"]) for p in params]
            params = [_local(p) for p in params]
            beta1, beta2 = group["betas"]
            torch._foreach_lerp_(m, grads, 1 - beta1)
            torch._foreach_mul_(v, beta2)
            torch._foreach_addcmul_(v, grads, grads, value=1 - beta2)
            denom = torch._foreach_sqrt(v)
            torch._foreach_add_(denom, group["eps"])
            update = torch._foreach_div(m, denom)
            if group["weight_decay"] != 0:
                torch._foreach_add_(update, params, alpha=group["weight_decay"])
            torch._foreach_add_(params, update, alpha=-group["lr"])
        return loss


def build_optimizer(model: nn.Module, cfg: OptimConfig, lr: float | None = None) -> torch.optim.Optimizer:
    """The optimizer named by `cfg.name`, over `param_groups(model)`; `lr` overrides cfg.lr (LR scaling)."""
    lr = cfg.lr if lr is None else lr
    groups = param_groups(model, cfg.weight_decay)
    if cfg.name in ("lamb", "nvlamb"):
        return Lamb(groups, lr=lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay,
                    bias_correction=cfg.bias_correction, min_trust_ratio=cfg.min_trust_ratio,
                    max_trust_ratio=cfg.max_trust_ratio, nvlamb=cfg.name == "nvlamb",
                    max_grad_norm=cfg.max_grad_norm)
    # torch's fused AdamW kernel (CUDA and CPU): on CPU its BERT-base optimizer step took 64 ms vs 226 ms foreach
    # on an idle machine (BENCHMARKS.md, "Techniques"); foreach for devices without a fused kernel.
    fused_ok = all(p.device.type in ("cuda", "cpu") for g in groups for p in g["params"])
    if cfg.name == "adamw":
        if cfg.bias_correction:
            return torch.optim.AdamW(groups, lr=lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay,
                                     **({"fused": True} if fused_ok else {"foreach": True}))
        return BertAdamW(groups, lr=lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)
    if cfg.name == "radam":
        return torch.optim.RAdam(groups, lr=lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay,
                                 decoupled_weight_decay=True, foreach=True)
    raise ValueError(f"config key 'optim.name': unknown optimizer {cfg.name!r}")
