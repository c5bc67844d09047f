"""Deployment as a user runs it: a fine-tuned model exported and predicted with, edge inputs of `bertrain predict`,
wrong --device names, and `bertrain inspect`'s number options (each a bug found by an audit, with its fix)."""
from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from conftest import shared_file
from helpers import TINY, save_tiny_head_model, save_tiny_model

from bertrain.cli import main

XQUAD = "squad/xquad-en-part1.json"


def _tiny_head_model(cls, folder: Path, positions: int = 64, task: dict | None = None) -> Path:
    return save_tiny_head_model(cls, folder, positions, task)


def _last_error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return err.strip().splitlines()[-1]


# ----------------------------------------------------------------------------------------------- export keeps task.json

def test_an_exported_fine_tuned_model_predicts_what_its_run_evaluated(tmp_path, capsys):
    """`bertrain export runs/squad/final hub/squad` wrote no task.json: `bertrain predict --model hub/squad` then
    read contexts in 384-token windows with stride 128 instead of the run's 128/64 and gave other answers than the
    run's dev predictions (13 of 25 on XQuAD with a fine-tuned MiniLM); a SQuAD v2.0 model lost its null answer.
    Now the HF export keeps task.json, as the ONNX export does, with the answer decoding the run evaluated with
    (data.max_answer_length here 3: predict read 30, and had no option for it), and the exported model answers as
    evaluated; a best/ or step-N folder (no task.json of its own) gets its run's."""
    data = shared_file(XQUAD)
    tiny = save_tiny_model(tmp_path / "tiny")
    run = tmp_path / "run"
    assert main(["finetune", "squad", "--train", str(data), "--dev", str(data), "--init", str(tiny),
                 "--output", str(run), "--data.train_articles", "0:1", "--data.dev_articles", "23:24",
                 "--data.max_seq_length", "64", "--data.doc_stride", "32", "--data.max_query_length", "16",
                 "--data.max_answer_length", "3", "--data.cache_dir", "", "--train.steps", "2", *TINY]) == 0
    hub = tmp_path / "hub"
    assert main(["export", str(run / "final"), str(hub)]) == 0
    task = json.loads((run / "final" / "task.json").read_text())
    # with the answer decoding the run evaluated with (final/ and best/ hold it: predict reads them as they are)
    assert {k: task[k] for k in ("n_best_size", "max_answer_length", "null_score_diff_threshold")} == \
        {"n_best_size": 20, "max_answer_length": 3, "null_score_diff_threshold": 0.0}
    assert json.loads((hub / "task.json").read_text()) == task
    assert json.loads((run / "best" / "task.json").read_text()) == task

    dev = json.loads((run / "dev-articles-23_24.json").read_text())
    items = tmp_path / "dev.jsonl"
    items.write_text("".join(json.dumps({"id": qa["id"], "question": qa["question"], "context": p["context"]}) + "\n"
                             for a in dev["data"] for p in a["paragraphs"] for qa in p["qas"]))
    capsys.readouterr()
    assert main(["predict", "--model", str(hub), "--input", str(items)]) == 0
    answers = {r["id"]: r["answer"] for r in map(json.loads, capsys.readouterr().out.splitlines())}
    reference = json.loads((run / "predictions.json").read_text())
    assert answers == reference
    # the SQuAD file itself (answers optional, as a hidden test set's): the official predictions.json, scored by
    # `bertrain evaluate` as the run scored it
    stripped = tmp_path / "test.json"
    stripped.write_text(json.dumps({"version": "1.1", "data": [
        {"title": a.get("title", ""), "paragraphs": [
            {"context": p["context"], "qas": [{"id": qa["id"], "question": qa["question"]} for qa in p["qas"]]}
            for p in a["paragraphs"]]} for a in dev["data"]]}))
    for source in (run / "dev-articles-23_24.json", stripped):
        assert main(["predict", "--model", str(hub), "--input", str(source), "--output", str(tmp_path / "p.json")]) == 0
        assert json.loads((tmp_path / "p.json").read_text()) == reference
    capsys.readouterr()
    assert main(["evaluate", "squad", "--data", str(run / "dev-articles-23_24.json"), "--predictions",
                 str(tmp_path / "p.json")]) == 0
    scored, ran = json.loads(capsys.readouterr().out), json.loads((run / "eval_results.json").read_text())
    assert (scored["exact_match"], scored["f1"]) == (ran["exact_match"], ran["f1"])
    for folder in ("final", "best"):  # the run's own folders answer as evaluated too
        assert main(["predict", "--model", str(run / folder), "--input", str(items)]) == 0
        assert {r["id"]: r["answer"] for r in map(json.loads, capsys.readouterr().out.splitlines())} == reference
    # --max-answer-length overrides task.json
    assert main(["predict", "--model", str(run / "final"), "--input", str(items), "--max-answer-length", "30"]) == 0
    assert {r["id"]: r["answer"] for r in map(json.loads, capsys.readouterr().out.splitlines())} != reference

    # a step-N folder holds no task.json: its export gets the run's (final/'s, else the one its config.yaml implies)
    for source in ("best", "step-2"):
        assert main(["export", str(run / source), str(tmp_path / f"hub-{source}")]) == 0
        assert json.loads((tmp_path / f"hub-{source}" / "task.json").read_text()) == task
    (run / "final").rename(tmp_path / "final-aside")
    assert main(["export", str(run), str(tmp_path / "hub-run")]) == 0  # the run folder: its last step-N
    assert json.loads((tmp_path / "hub-run" / "task.json").read_text()) == task
    pytest.importorskip("onnxscript", reason="needs the deploy extra: pip install 'bertrain[deploy]'")
    assert main(["export", str(run / "best"), str(tmp_path / "onnx"), "--format", "onnx"]) == 0
    assert json.loads((tmp_path / "onnx" / "task.json").read_text()) == task


