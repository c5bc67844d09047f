"""`bertrain bench` runs and reports what it promises (no timing assertions: speed lives in BENCHMARKS.md)."""
from __future__ import annotations

import json

import torch

from bertrain.bench.batches import max_predictions, model_flops, pretraining_batch, sample_lengths
from bertrain.cli import main
from bertrain.model.bert import BertConfig


def test_bench_tiny_compare_hf_json(capsys):
    rc = main(["bench", "--model", "tiny", "--seq-len", "32", "--batch-size", "4", "--device", "cpu", "--compare",
               "hf", "--json", "--steps", "1", "--warmup", "1"])
    assert rc == 0
    r = json.loads(capsys.readouterr().out)
    for key in ("bertrain.seq_per_s", "hf.seq_per_s", "speedup", "matmul_peak_tflops"):
        assert r[key] > 0, key
    p = r["pretrain"]
    for side in ("bertrain", "hf"):
        for key in ("seq_per_s", "tokens_per_s", "tflops", "mfu"):
            assert p[side][key] > 0, (side, key)
        assert abs(p[side]["mfu"] - p[side]["tflops"] / r["matmul_peak_tflops"]) < 1e-12  # the peak it reports
        assert p[side]["peak_mem_mb"] is not None
    assert "FLOPs" in r["flop_formula"] and p["real_tokens"] < p["padded_tokens"]
    assert p["bertrain_options"]["unpad"] is True


def test_bench_all_modes_human_output(capsys):
    rc = main(["bench", "--model", "tiny", "--seq-len", "16", "--batch-size", "2", "--mode", "all", "--steps", "1",
               "--warmup", "0", "--no-unpad", "--full-mlm-head", "--separate-qkv", "--no-foreach",
               "--optimizer", "lamb"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "pretrain" in out and "finetune" in out and "inference" in out and "TFLOP/s" in out


def test_bench_batches_are_realistic_and_consistent():
    cfg = BertConfig.from_preset("tiny")
    lengths = sample_lengths(1000, 128, seed=0)
    assert int(lengths.min()) >= 39 and int(lengths.max()) == 128  # U[ceil(0.3*128), 128]
    assert torch.equal(lengths, sample_lengths(1000, 128, seed=0))
    b = pretraining_batch(cfg, 8, 128, seed=1)
    assert b["masked_positions"].shape == (8, max_predictions(128)) == (8, 20)
    n = b["attention_mask"].sum(1)
    for i in range(8):
        k = int((b["masked_labels"][i] != -100).sum())
        pos = b["masked_positions"][i, :k]
        assert k == round(0.15 * int(n[i])) and int(pos.max()) < int(n[i]) and int(pos.min()) > 0
        # HF's (B, T) labels hold the same targets at the same places
        assert torch.equal(b["labels"][i, pos], b["masked_labels"][i, :k])
        assert int((b["labels"][i] != -100).sum()) == k


def test_flop_formula():
    cfg = BertConfig.from_preset("base")
    n = torch.tensor([128])
    H, I, L, V = 768, 3072, 12, 30522
    fwd = L * 2 * (4 * H * H + 2 * H * I) * 128 + L * 4 * H * 128 ** 2 + 2 * (H * H + H * V) * 20 + 2 * (H * H + 2 * H)
    assert model_flops(cfg, n, "pretrain", masked_tokens=20) == 3 * fwd
    assert model_flops(cfg, n, "inference") == fwd - 2 * (H * H + H * V) * 20 - 2 * (H * H + 2 * H) + 4 * H * 128


def test_bad_options_are_refused_in_one_line_before_any_timing(capsys):
    """Before: --device foo / mps and --threads -1 ended in a torch traceback (exit 1); --threads 0, --warmup -2 and
    --min-len-frac 5 ran silently with torch's threads, no warmup, and every sequence at full length."""
    cases = {("--device", "foo"): "--device 'foo': expected cpu, cuda or cuda:N",
             ("--device", "mps"): "--device 'mps': the bench runs on cpu or cuda[:N] only",
             ("--threads", "-1"): "--threads must be >= 1, got -1",
             ("--threads", "0"): "--threads must be >= 1, got 0",
             ("--warmup", "-2"): "--warmup must be >= 0, got -2",
             ("--min-len-frac", "5"): "--min-len-frac must be in [0, 1]",
             ("--min-len-frac", "-0.1"): "--min-len-frac must be in [0, 1]"}
    for args, message in cases.items():
        rc = main(["bench", "--model", "tiny", "--steps", "1", *args])
        err = capsys.readouterr().err
        assert rc == 2, args
        assert message in err and "Traceback" not in err and err.count("\n") == 1, (args, err)
