"""Mutation run: how much of the schedule code and the call path the fast tests can tell broken.

A small AST mutator of its own (mutmut and cosmic-ray run pytest in one process; the MPI tests
need ``mpirun``). It copies the package and the tests into a temporary directory, enumerates
mutants of the modules in :data:`TARGETS`, samples a stratified set of them, and for each mutant
rewrites that one file in the copy (never in the working tree), runs the fast test subset
against the copy and restores the file:

1. the serial tests that cover the mutated module (the verifier and schedule tests for
   ``algorithms/`` and ``partition.py``, the op table for ``ops.py``, the argument checks and
   ``auto``'s choice for the call path), with ``-x``;
2. if they all pass, a short MPI subset, ``mpirun -n RANKS python -m mpi4py -m pytest --with-mpi
   -x tests/test_allreduce_mpi.py -k ...`` (the grid restricted to the algorithms the module
   feeds, or a cross-section of it for the call path), under ``timeout``.

A mutant is *killed* when a test fails, errors or times out (a hang counts as a kill, as in
mutmut); it *survives* when every selected test passes. Mutation operators (``OPERATORS``):
``swap`` (operands of a non-commutative binary operator, or of ``np.copyto``), ``arith``
(``+``/``-``, ``*``/``//``, ``^``/``|``, ``<<``/``>>``), ``compare`` (``<``/``<=``, ``>``/``>=``,
``==``/``!=``), ``off_by_one`` (a ``range`` bound, a slice bound or an integer constant +1),
``drop`` (a call statement, a subscript assignment such as a copy-back, or an augmented
assignment, replaced by ``pass``), ``peer`` (an assignment to ``peer``, ``left``, ``right``,
``send_to``, ``recv_from``... given ``+ 1``), ``bool`` (``and``/``or``, ``not x`` to ``x``,
``True``/``False``). Docstrings, ``raise`` statements and f-strings (error text) are not
mutated.

Sampling: every mutant of every target is enumerated (``--list`` prints them); ``--sample N``
(default 60) draws N of them, stratified by file in proportion to each file's mutants with at
least two per file, uniformly within a file, from ``random.Random(--seed)`` (default 23), so a
rerun draws the same set. ``--only ID ...`` runs named mutants (ids as ``--list`` prints them).
Parallelism is 1 (the machine is shared); expect 10-60 s per mutant on 2 loaded cores.

Run (from the repository root; Open MPI as root needs the usual variables)::

    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \\
        PRTE_MCA_rmaps_default_mapping_policy=:oversubscribe
    .venv/bin/python scripts/mutation.py --sample 60 --ranks 3 --report mutation-report.txt
    .venv/bin/python scripts/mutation.py --only ID ... --extra tests/test_timeout_mpi.py
    .venv/bin/python scripts/mutation.py --targets shm --sample 30 --ranks 3

``--targets shm`` mutates the shared-memory transport (``mpiallreduce/shm/``) instead; its
stages are the stress test (every regime under random stalls, ``tests/test_shm_stress_mpi.py``)
and a cross-section of ``tests/test_shm_mpi.py``.

A run on this project's 2-core VM, with the survivors explained, is in
``docs/results/mutation-vm.txt``. It prints one line per mutant (``KILLED``/``SURVIVED``, by which
stage, seconds) and the kill fraction per file and overall; survivors are listed with their
line, to be explained or killed by a new test.
"""

from __future__ import annotations

import argparse
import ast
import copy
import os
import pathlib
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = "mpiallreduce"

#: the modules mutated (relative to the repository root)
TARGETS = sorted(
    [f"{PACKAGE}/algorithms/{p.name}" for p in (ROOT / PACKAGE / "algorithms").glob("*.py")]
    + [f"{PACKAGE}/{name}" for name in ("partition.py", "ops.py", "executor.py", "_binding.py",
                                         "_waiting.py", "_plans.py", "api.py")])

#: the shared-memory transport's modules (``--targets shm``)
SHM_TARGETS = sorted(f"{PACKAGE}/shm/{p.name}" for p in (ROOT / PACKAGE / "shm").glob("*.py"))
#: the MPI stages of an shm mutant: the stress test (every regime under random stalls), then a
#: cross-section of the shm tests (regimes, chunks, shared arrays, mismatches, timeouts)
MPI_SHM_K = ("awkward_counts or chunked or shared or mismatch or times_out or every_op_and_dtype "
             "or order or setting_a_constant")

