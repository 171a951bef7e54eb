"""Plan: a schedule bound once to buffers, scratch and a private communicator.

This is the only module that moves bytes (Send/Recv and their non-blocking and persistent forms).
Everything a run needs (buffer views, scratch, persistent requests) is made when the plan is
built, so :meth:`Plan.run` only starts requests, waits, and combines with NumPy ufuncs.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from functools import partial

import numpy as np
from mpi4py import MPI

from . import _form, _hooks
from ._binding import (  # noqa: F401 - flat and scratch_size are the package's names here too
    Layout,
    _BoundStep,
    _nonempty,
    _overlaps,
    _scratch_plan,
    _Written,
    flat,
    scratch_size,
)
from ._revoke import WatchedWait, ready_or_heard
from ._threads import guard_methods
from ._waiting import (  # noqa: F401 - as the package imports them from here
    BUSY_TESTS,
    MPI_CANNOT_SAY,
    SPIN_SECONDS,
    check_timeout,
    patience,
    poll,
    tested,
    unanswered,
    wait_or_fail,
    wait_until,
)
from .errors import CollectiveTimeout
from .ops import SCRATCH_COMBINE, Reducer
from .partition import segments
from .schedule import COPY, Step

#: tags per plan: a step's tag is ``tag_base + index % STEP_TAGS``. Each plan gets its own block
#: of tags (its *slot*, see :mod:`._state`), so the messages of two plans never match each other;
#: steps further apart than this share a tag, which is safe because a rank posts them in order.
STEP_TAGS = 4096

#: most elements in one MPI message. MPI-3 counts are C ints, and Open MPI 5.0 rejects larger
#: ones (MPI_ERR_ARG) even through mpi4py 4, so a longer range travels as several messages of
#: this size, posted in order in the same step (MPI's non-overtaking rule keeps them matched).
MAX_MESSAGE = 1 << 30

#: requests of a step that a run without deadline starts and waits one by one (more: Startall).
SINGLE_REQUESTS = 4

#: communicators of timed-out plans and of communicators freed after a timeout, deliberately
#: never freed: their abandoned messages would otherwise match a later communicator that reuses
#: their context id (MPICH reuses freed context ids at once).
ABANDONED: list = []

def _release(requests: list, owned_comm, broken: list) -> None:
    """Free persistent requests (and a communicator the plan owns) unless MPI is finalized.

    ``broken`` is non-empty once the plan timed out: its own communicator is then kept, never
    freed, so that a later communicator reusing its context id cannot match what it abandoned.
    """
    if MPI.Is_finalized():
        return
    for request in requests:
        if request != MPI.REQUEST_NULL:
            # a cancelled request after a timeout may refuse; nothing leaks
            with contextlib.suppress(MPI.Exception):
                request.Free()
    requests.clear()
    if owned_comm is not None and owned_comm != MPI.COMM_NULL:
        if broken:
            ABANDONED.append(owned_comm)
            return
        with contextlib.suppress(MPI.Exception):
            owned_comm.Free()


class _PlanBase:
    """What every plan shares: lifetime, timeouts, refusal after a timeout, ``with`` blocks.

    ``state`` is the communicator's :class:`~mpiallreduce._state.CommState` (or any object with
    ``broken`` and ``mark_broken``): once a collective on that communicator timed out, its
    messages may still be in flight, so every plan on it refuses to run.
    """

    algorithm: str
    #: bound while tracing (its runs record themselves: the call cache must run them, not a
    #: bare MPI call of its own)
    traced = False

    def __init__(self, comm: MPI.Intracomm, sendbuf, recvbuf: np.ndarray,
                 reducer: Reducer | None, *, timeout: float | None, state=None, owned_comm=None):
        self.comm = comm
        self.reducer = reducer
        self.timeout = timeout
        self.sendbuf = sendbuf
        self.recvbuf = recvbuf
        self._state = state
        self._result = flat(recvbuf)
        self._average = reducer is not None and reducer.average
        self._nranks = comm.Get_size()
        # the communicator's alarm (._revoke), which every wait of a run hears
        alarm = getattr(state, "alarm", None)
        self._alarm = alarm if self._nranks > 1 else None
        self._broken: str | None = None
        self._freed = False
        self._fast: tuple | None = None  # Plan: the run without deadline, flat (see _flatten)
        self._in_flight = None  # the Request of a run started and not yet completed
        self._request = None  # the Request of the last start()
        self._fast_held: tuple | None = None  # _fast while a run is in flight
        self._engine = None  # what progresses its started runs (set by .nonblocking)
        self._done = None  # a plan without steps: the complete Request of a start (.nonblocking)
        self._requests: list = []  # every persistent request, for free() and the finalizer
        # A plan dropped without free() still releases its requests (and its own communicator);
        # not at interpreter exit, where MPI may already be finalized.
        self._timed_out: list = []  # non-empty after a timeout (read by the finalizer)
        self._finalizer = weakref.finalize(self, _release, self._requests, owned_comm,
                                           self._timed_out)
        self._finalizer.atexit = False

    def _start(self, timeout: float | None) -> tuple[float | None, float | None]:
        """Refuse a freed, broken or running plan; return the run's timeout and its deadline."""
        if self._freed:
            raise ValueError("this plan has been freed")
        if self._in_flight is not None:
            self._refuse_in_flight("run() or start()")
        state = self._state
        if state is not None and state.broken:
            state.refuse_if_broken(self._where())
        if self._broken:
            raise ValueError(f"this plan is unusable after an earlier timeout: {self._broken}")
        if timeout is None:
            timeout = self.timeout
            if timeout is None:
                return None, None
        check_timeout(timeout)
        return timeout, time.monotonic() + timeout

    @staticmethod
    def _refuse_in_flight(what: str) -> None:
        raise ValueError(f"{what} on a plan with a run in flight (started and not yet "
                         f"completed); wait() for its request first")

    def _mark_in_flight(self, request) -> None:
        """Mark a started run in flight: run(), start() and free() refuse until it lands."""
        self._in_flight = request
        self._fast_held, self._fast = self._fast, None  # the inline fast path checks nothing

    def run_ended(self, ok: bool) -> None:
        """The started run completed (``ok``) or failed: the plan may run again."""
        self._in_flight = None
        if not self._freed and not self._broken:
            self._fast = self._fast_held
        self._fast_held = None

    def fail(self, reason: str, pending=(), keep=()) -> None:
        """Mark the plan unusable and revoke its communicator, then raise CollectiveTimeout
        (CommunicatorRevoked where another rank's alarm came first: it gave up first).

        ``pending`` are requests MPI cannot cancel (collective ones); the state keeps them.
        """
        self._broken = reason
        self._fast = None
        self._timed_out.append(reason)
        if self._state is not None:
            # the buffers stay alive: MPI may still complete what was abandoned
            with contextlib.suppress(CollectiveTimeout):
                self._state.fail(reason, list(pending), (self, *keep))
        raise CollectiveTimeout(f"{reason}; the plan is unusable now")

    def _where(self) -> str:
        """``"<call> on rank r"``, as messages name this plan's runs."""
        return f"{getattr(self, '_label', self.algorithm + ' allreduce')} on rank " \
               f"{self.comm.Get_rank()}"

    def gave_up(self, error: BaseException) -> None:
        """An exception left a run in the middle: the plan is unusable, and (unless every rank
        raised it alike) its communicator revoked (:mod:`._revoke`)."""
        self._broken = self._broken or f"{type(error).__name__}: {error}"
        self._fast = None
        self._timed_out.append(self._broken)
        if self._state is not None:
            self._state.give_up(error, self._where(), keep=(self,))

    def heard(self, requests=(), bound=None) -> None:
        """Another rank gave up (its alarm came) while this run waited for ``requests``:
        withdraw their receives, mark the plan, raise CommunicatorRevoked."""
        if bound is not None:
            for request in requests[:len(bound.recvs)]:
                if not request.Test():
                    request.Cancel()
                    request.Test()
        self._broken = "another rank gave up"
        self._fast = None
        self._timed_out.append(self._broken)
        state = self._state
        state.hear(state.revocation or state.alarm.heard, self._where(), list(requests),
                   (self,))

    def start(self, timeout: float | None = None):
        """Start a run without waiting for it; return its :class:`mpiallreduce.Request`.

        Until the request completes, ``run()``, ``start()`` and ``free()`` raise ValueError (see
        :func:`mpiallreduce.start`); ``wait()`` on the request, or on the plan, returns the result.
        """
        # (the starter is registered by .nonblocking, which owns progress: _hooks.set_starter)
        self._request = _hooks.starter(self, timeout)
        return self._request

    def wait(self, timeout: float | None = None) -> np.ndarray:
        """Wait for the run :meth:`start` began and return the result buffer."""
        if self._request is None:
            raise ValueError("wait() on a plan that was never started; call start() first")
        return self._request.wait(timeout)

    def free(self) -> None:
        """Release the plan's persistent requests (idempotent; refused while a run is in flight)."""
        if self._in_flight is not None:
            self._refuse_in_flight("free()")
        if not self._freed:
            self._freed = True
            self._fast = None
            self._finalizer()

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        guard_methods(cls, RUNS)  # below MPI_THREAD_MULTIPLE: refused from a second thread

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.free()

    def __repr__(self) -> str:
        op = self.reducer.name if self.reducer is not None else "none"
        return (f"<mpiallreduce.Plan {self.algorithm} count={self._result.size} "
                f"dtype={self._result.dtype} op={op} ranks={self._nranks}>")


