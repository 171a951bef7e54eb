"""mar.Comm's first call on a new case runs MPI's collective; a case called again gets a plan.

Every rank must take the same path for the same call whatever its caches hold, so each test
compares every rank's result with ``comm.Allreduce`` and gathers verdicts before asserting;
the mismatch tests run under a watchdog that aborts the job rather than let it hang.
"""

from __future__ import annotations

import contextlib
import threading

import numpy as np
import pytest
from conftest import assert_matches_native, assert_on_every_rank, awkward_counts, contribution
from mpi4py import MPI

import mpiallreduce as mar
from mpiallreduce import _state, select
from mpiallreduce import comm as comm_module

pytestmark = pytest.mark.mpi

#: seconds a mismatch test may take before the watchdog aborts the job (a hang)
HANG = 60.0


@pytest.fixture
def world():
    comm = MPI.COMM_WORLD.Dup()
    yield comm
    comm.Free()


@pytest.fixture
def routed(monkeypatch):
    """The calls mar.Comm hands to mar.allreduce (which binds or finds a plan), counted."""
    calls = []
    real = comm_module.allreduce
    monkeypatch.setattr(comm_module, "allreduce",
                        lambda *args, **kwargs: calls.append(args[1].size) or real(*args, **kwargs))
    return calls


@contextlib.contextmanager
def watchdog(seconds: float = HANG):
    """Abort the whole job if the block has not ended within ``seconds`` (a hang)."""
    timer = threading.Timer(seconds, lambda: MPI.COMM_WORLD.Abort(3))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def _entries(comm) -> int:
    state = _state.existing(comm)
    return 0 if state is None else len(state.calls.entries)


@pytest.mark.parametrize("dtype", ["float64", "complex128", "int32"])
@pytest.mark.parametrize("in_place", [False, True])
def test_new_counts_match_mpi_on_every_rank(world, routed, dtype, in_place):
    comm = mar.Comm(world)
    counts = awkward_counts(world.size)
    for count in counts:
        x = contribution(world, count, dtype)
        if in_place:
            out = x.copy()
            comm.Allreduce(MPI.IN_PLACE, out, op=MPI.SUM)
        else:
            out = np.empty_like(x)
            comm.Allreduce(x, out, op=MPI.SUM)
        assert_matches_native(world, x, out, MPI.SUM)
    assert routed == []  # each case once: MPI's collective ran every call, no plan was bound
    assert _entries(world) == 0


@pytest.mark.parametrize("reuse", [True, False])
def test_the_second_call_of_a_case_binds_a_plan(world, routed, reuse):
    comm = mar.Comm(world)
    x = contribution(world, 37, "float64")
    out = np.empty_like(x)
    for call in range(4):
        send, recv = (x, out) if reuse else (x.copy(), np.empty_like(x))
        comm.Allreduce(send, recv, op=MPI.SUM)
        assert_matches_native(world, x, recv, MPI.SUM)
        if call == 0:
            assert routed == [] and _entries(world) == 0
        if call == 1:
            assert routed == [37] and _entries(world) == 1
    assert _entries(world) == 1  # later calls found what the second bound (arrays or shape)


def test_another_dtype_or_op_is_another_case(world, routed):
    comm = mar.Comm(world)
    for dtype, op in (("float64", MPI.SUM), ("float32", MPI.SUM), ("float64", MPI.MAX),
                      ("float64", MPI.SUM)):
        x = contribution(world, 9, dtype)
        out = np.empty_like(x)
        comm.Allreduce(x, out, op=op)
        assert_matches_native(world, x, out, op)
    assert routed == [9]  # only the repeated (9, float64, SUM)


def test_ranks_with_different_caches_take_the_same_path(world):
    """Rank 0 reuses its arrays, the others pass fresh ones: their caches differ, their
    paths may not."""
    comm = mar.Comm(world)
    kept = {}
    for count in [1, 2, 5, 1, 2, 7, 5, 1, 64, 7, 64, 64, 2, 1000, 1000, 3, 1000]:
        x = contribution(world, count, "float64", seed=count)
        if world.rank == 0:
            send, out = kept.setdefault(count, (x.copy(), np.empty_like(x)))
            send[:] = x
        else:
            send, out = x, np.empty_like(x)
        comm.Allreduce(send, out, op=MPI.SUM)
        assert_matches_native(world, x, out, MPI.SUM)


def test_past_the_bound_every_rank_forgets_alike(world, monkeypatch, routed):
    monkeypatch.setattr(comm_module, "CASES", 3)
    comm = mar.Comm(world)
    kept = {}
    for count in [1, 1, 2, 3, 4, 1, 1, 5, 2, 2]:
        x = contribution(world, count, "int64")
        send, out = kept.setdefault(count, (x, np.empty_like(x))) if world.rank == 0 \
            else (x, np.empty_like(x))
        comm.Allreduce(send, out, op=MPI.SUM)
        assert_matches_native(world, x, out, MPI.SUM)
    # 1 again: bound; 4 forgets 1, 2 and 3, so 1 is new again, then bound; 2 forgets 4, 1
    # and 5, so it is new, then bound
    assert routed == [1, 1, 2]


@pytest.mark.parametrize("cases", [4096, 2])
def test_ranks_calling_through_different_objects_count_together(world, monkeypatch, cases):
    """Two mar.Comm objects of one communicator, each rank calling through either (its arrays
    reused per object, so each object remembers calls): the count is the communicator's, and
    forgetting it (``cases`` bounds it) forgets what both objects remember."""
    monkeypatch.setattr(comm_module, "CASES", cases)
    objects = (mar.Comm(world), mar.Comm(world))
    kept = {}
    for step, count in enumerate([3, 3, 4, 3, 4, 4, 5, 3, 3, 4, 4, 4]):
        x = contribution(world, count, "float64", seed=step)
        which = (world.rank + step) % 2
        send, out = kept.setdefault((which, count), (x.copy(), np.empty_like(x)))
        send[:] = x
        objects[which].Allreduce(send, out, op=MPI.SUM)
        assert_matches_native(world, x, out, MPI.SUM)


