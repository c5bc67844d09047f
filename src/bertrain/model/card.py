"""Model cards: the README.md that every exported model folder carries (OUTPUT/final, `bertrain export`).

The Hub reads a model folder's README.md as YAML metadata between `---` lines (library_name, pipeline_tag, tags,
base_model, datasets, language, license, model-index: the evaluation results), then Markdown. The card is written
from what the run left in its folder, so each statement has a file behind it:

* config.yaml        the resolved run config: the training settings, the model it started from (`init`,
                     `model.init`: a Hub model id becomes `base_model`), the command that runs it again
* task.json          the fine-tuning task (absent: pretraining)
* eval_results.json  fine-tuning's dev results of the final model: for final/ only, and only when written after the
                     run's config.yaml (by the run that made this model, not an earlier one in the same folder)
* metrics.jsonl      the evaluations while training (`"event": "eval"`) and the steps and samples trained: a step-N
                     folder reports the evaluation of step N, best/ that of best.json's step, a final/ without
                     eval_results.json that of its final step (eval.final: best -> the best step)

GLUE and SQuAD results go to model-index under the Hub's dataset ids (nyu-mll/glue, rajpurkar/squad[_v2]), named
with the files they were computed on; evaluations with no Hub dataset (pretraining's held-out documents, a task
registered beside GLUE's nine) are reported in the text only. License and language are the user's
(`bertrain export --license --language`): without a license the card says `license: other` and asks for one, with
the starting model's declared license beside it when its card is at hand; nothing is guessed.

The card is written with PyYAML (a core dependency); `huggingface_hub.ModelCard` parses it (tests/test_model_card.py).
"""
from __future__ import annotations

import json
import os
import re
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from bertrain import __version__
from bertrain.config import flatten
from bertrain.model.bert import BertPreTrainedModel
from bertrain.model.hf import hub_id_of, resolve_model_dir, split_hub_id, to_hf_state_dict
from bertrain.utils.io import atomic_write_text

README = "README.md"
LICENSE_HEADING = "## License and language"
TAG = "bertrain"

# bertrain class -> (the Hub's pipeline tag, the transformers Auto class that loads the folder)
PIPELINES = {"BertForPreTraining": ("fill-mask", "AutoModelForPreTraining"),
             "BertForQuestionAnswering": ("question-answering", "AutoModelForQuestionAnswering"),
             "BertForSequenceClassification": ("text-classification", "AutoModelForSequenceClassification"),
             "BertModel": ("feature-extraction", "AutoModel")}
TASK_NAMES = {"question-answering": "Question Answering", "text-classification": "Text Classification"}
GLUE = ("cola", "sst2", "mrpc", "stsb", "qqp", "mnli", "qnli", "rte", "wnli")  # the configs of nyu-mll/glue
GLUE_SPLITS = {"dev": "validation", "mnli-m": "validation_matched", "mnli-mm": "validation_mismatched"}
SQUAD = {"1.1": "rajpurkar/squad", "2.0": "rajpurkar/squad_v2"}
# evaluate-v1.1.py says exact_match, evaluate-v2.0.py exact (the v1.1 card lost its exact match)
SQUAD_METRICS = ("exact_match", "exact", "f1", "HasAns_exact", "HasAns_f1", "NoAns_exact", "NoAns_f1")
# bertrain's metric names -> the Hub's metric ids (composites such as acc_and_f1 stay in the text)
METRIC_TYPES = {"accuracy": "accuracy", "f1": "f1", "mcc": "matthews_correlation", "pearson": "pearsonr",
                "spearmanr": "spearmanr", "exact": "exact_match", "exact_match": "exact_match"}
# Settings shown in the card's table (the whole config.yaml follows it); a key absent from the run's config is
# skipped, as is one left empty or 0 (derived).
SETTINGS = ("init", "model.init", "model.preset", "data.task", "data.data_dir", "data.train_file", "data.dev_file",
            "data.train_articles", "data.dev_articles", "data.version_2_with_negative", "data.max_train_examples",
            "data.prepared", "data.input", "data.vocab_file", "data.max_seq_length", "sample.max_seq_length",
            "sample.next_sentence", "train.steps", "train.epochs", "train.max_time", "train.global_batch_size",
            "train.micro_batch_size", "optim.name", "optim.lr", "optim.weight_decay", "schedule.name",
            "schedule.warmup", "precision.mode", "parallelism.strategy", "eval.final", "seed")
