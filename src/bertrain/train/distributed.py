"""Process-group setup from whichever launcher started us (`train/launch.py` reads and checks its environment),
and the few collectives the loops need.

One code path for every world size: with no launcher environment (or a world of 1) no process group is created
and the collectives below are identities. Rank 0 prints the layout once; other ranks log warnings only.
"""
from __future__ import annotations

import contextlib
import datetime
import itertools
import logging
import os
import platform
import socket
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, TypeVar

import torch
import torch.distributed as torch_dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.fsdp import FSDPModule

from bertrain.train.config import DistributedConfig
from bertrain.train.launch import (check_layout, describe_layout, launch_env, name_ranks,
                                   restart_isolated_store)
from bertrain.utils.errors import RunStopped, UserError, is_user_os_error
from bertrain.utils.memory import TRAINING_MMAP_THRESHOLD, TRAINING_TRIM_THRESHOLD, keep_freed_memory

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistInfo:
    """This process's place in the job. `is_main` (rank 0) is the only rank that writes files."""
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    is_main: bool
    backend: str | None = None


def init_distributed(cfg: DistributedConfig | None = None, sharded: bool = False) -> DistInfo:
    """Join the process group of the launcher (if any), pin this rank to its local GPU, and describe the result.

    gloo on CPU, nccl on GPU (unless `cfg.backend` says otherwise). At world size 1 no group is created, unless a
    launcher started the process and `cfg.backend` names one (NCCL's code paths on a single GPU, as a multi-GPU job
    would take them) or the run is `sharded` (parallelism.strategy fsdp): then a one-rank group. An elastic FSDP job
    that lost all nodes but one thus resumes its sharded checkpoint on the survivor, as a DDP job does, instead of
    failing at every restart for want of ranks to shard across.
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
    me = {"pid": os.getpid(), "host": socket.gethostname(), "local_rank": local, "device": str(device),
          "launcher": layout.launcher if layout else None, "software": software_versions(),
          "gpu": gpu_identity(device.index) if device.type == "cuda" else None}
    one_rank_group = layout is not None and (cfg.backend != "auto" or sharded)
    if (world > 1 or one_rank_group) and not torch_dist.is_initialized():
        backend = cfg.backend if cfg.backend != "auto" else ("nccl" if use_cuda else "gloo")
        if backend == "nccl" and not use_cuda:
            raise ValueError("config key 'distributed.backend' is nccl but the device is CPU; use gloo")
        os.environ.setdefault("MASTER_ADDR", layout.master_addr)
        os.environ.setdefault("MASTER_PORT", str(layout.master_port))
        log.debug("rank %d/%d (local %d, %s): joining %s group at %s:%s", rank, world, local, layout.launcher,
                  backend, os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"])
        timeout = datetime.timedelta(seconds=cfg.timeout_s)
        try:
            store = restart_isolated_store(os.environ, timeout)
            if store is not None:
                torch_dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world,
                                              timeout=timeout)
            else:
                torch_dist.init_process_group(backend=backend, init_method="env://", rank=rank, world_size=world,
                                              timeout=timeout)
        except torch_dist.DistError as e:  # DistNetworkError, DistStoreError: the job never came together
            raise UserError(rendezvous_failure(rank, world, os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"],
                                               cfg.timeout_s, e)) from None
        # who is who, so that an error about rank r can name its pid and host even if r never said anything else
        _identities[:] = gather_objects(me)
        torch_dist._bertrain_joined = True  # the process ends without the interpreter's teardown (cli.entry)
        check_layout(_identities)
        if rank == 0:
            log.info("%s", describe_layout(layout, backend, _identities))
    elif torch_dist.is_initialized():
        backend = torch_dist.get_backend()
    if layout and world == 1 and backend is None:
        log.info("%s", describe_layout(layout, None, [me]))
    if rank != 0:
        _quiet_other_ranks()
    if device.type == "cpu":  # CPU steps re-allocate the same big buffers: keep them (see utils/memory.py)
        keep_freed_memory(TRAINING_MMAP_THRESHOLD, TRAINING_TRIM_THRESHOLD)
    return DistInfo(rank, world, local, device, rank == 0, backend)


def gpu_identity(index: int) -> str:
    """The physical GPU behind cuda:`index`: its UUID, else its entry of CUDA_VISIBLE_DEVICES. Not the index: Slurm's
    --gpus-per-task (and --gpu-bind) give each task its own GPU, seen by every task as cuda:0."""
    try:
        uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    except (RuntimeError, AssertionError):
        uuid = None
    if uuid:
        return str(uuid)
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    return visible[index] if index < len(visible) else str(index)


def software_versions() -> str:
    """What every rank of a job must run alike (`launch.check_layout`)."""
    import bertrain

    return f"bertrain {bertrain.__version__}, torch {torch.__version__}, Python {platform.python_version()}"


_quieted: list[tuple[logging.Logger, int]] = []


def _quiet_other_ranks() -> None:
    """Rank 0 alone reports progress: other ranks keep warnings and errors (a problem on rank 3 is still heard),
    unless -v asked for everything. Launchers merge every rank's output into one console, so N copies of each
    info line would bury what matters."""
    root = logging.getLogger("bertrain")
    if not root.isEnabledFor(logging.DEBUG):
        _quieted.append((root, root.level))
        root.setLevel(logging.WARNING)


def rendezvous_failure(rank: int, world: int, addr: str, port: str, timeout_s: float, error: BaseException) -> str:
    """What to check when the ranks could not meet (a wrong MASTER_ADDR, a closed port, a rank never started, a
    port in use): one line instead of torch's store traceback, exit 2 (the environment, not a bug)."""
    said = " ".join(str(error).split())
    if rank == 0 and ("EADDRINUSE" in said or "failed to listen" in said):
        return (f"rank 0 could not listen on port {port} (MASTER_PORT) of this host: it is in use, maybe by another "
                f"job; choose a free port (torch: {said})")
    if rank == 0:
        return (f"rank 0 waited {timeout_s:g} s (distributed.timeout_s) at {addr}:{port} for the job's other ranks, "
                f"and not all came: start every rank with the same world size ({world}), and "
                "make MASTER_ADDR rank 0's host as the other nodes reach it, its port open to them; or a rank failed "
                f"before joining (see its log) (torch: {said})")
    return (f"rank {rank} could not join the job at {addr}:{port} (MASTER_ADDR:MASTER_PORT) within {timeout_s:g} s "
            "(distributed.timeout_s): check that rank 0 is running, that MASTER_ADDR is rank 0's host as this node "
            f"reaches it (not localhost across machines), and that its port is open (torch: {said})")


