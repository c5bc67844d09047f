"""Audit of raw text -> vocabulary -> token store, as an experienced user runs it, against references (MediaWiki's
rendering of links, the inputs a glob names, exact-duplicate documents, the vocab command's settings and errors).
Each test fails on the code before the fix it names."""
from __future__ import annotations

import json
import os

import pytest

from bertrain.data.readers import CorpusConfig, SkipReport, doc_hash, iter_documents, iter_raw_documents, \
    resolve_inputs
from bertrain.data.tokenizer import VOCAB_STATS
from bertrain.data.wikitext import strip_wiki_markup
from conftest import shared_file
from helpers import one_line_error, run_cli

WIKI = "wiki/enwiki-sample-pages-articles.xml.bz2"




# ----------------------------------------------------------------------------------------------- wiki markup

def test_labelled_links_to_wiktionary_and_inline_interlanguage_links_keep_their_text():
    """MediaWiki shows the label of [[wikt:x|label]], of a colon-led interlanguage link [[:de:X|label]] and of an
    article whose title has a colon ([[Ben-Hur: A Tale of the Christ|Ben-Hur]]); before, all three were dropped,
    leaving "A great becomes a ruler" in the middle of sentences. Files, categories and sidebar interlanguage links
    ([[de:Paris]]) still show nothing."""
    wt = ("A great [[wikt:brigand|brigand]] becomes a ruler. The [[wiktionary:oblique|oblique]]ly lit side.\n"
          "The [[:de:Berliner Gesellschaft|Berlin Society]] and governor [[:no:Jose de Lima|Jose de Lima]].\n"
          "Novels such as ''[[Ben-Hur: A Tale of the Christ|Ben-Hur]]'' and [[Ben-Hur: A Tale of the Christ]].\n"
          "A [[wikt:brigand|brigand ''too'']] nested. [[File:X.jpg|thumb|a caption]] [[Category:Things]] "
          "[[de:Paris]] [[zh-yue:X]] [[:Category:Things|see the category]] [[wikt:bare]] end.")
    assert strip_wiki_markup(wt).splitlines() == [
        "A great brigand becomes a ruler. The obliquely lit side.",
        "The Berlin Society and governor Jose de Lima.",
        "Novels such as Ben-Hur and Ben-Hur: A Tale of the Christ.",
        "A brigand too nested. see the category end."]


def test_real_wikipedia_keeps_the_words_of_wiktionary_links():
    path = str(shared_file(WIKI))
    text = "\n".join(d.text for d in iter_documents([path], CorpusConfig(), SkipReport()))
    # Anarchism: 'A great [[wikt:brigand|brigand]] becomes a ruler of a Nation.'
    assert "A great brigand becomes a ruler of a Nation." in text
    assert "A great becomes" not in text
    # Apollo 8 (?): 'the first shafts of sunlight [[wiktionary:oblique|oblique]]ly illuminating'
    assert "obliquely illuminating" in text and " ly illuminating" not in text


def test_behaviour_switches_are_not_sentences():
    """__TOC__, __NOTOC__ ... are page settings (MediaWiki shows nothing); before, "__TOC__" was a sentence.
    Words that only look like them stay."""
    out = strip_wiki_markup("__NOTOC__\nText here.\n__TOC__\nThe C macros __FILE__ and __LINE__ expand.")
    assert out.splitlines() == ["Text here.", "The C macros __FILE__ and __LINE__ expand."]
    path = str(shared_file(WIKI))
    sentences = [s for d in iter_documents([path], CorpusConfig(), SkipReport()) for s in d.sentences]
    assert not [s for s in sentences if "__TOC__" in s or "__NOTOC__" in s]


# ----------------------------------------------------------------------------------------------- inputs

