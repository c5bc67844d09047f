"""The watchdog (issue 12, item 7): a frozen rank is named within `distributed.heartbeat_timeout_s`; SIGTERM during
a hung collective exits (code 3) within `distributed.stop_grace_s` naming the last complete checkpoint; a collective
that times out or loses a peer ends in one line naming the rank (`RankLost`, code 1); SIGINT twice exits at once.

Unit tests of the pure parts (staleness, messages, classification, the signal thread in-process), then real
`bertrain pretrain` processes on gloo, frozen with SIGSTOP, crashed or signalled."""
from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

import pytest
import torch

from distributed import cli_env, free_port, rank_env, spawn

from bertrain.train.config import DistributedConfig
from bertrain.train.distributed import DistInfo
from bertrain.train import heartbeat as heartbeat_module
from bertrain.train.heartbeat import Heartbeat, HeartbeatMonitor, heartbeat_value
from bertrain.train.watchdog import (
    RankLost, StopSignal, Watchdog, collective_error, hang_message, last_complete_checkpoint, lost_message,
    resume_hint,
)
from bertrain.utils.errors import EXIT_FAILED, EXIT_STOPPED

HOST = socket.gethostname()
GLOO_TIMEOUT = RuntimeError("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting "
                            "8000ms for recv operation to complete")
GLOO_PEER_GONE = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
                              "[127.0.0.1]:60289. This is typically caused by a remote worker crashing.")


def value(beat: int, step: int = 3, pid: int = 42, host: str = "hostB", **extra: object) -> bytes:
    return json.dumps({"beat": beat, "step": step, "pid": pid, "host": host, "status": "running", **extra}).encode()


# ----------------------------------------------------------------------------------------------- pure parts

def test_a_silent_rank_is_reported_once_by_name_and_its_return_too() -> None:
    m = HeartbeatMonitor([1, 2], timeout_s=10, collective_timeout_s=300, now=0.0)
    assert m.observe(1, value(1, pid=41, host="hostA"), 0.0) == []
    assert m.observe(2, value(1), 0.0) == []
    assert m.check(9.9) == []
    m.observe(1, value(2, pid=41, host="hostA"), 8.0)  # rank 1 beats on, rank 2 does not
    m.observe(2, value(1), 8.0)  # the same value again is no sign of life
    lines = m.check(12.0)
    assert len(lines) == 1
    assert lines[0][1] == ("rank 2 (pid 42 on hostB) has not answered for 12 s, last finished step 3: stopped, "
                           "swapped out or hung? The job fails at the collective timeout (distributed.timeout_s = "
                           "300 s) unless it comes back")
    assert m.check(16.0) == []  # once
    assert m.culprits(16.0) == ["rank 2 (pid 42 on hostB) has not answered for 16 s"]
    back = m.observe(2, value(2), 17.0)
    assert back and back[0][1] == "rank 2 (pid 42 on hostB) answers again after 17 s"
    assert m.culprits(17.5) == []


def test_a_rank_that_never_wrote_a_heartbeat_is_still_named() -> None:
    m = HeartbeatMonitor([3], timeout_s=5, collective_timeout_s=60, now=100.0)
    m.observe(3, None, 103.0)
    assert m.check(106.0)[0][1].startswith("rank 3 (no heartbeat yet) has not answered for 6 s: ")
    # the pids and hosts gathered when the process group was created name it all the same
    m = HeartbeatMonitor([3], timeout_s=5, collective_timeout_s=60, now=100.0,
                         identities={3: {"pid": 9, "host": "nodeC"}})
    assert m.check(106.0)[0][1].startswith("rank 3 (pid 9 on nodeC) has not answered for 6 s: ")


def test_finished_and_failed_ranks() -> None:
    m = HeartbeatMonitor([1, 2], timeout_s=5, collective_timeout_s=60, now=0.0)
    m.observe(1, value(9, status="done"), 1.0)
    lines = m.observe(2, value(9, failure="ValueError: boom", status="failed"), 1.0)
    assert lines == [(40, "rank 2 (pid 42 on hostB) failed: ValueError: boom (see its log); the other ranks stop at "
                          "their next collective")]
    assert m.observe(2, value(9, failure="ValueError: boom", status="failed"), 2.0) == []  # once
    assert m.check(100.0) == []  # a finished or failed rank is not "silent"
    assert m.culprits(100.0) == ["rank 2 (pid 42 on hostB) failed: ValueError: boom"]


def test_a_silent_rank_0_is_named_as_the_store_host() -> None:
    m = HeartbeatMonitor([0], timeout_s=5, collective_timeout_s=60, now=0.0, store_host=0)
    m.observe(0, value(1, pid=7, host="head"), 0.0)
    assert m.check(6.0)[0][1].startswith("rank 0 (pid 7 on head), which holds the rendezvous store, has not "
                                         "answered for 6 s")