_STEP_DIR = re.compile(r"step-(\d+)")
_LANGUAGE = re.compile(r"[a-z]{2,3}(-[A-Za-z0-9]+)*")
_LICENSE = re.compile(r"[a-z0-9][a-z0-9.+-]*")


@dataclass
class Evaluation:
    """One evaluated split: what it was, its numbers and, for a Hub dataset, its model-index entry."""
    title: str
    metrics: dict[str, float]
    task_type: str | None = None
    """The Hub task (question-answering, text-classification); None: not in model-index."""
    dataset_type: str | None = None
    """The Hub dataset id; None: reported in the text only."""
    dataset_config: str | None = None
    split: str | None = None


@dataclass
class CardFacts:
    """What a model card says, gathered from the run's files (`run_facts`) or given."""
    name: str
    """The model's name (the run or export folder's name)."""
    config: dict[str, Any] | None = None
    """The resolved run config (config.yaml); None: not trained by bertrain, or its run folder is not at hand."""
    task: dict[str, Any] | None = None
    """task.json of a fine-tuned model."""
    evaluations: list[Evaluation] = field(default_factory=list)
    evaluated: str = ""
    """Which evaluation the numbers are (e.g. 'after training, on the final model')."""
    trained: str = ""
    """Steps and samples the run trained, and which step's weights the folder holds when not the last."""
    launched: str | None = None
    """The command line that ran the training, when the export happens inside it."""
    source: str | None = None
    """What was exported, for a folder without a training record (a Hub id or a path)."""
    trained_with: str | None = None
    """The bertrain version that trained it: known when the card is written by the run itself."""
    license: str | None = None
    language: list[str] = field(default_factory=list)

    @property
    def init(self) -> str | None:
        """The model the run started from, as the config names it."""
        if not self.config:
            return None
        init = self.config.get("init")
        return (init if isinstance(init, str) else None) or _section(self.config, "model").get("init") or None

    @property
    def base_model(self) -> str | None:
        """The Hub model id of `init`: a Hub id it was given as, or the HF-cache snapshot folder it names."""
        init = self.init
        if not init:
            return None
        if not Path(init).exists() and split_hub_id(init) is not None:
            return split_hub_id(init)[0]
        return hub_id_of(init)

    @property
    def command(self) -> str | None:
        """The bertrain command that runs this config.yaml again."""
        if not self.config:
            return None
        data = _section(self.config, "data")
        if "task" in data:
            return "bertrain finetune glue --config config.yaml"
        if "train_file" in data:
            return "bertrain finetune squad --config config.yaml"
        return "bertrain pretrain --config config.yaml" if "sample" in self.config else None


def _section(config: dict[str, Any], name: str) -> dict[str, Any]:
    """A section of a run config (empty when absent or not a mapping: a config.yaml written by hand)."""
    value = config.get(name)
    return value if isinstance(value, dict) else {}


def check_license(value: str) -> str:
    """A license as the Hub's metadata spells it (a lower-case id such as apache-2.0, mit, cc-by-4.0, or other)."""
    if not _LICENSE.fullmatch(value):
        raise ValueError(f"--license {value!r}: give a Hub license id in lower case (e.g. apache-2.0, mit, "
                         "cc-by-4.0, other)")
    return value


def check_language(value: str) -> str:
    """A language code as the Hub's metadata spells it (ISO 639-1/3, e.g. en, de, zh-Hans)."""
    if not _LANGUAGE.fullmatch(value):
        raise ValueError(f"--language {value!r}: give an ISO 639-1 or 639-3 code such as en, de or fra")
    return value


def launched_command(argv: list[str] | None = None) -> str | None:
    """This process's command line when it is the `bertrain` CLI (the training command, for an export inside the
    run), else None (a test, a notebook, a Python program calling bertrain)."""
    argv = sys.argv if argv is None else argv
    if not argv:
        return None
    prog = Path(argv[0])
    if prog.name != "bertrain" and not (prog.name == "__main__.py" and prog.parent.name == "bertrain"):
        return None
    return shlex.join(["bertrain", *argv[1:]])


# ----------------------------------------------------------------------------------------------- the run's facts

