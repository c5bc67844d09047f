"""Experiment trackers: TensorBoard, MLflow, Weights & Biases, chosen by `metrics.report_to` (metrics.jsonl is
always written, by `train/metrics.MetricsLogger`). Rank 0 only.

A tracker receives the run's identity and resolved config (flattened, as hyperparameters), every training and
evaluation record, the final results and the output folders as artifacts. Its run id is part of the run state
(the registry's `trackers` entry, and OUTPUT/trackers.json for what a command logs after training), so a resumed
run continues the same tracker run. `metrics.group` groups runs: a W&B group, an MLflow parent run (what
`bertrain run` uses for its stages).

A resumed run hands its trackers the metrics.jsonl records up to the checkpoint's step (`backfill`): what a killed
run had queued but never sent, or every earlier record when the tracker run is new (its id was lost, or the tracker
was added on resume), so the tracker has each step of metrics.jsonl once. MLflow (which cannot delete a point)
first reads the run's history: a point it already has, also one the killed run sent after the checkpoint, is not
sent again.

Trackers talk to servers that may be slow or gone, so no call runs on the training thread: `Trackers` queues
each call for one worker thread (a bounded queue: a record that finds it full is dropped, counted, and said once).
A tracker whose call fails is switched off with one warning; training never waits for it, except at the end
(`close`), which waits at most `CLOSE_TIMEOUT_S` for what is queued. The one warning is bertrain's: urllib3's retry
warnings from that thread are not shown.

A run ends in its tracker as it ended: FINISHED, FAILED (an error, a diverged run) or KILLED (stopped by a signal or
the watchdog, resumable); W&B gets exit code 0, 1 or 3 (3 after `mark_preempting`). A run killed before its first
checkpoint and continued with `--resume auto` starts its tracker runs again: the MLflow runs of the killed attempt
(OUTPUT/trackers.json, the same run.json run) are set KILLED and tagged `bertrain.superseded_by` first (a W&B run
that stopped sending heartbeats is marked crashed by W&B itself).

`report_to` defaults to `auto`: TensorBoard when its package is installed, else metrics.jsonl only with a warning.
`tensorboard` written out (command line, config file, recipe) is a request like `mlflow` and `wandb`: without its
package it is an error before any work. A resume compares the checkpoint's saved config.yaml as data (the metrics
keys are taken from the command), so a run saved with `[tensorboard]` continues; passing such a config.yaml back
with `--config` asks for TensorBoard.

`bertrain run` (`pipeline_parent`) puts a pipeline's stages under one MLflow parent per run folder: the parent is
tagged with the group and the pipeline folder's run id (run.json), found by both, and terminated when the command
ends (FINISHED, FAILED or KILLED). A group outside a pipeline (`--metrics.group` of a single command) is found by
its name alone and stays open, as several commands may share it.
"""
from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import logging
import math
import os
import queue
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Protocol

from bertrain.config import flatten, to_dict
from bertrain.utils.errors import EXIT_FAILED, EXIT_STOPPED, RunStopped

log = logging.getLogger(__name__)

EXTRAS = {"tensorboard": ("tensorboard", "tensorboard"), "mlflow": ("mlflow", "mlflow"), "wandb": ("wandb", "wandb")}
"""report_to name -> (the module it needs, the bertrain extra that installs it)."""
AUTO = "auto"
"""The default of `metrics.report_to`: TensorBoard when its package is installed (else a warning), nothing else."""
WORKER = "bertrain-trackers"
"""The name of the threads that talk to the trackers' servers."""
FINISHED, FAILED, KILLED = "FINISHED", "FAILED", "KILLED"
RUN_IDS = "trackers.json"
QUEUE_SIZE = 10_000
CLOSE_TIMEOUT_S = 30.0


def check_report_to(names: list[str], mlflow_uri: str = "") -> None:
    """Refuse unknown trackers, missing packages and an MLflow store MLflow refuses before any work (`ValueError`
    naming the key and what to do). `auto` (the default) is the exception: TensorBoard if installed, else the run
    goes on with a warning (`open_trackers`); `tensorboard` written out needs its package like the others."""
    for name in names:
        if name == AUTO:
            continue
        if name not in EXTRAS:
            raise ValueError(f"config key 'metrics.report_to': unknown tracker {name!r} (choose from "
                             f"{', '.join(EXTRAS)}, or {AUTO}: tensorboard when installed; metrics.jsonl is always "
                             "written)")
        module, extra = EXTRAS[name]
        if importlib.util.find_spec(module) is None:
            instead = (f", or write {AUTO} (TensorBoard when installed) or [] (metrics.jsonl only)"
                       if name == "tensorboard" else "")
            raise ValueError(f"config key 'metrics.report_to' lists {name} but the {module} package is not "
                             f"installed: pip install 'bertrain[{extra}]'{instead}")
    if "mlflow" in names:
        _check_mlflow_store(mlflow_uri)


