"""Node-local shared-memory transport: one window per node, per-rank headers, three regimes.

With :mod:`.executor`, the transport layer: the only code that moves data between ranks. The
ranks of a communicator on one node share memory from ``MPI.Win.Allocate_shared``:

- a *header* per rank (:data:`HEADER_BYTES`, two cache lines of its own): a sequence counter
  and the call's signature, the latter double-buffered by call parity;
- *data slots* per rank, double-buffered by call parity: at call ``e`` every rank has seen
  every peer start call ``e - 1``, so every peer has finished reading call ``e - 2`` and slot
  ``e % 2`` is free without an acknowledgement round.

Every rank numbers its shm calls on a communicator (its *epoch*); call ``e`` publishes the
counter ``2e - 1`` once its data is in place ("arrived") and ``2e`` once its part is done
(the large regime's chunks count their steps in a word of their own, :data:`STEP_WORD`).
Regimes (chosen from the agreed count and dtype, never from per-rank state):

- *small* (up to :func:`small_bytes`): copy into the slot, publish, every rank reduces all p
  slots itself in rank order (identical bits everywhere, non-commutative ops exact);
- *large*: a chunk at a time (:data:`CHUNK_BYTES`, two chunk buffers per parity slot, so the
  slots stay in the caches): each rank copies the peers' blocks (``partition.block``) of its
  chunk in, publishes, reduces its own block across all ranks in rank order (its own input
  read where it is), publishes, and copies the other blocks out;
- *shared arrays* (:func:`shared_empty`): inputs are read straight from the peers' arrays,
  and a result that is a shared array is written straight into every rank's array.

Every wait checks the peers' signatures first, so ranks that run different calls (count,
dtype, op, plan, shared-array placement) raise the same ValueError without a message. A data
signature also carries a digest of the call's argument-check fields (:mod:`._agree`: algorithm
as requested, parameters, topology, whether a timeout is set, ...), so a one-shot call whose
run goes through here needs no separate check (``check=True`` is free): a difference there, or
a peer that checks the arguments of another call at this epoch, sends every rank to the
agreement's exchange (the plan's ``disagree``), which raises the agreement's message everywhere.

Memory ordering. A rank writes its data and signature, then its counter; a peer reads the
counter, then the data. x86-64 keeps stores in order with stores and loads with loads (TSO),
and each step here is a separate C call from Python (a compiler barrier), so no fence is
needed there. On other CPUs ``Win.Sync`` (a full memory barrier in Open MPI and MPICH) runs
between data and counter on both sides (:data:`FENCE`).
"""

from __future__ import annotations

import contextlib
import os
import platform
import threading
import time
import weakref
from functools import partial

import numpy as np
from mpi4py import MPI

from . import executor
from ._waiting import meet
from .errors import CollectiveTimeout
from .executor import ABANDONED, _PlanBase, _untraced, flat, poll
from .ops import DTYPES, exact_sum
from .partition import block

#: bytes of each rank's header: counter, then two signatures (call parity), padded to two
#: 64-byte lines so that a peer's adjacent-line prefetch never pulls in another rank's header.
HEADER_BYTES = 256
#: int64 words of a signature area (one per call parity): its kind, a digest of the whole, then
#: the fields (a peer compares the digest word alone on the hot path). A data
#: call writes count, dtype, op, plan, send block, send offset, recv block, recv offset and a
#: digest of its argument-check fields; the separate argument check (``check=True`` where the
#: run does not check itself) writes the eleven fields of :mod:`._agree`.
SIGNATURE_WORDS = 14  # kind, digest, up to 12 fields; two areas fit the header
KIND_DATA, KIND_CHECK = 1, 2
DATA_FIELDS = ("count", "dtype", "op", "plan", "shared sendbuf", "sendbuf offset",
               "shared recvbuf", "recvbuf offset")
#: signature columns (after kind and digest) that say which plan runs on which memory: where
#: these differ, the local message names them; elsewhere the agreement's exchange does.
PLACEMENT = tuple(range(2 + DATA_FIELDS.index("plan"), 2 + len(DATA_FIELDS)))
#: most bytes per rank of the small regime (every rank reduces every slot).
SMALL_BYTES = 32 << 10
#: the same at 2 ranks on private arrays (:func:`small_bytes`): there each rank reduces the
#: whole message either way, and one epoch instead of two measured faster up to here
#: (docs/performance.md, "Where shm stops").
SMALL_BYTES_TWO_RANKS = 128 << 10


def small_bytes(nranks: int, shared: bool = False) -> int:
    """Most bytes per rank of the small regime for ``nranks`` ranks; ``shared``: a buffer is a
    shared array (the large regime reads it in place, with no copy)."""
    return SMALL_BYTES_TWO_RANKS if nranks == 2 and not shared else SMALL_BYTES
