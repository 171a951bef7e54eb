"""Algorithm registry: name -> per-rank schedule builder. No MPI is imported here.

A builder is ``build(rank, nranks, count, topology=None, **params) -> list[Step]``: the steps of
one rank. :func:`build` assembles every rank's steps into a :class:`~mpiallreduce.schedule.Schedule`
for the verifier and the cost model; the executor asks only for its own rank's steps, so a plan on
rank r of a large communicator never builds the other ranks' programs.
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

    def steps(self, rank: int, nranks: int, count: int, topology=None, **params):
        """Return rank ``rank``'s steps as a tuple."""
        return tuple(self.builder(rank, nranks, count, topology=topology, **params))


#: name -> Algorithm, filled by :func:`register` as algorithm modules are imported.
REGISTRY: dict[str, Algorithm] = {}


def register(name: str, *, commutative_only: bool, **defaults):
    """Register a per-rank schedule builder under ``name``."""

    def decorate(builder: Callable) -> Callable:
        summary = (builder.__doc__ or "").strip().splitlines()[0] if builder.__doc__ else ""
        REGISTRY[name] = Algorithm(name, builder, commutative_only, summary, dict(defaults))
        return builder

    return decorate


def get(name: str) -> Algorithm:
    """Return the registered algorithm ``name`` or raise ValueError listing the known names."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown algorithm {name!r}; choose one of "
                         f"{', '.join(sorted(REGISTRY))}") from None


def build(name: str, nranks: int, count: int, topology=None, **params) -> Schedule:
    """Build the whole schedule of algorithm ``name`` for ``nranks`` ranks and ``count`` elements."""
    algorithm = get(name)
    merged = {**algorithm.params, **params}
    ranks = tuple(algorithm.steps(rank, nranks, count, topology=topology, **merged)
                  for rank in range(nranks))
    return Schedule(name, nranks, count, ranks, ordered=not algorithm.commutative_only,
                    params=merged)


# Importing the modules fills REGISTRY.
from . import ring  # noqa: E402,F401
