"""`bertrain inspect`: show samples and stats of a prepared folder."""
from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from bertrain.data.pretraining import PretrainingDataset
from bertrain.data.samples import sample_from_record
from bertrain.data.store import TokenStore, heldout_status
from bertrain.data.tokenizer import read_vocab
from bertrain.utils.errors import UserError

HELP = "print samples (tokens, ids, types, masks, NSP label) and stats of a prepared folder"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("data_dir", metavar="DIR", help="folder written by `bertrain prepare`")
    parser.add_argument("--samples", type=int, default=3, help="number of samples to show (default 3)")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument("--masking", choices=["auto", "static", "dynamic"], default="auto",
                        help="auto: static instances when present, else dynamic samples of epoch 0")
    parser.add_argument("--max-seq-length", type=int, default=None, help="dynamic: default from stats or 128")
    parser.add_argument("--max-predictions-per-seq", type=int, default=None)
    parser.add_argument("--epoch", type=int, default=0, help="dynamic: which epoch's samples")
    parser.add_argument("--verify", action="store_true", help="check every shard's checksum (the held-out set's too)")


def run(args: argparse.Namespace) -> int:
    for flag, value in (("--samples", args.samples), ("--epoch", args.epoch)):
        if value < 0:
            raise UserError(f"{flag} must be >= 0, got {value}")
    for flag, value in (("--max-seq-length", args.max_seq_length),
                        ("--max-predictions-per-seq", args.max_predictions_per_seq)):
        if value is not None and value < 1:  # 0 was taken for "not given": the default was shown instead
            raise UserError(f"{flag} must be >= 1, got {value}")
    data_dir = Path(args.data_dir)
    store = TokenStore(data_dir, verify=args.verify)  # clear errors for incomplete/corrupt folders
    if args.verify and (held := heldout_status(data_dir).dir) is not None:  # a damaged one failed only in pretrain
        TokenStore(held, verify=True)
    try:
        stats = json.loads((data_dir / "stats.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise UserError(f"cannot read {data_dir / 'stats.json'}: {e} (re-run prepare with --overwrite)") from None
    recorded, seed = sample_from_record(stats.get("sample_config"))  # static instances' settings and seed, if any
    masking = args.masking
    if masking == "auto":
        masking = "static" if stats.get("masking") == "static" else "dynamic"
    overrides = {k: v for k, v in (("max_seq_length", args.max_seq_length),
                                   ("max_predictions_per_seq", args.max_predictions_per_seq)) if v is not None}
    sample = dataclasses.replace(recorded, **overrides)
    ds = PretrainingDataset(data_dir, sample, masking=masking, seed=seed, verify=False)
    vocab = read_vocab(data_dir / "vocab.txt")
    n = min(args.samples, len(ds))
    batch = ds.get_batch(args.epoch, list(range(n)))
    samples = []
    for i in range(n):
        length = int(batch["attention_mask"][i].sum())
        ids = batch["input_ids"][i, :length].tolist()
        labels = batch["masked_labels"][i]
        k = int((labels != -100).sum())
        samples.append({
            "index": i, "tokens": [vocab[t] for t in ids], "input_ids": ids,
            "token_type_ids": batch["token_type_ids"][i, :length].tolist(),
            "masked_positions": batch["masked_positions"][i, :k].tolist(),
            "masked_labels": labels[:k].tolist(), "masked_label_tokens": [vocab[t] for t in labels[:k].tolist()],
            "next_sentence_label": int(batch["next_sentence_labels"][i]),
        })
    out = {"data_dir": str(data_dir), "masking": masking, "num_samples": len(ds), "num_shards": len(store.shards),
           "samples": samples, "stats": stats}
    if args.json:
        print(json.dumps(out, indent=2, ensure_ascii=False))
        return 0
    print(f"{data_dir}: {stats['num_documents']} documents, {stats['num_sentences']} sentences, "
          f"{stats['num_tokens']} tokens, {len(ds)} {masking} samples, tokenizer {stats['tokenizer_identity']}")
    for s in samples:
        print(f"\n#{s['index']} next_sentence_label={s['next_sentence_label']}")
        print(" ".join(s["tokens"]))
        print("types:  ", "".join(map(str, s["token_type_ids"])))
        print("masked: ", ", ".join(f"{p}:{t}" for p, t in zip(s["masked_positions"], s["masked_label_tokens"])))
    return 0
