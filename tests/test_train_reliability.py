"""Trustworthy run folders (issue 12, the training side): one writer per folder, no run destroys or mixes into
another, resume refuses silent config changes (or applies them correctly when allowed), unusable checkpoints and
impossible settings are refused before any work, a full disk while saving is one clear line, and fine-tuning
exports what a user needs (dev predictions, label names)."""
from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from distributed import cli_env
from helpers import TINY, finetune_argv, save_tiny_model, write_rte_like

from bertrain.cli import main
from bertrain.train import checkpoint as ckpt
from bertrain.utils.rundir import OutputLock


def write_config(path: Path, out: Path, steps: int = 4, save_interval: int = 2, **train) -> Path:
    path.write_text(json.dumps({
        "model": {"preset": "tiny", "dropout": 0.1},
        "data": {"synthetic_samples": 64, "vocab_size": 100},
        "sample": {"max_seq_length": 32, "max_predictions_per_seq": 5},
        "train": {"steps": steps, "global_batch_size": 8, "micro_batch_size": 8, "log_interval": 1, **train},
        "optim": {"name": "adamw", "lr": 0.005},
        "schedule": {"name": "poly", "warmup": 0.25},
        "checkpoint": {"save_interval": save_interval, "keep_last": 0},
        "seed": 3, "output_dir": str(out),
    }))
    return path


def snapshot(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


@pytest.fixture
def finished(tmp_path: Path) -> tuple[Path, Path]:
    """A finished 4-step run (checkpoints at 2 and 4, final export); returns (config, output folder)."""
    out = tmp_path / "run"
    cfg = write_config(tmp_path / "cfg.json", out)
    assert main(["pretrain", "--config", str(cfg)]) == 0
    return cfg, out


def test_second_run_on_a_locked_folder_fails_at_once_naming_the_holder(tmp_path, capsys):
    out = tmp_path / "run"
    cfg = write_config(tmp_path / "cfg.json", out)
    with OutputLock(out, "pretrain"):
        t0 = time.time()
        assert main(["pretrain", "--config", str(cfg)]) == 2
        assert time.time() - t0 < 30
    err = capsys.readouterr().err
    assert f"is in use by `bertrain pretrain` (pid {os.getpid()}" in err
    assert not (out / "metrics.jsonl").exists()


def test_a_dead_holders_lock_is_taken_over(tmp_path, capsys):
    out = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from bertrain.utils.rundir import OutputLock\n"
                               f"with OutputLock({str(out)!r}, 'pretrain'):\n print('held', flush=True); sys.stdin.read()"],
                              env=cli_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    holder.send_signal(signal.SIGKILL)
    holder.wait(timeout=30)
    assert main(["pretrain", "--config", str(write_config(tmp_path / "cfg.json", out))]) == 0
    capsys.readouterr()


