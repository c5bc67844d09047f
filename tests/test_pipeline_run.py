"""`bertrain run` end to end on the default recipe, made small by overrides (the README's main job, in seconds):
every stage runs and writes its marker; a second run skips everything; a changed key redoes exactly the stages
after it; kill -9 in the middle of a stage, then the same command again, gives the same final results bit for bit;
2 gloo ranks run it too; the report renders in a real browser (when chromium is installed)."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bertrain.pipeline.recipe import load_recipe
from bertrain.pipeline.stages import build_stages, plan
from distributed import REPO, cli_env, launch_cli

pytestmark = pytest.mark.slow

RECIPE = str(REPO / "configs" / "recipes" / "pydoc-small.yaml")
# The default recipe with its steps, examples and seeds turned down: the same stages, a minute on 2 cores.
SMALL = ["phase1.train.steps=30", "phase2.train.steps=6", "pretrain.checkpoint.save_interval=10",
         "finetune[0].seeds=[1,2]", "finetune[0].config.data.max_train_examples=256",
         "finetune[0].config.train.epochs=1"]
STAGES = ["vocab", "prepare", "pretrain-phase1", "pretrain-phase2", "data-pydoc-topics",
          "finetune-pydoc-topics-pretrained-s1", "finetune-pydoc-topics-pretrained-s2",
          "finetune-pydoc-topics-random-s1", "finetune-pydoc-topics-random-s2", "evaluate", "report"]


def argv(out: Path, *extra: str) -> list[str]:
    sets = [f"output_dir={out}", *SMALL, *extra]
    return ["run", RECIPE] + [a for s in sets for a in ("--set", s)]


def bertrain(args: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bertrain", *args], env=cli_env(), cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


def dry_run(out: Path, *extra: str) -> dict[str, tuple[str, str]]:
    """What `bertrain run ... --dry-run` prints (tests/test_pipeline_recipe.py runs the CLI), in this process."""
    recipe = load_recipe(RECIPE, [f"output_dir={out}", *SMALL, *extra])
    return {name: (d.action, d.reason) for name, d in plan(build_stages(recipe)).items()}


def final_results(out: Path) -> dict[str, bytes]:
    """What must be the same bits after any interruption: the results and every model's weights."""
    files = {"evaluate/results.json": out / "evaluate" / "results.json"}
    for stage in STAGES:
        for rel in ("final/model.safetensors", "out/final/model.safetensors", "vocab.txt", "data/train.tsv"):
            if (out / stage / rel).is_file():
                files[f"{stage}/{rel}"] = out / stage / rel
    return {k: p.read_bytes() for k, p in files.items()}


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("pipeline") / "straight"
    r = bertrain(argv(out))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return out


def test_every_stage_completes_with_results_of_both_inits_and_a_report(straight):
    for stage in STAGES:
        info = json.loads((straight / stage / "stage.json").read_text())
        assert info["stage"] == stage and info["hash"] and info["wall_s"] >= 0
    results = json.loads((straight / "evaluate" / "results.json").read_text())
    (task,) = results["tasks"]
    (metric,) = task["metrics"]
    assert (task["name"], metric["metric"], metric["examples"]) == ("pydoc-topics", "accuracy", 877)
    assert set(metric["by_init"]) == {"pretrained", "random"}
    for init in ("pretrained", "random"):
        s = metric["by_init"][init]
        assert set(s["seeds"]) == {"1", "2"} and s["min"] <= s["mean"] <= s["max"]
        for seed in ("1", "2"):  # the summary is the fine-tuning stage's own score
            own = json.loads((straight / f"finetune-pydoc-topics-{init}-s{seed}" / "out" / "eval_results.json").read_text())
            assert own["dev"]["accuracy"] == s["seeds"][seed]
    assert 0.15 < metric["majority_baseline"] < 0.3
    summary = json.loads((straight / "pretrain-phase1" / "stage.json").read_text())["summary"]
    assert summary["steps"] == 30 and summary["seq_per_s"] > 0
    page = (straight / "report" / "report.html").read_text()
    md = (straight / "report" / "report.md").read_text()
    for text in (page, md):
        assert "pretrained: mean ± sd" in text and "majority class" in text and "pretrain-phase2" in text
        assert "torch" in text and "phase1:" in text  # versions and the recipe
    assert page.count("<svg") == 4  # the results, both phases' curves and the fine-tuning curves, inline
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page)  # self-contained: nothing to fetch
    assert "<script" not in page
    for name in ("results-pydoc-topics.svg", "curves-pretrain-phase1.svg", "curves-pretrain-phase2.svg",
                 "finetune-pydoc-topics.svg"):
        assert f"]({name})" in md and (straight / "report" / name).is_file()
    # the held-out curves beside the training ones (the recipe holds documents out), the dev curves of every run
    for phase, steps in (("pretrain-phase1", 30), ("pretrain-phase2", 6)):
        evals = [r for r in map(json.loads, (straight / phase / "metrics.jsonl").read_text().splitlines())
                 if r.get("event") == "eval"]
        assert evals[-1]["step"] == steps and 0 < evals[-1]["metrics"]["mlm_acc"] < 1  # always after the last step
        assert "held-out" in (straight / "report" / f"curves-{phase}.svg").read_text()
    dev_svg = (straight / "report" / "finetune-pydoc-topics.svg").read_text()
    assert "dev accuracy" in dev_svg and "random seed 2" in dev_svg
    # the recipe keeps each run's last model: the report says the dev set did not choose it
    assert "each run ends with its last model (eval.final: last)" in md


