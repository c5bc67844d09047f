"""benchmarks/time_to_quality.py: its one evaluator gives exactly bertrain's training-time held-out number, for a
bertrain checkpoint and for the same weights as an HF checkpoint; the time-to-target and verdict rules; the HF side's
run_mlm chunking; the CLI refuses to overwrite a run; and (slow) the whole CLI on a tiny model."""
from __future__ import annotations

import json
import math
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO, SHARED_DATA
from helpers import TINY_VOCAB, prepare_config

from bertrain.config import from_dict
from bertrain.data.prepare import prepare
from bertrain.data.store import TokenStore

sys.path.insert(0, str(REPO / "benchmarks"))
import time_to_quality as ttq

TINY = ttq.Settings(budget="60s", seeds=[1], layers=2, hidden=64, heads=2, intermediate=128, vocab_size=1500,
                    batch=8, seq=64, lr=5e-3, warmup=2, steps=8, save_every=4, eval_samples=50)


# ----------------------------------------------------------------------------------------------- the evaluator

@pytest.fixture(scope="module")
def data(tmp_path_factory) -> ttq.DataPaths:
    """DIR/data as `pretrain` lays it out, from python-docs and the tiny test vocabulary (10% held out)."""
    paths = ttq.DataPaths(tmp_path_factory.mktemp("ttq") / "data")
    paths.vocab.parent.mkdir(parents=True)
    shutil.copy(TINY_VOCAB, paths.vocab)
    prepare(prepare_config(paths.prepared, vocab_file=str(paths.vocab), masking="dynamic", heldout_fraction=0.1,
                           heldout_min_documents=4, sample=ttq.sample_config(TINY.seq)))
    ttq.write_model_config(TINY, 1500, paths.model_config)
    return paths


@pytest.fixture(scope="module")
def bertrain_run(data: ttq.DataPaths) -> tuple[Path, dict[int, dict[str, float]]]:
    """An 8-step bertrain run of the comparison's config with its held-out evaluation ON (steps 4 and 8), laid out
    as `pretrain` leaves a run; returns (run folder, {step: the held-out metrics bertrain recorded})."""
    from bertrain.tasks.pretraining import PretrainConfig, run_pretraining

    run_dir = data.root.parent / "runs" / "bertrain-s1"
    run_dir.mkdir(parents=True)
    assert ttq.bertrain_config(TINY, 1, data, run_dir / "train")["eval"]["enabled"] is False  # the timed runs
    config = ttq.bertrain_config(TINY, 1, data, run_dir / "train", evaluate=True)
    config["eval"]["interval"] = 4
    (run_dir / "launch.json").write_text(json.dumps({"t0": time.time()}))
    run_pretraining(from_dict(PretrainConfig, config))
    records = [json.loads(x) for x in (run_dir / "train" / "metrics.jsonl").read_text().splitlines()]
    recorded = {r["step"]: r["metrics"] for r in records if r.get("event") == "eval"}
    assert sorted(recorded) == [4, 8] and recorded[8]["mlm_acc"] > 0.02  # past chance: a number worth matching
    return run_dir, recorded


def test_scorer_gives_the_number_bertrain_recorded_for_its_checkpoints(data, bertrain_run) -> None:
    run_dir, recorded = bertrain_run
    with ttq.Scorer(TINY, data, run_dir / "scoring") as scorer:
        curve = ttq.score_run("bertrain", run_dir, scorer)
        chance = scorer.chance_level()
    assert [p["step"] for p in curve] == [4, 8]
    for p in curve:
        assert p["mlm_acc"] == pytest.approx(recorded[p["step"]]["mlm_acc"], abs=1e-6)
        assert p["mlm_loss"] == pytest.approx(recorded[p["step"]]["mlm_loss"], abs=1e-6)  # the same forward pass
        assert 0 < p["wall_s"] < 600  # the COMPLETE marker's time since the recorded launch
    assert chance["eval_samples"] == 50 and 0 < chance["accuracy"] < 0.2 and chance["eval_targets"] > 50


