"""`bertrain convert`: import any HF/Google BERT folder (Google's TensorFlow checkpoints too) into a clean bertrain
model folder with every head."""
from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from bertrain.utils.errors import UserError, writing
from bertrain.utils.io import atomic_dir

HELP = ("import an HF/Google BERT folder (.safetensors, .bin or Google's TensorFlow checkpoint, any heads) into a "
        "bertrain model folder")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("hf_dir", metavar="HF_DIR",
                        help="folder with config.json and model weights (+ vocab.txt), or Google's release layout: "
                             "bert_config.json, vocab.txt, bert_model.ckpt.index and .data-*")
    parser.add_argument("out_dir", metavar="OUT_DIR", help="where to write the bertrain (HF-format) model folder")
    add_overwrite_argument(parser)


def add_overwrite_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--overwrite", action="store_true",
                        help="OUT_DIR exists and is not empty: write the new folder anyway; the old one is moved "
                             "aside to OUT_DIR.replaced-<time>, never deleted")


def check_out_dir(out: Path, overwrite: bool) -> None:
    """Refuse to write into an existing non-empty folder (or over a file) unless told to."""
    if _occupied(out) and not overwrite:
        raise UserError(f"{out} already exists and is not empty: pass --overwrite to write there anyway (the old "
                        "one is moved aside, not deleted), or choose another folder")


def _occupied(out: Path) -> bool:
    return out.is_symlink() or (out.exists() and (not out.is_dir() or any(out.iterdir())))


def write_model_folder(model, out: Path, command: str,
                       move: Callable[[Path], Path] | None = None) -> Path | None:
    """`model.save_pretrained` into `out`, atomically; an occupied `out` (allowed by --overwrite) is moved aside
    (`move`, default `rundir.move_aside`) once the new folder is complete. Returns where the old one went. Hold
    `OutputLock(out)` around it."""
    from bertrain.utils.rundir import move_aside

    moved: list[Path] = []

    def aside(path: Path) -> None:
        if _occupied(path):
            moved.append((move or move_aside)(path))
        else:  # an empty folder: nothing to keep
            path.rmdir()

    kept = f"{out} is unchanged" if out.exists() else f"nothing was written to {out}"
    with writing(f"{command}: writing {out}", kept=f"{kept} (the partial copy was removed)"):
        with atomic_dir(out, move_existing=aside) as tmp:
            model.save_pretrained(tmp)
    if moved:
        print(f"moved the previous {out} aside to {moved[0]}")
    return moved[0] if moved else None


def run(args: argparse.Namespace) -> int:
    from bertrain.model.bert import BertForPreTraining  # torch: only when run (--help stays instant)

    from bertrain.utils.rundir import OutputLock

    out = Path(args.out_dir)
    with OutputLock(out, "convert"):
        check_out_dir(out, args.overwrite)
        model = BertForPreTraining.from_pretrained(args.hf_dir)
        write_model_folder(model, out, "convert")
    initialised = model.loading_info["initialized"]
    print(f"converted {args.hf_dir} -> {out} (BertForPreTraining, {model.num_parameters():,} parameters)")
    if initialised:
        print(f"initialised randomly (absent from {args.hf_dir}): {', '.join(initialised)}")
    if "vocab.txt" not in model.tokenizer_files:
        # (tokenizer.json alone is copied but is not enough: bertrain tokenizes from vocab.txt; the log line of
        # `read_tokenizer_files` says why it could not take the vocabulary from it)
        print(f"warning: {args.hf_dir} has no vocab.txt"
              + (" that bertrain can use (see the warning above)" if "tokenizer.json" in model.tokenizer_files
                 else "") + f"; {out} has none, so bertrain cannot tokenize text for it")
    return 0