def test_an_in_place_export_keeps_task_json(tmp_path):
    """`bertrain export final final --overwrite` (to add a license) dropped the folder's task.json."""
    from bertrain.deploy.predict import Predictor
    from bertrain.model.bert import BertForQuestionAnswering

    task = {"kind": "qa", "task": "squad", "version_2_with_negative": True, "max_seq_length": 48, "doc_stride": 16,
            "max_query_length": 8}
    src = _tiny_head_model(BertForQuestionAnswering, tmp_path / "final", task=task)
    assert main(["export", str(src), str(src), "--overwrite", "--license", "mit"]) == 0
    assert json.loads((src / "task.json").read_text()) == task
    p = Predictor(src)
    assert p.version_2_with_negative and p.max_seq_length == 48
    (rec,) = p.predict([{"question": "who sat ?", "context": "ann sat on the mat ."}])
    assert "null_score_diff" in rec


# ----------------------------------------------------------------------------------------------- predict inputs

@pytest.fixture(scope="module")
def mrpc_like(tmp_path_factory) -> Path:
    from bertrain.model.bert import BertForSequenceClassification

    return _tiny_head_model(BertForSequenceClassification, tmp_path_factory.mktemp("mrpc") / "final",
                            task={"kind": "classification", "task": "mrpc", "labels": ["0", "1"],
                                  "max_seq_length": 32})


