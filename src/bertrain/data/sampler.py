"""The one rank partition of every training loader (pretraining, fine-tuning, synthetic) and its resumable loader.

An epoch's global order is a seeded permutation of the samples, a pure function of (seed, epoch). Micro-batch `m`
of rank `r` (world size `W`, micro-batch `b`) holds global positions `[(m*W + r)*b, (m*W + r + 1)*b)` of it. So
the `k` micro-steps of one optimizer step hold positions `[s*G, (s+1)*G)` with `G = b*k*W` the global batch,
whatever the split of `G` into `b`, `k` and `W`: every optimizer step sees the same samples on 1 process x 4
micro-steps, 2 x 2 or 4 x 1, and a resume needs only the number of global samples consumed.

Every rank gets the same number of micro-batches per epoch (`len(sampler)`): with `drop_last` the tail that does
not fill `b*W` is dropped; otherwise the order wraps around to its start until it fills a multiple of
`pad_multiple` (at least `b*W`; fine-tuning passes the global batch so that every example is seen each epoch,
as `DistributedSampler` pads).
"""
from __future__ import annotations

import math
from typing import Any, Callable, Iterable, Iterator

import numpy as np
import torch


def epoch_permutation(num_samples: int, seed: int, epoch: int) -> np.ndarray:
    """The global order of sample ids in `epoch`: `Generator.permutation(num_samples)`'s order, held in the smallest
    unsigned type that fits (`order_dtype`). Every rank holds the whole order, each epoch: int64 took 8 bytes per
    sample (1.4 GB per rank for Wikipedia + BookCorpus static instances, dupe 5); shuffling uint32 ids in place
    draws the same random numbers and gives the same order."""
    order = np.arange(num_samples, dtype=order_dtype(num_samples))
    np.random.default_rng([seed, epoch, 0x10AD]).shuffle(order)
    return order


def order_dtype(num_samples: int) -> np.dtype:
    """uint32 while every sample id fits (< 2**32), else int64."""
    return np.dtype(np.uint32) if num_samples <= 1 << 32 else np.dtype(np.int64)


class RankSampler:
    """Sample ids of each micro-batch of one rank (see the module docstring)."""

    def __init__(self, num_samples: int, micro_batch_size: int, rank: int = 0, world_size: int = 1,
                 seed: int = 12345, drop_last: bool = True, pad_multiple: int = 0) -> None:
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world size {world_size}")
        self.num_samples, self.b, self.rank, self.world, self.seed = num_samples, micro_batch_size, rank, \
            world_size, seed
        self.per_micro_step = micro_batch_size * world_size
        """Global samples consumed by one micro-step of all ranks."""
        if drop_last:
            self.micro_steps = num_samples // self.per_micro_step
        else:
            multiple = max(pad_multiple, self.per_micro_step)
            if multiple % self.per_micro_step:
                raise ValueError(f"pad_multiple {pad_multiple} is not a multiple of micro batch x world size "
                                 f"({self.per_micro_step})")
            self.micro_steps = math.ceil(num_samples / multiple) * multiple // self.per_micro_step
        if self.micro_steps == 0:
            raise ValueError(f"{num_samples} samples are fewer than one global micro-batch ({self.b} x {self.world} "
                             "ranks): lower config key 'train.micro_batch_size', use fewer ranks, or add data")

    def __len__(self) -> int:
        """Micro-batches per rank per epoch (the same on every rank)."""
        return self.micro_steps

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The epoch's global order, wrapped or cut to exactly `len(self) * b * W` positions."""
        order = epoch_permutation(self.num_samples, self.seed, epoch)
        need = self.micro_steps * self.per_micro_step
        if need > len(order):
            order = order[np.arange(need) % len(order)]
        return order[:need]

    def iter_epoch(self, epoch: int, start: int = 0) -> Iterator[np.ndarray]:
        """This rank's micro-batches of `epoch` from micro-step `start` on."""
        order = self.epoch_order(epoch)
        for m in range(start, self.micro_steps):
            lo = (m * self.world + self.rank) * self.b
            yield order[lo:lo + self.b]


