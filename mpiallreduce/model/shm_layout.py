"""What the model knows of the shared-memory transport's layout: where its regimes change and
how large its chunks are, as :mod:`mpiallreduce.shm.protocol` defines them.

The model is pure prediction and imports nothing of the transport (which imports MPI), so the
few sizes it needs are written here as the model's description of the transport;
``tests/test_model.py`` checks that they equal the transport's own for every size it tries.
"""

from __future__ import annotations

#: most bytes per rank of the small regime (every rank reduces every slot).
SMALL_BYTES = 32 << 10
#: the same at 2 ranks on private arrays.
SMALL_BYTES_TWO_RANKS = 128 << 10
#: bytes per rank of one chunk of the large regime, and most chunks of one call.
CHUNK_BYTES = 512 << 10
MAX_CHUNKS = 1024
#: slot regions are aligned to this many bytes (a cache line).
ALIGN = 64


def small_bytes(nranks: int, shared: bool = False) -> int:
    """Most bytes per rank of the small regime for ``nranks`` ranks (``shared``: shared arrays)."""
    return SMALL_BYTES_TWO_RANKS if nranks == 2 and not shared else SMALL_BYTES


def chunk_bytes(nbytes: int) -> int:
    """Bytes per chunk of the large regime for a message of ``nbytes``."""
    per_chunk = -(-nbytes // MAX_CHUNKS)
    return max(CHUNK_BYTES, -(-per_chunk // ALIGN) * ALIGN)
