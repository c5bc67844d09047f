"""The model on its own: config and presets, shapes, masks, losses, vocabulary padding, heads."""
from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from helpers import assert_same, count_checkpoints, grads

from bertrain import BertConfig, BertForPreTraining, BertForQuestionAnswering, BertForSequenceClassification, BertModel
from bertrain.bench.batches import pretraining_batch
from bertrain.commands.info import flops_per_token
from bertrain.model import bert as bert_module
from bertrain.model.bert import PRESETS
from bertrain.model.hf import config_from_hf_dict, config_from_json_file, config_to_hf_dict
from bertrain.model.losses import (classification_loss_sums, mean_from_sums, pretraining_loss_sums,
                                   qa_loss_sums)
from bertrain.model.options import CheckpointedBertLayer, ModelOptionsConfig, apply_model_options
from bertrain.train.optim import param_groups

V = 101  # a small vocabulary that is not a multiple of 8


def tiny(**kw) -> BertConfig:
    return BertConfig.from_preset("tiny", vocab_size=V, **kw)


def random_batch(B=4, T=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, V, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, 10:] = 0
    ids[1, 10:] = 0
    return ids, torch.zeros_like(ids), mask


# ----------------------------------------------------------------------------------------------- config

@pytest.mark.parametrize("name", list(PRESETS))
def test_every_preset_builds(name):
    cfg = BertConfig.from_preset(name)
    assert cfg.vocab_size == 30522 and cfg.padded_vocab_size == 30528
    assert cfg.hidden_size % cfg.num_attention_heads == 0
    device = "cpu" if name in ("tiny", "mini", "small") else "meta"  # real memory only for the small ones
    with torch.device(device):
        model = BertForPreTraining(cfg)
    assert model.num_parameters() > 0


def test_parameter_counts_match_bert_paper_and_hf():
    # Counts of transformers' BertModel / BertForPreTraining for bert-base/large-uncased (30522 vocabulary).
    expected = {"base": (109_482_240, 110_106_428), "large": (335_141_888, 336_226_108)}
    for name, (encoder, pretraining) in expected.items():
        cfg = BertConfig.from_preset(name)
        with torch.device("meta"):
            assert BertModel(cfg).num_parameters() == encoder
            m = BertForPreTraining(cfg)
        assert m.num_parameters() == pretraining
        assert m.num_parameters(exclude_padding=False) == pretraining + 6 * (cfg.hidden_size + 1)
    # Training FLOPs per token ~ 6 x parameters (the weights' matmuls, forward + backward) plus attention.
    assert 6 * 110e6 < flops_per_token(BertConfig.from_preset("base"), 128) < 6.6 * 110e6


