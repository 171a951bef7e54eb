"""Write a measurement as a result file under ``docs/results/``, with where it came from.

Every figure the README and the docs quote lives in one of these files; ``scripts/figures.py``
renders them into the pages, so two pages cannot disagree and a reader can trace each number to
the command, machine, MPI library and commit that produced it. A measuring script calls
``write`` on rank 0 once it has its rows::

    from _results import write
    write("call_cost", "What one call costs against comm.Allreduce",
          columns=["size", "mar.allreduce / comm.Allreduce"], rows=[["8 B", 0.57]],
          formats=["{}", "{:.2f}"], ranks=2, notes="medians of 3 interleaved rounds")

A file's schema (``SCHEMA``): ``title``, ``provenance`` (``machine``, ``cpu``, ``cores``, ``mpi``,
``mpi4py``, ``numpy``, ``python``, ``commit``, ``date``, ``command``, ``ranks``, ``load``),
``columns``, ``rows``, optional ``formats`` (one ``str.format`` pattern per column), ``values``
(named single figures that prose may quote) and ``notes``.
"""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import platform
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results"
SCHEMA = 1
PROVENANCE_KEYS = ("machine", "cpu", "cores", "mpi", "mpi4py", "numpy", "python", "commit", "date",
                   "command", "ranks", "load")


def _memory_gib() -> float | None:
    try:
        for line in pathlib.Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def library_name(text: str) -> str:
    """MPI's library string cut to its name and version ("Open MPI v5.0.11", "MPICH 4.3.0")."""
    first = text.replace("\x00", "").strip().splitlines()[0].split(",")[0]
    words = first.replace("Version:", "").split()
    return " ".join(words[:3])


def _commit() -> str:
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "describe", "--always", "--dirty"],
                             capture_output=True, text=True, timeout=10, check=False)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def provenance(ranks: int, command: str | None = None) -> dict:
    """Where a measurement ran: the machine, the libraries, the commit, the command and the load
    at the time (the 1-, 5- and 15-minute load averages: a busy machine's figures say so)."""
    import numpy
    from mpi4py import MPI

    from mpiallreduce.picks import cpu_model

    cores = os.cpu_count()
    mem = _memory_gib()
    return {
        "machine": f"{platform.system()} {platform.machine()}, {cores} cores"
                   + (f", {mem} GiB" if mem else ""),
        "cpu": cpu_model(),
        "cores": cores,
        "mpi": library_name(MPI.Get_library_version()),
        "mpi4py": __import__("mpi4py").__version__,
        "numpy": numpy.__version__,
        "python": platform.python_version(),
        "commit": _commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "command": command or " ".join(["python"] + sys.argv),
        "ranks": ranks,
        "load": [round(v, 2) for v in os.getloadavg()],
    }


def write(name: str, title: str, *, columns: list[str], rows: list[list], ranks: int,
          formats: list[str] | None = None, values: dict | None = None, notes: str = "",
          command: str | None = None, extra: dict | None = None) -> pathlib.Path:
    """Write ``docs/results/<name>.json`` (call on one rank) and return its path."""
    if formats is not None and len(formats) != len(columns):
        raise ValueError(f"{len(formats)} formats for {len(columns)} columns")
    for row in rows:
        if len(row) != len(columns):
            raise ValueError(f"row {row!r} has {len(row)} cells for {len(columns)} columns")
    doc = {"schema": SCHEMA, "title": title, "provenance": provenance(ranks, command),
           "columns": columns, "rows": rows}
    if formats is not None:
        doc["formats"] = formats
    if values:
        doc["values"] = values
    if notes:
        doc["notes"] = notes
    if extra:
        doc.update(extra)
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    tmp.replace(path)
    return path
