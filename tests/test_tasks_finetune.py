"""Fine-tuning end to end (tiny model: seconds; real MiniLM: a short slice), resume, two ranks, v2.0 on hand-made
unanswerable questions, and `bertrain predict` on the fine-tuned models (sharded evaluation: test_tasks_evaluate.py)."""
from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import shared_file
from distributed import launch_cli
from helpers import TINY, save_tiny_model, squad_v2_fixture, write_rte_like

from bertrain.cli import main

XQUAD = "squad/xquad-en-part1.json"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    """A randomly initialised tiny BERT (2 layers, hidden 64) with the test vocab, in HF format."""
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


# ----------------------------------------------------------------------------------------------- SQuAD

def test_squad_v1_end_to_end(tmp_path, tiny_model, capsys):
    data = shared_file(XQUAD)
    out = tmp_path / "run"
    rc = main(["finetune", "squad", "--train", str(data), "--dev", str(data), "--init", str(tiny_model),
               "--output", str(out), "--data.train_articles", "0:2", "--data.dev_articles", "23:24",
               "--data.max_seq_length", "128", "--data.doc_stride", "64", "--data.cache_dir", str(tmp_path / "c"),
               "--train.steps", "3", *TINY])
    assert rc == 0
    results = json.loads((out / "eval_results.json").read_text())
    assert set(results) >= {"exact_match", "f1", "train_steps", "eval_examples"} and results["train_steps"] == 3
    preds = json.loads((out / "predictions.json").read_text())
    nbest = json.loads((out / "nbest_predictions.json").read_text())
    dev = json.loads(data.read_text())["data"][23]
    qids = [qa["id"] for p in dev["paragraphs"] for qa in p["qas"]]
    assert sorted(preds) == sorted(qids) == sorted(nbest) and results["eval_examples"] == len(qids)
    contexts = {qa["id"]: p["context"] for p in dev["paragraphs"] for qa in p["qas"]}
    for qid, text in preds.items():  # answers are exact substrings of the original context
        assert text in contexts[qid] and 1 <= len(nbest[qid]) <= 20
        assert nbest[qid][0]["text"] == text
    assert not (out / "null_odds.json").exists()
    assert (out / "final" / "model.safetensors").is_file() and (out / "metrics.jsonl").is_file()
    assert len(list(Path(tmp_path / "c").glob("*.npz"))) == 2  # train and eval features cached
    capsys.readouterr()
    # the official evaluation of the written predictions gives the numbers in eval_results.json
    assert main(["evaluate", "squad", "--data", str(out / "dev-articles-23_24.json"),
                 "--predictions", str(out / "predictions.json")]) == 0
    official = json.loads(capsys.readouterr().out)
    assert official == pytest.approx({"exact_match": results["exact_match"], "f1": results["f1"]})


def test_squad_v2_end_to_end_with_unanswerable(tmp_path, tiny_model, capsys):
    train = squad_v2_fixture(tmp_path / "train-v2.json", 6)
    dev = squad_v2_fixture(tmp_path / "dev-v2.json", 3)
    out = tmp_path / "run"
    assert main(["finetune", "squad", "--version-2-with-negative", "--train", str(train), "--dev", str(dev),
                 "--init", str(tiny_model), "--output", str(out), "--data.max_seq_length", "64", "--data.max_query_length", "16",
                 "--data.cache_dir", "", "--train.steps", "6", *TINY]) == 0
    capsys.readouterr()
    results = json.loads((out / "eval_results.json").read_text())
    assert results["version"] == "2.0"
    assert results["HasAns_total"] == 3 and results["NoAns_total"] == 6 and results["total"] == 9
    null_odds = json.loads((out / "null_odds.json").read_text())
    preds = json.loads((out / "predictions.json").read_text())
    assert sorted(null_odds) == sorted(preds) and len(preds) == 9
    for qid, text in preds.items():  # prediction is "" exactly when the null score wins by more than 0
        assert (text == "") == (null_odds[qid] > 0.0)
    # evaluate-v2.0.py on the written files == eval_results.json; the best threshold is reproducible
    assert main(["evaluate", "squad", "--data", str(dev), "--predictions", str(out / "predictions.json"),
                 "--na-prob-file", str(out / "null_odds.json")]) == 0
    official = json.loads(capsys.readouterr().out)
    for k in ("exact", "f1", "HasAns_exact", "NoAns_f1", "best_exact", "best_f1", "best_f1_thresh"):
        assert official[k] == pytest.approx(results[k]), k
    best = json.loads((out / "predictions_best_f1_thresh.json").read_text())
    assert results["at_best_f1_thresh"]["f1"] == pytest.approx(results["best_f1"])
    assert sorted(best) == sorted(preds)
    assert json.loads((out / "final" / "task.json").read_text())["version_2_with_negative"] is True