def run_facts(model_dir: str | os.PathLike, run_dir: str | os.PathLike | None, name: str, *, final: bool = False,
              in_run: bool = False, task: dict[str, Any] | None = None, launched: str | None = None,
              license: str | None = None, language: list[str] | tuple[str, ...] = (),
              source: str | None = None) -> CardFacts:
    """The facts of the model in `model_dir`, from its run folder `run_dir` (None: it has none) and itself.

    `final`: the folder is the run's final model (OUTPUT/final, perhaps still being written under another name);
    `in_run`: the run itself is writing the card (so this bertrain trained it); `task`: its task.json when not yet
    in `model_dir`; `source`: what is exported, named in a card without a training record."""
    model_dir = Path(model_dir)
    run = Path(run_dir) if run_dir is not None else None
    config_file = next((f for f in (model_dir / "config.yaml", run and run / "config.yaml") if f and f.is_file()),
                       None)
    config = _read_yaml(config_file) if config_file else None
    task = task or _read_json(model_dir / "task.json") or _task_of(config or {})
    facts = CardFacts(name=name, config=config, task=task, launched=launched, license=license,
                      language=list(language), source=source, trained_with=__version__ if in_run else None)
    if run is None:
        return facts
    records, last = _metrics_records(run / "metrics.jsonl")
    step = _model_step(model_dir, run, config or {}, final)
    if last:
        held = f"; this folder holds the weights of step {step}" if step is not None and step != last["step"] else ""
        facts.trained = f"{last['step']} optimizer steps on {last['samples']:,} training samples{held}"
    results = _read_json(run / "eval_results.json") if final else None
    if results is not None and config_file is not None and \
            (run / "eval_results.json").stat().st_mtime >= config_file.stat().st_mtime:
        facts.evaluations = _final_evaluations(results, config or {})
        facts.evaluated = "after training, on this model (the run's eval_results.json)"
    else:
        # a final/ without a step holds the last weights, evaluated after the last step; another folder (a copy
        # beside the run's) is not known to hold any evaluated step
        record = records.get(step) if step is not None else (records[max(records)] if final and records else None)
        if record is not None:
            facts.evaluations = _record_evaluations(record, task, config or {})
            facts.evaluated = f"while training, at step {record['step']} (the run's metrics.jsonl)"
    return facts


def _task_of(config: dict[str, Any]) -> dict[str, Any] | None:
    """What task.json would say of a fine-tuning run's task, from its config (a step-N folder has no task.json)."""
    data = _section(config, "data")
    if "task" in data:
        return {"task": data["task"]}
    if "train_file" in data:
        return {"task": "squad", "version_2_with_negative": bool(data.get("version_2_with_negative"))}
    return None


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _read_yaml(path: Path) -> dict[str, Any] | None:
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        return None
    return data if isinstance(data, dict) else None


def _metrics_records(path: Path) -> tuple[dict[int, dict[str, Any]], dict[str, Any] | None]:
    """({step: its evaluation record}, the last training record) of a metrics.jsonl. A resumed run repeats the
    steps after its checkpoint: the later line wins."""
    evals: dict[int, dict[str, Any]] = {}
    last = None
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError:
        return evals, None
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # a line cut by a kill
        if not isinstance(rec, dict) or not isinstance(rec.get("step"), int):
            continue
        if rec.get("event") == "eval" and isinstance(rec.get("metrics"), dict):
            evals[rec["step"]] = rec
        elif "samples" in rec and (last is None or rec["step"] >= last["step"]):
            last = rec
    return evals, last


def _model_step(model_dir: Path, run: Path, config: dict[str, Any], final: bool) -> int | None:
    """The training step whose weights `model_dir` holds; None: the last one."""
    m = _STEP_DIR.fullmatch(model_dir.name)
    if m:
        return int(m.group(1))
    best = _read_json(run / "best" / "best.json")
    if model_dir.name == "best" and not final:
        return (_read_json(model_dir / "best.json") or {}).get("step")
    if final and _section(config, "eval").get("final") == "best" and best is not None:
        return best.get("step")
    return None


