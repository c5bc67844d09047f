"""Configs of the training engine, shared by pretraining (`tasks/pretraining.py`) and fine-tuning (`tasks/finetune.py`).

Each field has a one-line docstring right under it: `bertrain.config.add_config_arguments` turns it into the
`--section.key` help text. `__post_init__` rejects bad values with a `ValueError` naming the key; checks that need
the world size (the batch arithmetic) live in `resolve_batch`, called once the launcher's environment is known.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Literal, Optional

from bertrain.model.options import ModelOptionsConfig


def check_positive(key: str, value: float, allow_zero: bool = False) -> None:
    if not isinstance(value, (int, float)) or math.isnan(value) or value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"config key '{key}' must be {'>= 0' if allow_zero else '> 0'}, got {value!r}")


def check_all(checks: list) -> None:
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
    """Optimizer: lamb (the paper, trust-ratio clamps as DeepSpeed), nvlamb (as NVIDIA's BERT runs apex FusedLAMB:
    no trust ratio for biases and LayerNorm, gradients clipped to max_grad_norm first; its recipes set no clamps),
    adamw, radam."""
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
    """LAMB: upper clamp of the per-tensor trust ratio (DeepSpeed max_coeff; .inf in YAML: none, as apex)."""
    max_grad_norm: float = 1.0
    """Clip the all-reduced gradients to this global L2 norm; 0 disables clipping."""
    scale_lr_with_batch: bool = False
    """Linear LR scaling: lr * global_batch_size / base_batch_size (off by default: it hurt in the reports)."""
    base_batch_size: int = 256
    """Global batch size that `lr` was tuned for (used only with scale_lr_with_batch)."""
    init_state: Optional[str] = None
    """A checkpoint folder of an earlier run (OUTPUT/step-N, DDP or FSDP; or its run folder OUTPUT: the newest
    complete checkpoint) whose optimizer moments this run starts from, as NVIDIA's BERT phase 2 continues phase 1's LAMB moments. Its step counters start at 0 (so Adam's bias
    correction starts over, as there), and lr, betas, weight decay and the schedule are this run's. The same
    optimizer and the same parameters are required; the weights still come from the model's own init (pretraining:
    model.init). Unset (the default, as Google's and HF's scripts): the moments start at zero. A resumed run takes
    the moments of its own checkpoint instead."""

    def __post_init__(self) -> None:
        check_all([
            lambda: check_positive("optim.lr", self.lr),
            lambda: check_positive("optim.eps", self.eps),
            lambda: check_positive("optim.weight_decay", self.weight_decay, allow_zero=True),
            lambda: check_positive("optim.max_grad_norm", self.max_grad_norm, allow_zero=True),
            lambda: check_positive("optim.min_trust_ratio", self.min_trust_ratio, allow_zero=True),
            lambda: check_positive("optim.max_trust_ratio", self.max_trust_ratio),
            lambda: check_positive("optim.base_batch_size", self.base_batch_size),
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
    """LR schedule after warmup: linear decay, poly (NVIDIA's PolyWarmUpScheduler: (1 - step/total)^power over all
    steps, so the LR drops at the end of warmup), cosine, warmup_exp_decay_exp (DeepSpeed), constant."""
    warmup: float = 0.01
    """Warmup length: a fraction of the total steps if < 1, else a whole number of steps."""
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
    on_time: bool = False
    """Follow the wall clock instead of the step count: the schedule reaches its end at train.max_time (as
    cramming does); warmup is then a fraction of the budget. Such a run is not bit-reproducible."""

    def __post_init__(self) -> None:
        check_all([
            lambda: check_positive("schedule.warmup", self.warmup, allow_zero=True),
            lambda: check_positive("schedule.power", self.power),
            lambda: check_positive("schedule.decay_steps", self.decay_steps),
            lambda: check_positive("schedule.warmup_power", self.warmup_power),
            self._check_warmup_steps, self._check_ratios, self._check_on_time,
        ])

    def _check_warmup_steps(self) -> None:
        # 1 and above is a step count (warmup_steps): inf crashed there, 2.5 became 2 steps without a word
        if self.warmup >= 1 and not (math.isfinite(self.warmup) and self.warmup == int(self.warmup)):
            raise ValueError(f"config key 'schedule.warmup' ({self.warmup:g}) must be a fraction (< 1) of the steps "
                             "or a whole number of steps")

    def _check_on_time(self) -> None:
        # here, not only when the scheduler is built: that comes after the data are prepared (hours, for pretraining)
        if self.on_time and self.warmup >= 1:
            raise ValueError(f"config key 'schedule.warmup' ({self.warmup:g}) must be a fraction (< 1) of the time "
                             "budget with schedule.on_time")

    def _check_ratios(self) -> None:
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"config key 'schedule.min_lr_ratio' must be in [0, 1], got {self.min_lr_ratio}")
        if not 0.0 < self.decay_rate <= 1.0:
            raise ValueError(f"config key 'schedule.decay_rate' must be in (0, 1], got {self.decay_rate}")

    def warmup_steps(self, total_steps: int) -> int:
        """Warmup in steps: a fraction < 1 is of `total_steps`; 1 and above is a step count."""
        return int(round(self.warmup * total_steps)) if self.warmup < 1 else int(self.warmup)


FLOAT32_MAX = 3.4028234663852886e38
"""The largest float32 (torch.finfo(torch.float32).max): the largest loss scale GradScaler can hold."""


@dataclass
class PrecisionConfig:
    mode: Literal["fp32", "tf32", "bf16", "fp16"] = "fp32"
    """Numerics: fp32, tf32 matmuls (Ampere+), bf16 autocast, fp16 autocast with dynamic loss scaling."""
    initial_loss_scale: float = 65536.0
    """fp16: starting loss scale (a float32 number)."""
    min_loss_scale: float = 1.0
    """fp16: a scale below this with repeated overflows means the run has collapsed."""
    max_consecutive_skips: int = 20
    """fp16: stop with an error after this many consecutive overflow steps with the scale below min_loss_scale."""
    growth_interval: int = 2000
    """fp16: double the scale after this many steps without overflow."""

    def __post_init__(self) -> None:
        check_all([
            lambda: check_positive("precision.initial_loss_scale", self.initial_loss_scale),
            lambda: check_positive("precision.min_loss_scale", self.min_loss_scale, allow_zero=True),
            lambda: check_positive("precision.max_consecutive_skips", self.max_consecutive_skips),
            lambda: check_positive("precision.growth_interval", self.growth_interval),
            self._check_scale,
        ])

    def _check_scale(self) -> None:
        # GradScaler holds the scale in float32: inf skipped every step (inf x loss), above it failed at the first
        # backward pass with a traceback
        if isinstance(self.initial_loss_scale, (int, float)) and not self.initial_loss_scale <= FLOAT32_MAX:
            raise ValueError(f"config key 'precision.initial_loss_scale' must be a float32 number (<= "
                             f"{FLOAT32_MAX:.4g}; 65536 is the usual start), got {self.initial_loss_scale!r}")


@dataclass
class DistributedConfig:
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """Process-group backend: auto = nccl on GPU, gloo on CPU."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Device: auto = the local GPU when CUDA is available, else CPU."""
    timeout_s: int = 300
    """Collective timeout in seconds: a rank that stops answering fails the job after this long (torch's 1800 is
    half an hour of silence; the heartbeat names the rank sooner). Raise it only for steps slower than this. (With
    the heartbeat on, rank 0's checkpoint writes are waited for in the rendezvous store however long they take; a
    rank the heartbeat has not heard from for this long ends such a wait too.)"""
    bucket_cap_mb: int = 25
    """DDP gradient bucket size in MB (bigger buckets: fewer, larger allreduces; smaller: earlier overlap)."""
    grad_compression: Literal["none", "fp16", "bf16"] = "none"
    """Allreduce gradients in 16 bits (DDP comm hook): halves the bytes on the wire; see BENCHMARKS.md scaling."""
    heartbeat_interval_s: float = 5.0
    """Seconds between the heartbeats each rank writes to the rendezvous store (multi-process runs)."""
    heartbeat_timeout_s: float = 60.0
    """A rank whose heartbeat is this many seconds old is named in the log (rank, host, pid); 0: no heartbeat."""
    stop_grace_s: float = 20.0
    """After SIGTERM/SIGINT, seconds to wait for the step in flight to finish; past it the step counts as hung and
    the process exits (code 3) naming the last complete checkpoint. Keep it below the scheduler's kill delay."""

    def __post_init__(self) -> None:
        check_all([
            lambda: check_positive("distributed.timeout_s", self.timeout_s),
            lambda: check_positive("distributed.bucket_cap_mb", self.bucket_cap_mb),
            lambda: check_positive("distributed.heartbeat_interval_s", self.heartbeat_interval_s),
            lambda: check_positive("distributed.heartbeat_timeout_s", self.heartbeat_timeout_s, allow_zero=True),
            lambda: check_positive("distributed.stop_grace_s", self.stop_grace_s),
            self._check_heartbeat,
        ])

    def _check_heartbeat(self) -> None:
        if not self.heartbeat_timeout_s:
            return
        if self.heartbeat_timeout_s < 2 * self.heartbeat_interval_s:
            raise ValueError(f"config key 'distributed.heartbeat_timeout_s' ({self.heartbeat_timeout_s:g}) must be "
                             f"at least twice distributed.heartbeat_interval_s ({self.heartbeat_interval_s:g}), "
                             "or a healthy rank is reported as silent")
        if self.heartbeat_timeout_s > self.timeout_s:
            raise ValueError(f"config key 'distributed.heartbeat_timeout_s' ({self.heartbeat_timeout_s:g}) must not "
                             f"exceed distributed.timeout_s ({self.timeout_s}): the collective would time out before "
                             "the heartbeat names the silent rank")


