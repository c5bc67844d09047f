"""Audit of the model's options and the Python API: every speed option (and their combinations) against HF
transformers at edge lengths and padding, the inputs the embeddings would misread, the CPU dropout's draws in bf16,
and the README's Python snippet on the real all-MiniLM-L6-v2."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from bertrain import BertConfig, BertForPreTraining, BertForQuestionAnswering, BertForSequenceClassification
from bertrain.model.bert import Dropout
from bertrain.model.hf import to_hf_state_dict
from bertrain.model.options import ModelOptionsConfig, apply_model_options

REPO = Path(__file__).resolve().parents[1]
V = 99  # not a multiple of 8: the vocabulary is padded to 104 inside the model


def tiny(**kw) -> BertConfig:
    return BertConfig.from_preset("tiny", vocab_size=V, max_position_embeddings=64, **kw)


# ----------------------------------------------------------------------------------------------- inputs

def test_ids_in_the_padded_vocabulary_rows_are_a_clear_error():
    """vocab_size 99 is padded to 104 rows: ids 99..103 used to pass silently (zero embedding rows, where HF raises
    an IndexError), ids >= 104 and < 0 gave torch's "index out of range in self"."""
    model = BertForPreTraining(tiny()).eval()
    assert model.config.padded_vocab_size == 104
    for bad in (99, 103, 104, -1):
        with pytest.raises(ValueError, match=r"input_ids must lie in \[0, vocab_size=99\)"):
            model(torch.tensor([[2, bad, 3]]))
    assert model(torch.tensor([[2, 98, 3]])).prediction_logits.shape == (1, 3, V)  # the last real id is fine


def test_token_types_and_shapes_name_the_input():
    model = BertForSequenceClassification(tiny()).eval()
    ids = torch.randint(5, V, (2, 10))
    with pytest.raises(ValueError, match=r"token_type_ids must lie in \[0, type_vocab_size=2\); got 0\.\.2"):
        model(ids, token_type_ids=torch.tensor([[0] * 9 + [2]] * 2))
    with pytest.raises(ValueError, match=r"attention_mask has shape \(2, 9\), input_ids \(2, 10\)"):
        model(ids, attention_mask=torch.ones(2, 9, dtype=torch.long))
    with pytest.raises(ValueError, match=r"token_type_ids has shape \(2, 11\), input_ids \(2, 10\)"):
        model(ids, token_type_ids=torch.zeros(2, 11, dtype=torch.long))
    with pytest.raises(ValueError, match=r"input_ids must be a \(batch, length\) tensor .* got shape \(10,\)"):
        model(ids[0])
    with pytest.raises(ValueError, match=r"got shape \(0, 10\)"):
        model(ids[:0])
    with pytest.raises(ValueError, match="input_ids must hold integer token ids; got torch.float32"):
        model(ids.float())


def test_mlm_labels_and_masked_positions_shapes_are_clear_errors():
    model = BertForPreTraining(tiny()).eval()
    ids = torch.randint(5, V, (2, 10))
    pos = torch.tensor([[1, 4], [2, 3]])
    with pytest.raises(ValueError, match=r"labels has shape \(2, 10\); it must be \(2, 2\): aligned with "
                                         r"masked_positions"):
        model(ids, masked_positions=pos, labels=torch.zeros(2, 10, dtype=torch.long))
    with pytest.raises(ValueError, match=r"labels has shape \(2, 2\); it must be \(2, 10\): one label per token"):
        model(ids, labels=torch.zeros(2, 2, dtype=torch.long))
    with pytest.raises(ValueError, match=r"masked_positions\) must be \(batch=2, P\); got shape \(2,\)"):
        model(ids, masked_positions=pos[0])
    with pytest.raises(ValueError, match=r"must lie in \[0, 10\).*masked_positions"):
        model(ids, masked_positions=pos + 7)


