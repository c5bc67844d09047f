"""parallelism.strategy fsdp (FSDP2) on CPU/gloo: the same training as DDP, sharded.

* Optimizers and clipping on sharded tensors equal the full-tensor maths (LAMB per-tensor and multi-tensor,
  NVLAMB, AdamW, BERT AdamW, RAdam), and an fp16 overflow on one rank's shard skips the step on every rank.
* End to end through the CLI on 2 and 4 ranks: FSDP == DDP step by step for 20 steps (LAMB and AdamW, with
  accumulation); kill -9 + a corrupt newest sharded checkpoint + `--resume auto` == the straight run bit for bit;
  resume 4 -> 2 ranks; a DDP checkpoint continued under FSDP and that one under DDP again; the final export is one
  HF folder `transformers` loads.
* Configurations that do not fit the world size are refused, naming the key.
"""
from __future__ import annotations

import json
import math
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from distributed import cli_env, free_port, launch_cli, rank_env, spawn

from bertrain.cli import main
from bertrain.train import checkpoint as ckpt


def config(out: Path, optim: str = "lamb", strategy: str = "fsdp", dropout: float = 0.1, **parallelism) -> dict:
    """20 steps of a tiny BERT; global batch 16 = micro 2 x accumulation 4 x 2 ranks (x 2 x 4 ranks)."""
    return {
        "model": {"preset": "tiny", "dropout": dropout},
        "data": {"synthetic_samples": 256, "vocab_size": 100},
        "sample": {"max_seq_length": 32, "max_predictions_per_seq": 5},
        "train": {"steps": 20, "global_batch_size": 16, "micro_batch_size": 2, "log_interval": 1},
        "optim": {"name": optim, "lr": 0.01, "weight_decay": 0.01, "max_grad_norm": 1.0},
        "schedule": {"name": "poly", "warmup": 0.25},
        "checkpoint": {"save_interval": 5, "keep_last": 0},
        "distributed": {"timeout_s": 120, "heartbeat_timeout_s": 60},
        "parallelism": {"strategy": strategy, **parallelism},
        "seed": 7, "output_dir": str(out),
    }


def write(path: Path, cfg: dict) -> Path:
    path.write_text(json.dumps(cfg))
    return path


def pretrain(world: int, cfg: dict, *extra: str) -> str:
    """Run `bertrain pretrain` on `world` ranks; returns rank 0's output (asserting every rank succeeded)."""
    path = write(Path(cfg["output_dir"] + ".json"), cfg)
    results = launch_cli(world, ["pretrain", "--config", str(path), *extra], timeout=600)
    for rank, r in enumerate(results):
        assert r.returncode == 0, f"rank {rank}:\n{r.stdout[-4000:]}"
    return results[0].stdout


def final(out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(out / "final" / "model.safetensors"))


def records(out: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}


def assert_weights_close(a: dict, b: dict, **tol: float) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], msg=lambda m: f"{k}: {m}", **tol)


def assert_records_close(a: dict[int, dict], b: dict[int, dict], steps: range) -> None:
    for key in ("loss", "mlm_loss", "nsp_loss", "grad_norm"):
        torch.testing.assert_close([a[s][key] for s in steps], [b[s][key] for s in steps], rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"{key}: {m}")


# ----------------------------------------------------------------------------------------------- refusals

