"""MPI's own non-blocking and persistent collectives as request work (:class:`_NativeWork`),
and the requests dropped in flight that must outlive their Request (MPI-4 §6.12)."""

from __future__ import annotations

import atexit
import time
from functools import partial

from mpi4py import MPI

from .._revoke import WatchedWait, ready_or_heard
from .._waiting import MPI_CANNOT_SAY, deadline_of, poll, wait_until
from .requests import _earliest

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
        deadline = deadline_of(1.0)
        for work in _DROPPED:
            poll(work.requests, deadline)


# -- MPI's own non-blocking and persistent collectives ---------------------------------------------

class _NativeWork:
    """MPI requests: tested and waited in the caller's thread, polled when a deadline is set.

    ``deadline`` (time.monotonic) is the run's own, from ``timeout=``: past it, ``fail(reason,
    requests)`` revokes the communicator and raises. ``state``: the communicator's, whose
    alarm (:mod:`.._revoke`) every wait hears: another rank's give-up raises
    CommunicatorRevoked instead of waiting for a collective it will never join.
    """

    __slots__ = ("requests", "deadline", "timeout", "fail", "where", "keep", "join", "state")

    def __init__(self, requests: list, deadline: float | None, timeout, fail, where, keep,
                 state=None):
        self.requests, self.deadline, self.timeout, self.fail = requests, deadline, timeout, fail
        self.where = where  # names the call in a timeout message (a callable: built on failure)
        self.keep = keep  # the buffers MPI reads and writes until the requests complete
        self.state = state if state is not None and state.alarm is not None else None
        # join(): complete, or raise at the deadline (or when the alarm comes)
        if deadline is not None:
            self.join = self._wait_for_deadline
        elif self.state is not None:  # (reads self.requests at each wait: a reused work's)
            self.join = WatchedWait(requests, self.state.alarm, self._heard)
        elif len(requests) == 1:
            self.join = requests[0].Wait
        else:
            self.join = partial(MPI.Request.Waitall, requests)

    def _heard(self) -> None:
        """Another rank gave up while these requests waited: revoke here too, and raise."""
        self.state.hear(self.state.alarm.heard, self.where(), self.requests, (self.keep,))

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
        # completes it; and Request has no finalizer, a cost every request would pay.)
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
        if self.state is not None and self.state.alarm.test() is not None:
            self._heard()
        self._check_deadline()
        return False

    def complete(self, until: float | None) -> bool:
        stop = _earliest(until, self.deadline)
        if stop is None:
            MPI.Request.Waitall(self.requests)
            return True
        ready = ready_or_heard(self.requests, None if self.state is None else self.state.alarm,
                               self._heard)
        if wait_until(ready, stop):  # (the one wait loop)
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
