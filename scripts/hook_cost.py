"""Where the DDP hook's time goes: the bucket's reduction in parts, then DDP steps, one job.

    mpirun -n 2 python -m mpi4py scripts/hook_cost.py [--rounds 7] [--reps 5] [--steps 10]
        [--results NAME | --no-results]

Part 1, a bucket the size of the example model's large DDP bucket (6293504 float32, 25.2 MB),
every way ``--reps`` times per round, rounds interleaved, medians of the rounds' means:
``copy`` (one copy of the bucket: the memory's speed), ``divide`` (the division by p, out of
place), ``reduce`` (the persistent plan on the bucket, no division), ``divide+reduce`` (a
division pass, then the plan), ``hook`` (the hook called on the bucket, future waited; at p a
power of two it divides as it sums, ``mar.AVG``), ``hook as before`` (a division pass, then
the sum), ``hook, AVG to shared`` (tried: AVG from the bucket into a shared array, shm's
direct regime, two handshakes instead of two per 512 KiB chunk) and the division and sum a
piece at a time (``--piece`` bytes: divide a piece, reduce it while it is in cache).

Part 2, DDP steps of examples/torch_ddp.py's model, ``--steps`` steps per way per round,
interleaved one by one (``--ways``): ``local`` (no all-reduce), ``gloo``, ``nothing`` (a hook
that reduces nothing: DDP's bucket work and the hand-off to the communication thread),
``hook``, ``before`` (the hook dividing in a pass of its own), ``shared`` (AVG into a shared
array, the future's value); ``+view``: DDP with ``gradient_as_bucket_view=True`` (the
gradients are views of the buckets: no copy into them and back); ``+capN``:
``bucket_cap_mb=N``. Each step's ratio to Gloo's of the same cycle, medians.

``--results NAME`` (default ``hook_cost``; ``--results ''`` or ``--no-results`` writes none)
writes ``docs/results/NAME.json`` (``scripts/_results.py``) on rank 0: the DDP steps' table
(each way's ms and its ratios to the Gloo ways), or the bucket's where no steps ran, and the
bucket's times as values.
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
from mpi4py import MPI

import mpiallreduce as mar
import mpiallreduce.torch as mt
from mpiallreduce._checks import view

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "examples"))
from torch_ddp import batches, build, model_arguments, timed_step  # noqa: E402 - the example's model

LARGE = 2048 * 2048 + 2048 + 1024 * 2048  # the example's large bucket, float32 elements


class _Nothing(mt._Reduction):
    """A reduction that reduces nothing: the hook's hand-off and future alone."""

    def __init__(self, state, index, buffer, handed_over=False):
        self.state, self.index, self.buffer = state, index, buffer
        self.key = (buffer.data_ptr(), buffer.numel(), buffer.dtype)

    def start(self, buffer):
        return None

    def finish(self, request):
        return self.buffer

    def free(self):
        pass


class _SharedFolded(mt._Reduction):
    """AVG from the bucket into a shared array (shm's direct regime); the future's value."""

    def __init__(self, state, index, buffer, handed_over=False):
        self.state, self.index, self.buffer = state, index, buffer
        self.key = (buffer.data_ptr(), buffer.numel(), buffer.dtype)
        self.shared = mar.shared_empty(buffer.numel(), view(buffer.detach(), "b").dtype,
                                       comm=state.comm)
        self.payload = torch.from_numpy(self.shared)
        self.plan = mar.plan(view(buffer.detach(), "bucket"), self.shared, op=mar.AVG,
                             comm=state.comm, algorithm="shm")

    def start(self, buffer):
        return mt.start(self.plan)

    def finish(self, request):
        request.wait()
        return self.payload

    def free(self):
        self.plan.free()
        self.shared.free()


class _Before(mt._Reduction):
    """The hook as it was: divide the bucket in a pass of its own, then sum it in place."""

    def __init__(self, state, index, buffer, handed_over=False):
        super().__init__(state, index, buffer)
        if self.folded:
            self.plan.free()
            self.folded = False
            self.plan = mar.plan(MPI.IN_PLACE, view(buffer.detach(), "bucket"), comm=state.comm,
                                 algorithm=state.algorithm)


mt._KINDS["before"] = _Before
mt._KINDS["nothing"] = _Nothing
mt._KINDS["shared"] = _SharedFolded
HOOKS = {"nothing": mt._hook("nothing"), "hook": mt.allreduce_hook,
         "shared": mt._hook("shared"), "before": mt._hook("before")}