def test_tiny_preset_learns_one_batch_on_the_padding_free_path(monkeypatch):
    """The tiny preset as the trainer runs it (default ModelOptionsConfig: unpadded, masked-position MLM head) must
    overfit one batch: catches broken gradients or loss wiring anywhere on the path pretraining really takes."""
    layouts = []

    def spy(*args, **kwargs):
        layouts.append(original(*args, **kwargs))
        return layouts[-1]
    original = bert_module.attention_layout
    monkeypatch.setattr(bert_module, "attention_layout", spy)
    torch.manual_seed(0)
    cfg = BertConfig.from_preset("tiny", hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = apply_model_options(BertForPreTraining(cfg), ModelOptionsConfig()).train()
    b = pretraining_batch(cfg, 4, 32, seed=0)
    assert int(b["attention_mask"].sum()) < b["attention_mask"].numel()  # there is padding to skip
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(25):
        out = model(b["input_ids"], b["token_type_ids"], b["attention_mask"], masked_positions=b["masked_positions"],
                    labels=b["masked_labels"], next_sentence_label=b["next_sentence_labels"])
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(out.loss.item())
    assert layouts and all(layout.indices is not None for layout in layouts)  # unpadded every time
    assert losses[0] > math.log(cfg.vocab_size) * 0.9  # starts near chance (uniform over the vocabulary)
    assert losses[-1] < 0.2 * losses[0], losses


def test_preset_overrides_and_unknown_preset():
    assert BertConfig.from_preset("base", vocab_size=1000).vocab_size == 1000
    with pytest.raises(ValueError, match="unknown model preset 'huge'"):
        BertConfig.from_preset("huge")


@pytest.mark.parametrize("kw, field", [
    (dict(hidden_size=100, num_attention_heads=3), "hidden_size"),
    (dict(hidden_dropout_prob=1.5), "hidden_dropout_prob"),
    (dict(hidden_act="gelu_magic"), "hidden_act"),
    (dict(num_hidden_layers=0), "num_hidden_layers"),
    (dict(vocab_size=-3), "vocab_size"),
    (dict(layer_norm_eps=0.0), "layer_norm_eps"),
    (dict(pad_token_id=500, vocab_size=100), "pad_token_id"),
    (dict(hidden_size=64.0), "hidden_size"),
])
def test_config_validation_names_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        BertConfig(**kw)


def test_from_json_file_reads_hf_configs_and_rejects_nonsense(tmp_path):
    hf = {"architectures": ["BertForMaskedLM"], "model_type": "bert", "transformers_version": "4.8.2",
          "gradient_checkpointing": False, "use_cache": True, "position_embedding_type": "absolute",
          "vocab_size": 1234, "hidden_size": 48, "num_hidden_layers": 3, "num_attention_heads": 4,
          "intermediate_size": 96, "hidden_act": "gelu_new", "hidden_dropout_prob": 0, "layer_norm_eps": 1e-7}
    f = tmp_path / "config.json"
    f.write_text(json.dumps(hf))
    cfg = config_from_json_file(f)
    assert (cfg.vocab_size, cfg.hidden_size, cfg.hidden_act, cfg.hidden_dropout_prob) == (1234, 48, "gelu_new", 0.0)
    for bad, key in [({"num_attention_heads": 5}, "hidden_size"), ({"vocab_size": "many"}, "vocab_size"),
                     ({"model_type": "roberta"}, "model_type"), ({"attention_probs_dropout_prob": 2}, "attention"),
                     ({"position_embedding_type": "relative_key"}, "position_embedding_type")]:
        f.write_text(json.dumps({**hf, **bad}))
        with pytest.raises(ValueError, match=key) as e:
            config_from_json_file(f)
        assert str(f) in str(e.value)
    f.write_text("{not json")
    with pytest.raises(ValueError, match="config.json"):
        config_from_json_file(f)


def test_to_hf_dict_is_read_by_transformers():
    transformers = pytest.importorskip("transformers")
    cfg = BertConfig.from_preset("mini", vocab_size=777, hidden_act="relu")
    d = config_to_hf_dict(cfg, ["BertForPreTraining"])
    hf = transformers.BertConfig(**d)
    assert d["model_type"] == "bert" and d["architectures"] == ["BertForPreTraining"]
    assert "pad_vocab_size_multiple" not in d
    for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
              "hidden_act", "max_position_embeddings", "type_vocab_size", "layer_norm_eps", "pad_token_id"):
        assert getattr(hf, k) == getattr(cfg, k), k
    assert config_from_hf_dict(d) == cfg


# ----------------------------------------------------------------------------------------------- model

def test_shapes_and_output_names():
    torch.manual_seed(0)
    ids, tt, mask = random_batch()
    out = BertModel(tiny())(ids, tt, mask)
    assert out.last_hidden_state.shape == (4, 16, 64) and out.pooler_output.shape == (4, 64)
    pt = BertForPreTraining(tiny())(ids, tt, mask)
    assert pt.prediction_logits.shape == (4, 16, V) and pt.seq_relationship_logits.shape == (4, 2)
    assert pt.loss is None and pt.mlm_loss is None and pt.nsp_loss is None
    pos = torch.tensor([[1, 2, 3]] * 4)
    assert BertForPreTraining(tiny())(ids, tt, mask, masked_positions=pos).prediction_logits.shape == (4, 3, V)
    assert BertForSequenceClassification(tiny(), num_labels=5)(ids, tt, mask).logits.shape == (4, 5)
    qa = BertForQuestionAnswering(tiny())(ids, tt, mask)
    assert qa.start_logits.shape == qa.end_logits.shape == (4, 16)


