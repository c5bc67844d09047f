"""Model cards (issue 23): OUTPUT/final and `bertrain export` folders carry a README.md with the Hub's metadata,
written from the run's own files; `huggingface_hub.ModelCard` parses it and `transformers` still loads the folder."""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from bertrain import __version__
from bertrain.cli import main
from bertrain.data.prepare import prepare
from bertrain.model.card import launched_command, render, run_facts
from bertrain.model.hf import load_pretrained, model_class_for
from helpers import TINY_VOCAB, finetune_argv, finetune_data, prepare_config, save_tiny_model

hub = pytest.importorskip("huggingface_hub")
transformers = pytest.importorskip("transformers")

TEXT = ("the cat sat on the mat", "a dog ran in the park")


def card_of(folder: Path):
    card = hub.ModelCard.load(folder / "README.md")  # parses the metadata, model-index included
    return card, card.data


def config_block(text: str) -> dict:
    """The config.yaml that a card shows in its details block."""
    m = re.search(r"<summary>config\.yaml[^\n]*\n\n```yaml\n(.*?)```", text, re.S)
    assert m, "the card shows no config.yaml"
    return yaml.safe_load(m.group(1))


def same_outputs(folder: Path, auto_class: str) -> None:
    """transformers' Auto class loads `folder` (no missing weight) and computes what bertrain computes."""
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    hf, info = getattr(transformers, auto_class).from_pretrained(folder, output_loading_info=True)
    assert not info["missing_keys"], info["missing_keys"]
    ours = load_pretrained(model_class_for(folder), folder).eval()
    enc = tok(list(TEXT), padding=True, return_tensors="pt")
    with torch.no_grad():
        theirs = hf.eval()(**enc)
        mine = ours(input_ids=enc["input_ids"], token_type_ids=enc["token_type_ids"],
                    attention_mask=enc["attention_mask"])
    real = enc["attention_mask"].bool()  # token outputs at padding are each library's own business
    for name in ("logits", "start_logits", "prediction_logits", "last_hidden_state"):
        if getattr(theirs, name, None) is not None:
            a, b = getattr(mine, name), getattr(theirs, name)
            if name != "logits":
                a, b = a[real], b[real]
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
            return
    raise AssertionError(f"no output of {auto_class} compared")


@pytest.fixture(scope="module")
def glue_run(tmp_path_factory) -> Path:
    """A 6-step RTE-like fine-tuning run, evaluated and checkpointed at steps 3 and 6."""
    root = tmp_path_factory.mktemp("glue")
    argv = finetune_argv("glue", finetune_data("glue", root), save_tiny_model(root / "tiny"), root / "run", 6,
                         "--eval.interval", "3", "--checkpoint.save_interval", "3", "--checkpoint.keep_last", "0")
    assert main(argv) == 0
    return root / "run"


@pytest.fixture(scope="module")
def squad_run(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("squad")
    assert main(finetune_argv("squad", finetune_data("squad", root), save_tiny_model(root / "tiny"), root / "run",
                              4)) == 0
    return root / "run"


def evals(run: Path) -> dict[int, dict]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in records if r.get("event") == "eval"}


# ----------------------------------------------------------------------------------------------- OUTPUT/final

def test_glue_final_card_is_hub_metadata_from_the_run_and_transformers_loads_the_folder(glue_run: Path) -> None:
    final = glue_run / "final"
    card, data = card_of(final)
    results = json.loads((glue_run / "eval_results.json").read_text())
    assert data.library_name == "transformers" and data.pipeline_tag == "text-classification"
    assert data.license == "other" and "The license is not set" in card.text  # not invented: asked for
    assert "bertrain" in data.tags and "rte" in data.tags and data.datasets == ["nyu-mll/glue"]
    assert data.base_model is None  # started from a local folder: no Hub id to name
    assert data.language is None and "The language is not recorded" in card.text
    [result] = data.eval_results
    assert (result.task_type, result.dataset_type, result.dataset_config, result.dataset_split) == \
        ("text-classification", "nyu-mll/glue", "rte", "validation")
    assert (result.metric_type, result.metric_value) == ("accuracy", results["dev"]["accuracy"])
    assert str(glue_run.parent / "RTE") in result.dataset_name  # the files it was computed on
    assert data.model_name == "run"
    # the training settings, the version and the command, and the whole resolved config
    assert config_block(card.text) == yaml.safe_load((glue_run / "config.yaml").read_text())
    assert "`bertrain finetune glue --config config.yaml` with bertrain " + __version__ in card.text
    assert "| `optim.lr` | 0.001 |" in card.text and "| `train.steps` | 6 |" in card.text
    best = results["selection"]["best_step"]  # eval.final: best (fine-tuning's default)
    held = "." if best == 6 else f"; this folder holds the weights of step {best}."
    assert "The run trained 6 optimizer steps on 24 training samples" + held in card.text  # global batch 4
    assert "(labels: entailment, not_entailment)" in card.text
    same_outputs(final, "AutoModelForSequenceClassification")


