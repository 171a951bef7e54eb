"""Run examples/data_parallel.py for every --sync mode and print one comparison table.

    mpirun -n 4 python -m mpi4py scripts/data_parallel_table.py [--algorithm ring] [--steps 40]

Runs in one MPI job (each mode's ``main()`` in turn); arguments other than ``--sync`` are passed
to every run. A mode whose checks fail is shown as FAIL and makes the exit status 1.
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys

from mpi4py import MPI

EXAMPLE = pathlib.Path(__file__).resolve().parent.parent / "examples" / "data_parallel.py"


def load_example():
    spec = importlib.util.spec_from_file_location("data_parallel", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    example = load_example()
    rows = []
    for sync in example.SYNCS:
        try:
            rows.append(example.main([*argv, "--sync", sync, "--quiet"]))
        except SystemExit:
            rows.append({"sync": sync, "ok": False})
    comm = MPI.COMM_WORLD
    if comm.Get_rank() == 0:
        first = next((r for r in rows if "ranks" in r), {})
        print(f"# data-parallel MLP, {comm.Get_size()} ranks, algorithm "
              f"{first.get('algorithm', '?')}; bytes = payload each rank hands to the "
              f"collectives per step")
        print(f"{'sync':<9} {'ms/step':>8} {'bytes/step':>10} {'final loss':>11} "
              f"{'rel. diff':>9} {'tolerance':>9} {'identical':>9} {'check':>5}")
        for r in rows:
            if "ranks" not in r:
                print(f"{r['sync']:<9} {'':>8} {'':>10} {'':>11} {'':>9} {'':>9} {'':>9} FAIL")
                continue
            print(f"{r['sync']:<9} {r['ms_per_step']:8.2f} {r['bytes_per_step']:10d} "
                  f"{r['loss']:11.6f} {r['relative_error']:9.1e} {r['tolerance']:9.0e} "
                  f"{str(r['identical']):>9} {'ok' if r['ok'] else 'FAIL':>5}")
        print(f"# single-process full-batch final loss: {first.get('reference', float('nan')):.6f}")
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
