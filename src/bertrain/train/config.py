"""Configs of the training engine (shared by pretraining and fine-tuning) and of `bertrain pretrain`.

Each field has a one-line docstring right under it: `bertrain.config.add_config_arguments` turns it into the
`--section.key` help text. `__post_init__` rejects bad values with a `ValueError` naming the key; checks that need
the world size (the batch arithmetic) live in `resolve_batch`, called once the launcher's environment is known.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, Optional


def _positive(key: str, value: float, allow_zero: bool = False) -> None:
    if not isinstance(value, (int, float)) or math.isnan(value) or value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"config key '{key}' must be {'>= 0' if allow_zero else '> 0'}, got {value!r}")


def _check_all(checks: list) -> None:
    """Run every check and report all problems at once (litgpt style), each naming its key."""
    errors = []
    for check in checks:
        try:
            check()
        except ValueError as e:
            errors.append(str(e))
    if errors:
        raise ValueError("; ".join(errors))


@dataclass
class OptimConfig:
    name: Literal["lamb", "nvlamb", "adamw", "radam"] = "adamw"
    """Optimizer: lamb (trust-ratio clamps as DeepSpeed), nvlamb (NVIDIA: global grad-norm pre-normalisation), adamw, radam."""
    lr: float = 1e-4
    """Peak learning rate (before optional linear scaling with the global batch)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam/LAMB beta1, beta2."""
    eps: float = 1e-6
    """Adam/LAMB epsilon added to sqrt(v) (BERT uses 1e-6)."""
    weight_decay: float = 0.01
    """Decoupled weight decay; never applied to biases and LayerNorm parameters."""
    bias_correction: bool = True
    """Adam bias correction of the moments; google-research/bert's AdamWeightDecayOptimizer has none (false)."""
    min_trust_ratio: float = 0.01
    """LAMB: lower clamp of the per-tensor trust ratio ||w||/||update|| (DeepSpeed min_coeff)."""
    max_trust_ratio: float = 10.0
    """LAMB: upper clamp of the per-tensor trust ratio (DeepSpeed max_coeff)."""
    max_grad_norm: float = 1.0
    """Clip the all-reduced gradients to this global L2 norm; 0 disables clipping."""
    scale_lr_with_batch: bool = False
    """Linear LR scaling: lr * global_batch_size / base_batch_size (off by default: it hurt in the reports)."""
    base_batch_size: int = 256
    """Global batch size that `lr` was tuned for (used only with scale_lr_with_batch)."""

    def __post_init__(self) -> None:
        _check_all([
            lambda: _positive("optim.lr", self.lr),
            lambda: _positive("optim.eps", self.eps),
            lambda: _positive("optim.weight_decay", self.weight_decay, allow_zero=True),
            lambda: _positive("optim.max_grad_norm", self.max_grad_norm, allow_zero=True),
            lambda: _positive("optim.min_trust_ratio", self.min_trust_ratio, allow_zero=True),
            lambda: _positive("optim.max_trust_ratio", self.max_trust_ratio),
            lambda: _positive("optim.base_batch_size", self.base_batch_size),
            self._check_betas, self._check_trust,
        ])

    def _check_betas(self) -> None:
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"config key 'optim.betas' must be two numbers in [0, 1), got {list(self.betas)}")

    def _check_trust(self) -> None:
        if self.min_trust_ratio > self.max_trust_ratio:
            raise ValueError("config key 'optim.min_trust_ratio' must not exceed 'optim.max_trust_ratio', got "
                             f"{self.min_trust_ratio} > {self.max_trust_ratio}")


