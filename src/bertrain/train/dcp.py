"""Sharded checkpoints (`parallelism.strategy: fsdp`) through `torch.distributed.checkpoint` (DCP), and loading
either kind of checkpoint into either kind of model.

An FSDP checkpoint is the same `OUTPUT/step-N/` folder as a DDP one (`train/checkpoint.py`), with the weights and
optimizer state in `dcp/` instead of `model.safetensors` + `train_state.pt["optimizer"]`:

    step-N/dcp/__R_0.distcp, .metadata   each rank writes its own shards, in parallel; rank 0 the metadata
    step-N/train_state.pt                 "format": "dcp", and everything else a DDP checkpoint holds (scheduler,
                                          scaler, every rank's RNG state, loader position, counters)
    step-N/config.yaml, manifest.json, COMPLETE

The rules of `train/checkpoint.py` hold: the folder is built under a temporary name and renamed into place by
rank 0 once every rank's shards are written; `manifest.json` has the size and sha256 of every file (each rank
hashes a share of the files, in parallel), `COMPLETE` comes last, so `latest_checkpoint` skips a folder with a
missing, truncated or corrupt shard exactly as it skips a corrupt `model.safetensors`.

Loading (`load_model_and_optimizer`), every combination:

* DCP checkpoint -> FSDP model: DCP reads each rank's shards, resharding when the world size changed.
* DCP checkpoint -> DDP / one-process model: the same call with plain tensors: DCP assembles full tensors.
* DDP checkpoint -> FSDP model: the full weights (HF safetensors) and the optimizer's own state dict (keyed by
  position, turned into parameter names) are scattered to the shards (`set_*_state_dict(full_state_dict=True)`).
* DDP checkpoint -> DDP model: `load_state_dict`, as before.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as torch_dcp
from safetensors.torch import load_file
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions, get_model_state_dict, get_optimizer_state_dict, set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import FSDPModule

from bertrain.config import save_config
from bertrain.model.bert import BertForSequenceClassification, BertPreTrainedModel
from bertrain.model.hf import save_config_and_tokenizer
from bertrain.train import checkpoint as ckpt
from bertrain.train.distributed import DistInfo, broadcast_object, gather_objects, is_distributed
from bertrain.utils.errors import OutputError
from bertrain.utils.io import atomic_write_json, dir_mode, replace_dir

log = logging.getLogger(__name__)

DCP_DIR = "dcp"
FORMAT = "dcp"


def is_sharded_checkpoint(path: str | Path) -> bool:
    return (Path(path) / DCP_DIR).is_dir()


def shard_files(metadata: Any, folder: Path) -> list[str]:
    """The shard files (relative to `folder`) of every rank that the DCP checkpoint `folder` names: from the
    `Metadata` that `dcp.save` returned where it holds them (torch >= 2.13), else from the `.metadata` file rank 0
    wrote (torch 2.11's save returns its Metadata without `storage_data`)."""
    storage = getattr(metadata, "storage_data", None)
    if not storage:
        storage = torch_dcp.FileSystemReader(str(folder)).read_metadata().storage_data or {}
    return sorted({info.relative_path for info in storage.values()})


def save_sharded_checkpoint(output_dir: str | Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                            train_state: dict[str, Any], config: Any, keep_last: int, dist: DistInfo) -> Path:
    """Write `OUTPUT/step-N/` from every rank (collective: call on all ranks with the same arguments).

    Raises on a rank that failed; the caller makes every rank agree on the outcome. Every collective in here is
    reached by every rank whatever fails, so a failure never leaves a rank waiting."""
    target = ckpt.checkpoint_dir(output_dir, step)
    tmp: Path | None = None
    if dist.is_main:  # the temporary folder, and the files only rank 0 has
        try:
            Path(output_dir).mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=output_dir))
            os.chmod(tmp, dir_mode())
            ckpt.save_torch({**train_state, "format": FORMAT}, tmp / ckpt.TRAIN_STATE)
            if config is not None:
                save_config(config, tmp / "config.yaml")
            if isinstance(model, BertPreTrainedModel):  # config.json + tokenizer: a self-contained folder
                save_config_and_tokenizer(model, tmp, plain_class(model).__name__)
        except BaseException:  # whatever it is, the other ranks must not wait for a folder that never comes
            broadcast_object(None)
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
            raise
    shared = broadcast_object(str(tmp) if tmp else None)
    if shared is None:
        raise OutputError(f"rank 0 could not start checkpoint step-{step} in {output_dir} (see its message)")
    tmp = Path(shared)
    try:
        state = {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer)}
        metadata = torch_dcp.save(state, checkpoint_id=tmp / DCP_DIR, no_dist=not is_distributed())
    except torch_dcp.CheckpointException as e:  # raised on every rank when any rank failed to write its shards
        if dist.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise OutputError(f"writing the shards of checkpoint step-{step} in {output_dir} failed: {e}") from None
    # every file exists now (DCP's save ends after rank 0 wrote the metadata): each rank hashes a share of them.
    # The list is rank 0's, and names every shard file of DCP's metadata (every rank's, wherever it wrote it),
    # not what each rank's directory listing shows: a shared filesystem may list another node's new file late, and
    # a share taken from two different listings would leave files out of the manifest.
    names = None
    if dist.is_main:
        names = sorted({str(p.relative_to(tmp)) for p in tmp.rglob("*") if p.is_file()}
                       | {f"{DCP_DIR}/{path}" for path in shard_files(metadata, tmp / DCP_DIR)})
    files = [tmp / name for name in broadcast_object(names)]
    mine: dict[str, Any] = {}
    try:
        for p in files[dist.rank::dist.world_size]:
            mine[str(p.relative_to(tmp))] = {"size": p.stat().st_size, "sha256": ckpt.sha256_file(p)}
    except OSError as e:
        mine = {"error": f"rank {dist.rank}: {e}"}
    shares = gather_objects(mine)
    errors = [s["error"] for s in shares if "error" in s]
    if errors:
        if dist.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise OutputError(f"checkpoint step-{step} in {output_dir}: could not read back the shards: "
                          + "; ".join(errors))
    if not dist.is_main:
        return target
    try:
        manifest = {"step": step, "files": {k: v for s in shares for k, v in sorted(s.items())}}
        atomic_write_json(tmp / ckpt.MANIFEST, manifest)
        (tmp / ckpt.COMPLETE).write_text(f"{step}\n")  # last: a folder with this marker is whole
        replace_dir(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("saved sharded checkpoint %s (%d ranks)", target, dist.world_size)
    ckpt.prune_checkpoints(output_dir, keep_last)
    return target


def load_model_and_optimizer(path: str | Path, train_state: dict[str, Any], model: nn.Module,
                             optimizer: torch.optim.Optimizer, load_optimizer: bool = True) -> None:
    """Load a checkpoint's weights (and optimizer state) into `model` (FSDP-sharded or plain) and `optimizer`.

    Collective under FSDP or for a DCP checkpoint: every rank calls it. See the module docstring."""
    path = Path(path)
    sharded_model = isinstance(model, FSDPModule)
    if is_sharded_checkpoint(path):
        # sharded model: DTensors, each rank reads its shards; plain model: DCP assembles full tensors
        state: dict[str, Any] = {"model": get_model_state_dict(model)}
        if load_optimizer:  # (fills the state of a fresh optimizer first, so that DCP knows what to read)
            state["optimizer"] = get_optimizer_state_dict(model, optimizer)
        try:
            torch_dcp.load(state, checkpoint_id=path / DCP_DIR, no_dist=not is_distributed())
        except torch_dcp.CheckpointException as e:
            raise ValueError(f"the sharded weights in {path / DCP_DIR} do not fit this model: {e}") from None
        set_model_state_dict(model, state["model"])
        if load_optimizer:
            set_optimizer_state_dict(model, optimizer, state["optimizer"])
        return
    if not sharded_model:
        ckpt.load_model_weights(model, path)
        if load_optimizer:
            optimizer.load_state_dict(train_state["optimizer"])
        return
    full = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, _full_weights(model, path), options=full)
    if load_optimizer:
        set_optimizer_state_dict(model, optimizer, optimizer_state_by_name(model, optimizer, train_state["optimizer"]),
                                 options=full)


