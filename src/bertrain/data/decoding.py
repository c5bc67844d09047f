"""Input decoding: bytes on disk -> text, strictly (used by `bertrain.data.readers`).

`CountingReader` opens an input (`.bz2`, `.gz`, `.xz` and `.zst` decompressed on the fly; zstandard, from the
`data` extra, imported only for a `.zst` file), counts the bytes read, follows the position on disk for the
progress, and turns a truncated compressed stream into a clean end of file.
`text_blocks` / `text_lines` decode it in blocks of whole lines, cutting over-long lines into pieces.

Decoding is strict: text is UTF-8 unless `CorpusConfig.encoding` names another (ASCII-compatible, see
`check_encoding`) encoding, and a file that is not text — a NUL byte, or more than 1% of the bytes read so far
invalid in the encoding (a binary, or latin-1 text read as UTF-8) — is refused with a `UserError` naming the file
and the byte offset. Fewer invalid bytes are replaced (U+FFFD, then dropped by cleaning) and counted as
`replaced_characters` in the reader's report (a `SkipReport`).
"""
from __future__ import annotations

import bz2
import codecs
import gzip
import io
import lzma
import os
import threading
from pathlib import Path
from typing import IO, Iterator, Protocol

from bertrain.data.progress import Progress
from bertrain.utils.errors import UserError

# Lines longer than this are cut into pieces (at whitespace where possible): a 10 MB line without a newline would
# otherwise become one 10 MB "sentence" (and one huge string per worker task).
MAX_LINE_CHARS = 1 << 20
# A file with more invalid bytes than this share (of the whole file, or of what was read once that is 1 MB or more;
# NUL bytes: any) is not text in its encoding.
MAX_INVALID_SHARE = 0.01


def check_encoding(encoding: str) -> None:
    """A `ValueError` unless `encoding` is a known encoding in which ASCII (newlines, NUL) is itself."""
    try:
        codecs.lookup(encoding)
    except LookupError:
        raise ValueError(f"unknown encoding {encoding!r} (e.g. utf-8, latin-1, cp1252, shift_jis)") from None
    try:
        # utf-8-sig writes a BOM first, then is UTF-8 (which the readers read with a leading BOM dropped)
        ascii_compatible = ("\n\0 az".encode(encoding) == b"\n\0 az"
                            or codecs.lookup(encoding).name == "utf-8-sig")
    except (UnicodeError, LookupError):
        ascii_compatible = False
    if not ascii_compatible:
        raise ValueError(f"encoding {encoding!r} does not write ASCII as ASCII (UTF-16/32?): convert the files to "
                         f"UTF-8 first, e.g. `iconv -f {encoding} -t UTF-8 in.txt > out.txt`")


class Tally(Protocol):
    """Where decoding counts what it repaired, per file (`bertrain.data.readers.SkipReport`)."""

    def add(self, source: str, what: str, n: int = 1) -> None: ...


COMPRESSED_SUFFIXES = (".bz2", ".gz", ".xz", ".zst", ".zstd")


# suffixes, the format's name, how its files start (zstd: a frame, or a skippable frame 0x184D2A5?, little-endian)
_FORMATS = ((".bz2", "bzip2", (b"BZh",)), (".gz", "gzip", (b"\x1f\x8b",)), (".xz", "xz", (b"\xfd7zXZ\x00",)),
            ((".zst", ".zstd"), "zstd", (b"\x28\xb5\x2f\xfd",) + tuple(bytes([b, 0x2a, 0x4d, 0x18]) for b in
                                                                      range(0x50, 0x60))))


def _is_compressed(path: str) -> bool:
    return path.lower().endswith(COMPRESSED_SUFFIXES)


class _ZstdStream:
    """`read(n)` of the decompressed data of a .zst file, every frame in turn (`zstd` and `pzstd` write several).

    Why not zstandard's `stream_reader`: at a cut-off file it returns a short read as if the data ended there; this
    raises `EOFError` (as bz2, gzip and lzma do) when the file ends inside a frame, so `CountingReader` reports the
    file as truncated."""

    _READ = 1 << 16  # compressed bytes fed at a time (text expands ~4x: the output stays small)

    def __init__(self, f: IO[bytes], path: str):
        try:
            import zstandard
        except ImportError:
            raise UserError(f"reading {path} needs the zstandard package: pip install 'bertrain[data]'") from None
        self._zstd = zstandard
        self._f = f
        self._dec = zstandard.ZstdDecompressor().decompressobj()
        self._in_frame = False  # compressed bytes of the current frame were fed
        self._out = bytearray()  # decompressed, not yet read (deleting from its front is cheap)
        self._error: Exception | None = None  # a cut-off or damaged file: raised once what came before is read

    def read(self, n: int = -1) -> bytes:
        while self._error is None and (n < 0 or len(self._out) < n):
            data = self._f.read(self._READ)
            if not data:
                if self._in_frame:
                    self._error = EOFError("the file ends inside a zstd frame")
                break
            try:
                while data:
                    self._out += self._dec.decompress(data)
                    self._in_frame = True
                    if not self._dec.eof:
                        break
                    data = self._dec.unused_data  # the next frame starts here
                    self._dec = self._zstd.ZstdDecompressor().decompressobj()
                    self._in_frame = False
            except self._zstd.ZstdError as e:  # damaged data: like bz2's OSError (an error once what came before is read)
                self._error = OSError(f"zstd: {e}")
        if not self._out and self._error is not None:  # what came before the damage was returned first
            raise self._error
        n = len(self._out) if n < 0 else min(n, len(self._out))
        out = bytes(self._out[:n])
        del self._out[:n]
        return out

    def close(self) -> None:
        pass  # the file on disk is closed by its owner