@dataclass
class ScheduleConfig:
    name: Literal["linear", "poly", "cosine", "warmup_exp_decay_exp", "constant"] = "linear"
    """LR schedule after warmup: linear decay, poly (NVIDIA), cosine, warmup_exp_decay_exp (DeepSpeed), constant."""
    warmup: float = 0.01
    """Warmup length: a fraction of the total steps if < 1, else a number of steps."""
    power: float = 0.5
    """poly: decay exponent (NVIDIA uses 0.5)."""
    min_lr_ratio: float = 0.0
    """linear/poly/cosine: final LR as a fraction of the peak."""
    decay_rate: float = 0.99
    """warmup_exp_decay_exp: multiply the LR by this every decay_steps after warmup."""
    decay_steps: int = 1000
    """warmup_exp_decay_exp: steps per decay_rate factor."""
    warmup_power: float = 2.0
    """warmup_exp_decay_exp: warmup rises as (t/warmup)^warmup_power (DeepSpeed's degree 2)."""

    def __post_init__(self) -> None:
        _check_all([
            lambda: _positive("schedule.warmup", self.warmup, allow_zero=True),
            lambda: _positive("schedule.power", self.power),
            lambda: _positive("schedule.decay_steps", self.decay_steps),
            lambda: _positive("schedule.warmup_power", self.warmup_power),
            self._check_ratios,
        ])

    def _check_ratios(self) -> None:
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"config key 'schedule.min_lr_ratio' must be in [0, 1], got {self.min_lr_ratio}")
        if not 0.0 < self.decay_rate <= 1.0:
            raise ValueError(f"config key 'schedule.decay_rate' must be in (0, 1], got {self.decay_rate}")

    def warmup_steps(self, total_steps: int) -> int:
        """Warmup in steps: a fraction < 1 is of `total_steps`; 1 and above is a step count."""
        return int(round(self.warmup * total_steps)) if self.warmup < 1 else int(self.warmup)


@dataclass
class PrecisionConfig:
    mode: Literal["fp32", "tf32", "bf16", "fp16"] = "fp32"
    """Numerics: fp32, tf32 matmuls (Ampere+), bf16 autocast, fp16 autocast with dynamic loss scaling."""
    initial_loss_scale: float = 65536.0
    """fp16: starting loss scale."""
    min_loss_scale: float = 1.0
    """fp16: a scale below this with repeated overflows means the run has collapsed."""
    max_consecutive_skips: int = 20
    """fp16: stop with an error after this many consecutive overflow steps with the scale below min_loss_scale."""
    growth_interval: int = 2000
    """fp16: double the scale after this many steps without overflow."""

    def __post_init__(self) -> None:
        _check_all([
            lambda: _positive("precision.initial_loss_scale", self.initial_loss_scale),
            lambda: _positive("precision.min_loss_scale", self.min_loss_scale, allow_zero=True),
            lambda: _positive("precision.max_consecutive_skips", self.max_consecutive_skips),
            lambda: _positive("precision.growth_interval", self.growth_interval),
        ])


@dataclass
class DistributedConfig:
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """Process-group backend: auto = nccl on GPU, gloo on CPU."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Device: auto = the local GPU when CUDA is available, else CPU."""
    timeout_s: int = 1800
    """Collective timeout in seconds."""
    bucket_cap_mb: int = 25
    """DDP gradient bucket size in MB (bigger buckets: fewer, larger allreduces; smaller: earlier overlap)."""
    grad_compression: Literal["none", "fp16", "bf16"] = "none"
    """Allreduce gradients in 16 bits (DDP comm hook): halves the bytes on the wire; see BENCHMARKS.md scaling."""

    def __post_init__(self) -> None:
        _check_all([
            lambda: _positive("distributed.timeout_s", self.timeout_s),
            lambda: _positive("distributed.bucket_cap_mb", self.bucket_cap_mb),
        ])


@dataclass
class CheckpointConfig:
    save_interval: int = 1000
    """Save a checkpoint folder OUTPUT/step-N every this many steps (0: only at the end)."""
    keep_last: int = 3
    """Keep only the newest k checkpoint folders (0: keep all)."""
    export_final: bool = True
    """Also export the final model in HF format to OUTPUT/final."""

    def __post_init__(self) -> None:
        _check_all([
            lambda: _positive("checkpoint.save_interval", self.save_interval, allow_zero=True),
            lambda: _positive("checkpoint.keep_last", self.keep_last, allow_zero=True),
        ])


# ----------------------------------------------------------------------------------------------- pretraining

