"""`optim.init_state`: a new run's optimizer starts from another run's moments, as NVIDIA's BERT phase 2 continues
phase 1's LAMB moments (step counters at 0, this run's lr and schedule). What is checked is what the optimizer did:
from the same weights and the same first batch, the first step's first moment differs from a fresh run's by exactly
beta1 x the loaded moment. (Sharded checkpoints and FSDP models: tests/test_train_fsdp.py.)"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from bertrain.cli import main
from bertrain.config import from_dict
from bertrain.tasks.pretraining import PretrainConfig, run_pretraining
from bertrain.train import checkpoint as ckpt
from bertrain.train.dcp import load_optimizer_moments
from bertrain.train.optim import build_optimizer
from bertrain.model.bert import BertForPreTraining

BETA1 = 0.9


def _config(out: Path, **over) -> PretrainConfig:
    cfg = {"model": {"preset": "tiny", "dropout": 0.0}, "data": {"synthetic_samples": 64, "vocab_size": 100},
           "sample": {"max_seq_length": 32, "max_predictions_per_seq": 5},
           "train": {"steps": 6, "global_batch_size": 8, "micro_batch_size": 4, "log_interval": 1},
           "optim": {"name": "nvlamb", "lr": 0.01, "betas": [BETA1, 0.999]},
           "schedule": {"name": "poly", "warmup": 0.5}, "checkpoint": {"save_interval": 3}, "seed": 3,
           "output_dir": str(out)}
    for k, v in over.items():
        cfg[k] = {**cfg.get(k, {}), **v} if isinstance(v, dict) else v
    return from_dict(PretrainConfig, cfg)


@pytest.fixture(scope="module")
def phase1(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("init-state") / "phase1"
    run_pretraining(_config(out))
    return out


def _moments(step_dir: Path) -> list[dict]:
    return list(ckpt.load_train_state(step_dir)["optimizer"]["state"].values())


def test_the_first_step_continues_the_loaded_moments(phase1: Path, tmp_path: Path, caplog) -> None:
    start = phase1 / "step-6"
    phase2 = {"model": {"preset": "tiny", "dropout": 0.0, "init": str(start)}, "train": {"steps": 3},
              "schedule": {"name": "linear", "warmup": 0}, "checkpoint": {"save_interval": 1}, "seed": 11}
    fresh = run_pretraining(_config(tmp_path / "fresh", **phase2, optim={"lr": 0.004}))
    with caplog.at_level("INFO"):
        carried = run_pretraining(_config(tmp_path / "carried", **phase2,
                                          optim={"lr": 0.004, "init_state": str(start)}))
    n = len(_moments(start))
    assert f"optimizer moments of {n} parameters from {start} (optim.init_state)" in caplog.text
    loaded, a, b = _moments(start), _moments(tmp_path / "fresh" / "step-1"), _moments(tmp_path / "carried" / "step-1")
    assert len(loaded) == len(a) == len(b) == n > 0
    for m0, fr, ca in zip(loaded, a, b):
        # m1 = beta1 m0 + (1 - beta1) g: the same g (same weights, batch, seed), so m1 - m1_fresh = beta1 m0
        torch.testing.assert_close(ca["exp_avg"] - fr["exp_avg"], BETA1 * m0["exp_avg"], rtol=1e-4, atol=1e-7)
        assert float(ca["step"]) == float(fr["step"]) == 1.0  # the counters started at 0, not at phase 1's 6
    assert any(m0["exp_avg"].abs().max() > 0 for m0 in loaded)
    # this run's hyperparameters: the lr of its own schedule (warmup from 0.004), not phase 1's 0.01
    lr = ckpt.load_train_state(tmp_path / "carried" / "step-1")["optimizer"]["param_groups"][0]["initial_lr"]
    assert lr == 0.004
    # the run folder stands for its newest complete checkpoint (the recipe's `phase2.optim.init_state: phase1`)
    with caplog.at_level("INFO"):
        run_pretraining(_config(tmp_path / "from-run", **phase2, optim={"lr": 0.004, "init_state": str(phase1)}))
    assert f"optimizer moments of {n} parameters from {start} (optim.init_state)" in caplog.text
    c = _moments(tmp_path / "from-run" / "step-1")
    assert all(torch.equal(x["exp_avg"], y["exp_avg"]) for x, y in zip(b, c))
    assert not torch.equal(carried.model.bert.embeddings.word_embeddings.weight,
                           fresh.model.bert.embeddings.word_embeddings.weight)


def test_loaded_state_under_this_runs_hyperparameters(phase1: Path) -> None:
    start = phase1 / "step-3"
    model = BertForPreTraining.from_pretrained(start)
    optimizer = build_optimizer(model, _config(Path("o"), optim={"lr": 0.5}).optim)
    for g in optimizer.param_groups:
        g["initial_lr"] = g["lr"]
    n = load_optimizer_moments(start, ckpt.load_train_state(start), model, optimizer)
    saved = ckpt.load_train_state(start)["optimizer"]
    assert n == len(saved["state"]) == len(optimizer.state)
    for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"]):
        assert torch.equal(optimizer.state[p]["exp_avg_sq"], saved["state"][i]["exp_avg_sq"])
        assert float(optimizer.state[p]["step"]) == 0.0
    assert {g["lr"] for g in optimizer.param_groups} == {g["initial_lr"] for g in optimizer.param_groups} == {0.5}


def test_what_cannot_start_the_moments_is_refused_naming_the_key(phase1: Path, tmp_path: Path, capsys) -> None:
    import json

    def run(name: str, **over) -> str:
        cfg = {"model": {"preset": "tiny"}, "data": {"synthetic_samples": 64, "vocab_size": 100},
               "sample": {"max_seq_length": 32, "max_predictions_per_seq": 5},
               "train": {"steps": 1, "global_batch_size": 8, "micro_batch_size": 8},
               "optim": {"name": "nvlamb"}, "output_dir": str(tmp_path / name)}
        for k, v in over.items():
            cfg[k] = {**cfg[k], **v}
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(cfg))
        assert main(["pretrain", "--config", str(path)]) == 2
        return capsys.readouterr().err

    key = "config key 'optim.init_state'"
    err = run("final", optim={"init_state": str(phase1 / "final")})
    assert f"{key}: {phase1 / 'final'} holds no optimizer state" in err and "step-N" in err
    err = run("missing", optim={"init_state": str(tmp_path / "nowhere")})
    assert f"{key}: {tmp_path / 'nowhere'} does not exist" in err
    err = run("adamw", optim={"name": "adamw", "init_state": str(phase1 / "step-6")})
    assert "holds nvlamb moments, this run's optimizer is adamw: set optim.name: nvlamb" in err
    err = run("wider", model={"hidden_size": 64, "num_attention_heads": 2, "intermediate_size": 128},
              optim={"init_state": str(phase1 / "step-6")})
    assert key in err and "has shape" in err
    assert not list((tmp_path / "wider").glob("step-*"))  # refused before any step
    damaged = tmp_path / "damaged-phase1"  # the newest checkpoint of the run folder fails its check
    shutil.copytree(phase1, damaged)
    weights = damaged / "step-6" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    err = run("damaged", optim={"init_state": str(damaged)})
    assert f"{key}: " in err and "step-6" in err and "step-3" not in err  # not the older one's moments
