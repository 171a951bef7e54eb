"""The shared-memory transport's sizes, written once: where its regimes change, how large its
chunks are, how slots are aligned.

Core: plain numbers and pure functions, no MPI. :mod:`.shm.protocol` (the transport) and
:mod:`.model.shm_layout` (the model's description of the transport, which must not import it)
both take them from here. The functions take the sizes as arguments, with these values as
defaults: the transport passes its own module's names (which tests set, ``shm.CHUNK_BYTES =
4096``), so a test that shrinks the transport's chunks leaves the model's predictions alone.
"""

from __future__ import annotations

#: most bytes per rank of the small regime (every rank reduces every slot).
SMALL_BYTES = 32 << 10
#: the same at 2 ranks on private arrays (:func:`small_bytes`): there each rank reduces the
#: whole message either way, and one epoch instead of two measured faster up to here
#: (docs/performance.md, "Where shm stops").
SMALL_BYTES_TWO_RANKS = 128 << 10
#: bytes per rank of one chunk of the large regime on a private result: the message moves
#: through two chunk buffers per parity slot, a chunk at a time, so the slots stay in the
#: caches instead of streaming the whole message through memory twice more (see
#: :class:`.shm.large.ChunkedPlan`; measured in docs/performance.md, "Chunks").
CHUNK_BYTES = 512 << 10
#: most chunks of one call: a larger message takes larger chunks (the bound calls per chunk
#: are kept per plan).
MAX_CHUNKS = 1024
#: alignment of slot regions (a cache line).
ALIGN = 64
#: the element types whose small-regime load and reduce (SUM, PROD, AVG) the compiled call path
#: runs in C, at every size of the small regime: one vectorised pass per rank, as NumPy's ufunc
#: calls make, without their per-call cost (a loop element by element, all ranks at a time,
#: would lose to the ufuncs past 1 KiB: the pass per rank is what lets it cover every size).
#: Other types and ops call NumPy's ufuncs in each run (the model charges ``shm_call`` there).
COMPILED_REDUCE_DTYPES = ("float32", "float64")


def small_bytes(nranks: int, shared: bool = False, small: int = SMALL_BYTES,
                small_two_ranks: int = SMALL_BYTES_TWO_RANKS) -> int:
    """Most bytes per rank of the small regime for ``nranks`` ranks; ``shared``: a buffer is a
    shared array (the large regime reads it in place, with no copy)."""
    return small_two_ranks if nranks == 2 and not shared else small


def round_up(nbytes: int, align: int = ALIGN) -> int:
    """``nbytes`` rounded up to a whole number of ``align`` bytes (cache lines)."""
    return -(-nbytes // align) * align


def chunk_bytes(nbytes: int, chunk: int = CHUNK_BYTES, most: int = MAX_CHUNKS,
                align: int = ALIGN) -> int:
    """Bytes per chunk of the large regime for a message of ``nbytes`` (agreed on every rank):
    ``chunk``, or more where the message would take more than ``most`` chunks."""
    return max(chunk, round_up(-(-nbytes // most), align))
