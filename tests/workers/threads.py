"""Threads calling mpiallreduce, at a given MPI thread level.

Run as ``mpirun -n 2 python -m mpi4py threads.py LEVEL`` with LEVEL one of ``single``,
``funneled``, ``serialized``, ``multiple`` (``mpi4py.rc.thread_level``). Every rank prints
``OK <case>`` or ``FAIL <case>: <why>`` per case, then ``DONE``.

- ``multiple``: threads on distinct communicators at the same time (mixed algorithms and sizes,
  one-shot calls and a plan per thread), and requests waited in another thread than the one
  that started them, must give exact results.
- below it: a call from a second thread (a one-shot call, a plan's run, a request's wait) must
  raise a clear ``RuntimeError`` naming the thread level and ``MPI_THREAD_MULTIPLE``, and leave
  the communicator as it was: the first thread's next call (or wait) still gives the exact
  result.

Inputs are small integers, so every algorithm's result is exact. Every call that could meet a
peer that never comes carries a ``timeout``, and a hang dumps every thread's stack
(``faulthandler``) and ends the rank.
"""

import faulthandler
import pathlib
import re
import sys
import threading
import traceback

import mpi4py

mpi4py.rc.thread_level = sys.argv[1]

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

import mpiallreduce as mar  # noqa: E402

#: seconds before a hung rank dumps its threads' stacks and exits
HANG_SECONDS = 60
#: threads (each on a Dup of COMM_WORLD of its own) and calls per thread in the concurrent case
THREADS = 4
CALLS = 200
#: seconds between the interpreter's thread switches in the concurrent case
SWITCH_SECONDS = 1e-5
ALGORITHMS = ("shm", "ring", "recursive_doubling", "auto", "native")
COUNTS = (0, 1, 2, 7, 64, 1001, 4096, 65537)
DTYPES = ("float64", "float32", "int64", "int32")
#: a timeout on the calls below MPI_THREAD_MULTIPLE: a rank that raised where its peer did not
#: leaves the peer waiting, which must end as an error, not a hang
TIMEOUT = 20.0
LEVEL_NAMES = {MPI.THREAD_SINGLE: "MPI_THREAD_SINGLE", MPI.THREAD_FUNNELED: "MPI_THREAD_FUNNELED",
               MPI.THREAD_SERIALIZED: "MPI_THREAD_SERIALIZED",
               MPI.THREAD_MULTIPLE: "MPI_THREAD_MULTIPLE"}


def contribution(comm, count: int, dtype: str, key: int) -> np.ndarray:
    """This rank's input: ``(i + key) % 61 * (rank + 1)``, small integers."""
    base = (np.arange(count) + key) % 61
    return (base * (comm.Get_rank() + 1)).astype(dtype)


