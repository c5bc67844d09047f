"""`bertrain export`: a bertrain checkpoint or model folder -> a clean HF folder (no training files)."""
from __future__ import annotations

import argparse
import re
from pathlib import Path

from bertrain.commands.convert import add_overwrite_argument, check_out_dir, write_model_folder

HELP = "export a bertrain checkpoint (or run folder: its latest checkpoint) as a clean Hugging Face model folder"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint_dir", metavar="CHECKPOINT_DIR",
                        help="a checkpoint folder (step-N), a model folder, or a run folder holding step-N folders")
    parser.add_argument("out_dir", metavar="OUT_DIR", help="where to write the HF model folder")
    add_overwrite_argument(parser)


def resolve_checkpoint(path: Path) -> Path:
    """A folder with config.json as is; a run folder -> its latest complete step-N checkpoint."""
    if (path / "config.json").is_file() or not path.is_dir():
        return path
    steps = [p for p in path.iterdir() if re.fullmatch(r"step-\d+", p.name) and (p / "COMPLETE").exists()
             and (p / "config.json").is_file()]
    if not steps:
        return path  # from_pretrained names what is missing
    return max(steps, key=lambda p: int(p.name.split("-")[1]))


def run(args: argparse.Namespace) -> int:
    from bertrain.model.hf import model_class_for  # torch: only when run (--help stays instant)

    from bertrain.utils.rundir import OutputLock

    out = Path(args.out_dir)
    with OutputLock(out, "export"):
        check_out_dir(out, args.overwrite)
        src = resolve_checkpoint(Path(args.checkpoint_dir))
        cls = model_class_for(src)
        model = cls.from_pretrained(src)
        write_model_folder(model, out, "export")
    print(f"exported {src} -> {out} ({cls.__name__}, {model.num_parameters():,} parameters)")
    return 0
