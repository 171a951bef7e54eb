"""Compose flat schedules into hierarchical ones: relabel a sub-group's program, pad phases.

Messages match by step index, so when several sub-groups run a phase side by side (every node
its own reduce, every shard its own cross-node allreduce), each rank's part of the phase is
padded with empty steps to the longest program of that phase over all ranks: the next phase
then starts at the same step index everywhere.
"""

from __future__ import annotations

from functools import lru_cache

from ..schedule import Recv, Send, Step
from ..topology import Topology
from . import REGISTRY, get

#: below this many elements per leader or shard, the default inner algorithm is latency-bound.
SMALL_COUNT = 4096
#: how hierarchical and cascade plans run their intra-node phase: over shared memory where the
#: transport can ("auto"), always ("shm": a ValueError where it cannot), or as the
#: point-to-point schedule ("p2p"); see :mod:`.nodes`.
INTRA = ("auto", "shm", "p2p")
_LATENCY_FIRST = ("recursive_doubling", "tree", "rabenseifner", "ring")
_BANDWIDTH_FIRST = ("rabenseifner", "ring", "recursive_doubling", "tree")


def relabel(steps, ranks, offset: int = 0) -> list[Step]:
    """Map a sub-group's program to parent ranks (peer i -> ``ranks[i]``), ranges shifted by ``offset``."""
    return [Step(tuple(Send(ranks[s.peer], s.start + offset, s.stop + offset) for s in step.sends),
                 tuple(Recv(ranks[r.peer], r.start + offset, r.stop + offset, r.action, r.order)
                       for r in step.recvs))
            for step in steps]


def pad(steps, length: int) -> list[Step]:
    """Return ``steps`` followed by empty steps up to ``length`` steps."""
    steps = list(steps)
    if len(steps) > length:
        raise ValueError(f"phase of {len(steps)} steps does not fit its padded length {length}")
    return steps + [Step()] * (length - len(steps))


@lru_cache(maxsize=4096)
def program_length(name: str, nranks: int, count: int) -> int:
    """Number of steps of every rank's program of flat algorithm ``name``.

    Flat algorithms are built from phases that pad idle ranks with empty steps, so every rank's
    program has the same length (``tests/test_model.py`` checks this for p = 1..64) and rank 0's
    program gives it: O(one program) instead of building all p of them, which made hierarchical
    and cascade schedules O(p²) to build (seconds at 512 nodes with ``inner="ring"``).
    """
    algorithm = get(name)
    return len(algorithm.steps(0, nranks, count, **algorithm.params))


def flat_steps(name: str, rank: int, ranks, start: int, stop: int) -> list[Step]:
    """Rank ``rank``'s steps of flat ``name`` allreducing ``[start, stop)`` among parent ranks ``ranks``.

    Padded to the algorithm's longest program for this group, so every member ends together.
    """
    algorithm = get(name)
    nranks, count = len(ranks), stop - start
    steps = algorithm.steps(ranks.index(rank), nranks, count, **algorithm.params)
    return pad(relabel(steps, ranks, start), program_length(name, nranks, count))


def check_intra(intra) -> None:
    """Raise ValueError unless ``intra`` is one of :data:`INTRA`."""
    if intra not in INTRA:
        raise ValueError(f"intra must be one of {', '.join(map(repr, INTRA))}, got {intra!r}")


def resolve_topology(topology, nranks: int) -> Topology:
    """Return ``topology`` checked against ``nranks``; ``None`` gives :meth:`Topology.default`."""
    if topology is None:
        return Topology.default(nranks)
    if not isinstance(topology, Topology):
        raise TypeError(f"topology must be a mpiallreduce Topology, got {type(topology).__name__}")
    topology.check_size(nranks)
    return topology


def choose_inner(inner: str | None, count: int, ordered: bool = False) -> str:
    """Return the flat algorithm used across nodes: ``inner`` checked, or one chosen by size.

    The default is latency-first below :data:`SMALL_COUNT` elements (recursive doubling, tree),
    bandwidth-first above (Rabenseifner, ring), then any other registered flat algorithm; with
    ``ordered`` only among algorithms that keep MPI's rank order.
    """
    if inner is None:
        preference = _LATENCY_FIRST if count < SMALL_COUNT else _BANDWIDTH_FIRST
        flat = sorted(name for name, algorithm in REGISTRY.items() if not algorithm.uses_topology)
        for name in (*preference, *flat):
            if name in REGISTRY and not (ordered and REGISTRY[name].commutative_only):
                return name
        raise ValueError("no registered flat algorithm keeps rank order, so a non-commutative "
                         "op cannot cross nodes here; use a commutative op or 'native'")
    algorithm = get(inner)
    if algorithm.uses_topology:
        raise ValueError(f"inner={inner!r} must be a flat algorithm, not one that uses a topology")
    if ordered and algorithm.commutative_only:
        raise ValueError(f"inner={inner!r} reorders operands; a non-commutative op needs an "
                         f"inner algorithm that keeps rank order")
    return inner
