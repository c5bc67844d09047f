"""Speed measurement: the pretraining step, the fine-tuning step and inference, ours beside HF in one run.

Method (the same in `bertrain bench`, `benchmarks/*.py` and BENCHMARKS.md):

* **Batches.** Sequence lengths are drawn uniformly from [ceil(0.3*T), T] with a fixed seed (T=128: 39..128), so
  about a third of every batch is padding, as in real pretraining data. Pretraining batches mask
  round(0.15*n) real tokens of each sequence (at most `max_predictions = ceil(0.15*T)`, 20 at T=128) and carry an NSP
  label. Every side sees the *same* batches: ours the `masked_positions`/`masked_labels` form of the loader, HF the
  `(B, T)` labels with -100 elsewhere (its documented interface; its MLM head then runs over every token).
* **Interleaving.** All sides are warmed up, then their timed steps alternate (A B B A A B ...), so drift of a shared,
  noisy machine falls on every side alike; we report medians and the ratio of medians. Same process, same threads,
  same precision, same optimizer implementation for everyone (the model is what is compared).
* **FLOPs** are *useful* matmul FLOPs, counted identically for every side (2 per multiply-add; training = 3x the
  forward): `flop_formula()` states it. Padding, and the MLM head on unmasked tokens, are not useful work, so a side
  that computes them is slower at the same FLOP count.
* **MFU** = achieved FLOP/s / the peak of one big GEMM at the same dtype, measured on the same device in the same run.
* **Memory**: CUDA `max_memory_allocated` during one step minus what was allocated before it; on CPU the peak of
  malloc's allocated bytes (glibc `mallinfo2`; RSS from /proc/self/statm where it is missing), sampled every 2 ms by
  a thread in an extra untimed step, minus the value before it.
"""
from __future__ import annotations

import contextlib
import copy
import ctypes
import math
import os
import statistics
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from bertrain.utils.memory import TRAINING_MMAP_THRESHOLD, TRAINING_TRIM_THRESHOLD, keep_freed_memory
from bertrain.model.bert import (BertConfig, BertForPreTraining, BertForQuestionAnswering,
                                 BertForSequenceClassification)

MODES = ("pretrain", "finetune", "inference")
DTYPES = {"fp32": None, "tf32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class BenchOptions:
    """What to measure; every field has a `bertrain bench` flag of the same name."""

    model: str = "base"
    seq_len: int | None = None          # None: 128 for pretrain/finetune, 384 for inference
    batch_size: int = 8
    device: str = "cpu"
    precision: str = "fp32"             # fp32 | tf32 | bf16 | fp16 (autocast; fp16 training with a GradScaler)
    mode: str = "pretrain"              # pretrain | finetune | inference | all
    compare: str | None = None          # "hf": time transformers' model beside ours
    compile: bool = False               # torch.compile ours (per layer, dynamic shapes) and HF (whole model)
    steps: int | None = None            # timed steps per side; None: 3 on CPU, 20 on CUDA
    warmup: int | None = None           # untimed steps per side; None: 1 on CPU (3 with compile), 5 on CUDA
    seed: int = 1234
    threads: int | None = None          # torch.set_num_threads; None: leave torch's default
    min_len_frac: float = 0.3           # lengths ~ U[ceil(min_len_frac*T), T]
    optimizer: str = "adamw"            # pretraining optimizer for both sides: adamw (fused; HF Trainer's default
                                        # adamw_torch_fused) | lamb (our LAMB); finetune: adamw
    # our fast paths (each can be switched off to measure what it gives)
    unpad: bool = True
    masked_head: bool = True
    fused_qkv: bool = True
    foreach: bool = True                # each optimizer's fast form for the device (fused AdamW; LAMB multi-
                                        # tensor on CUDA, per-tensor on CPU); False: per-tensor loops
    checkpointing: bool = False
    jagged_attention: bool = False      # unpadded runs: attention on nested (jagged) tensors
    keep_freed_memory: bool = False     # CPU: the trainer's malloc setting (utils/memory.py), for both sides

    def __post_init__(self) -> None:
        if self.mode not in (*MODES, "all"):
            raise ValueError(f"--mode {self.mode!r}: choose one of {', '.join(MODES)}, all")
        if self.precision not in DTYPES:
            raise ValueError(f"--precision {self.precision!r}: choose one of {', '.join(DTYPES)}")
        if self.compare not in (None, "hf"):
            raise ValueError(f"--compare {self.compare!r}: only 'hf' is supported")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"--device {self.device}: CUDA is not available on this machine")
        if self.batch_size < 1 or (self.seq_len is not None and self.seq_len < 8):
            raise ValueError("--batch-size must be >= 1 and --seq-len >= 8")
        if self.optimizer not in ("lamb", "adamw"):
            raise ValueError(f"--optimizer {self.optimizer!r}: choose lamb or adamw")

    @property
    def on_cuda(self) -> bool:
        return torch.device(self.device).type == "cuda"

    def seq_len_for(self, mode: str) -> int:
        return self.seq_len if self.seq_len is not None else (384 if mode == "inference" else 128)

    def n_steps(self) -> tuple[int, int]:
        steps = self.steps if self.steps is not None else (20 if self.on_cuda else 3)
        warmup = self.warmup if self.warmup is not None else (5 if self.on_cuda else (3 if self.compile else 1))
        return steps, warmup


