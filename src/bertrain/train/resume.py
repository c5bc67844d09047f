"""Where a run lives and how it continues: the run folder, the choice of checkpoint, and the restore.

* `run_folder`: rank 0 locks the output folder for the whole command (`OutputLock`) and claims it for this run
  (`claim_run_folder`: a new run never mixes into, or destroys, another run's folder); every rank learns the
  outcome, so an error never leaves a rank waiting, and every rank must find the run's record there
  (`check_shared_output`: a multi-node job needs its output folder on a filesystem every node mounts).
* `find_resume_checkpoint`: rank 0 chooses (the newest complete, checksum-verified checkpoint for "auto") and
  broadcasts the choice. If checkpoints exist but none is usable, that is an error, not a silent fresh start.
* `config_changes` / `restore`: the new resolved config is compared with the checkpoint's. Keys that keep the run
  exact (logging, checkpointing, workers, how the model runs) are taken; keys that change the run (optimizer,
  schedule, steps, batch, model, data, seed, precision) are refused, all listed old -> new, unless
  `--allow-config-change`: then the new optimizer hyperparameters are applied and the schedule is recomputed for
  the new length at the step reached (the trainer records the changes in metrics.jsonl).
* `init_optimizer_state`: a new run whose optimizer starts from another run's moments (`optim.init_state`: NVIDIA's
  phase 2 continuing phase 1's LAMB moments).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Collection, Iterator, Mapping

from bertrain.config import PATH_KEYS, flatten, load_file, to_dict, upgrade_keys
from bertrain.train import checkpoint as ckpt
from bertrain.train.config import BatchPlan, TrainerConfig
from bertrain.train.dcp import load_model_and_optimizer, load_optimizer_moments
from bertrain.train.distributed import DistInfo, describe_ranks, gather_objects, on_rank0, same_paths_on_every_rank
from bertrain.train.states import Stateful, load_entries
from bertrain.utils.errors import UserError
from bertrain.utils.rundir import OutputLock, claim_run_folder, read_run

log = logging.getLogger(__name__)

# Keys whose change keeps a resumed run exact (or only changes how fast it runs, tested equal): taken silently.
EXACT_KEYS = ("train.log_interval", "train.trim_padding", "checkpoint.", "data.num_workers", "distributed.backend",
              "distributed.device", "distributed.timeout_s", "distributed.bucket_cap_mb", "distributed.heartbeat",
              "distributed.stop_grace_s", "model_options.", "output_dir", "do_eval", "eval_batch_size",
              # ddp <-> fsdp: the same run (allclose, not bitwise: reduction order); resharding is bitwise
              "parallelism.strategy", "parallelism.reshard_after_forward", "parallelism.dp_shard",
              "data.predict_test", "data.cache_dir", "data.n_best_size", "data.max_answer_length",
              "data.null_score_diff_threshold", "data.dev_file", "data.dev_articles",
              # more or fewer evaluations, a longer or shorter budget: the steps taken are the same
              "eval.enabled", "eval.interval", "eval.each_epoch", "train.max_time", "train.deterministic",
              # where the records go and what is profiled: the numbers are the same
              "metrics.", "profile.")


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """--resume, --overwrite and --allow-config-change: spelled and behaving the same for every training command."""
    parser.add_argument("--resume", metavar="auto|PATH", default=None,
                        help="continue from the newest complete checkpoint in output_dir (auto; from scratch if "
                             "there is none yet) or from the checkpoint folder PATH")
    parser.add_argument("--overwrite", action="store_true",
                        help="start a new run in an output folder that holds another run: the old folder is moved "
                             "aside to OUTPUT.replaced-<time>, never deleted")
    parser.add_argument("--allow-config-change", action="store_true",
                        help="with --resume: apply config changes that alter the run (lr, schedule, steps, ...; "
                             "the schedule is recomputed for the new length) instead of refusing them")


# Set by a launcher that restarts a failed job by itself: torchrun --max-restarts (elastic agent) and Slurm's
# requeue (scontrol requeue, --requeue on node failure). A restarted run continues; it never starts over.
RESTART_VARIABLES = ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT")


def restart_count(env: Mapping[str, str] | None = None) -> tuple[str, int] | None:
    """(variable, count) when a launcher has restarted this job (count > 0), else None."""
    env = os.environ if env is None else env
    for var in RESTART_VARIABLES:
        value = env.get(var, "").strip()
        if value.isdigit() and int(value) > 0:
            return var, int(value)
    return None


def resume_on_restart(resume: str | None, overwrite: bool,
                      env: Mapping[str, str] | None = None) -> tuple[str | None, bool]:
    """The (--resume, --overwrite) a command really uses: after a launcher's restart, `--resume auto` unless a
    checkpoint PATH was given (the first attempt already claimed or replaced the folder, so --overwrite is dropped:
    moving the folder aside now would throw away the checkpoints this restart must continue from)."""
    restarted = restart_count(env)
    if restarted is None:
        return resume, overwrite
    var, count = restarted
    if resume is None:
        log.info("%s=%d: restarted by the launcher, continuing from the newest complete checkpoint "
                 "(--resume auto)", var, count)
        resume = "auto"
    return resume, False


@contextlib.contextmanager
def run_folder(output_dir: Path, command: str, dist: DistInfo, resume: str | None, overwrite: bool,
               inputs: Mapping[str, str] | None = None, models: Collection[str] = (),
               flags: Mapping[str, str] | None = None, cfg: TrainerConfig | None = None) -> Iterator[None]:
    """Hold the output folder for this run (see the module docstring), after checking its `inputs` (config key ->
    path; `models`: the keys that name a model folder or Hub id; `flags`: a key's command-line flag, named in the
    errors) with `check_inputs`, and `cfg`'s batch plan and parallel layout at this world size (`Trainer.fit`
    checks them again): a strategy that does not fit the job was refused only after `--overwrite` had moved the
    finished run aside."""
    from bertrain.train.config import resolve_batch
    from bertrain.train.parallel import ParallelDims  # FSDP2's imports only when a run starts

    with contextlib.ExitStack() as held:  # releases the lock on every way out

        def claim() -> str:
            # the checks read only: before the lock, so that a refused command creates nothing (not even the
            # output folder's parents and its lock file)
            check_inputs(output_dir, inputs or {}, models, overwrite, flags or {})
            if cfg is not None:
                resolve_batch(cfg.train, dist.world_size)
                ParallelDims.from_config(cfg, dist.world_size)
            held.enter_context(OutputLock(output_dir, command))
            return claim_run_folder(output_dir, command, resume, overwrite)["run_id"]

        run_id = on_rank0(f"use the output folder {output_dir}", claim)
        check_shared_output(output_dir, run_id, dist)
        yield


def checkpoint_for_gone_init(init: str, resume: str | None, output_dir: str | Path,
                             with_weights: bool = False) -> Path | None:
    """The run's own checkpoint to build the model from where a resume's initial model (`init`: pretraining's
    model.init, fine-tuning's --init) is gone (moved or deleted once the run had checkpoints); None where `init` is
    there, or nothing is resumed, or no checkpoint has a config.json (`with_weights`: and HF weights, not only DCP
    shards). Any of the run's checkpoints will do: a run keeps its shape, and the resume verifies its own."""
    from bertrain.model.hf import find_config_file, resolve_model_dir

    if not resume or not init:
        return None
    try:
        find_config_file(resolve_model_dir(init))
        return None
    except ValueError:  # UserError too: a Hub id that is not in the local cache
        pass
    candidates = [p for _, p in ckpt.list_checkpoints(output_dir)] if resume == "auto" else [Path(resume)]
    return next((p for p in reversed(candidates) if (p / "config.json").is_file()
                 and (not with_weights or (p / "model.safetensors").is_file())), None)


def check_inputs(output_dir: Path, inputs: Mapping[str, str], models: Collection[str], overwrite: bool,
                 flags: Mapping[str, str]) -> None:
    """What a run reads (config key -> path; empty: unused), checked before its output folder is claimed. Before,
    a mistyped `data.prepared` or `model.init` failed only after `--overwrite` had moved the finished run aside
    (leaving a folder with only run.json, which `--resume auto` then started afresh), and an output_dir that was
    data.prepared wrote checkpoints into the token store. A key in `models` must be a model folder (config.json or
    Google's bert_config.json) or a Hub id in the local cache; any other must exist."""
    from bertrain.model.hf import find_config_file, resolve_model_dir

    out = output_dir.resolve()
    for key, value in inputs.items():
        if not value:
            continue
        name = f"config key '{key}'" + (f" ({flags[key]})" if key in flags else "")
        try:
            path = resolve_model_dir(value) if key in models else Path(value)
            if key in models:
                find_config_file(path)
            elif not path.exists():
                raise ValueError(f"{value} does not exist")
        except ValueError as e:
            raise UserError(f"{name}: {e}") from None
        where = path.resolve()
        if where == out:
            raise UserError(f"{name}: {value} is the output folder of this run: a run must not write into "
                            "what it reads; choose another output_dir")
        if overwrite and out in where.parents:
            raise UserError(f"{name}: {value} is inside the output folder {output_dir}, which --overwrite "
                            "would move aside before the run reads it: move it out, or choose another output_dir")


# How long a rank waits for the run.json rank 0 has just written to appear where it runs: a shared filesystem's
# client may cache a directory for some seconds (NFS: acdirmin); a node-local folder never shows it.
SHARED_OUTPUT_WAIT_S = float(os.environ.get("BERTRAIN_SHARED_OUTPUT_WAIT_S", "15"))


def check_shared_output(output_dir: Path, run_id: str, dist: DistInfo) -> None:
    """Refuse a job whose ranks do not share the output folder (collective). Rank 0 writes it, but every rank reads
    the checkpoint to resume from, and under FSDP each rank writes its own shards into it: on node-local disks a
    resume failed on the other nodes (and rank 0 crashed in its next collective), and FSDP wrote checkpoints whose
    other-node shards were not there, marked complete. Each rank must find rank 0's run.json (this run's id) in
    `output_dir`, waiting up to `SHARED_OUTPUT_WAIT_S` for a shared filesystem's caches."""
    if dist.world_size == 1:
        return
    deadline = time.monotonic() + SHARED_OUTPUT_WAIT_S
    while True:
        record = read_run(output_dir)
        if record is not None and record.get("run_id") == run_id:
            seen = None
            break
        if time.monotonic() >= deadline:  # what this rank found instead
            seen = ("no run.json" if record is None else
                    f"the run.json of another run ({record.get('run_id')}, started {record.get('started', '?')})")
            break
        time.sleep(0.2)
    views = gather_objects(seen)
    lack = [r for r, v in enumerate(views) if v is not None]
    if lack:
        raise UserError(
            f"output folder {output_dir} is not shared by every rank: {describe_ranks(lack)} found "
            f"{views[lack[0]]} there, where rank 0 wrote this run's (run {run_id}). Every rank reads the checkpoint "
            "a run resumes from (and with parallelism.strategy fsdp writes its own shards of every checkpoint), so "
            "output_dir must be on a filesystem that every node mounts at the same path (NFS, Lustre, GPFS, ...)")


def find_resume_checkpoint(resume: str | None, output_dir: Path, dist: DistInfo) -> Path | None:
    """Rank 0 decides which checkpoint to resume from (verifying it) and tells the others."""
    if not resume:
        return None

    def choose() -> str | None:
        if resume != "auto":
            problem = ckpt.verify_checkpoint(resume)
            if problem:
                raise UserError(f"--resume {resume}: {problem}")
            return resume
        found = ckpt.latest_checkpoint(output_dir)
        if found is not None:
            return str(found)
        bad = [(p, ckpt.verify_checkpoint(p)) for _, p in ckpt.list_checkpoints(output_dir)]
        if bad:
            raise UserError(f"--resume {resume}: none of the {len(bad)} checkpoints in {output_dir} is usable ("
                            + "; ".join(f"{p.name}: {why}" for p, why in bad[-3:])
                            + "): remove the broken ones, or start over with --overwrite")
        log.info("--resume auto: no checkpoint in %s yet, starting from scratch", output_dir)
        return None

    choice = on_rank0("choose the checkpoint to resume from", choose)
    return Path(choice) if choice else None


def config_changes(old: dict[str, Any], new: dict[str, Any]) -> tuple[dict[str, tuple], dict[str, tuple]]:
    """(taken, run-changing): every differing dotted key -> (old, new); absent keys are `None`."""
    a, b = flatten(old), flatten(new)
    taken, changing = {}, {}
    for key in sorted(set(a) | set(b)):
        va, vb = a.get(key), b.get(key)
        if isinstance(va, (list, tuple)) and isinstance(vb, (list, tuple)):
            va, vb = list(va), list(vb)
        if va == vb:
            continue
        same = key.rsplit(".", 1)[-1] in PATH_KEYS and same_paths(va, vb)
        (taken if same or key.startswith(EXACT_KEYS) else changing)[key] = (va, vb)
    return taken, changing


def same_paths(a: Any, b: Any) -> bool:
    """Whether two values of a path key name the same files from here: `data` and `/abs/cwd/data`, `x/../y` and `y`,
    a symlink and its target (before, the same folder spelled otherwise on the resume's command line was refused as
    a run-changing key). A path that names another folder with the same content is still a change; one that names
    the same folder whose content changed is caught by the data's fingerprint and the model's config."""
    if isinstance(a, str) and isinstance(b, str):
        try:
            return os.path.samefile(a, b)
        except OSError:  # one is missing: the same spelling once normalised
            return os.path.abspath(a) == os.path.abspath(b)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same_paths(x, y) for x, y in zip(a, b))
    return False


