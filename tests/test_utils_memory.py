"""The malloc setting CPU training and prepare's workers use (utils/memory.py)."""
from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

CODE = ("from bertrain.utils.memory import keep_freed_memory, TRAINING_MMAP_THRESHOLD as M, "
        "TRAINING_TRIM_THRESHOLD as T; print(keep_freed_memory(M, T))")


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt thresholds are glibc's")
@pytest.mark.parametrize("opt_out", [False, True])
def test_keep_freed_memory_applies_and_can_be_turned_off(opt_out):
    # a fresh process: the setting is process-wide
    env = {"BERTRAIN_KEEP_FREED_MEMORY": "0"} if opt_out else {}
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, env={**os.environ, **env})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(not opt_out)


TRIM = """
import ctypes, sys
from bertrain.utils.memory import keep_freed_memory, release_freed_memory, TRAINING_MMAP_THRESHOLD as M, \\
    TRAINING_TRIM_THRESHOLD as T

def rss_mb():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS")).split()[1]) / 1024

assert not release_freed_memory(0)  # nothing kept: nothing to hand back
assert keep_freed_memory(M, T)
assert not release_freed_memory(60)  # just kept: not before the interval
# 600 blocks of 1 MB (heap memory under the kept thresholds), touched, then 5 of every 6 freed: gaps that nothing
# reuses, which the kept heap keeps resident
buf = [ctypes.create_string_buffer(1 << 20) for _ in range(600)]
small = buf[:40]
del buf[:40]
del small[::2]  # 20 MB of gaps: far below what is in use, kept for the next steps
assert not release_freed_memory(0)
buf = buf[::6]
before = rss_mb()
assert release_freed_memory(0)  # ~470 MB free against ~100 MB in use: handed back
print(before - rss_mb())
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_release_freed_memory_hands_the_kept_gaps_back():
    """A long CPU run's RSS rose ~5 MB per step under the kept heap (gaps of varying shapes, 1.5 -> 5.2 GB in 2,000
    steps of the tiny model): the trainer hands the free pages back once they outgrow the memory in use. Here: the
    freed gaps leave the resident set; a few are kept."""
    out = subprocess.run([sys.executable, "-c", TRIM], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert float(out.stdout) > 300, out.stdout
