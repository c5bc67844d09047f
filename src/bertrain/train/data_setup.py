"""Real pretraining data for the trainer: a prepared folder, or raw text prepared on the fly.

With `data.input` and no `data.prepared`, rank 0 trains a WordPiece vocabulary (unless `data.vocab_file` is given)
into OUTPUT/vocab/ and prepares the corpus into OUTPUT/data/ — each only if not already there, so a re-run or a
resume reuses them — while the other ranks wait. The tokenizer identity of the data is checked against the vocab
the model is built with: a mismatch is an error, not a garbage run.
"""
from __future__ import annotations

import logging
from pathlib import Path

from bertrain.train.config import BatchPlan, PretrainConfig
from bertrain.train.distributed import DistInfo, barrier

log = logging.getLogger(__name__)


def prepare_on_the_fly(cfg: PretrainConfig) -> tuple[Path, Path]:
    """(data dir, vocab file) under the output folder, building what is missing (call on rank 0 only)."""
    from bertrain.data.prepare import PrepareConfig, prepare
    from bertrain.data.tokenizer import train_vocab
    d, out = cfg.data, Path(cfg.output_dir)
    vocab_file = Path(d.vocab_file) if d.vocab_file else out / "vocab" / "vocab.txt"
    if not vocab_file.exists():
        if d.vocab_file:
            raise ValueError(f"config key 'data.vocab_file': {vocab_file} does not exist")
        log.info("training a %d-token WordPiece vocabulary on %s", d.vocab_size, ", ".join(d.input))
        train_vocab(list(d.input), vocab_file.parent, vocab_size=d.vocab_size, lowercase=d.do_lower_case)
    data_dir = out / "data"
    if not (data_dir / "stats.json").exists():
        log.info("preparing %s into %s", ", ".join(d.input), data_dir)
        prepare(PrepareConfig(
            inputs=list(d.input), output=str(data_dir), vocab_file=str(vocab_file), masking=d.masking,
            max_seq_length=d.max_seq_length, max_predictions_per_seq=d.max_predictions_per_seq,
            masked_lm_prob=d.masked_lm_prob, short_seq_prob=d.short_seq_prob, dupe_factor=d.dupe_factor,
            do_lower_case=d.do_lower_case, random_seed=cfg.seed, whole_word_masking=d.whole_word_masking,
            next_sentence=d.next_sentence, overwrite=data_dir.exists()))
    return data_dir, vocab_file


def build_real_data(cfg: PretrainConfig, dist: DistInfo, plan: BatchPlan):
    """A `PretrainData` over bertrain's prepared-data loader for this rank."""
    from bertrain.data.pretraining import PretrainingDataset, PretrainingLoader
    from bertrain.data.tokenizer import read_vocab
    from bertrain.model.hf import tokenizer_files_from_vocab
    from bertrain.train.pretrain import PretrainData
    d = cfg.data
    if d.source == "raw":
        error = None
        if dist.is_main:
            try:
                prepare_on_the_fly(cfg)
            except BaseException as e:  # let the other ranks leave the barrier before re-raising
                error = e
        barrier()
        from bertrain.train.distributed import broadcast_object
        if not broadcast_object(error is None):
            if error is not None:
                raise error
            raise RuntimeError("rank 0 failed to prepare the data (see its log)")
        data_dir, vocab_file = Path(cfg.output_dir) / "data", (
            Path(d.vocab_file) if d.vocab_file else Path(cfg.output_dir) / "vocab" / "vocab.txt")
    else:
        data_dir = Path(d.prepared)
        if not data_dir.is_dir():
            raise ValueError(f"config key 'data.prepared': {data_dir} is not a folder")
        vocab_file = Path(d.vocab_file) if d.vocab_file else data_dir / "vocab.txt"
        if not vocab_file.is_file():
            raise ValueError(f"config key 'data.vocab_file': {vocab_file} does not exist (give the vocab the data "
                             "was prepared with)")
    ds = PretrainingDataset(data_dir, d.max_seq_length, d.max_predictions_per_seq, d.masking, cfg.seed,
                            d.masked_lm_prob, d.short_seq_prob, d.whole_word_masking, d.next_sentence)
    ds.check_tokenizer(vocab_file, d.do_lower_case)
    loader = PretrainingLoader(ds, plan.micro_batch_size, dist.rank, dist.world_size, seed=cfg.seed,
                               num_workers=d.num_workers)
    vocab_size = len(read_vocab(vocab_file))
    log.info("data %s: %d samples per epoch, vocab %s (%d tokens)", data_dir, len(ds), vocab_file, vocab_size)
    return PretrainData(loader, vocab_size, tokenizer_files_from_vocab(vocab_file, d.do_lower_case),
                        ds.tokenizer_identity)