def test_padding_does_not_change_real_tokens():
    torch.manual_seed(0)
    model = BertModel(tiny()).eval()
    ids = torch.randint(1, V, (1, 9))
    alone = model(ids).last_hidden_state
    padded_ids = torch.cat([ids, torch.zeros(1, 7, dtype=torch.long)], 1)
    mask = torch.cat([torch.ones(1, 9), torch.zeros(1, 7)], 1).long()
    padded = model(padded_ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(padded[:, :9], alone, rtol=1e-5, atol=1e-6)


def test_fully_padded_row_gives_no_nan():
    torch.manual_seed(0)
    model = BertForPreTraining(tiny())
    ids, tt, mask = random_batch()
    mask[2] = 0
    out = model(ids, tt, mask, labels=ids, next_sentence_label=torch.tensor([0, 1, 0, 1]))
    assert torch.isfinite(out.prediction_logits).all() and torch.isfinite(out.loss)
    out.loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_losses_with_no_targets_are_zero_not_nan():
    torch.manual_seed(0)
    model = BertForPreTraining(tiny())
    ids, tt, mask = random_batch()
    pos = torch.zeros(4, 5, dtype=torch.long)
    labels = torch.full((4, 5), -100)
    labels[0, 0] = 7
    out = model(ids, tt, mask, masked_positions=pos, labels=labels, next_sentence_label=torch.full((4,), -100))
    assert out.nsp_loss.item() == 0.0 and torch.isfinite(out.mlm_loss) and out.mlm_loss > 0
    assert out.loss.item() == pytest.approx(out.mlm_loss.item())
    out.loss.backward()
    # Zero NSP loss still reaches the NSP head (zero gradient, not None): DDP needs every parameter used.
    assert model.cls.seq_relationship.weight.grad is not None
    assert model.cls.seq_relationship.weight.grad.abs().sum() == 0
    out = model(ids, tt, mask, masked_positions=pos, labels=torch.full((4, 5), -100),
                next_sentence_label=torch.tensor([0, 1, -100, 1]))
    assert out.mlm_loss.item() == 0.0 and torch.isfinite(out.loss) and out.loss == out.nsp_loss


def test_mlm_and_nsp_losses_are_means_over_targets():
    torch.manual_seed(0)
    model = BertForPreTraining(tiny()).eval()
    ids, tt, mask = random_batch()
    labels = torch.full_like(ids, -100)
    labels[0, 3], labels[2, 5] = 11, 12
    nsp = torch.tensor([0, 1, -100, 0])
    out = model(ids, tt, mask, labels=labels, next_sentence_label=nsp)
    logp = out.prediction_logits.log_softmax(-1)
    mlm = -(logp[0, 3, 11] + logp[2, 5, 12]) / 2
    nl = out.seq_relationship_logits.log_softmax(-1)
    nsp_ref = -(nl[0, 0] + nl[1, 1] + nl[3, 0]) / 3
    torch.testing.assert_close(out.mlm_loss, mlm)
    torch.testing.assert_close(out.nsp_loss, nsp_ref)
    torch.testing.assert_close(out.loss, mlm + nsp_ref)


def test_vocabulary_padding_stays_zero_through_training():
    torch.manual_seed(0)
    cfg = tiny()
    assert cfg.padded_vocab_size == 104
    model = BertForPreTraining(cfg)
    emb, bias = model.bert.embeddings.word_embeddings.weight, model.cls.predictions.bias
    assert emb.shape[0] == bias.shape[0] == 104
    assert emb[V:].abs().sum() == 0 and bias[V:].abs().sum() == 0 and emb[cfg.pad_token_id].abs().sum() == 0
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    ids, tt, mask = random_batch()
    for _ in range(3):
        out = model(ids, tt, mask, labels=ids, next_sentence_label=torch.tensor([0, 1, 0, 1]))
        out.loss.backward()
        assert emb.grad[V:].abs().sum() == 0 and bias.grad[V:].abs().sum() == 0
        opt.step()
        opt.zero_grad()
    assert emb[V:].abs().sum() == 0 and bias[V:].abs().sum() == 0
    assert bias[:V].abs().sum() > 0  # the real part did train
    # tied decoder: one tensor, counted once
    assert sum(p is emb for p in model.parameters()) == 1


def test_bert_initialisation():
    torch.manual_seed(0)
    model = BertForPreTraining(BertConfig.from_preset("mini", vocab_size=2000))
    dense = model.bert.encoder.layer[0].intermediate.dense
    assert abs(dense.weight.std().item() - 0.02) < 0.002 and dense.bias.abs().sum() == 0
    ln = model.bert.encoder.layer[0].output.LayerNorm
    assert (ln.weight == 1).all() and (ln.bias == 0).all()
    assert (model.cls.predictions.bias == 0).all()


def test_dropout_only_in_training():
    torch.manual_seed(0)
    model = BertModel(tiny())
    ids, tt, mask = random_batch()
    model.eval()
    assert torch.equal(model(ids, tt, mask).last_hidden_state, model(ids, tt, mask).last_hidden_state)
    model.train()
    assert not torch.equal(model(ids, tt, mask).last_hidden_state, model(ids, tt, mask).last_hidden_state)


def options_applied(model: BertForPreTraining) -> tuple:
    """What `apply_model_options` sets: the encoder's two switches and each encoder layer's class."""
    return model.bert.unpad, model.bert.jagged_attention, [type(layer) for layer in model.bert.encoder.layer]


def test_checkpointing_is_applied_from_outside_in_place_and_twice_is_once(monkeypatch):
    """Activation checkpointing is applied per encoder layer by `apply_model_options` (the model file has no flag
    for it), in place: parameter names, state_dict keys and the optimizer's no-decay groups (by name) are the plain
    model's. Applying the options twice is applying them once (the trainer applies them again to the model gathered
    back from FSDP shards, a deep copy of the model as it was before sharding): one checkpoint per layer."""
    torch.manual_seed(0)
    plain = BertForPreTraining(tiny())
    model = copy.deepcopy(plain)
    options = ModelOptionsConfig(unpad=False, jagged_attention=True, gradient_checkpointing=True)
    assert apply_model_options(model, options) is model
    assert all(type(layer) is CheckpointedBertLayer for layer in model.bert.encoder.layer)
    assert not any(hasattr(m, "gradient_checkpointing") for m in model.modules())
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in plain.named_parameters()]
    assert list(model.state_dict()) == list(plain.state_dict())

    def grouped(m: torch.nn.Module) -> list[list[str]]:
        names = {id(p): n for n, p in m.named_parameters()}
        return [[names[id(p)] for p in g["params"]] for g in param_groups(m, 0.01)]
    assert grouped(model) == grouped(plain)

    once = options_applied(model)
    apply_model_options(model, options)
    gathered = apply_model_options(copy.deepcopy(model), options)
    assert options_applied(model) == options_applied(gathered) == once
    calls = count_checkpoints(monkeypatch)
    ids, tt, mask = random_batch()
    gathered(ids, tt, mask, labels=ids, next_sentence_label=torch.tensor([0, 1, 0, 1])).loss.backward()
    assert calls[0] == tiny().num_hidden_layers


