"""`bertrain prepare`: corpora -> sharded token store (+ static MLM/NSP instances, + a held-out set), see
bertrain.data.prepare; `--add-heldout DIR` gives a store prepared without a held-out set one."""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging

from bertrain.data.prepare import PrepareConfig, add_heldout, prepare
from bertrain.data.readers import INPUT_FORMATS, CorpusConfig
from bertrain.data.samples import SampleConfig
from bertrain.data.tokenizer import recorded_casing
from bertrain.utils.errors import UserError

log = logging.getLogger(__name__)

HELP = "tokenize corpora into a sharded token store and (--masking static) pretraining instances"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--input", nargs="+", metavar="PATH",
                      help="files (.txt, .xml, .jsonl, .parquet, .arrow; .bz2/.gz/.xz/.zst), folders (a `datasets` "
                           "save_to_disk folder too), globs or builtin:python-docs")
    what.add_argument("--add-heldout", metavar="DIR",
                      help="instead of preparing: give the store DIR, prepared without a held-out set (before they "
                           "existed, or with --heldout-fraction 0), the one a fresh prepare would make, from its own "
                           "shards (no input needed; the old folder is moved aside to DIR.replaced-<time>; only "
                           "--heldout-* and --workers apply, the rest is as recorded in DIR)")
    a("--output", metavar="DIR", help="output folder (refused if it exists, unless --overwrite); required with --input")
    a("--vocab-file", metavar="FILE", help="WordPiece vocab.txt; required with --input")
    a("--max-seq-length", type=int, default=128)
    a("--max-predictions-per-seq", type=int, default=20)
    a("--masked-lm-prob", type=float, default=0.15)
    a("--short-seq-prob", type=float, default=0.1)
    a("--dupe-factor", type=int, default=5, help="static: differently masked copies (default 5)")
    a("--masking", choices=["static", "dynamic", "none"], default="static",
      help="static: also materialise masked instances (google-research/bert); dynamic or none: write the token "
           "store only, samples are built and masked at training time (default static)")
    a("--do-lower-case", action=argparse.BooleanOptionalAction, default=None,
      help="must match the vocab (default: the casing `bertrain vocab` recorded beside it, else lower-case)")
    a("--seed", "--random-seed", dest="seed", type=int, default=12345,
      help="seed of blocks, masking and NSP pairing (default 12345)")
    a("--workers", type=int, default=0, help="worker processes (default: every core)")
    a("--whole-word-masking", action="store_true", help="static: mask whole words")
    a("--no-next-sentence", dest="next_sentence", action="store_false",
      help="static: MLM-only packing across documents, no NSP pairs")
    a("--whole-sentences", dest="split_sentences", action="store_false",
      help="static MLM-only packing: whole sentences only (default: full blocks that may cut a sentence, as run_mlm)")
    a("--no-document-separator", dest="document_separator", action="store_false",
      help="static MLM-only packing: no [SEP] between documents (default: one where a block crosses documents, as "
           "RoBERTa FULL-SENTENCES)")
    a("--input-format", default="auto", choices=INPUT_FORMATS)
    a("--text-column", "--text-field", dest="text_field", default="text", metavar="NAME",
      help="Parquet/Arrow column (or JSONL key) holding a document's text (default text)")
    a("--encoding", default="utf-8", help="encoding of text/JSONL inputs, e.g. latin-1 or cp1252 (default utf-8; a "
                                          "file that is not text in it is refused)")
    a("--min-document-chars", type=int, default=20)
    a("--dedupe", action="store_true", help="skip exact duplicate documents")
    a("--keep-disambiguation", dest="skip_disambiguation", action="store_false",
      help="Wikipedia: keep disambiguation pages")
    a("--shard-tokens", type=int, default=1 << 25, help="tokens per shard")
    a("--heldout-fraction", type=float, default=0.01,
      help="share of the documents set aside (by a hash of their content) in OUTPUT/heldout for evaluation, never "
           "trained on; 0 disables it (default 0.01)")
    a("--heldout-min-documents", type=int, default=10,
      help="at least this many held-out documents; a corpus where that is over 10%% of its documents gets no "
           "held-out set (default 10)")
    a("--overwrite", action="store_true",
      help="replace an existing output folder (moved aside to OUTPUT.replaced-<time>, not deleted)")