def test_a_glob_that_matches_folders_reads_them_as_folders(tmp_path):
    """`--input 'corpora/*'` with a folder per source: before, "matches no files" (folders were filtered out);
    `corpora/**` (folders and their files) reads each file once."""
    for name in ("news", "books"):
        d = tmp_path / "corpora" / name
        d.mkdir(parents=True)
        (d / "a.txt").write_text(f"The {name} text is here and long enough.\n")
        (d / ".hidden.txt").write_text("never read\n")
    (tmp_path / "corpora" / "top.txt").write_text("A top level text long enough to keep.\n")
    files = [str(tmp_path / "corpora" / p) for p in ("books/a.txt", "news/a.txt", "top.txt")]
    assert resolve_inputs([str(tmp_path / "corpora" / "*")]) == files
    assert [os.path.normpath(p) for p in resolve_inputs([str(tmp_path / "corpora" / "**")])] == files
    assert resolve_inputs([str(tmp_path / "corpora" / "*" / "*.txt")]) == files[:2]
    report = SkipReport()
    docs = list(iter_documents([str(tmp_path / "corpora" / "**")], CorpusConfig(), report))
    assert [d.sentences for d in docs] == [["The books text is here and long enough."],
                                           ["The news text is here and long enough."],
                                           ["A top level text long enough to keep."]]


