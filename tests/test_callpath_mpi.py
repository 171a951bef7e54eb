"""The one-shot call path: plan cache, order safety, timeouts everywhere, layouts, 8/16-bit sums.

Every test runs at every rank count; results are compared with comm.Allreduce or with a NumPy
reduction of every rank's input, on every rank.
"""

from __future__ import annotations

import gc
import re
import threading
import time
import weakref

import numpy as np
import pytest
from conftest import (
    GRID_KINDS,
    assert_identical_across_ranks,
    assert_matches_native,
    assert_on_every_rank,
    contribution,
    mismatch,
)
from mpi4py import MPI

import mpiallreduce as mar
from mpiallreduce import _agree, _checks, _plans, _state, ops, shm
from mpiallreduce.topology import RANKS_PER_NODE_ENV

pytestmark = pytest.mark.mpi

SCHEDULES = [name for name in mar.ALGORITHMS if name not in ("native", "auto")]
TIMEOUT = 0.3  # short: each run of this file waits it out some 50 times


def _entries(comm) -> int:
    state = _state.existing(comm)
    return 0 if state is None else len(state.calls.entries)


@pytest.fixture
def comm():
    comm = MPI.COMM_WORLD.Dup()
    yield comm
    comm.Free()


# -- the cache ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("algorithm", mar.ALGORITHMS)
def test_a_repeated_call_reuses_its_plan_and_reads_fresh_contents(comm, algorithm):
    x = contribution(comm, 37, "float64")
    out = np.empty_like(x)
    mar.allreduce(x, out, comm=comm, algorithm=algorithm)
    assert _entries(comm) == 1
    (entry,) = _state.existing(comm).calls.entries.values()
    for round_ in range(3):
        x[:] = contribution(comm, 37, "float64", seed=round_ + 1)  # new contents, same array
        mar.allreduce(x, out, comm=comm, algorithm=algorithm)
        assert_matches_native(comm, x, out, MPI.SUM)
    assert _entries(comm) == 1
    assert next(iter(_state.existing(comm).calls.entries.values())) is entry


@pytest.mark.parametrize("algorithm", ["native", "ring", "recursive_doubling"])
def test_in_place_calls_are_cached_and_correct(comm, algorithm):
    x = contribution(comm, 11, "int64")
    buf = np.empty_like(x)
    for _ in range(3):
        buf[:] = x
        mar.allreduce(MPI.IN_PLACE, buf, comm=comm, algorithm=algorithm)
        assert_matches_native(comm, x, buf, MPI.SUM)
    assert _entries(comm) == 1


def test_a_freed_buffer_cannot_be_confused_with_a_new_one(comm):
    """The cache keeps the arrays of its plans alive: a new array never gets their memory."""
    x = contribution(comm, 64, "float64")
    out = np.empty_like(x)
    mar.allreduce(x, out, comm=comm, algorithm="ring")
    kept = weakref.ref(out)
    del out
    gc.collect()
    assert kept() is not None  # still held by the cached plan, so its address is still its own
    for seed in range(4):
        y = contribution(comm, 64, "float64", seed=seed)
        fresh = np.empty_like(y)
        assert_matches_native(comm, y, mar.allreduce(y, fresh, comm=comm, algorithm="ring"),
                              MPI.SUM)
        del fresh, y


def test_a_changed_shape_or_dtype_rebinds(comm):
    x = contribution(comm, 24, "int32")
    out = np.empty_like(x)
    mar.allreduce(x, out, comm=comm, algorithm="ring")
    x.shape = out.shape = (4, 6)
    assert_matches_native(comm, x, mar.allreduce(x, out, comm=comm, algorithm="ring"), MPI.SUM)
    x.dtype = out.dtype = np.int16  # 48 elements of another type, same memory
    assert_matches_native(comm, x, mar.allreduce(x, out, comm=comm, algorithm="ring"), MPI.SUM)


def test_new_views_of_the_same_memory_are_correct(comm):
    x = contribution(comm, 30, "float32")
    out = np.zeros_like(x)
    for stop in (30, 20, 30):
        mar.allreduce(x[:stop], out[:stop], comm=comm, algorithm="tree")
        assert_matches_native(comm, x[:stop], out[:stop], MPI.SUM)


def test_the_cache_is_bounded_by_entries_and_bytes(comm, monkeypatch):
    state = _state.state(comm)
    monkeypatch.setattr(state.calls, "max_entries", 3)
    monkeypatch.setattr(state.calls, "max_bytes", 10_000)
    arrays = [contribution(comm, 50, "float64", seed=s) for s in range(6)]
    for x in arrays:
        assert_matches_native(comm, x, mar.allreduce(x, np.empty_like(x), comm=comm), MPI.SUM)
        assert len(state.calls.entries) <= 3
        assert state.calls.nbytes <= 10_000
    big = contribution(comm, 2000, "float64")  # 32 kB of buffers alone: never cached
    assert_matches_native(comm, big, mar.allreduce(big, np.empty_like(big), comm=comm), MPI.SUM)
    assert all(entry.objects[2].size == 50
               for entry in state.calls.entries.values())


