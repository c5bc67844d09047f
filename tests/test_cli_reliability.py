"""The command line explains every failure: documented exit codes (0 finished, 1 bug, 2 user error, 3 stopped),
one line instead of a traceback (unless --debug), "did you mean" for misspelt keys and options, errors that blame
the right source (command line or file), --help defaults that are the defaults a run gets, the thread choice
applied and printed once (the choice itself: test_utils_threads.py), exports that honour the umask (atomic writes:
test_utils_io.py), export/convert that lock their output and move an old one aside instead of deleting it, and
predict / evaluate inputs that are numbered (read_items: test_deploy_predict.py) and summarised in one line."""
from __future__ import annotations

import argparse
import errno
import io
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from distributed import cli_env, default_sigint, wait_for_output
from helpers import permissions

from bertrain.cli import build_parser, main
from bertrain.config import iter_fields, load_config
from bertrain.utils import threads
from bertrain.utils.errors import RunStopped, UserError

ASSETS = Path(__file__).resolve().parent / "assets"
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _threads_untouched(monkeypatch):
    """main() chooses the thread count once per process; keep this test process's count as it is."""
    monkeypatch.setattr(threads, "_applied", (0, "left alone by the tests"))


def _fail_with(monkeypatch, exc: BaseException) -> None:
    """`bertrain info` raises `exc` (the real dispatcher and handlers, a controlled failure)."""
    from bertrain.commands import info

    def run(args):
        raise exc

    monkeypatch.setattr(info, "run", run)


# ----------------------------------------------------------------------------------------------- exit codes

