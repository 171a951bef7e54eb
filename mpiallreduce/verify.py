"""Symbolic checker: run a Schedule on sets of contributions, no MPI.

Every element range of every rank holds the ordered tuple of ranks whose contributions it
contains. Running the schedule moves and combines those tuples exactly as the executor moves and
combines data, and any inconsistency raises :class:`ScheduleError` naming rank, step and range.
Ranges are kept as intervals, so a count of 10**6 costs no more than a count of 100.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Sequence

from .errors import ScheduleError
from .partition import block
from .schedule import COPY, LOCAL_FIRST, RECEIVED_FIRST, REDUCE, Schedule

#: contents of a range: ordered tuple of contributing ranks; ``None`` means undefined data.
Contents = tuple | None
Segments = list[tuple[int, int, Contents]]


class _Buffer:
    """A rank's working buffer as sorted, non-overlapping intervals of equal contents."""

    def __init__(self, count: int, segments: Segments):
        self.starts: list[int] = []
        self.items: list[tuple[int, int, Contents]] = []
        cursor = 0
        for start, stop, contents in sorted(segments):
            if start < cursor or stop < start:
                raise ValueError(f"overlapping initial segments at {start}")
            if start > cursor:
                self._append(cursor, start, None)
            self._append(start, stop, contents)
            cursor = stop
        if cursor < count:
            self._append(cursor, count, None)
        self.count = count

    def _append(self, start, stop, contents):
        if stop > start:
            self.starts.append(start)
            self.items.append((start, stop, contents))

    def _split(self, at: int) -> None:
        i = bisect_right(self.starts, at) - 1
        if i < 0:
            return
        start, stop, contents = self.items[i]
        if start < at < stop:
            self.items[i] = (start, at, contents)
            self.items.insert(i + 1, (at, stop, contents))
            self.starts.insert(i + 1, at)

    def read(self, start: int, stop: int) -> Segments:
        """Return the segments covering ``[start, stop)``, cut to that range."""
        if start == stop:
            return []
        self._split(start)
        self._split(stop)
        i = bisect_right(self.starts, start) - 1
        out = []
        while i < len(self.items) and self.items[i][0] < stop:
            out.append(self.items[i])
            i += 1
        return out

    def write(self, segments: Segments) -> None:
        """Overwrite the ranges named by ``segments`` with their contents."""
        for start, stop, contents in segments:
            if start == stop:
                continue
            self._split(start)
            self._split(stop)
            lo = bisect_right(self.starts, start) - 1
            hi = lo
            while hi < len(self.items) and self.items[hi][0] < stop:
                hi += 1
            self.items[lo:hi] = [(start, stop, contents)]
            self.starts[lo:hi] = [start]


def _describe(contents: Contents) -> str:
    return "undefined data" if contents is None else f"ranks {contents}"


def _expected_all(nranks: int) -> str:
    return f"all of 0..{nranks - 1}" if nranks > 1 else "rank 0"


def _combine(left: Contents, right: Contents, ordered: bool, where: str) -> tuple:
    if left is None or right is None:
        raise ScheduleError(f"{where}: reduces {_describe(left)} with {_describe(right)}")
    doubled = set(left) & set(right)
    if doubled:
        raise ScheduleError(f"{where}: contribution of ranks {tuple(sorted(doubled))} doubled "
                            f"(combining {left} with {right})")
    if ordered:
        if left[-1] + 1 != right[0]:
            raise ScheduleError(f"{where}: combining {left} with {right} breaks MPI's rank order")
        return left + right
    return tuple(sorted(left + right))


def allreduce_initial(rank: int, count: int) -> Segments:
    """Initial state of an allreduce: the whole buffer is the rank's own contribution."""
    return [(0, count, (rank,))]


def allreduce_expected(nranks: int) -> Callable[[int, int], Segments]:
    """Final state of an allreduce: every element holds every rank, in rank order."""
    every = tuple(range(nranks))
    return lambda rank, count: [(0, count, every)]


def reduce_scatter_expected(nranks: int) -> Callable[[int, int], Segments]:
    """Final state of a reduce-scatter: rank r's block (partition.block) holds every rank."""
    every = tuple(range(nranks))
    return lambda rank, count: [(*block(count, nranks, rank), every)]


def allgather_initial(nranks: int) -> Callable[[int, int], Segments]:
    """Initial state of an allgather: rank r holds only its own block."""
    return lambda rank, count: [(*block(count, nranks, rank), (rank,))]


