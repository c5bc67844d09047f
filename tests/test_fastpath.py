"""Every fast path computes what the plain path computes: outputs and every parameter gradient, fp32 on CPU.

Dropout is off where the two paths draw random numbers in different layouts (padded vs unpadded); activation
checkpointing is tested with dropout on, because replaying the RNG state is the point.
"""
from __future__ import annotations

import os

import pytest
import torch
from helpers import ATOL, RTOL, assert_same, count_checkpoints, grads

from bertrain.bench.batches import pretraining_batch, qa_batch
from bertrain.bench.steps import SplitQKV, split_qkv
from bertrain.model.bert import (BertConfig, BertForPreTraining, BertForQuestionAnswering,
                                 BertForSequenceClassification, BertLayer, BertModel)
from bertrain.model.options import ModelOptionsConfig, apply_model_options
from bertrain.model.unpad import Jagged, Segments, gather_rows, scatter_rows, unpad_indices

# Every test that takes `dev` also runs on CUDA when there is a GPU (the "device run" of issue 6): fp32 there too,
# with a looser tolerance (different kernels on each side: SDPA with and without a mask, reductions in other orders).
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def tol(dev: torch.device) -> dict[str, float]:
    return dict(rtol=RTOL, atol=ATOL) if dev.type == "cpu" else dict(rtol=2e-4, atol=2e-5)


def tiny(dropout: float = 0.0) -> BertConfig:
    return BertConfig.from_preset("tiny", vocab_size=1003, hidden_dropout_prob=dropout,
                                  attention_probs_dropout_prob=dropout)


def pretrain_run(model: BertForPreTraining, b: dict[str, torch.Tensor], *, unpad: bool, masked: bool = True,
                 ckpt: bool = False, seed: int = 0, jagged: bool = False, per_sequence: bool = False,
                 prune: bool = False):
    """One forward and backward; the options not named are off (pruning too: each path is tested on every layer)."""
    model.zero_grad(set_to_none=True)
    apply_model_options(model, ModelOptionsConfig(unpad=unpad, jagged_attention=jagged, gradient_checkpointing=ckpt,
                                                  per_sequence_attention=per_sequence, prune_last_layer=prune))
    x = dict(input_ids=b["input_ids"], token_type_ids=b["token_type_ids"], attention_mask=b["attention_mask"],
             next_sentence_label=b["next_sentence_labels"])
    if masked:
        x.update(masked_positions=b["masked_positions"], labels=b["masked_labels"])
    else:
        x.update(labels=b["labels"])
    torch.manual_seed(seed)
    out = model(**x)
    out.loss.backward()
    return out, grads(model)


@pytest.fixture(scope="module", params=DEVICES)
def dev(request) -> torch.device:
    return torch.device(request.param)


@pytest.fixture(scope="module")
def batch() -> dict[str, torch.Tensor]:
    return pretraining_batch(tiny(), 6, 40, seed=3)


@pytest.fixture(scope="module")
def dbatch(batch, dev) -> dict[str, torch.Tensor]:
    """`batch` on each test device."""
    return {k: v.to(dev) for k, v in batch.items()}


def test_unpadded_pretraining_equals_padded(dbatch, dev):
    torch.manual_seed(0)
    model = BertForPreTraining(tiny()).to(dev).train()
    assert int(dbatch["attention_mask"].sum()) < dbatch["attention_mask"].numel()  # there is padding to remove
    ref, g_ref = pretrain_run(model, dbatch, unpad=False)
    out, g = pretrain_run(model, dbatch, unpad=True)
    torch.testing.assert_close(out.prediction_logits, ref.prediction_logits, **tol(dev))
    torch.testing.assert_close(out.seq_relationship_logits, ref.seq_relationship_logits, **tol(dev))
    torch.testing.assert_close(out.loss, ref.loss, **tol(dev))
    assert_same(g, g_ref, "grad", **tol(dev))


