"""Gradient compression: 16-bit floats on the wire, and top-k sparsification with error feedback.

**16-bit casts** (:data:`FP16`, :data:`BF16`). The payload is 16-bit words (``uint16``: MPI has no
half-precision datatype, and NumPy has no bfloat16, so both travel as their bit patterns), and
the reduction is an MPI user op (``MPI.Op.Create``) that decodes both operands to float32, adds,
and encodes the sum. Every algorithm here combines through the op it is given (``Reduce_local``
in the schedules, MPI's own reduction for ``native``), so the cast composes with all of them, and
every combine accumulates in float32; only the partial sums that travel are rounded to 16 bits.
bfloat16 is encoded from the float32 bit pattern with round-to-nearest-even (NaN stays NaN), in
three NumPy operations; ``ml_dtypes`` would do the same and is not needed.

*Error bound.* Any allreduce combines p contributions along some reduction tree (p - 1 combines
per element, whatever the algorithm). With unit roundoff u (2^-11 for float16, 2^-8 for bfloat16)
and subnormal spacing eta (2^-25 for float16, 2^-134 for bfloat16), each encode and each combine
adds at most u·|partial sum| + eta, and a partial sum is at most Σ|x_r| in magnitude, so to first
order in u::

    |SUM result - Σ_r x_r|     <=  p · (u · Σ_r |x_r| + eta)
    |AVG result - mean_r x_r|  <=  u · Σ_r |x_r| + p · eta

For AVG the contributions are divided by p (in float32) before encoding, as DDP's fp16 hook
does, so that the sum cannot overflow float16's 65504 and the tree adds means. The bound counts
the encoding of each contribution as a rounding of a partial sum; every combine rounds once.
:func:`cast_error_bound` returns it times (1 + u)^p, which covers the second-order terms.
float16 overflows to inf past 65504 (bfloat16 has float32's range).

**Top-k with error feedback** (:class:`TopK`). Each rank adds its residual to its gradient,
sends the k = ceil(ratio · n) entries of largest magnitude (values and int64 indices, two
``allgather`` calls) and keeps the rest as the next residual. Every rank sums the gathered
entries in rank order, so the result is bit-identical everywhere. Bound: the result differs from
the exact sum of the accumulated gradients (gradient + residual) by the sum of what stayed
behind, elementwise at most Σ_r t_r where t_r is rank r's k-th largest magnitude; and nothing is
lost: the applied sums plus the residuals equal the exact sums of the gradients.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
from mpi4py import MPI

from . import api, collectives
from .ops import AVG


@dataclass
class Cast:
    """A 16-bit float format on the wire: encode to / decode from ``uint16`` words."""

    name: str
    unit_roundoff: float
    subnormal: float  # half the smallest subnormal: the absolute rounding error near zero
    encode: object  # (float array, uint16 out) -> None
    decode: object  # (uint16 array, float32 out) -> None
    _op: MPI.Op | None = field(default=None, repr=False)

    @property
    def op(self) -> MPI.Op:
        """The commutative MPI user op: decode both operands, add in float32, encode."""
        if self._op is None:
            decode, encode = self.decode, self.encode

            def add(inbuf, inoutbuf, datatype):
                received = np.frombuffer(inbuf, dtype=np.uint16)
                local = np.frombuffer(inoutbuf, dtype=np.uint16)
                total = np.empty(local.size, dtype=np.float32)
                decode(local, total)
                total += decoded(decode, received)
                encode(total, local)

            self._op = MPI.Op.Create(add, commute=True)
        return self._op


def decoded(decode, words: np.ndarray) -> np.ndarray:
    out = np.empty(words.size, dtype=np.float32)
    decode(words, out)
    return out


def _fp16_encode(values: np.ndarray, words: np.ndarray) -> None:
    np.copyto(words.view(np.float16), values, casting="unsafe")


def _fp16_decode(words: np.ndarray, out: np.ndarray) -> None:
    np.copyto(out, words.view(np.float16))


def _bf16_encode(values: np.ndarray, words: np.ndarray) -> None:
    bits = np.asarray(values, dtype=np.float32).view(np.uint32)
    # round to nearest, ties to even: add 0x7FFF plus the lowest kept bit, then truncate
    rounded = bits + (np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))
    np.right_shift(rounded, np.uint32(16), out=rounded)
    np.copyto(words, rounded, casting="unsafe")
    words[np.isnan(values)] = 0x7FC0  # the carry above could turn a NaN into inf


def _bf16_decode(words: np.ndarray, out: np.ndarray) -> None:
    bits = out.view(np.uint32)
    np.copyto(bits, words)
    np.left_shift(bits, np.uint32(16), out=bits)


FP16 = Cast("fp16", 2.0 ** -11, 2.0 ** -25, _fp16_encode, _fp16_decode)
BF16 = Cast("bf16", 2.0 ** -8, 2.0 ** -134, _bf16_encode, _bf16_decode)
CASTS = {"fp16": FP16, "bf16": BF16}


def cast(wire) -> Cast:
    """Return the Cast named ``wire`` ("fp16" or "bf16"), or ``wire`` itself if it is one."""
    if isinstance(wire, Cast):
        return wire
    if wire not in CASTS:
        raise ValueError(f"unknown wire format {wire!r}; choose one of {', '.join(CASTS)}")
    return CASTS[wire]


def check_float(array: np.ndarray, what: str) -> None:
    if array.dtype not in (np.float32, np.float64):
        raise TypeError(f"{what} has dtype {array.dtype}; compression needs float32 or float64")


def cast_error_bound(wire, magnitudes: np.ndarray, nranks: int, average: bool) -> np.ndarray:
    """Elementwise bound on |result - exact| given ``magnitudes`` = Σ_r |x_r| (module docstring)."""
    codec = cast(wire)
    scale = 1.0 if average else float(nranks)
    u = codec.unit_roundoff
    return (1 + u) ** nranks * (scale * u * magnitudes + nranks * codec.subnormal)


def encode_for_sum(codec: Cast, values: np.ndarray, words: np.ndarray, nranks: int,
                   average: bool) -> None:
    """Encode ``values`` (divided by p first for AVG, so the sum stays in range)."""
    if average and nranks > 1:
        codec.encode(np.divide(values, nranks, dtype=np.float32), words)
    else:
        codec.encode(values, words)


def cast_allreduce(sendbuf, recvbuf=None, wire="fp16", op=MPI.SUM, comm=None, algorithm="auto",
                   **kwargs):
    """Allreduce float32/float64 ``sendbuf`` with 16-bit values on the wire, float32 combines.

    Args:
        sendbuf: float32 or float64 array (C-contiguous).
        recvbuf: result of the same shape and dtype; ``None`` allocates one.
        wire: ``"fp16"`` or ``"bf16"``.
        op: ``MPI.SUM`` or ``mpiallreduce.AVG``.
        comm, algorithm, kwargs: as for :func:`mpiallreduce.allreduce` (any algorithm).

    Returns:
        The result, within :func:`cast_error_bound` of the exact sum or mean.
    """
    codec = cast(wire)
    values = np.ascontiguousarray(sendbuf)
    check_float(values, "sendbuf")
    if op is not MPI.SUM and op is not AVG:
        raise ValueError("cast_allreduce sums: op must be MPI.SUM or mpiallreduce.AVG")
    comm = MPI.COMM_WORLD if comm is None else comm
    out = np.empty_like(values) if recvbuf is None else recvbuf
    words = np.empty(values.size, dtype=np.uint16)
    encode_for_sum(codec, values.reshape(-1), words, comm.Get_size(), op is AVG)
    api.allreduce(MPI.IN_PLACE, words, op=codec.op, comm=comm, algorithm=algorithm, **kwargs)
    np.copyto(out.reshape(-1), decoded(codec.decode, words), casting="same_kind")
    return out


class TopK:
    """Top-k sparsification with error feedback, one residual per array (module docstring).

    Args:
        ratio: fraction of each array's entries sent per step (k = ceil(ratio · n), at least 1).
    """

    def __init__(self, ratio: float = 0.01):
        if not 0 < ratio <= 1:
            raise ValueError(f"top-k ratio must be in (0, 1], got {ratio!r}")
        self.ratio = ratio
        self.residuals: dict = {}

    def k(self, size: int) -> int:
        return min(size, max(1, math.ceil(self.ratio * size)))

    def select(self, key, gradient: np.ndarray, values: np.ndarray, indices: np.ndarray,
               offset: int = 0) -> float:
        """Add the residual of ``key`` to ``gradient``; write its top-k into ``values``/``indices``.

        ``indices`` get ``offset`` added (positions in a bucket). Returns the threshold (the k-th
        largest magnitude) that bounds every entry left in the residual.
        """
        flat = gradient.reshape(-1)
        residual = self.residuals.get(key)
        if residual is None:
            residual = self.residuals[key] = np.zeros(flat.size, dtype=flat.dtype)
        residual += flat  # the residual now holds gradient + old residual
        k = values.size
        chosen = np.argpartition(np.abs(residual), flat.size - k)[flat.size - k:]
        chosen.sort()  # a deterministic order, whatever argpartition returns
        np.take(residual, chosen, out=values)
        threshold = float(np.min(np.abs(values))) if k else 0.0
        residual[chosen] = 0
        np.add(chosen, offset, out=indices)
        return threshold


def sparse_sum(values: np.ndarray, indices: np.ndarray, out: np.ndarray, comm=None,
               algorithm="auto") -> np.ndarray:
    """Sum every rank's (index, value) pairs into the dense ``out`` (zeroed first).

    Each rank passes the same number of pairs; two ``allgather`` calls collect them and every
    rank adds them in rank order, so ``out`` is bit-identical on every rank.
    """
    comm = MPI.COMM_WORLD if comm is None else comm
    nranks = comm.Get_size()
    all_values = np.empty(values.size * nranks, dtype=values.dtype)
    all_indices = np.empty(indices.size * nranks, dtype=indices.dtype)
    gather = algorithm if algorithm in ("ring", "recursive_doubling", "native") else "auto"
    collectives.allgather(values, all_values, comm=comm, algorithm=gather)
    collectives.allgather(indices, all_indices, comm=comm, algorithm=gather)
    out[...] = 0
    np.add.at(out.reshape(-1), all_indices, all_values)
    return out
