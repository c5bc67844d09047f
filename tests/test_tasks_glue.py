"""GLUE TSV readers (layouts, BOM, quoting, label validation) and the submission format."""
from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pytest

from conftest import ASSETS, shared_file

from bertrain.tasks.common import load_task_tokenizer
from bertrain.tasks.glue import TASKS, build_features, get_task, read_glue_tsv, read_split, write_submission


def tsv(path: Path, rows: list[list[str]], bom: bool = False) -> Path:
    text = "\n".join("\t".join(r) for r in rows) + "\n"
    path.write_bytes((b"\xef\xbb\xbf" if bom else b"") + text.encode("utf-8"))
    return path


def test_real_mrpc_and_sst2_layouts():
    mrpc = get_task("mrpc")
    train = read_glue_tsv(shared_file("glue/MRPC/train.tsv"), mrpc, mrpc.train)  # starts with a BOM
    assert len(train) == 3667 and train[0].label == "1"
    assert train[0].text_a.startswith("Amrozi accused his brother") and train[0].text_b.startswith("Referring to him")
    # QUOTE_NONE: a sentence with an unbalanced double quote stays one field on one line
    assert any(ex.text_b.startswith('" ') for ex in train)
    (_, dev), = read_split(shared_file("glue/MRPC/dev.tsv").parent, mrpc, "dev")
    assert len(dev) == 408 and sum(ex.label == "1" for ex in dev) / len(dev) == pytest.approx(0.684, abs=1e-3)
    (_, test), = read_split(shared_file("glue/MRPC/test.tsv").parent, mrpc, "test")
    assert len(test) == 1725 and test[0].label is None and test[0].index == "0"
    sst = get_task("SST-2")
    (_, dev), = read_split(shared_file("glue/SST-2/dev.tsv").parent, sst, "dev")
    assert len(dev) == 872 and dev[0].text_b is None
    assert sum(ex.label == "1" for ex in dev) / len(dev) == pytest.approx(0.509, abs=1e-3)


def test_cola_has_no_header_and_mnli_has_two_dev_sets(tmp_path):
    cola = TASKS["cola"]
    tsv(tmp_path / "train.tsv", [["gj04", "1", "", "The sailors rode the breeze clear of the rocks."],
                                 ["gj04", "0", "*", "The more you eat, the more you want \"."]])
    ex = read_glue_tsv(tmp_path / "train.tsv", cola, cola.train)
    assert [e.label for e in ex] == ["1", "0"] and ex[1].text_a.endswith('want ".')
    mnli = TASKS["mnli"]
    header = ["index", "promptID", "pairID", "genre", "s1bp", "s2bp", "s1p", "s2p", "sentence1", "sentence2",
              "label1", "gold_label"]
    row = ["0", "1", "1e", "fiction", "(", "(", "(", "(", "A man sleeps.", "A person rests.", "entailment",
           "entailment"]
    tsv(tmp_path / "dev_matched.tsv", [header, row])
    tsv(tmp_path / "dev_mismatched.tsv", [header, row[:-1] + ["neutral"], row[:-1] + ["contradiction"]])
    splits = read_split(tmp_path, mnli, "dev")
    assert [(n, [e.label for e in ex]) for n, ex in splits] == [
        ("mnli-m", ["entailment"]), ("mnli-mm", ["neutral", "contradiction"])]


def test_bad_rows_name_file_and_line(tmp_path):
    rte = TASKS["rte"]
    p = tsv(tmp_path / "dev.tsv", [["index", "sentence1", "sentence2", "label"],
                                   ["0", "A dog runs.", "An animal moves.", "entailment"],
                                   ["1", "A dog runs.", "A cat sleeps.", "contradiction"]])
    with pytest.raises(ValueError, match=rf"{p}:3: label 'contradiction' is not one of rte's labels"):
        read_glue_tsv(p, rte, rte.dev)
    p = tsv(tmp_path / "short.tsv", [["index", "sentence1", "sentence2", "label"], ["0", "only one sentence"]])
    with pytest.raises(ValueError, match=rf"{p}:2: 2 tab-separated fields, rte needs at least 4"):
        read_glue_tsv(p, rte, rte.dev)
    stsb = TASKS["stsb"]
    p = tsv(tmp_path / "sts.tsv", [["index", "genre", "filename", "year", "old_index", "source1", "source2",
                                    "sentence1", "sentence2", "score"],
                                   ["0", "g", "f", "y", "0", "s", "s", "A plane.", "An air plane.", "high"]])
    with pytest.raises(ValueError, match=rf"{p}:2: stsb label 'high' is not a number"):
        read_glue_tsv(p, stsb, stsb.dev)
    p = tmp_path / "latin1.tsv"
    p.write_bytes(b"sentence\tlabel\ncaf\xe9\t1\n")
    with pytest.raises(ValueError, match=rf"{p}: not UTF-8"):
        read_glue_tsv(p, TASKS["sst2"], TASKS["sst2"].dev)
    with pytest.raises(ValueError, match="unknown GLUE task 'squad'"):
        get_task("squad")


