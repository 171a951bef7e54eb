"""The bench's command line: its options, their defaults and checks, and the cases they select.

:func:`parse_args` raises :class:`~mpiallreduce.sizes.UsageError` (or :class:`HelpShown`) with
the same outcome on every rank for the same argv; nothing here communicates.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
from dataclasses import dataclass

import numpy as np
from mpi4py import MPI

import mpiallreduce as mar

from ..decide import MIN_ROUNDS
from ..ops import AVG, DTYPES, OP_NAMES, reducer
from ..sizes import UsageError, human, parse_sizes
from ..topology import RANKS_PER_NODE_ENV

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2
DEFAULT_SIZES = "8:16M"
#: default iteration rule: MAX_ITERATIONS up to BUDGET_BYTES / MAX_ITERATIONS bytes, then fewer
#: (about BUDGET_BYTES moved per rank and size), never under MIN_ITERATIONS.
MAX_ITERATIONS, MIN_ITERATIONS, BUDGET_BYTES = 1000, 20, 64 * 2**20
#: the rule in words (the help text and the metadata).
ITERATION_RULE = (f"min({MAX_ITERATIONS}, {BUDGET_BYTES // 2**20}M/size), "
                  f"at least {MIN_ITERATIONS}")
#: the fewest rounds (--repeat) that can back a recommendation: the decision's noise is the
#: spread of a code's rounds, which fewer rounds do not measure (:data:`mpiallreduce.decide.MIN_ROUNDS`).
RECOMMEND_ROUNDS = MIN_ROUNDS


class HelpShown(Exception):
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
        raise HelpShown

    def _print_message(self, message, file=None):
        if self.printing:
            super()._print_message(message, file)


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
#: the label of Gloo's all-reduce (``torch.distributed.all_reduce`` on the array's tensor), the
#: reference column with ``--against gloo``.
GLOO = "gloo"
#: what ``--against`` may name: the row every ratio is taken against.
REFERENCES = ("native", GLOO)


def parse_apis(text: str) -> list[str]:
    """Parse ``--api``: a comma list of :data:`APIS`."""
    apis = [a.strip() for a in text.split(",") if a.strip()]
    unknown = [a for a in apis if a not in APIS]
    if unknown or not apis:
        raise UsageError(f"--api {text!r}: choose a comma list of {', '.join(APIS)}")
    return list(dict.fromkeys(apis))


#: bench names for an algorithm with parameters: hierarchical and cascade with either
#: intra-node phase (the plain names run what ``intra="auto"`` picks). Named explicitly
#: only, never by ``all``.
VARIANTS = {f"{name}-{intra}": (name, {"intra": intra})
            for name in ("hierarchical", "cascade") for intra in ("shm", "p2p")}


def algorithm_call(name: str) -> tuple[str, dict]:
    """The algorithm and parameters a bench name runs (:data:`VARIANTS`)."""
    return VARIANTS.get(name, (name, {}))


def named_algorithms(text: str) -> tuple[str, ...]:
    """Return the names of an ``--algorithms`` list given one by one (not through ``all``):
    on one node only these of the multi-node algorithms are weighed by the advice."""
    return tuple(dict.fromkeys(part.strip() for part in text.split(",")
                               if part.strip() and part.strip() != "all"))


def parse_algorithms(text: str) -> list[str]:
    """Return the algorithm names of a comma list; ``all`` means every one, ``auto`` included
    (:data:`VARIANTS` only where named)."""
    names: list[str] = []
    for item in (part.strip() for part in text.split(",")):
        expanded = list(mar.ALGORITHMS) if item == "all" else [item]
        for name in expanded:
            if name not in mar.ALGORITHMS and name not in VARIANTS:
                raise UsageError(f"unknown algorithm {name!r} in --algorithms; choose from "
                                 f"{', '.join((*mar.ALGORITHMS, *VARIANTS))} or all")
            if name not in names:
                names.append(name)
    # native is the reference of every ratio: always run it, and first.
    return ["native"] + [name for name in names if name != "native"]


def op_of(name: str):
    """Return the op named on the command line (one of ``ops.OP_NAMES``)."""
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
                             f"runs, as the reference; {', '.join(VARIANTS)} run those with "
                             f"intra='shm' or 'p2p' (the intra-node phase; not in all) "
                             f"(default: all)")
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
                        help=f"timed runs per size and algorithm (default: {ITERATION_RULE})")
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
                             "rows show the median and the spread across rounds; from "
                             f"{RECOMMEND_ROUNDS} rounds the closing advice recommends another "
                             "algorithm than auto where its median beat auto's by more than "
                             "the spread of either one's rounds (default: 1)")
    parser.add_argument("--against", default="native", choices=REFERENCES,
                        help="the reference column: native (MPI's own Allreduce, as a plan) or "
                             "gloo (torch.distributed.all_reduce with Gloo on a torch tensor "
                             "sharing the array's memory, set up by mar.torch.init_process_group; "
                             "Gloo reduces in place, so out of place the input is copied into "
                             "the result first, as a torch user would; needs the torch extra); "
                             "native still runs (default: native)")
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
    against: str = "native"
    #: the algorithms named one by one in --algorithms (not through ``all``)
    named: tuple[str, ...] = ()

    @property
    def width(self) -> int:
        """Width of the algorithm column."""
        return max(9, *(len(label) for _, _, label in self.cases))

    @property
    def cases(self) -> list[tuple[str, str, str]]:
        """(algorithm, api, row label) in the order measured: the native plan, comm.Allreduce if
        a call mode is timed, then every algorithm in every mode."""
        cases = [("native", "plan", "native")]  # the reference of vs_native, always first
        if self.against == GLOO:  # the reference, first, native after it
            cases.insert(0, (GLOO, GLOO, GLOO))
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
    """Parse and check a command line; raise UsageError (or HelpShown) with the same outcome on
    every rank for the same argv."""
    args = build_parser(printing).parse_args(argv)
    notes = []
    dtype = np.dtype(args.dtype)
    try:
        reducer(op_of(args.op), dtype)
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
    if args.against == GLOO and importlib.util.find_spec("torch") is None:
        raise UsageError("--against gloo needs torch: pip install 'mpiallreduce[torch]'")
    return Options(parse_algorithms(args.algorithms), parse_apis(args.api), args.repeat, sizes,
                   dtype, args.op,
                   args.iterations, args.warmup, args.in_place, args.validate, args.json, args.csv, args.plot,
                   ranks_per_node, args.quiet, notes, args.trace, args.against,
                   named_algorithms(args.algorithms))
