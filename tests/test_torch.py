"""PyTorch jobs in which a rank fails inside the DDP hook end, non-zero, with the error: never a
hang. Each launches its own ``mpirun`` (a serial test, run once); skipped without torch. (That
the worker trains when no rank fails is test_torch_mpi.py's DDP tests, in process: each job
here costs a torch start-up, tens of seconds on a loaded machine.)"""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest
from conftest import MPIRUN, launcher_environment, needs_mpirun

pytest.importorskip("torch")

WORKER = pathlib.Path(__file__).resolve().parent / "workers" / "torch_fail.py"
#: seconds after which the job counts as hung (subprocess.TimeoutExpired fails the test)
LIMIT = 300

pytestmark = needs_mpirun


def _run(how, *launch):
    return subprocess.run([str(MPIRUN), "-n", "2", sys.executable, *launch, str(WORKER), how],
                          env=launcher_environment(), capture_output=True, text=True,
                          timeout=LIMIT)


def test_a_rank_raising_in_the_hook_ends_the_job():
    done = _run("raise", "-m", "mpi4py")  # subprocess.TimeoutExpired (a hang) fails the test
    output = done.stdout + done.stderr
    assert "rank 1 fails in the hook at step 3" in output
    assert "RuntimeError: rank 1 fails in the hook" in output
    assert done.returncode != 0, output
    assert "no rank failed" not in output


def test_a_failed_reduction_aborts_the_job_without_mpi4py_s_handler():
    done = _run("mismatch")
    output = done.stdout + done.stderr
    assert "the reduction of gradient bucket 0 failed: ValueError" in output, output
    assert "aborting the job" in output
    assert done.returncode != 0, output
    assert "no rank failed" not in output
