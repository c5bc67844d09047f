"""The launcher itself dies: `kill -9` of the torchrun agent (an OOM kill, a `pkill -9 torchrun`).

torchrun's workers share the agent's rendezvous store (TORCHELASTIC_USE_AGENT_STORE), but their gloo collectives
are peer to peer: orphaned, they train on, unwatched, holding their GPUs and the output folder, and with nothing
left to stop or restart them. They notice when the store fails (the heartbeat's connection to it breaks): every
rank then saves the same step and stops, as on SIGTERM, naming the launcher (not rank 0, which still runs)."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from distributed import cli_env

pytestmark = pytest.mark.slow

BIN = Path(sys.executable).parent
STEPS = 100_000  # far more than the test waits for: only a stop ends the workers in time


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"  # an orphan's zombie, not yet reaped by whoever adopted it, has stopped


def _wait(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def test_workers_whose_torchrun_agent_was_killed_save_a_step_and_stop(tmp_path: Path) -> None:
    """Before: the heartbeat said "rank 0 (pid P), which holds the rendezvous store, is gone: crashed or killed? The
    other ranks stop at their next collective" while rank 0 trained on with the others to the last step (300 of
    300 in the trial), then the first store barrier (the final export) failed with a traceback, exit 1."""
    from bertrain.train import checkpoint as ckpt

    config = tmp_path / "tiny.json"
    config.write_text(json.dumps({
        "model": {"preset": "tiny"}, "data": {"synthetic_samples": 256, "vocab_size": 100},
        "sample": {"max_seq_length": 32, "max_predictions_per_seq": 5},
        "train": {"steps": STEPS, "global_batch_size": 16, "micro_batch_size": 4, "log_interval": 1},
        "optim": {"name": "lamb", "lr": 0.01}, "checkpoint": {"save_interval": 1000, "keep_last": 0},
        "distributed": {"timeout_s": 60, "heartbeat_interval_s": 0.5, "heartbeat_timeout_s": 5}, "seed": 7}))
    out, log_file = tmp_path / "run", tmp_path / "log.txt"
    with open(log_file, "w") as log:
        agent = subprocess.Popen([str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2", "-m", "bertrain",
                                  "pretrain", "--config", str(config), "--output", str(out)],
                                 env=cli_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    workers: list[int] = []
    try:
        _wait(lambda: re.search(r"step 5/", log_file.read_text()) is not None or agent.poll() is not None, 120,
              "the run did not reach step 5")
        text = log_file.read_text()
        workers = [int(p) for p in re.findall(r"rank \d: local rank \d on \S+ \(pid (\d+)", text)]
        assert len(workers) == 2 and agent.poll() is None, text[-3000:]
        os.kill(agent.pid, signal.SIGKILL)
        agent.wait()
        _wait(lambda: not any(_alive(p) for p in workers), 60,
              "the workers trained on after their launcher was killed")
    finally:
        for pid in workers:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        if agent.poll() is None:
            agent.kill()
            agent.wait()
    text = log_file.read_text()
    assert "torchrun's agent (the launcher, at " in text and "which holds the rendezvous store, is gone" in text, \
        text[-3000:]
    assert "which holds the rendezvous store, is gone" not in text.split("torchrun's agent")[0]  # not rank 0
    assert "Traceback" not in text, text[-3000:]
    stopped = re.findall(r"stopped: stopped by a signal at step (\d+) after saving", text)
    assert len(stopped) == 2 and stopped[0] == stopped[1], text[-3000:]
    step = int(stopped[0])
    assert 5 < step < STEPS
    assert [s for s, _ in ckpt.list_checkpoints(out)] == [step]
    assert ckpt.verify_checkpoint(out / f"step-{step}") is None
