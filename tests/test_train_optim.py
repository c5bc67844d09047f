"""LAMB / NVLAMB / BERT AdamW against straightforward per-parameter references, parameter groups, schedules."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from bertrain.train.config import OptimConfig, ScheduleConfig
from bertrain.train.optim import BertAdamW, Lamb, build_optimizer, param_groups
from bertrain.train.schedules import LRMultiplier, build_scheduler


class Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 8)
        self.lin = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.out = nn.Linear(8, 3)
        with torch.no_grad():
            self.out.bias.zero_()  # a zero-norm tensor: trust ratio must fall back to 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(torch.tanh(self.lin(self.emb(x)))))


def reference_lamb_step(params, grads, states, lr, betas, eps, wd_of, bias_correction, min_tr, max_tr, nvlamb,
                        max_grad_norm=1.0):
    """LAMB as written in the paper (You et al. 2019, Alg. 2) / cybertronai pytorch_lamb, one tensor at a time,
    with DeepSpeed's trust-ratio clamps; NVLAMB as apex FusedLAMB (NVIDIA's BERT) computes it: the gradients
    divided by ||g|| / max_grad_norm only where the global norm exceeds max_grad_norm, and trust ratio 1 for
    tensors without weight decay. Returns (a ratio was clamped, the nvlamb gradients were scaled)."""
    b1, b2 = betas
    clamped = scaled = False
    if nvlamb:
        gnorm = math.sqrt(sum(float((g.double() ** 2).sum()) for g in grads))
        if gnorm > max_grad_norm:
            scaled = True
            grads = [g / (gnorm / max_grad_norm) for g in grads]
    for p, g, st, wd in zip(params, grads, states, wd_of):
        st["t"] += 1
        st["m"] = b1 * st["m"] + (1 - b1) * g
        st["v"] = b2 * st["v"] + (1 - b2) * g * g
        m_hat = st["m"] / (1 - b1 ** st["t"]) if bias_correction else st["m"]
        v_hat = st["v"] / (1 - b2 ** st["t"]) if bias_correction else st["v"]
        update = m_hat / (v_hat.sqrt() + eps) + wd * p
        w_norm, u_norm = float(p.norm()), float(update.norm())
        trust = w_norm / u_norm if w_norm > 0 and u_norm > 0 else 1.0
        if nvlamb and wd == 0:
            trust = 1.0  # apex: `if (use_nvlamb || decay != 0)` guards the ratio; DLE's BERT runs use_nvlamb=False
        clamped |= not min_tr <= trust <= max_tr
        trust = min(max(trust, min_tr), max_tr)
        p -= lr * trust * update
    return clamped, scaled


def _batches(n: int):
    g = torch.Generator().manual_seed(3)
    return [(torch.randint(0, 11, (16,), generator=g), torch.randint(0, 3, (16,), generator=g)) for _ in range(n)]


@pytest.mark.parametrize("foreach", [True, False])
@pytest.mark.parametrize("nvlamb,bias_correction,min_tr,max_tr", [
    (False, True, 0.01, 10.0), (True, True, 0.0, 10.0), (False, False, 0.5, 2.0),
])
def test_lamb_matches_reference_step_by_step(nvlamb, bias_correction, min_tr, max_tr, foreach) -> None:
    torch.manual_seed(0)
    model = Toy()
    ref = [p.detach().clone() for p in model.parameters()]
    init = [p.detach().clone() for p in model.parameters()]
    groups = param_groups(model, 0.1)
    wd_of_id = {id(p): g["weight_decay"] for g in groups for p in g["params"]}
    wd_of = [wd_of_id[id(p)] for p in model.parameters()]
    lr, betas, eps = 0.02, (0.9, 0.99), 1e-6
    opt = Lamb(groups, lr=lr, betas=betas, eps=eps, weight_decay=0.1, bias_correction=bias_correction,
               min_trust_ratio=min_tr, max_trust_ratio=max_tr, nvlamb=nvlamb, foreach=foreach)
    states = [{"t": 0, "m": torch.zeros_like(p), "v": torch.zeros_like(p)} for p in ref]
    clamped, scaled = False, []
    for step, (x, y) in enumerate(_batches(12)):
        model.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        grads = [p.grad.detach().clone() for p in model.parameters()]
        opt.step()
        c, s = reference_lamb_step(ref, grads, states, lr, betas, eps, wd_of, bias_correction, min_tr, max_tr, nvlamb)
        clamped |= c
        scaled.append(s)
        for i, (p, r) in enumerate(zip(model.parameters(), ref)):
            torch.testing.assert_close(p.detach(), r, rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"step {step}, tensor {i}: {m}")
    # the narrow clamp range was exercised, and the parameters really moved (agreement is not trivial)
    assert clamped == (min_tr == 0.5)
    if nvlamb:  # the global norms (0.7 to 1.5) straddle max_grad_norm 1: both of apex's branches were taken
        assert any(scaled) and not all(scaled)
    assert min(float((p.detach() - q).abs().max()) for p, q in zip(model.parameters(), init)) > 1e-3


@pytest.mark.parametrize("nvlamb", [False, True])
def test_multi_tensor_lamb_equals_per_tensor_loop(nvlamb):
    """Lamb's two forms (multi-tensor for CUDA, per-tensor, the CPU default) take the same steps. (Each is also
    checked against the paper's algorithm: test_lamb_matches_reference_step_by_step.)"""
    torch.manual_seed(0)
    shapes = [(7, 5), (5,), (3, 4, 2), (1,)]
    a = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    a[-1].data.zero_()  # a zero weight: trust ratio 1
    b[-1].data.zero_()
    groups = lambda ps: [{"params": ps[:2], "weight_decay": 0.01}, {"params": ps[2:], "weight_decay": 0.0}]
    fast = Lamb(groups(a), lr=1e-2, nvlamb=nvlamb, foreach=True)
    ref = Lamb(groups(b), lr=1e-2, nvlamb=nvlamb, foreach=False)
    for step in range(4):
        g = [torch.randn(s) for s in shapes]
        for p, x in zip(a, g):
            p.grad = x.clone()
        for p, x in zip(b, g):
            p.grad = x.clone()
        fast.step()
        ref.step()
        for p, q in zip(a, b):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_bert_adamw_without_bias_correction_matches_google_formula() -> None:
    torch.manual_seed(0)
    model = Toy()
    ref = [p.detach().clone() for p in model.parameters()]
    opt = BertAdamW(model.parameters(), lr=0.01, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01)
    m = [torch.zeros_like(p) for p in ref]
    v = [torch.zeros_like(p) for p in ref]
    for x, y in _batches(10):
        model.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        for i, p in enumerate(model.parameters()):
            g = p.grad
            m[i] = 0.9 * m[i] + 0.1 * g
            v[i] = 0.999 * v[i] + 0.001 * g * g
            ref[i] -= 0.01 * (m[i] / (v[i].sqrt() + 1e-6) + 0.01 * ref[i])  # AdamWeightDecayOptimizer
        opt.step()
    for p, r in zip(model.parameters(), ref):
        torch.testing.assert_close(p.detach(), r, rtol=1e-5, atol=1e-6)


