"""Google's TensorFlow BERT checkpoints, read without TensorFlow (bertrain.model.tf_checkpoint and hf.py on top).

The fixture, tests/assets/google-tf-tiny, is a real checkpoint: Google's modeling.py (+ the heads of
run_pretraining.py, run_squad.py, run_classifier.py and one step of its AdamWeightDecayOptimizer) run in graph mode
by TensorFlow 2.15.1 and saved by tf.compat.v1.train.Saver, with the graph's outputs on fixed inputs (expected.npz);
make_fixture.py beside it made it and says how. So the outputs here are compared with Google's own code, and the
index/data files are TensorFlow's bytes, not a re-implementation's.
"""
from __future__ import annotations

import json
import logging
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from bertrain import BertForPreTraining, BertForQuestionAnswering, BertForSequenceClassification, BertModel
from bertrain.model import tf_checkpoint
from bertrain.model.hf import load_hf_state_dict, model_class_for, weights_files
from conftest import ASSETS
from helpers import finetune_argv, finetune_data, one_line_error, run_cli

FIXTURE = ASSETS / "google-tf-tiny"
PREFIX = "bert_model.ckpt"
DATA = f"{PREFIX}.data-00000-of-00001"
EXPECTED = dict(np.load(FIXTURE / "expected.npz"))
RTOL = ATOL = 1e-5
SKIPPED = ["bert/encoder/layer_1/output/LayerNorm/gamma/adam_m", "bert/encoder/layer_1/output/LayerNorm/gamma/adam_v",
           "bert/pooler/dense/bias/adam_m", "bert/pooler/dense/bias/adam_v", "fixture_note", "global_step",
           "output_weights/adam_m", "output_weights/adam_v"]


def inputs() -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(EXPECTED[k]).long()
            for k in ("input_ids", "input_mask", "segment_ids", "masked_lm_positions")}


def close(actual: torch.Tensor, name: str, where: torch.Tensor | None = None) -> float:
    """Assert `actual` is Google's output `name` (at the positions `where`, if given); the max abs difference."""
    expected = torch.from_numpy(EXPECTED[name])
    if where is not None:
        actual, expected = actual[where], expected[where]
    torch.testing.assert_close(actual.float(), expected, rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}: {m}")
    return (actual.float() - expected).abs().max().item()


def copy_fixture(dest: Path, prefix: str = PREFIX) -> Path:
    """The fixture's files in `dest`, the checkpoint under `prefix` (make_fixture.py left out)."""
    dest.mkdir(parents=True, exist_ok=True)
    for f in FIXTURE.iterdir():
        if f.name.startswith(PREFIX):
            shutil.copy(f, dest / f.name.replace(PREFIX, prefix, 1))
        elif f.suffix in (".json", ".txt"):
            shutil.copy(f, dest / f.name)
    return dest


# ----------------------------------------------------------------------------------------------- CRC32C, a table

def _crc32c_table() -> list[int]:
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_TABLE = _crc32c_table()


