"""Output folders that no run destroys: one writer at a time, and a run identity that a new run must respect.

* `OutputLock(path)`: an exclusive `fcntl.flock` on the sibling file `.NAME.lock`, held for the whole command.
  A second command on the same output fails at once naming the holder (host, pid, command, start time). The
  kernel drops the lock when its process dies (also on kill -9), so a dead holder's lock is simply taken over.
  (flock is advisory and per host; on NFS it depends on the server's lock support.)
* `claim_run_folder(path, command, resume, overwrite)`: a training run's folder records `run.json` (run id,
  command, start). A new run (no `--resume`) refuses a folder that holds another run's outputs unless
  `--overwrite`, which moves the old folder aside to `NAME.replaced-<time>` — never deletes it.
"""
from __future__ import annotations

import datetime
import fcntl
import json
import os
import socket
import uuid
from pathlib import Path
from typing import Any

from bertrain.utils.errors import UserError, writing
from bertrain.utils.io import atomic_write_json

RUN_FILE = "run.json"
# What marks a folder as holding a run's outputs (a folder with none of these is free to use). `run.json` alone is
# not one: a run that stopped at a config or input error before writing anything leaves only its record, and the
# corrected command must be able to start there without --overwrite.
RUN_OUTPUTS = ("config.yaml", "metrics.jsonl", "final", "eval_results.json", "predictions.json",
               "recipe.yaml")  # the last: a `bertrain run` folder (its stages are folders inside)


def lock_path(path: str | os.PathLike) -> Path:
    path = Path(path).absolute()
    return path.with_name(f".{path.name}.lock")


class OutputLock:
    """`with OutputLock(out, "pretrain"):` — exclusive use of the output folder `out` for the block."""

    def __init__(self, path: str | os.PathLike, command: str) -> None:
        self.path = Path(path)
        self.command = command
        self._fd: int | None = None

    def __enter__(self) -> "OutputLock":
        lp = lock_path(self.path)
        with writing(f"creating the lock file {lp}"):
            lp.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(lp, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise UserError(f"output folder {self.path} is in use by {holder}: wait for it to finish, stop it, or "
                            "choose another output folder") from None
        os.ftruncate(fd, 0)
        info = {"host": socket.gethostname(), "pid": os.getpid(), "command": self.command,
                "since": datetime.datetime.now().isoformat(timespec="seconds")}
        os.write(fd, (json.dumps(info) + "\n").encode())
        self._fd = fd
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


def _read_holder(fd: int) -> str:
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        info = json.loads(os.read(fd, 4096).decode() or "{}")
        return (f"`bertrain {info.get('command', '?')}` (pid {info.get('pid', '?')} on {info.get('host', '?')}, "
                f"since {info.get('since', '?')})")
    except (OSError, ValueError):
        return "another bertrain process"


def read_run(path: str | os.PathLike) -> dict[str, Any] | None:
    f = Path(path) / RUN_FILE
    try:
        return json.loads(f.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def holds_run(path: str | os.PathLike) -> bool:
    """Whether the folder holds the outputs of a run (training, fine-tuning or evaluation); its run record alone
    (`run.json`) does not count."""
    path = Path(path)
    return path.is_dir() and (any((path / name).exists() for name in RUN_OUTPUTS)
                              or any(path.glob("step-*")) or any(path.glob("*/stage-started.json")))


def move_aside(path: Path) -> Path:
    """Rename `path` to a free `NAME.replaced-<time>` sibling and return the new name."""
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    target = path.with_name(f"{path.name}.replaced-{stamp}")
    n = 1
    while target.exists():
        n += 1
        target = path.with_name(f"{path.name}.replaced-{stamp}-{n}")
    with writing(f"moving the previous run {path} aside to {target.name}", kept=f"{path} is unchanged"):
        os.replace(path, target)
    return target


def claim_run_folder(path: str | os.PathLike, command: str, resume: str | None, overwrite: bool) -> dict[str, Any]:
    """Make `path` this run's folder (call on rank 0, holding `OutputLock`); returns the run record.

    - `resume`: the folder's run continues (its record is kept, or created for an older folder).
    - a folder holding another run: refused, unless `overwrite` (then moved aside, never deleted).
    """
    path = Path(path)
    if resume and overwrite:
        raise UserError("--resume and --overwrite contradict each other: continue the run, or replace it")
    existing = read_run(path)
    if resume:
        if existing is not None:
            return existing
    elif holds_run(path):
        what = (f"run {existing['run_id']} (`bertrain {existing.get('command', '?')}`, started "
                f"{existing.get('started', '?')})" if existing else "the outputs of an earlier run")
        if not overwrite:
            raise UserError(f"output folder {path} holds {what}: continue it with --resume auto, replace it with "
                            "--overwrite (the old folder is moved aside, not deleted), or choose another folder")
        moved = move_aside(path)
        print(f"bertrain {command}: moved the previous run in {path} aside to {moved}", flush=True)
    record = {"run_id": uuid.uuid4().hex[:12], "command": command,
              "started": datetime.datetime.now().isoformat(timespec="seconds"), "host": socket.gethostname()}
    with writing(f"writing {path / RUN_FILE}"):
        path.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path / RUN_FILE, record)
    return record
