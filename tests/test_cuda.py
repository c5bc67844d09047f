"""On a GPU (issue 26): bf16, kill-and-resume, NCCL and FSDP2 on one rank, and no host syncs in the step.

Every test here needs CUDA and skips without it (the fast-path equality tests of test_fastpath.py, the fp16
overflow test of test_train_precision.py, the optimizer tests and HF parity also run on CUDA where there is a GPU). `benchmarks/gpu_session.sh tests` runs them on the lent
GPU machine; BENCHMARKS.md ("GPU") says which ran there and what they found.
"""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from distributed import cli_env

from bertrain.train import checkpoint as ckpt
from bertrain.train.config import OptimConfig, PrecisionConfig
from bertrain.train.optim import build_optimizer
from bertrain.train.precision import Precision

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the GPU machine: "
                                                                      "benchmarks/gpu_session.sh tests)")
CUDA = torch.device("cuda")
SRC = str(Path(ckpt.__file__).resolve().parents[1])  # bertrain's package folder


# ----------------------------------------------------------------------------------------------- precision

def test_bf16_autocast_pretraining_step_is_close_to_fp32_on_cuda() -> None:
    from bertrain.bench.batches import pretraining_batch
    from bertrain.model.bert import BertConfig, BertForPreTraining
    cfg = BertConfig.from_preset("mini", vocab_size=1000, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    b = {k: v.to(CUDA) for k, v in pretraining_batch(cfg, 8, 64, seed=1).items()}
    torch.manual_seed(0)
    model = BertForPreTraining(cfg).to(CUDA)
    x = dict(input_ids=b["input_ids"], token_type_ids=b["token_type_ids"], attention_mask=b["attention_mask"],
             masked_positions=b["masked_positions"], labels=b["masked_labels"],
             next_sentence_label=b["next_sentence_labels"])
    losses, grads = {}, {}
    for mode in ("fp32", "bf16"):
        prec = Precision(PrecisionConfig(mode=mode), CUDA)
        model.zero_grad(set_to_none=True)
        with prec.autocast():
            out = model(**x)
        assert out.prediction_logits.dtype == (torch.bfloat16 if mode == "bf16" else torch.float32)
        prec.backward(out.loss)
        losses[mode] = out.loss.item()
        grads[mode] = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        assert grads[mode].dtype == torch.float32  # master weights and their gradients stay fp32
    assert abs(losses["bf16"] - losses["fp32"]) / losses["fp32"] < 1e-2, losses
    rel = ((grads["bf16"] - grads["fp32"]).norm() / grads["fp32"].norm()).item()
    assert rel < 5e-2, rel  # bf16 operands: about 1e-2 relative error per product


@pytest.mark.parametrize("jagged", [False, True])
def test_a_mask_on_the_host_gives_the_same_model_as_on_the_gpu(jagged: bool) -> None:
    """The trainer keeps the attention mask on the host (its lengths are read there, no sync): same outputs and
    gradients as with the mask on the GPU, unpadded and jagged."""
    from bertrain.bench.batches import pretraining_batch
    from bertrain.model.bert import BertConfig, BertForPreTraining
    from bertrain.model.options import ModelOptionsConfig, apply_model_options
    cfg = BertConfig.from_preset("tiny", vocab_size=500, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    host = pretraining_batch(cfg, 6, 40, seed=3)
    torch.manual_seed(0)
    model = apply_model_options(BertForPreTraining(cfg), ModelOptionsConfig(jagged_attention=jagged)).to(CUDA)
    results = []
    for mask in (host["attention_mask"], host["attention_mask"].to(CUDA)):
        b = {k: v.to(CUDA) for k, v in host.items()}
        model.zero_grad(set_to_none=True)
        out = model(input_ids=b["input_ids"], token_type_ids=b["token_type_ids"], attention_mask=mask,
                    masked_positions=b["masked_positions"], labels=b["masked_labels"],
                    next_sentence_label=b["next_sentence_labels"])
        out.loss.backward()
        results.append((out.prediction_logits.detach(), [p.grad.clone() for p in model.parameters()]))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=0, atol=0)
    for g0, g1 in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(g0, g1, rtol=1e-6, atol=1e-7)


# ----------------------------------------------------------------------------------------------- CLI runs

def pretrain_config(path: Path, out: Path, steps: int = 24, save_interval: int = 4, **sections: dict) -> Path:
    cfg = {
        "model": {"preset": "mini", "dropout": 0.1},  # dropout on: the CUDA RNG must replay exactly
        "data": {"synthetic_samples": 512, "vocab_size": 200},
        "sample": {"max_seq_length": 64, "max_predictions_per_seq": 8},
        "train": {"steps": steps, "global_batch_size": 32, "micro_batch_size": 16, "log_interval": 1,
                  "deterministic": True},
        "optim": {"name": "lamb", "lr": 0.005},
        "schedule": {"name": "poly", "warmup": 0.1},
        "precision": {"mode": "bf16"},
        "checkpoint": {"save_interval": save_interval, "keep_last": 0},
        "distributed": {"device": "cuda"},
        "seed": 11, "output_dir": str(out),
    }
    for key, values in sections.items():
        cfg.setdefault(key, {}).update(values)
    path.write_text(json.dumps(cfg))
    return path


def run_cli(argv: list[str], timeout: float = 400) -> subprocess.CompletedProcess:
    r = subprocess.run(argv, env=cli_env(), capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    return r


def pretrain(config: Path, *extra: str) -> subprocess.CompletedProcess:
    return run_cli([sys.executable, "-m", "bertrain", "pretrain", "--config", str(config), *extra])


def torchrun(config: Path) -> subprocess.CompletedProcess:
    return run_cli([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
                    "-m", "bertrain", "pretrain", "--config", str(config)])


def losses(out: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}


def final(out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(out / "final" / "model.safetensors"))


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Path:
    """24 steps of a mini BERT, bf16, LAMB, dropout, train.deterministic: the reference run."""
    d = tmp_path_factory.mktemp("cuda")
    pretrain(pretrain_config(d / "straight.json", d / "straight"))
    return d / "straight"


def test_killed_and_resumed_cuda_run_is_bitwise_identical(straight: Path, tmp_path: Path) -> None:
    out = tmp_path / "killed"
    cfg = pretrain_config(tmp_path / "killed.json", out)
    log = tmp_path / "killed.log"
    with log.open("w") as f:  # a file, not a pipe nobody reads while waiting: the child never blocks on its log
        proc = subprocess.Popen([sys.executable, "-m", "bertrain", "pretrain", "--config", str(cfg)], env=cli_env(),
                                stdout=f, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while not (out / "step-8" / "COMPLETE").exists():
        assert proc.poll() is None, f"ended before step 8:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, "no checkpoint step-8 appeared"
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    done = [s for s, p in ckpt.list_checkpoints(out) if (p / "COMPLETE").exists()]
    assert 8 <= max(done) < 24, done
    r = pretrain(cfg, "--resume", "auto")
    assert f"resumed from {out / f'step-{max(done)}'}" in r.stderr
    a, b = final(straight), final(out)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert losses(straight) == losses(out)


def test_torchrun_one_rank_on_nccl_equals_the_plain_run(straight: Path, tmp_path: Path) -> None:
    out = tmp_path / "nccl"
    r = torchrun(pretrain_config(tmp_path / "nccl.json", out, distributed={"device": "cuda", "backend": "nccl"}))
    assert "nccl" in (r.stdout + r.stderr)
    a, b = final(straight), final(out)
    # DDP on one rank: the all-reduce of a single gradient is that gradient, so the run is the plain one up to the
    # order of floating-point work (on CUDA it was not bitwise: BENCHMARKS.md "GPU")
    diff = max(float((a[k].float() - b[k].float()).abs().max()) for k in a)
    la, lb = losses(straight), losses(out)
    assert sorted(la) == sorted(lb)
    torch.testing.assert_close([lb[s] for s in sorted(lb)], [la[s] for s in sorted(la)], rtol=1e-3, atol=0)
    assert diff < 1e-3, diff


def test_fsdp2_on_one_rank_nccl_trains_like_ddp(straight: Path, tmp_path: Path) -> None:
    out = tmp_path / "fsdp"
    torchrun(pretrain_config(tmp_path / "fsdp.json", out, distributed={"device": "cuda", "backend": "nccl"},
                             parallelism={"strategy": "fsdp"}))
    la, lb = losses(straight), losses(out)
    assert sorted(la) == sorted(lb)
    # bf16 gathers (FSDP2's param_dtype) vs bf16 autocast of fp32 weights: the same casts, other kernels
    torch.testing.assert_close([lb[s] for s in sorted(lb)], [la[s] for s in sorted(la)], rtol=2e-2, atol=0)
    a, b = final(straight), final(out)
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=2e-2, msg=lambda m: f"{k}: {m}")
    assert any(p.name == "dcp" or p.suffix == ".distcp" for p in (out / "step-24").rglob("*")), \
        "FSDP checkpoints are written by DCP"


# ----------------------------------------------------------------------------------------------- host syncs

@pytest.mark.parametrize("name", ["lamb", "nvlamb", "adamw", "adamw-nobc", "radam"])
def test_optimizer_step_and_clipping_do_not_sync(name: str) -> None:
    """LAMB reads its step count as a Python float for the bias corrections: kept on the host, as torch's own
    optimizers keep it, that read does not wait for the GPU (it did, before issue 26)."""
    from bertrain.model.bert import BertConfig, BertForPreTraining
    torch.manual_seed(0)
    model = BertForPreTraining(BertConfig.from_preset("tiny", vocab_size=100)).to(CUDA)
    opt = build_optimizer(model, OptimConfig(name=name.split("-")[0], lr=1e-3, bias_correction="nobc" not in name))
    params = list(model.parameters())
    for step in range(3):
        for p in params:
            p.grad = torch.randn_like(p)
        torch.cuda.synchronize()
        if step > 0:  # the first step creates the state
            torch.cuda.set_sync_debug_mode("error")
        try:
            torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
            opt.step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    if name in ("lamb", "nvlamb"):
        assert all(st["step"].device.type == "cpu" and float(st["step"]) == 3 for st in opt.state.values())


def test_no_host_sync_in_the_steady_state_step(tmp_path: Path) -> None:
    """20 steps under torch.cuda.set_sync_debug_mode("warn"): the one per-step flags all-reduce (step_flags) is the
    only host sync; the log flush every log_interval steps is the other allowed place."""
    from bertrain.cli import main
    from bertrain.train import trainer
    allowed = {trainer.step_flags.__code__.co_name, trainer.Meter.flush.__code__.co_name}
    cfg = pretrain_config(tmp_path / "sync.json", tmp_path / "sync", steps=28, save_interval=0,
                          train={"log_interval": 100, "deterministic": False}, eval={"enabled": False},
                          checkpoint={"save_interval": 0, "export_final": False})
    syncs: list[str] = []
    original = trainer.take

    def take(it, n):  # steps 9 to 27: the steady state (allocator warm-up and first calls done), not the end
        take.calls += 1
        if take.calls in (9, 28):
            torch.cuda.set_sync_debug_mode("warn" if take.calls == 9 else 0)
        return original(it, n)
    take.calls = 0

    import traceback

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchronizing" in str(message) and torch.cuda.get_sync_debug_mode():
            frames = [f for f in traceback.extract_stack()[:-1] if "/torch/" not in f.filename
                      and not f.filename.endswith("warnings.py")]
            ours = [f for f in frames if f.filename.startswith(SRC)]
            # the innermost caller is bertrain's (not this test's own switch), outside the allowed places
            if frames and frames[-1].filename.startswith(SRC) and not any(f.name in allowed for f in ours):
                syncs.append(" <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(ours[-4:])))

    trainer.take, shown = take, warnings.showwarning
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            assert main(["pretrain", "--config", str(cfg)]) == 0
    finally:
        torch.cuda.set_sync_debug_mode(0)
        trainer.take, warnings.showwarning = original, shown
    assert take.calls >= 28
    assert not syncs, "host syncs in the steady-state step:\n" + "\n".join(sorted(set(syncs)))
