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
* **A rank that stopped answering** (`bertrain.train.heartbeat`). Every `distributed.heartbeat_interval_s` each
  rank writes a heartbeat (a counter, its step, pid and host) to the rendezvous store; rank 0 watches every rank,
  the others watch rank 0. A heartbeat unchanged for `distributed.heartbeat_timeout_s` (by the watcher's own
  clock: no clock skew) is reported once, naming the rank, its pid and host; a rank that fails with an exception
  says so in its heartbeat. A SIGSTOPped or swapped-out process's threads stop too, so its heartbeat goes stale.
* **A collective that failed** (gloo's timeout after `distributed.timeout_s`, a peer's connection closed): leaving
  the `with` block turns it into `RankLost`, one line naming the rank that stopped answering (if known) and the
  last complete checkpoint, instead of gloo's 80-line traceback.

Exit codes (`bertrain.utils.errors`): a stop that a signal asked for is `EXIT_STOPPED` (3) even when the step in
flight could not be saved: the run is resumable from the checkpoint named, as a scheduler that requeues on 3
expects. A collective that failed without any signal is `RankLost.exit_code` = `EXIT_FAILED` (1): the job failed
(a rank crashed or froze) and needs a look; and since `srun` reports the highest exit code of a job's tasks and
torchrun the first failure, the survivors of a crashed rank (1, traceback) must not claim a clean stop (3).

