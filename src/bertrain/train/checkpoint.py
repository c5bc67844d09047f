"""Self-contained, atomic checkpoint folders: `OUTPUT/step-N/`.

A folder holds the model in HF format (`save_pretrained`: config.json, model.safetensors, tokenizer files), so
`from_pretrained` and `transformers` read it directly; `train_state.pt` (optimizer, scheduler, scaler, every RNG
state of every rank, data-loader state, step / samples / epoch); `config.yaml` (the resolved run config);
`manifest.json` (size and sha256 of every file) and a `COMPLETE` marker written last. It is built under a
temporary name and renamed into place, so a crash leaves either the whole folder or none. `latest_checkpoint`
returns the newest folder that is complete and whose checksums match, reporting and skipping the others.

Under `parallelism.strategy: fsdp` the weights and optimizer state are sharded instead (`dcp/`, every rank writes
its own part: `train/dcp.py`), with the same manifest, marker and checks.

`export_final` writes OUTPUT/final: the model alone (HF format, task.json for a fine-tuned one) and its model card.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from bertrain.config import save_config
from bertrain.model.bert import BertPreTrainedModel
from bertrain.model.card import CardFacts, launched_command, render, run_facts, write_card
from bertrain.utils.io import atomic_dir, atomic_write_json

log = logging.getLogger(__name__)

STEP_DIR = re.compile(r"^step-(\d+)$")
TRAIN_STATE = "train_state.pt"
MANIFEST = "manifest.json"
COMPLETE = "COMPLETE"


def checkpoint_dir(output_dir: str | Path, step: int) -> Path:
    return Path(output_dir) / f"step-{step}"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def save_torch(obj: Any, path: Path) -> None:
    """`torch.save` into a Python file: a full disk then raises torch's RuntimeError with the OS's error (ENOSPC) as
    its context, which `writing` turns into one clear line; torch's own file writer (given a path) says only
    "basic_ios::clear: iostream error". The archive's inner folder is "archive" whatever the file's name."""
    with open(path, "wb") as f:
        torch.save(obj, f)


def save_model(model: nn.Module, path: Path) -> None:
    """HF-format weights via `save_pretrained` (bertrain models); plain safetensors for other modules."""
    if hasattr(model, "save_pretrained"):
        model.save_pretrained(path)
    else:
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path / "model.safetensors"))


def load_model_weights(model: nn.Module, path: str | Path) -> None:
    """Load a checkpoint folder's weights into `model` in place (exact: safetensors keeps every bit)."""
    path = Path(path)
    if hasattr(type(model), "from_pretrained"):
        loaded = type(model).from_pretrained(path)
        model.load_state_dict(loaded.state_dict())
        if hasattr(loaded, "tokenizer_files"):
            model.tokenizer_files = loaded.tokenizer_files
    else:
        model.load_state_dict(load_file(str(path / "model.safetensors")))


def save_checkpoint(output_dir: str | Path, step: int, model: nn.Module, train_state: dict[str, Any],
                    config: Any, keep_last: int = 0) -> Path:
    """Write `OUTPUT/step-N/` atomically (rank 0 only), then keep the newest `keep_last` (0: all)."""
    target = checkpoint_dir(output_dir, step)
    with atomic_dir(target, overwrite=True) as tmp:
        save_model(model, tmp)
        save_torch(train_state, tmp / TRAIN_STATE)
        if config is not None:
            save_config(config, tmp / "config.yaml")
        files = sorted(p for p in tmp.rglob("*") if p.is_file())
        manifest = {"step": step, "files": {str(p.relative_to(tmp)): {"size": p.stat().st_size,
                                                                      "sha256": sha256_file(p)} for p in files}}
        atomic_write_json(tmp / MANIFEST, manifest)
        (tmp / COMPLETE).write_text(f"{step}\n")  # last: a folder with this marker is whole
    log.info("saved checkpoint %s", target)
    prune_checkpoints(output_dir, keep_last)
    return target


def room_warning(output_dir: str | Path, latest: Path, saves_left: int | None, keep_last: int) -> str | None:
    """A warning when the filesystem of `output_dir` has less free space than the checkpoints still to come need,
    each about the size of `latest` (just written): one more folder at a time with `keep_last` (the next one is
    complete before the oldest goes), all `saves_left` with keep_last 0 (the next one when that is unknown: a time
    budget). None when there is room: the check costs one folder listing and one statvfs."""
    if saves_left == 0:
        return None
    size = sum(p.stat().st_size for p in Path(latest).rglob("*") if p.is_file())
    count = saves_left if keep_last <= 0 and saves_left is not None else 1
    free = shutil.disk_usage(output_dir).free
    if free >= size * count:
        return None
    coming = f"the {saves_left} still to come need" if saves_left is not None else "the next one needs"
    return (f"the disk may fill before this run ends: checkpoint {Path(latest).name} takes {size / 2**20:,.1f} MiB, "
            f"{coming} about {size * count / 2**20:,.1f} MiB more (checkpoint.keep_last = {keep_last}), and "
            f"{free / 2**20:,.1f} MiB are free on {output_dir}; a save that does not fit stops the run with the last "
            "complete checkpoint kept: free space, lower checkpoint.keep_last or raise checkpoint.save_interval")


