"""The report's verdict: does pretraining help, judged on the task's primary metric with an interval over seeds and
the chance level (bertrain.pipeline.verdict), recorded by the evaluate stage and rendered in report.md/.html."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml

from bertrain.pipeline.evaluate import summarize
from bertrain.pipeline.recipe import load_recipe
from bertrain.pipeline.report import _verdict, write_report
from bertrain.pipeline.verdict import HELPS, HURTS, INCONCLUSIVE, decide
from bertrain.tasks.metrics import PRIMARY_METRIC

REPO = Path(__file__).resolve().parents[1]
DEFAULT = REPO / "configs" / "recipes" / "pydoc-small.yaml"

# README: the default recipe's dev accuracy, seeds 1-3, and the majority class of its dev set
README_PRETRAINED, README_RANDOM, README_MAJORITY = [0.366, 0.379, 0.372], [0.215, 0.268, 0.254], 0.208


def welch_by_hand(a: list[float], b: list[float]) -> tuple[float, float, float, float]:
    """(difference, low, high, df) of the 95% Welch interval: Welch-Satterthwaite df, the t quantile from scipy."""
    from scipy.stats import t

    mean = lambda v: sum(v) / len(v)  # noqa: E731
    va, vb = (sum((x - mean(v)) ** 2 for x in v) / (len(v) - 1) / len(v) for v in (a, b))
    df = (va + vb) ** 2 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1))
    d, half = mean(a) - mean(b), t.ppf(0.975, df) * math.sqrt(va + vb)
    return d, d - half, d + half, df


def test_the_default_recipes_numbers_are_a_win_with_welchs_interval():
    v = decide(README_PRETRAINED, README_RANDOM, README_MAJORITY, "majority class")
    assert v.outcome == HELPS
    d, lo, hi, df = welch_by_hand(README_PRETRAINED, README_RANDOM)
    # df = 2.2238, t(0.975, 2.2238) = 3.9132 (t tables: 4.303 at df 2, 3.182 at df 3)
    assert df == pytest.approx(2.2238, abs=1e-4) and (hi - d) / 0.0162959 == pytest.approx(3.9132, abs=1e-3)
    assert v.difference == pytest.approx(d) == pytest.approx(0.126667, abs=1e-6)
    assert v.interval == pytest.approx((lo, hi), abs=1e-9)
    assert v.interval == pytest.approx((0.06290, 0.19044), abs=1e-5)
    assert v.seeds == {"pretrained": 3, "random": 3} and v.chance == 0.208
    assert v.means == pytest.approx({"pretrained": 0.372333, "random": 0.245667}, abs=1e-6)
    from scipy.stats import ttest_ind  # an independent implementation, where this scipy has it (1.11+)
    res = ttest_ind(README_PRETRAINED, README_RANDOM, equal_var=False)
    if hasattr(res, "confidence_interval"):
        assert v.interval == pytest.approx(tuple(res.confidence_interval(0.95)), abs=1e-9)


def test_a_loss_is_a_loss():
    p, r = [0.60, 0.62, 0.61], [0.70, 0.72, 0.71]
    v = decide(p, r, 0.5, "majority class")
    d, lo, hi, df = welch_by_hand(p, r)
    assert df == pytest.approx(4.0)  # equal spreads and seeds: Student's df, n1 + n2 - 2
    assert hi - d == pytest.approx(2.776445 * math.sqrt(2 * 0.0001 / 3))  # t(0.975, 4) from a table
    assert v.outcome == HURTS and v.difference == pytest.approx(d) == pytest.approx(-0.10)
    assert v.interval == pytest.approx((lo, hi), abs=1e-9) and hi < 0


def test_overlapping_seeds_are_inconclusive():
    p, r = [0.30, 0.35], [0.32, 0.36]
    v = decide(p, r, 0.20, "majority class")
    d, lo, hi, df = welch_by_hand(p, r)
    assert v.outcome == INCONCLUSIVE and "covers zero" in v.reason
    assert v.difference == pytest.approx(d) == pytest.approx(-0.015)
    assert v.interval == pytest.approx((lo, hi), abs=1e-9) and lo < 0 < hi
    assert df == pytest.approx(1.908, abs=1e-3)  # two seeds a side: t(0.975) about 4.5, a wide interval


def test_one_seed_per_side_is_inconclusive_however_large_the_gap():
    # STS-B Pearson of the overclaiming report: 0.029 pretrained vs 0.019 random, one seed each
    v = decide([0.029], [0.019], 0.0, "no correlation")
    assert v.outcome == INCONCLUSIVE and v.reason == "one seed per side: no spread"
    assert v.interval is None and v.difference == pytest.approx(0.010)
    assert v.seeds == {"pretrained": 1, "random": 1} and v.chance == 0.0
    v = decide([0.90], [0.10], 0.5, "majority class")
    assert v.outcome == INCONCLUSIVE and v.interval is None
    v = decide([0.90, 0.91, 0.92], [0.10], 0.5, "majority class")
    assert v.outcome == INCONCLUSIVE and v.reason == "1 random-init seed: no spread"
    v = decide([0.90, 0.91], [], 0.5, "majority class")
    assert v.outcome == INCONCLUSIVE and v.difference is None and "no random-init runs" in v.reason


def test_both_sides_at_chance_is_inconclusive_even_when_the_interval_excludes_zero():
    p, r = [0.029, 0.031, 0.030], [0.019, 0.020, 0.018]  # Pearson: tight seeds, both within 5 points of 0
    v = decide(p, r, 0.0, "no correlation")
    assert v.interval[0] > 0  # the gap alone would pass
    assert v.outcome == INCONCLUSIVE and v.reason.startswith("both at chance")
    v = decide([0.25, 0.251], [0.23, 0.231], README_MAJORITY, "majority class")  # accuracy within 5 points of 0.208
    assert v.outcome == INCONCLUSIVE and v.reason.startswith("both at chance")
    # one side at chance, the other well above it: a real verdict
    assert decide([0.40, 0.41], [0.24, 0.25], README_MAJORITY, "majority class").outcome == HELPS
    # SQuAD scores are percent: the margin is 5 points there too
    assert decide([4.0, 4.2], [1.0, 1.1], 0.0, "no answer", points_per_unit=1.0).outcome == INCONCLUSIVE
    assert decide([40.0, 42.0], [10.0, 11.0], 0.0, "no answer", points_per_unit=1.0).outcome == HELPS
    # an unknown chance level skips the rule, and says so in the report
    assert decide(p, r, None).outcome == HELPS


def test_primary_metrics():
    assert {t: PRIMARY_METRIC.get(t, "accuracy") for t in ("squad", "mrpc", "cola", "stsb", "sst2", "mnli")} == {
        "squad": "f1", "mrpc": "f1", "cola": "mcc", "stsb": "pearson", "sst2": "accuracy", "mnli": "accuracy"}


def write_run(run: Path, task: str, dirname: str, scores: dict[str, list[float]], **extra) -> None:
    for init, values in scores.items():
        for seed, value in enumerate(values, start=1):
            out = run / f"finetune-{dirname}-{init}-s{seed}" / "out"
            out.mkdir(parents=True)
            dev = {"examples": 100, **{k: (value if v is None else v) for k, v in extra.items()}}
            (out / "eval_results.json").write_text(json.dumps({"task": task, "dev": dev}))


def test_evaluate_records_the_verdict_and_the_report_renders_it(tmp_path):
    recipe = load_recipe(DEFAULT, [f"output_dir={tmp_path}"])
    write_run(tmp_path, "pydoctopics", "pydoc-topics", {"pretrained": README_PRETRAINED, "random": README_RANDOM},
              accuracy=None, majority_baseline_accuracy=README_MAJORITY)
    results = summarize(recipe, tmp_path)
    (v,) = results["tasks"][0]["verdicts"]
    assert (v["split"], v["metric"], v["outcome"], v["chance"], v["chance_source"]) == (
        "dev", "accuracy", HELPS, README_MAJORITY, "majority class")
    assert v["interval"] == pytest.approx([0.06290, 0.19044], abs=1e-5)
    results = json.loads(json.dumps(results))  # as results.json holds it
    line = ("pydoc-topics (accuracy): pretraining helps: +12.7 points (95% CI +6.3 to +19.0, Welch, 3 seeds per "
            "side); pretrained 37.2, random 24.6, chance 20.8 (majority class)")
    assert _verdict(results) == [line]

    (tmp_path / "evaluate").mkdir()
    (tmp_path / "evaluate" / "results.json").write_text(json.dumps(results))
    write_report(recipe, tmp_path, [], tmp_path / "report")
    md = (tmp_path / "report" / "report.md").read_text()
    page = (tmp_path / "report" / "report.html").read_text()
    assert f"## Verdict\n\n- {line}\n" in md
    assert f"<h2>Verdict</h2><ul><li>{line}</li></ul>" in page


def glue_recipe(tmp_path: Path, task: str, seeds: list[int]):
    finetune = [{"name": task, "kind": "glue", "seeds": seeds, "random_init": True,
                 "config": {"data": {"task": task, "data_dir": str(tmp_path)}}}]
    return load_recipe(DEFAULT, [f"output_dir={tmp_path}", f"finetune={yaml.safe_dump(finetune)}"])


def test_the_stsb_overclaim_is_inconclusive_on_pearson(tmp_path):
    """One seed, Pearson 0.029 vs 0.019 and Spearman the other way round: judged on Pearson only, inconclusive."""
    recipe = glue_recipe(tmp_path, "stsb", [1])
    for init, (pearson, spearman) in {"pretrained": (0.029, 0.010), "random": (0.019, 0.020)}.items():
        write_run(tmp_path, "stsb", "stsb", {init: [pearson]}, pearson=None, spearmanr=spearman)
    (task,) = summarize(recipe, tmp_path)["tasks"]
    (v,) = task["verdicts"]
    assert (v["metric"], v["outcome"], v["reason"], v["chance"]) == ("pearson", INCONCLUSIVE,
                                                                    "one seed per side: no spread", 0.0)
    assert _verdict({"tasks": [task]}) == [
        "stsb (pearson): inconclusive (one seed per side: no spread): +1.0 points (1 seed per side); "
        "pretrained 2.9, random 1.9, chance 0.0 (no correlation)"]


def test_f1s_chance_level_is_always_predicting_the_positive_class(tmp_path):
    recipe = glue_recipe(tmp_path, "mrpc", [1, 2])
    write_run(tmp_path, "mrpc", "mrpc", {"pretrained": [0.85, 0.86], "random": [0.80, 0.81]}, f1=None, accuracy=0.7,
              majority_baseline_accuracy=0.684)
    # the dev labels, as run_glue writes them beside eval_results.json: 3 positives of 4
    rows = ["index\tprediction\tlabel\ttext_a\ttext_b"] + [f"{i}\t1\t{y}\ta\tb" for i, y in enumerate("1101")]
    (tmp_path / "finetune-mrpc-pretrained-s1" / "out" / "dev_predictions.tsv").write_text("\n".join(rows) + "\n")
    (task,) = summarize(recipe, tmp_path)["tasks"]
    (v,) = task["verdicts"]
    p = 0.75
    assert v["metric"] == "f1" and v["chance"] == pytest.approx(2 * p / (1 + p)) and v["chance_source"] == \
        "always positive"
    # F1 0.85 vs 0.80 with chance 0.857: both within 5 points of what "always positive" scores
    assert v["outcome"] == INCONCLUSIVE and v["reason"].startswith("both at chance")


def test_a_score_that_is_not_a_number_is_inconclusive_never_a_loss(tmp_path):
    """Pearson of constant (or NaN) predictions is NaN. Before: the NaN interval failed `lo <= 0 <= hi`, and the
    verdict read "pretraining hurts" (a NaN pretrained side: also "hurts", since NaN > 0 is false)."""
    nan = float("nan")
    v = decide([0.80, 0.82], [nan, nan], 0.0, "no correlation")
    assert v.outcome == INCONCLUSIVE and v.reason == "2 random-init seeds scored no number (NaN or inf)"
    assert v.interval is None and v.difference is None and v.method is None
    v = decide([nan, 0.82, 0.81], [0.10, 0.12], 0.0, "no correlation")
    assert v.outcome == INCONCLUSIVE and v.reason == "1 pretrained seed scored no number (NaN or inf)"
    v = decide([0.5, float("inf")], [nan, 0.1], 0.0)
    assert v.outcome == INCONCLUSIVE and v.reason == ("1 pretrained seed and 1 random-init seed scored no number "
                                                      "(NaN or inf)")

    # end to end: STS-B whose random-init runs predicted a constant, through results.json to the report's line
    recipe = glue_recipe(tmp_path, "stsb", [1, 2])
    write_run(tmp_path, "stsb", "stsb", {"pretrained": [0.80, 0.82], "random": [nan, nan]}, pearson=None,
              spearmanr=0.5)
    results = json.loads(json.dumps(summarize(recipe, tmp_path)))  # as results.json holds it
    (v,) = results["tasks"][0]["verdicts"]
    assert (v["metric"], v["outcome"], v["interval"], v["difference"]) == ("pearson", INCONCLUSIVE, None, None)
    (line,) = _verdict(results)
    assert line.startswith("stsb (pearson): inconclusive (2 random-init seeds scored no number (NaN or inf)); ")
    assert "hurts" not in line and "helps" not in line and line.endswith("chance 0.0 (no correlation)")
    # the spread over seeds: NaN throughout, counted (before: statistics.stdev raised AttributeError and the
    # evaluate stage, after every fine-tuning run, ended in a traceback)
    (m,) = [m for m in results["tasks"][0]["metrics"] if m["metric"] == "pearson"]
    rnd, pre = m["by_init"]["random"], m["by_init"]["pretrained"]
    assert rnd["not_finite"] == 2 and all(math.isnan(rnd[k]) for k in ("mean", "std", "min", "max"))
    assert pre["mean"] == pytest.approx(0.81) and pre["std"] == pytest.approx(0.0141421, rel=1e-5)
    assert "not_finite" not in pre
    (tmp_path / "evaluate").mkdir()
    (tmp_path / "evaluate" / "results.json").write_text(json.dumps(results))
    write_report(recipe, tmp_path, [], tmp_path / "report")
    md = (tmp_path / "report" / "report.md").read_text()
    assert ("| stsb | dev | pearson | 81.0 ± 1.4 (80.0–82.0, n=2) | no number: 2 of 2 seeds scored NaN or inf |"
            in md)


def test_one_seed_in_the_results_table_has_no_spread_not_a_spread_of_zero(tmp_path):
    """Before: "2.9 ± 0.0 (2.9–2.9, n=1)", a spread of zero claimed for a single seed."""
    recipe = glue_recipe(tmp_path, "stsb", [1])
    write_run(tmp_path, "stsb", "stsb", {"pretrained": [0.029], "random": [0.019]}, pearson=None, spearmanr=0.01)
    results = json.loads(json.dumps(summarize(recipe, tmp_path)))
    (tmp_path / "evaluate").mkdir()
    (tmp_path / "evaluate" / "results.json").write_text(json.dumps(results))
    write_report(recipe, tmp_path, [], tmp_path / "report")
    md = (tmp_path / "report" / "report.md").read_text()
    assert "| stsb | dev | pearson | 2.9 (n=1: no spread) | 1.9 (n=1: no spread) | — | — |" in md
    assert "± 0.0" not in md


def test_the_results_plot_shows_scores_below_zero(monkeypatch):
    """A random-init MCC of -0.08 (CoLA, a model that learned nothing): before, the y axis started at 0 and hid it."""
    from bertrain.pipeline import report

    figures = []
    monkeypatch.setattr(report, "_svg", lambda fig: figures.append(fig) or "")
    spread = lambda v: {"seeds": {str(i): x for i, x in enumerate(v)}, "mean": sum(v) / len(v), "std": 0.01,  # noqa
                        "min": min(v), "max": max(v)}
    task = {"name": "cola", "kind": "glue", "metrics": [{"split": "dev", "metric": "mcc", "majority_baseline": None,
            "paper": None, "by_init": {"pretrained": spread([0.12, 0.10]), "random": spread([-0.08, -0.02])}}]}
    report.results_svg(task)
    (ax,) = figures[0].axes
    assert ax.get_ylim()[0] <= -8.0  # percent
    task["metrics"][0]["by_init"]["random"] = spread([0.01, 0.02])
    report.results_svg(task)
    assert figures[1].axes[0].get_ylim()[0] == 0.0  # non-negative scores: the axis still starts at zero
