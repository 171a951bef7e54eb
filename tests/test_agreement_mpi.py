"""Cross-rank agreement: ranks that pass different arguments, or bad input on some ranks, all
raise the same exception (no hang), and the communicator works afterwards."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import assert_matches_native, contribution
from mpi4py import MPI

import mpiallreduce as mar
from mpiallreduce import _agree, _checks, _plans, _state

pytestmark = pytest.mark.mpi(min_size=2)

SCHEDULES = [name for name in mar.ALGORITHMS if name not in ("native", "auto")]


def _others(comm) -> str:
    others = [r for r in range(comm.size) if r != 1]
    return ("rank " if len(others) == 1 else "ranks ") + ", ".join(map(str, others))


def _mismatch(comm, kind):
    """Arguments where rank 1 differs from the others in ``kind``; and the message expected."""
    odd = comm.rank == 1
    count, dtype, op, algorithm = 10, "float64", MPI.SUM, "ring"
    if kind == "count":
        count = 11 if odd else 10
        expected = f"count differs: 10 on {_others(comm)}; 11 on rank 1"
    elif kind == "dtype":
        dtype = "float32" if odd else "float64"
        expected = f"dtype differs: float64 on {_others(comm)}; float32 on rank 1"
    elif kind == "op":
        op = MPI.MAX if odd else MPI.SUM
        expected = f"op differs: SUM on {_others(comm)}; MAX on rank 1"
    else:
        algorithm = "native" if odd else "ring"
        expected = f"algorithm differs: ring on {_others(comm)}; native on rank 1"
    x = contribution(comm, count, dtype)
    return dict(sendbuf=x, op=op, comm=comm, algorithm=algorithm), expected


def _same_everywhere(comm, exc) -> str:
    messages = comm.allgather((type(exc).__name__, str(exc)))
    assert len(set(messages)) == 1, f"ranks raised different errors: {messages}"
    return str(exc)


def _still_works(comm):
    x = contribution(comm, 100, "float64")
    assert_matches_native(comm, x, mar.allreduce(x, comm=comm, algorithm="ring"), MPI.SUM)


@pytest.mark.parametrize("entry", ["allreduce", "plan"])
@pytest.mark.parametrize("kind", ["count", "dtype", "op", "algorithm"])
def test_a_mismatch_raises_the_same_error_on_every_rank(kind, entry):
    comm = MPI.COMM_WORLD
    kwargs, expected = _mismatch(comm, kind)
    call = mar.allreduce if entry == "allreduce" else mar.plan
    with pytest.raises(ValueError) as info:
        call(**kwargs)
    message = _same_everywhere(comm, info.value)
    assert message == f"{entry} called with different arguments on different ranks: {expected}"
    _still_works(comm)


def test_a_timeout_on_some_ranks_only_times_out_there():
    """With a timeout the check is a polled Iallreduce, without one a blocking Allreduce, and MPI
    never matches the two kinds: the ranks with a timeout raise CollectiveTimeout naming the
    likely causes; the others wait (here rank 1 lets them go by joining their check, which then
    reports the difference)."""
    world = MPI.COMM_WORLD
    comm = world.Dup()
    x = contribution(comm, 10, "float64")
    # the state exists: the call under test goes straight to the check (a native call: once an
    # shm call made the node's shared memory, the check runs there, see test_shm_mpi)
    mar.allreduce(x, comm=comm, algorithm="native")
    if comm.rank == 1:
        with pytest.raises(mar.CollectiveTimeout, match=r"the argument check did not complete "
                           r"within 0\.5 s; some rank of the communicator has not made this call, "
                           r"or runs calls on it in a different order, or passed check=False"):
            mar.allreduce(x, comm=comm, algorithm="native", timeout=0.5)
        # release the others: a blocking check with this rank's signature, then the details
        fields = _checks.allreduce_call(x, None, MPI.SUM, comm, "native", None).signature(0.5)
        signature = _agree.Signature(fields)
        checker = _state.state(comm).checker
        checker.Allreduce(signature.packed, signature.result, MPI.MAX)
        checker.allgather((fields, None))
        message = None
    else:
        with pytest.raises(ValueError) as info:
            mar.allreduce(x, comm=comm, algorithm="native")
        message = str(info.value)
        assert message.startswith("allreduce called with different arguments on different "
                                  "ranks: "), message
        assert message.endswith("timeout differs: no timeout on " + _others(comm)
                                + "; a timeout on rank 1"), message
    world.Barrier()
    comm.Free()


def test_a_topology_that_differs_between_ranks_is_a_mismatch():
    """Different topologies give hierarchical schedules whose messages do not match: a hang."""
    comm = MPI.COMM_WORLD
    x = contribution(comm, 10, "float64")
    topology = mar.Topology.simulated(comm, ranks_per_node=2 if comm.rank == 1 else 1)
    with pytest.raises(ValueError) as info:
        mar.allreduce(x, comm=comm, algorithm="hierarchical", topology=topology)
    message = _same_everywhere(comm, info.value)
    assert message.startswith("allreduce called with different arguments on different ranks: "
                              "topology differs: a topology with checksum ")
    assert f" on {_others(comm)}; a topology with checksum " in message
    assert message.endswith(" on rank 1")
    _still_works(comm)


def test_several_mismatches_are_all_named():
    comm = MPI.COMM_WORLD
    x = contribution(comm, 5 + comm.rank, "float64")
    with pytest.raises(ValueError) as info:
        mar.allreduce(x, op=MPI.MAX if comm.rank else MPI.SUM, comm=comm)
    message = _same_everywhere(comm, info.value)
    counts = "; ".join(f"{5 + r} on rank {r}" for r in range(comm.size))
    assert f"count differs: {counts}" in message
    assert f"op differs: SUM on rank 0; MAX on {_others_than_zero(comm)}" in message


def _others_than_zero(comm) -> str:
    rest = list(range(1, comm.size))
    return ("rank " if len(rest) == 1 else "ranks ") + ", ".join(map(str, rest))


def test_bad_input_on_one_rank_raises_everywhere():
    comm = MPI.COMM_WORLD
    x = contribution(comm, 10, "float64")
    out = np.zeros(10)
    if comm.rank == 1:
        out.flags.writeable = False
    with pytest.raises(ValueError) as info:
        mar.allreduce(x, out, comm=comm, algorithm="ring")
    assert _same_everywhere(comm, info.value) == (
        "allreduce: bad input on rank 1: recvbuf is read-only; the result needs a writable buffer")
    _still_works(comm)


def test_different_bad_inputs_are_each_reported():
    comm = MPI.COMM_WORLD
    x = contribution(comm, 10, "float64")
    algorithm = "rnig" if comm.rank == 0 else "ring"
    op = MPI.BAND if comm.rank == 1 else MPI.SUM
    with pytest.raises(ValueError) as info:  # rank 0's error decides the type
        mar.allreduce(x, op=op, comm=comm, algorithm=algorithm)
    message = _same_everywhere(comm, info.value)
    assert message.startswith("allreduce: bad input on rank 0: unknown algorithm 'rnig'; ")
    assert "; rank 1: op MPI.BAND is not defined for dtype float64" in message
    _still_works(comm)


def test_the_same_bad_input_everywhere_gives_the_plain_message():
    comm = MPI.COMM_WORLD
    with pytest.raises(TypeError) as info:
        mar.allreduce(np.zeros(3), op=MPI.BAND, comm=comm)
    assert _same_everywhere(comm, info.value).startswith(
        "op MPI.BAND is not defined for dtype float64")


@pytest.mark.parametrize("algorithm", SCHEDULES + ["native"])
def test_a_plan_checks_once_when_built(monkeypatch, algorithm):
    comm = MPI.COMM_WORLD
    calls = []
    real = _agree.agree
    counting = lambda *args, **kw: calls.append(1) or real(*args, **kw)
    monkeypatch.setattr(_agree, "agree", counting)
    monkeypatch.setattr(_plans, "agree", counting)
    x = contribution(comm, 50, "float64")
    out = np.empty_like(x)
    with mar.plan(x, out, comm=comm, algorithm=algorithm) as p:
        assert len(calls) == 1
        for _ in range(3):
            p.run()
        assert_matches_native(comm, x, out, MPI.SUM)
    assert len(calls) == 1
    mar.allreduce(x, comm=comm, algorithm=algorithm)
    mar.allreduce(x, comm=comm, algorithm=algorithm, check=False)
    # an shm call's run compares the agreement's fields itself (test_shm_mpi): no separate check
    assert len(calls) == (1 if algorithm == "shm" else 2)


def test_an_intercommunicator_is_refused():
    world = MPI.COMM_WORLD
    half = world.Split(world.rank % 2, world.rank)
    inter = half.Create_intercomm(0, world, 1 - world.rank % 2, tag=11)
    try:
        for check in (True, False):
            with pytest.raises(TypeError, match="comm is an intercommunicator; mpiallreduce "
                                                "needs an intracommunicator"):
                mar.allreduce(np.zeros(4), comm=inter, check=check)
    finally:
        inter.Free()
        half.Free()
