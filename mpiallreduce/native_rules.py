"""Write the measured native choice per message size in the MPI library's own rules format.

    python -m mpiallreduce.tune --export openmpi-rules|mpich-json [--from SWEEP.json] [--output FILE]

The choice comes from ``scripts/native_sweep.py --json SWEEP.json``, which runs every native
configuration in its own job (MPI reads its tuning parameters once, at initialisation) and records
per message size the strongest one and the environment that forced it. Without ``--from`` the
export runs that sweep first (2 ranks, its default sizes, out of place).

Formats:

- ``openmpi-rules``: coll/tuned's dynamic rules file, the classic text format every Open MPI 5
  reads. Use it with ``OMPI_MCA_coll_tuned_use_dynamic_rules=1
  OMPI_MCA_coll_tuned_dynamic_rules_filename=FILE``. Grammar (whitespace-separated integers,
  ``#`` starts a comment): number of collectives; per collective its id (allreduce is 2, the
  ``ALLREDUCE`` entry of ``COLLTYPE_T`` in ``coll_base_functions.h``), number of communicator
  sizes; per communicator size the size and the number of message sizes; per message size
  ``msg_size algorithm faninout segsize``, the first at ``msg_size`` 0. The library takes the
  rule of the largest communicator size not above the communicator's and the last message size
  not above the message's bytes; algorithm 0 leaves the choice to its built-in decision.
- ``mpich-json``: the tree ``MPIR_CVAR_COLL_SELECTION_TUNING_JSON_FILE`` reads. The file
  replaces MPICH's whole built-in tree (every collective), so the export copies the built-in
  tree out of the installed ``libmpi`` and replaces only allreduce's intra-communicator branch;
  the measured algorithm holds for built-in ops on counts of at least the largest power of two
  not above the ranks (what the sweep timed: the tree skips the checks the
  ``MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM`` path makes).

Open MPI's format cannot tell ops apart: a rule naming ring (4), segmented ring (5) or
Rabenseifner (6) would apply to non-commutative user ops too, which ring and segmented ring
combine out of rank order (as forcing them with ``OMPI_MCA_coll_tuned_allreduce_algorithm``
does). So where the sweep measured one of those strongest, the file names the built-in decision
(0, which checks the op) unless ``allow_reordering`` (``tune --export ... --allow-reordering``)
says every program that reads the file uses commutative ops only.

Either way the measured choice holds for communicators of exactly the measured size; every
other size, and every size range where the library's default was strongest, keeps the library's
own decision. Measured sizes split the byte axis at the geometric midpoint between neighbours.
"""

from __future__ import annotations

import json
import math
import pathlib
import subprocess
import sys
import tempfile

FORMATS = ("openmpi-rules", "mpich-json")
#: ``ALLREDUCE`` in Open MPI's ``COLLTYPE_T`` (ompi/mca/coll/base/coll_base_functions.h)
OPEN_MPI_ALLREDUCE = 2
#: coll/tuned's allreduce algorithm ids (``ompi_info --param coll tuned --level 9``)
OPEN_MPI_ALGORITHMS = {0: "built-in decision", 1: "basic linear", 2: "nonoverlapping",
                       3: "recursive doubling", 4: "ring", 5: "segmented ring",
                       6: "rabenseifner"}
#: the ids that may combine out of rank order: coll_base_allreduce.c documents ring and
#: segmented ring as "only for commutative operations"; Rabenseifner's reduce-scatter is held to
#: the same rule, since a rules file that lets one wrong sum through is worse than a slower one
OPEN_MPI_REORDERING = frozenset({4, 5, 6})
_OMPI_ALGORITHM = "OMPI_MCA_coll_tuned_allreduce_algorithm"
_OMPI_SEGMENT = "OMPI_MCA_coll_tuned_allreduce_algorithm_segmentsize"
_MPICH_ALGORITHM = "MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM"


class RulesError(ValueError):
    """A sweep that cannot be exported, or a rules file that breaks its grammar."""


