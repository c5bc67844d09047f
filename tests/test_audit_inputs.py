"""Inputs that change under a run: a run's data or initial model replaced, edited or re-prepared between its start
and its resume. Either nothing that matters changed and the resume continues bit for bit, or it refuses with one
line naming the input (exit 2), or, where the user asks to continue (--allow-config-change), a warning and a
metrics.jsonl record. Real data (../shared/data), tiny models, a few steps; a run "killed" after its step-2
checkpoint is the finished run with what came later removed (the state a kill -9 there leaves)."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import shared_file
from helpers import TINY, TINY_VOCAB, one_line_error, run_cli, save_tiny_model

STEPS = ["--train.steps", "4", "--checkpoint.save_interval", "2", "--checkpoint.keep_last", "0"]
PRETRAIN = ["pretrain", "--model.preset", "tiny", "--model.dropout", "0.1", "--sample.max_seq_length", "64",
            "--train.global_batch_size", "8", "--train.micro_batch_size", "8", "--eval.enabled", "false", *STEPS]


def cut_after_step_2(out: Path) -> None:
    """What a kill -9 right after the step-2 checkpoint leaves of the finished run `out`."""
    for p in out.iterdir():
        m = re.fullmatch(r"step-(\d+)", p.name)
        if (m and int(m.group(1)) > 2) or p.name in ("final", "best"):
            shutil.rmtree(p)
        elif p.name in ("eval_results.json", "metrics.png", "dev_predictions.tsv") or p.suffix == ".tsv":
            p.unlink()


def weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(out / "final" / "model.safetensors"))


def same_weights(a: Path, b: Path) -> bool:
    wa, wb = weights(a), weights(b)
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def corpus(tmp_path: Path, name: str, edit=lambda t: t) -> Path:
    """The first 60 kB of Tiny Shakespeare (`edit`ed), as a text file."""
    text = shared_file("text/tiny-shakespeare.txt").read_text(encoding="utf-8")[:60_000]
    path = tmp_path / name
    path.write_text(edit(text), encoding="utf-8")
    return path


def prepare(capsys, text: Path, store: Path, *extra: str) -> None:
    code, _, err = run_cli(capsys, "prepare", "--input", text, "--output", store, "--vocab-file", TINY_VOCAB,
                           "--masking", "dynamic", "--heldout-fraction", "0", "--workers", "1", *extra)
    assert code == 0, err


def swap_words(text: str) -> str:
    """'the' and 'and' swapped: both one token of the test vocabulary, so every sentence keeps its token count
    (the same documents, sentences and number of samples), with other token ids."""
    return re.sub(r"\b(the|and)\b", lambda m: "and" if m.group(1) == "the" else "the", text)


def test_a_store_reprepared_in_place_from_an_edited_corpus_is_refused_on_resume(tmp_path, capsys):
    """Before: the loader's state checked only the number of samples per epoch; a store re-prepared in place
    (`prepare --overwrite`) from an edited corpus with the same count resumed with exit 0 and trained its last
    steps on the other data, straight != resumed without a word. A store prepared again from the same input (the
    same bytes) still resumes bit for bit."""
    from bertrain.data.pretraining import PretrainingDataset

    text, edited = corpus(tmp_path, "a.txt"), corpus(tmp_path, "a-edited.txt", swap_words)
    store = tmp_path / "store"
    prepare(capsys, text, store)
    straight, run = tmp_path / "straight", tmp_path / "run"
    for out in (straight, run):
        code, _, err = run_cli(capsys, *PRETRAIN, "--data.prepared", store, "--output_dir", out)
        assert code == 0, err
    cut_after_step_2(run)
    n = len(PretrainingDataset(store))

    prepare(capsys, text, store, "--overwrite", "--workers", "2")  # the same input again: the same data
    code, _, err = run_cli(capsys, *PRETRAIN, "--data.prepared", store, "--output_dir", run, "--resume", "auto")
    assert code == 0, err
    assert same_weights(straight, run)

    cut_after_step_2(run)
    prepare(capsys, edited, store, "--overwrite")
    assert len(PretrainingDataset(store)) == n  # the number of samples alone cannot tell
    code, _, err = run_cli(capsys, *PRETRAIN, "--data.prepared", store, "--output_dir", run, "--resume", "auto")
    line = one_line_error(err)
    assert code == 2 and f"data.prepared {store} changed since the run started" in line
    assert "re-prepared in place" in line and "replaced-<time>" in line and "--overwrite" in line
    assert not (run / "final").exists() and not (run / "step-4").exists()

    # the way out it names: the store the run started with, which prepare --overwrite moved aside
    store.rename(tmp_path / "edited-store")
    next(tmp_path.glob("store.replaced-*")).rename(store)
    code, _, err = run_cli(capsys, *PRETRAIN, "--data.prepared", store, "--output_dir", run, "--resume", "auto")
    assert code == 0, err
    assert same_weights(straight, run)


def glue_dir(tmp_path: Path, name: str, rows: int = 41) -> Path:
    """MRPC's first `rows - 1` training and 20 dev examples."""
    src = shared_file("glue/MRPC")
    d = tmp_path / name
    d.mkdir()
    for split, n in (("train", rows), ("dev", 21)):
        lines = (src / f"{split}.tsv").read_text(encoding="utf-8-sig").splitlines()[:n]
        (d / f"{split}.tsv").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return d


