"""WordPiece vocabularies and tokenizers (HF `tokenizers`, Rust): training, loading, identity.

The *identity* of a tokenizer is a short hash of its vocabulary (the token list, so CRLF/LF line endings do not
matter) plus its casing. `bertrain prepare` records it in the prepared folder and the trainer compares it with the
model's vocab at start (`check_tokenizer_identity`): training on ids from a different vocab is an error, not a
silently useless run.
"""
from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path
from typing import Iterable, Sequence

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from bertrain.utils.io import atomic_write_text

logger = logging.getLogger(__name__)

SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")


def read_vocab(vocab_file: str | os.PathLike) -> list[str]:
    """The tokens of a BERT vocab.txt, one per line, in id order (a clear error for a missing/empty file)."""
    path = Path(vocab_file)
    if not path.is_file():
        raise FileNotFoundError(f"vocab file {path} does not exist (train one with `bertrain vocab` or pass a vocab.txt)")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"vocab file {path} is not UTF-8 text: {e}") from None
    tokens = text.splitlines()
    if tokens and tokens[-1] == "":
        tokens.pop()
    if not tokens:
        raise ValueError(f"vocab file {path} is empty")
    missing = [t for t in ("[UNK]", "[CLS]", "[SEP]", "[MASK]", "[PAD]") if t not in tokens]
    if missing:
        raise ValueError(f"vocab file {path} lacks the special tokens {missing}; a BERT vocab needs all of "
                         f"{list(SPECIAL_TOKENS)}")
    return tokens


def tokenizer_identity(vocab_file: str | os.PathLike, do_lower_case: bool) -> str:
    """A stable id of (vocabulary, casing), e.g. ``wordpiece-30522-uncased-3f2a...``: equal iff the ids mean the same."""
    tokens = read_vocab(vocab_file)
    h = hashlib.sha256("\n".join(tokens).encode("utf-8"))
    h.update(b"\0lower=" + (b"1" if do_lower_case else b"0"))
    return f"wordpiece-{len(tokens)}-{'uncased' if do_lower_case else 'cased'}-{h.hexdigest()[:16]}"


def check_tokenizer_identity(expected: str, vocab_file: str | os.PathLike, do_lower_case: bool, where: str) -> None:
    """Raise `ValueError` when the data at `where` was tokenized with another vocab/casing than `vocab_file`."""
    actual = tokenizer_identity(vocab_file, do_lower_case)
    if actual != expected:
        raise ValueError(
            f"tokenizer mismatch: {where} was prepared with tokenizer {expected}, but the model's vocab "
            f"{vocab_file} (do_lower_case={do_lower_case}) is {actual}. Re-run `bertrain prepare` with the model's "
            f"vocab file, or train with the vocab the data was prepared with.")


def _bert_pipeline(tok: Tokenizer, lowercase: bool) -> Tokenizer:
    # Google's BasicTokenizer: clean control chars, split CJK, strip accents only when lowercasing.
    tok.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True,
                                                strip_accents=None, lowercase=lowercase)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(prefix="##")
    return tok


def load_tokenizer(vocab_file: str | os.PathLike, do_lower_case: bool = True) -> Tokenizer:
    """A fast BERT WordPiece tokenizer for `vocab_file`; `encode(..., add_special_tokens=False)` gives raw ids."""
    tokens = read_vocab(vocab_file)
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]", max_input_chars_per_word=200))  # as google-research/bert
    return _bert_pipeline(tok, do_lower_case)


def train_vocab(inputs: Sequence[str | os.PathLike] | str, output_dir: str | os.PathLike, vocab_size: int = 30522,
                lowercase: bool = True, min_frequency: int = 2, limit_alphabet: int = 1000,
                special_tokens: Sequence[str] = SPECIAL_TOKENS, corpus_options: dict | None = None) -> Path:
    """Train a WordPiece vocabulary on `inputs` (any input `bertrain prepare` reads) and write `output_dir/vocab.txt`.

    Documents are read, cleaned and split exactly as `prepare` does (see `bertrain.data.corpus`), so the vocab
    sees the same text the model will. Returns the path of vocab.txt (written atomically).
    """
    from bertrain.data.corpus import CorpusOptions, SkipReport, iter_documents

    if isinstance(inputs, (str, os.PathLike)):
        inputs = [inputs]
    if vocab_size < len(special_tokens) + 1:
        raise ValueError(f"vocab_size {vocab_size} is too small: it must exceed the {len(special_tokens)} special tokens")
    opts = CorpusOptions(**(corpus_options or {}))
    report = SkipReport()

    def texts() -> Iterable[str]:
        for doc in iter_documents([str(p) for p in inputs], opts, report):
            yield doc.text

    tok = _bert_pipeline(Tokenizer(models.WordPiece(unk_token="[UNK]")), lowercase)
    trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                        limit_alphabet=limit_alphabet, special_tokens=list(special_tokens),
                                        continuing_subword_prefix="##", show_progress=False)
    tok.train_from_iterator(texts(), trainer=trainer)
    report.log(logger)
    vocab = tok.get_vocab()
    ordered = sorted(vocab, key=vocab.__getitem__)
    if report.documents == 0:
        raise ValueError(f"no text found in {list(map(str, inputs))}: {report.summary()}")
    out = Path(output_dir) / "vocab.txt"
    atomic_write_text(out, "\n".join(ordered) + "\n")
    logger.info("wrote %s: %d tokens (%s) from %d documents", out, len(ordered),
                "uncased" if lowercase else "cased", report.documents)
    return out
