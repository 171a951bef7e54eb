"""hierarchical and cascade under MPI with simulated nodes (explicit topology and the
MPIALLREDUCE_RANKS_PER_NODE variable), compared with comm.Allreduce on every rank."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import affine_compose, affine_maps, assert_matches_native, awkward_counts, contribution
from mpi4py import MPI

import mpiallreduce as mar
from mpiallreduce._state import state as _state
from mpiallreduce.topology import RANKS_PER_NODE_ENV, Topology

pytestmark = pytest.mark.mpi

TWO_LEVEL = ["hierarchical", "cascade"]


def _check(comm, name, topology, dtypes=("float64", "int64")):
    for dtype in dtypes:
        for count in awkward_counts(comm.size):
            x = contribution(comm, count, dtype)
            out = mar.allreduce(x, comm=comm, algorithm=name, topology=topology)
            assert_matches_native(comm, x, out, MPI.SUM)


@pytest.mark.parametrize("per_node", [2, 3])
@pytest.mark.parametrize("name", TWO_LEVEL)
def test_explicit_simulated_topology(name, per_node):
    comm = MPI.COMM_WORLD
    _check(comm, name, Topology.simulated(comm, ranks_per_node=per_node))


@pytest.mark.parametrize("per_node", [2, 3])
@pytest.mark.parametrize("name", TWO_LEVEL)
def test_environment_variable_simulates_nodes(monkeypatch, name, per_node):
    monkeypatch.setenv(RANKS_PER_NODE_ENV, str(per_node))
    comm = MPI.COMM_WORLD.Dup()  # a fresh communicator: the topology is kept per communicator
    try:
        _check(comm, name, None, dtypes=("float64",))
        assert _state(comm).topology == Topology.simulated(comm, ranks_per_node=per_node)
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


@pytest.mark.parametrize("name", TWO_LEVEL)
def test_nodes_that_are_not_rank_blocks(name):
    comm = MPI.COMM_WORLD
    _check(comm, name, Topology.from_nodes([rank % 2 for rank in range(comm.size)]), ("int32",))


def test_cascade_over_node_and_group_levels():
    comm = MPI.COMM_WORLD
    _check(comm, "cascade", Topology.simulated(comm, 2, nodes_per_group=2))


@pytest.mark.parametrize("name", TWO_LEVEL)
def test_plan_in_place_with_a_topology(name):
    comm = MPI.COMM_WORLD
    buf = np.empty(1001, dtype=np.float64)
    with mar.plan(MPI.IN_PLACE, buf, comm=comm, algorithm=name,
                  topology=Topology.simulated(comm, 3)) as plan:
        for round_ in range(2):
            x = contribution(comm, buf.size, "float64", seed=round_)
            buf[:] = x
            plan.run()
            assert_matches_native(comm, x, buf, MPI.SUM)


@pytest.mark.parametrize("nodes", ["blocks", "interleaved"])
def test_hierarchical_keeps_rank_order_or_refuses(nodes):
    comm = MPI.COMM_WORLD
    if nodes == "blocks":
        topology = Topology.simulated(comm, 2)
    else:
        topology = Topology.from_nodes([rank % 2 for rank in range(comm.size)])
    refuses = topology.nnodes > 1 and not topology.contiguous
    op = MPI.Op.Create(affine_compose, commute=False)
    try:
        for inner in ("tree", "recursive_doubling", "rabenseifner"):
            for count in (1, comm.size + 1, 97):
                x = affine_maps(comm, count)
                call = dict(op=op, comm=comm, algorithm="hierarchical", topology=topology,
                            inner=inner)
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
