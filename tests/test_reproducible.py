"""The pieces of reproducible sums that need no peers: rounding, headroom, argument checks."""

from __future__ import annotations

import math
import random
from fractions import Fraction

import numpy as np
import pytest
from mpi4py import MPI

import mpiallreduce as mar
from mpiallreduce import reproducible
from mpiallreduce.reproducible import FORMATS, MAX_CONTRIBUTIONS, _exact, _round, check, word_bits

F64, F32 = FORMATS[np.dtype(np.float64)], FORMATS[np.dtype(np.float32)]


def nearest(exact: Fraction, dtype) -> float:
    """Round ``exact`` to nearest, ties to even, by searching the float grid (no float math)."""
    info = np.finfo(dtype)
    if exact == 0:
        return 0.0
    sign, magnitude = (1, exact) if exact > 0 else (-1, -exact)
    mantissa = info.nmant + 1
    exponent = magnitude.numerator.bit_length() - magnitude.denominator.bit_length()
    while Fraction(2) ** exponent > magnitude and exponent > info.minexp:
        exponent -= 1
    while Fraction(2) ** (exponent + 1) <= magnitude:
        exponent += 1
    unit = Fraction(2) ** (max(exponent, info.minexp) - mantissa + 1)
    steps = magnitude / unit
    floor = steps.numerator // steps.denominator
    rest = steps - floor
    if rest > Fraction(1, 2) or (rest == Fraction(1, 2) and floor % 2):
        floor += 1
    value = floor * unit
    if value >= Fraction(2) ** (info.maxexp):
        return sign * math.inf
    return sign * float(value)


@pytest.mark.parametrize("fmt, dtype", [(F64, np.float64), (F32, np.float32)], ids=["f64", "f32"])
def test_round_is_correct_rounding_ties_to_even(fmt, dtype):
    rng = random.Random(1)
    cases = [(1, 0), (-1, 0), (3, -1076), ((1 << 53) + 1, 0), ((1 << 54) + 2, -1),
             ((1 << 24) + 1, 0), ((1 << 200) - 1, 900), (5, -1075), (5, -151), (3, 127),
             ((1 << 25) - 1, 103)]
    for _ in range(3000):
        bits = rng.randint(1, 140)
        total = rng.getrandbits(bits) * rng.choice([-1, 1]) or 1
        unit = rng.randint(-1200, 1000)
        cases.append((total, unit))
    for total, unit in cases:
        want = nearest(Fraction(total) * Fraction(2) ** unit, dtype)
        got = _round(total, unit, fmt)
        assert got == want or (math.isinf(got) and got == want), (total, unit, got, want)
        assert float(dtype(got)) == got or math.isinf(got)


def test_words_have_headroom_for_every_supported_rank_count():
    for nranks in (1, 2, 3, 1023, 1024, 1025, 65536, MAX_CONTRIBUTIONS):
        bits = word_bits(nranks)
        assert nranks * 2 ** bits < 2 ** 52  # every partial sum of words is an exact float64
        assert bits >= 31
    assert word_bits(2) == word_bits(1023) == reproducible.WORD_BITS


@pytest.mark.parametrize("op, dtype", [("MAX", "float64"), ("MIN", "float32"), ("PROD", "float64"),
                                       ("SUM", "int64"), ("SUM", "uint8"), ("AVG", "int32")])
def test_uncovered_ops_and_dtypes_name_the_reason(op, dtype):
    with pytest.raises(ValueError, match="MIN, MAX and sums of integers are exact"):
        check(op, np.dtype(dtype))
    for op, dtype in (("SUM", "float64"), ("AVG", "complex64")):
        check(op, np.dtype(dtype))


def test_single_rank_results_are_the_input_bits():
    """One contribution per element: every value comes back as it was (subnormals, -0, inf)."""
    x = np.array([1.5, -0.0, 0.0, 5e-324, -5e-324, np.inf, -np.inf, 1e308, 2.0 ** -1060, -3.0])
    out = mar.allreduce(x, None, comm=MPI.COMM_SELF, algorithm="ring", reproducible=True)
    assert np.array_equal(out, x) and np.array_equal(np.signbit(out), np.signbit(x))
    y = np.where(np.abs(x) > 1e38, 3e38, x).astype(np.float32)
    out32 = mar.allreduce(y, None, comm=MPI.COMM_SELF, reproducible=True)
    assert np.array_equal(out32, y) and np.array_equal(np.signbit(out32), np.signbit(y))


def test_sum_of_subnormals_and_of_opposite_extremes_is_exact():
    tiny = np.float64(5e-324)
    values = np.array([tiny] * 1000 + [-tiny] * 10)
    assert float(mar.sum(values, comm=MPI.COMM_SELF)) == 990 * 5e-324
    big = np.finfo(np.float64).max
    assert float(mar.sum(np.array([big, big, -big]), comm=MPI.COMM_SELF)) == big
    assert float(mar.sum(np.array([big, big]), comm=MPI.COMM_SELF)) == math.inf
    assert float(mar.sum(np.array([], dtype=np.float64), comm=MPI.COMM_SELF)) == 0.0
    assert mar.sum(np.ones(3, dtype=np.float32), comm=MPI.COMM_SELF).dtype == np.float32
    assert mar.norm2(np.array([3 + 4j]), comm=MPI.COMM_SELF) == 5.0
    assert mar.dot(np.array([1 + 2j]), np.array([3 - 1j]), comm=MPI.COMM_SELF) == (1 + 2j) * (3 - 1j)


