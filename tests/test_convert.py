"""HF folders in and out: bit-identical round trips, transformers loading our exports cleanly, old checkpoint
layouts, clear errors on bad folders, and the `convert` / `export` / `info` commands."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from bertrain import BertForPreTraining, BertForQuestionAnswering, BertForSequenceClassification, BertModel
from bertrain.cli import main
from bertrain.model.hf import load_hf_state_dict, tokenizer_files_from_vocab

transformers = pytest.importorskip("transformers")

VOCAB = 99
WORDS = ["hello", "world", "the", "cat", "sat", "on", "mat", "##s", "un", "##aff", "##able", ",", ".", "!"]


def write_vocab(path: Path, n: int = VOCAB) -> None:
    tokens = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + WORDS
    path.write_text("\n".join(tokens + [f"[unused{i}]" for i in range(n - len(tokens))]) + "\n")


def hf_folder(tmp_path: Path, cls=None, name: str = "hf", **kw) -> Path:
    """A folder written by transformers itself (random weights, biases and LayerNorms too) plus a vocab.txt."""
    cls = cls or transformers.BertForPreTraining
    cfg = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=48, max_position_embeddings=64, **kw)
    torch.manual_seed(0)
    model = cls(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    out = tmp_path / name
    model.save_pretrained(out)
    write_vocab(out / "vocab.txt")
    return out


@pytest.fixture
def hf_logs(caplog):
    """transformers' log records, captured (it does not propagate to the root logger by default)."""
    transformers.utils.logging.enable_propagation()
    with caplog.at_level(logging.WARNING):
        yield caplog
    transformers.utils.logging.disable_propagation()


def assert_same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


# ----------------------------------------------------------------------------------------------- round trips

@pytest.mark.parametrize("hf_cls, ours_cls", [
    ("BertForPreTraining", BertForPreTraining), ("BertModel", BertModel),
    ("BertForSequenceClassification", BertForSequenceClassification),
    ("BertForQuestionAnswering", BertForQuestionAnswering),
])
def test_round_trip_is_bit_identical(tmp_path, hf_cls, ours_cls, hf_logs):
    src = hf_folder(tmp_path, getattr(transformers, hf_cls))
    model = ours_cls.from_pretrained(src)
    assert model.loading_info["initialized"] == [] and model.loading_info["unexpected_keys"] == []
    model.save_pretrained(tmp_path / "out")
    assert_same_tensors(load_file(tmp_path / "out" / "model.safetensors"), load_file(src / "model.safetensors"))
    assert (tmp_path / "out" / "vocab.txt").read_bytes() == (src / "vocab.txt").read_bytes()
    # and transformers reads it back as the same class without complaint
    hf_logs.clear()
    getattr(transformers, hf_cls).from_pretrained(tmp_path / "out")
    assert not [r for r in hf_logs.records if r.levelno >= logging.WARNING], hf_logs.text


