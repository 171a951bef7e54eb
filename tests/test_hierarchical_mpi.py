"""hierarchical and cascade under MPI with simulated nodes (explicit topology and the
MPIALLREDUCE_RANKS_PER_NODE variable), compared with comm.Allreduce on every rank: the
point-to-point schedules (intra="p2p") and the shared-memory intra-node phase (intra="shm",
what "auto" picks here, :mod:`mpiallreduce.shm_nodes`)."""

from __future__ import annotations

import os

import numpy as np
import pytest
from conftest import (
    affine_compose,
    affine_maps,
    assert_matches_native,
    awkward_counts,
    contribution,
    time_out_or_hear,
    timed_out,
)
from mpi4py import MPI

import mpiallreduce as mar
from mpiallreduce import _plans, shm, shm_nodes
from mpiallreduce._state import existing
from mpiallreduce._state import state as _state
from mpiallreduce.topology import RANKS_PER_NODE_ENV, Topology

pytestmark = pytest.mark.mpi

TWO_LEVEL = ["hierarchical", "cascade"]
INTRA = ["shm", "p2p"]


def _check(comm, name, topology, dtypes=("float64", "int64"), **params):
    for dtype in dtypes:
        for count in awkward_counts(comm.size):
            x = contribution(comm, count, dtype)
            out = mar.allreduce(x, comm=comm, algorithm=name, topology=topology, **params)
            assert_matches_native(comm, x, out, MPI.SUM)


def _transport(plan) -> str:
    return "shm" if isinstance(plan, shm_nodes.NodesPlan) else "p2p"


def _auto(comm, per_node: int) -> str:
    """What intra="auto" runs here (one machine): shm, but not where the ranks outnumber the
    cores, nor on nodes of one rank."""
    crowded = comm.size > (os.cpu_count() or 1)
    return "p2p" if crowded or min(per_node, comm.size) == 1 else "shm"


@pytest.mark.parametrize("intra", INTRA)
@pytest.mark.parametrize("per_node", [2, 3])
@pytest.mark.parametrize("name", TWO_LEVEL)
def test_explicit_simulated_topology(name, per_node, intra):
    """Nodes of 3 are unequal at -n 4, 5 and 8 (3+1, 3+2, 3+3+2)."""
    comm = MPI.COMM_WORLD
    _check(comm, name, Topology.simulated(comm, ranks_per_node=per_node), intra=intra)


@pytest.mark.parametrize("per_node", [2, 3])
@pytest.mark.parametrize("name", TWO_LEVEL)
def test_environment_variable_simulates_nodes(monkeypatch, name, per_node):
    monkeypatch.setenv(RANKS_PER_NODE_ENV, str(per_node))
    monkeypatch.setattr(os, "cpu_count", lambda: 64)  # as if every rank had a core: auto -> shm
    comm = MPI.COMM_WORLD.Dup()  # a fresh communicator: the topology is kept per communicator
    try:
        _check(comm, name, None, dtypes=("float64",))
        assert _state(comm).topology == Topology.simulated(comm, ranks_per_node=per_node)
        with mar.plan(np.ones(10), comm=comm, algorithm=name) as plan:
            assert _transport(plan) == ("shm" if comm.size > 1 else "p2p")  # cores to spare
    finally:
        comm.Free()


def test_from_comm_without_the_variable_finds_one_node_here(monkeypatch):
    monkeypatch.delenv(RANKS_PER_NODE_ENV, raising=False)
    comm = MPI.COMM_WORLD
    topology = Topology.from_comm(comm)
    assert topology.nranks == comm.size
    assert topology.members == (tuple(range(comm.size)),)  # mpirun on one machine


@pytest.mark.mpi(min_size=2)
def test_the_variable_must_agree_across_ranks(monkeypatch):
    comm = MPI.COMM_WORLD
    monkeypatch.setenv(RANKS_PER_NODE_ENV, str(1 + comm.rank % 2))
    with pytest.raises(ValueError, match="differs between ranks"):
        Topology.from_comm(comm)
    monkeypatch.setenv(RANKS_PER_NODE_ENV, "zero")
    with pytest.raises(ValueError, match="not a positive integer"):
        Topology.from_comm(comm)


@pytest.mark.parametrize("intra", INTRA)
@pytest.mark.parametrize("name", TWO_LEVEL)
def test_nodes_that_are_not_rank_blocks(name, intra):
    comm = MPI.COMM_WORLD
    _check(comm, name, Topology.from_nodes([rank % 2 for rank in range(comm.size)]), ("int32",),
           intra=intra)


