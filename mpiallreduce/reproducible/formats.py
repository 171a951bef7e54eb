"""How each float type is held as fixed-point words: the formats, the checks of what
``reproducible=True`` covers, and the one rounding back from an exact total."""

from __future__ import annotations

import math
import sys

import numpy as np
from mpi4py import MPI

from ..executor import flat
from ..ops import AVG

#: bits of each fixed-point word below its 21 bits of carry headroom.
WORD_BITS = 42
#: most contributions (ranks) an element may have: each word then stays below 2**62.
MAX_CONTRIBUTIONS = 1 << 20


class _Format:
    """How one float type is held: words per value and the layout of its top 16 bits."""

    def __init__(self, dtype, words: int, mantissa: int, exponent_bits: int, min_unit: int):
        self.dtype = np.dtype(dtype)
        self.words = words
        self.mantissa = mantissa  # significant bits, the hidden one included
        self.min_unit = min_unit  # the subnormal spacing: every value is a multiple of it
        self.max_exponent = 1 << (exponent_bits - 1)  # 2**max_exponent overflows
        self.all_ones = (1 << exponent_bits) - 1  # biased exponent of inf and NaN
        self.bias = (1 << (exponent_bits - 1)) - 2  # |x| < 2**(b - bias) for biased exponent b
        # key = the top 16 bits rotated left by one with the sign bit inverted: the biased
        # exponent b in its top bits (so a MAX of keys is a MAX of exponents), then the leading
        # fraction bits, then "not negative"; b = key >> key_shift
        self.key_shift = 16 - exponent_bits
        self.top = self.dtype.itemsize // 2 - 1 if sys.byteorder == "little" else 0


FORMATS = {np.dtype(np.float64): _Format(np.float64, 2, 53, 11, -1074),
           np.dtype(np.float32): _Format(np.float32, 1, 24, 8, -149)}
#: index of a float64's top 16 bits among its four
_TOP64 = FORMATS[np.dtype(np.float64)].top
_REAL = {np.dtype(np.complex128): np.dtype(np.float64),
         np.dtype(np.complex64): np.dtype(np.float32)}


def check(op_name: str, dtype: np.dtype) -> None:
    """Raise ValueError unless ``reproducible=True`` covers (op, dtype)."""
    dtype = np.dtype(dtype)
    if op_name in ("SUM", "AVG") and (dtype in FORMATS or dtype in _REAL):
        return
    raise ValueError(
        f"reproducible=True covers SUM and AVG on float32, float64, complex64 and complex128, "
        f"not {op_name} on {dtype}; MIN, MAX and sums of integers are exact, so every algorithm "
        f"and rank order already gives the same bits: pass reproducible=False")


def covers(op, dtype) -> bool:
    """Does ``reproducible=True`` apply to (op, dtype)? (``mar.Comm`` passes it only then: other
    ops and integer dtypes are reproducible already.)"""
    return (op is AVG or op == MPI.SUM) and (np.dtype(dtype) in FORMATS
                                             or np.dtype(dtype) in _REAL)


def _float_view(array: np.ndarray) -> np.ndarray:
    """The flat float view of a float or complex array (real and imaginary parts interleaved)."""
    values = flat(array)
    return values.view(_REAL.get(values.dtype, values.dtype))


def word_bits(nranks: int) -> int:
    """Bits per word for sums of ``nranks`` contributions: 42, fewer past 1023 ranks.

    A word is an integer-valued float64 below ``2**bits``; a sum of ``nranks`` of them stays
    below ``2**52``, so every partial sum is exact and every order gives the same words.
    """
    return min(WORD_BITS, 52 - nranks.bit_length())


def _round(total: int, unit: int, fmt: _Format) -> float:
    """``total * 2**unit`` rounded to nearest (ties to even) in ``fmt``, as a Python float."""
    if total == 0:
        return 0.0
    magnitude = abs(total)
    kept_unit = max(unit + magnitude.bit_length() - fmt.mantissa, fmt.min_unit)
    if kept_unit > unit:
        drop = kept_unit - unit
        kept = magnitude >> drop
        rest = magnitude - (kept << drop)
        half = 1 << (drop - 1)
        if rest > half or (rest == half and kept & 1):
            kept += 1
        magnitude, unit = kept, kept_unit
    if magnitude.bit_length() + unit > fmt.max_exponent:
        value = math.inf
    else:
        value = math.ldexp(float(magnitude), unit)  # exact: at most fmt.mantissa bits
    return -value if total < 0 else value
