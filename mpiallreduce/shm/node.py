"""A node's shared memory: the window of headers and data slots its ranks share, its epochs,
and the memory of shared arrays (:class:`SharedBlock`).

The ranks of a communicator on one node share memory from ``MPI.Win.Allocate_shared``:

- a *header* per rank (:data:`.protocol.HEADER_BYTES`, four cache lines of its own): a
  counter word (the last step this rank published), then the call's signature, double-buffered
  by call parity, then the chunk-step word of the large regime;
- *data slots* per rank, one per parity (:mod:`.protocol` defines epoch, parity slot, publish
  and arrive).

Memory ordering. A rank writes its data and signature, then its counter; a peer reads the
counter, then the data. x86-64 keeps stores in order with stores and loads with loads (TSO),
and each step here is a separate C call from Python (a compiler barrier), so no fence is
needed there. On other CPUs (and in tests, :data:`.protocol.FENCE`) ``Win.Sync`` (a full
memory barrier in Open MPI and MPICH) runs between data and counter on both sides.

The node is handed what it needs by its caller (the communicator's state: its ``private``
and ``checker`` duplicates, ``fail`` and the call cache ``calls``); it imports nothing above
the transport.
"""

from __future__ import annotations

import contextlib
import os
import weakref

import numpy as np
from mpi4py import MPI

from .. import _form
from .._revoke import mark_of, marked_rank
from .._waiting import deadline_of, meet, poll, wait_until
from ..errors import CollectiveTimeout
from ..executor import ABANDONED
from . import protocol
from .protocol import (
    ALIGN,
    HEADER_BYTES,
    MIN_WINDOW,
    SIGNATURE_WORDS,
    SPIN_READS,
    STEP_WORD,
    YIELD_SECONDS,
    round_up,
)


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return os.cpu_count() or 1


