"""The shipped configs and recipes against the systems they reproduce (NVIDIA's DeepLearningExamples BERT, the BERT
paper, google-research/bert), and the config loader's behaviour around them: duplicate keys, `~` / `$VAR` in paths,
the error of a recipe stage left without a required key."""
from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from bertrain.config import config_keys, load_config, load_file
from bertrain.pipeline.recipe import finetune_config, load_recipe, pretrain_config
from bertrain.tasks.finetune import GlueFinetuneConfig, SquadFinetuneConfig
from bertrain.tasks.pretraining import PretrainConfig
from bertrain.train.config import resolve_batch
from bertrain.train.schedules import LRMultiplier
from bertrain.utils.errors import UserError

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"


def _comment_command(path: Path) -> list[str]:
    """The `bertrain pretrain ...` command written in the comment of a config file (with its `\\` continuations)."""
    lines = [line.lstrip("#").strip() for line in path.read_text().splitlines() if line.startswith("#")]
    start = next(i for i, line in enumerate(lines) if line.startswith("bertrain pretrain"))
    words = []
    for line in lines[start:]:
        words.append(line.rstrip("\\").strip())
        if not line.endswith("\\"):
            break
    return shlex.split(" ".join(words))


def _overrides(argv: list[str]) -> tuple[str, dict[str, str]]:
    """(--config, the dotted overrides) of a `bertrain pretrain` command line."""
    args = argv[2:]
    pairs = dict(zip(args[::2], args[1::2]))
    assert all(k.startswith("--") for k in pairs), argv
    return pairs.pop("--config"), {k[2:]: v for k, v in pairs.items()}


# ----------------------------------------------------------------------------------------------- the BERT paper

def test_paper_adamw_config_is_900k_at_128_then_100k_at_512_on_one_lr_line() -> None:
    """The paper: 1M steps at batch 256, 90% at length 128 and 10% at 512, lr 1e-4, 10k warmup then linear decay.
    The file ran 1M steps at 128 and then told the user to add 100k at 512 (1.1M in all, the schedule restarted
    with a second warmup to 1e-4), into the folder that phase 1 had finished in (refused)."""
    path = CONFIGS / "bert-base-adamw-256.yaml"
    p1 = load_config(PretrainConfig, path)
    config, overrides = _overrides(_comment_command(path))
    assert Path(config).name == path.name
    p2 = load_config(PretrainConfig, path, overrides)
    assert (p1.sample.max_seq_length, p2.sample.max_seq_length) == (128, 512)
    assert (p1.sample.max_predictions_per_seq, p2.sample.max_predictions_per_seq) == (20, 80)
    assert p1.train.steps + p2.train.steps == 1_000_000 and p2.train.steps == 100_000
    assert p1.train.global_batch_size == p2.train.global_batch_size == 256
    assert p2.model.init == f"{p1.output_dir}/final" and p2.optim.init_state == p1.output_dir
    assert p2.output_dir != p1.output_dir  # phase 1's folder is finished: a run into it is refused
    # the two schedules together follow the paper's one line: 10k warmup to 1e-4, then linear to 0 at 1M (the
    # paper's decay spans all 1M steps, bertrain's linear the steps after warmup: within 1% of the peak)
    f1, f2 = LRMultiplier(p1.schedule, p1.train.steps), LRMultiplier(p2.schedule, p2.train.steps)
    for t in range(10_000, 1_000_000, 10_000):
        lr = p1.optim.lr * f1(t) if t < p1.train.steps else p2.optim.lr * f2(t - p1.train.steps)
        assert lr == pytest.approx(1e-4 * (1 - t / 1_000_000), abs=1e-6), t
    assert p1.optim.lr * f1(p1.train.steps - 1) == pytest.approx(p2.optim.lr * f2(0), rel=2e-5)
    assert (p1.optim.name, p1.optim.betas, p1.optim.weight_decay, p1.optim.eps) == ("adamw", (0.9, 0.999), 0.01, 1e-6)
    assert p1.optim.bias_correction is False and p1.schedule.warmup == 10_000


# ----------------------------------------------------------------------------------------------- NVIDIA's recipe

NVIDIA = {  # DeepLearningExamples/PyTorch/LanguageModeling/BERT/scripts/configs/pretrain_config.sh (dgxa100_8gpu)
    1: dict(seq=128, preds=20, batch=8192 * 8, lr=6e-3, warmup=0.2843, steps=7038),
    2: dict(seq=512, preds=80, batch=4096 * 8, lr=4e-3, warmup=0.128, steps=1563),
}


def _numbers(cfg: PretrainConfig) -> dict:
    return dict(seq=cfg.sample.max_seq_length, preds=cfg.sample.max_predictions_per_seq,
                batch=cfg.train.global_batch_size, lr=cfg.optim.lr, warmup=cfg.schedule.warmup, steps=cfg.train.steps)


