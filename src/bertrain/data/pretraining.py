"""Pretraining batches for the trainer: `PretrainingDataset` (samples of a prepared folder) and its loader, and
`HeldoutEvalSet` (the fixed evaluation samples of the folder's held-out documents).

A sample is built by `bertrain.data.samples` (dynamic: at training time; static: read from the instances `prepare`
materialised) and a micro-batch is the dict of ARCHITECTURE.md ("Pretraining batches"). `PretrainingLoader` is the
shared rank partition and resumable position of `bertrain.data.sampler`, with the batches optionally built in
DataLoader worker processes.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path
from typing import Any, Iterable, Iterator, Literal

import numpy as np
import torch

from bertrain.data.sampler import RankSampler, ResumableLoader
from bertrain.data.samples import (NSP_NONE, ROW_HEADER, InstanceBuilder, SampleConfig, find_static,
                                   open_instances)
from bertrain.data.store import TokenStore, heldout_status, read_store_meta
from bertrain.data.tokenizer import check_tokenizer_identity, tokenizer_identity

Masking = Literal["static", "dynamic"]
EVAL_SEED = 20251
"""The default seed of the held-out evaluation samples (blocks, masks, NSP pairs): not a training seed's default."""


def rows_to_batch(rows: np.ndarray, sample: SampleConfig) -> dict[str, torch.Tensor]:
    """Instance rows -> the batch dict of ARCHITECTURE.md ("Pretraining batches")."""
    T, P = sample.max_seq_length, sample.max_predictions_per_seq
    rows = rows.astype(np.int64, copy=False)
    total, a_len, nsp, n_pred = rows[:, 0], rows[:, 1], rows[:, 2], rows[:, 3]
    pos = np.arange(T)[None, :]
    attention = pos < total[:, None]
    types = (pos >= a_len[:, None]) & attention
    labels = rows[:, ROW_HEADER + T + P:].copy()
    labels[np.arange(P)[None, :] >= n_pred[:, None]] = -100
    return {
        "input_ids": torch.from_numpy(np.ascontiguousarray(rows[:, ROW_HEADER: ROW_HEADER + T])),
        "token_type_ids": torch.from_numpy(types.astype(np.int64)),
        "attention_mask": torch.from_numpy(attention.astype(np.int64)),
        "masked_positions": torch.from_numpy(np.ascontiguousarray(rows[:, ROW_HEADER + T: ROW_HEADER + T + P])),
        "masked_labels": torch.from_numpy(labels),
        "next_sentence_labels": torch.from_numpy(np.where(nsp == NSP_NONE, -100, nsp)),
    }


def _check_tokenizer(expected: str, vocab_file: str | os.PathLike, do_lower_case: bool, where: str) -> None:
    """`check_tokenizer_identity`, and where only the casing differs (the same vocab.txt) an error that says so:
    re-running prepare with the model's vocab file, the general advice, would change nothing."""
    if tokenizer_identity(vocab_file, not do_lower_case) == expected:
        was, now = ("uncased", "true") if not do_lower_case else ("cased", "false")
        raise ValueError(f"tokenizer mismatch: {where} was prepared {was} with {vocab_file}, but do_lower_case is "
                         f"{str(do_lower_case).lower()} (pretraining: config key 'data.do_lower_case'): set it to "
                         f"{now}, or prepare the data again with the casing you want")
    check_tokenizer_identity(expected, vocab_file, do_lower_case, where)


