"""What ``auto`` learned, kept across jobs per machine: a second job starts with the first's picks.

A learned case (:mod:`mpiallreduce.learn`) costs its first calls; the same case on the same
kind of machine, MPI and layout of ranks decides the same way next time, so the decision is
written down and reused. The file (:func:`path`: ``$MPIALLREDUCE_LEARNED``, else
``$XDG_CACHE_HOME/mpiallreduce/learned.json``; ``MPIALLREDUCE_LEARNED=off`` keeps nothing)
holds, per machine :func:`fingerprint` (CPU model, core count, MPI library and version,
mpiallreduce's version, nodes and ranks per node), each case's verdict and when it was made::

    {"format": "mpiallreduce-learned/1",
     "machines": {"<fingerprint key>": {"fingerprint": {...},
                                        "cases": {"p2 8388608 out commutative float64":
                                                  {"pick": "recursive_doubling", "verdict": {...},
                                                   "agreed_us": {...}, "learned": "<UTC time>"}}}}}

Agreement by construction: rank 0 alone reads the file, once per communicator, and broadcasts
the picks of its machine's fingerprint (one ``bcast``, at the first learning case of the
communicator, which every rank reaches at the same call); every rank then starts from the same
picks. Rank 0 alone writes, right after a decision every rank agreed on (the rounds' times were
made every rank's first): it reads the file again, replaces the case, and renames a complete
temporary file over it, so a reader never sees half a file and jobs running side by side lose
at most one another's latest case, never the file.

Re-checked on a schedule: a pick older than ``MPIALLREDUCE_LEARNED_DAYS`` days (default
:data:`MAX_DAYS`) is dropped when read and the case learned again (a new MPI, firmware or load
pattern can reverse a verdict; a version or fingerprint change starts afresh anyway). So is a
pick whose incumbent is no longer what the rules choose (the rules changed under it). A file of
another format, or one that cannot be read, gives one ``RuntimeWarning`` and is ignored (and
rewritten at the next decision).

``python -m mpiallreduce`` says where the file is and what it holds for this machine;
``python -m mpiallreduce --forget`` deletes it (:func:`forget`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import json
import os
import pathlib
import platform
import tempfile
import warnings

from mpi4py import MPI

from . import decide
from ._env import env_float
from ._version import __version__

#: the file's format; another is ignored (and replaced at the next write)
FORMAT = "mpiallreduce-learned/1"
#: where the file is ("off": keep nothing), and after how many days a pick is learned again
PATH_ENV, DAYS_ENV = "MPIALLREDUCE_LEARNED", "MPIALLREDUCE_LEARNED_DAYS"
#: a week: long enough that a job run daily never learns twice, short enough that a changed
#: machine (an MPI update, other tenants) is re-measured within days
MAX_DAYS = 7.0


def path() -> str | None:
    """The file the picks live in, or None with ``MPIALLREDUCE_LEARNED=off``."""
    value = os.environ.get(PATH_ENV, "").strip()
    if value.lower() == "off":
        return None
    if value:
        return value
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "mpiallreduce", "learned.json")


def max_days() -> float:
    """``MPIALLREDUCE_LEARNED_DAYS`` (a number >= 0; 0 reuses nothing), else :data:`MAX_DAYS`."""
    return env_float(DAYS_ENV, MAX_DAYS, 0.0)


@functools.lru_cache(maxsize=1)
def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``; elsewhere what ``platform`` knows)."""
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def fingerprint(node_sizes) -> dict:
    """What makes one machine's verdicts another's: the CPU model and core count, the MPI
    library and its version, mpiallreduce's version, and how the ranks sit on nodes (the
    communicator size is part of each case)."""
    library = MPI.Get_library_version().strip().splitlines()[0].rstrip("\x00").strip()
    sizes = tuple(node_sizes)
    return {"cpu": cpu_model(), "cores": os.cpu_count(), "mpi": library,
            "mpiallreduce": __version__, "nodes": len(sizes),
            "ranks_per_node": "+".join(map(str, sorted(set(sizes))))}


