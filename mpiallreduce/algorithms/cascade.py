"""Cascade allreduce: reduce-scatter inside each node, allreduce every shard across nodes among
the ranks of the same local index (all shards at once), allgather inside each node.

Every rank of a node carries 1/m of the inter-node traffic, so all links into a node are busy,
where hierarchical funnels everything through one leader. With more levels (node, then group of
nodes, ...) each level runs one reduce-scatter on the way down and one allgather on the way up.

Cost (two levels, m ranks per node, N nodes, intra (α_i, β_i), inter (α_o, β_o)), ring inside:
2(m-1)α_i + 2(m-1)/m·nβ_i + (m-1)/m·nγ, plus the inner algorithm on n/m elements among N ranks,
e.g. ring: 2(N-1)α_o + 2(N-1)/N·(n/m)β_o, on m links per node in parallel.
References: 2D-torus allreduce (Mikami et al., 2018), Horovod's hierarchical allreduce,
BlueConnect (Cho et al., SysML 2019).
"""

from __future__ import annotations

from functools import lru_cache

from ..partition import block
from ..schedule import REDUCE, Recv, Send, Step, step
from ..topology import units
from . import register
from .compose import check_intra, choose_inner, flat_steps, pad, program_length, relabel, resolve_topology
from .ring import ring_allgather, ring_reduce_scatter


@lru_cache(maxsize=256)
def _shape(ranks: tuple[int, ...], ids: tuple[int, ...]):
    """Units of ``ranks`` at one level, the core size (smallest unit), the most extra ranks,
    and each rank's unit (cached: every rank of a level asks for the same shape)."""
    members = units(ranks, ids)
    sizes = [len(unit) for unit in members]
    unit_of = {rank: unit for unit in members for rank in unit}
    return members, min(sizes), max(sizes) - min(sizes), unit_of


def _shard(core: int, owner: int, count: int) -> tuple[int, int]:
    """Block a core rank owns after the ring reduce-scatter (ring leaves rank j with block j+1)."""
    return block(count, core, (owner + 1) % core)


@lru_cache(maxsize=4096)
def _length(ranks: tuple[int, ...], levels: tuple, count: int, inner: str) -> int:
    """Steps of every rank's cascade program for ``ranks`` on ``count`` elements."""
    if not levels:
        return program_length(inner, len(ranks), count)
    members, core, extra, _ = _shape(ranks, levels[0])
    cross = max(_length(tuple(unit[j] for unit in members), levels[1:],
                        _size(_shard(core, j, count)), inner) for j in range(core))
    return extra + 2 * (core - 1) + cross + (1 if extra else 0)


def _size(bounds: tuple[int, int]) -> int:
    return bounds[1] - bounds[0]


def _fold_in(local: int, unit, core: int, extra: int, count: int) -> list[Step]:
    """``extra`` steps in which the unit's ranks beyond ``core`` reduce block c into core rank c.

    In step t, core rank c receives from extra rank (c + t) mod extra, so no core rank gets two
    reductions of the same block in one step and every extra rank is drained. Peers are indices
    into ``unit`` and ranges start at 0; the caller relabels.
    """
    steps = []
    for t in range(extra):
        if local < core:
            source = core + (local + t) % extra
            recvs = [Recv(source, *block(count, core, local), REDUCE)] if source < len(unit) else []
            steps.append(step([], recvs))
        else:
            sends = [Send(c, *block(count, core, c)) for c in range(core)
                     if (c + t) % extra == local - core]
            steps.append(step(sends))
    return steps


def _fan_out(local: int, unit, core: int, count: int) -> list[Step]:
    """One step in which every core rank sends its block of the result to every extra rank.

    Like :func:`_fold_in`, peers are indices into ``unit`` and ranges start at 0.
    """
    extras = range(core, len(unit))
    if local < core:
        out = step([Send(x, *block(count, core, local)) for x in extras])
    else:
        out = step([], [Recv(c, *block(count, core, c)) for c in range(core)])
    return [out]


def _cascade(rank: int, ranks: tuple[int, ...], levels: tuple, start: int, stop: int,
             inner: str) -> list[Step]:
    """Rank's steps allreducing ``[start, stop)`` among ``ranks`` with ``levels`` still to descend."""
    count = stop - start
    if not levels:
        return flat_steps(inner, rank, ranks, start, stop)
    members, core, extra, unit_of = _shape(ranks, levels[0])
    unit = unit_of[rank]
    local = unit.index(rank)
    steps = relabel(_fold_in(local, unit, core, extra, count), unit, start)
    if local < core:
        lo, hi = _shard(core, local, count)
        group = tuple(u[local] for u in members)
        scatter = relabel(ring_reduce_scatter(local, core, count), unit, start)
        cross = _cascade(rank, group, levels[1:], start + lo, start + hi, inner)
        gather = relabel(ring_allgather(local, core, count), unit, start)
    else:
        scatter = cross = gather = []
    cross_length = max(_length(tuple(u[j] for u in members), levels[1:],
                               _size(_shard(core, j, count)), inner) for j in range(core))
    steps += pad(scatter, core - 1) + pad(cross, cross_length) + pad(gather, core - 1)
    if extra:
        steps += relabel(_fan_out(local, unit, core, count), unit, start)
    return steps


@register("cascade", commutative_only=True, uses_topology=True, inner=None, intra="auto")
def cascade(rank: int, nranks: int, count: int, topology=None, inner: str | None = None,
            intra: str = "auto") -> list[Step]:
    """Reduce-scatter in each node, allreduce each shard across nodes, allgather in the node.

    Args:
        topology: nodes and optional coarser levels (default: :meth:`Topology.default`); one
            reduce-scatter/allgather pair (ring) per level, ``inner`` across the top level.
        inner: flat algorithm for the shards across nodes (default: chosen by shard size).
        intra: how a plan runs the intra-node phase (:data:`~.nodes.INTRA`); this schedule is
            the point-to-point form, which ``"p2p"`` always runs (see :mod:`.nodes`).

    Unequal nodes: each node splits the vector into as many shards as the smallest node has
    ranks (the "core"); a node's remaining ranks first reduce their shards into the core ranks
    (one step per extra rank) and get the result back in one final step. With very unequal
    nodes (say 8 + 1) the cross-node traffic then goes through few ranks, as in hierarchical.
    With one node this is ring; with one rank per node it is ``inner`` over all ranks.
    """
    check_intra(intra)
    if nranks == 1 or count == 0:
        return []
    topology = resolve_topology(topology, nranks)
    inner = choose_inner(inner, count // max(topology.node_sizes))
    return _cascade(rank, tuple(range(nranks)), topology.levels, 0, count, inner)
