"""Run code on N local gloo processes (127.0.0.1, a free port), like mosaicml/streaming's tests/common.

Two ways: `spawn(fn, world_size, *args)` runs a picklable function in N `torch.multiprocessing` processes with
the torchrun environment variables set (the code under test calls `init_distributed` itself);
`launch_cli(world_size, argv)` runs `python -m bertrain …` as N subprocesses the same way torchrun would.
Each process gets OMP_NUM_THREADS=1 so that 4 ranks share 2 cores without oversubscription.

For a child that a test signals: `default_sigint` (its SIGINT as a terminal's Ctrl-C expects, however the suite was
started) and `wait_for_output` (wait for the line that says it is ready, not a fixed sleep).
"""
from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[1]


def base_config(out: Path, **train: object) -> dict:
    """A tiny synthetic pretraining run of 4 steps on any number of ranks (dropout on, checkpoints every 2)."""
    return {
        # dropout on: masks are seeded by the micro-batch's place in the global batch, not by the rank
        "model": {"preset": "tiny", "dropout": 0.1},
        "data": {"synthetic_samples": 256, "vocab_size": 100},
        "sample": {"max_seq_length": 32, "max_predictions_per_seq": 5},
        "train": {"steps": 4, "global_batch_size": 16, "micro_batch_size": 4, "log_interval": 1, **train},
        "optim": {"name": "lamb", "lr": 0.01, "weight_decay": 0.01, "max_grad_norm": 1.0},
        "schedule": {"name": "poly", "warmup": 0.25},
        "checkpoint": {"save_interval": 2, "keep_last": 0, "export_final": False},
        "distributed": {"timeout_s": 120},
        "seed": 7,
        "output_dir": str(out),
    }


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, world_size: int, port: int) -> dict[str, str]:
    return {"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1"}


def _entry(rank: int, fn: Callable, world_size: int, port: int, args: tuple) -> None:
    os.environ.update(rank_env(rank, world_size, port))
    import torch
    torch.set_num_threads(1)
    fn(rank, world_size, *args)
    # The work is done (and asserted by the caller from its files): leave without the interpreter's teardown. Under
    # load a finished rank sometimes died in it of SIGABRT ("terminate called without an active exception": a torch
    # C++ thread destroyed while joinable), seen in 1 of 9 parallel runs of an FSDP test after both ranks had
    # finished; the CLI's processes exit normally and are not affected in the suite.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# The free port is released before rank 0 binds it, so another process can take it in between (rare): a run that
# failed only because of that is retried on a new port.
_PORT_TAKEN = ("Address already in use", "EADDRINUSE", "address already in use")
_PORT_TRIES = 3


def spawn(fn: Callable[..., Any], world_size: int, *args: Any) -> None:
    """Run fn(rank, world_size, *args) on `world_size` processes (a fresh process even for 1, so that global state
    — process group, RNG, threads — is isolated); raises if any fails."""
    for attempt in range(_PORT_TRIES):
        try:
            mp.start_processes(_entry, args=(fn, world_size, free_port(), args), nprocs=world_size, join=True,
                               start_method="spawn")
            return
        except mp.ProcessRaisedException as e:
            if attempt + 1 == _PORT_TRIES or not any(t in str(e) for t in _PORT_TAKEN):
                raise


def cli_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = str(REPO / "src") + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra or {})
    return env


def default_sigint() -> None:
    """`preexec_fn` of a child that a test sends SIGINT (Ctrl-C): SIGINT back to its default action in the child.

    A shell starts a background job (`cmd &` in a script) with SIGINT ignored, and an ignored signal stays ignored
    across fork and exec (`restore_signals` resets only SIGPIPE, SIGXFZ and SIGXFSZ), so a test suite started that
    way would start children that never see the Ctrl-C; Python installs its KeyboardInterrupt handler only when
    SIGINT is not ignored at start-up."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def wait_for_output(proc: subprocess.Popen, timeout: float) -> str:
    """The first line `proc` writes to its stdout pipe (its readiness signal), or AssertionError naming why not: it
    ended (with its stderr) or stayed silent for `timeout` seconds. Call it before anything else reads
    `proc.stdout` (select sees the pipe, not what Python has already buffered from it)."""
    deadline = time.monotonic() + timeout
    while not select.select([proc.stdout], [], [], 0.1)[0]:
        if proc.poll() is not None:
            raise AssertionError(f"exited {proc.returncode} before it was ready:\n{proc.stderr.read()[-3000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"not ready after {timeout:g} s")
    line = proc.stdout.readline()
    assert line, f"closed its output before it was ready (exit {proc.wait()}):\n{proc.stderr.read()[-3000:]}"
    return line


def launch_cli(world_size: int, argv: list[str], timeout: float = 300, cwd: str | Path | None = None
               ) -> list[subprocess.CompletedProcess]:
    """`python -m bertrain ARGV` on `world_size` processes (torchrun-style environment); waits for all."""
    for attempt in range(_PORT_TRIES):
        results = _launch_cli_once(world_size, argv, timeout, cwd)
        port_taken = any(r.returncode != 0 and any(t in r.stdout for t in _PORT_TAKEN) for r in results)
        if not port_taken or world_size == 1 or attempt + 1 == _PORT_TRIES:
            return results
    raise AssertionError("unreachable")


def _launch_cli_once(world_size: int, argv: list[str], timeout: float, cwd: str | Path | None
                     ) -> list[subprocess.CompletedProcess]:
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "bertrain", *argv], cwd=cwd,
                              env=cli_env(rank_env(r, world_size, port) if world_size > 1 else None),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(world_size)]
    return wait_all(procs, timeout)


def wait_all(procs: list[subprocess.Popen], timeout: float) -> list[subprocess.CompletedProcess]:
    """Each process's exit code and output (stdout piped, stderr merged); any still running at the end is killed,
    also when waiting fails or times out."""
    results = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            results.append(subprocess.CompletedProcess(p.args, p.returncode, out, None))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return results
