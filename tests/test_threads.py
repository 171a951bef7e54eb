"""Threads calling mpiallreduce at each MPI thread level (subprocess mpirun, since the thread
level is fixed when MPI starts; the cases are in ``workers/threads.py``).

Under ``MPI_THREAD_MULTIPLE`` (mpi4py's default) threads on distinct communicators at the same
time, and requests waited in another thread than the one that started them, give exact results.
Below it, a second thread's call (a one-shot call, a plan's run, a request's wait) must raise a
clear ``RuntimeError`` naming the thread level and ``MPI_THREAD_MULTIPLE`` instead of running
MPI from a thread the level does not allow, and the first thread's calls must go on unharmed.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest
from conftest import MPIRUN, launcher_environment, needs_mpirun

WORKER = pathlib.Path(__file__).resolve().parent / "workers" / "threads.py"

pytestmark = needs_mpirun


def run_worker(level: str) -> tuple[subprocess.CompletedProcess, str]:
    command = ["timeout", "150", str(MPIRUN), "-n", "2", sys.executable, "-m", "mpi4py",
               str(WORKER), level]
    # osc/ucx off, as the README and the Makefile set it: where UCX finds no network device,
    # Open MPI 5.0's osc/ucx query (run at every Win.Allocate_shared) is not thread-safe, and
    # threads making their first shared windows at once crash in ucp_cleanup (SIGSEGV/SIGABRT)
    env = {**launcher_environment(), "OMPI_MCA_osc": "^ucx"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=180)
    return done, done.stdout + done.stderr


def assert_every_case_passed(done: subprocess.CompletedProcess, output: str, cases: int):
    failures = [line for line in done.stdout.splitlines() if line.startswith("FAIL")]
    assert not failures, "\n".join(failures)
    assert done.returncode == 0, output
    assert done.stdout.count("DONE") == 2, output
    assert done.stdout.count("OK ") == 2 * cases, output


def test_threads_on_distinct_communicators_and_requests_across_threads():
    assert_every_case_passed(*run_worker("multiple"), cases=2)


@pytest.mark.parametrize("level", ["single", "funneled", "serialized"])
def test_a_second_threads_call_is_refused_below_thread_multiple(level):
    assert_every_case_passed(*run_worker(level), cases=6)
