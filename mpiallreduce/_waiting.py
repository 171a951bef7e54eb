"""Waiting with a deadline: the one wait loop and the one deadline of the package.

The two helpers every wait of the package is written with (their names and signatures are
stable):

- ``deadline_of(timeout) -> float | None``: the ``time.monotonic()`` instant ``timeout``
  seconds from now, None for None (no deadline).
- ``wait_until(ready, deadline, on_timeout=None, *, spin=BUSY_TESTS,
  yield_seconds=SPIN_SECONDS) -> bool``: call ``ready()`` until it returns true (then True):
  ``spin`` times back to back, then giving the core away (``os.sched_yield``) between calls
  for ``yield_seconds``, then sleeping from 50 µs doubling to 1 ms between calls, up to
  ``deadline`` (None: forever). Past the deadline (``ready()`` asked once more) it calls
  ``on_timeout()``, which raises (so a timeout's reason is built only on a timeout); without
  ``on_timeout`` it returns False. Pass ``spin=0`` where ranks outnumber cores (a spinning
  rank holds the core the rank it waits for needs): it then yields at once.

In the compiled form ``wait_until`` is its twin, ``_compiled.wait_until`` (the same calls of
``ready`` at the same pace, no generator between them). ``poll`` tests MPI requests with it;
``wait_or_fail`` turns a missed deadline into the caller's failure (the communicator marked
unusable, CollectiveTimeout raised); ``meet`` is the one non-blocking barrier before a
collective set-up step. ``patience`` is the pace of ``wait_until`` as a generator (for loops
that do more than one test per round).
``check_timeout`` is the one check of a ``timeout=`` argument. ``unanswered`` words what a
timeout message says of the ranks a schedule's step waits for; :data:`MPI_CANNOT_SAY` what it
says where MPI's own collective was waited for.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from functools import partial
from typing import NoReturn

from mpi4py import MPI

from . import _form


def check_timeout(timeout) -> None:
    """Raise ValueError unless ``timeout`` is None or a positive number of seconds."""
    if timeout is None:
        return
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds or None, got {timeout!r}")


#: tests a wait with a deadline makes back to back first (a few µs: each drives MPI's progress).
BUSY_TESTS = 64
#: seconds a wait with a deadline then spins (yielding the core between tests) before it sleeps.
SPIN_SECONDS = 2e-3


def patience(deadline: float | None, spin: bool = True):
    """Yield between the tests of a wait until ``deadline`` (time.monotonic; None: forever).

    With ``spin``, yields at once for :data:`SPIN_SECONDS` while giving the core away
    (``sched_yield``: cheap when nobody else wants it, fair when more ranks than cores share
    it); then sleeps from 50 µs doubling to 1 ms between tests. A plain ``time.sleep`` of a
    microsecond sleeps far longer on Linux (the kernel's timer slack and a wake-up), which
    would make every short wait with a timeout that slow.
    """
    return _pace(deadline, SPIN_SECONDS if spin else 0.0)


def _pace(deadline: float | None, yield_seconds: float):
    """:func:`patience` with ``yield_seconds`` of yielding before the sleeps."""
    now = time.monotonic()
    if yield_seconds > 0:
        spin_until = (now + yield_seconds if deadline is None
                      else min(now + yield_seconds, deadline))
        while now < spin_until:
            os.sched_yield()
            yield
            now = time.monotonic()
    pause = 5e-5
    while deadline is None or now <= deadline:
        time.sleep(pause)
        pause = min(pause * 2, 1e-3)
        yield
        now = time.monotonic()


def deadline_of(timeout: float | None) -> float | None:
    """The ``time.monotonic()`` instant ``timeout`` seconds from now; None for None."""
    return None if timeout is None else time.monotonic() + timeout


def wait_until(ready: Callable[[], object], deadline: float | None,
               on_timeout: Callable[[], NoReturn] | None = None, *, spin: int = BUSY_TESTS,
               yield_seconds: float = SPIN_SECONDS) -> bool:
    """Call ``ready()`` until it is true (True), or until ``deadline`` (time.monotonic; None:
    never) passes: then ``on_timeout()`` (which raises), or False without one.

    ``ready()`` is called ``spin`` times back to back (0 where ranks outnumber cores), then
    between ``os.sched_yield`` calls for ``yield_seconds``, then between sleeps from 50 µs
    doubling to 1 ms (the pace of :func:`patience`); once more after the deadline passed.
    """
    for _ in range(spin):
        if ready():
            return True
    for _ in _pace(deadline, yield_seconds):
        if ready():
            return True
    if ready():
        return True
    if on_timeout is not None:
        on_timeout()
        raise AssertionError("on_timeout() must raise")  # pragma: no cover
    return False


def poll(requests, deadline: float | None) -> bool:
    """Test ``requests`` until all complete (True) or ``deadline`` (time.monotonic) passes (False).

    Tests :data:`BUSY_TESTS` times back to back (a short collective completes within a few
    tests), then at the pace of :func:`patience` (:func:`wait_until`).
    """
    return wait_until(tested(requests), deadline)


def tested(requests):
    """The ``ready()`` of a wait for ``requests``: up to :data:`EACH_MOST` of them, each one's
    own ``Test`` in turn (:class:`EachTested`), more through ``Testall`` bound to them (a poll
    through the compiled :func:`wait_until` then runs no Python frame per test)."""
    if len(requests) <= EACH_MOST:
        return EachTested(requests)
    return partial(_TESTALL, requests)


_TESTALL = MPI.Request.Testall
#: most requests a wait tests one by one: ``Testall`` builds a C array from the list on every
#: call, which costs as much as several ``Test`` calls, so up to this many one ``Test`` each
#: is cheaper.
EACH_MOST = 4


class EachTested:
    """``ready()`` for a few requests: each one's ``Test``, the last first (the sends, posted
    last, complete first), skipping those done in earlier calls; true once every one is done,
    and from then it tests them all again (a persistent plan's next run reuses it). A test
    completes its request on its own (as ``Wait`` does); the requests complete as with
    ``Testall``. The compiled form has a twin, ``_compiled.EachTested``, which ``_waiting``
    installs."""

    __slots__ = ("tests", "done")

    def __init__(self, requests):
        self.tests = tuple(request.Test for request in reversed(requests))
        self.done = 0

    def __call__(self) -> bool:
        tests, done = self.tests, self.done
        while done < len(tests):
            if not tests[done]():
                self.done = done
                return False
            done += 1
        self.done = 0
        return True


def wait_or_fail(requests, deadline: float, fail, reason) -> None:
    """Poll ``requests`` up to ``deadline``; past it call ``fail(reason(), requests)``, which
    marks the communicator unusable and raises CollectiveTimeout: the one way a polled
    collective of the package ends in a timeout. ``reason`` is only built when needed."""
    if not poll(requests, deadline):
        fail(reason(), requests)
        raise AssertionError("fail() must raise")  # pragma: no cover


def meet(comm, deadline: float, fail, doing: str) -> None:
    """Wait until every rank of ``comm`` has come here (a non-blocking barrier polled up to
    ``deadline``), before a set-up step that is collective; past it ``fail`` raises
    CollectiveTimeout, saying that ``doing`` (e.g. "allreduce on rank 1: setting up shared
    memory") did not complete."""
    wait_or_fail([comm.Ibarrier()], deadline, fail, lambda: (
        f"{doing} did not complete in time; some rank has not made this call "
        f"({MPI_CANNOT_SAY})"))


# -- what a timeout message says about the ranks waited for -----------------------------------------

#: what a timeout message says where the wait was MPI's own collective, which cannot tell
#: which rank has not arrived
MPI_CANNOT_SAY = "MPI does not say which rank is missing"


def name_ranks(ranks) -> str:
    """``"rank 2"``, ``"ranks 0 and 2"``, ``"ranks 0, 2 and 3"``."""
    ranks = [str(rank) for rank in ranks]
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return f"ranks {', '.join(ranks[:-1])} and {ranks[-1]}"


def unanswered(step: int, not_sent, not_received, call: str = "this call",
               slow: bool = False) -> str:
    """Say which peers a step of a schedule still waits for, and what each may be doing.

    ``not_sent``: the peers whose messages of ``step`` have not arrived (pending receives);
    ``not_received``: those that have not posted the receive for this rank's message (pending
    sends). A peer may itself wait for another rank that has not arrived: the message names
    what this rank knows, the peers it waits for. ``slow``: the wait may end yet (a request's
    own ``wait(timeout)``, which leaves it in flight).
    """
    parts = []
    if not_sent:
        one = len(not_sent) == 1
        parts.append(f"{name_ranks(not_sent)} {'has' if one else 'have'} not sent "
                     f"{'its' if one else 'their'} step {step} message{'' if one else 's'}")
    if not_received:
        one = len(not_received) == 1
        parts.append(f"{name_ranks(not_received)} {'has' if one else 'have'} not posted the "
                     f"receive for this rank's step {step} message")
    who = "it" if len({*not_sent, *not_received}) == 1 else "each"
    return (f"{'; '.join(parts)} ({who} has not made {call}{', or is slow' if slow else ''}, or "
            f"waits itself for a rank that has not; or ranks run plans or calls on this "
            f"communicator in different orders)")


#: the Python form's (the reference the compiled twin is tested against)
PythonEachTested = EachTested

if _form.compiled is not None:  # the compiled twins of wait_until and EachTested
    _form.compiled.install_waiting(BUSY_TESTS, SPIN_SECONDS)
    _form.compiled.wait_until.__doc__ = wait_until.__doc__
    _form.compiled.wait_until.__wrapped__ = wait_until
    wait_until = _form.compiled.wait_until  # noqa: F811
    EachTested = _form.compiled.EachTested  # noqa: F811