class PretrainingDataset:
    """Samples of a prepared folder. `len(ds)` samples per epoch; `get_batch(epoch, sample_ids)` -> batch dict.

    masking='dynamic': sample `i` of epoch `e` is block `i` built and masked with keys (seed, e, i); any `sample`
    settings work on one token store. masking='static': sample `i` is the materialised instance `i`
    (dupe_factor x blocks), which `prepare --masking static` must have written for the same `sample` and `seed`;
    `epoch` is ignored. Picklable (memory maps are reopened lazily), so it works in DataLoader workers.
    """

    def __init__(self, data_dir: str | os.PathLike, sample: SampleConfig = SampleConfig(),
                 masking: Masking = "dynamic", seed: int = 12345, verify: bool = True):
        if masking not in ("static", "dynamic"):
            raise ValueError(f"masking must be 'static' or 'dynamic', got {masking!r}")
        self.data_dir = Path(data_dir)
        self.masking = masking
        self.sample = sample
        self.seed = seed
        self.meta = read_store_meta(self.data_dir)
        self.tokenizer_identity: str = self.meta["tokenizer_identity"]
        self._verify = verify
        self._store: TokenStore | None = None
        self._builder: InstanceBuilder | None = None
        self._rows: np.ndarray | None = None
        self._static_meta: dict[str, Any] = {}
        if masking == "static":
            self.static_dir, smeta = find_static(self.data_dir, sample, seed)
            self._len = int(smeta["num_instances"])
            self._static_meta = smeta
        else:
            self._len = len(self._get_builder().blocks)
        if self._len == 0:
            raise ValueError(f"{self.data_dir} yields no samples for {sample} (is the corpus empty?)")

    def __len__(self) -> int:
        return self._len

    def _get_builder(self) -> InstanceBuilder:
        if self._builder is None:
            self._store = TokenStore(self.data_dir, verify=self._verify)
            self._verify = False  # checked once per process
            self._builder = InstanceBuilder(self._store, self.sample, self.seed)
        return self._builder

    def _get_rows(self) -> np.ndarray:
        if self._rows is None:
            smeta = json.loads((self.static_dir / "instances.json").read_text(encoding="utf-8"))
            self._rows = open_instances(self.static_dir / "instances.bin", smeta)
        return self._rows

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_store"] = state["_builder"] = state["_rows"] = None
        return state

    def get_rows(self, epoch: int, sample_ids: np.ndarray) -> np.ndarray:
        sample_ids = np.asarray(sample_ids, dtype=np.int64)
        if self.masking == "static":
            return np.asarray(self._get_rows()[sample_ids], dtype=np.int64)
        return self._get_builder().build(epoch, sample_ids)

    def get_batch(self, epoch: int, sample_ids: np.ndarray) -> dict[str, torch.Tensor]:
        return rows_to_batch(self.get_rows(epoch, sample_ids), self.sample)

    def check_tokenizer(self, vocab_file: str | os.PathLike, do_lower_case: bool) -> None:
        """Raise `ValueError` unless the data was tokenized with `vocab_file` and this casing."""
        _check_tokenizer(self.tokenizer_identity, vocab_file, do_lower_case, str(self.data_dir))

    def identity(self) -> str:
        """A fingerprint of the samples' content from what store.json (and a static folder's instances.json)
        records: the tokenizer and each shard's counts, size and CRC32 (no file is read; the folder's path is not in
        it, so a moved store is the same data). The loader's checkpoint state holds it (`ResumableLoader`)."""
        shards = [[e.get(k) for k in ("n_tokens", "n_sentences", "n_documents", "bytes", "crc32")]
                  for e in self.meta["shards"]]
        static = {k: self._static_meta.get(k) for k in ("num_instances", "row_width", "dtype", "dupe_factor",
                                                        "sample_config")} if self.masking == "static" else None
        record = json.dumps({"tokenizer": self.tokenizer_identity, "shards": shards, "static": static},
                            sort_keys=True)
        return hashlib.sha256(record.encode()).hexdigest()[:16]


class _BatchFetcher:
    """Map-style adapter for torch's DataLoader: item = (epoch, sample ids) -> batch dict (built in workers)."""

    def __init__(self, ds: PretrainingDataset):
        self.ds = ds

    def __len__(self) -> int:  # not used for sampling (we pass our own sampler)
        return len(self.ds)

    def __getitem__(self, item: tuple[int, np.ndarray]) -> dict[str, torch.Tensor]:
        epoch, ids = item
        return self.ds.get_batch(epoch, ids)


class _Items:
    """A one-pass iterable of (epoch, sample ids) as DataLoader's sampler: its main process takes the next item only
    when a worker needs one."""

    def __init__(self, items: Iterable[tuple[int, np.ndarray]]):
        self.items = items

    def __iter__(self) -> Iterator[tuple[int, np.ndarray]]:
        return iter(self.items)


class PretrainingLoader(ResumableLoader):
    """Distributed, resumable micro-batch loader over a `PretrainingDataset`.

    The rank partition, epochs and `state_dict` are those of `bertrain.data.sampler` (`drop_last=False` wraps the
    epoch's order around to fill the last global micro-batch). `num_workers > 0` builds the micro-batches in that
    many DataLoader worker processes, in the same order.
    """

    def __init__(self, dataset: PretrainingDataset, micro_batch_size: int, rank: int = 0, world_size: int = 1,
                 seed: int = 12345, num_workers: int = 0, drop_last: bool = True, prefetch_factor: int = 2):
        sampler = RankSampler(len(dataset), micro_batch_size, rank, world_size, seed, drop_last)
        super().__init__(sampler, dataset.get_batch)
        self.ds = dataset
        self.num_workers = num_workers
        self.prefetch_factor = prefetch_factor
        self.data_name = f"data.prepared {dataset.data_dir}"
        self.way_back = (f" (a store replaced by `bertrain prepare --overwrite` is kept as "
                         f"{dataset.data_dir.name}.replaced-<time>)")

    def data_identity(self) -> str:
        return self.ds.identity()

    def batches(self, items: Iterable[tuple[int, np.ndarray]]) -> Iterator[dict[str, torch.Tensor]]:
        if self.num_workers == 0:
            return super().batches(items)
        # The items stay a lazy iterable: list(items) built every micro-batch of the rest of the epoch up front, at
        # each epoch's start (1.25M items, ~0.5 GB and ~8 s for 40M samples at micro-batch 32 on one rank).
        dl = torch.utils.data.DataLoader(_BatchFetcher(self.ds), batch_size=None, sampler=_Items(items),
                                         num_workers=self.num_workers, prefetch_factor=self.prefetch_factor,
                                         multiprocessing_context="spawn" if os.name != "posix" else None)
        return iter(dl)


