"""What ``algorithm="auto"`` picks for (p, bytes, op, topology).

The built-in rules are data: ``mpiallreduce/rules/builtin.json`` (format
:data:`FORMAT`, loaded once by :func:`builtin`), one entry per rule with the measurement behind
it (machine, date, command, the numbers), in the spirit of Open MPI's coll/tuned rules files.
This module keeps the why of each kind of rule; the figures live in the file and in
docs/performance.md.

Kinds of rule, each a list where the first match decides:

- ``one_node`` (:func:`one_node_choice`): where every rank is on one node, the shared-memory
  transport ``shm`` sends no message and has no agreement round; a private message past some
  size streams through memory and the pipelined ring, which moves fewer bytes, is as fast.
  With more ranks than cores a waiting rank gives its core away, so there ``shm`` starts at
  the setting ``shm_oversubscribed_bytes``.
- ``schedule`` (:func:`choose`): elsewhere, an algorithm written in Python over point-to-point
  messages pays interpreter time per step that MPI's native collective does not, so ``auto``
  picks ``native`` unless a rule says a schedule measured faster in both modes; outside the
  rules the ratios straddle 1 and ``native`` stays. Communicators larger than the setting
  ``measured_ranks`` ask the cost model (:func:`model_choice`), which must predict a schedule
  ``model_margin`` times faster than native.
- ``persistent_native`` (:func:`persistent_native`): where the drop-in's ``Allreduce_init``
  returns MPI's own persistent request instead of an ``shm`` plan.

Re-measure (``python -m mpiallreduce.bench``, or write a table with ``mpiallreduce.tune``) on
another machine or MPI before trusting these rules there; ``algorithm=`` overrides them.

Measured tables. ``mpirun -n N python -m mpi4py -m mpiallreduce.tune`` measures every algorithm
and native on this machine at N ranks and writes a decision table in the same format
(:data:`FORMAT`: a ``provenance`` entry per table); :func:`choose` consults the table for the
communicator size and op class (commutative or not) and falls back to the built-in rules when
there is none, or the file is missing or bad (a bad file gives one ``RuntimeWarning`` and is
ignored). The file is :func:`default_path` (``$XDG_CACHE_HOME/mpiallreduce/tuning.json``,
``~/.cache/...`` without it) unless ``MPIALLREDUCE_TUNING=path`` names another;
``MPIALLREDUCE_TUNING=off`` ignores every table. It is read once per process and path
(:func:`reload` forgets it). Format (files of the older ``mpiallreduce-tuning/1`` format, the
same without ``provenance``, are read too)::

    {"format": "mpiallreduce-rules/1",
     "provenance": {"tune-n2": {"machine": "...", "date": "...", "command": "...",
                                "measured": {"commutative": {"8": {"native": 1.2, ...}}}}},
     "tables": [{"nranks": 2, "provenance": "tune-n2",
                 "classes": {"commutative": [{"min_bytes": 0, "max_bytes": 65536,
                                              "algorithm": "native"},
                                             {"min_bytes": 65536, "max_bytes": null,
                                              "algorithm": "ring_segmented"}],
                             "noncommutative": [...]}}]}

Learning (:func:`learn_settings`, :func:`learn_candidates`, :func:`learning_pays`; the runs
themselves are :mod:`mpiallreduce.learn`'s). Unless ``MPIALLREDUCE_LEARN=off``, a repeated
``auto`` call or plan whose calls are long enough to repay it times, in its first runs, the
candidates this module names for its (size bucket, mode, op class, dtype), agrees across ranks
on the fastest and keeps it for the communicator (and, :mod:`.picks`, for the next job on this
machine): the rules above are then only the first guess. A measured table
(:func:`mpiallreduce.learn.save` writes what was learned into one) covers both modes with the
classes ``commutative_in_place`` and ``noncommutative_in_place``; a table without them uses its
out-of-place ranges in place too.

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
from dataclasses import dataclass
from importlib import resources

import numpy as np

from . import algorithms
from ._env import env_int
from .ops import Reducer, native_deviates

#: the format tag of the rules file and of tune's tables, checked on load.
FORMAT = "mpiallreduce-rules/1"
#: the tag of tables written before rules became data (read too, without provenance).
LEGACY_FORMAT = "mpiallreduce-tuning/1"
#: rule kinds, modes and op classes a rule may name.
KINDS = ("schedule", "one_node", "persistent_native")
MODES = ("any", "in_place", "out_of_place")
RULE_OPS = ("any", "commutative")
#: settings the built-in file must give.
SETTINGS = ("shm_oversubscribed_bytes", "modular_ring_bytes", "measured_ranks", "model_margin")
PROVENANCE_FIELDS = ("machine", "date", "command", "measured")


@dataclass(frozen=True)
class Rule:
    """One rule: ``algorithm`` for ``low <= nranks <= high`` and ``least <= bytes < most``
    (``most`` None: no limit), for ``op`` ("any" or "commutative") in ``mode``."""

    kind: str
    low: int
    high: int
    least: int
    most: int | None
    op: str
    mode: str
    algorithm: str
    provenance: str

    def covers(self, nranks: int, nbytes: int) -> bool:
        return (self.low <= nranks <= self.high and self.least <= nbytes
                and (self.most is None or nbytes < self.most))


@dataclass(frozen=True)
class Rules:
    """The parsed rules file: rules by kind (in file order), settings, provenance records."""

    rules: dict
    settings: dict
    provenance: dict

    def of(self, kind: str) -> tuple[Rule, ...]:
        return self.rules.get(kind, ())


def parse_rules(data) -> Rules:
    """Check a loaded rules file; return its :class:`Rules`. Raises ValueError naming the
    first problem."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"not a {FORMAT} file")
    provenance = _provenance(data)
    by_kind: dict[str, list[Rule]] = {kind: [] for kind in KINDS}
    for index, item in enumerate(data.get("rules", [])):
        where = f"rule {index}"
        if not isinstance(item, dict):
            raise ValueError(f"{where}: expected an object")
        kind, mode, op, name = (item.get(k) for k in ("kind", "mode", "op", "algorithm"))
        if kind not in KINDS or mode not in MODES or op not in RULE_OPS:
            raise ValueError(f"{where}: kind, mode and op must be one of {KINDS}, {MODES}, "
                             f"{RULE_OPS}; got {kind!r}, {mode!r}, {op!r}")
        ranks, sizes = item.get("nranks"), item.get("bytes")
        if not (_pair(ranks) and ranks[1] is not None and 1 <= ranks[0] <= ranks[1]):
            raise ValueError(f"{where}: nranks must be [fewest, most], got {ranks!r}")
        if not (_pair(sizes) and sizes[0] >= 0 and (sizes[1] is None or sizes[1] > sizes[0])):
            raise ValueError(f"{where}: bytes must be [least, most or null], got {sizes!r}")
        if name not in ("native", "shm") and name not in algorithms.REGISTRY:
            raise ValueError(f"{where}: unknown algorithm {name!r}")
        if item.get("provenance") not in provenance:
            raise ValueError(f"{where}: provenance {item.get('provenance')!r} is not an entry "
                             f"of 'provenance'")
        by_kind[kind].append(Rule(kind, *ranks, *sizes, op, mode, name, item["provenance"]))
    settings = {}
    for key, entry in data.get("settings", {}).items():
        if not isinstance(entry, dict) or entry.get("provenance") not in provenance \
                or isinstance(entry.get("value"), bool) \
                or not isinstance(entry.get("value"), (int, float)):
            raise ValueError(f"setting {key!r}: expected {{\"value\": number, \"provenance\": "
                             f"an entry of 'provenance'}}")
        settings[key] = entry["value"]
    return Rules({kind: tuple(rules) for kind, rules in by_kind.items()}, settings, provenance)


