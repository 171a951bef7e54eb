"""Plan: a schedule bound once to buffers, scratch and a private communicator.

This is the only module that moves bytes (Send/Recv and their non-blocking and persistent forms).
Everything a run needs (buffer views, scratch, persistent requests) is made when the plan is
built, so :meth:`Plan.run` only starts requests, waits, and combines with NumPy ufuncs.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import numpy as np
from mpi4py import MPI

from .errors import CollectiveTimeout
from .ops import Reducer
from .schedule import COPY, Step

#: MPI guarantees tags up to 32767; a step's tag is its index modulo this.
_TAG_SPAN = 32768


@dataclass
class _Combine:
    """After a step's messages complete: reduce or copy ``scratch`` into ``target``."""

    scratch: np.ndarray
    target: np.ndarray
    action: str
    order: str


@dataclass
class _BoundStep:
    """One step bound to buffers: what to post, and what to combine once it completes."""

    index: int
    recvs: list  # (peer, view)
    sends: list  # (peer, view)
    combines: list
    requests: list  # persistent requests (persistent plans only)


def _overlaps(start: int, stop: int, ranges) -> bool:
    return any(start < hi and lo < stop for lo, hi in ranges)


def scratch_size(steps: tuple[Step, ...]) -> int:
    """Elements of scratch the steps need at once: receives that must not land in place."""
    need = 0
    for step in steps:
        sent = [(s.start, s.stop) for s in step.sends]
        need = max(need, sum(r.size for r in step.recvs
                             if r.action != COPY or _overlaps(r.start, r.stop, sent)))
    return need