@pytest.mark.parametrize("intra", INTRA)
def test_cascade_over_node_and_group_levels(intra):
    comm = MPI.COMM_WORLD
    _check(comm, "cascade", Topology.simulated(comm, 2, nodes_per_group=2), intra=intra)


@pytest.mark.parametrize("intra", INTRA)
@pytest.mark.parametrize("name", TWO_LEVEL)
def test_plan_in_place_with_a_topology(name, intra):
    comm = MPI.COMM_WORLD
    buf = np.empty(1001, dtype=np.float64)
    with mar.plan(MPI.IN_PLACE, buf, comm=comm, algorithm=name,
                  topology=Topology.simulated(comm, 3), intra=intra) as plan:
        assert _transport(plan) == (intra if comm.size > 1 else "p2p")
        for round_ in range(2):
            x = contribution(comm, buf.size, "float64", seed=round_)
            buf[:] = x
            plan.run()
            assert_matches_native(comm, x, buf, MPI.SUM)


@pytest.mark.parametrize("intra", INTRA)
@pytest.mark.parametrize("nodes", ["blocks", "interleaved"])
def test_hierarchical_keeps_rank_order_or_refuses(nodes, intra):
    comm = MPI.COMM_WORLD
    if nodes == "blocks":
        topology = Topology.simulated(comm, 2)
    else:
        topology = Topology.from_nodes([rank % 2 for rank in range(comm.size)])
    refuses = topology.nnodes > 1 and not topology.contiguous
    op = MPI.Op.Create(affine_compose, commute=False)
    try:
        for inner in ("tree", "recursive_doubling", "rabenseifner"):
            # 5000 uint64: above shm's small regime, every rank of a node reduces a block
            for count in (1, comm.size + 1, 97, 5000):
                x = affine_maps(comm, count)
                call = dict(op=op, comm=comm, algorithm="hierarchical", topology=topology,
                            inner=inner, intra=intra)
                if refuses:
                    with pytest.raises(ValueError, match="block of consecutive ranks"):
                        mar.allreduce(x, **call)
                else:
                    ref = np.empty_like(x)
                    comm.Allreduce(x, ref, op=op)
                    assert np.array_equal(mar.allreduce(x, **call), ref)
    finally:
        op.Free()


@pytest.mark.parametrize("name", TWO_LEVEL)
def test_a_topology_of_the_wrong_size_or_type_is_refused_on_every_rank(name):
    comm = MPI.COMM_WORLD
    x = np.ones(10)
    with pytest.raises(ValueError, match=f"topology describes {comm.size + 1} ranks but the "
                                         f"communicator has {comm.size}"):
        mar.allreduce(x, comm=comm, algorithm=name, topology=Topology.simulated(comm.size + 1, 2))
    with pytest.raises(TypeError, match="topology must be a mpiallreduce Topology"):
        mar.allreduce(x, comm=comm, algorithm=name, topology=[0] * comm.size)


# -- the shared-memory intra-node phase ---------------------------------------------------------