def test_pretraining_with_no_masked_position_gives_the_nsp_loss():
    """masked_positions (B, 0) (the docstring allows P >= 0): the MLM loss crashed in its reshape ("cannot reshape
    tensor of 0 elements into shape [0, -1]"); now 0, and the loss is NSP's."""
    torch.manual_seed(0)
    model = BertForPreTraining(tiny())
    ids = torch.randint(5, V, (2, 10))
    nsp = torch.tensor([0, 1])
    out = model(ids, masked_positions=ids[:, :0], labels=ids[:, :0], next_sentence_label=nsp)
    assert out.prediction_logits.shape == (2, 0, V) and out.mlm_loss.item() == 0.0
    torch.testing.assert_close(out.loss, torch.nn.functional.cross_entropy(out.seq_relationship_logits, nsp))
    out.loss.backward()
    assert all(p.grad is not None for p in model.parameters())


def test_position_beyond_max_position_embeddings_is_a_clear_error():
    with pytest.raises(ValueError, match="sequence length 65 exceeds max_position_embeddings 64"):
        BertForPreTraining(tiny())(torch.randint(5, V, (1, 65)))


# ----------------------------------------------------------------------------------------------- dropout

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("p", [0.1, 0.01])
def test_cpu_dropout_keeps_1_minus_p_in_low_precision(dtype, p):
    """bf16 uniforms have 256 levels (k/256): `rand_like(x) >= p` on a bf16 activation (CPU autocast) kept 0.898 for
    p = 0.1 and 0.988 for p = 0.01 (10 and 40 standard deviations off at 4M draws): activations shrunk in training.
    The uniforms are now float32 whatever x's dtype."""
    torch.manual_seed(0)
    y = Dropout(p).train()(torch.ones(4_000_000, dtype=dtype))
    assert y.dtype == dtype
    sd = (p * (1 - p) / 4e6) ** 0.5
    assert abs((y != 0).double().mean().item() - (1 - p)) < 4 * sd


def test_cpu_dropout_float32_draw_is_unchanged():
    """In float32 the mask is the very draw `rand_like(x) >= p` (reproducible results of earlier runs are kept)."""
    x = torch.randn(1000, 37)
    torch.manual_seed(5)
    expected = x * (torch.rand_like(x) >= 0.1).to(x.dtype).mul_(1.0 / 0.9)
    torch.manual_seed(5)
    assert torch.equal(Dropout(0.1).train()(x), expected)


# ----------------------------------------------------------------------------------------------- HF parity

transformers = pytest.importorskip("transformers")

# the options, alone and combined; each against HF's eager BERT
COMBOS = {
    "plain": dict(unpad=False, per_sequence_attention=False, prune_last_layer=False),
    "unpad": dict(unpad=True, per_sequence_attention=False, prune_last_layer=False),
    "unpad+per_sequence+prune": dict(unpad=True, per_sequence_attention=True, prune_last_layer=True),
    "jagged+prune+ckpt": dict(unpad=True, jagged_attention=True, prune_last_layer=True, gradient_checkpointing=True),
    "padded+prune+ckpt": dict(unpad=False, prune_last_layer=True, gradient_checkpointing=True),
}
HEADS = {"pretraining": (BertForPreTraining, "BertForPreTraining"),
         "classification": (BertForSequenceClassification, "BertForSequenceClassification"),
         "qa": (BertForQuestionAnswering, "BertForQuestionAnswering")}


@pytest.fixture(scope="module")
def hf_folders(tmp_path_factory) -> dict[str, tuple[Path, torch.nn.Module]]:
    """Random HF models (every parameter random, so no mismatch hides behind a 0 or 1) saved as HF folders."""
    cfg = transformers.BertConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=48, max_position_embeddings=512, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0, attn_implementation="eager")
    out = {}
    for task, (_, hf_name) in HEADS.items():
        torch.manual_seed(0)
        model = getattr(transformers, hf_name)(cfg)
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.2 + (1.0 if p.ndim == 1 and p.mean() == 1 else 0.0))
        folder = tmp_path_factory.mktemp(task)
        model.save_pretrained(folder)
        (folder / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] +
                                                    [f"t{i}" for i in range(V - 5)]) + "\n")
        out[task] = (folder, model)
    return out


