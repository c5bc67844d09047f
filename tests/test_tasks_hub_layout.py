"""GLUE and SQuAD in the Hugging Face Hub's layouts (issue 24): Parquet files (GLUE's
`<task>/{train,validation,test}-*.parquet`, SQuAD's `id, title, context, question, answers`) and `datasets` folders
(`save_to_disk`), built here with `datasets` from the real MRPC, SST-2 and XQuAD files in ../shared/data (and
hand-made MNLI, STS-B and SQuAD v2.0 rows): the same examples, features, labels, submission files and official
metrics as from the TSV / JSON files of the same rows; the fine-tuning commands given the Hub's folders and files
end with the same predictions; a wrong or missing column is one error naming the file and the column."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

datasets = pytest.importorskip("datasets", reason="the data extra (pip install 'bertrain[data]') is not installed")
pytest.importorskip("pyarrow", reason="the data extra is not installed")

from bertrain.cli import main  # noqa: E402
from bertrain.tasks.common import load_task_tokenizer  # noqa: E402
from bertrain.tasks.glue import (HUB_COLUMNS, HUB_SPLITS, build_features, get_task, has_split, read_split,  # noqa: E402
                                 write_dev_predictions, write_submission)
from bertrain.tasks.metrics import evaluate_squad, glue_compute_metrics  # noqa: E402
from bertrain.tasks.squad import (SquadFeatureConfig, build_features as squad_features, load_dataset_json,  # noqa: E402
                                  load_or_build_features, read_squad, squad_layout)
from conftest import shared_file  # noqa: E402
from helpers import TINY, save_tiny_model, squad_v2_fixture, write_rte_like  # noqa: E402

Value, ClassLabel, Features = datasets.Value, datasets.ClassLabel, datasets.Features


@pytest.fixture(scope="module", autouse=True)
def quiet():
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def tiny_tok(tiny_model):
    return load_task_tokenizer(tiny_model)  # the test vocabulary, lower-cased


# ----------------------------------------------------------------------------------------------- GLUE

def hub_glue(tsv_dir: Path, task_name: str) -> dict[str, "datasets.Dataset"]:
    """The Hub's splits of a task, as nyu-mll/glue has them, built from the rows of its TSV files: the Hub's
    columns, the label a ClassLabel id (-1 in test splits), idx an int32."""
    task = get_task(task_name)
    cols = HUB_COLUMNS[task.name]
    feats = {cols.text_a: Value("string")}
    if cols.text_b:
        feats[cols.text_b] = Value("string")
    feats["label"] = ClassLabel(names=list(cols.class_names)) if cols.class_names else Value("float32")
    feats["idx"] = Value("int32")
    out = {}
    for split in ("train", "dev", "test"):
        files = {"train": [("train", "train.tsv")], "dev": [(n, f) for n, f in task.dev_files],
                 "test": [(n, f) for n, f in task.test_files]}[split]
        for (name, examples), (_, fn) in zip(read_split(tsv_dir, task, split), files):
            rows = {cols.text_a: [e.text_a for e in examples], "idx": [int(e.index) for e in examples],
                    "label": [-1 if e.label is None else cols.tsv_labels.index(e.label) if cols.tsv_labels
                              else e.label for e in examples]}
            if cols.text_b:
                rows[cols.text_b] = [e.text_b for e in examples]
            out[HUB_SPLITS[fn]] = datasets.Dataset.from_dict(rows, features=Features(feats))
    return out


def write_hub_parquet(splits: dict, folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, ds in splits.items():
        ds.to_parquet(str(folder / f"{name}-00000-of-00001.parquet"))
    return folder


def rows(splits):
    return [(name, [(e.text_a, e.text_b, e.label, e.index) for e in examples]) for name, examples in splits]


@pytest.mark.parametrize("task_name,folder", [("mrpc", "MRPC"), ("sst2", "SST-2")])
def test_real_glue_from_hub_parquet_and_datasets_folder_equals_tsv(task_name, folder, tmp_path, tiny_tok):
    tsv_dir = shared_file(f"glue/{folder}/train.tsv").parent
    task = get_task(task_name)
    splits = hub_glue(tsv_dir, task_name)
    root = tmp_path / "glue"
    write_hub_parquet(splits, root / task_name)  # the Hub repository: glue/<task>/...
    datasets.DatasetDict(splits).save_to_disk(str(tmp_path / "saved"))
    rng = np.random.default_rng(0)
    for split in ("train", "dev", "test"):
        want = read_split(tsv_dir, task, split)
        assert len(want[0][1]) == {"train": {"mrpc": 3667, "sst2": 67349}, "dev": {"mrpc": 408, "sst2": 872},
                                   "test": {"mrpc": 1725, "sst2": 1821}}[split][task_name]
        preds = rng.integers(0, 2, len(want[0][1]))
        fw = build_features(want[0][1], task, tiny_tok, 64) if split == "dev" else None
        for data_dir in (root / task_name, root, tmp_path / "saved"):
            got = read_split(data_dir, task, split)
            assert rows(got) == rows(want), (split, data_dir)  # texts, labels (TSV names), indices, in order
            assert has_split(data_dir, task, split)
            if data_dir == root:
                continue  # (the same files as root / task_name)
            if split == "dev":  # the same features and metrics, and the same dev predictions file
                fg = build_features(got[0][1], task, tiny_tok, 64)
                assert fw.keys() == fg.keys() and all(np.array_equal(fw[k], fg[k]) for k in fw)
                assert glue_compute_metrics(task.name, preds.tolist(), fg["labels"].tolist()) == \
                    glue_compute_metrics(task.name, preds.tolist(), fw["labels"].tolist())
                write_dev_predictions(tmp_path / "w.tsv", task, want[0][1], preds)
                write_dev_predictions(tmp_path / "g.tsv", task, got[0][1], preds)
            elif split == "test":  # the GLUE server's submission file, byte for byte
                write_submission(tmp_path / "w.tsv", task, want[0][1], preds)
                write_submission(tmp_path / "g.tsv", task, got[0][1], preds)
            else:
                continue
            assert (tmp_path / "g.tsv").read_bytes() == (tmp_path / "w.tsv").read_bytes()


def test_mnli_matched_mismatched_and_label_names(tmp_path):
    """MNLI's four evaluation splits; the Hub's class ids (entailment 0, neutral 1, contradiction 2) map to the
    TSV's label names; STS-B's float32 scores read as the decimals the TSV has."""
    mnli = get_task("mnli")
    tsv = write_rte_like(tmp_path / "MNLI", mnli=True, task_labels=("contradiction", "entailment", "neutral"))
    splits = hub_glue(tsv, "mnli")
    assert sorted(splits) == ["test_matched", "test_mismatched", "train", "validation_matched",
                              "validation_mismatched"]
    assert splits["train"]["label"][:2] == [2, 1]  # contradiction, neutral (write_rte_like's two labels)
    write_hub_parquet(splits, tmp_path / "hub" / "mnli")
    datasets.DatasetDict(splits).save_to_disk(str(tmp_path / "saved"))
    for split in ("train", "dev", "test"):
        want = read_split(tsv, mnli, split)
        assert [n for n, _ in want] == {"train": ["train"], "dev": ["mnli-m", "mnli-mm"],
                                        "test": ["mnli-m", "mnli-mm"]}[split]
        for d in (tmp_path / "hub", tmp_path / "saved"):
            assert rows(read_split(d, mnli, split)) == rows(want)

    stsb = get_task("stsb")
    scores = [0.0, 3.8, 4.2, 1.667, 5.0]
    ds = datasets.Dataset.from_dict(
        {"sentence1": ["a b"] * 5, "sentence2": ["c d"] * 5, "label": scores, "idx": list(range(5))},
        features=Features({"sentence1": Value("string"), "sentence2": Value("string"), "label": Value("float32"),
                           "idx": Value("int32")}))
    write_hub_parquet({"validation": ds}, tmp_path / "stsb")
    (_, got), = read_split(tmp_path / "stsb", stsb, "dev")
    assert [e.label for e in got] == scores


def _mrpc_ds(**change):
    data = {"sentence1": ["A cat sat.", "A dog ran."], "sentence2": ["The cat sat.", "Dogs fly."], "label": [1, 0],
            "idx": [0, 1]}
    feats = {"sentence1": Value("string"), "sentence2": Value("string"),
             "label": ClassLabel(names=["not_equivalent", "equivalent"]), "idx": Value("int32")}
    for k, v in change.items():
        if v is None:
            data.pop(k), feats.pop(k)
        else:
            data[k], feats[k] = v
    return datasets.Dataset.from_dict(data, features=Features(feats))


def test_glue_bad_columns_name_the_file_and_column(tmp_path):
    mrpc = get_task("mrpc")

    def error(ds, split="train") -> str:
        d = tmp_path / f"case{len(list(tmp_path.iterdir()))}"
        write_hub_parquet({split: ds}, d)
        with pytest.raises(ValueError) as e:
            read_split(d, mrpc, "train")
        return str(e.value).replace(str(d), "D")

    assert error(_mrpc_ds(sentence2=None)) == (
        "D/train-00000-of-00001.parquet has no column 'sentence2' (expected a string column); its columns: "
        "sentence1, label, idx; the Hub's mrpc has sentence1, sentence2, label, idx")
    assert error(_mrpc_ds(label=([1.0, 0.0], Value("float64")))) == (
        "D/train-00000-of-00001.parquet: column 'label' is double, expected an integer (class id) or string column")
    assert error(_mrpc_ds(label=([1, 0], ClassLabel(names=["equivalent", "not_equivalent"])))) == (
        "D/train-00000-of-00001.parquet: column 'label' has the classes ['equivalent', 'not_equivalent'], expected "
        "mrpc's ['not_equivalent', 'equivalent'] (in this order)")
    assert error(_mrpc_ds(label=([1, -1], Value("int64")))) == (
        "D/train-00000-of-00001.parquet: row 1: column 'label' is -1, expected a class id 0..1 (0 not_equivalent, "
        "1 equivalent) (-1 marks a test row without a label)")
    assert error(_mrpc_ds(sentence1=(["A cat sat.", " "], Value("string")))) == \
        "D/train-00000-of-00001.parquet: row 1: empty sentence"
    assert error(_mrpc_ds(), split="validation") == (
        "mrpc: D has no train-*.parquet file (the Hub's train split); its Parquet files are of the splits validation")
    assert not has_split(tmp_path / "case5", mrpc, "train") and has_split(tmp_path / "case5", mrpc, "dev")
    with pytest.raises(ValueError, match="train.tsv does not exist \\(nor the Hub's layout"):
        read_split(tmp_path / "nowhere", mrpc, "train")


def test_finetune_glue_on_the_hub_folder_gives_the_tsv_run(tmp_path, tiny_model, capsys):
    """`bertrain finetune glue --data-dir` on the Hub's Parquet folder and on a `datasets` folder: the dev
    metrics, the dev predictions and the GLUE-server submission of the TSV run (the fine-tuning code is the same;
    only the layout is read)."""
    tsv_dir = shared_file("glue/MRPC/train.tsv").parent
    splits = hub_glue(tsv_dir, "mrpc")
    write_hub_parquet(splits, tmp_path / "hub" / "mrpc")
    datasets.DatasetDict(splits).save_to_disk(str(tmp_path / "saved"))
    results = {}
    for name, data_dir in (("tsv", tsv_dir), ("hub", tmp_path / "hub"), ("saved", tmp_path / "saved")):
        out = tmp_path / f"run-{name}"
        assert main(["finetune", "glue", "--task", "mrpc", "--data-dir", str(data_dir), "--init", str(tiny_model),
                     "--output", str(out), "--train.steps", "3", "--data.max_train_examples", "48",
                     "--data.max_seq_length", "32", *TINY]) == 0
        capsys.readouterr()
        results[name] = (json.loads((out / "eval_results.json").read_text())["dev"],
                         (out / "dev_predictions.tsv").read_bytes(), (out / "MRPC.tsv").read_bytes())
    assert results["tsv"][0]["examples"] == 408
    assert results["hub"] == results["tsv"] and results["saved"] == results["tsv"]


# ----------------------------------------------------------------------------------------------- SQuAD

SQUAD_FEATURES = Features({"id": Value("string"), "title": Value("string"), "context": Value("string"),
                           "question": Value("string"),
                           "answers": datasets.Sequence({"text": Value("string"), "answer_start": Value("int32")})})


def hub_squad(json_path: Path) -> "datasets.Dataset":
    """The Hub's rows of a SQuAD JSON file (rajpurkar/squad, squad_v2): one per question, in order; an
    unanswerable question has empty answer lists (the Hub keeps no plausible answers)."""
    data = json.loads(json_path.read_text())
    rows = {k: [] for k in SQUAD_FEATURES}
    for article in data["data"]:
        for para in article["paragraphs"]:
            for qa in para["qas"]:
                rows["id"].append(qa["id"])
                rows["title"].append(article.get("title", ""))
                rows["context"].append(para["context"])
                rows["question"].append(qa["question"])
                rows["answers"].append({"text": [a["text"] for a in qa["answers"]],
                                        "answer_start": [a["answer_start"] for a in qa["answers"]]})
    return datasets.Dataset.from_dict(rows, features=SQUAD_FEATURES)


def squad_rows(examples):
    return [(e.qid, e.question, e.context, e.answers, e.is_impossible, e.title) for e in examples]


def test_real_squad_from_hub_parquet_and_datasets_folder_equals_json(tmp_path, tiny_tok):
    path = shared_file("squad/xquad-en-part1.json")
    ds = hub_squad(path)
    (tmp_path / "plain_text").mkdir()
    ds.to_parquet(str(tmp_path / "plain_text" / "validation-00000-of-00001.parquet"))
    datasets.DatasetDict({"validation": ds}).save_to_disk(str(tmp_path / "saved"))
    want = read_squad(path)
    assert len(want) == 632
    gold = json.loads(path.read_text())
    cfg = SquadFeatureConfig(max_seq_length=128, doc_stride=64, max_query_length=32)
    fw = squad_features(want, tiny_tok, cfg, is_training=False)
    preds = {e.qid: e.context[:12] if i % 3 else e.answers[0]["text"] for i, e in enumerate(want)}
    for given in (tmp_path / "plain_text" / "validation-00000-of-00001.parquet", tmp_path / "plain_text",
                  tmp_path / "saved" / "validation"):
        assert squad_rows(read_squad(given, version_2_with_negative=False)) == squad_rows(want)
        assert load_dataset_json(given) == gold  # the JSON's nesting again: articles, paragraphs, ids
        assert evaluate_squad(load_dataset_json(given), preds) == evaluate_squad(gold, preds)
    # the features (through the feature cache, keyed by the folder's content)
    given = tmp_path / "plain_text"
    fg, cache = load_or_build_features(given, read_squad(given), tiny_tok, cfg, False, tmp_path / "cache")
    assert cache is not None and cache.name.startswith("squad-plain_text-eval-")
    assert fw.keys() == fg.keys() and all(np.array_equal(fw[k], fg[k]) for k in fw)
    assert load_or_build_features(given, read_squad(given), tiny_tok, cfg, False, tmp_path / "cache")[1] == cache
    assert evaluate_squad(gold, preds)["exact_match"] == pytest.approx(100 * 214 / 632)


def test_squad_v2_from_hub_parquet(tmp_path):
    """v2.0: questions with empty answer lists are the unanswerable ones; the official v2.0 numbers (with
    no-answer scores) are the JSON's."""
    v2 = squad_v2_fixture(tmp_path / "dev.json", 4)
    hub_squad(v2).to_parquet(str(tmp_path / "dev.parquet"))
    want, got = read_squad(v2, True), read_squad(tmp_path / "dev.parquet", True)
    assert squad_rows(got) == squad_rows(want) and sum(e.is_impossible for e in got) == 8
    gold, hub = json.loads(v2.read_text()), load_dataset_json(tmp_path / "dev.parquet")
    assert hub["version"] == "v2.0"
    preds = {e.qid: ("" if i % 2 else "ann") for i, e in enumerate(want)}
    odds = {e.qid: float(i % 5) - 2 for i, e in enumerate(want)}
    assert evaluate_squad(hub, preds, odds) == evaluate_squad(gold, preds, odds)
    with pytest.raises(ValueError, match="unanswerable question in a file read as SQuAD v1.1"):
        read_squad(tmp_path / "dev.parquet", version_2_with_negative=False)


