"""WordPiece vocabularies and tokenizers (HF `tokenizers`, Rust): training, loading, identity.

The *identity* of a tokenizer is a short hash of its vocabulary (the token list, so CRLF/LF line endings do not
matter) plus its casing. `bertrain prepare` records it in the prepared folder and the trainer compares it with the
model's vocab at start (`check_tokenizer_identity`): training on ids from a different vocab is an error, not a
silently useless run.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
import sys
import time
from collections import Counter
from itertools import chain, compress, repeat
from operator import is_
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from bertrain.data.progress import Progress
from bertrain.data.readers import CorpusConfig, SkipReport, input_fingerprint, iter_documents, resolve_inputs
from bertrain.utils.errors import UserError, writing
from bertrain.utils.io import atomic_write_json, atomic_write_text, fsync_dir
from bertrain.utils.rundir import OutputLock, move_aside

logger = logging.getLogger(__name__)

SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")


# Rust's char::is_whitespace (the Unicode White_Space property), which `str::trim_end` strips; Python's str.isspace
# differs (it also counts \x1c-\x1f).
_RUST_WHITE_SPACE = "\t\n\x0b\x0c\r \x85\xa0\u1680" + "".join(map(chr, range(0x2000, 0x200b))) + \
    "\u2028\u2029\u202f\u205f\u3000"


def vocab_lines(text: str) -> list[str]:
    """The tokens of a vocab.txt's text as HF `tokenizers` reads them (WordPiece.read_file: cut at \\n only, trailing
    Unicode white space trimmed), not as str.splitlines, which also cuts at \\x0b, \\x0c, \\x1c-\\x1e, \\x85,
    \\u2028 and \\u2029: a token holding one of them would shift every later id against transformers'."""
    return [t.rstrip(_RUST_WHITE_SPACE) for t in text.split("\n")]