@dataclass
class ParallelismConfig:
    strategy: Literal["ddp", "fsdp"] = "ddp"
    """Data parallelism: ddp (every rank holds full weights, gradients and optimizer state) or fsdp (PyTorch FSDP2:
    each rank holds 1/world of them, weights are all-gathered per layer for forward and backward; see
    train/parallel.py). Checkpoints of either resume under the other."""
    reshard_after_forward: bool = True
    """fsdp: free each layer's gathered weights after its forward and gather them again for backward, on every
    micro-step (ZeRO-3: least memory, most traffic); false gathers them once per optimizer step and keeps them
    through all micro-steps (full weights on every rank like ddp, gradients and optimizer state sharded)."""
    param_dtype: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    """fsdp: dtype in which weights are all-gathered and computed (auto: bf16/fp16 under precision.mode bf16/fp16,
    else fp32); the sharded master weights and the optimizer stay fp32."""
    reduce_dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    """fsdp: dtype of the gradient reduce-scatter (16 bits halves its bytes; fp32 keeps gradients exact)."""
    dp_shard: int = 0
    """fsdp: ranks that share one copy of the states (0: all ranks). Fewer than the world size is HSDP: states
    sharded within groups of dp_shard ranks (e.g. one node), replicated across the world / dp_shard groups."""

    def __post_init__(self) -> None:
        check_positive("parallelism.dp_shard", self.dp_shard, allow_zero=True)


