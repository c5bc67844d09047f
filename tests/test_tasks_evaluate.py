"""Sharded evaluation (tasks/evaluate.py): every example scored once, by exactly one rank, whatever the world size."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from distributed import spawn

from bertrain.tasks.evaluate import eval_batches, merge_gathered


@pytest.mark.parametrize("n, world", [(5, 2), (7, 3), (2, 4), (8, 4), (1, 1)])
def test_merge_gathered_puts_every_rank_s_batches_in_order(n, world):
    split = [eval_batches(n, 2, r, world) for r in range(world)]
    assert len({len(b) + fill for b, fill in split}) == 1  # as many passes on every rank (collectives need it)
    shards = [np.concatenate(b) if b else np.zeros(0, dtype=np.int64) for b, _ in split]
    parts = [(s, (s * 10.0, np.stack([s, s], axis=1))) for s in shards]
    a, b = merge_gathered(parts, n)
    assert np.array_equal(a, np.arange(n) * 10.0) and b.shape == (n, 2)
    with pytest.raises(RuntimeError, match="covered"):  # a rank's part lost, or a wrong total
        merge_gathered(parts[:-1] if world > 1 else parts, n + 1)


class _EchoModel(torch.nn.Module):
    """Outputs each example's first token id: lets the test see exactly which example produced which output."""

    def forward(self, input_ids, token_type_ids=None, attention_mask=None):
        class Out:
            logits = input_ids[:, :1].float() * 1.0
        return Out()


def _gather_worker(rank: int, world: int, n: int, out_dir: str) -> None:
    from bertrain.tasks.evaluate import distributed_forward
    from bertrain.train.distributed import cleanup, init_distributed

    dist = init_distributed()
    try:
        ids = np.arange(n, dtype=np.int64)[:, None].repeat(4, axis=1) + 100
        feats = {"input_ids": ids, "token_type_ids": np.zeros_like(ids), "attention_mask": np.ones_like(ids)}
        (out,) = distributed_forward(_EchoModel(), feats, lambda o: (o.logits,), dist, batch_size=2)
        np.save(Path(out_dir) / f"rank{rank}.npy", out)
    finally:
        cleanup()


@pytest.mark.slow
def test_distributed_eval_two_processes_no_duplicates(tmp_path):
    n = 7  # not a multiple of the world size: rank 1 has a batch fewer and runs a filler
    spawn(_gather_worker, 2, n, str(tmp_path))
    for r in range(2):
        out = np.load(tmp_path / f"rank{r}.npy")
        assert out[:, 0].tolist() == [100.0 + i for i in range(n)]