class ResumableLoader:
    """Iterates one rank's micro-batches epoch after epoch; `state_dict` is the global position.

    `fetch(epoch, ids) -> batch dict` builds a micro-batch. Iterating runs from the current position to the end
    of the current epoch, then moves to the next epoch (a new `iter()` starts it). `state_dict()` =
    {epoch, samples consumed (global), seed, num_samples}; `load_state_dict` accepts a state saved under any world
    size as long as the consumed count is a multiple of the new `b*W` (true at optimizer-step boundaries when the
    global batch is unchanged). `batches(items)` may be overridden to build batches elsewhere (worker processes).
    """

    def __init__(self, sampler: RankSampler, fetch: Callable[[int, np.ndarray], dict[str, torch.Tensor]]) -> None:
        self.sampler = sampler
        self.fetch = fetch
        self.epoch = 0
        self.consumed = 0  # global samples consumed in the current epoch

    def __len__(self) -> int:
        return len(self.sampler)

    @property
    def seed(self) -> int:
        return self.sampler.seed

    def set_epoch(self, epoch: int) -> None:
        """Jump to the start of `epoch` (no-op if already in it, so a resumed position is kept)."""
        if epoch != self.epoch:
            self.epoch, self.consumed = epoch, 0

    def batches(self, items: Iterable[tuple[int, np.ndarray]]) -> Iterator[dict[str, torch.Tensor]]:
        return (self.fetch(e, ids) for e, ids in items)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        per_step = self.sampler.per_micro_step
        epoch = self.epoch
        items = ((epoch, ids) for ids in self.sampler.iter_epoch(epoch, self.consumed // per_step))
        for batch in self.batches(items):
            self.consumed += per_step  # counted before the yield: state_dict() after a batch includes it
            yield batch
        if self.epoch == epoch and self.consumed >= len(self.sampler) * per_step:
            self.epoch, self.consumed = epoch + 1, 0

    data_name = "data.prepared"
    """How the errors of `load_state_dict` name the input that the samples come from."""
    way_back = ""
    """Where the data the run started with may still be (said in `load_state_dict`'s error)."""

    def data_identity(self) -> str | None:
        """A cheap fingerprint of the samples' content (None: unknown): recorded in `state_dict` and compared on
        resume, since the same number of samples does not mean the same data (an input edited between a run's start
        and its resume, or re-prepared in place, trained silently on other rows)."""
        return None

    def state_dict(self) -> dict[str, Any]:
        state = {"epoch": self.epoch, "samples_consumed": self.consumed, "seed": self.sampler.seed,
                 "num_samples": self.sampler.num_samples}
        identity = self.data_identity()
        return state if identity is None else {**state, "data": identity}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        s = self.sampler
        if state.get("seed", s.seed) != s.seed:
            raise ValueError(f"loader state was saved with seed {state['seed']}, this loader uses {s.seed}")
        way_out = (f"resume with the data the run started with{self.way_back}, or start a new run (--overwrite)")
        if state.get("num_samples", s.num_samples) != s.num_samples:
            raise ValueError(f"the checkpoint's data loader was saved for {state['num_samples']} samples per epoch, "
                             f"this data has {s.num_samples}: it is different data (was {self.data_name} "
                             f"re-prepared or changed?) or a different sample config; {way_out}")
        saved, identity = state.get("data"), self.data_identity()
        if saved is not None and identity is not None and saved != identity:
            raise ValueError(f"{self.data_name} changed since the run started: the checkpoint was trained on samples "
                             f"with fingerprint {saved}, the same number of samples now has {identity} (edited, "
                             f"replaced or re-prepared in place?), so a resume would train on other data than a "
                             f"straight run; {way_out}")
        consumed = int(state["samples_consumed"])
        if consumed % s.per_micro_step:
            raise ValueError(f"cannot resume at {consumed} consumed samples with {s.world} ranks x micro batch "
                             f"{s.b}: not a multiple of {s.per_micro_step} (keep the global batch size when "
                             "resuming)")
        self.epoch, self.consumed = int(state["epoch"]), consumed


class ArrayLoader(ResumableLoader):
    """Micro-batches of in-memory feature arrays (fine-tuning): `arrays[key][ids]` as tensors (integers as int64).

    Pads each epoch by wrapping to a multiple of `pad_multiple` (the global batch), so no example is dropped.
    """

    def __init__(self, arrays: dict[str, np.ndarray], micro_batch_size: int, rank: int = 0, world_size: int = 1,
                 seed: int = 12345, pad_multiple: int = 0) -> None:
        lengths = {len(a) for a in arrays.values()}
        if len(lengths) != 1:  # data, not an invariant: an error that `python -O` keeps
            raise ValueError(f"feature arrays of different lengths (or none): {lengths}")
        self.arrays = arrays
        sampler = RankSampler(lengths.pop(), micro_batch_size, rank, world_size, seed, drop_last=False,
                              pad_multiple=pad_multiple)
        super().__init__(sampler, self._take)
        self._identity: str | None = None

    def data_identity(self) -> str:
        """The blake2b of the feature arrays (names, dtypes, shapes, bytes), computed once: fine-tuning features are
        in memory and small (MNLI's: about 0.5 s)."""
        if self._identity is None:
            import hashlib

            h = hashlib.blake2b(digest_size=8)
            for k in sorted(self.arrays):
                a = np.ascontiguousarray(self.arrays[k])
                h.update(f"{k}:{a.dtype.str}:{a.shape};".encode())
                h.update(a)
            self._identity = h.hexdigest()
        return self._identity

    def _take(self, epoch: int, ids: np.ndarray) -> dict[str, torch.Tensor]:
        out = {}
        for k, a in self.arrays.items():
            t = torch.from_numpy(np.ascontiguousarray(a[ids]))
            out[k] = t.long() if not t.is_floating_point() else t
        return out
