"""What reproducible sums cost: ``reproducible=True`` against the same call without, and
``mar.dot`` against ``comm.allreduce(np.dot(x, y))``, medians of interleaved runs.

    mpirun -n 2 python -m mpi4py scripts/reproducible_cost.py [--repeat 3] [--sizes 8 64K 8M]
        [--algorithm auto] [--dot 1M] [--convert] [--results NAME | --no-results]

Each row times both variants ``--repeat`` times, alternating (plain, reproducible, plain, ...);
a round times enough calls one by one to last about 0.2 s and keeps the median call (the
slowest rank's): on a shared machine a block mean is dominated by the few calls during which a
rank was descheduled. It prints the median over rounds of each, the median of the per-round
ratios with their spread (min-max), and the ratio of the fastest calls seen (``best``). Rank 0
prints. The arrays are float64, filled with values of mixed signs and magnitudes.
``--results NAME`` (default ``reproducible_cost``; ``--results ''`` or ``--no-results`` writes
none) writes ``docs/results/NAME.json`` (``scripts/_results.py``) on rank 0: the rows above, and
in its notes ``OPENBLAS_NUM_THREADS`` (run with it set to 1 for the documented figures).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time

import numpy as np
from mpi4py import MPI

import mpiallreduce as mar

TARGET_SECONDS = 0.2


def size_bytes(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def seconds_per_call(comm, call, calls: int) -> tuple[float, float]:
    """The slowest rank's median and fastest time of ``calls`` calls timed one by one."""
    comm.Barrier()
    times = []
    clock = time.perf_counter
    for _ in range(calls):
        start = clock()
        call()
        times.append(clock() - start)
    return (comm.allreduce(statistics.median(times), op=MPI.MAX),
            comm.allreduce(min(times), op=MPI.MAX))


def calibrate(comm, call) -> int:
    """How many calls last about TARGET_SECONDS (agreed: the slowest rank's count)."""
    call()
    once = seconds_per_call(comm, call, 3)[0]
    return comm.allreduce(max(5, min(20_000, int(TARGET_SECONDS / max(once, 1e-7)))), op=MPI.MAX)


def compare(comm, plain, other, repeat: int) -> tuple[float, float, list[float], float]:
    """Median seconds of ``plain`` and ``other``, the per-round ratios other / plain and the
    ratio of the fastest calls."""
    calls = calibrate(comm, plain)
    calls_other = calibrate(comm, other)
    times, other_times, ratios, fastest, other_fastest = [], [], [], [], []
    for _ in range(repeat):
        base, base_min = seconds_per_call(comm, plain, calls)
        cost, cost_min = seconds_per_call(comm, other, calls_other)
        times.append(base)
        other_times.append(cost)
        ratios.append(cost / base)
        fastest.append(base_min)
        other_fastest.append(cost_min)
    return (statistics.median(times), statistics.median(other_times), ratios,
            min(other_fastest) / min(fastest))


def row(label: str, base: float, cost: float, ratios: list[float], best: float) -> str:
    return (f"{label:<34} {base * 1e6:>11.1f} {cost * 1e6:>11.1f} "
            f"{statistics.median(ratios):>6.2f}x [{min(ratios):.2f}-{max(ratios):.2f}] "
            f"{best:>6.2f}x")


def mpirun_command(ranks: int) -> str:
    """The command that ran this script, as a reader would type it (the result's provenance)."""
    blas = os.environ.get("OPENBLAS_NUM_THREADS")
    prefix = f"OPENBLAS_NUM_THREADS={blas} " if blas else ""
    return prefix + f"mpirun -n {ranks} python -m mpi4py " + " ".join(sys.argv)