class Node(_form.compiled.NodeFields if _form.compiled is not None else object):
    """The shared-memory state of one communicator's node: headers, data windows, epoch.

    Made on first use (collective, at a point every rank reaches alike) and attached to the
    private communicator, so it is freed with it (see :func:`node_of`). In the compiled form
    ``epoch`` and ``finished`` are the C members of ``_compiled.NodeFields``, which the compiled
    small-regime run reads without an attribute lookup.
    """

    def __init__(self, private: MPI.Intracomm, state, comm: MPI.Intracomm | None = None):
        self.state = state
        # the ranks of private that share this memory: its shared-memory split, or ``comm``
        # (a node of a topology, :mod:`.shm_nodes`), which the node then owns and frees
        self.comm = (private.Split_type(MPI.COMM_TYPE_SHARED, key=private.Get_rank())
                     if comm is None else comm)
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self.closed = False
        self.crowded = False  # (a node of shm_nodes: some machine has more ranks than cores)
        self.epoch = 0  # the last epoch claimed (in call order, in the caller's thread)
        self.finished = 0  # the last epoch run to its end on this rank
        # counter reads a wait makes back to back before it yields: none where the node's
        # ranks outnumber the cores (a spinning rank holds the core its peer needs)
        self.spin = SPIN_READS if self.size <= _cores() else 0
        # Win.Sync between data and counter (weakly ordered memory), fixed for the node's life
        self.fence = protocol.FENCE
        self.capacity = 0  # bytes per rank of the current data window
        self.segments: list = []  # each rank's segment of the current data window
        self.windows: list[MPI.Win] = []
        self.blocks = 0  # shared arrays made so far (their ids agree: creation is collective)
        header = self._allocate(HEADER_BYTES)
        self.headers = [memoryview(header.Shared_query(q)[0]).cast("B").cast("q")
                        for q in range(self.size)]
        self.header = self.headers[self.rank]
        self.header[:] = memoryview(bytes(HEADER_BYTES)).cast("q")
        self.comm.Barrier()  # every header is zero before anyone reads one
        self.peers = tuple(q for q in range(self.size) if q != self.rank)
        self.peer_headers = tuple(self.headers[q] for q in self.peers)
        # the peers' chunk-step words, as views whose word 0 is the step (for wait())
        self.peer_steps = tuple(header[STEP_WORD:] for header in self.peer_headers)
        self.sync = header.Sync if self.fence else None
        self.areas = tuple((1 + parity * SIGNATURE_WORDS, 1 + (parity + 1) * SIGNATURE_WORDS)
                           for parity in (0, 1))
        self.signatures = tuple(tuple(h[lo:hi] for h in self.headers) for lo, hi in self.areas)
        self.written: list = [None, None]  # the plan whose signature each area holds
        # (the communicator's revocation marks this rank's header: ``_revoke``)
        state.nodes.append(self)

    # -- order: epochs are claimed in call order and run one after the other -----------------

    def claim(self) -> int:
        """Take the next epoch (in the caller's thread, so in call order on every rank)."""
        self.epoch += 1
        return self.epoch

    def turn(self, epoch: int, deadline: float | None, what: str) -> None:
        """Wait until every earlier epoch has run here (one started in a progress thread).

        The earlier epoch runs in another thread of this process: the wait sleeps between its
        checks from the start (a spin or ``sched_yield`` would keep the GIL from that thread).
        """
        if self.finished == epoch - 1:
            return

        def late():
            raise CollectiveTimeout(f"{what} on rank {self.rank}: an earlier request on this "
                                    f"communicator did not finish in time")
        wait_until(lambda: self.finished == epoch - 1, deadline, late, spin=0, yield_seconds=0)

    def finish(self, epoch: int) -> None:
        """Mark ``epoch`` run to its end on this rank (a later epoch's :meth:`turn` waits for it)."""
        self.finished = epoch

    # -- the counters ---------------------------------------------------------------------------

    def publish(self, value: int) -> None:
        """Make this rank's data and signature visible, then its counter ``value``."""
        if self.sync is not None:
            self.sync()
        self.header[0] = value

    def mark(self, rank: int) -> None:
        """Mark ``rank``'s give-up in this rank's header (:mod:`.._revoke`): counter and
        chunk-step words below anything a peer waits for."""
        if not self.closed:
            self.header[0] = self.header[STEP_WORD] = mark_of(rank)

    def wait(self, target: int, deadline: float | None, some=None, where: str | None = None
             ) -> list[int] | None:
        """Wait until every peer's counter (or, given ``some = (ranks, their headers)``, those
        peers') reaches ``target``; return the ranks missing at ``deadline`` (None once all
        arrived). Spins, then yields the core, then sleeps (:func:`.._waiting.wait_until`).

        A peer's mark (it gave up), or the alarm of a rank elsewhere, ends the wait with
        CommunicatorRevoked (``where``: ``"<call> on rank r"``, as the message names it)."""
        ranks, headers = (self.peers, self.peer_headers) if some is None else some
        alarm = self.state.alarm
        reads = 0

        def ready() -> bool:  # a loop, not all(): it runs once per read
            nonlocal reads
            arrived = True
            for peer in headers:
                word = peer[0]
                if word < target:
                    if word < 0:  # a mark: raised below
                        return True
                    arrived = False
            reads += 1
            if not arrived and reads % SPIN_READS == 0 and alarm.test() is not None:
                return True
            return arrived
        if not wait_until(ready, deadline, spin=self.spin, yield_seconds=YIELD_SECONDS):
            return [q for q, h in zip(ranks, headers) if h[0] < target]
        if where is None:
            where = f"shm allreduce on rank {self.state.private.Get_rank()}"
        for header in headers:
            if header[0] < 0:
                self.state.heard_mark(marked_rank(header[0]), where)
        self.state.check_alarm(where)
        if self.sync is not None:
            self.sync()
        return None

    def give_up(self, error: BaseException, where: str) -> None:
        """An exception ends a run in the middle (``where``: the call): revoke (:mod:`.._revoke`)."""
        self.state.give_up(error, f"{where} on rank {self.state.private.Get_rank()}")

    # -- the argument check ----------------------------------------------------------------------

    def agree(self, signature, timeout: float | None, what: str, on_timeout) -> bool:
        """The argument check over the headers: True if every rank wrote ``signature``.

        One epoch like a small call, with no data: the fields of :mod:`._agree` in this
        rank's header, the counter, a read of every header. False (only ever on every rank
        alike) sends the caller to the exchange of :func:`._agree.disagree`; so does a peer
        that runs a data call here instead (a call whose run checks itself, ``check=False``, a
        plan): it sees this check's signature and joins the exchange (:meth:`ShmPlan._mismatch`).
        The area's last word (padding in every signature) is carried, not compared: where the
        signatures agree, ``signature.carried`` is every rank's, in node rank order (a
        reproducible sum of one value sends its bits there instead of an
        exchange of its own).
        """
        deadline = deadline_of(timeout)
        epoch = self.claim()
        try:
            self.turn(epoch, deadline, what)
            parity = epoch & 1
            lo, hi = self.areas[parity]
            self.header[lo:hi] = signature.shm
            self.written[parity] = None
            self.publish(2 * epoch)
            missing = self.wait(2 * epoch - 1, deadline,
                                where=f"{what} on rank {self.state.private.Get_rank()}")
            if missing is not None:
                reason = (f"{what} on rank {self.rank}: the argument check did not complete "
                          f"within {timeout:g} s; no answer from rank(s) "
                          f"{', '.join(map(str, missing))} (a rank has not made this call, or "
                          f"runs calls in a different order, or passed check=False)")
                on_timeout(reason, [], (signature,))
                raise CollectiveTimeout(reason)
            mine = signature.shm[:-1]
            same = True
            # carried: every rank's last signature word, in rank order (passed along to every
            # rank, never compared: _agree.Signature.carried)
            carried = []
            for theirs in self.signatures[parity]:
                carried.append(theirs[-1])
                if theirs[:-1] != mine:
                    same = False
            signature.carried = carried
            return same
        finally:
            self.finish(epoch)

    def _allocate(self, nbytes: int) -> MPI.Win:
        window = MPI.Win.Allocate_shared(nbytes, 1, comm=self.comm)
        if self.fence:
            window.Lock_all(MPI.MODE_NOCHECK)  # Win.Sync needs a passive-target epoch
        self.windows.append(window)
        return window

    def meet(self, deadline: float | None, what: str) -> None:
        """Let every rank arrive before a blocking collective, within ``deadline``."""
        _meet(self.comm, self.state, deadline, what)

    def reserve(self, nbytes: int, deadline: float | None, what: str) -> None:
        """Grow the data window to two slots of ``nbytes`` per rank (collective when it grows).

        Called with the agreed count of a call: every rank holds the same capacity after the
        same calls, so every rank grows at the same call. Windows are never freed before the
        communicator (plans bound to them may live on), and grow to powers of two.
        """
        need = 2 * round_up(nbytes)
        if need <= self.capacity:
            return
        capacity = max(MIN_WINDOW, 1 << (need - 1).bit_length())
        self.meet(deadline, what)
        window = self._allocate(capacity)
        self.capacity = capacity
        self.segments = [window.Shared_query(q)[0] for q in range(self.size)]

    def new_block(self, nbytes: int) -> SharedBlock:
        """Allocate a shared array's memory on every rank of the node (collective)."""
        window = self._allocate(max(round_up(nbytes), ALIGN))
        self.windows.remove(window)  # the block owns it
        self.blocks += 1
        return SharedBlock(self, window, self.blocks)

    def scratch_block(self, nbytes: int) -> SharedBlock:
        """As :meth:`new_block`, for a layer's internal buffers (reproducible sums' words): the
        node keeps the window and frees it with the others, never before (collective)."""
        block = self.new_block(nbytes)
        self.windows.append(block.window)
        return block

    def close(self) -> None:
        """Free the windows when every rank of the node frees the communicator.

        ``Win.Free`` is collective and blocks, so the ranks first meet in an ``Ibarrier``
        polled for :data:`CLOSE_SECONDS`: after a timeout some ranks hold a broken state and the
        rank that was missing a healthy one, yet all of them free the communicator. A rank
        that does not come keeps the windows mapped (never a hang, never a crash).
        """
        if self.closed:
            return
        self.closed = True
        if MPI.Is_finalized():
            return
        request = self.comm.Ibarrier()
        if not poll([request], deadline_of(CLOSE_SECONDS)):
            ABANDONED.append((self, request))  # kept mapped, never freed: a peer may still read
            return
        for window in self.windows:
            if self.fence:
                window.Unlock_all()
            window.Free()
        self.windows.clear()
        self.comm.Free()


