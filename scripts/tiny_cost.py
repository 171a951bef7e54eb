"""What a tiny reduction costs through mpiallreduce against plain mpi4py: issue 36's table.

    python scripts/tiny_cost.py [--jobs openmpi:2 openmpi:4 mpich:2] [--rounds 15]
        [--python] [--results NAME | --no-results]

Each job (``LIBRARY:RANKS``: the venv of that MPI library, ``.venv`` for Open MPI at its
defaults and ``.venv-mpich`` for MPICH, under its own mpirun) runs every row of the issue's
table, plus the drop-in and ``mar.allreduce`` at 64 KiB and up, float64 SUM. A row and its
reference are timed in the same job, block after block (``comm.Barrier`` first, a block a few
ms; the slower rank's time counts), in ``--rounds`` interleaved rounds (their order alternates);
the table prints, per row, the median over the rounds of row / reference, its spread (min-max)
and the issue's target. ``--python`` runs every job with ``MPIALLREDUCE_COMPILED=0`` (the
pure-Python form) as well, one row table per form. The form, the MPI library and ``uptime``
head each table: timings on a loaded machine are noise, ratios within one job less so.

``--results NAME`` (default ``tiny_cost``; ``--results ''`` or ``--no-results`` writes none)
writes ``docs/results/NAME.json`` (``scripts/_results.py``): the rows of :data:`RESULT_ROWS`
(the 8-byte call variants, the heat step and the CG iteration), one ratio column per job.

Open MPI runs at its defaults (``OMPI_MCA_mpi_yield_when_idle`` is never set: Open MPI sets
it itself where ranks outnumber cores); run as root and oversubscribed as the Makefile does.
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
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
OPEN_MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
                "PRTE_MCA_rmaps_default_mapping_policy": ":oversubscribe",
                "OMPI_MCA_osc": "^ucx"}  # as the Makefile: osc/ucx prints errors here
VENVS = {"openmpi": ".venv", "mpich": ".venv-mpich"}
#: the 64 KiB and larger sizes (float64 elements) that must not get slower
LARGE = (8 << 10, 128 << 10, 1 << 20)
#: the rows the result file keeps (``--results``): label -> (the reader's row, value name)
RESULT_ROWS = {
    "mar.allreduce(x, out) / comm.Allreduce":
        ("`mar.allreduce(x, out)` / `comm.Allreduce`", "allreduce_8B"),
    "mar.allreduce(x) fresh / Allreduce(x, empty_like(x))":
        ("`mar.allreduce(x)` (fresh array) / `comm.Allreduce(x, np.empty_like(x))`", "fresh_8B"),
    "mar.Comm.Allreduce in place / plain":
        ("`mar.Comm.Allreduce`, in place / plain", "comm_in_place_8B"),
    "mar.Comm.Allreduce out of place / plain":
        ("`mar.Comm.Allreduce`, out of place / plain", "comm_8B"),
    "mar.Comm.Allreduce(IN_PLACE, new spec) / plain":
        ("`mar.Comm.Allreduce` on a new buffer spec per call / plain", "new_spec_8B"),
    "start(plan).wait() / plan.run()":
        ("`mar.start(plan).wait()` / `plan.run()`", "start_8B"),
    "heat step via mar.Comm / plain":
        ("heat-equation step through `mar.Comm` / plain mpi4py", "heat_step"),
    "examples/conjugate_gradient.py per iteration":
        ("`examples/conjugate_gradient.py`, per iteration / plain", "cg_iteration"),
}


# -- inside the job -----------------------------------------------------------------------------------

def rows(comm, mar, MPI, np):
    """(label, target, row, reference): each a zero-argument call, or (for the CG solve) a
    callable returning its own seconds per iteration."""
    world = comm
    drop_in = mar.Comm(world)
    rank, size = world.Get_rank(), world.Get_size()
    x, out = np.array([1.0 + rank]), np.empty(1)
    a, b = np.array([2.0 + rank]), np.empty(1)  # mar.Comm's own pair
    inplace, inplace_plain = np.array([3.0]), np.array([3.0])
    plan = mar.plan(x, out)
    timed_x, timed_out = np.array([1.0]), np.empty(1)
    sched_x, sched_out = np.array([1.0]), np.empty(1)
    address = np.array([4.0])
    pointer = address.ctypes.data
    halo_send, halo_recv = np.zeros(128), np.empty(128)
    right, left = (rank + 1) % size, (rank - 1) % size
    fresh_out = np.empty(1)

    def heat(c):
        def step():
            c.Allreduce(MPI.IN_PLACE, inplace if c is drop_in else inplace_plain, op=MPI.SUM)
            local = np.array([0.5])
            c.Allreduce(MPI.IN_PLACE, local, op=MPI.SUM)
            c.Sendrecv(halo_send, dest=right, recvbuf=halo_recv, source=left)
        return step

    sys.path.insert(0, str(ROOT / "examples"))
    import conjugate_gradient as cg

    def cg_iteration(c):
        def solve():
            _, iterations, seconds = cg.solve(c, 48)
            return seconds / iterations
        return solve

    spec = lambda: [MPI.memory.fromaddress(pointer, 8), 1, MPI.DOUBLE]
    table = [
        ("mar.allreduce(x, out) / comm.Allreduce", 0.5,
         lambda: mar.allreduce(x, out), lambda: world.Allreduce(x, out)),
        ("mar.allreduce(x) fresh / Allreduce(x, empty_like(x))", 1.0,
         lambda: mar.allreduce(x), lambda: world.Allreduce(x, np.empty_like(x))),
        ("mar.Comm.Allreduce in place / plain", 0.6,
         lambda: drop_in.Allreduce(MPI.IN_PLACE, a), lambda: world.Allreduce(MPI.IN_PLACE, b)),
        ("mar.Comm.Allreduce out of place / plain", 0.6,
         lambda: drop_in.Allreduce(a, b), lambda: world.Allreduce(x, fresh_out)),
        ("mar.Comm.allreduce(1.5) / plain", 1.0,
         lambda: drop_in.allreduce(1.5), lambda: world.allreduce(1.5)),
        ("heat step via mar.Comm / plain", 0.9, heat(drop_in), heat(world)),
        ("examples/conjugate_gradient.py per iteration", 0.9,
         cg_iteration(drop_in), cg_iteration(world)),
        ("iallreduce(x, out).wait() / mar.allreduce(x, out)", 1.1,
         lambda: mar.iallreduce(x, out).wait(), lambda: mar.allreduce(x, out)),
        ("start(plan).wait() / plan.run()", 1.1,
         lambda: mar.start(plan).wait(), lambda: plan.run()),  # (each row a lambda's call)
        ("timeout= / none, shm (auto)", 1.1,
         lambda: mar.allreduce(timed_x, timed_out, timeout=60.0),
         lambda: mar.allreduce(timed_x, timed_out)),
        ("timeout= / none, recursive_doubling", 1.1,
         lambda: mar.allreduce(sched_x, sched_out, algorithm="recursive_doubling", timeout=60.0),
         lambda: mar.allreduce(sched_x, sched_out, algorithm="recursive_doubling")),
        ("mar.Comm.Allreduce(IN_PLACE, new spec) / plain", 1.0,
         lambda: drop_in.Allreduce(MPI.IN_PLACE, spec()),
         lambda: world.Allreduce(MPI.IN_PLACE, spec())),
    ]
    for count in LARGE:
        big_x, big_out, big_ref = np.ones(count), np.empty(count), np.empty(count)
        kib = count * 8 >> 10
        table.append((f"{kib} KiB: mar.allreduce(x, out) / comm.Allreduce", 1.0,
                      lambda bx=big_x, bo=big_out: mar.allreduce(bx, bo),
                      lambda bx=big_x, br=big_ref: world.Allreduce(bx, br)))
        table.append((f"{kib} KiB: mar.Comm.Allreduce / plain", 1.0,
                      lambda bx=big_x, bo=big_out: drop_in.Allreduce(bx, bo),
                      lambda bx=big_x, br=big_ref: world.Allreduce(bx, br)))
    return table


def block_time(comm, call, iterations: int, returns_time: bool) -> float:
    """Seconds per call of ``call`` over ``iterations`` calls (the slower rank's)."""
    comm.Barrier()
    if returns_time:
        mine = call()
    else:
        start = time.perf_counter()
        for _ in range(iterations):
            call()
        mine = (time.perf_counter() - start) / iterations
    return comm.allreduce(mine, op=_MAX)


_MAX = None


def inner(rounds: int, json_path: str | None = None) -> None:
    global _MAX
    import numpy as np
    from mpi4py import MPI

    import mpiallreduce as mar
    from mpiallreduce import _form

    _MAX = MPI.MAX
    comm = MPI.COMM_WORLD
    table = rows(comm, mar, MPI, np)
    iterations = []
    for label, _, row, reference in table:  # warm up, and size each block to ~3 ms
        solve = label.startswith("examples/")
        for call in (row, reference):
            for _ in range(1 if solve else 50):
                call()
        seconds = block_time(comm, reference, 200, solve)
        iterations.append(1 if solve else max(20, min(20000, int(3e-3 / max(seconds, 1e-8)))))
    ratios = [[] for _ in table]
    for r in range(rounds):
        for i, (label, _, row, reference) in enumerate(table):
            solve = label.startswith("examples/")
            order = (row, reference) if r % 2 == 0 else (reference, row)
            times = [block_time(comm, call, iterations[i], solve) for call in order]
            mine, theirs = times if r % 2 == 0 else times[::-1]
            ratios[i].append((mine / theirs, mine, theirs))
    if comm.Get_rank() == 0:
        library = MPI.Get_library_version().splitlines()[0].strip().strip("\0")[:60]
        load = os.getloadavg()
        print(f"# {comm.Get_size()} ranks, {library}; call path: {_form.describe()}")
        print(f"# load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; {rounds} interleaved "
              f"rounds, median [min-max] of row / reference per round; times are medians")
        print(f"{'row':56s} {'ratio':>6s} {'[min-max]':>13s} {'target':>7s} {'row us':>8s} "
              f"{'ref us':>8s}")
        for (label, target, _, _), values in zip(table, ratios):
            ratio = statistics.median(v[0] for v in values)
            low, high = min(v[0] for v in values), max(v[0] for v in values)
            mine = statistics.median(v[1] for v in values) * 1e6
            theirs = statistics.median(v[2] for v in values) * 1e6
            mark = "" if ratio <= target else " *"
            print(f"{label:56s} {ratio:6.2f} [{low:5.2f}-{high:5.2f}] {'<= ' + str(target):>7s} "
                  f"{mine:8.2f} {theirs:8.2f}{mark}")
        print("(* above the target)", flush=True)
        if json_path:
            with open(json_path, "w", encoding="utf-8") as file:
                json.dump({"form": _form.describe(), "library": library, "rounds": rounds,
                           "rows": {label: statistics.median(v[0] for v in values)
                                    for (label, _, _, _), values in zip(table, ratios)}}, file)


# -- the launcher --------------------------------------------------------------------------------------

def launch(library: str, ranks: int, rounds: int, python_form: bool,
           json_path: str | None = None) -> int:
    venv = ROOT / VENVS[library]
    mpirun, python = venv / "bin" / "mpirun", venv / "bin" / "python"
    if not python.exists():
        print(f"# {library}: no {venv} (make {VENVS[library]}/.installed MPI={library})")
        return 0
    env = dict(os.environ, **OPEN_MPI_ENV)
    env.pop("OMPI_MCA_mpi_yield_when_idle", None)  # Open MPI at its defaults
    if python_form:
        env["MPIALLREDUCE_COMPILED"] = "0"
    uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(f"\n## {library} -n {ranks}{' (MPIALLREDUCE_COMPILED=0)' if python_form else ''}; "
          f"uptime: {uptime}", flush=True)
    command = [str(mpirun), "-n", str(ranks), str(python), "-m", "mpi4py", __file__, "--inner",
               "--rounds", str(rounds)] + (["--json", json_path] if json_path else [])
    return subprocess.run(command, env=env, timeout=600).returncode


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", nargs="+", default=["openmpi:2", "openmpi:4", "mpich:2"],
                        help="LIBRARY:RANKS, LIBRARY openmpi or mpich")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--python", action="store_true",
                        help="also run each job with MPIALLREDUCE_COMPILED=0")
    parser.add_argument("--results", default="tiny_cost", metavar="NAME",
                        help="write docs/results/NAME.json ('' for none; default: tiny_cost)")
    parser.add_argument("--no-results", dest="results", action="store_const", const="",
                        help="write no result file")
    parser.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--json", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.inner:
        inner(args.rounds, args.json)
        return 0
    status = 0
    measured: list[tuple[str, dict]] = []  # (column, the inner job's ratios)
    with tempfile.TemporaryDirectory() as folder:
        for job in args.jobs:
            library, _, ranks = job.partition(":")
            if library not in VENVS:
                parser.error(f"unknown library {library!r} in {job!r}: openmpi or mpich")
            for python_form in (False, True) if args.python else (False,):
                path = os.path.join(folder, f"{len(measured)}-{library}-{ranks}-{python_form}.json")
                status |= launch(library, int(ranks or 2), args.rounds, python_form, path)
                if os.path.exists(path):
                    with open(path, encoding="utf-8") as file:
                        job_rows = json.load(file)
                    name = "Open MPI" if library == "openmpi" else "MPICH"
                    column = (f"{name}, {int(ranks or 2)} ranks"
                              + (" (pure Python)" if python_form else ""))
                    measured.append((column, job_rows))
    if args.results and measured:
        write_results(args, measured)
    return status