PACKING_ONLY_KEYS = ("sample.split_sentences", "sample.document_separator")
"""Sample keys that only MLM-only packing reads (`sample.next_sentence: false`)."""

ADDED_KEYS: dict[str, Any] = {
    "data.encoding": "utf-8", "data.text_column": "text",  # how raw input is read: utf-8, JSONL's "text"
    "data.heldout_fraction": None, "data.heldout_min_documents": None,  # prepare's own defaults
    "optim.init_state": None,  # moments from zero
    "schedule.on_time": False,  # the schedule follows the steps
    "parallelism.param_dtype": "auto", "parallelism.reduce_dtype": "fp32",  # FSDP's dtypes before they moved
    # evaluation while training: none, so no early stop, no target, and the run ended with its last weights
    "eval.final": "last", "eval.metric": "", "eval.patience": 0, "eval.min_delta": 0.0, "eval.target": None,
    "eval.max_samples": 2048,  # decides only the numbers of evaluations an older run never made
    # EXACT_KEYS that a pipeline stage's hash covers (pipeline.stages.RESULT_KEYS) and older bertrains lacked
    "eval.enabled": True, "train.max_time": "",
}
"""Keys of the run-changing kind (not in `EXACT_KEYS`) added after run folders existed, each at the value that
does what a bertrain without the key did. A checkpoint's config.yaml written before a key existed is read with
it (`keys_of_before`): an older run resumed under today's defaults is the same run and is not refused for keys it
could not have had (before, every one of them was a change `None -> default`), and a value that would change it
(fine-tuning's `eval.final: best`, where older runs ended with their last model) is listed as any other change,
saying the key is new and which value continues the run as it began. The sample keys added since are
`sample_keys_of_before`'s. A key added to a config dataclass later belongs here unless it is an `EXACT_KEYS` one
(tests/test_audit_upgrade.py checks every key of today's configs against a config.yaml of before it)."""


