"""Differential fuzz under MPI: a seeded random sequence of calls, the same on every rank,
each compared with comm.Allreduce. The seed is fixed (not hypothesis, which would draw a
different sequence on each rank), so a failure replays exactly."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import assert_matches_native, contribution
from mpi4py import MPI
from test_allreduce_mpi import OPS, VALID

import mpiallreduce as mar
from mpiallreduce import executor

pytestmark = pytest.mark.mpi

SEED = 20260606
CALLS = 250
CHOICES = ([(name, dtype) for name, dtypes in VALID.items() for dtype in dtypes]
           + [("AVG", dtype) for dtype in ("float32", "float64", "complex64", "complex128")])


def _calls(p: int, seed: int):
    """Yield (algorithm, op name, dtype, count, in_place): a function of the seed and p only."""
    rng = np.random.default_rng([seed, p])
    for _ in range(CALLS):
        op_name, dtype = CHOICES[rng.integers(len(CHOICES))]
        algorithm = mar.ALGORITHMS[rng.integers(len(mar.ALGORITHMS))]
        if rng.random() < 0.5:
            count = int(rng.choice([0, 1, max(p - 1, 0), p, p + 1, 2 * p + 1]))
        else:
            count = int(rng.integers(0, 3000))
        yield algorithm, op_name, dtype, count, bool(rng.integers(2))


def _check(comm, algorithm, op_name, dtype, count, in_place, index):
    x = contribution(comm, count, dtype, "SUM" if op_name == "AVG" else op_name, seed=index)
    op = mar.AVG if op_name == "AVG" else OPS[op_name]
    if in_place:
        out = x.copy()
        assert mar.allreduce(MPI.IN_PLACE, out, op=op, comm=comm, algorithm=algorithm) is out
    else:
        out = mar.allreduce(x, op=op, comm=comm, algorithm=algorithm)
    assert_matches_native(comm, x, out, MPI.SUM if op_name == "AVG" else op,
                          average=op_name == "AVG")


def test_random_calls_match_native():
    comm = MPI.COMM_WORLD
    for index, call in enumerate(_calls(comm.size, SEED)):
        try:
            _check(comm, *call, index)
        except AssertionError as exc:
            raise AssertionError(f"call {index} (algorithm, op, dtype, count, in place) = "
                                 f"{call}: {exc}") from None


@pytest.mark.parametrize("algorithm", mar.ALGORITHMS)
def test_messages_over_the_size_limit_travel_in_pieces(monkeypatch, algorithm):
    """The executor splits ranges longer than MAX_MESSAGE (the 2**31 int-count limit, here 7)."""
    monkeypatch.setattr(executor, "MAX_MESSAGE", 7)
    comm = MPI.COMM_WORLD
    for count in (6, 7, 8, 50 * comm.size + 3):
        x = contribution(comm, count, "int64")
        for p in (mar.plan(x, comm=comm, algorithm=algorithm),
                  mar.plan(x, comm=comm, algorithm=algorithm, timeout=60)):
            with p:
                assert_matches_native(comm, x, p.run(), MPI.SUM)
        out = x.copy()
        mar.allreduce(MPI.IN_PLACE, out, comm=comm, algorithm=algorithm)
        assert_matches_native(comm, x, out, MPI.SUM)
