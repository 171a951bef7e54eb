"""What a call costs against ``comm.Allreduce``: the bench's ``--api`` rows, medians of repeats.

    python scripts/call_cost.py [--ranks 2 4] [--sizes 8 64K 8M] [--repeat 3]
        [--algorithms native,recursive_doubling] [--trace]

For every rank count and size, runs ``python -m mpiallreduce.bench --api plan,call,...`` (every
call mode: plan, one-shot call with and without check, start, iallreduce, the drop-in's
Allreduce with and without check and its Allreduce_init)
``--repeat`` times under mpirun (a fresh job each time) and prints, per row, the median over the
repeats of its time / ``comm.Allreduce``'s time in the same run, with the spread (min-max).
``--trace`` runs the bench with ``--trace`` (its timed schedule runs recorded, the file
discarded): the cost of tracing, against the same untraced reference.
Needs the venv's mpirun (or one on PATH); sets Open MPI's variables for root and
oversubscription as the Makefile does.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
OPEN_MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
                "PRTE_MCA_rmaps_default_mapping_policy": ":oversubscribe",
                "OMPI_MCA_osc": "^ucx"}  # as the Makefile: osc/ucx prints errors here


def _mpirun() -> str:
    local = pathlib.Path(sys.executable).parent / "mpirun"
    return str(local) if local.exists() else (shutil.which("mpirun") or "mpirun")


def bench(ranks: int, size: str, algorithms: str, iterations: int | None, apis: str,
          trace: bool = False) -> list[dict]:
    """Run the bench once; return its rows."""
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "rows.json")
        command = [_mpirun(), "-n", str(ranks), sys.executable, "-m", "mpi4py", "-m",
                   "mpiallreduce.bench", "--sizes", f"{size}:{size}", "--algorithms", algorithms,
                   "--api", apis, "--quiet", "--json", out]
        if iterations:
            command += ["--iterations", str(iterations)]
        if trace:
            command += ["--trace", os.path.join(folder, "trace.json")]
        env = {**os.environ, **OPEN_MPI_ENV}
        subprocess.run(command, check=True, env=env, cwd=ROOT, timeout=900)
        with open(out) as f:
            return json.load(f)["rows"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--sizes", nargs="+", default=["8", "64K", "8M"])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--algorithms", default="native,auto,recursive_doubling")
    parser.add_argument("--iterations", type=int, default=None)
    parser.add_argument("--api", default="plan,call,call-nocheck,start,iallreduce,comm,comm-nocheck,"
                                         "comm-init",
                        help="the bench's --api modes to time (default: all of them)")
    parser.add_argument("--trace", action="store_true",
                        help="trace the timed runs (bench --trace): what tracing costs")
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    print(f"# time / comm.Allreduce (same run), median [min-max] of {args.repeat} runs"
          + (", schedules traced (bench --trace)" if args.trace else ""))
    print(f"# {'ranks':>5} {'size':>6} {'row':<34} {'ratio':>7}  spread          median us")
    for ranks in args.ranks:
        for size in args.sizes:
            runs = [bench(ranks, size, args.algorithms, args.iterations, args.api, args.trace)
                    for _ in range(args.repeat)]
            labels = [r["algorithm"] for r in runs[0]]
            for label in labels:
                ratios, times = [], []
                for rows in runs:
                    base = next(r["avg_us"] for r in rows if r["algorithm"] == "comm.Allreduce")
                    mine = next(r["avg_us"] for r in rows if r["algorithm"] == label)
                    ratios.append(mine / base)
                    times.append(mine)
                print(f"  {ranks:>5} {size:>6} {label:<34} {statistics.median(ratios):>7.2f}  "
                      f"[{min(ratios):.2f}-{max(ratios):.2f}]  {statistics.median(times):>12.2f}",
                      flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
