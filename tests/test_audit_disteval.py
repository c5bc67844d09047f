"""Evaluation and prediction on N processes give what 1 process gives: the same batches, the same bits, every
example once (tasks/evaluate.py), for the dev evaluation while training and the final dev and test predictions."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from distributed import launch_cli, spawn
from helpers import save_tiny_model

from bertrain.tasks.evaluate import eval_batches


@pytest.mark.parametrize("n", [0, 1, 2, 7, 11])
@pytest.mark.parametrize("batch_size", [1, 3, 4])
def test_eval_batches_are_those_of_one_process_at_every_world_size(n: int, batch_size: int) -> None:
    alone, _ = eval_batches(n, batch_size, 0, 1)
    assert [b.tolist() for b in alone] == [list(range(s, min(n, s + batch_size))) for s in range(0, n, batch_size)]
    for world in (2, 3, 4):
        split = [eval_batches(n, batch_size, r, world) for r in range(world)]
        assert len({len(b) + fillers for b, fillers in split}) == 1  # as many forward passes on every rank
        dealt = {r + world * j: b.tolist() for r, (mine, _) in enumerate(split) for j, b in enumerate(mine)}
        assert [dealt[k] for k in sorted(dealt)] == [b.tolist() for b in alone]  # the same batches, none twice


class _Recording(torch.nn.Module):
    """A tiny QA BERT whose outputs also say the shape of the batch each example ran in, and count the passes."""

    def __init__(self) -> None:
        super().__init__()
        from bertrain.model.bert import BertConfig, BertForQuestionAnswering

        torch.manual_seed(0)
        self.bert = BertForQuestionAnswering(BertConfig.from_preset("tiny", vocab_size=100))
        self.passes = 0

    def forward(self, input_ids, token_type_ids=None, attention_mask=None):
        self.passes += 1
        out = self.bert(input_ids=input_ids, token_type_ids=token_type_ids, attention_mask=attention_mask)
        out.batch_shape = torch.tensor(input_ids.shape).repeat(len(input_ids), 1)
        return out


def _features(n: int, width: int = 24) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(n)
    lengths = rng.integers(3, width + 1, size=n)  # ragged: trimming makes each batch as wide as its longest row
    ids = rng.integers(5, 100, size=(n, width))
    mask = (np.arange(width)[None, :] < lengths[:, None]).astype(np.int64)
    return {"input_ids": ids * mask, "token_type_ids": np.zeros_like(ids), "attention_mask": mask}


def _forward_worker(rank: int, world: int, out_dir: str) -> None:
    from bertrain.tasks.evaluate import distributed_forward
    from bertrain.train.distributed import cleanup, init_distributed

    dist = init_distributed()
    try:
        for n in (11, 1):
            model = _Recording().eval()
            start, end, shape = distributed_forward(model, _features(n), lambda o: (o.start_logits, o.end_logits,
                                                                                    o.batch_shape), dist, batch_size=3)
            np.savez(Path(out_dir) / f"n{n}-w{world}-r{rank}.npz", start=start, end=end, shape=shape,
                     passes=model.passes)
    finally:
        cleanup()


def test_distributed_forward_on_two_and_three_processes_gives_the_bits_of_one(tmp_path: Path) -> None:
    """11 ragged QA features in batches of 3 (4 batches: 2 ranks hold 2 each, 3 ranks 2-1-1) and 1 feature (one
    batch: the other ranks have none and run a filler): each example runs in the batch it runs in on one process,
    so its logits are the same bits; every rank runs as many forward passes (an FSDP model gathers in each)."""
    for world in (1, 2, 3):
        spawn(_forward_worker, world, str(tmp_path))
    for n in (11, 1):
        ref = np.load(tmp_path / f"n{n}-w1-r0.npz")
        assert ref["start"].shape == (n, 24) and int(ref["passes"]) == -(-n // 3)
        for world in (2, 3):
            runs = [np.load(tmp_path / f"n{n}-w{world}-r{r}.npz") for r in range(world)]
            assert len({int(r["passes"]) for r in runs}) == 1, (n, world)
            for r in runs:  # every rank gets every output, in example order
                assert r["shape"].tolist() == ref["shape"].tolist(), (n, world)  # each example's batch (B, T)
                for k in ("start", "end"):
                    assert np.array_equal(r[k], ref[k]), (n, world, k)


# ---------------------------------------------------------------------------------------- end to end, the CLI

def _squad_long(path: Path, n: int, reps: int) -> Path:
    """SQuAD v2.0 whose contexts are long enough for several windows each: answerable and unanswerable questions."""
    names = ["ann", "bob", "cat", "dan", "eve", "fay", "gus"]
    paras = []
    for i in range(n):
        filler = " ".join(f"the dog sat over the family {names[(i + k) % 7]} ." for k in range(reps + i % 3))
        ctx = f"{filler} {names[i % 7]} sat on the mat in the house with people . {filler}"
        start = ctx.index(f" {names[i % 7]} sat on the mat") + 1
        paras.append({"context": ctx, "qas": [
            {"id": f"p{i}-who", "question": "who sat on the mat ?", "is_impossible": False,
             "answers": [{"text": names[i % 7], "answer_start": start}]},
            {"id": f"p{i}-no", "question": "who sat with the cat ?", "is_impossible": True, "answers": []}]})
    path.write_text(json.dumps({"version": "v2.0", "data": [{"title": "t", "paragraphs": paras}]}))
    return path


def _stsb(folder: Path, n_dev: int) -> Path:
    rng = np.random.default_rng(1)
    words = "the cat dog sat on a mat in house with and over people family".split()
    sentence = lambda: " ".join(rng.choice(words, size=int(rng.integers(2, 12))))  # noqa: E731
    folder.mkdir(parents=True)
    head = "index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2"
    for name, n, labelled in (("train.tsv", 24, True), ("dev.tsv", n_dev, True), ("test.tsv", n_dev + 2, False)):
        rows = [f"{i}\tg\tf\t2012\t{i}\ts\ts\t{sentence()}\t{sentence()}" + (f"\t{rng.uniform(0, 5):.3f}" * labelled)
                for i in range(n)]
        (folder / name).write_text("\n".join([head + "\tscore" * labelled, *rows]) + "\n")
    return folder


def _ok(results) -> None:
    for r in results:
        assert r.returncode == 0, r.stdout[-3000:]


@pytest.mark.slow
def test_squad_v2_and_stsb_files_on_two_and_three_processes_are_those_of_one(tmp_path: Path) -> None:
    """Eval-only SQuAD v2.0 (5 long contexts: 86 windows, an example's windows split over ranks) and an STS-B
    fine-tuning with dev evaluations while training (11 dev examples, eval batch 3): predictions.json,
    nbest_predictions.json, null_odds.json, dev_predictions.tsv (scores to float32 precision), STS-B.tsv and the
    numbers are the same on 2 and 3 processes as on 1 (before: nbest probabilities, null odds, STS-B scores and
    Pearson differed in their last digits)."""
    tiny = save_tiny_model(tmp_path / "tiny")
    squad = tmp_path / "squad"
    squad.mkdir()
    _squad_long(squad / "train.json", 6, 2)
    _squad_long(squad / "dev.json", 5, 4)
    common = ["--version-2-with-negative", "--data.max_seq_length", "48", "--data.doc_stride", "16",
              "--data.max_query_length", "12", "--data.cache_dir", ""]
    _ok(launch_cli(1, ["finetune", "squad", *common, "--train", str(squad / "train.json"), "--do_eval", "false",
                       "--init", str(tiny), "--output", str(tmp_path / "qa"), "--train.steps", "3",
                       "--train.micro_batch_size", "4", "--optim.lr", "3e-3"]))
    for world in (1, 2, 3):
        _ok(launch_cli(world, ["finetune", "squad", *common, "--dev", str(squad / "dev.json"), "--do_train", "false",
                               "--init", str(tmp_path / "qa" / "final"), "--output", str(tmp_path / f"qa-w{world}"),
                               "--eval_batch_size", "5"]))
    one = json.loads((tmp_path / "qa-w1" / "eval_results.json").read_text())
    assert one["eval_features"] > 5 * one["eval_examples"] // 2  # several windows per question
    for world in (2, 3):
        for name in ("predictions.json", "nbest_predictions.json", "null_odds.json",
                     "predictions_best_f1_thresh.json"):
            assert (tmp_path / f"qa-w{world}" / name).read_bytes() == (tmp_path / "qa-w1" / name).read_bytes(), name
        got = json.loads((tmp_path / f"qa-w{world}" / "eval_results.json").read_text())
        assert {k: v for k, v in got.items() if k != "eval_seconds"} == \
            {k: v for k, v in one.items() if k != "eval_seconds"}

    data = _stsb(tmp_path / "STS-B", 11)
    # 2 ranks x 1 micro-step == 1 rank x 2 micro-steps bit for bit (README): the same weights at every evaluation
    for world in (1, 2):
        _ok(launch_cli(world, ["finetune", "glue", "--task", "stsb", "--data-dir", str(data), "--data.max_seq_length",
                               "32", "--init", str(tiny), "--output", str(tmp_path / f"sts-w{world}"),
                               "--train.steps", "4", "--train.micro_batch_size", "2", "--train.global_batch_size",
                               "4", "--eval_batch_size", "3", "--optim.lr", "3e-3", "--eval.interval", "2"]))
    a, b = tmp_path / "sts-w1", tmp_path / "sts-w2"
    assert (a / "final" / "model.safetensors").read_bytes() == (b / "final" / "model.safetensors").read_bytes()
    for name in ("dev_predictions.tsv", "STS-B.tsv"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    evals = [[json.loads(line)["metrics"] for line in (d / "metrics.jsonl").read_text().splitlines()
              if '"event": "eval"' in line] for d in (a, b)]
    assert len(evals[0]) == 2 and evals[0] == evals[1]
    dev = [json.loads((d / "eval_results.json").read_text())["dev"] for d in (a, b)]
    assert dev[0] == dev[1] and dev[0]["examples"] == 11
