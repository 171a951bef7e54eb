"""The non-blocking entry points: ``iallreduce`` (through the call cache) and ``start(plan)``.

Checks, agreement and binding happen here, in the caller's thread and in call order; the
request's work is MPI's (:mod:`.native`) or a schedule's run (:mod:`.progress`).
"""

from __future__ import annotations

import time

import numpy as np
from mpi4py import MPI

from .. import _form, _hooks, _plans
from .._agree import prepare
from .._checks import allreduce_call
from .._state import state as comm_state
from .._waiting import deadline_of
from ..executor import MAX_MESSAGE, Plan, _untraced, flat
from ..native_plan import NativePlan
from ..partition import segments
from .native import _DROPPED, _NativeWork, _tidy
from .progress import _schedule_request, _start_lean
from .requests import Request


def iallreduce(sendbuf, recvbuf, op, comm, algorithm, topology, check, timeout,
               params: dict) -> Request:
    """Start an allreduce and return a :class:`Request`; ``wait()`` returns the result
    (:func:`mpiallreduce.iallreduce`, whose arguments these are, ``params`` as a dict).

    Arguments as :func:`mpiallreduce.allreduce`; ``timeout`` bounds the set-up and the run.
    The checks and the plan's binding happen now, in the caller's thread and in call order;
    how the run progresses is in the module docstring. Do not touch ``recvbuf`` (or write
    ``sendbuf``) until the request completes. Requests and blocking calls on one communicator
    are issued in the same order on every rank.

    As :func:`mpiallreduce.allreduce` does, a repeated call with the same objects finds what its
    first call set up (the agreement's signature, MPI's arguments or the bound plan, in the
    communicator's call cache) and costs the agreement (if ``check``) and the start.
    """
    if _DROPPED:
        _tidy()
    return _plans.cached_call(_plans.IALLREDUCE, _bind, sendbuf, recvbuf, op, comm, algorithm,
                              topology, check, timeout, params)


def _bind(slot, sendbuf, recvbuf, op, comm, algorithm, topology, check, timeout, params):
    """An iallreduce the call cache does not hold (:func:`._plans.cached_call`, whose arguments
    these are): checked, set up (kept where it can be) and started."""
    call = prepare("iallreduce", comm, check, lambda comm: allreduce_call(
        sendbuf, recvbuf, op, comm, algorithm, topology, params), timeout=timeout,
        checks_itself=_plans.checks_itself)
    if call.recv.size == 0:
        return Request(call.recv)
    state = comm_state(call.comm)
    deadline = deadline_of(timeout)
    entry = _Started(call, state, (comm, sendbuf, recvbuf, op, topology), deadline)
    key = _plans.call_key(slot, comm, sendbuf, op, algorithm, topology, params)
    if key is not None and _plans.cacheable(sendbuf, recvbuf, call) and state.calls.put(key, entry):
        return entry.run(timeout)
    return entry.run(timeout, once=True)


