"""Process memory settings: keep freed heap memory instead of handing it back to the kernel (glibc only).

Why: with glibc's defaults a process returns large freed blocks to the kernel (munmap, heap trim) and page-faults
them back in at the next allocation of the same size. Work that allocates and frees the same big buffers over and
over then spends a large share of its time in the kernel zeroing pages:
* `prepare`'s pool workers (numpy temporaries of every task);
* a CPU training step (PyTorch's CPU allocator is malloc): BERT-base at seq 128, batch 8 spent ~16% of its CPU time
  in the kernel; with the thresholds below the step takes 18-22% less time (BENCHMARKS.md, CPU results: freed
  memory).
Fixed thresholds also switch off glibc's dynamic threshold. A no-op where mallopt is unavailable (non-glibc), and
off with BERTRAIN_KEEP_FREED_MEMORY=0.

The price: freed blocks stay in the process, and a training run's varying shapes (the MLM logits of a batch's
masked positions, the trimmed sequence length) keep opening gaps no later block fits: a 25-minute CPU run's RSS
rose ~5 MB per step without levelling off (1.3 -> 3.6 GB for a 10M-parameter model; 1.0 -> 3.1 GB over 1,350 steps
of the tiny one). `release_freed_memory`, called by the trainer at its log lines, hands the free pages back
(malloc_trim) once they outgrow the memory in use: the step keeps its speed, the process about twice its live heap.
"""
from __future__ import annotations

import ctypes
import os
import sys
import time

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameter numbers
_INT_MAX = 2**31 - 1  # mallopt takes a C int


def keep_freed_memory(mmap_threshold: int, trim_threshold: int) -> bool:
    """Allocations below `mmap_threshold` bytes come from the heap, and up to `trim_threshold` bytes of free heap
    stay in the process. Returns whether glibc accepted both."""
    if not sys.platform.startswith("linux") or os.environ.get("BERTRAIN_KEEP_FREED_MEMORY") == "0":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    ok_mmap = mallopt(M_MMAP_THRESHOLD, min(mmap_threshold, _INT_MAX)) == 1
    ok_trim = mallopt(M_TRIM_THRESHOLD, min(trim_threshold, _INT_MAX)) == 1
    _trim.update(kept=ok_mmap and ok_trim, last=time.monotonic())
    return ok_mmap and ok_trim


_trim: dict[str, float | bool] = {"kept": False, "last": 0.0}


class MallInfo2(ctypes.Structure):
    """glibc's `struct mallinfo2` (glibc >= 2.33), summed over every arena."""
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]


def heap_bytes() -> tuple[int, int] | None:
    """(bytes malloc has handed out, free bytes it keeps in its heaps), or None without mallinfo2."""
    try:
        fn = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):
        return None
    fn.restype = MallInfo2
    info = fn()
    return int(info.uordblks + info.hblkhd), int(info.fordblks)


MIN_KEPT_FREE = 256 << 20
"""Free heap below this is never handed back: the pages the next steps reuse."""


def release_freed_memory(min_interval_s: float = 10.0) -> bool:
    """Hand the heap's free pages back to the kernel (glibc's malloc_trim) where `keep_freed_memory` holds them and
    they have grown past the memory in use (and `MIN_KEPT_FREE`): checked at most once per `min_interval_s`;
    returns whether it trimmed. Bounds the RSS growth the kept gaps cause (module docstring) to about twice the
    live heap, and pays the page faults of a trim only then: trimming once a minute regardless cost 4% of the
    step time (tiny preset, 2,000 steps)."""
    now = time.monotonic()
    if not _trim["kept"] or now - float(_trim["last"]) < min_interval_s:
        return False
    _trim["last"] = now
    heap = heap_bytes()
    if heap is not None and heap[1] <= max(heap[0], MIN_KEPT_FREE):
        return False
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        return False
    return True


# CPU training: every activation and gradient buffer of a step is below 1 GB at the sizes trained on a CPU.
TRAINING_MMAP_THRESHOLD = 1 << 30
TRAINING_TRIM_THRESHOLD = _INT_MAX
