"""Timeline traces of runs: what every rank did in every step, as a Chrome Trace Event file.

    MPIALLREDUCE_TRACE=trace.json mpirun -n 4 python -m mpi4py script.py
    with mar.trace("trace.json"):          # collective over COMM_WORLD (or comm=)
        ...

While tracing, every schedule plan built (``mar.plan``, one-shot calls, ``iallreduce``, the
related collectives) binds a *traced* flat program instead of its plain one (see
:meth:`.executor.Plan._flatten`): the same calls, with a clock reading before each phase. A plan
built while tracing is off never looks at the trace, so an untraced run costs what it did.
Stepwise runs (with a timeout, or non-blocking: :meth:`.executor.Plan.steps`) record the same
phases through the same hook; native calls are not traced (MPI's ``Allreduce`` is one call: its
time is the run).

Each rank records its plan runs and, within them, every step and its phases:

- ``load`` / ``finish``: copies before the first step and after the last (and AVG's divide);
- ``copy``: copies into the result before a step's messages are posted, or out of scratch;
- ``start``: posting the step's receives and sends (``Start`` of persistent requests);
- ``wait``: waiting for them (what the peers' lateness and the transfer cost);
- ``combine``: reductions of received data (NumPy ufuncs or ``Reduce_local``). A combine the
  executor defers until the next step's messages are posted lies inside that next step and
  names its own step in ``args.step``.

A rank keeps its latest :data:`MAX_EVENTS` clock readings (``MPIALLREDUCE_TRACE_EVENTS``),
about 100 B each; runs whose start was dropped are left out of the file.

Clocks (``time.perf_counter_ns``) are aligned across ranks by a ping-pong with rank 0 when
tracing starts (``trace()``) or, with the environment variable, when the trace is written at
exit; ranks on rank 0's host share its clock and need no estimate. Rank 0 writes one JSON file:
one track per rank (thread ``rank r`` of process ``mpiallreduce``), opened by Perfetto
(ui.perfetto.dev) or chrome://tracing.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import time
from collections import deque
from functools import partial

import numpy as np
from mpi4py import MPI

from . import executor
from .schedule import COPY

#: environment variable naming the trace file of a whole run (written by rank 0 at exit).
ENV = "MPIALLREDUCE_TRACE"
#: ping-pongs per rank when aligning clocks (the one of least round trip counts).
ALIGN_ROUNDS = 16
#: environment variable: most clock readings a rank keeps (the latest; default
#: :data:`MAX_EVENTS`). A reading takes about 100 B, so a long traced run stays bounded.
EVENTS_ENV = "MPIALLREDUCE_TRACE_EVENTS"
MAX_EVENTS = 1_000_000


def _max_events() -> int:
    text = os.environ.get(EVENTS_ENV, "").strip()
    if not text:
        return MAX_EVENTS
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"{EVENTS_ENV}={text!r} is not a positive integer")
    return int(text)

_clock = time.perf_counter_ns


class Recorder:
    """One rank's trace: clock readings appended by traced programs, until :meth:`close`."""

    def __init__(self, path: str, comm: MPI.Intracomm):
        self.path = path
        self.comm = comm
        # (ns, marker), the latest _max_events() of them (a deque appends as fast as a list);
        # a marker is (plan, kind, step, opens)
        self.events: deque = deque(maxlen=_max_events())
        self.plans: list[dict] = []  # what each traced plan of this rank is (by marker[0])
        self.offsets: list[int] | None = None  # rank 0: each rank's clock minus rank 0's
        self.aligned = False
        self.origin: int | None = None  # rank 0's clock when tracing started (ns)
        self.written: str | None = None  # the file, once rank 0 wrote it

    def stamp(self, marker: tuple) -> None:
        """Record that ``marker``'s phase begins now."""
        self.events.append((_clock(), marker))

    # -- binding (plan time) ---------------------------------------------------------------------

    def program(self, plan, steps) -> tuple:
        """The traced flat program of ``plan`` (a Plan being built over ``steps``)."""
        index = len(self.plans)
        self.plans.append(_describe(plan, steps))
        plan._phase = partial(self._phase, index)  # its stepwise runs too (non-blocking, timeouts)
        return plan._flatten(plan._phase)

    def _phase(self, plan: int, kind: str, step, group) -> list:
        """``group`` of calls preceded by the stamps of its phase (see ``Plan._flatten``)."""
        group = list(group)
        if kind in ("run", "end"):
            return [partial(self.stamp, (plan, kind, None, False))]
        if kind == "combine":  # copies out of scratch and reductions, each run of them a phase
            out, previous = [], None
            for call in group:
                now = COPY if getattr(call, "func", None) is np.copyto else "combine"
                if now != previous:
                    out.append(partial(self.stamp, (plan, now, step, False)))
                    previous = now
                out.append(call)
            return out
        if not group and kind not in ("start", "wait"):
            return group
        opens = kind in ("copy", "start")  # the first phase of a step opens the step's span
        return [partial(self.stamp, (plan, kind, step, opens)), *group]

    # -- pausing and writing ---------------------------------------------------------------------

    @contextlib.contextmanager
    def paused(self):
        """Record nothing inside the block (the bench's warm-up runs), at no cost per run."""
        events, self.events = self.events, deque(maxlen=0)
        try:
            yield
        finally:
            self.events = events

    def align(self) -> None:
        """Estimate every rank's clock offset against rank 0 (collective over ``comm``)."""
        self.offsets = _offsets(self.comm)
        self.aligned = True
        if self.comm.Get_rank() == 0:
            self.origin = _clock()
        self.origin = self.comm.bcast(self.origin, root=0)

    def close(self) -> None:
        """Stop recording: gather every rank's events on rank 0, which writes the file.

        Collective over ``comm``. Plans built while tracing keep their traced programs, which
        from now on record nothing.
        """
        events, self.events = self.events, deque(maxlen=0)
        if not self.aligned:  # started by the environment: aligned now, times from the first event
            self.align()
            self.origin = None
        gathered = self.comm.gather((list(events), self.plans), root=0)
        if self.comm.Get_rank() == 0:
            document = chrome_trace(gathered, self.offsets, self.origin)
            with open(self.path, "w", encoding="utf-8") as handle:
                json.dump(document, handle)
            self.written = self.path
        self.comm.Barrier()