def test_same_weights_as_an_hf_trainer_checkpoint_score_the_same(data, bertrain_run) -> None:
    """Step 8's weights in a transformers BertForMaskedLM saved with save_pretrained (what HF Trainer writes: no
    pooler, no NSP head, tied decoder) score the same through the HF branch (saves.jsonl + checkpoint-N)."""
    transformers = pytest.importorskip("transformers")
    from bertrain.model.bert import BertForPreTraining
    from bertrain.model.hf import config_to_hf_dict, to_hf_state_dict

    run_dir, recorded = bertrain_run
    ours = BertForPreTraining.from_pretrained(run_dir / "train" / "step-8")
    hf = transformers.BertForMaskedLM(transformers.BertConfig(**config_to_hf_dict(ours.config, ["BertForMaskedLM"])))
    state = {k: v.clone() for k, v in to_hf_state_dict(ours).items()
             if not k.startswith(("bert.pooler.", "cls.seq_relationship."))}
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected and all(k.endswith(("position_ids", "decoder.weight", "decoder.bias")) for k in missing)
    hf.tie_weights()
    hf_run = run_dir.parent / "hf-s1"
    hf.save_pretrained(hf_run / "train" / "checkpoint-8")
    (hf_run / "saves.jsonl").write_text(json.dumps({"step": 8, "wall_s": 12.5}) + "\n")
    with ttq.Scorer(TINY, data, hf_run / "scoring") as scorer:
        curve = ttq.score_run("hf", hf_run, scorer)
    assert [(p["wall_s"], p["step"]) for p in curve] == [(12.5, 8)]
    assert curve[0]["mlm_acc"] == pytest.approx(recorded[8]["mlm_acc"], abs=1e-6)
    assert curve[0]["mlm_loss"] == pytest.approx(recorded[8]["mlm_loss"], abs=1e-6)


# ----------------------------------------------------------------------------------------------- rules

def test_time_to_reach_is_the_first_checkpoint_at_or_above_the_target() -> None:
    curve = [(10.0, 0.1), (20.0, 0.3), (30.0, 0.25), (40.0, 0.5)]
    assert ttq.time_to_reach(curve, 0.3) == 20.0  # reached exactly, no interpolation
    assert ttq.time_to_reach(curve, 0.29) == 20.0
    assert ttq.time_to_reach(curve, 0.4) == 40.0
    assert ttq.time_to_reach(curve, 0.51) is None  # never
    assert ttq.time_to_reach([], 0.1) is None
    with pytest.raises(ValueError, match="sorted"):
        ttq.time_to_reach([(2.0, 0.1), (1.0, 0.2)], 0.1)


def test_ratio_bounds_and_verdict() -> None:
    assert ttq.ratio_bounds(100, 400, 600, 600) == (0.25, 0.25)
    assert ttq.ratio_bounds(100, None, 600, 500) == (0.0, 0.2)  # HF never got there: ratio < 100/500
    assert ttq.ratio_bounds(None, 300, 600, 600) == (2.0, math.inf)  # bertrain never did: ratio > 600/300
    assert ttq.ratio_bounds(None, None, 600, 600) == (0.0, math.inf)
    assert ttq.verdict([(0.3, 0.3), (0.45, 0.45)])[0] == "goal met"
    assert ttq.verdict([(0.3, 0.3), (0.0, 0.2)])[0] == "goal met"
    assert ttq.verdict([(0.6, 0.6), (0.9, 0.9)])[0] == "goal missed"
    assert ttq.verdict([(0.6, 0.6), (2.0, math.inf)])[0] == "goal missed"
    assert ttq.verdict([(0.4, 0.4), (0.6, 0.6)])[0] == "inconclusive"  # the seeds straddle 0.5
    assert ttq.verdict([(0.3, 0.3), (0.0, math.inf)])[0] == "inconclusive"
    word, why = ttq.verdict([(0.1, 0.1)])
    assert word == "inconclusive" and "1 seed" in why  # one seed says nothing about the spread
    assert ttq.verdict([(0.5, 0.5), (0.5, 0.5)])[0] == "goal met"  # <= 0.5 is the goal


def _run(side: str, seed: int, curve: list[tuple[float, float]]) -> dict:
    return {"side": side, "seed": seed, "curve": [[t, 10 * i, acc] for i, (t, acc) in enumerate(curve)],
            "final_acc": curve[-1][1], "last_checkpoint_s": curve[-1][0]}


