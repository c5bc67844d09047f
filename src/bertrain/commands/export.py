"""`bertrain export`: a bertrain checkpoint or model folder (or a Hub model id in the local HF cache) -> a clean HF
folder (no training files; task.json, the settings predict and serve read, for a fine-tuned model) with its model card
(README.md, `bertrain.model.card`), or with `--format onnx` an ONNX
graph verified against PyTorch (`bertrain.deploy.onnx_export`), optionally laid out as a Triton model repository."""
from __future__ import annotations

import argparse
import re
from pathlib import Path

from bertrain.commands.convert import add_overwrite_argument, check_out_dir, write_model_folder
from bertrain.utils.errors import UserError

TASK_FILE = "task.json"  # bertrain.deploy.predict.TASK_FILE: what predict and serve read beside a fine-tuned model

HELP = ("export a bertrain checkpoint (or run folder: its latest checkpoint) as a clean Hugging Face model folder "
        "with a model card, or as ONNX (--format onnx)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint_dir", metavar="CHECKPOINT_DIR",
                        help="a checkpoint folder (step-N), a model folder (e.g. a run's final/), a run folder holding "
                             "step-N folders, or a Hub model id (ORG/NAME) in the local Hugging Face cache")
    parser.add_argument("out_dir", metavar="OUT_DIR", help="where to write the HF model folder")
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
                        help="onnx: write a Triton model repository: OUT_DIR/NAME/config.pbtxt, "
                             "OUT_DIR/NAME/1/model.onnx")
    parser.add_argument("--name", default=None, help="--triton: the model's name in the repository "
                                                    "(default: bert_qa, bert_classification or bert_encoder)")
    add_overwrite_argument(parser)


def resolve_checkpoint(path: Path) -> Path:
    """A model or checkpoint folder as is; a run folder -> its newest complete step-N checkpoint, of either kind
    (HF weights, or DCP shards after FSDP: a run may hold both when it changed strategy on resume)."""
    if (path / "config.json").is_file() or (path / "dcp").is_dir() or not path.is_dir():
        return path
    steps = [p for p in path.iterdir() if re.fullmatch(r"step-\d+", p.name) and (p / "COMPLETE").exists()
             and ((p / "config.json").is_file() or (p / "dcp").is_dir())]
    if not steps:
        return path  # from_pretrained names what is missing
    return max(steps, key=lambda p: int(p.name.split("-")[1]))


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
    with OutputLock(out, "export"):
        check_out_dir(out, args.overwrite)
        src = resolve_checkpoint(resolve_model_dir(args.checkpoint_dir))
        model = load_model(src)
        cls = type(model)
        if args.format == "onnx":
            return _export_onnx(model, src, out, args)
        card = model_card(model, src, out, license, language, source=args.checkpoint_dir)
        task = task_file_of(src, model)
        write_model_folder(WithCard(model, card, {TASK_FILE: task} if task else {}), out, "export")
    print(f"exported {src} -> {out} ({cls.__name__}, {model.num_parameters():,} parameters; model card "
          f"{out / 'README.md'}, license: {license or 'other (not set: see the card)'})")
    return 0


def task_file_of(src: Path, model) -> bytes | None:
    """task.json for the exported folder: the label names and feature settings `bertrain predict` and `serve` read.
    Without it they fall back to 384/128-token windows and drop a SQuAD v2.0 model's null answer, so the exported
    model answered otherwise than its run evaluated it. The source's own (a fine-tuned final/); for a step-N or
    best/ folder of a fine-tuning run, its run's final/task.json, else the one the run's config.yaml implies (what
    `bertrain finetune` writes into final/); None outside a fine-tuning run. A QA task.json gets the answer
    decoding its run evaluated with (data.n_best_size, max_answer_length, null_score_diff_threshold), which
    `bertrain finetune` does not write into it."""
    import json

    import yaml

    run = src.parent
    data: dict = {}
    if (run / "config.yaml").is_file():
        try:
            data = (yaml.safe_load((run / "config.yaml").read_text(encoding="utf-8")) or {}).get("data") or {}
        except (OSError, yaml.YAMLError, AttributeError):
            data = {}
    data = data if isinstance(data, dict) else {}
    # SQuAD's answer decoding as the run evaluated (task.json of older runs does not say it)
    decoding = {k: data[k] for k in ("n_best_size", "max_answer_length", "null_score_diff_threshold") if k in data}
    own = src / TASK_FILE
    if not own.is_file() and (run / "config.yaml").is_file() and (run / "final" / TASK_FILE).is_file():
        try:  # the same run's final model: the same task, if it is the same kind of model
            same = json.loads((run / "final" / "config.json").read_text(encoding="utf-8")).get("architectures")
        except (OSError, ValueError, AttributeError):
            same = None
        if same == [type(model).__name__]:
            own = run / "final" / TASK_FILE
    if own.is_file():
        text = own.read_bytes()
        try:
            task = json.loads(text)
        except ValueError:
            return text  # as it is: predict names what is wrong with it
        if not isinstance(task, dict) or task.get("kind") != "qa" or all(k in task for k in decoding):
            return text
        return (json.dumps({**task, **{k: v for k, v in decoding.items() if k not in task}}, indent=2)
                + "\n").encode()
    if not data or model is None:
        return None
    task = None
    if type(model).__name__ == "BertForQuestionAnswering" and data.get("train_file"):
        task = {"kind": "qa", "task": "squad", "version_2_with_negative": bool(data.get("version_2_with_negative")),
                **{k: data[k] for k in ("max_seq_length", "doc_stride", "max_query_length") if k in data},
                **decoding}
    elif type(model).__name__ == "BertForSequenceClassification" and data.get("task"):
        from bertrain.tasks.glue import TASKS

        glue = TASKS.get(data["task"])
        if glue is None:
            return None
        task = {"kind": "regression" if glue.is_regression else "classification", "task": glue.name,
                "labels": list(glue.labels) if glue.labels else None,
                **({"max_seq_length": data["max_seq_length"]} if "max_seq_length" in data else {})}
    return None if task is None else (json.dumps(task, indent=2) + "\n").encode()


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


def _export_onnx(model, src: Path, out: Path, args: argparse.Namespace) -> int:
    from bertrain.deploy.backends import task_of
    from bertrain.deploy.onnx_export import OPSET, OnnxFolder

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
    name = (args.name or f"bert_{task}") if args.triton else None
    if name is not None and not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
        raise UserError(f"--name {name!r}: use letters, digits, '_', '-' or '.' (it is a folder name)")
    folder = OnnxFolder(model, src, opset=args.opset or OPSET, triton_name=name, task_file=task_file_of(src, model))
    write_model_folder(folder, out, "export")
    where = out / name / "1" if name else out
    print(f"exported {src} -> {where / 'model.onnx'} ({type(model).__name__}, task {task}, ONNX opset {folder.opset}, "
          f"dynamic axes batch x sequence)" + (f"; Triton model repository {out} (model {name})" if name else ""))
    print(f"verified against PyTorch on real text: max abs difference of the outputs {folder.max_abs_diff:.2e} "
          f"(limit {folder.tolerance:g}, fp32)")
    return 0