def test_configurations_that_do_not_fit_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from bertrain.config import from_dict
    from bertrain.tasks.pretraining import PretrainConfig
    from bertrain.train.parallel import ParallelDims

    def dims(world: int, **changes: object) -> ParallelDims:
        cfg = config(tmp_path / "x")
        for key, value in changes.items():
            section, name = key.split("__")
            cfg[section][name] = value
        return ParallelDims.from_config(from_dict(PretrainConfig, cfg), world)

    assert dims(4) == ParallelDims(dp_replicate=1, dp_shard=4) and dims(4).fsdp_enabled
    assert dims(4, parallelism__strategy="ddp") == ParallelDims(dp_replicate=4, dp_shard=1)
    assert dims(4, parallelism__dp_shard=2) == ParallelDims(dp_replicate=2, dp_shard=2)
    with pytest.raises(ValueError, match="'parallelism.strategy' is fsdp but the job has 1 rank") as refused:
        dims(1)
    assert "dp_shard" not in str(refused.value)  # one message, not a second one about dp_shard
    with pytest.raises(ValueError, match=r"'parallelism.dp_shard' \(3\) must divide the world size \(4\)"):
        dims(4, parallelism__dp_shard=3)
    with pytest.raises(ValueError, match=r"'parallelism.dp_shard' \(2\) applies only with parallelism.strategy"):
        dims(4, parallelism__strategy="ddp", parallelism__dp_shard=2)
    with pytest.raises(ValueError, match="'distributed.grad_compression'.*'parallelism.reduce_dtype'"):
        dims(2, distributed__grad_compression="fp16")
    with pytest.raises(ValueError, match="fp16 need the loss scaling of 'precision.mode' fp16"):
        dims(2, parallelism__param_dtype="fp16")
    # keys that would silently do nothing under ddp; every problem reported at once
    with pytest.raises(ValueError, match="'parallelism.reshard_after_forward'.*; config key 'parallelism.reduce_dtype"):
        dims(2, parallelism__strategy="ddp", parallelism__reshard_after_forward=False,
             parallelism__reduce_dtype="bf16")
    # through the CLI: a user error (exit 2) before any work, naming the key
    path = write(tmp_path / "one.json", config(tmp_path / "one"))
    assert main(["pretrain", "--config", str(path)]) == 2
    assert "'parallelism.strategy' is fsdp but the job has 1 rank" in capsys.readouterr().err
    assert not list((tmp_path / "one").glob("step-*"))


# ----------------------------------------------------------------------------------------------- the step, sharded

def test_model_outputs_are_pytree_nodes_so_fsdp_finds_their_tensors() -> None:
    """torch 2.11's FSDP2 registers the root module's pre-backward hook on the output tensors that pytree's
    `tree_flatten` finds: a plain dataclass is one opaque leaf to it, so the hook was never registered, the root's
    weights (embeddings, heads) stayed freed after forward, and the first backward failed ("setStorage: ... out of
    bounds for storage of size 0": every FSDP test on torch 2.11, and the GPU session's FSDP2 crash). Every output
    type must flatten to its tensors, in field order, and rebuild to an equal output."""
    import dataclasses

    from torch.utils._pytree import tree_flatten, tree_unflatten

    from bertrain.model import bert

    for cls in (bert.BertModelOutput, bert.BertForPreTrainingOutput, bert.SequenceClassifierOutput,
                bert.QuestionAnsweringOutput):
        values = {f.name: torch.full((2,), float(i), requires_grad=True) for i, f in enumerate(dataclasses.fields(cls))}
        out = cls(**values)
        leaves, spec = tree_flatten(out)
        assert [id(t) for t in leaves] == [id(v) for v in values.values()], cls.__name__
        assert tree_unflatten(leaves, spec) == out
        if len(values) > 1:  # a missing optional output is no leaf, and still rebuilds
            partial = cls(**{next(iter(values)): values[next(iter(values))]})
            leaves, spec = tree_flatten(partial)
            assert len(leaves) == 1 and tree_unflatten(leaves, spec) == partial


