"""Corpus readers: raw inputs -> documents (`iter_raw_documents`), and cleaned documents (`iter_documents`).

Inputs (`resolve_inputs`): files, folders (recursive, sorted; hidden files and folders skipped), globs, HF `datasets`
folders (`save_to_disk`: their Arrow files in order), and `builtin:python-docs` (the English text of Python's own
reference documentation, `pydoc_data.topics`, present on every Python installation); one run may mix them all.
The format is chosen by suffix unless `CorpusConfig.input_format` says otherwise; `.bz2`, `.gz`, `.xz` and `.zst`
are decompressed on the fly:

* `wiki`  (`.xml`, `.xml.bz2`, multistream too): MediaWiki XML dumps (markup stripped by
  `bertrain.data.wikitext`); redirects, non-article namespaces and (by default) disambiguation pages skipped; each
  article is a document, each line a paragraph.
* `text`  (`.txt` and anything else): documents separated by blank lines (a file without blank lines is one
  document, cut every `MAX_DOCUMENT_CHARS`); single newlines inside a document are soft (verse, wrapped paragraphs).
* `lines` (BookCorpus style): one sentence per line, blank lines separate documents.
* `jsonl` (`.jsonl`, `.json`, `.ndjson`): one JSON object per line, the text in `text_field`.
* `parquet` (`.parquet`: the Hugging Face Hub's layout, LDDL's) and `arrow` (`.arrow`: the files of a `datasets`
  folder): one document per row, the text in the string column `text_field` (`--text-column`, default `text`);
  read a record batch at a time (`bertrain.data.tables`; pyarrow from the `data` extra, imported only then). A
  missing column or one that is not a string column is one error naming the file, the column and the columns
  there are.

Decoding is strict (`bertrain.data.decoding`): text is UTF-8 unless `CorpusConfig.encoding` names another
(ASCII-compatible) encoding, and a file that is not text is refused with a `UserError` naming the file and the byte
offset. Fewer invalid bytes are replaced (U+FFFD, then dropped by cleaning) and counted as `replaced_characters`.

Reading is streaming (memory does not grow with the corpus). Every lesser problem with the input — replaced
characters, empty files, over-long lines, truncated compressed files, bad JSON lines — is counted per file in a
`SkipReport` and logged with the file name (the first few files; the rest are summed up in one line), instead of
aborting a long run or passing silently. Cleaning is `bertrain.data.cleaning` (run in the worker processes of
`prepare`).
"""
from __future__ import annotations

import glob
import hashlib
import io
import json
import logging
import os
import re
import typing
import xml.etree.ElementTree as ET
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Literal

from bertrain.data.cleaning import clean_documents
from bertrain.data.decoding import (COMPRESSED_SUFFIXES, CountingReader, InputProgress, check_encoding, text_blocks,
                                    text_lines)
from bertrain.data.progress import Progress
from bertrain.data.tables import dataset_files, dataset_splits
from bertrain.utils.errors import UserError

logger = logging.getLogger(__name__)

BUILTIN_PYTHON_DOCS = "builtin:python-docs"
InputFormat = Literal["auto", "wiki", "text", "lines", "jsonl", "parquet", "arrow"]
INPUT_FORMATS: tuple[str, ...] = typing.get_args(InputFormat)

# Per-file warnings logged one by one; the rest are summed up in one line (stats.json lists every file).
MAX_WARNINGS = 10


@dataclass
class CorpusConfig:
    """How inputs are read and cleaned (shared by `bertrain vocab` and `bertrain prepare`)."""

    input_format: InputFormat = "auto"
    """Input format for every input: auto (by suffix), wiki, text, lines, jsonl, parquet, arrow."""
    text_field: str = "text"
    """JSONL: the key holding a document's text; Parquet and Arrow (`datasets` folders): the text column."""
    min_document_chars: int = 20
    """Documents with fewer characters after cleaning are skipped (counted in the report)."""
    dedupe: bool = False
    """Skip exact duplicate documents (by a hash of their raw text)."""
    skip_disambiguation: bool = True
    """Wikipedia: skip disambiguation pages (title '(disambiguation)' or a disambiguation template)."""
    encoding: str = "utf-8"
    """Encoding of text, lines and JSONL inputs (latin-1, cp1252, ...; XML dumps declare their own)."""

    def __post_init__(self) -> None:
        if self.min_document_chars < 0:
            raise ValueError(f"min_document_chars must be >= 0, got {self.min_document_chars}")
        if not self.text_field:
            raise ValueError("text_field must not be empty")
        check_encoding(self.encoding)



