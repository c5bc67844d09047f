"""BERT (Devlin et al., 2018) in one file: config and presets, the encoder, and the pretraining / classification /
span-extraction heads. Read it top to bottom; shapes are in the comments (B batch, T tokens, H hidden,
nh heads, hs head size, P masked positions, V vocabulary).

Module and parameter names follow Hugging Face's `BertModel` so that anyone who knows it finds their way, with one
difference: the query/key/value projections are a single fused Linear (`attention.self.qkv`, H -> 3H). The key map
in `bertrain.model.hf` splits and concatenates them; it is the only place that knows about checkpoint formats
(config.json, weight files), and it imports this module, never the reverse.

The vocabulary is padded internally to a multiple of `pad_vocab_size_multiple` (8) so that the embedding and
decoder matmuls get tensor-core friendly shapes. The extra embedding rows and decoder-bias entries start at zero and
stay zero (no input id reaches them and the logits are sliced back to `vocab_size` before any loss), so exporting
by slicing and importing by zero-padding is lossless.

This file says what the model computes, not how it is run. The fast paths (each tested equal to the plain path in
tests/test_fastpath.py, measured in BENCHMARKS.md) are switched by `bertrain.model.options.apply_model_options`:
* `BertModel.unpad`, the one unpadding switch: embeddings, projections, FFN and LayerNorms run on the real tokens
  only, a flat (N, H) tensor, in every call whose caller reads no output at a padding position
  (`BertModel.forward(..., reads_padding=False)`: pretraining with masked positions, classification, QA outside
  training). `BertModel.forward` picks the batch's `AttentionLayout` (bertrain.model.unpad) once; every layer
  takes it.
* `BertModel.jagged_attention`: unpadded attention on nested (jagged) tensors: no padding anywhere.
* `BertModel.per_sequence_attention`: unpadded attention on CPU one sequence at a time: no padding anywhere.
* `BertModel.prune_last_layer`: in a call that reads the last layer at a few positions only
  (`BertModel.forward(..., read_positions=...)`: [CLS] for classification, [CLS] and the masked positions for
  pretraining), the last layer computes those rows only: their queries, attention output, FFN and LayerNorms (keys
  and values still at every token, which every query attends to).
* activation checkpointing and compile are applied from outside, per encoder layer (`apply_model_options`, as
  torchtitan's parallelize functions do): this file has no flag for them.
Losses are the functions of `bertrain.model.losses` that the trainer uses: a head's `.loss` is their sum divided by
the local count of targets.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from bertrain.model.losses import classification_loss_sums, mean_from_sums, pretraining_loss_sums, qa_loss_sums
from bertrain.model.unpad import AttentionLayout, attention_layout, to_device

# ----------------------------------------------------------------------------------------------- config

# HF's names for activations (transformers.activations.ACT2FN) -> the function we use.
ACTIVATIONS = {
    "gelu": F.gelu,                                                    # exact erf GELU, as HF reads BERT configs
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),               # tanh approximation (GPT-2 style)
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
    "swish": F.silu,
}


@dataclass
class BertConfig:
    """The fields of an HF/Google BERT `config.json`, plus bertrain's vocabulary padding."""

    vocab_size: int = 30522
    """Number of tokens in the WordPiece vocabulary (lines of vocab.txt)."""
    hidden_size: int = 768
    """Width H of every token representation."""
    num_hidden_layers: int = 12
    """Number of transformer encoder layers."""
    num_attention_heads: int = 12
    """Attention heads per layer; hidden_size must be divisible by it."""
    intermediate_size: int = 3072
    """Width of the feed-forward layer inside each encoder layer (usually 4*H)."""
    hidden_act: str = "gelu"
    """Activation of the feed-forward layer and the MLM transform: gelu (exact erf), gelu_new, relu, silu, ..."""
    hidden_dropout_prob: float = 0.1
    """Dropout on embeddings and on the output of every sub-layer."""
    attention_probs_dropout_prob: float = 0.1
    """Dropout on the attention probabilities."""
    max_position_embeddings: int = 512
    """Longest sequence the learned position embeddings cover."""
    type_vocab_size: int = 2
    """Number of segment (token type) ids: 2 for sentence A / B."""
    initializer_range: float = 0.02
    """Standard deviation of the normal initialisation of weights."""
    layer_norm_eps: float = 1e-12
    """Epsilon of every LayerNorm."""
    pad_token_id: int | None = 0
    """Id of [PAD]; its embedding row starts at zero and gets no gradient from the input side (as in HF)."""
    classifier_dropout: float | None = None
    """Dropout before the classification head; None means hidden_dropout_prob."""
    pad_vocab_size_multiple: int = 8
    """Pad the embedding/decoder rows internally to a multiple of this (speed); 1 disables. Not exported."""

    def __post_init__(self) -> None:
        def check(name: str, ok: bool, why: str) -> None:
            if not ok:
                raise ValueError(f"BertConfig.{name} = {getattr(self, name)!r}: {why}")

        def number(v: Any) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool)

        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                     "max_position_embeddings", "type_vocab_size", "pad_vocab_size_multiple"):
            v = getattr(self, name)
            check(name, isinstance(v, int) and not isinstance(v, bool) and v >= 1, "must be a positive integer")
        for name in ("hidden_dropout_prob", "attention_probs_dropout_prob", "classifier_dropout",
                     "initializer_range", "layer_norm_eps"):
            v = getattr(self, name)
            if v is None and name == "classifier_dropout":
                continue
            if "dropout" in name:
                check(name, number(v) and 0 <= v < 1, "must be a probability in [0, 1)")
            else:
                check(name, number(v) and v > 0, "must be a positive number")
            setattr(self, name, float(v))  # JSON writes 0 for 0.0
        check("hidden_act", isinstance(self.hidden_act, str) and self.hidden_act in ACTIVATIONS,
              f"unsupported activation; choose one of {', '.join(ACTIVATIONS)}")
        check("hidden_size", self.hidden_size % self.num_attention_heads == 0,
              f"must be divisible by num_attention_heads ({self.num_attention_heads})")
        v = self.pad_token_id
        check("pad_token_id", v is None or (type(v) is int and 0 <= v < self.vocab_size),
              f"must be a token id in [0, vocab_size={self.vocab_size}) or None")

    @property
    def padded_vocab_size(self) -> int:
        """vocab_size rounded up to a multiple of pad_vocab_size_multiple: the rows actually allocated."""
        m = self.pad_vocab_size_multiple
        return (self.vocab_size + m - 1) // m * m

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> BertConfig:
        """A named size: tiny (tests), mini, small, medium, base (BERT-Base), large (BERT-Large)."""
        if name not in PRESETS:
            raise ValueError(f"unknown model preset {name!r}; choose one of {', '.join(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})


PRESETS: dict[str, dict[str, Any]] = {
    # layers x hidden x heads; intermediate = 4 * hidden. tiny is for tests: a forward/backward takes milliseconds.
    "tiny": dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=2, intermediate_size=256),
    "mini": dict(num_hidden_layers=4, hidden_size=256, num_attention_heads=4, intermediate_size=1024),
    "small": dict(num_hidden_layers=4, hidden_size=512, num_attention_heads=8, intermediate_size=2048),
    "medium": dict(num_hidden_layers=8, hidden_size=512, num_attention_heads=8, intermediate_size=2048),
    "base": dict(num_hidden_layers=12, hidden_size=768, num_attention_heads=12, intermediate_size=3072),
    "large": dict(num_hidden_layers=24, hidden_size=1024, num_attention_heads=16, intermediate_size=4096),
}


