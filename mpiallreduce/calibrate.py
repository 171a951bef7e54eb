"""Measure this machine for the cost model (a client: it runs MPI; the model does not).

    mpirun -n 2 python -m mpi4py -m mpiallreduce.calibrate -o machine.json
    mpirun -n 2 python -m mpi4py -m mpiallreduce.model calibrate -o machine.json   # the same

:func:`measure` times, under two ranks of a communicator (the others wait), everything the
model's terms are made of: a persistent-request ping-pong by size, the executor's combine and
copy by size, ``Plan.run()`` of three shapes of one-element steps, ``comm.Allreduce`` of one
float64, the shm transport's runs in its regimes and hierarchical over it, and the node's
copy bandwidth. :func:`mpiallreduce.model.fit.machine_from` turns those numbers into a
:class:`~mpiallreduce.model.Machine` (pure arithmetic, so a machine can be refitted from the
measurements a file keeps, ``info["measurements"]``); :func:`calibrate` does both.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time
from collections.abc import Sequence
from functools import partial

import numpy as np

from .model.fit import (
    NUMPY_RUN_BYTES,
    NUMPY_RUN_DTYPE,
    REUSE_ALGORITHM,
    REUSE_SIZES,
    SHM_PEER_BYTES,
    machine_from,
)
from .model.machine import INTER, INTRA, NETWORK_100G, Link, Machine
from .schedule import REDUCE
from .sizes import human
from .topology import Topology

#: timed rounds per measurement; the fastest counts.
REPEATS = 7
#: rounds of the short measurements (a round under a few ms): more, shorter rounds give a
#: shared machine more chances to leave one of them alone.
SHORT_REPEATS = 25


def _pingpong_persistent(comm, nbytes: int, iterations: int) -> float:
    """One-way time of ``nbytes`` between ranks 0 and 1 over persistent requests, the way a
    plan's steps post them (half the round trip, best of :data:`REPEATS` rounds)."""
    from mpi4py import MPI

    # a send buffer and a receive buffer, as a schedule's steps send from their input and
    # receive into scratch or the result: with one buffer for both, each message lands in
    # lines the peer has just read, and the next leaves from lines just written
    # (Machine.reuse_curve), which would dominate the one-way time at 16-256 KiB;
    # the receive buffer lies COPY_DISTANCE past the send buffer modulo 4096 (the ranks
    # allocate alike, so the peer's too), outside memcpy's slow band
    source = np.zeros(max(nbytes, 1), dtype=np.uint8)
    buf, into = source[:nbytes], _apart(source)[:nbytes]
    rank = comm.Get_rank()
    best = float("inf")
    rounds = SHORT_REPEATS if nbytes <= 64 << 10 else REPEATS
    if rank > 1:
        for _ in range(rounds):
            comm.Barrier()
        return comm.bcast(best, root=0)
    peer = 1 - rank
    send, recv = comm.Send_init(buf, peer, 8), comm.Recv_init(into, peer, 8)
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


