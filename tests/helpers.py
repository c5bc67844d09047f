"""Helpers shared by the model tests (test_model.py, test_fastpath.py)."""
from __future__ import annotations

import torch

RTOL, ATOL = 1e-5, 1e-6


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A copy of every parameter's gradient, by name (parameters without one left out)."""
    return {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str, rtol: float = RTOL,
                atol: float = ATOL) -> None:
    """The same names, and close tensors under each."""
    assert a.keys() == b.keys(), what
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=rtol, atol=atol, msg=lambda m, k=k: f"{what} {k}: {m}")
