"""`bertrain serve MODEL`: an HTTP JSON API for a fine-tuned QA or classification model (`bertrain.deploy.server`).

MODEL is what `bertrain predict --model` takes: a fine-tuned model folder for `--backend torch`, the folder of
`bertrain export --format onnx` for `--backend onnxruntime`. Stop it with SIGTERM or Ctrl-C: requests in flight are
answered first, then it exits 0.
"""
from __future__ import annotations

import argparse
import logging

HELP = "serve a fine-tuned QA or classification model over HTTP (POST /predict, GET /health), micro-batched"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from dataclasses import asdict

    from bertrain.deploy.config import ServeConfig

    d = asdict(ServeConfig())
    parser.add_argument("model", metavar="MODEL", help="fine-tuned model folder (torch) or ONNX export folder "
                                                       "(onnxruntime)")
    parser.add_argument("--backend", choices=["torch", "onnxruntime"], default="torch",
                        help="what runs the model (onnxruntime: a folder from bertrain export --format onnx)")
    parser.add_argument("--task", choices=["qa", "classification"], default=None,
                        help="default: from the folder's task.json or config.json head")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    parser.add_argument("--host", default=d["host"], help="address to listen on (default: this machine only)")
    parser.add_argument("--port", type=int, default=d["port"], help="TCP port (0: a free one, printed on start)")
    parser.add_argument("--max-batch-size", type=int, default=d["max_batch_size"],
                        help="most items per micro-batch of concurrent requests")
    parser.add_argument("--max-wait-ms", type=float, default=d["max_wait_ms"],
                        help="how long a request waits for others to join its micro-batch")
    parser.add_argument("--max-request-bytes", type=int, default=d["max_request_bytes"],
                        help="largest request body; larger ones get 413")
    parser.add_argument("--max-seq-length", type=int, default=None, help="default: from task.json")


def run(args: argparse.Namespace) -> int:
    from bertrain.deploy.config import ServeConfig
    from bertrain.deploy.server import serve
    from bertrain.deploy.predict import Predictor
    from bertrain.utils import threads

    threads.apply_threads(logging.getLogger("bertrain"))
    cfg = ServeConfig(host=args.host, port=args.port, max_batch_size=args.max_batch_size,
                      max_wait_ms=args.max_wait_ms, max_request_bytes=args.max_request_bytes)
    predictor = Predictor(args.model, task=args.task, device=args.device, batch_size=cfg.max_batch_size,
                          max_seq_length=args.max_seq_length, backend=args.backend)
    serve(predictor, cfg, args.backend)
    return 0