def _sharded_step_worker(rank: int, world_size: int, out: str) -> None:
    from bertrain.model.bert import BertConfig, BertForPreTraining
    from bertrain.train.config import (
        DistributedConfig, OptimConfig, ParallelismConfig, PrecisionConfig, TrainConfig, TrainerConfig,
    )
    from bertrain.train.distributed import init_distributed, no_sync
    from bertrain.train.optim import Lamb, build_optimizer
    from bertrain.train.parallel import apply_fsdp
    from bertrain.train.precision import Precision
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    dist = init_distributed(DistributedConfig(timeout_s=60))
    trainer_cfg = TrainerConfig(train=TrainConfig(steps=1), parallelism=ParallelismConfig(strategy="fsdp"),
                                output_dir=out)
    torch.manual_seed(0)
    batches = [torch.randint(1, 100, (4, 16)) for _ in range(3)]  # the same on every rank: FSDP's mean = the grad

    def models() -> tuple[torch.nn.Module, torch.nn.Module]:
        torch.manual_seed(1)
        plain = BertForPreTraining(BertConfig.from_preset("tiny", vocab_size=100, hidden_dropout_prob=0.0,
                                                          attention_probs_dropout_prob=0.0))
        torch.manual_seed(1)
        sharded = BertForPreTraining(BertConfig.from_preset("tiny", vocab_size=100, hidden_dropout_prob=0.0,
                                                            attention_probs_dropout_prob=0.0))
        return plain, apply_fsdp(sharded, trainer_cfg, dist)

    results = {}
    for name, kwargs in [("lamb", {}), ("lamb-foreach", {}), ("nvlamb", {}), ("adamw", {}),
                         ("adamw", {"bias_correction": False}), ("radam", {})]:
        key = name + ("-nobc" if kwargs else "")
        plain, sharded = models()
        opt_cfg = OptimConfig(name=name.split("-")[0], lr=0.05, max_grad_norm=0.5, **kwargs)
        opts = [build_optimizer(m, opt_cfg) for m in (plain, sharded)]
        if name == "lamb-foreach":
            assert all(isinstance(o, Lamb) for o in opts)
            for o in opts:
                o.foreach = True
        precision = Precision(PrecisionConfig(), dist.device)
        norms = []
        for ids in batches:
            pair = []
            for model, opt in zip((plain, sharded), opts):
                model(ids, labels=ids).loss.backward()
                pair.append(float(precision.unscale_and_clip(opt, list(model.parameters()), 0.5)))
                precision.step(opt)
                opt.zero_grad(set_to_none=True)
            norms.append(pair)
        full = get_model_state_dict(sharded, options=StateDictOptions(full_state_dict=True))
        results[key] = {"norms": norms, "plain": plain.state_dict(), "sharded": full,
                        "start": models()[0].state_dict()}

    # bf16: the mixed-precision policy gathers and computes in bf16 (fp32 shards); gradients close to autocast's
    bf16_cfg = TrainerConfig(train=TrainConfig(steps=1), precision=PrecisionConfig(mode="bf16"),
                             parallelism=ParallelismConfig(strategy="fsdp"), output_dir=out)
    torch.manual_seed(1)
    plain = BertForPreTraining(BertConfig.from_preset("tiny", vocab_size=100, hidden_dropout_prob=0.0,
                                                      attention_probs_dropout_prob=0.0))
    sharded = apply_fsdp(type(plain)(plain.config), bf16_cfg, dist)
    from torch.distributed.checkpoint.state_dict import set_model_state_dict
    set_model_state_dict(sharded, plain.state_dict(), options=StateDictOptions(full_state_dict=True))
    seen = []
    layer = sharded.bert.encoder.layer[0].intermediate
    layer.register_forward_pre_hook(lambda m, args: seen.append(m.dense.weight.dtype))
    bf16 = Precision(PrecisionConfig(mode="bf16"), dist.device)
    norms = []
    for model in (plain, sharded):
        with bf16.autocast():
            loss = model(batches[0], labels=batches[0]).loss
        loss.backward()
        norms.append(float(bf16.unscale_and_clip(build_optimizer(model, OptimConfig()), list(model.parameters()), 0.0)))
    results["bf16"] = {"seen": seen, "norms": norms,
                       "shard_dtype": next(sharded.parameters()).to_local().dtype,
                       "grad_dtype": next(sharded.parameters()).grad.to_local().dtype}
    # with dropout on (the CPU mask was float32 and made bf16 activations float32, which the bf16 LayerNorm of the
    # mixed-precision policy refused: "mixed dtype (CPU)", every bf16 FSDP run with dropout crashed)
    dropping = apply_fsdp(BertForPreTraining(BertConfig.from_preset("tiny", vocab_size=100)), bf16_cfg, dist).train()
    with bf16.autocast():
        loss = dropping(batches[0], labels=batches[0]).loss
    loss.backward()
    results["bf16"]["dropout_loss"] = float(loss)

    # all-gathers per optimizer step of 4 micro-steps (FSDP2's own hook point; None where a torch version lacks it)
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group
    gather = getattr(_fsdp_param_group, "foreach_all_gather", None)
    results["gathers"] = None
    if gather is not None:
        counts = [0]

        def counting(*args, **kwargs):
            counts[0] += 1
            return gather(*args, **kwargs)

        _fsdp_param_group.foreach_all_gather = counting
        results["gathers"] = {}
        for reshard in (True, False):
            cfg = TrainerConfig(train=TrainConfig(steps=1), output_dir=out,
                                parallelism=ParallelismConfig(strategy="fsdp", reshard_after_forward=reshard))
            model = apply_fsdp(BertForPreTraining(BertConfig.from_preset("tiny", vocab_size=100)), cfg, dist)
            counts[0] = 0
            for i in range(4):
                with no_sync(model, enabled=i < 3, keep_gathered=not reshard):
                    model(batches[0], labels=batches[0]).loss.backward()
            results["gathers"][reshard] = counts[0]
        _fsdp_param_group.foreach_all_gather = gather

    # fp16: an overflow in one rank's shard only must skip the step on every rank
    plain, sharded = models()
    opt = build_optimizer(sharded, OptimConfig(name="lamb"))
    precision = Precision(PrecisionConfig(mode="fp16", initial_loss_scale=1024.0), dist.device)
    before = [p.to_local().clone() for p in sharded.parameters()]
    with precision.autocast():
        loss = sharded(batches[0], labels=batches[0]).loss
    precision.backward(loss)
    if rank == 1:
        next(p for p in sharded.parameters() if p.to_local().numel()).grad.to_local()[0].fill_(float("inf"))
    precision.unscale_and_clip(opt, list(sharded.parameters()), 1.0)
    stepped = precision.step(opt)
    unchanged = all(torch.equal(a, p.to_local()) for a, p in zip(before, sharded.parameters()))
    results["fp16"] = {"stepped": stepped, "unchanged": unchanged, "scale": precision.loss_scale}
    torch.save(results, Path(out) / f"rank{rank}.pt")