def sample_keys_of_before(data: dict[str, Any]) -> dict[str, Any]:
    """A saved config's `sample` section with the packing keys added since, at the value that gives the rows it
    trained on: whole sentences (before split_sentences) and no document separators (before document_separator).
    So a packing run of an older bertrain resumes as itself and is told, key by key, what a newer default would
    change."""
    sample = data.get("sample")
    if not isinstance(sample, dict) or sample.get("next_sentence", True) is not False:
        return data
    missing = {k.split(".", 1)[1]: False for k in PACKING_ONLY_KEYS if k.split(".", 1)[1] not in sample}
    return {**data, "sample": {**sample, **missing}} if missing else data


def keys_of_before(old: dict[str, Any], new: dict[str, Any]) -> tuple[dict[str, Any], set[str]]:
    """A saved config `old` (nested) as dotted keys, with the keys that today's config `new` (dotted) has and it
    lacks, added since it was written (`ADDED_KEYS`; the packing keys of `sample_keys_of_before`), at the value
    that does what the bertrain that wrote it did; and the names of those keys."""
    flat = flatten(sample_keys_of_before(old))
    added = {k for k in PACKING_ONLY_KEYS if k in flat} - set(flatten(old))
    for key, value in ADDED_KEYS.items():
        if key in new and key not in flat:
            flat[key] = value
            added.add(key)
    return flat, added


