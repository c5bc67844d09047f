"""Multi-process proof on CPU (gloo): identical parameters on every rank, 1x4 == 2x2 == 4x1 accumulation (1x2 ==
2x1 bit for bit), resume on another world size, uneven data without a hang. Runs `train()` itself in spawned processes."""
from __future__ import annotations

import json
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from distributed import base_config, spawn

pytestmark = pytest.mark.slow


def _train_worker(rank: int, world_size: int, cfg_dict: dict, resume: str | None) -> None:
    from bertrain.config import from_dict
    from bertrain.tasks.pretraining import PretrainConfig, run_pretraining
    import bertrain.train.distributed as distributed
    cfg = from_dict(PretrainConfig, cfg_dict)
    backends, init = [], distributed.init_distributed

    def recorded(*args):  # the process group's backend while the run lasts (None: no group)
        info = init(*args)
        backends.append(info.backend)
        return info
    distributed.init_distributed = recorded
    result = run_pretraining(cfg, resume=resume)
    state = {k: v.detach().clone() for k, v in result.model.state_dict().items()}
    torch.save({"params": state, "step": result.state.step, "epoch": result.state.epoch, "backend": backends[-1]},
               Path(cfg.output_dir) / f"rank{rank}.pt")


def losses(out: Path) -> list[float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows]


def assert_state_close(a: dict, b: dict, **tol: float) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], msg=lambda m: f"{k}: {m}", **tol)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """The same 4 steps (global batch 16) as 1 process x 4 micro-steps, 2 x 2 and 4 x 1."""
    root = tmp_path_factory.mktemp("ddp")
    out = {}
    for world in (1, 2, 4):
        out[world] = root / f"w{world}"
        spawn(_train_worker, world, base_config(out[world]), None)
    return out


def test_parameters_identical_on_all_ranks(runs: dict[int, Path]) -> None:
    for world in (2, 4):
        ref = torch.load(runs[world] / "rank0.pt")["params"]
        for r in range(1, world):
            other = torch.load(runs[world] / f"rank{r}.pt")["params"]
            for k in ref:
                assert torch.equal(ref[k], other[k]), f"world {world}: rank {r} differs from rank 0 in {k}"


