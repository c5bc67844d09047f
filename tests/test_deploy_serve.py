"""`bertrain serve`: the micro-batcher (asyncio, a fake model), the HTTP API in-process on the real MiniLM (4xx that
name the field, 413, one item or a list, ids), and real servers in subprocesses on 127.0.0.1: a short load test whose
every answer is checked against offline predictions (ONNX Runtime backend), SIGTERM with requests in flight, and
hostile and heavy traffic (issue 25: input that must never be a 5xx, clients that leave or stall, bodies over the
limit, a flood beyond the queue, too many connections, the API key, the Prometheus metrics)."""
from __future__ import annotations

import asyncio
import json
import signal
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from bertrain.cli import main
from bertrain.deploy.loadtest import metric
from conftest import shared_file

pytest.importorskip("fastapi", reason="needs the deploy extra: pip install 'bertrain[deploy]'")
pytest.importorskip("httpx", reason="needs the deploy extra: pip install 'bertrain[deploy]'")
pytest.importorskip("prometheus_client", reason="needs the deploy extra: pip install 'bertrain[deploy]'")

# deploy_models (conftest.py): the session fixture, MiniLM + seeded heads and their ONNX exports


# ----------------------------------------------------------------------------------------------- micro-batching

def _batches(sizes: list[int], max_batch_size: int, fail_on: str | None = None):
    """Submit requests of `sizes` items at once to a MicroBatcher over a fake model; the batches it ran and the
    answers (or exceptions) each request got."""
    from bertrain.deploy.server import MicroBatcher

    ran: list[list[str]] = []

    def predict(items):
        ran.append([it["v"] for it in items])
        if fail_on is not None and any(it["v"] == fail_on for it in items):
            raise ValueError(f"bad item {fail_on}")
        return [{"echo": it["v"]} for it in items]

    async def go():
        b = MicroBatcher(predict, max_batch_size=max_batch_size, max_wait_s=0.5)
        b.start()
        reqs = [[{"v": f"{r}.{i}"} for i in range(n)] for r, n in enumerate(sizes)]
        out = await asyncio.gather(*(b.submit(r) for r in reqs), return_exceptions=True)
        await b.close()
        return reqs, out, b.stats

    reqs, out, stats = asyncio.run(go())
    return ran, reqs, out, stats


def test_micro_batcher_groups_concurrent_requests_and_never_splits_one():
    ran, reqs, out, stats = _batches([1, 2, 1, 3, 1], max_batch_size=4)
    for r, o in zip(reqs, out):  # each request gets exactly its own answers, in order
        assert o == [{"echo": it["v"]} for it in r]
    # in arrival order, as many whole requests as fit in 4 items: [1, 2, 1] [3, 1]
    assert [len(b) for b in ran] == [4, 4]
    assert stats.batches == 2 and stats.requests == 5 and stats.largest_batch_requests == 3
    assert stats.in_flight == 0
    ran, _, out, _ = _batches([6, 1], max_batch_size=4)  # larger than a batch: runs alone
    assert [len(b) for b in ran] == [6, 1]


def test_micro_batcher_isolates_a_failing_request():
    ran, reqs, out, stats = _batches([1, 1, 1], max_batch_size=8, fail_on="1.0")
    assert isinstance(out[1], ValueError) and "bad item 1.0" in str(out[1])
    assert stats.batches == 1 and stats.requests == 3  # the retries alone are not counted as batches
    assert out[0] == [{"echo": "0.0"}] and out[2] == [{"echo": "2.0"}]
    assert ran[0] == ["0.0", "1.0", "2.0"] and sorted(map(tuple, ran[1:])) == [("0.0",), ("1.0",), ("2.0",)]


# ----------------------------------------------------------------------------------------------- the API

@pytest.fixture(scope="module")
def clients(deploy_models):
    """In-process apps (lifespan run by TestClient) on the real MiniLM: classification (torch) and QA (ONNX
    Runtime), with a small request size limit."""
    from fastapi.testclient import TestClient

    from bertrain.deploy.config import ServeConfig
    from bertrain.deploy.server import create_app
    from bertrain.deploy.predict import Predictor

    cfg = ServeConfig(max_batch_size=8, max_wait_ms=1, max_request_bytes=4096)
    cls = Predictor(deploy_models["cls"], batch_size=8)
    qa = Predictor(deploy_models["qa_onnx"], batch_size=8, backend="onnxruntime")
    with TestClient(create_app(cls, cfg)) as c, TestClient(create_app(qa, cfg, "onnxruntime")) as q:
        yield {"cls": (c, cls), "qa": (q, qa)}


