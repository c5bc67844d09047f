"""An audit of `bertrain run`'s pipeline: the random-init side is the pretrained model's architecture, a recipe is
refused before any work naming its key, the report's curves and dev-selection notes say what happened, and the
verdict's interval is scipy's Welch interval. Fast: no training (stages are built, not run)."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from bertrain.pipeline.evaluate import summarize
from bertrain.pipeline.recipe import load_recipe
from bertrain.pipeline.report import _run_curves, _selection_notes
from bertrain.pipeline.stages import build_stages
from bertrain.pipeline.verdict import welch_interval
from bertrain.utils.errors import UserError

REPO = Path(__file__).resolve().parents[1]
DEFAULT = REPO / "configs" / "recipes" / "pydoc-small.yaml"
VOCAB = REPO / "tests" / "assets" / "vocab-tiny.txt"


def stages_of(tmp_path: Path, *overrides: str) -> dict:
    recipe = load_recipe(DEFAULT, [f"output_dir={tmp_path / 'run'}", *overrides])
    return {s.name: s for s in build_stages(recipe)}


def random_init_config(tmp_path: Path, *overrides: str) -> tuple[dict, dict]:
    """(config.json of the random-init model the stage's setup writes, the stage's hashed settings)."""
    stages = stages_of(tmp_path, "finetune[0].seeds=[1]", *overrides)
    (tmp_path / "run" / "vocab").mkdir(parents=True)
    shutil.copy(VOCAB, tmp_path / "run" / "vocab" / "vocab.txt")
    stage = stages["finetune-pydoc-topics-random-s1"]
    stage.folder.mkdir(parents=True)
    stage.setup(stage)
    return json.loads((stage.folder / "init" / "config.json").read_text()), stage.settings


def test_random_init_has_the_architecture_phase1_set_not_the_presets(tmp_path):
    """Phase 2 starts from phase 1's weights, so `phase1.model.num_hidden_layers: 2` makes a 2-layer pretrained
    model. Before, the random-init model was built from phase 2's model section (the preset's 4 layers): the verdict
    compared a 2-layer pretrained model with a 4-layer random one."""
    config, settings = random_init_config(tmp_path, "phase1.model.num_hidden_layers=2")
    assert (config["num_hidden_layers"], config["hidden_size"], config["intermediate_size"]) == (2, 128, 512)
    assert settings["random_init.model"]["num_hidden_layers"] == 2  # in the stage's hash: a change redoes it


def test_random_init_takes_the_dropout_phase2_loads_the_pretrained_model_with(tmp_path):
    # phase 2's dropout applies to the weights it loads (build_model: from_pretrained(init, dropout)), so the
    # pretrained model fine-tuning starts from has it; the random-init model must too
    config, _ = random_init_config(tmp_path, "phase2.model.dropout=0.0")
    assert (config["hidden_dropout_prob"], config["attention_probs_dropout_prob"]) == (0.0, 0.0)
    config, _ = random_init_config(tmp_path / "default")
    assert (config["num_hidden_layers"], config["hidden_dropout_prob"]) == (4, 0.1)


def test_the_default_recipes_random_init_stage_keeps_its_hash(tmp_path):
    """Phase 1 and phase 2 share `pretrain.model` in the shipped recipe: the architecture, and so the hash of a
    finished run's random-init stages, is what it was (no stage of an existing run is redone by the fix)."""
    stages = stages_of(tmp_path)
    phase2 = stages["pretrain-phase2"].config.model
    assert stages["finetune-pydoc-topics-random-s1"].settings["random_init.model"] == {
        **yaml.safe_load(yaml.safe_dump(dict(vars(phase2)))), "init": None}


def test_a_max_seq_length_over_the_positions_is_refused_before_phase2_has_weights(tmp_path):
    """Before, the check read the positions from phase 2's model.init folder, absent until phase 1 has run: a fresh
    run passed it and failed after pretraining."""
    with pytest.raises(UserError, match=r"finetune\[0\]\.config\.data\.max_seq_length: 1000 exceeds the 512 "):
        stages_of(tmp_path, "finetune[0].config.data.max_seq_length=1000")
    assert not (tmp_path / "run").exists()  # before any work


