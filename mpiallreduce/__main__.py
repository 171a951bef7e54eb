"""``python -m mpiallreduce``: what the package sees (versions, MPI, ranks, nodes, deviations).

Like ``ompi_info`` or ``torch.utils.collect_env``: run it alone or under ``mpirun``; rank 0
prints, every rank takes part in the topology discovery. Exit status 0.
``python -m mpiallreduce --forget`` deletes the picks ``auto`` learned and kept
(:mod:`mpiallreduce.picks`).
"""

from __future__ import annotations

import os
import platform
import sys

import numpy as np

#: what :func:`clean` drops: the C0 controls but tab and newline, and DEL
_CONTROLS = dict.fromkeys([*(c for c in range(0x20) if chr(c) not in "\t\n"), 0x7F])


def clean(text: str) -> str:
    """Return ``text`` without control characters other than newline and tab.

    MPI libraries hand back C strings with their terminator (Open MPI's
    ``MPI_Get_library_version`` ends with a NUL), which makes ``grep`` call the output binary.
    """
    return text.translate(_CONTROLS)


def report(comm=None) -> list[str]:
    """Return the lines to print, clean text (:func:`clean`; collective over ``comm``, default
    COMM_WORLD)."""
    import mpi4py
    from mpi4py import MPI

    import mpiallreduce as mar

    from . import _form, ops, picks, select
    from .topology import RANKS_PER_NODE_ENV

    comm = MPI.COMM_WORLD if comm is None else comm
    topology = mar.Topology.from_comm(comm)
    levels = {MPI.THREAD_SINGLE: "single", MPI.THREAD_FUNNELED: "funneled",
              MPI.THREAD_SERIALIZED: "serialized", MPI.THREAD_MULTIPLE: "multiple"}
    library = " ".join(MPI.Get_library_version().split())
    simulated = os.environ.get(RANKS_PER_NODE_ENV)
    deviations = [f"{op} on {dtype.name}" for dtype in ops.NARROW_INTS for op in ("SUM", "PROD")
                  if ops.native_deviates(op, dtype)]
    table = getattr(select, "table_path", lambda: None)()
    lines = [
        f"mpiallreduce {mar.__version__} ({os.path.dirname(mar.__file__)})",
        f"python {platform.python_version()}, numpy {np.__version__}, mpi4py {mpi4py.__version__}",
        f"MPI library: {library[:160].strip()}",
        f"MPI standard: {'.'.join(map(str, MPI.Get_version()))}; thread level: "
        f"{levels.get(MPI.Query_thread(), MPI.Query_thread())} "
        f"(threads may use different communicators at once only at 'multiple')",
        f"ranks: {comm.Get_size()}{_launcher_note(comm)}; nodes: {topology.nnodes} of "
        f"{'+'.join(map(str, topology.node_sizes))} rank(s)"
        + (f" (simulated: {RANKS_PER_NODE_ENV}={simulated})" if simulated else
           " (MPI_COMM_TYPE_SHARED)"),
        f"call path: {_form.describe()}",
        f"algorithms: {', '.join(mar.ALGORITHMS)}",
        "auto: " + _auto_source(table),
        "native deviations: " + (
            f"saturating {', '.join(deviations)} (auto runs a schedule for these instead)"
            if deviations else "none found (8/16-bit SUM and PROD wrap as C does)"),
        "learning: " + _learning(),
        *picks.describe(topology.node_sizes),
    ]
    return [clean(line) for line in lines]


def _auto_source(table: str | None) -> str:
    """Where auto's choices come from: a tuning table that exists, else the built-in rules."""
    if table is None:
        return "built-in rules (MPIALLREDUCE_TUNING=off)"
    if not os.path.exists(table):
        return (f"built-in rules (no tuning table at {table}; write one with "
                f"mpirun -n N python -m mpi4py -m mpiallreduce.tune)")
    return f"tuning table {table} (built-in rules for the rank counts it does not cover)"


def _learning() -> str:
    from . import select

    settings = select.learn_settings()
    if not settings.on:
        return f"off ({select.LEARN_ENV}=off: auto runs the rules' choices)"
    return (f"on (a repeated auto call times its candidates in its first calls, "
            f"{settings.runs} rounds each; {select.LEARN_ENV}=off turns it off)")


def _launcher_note(comm) -> str:
    """Say so when this is one process started without a launcher (everything runs as 1 rank)."""
    if comm.Get_size() > 1:
        return ""
    launched = any(key.startswith(("OMPI_COMM_WORLD", "PMI_", "PMIX_RANK", "HYDRA_"))
                   for key in os.environ)
    return "" if launched else " (one process, no launcher: launch under mpirun -n N for more)"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help"):
        print(clean(__doc__.strip()))
        return 0
    if argv == ["--forget"]:
        from . import picks

        gone = picks.forget()
        print(clean(f"deleted the learned picks in {gone}" if gone else
                    f"no learned picks to delete ({picks.path() or picks.PATH_ENV + '=off'})"))
        return 0
    if argv:
        print(clean(f"python -m mpiallreduce: takes no arguments but --forget, got "
                    f"{' '.join(argv)} (the bench is python -m mpiallreduce.bench)"),
              file=sys.stderr)
        return 2
    from mpi4py import MPI

    lines = report()
    if MPI.COMM_WORLD.Get_rank() == 0:
        print("\n".join(lines), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
