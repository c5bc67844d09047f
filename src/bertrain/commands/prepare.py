"""`bertrain prepare`: corpora -> sharded token store (+ static MLM/NSP instances), see bertrain.data.prepare."""
from __future__ import annotations

import argparse
import json

from bertrain.data.prepare import PrepareConfig, prepare
from bertrain.data.readers import CorpusConfig
from bertrain.data.samples import SampleConfig

HELP = "tokenize corpora into a sharded token store and (--masking static) pretraining instances"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--input", nargs="+", required=True, metavar="PATH", help="files, folders, globs or builtin:python-docs")
    a("--output", required=True, metavar="DIR", help="output folder (refused if it exists, unless --overwrite)")
    a("--vocab-file", required=True, metavar="FILE", help="WordPiece vocab.txt")
    a("--max-seq-length", type=int, default=128)
    a("--max-predictions-per-seq", type=int, default=20)
    a("--masked-lm-prob", type=float, default=0.15)
    a("--short-seq-prob", type=float, default=0.1)
    a("--dupe-factor", type=int, default=5, help="static: differently masked copies (default 5)")
    a("--masking", choices=["static", "dynamic", "none"], default="static",
      help="static: also materialise masked instances (google-research/bert); dynamic or none: write the token "
           "store only, samples are built and masked at training time (default static)")
    a("--do-lower-case", action=argparse.BooleanOptionalAction, default=True, help="must match the vocab")
    a("--seed", "--random-seed", dest="seed", type=int, default=12345,
      help="seed of blocks, masking and NSP pairing (default 12345)")
    a("--workers", type=int, default=0, help="worker processes (default: every core)")
    a("--whole-word-masking", action="store_true", help="static: mask whole words")
    a("--no-next-sentence", dest="next_sentence", action="store_false",
      help="static: MLM-only packing (full sentences up to the length, no NSP pairs)")
    a("--input-format", default="auto", choices=["auto", "wiki", "text", "lines", "jsonl"])
    a("--text-field", default="text", help="JSONL key holding the text")
    a("--encoding", default="utf-8", help="encoding of text/JSONL inputs, e.g. latin-1 or cp1252 (default utf-8; a "
                                          "file that is not text in it is refused)")
    a("--min-document-chars", type=int, default=20)
    a("--dedupe", action="store_true", help="skip exact duplicate documents")
    a("--keep-disambiguation", dest="skip_disambiguation", action="store_false",
      help="Wikipedia: keep disambiguation pages")
    a("--shard-tokens", type=int, default=1 << 25, help="tokens per shard")
    a("--overwrite", action="store_true",
      help="replace an existing output folder (moved aside to OUTPUT.replaced-<time>, not deleted)")


def run(args: argparse.Namespace) -> int:
    sample = SampleConfig(max_seq_length=args.max_seq_length, max_predictions_per_seq=args.max_predictions_per_seq,
                          masked_lm_prob=args.masked_lm_prob, short_seq_prob=args.short_seq_prob,
                          whole_word_masking=args.whole_word_masking, next_sentence=args.next_sentence)
    cfg = PrepareConfig(
        inputs=args.input, output=args.output, vocab_file=args.vocab_file, sample=sample,
        dupe_factor=args.dupe_factor, masking=args.masking, do_lower_case=args.do_lower_case, seed=args.seed,
        workers=args.workers, overwrite=args.overwrite, shard_tokens=args.shard_tokens,
        corpus=CorpusConfig(input_format=args.input_format, text_field=args.text_field,
                            min_document_chars=args.min_document_chars, dedupe=args.dedupe,
                            skip_disambiguation=args.skip_disambiguation, encoding=args.encoding))
    stats = prepare(cfg)
    print(json.dumps({k: v for k, v in stats.items() if k != "skipped"}, indent=2))
    return 0
