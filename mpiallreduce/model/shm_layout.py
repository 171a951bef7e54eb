"""What the model knows of the shared-memory transport's layout: where its regimes change and
how large its chunks are.

The model is pure prediction and imports nothing of the transport (which imports MPI); the
sizes are :mod:`mpiallreduce._shm_sizes`' (core), the definitions :mod:`mpiallreduce.shm.protocol`
runs on too, so they are written once.
"""

from __future__ import annotations

from .._shm_sizes import (  # noqa: F401 - the model's names for them
    ALIGN,
    CHUNK_BYTES,
    COMPILED_REDUCE_DTYPES,
    MAX_CHUNKS,
    SMALL_BYTES,
    SMALL_BYTES_TWO_RANKS,
    chunk_bytes,
    small_bytes,
)
