#!/usr/bin/env python3
"""Run the bench at -n 2, -n 4 and -n 8 (2 simulated nodes of 4), predict the same cases from a
calibration, and print predicted / measured per algorithm and size, the share of rows within
+-25% and +-35% per rank count and mode (out of place, in place), and (``--plot``) predicted
against measured.

    scripts/predict_vs_measured.py --machine docs/results/machine-vm.json --sizes 8:64K --plot pvm.png
    scripts/predict_vs_measured.py --measured bench.json --plot pvm.png   # saved bench rows
    scripts/predict_vs_measured.py --machine docs/results/machine-quiet.json \
        --measured docs/results/bench-n2-out.json --measured docs/results/bench-n2-in.json
    scripts/predict_vs_measured.py --calibrate machine.json --ranks 2 --modes out,in \
        --sizes 8:64M --repeat 3     # calibrate, then the bench, back to back (quiet machine)
    scripts/predict_vs_measured.py --calibrate machine.json --in-job --modes out,in \
        --sizes 8:64M --repeat 3 --save-measured bench.json   # both in one mpirun job

``--in-job`` (with ``--calibrate``, at -n 2) calibrates and then runs the bench in each mode
inside one ``mpirun`` job, the same two processes: this VM's speed moves from one job to the
next (placement, the state of the host), and Python's per-call costs and MPI's move by
different factors, so a calibration made in one job and judged on a bench of another mixes
two machines. In one job, what is left is the model's own error.

``--measured`` takes rows saved by ``--save-measured`` or the ``--json`` file of
``mpiallreduce.bench`` itself (its header says the ranks, simulated nodes and whether it ran
in place), and may be given more than once. ``auto`` rows are predicted as what they ran
(the bench's ``runs`` column). Where the bench repeated its rounds (``--repeat``), a row whose
rounds spread beyond +-25% of their median is *unsteady*: the machine did not reproduce it, so
no model can be held to it; the summary gives the shares over all rows and over the steady ones.
The bench measures every size's rounds within seconds, so a slow spell of the machine moves
every algorithm of a size together; the second summary compares each algorithm's time
relative to native measured in the same rounds (the bench's ``vs_native``) with the model's
ratio, which such a common factor cancels. The last summary (``as used``) judges the model's
ratios between algorithms and its pick (issue 38, item 3); with ``--fit`` (terms fitted on
another run) the same summary follows with that run's own measurements in the model's place
(``replay of the --fit run``): how far the two jobs agree, which the held-out figures are read
against.

Runs with more ranks than this machine has cores (``--cores``, default: the cores this process
may run on) are not predicted: the model has no core-sharing term
(:func:`mpiallreduce.model.check_cores`), so their rows are listed as REFUSED with the reason
and left out of the shares, never compared with a silent 10x error.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
from dataclasses import replace

from mpiallreduce.algorithms.nodes import NODE_PHASED
from mpiallreduce.model import DEFAULT_MACHINE, Machine, Oversubscribed, check_cores, predict
from mpiallreduce.model.fit import fit_terms
from mpiallreduce.sizes import parse_size
from mpiallreduce.topology import Topology

ROOT = pathlib.Path(__file__).resolve().parent.parent
OPEN_MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
                "PRTE_MCA_rmaps_default_mapping_policy": ":oversubscribe"}
#: (ranks, ranks per simulated node or None); all ranks run on this one machine
CASES = ((2, None), (4, None), (8, 4))
#: the agreement bands reported: |predicted / measured - 1| <= band
BANDS = (0.25, 0.35)


def label(nranks: int, per_node: int | None) -> str:
    return f"{nranks}" + (f"/{per_node}" if per_node else "")


def _mpirun(nranks: int) -> list[str]:
    mpirun = pathlib.Path(sys.executable).parent / "mpirun"
    return [str(mpirun if mpirun.exists() else "mpirun"), "-n", str(nranks), sys.executable,
            "-m", "mpi4py", "-m"]


def bench(nranks: int, per_node: int | None, sizes: str, iterations: int | None,
          in_place: bool = False, repeat: int = 1) -> list[dict]:
    """Run the bench under mpirun and return its JSON rows."""
    env = {**os.environ, **OPEN_MPI_ENV, "PYTHONPATH": str(ROOT)}
    if per_node:
        env["MPIALLREDUCE_RANKS_PER_NODE"] = str(per_node)
    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(tmp) / "bench.json"
        subprocess.run(_mpirun(nranks) + ["mpiallreduce.bench", "--quiet", "--no-validate",
                                          "--sizes", sizes, "--repeat", str(repeat),
                                          "--json", str(out)]
                       + ([] if iterations is None else ["--iterations", str(iterations)])
                       + (["--in-place"] if in_place else []),
                       env=env, check=True, timeout=1800)
        return json.loads(out.read_text())["rows"]


def calibrate(path: str) -> Machine:
    """Run ``model calibrate`` at -n 2 now (right before the bench: this machine's speed moves
    over minutes, so a calibration is only comparable with a bench run next to it)."""
    env = {**os.environ, **OPEN_MPI_ENV, "PYTHONPATH": str(ROOT)}
    subprocess.run(_mpirun(2) + ["mpiallreduce.model", "calibrate", "-o", path], env=env,
                   check=True, timeout=600, stdout=subprocess.DEVNULL)
    return Machine.load(path)


def in_job(path: str, sizes: str, iterations: int | None, modes: list[str], repeat: int
           ) -> tuple[Machine, dict]:
    """Calibrate into ``path``, then run the bench in each of ``modes``, in one ``mpirun -n 2``
    job (this script as its worker, :func:`worker`); return the machine and the rows."""
    env = {**os.environ, **OPEN_MPI_ENV, "PYTHONPATH": str(ROOT)}
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(_mpirun(2)[:-1] + [__file__, "--worker", tmp, "--calibrate", path,
                                          "--sizes", sizes, "--repeat", str(repeat),
                                          "--modes", ",".join(modes)]
                       + ([] if iterations is None else ["--iterations", str(iterations)]),
                       env=env, check=True, timeout=3600, stdout=subprocess.DEVNULL)
        rows = {(label(2, None), mode): json.loads(
            (pathlib.Path(tmp) / f"bench-{mode}.json").read_text())["rows"] for mode in modes}
    return Machine.load(path), rows


def worker(opts) -> int:
    """The MPI side of :func:`in_job` (every rank): calibrate, then the bench per mode."""
    from mpi4py import MPI

    from mpiallreduce.bench.cli import main as bench_main
    from mpiallreduce.calibrate import calibrate as measure

    comm = MPI.COMM_WORLD
    machine = measure(comm)
    if comm.rank == 0:
        machine.save(opts.calibrate)
    status = 0
    for mode in opts.modes.split(","):
        argv = ["--quiet", "--no-validate", "--sizes", opts.sizes, "--repeat", str(opts.repeat),
                "--json", str(pathlib.Path(opts.worker) / f"bench-{mode}.json")]
        argv += [] if opts.iterations is None else ["--iterations", str(opts.iterations)]
        status = status or bench_main(argv + (["--in-place"] if mode == "in" else []), comm)
    return status


def save_measured(path: str, measured: dict) -> None:
    """Write this run's rows, ``{(case label, mode): rows}``, for a later ``--measured``: one
    file per mode, ``PATH-out.json`` and ``PATH-in.json`` where there are both."""
    by_mode: dict[str, dict] = {}
    for (case, mode), rows in measured.items():
        by_mode.setdefault(mode, {})[case] = rows
    for mode, cases in by_mode.items():
        target = pathlib.Path(path)
        if len(by_mode) > 1:
            target = target.with_name(f"{target.stem}-{mode}{target.suffix}")
        target.write_text(json.dumps({"cases": cases, "in_place": mode == "in"}) + "\n")


#: a repeated row is steady when every round lies within this band of the rows' median
STEADY = 0.25


def load_measured(paths: list[str]) -> dict[tuple[str, str], list[dict]]:
    """Read saved rows: ``{(case label, mode): rows}``, mode "out" or "in" (in place).

    A file is either ``{"cases": {label: rows}}`` (``--save-measured``, out of place unless it
    says ``"in_place": true``) or the bench's own ``--json`` output (``meta`` and ``rows``).
    """
    measured: dict[tuple[str, str], list[dict]] = {}
    for path in paths:
        data = json.loads(pathlib.Path(path).read_text())
        if "cases" in data:
            mode = "in" if data.get("in_place") else "out"
            for case, rows in data["cases"].items():
                measured.setdefault((case, mode), []).extend(rows)
            continue
        if "meta" not in data or "rows" not in data:
            raise ValueError(f"{path}: neither saved rows ({{'cases': ...}}) nor bench --json "
                             f"output ('meta' and 'rows')")
        meta = data["meta"]
        per_node = meta.get("ranks_per_node")
        per_node = None if per_node is None or "real" in str(per_node) else int(per_node)
        if per_node == meta["ranks"]:
            per_node = None
        key = (label(int(meta["ranks"]), per_node), "in" if meta.get("in_place") else "out")
        measured.setdefault(key, []).extend(data["rows"])
    return measured


def steady(row: dict) -> bool | None:
    """Did the bench's rounds agree within :data:`STEADY` of their median? None: one round."""
    lo, hi, median = row.get("avg_lo_us"), row.get("avg_hi_us"), row.get("avg_us")
    if lo is None or hi is None or not row.get("repeats", 1) > 1 or not median:
        return None
    return lo >= (1 - STEADY) * median and hi <= (1 + STEADY) * median