def _pair(value) -> bool:
    return (isinstance(value, list) and len(value) == 2
            and all(v is None or (isinstance(v, int) and not isinstance(v, bool))
                    for v in value) and value[0] is not None)


def _provenance(data) -> dict:
    records = data.get("provenance", {})
    if not isinstance(records, dict):
        raise ValueError("'provenance' must map names to records")
    for key, record in records.items():
        missing = [f for f in PROVENANCE_FIELDS if not isinstance(record, dict) or f not in record]
        if missing:
            raise ValueError(f"provenance {key!r} lacks {', '.join(missing)}")
    return records


@functools.lru_cache(maxsize=1)
def builtin() -> Rules:
    """Return the built-in rules (``mpiallreduce/rules/builtin.json``), loaded once."""
    text = resources.files(__package__).joinpath("rules", "builtin.json").read_text("utf-8")
    rules = parse_rules(json.loads(text))
    missing = [key for key in SETTINGS if key not in rules.settings]
    if missing:
        raise ValueError(f"the built-in rules file lacks the settings {', '.join(missing)}")
    return rules


def _as_tuples(kind: str, mode: str | None = None) -> tuple:
    return tuple((r.low, r.high, r.least, r.most, r.algorithm) for r in builtin().of(kind)
                 if mode is None or r.mode == mode)


