"""Does ``auto`` with learning match the best algorithm on this machine?

    mpirun -n 2 python -m mpi4py scripts/auto_learn.py [--sizes 8,64,512,4K,32K,256K,2M,8M,64M]
        [--modes out,in] [--repeats 12] [--runs 5] [--json FILE] [--results NAME | --no-results]

For every size and mode, on a fresh duplicate of COMM_WORLD (nothing learned yet), with
learning at its defaults and no tuning table (``MPIALLREDUCE_TUNING=off``: the built-in rules
are the first guess, unedited): repeated ``mar.allreduce`` calls under ``auto`` (float64 SUM,
the same arrays every call) until the case is learned, counting the calls and their time. Then
``auto``'s call (now the winner's cached call) and a call of every algorithm by name
(``native``, ``shm`` on one node, every schedule; the same arrays, ``check=True`` as ``auto``'s),
and ``comm.Allreduce`` for reference, timed interleaved: rounds, each in a fresh order (seeded
alike on every rank), a batch of calls each after one untimed call, the slowest rank's mean,
the median over rounds.

Prints one row per size and mode: auto's time after learning, the best algorithm's (by name)
and their ratio (the target: <= 1.05), the picked algorithm's time by name over the best's
(``pick``: was the choice right?) and auto's over it (``a/pick``: from 256 KiB up, where a
call's path costs nothing next to the transfer, the same code timed twice, so the spread of
this column there is the timing's own noise; below, the calls take 1-15 us and which of two
sub-microsecond call paths runs faster moved between jobs), and ``held``: auto over the best by
name where the best is picked on the even rounds and both are timed on the odd ones (the least
of a dozen noisy medians is biased low, so ``ratio`` overstates auto's loss), what ``auto``
picked among which candidates, how many calls learning took, what they cost in all and beyond
the same number of the winner's calls (after one call of ``native`` and of ``shm`` by name: the
set-up any first call pays, learning or not, is not counted). Each row's ``auto`` result is
checked against ``comm.Allreduce``. Times are microseconds per call; rank 0 prints. The
machine's load is printed first: on a shared machine compare ratios within a run, never
absolute times between runs.

``--results NAME`` (default ``auto_learn``; ``--results ''`` or ``--no-results`` writes none)
writes ``docs/results/NAME.json`` (``scripts/_results.py``) on rank 0: per size, each mode's
auto / best and what auto picked, and the summary counts as values.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
from functools import partial

# learning at its defaults (on), no tuning table: the built-in rules, unedited, are the first
# guess; the kept picks are wherever MPIALLREDUCE_LEARNED says (the --launch driver gives each
# pair of jobs a fresh file)
os.environ["MPIALLREDUCE_TUNING"] = "off"

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

import mpiallreduce as mar  # noqa: E402
from mpiallreduce import algorithms, decide, learn, select, tune  # noqa: E402
from mpiallreduce.sizes import human, parse_sizes  # noqa: E402
from mpiallreduce.topology import Topology  # noqa: E402
from mpiallreduce.tune import interleaved  # noqa: E402

DEFAULT_SIZES = "8,64,512,4K,32K,256K,2M,8M,64M"
#: most calls a case may take to learn before the script gives up on it (a defect)
MOST_LEARNING_CALLS = 1000


def _learn(comm, send, out) -> tuple[int, float, dict]:
    """Call auto until the case is learned, back to back as a program's loop calls it; return
    the calls, their seconds (from a barrier to the last call, the slowest rank's) and the
    case's report. (No barrier between the calls: with one before each, learning's rounds
    spread 9-13% at 8 MiB on this machine and it kept shm within that noise in 3 of 8 fresh
    communicators, where back to back it picked the ring family, 10-33% faster, in 8 of 8.)"""
    calls = 0
    comm.Barrier()
    start = MPI.Wtime()
    while True:
        mar.allreduce(send, out, comm=comm)
        calls += 1
        (report,) = learn.learned(comm)
        if report["winner"] is not None or calls >= MOST_LEARNING_CALLS:
            return calls, comm.allreduce(MPI.Wtime() - start, op=MPI.MAX), report


#: the calls over which learning's cost is stated (the issue's job of 1,000 calls of a case),
#: and how many fresh communicators time it, alternating learning and the pick
JOB_CALLS, COST_REPEATS = 1000, 5


def _first_calls(world, send, out, calls: int, algorithm: str) -> tuple[float, float]:
    """Seconds of the first call of a case on a fresh communicator and of the ``calls - 1``
    after it (the slowest rank's), kept picks off: with ``auto``, learning from scratch; with a
    name, that algorithm from the start (its set-up included, as learning's candidates'
    are)."""
    comm = world.Dup()
    kept = os.environ.get("MPIALLREDUCE_LEARNED")
    os.environ["MPIALLREDUCE_LEARNED"] = "off"
    try:
        comm.Barrier()
        start = MPI.Wtime()
        mar.allreduce(send, out, comm=comm, algorithm=algorithm)
        first = MPI.Wtime() - start
        for _ in range(calls - 1):
            mar.allreduce(send, out, comm=comm, algorithm=algorithm)
        rest = MPI.Wtime() - start - first
        seconds = np.array([first, rest])
        comm.Allreduce(MPI.IN_PLACE, seconds, MPI.MAX)
        return tuple(seconds.tolist())
    finally:
        if kept is None:
            os.environ.pop("MPIALLREDUCE_LEARNED", None)
        else:
            os.environ["MPIALLREDUCE_LEARNED"] = kept
        comm.Free()


def learning_cost(world, send, out, pick: str, pick_seconds: float) -> float:
    """What learning costs a job of :data:`JOB_CALLS` calls of a case over calling ``pick``
    from the start: the first calls (as many as learning takes, and a few more) timed both
    ways on fresh communicators, alternating; the median difference of the calls after the
    first over the whole job's time (the calls after those run the pick either way). The first
    call is left out of the difference: it sets up the communicator either way (its duplicates,
    the node's shared-memory windows), which varies by milliseconds between fresh
    communicators, and learning runs none of it (a case's first call runs the rules' choice)."""
    calls = learn.calls_to_decide() + 2
    named, learned = [], []
    for repeat in range(COST_REPEATS):  # (each first every other time)
        for way in ("pick", "auto") if repeat % 2 == 0 else ("auto", "pick"):
            (named if way == "pick" else learned).append(
                _first_calls(world, send, out, calls, pick if way == "pick" else "auto"))
    extra = statistics.median(b[1] - a[1] for a, b in zip(named, learned))
    # the job calling the pick from the start: its first calls (set-up included), then the rest
    return extra / (statistics.median(sum(a) for a in named) + (JOB_CALLS - calls) * pick_seconds)


def _contenders(comm, send, out) -> dict:
    """auto and every algorithm by name that takes the call (each called once here)."""
    ways = {"auto": lambda: mar.allreduce(send, out, comm=comm),
            "comm.Allreduce": lambda: comm.Allreduce(send, out)}
    for name in ("native", "shm", *algorithms.REGISTRY):
        try:
            mar.allreduce(send, out, comm=comm, algorithm=name)
        except ValueError:
            continue  # refused on every rank alike (shm across nodes)
        ways[name] = partial(mar.allreduce, send, out, comm=comm, algorithm=name)
    return ways


def _time(comm, ways: dict, size: int, repeats: int) -> dict[str, list[float]]:
    """Each way's slowest-rank mean per round (:func:`mpiallreduce.tune.interleaved`: a fresh
    order each round and one untimed call before each batch; with a dozen ways on the same
    arrays the call cache (MPIALLREDUCE_CACHE_BYTES) cannot hold them all, and at 8 MiB a way
    it evicted took up to 8.2 ms on its next call where the one after took 0.9-1.0; with a
    rotated order auto, timed always after the same way, came out 1.12-1.22x its own pick by
    name at 64 MiB, 2026-12-04)."""
    labels = list(ways)
    rounds = interleaved(comm, [ways[label] for label in labels], size, repeats)
    return {label: rounds[:, index].tolist() for index, label in enumerate(labels)}


def _medians(samples: dict, rounds: slice = slice(None)) -> dict[str, float]:
    return {label: statistics.median(values[rounds]) for label, values in samples.items()}


def case(world, size: int, in_place: bool, repeats: int) -> dict:
    comm = world.Dup()  # nothing learned on it yet
    try:
        count = max(size // 8, 1)
        rng = np.random.default_rng([comm.rank, count])
        x = rng.integers(-8, 9, count).astype(np.float64)
        # in place, the buffer holds zeros: every call's input is its last result, and zeros
        # stay zeros (no overflow to inf over thousands of calls)
        out = np.zeros(count) if in_place else np.empty(count)
        send = MPI.IN_PLACE if in_place else x
        # what the first auto call on a communicator sets up with or without learning (the
        # duplicates, the topology, the node's window at this size), so that the learning
        # calls' cost is learning's own
        mar.allreduce(send, out, comm=comm, algorithm="native")
        with contextlib.suppress(ValueError):  # not on one node (every rank alike)
            mar.allreduce(send, out, comm=comm, algorithm="shm")
        calls, cost, report = _learn(comm, send, out)
        samples = _time(comm, _contenders(comm, send, out), size, repeats)
        times = _medians(samples)
        # auto's result after learning, against comm.Allreduce (the same on every rank)
        reference = np.empty_like(x)
        comm.Allreduce(x, reference)
        if in_place:
            out[:] = x
        else:
            out.fill(np.nan)
        mar.allreduce(send, out, comm=comm)
        if not comm.allreduce(bool(np.array_equal(out, reference)), op=MPI.LAND):
            raise SystemExit(f"auto's result differs from comm.Allreduce at {size} bytes")
        ours = {k: t for k, t in times.items() if k not in ("auto", "comm.Allreduce")}
        best = min(ours, key=ours.get)
        winner = report["winner"]
        one_node = Topology.from_comm(comm).nnodes == 1  # (collective)
        advice = _advice(samples, report, one_node, tune.incumbent(
            comm.size, size, MPI.SUM, in_place, one_node))
        # the least of a dozen noisy medians is biased low (the winner's curse): pick the best
        # by name on the even rounds, then time it and auto on the odd ones
        even, odd = _medians(samples, slice(0, None, 2)), _medians(samples, slice(1, None, 2))
        held = min((k for k in even if k not in ("auto", "comm.Allreduce")), key=even.get)
        return {"bytes": size, "mode": "in" if in_place else "out", "auto_us": 1e6 * times["auto"],
                "best": best, "best_us": 1e6 * ours[best], "ratio": times["auto"] / ours[best],
                "picked": winner, "candidates": report["candidates"],
                # the pick by name runs the same code as auto's call: their ratio is the noise
                "pick_us": 1e6 * ours.get(winner, times["auto"]),
                "held_out": {"best": held, "ratio": odd["auto"] / odd[held]},
                "learning_calls": report["learning_calls"], "calls": calls,
                "remembered": report["remembered"], "learning_ms": 1e3 * cost,
                "learning_extra_ms": 1e3 * (cost - calls * ours.get(winner, times["auto"])),
                "cost_1000": learning_cost(world, send, out, winner,
                                           ours.get(winner, times["auto"])),
                **advice,
                "comm_allreduce_us": 1e6 * times["comm.Allreduce"],
                "us": {k: round(1e6 * t, 2) for k, t in times.items()}}
    finally:
        comm.Free()


def _advice(samples: dict, report: dict, one_node: bool, ruled: str) -> dict:
    """What each advisor says at this row, with :func:`mpiallreduce.decide.decide` as each
    does: learning's own verdict (its rounds, the rules' choice the incumbent), tune's
    (:func:`mpiallreduce.tune.verdict` over the rounds of every algorithm by name here, the
    built-in rules' choice ``ruled`` the incumbent, as tune's) and the bench's advice (the
    same rounds with auto's call, auto the incumbent: a win names the algorithm to call
    instead of auto). They agree where every
    decided verdict names the same algorithm (auto's stands for what it learned); a verdict
    "within noise" says the measurement could not tell, and disagrees with nothing."""
    names = {k: v for k, v in samples.items() if k not in ("auto", "comm.Allreduce")}
    tuned = tune.verdict(names, one_node, ruled)
    benched = decide.decide({k: v for k, v in samples.items() if k != "comm.Allreduce"},
                            "auto", one_node=one_node)
    learned = report["winner"]
    said = {"learning": (learned, report["decided"] is not False),
            "tune": (tuned.pick, tuned.decided),
            "bench": (learned if benched.pick == "auto" else benched.pick, benched.decided)}
    decided = {pick for pick, sure in said.values() if sure}
    return {"tune": tuned.text, "bench": benched.text, "learning": report["verdict"],
            "picks": {who: pick for who, (pick, _) in said.items()},
            "agree": len(decided) <= 1}


def _size_text(size: int) -> tuple[str, str]:
    """(column text, value suffix): ``32768`` -> ``32 KiB``, ``32K``; ``8`` -> ``8 B``, ``8B``."""
    short = human(size)
    if short[-1].isalpha():
        return f"{short[:-1]} {short[-1]}iB", short
    return f"{size} B", f"{size}B"


def mpirun_command(ranks: int) -> str:
    """The command that ran this script, as a reader would type it (the result's provenance)."""
    return f"mpirun -n {ranks} python -m mpi4py " + " ".join(sys.argv)


def write_results(args, world, rows: list[dict]) -> None:
    """Write the reader's table (rank 0): one row per size, per mode auto / best and the pick."""
    from _results import write

    modes = list(dict.fromkeys(row["mode"] for row in rows))
    sizes = list(dict.fromkeys(row["bytes"] for row in rows))
    by = {(row["bytes"], row["mode"]): row for row in rows}
    place = {"out": "out of place", "in": "in place"}
    columns = ["size"]
    for mode in modes:
        columns += [f"auto / best, {place[mode]}", f"auto picked, {place[mode]}"]
    table, values = [], {}
    for size in sizes:
        text, key = _size_text(size)
        cells = [text]
        for mode in modes:
            row = by.get((size, mode))
            cells += [row["ratio"], row["picked"]] if row else [None, None]
            if row:
                values[f"{mode}_{key}"] = round(row["ratio"], 3)
        table.append(cells)
    n = len(rows)
    values["within_1_05"] = f"{sum(row['ratio'] <= 1.05 for row in rows)} of {n}"
    values["worst"] = round(max(row["ratio"] for row in rows), 3)
    values["held_within_1_05"] = f"{sum(row['held_out']['ratio'] <= 1.05 for row in rows)} of {n}"
    values["held_worst"] = round(max(row["held_out"]["ratio"] for row in rows), 3)
    values["most_learning_calls"] = max(row["learning_calls"] for row in rows)
    notes = (f"float64 SUM, learning at its defaults, no tuning table: auto's call after "
             f"learning over the fastest algorithm called by name, medians of {args.repeats} "
             f"interleaved rounds; 'auto picked': what learning kept.")
    path = write(args.results, "auto with learning against the best algorithm called by name",
                 columns=columns, rows=table, formats=["{}"] + ["{:.2f}", "{}"] * len(modes),
                 ranks=world.size, values=values, notes=notes,
                 command=mpirun_command(world.size))
    print(f"# wrote docs/results/{path.name}", flush=True)


def summary(rows: list[dict]) -> str:
    """One job against the targets, in words."""
    return (f"targets: auto within 1.05x of the best in "
            f"{sum(row['ratio'] <= 1.05 for row in rows)} of {len(rows)} rows (17 wanted); "
            f"learning, tune and the bench agree in {sum(row['agree'] for row in rows)} of "
            f"{len(rows)}; learning calls {sum(row['learning_calls'] for row in rows)} "
            f"({sum(bool(row['remembered']) for row in rows)} rows remembered); learning's "
            f"cost over 1,000 calls at most "
            f"{100 * max(row['cost_1000'] for row in rows):.1f}% (5% wanted)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default=DEFAULT_SIZES)
    parser.add_argument("--modes", default="out,in")
    # 12 rounds: with 6, auto against its own pick by name (the same code) spread past 5% in
    # up to 2 of the 8 rows from 256 KiB (2026-12-04), as much as the target it judges
    parser.add_argument("--repeats", type=int, default=12)
    parser.add_argument("--runs", type=int, default=None,
                        help="timed runs per candidate while learning (MPIALLREDUCE_LEARN_RUNS)")
    parser.add_argument("--json", default=None, help="write the rows here (rank 0)")
    parser.add_argument("--results", default="auto_learn", metavar="NAME",
                        help="write docs/results/NAME.json ('' for none; default: auto_learn)")
    parser.add_argument("--no-results", dest="results", action="store_const", const="",
                        help="write no result file")
    args = parser.parse_args(argv)
    if args.runs is not None:
        os.environ["MPIALLREDUCE_LEARN_RUNS"] = str(args.runs)
    world = MPI.COMM_WORLD
    sizes = [s for s in parse_sizes(args.sizes) if s >= 8]
    modes = [m.strip() for m in args.modes.split(",")]
    if world.rank == 0:
        load = os.getloadavg() if hasattr(os, "getloadavg") else None
        print(f"# {world.size} ranks, {os.cpu_count()} cores, load {load}, float64 SUM, "
              f"{args.repeats} interleaved rounds; learning: {select.learn_settings()}",
              flush=True)
        print(f"# {'size':>5} {'mode':>4} {'auto':>10} {'best':>10} {'ratio':>6} {'pick':>6} "
              f"{'a/pick':>6} {'held':>6}  "
              f"{'best is':<18} {'auto picked':<18} {'calls':>5} {'cost ms':>8} {'extra ms':>8}"
              f" {'/1000':>6} {'agree':>5}  candidates", flush=True)
    rows = []
    for size in sizes:
        for mode in modes:
            row = case(world, size, mode == "in", args.repeats)
            rows.append(row)
            if world.rank == 0:
                print(f"  {human(size):>5} {row['mode']:>4} {row['auto_us']:10.1f} "
                      f"{row['best_us']:10.1f} {row['ratio']:6.2f} "
                      f"{row['pick_us'] / row['best_us']:6.2f} {row['auto_us'] / row['pick_us']:6.2f} "
                      f"{row['held_out']['ratio']:6.2f}  "
                      f"{row['best']:<18} "
                      f"{row['picked']:<18} {row['learning_calls']:5d} "
                      f"{row['learning_ms']:8.1f} {row['learning_extra_ms']:8.1f} "
                      f"{100 * row['cost_1000']:5.1f}% {'yes' if row['agree'] else 'NO':>5}  "
                      f"{','.join(row['candidates'])}", flush=True)
                if not row["agree"]:
                    print(f"#   learning: {row['learning']}; tune: {row['tune']}; "
                          f"bench: {row['bench']}", flush=True)
    if world.rank == 0:
        within = sum(row["ratio"] <= 1.05 for row in rows)
        print(f"# auto within 1.05x of the best: {within} of {len(rows)} rows; worst "
              f"{max(row['ratio'] for row in rows):.2f}x; load now {os.getloadavg()}", flush=True)
        held = sum(row["held_out"]["ratio"] <= 1.05 for row in rows)
        print(f"# held out (best picked on the even rounds, auto and it timed on the odd): auto "
              f"within 1.05x in {held} of {len(rows)} rows; worst "
              f"{max(row['held_out']['ratio'] for row in rows):.2f}x", flush=True)
        picks = sum(row["pick_us"] <= 1.05 * row["best_us"] for row in rows)
        large = [row for row in rows if row["bytes"] >= 256 << 10]
        alike = sum(abs(row["auto_us"] / row["pick_us"] - 1) <= 0.05 for row in large)
        print(f"# auto's pick, called by name, within 1.05x of the best: {picks} of {len(rows)}; "
              f"from 256 KiB, auto within +-5% of its pick by name (the same code: the "
              f"timing's noise): {alike} of {len(large)}", flush=True)
        print(f"# {summary(rows)}", flush=True)
        if args.json:
            with open(args.json, "w", encoding="utf-8") as file:
                json.dump({"ranks": world.size, "rows": rows}, file, indent=1)
        if args.results and rows:
            write_results(args, world, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
