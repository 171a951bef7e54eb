"""The shm plan: what every regime shares (placement, signatures, the epoch, arrive, the
mismatch report, the run), and the local plan of one rank or an empty message.

A plan's regime is a subclass (:mod:`.small`, :mod:`.large`), chosen from the agreed count,
dtype and placement by :func:`.regimes.regime_of`: each binds its programs (per parity slot)
and defines ``_run(node, epoch, timeout, deadline)``.
"""

from __future__ import annotations

from functools import partial

import numpy as np

from .. import _hooks
from ..errors import raised_alike
from ..executor import _PlanBase, _untraced, flat
from ..ops import DTYPES, exact_sum
from . import protocol
from .arrays import placement
from .node import Node
from .protocol import (
    DATA_FIELDS,
    KIND_CHECK,
    KIND_DATA,
    PLACEMENT,
    Stalled,
    differs,
    digest,
    signature_words,
    small_bytes,
)

#: bytes from which :func:`copy_call` copies with NumPy's byte loop where memcpy would be slow.
LOOP_COPY_BYTES = 4096
#: distances (target less source, modulo 4096) at which memcpy is slow: 1 up to this, excluded.
TRAPPED_DISTANCE = 64


def copy_call(target: np.ndarray, source: np.ndarray, distance: int | None = None):
    """A bound call that copies ``source`` into ``target`` (contiguous, the same number of
    bytes, never overlapping): the one copy between a slot or shared array and a rank's array.

    glibc's memcpy (``rep movsb`` from a few KiB up to the L2 size) runs several times slower
    on AMD Zen 3 where the target lies 1-31 bytes past the source modulo 4096 (a false
    dependency of each load on the store before it; glibc bug 30994; 40-56 bytes past are slow
    here too, less so: hence :data:`TRAPPED_DISTANCE`). A slot sits
    at a page offset of the window's, a NumPy array where malloc put it (16 bytes past a page
    for a large one, anywhere for one from the heap): copying a slot out into such an array, or
    an input ending just before a page into a slot, hit it, in some runs and not others. There
    (from :data:`LOOP_COPY_BYTES`, target 1 to :data:`TRAPPED_DISTANCE` - 1 bytes past the
    source modulo 4096), the copy is NumPy's identity loop over the bytes (``np.positive`` on
    uint8, the same bits), as fast as the good case; elsewhere memcpy (a byte memoryview's
    slice assignment), whose stores into lines another core has just read beat the loop's
    (32 KiB into the small regime's slot, at 2 ranks, copies faster with memcpy).

    ``distance``: the target's address less the source's, where the caller knows it (reading
    two arrays' addresses is most of what a call of this costs, a few thousand times per
    binding of a 64 MiB chunked plan).
    """
    target, source = target.view(np.uint8), source.view(np.uint8)
    if target.nbytes >= LOOP_COPY_BYTES and (
            trapped(target, source) if distance is None else in_band(distance)):
        return partial(np.positive, source, target)
    return partial(memoryview(target).__setitem__, slice(None), memoryview(source))


def trapped(target: np.ndarray, source: np.ndarray) -> bool:
    """Whether memcpy from ``source`` to ``target`` falls in :func:`copy_call`'s slow band."""
    return in_band(target.ctypes.data - source.ctypes.data)


def in_band(distance: int) -> bool:
    """Whether a target ``distance`` bytes past its source lies in memcpy's slow band."""
    return 0 < distance % 4096 < TRAPPED_DISTANCE


def placed(node: Node, call, source: np.ndarray, result: np.ndarray) -> tuple:
    """(send block, its offset, recv block, its offset) of ``call`` on ``node``: the shared
    arrays its buffers lie in, None (both) where a buffer is private."""
    send_block = placement(call.send, node) if call.send is not None else None
    recv_block = placement(call.recv, node)
    send_at = send_block.offset(source) if send_block is not None else None
    recv_at = recv_block.offset(result) if recv_block is not None else None
    if send_at is None:
        send_block = None
    if recv_at is None:
        recv_block = None
    return send_block, send_at, recv_block, recv_at