@pytest.mark.parametrize("override, key", [("finetune[0].seeds=[]", "finetune[0].seeds"),
                                          ("finetune[0].seeds=[1, 1]", "finetune[0].seeds"),
                                          ("finetune[0].name=Bad!", "finetune[0].name")])
def test_a_tasks_own_checks_name_the_task(tmp_path, override, key):
    """Before: "recipe key 'seeds' must list at least one seed" — which task's, in a recipe of several?"""
    with pytest.raises(UserError, match="^recipe key " + re.escape(f"'{key}'")):
        load_recipe(DEFAULT, [f"output_dir={tmp_path}", override])


@pytest.mark.parametrize("override, key", [
    ("finetune[0].config.train.epochs=0", "finetune[0].config.train.epochs"),
    ("finetune[0].search={grid: {train.epochs: [0, 2]}}", "finetune[0].search.grid.train.epochs")])
def test_an_error_listing_several_keys_names_the_recipe_key_that_set_one(tmp_path, override, key):
    """"config keys 'train.steps' (the default), 'train.epochs' and 'train.max_time' are all unset": before, only
    the first key was looked up in the recipe, so the message named no recipe key at all."""
    with pytest.raises(UserError) as e:
        stages_of(tmp_path, override)
    assert f"'{key}'" in str(e.value) and len(str(e.value).splitlines()) == 1


def test_a_tasks_curves_do_not_take_the_runs_of_a_task_whose_name_extends_it(tmp_path):
    """Tasks `mnli` and `mnli-small`: `finetune-mnli-` is a prefix of `finetune-mnli-small-pretrained-s1`, and
    before, task mnli's curves drew mnli-small's runs too (as an init named 'small-pretrained')."""
    stages = []
    for name in ("finetune-mnli-pretrained-s1", "finetune-mnli-small-pretrained-s1", "search-mnli-random-t2",
                 "search-mnli-small-random-t1"):
        out = tmp_path / name / "out"
        out.mkdir(parents=True)
        (out / "metrics.jsonl").write_text(json.dumps({"step": 4, "event": "eval", "metrics": {"accuracy": 0.5},
                                                       "metric": "accuracy", "value": 0.5}) + "\n")
        stages.append(SimpleNamespace(name=name, config=SimpleNamespace(output_dir=str(out)), folder=tmp_path / name))
    runs, trials = _run_curves(stages, "mnli", None)
    assert [(r["init"], r["label"]) for r in runs] == [("pretrained", "pretrained seed 1")]
    assert [(t["init"], t["label"]) for t in trials] == [("random", "random: trial 2 (chosen)")]
    runs, trials = _run_curves(stages, "mnli-small", None)
    assert [r["label"] for r in runs] == ["pretrained seed 1"] and [t["init"] for t in trials] == ["random"]


def write_runs(run: Path, stop: dict[str, str | None]) -> None:
    """eval_results.json of pydoc-topics runs (seeds 1-2 per side) ending with their last model; `stop`: each
    run's stop_reason."""
    for init in ("pretrained", "random"):
        for seed in (1, 2):
            out = run / f"finetune-pydoc-topics-{init}-s{seed}" / "out"
            out.mkdir(parents=True)
            value = 0.4 if init == "pretrained" else 0.25
            selection = {"metric": "accuracy", "maximise": True, "final": "last", "best_step": 4, "best_value": value,
                         "stop_reason": stop.get(f"{init} seed {seed}"),
                         "history": [{"step": 4, "accuracy": value}, {"step": 8, "accuracy": value - 0.01}]}
            (out / "eval_results.json").write_text(json.dumps({
                "task": "pydoctopics", "selection": selection,
                "dev": {"accuracy": value + 0.001 * seed, "examples": 878, "majority_baseline_accuracy": 0.208}}))


