"""The real launchers (issue 13), on this machine, CPU and gloo: Open MPI's `mpirun`, Slurm's `srun` and `sbatch`
on a single-host Slurm cluster, `torchrun` across two agents (static and c10d rendezvous), and torchrun's elastic
restarts after a kill -9 — of one worker, and of a whole agent (2 -> 1 nodes, global batch kept). Every run's final
weights are bitwise equal to `torchrun --nproc-per-node 2` with the same config.

The launch lines come from README.md's "Many machines" section: each line there is run here (its launcher part,
with this test's small config, a free port, and `--allow-run-as-root` for mpirun as root), so the README cannot
drift from what works. Needs Debian's openmpi-bin, slurm-wlm and munge: installed with apt-get when running as
root with apt available, skipped with the reason otherwise (`-m "not launchers"` leaves them out).
"""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from distributed import REPO, cli_env, free_port, wait_all

pytestmark = [pytest.mark.launchers, pytest.mark.slow]

PACKAGES = {"mpirun": "openmpi-bin", "srun": "slurm-wlm", "slurmctld": "slurmctld", "slurmd": "slurmd",
            "munged": "munge"}
TIMEOUT = 240
VOCAB = REPO / "tests" / "assets" / "vocab-tiny.txt"
BIN = Path(sys.executable).parent  # bertrain, torchrun: installed beside this Python


# ------------------------------------------------------------------------------------------------ set-up

@pytest.fixture(scope="module")
def tools() -> None:
    missing = sorted({pkg for tool, pkg in PACKAGES.items() if shutil.which(tool) is None})
    if not missing:
        return
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        pytest.skip(f"launcher packages {', '.join(missing)} missing and cannot be installed here (needs root and "
                    "apt-get): apt-get install -y openmpi-bin slurm-wlm munge")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for cmd in (["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", "openmpi-bin", "slurm-wlm", "munge"]):
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        if r.returncode != 0:
            pytest.skip(f"`{' '.join(cmd)}` failed (no package mirror?): {r.stderr.strip()[-300:]}")


# Each launch line of README.md's "Many machines" section, by what identifies it there; each is run below.
LINES = {
    "torchrun": ("torchrun --standalone --nproc-per-node 2 -m bertrain pretrain",),
    "torchrun static": ("torchrun --nnodes 2 --node-rank 0",),
    "torchrun c10d": ("torchrun --nnodes 1:2", "--rdzv-backend c10d"),
    "torchrun elastic": ("torchrun --standalone", "--max-restarts"),
    "mpirun pretrain": ("mpirun", "bertrain pretrain"),
    "mpirun finetune": ("mpirun", "bertrain finetune"),
    "srun": ("srun",),
    "sbatch": ("sbatch examples/slurm/pretrain.sbatch",),
}


def test_every_readme_launch_line_is_run() -> None:
    lines = readme_launch_lines()
    for line in lines:
        users = [name for name, needles in LINES.items() if all(n in line for n in needles)]
        assert len(users) == 1, f"README launch line {line!r} is run by {users or 'no test'}"
    assert len(lines) == len(LINES)


