"""Reproducible sums of whole vectors split over the ranks: :func:`sum`, :func:`dot`, :func:`norm2`.

Each rank's exact local total (:mod:`._exact`) crosses as words of an integer SUM; how, and
why it depends on the global vector only: :mod:`mpiallreduce.reproducible`.
"""

from __future__ import annotations

import math

import numpy as np
from mpi4py import MPI

from .. import _plans
from .._agree import FIELDS, Signature, agree, bad_signature
from .._checks import ALGORITHMS
from .._state import state as comm_state
from ..ops import DTYPES, OP_NAMES
from . import _exact
from .formats import _REAL, FORMATS, MAX_CONTRIBUTIONS, _Format, _round, check

#: bits of each word in which a rank's exact local total crosses to the others (23 bits of
#: carry headroom: MAX_CONTRIBUTIONS ranks' words sum below 2**63).
EXACT_WORD_BITS = 40
#: words per component: 2160 bits, above any exact total of fewer than 2**60 float64 values
#: (``|total| < count * 2**(1024 + 1074)`` in units of 2**-1074).
EXACT_WORDS = 54
#: added to every rank's total so that its words are never negative (taken off times p after).
_BIAS = 1 << (EXACT_WORD_BITS * EXACT_WORDS - 1)
#: per component after its words: NaN, +inf, -inf, a value other than -0, any value at all
#: (each rank's 0 or 1, summed)
_FLAGS = 5
_KINDS = ("sum", "dot", "norm2")


class _Term:
    """One term of a component: ``sign * left`` or ``sign * left * right`` elementwise, each
    product rounded once in float64 (exact for float32 input)."""

    def __init__(self, left: np.ndarray, right: np.ndarray | None = None, sign: int = 1):
        self.left, self.right, self.sign = left, right, sign


def _encode(total: int, out: np.ndarray) -> None:
    """``total + _BIAS`` as EXACT_WORDS words of 40 bits (little-endian bytes, no Python loop)."""
    raw = (total + _BIAS).to_bytes(EXACT_WORDS * 5, "little")
    words = out.view(np.uint8).reshape(EXACT_WORDS, 8)
    words[:, :5] = np.frombuffer(raw, np.uint8).reshape(EXACT_WORDS, 5)
    words[:, 5:] = 0  # (the buffer held the last call's sums)