def _check_mlflow_store(mlflow_uri: str) -> None:
    """MLflow >= 3.13 refuses a file store (file:///..., a plain path) unless MLFLOW_ALLOW_FILE_STORE is true, and
    says so only when the run opens, on the tracker's thread: the run went on untracked with a warning cut before
    its advice. Checked here, from the version and the environment (importing mlflow takes seconds)."""
    from importlib.metadata import PackageNotFoundError, version
    from urllib.parse import urlparse

    uri = mlflow_uri or os.environ.get("MLFLOW_TRACKING_URI", "")
    if not uri or urlparse(uri).scheme not in ("", "file"):
        return  # MLflow's default (a sqlite database), a database or a server
    if os.environ.get("MLFLOW_ALLOW_FILE_STORE", "").strip().lower() in ("true", "1"):
        return
    try:
        installed = version("mlflow")
        major_minor = tuple(int(x) for x in installed.split(".")[:2])
    except (PackageNotFoundError, ValueError):
        return
    if major_minor >= (3, 13):
        where = "config key 'metrics.mlflow_uri'" if mlflow_uri else "the environment variable MLFLOW_TRACKING_URI"
        raise ValueError(f"{where} is {uri!r}, a file store, which MLflow {installed} refuses (its file store is in "
                         "maintenance mode): use a database, e.g. --metrics.mlflow_uri sqlite:///mlflow.db "
                         "(`mlflow migrate-filestore` moves existing runs there), or set MLFLOW_ALLOW_FILE_STORE=true")


class Tracker(Protocol):
    name: str

    def start(self, run_id: str | None, params: dict[str, Any], info: dict[str, Any]) -> str | None:
        """Open (run_id None) or continue a run; returns its id (None: the tracker has no ids)."""

    def log(self, record: dict[str, Any]) -> None: ...
    def results(self, results: dict[str, Any]) -> None: ...
    def artifact(self, path: Path) -> None: ...
    def finish(self, status: str = FINISHED) -> None: ...
    # optional: backfill(records, continued) -- the records of metrics.jsonl up to the resume step (see above)
    # optional: supersede(stale_id, info) -- end the run of an attempt killed before its first checkpoint (above)


def run_status(exc: BaseException | None) -> str:
    """How a run that ended with `exc` (None: it did not raise) ends in its tracker: FINISHED, KILLED (a stop by
    signal or watchdog, resumable; a second Ctrl-C) or FAILED (any other error)."""
    if exc is None:
        return FINISHED
    return KILLED if isinstance(exc, (RunStopped, KeyboardInterrupt)) else FAILED


