"""Audit of the training engine's numerics (schedules, precision, optimizers) against what the references do:
each test failed before its fix."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from bertrain.config import from_dict
from bertrain.tasks.pretraining import PretrainConfig, run_pretraining
from bertrain.train.config import OptimConfig, PrecisionConfig, ScheduleConfig, TrainConfig, TrainerConfig
from bertrain.train.optim import BertAdamW, build_optimizer
from bertrain.train.precision import Precision

CPU = torch.device("cpu")


def _trainer_config(**schedule) -> TrainerConfig:
    return TrainerConfig(train=TrainConfig(max_time="10m"), schedule=ScheduleConfig(name="constant", **schedule),
                         output_dir="o")


def test_a_time_budget_alone_refuses_a_fractional_warmup() -> None:
    """train.max_time without train.steps/epochs: the run has NO_STEP_LIMIT (2**62) steps, so a warmup fraction
    (the default 0.01) was 4.6e16 steps long and the LR stayed ~2e-20 x the peak for the whole run. Refused now,
    naming the key; a warmup in steps, none, or on_time (a fraction of the budget) still run."""
    with pytest.raises(ValueError, match=r"config key 'schedule.warmup' \(0.01\).*train.max_time.*in steps"):
        _trainer_config(warmup=0.01)
    for ok in ({"warmup": 0}, {"warmup": 100}, {"warmup": 0.1, "on_time": True}):
        assert _trainer_config(**ok).schedule.warmup == ok["warmup"]
    # with a length the fraction is of that length, as before
    assert TrainerConfig(train=TrainConfig(steps=100, max_time="10m"), schedule=ScheduleConfig(warmup=0.05),
                         output_dir="o").schedule.warmup_steps(100) == 5


def test_on_time_warmup_in_steps_is_refused_by_the_config() -> None:
    """Before, only build_scheduler refused it: after the data were prepared and the model built."""
    with pytest.raises(ValueError, match=r"config key 'schedule.warmup' \(100\) must be a fraction"):
        ScheduleConfig(on_time=True, warmup=100)
    assert ScheduleConfig(on_time=False, warmup=100).warmup == 100


def _fp16_step(model: nn.Module, opt: torch.optim.Optimizer, prec: Precision) -> bool:
    with prec.autocast():
        loss = model(torch.randn(8, 4)).float().pow(2).mean()
    prec.backward(loss)
    prec.unscale_and_clip(opt, model.parameters(), 1.0)
    stepped = prec.step(opt)
    opt.zero_grad(set_to_none=True)
    return stepped


def test_a_resumed_scaler_grows_at_the_configs_growth_interval() -> None:
    """GradScaler's state_dict carries growth_interval, and loading it replaced the config's: a run resumed with
    --allow-config-change --precision.growth_interval 3 (logged as applied) kept growing every 2000 steps."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    opt = build_optimizer(model, OptimConfig(name="adamw", lr=1e-3))
    before = Precision(PrecisionConfig(mode="fp16", initial_loss_scale=64.0, growth_interval=2000), CPU)
    after = Precision(PrecisionConfig(mode="fp16", initial_loss_scale=64.0, growth_interval=3), CPU)
    after.load_state_dict(before.state_dict())
    assert after.scaler.get_growth_interval() == 3
    scales = []
    for _ in range(6):
        assert _fp16_step(model, opt, after)
        scales.append(after.loss_scale)
    assert scales == [64.0, 64.0, 128.0, 128.0, 128.0, 256.0]  # torch.amp.GradScaler(growth_interval=3)


