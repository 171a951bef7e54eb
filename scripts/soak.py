"""Soak test: many mixed calls and many short-lived communicators, watched for wrong results
and for leaks (resident memory, shared-memory windows and mappings, caches, threads).

    mpirun -n 2 python -m mpi4py scripts/soak.py [--calls N] [--comms M] [--seed S]
        [--reports R]

Phases, every rank making the same calls in the same order (the choices come from a generator
seeded alike on every rank):

1. *warm-up*: every algorithm of ``mar.ALGORITHMS`` through every entry point (one-shot
   ``mar.allreduce``, a persistent ``mar.plan`` run several times then freed,
   ``mar.iallreduce(...).wait()``, ``mar.Comm(MPI.COMM_WORLD).Allreduce``), in place and out
   of place, at the largest size and a small one: every window and cache MPI and mpiallreduce
   keep for ``COMM_WORLD`` reaches its full size here;
2. *calls*: N random calls: algorithm, entry point, dtype, op (SUM, MAX, MIN), in place or not,
   fresh arrays or reused ones, and a size from 8 B to 1 MiB (log-uniform; counts 0, 1, small
   and odd ones drawn on purpose);
3. *communicators*: M communicators (``Dup`` and ``Split`` in turn), each used by a few calls
   (a one-shot ``shm`` call, a plan run twice, another entry point) and freed.

Inputs are integer-valued (``base * (rank + 1) + shift`` with ``base`` in [0, 64)), so every
rank computes the exact SUM, MAX and MIN locally; a wrong result on any rank prints ``FAIL``
lines and the script exits with status 1.

Rank 0 prints a report at the start, ``--reports`` times during each phase, and at the end: the
largest resident memory of any rank (``VmRSS``), the shared mappings of the process
(``/proc/self/maps`` entries mapped shared: MPI's shared windows are files under ``/dev/shm``
mapped this way), the windows held by live ``mpiallreduce.shm.node.Node`` objects, the threads,
the entries of ``mpiallreduce._state.CALLS``/``SHAPES`` and ``mpiallreduce.executor.ABANDONED``,
and the schedule cache's entries and estimated bytes (bounded by
``_schedules.SCHEDULE_CACHE_BYTES``: with random counts it fills slowly, and its objects take
more memory than its estimate, which is most of the resident memory a long run gains).
The last line is the verdict, between the end of the warm-up and the end (after the
non-blocking progress threads have had time to retire): it fails (status 1) if resident memory
grew by more than ``RSS_BOUND``, or the shared mappings, live windows or nodes, threads or
abandoned objects grew at all, or the call cache holds more entries after the communicators
were freed than before they were made.
"""

from __future__ import annotations

import argparse
import gc
import math
import sys
import threading
import time
from typing import NamedTuple

import numpy as np
from mpi4py import MPI

import mpiallreduce as mar
from mpiallreduce import _state, executor
from mpiallreduce._schedules import SCHEDULES
from mpiallreduce.nonblocking import progress
from mpiallreduce.shm.node import Node

#: largest message per rank
MAX_BYTES = 1 << 20
#: smallest message drawn from the log-uniform size range (counts 0 and 1 are drawn apart)
MIN_BYTES = 8
DTYPES = tuple(np.dtype(name) for name in ("float64", "float32", "int64", "int32", "uint16"))
OPS = {"SUM": MPI.SUM, "MAX": MPI.MAX, "MIN": MPI.MIN}
ENTRIES = ("call", "plan", "iallreduce", "comm")
#: element counts whose arrays are kept and reused (cache hits); others get fresh arrays
POPULAR = (1, 3, 17, 256, 1000, 4099, 65536)
#: most resident memory (bytes, the largest rank) the run may gain after the warm-up
RSS_BOUND = 64 << 20
#: algorithms the communicator phase's plans take in turn
COMM_PHASE_ALGORITHMS = ("ring", "recursive_doubling", "auto", "shm", "native", "tree",
                         "rabenseifner", "hierarchical", "cascade")


# -- inputs and their exact results ---------------------------------------------------------------

