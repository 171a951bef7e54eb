"""What tracing costs a latency-bound loop: traced against untraced, in the same job.

    mpirun -n 2 python -m mpi4py scripts/trace_cost.py [--rounds 31] [--iterations 200]
        [--algorithms auto,native,recursive_doubling] [--ways mar.Comm,mar.allreduce]
        [--no-write]

The loop is a solver's communication (a Jacobi iteration's): per iteration an 8-byte allreduce
of a fresh NumPy array (a new one each iteration, as ``np.array([local_residual])`` makes) and a
1 KiB ``comm.Sendrecv`` with the neighbours. Each row calls the allreduce one way
(``mar.Comm(COMM_WORLD, algorithm=...).Allreduce`` or ``mar.allreduce``) and times ``iterations``
iterations untraced, then as many inside ``mar.trace(...)``, alternating for ``rounds`` rounds
(a barrier before each batch, and untimed warm-up iterations first: a trace starting or ending
drops the cached calls), so that load on a shared machine hits both alike. A batch's time per
iteration is the slowest rank's mean. Short batches and many rounds keep the medians steady
where ranks share their cores with other jobs: a batch that a stall hits runs many times
slower, traced or not, and Open MPI's own Allreduce at two oversubscribed ranks settles for a
whole batch into one of two speeds, several times apart, traced or not.

Prints per row the medians over rounds of the untraced and traced time per iteration, traced
over untraced (the median of the rounds' ratios, and their range), and the runs the last trace
holds per call on rank 0 (one: every call recorded, and once). Rank 0 writes
``docs/results/trace_cost.json`` (``--no-write``: not), its ``values`` the first row's figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np
from mpi4py import MPI

import mpiallreduce as mar

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _results import library_name, write  # noqa: E402

#: untimed iterations at the start of every batch (the calls bind again after a switch)
WARMUP = 20
#: the neighbour exchange's bytes
HALO_BYTES = 1024


def _loop(allreduce, comm, iterations: int) -> float:
    """Run the loop; return the slowest rank's mean seconds per iteration."""
    rank, size = comm.Get_rank(), comm.Get_size()
    right, left = (rank + 1) % size, (rank - 1) % size
    halo = np.full(HALO_BYTES, rank, dtype=np.uint8)
    ghost = np.empty_like(halo)
    comm.Barrier()
    start = time.perf_counter()
    for step in range(iterations):
        residual = np.array([float(step + rank)])  # fresh arrays, every iteration
        total = np.empty(1)
        allreduce(residual, total)
        comm.Sendrecv(halo, right, 0, ghost, left, 0)
    return comm.allreduce((time.perf_counter() - start) / iterations, op=MPI.MAX)


def _entry(way: str, algorithm: str, comm):
    """``allreduce(x, out)`` the way a row calls it."""
    if way == "mar.Comm":
        return mar.Comm(comm, algorithm=algorithm).Allreduce
    return lambda x, out: mar.allreduce(x, out, comm=comm, algorithm=algorithm)


def _runs_per_call(path: str, calls: int) -> float:
    """Run events on rank 0's track of the trace at ``path``, per call made while it was on."""
    with open(path, encoding="utf-8") as handle:
        events = json.load(handle)["traceEvents"]
    runs = [e for e in events if e.get("ph") == "X" and e["tid"] == 0
            and "algorithm" in e.get("args", {})]
    return len(runs) / calls


