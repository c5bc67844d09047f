"""Where a batch's tokens are, for attention: the `AttentionLayout` that `BertModel.forward` builds once and passes
unchanged through every layer, and the row gathering/scattering behind the padding-free (unpadded) path.

Four layouts, each tested equal to the first (tests/test_fastpath.py):

* padded: tensors are (B, T, ...); attention masks the padding (`mask`).
* unpadded: embeddings, projections, FFN and LayerNorms run on the N real tokens only, a flat (N, ...) tensor;
  `indices` (N,) are their places in the flattened (B, T') grid, T' the last column holding a real token rounded
  up to a multiple of 8. Attention scatters the fused QKV into that zero grid, masks it, and gathers back.
* unpadded + jagged: as unpadded, but attention runs on nested (jagged) tensors, so there is no padding anywhere
  (SDPA picks a variable-length kernel: flash on CUDA).
* unpadded + per sequence (CPU, not compiled): as unpadded, but attention runs one sequence at a time on its own
  rows, without a mask: no padding anywhere either, at the price of one SDPA call per sequence, which costs
  little on a CPU (where the padded grid's attention, its dropout and its zero fill were a quarter of a fine-tuning
  step: BENCHMARKS.md) and much on a GPU (a launch per call).

`AttentionLayout.rows_at` says where given positions are among a layout's flat rows: the pruned last layer
(`BertModel.prune_last_layer`) computes those rows only.

The layout depends on the batch's lengths, which are data: read on a GPU they would stall the host every step (a
device-to-host copy waits for all queued work). So the mask may stay on the host while the batch is on the GPU (the
trainer does that, `train/trainer.py:to_device`): the layout is then computed there and only its tensors go to the
GPU, as copies that do not wait. With a mask on the GPU the same code runs there, at one sync per forward.
"""
from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F


class _DropFxTracingNotice(logging.Filter):
    """torch.nested logs a one-off notice about `is_fx_tracing` from inside `nested_tensor_from_jagged` (a torch
    internal, nothing the user can act on): drop just that record."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("is_fx_tracing will return true")


logging.getLogger("torch.fx._symbolic_trace").addFilter(_DropFxTracingNotice())


# ----------------------------------------------------------------------------------------------- rows

class _Gather(torch.autograd.Function):
    """x[indices] along dim 0, indices unique: the backward scatters with index_put (a copy), not index_add
    (an accumulation, several times slower on CPU). As flash-attn's bert_padding.IndexFirstAxis."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(indices)
        ctx.rows = x.size(0)
        return x.index_select(0, indices)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (indices,) = ctx.saved_tensors
        return grad.new_zeros(ctx.rows, *grad.shape[1:]).index_put_((indices,), grad), None


class _Scatter(torch.autograd.Function):
    """A zero (rows, ...) tensor with x written at `indices` (unique) along dim 0; backward gathers."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, indices: torch.Tensor, rows: int) -> torch.Tensor:
        ctx.save_for_backward(indices)
        return x.new_zeros(rows, *x.shape[1:]).index_put_((indices,), x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (indices,) = ctx.saved_tensors
        return grad.index_select(0, indices), None, None


def gather_rows(x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """(R, ...) -> (N, ...): the rows `indices` (unique), e.g. the real tokens of a flattened padded batch."""
    return _Gather.apply(x, indices)


def scatter_rows(x: torch.Tensor, indices: torch.Tensor, rows: int) -> torch.Tensor:
    """(N, ...) -> (rows, ...): zeros with x's rows at `indices` (unique); the inverse of gather_rows."""
    return _Scatter.apply(x, indices, rows)


