"""Exact sums of float64 values on one rank: the local part of :func:`mpiallreduce.sum`,
:func:`~mpiallreduce.dot` and :func:`~mpiallreduce.norm2`.

A term (``sign * left`` or ``sign * left * right`` elementwise, each product rounded once in
float64, exact for float32 input) is reduced to its *exact* sum, an integer number of
``2**-1074`` (every float64 is a multiple of it), and two integers that say which special
values it holds (:class:`Total`). Because the sum is exact, it does not depend on how the
values are split over ranks, chunks or blocks, nor on which of the two implementations below
computed it: ranks may even differ in whether Numba is installed.

How: per block of values, the largest magnitude ``2**(e-1) <= m < 2**e`` sets a unit
``u = e - 84``; two additions of rounding constants (``hi = (v + 1.5 * 2**(94+u)) - ...``, then
the same with ``1.5 * 2**(52+u)`` on ``v - hi``; Demmel and Nguyen's extraction) split each value
into a multiple of ``2**(42+u)`` and one of ``2**u`` whose int64 bit patterns are summed, and
what is left below ``2**u`` (the residual, exact) goes round again with its own unit until
nothing is left (values 32 binades below a block's largest need a second round; zeros never do).
Values of ``2**1000`` and more are scaled by ``2**-128`` first (exact wherever the scaled value
is; the others go round unscaled).

- **NumPy** (always there): 12 passes over chunks of ``CHUNK`` values that stay in cache.
- **Numba** (``pip install mpiallreduce[fast]``, used when it imports; ``MPIALLREDUCE_NUMBA=0``
  turns it off): one compiled pass per block of ``BLOCK`` values at the unit the previous
  block's largest gave (a block that needs more is buffered and goes the long way), the words
  accumulated in a carry-save integer of 30-bit digits. Close to ``np.dot``'s time for a dot
  product, where the NumPy form takes an order of magnitude more (``scripts/reproducible_cost.py
  --dot`` measures it; docs/howto/numerics.md, "Reproducible sums").
"""

from __future__ import annotations

import math
import os
import warnings

import numpy as np

from ._exact_format import _INF_BITS, _NONE, BLOCK, HUGE_EXPONENT, SCALE  # noqa: F401 - BLOCK: as named here

#: values per NumPy chunk (two 128 KiB work arrays: in L2).
CHUNK = 1 << 14
#: the sign bit's pattern.
_SIGN = 1 << 63
#: 30-bit digits of the Numba accumulator: weights 2**(30k - 1074) up to 2**(2160 - 1074).
DIGITS = 72


class Total:
    """One term's (or component's) exact sum ``total * 2**-1074`` and, from the bit patterns of
    its values, ``most`` = max over values of their bits as signed int64 and ``most_negated``
    = the same for the negated values (:meth:`flags` derives the IEEE specials from them),
    and how many values it had. (The compiled form reports, for a block of finite values not
    all zero, its largest magnitude's bits as both: :meth:`flags` reads the same from them.)"""

    __slots__ = ("total", "most", "most_negated", "count")

    def __init__(self, total: int = 0, most: int = _NONE, most_negated: int = _NONE,
                 count: int = 0):
        self.total, self.most, self.most_negated, self.count = total, most, most_negated, count

    def add(self, other: Total, sign: int) -> None:
        """Add ``sign * other`` (a negated term swaps what its values' signs say)."""
        most, negated = ((other.most, other.most_negated) if sign > 0
                         else (other.most_negated, other.most))
        self.total += other.total if sign > 0 else -other.total
        self.most = max(self.most, most)
        self.most_negated = max(self.most_negated, negated)
        self.count += other.count

    def flags(self) -> list[int]:
        """[NaN, +inf, -inf, a value other than -0, any value], each 0 or 1."""
        most, negated = self.most, self.most_negated
        nan = int(max(most, negated) > _INF_BITS)
        return [nan, int(not nan and most == _INF_BITS), int(not nan and negated == _INF_BITS),
                int(most >= 0 or negated > 0), int(self.count > 0)]

    def special(self) -> bool:
        """Whether it holds a NaN or an infinity (its sum is then not needed)."""
        return max(self.most, self.most_negated) >= _INF_BITS


def term_total(left: np.ndarray, right: np.ndarray | None) -> Total:
    """The exact sum of ``left`` (``left * right`` rounded to float64, if given) and its bits.

    Where the compiled form fails (Numba cannot compile for this machine or these arrays), the
    NumPy form answers instead, with a warning, and from then on in this process: an error on
    one rank would leave the others waiting in the exchange, and both forms give the same sum.
    """
    kernel = _numba_kernel()
    if kernel is not None and left.size:
        try:
            return kernel(left, right)
        except Exception as exc:  # noqa: BLE001 - any failure of the compiled form
            _give_up(exc)
    return _numpy_total(left, right)


def _give_up(exc: Exception) -> None:
    warnings.warn(f"mpiallreduce: the compiled exact sums failed ({type(exc).__name__}: {exc}); "
                  f"using the NumPy form (the same results, slower)", RuntimeWarning,
                  stacklevel=3)
    _KERNEL[:] = [None]
    _COMPILED[:] = [None]


# -- NumPy ---------------------------------------------------------------------------------------