_identities: list[dict[str, Any]] = []


def rank_identities() -> list[dict[str, Any]]:
    """Every rank's {"pid", "host", "local_rank", "device", "launcher"}, in rank order, gathered when the process
    group was created ([] without one)."""
    return list(_identities)


def is_distributed() -> bool:
    """A process group exists (also a one-rank group of a named backend: its collectives then run, on one rank)."""
    return torch_dist.is_available() and torch_dist.is_initialized()


def wrap_model(model: nn.Module, dist: DistInfo, cfg: DistributedConfig | None = None) -> nn.Module:
    """DDP when there is a process group (world_size > 1, or a named backend on one rank), else the model itself.

    DDP broadcasts rank 0's parameters and buffers when it wraps, so every rank starts from identical weights even
    if their initialisation differed (we also build the model with the same seed on every rank).
    """
    if not is_distributed():
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


T = TypeVar("T")


def on_rank0(what: str, fn: Callable[[], T], long: bool = False) -> T:
    """Rank 0 does `fn()` while the other ranks wait; every rank learns the outcome: rank 0's return value (which
    must pickle), or its error raised on every rank. The one place for "rank 0 does it, the others wait".

    `what` completes "rank 0 could not ..." (e.g. "prepare the data"). `long`: the others wait in the rendezvous
    store with no time limit (`barrier(waiting_for=...)`: work that may take longer than a collective's timeout,
    such as preparing a corpus); else in a collective, which fails after `distributed.timeout_s`.

    Rank 0 re-raises its own exception; the others raise one of the same kind with its first line, so every rank
    exits with the same code (2 for a user error, 3 for a stop, 1 otherwise) and none waits for a rank that gave
    up. Call it on every rank, in the same order."""
    value: Any = None
    error: BaseException | None = None
    if not is_distributed():
        return fn()
    if torch_dist.get_rank() == 0:
        try:
            value = fn()
        except BaseException as e:  # the other ranks must hear about it before anyone raises
            error = e
    if long:
        barrier(waiting_for=f"rank 0 to {what}")
    outcome = broadcast_object(("ok", value) if error is None else (_error_kind(error), _first_line(error)))
    if error is not None:
        raise error
    kind, payload = outcome
    if kind == "ok":
        return payload
    message = f"rank 0 could not {what}: {payload}"
    if kind == "user":
        raise UserError(message)
    if kind == "stopped":
        raise RunStopped(message)
    raise RuntimeError(message + " (see rank 0's log)")


