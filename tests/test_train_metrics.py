"""metrics.jsonl (train/metrics.py): standard JSON records; on resume the records after the checkpoint's step are
dropped by replacing the file whole, so a write that fails (a full disk: here a file-size limit, no mock) leaves
every record in place."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bertrain.train.metrics import MetricsLogger, read_metrics

SCRIPT = """
import resource, signal, sys
from bertrain.train.metrics import MetricsLogger
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit: OSError EFBIG, as a full disk's ENOSPC
resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[2]), resource.RLIM_INFINITY))
try:
    MetricsLogger(sys.argv[1], resume_step=int(sys.argv[3]))
except Exception as e:
    print(type(e).__name__, e)
    sys.exit(2)
"""


def _write(out: Path, steps: int) -> str:
    out.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps({"step": s, "loss": 10.0 - s / 7, "note": "x" * 40}) + "\n" for s in range(1, steps + 1))
    (out / "metrics.jsonl").write_text(text + '{"step": 41, "lo', encoding="utf-8")  # a line cut by a kill
    return text


def test_a_resume_that_cannot_rewrite_metrics_jsonl_keeps_every_record(tmp_path: Path) -> None:
    text = _write(tmp_path, 40)
    before = (tmp_path / "metrics.jsonl").read_bytes()
    limit = 1000  # the kept records (30 of about 80 bytes) do not fit
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path), str(limit), "30"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "OutputError" in done.stdout and "metrics.jsonl is unchanged" in done.stdout, done.stdout
    # before: write_text emptied the file first, then stopped at the limit: 11 of the 40 records left
    assert (tmp_path / "metrics.jsonl").read_bytes() == before and len(read_metrics(tmp_path / "metrics.jsonl")) == 40
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]  # no temporary file left
    assert len(text) > limit


def test_a_resume_drops_the_records_after_the_checkpoint_and_the_cut_line(tmp_path: Path) -> None:
    _write(tmp_path, 40)
    with MetricsLogger(tmp_path, resume_step=30) as ml:
        ml.log({"step": 31, "loss": float("nan")})
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, 32)) and records[-1]["loss"] is None


def test_records_are_standard_json_with_nested_nan_as_null(tmp_path: Path) -> None:
    """An evaluation's metrics nest in the record: an inf/NaN there (the Pearson correlation of constant
    predictions) is written as null too (before: the bare token NaN, which strict JSON readers refuse)."""
    with MetricsLogger(tmp_path, True) as m:
        m.log({"step": 1, "loss": float("nan"), "event": "eval", "metrics": {"pearson": float("nan"), "acc": 0.5},
               "curve": [1.0, float("inf")]})
    line = (tmp_path / "metrics.jsonl").read_text().strip()
    assert json.loads(line, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}")) == {
        "step": 1, "loss": None, "event": "eval", "metrics": {"pearson": None, "acc": 0.5}, "curve": [1.0, None]}


def test_checkpoint_and_evaluation_time_are_not_counted_as_training_throughput(tmp_path, monkeypatch) -> None:
    """A checkpoint write (or an evaluation) inside a log interval was counted in that interval's elapsed_s, so its
    seq/s and tokens/s fell with the checkpoint's size. A fake clock that the save advances by 1000 s shows it."""
    import json

    from bertrain.config import from_dict
    from bertrain.tasks.pretraining import PretrainConfig, run_pretraining
    from bertrain.train import checkpoint as ckpt
    from bertrain.train import trainer

    clock = [0.0]
    real = trainer.time.perf_counter

    def fake() -> float:
        return real() + clock[0]

    save = ckpt.save_checkpoint

    def slow_save(*args, **kwargs):
        clock[0] += 1000.0  # a checkpoint that takes 1000 s
        return save(*args, **kwargs)

    monkeypatch.setattr(trainer.time, "perf_counter", fake)
    monkeypatch.setattr(ckpt, "save_checkpoint", slow_save)
    cfg = from_dict(PretrainConfig, {
        "model": {"preset": "tiny"}, "data": {"synthetic_samples": 64, "vocab_size": 100},
        "sample": {"max_seq_length": 32, "max_predictions_per_seq": 5},
        "train": {"steps": 6, "global_batch_size": 8, "micro_batch_size": 8, "log_interval": 3},
        "checkpoint": {"save_interval": 2}, "output_dir": str(tmp_path / "run")})
    run_pretraining(cfg)
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "seq_per_s" in r]
    assert [r["step"] for r in steps] == [3, 6]
    assert all(r["elapsed_s"] < 500 for r in steps), [r["elapsed_s"] for r in steps]


