"""Which rank is on which node: plain data. Only :meth:`Topology.from_comm` touches MPI.

A topology lists, for every rank of a communicator, the node it runs on, and optionally coarser
levels above that (a group of nodes under one switch, a rack, ...). Hierarchical and cascade
schedules are built from it; the verifier and the cost model use it without MPI.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cached_property
from math import isqrt

#: environment variable that makes :meth:`Topology.from_comm` simulate nodes of k ranks.
RANKS_PER_NODE_ENV = "MPIALLREDUCE_RANKS_PER_NODE"


def _first_appearance(ids) -> tuple[int, ...]:
    """Renumber ``ids`` 0, 1, 2, ... in order of first appearance (equal topologies compare equal)."""
    seen: dict = {}
    return tuple(seen.setdefault(i, len(seen)) for i in ids)


def _consecutive(nranks: int, size: int) -> tuple[int, ...]:
    """Unit index of each of ``nranks`` ranks when consecutive ranks form units of ``size``."""
    return tuple(rank // size for rank in range(nranks))


def _positive(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


@dataclass(frozen=True)
class Topology:
    """Node (and coarser level) membership of every rank; hashable, identical on every rank.

    ``levels[0][r]`` is the node of rank r, ``levels[1][r]`` (if present) the group of nodes it
    belongs to, and so on; every level nests in the next (ranks of one node share one group).
    Unit indices are renumbered in order of first appearance. Build one with :meth:`from_nodes`,
    :meth:`from_levels`, :meth:`simulated` or :meth:`from_comm`.
    """

    levels: tuple[tuple[int, ...], ...]

    def __post_init__(self):
        if not self.levels:
            raise ValueError("a topology needs at least one level (the node of every rank)")
        levels = tuple(_first_appearance(level) for level in self.levels)
        nranks = len(levels[0])
        if nranks == 0:
            raise ValueError("a topology needs at least one rank")
        for depth, (inner, outer) in enumerate(zip(levels, levels[1:]), start=1):
            if len(outer) != nranks:
                raise ValueError(f"level {depth} lists {len(outer)} ranks, level 0 lists {nranks}")
            parent: dict[int, int] = {}
            for rank, (unit, above) in enumerate(zip(inner, outer)):
                if parent.setdefault(unit, above) != above:
                    raise ValueError(f"level {depth - 1} unit of rank {rank} spans several "
                                     f"level {depth} units; levels must nest")
        object.__setattr__(self, "levels", levels)

    # -- constructors ----------------------------------------------------------------------------

    @classmethod
    def from_nodes(cls, nodes) -> Topology:
        """Build a one-level topology from the node index of every rank, e.g. ``[0, 0, 1, 1]``."""
        return cls((tuple(int(n) for n in nodes),))

    @classmethod
    def from_levels(cls, *levels) -> Topology:
        """Build a multi-level topology: the node of every rank, then the group of every rank, ..."""
        return cls(tuple(tuple(int(u) for u in level) for level in levels))

    @classmethod
    def simulated(cls, comm_or_size, ranks_per_node: int, nodes_per_group: int | None = None
                  ) -> Topology:
        """Group consecutive ranks into nodes of ``ranks_per_node`` (the last may be smaller).

        Args:
            comm_or_size: a communicator (only its size is read) or a number of ranks.
            ranks_per_node: ranks per simulated node.
            nodes_per_group: if given, also group consecutive nodes into a second level.
        """
        nranks = comm_or_size if isinstance(comm_or_size, int) else comm_or_size.Get_size()
        _positive(nranks, "the number of ranks")
        _positive(ranks_per_node, "ranks_per_node")
        levels = [_consecutive(nranks, ranks_per_node)]
        if nodes_per_group is not None:
            _positive(nodes_per_group, "nodes_per_group")
            levels.append(_consecutive(nranks, ranks_per_node * nodes_per_group))
        return cls(tuple(levels))

    @classmethod
    def default(cls, nranks: int) -> Topology:
        """A simulated topology for schedules built without one: nodes of ⌈√p⌉ consecutive ranks."""
        root = isqrt(nranks)
        return cls.simulated(nranks, root if root * root == nranks else root + 1)

    @classmethod
    def from_comm(cls, comm) -> Topology:
        """Group ``comm``'s ranks by shared-memory node (collective: call it on every rank).

        With the environment variable ``MPIALLREDUCE_RANKS_PER_NODE=k`` set, consecutive ranks
        form simulated nodes of k instead, so one machine can run several "nodes". The variable
        must hold the same value on every rank; a difference raises the same ValueError on all.
        """
        from mpi4py import MPI

        setting = os.environ.get(RANKS_PER_NODE_ENV, "").strip()
        local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
        try:
            leader = local.bcast(comm.Get_rank(), root=0)  # node id: its lowest rank in comm
        finally:
            local.Free()
        gathered = comm.allgather((leader, setting))
        settings = sorted({s for _, s in gathered})
        if len(settings) > 1:
            raise ValueError(f"{RANKS_PER_NODE_ENV} differs between ranks ({settings}); set it "
                             f"identically on every rank")
        if setting:
            try:
                ranks_per_node = int(setting)
            except ValueError:
                ranks_per_node = 0
            if ranks_per_node < 1:
                raise ValueError(f"{RANKS_PER_NODE_ENV}={setting!r} is not a positive integer")
            return cls.simulated(comm.Get_size(), ranks_per_node)
        return cls.from_nodes(node for node, _ in gathered)

    # -- derived data ------------------------------------------------------------------------------

    @property
    def nranks(self) -> int:
        return len(self.levels[0])

    @property
    def node(self) -> tuple[int, ...]:
        """Node index of every rank."""
        return self.levels[0]

    @cached_property
    def members(self) -> tuple[tuple[int, ...], ...]:
        """Ranks of every node, ascending; nodes in order of their lowest rank."""
        return units(range(self.nranks), self.node)

    @property
    def nnodes(self) -> int:
        return len(self.members)

    @property
    def node_sizes(self) -> tuple[int, ...]:
        return tuple(len(ranks) for ranks in self.members)

    @cached_property
    def local_rank(self) -> tuple[int, ...]:
        """Index of every rank inside its node."""
        local = [0] * self.nranks
        for ranks in self.members:
            for index, rank in enumerate(ranks):
                local[rank] = index
        return tuple(local)

    @property
    def leaders(self) -> tuple[int, ...]:
        """The lowest rank of every node."""
        return tuple(ranks[0] for ranks in self.members)

    @property
    def contiguous(self) -> bool:
        """True when every node is a block of consecutive ranks (then node order is rank order)."""
        return all(ranks[-1] - ranks[0] == len(ranks) - 1 for ranks in self.members)

    def check_size(self, nranks: int) -> None:
        """Raise ValueError unless the topology describes exactly ``nranks`` ranks."""
        if self.nranks != nranks:
            raise ValueError(f"topology describes {self.nranks} ranks but the communicator has "
                             f"{nranks}; build it for this communicator (Topology.from_comm or "
                             f"Topology.simulated(comm, ranks_per_node=k))")

    def __repr__(self) -> str:
        sizes = "+".join(map(str, self.node_sizes))
        more = f", {len(self.levels)} levels" if len(self.levels) > 1 else ""
        return f"Topology({self.nranks} ranks, nodes {sizes}{more})"


def units(ranks, ids) -> tuple[tuple[int, ...], ...]:
    """Split ``ranks`` (ascending) by ``ids[rank]``: units in order of their lowest rank."""
    grouped: dict[int, list[int]] = {}
    for rank in ranks:
        grouped.setdefault(ids[rank], []).append(rank)
    return tuple(tuple(members) for members in grouped.values())