def describe_ranks(ranks: list[int]) -> str:
    """"ranks 0-3 on host-a, rank 4 on host-b": `ranks` by the host each runs on (`launch.name_ranks` on the
    identities gathered at start-up)."""
    return name_ranks(ranks, rank_identities())


def same_paths_on_every_rank(paths: dict[str, Any]) -> None:
    """Refuse a job whose ranks do not see the same inputs. Each rank checks which of `paths` (config key -> path;
    empty entries skipped) exist where it runs, and what they hold (`path_contents`); if some ranks see a path that
    others do not (a copy missing on one node, a node-local disk), or a different copy of it (a stale copy on one
    node's local disk), every rank raises the same one-line `UserError` naming the key, the path and the ranks and
    hosts on each side: before, the rank without it failed alone and the others crashed in their next collective
    with the transport's "connection closed" traceback, and a stale copy trained on other data without a word. A
    path missing on every rank is left to the usual checks, whose messages say more. Collective: every rank calls
    it with the same keys."""
    if not is_distributed():
        return
    items = {key: os.fspath(path) for key, path in paths.items() if path}
    seen = gather_objects({key: (path, path_contents(path)) for key, path in items.items()})
    for key in dict.fromkeys(k for s in seen for k in s):  # every rank's keys, in order
        views = [s.get(key, ("", None))[1] for s in seen]
        have = [r for r, v in enumerate(views) if v is not None]
        if not have:
            continue
        path = seen[have[0]][key][0]
        if len(have) < len(seen):
            lack = [r for r in range(len(seen)) if r not in have]
            raise UserError(f"config key '{key}': {path} exists for {describe_ranks(have)} but not for "
                            f"{describe_ranks(lack)}: every rank reads it, so every node must see it at the same "
                            "path (copy it there, or put it on a filesystem that every node mounts)")
        first = views[0]
        other = [r for r, v in enumerate(views) if v != first]
        if other:
            differ = sorted(n for n in set(first) | set(views[other[0]]) if first.get(n) != views[other[0]].get(n))
            same = [r for r, v in enumerate(views) if v == first]
            raise UserError(f"config key '{key}': {path} is not the same on every node: {describe_ranks(same)} and "
                            f"{describe_ranks(other)} have different copies ({', '.join(differ[:3])} "
                            f"{'differs' if len(differ) == 1 else 'differ'}): give every node the same copy")


# Files up to this size are compared by content across ranks (up to COMPARED_BYTES_PER_PATH in all), larger ones by
# size: a prepared store's shards are covered by the checksums in its store.json, a model's weights by their size
# beside its config.json; a folder of many data files must not cost a full read on every rank.
CONTENT_COMPARED_BYTES = 4 << 20
COMPARED_BYTES_PER_PATH = 16 << 20


def path_contents(path: str) -> dict[str, str] | None:
    """What `path` holds, cheaply, for comparing copies on different nodes: {name: size, and a sha256 within the
    limits above} of the file, or of the files directly in the folder (in name order); None if it does not
    exist."""
    import hashlib

    p = os.path.abspath(path)
    if not os.path.exists(p):
        return None
    files = [(os.path.basename(p), p)] if os.path.isfile(p) else sorted(  # hidden: locks, NFS's .nfs* files
        (e.name, e.path) for e in os.scandir(p) if e.is_file() and not e.name.startswith("."))
    out, budget = {}, COMPARED_BYTES_PER_PATH
    for name, f in files:
        try:
            size = os.path.getsize(f)
            digest = ""
            if size <= min(CONTENT_COMPARED_BYTES, budget):
                budget -= size
                with open(f, "rb") as fh:
                    digest = " " + hashlib.sha256(fh.read()).hexdigest()[:16]
        except OSError as e:
            out[name] = f"unreadable ({e.strerror})"
            continue
        out[name] = f"{size}{digest}"
    return out


