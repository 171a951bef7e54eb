"""Large-message check: an allreduce of more than 2**31 int8 elements (over 2 GiB) with every
algorithm offered, compared element by element with the known answer.

Run with ``make test-large`` (``mpirun -n 2 python -m mpi4py scripts/test_large.py``). Memory:
about 4.6 GiB per rank at peak (the 2 GiB in-place buffer, scratch of up to the whole vector for
tree and recursive doubling, MPI's own temporary for ``native``), so 10 GiB for the two ranks.
MPI-3 message counts are C ints and Open MPI 5.0 refuses larger ones, so this also proves the
executor's splitting into MAX_MESSAGE pieces.
"""

from __future__ import annotations

import argparse
import resource
import sys
import time

import numpy as np
from mpi4py import MPI

import mpiallreduce as mar

REGION = 1 << 24  # elements per region; each region has its own offset, so misplaced data shows


def _pattern(region: int, rank: int, nranks: int) -> np.ndarray:
    # values below 128 / nranks: the sum never overflows int8 (signed overflow is undefined in C)
    period = max(127 // nranks, 1)
    return ((np.arange(period) + region + rank) % period).astype(np.int8)


def fill(buf: np.ndarray, rank: int, nranks: int) -> None:
    """Write this rank's contribution: a small ramp, shifted by the region index and rank."""
    for region, start in enumerate(range(0, buf.size, REGION)):
        part = buf[start:start + REGION]
        part[:] = np.resize(_pattern(region, rank, nranks), part.size)


def first_wrong(buf: np.ndarray, nranks: int) -> int | None:
    """Return the first index whose value is not the int8 sum of every rank's contribution."""
    for region, start in enumerate(range(0, buf.size, REGION)):
        part = buf[start:start + REGION]
        want = sum(_pattern(region, rank, nranks) for rank in range(nranks))
        bad = np.flatnonzero(part != np.resize(want, part.size))
        if bad.size:
            return start + int(bad[0])
    return None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=(1 << 31) + (1 << 20) + 3,
                        help="int8 elements per rank (default: 2**31 + 2**20 + 3)")
    parser.add_argument("--algorithms", nargs="*", default=list(mar.ALGORITHMS))
    args = parser.parse_args(argv)
    comm = MPI.COMM_WORLD
    buf = np.empty(args.count, dtype=np.int8)
    failures = 0
    for algorithm in args.algorithms:
        fill(buf, comm.rank, comm.size)
        comm.Barrier()
        start = time.monotonic()
        mar.allreduce(MPI.IN_PLACE, buf, comm=comm, algorithm=algorithm)
        elapsed = comm.allreduce(time.monotonic() - start, op=MPI.MAX)
        wrong = comm.allgather(first_wrong(buf, comm.size))
        ok = all(w is None for w in wrong)
        failures += not ok
        if comm.rank == 0:
            detail = "" if ok else f" first wrong index per rank: {wrong}"
            print(f"{algorithm:>20}: {args.count} int8 ({args.count / 2**30:.2f} GiB) on "
                  f"{comm.size} ranks in {elapsed:.1f} s: {'pass' if ok else 'FAIL'}{detail}",
                  flush=True)
    peak = comm.allreduce(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, op=MPI.MAX)
    if comm.rank == 0:
        print(f"peak resident memory per rank: {peak / 2**20:.2f} GiB; "
              f"{'all passed' if not failures else f'{failures} failed'}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