# The module-level names below are views of the file, for readers and tests that name them.
_SETTINGS = builtin().settings
#: (fewest ranks, most ranks, least bytes, most bytes (exclusive, None: no limit), algorithm)
#: of the ``schedule`` rules, commutative ops only.
RULES = _as_tuples("schedule")
#: bytes per rank from which every measured communicator size runs the pipelined ring: the
#: least bytes of the last, open-ended ``schedule`` rule.
LARGE_MESSAGE_BYTES = RULES[-1][2]
#: the ``one_node`` rules for any mode, for in place only, for out of place only.
SHM_RULES = tuple(rule[:4] for rule in _as_tuples("one_node", "any"))
SHM_IN_PLACE_RULES = tuple(rule[:4] for rule in _as_tuples("one_node", "in_place"))
ONE_NODE_OUT_OF_PLACE_RULES = _as_tuples("one_node", "out_of_place")
SHM_OVERSUBSCRIBED_BYTES = int(_SETTINGS["shm_oversubscribed_bytes"])
#: (fewest ranks, most ranks, most bytes (exclusive)) of the ``persistent_native`` rules.
PERSISTENT_NATIVE_RULES = tuple((low, high, most)
                                for low, high, _, most, _ in _as_tuples("persistent_native"))
MODULAR_RING_BYTES = int(_SETTINGS["modular_ring_bytes"])
MEASURED_RANKS = int(_SETTINGS["measured_ranks"])
MODEL_MARGIN = float(_SETTINGS["model_margin"])


#: the environment variable that names the table file ("off": use none).
TUNING_ENV = "MPIALLREDUCE_TUNING"
#: op classes of a table; the ``_in_place`` ones (optional) hold the ranges for in-place calls.
OP_CLASSES = ("commutative", "noncommutative")
TABLE_CLASSES = (*OP_CLASSES, *(f"{name}_in_place" for name in OP_CLASSES))

#: learning's switches (:func:`learn_settings`): on/off, timed runs per candidate, and after how
#: many further calls of a learned case it is timed again (0: never).
LEARN_ENV, LEARN_RUNS_ENV, RELEARN_ENV = ("MPIALLREDUCE_LEARN", "MPIALLREDUCE_LEARN_RUNS",
                                          "MPIALLREDUCE_RELEARN_EVERY")