def edge_batch(B: int, T: int, padding: str) -> dict[str, torch.Tensor]:
    """`none`: every row full; `heavy`: row 0 full (B > 1), the others a quarter or less; `absent`: no
    attention_mask and no token_type_ids."""
    g = torch.Generator().manual_seed(T * 10 + B)
    ids = torch.randint(5, V, (B, T), generator=g)
    lengths = [T] * B if padding != "heavy" else [T if i == 0 and B > 1 else max(1, T // (4 + i)) for i in range(B)]
    mask = (torch.arange(T)[None] < torch.tensor(lengths)[:, None]).long()
    ids = ids * mask
    ids[:, 0] = 2
    types = ((torch.arange(T)[None] >= torch.tensor(lengths)[:, None] // 2) & mask.bool()).long()
    if padding == "absent":
        return dict(input_ids=ids)
    return dict(input_ids=ids, token_type_ids=types, attention_mask=mask)


def targets(task: str, x: dict[str, torch.Tensor]) -> tuple[dict, dict]:
    """(our keyword targets, HF's): labels at real tokens only (the outputs at padding are the options' business)."""
    ids = x["input_ids"]
    B, T = ids.shape
    lengths = x["attention_mask"].sum(1) if "attention_mask" in x else torch.full((B,), T)
    if task == "pretraining":
        P = 2
        pos = torch.stack([torch.arange(P) * int(n - 1) // max(P - 1, 1) for n in lengths])  # first and last real
        lab = torch.randint(5, V, (B, P), generator=torch.Generator().manual_seed(2))
        lab[:, 1] = torch.where(pos[:, 1] == pos[:, 0], -100, lab[:, 1])   # one-token rows: one target
        labels = torch.full((B, T), -100)
        for b, p in (lab != -100).nonzero().tolist():
            labels[b, pos[b, p]] = lab[b, p]
        nsp = torch.arange(B) % 2
        return (dict(masked_positions=pos, labels=lab, next_sentence_label=nsp),
                dict(labels=labels, next_sentence_label=nsp))
    if task == "classification":
        y = torch.arange(B) % 2
        return dict(labels=y), dict(labels=y)
    start, end = lengths - 1, torch.zeros(B, dtype=torch.long)
    return (dict(start_positions=start, end_positions=end),) * 2


def outputs(task: str, out, kw: dict, mask: torch.Tensor | None, hf: bool) -> dict[str, torch.Tensor]:
    """The compared outputs: the loss, the MLM logits at the masked positions, the NSP/class logits, the QA logits at
    real tokens."""
    if task == "pretraining":
        logits = out.prediction_logits
        if hf:
            pos = kw["_pos"]
            logits = logits.gather(1, pos[..., None].expand(-1, -1, V))
        return dict(loss=out.loss, mlm=logits, nsp=out.seq_relationship_logits)
    if task == "classification":
        return dict(loss=out.loss, logits=out.logits)
    real = mask.bool() if mask is not None else torch.ones_like(out.start_logits, dtype=torch.bool)
    return dict(loss=out.loss, start=out.start_logits[real], end=out.end_logits[real])


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    assert a.shape == b.shape, (a.shape, b.shape)
    scale = b.abs().max().item()
    return (a - b).abs().max().item() / (scale if scale > 0 else 1.0)


def check_parity(hf_folders, task: str, T: int, B: int, padding: str, train: bool) -> None:
    folder, hf = hf_folders[task]
    x = edge_batch(B, T, padding)
    ours_kw, hf_kw = targets(task, x)
    hf.train(train).zero_grad(set_to_none=True)
    ref = outputs(task, hf(**x, **hf_kw), {"_pos": ours_kw.get("masked_positions")}, x.get("attention_mask"), True)
    ref["loss"].backward()
    hf_grads = {k: p.grad for k, p in hf.named_parameters()}
    scale = max(g.abs().max().item() for g in hf_grads.values())
    for name, options in COMBOS.items():
        if task == "qa" and not train and options["unpad"]:
            continue  # documented: unpadded QA inference gives padding a logit of -10000 (its loss sees them)
        what = f"{task} T={T} B={B} {padding} {'train' if train else 'eval'} {name}"
        model = apply_model_options(HEADS[task][0].from_pretrained(folder), ModelOptionsConfig(**options)).train(train)
        got = outputs(task, model(**x, **ours_kw), ours_kw, x.get("attention_mask"), False)
        for k in ref:
            assert rel_err(got[k], ref[k]) <= 2e-5, f"{what}: {k}"
        got["loss"].backward()
        ours = to_hf_state_dict({k: p.grad for k, p in model.named_parameters()}, model.config)
        for k, g in hf_grads.items():
            # exactly 0 in exact arithmetic (rounding noise on both sides): the key bias; for QA, whatever shifts
            # every start/end logit equally, and everything at T = 1 (a softmax over one position)
            if k.endswith("key.bias") or (task == "qa" and (T == 1 or k.endswith(("qa_outputs.bias",
                                                                                   "1.output.LayerNorm.bias")))):
                continue
            err = (ours[k].double() - g.double()).abs().max().item() / scale
            assert err <= 2e-5, f"{what}: grad {k} {err:.3g}"


@pytest.mark.parametrize("task", list(HEADS))
@pytest.mark.parametrize("T, B, padding", [(1, 1, "none"), (2, 3, "heavy"), (129, 3, "heavy"), (128, 1, "none"),
                                           (127, 2, "absent"), (512, 3, "heavy"), (512, 2, "none")])
def test_every_option_combination_equals_hf_at_edge_lengths(hf_folders, task, T, B, padding):
    """Loss, logits and every parameter's gradient of one training step (dropout 0, fp32) and of eval mode, for
    each option combination, equal HF transformers' at lengths 1, 2, 127, 128, 129, 512: batch 1 and > 1, no
    padding, heavy padding, and attention_mask / token_type_ids absent."""
    for train in (True, False):
        check_parity(hf_folders, task, T, B, padding, train)


# ----------------------------------------------------------------------------------------------- Python API

def test_readme_python_snippet_runs_on_the_real_minilm(minilm_path, tmp_path):
    """The README's Python block as written (its two folder names replaced) on all-MiniLM-L6-v2: the outputs it
    names exist, and the folder it saves loads in transformers with the same predictions."""
    import bertrain
    text = (REPO / "README.md").read_text()
    block = re.search(r"## Python API\s+```python\n(.*?)```", text, re.S).group(1)
    names = re.search(r"from bertrain import (.*)", block).group(1).split(", ")
    assert all(n in bertrain.__all__ and n in dir(bertrain) for n in names)
    code = block.replace('"hf/bert-base"', repr(str(minilm_path))).replace('"hf/out"', repr(str(tmp_path / "out")))
    tok = transformers.BertTokenizerFast.from_pretrained(minilm_path)
    enc = tok(["the cat sat on the mat", "hello"], ["a dog ran", "the world is big"], padding=True,
              return_tensors="pt")
    pos = torch.tensor([[2, 3], [1, 2]])
    ns = dict(input_ids=enc["input_ids"], tt=enc["token_type_ids"], am=enc["attention_mask"], pos=pos,
              lab=enc["input_ids"].gather(1, pos), nsp=torch.tensor([0, 1]))
    exec(compile(code, "README.md", "exec"), ns)
    out, model = ns["out"], ns["model"]
    assert out.prediction_logits.shape == (2, 2, 30522) and out.seq_relationship_logits.shape == (2, 2)
    assert torch.isfinite(out.loss)
    hf = transformers.BertForPreTraining.from_pretrained(tmp_path / "out").eval()
    model.eval()
    ours = model(ns["input_ids"], ns["tt"], ns["am"], masked_positions=pos)
    theirs = hf(input_ids=ns["input_ids"], token_type_ids=ns["tt"], attention_mask=ns["am"])
    torch.testing.assert_close(ours.prediction_logits, theirs.prediction_logits.gather(
        1, pos[..., None].expand(-1, -1, 30522)), rtol=1e-5, atol=1e-5)
    again = BertForPreTraining.from_pretrained(tmp_path / "out")
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))