def load_optimizer_moments(path: str | Path, train_state: dict[str, Any], model: nn.Module,
                           optimizer: torch.optim.Optimizer) -> int:
    """Start `optimizer` from the moments of another run's checkpoint (`optim.init_state`): its per-parameter state
    with every step counter set to 0, under this optimizer's own hyperparameters (lr, betas, the schedule's
    initial_lr). Any combination of DCP / DDP checkpoint and FSDP / plain model, as `load_model_and_optimizer`;
    collective under FSDP or for a DCP checkpoint. Returns the number of parameters whose state was loaded."""
    path = Path(path)
    own_groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}  # full shapes, also of FSDP's sharded DTensors
    if is_sharded_checkpoint(path):
        state = {"optimizer": get_optimizer_state_dict(model, optimizer)}  # a fresh optimizer's, filled: the keys
        try:
            torch_dcp.load(state, checkpoint_id=path / DCP_DIR, no_dist=not is_distributed())
        except torch_dcp.CheckpointException as e:
            raise ValueError(f"its optimizer state does not fit this model's parameters: {e}") from None
        by_name = state["optimizer"]
    else:
        if "optimizer" not in train_state:
            raise ValueError("it holds no optimizer state")
        by_name = optimizer_state_by_name(model, optimizer, train_state["optimizer"])
        for name, st in by_name["state"].items():
            for key, value in st.items():
                if torch.is_tensor(value) and value.dim() > 0 and tuple(value.shape) != shapes[name]:
                    raise ValueError(f"its {key} of {name} has shape {tuple(value.shape)}, this model's parameter "
                                     f"{shapes[name]}")
    for st in by_name["state"].values():
        if "step" in st:  # a tensor (torch's AdamW, LAMB) or a number
            st["step"] = torch.zeros_like(st["step"]) if torch.is_tensor(st["step"]) else 0
    by_name["param_groups"] = [{**own, "params": g["params"]} for own, g in zip(own_groups, by_name["param_groups"])]
    if isinstance(model, FSDPModule) or is_sharded_checkpoint(path):
        set_optimizer_state_dict(model, optimizer, by_name,
                                 options=StateDictOptions(full_state_dict=not is_sharded_checkpoint(path)))
    else:  # by name back to by position: the form `load_state_dict` takes
        index = {n: i for i, n in enumerate(n for g in by_name["param_groups"] for n in g["params"])}
        optimizer.load_state_dict({
            "state": {index[n]: st for n, st in by_name["state"].items()},
            "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in by_name["param_groups"]]})
    return len(by_name["state"])


def plain_class(model: nn.Module) -> type:
    """The model's own class (FSDP2 makes a subclass of it)."""
    return next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule))


