"""The simulator: one clock per rank (or class of ranks) through the cost programs."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from functools import lru_cache
from itertools import zip_longest

import numpy as np

from ..errors import ScheduleError
from ..ops import SCRATCH_COMBINE
from ..topology import Topology
from .machine import INTRA, MAX_CLASSES, Machine
from .programs import _links, _places, _Quotient, _span_sizes, _Table

#: the least message (and result) whose cost :meth:`_Costs.on` bounds by the whole result's
#: per-byte time: past the eager sizes, where messages are bandwidth
STREAM_BYTES = 64 << 10


@dataclass(frozen=True)
class _Costs:
    """What one prediction charges, from a machine: message costs, the interpreter's terms per
    step, request and combine, and the bytes' combine (γ at the combine's size) and copies.

    ``in_place``: the executor's reducing receives into a result the plan sends from land in
    scratch and, between the sizes of :data:`SCRATCH_COMBINE`, are copied back (out of place
    the first reduction of a range lands in the result itself: no copy).
    """

    machine: Machine
    dtype: str
    in_place: bool = False
    result_bytes: int = 0

    @property
    def links(self):
        return self.machine.links

    def message(self, nbytes, link):
        """Seconds of messages of ``nbytes`` on ``link`` (arrays of equal shape, or scalars)."""
        links = self.links
        if all(other == links[0] for other in links[1:]):
            return self.on(links[0], nbytes)
        link = np.asarray(link)
        return np.select([link == kind for kind in range(len(links))],
                         [self.on(other, nbytes) for other in links])

    def on(self, link, nbytes):
        """Seconds of messages of ``nbytes`` on ``link``; from :data:`STREAM_BYTES` up, at
        least the per-byte time of a message of the whole result: a run's messages stream
        through ``result_bytes``, so pieces of a result that has left the caches (a segmented
        ring's) cannot move faster per byte than the whole would (the ping-pong resends one
        cache-hot buffer). Below, a message's own protocol decides (eager or not)."""
        cost = link.cost(nbytes)
        whole = self.result_bytes
        if whole <= STREAM_BYTES or link.curve is None:
            return cost
        nbytes = np.asarray(nbytes, dtype=float)
        return np.where(nbytes >= STREAM_BYTES,
                        np.maximum(cost, nbytes * (link.cost(whole) / whole)), cost)

    def cpu(self, requests):
        """Seconds of Python before a step's messages: the step and its requests."""
        return self.machine.step + self.machine.request * np.asarray(requests, dtype=float)

    def reduce(self, reduced, combines):
        """Seconds after a step's messages: its combines (calls and bytes), copies back."""
        reduced = np.asarray(reduced, dtype=float)
        combines = np.asarray(combines, dtype=float)
        piece = np.where(combines > 0, reduced / np.maximum(combines, 1), 0.0)
        machine = self.machine
        seconds = reduced * machine.gamma_at(self.dtype, piece) + combines * machine.combine
        if self.in_place and self.result_bytes <= SCRATCH_COMBINE[1]:
            copied = np.where(piece >= SCRATCH_COMBINE[0], 1.0, 0.0)
            seconds = seconds + copied * (reduced * machine.copy_at(piece)
                                          + combines * machine.combine)
        return seconds


def _exchange(ready: np.ndarray, sender, receiver, link, nbytes, costs: _Costs) -> np.ndarray:
    """End time of every rank after one step's messages (the rules of :func:`_run`)."""
    end = ready.copy()
    if len(sender) == 0:
        return end
    cost = costs.message(nbytes, link)
    # two ports per rank: shared memory, and the network card every link above the node
    # shares (a message to another site leaves through the same port as one to the next node)
    port = np.minimum(link, 1)
    size = 2 * len(ready)
    send_port, recv_port = sender * 2 + port, receiver * 2 + port
    send_load = np.bincount(send_port, weights=cost, minlength=size)
    recv_load = np.bincount(recv_port, weights=cost, minlength=size)
    finish = (np.maximum(ready[sender], ready[receiver])
              + np.maximum(send_load[send_port], recv_load[recv_port]))
    np.maximum.at(end, sender, finish)
    np.maximum.at(end, receiver, finish)
    return end


#: above this many ranks the exact paths leave ``Prediction.pairs`` out (``None``): a dict of
#: every (sender, receiver) pair costs more than the simulation itself.
PAIRS_RANKS = 512


