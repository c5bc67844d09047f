"""Progress of the long phases of `vocab` and `prepare`: a tqdm bar on a terminal, a log line every ~10 s otherwise
(a CI or Slurm log gets a few lines with the rate and the time left, not a bar redrawn thousands of times)."""
from __future__ import annotations

import logging
import sys
import time
from typing import Any

from tqdm import tqdm

logger = logging.getLogger(__name__)

LOG_INTERVAL = 10.0  # seconds between two progress lines when stderr is not a terminal


def _amount(value: float, unit: str) -> str:
    if unit == "B":
        return f"{value / 1e6:,.1f} MB"
    return f"{value:,.0f} {unit}"


class Progress:
    """`with Progress("tokenizing", total=n_bytes) as p: ... p.set(done)` (or `p.update(k)`).

    `unit` "B" shows megabytes. A bar when stderr is a terminal (`bar=None`: decide by that), else an INFO line
    every `interval` seconds (default `LOG_INTERVAL`): "tokenizing: 12.3 MB of 45.6 MB (27%), 3.1 MB/s, about 11 s
    left"."""

    def __init__(self, desc: str, total: float | None = None, unit: str = "B", log: logging.Logger = logger,
                 interval: float | None = None, bar: bool | None = None) -> None:
        self.desc, self.total, self.unit, self.log = desc, total, unit, log
        self.interval = LOG_INTERVAL if interval is None else interval
        self.value = 0.0
        self.start = self.last = time.monotonic()
        use_bar = sys.stderr.isatty() if bar is None else bar
        self.bar = tqdm(total=total, desc=desc, unit=unit, unit_scale=True, unit_divisor=1000, leave=False,
                        dynamic_ncols=True, file=sys.stderr) if use_bar else None

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def update(self, n: float = 1) -> None:
        self.set(self.value + n)

    def set(self, value: float) -> None:
        if self.bar is not None:
            self.bar.update(value - self.value)
            self.value = value
            return
        self.value = value
        now = time.monotonic()
        if now - self.last >= self.interval:
            self.last = now
            self.log.info("%s", self.line(now))

    def line(self, now: float | None = None) -> str:
        elapsed = max((now or time.monotonic()) - self.start, 1e-9)
        rate = self.value / elapsed
        text = f"{self.desc}: {_amount(self.value, self.unit)}"
        if self.total:
            text += f" of {_amount(self.total, self.unit)} ({100 * self.value / self.total:.0f}%)"
        text += f", {_amount(rate, self.unit)}/s"
        if self.total and rate > 0 and self.value < self.total:
            text += f", about {(self.total - self.value) / rate:,.0f} s left"
        return text

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