def compare(measured: dict, machine: Machine, cores: int | None, intra: str = "auto"
            ) -> list[dict]:
    """Return one record per measured row: case, mode, size, algorithm, measured and predicted µs.

    ``measured`` maps a case label ("2", "4", "8/4"), or a (label, mode) pair, to bench rows.
    All ranks of a case ran on this machine, so a case with more ranks than ``cores`` is
    refused (``refused`` holds the reason, ``predicted_us`` is None); so is a row the model
    cannot predict. ``intra``: hierarchical and cascade's intra-node phase as the bench ran it
    (``"p2p"`` for rows measured before that phase could run over shared memory).
    """
    records = []
    keyed = {(key, "out") if isinstance(key, str) else key: rows for key, rows in measured.items()}
    for nranks, per_node in CASES:
        for mode in ("out", "in"):
            rows = keyed.get((label(nranks, per_node), mode))
            if not rows:
                continue
            records += _compare_case(rows, nranks, per_node, mode, machine, cores, intra)
    return records


def _compare_case(rows, nranks, per_node, mode, machine, cores, intra="auto") -> list[dict]:
    topology = Topology.simulated(nranks, per_node or nranks)
    refused = None
    try:
        check_cores(nranks, replace(machine, cores=cores))
    except Oversubscribed as error:
        refused = f"this machine: {error}"
    records = []
    native = {}
    for row in rows:
        algorithm = row["algorithm"]
        runs = row.get("runs") or algorithm
        record = {"case": label(nranks, per_node), "mode": mode, "nranks": nranks,
                  "size": row["size"], "algorithm": algorithm, "measured_us": row["avg_us"],
                  "steady": steady(row), "predicted_us": None, "refused": refused}
        if refused is None:
            try:
                if runs == "auto":
                    raise ValueError("auto without the bench's runs column: what it ran is "
                                     "unknown")
                params = {"intra": intra} if runs in NODE_PHASED else {}
                record["predicted_us"] = predict(runs, nranks, row["size"], topology, machine,
                                                 in_place=mode == "in", **params).time * 1e6
            except ValueError as error:
                record["refused"] = str(error)
        ratio = row.get("vs_native")
        record["measured_vs_native"] = ratio if isinstance(ratio, (int, float)) \
            and ratio == ratio and ratio > 0 else None
        if algorithm == "native":
            native[row["size"]] = record["predicted_us"]
        records.append(record)
    for record in records:  # the model's native / algorithm, as the bench's vs_native
        predicted, reference = record["predicted_us"], native.get(record["size"])
        record["predicted_vs_native"] = (reference / predicted if predicted and reference
                                         and record["algorithm"] != "native" else None)
    return records