def choices(sweep: dict, mode: str = "out") -> list[tuple[int, dict]]:
    """Return (bytes per rank, environment of the strongest native configuration), by size.

    Args:
        sweep: what ``scripts/native_sweep.py --json`` wrote.
        mode: ``out`` or ``in_place``, as the sweep measured them.
    """
    if "configs" not in sweep:
        raise RulesError("the sweep file has no 'configs' (each configuration's environment): "
                         "write it again with scripts/native_sweep.py --json FILE")
    results = sweep.get("results", {}).get(mode)
    if not results:
        raise RulesError(f"the sweep file has no results for mode {mode!r}; it has "
                         f"{', '.join(sweep.get('results', {})) or 'none'}")
    table = []
    for size, row in sorted(results.items(), key=lambda item: int(item[0])):
        label = row["native_config"]
        if label not in sweep["configs"]:
            raise RulesError(f"size {size}: strongest configuration {label!r} is not among the "
                             f"sweep's configs ({', '.join(sweep['configs'])})")
        table.append((int(size), dict(sweep["configs"][label])))
    return table


def ranges(table: list[tuple[int, object]]) -> list[tuple[int, int | None, object]]:
    """Return (first byte, last byte or None for no end, choice) ranges covering every size.

    Each measured size's choice reaches halfway (geometrically) to its neighbours; neighbours
    with the same choice merge into one range.
    """
    if not table:
        raise RulesError("no measured sizes to export")
    found: list[tuple[int, int | None, object]] = []
    for index, (size, choice) in enumerate(table):
        start = 0 if index == 0 else math.isqrt(table[index - 1][0] * size) + 1
        if found and found[-1][2] == choice:
            start = found.pop()[0]
        found.append((start, None, choice))
    return [(start, None if index == len(found) - 1 else found[index + 1][0] - 1, choice)
            for index, (start, _, choice) in enumerate(found)]


def openmpi_algorithm(env: dict) -> tuple[int, int]:
    """Return coll/tuned's (algorithm id, segment bytes) for a sweep configuration's environment;
    (0, 0), the built-in decision, for the default."""
    algorithm = int(env.get(_OMPI_ALGORITHM, 0))
    if algorithm not in OPEN_MPI_ALGORITHMS:
        raise RulesError(f"unknown coll/tuned allreduce algorithm {algorithm}; known: "
                         + ", ".join(f"{k} {v}" for k, v in OPEN_MPI_ALGORITHMS.items()))
    return algorithm, int(env.get(_OMPI_SEGMENT, 0))


def openmpi_rules(ranks: int, table: list[tuple[int, dict]], source: str = "",
                  allow_reordering: bool = False) -> str:
    """Return the coll/tuned dynamic rules file for allreduce at ``ranks`` ranks.

    A second communicator size, ``ranks + 1``, hands larger communicators back to the built-in
    decision (the library applies the rule of the largest size not above the communicator's).
    Without ``allow_reordering`` a size whose strongest configuration may combine out of rank
    order (:data:`OPEN_MPI_REORDERING`) gets the built-in decision instead.
    """
    if ranks < 1:
        raise RulesError(f"ranks must be >= 1, got {ranks}")
    lines = ["# coll/tuned dynamic rules: allreduce as mpiallreduce's native sweep measured it"]
    if source:
        lines.append(f"# from {source}")
    picks = [(size, openmpi_algorithm(env)) for size, env in table]
    if not allow_reordering:
        kept = [(size, (0, 0) if pick[0] in OPEN_MPI_REORDERING else pick) for size, pick in picks]
        if kept != picks:
            lines.append("# sizes where ring, segmented ring or rabenseifner measured strongest "
                         "keep the built-in decision: they may combine non-commutative ops out "
                         "of rank order (--allow-reordering writes them)")
        picks = kept
    lines += ["1  # collectives", f"{OPEN_MPI_ALLREDUCE}  # allreduce", "2  # communicator sizes",
              f"{ranks}  # ranks: the measured choice"]
    spans = ranges(picks)
    lines.append(f"{len(spans)}  # message sizes")
    for start, _, (algorithm, segment) in spans:
        lines.append(f"{start} {algorithm} 0 {segment}  # {OPEN_MPI_ALGORITHMS[algorithm]}")
    lines += [f"{ranks + 1}  # more ranks: the built-in decision", "1", "0 0 0 0"]
    return "\n".join(lines) + "\n"


