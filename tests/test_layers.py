"""The package's layers (docs/internals.md, "Layers"): every module imports only from its own
layer or below, inside functions too, and the imports between modules form no cycle.

An AST walk over every module of the package reads every ``import`` and ``from ... import``
(top level, function bodies, relative and absolute), maps both ends to their layer and fails on
an upward import, naming the file, the line and the two layers. Importing a submodule from
outside its package imports the package too (its ``__init__`` runs first), so that counts as
an import of the package as well.

:data:`ALLOWED` lists the upward imports that remain while their owners move them; an entry
that no longer exists fails too, so the list only shrinks.
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent / "mpiallreduce"
PACKAGE = "mpiallreduce"

#: bottom to top: a module imports only from its own layer or those before it.
ORDER = ("core", "transport", "choice", "calls", "face", "clients")

#: module (or package: every module under it) -> layer; the longest matching name decides.
#: Keep in step with docs/internals.md, "Layers".
LAYERS = {
    # core: plain data and pure functions, MPI only where a helper waits or reads a buffer
    "errors": "core", "ops": "core", "partition": "core", "schedule": "core", "sizes": "core",
    "topology": "core", "verify": "core", "algorithms": "core", "_waiting": "core",
    "_dlpack": "core", "_env": "core", "_version": "core", "_lru": "core", "_schedules": "core",
    "_shm_sizes": "core",
    # the compiled twins (and the choice of form): they import nothing of the package, the
    # call path and shm hand them what they run
    "_form": "core", "_compiled": "core", "reproducible._exact": "core",
    "reproducible._exact_numba": "core", "reproducible._exact_format": "core",
    # transport: moves bytes (point-to-point plans, the node's shared memory), and the hooks
    # the layers above plug in (_hooks); non-blocking requests and their progress
    "executor": "transport", "native_plan": "transport", "_binding": "transport",
    "_revoke": "transport", "_threads": "transport",
    "_hooks": "transport", "shm": "transport", "shm_nodes": "transport", "nonblocking.requests": "transport",
    "nonblocking.native": "transport", "nonblocking.progress": "transport",
    # choice: what auto picks; the model predicts from schedules and machine files (its
    # command line too: model.cli prints predictions, and runs nothing on MPI); decide judges
    # measured rounds for the bench, tune and learning
    "select": "choice", "model": "choice", "decide": "choice", "picks": "choice",
    # calls: the one call path (normalise, cache, agree, bind) and the non-blocking entry points
    "_plans": "calls", "_agree": "calls", "_checks": "calls", "_state": "calls",
    "_buffers": "calls", "nonblocking": "calls", "learn": "calls",
    # face: what users call
    "": "face", "api": "face", "collectives": "face", "comm": "face", "_requests": "face",
    "reproducible": "face", "grad": "face", "compression": "face", "tracing": "face",
    # clients: measure on MPI, draw, tune, report, from above the face
    "bench": "clients", "tune": "clients", "calibrate": "clients", "show": "clients",
    "__main__": "clients", "model.__main__": "clients", "torch": "clients",
}

#: upward imports that remain, each (importing module, imported module): who moves them. An
#: entry covers the module and every module under it (shm's, once shm is a package). An entry
#: that is no longer there fails test_allowed_upward_imports_still_exist: delete it then.
ALLOWED: dict[tuple[str, str], str] = {
    # none left: shm's reaches into _checks and _state went with its split into a package
    # (helper H1); add an entry here only with who removes it, and when
}


def _allowed(name: str, target: str) -> bool:
    return any(target == imported and (name == module or name.startswith(module + "."))
               for module, imported in ALLOWED)


def module_name(path: pathlib.Path) -> str:
    """``mpiallreduce/shm/node.py`` -> ``shm.node``; a package's ``__init__`` is the package;
    the package itself is ``""``."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(path): path for path in sorted(ROOT.rglob("*.py"))}


def is_package(name: str) -> bool:
    return name == "" or (ROOT / name.replace(".", "/") / "__init__.py").exists()


def layer_of(name: str) -> str:
    """The layer of a module: that of the longest name in LAYERS it is, or lies under."""
    parts = name.split(".") if name else []
    for end in range(len(parts), -1, -1):
        found = LAYERS.get(".".join(parts[:end]))
        if found is not None:
            return found
    raise AssertionError(f"module {name!r} has no layer: add it to LAYERS in {__file__} "
                         f"and to docs/internals.md, 'Layers'")


