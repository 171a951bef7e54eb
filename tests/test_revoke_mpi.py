"""Revocation: once a rank gives up on a collective (a timeout, an exception in the middle of a
run), no rank returns a result that holds the abandoned call's data, the ranks still waiting
learn of it and raise, every later call on the communicator raises CommunicatorRevoked on every
rank, and ``mar.recover`` makes it usable again.

The scenario of every test in the first group: rank GAVE_UP makes a call alone and times out
(the others are elsewhere); then every rank makes the next call with new data. Before
revocation, shm's small and middle regimes and every schedule run without the argument check
returned GAVE_UP's abandoned contribution plus the late ranks' own on the late ranks: a wrong
sum, silently. Each rank's outcome is gathered before anything is asserted.
"""

from __future__ import annotations

import signal
import threading
import time

import numpy as np
import pytest
from mpi4py import MPI

import mpiallreduce as mar
from mpiallreduce import shm
from mpiallreduce._revoke import WatchedWait

pytestmark = pytest.mark.mpi(min_size=2)

GAVE_UP = 0
TIMEOUT = 0.05
#: seconds within which a rank waiting in a call learns that another gave up (the bound the
#: library keeps is far below this; the machine's other jobs share its cores)
HEAR = 1.0
#: what no wait here should approach (only a hang exceeds it)
HANG = 30.0
SCHEDULES = [name for name in mar.ALGORITHMS if name not in ("shm", "native", "auto")]
#: elements of float64: 8 B, 64 KiB (shm's middle regime at 2 ranks), 1 MiB (its large one)
SIZES = {"8B": 1, "64KiB": 8192, "1MiB": 131072}


def _values(comm, count: int, first: float, others: float) -> np.ndarray:
    return np.full(count, first if comm.rank == GAVE_UP else others)


def _entry(entry: str, comm, algorithm: str, x: np.ndarray, out: np.ndarray):
    """``call(timeout)``: one call of ``entry`` on ``comm`` with ``x`` into ``out``."""
    if entry == "allreduce":
        return lambda timeout: mar.allreduce(x, out, comm=comm, algorithm=algorithm,
                                             timeout=timeout)
    if entry == "unchecked":
        return lambda timeout: mar.allreduce(x, out, comm=comm, algorithm=algorithm,
                                             timeout=timeout, check=False)
    if entry == "plan":
        plan = mar.plan(x, out, comm=comm, algorithm=algorithm)
        return lambda timeout: plan.run(timeout=timeout)
    if entry == "iallreduce":
        return lambda timeout: mar.iallreduce(x, out, comm=comm, algorithm=algorithm,
                                              timeout=timeout).wait()
    if entry == "comm":
        comms = {timeout: mar.Comm(comm, algorithm=algorithm,
                                   **({} if timeout is None else {"timeout": timeout}))
                 for timeout in (None, TIMEOUT, HANG)}
        return lambda timeout: comms[timeout].Allreduce(x, out)
    raise AssertionError(entry)


def _outcome(call, timeout) -> tuple[str, float, object]:
    """(what happened, seconds it took, the result or the exception's rank)."""
    start = time.monotonic()
    try:
        result = call(timeout)
    except mar.CommunicatorRevoked as error:
        return "revoked", time.monotonic() - start, error.rank
    except Exception as error:  # noqa: BLE001 - every rank's outcome is gathered first
        return f"{type(error).__name__}: {error}", time.monotonic() - start, None
    return "returned", time.monotonic() - start, np.asarray(result).ravel()[:3].tolist()


