"""Waiting for MPI requests with a deadline: the one polling loop of the package.

``poll`` tests requests back to back, then at a backing-off pace (:func:`patience`) until a
deadline; ``wait_or_fail`` turns a missed deadline into the caller's failure (the communicator
marked unusable, CollectiveTimeout raised). ``check_timeout`` is the one check of a
``timeout=`` argument.
"""

from __future__ import annotations

import os
import time

from mpi4py import MPI


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
    it); then sleeps from 50 µs doubling to 1 ms between tests. A plain ``time.sleep`` of 1 µs
    sleeps ~60-90 µs on Linux, which made every short wait with a timeout that slow.
    """
    now = time.monotonic()
    if spin:
        spin_until = now + SPIN_SECONDS if deadline is None else min(now + SPIN_SECONDS, deadline)
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


def poll(requests, deadline: float) -> bool:
    """Test ``requests`` until all complete (True) or ``deadline`` (time.monotonic) passes (False).

    Tests :data:`BUSY_TESTS` times back to back (a short collective completes within a few
    tests), then at the pace of :func:`patience`.
    """
    testall = MPI.Request.Testall
    for _ in range(BUSY_TESTS):
        if testall(requests):
            return True
    for _ in patience(deadline):
        if testall(requests):
            return True
    return testall(requests)


def wait_or_fail(requests, deadline: float, fail, reason) -> None:
    """Poll ``requests`` up to ``deadline``; past it call ``fail(reason(), requests)``, which
    marks the communicator unusable and raises CollectiveTimeout: the one way a polled
    collective of the package ends in a timeout. ``reason`` is only built when needed."""
    if not poll(requests, deadline):
        fail(reason(), requests)
        raise AssertionError("fail() must raise")  # pragma: no cover