def allgather_expected(nranks: int) -> Callable[[int, int], Segments]:
    """Final state of an allgather: block j holds rank j's contribution, on every rank."""
    return lambda rank, count: [(*block(count, nranks, j), (j,)) for j in range(nranks)]


def bcast_initial(root: int) -> Callable[[int, int], Segments]:
    """Initial state of a broadcast: the root holds its vector, the others nothing."""
    return lambda rank, count: [(0, count, (root,))] if rank == root else []


def bcast_expected(root: int) -> Callable[[int, int], Segments]:
    """Final state of a broadcast: every rank holds the root's vector."""
    return lambda rank, count: [(0, count, (root,))]


def _alltoall_blocks(nranks: int, count: int, region: int, label) -> Segments:
    n = count // 2
    return [(region * n + lo, region * n + hi, label(j))
            for j, (lo, hi) in enumerate(block(n, nranks, j) for j in range(nranks))]


def alltoall_initial(nranks: int) -> Callable[[int, int], Segments]:
    """Initial state of an alltoall over send-then-receive space of ``count`` = 2n elements.

    Contents are ``(source, destination)`` labels: send block j of rank r is ``(r, j)``; the
    rank's own block is already in place in the receive half (the executor copies it locally).
    """
    def initial(rank, count):
        own = _alltoall_blocks(nranks, count, 1, lambda j: (rank, rank))[rank]
        return _alltoall_blocks(nranks, count, 0, lambda j: (rank, j)) + [own]
    return initial


def alltoall_expected(nranks: int) -> Callable[[int, int], Segments]:
    """Final state of an alltoall: receive block j of rank r holds ``(j, r)``."""
    return lambda rank, count: _alltoall_blocks(nranks, count, 1, lambda j: (j, rank))


def collective_states(collective: str, nranks: int, root: int = 0):
    """Return ``(initial, expected)`` for :func:`verify` of a schedule of ``collective``."""
    if collective == "allreduce":
        return allreduce_initial, allreduce_expected(nranks)
    if collective == "reduce_scatter":
        return allreduce_initial, reduce_scatter_expected(nranks)
    if collective == "allgather":
        return allgather_initial(nranks), allgather_expected(nranks)
    if collective == "bcast":
        return bcast_initial(root), bcast_expected(root)
    if collective == "alltoall":
        return alltoall_initial(nranks), alltoall_expected(nranks)
    raise ValueError(f"unknown collective {collective!r}")


