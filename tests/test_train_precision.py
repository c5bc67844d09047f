"""Precision: an injected overflow skips the step (weights, optimizer state and schedule untouched); a collapsing
loss scale stops with a clear error; bf16 autocast runs on CPU."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from bertrain.train.config import OptimConfig, PrecisionConfig, ScheduleConfig
from bertrain.train.optim import build_optimizer
from bertrain.train.precision import LossScaleCollapse, Precision
from bertrain.train.schedules import build_scheduler

CPU = torch.device("cpu")
# the overflow test also runs on CUDA where there is a GPU (issue 26): fp16 autocast and loss scaling are real there
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def setup(mode: str = "fp16", device: torch.device = CPU, **precision: float):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)).to(device)
    opt = build_optimizer(model, OptimConfig(name="lamb", lr=1e-2))
    sched = build_scheduler(opt, ScheduleConfig(name="linear", warmup=0), 10)
    return model, opt, sched, Precision(PrecisionConfig(mode=mode, **precision), device)


def train_step(model, opt, sched, prec, inject_inf: bool) -> bool:
    x = torch.randn(16, 4, device=prec.device)
    with prec.autocast():
        y = model(x)
        if prec.device.type == "cuda":
            assert y.dtype == torch.float16  # autocast really computes in fp16 there
        loss = y.float().pow(2).mean()
    prec.backward(loss)
    if inject_inf:
        model[0].weight.grad[0, 0] = float("inf")
    prec.unscale_and_clip(opt, model.parameters(), 1.0)
    stepped = prec.step(opt)
    opt.zero_grad(set_to_none=True)
    if stepped:
        sched.step()
    return stepped


@pytest.mark.parametrize("device", DEVICES)
def test_overflow_skips_step_without_touching_weights_or_schedule(device: str) -> None:
    model, opt, sched, prec = setup(initial_loss_scale=1024.0, device=torch.device(device))
    assert train_step(model, opt, sched, prec, inject_inf=False)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    moments = {k: v.clone() for k, v in opt.state[model[0].weight].items()}
    lr, epoch, scale = opt.param_groups[0]["lr"], sched.last_epoch, prec.loss_scale

    assert not train_step(model, opt, sched, prec, inject_inf=True)
    for k, v in model.state_dict().items():
        assert torch.equal(v, weights[k]), k
    for k, v in opt.state[model[0].weight].items():
        assert torch.equal(v, moments[k]), k
    assert sched.last_epoch == epoch and opt.param_groups[0]["lr"] == lr
    assert prec.loss_scale == scale / 2 and prec.skipped_steps == 1

    assert train_step(model, opt, sched, prec, inject_inf=False)  # and training goes on
    assert sched.last_epoch == epoch + 1
    assert not torch.equal(model[0].weight, weights["0.weight"])
    assert prec.consecutive_skips == 0


def test_collapsing_loss_scale_raises_clear_error() -> None:
    model, opt, sched, prec = setup(initial_loss_scale=8.0, min_loss_scale=1.0, max_consecutive_skips=3)
    with pytest.raises(LossScaleCollapse, match="min_loss_scale.*bf16"):
        for _ in range(10):
            train_step(model, opt, sched, prec, inject_inf=True)
    assert prec.loss_scale == 0.5 and prec.consecutive_skips == 4  # 8 -> 4 -> 2 -> 1 -> 0.5: below 1


def test_scaler_state_roundtrip() -> None:
    _, opt, _, prec = setup(initial_loss_scale=512.0)
    prec.skipped_steps = 5
    other = Precision(PrecisionConfig(mode="fp16"), CPU)
    other.load_state_dict(prec.state_dict())
    assert other.loss_scale == 512.0 and other.skipped_steps == 5


def test_bf16_autocast_on_cpu() -> None:
    model, opt, sched, prec = setup("bf16")
    with prec.autocast():
        y = model[0](torch.randn(2, 4))
    assert y.dtype == torch.bfloat16
    assert train_step(model, opt, sched, prec, inject_inf=False) and prec.loss_scale == 1.0


def test_fp32_and_tf32_have_no_autocast() -> None:
    for mode in ("fp32", "tf32"):
        model, *_ , prec = setup(mode)
        with prec.autocast():
            assert model[0](torch.randn(2, 4)).dtype == torch.float32