def test_a_pair_model_given_one_sentence_is_refused_naming_the_line(mrpc_like, tmp_path, capsys):
    """An MRPC model (sentence pairs) fed a file whose second column is missing classified the lone sentences
    silently: numbers that mean nothing, as fine-tuning and evaluation never gave it a single sentence. Now the
    line is named (exit 2); CRLF line ends and blank lines do not count as a column."""
    items = tmp_path / "in.jsonl"
    items.write_bytes(b'{"text": "the cat sat", "text_pair": "a cat was sitting"}\r\n\r\n  \r\n{"text": "alone"}\r\n')
    assert main(["predict", "--model", str(mrpc_like), "--input", str(items)]) == 2
    assert _last_error_line(capsys) == (f"bertrain predict: error: {items}:4: the model was fine-tuned on mrpc, a "
                                        "sentence-pair task: give 'text' and 'text_pair' (TSV: text<TAB>text_pair)")
    tsv = tmp_path / "in.tsv"
    tsv.write_text("the cat sat\ta cat was sitting\nalone\n")
    assert main(["predict", "--model", str(mrpc_like), "--input", str(tsv)]) == 2
    assert f"{tsv}:2: the model was fine-tuned on mrpc, a sentence-pair task" in _last_error_line(capsys)
    assert main(["predict", "--model", str(mrpc_like), "--text", "alone"]) == 2
    assert _last_error_line(capsys).endswith("a sentence-pair task: give --text and --text-pair")
    # the pairs alone are predicted
    items.write_bytes(b'{"text": "the cat sat", "text_pair": "a cat was sitting"}\r\n')
    assert main(["predict", "--model", str(mrpc_like), "--input", str(items)]) == 0
    assert [r["label"] in ("0", "1") for r in map(json.loads, capsys.readouterr().out.splitlines())] == [True]


def test_a_single_sentence_model_given_a_pair_is_refused(tmp_path, capsys):
    from bertrain.deploy.predict import read_items
    from bertrain.model.bert import BertForSequenceClassification

    sst2 = _tiny_head_model(BertForSequenceClassification, tmp_path / "sst2",
                            task={"kind": "classification", "task": "sst2", "labels": ["0", "1"],
                                  "max_seq_length": 32})
    assert main(["predict", "--model", str(sst2), "--text", "a fine film", "--text-pair", "why"]) == 2
    assert _last_error_line(capsys).endswith("sst2, a single-sentence task: give --text alone, without --text-pair")
    f = io.StringIO('{"sentence": "a fine film"}\n{"sentence1": "a", "sentence2": "b"}\n')
    with pytest.raises(ValueError, match=r"^x.jsonl:2: the model was fine-tuned on sst2, a single-sentence task"):
        list(read_items(f, "x.jsonl", "jsonl", "classification", pair=False, task_name="sst2"))
    # a model whose task is unknown takes both
    f = io.StringIO('{"text": "a"}\n{"text": "a", "text_pair": "b"}\n')
    assert len(list(read_items(f, "x.jsonl", "jsonl", "classification"))) == 2


def test_command_line_text_that_is_not_utf8_is_one_line(mrpc_like, capsys):
    """`bertrain predict --text $'ab\\xffc'` (a Latin-1 shell, a pasted byte): Python keeps the byte as a lone
    surrogate and the tokenizer raised TypeError ("TextInputSequence must be str"), a traceback and exit 1."""
    assert main(["predict", "--model", str(mrpc_like), "--text", "ab\udcffc", "--text-pair", "x"]) == 2
    assert _last_error_line(capsys) == ("bertrain predict: error: --text: not UTF-8 text (byte 0xff at character 3): "
                                        "give it as UTF-8 (e.g. convert with iconv -f latin1 -t utf-8)")
    assert main(["predict", "--model", str(mrpc_like), "--text", "ab", "--text-pair", "caf\udce9"]) == 2
    assert "--text-pair: not UTF-8 text (byte 0xe9 at character 4)" in _last_error_line(capsys)


@pytest.mark.parametrize("text, message", [
    ('{"kind": ', "not valid JSON (Expecting value: line 2 column 1 (char 10))"),
    ('["classification"]', "expected a JSON object, got list"),
    ('{"kind": "classification", "max_seq_length": "64"}', "'max_seq_length' must be a positive integer, got '64'"),
    ('{"kind": "classification", "labels": [0, 1]}', "'labels' must be a list of label names (strings), got [0, 1]"),
    ('{"kind": "cls"}', "'kind' is 'cls', not qa, classification or regression"),
])
def test_a_damaged_task_json_is_named(tmp_path, capsys, text, message):
    """A damaged task.json was a bare "Expecting value: line 2 column 1" or "invalid literal for int()" naming
    neither file nor key, and one holding a list a traceback (AttributeError, exit 1)."""
    from bertrain.model.bert import BertForSequenceClassification

    folder = _tiny_head_model(BertForSequenceClassification, tmp_path / "cls")
    (folder / "task.json").write_text(text + "\n")
    assert main(["predict", "--model", str(folder), "--text", "a"]) == 2
    assert _last_error_line(capsys) == (f"bertrain predict: error: {folder / 'task.json'}: {message}: fix it, or "
                                        "remove it (the head in config.json then decides the task, with the "
                                        "default lengths)")


