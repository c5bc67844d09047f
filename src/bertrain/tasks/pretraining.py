"""Pretraining (MLM + NSP) as a task of the training engine: its config, data, model and loss.

`run_pretraining(cfg, resume)` is `bertrain pretrain`: the data (a prepared folder, raw text prepared on the fly,
or synthetic samples), a `BertForPreTraining` (a preset, a config.json, or weights from `model.init`), and the
loss sums of `bertrain.model.losses`; everything else is `bertrain.train.trainer.Trainer`.

With `data.input` and no `data.prepared`, rank 0 trains a WordPiece vocabulary (unless `data.vocab_file` is
given; with `model.init`, the model's own vocab.txt is copied instead) into OUTPUT/vocab/ and prepares the corpus
into OUTPUT/data/ — each only if not already there, so a re-run or a resume reuses them — while the other ranks
wait. The tokenizer identity of the data is checked against the
vocab the model is built with: a mismatch is an error, not a garbage run.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

import torch
from torch import nn

from bertrain.data.build import ensure_prepared, ensure_vocab
from bertrain.data.prepare import PrepareConfig
from bertrain.data.pretraining import HeldoutEvalSet, PretrainingDataset, PretrainingLoader
from bertrain.data.readers import CorpusConfig
from bertrain.data.samples import SampleConfig
from bertrain.data.store import heldout_status
from bertrain.data.synthetic import SyntheticPretrainingLoader
from bertrain.data.tokenizer import read_vocab
from bertrain.model.bert import BertConfig, BertForPreTraining
from bertrain.model.hf import (config_from_json_file, model_dir_or_name, read_tokenizer_files, resolve_model_dir,
                              tokenizer_files_from_vocab)
from bertrain.model.losses import pretraining_loss_sums
from bertrain.train import checkpoint as ckpt
from bertrain.train.config import BatchPlan, TrainerConfig, check_all, check_positive
from bertrain.train.distributed import (DistInfo, all_reduce_sum, distributed_context, on_rank0,
                                       same_paths_on_every_rank)
from bertrain.train.metrics import plot_metrics
from bertrain.train.precision import Precision
from bertrain.train.resume import checkpoint_for_gone_init, run_folder
from bertrain.train.trainer import RunResult, Trainer, to_device, trim_padding
from bertrain.utils.errors import UserError, writing
from bertrain.utils.io import atomic_write_bytes

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------------------- config

@dataclass
class ModelConfig:
    preset: str = "tiny"
    """Model preset (tiny, mini, small, medium, base, large) or the path of an HF/Google config.json."""
    init: Optional[str] = None
    """Initialise the weights from this checkpoint or HF folder (weights only: phase 2 starts from phase 1; the
    optimizer's moments too with optim.init_state, as NVIDIA's phase 2)."""
    dropout: Optional[float] = None
    """Override both hidden and attention dropout probabilities (e.g. 0 for exact equivalence tests)."""
    max_position_embeddings: Optional[int] = None
    """Override the preset's max_position_embeddings."""
    num_hidden_layers: Optional[int] = None
    """Override the preset's number of layers."""
    hidden_size: Optional[int] = None
    """Override the preset's hidden size."""
    num_attention_heads: Optional[int] = None
    """Override the preset's number of attention heads."""
    intermediate_size: Optional[int] = None
    """Override the preset's feed-forward size."""

    def architecture_overrides(self) -> dict:
        """The BertConfig fields this section overrides."""
        keys = ("max_position_embeddings", "num_hidden_layers", "hidden_size", "num_attention_heads",
                "intermediate_size")
        out = {k: getattr(self, k) for k in keys if getattr(self, k) is not None}
        if self.dropout is not None:
            out.update(hidden_dropout_prob=self.dropout, attention_probs_dropout_prob=self.dropout)
        return out

    def __post_init__(self) -> None:
        for k in ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size",
                  "max_position_embeddings"):
            if getattr(self, k) is not None:
                check_positive(f"model.{k}", getattr(self, k))
        if not self.preset:
            raise ValueError("config key 'model.preset' must name a preset or a config.json path")
        if self.dropout is not None and not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"config key 'model.dropout' must be in [0, 1), got {self.dropout}")


