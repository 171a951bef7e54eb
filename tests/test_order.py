"""Plans run in different orders on different ranks never exchange data (subprocess mpirun).

Without a timeout they wait, as mis-ordered MPI collectives do (the job is killed here after a
few seconds, having printed no result); with one, every rank raises CollectiveTimeout naming
the likely cause. Before slots per plan, rank 0 got A=111, B=102 and rank 1 A=102, B=111.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest
from conftest import MPIRUN, launcher_environment, needs_mpirun

WORKER = pathlib.Path(__file__).resolve().parent / "workers" / "misordered.py"

pytestmark = needs_mpirun


def _run(*args, limit):
    command = ["timeout", str(limit), str(MPIRUN), "-n", "2", sys.executable, "-m", "mpi4py",
               str(WORKER), *args]
    return subprocess.run(command, env=launcher_environment(), capture_output=True, text=True,
                          timeout=limit + 30)


@pytest.mark.parametrize("algorithm", ["recursive_doubling", "native"])
def test_misordered_plans_wait_without_a_timeout(algorithm):
    done = _run(algorithm, limit=6)
    assert done.returncode == 124, done.stdout + done.stderr  # still waiting when killed
    assert "RESULT" not in done.stdout


@pytest.mark.parametrize("algorithm", ["recursive_doubling", "native"])
def test_misordered_plans_time_out_on_every_rank(algorithm):
    done = _run(algorithm, "1.0", limit=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "RESULT" not in done.stdout
    # the ranks' lines may arrive interleaved (MPICH's launcher forwards output unbuffered)
    reports = sorted(part for part in done.stdout.split("TIMEOUT rank ")[1:])
    assert len(reports) == 2, done.stdout
    for rank, report in enumerate(reports):
        assert report.startswith(f"{rank}: "), report
        assert "ranks run plans or calls on this communicator in different orders" in report