def test_squad_final_card_reports_the_official_metrics(squad_run: Path) -> None:
    card, data = card_of(squad_run / "final")
    results = json.loads((squad_run / "eval_results.json").read_text())
    assert data.pipeline_tag == "question-answering" and data.datasets == ["rajpurkar/squad_v2"]
    got = {r.metric_type: r.metric_value for r in data.eval_results}
    assert got == {"exact_match": results["exact"], "f1": results["f1"]}
    assert {r.dataset_type for r in data.eval_results} == {"rajpurkar/squad_v2"}
    assert "`bertrain finetune squad --config config.yaml`" in card.text
    assert f"| NoAns_f1 | {results['NoAns_f1']:.4g} |" in card.text
    same_outputs(squad_run / "final", "AutoModelForQuestionAnswering")


def test_a_squad_v1_card_reports_exact_match_as_evaluate_v11_names_it() -> None:
    """evaluate-v1.1.py's key is exact_match (v2.0's is exact): the v1.1 card had f1 alone."""
    from bertrain.model.card import _final_evaluations, _index_entry

    results = {"task": "squad", "version": "1.1", "exact_match": 71.25, "f1": 80.5, "examples": 96}
    [e] = _final_evaluations(results, {})
    assert e.metrics == {"exact_match": 71.25, "f1": 80.5} and e.dataset_type == "rajpurkar/squad"
    assert [(m["type"], m["value"]) for m in _index_entry(e)["metrics"]] == [("exact_match", 71.25), ("f1", 80.5)]


def test_pretraining_final_card_reports_the_heldout_evaluation_in_the_text(tmp_path: Path) -> None:
    from bertrain.config import from_dict
    from bertrain.tasks.pretraining import PretrainConfig, run_pretraining

    store = tmp_path / "data"
    prepare(prepare_config(store, heldout_fraction=0.1, heldout_min_documents=4, masking="dynamic"))
    cfg = {"model": {"preset": "tiny"}, "data": {"prepared": str(store), "vocab_file": TINY_VOCAB},
           "sample": {"max_seq_length": 64, "max_predictions_per_seq": 10},
           "train": {"steps": 4, "global_batch_size": 8, "micro_batch_size": 8, "log_interval": 1},
           "checkpoint": {"save_interval": 0}, "eval": {"interval": 2, "max_samples": 16}, "seed": 7,
           "output_dir": str(tmp_path / "run")}
    final = run_pretraining(from_dict(PretrainConfig, cfg)).final_dir
    card, data = card_of(final)
    assert data.pipeline_tag == "fill-mask" and data.license == "other"
    # held-out documents of a local corpus have no Hub dataset: text only, no model-index
    assert data.eval_results is None and data.datasets is None
    last = evals(tmp_path / "run")[4]["metrics"]
    assert "held-out documents of the pretraining corpus" in card.text and "at step 4" in card.text
    for k in ("mlm_acc", "mlm_loss", "nsp_acc", "nsp_loss"):
        assert f"| {k} | {last[k]:.4g} |" in card.text
    assert "pretrained with masked language modelling and next sentence prediction" in card.text
    assert "`bertrain pretrain --config config.yaml`" in card.text
    same_outputs(final, "AutoModelForPreTraining")


