"""Pieces shared by the task modules: the WordPiece tokenizer of a model folder and its identity."""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer
from tokenizers.implementations import BertWordPieceTokenizer

from bertrain.model.hf import resolve_model_dir, vocab_from_tokenizer_json

SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")


@dataclass
class TaskTokenizer:
    """A fast WordPiece tokenizer plus what the task code needs to know about it."""

    tokenizer: Tokenizer
    """The `tokenizers` object, without truncation or padding (callers set those per use)."""
    identity: str
    """sha256 of the vocabulary and casing: part of every feature-cache key."""
    cls_id: int
    sep_id: int
    pad_id: int
    do_lower_case: bool

    def encode_plain(self, texts: list[str]) -> list:
        """Encodings of `texts` without special tokens (ids + character offsets into each text)."""
        self.tokenizer.no_truncation()
        self.tokenizer.no_padding()
        return self.tokenizer.encode_batch(texts, add_special_tokens=False)


def read_do_lower_case(model_dir: str | os.PathLike) -> bool:
    """`do_lower_case` from the folder's tokenizer_config.json (True, BERT's default, when absent)."""
    cfg = Path(model_dir) / "tokenizer_config.json"
    if not cfg.is_file():
        return True
    try:
        data = json.loads(cfg.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{cfg}: not valid JSON: {e}") from None
    return bool(data.get("do_lower_case", True))


def basic_tokenizer_settings(model_dir: Path) -> tuple[bool | None, bool]:
    """`strip_accents` (None: as lowercasing) and `tokenize_chinese_chars` from tokenizer_config.json, as
    transformers' BertTokenizer reads them: a model saved with strip_accents false (lowercased, accents kept) was
    tokenized otherwise than in transformers."""
    cfg = model_dir / "tokenizer_config.json"
    try:
        data = json.loads(cfg.read_text(encoding="utf-8")) if cfg.is_file() else {}
    except json.JSONDecodeError as e:
        raise ValueError(f"{cfg}: not valid JSON: {e}") from None
    data = data if isinstance(data, dict) else {}
    strip, chinese = data.get("strip_accents"), data.get("tokenize_chinese_chars", True)
    for key, value in (("strip_accents", strip), ("tokenize_chinese_chars", chinese)):
        if value is not None and not isinstance(value, bool):
            raise ValueError(f"{cfg}: '{key}' must be true, false or null, got {value!r}")
    return strip, chinese is not False


def load_task_tokenizer(model_dir: str | os.PathLike, do_lower_case: bool | None = None) -> TaskTokenizer:
    """The tokenizer of an HF-format model folder (or bertrain checkpoint folder): vocab.txt + do_lower_case.

    We build it from vocab.txt rather than tokenizer.json so that a bertrain checkpoint (which always carries
    vocab.txt and tokenizer_config.json) and an HF folder give the same tokenizer; BERT's basic tokenizer rules
    (clean text, split CJK characters, strip accents when lowercasing) are those of `BertWordPieceTokenizer`.
    `model_dir` may be a Hub model id in the local HF cache (`bertrain.model.hf.resolve_model_dir`).
    """
    model_dir = resolve_model_dir(model_dir)
    vocab = model_dir / "vocab.txt"
    if vocab.is_file():
        vocab_bytes, source = vocab.read_bytes(), str(vocab)
    else:  # a folder whose tokenizer transformers >= 5 saved: tokenizer.json alone, when it is BERT's tokenizer
        vocab_bytes, lower, why = _vocab_of_tokenizer_json(model_dir)
        if vocab_bytes is None:
            raise ValueError(f"model folder {model_dir} has no vocab.txt (needed for the tokenizer)"
                             + (f", and its tokenizer.json {why}" if why else ""))
        from bertrain.data.tokenizer import vocab_lines  # only here: predict and serve need no corpus readers

        tokens = vocab_lines(vocab_bytes.decode("utf-8"))[:-1]  # (the text ends with a newline)
        source = {t: i for i, t in enumerate(tokens)}
        if do_lower_case is None:
            do_lower_case = lower  # the casing its normalizer applies
    if do_lower_case is None:
        do_lower_case = read_do_lower_case(model_dir)
    strip_accents, chinese = basic_tokenizer_settings(model_dir)
    wp = BertWordPieceTokenizer(source, lowercase=do_lower_case, strip_accents=strip_accents, clean_text=True,
                                handle_chinese_chars=chinese)
    tok = wp._tokenizer  # the underlying `tokenizers.Tokenizer`
    ids = {t: tok.token_to_id(t) for t in ("[CLS]", "[SEP]", "[PAD]", "[UNK]")}
    missing = [t for t, i in ids.items() if i is None]
    if missing:
        raise ValueError(f"{vocab}: special tokens {missing} are not in the vocabulary")
    h = hashlib.sha256(vocab_bytes)
    h.update(f"lower={do_lower_case}".encode())
    if strip_accents is not None or not chinese:  # (the defaults keep the identities, and caches, of before)
        h.update(f"strip_accents={strip_accents},chinese={chinese}".encode())
    return TaskTokenizer(tokenizer=tok, identity=h.hexdigest(), cls_id=ids["[CLS]"], sep_id=ids["[SEP]"],
                         pad_id=ids["[PAD]"], do_lower_case=do_lower_case)


def file_sha256(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def default_cache_dir() -> Path:
    """Where feature caches go unless the config says otherwise ($BERTRAIN_CACHE or ~/.cache/bertrain)."""
    return Path(os.environ.get("BERTRAIN_CACHE", Path.home() / ".cache" / "bertrain")) / "features"


def _vocab_of_tokenizer_json(model_dir: Path) -> tuple[bytes | None, bool | None, str]:
    """(vocab.txt bytes, lower-cases, why not) of the folder's tokenizer.json (`vocab_from_tokenizer_json`)."""
    tokenizer_json, config = model_dir / "tokenizer.json", model_dir / "tokenizer_config.json"
    if not tokenizer_json.is_file():
        return None, None, ""
    return vocab_from_tokenizer_json(tokenizer_json.read_bytes(), config.read_bytes() if config.is_file() else None)