def test_a_context_without_tokens_is_named_by_the_items_id(tmp_path):
    """A context of zero-width or control characters only passes the empty check but has no tokens; the error
    named "question id K", K its position in the current chunk of 256 (item 290 was "question id 34"), not the
    item. Now it names the item's id."""
    from bertrain.deploy.predict import Predictor
    from bertrain.model.bert import BertForQuestionAnswering

    qa = _tiny_head_model(BertForQuestionAnswering, tmp_path / "qa")
    items = [{"id": "a", "question": "who sat ?", "context": "ann sat ."},
             {"id": "u7", "question": "who sat ?", "context": "\u200b\u0000"}]
    with pytest.raises(ValueError, match=r"^item u7: the context has no tokens"):
        Predictor(qa).predict(items)


def test_a_qa_window_without_room_for_the_context_is_refused_at_load(tmp_path, capsys):
    """`--max-seq-length 40` on a QA model trained with 64 question tokens failed only at the first input, naming
    max_query_length, which predict has no option for (`bertrain serve` answered every request 422). Now the load
    fails, naming --max-seq-length and the least that works; that length then predicts."""
    from bertrain.deploy.predict import Predictor
    from bertrain.model.bert import BertForQuestionAnswering

    qa = _tiny_head_model(BertForQuestionAnswering, tmp_path / "qa", positions=128,
                          task={"kind": "qa", "task": "squad", "max_seq_length": 128, "doc_stride": 32,
                                "max_query_length": 64})
    with pytest.raises(ValueError, match=r"^--max-seq-length 40 leaves no room for the context after the question "
                                         r"\(up to 64 tokens: max_query_length in task.json\) and 3 special tokens: "
                                         r"use --max-seq-length 68 or more$"):
        Predictor(qa, max_seq_length=40)
    assert main(["predict", "--model", str(qa), "--max-seq-length", "67", "--input", str(tmp_path / "absent")]) == 2
    assert "use --max-seq-length 68 or more" in _last_error_line(capsys)
    (rec,) = Predictor(qa, max_seq_length=68).predict([{"question": "who sat ?", "context": "ann sat on the mat ."}])
    assert rec["answer"] == "ann sat on the mat ."[rec["start"]:rec["end"]]
    (qa / "task.json").unlink()  # without task.json: half the window for the question
    with pytest.raises(ValueError, match=r"--max-seq-length 6 .*half the window.*use --max-seq-length 7 or more"):
        Predictor(qa, max_seq_length=6)
    assert Predictor(qa, max_seq_length=7).predict([{"question": "who ?", "context": "ann sat ."}])


@pytest.mark.parametrize("backend, device, message", [
    ("torch", "gpu", "--device gpu: not a device name; use cpu, cuda or cuda:N"),
    ("onnxruntime", "gpu", "--device gpu: not a device name; use cpu, cuda or cuda:N"),
    ("torch", "cuda:99", "--device cuda:99: "),
])
def test_a_wrong_device_is_one_line(mrpc_like, capsys, device, message, backend):
    """--device gpu (a name torch does not know) or a GPU that is not there was a traceback and exit 1 (torch's
    RuntimeError, or "AssertionError: Torch not compiled with CUDA enabled" from moving the model)."""
    if backend == "onnxruntime":
        pytest.importorskip("onnxruntime", reason="needs the deploy extra: pip install 'bertrain[deploy]'")
    assert main(["predict", "--model", str(mrpc_like), "--backend", backend, "--text", "a", "--text-pair", "b",
                 "--device", device]) == 2
    assert _last_error_line(capsys).startswith(f"bertrain predict: error: {message}")