def write_results(args, measured: list[tuple[str, dict]]) -> None:
    """Write the reader's table: the rows of RESULT_ROWS, one ratio column per job."""
    from _results import write

    rows, values = [], {}
    for label, (text, key) in RESULT_ROWS.items():
        rows.append([text] + [job["rows"].get(label) for _, job in measured])
        for i, (column, job) in enumerate(measured):
            if job["rows"].get(label) is not None:
                suffix = "" if i == 0 else "_" + "".join(c for c in column.lower() if c.isalnum())
                values[key + suffix] = round(job["rows"][label], 3)
    ranks = sorted({int(job.partition(":")[2] or 2) for job in args.jobs})
    notes = (f"8-byte float64 SUM unless named; each row's time over its reference's in the same "
             f"job, median of {args.rounds} interleaved rounds (blocks of ~3 ms, the slower "
             f"rank's time); call path: {measured[0][1]['form']}.")
    path = write(args.results, "What a tiny reduction costs against plain mpi4py",
                 columns=["row / reference"] + [column for column, _ in measured], rows=rows,
                 formats=["{}"] + ["{:.2f}"] * len(measured),
                 ranks=ranks[0] if len(ranks) == 1 else ", ".join(map(str, ranks)),
                 values=values, notes=notes)
    print(f"# wrote {path.relative_to(ROOT)}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
