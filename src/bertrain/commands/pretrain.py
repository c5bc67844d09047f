"""`bertrain pretrain --config FILE [--section.key VALUE …] [--resume auto|PATH]`.

Runs as one process, or under torchrun / srun / mpirun unchanged (the launcher's environment decides the rank).
"""
from __future__ import annotations

import argparse
import logging

from bertrain.config import add_config_arguments, load_config, overrides_from_args

HELP = "pretrain BERT (MLM + NSP) on one or many processes; checkpoints, resume, metrics"

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from bertrain.tasks.pretraining import PretrainConfig
    from bertrain.train.resume import add_run_arguments
    parser.add_argument("--config", metavar="FILE", help="YAML/JSON recipe (e.g. configs/quickstart.yaml)")
    add_run_arguments(parser)
    add_config_arguments(parser, PretrainConfig)


def run(args: argparse.Namespace) -> int:
    from bertrain.tasks.pretraining import PretrainConfig, run_pretraining
    cfg = load_config(PretrainConfig, args.config, overrides_from_args(args))
    from bertrain.utils.errors import RunStopped
    from bertrain.train.resume import resume_on_restart
    resume, overwrite = resume_on_restart(args.resume, args.overwrite)
    result = run_pretraining(cfg, resume=resume, overwrite=overwrite, allow_config_change=args.allow_config_change)
    if result.stopped_by_signal:
        step = result.state.step
        raise RunStopped(f"stopped by a signal at step {step} after saving {cfg.output_dir}/step-{step}; continue "
                         "with the same command and --resume auto", checkpoint=result.output_dir / f"step-{step}")
    return 0
