"""Cost programs: a rank's steps reduced to what the simulator needs, grouped by symmetry.

The quotient (one representative program per class of ranks) and the exact paths (every
rank's ranges as block-distributed slot spans, built once per (p, topology)); see the
package documentation for when each is used.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from .. import algorithms
from .._binding import _Written
from ..algorithms.ring_segmented import default_segment_bytes, pieces
from ..errors import ScheduleError
from ..schedule import REDUCE
from ..topology import Topology
from .machine import MAX_CLASSES


@dataclass(frozen=True, slots=True)
class _CostStep:
    """One rank's non-empty step: its sends, its port loads per link class, bytes it reduces."""

    sends: tuple[tuple[int, int, int], ...]      # (peer, bytes, link) of non-empty sends
    send_count: tuple[int, int]                  # messages per link class
    send_bytes: tuple[int, int]
    recv_count: tuple[int, int]
    recv_bytes: tuple[int, int]
    reduced: int                                 # bytes combined into the buffer
    recvs: tuple[tuple[int, int, int], ...]      # (peer, bytes, link): for the quotient check
    combines: int = 0                            # reducing receives (one combine call each)
    requests: int = 0                            # non-empty sends and receives


def _cost_step(sends, recvs, reduced: int, intern: dict, combines: int = 0) -> _CostStep:
    """Return the (interned) cost step of ``(peer, bytes, link)`` sends and receives."""
    key = (sends, recvs, reduced, combines)
    found = intern.get(key)
    if found is None:
        count, volume = [0] * MAX_CLASSES, [0] * MAX_CLASSES
        rcount, rvolume = [0] * MAX_CLASSES, [0] * MAX_CLASSES
        for _, nbytes, link in sends:
            if nbytes:
                count[link] += 1
                volume[link] += nbytes
        for _, nbytes, link in recvs:
            if nbytes:
                rcount[link] += 1
                rvolume[link] += nbytes
        found = intern[key] = _CostStep(tuple(s for s in sends if s[1]), tuple(count),
                                        tuple(volume), tuple(rcount), tuple(rvolume), reduced,
                                        recvs, combines, sum(count) + sum(rcount))
    return found


def _places(topology: Topology, nclasses: int = 2) -> tuple[tuple[int, ...], ...]:
    """The levels of ``topology`` that decide a message's link class among ``nclasses``: the
    node, then up to ``nclasses - 2`` coarser levels (a rack, a site)."""
    return topology.levels[:max(1, nclasses - 1)]


def _link(places, rank: int, peer: int) -> int:
    """Link class of a message between ``rank`` and ``peer``: 0 on one node, else 1 plus the
    coarser levels at which they differ (levels nest, so the coarsest one decides)."""
    return sum(level[rank] != level[peer] for level in places)


def _links(places, ranks: np.ndarray, peers: np.ndarray) -> np.ndarray:
    """:func:`_link` of arrays of ranks and peers."""
    found = np.zeros(len(ranks), dtype=np.int64)
    for level in places:
        level = np.asarray(level)
        found += level[ranks] != level[peers]
    return found


def _compile(steps, rank: int, places, itemsize: int, intern: dict
             ) -> list[_CostStep | None]:
    """Reduce one rank's steps to cost steps (``None`` for an empty step).

    Equal cost steps are one object (``intern``), so the simulator can tell repeated steps
    apart by identity.
    """
    program: list[_CostStep | None] = []
    for step in steps:
        if not step:
            program.append(None)
            continue
        sends = tuple([(s.peer, (s.stop - s.start) * itemsize, _link(places, rank, s.peer))
                       for s in step.sends])
        recvs = tuple([(r.peer, (r.stop - r.start) * itemsize, _link(places, rank, r.peer))
                       for r in step.recvs])
        reduced = sum([r.stop - r.start for r in step.recvs if r.action == REDUCE]) * itemsize
        combines = sum([1 for r in step.recvs if r.action == REDUCE and r.stop > r.start])
        program.append(_cost_step(sends, recvs, reduced, intern, combines))
    return program


