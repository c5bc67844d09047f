"""What `parallelism.strategy: fsdp` saves per rank, and what it costs on CPU, measured on gloo.

1. Memory (`--memory`, default): BERT-base and BERT-large (`BertForPreTraining`) are built on the meta device (no
   weights allocated) and sharded with `train.parallel.apply_fsdp` on W gloo ranks, exactly as the trainer does;
   each rank then counts the bytes of its own shards (`DTensor.to_local()`): parameters, gradients (FSDP2 writes
   reduce-scattered gradients with the shape of the local shard) and the optimizer state, which
   `build_optimizer` creates with the shape of each parameter (LAMB/AdamW: two fp32 moments per element, plus a
   scalar step). DDP is the same count on the full tensors. Steady-state bytes between steps; the transient
   working set (the gathered units during forward/backward, and the unsharded gradients that accumulation under
   `no_sync` holds until the last micro-step) is printed beside it.
2. On the wire (`--wire`, pure arithmetic with the inputs of `benchmarks/scaling_model.py`): the bytes each GPU
   moves per optimizer step under DDP and FSDP at 8, 64 and 256 GPUs, and the efficiency they allow (below).
3. Step time (`--time`): one 2-rank gloo job builds the same small BERT under DDP, FSDP (reshard after forward)
   and FSDP (no reshard) and times optimizer steps (LAMB, 2 micro-steps of accumulation) round-robin, so the three
   share the machine's load; reports the median of each and the ratios to DDP.

    python benchmarks/fsdp_memory.py --memory --worlds 2 4
    python benchmarks/fsdp_memory.py --wire
    python benchmarks/fsdp_memory.py --time --preset small --steps 20
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import time

import torch
import torch.multiprocessing as mp

GB = 1e9


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init(rank: int, world: int, port: int) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)


def _trainer_config(strategy: str, reshard: bool = True, optim: str = "lamb"):
    from bertrain.train.config import OptimConfig, ParallelismConfig, TrainConfig, TrainerConfig
    return TrainerConfig(train=TrainConfig(steps=1), optim=OptimConfig(name=optim),
                         parallelism=ParallelismConfig(strategy=strategy, reshard_after_forward=reshard),
                         output_dir="unused")


# ----------------------------------------------------------------------------------------------- memory

def _memory_worker(rank: int, world: int, port: int, queue: "mp.Queue") -> None:
    _init(rank, world, port)
    from bertrain.model.bert import BertConfig, BertForPreTraining
    from bertrain.train.distributed import init_distributed
    from bertrain.train.parallel import apply_fsdp, transformer_layers
    dist = init_distributed()
    for preset in ("base", "large"):
        with torch.device("meta"):
            model = BertForPreTraining(BertConfig.from_preset(preset))
        total = sum(p.numel() for p in model.parameters())
        layer = sum(p.numel() for p in transformer_layers(model)[0].parameters())
        root = total - layer * len(transformer_layers(model))
        apply_fsdp(model, _trainer_config("fsdp"), dist)
        local = sum(p.to_local().numel() for p in model.parameters())
        queue.put({"preset": preset, "world": world, "rank": rank, "params": total, "local": local,
                   "layer": layer, "root": root, "tensors": sum(1 for _ in model.parameters())})
    torch.distributed.destroy_process_group()


def run_ranks(target, world: int, args: tuple, results: int) -> list:
    """Run target(rank, world, port, *args, queue) on `world` spawned processes; collect `results` queue items
    (raises as soon as a rank dies instead of waiting forever)."""
    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), _free_port()
    procs = [ctx.Process(target=target, args=(r, world, port, *args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    got: list = []
    while len(got) < results:
        try:
            got.append(queue.get(timeout=5))
        except Exception:  # queue.Empty
            failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if failed:
                raise RuntimeError(f"a rank failed (exit codes {failed}): see its traceback above") from None
    for p in procs:
        p.join(timeout=60)
    return got


def measure_memory(worlds: list[int]) -> list[dict]:
    return [row for world in worlds for row in run_ranks(_memory_worker, world, (), 2 * world)]


def print_memory(rows: list[dict]) -> None:
    print("| model | strategy | W | params / rank | grads / rank | optimizer / rank | total / rank | vs DDP |"
          " gathered units (transient) | unsharded grads held by no_sync |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for preset in ("base", "large"):
        mine = [r for r in rows if r["preset"] == preset]
        n, tensors = mine[0]["params"], mine[0]["tensors"]
        ddp = 4 * n + 4 * n + (8 * n + 4 * tensors)  # fp32 weights, fp32 grads, 2 fp32 moments + step per tensor
        for world in sorted({r["world"] for r in mine}):
            print(f"| BERT-{preset} ({n / 1e6:.0f}M) | ddp | {world} | {4 * n / GB:.2f} GB | {4 * n / GB:.2f} GB | "
                  f"{(8 * n + 4 * tensors) / GB:.2f} GB | {ddp / GB:.2f} GB | 1 | - | - |")
            ranks = [r for r in mine if r["world"] == world]
            worst = max(r["local"] for r in ranks)  # the largest shard decides (FSDP pads the last rank's)
            fsdp = 4 * worst + 4 * worst + 8 * worst + 4 * tensors
            r0 = ranks[0]
            working = 4 * (r0["root"] + 2 * r0["layer"])  # root unit + current + prefetched layer, fp32
            print(f"| BERT-{preset} ({n / 1e6:.0f}M) | fsdp | {world} | {4 * worst / GB:.3f} GB | "
                  f"{4 * worst / GB:.3f} GB | {(8 * worst + 4 * tensors) / GB:.3f} GB | {fsdp / GB:.3f} GB | "
                  f"{fsdp / ddp:.3f} (1/W = {1 / world:.3f}) | {working / GB:.3f} GB | {4 * n / GB:.2f} GB |")


# ----------------------------------------------------------------------------------------------- on the wire

def fsdp_efficiency(params: int, global_batch: int, micro: int, rate: float, n: int, link: dict[str, float],
                    reshard: bool, param_bytes: int = 2, reduce_bytes: int = 4,
                    per_node: int = 8) -> tuple[float, float, float]:
    """(efficiency, GB per GPU per step, exposed ms per step) of FSDP, in the model of scaling_model.py.

    With `reshard` (ZeRO-3) every unit is all-gathered for forward and again for backward on every micro-step;
    without it the gathered weights stay from the first forward through the last backward of the step (no_sync
    keep_gathered): one gather per optimizer step. Each gather moves (N-1)/N x P x param_bytes (a ring all-gather
    is half an all-reduce); the gradients are reduce-scattered once per optimizer step (accumulation runs under
    no_sync). FSDP prefetches the next unit's gather during the current unit's compute, so a micro-step's gathers
    hide behind its compute up to the compute time; the reduce-scatter overlaps the last backward as DDP's
    all-reduce does."""
    bw, alpha = (link["intra"], link["alpha_intra"]) if n <= per_node else (link["inter"], link["alpha_inter"])
    accumulation = max(1, global_batch // (n * micro))
    gathered_micro_steps, gathers = (accumulation, 2) if reshard else (1, 1)
    t_micro = micro / rate
    frac = (n - 1) / n
    t_gather = gathers * (frac * params * param_bytes / (bw * 1e9) + (n - 1) * alpha)
    t_rs = frac * params * reduce_bytes / (bw * 1e9) + (n - 1) * alpha
    exposed = gathered_micro_steps * max(0.0, t_gather - t_micro) + max(0.0, t_rs - 2 / 3 * t_micro)
    t_compute = global_batch / n / rate
    wire = frac * params * (gathered_micro_steps * gathers * param_bytes + reduce_bytes)
    return t_compute / (t_compute + exposed), wire / GB, exposed * 1e3


def print_wire(gpus: list[int]) -> None:
    from scaling_model import LINKS, MODELS, efficiency
    for mname, (params, gb, micro, rate) in MODELS.items():
        print(f"\n### {mname}: bf16 gathers, fp32 reduce-scatter")
        print("| interconnect | GPUs | accumulation | DDP GB/step | DDP eff. | FSDP reshard GB/step | eff. | "
              "FSDP no reshard GB/step | eff. |")
        print("|---|---|---|---|---|---|---|---|---|")
        for lname, link in LINKS.items():
            for n in gpus:
                ddp_eff = efficiency(params, gb, micro, rate, n, link, 4)[0]
                ddp_wire = 2 * (n - 1) / n * params * 4 / GB
                r = fsdp_efficiency(params, gb, micro, rate, n, link, reshard=True)
                k = fsdp_efficiency(params, gb, micro, rate, n, link, reshard=False)
                print(f"| {lname} | {n} | {max(1, gb // (n * micro))} | {ddp_wire:.2f} | {ddp_eff * 100:.0f}% | "
                      f"{r[1]:.1f} | {r[0] * 100:.0f}% | {k[1]:.1f} | {k[0] * 100:.0f}% |")


# ----------------------------------------------------------------------------------------------- step time

def _time_worker(rank: int, world: int, port: int, preset: str, steps: int, queue: "mp.Queue") -> None:
    _init(rank, world, port)
    from bertrain.model.bert import BertConfig, BertForPreTraining
    from bertrain.train.config import PrecisionConfig
    from bertrain.train.distributed import init_distributed, no_sync, wrap_model
    from bertrain.train.optim import build_optimizer
    from bertrain.train.parallel import apply_fsdp
    from bertrain.train.precision import Precision
    dist = init_distributed()
    variants = {}
    for name, strategy, reshard in (("ddp", "ddp", True), ("fsdp", "fsdp", True), ("fsdp-no-reshard", "fsdp", False)):
        torch.manual_seed(0)
        model = BertForPreTraining(BertConfig.from_preset(preset, vocab_size=30522))
        cfg = _trainer_config(strategy, reshard)
        train = apply_fsdp(model, cfg, dist) if strategy == "fsdp" else wrap_model(model, dist, cfg.distributed)
        variants[name] = (train, build_optimizer(model, cfg.optim), [p for p in model.parameters()])
    precision = Precision(PrecisionConfig(), dist.device)
    g = torch.Generator().manual_seed(rank)
    batches = [torch.randint(1000, 30000, (8, 128), generator=g) for _ in range(2)]
    nsp = torch.zeros(8, dtype=torch.long)
    positions = torch.randint(1, 128, (8, 20), generator=g)  # 20 masked positions per row, as pretraining
    times: dict[str, list[float]] = {k: [] for k in variants}
    for step in range(steps + 2):  # round-robin: the three see the same machine load; 2 warm-up steps
        for name, (train, opt, params) in variants.items():
            torch.distributed.barrier()
            t0 = time.perf_counter()
            for i, ids in enumerate(batches):
                with no_sync(train, enabled=i < len(batches) - 1, keep_gathered=name == "fsdp-no-reshard"):
                    precision.backward(train(ids, masked_positions=positions, labels=ids.gather(1, positions),
                                             next_sentence_label=nsp).loss)
            precision.unscale_and_clip(opt, params, 1.0)
            precision.step(opt)
            opt.zero_grad(set_to_none=True)
            torch.distributed.barrier()
            if step >= 2:
                times[name].append(time.perf_counter() - t0)
    if rank == 0:
        queue.put({k: statistics.median(v) for k, v in times.items()})
    torch.distributed.destroy_process_group()


def measure_time(preset: str, steps: int) -> dict[str, float]:
    return run_ranks(_time_worker, 2, (preset, steps), 1)[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--memory", action="store_true")
    ap.add_argument("--time", action="store_true")
    ap.add_argument("--wire", action="store_true")
    ap.add_argument("--gpus", type=int, nargs="+", default=[8, 64, 256])
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    if args.memory or not (args.time or args.wire):
        print_memory(measure_memory(args.worlds))
    if args.wire:
        print_wire(args.gpus)
    if args.time:
        t = measure_time(args.preset, args.steps)
        print(f"\nBERT-{args.preset}, 2 gloo ranks x 1 thread, LAMB, 2 micro-steps of 8 x 128 (20 masked), "
              f"median of {args.steps}:")
        for k, v in t.items():
            print(f"  {k:16s} {v * 1e3:8.1f} ms/step  {v / t['ddp']:.2f}x ddp")


if __name__ == "__main__":
    main()
