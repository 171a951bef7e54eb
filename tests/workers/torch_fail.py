"""A DDP job in which one rank fails inside the gradient hook: ``torch_fail.py raise|mismatch|none``.

- ``raise``: at step 3, rank 1's hook raises before handing its bucket over, while the other
  ranks' buckets wait for it (run under ``python -m mpi4py``: the exception ends the job).
- ``mismatch``: rank 1 reduces its buckets with another algorithm than the other ranks: the
  reduction itself fails, in the communication thread, on every rank, and the hook's state
  aborts the job (run without ``-m mpi4py``: ``State(abort_on_error=True)`` alone ends it).
- ``none``: every rank trains 5 steps.

test_torch.py checks that the job ends, non-zero, with the error, and does not hang.
"""

from __future__ import annotations

import sys

import torch
from mpi4py import MPI

import mpiallreduce as mar


def main(argv=None) -> None:
    how = (list(argv if argv is not None else sys.argv[1:]) + ["none"])[0]
    comm = MPI.COMM_WORLD
    mar.torch.init_process_group(comm)
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(100, 10))
    algorithm = "ring" if how == "mismatch" and comm.rank == 1 else "auto"
    state = mar.torch.State(comm, algorithm=algorithm)
    step = 0

    def hook(state, bucket):
        if how == "raise" and step == 3 and comm.rank == 1:
            print(f"rank 1 fails in the hook at step {step}", flush=True)
            raise RuntimeError("rank 1 fails in the hook")
        return mar.torch.allreduce_hook(state, bucket)
    model.register_comm_hook(state, hook)
    for step in range(5):  # noqa: B007 - the hook reads it
        model(torch.randn(8, 100)).sum().backward()
    state.free()
    print("no rank failed", flush=True)


if __name__ == "__main__":
    main()
