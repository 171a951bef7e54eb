"""A rank that raises, or is killed, ends the whole job: mpirun exits non-zero, never hangs.

These tests launch their own ``mpirun`` in a subprocess, so they are serial tests (no ``mpi``
mark): they run once, in the serial pass of ``make test``, not under every rank count.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import time

import pytest

import mpiallreduce as mar

WORKER = pathlib.Path(__file__).resolve().parent / "workers" / "crash.py"
MPIRUN = pathlib.Path(sys.executable).parent / "mpirun"
LIMIT = 60  # seconds: the job must be over by then
OPEN_MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
                "PRTE_MCA_rmaps_default_mapping_policy": ":oversubscribe"}

pytestmark = pytest.mark.skipif(not MPIRUN.exists(), reason=f"no mpirun next to {sys.executable}")


def _environment() -> dict:
    # Drop what this (singleton MPI) process inherited from any launcher, keep the rest.
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "PMIX_", "PRTE_", "OPAL_"))}
    return {**env, **OPEN_MPI_ENV}


def _run(*args, nranks=3):
    start = time.monotonic()
    done = subprocess.run([str(MPIRUN), "-n", str(nranks), sys.executable, "-m", "mpi4py",
                           str(WORKER), *args], env=_environment(), capture_output=True,
                          text=True, timeout=LIMIT)
    return done, time.monotonic() - start


def test_the_worker_completes_when_no_rank_fails():
    done, _ = _run("none")
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("no rank failed") == 3


@pytest.mark.parametrize("algorithm", ["ring", "native"])
@pytest.mark.parametrize("how", ["raise", "kill"])
def test_a_failing_rank_ends_the_job(how, algorithm):
    assert algorithm in mar.ALGORITHMS
    done, elapsed = _run(how, algorithm)  # subprocess.TimeoutExpired fails the test
    output = done.stdout + done.stderr
    assert f"rank 1 fails ({how}) at call 10" in output
    assert done.returncode != 0, output
    assert "no rank failed" not in output
    assert elapsed < LIMIT
