"""Non-blocking allreduce: ``iallreduce``, ``start(plan)`` and the :class:`Request` they return.

What runs where:

- **In the caller's thread, at the call**: the local checks, the agreement check (``check=True``)
  and binding the plan (a slot of tags of its own, scratch of its own). These are collective and
  happen in call order on every rank, as the ordering rule requires. ``algorithm="native"`` (and
  ``auto`` where it picks native) starts MPI's own ``Iallreduce`` here, on the communicator's
  private duplicate, in call order.
- **In one progress thread per communicator**: the schedule's ``run()``, queued first in, first
  out, so runs start in call order on every rank; for native requests, the ``Wait`` that drives
  MPI's progress engine. The thread exits after :data:`IDLE_SECONDS` without work and is
  started again by the next request.
- **In the caller's thread, at ``wait()``**: nothing but waiting for the thread's event (the
  result is ready then); an exception raised in the thread (``CollectiveTimeout`` etc.) is
  raised here, again on every later ``wait()``.

The thread needs ``MPI_THREAD_MULTIPLE`` (mpi4py's default). Under a lower level
(``mpi4py.rc.thread_level``) there is no thread: queued runs execute, in call order, when
``wait()`` or ``test()`` is called on any request of that communicator, and native requests are
progressed by MPI alone (``test()``/``wait()`` call ``Test``/``Wait``).
"""

from __future__ import annotations

import collections
import threading
import time
import weakref

import numpy as np
from mpi4py import MPI

from . import _plans
from ._agree import prepare
from ._checks import allreduce_call
from ._state import state as comm_state
from .errors import CollectiveTimeout
from .executor import MAX_MESSAGE, flat, poll
from .partition import segments

#: seconds a progress thread waits for work before it exits (the next request starts another).
IDLE_SECONDS = 1.0


def threaded() -> bool:
    """Whether requests progress in a thread (MPI was initialised with MPI_THREAD_MULTIPLE)."""
    return MPI.Query_thread() == MPI.THREAD_MULTIPLE


class Request:
    """A collective in flight: ``wait()`` returns its result, ``test()`` and ``done`` poll it.

    Requests on one communicator may be waited in any order. ``wait()`` and ``test()`` may be
    called again after completion: they return the same result (or raise the same exception).
    """

    def __init__(self, result, worker, finish=None):
        self._result = result
        self._worker = worker
        self._finish = finish  # run in the caller's thread once, after completion (AVG division)
        self._event = threading.Event()
        self._error: BaseException | None = None

    def _complete(self, error: BaseException | None = None) -> None:
        self._error = error
        self._event.set()

    @property
    def done(self) -> bool:
        """True once the collective has completed (or failed); does not drive progress."""
        return self._event.is_set()

    def test(self) -> bool:
        """Return True if complete (raising its exception if it failed), else False at once."""
        if not self._event.is_set():
            self._worker.drive(self, block=False)
        if not self._event.is_set():
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
        if not self._event.is_set():
            self._worker.drive(self, block=True)
            if not self._event.wait(timeout):
                raise CollectiveTimeout(
                    f"request not complete within {timeout:g} s; it is still in flight (a rank "
                    f"has not made the matching call, or is slow): wait again, or Abort")
        return self._outcome()

    def _outcome(self):
        if self._error is not None:
            raise self._error
        if self._finish is not None:
            finish, self._finish = self._finish, None
            finish()
        return self._result


class _Worker:
    """The progress of one communicator: a FIFO of jobs and (threaded) the thread running them.

    A job returns the result array when complete, or False when a non-blocking test found it
    incomplete (unthreaded mode only).
    """

    def __init__(self):
        self.cond = threading.Condition()
        self.jobs: collections.deque = collections.deque()
        self.thread: threading.Thread | None = None
        self.threaded = threaded()
        self.busy = threading.Lock()  # unthreaded: one caller drives the queue at a time

    def submit(self, request: Request, job) -> None:
        with self.cond:
            self.jobs.append((request, job))
            if not self.threaded:
                return
            if self.thread is None:
                self.thread = threading.Thread(target=self._loop, name="mpiallreduce-progress",
                                               daemon=True)
                self.thread.start()
            else:
                self.cond.notify()

    def _loop(self) -> None:
        while True:
            with self.cond:
                if not self.jobs:
                    self.cond.wait(IDLE_SECONDS)
                if not self.jobs:
                    self.thread = None  # the next submit starts a new thread
                    return
                request, job = self.jobs.popleft()
            _execute(request, job)

    def drive(self, request: Request, block: bool) -> None:
        """Unthreaded: run queued jobs in order up to ``request``.

        ``test()`` (``block=False``) only tests a native request at the head of the queue; a
        queued schedule run ahead of it runs to completion (it has no non-blocking form).
        """
        if self.threaded:
            return
        with self.busy:
            while not request.done:
                with self.cond:
                    if not self.jobs:
                        return
                    queued, job = self.jobs[0]
                if not block and isinstance(job, _NativeWait) and not job.test():
                    return
                with self.cond:
                    self.jobs.popleft()
                _execute(queued, job)


