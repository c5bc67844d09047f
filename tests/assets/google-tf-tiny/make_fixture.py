"""Write this folder: a tiny BERT checkpoint saved by TensorFlow from Google's own modeling.py, and its outputs.

Not a test, and not run by the tests (they need no TensorFlow): it made the files beside it, which
tests/test_model_tf_checkpoint.py reads. Re-run it only to remake them, in a separate environment (TensorFlow is
never installed into bertrain's):

    python3.11 -m venv /tmp/tfenv
    /tmp/tfenv/bin/pip install tensorflow-cpu==2.15.1 'numpy<2'      # what made the committed files (Python 3.11)
    git clone https://github.com/google-research/bert /tmp/google-bert # archived; HEAD eedf5716ce12...
    /tmp/tfenv/bin/python tests/assets/google-tf-tiny/make_fixture.py --bert /tmp/google-bert

(`--bert` may also be a bare git repository: the files are then read with `git show HEAD:<file>`.) TF 2.15 is the
last release with Keras 2 as its Keras, which tf.compat.v1.layers.dense (modeling.py's dense layers) needs; its
wheels need numpy < 2. The run is seeded: it rewrites the committed files byte for byte (google-research/bert at
eedf5716ce1268e56f0a50264a88cafad334ac61).

What it writes (Google's release layout, as in uncased_L-12_H-768_A-12.zip, without bert_model.ckpt.meta):

* bert_config.json: Google's format, hidden_act "gelu" (which Google's code computes with the tanh approximation).
* vocab.txt: 100 tokens, BERT's special tokens first.
* bert_model.ckpt.index, bert_model.ckpt.data-00000-of-00001: `tf.compat.v1.train.Saver` of every variable of the
  graph: BertModel, the MLM and NSP heads of run_pretraining.py, the SQuAD head of run_squad.py and the
  classifier of run_classifier.py (3 labels) on one shared encoder; `adam_m`/`adam_v` slots of a few variables and
  `global_step`, as Google's fine-tuning outputs hold, made by one real step of optimization.py's
  AdamWeightDecayOptimizer; and one string variable (`fixture_note`), for the reader's "skip strings" path.
* expected.npz (float32, plus the int32 inputs): the graph's outputs on fixed inputs with dropout off
  (is_training=False): sequence_output, pooled_output, MLM log-probabilities at the masked positions, NSP logits
  and log-probabilities, SQuAD start/end logits, classifier logits.

Every variable gets random values after initialisation (LayerNorm gamma/beta and every bias too, none left at 0 or
1), large enough that the activations reach where the exact and the tanh GELU differ: a wrong key, a missing
transpose or the wrong activation each changes the outputs far beyond the tests' tolerance.

What is patched in Google's code, and why (the rest runs as published, in graph mode):

* `import tensorflow as tf` -> `import tensorflow.compat.v1 as tf`, with `tf.disable_v2_behavior()`: the code is
  TF 1 (variable scopes, tf.layers.dense, get_variable); TF 2 keeps all of it under tf.compat.v1.
* `tf.contrib.layers.layer_norm` -> `_contrib_layer_norm` below: tf.contrib is gone from TF 2. The replacement is
  contrib's computation with modeling.py's arguments (normalise over the last axis, `tf.nn.moments` then
  `tf.nn.batch_normalization` with variance_epsilon 1e-12, variables `LayerNorm/beta` then `LayerNorm/gamma`).
* The head functions (run_pretraining.get_masked_lm_output / get_next_sentence_output / gather_indexes,
  run_squad.create_model, run_classifier.create_model) and optimization.AdamWeightDecayOptimizer are taken from
  their files by name and run with the patched modeling module; the two create_model functions each build their
  own BertModel, so here `modeling.BertModel` hands them the one already built (all heads on one encoder).
"""
from __future__ import annotations

