"""Calibration: measure a machine under mpirun -n 2 (ping-pong curve, combine and copy by size,
the interpreter's terms, native's entry, the shm transport)."""

from __future__ import annotations

import datetime
import os
import platform
import time
from collections.abc import Sequence
from dataclasses import replace
from functools import partial

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
#: rounds of the short measurements (a round under a few ms): more, shorter rounds give a
#: shared machine more chances to leave one of them alone.
SHORT_REPEATS = 25


def _pingpong_persistent(comm, nbytes: int, iterations: int) -> float:
    """One-way time of ``nbytes`` between ranks 0 and 1 over persistent requests, the way a
    plan's steps post them (half the round trip, best of :data:`REPEATS` rounds)."""
    from mpi4py import MPI

    buf = np.zeros(max(nbytes, 1), dtype=np.uint8)[:nbytes]
    rank = comm.Get_rank()
    best = float("inf")
    rounds = SHORT_REPEATS if nbytes <= 64 << 10 else REPEATS
    if rank > 1:
        for _ in range(rounds):
            comm.Barrier()
        return comm.bcast(best, root=0)
    peer = 1 - rank
    send, recv = comm.Send_init(buf, peer, 8), comm.Recv_init(buf, peer, 8)
    try:
        for _ in range(rounds):
            comm.Barrier()
            start = MPI.Wtime()
            for _ in range(iterations):
                if rank == 0:
                    send.Start()
                    send.Wait()
                    recv.Start()
                    recv.Wait()
                else:
                    recv.Start()
                    recv.Wait()
                    send.Start()
                    send.Wait()
            best = min(best, (MPI.Wtime() - start) / iterations / 2)
    finally:
        send.Free()
        recv.Free()
    return comm.bcast(best, root=0)


#: sizes of the measured curves (link, combine, copy): every power of two from 1 B (links) or
#: 4 KiB (per-byte rates; below, the call's own cost dominates) to 64 MiB.
CURVE_SIZES = tuple(1 << k for k in range(27))
RATE_SIZES = tuple(1 << k for k in range(12, 27))


def _best(call, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - start)
    return best


