"""One `bertrain bench` run: the options, each mode timed (ours and HF interleaved), the JSON result and its table."""
from __future__ import annotations

import importlib.util
import os
import statistics
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from bertrain.bench.batches import flop_formula, model_flops, pretraining_batch, qa_batch
from bertrain.bench.steps import (DTYPES, bench_optimizer, build_hf, make_inference_step, make_train_step,
                                  optimizer_form, pretrain_forward, qa_forward, split_qkv)
from bertrain.bench.timing import Side, matmul_peak, time_interleaved
from bertrain.model.bert import PRESETS, BertConfig, BertForPreTraining, BertForQuestionAnswering
from bertrain.model.options import ModelOptionsConfig, apply_model_options
from bertrain.utils.memory import TRAINING_MMAP_THRESHOLD, TRAINING_TRIM_THRESHOLD, keep_freed_memory

MODES = ("pretrain", "finetune", "inference")


@dataclass
class BenchConfig:
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
    unpad: bool = True                  # QA: inference only (its training keeps padding, as the trainer does)
    masked_head: bool = True
    fused_qkv: bool = True
    foreach: bool = True                # each optimizer's fast form for the device (fused AdamW; LAMB multi-
                                        # tensor on CUDA, per-tensor on CPU); False: per-tensor loops
    checkpointing: bool = False
    jagged_attention: bool = False      # unpadded runs: attention on nested (jagged) tensors
    per_sequence_attention: bool = True  # unpadded runs on CPU: attention one sequence at a time (else the grid)
    prune_last_layer: bool = True       # pretraining with the masked head: the last layer on [CLS] + masked rows
    keep_freed_memory: bool = False     # CPU: the trainer's malloc setting (utils/memory.py), for both sides

    def __post_init__(self) -> None:
        if self.mode not in (*MODES, "all"):
            raise ValueError(f"--mode {self.mode!r}: choose one of {', '.join(MODES)}, all")
        if self.precision not in DTYPES:
            raise ValueError(f"--precision {self.precision!r}: choose one of {', '.join(DTYPES)}")
        if self.compare not in (None, "hf"):
            raise ValueError(f"--compare {self.compare!r}: only 'hf' is supported")
        try:  # torch's own error is a RuntimeError listing twenty device types: a traceback, exit 1
            device = torch.device(self.device)
        except RuntimeError:
            raise ValueError(f"--device {self.device!r}: expected cpu, cuda or cuda:N") from None
        if device.type not in ("cpu", "cuda"):  # the bench syncs and measures memory on these two only
            raise ValueError(f"--device {self.device!r}: the bench runs on cpu or cuda[:N] only")
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"--device {self.device}: CUDA is not available on this machine")
        if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"--device {self.device}: this machine has {torch.cuda.device_count()} CUDA device(s), "
                             f"cuda:0 to cuda:{torch.cuda.device_count() - 1}")
        if self.model not in PRESETS:  # found here, not after the matmul peak and a model build
            raise ValueError(f"--model {self.model!r}: choose a preset: {', '.join(PRESETS)}")
        if self.batch_size < 1 or (self.seq_len is not None and self.seq_len < 8):
            raise ValueError("--batch-size must be >= 1 and --seq-len >= 8")
        positions = BertConfig.from_preset(self.model).max_position_embeddings
        if self.seq_len is not None and self.seq_len > positions:
            raise ValueError(f"--seq-len {self.seq_len}: the {self.model} model has {positions} positions "
                             f"(max_position_embeddings); use --seq-len {positions} or less")
        if self.compare == "hf" and importlib.util.find_spec("transformers") is None:  # else a traceback, exit 1
            raise ValueError("--compare hf needs the transformers package: pip install 'bertrain[bench]'")
        if self.steps is not None and self.steps < 1:
            raise ValueError("--steps must be >= 1")
        if self.warmup is not None and self.warmup < 0:  # range(-2) would silently time cold steps
            raise ValueError(f"--warmup must be >= 0, got {self.warmup}")
        if self.threads is not None and self.threads < 1:  # 0 was silently ignored, < 0 a torch traceback
            raise ValueError(f"--threads must be >= 1, got {self.threads} (leave it out for torch's default)")
        if not 0.0 <= self.min_len_frac <= 1.0:  # above 1 every sequence silently had the full length T
            raise ValueError(f"--min-len-frac must be in [0, 1] (lengths ~ U[ceil(FRAC*T), T]), got "
                             f"{self.min_len_frac}")
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

    def model_options(self) -> ModelOptionsConfig:
        """Our model's speed options, as the trainer would apply them."""
        return ModelOptionsConfig(unpad=self.unpad, jagged_attention=self.jagged_attention,
                                  per_sequence_attention=self.per_sequence_attention,
                                  prune_last_layer=self.prune_last_layer,
                                  gradient_checkpointing=self.checkpointing, compile=self.compile)


