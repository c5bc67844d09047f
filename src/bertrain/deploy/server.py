"""`bertrain serve`: a fine-tuned QA or classification model behind an HTTP JSON API (FastAPI on uvicorn).

    POST /predict   one item or a list of items -> one result or a list, in order
                    QA:             {"question": str, "context": str[, "id"]}
                    classification: {"text": str[, "text_pair": str][, "id"]}
                    results are `Predictor`'s (deploy/predict.py): the same as `bertrain predict` prints
    GET  /health    {"status": "ok", task, backend, model, labels, the batching settings and counters}

Concurrent requests are micro-batched: `MicroBatcher` queues them, and one worker takes the first waiting request,
lets others join it for up to `max_wait_ms` or until `max_batch_size` items, and runs the whole batch through the
model in one thread (the model is never run twice at once; the event loop keeps accepting meanwhile). A request is
never split across batches; one larger than `max_batch_size` runs alone.

User errors are 4xx naming what is wrong, never 500: a body over `max_request_bytes` 413, malformed JSON 400, a
missing/empty/extra field 422 naming it (e.g. `items[3].context`). A batch that fails is retried request by request,
so one request cannot fail the others batched with it.

Shutdown (SIGTERM, SIGINT): uvicorn stops accepting connections and waits for the requests in flight; then the
batcher drains what is still queued before the process exits 0.
"""
from __future__ import annotations

import asyncio
import json
import logging
import signal
import socket
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Annotated, Any, AsyncIterator, Callable

from bertrain.deploy import require
from bertrain.deploy.config import ServeConfig
from bertrain.utils.errors import UserError

log = logging.getLogger(__name__)

fastapi = require("fastapi", "bertrain serve")
pydantic = require("pydantic", "bertrain serve")

from fastapi import FastAPI, Request  # noqa: E402  (after the check that names the extra)
from fastapi.responses import JSONResponse  # noqa: E402
from pydantic import AfterValidator, BaseModel, ConfigDict, TypeAdapter, ValidationError  # noqa: E402


# ----------------------------------------------------------------------------------------------- request items

def _not_blank(v: str) -> str:
    if not v.strip():
        raise ValueError("must not be empty or only whitespace")
    return v


Text = Annotated[str, AfterValidator(_not_blank)]


class QAItem(BaseModel):
    model_config = ConfigDict(extra="forbid")
    question: Text
    context: Text
    id: str | int | None = None


class ClassificationItem(BaseModel):
    model_config = ConfigDict(extra="forbid")
    text: Text
    text_pair: Text | None = None
    id: str | int | None = None


class RequestError(Exception):
    """A request the server refuses: the HTTP status and one message naming what is wrong."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def parse_items(body: bytes, task: str) -> tuple[list[dict[str, Any]], bool]:
    """The request's items (as dicts) and whether it was a list; `RequestError` (400/422) naming the field."""
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RequestError(400, f"the body is not valid JSON: {e}") from None
    item_cls = QAItem if task == "qa" else ClassificationItem
    fields = "question, context" if task == "qa" else "text[, text_pair]"
    if isinstance(data, list):
        if not data:
            raise RequestError(422, "the list of items is empty")
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


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refused with 413 as soon as it exceeds `limit` bytes (declared or streamed)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise RequestError(413, f"the request body is {int(declared):,} bytes; the limit is {limit:,} "
                                "(--max-request-bytes): send fewer or shorter items per request")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise RequestError(413, f"the request body exceeds the limit of {limit:,} bytes (--max-request-bytes)")
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


