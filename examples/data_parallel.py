"""Data-parallel training of a small two-layer MLP in NumPy, gradients synchronised by mpiallreduce.

    mpirun -n 4 python -m mpi4py examples/data_parallel.py --sync bucketed --algorithm ring

Every rank generates the same synthetic binary-classification data set and trains on its block
of the samples; the synchronised gradient is the full-batch gradient, so training follows the
single-process full-batch run. ``--sync`` picks how gradients travel:

- ``plain``: one blocking ``allreduce`` per gradient array;
- ``bucketed``: :class:`mpiallreduce.GradSync`, buckets started during backprop (overlap);
- ``fp16`` / ``bf16``: the same with 16-bit words on the wire, float32 combines;
- ``topk``: top-k (10 %) with error feedback, values and indices exchanged with allgather;
- ``sharded``: ZeRO stage 1 (:class:`mpiallreduce.ShardedSGD`);
- ``async``: :class:`mpiallreduce.DelayedSync`, the averaged gradient applied one step late.

After every step all replicas must hold bit-identical parameters, and the final loss must be
within :data:`TOLERANCE` (relative) of the single-process full-batch run; otherwise the example
exits with status 1. Rank 0 prints time per step, bytes per rank per step and the final loss.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time

import numpy as np
from mpi4py import MPI

import mpiallreduce as mar
from mpiallreduce.partition import block

SYNCS = ("plain", "bucketed", "fp16", "bf16", "topk", "sharded", "async")
#: relative tolerance on the final loss against the single-process full-batch run. The exact
#: modes differ only in the order of additions; 16-bit casts perturb each gradient by ~u;
#: top-k and async follow another trajectory (async: the delayed full-batch run's, which is
#: also checked, to 1e-9, since every replica applies the same averaged gradient one step late).
TOLERANCE = {"plain": 1e-9, "bucketed": 1e-9, "sharded": 1e-9, "fp16": 1e-3, "bf16": 1e-2,
             "topk": 0.2, "async": 0.1}
#: tolerance of ``--sync async`` against the single-process run with the same one-step delay
DELAYED_TOLERANCE = 1e-9


def make_data(samples: int, features: int, seed: int = 0):
    """A linearly separable-ish problem: labels from a random hyperplane plus noise."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((samples, features))
    w = rng.standard_normal(features)
    y = (x @ w + 0.5 * rng.standard_normal(samples) > 0).astype(np.float64)
    return x, y


def init_params(features: int, hidden: int, seed: int = 1) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((features, hidden)) / np.sqrt(features),  # W1
            np.zeros(hidden),                                              # b1
            rng.standard_normal(hidden) / np.sqrt(hidden),                 # W2
            np.zeros(1)]                                                   # b2


def loss_sum(params, x, y) -> float:
    """Sum over the samples of the binary cross-entropy."""
    w1, b1, w2, b2 = params
    z = np.tanh(x @ w1 + b1) @ w2 + b2
    return float(np.sum(np.logaddexp(0, z) - y * z))


def backprop(params, x, y, total: int, grads, ready=None) -> None:
    """Write d(loss sum)/d(params) / total into ``grads``, last layer first; call ``ready(i)``
    as each gradient is final (the hook bucketed synchronisation starts buckets from)."""
    w1, b1, w2, b2 = params
    hidden = np.tanh(x @ w1 + b1)
    z = hidden @ w2 + b2
    dz = (1 / (1 + np.exp(-z)) - y) / total
    np.dot(hidden.T, dz, out=grads[2])
    grads[3][0] = dz.sum()
    if ready:
        ready(3)
        ready(2)
    dh = np.outer(dz, w2) * (1 - hidden * hidden)
    np.dot(x.T, dh, out=grads[0])
    np.sum(dh, axis=0, out=grads[1])
    if ready:
        ready(1)
        ready(0)


def reference_loss(args, x, y, delayed: bool = False) -> float:
    """The single-process full-batch run: same model, data, optimizer and steps (``delayed``:
    each gradient applied one step late, as ``--sync async`` does)."""
    params = init_params(args.features, args.hidden)
    grads = [np.empty_like(p) for p in params]
    optimizer = mar.SGD(args.lr, args.momentum)
    velocity = [np.zeros_like(p) for p in params]
    previous = None
    for _ in range(args.steps):
        backprop(params, x, y, len(y), grads)
        apply, previous = (previous, [g.copy() for g in grads]) if delayed else (grads, None)
        for p, g, v in zip(params, apply or (), velocity):
            optimizer.update(p, g, v)
    for p, g, v in zip(params, previous or (), velocity):
        optimizer.update(p, g, v)
    return loss_sum(params, x, y) / len(y)


