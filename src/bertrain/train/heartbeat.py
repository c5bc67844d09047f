"""Heartbeats: how a rank notices another that stopped answering (run by `bertrain.train.watchdog.Watchdog`).

Every `distributed.heartbeat_interval_s` each rank writes a heartbeat (`heartbeat_value`: a counter, its step, pid
and host, and its status) under `HEARTBEAT_KEY` in the rendezvous store; rank 0 watches every rank, the others watch
rank 0. `HeartbeatMonitor` keeps what a watcher knows of each rank (`Peer`) and says, by the watcher's own clock (no
clock skew), which rank has been silent for `distributed.heartbeat_timeout_s`, which failed, and when the store itself
is gone. Pure: no threads of its own, no store I/O.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import threading
from dataclasses import dataclass, field
from typing import Any

from bertrain.train.distributed import rank_identities

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
                 store_host: int | None = None, identities: dict[int, dict[str, Any]] | None = None) -> None:
        self.timeout_s, self.collective_timeout_s = timeout_s, collective_timeout_s
        self.store_host = store_host
        self.peers = {r: Peer(r, now, info=dict((identities or {}).get(r, {}))) for r in ranks}
        self.store_lost: str | None = None
        """Why the rendezvous store stopped answering with an error (its host, rank 0, is gone)."""
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
            host = self.peers[self.store_host].name() if self.store_host in self.peers else "rank 0"
        return [(logging.ERROR, f"{host}, which holds the rendezvous store, is gone ({reason}): crashed or killed? "
                                "The other ranks stop at their next collective")]

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

    def culprits(self, now: float) -> list[str]:
        """Ranks known to have failed or to be silent for `timeout_s`, described for an error line."""
        with self._lock:
            failed = [f"{p.name()} failed: {p.failure}" for p in self.peers.values() if p.failure]
            silent = [f"{p.name()} has not answered for {now - p.seen_at:.0f} s" for p in self.peers.values()
                      if p.status == "running" and now - p.seen_at >= self.timeout_s
                      and not (self.store_lost and p.rank == self.store_host)]
            if self.store_lost and self.store_host in self.peers:
                failed.insert(0, f"{self.peers[self.store_host].name()} is gone (its rendezvous store: "
                                 f"{self.store_lost})")
        return failed + silent


def describe(rank: int, info: dict[str, Any]) -> str:
    """A rank named from a heartbeat read once (`Peer.name`), its pid and host from the rendezvous if it has none."""
    ids = rank_identities()
    return Peer(rank, 0.0, info={**(ids[rank] if rank < len(ids) else {}), **info}).name()
