"""mpi4py's request interface for mar.Comm: Wait/Test/Free over mpiallreduce's requests, and
Start over a plan (a persistent request, as ``MPI.Prequest``).

``Comm.Iallreduce`` returns a :class:`CommRequest` over :func:`mpiallreduce.iallreduce`'s request;
``Comm.Allreduce_init`` a :class:`CommPrequest` over :func:`mpiallreduce.plan`. Neither is an
``MPI.Request``: pass them to their own ``Wait()``, not to ``MPI.Request.Waitall``.
"""

from __future__ import annotations

from . import _hooks


class CommRequest:
    """mpi4py's request interface over an mpiallreduce request (``mar.iallreduce``).

    Offers ``Wait``/``Test``/``Free`` and the lowercase ``wait``/``test``. It is not an
    ``MPI.Request``: pass it to ``Wait()``, not to ``MPI.Request.Waitall``.
    """

    __slots__ = ("_request", "_done")

    def __init__(self, request=None):
        self._request = request  # an mpiallreduce request with wait()/test()
        self._done = request is None

    def Wait(self, status=None) -> bool:
        """Complete the collective."""
        if not self._done:
            self._request.wait()
            self._done = True
        return True

    def Test(self, status=None) -> bool:
        """Return whether the collective is complete."""
        if not self._done:
            self._done = bool(self._request.test())
        return self._done

    def Free(self) -> None:
        """Complete the collective (the other ranks' parts need this rank's), then drop it."""
        self.Wait()

    def wait(self, status=None):
        """Complete the collective (mpi4py's lowercase ``wait``)."""
        self.Wait(status)

    def test(self, status=None):
        """Return (complete, None), as mpi4py's lowercase ``test``."""
        return self.Test(status), None

    def __bool__(self) -> bool:
        return not self._done


class CommPrequest(CommRequest):
    """A persistent allreduce over :func:`mpiallreduce.plan`: Start/Wait/Test, as ``Prequest``.

    The plan is built (and, with ``check``, agreed across ranks) when the request is made, as
    ``MPI_Allreduce_init`` is collective. ``Start`` starts the plan (``Plan.start``); an
    inactive request completes at once, as MPI's does.
    """

    __slots__ = ("_plan", "_starter")

    def __init__(self, bound):
        super().__init__()
        self._plan = bound
        # mpiallreduce.start, as the plan's start() calls it (this request waits, not the plan)
        self._starter = _hooks.starter

    def Start(self) -> None:
        """Start the collective; the request must be inactive (waited for)."""
        if not self._done:
            raise ValueError("Start on an active persistent request; Wait for it first")
        self._request = self._starter(self._plan, None)
        self._done = False

    def Free(self) -> None:
        """Complete the collective, then free the plan."""
        self.Wait()
        self._plan.free()

    def __bool__(self) -> bool:
        return True
