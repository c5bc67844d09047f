"""Experiment trackers for real (train/trackers.py): MLflow through a sqlite store and through an `mlflow server`
started here, read back with MlflowClient; W&B in offline mode, its run file read back; a resumed run continues
the same tracker run; a tracker whose server dies never stops training; a missing package or an unknown tracker
is an error before any work. Nothing is mocked."""
from __future__ import annotations

import glob
import json
import os
import signal
import struct
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from distributed import cli_env, free_port

from bertrain.config import from_dict
from bertrain.tasks.pretraining import PretrainConfig, run_pretraining

mlflow = pytest.importorskip("mlflow", reason="mlflow is not installed: pip install 'bertrain[mlflow]'")


def _config(out: Path, steps: int = 4, save_interval: int = 2, **metrics) -> PretrainConfig:
    return from_dict(PretrainConfig, {
        "model": {"preset": "tiny"}, "data": {"synthetic_samples": 64, "vocab_size": 100},
        "sample": {"max_seq_length": 32, "max_predictions_per_seq": 5},
        "train": {"steps": steps, "global_batch_size": 8, "micro_batch_size": 8, "log_interval": 1},
        "checkpoint": {"save_interval": save_interval}, "seed": 3, "output_dir": str(out), "metrics": metrics})


def _client(uri: str):
    from mlflow.tracking import MlflowClient
    return MlflowClient(uri)


def _runs(uri: str, experiment: str = "bertrain") -> list:
    c = _client(uri)
    return c.search_runs([c.get_experiment_by_name(experiment).experiment_id])


def test_unknown_tracker_and_missing_package_are_refused_before_any_work(tmp_path: Path, monkeypatch) -> None:
    with pytest.raises(ValueError, match="metrics.report_to.*'neptune'.*tensorboard, mlflow, wandb"):
        _config(tmp_path / "a", report_to=["neptune"])
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ValueError, match=r"wandb package is not installed: pip install 'bertrain\[wandb\]'"):
        _config(tmp_path / "a", report_to=["wandb"])
    assert not (tmp_path / "a").exists()


def test_a_file_store_mlflow_refuses_is_refused_before_any_work(tmp_path: Path, monkeypatch) -> None:
    """MLflow >= 3.13 refuses a file store unless MLFLOW_ALLOW_FILE_STORE is true, and said so only when its run
    opened on the tracker thread: the run went on untracked, with a warning cut before its advice."""
    from importlib.metadata import version

    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setattr("importlib.metadata.version", lambda name: "3.13.0" if name == "mlflow" else version(name))
    for uri in (f"file://{tmp_path}/mlruns", str(tmp_path / "mlruns")):
        with pytest.raises(ValueError, match="config key 'metrics.mlflow_uri' is '.*', a file store, which MLflow "
                                             "3.13.0 refuses .* sqlite:///mlflow.db .* MLFLOW_ALLOW_FILE_STORE=true"):
            _config(tmp_path / "a", report_to=["mlflow"], mlflow_uri=uri)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "./mlruns")
    with pytest.raises(ValueError, match="the environment variable MLFLOW_TRACKING_URI is './mlruns', a file store"):
        _config(tmp_path / "a", report_to=["mlflow"])
    _config(tmp_path / "a", report_to=["auto"])  # MLflow's store matters only when MLflow is asked for
    _config(tmp_path / "a", report_to=["mlflow"], mlflow_uri=f"sqlite:///{tmp_path}/m.db")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # the user's way to keep a file store
    _config(tmp_path / "a", report_to=["mlflow"], mlflow_uri=str(tmp_path / "mlruns"))
    monkeypatch.setattr("importlib.metadata.version", lambda name: "3.12.2" if name == "mlflow" else version(name))
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE")
    _config(tmp_path / "a", report_to=["mlflow"], mlflow_uri=str(tmp_path / "mlruns"))  # older MLflow takes it
    assert not (tmp_path / "a").exists()