def _open_binary(path: str) -> tuple[IO[bytes], IO[bytes]]:
    """(the decompressed stream, the file on disk: its position is the progress)."""
    try:
        f = open(path, "rb")
    except OSError as e:
        raise UserError(f"cannot read input {path}: {e.strerror or e}") from e
    name = path.lower()
    if name.endswith(".bz2"):
        return bz2.BZ2File(f, "rb"), f  # reads multistream files (Wikipedia's *-multistream.xml.bz2) too
    if name.endswith(".gz"):
        return gzip.GzipFile(fileobj=f, mode="rb"), f
    if name.endswith(".xz"):
        return lzma.LZMAFile(f, "rb"), f
    if name.endswith((".zst", ".zstd")):
        try:
            return _ZstdStream(f, path), f  # type: ignore[return-value]
        except UserError:
            f.close()
            raise
    return f, f


class CountingReader(io.RawIOBase):
    """Opens an input file; counts bytes read (the uncompressed input size), reports the position in the file on
    disk to `progress` (whose `base` is the size of the inputs before this one), and turns a truncated compressed
    stream into a clean end of file, remembering that it happened."""

    def __init__(self, path: str, progress: "InputProgress | None" = None):
        self.raw, self.file = _open_binary(path)
        self.path = path
        self.progress = progress
        self.nbytes = 0
        self.truncated: str | None = None
        # read1: at most one decompressed chunk per call. GzipFile/BZ2File/LZMAFile.read(n) gather many chunks and
        # drop all of them when the stream turns out to be cut, so a truncated file would lose up to len(b) bytes
        # of good text before the cut (the zstd stream keeps what it decoded itself).
        self._read = getattr(self.raw, "read1", self.raw.read)

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:  # type: ignore[override]
        if self.truncated:
            return 0
        try:
            data = self._read(len(b))
        except (EOFError, OSError, lzma.LZMAError) as e:
            if self.raw is self.file:  # a plain file: a read error, not a truncated stream
                raise UserError(f"cannot read input {self.path}: {getattr(e, 'strerror', None) or e}") from e
            if not isinstance(e, EOFError):  # damaged data, not a cut-off file (bz2, gzip, lzma, zstd: EOFError)
                raise UserError(self._damaged(e)) from e
            self.truncated = f"{type(e).__name__}: {e}"
            return 0
        n = len(data)
        b[:n] = data
        self.nbytes += n
        if self.progress is not None:
            self.progress.at(self.file.tell())
        return n

    def _damaged(self, e: BaseException) -> str:
        """What to say of a compressed input whose data stops decoding before the file ends. Not kept as truncation is:
        the rest of the file (91 of 206 pages of a Wikipedia dump with 100 damaged bytes in its middle) would be lost
        to a warning, and a file that is not compressed at all (plain text named .gz) would be lost whole."""
        kind, magic = next((k, m) for suffixes, k, m in _FORMATS if self.path.lower().endswith(suffixes))
        size = os.fstat(self.file.fileno()).st_size
        if not os.pread(self.file.fileno(), 6, 0).startswith(magic):
            return (f"input {self.path} is not {kind} data ({type(e).__name__}: {e}): a file named "
                    f"{Path(self.path).suffix} must be {kind}; decompress or rename it, or download or copy it again")
        after = f", after {self.nbytes:,} bytes of text" if self.nbytes else ""
        return (f"input {self.path} is damaged at byte {self.file.tell():,} of {size:,} ({type(e).__name__}: {e})"
                f"{after}; the rest cannot be read: download or copy it again, or remove it from the inputs")

    def close(self) -> None:
        self.raw.close()
        self.file.close()
        super().close()


class InputProgress:
    """The reading progress over all inputs: `Progress` in bytes on disk, one file after another."""

    def __init__(self, progress: Progress):
        self.progress = progress
        self.base = 0

    def at(self, pos: int) -> None:
        self.progress.set(self.base + pos)

    def next_file(self, size: int) -> None:
        self.base += size
        self.progress.set(self.base)


# The codecs error handler "bertrain.replace": Python's "replace" (one U+FFFD per invalid sequence) that records
# where it replaced, so `_Decoder` counts exactly what it replaced and where the first bad byte is. It is called
# only on invalid bytes (valid text decodes in C as before); the spans are per thread.
_decode_spans = threading.local()


def _replace_and_record(e: UnicodeError) -> tuple[str, int]:
    if not isinstance(e, UnicodeDecodeError):
        raise e
    _decode_spans.spans.append((e.start, e.end))
    return "\ufffd", e.end