@pytest.mark.slow
def test_sharded_optimizers_and_clipping_equal_full_tensors(tmp_path: Path) -> None:
    spawn(_sharded_step_worker, 2, str(tmp_path))
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    for name in ("lamb", "lamb-foreach", "nvlamb", "adamw", "adamw-nobc", "radam"):
        for res in ranks:
            r = res[name]
            # the clipped norm is the global norm of the full gradients (each rank holds half of them)
            torch.testing.assert_close([n[1] for n in r["norms"]], [n[0] for n in r["norms"]], rtol=1e-5, atol=0)
            assert all(n[0] > 0.5 for n in r["norms"]), r["norms"]  # clipping really happened
            assert_weights_close(r["plain"], r["sharded"], rtol=1e-5, atol=1e-6)
            moved = max(float((r["plain"][k] - r["start"][k]).abs().max()) for k in r["start"])
            assert moved > 1e-3, (name, moved)  # three steps moved the weights far beyond the tolerance
    for res in ranks:
        assert res["fp16"] == {"stepped": False, "unchanged": True, "scale": 512.0}, res["fp16"]
        bf16 = res["bf16"]
        assert bf16["seen"] == [torch.bfloat16] and bf16["shard_dtype"] == bf16["grad_dtype"] == torch.float32
        torch.testing.assert_close(bf16["norms"][1], bf16["norms"][0], rtol=2e-2, atol=0)
        assert math.isfinite(bf16["dropout_loss"]) and bf16["dropout_loss"] > 0
    # 3 units (root, 2 layers): ZeRO-3 gathers each for forward and again for backward (the last layer stays
    # gathered) on every micro-step: 4 x 5; without resharding the weights stay gathered through the
    # accumulation: each unit once per optimizer step
    if ranks[0]["gathers"] is None:
        pytest.skip("this torch has no FSDP2 foreach_all_gather to count (the rest was checked)")
    assert ranks[0]["gathers"] == ranks[1]["gathers"] == {True: 20, False: 3}


# ----------------------------------------------------------------------------------------------- end to end

