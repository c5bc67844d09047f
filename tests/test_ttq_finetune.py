"""benchmarks/ttq_finetune.py (time to quality, fine-tuning): the scorer gives bertrain's own dev-evaluation numbers
for bertrain's checkpoints and for the same weights in transformers' form, the verdict logic on hand-made numbers,
the report, the CLI's refusals, and (slow) the whole CLI on a tiny model."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO
from helpers import TINY, WORDS

sys.path.insert(0, str(REPO / "benchmarks"))
import ttq_finetune as ttq

from bertrain.cli import main as bertrain_main

HAS_TIME_TO_QUALITY = (REPO / "benchmarks" / "time_to_quality.py").is_file()
needs_time_to_quality = pytest.mark.skipif(not HAS_TIME_TO_QUALITY, reason="benchmarks/time_to_quality.py "
                                           "(time_to_reach, plot_curves: the pretraining part's file) is not there")


def write_mrpc_like(root: Path, n_train: int = 64, n_dev: int = 48) -> Path:
    """A GLUE root with MRPC/ in MRPC's TSV layout (label first, the sentences in columns 4 and 5); label 1 when
    the two sentences share their first word, so a model can learn it; the positive class is the majority (as in
    MRPC) so F1 is not trivially 0."""
    rng = np.random.default_rng(0)
    d = root / "MRPC"
    d.mkdir(parents=True)

    def rows(n: int) -> list[str]:
        out = []
        for i in range(n):
            a, b = (" ".join(rng.choice(WORDS, size=6)) for _ in range(2))
            label = int(i % 3 != 0)
            if label:
                b = a.split()[0] + " " + b
            elif a.split()[0] == b.split()[0]:
                b = "over " + b if a.split()[0] != "over" else "mat " + b
            out.append(f"{label}\t{2 * i}\t{2 * i + 1}\t{a}\t{b}")
        return out

    header = "Quality\t#1 ID\t#2 ID\t#1 String\t#2 String"
    for name, n in (("train.tsv", n_train), ("dev.tsv", n_dev)):
        (d / name).write_text("\n".join([header, *rows(n)]) + "\n", encoding="utf-8")
    return root


def save_sensitive_tiny_model(d: Path) -> Path:
    """A tiny random BERT (the test vocab) drawn with a large initializer_range, so that its pooled outputs, and so
    its predictions, differ between examples from the first step (the default 0.02 predicts one class for all,
    which any model would match)."""
    import torch

    from bertrain.model.bert import BertConfig, BertModel
    from bertrain.model.hf import tokenizer_files_from_vocab

    torch.manual_seed(0)
    vocab = REPO / "tests" / "assets" / "vocab-tiny.txt"
    n = len(vocab.read_text(encoding="utf-8").splitlines())
    model = BertModel(BertConfig.from_preset("tiny", vocab_size=n, initializer_range=0.5))
    model.tokenizer_files = tokenizer_files_from_vocab(vocab, do_lower_case=True)
    model.save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> dict:
    """bertrain fine-tunes a tiny random BERT on the MRPC-like data for 6 steps with its dev evaluation on (every 2
    steps) and a checkpoint at each evaluation: {"out", "evals": {step: metrics}, "data", "model"}."""
    root = tmp_path_factory.mktemp("ttq")
    model = save_sensitive_tiny_model(root / "model")
    data = write_mrpc_like(root / "glue")
    out = root / "run"
    assert bertrain_main(["finetune", "glue", "--task", "mrpc", "--data-dir", str(data), "--init", str(model),
                          "--output", str(out), "--data.max_seq_length", "32", "--train.steps", "6", *TINY,
                          "--optim.lr", "1e-3",
                          "--checkpoint.save_interval", "2", "--checkpoint.keep_last", "0",
                          "--checkpoint.export_final", "false", "--eval.interval", "2",
                          "--eval.each_epoch", "false", "--data.predict_test", "false",
                          "--metrics.report_to", "[]"]) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = {r["step"]: r["metrics"] for r in records if r.get("event") == "eval"}
    assert sorted(evals) == [2, 4, 6]
    return {"out": out, "evals": evals, "data": data, "model": model}


@pytest.fixture(scope="module")
def scorer(tiny_run) -> ttq.DevScorer:
    from bertrain.config import load_config
    from bertrain.tasks.finetune import GlueFinetuneConfig

    return ttq.DevScorer(load_config(GlueFinetuneConfig, tiny_run["out"] / "config.yaml"))


# ----------------------------------------------------------------------------------------------- the scorer

def test_scorer_gives_bertrains_own_dev_evaluation(tiny_run, scorer):
    """(a) each bertrain checkpoint scores exactly what the trainer's dev evaluation recorded at that step."""
    assert scorer.primary == "f1" and scorer.examples == 48
    # the numbers say something: not the majority class's, and not the same at every step (three evaluations: with
    # 48 dev examples two of them can tie, as they did after a change of float rounding)
    assert len({m["f1"] for m in tiny_run["evals"].values()}) > 1
    assert all(m["f1"] != pytest.approx(scorer.chance["f1"]) for m in tiny_run["evals"].values())
    for step, recorded in tiny_run["evals"].items():
        scored = scorer.score(tiny_run["out"] / f"step-{step}")
        assert set(scored) == set(recorded)
        for key, value in recorded.items():
            assert scored[key] == pytest.approx(value, abs=1e-6), (step, key)
    # chance: always the majority class (1, two thirds of the dev set), through the same metric function
    assert scorer.chance["accuracy"] == pytest.approx(32 / 48)
    assert scorer.chance["f1"] == pytest.approx(2 * (32 / 48) / (1 + 32 / 48))


