"""shm's small regime with its reduce in C against NumPy's ufunc calls, and MPI's Allreduce.

    mpirun -n 2 python -m mpi4py scripts/shm_small_cost.py [--sizes 256,1K,2K,4K,16K,64K,128K]
        [--rounds 5] [--dtype float64] [--results NAME | --no-results]

In one job, per size: a ``shm`` plan as the compiled call path binds it (load and reduce in
C for float32/float64), the same plan with its reduce left to NumPy's ufuncs (what every
small-regime run past 1 KiB did before 2026-12-04; bound by handing ``_compiled.SmallRun`` no
op name), and ``comm.Allreduce``; rounds whose order rotates, a batch of runs each, the slowest
rank's mean per round, medians over rounds in microseconds, and their ratios. Both plans'
results are checked against every rank's input summed in rank order with NumPy (shm's order;
MPI's may differ past 2 ranks). Needs the compiled form (``python -m mpiallreduce`` says).
``--results NAME`` (default ``shm_small_cost``; ``--results ''`` or ``--no-results`` writes
none) writes ``docs/results/NAME.json`` (``scripts/_results.py``) on rank 0: the table above.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from functools import partial

import numpy as np
from mpi4py import MPI

import mpiallreduce as mar
from mpiallreduce import _form
from mpiallreduce.sizes import parse_sizes


def _numpy_reduce(small_run):
    """``SmallRun`` with no op name: its load and reduce are the Python form's NumPy calls."""
    def bind(*args):
        return small_run(*args[:10], None, *args[11:])
    return bind


def _plan(x, y, comm, numpy_reduce: bool):
    compiled = _form.compiled.SmallRun
    if numpy_reduce:
        _form.compiled.SmallRun = _numpy_reduce(compiled)
    try:
        return mar.plan(x, y, MPI.SUM, comm, "shm")
    finally:
        _form.compiled.SmallRun = compiled


def _label(nbytes: int) -> tuple[str, str]:
    """(column text, value suffix) of a size: ``2048`` -> ``2 KiB``, ``2K``."""
    if nbytes >= 1024 and nbytes % 1024 == 0:
        return f"{nbytes >> 10} KiB", f"{nbytes >> 10}K"
    return f"{nbytes} B", f"{nbytes}B"


def mpirun_command(ranks: int) -> str:
    """The command that ran this script, as a reader would type it (the result's provenance)."""
    return f"mpirun -n {ranks} python -m mpi4py " + " ".join(sys.argv)


def write_results(opts, comm, table: list[list]) -> None:
    """Write the reader's table (rank 0): per size, the times and the two ratios."""
    from _results import write

    values = {}
    for label, _, _, numpy_ratio, native_ratio in table:
        key = _label(int(label))[1] if label.isdigit() else label
        values[f"c_vs_numpy_{key}"] = round(numpy_ratio, 3)
        values[f"c_vs_native_{key}"] = round(native_ratio, 3)
    for name, column in (("c_vs_numpy_range", 3), ("c_vs_native_range", 4)):
        ratios = [row[column] for row in table]
        values[name] = f"{min(ratios):.2f}-{max(ratios):.2f}"
    rows = [[_label(int(r[0]))[0]] + r[1:] for r in table]
    notes = (f"{opts.dtype} SUM, out of place: a shm plan's run with its reduce in C, and over "
             f"the same plan reducing with NumPy's ufuncs and over comm.Allreduce; medians of "
             f"{opts.rounds} rounds in rotating order (the slowest rank's mean per round).")
    path = write(opts.results, "shm's small regime: the reduce in C against NumPy and MPI",
                 columns=["size", "C reduce (us)", "comm.Allreduce (us)", "C / NumPy",
                          "C / comm.Allreduce"], rows=rows,
                 formats=["{}", "{:.2f}", "{:.2f}", "{:.2f}", "{:.2f}"], ranks=comm.size,
                 values=values, notes=notes,
                 command=mpirun_command(comm.size))
    print(f"# wrote docs/results/{path.name}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="256,1K,2K,4K,16K,64K,128K")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dtype", default="float64", choices=("float32", "float64"))
    parser.add_argument("--results", default="shm_small_cost", metavar="NAME",
                        help="write docs/results/NAME.json ('' for none; default: shm_small_cost)")
    parser.add_argument("--no-results", dest="results", action="store_const", const="",
                        help="write no result file")
    opts = parser.parse_args()
    comm = MPI.COMM_WORLD
    if _form.compiled is None:
        raise SystemExit("needs the compiled call path (python -m mpiallreduce says which runs)")
    if comm.rank == 0:
        print(f"# -n {comm.size}, {opts.dtype} SUM, {opts.rounds} rounds, load "
              f"{os.getloadavg()[0]:.2f}; medians in us (slowest rank's mean per round)")
        print(f"{'bytes':>8} {'C reduce':>9} {'NumPy':>9} {'native':>9} {'C/NumPy':>8} "
              f"{'C/native':>9}")
    table = []
    for nbytes in parse_sizes(opts.sizes):
        count = max(nbytes // np.dtype(opts.dtype).itemsize, 1)
        x = np.random.default_rng(comm.rank).random(count).astype(opts.dtype)
        outs = {name: np.empty_like(x) for name in ("C", "NumPy", "native")}
        plans = {"C": _plan(x, outs["C"], comm, False),
                 "NumPy": _plan(x, outs["NumPy"], comm, True)}
        runs = {"C": plans["C"].run, "NumPy": plans["NumPy"].run,
                "native": partial(comm.Allreduce, x, outs["native"])}
        batch = max(20, min(2000, (16 << 20) // (count * x.itemsize)))
        samples = {name: [] for name in runs}
        labels = list(runs)
        for name in labels:
            for _ in range(batch // 10 + 5):
                runs[name]()
        for round_ in range(opts.rounds):
            shift = round_ % len(labels)
            for name in labels[shift:] + labels[:shift]:
                comm.Barrier()
                start = MPI.Wtime()
                for _ in range(batch):
                    runs[name]()
                samples[name].append(comm.allreduce((MPI.Wtime() - start) / batch, op=MPI.MAX))
        for plan in plans.values():
            plan.free()
        every = comm.allgather(x)
        expected = every[0].copy()
        for theirs in every[1:]:
            np.add(expected, theirs, out=expected)
        same = all(np.array_equal(outs[name], expected) for name in ("C", "NumPy"))
        if not comm.allreduce(same, op=MPI.LAND):
            raise SystemExit(f"{nbytes} B: a result differs from the rank-order sum")
        med = {name: 1e6 * statistics.median(values) for name, values in samples.items()}
        if comm.rank == 0:
            print(f"{nbytes:>8} {med['C']:>9.2f} {med['NumPy']:>9.2f} {med['native']:>9.2f} "
                  f"{med['C'] / med['NumPy']:>8.2f} {med['C'] / med['native']:>9.2f}")
            table.append([str(nbytes), med["C"], med["native"], med["C"] / med["NumPy"],
                          med["C"] / med["native"]])
    if comm.rank == 0 and opts.results and table:
        write_results(opts, comm, table)


if __name__ == "__main__":
    main()