def _rotate(program, rank: int, nranks: int, places, intern: dict, memo: dict):
    """Rank 0's cost program as rank ``rank``'s in a rotation-invariant schedule (peers + rank)."""
    rotated = []
    for cost in program:
        if cost is None:
            rotated.append(None)
            continue
        key = (id(cost), rank)
        found = memo.get(key)
        if found is None:
            def moved(messages):
                return tuple((peer, nbytes, _link(places, rank, peer))
                             for peer, nbytes in (((rank + p) % nranks, b)
                                                  for p, b, _ in messages))
            found = memo[key] = _cost_step(moved(cost.sends), moved(cost.recvs), cost.reduced,
                                           intern, cost.combines)
        rotated.append(found)
    return rotated


@dataclass(frozen=True)
class _Quotient:
    """Classes of ranks with one representative program each (every rank its own in full mode)."""

    reps: tuple[int, ...]
    class_of: tuple[int, ...]
    sizes: tuple[int, ...]
    programs: tuple[tuple[_CostStep | None, ...], ...]
    partition: str

    @property
    def full(self) -> bool:
        return len(self.reps) == len(self.class_of)


def _partitions(topology: Topology, rotation: bool = False, nclasses: int = 2):
    """Candidate partitions, coarsest first: (label, class of every rank).

    For a rotation-invariant schedule only the one that fits the topology: one class when every
    link is of one kind (one node, or one rank per node), ranks of equal local index on nodes
    of equal size, else none (every rank is simulated, each program rotated from rank 0's).
    Where the machine gives levels above the network their own links (``nclasses`` > 2) and
    the topology has them: ranks of equal index within their coarsest unit (a site), on
    units of equal size, checked as a quotient like any other partition.
    """
    nranks = topology.nranks
    places = _places(topology, nclasses)
    if len(places) > 1:
        coarsest = places[-1]
        members: dict = {}
        for rank, unit in enumerate(coarsest):
            members.setdefault(unit, []).append(rank)
        if len({len(m) for m in members.values()}) == 1 and all(
                m == list(range(m[0], m[0] + len(m))) for m in members.values()):
            yield "position in the coarsest level", tuple(
                rank - members[coarsest[rank]][0] for rank in range(nranks))
        return
    sizes = set(topology.node_sizes)
    uniform = topology.nnodes == 1 or sizes == {1}
    if not rotation or uniform:
        yield "one class", (0,) * nranks
    if topology.nnodes > 1 and len(sizes) == 1 and topology.contiguous and not uniform:
        yield "local rank", topology.local_rank


@lru_cache(maxsize=32)
def _classes(topology: Topology, rotation: bool, nclasses: int) -> tuple:
    """:func:`_partitions` as (label, class of every rank, representatives, class sizes): the
    lowest rank of each class represents it (cached: every count asks again)."""
    found = []
    for label, labels in _partitions(topology, rotation, nclasses):
        ids: dict = {}
        class_of = tuple(ids.setdefault(label_, len(ids)) for label_ in labels)
        reps = [0] * len(ids)
        sizes = [0] * len(ids)
        for rank in range(topology.nranks - 1, -1, -1):
            reps[class_of[rank]] = rank
            sizes[class_of[rank]] += 1
        found.append((label, class_of, tuple(reps), tuple(sizes)))
    return tuple(found)


def _consistent(programs, class_of) -> bool:
    """True when the representatives' programs match as a quotient schedule (see module doc)."""
    length = max((len(p) for p in programs), default=0)
    previous = None
    for k in range(length):
        costs = tuple(program[k] if k < len(program) else None for program in programs)
        if costs == previous:  # interned: the same step again, already checked
            continue
        previous = costs
        sent, received = set(), set()
        for index, cost in enumerate(costs):
            if cost is None:
                continue
            for peer, nbytes, link in cost.sends:
                sent.add((index, class_of[peer], nbytes, link))
            for peer, nbytes, link in cost.recvs:
                if nbytes:
                    received.add((class_of[peer], index, nbytes, link))
        if sent != received:
            return False
    return True


#: schedules in which rank r's program is rank 0's with every peer moved by +r (mod p) and the
#: ranges rotated: only rank 0's program is built (``tests/test_model.py`` checks the property).
ROTATION_INVARIANT = frozenset({"ring", "ring_segmented"})