# ----------------------------------------------------------------------------------------------- GLUE

def test_glue_mnli_matched_mismatched_and_submission(tmp_path, tiny_model, capsys):
    data = write_rte_like(tmp_path / "MNLI", task_labels=("entailment", "neutral", "contradiction"), mnli=True)
    out = tmp_path / "run"
    assert main(["finetune", "glue", "--task", "mnli", "--data-dir", str(data), "--init", str(tiny_model),
                 "--output", str(out), "--data.max_seq_length", "32", "--train.epochs", "1", *TINY]) == 0
    capsys.readouterr()
    res = json.loads((out / "eval_results.json").read_text())
    assert res["mnli-m"]["examples"] == 10 and res["mnli-mm"]["examples"] == 11
    assert 0.0 <= res["mnli-m"]["accuracy"] <= 1.0 and res["train_steps"] == 6  # 24 examples / batch 4
    for name, n in (("MNLI-m.tsv", 7), ("MNLI-mm.tsv", 9)):
        lines = (out / name).read_text().splitlines()
        assert lines[0] == "index\tprediction" and len(lines) == n + 1
        assert [l.split("\t")[0] for l in lines[1:]] == [str(i) for i in range(n)]
        assert {l.split("\t")[1] for l in lines[1:]} <= {"entailment", "neutral", "contradiction"}


def test_resume_reproduces_straight_run(tmp_path, tiny_model, capsys):
    """4 steps straight == 2 steps, checkpoint, 'crash', resume auto, 2 more steps (dropout on, RNG restored)."""
    data = write_rte_like(tmp_path / "RTE", n_train=30)
    common = ["finetune", "glue", "--task", "rte", "--data-dir", str(data), "--init", str(tiny_model),
              "--data.max_seq_length", "32", "--train.steps", "4", "--data.predict_test", "false",
              "--do_eval", "false", *TINY]
    assert main([*common, "--output", str(tmp_path / "straight")]) == 0
    resumed = tmp_path / "resumed"
    assert main([*common, "--output", str(resumed), "--checkpoint.save_interval", "2",
                 "--checkpoint.keep_last", "0"]) == 0
    assert (resumed / "step-2" / "COMPLETE").is_file() and (resumed / "step-4" / "COMPLETE").is_file()
    import shutil
    shutil.rmtree(resumed / "step-4")
    shutil.rmtree(resumed / "final")
    assert main([*common, "--output", str(resumed), "--checkpoint.save_interval", "2", "--resume", "auto"]) == 0
    capsys.readouterr()
    a = load_file(str(tmp_path / "straight" / "final" / "model.safetensors"))
    b = load_file(str(resumed / "final" / "model.safetensors"))
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)  # bitwise: the same engine resumes exactly
    init = load_file(str(tiny_model / "model.safetensors"))
    key = next(k for k in a if k.endswith("encoder.layer.0.attention.self.query.weight"))
    assert not torch.equal(a[key], init[next(k for k in init if k.endswith("layer.0.attention.self.query.weight"))])
    steps = [r["step"] for r in map(json.loads, (resumed / "metrics.jsonl").read_text().splitlines())
             if "event" not in r]  # training records (evaluations are records too)
    assert steps == [1, 2, 3, 4]  # the resumed run appends after its checkpoint, no step twice