@dataclass
class MicroBatcher:
    """Queue concurrent requests and run them through `predict` together (see the module docstring).

    `predict(items) -> results` runs in one worker thread; items are the requests' items in order, results one per
    item in the same order."""

    predict: Callable[[list[dict[str, Any]]], list[dict[str, Any]]]
    max_batch_size: int = 32
    max_wait_s: float = 0.005
    stats: BatchStats = field(default_factory=BatchStats)

    def __post_init__(self) -> None:
        self._pending: deque[_Pending] = deque()
        self._arrived = asyncio.Event()
        self._closing = False
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="bertrain-model")
        self._worker: asyncio.Task | None = None

    def start(self) -> None:
        self._worker = asyncio.get_running_loop().create_task(self._run(), name="bertrain-batcher")

    async def submit(self, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if self._closing:
            raise RequestError(503, "the server is shutting down")
        p = _Pending(items, asyncio.get_running_loop().create_future())
        self._pending.append(p)
        self._arrived.set()
        self.stats.in_flight += 1
        try:
            return await p.future
        finally:
            self.stats.in_flight -= 1

    async def close(self) -> None:
        """Answer everything queued, then stop the worker and its thread."""
        self._closing = True
        self._arrived.set()
        if self._worker is not None:
            await self._worker
        self._executor.shutdown(wait=True)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            while not self._pending:
                if self._closing:
                    return
                self._arrived.clear()
                await self._arrived.wait()
            batch = [self._pending.popleft()]
            n = len(batch[0].items)
            deadline = loop.time() + self.max_wait_s
            while n < self.max_batch_size:
                if self._pending:
                    if n + len(self._pending[0].items) > self.max_batch_size:
                        break  # it starts the next batch (a request is never split)
                    p = self._pending.popleft()
                    batch.append(p)
                    n += len(p.items)
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
            await self._answer(batch, loop)

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


# ----------------------------------------------------------------------------------------------- the app

def create_app(predictor: Any, cfg: ServeConfig, backend: str = "torch") -> FastAPI:
    """The ASGI app around a loaded `Predictor`."""
    task = predictor.task

    def predict(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
        # Requests are batched together: the model sees positions as ids (a QA example is keyed by its id, and two
        # clients may both send "1"); each request gets its own ids back in `predict_endpoint`.
        return predictor.predict([{**it, "id": str(i)} for i, it in enumerate(items)])

    batcher_box: dict[str, MicroBatcher] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        batcher = MicroBatcher(predict, cfg.max_batch_size, cfg.max_wait_ms / 1000)
        batcher.start()
        batcher_box["b"] = batcher
        yield
        await batcher.close()  # uvicorn has answered the requests in flight; answer anything still queued
        log.info("served %d requests (%d items) in %d batches", batcher.stats.requests, batcher.stats.items,
                 batcher.stats.batches)

    app = FastAPI(title="bertrain", lifespan=lifespan)

    @app.exception_handler(RequestError)
    async def _refused(request: Request, e: RequestError) -> JSONResponse:
        return JSONResponse({"error": str(e)}, status_code=e.status)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        b = batcher_box.get("b")
        return {"status": "ok", "task": task, "backend": backend, "model": str(predictor.model_dir),
                "labels": predictor.labels, "max_batch_size": cfg.max_batch_size, "max_wait_ms": cfg.max_wait_ms,
                "max_request_bytes": cfg.max_request_bytes, "stats": vars(b.stats) if b else None}

    @app.post("/predict")
    async def predict_endpoint(request: Request) -> Any:
        items, is_list = parse_items(await read_body(request, cfg.max_request_bytes), task)
        t0 = time.perf_counter()
        try:
            results = await batcher_box["b"].submit(items)
        except ValueError as e:  # input the model cannot take (Predictor's checks): the client's to fix
            raise RequestError(422, str(e)) from None
        for i, (it, rec) in enumerate(zip(items, results)):
            rec["id"] = str(it["id"]) if "id" in it else str(i)
        log.debug("%d items in %.1f ms", len(items), 1000 * (time.perf_counter() - t0))
        return results if is_list else results[0]

    return app


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
    sock = bind(cfg.host, cfg.port)
    host, port = sock.getsockname()[:2]
    app = create_app(predictor, cfg, backend)
    server = uvicorn.Server(uvicorn.Config(app, log_level="info", access_log=False, lifespan="on"))
    shown = f"[{host}]" if ":" in host else host
    print(f"bertrain serve: {predictor.model_dir} ({predictor.task}, {backend}) on http://{shown}:{port} "
          f"(max batch {cfg.max_batch_size}, max wait {cfg.max_wait_ms:g} ms)", flush=True)
    # uvicorn handles SIGTERM/SIGINT itself (stop accepting, finish what is in flight, lifespan shutdown), then
    # restores the handlers it found and raises the signal again. Finding these no-op handlers, the process ends
    # with exit 0 after a clean drain instead of dying by the signal (or a KeyboardInterrupt, exit 3).
    received: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, frame: received.append(signum))
                for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.run(sockets=[sock])
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if received:
        print(f"bertrain serve: stopped by {signal.Signals(received[0]).name}; every request received was answered",
              flush=True)
