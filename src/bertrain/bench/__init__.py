"""Speed measurement: the pretraining step, the fine-tuning step and inference, ours beside HF in one run.

`batches.py` (realistic batches, the FLOP count), `timing.py` (interleaved timing, peak memory, the matmul peak),
`steps.py` (the models, the optimizer, the step functions), `run.py` (`bertrain bench`: options, run, report).

Method (the same in `bertrain bench`, `benchmarks/*.py` and BENCHMARKS.md):

* **Batches.** Sequence lengths are drawn uniformly from [ceil(0.3*T), T] with a fixed seed (T=128: 39..128), so
  about a third of every batch is padding, as in real pretraining data. Pretraining batches mask
  round(0.15*n) real tokens of each sequence (at most `max_predictions = ceil(0.15*T)`, 20 at T=128) and carry an NSP
  label. Every side sees the *same* batches: ours the `masked_positions`/`masked_labels` form of the loader, HF the
  `(B, T)` labels with -100 elsewhere (its documented interface; its MLM head then runs over every token).
* **Our model** is configured by `bertrain.model.options.apply_model_options`, exactly as the trainer does (so QA
  fine-tuning keeps padding and QA inference runs unpadded); `--separate-qkv` is the bench's own ablation.
* **Interleaving.** All sides are warmed up, then their timed steps alternate (A B B A A B ...), so drift of a shared,
  noisy machine falls on every side alike; we report medians and the ratio of medians. Same process, same threads,
  same precision, same optimizer implementation for everyone (the trainer's: the model is what is compared).
* **FLOPs** are *useful* matmul FLOPs, counted identically for every side (2 per multiply-add; training = 3x the
  forward): `flop_formula()` states it. Padding, and the MLM head on unmasked tokens, are not useful work, so a side
  that computes them is slower at the same FLOP count.
* **MFU** = achieved FLOP/s / the peak of one big GEMM at the same dtype, measured on the same device in the same run.
* **Memory**: CUDA `max_memory_allocated` during one step minus what was allocated before it; on CPU the peak of
  malloc's allocated bytes (glibc `mallinfo2`; RSS from /proc/self/statm where it is missing), sampled every 2 ms by
  a thread in an extra untimed step, minus the value before it.
"""
from bertrain.bench.run import BenchConfig, format_table, run_bench

__all__ = ["BenchConfig", "format_table", "run_bench"]
