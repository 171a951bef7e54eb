"""Non-blocking requests at a given MPI thread level (the progress rules of docs/howto/calls.md).

Run as ``mpirun -n 2 python -m mpi4py nonblocking_levels.py LEVEL`` with LEVEL one of
``single``, ``serialized``, ``multiple`` (``mpi4py.rc.thread_level``). Every rank prints
``OK <case>`` or ``FAIL <case>: <why>`` per case, then ``DONE``. Ranks other than 0 join each
case 0.5 s late, so rank 0's calls meet a collective its peers have not started.
"""

import sys
import time

import mpi4py

mpi4py.rc.thread_level = sys.argv[1]

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

import mpiallreduce as mar  # noqa: E402

LATE = 0.5  # seconds the other ranks arrive after rank 0


def late(comm) -> None:
    if comm.rank != 0:
        time.sleep(LATE)


def expected(comm, count: int) -> np.ndarray:
    return sum(np.arange(count, dtype=np.float64) + r for r in range(comm.size))


def late_request(comm, algorithm):
    """An iallreduce of 1000 values that ranks other than 0 start 0.5 s late."""
    x = np.arange(1000, dtype=np.float64) + comm.rank
    late(comm)
    return mar.iallreduce(x, comm=comm, algorithm=algorithm, check=False)


def outcome(comm, out, failure: str | None) -> str | None:
    """Rank 0's failure if it saw one, else whether the sum is right."""
    if comm.rank == 0 and failure:
        return failure
    return None if np.array_equal(out, expected(comm, 1000)) else "wrong sum"


def never_blocks(comm, algorithm):
    """test() on a request whose peers have not started returns False at once."""
    request = late_request(comm, algorithm)
    first = request.test()
    return outcome(comm, request.wait(), first and "test() returned True before the other "
                                                   "ranks had started (it blocked)")


def wait_honours_its_timeout(comm, algorithm):
    """wait(timeout) raises CollectiveTimeout and leaves the request in flight."""
    request = late_request(comm, algorithm)
    raised = False
    if comm.rank == 0:
        try:
            request.wait(timeout=0.1)
        except mar.CollectiveTimeout as exc:
            raised = "still in flight" in str(exc)
    return outcome(comm, request.wait(), not raised and "wait(timeout=0.1) did not raise "
                   "CollectiveTimeout while the peers were late")


def blocking_call_between(comm, algorithm):
    """A blocking call while a request is in flight, waited in different orders by rank."""
    x = np.arange(1000, dtype=np.float64) + comm.rank
    y = np.arange(10, dtype=np.float64) + comm.rank
    request = mar.iallreduce(x, comm=comm, algorithm=algorithm, check=False)
    if comm.rank == 0:
        blocking = mar.allreduce(y, comm=comm, algorithm="ring", check=False)
        out = request.wait()
    else:
        out = request.wait()
        blocking = mar.allreduce(y, comm=comm, algorithm="ring", check=False)
    if not (np.array_equal(out, expected(comm, 1000))
            and np.array_equal(blocking, expected(comm, 10))):
        return "wrong sum"
    return None


CASES = [never_blocks, wait_honours_its_timeout]


def main():
    comm = MPI.COMM_WORLD
    mar.allreduce(np.zeros(1), comm=comm)  # the communicator's set-up is collective
    cases = CASES + ([blocking_call_between] if sys.argv[1] == "multiple" else [])
    for case in cases:
        for algorithm in ("ring", "native"):
            name = f"{case.__name__}[{algorithm}]"
            try:
                failure = case(comm, algorithm)
            except Exception as exc:  # noqa: BLE001 - reported, not raised
                failure = f"{type(exc).__name__}: {exc}"
            print(f"FAIL {name}: {failure}" if failure else f"OK {name}", flush=True)
            comm.Barrier()
    print("DONE", flush=True)


if __name__ == "__main__":
    main()
