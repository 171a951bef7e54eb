"""Reduce-scatter, allgather, broadcast and all-to-all from the allreduce phase builders.

Block layout is MPI's with counts from :mod:`mpiallreduce.partition`: ``block(count, p, r)`` is
rank r's part of the vector (reduce_scatter's result, allgather's contribution). The working
buffer is the full vector, except for alltoall, whose working space is the send buffer followed
by the receive buffer (``count`` is then twice the send count).

Costs (n bytes of the full vector, p ranks; Thakur, Rabenseifner & Gropp 2005):
ring reduce_scatter (p-1)α + (p-1)/p·nβ + (p-1)/p·nγ; recursive halving lg p·α + (p-1)/p·nβ +
(p-1)/p·nγ; ring allgather (p-1)α + (p-1)/p·nβ; recursive doubling lg p·α + (p-1)/p·nβ; binomial
bcast ⌈lg p⌉(α + nβ); scatter + allgather bcast (⌈lg p⌉ + p - 1)α + 2(p-1)/p·nβ (van de Geijn);
pairwise alltoall (p-1)(α + n/p·β).
"""

from __future__ import annotations

from ..partition import block, span
from ..schedule import COPY, REDUCE, Recv, Send, Step, step
from . import register
from .phases import (
    binomial_bcast,
    doubling_allgather,
    first_real_rank,
    fold_in,
    fold_out,
    halving_reduce_scatter,
    virtual_rank,
)
from .ring import ring_allgather, ring_reduce_scatter


def _rank_blocks(count: int, nranks: int):
    """Slots of the virtual ranks in rank order: virtual rank v's slot is its real ranks' blocks."""
    return lambda lo, hi: span(count, nranks, first_real_rank(lo, nranks),
                               first_real_rank(hi, nranks))


@register("ring", commutative_only=True, collective="reduce_scatter")
def reduce_scatter_ring(rank: int, nranks: int, count: int, topology=None) -> list[Step]:
    """Ring reduce-scatter: p-1 steps, rank r ends with block r reduced."""
    if nranks == 1 or count == 0:
        return []
    return ring_reduce_scatter(rank, nranks, count, owned=0)


@register("recursive_halving", commutative_only=True, collective="reduce_scatter")
def reduce_scatter_halving(rank: int, nranks: int, count: int, topology=None) -> list[Step]:
    """Recursive halving (distance halving, so blocks stay in rank order), extra ranks folded."""
    if nranks == 1 or count == 0:
        return []
    even = rank - rank % 2
    return (fold_in(rank, nranks, 0, count, REDUCE)
            + halving_reduce_scatter(virtual_rank(rank, nranks), nranks,
                                     _rank_blocks(count, nranks), keep_order=False)
            + fold_out(rank, nranks, *block(count, nranks, even)))


@register("ring", commutative_only=False, collective="allgather")
def allgather_ring(rank: int, nranks: int, count: int, topology=None) -> list[Step]:
    """Ring allgather: p-1 steps, each passing one block to the right."""
    if nranks == 1 or count == 0:
        return []
    return ring_allgather(rank, nranks, count, first_owned=0)


@register("recursive_doubling", commutative_only=False, collective="allgather")
def allgather_doubling(rank: int, nranks: int, count: int, topology=None) -> list[Step]:
    """Recursive doubling with the extra ranks' blocks folded into their partners first."""
    if nranks == 1 or count == 0:
        return []
    even = rank - rank % 2
    return (fold_in(rank, nranks, *block(count, nranks, even), COPY)
            + doubling_allgather(virtual_rank(rank, nranks), nranks,
                                 _rank_blocks(count, nranks), keep_order=False)
            + fold_out(rank, nranks, 0, count))


@register("binomial", commutative_only=False, collective="bcast", root=0)
def bcast_binomial(rank: int, nranks: int, count: int, topology=None, root: int = 0) -> list[Step]:
    """Binomial-tree broadcast of the whole vector from ``root``."""
    if nranks == 1 or count == 0:
        return []
    return binomial_bcast(rank, nranks, root, lambda lo, hi: (0, count))


@register("scatter_allgather", commutative_only=False, collective="bcast", root=0)
def bcast_scatter_allgather(rank: int, nranks: int, count: int, topology=None,
                            root: int = 0) -> list[Step]:
    """Binomial scatter of p blocks from ``root``, then ring allgather (large messages)."""
    if nranks == 1 or count == 0:
        return []
    # Blocks are numbered relative to the root, so vrank v = rank - root receives block v.
    blocks = lambda lo, hi: span(count, nranks, lo, hi)
    return (binomial_bcast(rank, nranks, root, blocks)
            + ring_allgather(rank, nranks, count, first_owned=-root))


@register("pairwise", commutative_only=False, collective="alltoall")
def alltoall_pairwise(rank: int, nranks: int, count: int, topology=None) -> list[Step]:
    """Pairwise exchange: in step s send to rank + s the block meant for it, receive from rank - s.

    ``count`` is the working space: the send buffer's n elements, then the receive buffer's.
    A rank's own block is copied locally by the executor before the steps.
    """
    n = count // 2
    if nranks == 1 or n == 0:
        return []
    steps = []
    for s in range(1, nranks):
        send_to, recv_from = (rank + s) % nranks, (rank - s) % nranks
        lo, hi = block(n, nranks, recv_from)
        steps.append(step([Send(send_to, *block(n, nranks, send_to))],
                          [Recv(recv_from, n + lo, n + hi, COPY)]))
    return steps