#: defaults: on (the rules are one machine's measurements; a repeated call is worth timing on
#: this one, and the verdict is kept across jobs, :mod:`.picks`); 5 timed runs per finalist
#: after one untimed run each (five, not four: the median and the interquartile range of five
#: both ignore one burst of load, where four rounds' quartiles take a quarter of it); never
#: re-timed.
LEARN_DEFAULT, LEARN_RUNS, RELEARN_EVERY = "on", 5, 0
#: the calls a case may spend learning (``learn.budget``): a first round screens up to
#: LEARN_CANDIDATES, then the rules' choice and the fastest other (LEARN_FINALISTS in all) run
#: the other rounds: 6 x 2 + 2 x 4 x 2 = 28 calls at the defaults. Each runs a candidate the
#: model puts within LEARN_MARGIN of the fastest; ``scripts/auto_learn.py`` measures what
#: the calls cost a job of 1,000 calls of the case.
LEARN_CALLS, LEARN_FINALISTS = 30, 2
#: learning pays only where a call is long: its candidates' set-up and 28 calls cost a case
#: 1-3 ms beyond the rules' choice (``scripts/auto_learn.py``, its cost column), 5-8% of a job
#: of 1,000 calls of 40 us (256 KiB at 2 ranks) and 1-2% from 2 MiB. So a case the model
#: predicts under LEARN_MIN_SECONDS per call keeps the rules' choice (the model puts shm at
#: 256 KiB at 120 us and 512 KiB at 240 us, about three times what it measures on a busy
#: machine); where the model cannot predict (more ranks than it has cores), cases below
#: LEARN_MIN_BYTES per rank do.
LEARN_MIN_SECONDS, LEARN_MIN_BYTES = 200e-6, 512 << 10
#: below this many bytes per rank no case is learned, nor the model asked (its prediction
#: costs a new size 80-100 us, a job of 1,000 calls of 1 us 8-10%): no machine the model has
#: fitted puts a call this small anywhere near LEARN_MIN_SECONDS
LEARN_FLOOR_BYTES = 64 << 10
#: at most this many candidates are timed; those the model predicts more than LEARN_MARGIN
#: times slower than its fastest are not (the model ranks; the machine decides). Six: with
#: four, the algorithm that measured best was often no candidate at all where the model puts
#: five schedules within 20% of each other (docs/tutorials/choosing.md, learning).
LEARN_CANDIDATES, LEARN_MARGIN = 6, 2.0


@dataclass(frozen=True)
class LearnSettings:
    """``on``; ``runs`` timed runs per candidate; ``relearn``: calls between re-timings (0: never)."""

    on: bool
    runs: int
    relearn: int


def learn_settings() -> LearnSettings:
    """Read the learning switches from the environment (``MPIALLREDUCE_LEARN=off|on``,
    ``MPIALLREDUCE_LEARN_RUNS=N`` (>= 1), ``MPIALLREDUCE_RELEARN_EVERY=N`` (>= 0)); ValueError
    naming a bad value. Every rank must set them alike (:func:`digest` folds them in, so the
    agreement check says so where they differ). Parsed once per set of values
    (:func:`environment`): a variable changed at run time is read again at the next call."""
    return _learning(environment(_LEARN_KEYS))


@functools.lru_cache(maxsize=8)
def _learning(values: tuple) -> LearnSettings:
    """``values``: the variables as :func:`environment` read them, the cache's key (a bad value
    raises, and raises again at every call: nothing is cached for it)."""
    env = os.environ
    mode = env.get(LEARN_ENV, "").strip().lower() or LEARN_DEFAULT
    if mode not in ("on", "off"):
        raise ValueError(f"{LEARN_ENV}={env[LEARN_ENV]!r}: expected on or off")
    runs = env_int(LEARN_RUNS_ENV, LEARN_RUNS, 1)
    relearn = env_int(RELEARN_ENV, RELEARN_EVERY, 0)
    return LearnSettings(mode == "on", runs, relearn)


#: the variables the settings read: the table's path (:func:`table_path`, with where
#: :func:`default_path` puts it) and learning's switches (:func:`learn_settings`)
_PATH_VARIABLES = (TUNING_ENV, "XDG_CACHE_HOME", "HOME")
_LEARN_VARIABLES = (LEARN_ENV, LEARN_RUNS_ENV, RELEARN_ENV)
# os.environ.get encodes the name and decodes the value at every read, several times the cost
# of the lookup: the settings read os.environ's own mapping by the encoded names (where this
# Python keeps one; otherwise os.environ itself). Either reflects os.environ[...] = and
# monkeypatch.setenv at once.
_RAW = getattr(os.environ, "_data", None)
if isinstance(_RAW, dict) and callable(getattr(os.environ, "encodekey", None)):
    _PATH_KEYS = tuple(os.environ.encodekey(name) for name in _PATH_VARIABLES)
    _LEARN_KEYS = tuple(os.environ.encodekey(name) for name in _LEARN_VARIABLES)
else:
    _RAW, _PATH_KEYS, _LEARN_KEYS = os.environ, _PATH_VARIABLES, _LEARN_VARIABLES
_DIGEST_KEYS = _PATH_KEYS + _LEARN_KEYS  # what digest() depends on


