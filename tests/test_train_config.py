"""Configs: every shipped recipe loads strictly with the values it promises; bad values name their key; keys that
moved (`distributed.strategy` -> `parallelism.strategy`) still read, in files, on the command line, in recipes and
in a checkpoint's saved config; the batch arithmetic; launcher environments (torchrun, Slurm, Open MPI, PMI)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from bertrain.config import load_config, to_dict
from bertrain.tasks.pretraining import PretrainConfig
from bertrain.train.config import TrainConfig, resolve_batch
from bertrain.train.launch import first_slurm_host, launch_env
from bertrain.utils.errors import UserError

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
RECIPES = {
    # file: (preset, global batch, lr, warmup, steps, seq, preds, optimizer, schedule)
    "bert-base-phase1.yaml": ("base", 65536, 6e-3, 0.2843, 7038, 128, 20, "nvlamb", "poly"),
    "bert-base-phase2.yaml": ("base", 32768, 4e-3, 0.128, 1563, 512, 80, "nvlamb", "poly"),
    "bert-large-phase1.yaml": ("large", 65536, 6e-3, 0.2843, 7038, 128, 20, "nvlamb", "poly"),
    "bert-large-phase2.yaml": ("large", 32768, 4e-3, 0.128, 1563, 512, 80, "nvlamb", "poly"),
    "bert-base-adamw-256.yaml": ("base", 256, 1e-4, 10000, 900_000, 128, 20, "adamw", "linear"),  # + 100k at 512
}


def test_every_shipped_config_loads() -> None:
    files = sorted(p.name for p in CONFIGS.glob("*.yaml") if not p.name.startswith("finetune"))  # theirs: tasks tests
    assert set(RECIPES) | {"quickstart.yaml"} <= set(files)
    for name in files:
        load_config(PretrainConfig, CONFIGS / name)  # strict: an unknown key or wrong type raises


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_recipe_values(name: str) -> None:
    preset, batch, lr, warmup, steps, seq, preds, optim, schedule = RECIPES[name]
    cfg = load_config(PretrainConfig, CONFIGS / name)
    assert (cfg.model.preset, cfg.train.global_batch_size, cfg.optim.lr, cfg.schedule.warmup, cfg.train.steps,
            cfg.sample.max_seq_length, cfg.sample.max_predictions_per_seq, cfg.optim.name, cfg.schedule.name) == (
        preset, batch, lr, warmup, steps, seq, preds, optim, schedule)
    assert cfg.optim.weight_decay == 0.01 and not cfg.optim.scale_lr_with_batch
    if "phase2" in name:
        assert cfg.model.init == f"runs/{name.replace('phase2.yaml', 'phase1')}/final"
        assert cfg.schedule.power == 0.5
    if "adamw" in name:
        assert cfg.optim.bias_correction is False
    plan = resolve_batch(cfg.train, 8)  # on 8 GPUs the accumulation is derived exactly
    assert plan.micro_batch_size * plan.accumulation * 8 == batch


def test_quickstart_prepares_builtin_corpus() -> None:
    cfg = load_config(PretrainConfig, CONFIGS / "quickstart.yaml")
    assert cfg.data.input == ["builtin:python-docs"] and cfg.data.prepared is None
    assert cfg.data.masking == "dynamic" and cfg.sample.max_seq_length == 128
    assert cfg.checkpoint.export_final and cfg.precision.mode == "fp32"


@pytest.mark.parametrize("override,key", [
    ({"optim.lr": "-1"}, "optim.lr"),
    ({"optim.betas": "[0.9, 1.5]"}, "optim.betas"),
    ({"optim.name": "sgd"}, "optim.name"),
    ({"optim.min_trust_ratio": "5", "optim.max_trust_ratio": "1"}, "optim.min_trust_ratio"),
    ({"schedule.name": "step"}, "schedule.name"),
    ({"schedule.decay_rate": "0"}, "schedule.decay_rate"),
    ({"precision.mode": "fp8"}, "precision.mode"),
    ({"train.micro_batch_size": "0"}, "train.micro_batch_size"),
    ({"train.steps": "0", "train.epochs": "0"}, "train.steps"),
    ({"train.steps": "ten"}, "train.steps"),
    ({"data.masked_lm_prob": "1.5"}, "data.masked_lm_prob"),
    ({"sample.max_predictions_per_seq": "200"}, "max_predictions_per_seq"),
    ({"model.dropout": "1.0"}, "model.dropout"),
    ({"checkpoint.keep_lst": "2"}, "checkpoint.keep_lst"),
    ({"distributed.backend": "mpi"}, "distributed.backend"),
])
def test_bad_values_name_the_key(override: dict, key: str) -> None:
    base = {"train.steps": "10", "data.synthetic_samples": "64"}
    with pytest.raises(ValueError, match=key.replace(".", r"\.")) as e:
        load_config(PretrainConfig, None, {**base, **override})
    assert "on the command line" in str(e.value)  # where the bad value came from, not a file


def test_command_line_overrides_every_section() -> None:
    cfg = load_config(PretrainConfig, CONFIGS / "quickstart.yaml", {
        "output_dir": "/tmp/x", "model.preset": "tiny", "train.steps": "7", "train.micro_batch_size": "4",
        "train.accumulation": "2", "train.global_batch_size": "0", "precision.mode": "bf16", "optim.name": "lamb",
        "seed": "3", "checkpoint.save_interval": "5", "data.input": "a.txt,b.txt"})
    assert (cfg.output_dir, cfg.model.preset, cfg.train.steps, cfg.train.micro_batch_size, cfg.train.accumulation,
            cfg.precision.mode, cfg.optim.name, cfg.seed, cfg.checkpoint.save_interval, cfg.data.input) == (
        "/tmp/x", "tiny", 7, 4, 2, "bf16", "lamb", 3, 5, ["a.txt", "b.txt"])


# ----------------------------------------------------------------------------------------------- moved keys

OLD_PARALLELISM = {"strategy": "fsdp", "reshard_after_forward": False, "fsdp_param_dtype": "bf16",
                   "fsdp_reduce_dtype": "bf16", "dp_shard": 2}
NEW_PARALLELISM = {"strategy": "fsdp", "reshard_after_forward": False, "param_dtype": "bf16", "reduce_dtype": "bf16",
                   "dp_shard": 2}


@pytest.fixture
def deprecations(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture):
    """The deprecation lines logged (each is said once per process: start from none said)."""
    import bertrain.config as C
    monkeypatch.setattr(C, "_deprecation_said", set())
    return lambda: [r.getMessage() for r in caplog.records if "deprecated" in r.getMessage()]


def _run(**sections: dict) -> dict:
    return {"train": {"steps": 10}, "data": {"synthetic_samples": 64}, "output_dir": "out", **sections}


def test_moved_parallelism_keys_in_a_file_are_read_with_one_line_each(tmp_path: Path, deprecations) -> None:
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump(_run(distributed={"timeout_s": 120, **OLD_PARALLELISM})))
    for _ in range(2):  # said once, however often a config is loaded
        cfg = load_config(PretrainConfig, path)
        assert to_dict(cfg.parallelism) == NEW_PARALLELISM and cfg.distributed.timeout_s == 120
    lines = deprecations()
    assert len(lines) == 5
    assert f"config key 'distributed.strategy' (in {path}) is deprecated: read as 'parallelism.strategy', its new " \
           "name" in lines
    assert any("'distributed.fsdp_param_dtype'" in line and "'parallelism.param_dtype'" in line for line in lines)


def test_moved_keys_on_the_command_line(deprecations, capsys: pytest.CaptureFixture) -> None:
    from bertrain.cli import build_parser
    from bertrain.config import overrides_from_args
    argv = ["pretrain", "--train.steps", "10", "--data.synthetic_samples", "64", "--distributed.strategy", "fsdp",
            "--distributed.dp_shard", "2", "--parallelism.reduce_dtype", "bf16"]
    args = build_parser(argv).parse_args(argv)
    cfg = load_config(PretrainConfig, None, overrides_from_args(args))
    assert (cfg.parallelism.strategy, cfg.parallelism.dp_shard, cfg.parallelism.reduce_dtype) == ("fsdp", 2, "bf16")
    assert deprecations() == [
        "config key 'distributed.strategy' (on the command line) is deprecated: read as 'parallelism.strategy', its "
        "new name",
        "config key 'distributed.dp_shard' (on the command line) is deprecated: read as 'parallelism.dp_shard', its "
        "new name"]
    with pytest.raises(SystemExit):  # --help lists the new keys only
        build_parser(["pretrain", "--help"]).parse_args(["pretrain", "--help"])
    shown = capsys.readouterr().out
    assert "--parallelism.dp_shard" in shown and "--distributed.dp_shard" not in shown
    # a later source wins, whichever spelling each used
    cfg = load_config(PretrainConfig, None, {"train.steps": "10", "data.synthetic_samples": "64",
                                             "parallelism.strategy": "fsdp"},
                      base={"distributed": {"strategy": "ddp"}})
    assert cfg.parallelism.strategy == "fsdp"


@pytest.mark.parametrize("where", ["file", "command line"])
def test_an_old_and_a_new_key_that_disagree_are_refused_naming_both(tmp_path: Path, where: str) -> None:
    path = tmp_path / "both.yaml"
    both = ("config keys 'distributed.strategy' ('fsdp') and 'parallelism.strategy' ('ddp') are both set "
            f"({'in ' + str(path) if where == 'file' else 'on the command line'}): 'distributed.strategy' is the old "
            "name of 'parallelism.strategy'; keep only 'parallelism.strategy'")
    with pytest.raises(ValueError, match=re.escape(both)):
        if where == "file":
            path.write_text(yaml.safe_dump(_run(distributed={"strategy": "fsdp"}, parallelism={"strategy": "ddp"})))
            load_config(PretrainConfig, path)
        else:
            load_config(PretrainConfig, None, {"train.steps": "10", "data.synthetic_samples": "64",
                                               "distributed.strategy": "fsdp", "parallelism.strategy": "ddp"})
    # the same value twice is only redundant
    cfg = load_config(PretrainConfig, None, {"train.steps": "10", "data.synthetic_samples": "64",
                                             "distributed.strategy": "fsdp", "parallelism.strategy": "fsdp"})
    assert cfg.parallelism.strategy == "fsdp"


def test_moved_keys_in_a_recipe(deprecations) -> None:
    from bertrain.pipeline.recipe import engine_config
    sections = [("pretrain", {"distributed": {"strategy": "fsdp", "timeout_s": 100}}),
                ("phase1", _run(distributed={"reshard_after_forward": False}))]
    cfg = engine_config(PretrainConfig, sections, {})
    assert (cfg.parallelism.strategy, cfg.parallelism.reshard_after_forward, cfg.distributed.timeout_s) == (
        "fsdp", False, 100)
    assert [line.split(" is deprecated")[0] for line in deprecations()] == [
        "config key 'distributed.strategy' (in recipe section pretrain)",
        "config key 'distributed.reshard_after_forward' (in recipe section phase1)"]
    # an error names the recipe section that set the value (and the key by its new name)
    with pytest.raises(ValueError, match=r"recipe key 'phase1.parallelism.dp_shard' must be >= 0"):
        engine_config(PretrainConfig, [("phase1", _run(distributed={"dp_shard": -1}))], {})


def test_a_checkpoint_saved_before_the_move_resumes_without_bogus_changes(tmp_path: Path, deprecations,
                                                                            caplog: pytest.LogCaptureFixture) -> None:
    """A checkpoint's config.yaml with the old `distributed.strategy` layout, compared with today's config."""
    import logging
    from bertrain.train.resume import check_config

    cfg = load_config(PretrainConfig, None, {"train.steps": "10", "data.synthetic_samples": "64",
                                             "parallelism.strategy": "fsdp"})

    def saved_before_the_move(**parallelism: object) -> Path:
        old = to_dict(cfg)
        moved = dict(old.pop("parallelism"), **parallelism)
        old["distributed"].update(strategy=moved["strategy"], reshard_after_forward=moved["reshard_after_forward"],
                                  fsdp_param_dtype=moved["param_dtype"], fsdp_reduce_dtype=moved["reduce_dtype"],
                                  dp_shard=moved["dp_shard"])
        step = tmp_path / f"step-{len(list(tmp_path.iterdir())) + 1}"
        step.mkdir()
        (step / "config.yaml").write_text(yaml.safe_dump(old, sort_keys=False))
        return step

    with caplog.at_level(logging.INFO, logger="bertrain"):
        assert check_config(saved_before_the_move(), cfg, allow_change=False) == {}
    assert "resuming with" not in caplog.text and deprecations() == []  # nothing changed; nothing to fix there
    with caplog.at_level(logging.INFO, logger="bertrain"):  # ddp -> fsdp keeps the run: taken, named by its new key
        assert check_config(saved_before_the_move(strategy="ddp"), cfg, allow_change=False) == {}
    assert "resuming with parallelism.strategy = 'fsdp' (was 'ddp')" in caplog.text
    with pytest.raises(UserError, match=r"parallelism.reduce_dtype: 'bf16' -> 'fp32'"):  # changes the run: refused
        check_config(saved_before_the_move(reduce_dtype="bf16"), cfg, allow_change=False)


def test_batch_arithmetic() -> None:
    t = TrainConfig(steps=1, global_batch_size=256, micro_batch_size=32)
    assert [resolve_batch(t, w).accumulation for w in (1, 2, 4, 8)] == [8, 4, 2, 1]
    with pytest.raises(ValueError, match="train.global_batch_size.*train.micro_batch_size.*change one of them$"):
        resolve_batch(t, 3)  # 256 is not a multiple of 32 x 3
    # a global batch below the micro batch x ranks: each rank takes its share, no accumulation (the same config
    # on 1 and N processes; it was refused, naming the micro batch to set)
    plan = resolve_batch(TrainConfig(steps=1, global_batch_size=16), 2)  # the default micro batch is 32
    assert (plan.micro_batch_size, plan.accumulation, plan.global_batch_size) == (8, 1, 16)
    assert resolve_batch(TrainConfig(steps=1, global_batch_size=16, micro_batch_size=16), 1).micro_batch_size == 16
    with pytest.raises(ValueError, match=r"\(15\) must be divisible .* x world size \(2\)"):
        resolve_batch(TrainConfig(steps=1, global_batch_size=15), 2)  # no equal share per rank
    with pytest.raises(ValueError, match="train.accumulation"):
        resolve_batch(TrainConfig(steps=1, global_batch_size=256, micro_batch_size=32, accumulation=3), 1)
    assert resolve_batch(TrainConfig(steps=1, micro_batch_size=8, accumulation=3), 2).global_batch_size == 48


def test_launcher_environments() -> None:
    assert launch_env({}) is None
    e = launch_env({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "n1", "MASTER_PORT": "1234"})
    assert (e.rank, e.world_size, e.local_rank, e.master_addr, e.master_port, e.launcher) == (3, 8, 1, "n1", 1234,
                                                                                               "torchrun")
    e = launch_env({"SLURM_PROCID": "5", "SLURM_NTASKS": "16", "SLURM_STEP_NUM_TASKS": "16", "SLURM_LOCALID": "1",
                    "SLURM_JOB_NODELIST": "gpu[07-08,11]", "SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "3"})
    assert (e.rank, e.world_size, e.local_rank, e.master_addr, e.master_port, e.launcher) == (
        5, 16, 1, "gpu07", 15000 + (4242 * 8 + 3) % 20000, "slurm")
    # the batch script of a 1-task job is one process, not a launcher
    assert launch_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_JOB_ID": "7"}) is None
    e = launch_env({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "2",
                    "OMPI_COMM_WORLD_LOCAL_SIZE": "4"})
    assert (e.rank, e.world_size, e.local_rank, e.master_addr, e.launcher) == (2, 4, 2, "127.0.0.1", "openmpi")
    with pytest.raises(ValueError, match="MASTER_ADDR"):  # several nodes and no master given
        launch_env({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_SIZE": "4"})
    e = launch_env({"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MASTER_ADDR": "head"})
    assert (e.rank, e.world_size, e.local_rank, e.master_addr, e.launcher) == (1, 2, 1, "head", "pmi")


@pytest.mark.parametrize("env, names", [
    ({"RANK": "0"}, "WORLD_SIZE"),
    ({"WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, "RANK"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}, "MASTER_ADDR, MASTER_PORT"),
    ({"RANK": "2", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, "rank 2"),
    ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "h",
      "MASTER_PORT": "1"}, "LOCAL_RANK=2"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "h", "MASTER_PORT": "70000"}, "MASTER_PORT"),
    ({"RANK": "0", "WORLD_SIZE": "zwei"}, "WORLD_SIZE='zwei'"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_JOB_ID": "7"}, "srun"),
    ({"SLURM_PROCID": "4", "SLURM_STEP_NUM_TASKS": "4"}, "SLURM_PROCID, SLURM_STEP_NUM_TASKS"),
    ({"OMPI_COMM_WORLD_RANK": "0"}, "OMPI_COMM_WORLD_SIZE"),
    ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "0"}, "OMPI_COMM_WORLD_SIZE=0"),
])
def test_launcher_environment_errors_name_the_variable(env: dict[str, str], names: str) -> None:
    with pytest.raises(ValueError, match=re.escape(names)):
        launch_env(env)


def test_layout_check_and_description() -> None:
    from bertrain.train.launch import LaunchEnv, check_layout, describe_layout
    ranks = [{"pid": 10 + r, "host": "n1", "local_rank": r, "launcher": "openmpi", "device": "cpu"} for r in (0, 1)]
    check_layout(ranks)
    text = describe_layout(LaunchEnv(0, 2, 0, "n1", 1234, "openmpi"), "gloo", ranks)
    assert text.splitlines() == ["launched by openmpi: world size 2, master n1:1234, gloo backend",
                                 "  rank 0: local rank 0 on n1 (pid 10, cpu)", "  rank 1: local rank 1 on n1 (pid 11, cpu)"]
    check_layout([dict(ranks[0]), dict(ranks[1], local_rank=0)])  # CPU ranks may share a local rank
    gpus = [dict(r, device=f"cuda:{r['local_rank']}") for r in ranks]
    check_layout(gpus)
    with pytest.raises(ValueError, match="ranks 0 and 1 both use cuda:0 on host n1"):
        check_layout([gpus[0], dict(gpus[1], device="cuda:0")])
    # Slurm's --gpus-per-task: each task sees its own GPU as cuda:0; the physical GPU decides (before: refused)
    per_task = [dict(r, device="cuda:0", gpu=f"GPU-{r['local_rank']}") for r in ranks]
    check_layout(per_task)
    with pytest.raises(ValueError, match=r"ranks 0 and 1 both use cuda:0 \(GPU GPU-0\) on host n1"):
        check_layout([per_task[0], dict(per_task[1], gpu="GPU-0")])
    with pytest.raises(ValueError, match="different launchers"):
        check_layout([dict(ranks[0]), dict(ranks[1], launcher="torchrun")])
    # another environment on one node: every rank names the ranks and hosts of each version
    soft = [dict(r, host=h, software="bertrain 0.1.0, torch 2.11.0") for r, h in zip(ranks * 2, ["n1"] * 2 + ["n2"] * 2)]
    check_layout(soft)
    soft[3]["software"] = soft[2]["software"] = "bertrain 0.1.0, torch 2.10.0"
    with pytest.raises(ValueError) as err:
        check_layout(soft)
    assert str(err.value) == ("the ranks run different software: ranks 0-1 on n1: bertrain 0.1.0, torch 2.11.0; "
                              "ranks 2-3 on n2: bertrain 0.1.0, torch 2.10.0: install the same versions on every "
                              "node (the same environment or container image)")


def test_the_gpu_identity_is_the_physical_gpu_whatever_the_index(monkeypatch: pytest.MonkeyPatch) -> None:
    from bertrain.train.distributed import gpu_identity

    class Props:
        uuid = "GPU-8c7a"

    monkeypatch.setattr("torch.cuda.get_device_properties", lambda index: Props())
    assert gpu_identity(0) == "GPU-8c7a"

    def no_uuid(index: int) -> None:
        raise RuntimeError("no CUDA")

    monkeypatch.setattr("torch.cuda.get_device_properties", no_uuid)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3, 5")  # Slurm's --gpus-per-task on the task with GPUs 3 and 5
    assert (gpu_identity(0), gpu_identity(1), gpu_identity(2)) == ("3", "5", "2")


def test_slurm_nodelist_parsing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("shutil.which", lambda _: None)  # no scontrol here: the parser decides
    assert first_slurm_host("node[001-004]") == "node001"
    assert first_slurm_host("a12,b3") == "a12"
    assert first_slurm_host("single") == "single"


def test_a_section_given_in_part_keeps_the_commands_own_defaults_for_the_rest() -> None:
    from bertrain.tasks.finetune import GlueFinetuneConfig

    base = {"init": "m", "output_dir": "o", "data": {"task": "rte", "data_dir": "d"}}
    cfg = load_config(GlueFinetuneConfig, base=base, overrides={"optim.weight_decay": "0", "eval.interval": "3"})
    # fine-tuning's lr 3e-5 and dev-selection defaults, not OptimConfig's 1e-4 and EvalConfig's final: last
    assert (cfg.optim.lr, cfg.optim.weight_decay) == (3e-5, 0.0)
    assert (cfg.eval.interval, cfg.eval.final, cfg.eval.each_epoch) == (3, "best", True)
    assert (cfg.checkpoint.save_interval, cfg.train.epochs) == (0, 2.0)


@pytest.mark.parametrize("next_sentence", [True, False])
def test_a_checkpoint_of_before_the_packing_keys_resumes_as_itself(tmp_path, next_sentence) -> None:
    """A checkpoint whose config.yaml predates sample.split_sentences / sample.document_separator: an NSP run (they
    mean nothing to it) resumes as before; a packing run is told that the newer defaults change its rows, and
    resumes with the values it trained with."""
    import json
    import shutil

    import yaml

    from bertrain.config import from_dict
    from bertrain.tasks.pretraining import PretrainConfig, run_pretraining
    from bertrain.train import checkpoint as ckpt
    from bertrain.utils.errors import UserError

    def cfg(steps: int, **sample) -> PretrainConfig:
        return from_dict(PretrainConfig, {
            "model": {"preset": "tiny"}, "data": {"synthetic_samples": 32, "vocab_size": 100},
            "sample": {"max_seq_length": 32, "max_predictions_per_seq": 5, "next_sentence": next_sentence, **sample},
            "train": {"steps": steps, "global_batch_size": 8, "micro_batch_size": 8},
            "checkpoint": {"save_interval": 1}, "output_dir": str(tmp_path / "run")})

    run_pretraining(cfg(2, split_sentences=False, document_separator=False))
    shutil.rmtree(tmp_path / "run" / "step-2")  # as if stopped after step 1
    saved = tmp_path / "run" / "step-1" / "config.yaml"
    old = yaml.safe_load(saved.read_text())
    for key in ("split_sentences", "document_separator"):  # as an older bertrain wrote it
        del old["sample"][key]
    saved.write_text(yaml.safe_dump(old))
    manifest = saved.parent / ckpt.MANIFEST
    files = json.loads(manifest.read_text())
    files["files"]["config.yaml"] = {"size": saved.stat().st_size, "sha256": ckpt.sha256_file(saved)}
    manifest.write_text(json.dumps(files))
    if next_sentence:
        assert run_pretraining(cfg(2), resume="auto").state.step == 2
        return
    with pytest.raises(UserError, match=r"sample.document_separator: False -> True \(a key added since.*"
                                        r"--sample.document_separator false continues the run as it began\)\n  "
                                        r"sample.split_sentences: False -> True"):
        run_pretraining(cfg(2), resume="auto")
    assert run_pretraining(cfg(2, split_sentences=False, document_separator=False), resume="auto").state.step == 2


@pytest.mark.parametrize("text, expected", [
    ("name: x\nstages:\n  vocab: {size: 100\n  bad: [\n",
     "line 4, column 6: expected ',' or '}', but got ':' (while parsing a flow mapping at line 3, column 10)"),
    ("a: 1\n b: 2\n", "line 2, column 3: mapping values are not allowed here"),
    ('a: "x\n', "line 2, column 1: found unexpected end of stream (while scanning a quoted scalar at line 1, "
                "column 4)"),
])
def test_a_config_file_that_is_not_yaml_is_one_line_naming_the_file_line_and_column(tmp_path: Path, text: str,
                                                                                     expected: str) -> None:
    """Before: PyYAML's five lines with excerpts and carets, naming the file "<unicode string>"."""
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ValueError) as e:
        load_config(PretrainConfig, path)
    assert str(e.value) == f"config file {path} is not valid YAML: {expected}"


@pytest.mark.parametrize("flag, value, expected", [
    ("--metrics.report_to", "[mlflow", "a list such as [a, b] (line 1, column 8: expected ',' or ']'"),
    ("--optim.betas", "[0.9", "a list such as [a, b] (line 1, column 5: expected ',' or ']'"),
])
def test_a_malformed_list_on_the_command_line_is_one_line_exit_2(tmp_path: Path, capsys, flag, value,
                                                                  expected) -> None:
    """A YAMLError is no ValueError: it was a traceback and exit 1, the code of a bug."""
    from bertrain.cli import main

    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps({"model": {"preset": "tiny"}, "data": {"synthetic_samples": 8, "vocab_size": 100},
                               "output_dir": str(tmp_path / "run")}))
    assert main(["pretrain", "--config", str(cfg), flag, value]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"bertrain pretrain: error: config key '{flag[2:]}': expected {expected}")
    assert not (tmp_path / "run").exists()
