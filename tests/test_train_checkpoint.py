"""Checkpoint folders: atomic and self-contained, keep-last-k, resume auto skips incomplete and corrupt ones;
and the end-to-end proof: a run killed with SIGKILL and resumed equals the straight run bit for bit; SIGTERM
saves and exits cleanly."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from bertrain.train import checkpoint as ckpt
from distributed import cli_env


def tiny_model():
    from bertrain.model.bert import BertConfig, BertForPreTraining
    torch.manual_seed(0)
    return BertForPreTraining(BertConfig.from_preset("tiny", vocab_size=50))


def test_save_latest_keep_last_and_skip_bad(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    model = tiny_model()
    for step in (1, 2, 3, 4):
        ckpt.save_checkpoint(tmp_path, step, model, {"state": {"step": step}}, None, keep_last=3)
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [2, 3, 4]
    folder = tmp_path / "step-4"
    assert {"config.json", "model.safetensors", "train_state.pt", "manifest.json", "COMPLETE"} <= {
        p.name for p in folder.iterdir()}
    assert ckpt.latest_checkpoint(tmp_path) == folder
    assert ckpt.load_train_state(folder)["state"]["step"] == 4
    # the folder is an HF model folder: from_pretrained reads its weights (weights only)
    loaded = type(model).from_pretrained(folder)
    for k, v in model.state_dict().items():
        assert torch.equal(v, loaded.state_dict()[k]), k

    # corrupt the newest (flip a byte of the weights), make the next one incomplete: step-2 wins
    data = bytearray((folder / "model.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (folder / "model.safetensors").write_bytes(bytes(data))
    (tmp_path / "step-3" / "COMPLETE").unlink()
    with caplog.at_level("WARNING"):
        assert ckpt.latest_checkpoint(tmp_path) == tmp_path / "step-2"
    assert "step-4: corrupt file model.safetensors" in caplog.text
    assert "step-3: incomplete" in caplog.text
    # a folder left by a killed save is never a candidate and is cleaned by the next save
    (tmp_path / ".step-9.abc.tmp").mkdir()
    ckpt.save_checkpoint(tmp_path, 5, model, {"state": {"step": 5}}, None, keep_last=0)
    assert not (tmp_path / ".step-9.abc.tmp").exists()


def write_config(path: Path, out: Path, steps: int, save_interval: int) -> Path:
    path.write_text(json.dumps({
        "model": {"preset": "tiny", "dropout": 0.1},  # dropout on: the RNG state must be restored exactly
        "data": {"synthetic_samples": 320, "vocab_size": 100},
        "sample": {"max_seq_length": 64, "max_predictions_per_seq": 8},
        "train": {"steps": steps, "global_batch_size": 32, "micro_batch_size": 16, "log_interval": 1},
        "optim": {"name": "lamb", "lr": 0.005},
        "schedule": {"name": "poly", "warmup": 0.1},
        "checkpoint": {"save_interval": save_interval, "keep_last": 0},
        "seed": 11, "output_dir": str(out),
    }))
    return path


def run_cli(config: Path, *extra: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bertrain", "pretrain", "--config", str(config), *extra],
                          env=cli_env(), capture_output=True, text=True, timeout=timeout)


def losses(out: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}


def start_and_signal(config: Path, out: Path, sig: int, after_step: int) -> subprocess.Popen:
    """Start a run and send `sig` as soon as checkpoint `after_step` is complete."""
    proc = subprocess.Popen([sys.executable, "-m", "bertrain", "pretrain", "--config", str(config)], env=cli_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 400  # generous: CI machines may be busy
    while not (out / f"step-{after_step}" / "COMPLETE").exists():
        assert proc.poll() is None, f"run ended before step {after_step}:\n{proc.stdout.read()}"
        assert time.time() < deadline, "no checkpoint appeared"
        time.sleep(0.02)
    proc.send_signal(sig)
    return proc


@pytest.mark.slow
def test_killed_and_resumed_run_is_bitwise_identical(tmp_path: Path) -> None:
    steps = 40  # 10 steps per epoch (320 samples / 32): the kill lands mid-epoch, the run crosses epochs
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    # the straight run and the run to kill go side by side (one thread each: the same numbers as alone)
    straight_proc = subprocess.Popen([sys.executable, "-m", "bertrain", "pretrain", "--config",
                                      str(write_config(tmp_path / "a.json", straight, steps, save_interval=4))],
                                     env=cli_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        cfg = write_config(tmp_path / "b.json", killed, steps, save_interval=4)
        proc = start_and_signal(cfg, killed, signal.SIGKILL, after_step=8)
        proc.wait(timeout=60)
        assert proc.returncode == -signal.SIGKILL
        done = [s for s, p in ckpt.list_checkpoints(killed) if (p / "COMPLETE").exists()]
        assert 8 <= max(done) < steps, done
        _, err = straight_proc.communicate(timeout=600)
        assert straight_proc.returncode == 0, err[-3000:]
    finally:
        if straight_proc.poll() is None:
            straight_proc.kill()
            straight_proc.wait()

    r = run_cli(cfg, "--resume", "auto")
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"resumed from {killed / f'step-{max(done)}'}" in r.stderr

    a, b = load_file(str(straight / "final" / "model.safetensors")), load_file(str(killed / "final" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    sa, sb = (ckpt.load_train_state(d / f"step-{steps}") for d in (straight, killed))
    for pa, pb in zip(sa["optimizer"]["state"].values(), sb["optimizer"]["state"].values()):
        assert all(torch.equal(pa[k], pb[k]) for k in pa)
    assert sa["loader"] == sb["loader"] and sa["state"] == sb["state"]
    la, lb = losses(straight), losses(killed)
    assert sorted(la) == sorted(lb) == list(range(1, steps + 1))
    assert la == lb  # every step's loss, bit for bit (JSON floats round-trip exactly)


@pytest.mark.slow
def test_sigterm_saves_and_exits_cleanly(tmp_path: Path) -> None:
    out = tmp_path / "term"
    cfg = write_config(tmp_path / "c.json", out, 400, save_interval=2)
    proc = start_and_signal(cfg, out, signal.SIGTERM, after_step=2)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 3, output[-3000:]  # EXIT_STOPPED: resumable, told apart from a finished run (0)
    assert "received SIGTERM" in output and "--resume auto" in output and "Traceback" not in output
    last = max(s for s, _ in ckpt.list_checkpoints(out))
    assert 2 <= last < 400 and ckpt.verify_checkpoint(out / f"step-{last}") is None
    assert ckpt.load_train_state(out / f"step-{last}")["state"]["step"] == last
    assert not (out / "final").exists()  # stopped early: not exported as final


def test_deterministic_kernels_switch_on_and_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """`train.deterministic`: torch's deterministic-only mode and cuBLAS's fixed workspace (set before the first
    cuBLAS call; a user's own setting is kept); off again for the next run in the same process."""
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    try:
        ckpt.use_deterministic_kernels(True)
        assert torch.are_deterministic_algorithms_enabled() and torch.backends.cudnn.deterministic
        import os
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
        monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
        ckpt.use_deterministic_kernels(True)
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
    finally:
        ckpt.use_deterministic_kernels(False)
    assert not torch.are_deterministic_algorithms_enabled() and not torch.backends.cudnn.deterministic
