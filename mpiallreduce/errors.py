"""Exceptions raised by mpiallreduce."""

from __future__ import annotations


class ScheduleError(Exception):
    """A schedule is wrong: unmatched message, size mismatch, missing, doubled or misordered data."""


class CollectiveTimeout(TimeoutError):
    """A collective did not finish within its ``timeout``; the plan that ran it is unusable, and
    so is its communicator: mpiallreduce revokes it (see :class:`CommunicatorRevoked`)."""


class CommunicatorRevoked(RuntimeError):
    """A rank gave up on a collective on this communicator, which mpiallreduce has revoked.

    Raised on every rank: by the collective a rank's peers still wait in when it gives up (a
    timeout, an error or an interrupt in the middle of a run), and by every later mpiallreduce
    call, plan run or request on that communicator, until :func:`mpiallreduce.recover` (or a
    fresh ``Dup`` of the parent communicator). No rank returns a result holding data of the
    abandoned call. As NCCL's ``ncclCommAbort`` and ULFM's ``MPI_Comm_revoke``.

    Attributes:
        rank: the rank (of the communicator) that gave up, or None where it is not known.
        reason: what that rank said when it gave up (the call, the step, what it waited for).
    """

    def __init__(self, message: str, rank: int | None = None, reason: str = ""):
        super().__init__(message)
        self.rank = rank
        self.reason = reason


def raised_alike(error: BaseException) -> BaseException:
    """Mark ``error`` as raised by every rank of the call alike (a disagreement found by the
    argument check or a run's signatures): the call ended on every rank, so it revokes
    nothing. Returns ``error``."""
    error.mpiallreduce_alike = True
    return error


def is_alike(error: BaseException) -> bool:
    """Whether ``error`` was raised by every rank alike (:func:`raised_alike`)."""
    return getattr(error, "mpiallreduce_alike", False)
