"""`bertrain export`: a bertrain checkpoint or model folder (or a Hub model id in the local HF cache) -> a clean HF
folder (no training files; task.json, the settings predict and serve read, for a fine-tuned model) with its model card
(README.md, `bertrain.model.card`), or with `--format onnx` an ONNX
graph verified against PyTorch (`bertrain.deploy.onnx_export`), optionally laid out as a Triton model repository."""
from __future__ import annotations

import argparse
import logging
import re
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from bertrain.commands.convert import _occupied, add_overwrite_argument, check_out_dir, write_model_folder
from bertrain.utils.errors import UserError

log = logging.getLogger(__name__)

TASK_FILE = "task.json"  # bertrain.deploy.predict.TASK_FILE: what predict and serve read beside a fine-tuned model

HELP = ("export a bertrain checkpoint (or run folder: its final/, else its newest checkpoint) as a clean Hugging Face "
        "model folder with a model card, or as ONNX (--format onnx)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint_dir", metavar="CHECKPOINT_DIR",
                        help="a checkpoint folder (step-N), a model folder (e.g. a run's final/), a run folder (its "
                             "final/, the best model under eval.final best; else its newest step-N), or a Hub model "
                             "id (ORG/NAME) in the local Hugging Face cache")
    parser.add_argument("out_dir", metavar="OUT_DIR",
                        help="where to write the HF model folder (--format onnx: the ONNX folder, or the Triton "
                             "repository with --triton)")
    parser.add_argument("--format", choices=["hf", "onnx"], default="hf",
                        help="hf: an HF model folder; onnx: model.onnx (dynamic batch and sequence axes) + tokenizer "
                             "files + onnx.json, verified against PyTorch on real text (QA, classification/"
                             "regression or encoder models; needs pip install \"bertrain[deploy]\")")
    parser.add_argument("--license", default=None, metavar="ID",
                        help="hf: the model card's license, a Hub license id such as apache-2.0 or mit (default: the "
                             "card says license: other and asks for one; bertrain never picks one)")
    parser.add_argument("--language", action="append", default=[], metavar="CODE",
                        help="hf: the model card's language (ISO 639-1, e.g. en); repeat for several")
    parser.add_argument("--opset", type=int, default=None, help="ONNX opset (default: 18)")
    parser.add_argument("--triton", action="store_true",
                        help="onnx: write a model of the Triton model repository OUT_DIR: OUT_DIR/NAME/config.pbtxt, "
                             "OUT_DIR/NAME/1/model.onnx (its other models are kept; --overwrite replaces only "
                             "OUT_DIR/NAME, moved out to OUT_DIR.NAME.replaced-<time>)")
    parser.add_argument("--name", default=None, help="--triton: the model's name in the repository "
                                                    "(default: bert_qa, bert_classification or bert_encoder)")
    add_overwrite_argument(parser)


def resolve_checkpoint(path: Path) -> Path:
    """A model or checkpoint folder as is; a run folder -> what the run ended on, its final/ (under eval.final best
    the best model, which the newest step-N is not: exporting a fine-tuned run deployed its last step), unless a
    step-N is newer (a resumed run that has not finished again); else its newest complete step-N checkpoint, of
    either kind (HF weights, or DCP shards after FSDP: a run may hold both when it changed strategy on resume)."""
    if (path / "config.json").is_file() or (path / "dcp").is_dir() or not path.is_dir():
        return path
    steps = [p for p in path.iterdir() if re.fullmatch(r"step-\d+", p.name) and (p / "COMPLETE").exists()
             and ((p / "config.json").is_file() or (p / "dcp").is_dir())]
    newest = max(steps, key=lambda p: int(p.name.split("-")[1])) if steps else None
    final = path / "final"
    if (final / "config.json").is_file() and (newest is None or final.stat().st_mtime >= newest.stat().st_mtime):
        log.info("%s: its final/ (what the run ended on; name %s/step-N for a checkpoint)", path, path)
        return final
    if newest is not None:
        log.info("%s: its newest complete checkpoint, %s", path, newest.name)
    return newest or path  # without one, from_pretrained names what is missing


def load_model(src: Path):
    """The model to export: an HF folder through from_pretrained; a sharded checkpoint assembled from its shards."""
    from bertrain.model.hf import model_class_for
    from bertrain.train.dcp import is_sharded_checkpoint, load_sharded_model

    if is_sharded_checkpoint(src):
        try:
            return load_sharded_model(src)
        except ValueError as e:
            raise UserError(str(e)) from None
    return model_class_for(src).from_pretrained(src)


