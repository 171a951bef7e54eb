"""``python -m mpiallreduce`` prints what the package sees and exits 0, alone and under mpirun."""

from __future__ import annotations

import subprocess
import sys

from conftest import MPIRUN, launcher_environment, needs_mpirun
from mpi4py import MPI

import mpiallreduce as mar
from mpiallreduce import ops


def _check(text: str, ranks: int, nodes: str) -> None:
    assert text.startswith(f"mpiallreduce {mar.__version__} "), text
    assert f"mpi4py {__import__('mpi4py').__version__}" in text
    assert "MPI library: " + MPI.Get_library_version().split()[0] in text
    alone = " (one process, no launcher: launch under mpirun -n N for more)" if ranks == 1 else ""
    assert f"ranks: {ranks}{alone}; nodes: {nodes}" in text
    assert "thread level: " in text
    assert "auto: built-in rules" in text or "auto: tuning table " in text
    deviates = any(ops.native_deviates("SUM", d) for d in ops.NARROW_INTS)
    assert ("native deviations: saturating SUM on int8" in text) == deviates, text


def test_alone():
    done = subprocess.run([sys.executable, "-m", "mpiallreduce"], capture_output=True, text=True,
                          timeout=120, env=launcher_environment())
    assert done.returncode == 0, done.stderr
    _check(done.stdout, 1, "1 of 1 rank(s)")


def test_a_missing_tuning_table_says_the_built_in_rules_are_used(tmp_path):
    env = {**launcher_environment(), "MPIALLREDUCE_TUNING": str(tmp_path / "none.json")}
    done = subprocess.run([sys.executable, "-m", "mpiallreduce"], capture_output=True, text=True,
                          timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    assert f"auto: built-in rules (no tuning table at {tmp_path / 'none.json'}" in done.stdout


@needs_mpirun
def test_under_mpirun_with_simulated_nodes():
    env = {**launcher_environment(), "MPIALLREDUCE_RANKS_PER_NODE": "2"}
    done = subprocess.run([str(MPIRUN), "-n", "3", sys.executable, "-m", "mpi4py", "-m",
                           "mpiallreduce"], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("mpiallreduce ") == 1  # rank 0 alone prints
    _check(done.stdout, 3, "2 of 2+1 rank(s) (simulated")


def test_arguments_are_refused():
    done = subprocess.run([sys.executable, "-m", "mpiallreduce", "--bogus"], capture_output=True,
                          text=True, timeout=120, env=launcher_environment())
    assert done.returncode == 2 and "takes no arguments" in done.stderr
