"""A job whose ranks never meet (a rank not started, a MASTER_ADDR the others cannot reach, MASTER_PORT in use): one
line saying what to check, exit 2, instead of torch's store traceback and "please report it" (exit 1)."""
from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import yaml

from distributed import base_config, cli_env, free_port, rank_env, wait_all


def test_ranks_that_never_meet_get_one_line_saying_what_to_check(tmp_path: Path) -> None:
    cfg = base_config(tmp_path / "out")
    cfg["distributed"] = {"timeout_s": 4, "heartbeat_interval_s": 1, "heartbeat_timeout_s": 2}
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump(cfg))
    argv = [sys.executable, "-m", "bertrain", "pretrain", "--config", str(config)]
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    ports = {"alone0": free_port(), "alone1": free_port(), "busy": busy.getsockname()[1]}
    try:  # the three at once: each waits out its 4 s timeout
        procs = [subprocess.Popen(argv, env=cli_env(rank_env(rank, 2, ports[name])), stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True)
                 for name, rank in (("alone0", 0), ("alone1", 1), ("busy", 0))]
        results = wait_all(procs, timeout=120)
    finally:
        busy.close()
    alone0, alone1, in_use = results
    for r in results:
        assert r.returncode == 2 and "Traceback" not in r.stdout, r.stdout[-3000:]
    line = alone0.stdout.strip().splitlines()[-1]
    assert line.startswith(f"bertrain pretrain: error: rank 0 waited 4 s (distributed.timeout_s) at "
                           f"127.0.0.1:{ports['alone0']} for the job's other ranks, and not all came: start every "
                           "rank with the same world size (2)"), line
    assert "1/2 clients joined" in line, line
    line = alone1.stdout.strip().splitlines()[-1]
    assert line.startswith(f"bertrain pretrain: error: rank 1 could not join the job at 127.0.0.1:{ports['alone1']} "
                           "(MASTER_ADDR:MASTER_PORT) within 4 s (distributed.timeout_s): check that rank 0 is "
                           "running"), line
    line = in_use.stdout.strip().splitlines()[-1]
    assert line.startswith(f"bertrain pretrain: error: rank 0 could not listen on port {ports['busy']} (MASTER_PORT) "
                           "of this host: it is in use"), line
    assert "EADDRINUSE" in line  # tests/distributed.py retries a launch on another port when it reads this
    assert not (tmp_path / "out").exists()  # nothing written
