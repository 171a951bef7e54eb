"""Reductions follow IEEE arithmetic as MPI's do: a float sum past the largest float is an
infinity, inf + -inf is NaN, with no NumPy warning and no FloatingPointError whatever the
caller's NumPy error state (which mpiallreduce leaves as it found it). Every algorithm, in and
out of place, on every regime (shm's scalar, small and chunked paths, node phases), against
comm.Allreduce on every rank."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from conftest import assert_on_every_rank
from mpi4py import MPI

import mpiallreduce as mar
from mpiallreduce import shm
from mpiallreduce.topology import Topology

pytestmark = pytest.mark.mpi

#: (dtype, op, count, what every rank contributes): sums and products past the largest
#: float (overflow), +inf against -inf (invalid: NaN), on one element (shm's Python-float
#: path), a vector, and one past the small regime (shm's chunked large regime)
CASES = [
    ("float64", "SUM", 1000, "huge"),  # the np.full(1000, 1e308)
    ("float64", "SUM", 1, "huge"),
    ("float64", "PROD", 7, "huge"),
    ("float64", "AVG", 1000, "huge"),
    ("float32", "SUM", 2, "huge"),
    ("float32", "SUM", 1000, "huge"),
    ("complex128", "SUM", 5, "huge"),
    ("float64", "SUM", 33, "opposite infinities"),
    ("float64", "SUM", shm.SMALL_BYTES_TWO_RANKS // 8 + 1001, "huge"),
]


def _input(comm, dtype: str, count: int, kind: str) -> np.ndarray:
    dtype = np.dtype(dtype)
    if kind == "opposite infinities":  # rank 0 +inf, rank 1 -inf: NaN from two ranks on
        value = (np.inf, -np.inf)[comm.rank % 2] if comm.rank < 2 else 1.0
        return np.full(count, value, dtype=dtype)
    big = np.finfo(dtype).max / 2 * 1.5  # any two of them overflow
    return np.full(count, big * (1 + 1j) if dtype.kind == "c" else big, dtype=dtype)


def _reference(comm, x: np.ndarray, op_name: str) -> np.ndarray:
    ref = np.empty_like(x)
    comm.Allreduce(x, ref, op=MPI.SUM if op_name == "AVG" else getattr(MPI, op_name))
    if op_name == "AVG":
        ref /= comm.size
    return ref


def _params(algorithm: str, comm) -> dict:
    if algorithm in ("hierarchical", "cascade") and comm.size > 1:
        # simulated nodes of 2 with shared memory inside: the node phases' reductions
        return {"topology": Topology.simulated(comm, 2), "intra": "shm"}
    return {}


def _run(comm, algorithm: str, x: np.ndarray, op_name: str, in_place: bool) -> np.ndarray:
    op = mar.AVG if op_name == "AVG" else getattr(MPI, op_name)
    params = _params(algorithm, comm)
    if in_place:
        buf = x.copy()
        mar.allreduce(MPI.IN_PLACE, buf, op=op, comm=comm, algorithm=algorithm, **params)
        return buf
    return mar.allreduce(x, np.empty_like(x), op=op, comm=comm, algorithm=algorithm, **params)


@pytest.mark.parametrize("in_place", [False, True], ids=["out_of_place", "in_place"])
@pytest.mark.parametrize("algorithm", mar.ALGORITHMS)
def test_overflow_is_infinity_without_a_warning(algorithm, in_place):
    """Each case twice (the second call finds its cached plan: the bound hot path)."""
    comm = MPI.COMM_WORLD
    state = np.geterr()
    problems = []
    for dtype, op_name, count, kind in CASES:
        x = _input(comm, dtype, count, kind)
        ref = _reference(comm, x, op_name)
        for _ in range(2):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                out = _run(comm, algorithm, x, op_name, in_place)
            case = f"rank {comm.rank}: {dtype} {op_name} of {count} ({kind})"
            if caught:
                problems.append(f"{case}: warned {[str(w.message) for w in caught][:3]}")
            if not np.array_equal(out, ref, equal_nan=True):
                problems.append(f"{case}: {out[:2]} where comm.Allreduce gives {ref[:2]}")
    if np.geterr() != state:
        problems.append(f"rank {comm.rank}: NumPy's error state changed to {np.geterr()}")
    assert_on_every_rank(comm, "; ".join(problems) or None)


@pytest.mark.parametrize("algorithm", ["ring", "shm", "recursive_doubling", "native", "auto"])
def test_no_floating_point_error_where_the_caller_raises_on_overflow(algorithm):
    """A caller's ``np.errstate(all="raise")`` does not reach the reductions (MPI's never
    raise), and holds again after the call."""
    comm = MPI.COMM_WORLD
    problems = []
    for dtype, op_name, count, kind in CASES:
        x = _input(comm, dtype, count, kind)
        ref = _reference(comm, x, op_name)
        with np.errstate(all="raise"):
            out = _run(comm, algorithm, x, op_name, False)
            still = np.geterr()["over"] == "raise"
        if not np.array_equal(out, ref, equal_nan=True):
            problems.append(f"rank {comm.rank}: {dtype} {op_name}: {out[:2]} vs {ref[:2]}")
        if not still:
            problems.append(f"rank {comm.rank}: the caller's error state was changed")
    assert_on_every_rank(comm, "; ".join(problems) or None)