def test_summary_target_is_hf_mean_final_and_times_are_per_seed() -> None:
    runs = {"bertrain-s1": _run("bertrain", 1, [(50, 0.20), (100, 0.31), (150, 0.40)]),
            "hf-s1": _run("hf", 1, [(200, 0.20), (400, 0.28), (600, 0.30)]),
            "hf-s2": _run("hf", 2, [(200, 0.20), (400, 0.30), (600, 0.34)]),
            "bertrain-s2": _run("bertrain", 2, [(50, 0.25), (100, 0.33), (150, 0.41)])}
    s = ttq.summarize({"runs": runs})
    assert s["target"] == pytest.approx(0.32) and s["final_acc"]["hf"]["n"] == 2
    assert s["per_seed"][1] == {"bertrain_s": 150, "hf_s": None, "ratio": None, "ratio_range": [0.0, 0.25]}
    assert s["per_seed"][2]["bertrain_s"] == 100 and s["per_seed"][2]["hf_s"] == 600
    assert s["ratio"]["n"] == 1 and s["verdict"] == "goal met"
    assert ttq.summarize({"runs": {"hf-s1": runs["hf-s1"]}})["verdict"] == "inconclusive"  # one side only
    one = ttq.summarize({"runs": {k: runs[k] for k in ("bertrain-s1", "hf-s1")}})
    assert one["verdict"] == "inconclusive" and one["target"] == 0.30


def test_order_alternates_sides_per_seed() -> None:
    assert ttq.run_order([1, 2, 3], ["bertrain", "hf"]) == [
        ("bertrain", 1), ("hf", 1), ("hf", 2), ("bertrain", 2), ("bertrain", 3), ("hf", 3)]


# ----------------------------------------------------------------------------------------------- HF data

def test_group_texts_gives_full_chunks_of_per_document_cls_sep_sequences() -> None:
    docs = [np.array([11, 12, 13]), np.array([21, 22, 23, 24, 25]), np.array([31])]
    pairs = list(ttq.document_sequences(docs, cls_id=2, sep_id=3))
    assert pairs[2][0].tolist() == [2, 31, 3] and pairs[2][1].tolist() == [1, 0, 1]
    ids = ttq.group_texts((p[0] for p in pairs), 4)
    # 5 + 7 + 3 = 15 tokens -> 3 chunks of 4, the last 3 tokens ([SEP] 2 31 3 minus one) dropped
    assert ids.tolist() == [[2, 11, 12, 13], [3, 2, 21, 22], [23, 24, 25, 3]]
    special = ttq.group_texts((p[1] for p in pairs), 4)
    assert special.tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 0, 1]]
    assert ttq.group_texts([], 4).shape == (0, 4)


def test_hf_examples_are_bertrain_training_documents(data) -> None:
    """From the prepared TRAINING store (held-out documents never in it): every document in order as
    [CLS] ids [SEP], cut into full chunks, the remainder dropped."""
    store = TokenStore(data.prepared)
    ids, special = ttq.run_mlm_chunks(store, cls_id=2, sep_id=3, seq=TINY.seq)
    total = store.num_tokens + 2 * store.num_documents
    assert ids.shape == (total // TINY.seq, TINY.seq) and special.shape == ids.shape
    docs = [np.concatenate(store.document(d)) for d in range(store.num_documents)]
    stream = np.concatenate([np.concatenate(([2], doc, [3])) for doc in docs])
    marks = np.concatenate([np.r_[1, np.zeros(len(doc), dtype=int), 1] for doc in docs])
    assert np.array_equal(ids.ravel(), stream[: ids.size]) and np.array_equal(special.ravel(), marks[: ids.size])


# ----------------------------------------------------------------------------------------------- the CLI

def test_pretrain_refuses_a_non_empty_out_and_bad_settings(tmp_path: Path) -> None:
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "results.json").write_text("{}")
    with pytest.raises(SystemExit, match="exists and is not empty"):
        ttq.main(["pretrain", "--out", str(tmp_path / "old")])
    with pytest.raises(SystemExit, match="--schedule linear decays over --steps"):
        ttq.main(["pretrain", "--out", str(tmp_path / "new"), "--schedule", "linear"])
    with pytest.raises(SystemExit, match="--budget"):
        ttq.main(["pretrain", "--out", str(tmp_path / "new"), "--budget", "soon"])
    with pytest.raises(SystemExit, match="does not exist"):
        ttq.main(["report", str(tmp_path / "new")])
    assert not (tmp_path / "new").exists()