@dataclass
class CheckpointConfig:
    save_interval: int = 1000
    """Save a checkpoint folder OUTPUT/step-N every this many steps (0: only at the end)."""
    keep_last: int = 3
    """Keep only the newest k checkpoint folders (0: keep all)."""
    export_final: bool = True
    """Also export the final model in HF format to OUTPUT/final."""

    def __post_init__(self) -> None:
        check_all([
            lambda: check_positive("checkpoint.save_interval", self.save_interval, allow_zero=True),
            lambda: check_positive("checkpoint.keep_last", self.keep_last, allow_zero=True),
        ])


@dataclass
class EvalConfig:
    enabled: bool = True
    """False: no evaluation while training at all, not even after the last step (e.g. to time training alone, as
    benchmarks/time_to_quality.py does; fine-tuning's dev evaluation after the run is not this one)."""
    interval: int = 0
    """Evaluate every this many optimizer steps (0: not periodically); there is always an evaluation after the last
    step. Pretraining evaluates on the prepared data's held-out documents, fine-tuning on the dev set."""
    each_epoch: bool = False
    """Also evaluate at the end of every epoch."""
    max_samples: int = 2048
    """Pretraining: held-out samples in the fixed evaluation set (spread over every held-out document)."""
    metric: str = ""
    """The selection metric (best checkpoint, early stopping, a search): '' = the task's primary metric (SQuAD f1,
    MRPC/QQP f1, CoLA mcc, STS-B pearson, accuracy otherwise; pretraining mlm_acc). Names ending in 'loss' are
    minimised, all others maximised."""
    final: Literal["best", "last"] = "last"
    """The model a run ends with (OUTPUT/final, the final dev evaluation): the best evaluated one (kept in
    OUTPUT/best) or the last one."""
    patience: int = 0
    """Early stopping: stop after this many evaluations in a row without an improvement of more than min_delta
    (0: never stop early)."""
    min_delta: float = 0.0
    """An improvement is a change of the selection metric by more than this."""
    target: Optional[float] = None
    """Stop once the selection metric reaches this value (e.g. 0.72 held-out MLM accuracy, MLPerf's BERT target)."""

    def __post_init__(self) -> None:
        check_all([
            lambda: check_positive("eval.interval", self.interval, allow_zero=True),
            lambda: check_positive("eval.max_samples", self.max_samples),
            lambda: check_positive("eval.patience", self.patience, allow_zero=True),
            lambda: check_positive("eval.min_delta", self.min_delta, allow_zero=True),
            self._check_enabled, self._check_target,
        ])

    def _check_target(self) -> None:
        # NaN is never reached (every comparison is false) and inf never either: the run went on to its end silently
        if self.target is not None and not math.isfinite(self.target):
            raise ValueError(f"config key 'eval.target' ({self.target}) must be a finite number, the value of the "
                             "selection metric (eval.metric) to stop at")

    def _check_enabled(self) -> None:
        if not self.enabled and (self.patience or self.target is not None):
            raise ValueError("eval.patience and eval.target need evaluations: drop them or set eval.enabled: true")


