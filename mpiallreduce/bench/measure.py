"""The bench's measurement: one size's input, reference and timed runs of every case.

A :class:`Case` is one message size on this rank: its input (small integers, so every reduction
order is exact), the reference result from ``comm.Allreduce``, and :meth:`Case.measure`, which
times one algorithm called one way (``options.APIS``) and validates it bit for bit on every
rank. :class:`Row` is what the sweep (``cli.run``) makes of a measurement, for the report.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np
from mpi4py import MPI

import mpiallreduce as mar

from .. import learn
from ..ops import reducer
from ..topology import Topology
from .options import GLOO, MPI_CALL, MPI_INIT, Options, algorithm_call, default_iterations, op_of

#: bench op name -> the name of torch's ``ReduceOp`` (AVG: SUM, divided after, as for MPI's)
_GLOO_OPS = {"SUM": "SUM", "AVG": "SUM", "PROD": "PRODUCT", "MIN": "MIN", "MAX": "MAX",
             "BAND": "BAND", "BOR": "BOR", "BXOR": "BXOR"}


def gloo_call(comm, x: np.ndarray, recv: np.ndarray, op: str, in_place: bool):
    """Return a call of Gloo's all-reduce into ``recv`` (a tensor on its memory), or the reason
    Gloo cannot run this case. Sets up torch.distributed from ``comm`` the first time
    (collective: the first case measured, on every rank)."""
    import torch
    import torch.distributed as dist

    if op not in _GLOO_OPS:
        return f"Gloo has no {op}"
    try:
        tensor = torch.from_numpy(recv)
    except TypeError as exc:
        return f"torch has no tensor of {recv.dtype}: {exc}"
    if not dist.is_initialized():
        mar.torch.init_process_group(comm)
    if dist.get_world_size() != comm.size:
        return "torch.distributed was set up on another communicator"
    reduce_op = getattr(dist.ReduceOp, _GLOO_OPS[op])
    if in_place:
        return lambda: dist.all_reduce(tensor, reduce_op)
    return lambda: (np.copyto(recv, x), dist.all_reduce(tensor, reduce_op))


@dataclass
class Row:
    """One size and algorithm: the measurement and its verdict."""

    size: int
    count: int
    algorithm: str
    iterations: int
    warmup: int
    avg_us: float
    min_us: float
    max_us: float
    algbw_gbs: float
    busbw_gbs: float
    vs_native: float
    check: str  # "ok", "FAIL" or "-" (not validated)
    repeats: int = 1
    avg_lo_us: float = float("nan")  # fastest and slowest round's avg (the spread; --repeat)
    avg_hi_us: float = float("nan")
    vs_native_lo: float = float("nan")  # lowest and highest round's ratio to native
    vs_native_hi: float = float("nan")
    runs: str = ""  # the algorithm a plan row ran (for auto: what it picked at this size)
    rounds_us: tuple[float, ...] = ()  # each round's avg, in the order run (--repeat)


def make_input(count: int, dtype: np.dtype, op: str, rank: int, seed: int = 2024) -> np.ndarray:
    """Return this rank's input: small integers in ``dtype``, so every reduction order is exact.

    PROD gets factors of magnitude one (units 1, -1, 1j, -1j for complex; 1 and 3 for unsigned
    types, which wrap the same way in any order), the logical ops 0..2, SUM and the rest small
    values, whose sums stay exact in any floating type for any practical number of ranks.
    """
    rng = np.random.default_rng([seed, rank, count])
    if dtype == np.bool_:
        return rng.integers(0, 2, count).astype(bool)
    if op == "PROD":
        units = {"u": [1, 3], "c": [1, -1, 1j, -1j]}.get(dtype.kind, [-1, 1])
        return rng.choice(np.array(units), count).astype(dtype)
    elif op in ("LAND", "LOR", "LXOR") or dtype.kind == "u":
        values = rng.integers(0, 3 if op in ("LAND", "LOR", "LXOR") else 8, count)
    else:
        values = rng.integers(-8, 9, count)
    if dtype.kind == "c":
        return (values + 1j * rng.integers(-8, 9, count)).astype(dtype)
    return values.astype(dtype)


def _reference(comm, x: np.ndarray, op: str) -> np.ndarray:
    """Return ``comm.Allreduce`` of ``x`` (AVG: the sum divided by p), the result to match."""
    red = reducer(op_of(op), x.dtype)
    ref = np.empty_like(x)
    comm.Allreduce(x, ref, op=red.mpi_op)
    if red.average:
        np.divide(ref, comm.size, out=ref)
    return ref


def _mean_time(run, iterations: int, warmup: int, comm, untraced=contextlib.nullcontext) -> float:
    """Return this rank's mean seconds per call: warm-up untimed, barrier, timed loop.

    ``untraced()`` is entered around what is not timed (a recorder's ``paused`` with --trace).
    """
    with untraced():
        for _ in range(warmup):
            run()
    comm.Barrier()
    start = MPI.Wtime()
    for _ in range(iterations):
        run()
    return (MPI.Wtime() - start) / iterations


def topology_for(comm, ranks_per_node: int | None):
    """Return the ``topology=`` the plans are built with, the layout the header describes.

    Simulated nodes of ``ranks_per_node`` consecutive ranks; ``None`` (the real layout) lets the
    library use ``Topology.from_comm`` for the algorithms that need one.
    """
    if ranks_per_node is None:
        return None
    return Topology.simulated(comm, ranks_per_node=ranks_per_node)


class Case:
    """One size: this rank's input, the reference result and the per-algorithm measurement."""

    def __init__(self, comm, opts: Options, size: int, recorder=None):
        self.comm, self.opts, self.size = comm, opts, size
        # with --trace, what is not timed is not recorded
        self.untraced = contextlib.nullcontext if recorder is None else recorder.paused
        self.count = size // opts.dtype.itemsize
        self.x = make_input(self.count, opts.dtype, opts.op, comm.rank)
        self.ref = _reference(comm, self.x, opts.op) if opts.validate else None
        self.recv = np.empty_like(self.x)
        self.picked: dict[str, str] = {}  # algorithm -> what its plan ran (auto's pick)
        self.iterations, self.warmup = default_iterations(size)
        if opts.iterations is not None:
            self.iterations, self.warmup = opts.iterations, max(1, opts.iterations // 10)
        if opts.warmup is not None:
            self.warmup = opts.warmup

    def measure(self, algorithm: str, topology, api: str = "plan") -> tuple[float, bool] | str:
        """Return (this rank's mean seconds, validation ok on every rank), or the reason the
        algorithm refused this case (the same on every rank: ``plan`` checks collectively).

        ``api`` is how it is called (:data:`APIS`), or :data:`MPI_CALL` for ``comm.Allreduce``.
        """
        if api == "plan-shared":
            with mar.shared_empty(self.x.shape, self.x.dtype, comm=self.comm) as send, \
                    mar.shared_empty(self.x.shape, self.x.dtype, comm=self.comm) as recv:
                send[...] = self.x
                return self._measure(algorithm, topology, "plan", send, recv)
        return self._measure(algorithm, topology, api, self.x, self.recv)

    def _measure(self, algorithm: str, topology, api: str, x: np.ndarray, recv: np.ndarray):
        opts, comm = self.opts, self.comm
        if opts.in_place:
            recv[...] = self.x
        sendbuf = MPI.IN_PLACE if opts.in_place else x
        op = op_of(opts.op)
        label = algorithm
        algorithm, params = algorithm_call(label)
        kwargs = dict(op=op, comm=comm, algorithm=algorithm, topology=topology, **params)
        try:
            plan = (mar.plan(sendbuf, recv, check=True, **kwargs)
                    if api in ("plan", "start") else None)
        except ValueError as exc:
            return str(exc)
        if api == GLOO:
            run = gloo_call(comm, x, recv, opts.op, opts.in_place)
            refused = comm.allgather(run if isinstance(run, str) else None)
            if any(refused):
                return next(r for r in refused if r)
        elif api == MPI_CALL:
            red = reducer(op, self.x.dtype)
            run = lambda: comm.Allreduce(sendbuf, recv, red.mpi_op)
        elif api == MPI_INIT:
            plan = comm.Allreduce_init(sendbuf, recv, reducer(op, self.x.dtype).mpi_op)
            run = lambda: (plan.Start(), plan.Wait())
        elif api in ("call", "call-nocheck"):
            # the arguments spelled out, as a caller writes them (a **kwargs expansion per call
            # would cost more than the call path itself at 8 B)
            check = api == "call"
            run = ((lambda: mar.allreduce(sendbuf, recv, op, comm, algorithm, topology, check,
                                          **params)) if params else
                   (lambda: mar.allreduce(sendbuf, recv, op, comm, algorithm, topology, check)))
        elif api == "start":
            run = lambda: plan.start().wait()
        elif api == "iallreduce":
            run = lambda: mar.iallreduce(sendbuf, recv, op, comm, algorithm, topology,
                                         **params).wait()
        elif api in ("comm", "comm-nocheck", "comm-init"):
            try:
                drop_in = mar.Comm(comm, algorithm, topology=topology, check=api != "comm-nocheck",
                                   **params)
                if api == "comm-init":
                    plan = drop_in.Allreduce_init(sendbuf, recv, op)
            except ValueError as exc:
                return str(exc)
            run = ((lambda: (plan.Start(), plan.Wait())) if api == "comm-init"
                   else (lambda: drop_in.Allreduce(sendbuf, recv, op)))
        else:
            run = plan.run
        with _freeing(plan):
            # in place, every run reduces the last result again: values may overflow to inf,
            # which costs nothing and is never validated (the input is restored first)
            # auto learns in its first calls of a case (the same number on every rank): warmed
            # up past them, it is timed running its pick, as a repeated call runs it
            warmup = max(self.warmup, learn.calls_to_decide()) if algorithm == "auto" \
                else self.warmup
            with np.errstate(all="ignore") if opts.in_place else contextlib.nullcontext():
                seconds = _mean_time(run, self.iterations, warmup, comm, self.untraced)
            if api == "plan":  # after its runs: what auto learned (unless learning is off)
                self.picked[label] = getattr(plan, "algorithm", algorithm)
            ok = True
            if opts.validate:
                if opts.in_place:
                    recv[...] = self.x
                else:
                    recv.fill(99)  # so a run that writes nothing cannot pass
                comm.Barrier()  # a shared result: no peer writes into it before it is reset
                with self.untraced():
                    run()
                if api in (MPI_CALL, MPI_INIT, GLOO) and reducer(op, self.x.dtype).average:
                    np.divide(recv, comm.size, out=recv)
                ok = bool(np.array_equal(recv, self.ref))
        ok = comm.allreduce(ok, op=MPI.LAND)
        return seconds, ok


@contextlib.contextmanager
def _freeing(plan):
    """Release a plan (its own ``with`` block) or an MPI persistent request (``Free``) after the
    block."""
    if plan is None or hasattr(plan, "__exit__"):
        with plan if plan is not None else contextlib.nullcontext():
            yield
        return
    try:
        yield
    finally:
        plan.Free()


def rank_stats(comm, seconds: float) -> tuple[float, float, float] | None:
    """Return (avg, min, max) over ranks of the per-rank means in µs, on rank 0 (None elsewhere)."""
    means = comm.gather(seconds, root=0)
    if means is None:
        return None
    micro = [1e6 * s for s in means]
    return sum(micro) / len(micro), min(micro), max(micro)