@dataclass
class DataConfig:
    prepared: Optional[str] = None
    """A prepared dataset folder (`bertrain prepare`); if absent and `input` is set, it is prepared on the fly."""
    input: list[str] = field(default_factory=list)
    """Raw corpus inputs (files, globs, or builtin:python-docs) prepared into OUTPUT/data when `prepared` is unset."""
    vocab_file: Optional[str] = None
    """WordPiece vocab.txt; with raw `input` and no vocab file a vocab is trained into OUTPUT/vocab/vocab.txt (with
    `model.init`: the model's vocab.txt is used)."""
    vocab_size: int = 8192
    """Size of the vocabulary trained on the fly (only without vocab_file), or of synthetic samples' ids."""
    do_lower_case: bool = True
    """Lower-case and strip accents (uncased BERT)."""
    encoding: str = "utf-8"
    """Text encoding of raw `input` files (e.g. latin-1 for legacy text; UTF-8 is strict: a binary file is refused)."""
    text_column: str = "text"
    """Raw `input` as JSONL, Parquet or a `datasets` folder: the field / column holding a document's text."""
    masking: Literal["dynamic", "static"] = "dynamic"
    """dynamic: samples built and masked on the fly from (seed, epoch, index); static: materialised instances."""
    dupe_factor: int = 5
    """static masking: copies of the corpus with different masks."""
    heldout_fraction: Optional[float] = None
    """Raw `input` only: share of the documents that the on-the-fly prepare holds out in OUTPUT/data/heldout for
    the held-out evaluation, never trained on (`bertrain prepare --heldout-fraction`); None: prepare's default (1%,
    at least `heldout_min_documents`). A small corpus needs more, e.g. 0.05 with a minimum of 4."""
    heldout_min_documents: Optional[int] = None
    """Raw `input` only: at least this many held-out documents (None: prepare's default, 10); a corpus where that
    is over 10% of its documents gets no held-out set."""
    num_workers: int = 0
    """DataLoader worker processes per rank."""
    synthetic_samples: int = 0
    """Use this many random synthetic samples instead of a dataset (engine tests and throughput checks); 0 = off."""
    uneven_last_rank: int = 0
    """synthetic only: the last rank gets this many micro-batches fewer per epoch (tests that uneven data never hangs)."""

    def __post_init__(self) -> None:
        check_all([
            lambda: check_positive("data.vocab_size", self.vocab_size),
            lambda: check_positive("data.num_workers", self.num_workers, allow_zero=True),
            lambda: check_positive("data.synthetic_samples", self.synthetic_samples, allow_zero=True),
            lambda: check_positive("data.uneven_last_rank", self.uneven_last_rank, allow_zero=True),
            lambda: check_positive("data.dupe_factor", self.dupe_factor),
            self._check_heldout,
        ])

    def _check_heldout(self) -> None:
        """Checked here, before a vocabulary is trained, not when prepare starts."""
        given = [k for k in ("heldout_fraction", "heldout_min_documents") if getattr(self, k) is not None]
        if given and self.source != "raw":
            raise ValueError(f"config key 'data.{given[0]}' applies to raw data.input (prepared on the fly); the "
                             "held-out set of a prepared folder is chosen when it is prepared (`bertrain prepare "
                             "--heldout-fraction`, `--add-heldout DIR` for an existing folder; in a recipe "
                             "data.prepare.heldout_fraction): remove it")
        if self.heldout_fraction is not None and not 0.0 <= self.heldout_fraction <= 0.5:
            raise ValueError(f"config key 'data.heldout_fraction' must be in [0, 0.5] (0: no held-out set), got "
                             f"{self.heldout_fraction}")
        if self.heldout_min_documents is not None:
            check_positive("data.heldout_min_documents", self.heldout_min_documents, allow_zero=True)

    @property
    def source(self) -> str:
        """Where samples come from: synthetic, prepared, or raw (prepare on the fly)."""
        if self.synthetic_samples:
            return "synthetic"
        if self.prepared:
            return "prepared"
        return "raw"


