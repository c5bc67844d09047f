"""Evaluation while training (train/evaluation.py): the selection rule and early stopping on hand-made histories;
held-out pretraining numbers the same bits on 1 and 2 ranks and across kill -9 + resume; fine-tuning that stops
where its history says and ends with the best model; a store without held-out set still trains."""
from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from distributed import cli_env, spawn
from helpers import TINY_VOCAB, finetune_argv, finetune_data, prepare_config, save_tiny_model

from bertrain.config import from_dict
from bertrain.data.prepare import prepare
from bertrain.train import checkpoint as ckpt
from bertrain.train.config import EvalConfig
from bertrain.train.evaluation import BEST, BEST_JSON, EvalHistory, maximises


# ----------------------------------------------------------------------------------------------- the rule

def _history(values: list[float], metric: str = "f1", **cfg) -> tuple[EvalHistory, int | None]:
    """Feed `values` (one evaluation every 10 steps) until the history says stop; (history, index it stopped at)."""
    h, c = EvalHistory(), EvalConfig(**cfg)
    for i, v in enumerate(values):
        h.update(10 * (i + 1), 0, {metric: v, "other": 0.0}, metric, c)
        if h.stop_reason:
            return h, i
    return h, None


def test_best_and_early_stopping_follow_the_history() -> None:
    h, stop = _history([0.50, 0.60, 0.605, 0.59, 0.70], patience=2, min_delta=0.01)
    # 0.605 is not an improvement by more than 0.01, nor is 0.59: two in a row -> stop at the fourth evaluation
    assert (h.best_step, h.best_value, stop) == (20, 0.60, 3) and "early stopping" in h.stop_reason
    h, stop = _history([0.50, 0.60, 0.605, 0.62, 0.61, 0.60], patience=2, min_delta=0.01)
    assert (h.best_step, stop) == (40, 5)  # 0.62 resets the count
    h, stop = _history([0.5, 0.4, 0.3], patience=0)
    assert (h.best_step, stop, h.since_best) == (10, None, 2)  # patience 0: never stops
    # losses are minimised
    assert not maximises("mlm_loss") and maximises("mlm_acc") and not maximises("mlm_perplexity")
    h, stop = _history([3.0, 2.5, 2.6, 2.55], metric="mlm_loss", patience=2)
    assert (h.best_step, h.best_value, stop) == (20, 2.5, 3)
    # a target stops the run when reached (MLPerf's "time to 72% masked-LM accuracy")
    h, stop = _history([0.5, 0.71, 0.72, 0.8], metric="mlm_acc", target=0.72)
    assert stop == 2 and "target" in h.stop_reason
    # a NaN is never the best
    h, _ = _history([float("nan"), 0.1])
    assert h.best_step == 20
    with pytest.raises(ValueError, match="eval.metric.*'nope'.*f1, other"):
        EvalHistory().update(1, 0, {"f1": 1.0, "other": 0.0}, "nope", EvalConfig())


def test_a_resumed_stop_is_decided_again_under_the_eval_settings_of_the_resume() -> None:
    h, stop = _history([0.5, 0.71, 0.72], metric="mlm_acc", target=0.7)
    assert stop == 1 and "eval.target = 0.7" in h.stop_reason
    h.recheck_stop("mlm_acc", EvalConfig(target=0.7))
    assert "eval.target = 0.7" in h.stop_reason  # the same settings: the same stop
    h.recheck_stop("mlm_acc", EvalConfig(target=0.9))
    assert h.stop_reason is None  # a higher target (--allow-config-change): the run goes on
    h, stop = _history([0.5, 0.4, 0.3], patience=2)
    assert stop == 2
    h.recheck_stop("f1", EvalConfig(patience=2, target=0.2))
    assert "eval.target = 0.2" in h.stop_reason
    h.recheck_stop("f1", EvalConfig(patience=3))
    assert h.stop_reason is None
    h.stop_reason = "stopped by the search after step 30 (f1 0.3)"
    h.recheck_stop("f1", EvalConfig())
    assert h.stop_reason.startswith("stopped by the search")  # a search's decision stands


