"""The shm protocol under random stalls: every regime, many epochs, checked on every rank.

The test hook :data:`mpiallreduce.shm.STALLS` makes every plan bound while it is set sleep at
random (a few hundred µs, on random ranks, at random steps) between its protocol steps, so the
ranks reach publish, wait, reduce and copy-out at different times in every epoch. A protocol
bug that a fast machine hides (data published before it is loaded, a wait skipped, a parity
slot or chunk buffer reused before the peers finished reading it) then shows as a wrong
result: inputs change every round, and each round is compared with ``comm.Allreduce``.

Both memory orderings run: ``FENCE=True`` (``Win.Sync`` between data and counter, the path of
weakly ordered CPUs) is set for a communicator of its own on x86 too.
"""

from __future__ import annotations

import faulthandler
import os
import tempfile
from functools import partial

import numpy as np
import pytest
from mpi4py import MPI

import mpiallreduce as mar
from mpiallreduce import shm

pytestmark = pytest.mark.mpi

#: rounds per case, each of BACK_TO_BACK epochs of one kind of call (a plan's run, its run with
#: a timeout, a one-shot call; the kind changes every round)
ROUNDS = 4
BACK_TO_BACK = 3
#: seconds a test may take before it is taken for a hang (stacks dumped, the job ended)
HANG_SECONDS = 300
#: (dtype, op) pairs; inputs are small integers, so every order of the reduction gives the same
#: bits and results compare exactly
OPS = [("int64", "SUM"), ("int32", "MAX"), ("float64", "SUM"), ("float32", "MIN"),
       ("complex128", "PROD"), ("float64", "AVG")]


@pytest.fixture(params=[False, True], ids=["tso", "fence"])
def comm(request, monkeypatch):
    """A communicator of its own (its node, windows and plans made under the hook), with
    stalls on and 4 KiB chunks; ``fence``: the Win.Sync path of weakly ordered memory."""
    monkeypatch.setattr(shm, "FENCE", request.param)
    monkeypatch.setattr(shm, "CHUNK_BYTES", 4096)
    monkeypatch.setattr(shm, "MAX_CHUNKS", 64)
    monkeypatch.setattr(shm, "STALLS", shm.Stalls(seed=MPI.COMM_WORLD.rank + 1,
                                                  probability=0.3, longest=3e-4))
    comm = MPI.COMM_WORLD.Dup()
    # a protocol bug may leave ranks waiting for each other: then every rank writes its stacks
    # to a file and exits (the job ends instead of hanging)
    path = os.path.join(tempfile.gettempdir(), f"shm-stress-hang.{os.getpid()}.{MPI.COMM_WORLD.rank}.txt")
    with open(path, "w") as stacks:
        faulthandler.dump_traceback_later(HANG_SECONDS, exit=True, file=stacks)
        yield comm
        faulthandler.cancel_dump_traceback_later()
    os.remove(path)
    comm.Free()


def _buffer(comm, count: int, dtype: str, shared: bool):
    return shm.shared_empty(count, dtype, comm=comm) if shared else np.empty(count, dtype)


def _inputs(comm, count: int, dtype: str, op_name: str, round_: int) -> np.ndarray:
    """This rank's input of a round: small integers (ones and twos for PROD), a new draw every
    round and rank, so data of another round or rank never passes for the right one."""
    rng = np.random.default_rng([round_, comm.rank, count])
    if op_name == "PROD":
        x = rng.integers(1, 3, count) + 1j * rng.integers(0, 2, count)
        return x.astype(dtype)
    return rng.integers(-1000, 1000, count).astype(dtype)


def _stress(comm, count: int, dtype: str, op_name: str, *, in_place: bool,
            shared_send: bool = False, shared_recv: bool = False, regime=None) -> None:
    """ROUNDS x BACK_TO_BACK epochs of one call's plan (untimed, timed) and one-shot calls,
    inputs changing every epoch, each result compared with comm.Allreduce on every rank."""
    average = op_name == "AVG"
    op = mar.AVG if average else getattr(MPI, op_name)
    native = MPI.SUM if average else op
    recv = _buffer(comm, count, dtype, shared_recv)
    send = None if in_place else _buffer(comm, count, dtype, shared_send)
    args = (MPI.IN_PLACE, recv) if in_place else (send, recv)
    plan = mar.plan(*args, op=op, comm=comm, algorithm="shm")
    if regime is not None and comm.size > 1 and count:
        assert isinstance(plan, regime), type(plan)
    calls = (plan.run, partial(plan.run, timeout=60.0),
             partial(mar.allreduce, *args, op=op, comm=comm, algorithm="shm"))
    wrong = []
    try:
        for round_ in range(ROUNDS):
            # BACK_TO_BACK epochs of one kind of call with no collective between them (a rank
            # may start the next while a peer still reads this one), then each checked
            inputs, results, raised = [], [], False
            for epoch in range(BACK_TO_BACK):
                x = _inputs(comm, count, dtype, op_name, BACK_TO_BACK * round_ + epoch)
                (recv if in_place else send)[...] = x
                inputs.append(x)
                try:  # an error on some ranks only is a failure of every rank, in step with them
                    calls[round_ % len(calls)]()
                except (ValueError, mar.CollectiveTimeout) as exc:
                    wrong.append(f"round {round_}: {type(exc).__name__}: {exc}")
                    raised = True
                results.append(recv.copy())
            for epoch, (x, result) in enumerate(zip(inputs, results)):
                expected = np.empty_like(x)
                comm.Allreduce(x, expected, op=native)
                if average:
                    expected = np.divide(expected, comm.size, dtype=expected.dtype)
                if not raised and not np.array_equal(result, expected):
                    bad = np.flatnonzero(result != expected)
                    wrong.append(f"round {round_} epoch {epoch}: {bad.size} of {count} elements "
                                 f"wrong, first [{bad[0]}] = {result[bad[0]]!r}, expected "
                                 f"{expected[bad[0]]!r}")
    finally:
        plan.free()
        for array in (send, recv):
            if isinstance(array, shm.SharedArray):
                array.free()
    every = comm.allgather(wrong)
    assert not any(every), (f"{count} x {dtype} {op_name} (in place: {in_place}, shared send: "
                            f"{shared_send}, shared recv: {shared_recv}): " + "; ".join(
                                f"rank {rank}: {', '.join(text)}"
                                for rank, text in enumerate(every) if text))


