"""The shared rank partition (RankSampler), its resumable loaders (ArrayLoader, SyntheticPretrainingLoader): the
same samples per optimizer step for any split of the global batch, full coverage with wrap-padding, exact resume,
refused resumes."""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch

from bertrain.data.sampler import ArrayLoader, RankSampler
from bertrain.data.samples import SampleConfig
from bertrain.data.synthetic import SyntheticPretrainingLoader


def step_multisets(n: int, b: int, accumulation: int, world: int, epoch: int, drop_last: bool = True,
                   pad_multiple: int = 0) -> list[list[int]]:
    """Per optimizer step, the sorted sample ids of all micro-batches of all ranks."""
    per_rank = [list(RankSampler(n, b, r, world, seed=5, drop_last=drop_last, pad_multiple=pad_multiple)
                     .iter_epoch(epoch)) for r in range(world)]
    n_steps = len(per_rank[0]) // accumulation
    return [sorted(int(i) for r in range(world) for m in range(s * accumulation, (s + 1) * accumulation)
                   for i in per_rank[r][m]) for s in range(n_steps)]


@pytest.mark.parametrize("drop_last", [True, False])
def test_one_by_four_equals_two_by_two_equals_four_by_one(drop_last):
    n, b = 203, 3  # global batch 12; 203 is not a multiple of it
    for epoch in (0, 1):
        one = step_multisets(n, b, 4, 1, epoch, drop_last, pad_multiple=12)
        two = step_multisets(n, b, 2, 2, epoch, drop_last, pad_multiple=12)
        four = step_multisets(n, b, 1, 4, epoch, drop_last, pad_multiple=12)
        assert one == two == four
        assert len(one) == (n // 12 if drop_last else -(-n // 12))
        # the micro-batch size may change too, as long as the global batch does not
        assert step_multisets(n, 6, 2, 1, epoch, drop_last, pad_multiple=12) == one
        assert step_multisets(n, 1, 3, 4, epoch, drop_last, pad_multiple=12) == one
    assert step_multisets(n, b, 4, 1, 0) != step_multisets(n, b, 4, 1, 1)  # epochs are shuffled differently


def test_wrap_padding_covers_every_example_each_epoch():
    n, b, world = 50, 3, 2
    features = {"x": np.arange(n), "y": np.arange(n, dtype=np.float32) / 2}
    loaders = [ArrayLoader(features, b, r, world, seed=1, pad_multiple=12) for r in range(world)]
    assert len({len(l) for l in loaders}) == 1 and len(loaders[0]) * b * world == 60  # 50 padded to 5 x 12
    for epoch in range(3):
        seen: Counter = Counter()
        for l in loaders:
            assert l.state_dict()["epoch"] == epoch
            for batch in l:
                assert batch["x"].dtype == torch.int64 and batch["y"].dtype == torch.float32
                assert torch.equal(batch["y"], batch["x"].float() / 2)  # the arrays stay aligned
                seen.update(batch["x"].tolist())
        assert set(seen) == set(range(n))  # no example dropped
        assert sum(seen.values()) == 60 and max(seen.values()) == 2  # the 10 extra are repeats
    with pytest.raises(ValueError, match="not a multiple"):
        RankSampler(n, b, 0, world, drop_last=False, pad_multiple=10)


def test_resume_mid_epoch_gives_the_same_batches():
    features = {"x": np.arange(97), "y": np.random.default_rng(0).random((97, 4))}
    straight = ArrayLoader(features, 4, seed=3)
    reference = list(straight) + [b for _, b in zip(range(6), straight)]  # epoch 0 (25 batches), then 1
    first = ArrayLoader(features, 4, seed=3)
    it = iter(first)
    for _ in range(9):
        next(it)
    state = first.state_dict()
    # and the features' fingerprint, compared on resume (tests/test_audit_inputs.py)
    assert state == {"epoch": 0, "samples_consumed": 36, "seed": 3, "num_samples": 97, "data": first.data_identity()}
    resumed = ArrayLoader(features, 4, seed=3)
    resumed.load_state_dict(state)
    got = list(resumed) + [b for _, b in zip(range(6), resumed)]  # the rest of epoch 0, then epoch 1
    assert len(got) == 22 == len(reference[9:])
    for have, want in zip(got, reference[9:]):
        assert have.keys() == want.keys() and all(torch.equal(have[k], want[k]) for k in want)
    # the same position on 2 ranks x 2 (same global batch): the global micro-steps continue where they stopped
    halves = [ArrayLoader(features, 2, r, 2, seed=3) for r in range(2)]
    for h in halves:
        h.load_state_dict(state)
    rank_batches = [[b for _, b in zip(range(3), h)] for h in halves]
    for m in range(3):
        assert torch.equal(torch.cat([rank_batches[0][m]["x"], rank_batches[1][m]["x"]]), reference[9 + m]["x"])


def test_load_state_dict_refuses_other_seed_data_or_position():
    loader = ArrayLoader({"x": np.arange(40)}, 4, 0, 2, seed=7)
    good = {"epoch": 1, "samples_consumed": 16, "seed": 7, "num_samples": 40, "data": loader.data_identity()}
    with pytest.raises(ValueError, match="changed since the run started"):  # the same count, other features
        loader.load_state_dict({**good, "data": ArrayLoader({"x": np.arange(1, 41)}, 4, 0, 2, seed=7).data_identity()})
    with pytest.raises(ValueError, match="seed"):
        loader.load_state_dict({**good, "seed": 8})
    with pytest.raises(ValueError, match="samples per epoch"):
        loader.load_state_dict({**good, "num_samples": 41})
    with pytest.raises(ValueError, match="not a multiple"):
        loader.load_state_dict({**good, "samples_consumed": 12})
    assert loader.state_dict() == {**good, "epoch": 0, "samples_consumed": 0}  # a refused state changes nothing
    loader.load_state_dict(good)
    assert loader.state_dict() == good


def test_array_loader_refuses_arrays_of_different_lengths():
    with pytest.raises(ValueError, match="different lengths"):
        ArrayLoader({"x": np.arange(10), "y": np.arange(9)}, 2)


@pytest.mark.parametrize("prob", [0.1, 0.15, 0.4])
def test_synthetic_masked_count_follows_masked_lm_prob(prob):
    sample = SampleConfig(max_seq_length=64, max_predictions_per_seq=30, masked_lm_prob=prob)
    loader = SyntheticPretrainingLoader(256, 32, seed=1, sample=sample)
    batches = list(loader)
    labels = torch.cat([b["masked_labels"] for b in batches])
    attention = torch.cat([b["attention_mask"] for b in batches])
    masked, length = (labels != -100).sum(1), attention.sum(1)
    expected = torch.clamp(torch.round(prob * (length - 3).double()).long(), 1, 30)
    assert torch.equal(masked, expected)
    frac = masked.sum().item() / (length - 3).sum().item()
    assert abs(frac - prob) < 0.02, frac


def test_synthetic_samples_depend_on_seed_and_index_only_and_last_rank_can_run_short():
    sample = SampleConfig(max_seq_length=16, max_predictions_per_seq=3)
    one = SyntheticPretrainingLoader(64, 4, 0, 1, seed=2, sample=sample)
    two = [SyntheticPretrainingLoader(64, 2, r, 2, seed=2, sample=sample) for r in range(2)]
    ref = [b["input_ids"] for b in one]
    per_rank = [[b["input_ids"] for b in l] for l in two]
    assert all(torch.equal(torch.cat([r0, r1]), want) for r0, r1, want in zip(*per_rank, ref))
    short = [SyntheticPretrainingLoader(64, 2, r, 2, seed=2, sample=sample, short_last_rank=3) for r in range(2)]
    assert [len(l) for l in short] == [16, 13]
    got = [[b["input_ids"] for b in l] for l in short]
    assert [len(g) for g in got] == [16, 13]
    assert all(torch.equal(a, b) for a, b in zip(got[1], per_rank[1]))  # the same batches, the last ones missing
    assert all(l.state_dict()["epoch"] == 1 for l in short)  # both ranks moved on to the next epoch
