"""Audit of what a run reports about itself: metrics.jsonl against the steps it averages, TensorBoard after a resume
(the checkpoint's step keeps its record), and `bertrain bench` refusing what it cannot run in one line."""
from __future__ import annotations

import json
import shutil
import statistics
import sys
import types
from pathlib import Path

import pytest

from bertrain.cli import main
from bertrain.config import from_dict
from bertrain.tasks.pretraining import PretrainConfig, run_pretraining
from bertrain.train import trainer as trainer_mod
from bertrain.train.trackers import TensorBoardTracker


def _config(out: Path, **over) -> PretrainConfig:
    cfg = {"model": {"preset": "tiny"}, "data": {"synthetic_samples": 64, "vocab_size": 100},
           "sample": {"max_seq_length": 32, "max_predictions_per_seq": 5},
           "train": {"steps": 6, "global_batch_size": 8, "micro_batch_size": 4, "log_interval": 1},
           "checkpoint": {"save_interval": 0}, "seed": 3, "output_dir": str(out), "metrics": {"report_to": []}}
    for k, v in over.items():
        cfg[k] = {**cfg.get(k, {}), **v} if isinstance(v, dict) else v
    return from_dict(PretrainConfig, cfg)


def _records(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def test_an_interval_record_is_the_mean_of_its_steps_and_tokens_are_the_real_ones(tmp_path: Path,
                                                                                 monkeypatch) -> None:
    real, seqs = [], []
    add_micro = trainer_mod.Meter.add_micro

    def counting(self, sums, batch):
        real.append(int(batch["attention_mask"].sum()))
        seqs.append(batch["input_ids"].shape[0])
        return add_micro(self, sums, batch)

    monkeypatch.setattr(trainer_mod.Meter, "add_micro", counting)
    run_pretraining(_config(tmp_path / "each"))
    each = _records(tmp_path / "each")
    per_step_tokens = [real[2 * i] + real[2 * i + 1] for i in range(6)]  # 2 micro-batches a step
    assert sum(per_step_tokens) < 6 * 8 * 32  # the synthetic rows are padded: padding must not count
    for r, tokens in zip(each, per_step_tokens):
        assert r["tokens_per_s"] * r["elapsed_s"] == pytest.approx(tokens)
        assert r["seq_per_s"] * r["elapsed_s"] == pytest.approx(8)
    run_pretraining(_config(tmp_path / "by3", train={"log_interval": 3}))
    by3 = _records(tmp_path / "by3")
    assert [r["step"] for r in by3] == [3, 6]
    for r in by3:
        steps = [e for e in each if r["step"] - 3 < e["step"] <= r["step"]]
        for key in ("loss", "mlm_loss", "nsp_loss", "grad_norm"):
            assert r[key] == pytest.approx(statistics.mean(e[key] for e in steps), rel=1e-12), key
        assert r["lr"] == steps[-1]["lr"] and r["samples"] == r["step"] * 8


# ----------------------------------------------------------------------------------------------- TensorBoard

class _FakeWriter:
    """torch.utils.tensorboard.SummaryWriter's interface, recording what it is given (the package is optional)."""
    made: list["_FakeWriter"] = []

    def __init__(self, log_dir: str, purge_step: int | None = None) -> None:
        self.log_dir, self.purge_step, self.scalars, self.texts = log_dir, purge_step, [], []
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        (Path(log_dir) / f"events.out.tfevents.{len(self.made)}").write_bytes(b"")
        self.made.append(self)

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self.scalars.append((tag, step, value))

    def add_text(self, tag: str, text: str) -> None:
        self.texts.append(tag)

    def close(self) -> None:
        pass


def test_a_resumed_tensorboard_folder_keeps_the_checkpoint_steps_record(tmp_path: Path, monkeypatch) -> None:
    """SummaryWriter hides the events at steps >= purge_step: before, purge_step was the checkpoint's step, so the
    record logged at that step (log_interval dividing save_interval: the usual case) vanished from TensorBoard while
    metrics.jsonl kept it, and the resumed run does not log it again. A folder without earlier events (TensorBoard
    added on resume) gets the earlier records of metrics.jsonl, as MLflow and W&B do."""
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", types.SimpleNamespace(SummaryWriter=_FakeWriter))
    _FakeWriter.made = []
    earlier = [{"step": s, "loss": 9.0 - s} for s in (2, 4)] + [{"step": 4, "event": "eval", "metrics": {"acc": .5}}]
    fresh = TensorBoardTracker(tmp_path, None)
    fresh.start(None, {"a": 1}, {})
    assert fresh.writer.purge_step is None and fresh.writer.texts == ["config"]
    resumed = TensorBoardTracker(tmp_path, 4)
    resumed.start(None, {"a": 1}, {})
    assert resumed.writer.purge_step == 5  # hides what the killed run wrote after step 4, not step 4 itself
    resumed.backfill(earlier, False)
    assert resumed.writer.scalars == [] and resumed.writer.texts == []  # it has them already
    added = TensorBoardTracker(tmp_path / "other", 4)  # TensorBoard added on resume: no earlier events
    added.start(None, {"a": 1}, {})
    assert added.writer.purge_step is None
    added.backfill(earlier, False)
    assert added.writer.scalars == [("train/loss", 2, 7.0), ("train/loss", 4, 5.0), ("eval/acc", 4, 0.5)]


def test_tensorboard_events_equal_metrics_jsonl_after_a_resume(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard", reason="tensorboard is not installed: pip install 'bertrain[tensorboard]'")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    out = tmp_path / "run"
    cfg = _config(out, train={"log_interval": 2}, checkpoint={"save_interval": 2},
                  metrics={"report_to": ["tensorboard"]})
    run_pretraining(cfg)
    shutil.rmtree(out / "step-6")  # as if killed after writing step 6's events, before its checkpoint
    run_pretraining(cfg, resume="auto")
    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    records = _records(out)
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == \
        [(r["step"], pytest.approx(r["loss"], rel=1e-6)) for r in records] and [r["step"] for r in records] == [2, 4, 6]


# ----------------------------------------------------------------------------------------------- bench

def test_bench_refuses_what_it_cannot_run_in_one_line_naming_the_flag(capsys, monkeypatch) -> None:
    """Before: a missing transformers package with --compare hf was a traceback (exit 1) after the matmul peak;
    an unknown preset and a --seq-len beyond the model's positions were found only after it, the latter without
    naming the flag."""
    cases = {("--model", "huge"): "--model 'huge': choose a preset: tiny",
             ("--seq-len", "1024"): "--seq-len 1024: the tiny model has 512 positions"}
    for args, message in cases.items():
        rc = main(["bench", "--model", "tiny", "--steps", "1", *args])
        err = capsys.readouterr().err
        assert rc == 2 and message in err and "Traceback" not in err and err.count("\n") == 1, (args, err)
    monkeypatch.setitem(sys.modules, "transformers", None)  # not installed
    rc = main(["bench", "--model", "tiny", "--steps", "1", "--compare", "hf"])
    err = capsys.readouterr().err
    assert rc == 2 and "--compare hf needs the transformers package: pip install 'bertrain[bench]'" in err, err
    assert "Traceback" not in err and err.count("\n") == 1