def test_a_new_run_never_overwrites_a_finished_one(finished, tmp_path, capsys):
    cfg, out = finished
    before = snapshot(out)
    run_id = json.loads((out / "run.json").read_text())["run_id"]
    assert main(["pretrain", "--config", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert f"holds run {run_id}" in err and "--resume auto" in err and "--overwrite" in err
    assert snapshot(out) == before  # nothing of the finished run changed (metrics, config, checkpoints, final)

    assert main(["pretrain", "--config", str(cfg), "--overwrite"]) == 0
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("run.replaced-")]
    assert len(aside) == 1 and snapshot(aside[0]) == before  # moved aside whole, never deleted
    assert json.loads((out / "run.json").read_text())["run_id"] != run_id
    assert main(["pretrain", "--config", str(cfg), "--resume", "auto", "--overwrite"]) == 2
    capsys.readouterr()


def test_inputs_are_checked_before_overwrite_moves_a_finished_run_aside(finished, tmp_path, capsys):
    """A mistyped input with --overwrite moved the finished run aside and then failed, leaving a folder with only
    run.json (which --resume auto then started afresh); an output_dir that was data.prepared wrote checkpoints into
    the token store. Now each is one line naming the key, and the finished run is untouched."""
    cfg, out = finished
    before = snapshot(out)
    cases = [(["--model.init", str(tmp_path / "phase1" / "final")], "config key 'model.init': "),
             (["--optim.init_state", str(tmp_path / "no-such-run")], "config key 'optim.init_state': "),
             (["--data.synthetic_samples", "0", "--data.prepared", str(tmp_path / "typo")],
              "config key 'data.prepared': "),
             (["--model.init", str(out / "final")], "is inside the output folder"),  # --overwrite would move it
             (["--data.synthetic_samples", "0", "--data.prepared", str(out)], "is the output folder of this run"),
             # the batch plan and the parallel layout too (FSDP on one process without a launcher)
             (["--parallelism.strategy", "fsdp"], "'parallelism.strategy' is fsdp but the job has 1 rank"),
             (["--train.global_batch_size", "12"], "config key 'train.global_batch_size'")]
    for extra, says in cases:
        assert main(["pretrain", "--config", str(cfg), "--overwrite", *extra]) == 2, extra
        err = capsys.readouterr().err.strip().splitlines()
        assert says in err[-1] and not [p for p in tmp_path.iterdir() if ".replaced-" in p.name], (extra, err)
        assert snapshot(out) == before
    # a refused command creates nothing: not the new output folder's parents, nor its lock file
    assert main(["pretrain", "--config", str(cfg), "--output_dir", str(tmp_path / "deep" / "new"),
                 "--model.init", str(tmp_path / "typo")]) == 2
    assert "config key 'model.init'" in capsys.readouterr().err and not (tmp_path / "deep").exists()
    model = save_tiny_model(tmp_path / "model")
    for argv, says in ((finetune_argv("glue", tmp_path / "RTE-typo", model, out, 2),
                        "config key 'data.data_dir' (--data-dir): "),
                       (finetune_argv("glue", tmp_path, tmp_path / "no-model", out, 2),
                        "config key 'init' (--init): ")):
        assert main([*argv, "--overwrite"]) == 2
        assert says in capsys.readouterr().err.strip().splitlines()[-1]
        assert snapshot(out) == before and not [p for p in tmp_path.iterdir() if ".replaced-" in p.name]


def test_a_run_refused_before_any_work_does_not_block_the_corrected_command(tmp_path, capsys):
    """A config error found after the folder was claimed leaves only the run record: the fixed command starts
    there without --overwrite, as a new run."""
    out = tmp_path / "run"
    cfg = write_config(tmp_path / "cfg.json", out)
    assert main(["pretrain", "--config", str(cfg), "--train.micro_batch_size", "3"]) == 2
    assert "micro_batch_size" in capsys.readouterr().err
    leftover = sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) if out.exists() else []
    assert leftover in ([], ["run.json"])
    refused_id = json.loads((out / "run.json").read_text())["run_id"] if leftover else None
    assert main(["pretrain", "--config", str(cfg)]) == 0
    assert (out / "final").is_dir() and not [p for p in tmp_path.iterdir() if ".replaced-" in p.name]
    assert json.loads((out / "run.json").read_text())["run_id"] != refused_id
    capsys.readouterr()


def test_resume_refuses_run_changing_keys_listing_each(finished, capsys):
    cfg, out = finished
    before = snapshot(out)
    assert main(["pretrain", "--config", str(cfg), "--resume", "auto", "--optim.lr", "0.01", "--train.steps", "8",
                 "--optim.name", "lamb"]) == 2
    err = capsys.readouterr().err
    for line in ("optim.lr: 0.005 -> 0.01", "train.steps: 4 -> 8", "optim.name: 'adamw' -> 'lamb'"):
        assert line in err
    assert "--allow-config-change" in err and snapshot(out) == before
    # what keeps the run exact is taken without a word
    assert main(["pretrain", "--config", str(cfg), "--resume", "auto", "--train.log_interval", "2",
                 "--checkpoint.keep_last", "1"]) == 0
    capsys.readouterr()