def _builder_params(name: str, itemsize: int, params: dict) -> dict:
    accepted = algorithms.get(name).params
    merged = dict(params)
    if "itemsize" in accepted:
        merged.setdefault("itemsize", itemsize)
    return merged


@lru_cache(maxsize=512)
def _quotient(name: str, nranks: int, count: int, topology: Topology, itemsize: int,
              params: tuple, symmetric: bool, nclasses: int = 2) -> _Quotient:
    """Build the cost programs of ``name``: a representative per class, or every rank
    (messages in ``nclasses`` link classes, :func:`_link`)."""
    algorithm = algorithms.get(name)
    merged = {**algorithm.params, **_builder_params(name, itemsize, dict(params))}
    places = _places(topology, nclasses)
    built: dict[int, list] = {}
    intern: dict = {}
    memo: dict = {}

    # a ring of single blocks at count >= p: rank 0's program from the slots, not rebuilt
    rotated = (symmetric and name in ROTATION_INVARIANT and count >= nranks > 1
               and _single_blocks(name, nranks, count, merged))
    if rotated:
        slots = _ring_program(name, nranks, count, itemsize, params)

    def program(rank: int):
        if rank not in built:
            if rotated:
                built[rank] = _ring_rotated(slots, rank, nranks, places, intern)
            elif name in ROTATION_INVARIANT and rank and symmetric:
                built[rank] = _rotate(program(0), rank, nranks, places, intern, memo)
            else:
                steps = algorithm.steps(rank, nranks, count, topology=topology, **merged)
                built[rank] = _compile(steps, rank, places, itemsize, intern)
        return built[rank]

    if symmetric:
        multilevel = len(places) > 1
        for label, class_of, reps, sizes in _classes(topology, name in ROTATION_INVARIANT,
                                                     nclasses):
            programs = [program(rep) for rep in reps]
            # rotation moves ranks of one local index onto each other and keeps the links;
            # only block sizes may differ (by one element), so no check
            if (name in ROTATION_INVARIANT and not multilevel) or _consistent(programs,
                                                                             class_of):
                return _Quotient(tuple(reps), class_of, tuple(sizes),
                                 tuple(tuple(p) for p in programs), label)
    programs = tuple(tuple(program(rank)) for rank in range(nranks))
    return _Quotient(tuple(range(nranks)), tuple(range(nranks)), (1,) * nranks, programs,
                     "every rank")