def _describe(plan, steps) -> dict:
    """What a trace says about a plan: its algorithm and size, and each step's messages."""
    result = plan._result
    itemsize = result.dtype.itemsize
    described = {}
    for index, step in enumerate(steps):
        if not step:
            continue
        described[index] = {
            "sends": [[send.peer, send.size * itemsize] for send in step.sends],
            "recvs": [[recv.peer, recv.size * itemsize, recv.action] for recv in step.recvs]}
    return {"name": plan._label, "algorithm": plan.algorithm, "count": int(result.size),
            "dtype": result.dtype.name, "bytes": int(result.nbytes),
            "op": plan.reducer.name if plan.reducer is not None else None,
            "ranks": plan._nranks, "steps": described}


def _offsets(comm: MPI.Intracomm) -> list[int] | None:
    """On rank 0: every rank's clock minus rank 0's, in ns (None elsewhere).

    Ranks on rank 0's host read the same monotonic clock (offset 0); others answer
    :data:`ALIGN_ROUNDS` pings with their clock, and the reading of least round trip counts
    (Cristian's algorithm: the answer is taken at the middle of the round trip).
    """
    rank, size = comm.Get_rank(), comm.Get_size()
    host = MPI.Get_processor_name()
    hosts = comm.gather(host, root=0)
    remote = comm.bcast([r for r in range(size) if hosts[r] != hosts[0]] if rank == 0 else None,
                        root=0)
    buffer = np.zeros(1, dtype=np.int64)
    tag = 0
    if rank != 0:
        if rank in remote:
            for _ in range(ALIGN_ROUNDS):
                comm.Recv(buffer, 0, tag)
                buffer[0] = _clock()
                comm.Send(buffer, 0, tag)
        return None
    offsets = [0] * size
    for peer in remote:
        best = None
        for _ in range(ALIGN_ROUNDS):
            sent = _clock()
            comm.Send(buffer, peer, tag)
            comm.Recv(buffer, peer, tag)
            back = _clock()
            if best is None or back - sent < best[0]:
                best = (back - sent, int(buffer[0]) - (sent + back) // 2)
        offsets[peer] = best[1]
    return offsets


def _event(name, start, stop, rank, args=None) -> dict:
    event = {"name": name, "cat": "mpiallreduce", "ph": "X", "ts": start / 1000,
             "dur": (stop - start) / 1000, "pid": 0, "tid": rank}
    if args:
        event["args"] = args
    return event


def _track(rank: int, events: list, plans: list[dict], shift: int) -> list[dict]:
    """Turn one rank's clock readings into nested complete events: runs, steps, phases."""
    out: list[dict] = []
    run = step = phase = None  # (start, name, args) of what is open
    runs: dict[int, int] = {}

    def close(item, at):
        if item is not None:
            out.append(_event(item[1], item[0], at, rank, item[2]))

    for item in events:
        stamp, (plan, kind, index, opens) = item
        if run is None and kind != "run":
            continue  # the oldest readings were dropped (MPIALLREDUCE_TRACE_EVENTS): a partial run
        at = stamp - shift
        described = plans[plan]
        if kind == "run":
            runs[plan] = runs.get(plan, 0) + 1
            run = (at, described["name"], {
                "algorithm": described["algorithm"], "plan": plan, "run": runs[plan],
                "count": described["count"], "dtype": described["dtype"],
                "bytes": described["bytes"], "op": described["op"], "ranks": described["ranks"]})
            continue
        close(phase, at)
        phase = None
        if kind == "end":
            close(step, at)
            close(run, at)
            run = step = None
            continue
        if kind == "finish" or (opens and (step is None or step[2]["step"] != index)):
            close(step, at)
            step = None
            if opens:
                messages = described["steps"][index]
                step = (at, f"step {index}", {
                    "step": index, "sends": messages["sends"], "recvs": messages["recvs"],
                    "bytes_sent": sum(b for _, b in messages["sends"]),
                    "bytes_received": sum(b for _, b, _ in messages["recvs"])})
        args = None
        if index is not None:
            messages = described["steps"][index]
            if kind in ("start", "wait"):
                args = {"step": index,
                        "peers": sorted({m[0] for m in messages["sends"] + messages["recvs"]}),
                        "bytes": sum(m[1] for m in messages["sends"] + messages["recvs"])}
            elif kind in ("combine", COPY):
                args = {"step": index,
                        "bytes": sum(b for _, b, action in messages["recvs"]
                                     if (action == COPY) == (kind == COPY))}
        phase = (at, kind, args)
    return out


def chrome_trace(gathered: list, offsets: list[int], origin: int | None = None) -> dict:
    """The Chrome Trace Event document of every rank's ``(events, plans)``.

    Times are µs since ``origin`` on rank 0's clock (default: the first event of any rank).
    """
    if origin is None:
        origin = min((min(e[0] for e in events) - offsets[rank]
                      for rank, (events, _) in enumerate(gathered) if events), default=0)
    trace_events: list[dict] = [
        {"name": "process_name", "ph": "M", "pid": 0, "tid": 0,
         "args": {"name": f"mpiallreduce ({len(gathered)} ranks)"}}]
    for rank, (events, plans) in enumerate(gathered):
        trace_events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": rank,
                             "args": {"name": f"rank {rank}"}})
        trace_events.append({"name": "thread_sort_index", "ph": "M", "pid": 0, "tid": rank,
                             "args": {"sort_index": rank}})
        trace_events += _track(rank, sorted(events, key=lambda e: e[0]), plans,
                               origin + offsets[rank])
    return {"traceEvents": trace_events, "displayTimeUnit": "ns",
            "otherData": {"source": "mpiallreduce", "ranks": len(gathered),
                          "clock": "time.perf_counter_ns, aligned to rank 0 (ping-pong)"}}


