"""What ``algorithm="auto"`` picks for (p, bytes, op, topology).

The rule is deliberately conservative: an algorithm written in Python over point-to-point
messages pays tens of microseconds of interpreter time per step, which MPI's native collective
does not, so ``auto`` picks ``native`` unless a measured crossover says a schedule wins.
Crossovers come from ``python -m mpiallreduce.bench`` runs; none measured so far beats native
on a single shared-memory node (see README, "Performance").
"""

from __future__ import annotations

from .ops import Reducer


def choose(nranks: int, nbytes: int, reducer: Reducer, topology=None) -> str:
    """Return the algorithm name ``auto`` uses; identical on every rank for identical arguments."""
    return "native"
