"""Where a fine-tuning step's time goes, bertrain vs HF, on real GLUE batches (issue 22: the profile behind the
time-to-quality numbers). Run by hand on an idle machine:

    python benchmarks/ttq_profile.py --task mrpc --init /tmp/ttq-mrpc/init/2-labels-s1

The same model folder for both (bertrain's `load_model` and transformers' `BertForSequenceClassification`), the same
training batches (the first `--steps` x `--batch` examples of the train split, each batch cut to its longest row as
`DataCollatorWithPadding` and bertrain's trim_padding do), fused AdamW on both, `--precision` (fp32, or the forward
under bf16 autocast as both trainers run it), `--threads` threads. Each side
runs `--warmup` untimed steps, then `--steps` steps under torch.profiler; prints each side's step time (median of
the profiled steps, timed by perf_counter), the real and padded tokens, and the top operators by self CPU time.
This is the same forward/backward/optimizer step the two trainers run, without their loops (loader, logging,
checkpoints): what the model and optimizer cost.

`--interleaved N` times instead of profiling: every side's steps alternate (A B, then B A, ...) for N rounds over
the same batches, each side with its own model and optimizer from the same weights; prints each side's median step
and its ratio to the first side. This is the measurement for small differences (the ablations `bertrain-grid` and
`bertrain-full`); the profile's sides run one after the other and carry the machine's drift.
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data" / "glue"


def batches(task_name: str, init: str, data_dir: Path, batch: int, n: int, max_len: int) -> list[dict]:
    """`n` training batches, each trimmed to its longest row."""
    from bertrain.tasks.common import load_task_tokenizer
    from bertrain.tasks.glue import build_features, get_task, read_split

    task = get_task(task_name)
    examples = read_split(data_dir, task, "train")[0][1][: batch * n]
    feats = build_features(examples, task, load_task_tokenizer(init), max_len)
    out = []
    for i in range(n):
        sl = slice(i * batch, (i + 1) * batch)
        width = int(feats["attention_mask"][sl].sum(1).max())
        out.append({k: torch.from_numpy(np.ascontiguousarray(v[sl][:, :width] if v.ndim == 2 else v[sl]))
                    for k, v in feats.items()})
    return out


SIDES = ("bertrain", "bertrain-grid", "bertrain-full", "hf")


def build(side: str, init: str, jagged: bool = False) -> torch.nn.Module:
    """`bertrain` (its defaults: unpadded, attention one sequence at a time on CPU, the last layer on [CLS] only),
    `bertrain-grid` (attention on the padded grid), `bertrain-full` (the last layer on every token) or `hf`."""
    if side not in SIDES:
        raise SystemExit(f"--sides: unknown side {side!r}; choose from {', '.join(SIDES)}")
    if side.startswith("bertrain"):
        from bertrain.model.options import ModelOptionsConfig, apply_model_options
        from bertrain.tasks.finetune import load_model
        return apply_model_options(load_model("cls", init, 2), ModelOptionsConfig(
            jagged_attention=jagged, per_sequence_attention=side != "bertrain-grid",
            prune_last_layer=side != "bertrain-full"))
    from transformers import BertForSequenceClassification
    return BertForSequenceClassification.from_pretrained(init, num_labels=2)


def forward_context(precision: str) -> Callable[[], contextlib.AbstractContextManager]:
    """The forward pass's context: nothing for fp32, CPU bf16 autocast for bf16 (bertrain's `Precision.autocast`
    and HF Trainer's `bf16=True` both wrap the forward and loss alone)."""
    if precision == "fp32":
        return contextlib.nullcontext
    if precision == "bf16":
        return lambda: torch.autocast("cpu", dtype=torch.bfloat16)
    raise SystemExit(f"--precision: unknown {precision!r}; choose fp32 or bf16")