def test_no_weight_decay_on_biases_and_layernorm() -> None:
    model = Toy()
    groups = param_groups(model, 0.01)
    decayed = {id(p) for g in groups if g["weight_decay"] > 0 for p in g["params"]}
    named = dict(model.named_parameters())
    assert id(named["lin.weight"]) in decayed and id(named["emb.weight"]) in decayed
    for name in ("lin.bias", "norm.weight", "norm.bias", "out.bias"):
        assert id(named[name]) not in decayed, name
    assert sum(len(g["params"]) for g in groups) == len(named)


@pytest.mark.parametrize("name,cls", [("lamb", Lamb), ("nvlamb", Lamb), ("adamw", torch.optim.AdamW),
                                      ("radam", torch.optim.RAdam)])
def test_build_optimizer(name: str, cls: type) -> None:
    opt = build_optimizer(Toy(), OptimConfig(name=name, lr=3e-4), lr=6e-4)
    assert isinstance(opt, cls)
    assert all(g["lr"] == 6e-4 for g in opt.param_groups)
    assert isinstance(build_optimizer(Toy(), OptimConfig(name="adamw", bias_correction=False)), BertAdamW)


def test_schedules() -> None:
    f = LRMultiplier(ScheduleConfig(name="linear", warmup=0.1), 100)
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0) and f(55) == pytest.approx(0.5)
    assert f(100) == pytest.approx(0.0)
    poly = LRMultiplier(ScheduleConfig(name="poly", warmup=10, power=0.5), 110)  # warmup in steps
    # NVIDIA's PolyWarmUpScheduler: t = step + 1, progress t / total over all steps (HF's, over the steps after
    # warmup, would give 1.0 at step 9 and sqrt(0.5) at step 60)
    assert poly.warmup == 10 and poly(8) == pytest.approx(0.9) and poly(9) == pytest.approx(math.sqrt(1 - 10 / 110))
    assert poly(60) == pytest.approx(math.sqrt(1 - 61 / 110)) and poly(109) == 0.0 and poly(200) == 0.0
    cos = LRMultiplier(ScheduleConfig(name="cosine", warmup=0, min_lr_ratio=0.1), 100)
    assert cos(0) == pytest.approx(1.0) and cos(50) == pytest.approx(0.55) and cos(100) == pytest.approx(0.1)
    exp = LRMultiplier(ScheduleConfig(name="warmup_exp_decay_exp", warmup=0.1, decay_rate=0.5, decay_steps=20), 100)
    assert exp(4) == pytest.approx((5 / 10) ** 2) and exp(10) == 1.0 and exp(30) == pytest.approx(0.5)
    assert LRMultiplier(ScheduleConfig(name="constant", warmup=0), 10)(9) == 1.0


def test_scheduler_drives_optimizer_lr() -> None:
    opt = build_optimizer(Toy(), OptimConfig(name="lamb", lr=1e-3))
    sched = build_scheduler(opt, ScheduleConfig(name="linear", warmup=2), 4)
    lrs = []
    for _ in range(4):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs == pytest.approx([5e-4, 1e-3, 1e-3, 5e-4])  # decay reaches 0 after the last step
