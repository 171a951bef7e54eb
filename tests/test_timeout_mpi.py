"""Timeouts: when one rank skips a collective, the others raise CollectiveTimeout, never before
the timeout (and within a bound so generous that only a hang exceeds it), naming the algorithm,
the step and exactly the peers that step waits for (as the schedule says: :func:`_waits`), or
saying plainly that MPI's own collective cannot tell; the plan and the communicator refuse
further use on those ranks.

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
from mpiallreduce import _agree, _state, algorithms, executor, shm
from mpiallreduce._waiting import unanswered
from mpiallreduce.partition import block, block_counts

pytestmark = pytest.mark.mpi(min_size=2)

SCHEDULES = [name for name in mar.ALGORITHMS if name not in ("native", "auto")]
TIMEOUT = 0.3  # short: each run of this file waits it out some 50 times
#: seconds past the timeout that only a hang exceeds (no speed is measured here: other jobs share
#: the machine's cores, and a stuck rank would otherwise wait for the job's own timeout)
HANG = 120.0
COUNT = 64  # small enough that every message is sent eagerly
#: float64 elements (4 MiB) whose every message travels by rendezvous: a send completes only
#: once its receive is posted (Open MPI's shared-memory eager limit is 4 KiB, MPICH's 64 KiB)
LARGE = 1 << 19
SKIPPER = 0
#: the point-to-point schedules (hierarchical and cascade told so: intra="p2p")
P2P = {name: {"intra": "p2p"} if name in ("hierarchical", "cascade") else {}
       for name in SCHEDULES if name != "shm"}


def _throwaway_comm(algorithm="ring"):
    """A Dup of COMM_WORLD on which ``algorithm`` has run once: its private Dup and (for the
    hierarchical algorithms) its topology exist, so the skipped call has nothing collective
    left to set up before its first message."""
    world = MPI.COMM_WORLD
    comm = world.Dup()
    x = contribution(comm, COUNT, "float64")
    assert_matches_native(comm, x, mar.allreduce(x, comm=comm, algorithm=algorithm), MPI.SUM)
    return comm


def _waits(schedule, eager: bool = True) -> dict:
    """Where each rank of ``schedule`` but SKIPPER waits when SKIPPER never makes the call:
    rank -> ``(step index, peers whose messages have not arrived, peers that have not posted
    the receive for this rank's)``, or None where the rank completes.

    A rank posts a step once its earlier steps completed. A receive completes once its peer has
    posted the same step; a send at once where MPI sends it eagerly (``eager``), else (by
    rendezvous) once its peer has posted the step. A peer that has not posted the step is named
    once, as not sent, where this rank also receives from it.
    """
    steps = [[(index, step) for index, step in enumerate(mine) if step] for mine in schedule.ranks]
    at = [0 if rank != SKIPPER else None for rank in range(schedule.nranks)]

    def posted(peer, index):
        return peer != SKIPPER and (at[peer] == len(steps[peer]) or steps[peer][at[peer]][0] >= index)

    moved = True
    while moved:
        moved = False
        for rank, mine in enumerate(steps):
            if rank != SKIPPER and at[rank] < len(mine):
                index, step = mine[at[rank]]
                peers = [recv.peer for recv in step.recvs]
                if not eager:
                    peers += [send.peer for send in step.sends]
                if all(posted(peer, index) for peer in peers):
                    at[rank] += 1
                    moved = True
    waits = {}
    for rank, mine in enumerate(steps):
        if rank == SKIPPER:
            continue
        if at[rank] == len(mine):
            waits[rank] = None
            continue
        index, step = mine[at[rank]]
        not_sent = sorted({recv.peer for recv in step.recvs if not posted(recv.peer, index)})
        not_received = [] if eager else sorted(
            {send.peer for send in step.sends if not posted(send.peer, index)} - {*not_sent})
        waits[rank] = (index, not_sent, not_received)
    return waits


def _numbers(text: str | None) -> list[int]:
    return [] if text is None else [int(n) for n in re.findall(r"\d+", text)]


def _named(message: str) -> tuple[int, list[int], list[int], list[int]]:
    """What a schedule's timeout message names: ``(step, every rank named, ranks that have not
    sent, ranks that have not posted their receive)``."""
    step = re.search(r"no answer from rank\(s\) ([\d, ]+) in step (\d+) within", message)
    assert step, message
    sent = re.search(r"ranks? ([\d, and]+) ha(?:s|ve) not sent (?:its|their) step (\d+) "
                     r"messages?", message)
    posted = re.search(r"ranks? ([\d, and]+) ha(?:s|ve) not posted the receive for this rank's "
                       r"step (\d+) message", message)
    for found in (sent, posted):
        assert found is None or found.group(2) == step.group(2), message
    return (int(step.group(2)), _numbers(step.group(1)), _numbers(sent and sent.group(1)),
            _numbers(posted and posted.group(1)))


def _schedule_of(comm, algorithm: str, count: int, **params):
    """The whole schedule a call of ``algorithm`` runs on ``comm`` (the topology it found)."""
    topology = (_state.state(comm).default_topology() if algorithms.get(algorithm).uses_topology
                else None)
    return algorithms.build(algorithm, comm.size, count, topology=topology, **params)


def _assert_names_what_it_waits_for(messages, waits, label: str) -> None:
    """Every rank but SKIPPER names exactly the peers ``waits`` says, in its words."""
    problems = []
    for rank, message in _timed_out(messages):
        index, not_sent, not_received = waits[rank]
        expected = (index, sorted({*not_sent, *not_received}), not_sent, not_received)
        if not message.startswith(f"{label} on rank {rank}: no answer from rank(s) ") \
                or _named(message) != expected:
            problems.append(f"rank {rank}: expected {expected}, got {message!r}")
        who = "it" if len(expected[1]) == 1 else "each"
        if f"in step {index} within {TIMEOUT:g} s: " not in message \
                or f"({who} has not made this call, or waits itself for a rank that has not; " \
                   f"or ranks run plans or calls on this communicator in different orders)" \
                not in message:
            problems.append(f"rank {rank}: the causes are not told: {message!r}")
    assert not problems, problems


def _skip_or_time_out(comm, call):
    """Rank SKIPPER skips ``call``; the others must raise in time: CollectiveTimeout, or
    CommunicatorRevoked where another waiting rank timed out first and its alarm came before
    this rank's own deadline (at least one rank times out; a revoked one names a rank that
    did). Returns every rank's timeout message, None for the skipper and the revoked ranks
    (:func:`_timed_out` reads them)."""
    world = MPI.COMM_WORLD
    world.Barrier()  # everyone starts together, so only the skipper is late
    message = heard = None
    if comm.rank != SKIPPER:
        start = time.monotonic()
        with pytest.raises((mar.CollectiveTimeout, mar.CommunicatorRevoked)) as info:
            call()
        elapsed = time.monotonic() - start
        # (a revoked rank may have left the barrier a moment after the rank that timed out)
        least = TIMEOUT if info.type is mar.CollectiveTimeout else TIMEOUT / 2
        assert elapsed >= least, f"raised after {elapsed:.2f} s, before the timeout"
        assert elapsed < TIMEOUT + HANG, f"raised after {elapsed:.2f} s: it hung"
        if info.type is mar.CollectiveTimeout:
            message = str(info.value)
        else:
            heard = info.value.rank
    world.Barrier()  # the skipper waits here until every other rank has timed out
    messages, heards = world.allgather(message), world.allgather(heard)
    if comm.size > 1:
        assert any(m is not None for m in messages), messages
    for rank, who in enumerate(heards):
        assert who is None or (who != SKIPPER and messages[who] is not None), (rank, who)
    return messages


def _timed_out(messages):
    """``(rank, message)`` of every rank that raised CollectiveTimeout (:func:`_skip_or_time_out`)."""
    return [(rank, message) for rank, message in enumerate(messages) if message is not None]


def _drain_messages(comm):
    """Receive every point-to-point message left on the private Dup, whatever its size (sends
    too large to go eagerly still wait for it); end with a flush mark."""
    private = _state.state(comm).private
    flush = private.Get_attr(MPI.TAG_UB)
    marks = [private.Isend(np.empty(0), peer, flush) for peer in range(comm.size) if peer != comm.rank]
    status = MPI.Status()
    for peer in range(comm.size):
        if peer == comm.rank:
            continue
        while True:  # MPI's non-overtaking rule: the mark comes after everything peer sent
            message = private.Mprobe(peer, MPI.ANY_TAG, status)
            message.Recv([np.empty(status.Get_count(MPI.BYTE), np.uint8), MPI.BYTE])
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


def _assert_refused_later(comm, skipper_hears: bool = True):
    """Every rank, the skipper too (it hears the others' alarm), refuses the communicator with
    CommunicatorRevoked naming a rank that gave up, and its reason. (``skipper_hears`` False:
    the others gave up setting up the communicator, before the alarm's channel existed.)"""
    if comm.rank == SKIPPER and not skipper_hears:
        return
    with pytest.raises(mar.CommunicatorRevoked, match="the communicator is revoked: rank "
                                                      r"\d+ gave up on a collective \(.*\); no "
                                                      "mpiallreduce call on it can run again") \
            as info:
        mar.allreduce(np.zeros(COUNT), comm=comm, algorithm="ring")
    assert info.value.rank != SKIPPER and info.value.reason, info.value


@pytest.mark.parametrize("algorithm", SCHEDULES)
def test_a_skipped_call_times_out_inside_the_schedule(algorithm, monkeypatch):
    # shm: the healthy rank's close of the node gives up after 1 s instead of 10
    monkeypatch.setattr(shm, "CLOSE_SECONDS", 0.5)
    comm = _throwaway_comm(algorithm)
    x = contribution(comm, COUNT, "float64")
    with mar.plan(x, comm=comm, algorithm=algorithm) as p:  # the transport the call takes
        schedule = isinstance(p, executor.Plan)
    messages = _skip_or_time_out(
        comm, lambda: mar.allreduce(x, comm=comm, algorithm=algorithm, check=False,
                                    timeout=TIMEOUT))
    if schedule:  # exactly the peers of this rank's pending receives in its step
        waits = _waits(_schedule_of(comm, algorithm, COUNT))
        assert all(waits.values()), f"some rank does not wait for the skipper: {waits}"
        _assert_names_what_it_waits_for(messages, waits, f"{algorithm} allreduce")
    else:  # shared memory: every rank that has not arrived, the skipper alone
        for rank, message in _timed_out(messages):
            assert message.startswith(f"{algorithm} allreduce on rank {rank}: no answer from "
                                      f"rank(s) {SKIPPER} in step 0 within {TIMEOUT:g} s"), message
    for _, message in _timed_out(messages):
        assert message.endswith("; the plan is unusable now"), message
    _drain_messages(comm)
    _assert_refused_later(comm)
    comm.Free()


@pytest.mark.parametrize("algorithm", ["recursive_doubling", "ring"])
def test_a_skipped_repeated_call_times_out_in_its_cached_timed_run(algorithm):
    # the same arrays with a timeout: the cache's entry runs the plan's flat polled program
    # (Plan.run_timed, no run() checks); a skipped third call still times out in its step
    comm = _throwaway_comm(algorithm)
    x = contribution(comm, COUNT, "float64")
    out = np.empty_like(x)
    for _ in range(2):
        mar.allreduce(x, out, comm=comm, algorithm=algorithm, check=False, timeout=60.0)
        assert_matches_native(comm, x, out, MPI.SUM)
    entry = _state.LAST[id(out)]
    assert entry.timed == entry.plan.run_timed
    messages = _skip_or_time_out(
        comm, lambda: mar.allreduce(x, out, comm=comm, algorithm=algorithm, check=False,
                                    timeout=TIMEOUT))
    waits = _waits(_schedule_of(comm, algorithm, COUNT))
    _assert_names_what_it_waits_for(messages, waits, f"{algorithm} allreduce")
    _drain_messages(comm)
    _assert_refused_later(comm)
    comm.Free()


def test_a_schedules_message_in_full():
    """One message word for word: rank 1 of a ring waits for rank 0's first message."""
    comm = _throwaway_comm()
    x = contribution(comm, COUNT, "float64")
    messages = _skip_or_time_out(
        comm, lambda: mar.allreduce(x, comm=comm, algorithm="ring", check=False, timeout=TIMEOUT))
    assert messages[1] in (None, f"ring allreduce on rank 1: no answer from rank(s) 0 in step 0 within "
                           f"{TIMEOUT:g} s: rank 0 has not sent its step 0 message (it has not "
                           f"made this call, or waits itself for a rank that has not; or ranks "
                           f"run plans or calls on this communicator in different orders); the "
                           f"plan is unusable now")
    _drain_messages(comm)
    comm.Free()


@pytest.mark.parametrize("algorithm", list(P2P))
def test_a_skipped_call_names_the_peers_that_have_not_posted_their_receive(algorithm,
                                                                          monkeypatch):
    """Messages too large to send eagerly: a send waits for its receive, so a rank whose step
    only sends to a rank that never came names it too, as not having posted the receive."""
    # hierarchical, cascade: the healthy ranks' close of the node gives up after 0.5 s, not 10
    monkeypatch.setattr(shm, "CLOSE_SECONDS", 0.5)
    comm = _throwaway_comm(algorithm)
    x = contribution(comm, LARGE, "float64")
    messages = _skip_or_time_out(
        comm, lambda: mar.allreduce(x, comm=comm, algorithm=algorithm, check=False,
                                    timeout=TIMEOUT, **P2P[algorithm]))
    waits = _waits(_schedule_of(comm, algorithm, LARGE, **P2P[algorithm]), eager=False)
    assert all(waits.values()), f"some rank does not wait for the skipper: {waits}"
    _assert_names_what_it_waits_for(messages, waits, f"{algorithm} allreduce")
    _drain_messages(comm)
    _assert_refused_later(comm)
    comm.Free()


def test_the_peers_named_in_one_sentence():
    assert unanswered(3, [0, 2], []) == (
        "ranks 0 and 2 have not sent their step 3 messages (each has not made this call, or "
        "waits itself for a rank that has not; or ranks run plans or calls on this "
        "communicator in different orders)")
    assert unanswered(1, [4], [1, 5, 6]) == (
        "rank 4 has not sent its step 1 message; ranks 1, 5 and 6 have not posted the receive "
        "for this rank's step 1 message (each has not made this call, or waits itself for a "
        "rank that has not; or ranks run plans or calls on this communicator in different "
        "orders)")
    assert unanswered(0, [], [2], "the matching call", slow=True) == (
        "rank 2 has not posted the receive for this rank's step 0 message (it has not made the "
        "matching call, or is slow, or waits itself for a rank that has not; or ranks run plans "
        "or calls on this communicator in different orders)")
    assert _named("x on rank 3: no answer from rank(s) 0, 2 in step 4 within 1 s: ranks 0 "
                  "and 2 have not sent their step 4 messages (...)") == (4, [0, 2], [0, 2], [])


@pytest.mark.parametrize("algorithm", ["ring", "native"])
def test_a_skipped_call_times_out_in_the_argument_check(algorithm):
    comm = _throwaway_comm(algorithm)
    x = contribution(comm, COUNT, "float64")
    messages = _skip_or_time_out(
        comm, lambda: mar.allreduce(x, comm=comm, algorithm=algorithm, timeout=TIMEOUT))
    for rank, message in _timed_out(messages):
        assert message == (f"allreduce on rank {rank}: the argument check did not complete "
                           f"within {TIMEOUT:g} s; some rank of the communicator has not made "
                           f"this call, or runs calls on it in a different order, or passed "
                           f"check=False (no data has moved yet; the check is one MPI "
                           f"collective, and MPI does not say which rank is missing)")
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
    for rank, message in _timed_out(messages):
        assert message == (f"native allreduce on rank {rank}: not complete within {TIMEOUT:g} s "
                           f"(a rank did not make this call, or ranks run plans or calls on this "
                           f"communicator in different orders; MPI does not say which rank is "
                           f"missing; a rank blocked in MPI's own blocking Allreduce, without "
                           f"timeout=, cannot be told and waits); the plan is unusable now")
    # an explicit native plan runs on a communicator of its own
    _drain_collective(comm, lambda state: p.comm.Iallreduce(x, np.empty_like(x), MPI.SUM).Wait())
    if comm.rank != SKIPPER:
        with pytest.raises(mar.CommunicatorRevoked, match=f"native allreduce on rank {comm.rank}: "
                                                          f"the communicator is revoked"):
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
    for rank, message in _timed_out(messages):
        assert message == (f"native {collective} on rank {rank}: not complete within "
                           f"{TIMEOUT:g} s (MPI does not say which rank is missing)")
    _drain_collective(comm, lambda state: start(state.private).Wait())
    _assert_refused_later(comm)
    comm.Free()


def test_a_skipped_first_call_times_out_setting_up_the_communicator():
    comm = MPI.COMM_WORLD.Dup()  # no state yet: the call begins with MPI_Comm_idup
    x = contribution(comm, COUNT, "float64")
    messages = _skip_or_time_out(
        comm, lambda: mar.allreduce(x, comm=comm, algorithm="ring", timeout=TIMEOUT))
    for rank, message in _timed_out(messages):
        assert message == (f"allreduce on rank {rank}: setting up the communicator "
                           f"(MPI_Comm_idup) did not complete in time; some rank has not made "
                           f"this call (MPI does not say which rank is missing)")
    if comm.rank == SKIPPER:
        dup, request = comm.Idup()
        request.Wait()
        dup.Free()
    else:
        MPI.Request.Waitall(_state.existing(comm).stale)
    _assert_refused_later(comm, skipper_hears=False)
    comm.Free()


#: related collectives and their schedules
_RELATED = [("reduce_scatter", "ring"), ("reduce_scatter", "recursive_halving"),
            ("allgather", "ring"), ("allgather", "recursive_doubling"),
            ("bcast", "binomial"), ("bcast", "scatter_allgather"), ("alltoall", "pairwise")]


def _related_call(collective: str, comm, x: np.ndarray):
    """``(call(**keywords), the count its schedule covers, builder parameters)``."""
    n, p = x.size, comm.size
    lo, hi = block(n, p, comm.rank)
    out = np.empty(hi - lo) if collective == "reduce_scatter" else np.empty_like(x)
    return {
        "reduce_scatter": (lambda **kw: mar.reduce_scatter(x, out, **kw), n, {}),
        "allgather": (lambda **kw: mar.allgather(x[lo:hi].copy(), out, **kw), n, {}),
        "bcast": (lambda **kw: mar.bcast(out, SKIPPER, **kw), n, {"root": SKIPPER}),
        "alltoall": (lambda **kw: mar.alltoall(x, out, **kw), 2 * n, {}),
    }[collective]


@pytest.mark.parametrize("collective, algorithm", _RELATED)
def test_a_related_collectives_schedule_names_the_peers(collective, algorithm):
    comm = _throwaway_comm()
    x = contribution(comm, COUNT * comm.size, "float64")
    call, count, params = _related_call(collective, comm, x)
    messages = _skip_or_time_out(comm, lambda: call(comm=comm, algorithm=algorithm, check=False,
                                                    timeout=TIMEOUT))
    waits = _waits(algorithms.build(algorithm, comm.size, count, collective=collective, **params))
    assert all(waits.values()), f"some rank does not wait for the skipper: {waits}"
    _assert_names_what_it_waits_for(messages, waits, f"{collective} {algorithm}")
    _drain_messages(comm)
    _assert_refused_later(comm)
    comm.Free()


@pytest.mark.parametrize("kind", ["iallreduce", "start"])
def test_a_skipped_request_names_the_peers(kind):
    """A non-blocking run past its own deadline names the peers as a blocking run does."""
    comm = _throwaway_comm()
    x = contribution(comm, COUNT, "float64")
    p = mar.plan(x, comm=comm, algorithm="ring") if kind == "start" else None  # collective
    if p is None:
        call = lambda: mar.iallreduce(x, comm=comm, algorithm="ring", check=False,
                                      timeout=TIMEOUT).wait()
    else:
        call = lambda: mar.start(p, timeout=TIMEOUT).wait()
    messages = _skip_or_time_out(comm, call)
    _assert_names_what_it_waits_for(messages, _waits(_schedule_of(comm, "ring", COUNT)),
                                    "ring allreduce")
    _drain_messages(comm)
    if p is not None:
        p.free()
    _assert_refused_later(comm)
    comm.Free()


def _a_wait_times_out(comm, algorithm: str) -> list:
    """Every rank but the skipper starts an iallreduce and waits TIMEOUT on it; then the skipper
    joins late, every request completes with the native result, and every rank gets the
    waiting ranks' timeout messages (None for the skipper)."""
    world = MPI.COMM_WORLD
    x = contribution(comm, COUNT, "float64")
    world.Barrier()
    message = None
    if comm.rank != SKIPPER:
        request = mar.iallreduce(x, comm=comm, algorithm=algorithm, check=False)
        with pytest.raises(mar.CollectiveTimeout) as info:
            request.wait(timeout=TIMEOUT)
        message = str(info.value)
    world.Barrier()  # the skipper calls only now: the others' requests complete
    if comm.rank == SKIPPER:
        request = mar.iallreduce(x, comm=comm, algorithm=algorithm, check=False)
    assert_matches_native(comm, x, request.wait(), MPI.SUM)
    return world.allgather(message)


def test_a_wait_that_times_out_names_the_peers_and_leaves_the_request_in_flight():
    comm = _throwaway_comm()
    messages = _a_wait_times_out(comm, "ring")
    waits = _waits(_schedule_of(comm, "ring", COUNT))
    for rank, message in enumerate(messages):
        if rank != SKIPPER:
            index, not_sent, not_received = waits[rank]
            assert message == (f"request not complete within {TIMEOUT:g} s; it is still in "
                               f"flight: ring allreduce on rank {rank} waits in step {index}: "
                               f"{unanswered(index, not_sent, not_received, 'the matching call', slow=True)}"
                               f"; wait again, or Abort"), message
    comm.Free()


def test_a_wait_on_mpis_own_collective_says_it_cannot_tell():
    comm = _throwaway_comm()
    x = contribution(comm, COUNT, "float64")
    mar.iallreduce(x, comm=comm, algorithm="native").wait()  # its duplicate exists
    for rank, told in enumerate(_a_wait_times_out(comm, "native")):
        if rank != SKIPPER:
            assert told == (f"request not complete within {TIMEOUT:g} s; it is still in "
                            f"flight: native iallreduce on rank {rank}: a rank has not made the "
                            f"matching call, or is slow (MPI does not say which rank is "
                            f"missing); wait again, or Abort"), told
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
    # (the rank that waits for the skipper itself may hear another's alarm first)
    assert all("no answer from rank(s) " in m for _, m in _timed_out(messages)), messages
    _drain_messages(comm)
    if comm.rank != SKIPPER:
        with pytest.raises(mar.CommunicatorRevoked, match=f"{algorithm} allreduce on rank "
                                                          f"{comm.rank}: the communicator is "
                                                          f"revoked: rank \\d+ gave up"):
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


# -- mar.Comm(timeout=...): mpi4py's own collectives keep the deadline too --------------------

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
    for rank, message in _timed_out(messages):
        if rank != SKIPPER:
            assert message == (f"{name} on rank {rank}: MPI's collective did not complete within "
                               f"{TIMEOUT:g} s; some rank has not made this call (MPI does not "
                               f"say which rank is missing)")
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
