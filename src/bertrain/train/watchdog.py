"""Stopping cleanly, and noticing a rank that stopped answering.

`StopSignal`: SIGTERM / SIGINT set a flag that the trainer's per-step all-reduce shares with every rank, so every
rank saves the same step and exits.

`Watchdog` covers what that flag cannot:

* **A signal during a hung collective.** Python runs signal handlers only in the main thread, between bytecodes; a
  main thread blocked in a gloo/NCCL collective never runs them. `signal.set_wakeup_fd` makes the C-level handler
  write the signal number to a pipe at once, whatever the main thread does; the watchdog thread reads it, sets the
  stop flag, and if the loop has not reached its next step boundary `distributed.stop_grace_s` later, logs one line
  (the rank that stopped answering if known, the last complete checkpoint) and exits with `EXIT_STOPPED`. A second
  SIGINT exits at once the same way.
* **A rank that stopped answering** (`bertrain.train.heartbeat.Heartbeat`, started and watched from here). Every
  `distributed.heartbeat_interval_s` each rank writes a heartbeat (a counter, its step, pid and host) to the
  rendezvous store; rank 0 watches every rank, the others watch rank 0. A heartbeat unchanged for
  `distributed.heartbeat_timeout_s` (by the watcher's own clock: no clock skew) is reported once, naming the rank,
  its pid and host; a rank that fails with an exception says so in its heartbeat. A SIGSTOPped or swapped-out
  process's threads stop too, so its heartbeat goes stale.
* **A collective that failed** (gloo's timeout after `distributed.timeout_s`, a peer's connection closed): leaving
  the `with` block turns it into `RankLost`, one line naming the rank that stopped answering (if known) and the
  last complete checkpoint, instead of gloo's 80-line traceback.

Exit codes (`bertrain.utils.errors`): a stop that a signal asked for is `EXIT_STOPPED` (3) even when the step in
flight could not be saved: the run is resumable from the checkpoint named, as a scheduler that requeues on 3
expects. A collective that failed without any signal is `RankLost.exit_code` = `EXIT_FAILED` (1): the job failed
(a rank crashed or froze) and needs a look; and since `srun` reports the highest exit code of a job's tasks and
torchrun the first failure, the survivors of a crashed rank (1, traceback) must not claim a clean stop (3).

The per-step cost is a few attribute writes (`step_done`); at world size 1 there is no heartbeat, only the signal
thread, which sleeps in `select`.
"""
from __future__ import annotations

import logging
import os
import select
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

from bertrain.train.checkpoint import COMPLETE, list_checkpoints
from bertrain.train.config import DistributedConfig
from bertrain.train.distributed import DistInfo, store_wait
from bertrain.train.heartbeat import Heartbeat
from bertrain.utils.errors import EXIT_FAILED, EXIT_STOPPED

log = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopSignal:
    """SIGTERM / SIGINT set a flag; the loop saves at the end of the step and exits (all ranks agree via the
    per-step all-reduce). A second SIGINT interrupts at once: `KeyboardInterrupt`, or, while a `Watchdog` watches
    the signals, the watchdog's immediate exit (which works even inside a hung collective)."""

    def __init__(self) -> None:
        self.requested = False
        self.signum: int | None = None
        self.watched = False
        """Set by `Watchdog` while its thread sees every signal: it then counts them and handles a second SIGINT."""
        self._previous: dict[int, Any] = {}
        self._lock = threading.Lock()

    def request(self, signum: int) -> bool:
        """Ask to stop (from the handler or the watchdog thread); True the first time, which is logged."""
        with self._lock:
            if self.requested:
                return False
            self.requested, self.signum = True, signum
        log.warning("received %s: will save a checkpoint at the end of this step and stop",
                    signal.Signals(signum).name)
        return True

    def request_for(self, reason: str) -> bool:
        """Ask to stop for `reason`, not a signal (the watchdog: the launcher is gone); True the first time."""
        with self._lock:
            if self.requested:
                return False
            self.requested = True
        log.warning("%s: will save a checkpoint at the end of this step and stop", reason)
        return True

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested and signum == signal.SIGINT and not self.watched:
            raise KeyboardInterrupt
        self.request(signum)

    def __enter__(self) -> "StopSignal":
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


class RankLost(RuntimeError):
    """A collective failed because a rank died or stopped answering. The message is one line naming it (if known)
    and the last complete checkpoint, from which `--resume auto` continues; `__cause__` is torch's error."""

    exit_code = EXIT_FAILED

    def __init__(self, message: str, checkpoint: Path | None = None) -> None:
        super().__init__(message)
        self.checkpoint = checkpoint


