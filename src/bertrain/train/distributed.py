"""Process-group setup from whichever launcher started us, and the few collectives the loops need.

One code path for every world size: with no launcher environment (or a world of 1) no process group is created
and the collectives below are identities. Launchers understood, first match wins:

* torchrun / torch.distributed.launch: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT
* Slurm `srun`: SLURM_PROCID, SLURM_STEP_NUM_TASKS, SLURM_LOCALID; the master is the first host of the step's
  node list, the port derived from the job and step ids (MASTER_ADDR / MASTER_PORT override both)
* Open MPI `mpirun`: OMPI_COMM_WORLD_RANK / _SIZE / _LOCAL_RANK; the port derived from the mpirun's job id
* MPICH / Intel MPI (PMI): PMI_RANK, PMI_SIZE, MPI_LOCALRANKID

Rank 0 prints the layout once (launcher, world size, master, each rank's local rank, host and pid); a partial or
inconsistent launcher environment is an error naming the variable.
"""
from __future__ import annotations

import contextlib
import datetime
import itertools
import logging
import os
import re
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

import torch
import torch.distributed as torch_dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.fsdp import FSDPModule

from bertrain.train.config import DistributedConfig
from bertrain.utils.memory import TRAINING_MMAP_THRESHOLD, TRAINING_TRIM_THRESHOLD, keep_freed_memory

log = logging.getLogger(__name__)

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


@dataclass(frozen=True)
class DistInfo:
    """This process's place in the job. `is_main` (rank 0) is the only rank that writes files."""
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    is_main: bool
    backend: str | None = None


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
    if not 0 < layout.master_port < 65536:
        raise ValueError(f"environment variable MASTER_PORT={layout.master_port} is not a TCP port (1-65535)")
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