def test_masked_position_head_equals_full_head_gathered(dbatch, dev):
    torch.manual_seed(0)
    model = BertForPreTraining(tiny()).to(dev)
    full, g_full = pretrain_run(model, dbatch, unpad=False, masked=False)
    fast, g_fast = pretrain_run(model, dbatch, unpad=True, masked=True)
    V = full.prediction_logits.size(-1)
    expected = full.prediction_logits.gather(1, dbatch["masked_positions"][..., None].expand(-1, -1, V))
    torch.testing.assert_close(fast.prediction_logits, expected, **tol(dev))
    torch.testing.assert_close(fast.loss, full.loss, **tol(dev))
    assert_same(g_fast, g_full, "grad", **tol(dev))


def test_unpadded_encoder_general_masks():
    """Left padding, holes, a row with no token at all, and no padding: real-token outputs equal the padded path's,
    padding positions are 0 (the padded path's values there are meaningless)."""
    torch.manual_seed(0)
    model = BertModel(tiny()).eval()
    B, T = 4, 19
    ids = torch.randint(5, 1003, (B, T))
    mask = torch.ones(B, T, dtype=torch.long)
    mask[0, :6] = 0          # left padding
    mask[1, 3:5] = 0         # holes
    mask[1, 15:] = 0
    mask[2] = 0              # nothing at all
    ids = ids * mask
    ref = model(ids, attention_mask=mask).last_hidden_state
    out = model(ids, attention_mask=mask, reads_padding=False)  # unpadded: `unpad` is on by default
    real = mask.bool()
    torch.testing.assert_close(out.last_hidden_state[real], ref[real], rtol=RTOL, atol=ATOL)
    assert (out.last_hidden_state[~real] == 0).all()
    full = torch.ones_like(mask)  # no padding: unpad falls back to the plain path
    torch.testing.assert_close(model(ids, attention_mask=full, reads_padding=False).last_hidden_state,
                               model(ids, attention_mask=full).last_hidden_state)
    apply_model_options(model, ModelOptionsConfig(unpad=False))  # the one switch: off, every call is padded
    assert torch.equal(model(ids, attention_mask=mask, reads_padding=False).last_hidden_state, ref)


def count_calls(monkeypatch, cls: type, name: str) -> list[int]:
    """Count the calls of `cls.name`, to prove that a path ran (an ignored flag would also "pass"): `Jagged.nest`
    (3 per layer: q, k, v made nested) or `Segments.attention` (1 per layer). For the per-sequence path the speed
    rule is lifted: the tiny test batches would not pass it (`test_per_sequence_attention_only_where_...`)."""
    import bertrain.model.unpad as unpad
    monkeypatch.setattr(unpad, "PER_SEQUENCE_MIN_SAVED", 0)
    calls = [0]
    original = getattr(cls, name)

    def counted(self, *args):
        calls[0] += 1
        return original(self, *args)
    monkeypatch.setattr(cls, name, counted)
    return calls


def test_jagged_attention_pretraining_equals_padded(dbatch, dev, monkeypatch):
    """Attention on nested (jagged) tensors: the same logits, loss and every gradient as the padded path."""
    torch.manual_seed(0)
    model = BertForPreTraining(tiny()).to(dev).train()
    ref, g_ref = pretrain_run(model, dbatch, unpad=False)
    calls = count_calls(monkeypatch, Jagged, "nest")
    out, g = pretrain_run(model, dbatch, unpad=True, jagged=True)
    assert calls[0] == 3 * tiny().num_hidden_layers
    torch.testing.assert_close(out.prediction_logits, ref.prediction_logits, **tol(dev))
    torch.testing.assert_close(out.seq_relationship_logits, ref.seq_relationship_logits, **tol(dev))
    torch.testing.assert_close(out.loss, ref.loss, **tol(dev))
    assert_same(g, g_ref, "grad", **tol(dev))