def machine_key(finger: dict) -> str:
    return " | ".join(f"{name}={finger[name]}" for name in sorted(finger))


def case_key(nranks: int, key: tuple) -> str:
    """A learning case (``learn.case``, no topology passed) on ``nranks`` ranks, as text."""
    bucket, in_place, commutative, deviates, dtype, _ = key
    import numpy as np

    return " ".join((f"p{nranks}", str(bucket), "in" if in_place else "out",
                     "commutative" if commutative else "noncommutative",
                     np.dtype(dtype).name + (" saturating" if deviates else "")))


def _read(file: str) -> dict:
    """The file's contents ({} where there is none; a bad one warns once and counts as none)."""
    try:
        with open(file, encoding="utf-8") as handle:
            data = json.load(handle)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        warnings.warn(f"ignoring mpiallreduce's learned picks in {file}: {exc}",
                      RuntimeWarning, stacklevel=3)
        return {}
    if not isinstance(data, dict) or data.get("format") != FORMAT \
            or not isinstance(data.get("machines"), dict):
        warnings.warn(f"ignoring mpiallreduce's learned picks in {file}: not of format "
                      f"{FORMAT}", RuntimeWarning, stacklevel=3)
        return {}
    return data


def _age_days(stamp: str, now: datetime.datetime) -> float:
    try:
        then = datetime.datetime.fromisoformat(stamp)
    except (TypeError, ValueError):
        return float("inf")
    return (now - then).total_seconds() / 86400.0


class Memory:
    """One communicator's view of the file: the fresh picks of its machine, by case.

    Made by :func:`load` (collective); :meth:`get` answers every rank alike, :meth:`put`
    writes on rank 0 only."""

    def __init__(self, file: str | None, finger: dict, cases: dict, rank: int):
        self.file, self.fingerprint, self.cases, self.rank = file, finger, cases, rank

    def get(self, nranks: int, key: tuple, ruled: str) -> dict | None:
        """The remembered decision of a case, or None (none kept, or its incumbent is no
        longer the rules' choice)."""
        entry = self.cases.get(case_key(nranks, key))
        if entry is None or entry.get("verdict", {}).get("incumbent") != ruled:
            return None
        return entry

    def put(self, nranks: int, key: tuple, verdict: decide.Verdict, agreed: dict) -> None:
        """Keep an agreed decision (rank 0 writes; the others only note it)."""
        name = case_key(nranks, key)
        entry = {"pick": verdict.pick, "verdict": _verdict_dict(verdict),
                 "agreed_us": {k: round(1e6 * t, 3) for k, t in agreed.items()},
                 "learned": datetime.datetime.now(datetime.timezone.utc).isoformat(
                     timespec="seconds")}
        self.cases[name] = entry
        if self.rank != 0 or self.file is None:
            return
        try:
            _update(self.file, self.fingerprint, name, entry)
        except OSError as exc:  # a read-only or full cache: learning still works, once per job
            warnings.warn(f"could not keep mpiallreduce's learned pick in {self.file}: {exc}",
                          RuntimeWarning, stacklevel=2)


def _verdict_dict(verdict: decide.Verdict) -> dict:
    data = dataclasses.asdict(verdict)
    # JSON has no NaN: a margin or noise that was not measured is kept as null
    return {k: (None if isinstance(v, float) and v != v else v) for k, v in data.items()}


def verdict_of(entry: dict) -> decide.Verdict:
    """The :class:`.decide.Verdict` a kept entry holds."""
    data = dict(entry["verdict"])
    for name in ("margin", "noise"):
        if data.get(name) is None:
            data[name] = float("nan")
    return decide.Verdict(**data)