@dataclass
class ModelSection:
    preset: str = "tiny"
    """Model preset (tiny, mini, small, medium, base, large) or the path of an HF/Google config.json."""
    init: Optional[str] = None
    """Initialise the weights from this checkpoint or HF folder (weights only: phase 2 starts from phase 1)."""
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
    gradient_checkpointing: bool = False
    """Recompute each encoder layer's activations in the backward pass (less memory, ~1/3 more compute)."""
    compile: bool = False
    """torch.compile each encoder layer (dynamic shapes; worth it on GPU, minutes of compile time on CPU)."""
    jagged_attention: bool = False
    """Attention on nested (jagged) tensors: no padding even inside attention (SDPA's variable-length flash kernel
    on CUDA with bf16/fp16). Same results; 19% slower on CPU (BENCHMARKS.md); measure with `bertrain bench
    --jagged-attention` on your GPU. Works with `compile` (equal to eager on CPU)."""

    def architecture_overrides(self) -> dict:
        """The BertConfig fields this section overrides."""
        keys = ("max_position_embeddings", "num_hidden_layers", "hidden_size", "num_attention_heads",
                "intermediate_size")
        out = {k: getattr(self, k) for k in keys if getattr(self, k) is not None}
        if self.dropout is not None:
            out.update(hidden_dropout_prob=self.dropout, attention_probs_dropout_prob=self.dropout)
        return out

    def __post_init__(self) -> None:
        for k in ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size"):
            if getattr(self, k) is not None:
                _positive(f"model.{k}", getattr(self, k))
        if not self.preset:
            raise ValueError("config key 'model.preset' must name a preset or a config.json path")
        if self.dropout is not None and not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"config key 'model.dropout' must be in [0, 1), got {self.dropout}")
        if self.max_position_embeddings is not None:
            _positive("model.max_position_embeddings", self.max_position_embeddings)


@dataclass
class DataSection:
    prepared: Optional[str] = None
    """A prepared dataset folder (`bertrain prepare`); if absent and `input` is set, it is prepared on the fly."""
    input: list[str] = field(default_factory=list)
    """Raw corpus inputs (files, globs, or builtin:python-docs) prepared into OUTPUT/data when `prepared` is unset."""
    vocab_file: Optional[str] = None
    """WordPiece vocab.txt; with raw `input` and no vocab file a vocab is trained into OUTPUT/vocab/vocab.txt."""
    vocab_size: int = 8192
    """Size of the vocabulary trained on the fly (only without vocab_file)."""
    do_lower_case: bool = True
    """Lower-case and strip accents (uncased BERT)."""
    max_seq_length: int = 128
    """Tokens per sample including [CLS] and [SEP]s (128 phase 1, 512 phase 2)."""
    max_predictions_per_seq: int = 20
    """Masked positions per sample (20 phase 1, 80 phase 2)."""
    masked_lm_prob: float = 0.15
    """Fraction of tokens masked."""
    short_seq_prob: float = 0.1
    """Probability of a shorter target length (google-research/bert)."""
    masking: Literal["dynamic", "static"] = "dynamic"
    """dynamic: samples built and masked on the fly from (seed, epoch, index); static: materialised instances."""
    next_sentence: bool = True
    """NSP sentence pairs; false = MLM-only packing of full sentences (no NSP loss)."""
    whole_word_masking: bool = False
    """Mask whole words (all WordPieces of a word together)."""
    dupe_factor: int = 5
    """static masking: copies of the corpus with different masks."""
    num_workers: int = 0
    """DataLoader worker processes per rank."""
    synthetic_samples: int = 0
    """Use this many random synthetic samples instead of a dataset (engine tests and throughput checks); 0 = off."""
    uneven_last_rank: int = 0
    """synthetic only: the last rank gets this many micro-batches fewer per epoch (tests that uneven data never hangs)."""

    def __post_init__(self) -> None:
        _check_all([
            lambda: _positive("data.max_seq_length", self.max_seq_length),
            lambda: _positive("data.max_predictions_per_seq", self.max_predictions_per_seq),
            lambda: _positive("data.vocab_size", self.vocab_size),
            lambda: _positive("data.num_workers", self.num_workers, allow_zero=True),
            lambda: _positive("data.synthetic_samples", self.synthetic_samples, allow_zero=True),
            lambda: _positive("data.uneven_last_rank", self.uneven_last_rank, allow_zero=True),
            lambda: _positive("data.dupe_factor", self.dupe_factor),
            self._check_probs,
        ])

    def _check_probs(self) -> None:
        if not 0.0 < self.masked_lm_prob < 1.0:
            raise ValueError(f"config key 'data.masked_lm_prob' must be in (0, 1), got {self.masked_lm_prob}")
        if not 0.0 <= self.short_seq_prob <= 1.0:
            raise ValueError(f"config key 'data.short_seq_prob' must be in [0, 1], got {self.short_seq_prob}")

    @property
    def source(self) -> str:
        """Where samples come from: synthetic, prepared, or raw (prepare on the fly)."""
        if self.synthetic_samples:
            return "synthetic"
        if self.prepared:
            return "prepared"
        return "raw"


