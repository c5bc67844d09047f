"""Atomic file and folder writes: a reader never sees a half-written output.

Files are written to a temporary sibling, flushed and fsynced, then renamed over the target (rename is atomic on
POSIX within one filesystem). Folders are built under a temporary sibling name and renamed into place at the end.

`tempfile` creates private temporaries (files 0600, folders 0700); before the rename they get the permissions a
plain `open()` / `mkdir()` would have given under the process umask (files 0666 & ~umask, folders 0777 & ~umask),
so a teammate can read a model or checkpoint exactly when the umask says so.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator

from bertrain.utils.errors import current_umask


def file_mode() -> int:
    """The mode `open(path, "w")` gives a new file under the current umask."""
    return 0o666 & ~current_umask()


def dir_mode() -> int:
    """The mode `mkdir` gives a new folder under the current umask."""
    return 0o777 & ~current_umask()


def fsync_dir(path: Path) -> None:
    """Make a rename or a new file in `path` durable (best effort: a folder that cannot be opened is skipped)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "wb", **kwargs: Any) -> Iterator[Any]:
    """A file to write `path` through, piece by piece: a temporary sibling, renamed over `path` when the block ends
    without an error (an error or Ctrl-C removes it, and `path` is as it was). For outputs too big to hold in
    memory whole (predictions of millions of inputs, feature caches). `mode`: "wb" or "w" (then `kwargs` are
    open()'s: encoding, newline)."""
    if mode not in ("wb", "w"):
        raise ValueError(f"atomic_open writes new files: mode 'wb' or 'w', got {mode!r}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, mode, **kwargs) as f:
            yield f
            f.flush()
            os.fchmod(f.fileno(), file_mode())  # mkstemp made it 0600
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    with atomic_open(path, "wb") as f:
        f.write(data)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike, obj: Any, indent: int = 2) -> None:
    atomic_write_text(path, json.dumps(obj, indent=indent, sort_keys=False) + "\n")


def replace_dir(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """Move the complete folder `src` to `dst` (same filesystem). An existing `dst` is replaced only after it has
    been moved aside, so a crash leaves one of the two complete folders in place, never neither."""
    src, dst = Path(src), Path(dst)
    if dst.exists():
        old = dst.with_name(f".{dst.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(dst, old)
        try:
            os.replace(src, dst)
        except BaseException:  # a stop signal's exception (Ctrl-C, the CLI's SIGTERM) between the two renames
            if not dst.exists():  # the old folder back under its name: the caller then drops the new one
                os.replace(old, dst)
            raise
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(src, dst)
    fsync_dir(dst.parent)


def remove_stale_temporaries(path: Path) -> None:
    """Remove the temporary folders `atomic_dir` left for `path` in a process that was killed (kill -9, OOM) while
    building it: each is as large as the output (a model, a checkpoint), and nothing else ever removed it. The
    writer of `path` holds its lock (`OutputLock` of the output, or of the run folder it is in), so a temporary of
    `path` found now is a dead writer's. Only `.NAME.<mkdtemp's 8 characters>.tmp` matches: not the temporaries of
    another output whose name starts with NAME."""
    pattern = re.compile(rf"\.{re.escape(path.name)}\.[a-z0-9_]{{8}}\.tmp")
    with contextlib.suppress(OSError):
        for entry in os.scandir(path.parent):
            if pattern.fullmatch(entry.name) and entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path, ignore_errors=True)


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike, overwrite: bool = False,
               move_existing: Callable[[Path], Any] | None = None) -> Iterator[Path]:
    """Build a folder under a temporary name and move it to `path` only when the block succeeds.

    With `overwrite=False` an existing `path` is an error; with `overwrite=True` it is replaced only after the new
    folder is complete (the old one is moved aside first, then deleted), so a crash never leaves neither. With
    `move_existing`, an existing `path` is handed to it instead (it must move it away, e.g. `rundir.move_aside`)
    once the new folder is complete: nothing is deleted.
    """
    path = Path(path)
    if path.exists() and not overwrite and move_existing is None:
        raise FileExistsError(f"{path} already exists (pass overwrite to replace it)")
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(path)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    try:
        os.chmod(tmp, dir_mode())  # mkdtemp made it 0700
        yield tmp
        fsync_dir(tmp)
        if move_existing is not None and (path.exists() or path.is_symlink()):
            move_existing(path)
        replace_dir(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