def _gamma_curve(sizes=RATE_SIZES) -> tuple[tuple[int, float], ...]:
    """Seconds per byte of the executor's float32 SUM combine by size (its own call's cost
    taken off: that is the ``combine`` term), best of several repeats."""
    from mpi4py import MPI

    from ..ops import reducer
    from ..schedule import RECEIVED_FIRST

    red = reducer(MPI.SUM, np.dtype("float32"))
    tiny = np.ones(1, np.float32), np.ones(1, np.float32)
    (call,) = red.bind(tiny[0], tiny[1], tiny[1], RECEIVED_FIRST)
    overhead = _best(call, 50)
    points = []
    for nbytes in sizes:
        received, local = np.ones(nbytes // 4, np.float32), np.ones(nbytes // 4, np.float32)
        (call,) = red.bind(received, local, local, RECEIVED_FIRST)
        call()
        seconds = _best(call, max(3, min(50, (64 << 20) // nbytes)))
        points.append((nbytes, max(seconds - overhead, 0.0) / nbytes))
    return tuple(points)


def _copy_curve(sizes=RATE_SIZES) -> tuple[tuple[int, float], ...]:
    """Seconds per byte to allocate a buffer and copy into it, by size (best of repeats), the
    Python calls' own cost (a 1-byte copy) taken off: MPI's copies are C."""
    overhead = _best(partial(_fresh_copy, np.ones(1, dtype=np.uint8)), 50)
    points = []
    for nbytes in sizes:
        source = np.ones(nbytes, dtype=np.uint8)
        copy = partial(_fresh_copy, source)
        seconds = _best(copy, max(3, min(50, (64 << 20) // nbytes)))
        points.append((nbytes, max(seconds - overhead, 0.0) / nbytes))
    return tuple(points)


def _fresh_copy(source: np.ndarray) -> None:
    np.copyto(np.empty_like(source), source)


def _plan_cost(comm, steps, count: int, iterations: int) -> float:
    """Seconds per ``Plan.run()`` of ``steps`` on ``count`` float64 (:func:`_seconds_per_run`)."""
    from mpi4py import MPI

    from ..executor import Plan
    from ..ops import reducer

    private = comm.Dup()
    try:
        x, y = np.ones(count, np.float64), np.empty(count, np.float64)
        plan = Plan(private, tuple(steps), x, y, reducer(MPI.SUM, np.dtype("float64")),
                    "calibrate")
        try:
            return _seconds_per_run(comm, plan.run, iterations)
        finally:
            plan.free()
    finally:
        private.Free()


def _seconds_per_run(comm, run, iterations: int) -> float:
    """Seconds per call of ``run`` (the slowest rank's best of :data:`SHORT_REPEATS` rounds of
    ``iterations`` calls, each round after a barrier)."""
    from mpi4py import MPI

    elapsed = float("inf")
    for _ in range(SHORT_REPEATS):
        comm.Barrier()
        start = MPI.Wtime()
        for _ in range(iterations):
            run()
        elapsed = min(elapsed, (MPI.Wtime() - start) / iterations)
    return comm.allreduce(elapsed, op=MPI.MAX)


def _interpreter_terms(comm, nsteps: int = 33) -> dict:
    """Per-step, per-request and per-combine seconds of ``Plan.run()``, from three shapes of
    one-element steps between ranks 0 and 1 (the others idle), as slopes over ``nsteps``:

    - chain: one message per step, the ranks taking turns (a tree's steps): ``step + request
      + message``;
    - exchange: a send and a receive per step on both ranks: ``step + 2 request + message``;
    - exchange with a reducing receive: the same ``+ combine + 8 γ``.

    Returns the three slopes, the 1-step run of the last and the number of steps.
    """
    from ..schedule import COPY, Recv, Send, Step

    rank = comm.Get_rank()
    peer = 1 - rank if rank < 2 else None

    def shapes(n):
        if peer is None:
            empty = [Step((), ())] * (n + 1)
            return empty, empty, empty
        chain = [Step((Send(peer, 0, 1),), ()) if k % 2 == rank
                 else Step((), (Recv(peer, 1, 2, COPY),)) for k in range(n + 1)]
        exchange = [Step((Send(peer, 0, 1),), (Recv(peer, 1, 2, COPY),)) for _ in range(n)]
        reducing = [Step((Send(peer, 0, 1),), (Recv(peer, 0, 1, REDUCE),)) for _ in range(n)]
        return chain, exchange, reducing

    result = {}
    for label, (short, long_) in zip(("chain", "exchange", "reducing"),
                                     zip(shapes(1), shapes(nsteps))):
        one = _plan_cost(comm, short, 2, 100)
        many = _plan_cost(comm, long_, 2, 10)
        result[label] = (many - one) / (nsteps - 1)
        result[label + " 1 step"] = one
    return result


def _shm_cost(comm, nbytes: int, iterations: int, algorithm: str = "shm", **params
              ) -> float | None:
    """Seconds per run of the shm transport's plan of ``nbytes`` float32 (slowest rank), or
    None where it does not run (ranks on several nodes, no shared memory); ``algorithm``
    hierarchical with ``intra="shm"``: its node-phased plan."""
    from mpi4py import MPI

    from ..api import plan

    x = np.ones(max(nbytes // 4, 1), np.float32)
    y = np.empty_like(x)
    try:
        bound = plan(x, y, MPI.SUM, comm, algorithm, **params)
    except (ValueError, NotImplementedError, MPI.Exception):
        return None
    try:
        return _seconds_per_run(comm, bound.run, iterations)
    finally:
        bound.free()


def _node_bandwidth(comm, nbytes: int = 64 << 20) -> float:
    """Bytes per second (read plus write) of all ranks copying ``nbytes`` at once."""
    from mpi4py import MPI

    source = np.ones(nbytes, dtype=np.uint8)
    target = np.empty_like(source)
    np.copyto(target, source)
    copies = max(1, min(64, (4 << 20) // max(nbytes, 1)))  # a round of ~4 MiB or one copy
    best = float("inf")
    for _ in range(REPEATS if nbytes >= 1 << 20 else SHORT_REPEATS):
        comm.Barrier()
        start = MPI.Wtime()
        for _ in range(copies):
            np.copyto(target, source)
        # the slowest rank's copy ends the phase
        best = min(best, comm.allreduce((MPI.Wtime() - start) / copies, op=MPI.MAX))
    return comm.Get_size() * 2 * nbytes / best


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


def _allreduce_cost(comm, iterations: int = 100) -> float:
    """Seconds per ``comm.Allreduce`` of one float64 from Python (out of place), slowest rank."""
    from mpi4py import MPI

    x, y = np.ones(1, np.float64), np.empty(1, np.float64)
    elapsed = float("inf")
    for _ in range(SHORT_REPEATS):
        comm.Barrier()
        start = MPI.Wtime()
        for _ in range(iterations):
            comm.Allreduce(x, y, MPI.SUM)
        elapsed = min(elapsed, (MPI.Wtime() - start) / iterations)
    return comm.allreduce(elapsed, op=MPI.MAX)


def calibrate(comm, sizes: Sequence[int] = CURVE_SIZES, inter: Link | None = None,
              rate_sizes: Sequence[int] = RATE_SIZES, bandwidth_bytes: int = 64 << 20
              ) -> Machine:
    """Measure the machine under two ranks of ``comm`` (collective: call it on every rank).

    Every number is a measurement of this machine, none is fitted to the bench:

    - the link: one-way times of a persistent-request ping-pong between ranks 0 and 1 over
      ``sizes`` (1 B .. 64 MiB), kept as the link's ``curve`` (the protocol switch, caches), and
      α, β least squares over them up to 4 MiB (the closed forms, older readers);
    - γ per dtype (the executor's SUM combine on 4 MiB), and float32's ``gamma_curve`` by size;
    - ``copy`` (allocate and copy 64 MiB) and its ``copy_curve`` by size;
    - ``step``, ``request``, ``combine`` and ``call`` from ``Plan.run()`` of three shapes of
      one-element steps (:func:`_interpreter_terms`), less the ping-pong's message;
    - ``native_call``: ``comm.Allreduce`` of one float64 less the model's time for it;
    - ``shm_small``/``shm_large``: the shm transport's run at 8 B and 64 KiB less the model's
      copies and combines there, ``shm_peer`` from its run at 16 KiB (the small regime's
      per-byte read of the peers' slots); ``phased_small``/``phased_large``: hierarchical with
      its shared-memory intra-node phase at 8 B and twice the small regime's limit, less the
      model's copies and combines; ``node_bandwidth``: all ranks copying 64 MiB at once,
      and ``node_curve`` the same at every size of ``rate_sizes`` below it;
    - ``cores``: those this process may run on.

    The measured link is the inter-node one when ranks 0 and 1 are on different nodes; the
    other class comes from ``inter`` (default :data:`NETWORK_100G`) or the default machine.
    ``rate_sizes`` are the sizes of the combine and copy curves, ``bandwidth_bytes`` what each
    rank copies for ``node_bandwidth`` (smaller ones make a quick, rougher calibration).
    """
    from mpi4py import MPI

    from ..shm import small_bytes

    if comm.Get_size() < 2:
        raise ValueError("calibrate needs at least 2 ranks: mpirun -n 2 python -m mpi4py -m "
                         "mpiallreduce.model calibrate -o machine.json")
    times = []
    for nbytes in sizes:
        iterations = int(min(100, max(5, (16 << 20) // max(nbytes, 1))))
        times.append(_pingpong_persistent(comm, nbytes, iterations))
    fitted = [(b, t) for b, t in zip(sizes, times) if b <= 4 << 20] or list(zip(sizes, times))
    line = fit_alpha_beta([b for b, _ in fitted], [t for _, t in fitted])
    measured = Link(line.alpha, line.beta, tuple(zip(map(int, sizes), times)))
    gamma = tuple((name, comm.bcast(_gamma(name), root=0))
                  for name in ("float32", "float64", "int32", "int64"))
    gamma_curve = comm.bcast(_gamma_curve(rate_sizes), root=0)
    copy = comm.bcast(_copy_cost(), root=0)
    copy_curve = comm.bcast(_copy_curve(rate_sizes), root=0)
    shapes = _interpreter_terms(comm)
    message = float(measured.cost(8))
    gamma64 = dict(gamma)["float64"]
    request = shapes["exchange"] - shapes["chain"]
    raw_step = shapes["chain"] - request - message
    combine = shapes["reducing"] - shapes["exchange"] - 8 * gamma64
    per_step, request, combine = max(0.0, raw_step), max(0.0, request), max(0.0, combine)
    per_call = max(0.0, shapes["reducing 1 step"] - shapes["reducing"])
    allreduce = _allreduce_cost(comm)
    split = Topology.from_comm(comm)
    # the cores of this node: the union of what its ranks may run on (mpirun binds each rank to
    # one core, so one rank's own affinity says 1)
    mine = (set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
            else set(range(os.cpu_count() or 1)))
    node_of_rank = split.node
    gathered = comm.allgather(mine)
    cores = len(set().union(*(cpus for rank, cpus in enumerate(gathered)
                              if node_of_rank[rank] == node_of_rank[comm.Get_rank()])))
    across = split.node[0] != split.node[1]
    intra = DEFAULT_MACHINE.intra if across else measured
    inter = measured if across else (NETWORK_100G if inter is None else inter)
    limit = small_bytes(comm.Get_size())  # the small regime's most bytes at this size
    shm = {} if across else {size: _shm_cost(comm, size, 100)
                             for size in (8, limit // 2, 2 * limit)}
    phased = {} if across else {size: _shm_cost(comm, size, 100, "hierarchical", intra="shm")
                                for size in (8, 2 * limit)}
    node_curve = None if across else tuple(
        (size, _node_bandwidth(comm, size)) for size in rate_sizes if size < bandwidth_bytes)
    bandwidth = 0.0 if across else _node_bandwidth(comm, bandwidth_bytes)
    if node_curve is not None:
        node_curve += ((bandwidth_bytes, bandwidth),)
    info = {"mpi_library": MPI.Get_library_version().strip().splitlines()[0].rstrip("\x00"),
            "mpi4py": __import__("mpi4py").__version__, "numpy": np.__version__,
            "python": platform.python_version(), "host": platform.node(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "load": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
            "measured_link": "inter" if across else "intra",
            "inter_source": "measured" if across else "given by hand (--inter-alpha/--inter-beta)"
                            if inter is not NETWORK_100G else "NETWORK_100G (100 Gb/s example)",
            "pingpong": {"sizes": list(map(int, sizes)), "one_way_s": times,
                         "kind": "persistent requests (Start/Wait), best of rounds"},
            "plan_run_s": {"chain per step": shapes["chain"],
                           "exchange per step": shapes["exchange"],
                           "reducing exchange per step": shapes["reducing"],
                           "reducing exchange, 1 step": shapes["reducing 1 step"],
                           "step before clamping at 0": raw_step},
            "shm_run_s": {str(k): v for k, v in shm.items()},
            "hierarchical_shm_run_s": {str(k): v for k, v in phased.items()},
            "allreduce_1_float64_s": allreduce}
    machine = Machine(intra, inter, gamma, per_step, per_call, copy, info=info,
                      request=request, combine=combine, gamma_curve=gamma_curve,
                      copy_curve=copy_curve, node_bandwidth=bandwidth, node_curve=node_curve)
    # native_call: what comm.Allreduce costs beyond the model of Open MPI's algorithm for it
    modelled = predict("native", comm.Get_size(), 8, split, machine, "float64").time
    machine = replace(machine, native_call=max(0.0, allreduce - modelled))
    if all(shm.get(size) is not None for size in shm) and shm and split.nnodes == 1:
        # the small regime's fixed cost at 8 B, its per-byte read of the peers' slots from
        # 16 KiB, then the large regime's fixed cost at 64 KiB with that rate
        nranks, half, large_size = comm.Get_size(), limit // 2, 2 * limit
        small = max(0.0, shm[8] - predict("shm", nranks, 8, split, machine).time)
        machine = replace(machine, shm_small=small)
        rest = shm[half] - predict("shm", nranks, half, split, machine).time
        machine = replace(machine, shm_peer=max(0.0, rest / ((nranks - 1) * half)))
        large = shm[large_size] - predict("shm", nranks, large_size, split, machine).time
        machine = replace(machine, shm_large=max(0.0, large))
    if phased and all(value is not None for value in phased.values()) and split.nnodes == 1:
        # hierarchical over shared memory on this one node (no cross phase), as shm's regimes
        nranks = comm.Get_size()
        fields = {}
        for size, name in ((8, "phased_small"), (2 * limit, "phased_large")):
            modelled = predict("hierarchical", nranks, size, split,
                               replace(machine, **{name: 0.0}), intra="shm").time
            fields[name] = max(0.0, phased[size] - modelled)
        machine = replace(machine, **fields)
    return replace(machine, cores=comm.bcast(cores, root=0))
