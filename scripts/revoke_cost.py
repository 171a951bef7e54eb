"""What revocation costs on the 8-byte path: this tree against another, at ``-n 2``.

    python scripts/revoke_cost.py --base /path/to/other/tree [--jobs 6] [--rounds 9]

The other tree is a checkout of another commit with its compiled module built in place
(``git worktree add /tmp/base <commit>``, then ``pip wheel --no-deps .`` there and its
``_compiled*.so`` copied into ``/tmp/base/mpiallreduce``). Each job (``mpirun -n 2``, one
tree's package first on ``PYTHONPATH``) times every row against ``comm.Allreduce`` of the same
8 bytes, block after block, in ``--rounds`` interleaved rounds, and prints the median ratio
per row; jobs of the two trees alternate, ``--jobs`` each. The table gives, per row, the median
over a tree's jobs of its in-job ratios, and the new tree's over the base's. Two processes
cannot import two versions of one package, so the trees never share a job: compare the ratios
(each to native, measured in its own job), not the times.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
OPEN_MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
                "PRTE_MCA_rmaps_default_mapping_policy": ":oversubscribe", "OMPI_MCA_osc": "^ucx"}


def rows(comm, mar, np):
    """(label, call) of every row; each reduces 8 bytes on ``comm``."""
    made = []

    def pair():
        made.append((np.array([1.0 + comm.rank]), np.empty(1)))
        return made[-1]

    table = []
    for algorithm in ("auto", "shm", "ring", "recursive_doubling", "native"):
        x, out = pair()
        table.append((f"mar.allreduce {algorithm}",
                      lambda x=x, out=out, a=algorithm: mar.allreduce(x, out, algorithm=a)))
        x, out = pair()
        plan = mar.plan(x, out, algorithm=algorithm)
        table.append((f"plan.run {algorithm}", plan.run))
    for algorithm in ("shm", "recursive_doubling"):
        x, out = pair()
        table.append((f"mar.allreduce {algorithm} timeout=60",
                      lambda x=x, out=out, a=algorithm: mar.allreduce(x, out, algorithm=a,
                                                                      timeout=60.0)))
    return table


def inner(rounds: int) -> None:
    """One job: every row's median ratio to ``comm.Allreduce`` over ``rounds`` rounds (JSON)."""
    import numpy as np
    from mpi4py import MPI

    import mpiallreduce as mar

    comm = MPI.COMM_WORLD
    x, out = np.array([1.0]), np.empty(1)
    table = rows(comm, mar, np)
    reference = lambda: comm.Allreduce(x, out)  # noqa: E731

    def block(call, iterations=2000) -> float:
        comm.Barrier()
        start = time.perf_counter()
        for _ in range(iterations):
            call()
        return comm.allreduce((time.perf_counter() - start) / iterations, op=MPI.MAX)

    for _, call in table:  # warm: every plan bound, every cache filled
        block(call, 200)
    ratios: dict = {label: [] for label, _ in table}
    for turn in range(rounds):
        for label, call in (table if turn % 2 == 0 else table[::-1]):
            ratios[label].append(block(call) / block(reference))
    if comm.rank == 0:
        print(json.dumps({label: statistics.median(values) for label, values in ratios.items()}))


def job(tree: pathlib.Path, rounds: int) -> dict:
    env = dict(os.environ, **OPEN_MPI_ENV, PYTHONPATH=str(tree))
    done = subprocess.run(["timeout", "600", str(ROOT / ".venv/bin/mpirun"), "-n", "2",
                           sys.executable, "-m", "mpi4py", __file__, "--inner",
                           "--rounds", str(rounds)],
                          env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", type=pathlib.Path, help="the other tree (built in place)")
    parser.add_argument("--jobs", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.inner:
        inner(args.rounds)
        return
    trees = {"base": args.base.resolve(), "this": ROOT}
    results: dict = {name: [] for name in trees}
    for turn in range(args.jobs):
        for name in (("base", "this") if turn % 2 == 0 else ("this", "base")):
            results[name].append(job(trees[name], args.rounds))
    load = os.getloadavg()
    print(f"# {args.jobs} jobs per tree at -n 2, {args.rounds} rounds each; load "
          f"{load[0]:.2f}; base {trees['base']}, this {trees['this']}")
    print(f"# {'row':<38} {'base/native':>12} {'this/native':>12} {'this/base':>10}")
    for label in results["this"][0]:
        base = statistics.median(result[label] for result in results["base"])
        this = statistics.median(result[label] for result in results["this"])
        spread = [result[label] for result in results["this"]]
        print(f"  {label:<38} {base:>12.3f} {this:>12.3f} {this / base:>10.3f}"
              f"   (this: {min(spread):.3f}-{max(spread):.3f})")


if __name__ == "__main__":
    main()