def timed(run, reps: int) -> float:
    start = time.perf_counter()
    for _ in range(reps):
        run()
    return (time.perf_counter() - start) / reps


def bucket_parts(args, comm) -> dict:
    p = comm.Get_size()
    state = mt.State(comm)
    source = torch.randn(LARGE, generator=torch.Generator().manual_seed(comm.Get_rank()))
    buffers = {name: source.clone() for name in ("reduce", "divide+reduce", "hook", "pieces")}
    other = torch.empty_like(source)
    plans = {name: mar.plan(MPI.IN_PLACE, view(buffers[name], "b"), comm=state.comm)
             for name in ("reduce", "divide+reduce")}
    piece = args.piece // 4
    pieces = [buffers["pieces"][lo:lo + piece] for lo in range(0, LARGE, piece)]
    piece_plans = [mar.plan(MPI.IN_PLACE, view(t, "b"), comm=state.comm) for t in pieces]

    def divide_reduce():
        buffers["divide+reduce"].div_(p)
        plans["divide+reduce"].run()

    def by_pieces():
        for t, plan in zip(pieces, piece_plans):
            t.div_(p)
            plan.run()

    bucket = mt.Bucket(0, buffers["hook"])
    before = mt.Bucket(1, buffers["reduce"].clone())
    shared = mt.Bucket(2, buffers["reduce"].clone())
    ways = {"copy": lambda: other.copy_(source),
            "divide": lambda: torch.div(source, p, out=other),
            "reduce": plans["reduce"].run,
            "divide+reduce": divide_reduce,
            "hook": lambda: mt.allreduce_hook(state, bucket).wait(),
            "hook as before": lambda: HOOKS["before"](state, before).wait(),
            "hook, AVG to shared": lambda: HOOKS["shared"](state, shared).wait(),
            f"pieces of {args.piece >> 10} KiB": by_pieces}
    times: dict = {name: [] for name in ways}
    for run in ways.values():
        run()
    for _ in range(args.rounds):
        for name, run in ways.items():
            comm.Barrier()
            times[name].append(timed(run, args.reps))
    for plan in (*plans.values(), *piece_plans):
        plan.free()
    state.free()
    return {name: statistics.median(values) for name, values in times.items()}


class Way:
    """One way of a DDP step of the example's model."""

    def __init__(self, name: str, args, comm):
        self.name = name
        self.model = build(args.inputs, args.hidden)
        self.net, self.state = self.model, None
        if name != "local":
            options = name.split("+")
            cap = [int(o[3:]) for o in options if o.startswith("cap")]
            self.net = torch.nn.parallel.DistributedDataParallel(
                self.model, gradient_as_bucket_view="view" in options,
                bucket_cap_mb=cap[0] if cap else None)
            hook = HOOKS.get(options[0])
            if hook is not None:
                self.state = mt.State(comm)
                self.net.register_comm_hook(self.state, hook)
        self.optimizer = torch.optim.SGD(self.net.parameters(), lr=args.lr)
        self.data = itertools.cycle(list(batches(comm, 4, args.batch, args.inputs)))

    def step(self) -> float:
        return timed_step(self.net, self.optimizer, next(self.data))


def steps(args, comm) -> dict:
    names = args.ways.split(",")
    ways = [Way(name, args, comm) for name in names]
    for way in ways:
        for _ in range(3):
            way.step()
    # interleaved step by step: the load falls on every way alike; each step's ratio to the
    # first way's step of the same cycle, then the median ratio
    times: dict = {way.name: [] for way in ways}
    for _ in range(args.rounds * args.steps):
        for way in ways:
            comm.Barrier()
            times[way.name].append(way.step())
    for way in ways:
        if way.state is not None:
            way.state.free()
    return {name: (statistics.median(values),
                   {other: statistics.median(a / b for a, b in zip(values, times[other]))
                    for other in times if other.startswith("gloo")})
            for name, values in times.items()}


def _key(name: str) -> str:
    """A value's name from a way's or a part's: ``hook+view`` -> ``hook_view``."""
    return "_".join("".join(c if c.isalnum() else " " for c in name.lower()).split())


#: what each DDP way is, for the result file's rows
WAY_TEXT = {"local": "no all-reduce (local)", "gloo": "Gloo (PyTorch's own)",
            "nothing": "a hook that reduces nothing", "hook": "`mpiallreduce.torch` hook",
            "before": "the hook dividing in a pass of its own",
            "shared": "the hook, AVG into a shared array"}