def test_precision_is_the_same_on_both_sides_and_auto_follows_the_device(tmp_path: Path) -> None:
    assert ttq.Settings().precision == "fp32" and ttq.Settings(device="cuda").precision == "bf16"
    s = ttq.Settings(precision="bf16")  # bf16 autocast on a CPU, on both sides
    data = ttq.DataPaths(tmp_path)
    assert ttq.bertrain_config(s, 1, data, tmp_path / "b")["precision"] == {"mode": "bf16"}
    hf = ttq.hf_arguments(s, 1, tmp_path / "h")
    assert (hf["bf16"], hf["use_cpu"]) == (True, True)
    assert ttq.hf_arguments(ttq.Settings(), 1, tmp_path / "h")["bf16"] is False
    assert ttq.Settings.from_json(s.to_json()).precision == "bf16"
    assert ttq.Settings.from_json({"device": "cpu", "precision": "fp32"}).precision == "fp32"  # an older results.json
    with pytest.raises(ValueError, match="--precision 'fp16': choose auto, fp32 or bf16"):
        ttq.Settings(precision="fp16")
    with pytest.raises(SystemExit):  # argparse: not one of the choices
        ttq.main(["pretrain", "--out", str(tmp_path / "new"), "--precision", "fp16"])


def test_finetune_forwards_its_arguments_to_ttq_finetune(monkeypatch) -> None:
    seen = []
    fake = type(sys)("ttq_finetune")
    fake.main = lambda argv: seen.append(argv) or 0
    monkeypatch.setitem(sys.modules, "ttq_finetune", fake)
    assert ttq.main(["finetune", "--out", "x", "--tasks", "mrpc"]) == 0
    assert seen == [["--out", "x", "--tasks", "mrpc"]]


@pytest.mark.slow
def test_cli_end_to_end_on_a_tiny_model(tmp_path: Path) -> None:
    """Both sides trained for a few seconds each (2 seeds, interleaved), scored, plotted and summarised; `score`
    and `report` redo it from the folder."""
    pytest.importorskip("transformers")
    if not (SHARED_DATA / ttq.WIKI).is_file():
        pytest.skip(f"real data {SHARED_DATA / ttq.WIKI} not present (CI has ../shared/data beside the repo)")
    out = tmp_path / "ttq"
    # The budget only bounds the runs: each side takes at least one step and saves its last one however short it
    # is (bertrain's budget counts from its first step; HF's callback stops at the first step end past it, counted
    # from launch, so HF's ~5 s start-up leaves it one step). In 2 s bertrain takes tens of steps even at a
    # fraction of its speed: several checkpoints. Every checkpoint is scored twice below, so fewer is faster.
    argv = ["pretrain", "--out", str(out), "--budget", "2s", "--seeds", "1", "2", "--layers", "1", "--hidden", "32",
            "--heads", "2", "--intermediate", "64", "--vocab-size", "1000", "--seq", "64", "--batch", "8",
            "--save-every", "5", "--warmup", "2", "--eval-samples", "64"]
    assert ttq.main(argv) == 0
    results = json.loads((out / ttq.RESULTS).read_text())
    assert results["order"] == ["bertrain-s1", "hf-s1", "hf-s2", "bertrain-s2"]
    for name, run in results["runs"].items():
        assert run["exit_code"] == 0 and run["steps"] >= 1 and run["curve"], name
        walls = [p[0] for p in run["curve"]]
        assert walls == sorted(walls) and 0 < walls[0] and run["curve"][-1][1] == run["steps"]
        assert run["threads"] == 2 and run["loader_workers"] == 0
    assert (out / ttq.PLOT).stat().st_size > 0
    summary = (out / ttq.SUMMARY).read_text()
    assert "| final held-out MLM accuracy" in summary and "Verdict:" in summary
    before = {k: r["curve"] for k, r in results["runs"].items()}
    assert ttq.main(["score", str(out)]) == 0  # the same weights, the same evaluator: the same numbers
    assert {k: r["curve"] for k, r in json.loads((out / ttq.RESULTS).read_text())["runs"].items()} == before
    (out / ttq.PLOT).unlink()
    assert ttq.main(["report", str(out)]) == 0 and (out / ttq.PLOT).is_file()
    with pytest.raises(SystemExit, match="not empty"):
        ttq.main(argv)
