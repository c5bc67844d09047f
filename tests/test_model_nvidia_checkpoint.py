"""Checkpoints of NVIDIA's DeepLearningExamples BERT for PyTorch (bertrain.model.nvidia_checkpoint, hf.py on top).

The fixture, tests/assets/nvidia-pyt-tiny, holds a tiny BERT's weights under NVIDIA's names (its vocabulary of 100
padded to 104 rows, as NVIDIA's scripts pad it) and what NVIDIA's own modeling.py computed with them: the version of
2020 ("gelu" = erf) and that of 2022 ("gelu" = the tanh approximation); make_fixture.py beside it made them and says
from which commits and with which patch. The repository holds no weight files, so the checkpoint files are rebuilt
here with torch.save as NVIDIA's scripts save them: run_pretraining.py's `ckpt_<step>.pt` of 2020 and of 2022,
run_squad.py's / run_glue.py's pytorch_model.bin ({"model": ...} beside the padded config they write), NGC's `*.pt`.
"""
from __future__ import annotations

import json
import logging
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from bertrain import BertForPreTraining, BertForQuestionAnswering, BertForSequenceClassification, BertModel
from bertrain.model import nvidia_checkpoint
from bertrain.model.hf import load_hf_state_dict, model_class_for, weights_files
from conftest import ASSETS
from helpers import finetune_argv, finetune_data, one_line_error, run_cli

FIXTURE = ASSETS / "nvidia-pyt-tiny"
STATE = {k: torch.from_numpy(v) for k, v in np.load(FIXTURE / "state_dict.npz").items()}
EXPECTED = dict(np.load(FIXTURE / "expected.npz"))
CONFIG = json.loads((FIXTURE / "bert_config.json").read_text())
VOCAB, PADDED = 100, 104
TOL = 1e-5
EMBEDDINGS, DECODER, MLM_BIAS = ("bert.embeddings.word_embeddings.weight", "cls.predictions.decoder.weight",
                                 "cls.predictions.bias")
HEADS = ("cls.", "qa_outputs.", "classifier.")


def inputs() -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(EXPECTED[k]) for k in ("input_ids", "input_mask", "segment_ids", "masked_lm_positions")}


def close(actual: torch.Tensor, name: str, where: torch.Tensor | None = None) -> float:
    """Assert `actual` is NVIDIA's output `name` (at the positions `where`, if given) within TOL of the output's
    largest value (at least 1): 1e-5 for hidden states, 2e-4 for MLM logits of up to 20, whose float32 sums of
    24 products and NVIDIA's GELU constant (1.41421 for sqrt(2)) move them by up to 3e-5. The max abs difference."""
    expected = torch.from_numpy(EXPECTED[name])
    if where is not None:
        actual, expected = actual[where], expected[where]
    atol = TOL * max(1.0, expected.abs().max().item())
    torch.testing.assert_close(actual.float(), expected, rtol=0, atol=atol, msg=lambda m: f"{name}: {m}")
    return (actual.float() - expected).abs().max().item()


def far(actual: torch.Tensor, name: str) -> bool:
    """Whether `actual` misses NVIDIA's output `name` by far more than `close` allows (10 times)."""
    expected = torch.from_numpy(EXPECTED[name])
    return (actual.float() - expected).abs().max().item() > 10 * TOL * max(1.0, expected.abs().max().item())


# ----------------------------------------------------------------------------------------------- NVIDIA's files

def nvidia_state(head: str) -> dict[str, torch.Tensor]:
    """`model.state_dict()` of NVIDIA's BertForPreTraining ("cls."), BertForQuestionAnswering ("qa_outputs.") or
    BertForSequenceClassification ("classifier."): the encoder and that head; the MLM decoder is the word-embedding
    tensor itself, as the tied module's state_dict() holds it."""
    state = {k: v for k, v in STATE.items() if not k.startswith(HEADS) or k.startswith(head)}
    if head == "cls.":
        state[DECODER] = state[EMBEDDINGS]
    return state