def mpirun_command(ranks: int) -> str:
    """The command that ran this script, as a reader would type it (the result's provenance)."""
    blas = os.environ.get("OPENBLAS_NUM_THREADS")
    prefix = f"OPENBLAS_NUM_THREADS={blas} " if blas else ""
    return prefix + f"mpirun -n {ranks} python -m mpi4py " + " ".join(sys.argv)


def write_results(args, comm, parts: dict, ddp: dict) -> None:
    """Write the reader's table (rank 0): DDP steps (or the bucket's parts) and the bucket's
    times as values."""
    from _results import write

    values = {f"bucket_{_key(name)}_ms": round(seconds * 1e3, 3)
              for name, seconds in parts.items()}
    if ddp:
        glooes = list(next(iter(ddp.values()))[1])
        columns = ["DDP step", "ms"] + [f"/ {g}" for g in glooes]
        rows = []
        for name, (seconds, ratios) in ddp.items():
            options = name.split("+")
            text = WAY_TEXT.get(options[0], options[0]) + "".join(
                ", gradient_as_bucket_view" if o == "view" else f", bucket_cap_mb={o[3:]}"
                for o in options[1:])
            rows.append([text, seconds * 1e3] + [ratios.get(g) for g in glooes])
            values.update({f"step_{_key(name)}_vs_{_key(g)}": round(ratios[g], 3)
                           for g in glooes if g != name})
        formats = ["{}", "{:.2f}"] + ["{:.2f}"] * len(glooes)
        title = "The DDP hook against Gloo: whole DDP steps of examples/torch_ddp.py's model"
        notes = (f"Steps interleaved one by one, {args.rounds} x {args.steps} per way; ms: median "
                 f"step; / gloo: median over cycles of the step's time over Gloo's of the same "
                 f"cycle; {torch.get_num_threads()} intra-op threads, OPENBLAS_NUM_THREADS="
                 f"{os.environ.get('OPENBLAS_NUM_THREADS', 'default')}; the values hold the "
                 f"25.2 MB bucket's parts (ms, medians of {args.rounds} rounds x {args.reps}).")
    else:
        columns, formats = ["bucket of 25.2 MB", "ms"], ["{}", "{:.2f}"]
        rows = [[name, seconds * 1e3] for name, seconds in parts.items()]
        title = "Where the DDP hook's time goes: one 25.2 MB bucket"
        notes = (f"float32, medians of {args.rounds} interleaved rounds' means of {args.reps} "
                 f"runs each.")
    path = write(args.results, title, columns=columns, rows=rows, formats=formats,
                 ranks=comm.Get_size(), values=values, notes=notes,
                 command=mpirun_command(comm.Get_size()))
    print(f"# wrote docs/results/{path.name}", flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--piece", type=int, default=1 << 20)
    parser.add_argument("--ways", default="local,gloo,gloo+view,nothing,nothing+view,hook,"
                        "hook+view")
    parser.add_argument("--parts", choices=("bucket", "steps", "both"), default="both")
    parser.add_argument("--results", default="hook_cost", metavar="NAME",
                        help="write docs/results/NAME.json ('' for none; default: hook_cost)")
    parser.add_argument("--no-results", dest="results", action="store_const", const="",
                        help="write no result file")
    model_arguments(parser)
    args = parser.parse_args(argv)
    comm = MPI.COMM_WORLD
    mt.init_process_group(comm)
    load = os.getloadavg()[0]
    parts = bucket_parts(args, comm) if args.parts != "steps" else {}
    ddp = steps(args, comm) if args.parts != "bucket" else {}
    if comm.Get_rank() == 0:
        print(f"# {comm.Get_size()} ranks, {torch.get_num_threads()} intra-op threads, "
              f"OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS', 'default')}, load "
              f"{load:.1f} -> {os.getloadavg()[0]:.1f}, {time.strftime('%H:%M', time.gmtime())} "
              f"UTC; {args.rounds} interleaved rounds, medians")
        for name, value in parts.items():
            print(f"bucket {LARGE * 4 / 1e6:.1f} MB {name:>20s} {value * 1e3:8.2f} ms")
        if ddp:
            print("# steps interleaved one by one; ratio: median over cycles of the step / "
                  "gloo's")
        for name, (value, ratios) in ddp.items():
            print(f"step {name:>20s} {value * 1e3:8.2f} ms  "
                  + "  ".join(f"{ratio:5.2f}x {g}" for g, ratio in ratios.items()))
        if args.results and (parts or ddp):
            write_results(args, comm, parts, ddp)
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