#: smallest data window per rank (two parity slots); windows grow to the next power of two.
MIN_WINDOW = 64 << 10
#: bytes per rank of one chunk of the large regime on a private result: the message moves
#: through two chunk buffers per parity slot, a chunk at a time, so the slots stay in the
#: caches instead of streaming the whole message through memory twice more (see
#: :meth:`ShmPlan._bind_chunks`; measured in docs/performance.md, "Chunks").
CHUNK_BYTES = 512 << 10
#: most chunks of one call: a larger message takes larger chunks (the bound calls per chunk
#: are kept per plan).
MAX_CHUNKS = 1024
#: the header word of the large regime's chunk steps (after the counter and the two
#: signature areas): ``epoch << 24`` plus the step, so it only grows.
STEP_WORD = 1 + 2 * SIGNATURE_WORDS
STEP_SHIFT = 24
#: counter reads a wait makes back to back before it yields the core between reads.
SPIN_READS = 200
#: seconds a wait yields (``sched_yield``) between reads before it sleeps between them.
YIELD_SECONDS = 10e-3
#: alignment of slot regions (a cache line).
ALIGN = 64
#: CPUs whose ordering (TSO) makes the counter protocol safe without a fence.
TSO_MACHINES = ("x86_64", "amd64", "i386", "i686", "x86")
#: whether a ``Win.Sync`` fence runs between data and counter.
FENCE = platform.machine().lower() not in TSO_MACHINES


def digest(kind: int, fields) -> int:
    """Python's hash of a tuple of ints, as a non-negative int64: the same in every process
    (only str/bytes hashes are salted)."""
    return hash((kind, *(int(field) for field in fields))) & ((1 << 62) - 1)


def signature_words(kind: int, fields) -> list[int]:
    """A signature area's words: kind, digest, fields, zero padding."""
    fields = [int(field) for field in fields]
    return [kind, digest(kind, fields), *fields] + [0] * (SIGNATURE_WORDS - 2 - len(fields))