#: algorithm names each algorithms/ module defines (the MPI subset's -k expression)
ALGORITHM_OF = {"ring.py": ["ring"], "ring_segmented.py": ["ring_segmented"],
                "tree.py": ["tree"], "knomial.py": ["knomial"],
                "recursive_doubling.py": ["recursive_doubling"],
                "rabenseifner.py": ["rabenseifner"], "cascade.py": ["cascade"],
                "hierarchical.py": ["hierarchical"]}

SERIAL_SCHEDULES = ["tests/test_verify.py", "tests/test_knomial.py", "tests/test_hierarchical.py",
                    "tests/test_partition.py"]
SERIAL_CALL_PATH = ["tests/test_ops.py", "tests/test_errors.py", "tests/test_select.py"]
#: the MPI cross-section for modules every algorithm goes through
MPI_CALL_PATH_K = ("(awkward_counts and world) or plan_in_place or average or user_op "
                   "or buffer_protocol or repeated_calls or auto_runs or auto_never or context "
                   "or (every_op_and_dtype and tree)")
#: related collectives (algorithms/collectives.py) are tested in their own MPI file
MPI_COLLECTIVES = "tests/test_collectives_mpi.py"

PEER_NAMES = {"peer", "left", "right", "send_to", "recv_from", "partner", "parent", "child",
              "src", "dst", "source", "dest", "target"}
SWAPPABLE = (ast.Sub, ast.Div, ast.FloorDiv, ast.Mod, ast.Pow, ast.LShift, ast.RShift)
ARITH = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.FloorDiv, ast.FloorDiv: ast.Mult,
         ast.BitXor: ast.BitOr, ast.BitOr: ast.BitXor, ast.BitAnd: ast.BitOr,
         ast.LShift: ast.RShift, ast.RShift: ast.LShift, ast.Mod: ast.FloorDiv}
COMPARE = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt,
           ast.Eq: ast.NotEq, ast.NotEq: ast.Eq}
OPERATORS = ("swap", "arith", "compare", "off_by_one", "drop", "peer", "bool")


@dataclass(frozen=True)
class Mutant:
    """One mutation: the ``index``-th node of ``ast.walk`` of ``path``, changed by ``operator``."""

    path: str
    index: int
    operator: str
    variant: int
    line: int
    text: str  # the mutated line, for the report

    @property
    def ident(self) -> str:
        return f"{self.path.split('/', 1)[1]}:{self.line}:{self.operator}:{self.index}.{self.variant}"


# -- enumerating and applying mutations ------------------------------------------------------------