def test_minilm_round_trip(minilm_path, tmp_path):
    model = BertModel.from_pretrained(minilm_path)
    model.save_pretrained(tmp_path / "out")
    src = load_hf_state_dict(minilm_path)
    src.pop("embeddings.position_ids")  # a buffer (arange), not a weight: transformers >= 4.31 does not save it
    assert_same_tensors(load_file(tmp_path / "out" / "model.safetensors"), src)
    for name in ("vocab.txt", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.json"):
        assert (tmp_path / "out" / name).read_bytes() == (minilm_path / name).read_bytes()


def test_transformers_loads_converted_minilm(minilm_path, tmp_path, hf_logs):
    out = tmp_path / "converted"
    assert main(["convert", str(minilm_path), str(out)]) == 0
    assert any("MLM head" in r.message for r in hf_logs.records if r.name.startswith("bertrain"))
    ours = BertForPreTraining.from_pretrained(out).eval()
    hf_logs.clear()
    tok = transformers.AutoTokenizer.from_pretrained(out)
    mlm, info = transformers.AutoModelForMaskedLM.from_pretrained(out, output_loading_info=True)
    pt, info2 = transformers.BertForPreTraining.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info2["missing_keys"] and not info2["unexpected_keys"]
    hf_warnings = "\n".join(r.getMessage() for r in hf_logs.records if r.name.startswith("transformers"))
    for word in ("MISSING", "newly initialized", "corrupted", "not initialized"):
        assert word not in hf_warnings, hf_warnings

    enc = tok(["Hello world, unaffable!", "the cat sat"], padding=True, return_tensors="pt")
    ref = transformers.AutoTokenizer.from_pretrained(minilm_path)(["Hello world, unaffable!", "the cat sat"],
                                                                   padding=True, return_tensors="pt")
    assert torch.equal(enc["input_ids"], ref["input_ids"])
    with torch.no_grad():
        o = ours(enc["input_ids"], enc["token_type_ids"], enc["attention_mask"])
        for hf in (mlm.eval(), pt.eval()):
            logits = hf(**enc).logits if hf is mlm else hf(**enc).prediction_logits
            torch.testing.assert_close(o.prediction_logits, logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(o.seq_relationship_logits, pt(**enc).seq_relationship_logits)


def test_tokenizer_files_from_vocab_load_in_transformers(tmp_path):
    write_vocab(tmp_path / "vocab.txt")
    for lower in (True, False):
        files = tokenizer_files_from_vocab(tmp_path / "vocab.txt", do_lower_case=lower)
        assert set(files) == {"vocab.txt", "tokenizer_config.json", "special_tokens_map.json"}
        d = tmp_path / f"tok{lower}"
        d.mkdir()
        for name, data in files.items():
            (d / name).write_bytes(data)
        tok = transformers.AutoTokenizer.from_pretrained(d)
        ids = tok("Hello unaffable")["input_ids"]
        assert tok.convert_ids_to_tokens(ids) == (["[CLS]", "hello", "un", "##aff", "##able", "[SEP]"] if lower
                                                  else ["[CLS]", "[UNK]", "un", "##aff", "##able", "[SEP]"])
    (tmp_path / "bad.txt").write_text("a\nb\n")
    with pytest.raises(ValueError, match=r"bad.txt.*\[PAD\]"):
        tokenizer_files_from_vocab(tmp_path / "bad.txt")


def test_an_exported_tokenizer_truncates_to_the_models_positions(tmp_path):
    """A model with 64 positions gets model_max_length 64 in its tokenizer_config.json (not BERT's 512), so HF's
    `truncation=True` yields inputs the model can take; a config already within the positions is kept byte for byte."""
    write_vocab(tmp_path / "vocab.txt")
    from bertrain.model.bert import BertConfig
    model = BertForPreTraining(BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1,
                                          num_attention_heads=2, intermediate_size=64, max_position_embeddings=64))
    model.tokenizer_files = tokenizer_files_from_vocab(tmp_path / "vocab.txt")
    model.save_pretrained(tmp_path / "out")
    assert json.loads((tmp_path / "out" / "tokenizer_config.json").read_text())["model_max_length"] == 64
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    enc = tok(" ".join(["the cat sat on the mat ."] * 40), truncation=True, return_tensors="pt")
    assert enc["input_ids"].shape == (1, 64)
    hf = transformers.BertForPreTraining.from_pretrained(tmp_path / "out")
    assert hf(**enc).prediction_logits.shape == (1, 64, VOCAB)

    model.tokenizer_files = {**model.tokenizer_files, "tokenizer_config.json": b'{"model_max_length": 32}\n'}
    model.save_pretrained(tmp_path / "short")
    assert (tmp_path / "short" / "tokenizer_config.json").read_bytes() == b'{"model_max_length": 32}\n'


# ----------------------------------------------------------------------------------------------- old layouts

def test_old_bin_layout_without_prefix_with_gamma_beta_and_decoder_copies(tmp_path):
    src = hf_folder(tmp_path)
    ref = BertForPreTraining.from_pretrained(src)
    sd = load_file(src / "model.safetensors")
    old = {}
    for k, v in sd.items():
        k = k.removeprefix("bert.").replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias",
                                                                                            "LayerNorm.beta")
        old[k] = v
    old["cls.predictions.decoder.weight"] = sd["bert.embeddings.word_embeddings.weight"].clone()
    old["cls.predictions.decoder.bias"] = old.pop("cls.predictions.bias")
    old["embeddings.position_ids"] = torch.arange(64)[None]
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    torch.save(old, legacy / "pytorch_model.bin")
    (legacy / "config.json").write_text((src / "config.json").read_text())
    (legacy / "vocab.txt").write_bytes((src / "vocab.txt").read_bytes())
    model = BertForPreTraining.from_pretrained(legacy)
    assert model.loading_info["unexpected_keys"] == [] and model.loading_info["initialized"] == []
    assert_same_tensors(model.state_dict(), ref.state_dict())
    assert "tokenizer_config.json" in model.tokenizer_files  # generated for a Google-style folder


