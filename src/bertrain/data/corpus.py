"""Corpus readers and cleaning: raw inputs -> documents -> cleaned sentences.

Inputs (`resolve_inputs`): files, folders (recursive, sorted), globs, and `builtin:python-docs` (the English text
of Python's own reference documentation, `pydoc_data.topics`, present on every Python installation). The format
is chosen by suffix unless `CorpusOptions.input_format` says otherwise; `.bz2`, `.gz` and `.xz` are decompressed
on the fly:

* `wiki`  (`.xml`, `.xml.bz2`, multistream too): MediaWiki XML dumps; markup stripped with mwparserfromhell
  (templates, tables, references, files, categories removed; links -> their text); redirects, non-article
  namespaces and (by default) disambiguation pages skipped; each article is a document, each line a paragraph.
* `text`  (`.txt` and anything else): documents separated by blank lines (a file without blank lines is one
  document); single newlines inside a document are soft (verse, wrapped paragraphs).
* `lines` (BookCorpus style): one sentence per line, blank lines separate documents.
* `jsonl` (`.jsonl`, `.json`): one JSON object per line, the text in `text_field`.

Reading is streaming (memory does not grow with the corpus). Every problem with the input — invalid UTF-8,
empty files, over-long lines, truncated compressed files, bad JSON lines — is counted per file in a `SkipReport`
and logged with the file name, instead of aborting a long run or passing silently.

Cleaning (`clean_document`, run in the worker processes of `prepare`): markup stripping, NFC normalisation,
control-character removal, sentence splitting (`split_sentences`).
"""
from __future__ import annotations

import bz2
import codecs
import dataclasses
import glob
import gzip
import io
import json
import logging
import lzma
import os
import re
import unicodedata
import xml.etree.ElementTree as ET
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Iterator, Literal

logger = logging.getLogger(__name__)

BUILTIN_PYTHON_DOCS = "builtin:python-docs"
InputFormat = Literal["auto", "wiki", "text", "lines", "jsonl"]

# Lines longer than this are cut into pieces (at whitespace where possible): a 10 MB line without a newline would
# otherwise become one 10 MB "sentence" (and one huge string per worker task).
MAX_LINE_CHARS = 1 << 20
# A "sentence" longer than this (no punctuation for pages) is cut at whitespace: BERT sees at most 512 tokens anyway.
MAX_SENTENCE_CHARS = 4000


@dataclass
class CorpusOptions:
    """How inputs are read and cleaned (shared by `bertrain vocab` and `bertrain prepare`)."""

    input_format: InputFormat = "auto"
    """Input format for every input: auto (by suffix), wiki, text, lines, jsonl."""
    text_field: str = "text"
    """JSONL: the key holding a document's text."""
    min_document_chars: int = 20
    """Documents with fewer characters after cleaning are skipped (counted in the report)."""
    dedupe: bool = False
    """Skip exact duplicate documents (by a hash of their raw text)."""
    skip_disambiguation: bool = True
    """Wikipedia: skip disambiguation pages (title '(disambiguation)' or a disambiguation template)."""

    def __post_init__(self) -> None:
        if self.min_document_chars < 0:
            raise ValueError(f"min_document_chars must be >= 0, got {self.min_document_chars}")
        if not self.text_field:
            raise ValueError("text_field must not be empty")


@dataclass
class RawDocument:
    """A document as read, before cleaning. `kind` picks the cleaning rules (wiki, text, lines, paragraphs)."""

    text: str
    kind: str
    source: str


@dataclass
class Document:
    """A cleaned document: its sentences (non-empty, stripped) and where it came from."""

    sentences: list[str]
    source: str

    @property
    def text(self) -> str:
        return "\n".join(self.sentences)


@dataclass
class SkipReport:
    """Counts of what was read and what was skipped, per file: logged at the end and stored in stats.json."""

    documents: int = 0
    files: int = 0
    input_bytes: int = 0
    counts: dict[str, Counter] = field(default_factory=lambda: defaultdict(Counter))

    def add(self, source: str, what: str, n: int = 1) -> None:
        self.counts[source][what] += n

    def merge(self, other: "SkipReport") -> None:
        self.documents += other.documents
        for src, c in other.counts.items():
            self.counts[src].update(c)

    def totals(self) -> dict[str, int]:
        out: Counter = Counter()
        for c in self.counts.values():
            out.update(c)
        return dict(sorted(out.items()))

    def problems(self) -> dict[str, dict[str, int]]:
        """Per file, the counts that mean something was lost or repaired (everything but plain tallies)."""
        tallies = {"wiki_pages", "wiki_articles"}
        return {src: {k: v for k, v in sorted(c.items()) if k not in tallies and v}
                for src, c in sorted(self.counts.items()) if any(k not in tallies and v for k, v in c.items())}

    def summary(self) -> str:
        t = self.totals()
        return f"{self.files} files, {self.input_bytes} bytes, {self.documents} documents kept; " + \
            (", ".join(f"{k}={v}" for k, v in t.items()) or "nothing skipped")

    def log(self, log: logging.Logger) -> None:
        for src, c in self.problems().items():
            log.warning("%s: %s", src, ", ".join(f"{k}={v}" for k, v in c.items()))
        log.info("read %s", self.summary())

    def to_dict(self) -> dict:
        return {"files": self.files, "input_bytes": self.input_bytes, "documents": self.documents,
                "totals": self.totals(), "problems": self.problems()}