class Plan:
    """A collective bound to its buffers; ``run()`` repeats it without allocating.

    Build plans with :func:`mpiallreduce.plan`, not directly. A plan is collective: every rank
    builds it and runs it the same number of times. ``free()`` (or a ``with`` block) releases
    its persistent requests; the buffers stay the caller's.
    """

    def __init__(self, comm: MPI.Intracomm, steps: tuple[Step, ...], sendbuf: np.ndarray | None,
                 recvbuf: np.ndarray, reducer: Reducer, algorithm: str, *,
                 persistent: bool = True, scratch: np.ndarray | None = None,
                 timeout: float | None = None):
        self.comm = comm
        self.algorithm = algorithm
        self.reducer = reducer
        self.timeout = timeout
        self.sendbuf = sendbuf
        self.recvbuf = recvbuf
        self._send = None if sendbuf is None else sendbuf.reshape(-1)
        self._result = recvbuf.reshape(-1)
        self._nranks = comm.Get_size()
        self._persistent = persistent
        self._broken: str | None = None
        self._freed = False
        need = scratch_size(steps)
        if scratch is None or scratch.size < need or scratch.dtype != recvbuf.dtype:
            scratch = np.empty(need, dtype=recvbuf.dtype)
        self._scratch = scratch
        self._steps = [self._bind(index, step) for index, step in enumerate(steps) if step]

    def _bind(self, index: int, step: Step) -> _BoundStep:
        result, scratch = self._result, self._scratch
        sent = [(s.start, s.stop) for s in step.sends]
        recvs, combines, offset = [], [], 0
        for recv in step.recvs:
            if recv.size == 0:
                continue
            target = result[recv.start:recv.stop]
            if recv.action == COPY and not _overlaps(recv.start, recv.stop, sent):
                recvs.append((recv.peer, target))  # lands in place: no scratch, no copy
                continue
            view = scratch[offset:offset + recv.size]
            offset += recv.size
            recvs.append((recv.peer, view))
            combines.append(_Combine(view, target, recv.action, recv.order))
        sends = [(s.peer, result[s.start:s.stop]) for s in step.sends if s.size]
        requests = []
        if self._persistent:
            tag = index % _TAG_SPAN
            requests = ([self.comm.Recv_init(view, peer, tag) for peer, view in recvs]
                        + [self.comm.Send_init(view, peer, tag) for peer, view in sends])
        return _BoundStep(index, recvs, sends, combines, requests)

    # -- running -----------------------------------------------------------------------------

    def run(self, timeout: float | None = None) -> np.ndarray:
        """Run the collective once and return the result buffer.

        Args:
            timeout: seconds to wait for the whole collective (default: the plan's). When it
                passes, raise :class:`CollectiveTimeout`; the plan is unusable afterwards.
        """
        if self._freed:
            raise ValueError("this plan has been freed")
        if self._broken:
            raise ValueError(f"this plan is unusable after an earlier failure: {self._broken}")
        timeout = self.timeout if timeout is None else timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        if self._send is not None:
            np.copyto(self._result, self._send)
        for bound in self._steps:
            if self._persistent:
                requests = bound.requests
                MPI.Prequest.Startall(requests)
            else:
                tag = bound.index % _TAG_SPAN
                requests = ([self.comm.Irecv(view, peer, tag) for peer, view in bound.recvs]
                            + [self.comm.Isend(view, peer, tag) for peer, view in bound.sends])
            if deadline is None:
                MPI.Request.Waitall(requests)
            else:
                self._wait_until(requests, bound, deadline, timeout)
            for combine in bound.combines:
                if combine.action == COPY:
                    np.copyto(combine.target, combine.scratch)
                else:
                    self.reducer.combine(combine.scratch, combine.target, combine.order)
        if self.reducer.average:
            np.divide(self._result, self._nranks, out=self._result)
        return self.recvbuf

    __call__ = run

    def _wait_until(self, requests, bound: _BoundStep, deadline: float, timeout: float) -> None:
        """Poll the step's requests until done or ``deadline``; on expiry cancel and raise."""
        pause = 1e-6
        while not MPI.Request.Testall(requests):
            if time.monotonic() > deadline:
                nrecv = len(bound.recvs)
                waiting = sorted({bound.recvs[i][0] for i, r in enumerate(requests[:nrecv])
                                  if not r.Test()})
                unsent = sorted({bound.sends[i][0] for i, r in enumerate(requests[nrecv:])
                                 if not r.Test()})
                for request in requests[:nrecv]:  # cancelling sends is deprecated in MPI-4
                    if not request.Test():
                        request.Cancel()
                peers = waiting or unsent
                self._broken = (f"{self.algorithm} timed out after {timeout:g} s in step "
                                f"{bound.index} waiting for rank(s) {peers}")
                raise CollectiveTimeout(
                    f"{self.algorithm} allreduce on rank {self.comm.Get_rank()}: no answer "
                    f"from rank(s) {', '.join(map(str, peers))} in step {bound.index} within "
                    f"{timeout:g} s; the plan is unusable now")
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)

    # -- lifetime ----------------------------------------------------------------------------

    def free(self) -> None:
        """Release the plan's persistent requests (idempotent)."""
        if self._freed:
            return
        self._freed = True
        for bound in self._steps:
            for request in bound.requests:
                if request != MPI.REQUEST_NULL:
                    # a cancelled request after a timeout may refuse; nothing leaks
                    with contextlib.suppress(MPI.Exception):
                        request.Free()
            bound.requests = []

    def __enter__(self) -> Plan:
        return self

    def __exit__(self, *exc) -> None:
        self.free()

    def __repr__(self) -> str:
        return (f"<mpiallreduce.Plan {self.algorithm} count={self._result.size} "
                f"dtype={self._result.dtype} op={self.reducer.name} ranks={self._nranks}>")


class NativePlan(Plan):
    """MPI's own ``Allreduce`` behind the Plan interface: the ground truth."""

    def __init__(self, comm, sendbuf, recvbuf, reducer: Reducer, *, timeout=None, **_):
        self.comm = comm
        self.algorithm = "native"
        self.reducer = reducer
        self.timeout = timeout
        self.sendbuf = sendbuf
        self.recvbuf = recvbuf
        self._nranks = comm.Get_size()
        self._freed = False
        self._broken = None
        self._steps = []
        self._result = recvbuf.reshape(-1)
        self._send = MPI.IN_PLACE if sendbuf is None else sendbuf

    def run(self, timeout: float | None = None) -> np.ndarray:
        """Call ``MPI_Allreduce`` (a blocking native call: ``timeout`` cannot interrupt it)."""
        if self._freed:
            raise ValueError("this plan has been freed")
        if self._result.size:
            self.comm.Allreduce(self._send, self.recvbuf, self.reducer.mpi_op)
            if self.reducer.average:
                np.divide(self._result, self._nranks, out=self._result)
        return self.recvbuf

    __call__ = run