#: the methods of every plan class that run MPI (:mod:`._threads` guards them)
RUNS = ("run", "__call__", "start", "wait")
guard_methods(_PlanBase, RUNS)


def _untraced(kind: str, index, group):
    """The phase hook of a plan bound without tracing: each group of calls as it is."""
    return group


class Plan(_PlanBase):
    """A collective bound to its buffers; ``run()`` repeats it without allocating.

    Build plans with :func:`mpiallreduce.plan`, not directly. A plan is collective: every rank
    builds it and runs it the same number of times, and plans on one communicator run in the
    same order on every rank. Its messages carry tags of its own slot (``tag_base``), so they
    never match another plan's. ``free()`` (or a ``with`` block) releases its persistent
    requests; the buffers stay the caller's.
    """

    def __init__(self, comm: MPI.Intracomm, steps: tuple[Step, ...], sendbuf: np.ndarray | None,
                 recvbuf: np.ndarray, reducer: Reducer | None, algorithm: str, *,
                 label: str | None = None, persistent: bool = True,
                 scratch: np.ndarray | None = None, timeout: float | None = None,
                 layout: Layout | None = None, state=None, tag_base: int = 0):
        """Bind ``steps`` to buffers.

        By default (allreduce) the schedule works in ``recvbuf`` and ``sendbuf`` is copied into it
        first; other collectives pass a :class:`Layout`. ``recvbuf`` is what ``run()`` returns
        (and divides by p for AVG). ``reducer`` may be ``None`` for collectives that only copy.
        ``label`` names the collective in timeout messages (default ``"<algorithm> allreduce"``).
        """
        super().__init__(comm, sendbuf, recvbuf, reducer, timeout=timeout, state=state)
        self.algorithm = algorithm
        self._label = label or f"{algorithm} allreduce"
        self._layout = layout or Layout.allreduce(recvbuf)
        tracer = _hooks.tracer  # (read once, at binding: an untraced plan never looks again)
        persistent = persistent or tracer is not None  # a traced run is one flat program
        self._phase = _untraced  # the tracer's hook when bound while tracing (see .tracing)
        self._stepwise: tuple | None = None  # steps()'s program, bound on first use
        self._lean: tuple | None = None  # lean_program's split of _fast, made on first use
        self._fast_timed = self._deadline = self._timeout = None  # a run with a deadline, flat
        self._persistent = persistent
        self._tag_base = tag_base
        self._waiters: dict = {}  # id(a step's requests) -> its wait (_waiter)
        # the last call of every run: the alarm heard once more (._revoke), before the result
        # is handed back
        self._heard = ((partial(state.check_alarm, self._where()),)
                       if self._alarm is not None else ())
        need, defer = _scratch_plan(steps)
        total = need * (2 if any(defer) else 1)
        if scratch is None or scratch.size < total or scratch.dtype != recvbuf.dtype:
            scratch = np.empty(total, dtype=recvbuf.dtype)
        self._scratch = scratch
        # Consecutive steps receive into alternate halves of the scratch when combines are
        # deferred, so a deferred combine never reads a buffer the next step is filling.
        # Out of place with no Layout, nothing is loaded first: the plan reads sendbuf until a
        # range of the result is written (see _Written).
        self._source = flat(sendbuf) if layout is None and sendbuf is not None else None
        written = _Written(self._source is None)
        bound_steps = [self._bind(index, step, (position % 2) * need if any(defer) else 0,
                                  defer[position], written)
                       for position, (index, step) in enumerate(_nonempty(steps))]
        self._bind_reductions(bound_steps)
        # per step: (before, requests or None to post afresh, combines, defer, the bound step)
        self._program = tuple((bound.before, bound.requests if persistent else None,
                               bound.combines, bound.defer, bound) for bound in bound_steps)
        count = self._result.size
        self._first = tuple(partial(np.copyto, destination, source)
                            for source, destination in self._layout.load)
        last = [partial(np.copyto, destination, source)
                for source, destination in self._layout.store]
        if self._source is not None:  # ranges no step wrote hold this rank's own data
            last += [partial(np.copyto, self._result[lo:hi], self._source[lo:hi])
                     for lo, hi in written.missing(count)]
        if self._average:
            last.append(partial(np.divide, self._result, self._nranks, self._result))
        self._last = tuple(last)
        if tracer is not None:  # tracing (.tracing): bound now, so an untraced run never looks
            self._fast = tracer.program(self, steps)
        else:  # (the timed program first: the untimed one's lean split stands)
            self._fast_timed = self._flatten(timed=True) if persistent else None
            self._fast = self._flatten() if persistent else None

    def _flatten(self, phase=None, timed: bool = False) -> tuple:
        """Return the whole run without a deadline as one flat tuple of argument-free calls.

        The same order as the stepwise loop in :meth:`run`: per step its copies, its requests
        started, the previous step's deferred combines, its requests waited, its combines. Up to
        :data:`SINGLE_REQUESTS` requests a step are started and waited one by one (cheaper than
        building the C array ``Startall``/``Waitall`` take from a list); waits run in reverse
        so the sends, posted last, are waited first.

        ``phase(kind, index, calls)`` (tracing, see :mod:`.tracing`) returns each group of
        calls with what records it: ``"run"``, ``"load"``, per step index ``"copy"``,
        ``"start"``, ``"wait"``, ``"combine"``, then ``"finish"`` and ``"end"``. ``timed``: each
        step's wait polls to the run's deadline instead (:meth:`_poll_step`; ``_fast_timed``).
        """
        if phase is None:
            phase = _untraced
        calls = [*phase("run", None, ()), *phase("load", None, self._first)]
        pending = ()
        startall, waitall = MPI.Prequest.Startall, MPI.Request.Waitall
        self._posted = None  # where the first step's requests have been started (see lean_program)
        self._first_requests = None  # what the first step waits on (see lean_program)
        for before, requests, combines, defer, bound in self._program:
            calls += phase("copy", bound.index, before)
            if requests is None:
                # not persistent: each run posts the step afresh with the tags of the run's
                # slot (_tag_base, see _post) into a list of its own, then waits for that list
                requests = []
                calls += phase("start", bound.index, [partial(self._post_into, requests, bound)])
                posted = True
            elif len(requests) <= SINGLE_REQUESTS:
                calls += phase("start", bound.index, [request.Start for request in requests])
                posted = False
            else:
                calls += phase("start", bound.index, [partial(startall, requests)])
                posted = False
            if self._posted is None:
                self._posted, self._first_requests = len(calls), requests
            calls += pending
            if timed:
                calls.append(polled_step(self, self._ready(requests, bound), requests, bound))
            elif self._alarm is not None:
                calls += phase("wait", bound.index, [self._waiter(requests, bound)])
            elif posted:
                calls += phase("wait", bound.index, [partial(waitall, requests)])
            elif len(requests) <= SINGLE_REQUESTS:
                calls += phase("wait", bound.index,
                               [request.Wait for request in reversed(requests)])
            else:
                calls += phase("wait", bound.index, [partial(waitall, requests)])
            if defer:
                pending = phase("combine", bound.index, combines)
            else:
                pending = ()
                calls += phase("combine", bound.index, combines)
        calls = (*calls, *pending, *self._heard, *phase("finish", None, self._last),
                 *phase("end", None, ()))
        if self._posted is None:
            self._posted = len(calls)
        return calls

    def _waiter(self, requests: list, bound: _BoundStep):
        """A step's wait without deadline that hears the alarm (:class:`._revoke.WatchedWait`;
        ``requests`` may be a list the run posts the step afresh into), one per list of
        requests: every flat program of the plan holds the same."""
        waiter = self._waiters.get(id(requests))
        if waiter is None or waiter.requests is not requests:
            waiter = self._waiters[id(requests)] = WatchedWait(
                requests, self._alarm, partial(self.heard, requests, bound))
        return waiter

    def _ready(self, requests: list, bound: _BoundStep | None):
        """``ready()`` of a step's polled wait: its requests tested, and the alarm heard."""
        return ready_or_heard(requests, self._alarm, partial(self.heard, requests, bound))

    @property
    def nbytes(self) -> int:
        """Bytes of scratch this plan holds (its buffers are the caller's)."""
        return self._scratch.nbytes

    def _bind_reductions(self, bound_steps: list[_BoundStep]) -> None:
        """Turn each step's reductions ``(received, local, lo, hi, order)`` into calls.

        Reductions into a range of the result that the plan sends from (in any step: the
        previous run's sends count too) are told so, see :meth:`Reducer.bind`.
        """
        small = self._result.nbytes <= SCRATCH_COMBINE[1]
        sent = [r for bound in bound_steps for r in bound.sent] if small else []
        for bound in bound_steps:
            calls = []
            for combine in bound.combines:
                if not isinstance(combine, tuple):
                    calls.append(combine)
                    continue
                received, local, lo, hi, order = combine
                calls.extend(self.reducer.bind(received, local, self._layout.view(lo, hi), order,
                                               _overlaps(lo, hi, sent)))
            bound.combines = tuple(calls)

    def _bind(self, index: int, step: Step, offset: int, defer: bool,
              written: _Written) -> _BoundStep:
        view_of, scratch, source = self._layout.view, self._scratch, self._source
        before, sends, sent = [], [], []
        for send in step.sends:
            for start, stop in segments(send.start, send.stop, MAX_MESSAGE):
                if stop == start:
                    continue
                pieces = written.pieces(start, stop)
                if source is not None and not any(w for _, _, w in pieces):
                    sends.append((send.peer, source[start:stop]))  # not written yet: sendbuf
                    continue
                for lo, hi, was in pieces:  # partly written: complete it in the result first
                    if not was:
                        before.append(partial(np.copyto, view_of(lo, hi), source[lo:hi]))
                        written.add(lo, hi)
                sends.append((send.peer, view_of(start, stop)))
                sent.append((start, stop))
        recvs, combines = [], []
        for recv in step.recvs:
            in_place = recv.action == COPY and not _overlaps(recv.start, recv.stop, sent)
            direct = (recv.action != COPY and source is not None
                      and self.reducer.ufunc is not None)
            for start, stop in segments(recv.start, recv.stop, MAX_MESSAGE):
                if stop == start:
                    continue
                target = view_of(start, stop)
                if in_place:
                    recvs.append((recv.peer, target))  # lands in place: no scratch, no copy
                    written.add(start, stop)
                    continue
                if direct and not any(was for _, _, was in written.pieces(start, stop)):
                    # out of place, a range the plan has not written holds nothing yet: the
                    # message lands there and is reduced with sendbuf in place (no scratch; a
                    # ufunc storing into cold lines it has not read costs more here)
                    recvs.append((recv.peer, target))
                    combines.append((target, source[start:stop], start, stop, recv.order))
                    written.add(start, stop)
                    continue
                view = scratch[offset:offset + stop - start]
                offset += stop - start
                recvs.append((recv.peer, view))
                if recv.action == COPY:
                    combines.append(partial(np.copyto, target, view))
                else:
                    for lo, hi, was in written.pieces(start, stop):
                        local = view_of(lo, hi) if was else source[lo:hi]
                        # bound once every step is known (see _bind_reductions)
                        combines.append((view[lo - start:hi - start], local, lo, hi, recv.order))
                written.add(start, stop)
        requests = []
        if self._persistent:
            tag = self._tag_base + index % STEP_TAGS
            requests = ([self.comm.Recv_init(view, peer, tag) for peer, view in recvs]
                        + [self.comm.Send_init(view, peer, tag) for peer, view in sends])
            self._requests.extend(requests)
        return _BoundStep(index, recvs, sends, tuple(before), combines, requests, defer, sent)

    # -- running -----------------------------------------------------------------------------

    def run(self, timeout: float | None = None) -> np.ndarray:
        """Run the collective once and return the result buffer.

        Args:
            timeout: seconds to wait for the whole collective (default: the plan's). When it
                passes, raise :class:`CollectiveTimeout`; the communicator is revoked then
                (:class:`CommunicatorRevoked` on every rank from then on, :mod:`._revoke`).
        """
        fast, state = self._fast, self._state
        if timeout is None and fast is not None and self.timeout is None \
                and (state is None or not state.broken):
            # the common case, checked inline: nothing refused, no deadline, persistent requests
            run_program(fast, self)
            return self.recvbuf
        timeout, deadline = self._start(timeout)
        if deadline is not None and self._fast_timed is not None:  # flat, polled steps
            self.run_timed(timeout)
            return self.recvbuf
        try:
            for requests, bound in self.steps():
                if deadline is None:
                    if self._alarm is None:
                        MPI.Request.Waitall(requests)
                    else:  # (a list per step and run: the wait is not kept)
                        WatchedWait(requests, self._alarm,
                                    partial(self.heard, requests, bound))()
                elif not wait_until(self._ready(requests, bound), deadline):
                    self.expire(requests, bound, timeout)
            if self._alarm is not None:
                state.check_alarm(self._where())
        except BaseException as error:
            self.gave_up(error)
            raise
        return self.recvbuf

    def run_timed(self, timeout: float) -> None:
        """Run once with a deadline ``timeout`` s from now, ``_fast_timed`` (persistent plans),
        without :meth:`run`'s checks: :meth:`run`'s, and the call cache's (``CallEntry.timed``:
        it checks ``timeout``, and drops its entries before their plans can be refused)."""
        self._deadline, self._timeout = time.monotonic() + timeout, timeout
        run_program(self._fast_timed, self)

    def lean_program(self) -> tuple:
        """The split of a run without deadline (untraced, one step at least; not freed, broken
        or running) that starts it *lean*: ``(program, head, rest, requests)``.

        A lean start posts the first step from the flat program (no step generator); a wait
        with nothing else in flight runs ``rest`` (the cheapest start and wait), anything else
        turns it into ``steps(posted=requests)``. ``head``'s calls load the buffers and start
        the first step, whose requests are ``requests``. Made once per flat program, and kept.

        A persistent plan's program is ``_fast``; a plan without persistent requests (an
        ``iallreduce``'s, which takes a new slot of tags per start) gets one made on first use
        that posts each step afresh with the tags of the run's slot.
        """
        fast, lean = self._fast, self._lean
        if lean is None or lean[0] is not fast:  # split once per flat program
            program = fast if fast is not None else self._flatten()
            posted = self._posted
            lean = self._lean = (fast, tuple(program[:posted]), tuple(program[posted:]),
                                 self._first_requests)
        return lean

    def _post_into(self, requests: list, bound: _BoundStep) -> None:
        """Post a step afresh with the tags of the run's slot into ``requests`` (cleared first:
        a plan without persistent requests reuses one list per step)."""
        tag = self._tag_base + bound.index % STEP_TAGS
        comm, append = self.comm, requests.append
        requests.clear()
        for peer, view in bound.recvs:
            append(comm.Irecv(view, peer, tag))
        for peer, view in bound.sends:
            append(comm.Isend(view, peer, tag))

    def steps(self, posted: list | None = None):
        """Run once, step by step: yield each step's ``(requests, bound step)`` once posted.

        ``posted``: the head of :meth:`lean_program` has already loaded the buffers and
        started the first step's requests, these; go on from there.

        The caller resumes the generator only when those requests have completed (waited,
        polled or tested: :meth:`run`, or a non-blocking request in
        :mod:`mpiallreduce.nonblocking`). The order is :meth:`_flatten`'s: per step its copies,
        its requests started, the previous step's deferred combines, then (after the yield) its
        combines. A plan bound while tracing records the same phases as its flat program.
        """
        head, program, tail = self._stepwise or self._bind_stepwise()
        startall = MPI.Prequest.Startall
        if posted is None:
            for call in head:
                call()
        pending = ()  # combines of a step that wait until the next step's messages are posted
        for before, requests, waits, combines, defer, bound in program:
            if posted is not None:  # (the first step's copies and starts are done)
                requests, posted = posted, None
            else:
                for call in before:
                    call()
                if requests is None:
                    requests = []
                    self._post_into(requests, bound)
                elif len(requests) <= SINGLE_REQUESTS:
                    for request in requests:
                        request.Start()
                else:
                    startall(requests)
            for call in pending:  # overlaps this step's transfers
                call()
            for call in waits:
                call()
            yield requests, bound
            if defer:
                pending = combines
            else:
                pending = ()
                for call in combines:
                    call()
        for call in (*pending, *tail):
            call()

    def _bind_stepwise(self) -> tuple:
        """The stepwise program (:meth:`steps`), each step's phases bound once (on first use,
        after a tracer has hooked ``_phase``): ``(head, steps, tail)``, a step being
        ``(copies and start stamps, requests or None, wait stamps, combines, defer, bound)``."""
        phase = self._phase
        head = (*phase("run", None, ()), *phase("load", None, self._first))
        program = tuple(((*phase("copy", bound.index, before), *phase("start", bound.index, ())),
                         requests, tuple(phase("wait", bound.index, ())),
                         tuple(phase("combine", bound.index, combines)), defer, bound)
                        for before, requests, combines, defer, bound in self._program)
        tail = (*phase("finish", None, self._last), *phase("end", None, ()))
        self._stepwise = (head, program, tail)
        return self._stepwise

    def stalled(self, requests, bound: _BoundStep | None) -> tuple[int, list, list]:
        """Where a run in flight waits: ``(step index, peers whose messages of that step have
        not arrived, peers that have not posted the receive for this rank's)``.

        ``requests`` are the step's, receives first (as posted); ``bound`` None is a lean
        start's first step. Asks each request's status without completing it: the failure
        path only, nothing of this runs while the run goes well.
        """
        if bound is None:
            bound = self._program[0][-1]
        nrecv = len(bound.recvs)
        not_sent = sorted({peer for (peer, _), request in zip(bound.recvs, requests[:nrecv])
                           if not request.Get_status()})
        # a peer that has not sent has not posted its step at all: named once, as not sent
        not_received = sorted({peer for (peer, _), request in zip(bound.sends, requests[nrecv:])
                               if not request.Get_status()} - {*not_sent})
        return bound.index, not_sent, not_received

    def _poll_step(self, ready, requests, bound: _BoundStep) -> None:
        """A step's wait in ``_fast_timed``: ``ready()`` (its requests ``tested``) to the
        deadline, else :meth:`expire`."""
        if not wait_until(ready, self._deadline):
            self.expire(requests, bound, self._timeout)

    def expire(self, requests, bound: _BoundStep | None, timeout: float) -> None:
        """Give up on a step past its deadline: cancel its receives, mark the plan, raise
        naming the peers the step waits for."""
        if bound is None:  # a lean start's first step
            bound = self._program[0][-1]
        index, not_sent, not_received = self.stalled(requests, bound)
        for request in requests[:len(bound.recvs)]:  # cancelling sends is deprecated in MPI-4
            if not request.Test():
                request.Cancel()
                request.Test()  # completes the cancel if it took
        where = f"{self._label} on rank {self.comm.Get_rank()}"
        peers = sorted({*not_sent, *not_received})
        if not peers:  # every message arrived between the last test and these
            self.fail(f"{where}: step {index} did not complete within {timeout:g} s (its "
                      f"messages arrived as the deadline passed)", keep=(requests,))
        self.fail(f"{where}: no answer from rank(s) {', '.join(map(str, peers))} in step {index} "
                  f"within {timeout:g} s: {unanswered(index, not_sent, not_received)}",
                  keep=(requests,))


def run_program(calls: tuple, plan: _PlanBase) -> None:
    """Run a plan's flat program (``calls``); an exception that leaves it in the middle makes
    the plan unusable and revokes its communicator (:meth:`_PlanBase.gave_up`)."""
    try:
        for call in calls:
            call()
    except BaseException as error:
        plan.gave_up(error)
        raise


def polled_step(plan: Plan, ready, requests, bound: _BoundStep):
    """A step's wait in ``plan._fast_timed``: :meth:`Plan._poll_step` bound to the step (the
    compiled form's twin, ``_compiled.PolledStep``, runs it with no Python frame)."""
    return partial(plan._poll_step, ready, requests, bound)


#: the Python form's (the reference the compiled twin is tested against)
python_polled_step = polled_step

if _form.compiled is not None:
    polled_step = _form.compiled.PolledStep  # noqa: F811