# -- the exact local totals of mar.sum / mar.dot / mar.norm2 (both forms) -------------------------

FORMS = ["numpy", pytest.param("numba", marks=pytest.mark.skipif(
    not _exact.available(), reason="Numba not installed (the fast extra)"))]


def _form(name):
    return _exact._numpy_total if name == "numpy" else _exact._numba_kernel()


def _exact_units(values: np.ndarray) -> int:
    """The exact sum in units of 2**-1074, by rationals."""
    total = sum((Fraction(float(v)) for v in values), Fraction(0)) * 2 ** 1074
    assert total.denominator == 1
    return total.numerator


def _hard_vectors():
    """Wide spans, blocks whose magnitudes jump (the compiled form's guessed unit), the
    largest floats beside the smallest, subnormals, cancellation, zeros of both signs."""
    rng = np.random.default_rng(3)
    block = _exact.BLOCK
    spans = rng.standard_normal(5000) * 2.0 ** rng.integers(-1074, 1000, 5000)
    jumps = np.concatenate([rng.standard_normal(block) * 2.0 ** e for e in (0, 40, -60, 900, -1070)])
    top = np.array([2.0 ** 1023 * 1.999, -2.0 ** 1023, 2.0 ** 1000, 5e-324, -2.0 ** -1060, 3.0])
    mixed = np.concatenate([top, rng.standard_normal(block + 3)])
    cancel = np.concatenate([rng.standard_normal(3000), -rng.standard_normal(3000)[::-1]])
    cancel = np.concatenate([cancel, -cancel, [2.0 ** -1074]])
    subnormal = rng.integers(-(1 << 52), 1 << 52, 4000) * 2.0 ** -1074
    zeros = np.array([0.0, -0.0, -0.0])
    return {"spans": spans, "jumps": jumps, "top": top, "mixed": mixed, "cancel": cancel,
            "subnormal": subnormal, "zeros": zeros, "one": np.array([-7.25]),
            "empty": np.array([])}


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("case", list(_hard_vectors()))
def test_exact_totals_are_exact(form, case):
    """Each form's local total is the exact sum (so the two forms, and any split, agree)."""
    values = _hard_vectors()[case]
    found = _form(form)(values, None)
    assert found.total == _exact_units(values)
    not_negative_zero = bool(np.any((values != 0) | ~np.signbit(values)))
    assert found.flags() == [0, 0, 0, int(not_negative_zero), int(values.size > 0)]
    halves = values.size // 2  # products: each rounded once in float64, then summed exactly
    x, y = values[:halves], values[halves:2 * halves][::-1].copy()
    with np.errstate(over="ignore", under="ignore"):
        products = x * y
    if np.all(np.isfinite(products)):
        assert _form(form)(x, y).total == _exact_units(products)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_exact_totals_of_float32_and_strided_input(form, dtype):
    rng = np.random.default_rng(4)
    z = (rng.standard_normal(3 * _exact.BLOCK + 5) + 1j * rng.standard_normal(3 * _exact.BLOCK + 5))
    z = z.astype(np.complex64 if dtype == np.float32 else np.complex128)
    real, imag = z.real, z.imag  # strided views
    assert _form(form)(real, None).total == _exact_units(real.astype(np.float64))
    assert _form(form)(real, imag).total == _exact_units(
        real.astype(np.float64) * imag.astype(np.float64))


@pytest.mark.parametrize("form", FORMS)
def test_exact_totals_flag_the_special_values(form):
    rng = np.random.default_rng(5)
    base = rng.standard_normal(2 * _exact.BLOCK)
    for where, value, want in ((7, np.nan, [1, 0, 0]), (_exact.BLOCK + 1, np.inf, [0, 1, 0]),
                               (3, -np.inf, [0, 0, 1])):
        values = base.copy()
        values[where] = value
        assert _form(form)(values, None).flags()[:3] == want
    both = base.copy()
    both[[2, _exact.BLOCK + 9]] = [np.inf, -np.inf]
    assert _form(form)(both, None).flags()[:3] == [0, 1, 1]
    total = _exact.Total()
    total.add(_form(form)(np.array([np.inf]), None), -1)  # a negated term: -inf
    assert total.flags()[:3] == [0, 0, 1]
    zeros = _exact.Total()
    zeros.add(_form(form)(np.array([0.0, 0.0]), None), -1)  # -(+0): every contribution -0
    assert zeros.flags()[3:] == [0, 1]


def test_a_failing_compiled_form_falls_back_to_numpy_with_a_warning(monkeypatch):
    """An error on one rank would leave the others waiting in the exchange: the NumPy form
    answers instead (the same exact sum) and the compiled one is not tried again."""
    def broken(left, right):
        raise RuntimeError("no LLVM target for this CPU")

    monkeypatch.setattr(_exact, "_KERNEL", [broken])
    monkeypatch.setattr(_exact, "_COMPILED", list(_exact._COMPILED))  # restored after
    values = np.array([1.0, 2.0 ** -60, -3.0, 2.0 ** 70])
    with pytest.warns(RuntimeWarning, match="compiled exact sums failed.*NumPy form"):
        got = mar.sum(values, comm=MPI.COMM_SELF)
    assert float(got) == float(sum(Fraction(float(v)) for v in values))
    assert _exact._KERNEL == [None] and _exact.compiled() is None