def test_bert_adamw_moments_continue_under_torch_adamw() -> None:
    """optim.bias_correction false (BertAdamW) -> true (torch.optim.AdamW): a resume with --allow-config-change or
    optim.init_state loads BertAdamW's state into AdamW, which failed with KeyError: 'step' (a traceback). BertAdamW
    now counts its steps (unused by its maths), so AdamW continues the moments with the right bias correction."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    bert = build_optimizer(model, OptimConfig(name="adamw", bias_correction=False, lr=1e-2))
    assert isinstance(bert, BertAdamW)
    for _ in range(2):
        model(torch.randn(4, 3)).pow(2).sum().backward()
        bert.step()
        bert.zero_grad()
    assert all(float(st["step"]) == 2 for st in bert.state.values())
    state = bert.state_dict()
    adamw = build_optimizer(model, OptimConfig(name="adamw", bias_correction=True, lr=1e-2))
    adamw.load_state_dict(state)
    w = model.weight.detach().clone()
    m, v = (adamw.state[model.weight][k].clone() for k in ("exp_avg", "exp_avg_sq"))
    model(torch.randn(4, 3)).pow(2).sum().backward()
    g = model.weight.grad.clone()
    adamw.step()
    # Adam step 3 from those moments: decoupled decay, then m_hat / (sqrt(v_hat) + eps)
    m, v = 0.9 * m + 0.1 * g, 0.999 * v + 0.001 * g * g
    expected = w * (1 - 1e-2 * 0.01) - 1e-2 * (m / (1 - 0.9 ** 3)) / ((v / (1 - 0.999 ** 3)).sqrt() + 1e-6)
    torch.testing.assert_close(model.weight.detach(), expected, rtol=1e-5, atol=1e-7)
    # and a BertAdamW state written before it counted steps still loads and steps
    old = {"state": {k: {n: t for n, t in st.items() if n != "step"} for k, st in state["state"].items()},
           "param_groups": state["param_groups"]}
    again = build_optimizer(model, OptimConfig(name="adamw", bias_correction=False, lr=1e-2))
    again.load_state_dict(old)
    model(torch.randn(4, 3)).pow(2).sum().backward()
    again.step()
    assert all(float(st["step"]) == 1 for st in again.state.values())


def test_resume_turning_bias_correction_on_continues_the_run(tmp_path: Path) -> None:
    """The user's path of the test above: 2 steps without bias correction, resumed to 4 with it."""
    def config(**optim) -> PretrainConfig:
        return from_dict(PretrainConfig, {
            "model": {"preset": "tiny"}, "data": {"synthetic_samples": 32, "vocab_size": 100},
            "sample": {"max_seq_length": 32, "max_predictions_per_seq": 5},
            "train": {"steps": 2 if not optim["bias_correction"] else 4, "global_batch_size": 8,
                      "micro_batch_size": 8, "log_interval": 1},
            "optim": {"name": "adamw", "lr": 1e-3, **optim}, "eval": {"enabled": False},
            "metrics": {"report_to": []}, "checkpoint": {"save_interval": 0, "export_final": False}, "seed": 3,
            "output_dir": str(tmp_path / "run")})
    run_pretraining(config(bias_correction=False))
    resumed = run_pretraining(config(bias_correction=True), resume="auto", allow_config_change=True)
    assert resumed.run.start_step == 2 and resumed.state.step == 4
    assert all(p.isfinite().all() for p in resumed.model.parameters())


def test_an_fp32_run_after_a_tf32_one_in_the_same_process_is_fp32() -> None:
    """The TF32 switches are process-wide and were only ever turned on: a pipeline's fp32 fine-tuning after a tf32
    pretraining stage (one process) ran TF32 matmuls. Set for every mode on CUDA now (the flags can be set
    without a GPU, so this runs anywhere)."""
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.get_float32_matmul_precision())
    try:
        Precision(PrecisionConfig(mode="tf32"), torch.device("cuda"))
        assert torch.backends.cuda.matmul.allow_tf32 and torch.get_float32_matmul_precision() == "high"
        for mode in ("fp32", "bf16"):
            Precision(PrecisionConfig(mode="tf32"), torch.device("cuda"))
            Precision(PrecisionConfig(mode=mode), torch.device("cuda"))
            assert not torch.backends.cuda.matmul.allow_tf32, mode
            assert torch.get_float32_matmul_precision() == "highest", mode
        before = torch.get_float32_matmul_precision()
        Precision(PrecisionConfig(mode="tf32"), CPU)  # on CPU: nothing set
        assert torch.get_float32_matmul_precision() == before
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved[0]
        torch.set_float32_matmul_precision(saved[1])