@pytest.mark.slow
def test_distributed_finetune_two_ranks(tmp_path, tiny_model):
    """`bertrain finetune glue` on 2 gloo ranks: every dev and test example scored exactly once."""
    data = write_rte_like(tmp_path / "RTE", n_dev=11, n_test=7)
    out = tmp_path / "run"
    res = launch_cli(2, ["finetune", "glue", "--task", "rte", "--data-dir", str(data), "--init", str(tiny_model),
                         "--output", str(out), "--data.max_seq_length", "32", "--train.steps", "3", *TINY])
    for r in res:
        assert r.returncode == 0, r.stdout[-3000:]
    results = json.loads((out / "eval_results.json").read_text())
    assert results["dev"]["examples"] == 11
    lines = (out / "RTE.tsv").read_text().splitlines()[1:]
    assert [l.split("\t")[0] for l in lines] == [str(i) for i in range(7)]
    assert "2 ranks" in res[0].stdout


def test_bad_config_and_data_errors(tmp_path, tiny_model, capsys):
    base = ["finetune", "glue", "--task", "rte", "--init", str(tiny_model), "--output", str(tmp_path / "o")]
    cfg = tmp_path / "ft.yaml"
    cfg.write_text("optim:\n  nme: adamw\n")  # a typo in a config file: strict loading names the key
    assert main([*base, "--data-dir", str(tmp_path), "--config", str(cfg)]) == 2
    assert "unknown config key 'optim.nme'" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # and on the command line argparse refuses it
        main([*base, "--data-dir", str(tmp_path), "--optim.nme", "adamw"])
    assert main([*base, "--data-dir", str(tmp_path / "nowhere")]) == 2
    assert f"config key 'data.data_dir' (--data-dir): {tmp_path / 'nowhere'} does not exist" in capsys.readouterr().err
    assert main(["finetune", "glue", "--task", "xnli", "--data-dir", ".", "--init", ".", "--output", "o"]) == 2
    assert "unknown GLUE task 'xnli'" in capsys.readouterr().err
    assert main(["finetune", "squad", "--init", str(tiny_model), "--output", str(tmp_path / "o")]) == 2
    assert "data.train_file" in capsys.readouterr().err


