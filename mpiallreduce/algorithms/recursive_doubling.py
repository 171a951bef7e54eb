"""Recursive-doubling allreduce: lg p full-vector exchanges with ``rank ^ mask``.

For p not a power of two the extra ranks fold their vector into a partner first and get the
result back last (see :mod:`.phases`). In each round a pair holds two adjacent, aligned groups
of ranks; both compute ``lower group ∘ upper group`` from the same two operands, so rank order
is kept for non-commutative ops and every rank ends with the same bits.

Cost: ⌈lg p⌉(α + nβ + nγ), plus two steps (α + nβ, and α + nβ + nγ) when p is not a power of
two. Fewest steps of all: wins for small messages.
Reference: Thakur, Rabenseifner & Gropp, IJHPCA 2005, §4.1.
"""

from __future__ import annotations

from ..schedule import LOCAL_FIRST, RECEIVED_FIRST, REDUCE, Recv, Send, Step, step
from . import register
from .phases import fold_in, fold_out, idle, pof2_below, real_rank, virtual_rank


def exchange(vrank: int | None, nranks: int, count: int) -> list[Step]:
    """Return the lg pof2 full-vector exchange-and-reduce rounds among the virtual ranks."""
    pof2 = pof2_below(nranks)
    nrounds = pof2.bit_length() - 1
    if vrank is None:
        return idle(nrounds)
    steps = []
    for t in range(nrounds):
        peer = vrank ^ (1 << t)
        order = LOCAL_FIRST if vrank < peer else RECEIVED_FIRST
        to = real_rank(peer, nranks)
        steps.append(step([Send(to, 0, count)], [Recv(to, 0, count, REDUCE, order)]))
    return steps


@register("recursive_doubling", commutative_only=False)
def recursive_doubling(rank: int, nranks: int, count: int, topology=None) -> list[Step]:
    """Full-vector exchanges with rank ^ mask, extra ranks folded in (any op, rank order kept)."""
    if nranks == 1 or count == 0:
        return []
    return (fold_in(rank, nranks, 0, count, REDUCE)
            + exchange(virtual_rank(rank, nranks), nranks, count)
            + fold_out(rank, nranks, 0, count))