def test_api_answers_one_item_or_a_list_as_predict_does(clients):
    c, cls = clients["cls"]
    item = {"text": "The cat sat.", "text_pair": "A cat was sitting."}
    one = c.post("/predict", json=item)
    assert one.status_code == 200
    (offline,) = cls.predict([item])
    assert one.json()["label"] == offline["label"] and abs(one.json()["score"] - offline["score"]) < 1e-5
    many = c.post("/predict", json=[{"text": "Hello.", "id": "a"}, item, {"text": "x y", "id": 7}]).json()
    assert [r["id"] for r in many] == ["a", "1", "7"] and many[1]["label"] == offline["label"]
    q, qa = clients["qa"]
    ctx = "Ann wrote the report in Paris in 1999."
    r = q.post("/predict", json={"question": "Who wrote the report?", "context": ctx}).json()
    (want,) = qa.predict([{"question": "Who wrote the report?", "context": ctx}])
    assert r["answer"] == want["answer"] and ctx[r["start"]:r["end"]] == r["answer"]
    health = c.get("/health").json()
    assert health["status"] == "ok" and health["task"] == "classification" and health["stats"]["requests"] >= 2
    assert q.get("/health").json()["backend"] == "onnxruntime"


@pytest.mark.parametrize("task, body, status, message", [
    ("cls", "{oops", 400, "not valid JSON"),
    ("cls", "[]", 422, "the list of items is empty"),
    ("cls", "5", 422, "expected a JSON object"),
    ("cls", '{"txt": "a"}', 422, "text: Field required; txt: unknown field"),
    ("cls", '[{"text": "a"}, {"text": "  "}]', 422, "items[1].text: must not be empty"),
    ("cls", '{"text": 5}', 422, "text: Input should be a valid string"),
    ("cls", '{"text": "a", "text_pair": ""}', 422, "text_pair: must not be empty"),
    ("qa", '{"question": "who?"}', 422, "context: Field required"),
    ("qa", '[{"question": "who?", "context": "Ann."}, {"question": "", "context": "x"}]', 422,
     "items[1].question: must not be empty"),
    ("cls", json.dumps([{"text": "word " * 100}] * 10), 413, "the limit is 4,096"),
])
def test_api_refuses_bad_requests_naming_the_field(clients, task, body, status, message):
    c, _ = clients[task]
    r = c.post("/predict", content=body, headers={"content-type": "application/json"})
    assert r.status_code == status and message in r.json()["error"], r.text


