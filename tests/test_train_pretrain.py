"""End to end on real text: `bertrain pretrain` on 2 processes (torchrun-style environment) trains a vocab on the
built-in corpus, prepares it, pretrains the tiny model, logs metrics, plots, exports HF format that transformers
loads; a phase-2 run starts from those weights at another sequence length."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from distributed import launch_cli

pytestmark = pytest.mark.slow


def test_pretrain_on_builtin_corpus_two_processes_then_phase2(tmp_path: Path) -> None:
    out = tmp_path / "run"
    common = ["--model.preset", "tiny", "--data.vocab_size", "2000", "--train.micro_batch_size", "8",
              "--train.global_batch_size", "32", "--train.log_interval", "2", "--optim.name", "lamb",
              "--optim.lr", "5e-3", "--checkpoint.save_interval", "4", "--seed", "5"]
    results = launch_cli(2, ["pretrain", "--config", "configs/quickstart.yaml", "--output_dir", str(out),
                             "--sample.max_seq_length", "64", "--sample.max_predictions_per_seq", "10",
                             "--train.steps", "8", *common], cwd=Path(__file__).resolve().parents[1])
    for r in results:
        assert r.returncode == 0, r.stdout[-4000:]
    assert (out / "vocab" / "vocab.txt").is_file() and (out / "data" / "stats.json").is_file()
    assert "accumulation 2 x 2 ranks" in results[0].stdout
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in records if "event" not in r]
    assert [r["step"] for r in rows] == [2, 4, 6, 8]
    # the quickstart holds out a few python-docs documents: evaluated after the last step, on both ranks' share
    (ev,) = [r for r in records if r.get("event") == "eval"]
    assert ev["step"] == 8 and set(ev["metrics"]) == {"mlm_loss", "mlm_acc", "mlm_perplexity", "nsp_loss",
                                                                    "nsp_acc"}
    for key in ("loss", "mlm_acc", "nsp_acc", "lr", "grad_norm", "loss_scale", "skipped_steps", "seq_per_s",
                "tokens_per_s", "data_wait"):
        assert rows[-1][key] is not None, key
    assert rows[-1]["samples"] == 8 * 32 and rows[-1]["loss"] < rows[0]["loss"]
    assert (out / "metrics.png").stat().st_size > 10_000
    assert (out / "config.yaml").is_file() and (out / "step-8" / "COMPLETE").is_file()

    # the export is an HF folder that transformers loads with its tokenizer, and gives our logits
    transformers = pytest.importorskip("transformers")
    final = out / "final"
    tok = transformers.AutoTokenizer.from_pretrained(str(final))
    hf = transformers.BertForPreTraining.from_pretrained(str(final)).eval()
    from bertrain.model.bert import BertForPreTraining
    ours = BertForPreTraining.from_pretrained(final).eval()
    enc = tok("The with statement is used to wrap the execution of a block.", return_tensors="pt")
    with torch.no_grad():
        a = hf(**enc).prediction_logits
        b = ours(enc["input_ids"], enc["token_type_ids"], enc["attention_mask"]).prediction_logits
    torch.testing.assert_close(a, b[..., : a.shape[-1]], rtol=1e-4, atol=1e-4)

    # phase 2: weights from phase 1's export, longer sequences, fresh optimizer and schedule
    out2 = tmp_path / "phase2"
    results = launch_cli(1, ["pretrain", "--config", "configs/quickstart.yaml", "--output_dir", str(out2),
                             "--model.init", str(final), "--data.vocab_file", str(out / "vocab" / "vocab.txt"),
                             "--sample.max_seq_length", "128", "--sample.max_predictions_per_seq", "20",
                             "--train.steps", "2", *common], cwd=Path(__file__).resolve().parents[1])
    assert results[0].returncode == 0, results[0].stdout[-4000:]
    assert "initialised weights from" in results[0].stdout
    state = torch.load(out2 / "step-2" / "train_state.pt", weights_only=False)
    assert state["state"]["step"] == 2 and state["scheduler"]["last_epoch"] == 2