def parse_openmpi_rules(text: str) -> dict[int, dict[int, list[tuple[int, int, int, int]]]]:
    """Return {collective id: {communicator size: [(msg_size, algorithm, faninout, segsize)]}}
    of a classic coll/tuned rules file; raise :class:`RulesError` where coll/tuned's reader
    would reject it (it then ignores the whole file without a word)."""
    words = [(number, word) for number, line in enumerate(text.splitlines(), 1)
             for word in line.split("#", 1)[0].split()]
    position = 0

    def take(what: str, minimum: int = 0) -> int:
        nonlocal position
        if position >= len(words):
            raise RulesError(f"the file ends where {what} was expected")
        line, word = words[position]
        position += 1
        if not word.isdigit() or int(word) < minimum:
            raise RulesError(f"line {line}: {what} must be an integer >= {minimum}, got {word!r}")
        return int(word)

    rules: dict[int, dict[int, list[tuple[int, int, int, int]]]] = {}
    for _ in range(take("the number of collectives")):
        collective = take("a collective id")
        by_size = rules.setdefault(collective, {})
        for _ in range(take(f"collective {collective}'s number of communicator sizes")):
            comm_size = take("a communicator size")
            messages = [tuple(take(what) for what in ("msg_size", "algorithm", "faninout",
                                                      "segsize"))
                        for _ in range(take(f"communicator size {comm_size}'s number of "
                                            f"message sizes"))]
            if messages and messages[0][0] != 0:
                raise RulesError(f"collective {collective}, communicator size {comm_size}: the "
                                 f"first message size must be 0, got {messages[0][0]}")
            by_size[comm_size] = messages
    if position != len(words):
        raise RulesError(f"line {words[position][0]}: unexpected {words[position][1]!r} after "
                         f"the last collective")
    return rules


def mpich_algorithm(env: dict) -> str | None:
    """Return the MPICH allreduce function a configuration forced; None for the default."""
    name = env.get(_MPICH_ALGORITHM)
    return f"MPIR_Allreduce_intra_{name}" if name else None


def mpich_tree(ranks: int, table: list[tuple[int, dict]], builtin: dict) -> dict:
    """Return MPICH's selection tree: ``builtin`` with allreduce's intra branch choosing the
    measured algorithm per ``avg_msg_size`` at exactly ``ranks`` ranks."""
    if ranks < 1:
        raise RulesError(f"ranks must be >= 1, got {ranks}")
    allreduce = builtin.get("collective=allreduce", {})
    default = allreduce.get("comm_type=intra")
    if default is None:
        raise RulesError("MPICH's built-in tree has no collective=allreduce/comm_type=intra")
    measured = {}
    for _, last, algorithm in ranges([(size, mpich_algorithm(env)) for size, env in table]):
        key = "avg_msg_size=any" if last is None else f"avg_msg_size<={last}"
        # the sweep timed a built-in op on counts of at least the ranks' power of two; the tree
        # runs what it names without MPICH's fallback checks (reduce_scatter_allgather asserts a
        # built-in op and count >= pof2), so outside those cases: the default
        measured[key] = {"is_op_built_in=yes": {"count<pow2": default,
                                                "count=any": {f"algorithm={algorithm}": {}}},
                         "is_op_built_in=no": default} if algorithm else default
    intra = {f"comm_size<{ranks}": default, f"comm_size<={ranks}": measured,
             "comm_size=any": default}
    return {**builtin, "collective=allreduce": {**allreduce, "comm_type=intra": intra}}


