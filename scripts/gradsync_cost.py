"""GradSync against the plain per-gradient loop over ``comm.Allreduce``: time per training step.

    mpirun -n 2 python -m mpi4py scripts/gradsync_cost.py [--case mlp|layers] [--features 512]
        [--hidden 1024] [--steps 30] [--rounds 3] [--bucket-bytes 4194304]
        [--results NAME | --no-results]

``--case mlp`` (the default): examples/data_parallel.py's model and data (a two-layer MLP;
512 x 1024 makes the gradients 4 MiB of float64). ``--case layers``: issue 37's case, two
``--hidden`` x ``--hidden`` float64 layers and their biases (512: 2 MiB each), the compute of a
step one matmul of that size, the gradients written after it in reverse order (last layer
first, as backprop does). In one job, every round runs ``--steps`` training steps of each
mode, interleaved: ``plain`` (backprop, then one ``comm.Allreduce(IN_PLACE, g)`` per gradient),
``GradSync`` (``overlap="auto"`` and ``packing="auto"``, the defaults: it times each way for a
few steps and keeps the fastest), ``GradSync overlap=False/True`` and ``packing=True/False``
forced. Prints, per mode, the median step time over
all rounds, its ratio to plain's median, and the spread (max / median over one round's steps,
the worst round). Run it with ``OPENBLAS_NUM_THREADS=1`` and without (BLAS at its default
thread count): issue 37's target is <= 1.0x plain in both, with and without overlap.
``--views``: each GradSync mode trains a model of its own whose gradients are the sync's views
of its buckets (``GradSync(views=True)``: nothing copied into the buckets or out).
``--results NAME`` (default ``gradsync_cost``; ``--results ''`` or ``--no-results`` writes
none) writes ``docs/results/NAME.json`` (``scripts/_results.py``) on rank 0: the table above,
with the case and ``OPENBLAS_NUM_THREADS`` in its notes.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys
import time

import numpy as np
from mpi4py import MPI

import mpiallreduce as mar
from mpiallreduce.grad import BUCKET_BYTES

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from data_parallel_table import load_example  # noqa: E402 - the example's loader, next to this


def mlp(args, comm):
    """The example's backprop: ``backprop(ready=None)`` writes ``backprop.grads``."""
    example = load_example()
    x, y = example.make_data(args.samples, args.features)
    lo, hi = mar.partition.block(len(y), comm.size, comm.rank)
    x, y = x[lo:hi], y[lo:hi]
    params = example.init_params(args.features, args.hidden)
    grads = [np.empty_like(p) for p in params]

    def backprop(ready=None):
        example.backprop(params, x, y, args.samples, grads, ready)
    backprop.grads = grads
    return backprop


def layers(args, comm):
    """Issue 37's case: two n x n float64 layers and their biases; a step's compute is one
    n x n matmul, then the gradients are written last layer first."""
    n = args.hidden
    rng = np.random.default_rng(comm.rank)
    a, b, product = rng.standard_normal((n, n)), rng.standard_normal((n, n)), np.empty((n, n))
    grads = [np.empty((n, n)), np.empty(n), np.empty((n, n)), np.empty(n)]

    def backprop(ready=None):
        np.matmul(a, b, out=product)
        for index in reversed(range(len(grads))):
            np.copyto(grads[index], product[:grads[index].shape[0]] if grads[index].ndim == 2
                      else product[0])
            if ready:
                ready(index)
    backprop.grads = grads
    return backprop


#: mode label -> the name of its ratio to plain in the result file's values
VALUE_NAMES = {"GradSync (overlap='auto')": "gradsync", "GradSync overlap=False": "overlap_false",
               "GradSync overlap=True": "overlap_true", "GradSync packing=True": "packing_true",
               "GradSync packing=False": "packing_false"}


def mpirun_command(ranks: int) -> str:
    """The command that ran this script, as a reader would type it (the result's provenance)."""
    blas = os.environ.get("OPENBLAS_NUM_THREADS")
    prefix = f"OPENBLAS_NUM_THREADS={blas} " if blas else ""
    return prefix + f"mpirun -n {ranks} python -m mpi4py " + " ".join(sys.argv)