@pytest.mark.parametrize("empty_row", [False, True])
@pytest.mark.parametrize("kind", ["jagged", "per_sequence"])
def test_padding_free_attention_general_masks(kind, empty_row, monkeypatch):
    """Left padding and holes (the real tokens of a row need not be contiguous) and a one-token row: each row's real
    tokens attend to each other only. A row without any token: jagged attention falls back to the unpadded grid
    for that batch (no sequence to nest); per-sequence attention gives it no rows; either way its outputs are 0."""
    torch.manual_seed(0)
    model = BertModel(tiny()).eval()
    B, T = 4, 19
    ids = torch.randint(5, 1003, (B, T))
    mask = torch.ones(B, T, dtype=torch.long)
    mask[0, :6] = 0
    mask[1, 3:5] = 0
    mask[1, 15:] = 0
    mask[3, 1:] = 0          # a single token
    if empty_row:
        mask[2] = 0
    ids = ids * mask
    ref = model(ids, attention_mask=mask).last_hidden_state
    if kind == "jagged":
        apply_model_options(model, ModelOptionsConfig(jagged_attention=True))
        calls = count_calls(monkeypatch, Jagged, "nest")
        expected = 0 if empty_row else 3 * tiny().num_hidden_layers
    else:
        apply_model_options(model, ModelOptionsConfig(per_sequence_attention=True))
        calls = count_calls(monkeypatch, Segments, "attention")
        expected = tiny().num_hidden_layers
    out = model(ids, attention_mask=mask, reads_padding=False).last_hidden_state
    assert calls[0] == expected
    real = mask.bool()
    torch.testing.assert_close(out[real], ref[real], rtol=RTOL, atol=ATOL)
    assert (out[~real] == 0).all()


def test_jagged_attention_with_checkpointing_and_dropout(batch, monkeypatch):
    torch.manual_seed(0)
    model = BertForPreTraining(tiny(dropout=0.1)).train()
    ref, g_ref = pretrain_run(model, batch, unpad=True, jagged=True, seed=7)
    calls = count_checkpoints(monkeypatch)
    out, g = pretrain_run(model, batch, unpad=True, jagged=True, ckpt=True, seed=7)
    assert calls[0] == tiny().num_hidden_layers
    torch.testing.assert_close(out.loss, ref.loss, rtol=RTOL, atol=ATOL)
    assert_same(g, g_ref, "grad")


