"""Parity with Hugging Face transformers on CPU in fp32: outputs, losses and every parameter's gradient agree to
<= 1e-5 relative error (max|a - b| / max|b|), with padded batches; on a random tiny config and on the real
all-MiniLM-L6-v2. Weights travel through the HF folder format (HF save_pretrained -> our from_pretrained, or ours
-> HF), so the key map is tested on the way."""
from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from bertrain import BertConfig, BertForPreTraining, BertForQuestionAnswering, BertForSequenceClassification, BertModel
from bertrain.model.hf import to_hf_state_dict
from bertrain.model.options import ModelOptionsConfig, apply_model_options

transformers = pytest.importorskip("transformers")

TOL = 1e-5
VOCAB = 99  # not a multiple of 8: exercises the internal vocabulary padding


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    assert a.shape == b.shape, (a.shape, b.shape)
    scale = b.abs().max().item()
    return (a - b).abs().max().item() / (scale if scale > 0 else 1.0)


def assert_close(a: torch.Tensor, b: torch.Tensor, what: str, tol: float = TOL) -> None:
    e = rel_err(a, b)
    assert e <= tol, f"{what}: relative error {e:.3g} > {tol}"


def write_vocab(path: Path, n: int) -> None:
    special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    path.write_text("\n".join(special + [f"tok{i}" for i in range(n - len(special))]) + "\n")


def hf_config(**kw):
    base = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
                max_position_embeddings=64, type_vocab_size=2, hidden_dropout_prob=0.1,
                attention_probs_dropout_prob=0.1, attn_implementation="eager")
    return transformers.BertConfig(**{**base, **kw})


@torch.no_grad()
def randomize(model: torch.nn.Module, seed: int = 0) -> None:
    """Random values everywhere (biases, LayerNorms, zeroed rows too), so no mismatch can hide behind a 0 or a 1."""
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.copy_(torch.randn(p.shape, generator=g) * 0.2 + (1.0 if p.ndim == 1 and p.mean() == 1 else 0.0))


def hf_folder(tmp_path: Path, cls, name: str, **kw) -> tuple[Path, torch.nn.Module]:
    torch.manual_seed(0)
    model = cls(hf_config(**kw))
    randomize(model)
    out = tmp_path / name
    model.save_pretrained(out)
    write_vocab(out / "vocab.txt", VOCAB)
    return out, model.eval()


