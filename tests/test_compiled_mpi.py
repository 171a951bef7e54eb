"""The compiled and the pure-Python call path give the same bits and the same errors.

Run in either form (``MPIALLREDUCE_COMPILED=0`` selects Python; ``make test`` runs these files
in both): every case here is checked against a reference computed from every rank's input in
rank order with NumPy (the Python form's own arithmetic), so both forms meet the same bits."""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

import mpiallreduce as mar
from mpiallreduce import _form

pytestmark = pytest.mark.mpi

#: inputs whose sum and product depend on the order of the operations (rounding), with signed
#: zeros, infinities and a NaN where asked
SPECIAL = [0.0, -0.0, 1e16, -1e16, 1.0, 3.0, 1e-300, 7.5, np.inf]


def _inputs(comm, count: int, dtype, special: bool) -> np.ndarray:
    rng = np.random.default_rng(1234 + 17 * comm.rank + count)
    x = (rng.standard_normal(count) * 10.0 ** rng.integers(-8, 9, count)).astype(dtype)
    if special:
        x[: len(SPECIAL)] = np.array(SPECIAL[:count], dtype=dtype)[: min(count, len(SPECIAL))]
        if comm.rank == comm.size - 1 and count > 2:
            x[2] = np.nan
    return x


def _reference(comm, x: np.ndarray, op: str) -> np.ndarray:
    """Every rank's input combined in rank order, one ufunc call per rank (the Python form)."""
    every = comm.allgather(x)
    total = every[0].copy()
    ufunc = {"PROD": np.multiply, "MAX": np.maximum}.get(op, np.add)
    for theirs in every[1:]:
        ufunc(total, theirs, out=total)
    if op == "AVG":
        np.divide(total, comm.size, out=total)
    return total


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.tobytes() == b.tobytes()


CASES = [("SUM", "float64"), ("AVG", "float64"), ("PROD", "float64"), ("SUM", "float32"),
         ("PROD", "float32"), ("SUM", "int64"), ("MAX", "float64")]


@pytest.mark.parametrize("op_name, dtype", CASES)
@pytest.mark.parametrize("count", [1, 2, 9, 1000])
def test_repeated_calls_give_rank_order_bits(op_name, dtype, count):
    """The first call binds, the next ones hit the cache (the compiled run where it is built),
    with and without a timeout, in place and out: every one gives the reference's bits. (shm:
    ``auto`` may pick a schedule that combines in another order where ranks outnumber cores.)"""
    comm = MPI.COMM_WORLD
    algorithm = "shm"
    op = mar.AVG if op_name == "AVG" else getattr(MPI, op_name)
    verdicts = []
    for special in (False, True):
        x = _inputs(comm, count, dtype, special and np.dtype(dtype).kind == "f")
        expected = _reference(comm, x, op_name)
        out = np.empty_like(x)
        inplace = np.empty_like(x)
        for timeout in (None, None, 30.0, None, 30.0):
            mar.allreduce(x, out, op=op, comm=comm, algorithm=algorithm, timeout=timeout)
            inplace[...] = x
            mar.allreduce(MPI.IN_PLACE, inplace, op=op, comm=comm, algorithm=algorithm,
                          timeout=timeout)
            verdicts.append(_same_bits(out, expected) and _same_bits(inplace, expected))
    everyone = comm.allgather(all(verdicts))
    assert all(everyone), f"ranks whose bits differ: {[r for r, ok in enumerate(everyone) if not ok]}"


def test_a_count_that_differs_raises_the_same_error_on_every_rank():
    """A repeated call whose count differs on one rank: the same ValueError everywhere (the
    compiled run's slow path is the Python form's)."""
    comm = MPI.COMM_WORLD
    if comm.size < 2:
        pytest.skip("needs two ranks")  # (uniform across ranks: the size is the world's)
    x, out = np.ones(4), np.empty(4)
    for _ in range(3):
        mar.allreduce(x, out, comm=comm, algorithm="shm")
    y, other = (np.ones(5), np.empty(5)) if comm.rank == 0 else (x, out)
    try:
        mar.allreduce(y, other, comm=comm, algorithm="shm")
        message = None
    except ValueError as exc:
        message = str(exc)
    messages = comm.allgather(message)
    assert messages[0] is not None and len(set(messages)) == 1, messages


def test_the_form_is_the_one_selected():
    """``MPIALLREDUCE_COMPILED=0`` selects Python; otherwise the compiled form where built."""
    import os

    if os.environ.get(_form.ENV, "1") == "0":
        assert _form.compiled is None
        assert mar.allreduce.__module__ == "mpiallreduce.api"
    elif _form.compiled is not None:
        assert mar.allreduce is _form.compiled.allreduce


def test_a_repeated_small_shm_call_runs_compiled_where_built():
    """Where the compiled form is active, a repeated 8-byte shm call's cache entry runs
    ``_compiled.SmallRun`` (with and without a timeout); in the Python form, the closures."""
    comm = MPI.COMM_WORLD
    if comm.size < 2:
        pytest.skip("one rank runs no shm epoch")  # (uniform across ranks)
    from mpiallreduce import _state

    x, out = np.ones(1), np.empty(1)
    for _ in range(2):
        mar.allreduce(x, out, comm=comm, algorithm="shm")
    entry = _state.LAST[id(out)]
    compiled = _form.compiled is not None
    kinds = {type(entry.direct).__name__, type(entry.timed).__name__}
    assert kinds == ({"SmallRun"} if compiled else {"function"}), kinds
    assert out[0] == comm.size
