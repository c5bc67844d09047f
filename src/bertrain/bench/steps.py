"""What the bench times: the two models with the same weights, the optimizer, and the step functions."""
from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from bertrain.model.bert import BertForPreTraining, BertForQuestionAnswering, BertForSequenceClassification
from bertrain.model.hf import config_to_hf_dict, to_hf_state_dict
from bertrain.train.config import OptimConfig
from bertrain.train.optim import Lamb, build_optimizer, param_groups

DTYPES = {"fp32": None, "tf32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


# ----------------------------------------------------------------------------------------------- models

def build_hf(ours: nn.Module, attn_implementation: str = "sdpa") -> nn.Module:
    """transformers' counterpart of `ours` with the same weights (our key map: QKV split, vocab padding sliced)."""
    import transformers  # optional (`pip install bertrain[bench]`): only --compare hf needs it

    cls_name = {BertForPreTraining: "BertForPreTraining", BertForQuestionAnswering: "BertForQuestionAnswering",
                BertForSequenceClassification: "BertForSequenceClassification"}[type(ours)]
    hf_config = transformers.BertConfig(**config_to_hf_dict(ours.config, [cls_name]))
    if isinstance(ours, BertForSequenceClassification):
        hf_config.num_labels = ours.num_labels
    hf = getattr(transformers, cls_name)._from_config(hf_config, attn_implementation=attn_implementation)
    state = {k: v.detach().clone() for k, v in to_hf_state_dict(ours).items()}
    missing, unexpected = hf.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith(("position_ids", "decoder.weight", "decoder.bias"))]
    if missing or unexpected:
        raise RuntimeError(f"HF model does not match ours: missing {missing}, unexpected {unexpected}")
    hf.tie_weights()
    return hf


class SplitQKV(nn.Module):
    """Ablation of the fused QKV projection (`--separate-qkv`): three GEMMs on the three row blocks of the same fused
    weight (so the parameters, their gradients and the optimizer are unchanged), concatenated back for attention."""

    def __init__(self, fused: nn.Linear):
        super().__init__()
        self.fused = fused

    # The pruned last layer (`BertSelfAttention.attend_from`) reads the weight's row blocks itself: queries on a few
    # rows, keys and values on all, already separate GEMMs there.
    @property
    def weight(self) -> torch.Tensor:
        return self.fused.weight

    @property
    def bias(self) -> torch.Tensor:
        return self.fused.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ws, bs = self.fused.weight.chunk(3, 0), self.fused.bias.chunk(3, 0)
        return torch.cat([F.linear(x, w, b) for w, b in zip(ws, bs)], dim=-1)


def split_qkv(model: nn.Module) -> None:
    """Replace every fused `qkv` Linear by `SplitQKV` (in place, same parameters)."""
    for m in model.modules():
        if isinstance(getattr(m, "qkv", None), nn.Linear):
            m.qkv = SplitQKV(m.qkv)


def bench_optimizer(model: nn.Module, name: str, foreach: bool = True) -> torch.optim.Optimizer:
    """The optimizer both sides use. foreach=True: the trainer's own (`train.optim.build_optimizer`: fused AdamW,
    HF Trainer's default `adamw_torch_fused`; or LAMB, multi-tensor on CUDA and per-tensor on CPU). foreach=False:
    the per-tensor loop of the same algorithm (the `--no-foreach` ablation, which the trainer does not offer)."""
    cfg = OptimConfig(name=name)
    if foreach:
        return build_optimizer(model, cfg)
    groups = param_groups(model, cfg.weight_decay)
    if name == "lamb":
        return Lamb(groups, lr=cfg.lr, foreach=False)
    return torch.optim.AdamW(groups, lr=cfg.lr, foreach=False)


def optimizer_form(name: str, foreach: bool, device: torch.device) -> str:
    """How `bench_optimizer(model, name, foreach)` runs on `device`, for the report."""
    if not foreach:
        return "per-tensor loop"
    if name == "lamb":
        return "multi-tensor" if device.type == "cuda" else "per-tensor, the CPU default"
    return "fused"


# ----------------------------------------------------------------------------------------------- steps

def _autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    dtype = DTYPES[precision]
    return torch.autocast(device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext()


def make_train_step(model: nn.Module, forward: Callable[[], torch.Tensor], optimizer: torch.optim.Optimizer,
                    device: torch.device, precision: str, foreach: bool = True) -> Callable[[], None]:
    """forward (under autocast) -> backward -> clip to norm 1 -> optimizer step -> zero grads: the trainer's step."""
    scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")
    params = [p for p in model.parameters() if p.requires_grad]

    def step() -> None:
        with _autocast(device, precision):
            loss = forward()
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=foreach)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)

    return step


def make_inference_step(forward: Callable[[], Any], device: torch.device, precision: str) -> Callable[[], None]:
    def step() -> None:
        with torch.inference_mode(), _autocast(device, precision):
            forward()

    return step


def pretrain_forward(model: nn.Module, b: dict[str, torch.Tensor], ours: bool,
                     masked_head: bool = True) -> Callable[[], torch.Tensor]:
    x = dict(input_ids=b["input_ids"], token_type_ids=b["token_type_ids"], attention_mask=b["attention_mask"])
    if ours and masked_head:
        kw = dict(masked_positions=b["masked_positions"], labels=b["masked_labels"])
    else:  # HF's interface (and our full-head ablation): logits for every token, labels (B, T)
        kw = dict(labels=b["labels"])
    return lambda: model(**x, **kw, next_sentence_label=b["next_sentence_labels"]).loss


def qa_forward(model: nn.Module, b: dict[str, torch.Tensor], with_loss: bool) -> Callable[[], Any]:
    x = dict(input_ids=b["input_ids"], token_type_ids=b["token_type_ids"], attention_mask=b["attention_mask"])
    if with_loss:
        return lambda: model(**x, start_positions=b["start_positions"], end_positions=b["end_positions"]).loss
    return lambda: model(**x).start_logits
