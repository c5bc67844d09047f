"""What a pretraining run builds from raw text before it can train: the WordPiece vocabulary and the prepared
token store, each built once and reused.

`bertrain pretrain` with raw `data.input` (on the fly, into its output folder) and the `vocab` / `prepare` stages of
`bertrain run` call these two functions and nothing else, so "what is already there, what is missing" is decided
in one place. Each builds only what is missing: a re-run or a resume reuses a complete vocabulary or store, and
prepare resumes a partial store from its finished shards. Call them on one process (rank 0: `on_rank0`).
"""
from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any, Sequence

from bertrain.data.prepare import PrepareConfig, prepare
from bertrain.data.readers import CorpusConfig
from bertrain.data.tokenizer import VOCAB_STATS, train_vocab

log = logging.getLogger(__name__)


def ensure_vocab(inputs: Sequence[str], folder: Path, vocab_size: int, lowercase: bool,
                 corpus: CorpusConfig | None = None, min_frequency: int = 2) -> dict[str, Any]:
    """`folder/vocab.txt` trained on `inputs` unless it is already complete (vocab.txt and its stats file, both
    renamed into place last); returns the vocabulary's stats (`vocab-stats.json`)."""
    vocab, stats = folder / "vocab.txt", folder / VOCAB_STATS
    if not (vocab.is_file() and stats.is_file()):
        log.info("training a %d-token WordPiece vocabulary on %s", vocab_size, ", ".join(inputs))
        train_vocab(list(inputs), folder, vocab_size=vocab_size, lowercase=lowercase, min_frequency=min_frequency,
                    overwrite=vocab.exists(), corpus=corpus)
    return json.loads(stats.read_text(encoding="utf-8"))


def ensure_prepared(cfg: PrepareConfig) -> dict[str, Any]:
    """`cfg.output` prepared unless it is already complete (a store folder exists only once complete: it is
    renamed into place with `stats.json` written last); returns its stats."""
    out = Path(cfg.output)
    if not (out / "stats.json").is_file():
        log.info("preparing %s into %s", ", ".join(cfg.inputs), out)
        prepare(dataclasses.replace(cfg, overwrite=cfg.overwrite or out.exists()))  # (an incomplete old layout)
    return json.loads((out / "stats.json").read_text(encoding="utf-8"))
