"""`bertrain export`: a bertrain checkpoint or model folder -> a clean HF folder (no training files), or with
`--format onnx` an ONNX graph verified against PyTorch (`bertrain.deploy.onnx_export`), optionally laid out as a
Triton model repository."""
from __future__ import annotations

import argparse
import re
from pathlib import Path

from bertrain.commands.convert import add_overwrite_argument, check_out_dir, write_model_folder
from bertrain.utils.errors import UserError

HELP = ("export a bertrain checkpoint (or run folder: its latest checkpoint) as a clean Hugging Face model folder, "
        "or as ONNX (--format onnx)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint_dir", metavar="CHECKPOINT_DIR",
                        help="a checkpoint folder (step-N), a model folder, or a run folder holding step-N folders")
    parser.add_argument("out_dir", metavar="OUT_DIR", help="where to write the HF model folder")
    parser.add_argument("--format", choices=["hf", "onnx"], default="hf",
                        help="hf: an HF model folder; onnx: model.onnx (dynamic batch and sequence axes) + tokenizer "
                             "files + onnx.json, verified against PyTorch on real text (QA, classification/"
                             "regression or encoder models; needs pip install \"bertrain[deploy]\")")
    parser.add_argument("--opset", type=int, default=None, help="ONNX opset (default: 18)")
    parser.add_argument("--triton", action="store_true",
                        help="onnx: write a Triton model repository: OUT_DIR/NAME/config.pbtxt, "
                             "OUT_DIR/NAME/1/model.onnx")
    parser.add_argument("--name", default=None, help="--triton: the model's name in the repository "
                                                    "(default: bert_qa, bert_classification or bert_encoder)")
    add_overwrite_argument(parser)


def resolve_checkpoint(path: Path) -> Path:
    """A folder with config.json as is; a run folder -> its latest complete step-N checkpoint."""
    if (path / "config.json").is_file() or not path.is_dir():
        return path
    steps = [p for p in path.iterdir() if re.fullmatch(r"step-\d+", p.name) and (p / "COMPLETE").exists()
             and (p / "config.json").is_file()]
    if not steps:
        sharded = [p for p in path.iterdir() if re.fullmatch(r"step-\d+", p.name) and (p / "dcp").is_dir()]
        if sharded or (path / "dcp").is_dir():
            raise UserError(f"{path} holds sharded checkpoints (parallelism.strategy: fsdp): their weights are "
                            "DCP shards for resuming, not an HF folder. Export the run's final/ folder (written at "
                            "the end of the run), or continue the run from the step with --resume and export its "
                            "final/")
        return path  # from_pretrained names what is missing
    return max(steps, key=lambda p: int(p.name.split("-")[1]))


def run(args: argparse.Namespace) -> int:
    from bertrain.model.hf import model_class_for  # torch: only when run (--help stays instant)

    from bertrain.utils.rundir import OutputLock

    if args.format != "onnx" and (args.triton or args.name or args.opset):
        raise UserError("--triton, --name and --opset are options of --format onnx")
    if args.name and not args.triton:
        raise UserError("--name names the model in a Triton repository: give it with --triton")
    if args.opset is not None and args.opset < 18:
        raise UserError(f"--opset {args.opset}: torch.onnx.export (the torch.export-based exporter) writes opset 18 "
                        "or newer")
    out = Path(args.out_dir)
    with OutputLock(out, "export"):
        check_out_dir(out, args.overwrite)
        src = resolve_checkpoint(Path(args.checkpoint_dir))
        cls = model_class_for(src)
        model = cls.from_pretrained(src)
        if args.format == "onnx":
            return _export_onnx(model, src, out, args)
        write_model_folder(model, out, "export")
    print(f"exported {src} -> {out} ({cls.__name__}, {model.num_parameters():,} parameters)")
    return 0


def _export_onnx(model, src: Path, out: Path, args: argparse.Namespace) -> int:
    from bertrain.deploy.backends import task_of
    from bertrain.deploy.onnx_export import OPSET, OnnxFolder

    task = task_of(model)
    untrained = model.loading_info.get("initialized") or []
    if untrained:  # an exported random head would serve noise
        raise UserError(f"{src} has no trained weights for the {', '.join(untrained)} of its "
                        f"{type(model).__name__}: export a fine-tuned model (bertrain finetune writes OUTPUT/final)")
    name = (args.name or f"bert_{task}") if args.triton else None
    if name is not None and not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
        raise UserError(f"--name {name!r}: use letters, digits, '_', '-' or '.' (it is a folder name)")
    folder = OnnxFolder(model, src, opset=args.opset or OPSET, triton_name=name)
    write_model_folder(folder, out, "export")
    where = out / name / "1" if name else out
    print(f"exported {src} -> {where / 'model.onnx'} ({type(model).__name__}, task {task}, ONNX opset {folder.opset}, "
          f"dynamic axes batch x sequence)" + (f"; Triton model repository {out} (model {name})" if name else ""))
    print(f"verified against PyTorch on real text: max abs difference of the outputs {folder.max_abs_diff:.2e} "
          f"(limit {folder.tolerance:g}, fp32)")
    return 0