class _NotOnTrackerThreads(logging.Filter):
    """urllib3's own warnings (`Retrying (...) after connection broken by ...`) on the trackers' threads: bertrain
    says once that the tracker failed, the retry line before it would be a second warning for the same thing."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR or not (record.threadName or "").startswith(WORKER)


_URLLIB3_FILTER = _NotOnTrackerThreads()


def _quiet_urllib3() -> None:
    logger = logging.getLogger("urllib3.connectionpool")
    if _URLLIB3_FILTER not in logger.filters:
        logger.addFilter(_URLLIB3_FILTER)


def _numbers(record: dict[str, Any]) -> tuple[int, dict[str, float]]:
    """(step, {name: value}) of a metrics.jsonl record: a training record's numbers as train/NAME, an evaluation's
    as eval/NAME (the same names TensorBoard shows)."""
    step = int(record.get("step", 0))
    section, values = ("eval", record.get("metrics", {})) if record.get("event") == "eval" else ("train", record)
    out = {f"{section}/{k}": float(v) for k, v in values.items()
           if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}
    return step, out


def _scalars(results: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in flatten(results).items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


class TensorBoardTracker:
    name = "tensorboard"

    def __init__(self, out: Path, resume_step: int | None) -> None:
        self.out, self.resume_step, self.writer = out, resume_step, None
        self.continued = False
        """The folder holds an earlier process's events (TensorBoard has no run ids: its folder is the run)."""

    def start(self, run_id: str | None, params: dict[str, Any], info: dict[str, Any]) -> None:
        from torch.utils.tensorboard import SummaryWriter  # needs the `tensorboard` package
        folder = self.out / "tensorboard"
        self.continued = self.resume_step is not None and any(folder.glob("*tfevents*"))
        # TensorBoard hides the events at steps >= purge_step: those the killed run wrote after the checkpoint.
        # The checkpoint's own step keeps its records (metrics.jsonl keeps them too, and they are not logged again).
        purge = self.resume_step + 1 if self.continued else None
        self.writer = SummaryWriter(str(folder), purge_step=purge)
        if not self.continued:
            self.writer.add_text("config", "\n".join(f"    {k}: {v}" for k, v in params.items()))
        return None

    def backfill(self, records: list[dict[str, Any]], continued: bool) -> None:
        """A folder without earlier events (TensorBoard added on resume, or its folder gone) gets the earlier
        records of metrics.jsonl; one with them keeps theirs."""
        if not self.continued:
            for record in records:
                self.log(record)

    def log(self, record: dict[str, Any]) -> None:
        step, values = _numbers(record)
        for k, v in values.items():
            self.writer.add_scalar(k, v, step)

    def results(self, results: dict[str, Any]) -> None:
        self.writer.add_text("results", "    " + json.dumps(results, indent=1).replace("\n", "\n    "))

    def artifact(self, path: Path) -> None:
        pass  # TensorBoard has no artifacts: the folders are beside its event files

    def finish(self, status: str = FINISHED) -> None:
        self.writer.close()


class MlflowTracker:
    """Through `MlflowClient` (explicit run ids, no global active run): the tracking URI of `metrics.mlflow_uri`,
    else MLFLOW_TRACKING_URI, else MLflow's default."""
    name = "mlflow"

    BATCH = 1000  # MLflow takes at most 1000 metrics per log_batch

    def __init__(self, uri: str, experiment: str, run_name: str, group: str, pipeline: str | None = None) -> None:
        self.uri, self.experiment, self.run_name, self.group = uri or None, experiment, run_name, group
        self.pipeline = pipeline
        """The run id of the `bertrain run` folder this stage belongs to (its parent is that pipeline's), or None."""
        self.client = self.run_id = None
        self.superseded: str | None = None
        """The run of a killed attempt that `supersede` ended (tagged with this run's id once it is open)."""
        self.logged: dict[str, set[int]] = {}
        """A continued run's points (name -> steps), read back at the start: none is sent twice."""

    def _connect(self) -> None:
        if self.client is None:
            self.client = _mlflow_client(self.uri)

    def supersede(self, stale_id: str, info: dict[str, Any]) -> None:
        """Set KILLED the run of an attempt killed before its first checkpoint (`stale_id`, from
        OUTPUT/trackers.json) when it is this folder's run (run.json's id; the output folder for a run tagged
        before the id was) and still RUNNING; `start` then tags it `bertrain.superseded_by` the new run."""
        self._connect()
        stale = self.client.get_run(stale_id)
        tags = stale.data.tags
        same = (tags.get("bertrain.run_id") == str(info["run_id"]) if "bertrain.run_id" in tags and "run_id" in info
                else tags.get("bertrain.output_dir") == str(info.get("output_dir")))
        if same and stale.info.status == "RUNNING":
            self.client.set_terminated(stale_id, status=KILLED)
            self.superseded = stale_id

    def start(self, run_id: str | None, params: dict[str, Any], info: dict[str, Any]) -> str:
        from mlflow.entities import Param
        self._connect()
        if run_id is not None:  # a resumed run: the same MLflow run, its parameters are already there
            self.client.update_run(run_id, status="RUNNING")
            self.run_id = run_id
            for key in self.client.get_run(run_id).data.metrics:
                if key.startswith(("train/", "eval/")):
                    self.logged[key] = {m.step for m in self.client.get_metric_history(run_id, key)}
            return run_id
        exp = self.client.get_experiment_by_name(self.experiment)
        exp_id = exp.experiment_id if exp else self.client.create_experiment(self.experiment)
        tags = {f"bertrain.{k}": str(v) for k, v in info.items()}
        if self.group:
            tags["mlflow.parentRunId"] = self._parent(exp_id)
        self.run_id = self.client.create_run(exp_id, run_name=self.run_name, tags=tags).info.run_id
        items = [Param(k, str(v)[:6000]) for k, v in params.items()]
        for i in range(0, len(items), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=items[i:i + 100])
        if self.superseded is not None:
            self.client.set_tag(self.superseded, "bertrain.superseded_by", self.run_id)
            log.info("tracker mlflow: run %s, of the attempt killed before its first checkpoint, is KILLED; this "
                     "attempt is run %s", self.superseded, self.run_id)
        return self.run_id

    def _parent(self, exp_id: str) -> str:
        """The group's parent run in the experiment (created by the first stage that asks): in a pipeline, the one
        of this pipeline's run folder (RUNNING again if an earlier attempt of the pipeline ended it); else the
        group's parent that belongs to no pipeline."""
        found = _find_parent(self.client, exp_id, self.group, self.pipeline)
        if found is not None:
            if self.pipeline is not None and found.info.status != "RUNNING":
                self.client.update_run(found.info.run_id, status="RUNNING")
            return found.info.run_id
        tags = {"bertrain.group": self.group}
        if self.pipeline is not None:
            tags["bertrain.pipeline_run_id"] = self.pipeline
        return self.client.create_run(exp_id, run_name=self.group, tags=tags).info.run_id

    def log(self, record: dict[str, Any]) -> None:
        self._send([record])

    def backfill(self, records: list[dict[str, Any]], continued: bool) -> None:
        self._send(records)

    def _send(self, records: list[dict[str, Any]]) -> None:
        """The records' points that the run does not have yet, in batches."""
        from mlflow.entities import Metric
        now = int(time.time() * 1000)
        points = []
        for record in records:
            step, values = _numbers(record)
            for k, v in values.items():
                if step not in self.logged.get(k, ()):
                    points.append(Metric(k, v, now, step))
                    if k in self.logged:
                        self.logged[k].add(step)
        for i in range(0, len(points), self.BATCH):
            self.client.log_batch(self.run_id, metrics=points[i:i + self.BATCH])

    def results(self, results: dict[str, Any]) -> None:
        from mlflow.entities import Metric
        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(f"results/{k}", v, now, 0)
                                                    for k, v in _scalars(results).items()])
        self.client.log_dict(self.run_id, results, "results.json")

    def artifact(self, path: Path) -> None:
        if path.is_dir():
            self.client.log_artifacts(self.run_id, str(path), path.name)
        elif path.is_file():
            self.client.log_artifact(self.run_id, str(path))

    def finish(self, status: str = FINISHED) -> None:
        self.client.set_terminated(self.run_id, status=status)


