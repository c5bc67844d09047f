"""`--init ORG/NAME` (fine-tuning) and `model.init: ORG/NAME` (pretraining): a Hub model id found in the local
Hugging Face cache, with HF_HUB_OFFLINE=1, never downloaded. The tests build the cache layout themselves
(models--ORG--NAME/blobs, snapshots/<commit>/ of links to the blobs, refs/main), as huggingface_hub writes it."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from bertrain import BertForPreTraining, BertForSequenceClassification
from bertrain.cli import main
from bertrain.model.hf import resolve_model_dir
from bertrain.tasks.common import load_task_tokenizer
from distributed import cli_env
from helpers import TINY_VOCAB, finetune_argv, finetune_data, save_tiny_model

hub = pytest.importorskip("huggingface_hub")
hub_constants = pytest.importorskip("huggingface_hub.constants")

COMMIT_A, COMMIT_B = "a" * 40, "b" * 40


def cache_model(cache: Path, repo_id: str, src: Path, commit: str, ref: str | None = "main") -> Path:
    """Put the files of the model folder `src` into `cache` as revision `commit` of `repo_id`: content-addressed
    blobs, the snapshot folder of relative links to them, and `refs/REF` naming the commit."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for f in sorted(p for p in src.iterdir() if p.is_file()):
        data = f.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / f.name).symlink_to(os.path.relpath(blob, snapshot))
    if ref:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture
def hub_cache(tmp_path: Path, monkeypatch) -> Path:
    """An empty HF cache for this test, offline. huggingface_hub reads its settings at import, so the module's
    constants are set too (a subprocess started with this environment needs only the variables)."""
    cache = tmp_path / "hf-cache"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    return cache