def _numpy_total(left: np.ndarray, right: np.ndarray | None) -> Total:
    result = Total(count=left.size)
    size = min(left.size, CHUNK)
    values, work, rest = np.empty(size), np.empty(size), np.empty(size)
    special = False
    with np.errstate(over="ignore", invalid="ignore"):
        for start in range(0, left.size, CHUNK):
            chunk = left[start:start + CHUNK]
            v = values[:chunk.size]
            if right is not None:
                np.multiply(chunk, right[start:start + CHUNK], out=v, dtype=np.float64)
            else:
                np.copyto(v, chunk)
            most, negated = _bit_maxima(v)
            result.most, result.most_negated = max(result.most, most), max(result.most_negated,
                                                                          negated)
            special = special or max(most, negated) >= _INF_BITS
            if not special:  # with a NaN or an infinity the sum is not needed
                result.total += _numpy_rounds(v, max(most, negated), work[:v.size],
                                              rest[:v.size])
    return result


def _bit_maxima(v: np.ndarray) -> tuple[int, int]:
    """(max of v's bits as int64, max of -v's): the latter is the unsigned max, sign flipped."""
    most = int(v.view(np.int64).max())
    return most, _signed(int(v.view(np.uint64).max()) ^ _SIGN)


def _numpy_rounds(v: np.ndarray, largest_bits: int, t: np.ndarray, r: np.ndarray) -> int:
    """The exact sum of the finite values ``v`` (overwritten) in units of 2**-1074."""
    total = 0
    while largest_bits > 0:
        exponent = math.frexp(_float(largest_bits))[1]
        if exponent >= HUGE_EXPONENT:
            scaled = np.multiply(v, 2.0 ** -SCALE)
            exact = np.multiply(scaled, 2.0 ** SCALE) == v
            scaled[~exact] = 0.0
            v[exact] = 0.0
            total += _numpy_rounds(scaled, _largest(scaled), t, r) << SCALE
            largest_bits = _largest(v)
            continue
        unit = max(exponent - 84, -1074)
        high = 1.5 * 2.0 ** (94 + unit)
        low = 1.5 * 2.0 ** (52 + unit)
        count = v.size
        np.add(v, high, out=t)
        upper = _signed((int(np.add.reduce(t.view(np.int64))) - count * _bits(high)) % (1 << 64))
        np.subtract(t, high, out=t)  # the multiple of 2**(42+u), exact
        np.subtract(v, t, out=r)  # what is left, exact
        np.add(r, low, out=t)
        lower = _signed((int(np.add.reduce(t.view(np.int64))) - count * _bits(low)) % (1 << 64))
        total += ((upper << 42) + lower) << (unit + 1074)
        np.subtract(t, low, out=t)  # the multiple of 2**u
        np.subtract(r, t, out=v)  # the residual below 2**u, exact
        largest_bits = _largest(v) if v.any() else 0
    return total


def _largest(v: np.ndarray) -> int:
    return max(_bit_maxima(v)) if v.size else 0


def _float(bits: int) -> float:
    return float(np.int64(bits).view(np.float64))


def _bits(value: float) -> int:
    return int(np.float64(value).view(np.int64))


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


# -- Numba ---------------------------------------------------------------------------------------

_KERNEL: list = []  # [the compiled term function or None], filled on first use


def _numba_kernel():
    if not _KERNEL:
        _KERNEL.append(_compile() if os.environ.get("MPIALLREDUCE_NUMBA", "1") != "0" else None)
    return _KERNEL[0]


def available() -> bool:
    """Whether the compiled form runs here (Numba imports and is not turned off)."""
    return _numba_kernel() is not None


_COMPILED: list = []  # [the kernels' module, warmed up, or None], filled on first use


def compiled():
    """The module of compiled kernels (:mod:`._exact_numba`) where :func:`available`, else None
    (the elementwise conversion of ``reproducible=True`` uses its ``keys`` and ``words``).

    The first use compiles them for the arrays a plan binds (float32 and float64 values, the
    strided top bits, uint16 keys), so that a failure shows here, before any exchange (the plan
    then binds its NumPy calls: the same words), never in the middle of a run."""
    if not available():  # (also where a test turns the compiled form off)
        return None
    if not _COMPILED:
        module = None
        if available():
            from . import _exact_numba as module
            try:
                for dtype in (np.float64, np.float32):
                    values = np.ones(2, dtype)
                    keys = np.zeros(2, np.uint16)
                    module.keys(values.view(np.uint16)[::values.itemsize // 2], keys)
                    module.words(values, keys, np.empty(2), np.empty(2), 7, 0, 1.0, True)
            except Exception as exc:  # noqa: BLE001 - any failure of the compiled form
                _give_up(exc)
                module = None
        _COMPILED.append(module)
    return _COMPILED[0]


def _compile():
    """The Numba form of :func:`term_total`, or None where Numba does not import."""
    try:
        from . import _exact_numba
    except ImportError:
        return None

    term = _exact_numba.term

    def term_total_numba(left: np.ndarray, right: np.ndarray | None) -> Total:
        # (compiled code sets no NumPy error state: infinities and NaN pass as IEEE makes them)
        digits = np.zeros(DIGITS, np.int64)
        most, negated = term(left, left if right is None else right, right is not None, digits)
        total = 0
        for k in np.flatnonzero(digits).tolist():
            total += int(digits[k]) << (30 * k)
        return Total(total, int(most), int(negated), left.size)

    return term_total_numba
