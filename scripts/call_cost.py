"""What a call costs against ``comm.Allreduce``: the bench's ``--api`` rows, medians of repeats.

    python scripts/call_cost.py [--ranks 2 4] [--sizes 8 64K 8M] [--repeat 3]
        [--algorithms native,recursive_doubling] [--trace] [--results NAME | --no-results]

For every rank count and size, runs ``python -m mpiallreduce.bench --api plan,call,...`` (every
call mode: plan, one-shot call with and without check, start, iallreduce, the drop-in's
Allreduce with and without check and its Allreduce_init)
``--repeat`` times under mpirun (a fresh job each time; each job measures ``--rounds`` rounds
with every row interleaved, the bench's ``--repeat``, and reports each row's median) and
prints, per row, the median over the repeats of its time / ``comm.Allreduce``'s time in the same
run, with the spread (min-max). Then the ratios the non-blocking issue sets targets for, each
row over its reference in the same job (median [min-max] over the repeats): ``start`` over
``plan``, ``iallreduce`` over ``call``, the drop-in's ``comm`` over ``call`` (and without
check), and ``comm-init`` over plain ``comm.Allreduce_init``.
``--trace`` runs the bench with ``--trace`` (its timed schedule runs recorded, the file
discarded): the cost of tracing, against the same untraced reference.
``--results NAME`` (default ``call_cost``; ``--results ''`` or ``--no-results`` writes none)
writes ``docs/results/NAME.json`` (``scripts/_results.py``): per size, the one-shot call with and
without check, the plan's run and ``mar.Comm``'s ``Allreduce`` of ``auto`` (or the first
algorithm other than ``native``), each over ``comm.Allreduce`` (median over the repeats).
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


#: (row, reference row, target): the issue's ratios at 8 bytes, the row's ``/api`` suffix over
#: the reference's (``plan`` is the bare algorithm's row); the target for native and shared
#: memory first, for schedules second (None: no target, not printed; the drop-in's own
#: Allreduce_init is the default ``mar.Comm``'s)
PAIRS = (("start", "plan", (1.5, 2.0)), ("iallreduce", "call", (1.5, 2.0)),
         ("comm", "call", (1.3, 1.3)), ("comm-nocheck", "call-nocheck", (1.3, 1.3)),
         ("comm-init", "comm.Allreduce_init", (1.5, None)))
#: algorithms whose runs are MPI's own collective or the shared-memory transport
NATIVE_OR_SHM = ("native", "auto", "shm")
#: the call modes the result file keeps (``--results``), with how a reader writes each call
RESULT_MODES = (("call", "`mar.allreduce(x, out)` (defaults, check=True)", "allreduce"),
                ("call-nocheck", "`mar.allreduce(x, out, check=False)`", "allreduce_nocheck"),
                ("plan", "`mar.plan(x, out).run()`", "plan"),
                ("comm", "`mar.Comm(comm).Allreduce`", "comm"))


def _size_label(size: str) -> str:
    """``64K`` -> ``64 KiB``, ``8`` -> ``8 B``: a column head."""
    units = {"K": "KiB", "M": "MiB", "G": "GiB"}
    return f"{size[:-1]} {units[size[-1].upper()]}" if size[-1].upper() in units else f"{size} B"


def _size_key(size: str) -> str:
    """``64K`` -> ``64K``, ``8`` -> ``8B``: the suffix of a value's name."""
    return size.upper() if size[-1].isalpha() else f"{size}B"


def _row(rows: list[dict], algorithm: str, api: str) -> float | None:
    label = api if api.startswith("comm.") else (algorithm if api == "plan" else f"{algorithm}/{api}")
    return next((r["avg_us"] for r in rows if r["algorithm"] == label), None)