# ----------------------------------------------------------------------------------------------- outputs

@dataclass
class BertModelOutput:
    last_hidden_state: torch.Tensor               # (B, T, H), or (B, P, H) at `read_positions`
    pooler_output: torch.Tensor | None = None     # (B, H): tanh(dense(h[CLS])); None without a pooler


@dataclass
class BertForPreTrainingOutput:
    loss: torch.Tensor | None = None              # mlm_loss + nsp_loss (whichever labels were given)
    mlm_loss: torch.Tensor | None = None          # mean over targets != -100 (0 when there are none)
    nsp_loss: torch.Tensor | None = None          # mean over labels != -100 (0 when there are none)
    prediction_logits: torch.Tensor | None = None  # (B, T, V), or (B, P, V) with masked_positions
    seq_relationship_logits: torch.Tensor | None = None  # (B, 2): 0 = B follows A, 1 = B is random


@dataclass
class SequenceClassifierOutput:
    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None            # (B, num_labels)


@dataclass
class QuestionAnsweringOutput:
    loss: torch.Tensor | None = None
    start_logits: torch.Tensor | None = None      # (B, T)
    end_logits: torch.Tensor | None = None        # (B, T)


# The outputs are pytree nodes (as transformers registers its ModelOutput), so that code which looks for the tensors
# of a module's output with torch's pytree finds them. FSDP2 of torch 2.11 does (its root module's pre-backward
# hook is registered on the tensors `tree_flatten` finds; torch 2.13 also walks dataclasses): a plain dataclass is
# one opaque leaf to it, the hook was never registered, and the first backward failed on the root's freed weights
# ("setStorage: ... out of bounds for storage of size 0").
for _output in (BertModelOutput, BertForPreTrainingOutput, SequenceClassifierOutput, QuestionAnsweringOutput):
    torch.export.register_dataclass(_output)