def test_a_store_that_fails_names_rank_0() -> None:
    m = HeartbeatMonitor([0], timeout_s=5, collective_timeout_s=60, now=0.0, store_host=0)
    m.observe(0, value(1, pid=7, host="head"), 0.0)
    line = m.lose_store("Broken pipe")
    assert line[0][1].startswith("rank 0 (pid 7 on head), which holds the rendezvous store, is gone (Broken pipe)")
    assert m.lose_store("again") == []
    assert m.culprits(100.0) == ["rank 0 (pid 7 on head) is gone (its rendezvous store: Broken pipe)"]


def test_a_store_held_by_torchruns_agent_names_the_launcher_not_rank_0() -> None:
    """Under torchrun the workers share the agent's store: its failure means the launcher is gone (rank 0 still
    runs), and the watchdog stops the run on it (`launcher_gone`). Before: "rank 0 (pid 7 on head) ... is gone"."""
    env = {"TORCHELASTIC_USE_AGENT_STORE": "True", "MASTER_ADDR": "head", "MASTER_PORT": "29400"}
    owner = heartbeat_module.agent_store_owner(env)
    assert owner == "torchrun's agent (the launcher, at head:29400)"
    assert heartbeat_module.agent_store_owner({"MASTER_ADDR": "head"}) is None  # srun, mpirun: rank 0 holds it
    m = HeartbeatMonitor([0], timeout_s=5, collective_timeout_s=60, now=0.0, store_host=None, store_owner=owner)
    m.observe(0, value(1, pid=7, host="head"), 0.0)
    assert not m.launcher_gone
    (level, line), = m.lose_store("Broken pipe")
    assert level == logging.ERROR and line.startswith(
        "torchrun's agent (the launcher, at head:29400), which holds the rendezvous store, is gone (Broken pipe): "
        "killed? Nothing watches, stops or restarts these workers any more, so every rank saves a checkpoint at the "
        "end of this step and stops (exit code 3)")
    assert m.launcher_gone
    assert m.culprits(1.0) == ["torchrun's agent (the launcher, at head:29400) is gone (its rendezvous store: "
                               "Broken pipe)"]
    rank0 = HeartbeatMonitor([0], timeout_s=5, collective_timeout_s=60, now=0.0, store_host=0)
    rank0.lose_store("Broken pipe")
    assert not rank0.launcher_gone  # a dead rank 0 fails the collectives anyway: RankLost, as before


def test_heartbeat_value_names_this_process() -> None:
    info = json.loads(heartbeat_value(3, 12, "failed", "OSError: disk full"))
    assert info == {"beat": 3, "step": 12, "pid": os.getpid(), "host": HOST, "status": "failed",
                    "failure": "OSError: disk full"}


def test_collective_errors_are_told_from_other_errors() -> None:
    assert collective_error(GLOO_TIMEOUT) == "timed out"
    assert collective_error(GLOO_PEER_GONE) == "a peer closed its connection"
    assert collective_error(ValueError("bad config")) is None
    assert collective_error(RuntimeError("CUDA out of memory. Tried to allocate 2 GiB")) is None
    assert collective_error(None) is None
    from torch.distributed import DistBackendError
    assert collective_error(DistBackendError("NCCL communicator was aborted")) == "NCCL communicator was aborted"


def _checkpoint(out: Path, step: int, complete: bool) -> Path:
    d = out / f"step-{step}"
    d.mkdir(parents=True)
    if complete:
        (d / "COMPLETE").write_text(f"{step}\n")
    return d


def test_last_complete_checkpoint_skips_an_unfinished_one(tmp_path: Path) -> None:
    assert last_complete_checkpoint(tmp_path / "missing") is None
    assert resume_hint(tmp_path) == (f"there is no complete checkpoint in {tmp_path} yet: --resume auto starts from "
                                     "step 0", None)
    good = _checkpoint(tmp_path, 10, True)
    _checkpoint(tmp_path, 20, False)  # killed while writing
    _checkpoint(tmp_path, 5, True)
    assert last_complete_checkpoint(tmp_path) == good
    assert resume_hint(tmp_path) == (f"the last complete checkpoint is {good}: continue with --resume auto", good)


def test_messages() -> None:
    hint = "the last complete checkpoint is out/step-10: continue with --resume auto"
    assert hang_message(0, 2, "SIGTERM", 20.4, 20, 12, ["rank 1 (pid 5 on b) has not answered for 75 s"], hint) == (
        "rank 0: SIGTERM 20 s ago and step 13 has not finished within distributed.stop_grace_s = 20 s: a collective "
        "is hung: rank 1 (pid 5 on b) has not answered for 75 s. Exiting without saving it (exit code 3); "
        + hint)
    assert "the step is slower than the grace: raise distributed.stop_grace_s" in hang_message(
        0, 1, "SIGINT", 1, 1, 0, [], hint)
    assert "every heartbeat is recent" in hang_message(1, 4, "SIGTERM", 1, 1, 0, [], hint)
    assert lost_message(0, 2, "timed out", 300, ["rank 1 (pid 5 on b) has not answered for 301 s"], hint) == (
        "rank 0: a collective timed out after distributed.timeout_s = 300 s: rank 1 (pid 5 on b) has not answered "
        "for 301 s. Nothing after the last checkpoint was saved; " + hint)
    assert "no rank could be named" in lost_message(1, 2, "a peer closed its connection", 300, [], hint)
    assert RankLost("x").exit_code == EXIT_FAILED