def _final_evaluations(results: dict[str, Any], config: dict[str, Any]) -> list[Evaluation]:
    """The evaluations of fine-tuning's eval_results.json: SQuAD's official metrics, or each GLUE dev split."""
    if results.get("task") == "squad":
        metrics = {k: results[k] for k in SQUAD_METRICS if isinstance(results.get(k), (int, float))}
        return [_squad(metrics, str(results.get("version", "")), config)]
    splits = {k: v for k, v in results.items() if isinstance(v, dict) and "examples" in v}
    return [_glue(str(results.get("task", "")), split, {k: v for k, v in values.items() if k != "examples"},
                  config, values["examples"]) for split, values in splits.items()]


def _record_evaluations(record: dict[str, Any], task: dict[str, Any] | None,
                        config: dict[str, Any]) -> list[Evaluation]:
    """The evaluation of one metrics.jsonl record: the dev set of a fine-tuning task (the first split), or the
    held-out documents of pretraining."""
    metrics = {k: v for k, v in record["metrics"].items() if isinstance(v, (int, float))}
    if task is None:
        return [Evaluation("held-out documents of the pretraining corpus (never trained on)", metrics)]
    if task.get("task") == "squad":
        return [_squad({k: v for k, v in metrics.items() if k in SQUAD_METRICS},
                       "2.0" if task.get("version_2_with_negative") else "1.1", config)]
    name = str(task.get("task", ""))
    return [_glue(name, "mnli-m" if name == "mnli" else "dev", metrics, config)]  # the first dev split


def _squad(metrics: dict[str, float], version: str, config: dict[str, Any]) -> Evaluation:
    data = _section(config, "data")
    where = f"{data['dev_file']}" if data.get("dev_file") else "the dev file"
    if data.get("dev_articles"):
        where += f", articles {data['dev_articles']} only"
    return Evaluation(f"SQuAD v{version} dev ({where})", metrics, "question-answering", SQUAD.get(version),
                      None, "validation")


def _glue(task: str, split: str, metrics: dict[str, float], config: dict[str, Any],
          examples: int | None = None) -> Evaluation:
    data = _section(config, "data")
    where = f"{data['data_dir']}, split {split}" if data.get("data_dir") else f"split {split}"
    if examples is not None:
        where += f", {examples:,} examples"
    if task in GLUE:
        return Evaluation(f"GLUE {task.upper()} dev ({where})", metrics, "text-classification", "nyu-mll/glue",
                          task, GLUE_SPLITS.get(split, split))
    return Evaluation(f"{task} dev ({where})", metrics)


# ----------------------------------------------------------------------------------------------- the card

def render(facts: CardFacts, model: BertPreTrainedModel) -> str:
    """README.md for `model`: YAML metadata, then what it is, its evaluation, its training and how to use it."""
    cls = type(model).__name__
    pipeline, auto = PIPELINES.get(cls, PIPELINES["BertModel"])
    meta: dict[str, Any] = {}
    if facts.language:
        meta["language"] = list(facts.language)
    meta["license"] = facts.license or "other"
    meta["library_name"] = "transformers"
    meta["pipeline_tag"] = pipeline
    task_name = (facts.task or {}).get("task")
    meta["tags"] = [TAG, "bert", *([task_name] if task_name else [])]
    if facts.base_model:
        meta["base_model"] = facts.base_model
    datasets = list(dict.fromkeys(e.dataset_type for e in facts.evaluations if e.dataset_type))
    if datasets:
        meta["datasets"] = datasets
    indexed = [e for e in facts.evaluations if e.dataset_type and e.task_type]
    if indexed:
        meta["model-index"] = [{"name": facts.name, "results": [_index_entry(e) for e in indexed]}]
    front = yaml.safe_dump(meta, sort_keys=False, allow_unicode=True)
    parts = [f"---\n{front}---\n", f"# {facts.name}\n", _summary(facts, model) + "\n"]
    if facts.evaluations:
        parts.append(_evaluation_section(facts))
    parts.append(_training_section(facts))
    parts.append(_use_section(auto))
    start = facts.init or facts.source
    parts.append(license_section(facts.license, facts.language, start, facts.base_model or start))
    return "\n".join(parts)


def _index_entry(e: Evaluation) -> dict[str, Any]:
    dataset: dict[str, Any] = {"name": e.title, "type": e.dataset_type}
    if e.dataset_config:
        dataset["config"] = e.dataset_config
    if e.split:
        dataset["split"] = e.split
    metrics = [{"type": METRIC_TYPES[k], "value": float(v), "name": k} for k, v in e.metrics.items()
               if k in METRIC_TYPES]
    return {"task": {"type": e.task_type, "name": TASK_NAMES.get(e.task_type, e.task_type)}, "dataset": dataset,
            "metrics": metrics}