def _totals(nranks: int, sender, receiver, link, nbytes, nclasses: int = 2):
    """(sent bytes, sent messages per rank, link bytes, link messages, pairs) of message arrays
    (link bytes and messages per link class)."""
    sent_bytes = np.bincount(sender, weights=nbytes, minlength=nranks).astype(np.int64)
    sent_messages = np.bincount(sender, minlength=nranks).astype(np.int64)
    link_bytes = tuple(int(nbytes[link == kind].sum()) for kind in range(nclasses))
    link_messages = tuple(int((link == kind).sum()) for kind in range(nclasses))
    pairs = None
    if nranks <= PAIRS_RANKS:
        keys = sender * nranks + receiver
        unique, index, counts = np.unique(keys, return_inverse=True, return_counts=True)
        sums = np.bincount(index, weights=nbytes, minlength=len(unique)).astype(np.int64)
        pairs = {(int(k) // nranks, int(k) % nranks): (int(c), int(b))
                 for k, c, b in zip(unique, counts, sums)}
    return sent_bytes, sent_messages, link_bytes, link_messages, pairs


def _simulate_table(table: _Table, count: int, itemsize: int, costs: _Costs
                    ) -> tuple[np.ndarray, tuple, int]:
    """Every rank's clock through the table at ``count``: exact, O(messages) NumPy work."""
    nranks = table.active.shape[1]
    clock = np.zeros(nranks)
    messages = []
    for k in range(table.active.shape[0]):
        active = table.active[k]
        sender, receiver, link, lo, hi = table.sends[k]
        nbytes = _span_sizes(count, table.parts, lo, hi) * itemsize
        sent = nbytes > 0
        sender, receiver, link, nbytes = sender[sent], receiver[sent], link[sent], nbytes[sent]
        requests = (np.bincount(sender, minlength=nranks)
                    + np.bincount(receiver, minlength=nranks))
        ready = clock + costs.cpu(requests) * active
        end = _exchange(ready, sender, receiver, link, nbytes, costs)
        messages.append((sender, receiver, link, nbytes))
        rank, rlo, rhi = table.reduces[k]
        spans = _span_sizes(count, table.parts, rlo, rhi) * itemsize
        reduced = np.bincount(rank, weights=spans, minlength=nranks)
        combines = np.bincount(rank, weights=spans > 0, minlength=nranks)
        clock = np.where(active, end + costs.reduce(reduced, combines), clock)
    steps = int(table.active.sum(axis=0).max()) if table.active.size else 0
    return clock, _totals(nranks, *map(np.concatenate, zip(*messages)),
                          len(costs.links)), steps


@lru_cache(maxsize=64)
def _simulate_ring_sparse(base: tuple, nranks: int, count: int, topology: Topology,
                          itemsize: int, costs: _Costs) -> tuple[np.ndarray, tuple, int]:
    """Every rank of a ring with fewer elements than ranks, touching only non-empty messages.

    Rank r's step is rank 0's rotated by r, so the ranks sending a non-empty block in step s
    are ``(j - slot) mod p`` for the ``count`` one-element blocks j, each to its ring
    neighbour: one message per port, so a message ends at max(both ready) + α + bβ. Every
    rank's every step is non-empty (it posts its zero-byte messages' step), so a rank without
    data in a step only advances by ``step``: clocks are kept relative to that common offset
    and only the busy ranks are touched. Cached on rank 0's program, so the segmented ring
    with one piece per block reuses the ring's run.
    """
    nclasses = len(costs.links)
    places = _places(topology, nclasses)
    request = costs.machine.request
    relative = np.zeros(nranks)
    # rank indices twice over: the senders of a step, (j - slot) mod p for the blocks j, are the
    # cyclic range starting at -slot, a slice of this array (no modulo per step)
    around = np.concatenate([np.arange(nranks), np.arange(nranks)])
    message = {}  # offset -> seconds of a one-block message from each rank to rank + offset
    reduce_cost = float(costs.reduce(itemsize, 1))
    for offset, slot, reduces in base:
        start, shift = -slot % nranks, offset % nranks
        # a cyclic range that does not wrap is a slice: views instead of gathers
        sender = (slice(start, start + count) if start + count <= nranks
                  else around[start:start + count])
        first = (start + shift) % nranks
        receiver = (slice(first, first + count) if first + count <= nranks
                    else around[first:first + count])
        if offset not in message:
            ranks = np.arange(nranks)
            classes = _links(places, ranks, (ranks + offset) % nranks)
            per_class = np.array([float(costs.message(itemsize, kind))
                                  for kind in range(nclasses)])
            message[offset] = per_class[classes]
        # the count blocks are distinct and fewer than p, so no rank sends (or receives) two of
        # them in one step: plain fancy indexing, no ufunc.at
        if request:  # a busy rank starts and waits its send and its receive
            relative[sender] += request
            relative[receiver] += request
        finish = np.maximum(relative[sender], relative[receiver])
        finish += message[offset][sender]
        if type(sender) is slice and type(receiver) is slice:  # views: updated in place
            sent, received = relative[sender], relative[receiver]
            np.maximum(sent, finish, out=sent)
            np.maximum(received, finish, out=received)
            if reduces:
                received += reduce_cost
            continue
        relative[sender] = np.maximum(relative[sender], finish)
        relative[receiver] = np.maximum(relative[receiver], finish)
        if reduces:
            relative[receiver] += reduce_cost
    return (relative + len(base) * costs.machine.step,
            _ring_totals(base, nranks, count, places, itemsize, nclasses), len(base))


def _ring_totals(base: tuple, nranks: int, count: int, places, itemsize: int,
                 nclasses: int = 2):
    """:func:`_totals` of the sparse ring's messages: each step's senders are a cyclic range
    of ``count`` ranks, so the counts come from difference and prefix sums over the ranks
    (O(steps + p)) instead of one entry per message (O(steps x count)); every message
    (``pairs``) only where :data:`PAIRS_RANKS` asks for them."""
    if nranks <= PAIRS_RANKS:
        blocks = np.arange(count)
        sender = np.concatenate([(blocks - slot) % nranks for _, slot, _ in base])
        receiver = np.concatenate([(blocks - slot + offset) % nranks for offset, slot, _ in base])
        link = _links(places, sender, receiver)
        return _totals(nranks, sender, receiver, link, np.full(len(sender), itemsize, np.int64),
                       nclasses)
    starts = np.array([-slot % nranks for _, slot, _ in base], dtype=np.int64)
    edges = np.zeros(2 * nranks + 1, dtype=np.int64)
    np.add.at(edges, starts, 1)
    np.add.at(edges, starts + count, -1)
    running = np.cumsum(edges)[:2 * nranks]
    sent_messages = running[:nranks] + running[nranks:]
    messages = [0] * nclasses
    ranks = np.arange(nranks)
    for offset in {offset for offset, _, _ in base}:
        classes = _links(places, ranks, (ranks + offset) % nranks)
        mine = starts[[o == offset for o, _, _ in base]]
        for kind in range(1, nclasses):
            hits = (classes == kind).astype(np.int64)
            prefix = np.concatenate([[0], np.cumsum(np.concatenate([hits, hits]))])
            messages[kind] += int((prefix[mine + count] - prefix[mine]).sum())
    messages[INTRA] = len(base) * count - sum(messages[1:])
    return (sent_messages * itemsize, sent_messages, tuple(m * itemsize for m in messages),
            tuple(messages), None)


# -- the simulator ---------------------------------------------------------------------------------

@dataclass
class Prediction:
    """What the model predicts for one collective.

    Attributes:
        time: seconds until the last rank finishes (plus the per-call term).
        finish: seconds at which every rank finishes its steps (array of p).
        sent_bytes, sent_messages: per rank (arrays of p).
        link_bytes, link_messages: totals over all ranks per link class (intra, inter).
        pairs: ``{(sender, receiver): (messages, bytes)}`` when every rank was simulated
            (``partition == "every rank"``), else ``None``.
        steps: non-empty steps of the longest program.
        partition: how ranks were grouped ("every rank", "one class", "local rank").
    """

    name: str
    nranks: int
    nbytes: int
    time: float
    finish: np.ndarray
    sent_bytes: np.ndarray
    sent_messages: np.ndarray
    link_bytes: tuple[int, int]
    link_messages: tuple[int, int]
    pairs: dict | None
    steps: int
    partition: str

    @property
    def busbw(self) -> float:
        """Bus bandwidth in B/s: size / time · 2(p-1)/p (nccl-tests' definition)."""
        if self.time <= 0 or self.nranks < 2:
            return 0.0
        return self.nbytes / self.time * 2 * (self.nranks - 1) / self.nranks


def _run(quotient: _Quotient, costs: _Costs) -> np.ndarray:
    """Simulate the class clocks; return the finish time of every class.

    A step that repeats the previous one (the same interned cost step in every class) after a
    step that advanced every clock by the same δ advances them by δ again (the step is a
    max-plus map, which commutes with adding a constant), so runs of equal steps in steady state
    cost one addition: a ring's 2(p-1) equal steps are simulated in a few.
    """
    nclasses = len(quotient.reps)
    class_of = quotient.class_of
    links = costs.links
    curved = any(link.curve is not None for link in links)
    loads: dict = {}  # id(cost step) -> (cpu before, send load, recv load, after), per run
    clock = [0.0] * nclasses
    programs = quotient.programs
    previous, delta, steady = None, 0.0, False
    # step k of every class at once (None past a program's end), transposed in C
    for k, step_costs in enumerate(zip_longest(*programs)):
        if steady and step_costs == previous:
            clock = [t + delta for t in clock]
            continue
        before = clock[:]
        active = []
        ready = {}
        send_load, recv_load, after = {}, {}, {}
        for c, cost in enumerate(step_costs):
            if cost is None:
                continue
            active.append((c, cost))
            found = loads.get(id(cost))
            if found is None or found[0] is not cost:
                found = loads[id(cost)] = (cost, *_loads(cost, links, curved, costs))
            _, before_, send_load[c], recv_load[c], after[c] = found
            ready[c] = clock[c] + before_
        end = dict(ready)
        for c, cost in active:
            for peer, _, link in cost.sends:
                d = class_of[peer]
                if d not in ready:
                    raise ScheduleError(f"rank {quotient.reps[c]}, step {k}: sends to rank {peer}, "
                                        f"which has no step {k}")
                port = 1 if link else 0
                finish = max(ready[c], ready[d]) + max(send_load[c][port], recv_load[d][port])
                if finish > end[c]:
                    end[c] = finish
                if finish > end[d]:
                    end[d] = finish
        for c, _ in active:
            clock[c] = end[c] + after[c]
        increments = {clock[c] - before[c] for c in range(nclasses)}
        steady = step_costs == previous and len(active) == nclasses and len(increments) == 1
        delta = increments.pop() if steady else 0.0
        previous = step_costs
    return np.asarray(clock, dtype=float)


def _loads(cost, links, curved: bool, costs: _Costs) -> tuple:
    """(Python before the messages, send load, receive load per link, seconds after) of a
    cost step."""
    # per port (shared memory; the network card, which every link above the node shares)
    if curved:
        send = [0.0, 0.0]
        for _, nbytes, link in cost.sends:
            send[min(link, 1)] += float(costs.on(links[link], nbytes))
        recv = [0.0, 0.0]
        for _, nbytes, link in cost.recvs:
            if nbytes:
                recv[min(link, 1)] += float(costs.on(links[link], nbytes))
        send_load, recv_load = tuple(send), tuple(recv)
    else:
        loads = [[0.0, 0.0], [0.0, 0.0]]
        for i, link in enumerate(links):
            loads[0][min(i, 1)] += cost.send_count[i] * link.alpha + cost.send_bytes[i] * link.beta
            loads[1][min(i, 1)] += cost.recv_count[i] * link.alpha + cost.recv_bytes[i] * link.beta
        send_load, recv_load = tuple(loads[0]), tuple(loads[1])
    return (float(costs.cpu(cost.requests)), send_load, recv_load,
            float(costs.reduce(cost.reduced, cost.combines)))


def _counts(quotient: _Quotient):
    """Per-class and per-link message counts of a quotient (cached: the quotient is)."""
    found = _COUNTS.get(id(quotient))
    if found is not None and found[0] is quotient:
        return found[1]
    sizes = quotient.sizes
    sent_bytes = np.zeros(len(quotient.reps), dtype=np.int64)
    sent_messages = np.zeros(len(quotient.reps), dtype=np.int64)
    link_bytes, link_messages = [0] * MAX_CLASSES, [0] * MAX_CLASSES
    pairs: dict | None = {} if quotient.full else None
    steps = 0
    for c, program in enumerate(quotient.programs):
        # cost steps are interned: count each distinct one once, then weigh it by its repeats
        repeats = Counter(map(id, program))
        repeats.pop(id(None), None)
        steps = max(steps, sum(repeats.values()))
        distinct = dict(zip(map(id, program), program))
        for key, times in repeats.items():
            for peer, nbytes_sent, link in distinct[key].sends:
                sent_bytes[c] += nbytes_sent * times
                sent_messages[c] += times
                link_bytes[link] += nbytes_sent * sizes[c] * times
                link_messages[link] += sizes[c] * times
                if pairs is not None:
                    messages, volume = pairs.get((quotient.reps[c], peer), (0, 0))
                    pairs[(quotient.reps[c], peer)] = (messages + times,
                                                       volume + nbytes_sent * times)
    result = (sent_bytes, sent_messages, tuple(link_bytes), tuple(link_messages), pairs, steps)
    if len(_COUNTS) > 512:
        _COUNTS.clear()
    _COUNTS[id(quotient)] = (quotient, result)
    return result


_COUNTS: dict = {}


def _simulate_ring_dense(program, nranks: int, topology: Topology, costs: _Costs
                         ) -> tuple[np.ndarray, tuple, int]:
    """Every rank of a ring of single blocks (count >= p) in NumPy, one clock per rank.

    ``program``: :func:`.programs._ring_program` (rank 0's distinct steps and their order);
    every rank runs it rotated, with rank 0's bytes, as :func:`_run` of the quotient does, so
    the clocks are the quotient's (ranks of one class have equal clocks by symmetry). Used
    where the quotient has many classes (levels above the network: one class per position in
    a site), whose step-by-step Python would cost p/sites per step.
    """
    distinct, index = program
    rows = np.asarray(distinct, dtype=np.int64)[np.asarray(index, dtype=np.int64)]
    nclasses = len(costs.links)
    places = _places(topology, nclasses)
    ranks = np.arange(nranks)
    receivers, classes = {}, {}
    for send_peer, _, recv_peer, _, _ in distinct:
        if (send_peer + recv_peer) % nranks:
            raise ScheduleError("a ring step's receive is not from the rank it sends to's left")
        receivers[send_peer] = (ranks + send_peer) % nranks
        classes[send_peer] = _links(places, ranks, receivers[send_peer])
    cost_of = {}  # (bytes, offset) -> seconds of each rank's message on its link class

    def seconds(nbytes: int, offset: int) -> np.ndarray:
        key = (nbytes, offset)
        if key not in cost_of:
            per_class = np.array([float(costs.message(nbytes, kind))
                                  for kind in range(nclasses)])
            cost_of[key] = per_class[classes[offset]]
        return cost_of[key]

    clock = np.zeros(nranks)
    before = float(costs.cpu(2))  # a non-empty send and receive per step
    for send_peer, sent, _, received, reduces in rows.tolist():
        receiver = receivers[send_peer]
        ready = clock + before
        load = np.maximum(seconds(sent, send_peer), seconds(received, send_peer))
        finish = np.maximum(ready, ready[receiver]) + load
        end = np.maximum(ready, finish)
        arrived = np.empty(nranks)
        arrived[receiver] = finish
        end = np.maximum(end, arrived)
        clock = end + float(costs.reduce(received if reduces else 0, 1 if reduces else 0))
    sent_total = int(rows[:, 1].sum())
    busy = int((rows[:, 1] > 0).sum())
    link_bytes, link_messages = [0] * nclasses, [0] * nclasses
    pairs: dict | None = {} if nranks <= PAIRS_RANKS else None
    for offset in receivers:
        mine = rows[rows[:, 0] == offset]
        per_class = np.bincount(classes[offset], minlength=nclasses)
        for kind in range(nclasses):
            link_bytes[kind] += int(mine[:, 1].sum()) * int(per_class[kind])
            link_messages[kind] += int((mine[:, 1] > 0).sum()) * int(per_class[kind])
        if pairs is not None:
            for rank, peer in zip(ranks.tolist(), receivers[offset].tolist()):
                messages, volume = pairs.get((rank, peer), (0, 0))
                pairs[(rank, peer)] = (messages + int((mine[:, 1] > 0).sum()),
                                       volume + int(mine[:, 1].sum()))
    totals = (np.full(nranks, sent_total, dtype=np.int64), np.full(nranks, busy, dtype=np.int64),
              tuple(link_bytes), tuple(link_messages), pairs)
    return clock, totals, len(rows)
