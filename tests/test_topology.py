"""Topology: construction, validation and derived data, without MPI."""

import pytest

from mpiallreduce.topology import Topology


def test_from_nodes_derives_members_local_ranks_and_leaders():
    topo = Topology.from_nodes([5, 5, 2, 2, 2, 9])
    assert topo.node == (0, 0, 1, 1, 1, 2)
    assert topo.members == ((0, 1), (2, 3, 4), (5,))
    assert topo.local_rank == (0, 1, 0, 1, 2, 0)
    assert topo.leaders == (0, 2, 5)
    assert topo.node_sizes == (2, 3, 1) and topo.nnodes == 3 and topo.nranks == 6
    assert topo.contiguous


def test_interleaved_nodes_are_not_contiguous():
    topo = Topology.from_nodes([0, 1, 0, 1])
    assert topo.members == ((0, 2), (1, 3))
    assert topo.local_rank == (0, 0, 1, 1)
    assert topo.leaders == (0, 1)
    assert not topo.contiguous


def test_equal_layouts_compare_and_hash_equal():
    a = Topology.from_nodes([3, 3, 7, 7])
    b = Topology.simulated(4, ranks_per_node=2)
    assert a == b and hash(a) == hash(b)
    assert a != Topology.simulated(4, ranks_per_node=3)


@pytest.mark.parametrize("nranks, k, sizes", [(8, 4, (4, 4)), (5, 2, (2, 2, 1)), (3, 5, (3,)),
                                              (4, 1, (1, 1, 1, 1)), (1, 1, (1,))])
def test_simulated_groups_consecutive_ranks_last_node_smaller(nranks, k, sizes):
    topo = Topology.simulated(nranks, ranks_per_node=k)
    assert topo.node_sizes == sizes
    assert topo.contiguous


def test_simulated_accepts_anything_with_get_size():
    class FakeComm:
        def Get_size(self):
            return 6

    assert Topology.simulated(FakeComm(), ranks_per_node=3).node_sizes == (3, 3)


def test_two_levels_nest_and_bad_nesting_is_refused():
    topo = Topology.simulated(12, ranks_per_node=2, nodes_per_group=3)
    assert len(topo.levels) == 2
    assert topo.levels[1] == (0,) * 6 + (1,) * 6
    assert Topology.from_levels([0, 0, 1, 1], [0, 0, 0, 0]).levels[1] == (0, 0, 0, 0)
    with pytest.raises(ValueError, match="levels must nest"):
        Topology.from_levels([0, 0, 1, 1], [0, 1, 1, 1])
    with pytest.raises(ValueError, match="level 1 lists 3 ranks"):
        Topology.from_levels([0, 0, 1, 1], [0, 0, 0])


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_simulated_refuses_bad_ranks_per_node(bad):
    with pytest.raises(ValueError, match="ranks_per_node must be a positive integer"):
        Topology.simulated(4, ranks_per_node=bad)


def test_empty_topologies_are_refused():
    with pytest.raises(ValueError, match="at least one rank"):
        Topology.from_nodes([])
    with pytest.raises(ValueError, match="at least one level"):
        Topology(())


def test_check_size_names_both_sizes():
    topo = Topology.simulated(6, ranks_per_node=3)
    topo.check_size(6)
    with pytest.raises(ValueError, match="topology describes 6 ranks but the communicator has 4"):
        topo.check_size(4)


@pytest.mark.parametrize("nranks, sizes", [(1, (1,)), (4, (2, 2)), (8, (3, 3, 2)), (9, (3, 3, 3)),
                                           (17, (5, 5, 5, 2))])
def test_default_uses_nodes_of_ceil_sqrt_p(nranks, sizes):
    assert Topology.default(nranks).node_sizes == sizes


def test_repr_shows_node_sizes():
    assert repr(Topology.from_nodes([0, 0, 1])) == "Topology(3 ranks, nodes 2+1)"
    assert "2 levels" in repr(Topology.simulated(8, 2, nodes_per_group=2))
