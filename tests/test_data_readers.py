"""Corpus reading (data/readers.py): real Wikipedia dumps (articles counted, redirects and disambiguation pages
skipped, no markup left), text / lines / JSONL / folders / the builtin corpus, every kind of bad input, and the block
reader. Cleaning and sentence splitting: test_data_cleaning.py; MediaWiki markup: test_data_wikitext.py."""
from __future__ import annotations

import bz2
import json
import logging
import random

import pytest

from bertrain.data import decoding, readers
from bertrain.data.readers import CorpusConfig, SkipReport, iter_documents, resolve_inputs
from conftest import shared_file

MARKUP = ("{{", "}}", "[[", "]]", "{|", "|}", "<ref")


def read(paths, **opts):
    report = SkipReport()
    docs = list(iter_documents([str(p) for p in paths], CorpusConfig(**opts), report))
    return docs, report


def test_wikipedia_sample_markup_gone_articles_counted_redirects_skipped():
    path = shared_file("wiki/enwiki-sample-pages-articles.xml.bz2")
    docs, report = read([path])
    t = report.totals()
    assert t["wiki_pages"] == 206
    assert t["wiki_articles"] == 106  # every non-redirect article page
    assert t["wiki_redirects"] + t["wiki_non_article_namespace"] == 100
    assert t["wiki_disambiguation"] == 8  # "Austin (disambiguation)", {{disambiguation}}, {{geodis}} ...
    assert len(docs) == 106 - 8
    titles = [d.source.split("#", 1)[1] for d in docs]
    assert "Anarchism" in titles and "Algorithm" in titles
    assert "AccessibleComputing" not in titles  # a redirect
    assert not any("(disambiguation)" in t for t in titles)
    text = "\n".join(d.text for d in docs)
    for m in MARKUP:
        assert m not in text, m
    assert "#REDIRECT" not in text.upper()
    assert len(text) > 2_000_000  # real text kept, not thrown away with the markup
    anarchism = docs[titles.index("Anarchism")].sentences
    assert anarchism[0].startswith("Anarchism is a political philosophy")


def test_keep_disambiguation_option():
    docs, report = read([shared_file("wiki/enwiki-sample-pages-articles.xml.bz2")], skip_disambiguation=False)
    assert len(docs) == 106


def test_table_markup_sample_has_no_table_syntax_left():
    docs, report = read([shared_file("wiki/enwiki-table-markup.xml.bz2")])
    assert docs
    text = "\n".join(d.text for d in docs)
    for m in MARKUP:
        assert m not in text, m


def test_text_documents_split_on_blank_lines_and_soft_newlines(tmp_path):
    f = tmp_path / "a.txt"
    f.write_text("First doc line one\ncontinues here. Second sentence.\n\n\nSecond doc is here. Yes it is.\n")
    docs, _ = read([f], min_document_chars=0)
    assert [d.sentences for d in docs] == [["First doc line one continues here.", "Second sentence."],
                                           ["Second doc is here.", "Yes it is."]]


def test_lines_jsonl_folder_glob_and_dedupe(tmp_path):
    (tmp_path / "books").mkdir()
    (tmp_path / "books" / "b1.txt").write_text("one sentence per line\nsecond line here\n\nnext book part\n")
    (tmp_path / "books" / "b2.txt").write_text("another book file\n")
    docs, _ = read([tmp_path / "books"], input_format="lines", min_document_chars=0)
    assert [d.sentences for d in docs] == [["one sentence per line", "second line here"], ["next book part"],
                                           ["another book file"]]
    j = tmp_path / "c.jsonl"
    j.write_text(json.dumps({"body": "A doc here. Two."}) + "\n{not json\n" + json.dumps({"x": 1}) + "\n"
                 + json.dumps({"body": "A doc here. Two."}) + "\n")
    docs, report = read([j], text_field="body", dedupe=True, min_document_chars=0)
    assert [d.sentences for d in docs] == [["A doc here.", "Two."]]
    c = report.counts[str(j)]
    assert (c["bad_json_lines"], c["lines_without_body"], c["duplicate_documents"]) == (1, 1, 1)
    assert resolve_inputs([str(tmp_path / "books" / "*.txt")]) == [str(tmp_path / "books" / "b1.txt"),
                                                                    str(tmp_path / "books" / "b2.txt")]
    with pytest.raises(ValueError, match="matches no files"):
        resolve_inputs([str(tmp_path / "*.nothing")])
    with pytest.raises(ValueError, match="does not exist"):
        resolve_inputs([str(tmp_path / "missing.txt")])