@pytest.mark.parametrize("act", ["gelu", "gelu_new", "relu", "gelu_pytorch_tanh"])
def test_activations(act):
    model = BertModel(tiny(hidden_act=act))
    assert torch.isfinite(model(random_batch()[0]).last_hidden_state).all()


def test_too_long_sequence_is_a_clear_error():
    model = BertModel(tiny(max_position_embeddings=8))
    with pytest.raises(ValueError, match="max_position_embeddings"):
        model(torch.ones(1, 9, dtype=torch.long))


def test_classification_and_regression_losses():
    torch.manual_seed(0)
    ids, tt, mask = random_batch()
    m = BertForSequenceClassification(tiny(), num_labels=3).eval()
    out = m(ids, tt, mask, labels=torch.tensor([0, 2, 1, 1]))
    torch.testing.assert_close(out.loss, torch.nn.functional.cross_entropy(out.logits, torch.tensor([0, 2, 1, 1])))
    r = BertForSequenceClassification(tiny(), num_labels=1).eval()
    y = torch.tensor([0.5, 1.0, -2.0, 3.0])
    out = r(ids, tt, mask, labels=y)
    torch.testing.assert_close(out.loss, ((out.logits.squeeze(-1) - y) ** 2).mean())
    with pytest.raises(ValueError, match="num_labels"):
        BertForSequenceClassification(tiny(), num_labels=0)