@dataclass
class RawDocument:
    """A document as read, before cleaning. `kind` picks the cleaning rules (wiki, text, lines, paragraphs)."""

    text: str
    kind: str
    file: str
    """The input it came from (a path, or builtin:python-docs): what the skip report counts under."""
    name: str = ""
    """Within `file`: a Wikipedia page's title, a built-in document's name; "" for a file that is one stream."""

    @property
    def source(self) -> str:
        """`file#name` (a page of a dump), or `file`."""
        return f"{self.file}#{self.name}" if self.name else self.file


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
    warnings: int = 0  # warnings given through `warn` (the first MAX_WARNINGS were logged)

    def add(self, source: str, what: str, n: int = 1) -> None:
        self.counts[source][what] += n

    def warn(self, msg: str, *args: object) -> None:
        """Log a warning about one input, or only count it once MAX_WARNINGS were logged (summed up in `log`)."""
        self.warnings += 1
        if self.warnings <= MAX_WARNINGS:
            logger.warning(msg, *args)

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

    def log(self, log: logging.Logger, where: str = "stats.json") -> None:
        """The files with problems (the first MAX_WARNINGS, then one line for the rest) and the summary."""
        problems = self.problems()
        for src, c in list(problems.items())[:MAX_WARNINGS]:
            log.warning("%s: %s", src, ", ".join(f"{k}={v}" for k, v in c.items()))
        if len(problems) > MAX_WARNINGS:
            log.warning("... and %d more files with problems (every file is listed in %s)",
                        len(problems) - MAX_WARNINGS, where)
        if self.warnings > MAX_WARNINGS:
            log.warning("%d more warnings about single inputs were not shown (counted in %s)",
                        self.warnings - MAX_WARNINGS, where)
        log.info("read %s", self.summary())

    def to_dict(self) -> dict:
        return {"files": self.files, "input_bytes": self.input_bytes, "documents": self.documents,
                "totals": self.totals(), "problems": self.problems()}


# ----------------------------------------------------------------------------------------------- inputs

def resolve_inputs(inputs: list[str]) -> list[str]:
    """Expand folders (`_folder_files`) and globs into files; keep `builtin:` names. Missing input = error."""
    out: list[str] = []
    for spec in inputs:
        spec = str(spec)
        if spec.startswith("builtin:"):
            if spec != BUILTIN_PYTHON_DOCS:
                raise ValueError(f"unknown built-in corpus {spec!r}; available: {BUILTIN_PYTHON_DOCS}")
            out.append(spec)
        elif any(ch in spec for ch in "*?["):
            # A folder it matches is read as a folder input (`corpora/*` with a folder per source, Hub language
            # folders `wikipedia/20231101.*`); what it matches inside such a folder (`data/**` matches the folders
            # and their files) is read with that folder, once.
            matches: list[str] = []
            folders: list[str] = []
            for p in sorted(glob.glob(spec, recursive=True)):
                if any(os.path.normpath(p).startswith(f) for f in folders):
                    continue
                parent = os.path.dirname(p) or "."
                if os.path.isfile(p) and (dataset_files(parent) is not None or _is_dataset_dict(parent)):
                    # a file of a `datasets` folder (`hub/ds/*`): the folder, read once (its state.json and
                    # dataset_info.json were read as JSON Lines text, 25 warnings of invalid JSON)
                    folders.append(os.path.join(os.path.normpath(parent), ""))
                    matches.extend(_folder_files(parent))
                elif os.path.isfile(p):
                    matches.append(p)
                elif os.path.isdir(p):
                    folders.append(os.path.join(os.path.normpath(p), ""))
                    matches.extend(_folder_files(p))
            if not matches:
                raise UserError(f"input glob {spec!r} matches no files")
            out.extend(matches)
        elif os.path.isdir(spec):
            files = _folder_files(spec)
            if not files:
                raise UserError(f"input folder {spec} contains no files")
            out.extend(files)
        elif os.path.isfile(spec):
            out.append(spec)
        elif os.path.exists(spec):
            raise UserError(f"input {spec} is neither a file nor a folder")
        else:
            raise UserError(f"input {spec} does not exist (give files, folders, globs or {BUILTIN_PYTHON_DOCS})")
    return out


