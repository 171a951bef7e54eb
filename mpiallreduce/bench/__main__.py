"""python -m mpiallreduce.bench (see :mod:`mpiallreduce.bench.cli`)."""

import sys

from mpi4py import MPI

from .cli import main

if __name__ == "__main__":
    status = main()
    if status:
        # Finalize first: under `python -m mpi4py`, a plain non-zero exit becomes MPI_Abort and
        # its banner; after Finalize every rank just exits with the status.
        MPI.Finalize()
    sys.exit(status)