#: seconds a rank freeing a communicator waits for the node's other ranks to free it too.
CLOSE_SECONDS = 10.0


def _delete_node(comm, keyval, node) -> None:
    node.close()


KEYVAL = MPI.Comm.Create_keyval(delete_fn=_delete_node)
#: the node of a communicator whose ranks all share it, on its checker duplicate: the argument
#: check then runs over the headers (:meth:`Node.agree`).
CHECK_KEYVAL = MPI.Comm.Create_keyval()


def _meet(comm: MPI.Intracomm, state, deadline: float | None, what: str) -> None:
    """Every rank of ``comm`` arrives before a collective set-up step, within ``deadline``
    (:func:`.._waiting.meet`; nothing to wait for without one: the step itself waits)."""
    if deadline is not None:
        meet(comm, deadline, state.fail,
             f"{what} on rank {comm.Get_rank()}: setting up shared memory")


def node_of(state, deadline: float | None = None, what: str = "allreduce") -> Node:
    """Return the node state of ``state``'s communicator, made on first use (collective)."""
    private = state.private
    found = private.Get_attr(KEYVAL)
    if found is None:
        _meet(private, state, deadline, what)
        found = Node(private, state)
        private.Set_attr(KEYVAL, found)
        if found.size == private.Get_size():
            state.checker.Set_attr(CHECK_KEYVAL, found)
    return found



