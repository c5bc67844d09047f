"""Cleaning (data/cleaning.py): normalisation, sentence splitting (abbreviations, initials, long runs), and batched
cleaning equal to one document at a time on fuzzed and real text."""
from __future__ import annotations

import random

import pytest

from bertrain.data.cleaning import clean_document, clean_documents, split_sentences
from bertrain.data.readers import CorpusConfig, SkipReport, iter_raw_documents
from conftest import shared_file


def test_split_sentences_abbreviations_initials_and_long_runs():
    s = split_sentences('Mr. Smith met Dr. J. R. R. Tolkien in the U.S. Army. He said "Hi!" Then 3 men left. '
                        "Version 3.5 is out? Yes.")
    assert s == ["Mr. Smith met Dr. J. R. R. Tolkien in the U.S. Army.", 'He said "Hi!"', "Then 3 men left.",
                 "Version 3.5 is out?", "Yes."]
    long = split_sentences("word " * 3000, max_chars=1000)
    assert len(long) >= 15 and all(len(x) <= 1000 for x in long)
    assert " ".join(long).split() == ["word"] * 3000


def test_one_word_sentence_ends_at_its_period():
    # The abbreviation check looks at the word before the period, not at the text since the paragraph's start
    # (which once made "Hi. Go" look like a dotted acronym and merged the sentences).
    assert split_sentences("Hi. Go. Stop now. Mr. Smith left.") == ["Hi.", "Go.", "Stop now.", "Mr. Smith left."]


FUZZ_ALPHABET = ["a", "B", "Mr", "Go", "no", ".", "!", "?", "\u2026", " ", "  ", "\n", "\n\n", "\n \n", "\r", "\r\n",
                 "\t", "\u00a0", "\u3000", "e\u0301", "\u0301", "\x00", "\x02", "\x03", "\x1f", "\u200b", "\ufeff",
                 "----", "\n----\n", "\"", "'", "(", "U.S.", "J.", "\u00c9", "1"]


@pytest.mark.parametrize("ascii_only", [True, False])
def test_batched_cleaning_equals_one_document_at_a_time(ascii_only):
    """`clean_documents` joins a chunk's documents and cleans them in one pass; the result must be exactly the
    per-document one, whatever the documents hold (separators, NULs, CRs at the joins, rule lines, odd spaces)."""
    rng = random.Random(0)
    alphabet = [a for a in FUZZ_ALPHABET if a.isascii()] if ascii_only else FUZZ_ALPHABET
    for _ in range(1500):
        texts = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 25))) for _ in range(rng.randint(1, 6))]
        for kind in ("text", "lines", "paragraphs"):
            assert clean_documents(texts, kind) == [clean_document(t, kind) for t in texts], (kind, texts)


@pytest.mark.parametrize("rel", ["text/tiny-shakespeare.txt", "wiki/enwiki-sample-pages-articles.xml.bz2"])
def test_batched_cleaning_equals_one_document_at_a_time_on_real_corpora(rel):
    raws = list(iter_raw_documents([str(shared_file(rel))], CorpusConfig(), SkipReport()))
    kind = raws[0].kind
    texts = [r.text for r in raws]
    batched = [s for i in range(0, len(texts), 700) for s in clean_documents(texts[i:i + 700], kind)]
    assert batched == [clean_document(t, kind) for t in texts]
    assert sum(map(len, batched)) > 10_000


def test_clean_document_controls_and_nfc():
    # No NFC (a cased tokenizer would then see another text than fine-tuning and serving: test_audit_unicode.py)
    out = clean_document("Cafe\u0301 au lait\x00 is\u200b good. Next one.", "text")
    assert out == ["Cafe\u0301 au lait is good.", "Next one."]
