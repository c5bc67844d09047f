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

# Order here is the order shown in --help; a command whose module is absent is not offered.
COMMANDS = [
    "info", "convert", "export", "vocab", "prepare", "inspect", "pretrain",
    "finetune", "evaluate", "predict", "bench",
]


def _available() -> list[str]:
    return [c for c in COMMANDS if importlib.util.find_spec(f"bertrain.commands.{c}") is not None]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="bertrain",
        description="Train BERT end to end: vocab -> prepare -> pretrain -> finetune -> evaluate -> predict.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _available():
        mod = importlib.import_module(f"bertrain.commands.{name}")
        p = sub.add_parser(name, help=mod.HELP, description=mod.HELP)
        mod.add_arguments(p)
        p.set_defaults(_module=mod)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
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