def _folder_files(folder: str) -> list[str]:
    """The files of a folder, recursively, sorted by path, without hidden files or folders (`.git`, the `.cache` of
    a Hub download). A `datasets` folder in it (or `folder` itself) gives, where its first file sorts, its Arrow
    files in their state.json order and nothing else (state.json, dataset_info.json are not text); a DatasetDict
    folder gives those of each split in its dataset_dict.json order."""
    root = Path(folder)
    files = sorted(str(p) for p in root.rglob("*")
                   if p.is_file() and not any(part.startswith(".") for part in p.relative_to(root).parts))
    kind: dict[str, str | None] = {}  # folder -> "dataset", "dict" or None

    def kind_of(d: str) -> str | None:
        if d not in kind:
            kind[d] = "dataset" if dataset_files(d) is not None else "dict" if _is_dataset_dict(d) else None
        return kind[d]

    out: list[str] = []
    done: set[str] = set()
    for p in files:
        rel = Path(p).relative_to(root).parent.parts
        # the outermost datasets folder holding p (a DatasetDict holds its splits' folders)
        owner = next((d for d in (str(root.joinpath(*rel[:i])) for i in range(len(rel) + 1)) if kind_of(d)), None)
        if owner is None:
            out.append(p)
        elif owner not in done:
            done.add(owner)
            splits = dataset_splits(owner) if kind_of(owner) == "dict" else [""]
            out.extend(str(f) for s in splits for f in dataset_files(os.path.join(owner, s)) or [])
    return out


def _is_dataset_dict(folder: str) -> bool:
    """`folder` holds a dataset_dict.json whose every split is a `datasets` folder beside it."""
    try:
        splits = dataset_splits(folder)
    except UserError:
        return False
    return bool(splits) and all(dataset_files(os.path.join(folder, s)) is not None for s in splits)


def input_fingerprint(inputs: list[str]) -> list[list]:
    """Each resolved input with its size and modification time: what makes a re-run the same run."""
    files = []
    for p in resolve_inputs(inputs):
        if os.path.isfile(p):
            st = os.stat(p)
            files.append([os.path.abspath(p), st.st_size, int(st.st_mtime)])
        else:
            files.append([p])
    return files


def input_size(files: list[str]) -> int:
    """Bytes on disk of resolved inputs (compressed files count compressed; built-ins their text): the total of
    the reading progress."""
    total = 0
    for p in files:
        if p == BUILTIN_PYTHON_DOCS:
            total += _BUILTIN_BYTES
        else:
            try:
                total += os.path.getsize(p)
            except OSError:
                pass
    return total


def detect_format(path: str) -> str:
    name = path.lower()
    if name.endswith(".parquet"):
        return "parquet"
    if name.endswith(".arrow"):
        return "arrow"
    for ext in COMPRESSED_SUFFIXES:
        if name.endswith(ext):
            name = name[: -len(ext)]
    if name.endswith(".xml"):
        return "wiki"
    if name.endswith((".jsonl", ".json", ".ndjson")):
        return "jsonl"
    return "text"



# A maximal run of non-blank lines (a blank line is empty or whitespace only, as str.strip() sees it: re's \s is
# the same Unicode whitespace), each with its "\n", or the text's unterminated last line.
_NON_BLANK_LINES = re.compile(r"(?:[^\n]*\S[^\n]*(?:\n|\Z))+")

MAX_DOCUMENT_CHARS = 1 << 24
"""A `text`/`lines` document that grows past this many characters (16 Mi: longer than any book or Wikipedia article)
is cut at the end of the block of lines that crossed it, and the rest starts a new document. A file without blank
lines (BookCorpus written one sentence per line with no blank line between books) was one document: held whole by
the reader, then cleaned and tokenized by one worker at ~40 bytes per character (4 GB for a 100 MB file, one core
busy, no random-next segments from other documents). Cuts are counted per file (`long_document_cuts`)."""


def _read_text(path: str, kind: str, report: SkipReport, encoding: str = "utf-8",
               progress: InputProgress | None = None) -> Iterator[RawDocument]:
    """Blank-line separated documents (`text`, `lines`): each document is a maximal run of non-blank lines.

    Found with one regex pass per decoded block rather than a Python loop over lines (that loop was the main
    process's largest cost in `prepare`, while the workers waited for their first chunk: BENCHMARKS.md, plain-text
    reading). A run that
    reaches a block's end may go on in the next block; block ends are line ends (or pieces of over-long lines,
    which count as lines). A document is cut when it grows past `MAX_DOCUMENT_CHARS` (memory stays bounded)."""
    with CountingReader(path, progress) as reader:
        pending: list[str] = []  # the document being read, when it may go on in the next block
        pending_chars = cuts = 0
        for block in text_blocks(reader, path, report, encoding):
            matched = False
            for m in _NON_BLANK_LINES.finditer(block):
                matched = True
                if pending and m.start() > 0:  # blank lines came first: the pending document is complete
                    yield RawDocument("".join(pending), kind, path)
                    pending, pending_chars = [], 0
                pending.append(m.group())
                pending_chars += m.end() - m.start()
                if m.end() < len(block):  # a blank line follows in this block
                    yield RawDocument("".join(pending), kind, path)
                    pending, pending_chars = [], 0
                elif pending_chars >= MAX_DOCUMENT_CHARS:  # no blank line for too long: cut at this line end
                    cuts += 1
                    yield RawDocument("".join(pending), kind, path)
                    pending, pending_chars = [], 0
            if pending and not matched:  # a block of blank lines only
                yield RawDocument("".join(pending), kind, path)
                pending, pending_chars = [], 0
        if pending:
            yield RawDocument("".join(pending), kind, path)
        if cuts:
            report.add(path, "long_document_cuts", cuts)
            report.warn("%s: %d document(s) ran past %d characters without a blank line (are documents separated "
                        "by blank lines?) and were cut at line ends into documents of about that size", path, cuts,
                        MAX_DOCUMENT_CHARS)
        _account_file(reader, path, report)


