"""What hierarchical and cascade do when their intra-node phase runs over shared memory.

Plain data, no MPI: the shared-memory transport (:mod:`mpiallreduce.shm_nodes`) moves the
bytes inside a node; across nodes each rank runs the point-to-point steps given here.

- cascade: the node's ``owners`` (the smallest node's size, the *core*) each reduce one block
  (``partition.block(count, owners, local)``) of every local slot, allreduce that block across
  nodes with the ranks of the same local index (cascade's own cross phase: flat ``inner``, or
  one more cascade level per coarser topology level), and publish it; every rank copies the
  blocks out. A node's ranks beyond the core only contribute their input (the remainder:
  unequal nodes need no fallback).
- hierarchical: the node's ranks each reduce one block (one rank, the leader, reduces all of it
  at small sizes); the leader gathers the blocks, allreduces the vector with the other leaders
  (flat ``inner``), and publishes it; every rank copies it out. Rank order is kept when every
  node is a block of consecutive ranks and ``inner`` keeps it (as the schedule form does).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..partition import block
from ..schedule import Step
from .cascade import _cascade
from .compose import INTRA, check_intra, choose_inner, flat_steps  # noqa: F401 - INTRA, check_intra: named here too

#: the algorithms whose intra-node phase can run over shared memory.
NODE_PHASED = ("hierarchical", "cascade")


@dataclass(frozen=True)
class NodePhase:
    """One rank's part of a two-level allreduce whose intra-node phase is shared memory.

    ``owners``: ranks of this rank's node that reduce a block (local ranks ``0 .. owners-1``,
    block ``partition.block(count, owners, local)``). ``leader``: hierarchical (the node's
    result comes from local rank 0, which gathers the blocks first) rather than cascade (every
    owner publishes its own block). ``cross``: this rank's point-to-point steps across nodes,
    on the parent communicator's ranks, over the range ``span`` of the vector (ranges in the
    steps count from ``span[0]``); empty where the rank has no cross-node part. ``inner``:
    the flat algorithm across nodes (None where nothing crosses).
    """

    owners: int
    leader: bool
    span: tuple[int, int]
    cross: tuple[Step, ...]
    inner: str | None


def node_phase(name: str, rank: int, count: int, topology, inner: str | None = None,
               ordered: bool = False, small: bool = False) -> NodePhase:
    """Return rank ``rank``'s :class:`NodePhase` of ``name`` (hierarchical or cascade).

    Args:
        small: the vector is small enough that one rank reducing it all beats splitting it
            (hierarchical only: its leader then reduces every slot itself).
        ordered: keep MPI's rank order (hierarchical; ValueError where it cannot, as the
            schedule form raises).
    """
    members = topology.members
    node = members[topology.node[rank]]
    local = topology.local_rank[rank]
    if name == "hierarchical":
        if ordered and not topology.contiguous:
            raise ValueError(f"hierarchical keeps rank order only when every node is a block of "
                             f"consecutive ranks; {topology!r} is not (use a commutative op)")
        owners = 1 if small else len(node)
        leaders = topology.leaders
        if local != 0 or len(leaders) == 1:
            return NodePhase(owners, True, (0, 0), (), None)
        inner = choose_inner(inner, count, ordered)
        return NodePhase(owners, True, (0, count),
                         tuple(flat_steps(inner, rank, leaders, 0, count)), inner)
    if name != "cascade":
        raise ValueError(f"{name!r} has no shared-memory intra-node phase; "
                         f"only {', '.join(NODE_PHASED)} do")
    owners = min(topology.node_sizes)
    if local >= owners:
        return NodePhase(owners, False, (0, 0), (), None)
    lo, hi = block(count, owners, local)
    if len(members) == 1:
        return NodePhase(owners, False, (lo, hi), (), None)
    widest = block(count, owners, 0)
    inner = choose_inner(inner, widest[1] - widest[0])
    group = tuple(unit[local] for unit in members)
    cross = tuple(_cascade(rank, group, topology.levels[1:], 0, hi - lo, inner))
    return NodePhase(owners, False, (lo, hi), cross, inner)
