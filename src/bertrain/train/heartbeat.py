"""Heartbeats: how a rank notices another that stopped answering (started by `bertrain.train.watchdog.Watchdog`).

Every `distributed.heartbeat_interval_s` each rank writes a heartbeat (`heartbeat_value`: a counter, its step, pid
and host, and its status) under `HEARTBEAT_KEY` in the rendezvous store; rank 0 watches every rank, the others watch
rank 0.

* `HeartbeatMonitor` keeps what a watcher knows of each rank (`Peer`) and says, by the watcher's own clock (no clock
  skew), which rank has been silent for `distributed.heartbeat_timeout_s`, which failed, and when the store itself
  is gone. Pure: no threads of its own, no store I/O.
* `Heartbeat` is the I/O around it: the thread that writes this rank's heartbeat and reads the watched ones (on its
  own connection to the store), this rank's last word when it leaves ("done", or "failed" with its error), and
  `culprits`: the ranks to name when a collective fails, probing the store when none is known yet.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

from bertrain.train.config import DistributedConfig
from bertrain.train.distributed import DistInfo, heartbeat_store, rank_identities

log = logging.getLogger(__name__)

HEARTBEAT_KEY = "bertrain/hb/{rank}"


@dataclass
class Peer:
    """What a watcher knows of one rank from its heartbeats."""
    rank: int
    seen_at: float
    """Monotonic time (the watcher's clock) the heartbeat last changed, or the watch started."""
    raw: bytes | None = None
    info: dict[str, Any] = field(default_factory=dict)
    reported: bool = False
    failure_reported: bool = False

    def name(self) -> str:
        pid, host = self.info.get("pid"), self.info.get("host")
        if pid is None:
            return f"rank {self.rank} (no heartbeat yet)"
        return f"rank {self.rank} (pid {pid} on {host})"

    @property
    def status(self) -> str:
        return self.info.get("status", "running")

    @property
    def failure(self) -> str | None:
        return self.info.get("failure")


def heartbeat_value(beat: int, step: int, status: str = "running", failure: str | None = None) -> bytes:
    info: dict[str, Any] = {"beat": beat, "step": step, "pid": os.getpid(), "host": socket.gethostname(),
                            "status": status}
    if failure:
        info["failure"] = failure
    return json.dumps(info).encode()


class HeartbeatMonitor:
    """Staleness of the watched ranks' heartbeats, by the watcher's clock: `observe` feeds values, `check` returns
    the lines to log (each situation once). Thread-safe; no I/O."""

    def __init__(self, ranks: list[int], timeout_s: float, collective_timeout_s: float, now: float,
                 store_host: int | None = None, identities: dict[int, dict[str, Any]] | None = None,
                 store_owner: str | None = None) -> None:
        self.timeout_s, self.collective_timeout_s = timeout_s, collective_timeout_s
        self.store_host = store_host
        self.store_owner = store_owner
        """The process holding the store when no rank does (`store_host` None): torchrun's agent, the launcher."""
        self.peers = {r: Peer(r, now, info=dict((identities or {}).get(r, {}))) for r in ranks}
        self.store_lost: str | None = None
        """Why the rendezvous store stopped answering with an error (its holder, rank 0 or torchrun's agent, is
        gone)."""
        self._lock = threading.Lock()

    def observe(self, rank: int, raw: bytes | None, now: float) -> list[tuple[int, str]]:
        """A value read for `rank` (None: not written yet); returns lines to log (a rank back, a rank failed)."""
        out: list[tuple[int, str]] = []
        with self._lock:
            peer = self.peers[rank]
            if raw is None or raw == peer.raw:
                return out
            try:
                info = {**peer.info, **json.loads(raw)}
            except ValueError:
                info = dict(peer.info)
            if peer.reported:
                out.append((logging.WARNING, f"{peer.name()} answers again after {now - peer.seen_at:.0f} s"))
                peer.reported = False
            peer.raw, peer.info, peer.seen_at = raw, info, now
            if peer.failure and not peer.failure_reported:
                peer.failure_reported = True
                out.append((logging.ERROR, f"{peer.name()} failed: {peer.failure} (see its log); the other ranks "
                                           "stop at their next collective"))
        return out

    def lose_store(self, reason: str) -> list[tuple[int, str]]:
        """The store failed with an error (not a wait): the process holding it, rank 0, died or closed it."""
        with self._lock:
            if self.store_lost is not None:
                return []
            self.store_lost = reason
            if self.store_owner is not None and self.store_host is None:
                return [(logging.ERROR, f"{self.store_owner}, which holds the rendezvous store, is gone ({reason}): "
                                        "killed? Nothing watches, stops or restarts these workers any more, so every "
                                        "rank saves a checkpoint at the end of this step and stops (exit code 3); "
                                        "continue with --resume auto under a new launcher")]
            host = self.peers[self.store_host].name() if self.store_host in self.peers else "rank 0"
        return [(logging.ERROR, f"{host}, which holds the rendezvous store, is gone ({reason}): crashed or killed? "
                                "The other ranks stop at their next collective")]

    @property
    def launcher_gone(self) -> bool:
        """The store failed and its holder is the launcher, not a rank: the ranks themselves still run."""
        return self.store_lost is not None and self.store_owner is not None and self.store_host is None

    def check(self, now: float) -> list[tuple[int, str]]:
        """Lines for ranks silent for `timeout_s` (each reported once until it answers again)."""
        out = []
        with self._lock:
            for peer in self.peers.values():
                if peer.reported or peer.status != "running" or now - peer.seen_at < self.timeout_s:
                    continue
                peer.reported = True
                out.append((logging.WARNING, self.silence_message(peer, now)))
        return out

    def silence_message(self, peer: Peer, now: float) -> str:
        step = peer.info.get("step")
        last = f", last finished step {step}" if step else ""
        store = ", which holds the rendezvous store," if peer.rank == self.store_host else ""
        return (f"{peer.name()}{store} has not answered for {now - peer.seen_at:.0f} s{last}: stopped, swapped out "
                f"or hung? The job fails at the collective timeout (distributed.timeout_s = "
                f"{self.collective_timeout_s:g} s) unless it comes back")

    def silent(self, now: float, at_least_s: float) -> list[str]:
        """Running ranks silent for `at_least_s` or more, described for an error line."""
        with self._lock:
            return self._silent(now, at_least_s)

    def _silent(self, now: float, at_least_s: float) -> list[str]:  # holding the lock
        return [f"{p.name()} has not answered for {now - p.seen_at:.0f} s" for p in self.peers.values()
                if p.status == "running" and now - p.seen_at >= at_least_s
                and not (self.store_lost and p.rank == self.store_host)]

    def culprits(self, now: float) -> list[str]:
        """Ranks known to have failed or to be silent for `timeout_s`, described for an error line."""
        with self._lock:
            failed = [f"{p.name()} failed: {p.failure}" for p in self.peers.values() if p.failure]
            silent = self._silent(now, self.timeout_s)
            if self.store_lost and self.store_host in self.peers:
                failed.insert(0, f"{self.peers[self.store_host].name()} is gone (its rendezvous store: "
                                 f"{self.store_lost})")
            elif self.store_lost and self.store_owner is not None:
                failed.insert(0, f"{self.store_owner} is gone (its rendezvous store: {self.store_lost})")
        return failed + silent


class Heartbeat:
    """This rank's heartbeat (thread "bertrain-heartbeat"): `start` it, `check` from a watching thread, `culprits`
    when a collective fails, `stop` with this rank's last word and `join`. See the module docstring.

    Its threads leave the store before `join` and `culprits` return, unless the store stopped answering
    (`_wait_out`): a thread still inside a store call when the interpreter shuts down aborts the process."""

    def __init__(self, dist: DistInfo, cfg: DistributedConfig, store: Any, step: int = 0) -> None:
        self.dist, self.cfg, self._store = dist, cfg, store
        self.step = step
        """The last step this rank finished (set by `Watchdog.step_done`), written in each heartbeat."""
        rank, world = dist.rank, dist.world_size
        watched = [r for r in range(world) if r != rank] if rank == 0 else [0]
        owner = agent_store_owner()
        self.monitor = HeartbeatMonitor(watched, cfg.heartbeat_timeout_s, cfg.timeout_s, time.monotonic(),
                                        store_host=None if owner else 0,
                                        identities=dict(enumerate(rank_identities())), store_owner=owner)
        self._closing = threading.Event()
        self._thread: threading.Thread | None = None
        self._beat = 0
        self._in_store: dict[int, float] = {}
        """Since when each thread (by ident) now inside a store call entered it."""
        self._last_read = time.monotonic()
        self._store_broken = False
        self._final: tuple[str, str | None] | None = None

    @classmethod
    def start(cls, dist: DistInfo, cfg: DistributedConfig, step: int = 0) -> "Heartbeat | None":
        """This rank's heartbeat, running; None in a single process, with `heartbeat_timeout_s` 0, or without a
        usable store (no heartbeat is better than no training). `step` is the last step finished."""
        if dist.world_size == 1 or cfg.heartbeat_timeout_s <= 0:
            return None
        try:
            store = heartbeat_store(cfg.timeout_s)
            if store is None:
                return None
            store.set(HEARTBEAT_KEY.format(rank=dist.rank), heartbeat_value(0, step))
        except Exception as e:
            log.warning("no heartbeat: cannot use the rendezvous store (%s)", first_line(e))
            return None
        heartbeat = cls(dist, cfg, store, step)
        heartbeat._thread = threading.Thread(target=heartbeat._loop, name="bertrain-heartbeat", daemon=True)
        heartbeat._thread.start()
        return heartbeat

    def stop(self, status: str, failure: str | None = None) -> None:
        """Stop beating; the thread's last heartbeat says `status` ("done" or "failed", with `failure`)."""
        self._final = (status, failure)
        self._closing.set()

    def join(self) -> None:
        """Wait until the thread has written the last word and ended (after `stop`)."""
        if self._thread is not None:
            self._wait_out(self._thread)

    def _loop(self) -> None:
        present: set[int] = set()
        while not self._closing.wait(self.cfg.heartbeat_interval_s):
            try:
                self._beat += 1
                with self._using_store():
                    self._store.set(HEARTBEAT_KEY.format(rank=self.dist.rank),
                                    heartbeat_value(self._beat, self.step))
                    values = self._read(list(self.monitor.peers), present)
                now = self._last_read = time.monotonic()
                for r, raw in values.items():
                    for level, line in self.monitor.observe(r, raw, now):
                        log.log(level, "%s", line)
            except Exception as e:  # stop using a store that failed: its connection may be out of step
                self._store_broken = True
                if not is_timeout(e):  # an error, not a wait: the process holding the store is gone
                    for level, line in self.monitor.lose_store(first_line(e)):
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
            with self._using_store():
                self._store.set(HEARTBEAT_KEY.format(rank=self.dist.rank),
                                heartbeat_value(self._beat + 1, self.step, status, failure))
        except Exception as e:
            log.debug("heartbeat: final write failed: %s", e)

    @contextlib.contextmanager
    def _using_store(self) -> Iterator[None]:
        me = threading.get_ident()
        self._in_store[me] = time.monotonic()
        try:
            yield
        finally:
            del self._in_store[me]

    def _stuck(self, thread: threading.Thread | None, now: float) -> bool:
        """`thread` has waited inside a store call for more than two intervals: the store lives in rank 0, and a
        store that does not reply is a rank 0 that does not run (frozen, swapped out). Such a call returns only
        once rank 0 runs again or is gone, whatever the store's timeout."""
        since = self._in_store.get(thread.ident) if thread is not None and thread.ident is not None else None
        return since is not None and now - since > 2 * self.cfg.heartbeat_interval_s

    def _wait_out(self, thread: threading.Thread) -> None:
        """Join `thread` until it has ended, or until it is `_stuck` in the store.

        No fixed timeout: a daemon thread still inside a store call when the interpreter shuts down aborts the
        process ("terminate called without an active exception": torch releases the GIL around the call and takes
        it back in a noexcept destructor, where a finalizing interpreter ends the thread). A store that answers is
        waited for however loaded the machine; a stuck thread is left behind, as its call will not return before
        rank 0 runs again."""
        while thread.is_alive() and not self._stuck(thread, time.monotonic()):
            thread.join(timeout=0.05)

    def _horizon(self, now: float) -> float:
        """Up to when this rank has looked at the heartbeats: its last completed read, or now while the thread is
        `_stuck` in the store. So a rank that was itself frozen does not, once thawed, accuse the others."""
        if self._store_broken or self._stuck(self._thread, now):
            return now
        return self._last_read

    def check(self, now: float) -> None:
        """Log the ranks that went silent (each once), by what this rank has seen up to `now`."""
        for level, line in self.monitor.check(self._horizon(now)):
            log.log(level, "%s", line)

    def silent(self, now: float, at_least_s: float) -> list[str]:
        """The watched ranks silent for `at_least_s` or more, by what this rank has seen up to `now`."""
        return self.monitor.silent(self._horizon(now), at_least_s)

    def culprits(self, probe: bool) -> list[str]:
        """The ranks known to have failed or gone silent; with `probe`, when none is known, read every rank's
        heartbeat twice 1.5 intervals apart (in a helper thread, left behind if `_stuck`: the store may be frozen
        too)."""
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
                with self._using_store():
                    first = read(store)
                found.extend(f"{describe(r, info)} failed: {info['failure']}" for r, info in first.items()
                             if info.get("failure"))
                if found:
                    return
                time.sleep(self.cfg.heartbeat_interval_s * 1.5)
                with self._using_store():
                    second = read(store)
                found.extend(f"{describe(r, info)} stopped answering (its heartbeat stopped: crashed, killed or "
                             "frozen?)" for r, info in second.items()
                             if info == first[r] and info.get("status", "running") == "running")
            except Exception as e:
                self._store_broken = True
                if not is_timeout(e):
                    self.monitor.lose_store(first_line(e))
                found.extend(self.monitor.culprits(time.monotonic()))

        t = threading.Thread(target=run, name="bertrain-watchdog-probe", daemon=True)
        t.start()
        self._wait_out(t)
        return list(found)


def agent_store_owner(env: dict[str, str] | None = None) -> str | None:
    """Who holds the rendezvous store when it is not rank 0: torchrun's agent (the launcher process), whose store
    the workers share (`TORCHELASTIC_USE_AGENT_STORE`, see `train/launch.restart_isolated_store`); else None."""
    env = dict(os.environ) if env is None else env
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    where = f"{env.get('MASTER_ADDR', '?')}:{env.get('MASTER_PORT', '?')}"
    return f"torchrun's agent (the launcher, at {where})"


def is_timeout(e: BaseException) -> bool:
    text = str(e).lower()
    return "timed out" in text or "timeout" in text


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return (text.splitlines()[0] if text else type(e).__name__)[:160]


def describe(rank: int, info: dict[str, Any]) -> str:
    """A rank named from a heartbeat read once (`Peer.name`), its pid and host from the rendezvous if it has none."""
    ids = rank_identities()
    return Peer(rank, 0.0, info={**(ids[rank] if rank < len(ids) else {}), **info}).name()
