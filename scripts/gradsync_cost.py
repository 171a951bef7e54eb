"""GradSync against the plain per-gradient loop over ``comm.Allreduce``: time per training step.

    mpirun -n 2 python -m mpi4py scripts/gradsync_cost.py [--case mlp|layers] [--features 512]
        [--hidden 1024] [--steps 30] [--rounds 3] [--bucket-bytes 4194304]

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
        for label, rounds in times.items():
            median = statistics.median(t for r in rounds for t in r)
            spread = max(max(r) / statistics.median(r) for r in rounds)
            print(f"{label:34s} {median * 1e3:8.2f} {median / base:8.2f} {spread:7.2f}")
        for label, sync in syncs.items():
            timed = ", ".join(f"{way}: {seconds * 1e3:.2f} ms" for way, seconds in sync.timed.items())
            print(f"# {label}: overlap_mode={sync.overlap_mode}, way={sync.way}"
                  f" (timed (way, overlap): {timed or '-'})")
    for sync in syncs.values():
        sync.free()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