def _decode(words: np.ndarray, nranks: int) -> int:
    """The sum of ``nranks`` totals from their summed words (each below 2**63): the even and
    the odd words laid out 10 bytes apart do not overlap, so two ``int.from_bytes`` read them."""
    pairs = np.ascontiguousarray(words, "<i8").view(np.uint8).reshape(EXACT_WORDS // 2, 16)
    spread = np.zeros((2, EXACT_WORDS // 2, 10), np.uint8)
    spread[0, :, :8] = pairs[:, :8]
    spread[1, :, :8] = pairs[:, 8:]
    even = int.from_bytes(spread[0].tobytes(), "little")
    odd = int.from_bytes(spread[1].tobytes(), "little")
    return even + (odd << EXACT_WORD_BITS) - nranks * _BIAS


def _exact_totals(what: str, components, dtype, comm, algorithm, error) -> list[tuple]:
    """Agree on the arguments, then sum every rank's exact local totals.

    The argument check every call makes (:func:`._agree.agree`: one constant-size
    ``Allreduce(MAX)``, so a rank whose call differs gets the same error as the others) and one
    integer SUM of each component's 54 words and 5 flags (:mod:`._exact` makes the totals).
    Returns per component (total, unit -1074, nan, +inf, -inf, any value other than -0, any
    value).
    """
    comm = MPI.COMM_WORLD if comm is None else comm
    state = comm_state(comm)
    state.refuse_if_broken(what)
    if error is None and comm.Get_size() > MAX_CONTRIBUTIONS:
        error = ValueError(f"mar.{what} sums at most {MAX_CONTRIBUTIONS} ranks' totals (the "
                           f"words' headroom); this communicator has {comm.Get_size()} ranks")
    cache = state.vectors  # signatures per call kind, buffers per size: reused calls are cheap
    signature = None if error is not None else cache.get((what, np.dtype(dtype), algorithm))
    if signature is None:
        fields = bad_signature()
        if error is None:
            fields = [0] * len(FIELDS)
            fields[2] = DTYPES.index(np.dtype(dtype))
            fields[3] = OP_NAMES.index("SUM")
            fields[4] = ALGORITHMS.index(algorithm)
            fields[6] = _KINDS.index(what) + 1
        signature = Signature(fields)
        if error is None:
            cache[what, np.dtype(dtype), algorithm] = signature
    # after the agreement every rank has the same kind and dtype, so the same components
    agree(state.checker, what, signature, error, ALGORITHMS, state=state)
    width = EXACT_WORDS + _FLAGS
    words = _buffer(cache, "exact", width * len(components))
    for index, terms in enumerate(components):
        component = _exact.Total()
        for term in terms:
            component.add(_exact.term_total(term.left, term.right), term.sign)
        part = words[index * width:(index + 1) * width]
        # with a NaN or an infinity the component is that special value: its total is not needed
        _encode(0 if component.special() else component.total, part[:EXACT_WORDS])
        part[EXACT_WORDS:] = component.flags()
    # the words' integer SUM, a plain allreduce (no check: agreed above) through the call cache
    _plans.cached_call(_plans.ALLREDUCE, _bind_words, MPI.IN_PLACE, words, MPI.SUM, comm, algorithm, None,
                       False, None, {})
    nranks = comm.Get_size()
    results = []
    for index in range(len(components)):
        part = words[index * width:(index + 1) * width]
        flags = [int(count > 0) for count in part[EXACT_WORDS:].tolist()]
        results.append((_decode(part[:EXACT_WORDS], nranks), -1074, *flags))
    return results


def _bind_words(slot, sendbuf, recvbuf, op, comm, algorithm, topology, check, timeout, params):
    """The words' SUM where the call cache does not hold it (:func:`._plans.cached_call`, whose
    arguments these are): bound, run and kept as a plain ``mar.allreduce`` of the same kept
    buffer is (:func:`._plans.bind_one_shot`); the buffer is the same each call, never known by
    its shape."""
    return _plans.bind_one_shot(slot, sendbuf, recvbuf, op, comm, algorithm, topology, check,
                                timeout, params)


def _buffer(cache: dict, name: str, size: int) -> np.ndarray:
    """An int64 buffer of ``size`` kept in the communicator's ``cache`` (the same array each
    call, so its allreduce runs the call cache's plan)."""
    found = cache.get((name, size))
    if found is None:
        found = cache[name, size] = np.zeros(size, np.int64)
    return found


def _value(result: tuple, fmt: _Format) -> float:
    """The float of one component: specials as IEEE addition gives them, else the rounded total."""
    total, unit, nan, positive, negative, nonzero_sign, nonempty = result
    if nan or (positive and negative):
        return math.nan
    if positive or negative:
        return math.inf if positive else -math.inf
    if total == 0:
        return -0.0 if nonempty and not nonzero_sign else 0.0
    return _round(total, unit, fmt)


def _vector(array, name: str) -> tuple[np.ndarray | None, Exception | None]:
    """A 1-D view of a float or complex array, or the error that says why not."""
    try:
        values = np.asarray(array)
        check("SUM", values.dtype)
    except Exception as exc:  # noqa: BLE001 - raised on every rank after the agreement
        return None, (exc if isinstance(exc, ValueError)
                      else TypeError(f"{name}: {exc}"))
    return values.reshape(-1), None


def _parts(values: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """Views of the real and imaginary parts, the latter None for real input."""
    if values.dtype in _REAL:
        return values.real, values.imag
    return values, None


def _result_type(dtype: np.dtype) -> np.dtype:
    return np.dtype(_REAL.get(np.dtype(dtype), dtype))


def sum(local, comm=None, algorithm: str = "auto"):  # noqa: A001 - the public name
    """Sum every element of a vector split over the ranks: the same bits for any split.

    Args:
        local: this rank's part of the global vector (any shape; float32, float64, complex64
            or complex128; the same dtype on every rank, any length, empty allowed).
        comm: the communicator (default ``MPI.COMM_WORLD``).
        algorithm: how the words of each rank's exact total are summed (any gives the same).

    Returns:
        The sum as a NumPy scalar of the dtype: the exact sum correctly rounded, IEEE special
        values as addition gives them (docs/howto/numerics.md, "Reproducible sums").

    Cost: one compiled pass over the data (Numba; about 12 NumPy passes without it, in chunks
    that stay in cache), the argument check and one integer SUM of 472 bytes per component.
    """
    values, error = _vector(local, "local")
    dtype = values.dtype if values is not None else np.dtype(np.float64)
    components = []
    if values is not None:
        real, imag = _parts(values)
        components = [[_Term(real)]] + ([] if imag is None else [[_Term(imag)]])
    return _finish("sum", components, dtype, comm, algorithm, error)


def dot(x, y, comm=None, algorithm: str = "auto"):
    """``np.dot`` of two vectors split over the ranks alike: the same bits for any split.

    Each product is rounded once in float64 (exact for float32 and complex64 input), so it
    does not depend on the split; their sum is exact until the one final rounding (as
    :func:`sum`). Complex vectors are multiplied without conjugation, as ``np.dot``.
    """
    vx, error = _vector(x, "x")
    vy, error_y = _vector(y, "y")
    error = error or error_y
    if error is None and vx.dtype != vy.dtype:
        error = TypeError(f"x has dtype {vx.dtype} but y has {vy.dtype}; they must match")
    if error is None and vx.shape != vy.shape:
        error = ValueError(f"x has {vx.size} local elements but y has {vy.size}; split both "
                           f"vectors alike")
    dtype = vx.dtype if error is None else np.dtype(np.float64)
    components = []
    if error is None:
        xr, xi = _parts(vx)
        yr, yi = _parts(vy)
        if xi is None:
            components = [[_Term(xr, yr)]]
        else:
            components = [[_Term(xr, yr), _Term(xi, yi, -1)], [_Term(xr, yi), _Term(xi, yr)]]
    return _finish("dot", components, dtype, comm, algorithm, error)


def norm2(x, comm=None, algorithm: str = "auto"):
    """The Euclidean norm of a vector split over the ranks: the same bits for any split.

    ``sqrt`` of the sum of squares (each rounded once in float64, as :func:`dot`), the sum
    rounded to float64 first; a real NumPy scalar of the input's precision.
    """
    vx, error = _vector(x, "x")
    dtype = vx.dtype if error is None else np.dtype(np.float64)
    components = []
    if error is None:
        real, imag = _parts(vx)
        components = [[_Term(real, real)] + ([] if imag is None else [_Term(imag, imag)])]
    return _finish("norm2", components, dtype, comm, algorithm, error)


def _finish(what, components, dtype, comm, algorithm, error):
    if error is None and algorithm not in ALGORITHMS:
        error = ValueError(f"unknown algorithm {algorithm!r}; choose one of "
                           f"{', '.join(ALGORITHMS)}")
    results = _exact_totals(what, components, dtype, comm, algorithm, error)
    real = _result_type(dtype)
    if what == "norm2":
        return real.type(math.sqrt(_value(results[0], FORMATS[np.dtype(np.float64)])))
    fmt = FORMATS[real]
    values = [_value(result, fmt) for result in results]
    if len(values) == 1:
        return real.type(values[0])
    return np.dtype(dtype).type(complex(values[0], values[1]))
