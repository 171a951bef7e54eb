"""Non-blocking allreduce: ``iallreduce``, ``start(plan)`` and the :class:`Request` they return.

What runs where:

- **In the caller's thread, at the call**: the local checks, the agreement check (``check=True``)
  and binding the plan (a slot of tags of its own and scratch of its own: nothing a blocking
  call uses meanwhile). These are collective and happen in call order on every rank, as the
  ordering rule requires.
- **MPI's own collective** (``algorithm="native"``, and ``auto`` where it picks native): the
  request *is* MPI's, started at the call (``Iallreduce`` on a duplicate kept for non-blocking
  collectives; ``start`` of a native plan: the plan's persistent ``Allreduce_init`` request).
  ``test()``/``wait()`` call MPI's ``Test``/``Wait`` in the caller's thread; no thread is
  involved, so the call costs about what MPI's costs.
- **A schedule**: its run is a generator of steps (:meth:`~mpiallreduce.executor.Plan.steps`).
  The call posts the first step; every ``test()``, ``wait()`` and later start on the same
  communicator advances every run in flight there as far as it goes without blocking (a run
  never waits for a later one, so waits in any order complete). With ``MPI_THREAD_MULTIPLE``
  (mpi4py's default) one progress thread per communicator also advances them while the caller
  is elsewhere (computing, or blocked in another collective that a peer reaches only after
  waiting): it looks every :data:`GRACE_SECONDS` and advances the runs only once one of them
  has been in flight since its previous look (a caller that starts and waits in a loop never
  meets it), then polls at a backing-off pace (50 µs up to :data:`PAUSE_MAX`) while runs are
  in flight, never blocks in MPI and never spins against the caller's computation; it exits
  after :data:`IDLE_SECONDS` without runs. Whichever thread completes a step runs its
  combines; the engine's lock keeps them apart (the thread only tries it, so it never makes
  the caller wait). A started plan without deadline, and a repeated ``iallreduce`` of a
  schedule, post their first step from a flat program (:meth:`Plan.lean_program`; the
  ``iallreduce``'s posts fresh messages with the tags of the slot it takes); a wait with
  nothing else in flight runs the rest of that program, anything else first turns it into a
  stepwise run.
- **A repeated call** (``iallreduce`` with the same objects) finds its set-up in the
  communicator's call cache (:class:`_Started`).
- **A plan without steps of its own** (``reproducible=True``, the shared-memory transport) runs
  whole at ``start``/``iallreduce``, in call order as a blocking call would, and its request is
  complete on return (the same result, no overlap).
- **Deadlines and failures** are decided in the caller's thread: ``wait(timeout)`` raises
  :class:`CollectiveTimeout` and leaves the request in flight; a run past its own ``timeout=``
  (given to ``iallreduce``/``start``) is abandoned there, in the caller's thread, which marks
  the communicator unusable (so no other thread ever frees plans the caller may be running).

Below ``MPI_THREAD_MULTIPLE`` (``mpi4py.rc.thread_level``) there is no thread: schedules progress
only inside ``start``, ``test`` and ``wait``; wait for a request before a blocking call that a
peer may reach only after waiting for it.
"""

from __future__ import annotations

import atexit
import itertools
import threading
import time
import weakref
from functools import partial

import numpy as np
from mpi4py import MPI

from . import _plans
from ._agree import prepare
from ._checks import allreduce_call
from ._state import state as comm_state
from .errors import CollectiveTimeout
from .executor import (
    BUSY_TESTS,
    MAX_MESSAGE,
    MPI_CANNOT_SAY,
    NativePlan,
    Plan,
    _PlanBase,
    _untraced,
    check_timeout,
    flat,
    patience,
    poll,
    unanswered,
)
from .partition import segments

#: longest pause (seconds) of the progress thread between polls while runs are in flight.
PAUSE_MAX = 1e-3
#: seconds between the progress thread's looks at new runs: it advances them only once one
#: was in flight at its previous look (a caller that waits at once completes its own).
GRACE_SECONDS = 1e-3
#: longest pause (seconds) of the progress thread while every look finds only new runs (a
#: caller that starts and waits in a loop): a run then left in flight is advanced within two
#: such pauses.
FRESH_PAUSE_MAX = 4e-3
#: seconds a progress thread waits for work before it exits (the next request starts another).
IDLE_SECONDS = 1.0


