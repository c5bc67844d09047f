"""Load against a running `bertrain serve`: concurrent clients, every answer checked against offline predictions.

Used by benchmarks/serve_load.py (numbers in BENCHMARKS.md) and by tests/test_deploy_serve*.py (seconds). Clients
only ever talk to the URL they are given (the benchmark starts the server on 127.0.0.1) and stop at a request count
and a time limit, whichever comes first. A 503 (the server's queue is full) is counted as refused, apart from the
lost requests (no answer, or any other status) and the wrong answers.
"""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from bertrain.deploy import require
from bertrain.deploy.config import API_KEY_ENV
from bertrain.model.bert import BertForQuestionAnswering, BertForSequenceClassification
from bertrain.tasks.glue import get_task, read_glue_tsv
from bertrain.tasks.squad import read_squad

SCORE_TOLERANCE = 1e-4
"""Largest difference of a score (probability) between a served answer and the offline one: batches of other
sizes and lengths change float rounding, never more."""


# ----------------------------------------------------------------------------------------------- inputs

def mrpc_items(path: str | os.PathLike, limit: int | None = None) -> list[dict[str, Any]]:
    """Sentence pairs of a GLUE MRPC TSV (e.g. ../shared/data/glue/MRPC/dev.tsv) as classification items."""
    task = get_task("mrpc")
    examples = read_glue_tsv(path, task, task.dev)[:limit]
    return [{"id": str(i), "text": e.text_a, "text_pair": e.text_b} for i, e in enumerate(examples)]


def squad_items(path: str | os.PathLike, limit: int | None = None) -> list[dict[str, Any]]:
    """Questions of a SQuAD-format JSON file (e.g. ../shared/data/squad/xquad-en-part1.json) as QA items."""
    return [{"id": e.qid, "question": e.question, "context": e.context} for e in read_squad(path)[:limit]]


def seeded_head_model(encoder_dir: str | os.PathLike, task: str, out: str | os.PathLike, seed: int = 0) -> Path:
    """A model folder: the encoder of `encoder_dir` (e.g. the real MiniLM) plus a `task` head initialised with
    `seed` and saved, so it loads as a model with trained weights. Its answers are not meaningful; for comparing
    backends and serving they are as good as any (each one is checked against the same model offline)."""
    cls = BertForQuestionAnswering if task == "qa" else BertForSequenceClassification
    torch.manual_seed(seed)
    model = cls.from_pretrained(encoder_dir)
    model.save_pretrained(out)
    return Path(out)


def same_prediction(got: dict[str, Any], want: dict[str, Any]) -> bool:
    """The same answer (QA: text and span) or label, and scores within `SCORE_TOLERANCE`."""
    keys = ("answer", "start", "end") if "answer" in want else ("label",)
    if any(got.get(k) != want.get(k) for k in keys):
        return False
    return abs(float(got["score"]) - float(want["score"])) <= SCORE_TOLERANCE


# ----------------------------------------------------------------------------------------------- the server

@dataclass
class ServerProcess:
    proc: subprocess.Popen
    url: str
    lines: list[str] = field(default_factory=list)
    api_key: str | None = None

    @property
    def headers(self) -> dict[str, str]:
        """What a request needs to be let in: the API key, when the server has one."""
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


@contextmanager
def running_server(model: str | os.PathLike, *options: str, timeout: float = 120.0,
                   api_key: str | None = None) -> Iterator[ServerProcess]:
    """`bertrain serve MODEL --host 127.0.0.1 --port 0 OPTIONS` in a subprocess until the block ends (then SIGTERM,
    and SIGKILL if it has not exited 60 s later), with `api_key` in its environment (BERTRAIN_API_KEY) if given.
    Yields the process and its URL. Its output is read into `lines` as it comes, so that a chatty server never
    blocks on a full pipe."""
    cmd = [sys.executable, "-m", "bertrain", "serve", str(model), "--host", "127.0.0.1", "--port", "0", *options]
    env = {k: v for k, v in os.environ.items() if k != API_KEY_ENV}
    if api_key is not None:
        env[API_KEY_ENV] = api_key
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1, env=env)
    server = ServerProcess(proc, "", api_key=api_key)
    reader: threading.Thread | None = None
    try:
        deadline = time.monotonic() + timeout
        while not server.url:
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError(f"bertrain serve exited ({proc.wait()}) before listening:\n" + "".join(server.lines))
            server.lines.append(line)
            if " on http://" in line:
                server.url = line.split(" on ", 1)[1].split()[0]
            elif time.monotonic() > deadline:
                raise RuntimeError("bertrain serve did not start in time:\n" + "".join(server.lines))
        reader = threading.Thread(target=_read_lines, args=(proc, server.lines), daemon=True)
        reader.start()
        _wait_healthy(server.url, deadline)
        yield server
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if reader is not None:
            reader.join(10)
        else:
            server.lines.extend(proc.stdout.readlines())
        proc.stdout.close()


def _read_lines(proc: subprocess.Popen, lines: list[str]) -> None:
    for line in proc.stdout:
        lines.append(line)


def _wait_healthy(url: str, deadline: float) -> None:
    httpx = require("httpx", "the load test")
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url}/health did not answer in time")
        time.sleep(0.1)


