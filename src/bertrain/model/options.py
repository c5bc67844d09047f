"""How a model runs (not what it computes): the speed options, applied by one plain function.

Pretraining, fine-tuning and `bertrain bench` all call `apply_model_options`; every option is tested equal to the
plain path (tests/test_fastpath.py), so switching one never changes a result beyond float rounding.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.utils.checkpoint
from torch import nn

from bertrain.model.bert import BertLayer
from bertrain.model.unpad import AttentionLayout


@dataclass
class ModelOptionsConfig:
    unpad: bool = True
    """Run the encoder on the real tokens only where no output depends on padding (pretraining with masked
    positions, classification; QA only outside training: HF's loss sees the padding positions' logits, so QA
    training keeps padding, and inference gives padding a logit of -10000, which changes no prediction). Sets
    `BertModel.unpad`, the one unpadding switch."""
    jagged_attention: bool = False
    """Unpadded runs: attention on nested (jagged) tensors, no padding even inside attention (SDPA's
    variable-length flash kernel on CUDA with bf16/fp16). Same results; 19% slower on CPU (BENCHMARKS.md)."""
    per_sequence_attention: bool = True
    """Unpadded runs on CPU, not compiled and not jagged: attention one sequence at a time on its own rows, without
    the padded (B, T') grid, its mask, its dropout draws and its zero fill, in batches where the grid would waste
    enough (`unpad.PER_SEQUENCE_MIN_SAVED`; same results; a MiniLM-sized training step at fill 0.67 is 4-5% faster,
    a 2-head model at length 64 would be slower and keeps the grid: BENCHMARKS.md "Time to quality"). Ignored on a GPU (a kernel launch per sequence) and with compile (the lengths would be new constants
    every batch)."""
    prune_last_layer: bool = True
    """Where the caller reads the last layer at a few positions only ([CLS] for classification, [CLS] and the masked
    positions for pretraining with masked positions), the last layer computes those rows only: their queries,
    attention output, FFN and LayerNorms; keys and values still at every token. The same results (float rounding);
    saves about 10/12 of one layer's Linear work per unread token: a MiniLM fine-tuning step 0.90x, a 4-layer
    pretraining step 0.88x (BENCHMARKS.md, "Techniques" and "Time to quality"). Sets `BertModel.prune_last_layer`."""
    gradient_checkpointing: bool = False
    """Recompute each encoder layer's activations in the backward pass (less memory, ~1/3 more compute); only
    where grad is enabled (no cost in evaluation)."""
    compile: bool = False
    """torch.compile each encoder layer (dynamic shapes; worth it on GPU, minutes of compile time on CPU)."""


class CheckpointedBertLayer(BertLayer):
    """A `BertLayer` that keeps only its input for the backward pass and recomputes the rest there.

    `apply_model_options` turns a layer into one in place (it sets the layer's class, as FSDP2's `fully_shard`
    does), not by wrapping it as torch's `checkpoint_wrapper` does: the parameters keep their names, so the
    state_dict, the HF export, checkpoint folders and the optimizer's grouping by name see the same model. Like
    torchtitan's block wrapper, FSDP2 shards the layer around it and compile traces through it."""

    def forward(self, x: torch.Tensor, layout: AttentionLayout, rows: torch.Tensor | None = None) -> torch.Tensor:
        if not torch.is_grad_enabled():  # nothing to keep for a backward pass: nothing to recompute
            return super().forward(x, layout, rows)
        # Dropout draws the same numbers again (checkpoint restores the RNG state). The recompute check compares
        # the saved tensors' shapes, which nested (jagged) tensors do not have.
        return torch.utils.checkpoint.checkpoint(super().forward, x, layout, rows, use_reentrant=False,
                                                 determinism_check="default" if layout.jagged is None else "none")


def apply_model_options(model: nn.Module, options: ModelOptionsConfig) -> nn.Module:
    """Switch `model`'s speed options in place (any bertrain model: the encoder or a model with a head); returns
    `model`. Idempotent (the trainer applies them again to the model gathered back from FSDP shards); call it before
    sharding. Unpadding and jagged attention are attributes the encoder reads at every forward; checkpointing and
    compile are applied per encoder layer, from outside (a layer without them is a plain `BertLayer`)."""
    encoder = getattr(model, "bert", model)  # a head's encoder, or the encoder itself
    encoder.unpad = options.unpad
    encoder.jagged_attention = options.jagged_attention
    encoder.per_sequence_attention = options.per_sequence_attention and not options.compile
    encoder.prune_last_layer = options.prune_last_layer
    for layer in encoder.encoder.layer:
        if type(layer) not in (BertLayer, CheckpointedBertLayer):
            raise TypeError(f"apply_model_options: an encoder layer is a {type(layer).__name__}; apply the options "
                            f"to the plain model, before sharding it")
        layer.__class__ = CheckpointedBertLayer if options.gradient_checkpointing else BertLayer
    if options.compile:
        # Per layer, with dynamic shapes: the token count N and the padded length T' are symbolic, so one graph
        # serves every batch (T' is a multiple of 8, which bounds the specialisations).
        for layer in encoder.encoder.layer:
            layer.compile(dynamic=True)
    return model
