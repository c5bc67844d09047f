"""The thread count (utils/threads.py): chosen from the usable CPUs, the load, a cgroup quota and the local ranks;
OMP_NUM_THREADS (or MKL_NUM_THREADS) overrides it. How the CLI applies and prints it: test_cli_reliability.py."""
from __future__ import annotations

import os

import pytest

from bertrain.utils import threads


def test_threads_follow_the_usable_cpus_and_the_load():
    pick = threads.choose_threads
    assert pick({}, affinity=range(8), load=0.2, machine_cpus=8, quota=None, physical=8)[0] == 8
    n, reason = pick({}, affinity=range(8), load=6.4, machine_cpus=8, quota=None, physical=8)
    assert n == 2 and "8 CPUs usable" in reason and "load 6.4" in reason
    assert pick({}, affinity=range(2), load=9.0, machine_cpus=2, quota=None, physical=2)[0] == 1  # at least 1
    # a job pinned to 4 of 64 CPUs carries only its share of the machine's load
    assert pick({}, affinity=[0, 1, 2, 3], load=16.0, machine_cpus=64, quota=None, physical=4)[0] == 3
    # hyperthreads: at most one thread per physical core, as PyTorch's own default
    assert pick({}, affinity=range(16), load=0.0, machine_cpus=16, quota=None, physical=8)[0] == 8
    # a container's CPU quota
    assert pick({}, affinity=range(32), load=0.0, machine_cpus=32, quota=2.0, physical=32)[0] == 2
    # torchrun: the local ranks share the CPUs
    assert pick({"LOCAL_WORLD_SIZE": "4"}, affinity=range(16), load=0.0, machine_cpus=16, quota=None,
                physical=16)[0] == 4
    # the user's choice wins
    assert pick({"OMP_NUM_THREADS": "3"}, affinity=range(16), load=15.0) == (3, "OMP_NUM_THREADS=3 is set")
    assert pick({"OMP_NUM_THREADS": "junk"}, affinity=range(4), load=0.0, machine_cpus=4, quota=None,
                physical=4)[0] == 4


def test_threads_read_this_process_s_cpus_load_and_environment(monkeypatch):
    """With no arguments, the choice reads this process's own affinity, the machine's CPU count and load, and the
    environment: a given machine state gives the expected count, and OMP_NUM_THREADS overrides it."""
    for var in (*threads.USER_VARIABLES, *threads.LOCAL_WORLD_VARIABLES):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5})  # 6 of the machine's 12 CPUs
    monkeypatch.setattr(os, "cpu_count", lambda: 12)
    monkeypatch.setattr(os, "getloadavg", lambda: (6.0, 1.0, 1.0))  # machine-wide: ~3 of it on our 6 CPUs
    monkeypatch.setattr(threads, "cgroup_quota", lambda: None)
    monkeypatch.setattr(threads, "physical_cores", lambda cpus: len(cpus))
    n, reason = threads.choose_threads()
    assert n == 3 and reason == "6 CPUs usable, load 6.0 (~3.0 on ours)"
    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    assert threads.choose_threads()[0] == 6
    monkeypatch.setattr(threads, "physical_cores", lambda cpus: 3)  # hyperthread pairs
    assert threads.choose_threads() == (3, "6 CPUs usable on 3 cores, load 0.0 (~0.0 on ours)")
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "2")  # two ranks on this node share the cores
    assert threads.choose_threads()[0] == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "5")
    assert threads.choose_threads() == (5, "OMP_NUM_THREADS=5 is set")
    monkeypatch.setenv("OMP_NUM_THREADS", "0")  # not a thread count: ignored, MKL's is next
    monkeypatch.setenv("MKL_NUM_THREADS", "2")
    assert threads.choose_threads() == (2, "MKL_NUM_THREADS=2 is set")


@pytest.mark.parametrize("cpu_max, cpus", [("200000 100000\n", 2.0), ("150000 100000", 1.5), ("max 100000", None),
                                           ("", None), ("junk", None), (None, None)])
def test_cgroup_quota_is_read_from_cpu_max(tmp_path, cpu_max, cpus):
    path = tmp_path / "cpu.max"
    if cpu_max is not None:
        path.write_text(cpu_max)
    assert threads.cgroup_quota(path) == cpus
