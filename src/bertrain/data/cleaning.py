"""Cleaning: raw document text -> normalised sentences (run in the worker processes of `prepare`).

`clean_documents` normalises (control characters removed, spaces collapsed, line ends unified), drops decoration
lines, and splits into sentences (`split_sentences`) by the rules of the document's kind: `lines` (one sentence per
line), `wiki` (markup stripped by `bertrain.data.wikitext`, every line a paragraph), `text`/`paragraphs` (blank lines
separate paragraphs, single newlines are soft).

Apart from what it drops on purpose (decoration lines, wiki markup), cleaning changes no WordPiece id of a text,
only where sentences end: the characters it deletes are those BERT's tokenizer deletes too (BertNormalizer's
clean_text), the ones it turns into spaces or line ends are white space to it. Fine-tuning, `predict` and `serve`
tokenize raw text with HF's BertTokenizerFast rules (what a user of an exported model runs), so pretraining sees the
same ids for the same text. No Unicode normalisation (NFC) here: a cased tokenizer keeps the form it is given
(decomposed 'e\u0301' is not 'é' to it), and text normalised only in pretraining would be another input at
fine-tuning and serving time (an uncased one applies NFD itself).
tests/test_audit_unicode.py checks cleaned-then-tokenized text against HF on raw multilingual text.
"""
from __future__ import annotations

import re
import unicodedata

# A "sentence" longer than this (no punctuation for pages) is cut at whitespace: BERT sees at most 512 tokens anyway.
MAX_SENTENCE_CHARS = 4000


# C0/C1 controls except tab/newline, zero-width chars, BOM, and U+FFFD left by invalid UTF-8: all of them deleted
# by BERT's tokenizer as well (categories Cc/Cf, U+FFFD). Not U+2028/U+2029 (line and paragraph separators): white
# space to the tokenizer, deleting them joined the words around them ("end\u2029Next" became one word), so they
# become line ends (`normalize_text`).
_CONTROL = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\u200b-\u200f\ufeff\ufffd]")
_ASCII_CONTROL = bytes([*range(0x00, 0x09), 0x0b, 0x0c, *range(0x0e, 0x20), 0x7f])  # _CONTROL's ASCII part
_ASCII_CONTROL_BUT_NUL = _ASCII_CONTROL[1:]
_CONTROL_BUT_NUL = re.compile("[\x01-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\u200b-\u200f\ufeff\ufffd]")
# Runs of 2+ spaces, or one space that is not " ": a plain single space matches nothing, so the usual text costs
# no substitutions (matching every single space was most of `normalize_text`'s time). Same output as
# `[...]+` -> " ".
# One leading class, not a top-level alternation, so that re scans for it in C (BENCHMARKS.md, batched cleaning).
_SPACES = re.compile(r"[ \t\u00a0\u2000-\u200a\u202f\u205f\u3000]"
                     r"(?:[ \t\u00a0\u2000-\u200a\u202f\u205f\u3000]+|(?<=[^ ]))")


_ODD_SPACE = re.compile(r"[\t\u00a0\u2000-\u200a\u202f\u205f\u3000]")
_SPACE_RUN = re.compile("  [ ]*")  # = " {2,}", but written so that re searches for the literal "  "