def _as_flag(key: str, value: Any) -> str:
    """The command-line option that sets `key` to `value` (--eval.final last)."""
    text = str(value).lower() if isinstance(value, bool) else str(value)
    return f"--{key} {text}"


def same_length(old: dict[str, Any], new: dict[str, Any]) -> bool:
    """Whether train.epochs cannot matter: the same train.steps > 0 on both sides (steps win over epochs; a
    default of epochs that changed since, fine-tuning's 0 -> 2, is not a change of a run with its steps set)."""
    steps = old.get("train.steps")
    return isinstance(steps, int) and steps > 0 and steps == new.get("train.steps")


def check_config(path: Path, cfg: TrainerConfig, allow_change: bool) -> dict[str, tuple]:
    """Compare `cfg` with the checkpoint's config.yaml; returns the run-changing differences that are allowed."""
    saved = path / "config.yaml"
    if not saved.is_file():
        return {}
    new = flatten(to_dict(cfg))
    old, added = keys_of_before(upgrade_keys(load_file(saved), warn=False), new)  # keys since moved or added
    taken, changing = config_changes(old, new)
    if old.get("sample.next_sentence") is not False and getattr(getattr(cfg, "sample", None),
                                                                "next_sentence", False):
        for key in PACKING_ONLY_KEYS:  # they mean nothing to an NSP run: absent from an older one, not a change
            changing.pop(key, None)
    if "train.epochs" in changing and same_length(old, new):
        taken["train.epochs"] = changing.pop("train.epochs")
    new_keys = {k: b for k, (a, b) in taken.items() if k not in old or k in added}
    for key, (a, b) in taken.items():
        if key not in new_keys:
            log.info("resuming with %s = %r (was %r)", key, b, a)
    if new_keys:  # one line: an older run lacks whole sections (metrics, profile, ...)
        log.info("resuming with %d keys added since the bertrain that wrote the checkpoint: %s", len(new_keys),
                 ", ".join(f"{k}={v!r}" for k, v in new_keys.items()))
    if changing and not allow_change:
        listed = "\n".join(f"  {k}: {a!r} -> {b!r}" + (f" (a key added since the bertrain that wrote the "
                                                       f"checkpoint, which ran as {a!r}: {_as_flag(k, a)} "
                                                       "continues the run as it began)" if k in added else "")
                           for k, (a, b) in changing.items())
        raise UserError(f"--resume {path}: the config differs from the checkpoint's in keys that change the run:\n"
                        f"{listed}\nresume with the checkpoint's values (its config.yaml), or pass "
                        "--allow-config-change to apply them (the schedule is recomputed for the new length)")
    return changing


