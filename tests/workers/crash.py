"""A job in which one rank fails mid-run: ``crash.py raise|kill [algorithm]``.

Rank 1 either raises or SIGKILLs itself in the middle of a run of allreduces, while the other
ranks are inside the next one, waiting for it. Run under ``mpirun ... python -m mpi4py`` this
must end the whole job with a non-zero exit; test_dead_ranks.py checks that it does, without hanging.
"""

from __future__ import annotations

import os
import signal
import sys

import numpy as np
from mpi4py import MPI

import mpiallreduce as mar


def main(argv=None) -> None:
    how, algorithm = (list(argv if argv is not None else sys.argv[1:]) + ["ring"])[:2]
    comm = MPI.COMM_WORLD
    x = np.full(1000, comm.rank, dtype=np.float64)
    for call in range(20):
        if call == 10 and comm.rank == 1 and how in ("raise", "kill"):
            print(f"rank 1 fails ({how}) at call {call}", flush=True)
            if how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError("rank 1 fails mid-run")
        mar.allreduce(x, comm=comm, algorithm=algorithm)
    print("no rank failed", flush=True)


if __name__ == "__main__":
    main()
