#!/usr/bin/env python3
"""Run the benchmark at several rank counts; merge the runs into one JSON file and one plot.

    scripts/bench_sweep.py [--ranks 2 4 8] [--json sweep.json] [--plot sweep.png] [-- BENCH ARGS]

Each rank count is one `mpirun -n N python -m mpi4py -m mpiallreduce.bench --json ...` under
`timeout`, with the bench arguments after `--` passed through (e.g. `-- --sizes 8:1M`). The merged
file holds {"runs": [{"ranks": N, "status": rc, "meta": ..., "notes": ..., "rows": [...]}]}. The
exit status is 0 when every run exited 0, else the first non-zero status.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# Open MPI as root and with more ranks than cores, as the Makefile sets them.
MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "PRTE_MCA_rmaps_default_mapping_policy": ":oversubscribe"}


def run_one(mpirun: str, ranks: int, bench_args: list[str], json_path: pathlib.Path,
            timeout: float) -> int:
    """Run the bench on ``ranks`` ranks, its table going to our stdout; return its exit status."""
    command = [mpirun, "-n", str(ranks), sys.executable, "-m", "mpi4py", "-m",
               "mpiallreduce.bench", "--json", str(json_path), *bench_args]
    print(f"=== {' '.join(command)}", flush=True)
    env = {**MPI_ENV, **os.environ}
    try:
        return subprocess.run(command, env=env, cwd=ROOT, timeout=timeout).returncode
    except subprocess.TimeoutExpired:
        print(f"=== -n {ranks}: timed out after {timeout:g} s", flush=True)
        return 124


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8],
                        help="rank counts to run (default: 2 4 8)")
    parser.add_argument("--json", default="sweep.json", help="merged output (default: sweep.json)")
    parser.add_argument("--plot", default="sweep.png",
                        help="latency and busbw of every run; '' for none (default: sweep.png)")
    parser.add_argument("--mpirun", default=str(pathlib.Path(sys.executable).parent / "mpirun"),
                        help="launcher (default: the mpirun next to this Python)")
    parser.add_argument("--timeout", type=float, default=900,
                        help="seconds per rank count (default: 900)")
    parser.add_argument("bench_args", nargs=argparse.REMAINDER,
                        help="arguments for mpiallreduce.bench, after --")
    args = parser.parse_args(argv)
    bench_args = args.bench_args[1:] if args.bench_args[:1] == ["--"] else args.bench_args
    runs, status = [], 0
    with tempfile.TemporaryDirectory() as tmp:
        for ranks in args.ranks:
            path = pathlib.Path(tmp) / f"n{ranks}.json"
            rc = run_one(args.mpirun, ranks, bench_args, path, args.timeout)
            status = status or rc
            run = {"ranks": ranks, "status": rc}
            if path.exists():
                run.update(json.loads(path.read_text()))
            runs.append(run)
    with open(args.json, "w") as f:
        json.dump({"runs": runs}, f, indent=1)
        f.write("\n")
    print(f"=== wrote {args.json} ({len(runs)} runs)")
    measured = [(f" p={run['ranks']}", run["rows"]) for run in runs if run.get("rows")]
    if args.plot and measured:
        from mpiallreduce.bench import plot

        meta = next(run["meta"] for run in runs if run.get("rows"))
        plot(measured, args.plot, f"allreduce sweep over {', '.join(map(str, args.ranks))} ranks, "
                                  f"{meta['dtype']} {meta['op']}")
        print(f"=== wrote {args.plot}")
    return status


if __name__ == "__main__":
    sys.exit(main())