def test_eval_settings_that_cannot_work_are_refused_naming_the_key() -> None:
    with pytest.raises(ValueError, match="eval.patience"):
        EvalConfig(patience=-1)
    with pytest.raises(ValueError, match="eval.max_samples"):
        EvalConfig(max_samples=0)
    with pytest.raises(ValueError, match="eval.patience and eval.target need evaluations"):
        EvalConfig(enabled=False, target=0.5)
    for never in (float("nan"), float("inf")):  # never reached: the run went on to its end without a word
        with pytest.raises(ValueError, match="config key 'eval.target' .* must be a finite number"):
            EvalConfig(target=never)


# ----------------------------------------------------------------------------------------------- pretraining

@pytest.fixture(scope="module")
def heldout_store(tmp_path_factory) -> Path:
    """python-docs prepared with 10% of its documents (at least 4) held out."""
    out = tmp_path_factory.mktemp("store") / "data"
    prepare(prepare_config(out, heldout_fraction=0.1, heldout_min_documents=4, masking="dynamic"))
    return out


def _pretrain_config(data: Path, out: Path, **over) -> dict:
    cfg = {"model": {"preset": "tiny", "dropout": 0.1},
           "data": {"prepared": str(data), "vocab_file": TINY_VOCAB},
           "sample": {"max_seq_length": 64, "max_predictions_per_seq": 10},
           "train": {"steps": 12, "global_batch_size": 16, "micro_batch_size": 8, "log_interval": 1},
           "optim": {"name": "lamb", "lr": 0.005}, "schedule": {"name": "poly", "warmup": 0.1},
           "checkpoint": {"save_interval": 4, "keep_last": 0},
           "eval": {"interval": 4, "max_samples": 100}, "seed": 7, "output_dir": str(out)}
    for k, v in over.items():
        cfg[k] = {**cfg[k], **v} if isinstance(v, dict) else v
    return cfg


def _evaluate_on_ranks(rank: int, world: int, data: str, out: str, result: str) -> None:
    from bertrain.tasks.pretraining import PretrainConfig, PretrainingTask, resolve_data
    from bertrain.train.distributed import distributed_context
    from bertrain.train.precision import Precision

    cfg = from_dict(PretrainConfig, _pretrain_config(Path(data), Path(out)))
    with distributed_context(cfg.distributed) as dist:
        task = PretrainingTask(cfg, resolve_data(cfg, dist))
        torch.manual_seed(0)
        model = task.build_model().eval()
        with torch.no_grad():
            metrics = task.evaluate(model, dist, Precision(cfg.precision, dist.device))
        if rank == 0:
            Path(result).write_text(json.dumps(metrics))


def test_heldout_numbers_are_the_same_bits_on_one_and_two_ranks(heldout_store: Path, tmp_path: Path) -> None:
    got = {}
    for world in (1, 2):
        result = tmp_path / f"w{world}.json"
        spawn(_evaluate_on_ranks, world, str(heldout_store), str(tmp_path / "out"), str(result))
        got[world] = json.loads(result.read_text())
    assert set(got[1]) == {"mlm_loss", "mlm_acc", "mlm_perplexity", "nsp_loss", "nsp_acc"}
    assert got[1]["mlm_perplexity"] == pytest.approx(math.exp(got[1]["mlm_loss"]), rel=1e-12)
    assert got[1] == got[2]  # exact: every micro-batch is the same on both, added in the same order
    assert 0 <= got[1]["mlm_acc"] < 0.05 and got[1]["mlm_loss"] > 5  # an untrained model is at chance


