"""Estimate pi by Monte Carlo on every rank and combine the tallies with mpiallreduce.

    mpirun -n 4 python examples/monte_carlo_pi.py [--samples N] [--algorithm ring]

Each rank throws darts into the unit square; an allreduce of (hits, throws) gives every rank the
global estimate (tests/test_examples.py checks it against MPI's own Allreduce).
"""

from __future__ import annotations

import argparse

import numpy as np
from mpi4py import MPI

import mpiallreduce as mar


def estimate_pi(samples_per_rank: int, comm=MPI.COMM_WORLD, algorithm: str = "ring",
                seed: int = 12345) -> tuple[float, np.ndarray]:
    """Return (pi estimate, global [hits, throws]) computed with an mpiallreduce allreduce."""
    rng = np.random.default_rng([seed, comm.rank])
    xy = rng.random((samples_per_rank, 2))
    hits = np.count_nonzero((xy * xy).sum(axis=1) <= 1.0)
    tally = np.array([hits, samples_per_rank], dtype=np.int64)
    total = mar.allreduce(tally, comm=comm, algorithm=algorithm)
    return 4.0 * total[0] / total[1], total


def main(argv=None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=200_000, help="darts per rank")
    parser.add_argument("--algorithm", default="ring", choices=mar.ALGORITHMS)
    args = parser.parse_args(argv)
    comm = MPI.COMM_WORLD
    pi, total = estimate_pi(args.samples, comm, args.algorithm)
    if comm.rank == 0:
        print(f"pi ~ {pi:.6f} from {total[1]} darts on {comm.size} ranks "
              f"(error {abs(pi - np.pi):.2e}, algorithm {args.algorithm})")
    return pi


if __name__ == "__main__":
    main()