@pytest.mark.parametrize("algorithm", ["shm", "ring", "native"])
@pytest.mark.parametrize("scratch_tips_it", [False, True], ids=["arrays", "scratch"])
def test_a_call_too_big_for_the_cache_builds_one_plan(comm, monkeypatch, algorithm,
                                                      scratch_tips_it):
    """A one-shot call the cache cannot keep builds its plan once, runs it, frees it, never a
    plan for the cache and then a second one to run (at 64 MiB a second build costs about as
    much as the run). Too big by its arrays alone, the cache's build is skipped; too big only
    with the plan's scratch, that plan runs once and the next calls of the shape skip it
    (built per call, its scratch fresh each time, rabenseifner in place at 64 MiB runs an order
    of magnitude slower than out of place)."""
    state = _state.state(comm)
    x = contribution(comm, 200, "float64")  # 3.2 kB of arrays
    monkeypatch.setattr(state.calls, "max_bytes", 3200 if scratch_tips_it else 1000)
    builds = []
    real = _plans.build
    monkeypatch.setattr(_plans, "build", lambda *a, **k: builds.append(k["persistent"])
                        or real(*a, **k))
    out = np.empty_like(x)
    for _ in range(5):  # the same arrays: a repeated call
        assert_matches_native(comm, x, mar.allreduce(x, out, comm=comm, algorithm=algorithm),
                              MPI.SUM)
    # at most one plan per call; of the cache's (persistent) builds, one: kept where the plan
    # has no scratch (the next calls find it), else run once and skipped from then on (a
    # schedule's call of up to 64 KiB is also remembered by its shape, whose staged plan is
    # persistent too and kept)
    if scratch_tips_it:
        scratch = algorithm == "ring" and comm.size > 1  # (one rank: the ring has none)
        assert builds == ([True, True, False, False, False] if scratch else [True]), \
            builds
    else:
        assert builds == [False] * 5, builds


def test_a_result_allocated_per_call_is_not_cached(comm):
    x = contribution(comm, 9, "float64")
    for _ in range(3):
        assert_matches_native(comm, x, mar.allreduce(x, comm=comm, algorithm="ring"), MPI.SUM)
    assert _entries(comm) == 0


@pytest.mark.parametrize("algorithm", ["auto", "native", "ring", "recursive_doubling", "shm"])
def test_a_result_left_to_mpiallreduce_is_known_by_its_shape(comm, monkeypatch, algorithm):
    """``total = mar.allreduce(local)``: from the second call the call's shape runs it instead
    of a set-up from scratch, into a new array each time, none of them held by the cache."""
    slow = []
    real = _plans.one_shot
    monkeypatch.setattr(_plans, "one_shot", lambda *a, **k: slow.append(1) or real(*a, **k))
    results, inputs = [], []
    for round_ in range(4):
        local = np.array([float(comm.rank + round_), 2.0 * comm.rank, -1.5])
        inputs.append(local.copy())
        results.append(mar.allreduce(local, comm=comm, algorithm=algorithm))
        assert np.array_equal(local, inputs[-1])
    assert len(slow) == 1
    assert len({id(out) for out in results}) == 4
    for local, out in zip(inputs, results):  # no call overwrote an earlier call's result
        assert out.shape == (3,)
        assert_matches_native(comm, local, out, MPI.SUM)
    assert _entries(comm) == 0
    matrix = contribution(comm, 12, "float64").reshape(3, 4)  # another shape of 12: its own
    for _ in range(2):
        out = mar.allreduce(matrix, comm=comm, algorithm=algorithm)
        assert out.shape == (3, 4)
        assert_matches_native(comm, matrix, out, MPI.SUM)


def test_last_finds_an_entry_for_every_recvbuf_the_cache_holds(comm):
    """One result buffer used on two communicators: freeing the one whose entry LAST held must
    leave LAST holding the other's (a miss in LAST means no entry holds the array, so a call
    there skips the full key's lookup)."""
    x = contribution(comm, 5, "float64")
    out = np.empty_like(x)
    other = MPI.COMM_WORLD.Dup()
    mar.allreduce(x, out, comm=comm, algorithm="ring")
    mar.allreduce(x, out, comm=other, algorithm="ring")
    assert _state.LAST[id(out)].objects[0] is other
    other.Free()
    found = _state.LAST.get(id(out))
    assert found is not None and found.objects[0] is comm
    for key in _state.CALLS:
        assert _state.LAST.get(key[2]) is not None
    slow = []
    real = _plans.one_shot
    try:
        _plans.one_shot = lambda *a, **k: slow.append(1) or real(*a, **k)
        assert_matches_native(comm, x, mar.allreduce(x, out, comm=comm, algorithm="ring"),
                              MPI.SUM)
    finally:
        _plans.one_shot = real
    assert slow == []


