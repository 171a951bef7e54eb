"""hierarchical and cascade schedules: verifier sweeps over topologies, flat limits, rank order,
and where the cross-node messages go. No MPI."""

from __future__ import annotations

from collections import Counter

import pytest

from mpiallreduce.algorithms import REGISTRY, build
from mpiallreduce.algorithms.compose import pad, relabel
from mpiallreduce.schedule import REDUCE, Recv, Send, Step, step
from mpiallreduce.topology import Topology
from mpiallreduce.verify import verify

TWO_LEVEL = ["hierarchical", "cascade"]
FLAT = sorted(name for name, algorithm in REGISTRY.items() if not algorithm.uses_topology)


def sized(*sizes: int) -> Topology:
    """Contiguous nodes of the given sizes."""
    return Topology.from_nodes([node for node, size in enumerate(sizes) for _ in range(size)])


def trim(steps) -> list[Step]:
    """Steps without the trailing empty ones (padding)."""
    steps = list(steps)
    while steps and not steps[-1]:
        steps.pop()
    return steps


def trimmed(schedule) -> list[list[Step]]:
    return [trim(steps) for steps in schedule.ranks]


# -- sweeps --------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", TWO_LEVEL)
@pytest.mark.parametrize("nnodes", range(1, 9))
def test_every_nodes_by_ranks_per_node_up_to_8_by_8(name, nnodes):
    for per_node in range(1, 9):
        p = nnodes * per_node
        topology = Topology.simulated(p, ranks_per_node=per_node)
        inner = FLAT[(nnodes + per_node) % len(FLAT)]  # every inner meets many shapes
        for count in sorted({0, 1, per_node - 1, p - 1, p + 1, 1009}):
            verify(build(name, p, count, topology, inner=inner))
            verify(build(name, p, count, topology))  # inner chosen by size


UNEQUAL = [(4, 4, 3), (3, 1), (1, 3), (8, 1), (1, 8), (2, 3, 4, 5), (5, 2, 5), (7, 7, 7, 6),
           (8, 8, 8, 1), (3, 3, 3, 3, 1), (6, 2)]


@pytest.mark.parametrize("inner", FLAT)
@pytest.mark.parametrize("name", TWO_LEVEL)
@pytest.mark.parametrize("sizes", UNEQUAL, ids=lambda s: "+".join(map(str, s)))
def test_unequal_nodes(name, inner, sizes):
    topology = sized(*sizes)
    p = topology.nranks
    for count in sorted({0, 1, min(sizes), max(sizes) + 1, p + 1, 97, 100_003}):
        verify(build(name, p, count, topology, inner=inner))


@pytest.mark.parametrize("name", TWO_LEVEL)
@pytest.mark.parametrize("nodes", [[0, 1, 0, 1], [0, 1, 2, 0, 1, 2, 0], [2, 2, 0, 1, 1, 0, 2],
                                   [0, 0, 1, 0, 1, 1, 1]])
def test_nodes_that_are_not_rank_blocks(name, nodes):
    topology = Topology.from_nodes(nodes)
    for count in (1, 5, 97):
        verify(build(name, len(nodes), count, topology))


@pytest.mark.parametrize("name", TWO_LEVEL)
@pytest.mark.parametrize("p", range(1, 18))
def test_default_topology_when_none_is_given(name, p):
    for count in (1, p + 1, 1009):
        verify(build(name, p, count))


# -- the flat limits -------------------------------------------------------------------------------

@pytest.mark.parametrize("inner", FLAT)
@pytest.mark.parametrize("name", TWO_LEVEL)
@pytest.mark.parametrize("p", [2, 3, 5, 8, 13])
def test_one_rank_per_node_is_the_inner_algorithm(name, inner, p):
    for count in (1, p + 1, 100):
        two_level = build(name, p, count, Topology.simulated(p, ranks_per_node=1), inner=inner)
        assert trimmed(two_level) == trimmed(build(inner, p, count))


