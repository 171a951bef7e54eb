"""Block distribution: the one place that splits a count into chunks.

Every chunk boundary in the package comes from here, so ring, Rabenseifner, reduce_scatter and
allgather agree on which rank owns which elements (the first ``count % parts`` blocks hold one
element more, as MPI's ``Reduce_scatter``/``Allgatherv`` users and mpi4py-fft lay them out).
"""

from __future__ import annotations


def block(count: int, parts: int, index: int) -> tuple[int, int]:
    """Return the half-open range ``[start, stop)`` of block ``index`` of ``count`` split ``parts`` ways."""
    q, r = divmod(count, parts)
    return index * q + min(index, r), (index + 1) * q + min(index + 1, r)


def blocks(count: int, parts: int) -> list[tuple[int, int]]:
    """Return all ``parts`` blocks of ``count`` in order."""
    return [block(count, parts, index) for index in range(parts)]


def block_counts(count: int, parts: int) -> list[int]:
    """Return the size of each of the ``parts`` blocks of ``count``."""
    return [stop - start for start, stop in blocks(count, parts)]


def span(count: int, parts: int, first: int, last: int) -> tuple[int, int]:
    """Return the range covered by blocks ``first .. last - 1`` (contiguous blocks)."""
    start, _ = block(count, parts, first)
    _, stop = block(count, parts, last - 1) if last > first else (start, start)
    return start, stop


def segments(start: int, stop: int, size: int) -> list[tuple[int, int]]:
    """Split ``[start, stop)`` into consecutive pieces of at most ``size`` elements."""
    if size < 1:
        raise ValueError(f"segment size must be >= 1 element, got {size}")
    return [(lo, min(lo + size, stop)) for lo in range(start, stop, size)] or [(start, stop)]


def sub_block(start: int, stop: int, parts: int, index: int) -> tuple[int, int]:
    """Return piece ``index`` of ``[start, stop)`` split ``parts`` ways (block distribution)."""
    lo, hi = block(stop - start, parts, index)
    return start + lo, start + hi