@dataclass
class PretrainConfig(TrainerConfig):
    """`bertrain pretrain`: model, data and sample settings plus the engine's sections."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """Model architecture and initial weights."""
    data: DataConfig = field(default_factory=DataConfig)
    """Where samples come from."""
    sample: SampleConfig = field(default_factory=SampleConfig)
    """What a sample is: length, masking, NSP."""
    output_dir: str = "runs/pretrain"
    """Folder for checkpoints (step-N), metrics.jsonl, the plot, the resolved config and the final export."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.data.source == "raw" and not self.data.input:
            raise ValueError("config keys 'data.prepared', 'data.input' and 'data.synthetic_samples' are all empty: "
                             "give a prepared folder, raw input files, or synthetic samples")


# ----------------------------------------------------------------------------------------------- the task

@dataclass(frozen=True)
class PretrainingData:
    """Where a run's samples come from, resolved once (`resolve_data`) before the task and its model are built."""
    data_dir: Path | None
    """The prepared folder (None: synthetic samples)."""
    vocab_file: Path | None
    vocab_size: int
    """Entries of the data's vocabulary: the model's vocab_size."""
    tokenizer_files: dict[str, bytes] | None
    """The tokenizer files that travel with the model (vocab.txt, tokenizer_config.json, ...)."""


def resolve_data(cfg: PretrainConfig, dist: DistInfo) -> PretrainingData:
    """The prepared folder and vocabulary of the run (every rank calls it): synthetic, a prepared folder, or raw
    input, whose vocabulary and token store rank 0 builds into OUTPUT/vocab and OUTPUT/data while the others wait."""
    d = cfg.data
    if d.source == "synthetic":
        return PretrainingData(None, None, d.vocab_size, None)
    if d.source == "raw":
        data_dir, vocab_file = on_rank0("prepare the data", lambda: prepare_on_the_fly(cfg), long=True)
    else:
        data_dir = Path(d.prepared)
        if not data_dir.is_dir():
            raise ValueError(f"config key 'data.prepared': {data_dir} is not a folder")
        vocab_file = Path(d.vocab_file) if d.vocab_file else data_dir / "vocab.txt"
        if not vocab_file.is_file():
            raise ValueError(f"config key 'data.vocab_file': {vocab_file} does not exist (give the vocab the data "
                             "was prepared with)")
    return PretrainingData(data_dir, vocab_file, len(read_vocab(vocab_file)),
                           tokenizer_files_from_vocab(vocab_file, d.do_lower_case))