@dataclass
class MetricsConfig:
    report_to: list[str] = field(default_factory=lambda: ["auto"])
    """Experiment trackers beside metrics.jsonl (always written): tensorboard, mlflow, wandb (extras
    bertrain[tensorboard|mlflow|wandb]; a listed tracker without its package is an error before any work), or auto
    (the default): tensorboard when installed, else skipped with an info line; [] for none."""
    experiment: str = "bertrain"
    """MLflow experiment / W&B project."""
    run_name: str = ""
    """The tracker run's name ('' = the output folder's name)."""
    group: str = ""
    """Group runs together: a W&B group, an MLflow parent run of that name (bertrain run: the recipe's name)."""
    mlflow_uri: str = ""
    """MLflow tracking URI ('' = MLFLOW_TRACKING_URI, else MLflow's default: sqlite:///mlflow.db in the cwd)."""

    def __post_init__(self) -> None:
        from bertrain.train.trackers import check_report_to  # no heavy import: it only looks the packages up
        check_report_to(list(self.report_to), self.mlflow_uri)


@dataclass
class ProfileConfig:
    enabled: bool = False
    """Run torch.profiler on a window of steps: a trace (TensorBoard / chrome://tracing / Perfetto) and a table of
    the top operators in OUTPUT/profile/ (train/profiling.py)."""
    start_step: int = 5
    """Steps run before the window opens (compilation, allocator warm-up and the first loads are then over)."""
    steps: int = 3
    """Optimizer steps in the window."""
    ranks: Literal["0", "all"] = "0"
    """Profile rank 0 only, or every rank (each writes its own files)."""
    memory: bool = False
    """GPU: also a CUDA memory snapshot of the window (allocations with their stacks; open it at
    https://pytorch.org/memory_viz)."""
    record_shapes: bool = True
    """Record operator input shapes (the table can then tell the matmuls apart)."""
    with_stack: bool = False
    """Record Python stacks (a bigger, slower trace)."""
    top: int = 30
    """Rows of the top-operators table."""

    def __post_init__(self) -> None:
        check_all([
            lambda: check_positive("profile.start_step", self.start_step, allow_zero=True),
            lambda: check_positive("profile.steps", self.steps),
            lambda: check_positive("profile.top", self.top),
        ])


# ----------------------------------------------------------------------------------------------- the run

@dataclass
class TrainConfig:
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
    deterministic: bool = False
    """Deterministic kernels only (`torch.use_deterministic_algorithms`, cuBLAS's fixed workspace), so that on a GPU
    the same run, and a killed and resumed one, give the same weights bit for bit, at some speed cost. Without it a
    CUDA run may differ in the last bits from run to run (atomic-add reductions); CPU runs are deterministic anyway."""
    max_time: str = ""
    """A wall-clock budget for the training loop, e.g. '90m', '24h', '1h30m', '3600s' ('' = none): the run ends
    cleanly at the first step past it (checkpoint, final evaluation and export, exit 0). The time spent is part of
    the checkpoint, so a resumed run has only the rest of the budget."""

    def __post_init__(self) -> None:
        check_all([
            lambda: check_positive("train.steps", self.steps, allow_zero=True),
            lambda: check_positive("train.epochs", self.epochs, allow_zero=True),
            lambda: check_positive("train.global_batch_size", self.global_batch_size, allow_zero=True),
            lambda: check_positive("train.micro_batch_size", self.micro_batch_size),
            lambda: check_positive("train.accumulation", self.accumulation, allow_zero=True),
            lambda: check_positive("train.log_interval", self.log_interval),
            self._check_length,
        ])

    def _check_length(self) -> None:
        self.max_time_s  # parses, or raises naming the key
        if self.steps == 0 and self.epochs == 0 and not self.max_time:
            raise ValueError("config keys 'train.steps', 'train.epochs' and 'train.max_time' are all unset: set one "
                             "of them")

    @property
    def max_time_s(self) -> float | None:
        """`max_time` in seconds (None: no budget)."""
        return parse_duration("train.max_time", self.max_time) if self.max_time else None