def _single_blocks(name: str, nranks: int, count: int, merged: dict) -> bool:
    """Whether every message of ``name`` at ``count`` is one whole ring block, as at count = p
    (the ring always; the segmented ring while it cuts a block into one piece)."""
    if name == "ring":
        return True
    if name == "ring_segmented":
        itemsize = merged["itemsize"]
        segment = merged.get("segment_bytes") or default_segment_bytes(count * itemsize)
        return pieces(count, nranks, max(1, segment // itemsize)) == 1
    return False


@lru_cache(maxsize=32)
def _ring_slots(name: str, nranks: int, itemsize: int, params: tuple) -> np.ndarray:
    """Rank 0's ring program at ``count = p``: per step (send peer, send slot, receive peer,
    receive slot, reduces), one row each."""
    algorithm = algorithms.get(name)
    merged = {**algorithm.params, **_builder_params(name, itemsize, dict(params))}
    rows = []
    for step_ in algorithm.steps(0, nranks, nranks, **merged):
        (send,), (recv,) = step_.sends, step_.recvs
        if send.size != 1 or recv.size != 1:
            raise ScheduleError(f"{name}: rank 0's steps are not single ring blocks")
        rows.append((send.peer, send.start, recv.peer, recv.start, recv.action == REDUCE))
    return np.asarray(rows, dtype=np.int64).reshape(-1, 5)


@lru_cache(maxsize=64)
def _ring_program(name: str, nranks: int, count: int, itemsize: int, params: tuple):
    """Rank 0's distinct steps at ``count`` (send peer, bytes, receive peer, bytes, reduces)
    and the index of each step among them: every block's size from the slots at once."""
    slots = _ring_slots(name, nranks, itemsize, params)
    sent = _span_sizes(count, nranks, slots[:, 1], slots[:, 1] + 1) * itemsize
    received = _span_sizes(count, nranks, slots[:, 3], slots[:, 3] + 1) * itemsize
    rows = np.stack([slots[:, 0], sent, slots[:, 2], received, slots[:, 4]], axis=1)
    # one integer per row (mixed radix of each column's distinct values): a 1-D unique
    key, radix = np.zeros(len(rows), dtype=np.int64), 1
    for column in rows.T:
        values, code = np.unique(column, return_inverse=True)
        key, radix = key * len(values) + code.reshape(-1), radix * len(values)
    if radix >= 1 << 62:  # too many distinct values for one integer: rows as they are
        _, first, index = np.unique(rows, axis=0, return_index=True, return_inverse=True)
    else:
        _, first, index = np.unique(key, return_index=True, return_inverse=True)
    return (tuple(tuple(int(v) for v in rows[i]) for i in first),
            index.reshape(-1).tolist())


def _rotated_ring(name: str, nranks: int, count: int, itemsize: int, params: tuple):
    """:func:`_ring_program` where ``name`` at ``count`` is a ring of single blocks with
    every block non-empty (count >= p), else None."""
    if name not in ROTATION_INVARIANT or count < nranks or nranks < 2:
        return None
    algorithm = algorithms.get(name)
    merged = {**algorithm.params, **_builder_params(name, itemsize, dict(params))}
    if not _single_blocks(name, nranks, count, merged):
        return None
    return _ring_program(name, nranks, count, itemsize, params)


def _ring_rotated(slots, rank: int, nranks: int, places, intern: dict) -> list[_CostStep]:
    """Rank 0's ring program moved to ``rank`` (peers + rank, rank 0's bytes), as
    :func:`_rotate` of :func:`_compile` gives it, from the distinct steps only."""
    distinct, index = slots
    costs = []
    for send_peer, sent, recv_peer, received, reduces in distinct:
        send_to, recv_from = (rank + send_peer) % nranks, (rank + recv_peer) % nranks
        costs.append(_cost_step(((send_to, sent, _link(places, rank, send_to)),),
                                ((recv_from, received, _link(places, rank, recv_from)),),
                                received if reduces else 0, intern,
                                1 if reduces and received else 0))
    return [costs[i] for i in index]


# -- exact paths for schedules without symmetry: ranges as slot spans, every rank in NumPy -----------

def _base_parts(name: str, nranks: int, count: int) -> int | None:
    """Slots whose block-distributed spans are every range of ``name`` at any ``count``, or None.

    Tree, the k-nomial tree and recursive doubling move the whole vector (one slot);
    Rabenseifner moves spans of its pof2 slots; the ring and, while every block holds at most
    one element (count < p), the segmented ring move single ring blocks. Building the
    schedule once at ``count = parts`` (one element per slot) gives every range of every
    other count by :func:`_span_sizes`: ``tests/test_model.py`` checks the result against
    the per-count simulation.
    """
    if name in ("tree", "knomial", "recursive_doubling"):
        return 1
    if name == "rabenseifner":
        return 1 << (nranks.bit_length() - 1)
    if name in ROTATION_INVARIANT and count < nranks:
        return nranks
    return None


def _span_sizes(count: int, parts: int, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Elements in slots ``[lo, hi)`` of ``count`` split ``parts`` ways (partition.block)."""
    q, r = divmod(count, parts)
    return (hi * q + np.minimum(hi, r)) - (lo * q + np.minimum(lo, r))


@dataclass(frozen=True)
class _Table:
    """Every rank's messages and reductions at the base count, as arrays (slot ranges)."""

    parts: int
    active: np.ndarray                  # (steps, p) bool: the rank's step is non-empty
    sends: tuple[tuple[np.ndarray, ...], ...]    # per step: sender, receiver, link, lo, hi
    reduces: tuple[tuple[np.ndarray, ...], ...]  # per step: rank, lo, hi of REDUCE receives


@lru_cache(maxsize=32)
def _table(name: str, nranks: int, topology: Topology, itemsize: int, params: tuple,
           parts: int, nclasses: int = 2) -> _Table:
    """Build every rank's program once at ``count = parts`` and keep it as slot ranges."""
    algorithm = algorithms.get(name)
    merged = {**algorithm.params, **_builder_params(name, itemsize, dict(params))}
    places = _places(topology, nclasses)
    programs = [algorithm.steps(rank, nranks, parts, topology=topology, **merged)
                for rank in range(nranks)]
    length = max((len(p) for p in programs), default=0)
    active = np.zeros((length, nranks), dtype=bool)
    sends, reduces = [], []
    for k in range(length):
        out, red = [], []
        for rank, program in enumerate(programs):
            if k >= len(program) or not program[k]:
                continue
            active[k, rank] = True
            out += [(rank, s.peer, s.start, s.stop) for s in program[k].sends]
            red += [(rank, r.start, r.stop) for r in program[k].recvs if r.action == REDUCE]
        sender, receiver, lo, hi = np.asarray(out, dtype=np.int64).reshape(-1, 4).T
        red_array = np.asarray(red, dtype=np.int64).reshape(-1, 3)
        sends.append((sender, receiver, _links(places, sender, receiver), lo, hi))
        reduces.append(tuple(red_array.T))
    return _Table(parts, active, tuple(sends), tuple(reduces))


@lru_cache(maxsize=32)
def _ring_base(name: str, nranks: int, itemsize: int, params: tuple):
    """Rank 0's ring program at ``count = p`` as (send offset, send slot, reduces) per step."""
    slots = _ring_slots(name, nranks, itemsize, params)
    if len(slots) and np.any((slots[:, 0] - slots[:, 2]) % nranks != 2 % nranks):
        raise ScheduleError(f"{name}: rank 0's steps are not single ring blocks")
    return tuple((int(send_peer), int(send_slot), bool(reduces))
                 for send_peer, send_slot, _, _, reduces in slots)


def _reused(steps, in_place: bool) -> int:
    """Elements of one rank's result that its run both sends from and writes (:func:`reused_bytes`).

    As the executor binds a run (its :class:`~.._binding._Written`, the same rule): out of
    place, a send whose range the run has not written yet goes out of sendbuf (the caller's
    input, which the run never writes); any other send, and every send in place, goes out of
    the result. Receives write the result (copied, or reduced into it, through scratch or
    not), and so do the loads of sendbuf into a range a send completes first. Writes and sends
    anywhere in the run count together: every run is the same, so a range written late in one
    run and sent early in the next moves between the cores too.
    """
    written = _Written(in_place)  # what the run has written so far (in place: everything)
    sent, writes = _Written(False), _Written(False)
    for step in steps:
        for send in step.sends:
            start, stop = send.start, send.stop
            if stop <= start:
                continue
            if not in_place:
                if not any(was for _, _, was in written.pieces(start, stop)):
                    continue  # out of sendbuf
                writes.add(start, stop)  # the rest loaded into the result
                written.add(start, stop)
            sent.add(start, stop)
        for recv in step.recvs:
            writes.add(recv.start, recv.stop)
            written.add(recv.start, recv.stop)
    return sum(hi - lo for first, last in sent.ranges
               for lo, hi, was in writes.pieces(first, last) if was)

@lru_cache(maxsize=1024)
def reused_bytes(name: str, nranks: int, count: int, itemsize: int, params: tuple,
                 in_place: bool) -> int:
    """The most bytes of its result any rank both sends from and writes in one run of ``name``
    on one node (``Machine.reuse_curve`` prices them).

    At 2 ranks: recursive doubling in place sends and then writes its whole result, out of
    place it sends its untouched input (none); the ring out of place forwards the half it
    reduced (half), in place both halves (all).
    """
    if nranks < 2 or count == 0:
        return 0
    algorithm = algorithms.get(name)
    merged = {**algorithm.params, **_builder_params(name, itemsize, dict(params))}
    topology = Topology.simulated(nranks, nranks)
    return itemsize * max(_reused(algorithm.steps(rank, nranks, count, topology=topology,
                                                  **merged), in_place)
                          for rank in range(nranks))
