"""Per-communicator state: private duplicates, plan slots, the call cache, scratch, topology.

mpiallreduce never sends on the user's communicator. The first call on a communicator makes two
duplicates of it (``Dup``; with a ``timeout=``, ``Idup`` polled against the call's deadline, so
even that first call honours it) and attaches a :class:`CommState` to it as an MPI attribute:

- ``private`` carries the schedules' point-to-point messages and the native collectives of
  one-shot calls;
- ``checker`` carries only the agreement check, so a rank that skips the check (``check=False``
  where the others check) waits instead of matching its data with another rank's signature.

Messages of different plans never match: every explicit plan takes the next *slot*, a block of
:data:`~mpiallreduce.executor.STEP_TAGS` tags of its own on ``private`` (slot 0 belongs to the
one-shot calls, which MPI-like match in call order). Plans are created in the same order on
every rank (creation is collective), so slot numbers agree without a message.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
from mpi4py import MPI

from ._env import env_int
from ._lru import LRU
from ._revoke import Alarm, Revocation
from ._waiting import meet
from .errors import CollectiveTimeout, is_alike
from .executor import ABANDONED, MPI_CANNOT_SAY, STEP_TAGS, poll
from .topology import Topology

#: most one-shot plans kept per communicator (``MPIALLREDUCE_CACHE_ENTRIES``; 0 disables the cache).
CACHE_ENTRIES = env_int("MPIALLREDUCE_CACHE_ENTRIES", 64)
#: most bytes (buffers kept alive plus plan scratch) the call cache holds per communicator
#: (``MPIALLREDUCE_CACHE_BYTES``). A call bigger than this on its own is not cached.
CACHE_BYTES = env_int("MPIALLREDUCE_CACHE_BYTES", 64 << 20)
#: most bytes of shared scratch kept per communicator between uncached calls; a bigger call gets
#: scratch of its own that is released when it returns.
SCRATCH_BYTES = env_int("MPIALLREDUCE_SCRATCH_BYTES", 64 << 20)


#: every cached one-shot plan of every communicator, by call key (see :class:`CallCache`): one
#: dictionary lookup finds a repeated call's plan, its communicator state included.
CALLS: dict = {}
#: the entry last bound to each recvbuf, by ``id(recvbuf)``: a repeated call finds its plan here
#: by comparing objects, without building and hashing the full key. Present for every recvbuf
#: some entry of :data:`CALLS` holds (``CallCache`` keeps it so), so a miss means no entry.
LAST: dict = {}
#: one-shot calls by their shape rather than their arrays (``id`` of comm, op and
#: topology, algorithm, dtype, count, in place, parameters): a code that allocates a fresh
#: array per call (``np.array([local_dot])``) still skips the set-up (see ``_plans.Shape``).
SHAPES: dict = {}
#: most shapes kept per communicator.
SHAPES_PER_COMM = 64


class CallCache:
    """Bound one-shot plans of one communicator, least recently bound first out.

    Entries are found by the identity of the objects passed (``id`` of comm, sendbuf, recvbuf,
    op and topology, with algorithm and parameters) in :data:`CALLS`: the entry keeps those
    objects alive, so an ``id`` cannot be reused by another object while the entry exists, and
    a hit also checks that the communicator handle, the arrays' shape and their dtype are still
    those the plan was bound to. Because the buffers are kept alive, their memory cannot be
    freed and handed to another array while a plan points at it. Each communicator's share is
    bounded by :data:`CACHE_ENTRIES` and :data:`CACHE_BYTES`.

    The bounds and the order are the package's one :class:`~mpiallreduce._lru.LRU` (an entry's
    weight is its ``nbytes``); a hit goes through :data:`CALLS`/:data:`LAST`, never through the
    LRU, so the order is the order of binding. What this class adds is keeping the two global
    indices (and :data:`SHAPES`) true as entries come and go.
    """

    def __init__(self, entries: int = CACHE_ENTRIES, nbytes: int = CACHE_BYTES):
        self.lru = LRU(entries, nbytes, on_drop=self._drop)
        # keys of this communicator's SHAPES
        self.shapes = LRU(SHAPES_PER_COMM, on_drop=self._drop_shape)
        # shapes (``_plans.shape_key``) whose entry was refused for its bytes, with the bound
        # then: their calls skip the cache's plan (a persistent one, its scratch its own)
        self.refused = LRU(SHAPES_PER_COMM)

    # the bounds and contents, as the tests and tracing read and set them
    entries = property(lambda self: self.lru.entries, doc="key -> entry, oldest first")
    nbytes = property(lambda self: self.lru.weight, doc="the entries' bytes in total")
    max_entries = property(lambda self: self.lru.max_entries,
                           lambda self, value: setattr(self.lru, "max_entries", value))
    max_bytes = property(lambda self: self.lru.max_weight,
                         lambda self, value: setattr(self.lru, "max_weight", value))

    def put_shape(self, key, shape) -> None:
        """Keep a native call's shape (bounded by :data:`SHAPES_PER_COMM`)."""
        if self.max_entries == 0:
            return
        # set SHAPES first: the shape this one replaces is freed, and SHAPES keeps the new one
        SHAPES[key] = shape
        self.shapes.put(key, shape)

    def _drop_shape(self, key, shape) -> None:
        if SHAPES.get(key) is shape:
            del SHAPES[key]
        shape.free()

    def fits(self, nbytes: int, shape=None) -> bool:
        """Whether an entry of at least ``nbytes`` could be kept (:meth:`put` says for sure),
        and one of ``shape`` was not refused under the present bound (:meth:`refuse`)."""
        if self.max_entries == 0 or nbytes > self.max_bytes:
            return False
        bound = self.refused.peek(shape) if shape is not None else None
        return bound is None or self.max_bytes > bound

    def refuse(self, shape) -> None:
        """Remember that an entry of ``shape`` did not fit under the present bound."""
        if shape is not None:
            self.refused.put(shape, self.max_bytes)

    def put(self, key, entry) -> bool:
        """Keep ``entry`` (an object with ``nbytes`` and ``free()``); False if it is too big."""
        if entry.nbytes > self.max_bytes or self.max_entries == 0:
            return False
        # index it first, so that the entry it replaces (if any) is only freed: CALLS and LAST
        # already name the new one
        CALLS[key] = entry
        LAST[key[2]] = entry
        return self.lru.put(key, entry, entry.nbytes)

    def _drop(self, key, entry) -> None:
        if CALLS.get(key) is entry:
            del CALLS[key]
        if LAST.get(key[2]) is entry:
            # LAST holds an entry for every recvbuf some entry holds (a miss there means no
            # entry holds it, and the call skips the lookup of its full key): another one's
            del LAST[key[2]]
            for other_key, other in list(CALLS.items()):  # (threads share CALLS)
                if other_key[2] == key[2]:
                    LAST[key[2]] = other
                    break
        entry.free()

    def discard(self, key) -> None:
        """Drop the entry under ``key`` now (freed, its indices updated), if there is one."""
        entry = self.lru.pop(key)
        if entry is not None:
            self._drop(key, entry)

    def discard_shape(self, key) -> None:
        """Drop the shape under ``key`` now (freed, :data:`SHAPES` updated), if there is one."""
        shape = self.shapes.pop(key)
        if shape is not None:
            self._drop_shape(key, shape)

    def clear(self) -> None:
        self.lru.clear()
        self.shapes.clear()


