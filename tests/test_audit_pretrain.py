"""Pretraining as an experienced user runs it, against the reference recipes (google-research/bert, NVIDIA
DeepLearningExamples, HF run_mlm): continued pretraining from an HF model, the checks between the model and the data."""
from __future__ import annotations

from pathlib import Path

import pytest

from bertrain.cli import main
from bertrain.data.prepare import PrepareConfig, prepare

TEXT = ("The cat sat on the mat. It was a sunny day and the cat was happy.\n\n"
        "Whole word masking masks every piece of a word. Tokenizers split rare words into pieces.\n\n")


@pytest.fixture(scope="module")
def minilm_cased_data(tmp_path_factory, minilm_path) -> Path:
    """A small corpus prepared with MiniLM's (uncased) vocab.txt but cased tokenization."""
    root = tmp_path_factory.mktemp("cased")
    corpus = root / "corpus.txt"
    corpus.write_text(TEXT * 30, encoding="utf-8")
    prepare(PrepareConfig(inputs=[str(corpus)], output=str(root / "data"), vocab_file=str(minilm_path / "vocab.txt"),
                          masking="dynamic", do_lower_case=False, workers=1, heldout_fraction=0.0))
    return root / "data"


def test_continued_pretraining_refuses_data_cased_otherwise_than_the_init_model(minilm_path, minilm_cased_data,
                                                                              tmp_path, capsys):
    """google-research/bert refuses a do_lower_case that contradicts the init checkpoint
    (tokenization.validate_case_matches_checkpoint): MiniLM is uncased (its tokenizer_config.json says
    do_lower_case true), so cased data would be mostly [UNK] for its vocabulary and the export would carry a cased
    tokenizer_config.json for an uncased model. One line naming the key, exit 2, nothing trained."""
    out = tmp_path / "run"
    code = main(["pretrain", "--model.init", str(minilm_path), "--data.prepared", str(minilm_cased_data),
                 "--data.do_lower_case", "false", "--sample.max_seq_length", "32",
                 "--sample.max_predictions_per_seq", "5", "--train.steps", "1", "--train.global_batch_size", "2",
                 "--train.micro_batch_size", "2", "--eval.enabled", "false", "--output_dir", str(out)])
    err = capsys.readouterr().err
    assert code == 2, err
    lines = [line for line in err.splitlines() if "error" in line]
    assert len(lines) == 1 and "Traceback" not in err
    assert "data.do_lower_case" in lines[0] and "uncased" in lines[0]
    assert not (out / "final").exists() and not list(out.glob("step-*"))


def _raw_argv(minilm_path: Path, corpus: Path, out: Path, *extra: str) -> list[str]:
    return ["pretrain", "--model.init", str(minilm_path), "--data.input", f"[{corpus}]",
            "--data.heldout_fraction", "0", "--sample.max_seq_length", "32", "--sample.max_predictions_per_seq", "5",
            "--train.steps", "1", "--train.global_batch_size", "2", "--train.micro_batch_size", "2",
            "--eval.enabled", "false", "--checkpoint.save_interval", "0", "--output_dir", str(out), *extra]


