"""How much of an allreduce iallreduce hides behind NumPy computation.

    mpirun -n 2 python -m mpi4py scripts/overlap.py [--mib 16] [--algorithms ring,native]
        [--results NAME | --no-results]

For each algorithm: time a large allreduce alone (T_comm), a NumPy computation sized to take
about as long alone (T_comp: ``np.sin`` over a private array, single-threaded, GIL released),
and both together (T_both: ``start(plan)``, compute, ``wait``; and again with a one-shot
``iallreduce``, which binds a plan per call). The fraction hidden is
``(T_comm + T_comp - T_both) / min(T_comm, T_comp)``: 1 when the shorter one disappears
entirely behind the other, 0 when they run one after the other, negative when running them
together costs more than in sequence. Medians of ``--repeats`` runs (max over ranks each), on
rank 0. The progress thread needs a core of its own to hide anything: with more ranks and
threads than cores, expect little.
``--results NAME`` (default ``overlap``; ``--results ''`` or ``--no-results`` writes none)
writes ``docs/results/NAME.json`` (``scripts/_results.py``) on rank 0: the table above.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np
from mpi4py import MPI

import mpiallreduce as mar


def timed(comm, fn) -> float:
    comm.Barrier()
    t0 = time.perf_counter()
    fn()
    return comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)


def measure(comm, x, out, algorithm, work, scratch, repeats) -> dict:
    """Time one algorithm alone, the matched computation alone, and both (see module doc)."""
    median = lambda fn: statistics.median(timed(comm, fn) for _ in range(repeats))
    with mar.plan(x, out, comm=comm, algorithm=algorithm) as plan:
        plan.run()  # warm
        t_comm = median(plan.run)
        t_one = median(lambda: np.sin(work, out=scratch))
        reps = max(1, round(comm.bcast(t_comm / t_one)))

        def compute():
            for _ in range(reps):
                np.sin(work, out=scratch)

        def both():
            request = mar.start(plan)
            compute()
            request.wait()

        def both_one_shot():  # iallreduce binds a fresh plan per call
            request = mar.iallreduce(x, out, comm=comm, algorithm=algorithm)
            compute()
            request.wait()

        t_comp = median(compute)
        t_both = median(both)
        t_call = median(both_one_shot)
    hidden = lambda t: (t_comm + t_comp - t) / min(t_comm, t_comp)
    return {"algorithm": algorithm, "comm_ms": 1e3 * t_comm, "comp_ms": 1e3 * t_comp,
            "both_ms": 1e3 * t_both, "hidden": hidden(t_both), "call_ms": 1e3 * t_call,
            "call_hidden": hidden(t_call)}


def mpirun_command(ranks: int) -> str:
    """The command that ran this script, as a reader would type it (the result's provenance)."""
    return f"mpirun -n {ranks} python -m mpi4py " + " ".join(sys.argv)


def write_results(args, comm, rows: list[dict]) -> None:
    """Write the reader's table (rank 0): per algorithm, the times and the fractions hidden."""
    from _results import write

    values = {}
    for r in rows:
        values[f"hidden_{r['algorithm']}"] = round(r["hidden"], 3)
        values[f"iallreduce_hidden_{r['algorithm']}"] = round(r["call_hidden"], 3)
    table = [[r["algorithm"], r["comm_ms"], r["comp_ms"], r["both_ms"], r["hidden"],
              r["call_hidden"]] for r in rows]
    notes = (f"{args.mib:g} MiB of float64 per rank, SUM; medians of {args.repeats} runs (the "
             f"slowest rank's each); hidden: (T_comm + T_comp - T_both) / min(T_comm, T_comp), "
             f"1 when the shorter disappears, 0 when they run in sequence; {os.cpu_count()} "
             f"cores.")
    path = write(args.results, "How much of an allreduce overlap hides behind NumPy computation",
                 columns=["algorithm", "allreduce ms", "compute ms", "both ms",
                          "hidden (start)", "hidden (iallreduce)"], rows=table,
                 formats=["{}", "{:.1f}", "{:.1f}", "{:.1f}", "{:.0%}", "{:.0%}"],
                 ranks=comm.size, values=values, notes=notes,
                 command=mpirun_command(comm.size))
    print(f"# wrote docs/results/{path.name}", flush=True)


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=float, default=16, help="MiB per rank (float64)")
    parser.add_argument("--algorithms", default="ring,rabenseifner,native")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--results", default="overlap", metavar="NAME",
                        help="write docs/results/NAME.json ('' for none; default: overlap)")
    parser.add_argument("--no-results", dest="results", action="store_const", const="",
                        help="write no result file")
    args = parser.parse_args(argv)
    comm = MPI.COMM_WORLD
    count = int(args.mib * (1 << 20)) // 8
    x = np.random.default_rng(comm.rank).random(count)
    out = np.empty_like(x)
    work = np.random.default_rng(99).random(1 << 18)
    scratch = np.empty_like(work)
    rows = []
    for algorithm in args.algorithms.split(","):
        rows.append(measure(comm, x, out, algorithm, work, scratch, args.repeats))
    if comm.rank == 0:
        print(f"# overlap: {args.mib:g} MiB per rank, {comm.size} ranks, {os.cpu_count()} cores, "
              f"median of {args.repeats}")
        print("# both: start(plan) + compute + wait; iallreduce: the one-shot call instead")
        print(f"{'algorithm':<14} {'comm ms':>8} {'compute ms':>10} {'both ms':>8} "
              f"{'hidden':>7} {'iallreduce ms':>13} {'hidden':>7}")
        for r in rows:
            print(f"{r['algorithm']:<14} {r['comm_ms']:8.1f} {r['comp_ms']:10.1f} "
                  f"{r['both_ms']:8.1f} {r['hidden']:7.0%} {r['call_ms']:13.1f} "
                  f"{r['call_hidden']:7.0%}")
        if args.results:
            write_results(args, comm, rows)
    return rows


if __name__ == "__main__":
    main()