def normalize_text(text: str, keep_nul: bool = False) -> str:
    """Control characters removed, runs of spaces collapsed, line ends unified (CR, CRLF and U+2028 -> newline,
    U+2029 -> a blank line: a paragraph break); no Unicode normalisation (see the module's docstring).

    `keep_nul` keeps NUL characters (the document separator of `clean_documents`)."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    if text.isascii():  # O(1) in CPython. bytes.translate deletes controls faster than re
        raw = text.encode("ascii")
        kept = raw.translate(None, _ASCII_CONTROL_BUT_NUL if keep_nul else _ASCII_CONTROL)
        if len(kept) != len(raw):
            text = kept.decode("ascii")
        odd_space = "\t" in text
    else:
        if "\u2028" in text or "\u2029" in text:
            text = text.replace("\u2028", "\n").replace("\u2029", "\n\n")
        text = (_CONTROL_BUT_NUL if keep_nul else _CONTROL).sub("", text)
        odd_space = _ODD_SPACE.search(text) is not None
    # Python's re tries a match at every candidate position (every space, for `_SPACES`); a single-class search
    # and a literal search are C scans. So clean text skips the substitution, and text whose only odd spacing is
    # runs of plain spaces (the usual case) uses the literal-prefix pattern (same result).
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
# MB, BENCHMARKS.md, batched cleaning). Joining a chunk's documents with a separator and running each step once over
# the whole text gives the same sentences (each step is per character or per line, and the separator is a line of its
# own that no step changes or crosses) at a fraction of the cost.
# NUL, kept through normalisation by `keep_nul` (real text has none: checked, and documents go one by one if it
# does). An ASCII separator keeps ASCII text ASCII, so CPython's 1-byte-string fast paths (NFC quick check, re)
# still apply: a non-ASCII one made normalising the joined text slower than document by document.
_DOC_SEP = "\n\x00\n"
_PARAGRAPH_BREAK = re.compile(r"\n\s*\n")
# After normalisation no C0 control is left (see _CONTROL), so these mark the boundaries in the joined text.
_PARA_MARK, _DOC_MARK = "\x02", "\x03"


def clean_documents(texts: list[str], kind: str) -> list[list[str]]:
    """`clean_document` for many documents of one kind at once (same result, much faster for short documents)."""
    if kind == "wiki":
        # Imported here: mwparserfromhell is slow to import, and only wiki input needs it.
        from bertrain.data.wikitext import strip_wiki_markup

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

# Why a hand-written splitter: pysbd (the maintained rule-based splitter that works offline) is far slower than
# the 6 MB/s this pipeline targets; NLTK punkt needs data that cannot be downloaded here. This regex +
# abbreviation check runs within cleaning's 0.03 s per MB (BENCHMARKS.md, batched cleaning) and
# handles what matters for BERT's sentence-pair task: ., ! and ? followed by space and an upper-case letter,
# digit or opening quote, except after common abbreviations, initials (J. R. R.) and dotted acronyms (U.S.).
# A sentence end: end punctuation, closing quotes/brackets, whitespace (group 2), then a capital or digit (beyond
# Latin-1, any letter that is not lower case: Ł, Č, Ō, Greek and Cyrillic capitals, CJK: `_opens_sentence`).
_OPENERS = "\"'\u2018\u201c(["
_SENTENCE_END_TAIL = r"[\"'\u2019\u201d)\]]*(\s+)(?=[\"'\u2018\u201c(\[]?[A-Z0-9\u00c0-\u00de\u0100-\U0010ffff])"
# CJK sentence ends (。！？), which no space follows: group 1 (empty) after them, unless a closing bracket or quote
# follows (「本当？」と彼は言った。 is one sentence).
_CJK_END = "\u3002\uff01\uff1f"
# A sentence end, or a paragraph/document mark (groups 1 and 2 are None for a mark). Written to start with one
# character class (a top-level alternation would not): CPython's re then scans for that class in C instead of
# trying a match at every position. `[.!?\u2026]` then `[.!?\u2026]*` is the `[.!?\u2026]+` of a sentence end.
_BOUNDARY = re.compile(f"[{_PARA_MARK}{_DOC_MARK}.!?\u2026{_CJK_END}](?:(?<=[{_PARA_MARK}{_DOC_MARK}])|"
                       f"(?<=[{_CJK_END}])[{_CJK_END}!?]*()(?![\u300d\u300f\uff09)\u201d\u2019])|"
                       f"[.!?\u2026]*{_SENTENCE_END_TAIL})")


def _opens_sentence(text: str, i: int) -> bool:
    """Whether the text from `i` (after a sentence end's whitespace) starts a sentence: an optional opening quote or
    bracket, then a capital or digit (beyond Latin-1: a letter that is not lower case)."""
    c = text[i]
    if c in _OPENERS and i + 1 < len(text):
        c = text[i + 1]
    return ("A" <= c <= "Z" or "0" <= c <= "9" or "\u00c0" <= c <= "\u00de"
            or (c > "\u00ff" and c.isalpha() and not c.islower()))
_ABBREVIATIONS = frozenset("""
mr mrs ms dr prof sr jr st mt ft rev gen col lt sgt capt cmdr adm gov sen rep pres hon fr
no nos vol vols fig figs eq eqs ch chap sec art p pp ed eds op cit cf ca approx est dept univ inc ltd co corp bros
jan feb mar apr jun jul aug sep sept oct nov dec mon tue wed thu fri sat sun
vs etc al e.g i.e viz e.g. i.e. a.m p.m u.s u.k
""".split())


def _splits_words(c: str) -> bool:
    """Whether BERT's pre-tokenizer ends a word at `c`: white space, punctuation (ASCII or category P*) and the CJK
    ideographs its normaliser puts spaces around (transformers' `_is_chinese_char`)."""
    o = ord(c)
    return (c.isspace() or 0x21 <= o <= 0x2f or 0x3a <= o <= 0x40 or 0x5b <= o <= 0x60 or 0x7b <= o <= 0x7e
            or 0x4e00 <= o <= 0x9fff or 0x3400 <= o <= 0x4dbf or 0x20000 <= o <= 0x2ceaf or 0xf900 <= o <= 0xfaff
            or 0x2f800 <= o <= 0x2fa1f or (o > 0x7f and unicodedata.category(c)[0] == "P"))


def _word_cut(s: str, max_chars: int) -> int:
    """Where to cut a sentence with no space in its last half before `max_chars` (CJK or Thai text, emoji runs):
    the last place before `max_chars` where a word ends for BERT, else the first one after it (an unbroken run of
    thousands of characters is one [UNK] word: cut, it was two or more), else at `max_chars` as before. A cut inside
    a word (a kana run, a letter and its accent, an emoji sequence) gave pretraining other ids than the same text
    gets in fine-tuning and serving."""
    for i in range(max_chars, max_chars // 2, -1):
        if _splits_words(s[i - 1]) or _splits_words(s[i]):
            return i
    for i in range(max_chars + 1, min(len(s), 2 * max_chars)):
        if _splits_words(s[i - 1]) or _splits_words(s[i]):
            return i
    return len(s) if len(s) <= 2 * max_chars else max_chars


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
            cut = cut if cut > 0 else _word_cut(s, max_chars)
            out.append(s[:cut].strip())
            s = s[cut:].strip()
        if s:
            out.append(s)

    for m in _BOUNDARY.finditer(text):
        end = m.start(1)
        if end < 0:
            end = m.start(2)
            c = text[m.end()] if end >= 0 else "A"
            if not ("A" <= c <= "Z" or "0" <= c <= "9") and not _opens_sentence(text, m.end()):
                continue  # (the regex's class takes every character beyond Latin-1, and a quote before it)
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