def bench(ranks: int, size: str, algorithms: str, iterations: int | None, apis: str,
          trace: bool = False, rounds: int = 1, dtype: str = "float32") -> list[dict]:
    """Run the bench once; return its rows."""
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "rows.json")
        command = [_mpirun(), "-n", str(ranks), sys.executable, "-m", "mpi4py", "-m",
                   "mpiallreduce.bench", "--sizes", f"{size}:{size}", "--algorithms", algorithms,
                   "--api", apis, "--quiet", "--json", out, "--dtype", dtype]
        if iterations:
            command += ["--iterations", str(iterations)]
        if trace:
            command += ["--trace", os.path.join(folder, "trace.json")]
        if rounds > 1:
            command += ["--repeat", str(rounds)]
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
    parser.add_argument("--dtype", default="float32",
                        help="the bench's element type (the non-blocking issue's table: float64)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="interleaved rounds per job (the bench's --repeat; default 3)")
    parser.add_argument("--api", default="plan,call,call-nocheck,start,iallreduce,comm,comm-nocheck,"
                                         "comm-init",
                        help="the bench's --api modes to time (default: all of them)")
    parser.add_argument("--trace", action="store_true",
                        help="trace the timed runs (bench --trace): what tracing costs")
    parser.add_argument("--results", default="call_cost", metavar="NAME",
                        help="write docs/results/NAME.json ('' for none; default: call_cost)")
    parser.add_argument("--no-results", dest="results", action="store_const", const="",
                        help="write no result file")
    args = parser.parse_args(argv)
    if args.repeat < 1 or args.rounds < 1:
        parser.error("--repeat and --rounds must be at least 1")
    print(f"# {args.dtype}; time / comm.Allreduce (same run), median [min-max] of {args.repeat} runs"
          + (", schedules traced (bench --trace)" if args.trace else ""))
    print(f"# {'ranks':>5} {'size':>6} {'row':<34} {'ratio':>7}  spread          median us")
    medians: dict[tuple[int, str, str], float] = {}
    for ranks in args.ranks:
        for size in args.sizes:
            runs = [bench(ranks, size, args.algorithms, args.iterations, args.api, args.trace,
                          args.rounds, args.dtype) for _ in range(args.repeat)]
            labels = [r["algorithm"] for r in runs[0]]
            for label in labels:
                ratios, times = [], []
                for rows in runs:
                    base = next(r["avg_us"] for r in rows if r["algorithm"] == "comm.Allreduce")
                    mine = next(r["avg_us"] for r in rows if r["algorithm"] == label)
                    ratios.append(mine / base)
                    times.append(mine)
                medians[ranks, size, label] = statistics.median(ratios)
                print(f"  {ranks:>5} {size:>6} {label:<34} {statistics.median(ratios):>7.2f}  "
                      f"[{min(ratios):.2f}-{max(ratios):.2f}]  {statistics.median(times):>12.2f}",
                      flush=True)
            _targets(ranks, size, args.algorithms.split(","), runs)
    if args.results:
        _write_results(args, medians)
    return 0


def _write_results(args, medians: dict[tuple[int, str, str], float]) -> None:
    """Write the reader's table: per rank count and call mode, each size's ratio."""
    from _results import write

    algorithms = [a for a in args.algorithms.split(",") if a != "native"]
    algorithm = "auto" if "auto" in algorithms else (algorithms[0] if algorithms else "native")
    modes = [m for m in RESULT_MODES if m[0] in args.api.split(",")]
    rows, values = [], {}
    for ranks in args.ranks:
        for mode, text, key in modes:
            label = mode if mode.startswith("comm.") else (
                algorithm if mode == "plan" else f"{algorithm}/{mode}")
            cells = [medians.get((ranks, size, label)) for size in args.sizes]
            if all(c is None for c in cells):
                continue
            head = text if algorithm == "auto" else f"{text} ({algorithm})"
            rows.append(([f"{head}, {ranks} ranks"] if len(args.ranks) > 1 else [head]) + cells)
            if ranks == args.ranks[0]:
                values.update({f"{key}_{_size_key(size)}": round(c, 3)
                               for size, c in zip(args.sizes, cells) if c is not None})
    columns = ["time / comm.Allreduce"] + [_size_label(s) for s in args.sizes]
    notes = (f"Each call's time over comm.Allreduce's in the same job ({algorithm}, {args.dtype} "
             f"SUM, out of place), median over {args.repeat} jobs of {args.rounds} interleaved "
             f"rounds each" + ("; the timed runs traced" if args.trace else "") + ".")
    path = write(args.results, "What one call costs against comm.Allreduce", columns=columns,
                 rows=rows, formats=["{}"] + ["{:.2f}"] * len(args.sizes),
                 ranks=args.ranks[0] if len(args.ranks) == 1 else ", ".join(map(str, args.ranks)),
                 values=values, notes=notes)
    print(f"# wrote {path.relative_to(path.parent.parent.parent)}")


def _targets(ranks: int, size: str, algorithms: list[str], runs: list[list[dict]]) -> None:
    """Print each PAIRS ratio (row over reference, same job) with its target."""
    print(f"# {'ranks':>5} {'size':>6} {'ratio (same job)':<44} {'ratio':>7}  spread        target")
    for algorithm in algorithms:
        for api, reference, (mine, schedule) in PAIRS:
            target = mine if algorithm in NATIVE_OR_SHM else schedule
            ratios = []
            if target is None:
                continue
            for rows in runs:
                top, bottom = _row(rows, algorithm, api), _row(rows, algorithm, reference)
                if top is not None and bottom:
                    ratios.append(top / bottom)
            if not ratios:
                continue
            median = statistics.median(ratios)
            label = f"{algorithm} {api} / {reference}"
            print(f"  {ranks:>5} {size:>6} {label:<44} {median:>7.2f}  "
                  f"[{min(ratios):.2f}-{max(ratios):.2f}]  <= {target:.1f} "
                  f"{'met' if median <= target else 'MISSED'}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