NUMERICS = 1
"""The revision of what a config computes, recorded in every checkpoint's train_state.pt (`"numerics"`, beside
`"bertrain"`: the version) by `Trainer.save`. Bump it, with a `NUMERICS_CHANGES` entry, whenever the same config
starts to give other numbers (a formula of an optimizer or a schedule): a run resumed across the change would
otherwise mix the two silently."""

NUMERICS_CHANGES: list[tuple[int, str, Callable[[dict[str, Any]], bool], str]] = [
    (1, "2026-11-27", lambda flat: flat.get("optim.name") == "nvlamb",
     "optim.name nvlamb became apex FusedLAMB as NVIDIA's BERT runs it (no trust ratio for biases and LayerNorm)"),
    (1, "2026-11-27", lambda flat: flat.get("schedule.name") == "poly",
     "schedule.name poly became NVIDIA's PolyWarmUpScheduler ((1 - t/total)^power over all steps, warmup "
     "included: up to 0.15 of the peak lr apart)"),
]
"""(revision, date, whether a run's dotted config uses what changed, what changed): the changes of numerics."""


def numerics_written(ts: dict[str, Any]) -> int | None:
    """The `NUMERICS` revision a checkpoint was written with: recorded since it existed; 0 for a checkpoint without
    the registry's `meter` entry (written before 2026-11-25, so before every change listed); None when unknown (a
    checkpoint of 2026-11-25 to the marker: before or after the changes of 2026-11-27)."""
    if isinstance(ts.get("numerics"), int):
        return ts["numerics"]
    return 0 if "meter" not in ts else None