# -- switching on and off ------------------------------------------------------------------------

def active() -> Recorder | None:
    """The recorder new plans bind to, or None when tracing is off."""
    return executor.TRACER


def _drop_cached_calls() -> None:
    """Free the cached one-shot plans, so that the next calls bind traced (or plain) ones."""
    from . import _state

    caches = {id(entry.state.calls): entry.state.calls
              for entry in (*_state.CALLS.values(), *_state.SHAPES.values())}
    for cache in caches.values():
        cache.clear()


def _begin(recorder: Recorder) -> None:
    if executor.TRACER is not None:
        raise ValueError(f"tracing is already on (to {executor.TRACER.path}); one trace at a time")
    _drop_cached_calls()
    executor.TRACER = recorder


def _end(recorder: Recorder) -> None:
    if executor.TRACER is recorder:
        executor.TRACER = None
    _drop_cached_calls()


@contextlib.contextmanager
def trace(path: str, comm: MPI.Intracomm | None = None):
    """Record a timeline of every schedule run inside the block; rank 0 writes it to ``path``.

    Collective over ``comm`` (default COMM_WORLD) on entry (clocks are aligned) and on exit
    (rank 0 gathers every rank's events and writes one Chrome Trace Event JSON file). Plans and
    one-shot calls bound inside the block are traced; plans bound before it are not.

    Yields the :class:`Recorder` (``recorder.paused()`` skips runs; ``recorder.written`` is the
    file on rank 0 once the block ends).
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"trace needs a file name, got {type(path).__name__}")
    world = MPI.COMM_WORLD if comm is None else comm
    if executor.TRACER is not None:
        raise ValueError(f"tracing is already on (to {executor.TRACER.path}); one trace at a time")
    recorder = Recorder(os.fspath(path), world.Dup())
    try:
        recorder.align()
        _begin(recorder)
        try:
            yield recorder
        finally:
            _end(recorder)
        recorder.close()
    finally:
        recorder.comm.Free()


def _at_exit(recorder: Recorder) -> None:
    if MPI.Is_finalized() or executor.TRACER is not recorder:
        return
    _end(recorder)
    recorder.comm = MPI.COMM_WORLD.Dup()  # the alignment's messages never match the user's
    try:
        recorder.close()
    finally:
        recorder.comm.Free()


def _from_environment() -> None:
    """``MPIALLREDUCE_TRACE=FILE``: trace the whole run, written at exit (clocks aligned then)."""
    path = os.environ.get(ENV, "").strip()
    if not path or executor.TRACER is not None:
        return
    recorder = Recorder(path, MPI.COMM_WORLD)
    executor.TRACER = recorder
    atexit.register(_at_exit, recorder)


_from_environment()