def run(args: argparse.Namespace) -> int:
    from bertrain.model.card import check_language, check_license  # torch: only when run (--help stays instant)
    from bertrain.model.hf import resolve_model_dir

    from bertrain.utils.rundir import OutputLock

    if args.format != "onnx" and (args.triton or args.name or args.opset):
        raise UserError("--triton, --name and --opset are options of --format onnx")
    if args.format == "onnx" and (args.license or args.language):
        raise UserError("--license and --language go into the model card of --format hf; an ONNX folder has none")
    license = check_license(args.license) if args.license else None
    language = [check_language(code) for code in args.language]
    if args.name and not args.triton:
        raise UserError("--name names the model in a Triton repository: give it with --triton")
    if args.opset is not None and args.opset < 18:
        raise UserError(f"--opset {args.opset}: torch.onnx.export (the torch.export-based exporter) writes opset 18 "
                        "or newer")
    out = Path(args.out_dir)
    if args.format == "onnx":
        return _export_onnx(args.checkpoint_dir, out, args)
    with OutputLock(out, "export"):
        check_out_dir(out, args.overwrite)
        src = resolve_checkpoint(resolve_model_dir(args.checkpoint_dir))
        model = load_model(src)
        cls = type(model)
        card = model_card(model, src, out, license, language, source=args.checkpoint_dir)
        task = task_file_of(src, model)
        write_model_folder(WithCard(model, card, {TASK_FILE: task} if task else {}), out, "export")
    print(f"exported {src} -> {out} ({cls.__name__}, {model.num_parameters():,} parameters; model card "
          f"{out / 'README.md'}, license: {license or 'other (not set: see the card)'})")
    return 0


def task_file_of(src: Path, model) -> bytes | None:
    """task.json for the exported folder: the label names and feature settings `bertrain predict` and `serve` read
    (without it an exported SQuAD model answered otherwise than its run evaluated it). The rule is
    `bertrain.deploy.predict.run_task_file`'s, the one `Predictor` follows for a folder without its own: the
    source's, or for a step-N folder its run's; None outside a fine-tuning run."""
    from bertrain.deploy.predict import run_task_file

    found = run_task_file(src, type(model).__name__)
    return found[0] if found else None


def model_card(model, src: Path, out: Path, license: str | None, language: list[str], source: str) -> str:
    """The README.md of the exported folder: the source's own bertrain card (final/ has one) with the license and
    language given here; else one written from the run folder the source sits in (a step-N or best/ folder), or,
    outside a run, one that says what was exported."""
    from bertrain.model.card import README, is_bertrain_card, relicense, render, run_facts

    if is_bertrain_card(src / README):
        text = (src / README).read_text(encoding="utf-8")
        return relicense(text, license, language) if license or language else text
    run = src.parent if (src.parent / "config.yaml").is_file() else None
    facts = run_facts(src, run, out.resolve().name, final=src.name == "final", license=license, language=language,
                      source=source)
    return render(facts, model)


class WithCard:
    """A model whose `save_pretrained` also writes its model card and `extra` files ({name: bytes}, e.g. task.json)
    (for `write_model_folder`'s atomic folder)."""

    def __init__(self, model, card: str, extra: dict[str, bytes] | None = None) -> None:
        self.model, self.card, self.extra = model, card, dict(extra or {})

    def save_pretrained(self, path: Path) -> None:
        from bertrain.model.card import write_card
        from bertrain.utils.io import atomic_write_bytes

        self.model.save_pretrained(path)
        for name, data in self.extra.items():
            atomic_write_bytes(Path(path) / name, data)
        write_card(path, self.card)


