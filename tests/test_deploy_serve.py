"""`bertrain serve`: the micro-batcher (asyncio, a fake model), the HTTP API in-process on the real MiniLM (4xx that
name the field, 413, one item or a list, ids), and real servers in subprocesses on 127.0.0.1: a short load test whose
every answer is checked against offline predictions (ONNX Runtime backend), and SIGTERM with requests in flight."""
from __future__ import annotations

import asyncio
import json
import signal
import socket
import sys
import threading
import time

import pytest

import deploy_fixtures
from bertrain.cli import main
from conftest import shared_file

pytest.importorskip("fastapi", reason="needs the deploy extra: pip install 'bertrain[deploy]'")
pytest.importorskip("httpx", reason="needs the deploy extra: pip install 'bertrain[deploy]'")

deploy_models = deploy_fixtures.deploy_models  # the session fixture: MiniLM + seeded heads, and their ONNX exports


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
    """Six requests wait in a micro-batch (max wait 3 s) when the server gets SIGTERM: all six are answered, with
    the offline predictions, and the server exits 0."""
    import httpx

    from bertrain.deploy.loadtest import mrpc_items, running_server, same_prediction
    from bertrain.deploy.predict import Predictor

    items = mrpc_items(shared_file("glue/MRPC/dev.tsv"), limit=6)
    expected = Predictor(deploy_models["cls"]).predict(items)
    answers: dict[int, httpx.Response | Exception] = {}
    with running_server(deploy_models["cls"], "--max-wait-ms", "3000") as server:
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
        server.proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(60)
        assert server.proc.wait(60) == 0
    for i, r in sorted(answers.items()):
        assert isinstance(r, httpx.Response) and r.status_code == 200, r
        assert same_prediction(r.json(), expected[i])
    assert len(answers) == len(items)
    assert any("served 6 requests (6 items) in 1 batches" in line for line in server.lines), server.lines
