"""`bertrain bench`: time the pretraining step, the fine-tuning step and inference, optionally beside HF."""
from __future__ import annotations

import argparse
import json

HELP = "measure training/inference speed (seq/s, tokens/s, TFLOP/s, MFU, memory), optionally against HF transformers"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="base", help="model preset: tiny, mini, small, medium, base, large")
    parser.add_argument("--seq-len", type=int, default=None,
                        help="sequence length T (default 128; 384 for --mode inference, SQuAD)")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per step (default 8)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default cpu)")
    parser.add_argument("--precision", default="fp32", choices=["fp32", "tf32", "bf16", "fp16"],
                        help="fp32, tf32 (CUDA matmuls), bf16 or fp16 autocast (default fp32)")
    parser.add_argument("--mode", default="pretrain", choices=["pretrain", "finetune", "inference", "all"],
                        help="pretrain: MLM+NSP step; finetune: SQuAD QA step; inference: QA forward")
    parser.add_argument("--compare", choices=["hf"], default=None,
                        help="also time transformers' model (SDPA attention, same weights, batch, precision, "
                             "threads and optimizer), interleaved with ours")
    parser.add_argument("--compile", action="store_true",
                        help="torch.compile ours (per layer, dynamic shapes) and HF (whole model)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per side (default 3 on CPU, 20 on CUDA)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps per side (default 1 CPU, 5 CUDA)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--seed", type=int, default=1234, help="seed of the weights and of the batch")
    parser.add_argument("--min-len-frac", type=float, default=0.3,
                        help="sequence lengths are uniform in [ceil(FRAC*T), T] (default 0.3)")
    parser.add_argument("--optimizer", default="adamw", choices=["adamw", "lamb"],
                        help="pretraining optimizer, the same for both sides: adamw (fused, HF Trainer's default) "
                             "or lamb (our multi-tensor LAMB); fine-tuning uses adamw")
    parser.add_argument("--no-unpad", dest="unpad", action="store_false",
                        help="ours: run the encoder on padded (B, T) tensors")
    parser.add_argument("--full-mlm-head", dest="masked_head", action="store_false",
                        help="ours: run the MLM head on every token (as HF) instead of the masked positions")
    parser.add_argument("--separate-qkv", dest="fused_qkv", action="store_false",
                        help="ours: three Q/K/V GEMMs instead of one fused one")
    parser.add_argument("--no-foreach", dest="foreach", action="store_false",
                        help="both sides: per-tensor optimizer loop and clipping instead of multi-tensor/fused")
    parser.add_argument("--checkpointing", action="store_true", help="ours: activation checkpointing per layer")
    parser.add_argument("--jagged-attention", action="store_true",
                        help="ours (unpadded runs): attention on nested/jagged tensors, no padding at all (flash "
                             "varlen on CUDA; slower on CPU)")
    parser.add_argument("--grid-attention", dest="per_sequence_attention", action="store_false",
                        help="ours (unpadded, CPU): attention on the padded grid instead of one sequence at a time")
    parser.add_argument("--full-last-layer", dest="prune_last_layer", action="store_false",
                        help="ours (pretraining, masked head): the last layer on every token instead of [CLS] and "
                             "the masked positions only")
    parser.add_argument("--keep-freed-memory", action="store_true",
                        help="CPU: keep freed memory in the process, as `bertrain pretrain`/`finetune` do "
                             "(utils/memory.py); a process setting, so it applies to both sides of --compare")
    parser.add_argument("--json", action="store_true", help="print the full result as JSON")


def run(args: argparse.Namespace) -> int:
    from bertrain.bench import BenchConfig, format_table, run_bench  # torch: only when run (--help stays instant)

    opts = BenchConfig(model=args.model, seq_len=args.seq_len, batch_size=args.batch_size, device=args.device,
                        precision=args.precision, mode=args.mode, compare=args.compare, compile=args.compile,
                        steps=args.steps, warmup=args.warmup, seed=args.seed, threads=args.threads,
                        min_len_frac=args.min_len_frac, optimizer=args.optimizer, unpad=args.unpad,
                        masked_head=args.masked_head, fused_qkv=args.fused_qkv, foreach=args.foreach,
                        checkpointing=args.checkpointing, jagged_attention=args.jagged_attention,
                        per_sequence_attention=args.per_sequence_attention, prune_last_layer=args.prune_last_layer,
                        keep_freed_memory=args.keep_freed_memory)
    result = run_bench(opts)
    print(json.dumps(result, indent=2) if args.json else format_table(result))
    return 0