def configure_ours(model: nn.Module, mode: str, opts: BenchConfig) -> dict[str, Any]:
    """Set our model's speed options as `opts` says (through `apply_model_options`, as the trainer does) plus the
    bench's own ablation (`--separate-qkv`); returns what is active."""
    apply_model_options(model, opts.model_options())
    if not opts.fused_qkv:
        split_qkv(model)
    active: dict[str, Any] = {
        "unpad": opts.unpad and mode != "finetune",  # QA training keeps padding (HF's loss sees it)
        "gradient_checkpointing": opts.checkpointing,
        "jagged_attention": opts.jagged_attention,
        "per_sequence_attention": opts.per_sequence_attention and not opts.compile and not opts.on_cuda,
        "fused_qkv": opts.fused_qkv,
        # only pretraining with masked positions reads a few positions (bench's finetune and inference are QA)
        "prune_last_layer": opts.prune_last_layer and opts.masked_head and mode == "pretrain",
    }
    if opts.compile:
        active["compile"] = "per-layer torch.compile, dynamic shapes (bertrain.model.options.apply_model_options)"
    return active


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
    }


def bench_mode(mode: str, opts: BenchConfig, peak: float) -> dict[str, Any]:
    """Time ours (and HF with --compare hf) for one mode; returns the per-side summaries and the speedup."""
    device = torch.device(opts.device)
    T, B = opts.seq_len_for(mode), opts.batch_size
    config = BertConfig.from_preset(opts.model)
    torch.manual_seed(opts.seed)
    ours = BertForPreTraining(config) if mode == "pretrain" else BertForQuestionAnswering(config)
    hf = build_hf(ours) if opts.compare == "hf" else None  # from the plain weights, before any ablation
    active = configure_ours(ours, mode, opts)
    if opts.precision == "tf32":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    training = mode != "inference"
    for m in (ours, hf):
        if m is not None:
            m.to(device).train(training)
    if hf is not None and opts.compile:
        hf.compile()

    if mode == "pretrain":
        b = pretraining_batch(config, B, T, opts.seed, opts.min_len_frac)
    else:
        b = qa_batch(config, B, T, opts.seed, opts.min_len_frac)
    host_mask = b["attention_mask"]
    b = {k: v.to(device) for k, v in b.items()}
    # ours gets the mask on the host, as the trainer passes it (train/trainer.py:to_device): the layout's lengths
    # are read there, not from the GPU; HF's model takes every input on the device
    b_ours = {**b, "attention_mask": host_mask}
    lengths = host_mask.sum(1)
    masked = int((b["masked_labels"] != -100).sum()) if mode == "pretrain" else 0
    flops = model_flops(config, lengths, mode, masked)

    sides: list[Side] = []
    opt_name = opts.optimizer if mode == "pretrain" else "adamw"
    for name, model in (("bertrain", ours), ("hf", hf)):
        if model is None:
            continue
        is_ours = model is ours
        inputs = b_ours if is_ours else b
        if mode == "pretrain":
            fwd = pretrain_forward(model, inputs, is_ours, opts.masked_head or not is_ours)
        else:
            fwd = qa_forward(model, inputs, with_loss=training)
        if training:
            step = make_train_step(model, fwd, bench_optimizer(model, opt_name, opts.foreach), device,
                                   opts.precision, opts.foreach)
        else:
            step = make_inference_step(fwd, device, opts.precision)
        sides.append(Side(name, step))
    steps, warmup = opts.n_steps()
    time_interleaved(sides, steps, warmup, device)

    real_tokens = int(lengths.sum())
    out: dict[str, Any] = {
        "seq_len": T, "batch_size": B, "real_tokens": real_tokens, "padded_tokens": B * T,
        "masked_tokens": masked, "flops_per_step": flops, "steps": steps, "warmup": warmup,
        "optimizer": f"{opt_name} ({optimizer_form(opt_name, opts.foreach, device)})" if training else None,
        "bertrain_options": active,
    }
    for s in sides:
        out[s.name] = _summarise(s, B, real_tokens, flops, peak)
    if hf is not None:
        out["speedup"] = out["hf"]["step_ms"] / out["bertrain"]["step_ms"]
        out["speedup_cpu_time"] = out["hf"]["step_cpu_ms"] / out["bertrain"]["step_cpu_ms"]
    return out


# ----------------------------------------------------------------------------------------------- the run

def run_bench(opts: BenchConfig) -> dict[str, Any]:
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
        import transformers  # optional: only --compare hf needs it; its version goes into the record when present
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
    # the peak measured again at the end: report the better of the two (the machine is shared), and every MFU
    # against that same reported peak
    result["matmul_peak_tflops"] = max(peak, matmul_peak(device, dtype)) / 1e12
    for mode in modes:
        for side in result[mode].values():
            if isinstance(side, dict) and "tflops" in side:
                side["mfu"] = side["tflops"] / result["matmul_peak_tflops"]
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
