"""How a model runs (not what it computes): the speed options, applied by one plain function.

Pretraining, fine-tuning and `bertrain bench` all call `apply_model_options`; every option is tested equal to the
plain path (tests/test_fastpath.py), so switching one never changes a result beyond float rounding.
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import nn


@dataclass
class ModelOptionsConfig:
    unpad: bool = True
    """Run the encoder on the real tokens only where no output depends on padding (pretraining with masked
    positions, classification; QA only outside training: HF's loss sees the padding positions' logits, so QA
    training keeps padding, and inference gives padding a logit of -10000, which changes no prediction)."""
    jagged_attention: bool = False
    """Unpadded runs: attention on nested (jagged) tensors, no padding even inside attention (SDPA's
    variable-length flash kernel on CUDA with bf16/fp16). Same results; 19% slower on CPU (BENCHMARKS.md)."""
    gradient_checkpointing: bool = False
    """Recompute each encoder layer's activations in the backward pass (less memory, ~1/3 more compute)."""
    compile: bool = False
    """torch.compile each encoder layer (dynamic shapes; worth it on GPU, minutes of compile time on CPU)."""


def apply_model_options(model: nn.Module, options: ModelOptionsConfig) -> nn.Module:
    """Switch `model`'s speed options in place (any bertrain model: the encoder or a model with a head); the model
    reads them at every forward. Returns `model`."""
    encoder = getattr(model, "bert", model)  # a head's encoder, or the encoder itself
    encoder.unpad = options.unpad
    encoder.jagged_attention = options.jagged_attention
    encoder.gradient_checkpointing = options.gradient_checkpointing
    if options.compile:
        # Per layer, with dynamic shapes: the token count N and the padded length T' are symbolic, so one graph
        # serves every batch (T' is a multiple of 8, which bounds the specialisations).
        for layer in encoder.encoder.layer:
            layer.compile(dynamic=True)
    return model