def relative_summary(records: list[dict]) -> list[str]:
    """Lines: per case and mode, the rows whose time relative to native in the same rounds
    (the bench's vs_native) the model's ratio matches within each band."""
    lines = [f"# relative to native (vs_native, same rounds): {'ranks':>5} {'mode':>4} "
             f"{'rows':>5} " + " ".join(f"{f'within +-{band:.0%}':>16}" for band in BANDS)]
    for case, mode in dict.fromkeys((record["case"], record["mode"]) for record in records):
        mine = [r for r in records if r["case"] == case and r["mode"] == mode
                and r.get("predicted_vs_native") and r.get("measured_vs_native")]
        if not mine:
            continue
        shares = []
        for band in BANDS:
            hits = sum(abs(r["predicted_vs_native"] / r["measured_vs_native"] - 1) <= band
                       for r in mine)
            shares.append(f"{f'{hits} ({hits / len(mine):.0%})':>16}")
        lines.append(f"# relative to native (vs_native, same rounds): {case:>5} {mode:>4} "
                     f"{len(mine):>5} " + " ".join(shares))
    return lines


#: the model as it is used: its ratios between algorithms within this band of the measured
#: ones, and its pick within PICK of the measured best (issue 38, item 3)
RATIO_BAND, PICK = 0.25, 0.10


