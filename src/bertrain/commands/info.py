"""`bertrain info`: a model's configuration, parameter counts and training FLOPs, without loading weights."""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

from bertrain.commands.export import resolve_checkpoint

HELP = "show a model's config, parameter counts and FLOPs per token (a preset name or a model folder)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="tiny",
                        help="a preset (tiny, mini, small, medium, base, large), an HF/bertrain model or checkpoint "
                             "folder, or a run folder (its latest checkpoint); default: tiny")
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON")


def flops_per_token(config: Any, seq_len: int, training: bool = True) -> float:
    """Approximate matmul FLOPs per token of BertForPreTraining with the MLM head on every token
    (2 per multiply-add; training = forward + backward = 3x forward)."""
    H, I, L, V = config.hidden_size, config.intermediate_size, config.num_hidden_layers, config.padded_vocab_size
    per_layer = 2 * (4 * H * H + 2 * H * I) + 2 * 2 * seq_len * H    # projections + FFN, then QK^T and AV
    forward = L * per_layer + 2 * (H * H + H * V)                    # + MLM transform and decoder
    return float(3 * forward if training else forward)


def describe(model: str) -> dict[str, Any]:
    # torch and the model only when run: `bertrain --help` and `bertrain info --help` import nothing heavy
    import torch

    from bertrain.model.bert import PRESETS, BertConfig, BertForPreTraining, BertModel
    from bertrain.model.hf import computed_config, config_from_json_file, find_config_file

    if Path(model).exists():  # a folder the user made wins over a preset of the same name (said below)
        if model in PRESETS:
            logging.getLogger(__name__).warning("--model %s: the folder %s, not the preset %s (run `bertrain info` "
                                                "elsewhere for the preset)", model, Path(model).resolve(), model)
        folder = resolve_checkpoint(Path(model))  # a run folder: its latest checkpoint
        config_file = find_config_file(folder)
        # as the folder's weights are computed: Google's and NVIDIA's checkpoints change their config's "gelu"
        config, source = computed_config(folder, config_from_json_file(config_file), config_file), str(config_file)
    elif model in PRESETS:
        config, source = BertConfig.from_preset(model), f"preset {model}"
    else:
        raise ValueError(f"--model {model!r} is neither a preset ({', '.join(PRESETS)}) nor an existing folder")
    with torch.device("meta"):  # shapes only: instant even for BERT-Large
        encoder, pretraining = BertModel(config), BertForPreTraining(config)
    H = config.hidden_size
    embeddings = sum(p.numel() for p in encoder.embeddings.parameters()) - (
        config.padded_vocab_size - config.vocab_size) * H
    return {
        "source": source,
        "config": dataclasses.asdict(config),
        "padded_vocab_size": config.padded_vocab_size,
        "parameters": {
            "BertModel": encoder.num_parameters(),
            "BertForPreTraining": pretraining.num_parameters(),
            "embeddings": embeddings,
            "encoder_layers": sum(p.numel() for p in encoder.encoder.parameters()),
        },
        "train_flops_per_token": {str(t): flops_per_token(config, t) for t in (128, 512)
                                  if t <= config.max_position_embeddings},
    }


def run(args: argparse.Namespace) -> int:
    info = describe(args.model)
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"model: {info['source']}")
    for k, v in info["config"].items():
        print(f"  {k:30s} {v}")
    print(f"  {'padded_vocab_size':30s} {info['padded_vocab_size']}  (internal)")
    print("parameters (without vocabulary padding):")
    for k, v in info["parameters"].items():
        print(f"  {k:30s} {v:>14,}  ({v / 1e6:.1f}M)")
    print("training FLOPs per token (forward + backward, MLM head on every token):")
    for t, f in info["train_flops_per_token"].items():
        print(f"  seq_len {t:>4s}                   {f:.3e}")
    return 0
