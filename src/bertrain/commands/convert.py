"""`bertrain convert`: import any HF/Google BERT folder into a clean bertrain model folder with every head."""
from __future__ import annotations

import argparse
from pathlib import Path

from bertrain.utils.io import atomic_dir

HELP = "import an HF/Google BERT folder (.safetensors or .bin, any heads) into a bertrain model folder"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("hf_dir", metavar="HF_DIR", help="folder with config.json and model weights (+ vocab.txt)")
    parser.add_argument("out_dir", metavar="OUT_DIR", help="where to write the bertrain (HF-format) model folder")
    parser.add_argument("--overwrite", action="store_true", help="replace OUT_DIR if it exists and is not empty")


def check_out_dir(out: Path, overwrite: bool) -> None:
    """Refuse to write into an existing non-empty folder unless told to."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise ValueError(f"{out} already exists and is not empty (pass --overwrite to replace it)")


def run(args: argparse.Namespace) -> int:
    from bertrain.model.bert import BertForPreTraining  # torch: only when run (--help stays instant)

    out = Path(args.out_dir)
    check_out_dir(out, args.overwrite)
    model = BertForPreTraining.from_pretrained(args.hf_dir)
    with atomic_dir(out, overwrite=out.exists()) as tmp:
        model.save_pretrained(tmp)
    initialised = model.loading_info["initialized"]
    print(f"converted {args.hf_dir} -> {out} (BertForPreTraining, {model.num_parameters():,} parameters)")
    if initialised:
        print(f"initialised randomly (absent from {args.hf_dir}): {', '.join(initialised)}")
    if "vocab.txt" not in model.tokenizer_files:
        print(f"warning: {args.hf_dir} has no vocab.txt; {out} has no tokenizer files")
    return 0
