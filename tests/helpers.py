"""Test code shared by several test files (a test file never imports another; multi-process helpers are in
distributed.py, pytest fixtures in conftest.py and deploy_fixtures.py).

* model tests (test_model.py, test_fastpath.py): `grads`, `assert_same`, `count_checkpoints`
* file modes (test_utils_io.py, test_cli_reliability.py): `permissions`
* data tests (test_data_store.py, test_data_reliability.py): `TINY_VOCAB`, `prepare_config`, `digest`, `EDGE_CASES`
* fine-tuning tests (test_tasks_finetune*.py, test_train_*.py): `TINY`, `write_rte_like`, `squad_v2_fixture`,
  `save_tiny_model`, `finetune_argv`, `finetune_data`
"""
from __future__ import annotations

import hashlib
import json
import stat
from pathlib import Path

import numpy as np
import torch

from bertrain.data.prepare import PrepareConfig
from conftest import ASSETS

RTOL, ATOL = 1e-5, 1e-6


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A copy of every parameter's gradient, by name (parameters without one left out)."""
    return {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str, rtol: float = RTOL,
                atol: float = ATOL) -> None:
    """The same names, and close tensors under each."""
    assert a.keys() == b.keys(), what
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=rtol, atol=atol, msg=lambda m, k=k: f"{what} {k}: {m}")


def count_checkpoints(monkeypatch) -> list[int]:
    """Count the checkpointed layer calls, to prove checkpointing ran (an ignored option would also "pass")."""
    calls = [0]
    original = torch.utils.checkpoint.checkpoint

    def checkpoint(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)
    monkeypatch.setattr(torch.utils.checkpoint, "checkpoint", checkpoint)
    return calls


# ----------------------------------------------------------------------------------------------- files

def permissions(p: Path) -> int:
    """The permission bits of `p` (0o644, ...)."""
    return stat.S_IMODE(p.stat().st_mode)


# ----------------------------------------------------------------------------------------------- data

TINY_VOCAB = str(ASSETS / "vocab-tiny.txt")
"""The tiny test vocabulary (a string, as config values and command lines take it)."""


def prepare_config(out, **kw) -> PrepareConfig:
    """A small `bertrain prepare` of the built-in python-docs corpus into `out` (several shards); `kw` overrides."""
    base = dict(inputs=["builtin:python-docs"], output=str(out), vocab_file=TINY_VOCAB, dupe_factor=2, workers=1,
                shard_tokens=30_000, chunk_bytes=50_000)
    base.update(kw)
    return PrepareConfig(**base)


