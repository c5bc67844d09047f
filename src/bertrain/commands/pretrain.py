"""`bertrain pretrain --config FILE [--section.key VALUE …] [--resume auto|PATH]`.

Runs as one process, or under torchrun / srun / mpirun unchanged (the launcher's environment decides the rank).
"""
from __future__ import annotations

import argparse
import logging

from bertrain.config import add_config_arguments, add_resume_argument, load_config, overrides_from_args

HELP = "pretrain BERT (MLM + NSP) on one or many processes; checkpoints, resume, metrics"

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from bertrain.tasks.pretraining import PretrainConfig
    parser.add_argument("--config", metavar="FILE", help="YAML/JSON recipe (e.g. configs/quickstart.yaml)")
    add_resume_argument(parser)
    add_config_arguments(parser, PretrainConfig)


def run(args: argparse.Namespace) -> int:
    from bertrain.tasks.pretraining import PretrainConfig, run_pretraining
    cfg = load_config(PretrainConfig, args.config, overrides_from_args(args))
    result = run_pretraining(cfg, resume=args.resume)
    if result.stopped_by_signal:
        log.warning("stopped by a signal at step %d; continue with --resume auto", result.state.step)
    return 0