def tree(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


def test_finetune_init_from_the_cached_hub_model_offline(minilm_path: Path, hub_cache: Path, tmp_path: Path) -> None:
    """The real all-MiniLM-L6-v2 weights as sentence-transformers/all-MiniLM-L6-v2 in the cache: `bertrain finetune
    glue --init ORG/NAME` under HF_HUB_OFFLINE=1 trains from them, and the card names the base model."""
    snapshot = cache_model(hub_cache, "sentence-transformers/all-MiniLM-L6-v2", minilm_path, COMMIT_A)
    out = tmp_path / "run"
    argv = finetune_argv("glue", finetune_data("glue", tmp_path), Path("sentence-transformers/all-MiniLM-L6-v2"), out,
                         2, "--eval.each_epoch", "false")
    before = tree(hub_cache)
    proc = subprocess.run([sys.executable, "-m", "bertrain", *argv], env=cli_env(), capture_output=True, text=True,
                          timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert tree(hub_cache) == before  # read, not written: nothing fetched
    assert f"the Hub model in the local Hugging Face cache, {snapshot}" in proc.stderr
    assert json.loads((out / "eval_results.json").read_text())["init"] == "sentence-transformers/all-MiniLM-L6-v2"
    card = hub.ModelCard.load(out / "final" / "README.md")
    assert card.data.base_model == "sentence-transformers/all-MiniLM-L6-v2" and card.data.license == "other"
    assert "[sentence-transformers/all-MiniLM-L6-v2](https://huggingface.co/sentence-transformers/all-MiniLM-L6-v2)" \
        in card.text
    # its own card (in the cache) declares apache-2.0: said beside the unset license, not adopted
    assert "sentence-transformers/all-MiniLM-L6-v2, declares `license: apache-2.0`" in card.text
    # the encoder started from the cached weights: 2 steps at lr 1e-3 move them only a little
    start = load_file(minilm_path / "model.safetensors")
    final = load_file(out / "final" / "model.safetensors")
    w = "encoder.layer.0.attention.self.query.weight"
    assert (final["bert." + w] - start[w]).abs().max() < 0.05 < start[w].abs().max()


def test_a_hub_id_resolves_by_ref_or_commit_and_a_local_folder_wins(hub_cache: Path, tmp_path: Path,
                                                                     monkeypatch) -> None:
    old = cache_model(hub_cache, "acme/tiny-bert", save_tiny_model(tmp_path / "v1"), COMMIT_A, ref=None)
    torch.manual_seed(1)
    v2 = tmp_path / "v2"
    BertForPreTraining.from_pretrained(old, hidden_dropout_prob=0.0).save_pretrained(v2)  # other weights: heads new
    new = cache_model(hub_cache, "acme/tiny-bert", v2, COMMIT_B)  # refs/main -> B
    assert resolve_model_dir("acme/tiny-bert") == new
    assert resolve_model_dir("acme/tiny-bert@main") == new
    assert resolve_model_dir(f"acme/tiny-bert@{COMMIT_A}") == old
    model = BertForSequenceClassification.from_pretrained("acme/tiny-bert", num_labels=3)
    cached = BertForSequenceClassification.from_pretrained(new, num_labels=3)
    enc = model.bert.embeddings.word_embeddings.weight
    assert torch.equal(enc, cached.bert.embeddings.word_embeddings.weight)
    assert load_task_tokenizer("acme/tiny-bert").identity == load_task_tokenizer(new).identity

    monkeypatch.chdir(tmp_path)  # a folder of the same name beside the command is the one meant
    local = save_tiny_model(tmp_path / "acme" / "tiny-bert")
    assert resolve_model_dir("acme/tiny-bert") == Path("acme/tiny-bert")
    assert resolve_model_dir(str(local)) == local


@pytest.mark.parametrize("command", ["finetune", "pretrain"])
def test_an_absent_hub_model_offline_is_one_line_saying_how_to_fetch_it(command: str, hub_cache: Path,
                                                                        tmp_path: Path, capsys) -> None:
    if command == "finetune":
        argv = finetune_argv("glue", finetune_data("glue", tmp_path), Path("acme/absent"), tmp_path / "run", 2)
    else:
        argv = ["pretrain", "--model.init", "acme/absent", "--data.synthetic_samples", "16", "--data.vocab_file",
                TINY_VOCAB, "--train.steps", "1", "--output_dir", str(tmp_path / "run")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "acme/absent: no such folder, and the Hub model acme/absent is not in the local Hugging Face cache" in err
    assert str(hub_cache) in err and "hf download acme/absent" in err
    assert tree(hub_cache) == [] and not (tmp_path / "run" / "final").exists()


def test_a_partly_cached_model_and_a_bad_revision_say_what_to_fetch(hub_cache: Path, tmp_path: Path) -> None:
    part = tmp_path / "part"
    part.mkdir()
    (part / "vocab.txt").write_text(Path(TINY_VOCAB).read_text())
    cache_model(hub_cache, "acme/part", part, COMMIT_A)  # only vocab.txt was fetched
    with pytest.raises(ValueError, match=r"holds only part of acme/part .*no config.json.*`hf download acme/part`"):
        resolve_model_dir("acme/part")
    with pytest.raises(ValueError, match=r"acme/part at revision v9 is not in the local .*"
                                         r"`hf download acme/part --revision v9`"):
        resolve_model_dir("acme/part@v9")


def test_pretraining_model_init_reads_the_cached_model(hub_cache: Path, tmp_path: Path) -> None:
    from bertrain.config import from_dict
    from bertrain.tasks.pretraining import PretrainConfig, build_model, check_model_fits_samples
    from bertrain.utils.errors import UserError

    snapshot = cache_model(hub_cache, "acme/tiny-bert", save_tiny_model(tmp_path / "tiny"), COMMIT_A)
    cfg = {"model": {"init": "acme/tiny-bert"}, "data": {"synthetic_samples": 16, "vocab_file": TINY_VOCAB},
           "train": {"steps": 1}, "output_dir": str(tmp_path / "run")}
    # the sample length is checked against the cached config.json before any data is built
    too_long = from_dict(PretrainConfig, {**cfg, "sample": {"max_seq_length": 1024}})
    with pytest.raises(UserError, match=r"exceeds the model's max_position_embeddings \(512\)"):
        check_model_fits_samples(too_long)
    ok = from_dict(PretrainConfig, cfg)
    check_model_fits_samples(ok)
    vocab = Path(TINY_VOCAB).read_bytes()
    model = build_model(ok, vocab.count(b"\n"), {"vocab.txt": vocab})
    assert model.loading_info["initialized"] == ["MLM head", "NSP head"]  # the cached encoder has no heads
    cached = load_file(snapshot / "model.safetensors")
    ours = model.bert.encoder.layer[1].output.dense.weight
    assert torch.equal(ours, cached["encoder.layer.1.output.dense.weight"])


def test_without_huggingface_hub_a_hub_id_names_the_extra(tmp_path: Path) -> None:
    code = ("import sys; sys.modules['huggingface_hub'] = None\n"  # import huggingface_hub -> ImportError
            "from bertrain.model.hf import resolve_model_dir\n"
            f"assert resolve_model_dir({str(tmp_path)!r}) == __import__('pathlib').Path({str(tmp_path)!r})\n"
            "try:\n    resolve_model_dir('acme/tiny-bert')\nexcept ValueError as e:\n    print(e)\n")
    proc = subprocess.run([sys.executable, "-c", code], env=cli_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == ("acme/tiny-bert: no such folder; to use it as a Hugging Face Hub model id (found in "
                                   'the local HF cache) install huggingface_hub: pip install "bertrain[hub]"')
