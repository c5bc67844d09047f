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
    # named after the steps it holds, 2-3 (before: "steps2-11", steps that never ran)
    assert sorted(p.name for p in (tmp_path / "run" / "profile").iterdir()) == [
        "rank0.steps2-3.pt.trace.json", "rank0.steps2-3.top-ops.txt"]


def test_profile_settings_that_cannot_work_are_refused_naming_the_key(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="profile.steps"):
        _config(tmp_path, 3, steps=0)


def _resumable(out: Path, train_steps: int, **profile):
    cfg = _config(out, train_steps, **profile)
    cfg.checkpoint.save_interval = 2
    return cfg


def test_a_run_resumed_past_the_window_profiles_after_its_own_warm_up_once(tmp_path: Path, caplog) -> None:
    out = tmp_path / "run"
    run_pretraining(_resumable(out, 4))  # no profile; profile.* may change on resume
    with caplog.at_level("INFO", logger="bertrain.train.profiling"):
        run_pretraining(_resumable(out, 8, enabled=True, start_step=1, steps=2), resume="auto",
                        allow_config_change=True)
    # resumed at step 4, past start_step 1: steps 6-7 (before: nothing, and nothing said)
    assert sorted(p.name for p in (out / "profile").iterdir()) == [
        "rank0.steps6-7.pt.trace.json", "rank0.steps6-7.top-ops.txt"]
    assert "resumed at step 4, past profile.start_step = 1: profiling steps 6-7 instead" in caplog.text
    caplog.clear()
    with caplog.at_level("INFO", logger="bertrain.train.profiling"):  # the run has its profile: not again
        run_pretraining(_resumable(out, 10, enabled=True, start_step=1, steps=2), resume="auto",
                        allow_config_change=True)
    assert len(list((out / "profile").iterdir())) == 2 and "not profiling again" in caplog.text


def test_a_profile_that_cannot_be_written_is_a_warning_and_the_run_keeps_its_checkpoint(tmp_path: Path,
                                                                                        caplog) -> None:
    out = tmp_path / "run"
    out.mkdir()
    (out / "profile").write_text("a file where the profile folder goes (or a full disk)")
    with caplog.at_level("WARNING"):
        result = run_pretraining(_resumable(out, 3, enabled=True, start_step=1, steps=5))
    # before: FileExistsError out of the step loop: no step-3 checkpoint, no final/, the run lost
    assert result.state.step == 3 and (out / "step-3").is_dir() and (out / "final" / "model.safetensors").is_file()
    assert "could not write the profile of steps2-3" in caplog.text and "training goes on" in caplog.text
    assert _losses(out) == _losses_of_plain(tmp_path, 3)


def _losses_of_plain(tmp_path: Path, train_steps: int) -> list[float]:
    run_pretraining(_resumable(tmp_path / "plain", train_steps))
    return _losses(tmp_path / "plain")


def test_what_runs_between_two_steps_of_the_window_is_not_in_the_profile(tmp_path: Path, monkeypatch) -> None:
    """An evaluation or a checkpoint inside the window was in the trace and the top-ops table named after the
    steps (an evaluation's forward passes were 3/4 of its log_softmax calls)."""
    import torch

    from bertrain.train import trainer

    real = trainer._Run.save

    def save_with_a_marker(self, *a, **kw):
        torch.special.i0(torch.ones(3))  # an operator no training step runs
        return real(self, *a, **kw)
    monkeypatch.setattr(trainer._Run, "save", save_with_a_marker)
    cfg = _config(tmp_path / "run", 5, enabled=True, start_step=1, steps=3)
    cfg.checkpoint.save_interval = 2  # a checkpoint after step 2, inside the window of steps 2-4
    run_pretraining(cfg)
    out = tmp_path / "run" / "profile"
    names = {e.get("name") for e in json.loads((out / "rank0.steps2-4.pt.trace.json").read_text())["traceEvents"]}
    assert "aten::addmm" in names and not [n for n in names if n and "i0" in n]
    assert "i0" not in (out / "rank0.steps2-4.top-ops.txt").read_text()


def test_a_window_the_run_never_reaches_is_a_warning(tmp_path: Path, caplog) -> None:
    with caplog.at_level("WARNING"):
        run_pretraining(_config(tmp_path / "run", 3, enabled=True, start_step=10, steps=2))
    assert "profile.start_step = 10 was never passed: the run ended at step 3" in caplog.text
    assert not (tmp_path / "run" / "profile").exists()