class PretrainingTask:
    """MLM + NSP on `BertForPreTraining`; the MLM loss runs only on the masked positions. Evaluated on the fixed
    held-out set of the prepared folder (`HeldoutEvalSet`) when it has one."""

    name = "pretrain"
    loss_groups = ("mlm", "nsp")
    primary_metric = "mlm_acc"
    EVAL_SUMS = ("mlm_loss_sum", "mlm_count", "mlm_correct", "nsp_loss_sum", "nsp_count", "nsp_correct")

    def __init__(self, cfg: PretrainConfig, data: PretrainingData) -> None:
        self.cfg, self.data = cfg, data
        self._heldout: HeldoutEvalSet | None = None
        self.can_evaluate = False
        if data.data_dir is not None and cfg.eval.enabled:
            status = heldout_status(data.data_dir)
            self.can_evaluate = status.dir is not None
            if not self.can_evaluate:
                e = cfg.eval
                unused = [k for k, v in (("eval.target", e.target), ("eval.patience", e.patience)) if v]
                log.warning("no held-out evaluation: %s%s", status.reason,
                            f" ({' and '.join(unused)} will not stop this run)" if unused else "")

    @property
    def metric_names(self) -> tuple[str, ...]:
        """What `evaluate` returns (no NSP figures without NSP pairs): eval.metric is checked before the first step."""
        return ("mlm_loss", "mlm_acc", "mlm_perplexity") + (("nsp_loss", "nsp_acc") if self.cfg.sample.next_sentence
                                                             else ())

    def heldout(self) -> HeldoutEvalSet:
        """The fixed evaluation set, built on first use (the same on every rank: a pure function of the store)."""
        if self._heldout is None:
            assert self.data.data_dir is not None and self.data.vocab_file is not None
            self._heldout = HeldoutEvalSet(self.data.data_dir, self.cfg.sample, max_samples=self.cfg.eval.max_samples)
            self._heldout.check_tokenizer(self.data.vocab_file, self.cfg.data.do_lower_case)
            log.info("held-out evaluation: %d samples of %s", len(self._heldout), self._heldout.dir)
        return self._heldout

    def evaluate(self, model: nn.Module, dist: DistInfo, precision: Precision) -> dict[str, float]:
        """Held-out MLM and NSP loss and accuracy. Every rank sums its micro-batches of the fixed set into its rows
        of a (micro-batches x sums) table; the all-reduce adds zeros to every other row (exact), and the rows are
        added in micro-batch order: the same bits at every world size."""
        ev, b = self.heldout(), self.cfg.train.micro_batch_size
        table = torch.zeros(ev.num_batches(b), len(self.EVAL_SUMS), dtype=torch.float64, device=dist.device)
        for k, batch in ev.batches(b, dist.rank, dist.world_size):
            batch = to_device(trim_padding(batch) if self.cfg.train.trim_padding else batch, dist.device)
            with precision.autocast():
                out = self.forward(model, batch)
            if k >= 0:
                table[k] = torch.stack([out[n].detach().double().reshape(()) for n in self.EVAL_SUMS])
        if dist.world_size > 1:
            table = all_reduce_sum(table)
        s = dict(zip(self.EVAL_SUMS, table.sum(0).tolist()))
        out = {}
        for g in ("mlm", "nsp"):
            if s[f"{g}_count"]:  # no NSP pairs without sample.next_sentence
                out.update({f"{g}_loss": s[f"{g}_loss_sum"] / s[f"{g}_count"],
                            f"{g}_acc": s[f"{g}_correct"] / s[f"{g}_count"]})
        if "mlm_loss" in out:  # HF run_mlm's figure: exp of the mean loss per masked token
            out["mlm_perplexity"] = math.exp(min(out["mlm_loss"], 700.0))  # (capped: no float overflow)
        return out

    def build_loader(self, dist: DistInfo, plan: BatchPlan) -> Any:
        """This rank's loader over synthetic samples or the prepared folder."""
        cfg, d, data = self.cfg, self.cfg.data, self.data
        if data.data_dir is None:
            return SyntheticPretrainingLoader(d.synthetic_samples, plan.micro_batch_size, dist.rank,
                                              dist.world_size, cfg.seed, cfg.sample, d.vocab_size,
                                              d.uneven_last_rank)
        ds = PretrainingDataset(data.data_dir, cfg.sample, d.masking, cfg.seed)
        ds.check_tokenizer(data.vocab_file, d.do_lower_case)
        log.info("data %s: %d samples per epoch, vocab %s (%d tokens)", data.data_dir, len(ds), data.vocab_file,
                 data.vocab_size)
        return PretrainingLoader(ds, plan.micro_batch_size, dist.rank, dist.world_size, seed=cfg.seed,
                                 num_workers=d.num_workers)

    def build_model(self) -> nn.Module:
        return build_model(self.cfg, self.data.vocab_size, self.data.tokenizer_files)

    def target_counts(self, batch: dict[str, torch.Tensor]) -> list[int]:
        return [int((batch["masked_labels"] != -100).sum()), int((batch["next_sentence_labels"] != -100).sum())]

    def forward(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = model(input_ids=batch["input_ids"], token_type_ids=batch["token_type_ids"],
                    attention_mask=batch["attention_mask"], masked_positions=batch["masked_positions"])
        return pretraining_loss_sums(out.prediction_logits, out.seq_relationship_logits, batch["masked_labels"],
                                     batch["next_sentence_labels"])

    def metrics(self, sums: dict[str, float]) -> dict[str, Any]:
        nsp = sums["nsp_count"]
        return {"mlm_acc": sums["mlm_correct"] / max(sums["mlm_count"], 1),
                "nsp_acc": sums["nsp_correct"] / nsp if nsp else None}


def prepare_on_the_fly(cfg: PretrainConfig) -> tuple[Path, Path]:
    """(data dir, vocab file) under the output folder, building what is missing (`bertrain.data.build`, the
    routine of the pipeline's vocab and prepare stages too); call it on rank 0 only."""
    d, out = cfg.data, Path(cfg.output_dir)
    corpus = CorpusConfig(encoding=d.encoding, text_field=d.text_column)
    if d.vocab_file:
        vocab_file = Path(d.vocab_file)
        if not vocab_file.is_file():
            raise ValueError(f"config key 'data.vocab_file': {vocab_file} does not exist")
    elif cfg.model.init:
        # Continued pretraining: the corpus is tokenized with the model's own vocabulary (as HF run_mlm uses the
        # model's tokenizer), not with a new one that the model's embeddings do not match.
        vocab_file = out / "vocab" / "vocab.txt"
        init_vocab = read_tokenizer_files(resolve_model_dir(cfg.model.init)).get("vocab.txt")
        if init_vocab is None:
            raise ValueError(f"config key 'model.init': {cfg.model.init} has no vocab.txt (nor a BERT tokenizer.json) "
                             "to tokenize data.input with: give data.vocab_file")
        if not vocab_file.is_file() or vocab_file.read_bytes() != init_vocab:
            atomic_write_bytes(vocab_file, init_vocab)
        log.info("tokenizing data.input with the vocabulary of model.init %s", cfg.model.init)
    else:
        vocab_file = out / "vocab" / "vocab.txt"
        ensure_vocab(d.input, vocab_file.parent, d.vocab_size, d.do_lower_case, corpus)
    data_dir = out / "data"
    heldout = {k: getattr(d, k) for k in ("heldout_fraction", "heldout_min_documents") if getattr(d, k) is not None}
    ensure_prepared(PrepareConfig(inputs=list(d.input), output=str(data_dir), vocab_file=str(vocab_file),
                                  masking=d.masking, sample=cfg.sample, dupe_factor=d.dupe_factor,
                                  do_lower_case=d.do_lower_case, seed=cfg.seed, corpus=corpus, **heldout))
    return data_dir, vocab_file


def build_model(cfg: PretrainConfig, vocab_size: int, tokenizer_files: dict[str, bytes] | None) -> nn.Module:
    """BertForPreTraining from a preset or config.json, optionally initialised from a checkpoint (weights only)."""
    m = cfg.model
    overrides = m.architecture_overrides()
    if m.init:
        dropout = {k: v for k, v in overrides.items() if k.endswith("dropout_prob")}
        model = BertForPreTraining.from_pretrained(m.init, **dropout)
        for k, v in overrides.items():
            if k not in dropout and getattr(model.config, k) != v:
                raise ValueError(f"config key 'model.{k}' = {v} disagrees with the model.init weights ({m.init} has "
                                 f"{getattr(model.config, k)}); an initialised model keeps its shape")
        init_vocab = model.tokenizer_files.get("vocab.txt")
        if init_vocab and tokenizer_files and tokenizer_files.get("vocab.txt") not in (None, init_vocab):
            raise ValueError(f"config key 'model.init': the vocab.txt of {m.init} differs from the vocabulary the "
                             "data was tokenized with; prepare the data with the model's vocab.txt")
        init_lower = _recorded_lower_case(Path(model_dir_or_name(m.init)))
        if tokenizer_files and init_lower is not None and init_lower != cfg.data.do_lower_case:
            raise ValueError(_casing_message(cfg, init_lower))
        if tokenizer_files:
            _check_init_tokenizer_rules(cfg, Path(model_dir_or_name(m.init)), init_lower)
        if model.config.vocab_size != vocab_size:
            raise ValueError(f"config key 'model.init': {m.init} has vocab_size {model.config.vocab_size} but the "
                             f"data's vocabulary has {vocab_size} entries")
        log.info("initialised weights from %s (weights only; the schedule starts fresh, and the optimizer's moments %s)",
                 m.init, "come from optim.init_state" if cfg.optim.init_state else "start at zero")
    else:
        if m.preset.endswith(".json") or Path(m.preset).is_file():
            config = config_from_json_file(m.preset)
            if config.vocab_size != vocab_size:
                raise ValueError(f"config key 'model.preset': {m.preset} has vocab_size {config.vocab_size} but the "
                                 f"data's vocabulary has {vocab_size} entries")
            config = dataclasses.replace(config, **overrides)  # re-validated by BertConfig.__post_init__
        else:
            config = BertConfig.from_preset(m.preset, vocab_size=vocab_size, **overrides)
        model = BertForPreTraining(config)
    if tokenizer_files:
        model.tokenizer_files = dict(tokenizer_files)
    if cfg.sample.max_seq_length > model.config.max_position_embeddings:
        raise ValueError(f"config key 'sample.max_seq_length' ({cfg.sample.max_seq_length}) exceeds the model's "
                         f"max_position_embeddings ({model.config.max_position_embeddings})")
    return model


def _recorded_lower_case(folder: Path) -> bool | None:
    """The casing the tokenizer_config.json of a model folder records (None: no such file or key; a casing that
    bertrain would only guess for a folder without one is not held against the data)."""
    try:
        value = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8")).get("do_lower_case")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, bool) else None


# ----------------------------------------------------------------------------------------------- the run

@dataclass
class PretrainResult:
    """What `run_pretraining` returns (on every rank)."""
    run: RunResult
    output_dir: Path
    final_dir: Path | None = None

    @property
    def state(self):
        return self.run.state

    @property
    def stopped_by_signal(self) -> bool:
        return self.run.stopped_by_signal

    @property
    def model(self) -> nn.Module:
        return self.run.model

    @property
    def last_metrics(self) -> dict[str, Any]:
        return self.run.last_metrics


def run_pretraining(cfg: PretrainConfig, resume: str | None = None, overwrite: bool = False,
                    allow_config_change: bool = False) -> PretrainResult:
    """Pretrain BERT as configured; `resume` is None, "auto" (newest complete checkpoint) or a checkpoint path;
    `overwrite` moves another run's folder aside; `allow_config_change` applies run-changing keys on resume."""
    out = Path(cfg.output_dir)
    given, cfg = cfg, built_on_resume(cfg, resume)  # `given` is what the checkpoints' config.yaml is compared with
    check_model_fits_samples(cfg)
    check_init_casing(cfg)
    d, m = cfg.data, cfg.model
    reads = {"data.prepared": d.prepared if d.source == "prepared" else "", "data.vocab_file": d.vocab_file or "",
             "model.init": m.init or "", "model.preset": m.preset if m.preset.endswith(".json") else "",
             "optim.init_state": (cfg.optim.init_state or "") if resume is None else ""}  # a resume has its own
    with distributed_context(cfg.distributed, sharded=cfg.parallelism.strategy == "fsdp") as dist, \
            run_folder(out, "pretrain", dist, resume, overwrite, reads, models=("model.init",), cfg=cfg), \
            contextlib.ExitStack() as after_fit:
        # (run_folder checked the batch plan and the parallel layout before a raw corpus is turned into a
        # vocabulary and a token store: refused after them, hours were lost on a dump)
        same_paths_on_every_rank(input_paths(cfg))
        task = PretrainingTask(cfg, resolve_data(cfg, dist))
        run = Trainer(given, dist).fit(task, resume, allow_config_change)
        result = PretrainResult(run, out)
        if not run.stopped_by_signal:
            after_fit.enter_context(run.closing_on_error())
            result.final_dir = on_rank0("export the final model", lambda: _finish(cfg, run.model), long=True)
            results = {"steps": run.state.step, "stop_reason": run.ended_early, "train": run.last_metrics,
                       "evaluation": run.evaluation}
            run.finish(results, result.final_dir, out / "metrics.png")
        return result


def built_on_resume(cfg: PretrainConfig, resume: str | None) -> PretrainConfig:
    """The config the model is built from: `cfg`, unless a resume's `model.init` is gone. Phase 2 starts from phase
    1's final/ (model.init), but its own checkpoints hold every weight and OUTPUT/vocab the vocabulary: continuing
    needs only the architecture, the checkpoint's config.json. Before, moving or deleting phase 1's folder (to free
    disk) left phase 2 unresumable ("config key 'model.init': ... does not exist"). Where there is no checkpoint to
    resume, the usual error names model.init."""
    m, out = cfg.model, Path(cfg.output_dir)
    found = checkpoint_for_gone_init(m.init, resume, out)
    if found is None:
        return cfg
    log.warning("config key 'model.init': %s is gone; resuming from %s, whose config.json gives the architecture "
                "(the weights come from the checkpoint, as on any resume)", m.init, found)
    d, vocab = cfg.data, out / "vocab" / "vocab.txt"
    if d.source == "raw" and not d.vocab_file and vocab.is_file():  # the copy of model.init's vocab.txt made at start
        d = dataclasses.replace(d, vocab_file=str(vocab))
    return dataclasses.replace(cfg, data=d, model=dataclasses.replace(m, init="", preset=str(found / "config.json")))


def input_paths(cfg: PretrainConfig) -> dict[str, str]:
    """What every rank reads itself, by config key (`same_paths_on_every_rank`); a raw corpus is read by rank 0
    alone, into the output folder (`check_shared_output`)."""
    d, m = cfg.data, cfg.model
    return {"data.prepared": d.prepared if d.source == "prepared" else "", "data.vocab_file": d.vocab_file or "",
            "model.init": model_dir_or_name(m.init) if m.init else "",
            "model.preset": m.preset if m.preset.endswith(".json") else ""}


def _finish(cfg: PretrainConfig, model: nn.Module) -> Path | None:
    """Rank 0, after the last step: the metrics plot and the final model in HF format (OUTPUT/final)."""
    out = Path(cfg.output_dir)
    _plot(out)
    if not cfg.checkpoint.export_final:
        return None
    with writing(f"exporting the final model to {out / 'final'}", kept="the checkpoints are intact", where=out):
        return ckpt.export_final(out, model)


def check_model_fits_samples(cfg: PretrainConfig) -> None:
    """Refuse a sample length beyond the model's positions before any vocabulary or data is built."""
    positions = model_positions(cfg)
    if positions is not None and cfg.sample.max_seq_length > positions:
        raise UserError(f"config key 'sample.max_seq_length' ({cfg.sample.max_seq_length}) exceeds the model's "
                        f"max_position_embeddings ({positions}): lower it or use a model with more positions")


def check_init_casing(cfg: PretrainConfig) -> None:
    """Refuse data cased otherwise than the `model.init` model before any vocabulary or data is built (as
    google-research/bert's validate_case_matches_checkpoint); `build_model` checks it again."""
    m, d = cfg.model, cfg.data
    if not m.init or d.source == "synthetic":
        return
    lower = _recorded_lower_case(resolve_model_dir(m.init))
    if lower is not None and lower != d.do_lower_case:
        raise UserError(_casing_message(cfg, lower))
    _check_init_tokenizer_rules(cfg, resolve_model_dir(m.init), lower)


def _check_init_tokenizer_rules(cfg: PretrainConfig, folder: Path, init_lower: bool | None) -> None:
    """Refuse a `model.init` whose tokenizer_config.json sets rules `bertrain prepare` does not apply: prepare
    tokenizes with BERT's defaults (accents stripped exactly when lowercasing, CJK ideographs split), while
    fine-tuning, predict and serve follow the folder's `strip_accents` / `tokenize_chinese_chars`
    (`tasks.common.load_task_tokenizer`), so its continued pretraining would learn other ids than it is used with."""
    from bertrain.tasks.common import basic_tokenizer_settings

    try:
        strip_accents, chinese = basic_tokenizer_settings(folder)
    except ValueError as e:
        raise UserError(f"config key 'model.init': {e}") from None
    lower = cfg.data.do_lower_case if init_lower is None else init_lower
    odd = ([f"strip_accents = {str(strip_accents).lower()} (with do_lower_case = {str(lower).lower()})"]
           if strip_accents is not None and strip_accents != lower else [])
    odd += ["tokenize_chinese_chars = false"] if not chinese else []
    if odd:
        raise UserError(f"config key 'model.init': {folder / 'tokenizer_config.json'} sets {' and '.join(odd)}, "
                        "which `bertrain prepare` does not apply (it strips accents exactly when lowercasing and "
                        "splits CJK characters, BERT's defaults): continued pretraining would learn other token ids "
                        "than the model is fine-tuned and served with. Start from a model with BERT's default "
                        "tokenizer rules")


def _casing_message(cfg: PretrainConfig, init_lower: bool) -> str:
    return (f"config key 'data.do_lower_case' is {str(cfg.data.do_lower_case).lower()} but {cfg.model.init} is "
            f"{'uncased' if init_lower else 'cased'} (its tokenizer_config.json says do_lower_case = "
            f"{str(init_lower).lower()}): set data.do_lower_case: {str(init_lower).lower()}"
            + ("" if cfg.data.source == "raw" else " and prepare the data that way"))


def model_positions(cfg: PretrainConfig) -> int | None:
    """The max_position_embeddings of the model the run trains (from its preset, config.json or init folder; None
    when that folder has no config.json yet), known before anything is built."""
    m = cfg.model
    if m.init:
        from bertrain.model.hf import CONFIG_NAMES, resolve_model_dir  # a Hub model id: its snapshot in the HF cache

        init = resolve_model_dir(m.init)
        found = [init / name for name in CONFIG_NAMES if (init / name).is_file()]  # or Google's bert_config.json
        config = config_from_json_file(found[0]) if found else None
        if config is not None:  # an initialised model keeps its shape: its positions, not the override's
            given = m.max_position_embeddings
            if given is not None and given != config.max_position_embeddings:
                raise UserError(f"config key 'model.max_position_embeddings' = {given} disagrees with the model.init "
                                f"weights ({m.init} has {config.max_position_embeddings}); an initialised model "
                                "keeps its shape: remove the key")
            return config.max_position_embeddings
    elif m.preset.endswith(".json") or Path(m.preset).is_file():
        config = config_from_json_file(m.preset)
    else:
        config = BertConfig.from_preset(m.preset, **m.architecture_overrides())
    return m.max_position_embeddings or (config.max_position_embeddings if config else None)


def _plot(out: Path) -> None:
    jsonl = out / "metrics.jsonl"
    if jsonl.exists():
        try:
            plot_metrics(jsonl, out / "metrics.png")
        except Exception as e:  # a plot must never fail a finished run
            log.warning("could not plot metrics: %s", e)