def _summary(facts: CardFacts, model: BertPreTrainedModel) -> str:
    c = model.config
    params = sum(t.numel() for t in to_hf_state_dict(model).values())
    tok = json.loads(model.tokenizer_files.get("tokenizer_config.json", b"{}") or b"{}") \
        if getattr(model, "tokenizer_files", None) else {}
    casing = {True: "uncased ", False: "cased "}.get(tok.get("do_lower_case"), "")
    task = facts.task or {}
    if task.get("task") == "squad":
        version = "2.0" if task.get("version_2_with_negative") else "1.1"
        what = f"fine-tuned for extractive question answering on SQuAD v{version}"
    elif task.get("task"):
        name = f"GLUE {task['task'].upper()}" if task["task"] in GLUE else task["task"]
        what = f"fine-tuned for {task['kind']} on {name}" if task.get("kind") else f"fine-tuned on {name}"
        if task.get("labels"):
            what += f" (labels: {', '.join(map(str, task['labels']))})"
    elif facts.config and "sample" in facts.config:
        nsp = _section(facts.config, "sample").get("next_sentence", True)
        what = "pretrained with masked language modelling" + (" and next sentence prediction" if nsp else "")
    elif facts.config:
        what = "trained by bertrain"
    else:
        what = f"exported from `{facts.source}`" if facts.source else "exported"
        what += f" by bertrain {__version__} (no bertrain training record was found beside it)"
    init = facts.init
    start = ""
    if init:
        start = f", starting from [{facts.base_model}](https://huggingface.co/{facts.base_model})" \
            if facts.base_model else f", starting from the local model `{init}`"
    if facts.trained_with:
        start += f", trained with bertrain {facts.trained_with}"
    return (f"A BERT model {what}{start}.\n\n"
            f"`{type(model).__name__}`: {c.num_hidden_layers} layers, hidden size {c.hidden_size}, "
            f"{c.num_attention_heads} attention heads, feed-forward size {c.intermediate_size}, "
            f"{c.max_position_embeddings} positions, {params:,} parameters; {casing}WordPiece vocabulary of "
            f"{c.vocab_size:,} tokens.")


def _fmt(v: Any) -> str:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return str(v)
    return f"{v:,}" if isinstance(v, int) else f"{v:.4g}"


def _evaluation_section(facts: CardFacts) -> str:
    out = ["## Evaluation\n", f"Evaluated by bertrain {facts.evaluated}.\n"]
    for e in facts.evaluations:
        out.append(f"**{e.title}**\n\n| metric | value |\n|---|---|")
        out += [f"| {k} | {_fmt(v)} |" for k, v in e.metrics.items()]
        out.append("")
    return "\n".join(out)


def _training_section(facts: CardFacts) -> str:
    out = ["## Training\n"]
    if facts.config is None:
        out.append("No training record: the folder was exported without the config.yaml of a bertrain run beside "
                   "it.\n")
        return "\n".join(out)
    if facts.trained:
        out.append(f"The run trained {facts.trained}.\n")
    flat = flatten(facts.config)
    if flat.get("train.steps"):
        flat.pop("train.epochs", None)  # steps win over epochs
    rows = [(k, flat[k]) for k in SETTINGS if k in flat and _shown(flat[k])]
    if rows:
        out.append("| setting | value |\n|---|---|")
        out += [f"| `{k}` | {_cell(v)} |" for k, v in rows]
        out.append("")
    if facts.launched:
        out.append(f"Command: `{facts.launched}`\n")
    if facts.command:
        version = f"bertrain {facts.trained_with}" if facts.trained_with else \
            f"the bertrain version that trained it (not recorded; bertrain {__version__} wrote this card)"
        out.append(f"Run it again: save the configuration below as config.yaml and run `{facts.command}` with "
                   f"{version}.\n")
    config = yaml.safe_dump(facts.config, sort_keys=False, allow_unicode=True)
    out.append(f"<details>\n<summary>config.yaml (the run's resolved configuration)</summary>\n\n```yaml\n{config}```"
               "\n\n</details>\n")
    return "\n".join(out)


