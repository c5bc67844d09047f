"""Upgrading bertrain under a run: what today's bertrain does with what an older one wrote.

The older files are made here, from what today's bertrain writes, by taking out what an older one did not write
(config keys added since, the checkpoint's newer registry entries and markers) and, for a changed formula, by
writing the value the old formula gave: no test depends on an old git commit.

Found by running five older commits' pretrain / finetune and resuming their run folders with today's bertrain:
* every resume of a run folder of before 2026-11-24 was refused for keys it could not have had (`data.text_column:
  None -> 'text'`, `eval.patience: None -> 0`, ...), and fine-tuning's for `train.epochs: 0.0 -> 2.0`, a default
  that changed but means nothing with train.steps set;
* a run of the shipped BERT recipes (nvlamb + poly) written before 2026-11-27 resumed without a word with the
  new nvlamb and poly maths (the lr of step 35 of a 200-step poly run went from 9.6e-4 to 9.1e-4).
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
import yaml

from bertrain import __version__
from bertrain.config import flatten, from_dict, to_dict
from bertrain.tasks.finetune import GlueFinetuneConfig, SquadFinetuneConfig
from bertrain.tasks.pretraining import PretrainConfig, run_pretraining
from bertrain.train import checkpoint as ckpt
from bertrain.train.resume import ADDED_KEYS, EXACT_KEYS, NUMERICS, PACKING_ONLY_KEYS, check_config
from bertrain.utils.errors import UserError

# The keys of the config.yaml that bertrain wrote on 2026-11-23 (commit af2d782): pretraining, GLUE fine-tuning,
# and SQuAD's data section (the rest of SQuAD's keys are GLUE's).
OLDEST_PRETRAIN = """checkpoint.export_final checkpoint.keep_last checkpoint.save_interval data.do_lower_case
data.dupe_factor data.input data.masking data.num_workers data.prepared data.synthetic_samples data.uneven_last_rank
data.vocab_file data.vocab_size distributed.backend distributed.bucket_cap_mb distributed.device
distributed.grad_compression distributed.heartbeat_interval_s distributed.heartbeat_timeout_s distributed.stop_grace_s
distributed.timeout_s model.dropout model.hidden_size model.init model.intermediate_size model.max_position_embeddings
model.num_attention_heads model.num_hidden_layers model.preset model_options.compile
model_options.gradient_checkpointing model_options.jagged_attention model_options.unpad optim.base_batch_size
optim.betas optim.bias_correction optim.eps optim.lr optim.max_grad_norm optim.max_trust_ratio optim.min_trust_ratio
optim.name optim.scale_lr_with_batch optim.weight_decay output_dir precision.growth_interval
precision.initial_loss_scale precision.max_consecutive_skips precision.min_loss_scale precision.mode
sample.masked_lm_prob sample.max_predictions_per_seq sample.max_seq_length sample.next_sentence sample.short_seq_prob
sample.whole_word_masking schedule.decay_rate schedule.decay_steps schedule.min_lr_ratio schedule.name schedule.power
schedule.warmup schedule.warmup_power seed train.accumulation train.epochs train.global_batch_size train.log_interval
train.micro_batch_size train.steps train.trim_padding""".split()
OLDEST_GLUE = """checkpoint.export_final checkpoint.keep_last checkpoint.save_interval data.data_dir
data.max_seq_length data.max_train_examples data.predict_test data.task distributed.backend distributed.bucket_cap_mb
distributed.device distributed.grad_compression distributed.heartbeat_interval_s distributed.heartbeat_timeout_s
distributed.stop_grace_s distributed.timeout_s do_eval do_train eval_batch_size init model_options.compile
model_options.gradient_checkpointing model_options.jagged_attention model_options.unpad optim.base_batch_size
optim.betas optim.bias_correction optim.eps optim.lr optim.max_grad_norm optim.max_trust_ratio optim.min_trust_ratio
optim.name optim.scale_lr_with_batch optim.weight_decay output_dir precision.growth_interval
precision.initial_loss_scale precision.max_consecutive_skips precision.min_loss_scale precision.mode
schedule.decay_rate schedule.decay_steps schedule.min_lr_ratio schedule.name schedule.power schedule.warmup
schedule.warmup_power seed train.accumulation train.epochs train.global_batch_size train.log_interval
train.micro_batch_size train.steps train.trim_padding""".split()
OLDEST_SQUAD_DATA = """data.train_file data.dev_file data.train_articles data.dev_articles
data.version_2_with_negative data.max_seq_length data.doc_stride data.max_query_length data.n_best_size
data.max_answer_length data.null_score_diff_threshold data.cache_dir""".split()


def nested(flat: dict) -> dict:
    out: dict = {}
    for key, value in flat.items():
        node = out
        *path, leaf = key.split(".")
        for part in path:
            node = node.setdefault(part, {})
        node[leaf] = value
    return out


def as_older(step: Path, keep: list[str] | None = None, drop_state: tuple[str, ...] = (),
             scheduler_lr: list[float] | None = None) -> None:
    """Make checkpoint folder `step` look as an older bertrain wrote it: its config.yaml with only the keys in
    `keep`, train_state.pt without the entries `drop_state`, the scheduler's recorded lr `scheduler_lr`; the
    manifest updated, so that the checkpoint verifies."""
    touched = []
    if keep is not None:
        saved = step / "config.yaml"
        flat = flatten(yaml.safe_load(saved.read_text()))
        saved.write_text(yaml.safe_dump(nested({k: v for k, v in flat.items() if k in keep}), sort_keys=False))
        touched.append(saved)
    if drop_state or scheduler_lr is not None:
        path = step / ckpt.TRAIN_STATE
        ts = torch.load(path, weights_only=False)
        for name in drop_state:
            ts.pop(name, None)
        if scheduler_lr is not None:
            ts["scheduler"]["_last_lr"] = scheduler_lr
        torch.save(ts, path)
        touched.append(path)
    manifest = step / ckpt.MANIFEST
    files = json.loads(manifest.read_text())
    for path in touched:
        files["files"][path.name] = {"size": path.stat().st_size, "sha256": ckpt.sha256_file(path)}
    manifest.write_text(json.dumps(files))
    assert ckpt.verify_checkpoint(step) is None


def pretrain_cfg(out: Path, steps: int, **sections: dict) -> PretrainConfig:
    data = {"model": {"preset": "tiny"}, "data": {"synthetic_samples": 64, "vocab_size": 100},
            "sample": {"max_seq_length": 32, "max_predictions_per_seq": 5},
            "train": {"steps": steps, "global_batch_size": 8, "micro_batch_size": 8},
            "checkpoint": {"save_interval": 2, "keep_last": 5, "export_final": False}, "eval": {"enabled": False},
            "metrics": {"report_to": []}, "output_dir": str(out)}
    for name, values in sections.items():
        data[name] = {**data.get(name, {}), **values}
    return from_dict(PretrainConfig, data)


def weights(step: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    return load_file(str(step / "model.safetensors"))


def stopped_at(out: Path, step: int) -> None:
    """Leave run folder `out` as if its run had been killed right after checkpoint step-`step`."""
    import shutil
    for _, path in ckpt.list_checkpoints(out):
        if int(path.name.split("-")[1]) > step:
            shutil.rmtree(path)


def test_a_run_of_an_older_bertrain_resumes_as_itself_under_todays_defaults(tmp_path: Path) -> None:
    """Its config.yaml lacks every key added since 2026-11-23: they take the values that do what it did, so the
    resume is neither refused (it was: `data.text_column: None -> 'text'` and nine more) nor changed: the same
    final weights as a straight run."""
    out = tmp_path / "run"
    run_pretraining(pretrain_cfg(out, 4))
    straight = weights(out / "step-4")
    stopped_at(out, 2)
    as_older(out / "step-2", keep=OLDEST_PRETRAIN, drop_state=("threads", "eval", "clock", "trackers", "meter",
                                                               "bertrain", "numerics"))
    assert run_pretraining(pretrain_cfg(out, 4), resume="auto").state.step == 4
    resumed = weights(out / "step-4")
    assert straight.keys() == resumed.keys() and all(torch.equal(straight[k], resumed[k]) for k in straight)


def glue_cfg(out: Path, **sections: dict) -> GlueFinetuneConfig:
    data = {"init": "unused", "data": {"task": "mrpc", "data_dir": "unused"}, "output_dir": str(out),
            "train": {"steps": 200, "micro_batch_size": 16, "global_batch_size": 16}}
    for name, values in sections.items():
        data[name] = {**data.get(name, {}), **values}
    return from_dict(GlueFinetuneConfig, data)


def test_an_older_fine_tuning_run_is_refused_only_for_the_key_that_would_change_it(tmp_path: Path) -> None:
    """Fine-tuning of before 2026-11-24 had no evaluation while training and ended with its last model: today's
    `eval.final: best` would end it otherwise, so that one key is listed, saying what continues the run as it began;
    no key it could not have had (`eval.patience: None -> 0`), and not `train.epochs`, whose default went from 0 to
    2 but which train.steps overrides."""
    step = tmp_path / "run" / "step-10"
    step.mkdir(parents=True)
    old = {k: v for k, v in flatten(to_dict(glue_cfg(tmp_path / "run"))).items() if k in OLDEST_GLUE}
    old["train.epochs"] = 0.0  # the default then
    (step / "config.yaml").write_text(yaml.safe_dump(nested(old)))
    with pytest.raises(UserError) as refused:
        check_config(step, glue_cfg(tmp_path / "run"), allow_change=False)
    listed = [line for line in str(refused.value).splitlines() if line.startswith("  ")]
    assert len(listed) == 1 and listed[0].startswith("  eval.final: 'last' -> 'best' (a key added since"), listed
    assert "--eval.final last continues the run as it began" in listed[0]
    assert check_config(step, glue_cfg(tmp_path / "run", eval={"final": "last"}), allow_change=False) == {}
    # with its steps unset, epochs decide the length: a change (0 -> 2 epochs is another run)
    old.update({"train.steps": 0, "train.epochs": 3.0})
    (step / "config.yaml").write_text(yaml.safe_dump(nested(old)))
    with pytest.raises(UserError, match=r"train.epochs: 3.0 -> 2.0"):
        check_config(step, glue_cfg(tmp_path / "run", train={"steps": 0, "epochs": 2.0}, eval={"final": "last"}),
                     allow_change=False)


def test_every_key_added_since_the_oldest_config_is_registered() -> None:
    """A key added to a config dataclass must say what an older run did without it: an `EXACT_KEYS` one (the run is
    the same whatever its value), a packing key of `sample_keys_of_before`, or an `ADDED_KEYS` entry. Else every
    older run is refused on resume for `KEY: None -> default` (or, worse, compared at a value it never had)."""
    cfgs = {"pretrain": (pretrain_cfg(Path("out"), 1), OLDEST_PRETRAIN),
            "glue": (glue_cfg(Path("out")), OLDEST_GLUE),
            "squad": (from_dict(SquadFinetuneConfig, {"init": "x", "data": {"train_file": "x", "dev_file": "x"},
                                                      "output_dir": "out", "train": {"steps": 1}}),
                      [k for k in OLDEST_GLUE if not k.startswith("data.")] + OLDEST_SQUAD_DATA)}
    for name, (cfg, oldest) in cfgs.items():
        unregistered = [k for k in flatten(to_dict(cfg)) if k not in oldest and not k.startswith(EXACT_KEYS)
                        and k not in ADDED_KEYS and k not in PACKING_ONLY_KEYS]
        assert unregistered == [], f"{name}: keys added without an ADDED_KEYS entry: {unregistered}"


def old_poly_lr(peak: float, step: int, warmup: int, total: int, power: float = 0.5) -> float:
    """The lr bertrain's poly gave at `step` (the count of steps taken) before 2026-11-27: (1 - p)^power over the
    steps after warmup."""
    if step < warmup:
        return peak * (step + 1) / warmup
    p = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (1.0 - p) ** power


def test_a_run_of_the_old_poly_schedule_is_refused_and_continues_only_when_asked(tmp_path: Path,
                                                                               caplog: pytest.LogCaptureFixture) -> None:
    """A checkpoint of before the `numerics` marker (no revision recorded) whose scheduler recorded the lr of the
    old poly formula: the resume is refused, naming the change, the lr at that step under both formulas, and the
    ways out; it resumed silently on the new formula before."""
    out = tmp_path / "run"
    cfg = dict(schedule={"name": "poly", "warmup": 1.0}, optim={"name": "adamw", "lr": 1e-3})
    run_pretraining(pretrain_cfg(out, 6, **cfg))
    stopped_at(out, 2)
    as_older(out / "step-2", drop_state=("bertrain", "numerics"), scheduler_lr=[old_poly_lr(1e-3, 2, 1, 6)] * 2)
    with pytest.raises(UserError) as refused:
        run_pretraining(pretrain_cfg(out, 6, **cfg), resume="auto")
    message = str(refused.value)
    assert "\n" not in message
    for part in (f"--resume {out / 'step-2'}", "schedule.name poly became NVIDIA's PolyWarmUpScheduler",
                 "2026-11-27", "gave lr 0.000894427 at step 2", "this bertrain's gives 0.000707107",
                 "Finish the run with the bertrain that wrote it", "--allow-config-change"):
        assert part in message, (part, message)
    with caplog.at_level(logging.WARNING, logger="bertrain"):
        assert run_pretraining(pretrain_cfg(out, 6, **cfg), resume="auto", allow_config_change=True).state.step == 6
    assert "continuing with this bertrain's (--allow-config-change)" in caplog.text


def test_an_nvlamb_run_of_before_the_change_is_refused(tmp_path: Path) -> None:
    """nvlamb changed on 2026-11-27 without leaving a trace in the optimizer's state: a checkpoint without the
    `meter` entry (before 2026-11-25) is certainly older, and refused; one with today's `numerics` resumes."""
    out = tmp_path / "run"
    cfg = dict(optim={"name": "nvlamb", "lr": 1e-3})
    run_pretraining(pretrain_cfg(out, 4, **cfg))
    assert torch.load(out / "step-4" / ckpt.TRAIN_STATE, weights_only=False)["numerics"] == NUMERICS
    assert torch.load(out / "step-4" / ckpt.TRAIN_STATE, weights_only=False)["bertrain"] == __version__
    stopped_at(out, 2)
    assert run_pretraining(pretrain_cfg(out, 4, **cfg), resume="auto").state.step == 4  # same numerics: resumes
    stopped_at(out, 2)
    as_older(out / "step-2", drop_state=("bertrain", "numerics", "meter"))
    with pytest.raises(UserError, match=r"written by a bertrain of before 2026-11-25 .*optim.name nvlamb became "
                                        r"apex FusedLAMB.*from step 2 on\. Finish the run with the bertrain that "
                                        r"wrote it, or pass --allow-config-change"):
        run_pretraining(pretrain_cfg(out, 4, **cfg), resume="auto")


