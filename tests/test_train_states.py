"""The registry of checkpoint states (`bertrain.train.states`): what the save writes is what the restore reads, an
entry a checkpoint lacks starts fresh, and a checkpoint written before the registry (train_state.pt version 2 as
the hand-built dict wrote it) still resumes bit for bit."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from bertrain.config import from_dict
from bertrain.tasks.pretraining import PretrainConfig, run_pretraining
from bertrain.train import checkpoint as ckpt
from bertrain.train.distributed import DistInfo
from bertrain.train.states import TENSOR_STATES, TrainState, load_entries, saved_entries, training_states

# The keys of train_state.pt as `Trainer.save` wrote them before the registry (bertrain at c1b39df): a checkpoint
# of this layout version must keep resuming.
LAYOUT_V2_KEYS = {"version", "task", "state", "scheduler", "precision", "rng", "loader", "world_size", "batch",
                  "threads", "optimizer"}


class Box:
    """A minimal stateful entry."""

    def __init__(self, value: object) -> None:
        self.value = value

    def state_dict(self) -> object:
        return self.value

    def load_state_dict(self, state: object) -> None:
        self.value = state


def test_save_and_restore_walk_the_same_entries(caplog: pytest.LogCaptureFixture) -> None:
    dist = DistInfo(0, 1, 0, torch.device("cpu"), True)
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    state = TrainState(step=5, epoch=1, samples=80)
    states = training_states(model, optimizer, Box("sched"), Box("prec"), Box("loader"), state, 3, dist,
                             Box({"best_step": 4}), Box({"elapsed_s": 3.0}),
                             Box({"mlflow": "abc"}), Box({"steps": 2}))
    saved = saved_entries(states)
    # every registered entry is saved, under its own name, except the tensors the checkpoint format stores
    assert set(saved) == set(states) - set(TENSOR_STATES)
    assert saved["state"] == {"step": 5, "epoch": 1, "samples": 80, "skipped_steps": 0}

    fresh_state = TrainState()
    fresh = training_states(model, optimizer, Box(None), Box(None), Box(None), fresh_state, 3, dist, Box(None),
                            Box(None), Box(None), Box(None))
    fresh["extra"] = Box("built")  # an entry added after the checkpoint was written
    with caplog.at_level("INFO"):
        load_entries(fresh, saved)
    assert fresh_state == state and fresh["scheduler"].value == "sched" and fresh["loader"].value == "loader"
    assert fresh["eval"].value == {"best_step": 4} and fresh["trackers"].value == {"mlflow": "abc"}
    assert fresh["meter"].value == {"steps": 2}
    assert fresh["extra"].value == "built" and "no 'extra' state" in caplog.text
    load_entries(fresh, {**saved, "scheduler": "other"}, skip=("scheduler",))
    assert fresh["scheduler"].value == "sched"


def _config(out: Path) -> PretrainConfig:
    return from_dict(PretrainConfig, {
        "model": {"preset": "tiny", "dropout": 0.1},  # dropout on: the RNG states must come back exactly
        "data": {"synthetic_samples": 96, "vocab_size": 100},
        "sample": {"max_seq_length": 32, "max_predictions_per_seq": 5},
        "train": {"steps": 8, "global_batch_size": 16, "micro_batch_size": 8, "log_interval": 1},
        "optim": {"name": "lamb", "lr": 0.005},
        "schedule": {"name": "poly", "warmup": 0.25},
        "checkpoint": {"save_interval": 4, "keep_last": 0},
        "seed": 5, "output_dir": str(out)})


def _rewrite_manifest(folder: Path) -> None:
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name not in (ckpt.MANIFEST, ckpt.COMPLETE))
    manifest = {"step": json.loads((folder / ckpt.MANIFEST).read_text())["step"],
                "files": {str(p.relative_to(folder)): {"size": p.stat().st_size, "sha256": ckpt.sha256_file(p)}
                          for p in files}}
    (folder / ckpt.MANIFEST).write_text(json.dumps(manifest))


def test_a_checkpoint_written_before_the_registry_resumes_bitwise(tmp_path: Path) -> None:
    straight = tmp_path / "straight"
    run_pretraining(_config(straight))
    weights = load_file(str(straight / "final" / "model.safetensors"))
    end = ckpt.load_train_state(straight / "step-8")

    # the same run cut after step 4, its checkpoint rewritten to exactly the old layout's keys
    old = tmp_path / "old"
    run_pretraining(_config(old))
    for gone in ("step-8", "final"):
        shutil.rmtree(old / gone)
    ts = ckpt.load_train_state(old / "step-4")
    assert LAYOUT_V2_KEYS <= set(ts), "the registry no longer writes a key of the old layout"
    torch.save({k: ts[k] for k in LAYOUT_V2_KEYS}, old / "step-4" / ckpt.TRAIN_STATE)
    _rewrite_manifest(old / "step-4")
    assert ckpt.verify_checkpoint(old / "step-4") is None

    result = run_pretraining(_config(old), resume="auto")
    assert result.run.start_step == 4
    resumed = load_file(str(old / "final" / "model.safetensors"))
    assert weights.keys() == resumed.keys() and all(torch.equal(weights[k], resumed[k]) for k in weights)
    again = ckpt.load_train_state(old / "step-8")
    assert again["state"] == end["state"] and again["loader"] == end["loader"]
    assert again["scheduler"] == end["scheduler"] and again["precision"] == end["precision"]
    for pa, pb in zip(end["optimizer"]["state"].values(), again["optimizer"]["state"].values()):
        assert all(torch.equal(pa[k], pb[k]) for k in pa)


def test_a_resume_between_two_log_lines_logs_the_same_interval_numbers(tmp_path: Path) -> None:
    """Log every 3 steps, save every 2: a resume from step 4 carries step 4's sums into the record of step 6, so
    every logged loss, accuracy and grad norm equals the straight run's."""
    def config(out: Path) -> PretrainConfig:
        cfg = _config(out)
        cfg.train.log_interval, cfg.checkpoint.save_interval = 3, 2
        return cfg

    learned = ("loss", "mlm_loss", "nsp_loss", "mlm_acc", "nsp_acc", "grad_norm", "lr")

    def records(out: Path) -> dict[int, dict]:
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: {k: r[k] for k in learned} for r in rows if "event" not in r}

    straight = tmp_path / "straight"
    run_pretraining(config(straight))
    cut = tmp_path / "cut"
    shutil.copytree(straight, cut)
    for gone in ("step-6", "step-8", "final"):
        shutil.rmtree(cut / gone)
    assert run_pretraining(config(cut), resume="auto").run.start_step == 4
    assert sorted(records(straight)) == [3, 6, 8] and records(cut) == records(straight)