def test_accumulation_equals_data_parallel(runs: dict[int, Path]) -> None:
    one = torch.load(runs[1] / "rank0.pt")["params"]
    for world in (2, 4):
        assert_state_close(one, torch.load(runs[world] / "rank0.pt")["params"], rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(losses(runs[world]), losses(runs[1]), rtol=1e-5, atol=1e-6)
    assert len(losses(runs[1])) == 4
    # the weights moved far more than the tolerance in the last two steps, so a wrong normalisation could not pass
    mid = torch.load(runs[1] / "step-2" / "train_state.pt", weights_only=False)
    assert mid["state"]["step"] == 2
    from bertrain.model.bert import BertForPreTraining
    at_2 = BertForPreTraining.from_pretrained(runs[1] / "step-2").state_dict()
    moved = max(float((one[k] - at_2[k]).abs().max()) for k in one if one[k].is_floating_point())
    assert moved > 1e-3, moved


def test_resume_on_another_world_size(runs: dict[int, Path], tmp_path: Path) -> None:
    """1-process checkpoint at step 2, continued on 2 processes (accumulation 4 -> 2): allclose to straight."""
    out = tmp_path / "resumed"
    spawn(_train_worker, 2, base_config(out), str(runs[1] / "step-2"))
    straight = torch.load(runs[1] / "rank0.pt")["params"]
    resumed = torch.load(out / "rank0.pt")
    assert resumed["step"] == 4
    assert_state_close(straight, resumed["params"], rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(losses(out), losses(runs[1])[2:], rtol=1e-5, atol=1e-6)


def _resume_worker(rank: int, world_size: int, cfg_dict: dict, resume: str, allow: bool) -> None:
    from bertrain.config import from_dict
    from bertrain.tasks.pretraining import PretrainConfig, run_pretraining
    cfg = from_dict(PretrainConfig, cfg_dict)
    result = run_pretraining(cfg, resume=resume, allow_config_change=allow)
    torch.save({"params": {k: v.detach().clone() for k, v in result.model.state_dict().items()},
                "step": result.state.step, "batch": result.run.plan.global_batch_size},
               Path(cfg.output_dir) / f"rank{rank}.pt")


def test_a_resume_that_would_change_a_derived_global_batch_is_refused(tmp_path: Path) -> None:
    """`train.global_batch_size: 0` with `train.accumulation: 2`: the batch is micro x accumulation x ranks, 16 on 2
    ranks. Resumed (or elastically restarted) on 1 rank with the same config it would be 8: refused like a changed
    batch key, naming the cause and how to keep the batch; that advice, taken, continues the run allclose to the
    straight one. Before: one warning, and the run went on with half the batch."""
    straight = tmp_path / "w2"
    cfg = base_config(straight, global_batch_size=0, accumulation=2)
    spawn(_train_worker, 2, cfg, None)
    out = tmp_path / "resumed"  # the run as a kill during step 3 leaves it
    shutil.copytree(straight, out, ignore=shutil.ignore_patterns("step-4", "rank*.pt"))
    before = {p: p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}
    with pytest.raises(Exception) as refused:
        spawn(_resume_worker, 1, base_config(out, global_batch_size=0, accumulation=2), "auto", False)
    assert "the global batch would change from 16 to 8 (train.global_batch_size is 0, so it is " \
           "train.micro_batch_size 4 x train.accumulation 2 x the ranks: 2 then, 1 now): continue on 2 ranks, keep " \
           "it on 1 ranks with --train.accumulation 4 --allow-config-change (or --train.global_batch_size 16 " \
           "--train.accumulation 0 --allow-config-change, which keeps it on any number of ranks)" in str(refused.value)
    assert {p: p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()} == before  # nothing written
    spawn(_resume_worker, 1, base_config(out, global_batch_size=0, accumulation=4), "auto", True)
    resumed = torch.load(out / "rank0.pt")
    assert resumed["step"] == 4 and resumed["batch"] == 16
    assert_state_close(torch.load(straight / "rank0.pt")["params"], resumed["params"], rtol=1e-4, atol=1e-6)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["changes"] for r in records if r.get("event") == "config_change"] == \
        [{"train.accumulation": {"old": 2, "new": 4}}]
    torch.testing.assert_close([r["loss"] for r in records if "loss" in r], losses(straight), rtol=1e-5, atol=1e-6)


def test_two_ranks_equal_one_rank_with_two_micro_steps_bitwise(tmp_path: Path) -> None:
    """2 ranks x 1 micro-step and 1 rank x 2 micro-steps (global batch 8, dropout on): the same samples and dropout
    masks in the same places, and two partial gradients add the same way (a + b), so the weights are equal bit for
    bit; what lets an elastic job continue exactly on fewer nodes (tests/test_launchers.py does it with torchrun).
    The logged losses too (the micro-steps' add in float64, as the ranks' all-reduce does)."""
    params = {}
    for world in (1, 2):
        cfg = base_config(tmp_path / f"w{world}", global_batch_size=8, micro_batch_size=4)
        spawn(_train_worker, world, cfg, None)
        params[world] = torch.load(tmp_path / f"w{world}" / "rank0.pt")["params"]
    for k in params[1]:
        assert torch.equal(params[1][k], params[2][k]), k
    assert losses(tmp_path / "w1") == losses(tmp_path / "w2")


def test_uneven_data_finishes_without_hang(tmp_path: Path) -> None:
    """The last rank has one micro-batch fewer per epoch; two epochs must end on both ranks together."""
    cfg = base_config(tmp_path / "uneven", steps=0, epochs=2.0, global_batch_size=0, accumulation=2)
    cfg["data"].update(synthetic_samples=64, uneven_last_rank=1)
    cfg["distributed"]["timeout_s"] = 60  # a hang would surface as a gloo timeout, not a stuck test
    spawn(_train_worker, 2, cfg, None)
    r0, r1 = (torch.load(tmp_path / "uneven" / f"rank{r}.pt") for r in (0, 1))
    # rank 1 has 7 micro-batches per epoch: 3 full steps of 2; rank 0's 8th batch is dropped with it
    assert r0["step"] == r1["step"] == 6
    assert r0["epoch"] == r1["epoch"] == 1


def test_fp16_gradient_compression_keeps_ranks_identical(tmp_path: Path, runs: dict[int, Path]) -> None:
    """The 16-bit allreduce hook halves the bytes on the wire: ranks stay bitwise identical and the result stays
    close to the fp32 allreduce (but not equal: it really is compressed). bf16 needs NCCL, so gloo tests fp16."""
    cfg = base_config(tmp_path / "c16")
    cfg["distributed"]["grad_compression"] = "fp16"
    spawn(_train_worker, 2, cfg, None)
    a = torch.load(tmp_path / "c16" / "rank0.pt")["params"]
    b = torch.load(tmp_path / "c16" / "rank1.pt")["params"]
    for k in a:
        assert torch.equal(a[k], b[k]), k
    fp32 = torch.load(runs[2] / "rank0.pt")["params"]
    assert_state_close(a, fp32, rtol=5e-2, atol=5e-3)
    assert any(not torch.equal(a[k], fp32[k]) for k in a)


def _on_rank0_worker(rank: int, world_size: int, out: str) -> None:
    """Every outcome of `on_rank0` on 2 ranks: a value, then rank 0 failing in each of the three exit-code classes
    (short and long waits); each rank records what it saw, so a hang or a wrong error shows in the file."""
    from bertrain.train.distributed import distributed_context, on_rank0
    from bertrain.utils.errors import RunStopped, UserError

    def fail(exc: BaseException):
        def fn():
            raise exc
        return fn

    seen = []
    with distributed_context() as dist:
        seen.append(("value", on_rank0("compute", lambda: {"rank": dist.rank, "n": 7})))
        cases = [("user", UserError("bad key 'x'\nsecond line"), False), ("stopped", RunStopped("signal"), True),
                 ("failed", KeyError("boom"), True), ("os", FileNotFoundError(2, "No such file", "/nope"), False)]
        for name, exc, long in cases:
            try:
                on_rank0(f"do {name}", fail(exc), long=long)
                seen.append((name, "no error"))
            except BaseException as e:  # noqa: BLE001 - the type is what is checked
                seen.append((name, type(e).__name__, str(e)))
        seen.append(("after", on_rank0("finish", lambda: "done")))  # the group still works after every failure
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(seen))


