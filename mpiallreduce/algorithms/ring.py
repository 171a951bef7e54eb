"""Ring allreduce: reduce-scatter around a ring, then allgather around it.

Cost: 2(p-1)α + 2(p-1)/p·nβ + (p-1)/p·nγ — bandwidth-optimal, latency linear in p.
Reference: Patarasuk & Yuan, "Bandwidth optimal all-reduce algorithms for clusters of
workstations", JPDC 2009; Thakur, Rabenseifner & Gropp, IJHPCA 2005.
"""

from __future__ import annotations

from ..partition import block
from ..schedule import COPY, REDUCE, Recv, Send, Step, step
from . import register


def ring_reduce_scatter(rank: int, nranks: int, count: int, owned: int = 1) -> list[Step]:
    """Return rank's p-1 ring steps after which it holds the reduced block ``(rank + owned) % p``.

    Each rank sends the block it has accumulated to its right neighbour and reduces the block
    arriving from its left neighbour into its own copy. ``owned=1`` suits the allgather that
    follows in allreduce; ``owned=0`` gives MPI's reduce-scatter layout (rank r gets block r).
    """
    right, left = (rank + 1) % nranks, (rank - 1) % nranks
    steps = []
    for s in range(nranks - 1):
        send_block = block(count, nranks, (rank + owned - 1 - s) % nranks)
        recv_block = block(count, nranks, (rank + owned - 2 - s) % nranks)
        steps.append(step([Send(right, *send_block)], [Recv(left, *recv_block, REDUCE)]))
    return steps


def ring_allgather(rank: int, nranks: int, count: int, first_owned: int = 1) -> list[Step]:
    """Return rank's p-1 ring steps that circulate every block, starting from block ``rank + first_owned``."""
    right, left = (rank + 1) % nranks, (rank - 1) % nranks
    steps = []
    for s in range(nranks - 1):
        send_block = block(count, nranks, (rank + first_owned - s) % nranks)
        recv_block = block(count, nranks, (rank + first_owned - s - 1) % nranks)
        steps.append(step([Send(right, *send_block)], [Recv(left, *recv_block, COPY)]))
    return steps


@register("ring", commutative_only=True)
def ring(rank: int, nranks: int, count: int, topology=None) -> list[Step]:
    """Ring reduce-scatter then ring allgather (bandwidth-optimal; commutative ops only)."""
    if nranks == 1 or count == 0:
        return []
    return ring_reduce_scatter(rank, nranks, count) + ring_allgather(rank, nranks, count)