def write_results(args, comm, table: list[list], gbytes: int, count: int, threads: str) -> None:
    """Write the reader's table (rank 0): per mode, ms per step, ratio to plain, spread."""
    from _results import write

    values = {VALUE_NAMES[label]: round(ratio, 3) for label, _, ratio, _ in table
              if label in VALUE_NAMES}
    rows = [[f"`{label}`" if label.startswith("GradSync") else label, ms, ratio, spread]
            for label, ms, ratio, spread in table]
    notes = (f"Case {args.case}{' with views=True' if args.views else ''}: gradients "
             f"{gbytes / 2**20:.1f} MiB of float64 in {count} arrays; median step over "
             f"{args.rounds} interleaved rounds x {args.steps} steps; spread: the worst round's "
             f"slowest step / its median; OPENBLAS_NUM_THREADS={threads}.")
    path = write(args.results, "GradSync against the plain per-gradient comm.Allreduce loop",
                 columns=["mode", "ms per step", "/ plain", "spread"], rows=rows,
                 formats=["{}", "{:.2f}", "{:.2f}", "{:.2f}"], ranks=comm.size, values=values,
                 notes=notes,
                 command=mpirun_command(comm.size))
    print(f"# wrote docs/results/{path.name}", flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", choices=("mlp", "layers"), default="mlp")
    parser.add_argument("--features", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--samples", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--bucket-bytes", type=int, default=BUCKET_BYTES)
    parser.add_argument("--views", action="store_true",
                        help="GradSync(views=True): the gradients are views of its buckets")
    parser.add_argument("--results", default="gradsync_cost", metavar="NAME",
                        help="write docs/results/NAME.json ('' for none; default: gradsync_cost)")
    parser.add_argument("--no-results", dest="results", action="store_const", const="",
                        help="write no result file")
    args = parser.parse_args(argv)
    comm = MPI.COMM_WORLD
    backprop = mlp(args, comm) if args.case == "mlp" else layers(args, comm)
    grads = backprop.grads

    def plain():
        backprop()
        for g in grads:
            comm.Allreduce(MPI.IN_PLACE, g, op=MPI.SUM)

    modes = {"plain comm.Allreduce loop": plain}
    syncs = {}
    for label, overlap, packing in (("GradSync (overlap='auto')", "auto", "auto"),
                                    ("GradSync overlap=False", False, "auto"),
                                    ("GradSync overlap=True", True, "auto"),
                                    ("GradSync packing=True", "auto", True),
                                    ("GradSync packing=False", "auto", False)):
        own = backprop
        if args.views:  # a backprop of its own, writing into the sync's views of its buckets
            own = mlp(args, comm) if args.case == "mlp" else layers(args, comm)
        sync = syncs[label] = mar.GradSync(own.grads, comm, op=MPI.SUM, overlap=overlap,
                                           bucket_bytes=args.bucket_bytes, views=args.views,
                                           packing=packing)
        own.grads[:] = sync.arrays

        def step(sync=sync, own=own):
            own(sync.ready)
            sync.wait()
        modes[label] = step
    times: dict[str, list[list[float]]] = {label: [] for label in modes}
    for label, step in modes.items():  # warm-up (plans bound, auto's probes decided)
        for _ in range(3):
            step()
        while label in syncs and syncs[label].probing:
            step()
    for _ in range(args.rounds):
        for label, step in modes.items():
            comm.Barrier()
            steps = []
            for _ in range(args.steps):
                t0 = time.perf_counter()
                step()
                steps.append(time.perf_counter() - t0)
            # every rank's step ends together; rank 0's clock is the step time
            times[label].append(steps)
    if comm.rank == 0:
        gbytes = sum(g.nbytes for g in grads)
        threads = os.environ.get("OPENBLAS_NUM_THREADS", "default")
        print(f"# case {args.case}, views={args.views}, load {os.getloadavg()[0]:.1f}; "
              f"{comm.size} ranks, "
              f"gradients {gbytes / 2**20:.1f} MiB in {len(grads)} arrays, "
              f"{args.rounds} rounds x {args.steps} steps, OPENBLAS_NUM_THREADS={threads}")
        base = statistics.median(t for r in times["plain comm.Allreduce loop"] for t in r)
        print(f"{'mode':34s} {'ms/step':>8s} {'/ plain':>8s} {'spread':>7s}")
        table = []
        for label, rounds in times.items():
            median = statistics.median(t for r in rounds for t in r)
            spread = max(max(r) / statistics.median(r) for r in rounds)
            print(f"{label:34s} {median * 1e3:8.2f} {median / base:8.2f} {spread:7.2f}")
            table.append([label, median * 1e3, median / base, spread])
        for label, sync in syncs.items():
            timed = ", ".join(f"{way}: {seconds * 1e3:.2f} ms" for way, seconds in sync.timed.items())
            print(f"# {label}: overlap_mode={sync.overlap_mode}, way={sync.way}"
                  f" (timed (way, overlap): {timed or '-'})")
        if args.results:
            write_results(args, comm, table, gbytes, len(grads), threads)
    for sync in syncs.values():
        sync.free()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
