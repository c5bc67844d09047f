"""Each fast path on and off, in one run (issue 6, section 2). Not a test: run by hand, numbers go to BENCHMARKS.md.

    python benchmarks/techniques.py --model base --seq-len 128 --batch-size 8 --steps 3
    python benchmarks/techniques.py --optimizers --model base      # optimizer step alone: fused/foreach vs loop

Training-step variants share ONE model and ONE optimizer (flags are switched before each variant's step), so
memory stays at one model's and every variant times the same weights and batch; HF (same weights, SDPA) is timed
in the same interleaved rounds. Each row reports the median step and its ratio to the all-on configuration.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from bertrain.bench.batches import pretraining_batch
from bertrain.bench.steps import SplitQKV, bench_optimizer, build_hf, make_train_step, pretrain_forward, split_qkv
from bertrain.bench.timing import Side, time_interleaved
from bertrain.model.bert import BertConfig, BertForPreTraining
from bertrain.model.options import ModelOptionsConfig, apply_model_options
from bertrain.train.optim import Lamb, param_groups


def training_variants(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    config = BertConfig.from_preset(args.model)
    torch.manual_seed(0)
    model = BertForPreTraining(config).to(device).train()
    hf = build_hf(model).to(device).train()
    b = {k: v.to(device) for k, v in pretraining_batch(config, args.batch_size, args.seq_len, 1234).items()}
    opt = bench_optimizer(model, args.optimizer)
    split_qkv(model)  # SplitQKV modules are bypassed when `fused` is selected below
    qkv_mods = [m for m in model.modules() if isinstance(m, SplitQKV)]

    def with_flags(unpad: bool = True, masked: bool = True, fused_qkv: bool = True, ckpt: bool = False,
                   jagged: bool = False, prune: bool = True):
        fwd_masked = pretrain_forward(model, b, True, True)
        fwd_full = pretrain_forward(model, b, True, False)
        inner = {m: make_train_step(model, f, opt, device, args.precision) for m, f in ((True, fwd_masked),
                                                                                     (False, fwd_full))}

        options = ModelOptionsConfig(unpad=unpad, jagged_attention=jagged, gradient_checkpointing=ckpt,
                                     prune_last_layer=prune)

        def step() -> None:
            apply_model_options(model, options)
            for m, parent in zip(qkv_mods, qkv_parents):
                parent.qkv = m if not fused_qkv else m.fused
            inner[masked]()
        return step

    qkv_parents = [m for m in model.modules() if isinstance(getattr(m, "qkv", None), SplitQKV)]
    sides = [
        Side("all on (unpad + masked MLM head + fused QKV + pruned last layer)", with_flags()),
        Side("last layer on every token", with_flags(prune=False)),
        Side("no unpadding", with_flags(unpad=False)),
        Side("MLM head on every token", with_flags(masked=False)),
        Side("separate Q/K/V GEMMs", with_flags(fused_qkv=False)),
        Side("all off (padded, full head, separate QKV, whole last layer)", with_flags(False, False, False, prune=False)),
        Side("all on + activation checkpointing", with_flags(ckpt=True)),
        Side("all on + jagged (nested-tensor) attention", with_flags(jagged=True)),
    ]
    hf_opt = bench_optimizer(hf, args.optimizer)
    sides.append(Side("HF BertForPreTraining (SDPA)",
                      make_train_step(hf, pretrain_forward(hf, b, False), hf_opt, device, args.precision)))
    time_interleaved(sides, args.steps, args.warmup, device)
    base = statistics.median(sides[0].times)
    rows = {s.name: {"step_ms": statistics.median(s.times) * 1e3, "vs_all_on": statistics.median(s.times) / base,
                     "peak_mem_mb": s.peak_bytes / 2 ** 20, "all_ms": [t * 1e3 for t in s.times],
                     "cpu_ms": statistics.median(s.cpu_times) * 1e3,
                     "cpu_vs_all_on": statistics.median(s.cpu_times) / statistics.median(sides[0].cpu_times)} for s in sides}
    return {"model": args.model, "seq_len": args.seq_len, "batch_size": args.batch_size, "device": args.device,
            "precision": args.precision, "optimizer": args.optimizer, "threads": torch.get_num_threads(),
            "real_tokens": int(b["attention_mask"].sum()), "rows": rows}


def optimizer_variants(args: argparse.Namespace) -> dict:
    """The optimizer step alone (gradients set once), each implementation interleaved."""
    device = torch.device(args.device)
    config = BertConfig.from_preset(args.model)
    params = [p for p in BertForPreTraining(config).to(device).parameters()]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    model = torch.nn.Module()
    model.params = torch.nn.ParameterList(params)
    variants = {
        "LAMB multi-tensor (bertrain.train.optim.Lamb)": Lamb(param_groups(model, 0.01), foreach=True),
        "LAMB per-tensor (bertrain.train.optim.Lamb, foreach=False: the CPU default)":
            bench_optimizer(model, "lamb", foreach=False),
        "AdamW fused": bench_optimizer(model, "adamw"),
        "AdamW foreach": torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True),
        "AdamW per-tensor loop": bench_optimizer(model, "adamw", foreach=False),
    }
    sides = [Side(k, o.step) for k, o in variants.items()]
    time_interleaved(sides, args.steps, 1, device, measure_memory=False)
    n = sum(p.numel() for p in params)
    return {"model": args.model, "params": n, "device": args.device, "threads": torch.get_num_threads(),
            "rows": {s.name: {"step_ms": statistics.median(s.times) * 1e3, "all_ms": [t * 1e3 for t in s.times]}
                     for s in sides}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="base")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--optimizer", default="adamw", choices=["adamw", "lamb"])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--optimizers", action="store_true", help="time the optimizer step implementations instead")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    result = optimizer_variants(args) if args.optimizers else training_variants(args)
    result["wall_s"] = time.perf_counter() - t0
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