class HeldoutEvalSet:
    """The fixed MLM + NSP evaluation samples of a prepared folder's held-out documents (`prepare` sets them aside
    in DIR/heldout; never trained on), as the batch dicts of the training loader.

    Built once by the dynamic `InstanceBuilder` on the held-out store, epoch 0, with `eval_seed` for the blocks,
    the masks and the NSP pairs: a pure function of (held-out store, `sample`, `eval_seed`, `max_samples`), so a
    loss on it at step N is comparable across steps, runs, world sizes and resumes; it does not depend on the
    training seed, epoch or masking mode. `max_samples` blocks evenly spaced over the held-out documents (all of
    them when None or fewer). A folder without a held-out set is a `ValueError` saying why (check first with
    `store.heldout_status(data_dir)`, which a trainer turns into a warning).

    `batches(b, rank, world_size)`: the set is cut into micro-batches of `b` rows, the same ones whatever the world
    size (so each micro-batch's sums are the same bits on 1 rank or on 8); rank r of W takes micro-batches r, r + W,
    r + 2W, ... and yields `(index, batch)`; a rank with one micro-batch fewer than the others runs a filler batch
    (index -1, every label -100) so every rank runs the same number of forward passes (FSDP needs it). Summing
    every micro-batch's sums in index order gives the same number at every world size.
    """

    def __init__(self, data_dir: str | os.PathLike, sample: SampleConfig = SampleConfig(),
                 eval_seed: int = EVAL_SEED, max_samples: int | None = None):
        status = heldout_status(data_dir)
        if status.dir is None:
            raise ValueError(status.reason)
        if max_samples is not None and max_samples < 1:
            raise ValueError(f"max_samples must be >= 1 or None, got {max_samples}")
        self.sample = sample
        self.eval_seed = eval_seed
        self.dir = status.dir
        self.record = status.record
        builder = InstanceBuilder(TokenStore(status.dir), sample, eval_seed)
        self.tokenizer_identity: str = builder.store.meta["tokenizer_identity"]
        n = builder.n_blocks
        m = n if max_samples is None else min(max_samples, n)
        self.block_ids = np.arange(m, dtype=np.int64) * n // m  # distinct, spread over every held-out document
        self.rows = builder.build(0, self.block_ids)

    def __len__(self) -> int:
        return len(self.rows)

    def rank_batches(self, micro_batch_size: int, rank: int, world_size: int) -> list[int]:
        """Indices of the micro-batches rank `rank` of `world_size` evaluates (see the class docstring)."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, {world_size})")
        return list(range(rank, self.num_batches(micro_batch_size), world_size))

    def num_batches(self, micro_batch_size: int) -> int:
        return math.ceil(len(self) / micro_batch_size)

    def batches(self, micro_batch_size: int, rank: int = 0,
                world_size: int = 1) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
        """Rank `rank`'s `(index, micro-batch)` pairs, then fillers (index -1): as many on every rank."""
        b = micro_batch_size
        mine = self.rank_batches(b, rank, world_size)
        for k in mine:
            yield k, rows_to_batch(self.rows[k * b: (k + 1) * b], self.sample)
        for _ in range(math.ceil(self.num_batches(b) / world_size) - len(mine)):
            filler = self.rows[:1].copy()
            filler[:, 2], filler[:, 3] = NSP_NONE, 0  # no NSP label, no masked prediction: labels -100
            yield -1, rows_to_batch(filler, self.sample)

    def check_tokenizer(self, vocab_file: str | os.PathLike, do_lower_case: bool) -> None:
        """Raise `ValueError` unless the held-out store was tokenized with `vocab_file` and this casing."""
        _check_tokenizer(self.tokenizer_identity, vocab_file, do_lower_case, str(self.dir))