def _excluded(tree: ast.AST) -> set[int]:
    """ids of nodes never mutated: docstrings, raise statements, f-strings, asserts, imports."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Raise, ast.JoinedStr, ast.Assert, ast.Import, ast.ImportFrom)):
            skip.update(id(n) for n in ast.walk(node))
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                skip.update(id(n) for n in ast.walk(body[0]))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            # annotations and the decorators' registration keywords are not behaviour we test
            for d in node.decorator_list:
                skip.update(id(n) for n in ast.walk(d))
            for a in ast.walk(node.args):
                if isinstance(a, ast.arg) and a.annotation is not None:
                    skip.update(id(n) for n in ast.walk(a.annotation))
            if node.returns is not None:
                skip.update(id(n) for n in ast.walk(node.returns))
        if isinstance(node, ast.AnnAssign):
            skip.update(id(n) for n in ast.walk(node.annotation))
    return skip


def _is_call_named(node, *names) -> bool:
    func = getattr(node, "func", None)
    name = getattr(func, "attr", None) or getattr(func, "id", None)
    return isinstance(node, ast.Call) and name in names


def _droppable(node: ast.AST) -> bool:
    """A statement whose removal is a mutant: a call, a subscript store (a copy-back), ``+=``."""
    return (isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)
            or isinstance(node, ast.Assign) and any(isinstance(t, ast.Subscript) for t in node.targets)
            or isinstance(node, ast.AugAssign))


def _variants(node: ast.AST, parent_of: dict) -> list[tuple[str, int]]:
    """The (operator, variant) mutations that apply to ``node``."""
    out = []
    if isinstance(node, ast.BinOp):
        if isinstance(node.op, SWAPPABLE):
            out.append(("swap", 0))
        if type(node.op) in ARITH:
            out.append(("arith", 0))
    elif _is_call_named(node, "copyto") and len(node.args) >= 2:
        out.append(("swap", 0))
    elif isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in COMPARE:
        out.append(("compare", 0))
    elif _is_call_named(node, "range") and node.args:
        out.extend(("off_by_one", i) for i in range(min(len(node.args), 2)))
    elif isinstance(node, ast.Slice):
        if node.lower is not None:
            out.append(("off_by_one", 0))
        if node.upper is not None:
            out.append(("off_by_one", 1))
    elif (isinstance(node, ast.Constant) and type(node.value) is int
          and not isinstance(parent_of.get(id(node)), (ast.Slice, ast.Subscript))):
        out.append(("off_by_one", 0))
    elif _droppable(node):
        out.append(("drop", 0))
    if isinstance(node, ast.Assign) and len(node.targets) == 1 and \
            isinstance(node.targets[0], ast.Name) and node.targets[0].id in PEER_NAMES:
        out.append(("peer", 0))
    if (isinstance(node, ast.BoolOp) or isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not)
            or isinstance(node, ast.Constant) and type(node.value) is bool):
        out.append(("bool", 0))
    return out


def _plus_one(expr: ast.expr) -> ast.expr:
    return ast.BinOp(left=expr, op=ast.Add(), right=ast.Constant(1))


def _mutate(node: ast.AST, operator: str, variant: int) -> ast.AST:
    """Return the replacement for ``node`` (a modified deep copy)."""
    new = copy.deepcopy(node)
    if operator == "swap":
        if isinstance(new, ast.BinOp):
            new.left, new.right = new.right, new.left
        else:
            new.args[0], new.args[1] = new.args[1], new.args[0]
    elif operator == "arith":
        new.op = ARITH[type(new.op)]()
    elif operator == "compare":
        new.ops = [COMPARE[type(new.ops[0])]()]
    elif operator == "off_by_one":
        if isinstance(new, ast.Call):
            new.args[variant] = _plus_one(new.args[variant])
        elif isinstance(new, ast.Slice):
            if variant == 0:
                new.lower = _plus_one(new.lower)
            else:
                new.upper = _plus_one(new.upper)
        else:
            new.value = new.value + 1
    elif operator == "drop":
        new = ast.Pass()
    elif operator == "peer":
        new.value = _plus_one(new.value)
    elif operator == "bool":
        if isinstance(new, ast.BoolOp):
            new.op = ast.Or() if isinstance(new.op, ast.And) else ast.And()
        elif isinstance(new, ast.UnaryOp):
            new = new.operand
        else:
            new.value = not new.value
    return ast.copy_location(new, node)


def _parents(tree: ast.AST) -> dict:
    return {id(child): parent for parent in ast.walk(tree) for child in ast.iter_child_nodes(parent)}


def enumerate_mutants(path: str) -> list[Mutant]:
    """Every mutant of ``path`` (relative to the repository root)."""
    source = (ROOT / path).read_text()
    tree = ast.parse(source)
    skip = _excluded(tree)
    parent_of = _parents(tree)
    lines = source.splitlines()
    out = []
    for index, node in enumerate(ast.walk(tree)):
        if id(node) in skip:
            continue
        for operator, variant in _variants(node, parent_of):
            line = getattr(node, "lineno", None) or getattr(parent_of.get(id(node)), "lineno", 0)
            out.append(Mutant(path, index, operator, variant, line,
                              lines[line - 1].strip() if line else ""))
    return out


def apply(mutant: Mutant) -> str | None:
    """Return the mutated source of the mutant's file, or None if the mutation changes nothing."""
    source = (ROOT / mutant.path).read_text()
    tree = ast.parse(source)
    nodes = list(ast.walk(tree))
    target = nodes[mutant.index]
    replacement = _mutate(target, mutant.operator, mutant.variant)
    for parent in nodes:
        for field, value in ast.iter_fields(parent):
            if value is target:
                setattr(parent, field, replacement)
            elif isinstance(value, list):
                for i, item in enumerate(value):
                    if item is target:
                        value[i] = replacement
    ast.fix_missing_locations(tree)
    mutated = ast.unparse(tree)
    if mutated == ast.unparse(ast.parse(source)):
        return None
    compile(mutated, mutant.path, "exec")
    return mutated


def sample(mutants: list[Mutant], size: int, seed: int) -> list[Mutant]:
    """Draw ``size`` mutants stratified by file (proportional, at least two per file)."""
    rng = random.Random(seed)
    by_file: dict[str, list[Mutant]] = {}
    for m in mutants:
        by_file.setdefault(m.path, []).append(m)
    total = len(mutants)
    picked = []
    for path in sorted(by_file):
        group = by_file[path]
        want = min(len(group), max(2, round(size * len(group) / total)))
        picked.extend(rng.sample(group, want))
    rng.shuffle(picked)  # a run cut short by --minutes is still a random subsample
    return picked


