"""What tracing costs per run: a traced plan against an untraced one, in the same job.

    mpirun -n 2 python -m mpi4py scripts/trace_cost.py [--sizes 8 64K 1M] [--rounds 21]
        [--runs 200] [--algorithms recursive_doubling,ring,rabenseifner]

For every algorithm and size, builds the same plan twice, once before and once inside
``mar.trace(...)``, and times ``runs`` calls of each in alternating batches (``rounds`` of
them, a barrier before each batch), so load on a shared machine hits both alike. Prints, per
row, the median over rounds of the traced batch's mean time per run over the untraced one's,
its spread, and the median difference in µs per run; the clock readings a traced run makes
(two per run, one per phase) are counted from the trace written. Rank 0 prints.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

import numpy as np
from mpi4py import MPI

import mpiallreduce as mar
from mpiallreduce.sizes import UsageError, human, parse_sizes


def _batch(plan, runs: int, comm) -> float:
    comm.Barrier()
    start = MPI.Wtime()
    for _ in range(runs):
        plan.run()
    return comm.allreduce((MPI.Wtime() - start) / runs) / comm.size  # mean over ranks


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["8", "64K", "1M"])
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--algorithms", default="recursive_doubling,ring,rabenseifner")
    args = parser.parse_args(argv)
    comm = MPI.COMM_WORLD
    try:
        sizes = [s for text in args.sizes for s in parse_sizes(text)]
    except UsageError as error:
        parser.error(str(error))
    root = comm.rank == 0
    folder = comm.bcast(tempfile.mkdtemp(prefix="trace-cost-") if root else None)
    path = os.path.join(folder, "trace.json")
    if root:
        print(f"# traced / untraced time per run, median [min-max] of {args.rounds} alternating "
              f"batches of {args.runs} runs; {comm.size} ranks; {MPI.Get_library_version()[:20]}")
        print(f"# {'size':>6} {'algorithm':<20} {'ratio':>6} {'spread':>13} {'untraced us':>12} "
              f"{'traced - untraced us':>21} {'stamps/run':>10}")
    for size in sizes:
        x = np.ones(max(size // 4, 1), dtype=np.float32)
        for name in args.algorithms.split(","):
            out = np.empty_like(x)
            plain = mar.plan(x, out, comm=comm, algorithm=name)
            with mar.trace(path, comm=comm):
                traced = mar.plan(x, out, comm=comm, algorithm=name)
                ratios, diffs, bases = [], [], []
                for _ in range(args.rounds):
                    base = _batch(plain, args.runs, comm)
                    with_trace = _batch(traced, args.runs, comm)
                    ratios.append(with_trace / base)
                    diffs.append((with_trace - base) * 1e6)
                    bases.append(base * 1e6)
            stamps = None
            if root:
                with open(path, encoding="utf-8") as handle:
                    events = json.load(handle)["traceEvents"]
                runs = sum(1 for e in events if e["ph"] == "X" and e["tid"] == 0
                           and "algorithm" in e.get("args", {}))
                phases = sum(1 for e in events if e["ph"] == "X" and e["tid"] == 0
                             and e["name"] in ("load", "copy", "start", "wait", "combine", "finish"))
                stamps = (phases + 2 * runs) / max(runs, 1)
                print(f"  {human(size):>6} {name:<20} {statistics.median(ratios):>6.2f} "
                      f"[{min(ratios):.2f}-{max(ratios):.2f}] {statistics.median(bases):>12.2f} "
                      f"{statistics.median(diffs):>+21.2f} {stamps:>10.1f}", flush=True)
            plain.free()
            traced.free()
    comm.Barrier()
    if root:
        os.remove(path)
        os.rmdir(folder)
    return 0


if __name__ == "__main__":
    sys.exit(main())
