#!/usr/bin/env python3
"""Our best algorithm against the strongest native configuration, and the local memory floor.

    scripts/native_sweep.py [--ranks 2] [--sizes 8,64K,8M,64M] [--repeats 3] [--json FILE]
                            [--results NAME | --no-results] [-- BENCH ARGS]

Runs ``python -m mpiallreduce.bench`` (float64 SUM, every algorithm) under ``mpirun`` once per
native configuration, out of place and in place, ``--repeats`` times:

- Open MPI: its default choice, and coll/tuned forced to allreduce algorithm 4 (ring), 5
  (segmented ring, with 256 KiB, 1 MiB and 4 MiB segments) and 6 (Rabenseifner), through
  ``OMPI_MCA_coll_tuned_use_dynamic_rules=1 OMPI_MCA_coll_tuned_allreduce_algorithm=N
  [OMPI_MCA_coll_tuned_allreduce_algorithm_segmentsize=S]``;
- MPICH (only when mpi4py runs on MPICH): the default and each
  ``MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM`` choice in :data:`MPICH_CHOICES`.

Per size and mode it prints the strongest native configuration (lowest median time), our best
algorithm measured in the same runs and its ratio (ours / native: below 1 is faster than the
strongest native), and the local memory floor: the copies and combines a bandwidth-optimal
allreduce cannot avoid on a single-copy transport, (p-1)/p·n elements received and reduced
(reduce-scatter) and (p-1)/p·n received (allgather), i.e. two copies and one add of
(p-1)/p·n elements, NumPy on every rank at once after a barrier (the slowest rank's median).
Times are medians over the repeats. On a shared machine the numbers are noisy: rerun before
believing a single row.

``--results NAME`` (default ``native_sweep``; ``--results ''`` or ``--no-results`` writes none,
and a run under pytest writes none unless named) writes ``docs/results/NAME.json``
(``scripts/_results.py``): per size and mode our best algorithm over Open MPI's (or MPICH's)
default and over the strongest native configuration.

Exit status: 0, or the first non-zero status of a bench run.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent

# Open MPI as root and with more ranks than cores, as the Makefile sets them.
MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "PRTE_MCA_rmaps_default_mapping_policy": ":oversubscribe",
           "OMPI_MCA_osc": "^ucx"}  # as the Makefile: osc/ucx prints errors on shm's windows
_TUNED = {"OMPI_MCA_coll_tuned_use_dynamic_rules": "1"}
#: label -> environment of each Open MPI configuration.
OPEN_MPI_CONFIGS = {
    "default": {},
    "tuned 4 (ring)": {**_TUNED, "OMPI_MCA_coll_tuned_allreduce_algorithm": "4"},
    **{f"tuned 5 (seg. ring {label})": {
        **_TUNED, "OMPI_MCA_coll_tuned_allreduce_algorithm": "5",
        "OMPI_MCA_coll_tuned_allreduce_algorithm_segmentsize": str(size)}
       for label, size in (("256K", 262144), ("1M", 1048576), ("4M", 4194304))},
    "tuned 6 (rabenseifner)": {**_TUNED, "OMPI_MCA_coll_tuned_allreduce_algorithm": "6"},
}
#: MPICH's intra-communicator allreduce algorithms (MPICH 4.x names).
MPICH_CHOICES = ("recursive_doubling", "reduce_scatter_allgather", "ring", "tree", "recexch",
                 "k_reduce_scatter_allgather")
DEFAULT_SIZES = "8,64K,8M,64M"


def mpi_library(python: str) -> str:
    """Return the MPI library string mpi4py reports, from a separate process."""
    code = "from mpi4py import MPI; print(MPI.Get_library_version().splitlines()[0])"
    result = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=120,
                            env=launcher_env())
    return result.stdout.strip()


def configs(library: str) -> dict[str, dict[str, str]]:
    """Return label -> environment of every native configuration to try under ``library``."""
    if "MPICH" in library:
        return {"default": {}, **{f"mpich {name}": {"MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM": name}
                                  for name in MPICH_CHOICES}}
    return dict(OPEN_MPI_CONFIGS)


def launcher_env(extra: dict | None = None) -> dict:
    """Our environment without what a launcher gave it (or earlier forced settings), plus ``extra``."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "PMIX_", "PRTE_", "OPAL_", "MPIR_CVAR_"))}
    return {**env, **MPI_ENV, **(extra or {})}


