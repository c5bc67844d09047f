"""How the ranks divide a model: DDP (every rank a full copy) or FSDP2 (every rank 1/world of it).

In the manner of torchtitan's `parallelize.py`: plain functions applied to the model, never a subclass of it.

* `ParallelDims.from_config(cfg, world_size)` checks, before any work, that the configured strategy fits the
  job (torchtitan's `ParallelDims`: the product of the degrees is the world size) and refuses what does not,
  naming the key, every problem at once.
* `apply_fsdp(model, cfg, dist)` shards the model in place with PyTorch's `fully_shard`: one unit per transformer
  layer (its weights are all-gathered just before it runs, and freed after it if `reshard_after_forward`) and the
  root (embeddings, pooler, heads: the tied word-embedding/decoder weight stays inside one unit). Parameters become
  `DTensor`s sharded on dim 0; gradients arrive reduce-scattered (averaged over ranks, as DDP's all-reduce) and
  the optimizer steps only the local shard. A `MixedPrecisionPolicy` gathers and computes in bf16/fp16 while the
  sharded master weights, gradients and optimizer state stay fp32.
* `meta_copy` / `gather_full_model`: the trained model as one plain module again (every rank), for evaluation and
  the HF export that `transformers` loads.
"""
from __future__ import annotations

import copy
import itertools
import warnings
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from bertrain.model.bert import BertLayer
from bertrain.train.config import ParallelismConfig, TrainerConfig
from bertrain.train.distributed import DistInfo, is_distributed

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class ParallelDims:
    """dp_replicate x dp_shard = world size: ddp replicates over every rank; fsdp shards over `dp_shard` ranks
    (`parallelism.dp_shard`, all by default) and replicates over the rest (HSDP)."""
    dp_replicate: int
    dp_shard: int
    one_rank: bool = False
    """fsdp on a one-rank process group (a launcher's one-rank job, e.g. an elastic job shrunk to one node): nothing
    is split, but every FSDP2 code path runs (mixed-precision gathers, sharded optimizer state, DCP checkpoints), e.g. on one GPU."""

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_enabled(self) -> bool:
        return self.dp_shard > 1 or self.one_rank

    @classmethod
    def from_config(cls, cfg: TrainerConfig, world_size: int) -> "ParallelDims":
        """The degrees for `cfg.parallelism` on `world_size` ranks; a ValueError naming every key that does not fit."""
        p, mode = cfg.parallelism, cfg.precision.mode
        fsdp = p.strategy == "fsdp"
        errors = []  # all at once, each naming its key
        one_rank = fsdp and world_size == 1 and is_distributed()
        if fsdp and world_size < 2 and not one_rank:
            errors.append("config key 'parallelism.strategy' is fsdp but the job has 1 rank: there is nothing to "
                          "shard across; use ddp, or launch 2 or more ranks (torchrun --nproc-per-node N; a "
                          "launcher's one-rank job runs FSDP2 on one rank)")
        compression = cfg.distributed.grad_compression
        if fsdp and compression != "none":
            errors.append(f"config key 'distributed.grad_compression' ({compression}) is a DDP allreduce hook; "
                          "under fsdp set 'parallelism.reduce_dtype' instead (the reduce-scatter dtype)")
        if fsdp and "fp16" in (p.param_dtype, p.reduce_dtype) and mode != "fp16":
            errors.append("config keys 'parallelism.param_dtype'/'reduce_dtype' fp16 need the loss scaling "
                          f"of 'precision.mode' fp16 (it is {mode}); use bf16, or precision.mode fp16")
        shard = p.dp_shard or world_size
        if fsdp and not one_rank and world_size >= 2 and (shard < 2 or world_size % shard):
            errors.append(f"config key 'parallelism.dp_shard' ({p.dp_shard}) must divide the world size "
                          f"({world_size}) and be at least 2: dp_replicate x dp_shard = world size; use 0 for all "
                          "ranks, or a divisor such as the GPUs per node")
        if not fsdp:
            default = ParallelismConfig()
            errors += [f"config key 'parallelism.{key}' ({getattr(p, key)}) applies only with parallelism.strategy "
                       f"fsdp (it is {p.strategy}); remove it or set the strategy to fsdp"
                       for key in ("reshard_after_forward", "param_dtype", "reduce_dtype", "dp_shard")
                       if getattr(p, key) != getattr(default, key)]
        if errors:
            raise ValueError("; ".join(errors))
        return cls(world_size // shard, shard, one_rank) if fsdp else cls(world_size, 1)


def mixed_precision_policy(cfg: TrainerConfig) -> MixedPrecisionPolicy:
    """Gather/compute dtype and gradient-reduction dtype (the sharded fp32 master weights are never cast)."""
    p = cfg.parallelism
    name = p.param_dtype
    if name == "auto":
        name = cfg.precision.mode if cfg.precision.mode in ("bf16", "fp16") else "fp32"
    param_dtype = DTYPES[name]
    return MixedPrecisionPolicy(param_dtype=None if param_dtype == torch.float32 else param_dtype,
                                reduce_dtype=DTYPES[p.reduce_dtype])


def transformer_layers(model: nn.Module) -> list[nn.Module]:
    """The units FSDP shards separately: the encoder layers, in forward order."""
    return [m for m in model.modules() if isinstance(m, BertLayer)]


def apply_fsdp(model: nn.Module, cfg: TrainerConfig, dist: DistInfo) -> nn.Module:
    """Shard `model` in place with FSDP2 over all ranks, or HSDP with `parallelism.dp_shard` (see the module
    docstring); returns it.

    Call before building the optimizer: `fully_shard` replaces the parameters with sharded ones."""
    reshard = cfg.parallelism.reshard_after_forward
    dims = ParallelDims.from_config(cfg, dist.world_size)
    if dims.dp_replicate > 1:  # HSDP: shard within groups of consecutive ranks (a node), replicate across them
        mesh = init_device_mesh(dist.device.type, (dims.dp_replicate, dims.dp_shard),
                                mesh_dim_names=("dp_replicate", "dp_shard"))
    else:
        mesh = init_device_mesh(dist.device.type, (dist.world_size,), mesh_dim_names=("dp_shard",))
    policy = mixed_precision_policy(cfg)
    layers = transformer_layers(model)
    for i, layer in enumerate(layers):
        # backward starts with the last layer: freeing its weights after forward would only gather them again
        fully_shard(layer, mesh=mesh, mp_policy=policy,
                    reshard_after_forward=reshard and i < len(layers) - 1)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)
    # FSDP2 warns once that the root returned a view (an in-place op on it would skip the backward hook): our
    # losses read the outputs out of place, so the warning would only alarm users.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    return model


