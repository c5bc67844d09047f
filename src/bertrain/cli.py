"""The `bertrain` command line: a thin dispatcher over `bertrain.commands.<name>`.

Each subcommand lives in its own module under `bertrain/commands/` and provides

    HELP: str                              # one line, shown in `bertrain --help`
    def add_arguments(parser) -> None      # fills its argparse sub-parser
    def run(args) -> int                   # does the work, returns the exit code

Modules are imported lazily, so `bertrain info` does not pay for importing the trainer.

`main` ends every command with a documented exit code (README "Exit codes", `bertrain.utils.errors`): 0 finished;
1 an unexpected error (traceback); 2 a user error — bad input or config, an unknown option or config key, an
`OSError` the user can cause (full disk, permission, read-only or missing path) — in one line; 3 stopped (a signal,
Ctrl-C, the watchdog), resumable. `--debug` adds the traceback to 2 and 3.
"""
from __future__ import annotations

import argparse
import difflib
import importlib
import importlib.util
import logging
import os
import re
import signal
import sys
import threading
import traceback
from typing import Any

from bertrain.config import suggest_keys, unknown_key_message
from bertrain.utils import threads
from bertrain.utils.errors import (EXIT_FAILED, EXIT_OK, EXIT_STOPPED, EXIT_USER_ERROR, RunStopped,
                                   describe_os_error, is_user_os_error)

log = logging.getLogger("bertrain")

# name -> one-line help. Order here is the order shown in --help. A command whose module is absent is not offered.
# The help lines live here (not only in the modules) so that `bertrain --help` and `bertrain info` import nothing
# heavy: only the chosen command's module is imported (importing torch takes seconds and much memory).
COMMANDS = {
    "run": "run a recipe end to end: vocab, prepare, pretrain phase 1/2, fine-tune, evaluate, report (resumable)",
    "info": "show a model config (preset, model folder or checkpoint): sizes, parameter counts; a run folder's state",
    "convert": "import an HF, Google TF or NVIDIA BERT checkpoint into a clean bertrain model folder",
    "export": "export a bertrain checkpoint or model folder in HF format, or as ONNX",
    "vocab": "train a WordPiece vocabulary on a corpus",
    "prepare": "turn raw corpora into a sharded token store and MLM+NSP samples",
    "inspect": "print samples and statistics of a prepared data folder",
    "pretrain": "pretrain BERT (MLM+NSP) on one process, torchrun, Slurm or mpirun",
    "finetune": "fine-tune on SQuAD v1.1/v2.0 or a GLUE task",
    "evaluate": "score SQuAD predictions with the official v1.1/v2.0 metrics (GLUE: finetune glue scores it)",
    "predict": "answer questions or classify sentences with a fine-tuned model",
    "serve": "serve a fine-tuned QA or classification model over HTTP (micro-batched; torch or onnxruntime)",
    "bench": "measure training and inference speed (optionally against HF transformers)",
}

# Commands whose PyTorch work runs on CPU threads chosen from the usable CPUs and the load (bertrain.utils.threads).
# `bench` keeps its own --threads; the others compute nothing worth threading.
THREADED = ("run", "pretrain", "finetune", "predict", "evaluate")


def _available() -> list[str]:
    return [c for c in COMMANDS if importlib.util.find_spec(f"bertrain.commands.{c}") is not None]


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser; only the sub-parser of the command named in `argv` is filled (its module imported)."""
    argv = sys.argv[1:] if argv is None else argv
    chosen = next((a for a in argv if not a.startswith("-")), None)
    parser = argparse.ArgumentParser(
        prog="bertrain",
        description="Train BERT end to end: vocab -> prepare -> pretrain -> finetune -> evaluate -> predict.",
        epilog="exit codes: 0 finished, 1 unexpected error (a bug; traceback), 2 user error (bad input, config, "
               "option or output folder; full disk; permissions; one line), 3 stopped early, resumable with "
               "--resume auto (a signal, Ctrl-C, the watchdog).",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("--debug", action="store_true",
                        help="also print the traceback of a user error (exit 2) or a stop (exit 3)")
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


def _leaf_parser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The (sub-)sub-parser that parsed the command's own options, e.g. the one of `bertrain finetune glue`."""
    while True:
        sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
        name = getattr(args, sub.dest, None) if sub is not None else None
        if name is None or name not in sub.choices:
            return parser
        parser = sub.choices[name]


def _unknown_arguments(leaf: argparse.ArgumentParser, extras: list[str]) -> str:
    """One line for arguments nobody declared: a config key gets "did you mean", another option a close option."""
    config_keys = [a.dest[4:] for a in leaf._actions if a.dest.startswith("cfg:")]
    options = [o for a in leaf._actions for o in a.option_strings if o.startswith("--")]
    flags = [e.split("=", 1)[0] for e in extras if e.startswith("--")]
    if not flags:
        return f"unrecognized arguments: {' '.join(extras)}"
    problems = []
    for flag in flags:
        key = flag[2:]
        close = difflib.get_close_matches(flag, options, n=1, cutoff=0.75)
        if config_keys and ("." in key or (not close and suggest_keys(key, config_keys))):
            problems.append(unknown_key_message(key, config_keys))
        else:
            problems.append(f"unrecognized argument {flag}" + (f" — did you mean {close[0]}?" if close else ""))
    return "; ".join(problems)


def _describe_stop(e: RunStopped) -> str:
    text = str(e) or "stopped"
    if e.checkpoint is not None and str(e.checkpoint) not in text:
        text += f"; the last checkpoint is {e.checkpoint} (continue with --resume auto)"
    return text