class _Started(_plans.BoundCall):
    """What an ``iallreduce`` sets up, kept for the next call with the same objects
    (:class:`._plans.BoundCall`: ``run`` starts one).

    Three kinds, by what the call resolves to (the same on every rank):

    - MPI's own collective: the arguments of ``Iallreduce`` on the duplicate kept for
      non-blocking collectives (the MPI datatype given, so mpi4py need not infer it);
    - a schedule: a plan of its own (its scratch too) posted step by step, which takes the
      communicator's next slot of tags at every start. Every rank takes one slot per schedule
      ``iallreduce``, whether its cache found the entry or not, so slot numbers stay equal
      across ranks even where one rank's cache has dropped an entry another kept. Started
      again before its request completed, it binds a plan for that one run;
    - a plan without steps (the shared-memory transport): it runs whole at the start.
    """

    __slots__ = ("call", "plan", "pieces", "iallreduce", "nranks", "average", "recv", "work",
                 "lean")
    what = "iallreduce"

    def __init__(self, call, state, objects: tuple, deadline: float | None):
        super().__init__(call, state, objects)
        self.call = call
        self.recv = call.recv
        self.nranks = state.private.Get_size()
        self.average = call.reducer.average
        self.plan = self.pieces = self.iallreduce = self.work = None
        if _plans.resolve(call, self.nranks, state, deadline, "iallreduce") == "native":
            self.iallreduce = state.nonblocking_comm(
                None if deadline is None else max(deadline - time.monotonic(), 1e-9),
                "iallreduce").Iallreduce
            result, send = flat(call.recv), None if call.send is None else flat(call.send)
            try:
                datatype = MPI.Datatype.fromcode(call.recv.dtype.char)
            except (KeyError, ValueError):
                datatype = None
            typed = (lambda buf: buf) if datatype is None else (lambda buf: [buf, datatype])
            self.pieces = [(MPI.IN_PLACE if send is None else typed(send[lo:hi]),
                            typed(result[lo:hi]), call.reducer.mpi_op)
                           for lo, hi in segments(0, result.size, MAX_MESSAGE) if hi > lo]
        else:
            self.plan = _plans.build(call, state, explicit=False, persistent=False,
                                     timeout=None, deadline=deadline, what="iallreduce")
        send_bytes = 0 if call.send is None else call.send.nbytes
        self.nbytes = call.recv.nbytes + send_bytes + (0 if self.plan is None else self.plan.nbytes)
        # fused: the run checks the call's arguments itself (an shm plan compares the
        # agreement's fields in its headers), so a repeated call makes no separate agreement
        self.fused = self.plan is not None and _plans.fused(self.plan)
        self.result = None
        if self.fused:
            # a cached shm plan's run without the checks of run() (the call cache drops the
            # entry before its plan is freed or its communicator breaks), as allreduce's: whole
            # at the start, so the call returns one complete request
            self.direct, self.args, self.result = self.plan.direct, (), Request(self.recv)
        # lean (Plan.lean_program): whether a start without deadline may post the first step
        # from the flat program, a wait with nothing else in flight running the rest of it
        # (_start_lean: untraced, one step at least); None: no steps to progress
        self.lean = None
        if self.plan is not None and hasattr(self.plan, "steps"):
            self.lean = self.plan._phase is _untraced and bool(self.plan._program)

    def run(self, timeout: float | None, once: bool = False) -> Request:
        """Start one run; ``once``: the entry is not kept (its plan is freed after the run)."""
        pieces = self.pieces
        if pieces is not None:
            if timeout is None and len(pieces) == 1:
                # one request without deadline: the work object of the entry's last request
                # again, which its completion handed back (a request in flight holds its work
                # alone, so one dropped in flight is kept by _NativeWork.__del__)
                send, recv, op = pieces[0]
                request = self.iallreduce(send, recv, op)
                work = self.work
                if work is None:
                    work = _NativeWork([request], None, None, self.fail, self.where, self,
                                       self.state)
                else:
                    self.work = None
                    work.requests[0] = request
                    if work.state is None:  # (a watched join reads the list itself)
                        work.join = request.Wait
                return Request(self.recv, work, work.back)
            deadline = deadline_of(timeout)
            requests = [self.iallreduce(*args) for args in pieces]
            work = _NativeWork(requests, deadline, timeout, self.fail, self.where, self,
                               self.state)
            return Request(self.recv, work, self.finish if self.average else None)
        plan = self.plan
        if self.lean is None:  # no steps of its own: runs whole now, in call order
            return _schedule_request(plan, timeout, owned=once)
        tag_base = self.state.take_slot()  # on every rank, hit or miss (see the class docstring)
        if timeout is None and self.lean and not once and plan._in_flight is None:
            plan._tag_base = tag_base
            return _start_lean(plan)
        if once:
            plan._tag_base = tag_base
            return _schedule_request(plan, timeout, owned=True)
        if plan._in_flight is not None:  # the same buffers again before the last wait
            plan = _plans.build(self.call, self.state, explicit=False, persistent=False,
                                timeout=None, what="iallreduce")
            plan._tag_base = tag_base
            return _schedule_request(plan, timeout, owned=True)
        plan._tag_base = tag_base
        plan._mark_in_flight(True)
        request = _schedule_request(plan, timeout, owned=False, finish=plan.run_ended)
        plan._in_flight = request
        return request

    def finish(self, ok: bool) -> None:
        if ok:  # AVG: MPI's SUM, divided here
            np.divide(self.recv, self.nranks, out=self.recv)

    def fail(self, reason: str, pending) -> None:
        self.state.fail(reason, pending, (self,))

    def where(self) -> str:
        return f"native iallreduce on rank {self.state.private.Get_rank()}"

    def free(self) -> None:
        # a plan with a run in flight is left to its run (a posted plan holds no persistent
        # requests; the collector releases it)
        if self.plan is not None and self.plan._in_flight is None:
            self.plan.free()


