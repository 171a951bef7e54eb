"""Message sizes on command lines: "8", "4K", "8:1G" (powers of two) and back to "4K"."""

from __future__ import annotations

import re

_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}
_SIZE = re.compile(r"^\s*(\d+)\s*([KMG]?)(?:I?B)?\s*$", re.IGNORECASE)


class UsageError(Exception):
    """A bad command line (the bench reports it once, on rank 0, and every rank exits 2)."""


def parse_size(text: str) -> int:
    """Return the byte count of ``text`` ("64", "4K", "16M", "1G"; binary units)."""
    match = _SIZE.match(text)
    if not match:
        raise UsageError(f"bad size {text!r}: expected a number of bytes with an optional K, M or G "
                         f"suffix (powers of 1024), e.g. 8, 4K, 16M")
    return int(match.group(1)) * _UNITS[match.group(2).upper()]


def parse_sizes(text: str) -> list[int]:
    """Return the powers of two from MIN to MAX for ``"MIN:MAX"`` (or the one size ``"N"``);
    a comma list of those gives their union, sorted (``"8,64K,8M:16M"``)."""
    if "," in text:
        return sorted({size for part in text.split(",") for size in parse_sizes(part)})
    low, sep, high = text.partition(":")
    sizes = (parse_size(low), parse_size(high) if sep else parse_size(low))
    for size in sizes:
        if size < 1 or size & (size - 1):
            raise UsageError(f"bad size {human(size)} in --sizes {text!r}: sizes must be powers of "
                             f"two (1, 2, 4, ..., 1K, ..., 1G)")
    if sizes[0] > sizes[1]:
        raise UsageError(f"--sizes {text!r}: MIN {human(sizes[0])} is larger than MAX "
                         f"{human(sizes[1])}")
    return [1 << k for k in range(sizes[0].bit_length() - 1, sizes[1].bit_length())]


def human(size: int) -> str:
    """Return ``size`` bytes as 8, 4K, 16M, 1G (exact binary units) or plain bytes."""
    for suffix, unit in (("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if size >= unit and size % unit == 0:
            return f"{size // unit}{suffix}"
    return str(size)