def schedule_drift(saved: dict[str, Any], scheduler: Any) -> tuple[int, float, float] | None:
    """(step, lr the checkpoint recorded, lr this bertrain's schedule gives there) where they differ: the schedule's
    formula changed since the checkpoint was written (a record of the old formula survives in every scheduler state,
    so this catches a change nobody registered). None where they agree or the state does not say."""
    try:
        step = int(saved["last_epoch"])
        recorded = [float(x) for x in saved["_last_lr"]]
        ours = [float(base) * float(fn(step)) for base, fn in zip(saved["base_lrs"], scheduler.lr_lambdas)]
    except (KeyError, TypeError, ValueError, AttributeError):
        return None
    for a, b in zip(recorded, ours):
        if abs(a - b) > 1e-9 * max(abs(a), abs(b), 1e-30):
            return step, a, b
    return None


def past_warmup(ts: dict[str, Any], scheduler: Any) -> bool:
    """Whether the checkpoint's step is past its schedule's warmup (where poly's two formulas part)."""
    try:
        return int(ts["scheduler"]["last_epoch"]) >= min(fn.warmup for fn in scheduler.lr_lambdas)
    except (KeyError, TypeError, ValueError, AttributeError):
        return False


def check_numerics(path: Path, ts: dict[str, Any], cfg: TrainerConfig, scheduler: Any, allow_change: bool,
                   recomputed: bool) -> None:
    """Refuse a resume that would continue a run with other numbers than it began with, because bertrain changed
    the maths of what its config uses since the checkpoint was written (`NUMERICS_CHANGES`, or a schedule whose
    recorded lr this bertrain's formula does not give: `schedule_drift`; `recomputed`: the schedule is recomputed
    anyway, for --allow-config-change). With --allow-config-change, a warning. Where the checkpoint cannot say
    (written between 2026-11-25 and the marker), a warning names the change."""
    flat = flatten(to_dict(cfg))
    revision = numerics_written(ts)
    applies = [(date, what) for rev, date, uses, what in NUMERICS_CHANGES
               if uses(flat) and (revision is None or revision < rev)]
    checked = not recomputed and not getattr(cfg.schedule, "on_time", False)
    drift = schedule_drift(ts.get("scheduler") or {}, scheduler) if checked else None
    if checked and drift is None and past_warmup(ts, scheduler):
        # the recorded lr is this bertrain's formula, where the formulas differ: the schedule's change is not it
        # (the evidence wins over the revision: a checkpoint rewritten to an older layout by hand or by a test)
        applies = [(date, what) for date, what in applies if not what.startswith("schedule.")]
    if not applies and drift is None:
        return
    whats = "; ".join(f"{what} on {date}" for date, what in applies)
    seen = "" if drift is None else (f"its schedule gave lr {drift[1]:.6g} at step {drift[0]}, this bertrain's gives "
                                     f"{drift[2]:.6g}")
    if revision is None and drift is None:  # cannot tell
        log.warning("--resume %s: the checkpoint does not record which bertrain wrote it; if that was one of before "
                    "%s, this run continues with other numbers than it began with (%s)", path, applies[0][0], whats)
        return
    by = ("a bertrain of before 2026-11-25 (train_state.pt has no 'numerics' revision and no 'meter' entry)"
          if revision == 0 else f"numerics revision {revision} (bertrain {ts.get('bertrain', '?')}), this is "
          f"{NUMERICS}" if revision is not None else "an earlier bertrain")
    message = (f"--resume {path}: written by {by}; since then {whats or 'the schedule changed'}"
               + (f" ({seen})" if seen else "") + ": continuing would change the run's numbers from step "
               f"{ts['state']['step']} on")
    if allow_change:
        log.warning("%s; continuing with this bertrain's (--allow-config-change)", message)
        return
    raise UserError(f"{message}. Finish the run with the bertrain that wrote it, or pass --allow-config-change to "
                    "continue with this one's maths")