def _join(*parts: str) -> str:
    return ".".join(part for part in parts if part)


def _ancestors(name: str) -> list[str]:
    """The packages above a module, innermost first, the root package (``""``) left out."""
    parts = name.split(".")
    return [".".join(parts[:end]) for end in range(len(parts) - 1, 0, -1)]


def imports(name: str) -> list[tuple[str, int]]:
    """Every module of the package that module ``name`` imports, with the line: top level and
    inside functions, relative and absolute. ``from P import X`` is module ``P.X`` where that is
    a module, else ``P``; a submodule imported from outside its package adds the packages
    above it (their ``__init__`` runs first)."""
    path = MODULES[name]
    package = name if is_package(name) else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets = []
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == PACKAGE or alias.name.startswith(PACKAGE + "."):
                    targets.append(alias.name[len(PACKAGE) + 1:])
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".") if package else []
                base = base[:len(base) - (node.level - 1)]
                origin = _join(".".join(base), node.module or "")
            elif node.module == PACKAGE or (node.module or "").startswith(PACKAGE + "."):
                origin = node.module[len(PACKAGE) + 1:]
            else:
                continue
            for alias in node.names:
                candidate = _join(origin, alias.name)
                targets.append(candidate if candidate in MODULES else origin)
        for target in targets:
            if target not in MODULES:
                raise AssertionError(f"{path}:{node.lineno}: imports {target!r}, which is no "
                                     f"module of the package")
            mine = set(_ancestors(name)) | ({name} if is_package(name) else set())
            for module in [target] + _ancestors(target):
                if module not in mine and module != name:
                    found.append((module, node.lineno))
    return found


EDGES = {name: imports(name) for name in MODULES}


def _label(name: str) -> str:
    return f"{PACKAGE}.{name}" if name else PACKAGE


def test_every_module_has_a_layer():
    for name in MODULES:
        assert layer_of(name) in ORDER


def test_no_module_imports_from_a_layer_above_its_own():
    upward = []
    for name, edges in EDGES.items():
        mine = ORDER.index(layer_of(name))
        for target, line in edges:
            theirs = ORDER.index(layer_of(target))
            if theirs > mine and not _allowed(name, target):
                upward.append(f"{MODULES[name].relative_to(ROOT.parent)}:{line}: "
                              f"{_label(name)} ({ORDER[mine]}) imports {_label(target)} "
                              f"({ORDER[theirs]})")
    assert not upward, "upward imports:\n" + "\n".join(sorted(set(upward)))


def test_allowed_upward_imports_still_exist():
    stale = []
    for module, target in ALLOWED:
        if not any((name == module or name.startswith(module + "."))
                   and any(imported == target for imported, _ in found)
                   and ORDER.index(layer_of(target)) > ORDER.index(layer_of(name))
                   for name, found in EDGES.items()):
            stale.append(f"{_label(module)} no longer imports {_label(target)} upward")
    assert not stale, f"delete from ALLOWED in {__file__}:\n" + "\n".join(stale)


def _cycles(edges: dict) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, components = {}, {}, set(), [], []
    counter = 0
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(edges[root]))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(edges[child])))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    return components


def test_the_imports_form_no_cycle():
    # A submodule's import of its own package (a registry filled by the package's __init__,
    # as algorithms/ does) is the package's business, not a cycle between concerns; and the
    # upward imports in ALLOWED are those still being moved.
    edges = {name: sorted({target for target, _ in found
                           if target not in _ancestors(name) and not _allowed(name, target)})
             for name, found in EDGES.items()}
    cycles = _cycles(edges)
    assert not cycles, "import cycles:\n" + "\n".join(
        " <-> ".join(_label(name) for name in cycle) for cycle in cycles)


def test_the_transport_reaches_the_layers_above_only_through_hooks():
    """Nothing writes another module's attributes to plug itself in: hooks go through
    :mod:`mpiallreduce._hooks` (``register_tracer``, ``set_starter``)."""
    patches = []
    for path in MODULES.values():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Assign, ast.AugAssign)):
                for target in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                    if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) \
                            and target.value.id in {"executor", "_PlanBase", "Plan", "NativePlan",
                                                    "_hooks"}:
                        patches.append(f"{path.relative_to(ROOT.parent)}:{node.lineno}: "
                                       f"{target.value.id}.{target.attr} = ...")
    assert not patches, "set through _hooks instead:\n" + "\n".join(patches)
