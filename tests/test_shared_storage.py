"""Multi-node jobs whose ranks do not see the same files: a node-local output folder or a copy of the inputs that
one node lacks is refused on every rank, naming what and where, before any work; FSDP's manifest lists every shard.

Other nodes are simulated on this host by a rank that runs in its own mount namespace (`unshare -m`) with an empty
tmpfs mounted over a folder: what a node with its own local disk at that path sees."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from distributed import base_config, cli_env, free_port, rank_env, spawn, wait_all

TIMEOUT = 300


def _can_unshare() -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    r = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs tmpfs /mnt && umount /mnt"],
                       capture_output=True)
    return r.returncode == 0


needs_unshare = pytest.mark.skipif(not _can_unshare(), reason="simulating a node-local disk needs root and "
                                   "`unshare -m` with tmpfs mounts (util-linux)")


def launch(argv: list[str], hidden: Path | None, world: int = 2, copy: Path | None = None,
           **env: str) -> list[subprocess.CompletedProcess]:
    """`python -m bertrain ARGV` on `world` ranks; ranks 1.. run as on another node whose `hidden` folder is an empty
    local disk (None: as on this node), or a local disk holding a copy of the folder `copy`."""
    port = free_port()
    procs = []
    for rank in range(world):
        cmd = [sys.executable, "-m", "bertrain", *argv]
        if rank > 0 and hidden is not None:
            fill = f' && cp -r "{copy}/." "{hidden}/"' if copy is not None else ""
            cmd = ["unshare", "-m", "sh", "-c", f'mount -t tmpfs tmpfs "{hidden}"{fill} && exec "$@"', "sh", *cmd]
        procs.append(subprocess.Popen(cmd, env=cli_env({**rank_env(rank, world, port), **env}),
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    return wait_all(procs, TIMEOUT)


def write_config(path: Path, cfg: dict) -> Path:
    path.write_text(yaml.safe_dump(cfg))
    return path


def last_line(r: subprocess.CompletedProcess) -> str:
    return r.stdout.strip().splitlines()[-1]


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@needs_unshare
def test_an_output_folder_that_another_node_does_not_see_is_refused_on_every_rank(tmp_path: Path) -> None:
    """Before: the straight run "worked" (rank 0 wrote every checkpoint), but `--resume auto` failed on the other
    node (exit 2, "No such file .../train_state.pt") while rank 0 crashed with gloo's traceback (exit 1), and FSDP
    wrote checkpoints marked complete without the other node's shards."""
    shared = tmp_path / "shared"
    shared.mkdir()
    out = shared / "run"
    config = write_config(tmp_path / "run.yaml", base_config(out))
    argv = ["pretrain", "--config", str(config)]
    for r in launch(argv, shared, BERTRAIN_SHARED_OUTPUT_WAIT_S="1"):
        assert r.returncode == 2, r.stdout[-3000:]
        line = last_line(r)
        assert f"output folder {out} is not shared by every rank: rank 1 on " in line, line
        assert "found no run.json there" in line and "a filesystem that every node mounts" in line, line
        assert "Traceback" not in r.stdout
    assert sorted(p.name for p in out.iterdir()) == ["run.json"]  # nothing trained, nothing written
    # the corrected command (every rank sees the folder) starts there as a new run
    for r in launch(argv, None):
        assert r.returncode == 0, r.stdout[-3000:]
    assert (out / "step-4" / "COMPLETE").is_file()
    # a resume from a node that does not see the run is refused too; the run's files are untouched
    shutil.rmtree(out / "step-4")
    before = snapshot(out)
    results = launch([*argv, "--resume", "auto"], shared, BERTRAIN_SHARED_OUTPUT_WAIT_S="1")
    assert [r.returncode for r in results] == [2, 2], results[0].stdout[-3000:]
    assert all("is not shared by every rank" in last_line(r) for r in results)
    assert snapshot(out) == before