def as_used(records: list[dict], title: str = "as used") -> tuple[list[str], dict]:
    """The model judged as it is used, per case and mode and over all: (lines, figures).

    Ratios: for every (case, mode, size), each algorithm's time over the measured fastest
    algorithm's of that size (same job, same rounds), predicted against measured; a row agrees
    when the predicted ratio is within +-RATIO_BAND of the measured one (the fastest itself is
    not counted: its ratio is 1 both ways). Pick: the model's fastest of the algorithms
    measured at that size takes at most (1 + PICK) times the measured fastest's time. ``auto``
    rows are left out (they are one of the others); so are refused rows. ``title`` starts
    every line.
    """
    groups: dict = {}
    for r in records:
        if r["algorithm"] == "auto" or r["predicted_us"] is None or not r["measured_us"] > 0:
            continue
        groups.setdefault((r["case"], r["mode"], r["size"]), []).append(r)
    tally: dict = {}
    for (case, mode, _), rows in groups.items():
        if len(rows) < 2:
            continue
        best = min(rows, key=lambda r: r["measured_us"])
        pick = min(rows, key=lambda r: r["predicted_us"])
        counts = tally.setdefault((case, mode), [0, 0, 0, 0])
        for r in rows:
            if r is best:
                continue
            measured = r["measured_us"] / best["measured_us"]
            predicted = r["predicted_us"] / best["predicted_us"]
            counts[0] += abs(predicted / measured - 1) <= RATIO_BAND
            counts[1] += 1
        counts[2] += pick["measured_us"] <= (1 + PICK) * best["measured_us"]
        counts[3] += 1
    lines = [f"# {title}: {'ranks':>5} {'mode':>4} {'ratios within +-25%':>22} "
             f"{'pick within 10%':>18}"]
    total = [0, 0, 0, 0]
    for (case, mode), counts in tally.items():
        total = [t + c for t, c in zip(total, counts)]
        lines.append(f"# {title}: {case:>5} {mode:>4} {_share(*counts[:2]):>22} "
                     f"{_share(*counts[2:]):>18}")
    lines.append(f"# {title}: {'all':>5} {'':>4} {_share(*total[:2]):>22} "
                 f"{_share(*total[2:]):>18}")
    figures = {"ratios": total[0] / total[1] if total[1] else None,
               "picks": total[2] / total[3] if total[3] else None}
    return lines, figures


#: the title of :func:`replayed`'s summary
REPLAY = "replay of the --fit run"


def replayed(records: list[dict], reference: dict) -> list[dict]:
    """``records`` with each prediction replaced by what another run (``reference``, as
    :func:`load_measured` returns it) measured for the same case, mode, size and algorithm
    (None where it has no such row).

    :func:`as_used` over them judges that run's measurements as if they were the model: how
    far two jobs of this machine agree with each other on the ratios and the picks. A model
    fitted on one run and judged on another is held to the same jobs, so this is the reference
    its held-out figures are read against (not a strict bound: a model of the jobs' mean could
    do somewhat better than one job's replay, and a model of a state neither run was in, worse).
    """
    measured = {(case, mode, row["size"], row["algorithm"]): row["avg_us"]
                for (case, mode), rows in reference.items() for row in rows}
    return [{**r, "predicted_us": measured.get((r["case"], r["mode"], r["size"],
                                                r["algorithm"]))} for r in records]


#: shm's small regime at 2 ranks, where its time grows with the bytes read from the peer's slot
SHM_SLOPE_SIZES = (8 << 10, 64 << 10)