def slow_crc32c(data) -> int:
    """CRC32C in pure Python: fine for the fixture's 58 KB, the reason bertrain does not ship one."""
    c = 0xFFFFFFFF
    for b in bytes(data):
        c = _TABLE[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


@pytest.fixture
def with_crc(monkeypatch):
    """The checksums checked, as where google_crc32c or crc32c is installed."""
    assert slow_crc32c(b"123456789") == 0xE3069283  # the CRC32C check value
    monkeypatch.setattr(tf_checkpoint, "crc32c_function", lambda: slow_crc32c)


@pytest.fixture
def without_crc(monkeypatch):
    """The checksums not checked, as where no CRC32C package is installed (the default here)."""
    monkeypatch.setattr(tf_checkpoint, "crc32c_function", lambda: None)


# ----------------------------------------------------------------------------------------------- an index writer

def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def write_index(path: Path, entries: list[tuple[bytes, bytes]], compression: int = 0) -> None:
    """An SSTable laid out as LevelDB's/TF's table builder does: one data block (keys whole, one restart), an empty
    metaindex block, the index block, the footer; each block with its trailer and a valid masked CRC32C."""
    out = bytearray()

    def block(items: list[tuple[bytes, bytes]]) -> bytes:
        body = b"".join(_varint(0) + _varint(len(k)) + _varint(len(v)) + k + v for k, v in items)
        return body + struct.pack("<II", 0, 1)

    def put(contents: bytes, kind: int = 0) -> bytes:
        handle = _varint(len(out)) + _varint(len(contents))
        crc = tf_checkpoint._mask(slow_crc32c(contents + bytes([kind])))
        out.extend(contents + bytes([kind]) + struct.pack("<I", crc))
        return handle

    data = put(block(entries), compression)
    meta = put(block([]))
    index = put(block([(entries[-1][0], data)]))
    path.write_bytes(bytes(out) + (meta + index).ljust(40, b"\0") + struct.pack("<Q", tf_checkpoint.TABLE_MAGIC))


def fixture_entries() -> list[tuple[bytes, bytes]]:
    return list(tf_checkpoint.read_table(FIXTURE / f"{PREFIX}.index", None))


# ----------------------------------------------------------------------------------------------- (a) the reader

def test_the_reader_lists_what_tensorflow_saved(with_crc):
    ckpt = tf_checkpoint.TFCheckpoint(FIXTURE / PREFIX)
    variables = {name: (shape, dtype) for name, shape, dtype in ckpt.variables()}
    assert len(variables) == 58 and ckpt.num_shards == 1 and not ckpt.big_endian
    assert variables["bert/embeddings/word_embeddings"] == ([100, 24], "float32")
    assert variables["bert/encoder/layer_1/intermediate/dense/kernel"] == ([24, 37], "float32")  # TF: [in, out]
    assert variables["cls/predictions/output_bias"] == ([100], "float32")
    assert variables["output_weights"] == ([3, 24], "float32")
    assert variables["global_step"] == ([], "int64") and variables["fixture_note"] == ([], "string")
    assert ckpt.read("global_step").item() == 1
    for name, (shape, dtype) in variables.items():  # every tensor reads, its checksum verified
        if dtype != "string":
            assert list(ckpt.read(name).shape) == shape
    with pytest.raises(ValueError, match="fixture_note is a string tensor"):
        ckpt.read("fixture_note")


def test_google_names_become_hf_names_kernels_transposed(caplog):
    caplog.set_level(logging.INFO, logger="bertrain.model.tf_checkpoint")
    ckpt = tf_checkpoint.TFCheckpoint(FIXTURE / PREFIX)
    sd = tf_checkpoint.load_bert_state_dict(FIXTURE / f"{PREFIX}.index")
    assert len(sd) == 58 - len(SKIPPED)
    assert f"skipped {len(SKIPPED)} variable(s)" in caplog.text and "global_step" in caplog.text
    query = ckpt.read("bert/encoder/layer_0/attention/self/query/kernel")
    assert torch.equal(sd["bert.encoder.layer.0.attention.self.query.weight"], query.t())
    assert sd["bert.encoder.layer.1.intermediate.dense.weight"].shape == (37, 24)  # torch: [out, in]
    assert torch.equal(sd["bert.embeddings.LayerNorm.weight"], ckpt.read("bert/embeddings/LayerNorm/gamma"))
    assert torch.equal(sd["cls.predictions.bias"], ckpt.read("cls/predictions/output_bias"))
    for tf_name, hf_name in [("cls/seq_relationship/output_weights", "cls.seq_relationship.weight"),
                             ("cls/squad/output_weights", "qa_outputs.weight"),
                             ("output_weights", "classifier.weight")]:
        assert torch.equal(sd[hf_name], ckpt.read(tf_name))  # [out, in] already: not transposed
    assert not [k for k in sd if "adam" in k or "global_step" in k or "note" in k]


@pytest.mark.parametrize("tf_name, expected", [
    ("bert/encoder/layer_11/attention/output/dense/kernel",
     ("bert.encoder.layer.11.attention.output.dense.weight", True)),
    ("bert/encoder/layer_3/output/LayerNorm/beta", ("bert.encoder.layer.3.output.LayerNorm.bias", False)),
    ("bert/embeddings/token_type_embeddings", ("bert.embeddings.token_type_embeddings.weight", False)),
    ("bert/pooler/dense/bias", ("bert.pooler.dense.bias", False)),
    ("cls/predictions/transform/LayerNorm/gamma", ("cls.predictions.transform.LayerNorm.weight", False)),
    ("cls/squad/output_bias", ("qa_outputs.bias", False)),
    ("bert/pooler/dense/kernel/adam_m", None), ("global_step", None), ("bert/encoder/layer_0/kernel", None),
    ("bert/embeddings/LayerNorm/kernel", None),
])
def test_the_name_map(tf_name, expected):
    assert tf_checkpoint.hf_key(tf_name) == expected


def test_the_index_writer_of_these_tests_writes_what_the_reader_reads(tmp_path, with_crc):
    """The error tests below rewrite the index; unchanged, the rewrite loads the same weights."""
    folder = copy_fixture(tmp_path / "m")
    write_index(folder / f"{PREFIX}.index", fixture_entries())
    a, b = load_hf_state_dict(folder), load_hf_state_dict(FIXTURE)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_big_endian_header_reads_big_endian_bytes(tmp_path, with_crc):
    entries = [(k, v + b"\x10\x01" if k == b"" else v) for k, v in fixture_entries()]  # endianness = BIG
    folder = copy_fixture(tmp_path / "m")
    write_index(folder / f"{PREFIX}.index", entries)
    little = tf_checkpoint.TFCheckpoint(FIXTURE / PREFIX).read("cls/predictions/output_bias")
    big = tf_checkpoint.TFCheckpoint(folder / PREFIX)
    assert big.big_endian
    swapped = torch.from_numpy(little.numpy().view(">f4").astype("<f4"))
    assert torch.equal(big.read("cls/predictions/output_bias").view(torch.int32), swapped.view(torch.int32))


# ----------------------------------------------------------------------------------------------- (b) parity

@torch.no_grad()
def test_pretraining_model_computes_what_googles_code_computed(caplog):
    caplog.set_level(logging.INFO, logger="bertrain.model.hf")
    x = inputs()
    model = BertForPreTraining.from_pretrained(FIXTURE).eval()
    assert model.config.hidden_act == "gelu_new" and "tanh approximation" in caplog.text
    assert model.loading_info["initialized"] == [] and model.loading_info["missing_keys"] == []
    out = model(x["input_ids"], x["segment_ids"], x["input_mask"], masked_positions=x["masked_lm_positions"])
    log_probs = torch.log_softmax(out.prediction_logits.float(), -1).reshape(-1, 100)
    print("max |ours - Google's|: mlm_log_probs", close(log_probs, "mlm_log_probs"),
          "nsp_logits", close(out.seq_relationship_logits, "nsp_logits"))


@torch.no_grad()
def test_encoder_computes_what_googles_code_computed():
    x = inputs()
    model = BertModel.from_pretrained(FIXTURE).eval()
    out = model(x["input_ids"], x["segment_ids"], x["input_mask"])  # every position, padding too
    print("max |ours - Google's|: sequence_output", close(out.last_hidden_state, "sequence_output"),
          "pooled_output", close(out.pooler_output, "pooled_output"))
    # The activation matters: read as the exact erf GELU (HF's "gelu"), the outputs are not Google's.
    erf = BertModel.from_pretrained(FIXTURE, hidden_act="gelu").eval()
    different = erf(x["input_ids"], x["segment_ids"], x["input_mask"]).last_hidden_state
    assert (different - torch.from_numpy(EXPECTED["sequence_output"])).abs().max() > 100 * ATOL


@torch.no_grad()
def test_squad_and_classifier_heads_compute_what_googles_code_computed():
    x = inputs()
    qa = BertForQuestionAnswering.from_pretrained(FIXTURE).eval()
    out = qa(x["input_ids"], x["segment_ids"], x["input_mask"])
    real = x["input_mask"].bool()  # at padding bertrain gives -10000 (answers never lie there)
    print("max |ours - Google's|: start_logits", close(out.start_logits, "start_logits", real),
          "end_logits", close(out.end_logits, "end_logits", real))
    classifier = BertForSequenceClassification.from_pretrained(FIXTURE).eval()
    assert classifier.num_labels == 3
    print("classifier_logits", close(classifier(x["input_ids"], x["segment_ids"], x["input_mask"]).logits,
                                     "classifier_logits"))


def test_the_folder_is_found_and_classified():
    assert weights_files(FIXTURE) == [FIXTURE / f"{PREFIX}.index"]
    assert model_class_for(FIXTURE) is BertForQuestionAnswering  # the heads present decide: qa_outputs first


# ----------------------------------------------------------------------------------------------- (c) convert

@torch.no_grad()
def test_convert_writes_a_folder_transformers_computes_the_same_with(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "converted"
    code, stdout, _ = run_cli(capsys, "convert", FIXTURE, out)
    assert code == 0 and "converted" in stdout
    config = json.loads((out / "config.json").read_text())
    assert config["hidden_act"] == "gelu_new"  # transformers' NewGELUActivation: Google's tanh approximation
    assert (out / "vocab.txt").read_bytes() == (FIXTURE / "vocab.txt").read_bytes()
    hf = transformers.BertForPreTraining.from_pretrained(out, attn_implementation="eager").eval()
    x = inputs()
    o = hf(input_ids=x["input_ids"], attention_mask=x["input_mask"], token_type_ids=x["segment_ids"],
           output_hidden_states=True)
    positions = x["masked_lm_positions"]
    at_masks = o.prediction_logits.gather(1, positions[..., None].expand(-1, -1, 100))
    pooled = hf.bert(input_ids=x["input_ids"], attention_mask=x["input_mask"],
                     token_type_ids=x["segment_ids"]).pooler_output
    print("max |transformers - Google's|: sequence_output", close(o.hidden_states[-1], "sequence_output"),
          "pooled_output", close(pooled, "pooled_output"),
          "mlm_log_probs", close(torch.log_softmax(at_masks, -1).reshape(-1, 100), "mlm_log_probs"),
          "nsp_logits", close(o.seq_relationship_logits, "nsp_logits"))
    # bertrain reads the converted folder (an HF folder now: its "gelu_new" is taken as written) the same way
    again = BertForPreTraining.from_pretrained(out)
    assert again.config.hidden_act == "gelu_new"


def test_finetune_init_from_a_google_folder(tmp_path, capsys):
    data = finetune_data("glue", tmp_path / "data")
    code, _, err = run_cli(capsys, *finetune_argv("glue", data, FIXTURE, tmp_path / "run", 1))
    assert code == 0, err
    assert json.loads((tmp_path / "run" / "final" / "config.json").read_text())["hidden_act"] == "gelu_new"


# ----------------------------------------------------------------------------------------------- which checkpoint

def test_the_checkpoint_file_chooses(tmp_path):
    folder = copy_fixture(tmp_path / "run", "model.ckpt-100")
    copy_fixture(folder, "model.ckpt-200")
    with open(folder / "model.ckpt-200.data-00000-of-00001", "r+b") as f:
        f.truncate(1000)  # so that loading it fails, naming it
    with pytest.raises(ValueError, match=r"holds 2 TensorFlow checkpoints \(model.ckpt-100, model.ckpt-200\) and no "
                                         r"`checkpoint` file.*model_checkpoint_path: \"model.ckpt-200\""):
        BertForPreTraining.from_pretrained(folder)
    # as tf.train.Saver writes it (often with the absolute path where training ran, here or on a bucket)
    (folder / "checkpoint").write_text('model_checkpoint_path: "gs://bucket/out/model.ckpt-100"\n'
                                       'all_model_checkpoint_paths: "gs://bucket/out/model.ckpt-100"\n'
                                       'all_model_checkpoint_paths: "gs://bucket/out/model.ckpt-200"\n')
    assert weights_files(folder) == [folder / "model.ckpt-100.index"]
    assert BertForPreTraining.from_pretrained(folder).loading_info["missing_keys"] == []
    (folder / "checkpoint").write_text('model_checkpoint_path: "model.ckpt-200"\n')
    with pytest.raises(ValueError, match="model.ckpt-200.data-00000-of-00001: truncated"):
        BertForPreTraining.from_pretrained(folder)
    (folder / "checkpoint").write_text('model_checkpoint_path: "model.ckpt-300"\n')
    with pytest.raises(ValueError, match=r"names the checkpoint 'model.ckpt-300', but .* has no model.ckpt-300.index; "
                                         r".*one of: model.ckpt-100, model.ckpt-200"):
        BertForPreTraining.from_pretrained(folder)


# ----------------------------------------------------------------------------------------------- (d) damage

def test_a_truncated_data_file_is_one_clear_error(tmp_path, capsys):
    folder = copy_fixture(tmp_path / "m")
    data = folder / DATA
    with open(data, "r+b") as f:
        f.truncate(data.stat().st_size - 100)
    code, _, err = run_cli(capsys, "convert", folder, tmp_path / "out")
    line = one_line_error(err)
    assert code == 2 and str(data) in line and "truncated" in line and "download or copy it again" in line
    assert not (tmp_path / "out").exists()
    # the same line where fine-tuning starts from it (`--init`)
    argv = finetune_argv("glue", finetune_data("glue", tmp_path / "data"), folder, tmp_path / "run", 1)
    code, _, err = run_cli(capsys, *argv)
    assert code == 2 and one_line_error(err).endswith(line.split(": error: ", 1)[1])


def test_a_damaged_index_is_one_clear_error(tmp_path, capsys):
    folder = copy_fixture(tmp_path / "m")
    index = folder / f"{PREFIX}.index"
    index.write_bytes(index.read_bytes()[:-8] + b"\0" * 8)  # the magic overwritten
    code, _, err = run_cli(capsys, "convert", folder, tmp_path / "out")
    line = one_line_error(err)
    assert code == 2 and str(index) in line and "table magic" in line and "download or copy" in line
    index.write_bytes(b"")  # empty (e.g. a failed copy)
    with pytest.raises(ValueError, match="not a TensorFlow checkpoint index"):
        BertForPreTraining.from_pretrained(folder)


def test_a_corrupt_block_or_tensor_fails_its_checksum_where_one_is_checked(tmp_path, with_crc):
    folder = copy_fixture(tmp_path / "m")
    data = folder / DATA
    raw = bytearray(data.read_bytes())
    raw[100] ^= 0x40  # a bit of bert/embeddings/LayerNorm/gamma (bytes 96..191), size unchanged
    data.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match=r"bytes of bert/embeddings/LayerNorm/gamma do not match their checksum"):
        BertModel.from_pretrained(folder)
    index = folder / f"{PREFIX}.index"
    raw = bytearray(index.read_bytes())
    raw[20] ^= 0x01
    index.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match=r"damaged .*checksum does not match"):
        BertModel.from_pretrained(folder)