def _export_onnx(source: str, out: Path, args: argparse.Namespace) -> int:
    from bertrain.deploy.backends import task_of
    from bertrain.deploy.onnx_export import OPSET, OnnxFolder
    from bertrain.model.hf import resolve_model_dir
    from bertrain.utils.rundir import OutputLock

    name = _checked_name(args.name) if args.triton else None
    src = resolve_checkpoint(resolve_model_dir(source))
    model = None
    if args.triton and name is None:  # the default name is the model's task: known once it is loaded
        model = load_model(src)
        name = f"bert_{task_of(model)}"
    # A Triton repository holds several models: only OUT/NAME is this export's to lock, check and replace
    target = out / name if name else out
    with (_model_lock(target) if name else OutputLock(out, "export")):
        if not name:
            check_out_dir(out, args.overwrite)
        elif _occupied(target) and not args.overwrite:
            raise UserError(f"{out} already holds a model {name} ({target}): pass --overwrite to replace it (the "
                            f"old one is moved beside the repository, not deleted), or choose another --name")
        model = model if model is not None else load_model(src)
        task = _deployable(model, src)
        folder = OnnxFolder(model, src, opset=args.opset or OPSET, triton_name=name,
                            task_file=task_file_of(src, model))
        if name:
            _write_triton_model(folder, target)
        else:
            write_model_folder(folder, out, "export")
    where = target / "1" if name else out
    print(f"exported {src} -> {where / 'model.onnx'} ({type(model).__name__}, task {task}, ONNX opset {folder.opset}, "
          f"dynamic axes batch x sequence)" + (f"; Triton model repository {out} (model {name})" if name else ""))
    print(f"verified against PyTorch on real text: max abs difference of the outputs {folder.max_abs_diff:.2e} "
          f"(limit {folder.tolerance:g}, fp32)")
    return 0


def _checked_name(name: str | None) -> str | None:
    """--name: one folder of the repository (not '.', '..' or a hidden one: the export would lock and replace the
    repository itself, its parent, or a folder Triton may not list)."""
    if name is not None and (not re.fullmatch(r"[A-Za-z0-9_.-]+", name) or name.startswith(".")):
        raise UserError(f"--name {name!r}: use letters, digits, '_', '-' or '.', not first (it is a folder name)")
    return name


def _deployable(model, src: Path) -> str:
    """The model's task ("qa", "classification", "encoder"); a head without trained weights is refused."""
    from bertrain.deploy.backends import task_of

    task = task_of(model)
    untrained = model.loading_info.get("initialized") or []
    if task == "encoder" and untrained == ["pooler"]:
        # an encoder saved without a pooler (transformers' add_pooling_layer=False; many sentence encoders): its
        # hidden states are all it has, so they are what is exported (a random pooler_output would be noise)
        model.pooler = None
        untrained = []
        print(f"{src} has no pooler weights: exporting last_hidden_state only")
    if untrained:  # an exported random head would serve noise
        raise UserError(f"{src} has no trained weights for the {', '.join(untrained)} of its "
                        f"{type(model).__name__}: export a fine-tuned model (bertrain finetune writes OUTPUT/final)")
    return task


@contextmanager
def _model_lock(target: Path) -> Iterator[None]:
    """`OutputLock` of the model folder REPOSITORY/NAME, its lock file beside the repository
    (.REPOSITORY.NAME.lock): inside, it would be one more entry among the models."""
    from bertrain.utils.rundir import OutputLock

    folder = target.absolute()
    stand_in = folder.parent.parent / f"{folder.parent.name}.{folder.name}"
    lock = OutputLock(stand_in, "export")
    try:
        lock.__enter__()
    except UserError as e:  # "output folder X is in use by ...": named as the user gave it
        raise UserError(str(e).replace(str(stand_in), str(target))) from None
    try:
        yield
    finally:
        lock.__exit__(None, None, None)


def _write_triton_model(folder, target: Path) -> None:
    """`write_model_folder` for the model folder REPOSITORY/NAME: built atomically beside its siblings; an old one
    (--overwrite) is moved out of the repository, beside it (REPOSITORY.NAME.replaced-<time>), once the new one is
    complete. Moved aside inside, Triton would take it for one more model, whose folder is not named as its
    config.pbtxt says, and refuse to load it (at start: refuse to start)."""
    write_model_folder(folder, target, "export", move=_move_out_of_repository)


def _move_out_of_repository(path: Path) -> Path:
    """Rename the model folder REPOSITORY/NAME to a free REPOSITORY.NAME.replaced-<time> beside the repository."""
    import datetime
    import os

    from bertrain.utils.errors import writing

    repository = path.absolute().parent
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    base = repository.parent / f"{repository.name}.{path.name}.replaced-{stamp}"
    target, n = base, 1
    while target.exists() or target.is_symlink():
        n += 1
        target = base.with_name(f"{base.name}-{n}")
    with writing(f"moving the previous model {path} aside to {target}", kept=f"{path} is unchanged"):
        os.replace(path, target)
    return target
