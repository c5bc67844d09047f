"""The stop grace after SIGTERM on 2 ranks must never cut the last checkpoint's save (a big checkpoint on a slow disk
takes longer than `distributed.stop_grace_s`).

Two ways a signal reaches a save with no step boundary after it:

* between two steps (while the next step's batches load): the trainer shares the stop flag in the all-reduce at
  the start of a step, so the run stops at the end of the step that starts, and saves it, without another
  `Watchdog.step_done`;
* during the final save after the last step (a step count that is no multiple of `checkpoint.save_interval`).

The grace is for a *hung step*; once the step loop has ended (`Watchdog.steps_over`) it no longer applies."""
from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from distributed import base_config, spawn

pytestmark = pytest.mark.slow

GRACE_S = 1.0
SIGNAL_AT_STEP = 3  # "between_steps": the signal arrives while the batches of step 3 load (after step 2's boundary)
STEPS = 5  # "final_save": the signal arrives while step 5, the last, is saved


def _signalled_worker(rank: int, world_size: int, cfg_dict: dict, when: str) -> None:
    from bertrain.config import from_dict
    from bertrain.tasks.pretraining import PretrainConfig, run_pretraining
    from bertrain.train import checkpoint as ckpt
    from bertrain.train import trainer

    take, save = trainer.take, ckpt.save_checkpoint
    calls = [0]

    # torchrun forwards SIGTERM to every rank: here each rank signals itself at the same point of the run
    def take_then_signal(it, n):
        calls[0] += 1
        if when == "between_steps" and calls[0] == SIGNAL_AT_STEP:
            os.kill(os.getpid(), signal.SIGTERM)  # handled before the step's all-reduce reads the flag
        return take(it, n)

    def slow_save(*args, **kwargs):  # rank 0 writes; a checkpoint that takes longer to write than the grace
        if when == "final_save":
            os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(3 * GRACE_S)
        return save(*args, **kwargs)

    def on_rank0(what, fn, long=False):  # every rank is signalled during the save, not rank 0 alone
        if when == "final_save" and what.startswith("write checkpoint") and rank != 0:
            os.kill(os.getpid(), signal.SIGTERM)
        return on_rank0_orig(what, fn, long)

    on_rank0_orig = trainer.on_rank0
    trainer.take, trainer.on_rank0, ckpt.save_checkpoint = take_then_signal, on_rank0, slow_save
    result = run_pretraining(from_dict(PretrainConfig, cfg_dict))
    (Path(cfg_dict["output_dir"]) / f"rank{rank}.json").write_text(
        json.dumps({"step": result.state.step, "stopped": result.stopped_by_signal}))


@pytest.mark.parametrize("when", ["between_steps", "final_save"])
def test_a_stop_signal_never_cuts_the_last_save_however_long_it_takes(tmp_path: Path, when: str) -> None:
    """Before: the grace ran on through the save, so `stop_grace_s` after the signal every rank exited 3 in the
    middle of writing the checkpoint, saying the step "has not finished within distributed.stop_grace_s" (it had):
    the checkpoint of the step reached was lost, and the exit named an older one (here: none)."""
    from bertrain.train import checkpoint as ckpt

    out = tmp_path / "run"
    cfg = base_config(out, steps=40 if when == "between_steps" else STEPS)
    cfg["checkpoint"].update(save_interval=100, export_final=True)  # only the last save writes a checkpoint
    cfg["distributed"].update(stop_grace_s=GRACE_S)
    spawn(_signalled_worker, 2, cfg, when)  # raises if a rank exited (the watchdog's os._exit(3))
    step = SIGNAL_AT_STEP if when == "between_steps" else STEPS
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    # a signal after the last step finished stops nothing: the run is complete (exported, exit 0)
    assert ranks == [{"step": step, "stopped": when == "between_steps"}] * 2
    assert [s for s, _ in ckpt.list_checkpoints(out)] == [step]
    assert ckpt.verify_checkpoint(out / f"step-{step}") is None
    assert ckpt.load_train_state(out / f"step-{step}")["state"]["step"] == step
    assert (out / "final").is_dir() == (when == "final_save")
