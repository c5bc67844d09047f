"""Timing and memory: the matmul peak (the MFU denominator), interleaved timed steps, the peak memory of a step."""
from __future__ import annotations

import ctypes
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from bertrain.utils.memory import MallInfo2


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on CPU), so wall-clock time covers it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_peak(device: torch.device, dtype: torch.dtype, n: int | None = None, reps: int = 5) -> float:
    """Best FLOP/s of an n x n x n GEMM at `dtype` on `device` (the MFU denominator)."""
    n = n or (8192 if device.type == "cuda" else 2048)
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    best = float("inf")
    for i in range(reps + 2):
        sync(device)
        t0 = time.perf_counter()
        (a @ b)
        sync(device)
        if i >= 2:
            best = min(best, time.perf_counter() - t0)
    return 2 * n ** 3 / best


# ----------------------------------------------------------------------------------------------- memory

def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _heap_reader() -> Callable[[], int] | None:
    """Bytes malloc has handed out and not got back (glibc >= 2.33 `mallinfo2`: in-use heap + mmapped blocks), or
    None. Unlike RSS this does not depend on whether freed memory goes back to the kernel (the trainer keeps it:
    utils/memory.py), so it measures what a step allocates, like CUDA's max_memory_allocated."""
    try:
        fn = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):
        return None
    fn.restype = MallInfo2

    def read() -> int:
        info = fn()
        return int(info.uordblks + info.hblkhd)
    return read


_HEAP = _heap_reader() if sys.platform.startswith("linux") else None


class _MemorySampler:
    """Peak allocated memory (or, without mallinfo2, RSS) of this process while the context is open (a 2 ms
    sampling thread)."""

    def __init__(self, read: Callable[[], int]):
        self.read = read

    def __enter__(self) -> _MemorySampler:
        self.base = self.peak = self.read()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, self.read())

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, self.read())


def peak_step_memory(step: Callable[[], None], device: torch.device) -> int:
    """Extra bytes at the peak of one `step()` over what was held before it (-1: no way to measure here)."""
    if device.type == "cuda":
        sync(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        sync(device)
        return torch.cuda.max_memory_allocated(device) - before
    read = _HEAP or (_rss_bytes if os.path.exists("/proc/self/statm") else None)
    if read is None:
        return -1
    with _MemorySampler(read) as s:
        step()
    return s.peak - s.base


# ----------------------------------------------------------------------------------------------- timed steps

@dataclass
class Side:
    """One thing to time: a name and a step function (a training step or an inference forward)."""

    name: str
    step: Callable[[], None]
    times: list[float] = field(default_factory=list)
    cpu_times: list[float] = field(default_factory=list)  # process CPU seconds (all threads) per timed step
    peak_bytes: int = -1


def time_interleaved(sides: list[Side], steps: int, warmup: int, device: torch.device,
                     measure_memory: bool = True) -> None:
    """Warm every side up, then alternate their timed steps (forward order on even rounds, reversed on odd)."""
    for _ in range(warmup):
        for s in sides:
            s.step()
    sync(device)
    for i in range(steps):
        for s in (sides if i % 2 == 0 else sides[::-1]):
            sync(device)
            t0, c0 = time.perf_counter(), time.process_time()
            s.step()
            sync(device)
            s.times.append(time.perf_counter() - t0)
            s.cpu_times.append(time.process_time() - c0)
    if measure_memory:
        for s in sides:
            s.peak_bytes = peak_step_memory(s.step, device)
