"""Run code on N local gloo processes (127.0.0.1, a free port), like mosaicml/streaming's tests/common.

Two ways: `spawn(fn, world_size, *args)` runs a picklable function in N `torch.multiprocessing` processes with
the torchrun environment variables set (the code under test calls `init_distributed` itself);
`launch_cli(world_size, argv)` runs `python -m bertrain …` as N subprocesses the same way torchrun would.
Each process gets OMP_NUM_THREADS=1 so that 4 ranks share 2 cores without oversubscription.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[1]


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


def spawn(fn: Callable[..., Any], world_size: int, *args: Any) -> None:
    """Run fn(rank, world_size, *args) on `world_size` processes; raises if any fails."""
    port = free_port()
    if world_size == 1:  # still a fresh process, so global state (process group, RNG, threads) is isolated
        mp.start_processes(_entry, args=(fn, 1, port, args), nprocs=1, join=True, start_method="spawn")
        return
    mp.start_processes(_entry, args=(fn, world_size, port, args), nprocs=world_size, join=True,
                       start_method="spawn")


def cli_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = str(REPO / "src") + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra or {})
    return env


def launch_cli(world_size: int, argv: list[str], timeout: float = 300, cwd: str | Path | None = None
               ) -> list[subprocess.CompletedProcess]:
    """`python -m bertrain ARGV` on `world_size` processes (torchrun-style environment); waits for all."""
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "bertrain", *argv], cwd=cwd,
                              env=cli_env(rank_env(r, world_size, port) if world_size > 1 else None),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(world_size)]
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