def test_a_second_run_skips_everything_and_a_change_redoes_what_follows_it(straight):
    before = {s: (straight / s / "stage.json").read_bytes() for s in STAGES}
    plan = dry_run(straight)
    assert {a for a, _ in plan.values()} == {"skip"} and list(plan) == STAGES
    r = bertrain(argv(straight))
    assert r.returncode == 0, r.stderr[-3000:]
    assert {s: (straight / s / "stage.json").read_bytes() for s in STAGES} == before

    plan = dry_run(straight, "phase2.train.steps=7")
    redo = {s for s, (a, _) in plan.items() if a == "redo"}
    assert redo == {"pretrain-phase2", "finetune-pydoc-topics-pretrained-s1", "finetune-pydoc-topics-pretrained-s2",
                    "evaluate", "report"}
    assert plan["pretrain-phase2"][1] == "train.steps: 6 -> 7"
    assert plan["finetune-pydoc-topics-pretrained-s1"][1] == "stage pretrain-phase2 changed"

    results = straight / "evaluate" / "results.json"
    saved = results.read_bytes()
    try:
        results.write_bytes(saved.replace(b"accuracy", b"acuracy"))
        plan = dry_run(straight)
        assert plan["evaluate"] == ("redo", "an output file was changed or removed since it completed")
        assert plan["report"][0] == "redo" and plan["finetune-pydoc-topics-random-s2"][0] == "skip"
    finally:
        results.write_bytes(saved)


def run_until(args: list[str], ready: Path, timeout: float = 300) -> bool:
    """Start `bertrain ARGS`, kill -9 it as soon as `ready` exists; False if it finished first."""
    proc = subprocess.Popen([sys.executable, "-m", "bertrain", *args], env=cli_env(), cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + timeout
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            if ready.exists():
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()
                return True
            time.sleep(0.05)
        return False
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_kill_9_in_the_middle_of_stages_then_run_again_gives_the_same_results_bitwise(straight, tmp_path):
    out = tmp_path / "killed"
    # in pretraining phase 1 once a checkpoint exists, then in a fine-tuning stage
    assert run_until(argv(out), out / "pretrain-phase1" / "step-10" / "COMPLETE")
    # the run folder moved before it is continued: the cut stage resumes (the engine refused the changed paths
    # of its inputs, for ever, with advice `bertrain run` has no flag for)
    out = out.rename(tmp_path / "moved")
    plan = dry_run(out)
    # `bertrain info` lists the whole plan in its order, the stages not started too (stages.json)
    info = json.loads(bertrain(["info", "--model", str(out), "--json"]).stdout)["run"]
    assert [s["name"] for s in info["stages"]] == list(plan)
    assert [s["name"] for s in info["stages"] if not s["not_started"]] == ["vocab", "prepare", "pretrain-phase1"]
    actions = [a for a, _ in plan.values()]
    assert "resume" in actions and actions.index("resume") == actions.count("skip")  # done, then the cut one
    assert run_until(argv(out), out / "finetune-pydoc-topics-pretrained-s2" / "stage-started.json")
    assert dry_run(out)["finetune-pydoc-topics-pretrained-s2"] == ("resume", "interrupted: continues where it stopped")
    r = bertrain(argv(out))
    assert r.returncode == 0, r.stderr[-3000:]
    got, want = final_results(out), final_results(straight)
    assert got.keys() == want.keys() and len(want) == 9  # results, vocab, task data, 2 phases, 4 fine-tuned
    assert [k for k in want if got[k] != want[k]] == []


def test_two_gloo_ranks_run_the_pipeline(tmp_path):
    out = tmp_path / "ddp"
    args = argv(out, "finetune[0].seeds=[1]", "finetune[0].random_init=false", "phase1.train.steps=10")
    # the recipe as it runs on one process (micro = global batch): each rank takes half of each batch (it was
    # refused before any work, "batch 16 = micro 16 x 2 ranks x ?", and needed three micro-batch overrides)
    results = launch_cli(2, args, timeout=600)
    for rank, r in enumerate(results):
        assert r.returncode == 0, f"rank {rank}:\n{r.stdout[-4000:]}"
    stages = [s for s in STAGES if "random" not in s and not s.endswith("s2")]
    for stage in stages:
        assert (out / stage / "stage.json").is_file(), stage
    # one-process stages ran once, on rank 0; the decisions are rank 0's
    assert "stage vocab: run" in results[0].stdout and "stage vocab" not in results[1].stdout
    assert "training a" not in results[1].stdout
    run_log = [json.loads(line) for line in (out / "pretrain-phase1" / "metrics.jsonl").read_text().splitlines()]
    assert run_log[-1]["step"] == 10
    assert "global batch 16 = micro 8 x accumulation 1 x 2 ranks" in results[0].stdout


def test_report_renders_in_headless_chromium(straight, tmp_path):
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        pytest.skip("chromium is not installed (Debian: apt-get install chromium): the report is not rendered")
    png = tmp_path / "report.png"
    r = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                        f"--screenshot={png}", "--window-size=1280,2400",
                        (straight / "report" / "report.html").as_uri()], capture_output=True, text=True, timeout=120)
    assert png.is_file(), r.stderr[-2000:]
    from PIL import Image
    img = Image.open(png).convert("L")
    hist = img.histogram()
    # not blank: a real page has text and plots: many pixels far from the white background, of many grey levels
    dark = sum(hist[:200])
    assert dark > 0.01 * img.width * img.height
    assert sum(1 for h in hist if h) > 50
    shutil.copy(png, straight / "report" / "screenshot.png")  # kept with the run for a person to look at
