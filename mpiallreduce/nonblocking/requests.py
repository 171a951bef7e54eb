"""The request a non-blocking call returns (:class:`Request`), and the work protocol behind it.

A request holds its result and its *work*: what completes it, an object with

- ``join()``: complete (blocking, no deadline but the run's own), raising the run's error;
- ``poll() -> bool``: advance without blocking, True once complete;
- ``complete(until) -> bool``: wait until complete (True) or until ``until`` (time.monotonic,
  None: no limit but the run's own deadline) passes (False);
- ``waits_for() -> str``: what it still waits for, as a ``wait(timeout)`` that passed says it.

MPI's own collectives' work is :class:`.native._NativeWork`; a schedule's run is its own work
(:class:`.progress._Run`, a Request subclass).
"""

from __future__ import annotations

from .. import _form
from .._threads import GUARDED, guard_methods
from .._waiting import check_timeout, deadline_of
from ..errors import CollectiveTimeout


class Request(_form.compiled.RequestFields if _form.compiled is not None else object):
    """A collective in flight: ``wait()`` returns its result, ``test()`` and ``done`` poll it.

    Requests on one communicator may be waited in any order. ``wait()`` and ``test()`` may be
    called again after completion: they return the same result (or raise the same exception).
    """

    # (in the compiled form, the C members of ``_compiled.RequestFields``, whose ``wait``
    # returns a complete request's result and hands any other wait to :meth:`_wait`)
    __slots__ = () if _form.compiled is not None else ("_result", "_work", "_finish", "_error")

    def __init__(self, result, work=None, finish=None):
        self._result = result
        self._work = work  # None once complete: see _NativeWork and _Run (join/poll/complete)
        self._finish = finish  # run once in the caller's thread on completion (AVG, run_ended)
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
                if not self._progress(deadline_of(timeout), block=True):
                    raise CollectiveTimeout(
                        f"request not complete within {timeout:g} s; it is still in flight: "
                        f"{work.waits_for()}; wait again, or Abort")
        if self._error is not None:
            raise self._error
        return self._result

    _wait = wait

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


if _form.compiled is not None:
    del Request.wait  # the compiled wait (RequestFields.wait), which hands the rest to _wait
    if GUARDED:  # (its own, for guard_methods to wrap)
        Request.wait = _form.compiled.RequestFields.wait
# below MPI_THREAD_MULTIPLE a second thread's wait or test is refused (.._threads)
guard_methods(Request, ("wait", "test"))


def _earliest(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else min(a, b)