def digest(folder: Path) -> dict[str, str]:
    """Hashes of every data file (stats.json holds timings, so it is left out)."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name != "stats.json"}


EDGE_CASES = [
    "Hello, World! It's 3.5% of $100 -- (maybe) [x] {y} <z> a_b a`b a~b a^b a|b a\\b a@b a#b a&b a*b a+b a=b",
    "ctrl\x00chars\x01in\x07the\x0bmiddle\x0cof\x1cwords\x1d\x1e\x1fand\x7fdel",
    "tab\there\rcarriage  two  spaces\u00a0nbsp\u3000ideographic\u2009thin\u200bzero\u200dwidth\ufeffbom\ufffdrepl",
    "Café naïve résumé Ångström Straße ΟΔΟΣ Σίσυφος İstanbul ǅungla ﬁne Ⅻ ①",
    "CJK 中文字符和日本語のテキスト 한국어 mixed漢字words",
    "Accents combining: e\u0301 a\u0300\u0323 .\u0301 \u0301alone",
    "emoji 😀👍🏽 and math 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 and symbols ©®™ – — “quoted” ‘single’ «guillemets» …",
    "a" * 199 + " " + "b" * 200 + " " + "c" * 201 + " " + "é" * 201 + " " + "Z" * 250,
    "unknownish ⟁⟂⟃ ꙮ \U0001F9FF words",
    "", "   ", "\x00\x01", "!!!", "...and... ???",
]
"""Text that tokenizers get wrong most easily: punctuation, control and space characters, accents, CJK, emoji,
overlong words, empty and blank strings."""


# ----------------------------------------------------------------------------------------------- fine-tuning

WORDS = "the cat dog sat on a mat in house with and over people family".split()


def _sentence(rng, k=6) -> str:
    return " ".join(rng.choice(WORDS, size=k))


def write_rte_like(d: Path, n_train=24, n_dev=10, n_test=7, task_labels=("entailment", "not_entailment"),
                   mnli=False) -> Path:
    """A small GLUE-layout pair task: label = whether the two sentences share their first word (learnable)."""
    rng = np.random.default_rng(0)
    d.mkdir(parents=True, exist_ok=True)

    def rows(n, labelled):
        out = []
        for i in range(n):
            a, b = _sentence(rng), _sentence(rng)
            if i % 2 == 0:
                b = a.split()[0] + " " + b
            lab = task_labels[0] if i % 2 == 0 else task_labels[-1]
            out.append((str(i), a, b, lab))
        return out

    def write(name, n, labelled):
        if mnli:
            header = "index\tpromptID\tpairID\tgenre\ta\tb\tc\td\tsentence1\tsentence2" + ("\tgold_label" if labelled else "")
            lines = [header] + [f"{i}\tp\tp\tg\t(\t(\t(\t(\t{a}\t{b}" + (f"\t{lab}" if labelled else "")
                                for i, a, b, lab in rows(n, labelled)]
        else:
            header = "index\tsentence1\tsentence2" + ("\tlabel" if labelled else "")
            lines = [header] + [f"{i}\t{a}\t{b}" + (f"\t{lab}" if labelled else "") for i, a, b, lab in rows(n, labelled)]
        (d / name).write_text("\n".join(lines) + "\n", encoding="utf-8")

    if mnli:
        write("train.tsv", n_train, True)
        write("dev_matched.tsv", n_dev, True)
        write("dev_mismatched.tsv", n_dev + 1, True)
        write("test_matched.tsv", n_test, False)
        write("test_mismatched.tsv", n_test + 2, False)
    else:
        write("train.tsv", n_train, True)
        write("dev.tsv", n_dev, True)
        write("test.tsv", n_test, False)
    return d


TINY = ["--train.micro_batch_size", "4", "--eval_batch_size", "8", "--train.log_interval", "1",
        "--optim.lr", "1e-3"]
"""Fine-tuning settings for the tiny model: small batches, a log line every step, a large learning rate."""


def squad_v2_fixture(path: Path, n_paragraphs: int) -> Path:
    """Hand-made SQuAD v2.0: in each paragraph one answerable and two unanswerable questions."""
    paras = []
    for i in range(n_paragraphs):
        name = ["ann", "bob", "cat", "dan", "eve", "fay"][i % 6]
        ctx = f"{name} sat on the mat in the house with people . the dog sat over the family ."
        paras.append({"context": ctx, "qas": [
            {"id": f"p{i}-who", "question": "who sat on the mat ?", "is_impossible": False,
             "answers": [{"text": name, "answer_start": 0}]},
            {"id": f"p{i}-no1", "question": "who sat with the cat ?", "is_impossible": True, "answers": [],
             "plausible_answers": [{"text": "the dog", "answer_start": ctx.index("the dog")}]},
            {"id": f"p{i}-no2", "question": "and a family house ?", "is_impossible": True, "answers": []},
        ]})
    path.write_text(json.dumps({"version": "v2.0", "data": [{"title": "fixture", "paragraphs": paras}]}))
    return path


def save_tiny_model(d: Path, dropout: float | None = None) -> Path:
    """A randomly initialised (seed 0) tiny BERT (2 layers, hidden 64) with the test vocab, saved in HF format to
    `d`; `dropout` sets both dropout probabilities (None: the preset's)."""
    from bertrain.model.bert import BertConfig, BertModel
    from bertrain.model.hf import tokenizer_files_from_vocab

    torch.manual_seed(0)
    vocab = ASSETS / "vocab-tiny.txt"
    n = sum(1 for _ in open(vocab, encoding="utf-8"))
    dropouts = {} if dropout is None else {"hidden_dropout_prob": dropout, "attention_probs_dropout_prob": dropout}
    model = BertModel(BertConfig.from_preset("tiny", vocab_size=n, **dropouts))
    model.tokenizer_files = tokenizer_files_from_vocab(vocab, do_lower_case=True)
    model.save_pretrained(d)
    return d


def finetune_argv(task: str, data: Path, model: Path, out: Path, steps: int, *extra: str) -> list[str]:
    """`bertrain finetune` arguments for `task` ("glue": RTE-like, else SQuAD v2.0) on `finetune_data`'s folder."""
    if task == "glue":
        head = ["finetune", "glue", "--task", "rte", "--data-dir", str(data), "--data.max_seq_length", "32"]
    else:
        head = ["finetune", "squad", "--version-2-with-negative", "--train", str(data / "train.json"), "--dev",
                str(data / "dev.json"), "--data.max_seq_length", "64", "--data.max_query_length", "16",
                "--data.cache_dir", ""]
    return [*head, "--init", str(model), "--output", str(out), "--train.steps", str(steps), *TINY, *extra]


def finetune_data(task: str, root: Path) -> Path:
    """The data folder of a small `task` ("glue" or "squad") fine-tuning run, written under `root`."""
    if task == "glue":
        return write_rte_like(root / "RTE", n_train=40, n_dev=10, n_test=7)
    root.mkdir(parents=True, exist_ok=True)
    squad_v2_fixture(root / "train.json", 8)
    squad_v2_fixture(root / "dev.json", 3)
    return root


POSITIONAL_OFFSET = 1000
"""In a positional store, ids below this are specials; corpus token p has id POSITIONAL_OFFSET + p."""


def write_positional_store(out: Path, counts, lengths, subword_every: int = 0) -> Path:
    """A prepared folder whose every token id is its own corpus position (id = POSITIONAL_OFFSET + position), so each
    token of a sample row says where in the corpus it came from: documents of `counts[d]` sentences of `lengths[s]`
    tokens; with `subword_every` k, every k-th position from 1 is a "##" piece (whole-word masking)."""
    import json

    import numpy as np

    from bertrain.data.store import STORE_FORMAT, STORE_VERSION, ShardWriter, token_dtype

    n_tokens = int(np.sum(lengths))
    vocab_size = POSITIONAL_OFFSET + n_tokens
    (out / "shards").mkdir(parents=True)
    w = ShardWriter(out / "shards" / "shard-00000.bts", token_dtype(vocab_size))
    w.add(POSITIONAL_OFFSET + np.arange(n_tokens), lengths, counts)
    info = w.close()
    meta = {"format": STORE_FORMAT, "version": STORE_VERSION, "tokenizer_identity": "positional-test",
            "do_lower_case": True, "vocab_size": vocab_size, "dtype": token_dtype(vocab_size).name,
            "special_ids": {"[PAD]": 0, "[UNK]": 1, "[CLS]": 2, "[SEP]": 3, "[MASK]": 4},
            "subword_ids": [POSITIONAL_OFFSET + q for q in range(1, n_tokens, subword_every)] if subword_every else [],
            "shards": [info], "num_tokens": n_tokens, "num_sentences": len(lengths), "num_documents": len(counts)}
    (out / "store.json").write_text(json.dumps(meta), encoding="utf-8")
    (out / "stats.json").write_text("{}", encoding="utf-8")  # marks the folder complete
    return out


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    """`bertrain ARGV` in this process: (exit code, stdout, stderr)."""
    from bertrain.cli import main as cli_main

    capsys.readouterr()
    code = cli_main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def one_line_error(err: str) -> str:
    """The one line of a user error (asserting there is one, and no traceback)."""
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def save_tiny_head_model(cls, folder: Path, positions: int = 64, task: dict | None = None) -> Path:
    """A tiny random model of `cls` (seed 0) with `positions` positions and the test vocabulary, saved as an HF
    folder (its head saved too, so it loads as trained), with `task` as its task.json."""
    import json

    from bertrain.model.bert import BertConfig
    from bertrain.model.hf import tokenizer_files_from_vocab

    torch.manual_seed(0)
    vocab = ASSETS / "vocab-tiny.txt"
    model = cls(BertConfig.from_preset("tiny", vocab_size=sum(1 for _ in open(vocab, encoding="utf-8")),
                                       max_position_embeddings=positions))
    model.tokenizer_files = tokenizer_files_from_vocab(vocab, do_lower_case=True)
    model.save_pretrained(folder)
    if task is not None:
        (folder / "task.json").write_text(json.dumps(task))
    return folder