def shm_slopes(records: list[dict]) -> list[str]:
    """Lines: per case and mode, the measured seconds per byte of ``shm`` from 8 to 64 KiB
    (least-squares slope of its rows) against the model's. Each case and mode is its own
    mpirun job, and this slope takes one of two values by job (docs/model.md, "Judged as it
    is used"): the model, calibrated in one job, has one of them."""
    lines = []
    for case, mode in dict.fromkeys((r["case"], r["mode"]) for r in records):
        mine = [r for r in records if r["case"] == case and r["mode"] == mode
                and r["algorithm"] == "shm" and r["predicted_us"] is not None
                and SHM_SLOPE_SIZES[0] <= r["size"] <= SHM_SLOPE_SIZES[1]]
        if len({r["size"] for r in mine}) < 2:
            continue
        sizes = [r["size"] for r in mine]
        slopes = [_slope(sizes, [r[key] for r in mine]) * 1e3
                  for key in ("measured_us", "predicted_us")]
        lines.append(f"# shm per byte, 8-64 KiB: {case:>5} {mode:>4} measured {slopes[0]:.3f} "
                     f"ns/B, predicted {slopes[1]:.3f} ns/B")
    return lines


def _slope(x: list[float], y: list[float]) -> float:
    mean_x, mean_y = sum(x) / len(x), sum(y) / len(y)
    return (sum((a - mean_x) * (b - mean_y) for a, b in zip(x, y))
            / sum((a - mean_x) ** 2 for a in x))


def keep_sizes(measured: dict, largest: int | None) -> dict:
    """``measured`` with the rows above ``largest`` bytes left out (None: all)."""
    if largest is None:
        return measured
    return {key: [row for row in rows if row["size"] <= largest]
            for key, rows in measured.items()}


def _share(hits: int, count: int) -> str:
    return f"{hits}/{count} ({hits / count:.0%})" if count else "-"


def within(record: dict, band: float) -> bool:
    return abs(record["predicted_us"] / record["measured_us"] - 1) <= band


def summary(records: list[dict]) -> list[str]:
    """Lines: per case and mode, rows compared and the share within each band (of all compared
    rows, and of the steady ones where the bench repeated its rounds); refused rows and why."""
    lines = [f"# {'ranks':>5} {'mode':>4} {'rows':>5} {'compared':>8} "
             + " ".join(f"{f'within +-{band:.0%}':>16}" for band in BANDS)
             + f" {'steady':>6} " + " ".join(f"{f'steady +-{band:.0%}':>16}" for band in BANDS)
             + "  refused"]
    for case, mode in dict.fromkeys((record["case"], record["mode"]) for record in records):
        mine = [r for r in records if r["case"] == case and r["mode"] == mode]
        compared = [r for r in mine if r["predicted_us"] is not None and r["measured_us"] > 0]
        calm = [r for r in compared if r["steady"]]
        shares = []
        for group in (compared, calm):
            for band in BANDS:
                hits = sum(within(r, band) for r in group)
                share = f"{hits} ({hits / len(group):.0%})" if group else "-"
                shares.append(f"{share:>16}")
        repeated = any(r["steady"] is not None for r in compared)
        reasons = sorted({r["refused"] for r in mine if r["refused"]})
        lines.append(f"# {case:>5} {mode:>4} {len(mine):>5} {len(compared):>8} "
                     + " ".join(shares[:2])
                     + f" {len(calm) if repeated else '-':>6} " + " ".join(shares[2:])
                     + f"  {len(mine) - len(compared)}"
                     + (f": {'; '.join(reasons)}" if reasons else ""))
    return lines