def _abandon_then_call_again(algorithm: str, count: int, entry: str, late_timeout):
    """The issue's scenario on a fresh communicator: a warm call, GAVE_UP's call alone (it
    times out), then the next call everywhere (GAVE_UP with a timeout, the others with
    ``late_timeout``) and one more; then ``mar.recover`` and a correct call."""
    world = MPI.COMM_WORLD
    comm = world.Dup()
    x = _values(comm, count, 1.0, 100.0)
    out = np.empty(count)
    call = _entry(entry, comm, algorithm, x, out)
    call(HANG)
    assert np.all(out == 1.0 + 100.0 * (comm.size - 1))
    gave_up = None
    if comm.rank == GAVE_UP:
        gave_up = _outcome(call, TIMEOUT)[0]
    world.Barrier()
    x[:] = 1000.0 if comm.rank == GAVE_UP else 100.0
    out[:] = np.nan
    next_call = _outcome(call, HANG if comm.rank == GAVE_UP else late_timeout)
    later_call = _outcome(call, None)
    outcomes = world.allgather((next_call, later_call))
    gave_up = world.bcast(gave_up, root=GAVE_UP)
    mar.recover(comm)
    x[:] = comm.rank + 1.0
    fresh = _entry(entry, comm, algorithm, x, out)
    fresh(None)
    recovered = world.allgather(bool(np.all(out == comm.size * (comm.size + 1) / 2)))
    comm.Free()
    assert gave_up.startswith("CollectiveTimeout"), gave_up
    for rank, ((what, seconds, detail), (later, _, later_detail)) in enumerate(outcomes):
        assert what == "revoked", (rank, what, detail, outcomes)
        assert detail == GAVE_UP, (rank, detail)
        assert seconds < HANG / 2, (rank, seconds)
        assert later == "revoked" and later_detail == GAVE_UP, (rank, later, later_detail)
    assert all(recovered), recovered


@pytest.mark.parametrize("size", list(SIZES))
@pytest.mark.parametrize("entry", ["allreduce", "unchecked", "plan", "iallreduce", "comm"])
@pytest.mark.parametrize("algorithm", ["auto", "shm"])
@pytest.mark.parametrize("late", ["late_timeout", "no_timeout"])
def test_shared_memory_never_returns_an_abandoned_contribution(algorithm, entry, size, late):
    # (the late ranks without timeout= wait in shm for GAVE_UP's counter: its mark ends it)
    _abandon_then_call_again(algorithm, SIZES[size], entry, HANG if late == "late_timeout"
                             else None)


@pytest.mark.parametrize("size", ["8B", "1MiB"])
@pytest.mark.parametrize("entry", ["allreduce", "unchecked", "plan", "iallreduce"])
@pytest.mark.parametrize("algorithm", SCHEDULES)
def test_schedules_never_return_an_abandoned_contribution(algorithm, entry, size):
    _abandon_then_call_again(algorithm, SIZES[size], entry, HANG)


@pytest.mark.parametrize("entry", ["unchecked", "plan"])
@pytest.mark.parametrize("algorithm", ["ring", "recursive_doubling", "tree", "cascade"])
def test_a_timeout_on_some_ranks_only(algorithm, entry):
    """The late ranks call without timeout=: their untimed waits hear the alarm too."""
    _abandon_then_call_again(algorithm, SIZES["8B"], entry, None)


@pytest.mark.parametrize("entry", ["allreduce", "unchecked", "plan", "iallreduce"])
def test_native_with_a_timeout_never_returns_an_abandoned_contribution(entry):
    # (without timeout= the late ranks would wait in MPI's own blocking Allreduce, which
    # nothing can interrupt: docs/howto/errors.md, "What cannot be interrupted")
    _abandon_then_call_again("native", SIZES["8B"], entry, HANG)


@pytest.mark.parametrize("algorithm", [name for name in mar.ALGORITHMS if name != "native"])
def test_a_rank_waiting_without_timeout_hears_a_give_up_within_a_second(algorithm):
    """GAVE_UP runs a ring plan the others never run, with a timeout; they run ``algorithm``'s
    plan (one they never share with it) without one: GAVE_UP times out, and each of them must
    raise CommunicatorRevoked within HEAR seconds of that, instead of waiting forever."""
    world = MPI.COMM_WORLD
    comm = world.Dup()
    x = np.ones(64)
    mine = mar.plan(x, np.empty(64), comm=comm, algorithm="ring")
    theirs = mar.plan(x, np.empty(64), comm=comm, algorithm=algorithm)
    theirs.run()  # set-up done: the wait below is the run's own
    world.Barrier()
    if comm.rank == GAVE_UP:
        what, _, _ = _outcome(lambda timeout: mine.run(timeout=timeout), TIMEOUT)
        detail = None
    else:
        what, _, detail = _outcome(lambda timeout: theirs.run(timeout=timeout), None)
    ended = time.time()
    outcomes = world.allgather((what, ended, detail))
    comm.Free()
    gave_up_at = outcomes[GAVE_UP][1]
    assert outcomes[GAVE_UP][0].startswith("CollectiveTimeout"), outcomes
    latencies = [ended - gave_up_at for _, ended, _ in outcomes]
    for rank, (what, _, detail) in enumerate(outcomes):
        if rank != GAVE_UP:
            assert what == "revoked" and detail == GAVE_UP, (rank, what, detail)
            assert latencies[rank] < HEAR, (rank, latencies)