def verify(schedule: Schedule,
           initial: Callable[[int, int], Segments] = allreduce_initial,
           expected: Callable[[int, int], Segments] | None = None,
           ordered: bool | None = None,
           on_step: Callable[[int, list[Segments]], None] | None = None) -> list[Segments]:
    """Run ``schedule`` symbolically and raise ScheduleError at the first inconsistency.

    Args:
        schedule: the schedule to check.
        initial: ``initial(rank, count)`` gives each rank's starting segments (default: allreduce).
        expected: ``expected(rank, count)`` gives the segments each rank must end with; a
            segment whose contents are ``None`` is not checked. Default: allreduce.
        ordered: enforce MPI's rank order in every combine (default: ``schedule.ordered``).
        on_step: called as ``on_step(index, segments)`` after each step with every rank's
            segments (what ``python -m mpiallreduce.show --contributions`` prints).

    Returns:
        The final segments of every rank.
    """
    p, count = schedule.nranks, schedule.count
    ordered = schedule.ordered if ordered is None else ordered
    expected = expected or allreduce_expected(p)
    if len(schedule.ranks) != p:
        raise ScheduleError(f"schedule has {len(schedule.ranks)} rank programs for {p} ranks")
    buffers = [_Buffer(count, initial(rank, count)) for rank in range(p)]
    for index in range(schedule.nsteps):
        steps = [steps[index] if index < len(steps) else None for steps in schedule.ranks]
        _check_matching(schedule, index, steps)
        # Sends read the buffers as they were at the start of the step.
        outgoing: dict[tuple[int, int], list[Segments]] = {}
        for rank, step in enumerate(steps):
            for send in step.sends if step else ():
                where = f"rank {rank}, step {index}"
                if not 0 <= send.start <= send.stop <= count:
                    raise ScheduleError(f"{where}: send range [{send.start}, {send.stop}) "
                                        f"outside [0, {count})")
                data = buffers[rank].read(send.start, send.stop)
                for start, stop, contents in data:
                    if contents is None:
                        raise ScheduleError(f"{where}: sends range [{start}, {stop}) to rank "
                                            f"{send.peer} before it holds any data")
                outgoing.setdefault((rank, send.peer), []).append(
                    [(s - send.start, e - send.start, c) for s, e, c in data])
        for rank, step in enumerate(steps):
            written: list[tuple[int, int, str]] = []
            for recv in step.recvs if step else ():
                where = f"rank {rank}, step {index}"
                if not 0 <= recv.start <= recv.stop <= count:
                    raise ScheduleError(f"{where}: receive range [{recv.start}, {recv.stop}) "
                                        f"outside [0, {count})")
                # Reduces of one step may share a range (a k-nomial parent's children): each
                # lands in scratch and they combine in the order listed. A copy may share none.
                for start, stop, action in written:
                    both_reduce = action == REDUCE and recv.action == REDUCE
                    if recv.start < stop and start < recv.stop and not both_reduce:
                        raise ScheduleError(f"{where}: receives into [{recv.start}, {recv.stop}) "
                                            f"overlap [{start}, {stop}) of the same step "
                                            f"(only reduces may share a range)")
                written.append((recv.start, recv.stop, recv.action))
                data = outgoing[(recv.peer, rank)].pop(0)
                shifted = [(s + recv.start, e + recv.start, c) for s, e, c in data]
                if recv.action == COPY:
                    buffers[rank].write(shifted)
                elif recv.action == REDUCE:
                    merged = []
                    for start, stop, contents in shifted:
                        for lo, hi, local in buffers[rank].read(start, stop):
                            at = f"{where}: range [{lo}, {hi})"
                            if recv.order == RECEIVED_FIRST:
                                merged.append((lo, hi, _combine(contents, local, ordered, at)))
                            elif recv.order == LOCAL_FIRST:
                                merged.append((lo, hi, _combine(local, contents, ordered, at)))
                            else:
                                raise ScheduleError(f"{where}: unknown operand order {recv.order!r}")
                    buffers[rank].write(merged)
                else:
                    raise ScheduleError(f"{where}: unknown receive action {recv.action!r}")
        if on_step is not None:
            on_step(index, [buffer.read(0, count) for buffer in buffers])
    final = []
    for rank, buffer in enumerate(buffers):
        got = buffer.read(0, count)
        for start, stop, want in expected(rank, count):
            if want is None:
                continue
            for lo, hi, contents in buffer.read(start, stop):
                if contents != want:
                    goal = _expected_all(p) if want == tuple(range(p)) else f"ranks {want}"
                    raise ScheduleError(f"rank {rank}, end: range [{lo}, {hi}) holds "
                                        f"{_describe(contents)}, expected {goal}")
        final.append(got)
    return final


def matched(steps: Sequence) -> tuple[dict, dict]:
    """Pair the messages of one step: ``(sent, got)``, both keyed ``(sender, receiver)``.

    ``steps[rank]`` is each rank's step (or None); ``sent[key]`` lists the sender's Sends to the
    receiver in order, ``got[key]`` the receiver's Recvs from the sender: the k-th of each match.
    """
    sent: dict[tuple[int, int], list] = {}
    got: dict[tuple[int, int], list] = {}
    for rank, step in enumerate(steps):
        for send in step.sends if step else ():
            sent.setdefault((rank, send.peer), []).append(send)
        for recv in step.recvs if step else ():
            got.setdefault((recv.peer, rank), []).append(recv)
    return sent, got


def _check_matching(schedule: Schedule, index: int, steps: Sequence) -> None:
    """Every send in step ``index`` has a receive of the same size in the peer's step, in order."""
    p = schedule.nranks
    for rank, step in enumerate(steps):
        if not step:
            continue
        for msg in (*step.sends, *step.recvs):
            if not 0 <= msg.peer < p or msg.peer == rank:
                raise ScheduleError(f"rank {rank}, step {index}: invalid peer {msg.peer}")
    sent, got = matched(steps)
    for (rank, peer), sends in sent.items():
        recvs = got.get((rank, peer), [])
        for k, send in enumerate(sends):
            if k >= len(recvs):
                raise ScheduleError(f"rank {rank}, step {index}: send of [{send.start}, "
                                    f"{send.stop}) to rank {peer} has no matching receive")
            if send.size != recvs[k].size:
                raise ScheduleError(f"rank {rank}, step {index}: sends {send.size} elements "
                                    f"to rank {peer}, which receives {recvs[k].size}")
    for (rank, peer), recvs in got.items():
        if len(recvs) > len(sent.get((rank, peer), [])):
            recv = recvs[len(sent.get((rank, peer), []))]
            raise ScheduleError(f"rank {peer}, step {index}: receive into [{recv.start}, "
                                f"{recv.stop}) from rank {rank} has no matching send")