def measure(way: str, algorithm: str, comm, rounds: int, iterations: int, path: str) -> dict:
    """One row: medians over ``rounds`` alternating batches, untraced and traced."""
    allreduce = _entry(way, algorithm, comm)
    untraced, traced, ratios = [], [], []
    for _ in range(rounds):
        _loop(allreduce, comm, WARMUP)
        plain = _loop(allreduce, comm, iterations)
        with mar.trace(path, comm=comm):
            _loop(allreduce, comm, WARMUP)
            with_trace = _loop(allreduce, comm, iterations)
        untraced.append(plain * 1e6)
        traced.append(with_trace * 1e6)
        ratios.append(with_trace / plain)
    runs = _runs_per_call(path, WARMUP + iterations) if comm.Get_rank() == 0 else None
    return {"untraced": statistics.median(untraced), "traced": statistics.median(traced),
            "ratio": statistics.median(ratios), "low": min(ratios), "high": max(ratios),
            "runs": runs}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=31)
    parser.add_argument("--iterations", type=int, default=200)
    parser.add_argument("--algorithms", default="auto,native,recursive_doubling")
    parser.add_argument("--ways", default="mar.Comm,mar.allreduce")
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args(argv)
    comm = MPI.COMM_WORLD
    root = comm.Get_rank() == 0
    folder = comm.bcast(tempfile.mkdtemp(prefix="trace-cost-") if root else None)
    path = os.path.join(folder, "trace.json")
    library = library_name(MPI.Get_library_version())
    if root:
        print(f"# a loop of an 8-byte allreduce of fresh arrays and a {HALO_BYTES} B Sendrecv: "
              f"us per iteration, medians of {args.rounds} alternating rounds of "
              f"{args.iterations}; {comm.Get_size()} ranks; {library}")
        print(f"# {'call':<14} {'algorithm':<19} {'untraced':>9} {'traced':>9} {'ratio':>6} "
              f"{'range':>11} {'runs/call':>9}", flush=True)
    rows = []
    for way in args.ways.split(","):
        for algorithm in args.algorithms.split(","):
            row = measure(way, algorithm, comm, args.rounds, args.iterations, path)
            rows.append((way, algorithm, row))
            if root:
                print(f"  {way:<14} {algorithm:<19} {row['untraced']:>9.1f} "
                      f"{row['traced']:>9.1f} {row['ratio']:>6.2f} "
                      f"{row['low']:>5.2f}-{row['high']:<5.2f} {row['runs']:>9.2f}", flush=True)
    comm.Barrier()
    if root:
        os.remove(path)
        os.rmdir(folder)
        if not args.no_write:
            way, algorithm, first = rows[0]
            written = write(
                "trace_cost", "What tracing costs a loop of 8-byte allreduces of fresh arrays",
                columns=["call", "algorithm", "untraced us", "traced us", "traced / untraced",
                         "lowest", "highest", "runs per call"],
                rows=[[w, a, round(r["untraced"], 2), round(r["traced"], 2),
                       round(r["ratio"], 3), round(r["low"], 3), round(r["high"], 3),
                       round(r["runs"], 3)] for w, a, r in rows],
                formats=["{}", "{}", "{:.1f}", "{:.1f}", "{:.2f}", "{:.2f}", "{:.2f}", "{:.2f}"],
                ranks=comm.Get_size(),
                values={"ratio": f"{first['ratio']:.1f}", "traced_us": f"{first['traced']:.1f}",
                        "untraced_us": f"{first['untraced']:.1f}",
                        "call": f"{way}(algorithm={algorithm!r}).Allreduce"
                        if way == "mar.Comm" else f"{way}(algorithm={algorithm!r})"},
                notes=(f"per iteration: an 8-byte allreduce of a fresh array and a "
                       f"{HALO_BYTES} B Sendrecv with the neighbours; medians over "
                       f"{args.rounds} rounds of {args.iterations} iterations untraced, then "
                       f"as many inside mar.trace(...) ({WARMUP} untimed first in each); a "
                       f"round's time is the slowest rank's mean; the ratio is the median of "
                       f"the rounds' traced / untraced, lowest and highest their range; runs "
                       f"per call: run events on rank 0's track of the last trace over its "
                       f"calls. Open MPI's own Allreduce (native) at two oversubscribed ranks "
                       f"runs a whole batch at one of two speeds several times apart, traced or "
                       f"not: its rows' ranges are wide"))
            print(f"# wrote {written}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