def test_a_file_name_with_a_hash_is_reported_whole(tmp_path):
    """Skips are counted under the input file: a '#' in its name is part of it (only a dump's pages are FILE#TITLE)."""
    f = tmp_path / "notes#1.txt"
    f.write_text("A document that is long enough to be kept here.\n\nShort.\n\nA document that is long enough "
                 "to be kept here.\n")
    docs, report = read([f], dedupe=True, min_document_chars=20)
    assert [d.source for d in docs] == [str(f)]
    assert report.counts == {str(f): {"short_documents": 1, "duplicate_documents": 1}}
    from bertrain.data.prepare import prepare
    from helpers import prepare_config
    stats = prepare(prepare_config(tmp_path / "out", inputs=[str(f)], masking="dynamic", heldout_fraction=0,
                                   corpus=CorpusConfig(dedupe=True, min_document_chars=20)))
    assert stats["skipped"]["problems"] == {str(f): {"short_documents": 1, "duplicate_documents": 1}}


def test_jsonl_without_the_field_and_xml_without_pages_say_what_to_change(tmp_path, caplog):
    j = tmp_path / "c.jsonl"
    j.write_text(json.dumps({"content": "A document under another key."}) + "\n" + json.dumps(["a", "list"]) + "\n")
    x = tmp_path / "r.xml"
    x.write_text("<root><item>Text that is not a wiki page at all.</item></root>\n")
    with caplog.at_level(logging.WARNING):
        docs, report = read([j, x], min_document_chars=0)
    assert docs == [] and report.counts[str(j)]["lines_without_text"] == 2
    assert f"{j} line 1 has no string field 'text' (its keys: content)" in caplog.text
    assert f"{j} line 2 has no string field 'text' (a JSON list, not an object)" in caplog.text
    assert "--text-field" in caplog.text
    assert f"{x} has no MediaWiki <page> elements (its root element is <root>)" in caplog.text
    assert "--input-format text" in caplog.text


def test_builtin_python_docs():
    docs, report = read(["builtin:python-docs"])
    assert len(docs) >= 70 and report.input_bytes > 400_000
    assert any("assert" in s for s in docs[0].sentences)
    with pytest.raises(ValueError, match="unknown built-in"):
        resolve_inputs(["builtin:nope"])


def test_bad_bytes_empty_file_and_huge_line_are_reported(tmp_path, caplog):
    bad = tmp_path / "bad.txt"  # 3 invalid sequences in 346 bytes: under 1%, so replaced and counted
    bad.write_bytes(b"Good text here. \xff\xfe More good text \xc3 here.\n" + b" " * 300 + b"\n")
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    huge = tmp_path / "huge.txt"
    huge.write_bytes((b"abcdefghi " * 1_048_576))  # 10 MB, one line, no newline
    with caplog.at_level(logging.WARNING):
        docs, report = read([bad, empty, huge])
        report.log(logging.getLogger("test"))
    assert report.counts[str(bad)]["replaced_characters"] == 3
    assert docs[0].sentences == ["Good text here.", "More good text here."]  # U+FFFD removed in cleaning
    assert report.counts[str(empty)]["empty_files"] == 1
    assert report.counts[str(huge)]["long_line_pieces"] >= 9
    assert sum(len(s) for s in docs[1].sentences) > 9_000_000  # nothing lost, only cut
    assert max(len(s) for s in docs[1].sentences) <= 4000
    assert str(bad) in caplog.text and "replaced_characters=3" in caplog.text