def optimizer_state(state: dict[str, torch.Tensor]) -> dict:
    """A real optimizer's state_dict after one step (NVIDIA's LAMB needs apex; its state is tensors and numbers too)."""
    params = [torch.nn.Parameter(t.clone()) for k, t in state.items() if k != DECODER]
    optimizer = torch.optim.AdamW(params)
    for p in params:
        p.grad = torch.ones_like(p)
    optimizer.step()
    return optimizer.state_dict()


def run_pretraining_2020(state: dict[str, torch.Tensor], data_loader: object = None) -> dict:
    """What run_pretraining.py of 2020 (1d4211fe) saves: torch.save({'model', 'optimizer', 'master params', 'files',
    'epoch', 'data_loader'}), the DataLoader itself but at the last step."""
    return {"model": state, "optimizer": optimizer_state(state),
            "master params": [t.clone() for k, t in state.items() if k != DECODER],
            "files": [1, "/workspace/data/training_0.hdf5", "/workspace/data/training_1.hdf5"], "epoch": 0,
            "data_loader": data_loader}


def run_pretraining_2022(state: dict[str, torch.Tensor]) -> dict:
    """What run_pretraining.py of 2022 (729963dd) saves: torch.save({'model', 'optimizer', 'grad_scaler', 'epoch'})."""
    return {"model": state, "optimizer": optimizer_state(state),
            "grad_scaler": torch.amp.GradScaler("cpu", init_scale=2.0 ** 20).state_dict(), "epoch": 1}


