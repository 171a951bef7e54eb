"""Timeline traces of runs: what every rank did in every step, as a Chrome Trace Event file.

    MPIALLREDUCE_TRACE=trace.json mpirun -n 4 python -m mpi4py script.py
    with mar.trace("trace.json"):          # collective over COMM_WORLD (or comm=)
        ...

While tracing, every plan built (``mar.plan``, one-shot calls and the call cache's bound runs,
``iallreduce``, ``mar.Comm``, the related collectives) binds a *traced* run instead of its plain
one: the same calls, with a clock reading before each phase. A plan built while tracing is off
never looks at the trace, so an untraced run costs what it did; one built before a trace starts
stays untraced through it (``mar.plan`` objects; cached one-shot calls are dropped when a trace
starts and ends, so they bind again). Schedules bind a traced flat program (see
:meth:`.executor.Plan._flatten`); their stepwise runs (with a timeout, or non-blocking:
:meth:`.executor.Plan.steps`) record the same phases through the same hook. Plans without a
schedule (shm, node phases, native) take a :class:`Marks` from :meth:`Recorder.marks` and
bind their own phases with it.

Each rank records its schedule runs and, within them, every step and its phases:

- ``load`` / ``finish``: copies before the first step and after the last (and AVG's divide);
- ``copy``: copies into the result before a step's messages are posted, or out of scratch;
- ``start``: posting the step's receives and sends (``Start`` of persistent requests);
- ``wait``: waiting for them (what the peers' lateness and the transfer cost);
- ``combine``: reductions of received data (NumPy ufuncs or ``Reduce_local``). A combine the
  executor defers until the next step's messages are posted lies inside that next step and
  names its own step in ``args.step``.

An shm run (``shm allreduce``) holds ``arrive`` (this rank's input into its slot), ``wait``
(until every peer has published the same step), ``reduce`` and ``copy out`` (its part of the
result into the others' reach, or theirs into its result); in the large regime on a private
result each chunk is a span (``chunk c``, its index in ``args.chunk``) holding its own phases.
A node-phased run (hierarchical, cascade with shared memory inside nodes) holds ``arrive``,
``wait``, ``reduce``, ``gather`` (the leader: the node's blocks), ``across`` (holding the
cross-node plan's own run, ``<algorithm> across nodes``), ``publish`` and ``copy out``. A native
call is one span (``native allreduce``) with nothing inside.

Recording a run costs its clock readings: each is one ``(ns, marker)`` tuple appended to the
rank's buffer in memory (the marker bound once with the plan, shared by all its runs); the
events, their names and arguments are made only when the trace is written, at the end of the
``trace()`` block or at exit, and nothing is written before. Calls with fresh arrays run the
plan their shape bound, traced as untraced (a native one staged through a traced plan of its
own), and shm's small regime keeps its compiled run, which makes the readings itself.
A rank keeps its latest :data:`MAX_EVENTS` clock readings (``MPIALLREDUCE_TRACE_EVENTS``),
about 100 B each; runs whose start was dropped, or that raised before their end, are left out
of the file. A trace that ends with no run recorded on any rank warns on rank 0, saying why.

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
import warnings
from collections import deque
from functools import partial

import numpy as np
from mpi4py import MPI

from . import _hooks, _state
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

    def stamper(self, marker: tuple):
        """The argument-free call a traced program holds for ``marker``: :meth:`stamp`, as a
        closure (cheaper to call than a partial of the method). It reads ``events`` at each
        call, so that a pause or the end of the trace silences it."""
        recorder = self

        def stamp() -> None:
            recorder.events.append((_clock(), marker))
        return stamp

    # -- binding (plan time) ---------------------------------------------------------------------

    def program(self, plan, steps) -> tuple:
        """The traced flat program of ``plan`` (a Plan being built over ``steps``)."""
        index = len(self.plans)
        self.plans.append(_describe(plan, steps))
        plan._phase = partial(self._phase, index)  # its stepwise runs too (non-blocking, timeouts)
        plan.traced = True
        return plan._flatten(plan._phase)

    def marks(self, plan, transport: str, regime: str, unit: str | None = None) -> Marks:
        """Register ``plan``, a plan without a schedule being bound (``transport``: ``"shm"``
        or ``"native"``; ``regime``: how it runs; ``unit``: what its numbered spans are,
        ``"chunk"``), and return its :class:`Marks`."""
        index = len(self.plans)
        self.plans.append(_describe(plan, (), transport=transport, regime=regime, unit=unit))
        plan.traced = True
        return Marks(self, index)

    def rename(self, plan, name: str) -> None:
        """Name the runs of ``plan`` (a schedule bound while tracing) ``name`` in the file."""
        phase = plan._phase
        if isinstance(phase, partial) and phase.func == self._phase:
            self.plans[phase.args[0]]["name"] = name

    def _phase(self, plan: int, kind: str, step, group) -> list:
        """``group`` of calls preceded by the stamps of its phase (see ``Plan._flatten``)."""
        group = list(group)
        if kind in ("run", "end"):
            return [self.stamper((plan, kind, None, False))]
        if kind == "combine":  # copies out of scratch and reductions, each run of them a phase
            out, previous = [], None
            for call in group:
                now = COPY if getattr(call, "func", None) is np.copyto else "combine"
                if now != previous:
                    out.append(self.stamper((plan, now, step, False)))
                    previous = now
                out.append(call)
            return out
        if not group and kind not in ("start", "wait"):
            return group
        opens = kind in ("copy", "start")  # the first phase of a step opens the step's span
        return [self.stamper((plan, kind, step, opens)), *group]

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
            if not any(e[1][1] == "run" for rank_events, _ in gathered for e in rank_events):
                warnings.warn(_empty(self.path, sum(len(plans) for _, plans in gathered)),
                              RuntimeWarning, stacklevel=2)
        self.comm.Barrier()


def _empty(path: str, bound: int) -> str:
    """Why a trace holds no run (the warning rank 0 gives once when it writes it)."""
    why = (f"{bound} plan(s) were bound while tracing and none ran" if bound else
           "no plan or call was bound while tracing")
    return (f"mpiallreduce trace {path}: no runs recorded on any rank ({why}): no allreduce ran "
            f"between the trace's start and its end, or only plans bound before the trace "
            f"started ran, which are not traced (build them inside the trace); the file holds "
            f"the ranks' empty tracks")


class Marks:
    """The clock readings of one traced plan without a schedule (shm, node phases, native),
    bound with the plan (:meth:`Recorder.marks`).

    Called as the plan's phase hook, ``marks(kind, index, group)`` returns the calls of
    ``group`` preceded by the stamp that opens phase ``kind`` (of chunk ``index``, or None);
    a group without calls stays empty unless its stamp marks something itself (``run``,
    ``end``, ``wait``, ``across``, and ``arrive``, which opens a chunk's span).
    :meth:`around` and :meth:`before` stamp around a whole run and before a wait, for the
    parts of a run that are methods rather than bound calls.
    """

    __slots__ = ("recorder", "plan")
    #: phases stamped even without calls of their own
    ALWAYS = ("run", "end", "wait", "across", "arrive")

    def __init__(self, recorder: Recorder, plan: int):
        self.recorder = recorder
        self.plan = plan

    def __call__(self, kind: str, index, group) -> list:
        group = list(group)
        if not group and kind not in self.ALWAYS:
            return group
        opens = kind == "arrive" and index is not None
        return [self.recorder.stamper((self.plan, kind, index, opens)), *group]

    def stamps(self, *kinds: str) -> tuple:
        """The stamps that open phases ``kinds`` (of no chunk), for a compiled run that makes
        them itself where the bound calls hold them (``_compiled.SmallRun``)."""
        return tuple(self.recorder.stamper((self.plan, kind, None, False)) for kind in kinds)

    def around(self, run):
        """``run(*args)`` between the stamps of the run's start and end (none if it raises:
        the file leaves such a run out)."""
        start, end = self("run", None, ())[0], self("end", None, ())[0]

        def traced(*args, **kwargs):
            start()
            result = run(*args, **kwargs)
            end()
            return result
        return traced

    def before(self, kind: str, call, index=None, argument: int | None = None):
        """``call(*args)`` after the stamp of phase ``kind``: of ``index``, or of the chunk
        its positional argument ``argument`` names."""
        if argument is None:
            stamp = self(kind, index, ())[0]

            def traced(*args, **kwargs):
                stamp()
                return call(*args, **kwargs)
            return traced
        recorder, plan = self.recorder, self.plan

        def traced_at(*args, **kwargs):
            recorder.stamp((plan, kind, args[argument], False))
            return call(*args, **kwargs)
        return traced_at


def _describe(plan, steps, **about) -> dict:
    """What a trace says about a plan: its algorithm and size, and each step's messages;
    ``about``: what else its runs say (a plan without a schedule: transport, regime, unit)."""
    result = plan._result
    itemsize = result.dtype.itemsize
    described = {}
    for index, step in enumerate(steps):
        if not step:
            continue
        described[index] = {
            "sends": [[send.peer, send.size * itemsize] for send in step.sends],
            "recvs": [[recv.peer, recv.size * itemsize, recv.action] for recv in step.recvs]}
    return {"name": getattr(plan, "_label", f"{plan.algorithm} allreduce"),
            "algorithm": plan.algorithm, "count": int(result.size),
            "dtype": result.dtype.name, "bytes": int(result.nbytes),
            "op": plan.reducer.name if plan.reducer is not None else None,
            "ranks": plan._nranks, "steps": described, **about}


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


class _Open:
    """A run being turned into events: its span, its open step (or chunk) and phase, and the
    events closed so far (kept until the run ends: a run that never ends is left out)."""

    __slots__ = ("plan", "run", "step", "phase", "events")

    def __init__(self, plan: int, run: tuple):
        self.plan = plan
        self.run = run  # (start, name, args)
        self.step = None  # (start, name, args, index)
        self.phase = None  # (start, kind, args)
        self.events: list[dict] = []

    def close(self, item, at: int, rank: int) -> None:
        if item is not None:
            self.events.append(_event(item[1], item[0], at, rank, item[2]))


def _run_args(described: dict, plan: int, number: int) -> dict:
    args = {"algorithm": described["algorithm"], "plan": plan, "run": number,
            "count": described["count"], "dtype": described["dtype"],
            "bytes": described["bytes"], "op": described["op"], "ranks": described["ranks"]}
    if "transport" in described:
        args.update(transport=described["transport"], regime=described["regime"])
    return args


def _step_span(described: dict, index: int, at: int) -> tuple:
    """The span a step (a schedule's) or a chunk (shm's large regime) opens at ``at``."""
    unit = described.get("unit")
    if unit is not None:
        return (at, f"{unit} {index}", {unit: index}, index)
    messages = described["steps"][index]
    return (at, f"step {index}", {
        "step": index, "sends": messages["sends"], "recvs": messages["recvs"],
        "bytes_sent": sum(b for _, b in messages["sends"]),
        "bytes_received": sum(b for _, b, _ in messages["recvs"])}, index)


def _phase_args(described: dict, kind: str, index) -> dict | None:
    if index is None:
        return None
    unit = described.get("unit")
    if "transport" in described:
        return {unit: index} if unit is not None else None
    messages = described["steps"][index]
    if kind in ("start", "wait"):
        return {"step": index,
                "peers": sorted({m[0] for m in messages["sends"] + messages["recvs"]}),
                "bytes": sum(m[1] for m in messages["sends"] + messages["recvs"])}
    if kind in ("combine", COPY):
        return {"step": index,
                "bytes": sum(b for _, b, action in messages["recvs"]
                             if (action == COPY) == (kind == COPY))}
    return None


def _track(rank: int, events: list, plans: list[dict], shift: int) -> list[dict]:
    """Turn one rank's clock readings into nested complete events: runs, steps or chunks,
    phases. Each plan's readings make its own runs, so runs of several plans may interleave
    (requests in flight together) or nest (a node-phased run's cross-node plan runs inside its
    ``across`` phase: the times nest, and so do the events)."""
    out: list[dict] = []
    running: dict[int, _Open] = {}  # each plan's run not yet ended
    runs: dict[int, int] = {}

    for stamp, (plan, kind, index, opens) in events:
        at = stamp - shift
        described = plans[plan]
        if kind == "run":  # (a run of this plan still open raised before its end: left out)
            runs[plan] = runs.get(plan, 0) + 1
            running[plan] = _Open(plan, (at, described["name"],
                                         _run_args(described, plan, runs[plan])))
            continue
        current = running.get(plan)
        if current is None:
            continue  # the oldest readings were dropped (MPIALLREDUCE_TRACE_EVENTS): a partial run
        current.close(current.phase, at, rank)
        current.phase = None
        if kind == "end":
            current.close(current.step, at, rank)
            current.close(current.run, at, rank)
            out += current.events
            del running[plan]
            continue
        # a phase of no step (finish) ends the open step; a step's first phase opens it
        if index is None or (opens and (current.step is None or current.step[3] != index)):
            current.close(current.step, at, rank)
            current.step = _step_span(described, index, at) if opens else None
        current.phase = (at, kind, _phase_args(described, kind, index))
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
    return _hooks.tracer


def _drop_cached_calls() -> None:
    """Free the cached one-shot plans, so that the next calls bind traced (or plain) ones."""
    caches = {id(entry.state.calls): entry.state.calls
              for entry in (*_state.CALLS.values(), *_state.SHAPES.values())}
    for cache in caches.values():
        cache.clear()


def _begin(recorder: Recorder) -> None:
    _refuse_second()
    _drop_cached_calls()
    _hooks.register_tracer(recorder)


def _end(recorder: Recorder) -> None:
    _hooks.unregister_tracer(recorder)
    _drop_cached_calls()


def _refuse_second() -> None:
    if _hooks.tracer is not None:
        raise ValueError(f"tracing is already on (to {_hooks.tracer.path}); one trace at a time")


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
    _refuse_second()
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
    if MPI.Is_finalized() or _hooks.tracer is not recorder:
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
    if not path or _hooks.tracer is not None:
        return
    recorder = Recorder(path, MPI.COMM_WORLD)
    _hooks.register_tracer(recorder)
    atexit.register(_at_exit, recorder)


_from_environment()
