"""Two plans run in different orders on different ranks (rank 0: B then A; others: A then B).

Run as ``mpirun -n 2 python -m mpi4py misordered.py ALGORITHM [TIMEOUT]``. Prints one line per
rank: ``WAITING rank R`` once its plans are built and it starts running them, then
``RESULT a=... b=...`` if the runs returned (the bug this guards against: swapped sums), or
``TIMEOUT <message>`` (a timeout, or the revocation by the rank that timed out first).
Without a timeout the ranks wait, as mis-ordered MPI collectives do, and the caller kills the
job.
"""

import sys

import numpy as np
from mpi4py import MPI

import mpiallreduce as mar


def main():
    algorithm = sys.argv[1]
    timeout = float(sys.argv[2]) if len(sys.argv) > 2 else None
    comm = MPI.COMM_WORLD
    a, b = np.full(2, 1.0 + comm.rank), np.full(2, 100.0 + 10 * comm.rank)
    plan_a = mar.plan(a, np.empty(2), comm=comm, algorithm=algorithm)
    plan_b = mar.plan(b, np.empty(2), comm=comm, algorithm=algorithm)
    plans = [plan_b, plan_a] if comm.rank == 0 else [plan_a, plan_b]
    # the launch is over and the plans are built: what follows is the wait itself
    print(f"WAITING rank {comm.rank}", flush=True)
    try:
        for plan in plans:
            plan.run(timeout=timeout)
    except (mar.CollectiveTimeout, mar.CommunicatorRevoked) as exc:
        # (CommunicatorRevoked: the other rank timed out first, and this one heard it; its
        # message holds the other's reason)
        print(f"TIMEOUT rank {comm.rank}: {exc}", flush=True)
        return
    print(f"RESULT rank {comm.rank}: a={plan_a.recvbuf[0]} b={plan_b.recvbuf[0]}", flush=True)


if __name__ == "__main__":
    main()