def test_sharded_safetensors(tmp_path):
    src = hf_folder(tmp_path)
    sd = load_file(src / "model.safetensors")
    keys = sorted(sd)
    shards = {"model-00001-of-00002.safetensors": keys[: len(keys) // 2],
              "model-00002-of-00002.safetensors": keys[len(keys) // 2:]}
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    for name, ks in shards.items():
        save_file({k: sd[k] for k in ks}, sharded / name, metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: name for name, ks in shards.items() for k in ks}}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    for name in ("config.json", "vocab.txt"):
        (sharded / name).write_bytes((src / name).read_bytes())
    assert_same_tensors(BertForPreTraining.from_pretrained(sharded).state_dict(),
                        BertForPreTraining.from_pretrained(src).state_dict())


def test_missing_heads_are_initialised_and_reported(tmp_path, caplog):
    src = hf_folder(tmp_path, transformers.BertModel)
    with caplog.at_level(logging.WARNING, logger="bertrain"):
        model = BertForPreTraining.from_pretrained(src)
    assert model.loading_info["initialized"] == ["MLM head", "NSP head"]
    assert "MLM head" in caplog.text and "NSP head" in caplog.text and "cls.predictions" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="bertrain"):
        cls = BertForSequenceClassification.from_pretrained(src, num_labels=4)
    assert cls.num_labels == 4 and "classification head" in caplog.text


def test_classification_labels_travel(tmp_path, caplog):
    src = hf_folder(tmp_path, transformers.BertForSequenceClassification, num_labels=3,
                    id2label={0: "neg", 1: "neu", 2: "pos"})
    model = BertForSequenceClassification.from_pretrained(src)
    assert model.num_labels == 3 and model.id2label == {0: "neg", 1: "neu", 2: "pos"}
    model.save_pretrained(tmp_path / "out")
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["id2label"] == {"0": "neg", "1": "neu", "2": "pos"} and cfg["architectures"] == [
        "BertForSequenceClassification"]
    with caplog.at_level(logging.WARNING, logger="bertrain"):
        other = BertForSequenceClassification.from_pretrained(src, num_labels=5, hidden_dropout_prob=0.0)
    assert other.num_labels == 5 and "re-initialising" in caplog.text and other.config.hidden_dropout_prob == 0.0
    with pytest.raises(TypeError, match="num_labels"):
        BertModel.from_pretrained(src, num_labels=3)
    with pytest.raises(TypeError, match="colour"):
        BertModel.from_pretrained(src, colour="red")


def test_save_pretrained_keeps_other_files_in_the_folder(tmp_path):
    src = hf_folder(tmp_path)
    ckpt = tmp_path / "step-10"
    ckpt.mkdir()
    (ckpt / "train_state.pt").write_bytes(b"optimizer")
    BertForPreTraining.from_pretrained(src).save_pretrained(ckpt)
    assert (ckpt / "train_state.pt").read_bytes() == b"optimizer"
    assert BertForPreTraining.from_pretrained(ckpt).loading_info["initialized"] == []


# ----------------------------------------------------------------------------------------------- bad input

def test_folder_without_config_json(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"empty.*no config.json"):
        BertModel.from_pretrained(tmp_path / "empty")
    with pytest.raises(ValueError, match="not a folder"):
        BertModel.from_pretrained(tmp_path / "nowhere")


def test_weights_of_the_wrong_shape(tmp_path):
    src = hf_folder(tmp_path)
    sd = load_file(src / "model.safetensors")
    sd["bert.encoder.layer.1.intermediate.dense.weight"] = torch.zeros(50, 32)
    save_file(sd, src / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError) as e:
        BertForPreTraining.from_pretrained(src)
    msg = str(e.value)
    assert "model.safetensors" in msg and "bert.encoder.layer.1.intermediate.dense.weight" in msg
    assert "(50, 32)" in msg and "(48, 32)" in msg


def test_vocab_size_disagreement(tmp_path):
    src = hf_folder(tmp_path)
    write_vocab(src / "vocab.txt", VOCAB + 3)
    with pytest.raises(ValueError) as e:
        BertForPreTraining.from_pretrained(src)
    assert "vocab.txt" in str(e.value) and "102" in str(e.value) and "99" in str(e.value)


def test_missing_weights_and_missing_encoder_weights(tmp_path):
    src = hf_folder(tmp_path)
    sd = load_file(src / "model.safetensors")
    del sd["bert.encoder.layer.0.attention.self.key.weight"]
    save_file(sd, src / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="missing 1 encoder weight.*layer.0.attention.self.key.weight"):
        BertForPreTraining.from_pretrained(src)
    (src / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="no weights found"):
        BertForPreTraining.from_pretrained(src)


def test_save_refuses_a_vocab_that_does_not_fit(tmp_path):
    model = BertForPreTraining.from_pretrained(hf_folder(tmp_path))
    model.tokenizer_files["vocab.txt"] = b"[PAD]\n[UNK]\n"
    with pytest.raises(ValueError, match="2 tokens"):
        model.save_pretrained(tmp_path / "out")


# ----------------------------------------------------------------------------------------------- configs HF allows

def _ids() -> torch.Tensor:
    return torch.tensor([[2, 5, 9, 17, 30, 3, 0, 0], [2, 40, 41, 7, 3, 90, 91, 3]])


def test_an_untied_mlm_decoder_is_refused_not_replaced_by_the_word_embeddings(tmp_path, capsys):
    # tie_word_embeddings = false: transformers predicts with cls.predictions.decoder.weight, bertrain's head with
    # the word embeddings. Before, the stored decoder was dropped like an old checkpoint's tied copy and
    # `bertrain convert` exited 0 with MLM logits up to ~0.5 off (every logit of this tiny model differed).
    src = hf_folder(tmp_path, tie_word_embeddings=False)
    with pytest.raises(ValueError, match=r"tie_word_embeddings = false .*cls\.predictions\.decoder\.weight"):
        BertForPreTraining.from_pretrained(src)
    out = tmp_path / "converted"
    assert main(["convert", str(src), str(out)]) == 2
    err = capsys.readouterr().err
    assert "tie_word_embeddings = false" in err and "--init" in err and "Traceback" not in err
    assert not out.exists()

    # The encoder does not use the decoder: it loads and computes what transformers computes.
    ours = BertModel.from_pretrained(src).eval()
    hf = transformers.BertModel.from_pretrained(src).eval()
    ids = _ids()
    mask = (ids != 0).long()
    with torch.no_grad():
        a = hf(input_ids=ids, attention_mask=mask).last_hidden_state
        b = ours(input_ids=ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(b[mask.bool()], a[mask.bool()], rtol=1e-5, atol=1e-5)


def test_a_multi_label_classifier_is_refused_where_its_head_would_be_used(tmp_path, capsys):
    # transformers scores problem_type multi_label_classification with a sigmoid per label. Before, bertrain loaded
    # the head as single-label: `bertrain export` wrote a config.json without the problem_type (transformers'
    # text-classification pipeline then gave softmax scores 0.34/0.33/0.33 instead of 0.50/0.50/0.50), and
    # `bertrain predict` scored with a softmax, both with exit 0.
    src = hf_folder(tmp_path, transformers.BertForSequenceClassification, num_labels=3,
                    problem_type="multi_label_classification")
    with pytest.raises(ValueError, match=r"problem_type = 'multi_label_classification' with 3 labels"):
        BertForSequenceClassification.from_pretrained(src)
    assert main(["export", str(src), str(tmp_path / "exported")]) == 2
    err = capsys.readouterr().err
    assert "multi_label_classification" in err and "bertrain convert" in err and "Traceback" not in err
    assert not (tmp_path / "exported").exists()
    # Where the head is not used, the encoder loads: another label count (fine-tuning re-initialises the head),
    # another class, `bertrain convert` (as the message says).
    assert BertForSequenceClassification.from_pretrained(src, num_labels=2).loading_info["initialized"] == [
        "classification head"]
    BertModel.from_pretrained(src)
    assert main(["convert", str(src), str(tmp_path / "converted")]) == 0
    # The kinds bertrain computes load as before: single-label (what transformers' Trainer records) and a
    # one-output regression.
    for name, kw in (("single", dict(num_labels=3, problem_type="single_label_classification")),
                     ("regression", dict(num_labels=1, problem_type="regression"))):
        ok = hf_folder(tmp_path, transformers.BertForSequenceClassification, name=name, **kw)
        assert BertForSequenceClassification.from_pretrained(ok).num_labels == kw["num_labels"]


def _saved_by_transformers_tokenizer(tmp_path: Path, lower: bool, **kw) -> Path:
    """An HF model folder whose tokenizer transformers saved itself: since transformers 5 that is tokenizer.json
    and tokenizer_config.json, without vocab.txt."""
    src = hf_folder(tmp_path, name=f"hf-{lower}")
    tok = transformers.BertTokenizerFast(str(src / "vocab.txt"), do_lower_case=lower, **kw)
    (src / "vocab.txt").unlink()
    tok.save_pretrained(src)
    (src / "vocab.txt").unlink(missing_ok=True)  # (transformers 4 also wrote it: test the folder 5 writes)
    assert (src / "tokenizer.json").is_file()
    return src


@pytest.mark.parametrize("lower", [True, False])
def test_a_tokenizer_saved_by_transformers_5_gives_the_converted_folder_its_vocab(tmp_path, capsys, lower):
    # Before: `bertrain convert` wrote no vocab.txt ("has no tokenizer files", though tokenizer.json was copied),
    # and bertrain could not fine-tune the converted model ("has no vocab.txt").
    from bertrain.tasks.common import load_task_tokenizer

    src = _saved_by_transformers_tokenizer(tmp_path, lower)
    out = tmp_path / "converted"
    assert main(["convert", str(src), str(out)]) == 0
    assert "warning" not in capsys.readouterr().out
    tokens = (out / "vocab.txt").read_text().split("\n")[:-1]
    assert tokens[:5] == ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] and len(tokens) == VOCAB
    assert json.loads((out / "tokenizer_config.json").read_text())["do_lower_case"] is lower
    ours = load_task_tokenizer(out)
    hf = transformers.AutoTokenizer.from_pretrained(src)
    for text in ["Hello world, the Cat sat on the mat!", "unaffable cats.", "HELLO hello Hello"]:
        assert ours.tokenizer.encode(text, add_special_tokens=False).ids == \
            hf(text, add_special_tokens=False)["input_ids"], text


@pytest.mark.parametrize("lower", [True, False])
def test_fine_tuning_reads_the_tokenizer_of_a_folder_transformers_5_saved(tmp_path, lower):
    """`bertrain finetune --init` / predict on such a folder as it is (before: "has no vocab.txt"): the vocabulary
    and casing of its tokenizer.json, the same ids and identity as the converted folder's vocab.txt."""
    from bertrain.tasks.common import load_task_tokenizer

    src = _saved_by_transformers_tokenizer(tmp_path, lower)
    assert main(["convert", str(src), str(tmp_path / "converted")]) == 0
    ours, converted = load_task_tokenizer(src), load_task_tokenizer(tmp_path / "converted")
    hf = transformers.AutoTokenizer.from_pretrained(src)
    assert ours.do_lower_case is lower and ours.identity == converted.identity
    for text in ["Hello world, the Cat sat on the mat!", "unaffable Café cats.", "HELLO hello Hello"]:
        ids = ours.tokenizer.encode(text, add_special_tokens=False).ids
        assert ids == converted.tokenizer.encode(text, add_special_tokens=False).ids == \
            hf(text, add_special_tokens=False)["input_ids"], text

    other = _saved_by_transformers_tokenizer(tmp_path / "other", True, strip_accents=False)
    with pytest.raises(ValueError, match="has no vocab.txt .*, and its tokenizer.json sets its BertNormalizer"):
        load_task_tokenizer(other)


def test_a_tokenizer_json_bertrain_cannot_reproduce_gives_no_vocab_and_says_so(tmp_path, capsys, caplog):
    # lower-casing without stripping accents: bertrain's tokenizer (vocab.txt + do_lower_case) strips them, so a
    # vocab.txt taken from it would tokenize "café" otherwise than the model's tokenizer.
    src = _saved_by_transformers_tokenizer(tmp_path, True, strip_accents=False)
    with caplog.at_level(logging.WARNING, logger="bertrain"):
        assert main(["convert", str(src), str(tmp_path / "converted")]) == 0
    assert "strip_accents" in caplog.text and "cannot tokenize" in caplog.text
    assert "has no vocab.txt that bertrain can use" in capsys.readouterr().out
    assert not (tmp_path / "converted" / "vocab.txt").exists()


def test_a_decoder_untied_in_name_only_loads_with_the_same_mlm_logits(tmp_path):
    # tie_word_embeddings = false but the decoder holds exactly the word embeddings: the numbers are the tied
    # model's, so the folder loads and predicts what transformers predicts.
    cfg = transformers.BertConfig(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=48, max_position_embeddings=64, tie_word_embeddings=False)
    torch.manual_seed(0)
    hf = transformers.BertForPreTraining(cfg).eval()
    with torch.no_grad():
        hf.cls.predictions.decoder.weight.copy_(hf.bert.embeddings.word_embeddings.weight)
    src = tmp_path / "hf"
    hf.save_pretrained(src)
    ours = BertForPreTraining.from_pretrained(src).eval()
    ids = _ids()
    with torch.no_grad():
        a = hf(input_ids=ids).prediction_logits
        b = ours(input_ids=ids).prediction_logits[..., :99]
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------------- commands

def test_cli_convert_export_and_overwrite(tmp_path, capsys):
    src = hf_folder(tmp_path, transformers.BertModel)
    out = tmp_path / "model"
    assert main(["convert", str(src), str(out)]) == 0
    assert "MLM head" in capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json", "model.safetensors", "special_tokens_map.json", "tokenizer_config.json", "vocab.txt"]
    assert BertForPreTraining.from_pretrained(out).loading_info["initialized"] == []

    assert main(["convert", str(src), str(out)]) == 2
    assert "already exists" in capsys.readouterr().err
    assert main(["convert", str(src), str(out), "--overwrite"]) == 0
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("model.replaced-")]  # the old one moved, not deleted
    assert len(aside) == 1 and (aside[0] / "model.safetensors").is_file()
    assert str(aside[0]) in capsys.readouterr().out

    # a run folder with checkpoints: export takes the latest complete one and leaves the training files behind
    run = tmp_path / "run"
    for step, complete in ((100, True), (200, True), (300, False)):
        ckpt = run / f"step-{step}"
        BertForPreTraining.from_pretrained(out).save_pretrained(ckpt)
        (ckpt / "train_state.pt").write_bytes(b"x")
        (ckpt / "config.yaml").write_text("model: tiny\n")
        if complete:
            (ckpt / "COMPLETE").write_text("")
    exported = tmp_path / "exported"
    assert main(["export", str(run), str(exported)]) == 0
    assert "step-200" in capsys.readouterr().out
    assert not (exported / "train_state.pt").exists() and not (exported / "COMPLETE").exists()
    assert_same_tensors(load_file(exported / "model.safetensors"), load_file(out / "model.safetensors"))
    assert main(["export", str(run / "step-100"), str(exported)]) == 2
    (tmp_path / "empty").mkdir()
    assert main(["export", str(run / "step-100"), str(tmp_path / "empty")]) == 0
    assert main(["export", str(tmp_path / "nothing"), str(tmp_path / "x")]) == 2