def export_final(output_dir: str | Path, model: nn.Module, extra_json: dict[str, Any] | None = None,
                 card: CardFacts | None = None) -> Path:
    """Rank 0: the final model in HF format (plus small JSON files such as task.json) in OUTPUT/final, atomically,
    with its model card (README.md, `bertrain.model.card`): from `card`, else from the run's files in OUTPUT
    (config.yaml, eval_results.json and metrics.jsonl as they are when this is called)."""
    final = Path(output_dir) / "final"
    with atomic_dir(final, overwrite=True) as tmp:
        save_model(model, tmp)
        for name, data in (extra_json or {}).items():
            atomic_write_json(tmp / name, data)
        if isinstance(model, BertPreTrainedModel):
            facts = card or run_facts(tmp, output_dir, Path(output_dir).resolve().name, final=True, in_run=True,
                                      launched=launched_command())
            write_card(tmp, render(facts, model))
    log.info("exported the final model in HF format to %s", final)
    return final


def list_checkpoints(output_dir: str | Path) -> list[tuple[int, Path]]:
    """All `step-N` folders (complete or not), oldest first."""
    out = []
    root = Path(output_dir)
    if root.is_dir():
        for p in root.iterdir():
            m = STEP_DIR.match(p.name)
            if m and p.is_dir():
                out.append((int(m.group(1)), p))
    return sorted(out)


def prune_checkpoints(output_dir: str | Path, keep_last: int) -> None:
    """Delete all but the newest `keep_last` complete folders, and temporary folders left by a killed save."""
    root = Path(output_dir)
    for stale in root.glob(".step-*.tmp"):
        shutil.rmtree(stale, ignore_errors=True)
    if keep_last <= 0:
        return
    complete = [p for _, p in list_checkpoints(root) if (p / COMPLETE).exists()]
    for p in complete[:-keep_last]:
        shutil.rmtree(p, ignore_errors=True)
        log.info("removed old checkpoint %s (keep_last=%d)", p, keep_last)


def verify_checkpoint(path: str | Path) -> str | None:
    """None if `path` is a complete checkpoint whose files match its manifest, else what is wrong."""
    path = Path(path)
    if not (path / COMPLETE).is_file():
        return "incomplete (no COMPLETE marker)"
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, json.JSONDecodeError) as e:
        return f"unreadable {MANIFEST}: {e}"
    for rel, meta in manifest.get("files", {}).items():
        f = path / rel
        if not f.is_file():
            return f"missing file {rel}"
        if f.stat().st_size != meta["size"]:
            return f"corrupt file {rel}: size {f.stat().st_size} != {meta['size']}"
        if sha256_file(f) != meta["sha256"]:
            return f"corrupt file {rel}: checksum mismatch"
    if TRAIN_STATE not in manifest.get("files", {}):
        return f"no {TRAIN_STATE}"
    return None


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The newest complete, uncorrupted `step-N` folder; each bad one newer than it is reported and skipped."""
    for step, path in reversed(list_checkpoints(output_dir)):
        problem = verify_checkpoint(path)
        if problem is None:
            return path
        log.warning("skipping checkpoint %s: %s", path, problem)
    return None


def load_train_state(path: str | Path) -> dict[str, Any]:
    """The training state of a checkpoint folder (our own file, so full unpickling is safe)."""
    return torch.load(Path(path) / TRAIN_STATE, map_location="cpu", weights_only=False)


# ----------------------------------------------------------------------------------------------- RNG states

def rng_state() -> dict[str, Any]:
    """Every RNG this process draws from: Python, NumPy, torch CPU and (if present) all CUDA devices."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def use_deterministic_kernels(enabled: bool) -> None:
    """`train.deterministic`: only deterministic kernels from here on (a process setting). cuBLAS needs its
    workspace fixed before its first call: `CUBLAS_WORKSPACE_CONFIG` is set unless the user set it already."""
    if enabled:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cudnn.benchmark = False
    torch.use_deterministic_algorithms(enabled)
    torch.backends.cudnn.deterministic = enabled


def seed_rank_rng(seed: int, rank: int, step: int) -> None:
    """Seed every RNG of this rank (dropout) as a function of (seed, rank, step): ranks differ, runs repeat."""
    s = (seed * 1_000_003 + rank * 7919 + step) % (2**31)
    random.seed(s)
    np.random.seed(s)
    torch.manual_seed(s)


def seed_micro_batch(seed: int, step: int, slot: int) -> None:
    """Seed torch's RNG (dropout) for one micro-batch from (seed, step, slot), `slot = micro_step * world + rank`:
    the micro-batch's place in the global batch (data/sampler.py), which does not depend on how the global batch is
    split into ranks and micro-steps. So dropout masks, like the samples, are the same on 2 ranks x 1 micro-step as
    on 1 rank x 2 micro-steps, and a run that continues on fewer ranks (an elastic restart on fewer nodes) keeps
    its numerics. One `manual_seed` per micro-batch costs microseconds."""
    torch.manual_seed(int(np.random.SeedSequence([seed, step, slot]).generate_state(1)[0]))


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