def _mlflow_client(uri: str | None) -> Any:
    # MLflow retries a refused connection 7 times with backoff (minutes): fail fast instead, the tracker is then
    # switched off (metrics.jsonl has every record). The user's environment wins.
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "20")
    from mlflow.tracking import MlflowClient
    return MlflowClient(tracking_uri=uri)


def _find_parent(client: Any, exp_id: str, group: str, pipeline: str | None) -> Any:
    """The parent run of `group` in the experiment: tagged with the pipeline's run id (`pipeline`), or, outside a
    pipeline, without one (None: none yet)."""
    if pipeline is not None:
        query = f"tags.`bertrain.pipeline_run_id` = '{pipeline}'"  # hex digits
    else:
        quote = "'" if "'" not in group else '"'
        query = f"tags.`bertrain.group` = {quote}{group}{quote}"
    runs = client.search_runs([exp_id], filter_string=query, max_results=100)
    return next((r for r in runs if r.data.tags.get("bertrain.group") == group
                 and r.data.tags.get("bertrain.pipeline_run_id") == pipeline), None)


class WandbTracker:
    """`wandb.init` in the run folder (WANDB_MODE=offline works without an account); a resumed run passes its id
    with resume="allow"."""
    name = "wandb"

    def __init__(self, out: Path, project: str, run_name: str, group: str) -> None:
        self.out, self.project, self.run_name, self.group = out, project, run_name, group
        self.run = None

    def start(self, run_id: str | None, params: dict[str, Any], info: dict[str, Any]) -> str:
        import wandb
        self.run = wandb.init(project=self.project, name=self.run_name, group=self.group or None, id=run_id,
                              resume="allow" if run_id else None, dir=str(self.out), config={**params, **info},
                              reinit="create_new")
        return self.run.id

    def log(self, record: dict[str, Any]) -> None:
        step, values = _numbers(record)
        self.run.log(values, step=step)

    def backfill(self, records: list[dict[str, Any]], continued: bool) -> None:
        """A new W&B run gets the earlier records; a continued one has them (W&B drops a step below its current
        one, so what a killed run sent after the checkpoint is not doubled either)."""
        if not continued:
            for record in records:
                step, values = _numbers(record)
                if values:
                    self.run.log(values, step=step)

    def results(self, results: dict[str, Any]) -> None:
        self.run.summary.update({f"results/{k}": v for k, v in _scalars(results).items()})

    def artifact(self, path: Path) -> None:
        import wandb
        art = wandb.Artifact(f"{self.run.id}-{path.name}".replace("/", "-"), type="model" if path.is_dir() else "file")
        (art.add_dir if path.is_dir() else art.add_file)(str(path))
        self.run.log_artifact(art)

    def finish(self, status: str = FINISHED) -> None:
        """W&B has no "killed" for a run that ends itself: a stop (resumable) is marked preempting and ends with
        bertrain's exit code 3, an error with 1; either shows as failed, a finished run with 0."""
        if status == KILLED:
            self.run.mark_preempting()
        self.run.finish(exit_code={FINISHED: 0, KILLED: EXIT_STOPPED}.get(status, EXIT_FAILED))


