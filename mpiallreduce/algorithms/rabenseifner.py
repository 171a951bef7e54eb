"""Rabenseifner's allreduce: recursive-halving reduce-scatter, recursive-doubling allgather.

Extra ranks of a non-power-of-two p fold in first and get the result last (see :mod:`.phases`).
The pof2 remaining ranks cut the vector into pof2 slots (block distribution) and halve by
*distance doubling* (partner ``vrank ^ 1`` first): each combine then joins two adjacent groups of
ranks in order, so non-commutative ops are exact, at the price of virtual rank v owning slot
bit-reverse(v), which the allgather undoes. Each slot is reduced on one rank only and copied
from there, so results are bit-identical. A count below p gives empty slots, which cost nothing.

Cost: 2 lg p·α + 2(p-1)/p·nβ + (p-1)/p·nγ (plus the fold's α + nβ + nγ and α + nβ when p is not a
power of two): bandwidth-optimal with logarithmic latency, wins for large messages.
Reference: Rabenseifner, "Optimization of collective reduction operations", ICCS 2004;
Thakur, Rabenseifner & Gropp, IJHPCA 2005, §4.3.
"""

from __future__ import annotations

from ..partition import span
from ..schedule import REDUCE, Step
from . import register
from .phases import doubling_allgather, fold_in, fold_out, halving_reduce_scatter, pof2_below, virtual_rank


@register("rabenseifner", commutative_only=False)
def rabenseifner(rank: int, nranks: int, count: int, topology=None) -> list[Step]:
    """Recursive-halving reduce-scatter + recursive-doubling allgather (any op, order kept)."""
    if nranks == 1 or count == 0:
        return []
    pof2 = pof2_below(nranks)
    vrank = virtual_rank(rank, nranks)
    slots = lambda lo, hi: span(count, pof2, lo, hi)
    return (fold_in(rank, nranks, 0, count, REDUCE)
            + halving_reduce_scatter(vrank, nranks, slots, keep_order=True)
            + doubling_allgather(vrank, nranks, slots, keep_order=True)
            + fold_out(rank, nranks, 0, count))