def readme_launch_lines() -> list[str]:
    """The command lines of README.md's "Many machines" section (continuations joined, comments dropped)."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    section = text.split("## Many machines", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", section, flags=re.S)
    lines = "\n".join(blocks).replace("\\\n", " ").splitlines()
    return [" ".join(line.split()) for line in lines if line.strip() and not line.strip().startswith("#")]


def readme_line(*needles: str) -> list[str]:
    """The one README launch line containing every needle, split into words, the `bertrain` part (from the word
    `bertrain` or `-m bertrain` on) left out: the test appends its own command."""
    found = [line for line in readme_launch_lines() if all(n in line for n in needles)]
    assert len(found) == 1, f"README 'Many machines' should have exactly one line with {needles}: {found}"
    words = shlex.split(found[0].replace("$HEAD", "127.0.0.1"))  # $HEAD: node 0's address; this host here
    cut = next(i for i, w in enumerate(words) if w == "bertrain")
    if words[cut - 1] == "-m":
        cut -= 1
    return words[:cut]


def port_for(words: list[str], port: int) -> list[str]:
    """The README's example ports (29500 master, 29400 rendezvous) replaced by a free one."""
    return [re.sub(r"\b29[45]00\b", str(port), w) for w in words]


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory, tools: None) -> dict[str, Path]:
    """Real text (Python's documentation, built in) prepared with the tiny test vocab, a small config, and the
    reference: `torchrun --nproc-per-node 2`."""
    root = tmp_path_factory.mktemp("launchers")
    data = root / "data"
    r = subprocess.run([str(BIN / "bertrain"), "prepare", "--input", "builtin:python-docs", "--output", str(data),
                        "--vocab-file", str(VOCAB), "--masking", "dynamic"], env=env(), capture_output=True,
                       text=True, timeout=TIMEOUT)
    assert r.returncode == 0, r.stdout + r.stderr
    config = root / "pretrain.yaml"
    config.write_text(json.dumps({
        "model": {"preset": "tiny", "dropout": 0.1},
        "data": {"prepared": str(data)},
        "sample": {"max_seq_length": 64, "max_predictions_per_seq": 10},
        # 16 = 8 x 2 ranks x 1 micro-step, or 8 x 1 rank x 2 micro-steps after a shrink
        "train": {"steps": 120, "global_batch_size": 16, "micro_batch_size": 8, "log_interval": 10},
        "optim": {"name": "lamb", "lr": 2e-3},
        "schedule": {"name": "poly", "warmup": 0.1},
        "checkpoint": {"save_interval": 10, "keep_last": 0},
        # a collective that fails when a peer is killed probes the heartbeats 1.5 intervals apart before it names
        # the silent rank (the kill -9 tests): 1.5 s instead of 7.5 s; nothing else depends on it
        "distributed": {"heartbeat_interval_s": 1},
        "seed": 7, "output_dir": str(root / "unused"),
    }))
    out = root / "reference"
    log = launch(with_bertrain(readme_line(*LINES["torchrun"])), config, out)
    assert log.count("launched by torchrun: world size 2") == 1, log  # printed once, by rank 0
    assert re.search(r"rank 0: local rank 0 on \S+ \(pid \d+, cpu\)\n\s+rank 1: local rank 1 on", log), log
    return {"root": root, "config": config, "reference": out, "data": data}


def env(**extra: str) -> dict[str, str]:
    e = cli_env(extra)
    e["PATH"] = f"{BIN}{os.pathsep}{e.get('PATH', '')}"
    return e


def pretrain_argv(config: Path, out: Path) -> list[str]:
    return ["pretrain", "--config", str(config), "--output_dir", str(out)]


def launch(prefix: list[str], config: Path, out: Path, extra_env: dict[str, str] | None = None) -> str:
    """Run `PREFIX pretrain ...` (PREFIX ends with `bertrain` or `-m bertrain`) and return its output."""
    argv = prefix + pretrain_argv(config, out)
    r = subprocess.run(argv, env=env(**(extra_env or {})), capture_output=True, text=True, timeout=TIMEOUT,
                       cwd=REPO)
    assert r.returncode == 0, f"{shlex.join(argv)} failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r.stdout + r.stderr


def with_bertrain(prefix: list[str]) -> list[str]:
    return prefix + ["bertrain"] if prefix[0] != "torchrun" else prefix + ["-m", "bertrain"]


def assert_bitwise(reference: Path, out: Path) -> None:
    a, b = (load_file(str(d / "final" / "model.safetensors")) for d in (reference, out))
    assert a.keys() == b.keys()
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, f"{out.name}: {len(differ)} tensors differ from the reference, e.g. {differ[:3]}"


def mpirun_prefix(words: list[str]) -> list[str]:
    if os.geteuid() == 0:  # Open MPI refuses root unless told (README says so)
        words = words[:1] + ["--allow-run-as-root"] + words[1:]
    return words


# ------------------------------------------------------------------------------------------------ Open MPI

def test_mpirun_pretrain_equals_torchrun(setup: dict[str, Path]) -> None:
    prefix = mpirun_prefix(readme_line(*LINES["mpirun pretrain"]))
    out = setup["root"] / "mpirun"
    log = launch(with_bertrain(prefix), setup["config"], out)
    assert log.count("launched by openmpi: world size 2") == 1, log
    assert_bitwise(setup["reference"], out)


def test_mpirun_finetune_equals_torchrun(setup: dict[str, Path], shared_data: Path) -> None:
    """GLUE MRPC (real data) fine-tuned from the reference's pretrained model: mpirun = torchrun, bitwise."""
    finetune = ["finetune", "glue", "--task", "mrpc", "--data-dir", str(shared_data / "glue" / "MRPC"),
                "--init", str(setup["reference"] / "final"), "--data.max_seq_length", "64", "--train.steps", "12",
                "--train.global_batch_size", "16", "--train.micro_batch_size", "8", "--eval_batch_size", "64",
                "--train.log_interval", "4", "--data.predict_test", "false"]
    results = {}
    for name, prefix in (("torchrun", with_bertrain(readme_line(*LINES["torchrun"]))),
                         ("mpirun", mpirun_prefix(readme_line(*LINES["mpirun finetune"])) + ["bertrain"])):
        out = setup["root"] / f"mrpc-{name}"
        argv = prefix + finetune + ["--output", str(out)]
        r = subprocess.run(argv, env=env(), capture_output=True, text=True, timeout=TIMEOUT, cwd=REPO)
        assert r.returncode == 0, f"{shlex.join(argv)}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
        results[name] = out
    assert_bitwise(results["torchrun"], results["mpirun"])
    a, b = ((d / "dev_predictions.tsv").read_bytes() for d in results.values())
    assert a == b and a.count(b"\n") == 409  # header + every MRPC dev pair, once