def test_freeing_the_communicator_releases_its_plans():
    comm = MPI.COMM_WORLD.Dup()
    x = contribution(comm, 9, "float64")
    out = np.empty_like(x)
    for algorithm in ("native", "ring"):
        mar.allreduce(x, out, comm=comm, algorithm=algorithm)
    keys = list(_state.existing(comm).calls.entries)
    assert all(key in _state.CALLS for key in keys)
    comm.Free()
    assert not any(key in _state.CALLS for key in keys)


def test_the_agreement_check_still_runs_on_a_cached_call(comm):
    x = contribution(comm, 10, "float64")
    out = np.empty_like(x)
    mar.allreduce(x, out, comm=comm)
    y = np.zeros(11) if comm.rank == 1 else x
    with pytest.raises(ValueError, match="count differs") if comm.size > 1 else _nothing():
        mar.allreduce(y, np.empty_like(y) if comm.rank == 1 else out, comm=comm)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# -- order safety ---------------------------------------------------------------------------------------

def _out_of_order(comm, algorithm, first_is_call=False):
    """Rank 0 runs B then A, the others A then B, each with a timeout: every rank must raise
    in its first collective (CollectiveTimeout, or CommunicatorRevoked where another rank
    timed out first), none may return a result."""
    a = np.full(4, 1.0 + comm.rank)
    b = np.full(4, 100.0 + 10 * comm.rank)
    out_a, out_b = np.empty(4), np.empty(4)
    plan_a = mar.plan(a, out_a, comm=comm, algorithm=algorithm)
    plan_b = mar.plan(b, out_b, comm=comm, algorithm=algorithm)
    runs = [lambda: plan_a.run(timeout=TIMEOUT), lambda: plan_b.run(timeout=TIMEOUT)]
    if first_is_call:
        runs[0] = lambda: mar.allreduce(a, out_a, comm=comm, algorithm=algorithm, check=False,
                                        timeout=TIMEOUT)
    if comm.rank == 0:
        runs.reverse()
    # each rank times out, or hears the alarm of a rank that timed out first
    with pytest.raises((mar.CollectiveTimeout, mar.CommunicatorRevoked)) as info:
        runs[0]()
    message = str(info.value) if info.type is mar.CollectiveTimeout else info.value.reason
    assert "in different orders" in message, message
    timed_out = comm.allgather(info.type is mar.CollectiveTimeout)
    assert any(timed_out), timed_out
    # the communicator is unusable now: every plan and call on it refuses, with the reason
    with pytest.raises(mar.CommunicatorRevoked, match="the communicator is revoked"):
        runs[1]()
    plan_a.free()
    plan_b.free()
    MPI.COMM_WORLD.Barrier()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("algorithm", ["ring", "recursive_doubling", "tree", "native"])
def test_plans_run_in_different_orders_time_out_instead_of_mixing(algorithm):
    comm = MPI.COMM_WORLD.Dup()
    _out_of_order(comm, algorithm)
    comm.Free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("algorithm", ["ring", "native"])
def test_a_call_and_a_plan_in_different_orders_time_out(algorithm):
    comm = MPI.COMM_WORLD.Dup()
    _out_of_order(comm, algorithm, first_is_call=True)
    comm.Free()


@pytest.mark.parametrize("algorithm", ["ring", "native", "rabenseifner"])
def test_many_plans_in_the_same_order_stay_apart(comm, algorithm):
    """Interleaved runs of several live plans, the same order everywhere: each its own sum."""
    inputs = [np.full(5, float(k * 100 + comm.rank)) for k in range(4)]
    outs = [np.empty(5) for _ in inputs]
    plans = [mar.plan(x, out, comm=comm, algorithm=algorithm) for x, out in zip(inputs, outs)]
    for order in ([0, 1, 2, 3], [3, 1, 0, 2]):
        for k in order:
            plans[k].run()
        mar.allreduce(inputs[0], outs[0], comm=comm, algorithm=algorithm)
        for x, out in zip(inputs, outs):
            assert_matches_native(comm, x, out, MPI.SUM)
    for p in plans:
        p.free()


def test_explicit_plans_take_distinct_slots(comm):
    x = np.ones(3)
    plans = [mar.plan(x, np.empty(3), comm=comm, algorithm="ring") for _ in range(3)]
    bases = [p._tag_base for p in plans]
    assert len(set(bases)) == 3 and 0 not in bases  # slot 0 belongs to one-shot calls
    assert_identical_across_ranks(comm, np.array(bases))
    for p in plans:
        p.free()


# -- timeouts cover the set-up ---------------------------------------------------------------------------

