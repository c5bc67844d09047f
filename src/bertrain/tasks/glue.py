"""GLUE: the nine tasks' layouts (TSV, the Hub's Parquet, `datasets` folders), label sets, features and the
GLUE-server submission format.

`read_split` reads a task folder in any of three layouts, detected from what is in it (`glue_layout`):

* the GLUE distribution's TSV files (`train.tsv`, `dev.tsv`, `test.tsv`; MNLI's `dev_matched.tsv`, ...). Column
  indices are those of the GLUE distribution (and of HF's `glue` processors). Files are read as UTF-8 with an
  optional byte-order mark (MRPC's train/dev start with one) and with `csv.QUOTE_NONE`: GLUE sentences contain
  unbalanced double quotes that a quoting reader would merge across lines.
* the Hugging Face Hub's Parquet files (nyu-mll/glue: `<task>/{train,validation,test}-*.parquet`, MNLI's
  `validation_matched`, `validation_mismatched`, `test_matched`, `test_mismatched`), columns as `HUB_COLUMNS`
  names them plus `label` (a class id, -1 in test splits) and `idx`;
* a `datasets` folder (`DatasetDict.save_to_disk`) with those splits and columns.

The data folder may also be the folder above the task's (the Hub repository, or the GLUE root with `MRPC/`). Class
ids are mapped to the TSV label strings (`HubColumns.tsv_labels`) that the metrics, the dev predictions and the
GLUE-server submission files use, so every layout gives the same examples; where a file names its ClassLabel
classes they are checked against the Hub's. Parquet and Arrow are read through `bertrain.data.tables` (pyarrow,
from the `data` extra, imported only then).
"""
from __future__ import annotations

import csv
import logging
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bertrain.data.tables import Table, dataset_splits, hub_split_files, hub_splits, split_files
from bertrain.tasks.common import TaskTokenizer
from bertrain.utils.io import atomic_write_text

log = logging.getLogger(__name__)

csv.field_size_limit(sys.maxsize)  # some QQP/MNLI fields are long; the default 128 KiB limit is arbitrary


@dataclass(frozen=True)
class Layout:
    """Where a split's fields live: column indices (None = absent) and whether the file has a header line."""

    text_a: int
    text_b: int | None
    label: int | None
    index: int | None
    header: bool = True


@dataclass(frozen=True)
class GlueTask:
    name: str
    labels: tuple[str, ...] | None  # None: regression (STS-B)
    train: Layout
    dev: Layout
    test: Layout
    dev_files: tuple[tuple[str, str], ...] = (("dev", "dev.tsv"),)  # (eval split name, file name)
    test_files: tuple[tuple[str, str], ...] = (("test", "test.tsv"),)
    submission: tuple[str, ...] = ()  # GLUE server file names, one per test file
    folder: str = ""  # the task's folder name in the GLUE distribution
    # Rows whose sentence is empty are kept (with one warning per file) instead of refused. Only QQP: GLUE's own
    # QQP train.tsv (and the Hub's train split) holds two pairs whose question2 is empty (huggingface/datasets#277),
    # which transformers' QqpProcessor and `datasets` keep as ""; elsewhere an empty sentence means a misread file.
    empty_text_ok: bool = False

    @property
    def num_labels(self) -> int:
        return 1 if self.labels is None else len(self.labels)

    @property
    def is_regression(self) -> bool:
        return self.labels is None


_PAIR_IDX = Layout(text_a=1, text_b=2, label=-1, index=0)
_PAIR_IDX_TEST = Layout(text_a=1, text_b=2, label=None, index=0)