def _execute(request: Request, job) -> None:
    try:
        result = job()
    except BaseException as exc:  # noqa: BLE001 - handed to wait(), whatever it is
        request._complete(exc)
        return
    request._result = result
    request._complete()


_WORKERS: dict = {}
_WORKERS_LOCK = threading.Lock()


def _worker(comm: MPI.Comm) -> _Worker:
    """The worker of a private communicator (one per communicator object, dropped with it)."""
    key = id(comm)
    with _WORKERS_LOCK:
        found = _WORKERS.get(key)
        if found is None or found[0]() is not comm:
            found = (weakref.ref(comm, lambda _: _WORKERS.pop(key, None)), _Worker())
            _WORKERS[key] = found
        return found[1]


def _run_job(plan, timeout, owned: bool):
    def job():
        try:
            return plan.run(timeout)
        finally:
            if owned:
                plan.free()
    return job


class _NativeWait:
    """Wait for (or test) native requests, polled up to a deadline when a timeout is set."""

    def __init__(self, requests, state, timeout, result):
        self.requests, self.state, self.timeout, self.result = requests, state, timeout, result

    def __call__(self):
        if self.timeout is None:
            MPI.Request.Waitall(self.requests)
            return self.result
        if not poll(self.requests, time.monotonic() + self.timeout):
            reason = (f"native iallreduce on rank {self.state.private.Get_rank()}: not complete "
                      f"within {self.timeout:g} s (MPI does not say which rank is missing)")
            self.state.mark_broken(reason, list(self.requests))
            raise CollectiveTimeout(reason)
        return self.result

    def test(self) -> bool:
        return MPI.Request.Testall(self.requests)


def iallreduce(sendbuf, recvbuf=None, op=MPI.SUM, comm=None, algorithm="auto", topology=None,
               check=True, timeout=None, **params) -> Request:
    """Start an allreduce and return a :class:`Request`; ``wait()`` returns the result.

    Arguments as :func:`mpiallreduce.allreduce`; ``timeout`` bounds the set-up and the run.
    The checks and the plan's binding happen now, in the caller's thread and in call order; the
    run happens in the communicator's progress thread (module docstring). Do not touch
    ``recvbuf`` (or write ``sendbuf``) until the request completes. Requests and blocking
    calls on one communicator are issued in the same order on every rank.
    """
    call = prepare("iallreduce", comm, check, lambda comm: allreduce_call(
        sendbuf, recvbuf, op, comm, algorithm, topology, params), timeout=timeout)
    state = comm_state(call.comm)
    worker = _worker(state.private)
    if call.recv.size == 0:
        request = Request(call.recv, worker)
        request._complete()
        return request
    private = state.private
    if _plans.resolve(call, private.Get_size()) == "native":
        private = state.nonblocking_comm(timeout, "iallreduce")
        result = flat(call.recv)
        send = None if call.send is None else flat(call.send)
        requests = [private.Iallreduce(MPI.IN_PLACE if send is None else send[lo:hi],
                                       result[lo:hi], call.reducer.mpi_op)
                    for lo, hi in segments(0, result.size, MAX_MESSAGE) if hi > lo]
        finish = None
        if call.reducer.average:
            finish = lambda: np.divide(result, private.Get_size(), out=result)
        request = Request(call.recv, worker, finish)
        worker.submit(request, _NativeWait(requests, state, timeout, call.recv))
        return request
    deadline = None if timeout is None else time.monotonic() + timeout
    plan = _plans.build(call, state, explicit=True, persistent=False, timeout=timeout,
                        deadline=deadline, what="iallreduce")
    request = Request(call.recv, worker)
    worker.submit(request, _run_job(plan, timeout, owned=True))
    return request


def start(plan, timeout: float | None = None) -> Request:
    """Start a persistent plan (from :func:`mpiallreduce.plan`) without waiting for it.

    The run happens in the progress thread of the plan's communicator, in start order;
    ``wait()`` returns the plan's result buffer (a freed or unusable plan raises there). A plan
    cannot be started again before its request completes. Start plans in the same order on
    every rank.
    """
    pending = _RUNNING.get(plan)
    if pending is not None and not pending.done:
        raise ValueError("this plan is still running; wait() for its request before "
                         "starting it again")
    worker = _worker(plan.comm)
    request = Request(plan.recvbuf, worker)
    _RUNNING[plan] = request
    worker.submit(request, _run_job(plan, timeout, owned=False))
    return request


_RUNNING: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