# ----------------------------------------------------------------------------------------------- encoder

class Dropout(nn.Dropout):
    """`nn.Dropout` whose CPU mask is drawn with `torch.rand(...) >= p` (float32 uniforms, whatever the input's
    dtype) instead of `bernoulli_`: the same distribution (keep with probability 1 - p, scale 1 / (1 - p)), drawn
    faster (a whole fine-tuning step 3% faster on 2 cores: BENCHMARKS.md "Time to quality"). Other devices keep
    torch's fused kernel."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0 or x.device.type != "cpu":
            return super().forward(x)
        # Uniforms in float32 whatever x's dtype: torch.rand in bf16 has 256 levels (k/256), so `>= p` kept 230/256 =
        # 0.898 for p = 0.1 and 253/256 for p = 0.01 (activations shrunk 0.2-0.4% in training, none kept for
        # p > 255/256); in float32 (x's usual dtype) this is the same draw as rand_like. The mask in x's dtype, as
        # torch's kernel keeps it: a bool mask times a Python float is float32, which turned bf16 activations into
        # float32 (FSDP's bf16 LayerNorm then refused them: "mixed dtype (CPU)")
        keep = torch.rand(x.shape, device=x.device) >= self.p
        return x * keep.to(x.dtype).mul_(1.0 / (1.0 - self.p))  # in place: no extra tensor


class BertEmbeddings(nn.Module):
    """word + position + token type embeddings, then LayerNorm and dropout."""

    def __init__(self, config: BertConfig):
        super().__init__()
        # padding_idx: the [PAD] row gets no gradient from the input side (HF does the same; needed for parity).
        self.word_embeddings = nn.Embedding(config.padded_vocab_size, config.hidden_size,
                                            padding_idx=config.pad_token_id)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = Dropout(config.hidden_dropout_prob)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor,
                position_ids: torch.Tensor) -> torch.Tensor:
        x = (self.word_embeddings(input_ids)                   # (B, T, H), or (N, H) unpadded
             + self.token_type_embeddings(token_type_ids)
             + self.position_embeddings(position_ids))         # (T, H) broadcast over B, or (N, H)
        return self.dropout(self.LayerNorm(x))


class BertSelfAttention(nn.Module):
    """Multi-head self-attention with one fused QKV projection and PyTorch's scaled_dot_product_attention."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size)  # rows: [query; key; value]
        self.dropout_p = config.attention_probs_dropout_prob

    def forward(self, x: torch.Tensor, layout: AttentionLayout, queries: torch.Tensor | None = None) -> torch.Tensor:
        """x: (B, T, H), or (N, H) unpadded. `queries` (B, P, H): hidden states of P tokens per sequence, taken from x:
        attention for those tokens only, over every token of their sequence -> (B, P, H)."""
        if queries is not None:
            return self.attend_from(x, layout, queries)
        qkv = self.qkv(x)                                                  # (B, T, 3H), or (N, 3H) unpadded
        dropout_p = self.dropout_p if self.training else 0.0
        if layout.jagged is not None:  # unpadded, and no padding for attention either: nested (jagged) tensors
            return layout.jagged.attention(qkv, self.num_heads, dropout_p)  # (N, H)
        if layout.segments is not None:  # unpadded, attention one sequence at a time (CPU)
            return layout.segments.attention(qkv, self.num_heads, dropout_p)  # (N, H)
        qkv = layout.to_grid(qkv)                       # (B, T, 3H); unpadded: the real tokens in a zero grid
        B, T, H = qkv.size(0), qkv.size(1), qkv.size(2) // 3
        q, k, v = qkv.view(B, T, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4).unbind(0)  # 3 x (B, nh, T, hs)
        # mask: (B, 1, 1, T) bool, True = attend; scale defaults to 1/sqrt(hs) as in BERT
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=layout.mask, dropout_p=dropout_p)  # (B, nh, T, hs)
        return layout.from_grid(y.transpose(1, 2).reshape(B, T, H))       # (B, T, H), or (N, H) unpadded

    def attend_from(self, x: torch.Tensor, layout: AttentionLayout, queries: torch.Tensor) -> torch.Tensor:
        """Queries at `queries` (B, P, H) only; keys and values at every token of x, in the padded grid (with P small,
        its (B, nh, P, T') scores cost little, so every layout takes this one path)."""
        H = x.size(-1)
        w, b = self.qkv.weight, self.qkv.bias                              # rows: [query; key; value]
        B, P = queries.size(0), queries.size(1)
        q = F.linear(queries, w[:H], b[:H]).view(B, P, self.num_heads, -1).transpose(1, 2)  # (B, nh, P, hs)
        kv = layout.to_grid(F.linear(x, w[H:], b[H:]))                     # (B, T', 2H)
        T = kv.size(1)
        k, v = kv.view(B, T, 2, self.num_heads, -1).permute(2, 0, 3, 1, 4).unbind(0)  # 2 x (B, nh, T', hs)
        dropout_p = self.dropout_p if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=layout.mask, dropout_p=dropout_p)  # (B, nh, P, hs)
        return y.transpose(1, 2).reshape(B, P, H)                          # (B, P, H)


