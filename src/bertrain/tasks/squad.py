"""SQuAD v1.1 / v2.0: reading, features (sliding windows over the context), caching and answer postprocessing.

Features follow Google's `run_squad.py` (and HF's `prepare_train_features`): the question is cut to
`max_query_length` tokens; the context is cut into windows of at most `max_seq_length - len(question) - 3`
tokens whose starts are `doc_stride` tokens apart; each window is `[CLS] question [SEP] window [SEP]`. A context
token that appears in several windows is scored only in the window where it has the most context on both sides
(`token_is_max_context`). Character offsets of the fast tokenizer map answers between characters and tokens both
ways, so predictions are exact substrings of the original context (no whitespace-token heuristics needed).

A SQuAD split is read from the official JSON file, or in the Hugging Face Hub's layout (`squad_layout`): Parquet
files (`plain_text/validation-00000-of-00001.parquet`, a folder holding one split's files) or a `datasets` folder
(`save_to_disk` of one split), one row per question with the columns id, title, context, question and answers
(struct of lists text / answer_start). Rows become the JSON's nesting again (`squad_json_from_table`: consecutive
rows with the same title form an article, with the same context a paragraph; v2.0 when a question has no answer),
so the reader's checks, the question ids of the predictions and the official metrics are those of the JSON file.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from bertrain.data.tables import Table, dataset_files, dataset_splits, hub_split_files, hub_splits
from bertrain.tasks.common import TaskTokenizer, default_cache_dir, file_sha256
from bertrain.utils.io import atomic_open, atomic_write_json

log = logging.getLogger(__name__)

FEATURE_VERSION = 1  # bump when the feature layout changes, so that old caches are not reused


@dataclass
class SquadExample:
    """One question about one paragraph."""

    qid: str
    question: str
    context: str
    answers: list[dict[str, Any]]  # [{"text", "answer_start"}]; empty for an unanswerable question
    is_impossible: bool = False
    plausible_answers: list[dict[str, Any]] = field(default_factory=list)
    title: str = ""


def load_json(path: Path) -> Any:
    """Parse a UTF-8 JSON file (a BOM allowed); `ValueError` naming the file and where on bad text or JSON."""
    try:
        text = path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({e})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: malformed JSON at line {e.lineno} column {e.colno}: {e.msg}") from None


def squad_layout(path: str | os.PathLike) -> tuple[str, list[Path]]:
    """("json" | "parquet" | "arrow", the files) of a SQuAD split: a JSON file, a Parquet or Arrow file, a folder of
    one split's Parquet files, or a `datasets` folder of one split. A folder that holds several splits is a
    `ValueError` naming them and what to give instead."""
    p = Path(path)
    if p.is_dir():
        files = dataset_files(p)
        if files is not None:
            return "arrow", files
        splits = dataset_splits(p)
        if splits is not None:
            raise ValueError(f"{p} is a `datasets` DatasetDict folder with the splits {', '.join(splits)}: give the "
                             f"folder of one split, e.g. {p / splits[0]}")
        parquet = sorted(f for f in p.glob("*.parquet") if f.is_file())
        if not parquet:
            raise ValueError(f"{p}: no SQuAD data in this folder (expected a `datasets` folder or one split's "
                             "Parquet files; or give the JSON file)")
        names = hub_splits(p)
        if len(names) > 1:
            raise ValueError(f"{p} holds the Parquet files of the splits {', '.join(names)}: give one split's "
                             f"file, e.g. {hub_split_files(p, names[-1])[0]}")
        return "parquet", parquet
    suffix = p.suffix.lower()
    return ("parquet" if suffix == ".parquet" else "arrow" if suffix == ".arrow" else "json"), [p]


_HUB_SQUAD = "the Hub's SQuAD has id, title, context, question, answers"


def squad_json_from_table(files: list[Path], fmt: str) -> dict[str, Any]:
    """The SQuAD JSON structure of the Hub's rows (one per question, in order): consecutive rows with the same
    title form an article, those with the same context a paragraph; with any question without an answer it is v2.0
    (every question gets `is_impossible`). A missing column or another type is a `ValueError` naming the file, the
    column and what was expected; the rows themselves are checked by `read_squad`, naming the question id."""
    articles: list[dict[str, Any]] = []
    unanswerable = False
    for path in files:
        with Table(path, fmt) as t:
            for c in ("id", "context", "question"):
                t.column(c, "string", hint=_HUB_SQUAD)
            cols = ["id", "context", "question", "answers"]
            t.column("answers", "answers", hint=_HUB_SQUAD)
            if t.has("title"):
                t.column("title", "string", hint=_HUB_SQUAD)
                cols.append("title")
            data = t.read(cols)
        for row, qid in enumerate(data["id"]):
            answers = _hub_answers(data["answers"][row], f"{path}: row {row} (question id {qid})")
            unanswerable = unanswerable or not answers
            title = (data["title"][row] if "title" in data else None) or ""
            context = data["context"][row]
            if not articles or articles[-1]["title"] != title:
                articles.append({"title": title, "paragraphs": []})
            paragraphs = articles[-1]["paragraphs"]
            if not paragraphs or paragraphs[-1]["context"] != context:
                paragraphs.append({"context": context, "qas": []})
            paragraphs[-1]["qas"].append({"id": qid, "question": data["question"][row], "answers": answers})
    if unanswerable:
        for article in articles:
            for para in article["paragraphs"]:
                for qa in para["qas"]:
                    qa["is_impossible"] = not qa["answers"]
    return {"version": "v2.0" if unanswerable else "1.1", "data": articles}


def _hub_answers(value: Any, where: str) -> list[dict[str, Any]]:
    """[{"text", "answer_start"}] of one row's `answers`: the Hub's struct of two lists, or a list of structs."""
    if value is None:
        raise ValueError(f"{where}: column 'answers' is empty (null), expected text and answer_start lists (empty "
                         "lists for an unanswerable question)")
    if isinstance(value, dict):
        texts, starts = value.get("text") or [], value.get("answer_start") or []
        if len(texts) != len(starts):
            raise ValueError(f"{where}: column 'answers' has {len(texts)} texts and {len(starts)} answer_starts, "
                             "expected one answer_start per text")
        return [{"text": t, "answer_start": a} for t, a in zip(texts, starts)]
    return [dict(a) for a in value]


def _load_squad(path: Path) -> Any:
    """The parsed JSON of a SQuAD split in any layout (`squad_layout`)."""
    fmt, files = squad_layout(path)
    return load_json(path) if fmt == "json" else squad_json_from_table(files, fmt)


def read_squad(path: str | os.PathLike, version_2_with_negative: bool | None = None) -> list[SquadExample]:
    """Read and validate a SQuAD split: a JSON file, or the Hub's Parquet / a `datasets` folder (`squad_layout`).

    Every answer must sit at its `answer_start` (checked character by character); contexts, questions and ids
    must be non-empty and ids unique. Problems raise `ValueError` naming the file and the question id.
    `version_2_with_negative=False` rejects unanswerable questions; None accepts both versions.
    """
    path = Path(path)
    data = _load_squad(path)
    if not isinstance(data, dict) or not isinstance(data.get("data"), list):
        raise ValueError(f"{path}: not a SQuAD file (expected an object with a 'data' list)")
    examples: list[SquadExample] = []
    seen: set[str] = set()
    for ai, article in enumerate(data["data"]):
        if not isinstance(article, dict) or not isinstance(article.get("paragraphs"), list):
            raise ValueError(f"{path}: article {ai} has no 'paragraphs' list")
        title = str(article.get("title", ""))
        for pi, para in enumerate(article["paragraphs"]):
            qas = para.get("qas") if isinstance(para, dict) else None
            if not isinstance(qas, list):
                raise ValueError(f"{path}: article {ai} paragraph {pi} has no 'qas' list")
            context = para.get("context")
            if isinstance(context, str):
                refuse_lone_surrogates(context, f"{path}: article {ai} paragraph {pi}: 'context'")
            for qa in qas:
                if not isinstance(qa, dict) or not isinstance(qa.get("id"), str) or not qa["id"]:
                    raise ValueError(f"{path}: article {ai} paragraph {pi}: a question without an 'id'")
                qid = qa["id"]
                where = f"{path}: question id {qid}"
                if qid in seen:
                    raise ValueError(f"{where}: duplicate question id")
                seen.add(qid)
                if not isinstance(context, str) or not context.strip():
                    raise ValueError(f"{where}: empty context (article {ai} paragraph {pi})")
                question = qa.get("question")
                if not isinstance(question, str) or not question.strip():
                    raise ValueError(f"{where}: empty question")
                refuse_lone_surrogates(question, f"{where}: 'question'")
                is_impossible = qa.get("is_impossible")
                if is_impossible not in (None, True, False):  # bool("false") is True: the question would flip
                    raise ValueError(f"{where}: 'is_impossible' must be true or false, got {is_impossible!r}")
                is_impossible = bool(is_impossible)
                if is_impossible and version_2_with_negative is False:
                    raise ValueError(f"{where}: unanswerable question in a file read as SQuAD v1.1 "
                                     "(pass --version-2-with-negative)")
                answers = qa.get("answers", [])
                if not isinstance(answers, list):
                    raise ValueError(f"{where}: 'answers' is not a list")
                if is_impossible and answers:
                    raise ValueError(f"{where}: is_impossible is true but answers are given")
                if not is_impossible and not answers:
                    raise ValueError(f"{where}: no answers and not marked is_impossible")
                plausible = qa.get("plausible_answers", []) if is_impossible else []
                if not isinstance(plausible, list):
                    raise ValueError(f"{where}: 'plausible_answers' is not a list, got {plausible!r:.80}")
                for kind, lst in (("answer", answers), ("plausible answer", plausible)):
                    for a in lst:
                        _check_answer(a, context, f"{where}: {kind}")
                examples.append(SquadExample(qid, question, context, answers, is_impossible, plausible, title))
    if not examples:
        raise ValueError(f"{path}: no questions")
    return examples


# A lone UTF-16 surrogate: what JSON's "\ud83d" escape decodes to when its pair was cut off (scraped text cut inside
# an emoji). No character: the tokenizer refuses the string (a TypeError deep in feature building, no file or
# question named), so fine-tuning and `bertrain predict` refuse it while reading (`serve` has its own request checks).
_SURROGATE = re.compile("[\ud800-\udfff]")


def refuse_lone_surrogates(text: str, where: str) -> None:
    """ValueError naming `where`, the code point and its position if `text` holds a lone surrogate."""
    bad = _SURROGATE.search(text)
    if bad:
        raise ValueError(f"{where} holds a lone UTF-16 surrogate (U+{ord(bad.group()):04X}) at character "
                         f"{bad.start() + 1}: not text (a JSON escape cut from its pair); fix the JSON escape")


def _check_answer(a: Any, context: str, where: str) -> None:
    if not isinstance(a, dict) or not isinstance(a.get("text"), str) or not isinstance(a.get("answer_start"), int):
        raise ValueError(f"{where} must have a string 'text' and an integer 'answer_start', got {a!r}")
    start, text = a["answer_start"], a["text"]
    if not text.strip():
        raise ValueError(f"{where} has empty text")
    if start < 0 or context[start:start + len(text)] != text:
        found = context[max(start, 0):max(start, 0) + len(text)]
        raise ValueError(f"{where} {text!r} does not match the context at answer_start {start} "
                         f"(the context there reads {found!r})")


# ----------------------------------------------------------------------------------------------- features

@dataclass
class SquadFeatureConfig:
    max_seq_length: int = 384
    """Tokens per window: [CLS] question [SEP] context-window [SEP], padded."""
    doc_stride: int = 128
    """Distance in tokens between the starts of consecutive context windows."""
    max_query_length: int = 64
    """Questions are cut to this many tokens."""

    def __post_init__(self) -> None:
        if self.max_query_length + 3 >= self.max_seq_length:
            raise ValueError(f"max_query_length ({self.max_query_length}) leaves no room for the context in "
                             f"max_seq_length ({self.max_seq_length})")
        if self.doc_stride <= 0:
            raise ValueError(f"doc_stride must be positive, got {self.doc_stride}")


# Arrays of one feature set; N features of length L.
#   input_ids, token_type_ids, attention_mask  (N, L) int64
#   start_positions, end_positions             (N,)   int64  (0 = [CLS]: no answer in this window)
#   example_index                               (N,)   int64  index into the example list
#   offsets                                     (N, L, 2) int32  char span in the context, -1 outside the context
#   max_context                                 (N, L) bool   token_is_max_context
SquadFeatures = dict[str, np.ndarray]


def max_context_window(spans: list[tuple[int, int]], n_tokens: int) -> np.ndarray:
    """For each context token, the window where it has the most context (Google's `_check_is_max_context`):
    score = min(left context, right context) + 0.01 * window length, ties to the earlier window.

    The same rule as asking per token over every window, but each window scores only its own tokens: work in the
    total window length (linear in the context) rather than tokens x windows, which made a long context (100k
    characters, thousands of windows) take minutes. tests/test_tasks_squad.py checks it against the per-token form."""
    best = np.full(n_tokens, -np.inf)
    owner = np.full(n_tokens, -1, dtype=np.int64)
    for i, (start, length) in enumerate(spans):
        p = np.arange(start, start + length)
        score = np.minimum(p - start, start + length - 1 - p) + 0.01 * length
        better = score > best[start:start + length]
        best[start:start + length][better] = score[better]
        owner[start:start + length][better] = i
    return owner


def answer_token_span(offsets: Any, char_start: int, char_end: int) -> tuple[int, int]:
    """Token indices [first, last] of the context tokens that overlap characters [char_start, char_end) ((-1, -1):
    none); `offsets`: (start, end) per token, a list or an (n, 2) array."""
    off = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
    hit = np.flatnonzero((off[:, 1] > char_start) & (off[:, 0] < char_end))
    return (int(hit[0]), int(hit[-1])) if len(hit) else (-1, -1)


ENCODE_CHUNK = 8192
"""Texts tokenized per `encode_batch` call in `build_features` (an Encoding holds ~80 bytes a token)."""


def _encode_chunked(tok: TaskTokenizer, texts: list[str]) -> Iterator[Any]:
    """`tok.encode_plain` of `texts`, `ENCODE_CHUNK` at a time (the same encodings, in order)."""
    for s in range(0, len(texts), ENCODE_CHUNK):
        yield from tok.encode_plain(texts[s:s + ENCODE_CHUNK])


def build_features(examples: list[SquadExample], tok: TaskTokenizer, cfg: SquadFeatureConfig,
                   is_training: bool) -> SquadFeatures:
    """Sliding-window features for `examples` (labels for training: the first answer, or [CLS]).

    Two passes: the windows of every example first (token ids as arrays, a few numbers per window), then the
    feature arrays, allocated once at their final size and filled row by row. Features built as Python lists of
    rows held ~30 KB per 384-token window until the end (3.8 GB at peak for SQuAD v1.1's train set, whose
    features are 1.1 GB)."""
    L = cfg.max_seq_length
    q_ids_of = [e.ids[: cfg.max_query_length] for e in _encode_chunked(tok, [ex.question for ex in examples])]
    # Paragraphs repeat across questions: tokenize each distinct context once.
    ctx_list = list(dict.fromkeys(ex.context for ex in examples))
    ctx_index = {c: i for i, c in enumerate(ctx_list)}
    contexts = [(np.asarray(e.ids, dtype=np.int64), np.asarray(e.offsets, dtype=np.int32).reshape(-1, 2))
                for e in _encode_chunked(tok, ctx_list)]
    del ctx_list

    plans = []  # per example: (context index, answer token span, windows, window owner of each context token)
    n_features = 0
    for ei, ex in enumerate(examples):
        ci = ctx_index[ex.context]
        c_ids, c_off = contexts[ci]
        if not len(c_ids):
            raise ValueError(f"question id {ex.qid}: the context has no tokens (only characters the tokenizer "
                             "drops: control or zero-width characters): fix or remove its paragraph")
        tok_start = tok_end = -1
        if is_training and not ex.is_impossible:
            a = ex.answers[0]
            tok_start, tok_end = answer_token_span(c_off, a["answer_start"], a["answer_start"] + len(a["text"]))
            if tok_start < 0:
                raise ValueError(f"question id {ex.qid}: the answer {a['text']!r} covers no token of the context "
                                 "(only characters the tokenizer drops): fix or remove the question")

        max_doc = L - len(q_ids_of[ei]) - 3
        spans: list[tuple[int, int]] = []
        start = 0
        while True:
            length = min(len(c_ids) - start, max_doc)
            spans.append((start, length))
            if start + length == len(c_ids):
                break
            start += min(length, cfg.doc_stride)
        plans.append((ci, tok_start, tok_end, spans, max_context_window(spans, len(c_ids))))
        n_features += len(spans)

    feats: SquadFeatures = {
        "input_ids": np.full((n_features, L), tok.pad_id, dtype=np.int64),
        "token_type_ids": np.zeros((n_features, L), dtype=np.int64),
        "attention_mask": np.zeros((n_features, L), dtype=np.int64),
        "start_positions": np.zeros(n_features, dtype=np.int64),
        "end_positions": np.zeros(n_features, dtype=np.int64),
        "example_index": np.zeros(n_features, dtype=np.int64),
        "offsets": np.full((n_features, L, 2), -1, dtype=np.int32),
        "max_context": np.zeros((n_features, L), dtype=bool),
    }
    fi = 0
    for ei, (ex, (ci, tok_start, tok_end, spans, owner)) in enumerate(zip(examples, plans)):
        q_ids = q_ids_of[ei]
        c_ids, c_off = contexts[ci]
        n_q = len(q_ids) + 2  # [CLS] question [SEP]
        for si, (start, length) in enumerate(spans):
            ids = feats["input_ids"][fi]
            ids[0], ids[1:n_q - 1], ids[n_q - 1] = tok.cls_id, q_ids, tok.sep_id
            ids[n_q:n_q + length] = c_ids[start:start + length]
            ids[n_q + length] = tok.sep_id
            feats["token_type_ids"][fi, n_q:n_q + length + 1] = 1
            feats["attention_mask"][fi, :n_q + length + 1] = 1
            feats["offsets"][fi, n_q:n_q + length] = c_off[start:start + length]
            feats["max_context"][fi, n_q:n_q + length] = owner[start:start + length] == si
            if is_training and not ex.is_impossible and start <= tok_start and tok_end <= start + length - 1:
                feats["start_positions"][fi] = tok_start - start + n_q
                feats["end_positions"][fi] = tok_end - start + n_q
            feats["example_index"][fi] = ei
            fi += 1
        plans[ei] = None  # (the owners, a context's length each, are not kept to the end)
    return feats


def _data_sha256(path: str | os.PathLike) -> str:
    """The content hash of a SQuAD split: its file's, or (a folder) that of its files' hashes in order."""
    _, files = squad_layout(path)
    if len(files) == 1 and files[0] == Path(path):
        return file_sha256(path)
    return hashlib.sha256(json.dumps([[f.name, file_sha256(f)] for f in files]).encode()).hexdigest()


def _build_features_of(data_file: str | os.PathLike, examples: list[SquadExample], tok: TaskTokenizer,
                       cfg: SquadFeatureConfig, is_training: bool) -> SquadFeatures:
    """`build_features`, its errors (a context or an answer of characters the tokenizer drops) naming the file:
    they name only the question id, and a run reads two files (--train, --dev)."""
    try:
        return build_features(examples, tok, cfg, is_training)
    except ValueError as e:
        raise ValueError(f"{data_file}: {e}") from None


def load_or_build_features(data_file: str | os.PathLike, examples: list[SquadExample], tok: TaskTokenizer,
                           cfg: SquadFeatureConfig, is_training: bool,
                           cache_dir: str | os.PathLike | None = None) -> tuple[SquadFeatures, Path | None]:
    """`build_features`, cached in `cache_dir` under a key of (file hash, tokenizer identity, settings).

    The cache file is written atomically, so concurrent ranks or a crash never leave a half-written cache;
    `cache_dir=""` disables caching.
    """
    if cache_dir == "":
        return _build_features_of(data_file, examples, tok, cfg, is_training), None
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    key = hashlib.sha256(json.dumps({
        "data": _data_sha256(data_file), "tokenizer": tok.identity, "max_seq_length": cfg.max_seq_length,
        "doc_stride": cfg.doc_stride, "max_query_length": cfg.max_query_length, "training": is_training,
        "n_examples": len(examples), "version": FEATURE_VERSION,
    }, sort_keys=True).encode()).hexdigest()[:24]
    path = cache_dir / f"squad-{Path(data_file).stem}-{'train' if is_training else 'eval'}-{key}.npz"
    if path.is_file():
        try:
            with np.load(path) as z:
                feats = {k: z[k] for k in z.files}
            if int(feats["example_index"].max()) < len(examples):
                log.info("loaded %d cached features from %s", len(feats["input_ids"]), path)
                return feats, path
        except (OSError, ValueError, KeyError) as e:  # corrupt cache: rebuild rather than fail
            log.warning("ignoring unreadable feature cache %s (%s)", path, e)
    feats = _build_features_of(data_file, examples, tok, cfg, is_training)
    with atomic_open(path, "wb") as f:  # streamed: an in-memory .npz and its bytes were two more copies (2.2 GB)
        np.savez(f, **feats)
    log.info("built %d features for %d examples, cached in %s", len(feats["input_ids"]), len(examples), path)
    return feats, path


# ----------------------------------------------------------------------------------------------- postprocess

@dataclass
class SquadPostprocessConfig:
    n_best_size: int = 20
    """Candidates kept per question (start and end indices considered per window, and entries in nbest)."""
    max_answer_length: int = 30
    """Longest answer, in tokens."""
    null_score_diff_threshold: float = 0.0
    """v2.0: predict no answer when score(null) - score(best span) exceeds this."""


def _softmax(x: list[float]) -> list[float]:
    if not x:
        return []
    a = np.asarray(x, dtype=np.float64)
    e = np.exp(a - a.max())
    return (e / e.sum()).tolist()


def _mark_end(context: str, end: int) -> int:
    """`end` moved past the combining marks (category Mn) right after it. An uncased tokenizer strips accents
    (NFD, then drops Mn), and a token's offsets then stop before a mark that followed its last letter: 'José' in
    decomposed form (NFD, as in Vietnamese or macOS text) gave the answer 'Jose', a Devanagari word lost its final
    vowel sign. A mark belongs to the letter before it, so the answer keeps it; a no-op where tokens keep marks."""
    while end < len(context) and unicodedata.category(context[end]) == "Mn":
        end += 1
    return end


def postprocess_predictions(examples: list[SquadExample], feats: SquadFeatures, start_logits: np.ndarray,
                            end_logits: np.ndarray, cfg: SquadPostprocessConfig, version_2_with_negative: bool,
                            ) -> tuple[dict[str, str], dict[str, list[dict[str, Any]]], dict[str, float]]:
    """Best answer text per question: (predictions, nbest, null_odds) as Google's `write_predictions`.

    `start_logits`/`end_logits` are (N, L), row i for feature i. For v2.0, `null_odds[qid]` = score_null -
    (start + end of the best non-null span), score_null being the smallest [CLS] score over the question's windows.
    """
    assert start_logits.shape == end_logits.shape == feats["input_ids"].shape
    by_example: dict[int, list[int]] = {}
    for fi, ei in enumerate(feats["example_index"].tolist()):
        by_example.setdefault(ei, []).append(fi)

    predictions: dict[str, str] = {}
    all_nbest: dict[str, list[dict[str, Any]]] = {}
    null_odds: dict[str, float] = {}
    for ei, ex in enumerate(examples):
        prelim: list[tuple[float, float, str, int, int]] = []  # (start_logit, end_logit, text, c0, c1)
        score_null, null_start, null_end = float("inf"), 0.0, 0.0
        for fi in by_example.get(ei, []):
            s_log, e_log = start_logits[fi], end_logits[fi]
            offs, maxc = feats["offsets"][fi], feats["max_context"][fi]
            if version_2_with_negative:
                null = float(s_log[0] + e_log[0])
                if null < score_null:
                    score_null, null_start, null_end = null, float(s_log[0]), float(e_log[0])
            starts = np.argsort(-s_log, kind="stable")[: cfg.n_best_size]
            ends = np.argsort(-e_log, kind="stable")[: cfg.n_best_size]
            for s in starts:
                if offs[s, 0] < 0 or not maxc[s]:
                    continue
                for e in ends:
                    if offs[e, 0] < 0 or e < s or e - s + 1 > cfg.max_answer_length:
                        continue
                    c0, c1 = int(offs[s, 0]), _mark_end(ex.context, int(offs[e, 1]))
                    prelim.append((float(s_log[s]), float(e_log[e]), ex.context[c0:c1], c0, c1))
        if version_2_with_negative:  # the null answer competes with the spans for a place in the n-best
            prelim.append((null_start, null_end, "", -1, -1))
        prelim.sort(key=lambda p: p[0] + p[1], reverse=True)
        nbest: list[dict[str, Any]] = []
        seen: set[str] = set()
        for sl, el, text, c0, c1 in prelim:
            if len(nbest) >= cfg.n_best_size:
                break
            if text in seen:
                continue
            seen.add(text)
            entry: dict[str, Any] = {"text": text, "start_logit": sl, "end_logit": el}
            if c0 >= 0:
                entry.update(char_start=c0, char_end=c1)
            nbest.append(entry)
        if version_2_with_negative:
            if "" not in seen:  # the null answer did not make the n-best: include it anyway (as Google's code)
                nbest.append({"text": "", "start_logit": null_start, "end_logit": null_end})
            if len(nbest) == 1:  # only the null answer: a nonce non-null entry keeps the logic below total
                nbest.insert(0, {"text": "empty", "start_logit": 0.0, "end_logit": 0.0})
        if not nbest:
            nbest.append({"text": "empty", "start_logit": 0.0, "end_logit": 0.0})
        probs = _softmax([p["start_logit"] + p["end_logit"] for p in nbest])
        for p, pr in zip(nbest, probs):
            p["probability"] = pr
        all_nbest[ex.qid] = nbest
        if not version_2_with_negative:
            predictions[ex.qid] = nbest[0]["text"]
            continue
        best_non_null = next(p for p in nbest if p["text"])
        diff = score_null - best_non_null["start_logit"] - best_non_null["end_logit"]
        null_odds[ex.qid] = diff
        predictions[ex.qid] = "" if diff > cfg.null_score_diff_threshold else best_non_null["text"]
    return predictions, all_nbest, null_odds


def apply_null_threshold(nbest: dict[str, list[dict[str, Any]]], null_odds: dict[str, float],
                         threshold: float) -> dict[str, str]:
    """v2.0 predictions for another threshold (e.g. the best one found on dev) without re-running the model."""
    out = {}
    for qid, entries in nbest.items():
        best_non_null = next(p for p in entries if p["text"])
        out[qid] = "" if null_odds[qid] > threshold else best_non_null["text"]
    return out


def at_best_f1_threshold(dataset_json: dict[str, Any], nbest: dict[str, list[dict[str, Any]]],
                         null_odds: dict[str, float], official: dict[str, Any]) -> tuple[float, dict[str, str],
                                                                                         dict[str, Any]]:
    """(threshold, predictions, their official v2.0 numbers) for the best-F1 threshold evaluate-v2.0.py found on
    `official`'s predictions. The script starts its sweep at threshold 0.0 meaning "answer nothing", which holds
    for probabilities in [0, 1]; null odds are unbounded, so when answering nothing scored best (no question
    improved on it) 0.0 would answer every question with negative odds. That case gets a threshold below every
    null odds instead. The official numbers themselves (best_f1, best_f1_thresh) are left as the script gives them."""
    from bertrain.tasks.metrics import evaluate_squad

    threshold = float(official["best_f1_thresh"])
    preds = apply_null_threshold(nbest, null_odds, threshold)
    scores = evaluate_squad(dataset_json, preds, None, version="2.0")
    if scores["f1"] < official["best_f1"] and null_odds:
        none = min(null_odds.values()) - 1.0
        none_preds = apply_null_threshold(nbest, null_odds, none)
        none_scores = evaluate_squad(dataset_json, none_preds, None, version="2.0")
        if none_scores["f1"] > scores["f1"]:
            threshold, preds, scores = none, none_preds, none_scores
    return threshold, preds, scores


def write_prediction_files(output_dir: str | os.PathLike, predictions: dict[str, str],
                           nbest: dict[str, list[dict[str, Any]]], null_odds: dict[str, float] | None) -> None:
    """predictions.json, nbest_predictions.json and (v2.0) null_odds.json, each written atomically."""
    output_dir = Path(output_dir)
    atomic_write_json(output_dir / "predictions.json", predictions)
    atomic_write_json(output_dir / "nbest_predictions.json", nbest)
    if null_odds is not None:
        atomic_write_json(output_dir / "null_odds.json", null_odds)


def load_dataset_json(path: str | os.PathLike, scoring: bool = True) -> dict[str, Any]:
    """The raw parsed SQuAD file (for the official evaluation), with a clear error on malformed JSON; the Hub's
    layouts (`squad_layout`) give the JSON structure of their rows.

    The nesting the official scripts read is checked: articles with 'paragraphs', paragraphs with 'qas', questions
    with an 'id' and (`scoring`: the file is to score predictions against) an 'answers' list of objects with a
    'text' string. A file without them is a `ValueError` naming the file and the question, where the scripts (and
    before this check, `bertrain evaluate`) stopped with a KeyError traceback."""
    data = _load_squad(Path(path))
    if not isinstance(data, dict) or not isinstance(data.get("data"), list):
        raise ValueError(f"{path}: not a SQuAD file (expected an object with a 'data' list)")
    for ai, article in enumerate(data["data"]):
        if not isinstance(article, dict) or not isinstance(article.get("paragraphs"), list):
            raise ValueError(f"{path}: article {ai} has no 'paragraphs' list")
        for pi, para in enumerate(article["paragraphs"]):
            qas = para.get("qas") if isinstance(para, dict) else None
            if not isinstance(qas, list):
                raise ValueError(f"{path}: article {ai} paragraph {pi} has no 'qas' list")
            for qa in qas:
                if not isinstance(qa, dict) or not isinstance(qa.get("id"), str) or not qa["id"]:
                    raise ValueError(f"{path}: article {ai} paragraph {pi}: a question without an 'id'")
                answers = qa.get("answers")
                if scoring and (not isinstance(answers, list) or
                                not all(isinstance(a, dict) and isinstance(a.get("text"), str) for a in answers)):
                    raise ValueError(f"{path}: question id {qa['id']}: 'answers' must be a list of objects with a "
                                     f"'text' string ([] for an unanswerable question), got {answers!r:.80}")
    return data
