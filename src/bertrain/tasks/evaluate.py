"""Distributed evaluation: every rank runs its share of the examples, every rank gets all outputs in order.

Indices are padded to a multiple of the world size (by wrapping) and strided over ranks; every rank's (index,
output) pairs are gathered and the padded duplicates dropped by index, so each example is scored exactly once
whatever the world size.
"""
from __future__ import annotations

import logging
import math
import sys
import time
from typing import Any, Callable

import numpy as np
import torch
from tqdm import tqdm

from bertrain.train.distributed import DistInfo, gather_objects
from bertrain.train.precision import Precision
from bertrain.train.trainer import to_device, trim_padding

log = logging.getLogger(__name__)


def shard_for_eval(n: int, rank: int, world: int) -> np.ndarray:
    """This rank's evaluation indices: 0..n-1 padded by wrapping to a multiple of `world`, strided by rank."""
    total = math.ceil(n / world) * world
    return (np.arange(total) % n)[rank::world] if n else np.zeros(0, dtype=np.int64)


def merge_gathered(parts: list[tuple[np.ndarray, Any]], n: int) -> list[np.ndarray]:
    """Join every rank's (indices, outputs) into outputs in index order, dropping padded duplicates.

    `outputs` is a tuple of arrays with the same first dimension as `indices`. Raises if an index is missing.
    """
    indices = np.concatenate([p[0] for p in parts])
    uniq, first = np.unique(indices, return_index=True)  # first occurrence of each index, sorted by index
    if len(uniq) != n or (n and (uniq[0] != 0 or uniq[-1] != n - 1)):
        raise RuntimeError(f"distributed evaluation covered {len(uniq)} of {n} examples")
    n_out = len(parts[0][1])
    merged = []
    for k in range(n_out):
        arr = np.concatenate([p[1][k] for p in parts])
        merged.append(arr[first])
    return merged


@torch.no_grad()
def distributed_forward(model: torch.nn.Module, feats: dict[str, np.ndarray], outputs: Callable[[Any], tuple],
                        dist: DistInfo, batch_size: int, precision: Precision | None = None,
                        trim: bool = True, per_token: bool = True) -> list[np.ndarray]:
    """Run `model` over all of `feats`, sharded over ranks; every rank gets all outputs in example order.

    `outputs(model_output)` picks the tensors to keep, each (B, ...); with `per_token` (QA logits) columns cut by
    trimming come back as -10000 so that the outputs keep the full width and never win an argmax. Per-example
    outputs (classification logits) pass `per_token=False`: a batch trimmed to as many tokens as there are
    classes (a sentence of characters the tokenizer drops, alone in the last batch: [CLS] [SEP], 2 tokens) had
    its (B, 2) logits widened too, and joining them to the other batches failed.
    """
    n = len(feats["input_ids"])
    L = feats["input_ids"].shape[1]
    mine = shard_for_eval(n, dist.rank, dist.world_size)
    model.eval()
    chunks: list[list[np.ndarray]] = []
    if dist.is_main:
        log.info("evaluating %d examples on %d rank(s), %d per batch", n, dist.world_size, batch_size)
    t0 = last_log = time.perf_counter()
    bar = tqdm(total=len(mine), desc="evaluate", unit="ex", disable=not (dist.is_main and sys.stderr.isatty()))
    for s in range(0, len(mine), batch_size):
        idx = mine[s:s + batch_size]
        batch = {k: torch.from_numpy(np.ascontiguousarray(feats[k][idx])).long()
                 for k in ("input_ids", "token_type_ids", "attention_mask")}
        batch = to_device(trim_padding(batch) if trim else batch, dist.device)
        ctx = precision.autocast() if precision is not None else torch.autocast("cpu", enabled=False)
        with ctx:
            out = outputs(model(**batch))
        arrs = []
        for t in out:
            t = t.float().cpu().numpy()
            if per_token and t.ndim == 2 and t.shape[1] < L and t.shape[1] == batch["input_ids"].shape[1]:
                t = np.concatenate([t, np.full((t.shape[0], L - t.shape[1]), -10000.0, np.float32)], axis=1)
            arrs.append(t)
        chunks.append(arrs)
        bar.update(len(idx))
        if dist.is_main and bar.disable and time.perf_counter() - last_log > 30:  # no terminal: a line now and then
            last_log = time.perf_counter()
            log.info("evaluated %d of %d examples of this rank (%.0f/s)", s + len(idx), len(mine),
                     (s + len(idx)) / (last_log - t0))
    bar.close()
    k = len(chunks[0]) if chunks else 0
    local = tuple(np.concatenate([c[j] for c in chunks]) for j in range(k))
    parts = gather_objects((mine, local))
    return merge_gathered(parts, n)