@needs_unshare
@pytest.mark.parametrize("stale", [False, True], ids=["missing", "stale"])
@pytest.mark.parametrize("command", ["pretrain", "glue"])
def test_an_input_that_one_node_lacks_is_named_on_every_rank(command: str, stale: bool, tmp_path: Path,
                                                              minilm_path: Path) -> None:
    """Before: the rank without the input exited 2 alone and rank 0 crashed in its next collective with gloo's
    "Connection closed by peer" traceback, exit 1 ("please report it"); a node with another copy at the same path
    (a stale one on its local disk) trained on it without a word."""
    local = tmp_path / "local"
    local.mkdir()
    if command == "pretrain":
        from bertrain.model.bert import BertConfig, BertForPreTraining

        init = local / "init"
        BertForPreTraining(BertConfig.from_preset("tiny", vocab_size=100)).save_pretrained(init)
        cfg = base_config(tmp_path / "out")
        cfg["model"] = {"init": str(init)}
        argv, key, path = ["pretrain", "--config", str(write_config(tmp_path / "c.yaml", cfg))], "model.init", init
    else:
        data = local / "MRPC"
        data.mkdir()
        rows = ["Quality\t#1 ID\t#2 ID\t#1 String\t#2 String",
                *[f"{i % 2}\t{i}\t{i + 100}\tthe cat sat on mat {i}\ta cat was on the mat {i}" for i in range(16)]]
        for split in ("train", "dev"):
            (data / f"{split}.tsv").write_text("\n".join(rows) + "\n")
        argv = ["finetune", "glue", "--task", "mrpc", "--data-dir", str(data), "--init", str(minilm_path),
                "--output", str(tmp_path / "out"), "--train.epochs", "1", "--data.max_seq_length", "32"]
        key, path = "data.data_dir", data
    copy = None
    if stale:  # the other node's copy: the same folder with one file changed
        copy = tmp_path / "other-node"
        shutil.copytree(local, copy)
        changed = copy / path.name / ("config.json" if command == "pretrain" else "dev.tsv")
        changed.write_text(changed.read_text().replace("\n", "\n ", 1))
    results = launch(argv, local, copy=copy)
    for r in results:
        assert r.returncode == 2, r.stdout[-3000:]
        line = last_line(r)
        assert "Traceback" not in r.stdout, r.stdout[-3000:]
        if stale:
            assert (f"config key '{key}': {path} is not the same on every node: rank 0 on " in line
                    and f"have different copies ({changed.name} differs): give every node the same copy" in line), line
        else:
            assert (f"config key '{key}': {path} exists for rank 0 on " in line and " but not for rank 1 on " in line
                    and "every node must see it at the same path" in line), line


def _hidden_listing_worker(rank: int, world_size: int, cfg_dict: dict) -> None:
    """FSDP pretraining where rank 0's directory listings miss the other rank's shard files, as a shared
    filesystem's client may list another node's new file late."""
    from bertrain.config import from_dict
    from bertrain.tasks.pretraining import PretrainConfig, run_pretraining

    if rank == 0:
        rglob = Path.rglob
        Path.rglob = lambda self, pattern: (p for p in rglob(self, pattern) if not p.name.startswith("__1_"))
    run_pretraining(from_dict(PretrainConfig, cfg_dict))


def test_a_sharded_checkpoints_manifest_names_every_shard_even_if_a_listing_misses_one(tmp_path: Path) -> None:
    """Before: each rank hashed a share of its own listing, so rank 1's shard (and the files rank 0's share skipped)
    were missing from manifest.json: a checkpoint marked complete whose checksums did not cover its shards."""
    from bertrain.train.checkpoint import verify_checkpoint

    out = tmp_path / "run"
    cfg = base_config(out)
    cfg["parallelism"] = {"strategy": "fsdp"}
    spawn(_hidden_listing_worker, 2, cfg)
    for step in ("step-2", "step-4"):
        folder = out / step
        on_disk = {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()} - {"manifest.json",
                                                                                              "COMPLETE"}
        listed = set(json.loads((folder / "manifest.json").read_text())["files"])
        assert "dcp/__1_0.distcp" in on_disk and listed == on_disk, sorted(on_disk ^ listed)
        assert verify_checkpoint(folder) is None


