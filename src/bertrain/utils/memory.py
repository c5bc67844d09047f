"""Process memory settings: keep freed heap memory instead of handing it back to the kernel (glibc only).

Why: with glibc's defaults a process returns large freed blocks to the kernel (munmap, heap trim) and page-faults
them back in at the next allocation of the same size. Work that allocates and frees the same big buffers over and
over then spends a large share of its time in the kernel zeroing pages:
* `prepare`'s pool workers (numpy temporaries of every task);
* a CPU training step (PyTorch's CPU allocator is malloc): BERT-base at seq 128, batch 8 spent ~16% of its CPU time
  in the kernel; with the thresholds below the step takes 18-22% less time (BENCHMARKS.md, CPU results: freed
  memory).
Fixed thresholds also switch off glibc's dynamic threshold. A no-op where mallopt is unavailable (non-glibc), and
off with BERTRAIN_KEEP_FREED_MEMORY=0 (the price is a process that keeps its peak heap).
"""
from __future__ import annotations

import ctypes
import os
import sys

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
    return ok_mmap and ok_trim


# CPU training: every activation and gradient buffer of a step is below 1 GB at the sizes trained on a CPU.
TRAINING_MMAP_THRESHOLD = 1 << 30
TRAINING_TRIM_THRESHOLD = _INT_MAX