def _account_file(reader: CountingReader, path: str, report: SkipReport,
                  kept: str = "what was read before the cut") -> None:
    """After a file is read: count its bytes, and report it if it was empty or cut short (a truncated bz2)."""
    report.input_bytes += reader.nbytes
    if reader.nbytes == 0:
        report.add(path, "empty_files")
    if reader.truncated:
        report.add(path, "truncated_files")
        report.warn("%s is truncated (%s); kept %s", path, reader.truncated, kept)


# Half of a UTF-16 surrogate pair: JSON's "\ud800" escape decodes to it (scraped text cut inside an emoji), but it
# is no Unicode character and cannot be encoded as UTF-8 (a pair, "\ud83d\ude00", decodes to one character).
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def _read_jsonl(path: str, text_field: str, report: SkipReport, encoding: str = "utf-8",
                progress: InputProgress | None = None) -> Iterator[RawDocument]:
    with CountingReader(path, progress) as reader:
        first = True
        for lineno, line in enumerate(text_lines(reader, path, report, encoding), 1):
            if not line.strip():
                continue
            if first and line.lstrip().startswith("["):  # a list has no text field: every line would be skipped
                name = Path(path).name
                raise UserError(f"{path} is a JSON array, not JSON Lines (one JSON object per line, what .json and "
                                f".jsonl inputs are read as): convert it, e.g. jq -c '.[]' {name} > "
                                f"{name.split('.')[0]}.jsonl")
            first = False
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                report.add(path, "bad_json_lines")
                if report.counts[path]["bad_json_lines"] <= 3:
                    report.warn("%s line %d is not valid JSON; skipped", path, lineno)
                continue
            text = obj.get(text_field) if isinstance(obj, dict) else None
            if not isinstance(text, str):
                report.add(path, f"lines_without_{text_field}")
                if report.counts[path][f"lines_without_{text_field}"] <= 3:
                    has = (f"its keys: {', '.join(map(str, list(obj)[:8]))}" if isinstance(obj, dict)
                           else f"a JSON {type(obj).__name__}, not an object")
                    report.warn("%s line %d has no string field %r (%s); skipped. Name the text field with "
                                "--text-field (pretraining config: data.text_column)", path, lineno, text_field, has)
                continue
            if "\\u" in line:  # only a \uXXXX escape puts a lone surrogate into the decoded text
                text, n = _LONE_SURROGATE.subn("\ufffd", text)
                if n:  # replaced like an invalid byte (then dropped by cleaning), and counted as one
                    report.add(path, "replaced_characters", n)
            yield RawDocument(text, "text", path)
        _account_file(reader, path, report)


def _read_table(path: str, fmt: str, column: str, report: SkipReport,
                progress: InputProgress | None = None) -> Iterator[RawDocument]:
    """One document per row of a Parquet or Arrow file: the string column `column` (a null is counted, not read).
    Streamed a record batch at a time; `report.input_bytes` counts the text's UTF-8 bytes."""
    from bertrain.data.tables import Table, text_bytes

    with Table(path, fmt) as table:
        table.column(column, "string", hint="name the text column with --text-column (pretraining "
                                            "config: data.text_column)")
        rows = 0
        for batch, pos in table.batches([column]):
            values = batch.column(0)
            rows += batch.num_rows
            report.input_bytes += text_bytes(values)
            if values.null_count:
                report.add(path, f"rows_without_{column}", values.null_count)
            for text in values.to_pylist():
                if text is not None:
                    yield RawDocument(text, "text", path)
            if progress is not None:
                progress.at(pos)
    if rows == 0:
        report.add(path, "empty_files")


