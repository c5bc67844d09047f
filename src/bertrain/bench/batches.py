"""The bench's batches (realistic lengths, the loader's pretraining layout plus HF's) and its FLOP count."""
from __future__ import annotations

import math
from typing import Any

import torch

from bertrain.model.bert import BertConfig


def sample_lengths(batch_size: int, seq_len: int, seed: int, min_len_frac: float = 0.3) -> torch.Tensor:
    """(B,) lengths ~ U[ceil(min_len_frac * T), T], reproducible from `seed`."""
    g = torch.Generator().manual_seed(seed)
    lo = min(seq_len, max(3, math.ceil(min_len_frac * seq_len)))
    return torch.randint(lo, seq_len + 1, (batch_size,), generator=g)


def _token_batch(config: BertConfig, lengths: torch.Tensor, seq_len: int, g: torch.Generator) -> dict[str, Any]:
    B, V = len(lengths), config.vocab_size
    cls_id, sep_id = (101, 102) if V > 1000 else (2, 3)
    ids = torch.randint(min(999, V // 2), V, (B, seq_len), generator=g)
    mask = (torch.arange(seq_len)[None, :] < lengths[:, None]).long()
    tt = torch.zeros(B, seq_len, dtype=torch.long)
    for i, n in enumerate(lengths.tolist()):
        a = max(1, n // 2)
        ids[i, 0], ids[i, a - 1], ids[i, n - 1] = cls_id, sep_id, sep_id
        tt[i, a:n] = 1
    ids = ids * mask
    return {"input_ids": ids, "token_type_ids": tt, "attention_mask": mask}


def max_predictions(seq_len: int) -> int:
    return math.ceil(0.15 * seq_len)


def pretraining_batch(config: BertConfig, batch_size: int, seq_len: int, seed: int,
                      min_len_frac: float = 0.3) -> dict[str, torch.Tensor]:
    """A pretraining micro-batch in the loader's layout (ARCHITECTURE.md) plus `labels` (B, T) for HF's head."""
    lengths = sample_lengths(batch_size, seq_len, seed, min_len_frac)
    g = torch.Generator().manual_seed(seed + 1)
    b = _token_batch(config, lengths, seq_len, g)
    P = max_predictions(seq_len)
    pos = torch.zeros(batch_size, P, dtype=torch.long)
    mlabels = torch.full((batch_size, P), -100, dtype=torch.long)
    labels = torch.full((batch_size, seq_len), -100, dtype=torch.long)
    for i, n in enumerate(lengths.tolist()):
        k = min(P, max(1, round(0.15 * n)))
        chosen = (torch.randperm(n - 1, generator=g)[:k] + 1).sort().values  # never [CLS]
        pos[i, :k] = chosen
        mlabels[i, :k] = b["input_ids"][i, chosen]
        labels[i, chosen] = b["input_ids"][i, chosen]
        b["input_ids"][i, chosen] = 103 if config.vocab_size > 1000 else 4  # [MASK]
    b.update(masked_positions=pos, masked_labels=mlabels, labels=labels,
             next_sentence_labels=torch.randint(0, 2, (batch_size,), generator=g))
    return b


def qa_batch(config: BertConfig, batch_size: int, seq_len: int, seed: int,
             min_len_frac: float = 0.3) -> dict[str, torch.Tensor]:
    """A SQuAD-like batch: question + context, answer span inside the real tokens."""
    lengths = sample_lengths(batch_size, seq_len, seed, min_len_frac)
    g = torch.Generator().manual_seed(seed + 2)
    b = _token_batch(config, lengths, seq_len, g)
    start = torch.stack([torch.randint(max(1, n // 2), n - 1, (1,), generator=g)[0] for n in lengths.tolist()])
    b.update(start_positions=start, end_positions=torch.minimum(start + 3, lengths - 2))
    return b


# ----------------------------------------------------------------------------------------------- FLOPs

def flop_formula() -> str:
    return ("useful matmul FLOPs, 2 per multiply-add, training = 3 x forward: forward = "
            "L*2*(4*H^2 + 2*H*I) * sum(n_i)  [QKV, attention output, FFN on real tokens] "
            "+ L*4*H * sum(n_i^2)  [QK^T and AV over real tokens] "
            "+ 2*(H^2 + H*V) * masked_tokens + 2*(H^2 + 2*H) * B  [MLM head at masked positions, pooler+NSP] "
            "(fine-tuning/inference QA head: 2*2*H * sum(n_i)); embeddings, softmax, LayerNorm, GELU not counted")


def model_flops(config: BertConfig, lengths: torch.Tensor, mode: str, masked_tokens: int = 0) -> float:
    """FLOPs of one step on a batch with real lengths `lengths`, by `flop_formula()`."""
    H, I, L, V = config.hidden_size, config.intermediate_size, config.num_hidden_layers, config.vocab_size
    n = lengths.double()
    fwd = L * 2 * (4 * H * H + 2 * H * I) * n.sum() + L * 4 * H * (n * n).sum()
    if mode == "pretrain":
        fwd = fwd + 2 * (H * H + H * V) * masked_tokens + 2 * (H * H + 2 * H) * len(lengths)
    else:
        fwd = fwd + 2 * 2 * H * n.sum()
    return float(fwd * (1 if mode == "inference" else 3))