def _small_counts(p: int) -> list[int]:
    """0, 1, below p, odd, and near the small regime's limit (float64 at p ranks)."""
    return sorted({0, 1, max(p - 1, 1), 7, 1001, shm.small_bytes(p) // 8 - 3})


@pytest.mark.parametrize("in_place", [False, True], ids=["out", "in_place"])
def test_small_regime_under_stalls(comm, in_place):
    for count in _small_counts(comm.size):
        for dtype, op_name in OPS:
            if count > 1001 and dtype != "float64":
                continue
            _stress(comm, count, dtype, op_name, in_place=in_place, regime=shm.SmallPlan)


@pytest.mark.parametrize("in_place", [False, True], ids=["out", "in_place"])
def test_chunked_regime_under_stalls(comm, in_place):
    """Private results past the small regime: many 4 KiB chunks, odd counts."""
    for extra in (1, 4096 // 8 * 3 + comm.size + 1):
        for dtype, op_name in (("float64", "SUM"), ("int64", "SUM"), ("float64", "AVG")):
            count = shm.small_bytes(comm.size) // 8 + extra
            _stress(comm, count, dtype, op_name, in_place=in_place, regime=shm.ChunkedPlan)


@pytest.mark.parametrize("placement", ["shared_send", "shared_recv", "shared_both",
                                       "shared_in_place"])
def test_shared_arrays_under_stalls(comm, placement):
    """Shared arrays read (and a shared result written) in place: the direct regime, and the
    chunked one reading shared inputs; small and large counts."""
    in_place = placement == "shared_in_place"
    shared_send = placement in ("shared_send", "shared_both")
    shared_recv = placement != "shared_send"
    for dtype, op_name in (("float64", "SUM"), ("int32", "MAX"), ("float64", "AVG")):
        large = shm.SMALL_BYTES // np.dtype(dtype).itemsize + 2 * comm.size + 1
        for count in (1, max(comm.size - 1, 1), 1001, large):
            regime = None
            if count == large:
                regime = shm.DirectPlan if shared_recv else shm.ChunkedPlan
            _stress(comm, count, dtype, op_name, in_place=in_place, shared_send=shared_send,
                    shared_recv=shared_recv, regime=regime)


def test_the_hook_is_off_and_unbound_in_production():
    """Without the hook a plan's programs hold no stall (nothing checked at run time)."""
    assert shm.STALLS is None
    comm = MPI.COMM_WORLD.Dup()
    try:
        x = np.ones(5)
        plan = mar.plan(x, comm=comm, algorithm="shm")
        if comm.size > 1:
            assert not isinstance(plan._phase, shm.protocol.Stalled)
        plan.free()
    finally:
        comm.Free()


class _Counted(shm.Stalls):
    """The hook, counting its stalls instead of sleeping."""

    def __init__(self):
        super().__init__(seed=0, probability=1.0, longest=0.0)
        self.calls = 0

    def __call__(self) -> None:
        self.calls += 1


def test_the_hook_stalls_every_regime(monkeypatch):
    """Plans of every regime bound while the hook is set stall between their steps (else the
    tests above would run the protocol as production does, and catch less), and still give
    comm.Allreduce's result on every rank."""
    monkeypatch.setattr(shm, "CHUNK_BYTES", 4096)
    comm = MPI.COMM_WORLD.Dup()
    large = shm.SMALL_BYTES_TWO_RANKS // 8 + 2 * comm.size + 1
    verdicts = []
    try:
        for count, shared, regime in ((7, False, shm.SmallPlan), (large, False, shm.ChunkedPlan),
                                      (large, True, shm.DirectPlan)):
            counted = _Counted()
            monkeypatch.setattr(shm, "STALLS", counted)
            recv = _buffer(comm, count, "float64", shared)
            x = _inputs(comm, count, "float64", "SUM", count)
            recv[...] = x
            plan = mar.plan(MPI.IN_PLACE, recv, comm=comm, algorithm="shm")
            try:
                plan.run()
                expected = np.empty_like(x)
                comm.Allreduce(x, expected)
                verdicts.append((regime.__name__, comm.size == 1 or (
                    isinstance(plan, regime) and counted.calls > 0),
                    np.array_equal(recv, expected)))
            finally:
                plan.free()
                if shared:
                    recv.free()
    finally:
        comm.Free()
    every = MPI.COMM_WORLD.allgather(verdicts)
    assert all(stalled and right for verdict in every for _, stalled, right in verdict), every
