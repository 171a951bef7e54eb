"""What the drop-in's routing costs: ``mar.Comm.Allreduce`` against the ``mar.allreduce`` call it
makes, in one process (p = 1: CPU only, so no other rank's scheduling shows), 8 B float64 SUM.

    python scripts/drop_in_cost.py [--algorithms native ring] [--rounds 15] [--routing-only]
        [--results NAME | --no-results]

Cases run interleaved; each figure is the best over ``--rounds`` rounds of 3 x 2000 calls, for the
same arrays each call, in place, and a fresh pair of arrays per call (as dot products are written).
``--routing-only`` replaces the ``mar.allreduce`` that ``mar.Comm`` calls by a function that returns
at once, so the routing alone is timed (against that function called directly): the figure least
disturbed by other work on a busy machine.

``--results NAME`` (default ``drop_in_cost``; ``--results ''`` or ``--no-results`` writes none)
writes ``docs/results/NAME.json`` (``scripts/_results.py``): per kind of arrays and per
algorithm and check, ``mar.Comm.Allreduce`` over ``mar.allreduce`` (with ``--routing-only``: the
routing's µs per call).
"""

from __future__ import annotations

import argparse
import sys
import timeit

import numpy as np
from mpi4py import MPI

import mpiallreduce as mar


def _returns(sendbuf, recvbuf=None, op=None, comm=None, algorithm="auto", topology=None,
             check=True, timeout=None, **params):
    """mar.allreduce's signature, doing nothing (``--routing-only``)."""
    return recvbuf


def measure(world, algorithm: str, check: bool, rounds: int) -> dict:
    """Best µs per call of each (arrays, mar.allreduce or mar.Comm) case, run interleaved."""
    x, out, op = np.ones(1), np.empty(1), MPI.SUM
    comm = mar.Comm(world, algorithm, check=check)
    comm.Allreduce(x, out, op)
    plain = comm._plain()  # the communicator mar.Comm hands to mar.allreduce
    cases = {
        ("same", "call"): lambda: mar.allreduce(x, out, op, plain, algorithm, None, check),
        ("same", "comm"): lambda: comm.Allreduce(x, out, op),
        ("in place", "call"): lambda: mar.allreduce(MPI.IN_PLACE, out, op, plain, algorithm,
                                                    None, check),
        ("in place", "comm"): lambda: comm.Allreduce(MPI.IN_PLACE, out, op),
        ("fresh", "call"): lambda: mar.allreduce(np.ones(1), np.empty(1), op, plain, algorithm,
                                                 None, check),
        ("fresh", "comm"): lambda: comm.Allreduce(np.ones(1), np.empty(1), op)}
    best = dict.fromkeys(cases, float("inf"))
    for _ in range(rounds):
        for case, run in cases.items():
            seconds = min(timeit.repeat(run, number=2000, repeat=3)) / 2000
            best[case] = min(best[case], seconds * 1e6)
    return best


ARRAYS = ("same", "in place", "fresh")


def write_results(args, measured: dict) -> None:
    """Write the reader's table: one row per kind of arrays, one column per algorithm and check."""
    from _results import write

    keys = list(measured)
    columns = ["arrays"] + [f"{a}, check={c}" for a, c in keys]
    rows, values = [], {}
    for arrays in ARRAYS:
        cells = []
        for algorithm, check in keys:
            call, drop_in = measured[algorithm, check][arrays]
            cell = drop_in - call if args.routing_only else drop_in / call
            cells.append(cell)
            key = f"{algorithm}_{'check' if check else 'nocheck'}_{arrays.replace(' ', '_')}"
            values[key] = round(cell, 3)
        values[f"{arrays.replace(' ', '_')}_range"] = f"{min(cells):.2f}-{max(cells):.2f}"
        rows.append([f"{arrays} arrays" if arrays != "in place" else "in place"] + cells)
    if args.routing_only:
        title = "What the drop-in's routing costs, alone (µs per call)"
        notes = (f"One process, 8 B float64 SUM: mar.Comm.Allreduce's µs per call minus the "
                 f"function it calls (mar.allreduce replaced by one that returns at once), "
                 f"best over {args.rounds} interleaved rounds of 3 x 2000 calls.")
    else:
        title = "What the drop-in costs: mar.Comm.Allreduce / the mar.allreduce call it makes"
        notes = (f"One process, 8 B float64 SUM: mar.Comm.Allreduce's time over the mar.allreduce "
                 f"call it makes, best over {args.rounds} interleaved rounds of 3 x 2000 calls.")
    path = write(args.results, title, columns=columns, rows=rows,
                 formats=["{}"] + ["{:.2f}"] * len(keys), ranks=MPI.COMM_WORLD.Get_size(),
                 values=values, notes=notes)
    print(f"# wrote docs/results/{path.name}", flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--algorithms", nargs="+", default=["native", "ring"])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--routing-only", action="store_true")
    parser.add_argument("--results", default="drop_in_cost", metavar="NAME",
                        help="write docs/results/NAME.json ('' for none; default: drop_in_cost)")
    parser.add_argument("--no-results", dest="results", action="store_const", const="",
                        help="write no result file")
    args = parser.parse_args(argv)
    if args.routing_only:
        from mpiallreduce import comm as drop_in

        mar.allreduce = drop_in.allreduce = _returns
    print("# algorithm check  arrays       mar.allreduce us  mar.Comm.Allreduce us  routing us")
    measured = {}
    for algorithm in args.algorithms:
        for check in (True, False):
            best = measure(MPI.COMM_WORLD, algorithm, check, args.rounds)
            measured[algorithm, check] = {}
            for arrays in ARRAYS:
                call, drop_in = best[arrays, "call"], best[arrays, "comm"]
                measured[algorithm, check][arrays] = (call, drop_in)
                print(f"  {algorithm:>9} {check!s:5}  {arrays:<10} {call:16.3f} "
                      f"{drop_in:22.3f} {drop_in - call:+11.3f}", flush=True)
    if args.results and MPI.COMM_WORLD.Get_rank() == 0:
        write_results(args, measured)
    return 0


if __name__ == "__main__":
    sys.exit(main())