def init_distributed(cfg: DistributedConfig | None = None) -> DistInfo:
    """Join the process group of the launcher (if any), pin this rank to its local GPU, and describe the result.

    gloo on CPU, nccl on GPU (unless `cfg.backend` says otherwise). At world size 1 no group is created.
    """
    cfg = cfg or DistributedConfig()
    layout = launch_env()
    rank, world, local = (layout.rank, layout.world_size, layout.local_rank) if layout else (0, 1, 0)
    use_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    if use_cuda:
        if not torch.cuda.is_available():
            raise ValueError("config key 'distributed.device' is cuda but CUDA is not available")
        # pin before any CUDA work so that NCCL and every tensor of this rank use its own GPU
        torch.cuda.set_device(local % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    backend = None
    if world > 1 and not torch_dist.is_initialized():
        backend = cfg.backend if cfg.backend != "auto" else ("nccl" if use_cuda else "gloo")
        if backend == "nccl" and not use_cuda:
            raise ValueError("config key 'distributed.backend' is nccl but the device is CPU; use gloo")
        os.environ.setdefault("MASTER_ADDR", layout.master_addr)
        os.environ.setdefault("MASTER_PORT", str(layout.master_port))
        log.debug("rank %d/%d (local %d, %s): joining %s group at %s:%s", rank, world, local, layout.launcher,
                  backend, os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"])
        timeout = datetime.timedelta(seconds=cfg.timeout_s)
        store = restart_isolated_store(os.environ, timeout)
        if store is not None:
            torch_dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world, timeout=timeout)
        else:
            torch_dist.init_process_group(backend=backend, init_method="env://", rank=rank, world_size=world,
                                          timeout=timeout)
        # who is who, so that an error about rank r can name its pid and host even if r never said anything else
        _identities[:] = gather_objects({"pid": os.getpid(), "host": socket.gethostname(), "local_rank": local,
                                         "launcher": layout.launcher, "device": str(device)})
        check_layout(_identities)
        if rank == 0:
            log.info("%s", describe_layout(layout, backend, _identities))
    elif torch_dist.is_initialized():
        backend = torch_dist.get_backend()
    if layout and world == 1:
        log.info("%s", describe_layout(layout, None, [{"pid": os.getpid(), "host": socket.gethostname(),
                                                      "local_rank": local, "device": str(device)}]))
    if rank != 0:
        _quiet_other_ranks()
    if device.type == "cpu":  # CPU steps re-allocate the same big buffers: keep them (see utils/memory.py)
        keep_freed_memory(TRAINING_MMAP_THRESHOLD, TRAINING_TRIM_THRESHOLD)
    return DistInfo(rank, world, local, device, rank == 0, backend)


_quieted: list[tuple[logging.Logger, int]] = []


def _quiet_other_ranks() -> None:
    """Rank 0 alone reports progress: other ranks keep warnings and errors (a problem on rank 3 is still heard),
    unless -v asked for everything. Launchers merge every rank's output into one console, so N copies of each
    info line would bury what matters."""
    root = logging.getLogger("bertrain")
    if not root.isEnabledFor(logging.DEBUG):
        _quieted.append((root, root.level))
        root.setLevel(logging.WARNING)


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


_identities: list[dict[str, Any]] = []


def check_layout(ranks: list[dict[str, Any]]) -> None:
    """Every rank's identity (gathered, in rank order) must describe one job: the same launcher everywhere, and no
    two ranks of a host on one GPU (their local ranks collide: NCCL would fail later, or both would run slowly). CPU
    ranks may share a host's local rank: two torchrun agents on one machine are a legitimate test of two nodes.
    The check runs on every rank with the same input, so every rank raises the same error."""
    launchers = sorted({r["launcher"] for r in ranks})
    if len(launchers) > 1:
        raise ValueError(f"ranks were started by different launchers ({', '.join(launchers)}): a leftover "
                         "RANK/WORLD_SIZE, SLURM_* or OMPI_* variable in some environments; unset it")
    seen: dict[tuple[str, str], int] = {}
    for rank, r in enumerate(ranks):
        if not r["device"].startswith("cuda"):
            continue
        key = (r["host"], r["device"])
        if key in seen:
            raise ValueError(f"ranks {seen[key]} and {rank} both use {key[1]} on host {key[0]} (local ranks "
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


def rank_identities() -> list[dict[str, Any]]:
    """Every rank's {"pid", "host"}, in rank order, gathered when the process group was created ([] without one)."""
    return list(_identities)


def is_distributed() -> bool:
    return torch_dist.is_available() and torch_dist.is_initialized() and torch_dist.get_world_size() > 1


def wrap_model(model: nn.Module, dist: DistInfo, cfg: DistributedConfig | None = None) -> nn.Module:
    """DDP when world_size > 1, else the model itself.

    DDP broadcasts rank 0's parameters and buffers when it wraps, so every rank starts from identical weights even
    if their initialisation differed (we also build the model with the same seed on every rank).
    """
    if dist.world_size == 1:
        return model
    cfg = cfg or DistributedConfig()
    # DDP's buffer options are left at their defaults: our models register no buffers, so there is nothing to
    # sync (and torch 2.13 deprecates `broadcast_buffers` in favour of a keyword that torch 2.11 lacks)
    ddp = nn.parallel.DistributedDataParallel(
        model, device_ids=[dist.device.index] if dist.device.type == "cuda" else None,
        bucket_cap_mb=cfg.bucket_cap_mb, gradient_as_bucket_view=True)
    if cfg.grad_compression == "bf16" and dist.device.type != "cuda":
        raise ValueError("config key 'distributed.grad_compression': bf16 allreduce needs NCCL on CUDA "
                         "(torch's hook refuses gloo); use fp16 on CPU, or none")
    if cfg.grad_compression != "none":
        # torch's own hooks: cast each bucket to 16 bits, allreduce, cast back (divided by world size as DDP does).
        hook = default_hooks.bf16_compress_hook if cfg.grad_compression == "bf16" else default_hooks.fp16_compress_hook
        ddp.register_comm_hook(state=None, hook=hook)
    return ddp


def unwrap_model(model: nn.Module) -> nn.Module:
    """The model inside DDP; an FSDP2 model is sharded in place, so it is its own unwrapped form."""
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def no_sync(model: nn.Module, enabled: bool, keep_gathered: bool = False) -> contextlib.AbstractContextManager:
    """Skip the gradient all-reduce (DDP) or reduce-scatter (FSDP2) inside the block (accumulation micro-steps)
    when `enabled`: gradients accumulate locally until the last micro-step's backward reduces them.

    `keep_gathered` (FSDP2 without `reshard_after_forward`, whose gathered weights stay from forward to backward
    anyway): they also stay from one micro-step to the next, so the weights are all-gathered once per optimizer
    step instead of once per micro-step (the last micro-step's backward frees them)."""
    if enabled and isinstance(model, nn.parallel.DistributedDataParallel):
        return model.no_sync()
    if enabled and isinstance(model, FSDPModule):
        return _fsdp_no_sync(model, keep_gathered)
    return contextlib.nullcontext()


@contextlib.contextmanager
def _fsdp_no_sync(model: FSDPModule, keep_gathered: bool) -> Iterator[None]:
    # FSDP2 has setters but no context; the flag DDP uses tells `grads_are_synced` where we are
    model.set_requires_gradient_sync(False)
    model.set_reshard_after_backward(not keep_gathered)
    model.require_backward_grad_sync = False
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)
        model.set_reshard_after_backward(True)
        model.require_backward_grad_sync = True


def grads_are_synced(model: nn.Module) -> bool:
    """False while inside `no_sync`: gradients are then local and must not be clipped or stepped on."""
    return getattr(model, "require_backward_grad_sync", True)


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum `tensor` over ranks in place (identity at world size 1) and return it."""
    if is_distributed():
        torch_dist.all_reduce(tensor, op=torch_dist.ReduceOp.SUM)
    return tensor


def gather_objects(obj: Any) -> list[Any]:
    """Every rank's `obj`, in rank order, on every rank."""
    if not is_distributed():
        return [obj]
    out: list[Any] = [None] * torch_dist.get_world_size()
    torch_dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank `src`'s `obj` on every rank."""
    if not is_distributed():
        return obj
    box = [obj]
    torch_dist.broadcast_object_list(box, src=src)
    return box[0]


_long_waits = itertools.count()
LONG_WAIT_LOG_S = 300.0


def barrier(waiting_for: str | None = None, poll_s: float = 1.0) -> None:
    """Wait for every rank.

    Plain: a collective barrier, failing after `distributed.timeout_s`. With `waiting_for` (what the early ranks wait
    for, e.g. "rank 0 to prepare the data") the ranks meet in the rendezvous store instead, with no time limit, and
    say every few minutes what they are waiting for: for phases where one rank works alone for longer than any
    collective should take. Every rank must pass the same `waiting_for`-ness in the same order.
    """
    if not is_distributed():
        return
    if waiting_for is None:
        torch_dist.barrier()
        return
    store = torch_dist.distributed_c10d._get_default_store()
    key, world = f"bertrain/wait/{next(_long_waits)}", torch_dist.get_world_size()
    arrived = store.add(key, 1)
    start = last_log = time.monotonic()
    while arrived < world:
        time.sleep(poll_s)
        arrived = store.add(key, 0)
        if time.monotonic() - last_log >= LONG_WAIT_LOG_S:
            last_log = time.monotonic()
            log.info("rank %d: still waiting for %s (%.0f min, %d of %d ranks ready)", torch_dist.get_rank(),
                     waiting_for, (last_log - start) / 60, arrived, world)
    # Every rank has arrived, but a rank that saw it first could go on and tear the store down (rank 0 hosts it)
    # while another is still between two polls: one collective barrier, immediate now, closes that window.
    torch_dist.barrier()


def heartbeat_store(timeout_s: float) -> Any | None:
    """A private connection to the rendezvous store (None without a process group), for the watchdog's heartbeat:
    its own socket, so a heartbeat stuck on a frozen store host never holds up the process group's own client."""
    if not is_distributed():
        return None
    store = torch_dist.distributed_c10d._get_default_store().clone()
    store.set_timeout(datetime.timedelta(seconds=timeout_s))
    return store


def cleanup() -> None:
    """Leave the process group (safe to call when none was created)."""
    _identities.clear()
    while _quieted:
        logger, level = _quieted.pop()
        logger.setLevel(level)
    if torch_dist.is_available() and torch_dist.is_initialized():
        torch_dist.destroy_process_group()


@contextlib.contextmanager
def distributed_context(cfg: DistributedConfig | None = None) -> Iterator[DistInfo]:
    """`init_distributed` and always `cleanup`, even on errors — unless the process group was there already: then
    an outer context owns it (`bertrain run` holds one group for all its stages; re-creating it per stage would let a
    fast rank reach rank 0's old rendezvous store before rank 0 has closed it)."""
    owner = not (torch_dist.is_available() and torch_dist.is_initialized())
    try:
        yield init_distributed(cfg)
    finally:
        if owner:
            cleanup()
