"""Requests at every MPI thread level: test() never blocks, wait(timeout) honours its timeout
(subprocess mpirun, since the thread level is fixed when MPI starts).

Without MPI_THREAD_MULTIPLE, ``test()`` must not run a queued schedule to completion (which
would block until the late ranks arrived), and ``wait(timeout)`` must still honour its
timeout.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest
from conftest import MPIRUN, launcher_environment, needs_mpirun

WORKER = pathlib.Path(__file__).resolve().parent / "workers" / "nonblocking_levels.py"

pytestmark = needs_mpirun


@pytest.mark.parametrize("level", ["single", "serialized", "multiple"])
def test_requests_progress_at_every_thread_level(level):
    command = ["timeout", "120", str(MPIRUN), "-n", "2", sys.executable, "-m", "mpi4py",
               str(WORKER), level]
    done = subprocess.run(command, env=launcher_environment(), capture_output=True, text=True,
                          timeout=150)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert done.stdout.count("DONE") == 2, output
    assert "FAIL" not in done.stdout, output
    assert done.stdout.count("OK ") >= 8, output
