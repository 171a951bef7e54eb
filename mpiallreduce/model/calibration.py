"""Calibration: measure a machine under mpirun -n 2 (ping-pong, combine, copy, steps, native)."""

from __future__ import annotations

import datetime
import os
import platform
import time
from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from ..schedule import REDUCE
from ..topology import Topology
from .machine import DEFAULT_MACHINE, NETWORK_100G, Link, Machine
from .prediction import predict


def fit_alpha_beta(sizes: Sequence[int], seconds: Sequence[float]) -> Link:
    """Least-squares fit of one-way times ``t = α + size·β``; α and β clamped at 0.

    Raises ValueError for fewer than two distinct sizes or mismatched lengths.
    """
    sizes = np.asarray(sizes, dtype=float)
    seconds = np.asarray(seconds, dtype=float)
    if sizes.shape != seconds.shape or sizes.ndim != 1:
        raise ValueError(f"sizes and times must be two lists of one length, got {sizes.shape} "
                         f"and {seconds.shape}")
    if len(np.unique(sizes)) < 2:
        raise ValueError("fitting α and β needs at least two distinct message sizes")
    if not np.all(np.isfinite(seconds)) or np.any(seconds < 0):
        raise ValueError("times must be finite and >= 0")
    # weight by 1/t: relative errors, so the small sizes fix α and the large ones β
    weights = 1.0 / np.maximum(seconds, 1e-12)
    design = np.stack([np.ones_like(sizes), sizes], axis=1) * weights[:, None]
    (alpha, beta), *_ = np.linalg.lstsq(design, seconds * weights, rcond=None)
    return Link(float(max(alpha, 0.0)), float(max(beta, 0.0)))


#: timed rounds per measurement; the fastest counts.
REPEATS = 7


def _pingpong(comm, nbytes: int, iterations: int) -> float:
    """One-way time of a ``nbytes`` message between ranks 0 and 1 (half the round trip)."""
    from mpi4py import MPI

    buf = np.zeros(max(nbytes, 1), dtype=np.uint8)[:nbytes]
    rank = comm.Get_rank()
    best = float("inf")
    # best of several short rounds: on a shared machine the others' load only adds time
    for _ in range(REPEATS):
        comm.Barrier()
        start = MPI.Wtime()
        for _ in range(iterations):
            if rank == 0:
                comm.Send(buf, 1, 7)
                comm.Recv(buf, 1, 7)
            elif rank == 1:
                comm.Recv(buf, 0, 7)
                comm.Send(buf, 0, 7)
        best = min(best, (MPI.Wtime() - start) / iterations / 2)
    return comm.bcast(best, root=0)


def _gamma(dtype, nbytes: int = 4 << 20, repeats: int = 20) -> float:
    """Seconds per byte of the executor's local combine (SUM) on ``dtype``, best of ``repeats``."""
    from mpi4py import MPI

    from ..ops import reducer
    from ..schedule import RECEIVED_FIRST

    combine = reducer(MPI.SUM, np.dtype(dtype))
    count = nbytes // np.dtype(dtype).itemsize
    received, local = np.ones(count, dtype), np.ones(count, dtype)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        combine.combine(received, local, RECEIVED_FIRST)
        best = min(best, time.perf_counter() - start)
    return best / (count * np.dtype(dtype).itemsize)


def _copy_cost(nbytes: int = 64 << 20, repeats: int = 7) -> float:
    """Seconds per byte to allocate a fresh ``nbytes`` buffer and copy into it, best of ``repeats``."""
    source = np.ones(nbytes, dtype=np.uint8)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        target = np.empty_like(source)
        np.copyto(target, source)
        best = min(best, time.perf_counter() - start)
        del target
    return best / nbytes


def _allreduce_cost(comm, iterations: int = 400) -> float:
    """Seconds per ``comm.Allreduce`` of one float64 from Python (out of place), slowest rank."""
    from mpi4py import MPI

    x, y = np.ones(1, np.float64), np.empty(1, np.float64)
    elapsed = float("inf")
    for _ in range(REPEATS):
        comm.Barrier()
        start = MPI.Wtime()
        for _ in range(iterations):
            comm.Allreduce(x, y, MPI.SUM)
        elapsed = min(elapsed, (MPI.Wtime() - start) / iterations)
    return comm.allreduce(elapsed, op=MPI.MAX)