def plot(records: list[dict], path: str) -> None:
    """Predicted against measured, log axes, one marker per algorithm, one colour per case."""
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    compared = [r for r in records if r["predicted_us"] is not None and r["measured_us"] > 0]
    markers = "osD^v<>phx*+"
    algorithms = sorted({r["algorithm"] for r in compared})
    cases = list(dict.fromkeys((r["case"], r.get("mode", "out")) for r in compared))
    fig, ax = plt.subplots(figsize=(7, 6))
    for index, name in enumerate(algorithms):
        for color, (case, mode) in enumerate(cases):
            mine = [r for r in compared if r["algorithm"] == name and r["case"] == case
                    and r.get("mode", "out") == mode]
            if mine:
                where = "" if mode == "out" else ", in place"
                ax.scatter([r["measured_us"] for r in mine], [r["predicted_us"] for r in mine],
                           marker=markers[index % len(markers)], color=f"C{color % 10}",
                           label=f"{name}, {case} ranks{where}", s=22)
    if compared:
        values = [v for r in compared for v in (r["measured_us"], r["predicted_us"])]
        low, high = min(values) / 1.5, max(values) * 1.5
        ax.plot([low, high], [low, high], color="black", linewidth=0.8, label="predicted = measured")
        for band, style in zip(BANDS, (":", "--")):
            for factor in (1 - band, 1 + band):
                ax.plot([low, high], [low * factor, high * factor], color="grey",
                        linestyle=style, linewidth=0.6)
        ax.set_xlim(low, high)
        ax.set_ylim(low, high)
    ax.set_xscale("log")
    ax.set_yscale("log")
    for axis in (ax.xaxis, ax.yaxis):
        axis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlabel("measured (µs)")
    ax.set_ylabel("predicted (µs)")
    ax.set_title("mpiallreduce.model: predicted against measured (bands +-25%, +-35%)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="x-small", ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def fitted(machine: Machine, rows: dict) -> Machine:
    """``machine`` with its per-call and per-step terms fitted to the rows of one case (the
    first of CASES that ``rows`` holds, both modes): ranks on a simulated topology as run."""
    for nranks, per_node in CASES:
        mine = [(row, mode == "in") for (case, mode), found in rows.items()
                if case == label(nranks, per_node) for row in found]
        if mine:
            topology = Topology.simulated(nranks, per_node or nranks)
            return fit_terms(machine, [row for row, _ in mine], nranks, topology,
                             [mode for _, mode in mine])
    return machine


def main(argv=None, out=None) -> int:
    out = sys.stdout if out is None else out
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--machine", help="calibration JSON (default: the built-in machine)")
    parser.add_argument("--calibrate", metavar="FILE.json",
                        help="run calibrate at -n 2 into FILE first and predict from it (not "
                             "with --measured)")
    parser.add_argument("--sizes", default="8:64K")
    parser.add_argument("--iterations", type=int, default=None,
                        help="timed runs per row (default: the bench's, by size)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="the bench's interleaved rounds (3 gives the steady rows)")
    parser.add_argument("--ranks", default="2,4,8/4", metavar="LIST",
                        help="cases to run: ranks, or ranks/ranks per simulated node "
                             "(default: 2,4,8/4)")
    parser.add_argument("--modes", default=None, metavar="LIST",
                        help="out, in or both (out,in) (default: out, or in with --in-place)")
    parser.add_argument("--cores", type=int, default=len(os.sched_getaffinity(0))
                        if hasattr(os, "sched_getaffinity") else os.cpu_count(),
                        help="cores of this machine (default: those this process may use)")
    parser.add_argument("--measured", metavar="FILE.json", action="append",
                        help="bench rows saved by --save-measured, or a bench --json file "
                             "(repeatable): predict only, run nothing")
    parser.add_argument("--fit", metavar="FILE.json", action="append",
                        help="bench rows of ANOTHER run (as --measured, repeatable): fit the "
                             "machine's per-call and per-step terms to them "
                             "(model.fit.fit_terms) and judge the fitted model on --measured "
                             "or this run (held out)")
    parser.add_argument("--in-place", action="store_true",
                        help="run the bench in place (--in-place) instead of out of place")
    parser.add_argument("--save-measured", metavar="FILE.json",
                        help="write the bench rows of this run for a later --measured")
    parser.add_argument("--plot", metavar="FILE.png",
                        help="predicted against measured (needs matplotlib: the plot extra)")
    parser.add_argument("--max-size", default=None, metavar="SIZE",
                        help="judge (and --fit) only rows of at most SIZE bytes, e.g. 64K "
                             "(issue 38 judges 8 B-64 KiB; stored runs reach 64 MiB)")
    parser.add_argument("--intra", choices=("auto", "shm", "p2p"), default="auto",
                        help="hierarchical and cascade's intra-node phase as the bench ran it "
                             "(default auto, as the library runs them; p2p for rows measured "
                             "before it could run over shared memory, e.g. the stored "
                             "docs/results/bench-n2-*.json)")
    parser.add_argument("--in-job", action="store_true",
                        help="with --calibrate: calibrate and run the bench in one mpirun job "
                             "(-n 2 only), not one job each")
    parser.add_argument("--worker", metavar="DIR", help=argparse.SUPPRESS)
    opts = parser.parse_args(argv)
    if opts.worker:
        return worker(opts)
    if opts.in_job and not opts.calibrate:
        parser.error("--in-job runs the calibration: give it --calibrate FILE.json")
    if opts.in_job and opts.ranks not in ("2", parser.get_default("ranks")):
        parser.error("--in-job runs at -n 2 only")
    if opts.calibrate and opts.measured:
        parser.error("--calibrate measures this machine now; --measured re-predicts old rows")
    machine = Machine.load(opts.machine) if opts.machine else DEFAULT_MACHINE
    in_job_rows = None
    if opts.calibrate and opts.in_job:
        modes = (opts.modes or ("in" if opts.in_place else "out")).split(",")
        if set(modes) - {"out", "in"}:
            parser.error("--modes takes out and in")
        machine, in_job_rows = in_job(opts.calibrate, opts.sizes, opts.iterations, modes,
                                      opts.repeat)
    elif opts.calibrate:
        machine = calibrate(opts.calibrate)
    largest = None if opts.max_size is None else parse_size(opts.max_size)
    reference = None
    if opts.fit:
        reference = keep_sizes(load_measured(opts.fit), largest)
        machine = fitted(machine, reference)
    if in_job_rows is not None:
        measured = in_job_rows
    elif opts.measured:
        try:
            measured = load_measured(opts.measured)
        except (OSError, ValueError, KeyError) as error:
            print(f"predict_vs_measured: {error}", file=sys.stderr)
            return 2
    else:
        modes = (opts.modes or ("in" if opts.in_place else "out")).split(",")
        wanted = {case.strip() for case in opts.ranks.split(",")}
        cases = [(n, k) for n, k in CASES if label(n, k) in wanted]
        if not cases or set(modes) - {"out", "in"}:
            parser.error(f"--ranks takes {', '.join(label(n, k) for n, k in CASES)}; --modes "
                         f"out and in")
        measured = {}
        for mode in modes:
            for n, k in cases:
                measured[(label(n, k), mode)] = bench(n, k, opts.sizes, opts.iterations,
                                                      mode == "in", opts.repeat)
    if opts.save_measured and not opts.measured:
        save_measured(opts.save_measured, measured)
    records = compare(keep_sizes(measured, largest), machine, opts.cores, opts.intra)
    info = machine.info
    print(f"# machine: {opts.calibrate or opts.machine or 'built-in'}"
          + (" (calibrated in the bench's job)" if opts.in_job else "")
          + (f", terms fitted to {', '.join(opts.fit)}" if opts.fit else "") + " ("
          f"{info.get('host', '')} {info.get('date', info.get('source', ''))}, load "
          f"{info.get('load', '?')}); measured: {', '.join(opts.measured or ['this run'])}",
          file=out)
    print(f"{'ranks':>7} {'mode':>4} {'size(B)':>9} {'algorithm':<20} {'measured(us)':>13} "
          f"{'predicted(us)':>14} {'pred/meas':>9} steady", file=out)
    for r in records:
        calm = {None: "-", True: "yes", False: "no"}[r["steady"]]
        head = (f"{r['case']:>7} {r['mode']:>4} {r['size']:>9} {r['algorithm']:<20} "
                f"{r['measured_us']:>13.2f}")
        if r["predicted_us"] is None:
            print(f"{head} {'REFUSED':>14} {'-':>9} {calm}", file=out)
            continue
        print(f"{head} {r['predicted_us']:>14.2f} {r['predicted_us'] / r['measured_us']:>9.2f} "
              f"{calm}", file=out)
    print("\n".join(summary(records)), file=out)
    relative = relative_summary(records)
    if len(relative) > 1:
        print("\n".join(relative), file=out)
    print("\n".join(as_used(records)[0] + shm_slopes(records)), file=out)
    if reference is not None:  # the other run itself as the model: how far two jobs agree
        print("\n".join(as_used(replayed(records, reference), REPLAY)[0]), file=out)
    if opts.plot:
        plot(records, opts.plot)
        print(f"# wrote {opts.plot}", file=out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