def training_step(side: str, init: str, jagged: bool = False, precision: str = "fp32") -> Callable[[dict], None]:
    """One side's fine-tuning step (forward, backward, clipping, fused AdamW) on its own model from `init`."""
    context = forward_context(precision)
    torch.manual_seed(0)
    model = build(side, init, jagged).train()
    decay = [p for n, p in model.named_parameters() if p.ndim > 1]
    other = [p for n, p in model.named_parameters() if p.ndim <= 1]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": other, "weight_decay": 0.0}],
                            lr=5e-5, eps=1e-6, fused=True)

    def step(b: dict) -> None:
        with context():
            out = model(input_ids=b["input_ids"], token_type_ids=b["token_type_ids"],
                        attention_mask=b["attention_mask"], labels=b["labels"])
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def interleaved(sides: list[str], init: str, data: list[dict], rounds: int, warmup: int,
                jagged: bool = False, precision: str = "fp32") -> dict[str, dict]:
    """Every side's step on batch i, alternating the sides' order each round (bertrain.bench.timing)."""
    from bertrain.bench.timing import Side, time_interleaved

    def cycling(step: Callable[[dict], None]) -> Callable[[], None]:
        batches = itertools.cycle(data)
        return lambda: step(next(batches))
    timed = [Side(s, cycling(training_step(s, init, jagged, precision))) for s in sides]
    time_interleaved(timed, rounds, warmup, torch.device("cpu"), measure_memory=False)
    first = statistics.median(timed[0].times)
    return {s.name: {"step_ms": statistics.median(s.times) * 1e3, "vs_first": statistics.median(s.times) / first,
                     "all_ms": [round(t * 1e3) for t in s.times]} for s in timed}


def profile_side(side: str, init: str, data: list[dict], warmup: int, rows: int, jagged: bool = False,
                 precision: str = "fp32") -> dict:
    step = training_step(side, init, jagged, precision)
    for b in data[:warmup]:
        step(b)
    times = []
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for b in data[warmup:]:
            t = time.perf_counter()
            with torch.profiler.record_function("step"):
                step(b)
            times.append(time.perf_counter() - t)
    timed = data[warmup:]
    return {"step_ms": statistics.median(times) * 1e3,
            "real_tokens": sum(int(b["attention_mask"].sum()) for b in timed),
            "padded_tokens": sum(b["input_ids"].numel() for b in timed),
            "table": prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--task", default="mrpc")
    ap.add_argument("--init", required=True, help="an HF-format model folder with a classifier head")
    ap.add_argument("--data-dir", default=None, help="the task's GLUE folder (default ../shared/data/glue/<TASK>)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=6, help="profiled steps per side")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--max-seq-length", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, default=15, help="operators shown per side")
    ap.add_argument("--precision", choices=["fp32", "bf16"], default="fp32",
                    help="both sides: fp32, or the forward under CPU bf16 autocast")
    ap.add_argument("--jagged-attention", action="store_true", help="bertrain: attention on nested tensors")
    ap.add_argument("--sides", default="bertrain,hf", help=f"comma-separated: {', '.join(SIDES)}")
    ap.add_argument("--interleaved", type=int, default=0, metavar="ROUNDS",
                    help="time the sides interleaved for ROUNDS rounds instead of profiling them")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    folder = {"mrpc": "MRPC", "sst2": "SST-2"}.get(args.task, args.task.upper())
    data_dir = Path(args.data_dir) if args.data_dir else SHARED / folder
    data = batches(args.task, args.init, data_dir, args.batch, args.warmup + args.steps, args.max_seq_length)
    if args.interleaved:
        result = interleaved(args.sides.split(","), args.init, data, args.interleaved, args.warmup,
                             args.jagged_attention, args.precision)
        for side, r in result.items():
            print(f"{side}: median step {r['step_ms']:.0f} ms, {r['vs_first']:.3f} of the first; all {r['all_ms']}")
        return
    results = {}
    for side in args.sides.split(","):
        results[side] = r = profile_side(side, args.init, data, args.warmup, args.rows, args.jagged_attention,
                                         args.precision)
        print(f"\n=== {side}: median step {r['step_ms']:.0f} ms; {r['real_tokens']} real of {r['padded_tokens']} "
              f"padded tokens in the profiled steps\n{r['table']}")
    for side in results:
        if side != "hf" and "hf" in results:
            print(f"{side} / HF step time: {results[side]['step_ms'] / results['hf']['step_ms']:.3f}")


if __name__ == "__main__":
    main()