# ----------------------------------------------------------------------------------------------- inputs

def resolve_inputs(inputs: list[str]) -> list[str]:
    """Expand folders (recursively, sorted) and globs into files; keep `builtin:` names. Missing input = error."""
    out: list[str] = []
    for spec in inputs:
        spec = str(spec)
        if spec.startswith("builtin:"):
            if spec != BUILTIN_PYTHON_DOCS:
                raise ValueError(f"unknown built-in corpus {spec!r}; available: {BUILTIN_PYTHON_DOCS}")
            out.append(spec)
        elif any(ch in spec for ch in "*?["):
            matches = sorted(p for p in glob.glob(spec, recursive=True) if os.path.isfile(p))
            if not matches:
                raise ValueError(f"input glob {spec!r} matches no files")
            out.extend(matches)
        elif os.path.isdir(spec):
            files = sorted(str(p) for p in Path(spec).rglob("*") if p.is_file() and not p.name.startswith("."))
            if not files:
                raise ValueError(f"input folder {spec} contains no files")
            out.extend(files)
        elif os.path.isfile(spec):
            out.append(spec)
        else:
            raise ValueError(f"input {spec} does not exist (give files, folders, globs or {BUILTIN_PYTHON_DOCS})")
    return out


def detect_format(path: str) -> str:
    name = path.lower()
    for ext in (".bz2", ".gz", ".xz"):
        if name.endswith(ext):
            name = name[: -len(ext)]
    if name.endswith(".xml"):
        return "wiki"
    if name.endswith((".jsonl", ".json", ".ndjson")):
        return "jsonl"
    return "text"


def _open_binary(path: str) -> IO[bytes]:
    name = path.lower()
    if name.endswith(".bz2"):
        return bz2.open(path, "rb")  # reads multistream files (Wikipedia's *-multistream.xml.bz2) too
    if name.endswith(".gz"):
        return gzip.open(path, "rb")
    if name.endswith(".xz"):
        return lzma.open(path, "rb")
    return open(path, "rb")


class _CountingReader(io.RawIOBase):
    """Wraps a binary stream; counts bytes read (the uncompressed input size) and turns a truncated compressed
    stream into a clean end of file, remembering that it happened."""

    def __init__(self, raw: IO[bytes]):
        self.raw = raw
        self.nbytes = 0
        self.truncated: str | None = None

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:  # type: ignore[override]
        if self.truncated:
            return 0
        try:
            data = self.raw.read(len(b))
        except (EOFError, OSError, lzma.LZMAError) as e:  # bz2/gzip/lzma raise these on a cut-off file
            self.truncated = f"{type(e).__name__}: {e}"
            return 0
        n = len(data)
        b[:n] = data
        self.nbytes += n
        return n

    def close(self) -> None:
        self.raw.close()
        super().close()


def _text_lines(reader: _CountingReader, source: str, report: SkipReport) -> Iterator[str]:
    """Decode UTF-8 line by line (each with its "\n"); see `_text_blocks`."""
    for block in _text_blocks(reader, source, report):
        lines = block.split("\n")
        last = lines.pop()
        for line in lines:
            yield line + "\n"
        if last:
            yield last


_BLOCK_BYTES = 1 << 20  # what `_text_blocks` reads at a time


