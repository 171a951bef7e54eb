"""Hierarchical (leader-based) allreduce: reduce to a leader per node, allreduce among the
leaders with a flat algorithm, broadcast inside every node.

Cost, with m ranks per node, N nodes, intra-node link (α_i, β_i) and inter-node link (α_o, β_o):
2⌈lg m⌉(α_i + nβ_i) + ⌈lg m⌉nγ for the two binomial trees inside a node, plus the inner
algorithm on N leaders over the inter-node link, e.g. with ring 2(N-1)α_o + 2(N-1)/N·nβ_o.
Only the leaders use the inter-node link. Reference shape: Open MPI's han "simple" allreduce,
MPICH's SMP-aware allreduce (Zhu et al., "Hierarchical collectives in MPICH2", EuroPVM/MPI 2009).
"""

from __future__ import annotations

from ..schedule import Step
from . import register
from .compose import check_intra, choose_inner, flat_steps, pad, program_length, relabel, resolve_topology
from .phases import binomial_bcast, binomial_reduce, rounds


@register("hierarchical", commutative_only=False, uses_topology=True, inner=None, ordered=False,
          intra="auto")
def hierarchical(rank: int, nranks: int, count: int, topology=None, inner: str | None = None,
                 ordered: bool = False, intra: str = "auto") -> list[Step]:
    """Reduce to one leader per node, allreduce among leaders, broadcast in each node.

    Args:
        topology: which rank is on which node (default: :meth:`Topology.default`); only its
            first level (nodes) is used. Nodes may differ in size.
        inner: flat algorithm among the leaders (default: chosen by ``count``, see
            :func:`~mpiallreduce.algorithms.compose.choose_inner`).
        ordered: keep MPI's rank order (for a non-commutative op). Possible when every node is
            a block of consecutive ranks and ``inner`` keeps order; otherwise ValueError.
        intra: how a plan runs the intra-node phase (:data:`~.nodes.INTRA`); this schedule is
            the point-to-point form, which ``"p2p"`` always runs (see :mod:`.nodes`).

    With one node this is a binomial reduce and broadcast; with one rank per node it is
    ``inner`` over all ranks.
    """
    check_intra(intra)
    if nranks == 1 or count == 0:
        return []
    topology = resolve_topology(topology, nranks)
    if ordered and not topology.contiguous:
        raise ValueError(f"hierarchical keeps rank order only when every node is a block of "
                         f"consecutive ranks; {topology!r} is not (use a commutative op)")
    members = topology.members[topology.node[rank]]
    local = topology.local_rank[rank]
    depth = max(rounds(size) for size in topology.node_sizes)
    leaders = topology.leaders
    cross = []
    if len(leaders) > 1:
        inner = choose_inner(inner, count, ordered)
        cross = pad(flat_steps(inner, rank, leaders, 0, count) if local == 0 else [],
                    program_length(inner, len(leaders), count))
    whole = lambda lo, hi: (0, count)  # a broadcast sends the whole vector down every edge
    reduce = relabel(binomial_reduce(local, len(members), count), members)
    bcast = relabel(binomial_bcast(local, len(members), 0, whole), members)
    return pad(reduce, depth) + cross + pad(bcast, depth)