def run_bench(mpirun: str, ranks: int, sizes: str, in_place: bool, env: dict, bench_args,
              timeout: float) -> tuple[int, list[dict]]:
    """Run the bench once; return (exit status, its JSON rows)."""
    with tempfile.TemporaryDirectory() as folder:
        out = pathlib.Path(folder) / "rows.json"
        command = [mpirun, "-n", str(ranks), sys.executable, "-m", "mpi4py", "-m",
                   "mpiallreduce.bench", "--dtype", "float64", "--sizes", sizes, "--quiet",
                   "--json", str(out), *(["--in-place"] if in_place else []), *bench_args]
        try:
            status = subprocess.run(command, env=launcher_env(env), cwd=ROOT,
                                    timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            return 124, []
        rows = json.loads(out.read_text())["rows"] if out.exists() else []
    return status, rows


def floor_worker(sizes: list[int], repeats: int) -> None:
    """Under mpirun: time the floor's copies and add on every rank at once; rank 0 prints JSON."""
    import numpy as np
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    result = {}
    for size in sizes:
        count = max(1, (comm.size - 1) * (size // 8) // comm.size)
        source, received, block, result_part = (np.ones(count) for _ in range(4))
        runs = max(3, min(200, (32 << 20) // size))
        samples = []
        for _ in range(max(repeats, 3)):
            comm.Barrier()
            start = MPI.Wtime()
            for _ in range(runs):
                np.copyto(received, source)          # reduce-scatter: the peers' blocks arrive
                np.add(block, received, out=block)   # and are combined into ours
                np.copyto(result_part, source)       # allgather: the others' results arrive
            samples.append(comm.allreduce((MPI.Wtime() - start) / runs, op=MPI.MAX))
        result[size] = 1e6 * statistics.median(samples)
    if comm.rank == 0:
        print(json.dumps(result))


def measure_floor(mpirun: str, ranks: int, sizes: list[int], repeats: int,
                  timeout: float) -> dict[int, float]:
    command = [mpirun, "-n", str(ranks), sys.executable, str(pathlib.Path(__file__).resolve()),
               "--floor-worker", "--sizes", ",".join(map(str, sizes)), "--repeats", str(repeats)]
    result = subprocess.run(command, env=launcher_env(), cwd=ROOT, capture_output=True, text=True,
                            timeout=timeout)
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    return {int(k): v for k, v in json.loads(lines[-1]).items()} if lines else {}


def summarise(rows_by_config: dict[str, list[list[dict]]]) -> dict[int, dict]:
    """Return size -> the strongest native config and our best algorithm in those same runs."""
    medians: dict[str, dict[int, dict[str, float]]] = {}
    for config, runs in rows_by_config.items():
        samples: dict[tuple[int, str], list[float]] = {}
        for rows in runs:
            for row in rows:
                if row["check"] != "FAIL":
                    samples.setdefault((row["size"], row["algorithm"]), []).append(row["avg_us"])
        for (size, algorithm), times in samples.items():
            medians.setdefault(config, {}).setdefault(size, {})[algorithm] = statistics.median(times)
    summary = {}
    sizes = sorted({size for by_size in medians.values() for size in by_size})
    for size in sizes:
        natives = {c: m[size]["native"] for c, m in medians.items() if "native" in m.get(size, {})}
        if not natives:
            continue
        config = min(natives, key=natives.get)
        # auto is not one of ours here: below its crossover it is native itself (in a forced
        # configuration's run, that configuration), so it is reported against native instead
        ours = {a: t for a, t in medians[config][size].items() if a not in ("native", "auto")}
        best = min(ours, key=ours.get) if ours else None
        autos = {c: m[size]["auto"] / m[size]["native"] for c, m in medians.items()
                 if "auto" in m.get(size, {}) and "native" in m[size]}
        summary[size] = {"native_config": config, "native_us": natives[config],
                         "natives_us": natives, "ours": best,
                         "ours_us": ours.get(best), "default_native_us": natives.get("default"),
                         "auto_vs_native": autos,
                         "medians_us": {c: m.get(size, {}) for c, m in medians.items()}}
    return summary


def human(size: int) -> str:
    for suffix, unit in (("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if size >= unit and size % unit == 0:
            return f"{size // unit}{suffix}"
    return str(size)


def table(results: dict[str, dict[int, dict]], floor: dict[int, float]) -> list[str]:
    """Return the printed table: one line per size and mode."""
    lines = [f"{'size':>6} {'mode':<8} {'strongest native':<26} {'native us':>10} "
             f"{'our best':<20} {'ours us':>10} {'ratio':>6} {'vs default':>10} {'floor us':>9} "
             f"{'auto/native worst':>17}"]
    for mode, summary in results.items():
        for size, s in sorted(summary.items()):
            ratio = f"{s['ours_us'] / s['native_us']:.2f}" if s["ours"] else "-"
            ours = f"{s['ours_us']:.1f}" if s["ours"] else "-"
            low = f"{floor[size]:.1f}" if size in floor else "-"
            default = s.get("default_native_us")
            versus = f"{s['ours_us'] / default:.2f}" if s["ours"] and default else "-"
            autos = s.get("auto_vs_native") or {}
            worst = f"{max(autos.values()):.2f}" if autos else "-"
            lines.append(f"{human(size):>6} {mode:<8} {s['native_config']:<26} "
                         f"{s['native_us']:>10.1f} {s['ours'] or '-':<20} {ours:>10} {ratio:>6} "
                         f"{versus:>10} {low:>9} {worst:>17}")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2, help="ranks (default: 2)")
    parser.add_argument("--sizes", default=DEFAULT_SIZES,
                        help=f"bench --sizes, a comma list allowed (default: {DEFAULT_SIZES})")
    parser.add_argument("--repeats", type=int, default=3, help="runs per configuration and mode; "
                        "medians are kept (default: 3)")
    parser.add_argument("--modes", default="out,in_place",
                        help="comma list of out, in_place (default: both)")
    parser.add_argument("--json", default=None, help="write every median here (default: none)")
    parser.add_argument("--timeout", type=float, default=600,
                        help="seconds per bench run (default: 600)")
    parser.add_argument("--results", default=None, metavar="NAME",
                        help="write docs/results/NAME.json ('' for none; default: native_sweep, "
                             "none under pytest)")
    parser.add_argument("--no-results", dest="results", action="store_const", const="",
                        help="write no result file")
    parser.add_argument("--floor-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("bench_args", nargs="*", help="after --: more bench arguments")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from mpiallreduce.sizes import UsageError, parse_sizes

    try:
        sizes = [s for s in parse_sizes(args.sizes) if s >= 8]
    except UsageError as exc:
        parser.error(str(exc))
    if args.floor_worker:
        floor_worker(sizes, args.repeats)
        return 0
    modes = [m.strip() for m in args.modes.split(",")]
    if not sizes or args.repeats < 1 or set(modes) - {"out", "in_place"}:
        parser.error("need sizes of 8 bytes or more, --repeats >= 1, --modes of out, in_place")
    mpirun = str(pathlib.Path(sys.executable).parent / "mpirun")
    if not os.path.exists(mpirun):
        mpirun = "mpirun"
    library = mpi_library(sys.executable)
    chosen = configs(library)
    print(f"# {library}; {args.ranks} ranks; float64 SUM; medians of {args.repeats}; "
          f"configurations: {', '.join(chosen)}", flush=True)
    status = 0
    results: dict[str, dict[int, dict]] = {}
    spec = ",".join(map(str, sizes))
    for mode in modes:
        rows_by_config: dict[str, list[list[dict]]] = {config: [] for config in chosen}
        for repeat in range(args.repeats):
            for config, env in chosen.items():
                code, rows = run_bench(mpirun, args.ranks, spec, mode == "in_place", env,
                                       args.bench_args, args.timeout)
                status = status or code
                rows_by_config[config].append(rows)
                print(f"# {mode} {config} run {repeat + 1}: status {code}, {len(rows)} rows",
                      flush=True)
        results[mode] = summarise(rows_by_config)
    floor = measure_floor(mpirun, args.ranks, sizes, args.repeats, args.timeout)
    print("\n".join(table(results, floor)), flush=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as file:
            # each configuration's environment: mpiallreduce.native_rules turns the strongest
            # one per size into the library's own rules file
            json.dump({"library": library, "ranks": args.ranks, "repeats": args.repeats,
                       "configs": chosen, "floor_us": floor, "results": results}, file, indent=1)
    name = args.results
    if name is None:  # a test's tiny sweep must not replace the measured file
        name = "" if "PYTEST_CURRENT_TEST" in os.environ else "native_sweep"
    if name:
        write_results(name, results, library, args)
    return status


def write_results(name: str, results: dict[str, dict[int, dict]], library: str, args) -> None:
    """Write the reader's table: per size and mode, our best over the default and the strongest."""
    from _results import write

    rows, values = [], {}
    for size in sorted({size for summary in results.values() for size in summary}):
        for mode, summary in results.items():
            s = summary.get(size)
            if s is None or not s["ours"]:
                continue
            default = s["ours_us"] / s["default_native_us"] if s["default_native_us"] else None
            strongest = s["ours_us"] / s["native_us"]
            short_size = human(size)
            rows.append([f"{size} B" if not short_size[-1].isalpha()
                         else f"{short_size[:-1]} {short_size[-1]}iB",
                         "in place" if mode == "in_place" else "out of place", s["ours"],
                         s["native_config"], default, strongest])
            short, key = "in" if mode == "in_place" else "out", short_size
            key = key if key[-1].isalpha() else f"{key}B"
            values[f"{short}_vs_strongest_{key}"] = round(strongest, 3)
            if default is not None:
                values[f"{short}_vs_default_{key}"] = round(default, 3)
    mpi = library.split(",")[0].strip()
    bench = list(args.bench_args)
    chosen = next((a.split("=", 1)[1] for a in bench if a.startswith("--algorithms=")), None)
    if "--algorithms" in bench[:-1]:
        chosen = bench[bench.index("--algorithms") + 1]
    notes = (f"Our fastest algorithm's time over {mpi}'s default Allreduce and over its strongest "
             f"configuration at that size (float64 SUM), medians of {args.repeats} runs of each "
             f"configuration; below 1 ours is faster"
             + (f"; ours: the best of {chosen.replace(',', ', ')}" if chosen else "") + ".")
    path = write(name, "Our best algorithm against MPI's default and its strongest configuration",
                 columns=["size", "mode", "our best", "strongest native", "ours / default",
                          "ours / strongest"], rows=rows,
                 formats=["{}", "{}", "{}", "{}", "{:.2f}", "{:.2f}"], ranks=args.ranks,
                 values=values, notes=notes)
    print(f"# wrote {path.relative_to(ROOT)}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