def test_on_rank0_value_and_every_failure_reach_every_rank(tmp_path: Path) -> None:
    spawn(_on_rank0_worker, 2, str(tmp_path))
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    # the value computed on rank 0 reaches rank 1
    assert r0[0] == r1[0] == ["value", {"rank": 0, "n": 7}]
    # rank 0 raises its own exception; the others one of the same exit-code class naming what rank 0 could not do
    assert r0[1] == ["user", "UserError", "bad key 'x'\nsecond line"]
    assert r1[1] == ["user", "UserError", "rank 0 could not do user: bad key 'x'"]
    assert r0[2] == ["stopped", "RunStopped", "signal"]
    assert r1[2] == ["stopped", "RunStopped", "rank 0 could not do stopped: signal"]
    assert r0[3] == ["failed", "KeyError", "'boom'"]
    assert r1[3][:2] == ["failed", "RuntimeError"] and "rank 0 could not do failed: 'boom'" in r1[3][2]
    assert r0[4][:2] == ["os", "FileNotFoundError"]
    assert r1[4][:2] == ["os", "UserError"]  # a missing file is the user's to fix: exit 2 on every rank
    assert r0[5] == r1[5] == ["after", "done"]


def test_one_rank_group_of_a_named_backend_runs_ddp_and_fsdp_and_equals_the_plain_run(runs: dict[int, Path],
                                                                                      tmp_path: Path) -> None:
    """`distributed.backend` named under a launcher at world size 1: a one-rank group (the code paths of NCCL on one
    GPU, here gloo), DDP-wrapped, or FSDP2 with DCP checkpoints; so does fsdp under a launcher with the default
    backend (an elastic FSDP job shrunk to one node); the numbers are the plain run's, bit for bit. The plain run is
    the module's 1-process run: the same `base_config`, spawned the same way."""
    plain = runs[1]
    saved = torch.load(plain / "rank0.pt")
    finals = {"plain": saved["params"]}
    assert saved["backend"] is None and not (plain / "step-4" / "dcp").is_dir()  # no backend named: no group
    cfgs = {}
    for name, extra in [("ddp", {"distributed": {"backend": "gloo"}}),
                        ("fsdp", {"distributed": {"backend": "gloo"}, "parallelism": {"strategy": "fsdp"}}),
                        ("fsdp-auto", {"parallelism": {"strategy": "fsdp"}})]:
        cfgs[name] = cfg = base_config(tmp_path / name)
        for key, values in extra.items():
            cfg[key] = {**cfg.get(key, {}), **values}
    with ThreadPoolExecutor(3) as pool:  # side by side (one thread each: the same numbers as alone)
        for run in [pool.submit(spawn, _train_worker, 1, cfg, None) for cfg in cfgs.values()]:
            run.result()
    for name in cfgs:
        saved = torch.load(tmp_path / name / "rank0.pt")
        finals[name] = saved["params"]
        assert saved["backend"] == "gloo"  # a named backend, or fsdp: a one-rank group
        assert (tmp_path / name / "step-4" / "dcp").is_dir() == name.startswith("fsdp")
        assert losses(tmp_path / name) == losses(plain)
    for name in ("ddp", "fsdp", "fsdp-auto"):
        assert all(torch.equal(finals[name][k], finals["plain"][k]) for k in finals["plain"]), name