def test_a_stale_eval_results_file_is_not_this_models_result(glue_run: Path, tmp_path: Path) -> None:
    """eval_results.json counts only when written after the run's config.yaml (by the run that made final/); an
    older one (an earlier run in the folder) gives way to the evaluation recorded at the step final/ holds (the
    best one: eval.final is best)."""
    run = tmp_path / "run"
    shutil.copytree(glue_run, run)
    results = json.loads((run / "eval_results.json").read_text())
    results["dev"]["accuracy"] = 0.123
    (run / "eval_results.json").write_text(json.dumps(results))
    model = load_pretrained(model_class_for(run / "final"), run / "final")

    fresh = run_facts(run / "final", run, "run", final=True)
    assert [e.metrics["accuracy"] for e in fresh.evaluations] == [0.123]
    old = (run / "config.yaml").stat().st_mtime - 60
    os.utime(run / "eval_results.json", (old, old))
    stale = run_facts(run / "final", run, "run", final=True)
    best = results["selection"]["best_step"]
    assert [e.metrics for e in stale.evaluations] == [evals(run)[best]["metrics"]]
    text = render(stale, model)
    assert "0.123" not in text and f"while training, at step {best}" in text


def test_launched_command_is_only_the_bertrain_cli() -> None:
    assert launched_command(["/usr/bin/bertrain", "finetune", "glue", "--task", "rte", "--init", "a b"]) == \
        "bertrain finetune glue --task rte --init 'a b'"
    assert launched_command(["/x/site-packages/bertrain/__main__.py", "pretrain"]) == "bertrain pretrain"
    assert launched_command(["/usr/bin/pytest", "-q"]) is None


# ----------------------------------------------------------------------------------------------- bertrain export

def test_export_of_final_keeps_its_card_and_sets_license_and_language(glue_run: Path, tmp_path: Path) -> None:
    src = tmp_path / "final"
    shutil.copytree(glue_run / "final", src)
    text = (src / "README.md").read_text()
    edited = text.replace("## Evaluation\n", "## Evaluation\n\nA note the user wrote.\n", 1)
    (src / "README.md").write_text(edited)
    out = tmp_path / "out"
    assert main(["export", str(src), str(out), "--license", "apache-2.0", "--language", "en"]) == 0
    card, data = card_of(out)
    assert data.license == "apache-2.0" and data.language == ["en"]
    assert "A note the user wrote." in card.text  # the rest of the card is kept as it was
    assert "The license is not set" not in card.text and "License: `apache-2.0`" in card.text
    assert data.eval_results == card_of(glue_run / "final")[1].eval_results
    same_outputs(out, "AutoModelForSequenceClassification")


def test_export_of_a_checkpoint_reports_that_steps_evaluation(glue_run: Path, tmp_path: Path) -> None:
    out = tmp_path / "step3"
    assert main(["export", str(glue_run / "step-3"), str(out)]) == 0
    card, data = card_of(out)
    at3 = evals(glue_run)[3]["metrics"]
    assert [(r.metric_type, r.metric_value) for r in data.eval_results] == [("accuracy", at3["accuracy"])]
    assert "while training, at step 3" in card.text and "this folder holds the weights of step 3" in card.text
    assert config_block(card.text) == yaml.safe_load((glue_run / "step-3" / "config.yaml").read_text())
    assert data.model_name == "step3"


def test_export_outside_a_run_says_so_and_names_the_source_license(minilm_path: Path, tmp_path: Path) -> None:
    """The real all-MiniLM-L6-v2 folder: its own card declares apache-2.0; the export does not adopt it."""
    out = tmp_path / "minilm"
    assert main(["export", str(minilm_path), str(out)]) == 0
    card, data = card_of(out)
    assert data.pipeline_tag == "feature-extraction" and data.license == "other" and data.eval_results is None
    assert "no bertrain training record was found" in card.text and "## Training\n\nNo training record" in card.text
    assert f"{minilm_path}, declares `license: apache-2.0`" in card.text
    assert "6 layers, hidden size 384, 12 attention heads" in card.text
    same_outputs(out, "AutoModel")


@pytest.mark.parametrize("argv, needle", [
    (["--license", "Apache 2.0"], "--license 'Apache 2.0'"),
    (["--language", "english"], "--language 'english'"),
    (["--format", "onnx", "--license", "mit"], "--license and --language go into the model card"),
])
def test_export_refuses_bad_card_options_in_one_line(glue_run: Path, tmp_path: Path, capsys, argv, needle) -> None:
    out = tmp_path / "out"
    assert main(["export", str(glue_run / "final"), str(out), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1
    assert not out.exists()
