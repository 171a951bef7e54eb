"""Issue 37's targets for PyTorch: the mpiallreduce hook and GradSync against Gloo, in one job.

    mpirun -n 2 python -m mpi4py scripts/torch_targets.py [--rounds 5] [--sizes 64K,1M,8M,64M]
        [--steps 10] [--hidden 2048]

Two parts, each in interleaved rounds (every way once per round, in turn), medians over rounds:

1. **The bucket all-reduce**: a float32 bucket of each size through
   ``mar.torch.allreduce_hook`` and through PyTorch's own ``allreduce_hook`` on Gloo (both
   divide by p and sum, as DDP does), ``--reps`` calls per round, future waited each time.
   Target: hook / Gloo <= 0.5 at 64 KiB-64 MiB.
2. **A training step** of examples/torch_ddp.py's model (``--hidden``), ``--steps`` steps per
   way per round: ``local`` (the model alone, no all-reduce: the compute), DDP on ``gloo``, DDP
   with the ``hook``, both again with ``gradient_as_bucket_view=True`` (``+view``: DDP's
   gradients are views of its buckets, so it copies nothing into them and back), and
   ``GradSync`` (the model alone, each parameter's gradient marked ready by a
   post-accumulate hook, ``overlap=True``, waited before the update), ``GradSync-serial``
   (the same with ``overlap=False``), both again with ``+views`` (the gradients views of the
   sync's buckets: ``GradSync(views=True)``) and ``plain`` (the loop GradSync replaces: after
   backward, ``comm.Allreduce(MPI.IN_PLACE, g)`` per gradient, then divided by p). Targets:
   hook step / Gloo step <= 0.7 (DDP's options alike for both); visible communication (step -
   local step) of GradSync <= 0.5x Gloo's; GradSync's step <= the plain loop's, with and
   without overlap. Each way first runs 3 untimed steps, and each GradSync as many more as it
   spends timing its ways (``packing="auto"``); the GradSync lines say which way it kept and
   what each cost while it timed them (``sync.timed``).

Prints the medians and ratios (rank 0; every rank's step ends together); says "target met" or
"target NOT met" per line. Set ``OPENBLAS_NUM_THREADS``/``OMP_NUM_THREADS`` as you measure
(torch's intra-op threads follow ``OMP_NUM_THREADS``).
"""

from __future__ import annotations

import argparse
import itertools
import os
import pathlib
import statistics
import sys
import time

import torch
import torch.distributed as dist
from mpi4py import MPI
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

import mpiallreduce as mar

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "examples"))
from torch_ddp import batches, build, model_arguments, timed_step  # noqa: E402 - the example's model

SIZES = {"64K": 64 << 10, "1M": 1 << 20, "8M": 8 << 20, "64M": 64 << 20}


