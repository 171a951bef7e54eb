#!/usr/bin/env python3
"""Run the bench at -n 2, -n 4 and -n 8 (2 simulated nodes of 4), predict the same cases from a
calibration, and print predicted / measured per algorithm and size.

    scripts/predict_vs_measured.py --machine scripts/machine-vm.json --sizes 8:64K
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

from mpiallreduce.model import DEFAULT_MACHINE, Machine, predict
from mpiallreduce.topology import Topology

ROOT = pathlib.Path(__file__).resolve().parent.parent
OPEN_MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
                "PRTE_MCA_rmaps_default_mapping_policy": ":oversubscribe"}
#: (ranks, ranks per node or None)
CASES = ((2, None), (4, None), (8, 4))


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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--machine", help="calibration JSON (default: the built-in machine)")
    parser.add_argument("--sizes", default="8:64K")
    parser.add_argument("--iterations", type=int, default=100)
    opts = parser.parse_args(argv)
    machine = Machine.load(opts.machine) if opts.machine else DEFAULT_MACHINE
    print(f"{'ranks':>7} {'size(B)':>9} {'algorithm':<20} {'measured(us)':>13} "
          f"{'predicted(us)':>14} {'pred/meas':>9}")
    for nranks, per_node in CASES:
        topology = Topology.simulated(nranks, per_node or nranks)
        for row in bench(nranks, per_node, opts.sizes, opts.iterations):
            try:
                predicted = predict(row["algorithm"], nranks, row["size"], topology, machine)
            except ValueError:
                continue
            label = f"{nranks}" + (f"/{per_node}" if per_node else "")
            print(f"{label:>7} {row['size']:>9} {row['algorithm']:<20} {row['avg_us']:>13.2f} "
                  f"{predicted.time * 1e6:>14.2f} {predicted.time * 1e6 / row['avg_us']:>9.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
