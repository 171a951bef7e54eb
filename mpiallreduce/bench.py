"""OSU-style allreduce benchmark: latency, bus bandwidth and a check against MPI's own Allreduce.

    mpirun -n 4 python -m mpi4py -m mpiallreduce.bench [--sizes 8:16M] [--algorithms all] ...

For every message size (powers of two) and every algorithm, on every rank: build a plan (outside
any timing), run it ``warmup`` times untimed, barrier, time ``iterations`` runs with
``MPI.Wtime`` and keep this rank's mean. The row shows the average, minimum and maximum of the
per-rank means across ranks (as OSU's osu_allreduce does), algbw = size / avg and
busbw = algbw * 2(p-1)/p (as nccl-tests defines it), the ratio native avg / this avg (above 1:
faster than MPI's own Allreduce) and the validation verdict: after timing, the plan runs once
more on fresh input and every rank compares its result with ``comm.Allreduce`` of the same input.
The inputs are small integers (in the chosen dtype), so every reduction order gives the exact
same result and the comparison is bit for bit.

Output goes to rank 0's stdout. Exit status: 0, 1 if any validation failed, 2 for bad arguments,
the same on every rank.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import datetime
import importlib.util
import json
import os
import platform
import statistics
import sys
from dataclasses import asdict, dataclass

import numpy as np
from mpi4py import MPI

import mpiallreduce as mar

from .ops import AVG, DTYPES, OP_NAMES, reducer
from .sizes import UsageError, human, parse_size, parse_sizes  # noqa: F401 (bench.parse_size...)
from .topology import Topology

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2
#: the variable the library reads for simulated nodes (see DESIGN.md, Topology).
RANKS_PER_NODE_ENV = "MPIALLREDUCE_RANKS_PER_NODE"
DEFAULT_SIZES = "8:16M"
#: default iteration rule: MAX_ITERATIONS up to BUDGET_BYTES / MAX_ITERATIONS bytes, then fewer
#: (about BUDGET_BYTES moved per rank and size), never under MIN_ITERATIONS.
MAX_ITERATIONS, MIN_ITERATIONS, BUDGET_BYTES = 1000, 20, 64 * 2**20
_ITERATION_RULE = (f"min({MAX_ITERATIONS}, {BUDGET_BYTES // 2**20}M/size), "
                   f"at least {MIN_ITERATIONS}")


class _HelpShown(Exception):
    """``-h`` or ``--version`` printed its text; exit 0."""


class _Parser(argparse.ArgumentParser):
    """argparse that raises instead of exiting and prints help on one rank only."""

    def __init__(self, *args, printing: bool = True, **kwargs):
        super().__init__(*args, **kwargs)
        self.printing = printing

    def error(self, message):
        raise UsageError(message)

    def exit(self, status=0, message=None):
        if message:
            raise UsageError(message.strip())
        raise _HelpShown

    def _print_message(self, message, file=None):
        if self.printing:
            super()._print_message(message, file)


# -- arguments -------------------------------------------------------------------------------------

def default_iterations(size: int) -> tuple[int, int]:
    """Return (iterations, warm-up) for ``size`` bytes when the command line does not fix them."""
    iterations = max(MIN_ITERATIONS, min(MAX_ITERATIONS, BUDGET_BYTES // max(size, 1)))
    return iterations, max(1, iterations // 10)


#: how an algorithm is called: a plan's run(), the one-shot function with or without the check,
#: a plan's start().wait(), the one-shot iallreduce(...).wait(), through the drop-in
#: ``mar.Comm`` (its Allreduce with or without the check, its Allreduce_init's Start + Wait), and
#: plan-shared: a plan's run() on buffers from ``mar.shared_empty`` (zero copy under ``shm``).
APIS = ("plan", "call", "call-nocheck", "start", "iallreduce", "comm", "comm-nocheck",
        "comm-init", "plan-shared")
#: the label of mpi4py's own ``comm.Allreduce``, timed beside the one-shot calls.
MPI_CALL = "comm.Allreduce"
#: the label of MPI's own persistent request (``comm.Allreduce_init``: Start + Wait), timed
#: beside the persistent and non-blocking modes.
MPI_INIT = "comm.Allreduce_init"


def parse_apis(text: str) -> list[str]:
    """Parse ``--api``: a comma list of :data:`APIS`."""
    apis = [a.strip() for a in text.split(",") if a.strip()]
    unknown = [a for a in apis if a not in APIS]
    if unknown or not apis:
        raise UsageError(f"--api {text!r}: choose a comma list of {', '.join(APIS)}")
    return list(dict.fromkeys(apis))


def parse_algorithms(text: str) -> list[str]:
    """Return the algorithm names of a comma list; ``all`` means every one, ``auto`` included."""
    names: list[str] = []
    for item in (part.strip() for part in text.split(",")):
        expanded = list(mar.ALGORITHMS) if item == "all" else [item]
        for name in expanded:
            if name not in mar.ALGORITHMS:
                raise UsageError(f"unknown algorithm {name!r} in --algorithms; choose from "
                                 f"{', '.join(mar.ALGORITHMS)} or all")
            if name not in names:
                names.append(name)
    # native is the reference of every ratio: always run it, and first.
    return ["native"] + [name for name in names if name != "native"]


def _op(name: str):
    return AVG if name == "AVG" else getattr(MPI, name)


def build_parser(printing: bool = True) -> _Parser:
    """Return the command-line parser (every option documents its default)."""
    parser = _Parser(
        prog="python -m mpiallreduce.bench", printing=printing,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=("OSU-style allreduce benchmark of mpiallreduce's algorithms against MPI's own "
                     "Allreduce.\nRun under mpirun: mpirun -n 4 python -m mpi4py -m "
                     "mpiallreduce.bench"),
        epilog=("timing: for each size and algorithm a plan is built (untimed), run WARMUP times "
                "untimed,\nthen after a barrier ITERATIONS runs are timed with MPI.Wtime; each "
                "rank keeps its mean,\nand avg/min/max are taken over those per-rank means "
                "(as OSU does).\nalgbw = size / avg; busbw = algbw * 2(p-1)/p (nccl-tests); "
                "vs_native = native avg / avg\n(above 1: faster than native). Validation: after "
                "timing, one more run on fresh input is\ncompared on every rank, bit for bit, "
                "with comm.Allreduce of the same small-integer input.\n"
                "exit status: 0 ok, 1 a validation failed, 2 bad arguments (same on every rank)."))
    names = ", ".join(mar.ALGORITHMS)
    parser.add_argument("--algorithms", default="all", metavar="LIST",
                        help=f"comma list of {names}, or all (every one); native always "
                             f"runs, as the reference (default: all)")
    parser.add_argument("--sizes", default=DEFAULT_SIZES, metavar="MIN:MAX",
                        help="message sizes in bytes per rank, every power of two from MIN to MAX; "
                             "K, M, G suffixes are powers of 1024; one size N is N:N; a comma "
                             "list (8,64K,8M:16M) takes the union "
                             f"(default: {DEFAULT_SIZES})")
    parser.add_argument("--dtype", default="float32", choices=[d.name for d in DTYPES],
                        metavar="DTYPE", help="element type, one of "
                        f"{', '.join(d.name for d in DTYPES)} (default: float32)")
    parser.add_argument("--op", default="SUM", choices=OP_NAMES, type=str.upper, metavar="OP",
                        help=f"reduction, one of {', '.join(OP_NAMES)}; it must be defined for "
                             "the dtype (default: SUM)")
    parser.add_argument("--iterations", type=int, default=None, metavar="N",
                        help=f"timed runs per size and algorithm (default: {_ITERATION_RULE})")
    parser.add_argument("--warmup", type=int, default=None, metavar="N",
                        help="untimed runs before timing (default: iterations/10, at least 1)")
    parser.add_argument("--api", default="plan", metavar="LIST",
                        help="comma list of how each algorithm is called: plan (mar.plan(...).run()),"
                             " call (mar.allreduce(...), one-shot, check=True), call-nocheck "
                             "(mar.allreduce(..., check=False)), start (plan.start().wait()), "
                             "iallreduce (mar.iallreduce(...).wait()), comm and comm-nocheck "
                             "(mar.Comm(comm, algorithm).Allreduce with and without the check), "
                             "comm-init (mar.Comm's Allreduce_init: Start + Wait), plan-shared (a "
                             "plan on mar.shared_empty buffers); with a mode other than plan, "
                             "comm.Allreduce itself is timed too (and comm.Allreduce_init's Start "
                             "+ Wait beside start, iallreduce and comm-init), and rows of a mode "
                             "are named ALGORITHM/MODE (default: plan)")
    parser.add_argument("--repeat", type=int, default=1, metavar="R",
                        help="measure every size R times, the algorithms interleaved in each round; "
                             "rows show the median and the spread across rounds, and the closing "
                             "recommendation says whether a lead exceeds it (default: 1)")
    parser.add_argument("--in-place", action="store_true",
                        help="reduce in place (sendbuf = MPI.IN_PLACE) (default: off)")
    parser.add_argument("--no-validate", dest="validate", action="store_false",
                        help="skip the comparison with comm.Allreduce (default: validate)")
    parser.add_argument("--json", metavar="FILE", help="write metadata and rows as JSON "
                        "(default: none)")
    parser.add_argument("--csv", metavar="FILE", help="write rows as CSV, metadata as leading "
                        "'#' lines (default: none)")
    parser.add_argument("--plot", metavar="FILE.png", help="draw latency and busbw against size "
                        "(needs matplotlib, the 'plot' extra) (default: none)")
    parser.add_argument("--trace", metavar="FILE.json",
                        help="record the timed runs of the schedules (one size only) as a Chrome "
                             "Trace file, one track per rank (warm-up, validation and native runs "
                             "are not recorded) (default: none)")
    parser.add_argument("--ranks-per-node", type=int, default=None, metavar="K",
                        help=f"simulate nodes of K consecutive ranks (sets {RANKS_PER_NODE_ENV} "
                             "for the hierarchical algorithms) (default: "
                             f"${RANKS_PER_NODE_ENV} if set, else the real layout)")
    parser.add_argument("--quiet", action="store_true",
                        help="print no table, only failures and errors (default: off)")
    parser.add_argument("--version", action="version",
                        version=f"mpiallreduce.bench {mar.__version__}")
    return parser


@dataclass
class Options:
    """A checked command line."""

    algorithms: list[str]
    apis: list[str]
    repeat: int
    sizes: list[int]
    dtype: np.dtype
    op: str
    iterations: int | None
    warmup: int | None
    in_place: bool
    validate: bool
    json: str | None
    csv: str | None
    plot: str | None
    ranks_per_node: int | None
    quiet: bool
    notes: list[str]
    trace: str | None = None

    @property
    def width(self) -> int:
        """Width of the algorithm column."""
        return max(9, *(len(label) for _, _, label in self.cases))

    @property
    def cases(self) -> list[tuple[str, str, str]]:
        """(algorithm, api, row label) in the order measured: the native plan, comm.Allreduce if
        a call mode is timed, then every algorithm in every mode."""
        cases = [("native", "plan", "native")]  # the reference of vs_native, always first
        if any(api != "plan" for api in self.apis):
            cases.append((MPI_CALL, MPI_CALL, MPI_CALL))
        if any(api in ("start", "iallreduce", "comm-init") for api in self.apis):
            cases.append((MPI_INIT, MPI_INIT, MPI_INIT))
        return cases + [(name, api, name if api == "plan" else f"{name}/{api}")
                        for name in self.algorithms for api in self.apis
                        if (name, api) != ("native", "plan")]


def check_outputs(opts: Options) -> None:
    """Raise UsageError if an output file could not be written (before a long run, not after)."""
    for flag in ("json", "csv", "plot", "trace"):
        path = getattr(opts, flag)
        if path is None:
            continue
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
            raise UsageError(f"--{flag} {path}: folder {folder} does not exist or is not writable")


def parse_args(argv=None, printing: bool = True) -> Options:
    """Parse and check a command line; raise UsageError (or _HelpShown) with the same outcome on
    every rank for the same argv."""
    args = build_parser(printing).parse_args(argv)
    notes = []
    dtype = np.dtype(args.dtype)
    try:
        reducer(_op(args.op), dtype)
    except TypeError as exc:
        raise UsageError(f"--op {args.op} with --dtype {args.dtype}: {exc}") from None
    sizes = parse_sizes(args.sizes)
    small = [s for s in sizes if s < dtype.itemsize]
    if small:
        sizes = [s for s in sizes if s >= dtype.itemsize]
        if not sizes:
            raise UsageError(f"--sizes {args.sizes!r}: every size is smaller than one {dtype.name} "
                             f"element ({dtype.itemsize} B)")
        notes.append(f"sizes below one {dtype.name} element ({dtype.itemsize} B) skipped: "
                     f"{', '.join(map(human, small))}")
    for name in ("iterations", "warmup"):
        value = getattr(args, name)
        if value is not None and value < (1 if name == "iterations" else 0):
            raise UsageError(f"--{name} {value}: must be at least {1 if name == 'iterations' else 0}")
    ranks_per_node = args.ranks_per_node
    if ranks_per_node is None and os.environ.get(RANKS_PER_NODE_ENV):
        text = os.environ[RANKS_PER_NODE_ENV]
        if not text.strip().isdigit():
            raise UsageError(f"{RANKS_PER_NODE_ENV}={text!r}: must be a positive integer")
        ranks_per_node = int(text)
    if ranks_per_node is not None and ranks_per_node < 1:
        raise UsageError(f"--ranks-per-node {ranks_per_node}: must be at least 1")
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        raise UsageError("--plot needs matplotlib: pip install 'mpiallreduce[plot]'")
    if args.repeat < 1:
        raise UsageError(f"--repeat {args.repeat}: must be at least 1")
    if args.trace and len(sizes) != 1:
        raise UsageError(f"--trace records the runs of one size; --sizes {args.sizes!r} gives "
                         f"{len(sizes)} (give one, e.g. --sizes 64K)")
    return Options(parse_algorithms(args.algorithms), parse_apis(args.api), args.repeat, sizes,
                   dtype, args.op,
                   args.iterations, args.warmup, args.in_place, args.validate, args.json, args.csv, args.plot,
                   ranks_per_node, args.quiet, notes, args.trace)


# -- measuring -------------------------------------------------------------------------------------

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
    red = reducer(_op(op), x.dtype)
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


def _topology(comm, ranks_per_node: int | None):
    """Return the ``topology=`` the plans are built with, the layout the header describes.

    Simulated nodes of ``ranks_per_node`` consecutive ranks; ``None`` (the real layout) lets the
    library use ``Topology.from_comm`` for the algorithms that need one.
    """
    if ranks_per_node is None:
        return None
    return Topology.simulated(comm, ranks_per_node=ranks_per_node)


class _Case:
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
        op = _op(opts.op)
        kwargs = dict(op=op, comm=comm, algorithm=algorithm, topology=topology)
        try:
            plan = (mar.plan(sendbuf, recv, check=True, **kwargs)
                    if api in ("plan", "start") else None)
        except ValueError as exc:
            return str(exc)
        if api == MPI_CALL:
            red = reducer(op, self.x.dtype)
            run = lambda: comm.Allreduce(sendbuf, recv, red.mpi_op)
        elif api == MPI_INIT:
            plan = comm.Allreduce_init(sendbuf, recv, reducer(op, self.x.dtype).mpi_op)
            run = lambda: (plan.Start(), plan.Wait())
        elif api in ("call", "call-nocheck"):
            # the arguments spelled out, as a caller writes them (a **kwargs expansion per call
            # would cost more than the call path itself at 8 B)
            check = api == "call"
            run = lambda: mar.allreduce(sendbuf, recv, op, comm, algorithm, topology, check)
        elif api == "start":
            run = lambda: plan.start().wait()
        elif api == "iallreduce":
            run = lambda: mar.iallreduce(sendbuf, recv, op, comm, algorithm, topology).wait()
        elif api in ("comm", "comm-nocheck", "comm-init"):
            try:
                drop_in = mar.Comm(comm, algorithm, topology=topology, check=api != "comm-nocheck")
                if api == "comm-init":
                    plan = drop_in.Allreduce_init(sendbuf, recv, op)
            except ValueError as exc:
                return str(exc)
            run = ((lambda: (plan.Start(), plan.Wait())) if api == "comm-init"
                   else (lambda: drop_in.Allreduce(sendbuf, recv, op)))
        else:
            run = plan.run
        if api == "plan":
            self.picked[algorithm] = getattr(plan, "algorithm", algorithm)
        with _freeing(plan):
            # in place, every run reduces the last result again: values may overflow to inf,
            # which costs nothing and is never validated (the input is restored first)
            with np.errstate(all="ignore") if opts.in_place else contextlib.nullcontext():
                seconds = _mean_time(run, self.iterations, self.warmup, comm, self.untraced)
            ok = True
            if opts.validate:
                if opts.in_place:
                    recv[...] = self.x
                else:
                    recv.fill(99)  # so a run that writes nothing cannot pass
                comm.Barrier()  # a shared result: no peer writes into it before it is reset
                with self.untraced():
                    run()
                if api in (MPI_CALL, MPI_INIT) and reducer(op, self.x.dtype).average:
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


def _stats(comm, seconds: float) -> tuple[float, float, float] | None:
    """Return (avg, min, max) over ranks of the per-rank means in µs, on rank 0 (None elsewhere)."""
    means = comm.gather(seconds, root=0)
    if means is None:
        return None
    micro = [1e6 * s for s in means]
    return sum(micro) / len(micro), min(micro), max(micro)


# -- output ----------------------------------------------------------------------------------------

def _layout(comm, ranks_per_node: int | None) -> tuple[str, int]:
    """Return (ranks-per-node description, number of nodes) for the header."""
    p = comm.size
    if ranks_per_node is not None:
        nodes = -(-p // ranks_per_node)
        uneven = "" if p % ranks_per_node == 0 else f", last node {p % ranks_per_node}"
        return (f"{ranks_per_node} (simulated: {RANKS_PER_NODE_ENV}={ranks_per_node}, "
                f"{nodes} node(s){uneven})"), nodes
    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    sizes = comm.allgather(local.size if local.rank == 0 else 0)
    local.Free()
    per_node = sorted({s for s in sizes if s})
    nodes = sum(1 for s in sizes if s)
    return f"{'/'.join(map(str, per_node))} (real: {nodes} node(s))", nodes


def metadata(comm, opts: Options) -> dict:
    """Return the run's metadata (the same on every rank except the host name)."""
    layout, nodes = _layout(comm, opts.ranks_per_node)
    return {
        "tool": "mpiallreduce.bench",
        "version": mar.__version__,
        # "Open MPI v5.0.11, package: ..." / "MPICH Version:      5.0.2": the first part, one space
        "mpi_library": " ".join(MPI.Get_library_version().strip().splitlines()[0].split(",")[0]
                                .split()),
        "mpi_library_full": MPI.Get_library_version().strip().splitlines()[0],
        "mpi_standard": "{}.{}".format(*MPI.Get_version()),
        "mpi4py": __import__("mpi4py").__version__,
        "numpy": np.__version__,
        "python": platform.python_version(),
        "host": platform.node(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "ranks": comm.size,
        "ranks_per_node": layout,
        "nodes": nodes,
        "dtype": opts.dtype.name,
        "op": opts.op,
        "in_place": opts.in_place,
        "validate": opts.validate,
        "algorithms": opts.algorithms,
        "sizes": opts.sizes,
        "iterations": (f"fixed {opts.iterations}" if opts.iterations is not None else
                       _ITERATION_RULE),
        "warmup": (f"fixed {opts.warmup}" if opts.warmup is not None else
                   "iterations/10, at least 1"),
        "timer": "MPI.Wtime",
        "repeat": opts.repeat,
        "api": opts.apis,
        "trace": opts.trace,
    }


def header_lines(meta: dict, width: int) -> list[str]:
    """Return the ``#`` header and the column titles."""
    return [
        f"# {meta['tool']} {meta['version']}: allreduce latency and bandwidth (OSU-style)",
        f"# MPI: {meta['mpi_library']} (MPI {meta['mpi_standard']}); mpi4py {meta['mpi4py']}, "
        f"numpy {meta['numpy']}, Python {meta['python']}; host {meta['host']}, {meta['date']}",
        f"# ranks: {meta['ranks']}, ranks per node: {meta['ranks_per_node']}",
        f"# dtype: {meta['dtype']}, op: {meta['op']}, in place: {'yes' if meta['in_place'] else 'no'}"
        f", validation: {'on (bit for bit vs comm.Allreduce)' if meta['validate'] else 'off'}",
        f"# iterations: {meta['iterations']}; warm-up: {meta['warmup']} (untimed); rounds: "
        f"{meta.get('repeat', 1)} (algorithms interleaved; rows show the median round)",
        "# time: barrier, then the mean over iterations on each rank; avg/min/max over ranks (us)",
        "# algbw = size/avg, busbw = algbw*2(p-1)/p (GB/s, 1e9 B/s); "
        "vs_native = native avg/avg (>1: faster than native)",
        "#",
        f"# {'size(B)':>10} {'algorithm':<{width}} {'avg(us)':>11} {'min(us)':>11} {'max(us)':>11} "
        f"{'algbw(GB/s)':>11} {'busbw(GB/s)':>11} {'vs_native':>9} check",
    ]


def format_row(row: Row, width: int, spread: bool = False) -> str:
    line = (f"  {row.size:>10} {row.algorithm:<{width}} {row.avg_us:>11.2f} {row.min_us:>11.2f} "
            f"{row.max_us:>11.2f} {row.algbw_gbs:>11.4f} {row.busbw_gbs:>11.4f} "
            f"{row.vs_native:>9.2f} {row.check}")
    if spread:
        line += (f"  spread {row.avg_lo_us:.2f}-{row.avg_hi_us:.2f} us, "
                 f"vs_native {row.vs_native_lo:.2f}-{row.vs_native_hi:.2f}")
    return line


def _beats_native(row: Row) -> bool:
    """Faster than native beyond the measured spread: in every round (--repeat), or, with one
    round, by at least the 1% that the table's two decimals can show."""
    if row.repeats > 1:
        return row.vs_native_lo > 1
    return round(row.vs_native, 2) > 1


def _span(sizes: list[int]) -> str:
    return human(sizes[0]) if len(sizes) == 1 else f"{human(sizes[0])}-{human(sizes[-1])}"


def recommendations(rows: list[Row]) -> list[str]:
    """Per range of sizes, the fastest way to call (plan rows; median time), and whether it
    beats native by more than the spread measured."""
    plans = [r for r in rows if r.algorithm not in (MPI_CALL, MPI_INIT) and "/" not in r.algorithm]
    best: dict[int, Row] = {}
    for row in plans:
        if row.size not in best or row.avg_us < best[row.size].avg_us:
            best[row.size] = row
    groups: list[tuple[str, list[Row]]] = []
    for size in sorted(best):
        row = best[size]
        # auto where it ran native is native: never "faster than native" by noise alone
        name = row.algorithm if row.runs != "native" and _beats_native(row) else "native"
        if groups and groups[-1][0] == name:
            groups[-1][1].append(row)
        else:
            groups.append((name, [row]))
    lines = []
    for name, group in groups:
        sizes = [r.size for r in group]
        if name == "native":
            close = [f"{r.algorithm} {human(r.size)} ({r.vs_native:.2f}x)" for r in group
                     if r.algorithm != "native" and r.runs != "native"]
            note = (f"; ahead by less than the spread: {', '.join(close)}" if close else "")
            lines.append(f"# recommend {_span(sizes)}: native (nothing beats it beyond the "
                         f"measured spread{note})")
        else:
            ratios = ", ".join(f"{human(r.size)} {r.vs_native:.2f}x" for r in group)
            spread = ("in every round" if group[0].repeats > 1
                      else "one round: rerun with --repeat 3 to see the spread")
            lines.append(f"# recommend {_span(sizes)}: {name} (faster than native: {ratios}; "
                         f"{spread})")
    return lines


def summary_lines(rows: list[Row], algorithms: list[str]) -> list[str]:
    """Return one closing line per algorithm (mean busbw, the sizes where it beat native beyond
    the spread, or its cost against comm.Allreduce for the call modes), then recommendations."""
    repeats = max((r.repeats for r in rows), default=1)
    beyond = (f"in all {repeats} rounds" if repeats > 1
              else "by at least 1%; one round, no spread measured")
    lines = ["#", f"# summary: mean busbw over sizes; sizes where avg latency beat native ({beyond})"]
    for name in algorithms:
        mine = [r for r in rows if r.algorithm == name]
        if not mine:
            continue
        mean = sum(r.busbw_gbs for r in mine) / len(mine)
        line = f"# {name}: mean busbw {mean:.4f} GB/s over {len(mine)} size(s)"
        if "/" in name or name in (MPI_CALL, MPI_INIT):
            base = {r.size: r.avg_us for r in rows if r.algorithm == MPI_CALL}
            ratios = [f"{human(r.size)} {r.avg_us / base[r.size]:.2f}x" for r in mine
                      if r.size in base and name != MPI_CALL]
            if ratios:
                line += f"; time / comm.Allreduce: {', '.join(ratios)}"
        elif name != "native":
            wins = [f"{human(r.size)} ({r.vs_native:.2f}x)" for r in mine if _beats_native(r)]
            line += (f"; faster than native at {len(wins)} size(s): {', '.join(wins)}" if wins
                     else "; never faster than native")
        lines.append(line)
    return lines + ["#"] + recommendations(rows)


def write_json(path: str, meta: dict, rows: list[Row], notes: list[str]) -> None:
    with open(path, "w") as f:
        json.dump({"meta": meta, "notes": notes, "rows": [asdict(r) for r in rows]}, f, indent=1)
        f.write("\n")


def write_csv(path: str, meta: dict, rows: list[Row], notes: list[str]) -> None:
    with open(path, "w", newline="") as f:
        for key, value in meta.items():
            f.write(f"# {key}: {value}\n")
        for note in notes:
            f.write(f"# note: {note}\n")
        writer = csv.DictWriter(f, fieldnames=list(Row.__dataclass_fields__))
        writer.writeheader()
        for row in rows:
            writer.writerow(asdict(row))


def plot(runs: list[tuple[str, list[dict]]], path: str, title: str) -> None:
    """Draw latency and busbw against size (log-2 x axis), one line per algorithm and run.

    ``runs`` holds (label suffix, rows as dicts); the sweep script passes one run per rank count.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_lat, ax_bw) = plt.subplots(1, 2, figsize=(13, 5))
    colors: dict[str, str] = {}  # one colour per algorithm, one line style per run
    styles = ("-", "--", ":", "-.")
    for index, (suffix, rows) in enumerate(runs):
        for name in dict.fromkeys(r["algorithm"] for r in rows):
            color = colors.setdefault(name, f"C{len(colors) % 10}")
            mine = [r for r in rows if r["algorithm"] == name]
            sizes = [r["size"] for r in mine]
            style = {"color": color, "linestyle": styles[index % len(styles)], "marker": ".",
                     "label": f"{name}{suffix}"}
            ax_lat.plot(sizes, [r["avg_us"] for r in mine], **style)
            ax_bw.plot(sizes, [r["busbw_gbs"] for r in mine], **style)
    for ax, ylabel in ((ax_lat, "avg latency (µs)"), (ax_bw, "busbw (GB/s)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("message size per rank (B)")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="small")
    ax_lat.set_yscale("log")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- the command -----------------------------------------------------------------------------------

def run(comm, opts: Options, out=None, recorder=None) -> tuple[list[Row], list[str], bool]:
    """Measure every size and algorithm; print rows on rank 0 as each size finishes.

    ``recorder`` (--trace: a :class:`mpiallreduce.tracing.Recorder`) records the timed runs.

    Returns (rows, notes, all validations passed); rows and notes are complete on rank 0 only.
    """
    out = sys.stdout if out is None else out
    root = comm.rank == 0
    show = root and not opts.quiet
    topology = _topology(comm, opts.ranks_per_node)
    rows: list[Row] = []
    notes = list(opts.notes)
    refused: set[tuple[str, str]] = set()  # (algorithm, reason), noted once each
    all_ok = True
    busfactor = 2 * (comm.size - 1) / comm.size
    # untimed: every case once at the first size, so that no row pays for first calls (the
    # communicator's set-up, imports, caches: native measured 9.8 µs cold at 8 B, 6.4 warm)
    warm = _Case(comm, opts, opts.sizes[0])
    warm.iterations = warm.warmup = 1
    with contextlib.nullcontext() if recorder is None else recorder.paused():
        for algorithm, api, _ in opts.cases:
            warm.measure(algorithm, topology, api)
    for size in opts.sizes:
        case = _Case(comm, opts, size, recorder)
        # rounds[label] = [(avg, min, max, ok), ...]: every case once per round, interleaved
        rounds: dict[str, list[tuple[float, float, float, bool]]] = {}
        lines = []
        for _ in range(opts.repeat):
            for algorithm, api, label in opts.cases:
                result = case.measure(algorithm, topology, api)
                if isinstance(result, str):
                    if (label, result) not in refused:
                        refused.add((label, result))
                        notes.append(f"{label} skipped: {result}")
                        if show:
                            lines.append(f"# {label} skipped: {result}")
                    continue
                seconds, ok = result
                all_ok &= ok
                stats = _stats(comm, seconds)
                if stats is not None:
                    rounds.setdefault(label, []).append((*stats, ok))
        native = [avg for avg, *_ in rounds.get("native", [])]
        for label, measured in rounds.items():
            middle = sorted(measured)[(len(measured) - 1) // 2]  # the median round (lower one)
            avg, low, high = middle[:3]
            ok = all(round_ok for *_, round_ok in measured)
            ratios = [n / m for n, (m, *_) in zip(native, measured)] if native else []
            algbw = size / avg / 1e3  # B/µs -> GB/s
            row = Row(size, case.count, label, case.iterations, case.warmup, avg, low, high,
                      algbw, algbw * busfactor,
                      statistics.median(native) / avg if native else float("nan"),
                      ("ok" if ok else "FAIL") if opts.validate else "-", len(measured),
                      min(m[0] for m in measured), max(m[0] for m in measured),
                      min(ratios, default=float("nan")), max(ratios, default=float("nan")),
                      case.picked.get(label, ""))
            rows.append(row)
            if show or (root and not ok):
                lines.append(format_row(row, opts.width, opts.repeat > 1))
        if lines and root:
            print("\n".join(lines), file=out, flush=True)
    return rows, notes, all_ok


def main(argv=None, comm=None, out=None) -> int:
    """Run the benchmark; return the exit status (the same on every rank)."""
    comm = MPI.COMM_WORLD if comm is None else comm
    out = sys.stdout if out is None else out
    root = comm.rank == 0
    error = None
    try:
        opts = parse_args(argv, printing=root)
        if root:  # rank 0 alone writes files
            check_outputs(opts)
    except _HelpShown:
        return EXIT_OK
    except UsageError as exc:
        error = str(exc)
    # argv is the same everywhere, so ranks agree on it; the output check is rank 0's alone.
    # Sharing the verdicts makes every rank stop together, before any other collective.
    errors = comm.allgather(error)
    if any(errors):
        if root:
            first = next(e for e in errors if e)
            print(f"python -m mpiallreduce.bench: error: {first}\n"
                  f"(python -m mpiallreduce.bench -h lists the options and their defaults)",
                  file=sys.stderr, flush=True)
        return EXIT_USAGE
    if opts.ranks_per_node is not None:
        os.environ[RANKS_PER_NODE_ENV] = str(opts.ranks_per_node)
    meta = metadata(comm, opts)
    if root and not opts.quiet:
        lines = header_lines(meta, opts.width) + [f"# note: {note}" for note in opts.notes]
        print("\n".join(lines), file=out, flush=True)
    with mar.trace(opts.trace, comm) if opts.trace else contextlib.nullcontext() as recorder:
        rows, notes, all_ok = run(comm, opts, out, recorder)
    if root:
        if not opts.quiet:
            print("\n".join(summary_lines(rows, [label for _, _, label in opts.cases])),
                  file=out, flush=True)
        failed = [r for r in rows if r.check == "FAIL"]
        if failed:
            print(f"# validation FAILED: {', '.join(f'{r.algorithm} at {human(r.size)}' for r in failed)}",
                  file=out, flush=True)
        if opts.json:
            write_json(opts.json, meta, rows, notes)
        if opts.csv:
            write_csv(opts.csv, meta, rows, notes)
        if opts.plot:
            plot([("", [asdict(r) for r in rows])], opts.plot,
                 f"allreduce, {comm.size} ranks, {opts.dtype.name} {opts.op}")
        if opts.trace and not opts.quiet:
            print(f"# trace of the timed runs: {opts.trace} (Perfetto, chrome://tracing)",
                  file=out, flush=True)
    comm.Barrier()  # files are complete before any rank returns
    return EXIT_OK if all_ok else EXIT_FAIL


if __name__ == "__main__":
    status = main()
    if status:
        # Finalize first: under `python -m mpi4py`, a plain non-zero exit becomes MPI_Abort and
        # its banner; after Finalize every rank just exits with the status.
        MPI.Finalize()
    sys.exit(status)