def test_a_header_with_reordered_columns_is_refused_and_other_names_warn(tmp_path, caplog):
    """Reordered columns would train on ids or labels as text: refused, naming the column; a header with names
    GLUE does not use is read by position with a warning."""
    rows = ["1\t7\t8\tThe cat sat.\tA cat was sitting.", "0\t9\t10\tIt rained.\tThe sun shone."]
    (tmp_path / "ok.tsv").write_text("Quality\t#1 ID\t#2 ID\t#1 String\t#2 String\n" + "\n".join(rows) + "\n")
    assert [e.text_a for e in read_glue_tsv(tmp_path / "ok.tsv", get_task("mrpc"), TASKS["mrpc"].train)] == [
        "The cat sat.", "It rained."]
    moved = ["\t".join(r.split("\t")[i] for i in (0, 3, 4, 1, 2)) for r in rows]
    (tmp_path / "moved.tsv").write_text("Quality\t#1 String\t#2 String\t#1 ID\t#2 ID\n" + "\n".join(moved) + "\n")
    with pytest.raises(ValueError, match=r"moved.tsv:1: the header has '#1 string' in column 2, but mrpc reads its "
                                         r"text_a from column 4 \('#1 ID'\)"):
        read_glue_tsv(tmp_path / "moved.tsv", get_task("mrpc"), TASKS["mrpc"].train)
    (tmp_path / "named.tsv").write_text("y\ta\tb\tfirst\tsecond\n" + "\n".join(rows) + "\n")
    with caplog.at_level("WARNING"):
        assert len(read_glue_tsv(tmp_path / "named.tsv", get_task("mrpc"), TASKS["mrpc"].train)) == 2
    assert "named.tsv: the header does not name GLUE's mrpc columns ('#1 string', '#2 string', 'quality')" in \
        caplog.text


def test_features_and_submission(tmp_path):
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    (tok_dir / "vocab.txt").write_bytes((ASSETS / "vocab-tiny.txt").read_bytes())
    tok = load_task_tokenizer(tok_dir)
    rte = TASKS["rte"]
    p = tsv(tmp_path / "test.tsv", [["index", "sentence1", "sentence2"],
                                    ["7", "the cat sat on the mat " * 20, "a cat"], ["9", "one", "two"]])
    ex = read_glue_tsv(p, rte, rte.test)
    f = build_features(ex, rte, tok, max_seq_length=32)
    assert f["input_ids"].shape == (2, 32) and (f["labels"] == -1).all()
    assert f["attention_mask"][0].sum() == 32 and f["attention_mask"][1].sum() < 32
    # longest-first truncation keeps the short second sentence whole
    assert (f["token_type_ids"][0] == 1).sum() == len(tok.encode_plain(["a cat"])[0].ids) + 1
    write_submission(tmp_path / "RTE.tsv", rte, ex, np.array([1, 0]))
    rows = list(csv.reader(open(tmp_path / "RTE.tsv"), delimiter="\t"))
    assert rows == [["index", "prediction"], ["7", "not_entailment"], ["9", "entailment"]]
    stsb = TASKS["stsb"]
    write_submission(tmp_path / "STS-B.tsv", stsb, ex, np.array([5.7, -0.2]))
    assert (tmp_path / "STS-B.tsv").read_text().splitlines()[1:] == ["7\t5.000", "9\t0.000"]
    assert TASKS["mnli"].submission == ("MNLI-m.tsv", "MNLI-mm.tsv")
