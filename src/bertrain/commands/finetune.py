"""`bertrain finetune {squad,glue}`: fine-tune a BERT model and evaluate it with the official metrics.

Every config key can come from `--config FILE.yaml` and be overridden by `--section.key VALUE`; the short flags
(--train, --dev, --init, --output, --task, --data-dir, ...) are aliases for the most used keys.
Launch distributed runs with torchrun (or srun / mpirun): `torchrun --nproc-per-node 2 -m bertrain finetune ...`.
"""
from __future__ import annotations

import argparse
import json

HELP = "fine-tune on SQuAD v1.1/v2.0 or a GLUE task (distributed, mixed precision, resumable)"

# short flag -> (dotted config key, help)
_SQUAD_FLAGS = {
    "--train": ("data.train_file", "SQuAD JSON to train on"),
    "--dev": ("data.dev_file", "SQuAD JSON to evaluate on"),
}
_GLUE_FLAGS = {
    "--task": ("data.task", "cola, sst2, mrpc, stsb, qqp, mnli, qnli, rte or wnli"),
    "--data-dir": ("data.data_dir", "the task's GLUE folder (train.tsv, dev.tsv, test.tsv; or the Hub's Parquet "
                                    "files, or a `datasets` save_to_disk folder)"),
}
_COMMON_FLAGS = {
    "--output": ("output_dir", "output folder"),
}  # --init is a config key itself


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from bertrain.config import add_config_arguments
    from bertrain.train.resume import add_run_arguments
    from bertrain.tasks.finetune import GlueFinetuneConfig, SquadFinetuneConfig

    sub = parser.add_subparsers(dest="ft_task", metavar="TASK", required=True)
    for name, cls, flags in (("squad", SquadFinetuneConfig, _SQUAD_FLAGS), ("glue", GlueFinetuneConfig, _GLUE_FLAGS)):
        p = sub.add_parser(name, help=f"fine-tune on {name.upper()}",
                           description=(cls.__doc__ or "").split("\n")[0] or None)
        p.add_argument("--config", default=None, help="YAML/JSON config file (keys as below)")
        add_run_arguments(p)
        for flag, (key, help_) in {**flags, **_COMMON_FLAGS}.items():
            p.add_argument(flag, dest=f"short:{key}", default=None, metavar=flag.lstrip("-").upper().replace("-", "_"),
                           help=f"{help_} (= --{key})")
        if name == "squad":
            p.add_argument("--version-2-with-negative", dest="short:data.version_2_with_negative",
                           action="store_const", const="true", default=None,
                           help="SQuAD v2.0 (unanswerable questions) (= --data.version_2_with_negative true)")
        add_config_arguments(p, cls)


def _overrides(args: argparse.Namespace) -> dict[str, str]:
    from bertrain.config import overrides_from_args

    out = {k[6:]: v for k, v in vars(args).items() if k.startswith("short:") and v is not None}
    for key, value in overrides_from_args(args).items():
        if key in out and out[key] != value:
            raise ValueError(f"config key '{key}' given twice with different values ({out[key]!r}, {value!r})")
        out[key] = value
    return out


def run(args: argparse.Namespace) -> int:
    from bertrain.config import load_config
    from bertrain.tasks.finetune import GlueFinetuneConfig, SquadFinetuneConfig, run_glue, run_squad

    from bertrain.train.resume import resume_on_restart

    resume, overwrite = resume_on_restart(args.resume, args.overwrite)
    if args.ft_task == "squad":
        cfg = load_config(SquadFinetuneConfig, args.config, _overrides(args))
        results = run_squad(cfg, resume=resume, overwrite=overwrite, allow_config_change=args.allow_config_change)
    else:
        cfg = load_config(GlueFinetuneConfig, args.config, _overrides(args))
        results = run_glue(cfg, resume=resume, overwrite=overwrite, allow_config_change=args.allow_config_change)
    if results:  # only rank 0 returns results
        print(json.dumps(results, indent=2))
    return 0