def test_a_store_without_heldout_set_trains_with_a_warning(tmp_path: Path, caplog) -> None:
    from bertrain.tasks.pretraining import PretrainConfig, run_pretraining
    store = tmp_path / "old"
    prepare(prepare_config(store, heldout_fraction=0.0, masking="dynamic"))
    stats = json.loads((store / "stats.json").read_text())
    del stats["heldout"]  # as a store prepared before held-out sets existed
    (store / "stats.json").write_text(json.dumps(stats))
    cfg = from_dict(PretrainConfig, _pretrain_config(store, tmp_path / "run", train={"steps": 2},
                                                     checkpoint={"save_interval": 0}))
    with caplog.at_level("WARNING"):
        result = run_pretraining(cfg)
    assert result.state.step == 2 and result.run.evaluation == {}
    assert "no held-out evaluation" in caplog.text and f"bertrain prepare --add-heldout {store}" in caplog.text
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert not [r for r in records if r.get("event") == "eval"]
    assert "will not stop this run" not in caplog.text
    cfg = from_dict(PretrainConfig, _pretrain_config(store, tmp_path / "run2", train={"steps": 2},
                                                     checkpoint={"save_interval": 0}, eval={"target": 0.5}))
    with caplog.at_level("WARNING"):
        run_pretraining(cfg)
    assert "(eval.target will not stop this run)" in caplog.text  # said, not silently dropped


def test_eval_disabled_evaluates_nothing_not_even_after_the_last_step(heldout_store: Path, tmp_path: Path,
                                                                       caplog) -> None:
    from bertrain.tasks.pretraining import PretrainConfig, run_pretraining
    cfg = from_dict(PretrainConfig, _pretrain_config(heldout_store, tmp_path / "run", train={"steps": 4},
                                                     eval={"enabled": False}, checkpoint={"save_interval": 0}))
    with caplog.at_level("INFO"):
        result = run_pretraining(cfg)
    assert result.state.step == 4 and result.run.evaluation == {} and not _evals(tmp_path / "run")
    assert "held-out evaluation" not in caplog.text  # the set is not even built


def _evals(out: Path) -> list[dict]:
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r.get("event") == "eval"]


def test_raw_input_prepared_on_the_fly_takes_the_heldout_keys(heldout_store: Path, tmp_path: Path) -> None:
    """`bertrain pretrain` on raw data.input: data.heldout_fraction / heldout_min_documents reach the on-the-fly
    prepare (python-docs' 79 documents get no held-out set under prepare's default: 1%, at least 10, at most 10%);
    on a prepared folder, whose set was chosen when it was prepared, the keys are refused before any work."""
    from bertrain.tasks.pretraining import PretrainConfig, run_pretraining

    def config(out: str, steps: int = 2, **data) -> PretrainConfig:
        cfg = _pretrain_config(heldout_store, tmp_path / out, train={"steps": steps}, checkpoint={"save_interval": 0})
        cfg["data"].update(data)
        return from_dict(PretrainConfig, cfg)

    raw = {"prepared": None, "input": ["builtin:python-docs"]}
    result = run_pretraining(config("run", **raw, heldout_fraction=0.05, heldout_min_documents=4))
    stats = json.loads((tmp_path / "run" / "data" / "stats.json").read_text())
    assert stats["heldout"]["dir"] == "heldout" and stats["heldout"]["num_documents"] >= 4
    assert (stats["heldout"]["fraction"], stats["heldout"]["min_documents"]) == (0.05, 4)
    evals = _evals(tmp_path / "run")
    assert [e["step"] for e in evals] == [2] and 0 <= evals[0]["metrics"]["mlm_acc"] <= 1 and result.run.evaluation

    run_pretraining(config("default", steps=1, **raw))
    assert json.loads((tmp_path / "default" / "data" / "stats.json").read_text())["heldout"]["dir"] is None
    assert not _evals(tmp_path / "default")

    for key, value in (("heldout_fraction", 0.05), ("heldout_min_documents", 4)):
        with pytest.raises(ValueError, match=f"'data.{key}' applies to raw data.input.*bertrain prepare"):
            config("x", **{key: value})
    with pytest.raises(ValueError, match=r"'data.heldout_fraction' must be in \[0, 0.5\]"):
        config("x", **raw, heldout_fraction=0.7)
    # a batch plan that cannot work is refused before the raw corpus becomes a vocabulary and a token store (it was
    # refused by the trainer, after them: hours on a Wikipedia dump)
    bad = config("bad-batch", **raw)
    bad.train.global_batch_size, bad.train.micro_batch_size = 15, 4
    with pytest.raises(ValueError, match=r"'train.global_batch_size' \(15\) must be divisible"):
        run_pretraining(bad)
    assert not (tmp_path / "bad-batch" / "vocab").exists() and not (tmp_path / "bad-batch" / "data").exists()


