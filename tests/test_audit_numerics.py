"""Audit of the training numerics (optimizers, schedules, precision) against what the references do: each test
failed before its fix."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from bertrain.train.config import OptimConfig, PrecisionConfig
from bertrain.train.optim import build_optimizer
from bertrain.train.precision import Precision

CPU = torch.device("cpu")


def _fp16_step(model: nn.Module, opt: torch.optim.Optimizer, prec: Precision, inject_inf: bool) -> bool:
    with prec.autocast():
        loss = model(torch.randn(8, 4)).float().pow(2).mean()
    prec.backward(loss)
    if inject_inf:
        model[0].weight.grad[0, 0] = float("nan")
    prec.unscale_and_clip(opt, model.parameters(), 1.0)
    stepped = prec.step(opt)
    opt.zero_grad(set_to_none=True)
    return stepped


def test_a_skipped_fp16_step_is_reported_whatever_the_loss_scale() -> None:
    """Precision.step inferred a skip from the loss scale going down; once the scale stopped going down (0 after
    ~150 halvings with precision.min_loss_scale 0, or an infinite one) GradScaler still skipped every step but
    bertrain reported them taken: the schedule advanced, skipped_steps stayed 0, the run "finished" untrained.
    The skip is now read from GradScaler's own inf/NaN flags."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    opt = build_optimizer(model, OptimConfig(name="adamw", lr=1e-3))
    prec = Precision(PrecisionConfig(mode="fp16", initial_loss_scale=1.0, min_loss_scale=0.0), CPU)
    weights = [p.detach().clone() for p in model.parameters()]
    results = [_fp16_step(model, opt, prec, inject_inf=True) for _ in range(160)]
    assert prec.loss_scale == 0.0  # 1 halved 160 times in float32: 0 from the 150th on
    assert not any(results) and prec.skipped_steps == 160 and prec.consecutive_skips == 160
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights))


@pytest.mark.parametrize("value", [float("inf"), 1e39])
def test_a_loss_scale_float32_cannot_hold_is_refused_by_the_config(value: float) -> None:
    """precision.initial_loss_scale inf passed the config and GradScaler then skipped every step (inf x loss is
    inf); 1e39 failed at the first backward pass with a traceback ("value cannot be converted to type float
    without overflow"). Refused now, naming the key; the largest float32 still runs."""
    from bertrain.train.config import PrecisionConfig as Config
    with pytest.raises(ValueError, match=r"config key 'precision.initial_loss_scale' must be .*float32.*got"):
        Config(mode="fp16", initial_loss_scale=value)
    assert Config(mode="fp16", initial_loss_scale=2.0 ** 127).initial_loss_scale == 2.0 ** 127


@pytest.mark.parametrize("value", [float("inf"), 2.5])
def test_a_warmup_that_is_no_step_count_is_refused_by_the_config(value: float) -> None:
    """schedule.warmup inf crashed with OverflowError (a traceback, "unexpected error") once the model was built;
    2.5 silently warmed up for 2 steps. A warmup of 1 or more is a number of steps: a whole one now."""
    from bertrain.train.config import ScheduleConfig
    with pytest.raises(ValueError, match=r"config key 'schedule.warmup' .*whole number of steps"):
        ScheduleConfig(warmup=value)
    for ok in (0, 0.25, 1, 3.0, 100):
        assert ScheduleConfig(warmup=ok).warmup == ok


def deepspeed_lamb_coeff(w_norm: float, u_norm: float, min_coeff: float, max_coeff: float) -> float:
    """deepspeed/ops/lamb/fused_lamb.py: the clamps bound a computed ratio; the fallback 1 is not clamped."""
    coeff = 1.0
    if w_norm != 0 and u_norm != 0:
        coeff = min(max(w_norm / u_norm, min_coeff), max_coeff)
    return coeff


@pytest.mark.parametrize("foreach", [True, False])
@pytest.mark.parametrize("min_tr,max_tr", [(0.01, 0.5), (2.0, 10.0), (0.01, 10.0)])
def test_lamb_trust_ratio_falls_back_to_one_outside_the_clamps_as_deepspeed(foreach: bool, min_tr: float,
                                                                            max_tr: float) -> None:
    """A zero tensor (a zero-initialised bias at the first step) takes trust ratio 1 in DeepSpeed whatever the
    clamps; bertrain clamped that 1 too, so with max_trust_ratio < 1 (or min > 1) the biases' first step was
    scaled by the clamp. Computed ratios are still clamped (the weight below)."""
    from bertrain.train.optim import Lamb
    torch.manual_seed(0)
    weight, bias = nn.Parameter(torch.randn(5, 3)), nn.Parameter(torch.zeros(5))
    lr, eps, wd = 0.1, 1e-6, 0.01
    opt = Lamb([{"params": [weight], "weight_decay": wd}, {"params": [bias], "weight_decay": 0.0}], lr=lr, eps=eps,
               weight_decay=wd, min_trust_ratio=min_tr, max_trust_ratio=max_tr, foreach=foreach)
    weight.grad, bias.grad = torch.randn(5, 3), torch.randn(5)
    expected = []
    for p, decay in ((weight, wd), (bias, 0.0)):
        g = p.grad.double()
        m_hat, v_hat = g, g * g  # step 1: (0.1 g) / (1 - 0.9), (0.001 g^2) / (1 - 0.999)
        update = m_hat / (v_hat.sqrt() + eps) + decay * p.detach().double()
        coeff = deepspeed_lamb_coeff(float(p.detach().norm()), float(update.norm()), min_tr, max_tr)
        expected.append(p.detach().double() - lr * coeff * update)
    opt.step()
    torch.testing.assert_close(weight.detach().double(), expected[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(bias.detach().double(), expected[1], rtol=1e-5, atol=1e-6)