class Case(NamedTuple):
    """One call of the soak, the same on every rank (a named tuple: the tests import this file
    as a module of no package, where a dataclass cannot be made)."""

    entry: str
    algorithm: str
    dtype: np.dtype
    count: int
    op: str
    in_place: bool
    reuse: bool  # arrays from the pool (the call cache finds them again) or fresh ones
    runs: int  # runs of a plan (other entry points: 1)
    offset: int  # where the inputs' base starts in the shared base
    shift: int

    def __str__(self):
        place = "in place" if self.in_place else "out of place"
        return (f"{self.entry} {self.algorithm} {self.op} {self.dtype.name}[{self.count}] "
                f"{place}{' reused' if self.reuse else ''}")


class Inputs:
    """The shared integer base of every input, and the arrays reused from call to call."""

    def __init__(self, seed: int):
        rng = np.random.default_rng([seed, 1])
        self.base = {dtype: rng.integers(0, 64, MAX_BYTES // dtype.itemsize).astype(dtype)
                     for dtype in DTYPES}
        self.pool: dict = {}

    def slice(self, case: Case) -> np.ndarray:
        return self.base[case.dtype][case.offset:case.offset + case.count]

    def fill(self, out: np.ndarray, case: Case, rank: int, run: int) -> np.ndarray:
        """Write this rank's contribution to ``case``'s run ``run`` into ``out``."""
        np.multiply(self.slice(case), rank + 1, out=out)
        out += case.shift + run
        return out

    def arrays(self, case: Case) -> tuple[np.ndarray, np.ndarray]:
        """A send and a receive array for ``case``: the pool's pair, or a fresh one."""
        if not case.reuse:
            return np.empty(case.count, case.dtype), np.empty(case.count, case.dtype)
        key = (case.dtype, case.count)
        if key not in self.pool:
            self.pool[key] = (np.empty(case.count, case.dtype), np.empty(case.count, case.dtype))
        return self.pool[key]


def expected(inputs: Inputs, case: Case, size: int, run: int = 0) -> np.ndarray:
    """The exact result of ``case`` over ``size`` ranks (inputs grow with the rank: the base is
    never negative)."""
    base = inputs.slice(case).astype(np.int64)
    shift = case.shift + run
    if case.op == "SUM":
        exact = base * (size * (size + 1) // 2) + size * shift
    elif case.op == "MAX":
        exact = base * size + shift
    else:
        exact = base + shift
    return exact.astype(case.dtype)


def draw(rng: np.random.Generator, algorithms=mar.ALGORITHMS, entries=ENTRIES,
         max_bytes: int = MAX_BYTES) -> Case:
    """A random case (the same on every rank: ``rng`` is seeded alike everywhere)."""
    dtype = DTYPES[rng.integers(len(DTYPES))]
    longest = max_bytes // dtype.itemsize
    pick = rng.random()
    if pick < 0.3:
        count = int(POPULAR[rng.integers(len(POPULAR))])
    elif pick < 0.4:
        count = int(rng.choice([0, 1, 2, 3, 5, 7, 9]))
    else:
        nbytes = math.exp(rng.uniform(math.log(MIN_BYTES), math.log(max_bytes)))
        count = max(1, int(nbytes) // dtype.itemsize)
        if rng.random() < 0.5:
            count |= 1
    count = min(count, longest)
    entry = entries[rng.integers(len(entries))]
    return Case(entry=entry, algorithm=algorithms[rng.integers(len(algorithms))], dtype=dtype,
                count=count, op=list(OPS)[rng.integers(len(OPS))],
                in_place=bool(rng.random() < 0.5), reuse=count in POPULAR,
                runs=int(rng.integers(1, 5)) if entry == "plan" else 1,
                offset=int(rng.integers(0, longest - count + 1)),
                shift=int(rng.integers(0 if dtype.kind == "u" else -8, 9)))


# -- one call ---------------------------------------------------------------------------------------

def run_case(case: Case, comm: MPI.Intracomm, inputs: Inputs, wrappers: dict) -> str | None:
    """Make ``case``'s call(s) on ``comm``; return why a result is wrong on this rank, or None.

    ``wrappers`` keeps one ``mar.Comm`` per (communicator, algorithm) for the ``comm`` entry.
    """
    send, recv = inputs.arrays(case)
    op = OPS[case.op]
    rank, size = comm.Get_rank(), comm.Get_size()
    sendbuf = MPI.IN_PLACE if case.in_place else send
    # in place the contribution goes where the result comes
    target = recv if case.in_place else send
    if case.entry == "plan":
        inputs.fill(target, case, rank, 0)
        with mar.plan(sendbuf, recv, op=op, comm=comm, algorithm=case.algorithm) as plan:
            for run in range(case.runs):
                if run:
                    inputs.fill(target, case, rank, run)
                plan.run()
                problem = compare(recv, expected(inputs, case, size, run), case, rank, run)
                if problem:
                    return problem
        return None
    inputs.fill(target, case, rank, 0)
    if case.entry == "call":
        out = mar.allreduce(sendbuf, None if not case.in_place and case.count % 2 else recv,
                            op=op, comm=comm, algorithm=case.algorithm)
    elif case.entry == "iallreduce":
        out = mar.iallreduce(sendbuf, recv, op=op, comm=comm, algorithm=case.algorithm).wait()
    else:
        key = (comm.py2f(), case.algorithm)
        if key not in wrappers:
            wrappers[key] = mar.Comm(comm, algorithm=case.algorithm)
        wrappers[key].Allreduce(sendbuf, recv, op)
        out = recv
    return compare(out, expected(inputs, case, size), case, rank, 0)


def compare(out: np.ndarray, exact: np.ndarray, case: Case, rank: int, run: int) -> str | None:
    if out.dtype != exact.dtype or out.shape != exact.shape:
        return f"rank {rank}: {case} run {run}: got {out.dtype}{out.shape}"
    bad = np.flatnonzero(out != exact)
    if bad.size:
        return (f"rank {rank}: {case} run {run}: {bad.size} of {case.count} elements wrong, "
                f"first at {bad[0]}: {out[bad[0]]} instead of {exact[bad[0]]}")
    return None


# -- what the process holds --------------------------------------------------------------------------

def resident_bytes() -> int:
    """This process's resident memory (``VmRSS``)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def shared_mappings() -> tuple[int, int]:
    """Count and total bytes of this process's shared mappings (``/proc/self/maps`` entries
    whose permissions end in ``s``: MPI's shared windows, its shared-memory transport,
    PMIx's and hwloc's segments)."""
    count = nbytes = 0
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            if fields[1].endswith("s"):
                start, stop = (int(address, 16) for address in fields[0].split("-"))
                count += 1
                nbytes += stop - start
    return count, nbytes


def live_nodes() -> tuple[int, int]:
    """Open ``Node`` objects (a communicator's shared-memory state) and the windows they hold."""
    nodes = [obj for obj in gc.get_objects() if isinstance(obj, Node) and not obj.closed]
    return len(nodes), sum(len(node.windows) for node in nodes)


def snapshot(comm: MPI.Intracomm) -> dict:
    """What every rank holds now (collective): resident memory and shared mappings are the
    largest of any rank, the rest this rank's counts (the same on every rank)."""
    gc.collect()
    maps, map_bytes = shared_mappings()
    nodes, windows = live_nodes()
    local = {"rss": resident_bytes(), "maps": maps, "map_bytes": map_bytes, "nodes": nodes,
             "windows": windows, "threads": threading.active_count(),
             "calls": len(_state.CALLS), "shapes": len(_state.SHAPES),
             "abandoned": len(executor.ABANDONED), "schedules": len(SCHEDULES.lru),
             "schedule_bytes": SCHEDULES.lru.weight}
    every = comm.allgather(local)
    return {key: max(ranks[key] for ranks in every) for key in local}


def describe(where: str, figures: dict, started: float) -> str:
    return (f"[{where:>22} {time.monotonic() - started:8.1f} s] "
            f"rss {figures['rss'] / 2**20:7.1f} MiB  shared maps {figures['maps']:3d} "
            f"({figures['map_bytes'] / 2**20:.1f} MiB)  nodes {figures['nodes']} "
            f"windows {figures['windows']}  threads {figures['threads']}  "
            f"CALLS {figures['calls']}  SHAPES {figures['shapes']}  "
            f"ABANDONED {figures['abandoned']}  schedules {figures['schedules']} "
            f"({figures['schedule_bytes'] / 2**20:.1f} MiB estimated)")


# -- the phases --------------------------------------------------------------------------------------

def warm_up(comm: MPI.Intracomm, inputs: Inputs, wrappers: dict) -> list[str]:
    """Every algorithm through every entry point, in place and not, at the largest size and a
    small one; return the wrong results."""
    problems = []
    for algorithm in mar.ALGORITHMS:
        for entry in ENTRIES:
            for in_place in (False, True):
                for count in (MAX_BYTES // 8, 17):
                    case = Case(entry, algorithm, np.dtype("float64"), count, "SUM", in_place,
                                reuse=False, runs=2 if entry == "plan" else 1, offset=0, shift=1)
                    problems.append(run_case(case, comm, inputs, wrappers))
    return [p for p in problems if p]


def soak_calls(comm: MPI.Intracomm, calls: int, rng: np.random.Generator, inputs: Inputs,
               wrappers: dict, report=None, reports: int = 0) -> list[str]:
    """Make ``calls`` random calls on ``comm``; return the wrong results (every rank's).

    Every rank learns of a wrong result at the next report (``reports`` of them, each calling
    ``report(done)`` on every rank) and the phase stops there.
    """
    every = max(1, calls // reports) if reports else calls
    problems: list[str] = []
    for done in range(1, calls + 1):
        problem = run_case(draw(rng), comm, inputs, wrappers)
        if problem:
            problems.append(problem)
        if done % every == 0 or done == calls:
            found = checkpoint(comm, problems, done, calls, "calls", report)
            if found:
                return found
    return gather_problems(comm, problems)


def checkpoint(comm: MPI.Intracomm, problems: list[str], done: int, total: int, what: str,
               report) -> list[str]:
    """Every rank's problems so far (collective), after a progress line unless at the end."""
    found = gather_problems(comm, problems)
    if report is not None and done != total:
        report(f"{what} {done}/{total}")
    return found


def derived(comm: MPI.Intracomm, index: int) -> MPI.Intracomm:
    """The ``index``-th communicator of the phase: a ``Dup`` at odd ``index``, else a ``Split``
    into two halves (of different sizes at odd p) at p > 2, or all ranks in reverse order."""
    if index % 2:
        return comm.Dup()
    rank, size = comm.Get_rank(), comm.Get_size()
    return comm.Split(rank % 2 if size > 2 else 0, -rank)


def soak_comms(comm: MPI.Intracomm, count: int, rng: np.random.Generator, inputs: Inputs,
               report=None, reports: int = 0) -> list[str]:
    """Make ``count`` communicators from ``comm`` (``Dup`` and ``Split`` in turn), use each
    with a one-shot ``shm`` call, a plan run twice and one random call, then free it; return
    the wrong results (every rank's)."""
    every = max(1, count // reports) if reports else count
    problems: list[str] = []
    for done in range(1, count + 1):
        sub = derived(comm, done)
        wrappers: dict = {}
        shm_call = draw(rng, algorithms=("shm",), entries=("call",), max_bytes=64 << 10)
        plan = draw(rng, algorithms=(COMM_PHASE_ALGORITHMS[done % len(COMM_PHASE_ALGORITHMS)],),
                    entries=("plan",), max_bytes=64 << 10)
        other = draw(rng, entries=("call", "iallreduce", "comm"), max_bytes=64 << 10)
        for case in (shm_call, plan, other):
            problem = run_case(case, sub, inputs, wrappers)
            if problem:
                problems.append(f"communicator {done}: {problem}")
        sub.Free()
        if done % every == 0 or done == count:
            found = checkpoint(comm, problems, done, count, "communicators", report)
            if found:
                return found
    return gather_problems(comm, problems)


def gather_problems(comm: MPI.Intracomm, problems: list[str]) -> list[str]:
    """Every rank's wrong results, on every rank (collective)."""
    return [p for ranks in comm.allgather(problems[:5]) for p in ranks]


def settle(seconds: float = progress.IDLE_SECONDS + 1.0) -> None:
    """Give idle progress threads time to exit."""
    time.sleep(seconds)


def growth(warm: dict, before_comms: dict, end: dict, rss_bound: int = RSS_BOUND) -> list[str]:
    """What grew past its bound between the warm-up and the end (empty: nothing leaked)."""
    problems = []
    if end["rss"] - warm["rss"] > rss_bound:
        problems.append(f"resident memory grew {(end['rss'] - warm['rss']) / 2**20:.1f} MiB "
                        f"(bound {rss_bound / 2**20:.0f} MiB)")
    for key, what in (("maps", "shared mappings"), ("nodes", "open shm nodes"),
                      ("windows", "live shm windows"), ("threads", "threads"),
                      ("abandoned", "ABANDONED entries")):
        if end[key] > warm[key]:
            problems.append(f"{what} grew from {warm[key]} to {end[key]}")
    for key, what in (("calls", "CALLS"), ("shapes", "SHAPES")):
        if end[key] > before_comms[key]:
            problems.append(f"{what} holds {end[key]} entries after the communicators were "
                            f"freed, {before_comms[key]} before they were made")
    return problems


def library() -> str:
    """The MPI library's name and version, short."""
    return MPI.Get_library_version().rstrip("\x00").splitlines()[0].split(",")[0].strip()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=1_000_000, help="random calls on COMM_WORLD")
    parser.add_argument("--comms", type=int, default=10_000, help="communicators made and freed")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--reports", type=int, default=10, help="reports during each phase")
    args = parser.parse_args(argv)

    comm = MPI.COMM_WORLD
    started = time.monotonic()

    def report(where: str, figures: dict | None = None) -> dict:
        figures = figures or snapshot(comm)
        if comm.rank == 0:
            print(describe(where, figures, started), flush=True)
        return figures

    if comm.rank == 0:
        print(f"# soak: {comm.size} ranks, {args.calls} calls, {args.comms} communicators, "
              f"seed {args.seed}, {library()}", flush=True)
    rng = np.random.default_rng(args.seed)
    inputs = Inputs(args.seed)
    wrappers: dict = {}
    report("start")
    problems = warm_up(comm, inputs, wrappers)
    problems = gather_problems(comm, problems)
    warm = report("warm")
    if not problems:
        problems = soak_calls(comm, args.calls, rng, inputs, wrappers, report, args.reports)
    before_comms = report("calls done")
    if not problems:
        problems = soak_comms(comm, args.comms, rng, inputs, report, args.reports)
    settle()
    end = report("end")
    if problems:
        if comm.rank == 0:
            for problem in problems:
                print(f"FAIL {problem}", flush=True)
        return 1
    leaks = growth(warm, before_comms, end)
    if comm.rank == 0:
        figures = (f"rss {(end['rss'] - warm['rss']) / 2**20:+.1f} MiB (bound "
                   f"{RSS_BOUND / 2**20:.0f}), shared maps {end['maps'] - warm['maps']:+d}, "
                   f"windows {end['windows'] - warm['windows']:+d}, nodes "
                   f"{end['nodes'] - warm['nodes']:+d}, threads "
                   f"{end['threads'] - warm['threads']:+d}, CALLS {end['calls']}, ABANDONED "
                   f"{end['abandoned'] - warm['abandoned']:+d} since the warm-up")
        print(f"VERDICT {'FAIL' if leaks else 'PASS'}: {figures}"
              + "".join(f"; {leak}" for leak in leaks), flush=True)
    return 1 if leaks else 0


if __name__ == "__main__":
    sys.exit(main())