def scrape_metrics(url: str, headers: dict[str, str] | None = None) -> dict[tuple[str, tuple], float]:
    """The server's GET /metrics, read by prometheus-client's own parser: {(sample name, sorted labels): value}."""
    httpx = require("httpx", "the load test")
    parser = require("prometheus_client.parser", "reading GET /metrics")
    r = httpx.get(f"{url}/metrics", headers=headers, timeout=60)
    r.raise_for_status()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in parser.text_string_to_metric_families(r.text) for s in family.samples}


def metric(samples: dict[tuple[str, tuple], float], name: str, **labels: str) -> float:
    """One sample of `scrape_metrics`'s answer (0 when the series does not exist yet)."""
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


# ----------------------------------------------------------------------------------------------- the load

@dataclass
class LoadReport:
    clients: int
    seconds: float
    requests: int = 0
    answered: int = 0
    refused: int = 0                   # 503: the server's queue was full (Retry-After)
    lost: int = 0                      # no answer, or neither 200 nor 503
    wrong: int = 0                     # answered, but not the offline prediction
    latencies_ms: list[float] = field(default_factory=list, repr=False)           # of the answered requests
    refused_latencies_ms: list[float] = field(default_factory=list, repr=False)   # of the 503s
    retry_after_s: list[int] = field(default_factory=list, repr=False)
    max_score_diff: float = 0.0
    errors: list[str] = field(default_factory=list, repr=False)

    @property
    def requests_per_s(self) -> float:
        return self.answered / self.seconds if self.seconds else 0.0

    def percentile_ms(self, q: float, refused: bool = False) -> float:
        values = self.refused_latencies_ms if refused else self.latencies_ms
        return float(np.percentile(values, q)) if values else float("nan")

    def summary(self) -> dict[str, Any]:
        return {"clients": self.clients, "seconds": round(self.seconds, 2), "requests": self.requests,
                "answered": self.answered, "refused": self.refused, "lost": self.lost, "wrong": self.wrong,
                "refused_fraction": round(self.refused / self.requests, 4) if self.requests else 0.0,
                "requests_per_s": round(self.requests_per_s, 2), "p50_ms": round(self.percentile_ms(50), 1),
                "p99_ms": round(self.percentile_ms(99), 1),
                "refused_p50_ms": round(self.percentile_ms(50, refused=True), 1),
                "refused_p99_ms": round(self.percentile_ms(99, refused=True), 1),
                "retry_after_s": sorted(set(self.retry_after_s)), "max_score_diff": self.max_score_diff,
                "errors": self.errors[:5]}


def run_load(url: str, items: list[dict[str, Any]], expected: list[dict[str, Any]], clients: int = 8,
             duration_s: float = 60.0, max_requests: int = 100_000, items_per_request: int = 1,
             timeout_s: float = 120.0, headers: dict[str, str] | None = None,
             pause_after_503_s: float = 0.0) -> LoadReport:
    """`clients` concurrent clients POST /predict in a loop, each request `items_per_request` consecutive items of
    `items` (cycling), until `duration_s` has passed or `max_requests` were sent. Every answer is compared with
    `expected` (the offline predictions of `items`, by position). A client refused with 503 waits
    `pause_after_503_s` (not the server's Retry-After: a load test keeps the pressure on) and sends its next
    request."""
    httpx = require("httpx", "the load test")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a log line per request would load the client's core
    assert len(items) == len(expected) and items
    report = LoadReport(clients, 0.0)
    counter = iter(range(max_requests))

    async def client(http: Any, stop_at: float) -> None:
        for k in counter:
            if time.monotonic() >= stop_at:
                return
            idx = [(k * items_per_request + j) % len(items) for j in range(items_per_request)]
            report.requests += 1
            t0 = time.perf_counter()
            try:
                r = await http.post(f"{url}/predict", json=[items[i] for i in idx], headers=headers)
            except httpx.HTTPError as e:
                report.lost += 1
                report.errors.append(f"{type(e).__name__}: {e}")
                continue
            if r.status_code == 503 and "retry-after" in r.headers:
                report.refused += 1
                report.refused_latencies_ms.append(1000 * (time.perf_counter() - t0))
                report.retry_after_s.append(int(r.headers["retry-after"]))
                await asyncio.sleep(pause_after_503_s)
                continue
            report.latencies_ms.append(1000 * (time.perf_counter() - t0))
            if r.status_code != 200:
                report.lost += 1
                report.errors.append(f"{r.status_code}: {r.text[:200]}")
                continue
            report.answered += 1
            got = r.json()
            ok = len(got) == len(idx)
            for rec, i in zip(got, idx):
                ok = ok and rec.get("id") == items[i]["id"] and same_prediction(rec, expected[i])
                report.max_score_diff = max(report.max_score_diff, abs(rec["score"] - expected[i]["score"]))
            report.wrong += not ok

    async def main() -> None:
        limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
        async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as http:
            t0 = time.monotonic()
            await asyncio.gather(*(client(http, t0 + duration_s) for _ in range(clients)))
            report.seconds = time.monotonic() - t0

    asyncio.run(main())
    return report
