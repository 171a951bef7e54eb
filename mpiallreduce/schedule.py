"""Schedules: what every rank sends and receives, step by step, as plain data (no MPI).

A rank works on one buffer of ``count`` elements (for allreduce: the result buffer, which starts
as the rank's own contribution). A step holds sends and receives that may be in flight together.
Sends read the buffer as it was when the step began; receives land after every message of the
step has completed, in the order listed, either copied into their range or reduced with it.
Several reduces of one step may target the same range (a k-nomial parent reducing its
children, in the order listed); a copy shares its range with no other receive of its step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

COPY = "copy"
REDUCE = "reduce"
#: operand order of a reduce: ``received ∘ local`` (the sender's ranks come first) ...
RECEIVED_FIRST = "received_first"
#: ... or ``local ∘ received``.
LOCAL_FIRST = "local_first"


@dataclass(frozen=True, slots=True)
class Send:
    """Send elements ``[start, stop)`` of the working buffer to ``peer``."""

    peer: int
    start: int
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True, slots=True)
class Recv:
    """Receive ``stop - start`` elements from ``peer`` and copy or reduce them into ``[start, stop)``."""

    peer: int
    start: int
    stop: int
    action: str = COPY
    order: str = RECEIVED_FIRST

    @property
    def size(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True, slots=True)
class Step:
    """Messages one rank may have in flight together."""

    sends: tuple[Send, ...] = ()
    recvs: tuple[Recv, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.sends or self.recvs)


@dataclass(frozen=True)
class Schedule:
    """Every rank's steps for one collective on ``nranks`` ranks and ``count`` elements.

    ``ranks[r]`` is rank r's tuple of steps. Messages match by step index: a send in rank r's
    step k is received by a receive from r in the peer's step k, in the order both list them.
    """

    name: str
    nranks: int
    count: int
    ranks: tuple[tuple[Step, ...], ...]
    ordered: bool = False
    params: dict = field(default_factory=dict, compare=False)

    @property
    def nsteps(self) -> int:
        return max((len(steps) for steps in self.ranks), default=0)

    def messages(self):
        """Yield ``(rank, step, Send)`` for every send in the schedule."""
        for rank, steps in enumerate(self.ranks):
            for index, step in enumerate(steps):
                for send in step.sends:
                    yield rank, index, send


def step(sends=(), recvs=()) -> Step:
    """Build a Step from any iterables of Send and Recv."""
    return Step(tuple(sends), tuple(recvs))
