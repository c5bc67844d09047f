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