# -- running the fast subset against a mutant ---------------------------------------------------------

def _commands(mutant: Mutant, python: str, mpirun: str, ranks: int) -> list[tuple[str, list[str]]]:
    """The stages that test ``mutant``: [(name, argv)], cheapest first."""
    name = pathlib.PurePosixPath(mutant.path).name
    pytest_serial = [python, "-m", "pytest", "-q", "-x", "--color=no", "-p", "no:cacheprovider",
                     "-m", "not mpi and not slow"]
    pytest_mpi = [mpirun, "-n", str(ranks), python, "-m", "mpi4py", "-m", "pytest", "-q", "-x",
                  "--color=no", "-p", "no:cacheprovider", "--with-mpi", "-m", "mpi and not slow"]
    if "/shm/" in mutant.path:
        return [("mpi stress", pytest_mpi + ["tests/test_shm_stress_mpi.py"]),
                ("mpi shm", pytest_mpi + ["tests/test_shm_mpi.py", "-k", MPI_SHM_K])]
    in_algorithms = "/algorithms/" in mutant.path
    if in_algorithms and name == "collectives.py":
        return [("serial", pytest_serial + ["tests/test_verify.py", "-k", "collective"]),
                ("mpi", pytest_mpi + [MPI_COLLECTIVES, "-k", "world or split"])]
    if in_algorithms or name == "partition.py":
        stages = [("serial", pytest_serial + SERIAL_SCHEDULES)]
        names = ALGORITHM_OF.get(name)
        k = " or ".join(names) if names else MPI_CALL_PATH_K
        return stages + [("mpi", pytest_mpi + ["tests/test_allreduce_mpi.py", "-k", k])]
    serial = SERIAL_CALL_PATH + (["tests/test_verify.py"]
                                 if name in ("executor.py", "_binding.py") else [])
    return [("serial", pytest_serial + serial),
            ("mpi", pytest_mpi + ["tests/test_allreduce_mpi.py", "-k", MPI_CALL_PATH_K])]


def _stage(argv: list[str], workdir: pathlib.Path, env: dict, limit: int) -> int:
    """Run one stage under ``timeout`` in a session of its own; if this script is stopped,
    stop the whole stage (``timeout`` passes SIGTERM on to mpirun, which ends its ranks)."""
    process = subprocess.Popen(["timeout", str(limit), *argv], cwd=workdir, env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               start_new_session=True)
    try:
        return process.wait()
    except BaseException:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait()
        raise


def run_mutant(mutant: Mutant, workdir: pathlib.Path, args) -> tuple[str, str, float]:
    """Apply ``mutant`` in ``workdir``, run its stages, restore; return (verdict, stage, s)."""
    mutated = apply(mutant)
    if mutated is None:
        return "UNCHANGED", "-", 0.0
    target = workdir / mutant.path
    original = target.read_text()
    target.write_text(mutated)
    env = {**os.environ, "PYTHONPATH": str(workdir), "PYTHONDONTWRITEBYTECODE": "1"}
    start = time.monotonic()
    try:
        stages = _commands(mutant, args.python, args.mpirun, args.ranks)
        if args.extra:  # more MPI test files: is a survivor killed outside the fast subset?
            stages.append(("extra", stages[-1][1][:stages[-1][1].index("--with-mpi") + 3]
                           + args.extra))
        for stage, argv in stages:
            returncode = _stage(argv, workdir, env, args.timeout)
            if returncode not in (0, 5):  # 5: no test selected
                why = "timeout" if returncode in (124, 137) else f"rc {returncode}"
                return "KILLED", f"{stage} ({why})", time.monotonic() - start
        return "SURVIVED", "-", time.monotonic() - start
    finally:
        target.write_text(original)