def batch(B: int = 3, T: int = 12, seed: int = 1) -> dict[str, torch.Tensor]:
    """A padded batch: lengths T, T-5, 3; segment B starts halfway; token 0 = [PAD] on padding."""
    g = torch.Generator().manual_seed(seed)
    lengths = [T, T - 5, 3][:B]
    input_ids = torch.randint(5, VOCAB, (B, T), generator=g)
    attention_mask = torch.zeros(B, T, dtype=torch.long)
    token_type_ids = torch.zeros(B, T, dtype=torch.long)
    for i, n in enumerate(lengths):
        attention_mask[i, :n] = 1
        token_type_ids[i, n // 2:n] = 1
        input_ids[i, n:] = 0
    input_ids[:, 0] = 2  # [CLS]
    return dict(input_ids=input_ids, token_type_ids=token_type_ids, attention_mask=attention_mask)


# Gradients that are exactly 0 in exact arithmetic, so both sides hold only rounding noise and a relative error
# means nothing: the attention key bias (adding b to every key adds the constant q.b to all of a query's scores,
# which softmax ignores); for span extraction, anything that shifts all of a sequence's start (end) logits equally:
# the qa_outputs bias and the last layer's output LayerNorm bias. These are checked to be ~0 on both sides.
ZERO_GRADS = ("attention.self.key.bias",)


def compare_grads(ours: torch.nn.Module, hf: torch.nn.Module, zero_grads: tuple[str, ...] = ZERO_GRADS) -> None:
    """Every parameter's gradient, ours mapped to HF names by the same key map that exports the weights."""
    our_grads = to_hf_state_dict({k: p.grad for k, p in ours.named_parameters()}, ours.config)
    hf_grads = {k: p.grad for k, p in hf.named_parameters()}
    assert set(our_grads) == set(hf_grads)
    scale = max(g.abs().max().item() for g in hf_grads.values())
    for k, g in hf_grads.items():
        assert g is not None and our_grads[k] is not None, k
        if k.endswith(zero_grads):
            assert max(our_grads[k].abs().max(), g.abs().max()) <= TOL * scale, f"grad {k} should be ~0"
            continue
        assert_close(our_grads[k], g, f"grad {k}")


def test_pretraining_parity_tiny(tmp_path):
    path, hf = hf_folder(tmp_path, transformers.BertForPreTraining, "hf")
    ours = BertForPreTraining.from_pretrained(path).eval()
    x = batch()
    labels = torch.full_like(x["input_ids"], -100)
    labels[0, [1, 4, 9]] = torch.tensor([7, 8, 9])
    labels[1, [2, 5]] = torch.tensor([10, 98])
    labels[2, 1] = 11
    nsp = torch.tensor([0, 1, 1])

    h_o, h_h = ours.bert(**x), hf.bert(**x)
    assert_close(h_o.last_hidden_state, h_h.last_hidden_state, "last_hidden_state")
    assert_close(h_o.pooler_output, h_h.pooler_output, "pooler_output")

    o = ours(**x, labels=labels, next_sentence_label=nsp)
    r = hf(**x, labels=labels, next_sentence_label=nsp)
    assert o.prediction_logits.shape == (3, 12, VOCAB)
    assert_close(o.prediction_logits, r.prediction_logits, "prediction_logits")
    assert_close(o.seq_relationship_logits, r.seq_relationship_logits, "seq_relationship_logits")
    assert_close(o.loss, r.loss, "loss")
    o.loss.backward()
    r.loss.backward()
    compare_grads(ours, hf)

    # The MLM head on gathered positions gives HF's full logits at those positions, and the same loss.
    ours.zero_grad()
    pos = torch.tensor([[1, 4, 9], [2, 5, 0], [1, 0, 0]])  # padding slots point at 0
    plabels = torch.tensor([[7, 8, 9], [10, 98, -100], [11, -100, -100]])
    g = ours(**x, masked_positions=pos, labels=plabels, next_sentence_label=nsp)
    assert g.prediction_logits.shape == (3, 3, VOCAB)
    expected = r.prediction_logits.gather(1, pos[..., None].expand(-1, -1, VOCAB))
    assert_close(g.prediction_logits, expected, "gathered prediction_logits")
    assert_close(g.loss, r.loss, "loss with masked_positions")
    g.loss.backward()
    compare_grads(ours, hf)


def test_classification_parity_tiny(tmp_path):
    path, hf = hf_folder(tmp_path, transformers.BertForSequenceClassification, "cls", num_labels=3)
    ours = BertForSequenceClassification.from_pretrained(path).eval()
    assert ours.num_labels == 3
    x, labels = batch(), torch.tensor([0, 2, 1])
    o, r = ours(**x, labels=labels), hf(**x, labels=labels)
    assert_close(o.logits, r.logits, "logits")
    assert_close(o.loss, r.loss, "loss")
    o.loss.backward()
    r.loss.backward()
    compare_grads(ours, hf)


def test_regression_parity_tiny(tmp_path):
    path, hf = hf_folder(tmp_path, transformers.BertForSequenceClassification, "reg", num_labels=1)
    ours = BertForSequenceClassification.from_pretrained(path).eval()
    assert ours.num_labels == 1
    x, labels = batch(), torch.tensor([0.5, -1.0, 2.0])
    o, r = ours(**x, labels=labels), hf(**x, labels=labels)
    assert_close(o.logits, r.logits, "logits")
    assert_close(o.loss, r.loss, "MSE loss")


@pytest.mark.parametrize("options", ["default, training", "plain path, inference"])
def test_question_answering_parity_tiny(tmp_path, options):
    """HF's logits at every position (padding included), loss and gradients: in training with the default options
    (as the trainer runs it: QA training keeps padding), and on the plain path in eval mode. (Inference with the
    default options runs unpadded: padding logits -10000, tested in test_fastpath.py.)"""
    path, hf = hf_folder(tmp_path, transformers.BertForQuestionAnswering, "qa")
    if options == "default, training":  # dropout off, so that training mode computes what HF's eval mode does
        ours = BertForQuestionAnswering.from_pretrained(path, hidden_dropout_prob=0.0,
                                                        attention_probs_dropout_prob=0.0).train()
    else:
        ours = apply_model_options(BertForQuestionAnswering.from_pretrained(path), ModelOptionsConfig(unpad=False)).eval()
    assert ours.bert.pooler is None  # as HF: no pooler weights to miss or to leave unused
    x = batch()
    start, end = torch.tensor([3, 1, 50]), torch.tensor([5, 2, 60])  # the last is out of range: clamped, ignored
    o = ours(**x, start_positions=start, end_positions=end)
    r = hf(**x, start_positions=start, end_positions=end)
    assert_close(o.start_logits, r.start_logits, "start_logits")
    assert_close(o.end_logits, r.end_logits, "end_logits")
    assert_close(o.loss, r.loss, "loss")
    o.loss.backward()
    r.loss.backward()
    last = f"encoder.layer.{ours.config.num_hidden_layers - 1}.output.LayerNorm.bias"
    compare_grads(ours, hf, ZERO_GRADS + ("qa_outputs.bias", last))


def minilm_batch() -> dict[str, torch.Tensor]:
    x = batch(B=3, T=16)
    x["input_ids"] = torch.where(x["attention_mask"].bool(),
                                 torch.randint(1000, 30000, (3, 16), generator=torch.Generator().manual_seed(3)), 0)
    x["input_ids"][:, 0] = 101
    return x


def test_minilm_encoder_parity(minilm_path):
    ours = BertModel.from_pretrained(minilm_path).eval()
    hf = transformers.BertModel.from_pretrained(minilm_path, attn_implementation="eager").eval()
    x = minilm_batch()
    o, r = ours(**x), hf(**x)
    assert_close(o.last_hidden_state, r.last_hidden_state, "last_hidden_state")
    assert_close(o.pooler_output, r.pooler_output, "pooler_output")
    g = torch.Generator().manual_seed(5)
    w1, w2 = torch.randn(o.last_hidden_state.shape, generator=g), torch.randn(o.pooler_output.shape, generator=g)

    def f(out):
        return (out.last_hidden_state * w1).sum() + (out.pooler_output * w2).sum()

    f(o).backward()
    f(r).backward()
    compare_grads(ours, hf)


def test_minilm_pretraining_parity(minilm_path, tmp_path, caplog):
    torch.manual_seed(0)
    with caplog.at_level(logging.WARNING, logger="bertrain"):
        ours = BertForPreTraining.from_pretrained(minilm_path)
    assert "MLM head" in caplog.text and "NSP head" in caplog.text  # initialised, and said so
    ours.save_pretrained(tmp_path / "m")  # HF gets our freshly initialised heads, identical
    hf = transformers.BertForPreTraining.from_pretrained(tmp_path / "m", attn_implementation="eager").eval()
    ours.eval()
    x = minilm_batch()
    labels = torch.full_like(x["input_ids"], -100)
    labels[0, [2, 7]] = torch.tensor([2054, 1037])
    labels[1, 3] = 3000
    nsp = torch.tensor([1, 0, -100])
    o, r = ours(**x, labels=labels, next_sentence_label=nsp), hf(**x, labels=labels, next_sentence_label=nsp)
    assert_close(o.prediction_logits, r.prediction_logits, "prediction_logits")
    assert_close(o.seq_relationship_logits, r.seq_relationship_logits, "seq_relationship_logits")
    assert_close(o.loss, r.loss, "loss")
    o.loss.backward()
    r.loss.backward()
    compare_grads(ours, hf)


def test_our_init_loads_in_hf_identically(tmp_path):
    """A model built from a config (not loaded) exports to HF and computes the same there."""
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=48, max_position_embeddings=64)
    ours = BertForPreTraining(cfg).eval()
    ours.save_pretrained(tmp_path / "m")
    hf = transformers.BertForPreTraining.from_pretrained(tmp_path / "m", attn_implementation="eager").eval()
    x = batch()
    assert_close(ours(**x).prediction_logits, hf(**x).prediction_logits, "prediction_logits")


