"""`bertrain evaluate squad`: the official SQuAD v1.1 / v2.0 numbers for any predictions file, as JSON.

(SQuAD only: GLUE dev sets are scored by `bertrain finetune glue`, which writes eval_results.json.)"""
from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

log = logging.getLogger(__name__)

HELP = "score SQuAD predictions with the official v1.1/v2.0 evaluation (prints JSON; GLUE: finetune glue scores it)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="eval_task", metavar="TASK", required=True)
    p = sub.add_parser("squad", help="official evaluate-v1.1.py / evaluate-v2.0.py numbers",
                       description="Prints evaluate-v1.1.py's {exact_match, f1} for v1.1 data, or evaluate-v2.0.py's "
                                   "dict (exact, f1, total, HasAns_*, NoAns_*, best_* with --na-prob-file) for v2.0.")
    p.add_argument("--data", required=True, help="SQuAD JSON file with the gold answers")
    p.add_argument("--predictions", required=True, help="JSON object {question id: answer text}")
    p.add_argument("--na-prob-file", default=None,
                   help="v2.0: JSON {question id: no-answer score}, e.g. null_odds.json (enables best_* thresholds)")
    p.add_argument("--na-prob-thresh", type=float, default=1.0,
                   help="v2.0: predict no answer when the na-prob exceeds this (default 1.0, as the official script)")
    p.add_argument("--version", choices=["1.1", "2.0"], default=None,
                   help="which official script to follow (default: from the data file)")
    p.add_argument("--output", default=None, help="also write the JSON here")


def _read_json_object(path: str, what: str) -> dict:
    from bertrain.tasks.squad import load_json

    data = load_json(Path(path))
    if not isinstance(data, dict):
        raise ValueError(f"{path}: the {what} file must be a JSON object {{question id: ...}}")
    return data


def _shorten(text: str, limit: int = 80) -> str:
    """A value quoted in a one-line error: a whole article (36 KB) was printed."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text):,} characters)"


def run(args: argparse.Namespace) -> int:
    from bertrain.tasks.metrics import evaluate_squad, is_squad_v2
    from bertrain.tasks.squad import load_dataset_json
    from bertrain.utils.errors import writing
    from bertrain.utils.io import atomic_write_json

    dataset = load_dataset_json(args.data)
    preds = _read_json_object(args.predictions, "predictions")
    if "data" in preds and not isinstance(preds["data"], str):  # the arguments swapped: one line, not the file
        raise ValueError(f"{args.predictions} is a SQuAD data file, not predictions: --predictions takes the "
                         "{question id: answer text} file that finetune squad or predict writes (predictions.json)")
    for qid, text in preds.items():
        if not isinstance(text, str):
            raise ValueError(f"{args.predictions}: prediction for question id {qid} is not a string: "
                             f"{_shorten(repr(text))}")
    na_probs = None
    if args.na_prob_file:
        na_probs = _read_json_object(args.na_prob_file, "na-prob")
        for qid, v in na_probs.items():
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ValueError(f"{args.na_prob_file}: value for question id {qid} is not a number: "
                                 f"{_shorten(repr(v))}")
    qids = {qa["id"] for article in dataset.get("data", []) for p in article.get("paragraphs", [])
            for qa in p.get("qas", [])}
    strangers = [qid for qid in preds if qid not in qids]
    if strangers:  # the official scripts ignore them silently; usually the wrong data file or a wrong split
        log.warning("%d of %d predictions are for question ids not in %s (ignored), e.g. %s", len(strangers),
                    len(preds), args.data, ", ".join(strangers[:3]) + (", ..." if len(strangers) > 3 else ""))
    version = args.version or ("2.0" if is_squad_v2(dataset) else "1.1")
    if na_probs is not None and version == "1.1":  # evaluate-v1.1.py has no such file: said, not ignored silently
        log.warning("%s is scored as SQuAD v1.1 (no unanswerable questions): --na-prob-file %s is not used (give "
                    "--version 2.0 to score it as v2.0)", args.data, args.na_prob_file)
    if na_probs is not None and version == "2.0":
        lacking = [qid for qid in preds if qid in qids and qid not in na_probs]
        if lacking:  # the official script stops with a KeyError; name the file and what to give
            raise ValueError(f"{args.na_prob_file}: no value for question id {lacking[0]} ({len(lacking)} of the "
                             f"{len(preds)} predicted questions lack one): give the null_odds.json written with "
                             f"{args.predictions}")
    try:
        result = evaluate_squad(dataset, preds, na_probs, version=args.version, na_prob_thresh=args.na_prob_thresh)
    except ValueError as e:  # the scoring's own errors name a question, not the file it is in
        raise ValueError(f"{args.data}: {e}") from None
    print(json.dumps(result, indent=2))
    if args.output:
        with writing(f"writing the scores to {args.output}"):
            atomic_write_json(args.output, result)
    return 0
