"""Stopping cleanly: SIGTERM / SIGINT ask every rank to save the same step and exit.

`StopSignal` sets a flag that the trainer's per-step all-reduce shares with every rank.
"""
from __future__ import annotations

import logging
import signal
import threading
from typing import Any

log = logging.getLogger(__name__)


class StopSignal:
    """SIGTERM / SIGINT set a flag; the loop saves at the end of the step and exits (all ranks agree via the
    per-step all-reduce). A second SIGINT interrupts at once."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = True
        log.warning("received %s: will save a checkpoint at the end of this step and stop",
                    signal.Signals(signum).name)

    def __enter__(self) -> "StopSignal":
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