TASKS: dict[str, GlueTask] = {
    "cola": GlueTask("cola", ("0", "1"),
                     train=Layout(3, None, 1, None, header=False), dev=Layout(3, None, 1, None, header=False),
                     test=Layout(1, None, None, 0), submission=("CoLA.tsv",), folder="CoLA"),
    "sst2": GlueTask("sst2", ("0", "1"), train=Layout(0, None, 1, None), dev=Layout(0, None, 1, None),
                     test=Layout(1, None, None, 0), submission=("SST-2.tsv",), folder="SST-2"),
    "mrpc": GlueTask("mrpc", ("0", "1"), train=Layout(3, 4, 0, None), dev=Layout(3, 4, 0, None),
                     test=Layout(3, 4, None, 0), submission=("MRPC.tsv",), folder="MRPC"),
    "stsb": GlueTask("stsb", None, train=Layout(7, 8, -1, 0), dev=Layout(7, 8, -1, 0),
                     test=Layout(7, 8, None, 0), submission=("STS-B.tsv",), folder="STS-B"),
    "qqp": GlueTask("qqp", ("0", "1"), train=Layout(3, 4, 5, 0), dev=Layout(3, 4, 5, 0),
                    test=Layout(1, 2, None, 0), submission=("QQP.tsv",), folder="QQP", empty_text_ok=True),
    "mnli": GlueTask("mnli", ("contradiction", "entailment", "neutral"),
                     train=Layout(8, 9, -1, 0), dev=Layout(8, 9, -1, 0), test=Layout(8, 9, None, 0),
                     dev_files=(("mnli-m", "dev_matched.tsv"), ("mnli-mm", "dev_mismatched.tsv")),
                     test_files=(("mnli-m", "test_matched.tsv"), ("mnli-mm", "test_mismatched.tsv")),
                     submission=("MNLI-m.tsv", "MNLI-mm.tsv"), folder="MNLI"),
    "qnli": GlueTask("qnli", ("entailment", "not_entailment"), train=_PAIR_IDX, dev=_PAIR_IDX,
                     test=_PAIR_IDX_TEST, submission=("QNLI.tsv",), folder="QNLI"),
    "rte": GlueTask("rte", ("entailment", "not_entailment"), train=_PAIR_IDX, dev=_PAIR_IDX,
                    test=_PAIR_IDX_TEST, submission=("RTE.tsv",), folder="RTE"),
    "wnli": GlueTask("wnli", ("0", "1"), train=_PAIR_IDX, dev=_PAIR_IDX, test=_PAIR_IDX_TEST,
                     submission=("WNLI.tsv",), folder="WNLI"),
}

# The header names of GLUE's TSV files for the columns each task reads (text_a, text_b, label, index), as the
# GLUE distribution writes them; `check_header` compares a file's header line with them.
HEADER_NAMES: dict[str, tuple[str, str | None, str | None, str]] = {
    "cola": ("sentence", None, None, "index"),  # train/dev have no header line; the test file has one
    "sst2": ("sentence", None, "label", "index"),
    "mrpc": ("#1 string", "#2 string", "quality", "index"),
    "stsb": ("sentence1", "sentence2", "score", "index"),
    "qqp": ("question1", "question2", "is_duplicate", "id"),
    "mnli": ("sentence1", "sentence2", "gold_label", "index"),
    "qnli": ("question", "sentence", "label", "index"),
    "rte": ("sentence1", "sentence2", "label", "index"),
    "wnli": ("sentence1", "sentence2", "label", "index"),
}


def check_header(header: list[str], task: GlueTask, layout: Layout, path: Path) -> None:
    """Refuse a header that names a column this task reads at another position (columns reordered: the texts or
    the labels would be read from the wrong fields, silently); a header with other names is read by position,
    with one warning."""
    names = HEADER_NAMES.get(task.name)
    if names is None:
        return  # a task registered beside GLUE's: no known header
    seen = [h.strip().lower() for h in header]
    unnamed = []
    for field, col, name in zip(("text_a", "text_b", "label", "index"),
                                (layout.text_a, layout.text_b, layout.label, layout.index), names):
        if col is None or name is None:
            continue
        at = col if col >= 0 else len(seen) + col
        if 0 <= at < len(seen) and seen[at] == name:
            continue
        if name in seen:
            found = header[at].strip() if 0 <= at < len(header) else "absent"
            raise ValueError(f"{path}:1: the header has {name!r} in column {seen.index(name) + 1}, but {task.name} "
                             f"reads its {field} from column {at + 1} ({found!r}), "
                             "as GLUE's files lay them out: put the columns in GLUE's order")
        unnamed.append(name)
    if unnamed:
        log.warning("%s: the header does not name GLUE's %s columns (%s); reading them by position", path,
                    task.name, ", ".join(repr(n) for n in unnamed))