@pytest.mark.parametrize("algorithm", ["shm", "ring"])
def test_an_interrupt_in_a_wait_revokes(algorithm):
    """A signal's exception (Ctrl-C's KeyboardInterrupt) in GAVE_UP's wait leaves its run in the
    middle: the communicator is revoked, and the late ranks' next call raises."""
    world = MPI.COMM_WORLD
    comm = world.Dup()
    x = np.ones(16)
    out = np.empty(16)
    mar.allreduce(x, out, comm=comm, algorithm=algorithm)
    interrupted = None
    if comm.rank == GAVE_UP:
        def interrupt(signum, frame):
            raise KeyboardInterrupt
        previous = signal.signal(signal.SIGALRM, interrupt)
        # sent to the main thread alone: a process-wide timer's signal may land in any thread,
        # MPI's own or the progress thread, in the middle of a system call there (MPICH then
        # crashed later, in another test)
        timer = threading.Timer(TIMEOUT, signal.pthread_kill,
                                (threading.main_thread().ident, signal.SIGALRM))
        timer.start()
        try:
            mar.allreduce(x, out, comm=comm, algorithm=algorithm, check=False, timeout=HANG)
        except KeyboardInterrupt:
            interrupted = "KeyboardInterrupt"
        finally:
            timer.cancel()
            timer.join()
            signal.signal(signal.SIGALRM, previous)
    world.Barrier()
    outcome = _outcome(lambda timeout: mar.allreduce(x, out, comm=comm, algorithm=algorithm,
                                                     check=False, timeout=timeout), HANG)
    outcomes = world.allgather(outcome)
    interrupted = world.bcast(interrupted, root=GAVE_UP)
    mar.recover(comm)
    comm.Free()
    assert interrupted == "KeyboardInterrupt"
    for rank, (what, _, detail) in enumerate(outcomes):
        assert what == "revoked" and detail == GAVE_UP, (rank, what, detail)


class _FailAt:
    """shm's stall hook (``shm.protocol.STALLS``), bound into the plans made while it is set:
    on GAVE_UP, its ``at``-th call raises (the second: a run's "arrive" phase, before the rank
    publishes its data)."""

    def __init__(self, at: int):
        self.at, self.calls, self.rank = at, 0, None

    def bind(self, rank: int) -> None:
        self.rank = rank

    def __call__(self) -> None:
        self.calls += 1
        if self.rank == GAVE_UP and self.calls == self.at:
            raise RuntimeError("failed in the middle")


def _failing_plan(comm, algorithm: str, x, out, monkeypatch):
    """A plan whose run raises on GAVE_UP in its middle: a ring's after its first step's wait
    (the peer then waits for its second step's message), shm's before it publishes."""
    if algorithm == "shm":
        monkeypatch.setattr(shm.protocol, "STALLS", _FailAt(at=2))
        return mar.plan(x, out, comm=comm, algorithm="shm")
    plan = mar.plan(x, out, comm=comm, algorithm=algorithm)
    if comm.rank == GAVE_UP:
        def fail():
            raise RuntimeError("failed in the middle")
        program = list(plan._fast)
        first_wait = next(k for k, call in enumerate(program) if isinstance(call, WatchedWait))
        program.insert(first_wait + 1, fail)
        plan._fast = tuple(program)
    return plan