def test_mlflow_store_gets_config_records_results_and_artifacts_and_a_resume_continues_the_run(tmp_path: Path,
                                                                                              monkeypatch):
    monkeypatch.chdir(tmp_path)  # a sqlite store keeps artifacts in ./mlruns (MLflow's default)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    out = tmp_path / "run"
    run_pretraining(_config(out, 4, report_to=["mlflow"], mlflow_uri=uri, group="recipe-x"))
    runs = _runs(uri)
    child = next(r for r in runs if r.info.run_name == "run")
    parent = next(r for r in runs if r.info.run_name == "recipe-x")
    assert child.data.tags["mlflow.parentRunId"] == parent.info.run_id  # grouped under the recipe's run
    assert child.data.params["optim.lr"] == "0.0001" and child.data.params["train.steps"] == "4"
    assert child.data.tags["bertrain.task"] == "pretrain" and child.info.status == "FINISHED"
    c = _client(uri)
    history = [(m.step, m.value) for m in c.get_metric_history(child.info.run_id, "train/loss")]
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert history == [(r["step"], r["loss"]) for r in records]  # every record, the same numbers
    assert child.data.metrics["results/steps"] == 4
    assert {a.path for a in c.list_artifacts(child.info.run_id)} >= {"final", "metrics.png", "results.json"}
    assert json.loads((out / "trackers.json").read_text()) == {"mlflow": child.info.run_id}

    # resumed for 2 more steps: the same MLflow run continues (its id is in the checkpoint)
    run_pretraining(_config(out, 6, report_to=["mlflow"], mlflow_uri=uri, group="recipe-x"), resume="auto",
                    allow_config_change=True)
    assert len(_runs(uri)) == 2
    steps = [m.step for m in c.get_metric_history(child.info.run_id, "train/loss")]
    assert sorted(set(steps)) == [1, 2, 3, 4, 5, 6]


def _wandb_records(folder: Path):
    """The protobuf records of a W&B run file: a LevelDB-style log (a 7-byte header ':W&B', then 32 KiB blocks of
    records, each with a 7-byte header: crc32, length, type FULL=1 FIRST=2 MIDDLE=3 LAST=4)."""
    from wandb.proto import wandb_internal_pb2 as pb
    data = Path(folder).read_bytes()
    assert data[:4] == b":W&B"
    pos, buf, block = 7, b"", 32768
    while pos + 7 <= len(data):
        left = block - pos % block
        crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7]) if left >= 7 else (0, 0, 0)
        if left < 7 or (length == 0 and kind == 0):
            pos += left
            continue
        if pos + 7 + length > len(data):  # a record still being written
            return
        buf += data[pos + 7: pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(buf)
            buf = b""
            yield record


def test_wandb_offline_run_files_hold_config_history_results_and_artifacts(tmp_path: Path, monkeypatch) -> None:
    pytest.importorskip("wandb", reason="wandb is not installed: pip install 'bertrain[wandb]'")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    run_pretraining(_config(out, 4, report_to=["wandb"], experiment="proj", group="recipe-x"))
    run_id = json.loads((out / "trackers.json").read_text())["wandb"]
    (path,) = glob.glob(str(out / "wandb" / "offline-run-*" / f"run-{run_id}.wandb"))
    deadline = time.time() + 60
    while not any(r.WhichOneof("record_type") == "exit" for r in _wandb_records(path)):
        # wandb-core writes the file in its own process: it is complete once its last record, exit, is in it
        assert time.time() < deadline, f"{path} has no exit record"
        time.sleep(0.1)
    history, summary, artifacts, run = [], {}, [], None
    for rec in _wandb_records(path):
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            run = rec.run
        elif kind == "history":
            history.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item})
        elif kind == "summary":
            summary.update({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.summary.update})
        elif kind == "artifact":
            artifacts.append(rec.artifact.name)
    assert run is not None, path
    assert (run.run_id, run.project, run.run_group) == (run_id, "proj", "recipe-x")
    config = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in run.config.update}
    assert config["optim.lr"] == 0.0001 and config["task"] == "pretrain"
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [(h["_step"], h["train/loss"]) for h in history] == [(r["step"], r["loss"]) for r in records]
    assert summary["results/steps"] == 4 and f"{run_id}-final" in artifacts


@pytest.fixture
def mlflow_server(tmp_path: Path):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--backend-store-uri",
                             f"sqlite:///{tmp_path / 'server.db'}", "--default-artifact-root",
                             str(tmp_path / "artifacts"), "--host", "127.0.0.1", "--port", str(port), "--workers",
                             "1"], env=cli_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while True:  # ready when /health answers
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    break
        except OSError:
            pass
        assert proc.poll() is None and time.time() < deadline, "mlflow server did not start"
        time.sleep(0.2)
    yield url, proc
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)


@pytest.mark.slow
def test_mlflow_server_run_and_a_server_that_dies_never_stops_training(tmp_path: Path, mlflow_server, caplog):
    url, proc = mlflow_server
    out = tmp_path / "run"
    run_pretraining(_config(out, 4, report_to=["mlflow"], mlflow_uri=url))
    (child,) = _runs(url)
    assert [m.step for m in _client(url).get_metric_history(child.info.run_id, "train/loss")] == [1, 2, 3, 4]

    os.killpg(proc.pid, signal.SIGKILL)  # the server is gone: the next run trains to the end all the same
    proc.wait(30)
    with caplog.at_level("WARNING"):
        result = run_pretraining(_config(tmp_path / "run2", 4, report_to=["mlflow"], mlflow_uri=url))
    assert result.state.step == 4 and (tmp_path / "run2" / "final" / "model.safetensors").is_file()
    assert "tracker mlflow" in caplog.text


