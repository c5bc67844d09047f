"""Write this folder: a tiny BERT of NVIDIA's DeepLearningExamples BERT for PyTorch, its weights under NVIDIA's
names, and what NVIDIA's own modeling.py computes with them.

Not a test, and not run by the tests: it made the files beside it, which tests/test_model_nvidia_checkpoint.py
reads. Re-run it only to remake them (torch and numpy on a CPU are enough; boto3, botocore, requests and tqdm for
NVIDIA's file_utils.py, which modeling.py imports):

    git clone https://github.com/NVIDIA/DeepLearningExamples /tmp/dle    # or a bare mirror of it
    python tests/assets/nvidia-pyt-tiny/make_fixture.py --dle /tmp/dle   # scratch files go to /tmp/nvbert

What NVIDIA's code is used: PyTorch/LanguageModeling/BERT/modeling.py (+ the file_utils.py it imports) at two
commits of NVIDIA/DeepLearningExamples, read with `git show COMMIT:PATH` and saved unchanged into the scratch
folder (`--work`), outside this repository; the patched copies beside them are what runs:

* "2020": 1d4211fe9d94550d7bc72bb9b0ac4f576533ca52 (a merge of 2020-11-03; its modeling.py is that of 482fe9ac,
  2020-09-15, the last before 2022). `hidden_act` "gelu" is `bias_gelu`, x * 0.5 * (1 + erf(x / 1.41421)): the
  exact (erf) GELU, up to the constant. run_pretraining.py at this commit saves {'model', 'optimizer',
  'master params', 'files', 'epoch', 'data_loader'}.
* "2022": 729963dd47e7c8bd462ad10bfac7a7b0b604e6dd (master, 2024-04-04; its modeling.py is that of a9e2c1d5,
  2022-03-02, "update LDDL + NVFuser + Distillation"). "gelu" is `F.gelu(x, approximate=True)`, which in the PyTorch
  of the NGC 21.11 container its Dockerfile names is the tanh approximation. run_pretraining.py saves {'model',
  'optimizer', 'grad_scaler', 'epoch'}.

At both commits run_pretraining.py, run_squad.py and run_glue.py pad the vocabulary before building the model
(`if config.vocab_size % 8 != 0: config.vocab_size += 8 - (config.vocab_size % 8)`), and the parameter names are the
same (`dense_act` for the LinearActivation of BertIntermediate, BertPooler and BertPredictionHeadTransform); both
are asserted below, on the files read.

What is patched, and why (nothing else; apex is not installed here, so modeling.py's own `except ImportError`
fallback, its plain-torch LayerNorm, runs, as it does on any machine without apex):

* 2022 only: `torch.nn.functional.gelu(x, approximate=True)` -> `approximate='tanh'`. PyTorch >= 1.12 takes a string
  (`True` raises TypeError); NVIDIA's answer to that error (DeepLearningExamples issues #1187, #1272) is this very
  change, `True` having meant the tanh approximation in the 21.11 container.
* No `torch.jit.script`: run_pretraining.py of 2020 scripts `bias_gelu`, and that of 2022 the whole model; the
  scripted code computes the same operations, and the eager module is what modeling.py defines.

What it writes:

* bert_config.json: NVIDIA's (= Google's) format, vocab_size 100: not a multiple of 8, so NVIDIA's scripts pad the
  model to 104 rows.
* vocab.txt: the 100 tokens (BERT's special tokens first).
* state_dict.npz: float32 arrays under NVIDIA's names, as `BertForPreTraining(config).state_dict()` has them with the
  padded config (word embeddings and `cls.predictions.bias` of 104 rows), less `cls.predictions.decoder.weight`,
  which is the word-embedding matrix itself (tied; the tests put it back, as state_dict() holds it), plus the heads
  `qa_outputs.*` of BertForQuestionAnswering and `classifier.*` (3 labels) of BertForSequenceClassification, on the
  same encoder. Every value is random and none is left at its initial value (every bias, LayerNorm weight and bias,
  and the padded rows too).
* expected.npz: the int64 inputs (two sequences of 12, the second padded after 8, two segments each, three masked
  positions each) and, per version (`v2020_*`, `v2022_*`), the eval-mode (dropout off) outputs of NVIDIA's models:
  sequence_output, pooled_output, mlm_logits at the masked positions over the real vocabulary (the first 100
  columns), nsp_logits, start_logits and end_logits of BertForQuestionAnswering, classifier_logits.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
BERT = "PyTorch/LanguageModeling/BERT"
VERSIONS = {"2020": "1d4211fe9d94550d7bc72bb9b0ac4f576533ca52", "2022": "729963dd47e7c8bd462ad10bfac7a7b0b604e6dd"}
PATCHES = {  # version -> [(old, new)], each applied exactly once
    "2020": [],
    "2022": [("torch.nn.functional.gelu(x, approximate=True)", "torch.nn.functional.gelu(x, approximate='tanh')")],
}
PADDING = "config.vocab_size += 8 - (config.vocab_size % 8)"
SAVED = {"2020": "'master params': list(amp.master_params(optimizer))",  # what run_pretraining.py's torch.save holds
         "2022": "'grad_scaler': grad_scaler.state_dict()"}
CONFIG = {  # Google's bert_config.json keys, as NVIDIA's bert_config.json has them
    "attention_probs_dropout_prob": 0.1,
    "hidden_act": "gelu",
    "hidden_dropout_prob": 0.1,
    "hidden_size": 24,
    "initializer_range": 0.02,
    "intermediate_size": 37,
    "max_position_embeddings": 64,
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "type_vocab_size": 2,
    "vocab_size": 100,
}
NUM_LABELS = 3
TIED = "cls.predictions.decoder.weight"
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
WORDS = ("the of and to in a is was he for it with as his on be at by i this had not are but from or have an they "
         "which one you were her all she there would their we him been has when who will more no if out so said "
         "what up its about into than them can only other new some could time these two may then do first any my "
         "now such like our over man me even most made after also did many before must through back years where "
         "people").split()


def dle_file(dle: Path, commit: str, name: str) -> str:
    """A file of NVIDIA/DeepLearningExamples at `commit`, from a clone or a bare mirror."""
    return subprocess.run(["git", "-C", str(dle), "show", f"{commit}:{BERT}/{name}"], check=True, capture_output=True,
                          text=True).stdout


def patched(source: str, version: str) -> str:
    for old, new in PATCHES[version]:
        assert source.count(old) == 1, f"modeling.py {version} changed: {old!r} occurs {source.count(old)} times"
        source = source.replace(old, new)
    return source


def nvidia_modeling(dle: Path, work: Path, version: str) -> types.ModuleType:
    """NVIDIA's modeling.py of `version`, saved as read into `work`/<version>/, imported from its patched copy."""
    commit = VERSIONS[version]
    folder = work / version
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("modeling.py", "file_utils.py"):
        (folder / name).write_text(dle_file(dle, commit, name), encoding="utf-8")
    for name in ("run_pretraining.py", "run_squad.py", "run_glue.py"):  # the rules the tests reproduce
        script = dle_file(dle, commit, name)
        assert PADDING in script, f"{name} at {commit} no longer pads the vocabulary to a multiple of 8"
    assert SAVED[version] in dle_file(dle, commit, "run_pretraining.py"), f"run_pretraining.py at {commit} changed"
    (folder / "modeling_patched.py").write_text(patched((folder / "modeling.py").read_text(), version))
    sys.path.insert(0, str(folder))
    try:
        for name in ("file_utils", "modeling_patched"):
            sys.modules.pop(name, None)
        import modeling_patched
    finally:
        sys.path.remove(str(folder))
    return modeling_patched


