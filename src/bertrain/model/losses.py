"""The losses of every head, as sums over targets plus target counts.

The trainer divides each sum by the *global* count of its targets (over every micro-batch and rank of an
optimizer step), so 1 process x k micro-steps gives the same gradient as k processes x 1 even when micro-batches
hold different numbers of targets (MLM). The heads' own `.loss` is the same sum divided by the local count (the
HF convention), so the tests that compare a head's loss with HF's check the very function the trainer uses.

Sums are taken in fp32 whatever the autocast dtype. Label -100 means "no target" everywhere.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def ce_sum(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Summed cross-entropy over labels != ignore_index (0 when there are none: still a function of `logits`,
    so every parameter gets a gradient, which DDP needs)."""
    labels = labels.reshape(-1)
    # the class count spelled out: with no label at all (P = 0 masked positions) a -1 there is ambiguous
    return F.cross_entropy(logits.reshape(labels.numel(), logits.size(-1)).float(), labels, ignore_index=ignore_index,
                           reduction="sum")


def mean_from_sums(loss_sum: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """A local mean from a sum and its count (0, not NaN, when there is no target)."""
    return loss_sum / count.clamp(min=1)


@torch.no_grad()
def _correct(logits: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    return ((logits.argmax(-1) == labels) & valid).sum()


def pretraining_loss_sums(prediction_logits: torch.Tensor, seq_relationship_logits: torch.Tensor,
                          masked_labels: torch.Tensor | None,
                          next_sentence_labels: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """MLM and NSP: `mlm_loss_sum`, `nsp_loss_sum` (differentiable) and `mlm_correct`, `mlm_count`,
    `nsp_correct`, `nsp_count`. `masked_labels` is aligned with `prediction_logits` ((B, P) or (B, T));
    `prediction_logits` must already be cut to the real vocabulary (the head does it)."""
    out: dict[str, torch.Tensor] = {}
    for name, logits, labels in (("mlm", prediction_logits, masked_labels),
                                 ("nsp", seq_relationship_logits, next_sentence_labels)):
        if labels is None:
            continue
        valid = labels != -100
        out[f"{name}_loss_sum"] = ce_sum(logits, labels)
        out[f"{name}_correct"] = _correct(logits, labels, valid)
        out[f"{name}_count"] = valid.sum()
    return out


def classification_loss_sums(logits: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
    """Sequence classification: cross-entropy (num_labels > 1) or squared error (num_labels == 1, regression).
    `loss_sum`, `count`, and `correct` for classification."""
    if logits.size(-1) == 1:
        loss_sum = F.mse_loss(logits.reshape(-1).float(), labels.reshape(-1).float(), reduction="sum")
        return {"loss_sum": loss_sum, "count": torch.tensor(labels.numel(), device=logits.device)}
    labels = labels.reshape(-1)
    valid = labels != -100
    return {"loss_sum": ce_sum(logits, labels), "count": valid.sum(), "correct": _correct(logits, labels, valid)}


def qa_loss_sums(start_logits: torch.Tensor, end_logits: torch.Tensor, start_positions: torch.Tensor,
                 end_positions: torch.Tensor) -> dict[str, torch.Tensor]:
    """Span extraction, as HF: positions outside the sequence are clamped to T and ignored; a feature's loss is
    (CE_start + CE_end) / 2. `loss_sum` over features and `count` (features with a start target)."""
    T = start_logits.size(1)
    start = start_positions.reshape(-1).clamp(0, T)
    end = end_positions.reshape(-1).clamp(0, T)
    loss_sum = (ce_sum(start_logits, start, ignore_index=T) + ce_sum(end_logits, end, ignore_index=T)) / 2
    return {"loss_sum": loss_sum, "count": (start != T).sum()}