def is_sharded(model: nn.Module) -> bool:
    return isinstance(model, FSDPModule)


def meta_copy(model: nn.Module) -> nn.Module:
    """A copy of `model` (attributes, options, tokenizer files) whose parameters and buffers live on the meta
    device: the structure to rebuild the full model in after training, without a second copy of the weights."""
    memo: dict[int, torch.Tensor] = {}
    for t in itertools.chain(model.parameters(), model.buffers()):
        empty = torch.empty_like(t, device="meta")
        memo[id(t)] = nn.Parameter(empty, t.requires_grad) if isinstance(t, nn.Parameter) else empty
    return copy.deepcopy(model, memo)


def gather_full_model(sharded: nn.Module, template: nn.Module, device: torch.device) -> nn.Module:
    """The sharded model's weights, all-gathered on every rank into `template` (from `meta_copy`), a plain module.

    Every rank takes part (collective). Every rank gets the model because evaluation after fine-tuning runs on
    all of them; rank 0 alone writes the HF export from it."""
    full = get_model_state_dict(sharded, options=StateDictOptions(full_state_dict=True))
    model = template.to_empty(device=device)
    model.load_state_dict(full)
    state_keys = set(full)
    for name, buffer in sharded.named_buffers():  # non-persistent buffers are not in the state dict
        if name not in state_keys:
            model.get_buffer(name).copy_(buffer)
    model.train(sharded.training)
    return model
