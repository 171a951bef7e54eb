"""What the first call on a new count costs through ``mar.Comm`` against ``comm.Allreduce``.

    mpirun -n 2 python -m mpi4py scripts/new_size_cost.py [--calls 300] [--repeats 200]
        [--profile 0] [--no-write]

A test suite (Heat's) calls ``Allreduce`` on many counts once each: what it pays is the first
call of each case, not a repeated one. Each row times single calls, ``mar.Comm(COMM_WORLD)``'s
``Allreduce(x, out, op=MPI.SUM)`` (algorithm ``auto``, one communicator object for the whole
run, as a program keeps one) and plain ``COMM_WORLD.Allreduce(x, out, op=MPI.SUM)``,
interleaved call by call (which goes first alternates), each call between barriers:

- ``new count``: call k reduces count k (1..``--calls``), a count this communicator has never
  seen in that dtype, on fresh arrays; float64 and complex128, then float64 counts of 8-64 KiB,
  then int32 through ``mar.Comm(COMM_WORLD, check=False)`` (the check's share);
- ``second call of a count``: the same in float32, each count called once untimed first (the
  call that binds ``mar.Comm``'s plan, where a count repeats);
- ``repeated count``: the control, ``--repeats`` calls of 8 float64 elements on the same arrays
  (a solver's loop), and on fresh arrays each call (``np.array([dot])``).

A call's time is the slowest rank's (per-call times gathered at the end). Prints per row the
medians in us and mar.Comm over plain (the ratio of the medians); rank 0 writes
``docs/results/new_size_cost.json`` (``--no-write``: not). ``--profile N`` runs N more new
counts under cProfile on rank 0 and prints where the first-call path spends its time.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time

import numpy as np
from mpi4py import MPI

import mpiallreduce as mar
from mpiallreduce import _form

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _results import library_name, write  # noqa: E402

#: untimed calls first, in a dtype no row uses (int64): the communicator's state, duplicates
#: and shm window are made once per communicator, not per count, and a test suite pays them once
WARMUP = 20


def _fresh(count: int, dtype, rank: int) -> tuple[np.ndarray, np.ndarray]:
    x = np.arange(count, dtype=dtype) + rank
    if np.dtype(dtype).kind == "c":
        x = x + 1j * rank
    return x, np.empty_like(x)


def _timed(comm, allreduce, x, out) -> float:
    comm.Barrier()
    start = time.perf_counter()
    allreduce(x, out, op=MPI.SUM)
    return time.perf_counter() - start


def _slowest(comm, seconds: list[float]) -> np.ndarray:
    times = np.array(seconds)
    comm.Allreduce(MPI.IN_PLACE, times, MPI.MAX)
    return times * 1e6


def measure(comm, wrapped, counts, dtype, reuse: bool, earlier: int = 0) -> dict:
    """Time ``wrapped.Allreduce`` and ``comm.Allreduce`` call by call on ``counts``, each call
    after ``earlier`` untimed calls of its count (fresh arrays)."""
    rank = comm.Get_rank()
    mine, plain = [], []
    kept = _fresh(counts[0], dtype, rank) if reuse else None
    for index, count in enumerate(counts):
        ways = [("mar", wrapped.Allreduce), ("plain", comm.Allreduce)]
        if index % 2:
            ways.reverse()
        for name, allreduce in ways:
            for _ in range(earlier):
                allreduce(*_fresh(count, dtype, rank), op=MPI.SUM)
            x, out = kept if reuse else _fresh(count, dtype, rank)
            seconds = _timed(comm, allreduce, x, out)
            (mine if name == "mar" else plain).append(seconds)
            expected = np.empty_like(x)
            comm.Allreduce(x, expected, op=MPI.SUM)
            if not np.array_equal(out, expected) and not np.allclose(out, expected):
                raise AssertionError(f"rank {rank}: {name} count {count} {dtype}: wrong result")
    mar_us, plain_us = _slowest(comm, mine), _slowest(comm, plain)
    return {"mar": float(np.median(mar_us)), "plain": float(np.median(plain_us)),
            "ratio": float(np.median(mar_us) / np.median(plain_us)), "calls": len(counts)}


def profile(comm, wrapped, calls: int) -> str:
    """cProfile of ``calls`` first calls on new counts (rank 0's view)."""
    profiler = cProfile.Profile()
    rank = comm.Get_rank()
    for count in range(1, calls + 1):  # complex64: a dtype no row uses, so every count is new
        x, out = _fresh(count, "complex64", rank)
        comm.Barrier()
        profiler.enable()
        wrapped.Allreduce(x, out, op=MPI.SUM)
        profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(35)
    return text.getvalue()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=300, help="new counts per row")
    parser.add_argument("--repeats", type=int, default=200, help="calls of the control rows")
    parser.add_argument("--profile", type=int, default=0, help="profiled new counts (rank 0)")
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args(argv)
    comm = MPI.COMM_WORLD
    root = comm.Get_rank() == 0
    wrapped = mar.Comm(comm)
    # the same without the argument check: what the check itself costs a first call (an
    # exchange between the ranks, on this machine more than an 8-byte Allreduce)
    unchecked = mar.Comm(comm, check=False)
    for count in range(1, WARMUP + 1):
        x, out = _fresh(count, "int64", comm.Get_rank())
        wrapped.Allreduce(x, out, op=MPI.SUM)
        comm.Allreduce(x, out, op=MPI.SUM)
    n = args.calls
    rows = [  # (case, dtype, counts as printed, counts, same arrays, untimed calls first,
        #        the mar.Comm)
        ("new count", "float64", f"1..{n}", list(range(1, n + 1)), False, 0, wrapped),
        ("new count", "complex128", f"1..{n}", list(range(1, n + 1)), False, 0, wrapped),
        ("new count", "float64", "8-64 KiB", [1024 + 7 * k for k in range(n)], False, 0,
         wrapped),
        ("new count, check=False", "int32", f"1..{n}", list(range(1, n + 1)), False, 0,
         unchecked),
        ("second call of a count", "float32", f"1..{n}", list(range(1, n + 1)), False, 1,
         wrapped),
        ("repeated count, same arrays", "float64", "8", [8] * args.repeats, True, 0, wrapped),
        ("repeated count, fresh arrays", "float64", "8", [8] * args.repeats, False, 0, wrapped),
    ]
    library = library_name(MPI.Get_library_version())
    if root:
        print(f"# first calls on new counts: mar.Comm(COMM_WORLD).Allreduce against "
              f"COMM_WORLD.Allreduce, medians of single calls (slowest rank), interleaved; "
              f"{comm.Get_size()} ranks; {library}; {_form.describe()}")
        print(f"# {'case':<29} {'dtype':<10} {'counts':<9} {'mar.Comm us':>11} "
              f"{'plain us':>9} {'ratio':>6} {'calls':>6}", flush=True)
    results = []
    for case, dtype, label, counts, reuse, earlier, through in rows:
        row = measure(comm, through, counts, dtype, reuse, earlier)
        results.append((case, dtype, label, row))
        if root:
            print(f"  {case:<29} {dtype:<10} {label:<9} {row['mar']:>11.1f} {row['plain']:>9.1f} "
                  f"{row['ratio']:>6.2f} {row['calls']:>6}", flush=True)
    if args.profile:
        text = profile(comm, wrapped, args.profile)
        if root:
            print(text)
    comm.Barrier()
    if root and not args.no_write:
        first, unchecked_row = results[0][3], results[3][3]
        written = write(
            "new_size_cost", "The first call on a new count: mar.Comm against comm.Allreduce",
            columns=["case", "dtype", "counts", "mar.Comm us", "comm.Allreduce us",
                     "mar.Comm / comm.Allreduce", "calls"],
            rows=[[case, dtype, label, round(r["mar"], 2), round(r["plain"], 2),
                   round(r["ratio"], 3), r["calls"]] for case, dtype, label, r in results],
            formats=["{}", "{}", "{}", "{:.1f}", "{:.1f}", "{:.2f}", "{}"],
            ranks=comm.Get_size(),
            values={"ratio": f"{first['ratio']:.1f}", "mar_us": f"{first['mar']:.0f}",
                    "plain_us": f"{first['plain']:.0f}",
                    "unchecked_ratio": f"{unchecked_row['ratio']:.1f}"},
            command=("mpirun -n {} python -m mpi4py scripts/new_size_cost.py {}".format(
                comm.Get_size(), " ".join(sys.argv[1:])).strip()),
            notes=("Single calls between barriers, mar.Comm(COMM_WORLD) (auto) and plain "
                   "COMM_WORLD.Allreduce interleaved call by call (which goes first alternates); "
                   "a call's time is the slowest rank's; medians over the calls, the ratio of "
                   "the medians. New count: every call a count this communicator has not seen "
                   f"in that dtype, fresh arrays; {WARMUP} untimed calls on other counts first "
                   "(the communicator's set-up is paid once). Second call: each count called "
                   "once untimed first. Repeated count: the control"))
        print(f"# wrote {written}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