def bucket_times(args, comm, state) -> dict:
    """Seconds per call, per (size, way): medians over rounds of each round's mean."""
    times: dict = {}
    buffers = {size: torch.ones(SIZES[size] // 4) for size in args.sizes}
    ways = {"hook": lambda b: mar.torch.allreduce_hook(state, b).wait(),
            "gloo": lambda b: default_hooks.allreduce_hook(None, b).wait()}
    for index, buffer in enumerate(buffers.values()):  # bind the plans, warm Gloo
        for run in ways.values():
            run(mar.torch.Bucket(index, buffer))
    for _ in range(args.rounds):
        for index, (size, buffer) in enumerate(buffers.items()):
            for way, run in ways.items():
                bucket = mar.torch.Bucket(index, buffer)
                comm.Barrier()
                start = time.perf_counter()
                for _ in range(args.reps):
                    run(bucket)
                times.setdefault((size, way), []).append((time.perf_counter() - start) / args.reps)
    return {key: statistics.median(values) for key, values in times.items()}


class Way:
    """One way of training the example's model; ``step()`` runs one step and times it."""

    def __init__(self, name, args, comm):
        self.name = name
        self.model = build(args.inputs, args.hidden)
        params = list(self.model.parameters())
        for p in params:  # gradients in fixed memory (GradSync binds to it)
            p.grad = torch.zeros_like(p)
        self.net, self.sync, self.state, self.plain = self.model, None, None, None
        if name.startswith(("gloo", "hook")):
            self.net = torch.nn.parallel.DistributedDataParallel(
                self.model, gradient_as_bucket_view=name.endswith("+view"))
        if name.startswith("hook"):
            self.state = mar.torch.State(comm)
            self.net.register_comm_hook(self.state, mar.torch.allreduce_hook)
        if name == "plain":  # the loop GradSync replaces: MPI's in-place Allreduce per gradient
            self.plain = [(p.grad.numpy(), comm) for p in params]
        if name.startswith("GradSync"):
            views = name.endswith("+views")
            self.sync = mar.GradSync([p.grad for p in params], comm, op=mar.AVG,
                                     overlap=not name.startswith("GradSync-serial"),
                                     views=views)
            if views:  # the gradients live in the sync's buckets
                for p, array in zip(params, self.sync.arrays):
                    p.grad = torch.from_numpy(array)
            for i, p in enumerate(params):
                p.register_post_accumulate_grad_hook(lambda _, i=i: self.sync.ready(i))
        self.optimizer = torch.optim.SGD(params, lr=args.lr)
        self.data = itertools.cycle(list(batches(comm, 4, args.batch, args.inputs)))

    def step(self) -> float:
        return timed_step(self.net, self.optimizer, next(self.data), self.reduce)

    def reduce(self) -> None:
        """The gradients' reduction outside DDP: GradSync's wait, or the plain loop."""
        if self.sync is not None:
            self.sync.wait()
        if self.plain is not None:
            for grad, comm in self.plain:
                comm.Allreduce(MPI.IN_PLACE, grad, MPI.SUM)
                grad /= comm.Get_size()

    def free(self):
        if self.state is not None:
            self.state.free()
        if self.sync is not None:
            self.sync.free()


def step_times(args, comm) -> dict:
    ways = [Way(name, args, comm)
            for name in ("local", "gloo", "hook", "gloo+view", "hook+view", "GradSync",
                         "GradSync-serial", "GradSync+views", "GradSync-serial+views", "plain")]
    for way in ways:  # DDP rebuilds its buckets after its first step; plans bind; GradSync
        for _ in range(3):  # times its ways (overlap, packing) and keeps one
            way.step()
        while way.sync is not None and way.sync.probing:
            way.step()
    chosen = {way.name: (way.sync.overlap_mode, way.sync.way, way.sync.timed)
              for way in ways if way.sync is not None}
    times: dict = {way.name: [] for way in ways}
    for _ in range(args.rounds):
        for way in ways:
            comm.Barrier()
            times[way.name].append(statistics.median(way.step() for _ in range(args.steps)))
    for way in ways:
        way.free()
    return {name: statistics.median(values) for name, values in times.items()}, chosen


def verdict(ratio: float, target: float) -> str:
    return "target met" if ratio <= target else "target NOT met"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--sizes", type=lambda s: s.split(","), default=list(SIZES))
    parser.add_argument("--steps", type=int, default=10)
    model_arguments(parser)
    args = parser.parse_args(argv)
    comm = MPI.COMM_WORLD
    mar.torch.init_process_group(comm)
    state = mar.torch.State(comm)
    load = os.getloadavg()[0]
    buckets = bucket_times(args, comm, state)
    steps, chosen = step_times(args, comm)
    state.free()
    if comm.Get_rank() == 0:
        threads = os.environ.get("OPENBLAS_NUM_THREADS", "default")
        print(f"# {comm.Get_size()} ranks, torch {torch.__version__} ({torch.get_num_threads()} "
              f"intra-op threads), OPENBLAS_NUM_THREADS={threads}, load {load:.1f} at the start, "
              f"{os.getloadavg()[0]:.1f} at the end; {args.rounds} interleaved rounds, medians")
        print(f"{'bucket (float32)':>16s} {'hook us':>10s} {'gloo us':>10s} {'hook/gloo':>9s}")
        for size in args.sizes:
            hook, gloo = buckets[size, "hook"], buckets[size, "gloo"]
            print(f"{size:>16s} {hook * 1e6:10.1f} {gloo * 1e6:10.1f} {hook / gloo:9.2f}  "
                  f"{verdict(hook / gloo, 0.5)} (<= 0.5)")
        nbytes = sum(p.numel() * 4 for p in build(args.inputs, args.hidden).parameters())
        print(f"# step of the example's MLP ({nbytes / 1e6:.1f} MB of parameters, batch "
              f"{args.batch} per rank), ms")
        for name, value in steps.items():
            print(f"{name:>16s} {value * 1e3:10.2f}")
        for suffix in ("", "+view"):
            ratio = steps["hook" + suffix] / steps["gloo" + suffix]
            print(f"hook{suffix} step / gloo{suffix} step = {ratio:.2f}  {verdict(ratio, 0.7)} "
                  f"(<= 0.7)")
        visible = {name: steps[name] - steps["local"] for name in ("gloo", "hook", "GradSync")}
        for name in ("hook", "GradSync"):
            ratio = visible[name] / visible["gloo"]
            print(f"visible communication, {name} / gloo = {visible[name] * 1e3:.2f} / "
                  f"{visible['gloo'] * 1e3:.2f} ms = {ratio:.2f}  {verdict(ratio, 0.5)} (<= 0.5)")
        for name in ("GradSync", "GradSync-serial", "GradSync+views", "GradSync-serial+views"):
            ratio = steps[name] / steps["plain"]
            overlap, packed, timed = chosen[name]
            timed = ", ".join(f"{way}: {seconds * 1e3:.2f}" for way, seconds in timed.items())
            print(f"{name} step / plain Allreduce loop step = {ratio:.2f}  "
                  f"{verdict(ratio, 1.0)} (<= 1.0)  [overlap_mode={overlap}, "
                  f"way={packed}; timed (way, overlap) ms: {timed or '-'}]")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