def mpich_builtin_tree(library: str | pathlib.Path | None = None) -> dict:
    """Return the MPIR-level selection tree built into MPICH's ``libmpi`` (the one the mpi4py of
    this Python loaded where ``library`` is None)."""
    path = pathlib.Path(library) if library else _loaded_libmpi()
    data = path.read_bytes()
    start = data.find(b'{"collective=')
    while start >= 0:
        end = data.find(b"\0", start)
        text = data[start:end].decode("ascii", "replace")
        if '"algorithm=MPIR_Allreduce_intra_' in text:
            return json.loads(text)
        start = data.find(b'{"collective=', end)
    raise RulesError(f"{path} holds no MPIR selection tree with allreduce: is it MPICH's libmpi?")


def _loaded_libmpi() -> pathlib.Path:
    from mpi4py import MPI  # noqa: F401  (loads libmpi into this process)

    for line in pathlib.Path("/proc/self/maps").read_text().splitlines():
        name = line.split()[-1]
        if pathlib.Path(name).name.startswith("libmpi.so"):
            return pathlib.Path(name)
    raise RulesError("cannot find the libmpi mpi4py loaded in /proc/self/maps")


def export(fmt: str, sweep: dict, mode: str = "out", source: str = "",
           builtin: dict | None = None, allow_reordering: bool = False) -> str:
    """Return the rules file of format ``fmt`` for a sweep's measured choice
    (``allow_reordering``: see :func:`openmpi_rules`; MPICH's tree keeps user ops on the
    default whatever it is)."""
    table = choices(sweep, mode)
    if fmt == "openmpi-rules":
        if "Open MPI" not in sweep.get("library", "Open MPI"):
            raise RulesError(f"openmpi-rules from a sweep of {sweep['library']!r}: sweep "
                             f"under Open MPI")
        return openmpi_rules(sweep["ranks"], table, source, allow_reordering)
    if fmt == "mpich-json":
        if "MPICH" not in sweep.get("library", "MPICH"):
            raise RulesError(f"mpich-json from a sweep of {sweep['library']!r}: sweep under MPICH")
        tree = mpich_tree(sweep["ranks"], table, mpich_builtin_tree() if builtin is None
                          else builtin)
        return json.dumps(tree, indent=1) + "\n"
    raise RulesError(f"unknown format {fmt!r}; known: {', '.join(FORMATS)}")


def run_sweep(path: pathlib.Path, timeout: float = 3600) -> None:
    """Run ``scripts/native_sweep.py`` (2 ranks, its default sizes, out of place) into ``path``;
    its progress goes to stderr."""
    script = pathlib.Path(__file__).resolve().parent.parent / "scripts" / "native_sweep.py"
    if not script.exists():
        raise RulesError(f"no {script}: run scripts/native_sweep.py --json FILE from a checkout "
                         f"and pass --from FILE")
    status = subprocess.run([sys.executable, str(script), "--modes", "out", "--no-results",
                             "--json", str(path)], stdout=sys.stderr, timeout=timeout).returncode
    if status or not path.exists():
        raise RulesError(f"scripts/native_sweep.py exited with status {status}")


def main(fmt: str, source: str | None, output: str | None, out=None,
         allow_reordering: bool = False) -> int:
    """Export ``fmt`` from the sweep file ``source`` (None: run the sweep) to ``output`` (None:
    ``out``); return the exit status. tune's ``--export`` calls this."""
    out = sys.stdout if out is None else out
    try:
        with tempfile.TemporaryDirectory() as folder:
            path = pathlib.Path(source) if source else pathlib.Path(folder) / "sweep.json"
            if not source:
                run_sweep(path)
            text = export(fmt, json.loads(path.read_text()), source=str(source or "a sweep"),
                          allow_reordering=allow_reordering)
    except (RulesError, OSError, json.JSONDecodeError) as exc:
        print(f"mpiallreduce.tune --export: {exc}", file=sys.stderr, flush=True)
        return 2
    if output:
        pathlib.Path(output).write_text(text)
        print(f"# wrote {fmt} to {output}", file=out, flush=True)
    else:
        out.write(text)
    return 0