def test_a_resume_gives_the_mlflow_run_each_step_of_metrics_jsonl_once(tmp_path: Path, monkeypatch) -> None:
    """A killed run's tracker lacks what was still queued (steps up to the checkpoint: sent now, from metrics.jsonl)
    and has what was sent after the checkpoint (not sent twice); a tracker added on resume gets the earlier steps."""
    import shutil
    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"

    def history(out: Path) -> list[tuple[int, float]]:
        run_id = json.loads((out / "trackers.json").read_text())["mlflow"]
        return sorted((m.step, m.value) for m in _client(uri).get_metric_history(run_id, "train/loss"))

    def jsonl(out: Path) -> list[tuple[int, float]]:
        records = map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
        return [(r["step"], r["loss"]) for r in records if "loss" in r]  # not the config_change record

    # killed after step 6 was sent, before its checkpoint: the resume from step-4 does steps 5 and 6 again
    out = tmp_path / "killed"
    run_pretraining(_config(out, 6, report_to=["mlflow"], mlflow_uri=uri))
    shutil.rmtree(out / "step-6")
    shutil.rmtree(out / "final")
    run_pretraining(_config(out, 6, report_to=["mlflow"], mlflow_uri=uri), resume="auto")
    assert history(out) == jsonl(out) and [s for s, _ in jsonl(out)] == [1, 2, 3, 4, 5, 6]  # before: 5, 6 twice

    # the tracker's records up to the checkpoint never arrived (queued when killed; here: added on resume)
    out = tmp_path / "added"
    run_pretraining(_config(out, 4, report_to=[]))
    run_pretraining(_config(out, 6, report_to=["mlflow"], mlflow_uri=uri), resume="auto", allow_config_change=True)
    assert history(out) == jsonl(out) and len(jsonl(out)) == 6  # before: steps 5 and 6 only


# ----------------------------------------------------------------------------------------------- how runs end

def _at_step(monkeypatch, step: int, action) -> None:
    """`action()` when the loop takes the batches of `step` (the trainer's `take`), as a signal or an error would."""
    from bertrain.train import trainer
    take, calls = trainer.take, [0]

    def take_then(it, n):
        calls[0] += 1
        if calls[0] == step:
            action()
        return take(it, n)
    monkeypatch.setattr(trainer, "take", take_then)


def _wandb_exit_code(out: Path, run_id: str) -> int:
    (path,) = glob.glob(str(out / "wandb" / "offline-run-*" / f"run-{run_id}.wandb"))
    deadline = time.time() + 60
    while True:  # wandb-core writes the file in its own process: complete once its exit record is in it
        exits = [r.exit for r in _wandb_records(path) if r.WhichOneof("record_type") == "exit"]
        if exits:
            return exits[-1].exit_code
        assert time.time() < deadline, f"{path} has no exit record"
        time.sleep(0.1)


def test_a_failed_run_ends_failed_and_a_stopped_one_killed_in_mlflow_and_wandb(tmp_path: Path, monkeypatch) -> None:
    """Before: every run ended FINISHED (W&B: exit code 0), also one that diverged (exit 2) or was stopped by a
    signal (exit 3), so a dashboard could not tell them from a finished run."""
    pytest.importorskip("wandb", reason="wandb is not installed: pip install 'bertrain[wandb]'")
    from bertrain.train.precision import Diverged
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    trackers = {"report_to": ["mlflow", "wandb"], "mlflow_uri": uri}

    def ended(out: Path) -> tuple[str, int]:
        ids = json.loads((out / "trackers.json").read_text())
        return _client(uri).get_run(ids["mlflow"]).info.status, _wandb_exit_code(out, ids["wandb"])

    def diverge():
        raise Diverged("training diverged (here: on purpose)")

    _at_step(monkeypatch, 3, diverge)
    with pytest.raises(Diverged):
        run_pretraining(_config(tmp_path / "diverged", 4, **trackers))
    assert ended(tmp_path / "diverged") == ("FAILED", 1)

    _at_step(monkeypatch, 2, lambda: os.kill(os.getpid(), signal.SIGTERM))  # saved at step 2, resumable
    stopped = run_pretraining(_config(tmp_path / "stopped", 4, **trackers))
    assert stopped.stopped_by_signal and stopped.state.step == 2
    assert ended(tmp_path / "stopped") == ("KILLED", 3)

    monkeypatch.undo()  # the resume continues the same runs to FINISHED
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.chdir(tmp_path)
    ids = json.loads((tmp_path / "stopped" / "trackers.json").read_text())
    run_pretraining(_config(tmp_path / "stopped", 4, **trackers), resume="auto")
    assert json.loads((tmp_path / "stopped" / "trackers.json").read_text()) == ids
    assert _client(uri).get_run(ids["mlflow"]).info.status == "FINISHED"