def test_api_limit_holds_without_a_declared_length(clients):
    c, _ = clients["cls"]

    def chunks():
        for _ in range(10):
            yield b"[" + b" " * 1000

    r = c.post("/predict", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413 and "exceeds the limit of 4,096 bytes" in r.json()["error"]


def test_serve_command_refusals(deploy_models, capsys, monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        assert main(["serve", str(deploy_models["cls"]), "--port", str(port)]) == 2
        assert f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err
    assert main(["serve", str(deploy_models["cls"]), "--max-batch-size", "0"]) == 2
    assert "--max-batch-size 0: must be >= 1" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "fastapi", None)
    monkeypatch.delitem(sys.modules, "bertrain.deploy.server", raising=False)
    assert main(["serve", str(deploy_models["cls"])]) == 2
    assert 'fastapi' in (err := capsys.readouterr().err) and 'pip install "bertrain[deploy]"' in err


# ----------------------------------------------------------------------------------------------- real servers

def test_short_load_test_every_answer_checked(deploy_models):
    """4 concurrent clients for 3 s (at most 120 requests of 2 items) against `bertrain serve --backend
    onnxruntime` on 127.0.0.1: nothing lost, every answer the offline prediction."""
    from bertrain.deploy.loadtest import mrpc_items, run_load, running_server
    from bertrain.deploy.predict import Predictor

    items = mrpc_items(shared_file("glue/MRPC/dev.tsv"), limit=40)
    expected = Predictor(deploy_models["cls"]).predict(items)  # offline, PyTorch
    with running_server(deploy_models["cls_onnx"], "--backend", "onnxruntime", "--max-wait-ms", "5",
                        "--max-batch-size", "8") as server:
        report = run_load(server.url, items, expected, clients=4, duration_s=3, max_requests=120,
                          items_per_request=2)
    assert report.answered > 0 and report.lost == 0 and report.wrong == 0, report.summary()
    assert report.answered == report.requests and report.max_score_diff < 1e-4
    assert server.proc.returncode == 0


def test_sigterm_answers_every_request_in_flight(deploy_models):
    """Six requests wait in a micro-batch (max wait 3 s) and an upload has stalled when the server gets SIGTERM:
    all six are answered, with the offline predictions, the stalled upload gets 408 at --body-timeout-s (before
    issue 25 it held the shutdown for ever), and the server exits 0."""
    import httpx

    from bertrain.deploy.loadtest import mrpc_items, running_server, same_prediction
    from bertrain.deploy.predict import Predictor

    items = mrpc_items(shared_file("glue/MRPC/dev.tsv"), limit=6)
    expected = Predictor(deploy_models["cls"]).predict(items)
    answers: dict[int, httpx.Response | Exception] = {}
    with running_server(deploy_models["cls"], "--max-wait-ms", "3000", "--body-timeout-s", "5") as server:
        def send(i: int) -> None:
            try:
                answers[i] = httpx.post(f"{server.url}/predict", json=items[i], timeout=60)
            except Exception as e:  # noqa: BLE001  (recorded and asserted below)
                answers[i] = e

        threads = [threading.Thread(target=send, args=(i,)) for i in range(len(items))]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while httpx.get(f"{server.url}/health").json()["stats"]["in_flight"] < len(items):
            assert time.monotonic() < deadline, "the requests never arrived"
            time.sleep(0.02)
        stalled = connect(server)
        stalled.sendall(head(key=False, length=1000) + b'{"text": "sta')
        wait_for_metric(server, "bertrain_requests_in_flight", len(items) + 2)  # + the upload + this scrape
        server.proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(60)
        with stalled:
            answer, _ = read_until_closed(stalled, 60)
        assert answer.startswith(b"HTTP/1.1 408 ") and b"13 bytes came of 1,000" in answer, answer
        assert server.proc.wait(60) == 0
    for i, r in sorted(answers.items()):
        assert isinstance(r, httpx.Response) and r.status_code == 200, r
        assert same_prediction(r.json(), expected[i])
    assert len(answers) == len(items)
    assert any("served 6 requests (6 items) in 1 batches" in line for line in server.lines), server.lines


# ----------------------------------------------------------------------------------------------- hostile traffic
# Issue 25: one real server for what follows (ONNX Runtime backend, 127.0.0.1), plain clients (urllib, as an
# operator's script would) and raw sockets where a case needs bytes no client library would send. Small limits, so
# that each case is reached in seconds: --max-batch-size 4, --max-queue 8, --max-connections 48, 3 s header and
# body timeouts, an API key. Tests wait on the server's answers, its metrics or its closing of a socket, each with
# a deadline; none sleeps a fixed time. RELIABILITY.md "Serving" lists each case with its test.

KEY = "test-key-0123456789abcdef"
MAX_QUEUE, MAX_CONNECTIONS, TIMEOUT_S = 8, 48, 3.0


@pytest.fixture(scope="module")
def server(deploy_models):
    from bertrain.deploy.loadtest import running_server

    with running_server(deploy_models["cls_onnx"], "--backend", "onnxruntime", "--max-batch-size", "4",
                        "--max-wait-ms", "2", "--max-queue", str(MAX_QUEUE), "--max-connections",
                        str(MAX_CONNECTIONS), "--header-timeout-s", str(TIMEOUT_S), "--body-timeout-s",
                        str(TIMEOUT_S), api_key=KEY) as s:
        yield s
    assert s.proc.returncode == 0, "".join(s.lines)


@pytest.fixture(scope="module")
def mrpc(deploy_models):
    """40 real MRPC pairs and their offline predictions (PyTorch): what every served answer must equal."""
    from bertrain.deploy.loadtest import mrpc_items
    from bertrain.deploy.predict import Predictor

    items = mrpc_items(shared_file("glue/MRPC/dev.tsv"), limit=40)
    return items, Predictor(deploy_models["cls"]).predict(items)


# ----------------------------------------------------------------------------------------------- helpers

def request(server, path: str, body: bytes | None = None, headers: dict | None = None,
            key: bool = True) -> tuple[int, Any, bytes]:
    """A plain urllib request (as an operator's script sends it): status, headers, body; an HTTP error status is
    an answer too, only a broken connection raises. The headers are an `email.message.Message` (any case)."""
    hdrs = {"Content-Type": "application/json", **(server.headers if key else {}), **(headers or {})}
    req = urllib.request.Request(server.url + path, data=body, headers=hdrs)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.headers, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read()


def scrape(server) -> dict:
    """GET /metrics parsed by prometheus-client's own parser: {(sample name, sorted labels): value}."""
    from bertrain.deploy.loadtest import scrape_metrics

    return scrape_metrics(server.url, server.headers)


def wait_for_metric(server, name: str, at_least: float, deadline_s: float = 30.0, **labels) -> dict:
    deadline = time.monotonic() + deadline_s
    while True:
        m = scrape(server)
        if metric(m, name, **labels) >= at_least:
            return m
        assert time.monotonic() < deadline, f"{name}{labels} stayed at {metric(m, name, **labels)} < {at_least}"


def connect(server) -> socket.socket:
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=60)


