"""The entry points of ``reproducible=True``: ``allreduce`` (through the call cache), ``plan``
and ``iallreduce``, with the argument check that marks the call reproducible."""

from __future__ import annotations

import time

import numpy as np

from .. import _plans
from .._agree import prepare
from .._checks import allreduce_call
from .._state import state as comm_state
from ..nonblocking import Request, start
from .elementwise import GATHER_RANKS, ReproduciblePlan, _Agreed
from .formats import _float_view, check


def _checked_call(sendbuf, recvbuf, op, comm, algorithm, topology, params):
    call = allreduce_call(sendbuf, recvbuf, op, comm, algorithm, topology, params)
    check(call.reducer.name, call.recv.dtype)
    return call


class _Carry:
    """What a one-shot call's argument check carries over shared memory (as the plan's
    :meth:`ReproduciblePlan.carry_word` would): the bits of a one-value float64 call on at most
    :data:`GATHER_RANKS` ranks (0 for other calls); after the check, every rank's (``words``),
    or None (the check ran as a collective, or did not run)."""

    def __init__(self):
        self.words = None

    @staticmethod
    def word(agreed) -> int:
        call = agreed.call
        if call.recv.size != 1 or call.recv.dtype != np.float64 \
                or call.comm.Get_size() > GATHER_RANKS:
            return 0
        return int(_float_view(call.recv if call.send is None else call.send).view(np.int64)[0])


def _prepare(what, sendbuf, recvbuf, op, comm, algorithm, topology, check_args, timeout, params,
             carry=None):
    agreed = prepare(what, comm, check_args, lambda comm: _Agreed(_checked_call(
        sendbuf, recvbuf, op, comm, algorithm, topology, params)), timeout=timeout, carry=carry,
        checks_itself=_checks_itself if what == "allreduce" else None)
    return agreed.call


def _checks_itself(agreed, state) -> bool:
    """Does this one-shot call's run check its arguments itself (``_plans.checks_itself``)?
    One float64 on 2 to GATHER_RANKS ranks whose run is ``shm`` (see ``_init_gathered``)."""
    call = agreed.call
    return (call.recv.size == 1 and call.recv.dtype == np.float64
            and 1 < state.private.Get_size() <= GATHER_RANKS
            and _plans.checks_itself(call, state, learned=False))  # (binds by the rules)


class _Entry(_plans.BoundCall):
    """A one-shot reproducible plan kept in the communicator's call cache
    (:class:`._plans.BoundCall`), with its call's signature (reproducible marked) packed for the
    agreement check. The check carries a one-value plan's bits where it runs over shared memory
    (``carried``: every rank's, for the run that follows)."""

    #: carried: every rank's word that the argument check over shared memory brought along
    #: (the one float64 of a gathering plan, :meth:`ReproduciblePlan.carry_word`), for the run
    #: that follows; None where the check ran as a collective
    __slots__ = ("plan", "carried")

    def __init__(self, plan: ReproduciblePlan, call, state, objects: tuple):
        super().__init__(call, state, objects, _Agreed(call).signature)
        self.plan, self.carried = plan, None
        self.nbytes = plan.nbytes
        self.fused = plan.fused  # the run checks the arguments itself
        self.result = plan.recvbuf
        if plan.fused:
            # the shm run without deadline and without the plan's own checks (the cache drops
            # the entry before its plan is freed or its communicator breaks)
            self.direct, self.args = plan._inner.direct, ()

    def agree(self, timeout) -> None:
        """The agreement of a repeated call, carrying this rank's bits where it runs over
        shared memory (the one constant-size check every call makes, so a rank whose call
        differs gets the same error as the others)."""
        signature = self.signatures[timeout is not None]
        signature.shm[-1] = self.plan.carry_word()
        signature.carried = None
        _plans.BoundCall.agree(self, timeout)
        self.carried = signature.carried

    def run(self, timeout: float | None) -> np.ndarray:
        carried, self.carried = self.carried, None
        plan = self.plan
        if carried is not None and plan.carries:
            return plan.run_carried(carried, timeout)
        return plan.run(timeout)

    def free(self) -> None:
        self.plan.free()


def allreduce(sendbuf, recvbuf, op, comm, algorithm, topology, check_args, timeout, params):
    """``mpiallreduce.allreduce(..., reproducible=True)``: a plan bound once per set of arrays.

    A repeated call with the same arrays (and communicator, op, algorithm, topology and
    parameters) skips the local checks and the binding, as plain calls do: both go through
    :func:`._plans.cached_call`.
    """
    return _plans.cached_call(_plans.REPRODUCIBLE, _bind, sendbuf, recvbuf, op, comm, algorithm,
                              topology, check_args, timeout, params)


def _bind(slot, sendbuf, recvbuf, op, comm, algorithm, topology, check_args, timeout, params):
    """A reproducible allreduce the call cache does not hold (:func:`._plans.cached_call`,
    whose arguments these are): checked, bound, run and kept."""
    # a one-value call's value rides in the check, as a cached call's does (_Entry.agree):
    # ranks whose caches differ still run alike
    carry = _Carry()
    call = _prepare("allreduce", sendbuf, recvbuf, op, comm, algorithm, topology, check_args,
                    timeout, params, carry)
    if call.recv.size == 0:
        return call.recv
    state = comm_state(call.comm)
    deadline = None if timeout is None else time.monotonic() + timeout
    bound = ReproduciblePlan(call, state, explicit=False, timeout=None, deadline=deadline,
                             what="allreduce")

    def run():
        if carry.words is not None and bound.carries:
            return bound.run_carried(carry.words, timeout)
        return bound.run(timeout)

    key = _plans.call_key(slot, comm, sendbuf, op, algorithm, topology, params)
    if key is not None and _plans.cacheable(sendbuf, recvbuf, call) and state.calls.put(
            key, _Entry(bound, call, state, (comm, sendbuf, recvbuf, op, topology))):
        return run()
    try:
        return run()
    finally:
        bound.free()


def plan(sendbuf, recvbuf, op, comm, algorithm, topology, check_args, timeout, params):
    """``mpiallreduce.plan(..., reproducible=True)``: a persistent :class:`ReproduciblePlan`."""
    call = _prepare("plan", sendbuf, recvbuf, op, comm, algorithm, topology, check_args,
                    timeout, params)
    deadline = None if timeout is None else time.monotonic() + timeout
    return ReproduciblePlan(call, comm_state(call.comm), explicit=True, timeout=timeout,
                            deadline=deadline, what="plan")


def iallreduce(sendbuf, recvbuf, op, comm, algorithm, topology, check_args, timeout, params):
    """``mpiallreduce.iallreduce(..., reproducible=True)``: a plan started once, then freed."""
    call = _prepare("iallreduce", sendbuf, recvbuf, op, comm, algorithm, topology, check_args,
                    timeout, params)
    if call.recv.size == 0:
        return Request(call.recv)
    deadline = None if timeout is None else time.monotonic() + timeout
    bound = ReproduciblePlan(call, comm_state(call.comm), explicit=True, timeout=timeout,
                             deadline=deadline, what="iallreduce")
    try:
        return start(bound, timeout)  # runs whole, now (see nonblocking.start)
    finally:
        bound.free()