def _shown(v: Any) -> bool:
    """A setting worth a row: given (not None, empty or 0, which mean 'none' or 'derived'); booleans always."""
    return isinstance(v, bool) or v not in (None, "", [], 0)


def _cell(v: Any) -> str:
    text = ", ".join(map(str, v)) if isinstance(v, list) else _fmt(v)
    return text.replace("|", "\\|")


def _use_section(auto: str) -> str:
    return ("## Use\n\n```python\n"
            f"from transformers import AutoTokenizer, {auto}\n\n"
            'path = "path/to/this/folder"  # or its Hub id once uploaded\n'
            "tokenizer = AutoTokenizer.from_pretrained(path)\n"
            f"model = {auto}.from_pretrained(path)\n```\n\n"
            "With bertrain: `from_pretrained(path)` of its model classes, `bertrain finetune ... --init path`, "
            "`bertrain export path OUT --format onnx`.\n")


def license_section(license: str | None, language: list[str], start: str | None, shown: str | None = None) -> str:
    """The card's last section: the license and language as given, or what to set before publishing (with the
    license that the starting model `start`, a folder or a Hub id, declares in its card, if at hand)."""
    out = [f"{LICENSE_HEADING}\n"]
    if license:
        out.append(f"License: `{license}`, as given to `bertrain export --license`.")
    else:
        out.append("The license is not set: `license: other` above is a placeholder, not a choice. bertrain does not "
                   "pick a license for your model, which may be bound by the licenses of the starting model and of "
                   "the training data. Set `license:` to a Hub license id (e.g. apache-2.0, mit, cc-by-4.0) before "
                   "publishing, or export again with `bertrain export FOLDER OUT --license ID`.")
        declared = _declared_license(start)
        if declared:
            out.append(f"\nThe model this one comes from, {shown or start}, declares `license: {declared}` in its "
                       "card.")
    if language:
        out.append(f"\nLanguage: {', '.join(language)}.")
    else:
        out.append("\nThe language is not recorded: add `language:` (an ISO 639-1 code such as en) to the metadata, "
                   "or export with `--language CODE`.")
    return "\n".join(out) + "\n"


def _declared_license(start: str | None) -> str | None:
    """The license that the card of the model this one comes from declares (a folder or the HF cache), if any."""
    if not start:
        return None
    try:
        folder = resolve_model_dir(start)
    except ValueError:
        return None
    meta = read_metadata(folder / README)
    value = meta.get("license") if meta else None
    return str(value) if value and value != "other" else None


# ----------------------------------------------------------------------------------------------- files

def read_metadata(path: str | os.PathLike) -> dict[str, Any] | None:
    """The YAML metadata of a README.md (None: no file, or no metadata block)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError:
        return None
    m = re.match(r"---\n(.*?\n)---\n", text, re.S)
    if m is None:
        return None
    try:
        data = yaml.safe_load(m.group(1))
    except yaml.YAMLError:
        return None
    return data if isinstance(data, dict) else None


def is_bertrain_card(path: str | os.PathLike) -> bool:
    meta = read_metadata(path)
    return bool(meta) and TAG in (meta.get("tags") or [])


def relicense(text: str, license: str | None, language: list[str]) -> str:
    """A bertrain card with its license and/or language set (`bertrain export --license/--language` of a folder
    that has one): the metadata and the last section change, the rest is kept as it was (edits included)."""
    m = re.match(r"---\n(.*?\n)---\n", text, re.S)
    if m is None:
        raise ValueError("not a model card with YAML metadata")
    meta = yaml.safe_load(m.group(1)) or {}
    if license:
        meta["license"] = license
    if language:
        meta = {"language": list(language), **{k: v for k, v in meta.items() if k != "language"}}
    body = text[m.end():]
    cut = body.find(f"\n{LICENSE_HEADING}\n")
    body = body[:cut + 1] if cut >= 0 else body + "\n"
    given = meta.get("license") if meta.get("license") != "other" else None
    languages = meta.get("language") or []
    languages = [languages] if isinstance(languages, str) else list(languages)
    front = yaml.safe_dump(meta, sort_keys=False, allow_unicode=True)
    return f"---\n{front}---\n{body}{license_section(given, languages, meta.get('base_model'))}"


def write_card(folder: str | os.PathLike, text: str) -> Path:
    """README.md into `folder`, atomically."""
    path = Path(folder) / README
    atomic_write_text(path, text)
    return path