def _rank_0_skips(comm, call, expected: str, join) -> None:
    """Rank 0 never makes ``call``; the others must raise CollectiveTimeout matching ``expected``
    and refuse the communicator afterwards. Then rank 0 joins what they abandoned (``join``)
    and they complete their stale requests, so the communicator can be freed cleanly."""
    world = MPI.COMM_WORLD
    if comm.rank != 0:
        # (or the alarm of another rank that timed out first: it gave up before this one)
        with pytest.raises((mar.CollectiveTimeout, mar.CommunicatorRevoked)) as info:
            call()
        if info.type is mar.CollectiveTimeout:
            assert re.search(expected, str(info.value)), info.value
        else:
            assert info.value.rank != 0 and re.search(expected, info.value.reason), info.value
        with pytest.raises(mar.CommunicatorRevoked, match="the communicator is revoked"):
            mar.allreduce(np.ones(3), comm=comm, timeout=TIMEOUT)
    world.Barrier()
    if comm.rank == 0:
        join()
    else:
        MPI.Request.Waitall(_state.existing(comm).stale)
    world.Barrier()
    comm.Free()


def _join_idup(comm) -> None:
    dup, request = comm.Idup()
    request.Wait()
    dup.Free()


@pytest.mark.mpi(min_size=2)
def test_the_first_call_on_a_communicator_times_out_when_a_rank_is_missing():
    """The others time out while duplicating the communicator (Idup)."""
    comm = MPI.COMM_WORLD.Dup()
    _rank_0_skips(comm, lambda: mar.allreduce(np.ones(3), comm=comm, timeout=TIMEOUT),
                  r"setting up the communicator \(MPI_Comm_idup\) did not complete",
                  lambda: _join_idup(comm))


@pytest.mark.mpi(min_size=2)
def test_topology_discovery_times_out_when_a_rank_is_missing():
    comm = MPI.COMM_WORLD.Dup()
    mar.allreduce(np.ones(3), np.empty(3), comm=comm, algorithm="ring")  # a state, no topology
    _rank_0_skips(comm, lambda: mar.allreduce(np.ones(3), comm=comm, algorithm="hierarchical",
                                              check=False, timeout=TIMEOUT),
                  "topology discovery did not complete",
                  lambda: _state.existing(comm).private.Ibarrier().Wait())


def test_a_timeout_that_is_not_reached_changes_nothing_on_a_fresh_communicator():
    for algorithm in ("native", "hierarchical", "cascade", "ring"):
        comm = MPI.COMM_WORLD.Dup()
        x = contribution(comm, 20, "float64")
        assert_matches_native(comm, x, mar.allreduce(x, comm=comm, algorithm=algorithm,
                                                     timeout=30), MPI.SUM)
        with mar.plan(x, comm=comm, algorithm=algorithm, timeout=30) as p:
            assert_matches_native(comm, x, p.run(), MPI.SUM)
        comm.Free()


# -- the agreement --------------------------------------------------------------------------------------

@pytest.mark.mpi(min_size=2)
def test_any_exception_of_a_local_check_reaches_every_rank(comm, monkeypatch):
    real = _checks.allreduce_call

    def failing(*args, **kwargs):
        if comm.rank == 1:
            raise KeyError("something only rank 1 saw")
        return real(*args, **kwargs)

    # (the one-shot call's checks: _plans.bind_one_shot, where every blocking entry binds)
    monkeypatch.setattr(_plans, "allreduce_call", failing)
    with pytest.raises(KeyError, match="bad input on rank 1: 'something only rank 1 saw'"):
        mar.allreduce(np.ones(3), comm=comm)
    # the next call is fine everywhere
    monkeypatch.setattr(_plans, "allreduce_call", real)
    x = contribution(comm, 5, "float64")
    assert_matches_native(comm, x, mar.allreduce(x, comm=comm), MPI.SUM)


def test_the_check_is_a_constant_size_collective(comm, monkeypatch):
    sizes = []
    real = _plans.agree

    def recording(checker, what, signature, *args, **kwargs):
        sizes.append(len(signature.packed))
        return real(checker, what, signature, *args, **kwargs)

    monkeypatch.setattr(_plans, "agree", recording)
    x = np.ones(1000)
    out = np.empty_like(x)
    # a schedule (auto may run shm, whose runs check the arguments in the shared headers)
    mar.allreduce(x, out, comm=comm, algorithm="ring")
    mar.allreduce(x, out, comm=comm, algorithm="ring")
    assert sizes == [22]  # 2 x 11 int64 whatever the rank count


# -- layouts ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("algorithm", mar.ALGORITHMS)
def test_fortran_ordered_arrays_in_and_out_of_place(comm, algorithm):
    x = np.asfortranarray(contribution(comm, 35, "float64").reshape(5, 7))
    out = np.empty_like(x)  # Fortran order too
    assert out.flags.f_contiguous and not out.flags.c_contiguous
    mar.allreduce(x, out, comm=comm, algorithm=algorithm)
    assert out.flags.f_contiguous
    assert_matches_native(comm, x, out, MPI.SUM)
    buf = x.copy(order="F")
    mar.allreduce(MPI.IN_PLACE, buf, comm=comm, algorithm=algorithm)
    assert_matches_native(comm, x, buf, MPI.SUM)
    fresh = mar.allreduce(x, comm=comm, algorithm=algorithm)
    assert fresh.flags.f_contiguous
    assert_matches_native(comm, x, fresh, MPI.SUM)


