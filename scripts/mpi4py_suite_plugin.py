"""pytest plugin: run mpi4py's own test modules with MPI.COMM_WORLD and MPI.COMM_SELF replaced
by ``mar.Comm`` objects (``scripts/mpi4py_suite.py`` loads it with ``-p mpi4py_suite_plugin``).

``MPIALLREDUCE_SUITE_ALGORITHM`` names the algorithm; ``plain`` leaves mpi4py's communicators
alone (the reference run). The swap happens when pytest loads this plugin, before it imports
the test modules, so every ``COMM = MPI.COMM_WORLD`` in their class bodies, every
``MPI.COMM_WORLD.Dup()`` and every ``MPI.COMM_SELF`` in a test body gets the drop-in.
As mpi4py's own runner does without --numba/--cupy, the GPU array back-ends are hidden: this
machine has no GPU, and Numba's CUDA simulator fails those tests under plain mpi4py too.
"""

import os
import sys

sys.modules["numba"] = None  # mpi4py's runner: --no-numba, --no-cupy (the defaults without a GPU)
sys.modules["cupy"] = None

from mpi4py import MPI  # noqa: E402

ALGORITHM = os.environ.get("MPIALLREDUCE_SUITE_ALGORITHM", "plain")

if ALGORITHM != "plain":
    import mpiallreduce as mar

    MPI.COMM_WORLD = mar.Comm(MPI.COMM_WORLD, ALGORITHM)
    MPI.COMM_SELF = mar.Comm(MPI.COMM_SELF, ALGORITHM)