def test_a_missing_data_file_is_one_clear_error(tmp_path, capsys):
    folder = copy_fixture(tmp_path / "m")
    (folder / DATA).unlink()
    code, _, err = run_cli(capsys, "convert", folder, tmp_path / "out")
    line = one_line_error(err)
    assert code == 2 and f"{folder / DATA}: missing" in line and "copy or download all of them" in line


def test_an_unknown_bert_variable_is_refused_naming_it(tmp_path, without_crc, capsys):
    entries = dict(fixture_entries())
    entries[b"bert/encoder/layer_0/attention/self/relative_bias"] = entries[b"bert/pooler/dense/bias"]
    folder = copy_fixture(tmp_path / "m")
    write_index(folder / f"{PREFIX}.index", sorted(entries.items()))
    code, _, err = run_cli(capsys, "convert", folder, tmp_path / "out")
    line = one_line_error(err)
    assert code == 2 and "bert/encoder/layer_0/attention/self/relative_bias" in line
    assert "not part of Google's BERT" in line
    # outside bert/ an unknown variable is bookkeeping: skipped
    del entries[b"bert/encoder/layer_0/attention/self/relative_bias"]
    entries[b"loss_scale"] = entries[b"global_step"]
    write_index(folder / f"{PREFIX}.index", sorted(entries.items()))
    assert BertForPreTraining.from_pretrained(folder).loading_info["initialized"] == []
    # no bert/ variable at all: another code's checkpoint (TF 2's object-based ones name variables otherwise)
    other = {k: v for k, v in entries.items() if not k.startswith((b"bert/", b"cls/"))}
    write_index(folder / f"{PREFIX}.index", sorted(other.items()))
    with pytest.raises(ValueError, match=r"holds no variable of Google's BERT .* but fixture_note, global_step"):
        BertForPreTraining.from_pretrained(folder)