def test_checkpointed_model_saves_and_loads_unchanged(tmp_path):
    """Activation checkpointing is applied in place (per layer, by `apply_model_options`): `save_pretrained` writes
    the same weights under the same names, which `transformers` and our `from_pretrained` load with every key
    matched, computing what the model computes; a plain model's state dict loads into a checkpointed one."""
    from safetensors.torch import load_file

    path, hf = hf_folder(tmp_path, transformers.BertForPreTraining, "hf")
    plain = BertForPreTraining.from_pretrained(path).eval()
    ours = apply_model_options(BertForPreTraining.from_pretrained(path),
                               ModelOptionsConfig(gradient_checkpointing=True)).eval()
    ours.load_state_dict(plain.state_dict())  # strict: the same keys
    ours.save_pretrained(tmp_path / "ckpt")
    plain.save_pretrained(tmp_path / "plain")
    a, b = load_file(tmp_path / "ckpt" / "model.safetensors"), load_file(tmp_path / "plain" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    back_hf, info = transformers.BertForPreTraining.from_pretrained(tmp_path / "ckpt", attn_implementation="eager",
                                                                    output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    back = BertForPreTraining.from_pretrained(tmp_path / "ckpt")
    assert back.loading_info == {"initialized": [], "missing_keys": [], "unexpected_keys": []}
    x = batch()
    labels = torch.full_like(x["input_ids"], -100)
    labels[0, [1, 4]], labels[2, 1] = torch.tensor([7, 8]), 11
    nsp = torch.tensor([0, 1, 1])  # HF computes a loss only with both labels
    o = ours(**x, labels=labels, next_sentence_label=nsp)  # eval mode, grad on: checkpointed
    r = hf(**x, labels=labels, next_sentence_label=nsp)
    assert_close(o.prediction_logits, r.prediction_logits, "prediction_logits")
    assert_close(o.loss, r.loss, "loss")
    o.loss.backward()
    r.loss.backward()
    compare_grads(ours, hf)
    for model in (back_hf.eval(), back.eval()):
        assert_close(model(**x).prediction_logits, r.prediction_logits, "prediction_logits, reloaded")
