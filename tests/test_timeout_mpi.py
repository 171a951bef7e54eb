"""Timeouts: when one rank skips a collective, the others raise CollectiveTimeout, never before
the timeout (and within a bound so generous that only a hang exceeds it), naming the algorithm,
step and peer; the plan and the communicator
refuse further use on those ranks.

Each test runs on a throwaway Dup of COMM_WORLD. After the timeout the skipping rank drains
what the others left behind (messages on the private communicator, or the collective they
began), so every request completes and the world is clean for the next test. Nothing here
sleeps: the skipping rank waits in a barrier that the others reach once they have timed out.
"""

from __future__ import annotations

import re
import time
import warnings

import numpy as np
import pytest
from conftest import assert_matches_native, contribution
from mpi4py import MPI

import mpiallreduce as mar
from mpiallreduce import _agree, _state, shm
from mpiallreduce.partition import block, block_counts

pytestmark = pytest.mark.mpi(min_size=2)

SCHEDULES = [name for name in mar.ALGORITHMS if name not in ("native", "auto")]
TIMEOUT = 0.5
#: seconds past the timeout that only a hang exceeds (no speed is measured here: other jobs share
#: the machine's cores, and a stuck rank would otherwise wait for the job's own timeout)
HANG = 120.0
COUNT = 64  # small enough that every message is sent eagerly
SKIPPER = 0


def _throwaway_comm(algorithm="ring"):
    """A Dup of COMM_WORLD on which ``algorithm`` has run once: its private Dup and (for the
    hierarchical algorithms) its topology exist, so the skipped call has nothing collective
    left to set up before its first message."""
    world = MPI.COMM_WORLD
    comm = world.Dup()
    x = contribution(comm, COUNT, "float64")
    assert_matches_native(comm, x, mar.allreduce(x, comm=comm, algorithm=algorithm), MPI.SUM)
    return comm


def _skip_or_time_out(comm, call):
    """Rank SKIPPER skips ``call``; the others must raise CollectiveTimeout in time."""
    world = MPI.COMM_WORLD
    world.Barrier()  # everyone starts together, so only the skipper is late
    message = None
    if comm.rank != SKIPPER:
        start = time.monotonic()
        with pytest.raises(mar.CollectiveTimeout) as info:
            call()
        elapsed = time.monotonic() - start
        assert elapsed >= TIMEOUT, f"raised after {elapsed:.2f} s, before the timeout"
        assert elapsed < TIMEOUT + HANG, f"raised after {elapsed:.2f} s: it hung"
        message = str(info.value)
    world.Barrier()  # the skipper waits here until every other rank has timed out
    return world.allgather(message)


def _drain_messages(comm):
    """Receive every point-to-point message left on the private Dup; end with a flush mark."""
    private = _state.state(comm).private
    flush = private.Get_attr(MPI.TAG_UB)
    marks = [private.Isend(np.empty(0), peer, flush) for peer in range(comm.size) if peer != comm.rank]
    buf, status = np.empty(COUNT), MPI.Status()
    for peer in range(comm.size):
        if peer == comm.rank:
            continue
        while True:  # MPI's non-overtaking rule: the mark comes after everything peer sent
            private.Recv(buf, peer, MPI.ANY_TAG, status)
            if status.Get_tag() == flush:
                break
    MPI.Request.Waitall(marks)


def _drain_collective(comm, complete):
    """The skipper joins the collective the others abandoned; they complete their requests.

    ``complete`` must start the same non-blocking collective: MPI never matches a blocking
    collective with a non-blocking one.
    """
    state = _state.state(comm)
    if comm.rank == SKIPPER:
        complete(state)
    else:
        assert len(state.stale) == 1
        MPI.Request.Waitall(state.stale)
        state.stale.clear()


def _assert_refused_later(comm):
    if comm.rank != SKIPPER:
        with pytest.raises(ValueError, match="an earlier collective on this communicator timed "
                                             "out .*cannot carry more mpiallreduce calls"):
            mar.allreduce(np.zeros(COUNT), comm=comm, algorithm="ring")


@pytest.mark.parametrize("algorithm", SCHEDULES)
def test_a_skipped_call_times_out_inside_the_schedule(algorithm, monkeypatch):
    # shm: the healthy rank's close of the node gives up after 1 s instead of 10
    monkeypatch.setattr(shm, "CLOSE_SECONDS", 1.0)
    comm = _throwaway_comm(algorithm)
    x = contribution(comm, COUNT, "float64")
    messages = _skip_or_time_out(
        comm, lambda: mar.allreduce(x, comm=comm, algorithm=algorithm, check=False,
                                    timeout=TIMEOUT))
    pattern = rf"{algorithm} allreduce on rank \d+: no answer from rank\(s\) [\d, ]+ in step \d+ "
    for message in messages[1:]:
        assert message is not None
        assert message.endswith(f"within {TIMEOUT:g} s (a rank did not make this call, or ranks "
                                f"run plans or calls on this communicator in different orders); "
                                f"the plan is unusable now")
        assert re.match(pattern, message), message
    assert any(f"no answer from rank(s) {SKIPPER} in step" in m for m in messages[1:]), messages
    _drain_messages(comm)
    _assert_refused_later(comm)
    comm.Free()