def test_truncated_bz2_keeps_complete_pages_and_says_so(tmp_path, caplog):
    data = bz2.decompress(shared_file("wiki/enwiki-sample-pages-articles.xml.bz2").read_bytes())
    comp = bz2.compress(data[: len(data) // 2])
    cut = tmp_path / "cut.xml.bz2"
    cut.write_bytes(comp[: len(comp) * 3 // 4])  # cut inside the compressed stream
    with caplog.at_level(logging.WARNING):
        docs, report = read([cut])
    c = report.counts[str(cut)]
    assert c["truncated_files"] == 1
    assert 5 < len(docs) < 98
    assert "truncated" in caplog.text and str(cut) in caplog.text
    text = "\n".join(d.text for d in docs)
    assert "[[" not in text


def _documents_line_by_line(path, report):
    """The plain reference for `_read_text`: a document is a maximal run of lines whose strip() is not empty."""
    with decoding.CountingReader(str(path)) as reader:
        buf = []
        for line in decoding.text_lines(reader, str(path), report, "utf-8"):
            if line.strip():
                buf.append(line)
            elif buf:
                yield "".join(buf)
                buf = []
        if buf:
            yield "".join(buf)


@pytest.mark.parametrize("short_lines", [False, True])
def test_text_documents_block_reader_equals_line_by_line(tmp_path, monkeypatch, short_lines):
    """Documents found per decoded block (one regex pass) are those of the line-by-line rule, whatever the
    whitespace-only lines (\\r, \\x1c, U+3000, U+2028), invalid bytes, unterminated last lines, and over-long
    lines cut into pieces (MAX_LINE_CHARS shrunk to 64, or blocks to 40 bytes, so that pieces and block ends fall
    everywhere)."""
    monkeypatch.setattr(decoding, "MAX_INVALID_SHARE", 1.0)  # short files with invalid bytes: not refused here
    if short_lines:
        monkeypatch.setattr(decoding, "MAX_LINE_CHARS", 64)
    else:  # many block ends inside the fast path
        monkeypatch.setattr(decoding, "_BLOCK_BYTES", 40)
    rng = random.Random(1)
    pieces = ["abc", "Hello world.", " ", "  ", "\t", "\r", "\x1c", "\u3000", "\u2028", "\x85", "é", "\n", "\n", "\n",
              "\r\n", "\n  \n"]
    for i in range(150):
        parts = [rng.choice(pieces) for _ in range(rng.randint(0, 150))]
        if short_lines and rng.random() < 0.5:
            parts.insert(rng.randint(0, len(parts)), "x" * rng.randint(60, 300) + " y" * rng.randint(0, 40))
        data = "".join(parts).encode("utf-8") + (b"\xff\xfe tail\n" if rng.random() < 0.2 else b"")
        path = tmp_path / f"f{i}.txt"
        path.write_bytes(data)
        expected = list(_documents_line_by_line(path, SkipReport()))
        got = [d.text for d in readers._read_text(str(path), "text", SkipReport())]
        assert got == expected, repr(data[:200])


def test_iter_documents_batching_changes_nothing(tmp_path):
    """`iter_documents` cleans in batches: documents, skip counts and the document count are those of cleaning one
    document at a time (batch_chars=1), across kinds and with short documents and duplicates in the mix."""
    (tmp_path / "a.txt").write_text("Short.\n\nA longer document here. It has two sentences.\n\n" * 3 +
                                    "Another one, long enough to keep.\n")
    (tmp_path / "b.jsonl").write_text('{"text": "Json doc number one is here."}\n{"text": "x"}\n')
    inputs = [str(tmp_path / "a.txt"), str(tmp_path / "b.jsonl"), "builtin:python-docs"]
    results = []
    for batch_chars in (1, 1 << 18):
        report = SkipReport()
        docs = list(iter_documents(inputs, CorpusConfig(dedupe=True), report, batch_chars=batch_chars))
        results.append(([(d.sentences, d.source) for d in docs], report.to_dict(), report.documents))
    assert results[0] == results[1]
    assert results[0][2] > 50 and "duplicate_documents" in str(results[0][1]) and "short_documents" in str(results[0][1])
