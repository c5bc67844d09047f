"""A failed write says why in one line (`utils/errors.py` `writing`), also where a library wraps the OS's error:
torch.save, torch.distributed.checkpoint and safetensors each raise their own exception on a full disk. Shown
with a real file-size limit in a child process (the OS's EFBIG, as a full disk's ENOSPC), no mock."""
from __future__ import annotations

import errno
import subprocess
import sys
from pathlib import Path

import pytest

from bertrain.utils.errors import OutputError, os_error_in, writing

SCRIPT = """
import resource, signal, sys, warnings
from pathlib import Path
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from bertrain.train.checkpoint import save_torch
from bertrain.utils.errors import OutputError, writing
warnings.simplefilter("ignore")  # DCP: "assuming the intent is to save in a single process"
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, resource.RLIM_INFINITY))
out, big = Path(sys.argv[1]), {"w": torch.zeros(100_000)}  # 400 KB
for name, write in [("torch.save", lambda: save_torch(big, out / "a.pt")),
                    ("dcp.save", lambda: dcp.save(big, checkpoint_id=str(out / "dcp"))),
                    ("safetensors", lambda: save_file(big, str(out / "b.safetensors")))]:
    try:
        with writing(f"writing {name}", kept="kept"):
            write()
        print(name, "WROTE")
    except OutputError as e:
        print(name, "|", e)
"""


def test_each_library_writers_failure_becomes_one_line_with_the_os_reason(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = dict(line.split(" | ", 1) for line in done.stdout.strip().splitlines() if " | " in line)
    assert sorted(lines) == ["dcp.save", "safetensors", "torch.save"], done.stdout
    for name, message in lines.items():
        assert message.startswith(f"writing {name}: File too large") and "ulimit -f" in message, message
        assert message.endswith("; kept"), message


def test_an_error_without_an_os_error_behind_it_passes_unchanged() -> None:
    with pytest.raises(RuntimeError, match="a bug"):
        with writing("writing x"):
            raise RuntimeError("a bug")
    with pytest.raises(KeyboardInterrupt):
        with writing("writing x"):
            try:
                raise OSError(errno.ENOSPC, "No space left on device")
            except OSError:
                raise KeyboardInterrupt  # Ctrl-C while handling a write error: still an interrupt
    assert os_error_in(ValueError("no os error here")) is None


def test_the_os_error_is_found_in_each_wrapping() -> None:
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError:
            raise RuntimeError("unexpected pos 704 vs 598")
    except RuntimeError as e:
        assert os_error_in(e).errno == errno.ENOSPC
    rust = Exception("Error while serializing: I/O error: No space left on device (os error 28)")
    assert os_error_in(rust).errno == errno.ENOSPC and os_error_in(rust).strerror == "No space left on device"

    class CheckpointException(BaseException):  # DCP's shape: {rank: (exception, traceback)}
        failures = {0: (rust, []), 1: (RuntimeError("other"), [])}

    assert os_error_in(CheckpointException()).errno == errno.ENOSPC
    with pytest.raises(OutputError, match="the disk is full"):
        with writing("writing y"):
            raise CheckpointException()


def test_a_full_disk_without_a_file_name_measures_the_folder_written(tmp_path: Path, monkeypatch) -> None:
    """torch.save into a Python file and safetensors raise ENOSPC without a file name: the line gave the current
    folder's free space (77 GB on another disk) instead of the full one's."""
    import shutil

    from bertrain.utils.errors import describe_os_error

    sizes = {str(tmp_path / "run"): 0, str(Path.cwd()): 77_000 * 2**20}
    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(1, 1, sizes.get(str(p), 5 * 2**20)))
    (tmp_path / "run").mkdir()
    full = OSError(errno.ENOSPC, "No space left on device")
    with pytest.raises(OutputError) as e, writing("writing checkpoint step-3", where=tmp_path / "run"):
        raise RuntimeError("[enforce fail at inline_container.cc] unexpected pos") from full
    assert f"the disk is full (0 MiB free on {tmp_path / 'run'})" in str(e.value)
    assert "77,000 MiB" in describe_os_error(full, "writing")  # without `where`: the current folder, as before