def read_until_closed(sock: socket.socket, deadline_s: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection (within `deadline_s`), and how long it took."""
    t0 = time.monotonic()
    sock.settimeout(deadline_s)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return data, time.monotonic() - t0


def head(key: bool = True, length: int | None = None, extra: str = "") -> bytes:
    lines = ["POST /predict HTTP/1.1", "Host: 127.0.0.1", "Content-Type: application/json"]
    lines += [f"Authorization: Bearer {KEY}"] if key else []
    lines += [f"Content-Length: {length}"] if length is not None else []
    return ("\r\n".join(lines) + "\r\n" + extra + "\r\n").encode()


def no_traceback(server) -> None:
    log = "".join(server.lines)
    assert "Traceback" not in log and "Exception in ASGI application" not in log, log[-3000:]


# ----------------------------------------------------------------------------------------------- 1. user input

@pytest.mark.parametrize("body, status, message", [
    (b"[" * 5000 + b"]" * 5000, 400, "nested too deeply"),
    (b'{"a": ' * 5000 + b"1" + b"}" * 5000, 400, "nested too deeply"),
    (b'{"text": "a", "id": ' + b"7" * 5000 + b"}", 400, "not valid JSON: Exceeds the limit (4300 digits)"),
    (b'{"text": "a\\ud800b"}', 422, "text: holds '\\ud800' at character 1, a lone surrogate"),
    (b'{"text": "a", "id": "\\udfff"}', 422, "id: holds '\\udfff' at character 0, a lone surrogate"),
    (json.dumps([{"text": "a"}] * (MAX_QUEUE + 1)).encode(), 413, "holds 9 items; at most 8 can wait"),
])
def test_hostile_bodies_are_4xx_naming_the_problem_never_5xx(server, body, status, message):
    got, _, answer = request(server, "/predict", body)
    assert got == status and message in json.loads(answer)["error"], answer
    no_traceback(server)


# ----------------------------------------------------------------------------------------------- 2. disconnects

def test_clients_leaving_mid_upload_are_counted_without_a_traceback(server):
    """20 uploads stall halfway and then close: no traceback, at most a debug line each (none at the default
    level), bertrain_client_disconnects_total counts all 20, and the server answers the next request."""
    before = scrape(server)
    sockets = [connect(server) for _ in range(20)]
    for s in sockets:
        s.sendall(head(length=1000) + b'{"text": "half')
    # every upload is inside the app, waiting for the rest of its body (+1: this scrape itself)
    wait_for_metric(server, "bertrain_requests_in_flight", 21)
    for s in sockets:
        s.close()
    gone = metric(before, "bertrain_client_disconnects_total") + 20
    assert metric(wait_for_metric(server, "bertrain_client_disconnects_total", gone),
                  "bertrain_client_disconnects_total") == gone
    after = scrape(server)
    assert (metric(after, "bertrain_requests_total", path="/predict", status="499")
            == metric(before, "bertrain_requests_total", path="/predict", status="499") + 20)
    assert request(server, "/predict", b'{"text": "still here"}')[0] == 200
    no_traceback(server)
    assert not any("disconnect" in line.lower() or "went away" in line for line in server.lines), server.lines


# ----------------------------------------------------------------------------------------------- 3. too large

@pytest.mark.parametrize("mib, chunked", [(3, False), (12, False), (3, True)])
def test_an_oversized_body_is_a_413_a_plain_client_can_read(server, mib, chunked):
    """urllib sends the whole body before it reads the answer: the server reads and drops it (up to 16 MiB) and
    answers 413, instead of closing on the unread body (a reset: BrokenPipeError in the client)."""
    body = b"x" * (mib << 20)
    if chunked:  # no Content-Length: the limit is found while reading
        status, headers, answer = request(server, "/predict", iter([body[i:i + 65536]
                                                                    for i in range(0, len(body), 65536)]),
                                          headers={"Transfer-Encoding": "chunked"})
        assert status == 413 and "exceeds the limit of 1,048,576 bytes" in json.loads(answer)["error"]
    else:
        status, headers, answer = request(server, "/predict", body)
        assert status == 413 and json.loads(answer)["error"].startswith(
            f"the request body is {mib << 20:,} bytes; the limit is 1,048,576 (--max-request-bytes)")
    assert request(server, "/predict", b'{"text": "fine"}')[0] == 200


def test_a_client_waiting_for_100_continue_gets_413_before_sending(server):
    with connect(server) as s:
        s.sendall(head(length=100 << 20, extra="Expect: 100-continue\r\n"))
        answer, _ = read_until_closed(s, 30)
    assert answer.startswith(b"HTTP/1.1 413 ") and b"104,857,600 bytes" in answer, answer[:300]


# ----------------------------------------------------------------------------------------------- 4. overload

def test_a_flood_gets_503_with_retry_after_and_every_accepted_request_is_right(server, mrpc):
    """32 clients without pause against --max-queue 8 (two batches of 4): the excess is refused at once with 503
    and Retry-After, every request accepted is answered with the offline prediction, the queue never holds more
    than 8 items, and the server's memory stays put."""
    from bertrain.deploy.loadtest import run_load

    items, expected = mrpc
    rss_before = _rss_mib(server.proc.pid)
    report = run_load(server.url, items, expected, clients=32, duration_s=4, max_requests=2000,
                      headers=server.headers)
    summary = report.summary()
    assert report.refused > 0 and report.answered > 0, summary
    assert report.lost == 0 and report.wrong == 0 and report.max_score_diff < 1e-4, summary
    assert all(1 <= s <= 60 for s in report.retry_after_s), summary
    # refused at once: a 503 takes no model time, an accepted request waits for up to two batches
    assert report.percentile_ms(50, refused=True) < report.percentile_ms(50), summary
    _, _, health = request(server, "/health")
    stats = json.loads(health)["stats"]
    assert 0 < stats["largest_queue_items"] <= MAX_QUEUE and stats["queue_items"] == 0, stats
    assert stats["refused_queue_full"] >= report.refused
    assert _rss_mib(server.proc.pid) - rss_before < 200, (rss_before, _rss_mib(server.proc.pid))
    m = scrape(server)
    assert metric(m, "bertrain_queue_full_total") >= report.refused
    assert metric(m, "bertrain_requests_total", path="/predict", status="503") >= report.refused


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


# ----------------------------------------------------------------------------------------------- 5. slow clients

def test_slow_clients_are_timed_out(server):
    """A stalled body gets 408 after --body-timeout-s, a half-sent head 408 after --header-timeout-s, a connection
    that sends nothing is closed after it; meanwhile other clients are served."""
    before = scrape(server)
    stalled_body, stalled_head, idle = connect(server), connect(server), connect(server)
    stalled_body.sendall(head(length=1000) + b'{"text": "slo')
    stalled_head.sendall(b"POST /predict HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Le")
    assert request(server, "/predict", b'{"text": "not blocked"}')[0] == 200
    results = {name: read_until_closed(s, TIMEOUT_S + 30)
               for name, s in (("body", stalled_body), ("head", stalled_head), ("idle", idle))}
    for s in (stalled_body, stalled_head, idle):
        s.close()
    answer, seconds = results["body"]
    assert answer.startswith(b"HTTP/1.1 408 ") and b"--body-timeout-s" in answer and b"13 bytes came of 1,000" in answer
    assert TIMEOUT_S - 0.5 < seconds < TIMEOUT_S + 30, seconds
    answer, seconds = results["head"]
    assert answer.startswith(b"HTTP/1.1 408 ") and b"--header-timeout-s" in answer, answer
    assert results["idle"][0] == b""
    m = wait_for_metric(server, "bertrain_header_timeouts_total", metric(before, "bertrain_header_timeouts_total") + 2)
    assert (metric(m, "bertrain_requests_total", path="/predict", status="408")
            == metric(before, "bertrain_requests_total", path="/predict", status="408") + 1)
    no_traceback(server)


def test_connections_beyond_the_limit_get_503_until_the_idle_ones_time_out(server):
    """--max-connections idle connections are open: a request gets uvicorn's 503 (counted, one log line), and is
    served again once the header timeout has closed them."""
    before, t0 = scrape(server), time.monotonic()
    idle = [connect(server) for _ in range(MAX_CONNECTIONS)]
    try:
        status, _, _ = request(server, "/health")
        assert status == 503
        deadline = time.monotonic() + TIMEOUT_S + 30
        while (status := request(server, "/health")[0]) == 503:
            assert time.monotonic() < deadline, "the idle connections were never closed"
        assert status == 200
        assert all(read_until_closed(s, 30)[0] == b"" for s in idle)  # closed by the server, saying nothing
    finally:
        for s in idle:
            s.close()
    m = scrape(server)
    assert (metric(m, "bertrain_connection_limit_refusals_total")
            > metric(before, "bertrain_connection_limit_refusals_total"))
    refusals = [line for line in server.lines if "--max-connections" in line]
    assert refusals and "refused with 503" in refusals[0], server.lines
    assert len(refusals) <= 1 + (time.monotonic() - t0) / 10, refusals  # one line per 10 s, not one per request


# ----------------------------------------------------------------------------------------------- 6. API key

def test_only_requests_with_the_api_key_are_served(server):
    item = b'{"text": "The cat sat."}'
    status, headers, answer = request(server, "/predict", item, key=False)
    assert status == 401 and headers["WWW-Authenticate"] == 'Bearer realm="bertrain"'
    assert "needs an API key" in json.loads(answer)["error"]
    status, headers, answer = request(server, "/predict", item, key=False,
                                      headers={"Authorization": "Bearer " + KEY[:-1] + "X"})
    assert status == 401 and 'error="invalid_token"' in headers["WWW-Authenticate"]
    assert request(server, "/predict", item, key=False, headers={"Authorization": KEY})[0] == 401
    assert request(server, "/predict", item, key=False, headers={"Authorization": "bearer " + KEY})[0] == 200
    assert request(server, "/metrics", key=False)[0] == 401
    # a large body without the key: read and dropped, so urllib reads the 401
    assert request(server, "/predict", b"x" * (3 << 20), key=False)[0] == 401
    # /health stays open for load balancers, and tells them nothing more than that
    status, _, answer = request(server, "/health", key=False)
    assert status == 200 and json.loads(answer) == {"status": "ok"}
    assert json.loads(request(server, "/health")[2])["backend"] == "onnxruntime"


def test_serving_beyond_loopback_needs_a_key(deploy_models, capsys, caplog, monkeypatch, tmp_path):
    monkeypatch.delenv("BERTRAIN_API_KEY", raising=False)
    model = str(deploy_models["cls_onnx"])
    t0 = time.monotonic()
    assert main(["serve", model, "--backend", "onnxruntime", "--host", "0.0.0.0"]) == 2
    err = capsys.readouterr().err
    assert ("--host 0.0.0.0 lets anyone who can reach this port use the model, and no API key is set" in err
            and "BERTRAIN_API_KEY" in err and "--api-key-file" in err and "--allow-unauthenticated" in err), err
    assert time.monotonic() - t0 < 5  # refused before the model is loaded
    assert main(["serve", model, "--api-key", KEY]) == 2  # refused, not taken for --api-key-file: ps shows it
    err = capsys.readouterr().err
    assert "an API key is never read from the command line" in err and KEY not in err, err
    monkeypatch.setenv("BERTRAIN_API_KEY", "short")
    assert main(["serve", model, "--host", "0.0.0.0"]) == 2
    assert "holds a key of 5 characters: use at least 16" in capsys.readouterr().err
    key_file = tmp_path / "key"
    key_file.write_text(KEY + "\n")
    assert main(["serve", model, "--api-key-file", str(key_file)]) == 2
    assert "an API key is given twice" in capsys.readouterr().err
    monkeypatch.delenv("BERTRAIN_API_KEY")
    # past the checks (a key from a world-readable file, or --allow-unauthenticated), it fails only at the port,
    # taken here, so nothing listens beyond loopback during the test
    key_file.chmod(0o644)
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        port = str(taken.getsockname()[1])
        for extra in (["--api-key-file", str(key_file)], ["--allow-unauthenticated"]):
            code = main(["serve", model, "--backend", "onnxruntime", "--host", "0.0.0.0", "--port", port, *extra])
            captured = capsys.readouterr()
            assert code == 2 and f"cannot listen on 0.0.0.0:{port}" in captured.err, captured
            if extra[0] == "--api-key-file":
                assert "can be read by other users (mode -rw-r--r--): chmod 600" in caplog.text


# ----------------------------------------------------------------------------------------------- 7. metrics

def test_metrics_count_requests_latency_batches_and_name_the_model(server, mrpc):
    items, _ = mrpc
    status, headers, _ = request(server, "/metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain; version="), headers
    before = scrape(server)
    assert request(server, "/predict", json.dumps(items[0]).encode())[0] == 200
    assert request(server, "/predict", json.dumps(items[1:4]).encode())[0] == 200
    assert request(server, "/predict", b'{"txt": "a"}')[0] == 422
    m = scrape(server)

    def grew(name, **labels):
        return metric(m, name, **labels) - metric(before, name, **labels)

    assert grew("bertrain_requests_total", path="/predict", status="200") == 2
    assert grew("bertrain_requests_total", path="/predict", status="422") == 1
    assert grew("bertrain_request_duration_seconds_count", path="/predict", status="200") == 2
    assert grew("bertrain_request_duration_seconds_count", path="/predict", status="422") == 1
    assert grew("bertrain_request_duration_seconds_sum", path="/predict", status="200") > 0
    assert grew("bertrain_batch_items_sum") == 4 and grew("bertrain_batch_items_count") == 2
    assert grew("bertrain_batch_requests_count") == 2 and grew("bertrain_batch_duration_seconds_count") == 2
    assert metric(m, "bertrain_batch_items_bucket", le="4.0") - metric(before, "bertrain_batch_items_bucket",
                                                                       le="4.0") == 2
    assert metric(m, "bertrain_queue_items") == 0 and metric(m, "bertrain_queue_limit_items") == MAX_QUEUE
    assert metric(m, "bertrain_open_connections") >= 1 and metric(m, "process_resident_memory_bytes") > 50e6
    (info,) = [labels for (name, labels) in m if name == "bertrain_model_info"]
    info = dict(info)
    assert info["task"] == "classification" and info["backend"] == "onnxruntime" and info["auth"] == "api key"
    assert info["max_queue"] == str(MAX_QUEUE) and Path(info["model"]).name == "cls-onnx"
    assert KEY not in json.dumps(list(m))  # the key itself is never exposed
    # paths nobody serves are one series, however many a scanner tries
    for p in ("/admin", "/.env", "/wp-login.php"):
        assert request(server, p)[0] == 404
    assert not [k for k in scrape(server) if any(v in ("/admin", "/.env") for _, v in k[1])]