def test_a_pipeline_stage_of_an_older_bertrain_is_kept_not_redone(tmp_path: Path) -> None:
    """`bertrain run` on a run folder of an older bertrain: a finished (or cut) training stage whose record lacks the
    keys added since (at the values that do what it did), still hashes keys that now keep the result (metrics.*),
    and lacks keys hashed since (at the values it ran with: its stage-config.yaml) is skipped (resumed), not redone
    with its folder moved aside; a real change is still redone."""
    from bertrain.pipeline.recipe import load_recipe
    from bertrain.pipeline.stages import STAGE_FILE, STARTED_FILE, Decision, build_stages, decide, plan

    recipe = load_recipe(Path(__file__).resolve().parents[1] / "configs" / "recipes" / "pydoc-small.yaml",
                         [f"output_dir={tmp_path / 'run'}"])
    stages = build_stages(recipe)
    plan(stages)  # the hashes
    stage = next(s for s in stages if s.name == "pretrain-phase1")
    kept = {n: Decision("skip", "complete") for n in stage.deps}
    for n in stage.deps:  # the stages it read, as the older bertrain recorded them
        (stage.folder.parent / n).mkdir(parents=True)
        (stage.folder.parent / n / STAGE_FILE).write_text(json.dumps({"hash": f"old-{n}"}))
    stage.folder.mkdir(parents=True)
    for rel in stage.outputs:
        (stage.folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (stage.folder / rel).write_bytes(b"weights")
    settings = json.loads(json.dumps(stage.parts["settings"], default=str))
    ran = {**settings, "eval.enabled": True, "metrics.report_to": ["tensorboard"]}
    (stage.folder / "stage-config.yaml").write_text(yaml.safe_dump(nested(ran)))
    before = {k: v for k, v in settings.items() if k not in ("data.text_column", "eval.enabled", "data.encoding",
                                                             "eval.max_samples", "train.max_time")}
    before["metrics.report_to"] = ["tensorboard"]  # hashed then
    record = {"hash": "old", "parts": {"settings": before, "inputs": json.loads(json.dumps(stage.inputs)),
                                       "upstream": {n: f"old-{n}" for n in stage.deps}},
              "outputs": {rel: ckpt.sha256_file(stage.folder / rel) for rel in stage.outputs}}
    (stage.folder / STAGE_FILE).write_text(json.dumps(record))
    assert decide(stage, kept).action == "skip"
    changed = {**record, "parts": {**record["parts"], "settings": {**before, "optim.lr": 1.0}}}
    (stage.folder / STAGE_FILE).write_text(json.dumps(changed))
    assert decide(stage, kept).action == "redo"
    (stage.folder / STAGE_FILE).unlink()  # cut: only its start was recorded
    (stage.folder / STARTED_FILE).write_text(json.dumps({k: record[k] for k in ("hash", "parts")}))
    assert decide(stage, kept).action == "resume"
    assert decide(stage, {**kept, stage.deps[-1]: Decision("redo", "changed")}).action == "redo"
