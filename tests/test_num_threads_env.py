"""MHA_EXT_NUM_THREADS sets the pool's default thread count (read once, at
first use); an invalid value is ignored; OMP_NUM_THREADS is not read.

Each case runs in a fresh interpreter: the default is fixed at first use.
"""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CPUS = min(len(os.sched_getaffinity(0)), 256)


def threads_in_child(env_update):
    env = {k: v for k, v in os.environ.items()
           if k not in ("MHA_EXT_NUM_THREADS", "OMP_NUM_THREADS")}
    env.update(env_update)
    code = "import mha_ext; print(mha_ext.get_num_threads())"
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    return int(run.stdout.strip())


@pytest.mark.parametrize("value,want", [("3", 3), ("1", 1), (" 5", 5), ("7\n", 7),
                                        ("100000", 256), ("9223372036854775808", 256),
                                        ("99999999999999999999", 256)])
def test_env_sets_default(value, want):
    assert threads_in_child({"MHA_EXT_NUM_THREADS": value}) == want


@pytest.mark.parametrize("value", ["", "0", "-2", "two", "3x", "2.5",
                                   "-99999999999999999999"])
def test_invalid_env_ignored(value):
    assert threads_in_child({"MHA_EXT_NUM_THREADS": value}) == CPUS


def test_unset_is_cpus_and_omp_not_read():
    assert threads_in_child({}) == CPUS
    assert threads_in_child({"OMP_NUM_THREADS": "5"}) == CPUS
    assert threads_in_child({"OMP_NUM_THREADS": "5", "MHA_EXT_NUM_THREADS": "3"}) == 3


def test_set_num_threads_overrides_env():
    env = {k: v for k, v in os.environ.items() if k != "MHA_EXT_NUM_THREADS"}
    env["MHA_EXT_NUM_THREADS"] = "3"
    code = ("import mha_ext; mha_ext.set_num_threads(2); print(mha_ext.get_num_threads())")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "2"
