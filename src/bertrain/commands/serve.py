"""`bertrain serve MODEL`: an HTTP JSON API for a fine-tuned QA or classification model (`bertrain.deploy.server`).

MODEL is what `bertrain predict --model` takes: a fine-tuned model folder for `--backend torch`, the folder of
`bertrain export --format onnx` for `--backend onnxruntime`. Stop it with SIGTERM or Ctrl-C: requests in flight are
answered first, then it exits 0.

The API key comes from the environment variable BERTRAIN_API_KEY or from `--api-key-file FILE`, never from a flag
(the command line is visible to every user through `ps`). A --host other than loopback needs one, or
--allow-unauthenticated.
"""
from __future__ import annotations

import argparse
import logging

HELP = ("serve a fine-tuned QA or classification model over HTTP (POST /predict, GET /health, GET /metrics), "
        "micro-batched")


SERVE_FLAGS = {
    "host": "address to listen on (default: this machine only; any other needs an API key)",
    "port": "TCP port (0: a free one, printed on start)",
    "max_batch_size": "most items per micro-batch of concurrent requests",
    "max_wait_ms": "how long a request waits for others to join its micro-batch",
    "max_request_bytes": "largest request body; larger ones get 413",
    "max_queue": "most items waiting for the model; a request beyond gets 503 with Retry-After at once",
    "max_connections": "most open connections; a request on one beyond gets 503",
    "header_timeout_s": "time to send a complete request head (then 408, closed)",
    "body_timeout_s": "time to send a whole request body once its head has come (then 408, closed)",
}
"""The flags that are `ServeConfig` fields, with their help."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from dataclasses import asdict

    from bertrain.deploy.config import API_KEY_ENV, ServeConfig

    d = asdict(ServeConfig())
    parser.add_argument("model", metavar="MODEL", help="fine-tuned model folder (torch) or ONNX export folder "
                                                       "(onnxruntime)")
    parser.add_argument("--backend", choices=["torch", "onnxruntime"], default="torch",
                        help="what runs the model (onnxruntime: a folder from bertrain export --format onnx)")
    parser.add_argument("--task", choices=["qa", "classification"], default=None,
                        help="default: from the folder's task.json or config.json head")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    parser.add_argument("--max-seq-length", type=int, default=None, help="default: from task.json")
    parser.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32",
                        help="torch backend: the precision the model runs in (bf16/fp16: the whole model cast, half "
                             "the memory; on a GPU, faster; fp16 on a CPU is slow)")
    for name, text in SERVE_FLAGS.items():  # type and default from ServeConfig's field of the same name
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(d[name]), default=d[name], help=text)
    parser.add_argument("--api-key-file", default=None, metavar="FILE",
                        help=f"a file holding the API key that requests must send as 'Authorization: Bearer KEY' "
                             f"(or set {API_KEY_ENV}; never on the command line, which ps shows)")
    # Declared only to be refused (see run): else argparse would take `--api-key KEY` as an abbreviation of
    # --api-key-file, and the key would be on the command line for every user's `ps` to see.
    parser.add_argument("--api-key", dest="api_key_on_command_line", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--allow-unauthenticated", action="store_true",
                        help="serve on a --host other than loopback without an API key (a network you trust)")


def run(args: argparse.Namespace) -> int:
    from bertrain.deploy.config import API_KEY_ENV, ServeConfig, read_api_key
    from bertrain.utils.errors import UserError

    log = logging.getLogger("bertrain")
    if args.api_key_on_command_line is not None:
        raise UserError(f"--api-key: an API key is never read from the command line (every user's ps shows it): "
                        f"put it in the environment variable {API_KEY_ENV} or in a file for --api-key-file, and "
                        "make a new one, since this one has been shown")
    key, source, warning = read_api_key(args.api_key_file)
    cfg = ServeConfig(**{name: getattr(args, name) for name in SERVE_FLAGS},
                      allow_unauthenticated=args.allow_unauthenticated, api_key=key, api_key_source=source)
    if warning:
        log.warning(warning)
    # checked before the model is loaded: a refused configuration costs nothing
    from bertrain.deploy.predict import Predictor
    from bertrain.deploy.server import serve
    from bertrain.utils import threads

    threads.apply_threads(log)
    predictor = Predictor(args.model, task=args.task, device=args.device, batch_size=cfg.max_batch_size,
                          max_seq_length=args.max_seq_length, backend=args.backend, dtype=args.dtype)
    serve(predictor, cfg, args.backend)
    return 0