# ----------------------------------------------------------------------------------------------- pure parts

def last_complete_checkpoint(output_dir: str | Path) -> Path | None:
    """The newest `step-N` folder with its COMPLETE marker (no checksums: cheap enough for a process about to be
    killed; `--resume auto` verifies them)."""
    complete = [p for _, p in list_checkpoints(output_dir) if (p / COMPLETE).exists()]
    return complete[-1] if complete else None


def resume_hint(output_dir: str | Path) -> tuple[str, Path | None]:
    """(the sentence naming the last complete checkpoint and how to continue, that checkpoint)."""
    last = last_complete_checkpoint(output_dir)
    if last is None:
        return f"there is no complete checkpoint in {output_dir} yet: --resume auto starts from step 0", None
    return f"the last complete checkpoint is {last}: continue with --resume auto", last


def collective_error(exc: BaseException | None) -> str | None:
    """A short reason if `exc` is a failed collective (gloo/NCCL timeout, a peer gone), else None."""
    if exc is None:
        return None
    try:
        from torch.distributed import DistError
    except ImportError:  # pragma: no cover - torch without distributed
        DistError = ()  # type: ignore[assignment,misc]
    text = str(exc)
    low = text.lower()
    markers = ("gloo", "nccl", "timed out waiting", "connection closed by peer", "connection reset by peer",
               "broken pipe", "processgroup", "socket timeout")
    if not isinstance(exc, DistError) and not (isinstance(exc, RuntimeError) and any(m in low for m in markers)):
        return None
    if "timed out" in low or "timeout" in low:
        return "timed out"
    if "closed by peer" in low or "reset by peer" in low or "broken pipe" in low:
        return "a peer closed its connection"
    first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    return first[:200]


def hang_message(rank: int, world_size: int, signame: str, waited_s: float, grace_s: float, step: int,
                 culprits: list[str], hint: str) -> str:
    """The one line logged when the step in flight did not finish within the grace after a stop signal."""
    who = f"rank {rank}: " if world_size > 1 else ""
    if culprits:
        why = "a collective is hung: " + "; ".join(culprits)
    elif world_size > 1:
        why = ("a collective may be hung (every heartbeat is recent), or the step is slower than the grace: raise "
               "distributed.stop_grace_s for slow steps")
    else:
        why = "the step is slower than the grace: raise distributed.stop_grace_s to let it finish and save"
    return (f"{who}{signame} {waited_s:.0f} s ago and step {step + 1} has not finished within distributed.stop_grace_s"
            f" = {grace_s:g} s: {why}. Exiting without saving it (exit code {EXIT_STOPPED}); {hint}")


def lost_message(rank: int, world_size: int, reason: str, collective_timeout_s: float, culprits: list[str],
                 hint: str) -> str:
    """The one line of `RankLost`: a collective failed."""
    who = f"rank {rank}: " if world_size > 1 else ""
    what = (f"a collective timed out after distributed.timeout_s = {collective_timeout_s:g} s" if reason == "timed out"
            else f"a collective failed ({reason})")
    named = "; ".join(culprits) if culprits else ("no rank could be named (the other heartbeats are recent or "
                                                  "unreadable: see the other ranks' logs)")
    return f"{who}{what}: {named}. Nothing after the last checkpoint was saved; {hint}"


# ----------------------------------------------------------------------------------------------- the watchdog

_ACTIVE_FDS: list[int] = []  # the signal pipe of the active watchdog, closed in forked children


def _forget_in_child() -> None:
    """A forked child (a DataLoader worker) must not write its signals into the parent's watchdog pipe: one Ctrl-C
    reaching the parent and its workers would count as several."""
    if not _ACTIVE_FDS:
        return
    try:
        signal.set_wakeup_fd(-1)
    except (ValueError, OSError):
        pass
    for fd in _ACTIVE_FDS:
        try:
            os.close(fd)
        except OSError:
            pass
    _ACTIVE_FDS.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


def _flush_logs() -> None:
    for handler in logging.getLogger().handlers + log.handlers:
        try:
            handler.flush()
        except Exception:
            pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass


class Watchdog:
    """`with StopSignal() as stop, Watchdog(dist, cfg.distributed, stop, output_dir) as watchdog:` around the step
    loop; `watchdog.step_done(step)` once per step, at the end of the step (after its periodic save);
    `watchdog.steps_over()` once the loop has ended, before the last save.

    Its thread ("bertrain-watchdog") handles the signals and the stop grace, and logs what the rank's `Heartbeat`
    (`bertrain.train.heartbeat`, multi-process runs) has seen; leaving the block turns a failed collective into
    `RankLost`."""

    def __init__(self, dist: DistInfo, cfg: DistributedConfig, stop: StopSignal, output_dir: str | Path,
                 exit_fn: Callable[[int], None] = os._exit) -> None:
        self.dist, self.cfg, self.stop, self.output_dir = dist, cfg, stop, Path(output_dir)
        self.step = 0
        """The last step finished (`step_done`)."""
        self.heartbeat: Heartbeat | None = None
        """This rank's heartbeat while the block runs (None at world size 1, or with the heartbeat off)."""
        self._boundaries = 0
        self._exit_fn = exit_fn
        self._closing = threading.Event()
        self._thread: threading.Thread | None = None
        self._rfd = self._wfd = -1
        self._previous_wakeup: int | None = None
        self._deliveries = 0
        self._stop_at: float | None = None
        self._boundaries_at_stop = 0
        self._grace_over = False
        self._steps_over = False
        self._exited = False

    # -- the trainer's side

    def step_done(self, step: int) -> None:
        """A step boundary: the step finished (and its periodic checkpoint, if any, is written)."""
        self.step = step
        self._boundaries += 1
        if self.heartbeat is not None:
            self.heartbeat.step = step

    def steps_over(self) -> None:
        """The step loop has ended (its last step finished: the run's end, a stop signal, a time budget, an early
        stop). No step is in flight any more, so the stop grace, armed or not, no longer applies: what remains in
        the block is the last checkpoint's save, which a signal must not cut however long it takes (a collective
        hung in it still fails after `distributed.timeout_s`, as `RankLost`). A second SIGINT still exits at once.

        Why the trainer must say so: it shares a stop flag at the start of a step, so a signal that lands before
        that (while the step's batches load) stops the run at the end of that step and saves it without another
        `step_done`; without this call the grace kept running through that step and the save, and cut the save."""
        self._steps_over = True

    def explain(self, exc: BaseException) -> str | None:
        """One line for a failed collective (who stopped answering, the last complete checkpoint), or None if
        `exc` is not one. Leaving the `with` block raises `RankLost` with it, so callers rarely need this."""
        reason = collective_error(exc)
        if reason is None or self.dist.world_size == 1:
            return None
        culprits = self._culprits(probe=True)
        hint, _ = resume_hint(self.output_dir)
        return lost_message(self.dist.rank, self.dist.world_size, reason, self.cfg.timeout_s, culprits, hint)

    # -- context manager

    def __enter__(self) -> "Watchdog":
        if threading.current_thread() is threading.main_thread():
            self._rfd, self._wfd = os.pipe()
            os.set_blocking(self._rfd, False)
            os.set_blocking(self._wfd, False)
            self._previous_wakeup = signal.set_wakeup_fd(self._wfd, warn_on_full_buffer=False)
            _ACTIVE_FDS[:] = [self._rfd, self._wfd]
            self.stop.watched = True
        self.heartbeat = Heartbeat.start(self.dist, self.cfg, self.step)
        if self._rfd >= 0 or self.heartbeat is not None:
            self._thread = threading.Thread(target=self._watch_loop, name="bertrain-watchdog", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        final: tuple[str, str | None] = ("done", None)
        if exc is not None:
            failure = None
            if collective_error(exc) is None:
                failure = f"{type(exc).__name__}: {exc}".splitlines()[0][:300] if str(exc) else type(exc).__name__
            final = ("failed", failure)
        message = self.explain(exc) if exc is not None else None
        self._close(final)
        if message is not None:
            raise RankLost(message, last_complete_checkpoint(self.output_dir)) from exc

    def _close(self, final: tuple[str, str | None]) -> None:
        self._closing.set()
        if self.heartbeat is not None:
            self.heartbeat.stop(*final)
        if self._rfd >= 0:
            signal.set_wakeup_fd(self._previous_wakeup if self._previous_wakeup is not None else -1)
            self.stop.watched = False
            try:
                os.write(self._wfd, b"\0")  # wake the thread
            except OSError:
                pass
        if self._thread is not None:
            self._thread.join(timeout=2.0)  # it makes no torch call: left behind, it cannot abort the exit
        if self.heartbeat is not None:
            self.heartbeat.join()
        if self._rfd >= 0:
            _ACTIVE_FDS.clear()
            for fd in (self._rfd, self._wfd):
                os.close(fd)
            self._rfd = self._wfd = -1

    def _culprits(self, probe: bool) -> list[str]:
        return self.heartbeat.culprits(probe) if self.heartbeat is not None else []

    # -- signals and the grace period (thread "bertrain-watchdog")

    def _watch_loop(self) -> None:
        while not self._closing.is_set():
            try:
                ready, _, _ = select.select([self._rfd] if self._rfd >= 0 else [], [], [], self._wait_s())
                if self._closing.is_set():
                    return
                if ready:
                    try:
                        data = os.read(self._rfd, 512)
                    except BlockingIOError:
                        data = b""
                    for signum in data:
                        self._on_signal(signum)
                now = time.monotonic()
                self._check_grace(now)
                if self.heartbeat is not None:
                    self.heartbeat.check(now)
                    self._check_store_wait(now)
                    if self.heartbeat.monitor.launcher_gone and not self.stop.requested:
                        # the ranks still run and their collectives work: they stop together at a step boundary
                        self.stop.request_for(f"rank {self.dist.rank}: the launcher is gone")
            except Exception:  # the watchdog must never take the run down by itself
                log.debug("watchdog loop error", exc_info=True)
                if self._rfd < 0 and self.heartbeat is None:
                    return
                time.sleep(1.0)

    def _check_store_wait(self, now: float) -> None:
        """End a wait in the rendezvous store (rank 0 writing a checkpoint or the best model while the others wait)
        whose rank has been silent for longer than `distributed.timeout_s`: a collective would have failed by then,
        but a store held by a frozen rank 0 never answers, and the job would hang for good."""
        waiting = store_wait()
        if waiting is None or now - waiting[0] < self.cfg.timeout_s:
            return
        assert self.heartbeat is not None  # called only while the heartbeat runs
        silent = self.heartbeat.silent(now, self.cfg.timeout_s)
        if not silent:
            return
        hint, _ = resume_hint(self.output_dir)
        self._die(EXIT_FAILED, f"rank {self.dist.rank}: waited {now - waiting[0]:.0f} s in the rendezvous store for "
                               f"{waiting[1]}, and {'; '.join(silent)}: longer than distributed.timeout_s = "
                               f"{self.cfg.timeout_s:g} s, so the job fails as a collective would (exit code "
                               f"{EXIT_FAILED}); {hint} once it is fixed")

    def _wait_s(self) -> float:
        if self._stop_at is not None and not self._grace_over:
            return max(0.05, min(1.0, self._stop_at + self.cfg.stop_grace_s - time.monotonic()))
        return 1.0

    def _on_signal(self, signum: int) -> None:
        if signum not in STOP_SIGNALS:
            return
        self._deliveries += 1
        name = signal.Signals(signum).name
        if self._deliveries == 1:
            self._stop_at, self._boundaries_at_stop = time.monotonic(), self._boundaries
            self.stop.request(signum)
        elif signum == signal.SIGINT:
            hint, _ = resume_hint(self.output_dir)
            who = f"rank {self.dist.rank}: " if self.dist.world_size > 1 else ""
            self._die(EXIT_STOPPED, f"{who}second SIGINT: exiting now without saving step {self.step + 1} "
                                    f"(exit code {EXIT_STOPPED}); {hint}")
        else:
            log.warning("received %s again: still stopping at the end of step %d", name, self.step + 1)

    def _check_grace(self, now: float) -> None:
        if self._stop_at is None or self._grace_over:
            return
        if self._steps_over or self._boundaries != self._boundaries_at_stop:
            self._grace_over = True  # the loop reached a step boundary: the stop is in the trainer's hands
            return
        if now - self._stop_at < self.cfg.stop_grace_s:
            return
        self._grace_over = True
        hint, _ = resume_hint(self.output_dir)
        signame = signal.Signals(self.stop.signum or signal.SIGTERM).name
        self._die(EXIT_STOPPED, hang_message(self.dist.rank, self.dist.world_size, signame, now - self._stop_at,
                                             self.cfg.stop_grace_s, self.step, self._culprits(probe=False), hint))

    def _die(self, code: int, message: str) -> None:
        if self._exited:
            return
        self._exited = True

        def say() -> None:
            log.error("%s", message)
            _flush_logs()

        # logged from a helper thread: a log stream blocked (a stalled pipe) must not keep a hung job alive
        t = threading.Thread(target=say, name="bertrain-watchdog-exit", daemon=True)
        t.start()
        t.join(timeout=5.0)
        self._exit_fn(code)