def test_an_error_after_the_last_step_ends_the_tracker_run_failed(tmp_path: Path, monkeypatch) -> None:
    """An error between `fit` and `RunResult.finish` (exporting final/, the final evaluation) left the MLflow run
    RUNNING for ever: nothing closed it."""
    from bertrain.train import checkpoint as ckpt
    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"

    def export_fails(*a, **k):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(ckpt, "export_final", export_fails)
    out = tmp_path / "run"
    with pytest.raises(ValueError, match="exporting the final model"):
        run_pretraining(_config(out, 2, report_to=["mlflow"], mlflow_uri=uri))
    run_id = json.loads((out / "trackers.json").read_text())["mlflow"]
    assert _client(uri).get_run(run_id).info.status == "FAILED"


def test_a_run_killed_before_its_first_checkpoint_ends_its_mlflow_run_when_continued(tmp_path: Path,
                                                                                     monkeypatch) -> None:
    """Before: `--resume auto` after a kill before the first checkpoint opened a second MLflow run and left the
    first RUNNING for ever, with the killed attempt's points."""
    from bertrain.train.trackers import MlflowTracker
    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    out = tmp_path / "run"

    def killed():  # as kill -9: the process ends with its MLflow run open (finish never runs), no checkpoint
        raise SystemExit(137)

    with monkeypatch.context() as m:
        m.setattr(MlflowTracker, "finish", lambda self, status="FINISHED": None)
        _at_step(m, 3, killed)
        with pytest.raises(SystemExit):
            run_pretraining(_config(out, 4, save_interval=10, report_to=["mlflow"], mlflow_uri=uri))
    assert not list(out.glob("step-*"))
    (first,) = json.loads((out / "trackers.json").read_text()).values()
    assert _client(uri).get_run(first).info.status == "RUNNING"

    run_pretraining(_config(out, 4, save_interval=10, report_to=["mlflow"], mlflow_uri=uri), resume="auto")
    (second,) = json.loads((out / "trackers.json").read_text()).values()
    old, new = _client(uri).get_run(first), _client(uri).get_run(second)
    assert second != first and new.info.status == "FINISHED"
    assert old.info.status == "KILLED" and old.data.tags["bertrain.superseded_by"] == second
    assert old.data.tags["bertrain.run_id"] == new.data.tags["bertrain.run_id"] == \
        json.loads((out / "run.json").read_text())["run_id"]

    # a finished run whose checkpoints are gone starts again from scratch: its run is not touched
    for step in out.glob("step-*"):
        import shutil
        shutil.rmtree(step)
    run_pretraining(_config(out, 4, save_interval=10, report_to=["mlflow"], mlflow_uri=uri), resume="auto")
    assert _client(uri).get_run(second).info.status == "FINISHED"
    assert "bertrain.superseded_by" not in _client(uri).get_run(second).data.tags


def test_tensorboard_listed_without_its_package_is_refused_and_the_default_says_so(tmp_path: Path, monkeypatch,
                                                                                   caplog) -> None:
    """Before: `report_to: [tensorboard]` (command line or config file) without the package trained untracked with
    an INFO line; only the default (auto) may be skipped, with that info line."""
    import importlib.util

    from bertrain.config import load_config
    from bertrain.train.trackers import expand_report_to
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "tensorboard" else real(name, *a))
    with pytest.raises(ValueError, match=r"lists tensorboard but the tensorboard package is not installed: "
                                         r"pip install 'bertrain\[tensorboard\]'"):
        _config(tmp_path / "a", report_to=["tensorboard", "mlflow"], mlflow_uri=f"sqlite:///{tmp_path}/m.db")
    (tmp_path / "c.yaml").write_text("metrics:\n  report_to: [tensorboard]\n")
    with pytest.raises(ValueError, match="lists tensorboard"):
        load_config(PretrainConfig, str(tmp_path / "c.yaml"), {"output_dir": str(tmp_path / "a")})
    assert not (tmp_path / "a").exists()

    cfg = _config(tmp_path / "run", 2)  # the default: auto
    assert cfg.metrics.report_to == ["auto"]
    with caplog.at_level("INFO"):
        run_pretraining(cfg)
    (line,) = [r for r in caplog.records if "tensorboard is not installed" in r.getMessage()]
    assert line.levelname == "INFO"  # the default asks for nothing in particular: not a warning
    assert expand_report_to(["auto", "mlflow", "auto"]) == ["mlflow"]

    # a run whose saved config says [tensorboard] (bertrain wrote the default so before `auto`) continues: a
    # resume takes the metrics keys of the command, the checkpoint's config.yaml is compared as data
    before = _config(tmp_path / "before", 2)
    before.metrics.report_to = ["tensorboard"]  # as the old default was saved
    run_pretraining(before)
    assert "- tensorboard" in (tmp_path / "before" / "step-2" / "config.yaml").read_text()
    result = run_pretraining(_config(tmp_path / "before", 4), resume="auto", allow_config_change=True)
    assert result.state.step == 4