def check_global_batch(path: Path, saved: dict[str, Any], plan: BatchPlan, allow_change: bool) -> None:
    """Refuse a resume whose global batch differs from the checkpoint's although no batch key changed: with
    `train.global_batch_size` 0 the batch is micro x accumulation x world size, so a resume (or an elastic restart)
    on another number of ranks would silently train on another batch. A changed batch key was already refused (or
    allowed) by `check_config`; with `--allow-config-change` a warning says what changes."""
    old = int(saved["global_batch_size"])
    if old == plan.global_batch_size:
        return
    if allow_change:
        log.warning("the global batch size changed since the checkpoint (%d, now %d): the data order differs from "
                    "a straight run", old, plan.global_batch_size)
        return
    old_world = int(saved.get("world_size", 0)) or "?"
    keep = ""
    if old % (plan.micro_batch_size * plan.world_size) == 0:
        keep = (f" keep it on {plan.world_size} ranks with --train.accumulation "
                f"{old // (plan.micro_batch_size * plan.world_size)} --allow-config-change (or "
                f"--train.global_batch_size {old} --train.accumulation 0 --allow-config-change, which keeps it on "
                "any number of ranks),")
    raise UserError(f"--resume {path}: the global batch would change from {old} to {plan.global_batch_size} "
                    f"(train.global_batch_size is 0, so it is train.micro_batch_size {plan.micro_batch_size} x "
                    f"train.accumulation {plan.accumulation} x the ranks: {old_world} then, {plan.world_size} now): "
                    f"continue on {old_world} ranks,{keep} or pass --allow-config-change to continue with "
                    f"{plan.global_batch_size}")


def model_source(cfg: TrainerConfig) -> str:
    """The input a run's model config comes from, as an error names it: fine-tuning's --init, pretraining's
    model.init or a model.preset config.json, else the preset."""
    if getattr(cfg, "init", None):
        return f"--init {cfg.init}"
    m = getattr(cfg, "model", None)
    if getattr(m, "init", None):
        return f"model.init {m.init}"
    preset = str(getattr(m, "preset", ""))
    return f"model.preset {preset}" if preset.endswith(".json") or Path(preset).is_file() else f"preset {preset!r}"


def check_model_config(path: Path, model: Any, cfg: TrainerConfig, allow_change: bool) -> dict[str, tuple]:
    """Compare the model this resume built (from the run's model input: `model_source`) with the checkpoint's
    config.json. A config key that changes the model is refused by `check_config`; this catches the input itself
    replaced since the run started (an --init or model.init folder swapped for a model of the same shape with
    another dropout, activation or layer-norm eps: the weights come from the checkpoint, but the rest of the run
    computed otherwise than a straight run, without a word). Refused unless `allow_change` (then a warning, and
    the differences returned for metrics.jsonl's config_change event)."""
    from bertrain.model.hf import config_from_json_file

    config, saved = getattr(model, "config", None), path / "config.json"
    if config is None or not saved.is_file():
        return {}
    try:
        old = dataclasses.asdict(config_from_json_file(saved))
    except (OSError, ValueError):
        return {}
    new = dataclasses.asdict(config)
    diff = {f"config.json {k}": (old.get(k), v) for k, v in new.items()
            if k != "pad_vocab_size_multiple" and old.get(k) != v}
    if not diff:
        return {}
    listed = ", ".join(f"{k.split(' ', 1)[1]} {a!r} -> {b!r}" for k, (a, b) in diff.items())
    what = (f"the model built from {model_source(cfg)} differs from the one the run started with (its checkpoint's "
            f"config.json): {listed}")
    if allow_change:
        log.warning("--resume %s: %s; continuing with the new values (--allow-config-change)", path, what)
        return diff
    vocab = (" (pretraining's vocab_size is its data's vocabulary: data.prepared's vocab.txt or data.vocab_file)"
             if "config.json vocab_size" in diff else "")
    raise UserError(f"--resume {path}: {what}. Was the model{vocab} replaced since the run started? Put back the one "
                    "the run started from, or pass --allow-config-change to continue with these values")