def exact(comm, count: int, dtype: str, key: int) -> np.ndarray:
    """The sum of every rank's :func:`contribution`."""
    size = comm.Get_size()
    return (((np.arange(count) + key) % 61) * (size * (size + 1) // 2)).astype(dtype)


def wrong(out: np.ndarray, comm, count: int, dtype: str, key: int, what: str) -> str | None:
    expected = exact(comm, count, dtype, key)
    if out.dtype != expected.dtype or not np.array_equal(out, expected):
        return f"{what}: wrong result ({out[:4]}... instead of {expected[:4]}...)"
    return None


def failure(error: BaseException) -> str:
    """An exception raised in a thread, with where it was raised (its last frames)."""
    frames = traceback.extract_tb(error.__traceback__)[-4:]
    where = " <- ".join(f"{pathlib.Path(f.filename).name}:{f.lineno} {f.name}"
                        for f in reversed(frames))
    return f"{type(error).__name__}: {error} (at {where})"


def in_thread(target, *args, **kwargs):
    """Run ``target(*args, **kwargs)`` in a new thread; return ``{"value": what it returned}``
    or ``{"error": what it raised}``."""
    outcome = {}

    def run():
        try:
            outcome["value"] = target(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            outcome["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return outcome


# -- MPI_THREAD_MULTIPLE: threads must work ---------------------------------------------------------

def thread_calls(comm, index: int) -> str | None:
    """``CALLS`` one-shot calls of mixed algorithms, sizes, dtypes, in place or not, with a plan
    of its own run between them; the choices seeded by ``index`` (the same on every rank)."""
    rng = np.random.default_rng([index, 7])
    x = contribution(comm, 513, "float64", index)
    planned = np.empty_like(x)
    with mar.plan(x, planned, comm=comm, algorithm=ALGORITHMS[index % len(ALGORITHMS)]) as plan:
        for call in range(CALLS):
            algorithm = ALGORITHMS[rng.integers(len(ALGORITHMS))]
            count = int(COUNTS[rng.integers(len(COUNTS))])
            dtype = DTYPES[rng.integers(len(DTYPES))]
            key = index * CALLS + call
            send = contribution(comm, count, dtype, key)
            if rng.random() < 0.5:
                out = mar.allreduce(MPI.IN_PLACE, send, comm=comm, algorithm=algorithm)
            else:
                out = mar.allreduce(send, np.empty_like(send), comm=comm, algorithm=algorithm)
            problem = wrong(out, comm, count, dtype, key,
                            f"thread {index} call {call} ({algorithm}, {dtype}[{count}])")
            if problem:
                return problem
            if call % 10 == 0:
                plan.run()
                problem = wrong(planned, comm, 513, "float64", index, f"thread {index} plan")
                if problem:
                    return problem
    return None


def threads_on_their_own_communicators() -> str | None:
    """``THREADS`` threads, each on its own Dup of COMM_WORLD, at the same time.

    A thread that fails (a wrong result or an exception) leaves its peers on the other ranks
    waiting in their next call: it prints its ``FAIL`` line and aborts the job at once.
    """
    comms = [MPI.COMM_WORLD.Dup() for _ in range(THREADS)]  # collective: in the main thread
    # threads switch every 10 us instead of 5 ms: a race between them shows in a short run
    interval = sys.getswitchinterval()
    sys.setswitchinterval(SWITCH_SECONDS)

    def work(index):
        try:
            problem = thread_calls(comms[index], index)
        except Exception as exc:  # noqa: BLE001 - reported below
            problem = f"thread {index}: {failure(exc)}"
        if problem:
            print(f"FAIL threads_on_their_own_communicators: {problem}", flush=True)
            MPI.COMM_WORLD.Abort(1)

    threads = [threading.Thread(target=work, args=(index,)) for index in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    sys.setswitchinterval(interval)
    for comm in comms:
        comm.Free()
    return None


def request_waited_in_another_thread() -> str | None:
    """An ``iallreduce`` started in this thread and waited in another, for each algorithm,
    then one started in another thread and waited here."""
    comm = MPI.COMM_WORLD
    for key, algorithm in enumerate(ALGORITHMS):
        for count in (5, 20000):
            x = contribution(comm, count, "float64", key)
            request = mar.iallreduce(x, np.empty_like(x), comm=comm, algorithm=algorithm)
            outcome = in_thread(request.wait)
            if "error" in outcome:
                return f"wait in a thread ({algorithm}): {failure(outcome['error'])}"
            problem = wrong(outcome["value"], comm, count, "float64", key,
                            f"started here, waited in a thread ({algorithm}, {count})")
            if problem:
                return problem
            outcome = in_thread(mar.iallreduce, x, np.empty_like(x), comm=comm, algorithm=algorithm)
            if "error" in outcome:
                return f"start in a thread ({algorithm}): {failure(outcome['error'])}"
            problem = wrong(outcome["value"].wait(), comm, count, "float64", key,
                            f"started in a thread, waited here ({algorithm}, {count})")
            if problem:
                return problem
    return None


# -- below MPI_THREAD_MULTIPLE: a second thread's call must be refused -----------------------------

def refusal(outcome: dict) -> str | None:
    """Why ``outcome`` (of :func:`in_thread`) is not the clear error expected, or None."""
    level = LEVEL_NAMES[MPI.Query_thread()]
    if "error" not in outcome:
        return (f"a second thread's call under {level} returned normally; expected a "
                f"RuntimeError naming {level} and MPI_THREAD_MULTIPLE")
    error = outcome["error"]
    message = str(error)
    if not isinstance(error, RuntimeError) or not re.search(level, message, re.I) \
            or "THREAD_MULTIPLE" not in message.upper():
        return (f"a second thread's call under {level} raised {type(error).__name__}: "
                f"{message!r}; expected a RuntimeError naming {level} and MPI_THREAD_MULTIPLE")
    return None


def second_thread_call(algorithm: str):
    def case() -> str | None:
        """The main thread calls on COMM_WORLD, then a second thread does (refused); the main
        thread's next call is still exact."""
        comm = MPI.COMM_WORLD
        x = contribution(comm, 300, "int64", 1)
        first = mar.allreduce(x, comm=comm, algorithm=algorithm, timeout=TIMEOUT)
        problem = wrong(first, comm, 300, "int64", 1, "the main thread's call")
        y = contribution(comm, 300, "int64", 2)
        problem = problem or refusal(in_thread(mar.allreduce, y, comm=comm, algorithm=algorithm,
                                               timeout=TIMEOUT))
        after = mar.allreduce(y, comm=comm, algorithm=algorithm, timeout=TIMEOUT)
        return problem or wrong(after, comm, 300, "int64", 2, "the main thread's next call")
    case.__name__ = f"second_thread_call[{algorithm}]"
    return case


def second_thread_plan_run() -> str | None:
    """A plan made in the main thread and run in a second one (refused); it still runs here."""
    comm = MPI.COMM_WORLD
    x = contribution(comm, 300, "int64", 3)
    with mar.plan(x, np.empty_like(x), comm=comm, algorithm="ring") as plan:
        problem = refusal(in_thread(plan.run, TIMEOUT))
        return problem or wrong(plan.run(TIMEOUT), comm, 300, "int64", 3, "the plan's next run")


def second_thread_wait(algorithm: str):
    def case() -> str | None:
        """An ``iallreduce`` started in the main thread and waited in a second one (refused);
        the main thread's wait then gives the exact result."""
        comm = MPI.COMM_WORLD
        x = contribution(comm, 300, "int64", 4)
        request = mar.iallreduce(x, np.empty_like(x), comm=comm, algorithm=algorithm)
        problem = refusal(in_thread(request.wait, TIMEOUT))
        return problem or wrong(request.wait(TIMEOUT), comm, 300, "int64", 4,
                                "the main thread's wait")
    case.__name__ = f"second_thread_wait[{algorithm}]"
    return case


MULTIPLE_CASES = [threads_on_their_own_communicators, request_waited_in_another_thread]
LOWER_CASES = ([second_thread_call(a) for a in ("ring", "shm", "native")]
               + [second_thread_plan_run]
               + [second_thread_wait(a) for a in ("ring", "native")])


def main():
    faulthandler.dump_traceback_later(HANG_SECONDS, exit=True)
    comm = MPI.COMM_WORLD
    mar.allreduce(np.zeros(1), comm=comm)  # the communicator's set-up is collective
    cases = MULTIPLE_CASES if MPI.Query_thread() == MPI.THREAD_MULTIPLE else LOWER_CASES
    for case in cases:
        try:
            problem = case()
        except Exception as exc:  # noqa: BLE001 - reported, not raised
            problem = failure(exc)
        print(f"FAIL {case.__name__}: {problem}" if problem else f"OK {case.__name__}",
              flush=True)
        comm.Barrier()
    faulthandler.cancel_dump_traceback_later()
    print("DONE", flush=True)


if __name__ == "__main__":
    main()
