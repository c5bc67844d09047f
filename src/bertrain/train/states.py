"""What a checkpoint holds, registered once: a `{name: Stateful}` map that the save and the restore both walk
(as torchtitan's `CheckpointManager.states`).

`Trainer.fit` builds the map with `training_states`: model, optimizer, scheduler, precision (the fp16 loss scaler),
loader (the data position), rng (every rank's generators), threads (the CPU thread count), state (step, epoch,
samples), clock (training time, for a time budget), trackers (the tracker run ids: a resume continues them), eval (the evaluation history, best step and early-stopping count: `train/evaluation.EvalHistory`), meter (the log interval's partial sums: `train/trainer.Meter`). A new piece of run state is one more entry here — nothing in the save or the restore changes.

Where each entry lives in a checkpoint folder (`train/checkpoint.py`): the two entries holding big tensors,
`TENSOR_STATES`, are stored by the checkpoint format (the model as an HF folder and the optimizer in
`train_state.pt` under DDP; both as DCP shards under FSDP: `train/dcp.py`); every other entry is pickled in
`train_state.pt` under its own name. An entry missing from a checkpoint (written before the entry existed) keeps
the value it was built with, and the log says so.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import torch
from torch import nn

from bertrain.train.checkpoint import rng_state, seed_rank_rng, set_rng_state
from bertrain.train.distributed import DistInfo, gather_objects

log = logging.getLogger(__name__)

TENSOR_STATES = ("model", "optimizer")
"""Entries stored by the checkpoint format (HF folder / DCP shards), not pickled in train_state.pt."""


class Stateful(Protocol):
    def state_dict(self) -> Any: ...
    def load_state_dict(self, state: Any) -> None: ...


@dataclass
class TrainState:
    """Progress counters saved in every checkpoint."""
    step: int = 0
    """Optimizer steps done (including fp16-skipped ones: their data was consumed)."""
    epoch: int = 0
    samples: int = 0
    """Global samples consumed by completed steps."""
    skipped_steps: int = 0

    def state_dict(self) -> dict[str, int]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, int]) -> None:
        for k, v in state.items():
            setattr(self, k, v)


class RngStates:
    """Every rank's random generators (Python, NumPy, torch, CUDA). `state_dict` gathers them from all ranks (a
    collective: every rank calls it); on the same world size each rank gets its own back, on another one each rank
    is seeded from (seed, rank, step) — the data order and dropout follow the global batch, not the ranks."""

    def __init__(self, seed: int, dist: DistInfo, train_state: TrainState) -> None:
        self.seed, self.dist, self.train_state = seed, dist, train_state

    def state_dict(self) -> list[dict[str, Any]]:
        return gather_objects(rng_state())

    def load_state_dict(self, states: list[dict[str, Any]]) -> None:
        if len(states) == self.dist.world_size:
            set_rng_state(states[self.dist.rank])
            return
        log.warning("resuming on %d ranks from a %d-rank checkpoint (the data order and dropout follow the "
                    "global batch, not the ranks: the same samples and masks, summed in a different order)",
                    self.dist.world_size, len(states))
        # `state` is restored before `rng` (the registry's order), so this is the step the checkpoint reached
        seed_rank_rng(self.seed, self.dist.rank, self.train_state.step)


class ThreadCount:
    """The CPU thread count: CPU results depend on it, so a resumed run uses the count of the run it continues
    (unless OMP_NUM_THREADS says otherwise)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def state_dict(self) -> int:
        return torch.get_num_threads()

    def load_state_dict(self, threads: int | None) -> None:
        if not threads or threads == torch.get_num_threads() or self.device.type != "cpu":
            return
        if os.environ.get("OMP_NUM_THREADS"):
            log.warning("the checkpoint was written with %d threads, this run uses %d (OMP_NUM_THREADS): CPU "
                        "results may differ from a straight run in the last bits", threads, torch.get_num_threads())
        else:  # the count chosen from the load may differ from the first run's: keep the run's numerics exact
            log.info("using %d threads, as the run this checkpoint belongs to", threads)
            torch.set_num_threads(threads)


class Clock:
    """Wall time spent in the training loop, summed over the resumes of a run: what `train.max_time` and the on-time
    schedule count. Kept apart from `TrainState` (whose counters a straight and a resumed run share bit for bit)."""

    def __init__(self) -> None:
        self.before = 0.0  # seconds spent by the processes this run resumed from
        self.t0: float | None = None

    def start(self) -> None:
        self.t0 = time.perf_counter()

    def elapsed(self) -> float:
        return self.before + (time.perf_counter() - self.t0 if self.t0 is not None else 0.0)

    def state_dict(self) -> dict[str, float]:
        return {"elapsed_s": self.elapsed()}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.before = float(state["elapsed_s"])


def training_states(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, precision: Any,
                    loader: Any, state: TrainState, seed: int, dist: DistInfo,
                    eval_history: Stateful, clock: Stateful, tracker_ids: Stateful,
                    meter: Stateful) -> dict[str, Stateful]:
    """The registry of one run (see the module docstring). Restored in this order: `state` before `rng`."""
    return {"state": state, "model": model, "optimizer": optimizer, "scheduler": scheduler,
            "precision": precision, "loader": loader, "rng": RngStates(seed, dist, state),
            "threads": ThreadCount(dist.device), "eval": eval_history, "clock": clock, "trackers": tracker_ids,
            "meter": meter}


def saved_entries(states: dict[str, Stateful]) -> dict[str, Any]:
    """`state_dict()` of every entry pickled in train_state.pt (every rank calls it: `rng` gathers)."""
    return {name: s.state_dict() for name, s in states.items() if name not in TENSOR_STATES}


def load_entries(states: dict[str, Stateful], saved: dict[str, Any], skip: tuple[str, ...] = ()) -> None:
    """Load every entry pickled in train_state.pt, in registry order, except `skip`; an entry the checkpoint lacks
    keeps its built value."""
    for name, s in states.items():
        if name in TENSOR_STATES or name in skip:
            continue
        if name not in saved:
            log.info("the checkpoint has no %r state (written before it existed): it starts fresh", name)
            continue
        s.load_state_dict(saved[name])