def threaded() -> bool:
    """Whether schedules also progress in a thread (MPI was initialised with THREAD_MULTIPLE)."""
    return MPI.Query_thread() == MPI.THREAD_MULTIPLE


class Request:
    """A collective in flight: ``wait()`` returns its result, ``test()`` and ``done`` poll it.

    Requests on one communicator may be waited in any order. ``wait()`` and ``test()`` may be
    called again after completion: they return the same result (or raise the same exception).
    """

    __slots__ = ("_result", "_work", "_finish", "_error")

    def __init__(self, result, work=None, finish=None):
        self._result = result
        self._work = work  # None once complete: see _NativeWork and _Run (join/poll/complete)
        self._finish = finish  # run once in the caller's thread on completion (AVG, plan landing)
        self._error: BaseException | None = None
        if work is None and finish is not None:
            self._settle()

    @property
    def done(self) -> bool:
        """True once the collective has completed (or failed); does not drive progress."""
        return self._work is None

    def test(self) -> bool:
        """Return True if complete (raising its exception if it failed), else False at once."""
        if self._work is not None and not self._progress(None, block=False):
            return False
        self._outcome()
        return True

    def wait(self, timeout: float | None = None):
        """Wait for completion and return the result array.

        Args:
            timeout: seconds to wait (default: forever). When they pass, raise
                :class:`CollectiveTimeout`; the request is still in flight and may be waited
                again (the communicator is not marked unusable by this wait alone).
        """
        work = self._work
        if work is not None:
            if timeout is None:  # blocks until complete (or the run's own deadline raises)
                # (written out: each call saved here shows in a start().wait() at 8 bytes)
                try:
                    work.join()
                except Exception as exc:  # noqa: BLE001 - the request failed: kept for every wait()
                    self._error = exc
                self._work = None
                finish = self._finish
                if finish is not None:
                    self._finish = None
                    finish(self._error is None)
            else:
                check_timeout(timeout)
                if not self._progress(time.monotonic() + timeout, block=True):
                    raise CollectiveTimeout(
                        f"request not complete within {timeout:g} s; it is still in flight: "
                        f"{work.waits_for()}; wait again, or Abort")
        if self._error is not None:
            raise self._error
        return self._result

    def _progress(self, until, block: bool) -> bool:
        try:
            if not (self._work.complete(until) if block else self._work.poll()):
                return False
        except Exception as exc:  # noqa: BLE001 - the request failed: kept for every wait()
            self._error = exc
        self._work = None
        self._settle()
        return True

    def _settle(self) -> None:
        if self._finish is not None:
            finish, self._finish = self._finish, None
            finish(self._error is None)

    def _outcome(self):
        if self._error is not None:
            raise self._error
        return self._result


#: native requests dropped in flight, with their buffers (see _NativeWork.__del__)
_DROPPED: list = []


def _tidy() -> None:
    """Forget dropped native requests that have completed."""
    _DROPPED[:] = [work for work in _DROPPED if not MPI.Request.Testall(work.requests)]


@atexit.register
def _finish_dropped() -> None:
    """Before MPI finalizes (mpi4py's handler was registered first, so runs later): let dropped
    requests complete, for a second at most (a peer that never makes the call cannot be
    waited for)."""
    if _DROPPED and not MPI.Is_finalized():
        deadline = time.monotonic() + 1.0
        for work in _DROPPED:
            poll(work.requests, deadline)


# -- MPI's own non-blocking and persistent collectives ---------------------------------------------