def environment(keys: tuple) -> tuple:
    """The present values of the variables ``keys`` name (None where unset), as the key of the
    settings parsed from them: ``auto`` consults the settings several times per first call, and
    each consultation costs these few lookups, not a parse. A changed variable is a new key, so
    the settings follow the environment with nothing to reset (:func:`reload` forgets them
    anyway)."""
    return tuple(map(_RAW.get, keys))


def learn_candidates(nranks: int, nbytes: int, reducer: Reducer, in_place: bool,
                     one_node: bool, ruled: str, dtype: str = "float64",
                     topology=None) -> tuple[str, ...]:
    """What learning times for a call: ``ruled`` (the rules' choice) first, then ``native``
    (unless this MPI saturates the op on the dtype), ``shm`` where every rank is on one node,
    then the registered algorithms that accept the op in the order of the model's prediction,
    leaving out any predicted more than :data:`LEARN_MARGIN` times slower than the model's
    fastest; at most :data:`LEARN_CANDIDATES`. Schedules the model predicts alike (at 2 ranks
    ring and rabenseifner send the same messages) are each timed: their code is not alike, and
    one measured faster than the other where only one was timed (docs/tutorials/choosing.md). The
    same on every rank for the same arguments; memoized per power-of-two size."""
    bucket = 1 << (max(int(nbytes), 1).bit_length() - 1)
    return _learn_candidates(nranks, bucket, reducer.commutative,
                             native_deviates_for(reducer.name, dtype), bool(in_place),
                             bool(one_node), ruled, dtype, topology)


def learning_pays(nranks: int, nbytes: int, ruled: str, dtype: str = "float64",
                  in_place: bool = False, topology=None) -> bool:
    """Whether a case is long enough a call to learn (:data:`LEARN_MIN_SECONDS`,
    :data:`LEARN_MIN_BYTES`): the same on every rank for the same arguments."""
    bucket = 1 << (max(int(nbytes), 1).bit_length() - 1)
    return _learning_pays(nranks, bucket, ruled, dtype, bool(in_place), topology,
                          LEARN_MIN_SECONDS, LEARN_MIN_BYTES)


@functools.lru_cache(maxsize=1024)
def _learning_pays(nranks: int, bucket: int, ruled: str, dtype: str, in_place: bool, topology,
                   seconds: float, least: int) -> bool:
    try:
        from . import model

        return model.predict(ruled, nranks, bucket, topology, dtype=dtype,
                             in_place=in_place).time >= seconds
    except (ValueError, KeyError):  # the model cannot say: by size alone
        return bucket >= least


def native_deviates_for(name: str, dtype: str) -> bool:
    return native_deviates(name, np.dtype(dtype))


@functools.lru_cache(maxsize=1024)
def _learn_candidates(nranks: int, bucket: int, commutative: bool, deviates: bool,
                      in_place: bool, one_node: bool, ruled: str, dtype: str,
                      topology) -> tuple[str, ...]:
    names = [ruled]
    for name in (*(() if deviates else ("native",)), *(("shm",) if one_node else ())):
        if name not in names:
            names.append(name)
    valid = [name for name, algorithm in algorithms.REGISTRY.items()
             if commutative or not algorithm.commutative_only]
    predicted = {}
    try:
        from . import model

        for name in valid + names:
            if name not in predicted:
                predicted[name] = model.predict(name, nranks, bucket, topology, dtype=dtype,
                                                in_place=in_place).time
    except (ValueError, KeyError):
        predicted = {}  # the model cannot say (more ranks than its cores): the fixed ones only
    if predicted:
        best = min(predicted.values())
        ranked = sorted((t, name) for name, t in predicted.items() if name in valid)
        for time_, name in ranked:
            if len(names) >= LEARN_CANDIDATES or time_ > LEARN_MARGIN * best:
                break
            if name not in names:
                names.append(name)
    return tuple(names[:max(LEARN_CANDIDATES, 1)])