class BertAddNorm(nn.Module):
    """Post-LN sub-layer output: dense -> dropout -> add the residual -> LayerNorm (HF's BertSelfOutput/BertOutput)."""

    def __init__(self, in_features: int, config: BertConfig):
        super().__init__()
        self.dense = nn.Linear(in_features, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = Dropout(config.hidden_dropout_prob)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dropout(self.dense(x)) + residual)     # (B, T, H)


class BertAttention(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.self = BertSelfAttention(config)
        self.output = BertAddNorm(config.hidden_size, config)

    def forward(self, x: torch.Tensor, layout: AttentionLayout, rows: torch.Tensor | None = None) -> torch.Tensor:
        """rows (B, P): the flat rows of x (B * T or N) whose outputs are wanted; then -> (B, P, H)."""
        if rows is None:
            return self.output(self.self(x, layout), x)
        picked = x.reshape(-1, x.size(-1))[rows]                           # (B, P, H)
        return self.output(self.self(x, layout, picked), picked)


class BertIntermediate(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)
        self.act = ACTIVATIONS[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.dense(x))                                     # (B, T, I)


class BertLayer(nn.Module):
    """One post-LN encoder layer: x = LN(x + Attn(x)); x = LN(x + FFN(x))."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.attention = BertAttention(config)
        self.intermediate = BertIntermediate(config)
        self.output = BertAddNorm(config.intermediate_size, config)

    def forward(self, x: torch.Tensor, layout: AttentionLayout, rows: torch.Tensor | None = None) -> torch.Tensor:
        """x: (B, T, H), or (N, H) real tokens when `layout` is unpadded. rows (B, P): compute the outputs of these
        flat rows of x only (`AttentionLayout.rows_at`) -> (B, P, H)."""
        x = self.attention(x, layout, rows)                                # (B, T, H), (N, H) or (B, P, H)
        return self.output(self.intermediate(x), x)                        # (B, T, H), (N, H) or (B, P, H)


class BertEncoder(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(config) for _ in range(config.num_hidden_layers))

    def forward(self, x: torch.Tensor, layout: AttentionLayout, rows: torch.Tensor | None = None) -> torch.Tensor:
        """rows (B, P): the last layer computes only these flat rows of x (their outputs are all the caller reads;
        the other layers compute every row, which the next layer's keys and values need) -> (B, P, H)."""
        last = len(self.layer) - 1
        for i, layer in enumerate(self.layer):
            if i == last and rows is not None:
                return layer(x, layout, rows)                              # (B, P, H)
            x = layer(x, layout)                                           # (B, T, H), or (N, H) unpadded
        return x


class BertPooler(nn.Module):
    """tanh(dense(h[CLS])): the sentence representation used by NSP and sequence classification."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(h[:, 0]))                             # (B, H)


# ----------------------------------------------------------------------------------------------- shared base

M = TypeVar("M", bound="BertPreTrainedModel")


class BertPreTrainedModel(nn.Module):
    """What every class shares: the config, BERT initialisation, tokenizer files, and HF-format loading/saving."""

    config: BertConfig

    if TYPE_CHECKING:  # defined in bertrain.model.hf, which imports this module (never the reverse) and installs them
        @classmethod
        def from_pretrained(cls: type[M], path: str | os.PathLike, **kwargs: Any) -> M:
            """Load an HF-format folder or a bertrain checkpoint folder; missing heads are initialised and
            reported. Keyword arguments override config fields (e.g. hidden_dropout_prob=0.0); `num_labels` for
            classification."""

        def save_pretrained(self, path: str | os.PathLike) -> None:
            """Write config.json, model.safetensors (HF key names) and the tokenizer files into `path`."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.config = config
        self.tokenizer_files: dict[str, bytes] = {}  # vocab.txt, tokenizer_config.json, ... written by save_pretrained

    @torch.no_grad()
    def init_weights(self, module: nn.Module | None = None) -> None:
        """BERT initialisation of `module` (default: everything): weights ~ N(0, initializer_range), biases 0,
        LayerNorm 1/0; the [PAD] embedding row, the padded vocabulary rows and the MLM decoder bias start at 0."""
        std = self.config.initializer_range
        root = module if module is not None else self
        for m in root.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, mean=0.0, std=std)
                if isinstance(m, nn.Linear) and m.bias is not None:
                    nn.init.zeros_(m.bias)
                if isinstance(m, nn.Embedding) and m.padding_idx is not None:
                    m.weight[m.padding_idx].zero_()
            elif isinstance(m, nn.LayerNorm):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
            elif isinstance(m, BertLMPredictionHead):
                nn.init.zeros_(m.bias)
        for m in root.modules():  # after the loop above, which visits parents before children
            if isinstance(m, BertEmbeddings):
                m.word_embeddings.weight[self.config.vocab_size:].zero_()

    def num_parameters(self, exclude_padding: bool = True) -> int:
        """Number of parameters (tied weights counted once), by default without the padded vocabulary rows."""
        n = sum(p.numel() for p in self.parameters())
        if exclude_padding:
            extra = self.config.padded_vocab_size - self.config.vocab_size
            has_decoder_bias = any(isinstance(m, BertLMPredictionHead) for m in self.modules())
            n -= extra * self.config.hidden_size + extra * has_decoder_bias
        return n


def check_inputs(config: BertConfig, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None,
                 attention_mask: torch.Tensor | None) -> None:
    """A clear ValueError for inputs the embeddings would misread: shapes always; id ranges on the CPU only (reading
    them from a GPU would stall the host every step) and not while torch.compile/export traces. An id in
    [vocab_size, padded_vocab_size) would otherwise pass silently (the padding rows exist, zero), where HF fails."""
    if input_ids.dim() != 2 or not input_ids.numel():
        raise ValueError(f"input_ids must be a (batch, length) tensor with at least one token; got shape "
                         f"{tuple(input_ids.shape)}" + (" (one sequence: input_ids[None])" if input_ids.dim() == 1
                                                        else ""))
    if input_ids.is_floating_point():
        raise ValueError(f"input_ids must hold integer token ids; got {input_ids.dtype}")
    for name, t in (("token_type_ids", token_type_ids), ("attention_mask", attention_mask)):
        if t is not None and t.shape != input_ids.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, input_ids {tuple(input_ids.shape)}: give one "
                             f"value per token")
    if input_ids.device.type != "cpu" or torch.compiler.is_compiling() or torch.jit.is_tracing():
        return
    for name, t, n, what in (("input_ids", input_ids, config.vocab_size, "vocab_size"),
                             ("token_type_ids", token_type_ids, config.type_vocab_size, "type_vocab_size")):
        if t is not None and not bool(((t >= 0) & (t < n)).all()):
            raise ValueError(f"{name} must lie in [0, {what}={n}); got {int(t.min())}..{int(t.max())} (a tokenizer "
                             f"that does not match the model?)")


