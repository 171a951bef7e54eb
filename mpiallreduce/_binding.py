"""Binding a schedule to buffers: which ranges are written, where messages land, what scratch.

Plain data and analysis used by :class:`mpiallreduce.executor.Plan` when it is built: the
views of a collective's buffers (:class:`Layout`), the ranges a run has written so far
(:class:`_Written`), each bound step (:class:`_BoundStep`), and how much scratch a schedule
needs and which combines may be deferred past the next step's posting. No MPI calls.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .schedule import COPY, Step


def flat(array: np.ndarray) -> np.ndarray:
    """Return a 1-D view of a C- or Fortran-contiguous array, in memory order (as MPI reads it)."""
    return array.reshape(-1, order="A")


@dataclass
class _BoundStep:
    """One step bound to buffers: what to post, and what to call once it completes.

    ``before`` are copies made before the step's messages are posted, ``combines`` the
    argument-free calls made once they complete (copies out of scratch and reductions, bound
    at plan time; reductions stay ``(received, local, lo, hi, order)`` tuples until
    :meth:`Plan._bind_reductions` knows every step's sends), ``requests`` the persistent
    requests (persistent plans only).
    """

    index: int
    recvs: list  # (peer, view)
    sends: list  # (peer, view)
    before: tuple
    combines: tuple
    requests: list
    defer: bool = False  # combine after posting the next step (see _deferrable)
    sent: list | None = None  # element ranges sent from the working space (not sendbuf)


class _Written:
    """Which element ranges of the result buffer hold data written by the plan so far.

    Out of place, nothing is copied from sendbuf first: until a range is written (a receive
    lands in it or a reduction stores into it), the plan reads this rank's contribution from
    sendbuf, so sends go out of sendbuf and the first reduction of a range reads
    ``received ∘ sendbuf`` and stores into the result.
    """

    def __init__(self, written: bool):
        self.ranges: list[tuple[int, int]] = []
        self.everything = written  # in place: the result buffer holds the input from the start

    def pieces(self, start: int, stop: int) -> list[tuple[int, int, bool]]:
        """Split ``[start, stop)`` into ``(lo, hi, written)`` pieces in order."""
        if self.everything:
            return [(start, stop, True)]
        out, position = [], start
        for lo, hi in self.ranges:
            if hi <= position or lo >= stop:
                continue
            if lo > position:
                out.append((position, lo, False))
            out.append((max(lo, position), min(hi, stop), True))
            position = min(hi, stop)
        if position < stop:
            out.append((position, stop, False))
        return out

    def add(self, start: int, stop: int) -> None:
        if self.everything or stop <= start:
            return
        merged = []
        for lo, hi in self.ranges:
            if hi < start or lo > stop:
                merged.append((lo, hi))
            else:
                start, stop = min(lo, start), max(hi, stop)
        merged.append((start, stop))
        self.ranges = sorted(merged)

    def missing(self, count: int) -> list[tuple[int, int]]:
        """Ranges of ``[0, count)`` never written."""
        return [(lo, hi) for lo, hi, written in self.pieces(0, count) if not written]


@dataclass(frozen=True)
class Layout:
    """Where a schedule's working space lives, and what is copied in before and out after.

    ``regions`` are flat arrays laid end to end: the schedule's element ``i`` is element ``i`` of
    their concatenation (allreduce: the result buffer alone; alltoall: send then receive
    buffer). ``load`` and ``store`` are ``(source, destination)`` pairs of equal-sized flat
    arrays copied before the first step and after the last one.
    """

    regions: tuple[np.ndarray, ...]
    load: tuple[tuple[np.ndarray, np.ndarray], ...] = ()
    store: tuple[tuple[np.ndarray, np.ndarray], ...] = ()

    @classmethod
    def allreduce(cls, recvbuf: np.ndarray) -> Layout:
        """Work in ``recvbuf`` (out of place, the plan reads sendbuf where it has not written)."""
        return cls((flat(recvbuf),))

    def view(self, start: int, stop: int) -> np.ndarray:
        """Return the view of schedule elements ``[start, stop)``, which lie in one region."""
        offset = 0
        for region in self.regions:
            end = offset + region.size
            if start < end:
                if stop > end:
                    raise ValueError(f"range [{start}, {stop}) straddles two buffers")
                return region[start - offset:stop - offset]
            offset = end
        raise ValueError(f"range [{start}, {stop}) outside the working space of {offset}")


def _overlaps(start: int, stop: int, ranges) -> bool:
    return any(start < hi and lo < stop for lo, hi in ranges)


def _scratch_recvs(step: Step) -> list:
    """Receives of a step that land in scratch: reduces, and copies into a range being sent."""
    sent = [(s.start, s.stop) for s in step.sends]
    return [r for r in step.recvs
            if r.size and (r.action != COPY or _overlaps(r.start, r.stop, sent))]


def _deferrable(step: Step, following: Step | None) -> bool:
    """May ``step``'s combines wait until ``following``'s messages are posted?

    Yes when ``following`` neither sends nor receives into any range those combines write: the
    combines then overlap the next step's transfers (a pipelined schedule's segments) and nobody
    can tell. Scratch is double-buffered for such plans, so the receives never collide there.
    """
    targets = [(r.start, r.stop) for r in _scratch_recvs(step)]
    if not targets or following is None:
        return False
    touched = [(m.start, m.stop) for m in (*following.sends, *following.recvs) if m.size]
    return not any(_overlaps(lo, hi, touched) for lo, hi in targets)


def _nonempty(steps: tuple[Step, ...]) -> list[tuple[int, Step]]:
    return [(index, step) for index, step in enumerate(steps) if step]


def _scratch_plan(steps: tuple[Step, ...]) -> tuple[int, list[bool]]:
    """Return (scratch elements one step needs, whether each non-empty step is deferrable)."""
    active = [step for _, step in _nonempty(steps)]
    need = max((sum(r.size for r in _scratch_recvs(step)) for step in active), default=0)
    defer = [_deferrable(step, active[i + 1] if i + 1 < len(active) else None)
             for i, step in enumerate(active)]
    return need, defer


def scratch_size(steps: tuple[Step, ...]) -> int:
    """Elements of scratch the steps need at once (twice a step's need if combines are deferred)."""
    need, defer = _scratch_plan(steps)
    return need * (2 if any(defer) else 1)