def test_squad_bad_columns_and_ambiguous_folders(tmp_path):
    ds = hub_squad(squad_v2_fixture(tmp_path / "d.json", 1))

    def error(table, name="x.parquet") -> str:
        table.to_parquet(str(tmp_path / name))
        with pytest.raises(ValueError) as e:
            read_squad(tmp_path / name)
        return str(e.value).replace(str(tmp_path), "T")

    assert error(ds.remove_columns("question")) == (
        "T/x.parquet has no column 'question' (expected a string column); its columns: id, title, context, "
        "answers; the Hub's SQuAD has id, title, context, question, answers")
    assert error(ds.remove_columns("answers").add_column("answers", ["a"] * len(ds))) == (
        "T/x.parquet: column 'answers' is string, expected struct<text: list<string>, answer_start: list<int>> "
        "(the Hub's SQuAD layout) or list<struct<text: string, answer_start: int>>; the Hub's SQuAD has id, title, "
        "context, question, answers")
    bad = ds.map(lambda r: {"answers": {"text": r["answers"]["text"], "answer_start": [7] * len(r["answers"]["text"])}})
    assert error(bad) == ("T/x.parquet: question id p0-who: answer 'ann' does not match the context at answer_start 7 "
                          "(the context there reads ' on')")
    datasets.DatasetDict({"train": ds, "validation": ds}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(ValueError, match="is a `datasets` DatasetDict folder with the splits train, validation: "
                                         "give the folder of one split, e.g. "):
        squad_layout(tmp_path / "dd")
    (tmp_path / "hub").mkdir()
    for split in ("train", "validation"):
        ds.to_parquet(str(tmp_path / "hub" / f"{split}-00000-of-00001.parquet"))
    with pytest.raises(ValueError, match="holds the Parquet files of the splits train, validation: give one split's"):
        read_squad(tmp_path / "hub")
    assert error(ds.remove_columns("id").add_column("id", list(range(len(ds)))), "y.parquet") == \
        "T/y.parquet: column 'id' is int64, expected a string column; the Hub's SQuAD has id, title, context, " \
        "question, answers"


def test_finetune_squad_on_hub_parquet_gives_the_json_run(tmp_path, tiny_model, capsys):
    """`bertrain finetune squad --train X.parquet --dev DIR`: the predictions, no-answer scores and official v2.0
    numbers of the run on the JSON files of the same rows."""
    (tmp_path / "json").mkdir()
    train = squad_v2_fixture(tmp_path / "json" / "train.json", 8)
    dev = squad_v2_fixture(tmp_path / "json" / "dev.json", 3)
    hub_squad(train).to_parquet(str(tmp_path / "train-00000-of-00001.parquet"))
    datasets.DatasetDict({"validation": hub_squad(dev)}).save_to_disk(str(tmp_path / "saved"))
    out = {}
    for name, tr, dv in (("json", train, dev), ("hub", tmp_path / "train-00000-of-00001.parquet",
                                                tmp_path / "saved" / "validation")):
        o = tmp_path / f"run-{name}"
        assert main(["finetune", "squad", "--version-2-with-negative", "--train", str(tr), "--dev", str(dv),
                     "--data.max_seq_length", "64", "--data.max_query_length", "16", "--data.cache_dir", "",
                     "--init", str(tiny_model), "--output", str(o), "--train.steps", "4", *TINY]) == 0
        capsys.readouterr()
        res = json.loads((o / "eval_results.json").read_text())
        out[name] = ({k: v for k, v in res.items() if k.startswith(("exact", "f1", "HasAns", "NoAns", "best"))},
                     (o / "predictions.json").read_bytes(), (o / "null_odds.json").read_bytes())
    assert out["hub"] == out["json"] and out["json"][0]["NoAns_total"] == 6