def test_heartbeat_and_grace_settings_that_cannot_work_are_refused_naming_the_key() -> None:
    # a healthy rank would be reported silent between two of its heartbeats
    with pytest.raises(ValueError, match="'distributed.heartbeat_timeout_s' \\(6\\) must be at least twice "
                                         "distributed.heartbeat_interval_s \\(5\\)"):
        DistributedConfig(heartbeat_interval_s=5, heartbeat_timeout_s=6)
    # the collective would fail before the heartbeat names the silent rank (the default heartbeat timeout too)
    with pytest.raises(ValueError, match="'distributed.heartbeat_timeout_s' \\(60\\) must not exceed "
                                         "distributed.timeout_s \\(30\\)"):
        DistributedConfig(timeout_s=30)
    with pytest.raises(ValueError, match="'distributed.stop_grace_s' must be > 0"):
        DistributedConfig(stop_grace_s=0)
    assert DistributedConfig(timeout_s=30, heartbeat_timeout_s=0).heartbeat_timeout_s == 0  # heartbeat off


def _timeout_worker(rank: int, world_size: int, out: str) -> None:
    import torch.distributed as torch_dist
    from bertrain.train.distributed import distributed_context, heartbeat_store
    cfg = DistributedConfig(backend="gloo", device="cpu", timeout_s=2, heartbeat_timeout_s=0)
    with distributed_context(cfg):
        seen = {"store_timeout_s": heartbeat_store(cfg.timeout_s).timeout.total_seconds()}
        deadline = time.monotonic() + 30
        while rank == 0 and not Path(out, "rank1.json").exists() and time.monotonic() < deadline:
            time.sleep(0.05)  # rank 1 waits for rank 0 in the all-reduce: until it gave up, or for 30 s
        t0 = time.monotonic()
        try:
            torch_dist.all_reduce(torch.ones(1))
            seen["error"] = None
        except Exception as e:
            seen["error"] = collective_error(e) or repr(e)
        seen["waited_s"] = time.monotonic() - t0
        Path(out, f"rank{rank}.json").write_text(json.dumps(seen))


@pytest.mark.slow
def test_a_collective_fails_after_the_configured_timeout(tmp_path: Path) -> None:
    """distributed.timeout_s is the process group's own timeout (torch's default would wait 1800 s) and the
    heartbeat's store connection's."""
    spawn(_timeout_worker, 2, str(tmp_path))
    waiting = json.loads((tmp_path / "rank1.json").read_text())
    assert waiting["error"] == "timed out" and 1.5 < waiting["waited_s"] < 15, waiting
    assert waiting["store_timeout_s"] == 2


# ----------------------------------------------------------------------------------------------- the signal thread

ONE = DistInfo(0, 1, 0, torch.device("cpu"), True)


class Exits:
    """Stands in for os._exit: records the code."""

    def __init__(self) -> None:
        self.codes: list[int] = []
        self.event = threading.Event()

    def __call__(self, code: int) -> None:
        self.codes.append(code)
        self.event.set()


@pytest.fixture
def exits() -> Exits:
    return Exits()


