"""Schedules and the torch-backed optimizers against the systems bertrain replaces, re-written here in plain Python:
NVIDIA DeepLearningExamples' PolyWarmUpScheduler, HF transformers' linear/cosine schedules, DeepSpeed bing_bert's
warmup_exp_decay_exp, torch AdamW/RAdam as build_optimizer configures them. (LAMB/NVLAMB/BertAdamW step references:
tests/test_train_optim.py.)"""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from bertrain.train.config import OptimConfig, ScheduleConfig
from bertrain.train.optim import build_optimizer
from bertrain.train.schedules import LRMultiplier, build_scheduler


def dle_poly_lrs(base_lr: float, warmup: float, total: int, degree: float) -> list[float]:
    """The LR of each optimizer step under DLE's PolyWarmUpScheduler as run_pretraining.py drives it:
    `lr_scheduler.step()` runs before `optimizer.step()` and sets last_epoch = param_group['step'] + 1, where apex
    FusedLAMB counts param_group['step'] (absent before the first step: last_epoch 1)."""
    lrs = []
    for steps_taken in range(total):
        progress = (steps_taken + 1) / total
        lrs.append(base_lr * progress / warmup if progress < warmup else base_lr * (1.0 - progress) ** degree)
    return lrs


@pytest.mark.parametrize("total,warmup", [(7038, 2001 / 7038), (1563, 200 / 1563), (50, 0.2), (40, 0.0)])
def test_poly_schedule_is_nvidias_poly_warmup_scheduler(total: int, warmup: float) -> None:
    """Driven through LambdaLR as the trainer drives it. (7038, 2001) is the phase-1 recipe with the warmup it
    rounds 0.2843 to (2000.9 steps in DLE: bertrain's warmup is a whole number of steps, a <5e-5 difference); the
    old (1 - p)^power over the steps after warmup (HF's polynomial decay) was up to 0.154 of the peak LR off here."""
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=6e-3)
    sched = build_scheduler(opt, ScheduleConfig(name="poly", warmup=warmup, power=0.5), total)
    ours = []
    for _ in range(total):
        ours.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    ref = dle_poly_lrs(6e-3, warmup, total, 0.5)
    assert max(abs(a - b) for a, b in zip(ours, ref)) <= 1e-12 * 6e-3
    assert ours[-1] == 0.0  # as in DLE, the last step's progress is 1


def hf_lambda(name: str, step: int, warmup: int, total: int, min_lr_rate: float = 0.0) -> float:
    """transformers.optimization's _get_{linear,cosine}_schedule_with_warmup_lr_lambda (num_cycles 0.5)."""
    if step < warmup:
        return step / max(1, warmup)
    progress = (step - warmup) / max(1, total - warmup)
    if name == "linear":
        return max(0.0, (total - step) / max(1, total - warmup))
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)) * (1 - min_lr_rate) + min_lr_rate)


@pytest.mark.parametrize("name,min_ratio", [("linear", 0.0), ("cosine", 0.0), ("cosine", 0.1)])
def test_linear_and_cosine_match_hf_after_warmup_and_lead_by_one_step_in_it(name: str, min_ratio: float) -> None:
    """Equal to HF from the end of warmup on; during warmup bertrain's step s is HF's s + 1 (documented: the first
    step already uses 1/warmup of the peak, HF's uses 0)."""
    total, warmup = 100, 10
    f = LRMultiplier(ScheduleConfig(name=name, warmup=warmup, min_lr_ratio=min_ratio), total)
    for step in range(total + 1):
        expected = hf_lambda(name, step + 1 if step < warmup else step, warmup, total, min_ratio)
        assert f(step) == pytest.approx(expected, rel=1e-12, abs=1e-15), step
    transformers = pytest.importorskip("transformers")  # the installed library itself, where present
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    hf = (transformers.get_linear_schedule_with_warmup(opt, warmup, total) if name == "linear" else
          transformers.get_cosine_with_min_lr_schedule_with_warmup(opt, warmup, total, min_lr_rate=min_ratio))
    for step in range(warmup, total + 1):
        assert f(step) == pytest.approx(hf.lr_lambdas[0](step), rel=1e-12, abs=1e-15), step


def test_warmup_exp_decay_exp_matches_bing_bert() -> None:
    """DeepSpeedExamples bing_bert `warmup_exp_decay_exp(global_step, ...)`, called with the steps taken before
    this one: equal from the end of warmup on, bertrain's warmup one step ahead (as for every schedule)."""
    total, frac, rate, every, degree = 200, 0.1, 0.9, 30, 2.0

    def bing(global_step: int) -> float:
        x = global_step / total
        return (x / frac) ** degree if x < frac else rate ** ((global_step - frac * total) / every)
    f = LRMultiplier(ScheduleConfig(name="warmup_exp_decay_exp", warmup=frac, decay_rate=rate, decay_steps=every,
                                    warmup_power=degree), total)
    for step in range(total):
        assert f(step) == pytest.approx(bing(step + 1 if step < f.warmup else step), rel=1e-12), step


def _params() -> list[nn.Parameter]:
    torch.manual_seed(0)
    return [nn.Parameter(torch.randn(6, 5)), nn.Parameter(torch.randn(5))]


@pytest.mark.parametrize("name", ["adamw", "radam"])
def test_adamw_and_radam_take_decoupled_decay_steps(name: str) -> None:
    """build_optimizer's AdamW (bias correction on) and RAdam against the algorithms written out: weight decay
    decoupled and multiplied by lr (w <- w (1 - lr wd)), biases/LayerNorm excluded by the groups; RAdam rectified
    (plain momentum SGD while rho_t <= 5)."""
    model = nn.Sequential(nn.Linear(5, 6), nn.LayerNorm(6))
    ref = [p.detach().clone().double() for p in model.parameters()]
    wd_of = [0.1, 0.0, 0.0, 0.0]  # Linear.weight decays; Linear.bias, LayerNorm weight/bias do not
    lr, (b1, b2), eps = 0.01, (0.9, 0.999), 1e-6
    opt = build_optimizer(model, OptimConfig(name=name, lr=lr, betas=(b1, b2), eps=eps, weight_decay=0.1))
    m = [torch.zeros_like(r) for r in ref]
    v = [torch.zeros_like(r) for r in ref]
    rho_inf = 2 / (1 - b2) - 1
    g = torch.Generator().manual_seed(1)
    for t in range(1, 9):
        for p, r, i in zip(model.parameters(), ref, range(4)):
            grad = torch.randn(p.shape, generator=g, dtype=torch.float64)
            p.grad = grad.float()
            r.mul_(1 - lr * wd_of[i])
            m[i] = b1 * m[i] + (1 - b1) * grad
            v[i] = b2 * v[i] + (1 - b2) * grad * grad
            m_hat = m[i] / (1 - b1 ** t)
            if name == "adamw":
                r -= lr * m_hat / ((v[i] / (1 - b2 ** t)).sqrt() + eps)
                continue
            rho_t = rho_inf - 2 * t * b2 ** t / (1 - b2 ** t)
            if rho_t > 5:
                rect = math.sqrt((rho_t - 4) * (rho_t - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho_t))
                r -= lr * m_hat * rect / ((v[i] / (1 - b2 ** t)).sqrt() + eps)
            else:
                r -= lr * m_hat
        opt.step()
        for p, r in zip(model.parameters(), ref):
            torch.testing.assert_close(p.detach().double(), r, rtol=1e-6, atol=1e-7)