@pytest.mark.parametrize("ckpt", [False, True])
def test_per_sequence_attention_pretraining_equals_padded(batch, ckpt, monkeypatch):
    """Attention one sequence at a time (the CPU default): the same logits, loss and gradients as the padded path;
    with checkpointing and dropout, the same as without checkpointing."""
    torch.manual_seed(0)
    model = BertForPreTraining(tiny()).train()
    ref, g_ref = pretrain_run(model, batch, unpad=False)
    calls = count_calls(monkeypatch, Segments, "attention")
    out, g = pretrain_run(model, batch, unpad=True, per_sequence=True, ckpt=ckpt)
    assert calls[0] == tiny().num_hidden_layers * (2 if ckpt else 1)  # checkpointing runs each layer again
    torch.testing.assert_close(out.prediction_logits, ref.prediction_logits, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(out.loss, ref.loss, rtol=RTOL, atol=ATOL)
    assert_same(g, g_ref, "grad")
    dropout = BertForPreTraining(tiny(dropout=0.1)).train()
    a, g_a = pretrain_run(dropout, batch, unpad=True, per_sequence=True, seed=7)
    b, g_b = pretrain_run(dropout, batch, unpad=True, per_sequence=True, ckpt=True, seed=7)
    torch.testing.assert_close(a.loss, b.loss, rtol=RTOL, atol=ATOL)
    assert_same(g_a, g_b, "grad")


def test_per_sequence_attention_is_off_with_compile():
    """Compiled layers keep the grid: the per-sequence lengths would be new constants every batch (compile is
    lazy: applying it only wraps the layers)."""
    compiled = apply_model_options(BertModel(tiny()), ModelOptionsConfig(per_sequence_attention=True, compile=True))
    eager = apply_model_options(BertModel(tiny()), ModelOptionsConfig(per_sequence_attention=True))
    assert compiled.per_sequence_attention is False and eager.per_sequence_attention is True


def test_unpad_indices_trims_to_a_multiple_of_8():
    mask = torch.zeros(3, 64, dtype=torch.long)
    mask[0, :10], mask[1, :3], mask[2, :17] = 1, 1, 1
    idx, m = unpad_indices(mask)
    assert m.shape == (3, 24) and idx.numel() == 30
    x = torch.randn(3 * 24, 5, requires_grad=True)
    y = gather_rows(x, idx)
    torch.testing.assert_close(y, x[idx])
    torch.testing.assert_close(scatter_rows(y, idx, 72)[idx], y)
    (y * torch.arange(30.0)[:, None]).sum().backward()
    expected = torch.zeros(72, 5)
    expected[idx] = torch.arange(30.0)[:, None].expand(-1, 5)
    torch.testing.assert_close(x.grad, expected)


def last_layer_rows(model: torch.nn.Module) -> list[int]:
    """The number of rows the last encoder layer's FFN computes, per forward (a hook: proves which path ran)."""
    encoder = getattr(model, "bert", model)
    rows: list[int] = []
    encoder.encoder.layer[-1].intermediate.dense.register_forward_hook(
        lambda _m, args, _out: rows.append(args[0].reshape(-1, args[0].size(-1)).size(0)))
    return rows


@pytest.mark.parametrize("unpad", [False, True])
@pytest.mark.parametrize("empty_row", [False, True])
def test_read_positions_prune_the_last_layer(unpad, empty_row):
    """`read_positions`: the last layer computes [CLS] and those positions only, and gives what the full model
    gives there (padding positions included: 0 unpadded, the padded path's own values padded) with the same pooler
    output. Left padding, holes and a one-token row; a batch without any real token falls back to the full path."""
    torch.manual_seed(0)
    model = BertModel(tiny()).eval()
    B, T = 4, 19
    ids = torch.randint(5, 1003, (B, T))
    mask = torch.ones(B, T, dtype=torch.long)
    mask[0, :6] = 0          # left padding: [CLS] position 0 is padding
    mask[1, 3:5] = 0         # holes
    mask[1, 15:] = 0
    mask[3, 1:] = 0          # a single token
    if empty_row:
        mask[:] = 0
    ids = ids * mask
    positions = torch.tensor([[0, 7, 2, 18], [0, 3, 14, 16], [5, 0, 0, 1], [0, 0, 9, 1]])  # padding ones too
    apply_model_options(model, ModelOptionsConfig(unpad=unpad, prune_last_layer=False))
    full = model(ids, attention_mask=mask, reads_padding=False)
    expected = full.last_hidden_state.gather(1, positions[..., None].expand(-1, -1, tiny().hidden_size))
    apply_model_options(model, ModelOptionsConfig(unpad=unpad, prune_last_layer=True))
    rows = last_layer_rows(model)
    out = model(ids, attention_mask=mask, read_positions=positions)
    assert rows == [int(mask.sum()) if unpad and empty_row else B * (1 + positions.size(1))]
    assert out.last_hidden_state.shape == (B, positions.size(1), tiny().hidden_size)
    torch.testing.assert_close(out.last_hidden_state, expected, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(out.pooler_output, full.pooler_output, rtol=RTOL, atol=ATOL)
    none = model(ids, attention_mask=mask, read_positions=positions[:, :0])  # P = 0: the pooler alone
    assert none.last_hidden_state.shape == (B, 0, tiny().hidden_size)
    torch.testing.assert_close(none.pooler_output, full.pooler_output, rtol=RTOL, atol=ATOL)
    with pytest.raises(ValueError, match=r"read_positions must lie in \[0, 19\)"):
        model(ids, attention_mask=mask, read_positions=positions + 5)


@pytest.mark.parametrize("layout", ["padded", "unpadded", "jagged", "per_sequence"])
def test_pruned_last_layer_equals_full_in_training(dbatch, dev, layout, monkeypatch):
    """Pretraining with masked positions and classification, on every attention layout: pruning the last layer
    gives the same logits, loss and gradients as computing it whole; with checkpointing and dropout, the same as
    without checkpointing."""
    import bertrain.model.unpad as unpad_module
    monkeypatch.setattr(unpad_module, "PER_SEQUENCE_MIN_SAVED", 0)  # the tiny batches would not pass the rule
    paths = dict(unpad=layout != "padded", jagged=layout == "jagged", per_sequence=layout == "per_sequence")
    torch.manual_seed(0)
    model = BertForPreTraining(tiny()).to(dev).train()
    ref, g_ref = pretrain_run(model, dbatch, **paths)
    rows = last_layer_rows(model)
    out, g = pretrain_run(model, dbatch, **paths, prune=True)
    B, P = dbatch["masked_positions"].shape
    assert rows == [B * (1 + P)]
    torch.testing.assert_close(out.prediction_logits, ref.prediction_logits, **tol(dev))
    torch.testing.assert_close(out.seq_relationship_logits, ref.seq_relationship_logits, **tol(dev))
    torch.testing.assert_close(out.loss, ref.loss, **tol(dev))
    assert_same(g, g_ref, "grad", **tol(dev))

    dropout = BertForPreTraining(tiny(dropout=0.1)).to(dev).train()
    a, g_a = pretrain_run(dropout, dbatch, **paths, prune=True, seed=7)
    b, g_b = pretrain_run(dropout, dbatch, **paths, prune=True, ckpt=True, seed=7)
    torch.testing.assert_close(a.loss, b.loss, **tol(dev))
    assert_same(g_a, g_b, "grad", **tol(dev))

    classifier = BertForSequenceClassification(tiny(), num_labels=3).to(dev).train()
    rows = last_layer_rows(classifier)
    labels = torch.arange(B, device=dev) % 3
    results = []
    for prune in (False, True):
        classifier.zero_grad(set_to_none=True)
        apply_model_options(classifier, ModelOptionsConfig(
            unpad=paths["unpad"], jagged_attention=paths["jagged"], per_sequence_attention=paths["per_sequence"],
            prune_last_layer=prune))
        c = classifier(dbatch["input_ids"], dbatch["token_type_ids"], dbatch["attention_mask"], labels=labels)
        c.loss.backward()
        results.append((c.logits, grads(classifier)))
    assert rows[1] == B  # [CLS] alone
    torch.testing.assert_close(results[1][0], results[0][0], **tol(dev))
    assert_same(results[1][1], results[0][1], "grad", **tol(dev))


def test_unpadded_classification_equals_padded(dev):
    torch.manual_seed(0)
    model = BertForSequenceClassification(tiny(), num_labels=3).to(dev)
    b = {k: v.to(dev) for k, v in qa_batch(tiny(), 5, 33, seed=4).items()}
    labels = torch.tensor([0, 1, 2, 1, 0], device=dev)
    results = []
    for unpad in (False, True):
        model.zero_grad(set_to_none=True)
        apply_model_options(model, ModelOptionsConfig(unpad=unpad))
        out = model(b["input_ids"], b["token_type_ids"], b["attention_mask"], labels=labels)
        out.loss.backward()
        results.append((out.logits, grads(model)))
    torch.testing.assert_close(results[1][0], results[0][0], **tol(dev))
    assert_same(results[1][1], results[0][1], "grad", **tol(dev))


def test_question_answering_unpads_only_outside_training(monkeypatch):
    """With unpadding on (the default options): training computes the plain path's logits everywhere, padding
    included (HF's loss sees them), and so the same loss and gradients; inference keeps the real tokens' logits and
    gives padding -10000 (no prediction changes)."""
    torch.manual_seed(0)
    model = BertForQuestionAnswering(tiny())
    b = qa_batch(tiny(), 4, 30, seed=5)
    x = dict(input_ids=b["input_ids"], token_type_ids=b["token_type_ids"], attention_mask=b["attention_mask"])
    y = dict(start_positions=b["start_positions"], end_positions=b["end_positions"])
    results = {}
    for unpad in (False, True):
        apply_model_options(model, ModelOptionsConfig(unpad=unpad))
        model.zero_grad(set_to_none=True)
        model.train()
        out = model(**x, **y)
        out.loss.backward()
        model.eval()
        results[unpad] = out, grads(model), model(**x)
    (train_ref, g_ref, ref), (train, g, out) = results[False], results[True]
    torch.testing.assert_close(train.start_logits, train_ref.start_logits, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(train.end_logits, train_ref.end_logits, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(train.loss, train_ref.loss, rtol=RTOL, atol=ATOL)
    assert_same(g, g_ref, "grad")
    real = b["attention_mask"].bool()
    torch.testing.assert_close(out.start_logits[real], ref.start_logits[real], rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(out.end_logits[real], ref.end_logits[real], rtol=RTOL, atol=ATOL)
    assert (out.start_logits[~real] == -10000).all() and (out.end_logits[~real] == -10000).all()
    assert (ref.start_logits[~real] != -10000).all()  # the plain path's padding logits are the padding's own


@pytest.mark.parametrize("unpad", [False, True])
def test_activation_checkpointing_equals_plain_with_dropout(dbatch, dev, unpad, monkeypatch):
    """Checkpointing applied from outside (per layer, by `apply_model_options`): the same loss and gradients, dropout
    included; switched off again, the layers are plain `BertLayer`s (nothing wrapped, nothing to pay)."""
    torch.manual_seed(0)
    model = BertForPreTraining(tiny(dropout=0.1)).to(dev).train()
    ref, g_ref = pretrain_run(model, dbatch, unpad=unpad, seed=7)
    calls = count_checkpoints(monkeypatch)
    out, g = pretrain_run(model, dbatch, unpad=unpad, ckpt=True, seed=7)
    assert calls[0] == tiny().num_hidden_layers
    torch.testing.assert_close(out.loss, ref.loss, **tol(dev))
    assert_same(g, g_ref, "grad", **tol(dev))
    with torch.no_grad():  # evaluation: nothing to recompute, no checkpoint
        model(dbatch["input_ids"], dbatch["token_type_ids"], dbatch["attention_mask"])
    assert calls[0] == tiny().num_hidden_layers
    again, g_again = pretrain_run(model, dbatch, unpad=unpad, seed=7)  # switched off
    assert calls[0] == tiny().num_hidden_layers
    assert all(type(layer) is BertLayer for layer in model.bert.encoder.layer)
    torch.testing.assert_close(again.loss, ref.loss, **tol(dev))
    assert_same(g_again, g_ref, "grad", **tol(dev))


def test_split_qkv_ablation_equals_fused(batch):
    torch.manual_seed(0)
    model = BertForPreTraining(tiny())
    ref, g_ref = pretrain_run(model, batch, unpad=True)
    split_qkv(model)
    assert any(isinstance(m, SplitQKV) for m in model.modules())
    out, g = pretrain_run(model, batch, unpad=True)
    torch.testing.assert_close(out.loss, ref.loss, rtol=RTOL, atol=ATOL)
    assert_same({k.replace(".fused", ""): v for k, v in g.items()}, g_ref, "grad")


def test_bf16_autocast_unpadded_close_to_padded(batch):
    """bf16 paths agree to bf16 precision (the GPU recipe runs exactly this code under autocast)."""
    torch.manual_seed(0)
    model = BertForPreTraining(tiny())
    outs = []
    for unpad in (False, True):
        apply_model_options(model, ModelOptionsConfig(unpad=unpad))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            outs.append(model(batch["input_ids"], batch["token_type_ids"], batch["attention_mask"],
                              masked_positions=batch["masked_positions"], labels=batch["masked_labels"]).loss)
    torch.testing.assert_close(outs[1], outs[0], rtol=2e-2, atol=2e-2)


COMPILE = os.environ.get("BERTRAIN_TEST_COMPILE") == "1"


@pytest.mark.skipif(not COMPILE, reason="torch.compile (inductor C++ codegen) of the tiny model takes 1-3 minutes "
                                        "on the 2-core CI machine, over the suite's time budget; "
                                        "set BERTRAIN_TEST_COMPILE=1 to run it")
@pytest.mark.parametrize("jagged", [False, True])
@pytest.mark.parametrize("ckpt", [False, True])
def test_compiled_layers_equal_eager(batch, jagged, ckpt):
    """Per-layer compile, alone and over per-layer checkpointing (torchtitan's order: compile traces through the
    checkpointed layer), equals eager; with the last layer pruned (the default), so both the full layers and the
    pruned one are compiled."""
    torch.manual_seed(0)
    model = BertForPreTraining(tiny())
    ref, g_ref = pretrain_run(model, batch, unpad=True, jagged=jagged)
    apply_model_options(model, ModelOptionsConfig(jagged_attention=jagged, gradient_checkpointing=ckpt, compile=True))
    out, g = pretrain_run(model, batch, unpad=True, jagged=jagged, ckpt=ckpt, prune=True)
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-4, atol=1e-5)
    for k in g_ref:
        torch.testing.assert_close(g[k], g_ref[k], rtol=1e-4, atol=1e-5)
    # another length distribution: same graph (dynamic shapes), still equal
    b2 = pretraining_batch(tiny(), 6, 40, seed=11)
    model2 = BertForPreTraining(tiny())
    model2.load_state_dict({k.replace("._orig_mod", ""): v for k, v in model.state_dict().items()})
    out2, _ = pretrain_run(model, b2, unpad=True, jagged=jagged, ckpt=ckpt, prune=True)
    ref2, _ = pretrain_run(model2, b2, unpad=True, jagged=jagged)
    torch.testing.assert_close(out2.loss, ref2.loss, rtol=1e-4, atol=1e-5)


def test_per_sequence_attention_only_where_the_grid_wastes_enough():
    """Per-sequence attention pays for its loop of SDPA calls only where the padded grid would compute many extra
    attention scores per sequence: heads x (T'^2 - mean squared length) >= PER_SEQUENCE_MIN_SAVED."""
    from bertrain.model.unpad import PER_SEQUENCE_MIN_SAVED, attention_layout

    def mask(lengths: list[int], T: int) -> torch.Tensor:
        return (torch.arange(T)[None] < torch.tensor(lengths)[:, None]).long()

    sparse = mask([128, 40, 40, 40], 128)            # extra scores: 12 x (16384 - 5296) = 133k per sequence
    layout = attention_layout(sparse, unpad=True, per_sequence=True, num_heads=12)
    assert layout.segments is not None and layout.segments.lengths == (128, 40, 40, 40)
    assert attention_layout(sparse, unpad=True, num_heads=12).segments is None            # off unless asked
    assert attention_layout(sparse, unpad=True, per_sequence=True, num_heads=1).segments is None  # 11k: too few
    full = mask([128, 128, 120, 128], 128)           # 12 x (16384 - 15888) = 6.0k
    assert attention_layout(full, unpad=True, per_sequence=True, num_heads=12).segments is None
    short = mask([64, 20, 20, 40], 64)               # a 2-head model at length 64: 2 x (4096 - 1624) = 4.9k
    assert attention_layout(short, unpad=True, per_sequence=True, num_heads=2).segments is None
    assert 2 * (4096 - 1624) < PER_SEQUENCE_MIN_SAVED <= 12 * (16384 - 5296)