def unpad_indices(attention_mask: torch.Tensor, multiple: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """For unpadding: the flat indices (N,) of the real tokens in the (B, T') grid, and that grid's (B, T') mask,
    T' = the last column holding a real token, rounded up to `multiple` (bounded shapes for kernels and compile).
    On the device of the mask (on a GPU: one host sync, for the number of real tokens)."""
    mask = attention_mask.bool()
    T = mask.size(1)
    last = int(mask.any(0).nonzero().max()) + 1 if mask.any() else 1
    T = min(T, -(-last // multiple) * multiple)
    mask = mask[:, :T]
    return mask.reshape(-1).nonzero().squeeze(1), mask


def to_device(t: torch.Tensor, device: torch.device | None) -> torch.Tensor:
    """A host tensor copied to `device` without waiting: staged in pinned memory, whose block the caching host
    allocator keeps until the copy is done (a copy from pageable memory would synchronize the stream first)."""
    if device is None or t.device == device:
        return t
    if t.device.type == "cpu" and device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def sdpa_mask(attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """(B, T) 1 = token, 0 = padding -> (B, 1, 1, T) bool for SDPA, True = attend."""
    if attention_mask is None:
        return None
    mask = attention_mask.bool()
    # A row with no real token at all would make softmax over nothing -> NaN; let such rows attend everywhere.
    mask = mask | ~mask.any(dim=-1, keepdim=True)
    return mask[:, None, None, :]


# ----------------------------------------------------------------------------------------------- layout

@dataclass(frozen=True)
class Jagged:
    """Sequence boundaries of a flat (N, ...) batch of real tokens, for nested (jagged) tensors."""

    offsets: torch.Tensor  # (B + 1,) int64: sequence b is rows offsets[b]:offsets[b+1]
    max_len: int           # the longest sequence (saves a host sync inside the kernels)

    def nest(self, t: torch.Tensor) -> torch.Tensor:
        """(N, nh, hs) -> nested (B, nh, j, hs). SDPA's nested kernels need contiguous values (one copy of q, k, v:
        the padded path's scatter into a zero (B, T', 3H) grid copies as much, plus the padding)."""
        nested = torch.nested.nested_tensor_from_jagged(t.contiguous(), self.offsets, max_seqlen=self.max_len)
        return nested.transpose(1, 2)

    def attention(self, qkv: torch.Tensor, num_heads: int, dropout_p: float) -> torch.Tensor:
        """Self-attention of every sequence over its own tokens: fused (N, 3H) -> (N, H)."""
        N, H = qkv.size(0), qkv.size(1) // 3
        q, k, v = (self.nest(t) for t in qkv.view(N, 3, num_heads, -1).unbind(1))  # 3 x (B, nh, j, hs)
        with warnings.catch_warnings():  # the CPU fallback converts to torch's older nested layout, which warns
            warnings.filterwarnings("ignore", "The PyTorch API of nested tensors", UserWarning)
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p)   # (B, nh, j, hs)
        return y.transpose(1, 2).values().reshape(N, H)                       # (N, H)


PER_SEQUENCE_MIN_SAVED = 25_000
"""Per-sequence attention only where the padded grid would compute at least this many extra attention scores per
sequence and layer (heads x (T'^2 - mean of the squared lengths)): below it, the loop of one SDPA call per sequence
costs more than the padding it saves. Set from whole training steps on 2 CPU cores, interleaved (BENCHMARKS.md
"Time to quality"): 38k and 35k extra scores per sequence ran 5% and 4% faster, 17.5k 2% slower, 4.8k (a 2-head
model at length 64) 15-19% slower."""


@dataclass(frozen=True)
class Segments:
    """Sequence lengths of a flat (N, ...) batch of real tokens, on the host: sequence b is the next lengths[b] rows."""

    lengths: tuple[int, ...]

    def attention(self, qkv: torch.Tensor, num_heads: int, dropout_p: float) -> torch.Tensor:
        """Self-attention of every sequence over its own tokens, one SDPA call each: fused (N, 3H) -> (N, H)."""
        N, H = qkv.size(0), qkv.size(1) // 3
        out = []
        for part in qkv.split(self.lengths):                                # (L, 3H) views
            L = part.size(0)
            if L == 0:
                out.append(part.new_empty(0, H))
                continue
            q, k, v = part.view(L, 3, num_heads, -1).permute(1, 2, 0, 3).unbind(0)  # 3 x (nh, L, hs)
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p)       # (nh, L, hs), no mask
            out.append(y.transpose(0, 1).reshape(L, H))
        return torch.cat(out)                                               # (N, H)


@dataclass(frozen=True)
class AttentionLayout:
    """How a batch's tokens are laid out, chosen once per forward by `attention_layout`.

    Padded (`indices` None): tensors are (B, T, ...), `mask` (B, 1, 1, T) or None (no padding).
    Unpadded: tensors are (N, ...) real tokens; `indices` (N,) their places in the flattened (B, T') grid whose
    SDPA mask is `mask` (B, 1, 1, T'); with `jagged`, attention runs on nested tensors instead of that grid, with
    `segments` one sequence at a time.
    Only tensors (no Python ints) so that a compiled layer sees symbolic shapes, not new constants per batch; the
    exception, `segments`' lengths, is never built for compiled layers (`apply_model_options`)."""

    mask: torch.Tensor | None = None
    indices: torch.Tensor | None = None
    jagged: Jagged | None = None
    segments: Segments | None = None

    def flatten(self, t: torch.Tensor) -> torch.Tensor:
        """A (B, T) input (ids, token types) in this layout: (B, T) padded, (N,) unpadded."""
        if self.indices is None:
            return t
        return t[:, :self.mask.size(-1)].reshape(-1).index_select(0, self.indices)

    def position_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Positions of the tokens of this layout: (T,) padded (broadcast over B), (N,) unpadded."""
        if self.indices is None:
            return torch.arange(input_ids.size(-1), device=input_ids.device)
        B, Tp = self.mask.size(0), self.mask.size(-1)
        return torch.arange(Tp, device=input_ids.device).repeat(B).index_select(0, self.indices)

    def to_grid(self, x: torch.Tensor) -> torch.Tensor:
        """Padded: x unchanged. Unpadded: (N, C) -> (B, T', C), zeros at padding (for attention)."""
        if self.indices is None:
            return x
        B, Tp = self.mask.size(0), self.mask.size(-1)
        return scatter_rows(x, self.indices, B * Tp).view(B, Tp, -1)

    def from_grid(self, x: torch.Tensor) -> torch.Tensor:
        """The inverse of `to_grid`: padded, x unchanged; unpadded, (B, T', C) -> (N, C)."""
        if self.indices is None:
            return x
        return gather_rows(x.reshape(-1, x.size(-1)), self.indices)

    def rows_at(self, positions: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Where the tokens at `positions` (B, P) (each in [0, seq_len)) are among this layout's flat rows: (B, P)
        indices into the (B * seq_len, ...) padded or the (N, ...) unpadded rows. Unpadded, also which of them are
        real tokens, (B, P) bool: a padding position has no row (it gets row 0, and its output must be zeroed, as
        `to_padded` gives 0 there); padded, None. Device ops only (no host sync)."""
        B = positions.size(0)
        starts = torch.arange(B, device=positions.device).unsqueeze(1)    # (B, 1)
        if self.indices is None:
            return positions + starts * seq_len, None
        Tp = self.mask.size(-1)
        row_of = torch.full((B * Tp,), -1, dtype=torch.long, device=positions.device)
        row_of[self.indices] = torch.arange(self.indices.numel(), device=positions.device)
        rows = row_of[positions.clamp(max=Tp - 1) + starts * Tp]          # (B, P), -1 at padding
        real = (rows >= 0) & (positions < Tp)
        return rows.clamp(min=0), real

    def to_padded(self, h: torch.Tensor, seq_len: int) -> torch.Tensor:
        """The encoder's output as (B, T, H), T = `seq_len`: unpadded outputs are 0 at padding positions."""
        if self.indices is None:
            return h
        h = self.to_grid(h)                                                # (B, T', H)
        Tp = h.size(1)
        return F.pad(h, (0, 0, 0, seq_len - Tp)) if Tp < seq_len else h   # (B, T, H)


def attention_layout(attention_mask: torch.Tensor | None, unpad: bool = False, jagged: bool = False,
                     device: torch.device | None = None, per_sequence: bool = False,
                     num_heads: int = 1) -> AttentionLayout:
    """The layout for a batch with `attention_mask` (B, T) (None: no padding). `unpad`: run on the real tokens only
    (when there is padding to remove); `jagged`: unpadded attention on nested tensors (when no row is empty: a row
    without tokens has no sequence to nest, so such a batch falls back to the unpadded grid). `device`: where the
    model computes; a mask on the host is read there (no device sync) and the layout's tensors are sent over.
    `per_sequence` (not with `jagged`): unpadded attention one sequence at a time (`Segments`), in batches where the
    grid would compute PER_SEQUENCE_MIN_SAVED or more extra scores per sequence for a model of `num_heads` heads."""
    if not unpad or attention_mask is None or bool(attention_mask.bool().all()):
        return AttentionLayout(mask=to_device(sdpa_mask(attention_mask), device) if attention_mask is not None
                               else None)
    indices, grid = unpad_indices(attention_mask)                         # (N,), (B, T')
    nested = None
    if jagged:
        lengths = grid.sum(1)                                              # (B,)
        if bool(lengths.all()):
            nested = Jagged(to_device(F.pad(lengths.cumsum(0), (1, 0)), device), int(lengths.max()))
    segments = None
    if per_sequence and nested is None:
        lengths = grid.sum(1)
        extra = num_heads * (grid.size(1) ** 2 - lengths.double().pow(2).mean())
        if extra >= PER_SEQUENCE_MIN_SAVED:
            segments = Segments(tuple(lengths.tolist()))                   # host ints (one sync if on a GPU)
    return AttentionLayout(mask=to_device(sdpa_mask(grid), device), indices=to_device(indices, device),
                           jagged=nested, segments=segments)