codecs.register_error("bertrain.replace", _replace_and_record)


class _Decoder:
    """Decodes one input file incrementally and refuses it if it is not text in its encoding (see the module
    docstring); counts the characters it replaced. `decode` is fed the file's bytes in order."""

    def __init__(self, path: str, encoding: str, report: Tally):
        self.path, self.encoding, self.report = path, encoding, report
        self.decoder = codecs.getincrementaldecoder(encoding)("bertrain.replace")
        self.pos = 0  # bytes decoded so far
        self.invalid = 0  # invalid bytes so far
        self.first_bad = ""  # where the first one is, for the message
        # A UTF-8 byte order mark starting the file (Windows tools write one) is not text: as "utf-8-sig" does, it
        # is dropped, else a JSONL file's first line does not parse and its document is lost. (GLUE, SQuAD and
        # predict inputs are read the same way.)
        self.bom = codecs.lookup(encoding).name == "utf-8"

    def decode(self, data: bytes, final: bool = False) -> str:
        nul = data.find(b"\0")
        if nul >= 0:
            raise UserError(f"input {self.path} is not text: a NUL byte at byte offset {self.pos + nul}"
                            f"{self._decompressed()} ({data[max(0, nul - 16): nul + 16]!r}); give text files (for "
                            "UTF-16/32 text: convert it to UTF-8 first; for other encodings see --encoding)")
        spans = _decode_spans.spans = []
        text = self.decoder.decode(data, final)
        if self.bom and text:  # the first characters decoded (a BOM cut between two reads is not decoded yet)
            self.bom = False
            text = text.removeprefix("\ufeff")
        if spans:
            self.report.add(self.path, "replaced_characters", len(spans))
            self.invalid += sum(end - start for start, end in spans)
            if not self.first_bad:  # (an offset may be a few bytes early for a character cut by a long-line piece)
                start = min(spans[0][0], len(data))
                self.first_bad = f"{self.pos + start} ({data[max(0, start - 16): start + 16]!r})"
        if self.invalid > MAX_INVALID_SHARE * (self.pos + len(data)) and (final or self.pos + len(data) >= 1 << 20):
            raise UserError(
                f"input {self.path} is not {self.encoding} text: {self.invalid} of its {'' if final else 'first '}"
                f"{self.pos + len(data)} bytes{self._decompressed()} are invalid (more than "
                f"{MAX_INVALID_SHARE:.0%}), the first at byte offset {self.first_bad}; for text in a legacy "
                "encoding pass it with --encoding (e.g. --encoding latin-1 or cp1252)")
        self.pos += len(data)
        return text

    def _decompressed(self) -> str:
        return " of the decompressed data" if _is_compressed(self.path) else ""


def text_lines(reader: CountingReader, source: str, report: Tally, encoding: str) -> Iterator[str]:
    """Decode line by line (each with its "\n"); see `text_blocks`."""
    for block in text_blocks(reader, source, report, encoding):
        lines = block.split("\n")
        last = lines.pop()
        for line in lines:
            yield line + "\n"
        if last:
            yield last


_BLOCK_BYTES = 1 << 20  # what `text_blocks` reads at a time


def text_blocks(reader: CountingReader, source: str, report: Tally, encoding: str) -> Iterator[str]:
    """Decode (`_Decoder`: not text is refused) in blocks of whole lines ("\n"-terminated, except maybe the file's
    last); invalid bytes become U+FFFD (counted), over-long lines are cut into pieces (counted), each piece then a
    block of its own. (`encoding` is ASCII-compatible, see `check_encoding`, so a newline byte is a newline.)"""
    buffered = io.BufferedReader(reader, buffer_size=1 << 20)
    decoder = _Decoder(source, encoding, report)
    # Fast path: whole ~1 MB blocks of complete lines, decoded and split at once (a newline byte is never part of
    # a UTF-8 sequence, so this decodes exactly like line by line). A block with a line that readline() would cut
    # (MAX_LINE_CHARS bytes or more) is handed, with everything after it, to the line-by-line loop below.
    carry = b""
    while True:
        data = buffered.read(_BLOCK_BYTES)
        block = carry + data if carry else data
        if not block:
            tail = decoder.decode(b"", final=True)  # a character cut off at the end of the file: U+FFFD, counted
            if tail:
                yield tail
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
        text = decoder.decode(block, final=not data)
        if text:
            yield text
        if not data:
            return
    while True:
        line = buffered.readline(MAX_LINE_CHARS)
        if not line:
            tail = decoder.decode(b"", final=True)
            if tail:
                yield tail
            break
        if len(line) >= MAX_LINE_CHARS and not line.endswith(b"\n"):
            report.add(source, "long_line_pieces")
            # Cut at the last whitespace so a word is not split; the remainder starts the next piece.
            cut = max(line.rfind(b" "), line.rfind(b"\t"))
            if cut > MAX_LINE_CHARS // 2:
                rest = line[cut + 1:]
                line = line[:cut] + b"\n"
                buffered = _Prepend(rest, buffered)
        yield decoder.decode(line)


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