def _failed_run_worker(rank: int, world_size: int) -> None:
    import gc
    import weakref

    import torch.distributed as torch_dist

    from bertrain.train.config import DistributedConfig
    from bertrain.train.distributed import distributed_context, kept_until_exit

    class Trainer:  # stands for what a failed run's frames hold: the model, DDP's reducer, the process group
        pass

    def train() -> None:
        trainer = Trainer()
        refs.append(weakref.ref(trainer))
        raise RuntimeError("a collective failed")

    refs: list = []
    with pytest.raises(RuntimeError, match="a collective failed"):
        with distributed_context(DistributedConfig(backend="gloo")):  # a one-rank gloo group
            assert torch_dist.is_initialized()
            train()
    assert not torch_dist.is_initialized()  # the group itself is destroyed as before
    gc.collect()
    assert refs[0]() is not None, "a failed distributed run's objects must be kept for os._exit"
    assert len(kept_until_exit()) == 1
    kept_until_exit().clear()
    gc.collect()
    assert refs[0]() is None  # kept by the failure alone
    # without a process group nothing is kept: a failure there frees what it held, as any Python error does
    refs.clear()
    with pytest.raises(RuntimeError, match="a collective failed"):
        with distributed_context(DistributedConfig()):
            assert not torch_dist.is_initialized()
            train()
    gc.collect()
    assert refs[0]() is None and not kept_until_exit()


def test_a_failed_distributed_run_keeps_its_objects_for_the_exit_not_for_destructors() -> None:
    """After a failed collective, freeing the run's objects (DDP's reducer, then the process group, joining its
    worker threads with the GIL held) could hang for good; the failure keeps them until `cli.entry`'s os._exit."""
    spawn(_failed_run_worker, 1)