@pytest.mark.parametrize("size", ["base", "large"])
def test_recipe_phases_equal_the_standalone_nvidia_configs(size: str, tmp_path: Path) -> None:
    """`bertrain run configs/recipes/bert-SIZE.yaml` and `bertrain pretrain --config configs/bert-SIZE-phaseN.yaml`
    claim the same recipe: every training number of each phase is the same, and NVIDIA's."""
    recipe = load_recipe(CONFIGS / "recipes" / f"bert-{size}.yaml")
    for phase in (1, 2):
        alone = load_config(PretrainConfig, CONFIGS / f"bert-{size}-phase{phase}.yaml")
        init = tmp_path / "pretrain-phase1" / "final" if phase == 2 else None
        staged = pretrain_config(recipe, phase, tmp_path, tmp_path / "vocab.txt", tmp_path / "data", init)
        assert _numbers(alone) == _numbers(staged) == NVIDIA[phase]
        for cfg in (alone, staged):
            assert cfg.model.preset == size and (cfg.optim.name, cfg.schedule.name, cfg.schedule.power) == (
                "nvlamb", "poly", 0.5)
            assert (cfg.optim.betas, cfg.optim.eps, cfg.optim.weight_decay, cfg.optim.max_grad_norm) == (
                (0.9, 0.999), 1e-6, 0.01, 1.0)
            assert (cfg.optim.min_trust_ratio, cfg.optim.max_trust_ratio) == (0.0, float("inf"))
            assert cfg.train.micro_batch_size == alone.train.micro_batch_size
            assert resolve_batch(cfg.train, 8).global_batch_size == NVIDIA[phase]["batch"]
        if phase == 2:  # NVIDIA's phase 2 continues phase 1's LAMB moments
            assert alone.optim.init_state and staged.optim.init_state == str(tmp_path / "pretrain-phase1")


@pytest.mark.parametrize("size", ["base", "large"])
def test_recipe_finetuning_follows_the_paper(size: str, tmp_path: Path) -> None:
    """GLUE: batch 32, 3 epochs, lr among 5e-5/4e-5/3e-5/2e-5 chosen on dev, 10% warmup, length 128, for every task
    (the `<<: *glue` merge is one level deep: each task's `data:` must repeat the length); SQuAD v1.1: batch 32,
    2 epochs at 3e-5, 384 / 128 / 64."""
    recipe = load_recipe(CONFIGS / "recipes" / f"bert-{size}.yaml")
    assert recipe.report.paper_model == size
    kinds = set()
    for i, task in enumerate(recipe.finetune):
        cfg = finetune_config(recipe, i, tmp_path / "init", tmp_path / "out", task.seeds[0], None)
        kinds.add(task.kind)
        assert (cfg.train.global_batch_size, cfg.schedule.name, cfg.schedule.warmup, cfg.optim.weight_decay) == (
            32, "linear", 0.1, 0.01)
        if task.kind == "glue":
            assert isinstance(cfg, GlueFinetuneConfig) and cfg.data.task == task.name
            assert "max_seq_length" in task.config["data"], task.name  # not a default that happens to agree
            assert (cfg.train.epochs, cfg.data.max_seq_length) == (3.0, 128)
            assert task.search is not None and task.search.grid == {"optim.lr": [5e-5, 4e-5, 3e-5, 2e-5]}
        else:
            assert isinstance(cfg, SquadFinetuneConfig) and task.search is None
            assert (cfg.train.epochs, cfg.optim.lr) == (2.0, 3e-5)
            assert (cfg.data.max_seq_length, cfg.data.doc_stride, cfg.data.max_query_length) == (384, 128, 64)
    assert kinds == {"glue", "squad"}
    assert sorted(t.name for t in recipe.finetune if t.kind == "glue") == sorted(
        ["mnli", "qqp", "qnli", "sst2", "cola", "stsb", "mrpc", "rte"])


def test_readme_pretrain_flags_are_config_keys() -> None:
    """Every `--section.key` the README writes on a `bertrain pretrain` line is a key of PretrainConfig."""
    known = set(config_keys(PretrainConfig))
    text = (ROOT / "README.md").read_text().replace("\\\n", " ")
    lines = [line for line in text.splitlines() if "bertrain pretrain" in line]
    flags = {m for line in lines for m in re.findall(r"--([a-z_]+\.[a-z_.]+)", line)}
    assert flags and not flags - known, flags - known
    named = {m for line in lines for m in re.findall(r"--config ([\w./-]+)", line)}
    assert named and all((ROOT / n).is_file() for n in named), named


# ----------------------------------------------------------------------------------------------- duplicate keys