class BertModel(BertPreTrainedModel):
    """The encoder: embeddings, `num_hidden_layers` post-LN layers and (optionally) the pooler."""

    def __init__(self, config: BertConfig, add_pooling_layer: bool = True):
        super().__init__(config)
        self.embeddings = BertEmbeddings(config)
        self.encoder = BertEncoder(config)
        self.pooler = BertPooler(config) if add_pooling_layer else None
        # Speed options, read by `forward`; `apply_model_options` sets them (these are its defaults).
        # One switch for unpadding, and it is this option; a call's `reads_padding` says only which outputs its caller
        # reads (a fact about the call, as nanoGPT's forward computes the last position's logits only when given no
        # targets): the head knows what it reads, the option decides whether to skip what nobody reads.
        self.unpad = True                    # calls with reads_padding=False run on the real tokens only
        self.jagged_attention = False        # unpadded runs: attention on nested (jagged) tensors
        self.per_sequence_attention = False  # unpadded runs on CPU: attention one sequence at a time
        self.prune_last_layer = True         # calls with read_positions: the last layer computes those rows only
        self.init_weights()

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, reads_padding: bool = True,
                read_positions: torch.Tensor | None = None) -> BertModelOutput:
        """reads_padding=False: the caller reads no output at a padding position, so with `self.unpad` the encoder
        computes on the real tokens only (see the module docstring): the outputs at real tokens are those of the
        padded path, `last_hidden_state` is 0 at padding positions (the padded path gives values there that depend
        on the padding and that nothing should use). The default computes every position, as HF's BertModel.

        read_positions (B, P), P >= 0: the caller reads the last layer's outputs at these positions only (and the
        pooler's); `last_hidden_state` is then (B, P, H), the (B, T, H) output gathered there, and no padding
        position's output is read (as reads_padding=False: 0 there when unpadded). With `self.prune_last_layer` the
        last layer computes just those rows (and [CLS] for the pooler)."""
        check_inputs(self.config, input_ids, token_type_ids, attention_mask)
        B, T = input_ids.shape
        if T > self.config.max_position_embeddings:
            raise ValueError(f"sequence length {T} exceeds max_position_embeddings "
                             f"{self.config.max_position_embeddings}")
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        reads = read_positions
        if reads is not None:
            reads_padding = False
            if reads.dim() != 2 or reads.size(0) != B:
                raise ValueError(f"read_positions (BertForPreTraining: masked_positions) must be (batch={B}, P); got "
                                 f"shape {tuple(reads.shape)}")
            if reads.device.type == "cpu" and reads.numel() and not bool(((reads >= 0) & (reads < T)).all()):
                raise ValueError(f"read_positions must lie in [0, {T}) (the batch's length); got "
                                 f"{int(reads.min())}..{int(reads.max())} (BertForPreTraining: masked_positions)")
            if self.pooler is not None:  # [CLS] first, for the pooler
                reads = torch.cat([reads.new_zeros(B, 1), reads], dim=1)          # (B, 1 + P)
        layout = attention_layout(attention_mask, unpad=self.unpad and not reads_padding, jagged=self.jagged_attention,
                                  device=input_ids.device,  # the mask may be on the host: model/unpad.py
                                  per_sequence=self.per_sequence_attention and input_ids.device.type == "cpu",
                                  num_heads=self.config.num_attention_heads)
        x = self.embeddings(layout.flatten(input_ids), layout.flatten(token_type_ids),
                            layout.position_ids(input_ids))               # (B, T, H), or (N, H) unpadded
        if reads is not None and self.prune_last_layer and (layout.indices is None or layout.indices.numel()):
            rows, real = layout.rows_at(reads, T)                          # (B, P'), (B, P') bool or None
            h = self.encoder(x, layout, rows)                              # (B, P', H)
            if real is not None:  # unpadded: padding positions have no row of their own; 0 there, as to_padded
                h = h * real.unsqueeze(-1).to(h.dtype)
        else:
            h = layout.to_padded(self.encoder(x, layout), T)              # (B, T, H), or (N, H) unpadded
            if reads is not None:
                h = h.gather(1, reads.unsqueeze(-1).expand(-1, -1, h.size(-1)))  # (B, P', H)
        pooled = self.pooler(h) if self.pooler else None                   # reads h[:, 0]: [CLS]
        if reads is not None and self.pooler is not None:
            h = h[:, 1:]                                                   # (B, P, H): read_positions
        return BertModelOutput(last_hidden_state=h, pooler_output=pooled)


