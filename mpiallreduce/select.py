"""What ``algorithm="auto"`` picks for (p, bytes, op, topology).

An algorithm written in Python over point-to-point messages pays about 1 µs of interpreter
time per step that MPI's native collective does not, so ``auto`` picks ``native`` unless a
measured crossover says a schedule wins (docs/performance.md): from 32 MiB per rank,
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

#: bytes per rank from which ``auto`` prefers the pipelined ring to native (measured crossover).
LARGE_MESSAGE_BYTES = 32 << 20
#: further measured crossovers of the built-in rule, commutative ops only: (fewest ranks, most
#: ranks, least bytes, most bytes (exclusive, None: no limit), algorithm). Each range is where
#: the schedule beat Open MPI 5.0.11's default ``Allreduce`` in every one of three interleaved
#: bench rounds both out of place and in place (float32 SUM, this 2-core VM, docs/performance.md
#: "Performance"): at 2 ranks recursive_doubling 1.02-1.14x in place and 2.3x out of place at
#: 16-128 KiB, ring_segmented 1.08-1.16x in place and 1.6-1.8x out of place from 4 MiB; at 3,
#: 4 and 5 ranks knomial 1.02-1.9x at 2-32 KiB (3 and 5 ranks to 64 KiB). Outside them the
#: margins straddle 1 in one mode or the other and ``native`` stays.
RULES = (
    (2, 2, 16 << 10, 128 << 10, "recursive_doubling"),
    (2, 2, 4 << 20, None, "ring_segmented"),
    (3, 5, 2 << 10, 64 << 10, "knomial"),
)
#: communicator sizes (fewest, most) and bytes per rank (least, most; None: no limit) where
#: ``auto`` runs the shared-memory transport when every rank is on one node (:mod:`.shm`).
#: Measured at 2 ranks (float64 SUM, this 2-core VM under load from other jobs, interleaved
#: rounds, README "Shared memory"): shm plans took 0.37-0.64 of Open MPI's default Allreduce
#: at 8 B and 0.2-0.6 from 64 KiB, in place and out of place.
#: With more ranks than cores (``os.cpu_count()``, the same on every rank of a node) a waiting
#: rank gives its core away and a small call costs scheduler time slices: at 4 ranks on the 2
#: cores, 8 B took 2.5x native's time (native yields too, but sooner) and 64 KiB 0.78x, so
#: there ``auto`` runs shm only from :data:`SHM_OVERSUBSCRIBED_BYTES`.
#: Measured again at 2 ranks on a quieter VM (2026-12-01 21:09, float64 SUM, bench, 3
#: interleaved rounds, load ~2; native time / time, median round): from 4 MiB shm lost to
#: native in both modes (out of place 0.85-1.02 at 4-16 MiB, in place 0.68-0.82) where the
#: built-in rule's pipelined ring took 1.6-1.9 out of place and 0.76-0.95 in place; so at 2
#: ranks shm stops at 4 MiB. 3-8 ranks outnumber this VM's cores and were not measured so.
#: Since the large regime moves a chunk at a time (2026-12-02, another VM of the kind, float64
#: SUM): out of place at 8 MiB shm beat the pipelined ring in 5 of the 6 jobs of
#: scripts/native_sweep.py (861-1043 us against 942-1295) and in 3 of 3 of scripts/call_cost.py
#: (0.43 of comm.Allreduce against auto's ring_segmented 0.57), 0.79 of the faster of native and
#: the ring in 7 interleaved rounds (1.14 in a run under load 5); at 16 MiB 0.95 [0.77-1.17]
#: and 1.29, at 64 MiB 0.95 and 1.59: so at 2 ranks shm runs below 16 MiB.
SHM_RULES = ((2, 2, 0, 16 << 20), (3, 8, 0, None))
#: the same, in place only: since the large regime moves a chunk at a time (shm.CHUNK_BYTES),
#: at 2 ranks in place it beat both native and the pipelined ring from 4 MiB (2026-12-02 06:24
#: UTC, float64 SUM, plan runs, 7 interleaved rounds, load ~3; shm time / the faster of native
#: and ring_segmented, median round): 0.81, 0.76, 0.75, 0.79 at 4, 8, 16, 64 MiB; a run a
#: minute earlier under load 5 gave 0.68, 0.98, 1.02, 1.34; scripts/native_sweep.py (06:26,
#: 3 repeats) gave 520 us against the strongest native's 692 at 8 MiB (0.75) but 6.1-11.4 ms
#: against 6.6 at 64 MiB (memory-bound: the pipelined ring moves fewer bytes), so shm stops at
#: 32 MiB (out of place, at 16 MiB: see above).
SHM_IN_PLACE_RULES = ((2, 2, 16 << 20, 32 << 20),)
SHM_OVERSUBSCRIBED_BYTES = 128 << 10
#: On one node, out of place only: (fewest ranks, most ranks, least bytes, most bytes
#: (exclusive), algorithm) where a schedule that reduces straight out of ``sendbuf`` beat shm
#: (the same run as above): at 2 ranks recursive_doubling took 2.98, 3.92, 4.27, 4.79, 5.29 of
#: native's speed at 16, 32, 64, 128, 256 KiB where shm took 1.72, 1.45, 1.22, 1.26, 1.31
#: (512 KiB: 5.72 and 8.55 with rounds from 1.4 to 9.7; at 1-2 MiB shm was ahead, 1.87 and
#: 1.61 against 1.44 and 1.31). In place shm stays (2.13-1.30 against at most 1.18).
#: Measured again on 2026-12-02 (06:32 UTC, another VM of the same kind, load ~1.5, plan runs,
#: 7 interleaved rounds, two jobs): shm took 0.51, 0.64, 0.79, 0.78, 0.53, 0.55, 0.56, 0.55 of
#: recursive_doubling's time at 16 KiB .. 2 MiB (every round below 1.03 but one at 1 MiB), so
#: the rule is gone: shm runs there too. (Where the two VMs differ, `python -m
#: mpiallreduce.tune` measures the machine at hand.)
ONE_NODE_OUT_OF_PLACE_RULES: tuple = ()
#: (fewest ranks, most ranks, most bytes (exclusive)) where the drop-in's ``Allreduce_init``
#: (``mar.Comm``, ``algorithm="auto"``) returns MPI's own persistent request instead of a plan
#: whose run would be ``shm``: measured at 2 ranks (2026-12-01 22:55, scripts/call_cost.py,
#: 3 runs, float32 SUM, Start + Wait, microseconds, MPI's persistent request against the
#: shm plan's): 1.42 against 3.28 at 8 B, 1.81 against 3.19 at 1 KiB, 4.29 against 5.24 at
#: 2 KiB, 12.49 against 6.71 at 4 KiB (Open MPI 5's persistent allreduce leaves its fast path
#: there) and 14.4 against 9.3 at 8 KiB.
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
