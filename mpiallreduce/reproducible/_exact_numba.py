"""The compiled form of :mod:`._exact` (imported only where Numba is installed).

Every function here is ``numba.njit(cache=True)``: compiled on first use per argument type
(float32 or float64, contiguous or strided) and kept in ``__pycache__`` for the next process.
The arithmetic is :mod:`._exact`'s, operation for operation (no fast-math: a fused multiply-add
would change the products' rounding), so both forms give the same exact sums.
"""

from __future__ import annotations

import math

import numba
import numpy as np
from llvmlite import ir
from numba.core import types
from numba.extending import intrinsic

from ._exact_format import _INF_BITS, _NONE, BLOCK, HUGE_EXPONENT, SCALE

_MASK = (1 << 30) - 1
_jit = numba.njit(cache=True, nogil=True, error_model="numpy")


@intrinsic
def _bits(typingctx, value):
    """A float64's bit pattern as int64 (LLVM bitcast: vectorises, unlike a view)."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(64))
    return types.int64(types.float64), codegen


@intrinsic
def _from_bits(typingctx, value):
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.DoubleType())
    return types.float64(types.int64), codegen


@_jit
def _add_word(digits, word, position):
    """digits += word * 2**position; digits[k] weighs 2**(30k), each add below 2**30 per digit."""
    k, shift = position // 30, position % 30
    low = (word & _MASK) << shift
    digits[k] += low & _MASK
    digits[k + 1] += low >> 30
    high = (word >> 30) << shift
    digits[k + 1] += high & _MASK
    digits[k + 2] += high >> 30


@_jit
def _exponent(bits):
    """frexp's exponent of a positive finite float given by its bits."""
    return math.frexp(_from_bits(bits))[1]


@_jit
def _largest(buf, m):
    most = 0
    for i in range(m):
        most = max(most, _bits(abs(buf[i])))
    return most


@_jit
def _rounds(buf, m, largest_bits, offset, digits):
    """Add the exact sum of buf[:m] (finite; overwritten) * 2**offset, in units of 2**-1074."""
    while largest_bits > 0:
        exponent = _exponent(largest_bits)
        unit = max(exponent - 84, -1074)
        high = np.ldexp(1.5, 94 + unit)
        low = np.ldexp(1.5, 52 + unit)
        high_bits, low_bits = _bits(high), _bits(low)
        upper = 0
        lower = 0
        residual = 0
        for i in range(m):
            v = buf[i]
            t = v + high
            upper += _bits(t) - high_bits
            r = v - (t - high)
            r2 = r + low
            lower += _bits(r2) - low_bits
            left = r - (r2 - low)
            buf[i] = left
            residual = max(residual, _bits(abs(left)))
        _add_word(digits, upper, unit + 42 + 1074 + offset)
        _add_word(digits, lower, unit + 1074 + offset)
        largest_bits = residual


@_jit
def _block_total(buf, spare, m, largest_bits, digits):
    if _exponent(largest_bits) >= HUGE_EXPONENT:
        down, up = np.ldexp(1.0, -SCALE), np.ldexp(1.0, SCALE)
        for i in range(m):
            v = buf[i]
            w = v * down
            if w * up == v:
                spare[i] = w
                buf[i] = 0.0
            else:
                spare[i] = 0.0
        _rounds(spare, m, _largest(spare, m), SCALE, digits)
        largest_bits = _largest(buf, m)
    _rounds(buf, m, largest_bits, 0, digits)