_DURATION = re.compile(r"(?:(\d+(?:\.\d+)?)d)?(?:(\d+(?:\.\d+)?)h)?(?:(\d+(?:\.\d+)?)m)?(?:(\d+(?:\.\d+)?)s?)?")


def parse_duration(key: str, text: str) -> float:
    """'90m', '24h', '1h30m', '2d', '45s' or plain seconds ('3600') -> seconds (> 0)."""
    m = _DURATION.fullmatch(text.strip().lower())
    if not text.strip() or m is None or not any(m.groups()):
        raise ValueError(f"config key '{key}': expected a duration such as 90m, 24h, 1h30m or 3600s, got {text!r}")
    d, h, mins, s = (float(g) if g else 0.0 for g in m.groups())
    seconds = ((d * 24 + h) * 60 + mins) * 60 + s
    if seconds <= 0:
        raise ValueError(f"config key '{key}' must be a positive duration, got {text!r}")
    return seconds


@dataclass(frozen=True)
class BatchPlan:
    """The resolved batch arithmetic: global = micro x accumulation x world size."""
    global_batch_size: int
    micro_batch_size: int
    accumulation: int
    world_size: int


def resolve_batch(train: TrainConfig, world_size: int) -> BatchPlan:
    """Derive accumulation (or the global batch) for this world size; inconsistent values raise naming the keys.

    Keeping the global batch fixed and deriving accumulation is what makes a change of world size a launcher
    change only: the optimizer sees the same samples per step.
    """
    micro, acc, glob = train.micro_batch_size, train.accumulation, train.global_batch_size
    if glob == 0:
        acc = acc or 1
        glob = micro * acc * world_size
    elif acc == 0:
        if glob < micro * world_size and glob % world_size == 0:
            # micro_batch_size is the most one rank holds: a global batch below it x ranks needs no accumulation,
            # each rank takes its share (a recipe with micro = global ran on 1 process and was refused on 2: the
            # config would have had to change with the launcher)
            micro = glob // world_size
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
class TrainerConfig:
    """The sections every training run has (pretraining and fine-tuning configs extend it)."""

    train: TrainConfig = field(default_factory=TrainConfig)
    """Steps, batch sizes, logging."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer (lamb | nvlamb | adamw | radam)."""
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    """Learning-rate schedule."""
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    """Numeric precision (fp32 | tf32 | bf16 | fp16)."""
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    """Communication and health: process group, device, timeouts, heartbeat, stop grace."""
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    """How the ranks divide the model: ddp or fsdp (sharding, its dtypes, HSDP groups)."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoint folders."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Evaluation while training: when, the selection metric, the best model, early stopping."""
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    """Where records go beside metrics.jsonl: TensorBoard, MLflow, W&B."""
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    """torch.profiler on a window of steady-state steps."""
    model_options: ModelOptionsConfig = field(default_factory=ModelOptionsConfig)
    """How the model runs: unpadding, jagged attention, gradient checkpointing, compile (same results)."""
    seed: int = 12345
    """Seed of the model initialisation, data order, masking and dropout."""
    output_dir: str = ""
    """Folder for checkpoints (step-N), metrics.jsonl, the resolved config and the final export."""

    def __post_init__(self) -> None:
        if not self.output_dir:
            raise ValueError("config key 'output_dir' must not be empty")
        if self.schedule.on_time and not self.train.max_time:
            raise ValueError("config key 'schedule.on_time' needs a time budget: set train.max_time")
        if self.train.max_time and not (self.train.steps or self.train.epochs) and not self.schedule.on_time and \
                self.schedule.name != "constant":
            raise ValueError("config key 'train.max_time' without train.steps or train.epochs leaves the "
                             f"{self.schedule.name} schedule no length: set schedule.on_time: true (the schedule "
                             "ends at the budget) or train.steps")
        if self.train.max_time and not (self.train.steps or self.train.epochs) and not self.schedule.on_time and \
                0 < self.schedule.warmup < 1:
            # a fraction of a run whose length only the clock decides: of NO_STEP_LIMIT steps, i.e. an LR of ~0 forever
            raise ValueError(f"config key 'schedule.warmup' ({self.schedule.warmup:g}) is a fraction of the run's "
                             "steps, which train.max_time alone does not fix: give the warmup in steps (e.g. "
                             "schedule.warmup: 100; 0 for none), set train.steps, or set schedule.on_time: true (the "
                             "warmup is then a fraction of the budget)")