@dataclass
class TrainSection:
    steps: int = 0
    """Optimizer steps to run (0: derive from `epochs`)."""
    epochs: float = 0.0
    """Epochs over the data when `steps` is 0."""
    global_batch_size: int = 0
    """Samples per optimizer step over all ranks = micro_batch_size x accumulation x world size (0: derived)."""
    micro_batch_size: int = 32
    """Samples per forward/backward on one rank."""
    accumulation: int = 0
    """Micro-steps per optimizer step (0: derived from global_batch_size, micro_batch_size and the world size)."""
    log_interval: int = 10
    """Log metrics every this many steps."""
    trim_padding: bool = True
    """Drop padding columns beyond the longest sequence of each micro-batch (same result, less compute)."""

    def __post_init__(self) -> None:
        _check_all([
            lambda: _positive("train.steps", self.steps, allow_zero=True),
            lambda: _positive("train.epochs", self.epochs, allow_zero=True),
            lambda: _positive("train.global_batch_size", self.global_batch_size, allow_zero=True),
            lambda: _positive("train.micro_batch_size", self.micro_batch_size),
            lambda: _positive("train.accumulation", self.accumulation, allow_zero=True),
            lambda: _positive("train.log_interval", self.log_interval),
            self._check_length,
        ])

    def _check_length(self) -> None:
        if self.steps == 0 and self.epochs == 0:
            raise ValueError("config keys 'train.steps' and 'train.epochs' are both 0: set one of them")


@dataclass(frozen=True)
class BatchPlan:
    """The resolved batch arithmetic: global = micro x accumulation x world size."""
    global_batch_size: int
    micro_batch_size: int
    accumulation: int
    world_size: int


def resolve_batch(train: TrainSection, world_size: int) -> BatchPlan:
    """Derive accumulation (or the global batch) for this world size; inconsistent values raise naming the keys.

    Keeping the global batch fixed and deriving accumulation is what makes a change of world size a launcher
    change only: the optimizer sees the same samples per step.
    """
    micro, acc, glob = train.micro_batch_size, train.accumulation, train.global_batch_size
    if glob == 0:
        acc = acc or 1
        glob = micro * acc * world_size
    elif acc == 0:
        if glob % (micro * world_size):
            raise ValueError(
                f"config key 'train.global_batch_size' ({glob}) must be divisible by 'train.micro_batch_size' "
                f"({micro}) x world size ({world_size}) = {micro * world_size}; change one of them")
        acc = glob // (micro * world_size)
    elif glob != micro * acc * world_size:
        raise ValueError(
            f"config keys 'train.global_batch_size' ({glob}) != 'train.micro_batch_size' ({micro}) x "
            f"'train.accumulation' ({acc}) x world size ({world_size}); set accumulation to 0 to derive it")
    return BatchPlan(glob, micro, acc, world_size)


@dataclass
class PretrainConfig:
    model: ModelSection = field(default_factory=ModelSection)
    """Model architecture and initial weights."""
    data: DataSection = field(default_factory=DataSection)
    """Pretraining data."""
    train: TrainSection = field(default_factory=TrainSection)
    """Steps, batch sizes, logging."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer."""
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    """Learning-rate schedule."""
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    """Numeric precision."""
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    """Process group and device."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoint folders."""
    seed: int = 12345
    """Seed of model initialisation, data order and masking."""
    output_dir: str = "runs/pretrain"
    """Folder for checkpoints (step-N), metrics.jsonl, the plot, the resolved config and the final export."""

    def __post_init__(self) -> None:
        if not self.output_dir:
            raise ValueError("config key 'output_dir' must not be empty")
        if self.data.source == "raw" and not self.data.input:
            raise ValueError("config keys 'data.prepared', 'data.input' and 'data.synthetic_samples' are all empty: "
                             "give a prepared folder, raw input files, or synthetic samples")
        if self.data.max_predictions_per_seq > self.data.max_seq_length:
            raise ValueError("config key 'data.max_predictions_per_seq' must not exceed 'data.max_seq_length'")
