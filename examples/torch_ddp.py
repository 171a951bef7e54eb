"""PyTorch DDP three ways: Gloo, the mpiallreduce hook, the hook with bfloat16 on the wire.

    mpirun -n 2 python -m mpi4py examples/torch_ddp.py [--hidden 2048] [--steps 20]

An MLP (``--inputs`` -> ``--hidden`` -> ``--hidden`` -> 10: 25 MB of float32 parameters with
the defaults) trained on synthetic data (each rank its own batch, the same on every run) with
``DistributedDataParallel`` (``gradient_as_bucket_view=True``: DDP copies no gradient into its
buckets and back): first with Gloo's all-reduce (DDP's own), then with
``mar.torch.allreduce_hook``, then with ``mar.torch.bf16_compress_hook``. The set-up is
``mar.torch.init_process_group()``: nothing to export. Prints the loss trajectory of each
(the mean loss over ranks per step), the median time per step, and checks:

- the hook's losses equal Gloo's bit for bit on 2 ranks (Gloo halves each gradient, then
  adds the halves; the hook adds, then halves: the same bits, halving being exact), within a
  relative 1e-5 elsewhere (the order of the additions differs);
- with bfloat16 on the wire, within a relative 2e-2 of Gloo's (8 bits of mantissa per partial
  sum, then a few steps of training on it).

Exits with 1 if a check fails. Needs ``pip install 'mpiallreduce[torch]'`` (torch 2.13.0).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from mpi4py import MPI

import mpiallreduce as mar

#: relative tolerance of each way's losses against Gloo's (the hook's: 0 on 2 ranks)
TOLERANCE = {"gloo": 0.0, "hook": 1e-5, "hook+bf16": 2e-2}
HOOKS = {"gloo": None, "hook": "allreduce_hook", "hook+bf16": "bf16_compress_hook"}


def build(inputs: int, hidden: int) -> torch.nn.Module:
    torch.manual_seed(0)  # the same initial parameters on every rank and every way
    return torch.nn.Sequential(torch.nn.Linear(inputs, hidden), torch.nn.ReLU(),
                               torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
                               torch.nn.Linear(hidden, 10))


def batches(comm, steps: int, batch: int, inputs: int):
    """This rank's synthetic batches: inputs, and labels from a fixed random linear rule."""
    g = torch.Generator().manual_seed(1 + comm.Get_rank())
    rule = torch.randn(inputs, 10, generator=torch.Generator().manual_seed(0))
    for _ in range(steps):
        x = torch.randn(batch, inputs, generator=g)
        yield x, (x @ rule).argmax(dim=1)


class Trainer:
    """One way of training: the model, its DDP wrapper (with a hook or not), the optimizer."""

    def __init__(self, way: str, args, comm):
        self.model = build(args.inputs, args.hidden)
        # the gradients are views of DDP's buckets (for Gloo too): DDP copies nothing into the
        # buckets and back, and the hook reduces each bucket in place
        self.ddp = torch.nn.parallel.DistributedDataParallel(self.model,
                                                             gradient_as_bucket_view=True)
        self.state = None
        if HOOKS[way] is not None:
            self.state = mar.torch.State(comm)
            self.ddp.register_comm_hook(self.state, getattr(mar.torch, HOOKS[way]))
        self.optimizer = torch.optim.SGD(self.ddp.parameters(), lr=args.lr, momentum=0.9)
        self.data = list(batches(comm, args.steps, args.batch, args.inputs))
        self.losses: list[float] = []
        self.times: list[float] = []

    def step(self, index: int) -> None:
        x, y = self.data[index]
        start = time.perf_counter()
        loss = forward_backward(self.ddp, self.optimizer, x, y)
        self.optimizer.step()
        self.times.append(time.perf_counter() - start)
        self.losses.append(loss.item())

    def free(self) -> None:
        if self.state is not None:
            self.state.free()


def forward_backward(net, optimizer, x, y, set_to_none: bool = True):
    """One step's gradients: zeroed, then the loss of ``net`` on ``(x, y)`` back-propagated
    (DDP reduces the gradients during it); returns the loss."""
    optimizer.zero_grad(set_to_none=set_to_none)
    loss = torch.nn.functional.cross_entropy(net(x), y)
    loss.backward()
    return loss


def timed_step(net, optimizer, batch, between=None) -> float:
    """Seconds of one training step on ``batch`` with zeroed gradients kept allocated (as the
    scripts that time steps run it): gradients, then ``between()`` if given (a reduction of
    the gradients outside DDP), then the optimizer's step."""
    start = time.perf_counter()
    forward_backward(net, optimizer, *batch, set_to_none=False)
    if between is not None:
        between()
    optimizer.step()
    return time.perf_counter() - start


def model_arguments(parser: argparse.ArgumentParser) -> None:
    """The model's and the data's options (scripts/torch_targets.py trains the same model)."""
    parser.add_argument("--inputs", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.01)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    model_arguments(parser)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args(argv)
    comm = MPI.COMM_WORLD
    if not torch.distributed.is_initialized():
        mar.torch.init_process_group(comm)
    trainers = {way: Trainer(way, args, comm) for way in TOLERANCE}
    # the ways interleaved step by step, so that the machine's load falls on each alike
    for index in range(args.steps):
        for trainer in trainers.values():
            comm.Barrier()
            trainer.step(index)
    # the mean loss over ranks, per step
    losses = {way: comm.allreduce(t.losses) for way, t in trainers.items()}
    losses = {way: [v / comm.Get_size() for v in
                    [sum(values[i::args.steps]) for i in range(args.steps)]]
              for way, values in losses.items()}
    ok = True
    if comm.Get_rank() == 0:
        nbytes = sum(p.numel() * p.element_size() for p in trainers["gloo"].model.parameters())
        print(f"# {comm.Get_size()} ranks, {nbytes / 1e6:.1f} MB of float32 parameters, "
              f"{args.steps} steps of batch {args.batch} per rank")
        print(f"{'way':10s} {'ms/step':>8s} {'/ gloo':>7s} {'first loss':>11s} {'last loss':>10s} "
              f"{'max rel. diff':>13s} {'tolerance':>9s}")
        base = statistics.median(trainers["gloo"].times[2:] or trainers["gloo"].times)
        for way, trainer in trainers.items():
            median = statistics.median(trainer.times[2:] or trainer.times)
            diff = max(abs(a - b) / abs(b) for a, b in zip(losses[way], losses["gloo"]))
            tolerance = 0.0 if way == "hook" and comm.Get_size() <= 2 else TOLERANCE[way]
            ok &= diff <= tolerance
            print(f"{way:10s} {median * 1e3:8.1f} {median / base:7.2f} {losses[way][0]:11.6f} "
                  f"{losses[way][-1]:10.6f} {diff:13.2e} {tolerance:9.0e}")
        print("same loss trajectory as Gloo within the tolerances:", ok)
    for trainer in trainers.values():
        trainer.free()
    return 0 if comm.bcast(ok) else 1


if __name__ == "__main__":
    raise SystemExit(main())