def baseline(chosen: list[Mutant], workdir: pathlib.Path, args) -> bool:
    """Run every distinct stage of ``chosen`` on the unmutated copy; True if all pass."""
    env = {**os.environ, "PYTHONPATH": str(workdir), "PYTHONDONTWRITEBYTECODE": "1"}
    seen, ok = set(), True
    for m in chosen:
        for stage, argv in _commands(m, args.python, args.mpirun, args.ranks):
            if tuple(argv) in seen:
                continue
            seen.add(tuple(argv))
            start = time.monotonic()
            done = subprocess.run(["timeout", str(args.timeout), *argv], cwd=workdir, env=env,
                                  capture_output=True, text=True)
            passed = done.returncode in (0, 5)
            ok = ok and passed
            tail = done.stdout.strip().splitlines()[-1:] if done.stdout.strip() else [""]
            print(f"# baseline {'ok' if passed else 'FAILED'} {time.monotonic() - start:6.1f}s "
                  f"{' '.join(argv[argv.index('-m', 3) + 2:] if stage == 'serial' else argv[-3:])}"
                  f" | {tail[0]}", flush=True)
    return ok


def _workdir() -> pathlib.Path:
    """A temporary copy of the package, the tests and the project file."""
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="mutation-"))
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(ROOT / PACKAGE, workdir / PACKAGE, ignore=ignore)
    shutil.copytree(ROOT / "tests", workdir / "tests", ignore=ignore)
    shutil.copytree(ROOT / "examples", workdir / "examples", ignore=ignore)
    shutil.copy(ROOT / "pyproject.toml", workdir / "pyproject.toml")
    return workdir


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sample", type=int, default=60, help="mutants to draw (0: all)")
    parser.add_argument("--seed", type=int, default=23)
    parser.add_argument("--ranks", type=int, default=3, help="mpirun -n for the MPI stage")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per stage")
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument("--mpirun", default=str(pathlib.Path(sys.executable).parent / "mpirun"))
    parser.add_argument("--only", nargs="*", help="run these mutant ids only")
    parser.add_argument("--extra", nargs="*", help="MPI test files (and pytest options) to run "
                        "after the fast subset, e.g. for survivors")
    parser.add_argument("--targets", choices=("schedules", "shm"), default="schedules",
                        help="the schedule code and call path (TARGETS), or the shm transport "
                        "(SHM_TARGETS)")
    parser.add_argument("--list", action="store_true", help="print every mutant and exit")
    parser.add_argument("--report", help="also write the report to this file")
    parser.add_argument("--minutes", type=float,
                        help="start no mutant after this many minutes (the rest are not run)")
    parser.add_argument("--baseline", action="store_true",
                        help="run each stage of the chosen mutants on the unmutated copy first")
    args = parser.parse_args(argv)

    targets = SHM_TARGETS if args.targets == "shm" else TARGETS
    everything = [m for path in targets for m in enumerate_mutants(path)]
    if args.list:
        for m in everything:
            print(f"{m.ident}\t{m.text}")
        print(f"# {len(everything)} mutants in {len(targets)} files")
        return 0
    if args.only:
        wanted = set(args.only)
        chosen = [m for m in everything if m.ident in wanted]
    elif args.sample:
        chosen = sample(everything, args.sample, args.seed)
    else:
        chosen = everything
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # so the copy is removed
    workdir = _workdir()
    lines = [f"# mutation run: {len(chosen)} of {len(everything)} mutants, seed {args.seed}, "
             f"MPI stage at -n {args.ranks}, {time.strftime('%Y-%m-%d %H:%M')}"]
    print(lines[0], flush=True)
    results = []
    try:
        if args.baseline and not baseline(chosen, workdir, args):
            return 1
        stop = None if args.minutes is None else time.monotonic() + 60 * args.minutes
        for m in chosen:
            if stop is not None and time.monotonic() > stop:
                lines.append(f"# stopped after {args.minutes} minutes: {len(results)} of "
                             f"{len(chosen)} mutants run")
                break
            verdict, stage, seconds = run_mutant(m, workdir, args)
            results.append((m, verdict))
            line = f"{verdict:9} {stage:18} {seconds:6.1f}s  {m.ident}  | {m.text[:70]}"
            lines.append(line)
            print(line, flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    counted = [(m, v) for m, v in results if v != "UNCHANGED"]
    lines.append("# per file: killed / mutants")
    for path in targets:
        mine = [v for m, v in counted if m.path == path]
        if mine:
            lines.append(f"#   {path}: {mine.count('KILLED')}/{len(mine)}")
    killed = sum(v == "KILLED" for _, v in counted)
    if counted:
        lines.append(f"# killed {killed} of {len(counted)}: {100 * killed / len(counted):.1f}%")
    for m, v in counted:
        if v == "SURVIVED":
            lines.append(f"# survivor {m.ident}: {m.text}")
    print("\n".join(line for line in lines if line.startswith("#")))
    if args.report:
        pathlib.Path(args.report).write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