@pytest.mark.parametrize("p", [2, 3, 5, 8, 13])
def test_one_node_cascade_is_ring_and_hierarchical_is_a_binomial_tree(p):
    one_node = Topology.simulated(p, ranks_per_node=p)
    for count in (1, p + 1, 100):
        assert trimmed(build("cascade", p, count, one_node)) == trimmed(build("ring", p, count))
        assert trimmed(build("hierarchical", p, count, one_node)) == trimmed(build("tree", p, count))


@pytest.mark.parametrize("name", TWO_LEVEL)
def test_one_rank_and_empty_buffers_need_no_messages(name):
    assert build(name, 1, 100, Topology.from_nodes([0])).nsteps == 0
    assert build(name, 8, 0, Topology.simulated(8, 4)).nsteps == 0


# -- rank order ------------------------------------------------------------------------------------

ORDER_KEEPING = [name for name in FLAT if not REGISTRY[name].commutative_only]


@pytest.mark.parametrize("sizes", [(4, 4), (3, 3, 3), (2, 3, 1, 4), (1, 1, 1), (8, 1), (5,)],
                         ids=lambda s: "+".join(map(str, s)))
def test_hierarchical_keeps_rank_order_on_rank_block_nodes(sizes):
    topology = sized(*sizes)
    p = topology.nranks
    for inner in ORDER_KEEPING:
        for count in (1, p + 1, 97):
            schedule = build("hierarchical", p, count, topology, inner=inner, ordered=True)
            assert schedule.ordered
            verify(schedule)


def test_default_inner_keeps_order_when_asked():
    for count in (10, 100_000):  # below and above the latency/bandwidth switch
        verify(build("hierarchical", 6, count, Topology.simulated(6, 2), ordered=True))


def test_unordered_hierarchical_with_ring_breaks_rank_order():
    schedule = build("hierarchical", 8, 16, Topology.simulated(8, 2), inner="ring")
    assert not schedule.ordered
    verify(schedule)
    with pytest.raises(Exception, match="rank order"):
        verify(schedule, ordered=True)


def test_ordered_hierarchical_refuses_interleaved_nodes():
    with pytest.raises(ValueError, match="block of consecutive ranks"):
        build("hierarchical", 4, 8, Topology.from_nodes([0, 1, 0, 1]), inner="tree", ordered=True)


def test_ordered_hierarchical_refuses_a_reordering_inner():
    with pytest.raises(ValueError, match="inner='ring' reorders operands"):
        build("hierarchical", 4, 8, Topology.simulated(4, 2), inner="ring", ordered=True)


def test_cascade_is_registered_commutative_only_and_hierarchical_is_not():
    assert REGISTRY["cascade"].commutative_only
    assert not REGISTRY["hierarchical"].commutative_only
    assert REGISTRY["hierarchical"].params["ordered"] is False
    assert REGISTRY["cascade"].uses_topology and REGISTRY["hierarchical"].uses_topology


# -- more levels -------------------------------------------------------------------------------------

@pytest.mark.parametrize("inner", FLAT)
@pytest.mark.parametrize("p, per_node, per_group", [(8, 2, 2), (12, 2, 3), (27, 3, 3), (64, 4, 4),
                                                    (30, 4, 3), (13, 2, 2), (7, 3, 1)])
def test_cascade_over_three_levels(inner, p, per_node, per_group):
    topology = Topology.simulated(p, per_node, nodes_per_group=per_group)
    for count in (1, p - 1, p + 1, 1009):
        verify(build("cascade", p, count, topology, inner=inner))


def test_cascade_over_three_levels_with_uneven_groups():
    # nodes of 3, 3, 2, 3, 3; groups {0, 1} and {2, 3, 4}
    nodes = [0, 0, 0, 1, 1, 1, 2, 2, 3, 3, 3, 4, 4, 4]
    groups = [0] * 6 + [1] * 8
    for count in (1, 13, 101):
        verify(build("cascade", len(nodes), count, Topology.from_levels(nodes, groups)))