@pytest.mark.parametrize("algorithm", ["ring", "shm"])
def test_an_error_in_the_middle_of_a_run_revokes(algorithm, monkeypatch):
    """An exception in GAVE_UP's run, between its steps: its run ends in the middle, and the
    peer waiting (without timeout=) for what it would have sent next raises instead of waiting
    forever; every later call raises too."""
    world = MPI.COMM_WORLD
    comm = world.Dup()
    x = np.ones(8)
    out = np.empty(8)
    mar.allreduce(x, out, comm=comm, algorithm=algorithm)  # set-up done
    plan = _failing_plan(comm, algorithm, x, out, monkeypatch)
    world.Barrier()
    outcomes = world.allgather(_outcome(lambda timeout: plan.run(timeout=timeout), None))
    later = world.allgather(_outcome(lambda timeout: mar.allreduce(x, out, comm=comm), None))
    comm.Free()
    what, _, _ = outcomes[GAVE_UP]
    assert what == "RuntimeError: failed in the middle", outcomes
    for rank, (what, _, detail) in enumerate(outcomes):
        if rank != GAVE_UP:
            assert what == "revoked" and detail == GAVE_UP, (rank, what, detail)
    for rank, (what, _, detail) in enumerate(later):
        assert what == "revoked" and detail == GAVE_UP, (rank, what, detail)


def test_a_disagreement_revokes_nothing(comm):
    """Ranks that pass different counts all raise the same ValueError: the call ended on every
    rank alike, so the communicator stays usable."""
    if comm.size < 2:
        pytest.skip("one rank never disagrees")  # (COMM_SELF: the same on every rank)
    x = np.ones(4 + (comm.rank == GAVE_UP))
    with pytest.raises(ValueError, match="count differs"):
        mar.allreduce(x, comm=comm)
    y = np.full(3, comm.rank + 1.0)
    assert np.all(mar.allreduce(y, comm=comm) == comm.size * (comm.size + 1) / 2)


def test_the_revocation_names_who_gave_up_and_why():
    world = MPI.COMM_WORLD
    comm = world.Dup()
    x = np.ones(4)
    mar.allreduce(x, comm=comm, algorithm="ring")
    if comm.rank == GAVE_UP:
        with pytest.raises(mar.CollectiveTimeout):
            mar.allreduce(x, comm=comm, algorithm="ring", timeout=TIMEOUT)
    world.Barrier()
    with pytest.raises(mar.CommunicatorRevoked) as info:
        mar.allreduce(x, comm=comm, algorithm="ring", timeout=HANG)
    error = info.value
    assert isinstance(error, RuntimeError) and not isinstance(error, ValueError)
    assert error.rank == GAVE_UP
    assert error.reason.startswith(f"allreduce on rank {GAVE_UP}: the argument check did not "
                                   f"complete within {TIMEOUT:g} s"), error.reason
    assert f"rank {GAVE_UP} gave up on a collective ({error.reason})" in str(error)
    assert "mpiallreduce.recover(comm)" in str(error)
    mar.recover(comm)
    assert np.all(mar.allreduce(x, comm=comm, algorithm="ring") == comm.size)
    comm.Free()


@pytest.mark.parametrize("algorithm", ["auto", "ring", "native"])
def test_gradient_synchronisation_after_a_give_up_raises(algorithm):
    """GradSync runs plans and requests on the communicator: after GAVE_UP gave up on a call
    there, the next synchronisation raises CommunicatorRevoked on every rank."""
    world = MPI.COMM_WORLD
    comm = world.Dup()
    grads = [np.full(100, comm.rank + 1.0), np.full(3000, 2.0 * comm.rank)]
    sync = mar.GradSync(grads, comm, op=MPI.SUM, algorithm=algorithm, bucket_bytes=1024)
    result = sync.synchronize()
    assert np.all(result[0] == comm.size * (comm.size + 1) / 2)
    if comm.rank == GAVE_UP:
        with pytest.raises(mar.CollectiveTimeout):
            mar.allreduce(np.ones(4), comm=comm, algorithm="ring", timeout=TIMEOUT)
    world.Barrier()
    outcomes = world.allgather(_outcome(lambda timeout: sync.synchronize(), HANG))
    comm.Free()
    for rank, (what, _, detail) in enumerate(outcomes):
        assert what == "revoked" and detail == GAVE_UP, (rank, what, detail)