def test_cli_export_keeps_the_head(tmp_path):
    src = hf_folder(tmp_path, transformers.BertForQuestionAnswering)
    assert main(["export", str(src), str(tmp_path / "qa")]) == 0
    cfg = json.loads((tmp_path / "qa" / "config.json").read_text())
    assert cfg["architectures"] == ["BertForQuestionAnswering"]
    assert "qa_outputs.weight" in load_file(tmp_path / "qa" / "model.safetensors")


def test_cli_info(tmp_path, capsys, caplog, monkeypatch):
    assert main(["info"]) == 0
    assert "hidden_size" in capsys.readouterr().out
    assert main(["info", "--model", "base", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["parameters"]["BertModel"] == 109_482_240
    src = hf_folder(tmp_path)
    assert main(["info", "--model", str(src), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["config"]["vocab_size"] == VOCAB
    assert main(["info", "--model", "gigantic"]) == 2
    (tmp_path / "cwd").mkdir()  # a folder named like a preset is the folder (with a warning), not the preset
    hf_folder(tmp_path / "cwd", name="base")
    monkeypatch.chdir(tmp_path / "cwd")
    with caplog.at_level(logging.WARNING):
        assert main(["info", "--model", "base", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["config"]["vocab_size"] == VOCAB
    assert "not the preset base" in caplog.text