import argparse
import ast
import json
import subprocess
import sys
import types
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
CONFIG = {  # Google's bert_config.json keys, as in its releases
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
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
WORDS = ("the of and to in a is was he for it with as his on be at by i this had not are but from or have an they "
         "which one you were her all she there would their we him been has when who will more no if out so said "
         "what up its about into than them can only other new some could time these two may then do first any my "
         "now such like our over man me even most made after also did many before must through back years where "
         "people").split()

LAYER_NORM = '''
def _contrib_layer_norm(inputs, begin_norm_axis=-1, begin_params_axis=-1, scope=None):
  """tf.contrib.layers.layer_norm as modeling.py calls it (center, scale, last axis), for TF 2's compat.v1."""
  assert begin_norm_axis == -1 and begin_params_axis == -1
  with tf.variable_scope(scope, "LayerNorm", [inputs]):
    params_shape = inputs.shape[-1:]
    beta = tf.get_variable("beta", shape=params_shape, dtype=inputs.dtype, initializer=tf.zeros_initializer())
    gamma = tf.get_variable("gamma", shape=params_shape, dtype=inputs.dtype, initializer=tf.ones_initializer())
    mean, variance = tf.nn.moments(inputs, [inputs.shape.ndims - 1], keep_dims=True)
    return tf.nn.batch_normalization(inputs, mean, variance, offset=beta, scale=gamma, variance_epsilon=1e-12)
'''


def google_file(bert: Path, name: str) -> str:
    """A file of google-research/bert: from a checkout, else from a (bare) git repository's HEAD."""
    if (bert / name).is_file():
        return (bert / name).read_text(encoding="utf-8")
    return subprocess.run(["git", "-C", str(bert), "show", f"HEAD:{name}"], check=True, capture_output=True,
                          text=True).stdout


def patched_modeling(source: str) -> str:
    """modeling.py for TF 2's compat.v1 (see the module docstring); each patch must apply exactly once."""
    for old, new in [("import tensorflow as tf\n", "import tensorflow.compat.v1 as tf\n"),
                     ("tf.contrib.layers.layer_norm(", "_contrib_layer_norm(")]:
        assert source.count(old) == 1, f"modeling.py changed: {old!r} occurs {source.count(old)} times"
        source = source.replace(old, new)
    return source + "\n" + LAYER_NORM


def definition(source: str, name: str) -> str:
    """The source of the top-level function or class `name` in `source`."""
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name == name:
            return ast.get_source_segment(source, node)
    raise LookupError(f"{name} not found")


def inputs() -> dict[str, np.ndarray]:
    """Two sequences of 12 (the second padded after 8), two segments each, three masked positions each."""
    v = {t: i for i, t in enumerate(SPECIALS + WORDS)}
    cls, sep, mask, pad = v["[CLS]"], v["[SEP]"], v["[MASK]"], v["[PAD]"]
    first = [cls, v["the"], v["man"], mask, v["said"], sep, v["he"], v["would"], mask, v["back"], mask, sep]
    second = [cls, v["she"], mask, v["time"], sep, mask, v["people"], sep] + [pad] * 4
    return {
        "input_ids": np.array([first, second], np.int32),
        "input_mask": np.array([[1] * 12, [1] * 8 + [0] * 4], np.int32),
        "segment_ids": np.array([[0] * 6 + [1] * 6, [0] * 5 + [1] * 3 + [0] * 4], np.int32),
        "masked_lm_positions": np.array([[3, 8, 10], [2, 5, 1]], np.int32),
        "masked_lm_ids": np.array([[v["is"], v["up"], v["for"]],
                                   [v["was"], v["the"], v["she"]]], np.int32),
        "next_sentence_labels": np.array([0, 1], np.int32),
        "label_ids": np.array([2, 0], np.int32),
    }


def random_value(name: str, shape: list[int], rng: np.random.Generator) -> np.ndarray:
    """Values far from the initialiser's (every bias, beta != 0, every gamma != 1) and large enough to exercise
    the nonlinearities: kernels std 0.3 (pre-activations of std ~1.5 at hidden 24), embeddings std 1."""
    if name.endswith("/gamma"):
        return 1.0 + 0.2 * rng.standard_normal(shape)
    if name.endswith(("/beta", "bias")):
        return 0.2 * rng.standard_normal(shape)
    if name.endswith("_embeddings"):
        return rng.standard_normal(shape)
    return 0.3 * rng.standard_normal(shape)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bert", type=Path, required=True, help="a google-research/bert checkout or git repository")
    parser.add_argument("--out", type=Path, default=HERE, help="where to write (default: this folder)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    import tensorflow.compat.v1 as tf
    tf.disable_v2_behavior()

    modeling = types.ModuleType("modeling")
    modeling.__file__ = "modeling.py"
    sys.modules["modeling"] = modeling
    exec(compile(patched_modeling(google_file(args.bert, "modeling.py")), "modeling.py", "exec"), modeling.__dict__)

    (args.out / "bert_config.json").write_text(json.dumps(CONFIG, indent=2, sort_keys=True) + "\n")
    vocab = SPECIALS + WORDS
    assert len(vocab) == CONFIG["vocab_size"], len(vocab)
    (args.out / "vocab.txt").write_text("\n".join(vocab) + "\n")
    config = modeling.BertConfig.from_json_file(str(args.out / "bert_config.json"))
    x = inputs()

    tf.set_random_seed(0)
    const = {k: tf.constant(a) for k, a in x.items()}
    model = modeling.BertModel(config=config, is_training=False, input_ids=const["input_ids"],
                               input_mask=const["input_mask"], token_type_ids=const["segment_ids"],
                               use_one_hot_embeddings=False)
    # The heads' code, run on this encoder (see the module docstring).
    shared = types.SimpleNamespace(**vars(modeling))
    shared.BertModel = lambda **kw: model
    pretraining = {"tf": tf, "modeling": modeling}
    source = google_file(args.bert, "run_pretraining.py")
    for name in ("gather_indexes", "get_masked_lm_output", "get_next_sentence_output"):
        exec(definition(source, name), pretraining)
    squad = {"tf": tf, "modeling": shared}
    exec(definition(google_file(args.bert, "run_squad.py"), "create_model"), squad)
    classifier = {"tf": tf, "modeling": shared}
    exec(definition(google_file(args.bert, "run_classifier.py"), "create_model"), classifier)
    optimization = {"tf": tf, "re": __import__("re")}
    exec(definition(google_file(args.bert, "optimization.py"), "AdamWeightDecayOptimizer"), optimization)

    _, _, mlm_log_probs = pretraining["get_masked_lm_output"](
        config, model.get_sequence_output(), model.get_embedding_table(), const["masked_lm_positions"],
        const["masked_lm_ids"], tf.ones_like(const["masked_lm_ids"], tf.float32))
    _, _, nsp_log_probs = pretraining["get_next_sentence_output"](config, model.get_pooled_output(),
                                                                  const["next_sentence_labels"])
    graph = tf.get_default_graph()
    nsp_logits = graph.get_tensor_by_name("cls/seq_relationship/BiasAdd:0")  # the logits log_softmax reads
    start_logits, end_logits = squad["create_model"](config, False, const["input_ids"], const["input_mask"],
                                                     const["segment_ids"], False)
    classifier_loss, _, classifier_logits, _ = classifier["create_model"](
        config, False, const["input_ids"], const["input_mask"], const["segment_ids"], const["label_ids"],
        NUM_LABELS, False)

    # A fine-tuning output's bookkeeping: Google's optimizer slots (for a few variables only, to keep the fixture
    # small), the global step, and a string variable.
    global_step = tf.train.get_or_create_global_step()
    by_name = {v.op.name: v for v in tf.trainable_variables()}
    stepped = [by_name[n] for n in ("output_weights", "bert/pooler/dense/bias",
                                    "bert/encoder/layer_1/output/LayerNorm/gamma")]
    optimizer = optimization["AdamWeightDecayOptimizer"](learning_rate=1e-3, weight_decay_rate=0.01,
                                                         exclude_from_weight_decay=["LayerNorm", "bias"])
    train_op = optimizer.apply_gradients(zip(tf.gradients(classifier_loss, stepped), stepped))
    tf.Variable("written by make_fixture.py", name="fixture_note", trainable=False)

    rng = np.random.default_rng(20240611)
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        sess.run([v.assign(random_value(v.op.name, v.shape.as_list(), rng).astype(np.float32))
                  for v in tf.trainable_variables()])
        sess.run(train_op)
        sess.run(global_step.assign(1))
        tf.train.Saver().save(sess, str(args.out / "bert_model.ckpt"), write_meta_graph=False, write_state=False)
        outputs = sess.run({"sequence_output": model.get_sequence_output(), "pooled_output": model.get_pooled_output(),
                            "mlm_log_probs": mlm_log_probs, "nsp_logits": nsp_logits, "nsp_log_probs": nsp_log_probs,
                            "start_logits": start_logits, "end_logits": end_logits,
                            "classifier_logits": classifier_logits})
    np.savez(args.out / "expected.npz", **{k: v.astype(np.float32) for k, v in outputs.items()},
             **{k: x[k] for k in ("input_ids", "input_mask", "segment_ids", "masked_lm_positions")})
    for name, shape in tf.train.list_variables(str(args.out / "bert_model.ckpt")):
        print(name, shape)
    print(f"TensorFlow {tf.__version__}: wrote {args.out}")


if __name__ == "__main__":
    main()
