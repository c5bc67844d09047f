"""Launcher environments: who started this process, as which rank of how many, and where rank 0 listens.

Launchers understood, first match wins:

* torchrun / torch.distributed.launch: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT
* Slurm `srun`: SLURM_PROCID, SLURM_STEP_NUM_TASKS, SLURM_LOCALID; the master is the first host of the step's
  node list, the port derived from the job and step ids (MASTER_ADDR / MASTER_PORT override both)
* Open MPI `mpirun`: OMPI_COMM_WORLD_RANK / _SIZE / _LOCAL_RANK; the port derived from the mpirun's job id
* MPICH / Intel MPI (PMI): PMI_RANK, PMI_SIZE, MPI_LOCALRANKID

A partial or inconsistent environment is an error naming the variable (`launch_env`); once the ranks have met,
`check_layout` checks what they say of themselves and `describe_layout` is the one description rank 0 prints.
Under torchrun, `restart_isolated_store` keeps a restarted group away from its predecessors' store keys.
"""
from __future__ import annotations

import datetime
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from typing import Any, Mapping

import torch.distributed as torch_dist

DEFAULT_PORT = 29500


@dataclass(frozen=True)
class LaunchEnv:
    """Rank layout read from a launcher's environment variables."""
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    launcher: str


def _int(env: Mapping[str, str], key: str, low: int = 0, high: int | None = None) -> int:
    try:
        value = int(env[key])
    except ValueError:
        raise ValueError(f"environment variable {key}={env[key]!r} is not an integer") from None
    if value < low or (high is not None and value > high):
        bound = f"between {low} and {high}" if high is not None else f"at least {low}"
        raise ValueError(f"environment variable {key}={value} must be {bound}")
    return value


def _require(env: Mapping[str, str], launcher: str, keys: tuple[str, ...], why: str) -> None:
    missing = [k for k in keys if k not in env]
    if missing:
        raise ValueError(f"incomplete {launcher} environment: {', '.join(missing)} not set ({why}); start the "
                         f"command with the launcher, or unset the partial variables")


def first_slurm_host(nodelist: str) -> str:
    """First host of a Slurm node list: `scontrol show hostnames` when available, else parse `a[01-04,07],b`."""
    if shutil.which("scontrol"):
        try:
            out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                                 check=True, timeout=30).stdout.split()
            if out:
                return out[0]
        except (subprocess.SubprocessError, OSError):
            pass
    m = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not m:
        raise ValueError(f"cannot parse SLURM_JOB_NODELIST={nodelist!r}; set MASTER_ADDR")
    prefix, ranges = m.group(1), m.group(2)
    if not ranges:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first


def launch_env(env: Mapping[str, str] | None = None) -> LaunchEnv | None:
    """The rank layout from torchrun, Slurm (srun), Open MPI or PMI variables; None when no launcher is present.

    A partial or inconsistent environment (a rank beyond the world size, RANK without WORLD_SIZE, a Slurm batch
    script with several tasks that did not go through srun) is a ValueError naming the variable: the alternative is
    a silent one-process run, or ranks waiting for peers that will never come.
    """
    env = os.environ if env is None else env
    layout = _torchrun_env(env) or _slurm_env(env) or _mpi_env(env)
    if layout is None:
        return None
    if layout.rank >= layout.world_size:
        raise ValueError(f"{layout.launcher} environment: rank {layout.rank} is not below the world size "
                         f"{layout.world_size} ({_VARS[layout.launcher]})")
    return layout


# the variables each launcher's layout is read from, for error messages
_VARS = {"torchrun": "RANK, WORLD_SIZE", "slurm": "SLURM_PROCID, SLURM_STEP_NUM_TASKS",
         "openmpi": "OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE", "pmi": "PMI_RANK, PMI_SIZE"}


def _port(env: Mapping[str, str], default: int) -> int:
    return _int(env, "MASTER_PORT", 1, 65535) if "MASTER_PORT" in env else default