class Trackers:
    """The trackers of one command on rank 0 (`enabled` False elsewhere: every call is a no-op), fed through one
    worker thread (see the module docstring)."""

    def __init__(self, trackers: list[Tracker], enabled: bool = True) -> None:
        self.trackers = trackers if enabled else []
        self.dropped = 0
        self._failed: set[str] = set()
        self._queue: queue.Queue = queue.Queue(QUEUE_SIZE)
        self._thread: threading.Thread | None = None
        if self.trackers:
            _quiet_urllib3()
            self._thread = threading.Thread(target=self._work, name=WORKER, daemon=True)
            self._thread.start()

    def _work(self) -> None:
        while (call := self._queue.get()) is not None:
            call()

    def _each(self, method: str, *args: Any) -> None:
        """`method` of every tracker still on (on the worker thread)."""
        for t in self.trackers:
            if t.name in self._failed:
                continue
            try:
                getattr(t, method)(*args)
            except Exception as e:  # a tracker must never stop training: off, and said once
                self._failed.add(t.name)
                log.warning("tracker %s failed (%s: %s); it is off for the rest of this run, metrics.jsonl has "
                            "every record", t.name, type(e).__name__, (str(e).splitlines() or [""])[0][:300])

    def _put(self, call: Callable[[], None] | None, wait: bool = False) -> None:
        if self._thread is None:
            return
        try:
            self._queue.put(call, block=wait, timeout=CLOSE_TIMEOUT_S if wait else None)
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1:
                log.warning("the trackers fall behind (%d calls queued): records are dropped for them (not for "
                            "metrics.jsonl)", QUEUE_SIZE)

    def start(self, ids: TrackerIds, params: dict[str, Any], info: dict[str, Any],
              on_started: Callable[[dict[str, str]], None] | None = None,
              earlier: list[dict[str, Any]] | None = None, stale: dict[str, str] | None = None) -> None:
        """Open or continue each tracker's run (`ids.ids`: name -> id of the run being resumed), on the worker:
        training does not wait for a server. `ids` gets the new ids when they are known (the next checkpoint
        holds them), then `on_started(ids)` runs (it writes OUTPUT/trackers.json). `earlier`: a resumed run's
        metrics.jsonl records up to its step, handed to each tracker's `backfill` before any new record. `stale`:
        the runs of an attempt killed before its first checkpoint (name -> id), ended by the tracker's
        `supersede` before its new run opens."""
        def supersede(t: Tracker, stale_id: str) -> None:
            try:
                t.supersede(stale_id, info)  # type: ignore[attr-defined]
            except Exception as e:  # the new run opens all the same
                log.warning("tracker %s: could not end the run %s of the attempt killed before its first "
                            "checkpoint (%s: %s)", t.name, stale_id, type(e).__name__,
                            (str(e).splitlines() or [""])[0][:300])

        def start_all() -> None:
            for t in self.trackers:
                try:
                    previous = ids.ids.get(t.name)
                    stale_id = (stale or {}).get(t.name)
                    if previous is None and stale_id is not None and hasattr(t, "supersede"):
                        supersede(t, stale_id)
                    run_id = t.start(previous, params, info)
                    if run_id is not None:
                        ids.ids[t.name] = run_id
                    if earlier and hasattr(t, "backfill"):
                        t.backfill(earlier, previous is not None)
                except Exception as e:
                    self._failed.add(t.name)
                    log.warning("tracker %s could not start (%s: %s); the run goes on without it", t.name,
                                type(e).__name__, (str(e).splitlines() or [""])[0][:300])
            if on_started is not None and ids.ids:
                on_started(dict(ids.ids))

        self._put(start_all, wait=True)

    def log(self, record: dict[str, Any]) -> None:
        self._put(functools.partial(self._each, "log", record))

    def results(self, results: dict[str, Any]) -> None:
        self._put(functools.partial(self._each, "results", results), wait=True)

    def artifact(self, path: str | Path) -> None:
        self._put(functools.partial(self._each, "artifact", Path(path)), wait=True)

    def close(self, status: str = FINISHED) -> None:
        """Finish every run as `status` (FINISHED, FAILED, KILLED) and stop the worker, waiting at most
        CLOSE_TIMEOUT_S for what is queued."""
        if self._thread is None:
            return
        self._put(functools.partial(self._each, "finish", status), wait=True)
        self._put(None, wait=True)
        self._thread.join(CLOSE_TIMEOUT_S)
        if self._thread.is_alive():
            log.warning("the trackers did not finish within %.0f s (a server gone?); metrics.jsonl is complete",
                        CLOSE_TIMEOUT_S)
        self._thread = None

    def close_after_error(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                          tb: Any) -> None:
        """`close` as an exit callback (`contextlib.ExitStack.push`): KILLED for a stop, FAILED for an error."""
        self.close(run_status(exc))


