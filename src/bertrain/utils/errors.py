"""Exit codes and the one-line errors a user can act on.

Every command ends with one of the documented exit codes (README "Exit codes"):

* 0 `EXIT_OK` — finished.
* 1 `EXIT_FAILED` — an unexpected error (a bug): the traceback is printed.
* 2 `EXIT_USER_ERROR` — bad input, config or environment (a `ValueError`, an `OSError` the user can cause such as a
  full disk or a missing permission, a locked output folder): one line says what and what to do; `--debug` also
  prints the traceback.
* 3 `EXIT_STOPPED` — stopped by a signal (SIGTERM/SIGINT) or a watchdog after saving what could be saved: the run
  continues with `--resume auto`. A scheduler can tell it from a finished run.
"""
from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
from pathlib import Path
from typing import Iterator

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USER_ERROR = 2
EXIT_STOPPED = 3


class UserError(ValueError):
    """A problem the user can fix; the message says what and how. (`ValueError`s are treated the same way.)"""


class RunStopped(Exception):
    """The run stopped early on request (signal) or by the watchdog; `--resume auto` continues it."""

    def __init__(self, message: str, checkpoint: Path | None = None) -> None:
        super().__init__(message)
        self.checkpoint = checkpoint


def _free_space(path: Path) -> str:
    for p in (path, *path.parents):
        if p.exists():
            try:
                return f"{shutil.disk_usage(p).free / 2**20:,.0f} MiB free on {p}"
            except OSError:
                return ""
    return ""


def describe_os_error(e: OSError, doing: str, kept: str | None = None, needed_bytes: int | None = None,
                      where: str | os.PathLike | None = None) -> str:
    """One line: what was being done, why it failed (the OS's words), free vs needed space, what was kept. `where`:
    the folder being written, for an error that names no file (torch.save into a Python file, safetensors' Rust
    error): its free space, not the current folder's, is the one that ran out."""
    path = Path(e.filename) if e.filename else None
    reason = e.strerror or str(e)
    parts = [f"{doing}: {reason}" + (f" ({path})" if path else "")]
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        free = _free_space(path or (Path(where) if where is not None else Path.cwd()))
        need = f", about {needed_bytes / 2**20:,.0f} MiB needed" if needed_bytes else ""
        what = "the disk is full" if e.errno == errno.ENOSPC else "your disk quota is used up"
        parts.append(f"{what} ({free}{need}): free space or write elsewhere")
    elif e.errno == errno.EFBIG:
        parts.append("a file size limit was reached (ulimit -f, or the filesystem's largest file): raise it or "
                     "write elsewhere")
    elif e.errno in (errno.EACCES, errno.EPERM):
        parts.append("no permission: choose a folder you can write, or fix its permissions")
    elif e.errno == errno.EROFS:
        parts.append("the filesystem is read-only: write elsewhere")
    elif e.errno == errno.ENOENT:
        parts.append("the path does not exist")
    elif e.errno in (errno.EMFILE, errno.ENFILE):
        parts.append("too many open files: raise the limit (ulimit -n) or use fewer workers")
    elif e.errno in (errno.ENOTDIR, errno.EEXIST):
        parts.append("a file is in the way where a folder is needed: choose another path")
    if kept:
        parts.append(kept)
    return "; ".join(parts)


class OutputError(UserError):
    """An `OSError` while writing an output, turned into one clear line (the original is the `__cause__`)."""


@contextlib.contextmanager
def writing(doing: str, kept: str | None = None, needed_bytes: int | None = None,
            where: str | os.PathLike | None = None) -> Iterator[None]:
    """Turn an OSError inside the block into an `OutputError` naming what was being written and what was kept
    (`where`: the folder written, see `describe_os_error`)."""
    try:
        yield
    except OutputError:
        raise
    except BaseException as e:
        # CheckpointException (DCP) derives from BaseException; KeyboardInterrupt and SystemExit pass untouched
        cause = os_error_in(e) if isinstance(e, Exception) or hasattr(e, "failures") else None
        if cause is None:
            raise
        raise OutputError(describe_os_error(cause, doing, kept, needed_bytes, where)) from e


# Rust's std::io::Error as safetensors and tokenizers print it: "I/O error: No space left on device (os error 28)"
_RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)")


def os_error_in(e: BaseException, depth: int = 8) -> OSError | None:
    """The `OSError` behind a failed write, where a library wrapped it: `torch.save` into a Python file raises
    RuntimeError("... unexpected pos ...") with the OSError as its context; `torch.distributed.checkpoint` raises
    CheckpointException with each rank's exception in `failures`; safetensors raises SafetensorError with the errno
    in its message. None when there is no OSError behind `e`."""
    if depth < 0 or e is None:
        return None
    if isinstance(e, OSError):
        return e
    failures = getattr(e, "failures", None)  # DCP: {rank: (exception, traceback) or exception}
    for failure in failures.values() if isinstance(failures, dict) else ():
        inner = failure[0] if isinstance(failure, tuple) and failure else failure
        if isinstance(inner, BaseException) and (found := os_error_in(inner, depth - 1)) is not None:
            return found
    if m := _RUST_OS_ERROR.search(str(e)):
        number = int(m.group(1))
        return OSError(number, os.strerror(number))
    return os_error_in(e.__cause__ or e.__context__, depth - 1)  # type: ignore[arg-type]


# errno values of the OSErrors a user causes (and can fix): a full disk or quota, a permission, a read-only or
# missing path, a name that is too long, too many open files. Any other OSError (EIO, ...) is unexpected: exit 1.
USER_ERRNOS = frozenset({
    errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOENT, errno.ENOTDIR,
    errno.EISDIR, errno.EEXIST, errno.ENOTEMPTY, errno.ENAMETOOLONG, errno.ELOOP, errno.EMFILE, errno.ENFILE,
    errno.EXDEV, errno.EBUSY, errno.ETXTBSY,
})


def is_user_os_error(e: BaseException) -> bool:
    """Whether `e` is an `OSError` the user caused and can fix (see `USER_ERRNOS`): one line, exit 2."""
    return isinstance(e, OSError) and e.errno in USER_ERRNOS


def current_umask() -> int:
    """The process umask. Read from /proc/self/status where it is there (Linux: no change at all, so no other
    thread can create a file under a umask of 0 meanwhile), else by setting and restoring it."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0)
    os.umask(mask)
    return mask