@_jit
def _fused(left, right, multiply, m, unit):
    """One pass over a block at a guessed unit: the two words' sums, whether any value left a
    residual, and the largest magnitude's bits (:func:`term` keeps the words only where they
    are exact)."""
    high = np.ldexp(1.5, 94 + unit)
    low = np.ldexp(1.5, 52 + unit)
    high_bits, low_bits = _bits(high), _bits(low)
    upper = 0
    lower = 0
    inexact = False
    largest = 0
    for i in range(m):  # (LLVM takes the loop-invariant test out of the loop)
        v = np.float64(left[i]) * np.float64(right[i]) if multiply else np.float64(left[i])
        largest = max(largest, _bits(abs(v)))
        t = v + high
        upper += _bits(t) - high_bits  # each below 2**48: the sums cannot wrap
        r = v - (t - high)
        r2 = r + low
        lower += _bits(r2) - low_bits
        inexact |= r != r2 - low
    return upper, lower, inexact, largest


@_jit
def _products(left, right, multiply, m, buf):
    for i in range(m):
        if multiply:
            buf[i] = np.float64(left[i]) * np.float64(right[i])
        else:
            buf[i] = np.float64(left[i])


@_jit
def term(left, right, multiply, digits):
    """Add the exact sum of left (or left * right, each product rounded to float64) to digits;
    return (max of the values' bits, max of the negated values' bits) as int64.

    Each block is one pass at the unit the previous block's largest value gave: kept where its
    largest is at most 2**6 times that (the int64 sums cannot wrap) and nothing is left below
    the unit; otherwise the block's products are buffered and go through :func:`_block_total`.
    """
    n = left.size
    buf = np.empty(min(n, BLOCK))
    spare = np.empty(min(n, BLOCK))
    most = _NONE
    most_negated = _NONE
    special = False
    guess = HUGE_EXPONENT  # no guess yet: the first block goes the long way
    for start in range(0, n, BLOCK):
        m = min(n, start + BLOCK) - start
        block_left = left[start:start + m]
        block_right = right[start:start + m]
        kept = False
        if guess < HUGE_EXPONENT and not special:
            unit = max(guess - 84, -1074)
            upper, lower, inexact, top = _fused(block_left, block_right, multiply, m, unit)
            if 0 < top < _INF_BITS and not inexact and _exponent(top) <= guess + 6:
                _add_word(digits, upper, unit + 42 + 1074)
                _add_word(digits, lower, unit + 1074)
                # finite, some value nonzero: that is all the bits say here (Total.flags)
                a = b = top
                kept = True
        if not kept:
            _products(block_left, block_right, multiply, m, buf)
            a = _NONE
            b = _NONE
            for i in range(m):
                a = max(a, _bits(buf[i]))
                b = max(b, _bits(-buf[i]))
            top = max(a, b)
            if top >= _INF_BITS:
                special = True  # the sum is not needed from here; the bits still are
            elif top > 0 and not special:
                _block_total(buf, spare, m, top, digits)
        most = max(most, a)
        most_negated = max(most_negated, b)
        if top > 0 and top < _INF_BITS:
            guess = _exponent(top)
    return most, most_negated


# -- the elementwise conversion of reproducible=True (reproducible.ReproduciblePlan) ------------

@_jit
def keys(top, out):
    """Each value's key from its top 16 bits: rotated left by one, the sign bit inverted (the
    NumPy calls of ``ReproduciblePlan._bind``, in one pass)."""
    for i in range(top.size):
        t = np.int64(top[i])
        out[i] = ((t << 1) & 0xFFFF) | (((~t) & 0xFFFF) >> 15)


@_jit
def words(values, keys, high, low, shift, magic, down, two):
    """The words of each value at its agreed key: ``M`` from the key's top bits (a float64 whose
    top 16 bits are ``((key >> shift) & 0xFFF0) + magic``, the rest 0), ``hi = (x + M) - M`` and,
    for two words, ``lo = ((x - hi) + M * down) - M * down``: ``_bind``'s NumPy calls, one
    pass."""
    for i in range(values.size):
        top = (((np.int64(keys[i]) >> shift) & 0xFFF0) + magic) & 0xFFFF
        m = _from_bits(top << 48)
        x = np.float64(values[i])
        hi = (x + m) - m
        high[i] = hi
        if two:
            b = m * down
            low[i] = ((x - hi) + b) - b
