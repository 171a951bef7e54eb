"""An mpi4py program moved to mpiallreduce by one line: Monte Carlo pi, written the mpi4py way.

    mpirun -n 4 python -m mpi4py examples/mpi4py_pi.py

Everything below is plain mpi4py (``Allreduce`` of a NumPy tally, ``Allgather`` of per-rank
hit counts, ``Iallreduce`` of the squared error); the only change from the MPI version is the
line marked in ``main``, which makes those collectives run mpiallreduce's algorithms.
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

import mpiallreduce as mar


def estimate(comm, samples: int = 100_000, seed: int = 2024):
    """Return (pi estimate, hits per rank, squared error summed over ranks) on ``comm``."""
    rng = np.random.default_rng([seed, comm.Get_rank()])
    xy = rng.random((samples, 2))
    hits = np.array([np.count_nonzero((xy * xy).sum(axis=1) <= 1.0)], dtype=np.int64)

    per_rank = np.empty(comm.Get_size(), dtype=np.int64)
    comm.Allgather(hits, per_rank)

    tally = np.array([hits[0], samples], dtype=np.int64)
    total = np.empty_like(tally)
    comm.Allreduce(tally, total, op=MPI.SUM)
    pi = 4.0 * total[0] / total[1]

    local = np.array([(4.0 * hits[0] / samples - np.pi) ** 2])
    squared = np.empty(1)
    request = comm.Iallreduce(local, squared, op=MPI.SUM)
    request.Wait()
    return pi, per_rank, squared[0]


def main() -> float:
    comm = mar.Comm(MPI.COMM_WORLD)  # the one changed line; it was: comm = MPI.COMM_WORLD
    pi, per_rank, squared = estimate(comm)
    if comm.Get_rank() == 0:
        print(f"pi ~ {pi:.6f} from {comm.Get_size()} ranks; hits per rank {per_rank.tolist()}; "
              f"rms error per rank {np.sqrt(squared / comm.Get_size()):.2e}")
    return pi


if __name__ == "__main__":
    main()
