"""`bertrain run`: recipes load strictly (errors name the recipe key), every shipped recipe builds its stages and
dry-runs, and the stage hashes change exactly when a stage's result can."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from bertrain.cli import main
from bertrain.pipeline.recipe import load_recipe
from bertrain.pipeline.stages import build_stages, plan
from bertrain.utils.errors import UserError

REPO = Path(__file__).resolve().parents[1]
RECIPES = sorted((REPO / "configs" / "recipes").glob("*.yaml"))
DEFAULT = REPO / "configs" / "recipes" / "pydoc-small.yaml"


def stage_names(recipe) -> list[str]:
    return [s.name for s in build_stages(recipe)]


def test_shipped_recipes_are_found():
    assert {p.name for p in RECIPES} >= {"pydoc-small.yaml", "bert-base.yaml", "bert-large.yaml"}


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_every_shipped_recipe_loads_and_dry_runs(path, tmp_path, capsys):
    out = tmp_path / "run"
    recipe = load_recipe(path, [f"output_dir={out}"])
    names = stage_names(recipe)
    assert names[:4] == ["vocab", "prepare", "pretrain-phase1", "pretrain-phase2"]
    assert names[-2:] == ["evaluate", "report"]
    assert main(["run", str(path), "--dry-run", "--set", f"output_dir={out}"]) == 0
    text = capsys.readouterr().out
    assert f"{len(names)} stages in {out} ({len(names)} to run)" in text
    assert all(f"  {n} " in text for n in names)
    assert not out.exists()  # a dry run does nothing


@pytest.mark.parametrize("size, layers, paper", [("base", 12, 0.889), ("large", 24, 0.893)])
def test_real_recipes_follow_nvidia_and_compare_with_the_paper(size, layers, paper):
    recipe = load_recipe(REPO / "configs" / "recipes" / f"bert-{size}.yaml")
    stages = {s.name: s for s in build_stages(recipe)}
    p1, p2 = stages["pretrain-phase1"].config, stages["pretrain-phase2"].config
    assert (p1.sample.max_seq_length, p1.train.steps, p1.train.global_batch_size, p1.optim.lr) == (128, 7038, 65536, 6e-3)
    assert (p2.sample.max_seq_length, p2.train.steps, p2.train.global_batch_size, p2.optim.lr) == (512, 1563, 32768, 4e-3)
    assert p1.optim.name == p2.optim.name == "nvlamb" and p1.model.preset == size
    assert p2.model.init.endswith("pretrain-phase1/final")
    # NVIDIA's phase 2 continues phase 1's LAMB moments: the recipe's `init_state: phase1` is phase 1's run folder
    assert p1.optim.init_state is None and p2.optim.init_state == str(recipe.run_dir / "pretrain-phase1")
    with pytest.raises(UserError, match="'optim.init_state': 'phase1'.*set it under phase2"):
        build_stages(load_recipe(REPO / "configs" / "recipes" / f"bert-{size}.yaml", ["phase1.optim.init_state=phase1"]))
    assert stages["finetune-squad1.1-pretrained-s42"].config.data.train_file.endswith("train-v1.1.json")
    glue = {s.config.data.task for s in stages.values() if s.name.startswith("finetune-") and "squad" not in s.name}
    assert glue == {"mnli", "qqp", "qnli", "sst2", "cola", "stsb", "mrpc", "rte"}
    from bertrain.pipeline.evaluate import BERT_PAPER
    assert BERT_PAPER[(recipe.report.paper_model, "mrpc", "f1")] == paper
    from bertrain.model.bert import BertConfig
    assert BertConfig.from_preset(size).num_hidden_layers == layers


def test_default_recipe_compares_pretrained_with_random_init_over_seeds():
    recipe = load_recipe(DEFAULT)
    names = stage_names(recipe)
    assert "data-pydoc-topics" in names
    for init in ("pretrained", "random"):
        assert [n for n in names if n.startswith(f"finetune-pydoc-topics-{init}-")] == [
            f"finetune-pydoc-topics-{init}-s{s}" for s in (1, 2, 3)]
    stages = {s.name: s for s in build_stages(recipe)}
    assert stages["pretrain-phase1"].config.sample.max_seq_length == 128
    assert stages["pretrain-phase2"].config.sample.max_seq_length > 128
    # held-out curves: a held-out set the corpus's 79 documents allow, evaluated while pretraining
    prep = stages["prepare"].config
    assert (prep.heldout_fraction, prep.heldout_min_documents) == (0.05, 4)
    assert all(stages[f"pretrain-phase{p}"].config.eval.interval > 0 for p in (1, 2))
    # the dev set is scored by the verdict, so it does not also choose each run's final model
    ft = stages["finetune-pydoc-topics-pretrained-s1"].config
    assert (ft.eval.final, ft.eval.each_epoch) == ("last", True)


def write(tmp_path: Path, data: dict) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    return path


def base_data() -> dict:
    return yaml.safe_load(DEFAULT.read_text(encoding="utf-8"))


@pytest.mark.parametrize("edit, overrides, message", [
    (lambda d: d.update(finetuen=[]), [], "recipe key 'finetuen' — did you mean 'finetune'?"),
    (lambda d: d["phase1"].setdefault("optim", {}).update(lrr=1.0), [], "recipe key 'phase1.optim.lrr'"),
    (lambda d: None, ["pretrain.optim.lr=fast"], "recipe key 'pretrain.optim.lr'"),
    (lambda d: None, ["phase2.train.steps=-3"], "recipe key 'phase2.train.steps'"),
    (lambda d: d["pretrain"].update(output_dir="x"), [], "recipe key 'pretrain.output_dir' is set by bertrain run"),
    (lambda d: d["phase2"].setdefault("model", {}).update(init="x"), [], "recipe key 'phase2.model.init'"),
    (lambda d: None, ["finetune[0].config.init=x"], "recipe key 'finetune[0].config.init'"),
    (lambda d: None, ["finetune[0].config.optim.name=sgd"], "recipe key 'finetune[0].config.optim.name'"),
    (lambda d: None, ["finetune[0].seeds=[1,1]"], "seeds"),
    (lambda d: None, ["finetune[0].kind=mnist"], "recipe key 'finetune[0].kind'"),
    (lambda d: d["finetune"].append(dict(d["finetune"][0])), [], "task name(s) pydoc-topics used twice"),
    (lambda d: d["data"].update(input=[]), [], "recipe key 'data.input'"),
    (lambda d: d["data"]["prepare"].update(masking="sometimes"), [], "recipe key 'data.prepare.masking'"),
    (lambda d: None, ["phase1.train.steps"], "expected KEY=VALUE"),
    (lambda d: None, ["finetune[3].seeds=[1]"], "1 finetune task"),
    # the section of the key as written: its suggestion, a section-worded message, a list index with a dot
    (lambda d: None, ["phase1.train.stepz=40"],
     "unknown recipe key 'phase1.train.stepz' — did you mean 'phase1.train.steps'?"),
    (lambda d: None, ["phase1.sample.max_predictions_per_seq=400"],
     "recipe key 'phase1.sample.max_predictions_per_seq': max_predictions_per_seq must be in [1, max_seq_length]"),
    (lambda d: None, ["finetune[0].config.eval.metric=f1"],
     "recipe key finetune[0].config.eval.metric: 'f1' is not one of this task's metrics (accuracy)"),
    # a fine-tuning length beyond the positions of the model pretraining makes (it failed after pretraining)
    (lambda d: None, ["pretrain.model.max_position_embeddings=32", "phase1.sample.max_seq_length=32",
                      "phase2.sample.max_seq_length=32", "phase1.sample.max_predictions_per_seq=5",
                      "phase2.sample.max_predictions_per_seq=5"],
     "recipe key finetune[0].config.data.max_seq_length: 64 exceeds the 32 positions (max_position_embeddings) of "
     "the model pretrain-phase2 trains"),
])
def test_bad_recipes_are_refused_naming_the_key_before_any_work(tmp_path, capsys, edit, overrides, message):
    data = base_data()
    data["output_dir"] = str(tmp_path / "run")
    edit(data)
    path = write(tmp_path, data)
    with pytest.raises(UserError, match=None) as e:
        build_stages(load_recipe(path, overrides))
    assert message in str(e.value)
    argv = ["run", str(path)] + [a for o in overrides for a in ("--set", o)]
    assert main(argv) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_a_list_index_written_with_a_dot_says_how_to_write_it(tmp_path, capsys):
    argv = ["run", str(DEFAULT), "--dry-run", "--set", f"output_dir={tmp_path / 'run'}", "--set", "finetune.0.seeds=[1]"]
    assert main(argv) == 2
    assert "'finetune' is not a section: write finetune[0].seeds" in capsys.readouterr().err


def test_the_dry_run_refuses_what_the_run_would_refuse_before_any_work(tmp_path, capsys):
    argv = ["run", str(DEFAULT), "--set", f"output_dir={tmp_path / 'run'}", "--set",
            "finetune[0].config.train.global_batch_size=17", "--set", "finetune[0].config.train.micro_batch_size=8"]
    for dry in (["--dry-run"], []):
        assert main(argv + dry) == 2
        assert "stage finetune-pydoc-topics-pretrained-s1: config key 'train.global_batch_size' (17)" in \
            capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_missing_inputs_refuse_the_run_but_not_the_dry_run(tmp_path, capsys):
    data = base_data()
    data.update(output_dir=str(tmp_path / "run"))
    data["data"]["input"] = [str(tmp_path / "nowhere.txt")]
    path = write(tmp_path, data)
    assert main(["run", str(path), "--dry-run"]) == 0
    assert f"data.input: {tmp_path / 'nowhere.txt'} (for vocab, prepare)" in capsys.readouterr().out
    assert main(["run", str(path)]) == 2
    assert "missing inputs" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_a_glue_folder_without_its_dev_split_refuses_the_run_before_any_work(tmp_path, capsys):
    glue = tmp_path / "MRPC"
    glue.mkdir()
    (glue / "train.tsv").write_text("Quality\t#1 ID\t#2 ID\t#1 String\t#2 String\n1\t1\t2\tA cat.\tA cat sat.\n")
    data = base_data()
    data.update(output_dir=str(tmp_path / "run"))
    data["finetune"][0] = {"name": "mrpc", "kind": "glue", "seeds": [1],
                           "config": {"data": {"task": "mrpc", "data_dir": str(glue)}}}
    path = write(tmp_path, data)
    assert main(["run", str(path)]) == 2
    assert f"finetune[0].config.data.data_dir: the dev split of {glue}" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def hashes(overrides: list[str], tmp_path: Path) -> dict[str, str]:
    recipe = load_recipe(DEFAULT, [f"output_dir={tmp_path / 'run'}"] + overrides)
    return {s.name: s.hash for s in build_stages(recipe)}


def test_hashes_change_with_what_changes_a_result_and_everything_after_it(tmp_path):
    base = hashes([], tmp_path)
    assert base == hashes([], tmp_path)  # deterministic
    # keys that cannot change a result (logging, checkpoint interval), and moving the run folder, redo nothing but
    # the report (which shows the recipe and the folder)
    same = hashes(["pretrain.train.log_interval=5", "phase1.checkpoint.save_interval=7",
                   "finetune[0].config.train.log_interval=3"], tmp_path)
    moved = hashes([f"output_dir={tmp_path / 'elsewhere'}"], tmp_path)
    for other in (same, moved):
        assert {n for n in base if other[n] != base[n]} == {"report"}
    names = list(base)
    for override, first in (("phase2.train.steps=7", "pretrain-phase2"), ("data.vocab_size=4000", "vocab"),
                            ("phase1.optim.lr=0.002", "pretrain-phase1")):
        changed = hashes([override], tmp_path)
        redone = {n for n in names if changed[n] != base[n]}
        # the stage itself and every stage downstream of it; random init does not depend on pretraining
        after = names[names.index(first):]
        expect = {n for n in after if "random" not in n and n != "data-pydoc-topics"}
        if first == "vocab":
            expect |= {n for n in names if "random" in n} | {"prepare"}
        assert redone == expect, (override, sorted(redone ^ expect))
    # keys a resume may take unchanged (the steps are the same) but that change what a finished stage left behind
    for override, first in (("phase1.train.max_time=4s", "pretrain-phase1"),
                            ("phase1.eval.interval=7", "pretrain-phase1"),
                            ("finetune[0].config.eval.interval=3", "finetune-pydoc-topics-pretrained-s1"),
                            ("finetune[0].config.do_eval=false", "finetune-pydoc-topics-pretrained-s1")):
        changed = hashes([override], tmp_path)
        assert changed[first] != base[first] and changed["evaluate"] != base["evaluate"], override
    seeds = hashes(["finetune[0].seeds=[1,2,4]"], tmp_path)
    assert seeds["finetune-pydoc-topics-pretrained-s1"] == base["finetune-pydoc-topics-pretrained-s1"]
    assert seeds["evaluate"] != base["evaluate"]


def test_dry_run_on_a_fresh_folder_runs_everything(tmp_path):
    recipe = load_recipe(DEFAULT, [f"output_dir={tmp_path / 'run'}"])
    decisions = plan(build_stages(recipe))
    assert {d.action for d in decisions.values()} == {"run"}


def test_evaluate_collects_seeds_baselines_and_the_papers_figure(tmp_path):
    import json

    from bertrain.pipeline.evaluate import summarize
    data = base_data()
    data.update(output_dir=str(tmp_path), report={"paper_model": "base"})
    data["finetune"] = [{"name": "mrpc", "kind": "glue", "seeds": [1, 2], "random_init": True,
                         "config": {"data": {"task": "MRPC", "data_dir": str(tmp_path)}}},
                        {"name": "sq", "kind": "squad", "seeds": [7],
                         "config": {"data": {"train_file": "t.json", "dev_file": "d.json"}}}]
    recipe = load_recipe(write(tmp_path, data))
    scores = {("pretrained", 1): 0.80, ("pretrained", 2): 0.84, ("random", 1): 0.70, ("random", 2): 0.72}
    for (init, seed), f1 in scores.items():
        out = tmp_path / f"finetune-mrpc-{init}-s{seed}" / "out"
        out.mkdir(parents=True)
        (out / "eval_results.json").write_text(json.dumps({"task": "mrpc", "train_seconds": seed, "dev": {
            "accuracy": f1 - 0.1, "f1": f1, "acc_and_f1": 0.0, "examples": 408, "majority_baseline_accuracy": 0.684}}))
    out = tmp_path / "finetune-sq-pretrained-s7" / "out"
    out.mkdir(parents=True)
    (out / "eval_results.json").write_text(json.dumps({"task": "squad", "version": "1.1", "exact_match": 70.0,
                                                       "f1": 80.0, "eval_examples": 632}))
    mrpc, squad = summarize(recipe, tmp_path)["tasks"]
    f1, acc = mrpc["metrics"]
    assert (f1["split"], f1["metric"], f1["paper"], f1["majority_baseline"], f1["examples"]) == ("dev", "f1", 0.889,
                                                                                                None, 408)
    assert acc["metric"] == "accuracy" and acc["majority_baseline"] == 0.684 and acc["paper"] is None
    assert f1["by_init"]["pretrained"]["seeds"] == {"1": 0.80, "2": 0.84}
    assert f1["by_init"]["pretrained"]["mean"] == pytest.approx(0.82)
    assert f1["by_init"]["pretrained"]["std"] == pytest.approx(0.028284, rel=1e-4)  # sample sd of two seeds
    assert f1["by_init"]["random"]["max"] == 0.72
    em, sf1 = squad["metrics"]
    assert (em["split"], em["metric"], em["paper"], sf1["paper"], em["examples"]) == ("squad1.1", "exact_match", 80.8,
                                                                                     88.5, 632)
    assert set(em["by_init"]) == {"pretrained"}


def test_a_run_folder_of_another_command_is_refused(tmp_path, capsys):
    import json
    out = tmp_path / "run"
    out.mkdir()
    (out / "run.json").write_text(json.dumps({"run_id": "abc", "command": "pretrain", "started": "x"}))
    assert main(["run", str(DEFAULT), "--set", f"output_dir={out}"]) == 2
    assert f"run folder {out} holds the outputs of another command" in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == ["run.json"]  # nothing started


def test_a_pipeline_folder_is_a_run_that_other_commands_refuse_and_overwrite_moves_aside(tmp_path, capsys):
    import json
    from bertrain.utils.rundir import claim_run_folder, holds_run
    out = tmp_path / "run"
    (out / "vocab").mkdir(parents=True)
    (out / "run.json").write_text(json.dumps({"run_id": "abc", "command": "run", "started": "x"}))
    (out / "recipe.yaml").write_text("name: x\n")
    (out / "vocab" / "stage-started.json").write_text("{}")
    assert holds_run(out)
    assert main(["pretrain", "--config", "configs/quickstart.yaml", "--output_dir", str(out)]) == 2
    assert "holds run abc (`bertrain run`" in capsys.readouterr().err
    claim_run_folder(out, "run", None, overwrite=True)  # `bertrain run --overwrite`: start over
    assert [p.name for p in tmp_path.iterdir() if ".replaced-" in p.name] and not (out / "recipe.yaml").exists()
    capsys.readouterr()


def test_stages_are_grouped_for_the_trackers_under_the_recipe_unless_it_says_otherwise(tmp_path) -> None:
    from bertrain.pipeline.recipe import finetune_config, load_recipe, pretrain_config

    recipe = load_recipe(Path("configs/recipes/pydoc-small.yaml"))
    phase1 = pretrain_config(recipe, 1, tmp_path, tmp_path / "v.txt", tmp_path / "data", None)
    tune = finetune_config(recipe, 0, tmp_path / "init", tmp_path / "finetune-x-pretrained-s1" / "out", 1,
                           tmp_path / "task")
    assert (phase1.metrics.group, phase1.metrics.run_name) == ("pydoc-small", "pretrain-phase1")
    assert (tune.metrics.group, tune.metrics.run_name) == ("pydoc-small", "finetune-x-pretrained-s1")
    mine = load_recipe(Path("configs/recipes/pydoc-small.yaml"), ["pretrain.metrics.group=sweep-7"])
    assert pretrain_config(mine, 2, tmp_path, tmp_path / "v.txt", tmp_path / "data", None).metrics.group == "sweep-7"


def test_a_redo_names_the_nested_key_that_changed_not_a_cut_section(tmp_path):
    """The reason of a redone evaluate/report/random-init stage (shown by --dry-run and the log). Before, a nested
    section was cut at 40 characters on both sides: `recipe: {'name': 'pydoc-small', 'description'... ->
    {'name': 'pydoc-small', 'description'...`, the same text twice, and the key that changed unsaid."""
    from bertrain.pipeline.stages import _what_changed

    def stages(overrides: list[str]) -> dict:
        recipe = load_recipe(DEFAULT, [f"output_dir={tmp_path / 'run'}"] + overrides)
        return {s.name: s for s in build_stages(recipe)}

    base = stages([])
    cases = {"report.title=Mine": {"report": "recipe.report.title: '' -> 'Mine'"},
             "finetune[0].seeds=[1,2,3,4]": {"evaluate": "tasks[0][2]: [1, 2, 3] -> [1, 2, 3, 4]",
                                             "report": "recipe.finetune[0].seeds: [1, 2, 3] -> [1, 2, 3, 4]"},
             "pretrain.model.hidden_size=64": {
                 "finetune-pydoc-topics-random-s1": "random_init.model.hidden_size: 128 -> 64",
                 "report": "recipe.pretrain.model.hidden_size: 128 -> 64"}}
    for override, expected in cases.items():
        other = stages([override])
        for name, reason in expected.items():
            assert _what_changed(base[name].parts, other[name].parts).split("; ")[0] == reason, (override, name)
    # a list of sections that grows: the new element's keys and the length, not a cut list
    (task,) = yaml.safe_load(DEFAULT.read_text())["finetune"]
    two = stages(["finetune=" + yaml.safe_dump([task, {**task, "name": "again"}])])
    assert _what_changed(base["report"].parts, two["report"].parts).startswith(
        "recipe.finetune (length): 1 -> 2; recipe.finetune[1].config.data.max_seq_length: None -> 64; ")


def test_keys_added_since_do_not_redo_a_run_folder_of_before(tmp_path):
    """A run folder of an older bertrain is not redone for a key added since at the value that changes nothing
    (`optim.init_state` unset; `sample.document_separator` in an NSP run): the shipped recipe's stage settings
    hash as they did before those keys existed (digests of the code of 2026-11-27, before them). A packing run's
    separators change its rows: hashed."""
    from bertrain.pipeline.stages import _digest

    before = {"prepare": "036021eab368c93ba4c776eb10ef8e1a55b22d2cb2e2d7b66cc7a55de6954fbf",
              "pretrain-phase1": "e135d7e2b0d3e392a28011473660a745169fc36a00ad7aa653a8011a83f89dde",
              "pretrain-phase2": "5b7b69174939f0d64de51b76b6d151a6e7ed405ee42f75ed262e91364815e22f",
              "finetune-pydoc-topics-pretrained-s1": "09ba7218ee646c45723ccce394eebb618f60d8a5b7cd09fa7824398d6e6291a0",
              "finetune-pydoc-topics-random-s3": "dee8c24c9ca13ed4db285f4690cfbcff6d6deaa2a549e453d786f036e198cae5"}
    stages = {s.name: s for s in build_stages(load_recipe(DEFAULT, [f"output_dir={tmp_path / 'run'}"]))}
    assert {name: _digest(stages[name].settings) for name in before} == before
    packing = {s.name: s for s in build_stages(load_recipe(DEFAULT, [
        f"output_dir={tmp_path / 'run'}", "pretrain.sample.next_sentence=false"]))}
    assert packing["pretrain-phase1"].settings["sample.document_separator"] is True
    moments = {s.name: s for s in build_stages(load_recipe(DEFAULT, [
        f"output_dir={tmp_path / 'run'}", "phase2.optim.init_state=phase1"]))}
    assert moments["pretrain-phase2"].settings["optim.init_state"] == "$RUN/pretrain-phase1"
    assert _digest(moments["pretrain-phase1"].settings) == before["pretrain-phase1"]


def test_a_stopped_fine_tuning_stage_says_how_bertrain_run_continues() -> None:
    """The engine's advice ("continue with the same command and --resume auto") is no `bertrain run` flag."""
    import types

    from bertrain.pipeline.stages import _stage_stop
    from bertrain.utils.errors import RunStopped

    stage = types.SimpleNamespace(name="finetune-pydoc-topics-pretrained-s1")
    with pytest.raises(RunStopped) as e, _stage_stop(stage):
        raise RunStopped("stopped by a signal at step 6 after saving out/step-6 (...); continue with the same "
                         "command and --resume auto", checkpoint=Path("out/step-6"))
    assert str(e.value) == ("stage finetune-pydoc-topics-pretrained-s1: stopped by a signal at step 6 after saving "
                            "out/step-6 (...); run the same `bertrain run` again to continue")
    assert e.value.checkpoint == Path("out/step-6")