def test_early_stopping_on_dev_is_reported_as_a_choice_made_on_dev(tmp_path):
    """eval.patience (or eval.target) stops a run where a dev evaluation says: its last model was chosen on dev.
    Before, the report said "the dev set did not choose it" whenever eval.final was last."""
    recipe = load_recipe(DEFAULT, [f"output_dir={tmp_path}", "finetune[0].seeds=[1,2]"])
    why = "early stopping: 1 evaluations without an improvement of accuracy (eval.patience = 1; best 0.4 at step 4)"
    write_runs(tmp_path, {"pretrained seed 2": why})
    results = json.loads(json.dumps(summarize(recipe, tmp_path)))
    assert results["tasks"][0]["final_model"] == {"metric": "accuracy", "final": "last",
                                                  "stopped_on_dev": {"pretrained seed 2": why}}
    (note,) = _selection_notes(results)
    assert "1 run stopped early on a dev evaluation (pretrained seed 2" in note and note.endswith("optimistic.")
    assert "did not choose" not in note


def test_runs_that_ran_to_their_end_are_still_reported_as_not_chosen_on_dev(tmp_path):
    recipe = load_recipe(DEFAULT, [f"output_dir={tmp_path}", "finetune[0].seeds=[1,2]"])
    write_runs(tmp_path, {})
    results = json.loads(json.dumps(summarize(recipe, tmp_path)))
    assert results["tasks"][0]["final_model"] == {"metric": "accuracy", "final": "last"}
    (note,) = _selection_notes(results)
    assert "the dev set did not choose it" in note


@pytest.mark.parametrize("a, b", [([0.41, 0.43, 0.39], [0.25, 0.27, 0.24]), ([0.5, 0.52], [0.3, 0.36, 0.33, 0.31]),
                                  ([0.5, 0.5, 0.5], [0.30, 0.32, 0.35]), ([0.2, 0.6], [0.3, 0.31])])
def test_the_welch_interval_is_scipys(a, b):
    from scipy import stats

    ci = stats.ttest_ind(a, b, equal_var=False).confidence_interval(0.95)
    assert welch_interval(a, b) == pytest.approx((ci.low, ci.high), rel=1e-9)


def test_a_cut_stage_whose_upstream_runs_again_starts_over_not_resumes(tmp_path):
    """Phase 2 was cut (stage-started.json, no stage.json) and phase 1's final weights were since removed: phase 1
    is redone, so phase 2's checkpoints descend from weights that are gone. Before, phase 2 resumed from them (a
    complete phase 2 was redone in the same case); now both start over."""
    from bertrain.pipeline.stages import STARTED_FILE, Decision, decide

    stage = stages_of(tmp_path)["pretrain-phase2"]
    stage.folder.mkdir(parents=True)
    (stage.folder / STARTED_FILE).write_text(json.dumps({"hash": stage.hash, "parts": stage.parts}))
    skip = Decision("skip", "complete")
    upstream = {"vocab": skip, "prepare": skip, "pretrain-phase1": skip}
    assert decide(stage, upstream).action == "resume"
    upstream["pretrain-phase1"] = Decision("redo", "an output file was changed or removed since it completed")
    assert (decide(stage, upstream).action, decide(stage, upstream).reason) == (
        "redo", "interrupted, and stage pretrain-phase1 runs again")


def test_every_batch_size_an_optuna_range_may_propose_is_checked_before_any_work(tmp_path):
    """`train.global_batch_size: {low: 16, high: 64}` with micro-batches of 16: Optuna's trial 1 proposes 36 (seeded,
    the random sampler). Before, only the range's ends (16, 64) were checked, so the run failed at trial 1, after
    pretraining; now every integer the range holds is built and checked first."""
    pytest.importorskip("optuna")
    from bertrain.pipeline.stages import check_batches

    def search(rng: str) -> str:
        return ("finetune[0].search={optuna: {trials: 2, sampler: random, params: {train.global_batch_size: "
                + rng + "}}}")

    stages = list(stages_of(tmp_path, "finetune[0].config.train.micro_batch_size=16",
                            search("{low: 16, high: 64}")).values())
    with pytest.raises(UserError, match=r"^stage search-pydoc-topics-pretrained-t1, with a value its search may try"
                                        r".*'train.global_batch_size' \(17\) must be divisible"):
        check_batches(stages, 1)
    stages = stages_of(tmp_path, "finetune[0].config.train.micro_batch_size=16",
                       search("{low: 16, high: 64, step: 16}"))
    check_batches(list(stages.values()), 1)  # 16, 32, 48, 64: every one a multiple of 16
    trial1 = stages["search-pydoc-topics-pretrained-t1"]
    assert sorted(c.train.global_batch_size for c in trial1.variants) == [16, 32, 48, 64]


