"""Schedules run step by step in flight: a run (:class:`_Run`), the engine of one private
communicator that advances its runs (:class:`_Engine`) and its progress thread.

How runs progress, and when the thread looks at them: :mod:`mpiallreduce.nonblocking`.

A *lean* run (:func:`_start_lean`) is a start without deadline from the plan's flat program
(``Plan.lean_program``): its first step posted, the rest run by a wait that finds it alone in
flight as one flat loop; anything else turns it into a stepwise run.
"""

from __future__ import annotations

import threading
import time
import weakref

from mpi4py import MPI

from .._revoke import WatchedWait
from .._waiting import deadline_of, unanswered, wait_until
from .requests import Request, _earliest

#: longest pause (seconds) of the progress thread between polls while runs are in flight (the
#: cap of _waiting.wait_until's pace, which the thread polls at while steps move).
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
        self.deadline = deadline_of(timeout)
        self.bound = None
        self.finished = False
        self.error: BaseException | None = None
        if posted is None:
            self.steps = plan.steps()
            self.requests = self.rest = None
        else:  # _start_lean posted the first step: (its requests, the rest of the flat run)
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
            if lock.acquire(False):  # not blocking (positional: a keyword costs more here)
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
        alarm = self.plan._alarm  # (._revoke: another rank's give-up ends the wait)

        def finished() -> bool:
            """Advance the runs if the lock is free (else the thread is advancing them: look
            again after a pause); whether this run has ended."""
            if not lock.acquire(False):  # (not blocking)
                return False
            try:
                if stop is None:
                    # alone and without deadline: block in MPI step by step, as a blocking run
                    # does (runs holds this run until it ends), hearing the alarm
                    while len(runs) == 1 and runs[0] is self:
                        if self.rest is not None:  # lean, untouched: finished by wait()
                            break
                        if self.requests is not None:
                            if alarm is None:
                                MPI.Request.Waitall(self.requests)
                            else:
                                WatchedWait(self.requests, alarm, self._heard)()
                        self.advance()
                if not self.finished:
                    engine.progress()
                    if not self.finished and alarm is not None and alarm.test() is not None:
                        self._heard()
                return self.finished
            finally:
                lock.release()

        if wait_until(finished, stop):  # (the one wait loop; past stop, the deadline below)
            return self._ended()
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

    def _heard(self) -> None:
        """Another rank gave up (its alarm came): abandon the run, revoke here too and raise
        CommunicatorRevoked (engine lock held, caller's thread)."""
        self.engine.runs.remove(self)
        self.finished = True
        if self.steps is not None:
            self.steps.close()
        self.plan.heard(self.requests or [], self.bound)

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
        # The thread sleeps between looks (_look): it never spins against the caller. While
        # steps move it looks at the one wait's pace (_waiting.wait_until without spin:
        # 50 µs doubling to 1 ms, PAUSE_MAX), again from 50 µs after each step that moved;
        # otherwise the look says how long to sleep (GRACE_SECONDS doubling to
        # FRESH_PAUSE_MAX while it finds only new runs, PAUSE_MAX without runs), or that the
        # thread exits (IDLE_SECONDS without runs).
        looks = _Looks(self)
        pause = GRACE_SECONDS
        while pause is not None:
            if pause is _MOVED:
                wait_until(looks.steps_idle_over, None, spin=0, yield_seconds=0)
            else:
                time.sleep(pause)
                looks.look()
            pause = looks.pause


#: what a look returns after a step moved: look again at wait_until's pace
_MOVED = object()


class _Looks:
    """The progress thread's looks at its engine's runs, and what each one leaves: ``pause``,
    the next sleep (seconds), :data:`_MOVED`, or None (the thread exits)."""

    __slots__ = ("engine", "seen", "fresh", "idle_since", "pause", "in_flight")

    def __init__(self, engine: _Engine):
        self.engine = engine
        self.seen: tuple = ()  # the runs in flight at the last look
        self.fresh = False  # whether the last look found only runs started since the one before
        self.idle_since: float | None = None
        self.pause = GRACE_SECONDS
        self.in_flight = False  # whether the last look found runs in flight and moved none

    def steps_idle_over(self) -> bool:
        """Look; whether the pace changes (a step moved, or no run or only new ones found)."""
        self.look()
        return not self.in_flight

    def look(self) -> None:
        engine = self.engine
        self.in_flight = False
        runs = tuple(engine.runs)  # (a copy without the lock: only the lock's holder advances)
        if runs and not any(run in self.seen for run in runs):
            # Every run in flight started since the last look (a caller that starts and
            # waits in a loop completes its own runs): leave them to the caller for one
            # more pause, longer while that goes on. Advancing them here would take the
            # GIL and the lock from it, and turn its flat runs into stepwise ones (a loop
            # of 8-byte recursive doubling start().wait() on a loaded 2-core machine ran
            # far slower with a thread that advanced its runs than with no thread at all);
            # every look costs the caller a wake-up on a busy core.
            self.pause = min(self.pause * 2, FRESH_PAUSE_MAX) if self.fresh else GRACE_SECONDS
            self.seen, self.idle_since, self.fresh = runs, None, True
            return
        self.seen, self.fresh = runs, False
        if not runs:
            now = time.monotonic()
            self.idle_since = now if self.idle_since is None else self.idle_since
            if now - self.idle_since > IDLE_SECONDS:
                with engine.guard:
                    # clear first, then look (see wake): a run appended by a caller who
                    # saw this thread set is seen here
                    me, engine.thread = engine.thread, None
                    if not engine.runs:
                        self.pause = None
                        return
                    engine.thread = me
                    self.idle_since = None
            self.pause = PAUSE_MAX
            return
        moved = 0
        if engine.lock.acquire(False):  # (not blocking)
            try:
                moved = engine.progress()
            finally:
                engine.lock.release()
        # Not moved: outside wait_until's pace the last pause was at least GRACE_SECONDS,
        # so the doubling has reached PAUSE_MAX
        self.pause, self.in_flight = (_MOVED, False) if moved else (PAUSE_MAX, True)


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
    plan._fast_held, plan._fast = plan._fast, None  # (_mark_in_flight, inline)
    if engine.thread is None and engine.threaded and not run.finished:
        engine.wake()
    return run


def _lean_run(engine: _Engine, plan, requests: list, rest: tuple, new=Request.__new__) -> _Run:
    """``_Run(engine, plan, None, False, (requests, rest), plan.run_ended)``, its fields set
    directly (a third of the constructor's time: this is most of a lean start at 8 bytes)."""
    run = new(_Run)
    run._result, run._work, run._finish, run._error = plan.recvbuf, run, plan.run_ended, None
    run.engine, run.plan, run.owned, run.timeout, run.deadline = engine, plan, False, None, None
    run.bound, run.finished, run.error, run.steps = None, False, None, None
    run.requests, run.rest = requests, rest
    return run