def test_dedupe_finds_the_same_document_whatever_the_line_ends_around_it(tmp_path):
    """The same two documents in two text files, one without a final newline, one with CRLF line ends, and a JSONL
    file: --dedupe keeps 2 documents (before: 6, the raw texts differed by their trailing "\\n" / "\\r\\n")."""
    a, b = "Alpha beta gamma delta epsilon.", "Zeta eta theta iota kappa lambda."
    (tmp_path / "1.txt").write_text(f"{a}\n\n{b}", newline="")
    (tmp_path / "2.txt").write_bytes(f"{b}\r\n\r\n{a}\r\n".encode())
    (tmp_path / "3.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in (a, b)))
    inputs = [str(tmp_path / n) for n in ("1.txt", "2.txt", "3.jsonl")]
    raws = list(iter_raw_documents(inputs, CorpusConfig(), SkipReport()))
    assert len(raws) == 6 and len({doc_hash(r.text) for r in raws}) == 2
    report = SkipReport()
    docs = list(iter_documents(inputs, CorpusConfig(dedupe=True), report))
    assert [d.sentences for d in docs] == [[a], [b]]
    assert report.totals()["duplicate_documents"] == 4
    assert doc_hash("a\nb") != doc_hash("a b")  # the text itself still counts


# ----------------------------------------------------------------------------------------------- vocab command

def test_vocab_takes_the_corpus_settings_of_prepare(tmp_path, capsys):
    """`bertrain vocab --dedupe --min-document-chars N --keep-disambiguation`, as `prepare` takes them, so the
    vocabulary is trained on the text prepare keeps (before: "unrecognized arguments", exit 2)."""
    doc = "Alpha beta gamma delta epsilon zeta eta theta."
    (tmp_path / "c.txt").write_text(f"{doc}\n\n{doc}\n\nShort.\n\n{doc}\n")
    code, out, err = run_cli(capsys, "vocab", "--input", tmp_path / "c.txt", "--output", tmp_path / "v",
                             "--vocab-size", 60, "--dedupe", "--min-document-chars", 0, "--keep-disambiguation")
    assert code == 0, err
    stats = json.loads((tmp_path / "v" / VOCAB_STATS).read_text())
    assert stats["settings"]["dedupe"] is True and stats["settings"]["min_document_chars"] == 0
    assert stats["settings"]["skip_disambiguation"] is False
    assert stats["read"]["documents"] == 2 and stats["read"]["totals"] == {"duplicate_documents": 2}
    assert stats["num_words"] == 11  # 8 words and a period once, "Short" and its period once


@pytest.mark.parametrize("flag,value,message", [("--limit-alphabet", 0, "limit_alphabet must be >= 1"),
                                                ("--limit-alphabet", -1, "limit_alphabet must be >= 1"),
                                                ("--min-frequency", -1, "min_frequency must be >= 0")])
def test_vocab_refuses_settings_that_make_no_vocabulary(tmp_path, capsys, flag, value, message):
    """Before: --limit-alphabet 0 wrote a vocabulary of the 5 special tokens (every word [UNK]) with exit 0, -1
    silently dropped a character, and --min-frequency -1 was an OverflowError traceback (exit 1)."""
    (tmp_path / "c.txt").write_text("Alpha beta gamma delta epsilon zeta eta theta.\n")
    code, _, err = run_cli(capsys, "vocab", "--input", tmp_path / "c.txt", "--output", tmp_path / "v", flag, value)
    assert code == 2 and message in one_line_error(err)
    assert not (tmp_path / "v").exists()


def test_prepare_with_a_missing_vocab_file_is_one_line(tmp_path, capsys):
    """Before: FileNotFoundError, a traceback and exit 1 ("unexpected error ... please report it")."""
    (tmp_path / "c.txt").write_text("Alpha beta gamma delta epsilon zeta eta theta.\n")
    for vocab, says in ((tmp_path / "nope" / "vocab.txt", "does not exist"), (tmp_path, "is a folder")):
        code, _, err = run_cli(capsys, "prepare", "--input", tmp_path / "c.txt", "--output", tmp_path / "out",
                               "--vocab-file", vocab, "--masking", "dynamic")
        line = one_line_error(err)
        assert code == 2 and str(vocab) in line and says in line and "bertrain vocab" in line
        assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------------------------- sentences

def test_sentences_end_before_capitals_beyond_latin1_and_at_cjk_full_stops():
    """Before: a sentence end was seen only before A-Z, digits and À-Þ, so "Łódź. Łódź is" or "timbre. Ɂ
    indicates" (real Wikipedia) stayed one sentence, and Chinese/Japanese text (。！？, no space after them) was
    never split: a paragraph became one "sentence", cut at 4000 characters."""
    from bertrain.data.cleaning import clean_documents, split_sentences

    assert split_sentences("He moved to Łódź. Łódź is a city. Čapek wrote it. Москва is big. Α is alpha. "
                           "Then ő is lower. “ő too. “Ő starts.") == [
        "He moved to Łódź.", "Łódź is a city.", "Čapek wrote it.", "Москва is big.", "Α is alpha.",
        "Then ő is lower. “ő too.", "“Ő starts."]
    assert split_sentences("東京は日本の首都である。人口は約1400万人です。「本当？」と彼は言った。大阪も大きい！！次。") == [
        "東京は日本の首都である。", "人口は約1400万人です。", "「本当？」と彼は言った。", "大阪も大きい！！", "次。"]
    # unchanged: abbreviations, initials, acronyms
    assert split_sentences("Mr. Łukasz met Dr. J. Ó. Smith in the U.S. Ōsaka office.") == [
        "Mr. Łukasz met Dr. J. Ó. Smith in the U.S. Ōsaka office."]
    # batched cleaning still equals one document at a time with these characters at the joins
    import random
    rng = random.Random(1)
    alphabet = ["a", "Ł", "ő", "Ω", "東", "。", "！", "？", "」", "“", "\"", "(", ".", "!", " ", "\n", "\n\n", "Mr", "J."]
    for _ in range(800):
        texts = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 20))) for _ in range(rng.randint(1, 5))]
        for kind in ("text", "lines", "wiki"):
            assert clean_documents(texts, kind) == [clean_documents([t], kind)[0] for t in texts], (kind, texts)


def test_real_wikipedia_sentence_before_a_non_latin1_capital():
    path = str(shared_file(WIKI))
    sentences = [s for d in iter_documents([path], CorpusConfig(), SkipReport()) for s in d.sentences]
    assert "V indicates a vowel of unknown timbre." in sentences
    assert any(s.startswith("Ɂ indicates a glottal stop.") for s in sentences)