# -- shared arrays' memory ----------------------------------------------------------------------


class SharedBlock:
    """The memory of one shared array on every rank of a node, and the plans that use it."""

    def __init__(self, node: Node, window: MPI.Win, ident: int):
        self.node = node
        self.window = window
        self.ident = ident
        self.segments = [window.Shared_query(q)[0] for q in range(node.size)]
        self.base = np.frombuffer(self.segments[node.rank], dtype=np.uint8)
        self.users: weakref.WeakSet = weakref.WeakSet()
        self.freed = False

    def offset(self, array: np.ndarray) -> int | None:
        """Byte offset of ``array`` in this rank's segment, or None if it lies elsewhere."""
        if self.freed or self.node.closed:
            return None
        start = array.__array_interface__["data"][0] - self.base.ctypes.data
        if start >= 0 and start + array.nbytes <= self.base.nbytes:
            return start
        return None

    def peers(self, offset: int, dtype: np.dtype, count: int) -> list[np.ndarray]:
        """The same range of every rank's array, flat, in rank order."""
        return [np.frombuffer(segment, dtype=dtype, count=count, offset=offset)
                for segment in self.segments]

    def free(self) -> None:
        """Release the memory on every rank (collective); an error while a plan uses it."""
        if self.freed:
            return
        node = self.node
        with contextlib.suppress(Exception):
            node.state.calls.clear()  # cached one-shot plans may hold it: drop them (local)
        busy = sum(1 for plan in self.users if not plan._freed)
        if node.closed:
            self.freed = True
            return
        # the same error on every rank, or none: a rank that raised would leave the others in
        # the collective Win.Free
        busiest = node.comm.allreduce(busy, op=MPI.MAX)
        if busiest:
            raise ValueError(f"this shared array is still used by {busiest} plan(s) on some rank; "
                             f"free those plans on every rank first")
        self.freed = True
        self.base = None
        if self.node.fence:
            self.window.Unlock_all()
        self.window.Free()