def test_a_tracker_that_cannot_reach_its_server_gives_one_warning(tmp_path: Path, caplog) -> None:
    """Before: urllib3's `Retrying (Retry(total=0 ...)) after connection broken by ...` came first, a second warning
    for the same thing."""
    from bertrain.train.trackers import MlflowTracker, TrackerIds, Trackers
    trackers = Trackers([MlflowTracker(f"http://127.0.0.1:{free_port()}", "e", "run", "")])  # nothing listens
    with caplog.at_level("WARNING"):
        trackers.start(TrackerIds(), {}, {})
        trackers.close()
    assert [r.name for r in caplog.records if r.levelname == "WARNING"] == ["bertrain.train.trackers"], caplog.text


def test_pipelines_of_one_recipe_have_their_own_mlflow_parent_ended_with_the_command(tmp_path: Path,
                                                                                   monkeypatch) -> None:
    """Before: the parent run was found by the recipe's name alone (two pipelines of one recipe in different
    folders shared it) and never terminated (RUNNING for ever)."""
    from bertrain.pipeline import stages as pipeline
    from bertrain.pipeline.recipe import load_recipe
    from bertrain.utils.errors import RunStopped
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    (tmp_path / "mini.yaml").write_text(json.dumps({
        "name": "mini",
        "data": {"input": ["builtin:python-docs"], "vocab_size": 512, "prepare": {"masking": "dynamic"}},
        "pretrain": {"model": {"preset": "tiny"}, "train": {"global_batch_size": 8, "micro_batch_size": 8},
                     "checkpoint": {"save_interval": 100}, "eval": {"enabled": False},
                     "metrics": {"report_to": ["mlflow"], "mlflow_uri": uri, "experiment": "rec"}},
        "phase1": {"sample": {"max_seq_length": 32, "max_predictions_per_seq": 5}, "train": {"steps": 2}},
        "phase2": None, "finetune": []}))

    def pipeline_run(folder: str, report=None) -> None:
        recipe = load_recipe(str(tmp_path / "mini.yaml"), [f"output_dir={tmp_path / folder}"])
        with monkeypatch.context() as m:
            if report is not None:
                m.setattr(pipeline, "write_report", report)
            pipeline.run_stages(recipe, pipeline.build_stages(recipe))

    def parents() -> dict[str, tuple[str, list[str]]]:
        """run folder -> (the parent's status, its children's folders)"""
        runs = _runs(uri, "rec")
        folders = {json.loads((tmp_path / f / "run.json").read_text())["run_id"]: f for f in ("a", "b")
                   if (tmp_path / f / "run.json").is_file()}
        out = {}
        for p in (r for r in runs if r.info.run_name == "mini"):
            folder = folders.get(p.data.tags.get("bertrain.pipeline_run_id"), "?")  # ?: not tagged with one
            children = [Path(r.data.tags["bertrain.output_dir"]).parent.name for r in runs
                        if r.data.tags.get("mlflow.parentRunId") == p.info.run_id]
            out[folder] = (p.info.status, children)
        return out

    def fail(*a, **k):
        raise RuntimeError("the report failed (here: on purpose)")

    def stop(*a, **k):
        raise RunStopped("stopped by a signal (here: on purpose)")

    pipeline_run("a")
    with pytest.raises(RuntimeError):
        pipeline_run("b", report=fail)
    assert parents() == {"a": ("FINISHED", ["a"]), "b": ("FAILED", ["b"])}
    with pytest.raises(RunStopped):
        pipeline_run("b", report=stop)  # only the report stage runs again: the parent is ended all the same
    assert parents()["b"] == ("KILLED", ["b"])
    pipeline_run("b")
    assert parents() == {"a": ("FINISHED", ["a"]), "b": ("FINISHED", ["b"])}
