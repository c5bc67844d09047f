"""Interruption at moments nobody tried: a stop signal to the whole process group (a terminal's Ctrl-C, `kill -TERM
-PGID`, Slurm's or systemd's stop), at exact moments of a command, timed by what the process prints (a pause
patched into the child at the moment named, never a fixed sleep). Each case checks the exit code and message,
what is left on disk, and that the same command afterwards gives the result of an uninterrupted run."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from distributed import cli_env, default_sigint

# The child: `bertrain ARGS` with the Nth call of MODULE.CLASS.METHOD (or MODULE.FUNCTION) held: it prints PAUSED
# and waits until a signal ends it (the CLI turns SIGINT / SIGTERM into an exception raised in the wait).
PAUSE_AT = r"""
import importlib, sys, time
target, nth, args = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
module, _, name = target.rpartition(":")
owner = importlib.import_module(module)
attr = name
if "." in name:
    cls, attr = name.split(".")
    owner = getattr(owner, cls)
original = getattr(owner, attr)
calls = [0]
def held(*a, **k):
    calls[0] += 1
    if calls[0] == nth:
        print("PAUSED", file=sys.stderr, flush=True)
        while True:
            time.sleep(0.01)
    return original(*a, **k)
setattr(owner, attr, held)
from bertrain.cli import entry
sys.argv = ["bertrain", *args]
entry()
"""


def _stop_group_at(target: str, nth: int, argv: list[str], sig: signal.Signals, timeout: float = 60
                   ) -> tuple[int, str]:
    """Run `bertrain ARGV` in its own process group, send `sig` to the whole group once the child holds at the
    `nth` call of `target`; returns (exit code, stderr). A child still alive `timeout` s after the signal fails the
    test as hung (its group is killed)."""
    proc = subprocess.Popen([sys.executable, "-c", PAUSE_AT, target, str(nth), *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=cli_env({"OMP_NUM_THREADS": "1"}),
                            start_new_session=True, preexec_fn=default_sigint)
    err: list[str] = []
    try:
        for line in proc.stderr:
            err.append(line)
            if line.strip() == "PAUSED":
                os.killpg(proc.pid, sig)
                break
        else:
            proc.wait(timeout=60)
            pytest.fail(f"the child never reached {target} call {nth}: {''.join(err)[-3000:]}")
        try:
            rest = proc.communicate(timeout=timeout)[1]
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running {timeout} s after {sig.name} to its process group (hung)")
        return proc.returncode, "".join(err) + rest
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the group's leftovers (pool workers of a hung parent)
        except ProcessLookupError:
            pass
        proc.wait()


def _bertrain(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bertrain", *argv], capture_output=True, text=True,
                          env=cli_env({"OMP_NUM_THREADS": "1"}), timeout=300)


def _tree(folder: Path, skip: tuple[str, ...] = ()) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name not in skip}


# ----------------------------------------------------------------------------------------------- prepare

@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> tuple[Path, list[str], Path]:
    """A vocabulary, the arguments of a two-worker `prepare` of the built-in corpus, and its uninterrupted output."""
    root = tmp_path_factory.mktemp("prepare")
    done = _bertrain("vocab", "--input", "builtin:python-docs", "--output", str(root / "vocab"), "--vocab-size", "600")
    assert done.returncode == 0, done.stderr
    argv = ["prepare", "--input", "builtin:python-docs", "--vocab-file", str(root / "vocab" / "vocab.txt"),
            "--masking", "static", "--dupe-factor", "2", "--max-seq-length", "64", "--max-predictions-per-seq", "10",
            "--workers", "2", "--shard-tokens", "20000"]
    done = _bertrain(*argv, "--output", str(root / "straight"))
    assert done.returncode == 0, done.stderr
    return root, argv, root / "straight"


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_stop_signal_to_the_process_group_of_a_prepare_with_workers_stops_it_cleanly(prepared, sig):
    """Ctrl-C in a terminal (SIGINT to the foreground process group) or SIGTERM to every process of the job while
    the pool's workers hold tasks: exit 3, one line, and the same command finishes the build to the bytes of an
    uninterrupted one. Before: the workers died of it too (Ctrl-C: a traceback each), one of them mid-read of a task
    or holding the task queue's lock, and the parent hung for good in Pool.terminate (SIGTERM: nearly every time)."""
    root, argv, straight = prepared
    out = root / f"cut-{sig.name}"
    code, err = _stop_group_at("bertrain.data.store:ShardWriter.close", 1, [*argv, "--output", str(out)], sig)
    assert code == 3, err
    assert "Traceback" not in err
    word = "interrupted" if sig == signal.SIGINT else "stopped by SIGTERM"
    assert err.strip().splitlines()[-1] == f"bertrain prepare: {word}"
    assert not out.exists() and (out.parent / f"{out.name}.partial").is_dir()  # nothing under the final name
    done = _bertrain(*argv, "--output", str(out))
    assert done.returncode == 0, done.stderr
    assert _tree(out, skip=("stats.json",)) == _tree(straight, skip=("stats.json",))


# ----------------------------------------------------------------------------------------------- kill -9 leftovers

def test_kill_9_while_an_export_is_written_leaves_no_model_sized_temporary_once_run_again(tmp_path):
    """kill -9 (the OOM killer, a scheduler's hard stop) while `bertrain export` builds its folder: nothing under
    OUT, and the same command afterwards writes the export and removes the dead writer's temporary folder (before:
    `.OUT.<random>.tmp`, as large as the model, stayed beside it for good; the same for a run's final/ and best/,
    where only a killed checkpoint's `.step-N.*.tmp` was removed)."""
    from helpers import save_tiny_model

    model = save_tiny_model(tmp_path / "model")
    out = tmp_path / "exported"
    argv = ["export", str(model), str(out)]
    code, err = _stop_group_at("bertrain.model.card:write_card", 1, argv, signal.SIGKILL)
    assert code == -signal.SIGKILL, err
    assert not out.exists()
    assert [p.name for p in tmp_path.glob(".exported.*.tmp")]  # what the killed export left
    done = _bertrain(*argv)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == [".exported.lock"]
    assert (out / "model.safetensors").read_bytes() == (model / "model.safetensors").read_bytes()
