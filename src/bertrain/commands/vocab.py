"""`bertrain vocab`: train a WordPiece vocab.txt on any corpus `prepare` reads (the same inputs and settings give
the same bytes; an existing vocab.txt is refused unless --overwrite, which moves it aside)."""
from __future__ import annotations

import argparse
import json

from bertrain.data.readers import INPUT_FORMATS, CorpusConfig
from bertrain.data.tokenizer import VOCAB_STATS, tokenizer_identity, train_vocab

HELP = "train a WordPiece vocabulary (vocab.txt) on a corpus"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--input", nargs="+", required=True, metavar="PATH",
                        help="files (.txt, .xml, .jsonl, .parquet, .arrow; .bz2/.gz/.xz/.zst), folders (a `datasets` "
                             "save_to_disk folder too), globs or builtin:python-docs")
    parser.add_argument("--output", required=True, metavar="DIR", help="folder to write vocab.txt into")
    parser.add_argument("--vocab-size", type=int, default=30522, help="number of tokens (default 30522)")
    parser.add_argument("--cased", action="store_true", help="keep case and accents (default: lower-case)")
    parser.add_argument("--min-frequency", type=int, default=2, help="minimum pair frequency to merge (default 2)")
    parser.add_argument("--limit-alphabet", type=int, default=1000, help="maximum initial characters kept")
    parser.add_argument("--input-format", default="auto", choices=INPUT_FORMATS)
    parser.add_argument("--text-column", "--text-field", dest="text_field", default="text", metavar="NAME",
                        help="Parquet/Arrow column (or JSONL key) holding a document's text (default text)")
    parser.add_argument("--encoding", default="utf-8",
                        help="encoding of text/JSONL inputs, e.g. latin-1 or cp1252 (default utf-8; a file that is "
                             "not text in it is refused)")
    # The corpus settings of `bertrain prepare`: the vocabulary is trained on the text prepare keeps.
    parser.add_argument("--min-document-chars", type=int, default=20,
                        help="skip documents with fewer characters after cleaning (default 20, as prepare)")
    parser.add_argument("--dedupe", action="store_true", help="skip exact duplicate documents (as prepare --dedupe)")
    parser.add_argument("--keep-disambiguation", dest="skip_disambiguation", action="store_false",
                        help="Wikipedia: keep disambiguation pages (as prepare --keep-disambiguation)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an existing vocab.txt in --output (the old one is moved aside, not deleted)")


def run(args: argparse.Namespace) -> int:
    path = train_vocab(args.input, args.output, vocab_size=args.vocab_size, lowercase=not args.cased,
                       min_frequency=args.min_frequency, limit_alphabet=args.limit_alphabet, overwrite=args.overwrite,
                       corpus=CorpusConfig(input_format=args.input_format, text_field=args.text_field,
                                           encoding=args.encoding, min_document_chars=args.min_document_chars,
                                           dedupe=args.dedupe, skip_disambiguation=args.skip_disambiguation))
    stats = json.loads((path.parent / VOCAB_STATS).read_text(encoding="utf-8"))
    print(f"{path}\t{tokenizer_identity(path, not args.cased)}")
    print(f"{stats['num_tokens']} tokens from {stats['read']['documents']} documents "
          f"({stats['num_words']} words, {stats['replaced_characters']} invalid characters replaced); "
          f"details in {path.parent / VOCAB_STATS}")
    return 0
