"""MPI's own ``Allreduce`` behind the plan interface (:class:`NativePlan`): the ground truth
every algorithm is checked against, and what ``auto`` picks where MPI's is fastest."""

from __future__ import annotations

from functools import partial

import numpy as np
from mpi4py import MPI

from . import _hooks
from ._revoke import ready_or_heard
from ._waiting import MPI_CANNOT_SAY, wait_until
from .executor import MAX_MESSAGE, _PlanBase, flat
from .ops import Reducer
from .partition import segments


class NativePlan(_PlanBase):
    """MPI's own ``Allreduce`` behind the Plan interface: the ground truth.

    Without a timeout each run is one blocking ``Allreduce`` per piece of at most
    :data:`MAX_MESSAGE` elements; with one, ``Iallreduce`` polled up to the deadline (MPI cannot
    cancel a collective, so after a timeout the plan and the communicator are unusable).

    MPI matches collectives on one communicator by order alone, so an explicit plan runs on a
    communicator of its own (``owned``, freed with the plan): two native plans run in different
    orders on different ranks then wait for each other instead of swapping results. One-shot
    calls share the communicator's private duplicate, matched in call order as MPI's are.
    """

    algorithm = "native"

    def __init__(self, comm, sendbuf, recvbuf, reducer: Reducer, *, timeout=None, state=None,
                 owned: bool = False):
        super().__init__(comm, sendbuf, recvbuf, reducer, timeout=timeout, state=state,
                         owned_comm=comm if owned else None)
        send = None if sendbuf is None else flat(sendbuf)
        self.pieces = [(MPI.IN_PLACE if send is None else send[start:stop], self._result[start:stop])
                        for start, stop in segments(0, self._result.size, MAX_MESSAGE)
                        if stop > start]
        self._op = reducer.mpi_op
        self._persistent: list | None = None  # MPI's persistent requests, made on first start
        self._work = None  # what a start without deadline waits for (set by .nonblocking)
        if len(self.pieces) == 1 and not self._average:  # the run without deadline: one call
            self._fast = (partial(comm.Allreduce, *self.pieces[0], self._op),)
        tracer = _hooks.tracer
        if tracer is not None:  # tracing (.tracing): each run one span, bound now
            self.run = tracer.marks(self, "native", "one call").around(self.run)

    def persistent_requests(self) -> list:
        """MPI's own persistent ``Allreduce_init`` requests, one per piece, made on the first
        call (collective: the plan's first start happens at the same point on every rank)."""
        if self._persistent is None:
            self._persistent = [self.comm.Allreduce_init(send, recv, self._op)
                                for send, recv in self.pieces]
            self._requests.extend(self._persistent)
        return self._persistent

    def average(self) -> None:
        """Divide the result by p where the op is AVG (after a run of MPI's SUM)."""
        if self._average:
            np.divide(self._result, self._nranks, out=self._result)

    def run_ended(self, ok: bool) -> None:
        """A started run of MPI's persistent request completed: divide for AVG, run again."""
        super().run_ended(ok)
        if ok:
            self.average()

    def where(self) -> str:
        """This plan's started run, as a timeout message names it."""
        return f"native allreduce (started) on rank {self.comm.Get_rank()}"

    @property
    def nbytes(self) -> int:
        return 0

    def run(self, timeout: float | None = None) -> np.ndarray:
        """Call MPI's ``Allreduce`` (``Iallreduce`` polled up to ``timeout`` when one is set)."""
        fast, state = self._fast, self._state
        if timeout is None and fast is not None and self.timeout is None \
                and (state is None or not state.broken):
            fast[0]()
            return self.recvbuf
        timeout, deadline = self._start(timeout)
        op, comm = self._op, self.comm
        for send, recv in self.pieces:
            if deadline is None:
                comm.Allreduce(send, recv, op)
                continue
            requests = [comm.Iallreduce(send, recv, op)]
            ready = ready_or_heard(requests, self._alarm, partial(self.heard, requests))
            if not wait_until(ready, deadline):
                self.fail(f"native allreduce on rank {comm.Get_rank()}: not complete within "
                          f"{timeout:g} s (a rank did not make this call, or ranks run plans or "
                          f"calls on this communicator in different orders; {MPI_CANNOT_SAY}; "
                          f"a rank blocked in MPI's own blocking Allreduce, without timeout=, "
                          f"cannot be told and waits)", requests)
            if self._alarm is not None:  # a late rank's Iallreduce may match an abandoned one
                self._state.check_alarm(self._where())
        self.average()
        return self.recvbuf

    __call__ = run
