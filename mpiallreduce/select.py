"""What ``algorithm="auto"`` picks for (p, bytes, op, topology).

Where every rank is on one node, ``auto`` runs the shared-memory transport ``shm`` within the
limits of :data:`SHM_RULES` (:func:`one_node_choice`). Elsewhere, an algorithm written in
Python over point-to-point messages pays about 1 µs of interpreter time per step that MPI's
native collective does not, so ``auto`` picks ``native`` unless a measured crossover says a
schedule wins (docs/performance.md): from 32 MiB per rank,
``ring_segmented`` beat Open MPI 5.0.11's own ``Allreduce`` by 1.6-3.4x at 2 to 4 ranks with
every schedule faster than native there, and the narrower ranges of :data:`RULES`. Elsewhere
the ratios straddle 1 and ``native`` stays. Re-measure with ``python -m mpiallreduce.bench``
(or write a table with ``mpiallreduce.tune``) on another machine or MPI before trusting these
thresholds there; ``algorithm=`` overrides them.

Measured tables. ``mpirun -n N python -m mpi4py -m mpiallreduce.tune`` measures every algorithm
and native on this machine at N ranks and writes a decision table; :func:`choose` consults the
table for the communicator size and op class (commutative or not) and falls back to the built-in
rule above when there is none (above 8 ranks, where nothing was measured here, the cost
model's prediction instead: :func:`model_choice`), or the file is missing or bad (a bad file gives one
``RuntimeWarning`` and is ignored). The file is :func:`default_path`
(``$XDG_CACHE_HOME/mpiallreduce/tuning.json``, ``~/.cache/...`` without it) unless
``MPIALLREDUCE_TUNING=path`` names another; ``MPIALLREDUCE_TUNING=off`` ignores every table. It
is read once per process and path (:func:`reload` forgets it). Format::

    {"format": "mpiallreduce-tuning/1",
     "tables": [{"nranks": 2, "mpi_library": "...", "date": "...", "repeats": 5,
                 "classes": {"commutative": [{"min_bytes": 0, "max_bytes": 65536,
                                              "algorithm": "native"},
                                             {"min_bytes": 65536, "max_bytes": null,
                                              "algorithm": "ring_segmented"}],
                             "noncommutative": [...]},
                 "medians_us": {...}}]}

Ranges are half-open ``[min_bytes, max_bytes)`` in bytes per rank, sorted and contiguous from 0,
the last open-ended; algorithms are registered names or ``native``, and the non-commutative
class names only order-keeping ones. Every rank must see the same file contents (a shared file
system, or the same file copied to every node): the choice is a pure function of the arguments
and the file, so ranks that read different files could pick different algorithms and hang.
:func:`digest` names the contents for a cross-rank check.
"""

from __future__ import annotations

import functools
import json
import os
import warnings
import zlib

from . import algorithms
from .ops import Reducer