def test_question_answering_loss_ignores_out_of_range_positions():
    torch.manual_seed(0)
    ids, tt, mask = random_batch()
    m = BertForQuestionAnswering(tiny()).eval()
    out = m(ids, tt, mask, start_positions=torch.tensor([1, 2, 3, 99]), end_positions=torch.tensor([2, 3, 4, 99]))
    ce = torch.nn.functional.cross_entropy
    ref = (ce(out.start_logits[:3], torch.tensor([1, 2, 3])) + ce(out.end_logits[:3], torch.tensor([2, 3, 4]))) / 2
    torch.testing.assert_close(out.loss, ref)
    assert math.isfinite(out.loss.item())


# ----------------------------------------------------------------------------------------------- losses

def test_head_losses_are_the_trainers_sums_over_local_counts():
    """Each head's `.loss` is the sum of bertrain.model.losses (what the trainer uses) / the local target count."""
    torch.manual_seed(0)
    ids, tt, mask = random_batch()
    pos = torch.tensor([[1, 2, 3], [4, 5, 0], [6, 0, 0], [7, 8, 9]])
    mlm = torch.tensor([[11, 12, 13], [14, 15, -100], [16, -100, -100], [17, -100, 18]])
    nsp = torch.tensor([0, 1, -100, 1])
    out = BertForPreTraining(tiny()).eval()(ids, tt, mask, masked_positions=pos, labels=mlm, next_sentence_label=nsp)
    sums = pretraining_loss_sums(out.prediction_logits, out.seq_relationship_logits, mlm, nsp)
    assert (int(sums["mlm_count"]), int(sums["nsp_count"])) == (8, 3)
    torch.testing.assert_close(out.mlm_loss, sums["mlm_loss_sum"] / 8)
    torch.testing.assert_close(out.nsp_loss, sums["nsp_loss_sum"] / 3)
    torch.testing.assert_close(out.loss, sums["mlm_loss_sum"] / 8 + sums["nsp_loss_sum"] / 3)

    for num_labels, labels in ((3, torch.tensor([0, 2, -100, 1])), (1, torch.tensor([0.5, 1.0, -2.0, 3.0]))):
        out = BertForSequenceClassification(tiny(), num_labels=num_labels).eval()(ids, tt, mask, labels=labels)
        sums = classification_loss_sums(out.logits, labels)
        assert int(sums["count"]) == (3 if num_labels == 3 else 4)
        torch.testing.assert_close(out.loss, sums["loss_sum"] / sums["count"])

    start, end = torch.tensor([1, 2, 99, 4]), torch.tensor([2, 3, 99, 5])  # 99: outside, ignored
    out = BertForQuestionAnswering(tiny()).eval()(ids, tt, mask, start_positions=start, end_positions=end)
    sums = qa_loss_sums(out.start_logits, out.end_logits, start, end)
    assert int(sums["count"]) == 3
    torch.testing.assert_close(out.loss, mean_from_sums(sums["loss_sum"], sums["count"]))