def test_allowed_config_change_recomputes_the_schedule_and_is_recorded(finished, capsys):
    from bertrain.train.config import ScheduleConfig
    from bertrain.train.schedules import LRMultiplier

    cfg, out = finished
    assert main(["pretrain", "--config", str(cfg), "--resume", "auto", "--train.steps", "8", "--optim.lr", "0.01",
                 "--allow-config-change"]) == 0
    capsys.readouterr()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    event = [r for r in rows if r.get("event") == "config_change"]
    assert len(event) == 1 and event[0]["step"] == 4
    assert event[0]["changes"]["train.steps"] == {"old": 4, "new": 8}
    lr = {r["step"]: r["lr"] for r in rows if "lr" in r}
    f = LRMultiplier(ScheduleConfig(name="poly", warmup=0.25), 8)
    for step in (5, 6, 7, 8):  # the lr logged for step s is the one it used: the new 8-step schedule's at s - 1,
        assert lr[step] == pytest.approx(0.01 * f(step - 1))  # on the new peak (HF Trainer logs it so too)
    assert lr[8] == 0.0 and lr[7] > 0.0  # NVIDIA's poly (t = step + 1) reaches 0 at the new last step


def test_changed_architecture_is_refused_with_a_clear_message(finished, capsys):
    cfg, out = finished
    assert main(["pretrain", "--config", str(cfg), "--resume", "auto", "--model.num_hidden_layers", "3"]) == 2
    assert "model.num_hidden_layers: None -> 3" in capsys.readouterr().err
    assert main(["pretrain", "--config", str(cfg), "--resume", "auto", "--model.num_hidden_layers", "3",
                 "--allow-config-change"]) == 2
    err = capsys.readouterr().err
    assert "different architecture cannot continue a run" in err and "Traceback" not in err


def assert_resumes_without(init: Path, out: Path, argv: list[str], caplog) -> None:
    """Run `argv` (4 steps, checkpoints at 2 and 4) straight; cut it back to step 2's checkpoint (as a kill there
    leaves it), delete its `init` model, resume: it says so and ends bitwise as the straight run."""
    assert main(argv) == 0
    straight = load_file(out / "final" / "model.safetensors")
    for gone in ("step-4", "final"):
        shutil.rmtree(out / gone)
    shutil.rmtree(init)
    caplog.clear()
    with caplog.at_level("INFO", logger="bertrain"):
        assert main([*argv, "--resume", "auto"]) == 0
    assert "is gone; resuming from" in caplog.text and "resumed from" in caplog.text, caplog.text[-2000:]
    resumed = load_file(out / "final" / "model.safetensors")
    assert straight.keys() == resumed.keys() and all(torch.equal(straight[k], resumed[k]) for k in straight)


def test_phase2_resumes_after_its_model_init_folder_is_gone(finished, tmp_path, capsys, caplog):
    """Phase 2 (model.init = phase 1's final/) killed after step 2, then phase 1's folder deleted to free disk: the
    resume takes the architecture from its own checkpoint and ends bitwise as the straight run (before: 'config key
    model.init: ... does not exist'). Without a checkpoint to resume, the missing model.init is still refused."""
    _, phase1 = finished
    init = tmp_path / "phase1-final"
    phase1.joinpath("final").rename(init)
    out = tmp_path / "phase2"
    cfg = json.loads(write_config(tmp_path / "p2.json", out).read_text())
    cfg["model"] = {"init": str(init), "dropout": 0.1}
    (tmp_path / "p2.json").write_text(json.dumps(cfg))
    assert_resumes_without(init, out, ["pretrain", "--config", str(tmp_path / "p2.json")], caplog)
    # a fresh start has nothing to take the weights from
    assert main(["pretrain", "--config", str(tmp_path / "p2.json"), "--output_dir", str(tmp_path / "new")]) == 2
    assert "config key 'model.init'" in capsys.readouterr().err


