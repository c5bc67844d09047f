"""How many CPU threads a command's PyTorch work should use, chosen from the CPUs this process may use and the load.

PyTorch's default is one thread per core of the machine, whatever else runs on it. On a loaded machine that
oversubscribes the cores and the job runs ~2x slower than with `OMP_NUM_THREADS=1`. `choose_threads` picks:

* the user's choice, when `OMP_NUM_THREADS` (or `MKL_NUM_THREADS`) is set: it is left alone;
* otherwise the CPUs the process may use (`os.sched_getaffinity`, capped by a cgroup CPU quota where one is set),
  shared by the local ranks of a torchrun / Slurm job (`LOCAL_WORLD_SIZE`), minus the machine's current load
  (`os.getloadavg()[0]`, rounded; scaled to our share of the machine when the affinity is a subset), at least 1.

`cli.main` applies it once per process for the commands that compute (pretrain, finetune, predict, evaluate) and
prints one line saying how many threads and why. Float results depend on the thread count (reductions split
differently), so runs meant to be bitwise equal across loads set `OMP_NUM_THREADS` explicitly.
"""
from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Mapping, Sequence

USER_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
LOCAL_WORLD_VARIABLES = ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE", "OMPI_COMM_WORLD_LOCAL_SIZE",
                         "MPI_LOCALNRANKS")
CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")


def _affinity() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def _load() -> float | None:
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def _cgroup_quota(path: Path = CGROUP_CPU_MAX) -> float | None:
    """CPUs allowed by a cgroup v2 quota ("200000 100000" = 2 CPUs; "max ..." = no quota)."""
    try:
        quota, period = path.read_text().split()[:2]
        if quota == "max":
            return None
        return int(quota) / int(period)
    except (OSError, ValueError):
        return None


def _positive_int(value: str | None) -> int | None:
    try:
        n = int(str(value).strip())
    except ValueError:
        return None
    return n if n >= 1 else None


def choose_threads(environ: Mapping[str, str] | None = None, affinity: int | Sequence[int] | None = None,
                   load: float | None = -1.0, machine_cpus: int | None = None,
                   quota: float | None = -1.0) -> tuple[int, str]:
    """(threads, reason). Arguments default to this process's environment, affinity, load, CPU count and cgroup
    quota; tests pass them explicitly (`load=None` / `quota=None`: unknown / none)."""
    env = os.environ if environ is None else environ
    for var in USER_VARIABLES:
        if env.get(var, "").strip():
            n = _positive_int(env[var])
            if n is not None:
                return n, f"{var}={n} is set"
    cpus = affinity if isinstance(affinity, int) else (len(affinity) if affinity is not None else _affinity())
    cpus = max(1, cpus)
    machine = max(cpus, machine_cpus if machine_cpus is not None else (os.cpu_count() or cpus))
    if load is not None and load < 0:
        load = _load()
    if quota is not None and quota < 0:
        quota = _cgroup_quota()
    parts = [f"{cpus} CPU{'s' if cpus != 1 else ''} usable"]
    if quota is not None and quota < cpus:
        cpus = max(1, math.ceil(quota))
        parts.append(f"a cgroup quota of {quota:g} CPUs")
    ranks = next((n for n in (_positive_int(env.get(v)) for v in LOCAL_WORLD_VARIABLES) if n is not None), 1)
    free = float(cpus)
    if load is not None:
        busy = load * cpus / machine  # the load is machine-wide; our CPUs carry their share of it
        free = cpus - round(busy)
        parts.append(f"load {load:.1f}" + (f" (~{busy:.1f} on ours)" if machine > cpus else ""))
    if ranks > 1:
        free = free / ranks
        parts.append(f"{ranks} local ranks")
    n = max(1, int(free))
    return n, ", ".join(parts)


_applied: tuple[int, str] | None = None


def apply_threads(log=None) -> tuple[int, str]:
    """Choose once per process and apply it; log one line (rank 0 only) the first time.

    With torch imported, `torch.set_num_threads(n)`; otherwise `OMP_NUM_THREADS=n` in the environment, which torch
    reads when it is imported (so a command that never needs torch does not pay ~2 s to import it)."""
    global _applied
    if _applied is not None:
        return _applied
    import sys

    n, reason = choose_threads()
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(n)
    elif not any(os.environ.get(v, "").strip() for v in USER_VARIABLES):
        os.environ["OMP_NUM_THREADS"] = str(n)
    _applied = (n, reason)
    if log is not None:
        rank = os.environ.get("RANK", os.environ.get("SLURM_PROCID", os.environ.get("OMPI_COMM_WORLD_RANK", "0")))
        (log.info if rank == "0" else log.debug)(
            "using %d thread%s (%s); set OMP_NUM_THREADS to override", n, "s" if n != 1 else "", reason)
    return _applied
