"""iallreduce and start(plan): results, several outstanding, any wait order, errors from wait()."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import assert_matches_native, contribution
from mpi4py import MPI

import mpiallreduce as mar
from mpiallreduce import _plans, _state, nonblocking

pytestmark = pytest.mark.mpi

ALGORITHMS = ["native", "auto", "ring", "tree", "recursive_doubling", "rabenseifner"]


@pytest.fixture
def comm():
    comm = MPI.COMM_WORLD.Dup()
    yield comm
    comm.Free()


def test_mpi_is_initialised_with_thread_multiple():
    assert nonblocking.threaded()


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("count", [0, 1, 7, 1000])
def test_outstanding_requests_waited_in_any_order(comm, algorithm, count):
    inputs = [contribution(comm, count, "float64", seed=s) for s in range(3)]
    requests = [mar.iallreduce(x, comm=comm, algorithm=algorithm) for x in inputs]
    for i in (2, 0, 1):
        out = requests[i].wait()
        assert_matches_native(comm, inputs[i], out, MPI.SUM)
        assert requests[i].wait() is out  # again: the same result
        assert requests[i].test() and requests[i].done


@pytest.mark.parametrize("algorithm", ["native", "ring", "tree"])
def test_avg_in_place_and_given_recvbuf(comm, algorithm):
    x = contribution(comm, 33, "float64")
    out = np.empty_like(x)
    assert mar.iallreduce(x, out, op=mar.AVG, comm=comm, algorithm=algorithm).wait() is out
    assert_matches_native(comm, x, out, MPI.SUM, average=True)
    buf = contribution(comm, 33, "int32")
    ref = np.empty_like(buf)
    comm.Allreduce(buf, ref, MPI.MAX)
    mar.iallreduce(MPI.IN_PLACE, buf, op=MPI.MAX, comm=comm, algorithm=algorithm).wait()
    assert np.array_equal(buf, ref)


def test_test_polls_until_done(comm):
    x = contribution(comm, 100, "float64")
    request = mar.iallreduce(x, comm=comm, algorithm="ring")
    while not request.test():
        pass
    assert_matches_native(comm, x, request.wait(), MPI.SUM)


def test_mixed_with_blocking_calls(comm):
    x, y = contribution(comm, 50, "float64"), contribution(comm, 60, "float64", seed=1)
    request = mar.iallreduce(x, comm=comm, algorithm="ring")
    blocking = mar.allreduce(y, comm=comm, algorithm="recursive_doubling")
    assert_matches_native(comm, y, blocking, MPI.SUM)
    assert_matches_native(comm, x, request.wait(), MPI.SUM)


@pytest.mark.parametrize("algorithm", ["native", "ring", "tree"])
def test_persistent_plan_started_repeatedly(comm, algorithm):
    x = contribution(comm, 20, "float64")
    out = np.empty_like(x)
    with mar.plan(x, out, comm=comm, algorithm=algorithm) as plan:
        for round_ in range(3):
            x[:] = contribution(comm, 20, "float64", seed=round_)
            request = mar.start(plan)
            assert request.wait() is out
            assert_matches_native(comm, x, out, MPI.SUM)


def test_a_freed_plan_refuses_to_start(comm):
    plan = mar.plan(np.ones(4), np.empty(4), comm=comm, algorithm="ring")
    plan.free()
    with pytest.raises(ValueError, match="freed"):
        mar.start(plan)


@pytest.mark.mpi(min_size=2)
def test_a_timeout_in_the_progress_thread_raises_from_wait(short_close, comm):
    mar.allreduce(np.zeros(1), comm=comm)  # the communicator's set-up is collective
    if comm.rank == 0:  # the others never make the call: rank 0's run must time out
        request = mar.iallreduce(np.ones(8), comm=comm, algorithm="ring", check=False,
                                 timeout=0.3)
        with pytest.raises(mar.CollectiveTimeout, match="no answer"):
            request.wait()
    comm.Barrier()


@pytest.mark.mpi(min_size=2)
def test_wait_with_a_timeout_leaves_the_request_in_flight(comm):
    x = np.full(8, float(comm.rank))
    mar.allreduce(np.zeros(1), comm=comm)  # the communicator's set-up is collective
    if comm.rank == 0:
        request = mar.iallreduce(x, comm=comm, algorithm="ring", check=False)
        with pytest.raises(mar.CollectiveTimeout, match="still in flight"):
            request.wait(timeout=0.2)
    comm.Barrier()  # the others call only now
    if comm.rank != 0:
        request = mar.iallreduce(x, comm=comm, algorithm="ring", check=False)
    assert np.all(request.wait() == sum(range(comm.size)))


@pytest.mark.parametrize("algorithm", ["native", "ring"])
def test_without_a_progress_thread_runs_progress_in_test_and_wait(comm, algorithm):
    mar.allreduce(np.zeros(1), comm=comm)  # makes the communicator's state
    engine = nonblocking._engine(_state.existing(comm).private)
    engine.threaded = False
    try:
        inputs = [contribution(comm, 40, "float64", seed=s) for s in range(3)]
        requests = [mar.iallreduce(x, comm=comm, algorithm=algorithm) for x in inputs]
        requests[2].test()
        for i in (1, 2, 0):
            assert_matches_native(comm, inputs[i], requests[i].wait(), MPI.SUM)
    finally:
        engine.threaded = True


@pytest.mark.parametrize("algorithm", ["ring", "native"])
def test_plan_start_and_wait_methods(algorithm):
    comm = MPI.COMM_WORLD
    x = contribution(comm, 21, "float64")
    out = np.empty_like(x)
    with mar.plan(x, out, comm=comm, algorithm=algorithm) as p:
        with pytest.raises(ValueError, match="never started"):
            p.wait()
        for _ in range(3):
            out.fill(np.nan)
            request = p.start()
            assert p.wait() is out and request.wait() is out
            assert_matches_native(comm, x, out, MPI.SUM)


# -- concurrency: requests in flight and blocking calls on one communicator -------------------

def _ordered_sum(comm):
    """A user op (so uncached calls take the path where a communicator's scratch could be
    shared)."""
    return MPI.Op.Create(lambda a, b, t: np.add(np.frombuffer(a, "f8"), np.frombuffer(b, "f8"),
                                                out=np.frombuffer(b, "f8")), commute=True)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("algorithm", ["ring", "recursive_doubling"])
def test_a_request_in_flight_and_a_blocking_call_never_share_scratch(comm, algorithm):
    # An iallreduce that borrowed the communicator's scratch would share it with the blocking
    # call below (user op, recvbuf=None: uncached) at the same time, and 40 rounds show such
    # wrong sums many times over.
    op = _ordered_sum(comm)
    try:
        for round_ in range(40):
            x = contribution(comm, 5000, "float64", seed=round_)
            y = contribution(comm, 5000, "float64", seed=100 + round_)
            request = mar.iallreduce(x, op=op, comm=comm, algorithm=algorithm)
            blocking = mar.allreduce(y, op=op, comm=comm, algorithm=algorithm)
            assert_matches_native(comm, y, blocking, MPI.SUM)
            assert_matches_native(comm, x, request.wait(), MPI.SUM)
    finally:
        op.Free()


@pytest.mark.parametrize("algorithm", ["native", "ring", "tree"])
def test_a_plan_in_flight_refuses_run_start_and_free(comm, algorithm):
    x = contribution(comm, 64, "float64")
    out = np.empty_like(x)
    plan = mar.plan(x, out, comm=comm, algorithm=algorithm)
    request = plan.start()
    for call in (plan.run, plan.start, plan.free, lambda: mar.start(plan)):
        with pytest.raises(ValueError, match="in flight"):
            call()
    assert request.wait() is out
    assert_matches_native(comm, x, out, MPI.SUM)
    out.fill(np.nan)
    assert plan.run() is out  # usable again once waited
    assert_matches_native(comm, x, out, MPI.SUM)
    plan.free()


@pytest.mark.mpi(min_size=2)
def test_a_timeout_marks_the_communicator_in_the_callers_thread(short_close, comm, monkeypatch):
    # The progress thread must never drop (free) cached plans the caller's thread may be
    # running: every mark_broken happens in the thread that called wait().
    mar.allreduce(np.zeros(1), comm=comm)
    state = _state.existing(comm)
    threads = []
    original = state.mark_broken
    monkeypatch.setattr(state, "mark_broken", lambda *a, **k: (
        threads.append(__import__("threading").current_thread()), original(*a, **k))[1])
    if comm.rank == 0:  # the others never make the call
        request = mar.iallreduce(np.ones(8), comm=comm, algorithm="ring", check=False,
                                 timeout=0.3)
        with pytest.raises(mar.CollectiveTimeout, match="no answer"):
            request.wait()
        assert threads and all(t is __import__("threading").main_thread() for t in threads)
    comm.Barrier()


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_a_blocking_call_between_start_and_wait_in_any_rank_order(comm, algorithm):
    # Rank 0 makes the blocking call before waiting, the others after: the request must
    # progress while rank 0 blocks (the progress thread), as MPI's own would.
    x, y = contribution(comm, 3001, "float64"), contribution(comm, 17, "int64", seed=5)
    request = mar.iallreduce(x, comm=comm, algorithm=algorithm)
    if comm.rank == 0:
        blocking = mar.allreduce(y, comm=comm, algorithm="ring")
        out = request.wait()
    else:
        out = request.wait()
        blocking = mar.allreduce(y, comm=comm, algorithm="ring")
    assert_matches_native(comm, x, out, MPI.SUM)
    assert_matches_native(comm, y, blocking, MPI.SUM)


def test_started_plans_of_every_kind_waited_in_any_order(comm):
    xs = [contribution(comm, n, "float64", seed=n) for n in (1, 5, 300, 4000)]
    outs = [np.empty_like(x) for x in xs]
    plans = [mar.plan(x, out, comm=comm, algorithm=algorithm)
             for x, out, algorithm in zip(xs, outs, ["native", "ring", "tree", "rabenseifner"])]
    try:
        for round_ in range(3):
            for i, x in enumerate(xs):
                x[:] = contribution(comm, x.size, "float64", seed=10 * round_ + i)
            requests = [plan.start() for plan in plans]
            order = [3, 0, 2, 1] if round_ % 2 else [1, 2, 0, 3]
            for i in order:
                assert requests[i].wait() is outs[i]
            for x, out in zip(xs, outs):
                assert_matches_native(comm, x, out, MPI.SUM)
    finally:
        for plan in plans:
            plan.free()


@pytest.mark.parametrize("algorithm", ["native", "ring", "recursive_doubling"])
def test_a_dropped_request_completes_and_later_calls_are_right(comm, algorithm):
    import gc

    x = contribution(comm, 500, "float64")
    out = np.empty_like(x)
    mar.iallreduce(x, out, comm=comm, algorithm=algorithm)  # never waited
    gc.collect()
    y = contribution(comm, 500, "float64", seed=3)
    assert_matches_native(comm, y, mar.iallreduce(y, comm=comm, algorithm=algorithm).wait(),
                          MPI.SUM)
    assert_matches_native(comm, y, mar.allreduce(y, comm=comm, algorithm=algorithm), MPI.SUM)


@pytest.mark.parametrize("algorithm", ["native", "ring", "tree"])
def test_drop_in_requests_match_mpi(comm, algorithm):
    drop_in = mar.Comm(comm, algorithm)
    x = contribution(comm, 77, "float64")
    out = np.empty_like(x)
    drop_in.Iallreduce(x, out, MPI.SUM).Wait()
    assert_matches_native(comm, x, out, MPI.SUM)
    request = drop_in.Allreduce_init(x, out, MPI.SUM)
    for round_ in range(3):
        x[:] = contribution(comm, 77, "float64", seed=round_)
        out.fill(np.nan)
        request.Start()
        request.Wait()
        assert_matches_native(comm, x, out, MPI.SUM)
    request.Free()


@pytest.mark.parametrize("algorithm", ALGORITHMS + ["shm"])
def test_a_repeated_iallreduce_with_the_same_arrays_is_right_every_time(comm, algorithm):
    # the second call on finds its set-up in the call cache (MPI's arguments, or a plan that
    # takes a new slot of tags per start)
    x = contribution(comm, 301, "float64")
    out, buf = np.empty_like(x), np.empty_like(x)
    for round_ in range(4):
        x[:] = contribution(comm, 301, "float64", seed=round_)
        out.fill(np.nan)
        assert mar.iallreduce(x, out, comm=comm, algorithm=algorithm).wait() is out
        assert_matches_native(comm, x, out, MPI.SUM)
        buf[:] = x
        mar.iallreduce(MPI.IN_PLACE, buf, op=mar.AVG, comm=comm, algorithm=algorithm).wait()
        assert_matches_native(comm, x, buf, MPI.SUM, average=True)
    cached = [key for key in _state.CALLS
              if key[0] == id(comm) and key[2] == id(out) + _plans.IALLREDUCE]
    assert len(cached) == 1


@pytest.mark.parametrize("algorithm", ["native", "ring", "rabenseifner", "shm"])
def test_repeated_iallreduces_in_flight_together_complete_in_any_order(comm, algorithm):
    # Cached entries (the same arrays every round) start lean: a schedule posts its first step
    # from a flat program of fresh messages in a new slot per start, which test() (or another
    # start, or the progress thread) turns into a stepwise run; native hands its work object
    # from one request to the next. Three in flight at once, polled and waited in any order.
    xs = [contribution(comm, count, "float64", seed=s) for s, count in enumerate((301, 7, 64))]
    outs = [np.empty_like(x) for x in xs]
    for round_ in range(3):
        for s, x in enumerate(xs):
            x[:] = contribution(comm, x.size, "float64", seed=10 * round_ + s)
        requests = [mar.iallreduce(x, out, comm=comm, algorithm=algorithm)
                    for x, out in zip(xs, outs)]
        while not requests[1].test():
            pass
        for i in (2, 0, 1):
            assert requests[i].wait() is outs[i]
            assert_matches_native(comm, xs[i], outs[i], MPI.SUM)


def test_a_cached_native_iallreduce_hands_its_work_from_request_to_request(comm):
    # A request in flight holds its work object alone (so one dropped in flight is kept, with
    # its buffers, until MPI completes it: _NativeWork.__del__); once complete it hands the
    # object back to its cache entry, and the next request of the entry carries it.
    x = contribution(comm, 50, "float64")
    out = np.empty_like(x)
    mar.iallreduce(x, out, comm=comm, algorithm="native").wait()
    entry = _state.LAST[id(out) + _plans.IALLREDUCE]
    work = entry.work
    assert work is not None
    for seed in (1, 2):
        x[:] = contribution(comm, 50, "float64", seed=seed)
        request = mar.iallreduce(x, out, comm=comm, algorithm="native")
        assert entry.work is None and request._work is work
        assert request.wait() is out
        assert entry.work is work
        assert_matches_native(comm, x, out, MPI.SUM)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("algorithm", ["ring", "recursive_doubling", "tree"])
@pytest.mark.parametrize("timeout", [60, None])
def test_ranks_whose_call_caches_differ_still_match_their_messages(comm, algorithm, timeout):
    # Rank 0 keeps nothing in its call cache, the others keep everything: a cached schedule
    # entry must still take the same slot of tags as a rank that binds the call afresh, or two
    # requests in flight at once (and the explicit plan made after them) swap messages or hang.
    mar.allreduce(np.zeros(1), comm=comm)  # the communicator's state, then its cache size
    if comm.rank == 0:
        _state.state(comm).calls.max_entries = 0
    a, b = contribution(comm, 257, "float64", seed=1), contribution(comm, 33, "int64", seed=2)
    out_a, out_b = np.empty_like(a), np.empty_like(b)
    for round_ in range(3):
        a[:] = contribution(comm, 257, "float64", seed=10 + round_)
        # (a timeout, so that swapped messages fail the test instead of hanging the job; without
        # one, the others' cached entries start lean, and swapped messages of different sizes
        # raise MPI's truncation error)
        first = mar.iallreduce(a, out_a, comm=comm, algorithm=algorithm, timeout=timeout)
        second = mar.iallreduce(b, out_b, comm=comm, algorithm=algorithm, timeout=timeout)
        second.wait()
        first.wait()
        assert_matches_native(comm, a, out_a, MPI.SUM)
        assert_matches_native(comm, b, out_b, MPI.SUM)
    y = contribution(comm, 100, "float64", seed=7)
    with mar.plan(y, comm=comm, algorithm=algorithm) as plan:
        request = mar.iallreduce(a, out_a, comm=comm, algorithm=algorithm)
        assert_matches_native(comm, y, plan.run(), MPI.SUM)
        request.wait()
    assert_matches_native(comm, a, out_a, MPI.SUM)


@pytest.mark.parametrize("algorithm", ["ring", "recursive_doubling", "rabenseifner"])
def test_a_started_plan_completes_through_test_and_alongside_a_blocking_call(comm, algorithm):
    # A started plan's first step is posted at the start; whatever else happens before its
    # wait (test(), the progress thread while rank 0 blocks in another collective) carries it
    # on step by step.
    x, y = contribution(comm, 3001, "float64"), contribution(comm, 17, "int64", seed=5)
    out = np.empty_like(x)
    with mar.plan(x, out, comm=comm, algorithm=algorithm) as plan:
        request = plan.start()
        while not request.test():
            pass
        assert_matches_native(comm, x, out, MPI.SUM)
        x[:] = contribution(comm, 3001, "float64", seed=9)
        request = plan.start()
        if comm.rank == 0:
            blocking = mar.allreduce(y, comm=comm, algorithm="ring")
            request.wait()
        else:
            request.wait()
            blocking = mar.allreduce(y, comm=comm, algorithm="ring")
        assert_matches_native(comm, x, out, MPI.SUM)
        assert_matches_native(comm, y, blocking, MPI.SUM)