def run(args: argparse.Namespace) -> int:
    if args.add_heldout is not None:
        if args.output is not None or args.vocab_file is not None:
            raise UserError("--add-heldout DIR works on DIR with its own vocab.txt: drop --output and --vocab-file")
        _warn_ignored_by_add_heldout(args)
        stats = add_heldout(args.add_heldout, args.heldout_fraction, args.heldout_min_documents, args.workers)
        print(json.dumps({k: v for k, v in stats.items() if k != "skipped"}, indent=2))
        return 0
    missing = [flag for flag, v in (("--output", args.output), ("--vocab-file", args.vocab_file)) if v is None]
    if missing:
        raise UserError(f"prepare --input needs {' and '.join(missing)}")
    sample = SampleConfig(max_seq_length=args.max_seq_length, max_predictions_per_seq=args.max_predictions_per_seq,
                          masked_lm_prob=args.masked_lm_prob, short_seq_prob=args.short_seq_prob,
                          whole_word_masking=args.whole_word_masking, next_sentence=args.next_sentence,
                          split_sentences=args.split_sentences, document_separator=args.document_separator)
    if args.masking != "static":
        _warn_unused_sample_flags(sample, args.masking)
    do_lower_case = args.do_lower_case
    if do_lower_case is None:
        recorded = recorded_casing(args.vocab_file)
        do_lower_case = True if recorded is None else recorded
    cfg = PrepareConfig(
        inputs=args.input, output=args.output, vocab_file=args.vocab_file, sample=sample,
        dupe_factor=args.dupe_factor, masking=args.masking, do_lower_case=do_lower_case, seed=args.seed,
        workers=args.workers, overwrite=args.overwrite, shard_tokens=args.shard_tokens,
        corpus=CorpusConfig(input_format=args.input_format, text_field=args.text_field,
                            min_document_chars=args.min_document_chars, dedupe=args.dedupe,
                            skip_disambiguation=args.skip_disambiguation, encoding=args.encoding),
        heldout_fraction=args.heldout_fraction, heldout_min_documents=args.heldout_min_documents)
    stats = prepare(cfg)
    print(json.dumps({k: v for k, v in stats.items() if k != "skipped"}, indent=2))
    return 0


def _warn_ignored_by_add_heldout(args: argparse.Namespace) -> None:
    """--add-heldout takes DIR's recorded settings: a flag given for anything else (--masking, --max-seq-length,
    --seed, ...) was ignored without a word."""
    defaults = argparse.ArgumentParser()
    add_arguments(defaults)
    applies = {"add_heldout", "input", "heldout_fraction", "heldout_min_documents", "workers", "overwrite"}
    given = [a.option_strings[0] for a in defaults._actions
             if a.dest not in applies and a.option_strings and a.dest != "help"
             and getattr(args, a.dest, a.default) != a.default]
    if given:
        log.warning("--add-heldout uses the settings recorded in %s: %s not used (only --heldout-* and --workers "
                    "apply)", args.add_heldout, ", ".join(given) + (" is" if len(given) == 1 else " are"))


def _warn_unused_sample_flags(sample: SampleConfig, masking: str) -> None:
    """Google's create_pretraining_data takes the sample settings at prepare time; with dynamic masking they belong
    to the pretraining config (`sample.*`), so flags that change them here would be silently ignored."""
    default = SampleConfig()
    flags = {"max_seq_length": "--max-seq-length", "max_predictions_per_seq": "--max-predictions-per-seq",
             "masked_lm_prob": "--masked-lm-prob", "short_seq_prob": "--short-seq-prob",
             "whole_word_masking": "--whole-word-masking", "next_sentence": "--no-next-sentence",
             "split_sentences": "--whole-sentences", "document_separator": "--no-document-separator"}
    given = [f"{flag} (sample.{f.name}: {json.dumps(getattr(sample, f.name))})" for f in dataclasses.fields(sample)
             if (flag := flags.get(f.name)) and getattr(sample, f.name) != getattr(default, f.name)]
    if given:
        log.warning("--masking %s writes the token store only: %s not used here; samples are built at training time "
                    "from the pretraining config's sample.* keys, so set them there", masking,
                    ", ".join(given) + (" is" if len(given) == 1 else " are"))
