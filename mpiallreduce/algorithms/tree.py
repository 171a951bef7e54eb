"""Tree allreduce: binomial-tree reduce to rank 0, then binomial-tree broadcast.

Every combine appends a contiguous group of higher ranks on the right (``local ∘ received``),
so MPI's rank order is kept and non-commutative ops are exact; rank 0 computes the result once
and everyone receives a copy, so results are bit-identical.

Cost: 2⌈lg p⌉(α + nβ) + ⌈lg p⌉nγ — latency-optimal in step count among tree shapes, but every
byte crosses every level: wins for small messages.
Reference: Thakur, Rabenseifner & Gropp, IJHPCA 2005 (binomial reduce and broadcast).
"""

from __future__ import annotations

from ..schedule import Step
from . import register
from .phases import binomial_bcast, binomial_reduce


@register("tree", commutative_only=False)
def tree(rank: int, nranks: int, count: int, topology=None) -> list[Step]:
    """Binomial reduce to rank 0 then binomial broadcast (any op, rank order kept)."""
    if nranks == 1 or count == 0:
        return []
    return (binomial_reduce(rank, nranks, count)
            + binomial_bcast(rank, nranks, 0, lambda lo, hi: (0, count)))