def test_sigterm_without_a_step_boundary_exits_after_the_grace(tmp_path: Path, exits: Exits,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    good = _checkpoint(tmp_path, 4, True)
    cfg = DistributedConfig(stop_grace_s=0.3)
    with StopSignal() as stop, Watchdog(ONE, cfg, stop, tmp_path, exit_fn=exits) as wd:
        wd.step_done(7)
        t0 = time.monotonic()
        os.kill(os.getpid(), signal.SIGTERM)
        assert exits.event.wait(5), "the watchdog did not end a step that outlived the grace"
        waited = time.monotonic() - t0
    assert stop.requested and exits.codes == [EXIT_STOPPED] and 0.25 < waited < 3
    text = caplog.text
    assert "received SIGTERM" in text
    assert re.search(r"SIGTERM \d s ago and step 8 has not finished within distributed.stop_grace_s = 0.3 s: the "
                     r"step is slower than the grace", text)
    assert f"the last complete checkpoint is {good}: continue with --resume auto" in text


def test_a_step_boundary_within_the_grace_leaves_the_stop_to_the_trainer(tmp_path: Path, exits: Exits) -> None:
    cfg = DistributedConfig(stop_grace_s=0.3)
    with StopSignal() as stop, Watchdog(ONE, cfg, stop, tmp_path, exit_fn=exits) as wd:
        os.kill(os.getpid(), signal.SIGINT)  # the first SIGINT is a polite stop: no KeyboardInterrupt
        time.sleep(0.1)
        wd.step_done(1)
        time.sleep(0.6)
    assert stop.requested and exits.codes == []


def _until(condition, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the watchdog thread did not see the signal"
        time.sleep(0.01)


def test_once_the_step_loop_is_over_the_grace_never_cuts_the_last_save(tmp_path: Path, exits: Exits) -> None:
    """`steps_over`: the trainer's loop has ended and the last checkpoint is being written. A stop signal that came
    between two steps (the grace armed, and no step boundary follows: the trainer stops at the end of the step it
    then starts and saves it) or that comes during that save must not end the process however long the save
    takes. Before: `stop_grace_s` after the signal the watchdog exited 3 mid-save ("step N+1 has not finished")."""
    cfg = DistributedConfig(stop_grace_s=5)  # the thread's own checks never reach it: the test's checks decide
    later = lambda: time.monotonic() + 10 * cfg.stop_grace_s  # noqa: E731 - long past the grace, without waiting
    with StopSignal() as stop, Watchdog(ONE, cfg, stop, tmp_path, exit_fn=exits) as wd:
        wd.step_done(2)
        os.kill(os.getpid(), signal.SIGTERM)  # while step 3's batches load
        _until(lambda: wd._stop_at is not None)
        wd.steps_over()  # step 3 ran and the loop returned: its save starts
        wd._check_grace(later())
        assert exits.codes == []
    with StopSignal() as stop, Watchdog(ONE, cfg, stop, tmp_path, exit_fn=exits) as wd:
        wd.step_done(5)
        wd.steps_over()  # the last step's save
        os.kill(os.getpid(), signal.SIGTERM)
        _until(lambda: wd._stop_at is not None)
        wd._check_grace(later())
        assert exits.codes == [] and stop.requested
        os.kill(os.getpid(), signal.SIGINT)  # but a second SIGINT still exits at once
        assert exits.event.wait(5)
    assert exits.codes == [EXIT_STOPPED]
    # while the loop runs, the grace still ends a step that outlived it
    exits.codes.clear()
    with StopSignal() as stop, Watchdog(ONE, cfg, stop, tmp_path, exit_fn=exits) as wd:
        wd.step_done(2)
        os.kill(os.getpid(), signal.SIGTERM)
        _until(lambda: wd._stop_at is not None)
        wd._check_grace(later())
        assert exits.codes == [EXIT_STOPPED]


def test_a_second_sigint_exits_at_once(tmp_path: Path, exits: Exits, caplog: pytest.LogCaptureFixture) -> None:
    cfg = DistributedConfig(stop_grace_s=60)
    with StopSignal() as stop, Watchdog(ONE, cfg, stop, tmp_path, exit_fn=exits) as wd:
        wd.step_done(3)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGINT)  # handled by the watchdog: no KeyboardInterrupt in the main thread
        assert exits.event.wait(5)
    assert exits.codes == [EXIT_STOPPED]
    assert "second SIGINT: exiting now without saving step 4 (exit code 3); there is no complete checkpoint" \
        in caplog.text


def test_without_a_watchdog_a_second_sigint_still_interrupts() -> None:
    with pytest.raises(KeyboardInterrupt), StopSignal() as stop:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)
        assert stop.requested
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)


def test_signal_handlers_and_wakeup_fd_are_restored(tmp_path: Path, exits: Exits) -> None:
    before = signal.getsignal(signal.SIGTERM)
    with StopSignal() as stop, Watchdog(ONE, DistributedConfig(), stop, tmp_path, exit_fn=exits):
        assert signal.getsignal(signal.SIGTERM) == stop._handle
    assert signal.getsignal(signal.SIGTERM) == before
    assert signal.set_wakeup_fd(-1) == -1  # none left behind
    assert not [t for t in threading.enumerate() if t.name.startswith("bertrain-watchdog")]


def test_a_forked_child_does_not_signal_into_the_parents_watchdog(tmp_path: Path, exits: Exits) -> None:
    """DataLoader workers are forked: their Ctrl-C must not count as the parent's second SIGINT."""
    with StopSignal() as stop, Watchdog(ONE, DistributedConfig(stop_grace_s=60), stop, tmp_path, exit_fn=exits):
        pid = os.fork()
        if pid == 0:  # the child gets SIGINT (as a whole process group does on Ctrl-C) and leaves
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.1)
            os._exit(0)
        os.waitpid(pid, 0)
        time.sleep(0.3)
        assert not stop.requested
    assert exits.codes == []


# ----------------------------------------------------------------------------------------------- leaving the store

class SlowStore:
    """A rendezvous store whose reads take `delay` seconds (None: until `release`), like a loaded or a frozen rank 0;
    `reading` is set once a read has begun."""

    def __init__(self, delay: float | None) -> None:
        self.delay, self.values = delay, {}
        self.reading, self.release = threading.Event(), threading.Event()

    def set(self, key: str, value: bytes) -> None:
        self.values[key] = value

    def check(self, keys: list[str]) -> bool:
        self.reading.set()
        self.release.wait(self.delay)
        return all(k in self.values for k in keys)