def is_small(node: Node, nbytes: int, send_block, recv_block) -> bool:
    """Whether a call of ``nbytes`` per rank runs the small regime on ``node``."""
    return nbytes <= small_bytes(node.size, send_block is not None or recv_block is not None)


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
    #: whether the plan's node holds every rank of the communicator (True here; a node phase
    #: of :mod:`..shm_nodes` holds only some): the signatures its runs compare, the agreement's
    #: fields folded in, then check the whole call, so it needs no separate argument check
    #: (``_plans.fused``)
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
            copy = (copy_call(result, source),) if call.send is not None and count else ()
            divide = ((partial(np.divide, result, self._nranks, result),)
                      if self._average and count else ())
            self._local = (*phase("run", None, ()), *phase("copy out", None, copy),
                           *phase("reduce", None, divide), *phase("end", None, ()))
            return
        send_block, send_at, recv_block, recv_at = placed(node, call, source, result)
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
        # the data window this plan is bound to, and its bytes per rank: a later, larger call
        # grows the node's window (a new one), and a regime that binds a parity at its first
        # run must still slice this one
        self._segments, self._capacity = node.segments, node.capacity
        input_block, input_at = ((recv_block, recv_at) if call.send is None
                                 else (send_block, send_at))
        self._bind(source, input_block, input_at, recv_block, recv_at)

    def _bind(self, source, input_block, input_at, recv_block, recv_at) -> None:
        """Bind the regime's programs (per parity) and its hooks: each regime's own."""
        raise NotImplementedError  # pragma: no cover - ShmPlan runs only locally

    def _trace(self, regime: str, unit: str | None = None):
        """Bind this plan's phases traced where a trace is on (:data:`._hooks.tracer`, see
        :mod:`.tracing`), so that an untraced plan's runs never look; return the phase hook."""
        tracer = _hooks.tracer
        if tracer is not None:
            self._phase = tracer.marks(self, "shm", regime, unit)
        stalls = protocol.STALLS  # the test hook (bound in, so a plan without it never looks)
        if stalls is not None and self._node is not None:
            stalls.bind(self._node.rank)
            self._phase = Stalled(self._phase, stalls)
        return self._phase

    @property
    def nbytes(self) -> int:
        """Bytes of private scratch this plan holds (the windows belong to the communicator)."""
        return self._scratch.nbytes

    # -- binding ----------------------------------------------------------------------------

    def _slots(self, parity: int) -> list[np.ndarray]:
        """Every rank's slot of this parity, flat views of the data window."""
        result = self._result
        half = self._capacity // 2
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
        calls = [copy_call(out, operands[-1])]
        calls += [partial(reduce_local, operand, out) for operand in reversed(operands[:-1])]
        return calls

    def _scalar(self, slots: list[np.ndarray]):
        """One float64 summed or multiplied: Python floats (IEEE doubles, the same bits as the
        ufunc, in rank order) through memoryviews, without NumPy's per-call cost; else None
        (the small regime's reduction, and a node phase's of :mod:`..shm_nodes`)."""
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

    # -- running --------------------------------------------------------------------------------

    def run(self, timeout: float | None = None) -> np.ndarray:
        """Run the allreduce once and return the result buffer.

        Args:
            timeout: seconds to wait for the peers (default: the plan's). When they pass, raise
                :class:`CollectiveTimeout` naming the missing ranks; the communicator is
                revoked then (:class:`CommunicatorRevoked` on every rank from then on).
        """
        state = self._state
        bound = False  # the small regime's bound closures, checked here (cheaper at 8 B)
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
        except BaseException as error:  # a run left in the middle revokes (.._revoke)
            node.give_up(error, self._label)
            raise
        finally:
            node.finished = epoch

    def direct(self) -> None:
        """Run once without deadline and without the checks of :meth:`run`: for the call
        cache, which drops its entries before their plans are freed, their shared arrays freed
        or their communicator broken or freed (the one-shot hot path, ``check=True`` or not).
        The small regime replaces it with a closure (:meth:`.small.SmallPlan._bind_direct`)."""
        self._epoch(self._node, None, None)

    def _arrive(self, node: Node, epoch: int, value: int, timeout, deadline, step: int) -> None:
        """Publish ``value``, wait until every peer published ``2 * epoch - 1 + step``, and
        (step 0) compare the signatures (those of a run with or without ``timeout``)."""
        node.publish(value)
        target = 2 * epoch - 1 + step
        for peer in node.peer_headers:
            if peer[0] < target:
                missing = node.wait(target, deadline, where=self._where())
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

    def _where(self) -> str:
        """``"<call> on rank r"``, as messages name this plan's runs."""
        return f"{self._label} on rank {self.comm.Get_rank()}"

    def _sign(self, node: Node, parity: int, timeout) -> None:
        """Write this plan's signature (of a run with or without ``timeout``) into the area of
        ``parity``, unless it holds it already (the same run two epochs ago)."""
        words = self._signed[timeout is not None][0]
        if node.written[parity] is not words:
            lo, hi = node.areas[parity]
            node.header[lo:hi] = words
            node.written[parity] = words

    def _mismatch(self, signatures, timeout) -> None:
        """Raise the same ValueError on every rank: the peers' signatures differ from ours.

        Every rank reads the same table, so every rank takes the same branch: where the ranks
        run the same plan on the same memory (a difference in the arguments) or some rank
        checks the arguments of a call here (:meth:`Node.agree`), all of them exchange their
        argument-check fields (the agreement's message, naming the field); where plans or
        shared-array placement differ, the table names them without a message. The call ends
        on every rank alike, so it revokes nothing (:func:`..errors.raised_alike`).
        """
        try:
            self._differences(signatures, timeout)
        except Exception as error:
            raised_alike(error)
            raise

    def _differences(self, signatures, timeout) -> None:
        """:meth:`_mismatch`'s exception, raised."""
        table = [list(theirs) for theirs in signatures]
        data = all(fields[0] == KIND_DATA for fields in table)
        same_memory = all(len({fields[column] for fields in table}) == 1
                          for column in PLACEMENT)
        if self._disagree is not None and (not data or same_memory):
            self._disagree(self._agreement[timeout is not None])
        if not data:
            raise ValueError("shm allreduce: some ranks run this call while others check the "
                             "arguments of another (plans and calls in different orders)")
        problems = [problem for problem in (differs(name, [fields[column] for fields in table])
                                            for column, name in enumerate(DATA_FIELDS, start=2))
                    if problem is not None]
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

