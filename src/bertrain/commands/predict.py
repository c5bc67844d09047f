"""`bertrain predict`: batched QA or classification predictions from a file, stdin or the command line.

Output is JSON lines (one object per input, in input order) on stdout or --output; throughput goes to stderr. A
SQuAD split (`--format squad`, the default for a QA model's .json, .parquet, .arrow or folder input: the SQuAD JSON
or the Hub's layouts; answers optional) gives the official
predictions.json instead ({question id: answer}, what evaluate-v1.1/v2.0.py and the SQuAD leaderboard read), and for
a v2.0 model its null odds (evaluate-v2.0.py's --na-prob-file) beside it.
An input without an "id" is numbered by its position among the inputs, from 0. `--output` is written atomically
once every input is predicted: an error or Ctrl-C leaves an existing file as it was.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys

HELP = "predict with a fine-tuned model: QA (question + context) or classification (text [+ pair])"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="fine-tuned model folder (e.g. OUTPUT/final)")
    parser.add_argument("--task", choices=["qa", "classification"], default=None,
                        help="default: from the folder's task.json or config.json head")
    parser.add_argument("--input", default=None,
                        help="JSONL or TSV file, '-' for stdin (QA: {question, context} / question<TAB>context; "
                             "classification: {text[, text_pair]} / text[<TAB>text_pair]); an item without an "
                             "\"id\" is numbered by its position, from 0; QA: or a SQuAD split (--format "
                             "squad): a .json file, the Hub's Parquet, a `datasets` .arrow file or folder")
    parser.add_argument("--format", choices=["jsonl", "tsv", "squad"], default=None,
                        help="input format (default: from the file suffix: .tsv/.txt tsv; for a QA model .json, "
                             ".parquet, .arrow or a folder squad; else, and for stdin, jsonl); "
                             "squad: a SQuAD v1.1/v2.0 file (answers optional) -> the official predictions.json "
                             "{question id: answer} (v2.0 models: and OUTPUT's .null_odds.json, evaluate-v2.0.py's "
                             "--na-prob-file)")
    parser.add_argument("--question", default=None, help="one QA question (with --context)")
    parser.add_argument("--context", default=None, help="the context of --question")
    parser.add_argument("--text", default=None, help="one text to classify")
    parser.add_argument("--text-pair", default=None, help="second text of the pair for --text")
    parser.add_argument("--output", default=None, help="write JSON lines here instead of stdout")
    parser.add_argument("--batch-size", type=int, default=32, help="examples per forward pass")
    parser.add_argument("--max-seq-length", type=int, default=None, help="default: from task.json")
    parser.add_argument("--null-score-diff-threshold", type=float, default=None,
                        help="SQuAD v2.0 models: answer '' when score(null) - score(best span) exceeds this "
                             "(default: task.json's, else 0.0)")
    parser.add_argument("--max-answer-length", type=int, default=None,
                        help="QA: longest answer in tokens (default: task.json's, the run's "
                             "data.max_answer_length, else 30)")
    parser.add_argument("--n-best-size", type=int, default=None,
                        help="QA: start and end candidates per window (default: task.json's, else 20)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    parser.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32",
                        help="torch backend: the precision the model runs in (bf16/fp16: the whole model cast, half "
                             "the memory; on a GPU, faster; fp16 on a CPU is slow)")
    parser.add_argument("--backend", choices=["torch", "onnxruntime"], default="torch",
                        help="what runs the model: torch (a model folder) or onnxruntime (a folder written by "
                             "bertrain export --format onnx; pip install \"bertrain[deploy]\"); the same "
                             "tokenisation and post-processing either way")


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from bertrain.deploy.predict import Predictor, batched, pair_mismatch, read_items
    from bertrain.utils.errors import UserError, writing
    from bertrain.utils.io import atomic_open

    if args.batch_size < 1:
        raise ValueError("--batch-size must be >= 1")
    p = Predictor(args.model, task=args.task, device=args.device, batch_size=args.batch_size,
                  max_seq_length=args.max_seq_length, backend=args.backend, dtype=args.dtype)
    for flag, value in (("--max-answer-length", args.max_answer_length), ("--n-best-size", args.n_best_size)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    kwargs = {"null_score_diff_threshold": args.null_score_diff_threshold, "max_answer_length": args.max_answer_length,
              "n_best_size": args.n_best_size} if p.task == "qa" else {}

    flags = {"--question": args.question, "--context": args.context, "--text": args.text,
             "--text-pair": args.text_pair}
    # any of them (--text-pair alone too: it was ignored, and stdin read instead, waiting on a terminal)
    if any(value is not None for value in flags.values()):
        if args.input is not None:
            raise ValueError("give either --input or --question/--context/--text, not both")
        _check_flags(flags)
        if p.task == "qa":
            if args.question is None or args.context is None:
                raise ValueError("a QA model needs both --question and --context")
            given = [flag for flag in ("--text", "--text-pair") if flags[flag] is not None]
            if given:  # a classifier's flags: they were ignored without a word
                raise ValueError(f"{' and '.join(given)}: a QA model reads --question and --context only")
            items_iter = iter([{"id": "0", "question": args.question, "context": args.context}])
        else:
            if args.text is None:
                raise ValueError("--text-pair is the second text of --text: give --text too" if args.text_pair
                                 is not None else "a classification model needs --text")
            item = {"id": "0", "text": args.text}
            if args.text_pair is not None:
                item["text_pair"] = args.text_pair
            if p.pair is not None and (args.text_pair is not None) != p.pair:
                raise ValueError(pair_mismatch(p.meta.get("task"), p.pair, flags=True))
            items_iter = iter([item])
        f = None
        name = "the command line"
    else:
        src = args.input or "-"
        fmt = args.format or _guess_format(src, p.task)
        if fmt == "squad":
            return _predict_squad(p, src, args, kwargs)
        # errors="surrogateescape": a byte that is not UTF-8 reaches read_items, which names its line and column
        if src == "-":
            f = sys.stdin
            if hasattr(sys.stdin, "buffer"):
                f = io.TextIOWrapper(sys.stdin.buffer, encoding="utf-8", errors="surrogateescape")
            name = "<stdin>"
        else:
            if not Path(src).is_file():
                raise ValueError(f"input file {src} does not exist")
            f = open(src, encoding="utf-8", errors="surrogateescape")
            name = src
        items_iter = read_items(f, name, fmt, p.task, pair=p.pair, task_name=p.meta.get("task"))

    count = 0
    doing = f"writing the predictions to {args.output}"
    kept = f"{args.output} is unchanged" if args.output is not None and Path(args.output).exists() else None

    def predict_to(out) -> None:
        nonlocal count
        # Read in chunks of several batches so stdin streams and a large file never sits in memory at once; the
        # lines go out as they come (--output: into its temporary, renamed over it at the end), so memory stays
        # flat whatever the input's length (every line was kept to the end: ~0.6 KB per input, GBs at 5M inputs).
        for chunk in batched(items_iter, args.batch_size * 8):
            count += len(chunk)
            lines = [json.dumps(rec, ensure_ascii=False) for rec in p.predict(chunk, **kwargs)]
            if args.output is None:
                for line in lines:
                    print(line, file=out, flush=True)
            else:
                with writing(doing, kept=kept):  # (only the writes: an error reading the input is not one)
                    out.write("".join(x + "\n" for x in lines))
                    out.flush()  # (to the temporary: held in memory, a chunk's lines at most)
        if count == 0:
            raise UserError(f"{name} holds no items (it is empty or has only blank lines): nothing to predict"
                            + (f"; {args.output} was not written" if args.output else ""))

    try:
        if args.output is None:
            predict_to(sys.stdout)
        else:
            with contextlib.ExitStack() as stack:
                with writing(doing, kept=kept):
                    out = stack.enter_context(atomic_open(args.output, "w", encoding="utf-8", newline=""))
                predict_to(out)
                with writing(doing, kept=kept):  # the flush, fsync and rename over --output
                    stack.close()
    finally:
        if f is not None and f is not sys.stdin:
            if name == "<stdin>":
                f.detach()  # our wrapper must not close the process's stdin when it is collected
            else:
                f.close()
    tp = p.throughput
    print(f"bertrain predict: {tp.examples} examples in {tp.seconds:.2f} s ({tp.per_second:.1f} examples/s, "
          f"batch size {args.batch_size}, {p.task}, {args.backend} {args.dtype})", file=sys.stderr)
    if tp.truncated:
        print(f"bertrain predict: {tp.truncated} of {tp.examples} inputs were longer than {p.max_seq_length} tokens: "
              f"the model read their first {p.max_seq_length} (pairs: cut longest first, as in fine-tuning); "
              "--max-seq-length sets it, up to the model's positions", file=sys.stderr)
    return 0


def _predict_squad(p, src: str, args: argparse.Namespace, kwargs: dict) -> int:
    """--format squad: every question of a SQuAD file -> the official predictions.json (and null odds)."""
    from pathlib import Path

    from bertrain.deploy.predict import batched, read_squad_items
    from bertrain.utils.errors import writing
    from bertrain.utils.io import atomic_write_json

    if p.task != "qa":
        raise ValueError(f"--format squad: {args.model} is a {p.task} model; a SQuAD file needs a QA model")
    if src == "-" or not Path(src).exists():
        raise ValueError(f"--format squad: input file {src} does not exist (a SQuAD file is read whole: not stdin)")
    try:
        items = read_squad_items(src)
    except ValueError as e:
        if not _json_lines(src, str(e)):
            raise
        raise ValueError(f"{e} (JSON lines, one item per line? pass --format jsonl)") from None
    if not items:
        raise ValueError(f"{src} holds no questions: nothing to predict")
    preds: dict[str, str] = {}
    null_odds: dict[str, float] = {}
    for chunk in batched(iter(items), args.batch_size * 8):
        for rec in p.predict(chunk, **kwargs):
            preds[rec["id"]] = rec["answer"]
            if "null_score_diff" in rec:
                null_odds[rec["id"]] = rec["null_score_diff"]
    if args.output is None:
        print(json.dumps(preds, ensure_ascii=False, indent=2))
        if null_odds:
            print("bertrain predict: give --output to write the null odds too (evaluate-v2.0.py's --na-prob-file)",
                  file=sys.stderr)
    else:
        out = Path(args.output)
        odds = out.with_name(out.name.removesuffix(".json") + ".null_odds.json")
        with writing(f"writing the predictions to {out}", kept=f"{out} is unchanged" if out.exists() else None):
            atomic_write_json(out, preds)
            if null_odds:
                atomic_write_json(odds, null_odds)
        score = (f" (score them: bertrain evaluate squad --data {src} --predictions {out}"
                 + (f" --na-prob-file {odds})" if null_odds else ")")) if _has_answers(src) else ""
        print(f"bertrain predict: {len(preds)} answers -> {out}" + (f", null odds -> {odds}" if null_odds else "")
              + score, file=sys.stderr)
    tp = p.throughput
    print(f"bertrain predict: {tp.examples} questions in {tp.seconds:.2f} s ({tp.per_second:.1f} examples/s, "
          f"batch size {args.batch_size}, {args.backend} {args.dtype})", file=sys.stderr)
    return 0


SQUAD_SUFFIXES = (".json", ".parquet", ".arrow")
"""A QA model's input of these suffixes (or a folder) is a SQuAD split, in any layout `read_squad_items` reads: the
SQuAD JSON, the Hub's Parquet (rajpurkar/squad), a `datasets` Arrow file or folder. Guessed as JSON lines, a
Parquet file was refused as "not UTF-8 text"."""


def _has_answers(src: str) -> bool:
    """Whether the SQuAD file `src` can score predictions: a hidden test set (no answers) made the printed
    `evaluate squad` command fail ("'answers' must be a list")."""
    from bertrain.tasks.squad import load_dataset_json

    try:
        load_dataset_json(src)
    except (ValueError, OSError):
        return False
    return True


def _guess_format(src: str, task: str) -> str:
    """--format's default for the input `src` ('-': stdin) of a `task` model."""
    from pathlib import Path

    if src.endswith((".tsv", ".txt")):
        return "tsv"
    squad = src.lower().endswith(SQUAD_SUFFIXES) or (src != "-" and Path(src).is_dir())
    if squad and task != "qa" and not src.lower().endswith(".json"):  # read as JSON lines: "not UTF-8 … iconv"
        raise ValueError(f"{src}: a {task} model reads JSON lines ({{text[, text_pair]}} per line) or TSV "
                         "(text[<TAB>text_pair]); a Parquet or Arrow file or a datasets folder is read for QA "
                         "models only: write its rows as JSON lines first")
    return "squad" if squad and task == "qa" else "jsonl"


def _json_lines(src: str, error: str) -> bool:
    """Whether `error`, from reading `src` as a SQuAD JSON file, says it is JSON lines instead: several values
    ("Extra data" after the first line), or one object that is not a SQuAD file (a single QA item)."""
    if not src.lower().endswith(".json"):
        return False
    return ("malformed JSON" in error and "Extra data" in error) or "not a SQuAD file" in error


def _check_flags(flags: dict[str, str | None]) -> None:
    """The command line's texts: UTF-8 and not blank, each error naming its flag (an empty --text was
    "item 0: empty or missing 'text'", naming neither the flag nor the command line)."""
    for flag, value in flags.items():
        if value is None:
            continue
        bad = next((i for i, ch in enumerate(value) if "\udc80" <= ch <= "\udcff"), None)
        if bad is not None:  # a byte that is not UTF-8 (Python keeps it as a lone surrogate): no text
            raise ValueError(f"{flag}: not UTF-8 text (byte 0x{ord(value[bad]) - 0xdc00:02x} at character "
                             f"{bad + 1}): give it as UTF-8 (e.g. convert with iconv -f latin1 -t utf-8)")
        if not value.strip():
            raise ValueError(f"{flag} is empty: give the text itself")
