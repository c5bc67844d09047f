"""Audit of model interoperability: `bertrain info` on the folders a user has (a pretraining or fine-tuning run, a
`bertrain run` pipeline, one stopped early) and foreign checkpoints whose config.json does not match their weights."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from bertrain import BertForPreTraining
from bertrain.cli import main
from bertrain.data.prepare import prepare
from conftest import ASSETS
from helpers import prepare_config

TF_FIXTURE = ASSETS / "google-tf-tiny"


@pytest.fixture(scope="module")
def pretrain_run(tmp_path_factory) -> Path:
    """A real `bertrain pretrain` run of 4 steps: checkpoints at steps 2 and 4, held-out evaluations, final/."""
    root = tmp_path_factory.mktemp("interop")
    prepare(prepare_config(root / "data", heldout_fraction=0.05, heldout_min_documents=4))
    out = root / "run"
    assert main(["pretrain", "--data.prepared", str(root / "data"), "--model.preset", "tiny",
                 "--sample.max_seq_length", "64", "--sample.max_predictions_per_seq", "10", "--train.steps", "4",
                 "--train.global_batch_size", "8", "--train.micro_batch_size", "8", "--train.log_interval", "2",
                 "--optim.name", "adamw", "--eval.interval", "2", "--checkpoint.save_interval", "2",
                 "--checkpoint.keep_last", "0", "--output_dir", str(out)]) == 0
    return out


def _records(run: Path) -> tuple[dict, dict]:
    """(the last evaluation record, the last training record) of a run's metrics.jsonl."""
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in lines if r.get("event") == "eval"]
    train = [r for r in lines if "samples" in r and "event" not in r]
    return evals[-1], train[-1]


def info_text(folder: Path, capsys) -> str:
    assert main(["info", "--model", str(folder)]) == 0
    return capsys.readouterr().out