def choose(nranks: int, nbytes: int, reducer: Reducer, topology=None,
           use_tables: bool = True, in_place: bool = False) -> str:
    """Return the algorithm name ``auto`` uses; identical on every rank for identical arguments
    (and the same table file, see the module docstring).

    Never returns an algorithm that refuses the op: non-commutative ops get ``native`` or,
    from a measured table, an order-keeping algorithm. ``use_tables=False``: the built-in
    rules and the model only.
    """
    if nranks > 1 and nbytes > 0 and use_tables:
        picked = lookup(tables(), nranks, nbytes, reducer.commutative, in_place)
        if picked is not None:
            return picked
    if nranks > MEASURED_RANKS:
        return model_choice(nranks, nbytes, reducer, topology)
    if nranks > 1:
        for rule in builtin().of("schedule"):
            if (rule.op == "any" or reducer.commutative) and rule.covers(nranks, nbytes):
                return rule.algorithm
    return "native"


def rules_choice(nranks: int, nbytes: int, reducer: Reducer, in_place: bool,
                 one_node: bool, dtype: str = "float64", topology=None) -> str:
    """What the built-in rules alone choose (no table, no learning): the incumbent a
    measurement must beat to replace them (``tune``'s and learning's alike)."""
    if one_node:
        picked = one_node_choice(nranks, nbytes, in_place, reducer.commutative,
                                 use_tables=False)
        if picked is not None:
            return picked
    if nranks > 1 and native_deviates_for(reducer.name, dtype):
        return "recursive_doubling" if nbytes < MODULAR_RING_BYTES else "ring"
    return choose(nranks, nbytes, reducer, topology, use_tables=False, in_place=in_place)


def one_node_choice(nranks: int, nbytes: int, in_place: bool,
                    commutative: bool = True, shared: bool = False,
                    use_tables: bool = True) -> str | None:
    """What ``auto`` runs if every rank is on one node (the same on every rank for the same
    arguments): ``shm``, an out-of-place schedule of :data:`ONE_NODE_OUT_OF_PLACE_RULES`
    (commutative ops), or None (the rules for any topology decide). None where a measured
    tuning table covers ``nranks``: the table (which may name ``shm``) decides. ``shared``: an
    in-place call on node-shared memory (the words of a reproducible sum), which ``shm`` reduces
    with no copy in or out: no upper size limit (the limits above were measured on private
    arrays, which ``shm`` copies in and out; on shared arrays it beat native at every size measured)."""
    if use_tables and nranks in tables():
        return None
    if shared:
        in_place = True
    mode = "in_place" if in_place else "out_of_place"
    oversubscribed = nranks > _cores(os.cpu_count)
    # rules for this mode only come first (an out-of-place schedule beats shm there), then
    # shm's: those for any mode, then in place's
    ordered = sorted(builtin().of("one_node"), key=lambda rule: (rule.algorithm == "shm",
                                                                 rule.mode != "any"))
    for rule in ordered:
        if rule.mode not in ("any", mode) or (rule.op == "commutative" and not commutative):
            continue
        if rule.algorithm != "shm":
            if rule.covers(nranks, nbytes):
                return rule.algorithm
            continue
        least = max(rule.least, SHM_OVERSUBSCRIBED_BYTES) if oversubscribed else rule.least
        if rule.low <= nranks <= rule.high and least <= nbytes \
                and (rule.most is None or shared or nbytes < rule.most):
            return "shm"
    return None


@functools.lru_cache(maxsize=4)
def _cores(cpu_count) -> int:
    """``cpu_count() or 1``, asked once per function (``os.cpu_count`` reads the system's CPU
    list on every call, which costs a few microseconds per first call of ``auto``; a test that
    replaces it is asked anew)."""
    return cpu_count() or 1


def persistent_native(nranks: int, nbytes: int) -> bool:
    """Does the drop-in's ``Allreduce_init`` return MPI's own request where ``auto`` would run
    ``shm`` (:data:`PERSISTENT_NATIVE_RULES`)? Not where a tuning table covers ``nranks``."""
    if nranks in tables():
        return False
    return any(rule.covers(nranks, nbytes) for rule in builtin().of("persistent_native"))


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