_DISAMBIG = re.compile(r"\{\{\s*(disambig[^}|]*|dab|disamb|geodis|hndis|set index[^}|]*|[^}|]*disambiguation)\s*[|}]",
                       re.IGNORECASE)


def _read_wiki(path: str, opts: CorpusConfig, report: SkipReport,
               progress: InputProgress | None = None) -> Iterator[RawDocument]:
    """Stream pages out of a MediaWiki XML dump (expat via iterparse; elements are freed as we go)."""
    reader = CountingReader(path, progress)
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
                            yield RawDocument(text, "wiki", path, title)
                    root.clear()  # free the finished page (memory flat in the dump size)
        except ET.ParseError as e:
            if reader.truncated or "no element found" in str(e) or "unclosed token" in str(e):
                reader.truncated = reader.truncated or f"XML ends early: {e}"
            else:
                raise ValueError(f"{path} is not a valid MediaWiki XML dump: {e}") from None
    finally:
        reader.close()
    if not report.counts[path]["wiki_pages"] and not reader.truncated:
        report.warn("%s has no MediaWiki <page> elements (its root element is <%s>): it is not a Wikipedia dump; "
                    "`bertrain vocab/prepare --input-format text` reads it as plain text (or name it .txt)", path,
                    "none" if root is None else root.tag.rsplit("}", 1)[-1])
    _account_file(reader, path, report, kept=f"the {report.counts[path]['wiki_pages']} complete pages before the cut")


_BUILTIN_BYTES = 470_000  # about the size of builtin:python-docs, for the progress total only


def _read_builtin_python_docs(report: SkipReport, progress: InputProgress | None = None) -> Iterator[RawDocument]:
    # Imported only when asked for: ~465 KB of English reference text shipped with CPython.
    from pydoc_data.topics import topics

    done = 0
    for name in sorted(topics):
        text = topics[name]
        n = len(text.encode("utf-8"))
        report.input_bytes += n
        done += n
        if progress is not None:
            progress.at(min(done, _BUILTIN_BYTES))
        yield RawDocument(text, "paragraphs", BUILTIN_PYTHON_DOCS, name)


def iter_raw_documents(inputs: list[str], opts: CorpusConfig, report: SkipReport,
                       progress: Progress | None = None) -> Iterator[RawDocument]:
    """Every raw document of every input, in a deterministic order (inputs as given, folders sorted).
    `progress` (bytes; its total is `input_size` of the resolved inputs) follows the position in the inputs."""
    files = resolve_inputs(inputs)
    where = InputProgress(progress) if progress is not None else None
    if progress is not None and progress.total is None:
        progress.total = input_size(files)
    for path in files:
        report.files += 1
        if path == BUILTIN_PYTHON_DOCS:
            yield from _read_builtin_python_docs(report, where)
        else:
            fmt = opts.input_format if opts.input_format != "auto" else detect_format(path)
            if fmt == "wiki":
                yield from _read_wiki(path, opts, report, where)
            elif fmt == "jsonl":
                yield from _read_jsonl(path, opts.text_field, report, opts.encoding, where)
            elif fmt in ("parquet", "arrow"):
                yield from _read_table(path, fmt, opts.text_field, report, where)
            else:
                yield from _read_text(path, fmt, report, opts.encoding, where)
        if where is not None:
            where.next_file(input_size([path]))


def iter_documents(inputs: list[str], opts: CorpusConfig, report: SkipReport,
                   batch_chars: int = 1 << 18, progress: Progress | None = None) -> Iterator[Document]:
    """Read, clean and split in this process (for `bertrain vocab`; `prepare` cleans in worker processes).
    Documents are cleaned in batches of ~`batch_chars` of one kind (`clean_documents`: same result, faster)."""
    seen: set[bytes] | None = set() if opts.dedupe else None
    batch: list[RawDocument] = []
    size = 0

    def flush() -> Iterator[Document]:
        for raw, sentences in zip(batch, clean_documents([r.text for r in batch], batch[0].kind)):
            if sum(map(len, sentences)) < max(1, opts.min_document_chars):
                report.add(raw.file, "short_documents")
                continue
            report.documents += 1
            yield Document(sentences, raw.source)

    for raw in iter_raw_documents(inputs, opts, report, progress):
        if seen is not None:
            h = doc_hash(raw.text)
            if h in seen:
                report.add(raw.file, "duplicate_documents")
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
    """A 12-byte hash of a raw document's text (for `dedupe`), blind to what reading leaves around the same text:
    the line end after a text file's document (none after the file's last line), CRLF line ends, a JSONL value's
    lack of a final newline."""
    text = text.replace("\r\n", "\n").strip()
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=12).digest()