def _text_blocks(reader: _CountingReader, source: str, report: SkipReport) -> Iterator[str]:
    """Decode UTF-8 in blocks of whole lines ("\n"-terminated, except maybe the file's last); invalid bytes become
    U+FFFD (counted), over-long lines are cut into pieces (counted), each piece then a block of its own."""
    buffered = io.BufferedReader(reader, buffer_size=1 << 20)
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    # Fast path: whole ~1 MB blocks of complete lines, decoded and split at once (a newline byte is never part of
    # a UTF-8 sequence, so this decodes exactly like line by line). A block with a line that readline() would cut
    # (MAX_LINE_CHARS bytes or more) is handed, with everything after it, to the line-by-line loop below.
    carry = b""
    while True:
        data = buffered.read(_BLOCK_BYTES)
        block = carry + data if carry else data
        if not block:
            return
        if data:
            nl = block.rfind(b"\n")
            carry, block = block[nl + 1:], block[:nl + 1]
        else:
            carry = b""
        if len(carry) >= MAX_LINE_CHARS or (block and max(map(len, block.split(b"\n"))) >= MAX_LINE_CHARS):
            buffered = _Prepend(block + carry, buffered)
            break
        if not block:
            continue
        text = decoder.decode(block)
        if "\ufffd" in text:
            report.add(source, "invalid_utf8_sequences", text.count("\ufffd"))
        if text:
            yield text
        if not data:
            return
    while True:
        line = buffered.readline(MAX_LINE_CHARS)
        if not line:
            break
        if len(line) >= MAX_LINE_CHARS and not line.endswith(b"\n"):
            report.add(source, "long_line_pieces")
            # Cut at the last whitespace so a word is not split; the remainder starts the next piece.
            cut = max(line.rfind(b" "), line.rfind(b"\t"))
            if cut > MAX_LINE_CHARS // 2:
                rest = line[cut + 1:]
                line = line[:cut] + b"\n"
                buffered = _Prepend(rest, buffered)
        text = decoder.decode(line)
        if "\ufffd" in text:
            bad = text.count("\ufffd")
            report.add(source, "invalid_utf8_sequences", bad)
        yield text


class _Prepend:
    """A tiny readline() source: `head` bytes first, then `rest` (for cutting over-long lines)."""

    def __init__(self, head: bytes, rest):
        self.head = head
        self.rest = rest

    def readline(self, limit: int) -> bytes:
        if self.head:
            nl = self.head.find(b"\n")
            if 0 <= nl < limit:
                out, self.head = self.head[: nl + 1], self.head[nl + 1:]
                return out
            if len(self.head) >= limit:
                out, self.head = self.head[:limit], self.head[limit:]
                return out
            out, self.head = self.head, b""
            return out + self.rest.readline(limit - len(out))
        return self.rest.readline(limit)


# A maximal run of non-blank lines (a blank line is empty or whitespace only, as str.strip() sees it: re's \s is
# the same Unicode whitespace), each with its "\n", or the text's unterminated last line.
_NON_BLANK_LINES = re.compile(r"(?:[^\n]*\S[^\n]*(?:\n|\Z))+")


def _read_text(path: str, kind: str, report: SkipReport) -> Iterator[RawDocument]:
    """Blank-line separated documents (`text`, `lines`): each document is a maximal run of non-blank lines.

    Found with one regex pass per decoded block rather than a Python loop over lines (that loop was the main
    process's largest cost in `prepare`, ~20 ms per MB, while the workers waited for their first chunk). A run that
    reaches a block's end may go on in the next block; block ends are line ends (or pieces of over-long lines,
    which count as lines)."""
    with _CountingReader(_open_binary(path)) as reader:
        pending: list[str] = []  # the document being read, when it may go on in the next block
        for block in _text_blocks(reader, path, report):
            matched = False
            for m in _NON_BLANK_LINES.finditer(block):
                matched = True
                if pending and m.start() > 0:  # blank lines came first: the pending document is complete
                    yield RawDocument("".join(pending), kind, path)
                    pending = []
                pending.append(m.group())
                if m.end() < len(block):  # a blank line follows in this block
                    yield RawDocument("".join(pending), kind, path)
                    pending = []
            if pending and not matched:  # a block of blank lines only
                yield RawDocument("".join(pending), kind, path)
                pending = []
        if pending:
            yield RawDocument("".join(pending), kind, path)
        _account_file(reader, path, report)



def _account_file(reader: "_CountingReader", path: str, report: SkipReport,
                  kept: str = "what was read before the cut") -> None:
    """After a file is read: count its bytes, and report it if it was empty or cut short (a truncated bz2)."""
    report.input_bytes += reader.nbytes
    if reader.nbytes == 0:
        report.add(path, "empty_files")
    if reader.truncated:
        report.add(path, "truncated_files")
        logger.warning("%s is truncated (%s); kept %s", path, reader.truncated, kept)