def test_the_process_group_keys_set_under_pretrain_hold_for_every_stage(tmp_path) -> None:
    """`--set pretrain.distributed.timeout_s=900` was refused ("... differs from the recipe's
    pretrain.distributed.timeout_s (900) ... set the key there only") because the fine-tuning stages kept 300."""
    from bertrain.pipeline.stages import check_settings

    recipe = load_recipe(DEFAULT, [f"output_dir={tmp_path}", "pretrain.distributed.timeout_s=900",
                                   "pretrain.distributed.backend=gloo"])
    stages = build_stages(recipe)
    group = check_settings(recipe, stages)
    assert (group.timeout_s, group.backend) == (900, "gloo")
    assert {(s.config.distributed.timeout_s, s.config.distributed.backend) for s in stages if s.parallel} == \
        {(900, "gloo")}
    recipe = load_recipe(DEFAULT, [f"output_dir={tmp_path}", "pretrain.distributed.timeout_s=900",
                                   "finetune[0].config.distributed.timeout_s=60"])
    with pytest.raises(UserError, match="distributed.timeout_s = 60 differs from the recipe's "
                                        r"pretrain.distributed.timeout_s \(900\)"):
        check_settings(recipe, build_stages(recipe))


@pytest.mark.parametrize("phase", ["phase1", "phase2"])
def test_a_phase_longer_than_the_models_positions_is_refused_before_any_work(tmp_path, phase) -> None:
    """Phase 2's over-long samples were found when phase 2 began, after phase 1 (hours for BERT-base), and named
    the engine's key; the dry run accepted them."""
    with pytest.raises(UserError, match=f"recipe key {phase}.sample.max_seq_length: 1024 exceeds the 512 positions"):
        build_stages(load_recipe(DEFAULT, [f"output_dir={tmp_path}", f"{phase}.sample.max_seq_length=1024"]))
