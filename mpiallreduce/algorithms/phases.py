"""Phase builders the flat algorithms share: binomial trees, folding, halving and doubling.

Each returns one rank's steps for one phase; algorithms concatenate phases. Every rank of a phase
returns the same number of steps (idle ranks get empty ``Step()``\\ s) so that the phases of all
ranks stay step-aligned, which is how messages match.

Folding (Thakur, Rabenseifner & Gropp 2005, as Open MPI and MPICH do it): for p not a power of
two, with pof2 the largest power of two below p and rem = p - pof2, each even rank below 2·rem
hands its data to the odd rank above it and sits out; the remaining pof2 ranks get *virtual*
ranks 0..pof2-1, in rank order, each standing for one or two consecutive real ranks. The folded
ranks get the result back at the end.
"""

from __future__ import annotations

from collections.abc import Callable

from ..schedule import COPY, LOCAL_FIRST, RECEIVED_FIRST, REDUCE, Recv, Send, Step, step

Span = Callable[[int, int], tuple[int, int]]


def idle(nsteps: int) -> list[Step]:
    """Return ``nsteps`` empty steps: a rank that waits while others work in a phase."""
    return [Step() for _ in range(nsteps)]


def rounds(nranks: int) -> int:
    """Return ⌈lg nranks⌉, the depth of a binomial tree over ``nranks`` ranks."""
    return (nranks - 1).bit_length()


def pof2_below(nranks: int) -> int:
    """Return the largest power of two that is at most ``nranks``."""
    return 1 << (nranks.bit_length() - 1)


def virtual_rank(rank: int, nranks: int) -> int | None:
    """Return ``rank``'s virtual rank after folding, or ``None`` if it sits the phase out."""
    rem = nranks - pof2_below(nranks)
    if rank < 2 * rem:
        return rank // 2 if rank % 2 else None
    return rank - rem


def real_rank(vrank: int, nranks: int) -> int:
    """Return the real rank that acts for virtual rank ``vrank``."""
    rem = nranks - pof2_below(nranks)
    return 2 * vrank + 1 if vrank < rem else vrank + rem


def first_real_rank(vrank: int, nranks: int) -> int:
    """Return the lowest real rank virtual rank ``vrank`` stands for (``nranks`` past the end)."""
    rem = nranks - pof2_below(nranks)
    return 2 * vrank if vrank < rem else vrank + rem


def fold_in(rank: int, nranks: int, start: int, stop: int, action: str) -> list[Step]:
    """Return the folding step: even ranks below 2·rem send ``[start, stop)`` to ``rank + 1``.

    The odd partner reduces it as ``received ∘ local`` (keeping rank order) or copies it.
    No step at all when p is a power of two.
    """
    rem = nranks - pof2_below(nranks)
    if rem == 0:
        return []
    if rank >= 2 * rem:
        return idle(1)
    if rank % 2 == 0:
        return [step([Send(rank + 1, start, stop)])]
    return [step([], [Recv(rank - 1, start, stop, action, RECEIVED_FIRST)])]


def fold_out(rank: int, nranks: int, start: int, stop: int) -> list[Step]:
    """Return the unfolding step: odd ranks below 2·rem copy ``[start, stop)`` back to ``rank - 1``."""
    rem = nranks - pof2_below(nranks)
    if rem == 0:
        return []
    if rank >= 2 * rem:
        return idle(1)
    if rank % 2:
        return [step([Send(rank - 1, start, stop)])]
    return [step([], [Recv(rank + 1, start, stop, COPY)])]


def _masks(pof2: int, keep_order: bool) -> list[int]:
    """Halving masks: distance doubling (1, 2, 4, ...) keeps rank order, distance halving does not.

    With distance doubling a pair combines two *adjacent* aligned groups of virtual ranks, so
    every combine is ``lower group ∘ upper group``; the price is that virtual rank v ends up with
    slot bit-reverse(v) instead of slot v.
    """
    masks = [1 << t for t in range(pof2.bit_length() - 1)]
    return masks if keep_order else masks[::-1]