def nvidia_folder(dest: Path, files: dict[str, object], config: dict | None = None, legacy: bool = False) -> Path:
    """`dest` with bert_config.json (the fixture's, or `config` as NVIDIA's to_json_string writes it), vocab.txt and
    each of `files` saved by torch.save (`legacy`: the pre-1.6 format of NGC's 2019 files)."""
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copy(FIXTURE / "vocab.txt", dest / "vocab.txt")
    if config is None:
        shutil.copy(FIXTURE / "bert_config.json", dest / "bert_config.json")
    else:
        (dest / "bert_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    for name, obj in files.items():
        torch.save(obj, dest / name, _use_new_zipfile_serialization=not legacy)
    return dest


@pytest.fixture(scope="module")
def ckpt_2020(tmp_path_factory) -> Path:
    return nvidia_folder(tmp_path_factory.mktemp("nv") / "2020", {"ckpt_8601.pt": run_pretraining_2020(
        nvidia_state("cls."))})


@pytest.fixture(scope="module")
def ckpt_2022(tmp_path_factory) -> Path:
    return nvidia_folder(tmp_path_factory.mktemp("nv") / "2022", {"ckpt_7038.pt": run_pretraining_2022(
        nvidia_state("cls."))})


# ----------------------------------------------------------------------------------------------- the rules

def test_the_rules_are_nvidias():
    assert [nvidia_checkpoint.padded(n) for n in (30522, 30528, 100, 104, 1)] == [30528, 30528, 104, 104, 8]
    # run_squad.py / run_glue.py save the padded vocab_size: vocab.txt then says the real one
    assert nvidia_checkpoint.vocab_size(30528, 30522) == 30522
    assert nvidia_checkpoint.vocab_size(30522, 30522) == nvidia_checkpoint.vocab_size(30522, None) == 30522
    assert nvidia_checkpoint.vocab_size(30528, None) == 30528 and nvidia_checkpoint.vocab_size(30536, 30522) == 30536
    assert nvidia_checkpoint.hidden_act("gelu", ["optimizer", "grad_scaler", "epoch"])[0] == "gelu_new"
    assert nvidia_checkpoint.hidden_act("gelu", ["optimizer", "master params", "files"])[0] == "gelu"
    assert nvidia_checkpoint.hidden_act("gelu", [])[0] == "gelu"
    assert nvidia_checkpoint.hidden_act("gelu_new", []) == ("gelu_new", "")  # a config's word is kept
    assert nvidia_checkpoint.hidden_act("relu", ["grad_scaler"]) == ("relu", "")
    names = nvidia_checkpoint.hf_names({"module.bert.encoder.layer.3.intermediate.dense_act.weight": torch.ones(1),
                                        "bert.pooler.dense_act.bias": torch.ones(1),
                                        "cls.predictions.transform.dense_act.weight": torch.ones(1),
                                        "bert.encoder.layer.0.attention.output.dense.weight": torch.ones(1)}, Path("f"))
    assert list(names) == ["bert.encoder.layer.3.intermediate.dense.weight", "bert.pooler.dense.bias",
                           "cls.predictions.transform.dense.weight",
                           "bert.encoder.layer.0.attention.output.dense.weight"]


def test_the_fixture_is_nvidias_padded_model():
    assert STATE[EMBEDDINGS].shape == (PADDED, 24) and STATE[MLM_BIAS].shape == (PADDED,)
    assert CONFIG["vocab_size"] == VOCAB == len((FIXTURE / "vocab.txt").read_text().splitlines())
    assert "bert.encoder.layer.1.intermediate.dense_act.weight" in STATE and "bert.pooler.dense_act.weight" in STATE
    # the activation matters: NVIDIA's 2020 (erf) and 2022 (tanh) code compute other numbers on these weights, far
    # outside the tolerance the tests hold bertrain to
    for name in ("sequence_output", "mlm_logits", "start_logits"):
        assert far(torch.from_numpy(EXPECTED[f"v2022_{name}"]), f"v2020_{name}"), name


# ----------------------------------------------------------------------------------------------- (a) parity

@torch.no_grad()
@pytest.mark.parametrize("version", ["2020", "2022"])
def test_a_run_pretraining_checkpoint_computes_what_nvidias_code_computed(version, ckpt_2020, ckpt_2022, caplog):
    caplog.set_level(logging.INFO, logger="bertrain.model")
    folder, act = (ckpt_2020, "gelu") if version == "2020" else (ckpt_2022, "gelu_new")
    x = inputs()
    model = BertForPreTraining.from_pretrained(folder).eval()
    assert model.config.hidden_act == act and model.config.vocab_size == VOCAB
    assert model.loading_info == {"initialized": [], "missing_keys": [], "unexpected_keys": []}
    assert "ignoring 'optimizer'" in caplog.text and ("'master params'" if version == "2020" else "'grad_scaler'") \
        in caplog.text
    out = model(x["input_ids"], x["segment_ids"], x["input_mask"], masked_positions=x["masked_lm_positions"])
    print(f"max |ours - NVIDIA's {version}|: mlm_logits",
          close(out.prediction_logits.reshape(2, 3, VOCAB), f"v{version}_mlm_logits"),
          "nsp_logits", close(out.seq_relationship_logits, f"v{version}_nsp_logits"))
    encoder = BertModel.from_pretrained(folder).eval()
    hidden = encoder(x["input_ids"], x["segment_ids"], x["input_mask"])  # every position, padding too
    print("sequence_output", close(hidden.last_hidden_state, f"v{version}_sequence_output"),
          "pooled_output", close(hidden.pooler_output, f"v{version}_pooled_output"))
    # the other GELU is not NVIDIA's model: the file's entries decide it, not a guess that happens to be close
    other = BertModel.from_pretrained(folder, hidden_act="gelu_new" if act == "gelu" else "gelu").eval()
    wrong = other(x["input_ids"], x["segment_ids"], x["input_mask"]).last_hidden_state
    assert far(wrong, f"v{version}_sequence_output")


@torch.no_grad()
def test_run_squad_and_run_glue_outputs_compute_what_nvidias_code_computed(tmp_path, caplog):
    """Their pytorch_model.bin is {"model": state dict}, beside the config they wrote after padding (vocab_size 104)."""
    caplog.set_level(logging.INFO, logger="bertrain.model")
    padded_config = {**CONFIG, "vocab_size": PADDED, "output_all_encoded_layers": False}  # NVIDIA's to_json_string
    x = inputs()
    squad = nvidia_folder(tmp_path / "SQuAD", {"pytorch_model.bin": {"model": nvidia_state("qa_outputs.")}},
                          padded_config)
    assert weights_files(squad) == [squad / "pytorch_model.bin"] and model_class_for(squad) is BertForQuestionAnswering
    qa = BertForQuestionAnswering.from_pretrained(squad).eval()
    assert qa.config.vocab_size == VOCAB and qa.config.hidden_act == "gelu"
    assert "the padded size NVIDIA's fine-tuning scripts save" in caplog.text and "does not say which" in caplog.text
    out = qa(x["input_ids"], x["segment_ids"], x["input_mask"])
    real = x["input_mask"].bool()  # at padding bertrain gives -10000 (answers never lie there)
    print("max |ours - NVIDIA's 2020|: start_logits", close(out.start_logits, "v2020_start_logits", real),
          "end_logits", close(out.end_logits, "v2020_end_logits", real))
    glue = nvidia_folder(tmp_path / "SST-2", {"pytorch_model.bin": {"model": nvidia_state("classifier.")}},
                         padded_config)
    classifier = BertForSequenceClassification.from_pretrained(glue).eval()
    assert classifier.num_labels == 3
    print("classifier_logits", close(classifier(x["input_ids"], x["segment_ids"], x["input_mask"]).logits,
                                     "v2020_classifier_logits"))


@torch.no_grad()
def test_an_ngc_file_in_the_old_format_or_with_module_prefixes_loads_the_same(tmp_path):
    """NGC's bert_*_qa.pt ({"model": ...}) beside NVIDIA's bert_config.json and vocab.txt; saved in the pre-1.6
    format (NGC's 2019 files); and a state dict saved from a DDP wrapper (`module.` on every key)."""
    x = inputs()
    real = x["input_mask"].bool()
    qa_state = nvidia_state("qa_outputs.")
    for name, obj, legacy in [("legacy", {"model": qa_state}, True),
                              ("ddp", {"model": {f"module.{k}": v for k, v in qa_state.items()}}, False),
                              ("flat", {f"module.{k}": v for k, v in qa_state.items()}, False)]:
        folder = nvidia_folder(tmp_path / name, {"bert_base_qa.pt": obj}, legacy=legacy)
        assert weights_files(folder) == [folder / "bert_base_qa.pt"]
        qa = BertForQuestionAnswering.from_pretrained(folder).eval()
        assert qa.loading_info["missing_keys"] == [] and qa.config.hidden_act == "gelu", name
        out = qa(x["input_ids"], x["segment_ids"], x["input_mask"])
        close(out.start_logits, "v2020_start_logits", real)
        close(out.end_logits, "v2020_end_logits", real)
    assert set(load_hf_state_dict(tmp_path / "ddp")) == {k.replace("dense_act", "dense") for k in qa_state}


# ----------------------------------------------------------------------------------------------- (b) convert

@torch.no_grad()
@pytest.mark.parametrize("version", ["2020", "2022"])
def test_convert_writes_a_folder_transformers_computes_the_same_with(version, ckpt_2020, ckpt_2022, tmp_path,
                                                                      capsys):
    transformers = pytest.importorskip("transformers")
    folder = ckpt_2020 if version == "2020" else ckpt_2022
    out = tmp_path / "converted"
    code, stdout, err = run_cli(capsys, "convert", folder, out)
    assert code == 0 and "converted" in stdout, err
    config = json.loads((out / "config.json").read_text())
    assert config["vocab_size"] == VOCAB and config["hidden_act"] == ("gelu" if version == "2020" else "gelu_new")
    assert (out / "vocab.txt").read_bytes() == (FIXTURE / "vocab.txt").read_bytes()
    hf, info = transformers.BertForPreTraining.from_pretrained(out, attn_implementation="eager",
                                                               output_loading_info=True)
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    hf.eval()
    x = inputs()
    o = hf(input_ids=x["input_ids"], attention_mask=x["input_mask"], token_type_ids=x["segment_ids"],
           output_hidden_states=True)
    positions = x["masked_lm_positions"]
    at_masks = o.prediction_logits.gather(1, positions[..., None].expand(-1, -1, VOCAB))
    pooled = hf.bert(input_ids=x["input_ids"], attention_mask=x["input_mask"],
                     token_type_ids=x["segment_ids"]).pooler_output
    print(f"max |transformers - NVIDIA's {version}|: sequence_output",
          close(o.hidden_states[-1], f"v{version}_sequence_output"),
          "pooled_output", close(pooled, f"v{version}_pooled_output"),
          "mlm_logits", close(at_masks, f"v{version}_mlm_logits"),
          "nsp_logits", close(o.seq_relationship_logits, f"v{version}_nsp_logits"))


def test_finetune_init_from_an_nvidia_folder(ckpt_2022, tmp_path, capsys):
    data = finetune_data("glue", tmp_path / "data")
    code, _, err = run_cli(capsys, *finetune_argv("glue", data, ckpt_2022, tmp_path / "run", 1))
    assert code == 0, err
    assert json.loads((tmp_path / "run" / "final" / "config.json").read_text())["hidden_act"] == "gelu_new"


# ----------------------------------------------------------------------------------------------- (c) refused

class pretraining_dataset(torch.utils.data.Dataset):
    """Stands for run_pretraining.py's dataset class, which the DataLoader pickles from that script's `__main__`."""
    __module__ = "__main__"

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i])


