"""No interference: internal messages never match the user's, plans sharing a communicator run
one after the other in either order, and plans on different communicators interleave."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import assert_matches_native, contribution
from mpi4py import MPI

import mpiallreduce as mar

pytestmark = pytest.mark.mpi

# every algorithm once as each member of a pair (with its neighbour in the list)
PAIRS = [(a, mar.ALGORITHMS[(i + 1) % len(mar.ALGORITHMS)]) for i, a in enumerate(mar.ALGORITHMS)]


@pytest.mark.parametrize("algorithm, check",
                         [(a, False) for a in mar.ALGORITHMS] + [("ring", True)])
def test_a_pending_wildcard_receive_is_not_matched(algorithm, check):
    comm = MPI.COMM_WORLD
    got = np.full(3, -1.0)
    request = comm.Irecv(got, source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG)
    x = contribution(comm, 100, "float64")
    out = mar.allreduce(x, comm=comm, algorithm=algorithm, check=check)
    with mar.plan(x, comm=comm, algorithm=algorithm, check=check) as p:
        p.run()
        assert_matches_native(comm, x, p.recvbuf, MPI.SUM)
    assert not request.Test(), "an internal message matched the user's wildcard receive"
    assert (got == -1.0).all()
    assert_matches_native(comm, x, out, MPI.SUM)
    comm.Send(np.array([1.0, 2.0, 3.0]), dest=comm.rank, tag=7)  # the user's own message
    status = MPI.Status()
    request.Wait(status)
    assert got.tolist() == [1.0, 2.0, 3.0] and status.Get_tag() == 7


@pytest.mark.parametrize("first, second", PAIRS)
@pytest.mark.parametrize("order", ["first_then_second", "second_then_first"])
def test_two_plans_on_one_communicator_run_in_either_order(first, second, order):
    comm = MPI.COMM_WORLD
    x = contribution(comm, 101, "float64")
    y = contribution(comm, 37, "int32", "BXOR")
    with (mar.plan(x, comm=comm, algorithm=first) as p,
          mar.plan(y, op=MPI.BXOR, comm=comm, algorithm=second) as q):
        runs = [p, q] if order == "first_then_second" else [q, p]
        for _ in range(3):
            for plan in runs:
                plan.run()
            assert_matches_native(comm, x, p.recvbuf, MPI.SUM)
            assert_matches_native(comm, y, q.recvbuf, MPI.BXOR)


@pytest.mark.parametrize("algorithm", mar.ALGORITHMS)
def test_plans_on_different_communicators_interleave(algorithm):
    world = MPI.COMM_WORLD
    dup = world.Dup()
    half = world.Split(world.rank % 2, -world.rank)  # ranks reversed in each half
    try:
        comms = [world, dup, half]
        inputs = [contribution(c, 53 + 10 * i, "float64") for i, c in enumerate(comms)]
        plans = [mar.plan(x, comm=c, algorithm=algorithm) for c, x in zip(comms, inputs)]
        for round_ in range(3):
            for plan in plans[round_:] + plans[:round_]:  # a different order each round
                plan.run()
            for plan, c, x in zip(plans, comms, inputs):
                assert_matches_native(c, x, plan.recvbuf, MPI.SUM)
        for plan in plans:
            plan.free()
    finally:
        half.Free()
        dup.Free()
