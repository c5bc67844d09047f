"""`profile:` runs torch.profiler on a window of steps: a trace TensorBoard/Perfetto read and a table of the top
operators in OUTPUT/profile/, also when the run ends inside the window; the profiled steps compute the same."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from bertrain.config import from_dict
from bertrain.tasks.pretraining import PretrainConfig, run_pretraining


def _config(out: Path, train_steps: int, **profile) -> PretrainConfig:
    return from_dict(PretrainConfig, {
        "model": {"preset": "tiny", "dropout": 0.0}, "data": {"synthetic_samples": 64, "vocab_size": 100},
        "sample": {"max_seq_length": 32, "max_predictions_per_seq": 5},
        "train": {"steps": train_steps, "global_batch_size": 8, "micro_batch_size": 8, "log_interval": 1},
        "checkpoint": {"save_interval": 0}, "seed": 3, "output_dir": str(out), "metrics": {"report_to": []},
        "profile": profile})


def _losses(out: Path) -> list[float]:
    return [json.loads(x)["loss"] for x in (out / "metrics.jsonl").read_text().splitlines()]


def test_profile_window_writes_a_trace_and_a_table_and_changes_no_number(tmp_path: Path) -> None:
    run_pretraining(_config(tmp_path / "plain", 5))
    run_pretraining(_config(tmp_path / "prof", 5, enabled=True, start_step=1, steps=2, top=15))
    files = sorted(p.name for p in (tmp_path / "prof" / "profile").iterdir())
    assert files == ["rank0.steps2-3.pt.trace.json", "rank0.steps2-3.top-ops.txt"]
    trace = json.loads((tmp_path / "prof" / "profile" / files[0]).read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    assert "Optimizer.step#AdamW.step" in names and {"aten::addmm", "aten::embedding"} <= names
    table = (tmp_path / "prof" / "profile" / files[1]).read_text()
    assert "Self CPU" in table and "aten::" in table and len(table.splitlines()) <= 15 + 10
    assert _losses(tmp_path / "prof") == _losses(tmp_path / "plain")  # bit for bit


def test_a_run_that_ends_inside_the_window_still_writes_it(tmp_path: Path) -> None:
    run_pretraining(_config(tmp_path / "run", 3, enabled=True, start_step=1, steps=10))
    assert (tmp_path / "run" / "profile" / "rank0.steps2-11.top-ops.txt").is_file()


def test_profile_settings_that_cannot_work_are_refused_naming_the_key(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="profile.steps"):
        _config(tmp_path, 3, steps=0)