def test_info_on_a_pretraining_run_says_its_state_checkpoints_and_numbers(pretrain_run, capsys):
    """`bertrain info --model RUN` says what the run did, from its files: finished or not, its checkpoints, the last
    training and held-out numbers; then the final model (before: only the latest checkpoint's config.json)."""
    text = info_text(pretrain_run, capsys)
    last_eval, last_train = _records(pretrain_run)
    assert f"run: {pretrain_run} (bertrain pretrain; run " in text
    assert "state: finished after step 4 of 4\n" in text
    assert "checkpoints: step-2, step-4\n" in text and f"final model: {pretrain_run / 'final'}\n" in text
    assert f"last evaluation (step 4): mlm_loss {last_eval['metrics']['mlm_loss']:.4g} " in text
    assert f"last training log (step 4, {last_train['samples']} samples): loss {last_train['loss']:.4g} " in text
    assert f"model: {pretrain_run / 'final' / 'config.json'}\n" in text and "hidden_size" in text
    assert main(["info", "--model", str(pretrain_run), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["run"]["steps_done"] == 4 and info["run"]["planned_steps"] == 4
    assert info["run"]["last_eval"]["mlm_acc"] == last_eval["metrics"]["mlm_acc"]
    assert info["parameters"]["BertModel"] > 0  # the model section is still there


def test_info_on_an_interrupted_run_names_the_checkpoint_to_resume_from(pretrain_run, tmp_path, capsys):
    """A run cut in its last save (no final/, step-4 without COMPLETE): not finished, resumable from step-2, whose
    model is described; one cut before its first checkpoint has no model and still exits 0 (before: exit 2, "no
    config.json in this folder")."""
    cut = tmp_path / "cut"
    shutil.copytree(pretrain_run, cut)
    shutil.rmtree(cut / "final")
    (cut / "step-4" / "COMPLETE").unlink()
    text = info_text(cut, capsys)
    assert "state: not finished: stopped after step 4 of 4; its last complete checkpoint is step-2: the same " \
           "command with --resume auto continues from it" in text
    assert "checkpoints: step-2 (incomplete: step-4)" in text and f"model: {cut / 'step-2' / 'config.json'}" in text

    early = tmp_path / "early"
    early.mkdir()
    for name in ("config.yaml", "run.json"):
        shutil.copy(pretrain_run / name, early / name)
    (early / "metrics.jsonl").write_text((pretrain_run / "metrics.jsonl").read_text().splitlines()[0] + "\n")
    text = info_text(early, capsys)
    assert "before its first complete checkpoint (no model to resume)" in text and "\nmodel:" not in text


def _stage(folder: Path, started: str, summary: dict | None, complete: bool = True) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "stage-started.json").write_text(json.dumps({"hash": "h", "started": started}))
    if complete:
        (folder / "stage.json").write_text(json.dumps({"stage": folder.name, "hash": "h", "wall_s": 12.5,
                                                       "summary": summary or {}, "finished": started}))


def pipeline_folder(root: Path, pretrain_run: Path, finished: bool) -> Path:
    """A `bertrain run` folder in the layout `bertrain.pipeline.stages` writes (its stage files, evaluate's
    results.json, the report), its pretraining stages holding a real run."""
    pipe = root / "pipe"
    pipe.mkdir()
    (pipe / "run.json").write_text(json.dumps({"run_id": "abc", "command": "run", "started": "2026-01-01T00:00:00",
                                               "host": "h"}))
    (pipe / "recipe.yaml").write_text("name: small\n")
    _stage(pipe / "vocab", "2026-01-01T00:00:01", {"tokens": 4320})
    _stage(pipe / "prepare", "2026-01-01T00:00:01", {"num_documents": 73})
    for phase in ("pretrain-phase1", "pretrain-phase2"):
        shutil.copytree(pretrain_run, pipe / phase)
        _stage(pipe / phase, "2026-01-01T00:00:02", {"steps": 4, "mlm_acc": 0.125})
    for init in ("pretrained", "random"):
        _stage(pipe / f"finetune-topics-{init}-s1", "2026-01-01T00:00:03", {"train_steps": 100},
               complete=finished or init == "pretrained")
    if finished:
        _stage(pipe / "evaluate", "2026-01-01T00:00:04", {"tasks": 1})
        metric = {"split": "dev", "metric": "accuracy", "examples": 877, "majority_baseline": 0.2087,
                  "by_init": {"pretrained": {"seeds": {"1": 0.40, "2": 0.42}, "mean": 0.41, "std": 0.0141},
                              "random": {"seeds": {"1": 0.25, "2": 0.27}, "mean": 0.26, "std": 0.0141}}}
        verdict = {"split": "dev", "metric": "accuracy", "outcome": "pretraining helps",
                   "reason": "the 95% interval excludes zero", "difference": 0.15, "interval": [0.08, 0.22]}
        (pipe / "evaluate" / "results.json").write_text(json.dumps(
            {"tasks": [{"name": "topics", "metrics": [metric], "verdicts": [verdict]}]}))
        _stage(pipe / "report", "2026-01-01T00:00:05", {})
        (pipe / "report" / "report.html").write_text("<html></html>")
    return pipe


def test_info_on_a_pipeline_run_lists_its_stages_results_and_pretrained_model(pretrain_run, tmp_path, capsys):
    """`bertrain info --model RUNS/RECIPE`: its stages in the order they run, each complete or not, the results and
    verdict, the report, and the pretrained model it describes (before: exit 2, "no config.json in this folder")."""
    pipe = pipeline_folder(tmp_path, pretrain_run, finished=True)
    text = info_text(pipe, capsys)
    assert f"run: {pipe} (bertrain run; recipe small, run abc, started 2026-01-01T00:00:00 on h)\n  state: finished" \
        in text
    names = [line.split()[0] for line in text.splitlines() if line.startswith("    ") and "complete" in line]
    assert names == ["vocab", "prepare", "pretrain-phase1", "pretrain-phase2", "finetune-topics-pretrained-s1",
                     "finetune-topics-random-s1", "evaluate", "report"]
    assert "topics dev accuracy: pretrained 0.41 +- 0.0141 (2 seeds), random 0.26 +- 0.0141 (2 seeds); majority " \
           "class 0.2087" in text
    assert "verdict: pretraining helps (the 95% interval excludes zero)" in text
    assert f"report: {pipe / 'report' / 'report.html'}" in text
    assert f"pretrained model: {pipe / 'pretrain-phase2' / 'final'}\n" in text
    assert f"model: {pipe / 'pretrain-phase2' / 'final' / 'config.json'}" in text


def test_info_on_an_unfinished_pipeline_says_which_stages_are_left(pretrain_run, tmp_path, capsys):
    pipe = pipeline_folder(tmp_path, pretrain_run, finished=False)
    text = info_text(pipe, capsys)
    assert "state: not finished: finetune-topics-random-s1 started but not complete; the same `bertrain run` " \
           "command continues it" in text
    assert "stages (5 of 6 complete)" in text and "NOT COMPLETE" in text
    assert main(["info", "--model", str(pipe), "--json"]) == 0
    run = json.loads(capsys.readouterr().out)["run"]
    assert run["results"] is None and run["report"] is None
    assert [s["complete"] for s in run["stages"]] == [True, True, True, True, True, False]


def test_info_lists_the_stages_a_pipeline_has_not_started_from_its_plan(pretrain_run, tmp_path, capsys):
    """stages.json (the plan `bertrain run` writes) gives every stage in its order: the ones not started are listed
    as such and counted in the state (before: "5 of 6 complete" for a plan of 8 stages, the others unnamed)."""
    pipe = pipeline_folder(tmp_path, pretrain_run, finished=False)
    plan = ["vocab", "prepare", "pretrain-phase1", "pretrain-phase2", "finetune-topics-pretrained-s1",
            "finetune-topics-random-s1", "evaluate", "report"]
    (pipe / "stages.json").write_text(json.dumps({"stages": [{"name": n, "what": "..."} for n in plan]}))
    text = info_text(pipe, capsys)
    assert "stages (5 of 8 complete)" in text
    assert "state: not finished: finetune-topics-random-s1 started but not complete; 2 stages not started; the " \
           "same `bertrain run` command continues it" in text
    marks = [(line.split()[0], line.split()[1]) for line in text.splitlines()
             if line.startswith("    ") and ("complete" in line.lower() or "not started" in line)]
    assert marks == [(n, "complete") for n in plan[:5]] + [("finetune-topics-random-s1", "NOT"),
                                                          ("evaluate", "not"), ("report", "not")]
    assert main(["info", "--model", str(pipe), "--json"]) == 0
    stages = json.loads(capsys.readouterr().out)["run"]["stages"]
    assert [(s["name"], s["complete"], s["not_started"]) for s in stages] == \
        [(n, i < 5, i > 5) for i, n in enumerate(plan)]


def test_a_config_with_fewer_layers_than_the_checkpoint_is_refused(tmp_path):
    """Google's checkpoint (2 layers) beside a bert_config.json that says 1: refused naming both files (before: the
    first layer only was loaded and `bertrain convert` wrote that other network, with a warning); asked for with
    num_hidden_layers=1 it is the caller's choice."""
    folder = tmp_path / "tf"
    shutil.copytree(TF_FIXTURE, folder)
    config = json.loads((folder / "bert_config.json").read_text())
    assert config["num_hidden_layers"] == 2
    (folder / "bert_config.json").write_text(json.dumps({**config, "num_hidden_layers": 1}))
    with pytest.raises(ValueError) as e:
        BertForPreTraining.from_pretrained(folder)
    assert str(folder / "bert_model.ckpt.index") in str(e.value) and str(folder / "bert_config.json") in str(e.value)
    assert "holds 2 encoder layers (weights of layer(s) 1)" in str(e.value)
    assert main(["convert", str(folder), str(tmp_path / "out")]) == 2 and not (tmp_path / "out").exists()
    assert BertForPreTraining.from_pretrained(folder, num_hidden_layers=1).config.num_hidden_layers == 1