def _read_jsonl(path: str, text_field: str, report: SkipReport) -> Iterator[RawDocument]:
    with _CountingReader(_open_binary(path)) as reader:
        for lineno, line in enumerate(_text_lines(reader, path, report), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                report.add(path, "bad_json_lines")
                if report.counts[path]["bad_json_lines"] <= 3:
                    logger.warning("%s line %d is not valid JSON; skipped", path, lineno)
                continue
            text = obj.get(text_field) if isinstance(obj, dict) else None
            if not isinstance(text, str):
                report.add(path, f"lines_without_{text_field}")
                continue
            yield RawDocument(text, "text", path)
        _account_file(reader, path, report)


_DISAMBIG = re.compile(r"\{\{\s*(disambig[^}|]*|dab|disamb|geodis|hndis|set index[^}|]*|[^}|]*disambiguation)\s*[|}]",
                       re.IGNORECASE)


def _read_wiki(path: str, opts: CorpusOptions, report: SkipReport) -> Iterator[RawDocument]:
    """Stream pages out of a MediaWiki XML dump (expat via iterparse; elements are freed as we go)."""
    reader = _CountingReader(_open_binary(path))
    try:
        context = ET.iterparse(io.BufferedReader(reader, buffer_size=1 << 20), events=("start", "end"))
        root = None
        title = ns = text = None
        redirect = False
        try:
            for event, elem in context:
                tag = elem.tag.rsplit("}", 1)[-1]
                if event == "start":
                    if root is None:
                        root = elem
                    if tag == "page":
                        title, ns, text, redirect = None, None, None, False
                    continue
                if tag == "title":
                    title = elem.text or ""
                elif tag == "ns":
                    ns = (elem.text or "").strip()
                elif tag == "redirect":
                    redirect = True
                elif tag == "text":
                    text = elem.text or ""
                elif tag == "page":
                    report.add(path, "wiki_pages")
                    if ns not in (None, "0"):
                        report.add(path, "wiki_non_article_namespace")
                    elif redirect or (text or "").lstrip()[:9].lower() == "#redirect":
                        report.add(path, "wiki_redirects")
                    elif not text:
                        report.add(path, "wiki_empty_pages")
                    else:
                        report.add(path, "wiki_articles")
                        if opts.skip_disambiguation and ("(disambiguation)" in (title or "") or _DISAMBIG.search(text)):
                            report.add(path, "wiki_disambiguation")
                        else:
                            yield RawDocument(text, "wiki", f"{path}#{title}")
                    root.clear()  # free the finished page (memory flat in the dump size)
        except ET.ParseError as e:
            if reader.truncated or "no element found" in str(e) or "unclosed token" in str(e):
                reader.truncated = reader.truncated or f"XML ends early: {e}"
            else:
                raise ValueError(f"{path} is not a valid MediaWiki XML dump: {e}") from None
    finally:
        reader.close()
    _account_file(reader, path, report, kept=f"the {report.counts[path]['wiki_pages']} complete pages before the cut")


def _read_builtin_python_docs(report: SkipReport) -> Iterator[RawDocument]:
    from pydoc_data.topics import topics  # shipped with CPython: ~465 KB of English reference text

    for name in sorted(topics):
        text = topics[name]
        report.input_bytes += len(text.encode("utf-8"))
        yield RawDocument(text, "paragraphs", f"{BUILTIN_PYTHON_DOCS}#{name}")


def iter_raw_documents(inputs: list[str], opts: CorpusOptions, report: SkipReport) -> Iterator[RawDocument]:
    """Every raw document of every input, in a deterministic order (inputs as given, folders sorted)."""
    for path in resolve_inputs(inputs):
        report.files += 1
        if path == BUILTIN_PYTHON_DOCS:
            yield from _read_builtin_python_docs(report)
            continue
        fmt = opts.input_format if opts.input_format != "auto" else detect_format(path)
        if fmt == "wiki":
            yield from _read_wiki(path, opts, report)
        elif fmt == "jsonl":
            yield from _read_jsonl(path, opts.text_field, report)
        else:
            yield from _read_text(path, fmt, report)


def iter_documents(inputs: list[str], opts: CorpusOptions, report: SkipReport,
                   batch_chars: int = 1 << 18) -> Iterator[Document]:
    """Read, clean and split in this process (for `bertrain vocab`; `prepare` cleans in worker processes).
    Documents are cleaned in batches of ~`batch_chars` of one kind (`clean_documents`: same result, faster)."""
    seen: set[bytes] | None = set() if opts.dedupe else None
    batch: list[RawDocument] = []
    size = 0

    def flush() -> Iterator[Document]:
        for raw, sentences in zip(batch, clean_documents([r.text for r in batch], batch[0].kind)):
            if sum(map(len, sentences)) < max(1, opts.min_document_chars):
                report.add(raw.source.split("#")[0], "short_documents")
                continue
            report.documents += 1
            yield Document(sentences, raw.source)

    for raw in iter_raw_documents(inputs, opts, report):
        if seen is not None:
            h = doc_hash(raw.text)
            if h in seen:
                report.add(raw.source.split("#")[0], "duplicate_documents")
                continue
            seen.add(h)
        if batch and (raw.kind != batch[0].kind or size >= batch_chars):
            yield from flush()
            batch, size = [], 0
        batch.append(raw)
        size += len(raw.text)
    if batch:
        yield from flush()


def doc_hash(text: str) -> bytes:
    import hashlib

    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=12).digest()


