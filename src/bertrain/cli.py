"""The `bertrain` command line: a thin dispatcher over `bertrain.commands.<name>`.

Each subcommand lives in its own module under `bertrain/commands/` and provides

    HELP: str                              # one line, shown in `bertrain --help`
    def add_arguments(parser) -> None      # fills its argparse sub-parser
    def run(args) -> int                   # does the work, returns the exit code

Modules are imported lazily, so `bertrain info` does not pay for importing the trainer.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import logging
import sys

# name -> one-line help. Order here is the order shown in --help. A command whose module is absent is not offered.
# The help lines live here (not only in the modules) so that `bertrain --help` and `bertrain info` import nothing
# heavy: only the chosen command's module is imported (torch costs ~2 s and ~150 MB to import).
COMMANDS = {
    "info": "show a model config (preset, HF folder or checkpoint): sizes, parameter counts",
    "convert": "import an HF/Google BERT folder into a clean bertrain model folder",
    "export": "export a bertrain checkpoint or model folder in HF format",
    "vocab": "train a WordPiece vocabulary on a corpus",
    "prepare": "turn raw corpora into a sharded token store and MLM+NSP samples",
    "inspect": "print samples and statistics of a prepared data folder",
    "pretrain": "pretrain BERT (MLM+NSP) on one process, torchrun, Slurm or mpirun",
    "finetune": "fine-tune on SQuAD v1.1/v2.0 or a GLUE task",
    "evaluate": "score predictions with the official SQuAD / GLUE metrics",
    "predict": "answer questions or classify sentences with a fine-tuned model",
    "bench": "measure training and inference speed (optionally against HF transformers)",
}


def _available() -> list[str]:
    return [c for c in COMMANDS if importlib.util.find_spec(f"bertrain.commands.{c}") is not None]


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser; only the sub-parser of the command named in `argv` is filled (its module imported)."""
    argv = sys.argv[1:] if argv is None else argv
    chosen = next((a for a in argv if not a.startswith("-")), None)
    parser = argparse.ArgumentParser(
        prog="bertrain",
        description="Train BERT end to end: vocab -> prepare -> pretrain -> finetune -> evaluate -> predict.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _available():
        if name == chosen:
            mod = importlib.import_module(f"bertrain.commands.{name}")
            p = sub.add_parser(name, help=mod.HELP, description=mod.HELP)
            mod.add_arguments(p)
            p.set_defaults(_module=mod)
        else:
            sub.add_parser(name, help=COMMANDS[name], add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return int(args._module.run(args) or 0)
    except ValueError as e:  # user input problems: one clear line, no traceback
        if args.verbose:
            raise
        print(f"bertrain {args.command}: error: {e}", file=sys.stderr)
        return 2
    except FileNotFoundError as e:
        if args.verbose:
            raise
        print(f"bertrain {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