The per-step cost is one attribute write (`step_done`); at world size 1 there is no heartbeat, only the signal
thread, which sleeps in `select`.
"""
from __future__ import annotations

import json
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
from bertrain.train.distributed import DistInfo, heartbeat_store, rank_identities
from bertrain.train.heartbeat import HEARTBEAT_KEY, HeartbeatMonitor, describe, heartbeat_value
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
    loop; `watchdog.step_done(step)` once per step, at the end of the step (after its periodic save)."""

    def __init__(self, dist: DistInfo, cfg: DistributedConfig, stop: StopSignal, output_dir: str | Path,
                 exit_fn: Callable[[int], None] = os._exit) -> None:
        self.dist, self.cfg, self.stop, self.output_dir = dist, cfg, stop, Path(output_dir)
        self.step = 0
        """The last step finished (`step_done`)."""
        self._boundaries = 0
        self._exit_fn = exit_fn
        self._closing = threading.Event()
        self._threads: list[threading.Thread] = []
        self._rfd = self._wfd = -1
        self._previous_wakeup: int | None = None
        self._deliveries = 0
        self._stop_at: float | None = None
        self._boundaries_at_stop = 0
        self._grace_over = False
        self._exited = False
        self.monitor: HeartbeatMonitor | None = None
        self._store: Any = None
        self._beat = 0
        self._store_busy_since: float | None = None
        self._last_read = 0.0
        self._store_broken = False
        self._final: tuple[str, str | None] | None = None

    # -- the trainer's side

    def step_done(self, step: int) -> None:
        """A step boundary: the step finished (and its periodic checkpoint, if any, is written)."""
        self.step = step
        self._boundaries += 1

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
        if self.dist.world_size > 1 and self.cfg.heartbeat_timeout_s > 0:
            self._start_heartbeat()
        if self._rfd >= 0 or self.monitor is not None:
            self._spawn(self._watch_loop, "bertrain-watchdog")
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        if self._store is not None:
            failure = None
            if exc is not None and collective_error(exc) is None:
                failure = f"{type(exc).__name__}: {exc}".splitlines()[0][:300] if str(exc) else type(exc).__name__
            self._final = ("failed" if exc is not None else "done", failure)
        message = self.explain(exc) if exc is not None else None
        self._close()
        if message is not None:
            raise RankLost(message, last_complete_checkpoint(self.output_dir)) from exc

    def _close(self) -> None:
        self._closing.set()
        if self._rfd >= 0:
            signal.set_wakeup_fd(self._previous_wakeup if self._previous_wakeup is not None else -1)
            self.stop.watched = False
            try:
                os.write(self._wfd, b"\0")  # wake the thread
            except OSError:
                pass
        for t in self._threads:
            t.join(timeout=2.0)
        if self._rfd >= 0:
            _ACTIVE_FDS.clear()
            for fd in (self._rfd, self._wfd):
                os.close(fd)
            self._rfd = self._wfd = -1

    def _spawn(self, target: Callable[[], None], name: str) -> None:
        t = threading.Thread(target=target, name=name, daemon=True)
        t.start()
        self._threads.append(t)

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
                self._check_peers(now)
            except Exception:  # the watchdog must never take the run down by itself
                log.debug("watchdog loop error", exc_info=True)
                if self._rfd < 0 and self.monitor is None:
                    return
                time.sleep(1.0)

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
        if self._boundaries != self._boundaries_at_stop:
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

    # -- heartbeat (thread "bertrain-heartbeat")

    def _start_heartbeat(self) -> None:
        rank, world = self.dist.rank, self.dist.world_size
        try:
            store = heartbeat_store(self.cfg.timeout_s)
            if store is None:
                return
            store.set(HEARTBEAT_KEY.format(rank=rank), heartbeat_value(0, self.step))
        except Exception as e:  # no heartbeat is better than no training
            log.warning("no heartbeat: cannot use the rendezvous store (%s)", _first_line(e))
            return
        self._store = store
        watched = [r for r in range(world) if r != rank] if rank == 0 else [0]
        self.monitor = HeartbeatMonitor(watched, self.cfg.heartbeat_timeout_s, self.cfg.timeout_s, time.monotonic(),
                                        store_host=0, identities=dict(enumerate(rank_identities())))
        self._last_read = time.monotonic()
        self._spawn(self._heartbeat_loop, "bertrain-heartbeat")

    def _heartbeat_loop(self) -> None:
        present: set[int] = set()
        assert self.monitor is not None
        while not self._closing.wait(self.cfg.heartbeat_interval_s):
            try:
                self._store_busy_since = time.monotonic()
                self._beat += 1
                self._store.set(HEARTBEAT_KEY.format(rank=self.dist.rank), heartbeat_value(self._beat, self.step))
                values = self._read(list(self.monitor.peers), present)
                now = self._last_read = time.monotonic()
                self._store_busy_since = None
                for r, raw in values.items():
                    for level, line in self.monitor.observe(r, raw, now):
                        log.log(level, "%s", line)
            except Exception as e:  # stop using a store that failed: its connection may be out of step
                self._store_busy_since = None
                self._store_broken = True
                if not _is_timeout(e):  # an error, not a wait: the process holding the store is gone
                    for level, line in self.monitor.lose_store(_first_line(e)):
                        log.log(level, "%s", line)
                return
        self._write_final()

    def _read(self, ranks: list[int], present: set[int]) -> dict[int, bytes]:
        """Heartbeat values of `ranks` (a missing key is checked first: reading one would block)."""
        for r in ranks:
            if r not in present and self._store.check([HEARTBEAT_KEY.format(rank=r)]):
                present.add(r)
        have = sorted(r for r in ranks if r in present)
        if not have:
            return {}
        raws = self._store.multi_get([HEARTBEAT_KEY.format(rank=r) for r in have])
        return {r: bytes(v) for r, v in zip(have, raws)}

    def _write_final(self) -> None:
        """The last heartbeat: "done" (not silent: finished) or "failed" with this rank's error."""
        if self._final is None or self._store_broken:
            return
        status, failure = self._final
        try:
            self._store.set(HEARTBEAT_KEY.format(rank=self.dist.rank),
                            heartbeat_value(self._beat + 1, self.step, status, failure))
        except Exception as e:
            log.debug("heartbeat: final write failed: %s", e)

    def _horizon(self, now: float) -> float:
        """Up to when this rank has looked at the heartbeats: its last completed read, or now while a read has been
        waiting for more than two intervals (the store lives in rank 0: a store that does not reply is a rank 0
        that does not run). So a rank that was itself frozen does not, once thawed, accuse the others."""
        busy = self._store_busy_since
        if self._store_broken or (busy is not None and now - busy > 2 * self.cfg.heartbeat_interval_s):
            return now
        return self._last_read

    def _check_peers(self, now: float) -> None:
        if self.monitor is None:
            return
        for level, line in self.monitor.check(self._horizon(now)):
            log.log(level, "%s", line)

    def _culprits(self, probe: bool) -> list[str]:
        """The ranks known to have failed or gone silent; with `probe`, when none is known, read every rank's
        heartbeat twice one interval apart (in a helper thread, bounded in time: the store may be gone too)."""
        if self.monitor is None:
            return []
        known = self.monitor.culprits(self._horizon(time.monotonic()))
        if known or not probe or self._store_broken:
            return known
        found: list[str] = []
        ranks = [r for r in range(self.dist.world_size) if r != self.dist.rank]

        def read(store: Any) -> dict[int, dict[str, Any]]:
            out = {}
            for r in ranks:
                key = HEARTBEAT_KEY.format(rank=r)
                out[r] = json.loads(bytes(store.get(key))) if store.check([key]) else {}
            return out

        def run() -> None:
            try:
                store = self._store  # this connection: a new one to a dead store would retry for the timeout
                first = read(store)
                found.extend(f"{describe(r, info)} failed: {info['failure']}" for r, info in first.items()
                             if info.get("failure"))
                if found:
                    return
                time.sleep(self.cfg.heartbeat_interval_s * 1.5)
                second = read(store)
                found.extend(f"{describe(r, info)} stopped answering (its heartbeat stopped: crashed, killed or "
                             "frozen?)" for r, info in second.items()
                             if info == first[r] and info.get("status", "running") == "running")
            except Exception as e:
                assert self.monitor is not None
                self._store_broken = True
                if not _is_timeout(e):
                    self.monitor.lose_store(_first_line(e))
                found.extend(self.monitor.culprits(time.monotonic()))

        t = threading.Thread(target=run, name="bertrain-watchdog-probe", daemon=True)
        t.start()
        t.join(timeout=self.cfg.heartbeat_interval_s * 2 + 5)
        return list(found)


def _is_timeout(e: BaseException) -> bool:
    text = str(e).lower()
    return "timed out" in text or "timeout" in text


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return (text.splitlines()[0] if text else type(e).__name__)[:160]