@pytest.mark.parametrize("algorithm", ["ring", "native"])
def test_a_skipped_call_times_out_in_the_argument_check(algorithm):
    comm = _throwaway_comm(algorithm)
    x = contribution(comm, COUNT, "float64")
    messages = _skip_or_time_out(
        comm, lambda: mar.allreduce(x, comm=comm, algorithm=algorithm, timeout=TIMEOUT))
    for rank, message in enumerate(messages[1:], start=1):
        assert message == (f"allreduce on rank {rank}: the argument check did not complete "
                           f"within {TIMEOUT:g} s; some rank of the communicator has not made "
                           f"this call, or runs calls on it in a different order, or passed "
                           f"check=False (no data has moved yet)")
    fields = 2 * len(_agree.FIELDS)
    _drain_collective(comm, lambda state: state.checker.Iallreduce(
        np.zeros(fields, dtype=np.int64), np.empty(fields, dtype=np.int64), MPI.MAX).Wait())
    _assert_refused_later(comm)
    comm.Free()


def test_a_native_plan_times_out():
    comm = _throwaway_comm()
    x = contribution(comm, COUNT, "float64")
    out = np.empty_like(x)
    p = mar.plan(x, out, comm=comm, algorithm="native")
    messages = _skip_or_time_out(comm, lambda: p.run(timeout=TIMEOUT))
    for rank, message in enumerate(messages[1:], start=1):
        assert message == (f"native allreduce on rank {rank}: not complete within {TIMEOUT:g} s "
                           f"(a rank did not make this call, or ranks run plans or calls on this "
                           f"communicator in different orders; MPI does not say which rank is "
                           f"missing); the plan is unusable now")
    # an explicit native plan runs on a communicator of its own
    _drain_collective(comm, lambda state: p.comm.Iallreduce(x, np.empty_like(x), MPI.SUM).Wait())
    if comm.rank != SKIPPER:
        with pytest.raises(ValueError, match="this plan is unusable after an earlier timeout: "
                                             "native allreduce on rank"):
            p.run()
    p.free()
    _assert_refused_later(comm)
    comm.Free()


@pytest.mark.parametrize("collective", ["reduce_scatter", "allgather", "bcast", "alltoall"])
def test_a_native_related_collective_times_out(collective):
    """check=False lets the others reach MPI's collective itself while the skipper stays away."""
    comm = _throwaway_comm()
    x = contribution(comm, COUNT * comm.size, "float64")
    counts = block_counts(x.size, comm.size)
    lo, hi = block(x.size, comm.size, comm.rank)
    mine = x[lo:hi].copy()
    # Every buffer outlives the abandoned request: mpi4py 4.1 does not keep the receive buffer
    # of Iallgatherv or Ireduce_scatter alive, and MPI writes into it when the skipper joins
    # (a temporary here corrupted the heap under MPICH).
    block_out, full_out = np.empty(hi - lo), np.empty_like(x)
    calls = {  # the call under test, and the same collective started non-blocking
        "reduce_scatter": (lambda **kw: mar.reduce_scatter(x, block_out, **kw),
                           lambda private: private.Ireduce_scatter(x, block_out, counts)),
        "allgather": (lambda **kw: mar.allgather(mine, full_out, **kw),
                      lambda private: private.Iallgatherv(mine, [full_out, counts])),
        "bcast": (lambda **kw: mar.bcast(full_out, SKIPPER, **kw),
                  lambda private: private.Ibcast(full_out, SKIPPER)),
        "alltoall": (lambda **kw: mar.alltoall(x, full_out, **kw),
                     lambda private: private.Ialltoall(x, full_out)),
    }
    call, start = calls[collective]
    messages = _skip_or_time_out(comm, lambda: call(comm=comm, algorithm="native", check=False,
                                                    timeout=TIMEOUT))
    for rank, message in enumerate(messages[1:], start=1):
        assert message == (f"native {collective} on rank {rank}: not complete within "
                           f"{TIMEOUT:g} s (MPI does not say which rank is missing)")
    _drain_collective(comm, lambda state: start(state.private).Wait())
    _assert_refused_later(comm)
    comm.Free()


@pytest.mark.parametrize("algorithm", ["ring"])  # the executor path is the same for every schedule
def test_a_plan_times_out_and_is_unusable_afterwards(algorithm):
    comm = _throwaway_comm()
    x = contribution(comm, COUNT, "float64")
    out = np.empty_like(x)
    p = mar.plan(x, out, comm=comm, algorithm=algorithm, timeout=TIMEOUT)
    p.run()
    assert_matches_native(comm, x, out, MPI.SUM)
    messages = _skip_or_time_out(comm, p.run)
    assert any(f"no answer from rank(s) {SKIPPER} in step" in m for m in messages[1:]), messages
    _drain_messages(comm)
    if comm.rank != SKIPPER:
        with pytest.raises(ValueError, match=f"this plan is unusable after an earlier timeout: "
                                             f"{algorithm} allreduce on rank {comm.rank}: no "
                                             f"answer from"):
            p.run()
    p.free()
    comm.Free()