def _torchrun_env(env: Mapping[str, str]) -> LaunchEnv | None:
    if "RANK" not in env and "WORLD_SIZE" not in env:
        return None
    _require(env, "torchrun", ("RANK", "WORLD_SIZE"), "torchrun sets both")
    world = _int(env, "WORLD_SIZE", 1)
    if world > 1:  # torchrun always sets these; without them two ranks would share a GPU or a wrong master
        _require(env, "torchrun", ("LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"), f"WORLD_SIZE={world}")
    local = _int(env, "LOCAL_RANK") if "LOCAL_RANK" in env else 0
    if "LOCAL_WORLD_SIZE" in env and local >= _int(env, "LOCAL_WORLD_SIZE", 1):
        raise ValueError(f"torchrun environment: LOCAL_RANK={local} is not below "
                         f"LOCAL_WORLD_SIZE={env['LOCAL_WORLD_SIZE']}")
    return LaunchEnv(_int(env, "RANK"), world, local, env.get("MASTER_ADDR", "127.0.0.1"),
                     _port(env, DEFAULT_PORT), "torchrun")


def _slurm_env(env: Mapping[str, str]) -> LaunchEnv | None:
    if "SLURM_PROCID" not in env:
        return None
    if "SLURM_STEP_NUM_TASKS" not in env:
        # the batch script itself (sbatch) or an salloc shell: one process, not a job step started by srun
        tasks = int(env.get("SLURM_NTASKS", "1") or 1)
        if tasks > 1:
            raise ValueError(f"inside a Slurm allocation of SLURM_NTASKS={tasks} tasks but not started by srun "
                             "(SLURM_STEP_NUM_TASKS is not set): run `srun bertrain ...` so that every task "
                             "starts, or `srun -n 1 bertrain ...` for one process")
        return None
    addr = env.get("MASTER_ADDR")
    if not addr:
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        addr = first_slurm_host(nodelist) if nodelist else "127.0.0.1"
    # every task of a step derives the same port; other jobs and steps on the node get other ones
    job, step = (int(v) if v.isdigit() else 0 for v in (env.get("SLURM_JOB_ID", ""), env.get("SLURM_STEP_ID", "")))
    port = _port(env, 15000 + (job * 8 + step) % 20000)
    return LaunchEnv(_int(env, "SLURM_PROCID"), _int(env, "SLURM_STEP_NUM_TASKS", 1),
                     _int(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else 0, addr, port, "slurm")


def _mpi_env(env: Mapping[str, str]) -> LaunchEnv | None:
    for rank_key, size_key, local_keys, local_size_key, name in (
        ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", ("OMPI_COMM_WORLD_LOCAL_RANK",),
         "OMPI_COMM_WORLD_LOCAL_SIZE", "openmpi"),
        ("PMI_RANK", "PMI_SIZE", ("MPI_LOCALRANKID", "PMI_LOCAL_RANK"), "MPI_LOCALNRANKS", "pmi"),
    ):
        if rank_key not in env and size_key not in env:
            continue
        _require(env, name, (rank_key, size_key), f"{name} sets both")
        rank, size = _int(env, rank_key), _int(env, size_key, 1)
        local = next((_int(env, k) for k in local_keys if k in env), 0)
        if local_size_key in env and local >= _int(env, local_size_key, 1):
            raise ValueError(f"{name} environment: local rank {local} is not below {local_size_key}="
                             f"{env[local_size_key]}")
        addr = env.get("MASTER_ADDR")
        if not addr:
            single_node = env.get(local_size_key) == env[size_key]
            if size > 1 and not single_node:
                raise ValueError(f"launched by {name} on several nodes: set MASTER_ADDR (and MASTER_PORT) "
                                 "to rank 0's host, e.g. mpirun -x MASTER_ADDR=$(hostname) ...")
            addr = "127.0.0.1"
        # Open MPI's job id is the same on every rank of one mpirun and differs between mpiruns: two jobs on one
        # host do not fight over a port
        job = env.get("OMPI_MCA_ess_base_jobid", "")
        port = _port(env, 15000 + int(job) % 20000 if job.isdigit() else DEFAULT_PORT)
        return LaunchEnv(rank, size, local, addr, port, name)
    return None


def restart_isolated_store(env: Mapping[str, str], timeout: datetime.timedelta) -> Any | None:
    """Under torchrun, the store of this attempt: the agent's store, with keys private to the restart count.

    torchrun's workers share the agent's TCPStore, which outlives a restart (`--max-restarts`): without a prefix,
    the restarted workers read the keys their killed predecessors left (gloo's peer addresses, our barrier
    counters) and connect to processes that no longer exist; they hang until the timeout. The restart count is the
    same on every rank that one agent restarts; in a multi-node job each agent counts its own restarts
    (pytorch/pytorch#108158), which agree when every node's workers fail together, as they do when a peer dies."""
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    client = torch_dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=False, timeout=timeout)
    attempt = env.get("TORCHELASTIC_RESTART_COUNT", "0")
    return torch_dist.PrefixStore(f"bertrain/{env.get('TORCHELASTIC_RUN_ID', 'run')}/attempt-{attempt}/", client)