_NEGATIVE_NUMBER = re.compile(r"-(\d+\.?\d*|\.\d+)(e[-+]?\d+)?", re.IGNORECASE)


def join_negative_values(argv: list[str]) -> list[str]:
    """`--optim.lr -1e-3` -> `--optim.lr=-1e-3`: argparse takes a value that starts with '-' for an option unless it
    looks like a plain negative number (-3, -0.5), so exponents would otherwise fail with "expected one argument"
    and the value's own check (e.g. "lr must be > 0") would never be reached."""
    out: list[str] = []
    for token in argv:
        if out and out[-1].startswith("--") and "=" not in out[-1] and _NEGATIVE_NUMBER.fullmatch(token):
            out[-1] = f"{out[-1]}={token}"
        else:
            out.append(token)
    return out


def main(argv: list[str] | None = None) -> int:
    """Run one `bertrain` command; returns its exit code (see the module docstring). A usage error (an unknown
    option or config key, a missing argument) raises SystemExit(2) as argparse does."""
    argv = join_negative_values(sys.argv[1:] if argv is None else list(argv))
    debug = "--debug" in argv  # known before parsing, so even an interrupted import is reported as asked
    try:
        parser = build_parser(argv)
        args, extras = parser.parse_known_args(argv)
    except KeyboardInterrupt:
        if debug:
            traceback.print_exc()
        print("bertrain: interrupted", file=sys.stderr)
        return EXIT_STOPPED
    if extras:
        leaf = _leaf_parser(parser, args)
        print(f"{leaf.prog}: error: {_unknown_arguments(leaf, extras)} (see {leaf.prog} --help)", file=sys.stderr)
        raise SystemExit(EXIT_USER_ERROR)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    if args.command is None:
        parser.print_help()
        return EXIT_USER_ERROR
    name = f"bertrain {args.command}"
    debug = args.debug

    def fail(code: int, message: str) -> int:
        if debug:
            traceback.print_exc()
        print(f"{name}: {message}", file=sys.stderr)
        return code

    previous = _terminate_as_interrupt(args.command)
    try:
        if args.command in THREADED:
            threads.apply_threads(log)
        return int(args._module.run(args) or 0)
    except RunStopped as e:
        return fail(EXIT_STOPPED, f"stopped: {_describe_stop(e)}")
    except KeyboardInterrupt as e:
        resume = " (a training run continues from its last checkpoint with --resume auto)" if args.command in (
            "pretrain", "finetune") else " (run the same command again: finished stages are skipped, the cut one " \
            "resumes)" if args.command == "run" else ""
        return fail(EXIT_STOPPED, f"{'stopped by SIGTERM' if isinstance(e, Terminated) else 'interrupted'}{resume}")
    except BrokenPipeError:
        # The reader of our output went away (`bertrain predict ... | head`): not an error of ours. Python would
        # complain again when it flushes stdout at exit; point stdout at /dev/null first.
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        return EXIT_OK
    except ValueError as e:  # user input problems (UserError, OutputError, config errors): one clear line
        return fail(EXIT_USER_ERROR, f"error: {e}")
    except Exception as e:
        code = getattr(e, "exit_code", None)
        if isinstance(code, int):  # a failure that explains itself in one line (the watchdog's RankLost)
            return fail(code, f"error: {e}")
        if is_user_os_error(e):  # a full disk, a permission, a read-only or missing path: one line
            return fail(EXIT_USER_ERROR, describe_os_error(e, "error"))
        traceback.print_exc()  # a bug (or an OSError nobody can fix from here): where it happened matters
        print(f"{name}: unexpected error ({type(e).__name__}: {e}); the traceback above says where "
              "(please report it)", file=sys.stderr)
        return EXIT_FAILED
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def entry() -> None:
    """The `bertrain` command, as a console script and as `python -m bertrain` (so also under torchrun, srun and
    mpirun): `main()`, then the exit.

    A process that joined a process group ends without the interpreter's teardown: gloo's and the store's C++
    threads are destroyed there in no fixed order, which intermittently aborts an otherwise finished run
    ("terminate called without an active exception", exit -6), and a failed run's objects are kept for the exit
    on purpose (`train.distributed.keep_until_exit`). Every output is already written and closed (atomic writes,
    the group destroyed by `distributed_context`); only the streams need flushing."""
    code = main()
    if "torch.distributed" in sys.modules:
        import torch.distributed as torch_dist

        if torch_dist.is_available() and getattr(torch_dist, "_bertrain_joined", False):
            logging.shutdown()
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except (OSError, ValueError):  # a closed pipe: nothing more can be said
                    pass
            os._exit(code or 0)
    sys.exit(code)


class Terminated(KeyboardInterrupt):
    """SIGTERM outside a training loop (whose own handler saves a checkpoint first): stop as Ctrl-C does."""


def _terminate_as_interrupt(command: str) -> Any:
    """Outside the training loops, SIGTERM (a scheduler's stop, `kill`) ends the command like Ctrl-C: one line and
    exit 3, not a silent 143 between two pipeline stages. Not for `serve` (uvicorn drains on SIGTERM and re-raises
    it after), nor where the handler is not the default; a forked worker (prepare's pool) dies as before.
    Returns the handler to restore, None when none was installed."""
    if command == "serve" or threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return None
    pid = os.getpid()

    def handle(signum: int, frame: Any) -> None:
        if os.getpid() != pid:  # a forked child inherited this handler: die of the signal, as it would have
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        raise Terminated()

    return signal.signal(signal.SIGTERM, handle)


if __name__ == "__main__":
    sys.exit(main())