def start(plan, timeout: float | None = None) -> Request:
    """Start a persistent plan (from :func:`mpiallreduce.plan`) without waiting for it.

    A native plan starts MPI's persistent request (``Allreduce_init``, made on the first start);
    a schedule posts its first step and progresses as the module docstring says; a plan without
    steps of its own (``reproducible=True``, the shared-memory transport) runs whole at the
    start, in call order, and its request is complete. ``wait()``
    returns the plan's result buffer. Until the request completes, ``run()``, ``start()`` and
    ``free()`` on the plan raise ValueError. Start plans in the same order on every rank.
    """
    if timeout is None and type(plan) is NativePlan and plan._fast is not None \
            and plan.timeout is None and plan._persistent is not None \
            and (plan._state is None or not plan._state.broken):
        # the repeated start of a native plan of one piece (_fast: not freed, broken, running
        # or AVG), without deadline: MPI's persistent request, started
        work = plan._work
        if work is None:  # the same requests every start, no deadline: one work object
            work = plan._work = _NativeWork(plan._persistent, None, None, plan.fail, plan.where,
                                            plan, plan._state)
        plan._persistent[0].Start()
        request = Request(plan.recvbuf, work, plan.run_ended)
        plan._in_flight = request
        plan._fast_held, plan._fast = plan._fast, None  # (_mark_in_flight, inline)
        return request
    if timeout is None and type(plan) is Plan and plan._fast is not None \
            and plan.timeout is None and plan._phase is _untraced and plan._program \
            and (plan._state is None or not plan._state.broken):
        return _start_lean(plan)
    if not hasattr(plan, "steps") and type(plan) is not NativePlan:
        # no steps of its own: runs whole now, in call order; its request is complete (the
        # same one every start: a complete request never changes)
        result = plan.run(timeout)
        done = plan._done
        if done is None or done._result is not result:
            done = plan._done = Request(result)
        return done
    timeout, _ = plan._start(timeout)  # refuses a freed, broken or running plan
    plan._mark_in_flight(True)
    if isinstance(plan, NativePlan):
        requests = plan.persistent_requests()
        MPI.Prequest.Startall(requests)
        deadline = deadline_of(timeout)
        request = Request(plan.recvbuf, _NativeWork(requests, deadline, timeout, plan.fail,
                                                    plan.where, plan, plan._state),
                          plan.run_ended)
    else:
        request = _schedule_request(plan, timeout, owned=False, finish=plan.run_ended)
    plan._in_flight = request
    return request


if _form.compiled is not None:
    # the compiled twin of start (the repeated start of a small shm plan), and the compiled
    # iallreduce's binding (mpiallreduce._compiled)
    _form.compiled.install_nonblocking(start, _bind, _DROPPED, _tidy)
    _form.compiled.start.__doc__ = start.__doc__
    _form.compiled.start.__wrapped__ = start
    start = _form.compiled.start  # noqa: F811

_hooks.set_starter(start)
