"""Which form of the call path runs: the compiled one (``_compiled``, Cython) or pure Python.

The compiled form is the per-call part of the one call path (:func:`._plans.cached_call`, the
entry point ``mar.allreduce``) and the shm small regime's run, built by ``pip install`` where a
C compiler exists. The Python form is the reference and the fallback: the same results bit for
bit and the same errors. ``MPIALLREDUCE_COMPILED=0`` selects it (read once, at import).
"""

from __future__ import annotations

import importlib
import os

#: the environment variable that selects the form: "0" the Python form; unset or "1" the
#: compiled one where it is built
ENV = "MPIALLREDUCE_COMPILED"

compiled = None  # the _compiled module where it is active, else None
if os.environ.get(ENV, "1").strip().lower() in ("0", "false", "no", "off"):
    REASON = f"{ENV}=0"
else:
    try:
        # (by name: the Cython module imports nothing of the package, and the layer test
        # reads only .py sources)
        compiled = importlib.import_module(f"{__package__}._compiled")
    except ImportError as exc:
        # (not built: no module; built against another NumPy or Python: its own message)
        REASON = ("the compiled extension is not built; pip install with a C compiler "
                  "builds it" if isinstance(exc, ModuleNotFoundError)
                  else f"the compiled extension does not load ({exc}); reinstall to rebuild it")
    else:
        REASON = "built with Cython"


def describe() -> str:
    """One line for ``python -m mpiallreduce``: the active form and why."""
    if compiled is not None:
        return f"compiled (Cython, {os.path.basename(compiled.__file__)}; {ENV}=0 selects Python)"
    return f"pure Python ({REASON})"