def test_cuda_without_a_gpu_is_one_line(mrpc_like, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is visible: --device cuda works here")
    assert main(["predict", "--model", str(mrpc_like), "--text", "a", "--text-pair", "b", "--device", "cuda"]) == 2
    assert _last_error_line(capsys) == (
        "bertrain predict: error: --device cuda: PyTorch sees no CUDA GPU here (torch.cuda.is_available() is False: "
        "no GPU, no driver, CUDA_VISIBLE_DEVICES empty or a CPU-only torch); use --device cpu")


# ----------------------------------------------------------------------------------------------- inspect

@pytest.mark.parametrize("flag, value, message", [
    ("--max-seq-length", "0", "--max-seq-length must be >= 1, got 0"),
    ("--max-predictions-per-seq", "0", "--max-predictions-per-seq must be >= 1, got 0"),
    ("--samples", "-1", "--samples must be >= 0, got -1"),
    ("--epoch", "-1", "--epoch must be >= 0, got -1"),
])
def test_inspect_refuses_numbers_it_used_to_ignore(tmp_path, capsys, flag, value, message):
    """`bertrain inspect DIR --max-seq-length 0` showed the default 128-token samples (0 was read as "not
    given"); --epoch -1 and --samples -1 were taken silently."""
    assert main(["inspect", str(tmp_path / "prepared"), flag, value]) == 2
    assert _last_error_line(capsys) == f"bertrain inspect: error: {message}"


# ----------------------------------------------------------------------------------------------- ONNX export

def test_an_opset_onnx_runtime_cannot_run_is_one_line(tmp_path, capsys, monkeypatch):
    """`bertrain export --format onnx --opset 23` (or 30) wrote a graph that this ONNX Runtime could not run (23:
    its Attention operator failed; 30: an invalid graph): a traceback and exit 1 from the verification. Now the
    error says which opset ONNX Runtime could not run and to use the default; nothing is written. (Simulated with
    ONNX Runtime's own exception class: which opsets fail depends on the versions installed.)"""
    pytest.importorskip("onnxscript", reason="needs the deploy extra: pip install 'bertrain[deploy]'")
    fail = pytest.importorskip("onnxruntime.capi.onnxruntime_pybind11_state").Fail
    from bertrain.deploy import onnx_export
    from bertrain.model.bert import BertForSequenceClassification

    src = _tiny_head_model(BertForSequenceClassification, tmp_path / "cls")

    def cannot_run(self, inputs):
        raise fail("[ONNXRuntimeError] : 1 : FAIL : Non-zero status code returned while running Attention node.")

    monkeypatch.setattr(onnx_export.OnnxRuntimeBackend, "run", cannot_run)
    assert main(["export", str(src), str(tmp_path / "o"), "--format", "onnx", "--opset", "23"]) == 2
    line = _last_error_line(capsys)
    assert line.startswith(f"bertrain export: error: ONNX export of {src}: ONNX Runtime ")
    assert "cannot run the opset 23 graph (Fail: [ONNXRuntimeError] : 1 : FAIL : Non-zero status" in line
    assert line.endswith("nothing was written: use the default --opset 18")
    assert not (tmp_path / "o").exists()


def test_a_model_with_few_positions_exports_to_onnx(tmp_path, capsys):
    """A 64-position model failed `export --format onnx` ("sequence length 129 exceeds max_position_embeddings
    64"): the verification's longest pair was not cut to the model's positions. And the ONNX folder copied a
    tokenizer_config.json whose model_max_length (512) exceeded the graph's positions, which the HF export caps:
    transformers' tokenizer then made inputs the graph refuses. Both fixed; the export verifies and predicts."""
    pytest.importorskip("onnxscript", reason="needs the deploy extra: pip install 'bertrain[deploy]'")
    from bertrain.deploy.predict import Predictor
    from bertrain.model.bert import BertForSequenceClassification

    src = _tiny_head_model(BertForSequenceClassification, tmp_path / "cls", positions=64)
    config = json.loads((src / "tokenizer_config.json").read_text())
    (src / "tokenizer_config.json").write_text(json.dumps({**config, "model_max_length": 512}))
    assert main(["export", str(src), str(tmp_path / "onnx"), "--format", "onnx"]) == 0
    meta = json.loads((tmp_path / "onnx" / "onnx.json").read_text())
    assert max(b[1] for b in meta["verification"]["batches"]) == 64 and meta["verification"]["max_abs_diff"] < 1e-4
    assert json.loads((tmp_path / "onnx" / "tokenizer_config.json").read_text())["model_max_length"] == 64
    long = [{"text": " ".join(["the cat sat on the mat ."] * 20)}, {"text": "a dog"}]
    torch_side = Predictor(src).predict(long)
    onnx_side = Predictor(tmp_path / "onnx", backend="onnxruntime").predict(long)
    assert [r["label"] for r in onnx_side] == [r["label"] for r in torch_side]
    assert max(abs(a["score"] - b["score"]) for a, b in zip(onnx_side, torch_side)) < 1e-5


def test_an_encoder_without_a_pooler_exports_its_hidden_states(tmp_path, capsys):
    """An encoder saved without pooler weights (transformers' BertModel(add_pooling_layer=False), as many sentence
    encoders are) was refused by `export --format onnx` ("no trained weights for the pooler ... export a
    fine-tuned model"). Its hidden states are what it has: they are exported, equal to transformers' on the
    original folder at every real token."""
    pytest.importorskip("onnxscript", reason="needs the deploy extra: pip install 'bertrain[deploy]'")
    import numpy as np
    import onnxruntime as ort
    import torch
    import transformers
    from safetensors.torch import load_file, save_file

    from bertrain.model.bert import BertModel

    src = _tiny_head_model(BertModel, tmp_path / "enc")
    weights = {k: v for k, v in load_file(src / "model.safetensors").items() if not k.startswith("pooler.")}
    save_file(weights, src / "model.safetensors", metadata={"format": "pt"})
    capsys.readouterr()
    assert main(["export", str(src), str(tmp_path / "onnx"), "--format", "onnx"]) == 0
    assert f"{src} has no pooler weights: exporting last_hidden_state only" in capsys.readouterr().out
    assert json.loads((tmp_path / "onnx" / "onnx.json").read_text())["outputs"] == ["last_hidden_state"]
    sess = ort.InferenceSession(str(tmp_path / "onnx" / "model.onnx"), providers=["CPUExecutionProvider"])
    ids = torch.randint(5, 100, (3, 37), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 20:] = 0
    types = torch.zeros_like(ids)
    (h,) = sess.run(None, {"input_ids": ids.numpy(), "token_type_ids": types.numpy(), "attention_mask": mask.numpy()})
    hf = transformers.BertModel.from_pretrained(src, add_pooling_layer=False).eval()
    with torch.no_grad():
        ref = hf(input_ids=ids, token_type_ids=types, attention_mask=mask).last_hidden_state.numpy()
    assert np.abs(h - ref)[mask.bool().numpy()].max() < 1e-5


def test_a_last_batch_as_short_as_the_number_of_classes_is_classified(tmp_path):
    """A text of characters the tokenizer drops ([CLS] [SEP]: 2 tokens) alone in the last batch of a 2-class model:
    its logits were padded out as if they were per-token QA logits, and joining the batches failed."""
    from bertrain.deploy.predict import Predictor
    from bertrain.model.bert import BertForSequenceClassification

    cola = _tiny_head_model(BertForSequenceClassification, tmp_path / "cola",
                            task={"kind": "classification", "task": "cola", "labels": ["0", "1"],
                                  "max_seq_length": 32})
    items = [{"text": "the film is good ."}, {"text": "a bad movie ."}, {"text": "\u200b\u200b"}]
    small, whole = Predictor(cola, batch_size=2).predict(items), Predictor(cola, batch_size=4).predict(items)
    assert [r["label"] for r in small] == [r["label"] for r in whole] and len(small) == 3


@pytest.mark.parametrize("settings", [{"strip_accents": False}, {"strip_accents": True, "do_lower_case": False},
                                      {"tokenize_chinese_chars": False}])
def test_the_basic_tokenizer_settings_of_tokenizer_config_are_those_of_transformers(minilm_path, tmp_path, settings):
    """strip_accents and tokenize_chinese_chars in tokenizer_config.json were ignored: an uncased model saved with
    strip_accents false (accents kept) got other ids than in transformers."""
    import shutil

    transformers = pytest.importorskip("transformers")
    from bertrain.tasks.common import load_task_tokenizer

    folder = tmp_path / "tok"
    folder.mkdir()
    shutil.copy(minilm_path / "vocab.txt", folder / "vocab.txt")
    (folder / "tokenizer_config.json").write_text(json.dumps({"do_lower_case": True, **settings,
                                                              "tokenizer_class": "BertTokenizer"}))
    texts = ["Café déjà vu", "Ǆ ß İstanbul ﬁ", "東京 and 北京", "naïve Ärger"]
    hf = transformers.AutoTokenizer.from_pretrained(folder)
    ours = load_task_tokenizer(folder)
    assert [e.ids for e in ours.encode_plain(texts)] == [hf(t, add_special_tokens=False)["input_ids"] for t in texts]
    assert ours.identity != load_task_tokenizer(minilm_path).identity


def test_serve_refuses_one_sentence_for_a_pair_model_naming_the_item(mrpc_like):
    """The API (and `serve`) classified one sentence with a sentence-pair model: a label that means nothing."""
    pytest.importorskip("fastapi", reason="needs the deploy extra: pip install 'bertrain[deploy]'")
    from fastapi.testclient import TestClient

    from bertrain.deploy.config import ServeConfig
    from bertrain.deploy.predict import Predictor
    from bertrain.deploy.server import create_app

    with TestClient(create_app(Predictor(mrpc_like), ServeConfig())) as c:
        ok = c.post("/predict", json={"text": "a cat sat .", "text_pair": "the cat sat ."})
        assert ok.status_code == 200 and ok.json()["label"] in ("equivalent", "not_equivalent", "0", "1")
        bad = c.post("/predict", json=[{"text": "a", "text_pair": "b"}, {"text": "alone", "id": "q7"}])
        assert bad.status_code == 422
        assert bad.json()["error"] == "item 1: the model was fine-tuned on mrpc, a sentence-pair task: give 'text' " \
                                      "and 'text_pair'"


def test_a_squad_v2_file_gives_the_official_predictions_and_null_odds(tmp_path, capsys):
    """`bertrain predict --input dev.json` (a SQuAD v2.0 file) -> predictions.json and its null odds, those the
    fine-tuning run wrote for the same file; a repeated question id and a classifier are refused."""
    from helpers import finetune_argv, finetune_data

    data, model = finetune_data("squad", tmp_path / "data"), save_tiny_model(tmp_path / "init")
    run = tmp_path / "run"
    assert main(finetune_argv("squad", data, model, run, 2)) == 0
    out = tmp_path / "out" / "preds.json"
    out.parent.mkdir()
    assert main(["predict", "--model", str(run / "final"), "--input", str(data / "dev.json"), "--output",
                 str(out)]) == 0
    assert json.loads(out.read_text()) == json.loads((run / "predictions.json").read_text())
    odds = json.loads((tmp_path / "out" / "preds.null_odds.json").read_text())
    assert odds.keys() == json.loads((run / "null_odds.json").read_text()).keys()
    for k, v in json.loads((run / "null_odds.json").read_text()).items():
        assert abs(odds[k] - v) < 1e-4
    assert "--na-prob-file" in capsys.readouterr().err
    twice = json.loads((data / "dev.json").read_text())
    qas = twice["data"][0]["paragraphs"][0]["qas"]
    qas.append(dict(qas[0]))
    (tmp_path / "twice.json").write_text(json.dumps(twice))
    assert main(["predict", "--model", str(run / "final"), "--input", str(tmp_path / "twice.json")]) == 2
    assert f"question id {qas[0]['id']} appears twice" in _last_error_line(capsys)
