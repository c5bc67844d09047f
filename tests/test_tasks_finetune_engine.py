"""Fine-tuning runs on the pretraining engine and has its guarantees: kill -9 then `--resume auto` is bitwise the
straight run (GLUE and SQuAD: weights, losses and predictions), 1x4 == 2x2 == 4x1, gradient checkpointing
changes nothing, and `--resume` is one option spelled the same for every training command."""
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

from distributed import cli_env, launch_cli
from helpers import finetune_argv, finetune_data, save_tiny_model

from bertrain.cli import build_parser, main


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {"dropout": save_tiny_model(root / "dropout", 0.1), "no_dropout": save_tiny_model(root / "plain", 0.0)}


def _run(argv: list[str]) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "-m", "bertrain", *argv], env=cli_env(), capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return r


def _weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(out / "final" / "model.safetensors"))


def _losses(out: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
            if "event" not in r}  # training records (evaluations are records too)


@pytest.mark.slow
@pytest.mark.parametrize("task", ["glue", "squad"])
def test_killed_finetune_resumes_bitwise(tmp_path: Path, models: dict[str, Path], task: str) -> None:
    """Dropout on, so the RNG state of the killed run must be restored exactly too; a dev evaluation every 10 steps,
    so the evaluation history, the best step and OUTPUT/best must come back exactly as well."""
    data = finetune_data(task, tmp_path / "data")
    steps, kill_after = 80, 6
    ckpt = ["--checkpoint.save_interval", "2", "--checkpoint.keep_last", "0", "--eval.interval", "10"]
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    # the straight run and the run to kill go side by side (one thread each: the same numbers as alone)
    straight_proc = subprocess.Popen([sys.executable, "-m", "bertrain",
                                      *finetune_argv(task, data, models["dropout"], straight, steps, *ckpt)],
                                     env=cli_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    proc = subprocess.Popen([sys.executable, "-m", "bertrain",
                             *finetune_argv(task, data, models["dropout"], killed, steps, *ckpt)],
                            env=cli_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while not (killed / f"step-{kill_after}" / "COMPLETE").exists():
        assert proc.poll() is None, "the run ended before the kill (make it longer)"
        assert time.time() < deadline, "no checkpoint appeared"
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert not (killed / f"step-{steps}").exists() and not (killed / "final").exists()
    _, err = straight_proc.communicate(timeout=600)
    assert straight_proc.returncode == 0, err[-3000:]

    r = _run(finetune_argv(task, data, models["dropout"], killed, steps, *ckpt, "--resume", "auto"))
    assert "resumed from" in r.stderr
    a, b = _weights(straight), _weights(killed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    la, lb = _losses(straight), _losses(killed)
    assert sorted(lb) == list(range(1, steps + 1)) and la == lb  # every step's loss, bit for bit
    ra, rb = (json.loads((d / "eval_results.json").read_text()) for d in (straight, killed))
    assert set(range(10, steps + 1, 10)) <= {h["step"] for h in ra["selection"]["history"]}  # (and each epoch)
    assert ra["selection"] == rb["selection"]  # every dev evaluation, the best step, bit for bit
    best_a, best_b = (load_file(str(d / "best" / "model.safetensors")) for d in (straight, killed))
    assert all(torch.equal(best_a[k], best_b[k]) for k in best_a)
    if task == "glue":
        assert (straight / "RTE.tsv").read_bytes() == (killed / "RTE.tsv").read_bytes()
        assert ra["dev"] == rb["dev"]
    else:
        for name in ("predictions.json", "nbest_predictions.json", "null_odds.json"):
            assert (straight / name).read_bytes() == (killed / name).read_bytes(), name


@pytest.mark.slow
def test_finetune_one_process_accumulation_equals_data_parallel(tmp_path: Path, models: dict[str, Path]) -> None:
    """Global batch 8 as 1 process x 4 micro-steps of 2, 2 x 2 and 4 x 1 (no dropout): the same weights."""
    data = finetune_data("glue", tmp_path / "data")
    outs = {}
    for world in (1, 2, 4):
        outs[world] = tmp_path / f"w{world}"
        argv = finetune_argv("glue", data, models["no_dropout"], outs[world], 5, "--train.global_batch_size", "8",
                     "--train.micro_batch_size", "2", "--do_eval", "false", "--data.predict_test", "false")
        for r in launch_cli(world, argv):
            assert r.returncode == 0, r.stdout[-3000:]
    one = _weights(outs[1])
    init = load_file(str(models["no_dropout"] / "model.safetensors"))
    key = next(k for k in one if k.endswith("layer.0.attention.self.query.weight"))
    assert (one[key] - init[next(k for k in init if k.endswith("layer.0.attention.self.query.weight"))]).abs().max() > 1e-4
    for world in (2, 4):
        other = _weights(outs[world])
        for k in one:
            torch.testing.assert_close(one[k], other[k], rtol=1e-4, atol=1e-6, msg=lambda m: f"{world} ranks {k}: {m}")
        la, lw = _losses(outs[1]), _losses(outs[world])
        assert sorted(la) == sorted(lw) == [1, 2, 3, 4, 5]
        torch.testing.assert_close([la[s] for s in sorted(la)], [lw[s] for s in sorted(lw)], rtol=1e-5, atol=1e-6)


def test_finetune_gradient_checkpointing_changes_nothing(tmp_path: Path, models: dict[str, Path], capsys,
                                                         monkeypatch) -> None:
    """Recomputing activations (dropout on: the RNG is replayed) gives the same weights and predictions."""
    recomputed = []
    real = torch.utils.checkpoint.checkpoint

    def counting(*args, **kwargs):  # proves the option reaches the fine-tuned model (else equality is trivial)
        recomputed.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.utils.checkpoint, "checkpoint", counting)
    data = finetune_data("glue", tmp_path / "data")
    outs, calls = {}, {}
    for flag in ("false", "true"):
        outs[flag] = tmp_path / f"ckpt-{flag}"
        recomputed.clear()
        assert main(finetune_argv("glue", data, models["dropout"], outs[flag], 6,
                          "--model_options.gradient_checkpointing", flag)) == 0
        calls[flag] = len(recomputed)
    capsys.readouterr()
    assert calls["false"] == 0 and calls["true"] >= 6 * 2  # every layer of every training forward
    a, b = _weights(outs["false"]), _weights(outs["true"])
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert (outs["false"] / "RTE.tsv").read_bytes() == (outs["true"] / "RTE.tsv").read_bytes()
    assert _losses(outs["false"]) == _losses(outs["true"])


def test_resume_is_one_option_for_every_training_command() -> None:
    """`--resume` has one spelling, help and default in pretrain and finetune, and is not a config key."""
    from bertrain.tasks.finetune import GlueFinetuneConfig, SquadFinetuneConfig
    from bertrain.tasks.pretraining import PretrainConfig

    def sub_parser(*names: str):
        p = build_parser([names[0]])  # fills the named command's parser only
        for name, dest in zip(names, ("command", "ft_task")):
            p = next(a for a in p._actions if a.dest == dest).choices[name]
        return p

    actions = [next(a for a in sub_parser(*names)._actions if a.dest == "resume")
               for names in (("pretrain",), ("finetune", "glue"), ("finetune", "squad"))]
    assert {(tuple(a.option_strings), a.metavar, a.help, a.default) for a in actions} == {
        (("--resume",), "auto|PATH", actions[0].help, None)}
    for cls in (PretrainConfig, GlueFinetuneConfig, SquadFinetuneConfig):
        assert "resume" not in {f.name for f in cls.__dataclass_fields__.values()}
    args = build_parser(["finetune"]).parse_args(["finetune", "glue", "--task", "rte", "--data-dir", ".", "--init", ".", "--output",
                              "o", "--resume", "auto"])
    assert args.resume == "auto"
