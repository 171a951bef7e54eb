"""Exceptions raised by mpiallreduce."""

from __future__ import annotations


class ScheduleError(Exception):
    """A schedule is wrong: unmatched message, size mismatch, missing, doubled or misordered data."""


class CollectiveTimeout(TimeoutError):
    """A collective did not finish within its ``timeout``; the plan that ran it is unusable."""