# ----------------------------------------------------------------------------------------------- heads

class BertPredictionHeadTransform(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.act = ACTIVATIONS[config.hidden_act]
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.act(self.dense(h)))


class BertLMPredictionHead(nn.Module):
    """MLM head: transform, then the decoder whose weight is the word embedding matrix (tied) plus its own bias."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.vocab_size = config.vocab_size
        self.transform = BertPredictionHeadTransform(config)
        self.bias = nn.Parameter(torch.zeros(config.padded_vocab_size))

    def forward(self, h: torch.Tensor, decoder_weight: torch.Tensor) -> torch.Tensor:
        h = self.transform(h)                                              # (..., H)
        logits = F.linear(h, decoder_weight, self.bias)                    # (..., padded V)
        return logits[..., :self.vocab_size]                               # (..., V): padding sliced off


class BertPreTrainingHeads(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.predictions = BertLMPredictionHead(config)
        self.seq_relationship = nn.Linear(config.hidden_size, 2)


class BertForPreTraining(BertPreTrainedModel):
    """BERT with the masked-LM and next-sentence-prediction heads."""

    def __init__(self, config: BertConfig):
        super().__init__(config)
        self.bert = BertModel(config)
        self.cls = BertPreTrainingHeads(config)
        self.init_weights(self.cls)  # self.bert initialised itself

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, masked_positions: torch.Tensor | None = None,
                labels: torch.Tensor | None = None,
                next_sentence_label: torch.Tensor | None = None) -> BertForPreTrainingOutput:
        """masked_positions (B, P): run the (vocabulary-wide, expensive) MLM head only there; `labels` is then
        (B, P) aligned with it, else (B, T). -100 = ignore. next_sentence_label (B,): 0 IsNext, 1 random, -100."""
        aligned = masked_positions if masked_positions is not None else input_ids
        if labels is not None and labels.shape != aligned.shape:
            raise ValueError(f"labels has shape {tuple(labels.shape)}; it must be {tuple(aligned.shape)}: " +
                             ("aligned with masked_positions (B, P)" if masked_positions is not None
                              else "one label per token (B, T)"))
        # With masked_positions only those positions' outputs (and [CLS]'s) are read.
        out = self.bert(input_ids, token_type_ids, attention_mask, read_positions=masked_positions)
        h = out.last_hidden_state                                          # (B, T, H), or (B, P, H) masked
        decoder_weight = self.bert.embeddings.word_embeddings.weight      # (padded V, H), tied
        prediction_logits = self.cls.predictions(h, decoder_weight)        # (B, T or P, V)
        seq_relationship_logits = self.cls.seq_relationship(out.pooler_output)  # (B, 2)

        # Local means of the trainer's loss sums (HF's convention): sum over targets != -100 / their count.
        sums = pretraining_loss_sums(prediction_logits, seq_relationship_logits, labels, next_sentence_label)
        mlm_loss = mean_from_sums(sums["mlm_loss_sum"], sums["mlm_count"]) if labels is not None else None
        nsp_loss = mean_from_sums(sums["nsp_loss_sum"], sums["nsp_count"]) if next_sentence_label is not None else None
        losses = [loss for loss in (mlm_loss, nsp_loss) if loss is not None]
        return BertForPreTrainingOutput(loss=torch.stack(losses).sum() if losses else None, mlm_loss=mlm_loss,
                                        nsp_loss=nsp_loss, prediction_logits=prediction_logits,
                                        seq_relationship_logits=seq_relationship_logits)


class BertForSequenceClassification(BertPreTrainedModel):
    """Pooled [CLS] -> dropout -> linear. num_labels == 1 is regression (MSE), otherwise cross-entropy."""

    def __init__(self, config: BertConfig, num_labels: int = 2):
        super().__init__(config)
        if isinstance(num_labels, bool) or not isinstance(num_labels, int) or num_labels < 1:
            raise ValueError(f"num_labels = {num_labels!r}: must be a positive integer")
        self.num_labels = num_labels
        self.bert = BertModel(config)
        p = config.classifier_dropout if config.classifier_dropout is not None else config.hidden_dropout_prob
        self.dropout = Dropout(p)
        self.classifier = nn.Linear(config.hidden_size, num_labels)
        self.init_weights(self.classifier)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None,
                labels: torch.Tensor | None = None) -> SequenceClassifierOutput:
        # Only [CLS]'s output is read (by the pooler): no other position's.
        pooled = self.bert(input_ids, token_type_ids, attention_mask,
                           read_positions=input_ids.new_zeros(input_ids.size(0), 0)).pooler_output  # (B, H)
        logits = self.classifier(self.dropout(pooled))                    # (B, num_labels)
        loss = None
        if labels is not None:
            sums = classification_loss_sums(logits, labels)
            loss = mean_from_sums(sums["loss_sum"], sums["count"])
        return SequenceClassifierOutput(loss=loss, logits=logits)


class BertForQuestionAnswering(BertPreTrainedModel):
    """Span extraction (SQuAD): a start and an end logit for every token. No pooler, as in HF.

    Unpadded (`bert.unpad`) only outside training: HF's loss puts the padding positions' logits (computed from the
    padding's hidden states) into its softmax, so training keeps them; for inference the padding positions get a
    logit of -10000 instead, which leaves every prediction unchanged (answers never start or end on padding)."""

    def __init__(self, config: BertConfig):
        super().__init__(config)
        self.bert = BertModel(config, add_pooling_layer=False)
        self.qa_outputs = nn.Linear(config.hidden_size, 2)
        self.init_weights(self.qa_outputs)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, start_positions: torch.Tensor | None = None,
                end_positions: torch.Tensor | None = None) -> QuestionAnsweringOutput:
        reads_padding = self.training  # HF's loss sees the padding positions' logits
        out = self.bert(input_ids, token_type_ids, attention_mask, reads_padding=reads_padding)
        logits = self.qa_outputs(out.last_hidden_state)                    # (B, T, 2)
        if self.bert.unpad and not reads_padding and attention_mask is not None:
            # unpadded: padding has no hidden state of its own (0 there), so no logit of its own either
            padding = ~to_device(attention_mask, logits.device).bool()
            logits = logits.masked_fill(padding[..., None], -10000.0)
        start_logits, end_logits = logits.unbind(dim=-1)                   # 2 x (B, T)
        loss = None
        if start_positions is not None and end_positions is not None:
            # As HF: positions outside the sequence are ignored; loss = (CE_start + CE_end) / 2.
            sums = qa_loss_sums(start_logits, end_logits, start_positions, end_positions)
            loss = mean_from_sums(sums["loss_sum"], sums["count"])
        return QuestionAnsweringOutput(loss=loss, start_logits=start_logits, end_logits=end_logits)


MODEL_CLASSES: dict[str, type[BertPreTrainedModel]] = {
    c.__name__: c for c in (BertModel, BertForPreTraining, BertForSequenceClassification, BertForQuestionAnswering)
}
