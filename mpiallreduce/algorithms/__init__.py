"""Algorithm registry: name -> per-rank schedule builder. No MPI is imported here.

A builder is ``build(rank, nranks, count, topology=None, **params) -> list[Step]``: the steps of
one rank. Allreduce builders live in :data:`REGISTRY`; the related collectives (reduce_scatter,
allgather, bcast, alltoall) have registries of their own in :data:`COLLECTIVES`, filled by the
same decorator with ``collective=``. :func:`build` assembles every rank's steps into a
:class:`~mpiallreduce.schedule.Schedule` for the verifier and the cost model; the executor asks
only for its own rank's steps, so a plan on rank r of a large communicator never builds the
other ranks' programs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ..schedule import Schedule


@dataclass(frozen=True)
class Algorithm:
    """A registered allreduce schedule builder and what it accepts."""

    name: str
    builder: Callable
    commutative_only: bool
    summary: str
    params: dict = field(default_factory=dict)
    uses_topology: bool = False

    def steps(self, rank: int, nranks: int, count: int, topology=None, **params):
        """Return rank ``rank``'s steps as a tuple."""
        return tuple(self.builder(rank, nranks, count, topology=topology, **params))


#: name -> Algorithm for allreduce, filled by :func:`register` as algorithm modules are imported.
REGISTRY: dict[str, Algorithm] = {}
#: collective -> (name -> Algorithm); "allreduce" is :data:`REGISTRY`.
COLLECTIVES: dict[str, dict[str, Algorithm]] = {
    "allreduce": REGISTRY, "reduce_scatter": {}, "allgather": {}, "bcast": {}, "alltoall": {}}


def register(name: str, *, commutative_only: bool, collective: str = "allreduce",
             uses_topology: bool = False, **defaults):
    """Register a per-rank schedule builder under ``name`` for ``collective``.

    Args:
        commutative_only: the schedule reorders operands. An algorithm that keeps rank order
            only in some cases registers ``False`` and a default ``ordered=False`` parameter:
            the API passes ``ordered=True`` for a non-commutative op, and the builder then keeps
            rank order or raises ValueError.
        uses_topology: the builder reads ``topology`` (the API then supplies one per comm).
        defaults: the builder's keyword parameters (and their defaults) that callers may set,
            e.g. through ``mar.plan(..., segment_bytes=...)``.
    """

    def decorate(builder: Callable) -> Callable:
        summary = (builder.__doc__ or "").strip().splitlines()[0] if builder.__doc__ else ""
        COLLECTIVES[collective][name] = Algorithm(name, builder, commutative_only, summary,
                                                  dict(defaults), uses_topology)
        return builder

    return decorate


def get(name: str, collective: str = "allreduce") -> Algorithm:
    """Return the registered algorithm ``name`` or raise ValueError listing the known names."""
    registry = COLLECTIVES[collective]
    try:
        return registry[name]
    except KeyError:
        raise ValueError(f"unknown {collective} algorithm {name!r}; choose one of "
                         f"{', '.join(registry)}") from None


def build(name: str, nranks: int, count: int, topology=None, collective: str = "allreduce",
          **params) -> Schedule:
    """Build the whole schedule of algorithm ``name`` for ``nranks`` ranks and ``count`` elements."""
    algorithm = get(name, collective)
    merged = {**algorithm.params, **params}
    ranks = tuple(algorithm.steps(rank, nranks, count, topology=topology, **merged)
                  for rank in range(nranks))
    ordered = not algorithm.commutative_only and merged.get("ordered", True)
    return Schedule(name, nranks, count, ranks, ordered=ordered, params=merged)


# Importing the modules fills REGISTRY (hierarchical and cascade look flat ones up by name).
from . import ring, ring_segmented, tree, knomial, recursive_doubling, rabenseifner  # noqa: E402,F401,I001
from . import collectives  # noqa: E402,F401
from . import cascade, hierarchical  # noqa: E402,F401