def test_a_pretraining_stages_throughput_is_its_sequences_over_its_time(tmp_path):
    """Two log intervals of 100 sequences at 100 and 50 seq/s: 200 sequences in 3 s, 66.7 seq/s. Before, the
    report showed the plain mean of the intervals' rates, 75 seq/s."""
    from bertrain.pipeline.stages import _pretrain_summary

    rows = [{"step": 10, "samples": 100, "loss": 2.0, "seq_per_s": 100.0, "tokens_per_s": 12800.0, "elapsed_s": 1.0},
            {"step": 15, "event": "eval", "metrics": {"mlm_acc": 0.1}},
            {"step": 20, "samples": 200, "loss": 1.5, "seq_per_s": 50.0, "tokens_per_s": 6400.0, "elapsed_s": 2.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = _pretrain_summary(tmp_path)
    assert summary["seq_per_s"] == pytest.approx(200 / 3.0)
    assert summary["tokens_per_s"] == pytest.approx(200 * 128 / 3.0)
    assert (summary["steps"], summary["final_loss"]) == (20, 1.5)


def test_the_downstream_task_has_no_text_on_both_sides_of_the_split():
    """Docstrings that are the same text for an uncased model ("Return true if and only if the internal flag is
    true." in threading, "Return True if ..." in asyncio) were one in train and one in dev: now one example."""
    from bertrain.pipeline.downstream import is_dev, same_text_key, stdlib_docstrings

    rows = stdlib_docstrings()
    keys = [same_text_key(text) for text, _ in rows]
    assert len(keys) == len(set(keys)) > 1000
    train = {k for k, (text, _) in zip(keys, rows) if not is_dev(text)}
    assert not [k for k, (text, _) in zip(keys, rows) if is_dev(text) and k in train]
    assert same_text_key("Return True if, and only if, the flag is set.") == \
        same_text_key("return true if and only if the flag is set")


def test_a_finished_phases_edited_config_or_vocab_is_noticed_and_an_older_record_still_skips(tmp_path):
    """stage.json records the sha256 of a pretraining phase's final config.json, vocab.txt and tokenizer_config.json
    beside its weights: a config.json edited by hand (another dropout) redoes the phase, and so what follows it
    (before: only model.safetensors was recorded, and phase 2 ran from the edited model). A record of an older
    bertrain that lists the weights alone still skips while they are unchanged."""
    from bertrain.pipeline.stages import MODEL_FILES, STAGE_FILE, Decision, _finish, decide

    stage = stages_of(tmp_path)["pretrain-phase1"]
    for rel in MODEL_FILES:
        (stage.folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (stage.folder / rel).write_text(f"{rel}\n")
    _finish(stage, {}, 1.0)
    upstream = {"vocab": Decision("skip", "complete"), "prepare": Decision("skip", "complete")}
    assert decide(stage, upstream).action == "skip"
    config = stage.folder / "final" / "config.json"
    config.write_text('{"hidden_dropout_prob": 0.0}\n')
    assert (decide(stage, upstream).action, decide(stage, upstream).reason) == (
        "redo", "an output file was changed or removed since it completed")
    record = json.loads((stage.folder / STAGE_FILE).read_text())
    record["outputs"] = {k: v for k, v in record["outputs"].items() if k == "final/model.safetensors"}
    (stage.folder / STAGE_FILE).write_text(json.dumps(record))
    assert decide(stage, upstream).action == "skip"  # an older record vouches for the weights alone
    (stage.folder / "final" / "model.safetensors").write_text("other weights\n")
    assert decide(stage, upstream).action == "redo"
    (stage.folder / "final" / "model.safetensors").write_text("final/model.safetensors\n")
    assert decide(stage, upstream).action == "skip"
    (stage.folder / "final" / "vocab.txt").unlink()  # every output must still be there
    assert decide(stage, upstream).action == "redo"
