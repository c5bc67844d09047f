"""Distributed evaluation: every rank runs its share of the examples, every rank gets all outputs in order.

The examples are cut into batches in order, the same batches whatever the world size (those of one process);
rank r of W runs batches r, r + W, r + 2W, ... and a rank with one batch fewer runs a filler whose outputs are
dropped, so every rank runs as many forward passes (a sharded model gathers its weights in each). Every rank's
(index, output) pairs are gathered and put in index order: each example is scored exactly once, in a batch of the
same examples and width as on one process, so N processes give the same bits as one (the dev predictions, STS-B's
Pearson, SQuAD's nbest probabilities and null odds; strided examples gave other batches, equal only to rounding).
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


def eval_batches(n: int, batch_size: int, rank: int, world: int) -> tuple[list[np.ndarray], int]:
    """This rank's evaluation batches (example indices) and how many filler passes it runs after them.

    Examples 0..n-1 cut into batches of `batch_size` in order (the same batches at every world size); rank `rank`
    takes batches rank, rank + world, ...; the fillers make every rank's number of passes that of rank 0."""
    if batch_size < 1:
        raise ValueError(f"eval batch size must be >= 1, got {batch_size}")
    num = math.ceil(n / batch_size)
    mine = [np.arange(k * batch_size, min(n, (k + 1) * batch_size)) for k in range(rank, num, world)]
    return mine, math.ceil(num / world) - len(mine)


def merge_gathered(parts: list[tuple[np.ndarray, Any]], n: int) -> list[np.ndarray]:
    """Join every rank's (indices, outputs) into outputs in index order (an index given twice: its first outputs).

    `outputs` is a tuple of arrays with the same first dimension as `indices`. Raises if an index is missing.
    """
    parts = [p for p in parts if len(p[0])]  # (fewer batches than ranks: some ranks have no outputs at all)
    indices = np.concatenate([p[0] for p in parts]) if parts else np.zeros(0, dtype=np.int64)
    uniq, first = np.unique(indices, return_index=True)  # first occurrence of each index, sorted by index
    if len(uniq) != n or (n and (uniq[0] != 0 or uniq[-1] != n - 1)):
        raise RuntimeError(f"distributed evaluation covered {len(uniq)} of {n} examples")
    n_out = len(parts[0][1]) if parts else 0
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
    batches, fillers = eval_batches(n, batch_size, dist.rank, dist.world_size)
    mine = np.concatenate(batches) if batches else np.zeros(0, dtype=np.int64)
    model.eval()
    chunks: list[list[np.ndarray]] = []
    if dist.is_main:
        log.info("evaluating %d examples on %d rank(s), %d per batch", n, dist.world_size, batch_size)
    t0 = last_log = time.perf_counter()
    bar = tqdm(total=len(mine), desc="evaluate", unit="ex", disable=not (dist.is_main and sys.stderr.isatty()))
    done = 0
    # a filler is the set's first batch again (a rank may have no batch of its own: 1 dev example, 2 ranks)
    for b, idx in enumerate(batches + [np.arange(min(n, batch_size))] * fillers):
        batch = {k: torch.from_numpy(np.ascontiguousarray(feats[k][idx])).long()
                 for k in ("input_ids", "token_type_ids", "attention_mask")}
        batch = to_device(trim_padding(batch) if trim else batch, dist.device)
        ctx = precision.autocast() if precision is not None else torch.autocast("cpu", enabled=False)
        with ctx:
            out = outputs(model(**batch))
        if b >= len(batches):  # a filler: run for the other ranks' collectives, its outputs dropped
            continue
        arrs = []
        for t in out:
            t = t.float().cpu().numpy()
            if per_token and t.ndim == 2 and t.shape[1] < L and t.shape[1] == batch["input_ids"].shape[1]:
                t = np.concatenate([t, np.full((t.shape[0], L - t.shape[1]), -10000.0, np.float32)], axis=1)
            arrs.append(t)
        chunks.append(arrs)
        bar.update(len(idx))
        done += len(idx)
        if dist.is_main and bar.disable and time.perf_counter() - last_log > 30:  # no terminal: a line now and then
            last_log = time.perf_counter()
            log.info("evaluated %d of %d examples of this rank (%.0f/s)", done, len(mine), done / (last_log - t0))
    bar.close()
    k = len(chunks[0]) if chunks else 0
    local = tuple(np.concatenate([c[j] for c in chunks]) for j in range(k))
    parts = gather_objects((mine, local))
    return merge_gathered(parts, n)