def read_vocab(vocab_file: str | os.PathLike) -> list[str]:
    """The tokens of a BERT vocab.txt, one per line, in id order (a clear error for a missing/empty file)."""
    path = Path(vocab_file)
    if not path.is_file():  # a UserError (exit 2, one line), not FileNotFoundError (a traceback: exit 1)
        raise UserError(f"vocab file {path} {'is a folder' if path.is_dir() else 'does not exist'}: train one "
                        "with `bertrain vocab` or pass a vocab.txt")
    try:
        text = path.read_bytes().decode("utf-8")
    except OSError as e:
        raise UserError(f"cannot read vocab file {path}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"vocab file {path} is not UTF-8 text: {e}") from None
    tokens = vocab_lines(text)
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


def recorded_casing(vocab_file: str | os.PathLike) -> bool | None:
    """Whether `bertrain vocab` trained `vocab_file` lower-cased, from the vocab-stats.json beside it; None when
    there is no such record, or it describes another file (its sha256 differs: the vocab.txt was replaced)."""
    vocab_file = Path(vocab_file)
    try:
        stats = json.loads((vocab_file.parent / VOCAB_STATS).read_text(encoding="utf-8"))
        if stats["sha256"] != hashlib.sha256(vocab_file.read_bytes()).hexdigest():
            return None
        lowercase = stats["settings"]["lowercase"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return lowercase if isinstance(lowercase, bool) else None


def check_vocab_casing(vocab_file: str | os.PathLike, do_lower_case: bool, option: str) -> None:
    """Refuse tokenizing with the other casing than the one `vocab_file` was trained with (when it is recorded):
    a cased vocabulary read lower-cased splits most capitalised words into pieces, silently. `option` names the
    setting the user changes (e.g. `--do-lower-case`)."""
    trained = recorded_casing(vocab_file)
    if trained is not None and trained != do_lower_case:
        raise UserError(f"{vocab_file} was trained {'uncased' if trained else 'cased'} ({VOCAB_STATS} beside it: "
                        f"lowercase {str(trained).lower()}), but {option} is {str(do_lower_case).lower()}: use the "
                        f"vocabulary's casing, or a vocabulary trained with the casing you want")


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
    return _wordpiece({t: i for i, t in enumerate(read_vocab(vocab_file))}, do_lower_case)


# Longer words are [UNK]. 100, as HF's BertTokenizer(Fast) and `tasks.common.load_task_tokenizer`, which tokenize
# the model's text in fine-tuning and after export: with google-research/bert's 200, a word of 101-200 characters
# was pretrained on as pieces and then seen as [UNK] by the model it became.
_MAX_WORD_CHARS = 100


def _wordpiece(vocab: dict[str, int], do_lower_case: bool) -> Tokenizer:
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]", max_input_chars_per_word=_MAX_WORD_CHARS))
    return _bert_pipeline(tok, do_lower_case)


# ----------------------------------------------------------------------------------------------- fast encoding

# Why a second encoding path: most of the time HF `tokenizers` (Rust) spends on BertWordPiece is per-call and
# per-word bookkeeping (offsets, alignments, Encoding objects), not WordPiece itself. Text is Zipfian, so almost
# every word was seen before: `FastBertEncoder` splits whole chunks with one C regex and looks the pieces up in a
# dict of already encoded pieces, several times faster (BENCHMARKS.md, data preparation: the encoder). It stays
# exactly HF's output by construction, not by re-implementation: it only cuts the text at ASCII
# whitespace/punctuation and drops ASCII control characters, which BertNormalizer + BertPreTokenizer provably treat
# the same way (every ASCII char maps to itself, to its lower case, to a space or to nothing, each ASCII punctuation
# char is its own word, and ASCII chars are Unicode starters, so NFD never reorders across them). Every piece
# between two cuts, ASCII or not (accents, CJK, Unicode spaces/punctuation inside it, words over 100 chars -> [UNK]),
# is encoded by the HF tokenizer itself the first time it is seen. tests/test_data_tokenizer.py checks equality on
# the real corpora, cased and uncased.
_ASCII_WS = " \t\n\r"
_ASCII_PUNCT = "!-/:-@\\[-`{-~"  # the 32 ASCII punctuation chars, as a character class body
# A piece = a run of chars that are neither ASCII whitespace nor ASCII punctuation; or one punctuation char;
# or a newline (a separator: `_fill_words` joins words with it).
_PIECE = re.compile(f"[^{_ASCII_WS}{_ASCII_PUNCT}]+|[{_ASCII_PUNCT}]|\n")
# BertNormalizer deletes these (category Cc, except tab/newline/CR); deleting them first joins pieces like it does.
_ASCII_CONTROL_BYTES = bytes([*range(0x00, 0x09), 0x0b, 0x0c, *range(0x0e, 0x20), 0x7f])
_SEP = (-1,)
_SEP_BYTES = np.array(_SEP, np.int32).tobytes()


def _greedy_wordpiece(word: str, vocab: dict[str, int], max_chars: int, unk: int, longest: int) -> tuple[int, ...]:
    """WordPiece of one normalised pre-token, as HF `tokenizers`' WordPiece model (and google-research/bert) does
    it: longest vocab prefix first, continuations with "##", the whole word [UNK] if some rest matches nothing.
    `longest`: the length of the longest vocab entry (without "##"): no longer piece can match."""
    i = vocab.get(word)
    if i is not None and len(word) <= max_chars:  # the usual case: the word is a vocab entry
        return (i,)
    if len(word) > max_chars:
        return (unk,)
    ids = []
    start, n = 0, len(word)
    while start < n:
        end = min(n, start + longest)
        while end > start:
            i = vocab.get(word[start:end] if start == 0 else "##" + word[start:end])
            if i is not None:
                break
            end -= 1
        else:
            return (unk,)
        ids.append(i)
        start = end
    return tuple(ids)


class FastBertEncoder:
    """Sentences -> WordPiece ids, exactly as `tokenizer.encode(s, add_special_tokens=False).ids`, much faster.

    `tokenizer` must be a `load_tokenizer` tokenizer (BertNormalizer + BertPreTokenizer + WordPiece). The cache of
    encoded pieces is bounded by `max_cache` entries (cleared when full), so memory stays flat on any corpus.
    """

    def __init__(self, tokenizer: Tokenizer | None, do_lower_case: bool, max_cache: int = 400_000,
                 vocab: dict[str, int] | None = None):
        """`tokenizer` None: built from `vocab` when first needed (only non-ASCII words need it)."""
        self._tokenizer = tokenizer
        self.lower = do_lower_case
        self.vocab = vocab if vocab is not None else tokenizer.get_vocab()  # get_vocab() copies all 30k entries
        self.max_chars = getattr(tokenizer.model, "max_input_chars_per_word", 100) if tokenizer else _MAX_WORD_CHARS
        self.max_cache = max_cache
        self.longest: int | None = None  # longest vocab entry, for `_greedy_wordpiece` (computed when first needed)
        self.cache: dict[str, tuple[int, ...]] = {"\n": _SEP}  # piece -> ids ("\n": a separator, see _fill_words)
        # Space-delimited word (punctuation attached) -> its pieces' ids packed as int32 bytes: text splits at
        # spaces with one C call, and b"".join + np.frombuffer flattens the ids with no per-id Python work
        # (findall into pieces + chain/fromiter over id tuples was most of the encoder's time).
        self.words: dict[str, bytes] = {}
        self._reset_words()

    @classmethod
    def from_vocab_file(cls, vocab_file: str | os.PathLike, do_lower_case: bool) -> "FastBertEncoder":
        """The encoder of `load_tokenizer(vocab_file, do_lower_case)`, reading the file once. The HF tokenizer is
        built only if a non-ASCII word turns up (in `prepare`'s workers, after forking: less start-up)."""
        return cls(None, do_lower_case, vocab={t: i for i, t in enumerate(read_vocab(vocab_file))})

    @property
    def tokenizer(self) -> Tokenizer:
        if self._tokenizer is None:
            self._tokenizer = _wordpiece(self.vocab, self.lower)
        return self._tokenizer

    def _reset_words(self) -> None:
        self.words.clear()
        self.words.update({"": b"", "\n": _SEP_BYTES})

    def _fill(self, pieces: list[str]) -> None:
        cache = self.cache
        missing = set(pieces).difference(cache)
        if not missing:
            return
        if len(cache) + len(missing) > self.max_cache:
            cache.clear()
            cache["\n"] = _SEP
            missing = set(pieces).difference(cache)
        # An ASCII piece (a run of ASCII letters and digits) is one pre-token whose normal form is itself, lower-cased
        # when uncased: WordPiece's greedy longest-match-first on it is a few dict look-ups here, against ~8 us per
        # word through the HF tokenizer (new words are most of the cost of a worker's first chunks: Wikipedia's
        # sample has ~40k). Everything else (non-ASCII pieces) goes to the HF tokenizer itself.
        vocab, lower, max_chars, unk = self.vocab, self.lower, self.max_chars, self.vocab.get("[UNK]")
        if self.longest is None:
            self.longest = max((len(t) - 2 if t.startswith("##") else len(t) for t in vocab), default=1)
        words = []
        for w in missing:
            if w.isascii() and unk is not None:
                cache[w] = _greedy_wordpiece(w.lower() if lower else w, vocab, max_chars, unk, self.longest)
            else:
                words.append(w)
        if words:
            for w, enc in zip(words, self.tokenizer.encode_batch_fast(words, add_special_tokens=False)):
                cache[w] = tuple(enc.ids)

    def _fill_words(self, words: list[str]) -> dict[str, bytes]:
        """Encode new words (no spaces or newlines in them) into `self.words`, all at once: one regex pass over the
        words joined by newlines, one flatten, then each word's slice of the packed ids (a cold first chunk has
        ~25k new words per MB, so per-word regex and numpy calls were most of its cost). Returns them (the cache
        may have been cleared to make room, dropping words the caller already looked up)."""
        if len(self.words) + len(words) > self.max_cache:
            self._reset_words()
        pieces = _PIECE.findall("\n".join(words))  # "\n" pieces separate the words
        self._fill(pieces)
        cache = self.cache
        flat = np.fromiter(chain.from_iterable(map(cache.__getitem__, pieces)), np.int32)
        ends = np.flatnonzero(flat == -1).tolist() + [len(flat)]
        packed = flat.tobytes()
        new = {}
        start = 0
        for w, end in zip(words, ends):
            new[w] = packed[4 * start: 4 * end]
            start = end + 1
        self.words.update(new)
        return new

    def encode_sentences(self, sentences: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """(concatenated ids int64, ids per sentence int64) for `sentences`."""
        if not sentences:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        text = "\n".join(sentences)
        if text.count("\n") != len(sentences) - 1:  # a sentence holds a newline itself: encode one by one
            parts = [self.encode_sentences([s.replace("\n", " ")]) for s in sentences]
            return (np.concatenate([p[0] for p in parts]),
                    np.asarray([len(p[0]) for p in parts], dtype=np.int64))
        # bytes.translate finds (and deletes) ASCII controls faster than re; in UTF-8 an ASCII byte is
        # always that character, never part of another one.
        raw = text.encode("utf-8", "surrogatepass")
        kept = raw.translate(None, _ASCII_CONTROL_BYTES)
        if len(kept) != len(raw):
            text = kept.decode("utf-8", "surrogatepass")
        if "\t" in text or "\r" in text:  # ASCII whitespace like " " (BertNormalizer maps it to " ")
            text = text.replace("\t", " ").replace("\r", " ")
        # Words between single spaces ("" between two spaces: no ids); "\n" (-1) separates the sentences.
        words = text.replace("\n", " \n ").split(" ")
        found = list(map(self.words.get, words))
        try:
            data = b"".join(found)
        except TypeError:  # some words are new (None): encode them, then join
            new = self._fill_words(list(set(compress(words, map(is_, found, repeat(None))))))
            data = b"".join(map(new.get, words, found))  # the new word's ids, else what was found
        flat = np.frombuffer(data, np.int32).astype(np.int64)
        seps = np.flatnonzero(flat < 0)
        bounds = np.concatenate(([-1], seps, [len(flat)]))
        lens = np.diff(bounds) - 1
        return (np.delete(flat, seps) if len(seps) else flat), lens


# ----------------------------------------------------------------------------------------------- vocab training

VOCAB_STATS = "vocab-stats.json"  # beside vocab.txt: what it was trained on, with which settings, what was read
# The words of `WordCounter`: runs that are neither ASCII whitespace nor ASCII punctuation, or one ASCII punctuation.
_WORD_PIECE = re.compile(f"[^{_ASCII_WS}{_ASCII_PUNCT}]+|[{_ASCII_PUNCT}]")


class WordCounter:
    """Counts words (pre-tokens) exactly as BertNormalizer + BertPreTokenizer (`load_tokenizer`'s pipeline) cut
    and normalise them, by the argument of `FastBertEncoder`: the text is cut at ASCII whitespace and punctuation
    with one C regex and counted per piece; each distinct piece that is not ASCII is then normalised and
    pre-tokenized by HF `tokenizers` itself (an ASCII piece is its own word, lower-cased when uncased).
    tests/test_data_reliability.py checks equality with HF on the real corpora."""

    def __init__(self, lowercase: bool) -> None:
        self.lowercase = lowercase
        self.pieces: Counter = Counter()

    def add(self, text: str) -> None:
        raw = text.encode("utf-8", "surrogatepass")
        kept = raw.translate(None, _ASCII_CONTROL_BYTES)  # deleted by the normalizer: they join what they split
        if len(kept) != len(raw):
            text = kept.decode("utf-8", "surrogatepass")
        self.pieces.update(_WORD_PIECE.findall(text))

    def words(self) -> Counter:
        tok = _bert_pipeline(Tokenizer(models.WordPiece(unk_token="[UNK]")), self.lowercase)
        words: Counter = Counter()
        for piece, n in self.pieces.items():
            if piece.isascii():
                words[piece.lower() if self.lowercase else piece] += n
            else:
                for w, _ in tok.pre_tokenizer.pre_tokenize_str(tok.normalizer.normalize_str(piece)):
                    words[w] += n
        return words


def _repeated_words(words: Counter, chunk_chars: int = 1 << 20) -> Iterator[str]:
    """The words, each as often as counted, space-separated in ~1 MB strings (what the trainer is fed)."""
    buf: list[str] = []
    size = 0
    for w, n in words.items():
        unit = w + " "
        while n:
            k = min(n, max(1, (chunk_chars - size) // len(unit)))
            buf.append(unit * k)
            size += k * len(unit)
            n -= k
            if size >= chunk_chars:
                yield "".join(buf)
                buf, size = [], 0
    if buf:
        yield "".join(buf)


def wordpiece_from_counts(words: Counter, vocab_size: int, min_frequency: int = 2, limit_alphabet: int = 1000,
                          special_tokens: Sequence[str] = SPECIAL_TOKENS) -> list[str]:
    """The WordPiece vocabulary (tokens in id order) that HF `tokenizers`' WordPieceTrainer learns from these word
    counts — made deterministic.

    Why not `train_from_iterator` on the text alone: the trainer (a BPE trainer, tokenizers <= 0.23) numbers the
    continuation symbols ("##e", "##s", ...) in the iteration order of a hash map with a random seed, and breaks
    ties between equally frequent pairs by those numbers, so every run gave another vocabulary (other tokens, not
    only another order; also with RAYON_NUM_THREADS=1 and PYTHONHASHSEED=0; huggingface/tokenizers#1794, fix
    proposed in #2066). `limit_alphabet` drops the rarest characters with an unstable sort, so ties there were
    random too. Here the alphabet (the `limit_alphabet` most frequent characters, ties by code point, ordered by
    code point as HF orders it) and the continuation symbols (by code point) are computed from the counts and
    handed to the trainer first, as special tokens: every symbol has a fixed id before training starts, and the
    trainer's own algorithm (same merges rule, `min_frequency`, `vocab_size`, "##" scheme) does the rest on the
    same word counts, fed as words. Runs, thread counts and hash seeds give byte-identical vocabularies (tested).
    """
    alphabet_counts: Counter = Counter()
    continuing: set[str] = set()
    for w, n in words.items():
        for c in w:
            alphabet_counts[c] += n
        continuing.update(w[1:])
    kept = sorted(alphabet_counts, key=lambda c: (-alphabet_counts[c], c))[:limit_alphabet]
    alphabet = sorted(kept)
    continuation = [f"##{c}" for c in sorted(continuing.intersection(kept))]
    fixed = list(dict.fromkeys([*special_tokens, *alphabet, *continuation]))
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()  # the words are normalised and pre-tokenized already
    trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                        limit_alphabet=len(alphabet), initial_alphabet=alphabet,
                                        special_tokens=fixed, continuing_subword_prefix="##",
                                        show_progress=sys.stderr.isatty())
    tok.train_from_iterator(_repeated_words(words), trainer=trainer)
    vocab = tok.get_vocab()
    ordered = sorted(vocab, key=vocab.__getitem__)
    if ordered[: len(fixed)] != fixed or [vocab[t] for t in ordered] != list(range(len(ordered))):
        raise RuntimeError("this version of `tokenizers` numbers the trainer's symbols differently: the vocabulary "
                           "would not be reproducible (bertrain.data.tokenizer.wordpiece_from_counts)")
    return ordered


def train_vocab(inputs: Sequence[str | os.PathLike] | str, output_dir: str | os.PathLike, vocab_size: int = 30522,
                lowercase: bool = True, min_frequency: int = 2, limit_alphabet: int = 1000,
                special_tokens: Sequence[str] = SPECIAL_TOKENS, corpus: CorpusConfig | None = None,
                overwrite: bool = False) -> Path:
    """Train a WordPiece vocabulary on `inputs` (any input `bertrain prepare` reads) and write `output_dir/vocab.txt`
    (and `vocab-stats.json`: inputs, settings, what was read). The same inputs and settings give the same bytes.

    Documents are read, cleaned and split exactly as `prepare` does (see `bertrain.data.readers`), so the vocab
    sees the same text the model will. The folder is locked for the call (`OutputLock`); an existing vocab.txt is
    refused unless `overwrite`, which moves it aside (never deletes it). Returns the path of vocab.txt.
    """
    if isinstance(inputs, (str, os.PathLike)):
        inputs = [inputs]
    inputs = [str(p) for p in inputs]
    if vocab_size < len(special_tokens) + 1:
        raise ValueError(f"vocab_size {vocab_size} is too small: it must exceed the {len(special_tokens)} special tokens")
    if limit_alphabet < 1:  # 0: a vocabulary of the special tokens alone (every word [UNK]); < 0 cut it from the end
        raise ValueError(f"limit_alphabet must be >= 1 (the most characters the vocabulary starts from), got "
                         f"{limit_alphabet}")
    if min_frequency < 0:  # (HF's trainer takes an unsigned count: a traceback)
        raise ValueError(f"min_frequency must be >= 0, got {min_frequency}")
    opts = corpus or CorpusConfig()
    out_dir = Path(output_dir)
    out = out_dir / "vocab.txt"
    settings = {"vocab_size": vocab_size, "lowercase": lowercase, "min_frequency": min_frequency,
                "limit_alphabet": limit_alphabet, "special_tokens": list(special_tokens), **dataclasses.asdict(opts)}
    resolve_inputs(inputs)  # a mistyped input: refused before anything is created
    with OutputLock(out_dir, "vocab"):
        if out.exists() and not overwrite:
            raise UserError(f"{out} already exists{_same_run_note(out_dir, inputs, settings)}; pass --overwrite to "
                            "train it again (the old vocab.txt is moved aside, not deleted), or choose another "
                            "--output")
        t0 = time.perf_counter()
        report = SkipReport()
        counter = WordCounter(lowercase)
        with Progress("vocab: reading", log=logger) as progress:
            for doc in iter_documents(inputs, opts, report, progress=progress):
                counter.add(doc.text)
        report.log(logger, where=str(out_dir / VOCAB_STATS))
        if report.documents == 0:
            raise UserError(f"no text found in {inputs}: {report.summary()}")
        words = counter.words()
        logger.info("vocab: read %d documents in %.1f s; training %d WordPieces on %d distinct words (%d in all)%s",
                    report.documents, time.perf_counter() - t0, vocab_size, len(words), sum(words.values()),
                    "" if sys.stderr.isatty() else " (HF tokenizers: no progress lines until it ends)")
        t1 = time.perf_counter()
        ordered = wordpiece_from_counts(words, vocab_size, min_frequency, limit_alphabet, special_tokens)
        logger.info("vocab: trained in %.1f s", time.perf_counter() - t1)
        text = "\n".join(ordered) + "\n"
        stats = {"inputs": input_fingerprint(inputs), "settings": settings, "num_tokens": len(ordered),
                 "sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(),
                 "num_words": sum(words.values()), "num_distinct_words": len(words),
                 "replaced_characters": report.totals().get("replaced_characters", 0),
                 "seconds": round(time.perf_counter() - t0, 3), "read": report.to_dict()}
        _write_vocab(out_dir, text, stats, overwrite)
    logger.info("wrote %s: %d tokens (%s) from %d documents%s", out, len(ordered),
                "uncased" if lowercase else "cased", report.documents,
                f"; {stats['replaced_characters']} invalid characters replaced" if stats["replaced_characters"] else "")
    return out


def _same_run_note(out_dir: Path, inputs: list[str], settings: dict) -> str:
    """A note for the refusal: whether the existing vocab came from the same inputs and settings."""
    try:
        old = json.loads((out_dir / VOCAB_STATS).read_text(encoding="utf-8"))
        same = old["settings"] == settings and old["inputs"] == input_fingerprint(inputs)
    except (OSError, ValueError, KeyError, TypeError):
        return ""
    return (" (trained on the same inputs with the same settings: it is the vocabulary this command would write)"
            if same else " (trained on other inputs or settings)")


def _write_vocab(out_dir: Path, text: str, stats: dict, overwrite: bool) -> None:
    """vocab.txt and vocab-stats.json: both written under temporary names first, then the old ones moved aside
    (with `overwrite`) and the new ones renamed into place, so a full disk leaves the old files untouched."""
    names = ("vocab.txt", VOCAB_STATS)
    new = [out_dir / f".{name}.new" for name in names]
    try:
        with writing(f"writing the vocabulary to {out_dir}", kept="nothing was written; an earlier vocab.txt "
                     "there is unchanged"):
            out_dir.mkdir(parents=True, exist_ok=True)
            atomic_write_text(new[0], text)
            atomic_write_json(new[1], stats)
        for name in names:
            if overwrite and (out_dir / name).exists():
                logger.info("moved the previous %s aside to %s", name, move_aside(out_dir / name).name)
        with writing(f"renaming the new vocabulary into place in {out_dir}"):
            # vocab.txt last: it is what says a vocabulary is there (`train_vocab` refuses to overwrite it, prepare
            # reads the casing from the stats beside it); a cut between the renames leaves stats alone, redone
            for p, name in reversed(list(zip(new, names))):
                os.replace(p, out_dir / name)
    finally:
        for p in new:
            p.unlink(missing_ok=True)
    fsync_dir(out_dir)