def inputs() -> dict[str, np.ndarray]:
    """Two sequences of 12 (the second padded after 8), two segments each, three masked positions each."""
    v = {t: i for i, t in enumerate(SPECIALS + WORDS)}
    cls, sep, mask, pad = v["[CLS]"], v["[SEP]"], v["[MASK]"], v["[PAD]"]
    first = [cls, v["the"], v["man"], mask, v["said"], sep, v["he"], v["would"], mask, v["back"], mask, sep]
    second = [cls, v["she"], mask, v["time"], sep, mask, v["people"], sep] + [pad] * 4
    return {
        "input_ids": np.array([first, second], np.int64),
        "input_mask": np.array([[1] * 12, [1] * 8 + [0] * 4], np.int64),
        "segment_ids": np.array([[0] * 6 + [1] * 6, [0] * 5 + [1] * 3 + [0] * 4], np.int64),
        "masked_lm_positions": np.array([[3, 8, 10], [2, 5, 1]], np.int64),
    }


def random_value(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Values far from the initialiser's (every bias and LayerNorm bias != 0, every LayerNorm weight != 1) and large
    enough that the activations reach where the erf and the tanh GELU differ."""
    if "LayerNorm" in name and name.endswith(".weight"):
        return 1.0 + 0.2 * rng.standard_normal(shape)
    if name.endswith("bias"):
        return 0.2 * rng.standard_normal(shape)
    if "embeddings" in name:
        return rng.standard_normal(shape)
    return 0.3 * rng.standard_normal(shape)


def models(modeling: types.ModuleType, config_file: Path) -> dict[str, torch.nn.Module]:
    """NVIDIA's three models as its scripts build them: the config read, then padded (run_pretraining.py,
    run_squad.py, run_glue.py), in eval mode (dropout off)."""
    config = modeling.BertConfig.from_json_file(str(config_file))
    if config.vocab_size % 8 != 0:  # NVIDIA's scripts, verbatim
        config.vocab_size += 8 - (config.vocab_size % 8)
    return {"pretraining": modeling.BertForPreTraining(config).eval(),
            "qa": modeling.BertForQuestionAnswering(config).eval(),
            "classifier": modeling.BertForSequenceClassification(config, NUM_LABELS).eval()}


@torch.no_grad()
def outputs(nets: dict[str, torch.nn.Module], x: dict[str, np.ndarray], vocab_size: int) -> dict[str, np.ndarray]:
    ids, segments, mask = (torch.from_numpy(x[k]) for k in ("input_ids", "segment_ids", "input_mask"))
    pretraining = nets["pretraining"]
    (sequence_output,), pooled_output = pretraining.bert(ids, segments, mask)
    try:  # 2022: forward(input_ids, token_type_ids, attention_mask, masked_lm_labels); 2020: no labels
        prediction_scores, nsp_logits = pretraining(ids, segments, mask, None)
    except TypeError:
        prediction_scores, nsp_logits = pretraining(ids, segments, mask)
    positions = torch.from_numpy(x["masked_lm_positions"])
    at_masks = prediction_scores.gather(1, positions[..., None].expand(-1, -1, prediction_scores.shape[-1]))
    start_logits, end_logits = nets["qa"](ids, segments, mask)
    out = {"sequence_output": sequence_output, "pooled_output": pooled_output,
           "mlm_logits": at_masks[..., :vocab_size], "nsp_logits": nsp_logits, "start_logits": start_logits,
           "end_logits": end_logits, "classifier_logits": nets["classifier"](ids, segments, mask)}
    return {k: v.float().numpy() for k, v in out.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dle", type=Path, required=True, help="a NVIDIA/DeepLearningExamples clone or bare mirror")
    parser.add_argument("--work", type=Path, default=Path("/tmp/nvbert"), help="scratch folder for NVIDIA's files")
    parser.add_argument("--out", type=Path, default=HERE, help="where to write (default: this folder)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    (args.out / "bert_config.json").write_text(json.dumps(CONFIG, indent=2, sort_keys=True) + "\n")
    vocab = SPECIALS + WORDS
    assert len(vocab) == CONFIG["vocab_size"], len(vocab)
    (args.out / "vocab.txt").write_text("\n".join(vocab) + "\n")

    torch.manual_seed(0)
    rng = np.random.default_rng(20240611)
    state: dict[str, np.ndarray] = {}
    x = inputs()
    expected: dict[str, np.ndarray] = dict(x)
    for version in VERSIONS:
        modeling = nvidia_modeling(args.dle, args.work, version)
        nets = models(modeling, args.out / "bert_config.json")
        names = {**nets["pretraining"].state_dict(), **nets["qa"].state_dict(), **nets["classifier"].state_dict()}
        if not state:  # the first version draws the weights; the other must have the very same names and shapes
            state = {k: random_value(k, tuple(t.shape), rng).astype(np.float32) for k, t in names.items() if k != TIED}
        assert {k: tuple(t.shape) for k, t in names.items() if k != TIED} == {k: v.shape for k, v in state.items()}
        assert state["bert.embeddings.word_embeddings.weight"].shape[0] == 104  # padded, as NVIDIA's scripts do
        assert "bert.pooler.dense_act.weight" in state
        for net in nets.values():
            result = net.load_state_dict({k: torch.from_numpy(v) for k, v in state.items() if k in net.state_dict()},
                                         strict=False)
            assert result.unexpected_keys == [] and set(result.missing_keys) <= {TIED}, result
            if TIED in net.state_dict():  # tied: loading the embeddings loaded the decoder
                assert net.state_dict()[TIED].data_ptr() == net.bert.embeddings.word_embeddings.weight.data_ptr()
        for k, v in outputs(nets, x, CONFIG["vocab_size"]).items():
            expected[f"v{version}_{k}"] = v
        print(f"NVIDIA modeling.py {version} ({VERSIONS[version][:8]}): outputs computed")
    differ = np.abs(expected["v2020_sequence_output"] - expected["v2022_sequence_output"]).max()
    print(f"max |erf GELU (2020) - tanh GELU (2022)| on sequence_output: {differ:.3g}")
    np.savez_compressed(args.out / "state_dict.npz", **state)
    np.savez_compressed(args.out / "expected.npz", **expected)
    total = sum(f.stat().st_size for f in args.out.iterdir() if f.is_file())
    print(f"torch {torch.__version__}: wrote {args.out} ({total:,} bytes)")


if __name__ == "__main__":
    main()
