"""Measure every algorithm and native on this machine and write the decision table ``auto`` reads.

    mpirun -n N python -m mpi4py -m mpiallreduce.tune [--sizes 8:64M] [--repeats 5] [--output PATH]
        [--modes out,in]

The offline form of what ``auto`` does online (learning, on unless ``MPIALLREDUCE_LEARN=off``,
:mod:`mpiallreduce.learn`): time candidates interleaved, make each time the slowest rank's
with one collective (:func:`mpiallreduce.learn.slowest`), and let
:func:`mpiallreduce.decide.decide` say whether one beats the incumbent beyond the noise; here
every candidate, at every size, in both modes, and written to the table file, where learning
times a handful per case that the running program meets and keeps it for the communicator
(:func:`mpiallreduce.learn.save` writes what it learned in this same format).

For every message size (powers of two), op class and mode (out of place, and in place: the
``_in_place`` classes), every rank builds one plan per candidate
(every registered algorithm that accepts the op class, and ``native``), then runs them
*interleaved*: ``repeats`` rounds, each timing a batch of runs of every candidate in turn
after one untimed run (a fresh order each round, seeded alike on every rank: a rotated order
ran each candidate right after the same other one every round, whose caches and pages it
inherits), so a burst of load on a shared machine hits every candidate alike. A
batch's time is the slowest rank's mean; a candidate's time is the median over rounds. At
each size :func:`mpiallreduce.decide.decide` judges the rounds with the built-in rules' choice
there as the incumbent (:func:`incumbent`: what ``auto`` runs without a table, and what
learning's incumbent is too): a candidate wins only if its median beats the incumbent's by
more than the spread of either one's rounds; otherwise the size keeps the rules' choice and
its line says "within noise" (so it does with fewer than
:data:`mpiallreduce.decide.MIN_ROUNDS` rounds, or with rounds of the incumbent too spread to
judge).
On one node ``hierarchical`` and ``cascade`` (made for several nodes) are not timed.
Consecutive sizes with the same pick merge into one range. Op classes: ``commutative`` is
float64 SUM; ``noncommutative`` is a user op declared non-commutative (an elementwise add
through ``MPI.Op.Create``, so native and the schedules pay the same user-op call), with only
the order-keeping algorithms as candidates.

Rank 0 writes the table (JSON in the format of the built-in rules, see :mod:`mpiallreduce.select`:
the table names a provenance record with the machine, date, command, every median measured
and each size's verdict)
to ``--output``,
``$MPIALLREDUCE_TUNING`` or :func:`mpiallreduce.select.default_path` (in that order), replacing
the table of the same communicator size and keeping the others, so one file holds one table per
size. Every rank that calls ``auto`` must read the same file (see :mod:`mpiallreduce.select`).

``--compare LABEL=ALGORITHM[:NAME=VALUE,...] ...`` measures the given candidates the same way and
prints their medians instead of writing a table (how the defaults of ``knomial``'s ``k`` and
``ring_segmented``'s segment were chosen).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import random
import statistics
import sys
from dataclasses import dataclass, field

import numpy as np
from mpi4py import MPI

import mpiallreduce as mar

from . import algorithms, learn, select
from .decide import Verdict, decide, eligible
from .ops import reducer
from .sizes import UsageError, human, parse_sizes
from .topology import Topology

DEFAULT_SIZES = "8:64M"
DEFAULT_REPEATS = 5
#: a batch moves about this many bytes per rank (at least MIN_BATCH, at most MAX_BATCH runs).
BATCH_BYTES, MIN_BATCH, MAX_BATCH = 32 << 20, 3, 200


@dataclass(frozen=True)
class Candidate:
    """One thing to time: an algorithm name (or "native") and its parameters."""

    label: str
    algorithm: str
    params: dict = field(default_factory=dict)


def batch(size: int) -> int:
    """Return the runs per timed batch for ``size`` bytes."""
    return max(MIN_BATCH, min(MAX_BATCH, BATCH_BYTES // max(size, 1)))


def _add(inbuf, inoutbuf, datatype):
    # elementwise float64 add, declared non-commutative: the user-op path of every candidate
    a = np.frombuffer(inbuf, dtype=np.float64)
    b = np.frombuffer(inoutbuf, dtype=np.float64)
    np.add(a, b, out=b)


def candidates(op_class: str, one_node: bool = False) -> list[Candidate]:
    """Return every registered algorithm that accepts ``op_class``, native and the shared-memory
    transport (it keeps rank order; it refuses a communicator that spans nodes, and
    :func:`measure` leaves out what refuses), with defaults; on one node, not the algorithms
    made for several (:func:`mpiallreduce.decide.eligible`)."""
    names = [name for name, algorithm in algorithms.REGISTRY.items()
             if op_class == "commutative" or not algorithm.commutative_only]
    return [Candidate(name, name)
            for name in eligible(["native", "shm", *names], one_node=one_node)]


def interleaved(comm, calls: list, size: int, repeats: int) -> np.ndarray:
    """Time argument-free ``calls`` interleaved: the slowest rank's mean seconds per call of
    each, per round, an array ``(repeats, len(calls))``, the same on every rank (one
    collective, as auto's learning agrees on times). Collective.

    Each is called once first (pages in buffers and scratch, makes the connections); then
    every round times a batch of :func:`batch` calls of each, in a fresh order seeded by the
    round (the same on every rank: a rotated order ran each call right after the same other
    one every round, whose caches and pages it inherits), each batch after one untimed call
    (the caches back from the last one's, as learning warms each candidate; a one-shot call
    whose cached plan was evicted rebuilds it there, not in the batch)."""
    runs = batch(size)
    means = np.zeros((repeats, len(calls)))  # this rank's, per round and call
    for call in calls:
        call()
    for round_ in range(repeats):
        for index in random.Random(round_).sample(range(len(calls)), len(calls)):
            call = calls[index]
            call()
            comm.Barrier()
            start = MPI.Wtime()
            for _ in range(runs):
                call()
            means[round_, index] = (MPI.Wtime() - start) / runs
    return learn.slowest(comm, means)


def measure(comm, cands: list[Candidate], size: int, repeats: int, op=MPI.SUM,
            in_place: bool = False) -> dict[str, float]:
    """Return each candidate's median seconds per call at ``size`` bytes (float64), the same on
    every rank; candidates that refuse the case (ValueError from ``plan``) are left out."""
    return {label: statistics.median(times)
            for label, times in measure_rounds(comm, cands, size, repeats, op, in_place).items()}


def measure_rounds(comm, cands: list[Candidate], size: int, repeats: int, op=MPI.SUM,
                   in_place: bool = False) -> dict[str, list[float]]:
    """Return each candidate's seconds per call in every round (the slowest rank's) at
    ``size`` bytes (float64), the same on every rank; candidates that refuse the case
    (ValueError from ``plan``) are left out."""
    count = size // 8
    x = np.random.default_rng([comm.rank, count]).integers(-8, 9, count).astype(np.float64)
    # in place, zeros: each run's input is the last one's result, and zeros stay zeros
    recv = np.zeros_like(x) if in_place else x.copy()
    send = MPI.IN_PLACE if in_place else x
    plans = {}
    for cand in cands:
        try:
            plans[cand.label] = mar.plan(send, recv, op=op, comm=comm, algorithm=cand.algorithm,
                                         **cand.params)
        except ValueError:
            continue
    labels = list(plans)
    try:
        rounds = interleaved(comm, [plans[label].run for label in labels], size, repeats)
    finally:
        for plan in plans.values():
            plan.free()
    return {label: rounds[:, index].tolist() for index, label in enumerate(labels)}


def verdict(rounds: dict[str, list[float]], one_node: bool, incumbent: str = "native"
            ) -> Verdict:
    """The decision at one size: :func:`mpiallreduce.decide.decide` over each candidate's
    rounds, ``incumbent`` (what the built-in rules run there, :func:`incumbent`) to beat;
    native where the incumbent was not measured (it refused the case)."""
    return decide(rounds, incumbent if incumbent in rounds else "native", one_node=one_node)


def incumbent(nranks: int, size: int, op, in_place: bool, one_node: bool) -> str:
    """What ``auto`` runs at ``size`` bytes of float64 by the built-in rules alone: the choice
    a table entry replaces, as learning's incumbent is (so tune and learning ask the same
    question, and a size within the noise keeps what ``auto`` would run anyway)."""
    return select.rules_choice(nranks, size, reducer(op, np.dtype(np.float64)), in_place,
                               one_node)


def ranges(sizes: list[int], picks: list[str]) -> list[dict]:
    """Return the ranges of the decision table: the pick at each size, equal neighbours merged.

    The pick at size ``s`` covers ``[s, next measured size)``; the first range starts at 0
    and the last has no end (``max_bytes`` None).
    """
    ranges: list[dict] = []
    for index, (size, best) in enumerate(zip(sizes, picks)):
        if ranges and ranges[-1]["algorithm"] == best:
            ranges[-1]["max_bytes"] = None
        else:
            if ranges:
                ranges[-1]["max_bytes"] = size
            ranges.append({"min_bytes": 0 if index == 0 else size, "max_bytes": None,
                           "algorithm": best})
    return ranges


def tune(comm, sizes: list[int], repeats: int, out=None,
         modes: tuple[str, ...] = ("out",)) -> tuple[dict, dict]:
    """Measure both op classes over ``sizes`` in each of ``modes`` ("out": out of place, "in":
    in place, whose ranges the table keeps as the ``_in_place`` classes); return this
    communicator size's table and its provenance record (machine, date, command, the medians
    measured), as :func:`mpiallreduce.select.write_table` takes them."""
    out = sys.stdout if out is None else out
    classes, measured, verdicts = {}, {}, {}
    one_node = Topology.from_comm(comm).nnodes == 1  # collective, as every call here
    undecided = total = 0
    user_op = MPI.Op.Create(_add, commute=False)
    try:
        for op_class, op in (("commutative", MPI.SUM), ("noncommutative", user_op)):
            for mode in modes:
                name = op_class + ("_in_place" if mode == "in" else "")
                medians, picks = [], []
                for size in sizes:
                    rounds = measure_rounds(comm, candidates(op_class, one_node), size, repeats,
                                            op=op, in_place=mode == "in")
                    times = {label: statistics.median(t) for label, t in rounds.items()}
                    judged = verdict(rounds, one_node, incumbent(
                        comm.size, size, op, mode == "in", one_node))  # the same on every rank
                    medians.append(times)
                    picks.append(judged.pick)
                    verdicts.setdefault(name, {})[str(size)] = judged.text
                    total += 1
                    undecided += not judged.decided
                    if comm.rank == 0:
                        ranked = sorted(times, key=times.get)
                        print(f"# {name:>25} {human(size):>5}: " + ", ".join(
                            f"{label} {1e6 * times[label]:.1f}us" for label in ranked)
                            + f" -> {judged.text}", file=out, flush=True)
                classes[name] = ranges(sizes, picks)
                measured[name] = {str(size): {label: round(1e6 * t, 3)
                                              for label, t in m.items()}
                                  for size, m in zip(sizes, medians)}
    finally:
        user_op.Free()
    if comm.rank == 0 and undecided:
        print(f"# within noise at {undecided} of {total} size(s) and class(es): the table keeps "
              f"the built-in rules' choice there (more --repeats, or an idle machine, can tell "
              f"them apart)",
              file=out, flush=True)
    library = MPI.Get_library_version().strip().splitlines()[0].rstrip("\x00")
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    record = {
        "machine": f"{platform.node()}, {os.cpu_count()} cores, {library}",
        "date": date,
        "command": f"mpirun -n {comm.size} python -m mpi4py -m mpiallreduce.tune --sizes "
                   f"{human(sizes[0])}:{human(sizes[-1])} --repeats {repeats} "
                   f"--modes {','.join(modes)}",
        "measured": {"unit": "median us per call over interleaved rounds, slowest rank, "
                             "float64 (commutative: SUM; noncommutative: a user add)",
                     "load": load, **measured},
        "verdicts": verdicts,
    }
    table = {"nranks": comm.size, "provenance": f"tune-n{comm.size}", "classes": classes}
    return table, record


def _parse_candidate(text: str) -> Candidate:
    """``LABEL=ALGORITHM[:NAME=VALUE,...]`` (integer values) -> Candidate."""
    label, _, spec = text.partition("=")
    name, _, params = spec.partition(":")
    if not label or name not in mar.ALGORITHMS or name == "auto":
        raise SystemExit(f"--compare {text!r}: expected LABEL=ALGORITHM[:NAME=VALUE,...] with an "
                         f"algorithm of {', '.join(a for a in mar.ALGORITHMS if a != 'auto')}")
    values = {}
    for item in filter(None, params.split(",")):
        key, _, value = item.partition("=")
        values[key] = int(value)
    return Candidate(label, name, values)


def main(argv=None, comm=None, out=None) -> int:
    """Measure and write the table (or compare candidates); return the exit status."""
    comm = MPI.COMM_WORLD if comm is None else comm
    out = sys.stdout if out is None else out
    parser = argparse.ArgumentParser(prog="python -m mpiallreduce.tune", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default=DEFAULT_SIZES, metavar="MIN:MAX",
                        help=f"bytes per rank, every power of two (default: {DEFAULT_SIZES})")
    parser.add_argument("--repeats", type=int, default=DEFAULT_REPEATS, metavar="N",
                        help=f"interleaved rounds; the median is kept (default: {DEFAULT_REPEATS})")
    parser.add_argument("--output", metavar="PATH", default=None,
                        help="table file (default: $MPIALLREDUCE_TUNING, else "
                             f"{select.default_path()})")
    parser.add_argument("--compare", nargs="+", metavar="LABEL=ALGORITHM[:K=V,...]",
                        help="time these candidates and print medians; write no table")
    parser.add_argument("--in-place", action="store_true", help="with --compare: in place")
    parser.add_argument("--modes", default="out,in", metavar="out,in",
                        help="the table's modes: out of place, in place (its own ranges, "
                             "which auto follows for in-place calls); default: out,in")
    parser.add_argument("--export", choices=("openmpi-rules", "mpich-json"), default=None,
                        help="write the native sweep's strongest MPI configuration per size in "
                             "the MPI's own rules format (to --output, else stdout); time "
                             "nothing here (mpiallreduce.native_rules)")
    parser.add_argument("--from", dest="source", metavar="SWEEP.json", default=None,
                        help="with --export: scripts/native_sweep.py --json output (default: "
                             "run that sweep first)")
    parser.add_argument("--allow-reordering", action="store_true",
                        help="with --export openmpi-rules: name ring, segmented ring and "
                             "rabenseifner where they measured strongest, although Open MPI "
                             "then runs them for non-commutative ops too (default: the "
                             "built-in decision there)")
    args = parser.parse_args(argv)
    if args.export:
        from . import native_rules

        status = native_rules.main(args.export, args.source, args.output, out,
                                   args.allow_reordering) if comm.rank == 0 else 0
        comm.Barrier()  # the file is complete before any rank returns
        return status
    try:
        sizes = [s for s in parse_sizes(args.sizes) if s >= 8]  # float64 elements
    except UsageError as exc:
        parser.error(str(exc))
    if args.repeats < 1 or not sizes:
        parser.error("--repeats must be >= 1 and --sizes must include 8 bytes or more")
    if args.compare:
        cands = [_parse_candidate(text) for text in args.compare]
        for size in sizes:
            times = measure(comm, cands, size, args.repeats, in_place=args.in_place)
            if comm.rank == 0:
                best = min(times.values())
                print(f"{human(size):>5} " + "  ".join(
                    f"{c.label} {1e6 * times[c.label]:.1f}us ({times[c.label] / best:.2f})"
                    for c in cands if c.label in times), file=out, flush=True)
        return 0
    modes = tuple(mode.strip() for mode in args.modes.split(","))
    if not modes or set(modes) - {"out", "in"}:
        parser.error(f"--modes takes out, in or out,in; got {args.modes!r}")
    table, record = tune(comm, sizes, args.repeats, out, modes)
    path = args.output or select.table_path() or select.default_path()
    if comm.rank == 0:
        select.write_table(path, table, record)
        print(f"# wrote the table for {comm.size} rank(s) to {path}", file=out, flush=True)
    comm.Barrier()  # the file is complete before any rank returns
    return 0


if __name__ == "__main__":
    sys.exit(main())