# ----------------------------------------------------------------------------------------------- cleaning

# C0/C1 controls except tab/newline, zero-width chars, BOM, and U+FFFD left by invalid UTF-8.
_CONTROL = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\u200b-\u200f\u2028\u2029\ufeff\ufffd]")
_ASCII_CONTROL = bytes([*range(0x00, 0x09), 0x0b, 0x0c, *range(0x0e, 0x20), 0x7f])  # _CONTROL's ASCII part
_ASCII_CONTROL_BUT_NUL = _ASCII_CONTROL[1:]
_CONTROL_BUT_NUL = re.compile("[\x01-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\u200b-\u200f\u2028\u2029\ufeff\ufffd]")
# Runs of 2+ spaces, or one space that is not " ": a plain single space matches nothing, so the usual text costs
# no substitutions (matching every single space was 80% of `normalize_text`). Same output as `[...]+` -> " ".
# One leading class, not a top-level alternation, so that re scans for it in C (28 -> 6 ms per MB).
_SPACES = re.compile(r"[ \t\u00a0\u2000-\u200a\u202f\u205f\u3000]"
                     r"(?:[ \t\u00a0\u2000-\u200a\u202f\u205f\u3000]+|(?<=[^ ]))")


_ODD_SPACE = re.compile(r"[\t\u00a0\u2000-\u200a\u202f\u205f\u3000]")
_SPACE_RUN = re.compile("  [ ]*")  # = " {2,}", but written so that re searches for the literal "  "