def heartbeat_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "bertrain-heartbeat"]


def test_the_heartbeat_leaves_a_slow_store_before_the_rank_goes_on_and_a_frozen_one_behind(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A thread still inside a store call when the interpreter shuts down aborts the process ("terminate called
    without an active exception"): `join` waits for a store that answers, however slowly (here longer than the fixed
    2 s the watchdog once gave it), and leaves behind only a thread waiting on a rank 0 silent for two intervals."""
    rank1 = DistInfo(1, 2, 1, torch.device("cpu"), False)
    slow = SlowStore(delay=2.5)
    monkeypatch.setattr(heartbeat_module, "heartbeat_store", lambda timeout_s: slow)
    heartbeat = Heartbeat.start(rank1, DistributedConfig(timeout_s=60, heartbeat_interval_s=2, heartbeat_timeout_s=4))
    assert heartbeat is not None and slow.reading.wait(timeout=30)
    heartbeat.stop("done")
    heartbeat.join()
    assert heartbeat_threads() == []
    assert json.loads(slow.values["bertrain/hb/1"])["status"] == "done"  # its last word, after the read

    frozen = SlowStore(delay=None)
    monkeypatch.setattr(heartbeat_module, "heartbeat_store", lambda timeout_s: frozen)
    cfg = DistributedConfig(timeout_s=60, heartbeat_interval_s=0.5, heartbeat_timeout_s=1)
    heartbeat = Heartbeat.start(rank1, cfg)
    assert heartbeat is not None and frozen.reading.wait(timeout=30)
    heartbeat.stop("done")
    t0 = time.monotonic()
    heartbeat.join()
    assert time.monotonic() - t0 < 2 * cfg.heartbeat_interval_s + 2 and len(heartbeat_threads()) == 1
    frozen.release.set()  # rank 0 runs again: the thread leaves, and says its last word
    for t in heartbeat_threads():
        t.join(timeout=30)
    assert heartbeat_threads() == [] and json.loads(frozen.values["bertrain/hb/1"])["status"] == "done"


# ----------------------------------------------------------------------------------------------- long barrier

def _barrier_worker(rank: int, world_size: int, out: str) -> None:
    import bertrain.train.distributed as distributed
    from bertrain.train.config import DistributedConfig
    from bertrain.train.distributed import barrier, distributed_context
    timeout_s = 2
    with distributed_context(DistributedConfig(backend="gloo", device="cpu", timeout_s=timeout_s,
                                               heartbeat_timeout_s=0)):
        waited = Path(out, "rank1-waited")
        if rank == 0:  # slow: rank 0 arrives once rank 1 has waited twice as long as any collective may wait
            deadline = time.monotonic() + 120
            while not waited.exists():  # readiness: rank 1 says so from inside the barrier (however loaded)
                assert time.monotonic() < deadline, "rank 1 never reported a long enough wait at the barrier"
                time.sleep(0.05)
        else:  # the barrier's own "still waiting" lines, every 0.2 s here, tell when 2 x timeout_s have passed
            distributed.LONG_WAIT_LOG_S = 0.2
            arrived = time.monotonic()

            class Waited(logging.Handler):
                def emit(self, record: logging.LogRecord) -> None:
                    if "still waiting for" in record.getMessage() and time.monotonic() - arrived >= 2 * timeout_s:
                        waited.touch()
            logger = logging.getLogger(distributed.__name__)
            logger.setLevel(logging.INFO)  # other ranks are quieted to warnings
            logger.addHandler(Waited())
        barrier(waiting_for="rank 0 to prepare the data", poll_s=0.1)
        barrier()  # the group is still usable
        Path(out, f"rank{rank}").write_text("passed")


@pytest.mark.slow
def test_a_long_barrier_outlasts_the_collective_timeout(tmp_path: Path) -> None:
    spawn(_barrier_worker, 2, str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0", "rank1", "rank1-waited"]


# ----------------------------------------------------------------------------------------------- real runs

CRASH_ON_USR1 = ("import signal, sys\n"
                 "def boom(signum, frame):\n"
                 "    raise RuntimeError('injected failure')\n"
                 "signal.signal(signal.SIGUSR1, boom)\n"
                 "from bertrain.cli import main\n"
                 "sys.exit(main(sys.argv[1:]))\n")


def run_config(out: Path, **distributed: float) -> dict:
    return {
        "model": {"preset": "tiny", "dropout": 0.0},
        "data": {"synthetic_samples": 4096, "vocab_size": 100},
        "sample": {"max_seq_length": 32, "max_predictions_per_seq": 5},
        "train": {"steps": 100_000, "global_batch_size": 16, "micro_batch_size": 4, "log_interval": 10},
        "optim": {"name": "lamb", "lr": 0.01},
        "checkpoint": {"save_interval": 5, "keep_last": 2, "export_final": False},
        "distributed": {"timeout_s": 60, "heartbeat_interval_s": 0.5, "heartbeat_timeout_s": 3, "stop_grace_s": 3,
                        **distributed},
        "seed": 7,
        "output_dir": str(out),
    }


class Proc:
    """One `bertrain pretrain` process whose output is read as it comes (so a full pipe never blocks it)."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        # faulthandler on: a process that outlives its deadline is sent SIGABRT, which prints every thread's stack
        self.p = subprocess.Popen(argv, env={**env, "PYTHONFAULTHANDLER": "1"}, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True)
        self.lines: list[tuple[float, str]] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.p.stdout is not None
        for line in self.p.stdout:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    @property
    def pid(self) -> int:
        return self.p.pid

    @property
    def output(self) -> str:
        return "\n".join(line for _, line in self.lines)

    def wait_for(self, pattern: str, timeout: float) -> tuple[float, str]:
        """(time, line) of the first line matching `pattern`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for t, line in list(self.lines):
                if re.search(pattern, line):
                    return t, line
            if self.p.poll() is not None and not self._reader.is_alive():
                break
            time.sleep(0.05)
        raise AssertionError(f"no line matching {pattern!r} within {timeout} s; output:\n{self.output[-4000:]}")

    def wait(self, timeout: float) -> tuple[int, float]:
        """(exit code, time it exited); a process still running after `timeout` fails the test with its output."""
        try:
            rc = self.p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.kill(self.pid, signal.SIGCONT)
            os.kill(self.pid, signal.SIGABRT)  # faulthandler: where each of its threads is
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.p.wait(timeout=10)
            self._reader.join(timeout=10)
            raise AssertionError(f"pid {self.pid} still running after {timeout} s; its output, then its threads' "
                                 f"stacks:\n{self.output[-8000:]}") from None
        t = time.monotonic()
        self._reader.join(timeout=10)
        return rc, t

    def kill(self) -> None:
        if self.p.poll() is None:
            os.kill(self.p.pid, signal.SIGCONT)
            self.p.kill()
        self.p.wait(timeout=30)
        self._reader.join(timeout=10)


@contextlib.contextmanager
def launch(tmp_path: Path, world: int, cfg: dict, wrap: dict[int, str] | None = None) -> Iterator[list[Proc]]:
    """`world` ranks of `bertrain pretrain` on `cfg`; every one is continued (if stopped) and killed at the end."""
    config = tmp_path / "run.json"
    config.write_text(json.dumps(cfg))
    port = free_port()
    procs = []
    try:
        for r in range(world):
            head = ["-c", wrap[r]] if wrap and r in wrap else ["-m", "bertrain"]
            env = cli_env(rank_env(r, world, port) if world > 1 else None)
            procs.append(Proc([sys.executable, *head, "pretrain", "--config", str(config)], env))
        yield procs
    finally:
        for p in procs:
            p.kill()


def wait_for_checkpoint(out: Path, procs: list[Proc], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not last_complete_checkpoint(out):
        if time.monotonic() > deadline or any(p.p.poll() is not None for p in procs):
            raise AssertionError("no checkpoint was written:\n" + "\n----\n".join(p.output[-3000:] for p in procs))
        time.sleep(0.1)


@pytest.mark.slow
def test_frozen_rank_is_named_and_sigterm_exits_naming_the_last_checkpoint(tmp_path: Path) -> None:
    out = tmp_path / "out"
    cfg = run_config(out)
    with launch(tmp_path, 2, cfg) as procs:
        r0, r1 = procs
        wait_for_checkpoint(out, procs)
        os.kill(r1.pid, signal.SIGSTOP)
        t_stop = time.monotonic()
        t_named, line = r0.wait_for(r"rank 1 \(pid \d+ on .*\) has not answered for", timeout=30)
        assert f"rank 1 (pid {r1.pid} on {HOST})" in line and "distributed.timeout_s = 60 s" in line
        assert t_named - t_stop < cfg["distributed"]["heartbeat_timeout_s"] + 4, t_named - t_stop
        os.kill(r0.pid, signal.SIGTERM)  # rank 0 is blocked in a collective with the frozen rank
        t_term = time.monotonic()
        rc, t_exit = r0.wait(timeout=60)
        assert rc == EXIT_STOPPED, r0.output[-3000:]
        assert t_exit - t_term < cfg["distributed"]["stop_grace_s"] + 5, t_exit - t_term
        last = last_complete_checkpoint(out)
        _, line = r0.wait_for(r"has not finished within distributed.stop_grace_s", timeout=1)
        assert f"rank 1 (pid {r1.pid} on {HOST}) has not answered for" in line
        assert f"the last complete checkpoint is {last}: continue with --resume auto" in line
        assert "Traceback" not in r0.output


@pytest.mark.slow
def test_collective_timeout_names_the_frozen_rank_in_one_line(tmp_path: Path) -> None:
    out = tmp_path / "out"
    cfg = run_config(out, timeout_s=8)
    with launch(tmp_path, 2, cfg) as procs:
        r0, r1 = procs
        wait_for_checkpoint(out, procs)
        os.kill(r1.pid, signal.SIGSTOP)
        t_stop = time.monotonic()
        rc, t_exit = r0.wait(timeout=120)
        assert rc == EXIT_FAILED, r0.output[-3000:]
        assert t_exit - t_stop < 8 + 15, t_exit - t_stop  # at the collective timeout, not after 1800 s
        _, line = r0.wait_for(r"a collective timed out after distributed.timeout_s = 8 s", timeout=1)
        assert f"rank 1 (pid {r1.pid} on {HOST}) has not answered for" in line
        assert f"the last complete checkpoint is {last_complete_checkpoint(out)}: continue with --resume auto" in line
        assert "Traceback" not in r0.output  # one line, not gloo's traceback


@pytest.mark.slow
def test_a_frozen_rank_0_holding_the_store_is_named_by_the_others(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with launch(tmp_path, 2, run_config(out, timeout_s=8)) as procs:
        r0, r1 = procs
        wait_for_checkpoint(out, procs)
        os.kill(r0.pid, signal.SIGSTOP)  # the rendezvous store runs in rank 0's process: it stops too
        t_stop = time.monotonic()
        t_named, line = r1.wait_for(r"rank 0 \(pid \d+ on .*\), which holds the rendezvous store, has not answered",
                                    timeout=30)
        assert f"rank 0 (pid {r0.pid} on {HOST})" in line and t_named - t_stop < 3 + 4
        rc, _ = r1.wait(timeout=120)
        assert rc == EXIT_FAILED, r1.output[-3000:]
        # in a collective (a step), or in the store while rank 0 finished writing the checkpoint just seen complete
        _, line = r1.wait_for(r"a collective timed out after distributed.timeout_s = 8 s|waited \d+ s in the "
                              r"rendezvous store for rank 0 to write checkpoint step-\d+, .* longer than "
                              r"distributed.timeout_s = 8 s", timeout=1)
        assert f"rank 0 (pid {r0.pid} on {HOST}) has not answered for" in line
        assert f"the last complete checkpoint is {last_complete_checkpoint(out)}" in line


FREEZE_IN_SECOND_SAVE = ("import os, signal, sys\n"
                         "from bertrain.train import checkpoint\n"
                         "save, saves = checkpoint.save_checkpoint, []\n"
                         "def frozen(*args, **kwargs):\n"
                         "    saves.append(1)\n"
                         "    if len(saves) == 2:\n"
                         "        print('freezing in the second checkpoint write', flush=True)\n"
                         "        os.kill(os.getpid(), signal.SIGSTOP)\n"
                         "    return save(*args, **kwargs)\n"
                         "checkpoint.save_checkpoint = frozen\n"
                         "from bertrain.cli import main\n"
                         "sys.exit(main(sys.argv[1:]))\n")


@pytest.mark.slow
@pytest.mark.parametrize("heartbeat", [True, False], ids=["heartbeat", "no-heartbeat"])
def test_a_rank_0_frozen_while_the_others_wait_for_its_checkpoint_fails_the_job(heartbeat: bool,
                                                                               tmp_path: Path) -> None:
    """The others wait for rank 0's checkpoint write in the rendezvous store (no time limit: a big checkpoint on a
    slow filesystem must not fail the job), but the store lives in rank 0: a frozen rank 0 would block them for
    good. The watchdog ends such a wait once the heartbeat has been silent for distributed.timeout_s; with the
    heartbeat off the write is waited for in a collective, whose timeout ends it."""
    out = tmp_path / "out"
    cfg = run_config(out, timeout_s=8, **({} if heartbeat else {"heartbeat_timeout_s": 0}))
    with launch(tmp_path, 2, cfg, wrap={0: FREEZE_IN_SECOND_SAVE}) as procs:
        r0, r1 = procs
        t_frozen, _ = r0.wait_for("freezing in the second checkpoint write", timeout=120)
        rc, t_exit = r1.wait(timeout=60)
        assert rc == EXIT_FAILED, r1.output[-3000:]
        assert t_exit - t_frozen < 8 + 8, t_exit - t_frozen  # the timeout, then a few heartbeat intervals
        if not heartbeat:
            _, line = r1.wait_for(r"a collective timed out after distributed.timeout_s = 8 s", timeout=1)
            assert "step-5: continue with --resume auto" in line, line
            return
        _, line = r1.wait_for(r"waited \d+ s in the rendezvous store for rank 0 to write checkpoint step-10", timeout=1)
        assert f"rank 0 (pid {r0.pid} on {HOST}) has not answered for" in line, line
        assert "longer than distributed.timeout_s = 8 s" in line and "step-5: continue with --resume auto" in line


@pytest.mark.slow
def test_a_crashed_rank_is_named_by_the_others(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with launch(tmp_path, 2, run_config(out), wrap={1: CRASH_ON_USR1}) as procs:
        r0, r1 = procs
        wait_for_checkpoint(out, procs)
        os.kill(r1.pid, signal.SIGUSR1)  # rank 1 raises RuntimeError('injected failure') in its step
        t_crash = time.monotonic()
        rc1, _ = r1.wait(timeout=60)
        assert rc1 != 0 and "RuntimeError: injected failure" in r1.output
        rc, t_exit = r0.wait(timeout=60)
        assert rc == EXIT_FAILED, r0.output[-3000:]
        assert t_exit - t_crash < 15, t_exit - t_crash  # at once, not at the collective timeout
        _, line = r0.wait_for(r"a collective failed \(a peer closed its connection\)", timeout=1)
        assert f"rank 1 (pid {r1.pid} on {HOST}) failed: RuntimeError: injected failure" in line
        assert f"the last complete checkpoint is {last_complete_checkpoint(out)}" in line


@pytest.mark.slow
def test_a_killed_rank_is_named_by_the_others(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with launch(tmp_path, 2, run_config(out)) as procs:
        r0, r1 = procs
        wait_for_checkpoint(out, procs)
        os.kill(r1.pid, signal.SIGKILL)  # no exception, no last word: only its silence names it
        rc, _ = r0.wait(timeout=60)
        assert rc == EXIT_FAILED, r0.output[-3000:]
        _, line = r0.wait_for(r"a collective failed", timeout=1)
        assert f"rank 1 (pid {r1.pid} on {HOST}) stopped answering (its heartbeat stopped" in line


@pytest.mark.slow
def test_a_healthy_two_rank_run_reports_nothing(tmp_path: Path) -> None:
    out = tmp_path / "out"
    cfg = run_config(out, heartbeat_interval_s=0.2, heartbeat_timeout_s=2)
    cfg["train"]["steps"] = 40
    with launch(tmp_path, 2, cfg) as procs:
        for p in procs:
            rc, _ = p.wait(timeout=300)
            assert rc == 0, p.output[-3000:]
            assert "has not answered" not in p.output and "watchdog" not in p.output


def long_step_config(out: Path, grace: float) -> dict:
    """One rank, steps of a few seconds (256 micro-batches each), log every step."""
    cfg = run_config(out, stop_grace_s=grace)
    cfg["train"].update(steps=1000, global_batch_size=2048, micro_batch_size=8, log_interval=1)
    cfg["checkpoint"]["save_interval"] = 1
    return cfg


@pytest.mark.slow
def test_sigterm_during_a_step_longer_than_the_grace_exits_naming_the_checkpoint(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with launch(tmp_path, 1, long_step_config(out, grace=0.5)) as (p,):
        p.wait_for(r"saved checkpoint .*step-1$", timeout=120)  # step 2 (seconds long) has just begun
        os.kill(p.pid, signal.SIGTERM)
        t_term = time.monotonic()
        rc, t_exit = p.wait(timeout=60)
        assert rc == EXIT_STOPPED, p.output[-3000:]
        assert t_exit - t_term < 0.5 + 3
        _, line = p.wait_for(r"SIGTERM \d s ago and step 2 has not finished within distributed.stop_grace_s = 0.5 s",
                             timeout=1)
        assert line.endswith("the step is slower than the grace: raise distributed.stop_grace_s to let it finish and "
                             f"save. Exiting without saving it (exit code 3); the last complete checkpoint is "
                             f"{out / 'step-1'}: continue with --resume auto")


@pytest.mark.slow
def test_sigint_twice_exits_at_once_without_a_traceback(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with launch(tmp_path, 1, long_step_config(out, grace=60)) as (p,):
        p.wait_for(r"saved checkpoint .*step-1$", timeout=120)
        os.kill(p.pid, signal.SIGINT)
        time.sleep(0.3)
        os.kill(p.pid, signal.SIGINT)
        t_int = time.monotonic()
        rc, t_exit = p.wait(timeout=60)
        assert rc == EXIT_STOPPED, p.output[-3000:]
        assert t_exit - t_int < 3
        assert (f"second SIGINT: exiting now without saving step 2 (exit code 3); the last complete checkpoint is "
                f"{out / 'step-1'}: continue with --resume auto") in p.output
        assert "Traceback" not in p.output and "KeyboardInterrupt" not in p.output


@pytest.mark.slow
def test_sigterm_on_a_healthy_run_still_saves_and_exits_3(tmp_path: Path) -> None:
    out = tmp_path / "out"
    cfg = run_config(out)
    cfg["train"]["log_interval"] = 1
    with launch(tmp_path, 1, cfg) as (p,):
        p.wait_for(r"step 3/", timeout=120)
        os.kill(p.pid, signal.SIGTERM)
        rc, _ = p.wait(timeout=60)
        _, line = p.wait_for(r"stop requested \(signal\): saving step \d+", timeout=1)
        step = int(re.search(r"saving step (\d+)", line).group(1))
        assert last_complete_checkpoint(out) == out / f"step-{step}"
        assert "has not finished" not in p.output and "Traceback" not in p.output
        assert rc == EXIT_STOPPED, p.output[-3000:]  # the CLI's RunStopped -> 3 (issue 12 item 9)