def test_global_normalisation_over_micro_batches_equals_the_whole_batch():
    """The trainer's accumulation: sum each micro-batch's loss sums, divide by the step's total counts. With
    micro-batches holding different numbers of MLM targets this equals the loss (and every gradient) of the
    concatenated batch, which the mean of per-micro-batch means does not."""
    torch.manual_seed(0)
    cfg = tiny()
    model = BertForPreTraining(cfg).eval()
    a, b = pretraining_batch(cfg, 3, 24, seed=1), pretraining_batch(cfg, 5, 24, seed=2)
    keys = ("input_ids", "token_type_ids", "attention_mask", "masked_positions", "masked_labels",
            "next_sentence_labels")
    both = {k: torch.cat([a[k], b[k]]) for k in keys}

    def forward(x):
        out = model(x["input_ids"], x["token_type_ids"], x["attention_mask"], masked_positions=x["masked_positions"],
                    labels=x["masked_labels"], next_sentence_label=x["next_sentence_labels"])
        return out, pretraining_loss_sums(out.prediction_logits, out.seq_relationship_logits, x["masked_labels"],
                                          x["next_sentence_labels"])

    whole, _ = forward(both)
    whole.loss.backward()
    g_whole = grads(model)
    model.zero_grad()

    counts = [int((x["masked_labels"] != -100).sum()) for x in (a, b)]
    assert counts[0] / 3 != counts[1] / 5  # the micro-batches differ in targets per sequence
    mlm_total, nsp_total = sum(counts), 8
    mlm = nsp = 0.0
    means = []
    for x in (a, b):  # one micro-step each: the loss divided by the step's global counts, then backward
        out, sums = forward(x)
        share = sums["mlm_loss_sum"] / mlm_total + sums["nsp_loss_sum"] / nsp_total
        share.backward()
        mlm, nsp = mlm + sums["mlm_loss_sum"].detach(), nsp + sums["nsp_loss_sum"].detach()
        means.append(out.mlm_loss.detach())
    torch.testing.assert_close(mlm / mlm_total, whole.mlm_loss.detach())
    torch.testing.assert_close(nsp / nsp_total, whole.nsp_loss.detach())
    assert_same(grads(model), g_whole, "grad")
    assert abs(float(sum(means) / 2 - whole.mlm_loss.detach())) > 1e-3  # the naive average would not do


def test_cpu_dropout_draws_the_same_distribution_and_its_gradient_is_the_mask() -> None:
    """bert.Dropout draws its CPU mask with torch.rand instead of bernoulli_: keep rate 1 - p, kept values scaled by
    1 / (1 - p), the gradient is the same mask, reproducible under a seed, identity in eval."""
    from bertrain.model.bert import Dropout
    d = Dropout(0.1).train()
    x = torch.randn(400, 500, requires_grad=True)
    torch.manual_seed(3)
    y = d(x)
    kept = y != 0
    assert abs(kept.float().mean().item() - 0.9) < 0.005          # 200k draws: sd 0.0007
    torch.testing.assert_close(y[kept], x[kept] / 0.9)
    y.sum().backward()
    torch.testing.assert_close(x.grad, kept.float() / 0.9)
    torch.manual_seed(3)
    assert torch.equal(d(x), y)
    assert torch.equal(d.eval()(x), x)
    # the dtype of the input, as torch's kernel: a bf16 activation came back float32 (FSDP's bf16 LayerNorm then
    # refused it on the CPU: "mixed dtype (CPU): expect parameter to have scalar type of Float")
    for dtype in (torch.bfloat16, torch.float16):
        assert d.train()(x.detach().to(dtype)).dtype == dtype