class Trainer:
    """One ``--sync`` mode: ``step()`` computes the local gradients and updates the parameters."""

    def __init__(self, args, params, x, y, total, comm):
        self.args, self.params, self.x, self.y, self.total, self.comm = \
            args, params, x, y, total, comm
        self.grads = [np.empty_like(p) for p in params]
        self.optimizer = mar.SGD(args.lr, args.momentum)
        self.velocity = [np.zeros_like(p) for p in params]
        sync, algorithm = args.sync, args.algorithm
        self.sync = None
        if sync in ("bucketed", "fp16", "bf16", "topk"):
            compression = {"fp16": "fp16", "bf16": "bf16",
                           "topk": mar.TopK(args.topk_ratio)}.get(sync)
            self.sync = mar.GradSync(self.grads, comm, op=MPI.SUM, algorithm=algorithm,
                                     bucket_bytes=args.bucket_bytes, compression=compression)
        elif sync == "sharded":
            self.sync = mar.ShardedSGD(params, self.optimizer, comm, algorithm, op=MPI.SUM)
        elif sync == "async":
            self.sync = mar.DelayedSync(self.grads, comm, op=MPI.SUM, algorithm=algorithm,
                                        bucket_bytes=args.bucket_bytes)

    @property
    def payload_bytes(self) -> int:
        if self.sync is None:
            return sum(g.nbytes for g in self.grads)
        return self.sync.payload_bytes

    def _apply(self, grads) -> None:
        for p, g, v in zip(self.params, grads, self.velocity):
            self.optimizer.update(p, g, v)

    def step(self) -> None:
        sync, args = self.args.sync, self.args
        if sync in ("bucketed", "fp16", "bf16", "topk"):
            backprop(self.params, self.x, self.y, self.total, self.grads, self.sync.ready)
            self._apply(self.sync.wait())
            return
        backprop(self.params, self.x, self.y, self.total, self.grads)
        if sync == "plain":
            for g in self.grads:
                mar.allreduce(MPI.IN_PLACE, g, op=MPI.SUM, comm=self.comm,
                              algorithm=args.algorithm)
            self._apply(self.grads)
        elif sync == "sharded":
            self.sync.step(self.grads)
        else:  # async: apply the previous step's average while this step's is in flight
            previous = self.sync.step(self.grads)
            if previous is not None:
                self._apply(previous)

    def finish(self) -> None:
        if self.args.sync == "async":
            last = self.sync.flush()
            if last is not None:
                self._apply(last)
        if hasattr(self.sync, "free"):
            self.sync.free()


def identical_everywhere(comm, params) -> bool:
    digest = hashlib.sha256(b"".join(p.tobytes() for p in params)).digest()
    return len(set(comm.allgather(digest))) == 1


def parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sync", choices=SYNCS, default="plain")
    parser.add_argument("--algorithm", default="auto", choices=mar.ALGORITHMS)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--samples", type=int, default=1024)
    parser.add_argument("--features", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.5)
    parser.add_argument("--momentum", type=float, default=0.5)
    parser.add_argument("--bucket-bytes", type=int, default=4096,
                        help="bucket cap (small here so the tiny model has several buckets)")
    parser.add_argument("--topk-ratio", type=float, default=0.1)
    parser.add_argument("--quiet", action="store_true", help="print nothing (for the table)")
    return parser.parse_args(argv)


def main(argv=None) -> dict:
    """Train, check, print; return the summary. Exits with status 1 if a check fails."""
    args = parse(argv)
    comm = MPI.COMM_WORLD
    x, y = make_data(args.samples, args.features)
    lo, hi = block(args.samples, comm.Get_size(), comm.Get_rank())
    params = init_params(args.features, args.hidden)
    trainer = Trainer(args, params, x[lo:hi], y[lo:hi], args.samples, comm)
    identical = True
    elapsed = 0.0
    for _ in range(args.steps):
        comm.Barrier()
        t0 = time.perf_counter()
        trainer.step()
        elapsed += time.perf_counter() - t0
        identical = identical_everywhere(comm, params) and identical
    trainer.finish()
    identical = identical_everywhere(comm, params) and identical
    loss = comm.allreduce(loss_sum(params, x[lo:hi], y[lo:hi])) / args.samples
    reference = reference_loss(args, x, y)
    error = abs(loss - reference) / reference
    delayed_error = 0.0
    if args.sync == "async":
        delayed = reference_loss(args, x, y, delayed=True)
        delayed_error = abs(loss - delayed) / delayed
    summary = {"sync": args.sync, "algorithm": args.algorithm, "ranks": comm.Get_size(),
               "ms_per_step": 1e3 * comm.allreduce(elapsed, op=MPI.MAX) / args.steps,
               "bytes_per_step": trainer.payload_bytes, "loss": loss, "reference": reference,
               "relative_error": error, "tolerance": TOLERANCE[args.sync],
               "delayed_error": delayed_error, "identical": identical,
               "ok": identical and error <= TOLERANCE[args.sync]
               and delayed_error <= DELAYED_TOLERANCE}
    if comm.Get_rank() == 0 and not args.quiet:
        print(f"sync={args.sync} algorithm={args.algorithm} ranks={comm.Get_size()} "
              f"steps={args.steps}: {summary['ms_per_step']:.2f} ms/step, "
              f"{summary['bytes_per_step']} bytes/rank/step, final loss {loss:.6f} "
              f"(full-batch single process {reference:.6f}, relative difference {error:.1e}, "
              f"tolerance {TOLERANCE[args.sync]:g}"
              + (f"; from the delayed single-process run {delayed_error:.1e}"
                 if args.sync == "async" else "") + "); replicas bit-identical after every step: "
              f"{identical}")
    if not summary["ok"]:
        if comm.Get_rank() == 0:
            print(f"data_parallel: check failed: {summary}", file=sys.stderr)
        raise SystemExit(1)
    return summary


if __name__ == "__main__":
    main()