@pytest.mark.slow
def test_heldout_evaluation_survives_kill_and_resume_bit_for_bit(heldout_store: Path, tmp_path: Path) -> None:
    paths = {}
    for name in ("straight", "killed"):
        paths[name] = tmp_path / f"{name}.json"
        paths[name].write_text(json.dumps(_pretrain_config(heldout_store, tmp_path / name)))
    argv = [sys.executable, "-m", "bertrain", "pretrain", "--config"]
    straight = subprocess.Popen([*argv, str(paths["straight"])], env=cli_env(), stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)
    killed = subprocess.Popen([*argv, str(paths["killed"])], env=cli_env(), stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    deadline = time.time() + 400
    while not (tmp_path / "killed" / "step-8" / ckpt.COMPLETE).exists():
        assert killed.poll() is None and time.time() < deadline, "no step-8 checkpoint before the kill"
        time.sleep(0.01)
    killed.send_signal(signal.SIGKILL)
    killed.wait(timeout=60)
    _, err = straight.communicate(timeout=600)
    assert straight.returncode == 0, err[-3000:]
    r = subprocess.run([*argv, str(paths["killed"]), "--resume", "auto"], env=cli_env(), capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    a, b = _evals(tmp_path / "straight"), _evals(tmp_path / "killed")
    assert [e["step"] for e in a] == [4, 8, 12]
    strip = lambda e: {k: v for k, v in e.items() if k != "eval_s"}  # noqa: E731 (timing)
    assert [strip(e) for e in a] == [strip(e) for e in b]  # held-out numbers and decisions, bit for bit
    assert a[-1]["metrics"]["mlm_loss"] < a[0]["metrics"]["mlm_loss"]  # it learns on text it never saw
    # the checkpoint carries the history: step-12's equals the straight run's
    sa, sb = (ckpt.load_train_state(tmp_path / n / "step-12") for n in ("straight", "killed"))
    assert sa["eval"] == sb["eval"] and len(sa["eval"]["records"]) == 3


# ----------------------------------------------------------------------------------------------- fine-tuning

@pytest.mark.slow
@pytest.mark.parametrize("task, metric, known", [
    ("glue", "f1", "(accuracy)"),  # RTE reports accuracy only
    ("squad", "exact_match", "(HasAns_exact, HasAns_f1, HasAns_total, NoAns_exact, NoAns_f1, NoAns_total, "
                             "best_exact, best_exact_thresh, best_f1, best_f1_thresh, exact, f1, total)"),
])
def test_an_eval_metric_the_task_does_not_report_is_refused_before_any_step(tmp_path: Path, capsys, task, metric,
                                                                            known) -> None:
    from bertrain.cli import main
    model = save_tiny_model(tmp_path / "model")
    data = finetune_data(task, tmp_path / "data")
    out = tmp_path / "run"
    assert main(finetune_argv(task, data, model, out, 40, "--eval.metric", metric, "--eval.interval", "39")) == 2
    err = capsys.readouterr().err
    assert f"config key 'eval.metric': {metric!r} is not one of this task's metrics {known}" in err
    assert not (out / "metrics.jsonl").exists() and not list(out.glob("step-*"))


def test_pretraining_refuses_an_nsp_metric_without_nsp(heldout_store: Path, tmp_path: Path, capsys) -> None:
    from bertrain.cli import main
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps(_pretrain_config(heldout_store, tmp_path / "run", eval={"metric": "nsp_acc"},
                                               sample={"next_sentence": False})))
    assert main(["pretrain", "--config", str(cfg)]) == 2
    assert "'nsp_acc' is not one of this task's metrics (mlm_acc, mlm_loss, mlm_perplexity)" in capsys.readouterr().err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_finetune_stops_where_the_history_says_and_ends_with_the_best(tmp_path: Path) -> None:
    model = save_tiny_model(tmp_path / "model", dropout=0.1)
    data = finetune_data("glue", tmp_path / "data")
    out = tmp_path / "run"
    # min_delta 2: no evaluation after the first can improve accuracy by 2, so patience 2 stops at the third
    r = subprocess.run([sys.executable, "-m", "bertrain", *finetune_argv(
        "glue", data, model, out, 40, "--eval.interval", "3", "--eval.patience", "2", "--eval.min_delta", "2",
        "--data.predict_test", "false", "--train.log_interval", "4")], env=cli_env(), capture_output=True,
        text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    results = json.loads((out / "eval_results.json").read_text())
    sel = results["selection"]
    assert [h["step"] for h in sel["history"]] == [3, 6, 9] and sel["steps_run"] == 9
    assert sel["best_step"] == 3 and "early stopping" in sel["stop_reason"]
    assert sel["metric"] == "accuracy" and sel["best_value"] == sel["history"][0]["accuracy"]
    # the steps run, and a training record for the interval the stop ended (step 9; log_interval 4)
    assert (results["train_steps"], results["planned_steps"]) == (9, 40) and results["final_loss"] is not None
    train_records = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert [r["step"] for r in train_records] == [4, 8, 9]
    assert "final model: the best one, step 3 of 9" in r.stderr
    assert json.loads((out / BEST / BEST_JSON).read_text())["step"] == 3
    best, final = (load_file(str(out / d / "model.safetensors")) for d in (BEST, "final"))
    assert best.keys() == final.keys() and all(torch.equal(best[k], final[k]) for k in best)
    # best/ is a model folder predict and serve read as final/: the same task.json (labels, sequence length)
    assert json.loads((out / BEST / "task.json").read_text()) == json.loads((out / "final" / "task.json").read_text())
    # the final dev evaluation is the best model's: the number the selection saw
    assert results["dev"]["accuracy"] == sel["best_value"]
    assert not (out / "step-40").exists() and (out / "step-9" / ckpt.COMPLETE).exists()
    # run again with --resume auto: the stop is in the checkpoint, nothing more is trained
    r = subprocess.run([sys.executable, "-m", "bertrain", *finetune_argv(
        "glue", data, model, out, 40, "--eval.interval", "3", "--eval.patience", "2", "--eval.min_delta", "2",
        "--data.predict_test", "false", "--resume", "auto")], env=cli_env(), capture_output=True, text=True,
        timeout=600)
    assert r.returncode == 0 and "the run stopped at step 9" in r.stderr, r.stderr[-3000:]
    assert json.loads((out / "eval_results.json").read_text())["selection"] == sel
    # a changed patience, allowed: applied (it was reported as applied, and the run stopped again at step 9)
    r = subprocess.run([sys.executable, "-m", "bertrain", *finetune_argv(
        "glue", data, model, out, 40, "--eval.interval", "3", "--eval.patience", "4", "--eval.min_delta", "2",
        "--data.predict_test", "false", "--resume", "auto", "--allow-config-change")], env=cli_env(),
        capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "eval.patience 2 -> 4" in r.stderr, r.stderr[-3000:]
    sel = json.loads((out / "eval_results.json").read_text())["selection"]
    assert [h["step"] for h in sel["history"]] == [3, 6, 9, 10, 12] and sel["steps_run"] == 12  # 10: epoch end
    assert sel["best_step"] == 3 and "early stopping: 4 evaluations" in sel["stop_reason"]


def test_a_stopped_finetune_says_which_evaluations_ran() -> None:
    from bertrain.tasks.finetune import stopped_message

    out = Path("/runs/x")
    none = stopped_message(out, 5, {})
    assert none.startswith("stopped by a signal at step 5 after saving /runs/x/step-5 (no dev evaluation yet;")
    two = stopped_message(out, 25, {"metric": "accuracy", "best_step": 12, "best_value": 0.6875,
                                    "history": [{"step": 12}, {"step": 24}]})
    assert "(2 dev evaluations so far, best accuracy 0.6875 at step 12; the final dev evaluation" in two
    assert two.endswith("--resume auto")