class TrackerIds:
    """The tracker run ids of this run (name -> id): an entry of the checkpoint registry, so a resumed run
    continues the same tracker runs."""

    def __init__(self) -> None:
        self.ids: dict[str, str] = {}

    def state_dict(self) -> dict[str, str]:
        return dict(self.ids)

    def load_state_dict(self, ids: dict[str, str]) -> None:
        self.ids = dict(ids)


def open_trackers(cfg: Any, out: Path, is_main: bool, task: str, resume_step: int | None,
                  ids: TrackerIds) -> Trackers:
    """The trackers of `cfg.metrics.report_to`, their runs opened (or continued, with `ids` from the checkpoint)
    with the resolved config as parameters; OUTPUT/trackers.json names the runs. Rank 0 only (`is_main`)."""
    if not is_main:
        return Trackers([], enabled=False)
    m = cfg.metrics
    name = m.run_name or out.resolve().name
    made: list[Tracker] = []
    for kind in dict.fromkeys(expand_report_to(m.report_to)):
        if kind == "tensorboard":
            made.append(TensorBoardTracker(out, resume_step))
        elif kind == "mlflow":
            made.append(MlflowTracker(m.mlflow_uri, m.experiment, name, m.group, _PIPELINE_RUN))
        elif kind == "wandb":
            made.append(WandbTracker(out, m.experiment, name, m.group))
    trackers = Trackers(made)
    earlier: list[dict[str, Any]] = []
    if made and resume_step is not None and (out / "metrics.jsonl").is_file():
        # read before MetricsLogger drops the lines after the checkpoint's step (the same records it keeps)
        from bertrain.train.metrics import read_metrics
        try:
            earlier = [r for r in read_metrics(out / "metrics.jsonl")
                       if isinstance(r, dict) and r.get("step", 0) <= resume_step]
        except (OSError, UnicodeDecodeError) as e:
            log.warning("cannot read %s (%s): the trackers get only this run's records", out / "metrics.jsonl", e)
    recorded: dict[str, str] = {}
    if made and (out / RUN_IDS).is_file():
        try:
            recorded = json.loads((out / RUN_IDS).read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            log.warning("cannot read %s (%s): the trackers start new runs", out / RUN_IDS, e)
    stale: dict[str, str] = {}
    if resume_step is not None:
        # the runs were opened on the worker thread: a checkpoint written before that finished lacks their ids,
        # which OUTPUT/trackers.json (written when they opened) has
        ids.ids = {**recorded, **ids.ids}
    else:
        # no checkpoint to resume from, yet the runs of this folder's run (the folder was claimed for this run:
        # another run's folder is refused or moved aside): an attempt killed before its first checkpoint, whose
        # runs are ended before new ones open (each tracker checks the run is this one's and still running)
        stale = recorded
    from bertrain import __version__
    from bertrain.utils.io import atomic_write_json
    from bertrain.utils.rundir import read_run
    info = {"task": task, "output_dir": str(out.resolve()), "version": __version__}
    run_id = (read_run(out) or {}).get("run_id")
    if run_id:
        info["run_id"] = run_id  # the folder's run (run.json): its attempts are told from another run's
    trackers.start(ids, flatten(to_dict(cfg)), info, lambda started: atomic_write_json(out / RUN_IDS, started),
                   earlier, stale)
    return trackers


def expand_report_to(names: list[str]) -> list[str]:
    """The trackers `report_to` asks for, `auto` replaced by tensorboard when it is installed (else an info line,
    not a warning: the default asks for nothing in particular, and metrics.jsonl has every record)."""
    out: list[str] = []
    for name in dict.fromkeys(names):
        if name != AUTO:
            out.append(name)
        elif importlib.util.find_spec("tensorboard") is not None:
            out.append("tensorboard")
        else:
            log.info("tensorboard is not installed (pip install 'bertrain[tensorboard]'; metrics.report_to: [] "
                        "for no tracker): metrics.jsonl only")
    return list(dict.fromkeys(out))


# ----------------------------------------------------------------------------------------------- bertrain run

_PIPELINE_RUN: str | None = None
"""The run id of the `bertrain run` folder whose stages run now (`pipeline_parent`), None outside a pipeline."""


@contextlib.contextmanager
def pipeline_parent(run_id: str, configs: Callable[[], Iterable[Any]], is_main: bool = True) -> Iterator[None]:
    """The stages run inside belong to the pipeline whose folder's run id (run.json) is `run_id`: their MLflow
    parent is this pipeline's, not another's of the same recipe (group). When the block ends, rank 0 terminates
    the parent of each stage's engine config (`configs`: those whose OUTPUT/trackers.json names an MLflow run, in
    this attempt or an earlier one of the pipeline; the lookup of MlflowTracker: experiment, group and run id) as
    FINISHED, FAILED (an error) or KILLED (a stop: `bertrain run` again continues the pipeline, and its next tracked
    stage sets the parent RUNNING again)."""
    global _PIPELINE_RUN
    previous, _PIPELINE_RUN = _PIPELINE_RUN, run_id
    status = FAILED
    try:
        yield
        status = FINISHED
    except BaseException as e:
        status = run_status(e)
        raise
    finally:
        _PIPELINE_RUN = previous
        if is_main:
            groups = set()
            for cfg in configs():
                m = getattr(cfg, "metrics", None)
                if m is not None and m.group and "mlflow" in m.report_to and _tracked(Path(cfg.output_dir)):
                    groups.add((m.mlflow_uri, m.experiment, m.group))
            if groups:
                _in_worker(functools.partial(_end_parents, sorted(groups), run_id, status))


def _tracked(out: Path) -> bool:
    """Whether OUTPUT/trackers.json names an MLflow run (so its parent exists: looking it up costs no store)."""
    try:
        return "mlflow" in json.loads((out / RUN_IDS).read_text(encoding="utf-8"))
    except (OSError, ValueError, TypeError):
        return False


def _end_parents(groups: list[tuple[str, str, str]], run_id: str, status: str) -> None:
    for uri, experiment, group in groups:
        try:
            client = _mlflow_client(uri or None)
            exp = client.get_experiment_by_name(experiment)
            parent = exp and _find_parent(client, exp.experiment_id, group, run_id)
            if parent:
                client.set_terminated(parent.info.run_id, status=status)
        except Exception as e:
            log.warning("tracker mlflow: could not end the parent run of %s (%s: %s)", group, type(e).__name__,
                        (str(e).splitlines() or [""])[0][:300])


def _in_worker(call: Callable[[], None]) -> None:
    """`call` on a tracker thread, waiting at most CLOSE_TIMEOUT_S for it (a server gone must not hold the command)."""
    _quiet_urllib3()
    thread = threading.Thread(target=call, name=WORKER, daemon=True)
    thread.start()
    thread.join(CLOSE_TIMEOUT_S)
    if thread.is_alive():
        log.warning("the trackers did not finish within %.0f s (a server gone?)", CLOSE_TIMEOUT_S)