#: bytes per rank from which ``auto`` prefers the pipelined ring to native: there it beat Open
#: MPI's default at 2 to 4 ranks, as every schedule did (docs/performance.md, "Performance").
LARGE_MESSAGE_BYTES = 32 << 20
#: further crossovers of the built-in rule, commutative ops only: (fewest ranks, most ranks,
#: least bytes, most bytes (exclusive, None: no limit), algorithm). Each range is where the
#: schedule beat Open MPI's default in every interleaved bench round both out of place and in
#: place; outside them the margins straddle 1 and ``native`` stays (measured 2026-11-30,
#: docs/performance.md "Performance").
RULES = (
    (2, 2, 16 << 10, 128 << 10, "recursive_doubling"),
    (2, 2, 4 << 20, None, "ring_segmented"),
    (3, 5, 2 << 10, 64 << 10, "knomial"),
)
#: communicator sizes (fewest, most) and bytes per rank (least, most (exclusive); None: no
#: limit) where ``auto`` runs the shared-memory transport when every rank is on one node
#: (:mod:`.shm`): it sends no message and has no agreement round. At 2 ranks it stops at
#: 16 MiB: from there a private message streams through memory, and the pipelined ring, which
#: moves fewer bytes, is as fast (docs/performance.md, "Where shm stops").
SHM_RULES = ((2, 2, 0, 16 << 20), (3, 8, 0, None))
#: the same, in place only: with no input to read beside the result, ``shm`` stays ahead of
#: native and the pipelined ring up to 32 MiB at 2 ranks (docs/performance.md, "Where shm
#: stops").
SHM_IN_PLACE_RULES = ((2, 2, 16 << 20, 32 << 20),)
#: with more ranks than cores (``os.cpu_count()``, the same on every rank of a node) a waiting
#: rank gives its core away and a small call pays scheduler time slices, so there ``auto`` runs
#: ``shm`` only from this many bytes (4 ranks on 2 cores: docs/performance.md, "Shared memory").
SHM_OVERSUBSCRIBED_BYTES = 128 << 10
#: On one node, out of place only: (fewest ranks, most ranks, least bytes, most bytes
#: (exclusive), algorithm) where a schedule that reduces straight out of ``sendbuf`` beats
#: ``shm``. Empty: at 2 ranks ``shm`` beat ``recursive_doubling`` at 16 KiB-2 MiB
#: (docs/performance.md, "Where shm stops"); ``python -m mpiallreduce.tune`` measures yours.
ONE_NODE_OUT_OF_PLACE_RULES: tuple = ()
#: (fewest ranks, most ranks, most bytes (exclusive)) where the drop-in's ``Allreduce_init``
#: (``mar.Comm``, ``algorithm="auto"``) returns MPI's own persistent request instead of a plan
#: whose run would be ``shm``: below 4 KiB Open MPI 5's persistent allreduce keeps a fast path
#: that the shm plan's Start + Wait does not reach (2 ranks, scripts/call_cost.py, 2026-12-01).
PERSISTENT_NATIVE_RULES = ((2, 2, 4 << 10),)
#: where native saturates 8/16-bit sums, ``auto`` runs recursive doubling below this many bytes
#: per rank and the ring from here on (the results are modular either way).
MODULAR_RING_BYTES = 1 << 16
#: communicator sizes the crossover above was measured at; larger ones ask the cost model.
MEASURED_RANKS = 8
#: how much faster than native the cost model must predict a schedule before ``auto`` runs it
#: where nothing was measured: the model came within +-25% of the bench in at best half of the
#: rows here (docs/model.md), and its native is coll/tuned's flat table, while Open MPI with
#: peers on other nodes runs coll/han, which it does not model.
MODEL_MARGIN = 1.25


#: the environment variable that names the table file ("off": use none).
TUNING_ENV = "MPIALLREDUCE_TUNING"
#: the file format tag, checked on load.
FORMAT = "mpiallreduce-tuning/1"
OP_CLASSES = ("commutative", "noncommutative")


def choose(nranks: int, nbytes: int, reducer: Reducer, topology=None,
           use_tables: bool = True) -> str:
    """Return the algorithm name ``auto`` uses; identical on every rank for identical arguments
    (and the same table file, see the module docstring).

    Never returns an algorithm that refuses the op: non-commutative ops get ``native`` or,
    from a measured table, an order-keeping algorithm. ``use_tables=False``: the built-in
    rules and the model only.
    """
    if nranks > 1 and nbytes > 0 and use_tables:
        picked = lookup(tables(), nranks, nbytes, reducer.commutative)
        if picked is not None:
            return picked
    if nranks > MEASURED_RANKS:
        return model_choice(nranks, nbytes, reducer, topology)
    if nranks > 1 and reducer.commutative:
        for low, high, least, most, name in RULES:
            if low <= nranks <= high and least <= nbytes and (most is None or nbytes < most):
                return name
        if nbytes >= LARGE_MESSAGE_BYTES:
            return "ring_segmented"
    return "native"