@pytest.mark.parametrize("check", [True, False])
def test_layout_errors_name_the_fix(comm, check):
    x = np.ones((4, 6))
    with pytest.raises(ValueError, match=r"sendbuf is C-ordered but recvbuf is F-ordered; .*"
                                         r"np\.ascontiguousarray or np\.asfortranarray"):
        mar.allreduce(x, np.asfortranarray(np.empty((4, 6))), comm=comm, check=check)
    swapped = np.ones(6, dtype=">f8" if np.little_endian else "<f8")
    with pytest.raises(TypeError, match=r"not in this machine's byte order.*"
                                        r"newbyteorder\('='\)"):
        mar.allreduce(swapped, comm=comm, check=check)
    with pytest.raises(ValueError, match=r"must be contiguous \(C or Fortran order"):
        mar.allreduce(x[:, ::2], comm=comm, check=check)


# -- 8/16-bit overflow --------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["int8", "uint8", "int16", "uint16"])
@pytest.mark.parametrize("count", [1, 7, 64, 257])
@pytest.mark.parametrize("algorithm", ["auto"] + SCHEDULES)
def test_overflowing_narrow_sums_are_modular(comm, dtype, count, algorithm):
    info = np.iinfo(dtype)
    x = np.full(count, info.max - 1 - comm.rank % 3, dtype=dtype)
    everything = np.array(comm.allgather(x))
    with np.errstate(over="ignore"):
        expected = np.add.reduce(everything, axis=0, dtype=dtype)  # NumPy wraps as C does
    out = mar.allreduce(x, comm=comm, algorithm=algorithm)
    assert np.array_equal(out, expected), (out[:4], expected[:4])
    assert_identical_across_ranks(comm, out)


@pytest.mark.parametrize("dtype", ["int8", "uint8", "int16", "uint16"])
def test_auto_avoids_a_saturating_native_sum(comm, dtype):
    """NumPy is the reference, so this runs under every MPI: auto keeps native for an
    overflowing 8/16-bit sum only where MPI's own result there is NumPy's modular one (MPICH
    wraps; Open MPI's op/avx saturates, and auto must then pick a schedule), and auto's result
    is NumPy's either way."""
    info = np.iinfo(dtype)
    x = np.full(300, info.max - 1 - comm.rank % 3, dtype=dtype)  # 300: MPI's vector path
    with np.errstate(over="ignore"):
        expected = np.add.reduce(np.array(comm.allgather(x)), axis=0, dtype=dtype)
    native = np.empty_like(x)
    comm.Allreduce(x, native, op=MPI.SUM)
    call = _checks.allreduce_call(x, None, MPI.SUM, comm, "auto", None)
    chosen = _plans.resolve(call, comm.size)
    problem = None
    if chosen == "native" and not np.array_equal(native, expected):
        problem = f"rank {comm.rank}: auto kept native, whose {dtype} sum saturates"
    out = mar.allreduce(x, comm=comm, algorithm="auto")
    problem = problem or mismatch(comm, out, expected, None)
    assert_on_every_rank(comm, problem, out)
    assert (chosen != "native") == (comm.size > 1 and ops.native_deviates("SUM", x.dtype))
    float_call = _checks.allreduce_call(np.ones(3), None, MPI.SUM, comm, "auto", None)
    assert _plans.resolve(float_call, comm.size) == "native"


# -- threads and memory -----------------------------------------------------------------------------