def test_a_plot_that_fails_while_written_leaves_the_old_one(tmp_path, monkeypatch):
    """metrics.png was written in place by matplotlib: a kill or a full disk mid-write left a truncated PNG."""
    from matplotlib.figure import Figure

    from bertrain.train.metrics import plot_metrics

    jsonl = tmp_path / "metrics.jsonl"
    jsonl.write_text("".join(json.dumps({"step": s, "loss": 5.0 - s / 10, "mlm_loss": 4.0, "mlm_acc": 0.1 * s,
                                         "seq_per_s": 10.0, "data_wait": 0.1, "lr": 1e-4}) + "\n"
                             for s in range(1, 6)))
    png = plot_metrics(jsonl, tmp_path / "metrics.png")
    before = png.read_bytes()
    assert before.startswith(b"\x89PNG")

    def half_then_fail(self, fname, **kw):
        with open(fname, "wb") if isinstance(fname, (str, Path)) else _nullwriter(fname) as f:
            f.write(before[: len(before) // 2])
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(Figure, "savefig", half_then_fail)
    with pytest.raises(OSError):
        plot_metrics(jsonl, png)
    assert png.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl", "metrics.png"]


class _nullwriter:
    """A file object given to savefig (a buffer), used as a context manager that does not close it."""

    def __init__(self, f):
        self.f = f

    def __enter__(self):
        return self.f

    def __exit__(self, *exc):
        return False


def test_the_plot_waits_for_another_threads_import_of_ipython(tmp_path):
    """matplotlib's first canvas reads IPython.version_info; MLflow's tracker thread imports IPython lazily, and the
    plot was lost once to "partially initialized module 'IPython'". Here a thread's import of IPython is held open
    (after it began) until the plot has reached the point where it reads IPython: no fixed wait, only signals."""
    jsonl = tmp_path / "metrics.jsonl"
    jsonl.write_text("".join(json.dumps({"step": s, "loss": 5.0 - s / 10, "lr": 1e-4}) + "\n" for s in range(1, 4)))
    (tmp_path / "mods" / "IPython").mkdir(parents=True)
    (tmp_path / "mods" / "signals.py").write_text(
        "import threading\nbegan, go = threading.Event(), threading.Event()\n")
    (tmp_path / "mods" / "IPython" / "__init__.py").write_text(
        "import signals\nsignals.began.set()\nsignals.go.wait()\nversion_info = (9, 0, 0)\n")
    code = (f"import sys, threading, time; sys.path.insert(0, {str(tmp_path / 'mods')!r})\n"
            "import matplotlib.figure, matplotlib.backends.backend_agg, signals\n"
            "from bertrain.train.metrics import plot_metrics\n"
            "main = threading.main_thread().ident\n"
            "def release():  # once the plot reads IPython (waiting for its import, or failing on it)\n"
            "    while not signals.go.is_set():\n"
            "        f, names = sys._current_frames().get(main), set()\n"
            "        while f is not None:\n"
            "            names.add(f.f_code.co_name); f = f.f_back\n"
            "        if names & {'_wait_for_ipython', '_fix_ipython_backend2gui'}:\n"
            "            signals.go.set()\n"
            "        time.sleep(0.005)\n"
            "threading.Thread(target=__import__, args=('IPython',), daemon=True).start()\n"
            "assert signals.began.wait(60)\n"
            "threading.Thread(target=release, daemon=True).start()\n"
            f"plot_metrics({str(jsonl)!r}, {str(tmp_path / 'metrics.png')!r})\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert (tmp_path / "metrics.png").read_bytes().startswith(b"\x89PNG")