def test_partitioned_variables_and_compressed_tables_are_refused(tmp_path, without_crc):
    entries = fixture_entries()
    folder = copy_fixture(tmp_path / "m")
    sliced = [(k, v + b"\x3a\x00" if k == b"bert/pooler/dense/kernel" else v) for k, v in entries]  # slices = 7
    write_index(folder / f"{PREFIX}.index", sliced)
    with pytest.raises(ValueError, match="bert/pooler/dense/kernel is a partitioned variable"):
        BertForPreTraining.from_pretrained(folder)
    write_index(folder / f"{PREFIX}.index", entries, compression=1)
    with pytest.raises(ValueError, match=r"compressed \(type 1\)"):
        BertForPreTraining.from_pretrained(folder)


def test_a_randomly_damaged_index_is_a_value_error_never_a_crash(tmp_path, without_crc):
    """Bytes changed, cut or removed anywhere in the index (no checksum to catch it): a ValueError of one line, or
    (a change where it does not matter, e.g. a checksum) the weights; never another exception."""
    import random

    folder = copy_fixture(tmp_path / "m")
    index = folder / f"{PREFIX}.index"
    original = index.read_bytes()
    for seed in range(300):
        r = random.Random(seed)
        damaged = bytearray(original)
        if seed % 3 == 0:
            for _ in range(r.randint(1, 4)):
                damaged[r.randrange(len(damaged))] = r.randrange(256)
        elif seed % 3 == 1:
            damaged = damaged[:r.randrange(len(damaged))]
        else:
            i = r.randrange(len(damaged))
            del damaged[i:i + r.randint(1, 20)]
        index.write_bytes(bytes(damaged))
        try:
            tf_checkpoint.load_bert_state_dict(index)
        except ValueError as e:
            assert "\n" not in str(e) and str(index) in str(e), (seed, str(e))


def test_info_shows_the_activation_the_checkpoint_is_computed_with(tmp_path):
    """`bertrain info` reads no tensor, but shows Google's "gelu" as loading computes it (before: "gelu")."""
    from bertrain.commands.info import describe

    info = describe(str(FIXTURE))
    assert info["config"]["hidden_act"] == "gelu_new"
    assert json.loads((FIXTURE / "bert_config.json").read_text())["hidden_act"] == "gelu"
    hf = tmp_path / "hf"
    BertForPreTraining.from_pretrained(FIXTURE).save_pretrained(hf)
    assert describe(str(hf))["config"] == info["config"]  # the converted folder says the same