def load_sharded_model(path: str | Path) -> BertPreTrainedModel:
    """The model of a sharded checkpoint, whole, in this one process (for `bertrain export`): built from the folder's
    config.json and tokenizer files, its weights assembled by DCP from every rank's shards."""
    from bertrain.model.hf import config_from_json_file, model_class_for, read_tokenizer_files

    path = Path(path)
    if not (path / "config.json").is_file():
        raise ValueError(f"{path} is a sharded checkpoint from an older bertrain, without config.json: export the "
                         "run's final/ folder, or continue the run from it with --resume and export its final/")
    cls = model_class_for(path)
    config = config_from_json_file(path / "config.json")
    raw = json.loads((path / "config.json").read_text(encoding="utf-8"))
    if cls is BertForSequenceClassification:
        id2label = {int(k): v for k, v in (raw.get("id2label") or {}).items()}
        model = cls(config, num_labels=len(id2label) or raw.get("num_labels", 2))
        if id2label:
            model.id2label = id2label
    else:
        model = cls(config)
    model.tokenizer_files = read_tokenizer_files(path)
    with warnings.catch_warnings():  # DCP says it loads in one process: that is the point here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        load_model_and_optimizer(path, {}, model, None, load_optimizer=False)  # type: ignore[arg-type]
    model.loading_info = {"initialized": [], "missing_keys": [], "unexpected_keys": []}
    return model.eval()


def _full_weights(model: nn.Module, path: Path) -> dict[str, torch.Tensor]:
    """The full state dict of a DDP checkpoint folder, read as its own class reads it."""
    cls = plain_class(model)
    if not hasattr(cls, "from_pretrained"):
        return load_file(str(path / "model.safetensors"))
    loaded = cls.from_pretrained(path)
    if hasattr(loaded, "tokenizer_files"):
        model.tokenizer_files = loaded.tokenizer_files
    return loaded.state_dict()


def optimizer_state_by_name(model: nn.Module, optimizer: torch.optim.Optimizer,
                            saved: dict[str, Any]) -> dict[str, Any]:
    """`optimizer.state_dict()` of a DDP run (parameters by position in the groups) keyed by parameter name, the
    form `set_optimizer_state_dict` takes. Positions match because `build_optimizer` groups the parameters of the
    same model in the same order whatever the strategy."""
    names = {id(p): n for n, p in model.named_parameters()}
    if len(saved["param_groups"]) != len(optimizer.param_groups):
        raise ValueError(f"the checkpoint's optimizer has {len(saved['param_groups'])} parameter groups, this model's "
                         f"{len(optimizer.param_groups)}")
    state, groups = {}, []
    for group, old in zip(optimizer.param_groups, saved["param_groups"]):
        if len(group["params"]) != len(old["params"]):
            raise ValueError(f"the checkpoint's optimizer group holds {len(old['params'])} parameters, this model's "
                             f"{len(group['params'])}")
        fqns = [names[id(p)] for p in group["params"]]
        state.update({fqn: saved["state"][i] for fqn, i in zip(fqns, old["params"]) if i in saved["state"]})
        groups.append({**old, "params": fqns})
    return {"state": state, "param_groups": groups}