def test_a_timeout_that_is_not_reached_changes_nothing():
    comm = MPI.COMM_WORLD
    x = contribution(comm, 1000, "float64")
    for algorithm in mar.ALGORITHMS:
        out = mar.allreduce(x, comm=comm, algorithm=algorithm, timeout=60)
        assert_matches_native(comm, x, out, MPI.SUM)
        with mar.plan(x, comm=comm, algorithm=algorithm) as p:
            assert_matches_native(comm, x, p.run(timeout=60), MPI.SUM)


# -- mar.Comm(timeout=...): mpi4py's own collectives keep the deadline too (issue 34, item 2) ---

#: a collective of mar.Comm that mpi4py would run blocking, and the non-blocking call the
#: skipper joins afterwards on the same communicator (what the others left pending)
_COMM_CALLS = {
    "allreduce": (lambda c: c.allreduce(c.rank + 1),
                  lambda c: MPI.Intracomm.Iallgather(c, [np.zeros(1, np.int64), MPI.INT64_T],
                                                     [np.empty(c.size, np.int64), MPI.INT64_T])),
    "allgather": (lambda c: c.allgather({"rank": c.rank}),
                  lambda c: MPI.Intracomm.Iallgather(c, [np.zeros(1, np.int64), MPI.INT64_T],
                                                     [np.empty(c.size, np.int64), MPI.INT64_T])),
    "bcast": (lambda c: c.bcast(None, root=SKIPPER),
              lambda c: MPI.Intracomm.Ibcast(c, [np.zeros(1, np.int64), MPI.INT64_T], SKIPPER)),
    "barrier": (lambda c: c.barrier(), lambda c: MPI.Intracomm.Ibarrier(c)),
    "Barrier": (lambda c: c.Barrier(), lambda c: MPI.Intracomm.Ibarrier(c)),
    "Bcast": (lambda c: c.Bcast(_BCAST_BUF, root=SKIPPER),
              lambda c: MPI.Intracomm.Ibcast(c, _BCAST_BUF, SKIPPER)),
}
_BCAST_BUF = np.zeros(COUNT)  # outlives the abandoned request


@pytest.mark.parametrize("name", list(_COMM_CALLS))
def test_a_comm_with_a_timeout_times_out_in_mpi4pys_own_collectives(name):
    # comm.allreduce(obj) on a mar.Comm(timeout=...) waited forever for a rank that never came
    call, join = _COMM_CALLS[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # test_a_comm_with_a_timeout_warns_what_it_cannot_cover
        comm = mar.Comm(_throwaway_comm(), timeout=TIMEOUT)
    messages = _skip_or_time_out(comm, lambda: call(comm))
    for rank, message in enumerate(messages):
        if rank != SKIPPER:
            assert message == (f"{name} on rank {rank}: MPI's collective did not complete within "
                               f"{TIMEOUT:g} s; some rank has not made this call (MPI does not "
                               f"say which)")
    _drain_collective(comm, lambda state: join(comm).Wait())
    _assert_refused_later(comm)
    comm.Free()


def test_a_comm_with_a_timeout_computes_what_mpi4py_does():
    world = MPI.COMM_WORLD
    comm = mar.Comm(world.Dup(), timeout=HANG)
    assert comm.allreduce(world.rank + 1) == world.allreduce(world.rank + 1)
    assert comm.allreduce([world.rank], op=MPI.SUM) == world.allreduce([world.rank])  # rank order
    assert comm.allreduce(world.rank, op=MPI.MAX) == world.size - 1
    assert comm.allgather({"r": world.rank}) == [{"r": r} for r in range(world.size)]
    assert comm.bcast({"from": world.rank}, root=world.size - 1) == {"from": world.size - 1}
    comm.barrier()
    comm.Barrier()
    buf = np.arange(COUNT, dtype=float) * (world.rank == 0)
    comm.Bcast(buf, root=0)
    assert np.array_equal(buf, np.arange(COUNT, dtype=float))
    gathered = np.empty((world.size, 2)) if world.rank == 0 else None
    comm.Gather(np.full(2, float(world.rank)), gathered, root=0)
    if world.rank == 0:
        assert np.array_equal(gathered, np.repeat(np.arange(world.size, dtype=float), 2)
                              .reshape(world.size, 2))
    comm.Free()


def test_a_comm_with_a_timeout_warns_what_it_cannot_cover(monkeypatch):
    monkeypatch.setattr(mar.comm, "_warned", False)
    world = MPI.COMM_WORLD
    with pytest.warns(UserWarning, match=r"gather, scatter, .* run as mpi4py's, with no deadline"):
        comm = mar.Comm(world, timeout=HANG)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once a process
        mar.Comm(world, timeout=HANG)
        mar.Comm(world)
    assert comm.allreduce(1) == world.size