def test_resume_auto_with_only_broken_checkpoints_refuses(finished, capsys):
    cfg, out = finished
    for step in (2, 4):
        f = out / f"step-{step}" / "model.safetensors"
        data = bytearray(f.read_bytes())
        data[-1] ^= 0xFF
        f.write_bytes(bytes(data))
    before = snapshot(out)
    assert main(["pretrain", "--config", str(cfg), "--resume", "auto"]) == 2
    err = capsys.readouterr().err
    assert "none of the 2 checkpoints" in err and "step-4: corrupt file model.safetensors" in err
    assert snapshot(out) == before  # the old metrics are not wiped by a silent fresh start


def test_sample_length_beyond_the_models_positions_is_refused_before_any_work(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["pretrain", "--model.preset", "tiny", "--data.input", "builtin:python-docs", "--train.steps", "2",
                 "--sample.max_seq_length", "4096", "--output_dir", str(out)]) == 2
    assert "exceeds the model's max_position_embeddings" in capsys.readouterr().err
    assert not (out / "vocab").exists() and not (out / "data").exists()


def test_disk_full_while_saving_a_checkpoint_is_one_line_and_keeps_the_last_one(finished, tmp_path, monkeypatch,
                                                                                 capsys):
    cfg, _ = finished
    out = tmp_path / "second"
    real_save = torch.save

    def full_disk(obj, f, *a, **k):
        if isinstance(obj, dict) and obj.get("state", {}).get("step") == 4:
            # what torch 2.13's save into a Python file raises on a full disk: its own RuntimeError, the OS's
            # error as the context (test_a_real_write_limit_while_saving_... below shows it without a mock)
            try:
                raise OSError(errno.ENOSPC, "No space left on device")
            except OSError:
                raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
        return real_save(obj, f, *a, **k)

    monkeypatch.setattr(ckpt.torch, "save", full_disk)
    assert main(["pretrain", "--config", str(cfg), "--output_dir", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "writing checkpoint step-4" in err and "the disk is full" in err and "step-2" in err and "intact" in err
    assert ckpt.verify_checkpoint(out / "step-2") is None
    assert not list(out.glob(".step-*")) and not (out / "step-4").exists()  # no half-written folder left


def test_a_disk_too_small_for_the_checkpoints_to_come_is_said_after_the_first_save(tmp_path, monkeypatch, caplog):
    """After its first save a run compares that checkpoint's size x the saves still to come with the free space,
    and warns once (here the free space the OS reports is made small; the run itself writes on the real disk)."""
    real = ckpt.shutil.disk_usage
    out = tmp_path / "run"
    cfg = write_config(tmp_path / "cfg.json", out, steps=6, save_interval=2)  # saves at 2, 4, 6
    with caplog.at_level("WARNING", logger="bertrain.train.trainer"):
        assert main(["pretrain", "--config", str(cfg)]) == 0
    assert not [r for r in caplog.records if "the disk may fill" in r.getMessage()]  # room on the real disk
    size = sum(p.stat().st_size for p in (out / "step-2").rglob("*") if p.is_file())
    # (config.yaml names the output folder: a few bytes more or less than step-2 of `run`)
    for keep_last, free, warned in ((0, 2 * size - 1000, True), (0, 2 * size + 1000, False),
                                    (1, size - 1000, True), (1, size + 1000, False)):
        monkeypatch.setattr(ckpt.shutil, "disk_usage", lambda p, free=free: real(p)._replace(free=free))
        caplog.clear()
        run = tmp_path / f"run-{keep_last}-{free}"
        with caplog.at_level("WARNING", logger="bertrain.train.trainer"):
            assert main(["pretrain", "--config", str(cfg), "--output_dir", str(run),
                         "--checkpoint.keep_last", str(keep_last)]) == 0  # a warning, not a stop
        lines = [r.getMessage() for r in caplog.records if "the disk may fill" in r.getMessage()]
        assert len(lines) == int(warned), (keep_last, free, lines)
        if warned:  # after the first save (step-2), the saves at 4 and 6 to come
            assert lines[0].startswith("the disk may fill before this run ends: checkpoint step-2 takes") and \
                "the 2 still to come" in lines[0] and f"checkpoint.keep_last = {keep_last}" in lines[0], lines[0]
        monkeypatch.setattr(ckpt.shutil, "disk_usage", real)


def test_the_room_warning_under_a_time_budget_counts_the_next_save(tmp_path, monkeypatch):
    folder = tmp_path / "step-5"
    folder.mkdir()
    (folder / "w.bin").write_bytes(b"x" * 4096)
    real = ckpt.shutil.disk_usage
    monkeypatch.setattr(ckpt.shutil, "disk_usage", lambda p: real(p)._replace(free=4095))
    line = ckpt.room_warning(tmp_path, folder, None, 0)  # the number of saves is unknown: the next one
    assert line is not None and "the next one needs about 0.0 MiB more" in line
    assert ckpt.room_warning(tmp_path, folder, 0, 0) is None  # no save to come
    monkeypatch.setattr(ckpt.shutil, "disk_usage", lambda p: real(p)._replace(free=4096))
    assert ckpt.room_warning(tmp_path, folder, None, 0) is None


LIMITED = """
import resource, signal, sys
from bertrain.cli import main
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit: OSError EFBIG, as a full disk's ENOSPC
resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[1]), resource.RLIM_INFINITY))
sys.exit(main(sys.argv[2:]))
"""


def test_a_real_write_limit_while_saving_a_checkpoint_is_one_line_naming_it(tmp_path):
    """No mock: a file-size limit between model.safetensors (0.6 MB) and train_state.pt (1.2 MB) makes the real
    torch.save fail in the first checkpoint. Before, torch's own file writer said only "basic_ios::clear: iostream
    error" (exit 1 and a traceback: what a CI machine with a full disk printed)."""
    out = tmp_path / "run"
    cfg = write_config(tmp_path / "cfg.json", out)
    done = subprocess.run([sys.executable, "-c", LIMITED, str(900_000), "pretrain", "--config", str(cfg)],
                          capture_output=True, text=True, timeout=300, env=cli_env())
    assert done.returncode == 2, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert "writing checkpoint step-2" in last and "File too large" in last and "ulimit -f" in last, last
    assert "no checkpoint was written before" in last and "Traceback" not in done.stderr
    assert not (out / "step-2").exists() and not list(out.glob(".step-*"))  # the partial folder was removed


def test_glue_finetune_writes_dev_predictions_and_label_names(tmp_path, capsys):
    from helpers import save_tiny_model as _tiny_model

    model = _tiny_model(tmp_path / "model", 0.1)
    data = write_rte_like(tmp_path / "RTE", n_dev=10)
    out = tmp_path / "ft"
    assert main(["finetune", "glue", "--task", "rte", "--data-dir", str(data), "--init", str(model), "--output",
                 str(out), "--data.max_seq_length", "32", "--train.steps", "2", *TINY]) == 0
    capsys.readouterr()
    rows = (out / "dev_predictions.tsv").read_text().splitlines()
    assert rows[0].split("\t")[:3] == ["index", "prediction", "label"] and len(rows) == 11
    assert {r.split("\t")[1] for r in rows[1:]} <= {"entailment", "not_entailment"}
    config = json.loads((out / "final" / "config.json").read_text())
    assert config["id2label"] == {"0": "entailment", "1": "not_entailment"}
    assert json.loads((out / "final" / "task.json").read_text())["kind"] == "classification"


@pytest.mark.parametrize("kind", ["glue", "squad"])
def test_a_finetuning_resumes_after_its_init_folder_is_gone(kind, tmp_path, caplog):
    """The pretrained model (--init) moved or deleted while a fine-tuning was cut after a checkpoint: the resume
    builds the model from its own checkpoint and ends bitwise as the straight run (before: "config key 'init'
    (--init): … not a folder", the fine-tuning could not continue)."""
    from helpers import finetune_data

    init = save_tiny_model(tmp_path / "model", 0.1)
    out = tmp_path / "ft"
    argv = finetune_argv(kind, finetune_data(kind, tmp_path / "data"), init, out, 4,
                         "--checkpoint.save_interval", "2", "--checkpoint.keep_last", "0")
    assert_resumes_without(init, out, argv, caplog)


def test_a_bad_test_file_is_refused_before_training(tmp_path, capsys):
    from helpers import save_tiny_model as _tiny_model

    model = _tiny_model(tmp_path / "model")
    data = write_rte_like(tmp_path / "RTE", n_dev=10)
    with open(data / "test.tsv", "a") as f:
        f.write("99\tonly one field\n")
    out = tmp_path / "ft"
    argv = ["finetune", "glue", "--task", "rte", "--data-dir", str(data), "--init", str(model), "--output", str(out),
            "--data.max_seq_length", "32", "--train.steps", "2", *TINY]
    assert main(argv) == 2
    assert f"{data / 'test.tsv'}:9: 2 tab-separated fields" in capsys.readouterr().err
    assert not (out / "metrics.jsonl").exists() and not list(out.glob("step-*"))
    (data / "test.tsv").write_text("\n".join((data / "test.tsv").read_text().splitlines()[:-1]) + "\n")
    assert main(argv) == 0 and (out / "RTE.tsv").is_file()  # fixed: the same command runs (nothing was written)
    capsys.readouterr()


def test_stsb_finetune_exports_a_regression_model_that_predict_scores(tmp_path, capsys):
    from helpers import save_tiny_model as _tiny_model

    from bertrain.deploy.predict import Predictor

    model = _tiny_model(tmp_path / "model", 0.1)
    d = tmp_path / "STS-B"
    d.mkdir()
    header = "index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2\tscore"
    rows = [f"{i}\tg\tf\ty\t{i}\ts\ts\tthe cat sat on a mat {i}\ta dog sat in the house\t{i % 5}.0" for i in range(12)]
    for name in ("train.tsv", "dev.tsv"):
        (d / name).write_text("\n".join([header, *rows]) + "\n")
    out = tmp_path / "ft"
    assert main(["finetune", "glue", "--task", "stsb", "--data-dir", str(d), "--init", str(model), "--output",
                 str(out), "--data.max_seq_length", "32", "--train.steps", "2", *TINY]) == 0
    capsys.readouterr()
    assert json.loads((out / "final" / "task.json").read_text())["kind"] == "regression"
    (pred,) = Predictor(out / "final").predict([{"text": "the cat sat", "text_pair": "a dog sat"}])
    assert isinstance(pred["score"], float)


def test_resume_reuses_the_thread_count_of_the_run(finished, monkeypatch, capsys):
    """The thread count is chosen from the load at start, and CPU results depend on it: a resume in another
    process reuses the count the run's checkpoints were written with (unless OMP_NUM_THREADS says otherwise)."""
    cfg, out = finished
    saved = ckpt.load_train_state(out / "step-4")["threads"]
    assert saved == torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(saved + 1)
        monkeypatch.setattr("bertrain.utils.threads.apply_threads", lambda *a, **k: None, raising=False)
        assert main(["pretrain", "--config", str(cfg), "--resume", "auto", "--train.log_interval", "2"]) == 0
        assert torch.get_num_threads() == saved
    finally:
        torch.set_num_threads(before)
    capsys.readouterr()


def _plant_nan_gradient_at(monkeypatch, step: int) -> None:
    """A bad batch at optimizer step `step`: one gradient entry NaN before the norm is taken (as a real overflow
    in the forward or backward pass leaves it)."""
    from bertrain.train.precision import Precision
    original, calls = Precision.unscale_and_clip, []

    def unscale_and_clip(self, optimizer, params, max_norm):
        params = list(params)
        calls.append(1)
        if len(calls) == step:
            next(p for p in params if p.grad is not None).grad.view(-1)[0] = float("nan")
        return original(self, optimizer, params, max_norm)

    monkeypatch.setattr(Precision, "unscale_and_clip", unscale_and_clip)


@pytest.mark.parametrize("mode", ["fp32", "bf16"])
def test_a_diverged_run_stops_before_writing_nan_weights_and_keeps_the_last_checkpoint(tmp_path, monkeypatch,
                                                                                        capsys, mode):
    """fp32/bf16 have no loss scaler to skip a step with inf/NaN gradients: before, the run trained on NaN to the
    end, saved NaN checkpoints that replaced the good ones (keep_last) and exported a NaN model, exit 0. Now it stops
    at the first log line, evaluation or checkpoint after the bad step, exit 2, naming it and the intact checkpoint."""
    out = tmp_path / "run"
    cfg = write_config(tmp_path / "cfg.json", out, steps=12, save_interval=4, log_interval=5)
    _plant_nan_gradient_at(monkeypatch, 6)
    assert main(["pretrain", "--config", str(cfg), "--precision.mode", mode, "--checkpoint.keep_last", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "training diverged: the gradient norm was inf/NaN at step 6" in err and "steps 6-8" in err
    assert f"{out / 'step-4'} (the last complete checkpoint) is intact" in err and "--allow-config-change" in err
    assert sorted(p.name for p in out.glob("step-*")) == ["step-4"] and not (out / "final").exists()
    weights = load_file(out / "step-4" / "model.safetensors")
    assert all(torch.isfinite(w).all() for w in weights.values())
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [5]  # logged before the check: the record shows where it broke
    # diverged before the first checkpoint: nothing to continue from, so the advice is to start again
    cfg = write_config(tmp_path / "cfg2.json", tmp_path / "run2", steps=12, save_interval=8, log_interval=5)
    _plant_nan_gradient_at(monkeypatch, 6)
    assert main(["pretrain", "--config", str(cfg), "--precision.mode", mode]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "no checkpoint was written before. Start again with --overwrite and a lower optim.lr" in err
    assert "--resume auto" not in err


def test_fp16_skips_the_same_bad_step_and_trains_on(tmp_path, monkeypatch, capsys):
    """fp16's loss scaler skips a step with inf/NaN gradients (weights untouched): no divergence to report."""
    out = tmp_path / "run"
    cfg = write_config(tmp_path / "cfg.json", out, steps=8, save_interval=4, log_interval=4)
    _plant_nan_gradient_at(monkeypatch, 6)
    assert main(["pretrain", "--config", str(cfg), "--precision.mode", "fp16"]) == 0
    capsys.readouterr()
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["step"] == 8 and records[-1]["skipped_steps"] == 1
    assert all(torch.isfinite(w).all() for w in load_file(out / "final" / "model.safetensors").values())


def test_export_of_a_run_folder_takes_what_the_run_ended_on(finished, tmp_path, capsys):
    """`bertrain export RUN`: its final/ (under eval.final best the best model; before, always the newest step-N,
    so a fine-tuned run deployed its last step), unless a step-N is newer (resumed, not finished again)."""
    from bertrain.commands.export import resolve_checkpoint

    _, out = finished
    assert resolve_checkpoint(out) == out / "final"
    assert main(["export", str(out), str(tmp_path / "hf")]) == 0
    assert f"exported {out / 'final'} -> " in capsys.readouterr().out
    later = (out / "final").stat().st_mtime + 10
    os.utime(out / "step-4", (later, later))  # as a resume writes step-N after the earlier final/
    assert resolve_checkpoint(out) == out / "step-4"
    shutil.rmtree(out / "final")
    assert resolve_checkpoint(out) == out / "step-4"