def name_ranks(ranks: list[int], identities: list[dict[str, Any]]) -> str:
    """"ranks 0-3 on host-a, rank 4 on host-b": `ranks` in runs of consecutive ranks on one host (`identities`: every
    rank's, in rank order; hosts left out where unknown)."""
    groups: list[tuple[Any, list[int]]] = []
    for r in sorted(ranks):
        host = identities[r].get("host") if r < len(identities) else None
        if groups and groups[-1][0] == host and groups[-1][1][-1] == r - 1:
            groups[-1][1].append(r)
        else:
            groups.append((host, [r]))
    parts = []
    for host, rs in groups:
        name = f"rank {rs[0]}" if len(rs) == 1 else f"ranks {rs[0]}-{rs[-1]}"
        parts.append(name if host is None else f"{name} on {host}")
    return ", ".join(parts)


def check_layout(ranks: list[dict[str, Any]]) -> None:
    """Every rank's identity (gathered, in rank order) must describe one job: the same launcher everywhere, the same
    software (bertrain, torch and Python versions: nodes with another environment or container image fail later in
    obscure ways, or compute other numbers), and no two ranks of a host on one GPU (their local ranks collide: NCCL
    would fail later, or both would run slowly). CPU ranks may share a host's local rank: two torchrun agents on
    one machine are a legitimate test of two nodes. The check runs on every rank with the same input, so every rank
    raises the same error."""
    launchers = sorted({r["launcher"] for r in ranks})
    if len(launchers) > 1:
        raise ValueError(f"ranks were started by different launchers ({', '.join(launchers)}): a leftover "
                         "RANK/WORLD_SIZE, SLURM_* or OMPI_* variable in some environments; unset it")
    by_software: dict[str, list[int]] = {}
    for rank, r in enumerate(ranks):
        by_software.setdefault(r.get("software", ""), []).append(rank)
    if len(by_software) > 1:
        raise ValueError("the ranks run different software: " + "; ".join(
            f"{name_ranks(rs, ranks)}: {software or 'unknown'}" for software, rs in by_software.items())
            + ": install the same versions on every node (the same environment or container image)")
    seen: dict[tuple[str, str], int] = {}
    for rank, r in enumerate(ranks):
        if not r["device"].startswith("cuda"):
            continue
        # the physical GPU (`gpu`: its UUID), not the index: with Slurm's --gpus-per-task every task's GPU is cuda:0
        gpu = r.get("gpu") or r["device"]
        key = (r["host"], gpu)
        if key in seen:
            same = r["device"] if gpu == r["device"] else f"{r['device']} (GPU {gpu})"
            raise ValueError(f"ranks {seen[key]} and {rank} both use {same} on host {key[0]} (local ranks "
                             f"{ranks[seen[key]]['local_rank']} and {r['local_rank']}): the launcher's local-rank "
                             "variable (LOCAL_RANK, SLURM_LOCALID, OMPI_COMM_WORLD_LOCAL_RANK) is inconsistent, "
                             "or more ranks were started on the host than it has GPUs")
        seen[key] = rank


def describe_layout(layout: LaunchEnv, backend: str | None, ranks: list[dict[str, Any]], limit: int = 16) -> str:
    """The job as launched, printed once by rank 0: launcher, world size, master, and each rank's place."""
    lines = [f"launched by {layout.launcher}: world size {layout.world_size}, master "
             f"{layout.master_addr}:{layout.master_port}" + (f", {backend} backend" if backend else "")]
    for rank, r in enumerate(ranks[:limit]):
        lines.append(f"  rank {rank}: local rank {r['local_rank']} on {r['host']} (pid {r['pid']}, {r['device']})")
    if len(ranks) > limit:
        lines.append(f"  ... and {len(ranks) - limit} more ranks on {len({r['host'] for r in ranks})} hosts")
    return "\n".join(lines)
