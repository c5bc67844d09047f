"""Where a training step's time goes on a GPU: torch.profiler over a few steps of `bertrain bench`'s step.

    python benchmarks/gpu_profile.py --model large --seq-len 128 --batch-size 64 --optimizer lamb [--compile]
        [--jagged-attention] [--side hf] [--out DIR]

Prints the step time (CUDA events, no sync inside the step), the GPU's busy time per step (kernels, from the
profiler), kernel launches per step, and the top kernels and host-side operators; writes the full tables (and with
--trace the Chrome trace, gzipped) to --out. The step is bench's (bertrain.bench.steps.make_train_step: forward under bf16
autocast, backward, clip, optimizer step), on bench's synthetic batch, the mask kept on the host for ours as the
trainer keeps it. Needs CUDA.
"""
from __future__ import annotations

import argparse
import gzip
import shutil
import statistics
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from bertrain.bench.batches import model_flops, pretraining_batch  # noqa: E402
from bertrain.bench.run import BenchConfig, configure_ours  # noqa: E402
from bertrain.bench.steps import bench_optimizer, build_hf, make_train_step, pretrain_forward  # noqa: E402
from bertrain.model.bert import BertConfig, BertForPreTraining  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="large")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--optimizer", default="lamb", choices=["lamb", "adamw"])
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--jagged-attention", action="store_true")
    ap.add_argument("--side", default="ours", choices=["ours", "hf"])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--trace", action="store_true", help="also write the Chrome trace (gzipped) to --out")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("gpu_profile.py needs CUDA")
    dev = torch.device("cuda")
    opts = BenchConfig(model=args.model, seq_len=args.seq_len, batch_size=args.batch_size, device="cuda",
                       precision="bf16", compile=args.compile, optimizer=args.optimizer,
                       jagged_attention=args.jagged_attention)
    cfg = BertConfig.from_preset(args.model)
    torch.manual_seed(1234)
    ours = BertForPreTraining(cfg)
    model = build_hf(ours) if args.side == "hf" else ours
    if args.side == "ours":
        configure_ours(model, "pretrain", opts)
    model.to(dev).train()
    if args.side == "hf" and args.compile:
        model.compile()
    host = pretraining_batch(cfg, args.batch_size, args.seq_len, 1234, 0.3)
    b = {k: v.to(dev) for k, v in host.items()}
    if args.side == "ours":
        b["attention_mask"] = host["attention_mask"]  # as the trainer: lengths are read on the host
    step = make_train_step(model, pretrain_forward(model, b, args.side == "ours"), bench_optimizer(model, args.optimizer),
                           dev, "bf16")
    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    # steps back to back (no sync between them), as a training loop without host syncs runs
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(3):
        start.record()
        for _ in range(args.steps):
            step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / args.steps)
    step_ms = statistics.median(times)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            step()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy_ms = sum(e.time_range.elapsed_us() for e in kernels) / 1e3 / args.steps
    flops = model_flops(cfg, host["attention_mask"].sum(1), "pretrain", int((host["masked_labels"] != -100).sum()))
    print(f"{args.side} {args.model} T={args.seq_len} B={args.batch_size} {args.optimizer}"
          f"{' compile' if args.compile else ''}{' jagged' if args.jagged_attention else ''}: "
          f"step {step_ms:.1f} ms back to back ({args.batch_size / step_ms * 1e3:.0f} seq/s, "
          f"{flops / step_ms / 1e9:.0f} TFLOP/s), GPU busy {busy_ms:.1f} ms/step ({busy_ms / step_ms:.0%}), "
          f"{len(kernels) / args.steps:.0f} kernels/step")
    by_device = prof.key_averages().table(sort_by="self_device_time_total", row_limit=25, max_name_column_width=70)
    by_host = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=70)
    print(by_device[:6000])
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        name = f"{args.side}-{args.model}-T{args.seq_len}{'-compile' if args.compile else ''}"
        (args.out / f"{name}.txt").write_text(f"{by_device}\n\n{by_host}\n")
        if args.trace:
            trace = args.out / f"{name}.json"
            prof.export_chrome_trace(str(trace))
            with trace.open("rb") as f, gzip.open(f"{trace}.gz", "wb") as g:
                shutil.copyfileobj(f, g)
            trace.unlink()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