def test_continued_pretraining_on_raw_text_tokenizes_with_the_init_models_vocab(minilm_path, tmp_path, capsys):
    """`model.init` + raw `data.input` (no data.vocab_file): HF run_mlm tokenizes with the model's own tokenizer;
    a freshly trained vocabulary cannot match the model's embeddings (it was trained, the whole corpus tokenized
    with it, and only then the run refused)."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT * 30, encoding="utf-8")
    out = tmp_path / "run"
    code = main(_raw_argv(minilm_path, corpus, out))
    err = capsys.readouterr().err
    assert code == 0, err[-3000:]
    assert (out / "vocab" / "vocab.txt").read_bytes() == (minilm_path / "vocab.txt").read_bytes()
    assert (out / "final" / "vocab.txt").read_bytes() == (minilm_path / "vocab.txt").read_bytes()
    import json
    assert json.loads((out / "data" / "store.json").read_text())["vocab_size"] == 30522


def test_raw_text_cased_otherwise_than_the_init_model_is_refused_before_anything_is_built(minilm_path, tmp_path,
                                                                                         capsys):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT, encoding="utf-8")
    out = tmp_path / "run"
    code = main(_raw_argv(minilm_path, corpus, out, "--data.do_lower_case", "false"))
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    (line,) = [x for x in err.splitlines() if "error" in x]
    assert "data.do_lower_case" in line and "uncased" in line
    assert not (out / "vocab").exists() and not (out / "data").exists()


@pytest.mark.parametrize("setting, named", [({"strip_accents": False}, "strip_accents = false"),
                                             ({"tokenize_chinese_chars": False}, "tokenize_chinese_chars = false")])
def test_an_init_model_with_tokenizer_rules_prepare_does_not_apply_is_refused(minilm_path, tmp_path, capsys,
                                                                              setting, named):
    """A model whose tokenizer_config.json keeps accents while lowercasing, or does not split CJK characters, is
    fine-tuned and served with those rules (tasks.common.load_task_tokenizer) but `prepare` applies BERT's defaults:
    continued pretraining learned other ids than the model is used with, silently. Refused before any work; a model
    that sets the defaults explicitly runs."""
    import json
    import shutil

    init = tmp_path / "model"
    shutil.copytree(minilm_path, init)
    config = json.loads((init / "tokenizer_config.json").read_text())
    (init / "tokenizer_config.json").write_text(json.dumps({**config, **setting}))
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT, encoding="utf-8")
    out = tmp_path / "run"
    code = main(_raw_argv(init, corpus, out))
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    (line,) = [x for x in err.splitlines() if "error" in x]
    assert "config key 'model.init'" in line and named in line and str(init / "tokenizer_config.json") in line
    assert not (out / "vocab").exists() and not (out / "data").exists()
    (init / "tokenizer_config.json").write_text(json.dumps({**config, "strip_accents": None,
                                                             "tokenize_chinese_chars": True}))
    assert main(_raw_argv(init, corpus, tmp_path / "defaults")) == 0


def test_a_position_override_on_an_init_model_is_named_not_blamed_on_the_sample_length(minilm_path, tmp_path,
                                                                                      capsys):
    """MiniLM has 512 positions: phase 2 at 256 with a stray `model.max_position_embeddings: 128` was refused as
    "sample.max_seq_length (256) exceeds the model's max_position_embeddings (128)", a model it is not."""
    code = main(["pretrain", "--model.init", str(minilm_path), "--data.synthetic_samples", "8",
                 "--data.vocab_size", "30522", "--model.max_position_embeddings", "128",
                 "--sample.max_seq_length", "256", "--train.steps", "1", "--output_dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    (line,) = [x for x in err.splitlines() if "error" in x]
    assert "'model.max_position_embeddings' = 128" in line and "has 512" in line


def test_accumulated_micro_batches_equal_one_batch_and_reruns_are_bitwise(tmp_path):
    """Global batch 16 as 16 x 1, 8 x 2 and 4 x 4 micro-batches (dropout 0, dynamic masking on real text): the same
    weights after 3 AdamW steps to float tolerance; the same config run twice: the same model.safetensors bytes."""
    from safetensors.torch import load_file
    import torch

    vocab = Path(__file__).resolve().parent / "assets" / "vocab-tiny.txt"
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT * 40, encoding="utf-8")
    prepare(PrepareConfig(inputs=[str(corpus)], output=str(tmp_path / "data"), vocab_file=str(vocab),
                          masking="dynamic", workers=1, heldout_fraction=0.0))

    def run(name: str, micro: int) -> Path:
        out = tmp_path / name
        assert main(["pretrain", "--data.prepared", str(tmp_path / "data"), "--model.preset", "tiny",
                     "--model.num_hidden_layers", "2", "--model.hidden_size", "64", "--model.num_attention_heads", "2",
                     "--model.intermediate_size", "128", "--model.dropout", "0", "--sample.max_seq_length", "64",
                     "--sample.max_predictions_per_seq", "10", "--train.steps", "3", "--train.global_batch_size",
                     "16", "--train.micro_batch_size", str(micro), "--optim.name", "adamw", "--optim.lr", "1e-3",
                     "--eval.enabled", "false", "--checkpoint.save_interval", "0", "--output_dir", str(out)]) == 0
        return out / "final" / "model.safetensors"

    one = load_file(run("m16", 16))
    for micro in (8, 4):
        other = load_file(run(f"m{micro}", micro))
        for k in one:
            torch.testing.assert_close(other[k], one[k], rtol=1e-5, atol=1e-6)
    assert run("m8-again", 8).read_bytes() == (tmp_path / "m8" / "final" / "model.safetensors").read_bytes()


def test_prepare_with_dynamic_masking_says_that_sample_flags_belong_to_the_pretraining_config(tmp_path, caplog):
    """create_pretraining_data takes --max_seq_length / --do_whole_word_mask at prepare time; `prepare --masking
    dynamic` writes only the token store, so such flags were silently dropped (the run then trained at 128 without
    whole-word masking). Now one warning names them and the keys to set; without them, no warning."""
    import logging

    vocab = Path(__file__).resolve().parent / "assets" / "vocab-tiny.txt"
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT * 5, encoding="utf-8")
    base = ["prepare", "--input", str(corpus), "--vocab-file", str(vocab), "--masking", "dynamic", "--workers", "1",
            "--heldout-fraction", "0"]
    with caplog.at_level(logging.WARNING, logger="bertrain"):
        assert main([*base, "--output", str(tmp_path / "a"), "--whole-word-masking", "--max-seq-length", "512"]) == 0
    (warning,) = [r.getMessage() for r in caplog.records if "sample.*" in r.getMessage()]
    assert "--whole-word-masking" in warning and "sample.max_seq_length: 512" in warning
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="bertrain"):
        assert main([*base, "--output", str(tmp_path / "b")]) == 0
    assert not [r for r in caplog.records if "sample.*" in r.getMessage()]