def one_node_choice(nranks: int, nbytes: int, in_place: bool,
                    commutative: bool = True, shared: bool = False) -> str | None:
    """What ``auto`` runs if every rank is on one node (the same on every rank for the same
    arguments): ``shm``, an out-of-place schedule of :data:`ONE_NODE_OUT_OF_PLACE_RULES`
    (commutative ops), or None (the rules for any topology decide). None where a measured
    tuning table covers ``nranks``: the table (which may name ``shm``) decides. ``shared``: an
    in-place call on node-shared memory (the words of a reproducible sum), which ``shm`` reduces
    with no copy in or out: no upper size limit (the limits above were measured on private
    arrays, which ``shm`` copies in and out; shared arrays ran at 0.02-0.36 of native's time)."""
    if nranks in tables():
        return None
    if shared:
        in_place = True
    if not in_place and commutative:
        for low, high, least, most, name in ONE_NODE_OUT_OF_PLACE_RULES:
            if low <= nranks <= high and least <= nbytes < most:
                return name
    oversubscribed = nranks > (os.cpu_count() or 1)
    for low, high, least, most in SHM_RULES + (SHM_IN_PLACE_RULES if in_place else ()):
        if oversubscribed:
            least = max(least, SHM_OVERSUBSCRIBED_BYTES)
        if low <= nranks <= high and least <= nbytes and (most is None or shared
                                                          or nbytes < most):
            return "shm"
    return None


def persistent_native(nranks: int, nbytes: int) -> bool:
    """Does the drop-in's ``Allreduce_init`` return MPI's own request where ``auto`` would run
    ``shm`` (:data:`PERSISTENT_NATIVE_RULES`)? Not where a tuning table covers ``nranks``."""
    if nranks in tables():
        return False
    return any(low <= nranks <= high and nbytes < most
               for low, high, most in PERSISTENT_NATIVE_RULES)


def shm_fits(nranks: int, nbytes: int, in_place: bool = True) -> bool:
    """Would ``auto`` run ``shm`` for this size and mode, if every rank is on one node?"""
    return one_node_choice(nranks, nbytes, in_place) == "shm"


def model_choice(nranks: int, nbytes: int, reducer: Reducer, topology=None) -> str:
    """Fallback where nothing was measured: the cost model's fastest (built-in machine), if
    it is predicted at least :data:`MODEL_MARGIN` times faster than native, else native.

    Native is modelled as Open MPI's own decision in C (no interpreter cost, a copy of the
    message per call in its Rabenseifner), so it wins small messages and schedules win large
    ones. Non-commutative ops get native (it keeps rank order). Memoized per power-of-two size
    bucket, so a repeated question is a dictionary lookup.
    """
    if not reducer.commutative:
        return "native"  # the model times order-keeping schedules too, but native keeps order
    bucket = 1 << (max(int(nbytes), 1).bit_length() - 1)
    return _model_choice(nranks, bucket, True, topology)


@functools.lru_cache(maxsize=1024)
def _model_choice(nranks: int, bucket: int, commutative: bool, topology) -> str:
    from . import model

    best = model.choose(nranks, bucket, commutative, topology)
    if best != "native" and (model.predict("native", nranks, bucket, topology).time
                             < MODEL_MARGIN * model.predict(best, nranks, bucket, topology).time):
        return "native"
    return best


def lookup(loaded: dict, nranks: int, nbytes: int, commutative: bool) -> str | None:
    """Return the algorithm of the table for ``nranks`` and the op class at ``nbytes``, or None."""
    ranges = loaded.get(nranks, {}).get(OP_CLASSES[0] if commutative else OP_CLASSES[1], ())
    for low, high, name in ranges:
        if low <= nbytes and (high is None or nbytes < high):
            return name
    return None


