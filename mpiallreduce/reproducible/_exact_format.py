"""The constants both forms of the exact local sum share (:mod:`._exact`, NumPy, and
:mod:`._exact_numba`, compiled), in one place so that neither imports the other's module."""

#: values per Numba block (products buffered in 128 KiB).
BLOCK = 1 << 14
#: bit pattern of +inf (anything above, in magnitude, is a NaN).
_INF_BITS = 0x7FF0000000000000
#: the max of no bit patterns.
_NONE = -(1 << 63)
#: a value whose block's largest is at or above 2**(HUGE_EXPONENT - 1) is scaled by 2**-SCALE.
HUGE_EXPONENT = 1001
SCALE = 128