#: counts around shm's small regime (float64) and one of several windows
SHM_COUNTS = [shm.SMALL_BYTES // 8 - 1, shm.SMALL_BYTES // 8 + 1, 300_007]
#: (op, dtype) pairs: integer and float, logical, bitwise, a narrow integer, complex
SHM_CASES = [("SUM", "int8"), ("PROD", "uint16"), ("MIN", "int32"), ("MAX", "float32"),
             ("BXOR", "uint64"), ("LAND", "bool"), ("PROD", "complex128"), ("SUM", "float64")]


def _nodes(comm, per_node):
    return Topology.simulated(comm, ranks_per_node=per_node)


@pytest.mark.parametrize("op_name, dtype", SHM_CASES)
@pytest.mark.parametrize("name", TWO_LEVEL)
def test_shm_phase_ops_and_dtypes_match_native(name, op_name, dtype):
    comm = MPI.COMM_WORLD
    op = getattr(MPI, op_name)
    for per_node in (2, 3):
        for count in (1, comm.size + 1, 5003):
            x = contribution(comm, count, dtype, op_name)
            out = mar.allreduce(x, op=op, comm=comm, algorithm=name,
                                topology=_nodes(comm, per_node), intra="shm")
            assert_matches_native(comm, x, out, op)


@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("kind", ["one_shot", "plan"])
@pytest.mark.parametrize("name", TWO_LEVEL)
def test_shm_phase_repeated_with_changing_inputs(name, kind, in_place):
    """Stale slots (of the previous call, or two calls back) would show as wrong results."""
    comm = MPI.COMM_WORLD
    topology = _nodes(comm, 3)
    for count in sorted(set(awkward_counts(comm.size) + SHM_COUNTS)):
        buf, out = np.empty(count), np.empty(count)
        call = dict(comm=comm, algorithm=name, topology=topology, intra="shm")
        plan = None
        if kind == "plan":
            plan = (mar.plan(MPI.IN_PLACE, buf, **call) if in_place
                    else mar.plan(buf, out, **call))
        for round_ in range(3):
            x = contribution(comm, count, "float64", seed=round_)
            buf[...] = x
            if plan is not None:
                plan.run()
            elif in_place:
                mar.allreduce(MPI.IN_PLACE, buf, **call)
            else:
                mar.allreduce(buf, out, **call)
            assert_matches_native(comm, x, buf if in_place else out, MPI.SUM)
        if plan is not None:
            plan.free()


@pytest.mark.parametrize("name", TWO_LEVEL)
def test_shm_phase_average_user_op_and_narrow_integers(name):
    comm = MPI.COMM_WORLD
    topology = _nodes(comm, 2)
    call = dict(comm=comm, algorithm=name, topology=topology, intra="shm")
    for count in (1, 100, 5000):
        x = contribution(comm, count, "float64")
        assert_matches_native(comm, x, mar.allreduce(x, op=mar.AVG, **call), MPI.SUM,
                              average=True)
    add = MPI.Op.Create(lambda a, b, _: np.add(np.frombuffer(a), np.frombuffer(b),
                                               out=np.frombuffer(b)), commute=True)
    try:
        for count in (7, 5000):
            x = contribution(comm, count, "float64")
            assert_matches_native(comm, x, mar.allreduce(x, op=add, **call), MPI.SUM)
    finally:
        add.Free()
    for count in (7, 40_000):  # the modular 8/16-bit rule: NumPy's wrapping arithmetic
        rng = np.random.default_rng([comm.rank, count])
        x = rng.integers(100, 255, count, endpoint=True).astype(np.uint8)
        expect = np.sum(comm.allgather(x), axis=0, dtype=np.uint8)
        assert np.array_equal(mar.allreduce(x, **call), expect)


@pytest.mark.parametrize("name", TWO_LEVEL)
def test_shm_phase_fortran_order_and_several_dimensions(name):
    comm = MPI.COMM_WORLD
    call = dict(comm=comm, algorithm=name, topology=_nodes(comm, 3), intra="shm")
    for shape in [(3, 5), (200, 61)]:
        x = np.asfortranarray(contribution(comm, int(np.prod(shape)), "float64").reshape(shape))
        out = np.asfortranarray(np.empty(shape))
        mar.allreduce(x, out, **call)
        memory = x.reshape(-1, order="F")  # compared in memory order, as MPI pairs elements
        assert_matches_native(comm, memory, out.reshape(-1, order="F"), MPI.SUM)


@pytest.mark.parametrize("name", TWO_LEVEL)
def test_shm_phase_nonblocking_comm_and_timeout(name):
    comm = MPI.COMM_WORLD
    topology = _nodes(comm, 2)
    call = dict(algorithm=name, topology=topology, intra="shm")
    x = contribution(comm, 3000, "float64")
    assert_matches_native(comm, x, mar.iallreduce(x, comm=comm, **call).wait(), MPI.SUM)
    with mar.plan(x, comm=comm, **call) as plan:
        for _ in range(2):
            plan.start()
            assert_matches_native(comm, x, plan.wait(), MPI.SUM)
        assert_matches_native(comm, x, plan.run(timeout=60), MPI.SUM)
    assert_matches_native(comm, x, mar.allreduce(x, comm=comm, timeout=60, **call), MPI.SUM)
    drop_in = mar.Comm(comm, **call)
    out = np.empty_like(x)
    drop_in.Allreduce(x, out)
    assert_matches_native(comm, x, out, MPI.SUM)


@pytest.mark.parametrize("name", TWO_LEVEL)
def test_shm_phase_a_rank_whose_cache_lost_the_call_still_meets_the_others(name):
    """A rank that binds a call again makes no collective (the nodes exist, the window is big
    enough): the others, who find the call cached, would never meet one."""
    comm = MPI.COMM_WORLD
    call = dict(comm=comm, algorithm=name, topology=_nodes(comm, 2), intra="shm")
    for count in (10, 50_000):
        x = contribution(comm, count, "float64")
        out = np.empty_like(x)
        for round_ in range(3):
            if round_ and comm.rank == round_ % comm.size:
                existing(comm).calls.clear()  # local: no message
            mar.allreduce(x, out, **call)
            assert_matches_native(comm, x, out, MPI.SUM)


@pytest.mark.mpi(min_size=2)
def test_shm_phase_ranks_that_run_different_calls_raise_in_their_node():
    """One node (no cross-node phase to wait in): the node's signatures differ, every rank
    raises the same ValueError, with check=False as with plans run in different orders."""
    comm = MPI.COMM_WORLD
    one = _nodes(comm, comm.size)
    x = contribution(comm, 10, "float64")
    name = TWO_LEVEL[comm.rank % 2]
    with pytest.raises(ValueError, match="the algorithm or its parameters differ"):
        mar.allreduce(x, comm=comm, algorithm=name, topology=one, intra="shm", check=False)
    y = contribution(comm, 10 + comm.rank % 2, "float64")
    with pytest.raises(ValueError, match=r"count differs: 10 on ranks? 0"):
        mar.allreduce(y, comm=comm, algorithm="cascade", topology=one, intra="shm", check=False)
    assert_matches_native(comm, x, mar.allreduce(x, comm=comm, algorithm="cascade",
                                                 topology=one, check=False), MPI.SUM)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("name", TWO_LEVEL)
def test_shm_phase_a_missing_rank_times_out_on_every_other(name, monkeypatch):
    monkeypatch.setattr(shm, "CLOSE_SECONDS", 0.5)  # the timed-out ranks never free the nodes
    world = MPI.COMM_WORLD
    comm = world.Dup()
    x = contribution(comm, 100, "float64")
    call = dict(comm=comm, algorithm=name, topology=_nodes(comm, 2), intra="shm")
    mar.allreduce(x, **call)  # the nodes and windows exist: nothing collective left
    plan = mar.plan(x, **call)
    world.Barrier()
    message = None
    if comm.rank != 0:
        message = time_out_or_hear(lambda: plan.run(timeout=0.5), 0.5)
        with pytest.raises(mar.CommunicatorRevoked, match="the communicator is revoked"):
            plan.run()
    messages = world.allgather(message)
    assert all("no answer from rank(s)" in m for m in timed_out(messages)), messages
    assert messages[1] is None or "no answer from rank(s) 0 in step 0" in messages[1], messages
    plan.free()
    comm.Free()


@pytest.mark.parametrize("name", TWO_LEVEL)
def test_intra_chooses_the_transport_and_shm_refuses_where_memory_is_not_shared(name,
                                                                              monkeypatch):
    comm = MPI.COMM_WORLD
    topology = _nodes(comm, 2)
    x = np.ones(10)
    with pytest.raises(ValueError, match="intra must be one of 'auto', 'shm', 'p2p'"):
        mar.allreduce(x, comm=comm, algorithm=name, topology=topology, intra="tcp")
    for intra, per_node in (("auto", 2), ("auto", 1), ("shm", 2), ("shm", 1), ("p2p", 2)):
        with mar.plan(x, comm=comm, algorithm=name, topology=_nodes(comm, per_node),
                      intra=intra) as plan:
            expect = _auto(comm, per_node) if intra == "auto" else intra
            assert _transport(plan) == (expect if comm.size > 1 else "p2p")
            assert plan.algorithm == name
    if comm.size == 1:
        return
    # a node that does not share memory (on a real cluster: an explicit topology that joins
    # ranks of several machines): auto takes the schedule, shm refuses on every rank
    monkeypatch.setattr(_plans.shm_nodes, "node_for", lambda *args, **kwargs: None)
    with mar.plan(x, comm=comm, algorithm=name, topology=topology) as plan:
        assert _transport(plan) == "p2p"
    with pytest.raises(ValueError, match="needs every node of .* in one shared-memory node"):
        mar.plan(x, comm=comm, algorithm=name, topology=topology, intra="shm")


def test_shm_phase_under_grad_sync(monkeypatch):
    """GradSync's buckets (plans bound once, runs started in bucket order) over the shm phase."""
    monkeypatch.setenv(RANKS_PER_NODE_ENV, "2")
    monkeypatch.setattr(os, "cpu_count", lambda: 64)  # auto takes shm inside the nodes
    comm = MPI.COMM_WORLD.Dup()
    try:
        sizes = (5, 3000, 70_000)
        grads = [contribution(comm, n, "float64", seed=i) for i, n in enumerate(sizes)]
        with mar.GradSync(grads, comm, op=MPI.SUM, algorithm="hierarchical",
                          bucket_bytes=4096) as sync:
            assert all(_transport(b.plan) == ("shm" if comm.size > 1 else "p2p")
                       for b in sync.buckets)
            for step in range(2):
                fresh = [contribution(comm, n, "float64", seed=10 * step + i)
                         for i, n in enumerate(sizes)]
                for g, f in zip(grads, fresh):
                    g[...] = f
                for index in reversed(range(len(grads))):
                    sync.ready(index)
                for got, f in zip(sync.wait(), fresh):
                    assert_matches_native(comm, f, got, MPI.SUM)
    finally:
        comm.Free()