class _NativeWork:
    """MPI requests: tested and waited in the caller's thread, polled when a deadline is set.

    ``deadline`` (time.monotonic) is the run's own, from ``timeout=``: past it, ``fail(reason,
    requests)`` marks the communicator unusable and raises.
    """

    __slots__ = ("requests", "deadline", "timeout", "fail", "where", "keep", "join")

    def __init__(self, requests: list, deadline: float | None, timeout, fail, where, keep):
        self.requests, self.deadline, self.timeout, self.fail = requests, deadline, timeout, fail
        self.where = where  # names the call in a timeout message (a callable: built on failure)
        self.keep = keep  # the buffers MPI reads and writes until the requests complete
        # join(): complete, or raise at the deadline
        if deadline is not None:
            self.join = self._wait_for_deadline
        elif len(requests) == 1:
            self.join = requests[0].Wait
        else:
            self.join = partial(MPI.Request.Waitall, requests)

    def _wait_for_deadline(self) -> None:
        self.complete(None)

    def back(self, ok: bool) -> None:
        """An ``iallreduce`` entry's request completed: the entry may carry this work object
        again (``keep`` is the entry); AVG divides the result."""
        entry = self.keep
        entry.work = self
        if ok and entry.average:
            entry.finish(ok)

    def __del__(self):
        # Its request dropped in flight: MPI's own requests may not be freed while active
        # (MPI-4 §6.12), so they and their buffers are kept until they complete (tested at the
        # next call, waited at exit). (A schedule's dropped run stays with its engine, which
        # completes it; and Request has no finalizer, which cost ~0.5 us per request.)
        if MPI.Is_finalized():
            return
        try:
            active = not MPI.Request.Testall(self.requests)
        except MPI.Exception:  # a plan's persistent requests, freed with their plan
            return
        if active:
            _DROPPED.append(self)

    def poll(self) -> bool:
        if MPI.Request.Testall(self.requests):
            return True
        self._check_deadline()
        return False

    def complete(self, until: float | None) -> bool:
        stop = _earliest(until, self.deadline)
        if stop is None:
            MPI.Request.Waitall(self.requests)
            return True
        testall = MPI.Request.Testall
        for _ in itertools.chain(range(BUSY_TESTS), patience(stop)):
            if testall(self.requests):
                return True
        self._check_deadline()
        return False

    def _check_deadline(self) -> None:
        if self.deadline is not None and time.monotonic() > self.deadline:
            self.fail(f"{self.where()}: not complete within {self.timeout:g} s (a rank did not "
                      f"make this call, or ranks run calls on this communicator in different "
                      f"orders; {MPI_CANNOT_SAY})", self.requests)

    def waits_for(self) -> str:
        """What the requests wait for, as a ``wait(timeout)`` that passed says it."""
        return f"{self.where()}: a rank has not made the matching call, or is slow ({MPI_CANNOT_SAY})"


