"""What reproducible sums cost: ``reproducible=True`` against the same call without, and
``mar.dot`` against ``comm.allreduce(np.dot(x, y))``, medians of interleaved runs.

    mpirun -n 2 python -m mpi4py scripts/reproducible_cost.py [--repeat 3] [--sizes 8 64K 8M]
        [--algorithm auto] [--dot 1M]

Each row times both variants ``--repeat`` times, alternating (plain, reproducible, plain, ...),
each timing the mean over enough calls to last about 0.2 s (the slowest rank's), and prints the
median time of each and the median of the per-round ratios, with their spread (min-max). Rank 0
prints. The arrays are float64, filled with values of mixed signs and magnitudes.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from mpi4py import MPI

import mpiallreduce as mar

TARGET_SECONDS = 0.2


def size_bytes(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def seconds_per_call(comm, call, calls: int) -> float:
    """The slowest rank's mean time of ``calls`` calls."""
    comm.Barrier()
    start = time.perf_counter()
    for _ in range(calls):
        call()
    return comm.allreduce((time.perf_counter() - start) / calls, op=MPI.MAX)


def calibrate(comm, call) -> int:
    """How many calls last about TARGET_SECONDS (agreed: the slowest rank's count)."""
    call()
    once = seconds_per_call(comm, call, 1)
    return comm.allreduce(max(1, min(20_000, int(TARGET_SECONDS / max(once, 1e-7)))), op=MPI.MAX)


def compare(comm, plain, other, repeat: int) -> tuple[float, float, list[float]]:
    """Median seconds of ``plain`` and ``other``, and the per-round ratios other / plain."""
    calls = calibrate(comm, plain)
    calls_other = calibrate(comm, other)
    times, other_times, ratios = [], [], []
    for _ in range(repeat):
        base = seconds_per_call(comm, plain, calls)
        cost = seconds_per_call(comm, other, calls_other)
        times.append(base)
        other_times.append(cost)
        ratios.append(cost / base)
    return statistics.median(times), statistics.median(other_times), ratios


def row(label: str, base: float, cost: float, ratios: list[float]) -> str:
    return (f"{label:<34} {base * 1e6:>11.1f} {cost * 1e6:>11.1f} "
            f"{statistics.median(ratios):>6.2f}x [{min(ratios):.2f}-{max(ratios):.2f}]")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--sizes", nargs="+", default=["8", "64K", "8M"])
    parser.add_argument("--algorithm", default="auto")
    parser.add_argument("--dot", default="1M", help="local elements of each vector for mar.dot")
    args = parser.parse_args(argv)
    comm = MPI.COMM_WORLD
    rng = np.random.default_rng(comm.rank)
    lines = [f"# {comm.size} ranks, float64, medians of {args.repeat} interleaved runs "
             f"(microseconds; ratio median [min-max])",
             f"# {'call':<32} {'without':>11} {'with':>11}  ratio"]
    for text in args.sizes:
        count = max(1, size_bytes(text) // 8)
        x = rng.standard_normal(count) * np.exp2(rng.integers(-30, 30, count))
        out = np.empty_like(x)
        base, cost, ratios = compare(
            comm, lambda x=x, out=out: mar.allreduce(x, out, algorithm=args.algorithm),
            lambda x=x, out=out: mar.allreduce(x, out, algorithm=args.algorithm,
                                               reproducible=True), args.repeat)
        lines.append(row(f"allreduce {text} B ({args.algorithm})", base, cost, ratios))
    count = size_bytes(args.dot)
    x, y = rng.standard_normal(count), rng.standard_normal(count)
    base, cost, ratios = compare(comm, lambda: comm.allreduce(np.dot(x, y)),
                                 lambda: mar.dot(x, y, comm=comm), args.repeat)
    lines.append(row(f"dot of {args.dot} elements (vs np.dot)", base, cost, ratios))
    base, cost, ratios = compare(comm, lambda: comm.allreduce(np.sum(x)),
                                 lambda: mar.sum(x, comm=comm), args.repeat)
    lines.append(row(f"sum of {args.dot} elements (vs np.sum)", base, cost, ratios))
    if comm.rank == 0:
        print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