def test_scorer_reads_the_same_weights_in_transformers_form(tiny_run, scorer, tmp_path):
    """(b) the step-6 weights saved by transformers' BertForSequenceClassification.save_pretrained (as HF Trainer's
    checkpoints hold them) score the same number through the same loader and forward."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.BertForSequenceClassification.from_pretrained(tiny_run["out"] / "step-6")
    hf.save_pretrained(tmp_path / "hf")
    from safetensors import safe_open
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as f:  # transformers' own key names
        assert "bert.encoder.layer.0.attention.self.query.weight" in set(f.keys())
    assert not (tmp_path / "hf" / "vocab.txt").exists()  # no tokenizer needed: the scorer has the features
    scored = scorer.score(tmp_path / "hf")
    for key, value in tiny_run["evals"][6].items():
        assert scored[key] == pytest.approx(value, abs=1e-6), key


# ----------------------------------------------------------------------------------------------- the verdict

def times(seed, b, h, b_end=100.0, h_end=100.0) -> ttq.SeedTimes:
    return ttq.SeedTimes(seed, b, h, b_end, h_end)


@pytest.mark.parametrize("pairs, word, why", [
    ([times(1, 30, 60), times(2, 35, 50)], "met", "0.70"),                       # 0.5, 0.7: the goal is <= 0.7
    ([times(1, 40, 50), times(2, 45, 50)], "missed", "0.80"),                    # 0.8, 0.9
    ([times(1, 30, 60), times(2, 45, 50)], "inconclusive", "0.50..0.90"),        # the spread crosses 0.7
    ([times(1, 10, 60)], "inconclusive", "1 seed"),                             # one pair, however clear
    ([times(1, 30, 60), times(2, None, 50)], "inconclusive", "never reached the target in seed(s) 2"),
    ([times(1, 30, 60), times(2, 40, None, h_end=80)], "met", "0.50"),          # HF s2 never: ratio < 40/80
    ([times(1, 30, 60), times(2, 70, None, h_end=80)], "inconclusive", "across 0.7"),  # < 0.875: not enough
])
def test_verdict_on_hand_made_numbers(pairs, word, why):
    got, reason = ttq.verdict(pairs)
    assert got == word and why in reason, reason


def test_ratio_bounds():
    assert ttq.ratio_bounds(times(1, 30, 60)) == (0.5, 0.5)
    assert ttq.ratio_bounds(times(1, 30, None, h_end=120)) == (0.0, 0.25)
    assert ttq.ratio_bounds(times(1, None, 60)) is None


def test_run_order_is_a_b_b_a():
    assert ttq.run_order([1, 2, 3], ["bertrain", "hf"]) == [
        (1, "bertrain"), (1, "hf"), (2, "hf"), (2, "bertrain"), (3, "bertrain"), (3, "hf")]
    assert ttq.run_order([1, 2], ["hf"]) == [(1, "hf"), (2, "hf")]


def hand_made_results() -> dict:
    """results.json of two seeds on MRPC with hand-made curves [(wall_s, step, f1)]."""
    def run(curve):
        return {"curve": curve, "best": max(m for _, _, m in curve), "steps": curve[-1][1]}

    return {
        "settings": {"init": "MiniLM", "lr": 5e-5, "batch": 32, "epochs": 3.0, "budget": "", "max_seq_length": 128,
                     "device": "cpu", "threads": 2, "hf_pad_to_max": False},
        "machine": {"cpu": "test CPU", "gpus": "none (CPU)"},
        "tasks": {"mrpc": {
            "primary_metric": "f1", "chance": {"f1": 0.81, "accuracy": 0.68}, "dev_examples": 408,
            "train_examples": 3668, "total_steps": 345, "warmup_steps": 34, "save_every": 100,
            "runs": {
                "bertrain": {"1": run([[10, 100, 0.85], [20, 200, 0.89], [30, 300, 0.9]]),
                             "2": run([[11, 100, 0.87], [21, 200, 0.885], [31, 300, 0.87]])},
                "hf": {"1": run([[20, 100, 0.84], [40, 200, 0.885], [60, 300, 0.9]]),
                       "2": run([[19, 100, 0.85], [38, 200, 0.86], [57, 300, 0.85]])}}}}}


@needs_time_to_quality
def test_analysis_target_times_and_ratios():
    a = ttq.analyse_task(hand_made_results()["tasks"]["mrpc"])
    assert a["target"] == pytest.approx(0.88)  # the mean of HF's two bests
    assert a["best"]["hf"]["min"] == 0.86 and a["best"]["bertrain"]["mean"] == pytest.approx(0.8925)
    assert a["times"] == {"bertrain": {"1": 20, "2": 21}, "hf": {"1": 40, "2": None}}
    (p1, p2) = a["pairs"]
    assert p1["ratio"] == [0.5, 0.5] or p1["ratio"] == (0.5, 0.5)
    assert p2["ratio"][1] == pytest.approx(21 / 57)  # HF seed 2 stays below its mean: a bound only
    assert a["ratio"]["n"] == 1 and a["verdict"] == "met"


@needs_time_to_quality
def test_analysis_at_chance_level_is_inconclusive():
    record = hand_made_results()["tasks"]["mrpc"]
    record["chance"]["f1"] = 0.9  # HF's mean best, 0.88, is below it
    a = ttq.analyse_task(record)
    assert a["verdict"] == "inconclusive" and "chance level" in a["why"]


@needs_time_to_quality
def test_report_writes_summary_and_plot(tmp_path):
    pytest.importorskip("matplotlib")
    results = hand_made_results()
    ttq.write_report(tmp_path, results)
    summary = (tmp_path / "summary.md").read_text()
    assert "**Verdict vs the 0.7x goal: met**" in summary and "0.8800" in summary and "0.8100" in summary
    assert "< 0.368 (HF never reached it)" in summary
    assert (tmp_path / "ttq_mrpc.png").stat().st_size > 1000
    assert json.loads((tmp_path / "results.json").read_text())["tasks"]["mrpc"]["analysis"]["verdict"] == "met"
    assert ttq.main(["--out", str(tmp_path), "--report-only"]) == 0  # again from results.json alone


# ----------------------------------------------------------------------------------------------- the CLI

def test_cli_refuses_bad_input(tmp_path, capsys):
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "results.json").write_text("{}")
    assert ttq.main(["--out", str(tmp_path / "busy"), "--sides", "bertrain"]) == 2
    assert "exists and is not empty" in capsys.readouterr().err
    assert ttq.main(["--out", str(tmp_path / "a"), "--tasks", "stsb"]) == 2
    assert "regression" in capsys.readouterr().err
    assert ttq.main(["--out", str(tmp_path / "a"), "--budget", "soon"]) == 2
    assert "--budget" in capsys.readouterr().err
    assert ttq.main(["--out", str(tmp_path / "a"), "--sides", "bertrain,tf"]) == 2
    assert "--sides" in capsys.readouterr().err
    assert ttq.main(["--out", str(tmp_path / "a"), "--report-only"]) == 2
    assert "no results.json" in capsys.readouterr().err
    assert not (tmp_path / "a").exists()


def test_plan_matches_both_sides_step_counts():
    s = ttq.Settings(out=Path("x"), tasks=["mrpc"], seeds=[1], sides=["bertrain"], device="cpu", precision="fp32",
                     threads=1, epochs=3.0, budget="", budget_s=None, save_every=None, lr=5e-5, batch=32,
                     max_seq_length=128, hf_pad_to_max=False, data_dir=Path("."), init=Path("."),
                     keep_checkpoints=False)
    plan = ttq.plan_task(s, "mrpc", 3668)
    assert (plan.total_steps, plan.warmup_steps, plan.save_every) == (345, 34, 29)  # 115 steps an epoch


def test_precision_reaches_both_sides_and_auto_follows_the_device(tmp_path):
    init = tmp_path / "init"
    init.mkdir()
    (init / "config.json").write_text("{}")
    (init / "vocab.txt").write_text("[PAD]\n")
    argv = ["--out", str(tmp_path / "o"), "--tasks", "mrpc", "--init", str(init)]
    assert ttq.settings_from_args(ttq.parse_args(argv)).precision == "fp32"  # auto on a CPU
    s = ttq.settings_from_args(ttq.parse_args(argv + ["--precision", "bf16"]))
    assert s.precision == "bf16" and s.to_json()["precision"] == "bf16"
    plan = ttq.plan_task(s, "mrpc", 3668)
    assert ttq.bertrain_config(s, plan, 1, init, tmp_path / "r")["precision"] == {"mode": "bf16"}
    # results.json written before --precision existed: what the device implied
    assert (ttq.precision_of({"device": "cpu"}), ttq.precision_of({"device": "cuda"})) == ("fp32", "bf16")
    assert ttq.precision_of({"device": "cpu", "precision": "bf16"}) == "bf16"


@pytest.mark.slow
@needs_time_to_quality
def test_cli_end_to_end_on_a_tiny_model(tmp_path, tiny_run):
    """Both sides as subprocesses on the tiny model (2 seeds, A B B A), scored, reported; checkpoints deleted. HF
    pads to max_seq_length here (the default, padding per batch, ran in the smoke runs of the module docstring)."""
    for module in ("transformers", "accelerate"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"the HF side needs {module} (pip install transformers accelerate)")
    out = tmp_path / "ttq"
    rc = ttq.main(["--out", str(out), "--tasks", "mrpc", "--seeds", "1", "2", "--epochs", "0.5", "--batch", "8",
                   "--save-every", "2", "--threads", "1", "--max-seq-length", "32", "--data-dir",
                   str(tiny_run["data"]), "--init", str(tiny_run["model"]), "--hf-pad-to-max"])
    assert rc == 0
    results = json.loads((out / "results.json").read_text())
    assert [(o["seed"], o["side"]) for o in results["order"]] == [(1, "bertrain"), (1, "hf"), (2, "hf"),
                                                                   (2, "bertrain")]
    assert results["settings"]["hf_pad_to_max"] is True
    record = results["tasks"]["mrpc"]
    assert record["tokenizer_mismatches"] == 0 and record["total_steps"] == 4
    for side in ("bertrain", "hf"):
        for seed in ("1", "2"):
            run = record["runs"][side][seed]
            assert [step for _, step, _ in run["curve"]] == [2, 4], (side, seed)
            walls = [w for w, _, _ in run["curve"]]
            assert 0 < walls[0] < walls[1] <= run["wall_s"]
            assert not any(Path(p["path"]).exists() for p in run["points"])  # deleted after scoring
    assert record["analysis"]["target"] == pytest.approx(np.mean([r["best"] for r in record["runs"]["hf"].values()]))
    assert "Verdict vs the 0.7x goal" in (out / "summary.md").read_text() and (out / "ttq_mrpc.png").is_file()