def _halve(vrank: int, mask: int, lo: int, hi: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """Split slots ``[lo, hi)`` in two: return (the half ``vrank`` keeps, the half it gives)."""
    mid = (lo + hi) // 2
    if vrank & mask:
        return (mid, hi), (lo, mid)
    return (lo, mid), (mid, hi)


def owned_slots(vrank: int, pof2: int, keep_order: bool) -> tuple[int, int]:
    """Return the slot range virtual rank ``vrank`` owns after recursive halving."""
    lo, hi = 0, pof2
    for mask in _masks(pof2, keep_order):
        (lo, hi), _ = _halve(vrank, mask, lo, hi)
    return lo, hi


def halving_reduce_scatter(vrank: int | None, nranks: int, span: Span,
                           keep_order: bool) -> list[Step]:
    """Return the recursive-halving reduce-scatter steps among the pof2 virtual ranks.

    The vector is cut into pof2 slots; ``span(lo, hi)`` gives the element range of slots
    ``[lo, hi)``. In each round a virtual rank sends the half of its current slots it gives up to
    ``vrank ^ mask`` and reduces the half it keeps with the peer's copy. ``vrank=None`` (a rank
    folded away) gets empty steps.
    """
    pof2 = pof2_below(nranks)
    masks = _masks(pof2, keep_order)
    if vrank is None:
        return idle(len(masks))
    steps = []
    lo, hi = 0, pof2
    for mask in masks:
        peer = vrank ^ mask
        keep, give = _halve(vrank, mask, lo, hi)
        order = LOCAL_FIRST if vrank < peer else RECEIVED_FIRST
        to = real_rank(peer, nranks)
        steps.append(step([Send(to, *span(*give))], [Recv(to, *span(*keep), REDUCE, order)]))
        lo, hi = keep
    return steps


def doubling_allgather(vrank: int | None, nranks: int, span: Span, keep_order: bool) -> list[Step]:
    """Return the recursive-doubling allgather that undoes :func:`halving_reduce_scatter`.

    Each virtual rank starts with the slots halving left it and, round by round in reverse,
    swaps its slots with ``vrank ^ mask`` until it holds all of them.
    """
    pof2 = pof2_below(nranks)
    masks = _masks(pof2, keep_order)[::-1]
    if vrank is None:
        return idle(len(masks))
    steps = []
    lo, hi = owned_slots(vrank, pof2, keep_order)
    for mask in masks:
        peer = vrank ^ mask
        size = hi - lo
        theirs = (lo - size, lo) if vrank & mask else (hi, hi + size)
        to = real_rank(peer, nranks)
        steps.append(step([Send(to, *span(lo, hi))], [Recv(to, *span(*theirs), COPY)]))
        lo, hi = min(lo, theirs[0]), max(hi, theirs[1])
    return steps


def knomial_rounds(nranks: int, radix: int) -> int:
    """Return ⌈log_radix nranks⌉, the depth of a ``radix``-nomial tree over ``nranks`` ranks."""
    depth, reach = 0, 1
    while reach < nranks:
        depth, reach = depth + 1, reach * radix
    return depth


def _distances(nranks: int, radix: int) -> list[int]:
    """Return the distances 1, radix, radix², ... of a ``radix``-nomial tree's rounds."""
    return [radix ** t for t in range(knomial_rounds(nranks, radix))]


def knomial_reduce(rank: int, nranks: int, count: int, radix: int = 2) -> list[Step]:
    """Return the ⌈log_radix p⌉ steps of a ``radix``-nomial-tree reduce of the whole vector to rank 0.

    In round ``mask`` (1, radix, radix², ...) a rank whose digit at ``mask`` is ``j`` > 0 (and
    whose lower digits are 0) sends its partial result, ranks ``[rank, rank + mask)``, to
    ``rank - j·mask``; a rank whose lower digits are all 0 receives from its up to radix-1
    children ``rank + j·mask`` in one step and appends them in order on the right: ``local ∘
    child 1 ∘ child 2 ∘ ...``, so rank order is kept. ``radix=2`` is the binomial tree.
    """
    steps = []
    for mask in _distances(nranks, radix):
        digit, below = divmod(rank % (radix * mask), mask)
        if below:
            steps.append(Step())
        elif digit:
            steps.append(step([Send(rank - digit * mask, 0, count)]))
        else:
            children = range(rank + mask, min(rank + radix * mask, nranks), mask)
            steps.append(step([], [Recv(child, 0, count, REDUCE, LOCAL_FIRST) for child in children]))
    return steps


def knomial_bcast(rank: int, nranks: int, root: int, span: Span, radix: int = 2) -> list[Step]:
    """Return the ⌈log_radix p⌉ steps of a ``radix``-nomial-tree broadcast (or scatter) from ``root``.

    Ranks are taken relative to the root (``vrank = rank - root mod p``). In round ``mask``
    (largest first) a vrank that has its data (its digits up to ``mask`` are 0) sends to each
    child ``vrank + j·mask``, j = 1..radix-1, the range ``span(child, end of the child's
    subtree)``: the whole vector for a broadcast, the subtree's blocks for a scatter.
    ``radix=2`` is the binomial tree.
    """
    vrank = (rank - root) % nranks
    real = lambda v: (v + root) % nranks  # noqa: E731
    subtree = lambda child, mask: span(child, min(child + mask, nranks))  # noqa: E731
    steps = []
    for mask in reversed(_distances(nranks, radix)):
        digit, below = divmod(vrank % (radix * mask), mask)
        if below:
            steps.append(Step())
        elif digit:
            parent = vrank - digit * mask
            steps.append(step([], [Recv(real(parent), *subtree(vrank, mask), COPY)]))
        else:
            children = range(vrank + mask, min(vrank + radix * mask, nranks), mask)
            steps.append(step([Send(real(child), *subtree(child, mask)) for child in children]))
    return steps


def binomial_reduce(rank: int, nranks: int, count: int) -> list[Step]:
    """Return the ⌈lg p⌉ steps of a binomial-tree reduce of the whole vector to rank 0.

    In round ``mask`` a rank whose lowest set bit is ``mask`` sends its partial result (ranks
    ``[rank, rank + mask)``) to ``rank - mask``, which appends it on the right: ``local ∘
    received``, so rank order is kept.
    """
    return knomial_reduce(rank, nranks, count, radix=2)


def binomial_bcast(rank: int, nranks: int, root: int, span: Span) -> list[Step]:
    """Return the ⌈lg p⌉ steps of a binomial-tree broadcast (or scatter) from ``root``.

    Ranks are taken relative to the root (``vrank = rank - root mod p``). In round ``mask``
    (largest first) a vrank that has its data sends to ``vrank + mask`` the range
    ``span(vrank + mask, end of that child's subtree)``: the whole vector for a broadcast, the
    child subtree's blocks for a scatter.
    """
    return knomial_bcast(rank, nranks, root, span, radix=2)