def write_results(args, comm, table: list[tuple[str, str, tuple]]) -> None:
    """Write the reader's table (rank 0): per call, both medians and the ratios."""
    from _results import write

    rows, values = [], {}
    for label, key, (base, cost, ratios, best) in table:
        rows.append([label, base * 1e6, cost * 1e6, statistics.median(ratios),
                     f"{min(ratios):.2f}-{max(ratios):.2f}", best])
        values[key] = round(statistics.median(ratios), 3)
    threads = os.environ.get("OPENBLAS_NUM_THREADS")
    notes = (f"float64, each call with reproducible=True (or mar.dot, mar.sum) over the same call "
             f"without (or comm.allreduce of np.dot, np.sum), medians of {args.repeat} "
             f"interleaved runs of the median call; "
             + (f"OPENBLAS_NUM_THREADS={threads}" if threads else "BLAS at its default threads")
             + ("; Numba (the fast extra) installed" if importlib.util.find_spec("numba")
                else "; no Numba")
             + ("; converted at every rank count (--convert)" if args.convert else "") + ".")
    path = write(args.results, "What reproducible sums cost",
                 columns=["call", "without (us)", "with (us)", "ratio", "spread", "best"],
                 rows=rows, formats=["{}", "{:.1f}", "{:.1f}", "{:.2f}", "{}", "{:.2f}"],
                 ranks=comm.size, values=values, notes=notes,
                 command=mpirun_command(comm.size))
    print(f"# wrote docs/results/{path.name}", flush=True)


def _key(text: str) -> str:
    return text.upper() if text[-1].isalpha() else f"{text}B"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--sizes", nargs="+", default=["8", "64K", "8M"])
    parser.add_argument("--algorithm", default="auto")
    parser.add_argument("--dot", default="1M", help="local elements of each vector for mar.dot")
    parser.add_argument("--convert", action="store_true",
                        help="convert to words at 1 or 2 ranks too (reproducible.PAIR_RANKS = 0),"
                             " to measure the conversion where the plain SUM is already "
                             "reproducible")
    parser.add_argument("--results", default="reproducible_cost", metavar="NAME",
                        help="write docs/results/NAME.json ('' for none; "
                             "default: reproducible_cost)")
    parser.add_argument("--no-results", dest="results", action="store_const", const="",
                        help="write no result file")
    args = parser.parse_args(argv)
    if args.convert:
        mar.reproducible.elementwise.PAIR_RANKS = 0
    comm = MPI.COMM_WORLD
    rng = np.random.default_rng(comm.rank)
    lines = [f"# {comm.size} ranks, float64, medians of {args.repeat} interleaved runs "
             f"(microseconds, median call; ratio median [min-max]; best: fastest calls)"
             + (" (converted at every rank count: --convert)" if args.convert else ""),
             f"# {'call':<32} {'without':>11} {'with':>11}  ratio [spread]   best"]
    table = []  # (the reader's row label, value name, compare's result)
    for text in args.sizes:
        count = max(1, size_bytes(text) // 8)
        x = rng.standard_normal(count) * np.exp2(rng.integers(-30, 30, count))
        out = np.empty_like(x)
        result = compare(
            comm, lambda x=x, out=out: mar.allreduce(x, out, algorithm=args.algorithm),
            lambda x=x, out=out: mar.allreduce(x, out, algorithm=args.algorithm,
                                               reproducible=True), args.repeat)
        lines.append(row(f"allreduce {text} B ({args.algorithm})", *result))
        table.append((f"`allreduce` {text} B ({args.algorithm})", f"allreduce_{_key(text)}",
                      result))
    count = size_bytes(args.dot)
    x, y = rng.standard_normal(count), rng.standard_normal(count)
    result = compare(comm, lambda: comm.allreduce(np.dot(x, y)),
                     lambda: mar.dot(x, y, comm=comm), args.repeat)
    lines.append(row(f"dot of {args.dot} elements (vs np.dot)", *result))
    table.append((f"`mar.dot` of {args.dot} elements (vs `np.dot`)", "dot", result))
    result = compare(comm, lambda: comm.allreduce(np.sum(x)), lambda: mar.sum(x, comm=comm),
                     args.repeat)
    lines.append(row(f"sum of {args.dot} elements (vs np.sum)", *result))
    table.append((f"`mar.sum` of {args.dot} elements (vs `np.sum`)", "sum", result))
    if comm.rank == 0:
        print("\n".join(lines))
        if args.results:
            write_results(args, comm, table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