def test_a_section_written_twice_in_a_file_is_refused_not_replaced(tmp_path: Path) -> None:
    """PyYAML keeps the last of two equal keys: a second `optim:` dropped the first one's lr and optimizer, and the
    run trained with adamw at 1e-4 without a word."""
    path = tmp_path / "c.yaml"
    path.write_text("optim:\n  name: lamb\n  lr: 5.0e-3\ntrain: {steps: 5}\noptim:\n  weight_decay: 0.0\n"
                    "data: {synthetic_samples: 16}\n")
    with pytest.raises(ValueError) as e:
        load_config(PretrainConfig, path)
    assert str(path) in str(e.value) and "line 5" in str(e.value) and "'optim'" in str(e.value)
    assert "first at line 1" in str(e.value)
    path.write_text("optim:\n  lr: 1.0e-3\n  lr: 2.0e-3\n")
    with pytest.raises(ValueError, match=r"line 3, column 3: key 'lr' is written twice"):
        load_file(path)
    js = tmp_path / "c.json"
    js.write_text(json.dumps({"train": {"steps": 5}})[:-1] + ', "train": {"steps": 6}}')
    with pytest.raises(ValueError, match=r"c\.json: key 'train' is written twice"):
        load_file(js)


def test_yaml_merge_keys_and_anchors_still_load(tmp_path: Path) -> None:
    """`<<: *anchor` with an explicit key that overrides a merged one is no duplicate, also when the anchored
    mapping itself merges another and is defined deeper than where it is used."""
    path = tmp_path / "r.yaml"
    path.write_text("a:\n  deep: &g {<<: &b {lr: 1, x: 0}, lr: 2}\nc: {<<: *g, lr: 3}\nd: *b\n")
    assert load_file(path) == {"a": {"deep": {"lr": 2, "x": 0}}, "c": {"lr": 3, "x": 0}, "d": {"lr": 1, "x": 0}}
    for name in ("bert-base", "bert-large", "pydoc-small"):
        load_file(CONFIGS / "recipes" / f"{name}.yaml")


# ----------------------------------------------------------------------------------------------- paths

def test_tilde_and_env_vars_expand_in_path_keys_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`output_dir: ~/runs/x` in a file wrote to a folder named `~` in the working directory, `$SCRATCH/...` to one
    named `$SCRATCH`; the shell expands them on the command line, the loader now does in files too."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("BT_DATA", str(tmp_path / "data"))
    path = tmp_path / "c.yaml"
    path.write_text("data:\n  prepared: ${BT_DATA}/pretrain\noutput_dir: ~/runs/x\ntrain: {steps: 5}\n"
                    "metrics: {run_name: $BT_DATA}\n")
    cfg = load_config(PretrainConfig, path)
    assert cfg.output_dir == str(tmp_path / "home" / "runs" / "x")
    assert cfg.data.prepared == str(tmp_path / "data" / "pretrain")
    assert cfg.metrics.run_name == "$BT_DATA"  # not a path: as written
    cfg = load_config(PretrainConfig, path, {"model.init": "~/m", "data.input": "$BT_DATA/a.txt,b.txt"})
    assert cfg.model.init == str(tmp_path / "home" / "m")
    assert cfg.data.input == [str(tmp_path / "data" / "a.txt"), "b.txt"]
    with pytest.raises(ValueError) as e:
        load_config(PretrainConfig, path, {"output_dir": "$BT_UNSET_X/r"})
    assert "'output_dir'" in str(e.value) and "BT_UNSET_X" in str(e.value) and "not set" in str(e.value)
    assert "command line" in str(e.value)


def test_recipe_paths_expand_and_an_unset_variable_names_the_recipe_key(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("BT_CORPUS", str(tmp_path / "corpus"))
    path = tmp_path / "r.yaml"
    path.write_text("name: t\noutput_dir: ~/runs/t\ndata: {input: [$BT_CORPUS/a.txt, builtin:python-docs]}\n"
                    "phase1: {train: {steps: 2}}\nphase2: null\n")
    recipe = load_recipe(path)
    assert recipe.run_dir == tmp_path / "home" / "runs" / "t"
    assert recipe.data.input == [str(tmp_path / "corpus" / "a.txt"), "builtin:python-docs"]
    with pytest.raises(UserError, match=r"recipe key 'data\.input\[0\]'.*BT_NOPE_Y.*not set"):
        load_recipe(path, ["data.input=[$BT_NOPE_Y/a.txt]"])


# ----------------------------------------------------------------------------------------------- recipe errors

def test_a_recipe_stage_missing_a_required_key_names_its_section_not_cli_flags(tmp_path: Path) -> None:
    """A phase 2 left without train.steps said "recipe: config keys 'train.steps' ... — no --config was given: use a
    config file (e.g. --config configs/quickstart.yaml) or set --train.steps ... on the command line": no phase
    named, and flags that `bertrain run` does not have."""
    path = tmp_path / "r.yaml"
    path.write_text("name: t\ndata: {input: [builtin:python-docs]}\nphase1: {train: {steps: 2}}\n")
    recipe = load_recipe(path)
    pretrain_config(recipe, 1, tmp_path, tmp_path / "v.txt", tmp_path / "d", None)  # phase 1 is complete
    with pytest.raises(UserError) as e:
        pretrain_config(recipe, 2, tmp_path, tmp_path / "v.txt", tmp_path / "d", tmp_path / "final")
    message = str(e.value)
    assert message.startswith("recipe section 'phase2': ") and "train.steps" in message
    assert "--config" not in message and "--train.steps" not in message