def lookup(loaded: dict, nranks: int, nbytes: int, commutative: bool,
           in_place: bool = False) -> str | None:
    """Return the algorithm of the table for ``nranks`` and the op class at ``nbytes``, or None.
    In place, the class's ``_in_place`` ranges where the table has them, else its others."""
    classes = loaded.get(nranks, {})
    op_class = OP_CLASSES[0] if commutative else OP_CLASSES[1]
    ranges = (in_place and classes.get(f"{op_class}_in_place")) or classes.get(op_class, ())
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
    None when the variable is ``off``. Worked out once per set of values (:func:`environment`)."""
    return _table_path(environment(_PATH_KEYS))


@functools.lru_cache(maxsize=8)
def _table_path(values: tuple) -> str | None:
    """``values``: the variables as :func:`environment` read them, the cache's key."""
    env = os.environ.get(TUNING_ENV, "").strip()
    if env.lower() == "off":
        return None
    return env or default_path()


def tables() -> dict:
    """Return the parsed tables of :func:`table_path` (loaded once per path; {} if none)."""
    path = table_path()
    return {} if path is None else _load(path)


def reload() -> None:
    """Forget loaded tables and the settings read from the environment, so the next
    :func:`choose` reads the file again."""
    _load.cache_clear()
    _digest.cache_clear()
    _digest_of.cache_clear()
    _table_path.cache_clear()
    _learning.cache_clear()


def digest() -> int:
    """Return a CRC of the table file's bytes (0 without one), read once per process and path
    like the table itself, with the learning switches folded in (ranks that learn and ranks
    that do not would run different plans); the agreement check compares it across ranks for
    ``auto``. Worked out once per set of values of the variables it depends on
    (:func:`environment`): every first call of ``auto`` asks."""
    return _digest_of(environment(_DIGEST_KEYS))


@functools.lru_cache(maxsize=8)
def _digest_of(values: tuple) -> int:
    """``values``: the variables as :func:`environment` read them, the cache's key."""
    learning = learn_settings()
    if not learning.on:
        return _digest(table_path())
    return _digest(table_path()) ^ (zlib.crc32(repr(learning).encode()) & 0x7FFFFFFF)


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
    if not isinstance(data, dict) or data.get("format") not in (FORMAT, LEGACY_FORMAT):
        raise ValueError(f"not a {FORMAT} file")
    provenance = _provenance(data)
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
        if not isinstance(classes, dict) or set(classes) - set(TABLE_CLASSES):
            raise ValueError(f"nranks {nranks}: 'classes' must map some of "
                             f"{', '.join(TABLE_CLASSES)} to ranges")
        if "provenance" in entry and entry["provenance"] not in provenance:
            raise ValueError(f"nranks {nranks}: provenance {entry['provenance']!r} is not an "
                             f"entry of 'provenance'")
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
        if op_class.startswith("noncommutative") and name not in ("native", "shm") and \
                algorithms.REGISTRY[name].commutative_only:
            raise ValueError(f"{where}: {name!r} reorders operands")
        checked.append((low, high, name))
        expect = high
        if high is None:
            break
    if expect is not None or len(checked) != len(ranges):
        raise ValueError(f"{where}: the last range must have max_bytes null, and only the last")
    return tuple(checked)


def write_table(path: str, table: dict, provenance: dict | None = None) -> None:
    """Write ``table`` (one communicator size) into the file at ``path``, replacing that size's
    table and keeping the others; atomic (a reader sees the old file or the new one).

    ``provenance``: the record (machine, date, command, measured) the table names as its
    ``"provenance"``, kept under that name in the file's ``provenance`` map.
    """
    records = {}
    if provenance is not None:
        records[table["provenance"]] = provenance
    # never write what choose would refuse
    parse({"format": FORMAT, "provenance": records, "tables": [table]})
    tables_ = []
    try:
        with open(path, encoding="utf-8") as file:
            old = json.load(file)
        parse(old)
        tables_ = [t for t in old["tables"] if t["nranks"] != table["nranks"]]
        kept = {t.get("provenance") for t in tables_}
        records = {**{k: v for k, v in old.get("provenance", {}).items() if k in kept},
                   **records}
    except (OSError, ValueError):
        pass  # no file, or one choose ignores anyway: start afresh
    tables_ = sorted([*tables_, table], key=lambda t: t["nranks"])
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    temporary = f"{path}.tmp{os.getpid()}"
    with open(temporary, "w", encoding="utf-8") as file:
        json.dump({"format": FORMAT, "provenance": records, "tables": tables_}, file, indent=1)
        file.write("\n")
    os.replace(temporary, path)
    reload()