def test_three_level_cascade_crosses_groups_with_a_smaller_shard():
    p, count = 16, 1600
    two = build("cascade", p, count, Topology.simulated(p, 4), inner="ring")
    three = build("cascade", p, count, Topology.simulated(p, 4, nodes_per_group=2), inner="ring")
    groups = Topology.simulated(p, 8).node  # 2 groups of 2 nodes

    def cross_group(schedule):
        return sum(send.size for rank, _, send in schedule.messages()
                   if groups[rank] != groups[send.peer])

    assert cross_group(three) < cross_group(two)


# -- where the cross-node messages go ---------------------------------------------------------------

def cross_node(schedule, topology) -> Counter:
    """Elements each rank sends to other nodes."""
    sent = Counter()
    for rank, _, send in schedule.messages():
        if topology.node[rank] != topology.node[send.peer] and send.size:
            sent[rank] += send.size
    return sent


@pytest.mark.parametrize("inner", FLAT)
@pytest.mark.parametrize("nnodes, per_node", [(2, 4), (4, 2), (3, 3), (2, 8), (8, 2)])
def test_cascade_spreads_cross_node_traffic_hierarchical_funnels_it(inner, nnodes, per_node):
    p, count = nnodes * per_node, 4096
    topology = Topology.simulated(p, ranks_per_node=per_node)
    spread = cross_node(build("cascade", p, count, topology, inner=inner), topology)
    funnel = cross_node(build("hierarchical", p, count, topology, inner=inner), topology)
    assert set(spread) == set(range(p))  # every rank sends across nodes
    assert set(funnel) == set(topology.leaders)  # only leaders do
    # each cascade rank carries 1/per_node of a leader's cross-node load (up to block rounding)
    assert max(spread.values()) <= max(funnel.values()) / per_node + nnodes + 1


def test_cross_node_counts_for_8_ranks_on_2_nodes_with_ring():
    topology = Topology.simulated(8, ranks_per_node=4)
    count = 1024
    cascade = build("cascade", 8, count, topology, inner="ring")
    hierarchical = build("hierarchical", 8, count, topology, inner="ring")

    def messages(schedule):
        return sum(1 for rank, _, send in schedule.messages()
                   if topology.node[rank] != topology.node[send.peer])

    assert messages(cascade) == 16 and messages(hierarchical) == 4
    assert cross_node(cascade, topology) == Counter({r: 256 for r in range(8)})
    assert cross_node(hierarchical, topology) == Counter({0: 1024, 4: 1024})


# -- errors and helpers --------------------------------------------------------------------------------

@pytest.mark.parametrize("name", TWO_LEVEL)
def test_bad_topology_or_inner_is_refused(name):
    with pytest.raises(ValueError, match="topology describes 4 ranks but the communicator has 6"):
        build(name, 6, 10, Topology.simulated(4, 2))
    with pytest.raises(TypeError, match="topology must be a mpiallreduce Topology"):
        build(name, 4, 10, [0, 0, 1, 1])
    with pytest.raises(ValueError, match="must be a flat algorithm"):
        build(name, 4, 10, Topology.simulated(4, 2), inner="cascade")
    with pytest.raises(ValueError, match="unknown .*algorithm 'nope'; choose one of"):
        build(name, 4, 10, Topology.simulated(4, 2), inner="nope")


def test_relabel_maps_peers_and_shifts_ranges():
    local = [step([Send(1, 0, 3)], [Recv(0, 2, 5, REDUCE)])]
    assert relabel(local, (4, 9), offset=10) == [step([Send(9, 10, 13)], [Recv(4, 12, 15, REDUCE)])]


def test_pad_appends_empty_steps_and_refuses_to_truncate():
    one = step([Send(1, 0, 1)])
    assert pad([one], 3) == [one, Step(), Step()]
    with pytest.raises(ValueError, match="does not fit"):
        pad([one, one], 1)