def _earliest(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else min(a, b)


# -- schedules: runs progressed step by step -------------------------------------------------------

class _Run(Request):
    """A schedule plan's run in flight: its step generator and the requests it waits on; and
    the :class:`Request` the caller holds (its own work until complete: one object per start).

    In its engine's ``runs`` from submission until it ends (or is abandoned at its deadline).
    """

    __slots__ = ("engine", "plan", "owned", "timeout", "deadline", "steps", "requests", "bound",
                 "finished", "error", "rest")

    def __init__(self, engine: _Engine, plan, timeout: float | None, owned: bool,
                 posted: tuple | None = None, finish=None):
        # the request (as Request.__init__): the result, itself as its work, what completion runs
        self._result, self._work, self._finish, self._error = plan.recvbuf, self, finish, None
        self.engine, self.plan, self.owned = engine, plan, owned
        self.timeout = timeout
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.bound = None
        self.finished = False
        self.error: BaseException | None = None
        if posted is None:
            self.steps = plan.steps()
            self.requests = self.rest = None
        else:  # Plan.start_lean posted the first step: (its requests, the rest of the flat run)
            self.steps = None
            self.requests, self.rest = posted

    def advance(self) -> int:
        """Run steps whose requests completed, post the next ones; never blocks (engine lock
        held). Return how many steps moved."""
        moved = 0
        if self.steps is None:  # lean: anything but its own wait goes on as a generator
            self.steps, self.rest = self.plan.steps(posted=self.requests), None
        try:
            while self.requests is None or MPI.Request.Testall(self.requests):
                self.requests, self.bound = next(self.steps)
                moved += 1
        except StopIteration:
            self._end()
        except Exception as exc:  # noqa: BLE001 - a user op raised: handed to wait()
            self.error = exc
            self._end()
        return moved

    def _end(self) -> None:
        self.finished = True
        self.requests = None
        self.engine.runs.remove(self)
        if self.owned:
            self.plan.free()

    # the work protocol Request calls, in the caller's thread

    def poll(self) -> bool:
        engine = self.engine
        if engine.lock.acquire(False):  # (not blocking) else the thread is advancing it now
            try:
                engine.progress()
                if not self.finished:
                    self._check_deadline()
            finally:
                engine.lock.release()
        return self._ended()

    def join(self) -> None:
        """Complete the run (no deadline but its own); raise its error."""
        if self.rest is not None:  # lean and untouched (no deadline): alone, finish it here
            lock, runs = self.engine.lock, self.engine.runs
            if lock.acquire(False):  # not blocking (a keyword costs ~0.15 us here)
                try:
                    rest = self.rest
                    if rest is not None and len(runs) == 1:  # runs == [self]
                        # (_end, inline: a lean run is never owned, and only this wait
                        # reads it once it is out of runs)
                        self.rest = None
                        try:
                            for call in rest:
                                call()
                        except Exception as exc:  # noqa: BLE001 - a user op raised
                            self.error = exc
                            raise
                        finally:
                            self.finished = True
                            runs.remove(self)
                        return
                finally:
                    lock.release()
        self.complete(None)

    def complete(self, until: float | None) -> bool:
        engine = self.engine
        stop = _earliest(until, self.deadline)
        lock, runs = engine.lock, engine.runs
        for _ in itertools.chain(range(BUSY_TESTS), patience(stop)):
            if not lock.acquire(False):  # (not blocking)
                continue  # the thread is advancing the runs: look again after a pause
            try:
                if stop is None:
                    # alone and without deadline: block in MPI step by step, as a blocking run
                    # does (runs holds this run until it ends)
                    while len(runs) == 1 and runs[0] is self:
                        if self.rest is not None:  # lean, untouched: finished by wait()
                            break
                        if self.requests is not None:
                            MPI.Request.Waitall(self.requests)
                        self.advance()
                if not self.finished:
                    engine.progress()
                if self.finished:
                    return self._ended()
            finally:
                lock.release()
        with lock:
            engine.progress()
            if not self.finished:
                self._check_deadline()
        return self._ended()

    def _ended(self) -> bool:
        if self.finished and self.error is not None:
            raise self.error
        return self.finished

    def waits_for(self) -> str:
        """What the run waits for, naming the peers, as a ``wait(timeout)`` that passed says it
        (the caller's thread; builds nothing until a wait has timed out)."""
        plan = self.plan
        with self.engine.lock:  # the progress thread may be advancing the run
            if self.finished or self.requests is None:
                return f"{plan._label} on rank {plan.comm.Get_rank()} has just completed"
            index, not_sent, not_received = plan.stalled(self.requests, self.bound)
        if not not_sent and not not_received:
            return (f"{plan._label} on rank {plan.comm.Get_rank()} waits in step {index}, whose "
                    f"messages have just arrived")
        return (f"{plan._label} on rank {plan.comm.Get_rank()} waits in step {index}: "
                f"{unanswered(index, not_sent, not_received, 'the matching call', slow=True)}")

    def _check_deadline(self) -> None:
        """Past the run's own deadline: abandon it (engine lock held, caller's thread)."""
        if self.deadline is None or time.monotonic() <= self.deadline:
            return
        self.engine.runs.remove(self)
        self.finished = True
        if self.steps is not None:
            self.steps.close()
        self.plan.expire(self.requests, self.bound, self.timeout)  # marks broken and raises


class _Engine:
    """The runs in flight on one private communicator, and (threaded) the thread polling them.

    ``lock`` guards the runs: whoever holds it advances them. The caller's thread takes it
    in ``start``/``test``/``wait``; the progress thread only ever tries (``blocking=False``), so
    it never makes the caller wait and never blocks in MPI. The thread advances runs only once
    one of them was in flight at its previous look, :data:`GRACE_SECONDS` earlier (a run the
    caller waits for at once never meets it), then at a pace backing off from 50 µs to
    :data:`PAUSE_MAX` while runs are in flight, and exits after :data:`IDLE_SECONDS` without any
    (the next submit starts another): no notification on the hot path.
    """

    def __init__(self):
        self.lock = threading.Lock()
        self.guard = threading.Lock()  # the thread's start and exit
        self.runs: list[_Run] = []
        self.thread: threading.Thread | None = None
        self.threaded = threaded()

    def submit(self, run: _Run) -> None:
        """Post the run's first step, then let the thread (if any) progress it."""
        with self.lock:
            self.runs.append(run)
            self.progress()
        if not run.finished:
            self.wake()

    def wake(self) -> None:
        """Start the thread (threaded) if none runs; call after appending a run.

        Without the guard when a thread is there: a thread that exits first clears
        ``thread``, then looks at ``runs`` (and stays if it finds one), so a run appended
        before this look is seen by a thread that is still set here, or this look finds none.
        """
        if not self.threaded or self.thread is not None:
            return
        with self.guard:
            if self.thread is None:
                self.thread = threading.Thread(target=self._loop, name="mpiallreduce-progress",
                                               daemon=True)
                self.thread.start()

    def progress(self) -> int:
        """Advance every run in flight, in start order, without blocking (lock held); a run
        that ends leaves ``runs``."""
        moved = 0
        for run in tuple(self.runs):
            moved += run.advance()
        return moved

    def _loop(self) -> None:
        pause, idle_since = GRACE_SECONDS, None
        seen: tuple = ()  # the runs in flight at the last look
        fresh = False  # whether the last look found only runs started since the one before
        while True:
            time.sleep(pause)
            runs = tuple(self.runs)  # (a copy without the lock: only the lock's holder advances)
            if runs and not any(run in seen for run in runs):
                # Every run in flight started since the last look (a caller that starts and
                # waits in a loop completes its own runs): leave them to the caller for one
                # more pause, longer while that goes on. Advancing them here would take the
                # GIL and the lock from it, and turn its flat runs into stepwise ones
                # (measured before this rule: rd 8 B start().wait() 7.1x comm.Allreduce with
                # the thread, 3.5x without, at load 7 on 2 cores); every look costs the
                # caller a wake-up on a busy core.
                pause = min(pause * 2, FRESH_PAUSE_MAX) if fresh else GRACE_SECONDS
                seen, idle_since, fresh = runs, None, True
                continue
            seen, fresh = runs, False
            if not runs:
                now = time.monotonic()
                idle_since = now if idle_since is None else idle_since
                if now - idle_since > IDLE_SECONDS:
                    with self.guard:
                        # clear first, then look (see wake): a run appended by a caller who
                        # saw this thread set is seen here
                        me, self.thread = self.thread, None
                        if not self.runs:
                            return
                        self.thread = me
                        idle_since = None
                pause = PAUSE_MAX
                continue
            moved = 0
            if self.lock.acquire(False):  # (not blocking)
                try:
                    moved = self.progress()
                finally:
                    self.lock.release()
            pause = 5e-5 if moved else min(pause * 2, PAUSE_MAX)


_ENGINES: dict = {}
_ENGINES_LOCK = threading.Lock()


def _engine(comm: MPI.Comm) -> _Engine:
    """The engine of a private communicator (one per communicator object, dropped with it)."""
    key = id(comm)
    with _ENGINES_LOCK:
        found = _ENGINES.get(key)
        if found is None or found[0]() is not comm:
            found = (weakref.ref(comm, lambda _: _ENGINES.pop(key, None)), _Engine())
            _ENGINES[key] = found
        return found[1]


def _schedule_request(plan, timeout, owned: bool, finish=None) -> Request:
    if not hasattr(plan, "steps"):
        # no steps to progress (a plan of other plans, the shared-memory transport): it runs
        # whole now, in call order as a blocking call would; the request is complete
        try:
            return Request(plan.run(timeout))
        finally:
            if owned:
                plan.free()
    engine = plan._engine
    if engine is None:
        engine = plan._engine = _engine(plan.comm)
    run = _Run(engine, plan, timeout, owned, finish=finish)
    engine.submit(run)
    return run


# -- the public calls ------------------------------------------------------------------------------

def iallreduce(sendbuf, recvbuf, op, comm, algorithm, topology, check, timeout,
               params: dict) -> Request:
    """Start an allreduce and return a :class:`Request`; ``wait()`` returns the result
    (:func:`mpiallreduce.iallreduce`, whose arguments these are, ``params`` as a dict).

    Arguments as :func:`mpiallreduce.allreduce`; ``timeout`` bounds the set-up and the run.
    The checks and the plan's binding happen now, in the caller's thread and in call order;
    how the run progresses is in the module docstring. Do not touch ``recvbuf`` (or write
    ``sendbuf``) until the request completes. Requests and blocking calls on one communicator
    are issued in the same order on every rank.

    As :func:`mpiallreduce.allreduce` does, a repeated call with the same objects finds what its
    first call set up (the agreement's signature, MPI's arguments or the bound plan, in the
    communicator's call cache) and costs the agreement (if ``check``) and the start.
    """
    if _DROPPED:
        _tidy()
    return _plans.cached_call("iallreduce", _bind, sendbuf, recvbuf, op, comm, algorithm,
                              topology, check, timeout, params)


def _bind(slot, sendbuf, recvbuf, op, comm, algorithm, topology, check, timeout, params):
    """An iallreduce the call cache does not hold (:func:`._plans.cached_call`, whose arguments
    these are): checked, set up (kept where it can be) and started."""
    call = prepare("iallreduce", comm, check, lambda comm: allreduce_call(
        sendbuf, recvbuf, op, comm, algorithm, topology, params), timeout=timeout,
        checks_itself=_plans.checks_itself)
    if call.recv.size == 0:
        return Request(call.recv)
    state = comm_state(call.comm)
    deadline = None if timeout is None else time.monotonic() + timeout
    entry = _Started(call, state, (comm, sendbuf, recvbuf, op, topology), deadline)
    key = _plans.call_key(slot, comm, sendbuf, op, algorithm, topology, params)
    if key is not None and _plans.cacheable(sendbuf, recvbuf, call) and state.calls.put(key, entry):
        return entry.run(timeout)
    return entry.run(timeout, once=True)


class _Started(_plans.BoundCall):
    """What an ``iallreduce`` sets up, kept for the next call with the same objects
    (:class:`._plans.BoundCall`: ``run`` starts one).

    Three kinds, by what the call resolves to (the same on every rank):

    - MPI's own collective: the arguments of ``Iallreduce`` on the duplicate kept for
      non-blocking collectives (the MPI datatype given, so mpi4py need not infer it);
    - a schedule: a plan of its own (its scratch too) posted step by step, which takes the
      communicator's next slot of tags at every start. Every rank takes one slot per schedule
      ``iallreduce``, whether its cache found the entry or not, so slot numbers stay equal
      across ranks even where one rank's cache has dropped an entry another kept. Started
      again before its request completed, it binds a plan for that one run;
    - a plan without steps (the shared-memory transport): it runs whole at the start.
    """

    __slots__ = ("call", "plan", "pieces", "iallreduce", "nranks", "average", "recv", "work",
                 "lean")
    what = "iallreduce"

    def __init__(self, call, state, objects: tuple, deadline: float | None):
        super().__init__(call, state, objects)
        self.call = call
        self.recv = call.recv
        self.nranks = state.private.Get_size()
        self.average = call.reducer.average
        self.plan = self.pieces = self.iallreduce = self.work = None
        if _plans.resolve(call, self.nranks, state, deadline, "iallreduce") == "native":
            self.iallreduce = state.nonblocking_comm(
                None if deadline is None else max(deadline - time.monotonic(), 1e-9),
                "iallreduce").Iallreduce
            result, send = flat(call.recv), None if call.send is None else flat(call.send)
            try:
                datatype = MPI.Datatype.fromcode(call.recv.dtype.char)
            except (KeyError, ValueError):
                datatype = None
            typed = (lambda buf: buf) if datatype is None else (lambda buf: [buf, datatype])
            self.pieces = [(MPI.IN_PLACE if send is None else typed(send[lo:hi]),
                            typed(result[lo:hi]), call.reducer.mpi_op)
                           for lo, hi in segments(0, result.size, MAX_MESSAGE) if hi > lo]
        else:
            self.plan = _plans.build(call, state, explicit=False, persistent=False,
                                     timeout=None, deadline=deadline, what="iallreduce")
        send_bytes = 0 if call.send is None else call.send.nbytes
        self.nbytes = call.recv.nbytes + send_bytes + (0 if self.plan is None else self.plan.nbytes)
        # an shm plan's run compares the agreement's fields itself (as a blocking call's does)
        self.fused = self.plan is not None and _plans.fused(self.plan)
        self.result = None
        if self.fused:
            # a cached shm plan's run without the checks of run() (the call cache drops the
            # entry before its plan is freed or its communicator breaks), as allreduce's: whole
            # at the start, so the call returns one complete request
            self.direct, self.args, self.result = self.plan.direct, (), Request(self.recv)
        # a schedule: whether a start without deadline may post from a flat program
        # (_start_lean: untraced, one step at least); None: no steps to progress
        self.lean = None
        if self.plan is not None and hasattr(self.plan, "steps"):
            self.lean = self.plan._phase is _untraced and bool(self.plan._program)

    def run(self, timeout: float | None, once: bool = False) -> Request:
        """Start one run; ``once``: the entry is not kept (its plan is freed after the run)."""
        pieces = self.pieces
        if pieces is not None:
            if timeout is None and len(pieces) == 1:
                # one request without deadline: the work object of the entry's last request
                # again, which its completion handed back (a request in flight holds its work
                # alone, so one dropped in flight is kept by _NativeWork.__del__)
                send, recv, op = pieces[0]
                request = self.iallreduce(send, recv, op)
                work = self.work
                if work is None:
                    work = _NativeWork([request], None, None, self.fail, self.where, self)
                else:
                    self.work = None
                    work.requests[0] = request
                    work.join = request.Wait
                return Request(self.recv, work, work.back)
            deadline = None if timeout is None else time.monotonic() + timeout
            requests = [self.iallreduce(*args) for args in pieces]
            work = _NativeWork(requests, deadline, timeout, self.fail, self.where, self)
            return Request(self.recv, work, self.finish if self.average else None)
        plan = self.plan
        if self.lean is None:  # no steps of its own: runs whole now, in call order
            return _schedule_request(plan, timeout, owned=once)
        tag_base = self.state.take_slot()  # on every rank, hit or miss (see the class docstring)
        if timeout is None and self.lean and not once and plan._in_flight is None:
            plan._tag_base = tag_base
            return _start_lean(plan)
        if once:
            plan._tag_base = tag_base
            return _schedule_request(plan, timeout, owned=True)
        if plan._in_flight is not None:  # the same buffers again before the last wait
            plan = _plans.build(self.call, self.state, explicit=False, persistent=False,
                                timeout=None, what="iallreduce")
            plan._tag_base = tag_base
            return _schedule_request(plan, timeout, owned=True)
        plan._tag_base = tag_base
        plan._take_off(True)
        request = _schedule_request(plan, timeout, owned=False, finish=plan.landed)
        plan._in_flight = request
        return request

    def finish(self, ok: bool) -> None:
        if ok:  # AVG: MPI's SUM, divided here
            np.divide(self.recv, self.nranks, out=self.recv)

    def fail(self, reason: str, pending) -> None:
        self.state.fail(reason, pending, (self,))

    def where(self) -> str:
        return f"native iallreduce on rank {self.state.private.Get_rank()}"

    def free(self) -> None:
        # a plan with a run in flight is left to its run (a posted plan holds no persistent
        # requests; the collector releases it)
        if self.plan is not None and self.plan._in_flight is None:
            self.plan.free()


def start(plan, timeout: float | None = None) -> Request:
    """Start a persistent plan (from :func:`mpiallreduce.plan`) without waiting for it.

    A native plan starts MPI's persistent request (``Allreduce_init``, made on the first start);
    a schedule posts its first step and progresses as the module docstring says; a plan without
    steps of its own (``reproducible=True``, the shared-memory transport) runs whole at the
    start, in call order, and its request is complete. ``wait()``
    returns the plan's result buffer. Until the request completes, ``run()``, ``start()`` and
    ``free()`` on the plan raise ValueError. Start plans in the same order on every rank.
    """
    if timeout is None and type(plan) is NativePlan and plan._fast is not None \
            and plan.timeout is None and plan._persistent is not None \
            and (plan._state is None or not plan._state.broken):
        # the repeated start of a native plan of one piece (_fast: not freed, broken, running
        # or AVG), without deadline: MPI's persistent request, started
        work = plan._work
        if work is None:  # the same requests every start, no deadline: one work object
            work = plan._work = _NativeWork(plan._persistent, None, None, plan.fail, plan.where,
                                            plan)
        plan._persistent[0].Start()
        request = Request(plan.recvbuf, work, plan.landed)
        plan._in_flight = request
        plan._parked, plan._fast = plan._fast, None  # (_take_off, inline)
        return request
    if timeout is None and type(plan) is Plan and plan._fast is not None \
            and plan.timeout is None and plan._phase is _untraced and plan._program \
            and (plan._state is None or not plan._state.broken):
        return _start_lean(plan)
    if not hasattr(plan, "steps") and type(plan) is not NativePlan:
        # no steps of its own: runs whole now, in call order; its request is complete (the
        # same one every start: a complete request never changes)
        result = plan.run(timeout)
        done = plan._done
        if done is None or done._result is not result:
            done = plan._done = Request(result)
        return done
    timeout, _ = plan._start(timeout)  # refuses a freed, broken or running plan
    plan._take_off(True)
    if isinstance(plan, NativePlan):
        requests = plan.persistent_requests()
        MPI.Prequest.Startall(requests)
        deadline = None if timeout is None else time.monotonic() + timeout
        request = Request(plan.recvbuf, _NativeWork(requests, deadline, timeout, plan.fail,
                                                    plan.where, plan), plan.landed)
    else:
        request = _schedule_request(plan, timeout, owned=False, finish=plan.landed)
    plan._in_flight = request
    return request


def _start_lean(plan) -> Request:
    """Start a schedule plan's run without deadline from its flat program (``_fast``: not freed,
    broken or running; one step at least): its first step posted now; a wait with nothing else
    in flight runs the rest of the flat program, anything else (a test, another start, the
    thread) turns it into a stepwise run (:meth:`_Run.advance`)."""
    engine = plan._engine
    if engine is None:
        engine = plan._engine = _engine(plan.comm)
    lean = plan._lean
    if lean is None or lean[0] is not plan._fast:
        lean = plan.lean_program()
    runs = engine.runs
    if runs:
        with engine.lock:
            for call in lean[1]:
                call()
            run = _lean_run(engine, plan, lean[3], lean[2])
            runs.append(run)
            engine.progress()  # every start advances the runs in flight
    else:
        # Nothing in flight: no lock needed to add a run. Only the caller's thread adds runs
        # (one thread per communicator) and the progress thread only removes them, under the
        # lock, from a snapshot; the run is whole before it is appended.
        for call in lean[1]:
            call()
        run = _lean_run(engine, plan, lean[3], lean[2])
        runs.append(run)
    plan._in_flight = run  # (the run is its request)
    plan._parked, plan._fast = plan._fast, None  # (_take_off, inline)
    if engine.thread is None and engine.threaded and not run.finished:
        engine.wake()
    return run


def _lean_run(engine: _Engine, plan, requests: list, rest: tuple, new=object.__new__) -> _Run:
    """``_Run(engine, plan, None, False, (requests, rest), plan.landed)``, its fields set
    directly (a third of the constructor's time: this is most of a lean start at 8 bytes)."""
    run = new(_Run)
    run._result, run._work, run._finish, run._error = plan.recvbuf, run, plan.landed, None
    run.engine, run.plan, run.owned, run.timeout, run.deadline = engine, plan, False, None, None
    run.bound, run.finished, run.error, run.steps = None, False, None, None
    run.requests, run.rest = requests, rest
    return run


_PlanBase._starter = staticmethod(start)
