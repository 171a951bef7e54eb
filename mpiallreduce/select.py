"""What ``algorithm="auto"`` picks for (p, bytes, op, topology).

An algorithm written in Python over point-to-point messages pays about 10 µs of interpreter
time per step that MPI's native collective does not, so ``auto`` picks ``native`` unless a
measured crossover says a schedule wins. One such crossover is measured here (README,
"Performance"): from 32 MiB per rank, ``ring_segmented`` beat Open MPI 5.0.11's own
``Allreduce`` by a median 1.73x (32 MiB) and 1.86x (64 MiB) at 2 ranks over three bench runs,
and by 1.74x / 1.65x at 4 ranks, with every schedule faster than native there. Below 32 MiB the
ratios straddle 1 and ``native`` stays. Re-measure with ``python -m mpiallreduce.bench`` on
another machine or MPI before trusting the threshold there; ``algorithm=`` overrides it.
"""

from __future__ import annotations

from functools import lru_cache

from .ops import Reducer

#: bytes per rank from which ``auto`` prefers the pipelined ring to native (measured crossover).
LARGE_MESSAGE_BYTES = 32 << 20
#: where native saturates 8/16-bit sums, ``auto`` runs recursive doubling below this many bytes
#: per rank and the ring from here on (the results are modular either way).
MODULAR_RING_BYTES = 1 << 16
#: communicator sizes the crossover above was measured at; larger ones ask the cost model.
MEASURED_RANKS = 8


def choose(nranks: int, nbytes: int, reducer: Reducer, topology=None) -> str:
    """Return the algorithm name ``auto`` uses; identical on every rank for identical arguments.

    Never returns an algorithm that refuses the op: non-commutative ops always get ``native``.
    """
    if nranks > MEASURED_RANKS:
        return model_choice(nranks, nbytes, reducer, topology)
    if nranks > 1 and nbytes >= LARGE_MESSAGE_BYTES and reducer.commutative:
        return "ring_segmented"
    return "native"


def model_choice(nranks: int, nbytes: int, reducer: Reducer, topology=None) -> str:
    """Fallback where nothing was measured: the cost model's fastest (built-in machine).

    Native is modelled as Open MPI's own decision in C (no interpreter cost, a copy of the
    message per call in its Rabenseifner), so it wins small messages and schedules win large
    ones. Non-commutative ops get native (it keeps rank order). Memoized per power-of-two size
    bucket, so a repeated question is a dictionary lookup.
    """
    if not reducer.commutative:
        return "native"  # the model times order-keeping schedules too, but native keeps order
    bucket = 1 << (max(int(nbytes), 1).bit_length() - 1)
    return _model_choice(nranks, bucket, True, topology)


@lru_cache(maxsize=1024)
def _model_choice(nranks: int, bucket: int, commutative: bool, topology) -> str:
    from . import model

    return model.choose(nranks, bucket, commutative, topology)