@dataclass
class CommState:
    """What mpiallreduce keeps per user communicator (see the module docstring).

    ``broken`` is set when the communicator is revoked (:mod:`._revoke`): this rank gave up on
    a collective on it, or heard that another rank did. Messages of that call may still be in
    flight, so every later call and every plan on it refuses to run
    (:class:`~mpiallreduce.CommunicatorRevoked`). ``stale`` keeps the requests abandoned then
    (MPI cannot cancel a collective one); ``revocation`` says who gave up on what; ``alarm``
    is the channel that tells the other ranks; ``nodes`` are the shared-memory nodes whose
    headers this rank marks.
    """

    private: MPI.Intracomm
    checker: MPI.Intracomm
    calls: CallCache = field(default_factory=CallCache)
    scratch: dict = field(default_factory=dict)
    topology: Topology | None = None
    broken: str | None = None
    stale: list = field(default_factory=list)
    kept: list = field(default_factory=list)
    native_nonblocking: MPI.Intracomm | None = None
    #: reproducible vector sums' packed signatures and reused buffers (``reproducible``)
    vectors: dict = field(default_factory=dict)
    #: auto's learning records on this communicator, by case (``learn.records``)
    learned: dict = field(default_factory=dict)
    #: the picks earlier jobs learned (``picks.Memory``), read at the first learning case
    memory: object = None
    slots: int = 0  # slots of STEP_TAGS tags that fit under TAG_UB (slot 0: one-shot calls)
    next_slot: int = 1
    revocation: Revocation | None = None
    alarm: Alarm | None = None
    nodes: list = field(default_factory=list)

    def __post_init__(self):
        # TAG_UB is an attribute of COMM_WORLD (MPI-4.1 §7.1.1); MPI guarantees at least 32767
        tag_ub = MPI.COMM_WORLD.Get_attr(MPI.TAG_UB) or 32767
        self.slots = max(2, (tag_ub + 1) // STEP_TAGS)
        if self.alarm is None and self.checker != MPI.COMM_NULL:
            self.alarm = Alarm(self.checker)

    def mark_broken(self, reason: str, pending=(), keep=(), heard: Revocation | None = None,
                    rank: int | None = None) -> None:
        """Revoke the communicator: refuse it from now on and, where this rank gives up
        (``heard`` None), tell the other ranks (the alarm) and mark this rank's headers.
        ``pending`` are requests MPI may still complete; ``keep`` the buffers they (or
        cancelled point-to-point messages) may still touch, held so that MPI never writes into
        freed memory (mpi4py does not hold them for us). ``heard``: another rank gave up.
        ``rank``: this rank's, where the state has no private duplicate to read it from."""
        self.stale.extend(pending)
        self.kept.extend(keep)
        if self.revocation is not None:
            return
        self.broken = reason
        self.calls.clear()
        if self.private != MPI.COMM_NULL:
            rank = self.private.Get_rank()
        self.revocation = heard if heard is not None else Revocation(rank, reason)
        if heard is None and self.alarm is not None:
            self.alarm.send(reason)
        who = self.revocation.rank if self.revocation.rank is not None else rank
        for node in self.nodes:
            node.mark(who)

    def fail(self, reason: str, pending=(), keep=()) -> None:
        """Revoke the communicator (:meth:`mark_broken`) and raise CollectiveTimeout; where
        another rank gave up first (its alarm came), raise CommunicatorRevoked instead."""
        heard = self.alarm.test() if self.alarm is not None and self.revocation is None else None
        self.mark_broken(reason, list(pending), keep, heard)
        if heard is not None:
            raise heard.error(reason.split(":", 1)[0])
        raise CollectiveTimeout(reason)

    def hear(self, heard: Revocation, where: str, pending=(), keep=()) -> None:
        """Another rank gave up (``heard``): revoke here too, raise CommunicatorRevoked."""
        self.mark_broken(heard.reason, list(pending), keep, heard)
        raise self.revocation.error(where)

    def heard_mark(self, rank: int, where: str) -> None:
        """This rank found ``rank``'s mark in a node's header: revoke here too and raise."""
        self.hear(self.revocation or self.alarm.reason_from(rank), where)

    def give_up(self, error: BaseException, where: str, pending=(), keep=()) -> None:
        """An exception ends a run in the middle (``where``: ``"<call> on rank r"``): revoke,
        unless the communicator is revoked already or every rank raises ``error`` alike."""
        if self.revocation is None and not is_alike(error):
            self.mark_broken(f"{where}: gave up in the middle of the call "
                             f"({type(error).__name__}: {error})", list(pending), keep)

    def check_alarm(self, where: str) -> None:
        """Raise CommunicatorRevoked if another rank's alarm has come (revoking here too)."""
        if self.revocation is None and self.alarm is not None:
            heard = self.alarm.test()
            if heard is not None:
                self.hear(heard, where)

    def refuse_if_broken(self, what: str) -> None:
        """Raise CommunicatorRevoked (``what``: the call refused) if the communicator is."""
        if self.broken:
            raise (self.revocation or Revocation(None, self.broken)).error(what)

    def take_slot(self) -> int:
        """Return the tag base of the next plan (the same on every rank: creation is ordered).

        Slots wrap after ``slots - 1`` plans (524287 under Open MPI, whose TAG_UB is 2**31-1);
        only two live plans that many creations apart share tags.
        """
        slot = self.next_slot
        self.next_slot = slot + 1 if slot + 1 < self.slots else 1
        return slot * STEP_TAGS

    def scratch_for(self, dtype: np.dtype, size: int) -> np.ndarray:
        """Shared scratch of at least ``size`` elements; kept only up to :data:`SCRATCH_BYTES`."""
        buf = self.scratch.get(dtype)
        if buf is not None and buf.size >= size:
            return buf
        buf = np.empty(max(size, 1), dtype=dtype)
        if buf.nbytes <= SCRATCH_BYTES:
            self.scratch[dtype] = buf
        else:
            self.scratch.pop(dtype, None)  # an outsized call releases what it had, keeps nothing
        return buf

    def nonblocking_comm(self, timeout: float | None, what: str) -> MPI.Intracomm:
        """A duplicate of its own for native non-blocking collectives (made on first use).

        Their ``Wait`` runs in the progress thread; on a communicator of their own they never
        share one with the blocking collectives the caller's thread issues meanwhile.
        """
        if self.native_nonblocking is None:
            deadline = None if timeout is None else time.monotonic() + timeout
            self.native_nonblocking = self.duplicate(deadline, what)
        return self.native_nonblocking

    def duplicate(self, deadline: float | None, what: str) -> MPI.Intracomm:
        """Another duplicate of ``private`` (collective), within the deadline if one is set."""
        return _idup(self.private, deadline, what, self)

    def default_topology(self, deadline: float | None = None, what: str = "allreduce"
                         ) -> Topology:
        """``Topology.from_comm`` of the communicator, computed once (collective the first time).

        ``Split_type`` has no non-blocking form, so with a deadline every rank first meets in a
        polled ``Ibarrier``: once all have arrived, the blocking discovery cannot wait on a
        missing rank.
        """
        if self.topology is None:
            if deadline is not None:
                meet(self.private, deadline, self.fail,
                     f"{what} on rank {self.private.Get_rank()}: topology discovery")
            self.topology = Topology.from_comm(self.private)
        return self.topology


def _idup(comm: MPI.Intracomm, deadline: float | None, what: str, state=None) -> MPI.Intracomm:
    if deadline is None:
        return comm.Dup()
    dup, request = comm.Idup()
    if not poll([request], deadline):
        reason = (f"{what} on rank {comm.Get_rank()}: setting up the communicator (MPI_Comm_idup) "
                  f"did not complete in time; some rank has not made this call ({MPI_CANNOT_SAY})")
        if state is not None:
            state.mark_broken(reason, [request])
        error = CollectiveTimeout(reason)
        error.pending = [request]
        raise error
    return dup


def _delete_state(comm, keyval, state) -> None:
    if MPI.Is_finalized():
        return
    state.calls.clear()
    if state.alarm is not None and not state.broken:
        state.alarm.close()
    for private in (state.private, state.checker, state.native_nonblocking):
        if private is not None and private != MPI.COMM_NULL:
            if state.broken:
                ABANDONED.append(private)
            else:
                private.Free()


KEYVAL = MPI.Comm.Create_keyval(delete_fn=_delete_state)


def existing(comm: MPI.Intracomm) -> CommState | None:
    """Return comm's state if mpiallreduce has used comm before."""
    return comm.Get_attr(KEYVAL)


def state(comm: MPI.Intracomm, timeout: float | None = None, what: str = "allreduce") -> CommState:
    """Return comm's state, duplicating comm on first use (collective, like MPI_Comm_dup).

    With a ``timeout`` the duplicates are made with ``Idup`` polled against it; if some rank does
    not arrive, CollectiveTimeout is raised and the communicator is refused from then on.
    """
    found = comm.Get_attr(KEYVAL)
    if found is not None:
        return found
    # No lock here: the duplication is collective, and a process-wide lock held across it
    # would deadlock two threads that set up two communicators in different orders on
    # different ranks. One communicator is used by one thread at a time (docs/howto/calls.md, "Threads").
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        private = _idup(comm, deadline, what)
        checker = _idup(comm, deadline, what)
    except CollectiveTimeout as exc:
        fail_on(comm, str(exc), exc.pending, raise_=False)
        raise
    found = CommState(private, checker)
    comm.Set_attr(KEYVAL, found)
    return found


def fail_on(comm: MPI.Intracomm, reason: str, pending=(), raise_: bool = True) -> None:
    """Mark ``comm`` unusable for mpiallreduce and raise CollectiveTimeout, with no collective:
    where it has no state yet (a timeout in MPI's own collective, or in the set-up), the
    user's communicator keeps a dead one that holds the reason and the pending requests."""
    found = comm.Get_attr(KEYVAL)
    if found is None:
        found = CommState(MPI.COMM_NULL, MPI.COMM_NULL)
        comm.Set_attr(KEYVAL, found)
    found.mark_broken(reason, list(pending), rank=comm.Get_rank())
    if raise_:
        raise CollectiveTimeout(reason)


def recover(comm: MPI.Intracomm) -> None:
    """Make ``comm`` usable by mpiallreduce again after a revocation (collective: every rank of
    ``comm`` calls it, revoked or not).

    The ranks meet in a barrier on ``comm`` itself, then each drops its state of ``comm``: the
    next call makes fresh private duplicates (and shared windows), on which no message or slot
    of the abandoned call can ever match (the old duplicates are kept, never freed: see
    :data:`~mpiallreduce.executor.ABANDONED`). Plans bound before stay refused: make new
    ones. A rank blocked inside MPI's own collective cannot call it (see the docs, "Faults").
    """
    comm.Barrier()
    found = comm.Get_attr(KEYVAL)
    if found is not None:
        if found.revocation is None:  # (never told: revoked here too, so nothing is freed
            # that a revoked rank keeps, and no close waits for it)
            found.mark_broken("mpiallreduce.recover", heard=Revocation(None, "recovered"))
        comm.Delete_attr(KEYVAL)
