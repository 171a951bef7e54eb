"""A short soak (``scripts/soak.py``): mixed calls through every algorithm and entry point, then
communicators made, used and freed; every result exact on every rank, and nothing left behind
(resident memory within a bound, shared windows and mappings, threads and caches back where
they were).
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import load_file
from mpi4py import MPI

pytestmark = pytest.mark.mpi

soak = load_file("scripts/soak.py", "soak")

CALLS = 2000
COMMS = 200
SEED = 3


def test_mixed_calls_and_many_communicators_leak_nothing():
    comm = MPI.COMM_WORLD.Dup()  # its windows and plans are this test's alone
    start = soak.snapshot(comm)
    rng = np.random.default_rng(SEED)
    inputs = soak.Inputs(SEED)
    wrappers: dict = {}
    problems = soak.gather_problems(comm, soak.warm_up(comm, inputs, wrappers))
    warm = soak.snapshot(comm)
    problems += soak.soak_calls(comm, CALLS, rng, inputs, wrappers, reports=4)
    before_comms = soak.snapshot(comm)
    problems += soak.soak_comms(comm, COMMS, rng, inputs, reports=4)
    soak.settle()
    end = soak.snapshot(comm)
    # every list here is every rank's (gathered): the asserts fail alike on every rank
    assert not problems, "\n".join(problems)
    assert not soak.growth(warm, before_comms, end), (warm, before_comms, end)

    wrappers.clear()
    comm.Free()
    freed = soak.snapshot(MPI.COMM_WORLD)
    assert (freed["nodes"], freed["windows"]) <= (start["nodes"], start["windows"]), (start, freed)
    assert freed["maps"] <= start["maps"], (start, freed)