@pytest.mark.parametrize("code,strerror,hint", [
    (errno.ENOSPC, "No space left on device", "the disk is full"),
    (errno.EACCES, "Permission denied", "no permission"),
    (errno.EROFS, "Read-only file system", "read-only"),
    (errno.ENOENT, "No such file or directory", "does not exist"),
    (errno.EDQUOT, "Disk quota exceeded", "quota"),
])
def test_user_os_errors_are_one_line_exit_2(monkeypatch, capsys, tmp_path, code, strerror, hint):
    _fail_with(monkeypatch, OSError(code, strerror, str(tmp_path / "out" / "model.safetensors")))
    assert main(["info"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("bertrain info: error: ") and strerror in err and hint in err
    assert str(tmp_path / "out" / "model.safetensors") in err


def test_user_error_is_one_line_exit_2(monkeypatch, capsys):
    _fail_with(monkeypatch, UserError("output folder x is in use by `bertrain pretrain` (pid 7 on h)"))
    assert main(["info"]) == 2
    assert capsys.readouterr().err == "bertrain info: error: output folder x is in use by `bertrain pretrain` (pid 7 on h)\n"


def test_stopped_run_exits_3_naming_the_checkpoint(monkeypatch, capsys, tmp_path):
    _fail_with(monkeypatch, RunStopped("stopped by a signal at step 7", checkpoint=tmp_path / "step-7"))
    assert main(["info"]) == 3
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "stopped by a signal at step 7" in err and str(tmp_path / "step-7") in err and "--resume auto" in err


def test_ctrl_c_exits_3_with_one_line(monkeypatch, capsys):
    _fail_with(monkeypatch, KeyboardInterrupt())
    assert main(["info"]) == 3
    assert capsys.readouterr().err == "bertrain info: interrupted\n"


def test_unexpected_error_exits_1_with_the_traceback(monkeypatch, capsys):
    _fail_with(monkeypatch, RuntimeError("index out of range in a kernel"))
    assert main(["info"]) == 1
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "RuntimeError: index out of range" in err
    assert "unexpected error" in err.splitlines()[-1]
    _fail_with(monkeypatch, OSError(errno.EIO, "Input/output error"))  # not one a user causes: a traceback too
    assert main(["info"]) == 1
    assert "Traceback" in capsys.readouterr().err


@pytest.mark.parametrize("exc,code", [(UserError("bad value"), 2), (OSError(errno.ENOSPC, "No space left"), 2),
                                      (RunStopped("stopped at step 3"), 3), (KeyboardInterrupt(), 3)])
def test_debug_adds_the_traceback(monkeypatch, capsys, exc, code):
    _fail_with(monkeypatch, exc)
    assert main(["--debug", "info"]) == code
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err
    assert err.splitlines()[-1].startswith("bertrain info: ")


def test_sigterm_outside_a_training_loop_stops_like_ctrl_c(monkeypatch, capsys):
    """`kill PID` between two pipeline stages (or in any command but serve): one line and exit 3, not a silent
    death by signal (143); the default handler is back afterwards."""
    from bertrain.commands import info

    def run(args):
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(1000):  # the handler runs between two bytecodes of this loop
            time.sleep(0.01)
        raise AssertionError("SIGTERM did not stop the command")

    monkeypatch.setattr(info, "run", run)
    assert main(["info"]) == 3
    assert capsys.readouterr().err.strip().endswith("bertrain info: stopped by SIGTERM")
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_ctrl_c_while_predict_reads_stdin(monkeypatch, capsys, classifier):
    """The real predict path: Ctrl-C while it waits for input is one line and exit 3, not a traceback."""
    class Interrupted(io.StringIO):
        def __iter__(self):
            raise KeyboardInterrupt

    monkeypatch.setattr(sys, "stdin", Interrupted())
    assert main(["predict", "--model", str(classifier), "--input", "-"]) == 3
    err = capsys.readouterr().err
    assert "bertrain predict: interrupted" in err and "Traceback" not in err


def test_closed_pipe_is_not_an_error(monkeypatch, capsys, classifier, tmp_path):
    """`bertrain predict ... | head -1`: the reader went away; no traceback."""
    class ClosedPipe(io.StringIO):
        def write(self, s):
            raise BrokenPipeError(errno.EPIPE, "Broken pipe")

    items = tmp_path / "in.jsonl"
    items.write_text('{"text": "the cat"}\n{"text": "the dog"}\n')
    monkeypatch.setattr(sys, "stdout", ClosedPipe())
    assert main(["predict", "--model", str(classifier), "--input", str(items)]) == 0
    assert "Traceback" not in capsys.readouterr().err


@pytest.mark.slow
def test_sigint_to_a_real_process(classifier):
    """Ctrl-C (SIGINT) to `python -m bertrain predict` waiting on stdin: exit 3, one line, no traceback.

    The child gets SIGINT's default action whatever the suite inherited (`default_sigint`), and the signal is sent
    once it has answered the inputs written so far, so it is then waiting for more (no fixed sleep)."""
    proc = subprocess.Popen([sys.executable, "-m", "bertrain", "predict", "--model", str(classifier), "--input", "-",
                             "--batch-size", "1"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=cli_env(), preexec_fn=default_sigint)
    try:
        # predict reads 8 batches before it predicts them: 8 items of batch size 1 make it answer, then wait on stdin
        proc.stdin.write('{"text": "the cat sat"}\n' * 8)
        proc.stdin.flush()
        assert '"label"' in wait_for_output(proc, timeout=300)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 3, err
    assert "Traceback" not in err and "bertrain predict: interrupted" in err


def test_exit_codes_are_documented():
    readme = (REPO / "README.md").read_text()
    section = readme.split("## Exit codes", 1)[1].split("\n## ", 1)[0]
    for code, word in ((0, "finished"), (1, "unexpected"), (2, "user error"), (3, "stopped")):
        assert re.search(rf"\| {code} \| [^|]*{word}", section), (code, word)
    assert "--debug" in section
    assert "3 stopped" in build_parser([]).format_help().replace("\n", " ").replace("  ", " ")


# ----------------------------------------------------------------------------------------------- configs

def test_misspelt_key_on_the_command_line_suggests_the_key(capsys):
    with pytest.raises(SystemExit) as e:
        main(["pretrain", "--train.stepz", "5"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err == ("bertrain pretrain: error: unknown config key 'train.stepz' — did you mean 'train.steps'? "
                   "(see bertrain pretrain --help)\n")
    with pytest.raises(SystemExit):  # nested sub-command: its own name, and a key from another section
        main(["finetune", "glue", "--task", "rte", "--lr", "3e-5"])
    assert "bertrain finetune glue: error: unknown config key 'lr' — did you mean 'optim.lr'?" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # an ordinary option: the close one
        main(["pretrain", "--confg", "x.yaml"])
    assert "unrecognized argument --confg — did you mean --config?" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # an unknown section: the sections and the top-level keys
        main(["pretrain", "--bogus.key", "1"])
    err = capsys.readouterr().err
    assert "unknown config key 'bogus.key'; known sections: checkpoint, data," in err
    assert "train; top-level keys: output_dir, seed" in err


def test_a_negative_value_in_exponent_notation_reaches_the_keys_own_check(capsys):
    assert main(["pretrain", "--optim.lr", "-1e-3", "--data.synthetic_samples", "8"]) == 2
    assert "config key 'optim.lr' must be > 0, got -0.001" in capsys.readouterr().err
    from bertrain.cli import join_negative_values
    assert join_negative_values(["--a.b", "-1e-3", "--c", "-.5", "-v", "--d=-1", "--e", "-x"]) == [
        "--a.b=-1e-3", "--c=-.5", "-v", "--d=-1", "--e", "-x"]


def test_misspelt_key_in_a_config_file_suggests_the_key(tmp_path, capsys):
    from bertrain.tasks.pretraining import PretrainConfig

    cfg = tmp_path / "qs.yaml"
    cfg.write_text("train:\n  stepz: 5\ndata:\n  synthetic_samples: 8\n")
    with pytest.raises(ValueError) as e:
        load_config(PretrainConfig, cfg)
    assert str(e.value) == f"unknown config key 'train.stepz' — did you mean 'train.steps'? (in {cfg})"
    assert main(["pretrain", "--config", str(cfg)]) == 2
    assert "did you mean 'train.steps'?" in capsys.readouterr().err


def test_errors_blame_the_command_line_or_the_file(tmp_path):
    from bertrain.tasks.pretraining import PretrainConfig

    qs = tmp_path / "qs.yaml"
    qs.write_text("train:\n  steps: 10\ndata:\n  synthetic_samples: 8\noptim:\n  max_trust_ratio: 2.0\n")
    with pytest.raises(ValueError) as e:  # the override is wrong, not the file
        load_config(PretrainConfig, qs, {"optim.lr": "-1"})
    assert str(e.value).endswith("(--optim.lr on the command line)") and "qs.yaml" not in str(e.value)
    with pytest.raises(ValueError) as e:  # a bad type on the command line
        load_config(PretrainConfig, qs, {"train.steps": "ten"})
    assert str(e.value) == "config key 'train.steps': expected int, got 'ten' (--train.steps on the command line)"
    with pytest.raises(ValueError) as e:  # two keys from two sources: each named with its own
        load_config(PretrainConfig, qs, {"optim.min_trust_ratio": "5"})
    assert "(--optim.min_trust_ratio on the command line; optim.max_trust_ratio from " + str(qs) + ")" in str(e.value)
    qs.write_text("train:\n  steps: ten\n")
    with pytest.raises(ValueError) as e:  # the file is wrong: the file is named
        load_config(PretrainConfig, qs, {"data.synthetic_samples": "8"})
    assert str(e.value) == f"config key 'train.steps': expected int, got 'ten' (train.steps from {qs})"


def test_pretrain_without_a_config_says_what_is_needed(capsys):
    assert main(["pretrain"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "no --config was given" in err and "--config configs/quickstart.yaml" in err
    assert "--train.steps / --train.epochs" in err


def _help_defaults(argv: list[str]) -> dict[str, str]:
    parser = build_parser(argv)
    leaf = parser
    for word in argv:  # walk down to the sub-parser that holds the config keys
        sub = next((a for a in leaf._actions if isinstance(a, argparse._SubParsersAction)), None)
        if sub is not None and word in sub.choices:
            leaf = sub.choices[word]
    out = {}
    for a in leaf._actions:
        if a.dest.startswith("cfg:"):
            m = re.search(r"\(default: (.*)\)$", a.help)
            out[a.dest[4:]] = m.group(1).replace("%%", "%")
    return out


def _dotted(cfg, key: str):
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


@pytest.mark.parametrize("argv,cls_name,required", [
    (["pretrain"], "PretrainConfig", {"train.steps": "10", "data.synthetic_samples": "64"}),
    (["finetune", "squad"], "SquadFinetuneConfig",
     {"init": "m", "output_dir": "o", "data.train_file": "t.json", "data.dev_file": "d.json"}),
    (["finetune", "glue"], "GlueFinetuneConfig", {"init": "m", "output_dir": "o", "data.task": "rte",
                                                 "data.data_dir": "d"}),
])
def test_help_defaults_are_the_defaults_a_run_gets(argv, cls_name, required):
    from bertrain.tasks import finetune, pretraining

    cls = getattr(pretraining, cls_name, None) or getattr(finetune, cls_name)
    run = load_config(cls, None, required)  # a run with nothing else set
    shown = _help_defaults(argv)
    assert set(shown) == {k for k, *_ in iter_fields(cls)}
    wrong = {k: (v, repr(_dotted(run, k))) for k, v in shown.items()
             if k not in required and v != repr(_dotted(run, k))}
    assert not wrong  # key: (--help says, the run uses)
    if cls_name == "GlueFinetuneConfig":  # the ones the issue saw wrong
        assert (shown["optim.lr"], shown["schedule.warmup"], shown["checkpoint.save_interval"],
                shown["checkpoint.keep_last"]) == ("3e-05", "0.1", "0", "1")


def test_evaluate_help_promises_only_what_it_does():
    assert set(_subcommands(["evaluate"])) == {"squad"}
    top = build_parser(["--help"]).format_help()
    line = re.search(r"\n\s+evaluate\s+(.*?)\n\s{4}\w", top, flags=re.S).group(1)
    assert "SQuAD" in line and "GLUE: finetune glue" in " ".join(line.split())


def _subcommands(argv: list[str]) -> list[str]:
    parser = build_parser(argv)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    leaf = sub.choices[argv[0]]
    return list(next(a for a in leaf._actions if isinstance(a, argparse._SubParsersAction)).choices)


# ----------------------------------------------------------------------------------------------- threads

def test_main_applies_and_prints_the_thread_choice_once(monkeypatch, caplog, tmp_path):
    import torch

    monkeypatch.setattr(threads, "_applied", None)
    monkeypatch.setattr(threads, "choose_threads", lambda: (1, "2 CPUs usable, load 1.2"))
    set_to = []
    monkeypatch.setattr(torch, "set_num_threads", set_to.append)
    data = tmp_path / "d.json"
    data.write_text(json.dumps({"version": "1.1", "data": [{"title": "t", "paragraphs": [
        {"context": "c", "qas": [{"id": "q", "question": "?", "answers": [{"text": "c", "answer_start": 0}]}]}]}]}))
    (tmp_path / "p.json").write_text('{"q": "c"}')
    argv = ["evaluate", "squad", "--data", str(data), "--predictions", str(tmp_path / "p.json")]
    with caplog.at_level(logging.INFO):
        assert main(argv) == 0 and main(argv) == 0
    lines = [r.getMessage() for r in caplog.records if "thread" in r.getMessage()]
    assert lines == ["using 1 thread (2 CPUs usable, load 1.2); set OMP_NUM_THREADS to override"]
    assert set_to == [1]  # torch is imported in this process: set once, not per command


# ----------------------------------------------------------------------------------------------- umask

def test_an_exported_model_is_readable_as_the_umask_says(tmp_path, umask, classifier):
    assert main(["export", str(classifier), str(tmp_path / "hf")]) == 0
    assert permissions(tmp_path / "hf") == 0o777 & ~umask
    assert {permissions(p) for p in (tmp_path / "hf").iterdir()} == {0o666 & ~umask}


# ----------------------------------------------------------------------------------------------- export / convert

@pytest.fixture(scope="module")
def classifier(tmp_path_factory) -> Path:
    """A tiny sequence classifier with trained-looking heads (all weights saved) and the test vocab."""
    import torch

    from bertrain.model.bert import BertConfig, BertForSequenceClassification
    from bertrain.model.hf import tokenizer_files_from_vocab

    torch.manual_seed(0)
    vocab = ASSETS / "vocab-tiny.txt"
    n = sum(1 for _ in open(vocab, encoding="utf-8"))
    model = BertForSequenceClassification(BertConfig(vocab_size=n, hidden_size=32, num_hidden_layers=1,
                                                     num_attention_heads=2, intermediate_size=48,
                                                     max_position_embeddings=64), num_labels=2)
    model.tokenizer_files = tokenizer_files_from_vocab(vocab, do_lower_case=True)
    d = tmp_path_factory.mktemp("cls") / "model"
    model.save_pretrained(d)
    return d


def test_export_over_an_existing_folder_moves_it_aside(tmp_path, classifier, capsys):
    out = tmp_path / "hf"
    out.mkdir()
    (out / "notes.txt").write_text("my notes")
    assert main(["export", str(classifier), str(out)]) == 2  # refused: nothing touched
    assert "already exists" in capsys.readouterr().err and (out / "notes.txt").read_text() == "my notes"
    assert main(["export", str(classifier), str(out), "--overwrite"]) == 0
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("hf.replaced-")]
    assert len(aside) == 1 and (aside[0] / "notes.txt").read_text() == "my notes"  # moved, never deleted
    assert (out / "config.json").is_file() and not (out / "notes.txt").exists()
    assert str(aside[0]) in capsys.readouterr().out


def test_export_and_convert_refuse_a_locked_output(tmp_path, classifier, capsys):
    from bertrain.utils.rundir import OutputLock

    out = tmp_path / "hf"
    with OutputLock(out, "export"):
        assert main(["export", str(classifier), str(out)]) == 2
        err = capsys.readouterr().err
        assert "is in use by `bertrain export`" in err and f"pid {os.getpid()}" in err
        assert main(["convert", str(classifier), str(out)]) == 2
        assert "is in use" in capsys.readouterr().err
    assert not out.exists()
    assert main(["export", str(classifier), str(out)]) == 0  # released: it works


def test_a_failed_export_keeps_the_old_folder(tmp_path, classifier, monkeypatch, capsys):
    import bertrain.model.hf  # noqa: F401  (installs save_pretrained)
    from bertrain.model import bert

    out = tmp_path / "hf"
    assert main(["export", str(classifier), str(out)]) == 0
    before = sorted(p.name for p in out.iterdir())

    def full_disk(self, path):
        (Path(path) / "model.safetensors").write_bytes(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device", str(Path(path) / "model.safetensors"))

    monkeypatch.setattr(bert.BertPreTrainedModel, "save_pretrained", full_disk)
    assert main(["export", str(classifier), str(out), "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "the disk is full" in err and f"{out} is unchanged" in err
    assert sorted(p.name for p in out.iterdir()) == before
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith((".hf", "hf."))] == [".hf.lock"]  # no debris


# ----------------------------------------------------------------------------------------------- predict

def test_predict_ids_on_the_command_line(tmp_path, classifier, capsys):
    items = tmp_path / "in.tsv"
    items.write_text("the cat sat\n\nthe dog\tthe mat\n")
    assert main(["predict", "--model", str(classifier), "--input", str(items)]) == 0
    assert [json.loads(l)["id"] for l in capsys.readouterr().out.splitlines()] == ["0", "1"]


def test_predict_refuses_empty_input_and_keeps_the_old_output(tmp_path, classifier, capsys):
    items, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    out.write_text("earlier predictions\n")
    items.write_text("\n\n")
    assert main(["predict", "--model", str(classifier), "--input", str(items), "--output", str(out)]) == 2
    err = capsys.readouterr().err
    assert "holds no items" in err and f"{out} was not written" in err
    items.write_text('{"text": "the cat"}\n{oops\n')  # a bad line: named, and the old output kept
    assert main(["predict", "--model", str(classifier), "--input", str(items), "--output", str(out)]) == 2
    assert f"{items}:2: malformed JSON" in capsys.readouterr().err
    assert out.read_text() == "earlier predictions\n"


def test_predict_refuses_text_that_is_not_utf8(tmp_path, classifier, capsys):
    items = tmp_path / "in.tsv"
    items.write_bytes("the cat\ncaf\u00e9 au lait\n".encode("latin-1"))
    assert main(["predict", "--model", str(classifier), "--input", str(items)]) == 2
    err = capsys.readouterr().err
    assert f"{items}:2: not UTF-8 text (byte 0xe9 at column 4)" in err and "iconv" in err


def test_predict_refuses_a_model_without_the_trained_head(tmp_path, classifier, capsys):
    """A classifier asked for QA answers would answer from a randomly initialised span head: refused."""
    assert main(["predict", "--model", str(classifier), "--task", "qa", "--question", "who ?",
                 "--context", "ann sat ."]) == 2
    err = capsys.readouterr().err
    assert "without trained weights" in err and "bertrain finetune squad" in err


# ----------------------------------------------------------------------------------------------- evaluate

def test_evaluate_names_predictions_for_unknown_questions(tmp_path, caplog, capsys):
    data, preds = tmp_path / "d.json", tmp_path / "p.json"
    qas = [{"id": f"q{i}", "question": "?", "answers": [{"text": "c", "answer_start": 0}]} for i in range(4)]
    data.write_text(json.dumps({"version": "1.1", "data": [{"title": "t", "paragraphs": [{"context": "c",
                                                                                          "qas": qas}]}]}))
    preds.write_text(json.dumps({"q0": "c", "q1": "c", "x9": "c", "x8": "c"}))
    with caplog.at_level(logging.WARNING):
        assert main(["evaluate", "squad", "--data", str(data), "--predictions", str(preds)]) == 0
    msgs = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert sorted(msgs) == [f"2 of 4 predictions are for question ids not in {data} (ignored), e.g. x9, x8",
                            "2 of 4 questions have no prediction (score 0), e.g. q2, q3"]
    assert json.loads(capsys.readouterr().out) == {"exact_match": 50.0, "f1": 50.0}


def test_the_console_script_and_python_m_end_alike_without_teardown_after_joining_a_group(monkeypatch) -> None:
    """`bertrain` (the console script: what srun and mpirun start) and `python -m bertrain` (torchrun -m) both go
    through `cli.entry`: after joining a process group the process ends with os._exit (no destructors of gloo's
    threads, nor of a failed run's kept objects), else with sys.exit."""
    import tomllib

    import torch.distributed as torch_dist

    import bertrain.cli as cli

    repo = Path(__file__).resolve().parents[1]
    scripts = tomllib.loads((repo / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"bertrain": "bertrain.cli:entry"}
    assert "from bertrain.cli import entry" in (repo / "src" / "bertrain" / "__main__.py").read_text()

    class Exited(Exception):
        pass

    def fake_exit(code: int) -> None:
        raise Exited(code)

    monkeypatch.setattr(cli, "main", lambda: 3)
    monkeypatch.setattr(os, "_exit", fake_exit)
    with pytest.raises(SystemExit) as plain:  # no group joined: the normal exit
        cli.entry()
    assert plain.value.code == 3
    monkeypatch.setattr(torch_dist, "_bertrain_joined", True, raising=False)
    with pytest.raises(Exited) as joined:
        cli.entry()
    assert joined.value.args == (3,)


def test_evaluate_squad_with_the_files_swapped_is_one_short_line(tmp_path, capsys):
    """The data file given as --predictions printed the whole file (36 KB for four articles) in its "one line"."""
    context = "The quick brown fox jumps over the lazy dog. " * 200
    data = tmp_path / "dev.json"
    data.write_text(json.dumps({"version": "1.1", "data": [{"title": "t", "paragraphs": [
        {"context": context, "qas": [{"id": "q", "question": "?", "answers": [{"text": "fox", "answer_start": 16}]}]}]}]}))
    assert main(["evaluate", "squad", "--data", str(data), "--predictions", str(data)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and len(err[0]) < 400 and "is a SQuAD data file, not predictions" in err[0]
    (tmp_path / "p.json").write_text(json.dumps({"q": {"text": context}}))
    assert main(["evaluate", "squad", "--data", str(data), "--predictions", str(tmp_path / "p.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and len(err[0]) < 400 and "question id q is not a string: {'text': " in err[0]
    assert f"({len(repr({'text': context})):,} characters)" in err[0]


def test_evaluate_squad_names_the_data_file_and_an_unused_na_prob_file(tmp_path, capsys, caplog):
    qas = [{"id": "a", "question": "?", "answers": [{"text": "fox", "answer_start": 16}]},
           {"id": "n", "question": "?", "answers": [], "is_impossible": True}]
    data = tmp_path / "dev.json"
    data.write_text(json.dumps({"version": "v2.0", "data": [{"title": "t", "paragraphs": [
        {"context": "The quick brown fox.", "qas": qas}]}]}))
    (tmp_path / "p.json").write_text(json.dumps({"a": "fox", "n": ""}))
    (tmp_path / "odds.json").write_text(json.dumps({"a": -1.0, "n": 2.0}))
    argv = ["evaluate", "squad", "--data", str(data), "--predictions", str(tmp_path / "p.json")]
    assert main([*argv, "--version", "1.1"]) == 2  # an unanswerable question scored as v1.1: the file is named
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(
        f"bertrain evaluate: error: {data}: question id n has no gold answers")
    (tmp_path / "v1.json").write_text(json.dumps({"version": "1.1", "data": [{"title": "t", "paragraphs": [
        {"context": "The quick brown fox.", "qas": qas[:1]}]}]}))
    with caplog.at_level(logging.WARNING):
        assert main(["evaluate", "squad", "--data", str(tmp_path / "v1.json"), "--predictions",
                     str(tmp_path / "p.json"), "--na-prob-file", str(tmp_path / "odds.json")]) == 0
    assert "--na-prob-file" in caplog.text and "is not used" in caplog.text
