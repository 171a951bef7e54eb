"""What the drop-in's routing costs: ``mar.Comm.Allreduce`` against the ``mar.allreduce`` call it
makes, in one process (p = 1: CPU only, so no other rank's scheduling shows), 8 B float64 SUM.

    python scripts/drop_in_cost.py [--algorithms native ring] [--rounds 15] [--routing-only]

Cases run interleaved; each figure is the best over ``--rounds`` rounds of 3 x 2000 calls, for the
same arrays each call, in place, and a fresh pair of arrays per call (as dot products are written).
``--routing-only`` replaces the ``mar.allreduce`` that ``mar.Comm`` calls by a function that returns
at once, so the routing alone is timed (against that function called directly): the figure least
disturbed by other work on a busy machine.
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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--algorithms", nargs="+", default=["native", "ring"])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--routing-only", action="store_true")
    args = parser.parse_args(argv)
    if args.routing_only:
        from mpiallreduce import comm as drop_in

        mar.allreduce = drop_in.allreduce = _returns
    print("# algorithm check  arrays       mar.allreduce us  mar.Comm.Allreduce us  routing us")
    for algorithm in args.algorithms:
        for check in (True, False):
            best = measure(MPI.COMM_WORLD, algorithm, check, args.rounds)
            for arrays in ("same", "in place", "fresh"):
                call, drop_in = best[arrays, "call"], best[arrays, "comm"]
                print(f"  {algorithm:>9} {check!s:5}  {arrays:<10} {call:16.3f} "
                      f"{drop_in:22.3f} {drop_in - call:+11.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