def _update(file: str, finger: dict, name: str, entry: dict) -> None:
    """Replace one case of one machine in the file, atomically (write aside, then rename)."""
    data = _read(file) or {"format": FORMAT, "machines": {}}
    machine = data["machines"].setdefault(machine_key(finger), {"fingerprint": finger,
                                                                 "cases": {}})
    machine["fingerprint"] = finger
    machine.setdefault("cases", {})[name] = entry
    folder = os.path.dirname(os.path.abspath(file))
    os.makedirs(folder, exist_ok=True)
    handle, temporary = tempfile.mkstemp(prefix=".learned-", suffix=".json", dir=folder)
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as out:
            json.dump(data, out, indent=1, sort_keys=True)
            out.write("\n")
        os.replace(temporary, file)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


def fresh_cases(data: dict, finger: dict, days: float) -> dict:
    """The cases of ``finger``'s machine in ``data`` (the file's contents) no older than
    ``days``."""
    machine = data.get("machines", {}).get(machine_key(finger))
    if not isinstance(machine, dict):
        return {}
    now = datetime.datetime.now(datetime.timezone.utc)
    return {name: entry for name, entry in machine.get("cases", {}).items()
            if isinstance(entry, dict) and _age_days(entry.get("learned"), now) <= days}


def load(comm: MPI.Intracomm, node_sizes) -> Memory:
    """Read the machine's picks on rank 0 and give every rank the same (collective: one
    ``bcast`` over ``comm``). A bad setting raises on every rank alike."""
    rank = comm.Get_rank()
    finger = fingerprint(node_sizes)
    file = path()
    cases, error = {}, None
    if rank == 0:
        try:
            days = max_days()
            if file is not None and days > 0:
                cases = fresh_cases(_read(file), finger, days)
        except ValueError as exc:
            error = str(exc)
    if comm.Get_size() > 1:
        cases, error = comm.bcast((cases, error), root=0)
    if error is not None:
        raise ValueError(error)
    return Memory(file, finger, cases, rank)


def describe(node_sizes) -> list[str]:
    """Lines for ``python -m mpiallreduce``: where the picks live, and what they hold for
    this machine (its layout of ranks first, then the others it was run with)."""
    file = path()
    if file is None:
        return [f"learned picks: not kept ({PATH_ENV}=off)"]
    finger = fingerprint(node_sizes)
    data = _read(file) if os.path.exists(file) else {}
    days = max_days()
    machines = data.get("machines", {})
    same = {name: machine for name, machine in machines.items()
            if isinstance(machine, dict) and _same_machine(machine.get("fingerprint", {}), finger)}
    lines = [f"learned picks: {file} ({len(same)} layout(s) of ranks on this machine, "
             f"{len(machines) - len(same)} other machine(s); picks older than {days:g} days "
             f"are learned again; python -m mpiallreduce --forget deletes them)"]
    mine = machine_key(finger)
    for name in sorted(same, key=lambda name: name != mine):
        machine = same[name]
        layout = machine["fingerprint"]
        fresh = fresh_cases(data, layout, days)
        lines.append(f"  {layout.get('nodes')} node(s) of {layout.get('ranks_per_node')} "
                     f"rank(s){' (this run)' if name == mine else ''}: "
                     f"{len(fresh)} fresh case(s)")
        for case in sorted(fresh, key=_case_order):
            entry = fresh[case]
            noise = "" if entry.get("verdict", {}).get("decided", True) \
                else " (within noise: the rules' choice kept)"
            lines.append(f"    {case}: {entry.get('pick')}{noise}")
    return lines


def _same_machine(kept: dict, finger: dict) -> bool:
    """The same CPU, cores, MPI and mpiallreduce (the layout of ranks may differ)."""
    return all(kept.get(name) == finger[name] for name in ("cpu", "cores", "mpi", "mpiallreduce"))


def _case_order(name: str) -> tuple:
    parts = name.split()
    try:
        return (int(parts[0][1:]), int(parts[1]), parts[2:])
    except (IndexError, ValueError):
        return (0, 0, parts)


def forget() -> str | None:
    """Delete the picks file; return its path if there was one."""
    file = path()
    if file is None or not os.path.exists(file):
        return None
    os.unlink(file)
    return file
