"""Random pretraining batches with the real loader's contract, for engine tests and throughput checks.

Sample `i` is a pure function of (seed, i); the partition, epochs and `state_dict` are the shared ones of
`bertrain.data.sampler`, so the global batch of every optimizer step is the same set of samples for any world size,
and a state resumes on another world size.
"""
from __future__ import annotations

import numpy as np
import torch

from bertrain.data.sampler import RankSampler, ResumableLoader
from bertrain.data.samples import SampleConfig

CLS, SEP, MASK = 2, 3, 4  # the ids of the test vocabulary; 0 ([PAD]) fills the rest
FIRST_WORD = 5


class SyntheticPretrainingLoader(ResumableLoader):
    """Deterministic random MLM+NSP micro-batches (no data files needed). Of `sample`, the lengths and
    `masked_lm_prob` apply (every sample is an NSP pair, masked token by token).

    `short_last_rank`: the last rank gets that many micro-batches fewer per epoch (it stops early in the same
    order), to prove that uneven data never hangs the trainer.
    """

    def __init__(self, num_samples: int, micro_batch_size: int, rank: int = 0, world_size: int = 1, seed: int = 0,
                 sample: SampleConfig = SampleConfig(max_seq_length=32, max_predictions_per_seq=5),
                 vocab_size: int = 100, short_last_rank: int = 0) -> None:
        if vocab_size <= FIRST_WORD:
            raise ValueError(f"synthetic data needs vocab_size > {FIRST_WORD}, got {vocab_size}")
        sampler = RankSampler(num_samples, micro_batch_size, rank, world_size, seed, drop_last=True)
        if rank == world_size - 1:
            # Fewer micro-steps for this rank only: the earlier micro-batches keep their positions (they are a
            # prefix of the epoch's order), only the last ones go.
            sampler.micro_steps = max(0, sampler.micro_steps - short_last_rank)
        super().__init__(sampler, self._batch)
        self.sample, self.vocab = sample, vocab_size

    def _batch(self, epoch: int, ids: np.ndarray) -> dict[str, torch.Tensor]:
        samples = [self._sample(int(i)) for i in ids]
        return {k: torch.stack([s[k] for s in samples]) for k in samples[0]}

    def _sample(self, index: int) -> dict[str, torch.Tensor]:
        seq, preds = self.sample.max_seq_length, self.sample.max_predictions_per_seq
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        length = int(torch.randint(seq // 2, seq + 1, (), generator=g))
        ids = torch.randint(FIRST_WORD, self.vocab, (length,), generator=g)
        ids[0], ids[-1] = CLS, SEP
        split = max(2, length // 2)
        ids[split - 1] = SEP
        types = torch.zeros(seq, dtype=torch.long)
        types[split:length] = 1
        n = min(preds, max(1, round(self.sample.masked_lm_prob * (length - 3))))
        candidates = torch.tensor([i for i in range(1, length - 1) if i != split - 1])
        pos = candidates[torch.randperm(len(candidates), generator=g)[:n]].sort().values
        labels = ids[pos].clone()
        ids[pos] = MASK
        input_ids = torch.zeros(seq, dtype=torch.long)
        input_ids[:length] = ids
        attention = torch.zeros(seq, dtype=torch.long)
        attention[:length] = 1
        positions = torch.zeros(preds, dtype=torch.long)
        positions[:n] = pos
        masked = torch.full((preds,), -100, dtype=torch.long)
        masked[:n] = labels
        return {"input_ids": input_ids, "token_type_ids": types, "attention_mask": attention,
                "masked_positions": positions, "masked_labels": masked,
                "next_sentence_labels": torch.randint(0, 2, (), generator=g)}