@pytest.mark.skipif(MPI.Query_thread() < MPI.THREAD_MULTIPLE, reason="needs MPI_THREAD_MULTIPLE")
def test_two_threads_on_two_communicators():
    comms = [MPI.COMM_WORLD.Dup() for _ in range(2)]
    errors = []

    def work(comm, algorithm):
        try:
            x = contribution(comm, 33, "float64", seed=7)
            out = np.empty_like(x)
            for _ in range(30):
                mar.allreduce(x, out, comm=comm, algorithm=algorithm)
            ref = np.empty_like(x)
            comm.Allreduce(x, ref)
            np.testing.assert_allclose(out, ref, rtol=1e-12, atol=1e-12)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(c, a)) for c, a in zip(comms, ("ring", "native"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for c in comms:
        c.Free()
    assert not errors, errors


def test_a_dropped_plan_releases_its_requests(comm):
    x = np.ones(10)
    p = mar.plan(x, np.empty(10), comm=comm, algorithm="ring")
    p.run()
    finalizer = p._finalizer
    requests = p._requests
    assert finalizer.alive and (comm.size == 1 or requests)
    del p
    gc.collect()
    assert not finalizer.alive and requests == []


def test_outsized_scratch_is_not_kept(comm, monkeypatch):
    monkeypatch.setattr(_state, "SCRATCH_BYTES", 1000)
    x = contribution(comm, 4000, "float64")
    assert_matches_native(comm, x, mar.allreduce(x, comm=comm, algorithm="ring"), MPI.SUM)
    state = _state.existing(comm)
    assert all(buf.nbytes <= 1000 for buf in state.scratch.values())


def test_one_result_buffer_shared_by_several_calls(comm):
    """The last plan bound to a recvbuf is found by comparing objects; other calls into the same
    buffer (another op, input, algorithm or communicator) must still get their own plans."""
    x = contribution(comm, 12, "float64")
    y = contribution(comm, 12, "float64", seed=5)
    out = np.empty_like(x)
    other = MPI.COMM_WORLD.Dup()
    for _ in range(2):
        for send, op, algorithm, on in ((x, MPI.SUM, "auto", comm), (x, MPI.MAX, "auto", comm),
                                        (y, MPI.SUM, "auto", comm), (x, MPI.SUM, "ring", comm),
                                        (x, MPI.SUM, "auto", other)):
            mar.allreduce(send, out, op=op, comm=on, algorithm=algorithm)
            assert_matches_native(on, send, out, op)
        mar.allreduce(x, out, comm=comm, algorithm="ring_segmented", segment_bytes=16)
        assert_matches_native(comm, x, out, MPI.SUM)
    # y into out (auto = native, same shape as x's call) is served by that call's shape the
    # first time; the second time the same pair comes back it gets its own entry
    assert _entries(comm) == 5
    other.Free()


@pytest.mark.parametrize("algorithm", ["auto", "native", "ring", "recursive_doubling", "tree"])
@pytest.mark.parametrize("in_place", [False, True])
def test_fresh_arrays_each_call_skip_the_set_up(comm, monkeypatch, in_place, algorithm):
    """A dot product as scientific codes write it, np.array([local]) per call: the call is
    known by its shape (a schedule through staging buffers), so only the first call binds."""
    slow = []
    real = _plans.one_shot
    monkeypatch.setattr(_plans, "one_shot", lambda *a, **k: slow.append(1) or real(*a, **k))
    for round_ in range(4):
        local = np.array([float(comm.rank + round_), 2.0 * comm.rank])
        original = local.copy()
        if in_place:
            out = mar.allreduce(MPI.IN_PLACE, local, comm=comm, algorithm=algorithm)
        else:
            out = mar.allreduce(local, np.empty(2), comm=comm, algorithm=algorithm)
        assert_matches_native(comm, original, out, MPI.SUM)
        out = mar.allreduce(local.reshape(2, 1), np.empty((2, 1)), comm=comm, algorithm=algorithm,
                            op=mar.AVG)  # another op: one more bound shape (any shape of 2)
        assert_matches_native(comm, local.reshape(2, 1), out, MPI.SUM, average=True)
    assert len(slow) == 2


@pytest.mark.parametrize("algorithm", ["auto", "native", "ring", "shm"])
def test_arrays_reused_after_fresh_ones_are_bound_to_their_own_entry(comm, algorithm):
    """Fresh arrays first (the call is then known by its shape), then one pair reused: from
    its second call the pair has a call-cache entry of its own (no staging copies per call;
    before, every later call went through the shape, 2-4x slower at 8 B)."""
    for round_ in range(2):
        local = np.array([float(comm.rank + round_), 1.0])
        mar.allreduce(local, np.empty(2), comm=comm, algorithm=algorithm)
    x, out = np.array([float(comm.rank), 2.0]), np.empty(2)
    for round_ in range(3):
        x[0] = comm.rank + round_
        mar.allreduce(x, out, comm=comm, algorithm=algorithm)
        assert_matches_native(comm, x, out, MPI.SUM)
    entry = _state.LAST.get(id(out))
    assert entry is not None and entry.objects[2] is out


def test_fresh_arrays_that_do_not_fit_the_shape_still_get_checked(comm):
    mar.allreduce(np.ones(4), np.empty(4), comm=comm)  # the shape exists now
    x = np.ones(8)
    with pytest.raises(ValueError, match="sendbuf and recvbuf overlap"):
        mar.allreduce(x[:4], x[2:6], comm=comm)  # views that overlap: the checked path
    readonly = np.empty(4)
    readonly.flags.writeable = False
    with pytest.raises(ValueError, match="recvbuf is read-only"):
        mar.allreduce(np.ones(4), readonly, comm=comm)
    y = contribution(comm, 4, "float64")
    assert_matches_native(comm, y, mar.allreduce(y, np.empty(4), comm=comm, op=mar.AVG),
                          MPI.SUM, average=True)


@pytest.mark.parametrize("timeout", [np.float64(30.0), np.float32(30.0), np.int64(30)])
def test_a_numpy_timeout_finds_the_cached_plan(comm, monkeypatch, timeout):
    # Before: a np.float64 timeout failed the hot path's type() test, so every call bound its
    # plans again (and np.int64 was refused).
    x = contribution(comm, 9, "float64")
    out = np.empty_like(x)
    mar.allreduce(x, out, comm=comm, algorithm="ring", timeout=timeout)
    slow = []
    real = _plans.one_shot
    monkeypatch.setattr(_plans, "one_shot", lambda *a, **k: slow.append(1) or real(*a, **k))
    for _ in range(3):
        out.fill(np.nan)
        mar.allreduce(x, out, comm=comm, algorithm="ring", timeout=timeout)
        assert_matches_native(comm, x, out, MPI.SUM)
    assert slow == []


#: the entry points that keep what a call bound (each through _plans.cached_call): the call,
#: waited for, returning its result
KEPT = {
    "allreduce": lambda x, out, **kw: mar.allreduce(x, out, **kw),
    "iallreduce": lambda x, out, **kw: mar.iallreduce(x, out, **kw).wait(),
    "reproducible": lambda x, out, **kw: mar.allreduce(x, out, reproducible=True, **kw),
}


@pytest.mark.parametrize("timeout", [None, 30, np.float64(30.0)])
@pytest.mark.parametrize("entry_point", list(KEPT))
def test_every_entry_point_finds_its_cached_call_alike(comm, entry_point, timeout):
    # every entry point makes the same key, so no copy of the lookup can drift from the others
    # (such as skipping the NumPy timeout's conversion, or sorting the parameters in its key)
    call = KEPT[entry_point]
    x = contribution(comm, 9, "float64")
    out = np.empty_like(x)
    call(x, out, comm=comm, algorithm="knomial", timeout=timeout, k=2)
    entries = dict(_state.existing(comm).calls.entries)
    assert len(entries) == 1
    ((key, entry),) = entries.items()
    assert key == _plans.call_key(key[2], comm, x, MPI.SUM, "knomial", None, {"k": 2})
    kind = {"allreduce": _plans.ALLREDUCE, "iallreduce": _plans.IALLREDUCE,
            "reproducible": _plans.REPRODUCIBLE}[entry_point]
    assert key[2] == id(out) + kind
    assert _state.LAST[key[2]] is entry
    for seed in (1, 2, 3):
        x[:] = contribution(comm, 9, "float64", seed=seed)
        out.fill(np.nan)
        assert call(x, out, comm=comm, algorithm="knomial", timeout=timeout, k=2) is out
        assert_matches_native(comm, x, out, MPI.SUM)
    assert dict(_state.existing(comm).calls.entries) == entries


#: seconds past a timeout that only a hang exceeds (no speed is measured here)
HANG = 120.0


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("count", [1, 64])
@pytest.mark.parametrize("per_node", ["1", ""], ids=["nodes_of_one_rank", "one_node"])
@pytest.mark.parametrize("entry_point", list(KEPT))
def test_a_repeated_call_whose_peer_never_comes_times_out(monkeypatch, entry_point, per_node,
                                                          count):
    """A cached call honours ``timeout=`` as a first call does, on every entry point: the last
    rank skips the third call and the others raise CollectiveTimeout (the reproducible one
    across nodes too, which a lookup of its own would not). The skipper
    waits in a barrier the others reach once they have timed out, then joins the argument check
    they abandoned (where they waited in one; on one node they wait on shared memory), so the
    world is clean afterwards."""
    monkeypatch.setenv(RANKS_PER_NODE_ENV, per_node)  # read when comm's topology is discovered
    monkeypatch.setattr(shm, "CLOSE_SECONDS", 0.5)  # the skipper's close of the node, after
    call = KEPT[entry_point]
    world = MPI.COMM_WORLD
    comm = world.Dup()
    skipper = comm.size - 1
    x = np.arange(count, dtype=np.float64) + comm.rank
    out = np.empty_like(x)
    want = np.arange(count, dtype=np.float64) * comm.size + comm.size * (comm.size - 1) // 2
    for _ in range(2):  # the first call binds, the second runs the cached entry
        assert np.array_equal(call(x, out, comm=comm, timeout=HANG), want)
    world.Barrier()  # everyone starts together, so only the skipper is late
    outcome = None
    if comm.rank != skipper:
        start = time.monotonic()
        try:
            call(x, out, comm=comm, timeout=TIMEOUT)
            outcome = "returned"
        except Exception as exc:  # every rank's outcome is gathered before asserting
            outcome = f"{type(exc).__name__} after {time.monotonic() - start:.2f} s: {exc}"
    world.Barrier()  # the skipper waits here until every other rank has timed out
    state = _state.existing(comm)
    pending = world.allgather(len(state.stale) if comm.rank != skipper else 0)
    if any(pending):  # an argument check left in flight: the skipper joins it
        if comm.rank == skipper:
            fields = 2 * len(_agree.FIELDS)
            state.checker.Iallreduce(np.zeros(fields, np.int64), np.empty(fields, np.int64),
                                     MPI.MAX).Wait()
        else:
            MPI.Request.Waitall(state.stale)
            state.stale.clear()
    refused = None
    if comm.rank != skipper:
        try:
            call(x, out, comm=comm)
        except mar.CommunicatorRevoked as exc:
            refused = str(exc)
    outcomes, refusals = world.allgather(outcome), world.allgather(refused)
    comm.Free()
    # every waiting rank timed out, or heard the alarm of one that did (at least one did)
    assert any(outcomes[rank].startswith("CollectiveTimeout") for rank in range(skipper))
    for rank in range(skipper):
        assert outcomes[rank].startswith(("CollectiveTimeout", "CommunicatorRevoked")), \
            (rank, outcomes[rank])
        elapsed = float(outcomes[rank].split()[2])
        least = TIMEOUT if outcomes[rank].startswith("CollectiveTimeout") else TIMEOUT / 2
        assert least <= elapsed < TIMEOUT + HANG, (rank, outcomes[rank])
        assert "the communicator is revoked" in refusals[rank]


@pytest.mark.parametrize("algorithm", ["native", "ring"])
def test_a_shape_mismatch_raises_warm_as_it_does_cold(comm, algorithm):
    x = contribution(comm, 12, "float64")
    out = np.empty_like(x)
    mar.allreduce(x, out, comm=comm, algorithm=algorithm)  # cached now
    x.shape = (3, 4)  # the same objects, shapes that no longer match
    with pytest.raises(ValueError, match="shape"):
        mar.allreduce(x, out, comm=comm, algorithm=algorithm)
    x.shape = (12,)
    assert_matches_native(comm, x, mar.allreduce(x, out, comm=comm, algorithm=algorithm), MPI.SUM)


def test_the_signature_carries_autos_saturation_probe_and_mode(comm):
    x = np.ones(3, dtype=np.int8)
    saturates = int(ops.native_deviates("SUM", np.dtype(np.int8)))
    field = _agree.FIELDS.index("auto's inputs")
    call = _checks.allreduce_call(x, None, MPI.SUM, comm, "auto", None)
    fields = call.signature(None)
    assert len(fields) == len(_agree.FIELDS)
    assert fields[field] == saturates
    in_place = _checks.allreduce_call(MPI.IN_PLACE, x, MPI.SUM, comm, "auto", None)
    assert in_place.signature(None)[field] == saturates | 2


@pytest.mark.parametrize("comm", GRID_KINDS, indirect=True)
def test_auto_in_place_on_some_ranks_only_raises_on_every_rank(comm):
    # on one node auto's choice depends on the mode (shm in place, a schedule out of place
    # at some sizes): ranks that differ would wait for each other, so the check refuses it
    x = contribution(comm, 8192, "float64")  # 64 KiB
    if comm.size == 1:  # nobody to differ from (a split of 3 ranks has one of 1)
        assert_matches_native(comm, x, mar.allreduce(MPI.IN_PLACE, x.copy(), comm=comm), MPI.SUM)
        return
    # says what each rank did, not the encoded word (it said "auto's inputs differs: in place,
    # a native library that wraps on rank 0; out of place, ...")
    others = "rank 1" if comm.size == 2 else f"ranks {', '.join(map(str, range(1, comm.size)))}"
    with pytest.raises(ValueError, match=re.escape(
            f"sendbuf differs: rank 0 passed MPI.IN_PLACE; {others} passed a send buffer")) as info:
        if comm.rank == 0:
            mar.allreduce(MPI.IN_PLACE, x.copy(), comm=comm)
        else:
            mar.allreduce(x, comm=comm)
    assert "auto's inputs" not in str(info.value) and "saturates" not in str(info.value)
    assert_matches_native(comm, x, mar.allreduce(x, comm=comm), MPI.SUM)


def test_one_array_bound_by_every_entry_point_keeps_an_entry_per_entry_point(comm):
    # a call's slot is id(recvbuf) + its entry point's number: the same arrays passed to
    # allreduce, iallreduce and reproducible=True are three entries, each found again
    x = contribution(comm, 5, "float64")
    out = np.empty_like(x)
    for _ in range(3):
        for call in KEPT.values():
            out.fill(np.nan)
            assert call(x, out, comm=comm, algorithm="ring") is out
            assert_matches_native(comm, x, out, MPI.SUM)
    slots = sorted(key[2] for key in _state.existing(comm).calls.entries)
    assert slots == [id(out) + kind for kind in
                     (_plans.ALLREDUCE, _plans.IALLREDUCE, _plans.REPRODUCIBLE)]
