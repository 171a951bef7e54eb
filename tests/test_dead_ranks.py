"""A rank that raises, or is killed, ends the whole job: mpirun exits non-zero, never hangs.

These tests launch their own ``mpirun`` in a subprocess, so they are serial tests (no ``mpi``
mark): they run once, in the serial pass of ``make test``, not under every rank count.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest
from conftest import MPIRUN, launcher_environment, needs_mpirun

import mpiallreduce as mar

WORKER = pathlib.Path(__file__).resolve().parent / "workers" / "crash.py"
#: seconds after which the job counts as hung (subprocess.TimeoutExpired fails the test); so
#: generous that only a hang reaches it on a loaded machine: no speed is measured here
LIMIT = 300

pytestmark = needs_mpirun


def _run(*args, nranks=3):
    return subprocess.run([str(MPIRUN), "-n", str(nranks), sys.executable, "-m", "mpi4py",
                           str(WORKER), *args], env=launcher_environment(), capture_output=True,
                          text=True, timeout=LIMIT)


def test_the_worker_completes_when_no_rank_fails():
    done = _run("none")
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("no rank failed") == 3


@pytest.mark.parametrize("algorithm", ["ring", "native"])
@pytest.mark.parametrize("how", ["raise", "kill"])
def test_a_failing_rank_ends_the_job(how, algorithm):
    assert algorithm in mar.ALGORITHMS
    done = _run(how, algorithm)  # subprocess.TimeoutExpired (a hang) fails the test
    output = done.stdout + done.stderr
    assert f"rank 1 fails ({how}) at call 10" in output
    assert done.returncode != 0, output
    assert "no rank failed" not in output