def get_task(name: str) -> GlueTask:
    key = name.lower().replace("-", "").replace("_", "")
    if key not in TASKS:
        raise ValueError(f"unknown GLUE task {name!r}; known: {', '.join(TASKS)}")
    return TASKS[key]


@dataclass
class GlueExample:
    guid: str  # "<file>:<line>" — where the example came from, for error messages
    text_a: str
    text_b: str | None
    label: str | float | None  # label string (classification), float (STS-B), None (test)
    index: str  # the id the GLUE server expects in the submission file


def read_glue_tsv(path: str | os.PathLike, task: GlueTask, layout: Layout) -> list[GlueExample]:
    """Read one GLUE TSV split; a short row, an empty sentence (except QQP's: `empty_text_ok`) or a label outside
    the task's set is a `ValueError` naming the file and the 1-based line."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{task.name}: data file {path} does not exist")
    cols = [i for i in (layout.text_a, layout.text_b, layout.label, layout.index) if i is not None]
    # A negative index (the label as the last column) must not fall on a text column of a short row.
    need = max(i for i in cols if i >= 0) + 1 + any(i < 0 for i in cols)
    examples: list[GlueExample] = []
    empty: list[str] = []  # where a kept row has an empty sentence (tasks with `empty_text_ok`)
    try:
        with open(path, encoding="utf-8-sig", newline="") as f:
            for lineno, row in enumerate(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE), start=1):
                if lineno == 1 and layout.header:
                    check_header(row, task, layout, path)
                    continue
                if not row or row == [""]:
                    continue  # blank line (e.g. a trailing newline pair)
                where = f"{path}:{lineno}"
                if len(row) < need:
                    raise ValueError(f"{where}: {len(row)} tab-separated fields, {task.name} needs at least {need}")
                text_a = row[layout.text_a]
                text_b = row[layout.text_b] if layout.text_b is not None else None
                if not text_a.strip() or (text_b is not None and not text_b.strip()):
                    if not task.empty_text_ok:
                        raise ValueError(f"{where}: empty sentence")
                    empty.append(where)
                label: str | float | None = None
                if layout.label is not None:
                    raw = row[layout.label].strip()
                    if task.is_regression:
                        try:
                            label = float(raw)
                        except ValueError:
                            raise ValueError(f"{where}: {task.name} label {raw!r} is not a number") from None
                        if not math.isfinite(label):  # float() takes 'nan' and 'inf': the loss would be NaN
                            raise ValueError(f"{where}: {task.name} label {raw!r} is not a finite number")
                    else:
                        if raw not in task.labels:  # type: ignore[operator]
                            raise ValueError(f"{where}: label {raw!r} is not one of {task.name}'s labels "
                                             f"{list(task.labels)}")  # type: ignore[arg-type]
                        label = raw
                index = row[layout.index] if layout.index is not None else str(len(examples))
                examples.append(GlueExample(where, text_a, text_b, label, index))
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({e})") from None
    except csv.Error as e:
        raise ValueError(f"{path}: malformed TSV: {e}") from None
    if not examples:
        raise ValueError(f"{path}: no examples")
    _warn_empty(task, path, empty, len(examples))
    return examples


def _warn_empty(task: GlueTask, path: object, empty: list[str], total: int) -> None:
    if empty:
        log.warning("%s: %d of %d %s rows have an empty sentence (first: %s); kept, as transformers and datasets "
                    "keep them", path, len(empty), total, task.name, empty[0])


# ----------------------------------------------------------------------------------------------- the Hub's layout

@dataclass(frozen=True)
class HubColumns:
    """A task in the Hub's GLUE (nyu-mll/glue): its text columns, and per class id its ClassLabel name there and
    the TSV label it stands for (None: regression, a float label)."""

    text_a: str
    text_b: str | None
    class_names: tuple[str, ...] | None
    tsv_labels: tuple[str, ...] | None


HUB_COLUMNS: dict[str, HubColumns] = {
    "cola": HubColumns("sentence", None, ("unacceptable", "acceptable"), ("0", "1")),
    "sst2": HubColumns("sentence", None, ("negative", "positive"), ("0", "1")),
    "mrpc": HubColumns("sentence1", "sentence2", ("not_equivalent", "equivalent"), ("0", "1")),
    "stsb": HubColumns("sentence1", "sentence2", None, None),
    "qqp": HubColumns("question1", "question2", ("not_duplicate", "duplicate"), ("0", "1")),
    "mnli": HubColumns("premise", "hypothesis", ("entailment", "neutral", "contradiction"),
                       ("entailment", "neutral", "contradiction")),
    "qnli": HubColumns("question", "sentence", ("entailment", "not_entailment"), ("entailment", "not_entailment")),
    "rte": HubColumns("sentence1", "sentence2", ("entailment", "not_entailment"), ("entailment", "not_entailment")),
    "wnli": HubColumns("sentence1", "sentence2", ("not_entailment", "entailment"), ("0", "1")),
}

# The Hub's split for each file of the GLUE distribution.
HUB_SPLITS = {"train.tsv": "train", "dev.tsv": "validation", "test.tsv": "test",
              "dev_matched.tsv": "validation_matched", "dev_mismatched.tsv": "validation_mismatched",
              "test_matched.tsv": "test_matched", "test_mismatched.tsv": "test_mismatched"}


def _split_files(task: GlueTask, split: str) -> list[tuple[str, str, Layout]]:
    """[(split name, TSV file name, TSV layout)] of 'train', 'dev' or 'test'."""
    if split == "train":
        return [("train", "train.tsv", task.train)]
    if split == "dev":
        return [(name, fn, task.dev) for name, fn in task.dev_files]
    if split == "test":
        return [(name, fn, task.test) for name, fn in task.test_files]
    raise ValueError(f"unknown split {split!r}")


def glue_layout(data_dir: str | os.PathLike, task: GlueTask) -> tuple[str, Path]:
    """("tsv" | "parquet" | "datasets", the task's folder): the layout of `data_dir`, or of its sub-folder named
    after the task (the Hub's `mrpc/`, GLUE's `MRPC/`). A folder with none of them is read as TSV (whose reader
    says which file is missing)."""
    data_dir = Path(data_dir)
    tsv = [fn for _, fn, _ in _split_files(task, "train") + _split_files(task, "dev") + _split_files(task, "test")]
    for d in (data_dir, data_dir / task.name, data_dir / task.folder):
        if not d.is_dir():
            continue
        if any((d / fn).is_file() for fn in tsv):
            return "tsv", d
        if dataset_splits(d) is not None:
            return "datasets", d
        if any(p.is_file() for p in d.glob("*.parquet")):
            return "parquet", d
    return "tsv", data_dir


def has_split(data_dir: str | os.PathLike, task: GlueTask, split: str) -> bool:
    """Whether `data_dir` holds every file of `split` ('train', 'dev', 'test') in its layout."""
    layout, d = glue_layout(data_dir, task)
    hub = [HUB_SPLITS[fn] for _, fn, _ in _split_files(task, split)]
    if layout == "tsv":
        return all((d / fn).is_file() for _, fn, _ in _split_files(task, split))
    if layout == "datasets":
        return all(s in (dataset_splits(d) or []) for s in hub)
    return all(hub_split_files(d, s) for s in hub)


def read_split(data_dir: str | os.PathLike, task: GlueTask, split: str,
               scored: bool = False) -> list[tuple[str, list[GlueExample]]]:
    """[(split name, examples)] for 'train', 'dev' (two for MNLI: matched and mismatched) or 'test', from the
    layout `glue_layout` finds in `data_dir`: the same examples from each layout of the same rows. `scored`: the
    split is to be scored by the task's metrics (`check_scorable`)."""
    layout, d = glue_layout(data_dir, task)
    out = []
    for name, fn, tsv_layout in _split_files(task, split):
        hub = HUB_SPLITS[fn]
        if layout == "tsv":
            if not (d / fn).is_file():
                raise ValueError(f"{task.name}: data file {d / fn} does not exist (nor the Hub's layout in {d}: "
                                 f"{hub}-*.parquet files or a `datasets` folder with a {hub!r} split)")
            out.append((name, check_scorable(read_glue_tsv(d / fn, task, tsv_layout), task, scored, d / fn)))
            continue
        if layout == "datasets":
            files, fmt = split_files(d, hub), "arrow"
        else:
            files, fmt = hub_split_files(d, hub), "parquet"
            if not files:
                raise ValueError(f"{task.name}: {d} has no {hub}-*.parquet file (the Hub's {split} split); its "
                                 f"Parquet files are of the splits {', '.join(hub_splits(d))}")
        examples = read_glue_table(files, fmt, task, labelled=tsv_layout.label is not None)
        out.append((name, check_scorable(examples, task, scored, ", ".join(map(str, files)))))
    return out


def check_scorable(examples: list[GlueExample], task: GlueTask, scored: bool, where: object) -> list[GlueExample]:
    """`examples`, refused where a split to be `scored` cannot be: STS-B's Pearson and Spearman correlations need
    two examples (scipy's error on one named neither the file nor the task, and came after the training)."""
    if scored and task.is_regression and len(examples) < 2:
        raise ValueError(f"{where}: {len(examples)} example to score; {task.name}'s Pearson and Spearman "
                         "correlations need at least 2: give the whole dev split")
    return examples


def read_glue_table(files: list[Path], fmt: str, task: GlueTask, labelled: bool) -> list[GlueExample]:
    """The examples of one split in the Hub's columns (`HUB_COLUMNS`, `label`, `idx`), from Parquet or Arrow
    files in order. A missing column or another type is a `ValueError` naming the file, the column and what was
    expected; a bad row (an empty sentence, a class id out of range, -1 where labels are needed) names the file
    and the row. Test splits (`labelled` False) ignore their label column (-1 on the Hub)."""
    cols = HUB_COLUMNS[task.name]
    texts = [c for c in (cols.text_a, cols.text_b) if c is not None]
    examples: list[GlueExample] = []
    empty: list[str] = []  # where a kept row has an empty sentence (tasks with `empty_text_ok`)
    for path in files:
        with Table(path, fmt) as t:
            for c in texts:
                t.column(c, "string", hint=f"the Hub's {task.name} has {', '.join(texts)}, label, idx")
            want = list(texts)
            if labelled:
                t.column("label", "number" if task.is_regression else "label")
                names = t.class_names("label")
                if names is not None and cols.class_names is not None and tuple(names) != cols.class_names:
                    raise ValueError(f"{path}: column 'label' has the classes {names}, expected {task.name}'s "
                                     f"{list(cols.class_names)} (in this order)")
                want.append("label")
            has_idx = t.has("idx")
            if has_idx:
                t.column("idx", "integer")
                want.append("idx")
            float32 = labelled and task.is_regression and str(t.schema.field("label").type) in ("float", "halffloat")
            data = t.read(want)
        for row in range(len(data[cols.text_a])):
            where = f"{path}: row {row}"
            text_a = data[cols.text_a][row]
            text_b = data[cols.text_b][row] if cols.text_b is not None else None
            if not text_a or not text_a.strip() or (cols.text_b is not None and (not text_b or not text_b.strip())):
                if not task.empty_text_ok:
                    raise ValueError(f"{where}: empty sentence")
                empty.append(where)
                text_a, text_b = text_a or "", (text_b or "") if cols.text_b is not None else None
            label = _hub_label(task, data["label"][row], where, float32) if labelled else None
            if has_idx and data["idx"][row] is None:
                raise ValueError(f"{where}: column 'idx' is empty, expected the example's id")
            index = str(data["idx"][row]) if has_idx else str(len(examples))
            examples.append(GlueExample(where, text_a, text_b, label, index))
    if not examples:
        raise ValueError(f"{', '.join(map(str, files))}: no examples")
    _warn_empty(task, ", ".join(map(str, files)), empty, len(examples))
    return examples


def _hub_label(task: GlueTask, value: object, where: str, float32: bool) -> str | float:
    """A label of the Hub's columns as the TSV reader gives it: the TSV label string of a class id (or a TSV label
    string itself), a float for STS-B (a float32 read as the decimal it was written as, as the TSV has it)."""
    cols = HUB_COLUMNS[task.name]
    if task.is_regression:
        if value is None or value != value:  # None or NaN
            raise ValueError(f"{where}: column 'label' is empty, expected a similarity score")
        if not math.isfinite(float(value)):  # type: ignore[arg-type]
            raise ValueError(f"{where}: column 'label' is {value!r}, expected a finite similarity score")
        return float(str(np.float32(value))) if float32 else float(value)  # type: ignore[arg-type]
    assert cols.tsv_labels is not None
    if isinstance(value, str):
        if value not in task.labels:  # type: ignore[operator]
            raise ValueError(f"{where}: column 'label' is {value!r}, not one of {task.name}'s labels "
                             f"{list(task.labels)}")  # type: ignore[arg-type]
        return value
    if not isinstance(value, int) or not 0 <= value < len(cols.tsv_labels):
        raise ValueError(f"{where}: column 'label' is {value!r}, expected a class id 0..{len(cols.tsv_labels) - 1} "
                         f"({', '.join(f'{i} {n}' for i, n in enumerate(cols.class_names or ()))})"
                         + (" (-1 marks a test row without a label)" if value == -1 else ""))
    return cols.tsv_labels[value]


ENCODE_CHUNK = 8192
"""Examples tokenized per `encode_batch` call in `build_features`: a tokenizers Encoding holds ~18 KB at 128 tokens
(ids, offsets, token strings, masks), so encoding MNLI's 393k pairs at once held 7 GB for 1.2 GB of features."""


def build_features(examples: list[GlueExample], task: GlueTask, tok: TaskTokenizer,
                   max_seq_length: int) -> dict[str, np.ndarray]:
    """input_ids / token_type_ids / attention_mask (N, L) and labels (N,) — int64 ids, float32 for STS-B,
    -1 when the split has no labels. Pairs are truncated longest-first, as BERT's reference code does.

    Tokenized `ENCODE_CHUNK` examples at a time into the arrays: memory is the features' plus one chunk's."""
    n, L = len(examples), max_seq_length
    feats = {k: np.empty((n, L), dtype=np.int64) for k in ("input_ids", "token_type_ids", "attention_mask")}
    t = tok.tokenizer
    t.enable_truncation(max_length=max_seq_length, strategy="longest_first")
    t.enable_padding(length=max_seq_length, pad_id=tok.pad_id, pad_token="[PAD]")
    try:
        for s in range(0, n, ENCODE_CHUNK):
            chunk = examples[s:s + ENCODE_CHUNK]
            inputs = [(ex.text_a, ex.text_b) if ex.text_b is not None else ex.text_a for ex in chunk]
            encs = t.encode_batch(inputs, add_special_tokens=True)
            rows = slice(s, s + len(chunk))
            feats["input_ids"][rows] = [e.ids for e in encs]
            feats["token_type_ids"][rows] = [e.type_ids for e in encs]
            feats["attention_mask"][rows] = [e.attention_mask for e in encs]
            del encs
    finally:
        t.no_truncation()
        t.no_padding()
    if task.is_regression:
        feats["labels"] = np.asarray([ex.label if ex.label is not None else np.nan for ex in examples],
                                     dtype=np.float32)
    else:
        lab = {s: i for i, s in enumerate(task.labels)}  # type: ignore[arg-type]
        feats["labels"] = np.asarray([lab[ex.label] if ex.label is not None else -1 for ex in examples],
                                     dtype=np.int64)
    return feats


def label_strings(task: GlueTask, preds: np.ndarray) -> list[str]:
    """Model outputs (class ids, or scores for STS-B) as the strings the GLUE server expects."""
    if task.is_regression:
        # The server takes a similarity in [0, 5]; the regression head is unbounded.
        return [f"{min(max(float(p), 0.0), 5.0):.3f}" for p in preds]
    return [task.labels[int(p)] for p in preds]  # type: ignore[index]


def write_dev_predictions(path: str | os.PathLike, task: GlueTask, examples: list[GlueExample],
                          preds: np.ndarray) -> None:
    """`index<TAB>prediction<TAB>label<TAB>text_a[<TAB>text_b]` for each dev example (atomic write). STS-B's
    predictions are the scores the metrics saw, unclipped, to float32 precision: the submission's clipped 3-decimal
    strings gave a Pearson computed from this file far from eval_results.json's (0.17 against 0.08 where the
    scores were close together, as early in training)."""
    if len(examples) != len(preds):
        raise ValueError(f"{len(preds)} predictions for {len(examples)} dev examples")
    clean = lambda t: (t or "").replace("\t", " ").replace("\n", " ")  # noqa: E731 (keep the TSV one line each)
    lines = ["index\tprediction\tlabel\ttext_a\ttext_b"]
    shown = [f"{float(p):.9g}" for p in preds] if task.is_regression else label_strings(task, preds)
    for ex, s in zip(examples, shown):
        lines.append(f"{ex.index}\t{s}\t{ex.label}\t{clean(ex.text_a)}\t{clean(ex.text_b)}")
    atomic_write_text(path, "\n".join(lines) + "\n")


def write_submission(path: str | os.PathLike, task: GlueTask, examples: list[GlueExample],
                     preds: np.ndarray) -> None:
    """`index<TAB>prediction` lines under a header, the GLUE server's format (atomic write)."""
    if len(examples) != len(preds):
        raise ValueError(f"{len(preds)} predictions for {len(examples)} test examples")
    lines = ["index\tprediction"] + [f"{ex.index}\t{s}" for ex, s in zip(examples, label_strings(task, preds))]
    atomic_write_text(path, "\n".join(lines) + "\n")


# ----------------------------------------------------------------------------------------------- AX, model labels

DIAGNOSTIC_SUBMISSION = "AX.tsv"
"""The GLUE server's file for the diagnostic set (AX): the MNLI model's predictions, MNLI's label strings. The
server takes a submission only with all eleven files (CoLA ... WNLI.tsv, MNLI-m/-mm.tsv and AX.tsv)."""
_DIAGNOSTIC = Layout(text_a=1, text_b=2, label=None, index=0)  # diagnostic.tsv: index, sentence1, sentence2


def read_diagnostic(data_dir: str | os.PathLike) -> list[GlueExample] | None:
    """The GLUE diagnostic set (AX) for an MNLI data folder, or None where there is none: the GLUE distribution's
    `diagnostic/diagnostic.tsv` beside `MNLI/` (or in the folder itself), or the Hub's `ax/test-*.parquet` beside
    `mnli/` (nyu-mll/glue: premise, hypothesis, label -1, idx)."""
    data_dir = Path(data_dir)
    mnli = TASKS["mnli"]
    for d in (data_dir, data_dir / "diagnostic", data_dir.parent / "diagnostic"):
        if (d / "diagnostic.tsv").is_file():
            return read_glue_tsv(d / "diagnostic.tsv", mnli, _DIAGNOSTIC)
    for d in (data_dir / "ax", data_dir.parent / "ax"):
        if d.is_dir() and hub_split_files(d, "test"):
            return read_glue_table(hub_split_files(d, "test"), "parquet", mnli, labelled=False)
    return None


def model_label_ids(task: GlueTask, id2label: dict[int, str] | None) -> np.ndarray | None:
    """For a classifier whose config.json names its classes (id2label), the task's label id of each model class
    id (`ids[pred]`), where the model orders them otherwise than `task.labels`; None where the order is the same
    or the names say nothing (LABEL_0, ...). A model fine-tuned with transformers' run_glue.py on `datasets` has
    MNLI's classes as entailment, neutral, contradiction, run_classifier.py's as contradiction, entailment,
    neutral: the same class id means another class. Names are matched case-insensitively against the TSV labels
    and the Hub's ClassLabel names (SST-2's negative/positive ...); names of neither are a ValueError."""
    if task.is_regression or not id2label:
        return None
    names = [str(id2label[k]).strip().lower() for k in sorted(id2label)]
    if all(n.startswith("label_") and n[6:].isdigit() for n in names):
        return None
    assert task.labels is not None
    alias = {lab.lower(): j for j, lab in enumerate(task.labels)}
    hub = HUB_COLUMNS.get(task.name)
    if hub is not None and hub.class_names is not None and hub.tsv_labels is not None:
        alias.update({c.lower(): task.labels.index(t) for c, t in zip(hub.class_names, hub.tsv_labels)})
    ids = [alias.get(n) for n in names]
    if len(names) != task.num_labels or None in ids or len(set(ids)) != len(ids):
        raise ValueError(f"the model's id2label names the classes {[id2label[k] for k in sorted(id2label)]}, which "
                         f"are not {task.name}'s {list(task.labels)} in some order: fine-tune it on {task.name} "
                         "first, or give its config.json the task's label names")
    return None if ids == list(range(task.num_labels)) else np.asarray(ids, dtype=np.int64)
