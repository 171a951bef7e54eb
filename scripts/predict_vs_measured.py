#!/usr/bin/env python3
"""Run the bench at -n 2, -n 4 and -n 8 (2 simulated nodes of 4), predict the same cases from a
calibration, and print predicted / measured per algorithm and size, the share of rows within
+-25% and +-35% per rank count, and (``--plot``) predicted against measured.

    scripts/predict_vs_measured.py --machine scripts/machine-vm.json --sizes 8:64K --plot pvm.png
    scripts/predict_vs_measured.py --measured bench.json --plot pvm.png   # saved bench rows

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

from mpiallreduce.model import DEFAULT_MACHINE, Machine, Oversubscribed, check_cores, predict
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


def bench(nranks: int, per_node: int | None, sizes: str, iterations: int) -> list[dict]:
    """Run the bench under mpirun and return its JSON rows."""
    mpirun = pathlib.Path(sys.executable).parent / "mpirun"
    env = {**os.environ, **OPEN_MPI_ENV, "PYTHONPATH": str(ROOT)}
    if per_node:
        env["MPIALLREDUCE_RANKS_PER_NODE"] = str(per_node)
    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(tmp) / "bench.json"
        subprocess.run([str(mpirun if mpirun.exists() else "mpirun"), "-n", str(nranks),
                        sys.executable, "-m", "mpi4py", "-m", "mpiallreduce.bench", "--quiet",
                        "--no-validate", "--sizes", sizes, "--iterations", str(iterations),
                        "--json", str(out)], env=env, check=True, timeout=600)
        return json.loads(out.read_text())["rows"]


def compare(measured: dict[str, list[dict]], machine: Machine, cores: int | None) -> list[dict]:
    """Return one record per measured row: case, size, algorithm, measured and predicted µs.

    ``measured`` maps a case label ("2", "4", "8/4") to bench rows. All ranks of a case ran on
    this machine, so a case with more ranks than ``cores`` is refused (``refused`` holds the
    reason, ``predicted_us`` is None); so is a row the model cannot predict.
    """
    records = []
    for nranks, per_node in CASES:
        rows = measured.get(label(nranks, per_node))
        if not rows:
            continue
        topology = Topology.simulated(nranks, per_node or nranks)
        refused = None
        try:
            check_cores(nranks, replace(machine, cores=cores))
        except Oversubscribed as error:
            refused = f"this machine: {error}"
        for row in rows:
            record = {"case": label(nranks, per_node), "nranks": nranks, "size": row["size"],
                      "algorithm": row["algorithm"], "measured_us": row["avg_us"],
                      "predicted_us": None, "refused": refused}
            if refused is None:
                try:
                    record["predicted_us"] = predict(row["algorithm"], nranks, row["size"],
                                                     topology, machine).time * 1e6
                except ValueError as error:
                    record["refused"] = str(error)
            records.append(record)
    return records


def within(record: dict, band: float) -> bool:
    return abs(record["predicted_us"] / record["measured_us"] - 1) <= band


def summary(records: list[dict]) -> list[str]:
    """Lines: per case, rows compared and the share within each band; refused rows and why."""
    lines = [f"# {'ranks':>5} {'rows':>5} {'compared':>8} "
             + " ".join(f"{f'within +-{band:.0%}':>16}" for band in BANDS) + "  refused"]
    for case in dict.fromkeys(record["case"] for record in records):
        mine = [r for r in records if r["case"] == case]
        compared = [r for r in mine if r["predicted_us"] is not None and r["measured_us"] > 0]
        shares = []
        for band in BANDS:
            hits = sum(within(r, band) for r in compared)
            share = f"{hits} ({hits / len(compared):.0%})" if compared else "-"
            shares.append(f"{share:>16}")
        reasons = sorted({r["refused"] for r in mine if r["refused"]})
        lines.append(f"# {case:>5} {len(mine):>5} {len(compared):>8} " + " ".join(shares)
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
    cases = list(dict.fromkeys(r["case"] for r in compared))
    fig, ax = plt.subplots(figsize=(7, 6))
    for index, name in enumerate(algorithms):
        for color, case in enumerate(cases):
            mine = [r for r in compared if r["algorithm"] == name and r["case"] == case]
            if mine:
                ax.scatter([r["measured_us"] for r in mine], [r["predicted_us"] for r in mine],
                           marker=markers[index % len(markers)], color=f"C{color % 10}",
                           label=f"{name}, {case} ranks", s=22)
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


def main(argv=None, out=None) -> int:
    out = sys.stdout if out is None else out
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--machine", help="calibration JSON (default: the built-in machine)")
    parser.add_argument("--sizes", default="8:64K")
    parser.add_argument("--iterations", type=int, default=100)
    parser.add_argument("--cores", type=int, default=len(os.sched_getaffinity(0))
                        if hasattr(os, "sched_getaffinity") else os.cpu_count(),
                        help="cores of this machine (default: those this process may use)")
    parser.add_argument("--measured", metavar="FILE.json",
                        help="bench rows saved by --save-measured: predict only, run nothing")
    parser.add_argument("--save-measured", metavar="FILE.json",
                        help="write the bench rows of this run for a later --measured")
    parser.add_argument("--plot", metavar="FILE.png",
                        help="predicted against measured (needs matplotlib: the plot extra)")
    opts = parser.parse_args(argv)
    machine = Machine.load(opts.machine) if opts.machine else DEFAULT_MACHINE
    if opts.measured:
        measured = json.loads(pathlib.Path(opts.measured).read_text())["cases"]
    else:
        measured = {label(n, k): bench(n, k, opts.sizes, opts.iterations) for n, k in CASES}
        if opts.save_measured:
            pathlib.Path(opts.save_measured).write_text(json.dumps({"cases": measured}) + "\n")
    records = compare(measured, machine, opts.cores)
    print(f"{'ranks':>7} {'size(B)':>9} {'algorithm':<20} {'measured(us)':>13} "
          f"{'predicted(us)':>14} {'pred/meas':>9}", file=out)
    for r in records:
        if r["predicted_us"] is None:
            print(f"{r['case']:>7} {r['size']:>9} {r['algorithm']:<20} {r['measured_us']:>13.2f} "
                  f"{'REFUSED':>14} {'-':>9}", file=out)
            continue
        print(f"{r['case']:>7} {r['size']:>9} {r['algorithm']:<20} {r['measured_us']:>13.2f} "
              f"{r['predicted_us']:>14.2f} {r['predicted_us'] / r['measured_us']:>9.2f}",
              file=out)
    print("\n".join(summary(records)), file=out)
    if opts.plot:
        plot(records, opts.plot)
        print(f"# wrote {opts.plot}", file=out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
