"""Deployment defects found by audit B (README "Quickstart on your own data" steps 4-5 and "Deploy"), each with its
fix: predict/serve on a run's step-N checkpoint, a Triton repository of several models, the Hub's SQuAD layouts as
predict inputs, a model folder without a head, and --text-pair without --text."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from helpers import finetune_argv, finetune_data, one_line_error, run_cli, save_tiny_head_model, save_tiny_model

from bertrain.cli import main


@pytest.fixture(scope="module")
def squad_v2_run(tmp_path_factory) -> Path:
    """A 2-step SQuAD v2.0 run of the tiny model (64-token windows): final/ holds the weights of step-2/."""
    root = tmp_path_factory.mktemp("squad2")
    data, model = finetune_data("squad", root / "data"), save_tiny_model(root / "init")
    assert main(finetune_argv("squad", data, model, root / "run", 2)) == 0
    run = root / "run"
    assert (run / "step-2" / "model.safetensors").read_bytes() == (run / "final" / "model.safetensors").read_bytes()
    assert not (run / "step-2" / "task.json").exists()
    return run


def _squad_predictions(model: Path, data: Path, out: Path, *extra: str) -> tuple[dict, dict | None]:
    assert main(["predict", "--model", str(model), "--input", str(data), "--output", str(out), *extra]) == 0
    odds = out.with_name(out.name.removesuffix(".json") + ".null_odds.json")
    return json.loads(out.read_text()), json.loads(odds.read_text()) if odds.exists() else None


# ----------------------------------------------------------------------------------------------- D1: step-N

def test_a_step_checkpoint_predicts_as_its_runs_final_model(squad_v2_run, tmp_path, caplog):
    """`bertrain predict --model OUTPUT/step-N` (no task.json there) fell back to config.json's head: 384-token
    windows and SQuAD v1.1 decoding, so a v2.0 model never answered "no answer" and wrote no null odds, silently
    (51 of 96 answers of the run's on XQuAD). Now it reads its run's settings, as `bertrain export` did, and says
    so in one info line: the answers and null odds of final/ (the same weights) and of the run's dev evaluation."""
    from bertrain.deploy.predict import Predictor

    run, dev = squad_v2_run, squad_v2_run.parent / "data" / "dev.json"
    final = _squad_predictions(run / "final", dev, tmp_path / "final.json")
    with caplog.at_level(logging.INFO, logger="bertrain.deploy.predict"):
        step = _squad_predictions(run / "step-2", dev, tmp_path / "step.json")
    assert step == final and step[1] is not None
    assert step[0] == json.loads((run / "predictions.json").read_text())
    said = [r.getMessage() for r in caplog.records if r.name == "bertrain.deploy.predict"]
    assert said == [f"{run / 'step-2'} has no task.json: using its run's settings from {run / 'final' / 'task.json'}"]
    p = Predictor(run / "step-2")
    assert (p.version_2_with_negative, p.max_seq_length, p.task_source) == (True, 64, run / "final" / "task.json")
    assert p.meta == json.loads((run / "final" / "task.json").read_text())


def test_a_step_checkpoint_without_final_reads_its_runs_config(squad_v2_run, tmp_path, caplog):
    """Before the run has a final/ (stopped, or still training), the settings its config.yaml implies: those
    `bertrain finetune` writes into final/task.json, the same rule `bertrain export` applies (one place)."""
    import shutil

    from bertrain.commands.export import task_file_of
    from bertrain.deploy.predict import Predictor, run_task_file
    from bertrain.model.bert import BertForQuestionAnswering

    run = tmp_path / "run"
    shutil.copytree(squad_v2_run / "step-2", run / "step-2")
    shutil.copy(squad_v2_run / "config.yaml", run / "config.yaml")
    with caplog.at_level(logging.INFO, logger="bertrain.deploy.predict"):
        p = Predictor(run / "step-2")
    assert p.task_source == run / "config.yaml" and p.version_2_with_negative and p.max_seq_length == 64
    assert f"using its run's settings from {run / 'config.yaml'}" in caplog.text
    assert p.meta == json.loads((squad_v2_run / "final" / "task.json").read_text())
    text, source = run_task_file(run / "step-2", "BertForQuestionAnswering")
    assert source == run / "config.yaml" and json.loads(text) == p.meta
    assert task_file_of(run / "step-2", BertForQuestionAnswering.from_pretrained(run / "step-2")) == text


def test_a_model_folder_outside_a_run_warns_once_that_it_decodes_with_defaults(squad_v2_run, tmp_path, caplog):
    """Neither the folder nor a run around it says how the model was fine-tuned: today's defaults, said once."""
    import shutil

    from bertrain.deploy.predict import Predictor

    alone = tmp_path / "alone"
    shutil.copytree(squad_v2_run / "step-2", alone)
    with caplog.at_level(logging.INFO, logger="bertrain.deploy.predict"):
        p = Predictor(alone)
        p.predict([{"question": "who sat ?", "context": "ann sat on the mat ."}] * 3)
    assert (p.task_source, p.version_2_with_negative, p.max_seq_length) == (None, False, 384)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [f"{alone} has no task.json, nor does a fine-tuning run around it: decoding with the default "
                        "settings (384-token windows, stride 128, SQuAD v1.1 answers (never 'no answer')), which "
                        "may not be those the model was trained and evaluated with"]


# ----------------------------------------------------------------------------------------------- D4: Triton

def test_a_triton_repository_takes_a_second_model_and_overwrite_replaces_only_its_own(tmp_path, capsys):
    """`bertrain export ... triton --format onnx --triton --name squad` beside an existing triton/mrpc was refused
    ("triton already exists"), and with --overwrite moved the whole repository aside: mrpc was gone from it. Now
    the export owns triton/NAME only; --overwrite moves that one model out of the repository (left inside, Triton
    would take the old copy for a model whose folder is not named as its config.pbtxt says, and not start)."""
    pytest.importorskip("onnxscript", reason="needs the deploy extra: pip install 'bertrain[deploy]'")
    pytest.importorskip("onnxruntime", reason="needs the deploy extra: pip install 'bertrain[deploy]'")
    from bertrain.model.bert import BertForQuestionAnswering, BertForSequenceClassification

    cls = save_tiny_head_model(BertForSequenceClassification, tmp_path / "cls")
    qa = save_tiny_head_model(BertForQuestionAnswering, tmp_path / "qa")
    repo = tmp_path / "triton"
    assert run_cli(capsys, "export", cls, repo, "--format", "onnx", "--triton", "--name", "mrpc")[0] == 0
    mrpc = {p.relative_to(repo / "mrpc"): p.read_bytes() for p in (repo / "mrpc").rglob("*") if p.is_file()}
    code, out, _ = run_cli(capsys, "export", qa, repo, "--format", "onnx", "--triton")  # the default name: bert_qa
    assert code == 0 and f"Triton model repository {repo} (model bert_qa)" in out
    assert sorted(p.name for p in repo.iterdir()) == ["bert_qa", "mrpc"]  # no lock file
    assert (repo / "bert_qa" / "config.pbtxt").read_text().startswith('name: "bert_qa"\n')
    assert (repo / "bert_qa" / "1" / "model.onnx").is_file()

    code, _, err = run_cli(capsys, "export", qa, repo, "--format", "onnx", "--triton", "--name", "mrpc")
    assert code == 2 and one_line_error(err) == (
        f"bertrain export: error: {repo} already holds a model mrpc ({repo / 'mrpc'}): pass --overwrite to replace "
        "it (the old one is moved beside the repository, not deleted), or choose another --name")
    code, out, _ = run_cli(capsys, "export", qa, repo, "--format", "onnx", "--triton", "--name", "mrpc", "--overwrite")
    assert code == 0
    (aside,) = [p for p in tmp_path.iterdir() if p.name.startswith("triton.mrpc.replaced-")]
    assert f"moved the previous {repo / 'mrpc'} aside to {aside}" in out
    assert {p.relative_to(aside): p.read_bytes() for p in aside.rglob("*") if p.is_file()} == mrpc
    assert sorted(p.name for p in repo.iterdir()) == ["bert_qa", "mrpc"]  # no lock file
    assert json.loads((repo / "mrpc" / "1" / "onnx.json").read_text())["task"] == "qa"
    from bertrain.commands.export import _model_lock

    with _model_lock(repo / "mrpc"):  # another export of this model, now: refused naming it
        code, _, err = run_cli(capsys, "export", qa, repo, "--format", "onnx", "--triton", "--name", "mrpc",
                               "--overwrite")
    assert code == 2 and f"output folder {repo / 'mrpc'} is in use by `bertrain export`" in one_line_error(err)
    for bad in ("..", ".hidden"):  # not a model folder of the repository: its parent, or one Triton may skip
        code, _, err = run_cli(capsys, "export", qa, repo, "--format", "onnx", "--triton", "--name", bad)
        assert code == 2 and f"--name {bad!r}: use letters" in err


# ----------------------------------------------------------------------------------------------- D5: SQuAD layouts

def test_the_hubs_squad_layouts_are_predicted_as_the_json(squad_v2_run, tmp_path, capsys):
    """`bertrain predict --input validation-00000-of-00001.parquet` (the Hub's SQuAD, which README step 4 sells) was
    read as JSON lines: "not UTF-8 text ... iconv". A QA model's .parquet, .arrow or `datasets` folder input is now
    a SQuAD split, as a .json one: the same predictions.json. And a .json file of JSON lines says --format jsonl."""
    datasets = pytest.importorskip("datasets", reason="writes the Hub's layouts")
    dev = squad_v2_run.parent / "data" / "dev.json"
    want = _squad_predictions(squad_v2_run / "final", dev, tmp_path / "want.json")
    rows: dict[str, list] = {k: [] for k in ("id", "title", "context", "question", "answers")}
    for article in json.loads(dev.read_text())["data"]:
        for para in article["paragraphs"]:
            for qa in para["qas"]:
                for key, value in (("id", qa["id"]), ("title", article["title"]), ("context", para["context"]),
                                   ("question", qa["question"]),
                                   ("answers", {"text": [a["text"] for a in qa["answers"]],
                                                "answer_start": [a["answer_start"] for a in qa["answers"]]})):
                    rows[key].append(value)
    ds = datasets.Dataset.from_dict(rows)
    ds.to_parquet(str(tmp_path / "validation-00000-of-00001.parquet"))
    ds.save_to_disk(str(tmp_path / "saved"))
    (arrow,) = (tmp_path / "saved").glob("*.arrow")
    for given in (tmp_path / "validation-00000-of-00001.parquet", tmp_path / "saved", arrow):
        assert _squad_predictions(squad_v2_run / "final", given, tmp_path / "got.json") == want, given

    items = [{"question": "who sat ?", "context": "ann sat on the mat ."}, {"question": "who ?", "context": "bob ."}]
    for name, lines in (("items.json", items), ("one.json", items[:1])):
        (tmp_path / name).write_text("".join(json.dumps(item) + "\n" for item in lines))
        code, _, err = run_cli(capsys, "predict", "--model", squad_v2_run / "final", "--input", tmp_path / name)
        assert code == 2 and one_line_error(err).endswith("(JSON lines, one item per line? pass --format jsonl)")
        code, out, _ = run_cli(capsys, "predict", "--model", squad_v2_run / "final", "--input", tmp_path / name,
                               "--format", "jsonl")
        assert code == 0 and len(out.splitlines()) == len(lines)


# ----------------------------------------------------------------------------------------------- D7: no head

@pytest.mark.parametrize("kind", ["BertModel", "BertForPreTraining", "all-MiniLM-L6-v2"])
def test_a_model_without_a_head_says_to_fine_tune_it(kind, tmp_path, capsys, request):
    """`bertrain predict --model all-MiniLM-L6-v2 --text hi` (and `bertrain serve`) answered "cannot tell the task
    from config.json (BertModel); pass task='qa' or 'classification'": Python wording, and --task only led to the
    next error (the head has no trained weights). The error now says what the folder is and what to do."""
    from bertrain.model.bert import BertForPreTraining

    if kind == "BertModel":
        folder = save_tiny_model(tmp_path / "enc")
    elif kind == "BertForPreTraining":
        folder = save_tiny_head_model(BertForPreTraining, tmp_path / "pre")
    else:
        folder, kind = request.getfixturevalue("minilm_path"), "BertModel"
    line = (f"{folder} holds a {kind} without a QA or classification head: fine-tune it first (bertrain finetune "
            "squad|glue ... writes OUTPUT/final, a folder to predict with)")
    code, _, err = run_cli(capsys, "predict", "--model", folder, "--text", "hi")
    assert code == 2 and one_line_error(err) == f"bertrain predict: error: {line}"
    code, _, err = run_cli(capsys, "serve", folder, "--port", "0")
    assert code == 2 and err.strip().splitlines()[-1] == f"bertrain serve: error: {line}"


# ----------------------------------------------------------------------------------------------- D8: --text-pair

@pytest.fixture(scope="module")
def mrpc_like(tmp_path_factory) -> Path:
    from bertrain.model.bert import BertForSequenceClassification

    return save_tiny_head_model(BertForSequenceClassification, tmp_path_factory.mktemp("mrpc") / "final",
                                task={"kind": "classification", "task": "mrpc", "labels": ["0", "1"],
                                      "max_seq_length": 32})


@pytest.mark.parametrize("argv, message", [
    (["--text-pair", "a cat was sitting"], "--text-pair is the second text of --text: give --text too"),
    (["--text", "", "--text-pair", "b"], "--text is empty: give the text itself"),
    (["--text", "a", "--text-pair", "  "], "--text-pair is empty: give the text itself"),
    (["--text-pair", "b", "--input", "-"], "give either --input or --question/--context/--text, not both"),
])
def test_text_pair_without_text_is_refused_not_ignored(mrpc_like, capsys, monkeypatch, argv, message):
    """`echo '{...}' | bertrain predict --model M --text-pair X` ignored --text-pair and predicted stdin (on a
    terminal: waited for it); `--text ""` said "item 0: empty or missing 'text'". Each is one line naming the flag."""
    import io

    monkeypatch.setattr("sys.stdin", io.StringIO('{"text": "a b c", "text_pair": "a b d"}\n'))
    code, out, err = run_cli(capsys, "predict", "--model", mrpc_like, *argv)
    assert (code, out) == (2, "") and one_line_error(err) == f"bertrain predict: error: {message}"


def test_a_classifier_given_a_table_or_qa_given_text_flags_says_so(mrpc_like, tmp_path, capsys):
    """A Parquet file for a classifier was read as JSON lines ("not UTF-8 text ... iconv"); --text / --text-pair
    given to a QA model beside --question and --context were ignored without a word."""
    from bertrain.model.bert import BertForQuestionAnswering

    table = tmp_path / "validation-00000-of-00001.parquet"
    table.write_bytes(b"PAR1\x00\x01binary")
    code, _, err = run_cli(capsys, "predict", "--model", mrpc_like, "--input", table)
    assert code == 2 and "a classification model reads JSON lines" in one_line_error(err)
    qa = save_tiny_head_model(BertForQuestionAnswering, tmp_path / "qa",
                              task={"kind": "qa", "task": "squad", "max_seq_length": 64})
    code, _, err = run_cli(capsys, "predict", "--model", qa, "--question", "who?", "--context", "Ada wrote it.",
                           "--text-pair", "x")
    assert code == 2 and one_line_error(err) == (
        "bertrain predict: error: --text-pair: a QA model reads --question and --context only")


def test_predict_suggests_scoring_only_a_file_with_answers(squad_v2_run, tmp_path, capsys):
    """After a hidden test set (no answers) predict suggested `evaluate squad` on it, which then failed."""
    dev = squad_v2_run.parent / "data" / "dev.json"
    hidden = json.loads(dev.read_text())
    for article in hidden["data"]:
        for para in article["paragraphs"]:
            for qa in para["qas"]:
                qa.pop("answers", None)
                qa.pop("is_impossible", None)
    (tmp_path / "hidden.json").write_text(json.dumps(hidden))
    for data, scoreable in ((dev, True), (tmp_path / "hidden.json", False)):
        assert main(["predict", "--model", str(squad_v2_run / "final"), "--input", str(data), "--output",
                     str(tmp_path / f"{data.stem}-preds.json")]) == 0
        assert ("score them: bertrain evaluate squad" in capsys.readouterr().err) == scoreable