class WorkerInitObj:
    """Stands for run_pretraining.py's worker_init_fn class; unpickled, it writes its marker file: the proof that a
    file holding it was unpickled."""
    __module__ = "__main__"

    def __init__(self, seed: int, marker: Path) -> None:
        self.seed, self.marker = seed, str(marker)

    def __setstate__(self, state: dict) -> None:
        Path(state["marker"]).write_text("unpickled")
        self.__dict__.update(state)


def write_marker(path: str) -> None:
    Path(path).write_text("unpickled")


class Trap:
    """Any object: unpickling it calls write_marker."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return write_marker, (self.marker,)


def test_a_pickled_data_loader_is_refused_never_unpickled_and_the_command_extracts_the_weights(tmp_path, capsys,
                                                                                              monkeypatch):
    main = sys.modules["__main__"]
    monkeypatch.setattr(main, "pretraining_dataset", pretraining_dataset, raising=False)
    monkeypatch.setattr(main, "WorkerInitObj", WorkerInitObj, raising=False)
    marker = tmp_path / "unpickled.marker"
    dataset = pretraining_dataset()
    loader = torch.utils.data.DataLoader(dataset, sampler=torch.utils.data.RandomSampler(dataset), batch_size=2,
                                         worker_init_fn=WorkerInitObj(42, marker))  # as run_pretraining.py builds it
    folder = nvidia_folder(tmp_path / "nv", {"ckpt_8601.pt": run_pretraining_2020(nvidia_state("cls."), loader)})
    ckpt = folder / "ckpt_8601.pt"

    code, _, err = run_cli(capsys, "convert", folder, tmp_path / "out")
    line = one_line_error(err)
    assert code == 2 and f"{ckpt}: holds pickled Python objects besides tensors" in line
    assert "torch.utils.data.dataloader.DataLoader" in line and "__main__.WorkerInitObj" in line
    assert "which bertrain does not unpickle" in line and "if you trust the file, extract its weights with: " in line
    assert not marker.exists() and not (tmp_path / "out").exists()
    with pytest.raises(ValueError, match="does not unpickle"):
        BertForPreTraining.from_pretrained(folder)
    argv = finetune_argv("glue", finetune_data("glue", tmp_path / "data"), folder, tmp_path / "run", 1)
    code, _, err = run_cli(capsys, *argv)  # the same line where fine-tuning starts from it
    assert code == 2 and one_line_error(err).endswith(line.split(": error: ", 1)[1])
    assert not marker.exists()

    # The command, run as the user would copy it (in another process, another folder), writes pytorch_model.bin
    command = line.split("extract its weights with: ", 1)[1].rsplit(" (it writes pytorch_model.bin", 1)[0]
    assert command.startswith("python -c ")
    subprocess.run(shlex.quote(sys.executable) + command[len("python"):], shell=True, check=True, cwd=tmp_path,
                   capture_output=True)
    assert not marker.exists()  # the stand-ins for run_pretraining.py's classes run nothing of theirs
    with torch.no_grad():
        model = BertForPreTraining.from_pretrained(folder).eval()
        x = inputs()
        out = model(x["input_ids"], x["segment_ids"], x["input_mask"], masked_positions=x["masked_lm_positions"])
    close(out.prediction_logits.reshape(2, 3, VOCAB), "v2020_mlm_logits")
    assert model.config.hidden_act == "gelu"

    torch.load(ckpt, weights_only=False)  # the trap is live: unpickling the file would have run its code
    assert marker.read_text() == "unpickled"


def test_any_pickled_object_is_refused_in_the_old_format_too(tmp_path):
    marker = tmp_path / "unpickled.marker"
    folder = nvidia_folder(tmp_path / "nv", {"bert_large_qa.pt": {"model": nvidia_state("qa_outputs."),
                                                                  "note": Trap(marker)}}, legacy=True)
    with pytest.raises(ValueError) as e:
        BertForQuestionAnswering.from_pretrained(folder)
    message = str(e.value)
    assert "\n" not in message and message.startswith(f"{folder / 'bert_large_qa.pt'}: holds pickled Python objects")
    assert "write_marker" in message and f"{folder / 'pytorch_model.bin'}" in message
    assert not marker.exists()


@pytest.mark.parametrize("rows, says", [
    (112, "has 112 rows, but NVIDIA's scripts pad a vocabulary of 100 tokens"),
    (102, "has 102 rows, but NVIDIA's scripts pad a vocabulary of 100 tokens"),
    (96, "has 96 rows, fewer than the 100 tokens of the vocabulary"),
])
def test_vocabulary_rows_that_nvidias_padding_does_not_explain_are_refused(rows, says, tmp_path, capsys):
    state = nvidia_state("cls.")
    g = torch.Generator().manual_seed(0)
    extra = torch.randn(max(rows - PADDED, 0), state[EMBEDDINGS].shape[1], generator=g)
    state[EMBEDDINGS] = state[DECODER] = torch.cat([state[EMBEDDINGS], extra])[:rows]
    state[MLM_BIAS] = torch.cat([state[MLM_BIAS], torch.zeros(max(rows - PADDED, 0))])[:rows]
    folder = nvidia_folder(tmp_path / "nv", {"ckpt_10.pt": {"model": state}})
    code, _, err = run_cli(capsys, "convert", folder, tmp_path / "out")
    line = one_line_error(err)
    assert code == 2 and f"{folder / 'ckpt_10.pt'}: " in line and says in line, line
    assert f"{folder / 'bert_config.json'} says vocab_size = 100" in line
    assert "use the bert_config.json and vocab.txt" in line and not (tmp_path / "out").exists()


def test_several_pt_files_are_refused_listing_them(tmp_path, capsys):
    state = nvidia_state("cls.")
    folder = nvidia_folder(tmp_path / "results", {"ckpt_200.pt": {"model": state}, "ckpt_100.pt": {"model": state},
                                                  "train_state.pt": {"step": 1}})
    code, _, err = run_cli(capsys, "convert", folder, tmp_path / "out")
    line = one_line_error(err)
    assert code == 2 and "holds 2 PyTorch checkpoints (ckpt_100.pt, ckpt_200.pt)" in line
    assert "move the others out of the folder, or rename the one to use to pytorch_model.bin" in line
    (folder / "ckpt_200.pt").rename(folder / "pytorch_model.bin")  # as the message says
    assert weights_files(folder) == [folder / "pytorch_model.bin"]
    assert BertForPreTraining.from_pretrained(folder).loading_info["missing_keys"] == []
    # bertrain's own train_state.pt is never taken for weights
    for f in ("pytorch_model.bin", "ckpt_100.pt"):
        (folder / f).unlink()
    with pytest.raises(ValueError, match=r"no weights found .* NVIDIA's PyTorch BERT \(\*\.pt\)"):
        weights_files(folder)


def test_files_that_are_not_nvidias_checkpoints_are_one_line_naming_them(tmp_path):
    for name, obj, says in [("list", {"model": [1, 2]}, "its 'model' entry is a list, not a state dict"),
                            ("bookkeeping", {"optimizer": {}, "epoch": 3}, "'optimizer', 'epoch' are not tensors"),
                            ("tensor", torch.ones(3), "holds a Tensor, not a checkpoint of NVIDIA's BERT scripts")]:
        folder = nvidia_folder(tmp_path / name, {"ckpt_1.pt": obj})
        with pytest.raises(ValueError) as e:
            BertForPreTraining.from_pretrained(folder)
        assert str(e.value).startswith(str(folder / "ckpt_1.pt")) and says in str(e.value), str(e.value)
    folder = nvidia_folder(tmp_path / "truncated", {"ckpt_1.pt": {"model": nvidia_state("cls.")}})
    data = (folder / "ckpt_1.pt").read_bytes()
    (folder / "ckpt_1.pt").write_bytes(data[:len(data) // 2])
    with pytest.raises(ValueError, match="cannot read weights") as e:
        BertForPreTraining.from_pretrained(folder)
    assert "\n" not in str(e.value) and str(e.value).startswith(str(folder / "ckpt_1.pt"))


def test_an_hf_pytorch_model_bin_keeps_its_vocabulary_check(tmp_path):
    """The padded-config allowance is NVIDIA's: an HF .bin with vocab_size 104 and 100 tokens is refused as before."""
    hf_state = {k.replace("dense_act", "dense"): v[:VOCAB] if k in (EMBEDDINGS, MLM_BIAS) else v
                for k, v in nvidia_state("cls.").items() if k != DECODER}
    folder = nvidia_folder(tmp_path / "hf", {"pytorch_model.bin": hf_state}, {**CONFIG, "vocab_size": PADDED})
    with pytest.raises(ValueError, match=r"vocab.txt has 100 tokens but .*bert_config.json says vocab_size = 104; "
                                         r"the vocabulary and the model do not belong together"):
        BertForPreTraining.from_pretrained(folder)


def test_info_shows_the_config_the_weights_are_computed_with(ckpt_2020, ckpt_2022, tmp_path):
    """`bertrain info` reads no tensor, but says what loading decides: 2022's checkpoint computes "gelu" as the tanh
    approximation, and a fine-tuning output's padded vocab_size is vocab.txt's (before: the config file's words)."""
    from bertrain.commands.info import describe

    assert describe(str(ckpt_2020))["config"]["hidden_act"] == "gelu"
    assert describe(str(ckpt_2022))["config"]["hidden_act"] == "gelu_new"
    padded = nvidia_folder(tmp_path / "SQuAD", {"ckpt_1.pt": {"model": nvidia_state("qa_outputs.")}},
                           {**CONFIG, "vocab_size": PADDED})
    info = describe(str(padded))
    assert info["config"]["vocab_size"] == VOCAB and info["config"]["hidden_act"] == "gelu"
    assert info["config"] == {**describe(str(ckpt_2020))["config"]}  # the same model
