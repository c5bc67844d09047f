"""Seeing what happens: `metrics.jsonl` (one JSON object per logged step or evaluation), handed on to the
trackers (TensorBoard, MLflow, W&B: `train/trackers.py`), and a PNG plot of loss, accuracy and throughput at the
end. Only the main rank creates a logger with `enabled=True`."""
from __future__ import annotations

import io
import json
import logging
import math
import sys
from pathlib import Path
from typing import Any

from bertrain.utils.io import atomic_write_bytes

log = logging.getLogger(__name__)


def _finite(value: Any) -> Any:
    """`value` with every inf/NaN float, nested ones too (an evaluation's metrics), as None: metrics.jsonl is standard
    JSON, which has no NaN (json.dumps would write the bare token, which jq and JavaScript refuse)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


class MetricsLogger:
    """Append records to OUTPUT/metrics.jsonl and hand them to the run's trackers (`train/trackers.py`)."""

    def __init__(self, output_dir: str | Path, enabled: bool = True, resume_step: int | None = None,
                 trackers: Any = None) -> None:
        self.enabled = enabled
        self.path = Path(output_dir) / "metrics.jsonl"
        self.trackers = trackers
        self._file = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step is not None and self.path.exists():
            self._truncate_after(resume_step)
        elif resume_step is None and self.path.exists():
            self.path.unlink()  # a fresh run starts a fresh file
        self._file = open(self.path, "a", encoding="utf-8")

    def _truncate_after(self, step: int) -> None:
        """Drop lines a killed run wrote after the checkpoint we resume from, so each step appears once. The file
        is replaced whole (a full disk or a kill while it is written leaves the old one, every line intact)."""
        from bertrain.utils.errors import writing
        from bertrain.utils.io import atomic_write_text
        text = self.path.read_text(encoding="utf-8")
        keep = []
        for line in text.splitlines():
            try:
                if json.loads(line).get("step", 0) <= step:
                    keep.append(line)
            except (json.JSONDecodeError, AttributeError):  # a line cut by the kill
                continue
        new = "".join(k + "\n" for k in keep)
        if new != text:
            with writing(f"dropping the records after step {step} from {self.path}",
                         kept=f"{self.path} is unchanged"):
                atomic_write_text(self.path, new)

    def log(self, record: dict[str, Any]) -> None:
        if not self.enabled or self._file is None:
            return
        clean = _finite(record)
        self._file.write(json.dumps(clean) + "\n")
        self._file.flush()
        if self.trackers is not None:
            self.trackers.log(clean)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    out = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def _wait_for_ipython() -> None:
    """matplotlib's first canvas reads `sys.modules["IPython"].version_info`; MLflow's tracker thread imports IPython
    lazily, and a canvas made during that import failed ("partially initialized module 'IPython'"): the plot was
    lost. Importing it here waits for the other thread's import to finish (Python's per-module import lock)."""
    if "IPython" in sys.modules:
        try:
            import IPython  # noqa: F401
        except Exception:  # noqa: BLE001 - its own import failed in the other thread: matplotlib copes with that
            pass


def plot_metrics(jsonl: str | Path, png: str | Path) -> Path:
    """A 2x2 PNG: loss, MLM/NSP accuracy (training batches, and the held-out set when evaluated), throughput (seq/s)
    and learning rate against the step."""
    # matplotlib is imported here, at the end of a run: nothing else needs it, so no other command pays its import.
    # A Figure on the Agg canvas (no pyplot: no global state, no display).
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    _wait_for_ipython()

    records = read_metrics(jsonl)
    rows = [r for r in records if "loss" in r]
    steps = [r["step"] for r in rows]
    evals = [r for r in records if r.get("event") == "eval"]

    def series(key: str) -> list[float]:
        return [r.get(key) if r.get(key) is not None else float("nan") for r in rows]

    def curve(ax, key: str, label: str, always: bool = True) -> None:
        """The training-batch series of `key` (solid) and the held-out one (dashed, dots), in one colour."""
        color = None
        if always or any(r.get(key) is not None for r in rows):
            color = ax.plot(steps, series(key), marker="." if len(steps) < 3 else None, label=label)[0].get_color()
        points = [(r["step"], r["metrics"][key]) for r in evals if r["metrics"].get(key) is not None]
        if points:
            ax.plot(*zip(*points), marker="o", linestyle="--", color=color, label=f"{label} held-out")

    fig = Figure(figsize=(11, 7), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, 2)
    ax = axes[0][0]
    ax.plot(steps, series("loss"), label="total")
    curve(ax, "mlm_loss", "MLM")
    curve(ax, "nsp_loss", "NSP", always=False)
    ax.set_title("loss"); ax.legend(); ax.set_xlabel("step")
    ax = axes[0][1]
    curve(ax, "mlm_acc", "MLM accuracy")
    curve(ax, "nsp_acc", "NSP accuracy", always=False)
    ax.set_ylim(0, 1); ax.set_title("accuracy"); ax.legend(); ax.set_xlabel("step")
    ax = axes[1][0]
    ax.plot(steps, series("seq_per_s"), label="sequences/s")
    ax.set_title("throughput"); ax.set_xlabel("step"); ax.set_ylabel("sequences/s")
    ax2 = ax.twinx()
    ax2.plot(steps, series("data_wait"), color="tab:red", alpha=0.5, label="data-wait fraction")
    ax2.set_ylim(0, 1); ax2.set_ylabel("data-wait fraction")
    ax = axes[1][1]
    ax.plot(steps, series("lr"))
    ax.set_title("learning rate"); ax.set_xlabel("step")
    png = Path(png)
    buf = io.BytesIO()  # rendered first, then written atomically: a kill mid-write left a truncated PNG
    fig.savefig(buf, format="png", dpi=100)
    atomic_write_bytes(png, buf.getvalue())
    return png