def _sendrecv(comm, nbytes: int) -> float:
    """Seconds per blocking ``Sendrecv`` of ``nbytes`` between ranks 0 and 1, both sending at
    once as MPI's collectives exchange (best of rounds, the slower of the two; others idle).
    Many rounds of many calls up to 64 KiB: the best of 7 rounds of 100 calls scattered
    widely at 1 B-2 KiB in one job, where 25 rounds of 2000 held steady."""
    rank = comm.Get_rank()
    send, recv = np.ones(max(nbytes, 1), np.uint8), np.empty(max(nbytes, 1), np.uint8)
    run = (partial(comm.Sendrecv, send[:nbytes], 1 - rank, 7, recv[:nbytes], 1 - rank, 7)
           if rank < 2 else _idle)
    return _seconds_per_run(comm, run, int(min(2000, max(5, (32 << 20) // max(nbytes, 1)))),
                            SHORT_REPEATS if nbytes <= 64 << 10 else REPEATS)


def _idle() -> None:
    """What a rank beyond the two that measure runs: nothing."""


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

    from .ops import reducer
    from .schedule import RECEIVED_FIRST

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


#: where a calibration copy's target lies past its source, modulo 4096 bytes: half a page,
#: outside the band where glibc's memcpy (rep movsb) runs several times slower on AMD Zen 3
#: (target 1-63 bytes past the source), which the transport's copies avoid
#: (``shm.plan.copy_call``). A target allocated right after a source of a whole number of pages
#: falls in it (16 bytes past), and the calibrated copy and node rates of 64-256 KiB would come
#: out several times too slow.
COPY_DISTANCE = 2048


def _apart(source: np.ndarray) -> np.ndarray:
    """A new uint8 array of ``source``'s bytes whose address lies :data:`COPY_DISTANCE` bytes
    past the source's modulo 4096 (allocated here: allocation is part of what it measures)."""
    raw = np.empty(source.nbytes + 4096, dtype=np.uint8)
    start = (source.ctypes.data + COPY_DISTANCE - raw.ctypes.data) % 4096
    return raw[start:start + source.nbytes]


def _fresh_copy(source: np.ndarray) -> None:
    np.copyto(_apart(source), source)


def _plan_cost(comm, steps, count: int, iterations: int) -> float:
    """Seconds per ``Plan.run()`` of ``steps`` on ``count`` float64 (:func:`_seconds_per_run`)."""
    from mpi4py import MPI

    from .executor import Plan
    from .ops import reducer

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


def _seconds_per_run(comm, run, iterations: int, repeats: int = SHORT_REPEATS) -> float:
    """Seconds per call of ``run`` (the slowest rank's best of ``repeats`` rounds of
    ``iterations`` calls, each round after a barrier)."""
    from mpi4py import MPI

    elapsed = float("inf")
    for _ in range(repeats):
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
    from .schedule import COPY, Recv, Send, Step

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


#: the library's own point-to-point plans and MPI's ``Allreduce`` that :func:`measure` times at
#: small sizes in float32 (the bench's default), both modes: ``machine_from`` fits the per-call
#: terms to them (:func:`.model.fit.fit_terms`). The synthetic shapes alone price the call path
#: as it does not run: at 2 ranks the library's whole recursive doubling at 8 B takes less
#: than the shapes' one-element reducing step, and from the shapes alone the model put every
#: schedule too slow against native up to 2 KiB.
LIBRARY_ALGORITHMS = ("native", "ring", "tree", "recursive_doubling", "rabenseifner")
LIBRARY_SIZES = (8, 256, 2048)


def _run_row(comm, name: str, send, recv: np.ndarray, iterations: int,
             repeats: int = SHORT_REPEATS) -> dict:
    """One bench row (``algorithm``, ``size``, ``in_place``, ``avg_us``): ``name``'s plan, or
    ``comm.Allreduce`` for ``"native"``, on ``send`` (or ``MPI.IN_PLACE``) and ``recv``, float
    SUM, the slowest rank's best round (:func:`_seconds_per_run`)."""
    from mpi4py import MPI

    from .api import plan

    bound = None if name == "native" else plan(send, recv, MPI.SUM, comm, name)
    run = partial(comm.Allreduce, send, recv, MPI.SUM) if bound is None else bound.run
    try:  # in place, every run adds to the last result: inf costs nothing
        with np.errstate(all="ignore"):
            seconds = _seconds_per_run(comm, run, iterations, repeats)
    finally:
        if bound is not None:
            bound.free()
    return {"algorithm": name, "size": recv.nbytes, "in_place": send is MPI.IN_PLACE,
            "avg_us": seconds * 1e6}


def _library_runs(comm, iterations: int = 400) -> list[dict]:
    """Microseconds per run of :data:`LIBRARY_ALGORITHMS` at :data:`LIBRARY_SIZES` bytes of
    float32, out of place and in place (the slowest rank's best round, as bench rows:
    ``algorithm``, ``size``, ``in_place``, ``avg_us``)."""
    from mpi4py import MPI

    rows = []
    for in_place in (False, True):
        for size in LIBRARY_SIZES:
            x = np.ones(size // 4, np.float32)
            y = np.ones_like(x)
            send = MPI.IN_PLACE if in_place else x
            rows += [_run_row(comm, name, send, y, iterations) for name in LIBRARY_ALGORITHMS]
    return rows


def _reuse_runs(comm, iterations: int = 20) -> list[dict]:
    """Microseconds per run of :data:`.model.fit.REUSE_ALGORITHM`'s plan at
    :data:`.model.fit.REUSE_SIZES` bytes of float64, out of place and in place, interleaved by
    size (bench rows, as :func:`_library_runs`): in place it sends from and writes its whole
    result, out of place neither (``Machine.reuse_curve``)."""
    from mpi4py import MPI

    rows = []
    for size in REUSE_SIZES:
        x = np.ones(size // 8, np.float64)
        y = np.ones_like(x)
        rows += [_run_row(comm, REUSE_ALGORITHM, MPI.IN_PLACE if in_place else x, y,
                          max(iterations, (4 << 20) // size), REPEATS)
                 for in_place in (False, True)]
    return rows


def _shm_cost(comm, nbytes: int, iterations: int, algorithm: str = "shm", dtype=np.float32,
              **params) -> float | None:
    """Seconds per run of the shm transport's plan of ``nbytes`` of ``dtype`` (slowest rank),
    or None where it does not run (ranks on several nodes, no shared memory); ``algorithm``
    hierarchical with ``intra="shm"``: its node-phased plan."""
    from mpi4py import MPI

    from .api import plan

    x = np.ones(max(nbytes // np.dtype(dtype).itemsize, 1), dtype)
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
    target = _apart(source)
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

    from .ops import reducer
    from .schedule import RECEIVED_FIRST

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
        target = _apart(source)
        np.copyto(target, source)
        best = min(best, time.perf_counter() - start)
        del target
    return best / nbytes


def _fault_cost(nbytes: int = 64 << 20, repeats: int = 3) -> float:
    """Seconds per byte of the first writes into a fresh ``malloc`` of ``nbytes`` (the page
    faults and the kernel's zeroing) beyond writes into memory already mapped, best of
    ``repeats``; 0.0 where libc's malloc cannot be called. Open MPI's allreduce allocates a
    whole-message temporary with malloc every call, and glibc maps one of 32 MiB or more
    afresh each time (its largest mmap threshold on 64-bit), so its receives fault every page
    in (``model.native.OMPI_FRESH_BYTES``). NumPy's own large arrays ask for huge pages, whose
    faults cost far less: hence libc's malloc here."""
    import ctypes

    try:
        libc = ctypes.CDLL(None)
        malloc, free = libc.malloc, libc.free
    except (OSError, AttributeError):
        return 0.0
    malloc.restype, malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    free.argtypes = [ctypes.c_void_p]
    mapped = np.zeros(nbytes, dtype=np.uint8)
    fresh = written = float("inf")
    for _ in range(repeats):
        address = malloc(nbytes)
        if not address:
            return 0.0
        try:
            memory = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(address))
            start = time.perf_counter()
            memory.fill(1)
            fresh = min(fresh, time.perf_counter() - start)
        finally:
            free(address)
        start = time.perf_counter()
        mapped.fill(1)
        written = min(written, time.perf_counter() - start)
    return max(0.0, fresh - written) / nbytes


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


def measure(comm, sizes: Sequence[int] = CURVE_SIZES, rate_sizes: Sequence[int] = RATE_SIZES,
            bandwidth_bytes: int = 64 << 20) -> dict:
    """Measure the machine under two ranks of ``comm`` (collective: call it on every rank);
    return the numbers (the same on every rank: rank 0's, broadcast), JSON-able.

    ``sizes`` are the ping-pong's (1 B .. 64 MiB), ``rate_sizes`` those of the combine, copy and
    node-bandwidth curves, ``bandwidth_bytes`` what each rank copies for the node's bandwidth
    (smaller ones make a quick, rougher calibration).
    """
    from mpi4py import MPI

    from .shm import small_bytes

    if comm.Get_size() < 2:
        raise ValueError("calibrate needs at least 2 ranks: mpirun -n 2 python -m mpi4py -m "
                         "mpiallreduce.calibrate -o machine.json")
    times = []
    for nbytes in sizes:
        iterations = int(min(100, max(5, (16 << 20) // max(nbytes, 1))))
        times.append(_pingpong_persistent(comm, nbytes, iterations))
    _sendrecv(comm, 1)  # untimed: the first exchanges of a job run slower
    exchanges = [_sendrecv(comm, nbytes) for nbytes in sizes]
    gamma = [[name, comm.bcast(_gamma(name), root=0)]
             for name in ("float32", "float64", "int32", "int64")]
    gamma_curve = comm.bcast(_gamma_curve(rate_sizes), root=0)
    copy = comm.bcast(_copy_cost(), root=0)
    fault = comm.bcast(_fault_cost(), root=0)
    copy_curve = comm.bcast(_copy_curve(rate_sizes), root=0)
    shapes = _interpreter_terms(comm)
    allreduce = _allreduce_cost(comm)
    library = _library_runs(comm)
    reuse = _reuse_runs(comm)
    split = Topology.from_comm(comm)
    # the cores of this node: the union of what its ranks may run on (mpirun binds each rank to
    # one core, so one rank's own affinity says 1)
    mine = (set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
            else set(range(os.cpu_count() or 1)))
    gathered = comm.allgather(mine)
    cores = len(set().union(*(cpus for rank, cpus in enumerate(gathered)
                              if split.node[rank] == split.node[comm.Get_rank()])))
    across = split.node[0] != split.node[1]
    limit = small_bytes(comm.Get_size())  # the small regime's most bytes at this size
    shm = {} if across else {size: _shm_cost(comm, size, 100)
                             for size in (8, SHM_PEER_BYTES, limit // 2, 2 * limit)}
    # where the small regime's load and reduce call NumPy (types the compiled path leaves to it)
    numpy_run = {} if across else {NUMPY_RUN_BYTES: _shm_cost(comm, NUMPY_RUN_BYTES, 100,
                                                              dtype=NUMPY_RUN_DTYPE)}
    phased = {} if across else {size: _shm_cost(comm, size, 100, "hierarchical", intra="shm")
                                for size in (8, 2 * limit)}
    node_curve = None
    bandwidth = 0.0
    if not across:
        node_curve = [(size, _node_bandwidth(comm, size)) for size in rate_sizes
                      if size < bandwidth_bytes]
        bandwidth = _node_bandwidth(comm, bandwidth_bytes)
        node_curve.append((bandwidth_bytes, bandwidth))
    info = {"mpi_library": MPI.Get_library_version().strip().splitlines()[0].rstrip("\x00"),
            "mpi4py": __import__("mpi4py").__version__, "numpy": np.__version__,
            "python": platform.python_version(), "host": platform.node(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "load": os.getloadavg()[0] if hasattr(os, "getloadavg") else None}
    measured = {
        "pingpong_sizes": [int(size) for size in sizes], "pingpong_s": times,
        "pingpong_buffers": 2,
        "sendrecv_s": exchanges,
        "gamma": gamma, "gamma_curve": [list(p) for p in gamma_curve], "copy": copy,
        "copy_curve": [list(p) for p in copy_curve], "fault": fault, "plan_run_s": shapes,
        "allreduce_s": allreduce, "library_runs": library, "reuse_runs": reuse,
        "node": list(split.node), "cores": cores,
        "shm_small_limit": limit, "shm_run_s": {str(k): v for k, v in shm.items()},
        "shm_numpy_run_s": {str(k): v for k, v in numpy_run.items()},
        "hierarchical_shm_run_s": {str(k): v for k, v in phased.items()},
        "node_curve": None if node_curve is None else [list(p) for p in node_curve],
        "node_bandwidth": bandwidth, "info": info}
    return comm.bcast(measured, root=0)


def calibrate(comm, sizes: Sequence[int] = CURVE_SIZES, inter: Link | None = None,
              rate_sizes: Sequence[int] = RATE_SIZES, bandwidth_bytes: int = 64 << 20
              ) -> Machine:
    """Measure the machine under two ranks of ``comm`` (collective) and return the model's
    machine for it (:func:`measure`, then :func:`mpiallreduce.model.fit.machine_from`; every
    number a measurement of this machine, none fitted to the bench). The measured link is the
    inter-node one when ranks 0 and 1 are on different nodes; the other class comes from
    ``inter`` (default :data:`NETWORK_100G`) or the built-in machine."""
    return machine_from(measure(comm, sizes, rate_sizes, bandwidth_bytes), inter)


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"{text} must be >= 0")
    return value


def build_parser(prog: str = "python -m mpiallreduce.calibrate") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="Measure this machine for the cost "
                                     "model (under mpirun -n 2).")
    parser.add_argument("-o", "--output", required=True, metavar="FILE.json")
    parser.add_argument("--inter-alpha", type=_seconds, default=None, metavar="S",
                        help=f"inter-node latency in s (default {NETWORK_100G.alpha:g}: 100 Gb/s)")
    parser.add_argument("--inter-beta", type=_seconds, default=None, metavar="S_PER_B",
                        help=f"inter-node s/B (default {NETWORK_100G.beta:g}: 100 Gb/s)")
    return parser


def main(argv=None, out=None, prog: str = "python -m mpiallreduce.calibrate") -> int:
    """Calibrate on COMM_WORLD and write the machine file; return the exit status."""
    from mpi4py import MPI

    out = sys.stdout if out is None else out
    opts = build_parser(prog).parse_args(argv)
    comm = MPI.COMM_WORLD
    inter = None
    if opts.inter_alpha is not None or opts.inter_beta is not None:
        inter = Link(NETWORK_100G.alpha if opts.inter_alpha is None else opts.inter_alpha,
                     NETWORK_100G.beta if opts.inter_beta is None else opts.inter_beta)
    try:
        machine = calibrate(comm, inter=inter)
        if comm.Get_rank() == 0:
            machine.save(opts.output)
    except (ValueError, OSError) as error:
        print(f"{prog}: error: {error}", file=sys.stderr)
        return 2
    if comm.Get_rank() == 0:
        _report(machine, opts.output, out)
    return 0


def _report(machine: Machine, path: str, out) -> None:
    link = machine.info["measured_link"]
    measured = machine.link(INTER if link == "inter" else INTRA)
    print(f"# {machine.info['mpi_library']} on {machine.info['host']}, "
          f"{machine.info['date']}", file=out)
    print(f"{link}: alpha {measured.alpha * 1e6:.3f} us, beta {measured.beta:.4g} s/B "
          f"({1 / measured.beta / 1e9 if measured.beta else float('inf'):.2f} GB/s)", file=out)
    for name, value in machine.gamma:
        print(f"gamma {name}: {value:.4g} s/B ({1 / value / 1e9 if value else 0:.2f} GB/s)",
              file=out)
    print(f"step: {machine.step * 1e6:.2f} us, request: {machine.request * 1e6:.2f} us, "
          f"combine: {machine.combine * 1e6:.2f} us, call: {machine.call * 1e6:.2f} us, "
          f"native_call: {machine.native_call * 1e6:.2f} us, cores: {machine.cores}", file=out)
    curve = measured.curve or ()
    shown = (8, 2048, 4096, 65536, 1 << 20, 64 << 20)
    print("one-way: " + ", ".join(f"{human(b)} {t * 1e6:.3g} us" for b, t in curve
                                  if b in shown), file=out)
    if machine.native_link is not None and machine.native_link.curve:
        print("MPI's blocking exchange (native's messages): " + ", ".join(
            f"{human(b)} {t * 1e6:.3g} us" for b, t in machine.native_link.curve
            if b in shown[:4]), file=out)
    if machine.info.get("measurements", {}).get("library_runs"):
        print("(step, request, combine, call and native_call fitted to the library's own "
              "runs at " + ", ".join(human(size) for size in LIBRARY_SIZES) + ")", file=out)
    above = ("" if machine.shm_call is None
             else f" (+{machine.shm_call * 1e6:.2f} us where it calls NumPy's reduce)")
    print(f"shm: small {machine.shm_small * 1e6:.2f} us{above}, large "
          f"{machine.shm_large * 1e6:.2f} us per call, {machine.shm_peer:.3g} s/B from the "
          f"peers' slots; first writes to fresh pages {machine.fault * 1e9:.3f} ns/B; node "
          f"bandwidth {machine.node_bandwidth / 1e9:.1f} GB/s; load "
          f"{machine.info.get('load')}", file=out)
    if machine.shm_peer_curve is not None:
        print("shm's reads of the peers' slots: " + ", ".join(
            f"{human(b)} {r:.3g} s/B" for b, r in machine.shm_peer_curve), file=out)
    if machine.reuse_curve is not None:
        print("result bytes sent from and written in one run: " + ", ".join(
            f"{human(b)} {r:.3g} s/B" for b, r in machine.reuse_curve), file=out)
    if machine.phased_small is not None:
        print(f"hierarchical/cascade over shm: small {machine.phased_small * 1e6:.2f} us, "
              f"large {machine.phased_large * 1e6:.2f} us per call", file=out)
    print(f"wrote {path}", file=out)


if __name__ == "__main__":
    sys.exit(main())