def test_a_max_seq_length_beyond_the_models_positions_is_refused_before_any_work(tmp_path, capsys):
    """Before: SQuAD built every feature, failed at the first batch holding a 128-token window ('sequence length
    128 exceeds max_position_embeddings 64') and left a folder the corrected command refused as a run to resume;
    GLUE, whose inputs happened to be short, finished and exported a task.json of 128 that the model cannot take."""
    from bertrain.model.bert import BertConfig, BertModel
    from bertrain.model.hf import tokenizer_files_from_vocab
    from conftest import ASSETS

    torch.manual_seed(0)
    vocab = ASSETS / "vocab-tiny.txt"
    model = BertModel(BertConfig.from_preset("tiny", vocab_size=sum(1 for _ in open(vocab, encoding="utf-8")),
                                             max_position_embeddings=64))
    model.tokenizer_files = tokenizer_files_from_vocab(vocab, do_lower_case=True)
    model.save_pretrained(tmp_path / "m64")
    context = " ".join(["ann sat on the mat in the house ."] * 12)  # ~110 tokens: windows of 128 are needed
    data = {"version": "1.1", "data": [{"title": "t", "paragraphs": [{"context": context, "qas": [
        {"id": f"q{i}", "question": "who sat ?", "answers": [{"text": "ann", "answer_start": 0}]}
        for i in range(4)]}]}]}
    (tmp_path / "s.json").write_text(json.dumps(data))
    out = tmp_path / "out"
    squad = ["finetune", "squad", "--train", str(tmp_path / "s.json"), "--dev", str(tmp_path / "s.json"),
             "--init", str(tmp_path / "m64"), "--output", str(out), "--train.steps", "1", "--data.cache_dir", "",
             "--data.max_query_length", "8", *TINY]
    capsys.readouterr()
    assert main([*squad, "--data.max_seq_length", "128"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == (f"bertrain finetune: error: config key 'data.max_seq_length' (128) exceeds the "
                   f"max_position_embeddings (64) of the model to fine-tune ({tmp_path / 'm64'}): use 64 or less")
    assert not (out / "metrics.jsonl").exists()
    assert main([*squad, "--data.max_seq_length", "64"]) == 0  # the corrected command, into the same folder
    assert json.loads((out / "final" / "task.json").read_text())["max_seq_length"] == 64

    rte = write_rte_like(tmp_path / "RTE", n_train=8, n_dev=4, n_test=2)
    assert main(["finetune", "glue", "--task", "rte", "--data-dir", str(rte), "--init", str(tmp_path / "m64"),
                 "--output", str(tmp_path / "g"), "--train.steps", "1", "--data.max_seq_length", "128", *TINY]) == 2
    assert "config key 'data.max_seq_length' (128) exceeds" in capsys.readouterr().err
    assert not (tmp_path / "g" / "final").exists()


# ----------------------------------------------------------------------------------------------- real weights

@pytest.mark.slow
def test_real_minilm_short_mrpc_finetune_and_predict(tmp_path, minilm_path, capsys):
    """The real weights on a slice of the real MRPC (first 48 train / 64 dev lines, copied to a temp folder with
    their header and byte-order mark): fine-tune 3 steps, evaluate, export, predict."""
    src = shared_file("glue/MRPC/train.tsv").parent
    data = tmp_path / "MRPC"
    data.mkdir()
    for name, n in (("train.tsv", 48), ("dev.tsv", 64)):
        lines = (src / name).read_bytes().split(b"\n")
        (data / name).write_bytes(b"\n".join(lines[: n + 1]) + b"\n")
    out = tmp_path / "mrpc"
    assert main(["finetune", "glue", "--task", "mrpc", "--data-dir", str(data), "--init", str(minilm_path),
                 "--output", str(out), "--data.max_seq_length", "64", "--train.steps", "3",
                 "--train.micro_batch_size", "16"]) == 0
    capsys.readouterr()
    res = json.loads((out / "eval_results.json").read_text())
    assert res["dev"]["examples"] == 64 and {"accuracy", "f1", "majority_baseline_accuracy"} <= set(res["dev"])
    assert res["train_examples"] == 48 and res["train_steps"] == 3 and "test_predictions" not in res
    # the exported model predicts with the task's label names, from the Python API
    from bertrain.deploy.predict import Predictor
    p = Predictor(out / "final")
    recs = p.predict([{"text": "The cat sat.", "text_pair": "A cat was sitting."},
                      {"text": "Hello there.", "text_pair": "Hi."}])
    assert [r["label"] in ("0", "1") for r in recs] == [True, True]
    assert all(abs(sum(r["probabilities"].values()) - 1) < 1e-5 for r in recs)
    # MRPC reads sentence pairs: one sentence alone would get a label that means nothing
    with pytest.raises(ValueError, match="^item 1: the model was fine-tuned on mrpc, a sentence-pair task"):
        p.predict([{"text": "The cat sat.", "text_pair": "A cat was sitting."}, {"text": "Hello there."}])


# ----------------------------------------------------------------------------------------------- predict

def test_predict_command_qa(tmp_path, tiny_model, capsys, monkeypatch):
    train = squad_v2_fixture(tmp_path / "train.json", 2)
    out = tmp_path / "run"
    assert main(["finetune", "squad", "--train", str(train), "--init", str(tiny_model), "--output", str(out),
                 "--data.max_seq_length", "64", "--data.max_query_length", "16", "--data.cache_dir", "", "--train.steps", "1",
                 "--do_eval", "false", "--version-2-with-negative", *TINY]) == 0
    model = out / "final"
    items = tmp_path / "in.jsonl"
    ctx = "ann sat on the mat in the house ."
    items.write_text("\n".join(json.dumps({"id": f"x{i}", "question": "who sat ?", "context": ctx})
                               for i in range(5)) + "\n\n")
    capsys.readouterr()
    assert main(["predict", "--model", str(model), "--input", str(items), "--batch-size", "2"]) == 0
    cap = capsys.readouterr()
    recs = [json.loads(l) for l in cap.out.splitlines()]
    assert [r["id"] for r in recs] == [f"x{i}" for i in range(5)]
    for r in recs:
        assert "null_score_diff" in r and (r["answer"] == "" or r["answer"] in ctx)
        if r["answer"]:
            assert ctx[r["start"]:r["end"]] == r["answer"]
    assert "5 examples in" in cap.err and "examples/s" in cap.err
    # stdin, TSV
    monkeypatch.setattr(sys, "stdin", io.StringIO(f"who sat ?\t{ctx}\n"))
    assert main(["predict", "--model", str(model), "--format", "tsv", "--input", "-"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 1
    # a malformed line names the file and the line
    items.write_text(json.dumps({"question": "q", "context": "c"}) + "\n{oops\n")
    assert main(["predict", "--model", str(model), "--input", str(items)]) == 2
    assert f"{items}:2: malformed JSON" in capsys.readouterr().err
    # two items with the same id: each answered from its own context, as when asked alone
    from bertrain.deploy.predict import Predictor
    predictor = Predictor(model)
    a = {"id": "u", "question": "who sat ?", "context": ctx}
    b = {"id": "u", "question": "where is the cat ?", "context": "the cat is in the garden by the big tree ."}
    alone = [predictor.predict_qa([x])[0] for x in (a, b)]
    assert alone[0] != alone[1] and predictor.predict_qa([a, b]) == alone


# ----------------------------------------------------------------------------------------------- shipped configs

@pytest.mark.parametrize("name, cls_name", [("finetune-squad.yaml", "SquadFinetuneConfig"),
                                            ("finetune-glue.yaml", "GlueFinetuneConfig")])
def test_shipped_finetune_configs_load(name, cls_name):
    from bertrain import config as C
    from bertrain.tasks import finetune as F

    path = Path(__file__).resolve().parents[1] / "configs" / name
    required = {"init": "m", "output_dir": "o"}
    required.update({"data.train_file": "t.json", "data.dev_file": "d.json"} if "squad" in name else
                    {"data.task": "mrpc", "data.data_dir": "d"})
    cfg = C.load_config(getattr(F, cls_name), path, required)
    assert cfg.schedule.warmup == 0.1 and cfg.optim.name == "adamw" and cfg.optim.weight_decay == 0.01
    from bertrain.train.config import resolve_batch  # the recipe's batch of 32 on 1 or 2 ranks (it was 32 x ranks)
    assert [resolve_batch(cfg.train, w).global_batch_size for w in (1, 2)] == [32, 32]


def test_squad_labels_and_postprocessing_agree_tiny_overfit(tmp_path, tiny_model, capsys):
    """Train and evaluate on the same hand-made v1.1 questions: if the start/end labels, the windows and the
    offset mapping of the predictions agree, the tiny model fits them exactly (an off-by-one anywhere -> EM 0)."""
    data = squad_v2_fixture(tmp_path / "v2.json", 6)
    v1 = json.loads(data.read_text())
    for p in v1["data"][0]["paragraphs"]:
        p["qas"] = [qa for qa in p["qas"] if not qa["is_impossible"]]
        for qa in p["qas"]:
            qa.pop("is_impossible")
    v1["version"] = "1.1"
    data.write_text(json.dumps(v1))
    out = tmp_path / "run"
    assert main(["finetune", "squad", "--train", str(data), "--dev", str(data), "--init", str(tiny_model),
                 "--output", str(out), "--data.max_seq_length", "48", "--data.max_query_length", "16",
                 "--data.doc_stride", "8", "--data.cache_dir", "", "--train.steps", "60",
                 "--schedule.warmup", "0.0", *TINY]) == 0
    capsys.readouterr()
    res = json.loads((out / "eval_results.json").read_text())
    assert res["exact_match"] == 100.0 and res["f1"] == 100.0
