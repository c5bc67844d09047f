"""Random pretraining batches with the real loader's contract, for engine tests and throughput checks.

Sample `i` of epoch `e` is a pure function of (seed, e, i); the partition is the one of
`bertrain.data.pretraining` (micro-batch m of rank r holds global samples [(m*W + r)*b, (m*W + r + 1)*b) of the
epoch's permutation), so the global batch of every optimizer step is the same set of samples for any world size,
and `state_dict` (global samples consumed) resumes on another world size.
"""
from __future__ import annotations

from typing import Any, Iterator

import torch

PAD, CLS, SEP, MASK = 0, 2, 3, 4
FIRST_WORD = 5


class SyntheticPretrainingLoader:
    """Deterministic random MLM+NSP micro-batches (no data files needed)."""

    def __init__(self, num_samples: int, micro_batch_size: int, rank: int = 0, world_size: int = 1, seed: int = 0,
                 max_seq_length: int = 32, max_predictions_per_seq: int = 5, vocab_size: int = 100,
                 short_last_rank: int = 0) -> None:
        if vocab_size <= FIRST_WORD:
            raise ValueError(f"synthetic data needs vocab_size > {FIRST_WORD}, got {vocab_size}")
        self.num_samples = num_samples
        self.b, self.rank, self.world = micro_batch_size, rank, world_size
        self.seed, self.seq, self.preds, self.vocab = seed, max_seq_length, max_predictions_per_seq, vocab_size
        # the last rank may be given fewer micro-batches, to prove that uneven data never hangs the loop
        self.short = short_last_rank if rank == world_size - 1 else 0
        self.epoch = 0
        self.next_micro = 0

    def __len__(self) -> int:
        return max(0, self.num_samples // (self.b * self.world) - self.short)

    def set_epoch(self, epoch: int) -> None:
        self.epoch, self.next_micro = epoch, 0

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "samples": self.next_micro * self.b * self.world}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        samples = int(state["samples"])
        if samples % (self.b * self.world):
            raise ValueError(f"cannot resume synthetic data at sample {samples} with micro-batch {self.b} x world "
                             f"{self.world}: not a micro-batch boundary")
        self.epoch, self.next_micro = int(state["epoch"]), samples // (self.b * self.world)

    def _sample(self, index: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        length = int(torch.randint(self.seq // 2, self.seq + 1, (), generator=g))
        ids = torch.randint(FIRST_WORD, self.vocab, (length,), generator=g)
        ids[0], ids[-1] = CLS, SEP
        split = max(2, length // 2)
        ids[split - 1] = SEP
        types = torch.zeros(self.seq, dtype=torch.long)
        types[split:length] = 1
        n = min(self.preds, max(1, round(0.15 * (length - 3))))
        candidates = torch.tensor([i for i in range(1, length - 1) if i != split - 1])
        pos = candidates[torch.randperm(len(candidates), generator=g)[:n]].sort().values
        labels = ids[pos].clone()
        ids[pos] = MASK
        input_ids = torch.zeros(self.seq, dtype=torch.long)
        input_ids[:length] = ids
        attention = torch.zeros(self.seq, dtype=torch.long)
        attention[:length] = 1
        positions = torch.zeros(self.preds, dtype=torch.long)
        positions[:n] = pos
        masked = torch.full((self.preds,), -100, dtype=torch.long)
        masked[:n] = labels
        return {"input_ids": input_ids, "token_type_ids": types, "attention_mask": attention,
                "masked_positions": positions, "masked_labels": masked,
                "next_sentence_labels": torch.randint(0, 2, (), generator=g)}

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        perm = torch.randperm(self.num_samples, generator=torch.Generator().manual_seed(self.seed + self.epoch))
        while self.next_micro < len(self):
            m = self.next_micro
            start = (m * self.world + self.rank) * self.b
            samples = [self._sample(int(perm[i])) for i in range(start, start + self.b)]
            self.next_micro = m + 1  # counted before the yield: state_dict() after a batch includes it
            yield {k: torch.stack([s[k] for s in samples]) for k in samples[0]}
