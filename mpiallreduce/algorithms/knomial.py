"""K-nomial allreduce: k-nomial-tree reduce to rank 0, then k-nomial-tree broadcast.

A k-nomial tree (radix k) is the binomial tree with k-1 children per round instead of one: in
round ``mask`` (1, k, k², ...) each parent takes its children ``rank + j·mask``, j = 1..k-1, in
one step. Fewer rounds than binomial (⌈log_k p⌉ instead of ⌈lg p⌉), at the price of k-1
messages into (and out of) a parent per round. A parent appends its children's contiguous rank
groups on the right in rank order (``local ∘ child 1 ∘ ... ∘ child k-1``), so MPI's rank order
is kept and non-commutative ops are exact; rank 0 computes the result once and everyone
receives a copy, so results are bit-identical. ``k = 2`` is :mod:`tree`.

Default radix :data:`RADIX` = 4, chosen by timing the radixes against each other at 4 ranks
(``mpirun -n 4 python -m mpi4py -m mpiallreduce.tune --sizes 8:1M --compare
k2=knomial:k=2 k3=knomial:k=3 k4=knomial:k=4 k5=knomial:k=5``): up to 16 KiB k=4 was the
fastest, from 64 KiB the radixes tied, and at 1 MiB k=2 won, as the (k-1)nβ term says.
So k=4 for the small messages this algorithm is for; pass ``k=2`` (or use ``tree``) for large.

Cost: 2⌈log_k p⌉(α + (k-1)nβ) + ⌈log_k p⌉(k-1)nγ — fewer rounds than :mod:`tree` (the α term)
when α dominates; the (k-1)-fold β and γ terms are a parent's serialised traffic and combines.
Reference: the k-nomial trees of MPICH (``MPIR_CVAR_*_TREE_KVAL``) and UCC's knomial allreduce;
Thakur, Rabenseifner & Gropp, IJHPCA 2005, for the binomial case.
"""

from __future__ import annotations

from ..schedule import Step
from . import register
from .phases import knomial_bcast, knomial_reduce

#: default radix k (measured, see the module docstring).
RADIX = 4


@register("knomial", commutative_only=False, k=RADIX)
def knomial(rank: int, nranks: int, count: int, topology=None, k: int = RADIX) -> list[Step]:
    """K-nomial reduce to rank 0 then k-nomial broadcast (any op, rank order kept).

    Args:
        k: the radix, an integer >= 2 (2 is the binomial tree of ``tree``).
    """
    if isinstance(k, bool) or not isinstance(k, int) or k < 2:
        raise ValueError(f"knomial needs an integer radix k >= 2 (2 is the binomial tree), "
                         f"got k={k!r}")
    if nranks == 1 or count == 0:
        return []
    return (knomial_reduce(rank, nranks, count, radix=k)
            + knomial_bcast(rank, nranks, 0, lambda lo, hi: (0, count), radix=k))