def normalize_text(text: str, keep_nul: bool = False) -> str:
    """NFC normalisation, control characters removed, runs of spaces collapsed (newlines kept).

    `keep_nul` keeps NUL characters (the document separator of `clean_documents`)."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    if text.isascii():  # O(1) in CPython. NFC is the identity; bytes.translate deletes controls ~10x faster than re
        raw = text.encode("ascii")
        kept = raw.translate(None, _ASCII_CONTROL_BUT_NUL if keep_nul else _ASCII_CONTROL)
        if len(kept) != len(raw):
            text = kept.decode("ascii")
        odd_space = "\t" in text
    else:
        text = (_CONTROL_BUT_NUL if keep_nul else _CONTROL).sub("", unicodedata.normalize("NFC", text))
        odd_space = _ODD_SPACE.search(text) is not None
    # Python's re tries a match at every candidate position (every space, for `_SPACES`); a single-class search
    # and a literal search are C scans. So clean text skips the substitution, and text whose only odd spacing is
    # runs of plain spaces (the usual case) uses the literal-prefix pattern (same result, 12 -> 1 ms per MB).
    if odd_space:
        text = _SPACES.sub(" ", text)
    elif "  " in text:
        text = _SPACE_RUN.sub(" ", text)
    return text


def _strip_rule_lines(text: str) -> str:
    if any(c * 4 in text for c in "*=~^#_+-"):  # cheap C substring tests before the line regex
        text = _RULE_LINE.sub("", text)
    return text


# Decoration lines (reST/Markdown underlines, "*****" separators) are not sentences.
_RULE_LINE = re.compile(r"^[ \t]*([*=~^#_+-])\1{3,}[ \t]*$", re.MULTILINE)


def clean_document(text: str, kind: str) -> list[str]:
    """Raw document text -> cleaned sentences, by the rules of its `kind`."""
    return clean_documents([text], kind)[0]


# Why batched: Tiny Shakespeare has ~7,000 documents per MB, and cleaning them one call at a time spent most of its
# time in per-call overhead (normalise, rule lines, paragraph split and a splitter call per paragraph: 0.06 CPU s per
# MB, 40% of tokenizing). Joining a chunk's documents with a separator and running each step once over the whole
# text gives the same sentences (each step is per character or per line, and the separator is a line of its own that
# no step changes or crosses) at a fraction of the cost.
# NUL, kept through normalisation by `keep_nul` (real text has none: checked, and documents go one by one if it
# does). An ASCII separator keeps ASCII text ASCII, so CPython's 1-byte-string fast paths (NFC quick check, re)
# still apply: a non-ASCII one made normalising the joined text 2x slower than document by document.
_DOC_SEP = "\n\x00\n"
_PARAGRAPH_BREAK = re.compile(r"\n\s*\n")
# After normalisation no C0 control is left (see _CONTROL), so these mark the boundaries in the joined text.
_PARA_MARK, _DOC_MARK = "\x02", "\x03"


def clean_documents(texts: list[str], kind: str) -> list[list[str]]:
    """`clean_document` for many documents of one kind at once (same result, much faster for short documents)."""
    if kind == "wiki":
        texts = [strip_wiki_markup(t) for t in texts]
    if len(texts) > 1:
        joined = _DOC_SEP.join(texts)
        if joined.count("\x00") == len(texts) - 1:  # else some document holds a NUL itself: one by one
            return _clean_joined(joined, kind, len(texts))
    return [_clean_joined(t, kind, 1)[0] for t in texts]


def _clean_joined(text: str, kind: str, n_docs: int) -> list[list[str]]:
    """Normalised, rule lines removed, split into sentences: one list per document of `_DOC_SEP`-joined `text`."""
    text = _strip_rule_lines(normalize_text(text, keep_nul=n_docs > 1))
    if n_docs > 1:
        text = text.replace(_DOC_SEP, _DOC_MARK)
    if kind == "lines":  # one sentence per line already
        return [[s for s in (line.strip() for line in doc.split("\n")) if s] for doc in text.split(_DOC_MARK)]
    if kind == "wiki":  # every line is a paragraph
        text = text.replace("\n", _PARA_MARK)
    else:  # blank lines separate paragraphs; single newlines are soft
        text = _PARAGRAPH_BREAK.sub(_PARA_MARK, text).replace("\n", " ")
    docs = _split_marked(text, MAX_SENTENCE_CHARS)
    assert len(docs) == n_docs, (len(docs), n_docs)
    return docs


# ----------------------------------------------------------------------------------------------- sentences

# Why a hand-written splitter: pysbd (the maintained rule-based splitter that works offline) segments 86 KB/s
# here (measured on Tiny Shakespeare), 70x slower than the 6 MB/s this pipeline targets; NLTK punkt needs data
# that cannot be downloaded here. This regex + abbreviation check runs at ~30 MB/s (see BENCHMARKS.md) and
# handles what matters for BERT's sentence-pair task: ., ! and ? followed by space and an upper-case letter,
# digit or opening quote, except after common abbreviations, initials (J. R. R.) and dotted acronyms (U.S.).
# A sentence end: end punctuation, closing quotes/brackets, whitespace (group 1), then a capital or digit.
_SENTENCE_END_TAIL = r"[\"'\u2019\u201d)\]]*(\s+)(?=[\"'\u2018\u201c(\[]?[A-Z0-9\u00c0-\u00de])"
# A sentence end, or a paragraph/document mark (group 1 is None for a mark). Written to start with one character
# class (a top-level alternation would not): CPython's re then scans for that class in C instead of trying a match
# at every position (30 -> 13 ms per MB). `[.!?\u2026]` then `[.!?\u2026]*` is the `[.!?\u2026]+` of a sentence end.
_BOUNDARY = re.compile(f"[{_PARA_MARK}{_DOC_MARK}.!?\u2026](?:(?<=[{_PARA_MARK}{_DOC_MARK}])|"
                       f"[.!?\u2026]*{_SENTENCE_END_TAIL})")
_ABBREVIATIONS = frozenset("""
mr mrs ms dr prof sr jr st mt ft rev gen col lt sgt capt cmdr adm gov sen rep pres hon fr
no nos vol vols fig figs eq eqs ch chap sec art p pp ed eds op cit cf ca approx est dept univ inc ltd co corp bros
jan feb mar apr jun jul aug sep sept oct nov dec mon tue wed thu fri sat sun
vs etc al e.g i.e viz e.g. i.e. a.m p.m u.s u.k
""".split())


def split_sentences(paragraph: str, max_chars: int = MAX_SENTENCE_CHARS) -> list[str]:
    """Split one paragraph (no newlines) into sentences; sentences longer than `max_chars` are cut at spaces."""
    return _split_marked(paragraph.replace(_PARA_MARK, " ").replace(_DOC_MARK, " "), max_chars)[0]


def _split_marked(text: str, max_chars: int) -> list[list[str]]:
    """Sentences of `text`, whose paragraphs end at `_PARA_MARK` and documents at `_DOC_MARK`: one list per
    document. One regex pass over the whole text (not a call per paragraph: see `clean_documents`)."""
    docs: list[list[str]] = []
    out: list[str] = []
    start = 0

    def emit(s: str) -> None:
        s = s.strip()
        while len(s) > max_chars:
            cut = s.rfind(" ", max_chars // 2, max_chars)
            cut = cut if cut > 0 else max_chars
            out.append(s[:cut].strip())
            s = s[cut:].strip()
        if s:
            out.append(s)

    for m in _BOUNDARY.finditer(text):
        end = m.start(1)
        if end < 0:  # a paragraph or document mark
            emit(text[start:m.start()])
            if text[m.start()] == _DOC_MARK:
                docs.append(out)
                out = []
            start = m.end()
            continue
        punct = text[m.start():end].rstrip("\"'\u2019\u201d)]")
        if punct == ".":  # only a single '.' can end an abbreviation
            ws = text.rfind(" ", start, m.start())
            word = text[ws + 1 if ws >= 0 else start: m.start()].lstrip("\"'(\u2018\u201c[")
            if word.lower() in _ABBREVIATIONS or (len(word) == 1 and word.isalpha()) or ("." in word and len(word) <= 8):
                continue
        emit(text[start:end])
        start = m.end()
    emit(text[start:])
    docs.append(out)
    return docs


# ----------------------------------------------------------------------------------------------- wiki markup

_DROP_TAGS = frozenset("""ref references table gallery math chem ce score timeline imagemap graph mapframe
maplink syntaxhighlight source pre code templatedata templatestyles hiero inputbox categorytree poem
nowiki noinclude includeonly onlyinclude div span sup sub small big center font""".split()) - {
    "span", "sup", "sub", "small", "big", "center", "font", "nowiki", "div", "poem"}
_KEEP_CONTENT_TAGS = frozenset("b i u s strong em span small big sup sub center font abbr cite q nowiki div poem "
                               "blockquote li dd dt p tt var kbd".split())
_DROP_SECTIONS = frozenset({"references", "external links", "see also", "further reading", "notes", "bibliography",
                            "sources", "footnotes", "citations", "notes and references", "works cited"})
_LINK_DROP_PREFIXES = ("file:", "image:", "category:", "media:", "wikt:", "wiktionary:", "s:", "commons:")
_INTERWIKI = re.compile(r"^:?[a-z]{2,3}(-[a-z]+)?:")
_LEFTOVER_REF = re.compile(r"<ref[^>]*/>|<ref[^>]*>.*?</ref>|</?ref[^>]*>", re.IGNORECASE | re.DOTALL)
_LEFTOVER_TAG = re.compile(r"</?[a-zA-Z][^<>]{0,200}>")
_LEFTOVER_MARKUP = re.compile(r"\{\{|\}\}|\[\[|\]\]|\{\||\|\}|'{2,}")
_MULTI_SPACE = re.compile(r" {2,}")
_SPACE_PUNCT = re.compile(r" +([.,;:!?](?:\s|$))")
_TABLE_LINE = re.compile(r"^\s*(\{\||\|\}|\|-|\||!)")


_PRE_COMMENT = re.compile(r"<!--.*?(-->|$)", re.DOTALL)
_PRE_REF = re.compile(r"<ref\b[^>]*/>|<ref\b[^>]*>.*?</ref\s*>", re.IGNORECASE | re.DOTALL)
_BRACES = re.compile(r"\{\{|\}\}")


def _remove_templates(text: str) -> str:
    """Drop balanced {{...}} spans (templates carry no running text) with one C-regex scan.

    Why before mwparserfromhell: templates and citation references are most of an article's markup, and building
    their node trees in mwparserfromhell's Python builder was ~60% of the cleaning time (profiled on the shared
    Wikipedia sample); removing them first roughly halves the cost of `strip_wiki_markup`.
    """
    out: list[str] = []
    depth = 0
    last = 0
    for m in _BRACES.finditer(text):
        if m.group() == "{{":
            if depth == 0:
                out.append(text[last:m.start()])
            depth += 1
        elif depth:
            depth -= 1
            if depth == 0:
                last = m.end()
    if depth == 0:
        out.append(text[last:])
    return "".join(out)


# A plain internal link: no nested brackets, braces, tags or newlines in it (those are left to mwparserfromhell).
_PRE_LINK = re.compile(r"\[\[([^\[\]{}<>|\n]+)(?:\|([^\[\]{}<>\n]*))?\]\]")


def _link_text(m: re.Match) -> str:
    """What `_render_node` gives for a plain wikilink, done on the source text (see `strip_wiki_markup`)."""
    title, text = m.group(1).strip(), m.group(2)
    low = title.lower()
    if low.startswith(_LINK_DROP_PREFIXES) or _INTERWIKI.match(low):
        return ""
    if text is not None:
        return text
    return title.lstrip(":").split("#")[0] if not title.startswith("#") else title[1:]


_TABLE_EDGE = re.compile(r"^[ \t]*(\{\||\|\})", re.MULTILINE)
_LIST_MARK = re.compile(r"^[*#]+", re.MULTILINE)


def _remove_tables(text: str) -> str:
    """Drop balanced tables ({| at a line start .. |} at a line start) like `_remove_templates` drops templates:
    the renderer drops every table anyway, and their cells were ~40% of the nodes left for mwparserfromhell.
    An unclosed table is left to mwparserfromhell."""
    if "{|" not in text:
        return text
    out: list[str] = []
    depth = 0
    last = 0
    opened = 0
    for m in _TABLE_EDGE.finditer(text):
        if m.group(1) == "{|":
            if depth == 0:
                out.append(text[last:m.start()])
                opened = m.start()
            depth += 1
        elif depth:
            depth -= 1
            if depth == 0:
                last = m.end()
    out.append(text[opened:] if depth else text[last:])
    return "".join(out)


def strip_wiki_markup(wikitext: str) -> str:
    """MediaWiki markup -> plain text, one paragraph per line (headings and tail sections dropped)."""
    import mwparserfromhell

    wikitext = _remove_templates(_PRE_REF.sub("", _PRE_COMMENT.sub("", wikitext)))
    # Plain [[title|text]] links are most of the remaining nodes, and mwparserfromhell's Python builder spends
    # ~3 us per node: replacing them by their text with one regex first halves what is left of the parse (same
    # rules as `_render_node`; the text stays wikitext, so entities and leftovers are handled as before).
    wikitext = _PRE_LINK.sub(_link_text, _remove_tables(wikitext))
    # Bullets and numbers of list items: rendered as nothing (the node would be a Tag per item).
    wikitext = _LIST_MARK.sub("", wikitext)
    code = mwparserfromhell.parse(wikitext, skip_style_tags=True)
    parts: list[str] = []
    skip_level = 0  # > 0 while inside a dropped section (References, See also, ...) of that heading level
    for node in code.nodes:
        if isinstance(node, mwparserfromhell.nodes.Heading):
            title = _render(node.title).strip().lower()
            if skip_level and node.level > skip_level:
                continue
            skip_level = node.level if title in _DROP_SECTIONS else 0
            parts.append("\n")
            continue
        if not skip_level:
            parts.append(_render_node(node))
    text = "".join(parts)
    # Safety net for malformed markup mwparserfromhell leaves as text (unbalanced braces, stray tags).
    text = _LEFTOVER_REF.sub("", text)
    text = _LEFTOVER_TAG.sub("", text)
    lines = []
    for line in text.split("\n"):
        if _TABLE_LINE.match(line):
            continue
        # Removed templates/refs leave double spaces and "word ." behind.
        line = _SPACE_PUNCT.sub(r"\1", _MULTI_SPACE.sub(" ", _LEFTOVER_MARKUP.sub("", line))).strip()
        if line.startswith(("*", "#", ":", ";")):
            line = line.lstrip("*#:; ")
        if line:
            lines.append(line)
    return "\n".join(lines)


def _render(code) -> str:
    return "".join(_render_node(n) for n in code.nodes)


def _render_node(node) -> str:
    import mwparserfromhell.nodes as N

    if isinstance(node, N.Text):
        return node.value
    if isinstance(node, N.Wikilink):
        title = str(node.title).strip()
        low = title.lower()
        if low.startswith(_LINK_DROP_PREFIXES) or _INTERWIKI.match(low):
            return ""
        if node.text is not None:
            return _render(node.text)
        return title.lstrip(":").split("#")[0] if not title.startswith("#") else title[1:]
    if isinstance(node, N.Tag):
        if node.wiki_markup == "{|":
            return ""
        tag = str(node.tag).strip().lower()
        if tag == "br":
            return " "
        if tag in _DROP_TAGS or node.contents is None or node.self_closing:
            return ""
        if tag in _KEEP_CONTENT_TAGS or node.wiki_markup:
            return _render(node.contents)
        return ""
    if isinstance(node, N.ExternalLink):
        return _render(node.title) if node.title is not None else ""
    if isinstance(node, N.HTMLEntity):
        try:
            return node.normalize()
        except (ValueError, OverflowError):
            return ""
    # Templates, comments, parser arguments, headings inside tags: no running text.
    return ""


def options_from_dict(d: dict) -> CorpusOptions:
    names = {f.name for f in dataclasses.fields(CorpusOptions)}
    return CorpusOptions(**{k: v for k, v in d.items() if k in names})