# ------------------------------------------------------------------------------------------------ Slurm

@pytest.fixture(scope="module")
def slurm(setup: dict[str, Path]) -> dict[str, str]:
    """A single-host Slurm cluster (examples/slurm/local-cluster.sh) on free ports; stopped afterwards."""
    state = setup["root"] / "slurm"
    script = REPO / "examples" / "slurm" / "local-cluster.sh"
    ports = {"SLURMCTLD_PORT": str(free_port()), "SLURMD_PORT": str(free_port())}
    r = subprocess.run(["bash", str(script), "start", str(state)], env=dict(os.environ, **ports),
                       capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        subprocess.run(["bash", str(script), "stop", str(state)], capture_output=True, timeout=60)
        pytest.fail(f"the local Slurm cluster did not start:\n{r.stdout}\n{r.stderr}")
    yield {"SLURM_CONF": str(state / "slurm.conf")}
    subprocess.run(["bash", str(script), "stop", str(state)], capture_output=True, timeout=60)


def test_srun_pretrain_equals_torchrun(setup: dict[str, Path], slurm: dict[str, str]) -> None:
    out = setup["root"] / "srun"
    log = launch(with_bertrain(readme_line(*LINES["srun"])), setup["config"], out, slurm)
    assert log.count("launched by slurm: world size 2") == 1, log
    assert_bitwise(setup["reference"], out)


def test_sbatch_example_job_equals_torchrun(setup: dict[str, Path], slurm: dict[str, str]) -> None:
    """The shipped multi-node GPU job file, run as is; only the allocation is overridden on the command line
    (one 2-CPU node, no GPUs), and CONFIG/OUTPUT point at this test's run."""
    assert "sbatch examples/slurm/pretrain.sbatch" in readme_launch_lines()
    out, log = setup["root"] / "sbatch", setup["root"] / "sbatch.out"
    argv = ["sbatch", "--parsable", "--nodes=1", "--ntasks-per-node=2", "--gpus-per-node=0", "--cpus-per-task=1",
            "--time=10", f"--output={log}", f"--export=ALL,CONFIG={setup['config']},OUTPUT={out}",
            str(REPO / "examples" / "slurm" / "pretrain.sbatch")]
    r = subprocess.run(argv, env=env(**slurm), capture_output=True, text=True, timeout=TIMEOUT, cwd=REPO)
    assert r.returncode == 0, f"{r.stdout}\n{r.stderr}"
    state, exit_code = wait_for_job(r.stdout.strip().split(";")[0], slurm)
    text = log.read_text() if log.exists() else ""
    assert (state, exit_code) == ("COMPLETED", "0:0"), f"job {state}, exit code {exit_code}:\n{text[-3000:]}"
    assert text.count("launched by slurm: world size 2") == 1, text
    assert_bitwise(setup["reference"], out)


def wait_for_job(job: str, slurm: dict[str, str], timeout: float = TIMEOUT) -> tuple[str, str]:
    """The final JobState and ExitCode of a batch job, from `scontrol show job` polled until the job has ended.
    (`sbatch --wait` polls 2 s, then 8 s, then 32 s later: a job of ~10 s cost 10 or 42 s of waiting.)"""
    deadline = time.monotonic() + timeout
    while True:
        r = subprocess.run(["scontrol", "show", "job", "-o", job], env=env(**slurm), capture_output=True, text=True,
                           timeout=60)
        fields = dict(f.split("=", 1) for f in r.stdout.split() if "=" in f)
        assert r.returncode == 0 and "JobState" in fields, f"scontrol show job {job}: {r.stdout}{r.stderr}"
        if fields["JobState"] not in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED"):
            return fields["JobState"], fields["ExitCode"]
        assert time.monotonic() < deadline, f"job {job} still {fields['JobState']} after {timeout} s"
        time.sleep(0.1)


def test_slurm_batch_script_without_srun_is_refused(setup: dict[str, Path]) -> None:
    """Inside a 2-task allocation but not started by srun: one clear line naming the variables, exit 2."""
    r = subprocess.run([str(BIN / "bertrain"), *pretrain_argv(setup["config"], setup["root"] / "nosrun")],
                       env=env(SLURM_JOB_ID="9", SLURM_PROCID="0", SLURM_NTASKS="2"), capture_output=True,
                       text=True, timeout=TIMEOUT)
    assert r.returncode == 2, r.stderr
    assert "SLURM_NTASKS=2" in r.stderr and "SLURM_STEP_NUM_TASKS" in r.stderr and "srun" in r.stderr
    assert not (setup["root"] / "nosrun").exists()


# ------------------------------------------------------------------------------------------------ torchrun

def agents(words: list[str], port: int, config: Path, out: Path, n: int = 2) -> list[subprocess.Popen]:
    """`n` torchrun agents on this host, as on `n` nodes: the README line with --node-rank i for agent i. The others
    start once the first listens on `port`: it hosts the rendezvous store (the c10d rendezvous makes host whichever
    agent binds the port first, and the shrink test kills the second)."""
    procs = []
    for i in range(n):
        argv = port_for(words, port)
        if "--node-rank" in argv:
            argv[argv.index("--node-rank") + 1] = str(i)
        procs.append(subprocess.Popen(argv + ["-m", "bertrain", *pretrain_argv(config, out)], env=env(),
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO))
        if i == 0 and n > 1:
            wait_listening(port, procs[0])
    return procs


def listening(port: int) -> bool:
    """Whether a socket on this host listens on TCP `port`, from /proc/net (state 0A), IPv4 or IPv6."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:  # no IPv6
            continue
        for row in rows:
            fields = row.split()  # sl, local_address (hex ip:port), rem_address, st, ...
            local, state = fields[1], fields[3]
            if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
                return True
    return False


def wait_listening(port: int, proc: subprocess.Popen, timeout: float = TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not listening(port):
        assert proc.poll() is None, f"the first agent ended ({proc.returncode}) before it listened on port {port}"
        assert time.monotonic() < deadline, f"nothing listens on port {port} after {timeout} s"
        time.sleep(0.05)


def finish(procs: list[subprocess.Popen], timeout: float = TIMEOUT) -> list[str]:
    results = wait_all(procs, timeout)
    for r in results:
        assert r.returncode == 0, f"agent failed ({r.returncode}):\n{r.stdout[-4000:]}"
    return [r.stdout for r in results]


@pytest.mark.parametrize("name", ["torchrun static", "torchrun c10d"])
def test_torchrun_two_agents_equal_one(setup: dict[str, Path], name: str) -> None:
    """Two torchrun agents on 127.0.0.1 with one worker each, as two nodes: static (--node-rank 0/1 and a master
    address) and the c10d rendezvous. Rank 0 prints the layout once; the result is the one-agent result."""
    out = setup["root"] / name.replace(" ", "-")
    words = readme_line(*LINES[name])
    logs = finish(agents(words, free_port(), setup["config"], out))
    assert sum(log.count("launched by torchrun: world size 2") for log in logs) == 1, logs
    assert_bitwise(setup["reference"], out)


def children(pid: int) -> list[int]:
    """Child pids of `pid`, from /proc (no dependency on procps), in pid order."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after "(comm)": state, ppid, ...
        except OSError:  # the process ended meanwhile
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return sorted(found)


def wait_for(path: Path, procs: list[subprocess.Popen], timeout: float = TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert all(p.poll() is None for p in procs), "a launcher ended before the kill"
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def test_elastic_restart_after_kill9_is_bitwise(setup: dict[str, Path]) -> None:
    """torchrun --max-restarts: one worker killed with SIGKILL mid-run; the agent restarts the group, which
    continues from the last complete checkpoint by itself (TORCHELASTIC_RESTART_COUNT), not from scratch."""
    out = setup["root"] / "elastic"
    words = readme_line(*LINES["torchrun elastic"])
    (agent,) = agents(words, free_port(), setup["config"], out, n=1)
    wait_for(out / "step-30" / "COMPLETE", [agent])
    victim = children(agent.pid)[-1]
    os.kill(victim, signal.SIGKILL)
    (log,) = finish([agent])
    assert "TORCHELASTIC_RESTART_COUNT=1: restarted by the launcher" in log, log[-3000:]
    resumed = re.search(r"resumed from \S+/step-(\d+) at step (\d+)", log)
    assert resumed and int(resumed.group(1)) >= 30, log[-3000:]
    assert_bitwise(setup["reference"], out)


def test_elastic_shrink_two_agents_to_one_keeps_the_global_batch(setup: dict[str, Path]) -> None:
    """c10d rendezvous with --nnodes 1:2: the second agent (a node) and its worker are killed with SIGKILL; the
    first agent restarts alone (1 rank x 2 micro-steps instead of 2 x 1, the same global batch of 16) from the last
    complete checkpoint. Samples and dropout masks follow the global batch, not the ranks, and 2 partial gradients
    sum the same way either way: bitwise equal to the straight 2-rank run."""
    out = setup["root"] / "shrink"
    # torch's defaults would spend ~45 s after the kill: the dead agent leaves the rendezvous only once its
    # keep-alive is keep_alive_interval x keep_alive_max_attempt = 5 x 3 s old, then the lone agent waits
    # last_call_timeout = 30 s for more nodes. Here 1 x 5 s and 10 s. The last call also bounds how long the first
    # agent waits for the second at the start: the second joins ~1.3 s after the first (measured; ~3 s at twice the
    # load). Had the first trained alone, the checkpoint it resumes from would be a 1-rank one: asserted below.
    words = readme_line(*LINES["torchrun c10d"]) + [
        "--rdzv-conf", "last_call_timeout=10,keep_alive_interval=1,keep_alive_max_attempt=5"]
    first, second = agents(words, free_port(), setup["config"], out)
    wait_for(out / "step-30" / "COMPLETE", [first, second])
    for pid in [second.pid, *children(second.pid)]:
        os.kill(pid, signal.SIGKILL)
    second.wait()
    (log,) = finish([first])
    assert "micro 8 x accumulation 2 x 1 ranks" in log, log[-3000:]
    assert re.search(r"resumed from \S+/step-\d+ at step \d+", log), log[-3000:]
    assert "resuming on 1 ranks from a 2-rank checkpoint" in log, log[-3000:]  # both agents were in the first round
    assert_bitwise(setup["reference"], out)


def test_elastic_shrink_of_an_fsdp_job_resumes_its_shards_on_one_agent(setup: dict[str, Path]) -> None:
    """The shrink above under `parallelism.strategy: fsdp`: the lone agent's one-rank job makes a one-rank FSDP group
    and loads the 2-rank sharded checkpoint (DCP); the result equals the straight 2-rank FSDP run to rounding (FSDP
    reduce-scatters where one rank sums locally: not bitwise). Before session 17 every restart failed ("fsdp but the
    job has 1 rank")."""
    config = setup["root"] / "pretrain-fsdp.yaml"
    config.write_text(json.dumps({**json.loads(setup["config"].read_text()), "parallelism": {"strategy": "fsdp"}}))
    reference = setup["root"] / "fsdp-reference"
    launch(with_bertrain(readme_line(*LINES["torchrun"])), config, reference)
    out = setup["root"] / "fsdp-shrink"
    words = readme_line(*LINES["torchrun c10d"]) + [
        "--rdzv-conf", "last_call_timeout=10,keep_alive_interval=1,keep_alive_max_attempt=5"]  # as in the DDP test
    first, second = agents(words, free_port(), config, out)
    wait_for(out / "step-30" / "COMPLETE", [first, second])
    assert sorted(p.name for p in (out / "step-30" / "dcp").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    for pid in [second.pid, *children(second.pid)]:
        os.kill(pid, signal.SIGKILL)
    second.wait()
    (log,) = finish([first])
    assert "micro 8 x accumulation 2 x 1 ranks" in log, log[-3000:]
    assert "resuming on 1 ranks from a 2-rank checkpoint" in log, log[-3000:]
    assert (out / "step-120" / "dcp").is_dir()  # the lone agent's job went on sharded (a one-rank FSDP group)
    a, b = (load_file(str(d / "final" / "model.safetensors")) for d in (reference, out))
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=1e-5, msg=lambda m, k=k: f"{k}: {m}")


# ------------------------------------------------------------------------------------------------ bad environments

@pytest.mark.parametrize("variables, named", [
    ({"RANK": "0"}, "WORLD_SIZE"),
    ({"RANK": "3", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"}, "rank 3"),
    ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "x"}, "OMPI_COMM_WORLD_SIZE='x'"),
])
def test_bad_launcher_environment_is_one_line(setup: dict[str, Path], variables: dict[str, str],
                                              named: str) -> None:
    r = subprocess.run([str(BIN / "bertrain"), *pretrain_argv(setup["config"], setup["root"] / "badenv")],
                       env=env(**variables), capture_output=True, text=True, timeout=TIMEOUT)
    assert r.returncode == 2 and named in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