def finetune(capsys, data: Path, init: Path, out: Path, *extra: str) -> tuple[int, str]:
    code, _, err = run_cli(capsys, "finetune", "glue", "--task", "mrpc", "--data-dir", data, "--init", init,
                           "--output", out, "--data.max_seq_length", "48", "--do_eval", "false", *TINY, *STEPS,
                           *extra)
    return code, err


def test_a_glue_training_file_edited_between_start_and_resume_is_refused(tmp_path, capsys):
    """Before: labels flipped in train.tsv (the same number of rows) between a fine-tuning's start and its resume:
    exit 0, the rest of the run trained on the new labels. Now the features' fingerprint, kept in the loader's
    state, is compared: one line naming the data folder."""
    data, init = glue_dir(tmp_path, "MRPC"), save_tiny_model(tmp_path / "init", dropout=0.1)
    run = tmp_path / "run"
    code, err = finetune(capsys, data, init, run)
    assert code == 0, err
    cut_after_step_2(run)
    train = data / "train.tsv"
    lines = train.read_text(encoding="utf-8").splitlines()
    lines[1:11] = ["\t".join(["1" if c[0] == "0" else "0", *c[1:]]) for c in (r.split("\t") for r in lines[1:11])]
    train.write_text("\n".join(lines) + "\n", encoding="utf-8")
    code, err = finetune(capsys, data, init, run, "--resume", "auto")
    line = one_line_error(err)
    assert code == 2 and f"the training split of --data-dir {data}" in line and "changed since the run started" in line
    assert not (run / "final").exists()


def test_an_init_model_replaced_by_one_of_another_config_is_refused_on_resume(tmp_path, capsys, caplog):
    """Before: --init swapped between start and resume for a model of the same shape with other dropout: the
    weights came from the checkpoint, but the model was built from the new config.json: exit 0, the rest of the
    run trained with dropout 0, straight != resumed. Now refused; --allow-config-change continues with a warning
    and a config_change record in metrics.jsonl."""
    data, init = glue_dir(tmp_path, "MRPC"), save_tiny_model(tmp_path / "init", dropout=0.1)
    run = tmp_path / "run"
    code, err = finetune(capsys, data, init, run)
    assert code == 0, err
    cut_after_step_2(run)
    config = json.loads((init / "config.json").read_text())
    config.update(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    (init / "config.json").write_text(json.dumps(config))

    code, err = finetune(capsys, data, init, run, "--resume", "auto")
    line = one_line_error(err)
    assert code == 2 and f"the model built from --init {init} differs" in line
    assert "hidden_dropout_prob 0.1 -> 0.0" in line and "--allow-config-change" in line
    assert not (run / "final").exists()

    caplog.clear()
    code, err = finetune(capsys, data, init, run, "--resume", "auto", "--allow-config-change")
    assert code == 0, err
    assert any("hidden_dropout_prob 0.1 -> 0.0" in r.getMessage() and r.levelname == "WARNING" for r in caplog.records)
    events = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    change = [e for e in events if e.get("event") == "config_change"]
    assert change and change[-1]["changes"]["config.json hidden_dropout_prob"] == {"old": 0.1, "new": 0.0}


def test_the_same_init_replaced_by_other_weights_of_the_same_config_resumes_bitwise(tmp_path, capsys):
    """What does not matter is not refused: a resume takes every weight from its checkpoint, so --init's weights
    (another seed, the same config.json) change nothing."""
    data = glue_dir(tmp_path, "MRPC")
    init = save_tiny_model(tmp_path / "init", dropout=0.1)
    straight, run = tmp_path / "straight", tmp_path / "run"
    for out in (straight, run):
        code, err = finetune(capsys, data, init, out)
        assert code == 0, err
    cut_after_step_2(run)
    w = load_file(str(init / "model.safetensors"))
    from safetensors.torch import save_file

    save_file({k: v + 0.01 for k, v in w.items()}, str(init / "model.safetensors"))
    code, err = finetune(capsys, data, init, run, "--resume", "auto")
    assert code == 0, err
    assert same_weights(straight, run)


def test_the_same_store_named_by_another_path_resumes_bitwise(tmp_path, capsys, monkeypatch):
    """`--data.prepared store` at the start, `/abs/path/store` (or through a symlink) at the resume: the same folder,
    so the run continues bit for bit (before: refused as a run-changing key `data.prepared: 'store' ->
    '/abs/.../store'`). A path to another folder is still a change."""
    monkeypatch.chdir(tmp_path)
    prepare(capsys, corpus(tmp_path, "a.txt"), tmp_path / "store")
    (tmp_path / "link").symlink_to(tmp_path / "store")
    straight, run = tmp_path / "straight", tmp_path / "run"
    for out in (straight, run):
        code, _, err = run_cli(capsys, *PRETRAIN, "--data.prepared", "store", "--output_dir", out)
        assert code == 0, err
    cut_after_step_2(run)
    code, _, err = run_cli(capsys, *PRETRAIN, "--data.prepared", tmp_path / "link", "--output_dir", run,
                           "--resume", "auto")
    assert code == 0, err
    assert same_weights(straight, run)
    shutil.copytree(tmp_path / "store", tmp_path / "copy")
    cut_after_step_2(run)
    code, _, err = run_cli(capsys, *PRETRAIN, "--data.prepared", tmp_path / "copy", "--output_dir", run,
                           "--resume", "auto")
    assert code == 2 and f"data.prepared: 'store' -> '{tmp_path / 'copy'}'" in err and "Traceback" not in err