@needs_unshare
def test_a_pipeline_folder_that_another_node_does_not_see_is_refused_before_the_first_stage(tmp_path: Path) -> None:
    """`bertrain run` under a launcher: before, rank 0 ran the vocab and prepare stages alone and the job failed at
    the first training stage (with the message above, since that stage's folder is checked too)."""
    from distributed import REPO

    shared = tmp_path / "shared"
    shared.mkdir()
    out = shared / "pipeline"
    argv = ["run", str(REPO / "configs" / "recipes" / "pydoc-small.yaml"), "--set", f"output_dir={out}",
            "--set", "pretrain.train.micro_batch_size=8", "--set", "phase2.train.micro_batch_size=4",
            "--set", "finetune[0].config.train.micro_batch_size=16"]
    for r in launch(argv, shared, BERTRAIN_SHARED_OUTPUT_WAIT_S="1"):
        assert r.returncode == 2, r.stdout[-3000:]
        assert f"output folder {out} is not shared by every rank: rank 1 on " in last_line(r), r.stdout[-3000:]
    assert sorted(p.name for p in out.iterdir()) == ["run.json"]  # no stage ran


def _slow_storage_worker(rank: int, world_size: int, cfg_dict: dict, delay_s: float) -> None:
    """Rank 0's checkpoint writes take `delay_s` longer, as on a slow or busy shared filesystem."""
    import time

    from bertrain.config import from_dict
    from bertrain.tasks.pretraining import PretrainConfig, run_pretraining
    from bertrain.train import checkpoint

    if rank == 0:
        save = checkpoint.save_checkpoint

        def slow_save(*args, **kwargs):
            time.sleep(delay_s)
            return save(*args, **kwargs)

        checkpoint.save_checkpoint = slow_save
    run_pretraining(from_dict(PretrainConfig, cfg_dict))


def test_a_checkpoint_write_slower_than_the_collective_timeout_does_not_fail_the_job(tmp_path: Path) -> None:
    """Before: the other ranks waited for rank 0's write in a collective, which failed after distributed.timeout_s:
    a BERT-large checkpoint (4 GB, checksummed) on a slow filesystem ended the job. They now wait in the rendezvous
    store, while the heartbeat watches rank 0 (a frozen one still fails the job: test_train_watchdog)."""
    out = tmp_path / "run"
    cfg = base_config(out)
    cfg["distributed"] = {"timeout_s": 3, "heartbeat_interval_s": 1, "heartbeat_timeout_s": 2}
    cfg["checkpoint"]["save_interval"] = 4  # one checkpoint, at the last step
    spawn(_slow_storage_worker, 2, cfg, 4.0)
    assert (out / "step-4" / "COMPLETE").is_file()


def test_the_manifest_takes_the_shard_names_from_the_metadata_file_where_save_returns_none(tmp_path: Path) -> None:
    """torch 2.11's `dcp.save` returns its Metadata without `storage_data`: the shard names then come from the
    `.metadata` file rank 0 wrote, never from a directory listing alone (the test above failed on torch 2.11)."""
    import types

    import torch
    import torch.distributed.checkpoint as torch_dcp

    from bertrain.train.dcp import shard_files

    with pytest.warns(UserWarning, match="single process"):
        returned = torch_dcp.save({"w": torch.arange(6.0)}, checkpoint_id=tmp_path, no_dist=True)
    assert shard_files(returned, tmp_path) == ["__0_0.distcp"]
    assert shard_files(types.SimpleNamespace(storage_data=None), tmp_path) == ["__0_0.distcp"]  # as torch 2.11
    (tmp_path / ".metadata").unlink()
    with pytest.raises(FileNotFoundError):
        shard_files(types.SimpleNamespace(storage_data=None), tmp_path)