# ----------------------------------------------------------------------------------------------- batches

def sample_lengths(batch_size: int, seq_len: int, seed: int, min_len_frac: float = 0.3) -> torch.Tensor:
    """(B,) lengths ~ U[ceil(min_len_frac * T), T], reproducible from `seed`."""
    g = torch.Generator().manual_seed(seed)
    lo = min(seq_len, max(3, math.ceil(min_len_frac * seq_len)))
    return torch.randint(lo, seq_len + 1, (batch_size,), generator=g)


def _token_batch(config: BertConfig, lengths: torch.Tensor, seq_len: int, g: torch.Generator) -> dict[str, Any]:
    B, V = len(lengths), config.vocab_size
    cls_id, sep_id = (101, 102) if V > 1000 else (2, 3)
    ids = torch.randint(min(999, V // 2), V, (B, seq_len), generator=g)
    mask = (torch.arange(seq_len)[None, :] < lengths[:, None]).long()
    tt = torch.zeros(B, seq_len, dtype=torch.long)
    for i, n in enumerate(lengths.tolist()):
        a = max(1, n // 2)
        ids[i, 0], ids[i, a - 1], ids[i, n - 1] = cls_id, sep_id, sep_id
        tt[i, a:n] = 1
    ids = ids * mask
    return {"input_ids": ids, "token_type_ids": tt, "attention_mask": mask}


def max_predictions(seq_len: int) -> int:
    return math.ceil(0.15 * seq_len)


def pretraining_batch(config: BertConfig, batch_size: int, seq_len: int, seed: int,
                      min_len_frac: float = 0.3) -> dict[str, torch.Tensor]:
    """A pretraining micro-batch in the loader's layout (ARCHITECTURE.md) plus `labels` (B, T) for HF's head."""
    lengths = sample_lengths(batch_size, seq_len, seed, min_len_frac)
    g = torch.Generator().manual_seed(seed + 1)
    b = _token_batch(config, lengths, seq_len, g)
    P = max_predictions(seq_len)
    pos = torch.zeros(batch_size, P, dtype=torch.long)
    mlabels = torch.full((batch_size, P), -100, dtype=torch.long)
    labels = torch.full((batch_size, seq_len), -100, dtype=torch.long)
    for i, n in enumerate(lengths.tolist()):
        k = min(P, max(1, round(0.15 * n)))
        chosen = (torch.randperm(n - 1, generator=g)[:k] + 1).sort().values  # never [CLS]
        pos[i, :k] = chosen
        mlabels[i, :k] = b["input_ids"][i, chosen]
        labels[i, chosen] = b["input_ids"][i, chosen]
        b["input_ids"][i, chosen] = 103 if config.vocab_size > 1000 else 4  # [MASK]
    b.update(masked_positions=pos, masked_labels=mlabels, labels=labels,
             next_sentence_labels=torch.randint(0, 2, (batch_size,), generator=g))
    return b


def qa_batch(config: BertConfig, batch_size: int, seq_len: int, seed: int,
             min_len_frac: float = 0.3) -> dict[str, torch.Tensor]:
    """A SQuAD-like batch: question + context, answer span inside the real tokens."""
    lengths = sample_lengths(batch_size, seq_len, seed, min_len_frac)
    g = torch.Generator().manual_seed(seed + 2)
    b = _token_batch(config, lengths, seq_len, g)
    start = torch.stack([torch.randint(max(1, n // 2), n - 1, (1,), generator=g)[0] for n in lengths.tolist()])
    b.update(start_positions=start, end_positions=torch.minimum(start + 3, lengths - 2))
    return b


# ----------------------------------------------------------------------------------------------- FLOPs

def flop_formula() -> str:
    return ("useful matmul FLOPs, 2 per multiply-add, training = 3 x forward: forward = "
            "L*2*(4*H^2 + 2*H*I) * sum(n_i)  [QKV, attention output, FFN on real tokens] "
            "+ L*4*H * sum(n_i^2)  [QK^T and AV over real tokens] "
            "+ 2*(H^2 + H*V) * masked_tokens + 2*(H^2 + 2*H) * B  [MLM head at masked positions, pooler+NSP] "
            "(fine-tuning/inference QA head: 2*2*H * sum(n_i)); embeddings, softmax, LayerNorm, GELU not counted")


def model_flops(config: BertConfig, lengths: torch.Tensor, mode: str, masked_tokens: int = 0) -> float:
    """FLOPs of one step on a batch with real lengths `lengths`, by `flop_formula()`."""
    H, I, L, V = config.hidden_size, config.intermediate_size, config.num_hidden_layers, config.vocab_size
    n = lengths.double()
    fwd = L * 2 * (4 * H * H + 2 * H * I) * n.sum() + L * 4 * H * (n * n).sum()
    if mode == "pretrain":
        fwd = fwd + 2 * (H * H + H * V) * masked_tokens + 2 * (H * H + 2 * H) * len(lengths)
    else:
        fwd = fwd + 2 * 2 * H * n.sum()
    return float(fwd * (1 if mode == "inference" else 3))


def matmul_peak(device: torch.device, dtype: torch.dtype, n: int | None = None, reps: int = 5) -> float:
    """Best FLOP/s of an n x n x n GEMM at `dtype` on `device` (the MFU denominator)."""
    n = n or (8192 if device.type == "cuda" else 2048)
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    best = float("inf")
    for i in range(reps + 2):
        _sync(device)
        t0 = time.perf_counter()
        (a @ b)
        _sync(device)
        if i >= 2:
            best = min(best, time.perf_counter() - t0)
    return 2 * n ** 3 / best


# ----------------------------------------------------------------------------------------------- timing

def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]


def _heap_reader() -> Callable[[], int] | None:
    """Bytes malloc has handed out and not got back (glibc >= 2.33 `mallinfo2`: in-use heap + mmapped blocks), or
    None. Unlike RSS this does not depend on whether freed memory goes back to the kernel (the trainer keeps it:
    utils/memory.py), so it measures what a step allocates, like CUDA's max_memory_allocated."""
    try:
        fn = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):
        return None
    fn.restype = _MallInfo2

    def read() -> int:
        info = fn()
        return int(info.uordblks + info.hblkhd)
    return read


_HEAP = _heap_reader() if sys.platform.startswith("linux") else None


class _MemorySampler:
    """Peak allocated memory (or, without mallinfo2, RSS) of this process while the context is open (a 2 ms
    sampling thread)."""

    def __init__(self, read: Callable[[], int]):
        self.read = read

    def __enter__(self) -> "_MemorySampler":
        self.base = self.peak = self.read()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, self.read())

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, self.read())


def peak_step_memory(step: Callable[[], None], device: torch.device) -> int:
    """Extra bytes at the peak of one `step()` over what was held before it."""
    if device.type == "cuda":
        _sync(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        _sync(device)
        return torch.cuda.max_memory_allocated(device) - before
    read = _HEAP or (_rss_bytes if os.path.exists("/proc/self/statm") else None)
    if read is None:
        return -1
    with _MemorySampler(read) as s:
        step()
    return s.peak - s.base


@dataclass
class Side:
    """One thing to time: a name and a step function (a training step or an inference forward)."""

    name: str
    step: Callable[[], None]
    times: list[float] = field(default_factory=list)
    cpu_times: list[float] = field(default_factory=list)  # process CPU seconds (all threads) per timed step
    peak_bytes: int = -1
    info: dict[str, Any] = field(default_factory=dict)


def time_interleaved(sides: list[Side], steps: int, warmup: int, device: torch.device,
                     measure_memory: bool = True) -> None:
    """Warm every side up, then alternate their timed steps (forward order on even rounds, reversed on odd)."""
    for _ in range(warmup):
        for s in sides:
            s.step()
    _sync(device)
    for i in range(steps):
        for s in (sides if i % 2 == 0 else sides[::-1]):
            _sync(device)
            t0, c0 = time.perf_counter(), time.process_time()
            s.step()
            _sync(device)
            s.times.append(time.perf_counter() - t0)
            s.cpu_times.append(time.process_time() - c0)
    if measure_memory:
        for s in sides:
            s.peak_bytes = peak_step_memory(s.step, device)


# ----------------------------------------------------------------------------------------------- models

def build_ours(mode: str, config: BertConfig) -> nn.Module:
    if mode == "pretrain":
        return BertForPreTraining(config)
    return BertForQuestionAnswering(config)


def build_hf(ours: nn.Module, attn_implementation: str = "sdpa") -> nn.Module:
    """transformers' counterpart of `ours` with the same weights (our key map: QKV split, vocab padding sliced)."""
    import transformers

    from bertrain.model.hf import to_hf_state_dict

    cls_name = {BertForPreTraining: "BertForPreTraining", BertForQuestionAnswering: "BertForQuestionAnswering",
                BertForSequenceClassification: "BertForSequenceClassification"}[type(ours)]
    hf_config = transformers.BertConfig(**ours.config.to_hf_dict([cls_name]))
    if isinstance(ours, BertForSequenceClassification):
        hf_config.num_labels = ours.num_labels
    hf = getattr(transformers, cls_name)._from_config(hf_config, attn_implementation=attn_implementation)
    state = {k: v.detach().clone() for k, v in to_hf_state_dict(ours).items()}
    missing, unexpected = hf.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith(("position_ids", "decoder.weight", "decoder.bias"))]
    if missing or unexpected:
        raise RuntimeError(f"HF model does not match ours: missing {missing}, unexpected {unexpected}")
    hf.tie_weights()
    return hf


class SplitQKV(nn.Module):
    """Ablation of the fused QKV projection: three GEMMs on the three row blocks of the same fused weight (so the
    parameters, their gradients and the optimizer are unchanged), concatenated back for the attention code."""

    def __init__(self, fused: nn.Linear):
        super().__init__()
        self.fused = fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ws, bs = self.fused.weight.chunk(3, 0), self.fused.bias.chunk(3, 0)
        return torch.cat([F.linear(x, w, b) for w, b in zip(ws, bs)], dim=-1)


def split_qkv(model: nn.Module) -> None:
    """Replace every fused `qkv` Linear by `SplitQKV` (in place, same parameters)."""
    for m in model.modules():
        if isinstance(getattr(m, "qkv", None), nn.Linear):
            m.qkv = SplitQKV(m.qkv)


def configure_ours(model: nn.Module, opts: BenchOptions) -> dict[str, Any]:
    """Switch our model's fast paths on or off as `opts` says; returns what is actually active."""
    bert = model.bert
    active: dict[str, Any] = {}
    if hasattr(bert, "unpad"):
        bert.unpad = opts.unpad
        if hasattr(model, "qa_outputs"):
            model.unpad = opts.unpad  # QA: opt-in (padding logits -10000 instead of HF's values)
        active["unpad"] = opts.unpad
    else:
        active["unpad"] = "not available in this model version"
    if hasattr(bert, "gradient_checkpointing"):
        bert.gradient_checkpointing = opts.checkpointing
        active["gradient_checkpointing"] = opts.checkpointing
    elif opts.checkpointing:
        raise ValueError("--checkpointing: this model version has no gradient_checkpointing option")
    if hasattr(bert, "jagged_attention"):
        bert.jagged_attention = opts.jagged_attention
        active["jagged_attention"] = opts.jagged_attention
    elif opts.jagged_attention:
        raise ValueError("--jagged-attention: this model version has no jagged_attention option")
    if not opts.fused_qkv:
        split_qkv(model)
    active["fused_qkv"] = opts.fused_qkv
    return active


def compile_ours(model: nn.Module) -> str:
    """Our compile policy (per layer, dynamic shapes) when the model offers it, else the whole model."""
    if hasattr(model.bert, "compile_layers"):
        model.bert.compile_layers()
        return "per-layer torch.compile, dynamic token count (bertrain.model.bert.BertModel.compile_layers)"
    model.compile(dynamic=True)
    return "torch.compile(model, dynamic=True)"


def _optimizer_form(name: str, foreach: bool, device: torch.device) -> str:
    if not foreach:
        return "per-tensor loop"
    if name == "lamb":
        return "multi-tensor" if device.type == "cuda" else "per-tensor, the CPU default"
    return "fused"


def build_optimizer(model: nn.Module, name: str, device: torch.device, foreach: bool | None
                    ) -> torch.optim.Optimizer:
    """The optimizer both sides use: torch AdamW fused (HF Trainer's default `adamw_torch_fused`; for-loop when
    foreach=False) or our LAMB (`foreach` None: its per-device default, multi-tensor on CUDA and per-tensor on CPU;
    True/False: forced). No decay on biases/LayerNorm."""
    from bertrain.train.optim import Lamb, param_groups

    groups = param_groups(model, 0.01)
    if name == "lamb":
        return Lamb(groups, lr=1e-4, foreach=foreach)
    if foreach is False:
        return torch.optim.AdamW(groups, lr=1e-5, foreach=False)
    return torch.optim.AdamW(groups, lr=1e-5, fused=True)  # one kernel per tensor, on CUDA and on CPU


# ----------------------------------------------------------------------------------------------- steps

def _autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    dtype = DTYPES[precision]
    return torch.autocast(device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext()


def make_train_step(model: nn.Module, forward: Callable[[], torch.Tensor], optimizer: torch.optim.Optimizer,
                    device: torch.device, precision: str, foreach: bool = True) -> Callable[[], None]:
    """forward (under autocast) -> backward -> clip to norm 1 -> optimizer step -> zero grads: the trainer's step."""
    scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")
    params = [p for p in model.parameters() if p.requires_grad]

    def step() -> None:
        with _autocast(device, precision):
            loss = forward()
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=foreach)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)

    return step


def make_inference_step(forward: Callable[[], Any], device: torch.device, precision: str) -> Callable[[], None]:
    def step() -> None:
        with torch.inference_mode(), _autocast(device, precision):
            forward()

    return step


def pretrain_forward(model: nn.Module, b: dict[str, torch.Tensor], ours: bool,
                     masked_head: bool = True) -> Callable[[], torch.Tensor]:
    x = dict(input_ids=b["input_ids"], token_type_ids=b["token_type_ids"], attention_mask=b["attention_mask"])
    if ours and masked_head:
        kw = dict(masked_positions=b["masked_positions"], labels=b["masked_labels"])
    else:  # HF's interface (and our full-head ablation): logits for every token, labels (B, T)
        kw = dict(labels=b["labels"])
    return lambda: model(**x, **kw, next_sentence_label=b["next_sentence_labels"]).loss


def qa_forward(model: nn.Module, b: dict[str, torch.Tensor], with_loss: bool) -> Callable[[], Any]:
    x = dict(input_ids=b["input_ids"], token_type_ids=b["token_type_ids"], attention_mask=b["attention_mask"])
    if with_loss:
        return lambda: model(**x, start_positions=b["start_positions"], end_positions=b["end_positions"]).loss
    return lambda: model(**x).start_logits


# ----------------------------------------------------------------------------------------------- one mode

def _summarise(side: Side, batch_size: int, real_tokens: int, flops: float, peak: float) -> dict[str, Any]:
    t = statistics.median(side.times)
    return {
        "step_ms": round(t * 1e3, 3),
        "step_ms_all": [round(x * 1e3, 3) for x in side.times],
        # CPU seconds the process used per step (all threads): robust to being descheduled on a shared machine
        "step_cpu_ms": round(statistics.median(side.cpu_times) * 1e3, 3),
        "seq_per_s": batch_size / t,
        "tokens_per_s": real_tokens / t,
        "tflops": flops / t / 1e12,
        "mfu": flops / t / peak,
        "peak_mem_mb": round(side.peak_bytes / 2 ** 20, 1) if side.peak_bytes >= 0 else None,
        **side.info,
    }


def bench_mode(mode: str, opts: BenchOptions, peak: float) -> dict[str, Any]:
    """Time ours (and HF with --compare hf) for one mode; returns the per-side summaries and the speedup."""
    device = torch.device(opts.device)
    T, B = opts.seq_len_for(mode), opts.batch_size
    config = BertConfig.from_preset(opts.model)
    torch.manual_seed(opts.seed)
    ours = build_ours(mode, config)
    hf = build_hf(ours) if opts.compare == "hf" else None
    active = configure_ours(ours, opts)
    if opts.precision == "tf32":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    ours.to(device)
    if hf is not None:
        hf.to(device)
    training = mode != "inference"
    for m in (ours, hf):
        if m is not None:
            m.train(training)
    if opts.compile:
        active["compile"] = compile_ours(ours)
        if hf is not None:
            hf.compile()

    if mode == "pretrain":
        b = pretraining_batch(config, B, T, opts.seed, opts.min_len_frac)
    else:
        b = qa_batch(config, B, T, opts.seed, opts.min_len_frac)
    b = {k: v.to(device) for k, v in b.items()}
    lengths = b["attention_mask"].sum(1).cpu()
    masked = int((b["masked_labels"] != -100).sum()) if mode == "pretrain" else 0
    flops = model_flops(config, lengths, mode, masked)

    sides: list[Side] = []
    opt_name = opts.optimizer if mode == "pretrain" else "adamw"
    for name, model in (("bertrain", ours), ("hf", hf)):
        if model is None:
            continue
        is_ours = model is ours
        if mode == "pretrain":
            fwd = pretrain_forward(model, b, is_ours, opts.masked_head or not is_ours)
        else:
            fwd = qa_forward(model, b, with_loss=training)
        if training:
            opt = build_optimizer(model, opt_name, device, None if opts.foreach else False)
            step = make_train_step(model, fwd, opt, device, opts.precision, opts.foreach)
        else:
            step = make_inference_step(fwd, device, opts.precision)
        sides.append(Side(name, step))
    steps, warmup = opts.n_steps()
    time_interleaved(sides, steps, warmup, device)

    real_tokens = int(lengths.sum())
    out: dict[str, Any] = {
        "seq_len": T, "batch_size": B, "real_tokens": real_tokens, "padded_tokens": B * T,
        "masked_tokens": masked, "flops_per_step": flops, "steps": steps, "warmup": warmup,
        "optimizer": f"{opt_name} ({_optimizer_form(opt_name, opts.foreach, device)})" if training else None,
        "bertrain_options": active,
    }
    for s in sides:
        out[s.name] = _summarise(s, B, real_tokens, flops, peak)
    if hf is not None:
        out["speedup"] = out["hf"]["step_ms"] / out["bertrain"]["step_ms"]
        out["speedup_cpu_time"] = out["hf"]["step_cpu_ms"] / out["bertrain"]["step_cpu_ms"]
    return out


def run_bench(opts: BenchOptions) -> dict[str, Any]:
    """Everything `bertrain bench` prints: environment, FLOP formula, matmul peak, and one block per mode."""
    if opts.threads:
        torch.set_num_threads(opts.threads)
    device = torch.device(opts.device)
    if device.type == "cpu" and opts.keep_freed_memory:  # what the trainer does (train/distributed.py); a process
        keep_freed_memory(TRAINING_MMAP_THRESHOLD, TRAINING_TRIM_THRESHOLD)  # setting, so for both sides
    dtype = DTYPES[opts.precision] or torch.float32
    if opts.precision == "tf32" and device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    peak = matmul_peak(device, dtype)
    modes = MODES if opts.mode == "all" else (opts.mode,)
    result: dict[str, Any] = {
        "options": asdict(opts),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({os.cpu_count()} cores)",
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "flop_formula": flop_formula(),
        "matmul_peak_tflops": peak / 1e12,
        "timing": "medians of interleaved steps (ours and HF alternate in one process, same threads and batch)",
    }
    try:
        import transformers
        result["transformers"] = transformers.__version__
    except ImportError:
        pass
    for mode in modes:
        result[mode] = bench_mode(mode, opts, peak)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    # the headline numbers of the first mode, flat, for scripts
    first = result[modes[0]]
    result["mode"] = modes[0]
    result["bertrain.seq_per_s"] = first["bertrain"]["seq_per_s"]
    if "hf" in first:
        result["hf.seq_per_s"] = first["hf"]["seq_per_s"]
        result["speedup"] = first["speedup"]
        result["speedup_cpu_time"] = first["speedup_cpu_time"]
    # the peak measured again at the end: report the better of the two (the machine is shared)
    result["matmul_peak_tflops"] = max(peak, matmul_peak(device, dtype)) / 1e12
    return result


def format_table(result: dict[str, Any]) -> str:
    """A human-readable summary of `run_bench`'s result."""
    lines = [f"device {result['device']}, {result['threads']} threads, torch {result['torch']}, "
             f"precision {result['options']['precision']}, matmul peak {result['matmul_peak_tflops']:.3f} TFLOP/s",
             f"FLOPs: {result['flop_formula']}", ""]
    header = f"{'mode':<10} {'side':<9} {'step ms':>9} {'seq/s':>9} {'tokens/s':>10} {'TFLOP/s':>8} {'MFU':>6} " \
             f"{'peak MB':>8}"
    lines.append(header)
    for mode in MODES:
        if mode not in result:
            continue
        r = result[mode]
        for side in ("bertrain", "hf"):
            if side not in r:
                continue
            s = r[side]
            mem = f"{s['peak_mem_mb']:.0f}" if s["peak_mem_mb"] is not None else "-"
            lines.append(f"{mode:<10} {side:<9} {s['step_ms']:>9.1f} {s['seq_per_s']:>9.2f} {s['tokens_per_s']:>10.0f} "
                         f"{s['tflops']:>8.3f} {s['mfu']:>6.1%} {mem:>8}")
        extra = f"  B={r['batch_size']} T={r['seq_len']} real tokens {r['real_tokens']}/{r['padded_tokens']}"
        if "speedup" in r:
            extra += f", speedup vs HF {r['speedup']:.2f}x"
        lines.append(extra)
    return "\n".join(lines)


def clone_model(model: nn.Module) -> nn.Module:
    """A deep copy (for benchmarks that time several variants of one model with identical weights)."""
    return copy.deepcopy(model)