def _step_cost(comm, nsteps: int, iterations: int) -> float:
    """Seconds per ``Plan.run()`` of a schedule of ``nsteps`` one-element exchanges (2 ranks)."""
    from mpi4py import MPI

    from ..executor import Plan
    from ..ops import reducer
    from ..schedule import Recv, Send, Step

    peer = 1 - comm.Get_rank()
    steps = tuple(Step((Send(peer, 0, 1),), (Recv(peer, 0, 1, REDUCE),)) for _ in range(nsteps))
    private = comm.Dup()
    try:
        x, y = np.ones(1, np.float64), np.empty(1, np.float64)
        plan = Plan(private, steps, x, y, reducer(MPI.SUM, np.dtype("float64")), "calibrate")
        try:
            elapsed = float("inf")
            for _ in range(REPEATS):
                comm.Barrier()
                start = MPI.Wtime()
                for _ in range(iterations):
                    plan.run()
                elapsed = min(elapsed, (MPI.Wtime() - start) / iterations)
        finally:
            plan.free()
    finally:
        private.Free()
    return comm.allreduce(elapsed, op=MPI.MAX)


def calibrate(comm, sizes: Sequence[int] = tuple(4 ** k for k in range(12)),
              inter: Link | None = None) -> Machine:
    """Measure the machine under two ranks of ``comm`` (collective: call it on every rank).

    α, β: ping-pong between ranks 0 and 1 over ``sizes`` (8 B .. 4 MiB by default), least
    squares on the one-way times. γ: the executor's SUM combine on 4 MiB per dtype. ``step``
    and ``call``: ``Plan.run()`` of 1 and 32 one-element exchange steps; the slope less one
    message's α + 8β is the interpreter's cost per step, the rest of the 1-step run the cost
    per call. ``native_call``: ``comm.Allreduce`` of one float64 less the model's time for it.
    The measured link is the inter-node one when ranks 0 and 1 are on different
    nodes; the other class comes from ``inter`` (default :data:`NETWORK_100G`) or the default
    machine.
    """
    from mpi4py import MPI

    if comm.Get_size() < 2:
        raise ValueError("calibrate needs at least 2 ranks: mpirun -n 2 python -m mpi4py -m "
                         "mpiallreduce.model calibrate -o machine.json")
    times = []
    for nbytes in sizes:
        iterations = int(min(400, max(10, (16 << 20) // max(nbytes, 1))))
        times.append(_pingpong(comm, nbytes, iterations))
    measured = fit_alpha_beta(sizes, times)
    gamma = tuple((name, comm.bcast(_gamma(name), root=0))
                  for name in ("float32", "float64", "int32", "int64"))
    copy = comm.bcast(_copy_cost(), root=0)
    one, many = _step_cost(comm, 1, 400), _step_cost(comm, 33, 40)
    per_step = max(0.0, (many - one) / 32 - (measured.alpha + 8 * measured.beta))
    per_call = max(0.0, one - per_step - (measured.alpha + 8 * measured.beta))
    allreduce = _allreduce_cost(comm)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    split = Topology.from_comm(comm)
    across = split.node[0] != split.node[1]
    intra = DEFAULT_MACHINE.intra if across else measured
    inter = measured if across else (NETWORK_100G if inter is None else inter)
    info = {"mpi_library": MPI.Get_library_version().strip().splitlines()[0],
            "mpi4py": __import__("mpi4py").__version__, "numpy": np.__version__,
            "python": platform.python_version(), "host": platform.node(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "measured_link": "inter" if across else "intra",
            "inter_source": "measured" if across else "given by hand (--inter-alpha/--inter-beta)"
                            if inter is not NETWORK_100G else "NETWORK_100G (100 Gb/s example)",
            "pingpong": {"sizes": list(map(int, sizes)), "one_way_s": times},
            "plan_run_s": {"1 step": one, "33 steps": many},
            "allreduce_1_float64_s": allreduce}
    machine = Machine(intra, inter, gamma, per_step, per_call, copy, info=info)
    # native_call: what comm.Allreduce costs beyond the model of Open MPI's algorithm for it
    modelled = predict("native", comm.Get_size(), 8, split, machine, "float64").time
    return replace(machine, native_call=max(0.0, allreduce - modelled),
                   cores=comm.bcast(cores, root=0))