def _error_kind(e: BaseException) -> str:
    """How the other ranks should fail when rank 0 failed with `e` (the exit-code classes of utils/errors.py)."""
    if isinstance(e, (RunStopped, KeyboardInterrupt)):
        return "stopped"
    if isinstance(e, ValueError) or is_user_os_error(e):
        return "user"
    return "failed"


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__


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
    start = last_log = time.monotonic()
    _store_wait[:] = [(start, waiting_for)]
    try:
        arrived = store.add(key, 1)
        pause = min(0.005, poll_s)  # doubling up to poll_s: a short wait (a small checkpoint) costs milliseconds
        while arrived < world:
            time.sleep(pause)
            pause = min(2 * pause, poll_s)
            arrived = store.add(key, 0)
            if time.monotonic() - last_log >= LONG_WAIT_LOG_S:
                last_log = time.monotonic()
                log.info("rank %d: still waiting for %s (%.0f min, %d of %d ranks ready)", torch_dist.get_rank(),
                         waiting_for, (last_log - start) / 60, arrived, world)
    except torch_dist.DistError as e:
        # The store is gone (under torchrun its agent hosts it: a killed launcher), but the ranks still reach each
        # other: they meet in the collective below instead, with its time limit (how a stop-save completes after
        # the launcher was lost). Every path ends in that one barrier, so the ranks stay matched.
        log.warning("rank %d: the rendezvous store is gone (%s); waiting for %s in a collective instead",
                    torch_dist.get_rank(), " ".join(str(e).split())[:200], waiting_for)
    finally:
        _store_wait.clear()
    # Every rank has arrived, but a rank that saw it first could go on and tear the store down (rank 0 hosts it)
    # while another is still between two polls: one collective barrier, immediate now, closes that window.
    torch_dist.barrier()


_store_wait: list[tuple[float, str]] = []


def store_wait() -> tuple[float, str] | None:
    """(since when, what for) while this rank waits in `barrier(waiting_for=...)`, else None. A store wait has no
    time limit of its own, and a frozen rank 0 (which holds the store) blocks it for good: the watchdog ends it
    when the heartbeat says a rank has been silent for longer than a collective would wait."""
    return _store_wait[0] if _store_wait else None


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
def distributed_context(cfg: DistributedConfig | None = None, sharded: bool = False) -> Iterator[DistInfo]:
    """`init_distributed` and always `cleanup`, even on errors — unless the process group was there already: then
    an outer context owns it (`bertrain run` holds one group for all its stages; re-creating it per stage would let a
    fast rank reach rank 0's old rendezvous store before rank 0 has closed it)."""
    owner = not (torch_dist.is_available() and torch_dist.is_initialized())
    try:
        yield init_distributed(cfg, sharded)
    except BaseException as e:
        if owner and is_distributed():
            keep_until_exit(e)
        raise
    finally:
        if owner:
            cleanup()


_kept: list[BaseException] = []


def keep_until_exit(failure: BaseException) -> None:
    """Keep a failed distributed run's objects (held by the failure's traceback: the model, DDP's reducer and
    through it the process group) alive until the process ends, which a process that joined a group does with
    os._exit (`bertrain.cli.entry`), without destructors. After a failed collective a backend thread may still be
    finishing the failed work, and can need the GIL for it, while freeing the group from the main thread joins
    that thread with the GIL held: seen as a survivor of a frozen rank 0 that printed its one-line error and then
    hung for good in that destructor (1 run in ~25 under load), so that the launcher never saw it exit. The
    process group itself is destroyed before (`cleanup`): only the objects' memory is left to the exit."""
    _kept.append(failure)


def kept_until_exit() -> list[BaseException]:
    """What `keep_until_exit` holds (for tests)."""
    return _kept
