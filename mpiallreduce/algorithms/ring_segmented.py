"""Segmented (pipelined) ring allreduce: the ring's reduce-scatter cut into segments.

Each of the p-1 reduce-scatter rounds of :mod:`ring` is cut into m pieces (every block split m
ways by the block distribution, m chosen so that no piece exceeds the segment size), and each
piece is one step: send piece k of the block accumulated so far to the right, receive piece k
of the next block from the left and reduce it. The allgather phase is the plain ring's: it has
nothing to combine, so cutting it would only add latency (Open MPI's ``ring_segmented`` does
the same).

Overlap. A step's reduce touches piece k of the block it received, and the next step sends and
receives piece k + 1 (or piece 0 of the block reduced m steps earlier), so the two touch
disjoint ranges. The executor sees that when it binds the plan and *defers* such a step's
combines until it has posted the next step's messages: it starts step k + 1's sends and
receives, then reduces piece k while they are in flight, then waits (receives of consecutive
steps land in alternate halves of the scratch). The schedule keeps the simple step semantics the
verifier checks; the overlap is the executor's, found from the ranges alone, so any schedule
with the same shape gets it. With m = 1 every step sends what the previous one reduced, and
nothing is deferred: that is the plain ring.

Segment size: ``segment_bytes`` (default :data:`SEGMENT_BYTES`) with the element size
``itemsize`` that :func:`mpiallreduce.allreduce` fills in from the dtype. Pass a small value,
``mar.allreduce(x, algorithm="ring_segmented", segment_bytes=64)`` or the same keyword to
``mar.plan``, to force many segments on a small count (the tests do).

Cost: (p-1)(m+1)α + 2(p-1)/p·nβ + (p-1)/p·nγ, with the γ term hidden behind the β term of the
next segment when the transport progresses while Python reduces.
Reference: Patarasuk & Yuan, JPDC 2009; Open MPI coll/tuned ``allreduce_intra_ring_segmented``.
"""

from __future__ import annotations

from ..partition import block, sub_block
from ..schedule import REDUCE, Recv, Send, Step, step
from . import register
from .ring import ring_allgather

#: default largest segment: big enough that a step's interpreter cost (~10-20 µs) stays small
#: against its transfer, small enough that a message of a few MiB is pipelined.
SEGMENT_BYTES = 256 * 1024


def pieces(count: int, nranks: int, segment: int) -> int:
    """Return how many pieces each ring block is cut into so none exceeds ``segment`` elements."""
    start, stop = block(count, nranks, 0)  # block 0 is the largest
    return max(1, -(-(stop - start) // segment))


@register("ring_segmented", commutative_only=True, segment_bytes=SEGMENT_BYTES, itemsize=8)
def ring_segmented(rank: int, nranks: int, count: int, topology=None,
                   segment_bytes: int = SEGMENT_BYTES, itemsize: int = 8) -> list[Step]:
    """Pipelined ring: reduce-scatter in segments overlapping the combines, then ring allgather."""
    if segment_bytes < 1 or itemsize < 1:
        raise ValueError(f"segment_bytes and itemsize must be >= 1, got {segment_bytes}, {itemsize}")
    if nranks == 1 or count == 0:
        return []
    m = pieces(count, nranks, max(1, segment_bytes // itemsize))
    right, left = (rank + 1) % nranks, (rank - 1) % nranks
    steps = []
    for s in range(nranks - 1):
        send_block = block(count, nranks, (rank - s) % nranks)
        recv_block = block(count, nranks, (rank - s - 1) % nranks)
        for k in range(m):
            steps.append(step([Send(right, *sub_block(*send_block, m, k))],
                              [Recv(left, *sub_block(*recv_block, m, k), REDUCE)]))
    return steps + ring_allgather(rank, nranks, count)