def default_path() -> str:
    """Return where ``tune`` writes and ``auto`` reads the table when the environment says nothing."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "mpiallreduce", "tuning.json")


def table_path() -> str | None:
    """Return the table file ``auto`` reads: ``$MPIALLREDUCE_TUNING``, else :func:`default_path`;
    None when the variable is ``off``."""
    env = os.environ.get(TUNING_ENV, "").strip()
    if env.lower() == "off":
        return None
    return env or default_path()


def tables() -> dict:
    """Return the parsed tables of :func:`table_path` (loaded once per path; {} if none)."""
    path = table_path()
    return {} if path is None else _load(path)


def reload() -> None:
    """Forget loaded tables, so the next :func:`choose` reads the file again."""
    _load.cache_clear()
    _digest.cache_clear()


def digest() -> int:
    """Return a CRC of the table file's bytes (0 without one), read once per process and path
    like the table itself; the agreement check compares it across ranks for ``auto``."""
    return _digest(table_path())


@functools.lru_cache(maxsize=8)
def _digest(path: str | None) -> int:
    if path is None:
        return 0
    try:
        with open(path, "rb") as file:
            return zlib.crc32(file.read()) & 0x7FFFFFFF
    except OSError:
        return 0


@functools.lru_cache(maxsize=8)
def _load(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as file:
            text = file.read()
    except FileNotFoundError:
        return {}
    except OSError as exc:
        warnings.warn(f"cannot read tuning table {path}: {exc}; auto uses its built-in rule",
                      RuntimeWarning, stacklevel=3)
        return {}
    try:
        return parse(json.loads(text))
    except ValueError as exc:  # json.JSONDecodeError is a ValueError
        warnings.warn(f"ignoring tuning table {path}: {exc}; auto uses its built-in rule "
                      f"(rerun python -m mpiallreduce.tune)", RuntimeWarning, stacklevel=3)
        return {}


def parse(data) -> dict[int, dict[str, tuple[tuple[int, int | None, str], ...]]]:
    """Check a loaded table file; return nranks -> op class -> ((min, max, algorithm), ...).

    Raises ValueError naming the first problem.
    """
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"not a {FORMAT} file")
    entries = data.get("tables")
    if not isinstance(entries, list):
        raise ValueError("'tables' must be a list")
    parsed = {}
    for entry in entries:
        nranks = entry.get("nranks") if isinstance(entry, dict) else None
        if isinstance(nranks, bool) or not isinstance(nranks, int) or nranks < 1:
            raise ValueError(f"every table needs an integer nranks >= 1, got {nranks!r}")
        if nranks in parsed:
            raise ValueError(f"two tables for nranks {nranks}")
        classes = entry.get("classes")
        if not isinstance(classes, dict) or set(classes) - set(OP_CLASSES):
            raise ValueError(f"nranks {nranks}: 'classes' must map {' and/or '.join(OP_CLASSES)} "
                             f"to ranges")
        parsed[nranks] = {op_class: _ranges(nranks, op_class, ranges)
                          for op_class, ranges in classes.items()}
    return parsed


def _ranges(nranks: int, op_class: str, ranges) -> tuple[tuple[int, int | None, str], ...]:
    where = f"nranks {nranks}, {op_class}"
    if not isinstance(ranges, list) or not ranges:
        raise ValueError(f"{where}: expected a non-empty list of ranges")
    checked, expect = [], 0
    for item in ranges:
        low, high, name = (item.get(k) for k in ("min_bytes", "max_bytes", "algorithm")) \
            if isinstance(item, dict) else (None, None, None)
        if low != expect or isinstance(low, bool):
            raise ValueError(f"{where}: ranges must be contiguous from 0; expected min_bytes "
                             f"{expect}, got {low!r}")
        if high is not None and (isinstance(high, bool) or not isinstance(high, int)
                                 or high <= low):
            raise ValueError(f"{where}: max_bytes {high!r} must be an integer above {low} or null")
        if name not in ("native", "shm") and name not in algorithms.REGISTRY:
            raise ValueError(f"{where}: unknown algorithm {name!r}")
        if op_class == "noncommutative" and name not in ("native", "shm") and \
                algorithms.REGISTRY[name].commutative_only:
            raise ValueError(f"{where}: {name!r} reorders operands")
        checked.append((low, high, name))
        expect = high
        if high is None:
            break
    if expect is not None or len(checked) != len(ranges):
        raise ValueError(f"{where}: the last range must have max_bytes null, and only the last")
    return tuple(checked)


def write_table(path: str, table: dict) -> None:
    """Write ``table`` (one communicator size) into the file at ``path``, replacing that size's
    table and keeping the others; atomic (a reader sees the old file or the new one)."""
    parse({"format": FORMAT, "tables": [table]})  # never write what choose would refuse
    tables_ = []
    try:
        with open(path, encoding="utf-8") as file:
            old = json.load(file)
        parse(old)
        tables_ = [t for t in old["tables"] if t["nranks"] != table["nranks"]]
    except (OSError, ValueError):
        pass  # no file, or one choose ignores anyway: start afresh
    tables_ = sorted([*tables_, table], key=lambda t: t["nranks"])
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    temporary = f"{path}.tmp{os.getpid()}"
    with open(temporary, "w", encoding="utf-8") as file:
        json.dump({"format": FORMAT, "tables": tables_}, file, indent=1)
        file.write("\n")
    os.replace(temporary, path)
    reload()