def _round(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def chunk_bytes(nbytes: int) -> int:
    """Bytes per chunk of the large regime for a message of ``nbytes`` (agreed on every rank)."""
    return max(CHUNK_BYTES, _round(-(-nbytes // MAX_CHUNKS)))


def slot_bytes(nbytes: int) -> int:
    """Bytes per parity slot an shm plan of ``nbytes`` needs: the whole message up to the
    small regime's limit or two chunks, then two chunk buffers (a function of the agreed count
    alone, so every rank grows the window at the same call)."""
    return min(nbytes, max(2 * chunk_bytes(nbytes), SMALL_BYTES, SMALL_BYTES_TWO_RANKS))


class Node:
    """The shared-memory state of one communicator's node: headers, data windows, epoch.

    Made on first use (collective, at a point every rank reaches alike) and attached to the
    private communicator, so it is freed with it (see :func:`node_of`).
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
        self.turns = threading.Condition()
        self.waiting = 0
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
        self.sync = header.Sync if FENCE else None
        self.areas = tuple((1 + parity * SIGNATURE_WORDS, 1 + (parity + 1) * SIGNATURE_WORDS)
                           for parity in (0, 1))
        self.signatures = tuple(tuple(h[lo:hi] for h in self.headers) for lo, hi in self.areas)
        self.written: list = [None, None]  # the plan whose signature each area holds

    # -- order: epochs are claimed in call order and run one after the other -----------------

    def claim(self) -> int:
        """Take the next epoch (in the caller's thread, so in call order on every rank)."""
        self.epoch += 1
        return self.epoch

    def turn(self, epoch: int, deadline: float | None, what: str) -> None:
        """Wait until every earlier epoch has run here (one started in a progress thread)."""
        if self.finished == epoch - 1:
            return
        with self.turns:
            self.waiting += 1
            try:
                while self.finished != epoch - 1:
                    if deadline is not None and time.monotonic() > deadline:
                        raise CollectiveTimeout(f"{what} on rank {self.rank}: an earlier "
                                                f"request on this communicator did not finish "
                                                f"in time")
                    self.turns.wait(0.01)
            finally:
                self.waiting -= 1

    def finish(self, epoch: int) -> None:
        self.finished = epoch
        if self.waiting:
            with self.turns:
                self.turns.notify_all()

    # -- the counters ---------------------------------------------------------------------------

    def publish(self, value: int) -> None:
        """Make this rank's data and signature visible, then its counter ``value``."""
        if self.sync is not None:
            self.sync()
        self.header[0] = value

    def wait(self, target: int, deadline: float | None, some=None) -> list[int] | None:
        """Wait until every peer's counter (or, given ``some = (ranks, their headers)``, those
        peers') reaches ``target``; return the ranks missing at ``deadline`` (None once all
        arrived). Spins, then yields the core, then sleeps."""
        reads = 0
        started = None
        pause = 5e-5
        ranks, headers = (self.peers, self.peer_headers) if some is None else some
        for peer in headers:
            while peer[0] < target:
                reads += 1
                if reads < SPIN_READS:
                    continue
                now = time.monotonic()
                if started is None:
                    started = now
                if deadline is not None and now > deadline:
                    return [q for q, h in zip(ranks, headers) if h[0] < target]
                if now - started < YIELD_SECONDS:
                    os.sched_yield()
                else:
                    time.sleep(pause)
                    pause = min(pause * 2, 1e-3)
        if self.sync is not None:
            self.sync()
        return None

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
        deadline = None if timeout is None else time.monotonic() + timeout
        epoch = self.claim()
        try:
            self.turn(epoch, deadline, what)
            parity = epoch & 1
            lo, hi = self.areas[parity]
            self.header[lo:hi] = signature.shm
            self.written[parity] = None
            self.publish(2 * epoch)
            missing = self.wait(2 * epoch - 1, deadline)
            if missing is not None:
                reason = (f"{what} on rank {self.rank}: the argument check did not complete "
                          f"within {timeout:g} s; no answer from rank(s) "
                          f"{', '.join(map(str, missing))} (a rank has not made this call, or "
                          f"runs calls in a different order, or passed check=False)")
                on_timeout(reason, [], (signature,))
                raise CollectiveTimeout(reason)
            mine = signature.shm[:-1]
            same = True
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
        if FENCE:
            window.Lock_all(MPI.MODE_NOCHECK)  # Win.Sync needs a passive-target epoch
        self.windows.append(window)
        return window

    def meet(self, deadline: float | None, what: str) -> None:
        """Let every rank arrive before a blocking collective, within ``deadline``."""
        if deadline is None:
            return
        meet(self.comm, deadline, self.state.fail,
             f"{what} on rank {self.comm.Get_rank()}: setting up shared memory")

    def reserve(self, nbytes: int, deadline: float | None, what: str) -> None:
        """Grow the data window to two slots of ``nbytes`` per rank (collective when it grows).

        Called with the agreed count of a call: every rank holds the same capacity after the
        same calls, so every rank grows at the same call. Windows are never freed before the
        communicator (plans bound to them may live on), and grow to powers of two.
        """
        need = 2 * _round(nbytes)
        if need <= self.capacity:
            return
        capacity = max(MIN_WINDOW, 1 << (need - 1).bit_length())
        self.meet(deadline, what)
        window = self._allocate(capacity)
        self.capacity = capacity
        self.segments = [window.Shared_query(q)[0] for q in range(self.size)]

    def new_block(self, nbytes: int) -> SharedBlock:
        """Allocate a shared array's memory on every rank of the node (collective)."""
        window = self._allocate(max(_round(nbytes), ALIGN))
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
        if not poll([request], time.monotonic() + CLOSE_SECONDS):
            ABANDONED.append((self, request))  # kept mapped, never freed: a peer may still read
            return
        for window in self.windows:
            if FENCE:
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


def node_of(state, deadline: float | None = None, what: str = "allreduce") -> Node:
    """Return the node state of ``state``'s communicator, made on first use (collective)."""
    private = state.private
    found = private.Get_attr(KEYVAL)
    if found is None:
        if deadline is not None:
            meet(private, deadline, state.fail,
                 f"{what} on rank {private.Get_rank()}: setting up shared memory")
        found = Node(private, state)
        private.Set_attr(KEYVAL, found)
        if found.size == private.Get_size():
            state.checker.Set_attr(CHECK_KEYVAL, found)
    return found


# -- shared arrays ------------------------------------------------------------------------------


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
        if FENCE:
            self.window.Unlock_all()
        self.window.Free()


class SharedArray(np.ndarray):
    """A NumPy array in a node's shared window (:func:`shared_empty`); ``free()`` releases it.

    ``mpiallreduce`` reads peers' shared arrays directly: no copy in or out. Free it (or leave
    the ``with`` block) on every rank together, once no plan uses it; do not touch it (or views
    of it) afterwards.
    """

    _block: SharedBlock | None = None

    def __array_finalize__(self, obj):
        self._block = getattr(obj, "_block", None)

    def free(self) -> None:
        """Release the array's memory on every rank (collective)."""
        if self._block is not None:
            self._block.free()

    @property
    def freed(self) -> bool:
        return self._block is None or self._block.freed

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.free()


def shared_empty(shape, dtype=float, comm=None, order: str = "C") -> SharedArray:
    """Return an uninitialised array in the node's shared memory (collective on ``comm``).

    Pass it to :func:`mpiallreduce.allreduce` (``algorithm="shm"`` or ``auto``) on a one-node
    communicator and the ranks reduce straight from each other's arrays. Same shape and dtype
    on every rank. Free it with ``free()`` or a ``with`` block, or with the communicator.
    """
    from ._checks import check_comm
    from ._state import state as comm_state

    comm = MPI.COMM_WORLD if comm is None else comm
    check_comm(comm)
    dtype = np.dtype(dtype)
    if dtype not in DTYPES:
        raise TypeError(f"dtype {dtype} has no predefined MPI datatype here; use one of "
                        f"{', '.join(d.name for d in DTYPES)}")
    if order not in ("C", "F"):
        raise ValueError(f"order must be 'C' or 'F', got {order!r}")
    shape = tuple(int(n) for n in np.atleast_1d(shape)) if np.ndim(shape) else (int(shape),)
    if any(n < 0 for n in shape):
        raise ValueError(f"negative dimensions are not allowed: {shape}")
    state = comm_state(comm, None, "shared_empty")
    state.refuse_if_broken("shared_empty")
    node = node_of(state, None, "shared_empty")
    count = int(np.prod(shape, dtype=np.int64))
    memory = node.new_block(count * dtype.itemsize)
    array = np.ndarray(shape, dtype=dtype, buffer=memory.segments[node.rank],
                       order=order).view(SharedArray)
    array._block = memory
    return array


def shared_zeros(shape, dtype=float, comm=None, order: str = "C") -> SharedArray:
    """As :func:`shared_empty`, filled with zeros."""
    array = shared_empty(shape, dtype, comm, order)
    array.fill(0)
    return array


def _placement(array: np.ndarray | None, node: Node) -> SharedBlock | None:
    memory = getattr(array, "_block", None)
    if memory is None or memory.node is not node:
        return None
    return memory


# -- the plan ---------------------------------------------------------------------------------------


class ShmPlan(_PlanBase):
    """An allreduce over the node's shared memory, bound once; ``run()`` repeats it.

    Looks like :class:`~mpiallreduce.executor.Plan` to everything above it. Build with
    :func:`build` (through ``mpiallreduce.plan``/``allreduce`` with ``algorithm="shm"``).
    """

    algorithm = "shm"
    #: the small regime's bound run with a timeout (see _bind_direct); None elsewhere
    _timed = None
    #: one float64 SUM/AVG added up exactly (``exact=True``, reproducible sums)
    _exact = False
    #: its node holds every rank of the communicator, so the signatures its runs compare
    #: (the agreement's fields folded in) check the whole call (``_plans.fused``)
    whole = True
    #: ``phase(kind, index, calls)``: the calls of one phase as the plan binds them (as they
    #: are; bound while tracing, the tracer's :class:`~.tracing.Marks`: see :meth:`_trace`)
    _phase = staticmethod(_untraced)

    def __init__(self, node: Node | None, call, *, plan_id: int, timeout, state,
                 agreement=None, disagree=None, exact: bool = False):
        super().__init__(state.private, call.send, call.recv, call.reducer, timeout=timeout,
                         state=state)
        self._node = node
        self._exact = exact
        self._label = "shm allreduce"
        # the argument-check fields of this call's runs without and with a timeout, and what
        # raises the agreement's message on every rank from them (see _mismatch)
        self._agreement = agreement
        self._disagree = disagree
        red = call.reducer
        result = self._result
        count, dtype = result.size, result.dtype
        source = flat(call.send) if call.send is not None else result
        self._scratch = np.empty(0, dtype=dtype)
        self._local = ()
        for array in (call.send, call.recv):  # a shared array may not be freed under a plan
            memory = getattr(array, "_block", None)
            if memory is not None:
                if memory.freed:
                    raise ValueError("a buffer of this call is a shared array that has been freed")
                memory.users.add(self)
        if node is None or count == 0:  # one rank (or nothing): a local copy (and AVG's divide)
            phase = self._trace("local")
            copy = (partial(np.copyto, result, source),) if call.send is not None and count else ()
            divide = ((partial(np.divide, result, self._nranks, result),)
                      if self._average and count else ())
            self._local = (*phase("run", None, ()), *phase("copy out", None, copy),
                           *phase("reduce", None, divide), *phase("end", None, ()))
            return
        p, rank = node.size, node.rank
        send_block = _placement(call.send, node) if call.send is not None else None
        recv_block = _placement(call.recv, node)
        send_at = send_block.offset(source) if send_block is not None else None
        recv_at = recv_block.offset(result) if recv_block is not None else None
        if send_at is None:
            send_block = None
        if recv_at is None:
            recv_block = None
        fields = [count, DTYPES.index(dtype), red.index, plan_id,
                  -1 if send_block is None else send_block.ident,
                  -1 if send_at is None else send_at,
                  -1 if recv_block is None else recv_block.ident,
                  -1 if recv_at is None else recv_at]
        # (area words, digest) of a run without and with a timeout: the argument-check fields
        # folded in as one digest word, so comparing the digest compares them too
        signed = []
        for checked in agreement or ((), ()):
            words = signature_words(KIND_DATA, fields + [digest(KIND_CHECK, checked)])
            signed.append((memoryview(np.array(words, dtype=np.int64)).cast("B").cast("q"),
                           words[1]))
        self._signed = tuple(signed)
        self._peer_digests = tuple(tuple((node.headers[q], lo + 1) for q in node.peers)
                                   for lo, _ in node.areas)
        self._segments = node.segments
        nbytes = result.nbytes
        small = nbytes <= small_bytes(p, send_block is not None or recv_block is not None)
        if red.ufunc is None and recv_block is not None and not small:
            lo, hi = block(count, p, rank)
            self._scratch = np.empty(hi - lo, dtype=dtype)
        input_block, input_at = ((recv_block, recv_at) if call.send is None
                                 else (send_block, send_at))
        if small:  # (traced: its load and reduce calls hold the run's clock readings)
            self._trace("small")
            self._run = self._run_small
            self._programs = tuple(self._bind_small(parity, source) for parity in (0, 1))
            self.direct, self._timed = self._bind_direct()
            return
        if recv_block is None:
            # a private result: through the slots, a chunk at a time
            self._trace("chunked", "chunk")
            self._run = self._run_chunks
            self._programs = tuple(self._bind_chunks(parity, source, input_block, input_at)
                                   for parity in (0, 1))
        else:
            self._trace("shared")
            self._run = self._run_large
            self._programs = tuple(
                self._bind_large(parity, source, input_block, input_at, recv_block, recv_at)
                for parity in (0, 1))
        if self.traced:  # the run's ends and its waits are methods: stamped around them
            marks = self._phase
            chunked = recv_block is None
            self._run = marks.around(self._run)
            self._arrive = marks.before("wait", self._arrive, 0 if chunked else None)
            if chunked:
                self._chunk_wait = marks.before("wait", self._chunk_wait, argument=4)

    def _trace(self, regime: str, unit: str | None = None):
        """Bind this plan's phases traced where a trace is on (:data:`.executor.TRACER`, see
        :mod:`.tracing`), so that an untraced plan's runs never look; return the phase hook."""
        tracer = executor.TRACER
        if tracer is not None:
            self._phase = tracer.marks(self, "shm", regime, unit)
        return self._phase

    @property
    def nbytes(self) -> int:
        """Bytes of private scratch this plan holds (the windows belong to the communicator)."""
        return self._scratch.nbytes

    # -- binding ----------------------------------------------------------------------------

    def _slots(self, parity: int) -> list[np.ndarray]:
        """Every rank's slot of this parity, flat views of the data window."""
        result = self._result
        half = self._node.capacity // 2
        return [np.frombuffer(segment, dtype=result.dtype, count=result.size,
                              offset=parity * half)
                for segment in self._segments]

    def _reduce_into(self, out: np.ndarray, operands: list[np.ndarray]) -> list:
        """Calls that set ``out = operands[0] ∘ operands[1] ∘ …`` (rank order kept).

        ``out`` may be one of the operands only if it is the first (ufunc ops) .
        """
        red = self.reducer
        if red.ufunc is not None:
            bind = red._into
            calls = [bind(operands[0], operands[1], out)]
            calls += [bind(out, operand, out) for operand in operands[2:]]
            return calls
        # Reduce_local(a, b) sets b = a ∘ b: fold from the right, a copy of the last first
        reduce_local = red.mpi_op.Reduce_local
        calls = [partial(np.copyto, out, operands[-1])]
        calls += [partial(reduce_local, operand, out) for operand in reversed(operands[:-1])]
        return calls

    def _bind_small(self, parity: int, source: np.ndarray) -> tuple:
        """(load, reduce) of the small regime for one parity: single calls. Bound while
        tracing, they hold every clock reading of the run too (the closures of
        :meth:`_bind_direct`, which the call cache runs, have no other place for them)."""
        slots = self._slots(parity)
        rank = self._node.rank
        own = memoryview(slots[rank]).cast("B")
        phase = self._phase
        load = [*phase("run", None, ()),
                *phase("arrive", None, [partial(own.__setitem__, slice(None),
                                                memoryview(source).cast("B"))]),
                *phase("wait", None, ())]
        scalar = self._scalar(slots)
        reduce = [scalar] if scalar else self._reduce_into(self._result, slots)
        if self._average and not scalar:
            reduce.append(partial(np.divide, self._result, self._nranks, self._result))
        reduce = [*phase("reduce", None, reduce), *phase("end", None, ())]
        return _single(load), _single(reduce)

    def _scalar(self, slots: list[np.ndarray]):
        """One float64 summed or multiplied: Python floats (IEEE doubles, the same bits as the
        ufunc, in rank order) through memoryviews, without NumPy's per-call cost; else None."""
        red, result = self.reducer, self._result
        if result.size != 1 or result.dtype != np.float64 or red.name not in ("SUM", "AVG",
                                                                                "PROD"):
            return None
        out = memoryview(result).cast("B").cast("d")
        first, *rest = views = [memoryview(slot).cast("B").cast("d") for slot in slots]
        divisor = float(self._nranks) if self._average else None
        if self._exact:  # the correctly rounded sum, whatever the order (reproducible sums)
            def reduce():
                total = exact_sum([view[0] for view in views])
                out[0] = total if divisor is None else total / divisor
        elif red.name == "PROD":
            def reduce():
                total = first[0]
                for view in rest:
                    total *= view[0]
                out[0] = total
        elif divisor is None and len(rest) == 1:
            second = rest[0]

            def reduce():
                out[0] = first[0] + second[0]
        else:
            def reduce():
                total = first[0]
                for view in rest:
                    total += view[0]
                out[0] = total if divisor is None else total / divisor
        return reduce

    def _bind_chunks(self, parity: int, source: np.ndarray, input_block, input_at) -> tuple:
        """Calls of the large regime on a private result for one parity, chunk by chunk:
        a tuple of (load, reduce, pull) per chunk.

        The parity's slot holds two chunk buffers; chunk ``c`` goes through buffer ``c % 2``.
        load: the peers' blocks (``partition.block``) of this rank's input of the chunk into
        its buffer (none where the input is a shared array: the peers read it in place);
        reduce: this rank's block of the chunk across every rank's input in rank order (its
        own read where it is) into its buffer, then into the result; pull: the other blocks
        of the chunk out of the peers' buffers.
        Only a chunk's worth of slot memory is touched between waits, so it stays in the
        caches: the message itself is read once and the result written once.
        """
        node, result = self._node, self._result
        rank, p, count, dtype = node.rank, node.size, result.size, result.dtype
        per = max(1, chunk_bytes(result.nbytes) // dtype.itemsize)  # elements per chunk
        stride = _round(per * dtype.itemsize)
        base = parity * (node.capacity // 2)
        peer_inputs = (input_block.peers(input_at, dtype, count) if input_block is not None
                       else None)
        # every rank's two chunk buffers, as long as their longest chunk (the slot holds no
        # more: a message of under two chunks has a slot of its own size); chunks slice them
        buffers = [[np.frombuffer(segment, dtype=dtype, count=min(per, count - j * per),
                                  offset=base + j * stride) for segment in self._segments]
                   for j in range(1 if count <= per else 2)]
        chunks = []
        for c, start in enumerate(range(0, count, per)):
            stop = min(start + per, count)
            size = stop - start
            slots = [buffer[:size] for buffer in buffers[c % 2]]
            lo, hi = block(size, p, rank)
            load = ()
            if peer_inputs is None:
                # the peers' blocks of our input (our own block is read where it is)
                load = tuple(partial(np.copyto, slots[rank][a:b], source[start + a:start + b])
                             for a, b in ((0, lo), (hi, size)) if b > a)
                operands = [slot[lo:hi] for slot in slots]
                operands[rank] = source[start + lo:start + hi]
            else:
                operands = [array[start + lo:start + hi] for array in peer_inputs]
            load = tuple(self._phase("arrive", c, load))
            reduce, copy = [], []
            if hi > lo:
                # into our buffer first (never an operand, so rank order holds in place too),
                # then into the result
                mine = slots[rank][lo:hi]
                reduce += self._reduce_into(mine, operands)
                if self._average:
                    reduce.append(partial(np.divide, mine, self._nranks, mine))
                copy.append(partial(np.copyto, result[start + lo:start + hi], mine))
            pull = []
            for q in range(p):
                first, last = block(size, p, q)
                if q != rank and last > first:
                    pull.append(partial(np.copyto, result[start + first:start + last],
                                        slots[q][first:last]))
            phase = self._phase
            chunks.append((load, (*phase("reduce", c, reduce), *phase("copy out", c, copy)),
                           tuple(phase("copy out", c, pull))))
        return tuple(chunks)

    def _bind_large(self, parity: int, source: np.ndarray, input_block, input_at, recv_block,
                    recv_at) -> tuple:
        """Calls of the large regime on a shared result for one parity: (load, reduce).

        load: a private input into this rank's own shared result before "arrived"; reduce:
        this rank's block across all inputs, written into every rank's result (complete once
        every rank published "done": nothing to copy out). The slots are not used (a private
        result goes through :meth:`_bind_chunks`).
        """
        node, result = self._node, self._result
        rank, p, count, dtype = node.rank, node.size, result.size, result.dtype
        lo, hi = block(count, p, rank)
        load, reduce = [], []
        if input_block is not None:
            inputs = input_block.peers(input_at, dtype, count)
        else:
            # a private input into a shared result: copy it into our own shared result, then
            # reduce from the peers' results
            inputs = recv_block.peers(recv_at, dtype, count)
            load.append(partial(np.copyto, inputs[rank], source))
        mine = [operand[lo:hi] for operand in inputs]
        # the result is a shared array: write our block into every rank's array
        outputs = recv_block.peers(recv_at, dtype, count)
        target = outputs[rank][lo:hi]
        aliased = input_block is None or (input_block is recv_block and input_at == recv_at)
        if aliased and self.reducer.ufunc is not None:
            # our block of our own array first, the others fold into it: any order is
            # exact enough for the commutative ufunc ops, and one rank computes each block
            reduce += self._reduce_into(target, [mine[rank]] + mine[:rank] + mine[rank + 1:])
        elif aliased:
            # a user op keeps rank order: fold into scratch, not into an operand
            reduce += self._reduce_into(self._scratch, mine)
            reduce.append(partial(np.copyto, target, self._scratch))
        else:
            reduce += self._reduce_into(target, mine)
        if self._average:
            reduce.append(partial(np.divide, target, self._nranks, target))
        copy = [partial(np.copyto, outputs[q][lo:hi], target) for q in range(p) if q != rank]
        phase = self._phase
        return (tuple(phase("arrive", None, load)),
                (*phase("reduce", None, reduce), *phase("copy out", None, copy)))

    # -- running --------------------------------------------------------------------------------

    def run(self, timeout: float | None = None) -> np.ndarray:
        """Run the allreduce once and return the result buffer.

        Args:
            timeout: seconds to wait for the peers (default: the plan's). When they pass, raise
                :class:`CollectiveTimeout` naming the missing ranks; the plan and its
                communicator are unusable afterwards.
        """
        state = self._state
        bound = False  # the small regime's bound closures, checked here (1.3 us less at 8 B)
        if not self._freed and not self._broken and not state.broken:
            if timeout is None:
                timeout = self.timeout
            bound = timeout is None or (self._timed is not None
                                        and type(timeout) in (int, float) and timeout > 0)
        deadline = None
        if not bound:
            timeout, deadline = self._start(timeout)
        node = self._node
        if node is None:
            for call in self._local:
                call()
            return self.recvbuf
        if node.closed:
            raise ValueError("the communicator of this plan has been freed")
        if not bound:
            self._epoch(node, timeout, deadline)
        elif timeout is None:
            self.direct()
        else:
            self._timed(timeout)
        return self.recvbuf

    __call__ = run

    def _epoch(self, node: Node, timeout, deadline) -> None:
        """Claim the next epoch, run it (after every earlier one), and mark it finished."""
        epoch = node.claim()
        try:
            if node.finished != epoch - 1:
                node.turn(epoch, deadline, self._label)
            self._run(node, epoch, timeout, deadline)
        finally:
            node.finished = epoch
            if node.waiting:
                node.finish(epoch)

    def direct(self) -> None:
        """Run once without deadline and without the checks of :meth:`run`: for the call
        cache, which drops its entries before their plans are freed, their shared arrays freed
        or their communicator broken or freed (the one-shot hot path, ``check=True`` or not).
        The small regime replaces it with :meth:`_bind_direct`'s closure."""
        self._epoch(self._node, None, None)

    def _bind_direct(self):
        """:meth:`direct` of the small regime as closures over the bound state: the
        :meth:`_run_small` of a run without timeout and of one with, written out with locals
        instead of attribute reads (each shows at 8 bytes). Returns (untimed, timed); the
        timed one takes the run's timeout (checked by :meth:`run`)."""
        node = self._node
        header, peers, sync, written, areas = (node.header, node.peer_headers, node.sync,
                                               node.written, node.areas)
        arrive, mismatch, label = self._arrive, self._mismatch, self._label
        monotonic = time.monotonic

        def make(timed: bool):
            words, mine = self._signed[timed]
            programs = tuple((load, reduce, digests, parity, node.signatures[parity])
                             for (load, reduce), digests, parity
                             in zip(self._programs, self._peer_digests, (0, 1)))

            def direct(timeout=None) -> None:
                deadline = None if timeout is None else monotonic() + timeout
                epoch = node.epoch + 1
                node.epoch = epoch
                try:
                    if node.finished != epoch - 1:
                        node.turn(epoch, deadline, label)
                    load, reduce, digests, parity, signatures = programs[epoch & 1]
                    load()
                    if written[parity] is not words:
                        lo, hi = areas[parity]
                        header[lo:hi] = words
                        written[parity] = words
                    if sync is not None:
                        sync()
                    header[0] = 2 * epoch
                    target = 2 * epoch - 1
                    for peer in peers:
                        if peer[0] < target:
                            arrive(node, epoch, 2 * epoch, timeout, deadline, 0)
                            break
                    else:
                        if sync is not None:
                            sync()
                        for theirs, word in digests:
                            if theirs[word] != mine:
                                mismatch(signatures, timeout)
                    reduce()
                finally:
                    node.finished = epoch
                    if node.waiting:
                        node.finish(epoch)
            return direct
        return make(False), make(True)

    def _arrive(self, node: Node, epoch: int, value: int, timeout, deadline, step: int) -> None:
        """Publish ``value``, wait until every peer published ``2 * epoch - 1 + step``, and
        (step 0) compare the signatures (those of a run with or without ``timeout``)."""
        node.publish(value)
        target = 2 * epoch - 1 + step
        for peer in node.peer_headers:
            if peer[0] < target:
                missing = node.wait(target, deadline)
                if missing is not None:
                    self.fail(f"{self._label} on rank {node.rank}: no answer from rank(s) "
                               f"{', '.join(map(str, missing))} in step {step} within "
                               f"{timeout:g} s (a rank did not make this call, or ranks run "
                               f"plans or calls on this communicator in different orders)")
                break
        else:
            if node.sync is not None:
                node.sync()
        if step == 0:
            parity = epoch & 1
            mine = self._signed[timeout is not None][1]
            for header, word in self._peer_digests[parity]:
                if header[word] != mine:
                    self._mismatch(node.signatures[parity], timeout)

    def _sign(self, node: Node, parity: int, timeout) -> None:
        """Write this plan's signature (of a run with or without ``timeout``) into the area of
        ``parity``, unless it holds it already (the same run two epochs ago)."""
        words = self._signed[timeout is not None][0]
        if node.written[parity] is not words:
            lo, hi = node.areas[parity]
            node.header[lo:hi] = words
            node.written[parity] = words

    def _run_small(self, node: Node, epoch: int, timeout, deadline) -> None:
        parity = epoch & 1
        load, reduce = self._programs[parity]
        load()
        words, mine = self._signed[timeout is not None]
        if node.written[parity] is not words:
            self._sign(node, parity, timeout)
        # _arrive, written out: this path is what an 8-byte call costs
        if node.sync is not None:
            node.sync()
        node.header[0] = 2 * epoch
        target = 2 * epoch - 1
        for peer in node.peer_headers:
            if peer[0] < target:
                self._arrive(node, epoch, 2 * epoch, timeout, deadline, 0)
                break
        else:
            if node.sync is not None:
                node.sync()
            for header, word in self._peer_digests[parity]:
                if header[word] != mine:
                    self._mismatch(node.signatures[parity], timeout)
        reduce()

    def _run_large(self, node: Node, epoch: int, timeout, deadline) -> None:
        parity = epoch & 1
        load, reduce = self._programs[parity]
        for call in load:
            call()
        self._sign(node, parity, timeout)
        self._arrive(node, epoch, 2 * epoch - 1, timeout, deadline, 0)
        for call in reduce:
            call()
        # every rank's result is complete once every rank wrote its block into it
        self._arrive(node, epoch, 2 * epoch, timeout, deadline, 1)

    def _run_chunks(self, node: Node, epoch: int, timeout, deadline) -> None:
        """The chunked large regime (:meth:`_bind_chunks`). The first chunk's input, with the
        signature, publishes the counter ``2e - 1`` (the step that compares signatures); then
        per chunk ``c`` the step word says "reduced c" (``2c + 1``) and "loaded c + 1"
        (``2c + 2``) above ``e << STEP_SHIFT``. Chunk ``c + 1`` reuses the buffer of chunk
        ``c - 1``, free once every peer loaded chunk ``c`` (which it does after pulling
        ``c - 1``); the epoch's first chunk, as every call, takes the parity slot that every
        peer finished reading when it started the previous epoch."""
        parity = epoch & 1
        chunks = self._programs[parity]
        header, sync = node.header, node.sync
        base = epoch << STEP_SHIFT
        last = len(chunks) - 1
        for call in chunks[0][0]:
            call()
        self._sign(node, parity, timeout)
        self._arrive(node, epoch, 2 * epoch - 1, timeout, deadline, 0)
        for c, (_, reduce, pull) in enumerate(chunks):
            if c:
                self._chunk_wait(node, base + 2 * c, timeout, deadline, c, "load")
            for call in reduce:
                call()
            if sync is not None:
                sync()
            header[STEP_WORD] = base + 2 * c + 1
            if c == last:
                header[0] = 2 * epoch
            self._chunk_wait(node, base + 2 * c + 1, timeout, deadline, c, "reduce")
            for call in pull:
                call()
            if c < last:
                for call in chunks[c + 1][0]:
                    call()
                if sync is not None:
                    sync()
                header[STEP_WORD] = base + 2 * c + 2

    def _chunk_wait(self, node: Node, target: int, timeout, deadline, chunk: int,
                    what: str) -> None:
        """Wait until every peer's step word reaches ``target`` (chunk steps of the large
        regime); a deadline that passes names the missing ranks."""
        for peer in node.peer_steps:
            if peer[0] < target:
                missing = node.wait(target, deadline, (node.peers, node.peer_steps))
                if missing is not None:
                    self.fail(f"{self._label} on rank {node.rank}: no answer from rank(s) "
                              f"{', '.join(map(str, missing))} at the {what} of chunk {chunk} "
                              f"within {timeout:g} s (a rank stopped in the middle of this "
                              f"call)")
                return
        if node.sync is not None:
            node.sync()

    def _mismatch(self, signatures, timeout) -> None:
        """Raise the same ValueError on every rank: the peers' signatures differ from ours.

        Every rank reads the same table, so every rank takes the same branch: where the ranks
        run the same plan on the same memory (a difference in the arguments) or some rank
        checks the arguments of a call here (:meth:`Node.agree`), all of them exchange their
        argument-check fields (the agreement's message, naming the field); where plans or
        shared-array placement differ, the table names them without a message.
        """
        table = [list(theirs) for theirs in signatures]
        data = all(fields[0] == KIND_DATA for fields in table)
        placed = all(len({fields[column] for fields in table}) == 1 for column in PLACEMENT)
        if self._disagree is not None and (not data or placed):
            self._disagree(self._agreement[timeout is not None])
        if not data:
            raise ValueError("shm allreduce: some ranks run this call while others check the "
                             "arguments of another (plans and calls in different orders)")
        problems = []
        for column, name in enumerate(DATA_FIELDS, start=2):
            values: dict = {}
            for rank, fields in enumerate(table):
                values.setdefault(fields[column], []).append(rank)
            if len(values) > 1:
                problems.append(f"{name} differs: " + "; ".join(
                    f"{_describe(name, value)} on rank{'s' if len(ranks) > 1 else ''} "
                    f"{', '.join(map(str, ranks))}" for value, ranks in values.items()))
        if not problems:  # only the digest of what else the call is differs
            problems.append("the algorithm or its parameters differ")
        raise ValueError("shm allreduce: ranks run different calls (arguments, or plans and "
                         "calls in different orders): " + "; ".join(problems))


def _call_each(calls: tuple) -> None:
    for call in calls:
        call()


def _single(calls: list):
    """One argument-free call that makes ``calls``: the call itself where there is one."""
    return calls[0] if len(calls) == 1 else partial(_call_each, tuple(calls))


def _describe(name: str, value: int) -> str:
    if name == "dtype" and 0 <= value < len(DTYPES):
        return DTYPES[value].name
    if name == "op":
        from .ops import OP_NAMES
        return {-1: "a commutative user op", -2: "a non-commutative user op"}.get(
            value, OP_NAMES[value] if 0 <= value < len(OP_NAMES) else str(value))
    if name == "plan":
        return "a one-shot call" if value == 0 else f"plan #{value}"
    if name.startswith("shared"):
        return "a private array" if value == -1 else f"shared array #{value}"
    return str(value)


def build(call, state, *, topology, plan_id: int, timeout, deadline, what: str,
          agreement=None, disagree=None, exact: bool = False) -> ShmPlan:
    """Bind an shm plan for ``call`` on a one-node communicator.

    Raises ValueError (on every rank alike: the topology is agreed) when the communicator spans
    several nodes. The window is made or grown here, from the call's agreed count and dtype.
    ``agreement``: the argument-check fields of a run without and with a timeout, folded into
    every run's signature; ``disagree(fields)`` raises the agreement's message on every rank.
    ``exact``: a one-float64 SUM or AVG of several ranks, added up exactly (``ops.exact_sum``).
    """
    private = state.private
    nranks = private.Get_size()
    if nranks == 1:
        return ShmPlan(None, call, plan_id=plan_id, timeout=timeout, state=state)
    if topology is not None and topology.nnodes > 1:
        raise ValueError(f"algorithm 'shm' needs every rank on one node, but the communicator "
                         f"spans {topology.nnodes} nodes ({topology!r}); use 'hierarchical' or "
                         f"'cascade' across nodes")
    if call.recv.size == 0:
        return ShmPlan(None, call, plan_id=plan_id, timeout=timeout, state=state)
    node = node_of(state, deadline, what)
    if node.size != nranks:
        raise ValueError(f"algorithm 'shm' needs every rank on one node, but only {node.size} "
                         f"of {nranks} ranks share this one; use 'hierarchical' or 'cascade'")
    node.reserve(slot_bytes(call.recv.nbytes), deadline, what)
    if exact and (call.recv.size != 1 or call.recv.dtype != np.float64
                  or call.reducer.name not in ("SUM", "AVG")):
        raise ValueError("an exact shm plan sums one float64")
    return ShmPlan(node, call, plan_id=plan_id, timeout=timeout, state=state,
                   agreement=agreement, disagree=disagree, exact=exact)


def fits(call, state) -> bool:
    """Would :func:`build` bind ``call`` without a collective (the node exists, its window is
    large enough, the buffers are live), given that it runs ``shm`` on this communicator?"""
    node = state.private.Get_attr(KEYVAL)
    if call.recv.size == 0 or node is None or node.closed or node.size == 1 \
            or node.size != state.private.Get_size():
        return False
    if 2 * _round(slot_bytes(call.recv.nbytes)) > node.capacity:
        return False
    return not any(getattr(array, "_block", None) is not None and array._block.freed
                   for array in (call.send, call.recv))