@pytest.mark.parametrize("dtype", ["complex64", "complex128"])
@pytest.mark.parametrize("op", [MPI.SUM, MPI.PROD], ids=["SUM", "PROD"])
@pytest.mark.parametrize("spec", ["array", "datatype"])
def test_complex_sums_and_products_run_the_librarys_plan(world, routed, dtype, op, spec):
    comm = mar.Comm(world)
    x = contribution(world, 23, dtype, "PROD" if op == MPI.PROD else "SUM")
    out = np.empty_like(x)
    datatype = MPI.C_DOUBLE_COMPLEX if dtype == "complex128" else MPI.C_FLOAT_COMPLEX
    for _ in range(3):
        if spec == "array":
            comm.Allreduce(x, out, op=op)
        else:
            comm.Allreduce([x, datatype], [out, datatype], op=op)
        assert_matches_native(world, x, out, op)
    assert routed and routed[0] == 23  # the second call went to mpiallreduce's plan


@pytest.mark.parametrize("name", ["COMPLEX", "DOUBLE_COMPLEX"])
def test_fortran_complex_datatypes_run_the_librarys_plan(world, routed, name):
    datatype = getattr(MPI, name, MPI.DATATYPE_NULL)
    if datatype == MPI.DATATYPE_NULL or datatype.Get_size() not in (8, 16):
        pytest.skip(f"this MPI has no MPI.{name}")
    dtype = "complex64" if datatype.Get_size() == 8 else "complex128"
    comm = mar.Comm(world)
    x = contribution(world, 17, dtype)
    out = np.empty_like(x)
    for _ in range(2):
        comm.Allreduce([x, datatype], [out, datatype], op=MPI.SUM)
        assert_matches_native(world, x, out, MPI.SUM)
    assert routed == [17]


def _raises_on_every_rank(world, call) -> None:
    with watchdog():
        try:
            call()
        except ValueError as exc:
            problem = None if "count differs" in str(exc) else f"rank {world.rank}: {exc}"
        else:
            problem = f"rank {world.rank}: no error"
    assert_on_every_rank(world, problem)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("history", ["new", "repeated on the others"])
def test_mismatched_counts_raise_on_every_rank(world, history):
    """A first call with different counts (every rank at MPI's collective), and a rank whose
    count is new where the others' case has a plan: the same error everywhere, no hang; the
    next calls match again."""
    comm = mar.Comm(world)
    x = contribution(world, 10, "float64")
    out = np.empty_like(x)
    if history != "new":
        for _ in range(3):
            comm.Allreduce(x, out, op=MPI.SUM)
    odd = np.ones(10 + (world.rank == 1))
    _raises_on_every_rank(world, lambda: comm.Allreduce(odd, np.empty_like(odd), op=MPI.SUM))
    with watchdog():
        for _ in range(3):
            comm.Allreduce(x, out, op=MPI.SUM)
            assert_matches_native(world, x, out, MPI.SUM)
            y = contribution(world, 11, "float64")
            comm.Allreduce(y, np.empty_like(y), op=MPI.SUM)


@pytest.mark.mpi(min_size=2)
def test_an_unviewable_buffer_on_one_rank_sends_every_rank_to_mpi_alike(world):
    """One rank's buffer NumPy cannot take (a strided view): every rank goes to MPI together,
    counting nothing, and the calls after it still agree."""
    comm = mar.Comm(world)
    base = np.arange(16.0) + world.rank
    send = base[::2] if world.rank == 1 else base[:8].copy()
    out = np.empty(8)
    with watchdog():
        with contextlib.suppress(Exception):  # what MPI makes of it; the point is no hang
            comm.Allreduce(send, out, op=MPI.SUM)
        for _ in range(3):
            x = contribution(world, 8, "float64")
            comm.Allreduce(x, out, op=MPI.SUM)
            assert_matches_native(world, x, out, MPI.SUM)


def test_an_explicit_algorithm_binds_at_once(world, routed):
    comm = mar.Comm(world, "ring")
    x = contribution(world, 5, "float64")
    out = np.empty_like(x)
    comm.Allreduce(x, out, op=MPI.SUM)
    assert_matches_native(world, x, out, MPI.SUM)
    assert routed == [5]


def test_the_settings_follow_the_environment(monkeypatch, tmp_path):
    path = str(tmp_path / "table.json")
    monkeypatch.setenv(select.TUNING_ENV, path)
    assert select.table_path() == path
    monkeypatch.setenv(select.TUNING_ENV, "off")
    assert select.table_path() is None
    monkeypatch.setenv(select.LEARN_ENV, "on")
    monkeypatch.setenv(select.LEARN_RUNS_ENV, "3")
    assert select.learn_settings() == select.LearnSettings(True, 3, select.RELEARN_EVERY)
    monkeypatch.setenv(select.LEARN_RUNS_ENV, "none")
    with pytest.raises(ValueError, match=select.LEARN_RUNS_ENV):
        select.learn_settings()
    with pytest.raises(ValueError, match=select.LEARN_RUNS_ENV):  # a bad value is never kept
        select.learn_settings()
    monkeypatch.setenv(select.LEARN_ENV, "off")
    monkeypatch.delenv(select.LEARN_RUNS_ENV)
    assert not select.learn_settings().on
    monkeypatch.delenv(select.LEARN_ENV)  # the default: on
    assert select.learn_settings() == select.LearnSettings(True, select.LEARN_RUNS,
                                                           select.RELEARN_EVERY)
