"""Plans run in different orders on different ranks never exchange data (subprocess mpirun).

Without a timeout they wait, as mis-ordered MPI collectives do (both ranks report reaching the
wait, then the job stays silent and alive for a few seconds and is killed); with one, every
rank raises naming the likely cause (CollectiveTimeout, or CommunicatorRevoked carrying the
reason of the rank that timed out first). Before slots per plan, rank 0 got
A=111, B=102 and rank 1 A=102, B=111.
"""

from __future__ import annotations

import os
import pathlib
import queue
import signal
import subprocess
import sys
import threading
import time

import pytest
from conftest import MPIRUN, launcher_environment, needs_mpirun

WORKER = pathlib.Path(__file__).resolve().parent / "workers" / "misordered.py"
#: seconds the job may take to start and reach the wait (generous: only a broken launch fails)
LAUNCH = 120
#: seconds of silence, after both ranks reached the wait, that count as a hang: a run that
#: completed would print RESULT within milliseconds
SILENCE = 3

pytestmark = needs_mpirun


def _run(*args, limit):
    command = ["timeout", str(limit), str(MPIRUN), "-n", "2", sys.executable, "-m", "mpi4py",
               str(WORKER), *args]
    return subprocess.run(command, env=launcher_environment(), capture_output=True, text=True,
                          timeout=limit + 30)


@pytest.mark.parametrize("algorithm", ["recursive_doubling", "native"])
def test_misordered_plans_wait_without_a_timeout(algorithm):
    """Both ranks reach the wait (WAITING), then the job prints nothing and stays alive: a hang,
    told apart from a slow launch because the clock starts only once both ranks are waiting."""
    job = subprocess.Popen([str(MPIRUN), "-n", "2", sys.executable, "-m", "mpi4py", str(WORKER),
                            algorithm], env=launcher_environment(), stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in job.stdout], daemon=True).start()
    seen = []
    try:
        deadline = time.monotonic() + LAUNCH
        # count in the joined text: MPICH's launcher may put both ranks' lines on one
        while "".join(seen).count("WAITING rank") < 2:
            try:
                seen.append(lines.get(timeout=max(deadline - time.monotonic(), 0.01)))
            except queue.Empty:
                pytest.fail(f"the ranks did not reach the wait in {LAUNCH} s: {seen}")
        time.sleep(SILENCE)
        while not lines.empty():
            seen.append(lines.get())
        assert job.poll() is None, f"the job ended (exit {job.returncode}): {seen}"
        assert "RESULT" not in "".join(seen), seen
    finally:  # SIGTERM first: mpirun passes it to the ranks (as `timeout` did before)
        os.killpg(job.pid, signal.SIGTERM)
        try:
            job.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()


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