def restore(path: Path, states: dict[str, Stateful], dist: DistInfo, cfg: TrainerConfig, plan: BatchPlan,
            allow_change: bool = False) -> dict[str, tuple]:
    """Load a checkpoint into the run's registry of states (`train/states.py`: every entry it holds); returns the
    allowed run-changing config differences. Collective: every rank calls it."""
    ts = ckpt.load_train_state(path)
    if ts.get("version") != 2 or "loader" not in ts:
        raise UserError(f"--resume: {path} was written by an older bertrain (train_state version "
                        f"{ts.get('version')}); start a new run or resume with the version that wrote it")
    changes = check_config(path, cfg, allow_change)
    check_global_batch(path, ts["batch"], plan, allow_change)
    check_numerics(path, ts, cfg, states["scheduler"], allow_change, recomputed=bool(changes))
    model_changes = check_model_config(path, states["model"], cfg, allow_change)
    model, optimizer, scheduler = states["model"], states["optimizer"], states["scheduler"]
    fresh_groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    if "optim.name" in changes:
        log.warning("optimizer changed (%s -> %s): its moments start fresh", *changes["optim.name"])
    try:  # a DDP or an FSDP (sharded) checkpoint, into a plain or an FSDP-sharded model
        load_model_and_optimizer(path, ts, model, optimizer, load_optimizer="optim.name" not in changes)
    except (RuntimeError, ValueError) as e:
        raise UserError(f"--resume {path}: the checkpoint's model does not fit this config's model ({e}); a "
                        "different architecture cannot continue a run: start a new run with model.init") from None
    # with a changed config the schedule is recomputed below instead of loaded
    load_entries(states, ts, skip=("scheduler",) if changes else ())
    if changes:
        # the new hyperparameters, and the schedule recomputed for the new length at the step reached
        for group, fresh in zip(optimizer.param_groups, fresh_groups):
            group.update(fresh)
        taken_steps = int(ts["scheduler"]["last_epoch"])
        scheduler.last_epoch = taken_steps - 1
        with warnings.catch_warnings():  # "scheduler.step() before optimizer.step()": intended here
            warnings.simplefilter("ignore")
            scheduler.step()
        log.warning("resuming with a changed config (--allow-config-change): %s",
                    ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in changes.items()))
    log.info("resumed from %s at step %d (epoch %d, %d samples)", path, ts["state"]["step"], ts["state"]["epoch"],
             ts["state"]["samples"])
    return {**changes, **model_changes}


def init_optimizer_state(cfg: TrainerConfig, model: Any, optimizer: Any, dist: DistInfo) -> None:
    """`optim.init_state`: start a new run's optimizer from the moments of another run's checkpoint (see its
    docstring in train/config.py). Rank 0 checks the folder; collective: every rank calls it."""
    key = f"config key 'optim.init_state': {cfg.optim.init_state}"
    given = Path(cfg.optim.init_state)

    def check() -> str:
        path = given
        if not path.is_dir():
            raise UserError(f"{key} does not exist (give a checkpoint folder OUTPUT/step-N of the earlier run)")
        if not (path / ckpt.TRAIN_STATE).is_file() and ckpt.list_checkpoints(path):  # a run folder: its newest
            complete = [p for _, p in ckpt.list_checkpoints(path) if (p / ckpt.COMPLETE).exists()]
            if not complete:
                raise UserError(f"{key}: none of its checkpoints is complete")
            # the newest complete one; damaged, it is an error below (an older one's moments, taken with a
            # warning, were paired with model.init's weights of the newest step)
            path = complete[-1]
        if not (path / ckpt.TRAIN_STATE).is_file():
            raise UserError(f"{key} holds no optimizer state (no {ckpt.TRAIN_STATE}: an exported model folder?): give "
                            "a checkpoint folder OUTPUT/step-N of the earlier run")
        problem = ckpt.verify_checkpoint(path)
        if problem:
            where = "" if path == given else f" (its newest complete checkpoint, {path.name})"
            raise UserError(f"{key}{where}: {problem}")
        try:
            saved = flatten(to_dict(load_file(path / "config.yaml"))).get("optim.name")
        except (OSError, ValueError):
            saved = None
        if saved is not None and saved != cfg.optim.name:
            raise UserError(f"{key} holds {saved} moments, this run's optimizer is {cfg.optim.name}: set optim.name: "
                            f"{saved}, or leave optim.init_state unset to start the moments at zero")
        return str(path)

    path = Path(on_rank0("check optim.init_state", check))
    same_paths_on_every_rank({"optim.init_state": str(path)})
    try:
        n = load_optimizer_moments(path, ckpt.load_train_state(path), model, optimizer)
    except (RuntimeError, ValueError) as e:
        raise UserError(f"{key}: {e}") from None
    log.info("optimizer moments of %d parameters from %s (optim.init_state); step counters start at 0, lr and "
             "schedule are this run's", n, path)