@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Straight 20-step runs: DDP and FSDP with LAMB on 2 ranks and HSDP (2 x 2) on 4; DDP (2 ranks) and FSDP
    (4 ranks, weights not resharded after forward) with AdamW. (Dropout masks follow the global micro-batch slot,
    so 2 and 4 ranks draw the same ones.)"""
    root = tmp_path_factory.mktemp("fsdp")
    out = {}
    for name, world, cfg in [("ddp-lamb", 2, {"strategy": "ddp"}), ("fsdp-lamb", 2, {}),
                             ("ddp-adamw", 2, {"strategy": "ddp", "optim": "adamw", "dropout": 0.0}),
                             # no resharding: the gathered weights stay through accumulation (no_sync keep_gathered)
                             ("fsdp4-adamw", 4, {"optim": "adamw", "dropout": 0.0, "reshard_after_forward": False}),
                             ("hsdp4-lamb", 4, {"dp_shard": 2})]:  # HSDP: sharded in pairs, replicated twice
        out[name] = root / name
        pretrain(world, config(out[name], **cfg))
    return out


@pytest.mark.slow
def test_fsdp_equals_ddp_step_by_step(runs: dict[str, Path], tmp_path: Path,
                                      capsys: pytest.CaptureFixture) -> None:
    for ddp, fsdp in (("ddp-lamb", "fsdp-lamb"), ("ddp-adamw", "fsdp4-adamw"), ("ddp-lamb", "hsdp4-lamb")):
        a, b = records(runs[ddp]), records(runs[fsdp])
        assert sorted(a) == sorted(b) == list(range(1, 21))
        assert_records_close(a, b, range(1, 21))
        assert_weights_close(final(runs[ddp]), final(runs[fsdp]), rtol=1e-4, atol=1e-5)
    # the run really moved (a wrong normalisation could not pass the tolerance above)
    assert records(runs["fsdp-lamb"])[20]["loss"] < records(runs["fsdp-lamb"])[1]["loss"] - 0.05
    # the checkpoints are sharded: one file per rank, in the manifest; the final export is one HF folder
    step = runs["fsdp4-adamw"] / "step-20"
    assert sorted(p.name for p in (step / "dcp").glob("*.distcp")) == [f"__{r}_0.distcp" for r in range(4)]
    assert not (step / "model.safetensors").exists() and ckpt.verify_checkpoint(step) is None
    assert "dcp/__3_0.distcp" in json.loads((step / "manifest.json").read_text())["files"]
    from bertrain.cli import main
    # a sharded step is self-contained (config.json, tokenizer): `export` assembles its shards into an HF folder,
    # from the step or from a run folder whose newest step it is; the last step's weights are the final model's
    assert (step / "config.json").is_file()
    for source in (step, runs["fsdp4-adamw"].parent / "no-final"):
        if source.name == "no-final":
            source.mkdir()
            (source / "step-20").symlink_to(step, target_is_directory=True)
        assert main(["export", str(source), str(tmp_path / source.name)]) == 0
        assert f"exported {step if source == step else source / 'step-20'} ->" in capsys.readouterr().out
        exported = load_file(str(tmp_path / source.name / "model.safetensors"))
        whole = final(runs["fsdp4-adamw"])
        assert exported.keys() == whole.keys() and all(torch.equal(exported[k], whole[k]) for k in whole)
    shutil.rmtree(tmp_path / step.name, ignore_errors=True)
    older = tmp_path / "older"  # a sharded checkpoint of an older bertrain (no config.json): refused, saying why
    shutil.copytree(step, older)
    (older / "config.json").unlink()
    assert main(["export", str(older), str(tmp_path / "older-out")]) == 2
    assert "sharded checkpoint from an older bertrain, without config.json" in capsys.readouterr().err
    transformers = pytest.importorskip("transformers")
    hf = transformers.BertForPreTraining.from_pretrained(runs["fsdp-lamb"] / "final")
    ours = final(runs["fsdp-lamb"])
    assert torch.equal(hf.bert.encoder.layer[1].output.dense.weight, ours["bert.encoder.layer.1.output.dense.weight"])


def _start(world: int, config_path: Path) -> list[subprocess.Popen]:
    port = free_port()
    return [subprocess.Popen([sys.executable, "-m", "bertrain", "pretrain", "--config", str(config_path)],
                             env=cli_env(rank_env(r, world, port)), stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL) for r in range(world)]


@pytest.mark.slow
def test_killed_run_with_a_corrupt_shard_resumes_bitwise(runs: dict[str, Path], tmp_path: Path) -> None:
    """kill -9 every rank after step 10's checkpoint, flip a byte in the newest checkpoint's rank-1 shard:
    --resume auto skips it, continues from the one before, and ends bit for bit where the straight run did."""
    out = tmp_path / "killed"
    path = write(tmp_path / "killed.json", config(out))
    procs = _start(2, path)
    try:
        deadline = time.time() + 400
        while not (out / "step-10" / ckpt.COMPLETE).exists():
            assert all(p.poll() is None for p in procs), "the run ended before step 10"
            assert time.time() < deadline, "no checkpoint appeared"
            time.sleep(0.02)
    finally:
        for p in procs:
            p.send_signal(signal.SIGKILL)
            p.wait(timeout=60)
    done = [s for s, p in ckpt.list_checkpoints(out) if (p / ckpt.COMPLETE).exists()]
    newest = max(done)
    assert 10 <= newest < 20, done
    shard = out / f"step-{newest}" / "dcp" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))

    log = pretrain(2, config(out), "--resume", "auto")
    assert f"skipping checkpoint {out / f'step-{newest}'}: corrupt file dcp/__1_0.distcp" in log
    assert f"resumed from {out / f'step-{newest - 5}'}" in log
    straight = runs["fsdp-lamb"]
    a, b = final(straight), final(out)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ra, rb = records(straight), records(out)
    assert [ra[s]["loss"] for s in range(1, 21)] == [rb[s]["loss"] for s in range(1, 21)]


@pytest.mark.slow
def test_resume_on_fewer_ranks(runs: dict[str, Path], tmp_path: Path) -> None:
    """The 4-rank FSDP checkpoint at step 10, continued on 2 ranks: DCP reshards weights and moments."""
    out = tmp_path / "on2"
    log = pretrain(2, config(out, optim="adamw", dropout=0.0), "--resume", str(runs["fsdp4-adamw"] / "step-10"))
    assert "resuming on 2 ranks from a 4-rank checkpoint" in log
    assert_records_close(records(runs["fsdp4-adamw"]), records(out), range(11, 21))
    assert_weights_close(final(runs["fsdp4-adamw"]), final(out), rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_a_launchers_one_rank_job_resumes_the_shards(runs: dict[str, Path], tmp_path: Path) -> None:
    """What an elastic FSDP job that shrank to one node runs: torchrun's environment with WORLD_SIZE=1 and the
    default backend. It makes a one-rank group and continues the 2-rank shards (before: 'fsdp but the job has 1
    rank' at every restart, where a DDP job went on); without a launcher one process is still refused."""
    out = tmp_path / "on1"
    cfg = config(out)
    path = write(tmp_path / "on1.json", cfg)
    argv = [sys.executable, "-m", "bertrain", "pretrain", "--config", str(path),
            "--resume", str(runs["fsdp-lamb"] / "step-10")]
    r = subprocess.run(argv, env=cli_env(rank_env(0, 1, free_port())), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    assert "resuming on 1 ranks from a 2-rank checkpoint" in r.stderr, r.stderr[-4000:]
    assert "micro 2 x accumulation 8 x 1 ranks" in r.stderr, r.stderr[-4000:]
    assert (out / "step-15" / "dcp").is_dir()  # still sharded (one shard)
    assert_records_close(records(runs["fsdp-lamb"]), records(out), range(11, 21))
    assert_weights_close(final(runs["fsdp-lamb"]), final(out), rtol=1e-4, atol=1e-5)
    alone = subprocess.run(argv[:-2] + ["--overwrite"], env=cli_env(), capture_output=True, text=True, timeout=600)
    assert alone.returncode == 2 and "fsdp but the job has 1 rank" in alone.stderr, alone.stderr[-2000:]
    assert (out / "final" / "model.safetensors").is_file()  # refused before --overwrite moved the run aside


@pytest.mark.slow
def test_ddp_checkpoint_continues_under_fsdp_and_back(runs: dict[str, Path], tmp_path: Path) -> None:
    """DDP step-5 -> FSDP (steps 6-15, sharded checkpoints) -> DDP (steps 16-20) == the straight DDP run."""
    to_fsdp, back = tmp_path / "to-fsdp", tmp_path / "back"
    log = pretrain(2, config(to_fsdp), "--resume", str(runs["ddp-lamb"] / "step-5"))
    assert "resuming with parallelism.strategy = 'fsdp' (was 'ddp')" in log
    assert (to_fsdp / "step-15" / "dcp").is_dir()
    log = pretrain(2, config(back, strategy="ddp"), "--resume", str(to_fsdp / "step-15"))
    assert "resuming with parallelism.strategy = 'ddp' (was 'fsdp')" in log
    assert (back / "step-20" / "model.safetensors").is_file()
    straight = records(runs["ddp-lamb"])
    assert_records_close(straight, records(to_fsdp), range(6, 16))
    assert_records_close(straight, records(back), range(16, 21))
    assert_weights_close(final(runs["ddp-lamb"]), final(back), rtol=1e-4, atol=1e-5)
    # and the optimizer moments came through both conversions
    sa, sb = (ckpt.load_train_state(d / "step-20") for d in (runs["ddp-lamb"], back))
    for pa, pb in zip(sa["optimizer"]["state"].values(), sb["optimizer"]["state"].values()):
        for k in pa:
            torch.testing.assert_close(pa[k], pb[k], rtol=1e-4, atol=1e-7)


@pytest.mark.slow
def test_finetune_under_fsdp_equals_ddp(tmp_path: Path) -> None:
    """GLUE fine-tuning on 2 ranks, DDP and FSDP: the same weights, and the dev set scored by the model gathered
    back from the shards gives the same metrics."""
    from helpers import finetune_argv as _argv, finetune_data as _data, save_tiny_model as _tiny_model
    data, model = _data("glue", tmp_path / "data"), _tiny_model(tmp_path / "init", 0.1)
    outs = {}
    for strategy in ("ddp", "fsdp"):
        outs[strategy] = tmp_path / strategy
        argv = _argv("glue", data, model, outs[strategy], 6, "--train.global_batch_size", "8",
                     "--train.micro_batch_size", "2", "--parallelism.strategy", strategy)
        for r in launch_cli(2, argv, timeout=600):
            assert r.returncode == 0, r.stdout[-3000:]
    assert (outs["fsdp"] / "step-6" / "dcp").is_dir()
    assert_weights_close(final(outs["ddp"]), final(outs["fsdp"]), rtol=1e-4, atol=1e-5)
    ddp, fsdp = (json.loads((outs[s] / "eval_results.json").read_text()) for s in ("ddp", "fsdp"))
    assert ddp["dev"] == fsdp["dev"] and ddp["dev"]["examples"] == 10
    torch.testing.assert_close(ddp["final_loss"], fsdp["final_loss"], rtol=1e-5, atol=0)
    for name in ("dev_predictions.tsv", "RTE.tsv"):
        assert (outs["ddp"] / name).read_text() == (outs["fsdp"] / name).read_text()


@pytest.mark.slow
def test_optimizer_moments_from_another_run_in_every_combination(runs: dict[str, Path], tmp_path: Path) -> None:
    """`optim.init_state` (NVIDIA's phase 2: phase 1's moments, steps counted from 0): a DDP or a sharded checkpoint
    into a DDP or an FSDP run, all from the same weights, give the same steps; a run without it other steps."""
    weights = str(runs["ddp-lamb"] / "step-10")
    out: dict[str, Path] = {}
    # (DDP checkpoint -> DDP run: tests/test_optim_init_state.py, in one process)
    for name, strategy, source in (("ddp<-dcp", "ddp", "fsdp-lamb"), ("fsdp<-ddp", "fsdp", "ddp-lamb"),
                                   ("fsdp<-dcp", "fsdp", "fsdp-lamb"), ("fresh", "ddp", None)):
        out[name] = tmp_path / name.replace("<-", "-from-")
        cfg = config(out[name], strategy=strategy)
        cfg["model"]["init"] = weights
        cfg["train"]["steps"] = 4
        cfg["optim"]["lr"] = 0.004
        if source:
            cfg["optim"]["init_state"] = str(runs[source] / "step-10")
        log = pretrain(2, cfg)
        if source:
            assert "(optim.init_state); step counters start at 0" in log
    base = records(out["ddp<-dcp"])
    for name in ("fsdp<-ddp", "fsdp<-dcp"):
        assert_records_close(base, records(out[name]), range(1, 5))
        assert_weights_close(final(out["ddp<-dcp"]), final(out[name]), rtol=1e-4, atol=1e-5)
    fresh = records(out["fresh"])
    assert fresh[1]["loss"] == pytest.approx(base[1]["loss"], rel=1e-6)  # the same weights and batch ...
    assert abs(fresh[2]["loss"] - base[2]["loss"]) > 1e-4  # ... but another first step
