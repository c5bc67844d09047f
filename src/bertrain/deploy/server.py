"""`bertrain serve`: a fine-tuned QA or classification model behind an HTTP JSON API (FastAPI on uvicorn).

    POST /predict   one item or a list of items -> one result or a list, in order
                    QA:             {"question": str, "context": str[, "id"]}
                    classification: {"text": str[, "text_pair": str][, "id"]}
                    results are `Predictor`'s (deploy/predict.py): the same as `bertrain predict` prints
    GET  /health    {"status": "ok", task, backend, model, labels, the settings and counters}; always open (load
                    balancers): without the API key, when one is set, only {"status": "ok"}
    GET  /metrics   Prometheus text format (prometheus-client): requests by path and status, latency, batch sizes
                    and times, queue depth, connections, refusals, model/backend info, process memory and CPU

Concurrent requests are micro-batched: `MicroBatcher` queues them, and one worker takes the first waiting request,
lets others join it for up to `max_wait_ms` or until `max_batch_size` items, and runs the whole batch through the
model in one thread (the model is never run twice at once; the event loop keeps accepting meanwhile). A request is
never split across batches; one larger than `max_batch_size` runs alone.

What the server refuses, and how (every refusal a JSON {"error": ...} naming the cause and the flag; RELIABILITY.md
"Serving" has each case with its test):
  400 malformed JSON (also nested too deep, or a number too long to convert); 422 a missing/empty/extra field,
      named (`items[3].context`), or text that is not Unicode
  401 no or a wrong API key (`Authorization: Bearer KEY`, compared in constant time), when a key is set
  408 a request body not received within `body_timeout_s` (a request head within `header_timeout_s`: 408, closed)
  413 a body over `max_request_bytes` (read and dropped up to `ServeConfig.drain_bytes` first, so that clients
      that send the whole body before reading, like urllib, read the 413), or more items than `max_queue`
  503 + Retry-After: more than `max_queue` items would wait for the model; more than `max_connections` open
      (uvicorn's limit_concurrency); shutting down
User input never causes a 5xx; a 500 is a bug (logged with its traceback). A client that goes away mid-upload is
normal traffic: counted (`bertrain_client_disconnects_total`), a debug line, no traceback. A batch that fails is
retried request by request, so one request cannot fail the others batched with it.

Shutdown (SIGTERM, SIGINT): uvicorn stops accepting connections and waits for the requests in flight; then the
batcher drains what is still queued before the process exits 0.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
import signal
import socket
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Annotated, Any, AsyncIterator, Callable

from bertrain.deploy import require
from bertrain.deploy.config import ServeConfig, is_loopback
from bertrain.utils.errors import UserError

log = logging.getLogger(__name__)

fastapi = require("fastapi", "bertrain serve")
pydantic = require("pydantic", "bertrain serve")
prometheus_client = require("prometheus_client", "bertrain serve (GET /metrics)")

from fastapi import FastAPI, Request  # noqa: E402  (after the check that names the extra)
from fastapi.responses import JSONResponse, Response  # noqa: E402
from pydantic import AfterValidator, BaseModel, ConfigDict, TypeAdapter, ValidationError  # noqa: E402
from starlette.requests import ClientDisconnect  # noqa: E402

PATHS = ("/predict", "/health", "/metrics")
"""The paths metrics are labelled with; any other is "other" (a scanner's thousand paths stay one series)."""


# ----------------------------------------------------------------------------------------------- request items

def _unicode(v: str) -> str:
    try:
        v.encode("utf-8")
    except UnicodeEncodeError as e:  # a lone surrogate ("\ud800" in JSON): no UTF-8 answer could carry it back
        raise ValueError(f"holds {v[e.start]!a} at character {e.start}, a lone surrogate, which is not Unicode "
                         "text") from None
    return v


def _not_blank(v: str) -> str:
    if not v.strip():
        raise ValueError("must not be empty or only whitespace")
    return _unicode(v)


Text = Annotated[str, AfterValidator(_not_blank)]
Id = Annotated[str | int | None, AfterValidator(lambda v: _unicode(v) if isinstance(v, str) else v)]


class QAItem(BaseModel):
    model_config = ConfigDict(extra="forbid")
    question: Text
    context: Text
    id: Id = None


class ClassificationItem(BaseModel):
    model_config = ConfigDict(extra="forbid")
    text: Text
    text_pair: Text | None = None
    id: Id = None


class RequestError(Exception):
    """A request the server refuses: the HTTP status, one message naming what is wrong, extra response headers,
    and whether the connection must close after the answer (its body was not read to the end)."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None,
                 close: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.headers = dict(headers or {})
        if close:
            self.headers["Connection"] = "close"


class QueueFull(RequestError):
    """503 with Retry-After: more than --max-queue items would wait for the model."""


CLIENT_GONE = 499
"""The status recorded (never sent) for a request whose client went away before its body arrived (nginx's)."""


def parse_items(body: bytes, task: str, max_items: int | None = None) -> tuple[list[dict[str, Any]], bool]:
    """The request's items (as dicts) and whether it was a list; `RequestError` (400/413/422) naming the field."""
    try:
        data = json.loads(body)
    except RecursionError:  # json's C scanner recurses once per level: thousands of '[' exhaust the stack
        raise RequestError(400, "the body is not usable JSON: it is nested too deeply (an item is one object of "
                                "strings)") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, and an integer of over 4300 digits
        raise RequestError(400, f"the body is not valid JSON: {e}") from None
    item_cls = QAItem if task == "qa" else ClassificationItem
    fields = "question, context" if task == "qa" else "text[, text_pair]"
    if isinstance(data, list):
        if not data:
            raise RequestError(422, "the list of items is empty")
        if max_items is not None and len(data) > max_items:  # before validating them all
            raise RequestError(413, f"the request holds {len(data):,} items; at most {max_items:,} can wait for "
                                    "the model at once (--max-queue): send fewer per request")
        adapter, where = TypeAdapter(list[item_cls]), "items"
    elif isinstance(data, dict):
        adapter, where = TypeAdapter(item_cls), ""
    else:
        raise RequestError(422, f"expected a JSON object ({fields}) or a list of them, got {type(data).__name__}")
    try:
        items = adapter.validate_python(data)
    except ValidationError as e:
        problems = []
        for err in e.errors()[:5]:
            loc = where + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in err["loc"])
            msg = "unknown field" if err["type"] == "extra_forbidden" else err["msg"].removeprefix("Value error, ")
            problems.append(f"{loc.lstrip('.') or 'body'}: {msg}")
        more = f" (and {e.error_count() - 5} more)" if e.error_count() > 5 else ""
        raise RequestError(422, f"{'; '.join(problems)}{more} — a {task} item is {{{fields}}}") from None
    items = items if isinstance(items, list) else [items]
    return [it.model_dump(exclude_none=True) for it in items], isinstance(data, list)


async def read_body(request: Request, cfg: ServeConfig) -> bytes:
    """The request body, received within `cfg.body_timeout_s` (else 408), at most `cfg.max_request_bytes` (more:
    413). A body over the limit is still read, and dropped, up to
    `cfg.drain_bytes`, so that a client that sends it all before reading (urllib, requests) reads the 413 instead
    of a reset connection; a larger one, or one the client waits for a 100 Continue to send, is answered at once
    and its connection closed. A client that goes away raises `RequestError(CLIENT_GONE)`."""
    limit = cfg.max_request_bytes
    declared = request.headers.get("content-length")
    declared = int(declared) if declared is not None and declared.isdigit() else None
    too_large = (f"the request body is {declared:,} bytes; the limit is {limit:,} (--max-request-bytes): send "
                 "fewer or shorter items per request" if declared is not None else
                 f"the request body exceeds the limit of {limit:,} bytes (--max-request-bytes)")
    if declared is not None and declared > limit and (
            declared > cfg.drain_bytes or "100-continue" in request.headers.get("expect", "").lower()):
        raise RequestError(413, too_large, close=True)
    body = bytearray()
    received = 0
    try:
        async with asyncio.timeout(cfg.body_timeout_s):
            async for chunk in request.stream():
                received += len(chunk)
                if received <= limit:
                    body += chunk
                elif received > cfg.drain_bytes:
                    raise RequestError(413, too_large, close=True)
    except TimeoutError:
        raise RequestError(408, f"the request body did not arrive within {cfg.body_timeout_s:g} s "
                                f"(--body-timeout-s): {received:,} bytes came"
                                + (f" of {declared:,}" if declared is not None else ""), close=True) from None
    except ClientDisconnect:
        raise RequestError(CLIENT_GONE, f"the client went away after sending {received:,} bytes of its body"
                           + (f" (of {declared:,})" if declared is not None else "")) from None
    if received > limit:
        raise RequestError(413, too_large)
    return bytes(body)


# ----------------------------------------------------------------------------------------------- micro-batching

@dataclass
class _Pending:
    items: list[dict[str, Any]]
    future: asyncio.Future


@dataclass
class BatchStats:
    in_flight: int = 0               # requests submitted and not yet answered
    requests: int = 0
    items: int = 0
    batches: int = 0
    largest_batch_requests: int = 0
    largest_batch_items: int = 0
    queue_items: int = 0             # items waiting for the model now (not yet in a batch)
    queue_requests: int = 0
    largest_queue_items: int = 0
    refused_queue_full: int = 0      # requests answered 503 because the queue was full


@dataclass
class MicroBatcher:
    """Queue concurrent requests and run them through `predict` together (see the module docstring).

    `predict(items) -> results` runs in one worker thread; items are the requests' items in order, results one per
    item in the same order. With `max_queue`, a request that would make more than `max_queue` items wait is
    refused at once (503 with a Retry-After estimated from the recent throughput); `on_batch(items, requests,
    seconds)` is told of every batch run."""

    predict: Callable[[list[dict[str, Any]]], list[dict[str, Any]]]
    max_batch_size: int = 32
    max_wait_s: float = 0.005
    max_queue: int | None = None
    on_batch: Callable[[int, int, float], None] | None = None
    stats: BatchStats = field(default_factory=BatchStats)

    def __post_init__(self) -> None:
        self._pending: deque[_Pending] = deque()
        self._arrived = asyncio.Event()
        self._closing = False
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="bertrain-model")
        self._worker: asyncio.Task | None = None
        self._items_per_s: float | None = None  # recent throughput of the model (items per second of batch time)

    def start(self) -> None:
        self._worker = asyncio.get_running_loop().create_task(self._run(), name="bertrain-batcher")

    def retry_after_s(self, items: int = 0) -> int:
        """Whole seconds until the queue and `items` more would have been worked off at the recent rate, 1..60."""
        if not self._items_per_s:
            return 1
        return min(60, max(1, math.ceil((self.stats.queue_items + items) / self._items_per_s)))

    async def submit(self, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
        s, n = self.stats, len(items)
        if self._closing:
            raise RequestError(503, "the server is shutting down", headers={"Retry-After": "1"})
        if self.max_queue is not None and s.queue_items + n > self.max_queue and s.queue_items > 0:
            s.refused_queue_full += 1
            wait = self.retry_after_s(n)
            raise QueueFull(503, f"the server is busy: {s.queue_items} items are waiting for the model and "
                                    f"{n} more would pass --max-queue {self.max_queue}: retry in {wait} s",
                               headers={"Retry-After": str(wait)})
        p = _Pending(items, asyncio.get_running_loop().create_future())
        self._pending.append(p)
        s.queue_items += n
        s.queue_requests += 1
        s.largest_queue_items = max(s.largest_queue_items, s.queue_items)
        self._arrived.set()
        s.in_flight += 1
        try:
            return await p.future
        finally:
            s.in_flight -= 1

    async def close(self) -> None:
        """Answer everything queued, then stop the worker and its thread."""
        self._closing = True
        self._arrived.set()
        if self._worker is not None:
            await self._worker
        self._executor.shutdown(wait=True)

    def _take(self) -> _Pending:
        p = self._pending.popleft()
        self.stats.queue_items -= len(p.items)
        self.stats.queue_requests -= 1
        return p

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            while not self._pending:
                if self._closing:
                    return
                self._arrived.clear()
                await self._arrived.wait()
            batch = [self._take()]
            n = len(batch[0].items)
            deadline = loop.time() + self.max_wait_s
            while n < self.max_batch_size:
                if self._pending:
                    if n + len(self._pending[0].items) > self.max_batch_size:
                        break  # it starts the next batch (a request is never split)
                    batch.append(self._take())
                    n += len(batch[-1].items)
                    continue
                remaining = deadline - loop.time()
                if remaining <= 0 or self._closing:
                    break
                self._arrived.clear()
                try:  # an Event, not the queue, is what times out: nothing queued can be lost here
                    await asyncio.wait_for(self._arrived.wait(), remaining)
                except asyncio.TimeoutError:
                    break
            s = self.stats
            s.batches += 1
            s.requests += len(batch)
            s.items += n
            s.largest_batch_requests = max(s.largest_batch_requests, len(batch))
            s.largest_batch_items = max(s.largest_batch_items, n)
            t0 = time.perf_counter()
            await self._answer(batch, loop)
            seconds = time.perf_counter() - t0
            rate = n / max(seconds, 1e-6)
            self._items_per_s = rate if self._items_per_s is None else 0.8 * self._items_per_s + 0.2 * rate
            if self.on_batch is not None:
                self.on_batch(n, len(batch), seconds)

    async def _answer(self, batch: list[_Pending], loop: asyncio.AbstractEventLoop) -> None:
        try:
            results = await loop.run_in_executor(self._executor, self.predict, [it for p in batch for it in p.items])
        except Exception as e:
            if len(batch) > 1:  # find the request that failed: each alone, so the others are still answered
                for p in batch:
                    await self._answer([p], loop)
                return
            if not batch[0].future.done():
                batch[0].future.set_exception(e)
            return
        i = 0
        for p in batch:
            if not p.future.done():  # done = cancelled: the client went away
                p.future.set_result(results[i:i + len(p.items)])
            i += len(p.items)


# ----------------------------------------------------------------------------------------------- metrics

class Metrics:
    """The server's Prometheus metrics, in a registry of their own (one per app: tests run several in a process).

    Named after what Triton and TorchServe expose: requests by status, latency, batch sizes and times, queue depth;
    plus what protects the server (refusals by cause, open connections) and prometheus-client's process metrics
    (resident memory, CPU seconds, open file descriptors)."""

    def __init__(self, cfg: ServeConfig) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, ProcessCollector

        self.registry = r = CollectorRegistry()
        ProcessCollector(registry=r)
        latency = (.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60)
        sizes = sorted({2 ** k for k in range(0, 16) if 2 ** k < 2 * cfg.max_batch_size} | {cfg.max_batch_size})
        self.requests = Counter("bertrain_requests", "HTTP requests by path and status (499: the client went away "
                                "before its body arrived; never sent)", ["path", "status"], registry=r)
        self.latency = Histogram("bertrain_request_duration_seconds", "Time from the request head to the end of "
                                 "the answer, by path and status (a refusal should take next to none)",
                                 ["path", "status"], buckets=latency, registry=r)
        self.in_flight = Gauge("bertrain_requests_in_flight", "Requests being received, waiting or answered",
                               registry=r)
        self.batch_items = Histogram("bertrain_batch_items", "Items per model batch", buckets=sizes, registry=r)
        self.batch_requests = Histogram("bertrain_batch_requests", "Requests per model batch", buckets=sizes,
                                        registry=r)
        self.batch_seconds = Histogram("bertrain_batch_duration_seconds", "Time of one model batch (tokenising, "
                                       "forward pass, post-processing)", buckets=latency, registry=r)
        self.queue_items = Gauge("bertrain_queue_items", "Items waiting for the model", registry=r)
        self.queue_requests = Gauge("bertrain_queue_requests", "Requests waiting for the model", registry=r)
        self.queue_limit = Gauge("bertrain_queue_limit_items", "--max-queue", registry=r)
        self.queue_full = Counter("bertrain_queue_full", "Requests refused with 503 because --max-queue items "
                                  "were waiting", registry=r)
        self.connections = Gauge("bertrain_open_connections", "Open HTTP connections", registry=r)
        self.connection_limit = Counter("bertrain_connection_limit_refusals", "Requests refused with 503 by "
                                        "uvicorn because --max-connections were open", registry=r)
        self.header_timeouts = Counter("bertrain_header_timeouts", "Connections closed because no complete request "
                                       "head came within --header-timeout-s", registry=r)
        self.disconnects = Counter("bertrain_client_disconnects", "Clients that went away before their request body "
                                   "arrived", registry=r)
        self.model = Info("bertrain_model", "The model served", registry=r)
        self.queue_limit.set(cfg.max_queue)

    def on_batch(self, items: int, requests: int, seconds: float) -> None:
        self.batch_items.observe(items)
        self.batch_requests.observe(requests)
        self.batch_seconds.observe(seconds)


class _Measured:
    """Pure ASGI middleware: every HTTP request's status and time into `Metrics` (a pure one, not Starlette's
    BaseHTTPMiddleware, which wraps the body stream and the response in tasks of its own). A request that raised
    (answered 500 by Starlette outside this middleware) is counted as 500."""

    def __init__(self, app: Any, metrics: Metrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        m = self.metrics
        path = scope["path"] if scope["path"] in PATHS else "other"
        status = 500

        async def measured_send(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        t0 = time.perf_counter()
        m.in_flight.inc()
        try:
            await self.app(scope, receive, measured_send)
        finally:
            m.in_flight.dec()
            m.requests.labels(path, str(status)).inc()
            m.latency.labels(path, str(status)).observe(time.perf_counter() - t0)


# ----------------------------------------------------------------------------------------------- the app

def has_key(request: Request, key: str | None) -> bool:
    """Whether the request carries `key` as `Authorization: Bearer KEY` (always, when no key is set). The bytes are
    compared with `hmac.compare_digest`, in time that does not depend on where they differ."""
    if key is None:
        return True
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode("latin-1"), key.encode("ascii"))


async def require_key(request: Request, cfg: ServeConfig) -> None:
    """401 unless the request carries the API key. Its body is read and dropped first (up to --max-request-bytes),
    so that the client reads the 401 rather than a reset connection."""
    if has_key(request, cfg.api_key):
        return
    given = "authorization" in request.headers
    close = False
    if request.method == "POST":
        try:
            await read_body(request, cfg)
        except RequestError as e:
            if e.status != 413:  # 408 and a client gone stay what they are
                raise
            close = True
    raise RequestError(401, "wrong API key" if given else "this server needs an API key: send 'Authorization: "
                       "Bearer KEY'", headers={"WWW-Authenticate": 'Bearer realm="bertrain"'
                                               + (', error="invalid_token"' if given else "")}, close=close)


def create_app(predictor: Any, cfg: ServeConfig, backend: str = "torch") -> FastAPI:
    """The ASGI app around a loaded `Predictor`; `app.state.metrics` and `app.state.batcher` (once started)."""
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    task = predictor.task
    dtype = getattr(predictor.backend, "dtype", "fp32")  # an ONNX export runs in float32
    metrics = Metrics(cfg)
    metrics.model.info({"task": task, "backend": backend, "dtype": dtype, "model": str(predictor.model_dir),
                        "labels": ",".join(map(str, predictor.labels or [])),
                        "max_batch_size": str(cfg.max_batch_size), "max_wait_ms": f"{cfg.max_wait_ms:g}",
                        "max_queue": str(cfg.max_queue), "auth": "api key" if cfg.api_key else "none"})

    def predict(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
        # Requests are batched together: the model sees positions as ids (a QA example is keyed by its id, and two
        # clients may both send "1"); each request gets its own ids back in `predict_endpoint`.
        return predictor.predict([{**it, "id": str(i)} for i, it in enumerate(items)])

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        batcher = MicroBatcher(predict, cfg.max_batch_size, cfg.max_wait_ms / 1000, cfg.max_queue, metrics.on_batch)
        metrics.queue_items.set_function(lambda: batcher.stats.queue_items)
        metrics.queue_requests.set_function(lambda: batcher.stats.queue_requests)
        batcher.start()
        app.state.batcher = batcher
        yield
        await batcher.close()  # uvicorn has answered the requests in flight; answer anything still queued
        log.info("served %d requests (%d items) in %d batches", batcher.stats.requests, batcher.stats.items,
                 batcher.stats.batches)

    app = FastAPI(title="bertrain", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.metrics = metrics
    app.add_middleware(_Measured, metrics=metrics)

    @app.exception_handler(RequestError)
    async def _refused(request: Request, e: RequestError) -> Response:
        if e.status == CLIENT_GONE:  # normal traffic: counted, one debug line, no traceback; the answer goes nowhere
            metrics.disconnects.inc()
            client = request.client
            log.debug("%s: %s", f"{client.host}:{client.port}" if client else "a client", e)
        elif isinstance(e, QueueFull):
            metrics.queue_full.inc()
        return JSONResponse({"error": str(e)}, status_code=e.status, headers=e.headers)

    @app.get("/health")
    async def health(request: Request) -> dict[str, Any]:
        if not has_key(request, cfg.api_key):
            return {"status": "ok"}
        b = getattr(request.app.state, "batcher", None)
        return {"status": "ok", "task": task, "backend": backend, "dtype": dtype, "model": str(predictor.model_dir),
                "labels": predictor.labels, "max_batch_size": cfg.max_batch_size, "max_wait_ms": cfg.max_wait_ms,
                "max_request_bytes": cfg.max_request_bytes, "max_queue": cfg.max_queue,
                "stats": vars(b.stats) if b else None}

    @app.get("/metrics")
    async def metrics_endpoint(request: Request) -> Response:
        await require_key(request, cfg)
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/predict")
    async def predict_endpoint(request: Request) -> Any:
        await require_key(request, cfg)
        items, is_list = parse_items(await read_body(request, cfg), task, max_items=cfg.max_queue)
        t0 = time.perf_counter()
        try:
            results = await request.app.state.batcher.submit(items)
        except ValueError as e:  # input the model cannot take (Predictor's checks): the client's to fix
            raise RequestError(422, str(e)) from None
        for i, (it, rec) in enumerate(zip(items, results)):
            rec["id"] = str(it["id"]) if "id" in it else str(i)
        log.debug("%d items in %.1f ms", len(items), 1000 * (time.perf_counter() - t0))
        return results if is_list else results[0]

    return app


# ----------------------------------------------------------------------------------------------- the server

_HEAD_TIMEOUT_BODY = b'{"error":"no complete request head arrived in time (--header-timeout-s)"}'
# Written by hand: no request exists yet, so neither the app nor h11's state machine can answer it.
_HEAD_TIMEOUT_RESPONSE = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                          b"content-length: %d\r\nconnection: close\r\n\r\n%s"
                          % (len(_HEAD_TIMEOUT_BODY), _HEAD_TIMEOUT_BODY))


def header_timeout_protocol(header_timeout_s: float, on_timeout: Callable[[], None]) -> type:
    """uvicorn's HTTP/1.1 (h11) protocol with a deadline for each request head, passed to uvicorn as `http=`.

    uvicorn (0.54) has none: its keep-alive timer starts only after a first answer and is cancelled by any byte,
    so a client that connects and sends nothing, or a header line a minute, holds its socket (and a place under
    --max-connections) for ever. Here a connection must complete a request head within `header_timeout_s` of
    connecting or of its previous answer: one that sent part of a head gets 408, an idle one is closed."""
    h11 = require("h11", "bertrain serve")
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeaderTimeoutH11Protocol(H11Protocol):
        _head_timer: asyncio.TimerHandle | None = None

        def _arm_head_timer(self) -> None:
            self._cancel_head_timer()
            self._head_timer = self.loop.call_later(header_timeout_s, self._head_timed_out)

        def _cancel_head_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm_head_timer()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:
                self._cancel_head_timer()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self._arm_head_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_head_timer()
            super().connection_lost(exc)

        def _head_timed_out(self) -> None:
            self._head_timer = None
            if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
                return
            if self.conn.trailing_data[0]:  # part of a head came: say why it is closed
                self.transport.write(_HEAD_TIMEOUT_RESPONSE)
            on_timeout()
            self.transport.close()

    return HeaderTimeoutH11Protocol


class _ConnectionLimitLog(logging.Filter):
    """uvicorn answers a request over `limit_concurrency` (--max-connections) with 503 itself, before the app, and
    logs a warning for each: that line is the only sign of it. This filter counts them into `Metrics` and lets one
    line through per 10 s, with the count, instead of one per refused request."""

    MESSAGE = "Exceeded concurrency limit."

    def __init__(self, metrics: Metrics, limit: int) -> None:
        super().__init__()
        self.metrics, self.limit = metrics, limit
        self.unreported, self.last = 0, -math.inf

    def filter(self, record: logging.LogRecord) -> bool:
        if record.getMessage() != self.MESSAGE:
            return True
        self.metrics.connection_limit.inc()
        self.unreported += 1
        now = time.monotonic()
        if now - self.last < 10:
            return False
        record.msg, record.args = (f"{self.unreported} request(s) refused with 503: --max-connections "
                                   f"{self.limit} connections were open"), ()
        self.unreported, self.last = 0, now
        return True


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on (host, port); a port in use or an address we cannot bind is a `UserError`."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise UserError(f"cannot listen on {host}:{port}: {e.strerror or e}: choose another --port (0 picks a "
                        "free one) or --host") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def serve(predictor: Any, cfg: ServeConfig, backend: str) -> None:
    """Run the server until SIGTERM/SIGINT; in-flight and queued requests are answered before it returns."""
    uvicorn = require("uvicorn", "bertrain serve")
    prometheus_client.disable_created_metrics()  # no `*_created` series: this process only serves
    sock = bind(cfg.host, cfg.port)
    host, port = sock.getsockname()[:2]
    app = create_app(predictor, cfg, backend)
    metrics: Metrics = app.state.metrics
    protocol = header_timeout_protocol(cfg.header_timeout_s, metrics.header_timeouts.inc)
    server = uvicorn.Server(uvicorn.Config(app, log_level="info", access_log=False, lifespan="on", http=protocol,
                                           limit_concurrency=cfg.max_connections))
    metrics.connections.set_function(lambda: len(server.server_state.connections))
    limit_log = _ConnectionLimitLog(metrics, cfg.max_connections)
    uvicorn_log = logging.getLogger("uvicorn.error")
    uvicorn_log.addFilter(limit_log)
    shown = f"[{host}]" if ":" in host else host
    if cfg.api_key:
        auth = f"API key from {cfg.api_key_source}"
    elif is_loopback(cfg.host):
        auth = "no API key: this machine only"
    else:
        auth = "no API key (--allow-unauthenticated): anyone who can reach the port can use it"
        log.warning("serving on %s without an API key (--allow-unauthenticated)", cfg.host)
    print(f"bertrain serve: {predictor.model_dir} ({predictor.task}, {backend}, "
          f"{getattr(predictor.backend, 'dtype', 'fp32')}) on http://{shown}:{port} "
          f"(max batch {cfg.max_batch_size}, max wait {cfg.max_wait_ms:g} ms, max queue {cfg.max_queue} items, "
          f"max connections {cfg.max_connections}; {auth})", flush=True)
    # uvicorn handles SIGTERM/SIGINT itself (stop accepting, finish what is in flight, lifespan shutdown), then
    # restores the handlers it found and raises the signal again. Finding these no-op handlers, the process ends
    # with exit 0 after a clean drain instead of dying by the signal (or a KeyboardInterrupt, exit 3).
    received: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, frame: received.append(signum))
                for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.run(sockets=[sock])
    finally:
        uvicorn_log.removeFilter(limit_log)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if received:
        print(f"bertrain serve: stopped by {signal.Signals(received[0]).name}; every request received was answered",
              flush=True)
