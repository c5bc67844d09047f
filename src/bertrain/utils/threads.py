"""How many CPU threads a command's PyTorch work should use, chosen from the CPUs this process may use and the load.

PyTorch's default is one thread per core of the machine, whatever else runs on it. On a loaded machine that
oversubscribes the cores, and the job runs slower than with fewer threads. `choose_threads` picks:

* the user's choice, when `OMP_NUM_THREADS` (or `MKL_NUM_THREADS`) is set: it is left alone;
* otherwise the CPUs the process may use (`os.sched_getaffinity`, capped by a cgroup CPU quota where one is set),
  shared by the local ranks of a torchrun / Slurm job (`LOCAL_WORLD_SIZE`), minus the machine's current load
  (`os.getloadavg()[0]`, rounded; scaled to our share of the machine when the affinity is a subset), at most one
  per physical core (PyTorch's own default: hyperthreads do not speed up its kernels), at least 1.

`cli.main` applies it once per process for the commands that compute (pretrain, finetune, predict, evaluate) and
prints one line saying how many threads and why. Float results depend on the thread count (reductions split
differently), so runs meant to be bitwise equal across loads set `OMP_NUM_THREADS` explicitly.
"""
from __future__ import annotations

import math
import os
import sys
from pathlib import Path
from typing import Any, Mapping, Sequence

USER_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
LOCAL_WORLD_VARIABLES = ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE", "OMPI_COMM_WORLD_LOCAL_SIZE",
                         "MPI_LOCALNRANKS")
CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")


def _affinity() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return list(range(os.cpu_count() or 1))


def physical_cores(cpus: list[int]) -> int | None:
    """Distinct physical cores among the logical CPUs `cpus` (hyperthreads share one); None when unknown."""
    cores = set()
    for c in cpus:
        topo = Path(f"/sys/devices/system/cpu/cpu{c}/topology")
        try:
            cores.add(((topo / "physical_package_id").read_text().strip(), (topo / "core_id").read_text().strip()))
        except OSError:
            return None
    return len(cores) or None


def _load() -> float | None:
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def cgroup_quota(path: Path = CGROUP_CPU_MAX) -> float | None:
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


_UNSET: Any = object()


def choose_threads(environ: Mapping[str, str] | None = None, affinity: Sequence[int] | int | None = None,
                   load: float | None = _UNSET, machine_cpus: int | None = None, quota: float | None = _UNSET,
                   physical: int | None = _UNSET) -> tuple[int, str]:
    """(threads, reason).

    Each argument defaults to this process's own: environment, affinity (the logical CPUs it may run on, or their
    count), 1-minute load average, the machine's logical CPU count, cgroup CPU quota, and the physical cores among
    the affinity (PyTorch's own default is one thread per physical core). `None` means unknown / none.
    Threads = min(physical cores, usable CPUs - their share of the load), divided among the local ranks, >= 1.
    """
    env = os.environ if environ is None else environ
    for var in USER_VARIABLES:
        if env.get(var, "").strip():
            n = _positive_int(env[var])
            if n is not None:
                return n, f"{var}={n} is set"
    if affinity is None:
        affinity = _affinity()
    cpu_list = list(range(affinity)) if isinstance(affinity, int) else list(affinity)
    cpus = max(1, len(cpu_list))
    machine = max(cpus, machine_cpus if machine_cpus is not None else (os.cpu_count() or cpus))
    if load is _UNSET:
        load = _load()
    if quota is _UNSET:
        quota = cgroup_quota()
    if physical is _UNSET:
        physical = physical_cores(cpu_list) if affinity is not None and not isinstance(affinity, int) else None
    parts = [f"{cpus} CPU{'s' if cpus != 1 else ''} usable"]
    if physical is not None and physical < cpus:
        parts[0] += f" on {physical} core{'s' if physical != 1 else ''}"
    usable = float(cpus)
    if quota is not None and quota < cpus:
        usable = float(max(1, math.ceil(quota)))
        parts.append(f"a cgroup quota of {quota:g} CPUs")
    if load is not None:
        busy = load * cpus / machine  # the load is machine-wide; our CPUs carry their share of it
        usable -= round(busy)
        parts.append(f"load {load:.1f}" + (f" (~{busy:.1f} on ours)" if machine > cpus else ""))
    if physical is not None:
        usable = min(usable, physical)
    ranks = next((n for n in (_positive_int(env.get(v)) for v in LOCAL_WORLD_VARIABLES) if n is not None), 1)
    if ranks > 1:
        usable = usable / ranks
        parts.append(f"{ranks} local ranks")
    return max(1, int(usable)), ", ".join(parts)


_applied: tuple[int, str] | None = None


def apply_threads(log=None) -> tuple[int, str]:
    """Choose once per process and apply it; log one line (rank 0 only) the first time.

    With torch imported, `torch.set_num_threads(n)`; otherwise `OMP_NUM_THREADS=n` in the environment, which torch
    reads when it is imported (so a command that never needs torch does not pay for importing it)."""
    global _applied
    if _applied is not None:
        return _applied

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
