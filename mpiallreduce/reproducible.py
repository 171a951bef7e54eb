"""Reproducible sums: the same bits whatever the algorithm, the rank order or the number of ranks.

A floating-point sum depends on the order of its additions; a sum of integers does not. Every
value is turned into an exact fixed-point integer in units of ``2**u``, the integers are summed
(any algorithm, native included, gives the same words), and the total is rounded back to the
float type once, identically on every rank.

**Elementwise** (``allreduce(..., reproducible=True)``, :class:`ReproduciblePlan`): the unit is
chosen per element from the largest exponent among its contributions, agreed with one
``Allreduce(MAX)`` of 2 bytes per element (each value's key: its biased exponent, with the sign
in the lowest bit). A float64 element is held in 2 words with units ``2**(e_max - 42)`` and
``2**(e_max - 84)`` (:func:`word_bits` ``= 42`` bits each below the top of the largest
contribution's binade), a float32 one in 1 word (42 bits). A word is a float64 multiple of its
unit below ``2**(e_max + 1)``: a sum of ``p`` of them stays within 53 bits of the unit (the
width shrinks past 1023 ranks; at most :data:`MAX_CONTRIBUTIONS` ranks, a larger communicator is
refused: never a silent wrap), so every partial sum is exact and MPI's float SUM and the
schedules' ``np.add`` give the same words in any order. The words are made with rounding
constants (``hi = (x + M) - M`` with ``M = 1.5 * 2**(e_max - 42 + 52)``, then the same on
``x - hi``, both exact) and the result is ``HI + LO``: one rounding, no scaling back. Why two
words and not three: the words are what the algorithm moves, so their bytes are the cost at
large sizes (2x the data with 2 words, 3x with 3; docs/usage.md, "Reproducible sums"). Why not
binned floating-point accumulators (ReproBLAS): merging bins of different exponents needs a
user-defined combine, a Python callback in every step of every algorithm (and not MPI's
optimised SUM), or a fixed grid of bins over the whole exponent range, ~25 words per value.
Where the words' sum runs on the shared-memory transport, the keys and words live in
node-shared memory (:func:`_node_scratch`), so it reduces them in place, with no copy in or
out. One or two ranks need none of this (:data:`PAIR_RANKS`: two contributions are added once,
in either order alike), and one float64 value on at most :data:`GATHER_RANKS` ranks is summed
exactly from the gathered values.

**Whole vectors** (:func:`sum`, :func:`dot`, :func:`norm2`): each rank reduces its part to its
*exact* sum, an integer number of ``2**-1074`` (:mod:`._exact`: compiled with Numba where the
``fast`` extra is installed, else NumPy; both exact, so ranks may differ in which they run),
and the ranks sum those integers as 54 words of 40 bits, with 5 flags for the special values,
in one integer SUM after the argument check. The result is the exact sum of the global
vector's values (for ``dot``/``norm2``: of its products, each rounded once in float64) rounded
once: it depends on the global vector only, never on its split over ranks.

Accuracy, elementwise (``2**(e_max-1) <= largest magnitude < 2**e_max``, ``u = e_max - 84``, or
``e_max - 42`` for float32): a contribution that is a multiple of ``2**u`` (every one of
magnitude at least ``2**(e_max-32)``; float32 ``2**(e_max-19)``) is converted exactly, and if
all are, the result is the correctly rounded sum (``math.fsum``). Otherwise each contribution is
rounded to nearest to a multiple of ``2**u``: the error is at most ``count * 2**(u-1)`` plus
half an ulp of the result. At one or two ranks, and for one float64 value on at most
GATHER_RANKS ranks, the result is the correctly rounded sum always; whole vectors always.
Special values follow IEEE addition: a NaN anywhere gives NaN, +inf
with -inf gives NaN, infinities of one sign give that infinity, a true sum beyond the largest
float gives an infinity of its sign, and -0 only when every contribution is -0. NaN results are
the default quiet NaN (payloads are not kept).
"""

from __future__ import annotations

import math
import struct
import sys
import time
import weakref
from dataclasses import replace
from functools import partial

import numpy as np
from mpi4py import MPI

from . import _exact, _plans, shm
from ._agree import FIELDS, Signature, agree, bad_signature, prepare
from ._checks import ALGORITHMS, allreduce_call
from ._state import state as comm_state
from .executor import _PlanBase, flat
from .ops import DTYPES, OP_NAMES, exact_sum, reducer

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
    from .ops import AVG

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


#: most ranks for which a one-value float64 run gathers the values themselves (one exchange of
#: ``8 * p`` bytes, then an exact sum of ``p`` values on every rank: :func:`.ops.exact_sum`)
#: rather than agreeing on their largest exponent first (two exchanges of 2 and 16 bytes). Measured
#: at 2 ranks only (one exchange fewer, and the check over shared memory carries the values:
#: none of its own); 64 keeps the exact sum (about 30 ns a value) well below an exchange.
GATHER_RANKS = 64


#: most float elements for which a run looks its scales up in tables (one NumPy call) rather
#: than computing them from the keys (two or three): NumPy's cost per call dominates small runs.
SMALL = 256
#: float elements a larger run converts per block, so that a block's arrays (about 32 bytes per
#: element: 1 MiB) stay in the core's L2 cache (2 MiB here). Measured on 1M float64 elements,
#: one process: conversion to words 3.5 ms in one pass per operation, 2.3-2.5 ms in blocks of
#: 32K or 64K, 2.5-2.9 in blocks of 16K, 3.7 in blocks of 4K (NumPy's cost per call).
BLOCK = 1 << 15
_TABLES: dict = {}


def _magic_table(fmt: _Format, bits: int) -> np.ndarray:
    """The top word's rounding constant ``M = 1.5 * 2**(e_max - bits + 52)`` (float64) for
    every key (``e_max = b - bias``); inf where it overflows (those keys take another way)."""
    found = _TABLES.get((fmt.dtype, bits))
    if found is None:
        biased = np.arange(1 << 16) >> fmt.key_shift
        with np.errstate(over="ignore"):
            found = np.ldexp(1.5, biased - fmt.bias - bits + 52)
        _TABLES[fmt.dtype, bits] = found
    return found


#: most ranks for which an elementwise sum is the requested algorithm's own SUM, unconverted
#: (see ``ReproduciblePlan._init_pair``): two contributions are added once, in either order
#: with the same bits. Only a measurement of the conversion at 2 ranks sets it lower
#: (``scripts/reproducible_cost.py --convert``).
PAIR_RANKS = 2

#: the power of two by which the values of float64 elements near the top of the range are scaled
#: down before the conversion (and the results up after it), so that the constants and the
#: words' sum cannot overflow
OVERFLOW_SCALE = 128

#: node -> the node-shared scratch of reproducible plans (see _node_scratch)
_SCRATCH: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _node_scratch(state, nbytes: int, deadline: float | None, what: str) -> shm.SharedArray:
    """Node-shared memory of at least ``nbytes`` for the keys and words of reproducible plans.

    The shared-memory transport reduces arrays in it in place, straight from the peers' (no copy
    in or out: the words' sum then costs less than the plain call's). One block per node, shared
    by every reproducible plan on the communicator (runs are one at a time, in the caller's
    thread), grown to the next power of two when a plan needs more (collective: as the
    transport's own window, the need only grows at a call where every rank builds its plan,
    since a rank holding a plan of that size made the call that grew it), and freed with the
    communicator; plans bound to an outgrown block keep it.
    """
    node = shm.node_of(state, deadline, what)
    found = _SCRATCH.get(node)
    if found is None or found.nbytes < nbytes:
        node.meet(deadline, what)
        block = node.scratch_block(1 << max(nbytes - 1, 1).bit_length())
        found = np.frombuffer(block.segments[node.rank], dtype=np.uint8).view(shm.SharedArray)
        found._block = block
        _SCRATCH[node] = found
    return found


class ReproduciblePlan(_PlanBase):
    """An elementwise SUM/AVG whose result bits do not depend on the algorithm or rank order.

    A run: each value's key (its biased exponent b, then its leading fraction bits, then "not
    negative"), an ``Allreduce(MAX)`` of the keys in place, each value cut into words with its
    element's rounding constant ``M`` (float64 ``hi = (x + M) - M``, ``lo = ((x - hi) + m) - m``
    with ``m = M * 2**-bits``: each rounded to nearest, exact), the words summed by ``inner``
    (the plan of the requested algorithm, a float64 SUM of multiples of one unit that stays
    exact), then ``HI + LO`` (the one rounding). Every step is a flat program of NumPy calls
    bound here, in blocks of :data:`BLOCK` elements (``M``'s top 16 bits written from the keys);
    a run allocates only for elements that need care, seen in the keys' maximum and minimum: an
    inf or NaN contribution, float64 keys near the top of the range (scaled by
    ``2**-OVERFLOW_SCALE`` first), and keys of 0 (every contribution -0 or a negative
    subnormal: the result is -0 if it is 0).
    """

    #: its run checks the call's arguments itself (a one-value plan on shm, see
    #: :meth:`_init_gathered`), so ``check=True`` needs no separate agreement
    fused = False

    def __init__(self, call, state, *, explicit: bool, timeout: float | None,
                 deadline: float | None, what: str):
        private = state.private
        nranks = private.Get_size()
        if nranks > MAX_CONTRIBUTIONS:
            raise ValueError(f"reproducible=True sums at most {MAX_CONTRIBUTIONS} contributions "
                             f"per element (the words' headroom); this communicator has "
                             f"{nranks} ranks")
        values = _float_view(call.recv if call.send is None else call.send)
        fmt = FORMATS[values.dtype]
        size = values.size
        self.algorithm = call.algorithm
        self._fmt = fmt
        self._word_bits = bits = word_bits(nranks)
        self._values = values
        self._out = out = _float_view(call.recv)
        self._top = values.view(np.uint16)[fmt.top::values.itemsize // 2]
        # M = 1.5 * 2**(e_max - bits + 52) rounds a value below 2**e_max to the top word's unit
        # 2**(e_max - bits) in (x + M) - M; as a float64 its biased exponent is b + magic
        self._magic = 1075 - fmt.bias - bits
        # keys whose b is above: M overflows, or the top words' sum may (|sum| <= p * 2**e_max)
        self._overflow_key = (min(2046 - self._magic, 2045 - nranks.bit_length())
                              if fmt.words == 2 else fmt.all_ones - 1)
        words_call = replace(call, send=None, recv=np.empty(0), reducer=reducer(MPI.SUM,
                                                                                np.float64))
        self._gathered = self._pair = None
        if size == 1 and fmt.words == 2 and nranks <= GATHER_RANKS:
            self._init_gathered(call, words_call, state, explicit, timeout, deadline, what)
            return
        if nranks <= PAIR_RANKS:
            self._init_pair(call, state, explicit, timeout, deadline, what)
            return
        words_bytes = fmt.words * size * 8
        # in node-shared memory where shm sums them: no copy in or out, so at any size
        pooled = (nranks > 1 and words_bytes > shm.small_bytes(nranks)
                  and _plans.resolve(replace(words_call, recv=np.empty(fmt.words * size)),
                                     nranks, state, deadline, what, shared=True) == "shm")
        if pooled:  # keys, then words, in the node's shared scratch
            keys_bytes = -(-2 * size // 64) * 64
            scratch = _node_scratch(state, keys_bytes + words_bytes, deadline, what)
            self._keys = scratch[:2 * size].view(np.uint16)
            self._words = scratch[keys_bytes:keys_bytes + words_bytes].view(
                np.float64).reshape(fmt.words, size)
        else:
            self._keys = np.empty(size, np.uint16)
            self._words = np.empty((fmt.words, size), np.float64)
        # per block (in cache): M, the low word's M, the keys' sign bits and M's top 16 bits
        block = min(size, max(BLOCK, SMALL))
        self._block = (np.zeros(block), np.empty(block), np.empty(block, np.uint16))
        self._own = () if pooled else (self._keys, self._words)
        keys_call = replace(call, send=None, recv=self._keys, algorithm="auto", params={},
                            reducer=reducer(MPI.MAX, np.uint16))
        self._keys_plan = _plans.build(keys_call, state, explicit=explicit, persistent=True,
                                       timeout=None, deadline=deadline, what=what)
        self._inner = _plans.build(replace(words_call, recv=self._words.reshape(-1)), state,
                                   explicit=explicit, persistent=True, timeout=None,
                                   deadline=deadline, what=what, shared=pooled)
        super().__init__(private, call.send, call.recv, call.reducer, timeout=timeout, state=state)
        self._bind(out)

    def _init_gathered(self, call, words_call, state, explicit: bool, timeout: float | None,
                       deadline: float | None, what: str) -> None:
        """One float64 value on at most :data:`GATHER_RANKS` ranks: the ranks' values themselves
        are gathered (a SUM of ``p`` float64 where rank ``r`` sends its value at ``r`` and -0
        everywhere else: exact in any order, so any algorithm gives every rank every value) and
        each rank adds them up exactly with :func:`.ops.exact_sum`. One exchange instead of two
        (the keys' maximum, then the words), and the result is the correctly rounded sum
        always."""
        nranks, rank = state.private.Get_size(), state.private.Get_rank()
        self._keys_plan = None
        self._words = np.full(nranks, -0.0)
        self._own = (self._words,)
        self._block = ()
        self.fused = nranks > 1 and _plans.resolve(call, nranks, state, deadline, what) == "shm"
        if self.fused:  # shm: the run reads the peers' values where they wrote them, and checks
            # the arguments itself (its signature, reproducible marked, folds the check's in)
            self._inner = _plans.build_shm(call, state, explicit=explicit, timeout=timeout,
                                           deadline=deadline, what=what, exact=True,
                                           signature=_Agreed(call).signature)
        else:
            self._inner = _plans.build(replace(words_call, recv=self._words), state,
                                       explicit=explicit, persistent=True, timeout=None,
                                       deadline=deadline, what=what)
        super().__init__(state.private, call.send, call.recv, call.reducer, timeout=timeout,
                         state=state)
        self._gathered = (memoryview(self._values), memoryview(self._words), rank,
                          memoryview(np.full(nranks, -0.0)), memoryview(self._out),
                          float(nranks) if self._average else None,
                          memoryview(self._values.view(np.int64)),
                          struct.Struct(f"={nranks}q").pack, struct.Struct(f"={nranks}d").unpack)

    def _init_pair(self, call, state, explicit: bool, timeout: float | None,
                   deadline: float | None, what: str) -> None:
        """One or two ranks: IEEE addition is commutative and every algorithm adds each element
        of two contributions once (``a + b`` or ``b + a``: the same bits), so the requested
        algorithm's own SUM is reproducible as it is, and correctly rounded: no conversion.
        A run then makes NaN results the default quiet NaN (which payload ``NaN + NaN`` keeps
        depends on the order) and divides for AVG after the sum."""
        self._keys_plan = None
        self._block = self._own = ()
        self._inner = _plans.build(replace(call, reducer=reducer(MPI.SUM, call.recv.dtype)),
                                   state, explicit=explicit, persistent=True, timeout=None,
                                   deadline=deadline, what=what)
        super().__init__(state.private, call.send, call.recv, call.reducer, timeout=timeout,
                         state=state)
        self._pair = (np.array(float(self._nranks)) if self._average and self._nranks > 1
                      else None,)

    def _run_pair(self, deadline: float | None) -> np.ndarray:
        """The run on one or two ranks (see :meth:`_init_pair`)."""
        with np.errstate(over="ignore", invalid="ignore"):  # as IEEE addition: inf, NaN
            self._inner.run(_left(deadline))
            total = np.add.reduce(self._out)  # NaN if any element is: one pass finds them
        out = self._out
        if total != total:
            out[np.isnan(out)] = np.nan
        divisor = self._pair[0]
        if divisor is not None:
            np.divide(out, divisor, out)
        return self.recvbuf

    def _run_gathered(self, deadline: float | None) -> np.ndarray:
        """The run of a one-value plan that gathers (see :meth:`_init_gathered`)."""
        if self.fused:
            self._inner.run(_left(deadline))
            return self.recvbuf
        values, words, rank, minus_zeros, out, divisor = self._gathered[:6]
        words[rank] = values[0]  # before an in-place result overwrites it
        self._inner.run(_left(deadline))
        total = exact_sum(words.tolist())
        words[:] = minus_zeros  # -0 everywhere for the next run
        out[0] = total if divisor is None else total / divisor
        return self.recvbuf

    @property
    def carries(self) -> bool:
        """Does a check over shared memory carry what this plan's run needs (one float64)?"""
        return self._gathered is not None and not self.fused

    def carry_word(self) -> int:
        """What the argument check carries for this plan over shared memory: the value's bits
        (as int64) where the plan gathers, else 0."""
        return self._gathered[6][0] if self._gathered is not None else 0

    def run_carried(self, words: list[int], timeout: float | None) -> np.ndarray:
        """Run a gathering one-value plan whose check over shared memory carried every rank's
        value (``Signature.carried``, :meth:`carry_word`): no exchange of its own."""
        self._start(timeout)
        gathered = self._gathered
        total = exact_sum(gathered[8](gathered[7](*words)))
        divisor = gathered[5]
        gathered[4][0] = total if divisor is None else total / divisor
        return self.recvbuf

    def _bind(self, out: np.ndarray) -> None:
        """The run's NumPy calls, bound once: the keys, the words and back from the words.
        Arguments are positional and constants 0-d arrays: NumPy's cost per call is what small
        runs pay. Large runs go block by block (a block's arrays stay in cache)."""
        fmt, keys, words, values = self._fmt, self._keys, self._words, self._values
        self._back = self._back_calls(out)
        compiled = _exact.compiled()
        if compiled is not None:  # the same operations, one compiled pass each (Numba)
            two = fmt.words == 2
            self._small = values.size <= SMALL
            self._key_calls = (partial(compiled.keys, self._top, keys),)
            self._to_words = (partial(
                compiled.words, values, keys, words[0], words[1] if two else words[0],
                fmt.key_shift - 4, (self._magic << 4) | 8, 2.0 ** -self._word_bits, two),)
            return
        size = values.size
        small = size <= SMALL
        u16 = np.uint16
        one, fifteen = np.array(1, u16), np.array(15, u16)
        m1, m2, signs = self._block
        m1_top = m1.view(u16)[_TOP64::4]  # M's top 16 bits (the rest stay 0)
        # M's top 16 bits from a key: the biased exponent b + magic, then the fraction's 1 (1.5)
        to_top = (np.array(fmt.key_shift - 4, u16), np.array(0xFFF0, u16),
                  np.array((self._magic << 4) | 8, u16))
        down = np.array(2.0 ** -self._word_bits)  # the low word's M: M * 2**-bits
        key_calls, to_words = [], []
        if small:  # M of every key from a table: one call
            to_words.append(partial(_magic_table(fmt, self._word_bits).take, keys, 0,
                                    m1[:size], "clip"))
        for start in [0] if small else range(0, size, BLOCK):
            stop = size if small else min(start + BLOCK, size)
            key, top, x = keys[start:stop], self._top[start:stop], values[start:stop]
            sign, a, b = signs[:stop - start], m1[:stop - start], m2[:stop - start]
            # key = (top << 1) | (~top >> 15): the strided top bits read once (large runs)
            source = top if small else key
            key_calls += ([] if small else [partial(np.copyto, key, top)]) + [
                partial(np.invert, source, sign), partial(np.right_shift, sign, fifteen, sign),
                partial(np.left_shift, source, one, key), partial(np.bitwise_or, key, sign, key)]
            if not small:  # M per block: its top 16 bits from the key, a strided write
                to_words += [partial(np.right_shift, key, to_top[0], sign),
                             partial(np.bitwise_and, sign, to_top[1], sign),
                             partial(np.add, sign, to_top[2], sign),
                             partial(np.copyto, m1_top[:stop - start], sign)]
            hi = words[0][start:stop]
            to_words += [partial(np.add, x, a, hi),  # x + M: rounded to the top word's unit
                         partial(np.subtract, hi, a, hi)]  # hi, exact
            if fmt.words == 2:
                lo = words[1][start:stop]
                to_words += [partial(np.subtract, x, hi, lo),  # x - hi, exact
                             partial(np.multiply, a, down, b),
                             partial(np.add, lo, b, lo),  # rounded to the low word's unit
                             partial(np.subtract, lo, b, lo)]
        self._small = small
        self._key_calls, self._to_words = tuple(key_calls), tuple(to_words)

    def _back_calls(self, out: np.ndarray) -> list:
        """From the summed words to the result: one rounding (and AVG's division)."""
        words = self._words
        if self._fmt.words == 2:
            back = [partial(np.add, words[0], words[1], out)]  # the one rounding
        else:
            back = [partial(np.copyto, out, words[0], "same_kind")]  # float32: the one rounding
        if self._average:
            back.append(partial(np.divide, out, np.array(float(self._nranks)), out))
        return back

    @property
    def nbytes(self) -> int:
        arrays = (*self._block, *self._own)
        keys = 0 if self._keys_plan is None else self._keys_plan.nbytes
        return self._inner.nbytes + keys + int(
            np.add.reduce([a.nbytes for a in arrays]))

    def run(self, timeout: float | None = None) -> np.ndarray:
        """Sum every rank's values into the result, reproducibly; return the result buffer."""
        timeout, deadline = self._start(timeout)
        if self._gathered is not None:
            return self._run_gathered(deadline)
        if self._pair is not None:
            return self._run_pair(deadline)
        if not self._values.size:
            return self.recvbuf
        for call in self._key_calls:
            call()
        self._keys_plan.run(_left(deadline))
        return self._sum(deadline)

    __call__ = run

    def _sum(self, deadline: float | None) -> np.ndarray:
        """The run after the keys' maxima are in ``_keys``."""
        keys = self._keys
        largest, smallest = int(np.maximum.reduce(keys)), int(np.minimum.reduce(keys))
        shift = self._fmt.key_shift
        if largest >> shift <= self._overflow_key and smallest:
            for call in self._to_words:
                call()
            self._inner.run(_left(deadline))
            for call in self._back[:1]:
                call()
        else:  # an inf or NaN, a sum that may overflow, or every contribution -0 or negative tiny
            with np.errstate(over="ignore", invalid="ignore"):
                for call in self._to_words:
                    call()
                fixed = self._fix_words(largest)
                self._inner.run(_left(deadline))  # inf - inf in a combine: NaN, as IEEE says
                for call in self._back[:1]:
                    call()
            self._fix_results(fixed, smallest)
        for call in self._back[1:]:
            call()
        return self.recvbuf

    def _fix_words(self, largest: int) -> tuple:
        """Words of the elements the plain program does not cover (elementwise: each depends on
        its own key and contributions only): an inf or NaN contribution (the words are the inf
        or NaN itself, else 0: a float64 SUM then gives what IEEE addition gives in any order)
        and float64 keys above ``_overflow_key`` (the same program on the values scaled by
        ``2**-OVERFLOW_SCALE``, exact there). Returns the two sets of indices."""
        fmt, keys, words, values = self._fmt, self._keys, self._words, self._values
        shift = fmt.key_shift
        specials = scaled = None
        if largest >> shift == fmt.all_ones:
            specials = np.flatnonzero(keys >> shift == fmt.all_ones)
            found = values[specials].astype(np.float64)
            found[np.isfinite(found)] = 0.0
            found[np.isnan(found)] = np.nan  # one payload
            words[:, specials] = 0.0
            words[0][specials] = found
        if fmt.words == 2 and largest >> shift > self._overflow_key:
            b = keys >> shift
            scaled = np.flatnonzero((b > self._overflow_key) & (b < fmt.all_ones))
            x = np.ldexp(values[scaled], -OVERFLOW_SCALE)
            m = np.ldexp(1.5, (b[scaled].astype(np.int32) - OVERFLOW_SCALE
                               + self._magic - 1023))
            hi = (x + m) - m
            low = m * 2.0 ** -self._word_bits
            words[0][scaled] = hi
            words[1][scaled] = ((x - hi) + low) - low
        return specials, scaled

    def _fix_results(self, fixed: tuple, smallest: int) -> None:
        """Results of the elements of :meth:`_fix_words`, and -0 where every contribution was
        -0 (key 0: no contribution non-negative, none above the subnormal range's top bits:
        the sum is 0 only if all were -0)."""
        out = self._out
        specials, scaled = fixed
        if scaled is not None and scaled.size:
            with np.errstate(over="ignore"):
                out[scaled] = np.ldexp(self._words[0][scaled] + self._words[1][scaled],
                                       OVERFLOW_SCALE)
        if specials is not None:  # one NaN for every NaN (x86's inf - inf is another)
            found = out[specials]
            found[np.isnan(found)] = np.nan
            out[specials] = found
        if smallest == 0:
            zero = np.flatnonzero(self._keys == 0)
            out[zero[out[zero] == 0]] = -0.0

    def free(self) -> None:
        """Release the inner plans (idempotent)."""
        if not self._freed:
            self._inner.free()
            if self._keys_plan is not None:
                self._keys_plan.free()
        super().free()

    def __repr__(self) -> str:
        return (f"<mpiallreduce.ReproduciblePlan {self.algorithm} count={self._values.size} "
                f"dtype={self._values.dtype} ranks={self._nranks}>")


def _left(deadline: float | None) -> float | None:
    """Seconds left before ``deadline`` (at least a microsecond), or None."""
    if deadline is None:
        return None
    return max(deadline - time.monotonic(), 1e-6)


# -- entry points for api.py ---------------------------------------------------------------------

def _checked_call(sendbuf, recvbuf, op, comm, algorithm, topology, params):
    call = allreduce_call(sendbuf, recvbuf, op, comm, algorithm, topology, params)
    check(call.reducer.name, call.recv.dtype)
    return call


class _Agreed:
    """A checked call whose signature also says ``reproducible`` (ranks must agree on it)."""

    def __init__(self, call):
        self.call = call

    def signature(self, timeout) -> list[int]:
        fields = self.call.signature(timeout)
        fields[6] = (fields[6] ^ 0x52455052) & 0x7FFFFFFF  # the parameters field, marked
        return fields


class _Carry:
    """What a one-shot call's argument check carries over shared memory (as the plan's
    :meth:`ReproduciblePlan.carry_word` would): the bits of a one-value float64 call on at most
    :data:`GATHER_RANKS` ranks (0 for other calls); after the check, every rank's (``words``),
    or None (the check ran as a collective, or did not run)."""

    def __init__(self):
        self.words = None

    @staticmethod
    def word(agreed) -> int:
        call = agreed.call
        if call.recv.size != 1 or call.recv.dtype != np.float64 \
                or call.comm.Get_size() > GATHER_RANKS:
            return 0
        return int(_float_view(call.recv if call.send is None else call.send).view(np.int64)[0])


def _prepare(what, sendbuf, recvbuf, op, comm, algorithm, topology, check_args, timeout, params,
             carry=None):
    agreed = prepare(what, comm, check_args, lambda comm: _Agreed(_checked_call(
        sendbuf, recvbuf, op, comm, algorithm, topology, params)), timeout=timeout, carry=carry,
        checks_itself=_checks_itself if what == "allreduce" else None)
    return agreed.call


def _checks_itself(agreed, state) -> bool:
    """Does this one-shot call's run check its arguments itself (``_plans.checks_itself``)?
    One float64 on 2 to GATHER_RANKS ranks whose run is ``shm`` (see ``_init_gathered``)."""
    call = agreed.call
    return (call.recv.size == 1 and call.recv.dtype == np.float64
            and 1 < state.private.Get_size() <= GATHER_RANKS
            and _plans.checks_itself(call, state))


class _Entry(_plans.BoundCall):
    """A one-shot reproducible plan kept in the communicator's call cache
    (:class:`._plans.BoundCall`), with its call's signature (reproducible marked) packed for the
    agreement check. The check carries a one-value plan's bits where it runs over shared memory
    (``carried``: every rank's, for the run that follows)."""

    __slots__ = ("plan", "carried")

    def __init__(self, plan: ReproduciblePlan, call, state, objects: tuple):
        super().__init__(call, state, objects, _Agreed(call).signature)
        self.plan, self.carried = plan, None
        self.nbytes = plan.nbytes
        self.fused = plan.fused  # the run checks the arguments itself
        self.result = plan.recvbuf
        if plan.fused:
            # the shm run without deadline and without the plan's own checks (the cache drops
            # the entry before its plan is freed or its communicator breaks)
            self.direct, self.args = plan._inner.direct, ()

    def agree(self, timeout) -> None:
        """The agreement of a repeated call, carrying this rank's bits where it runs over
        shared memory (the one constant-size check every call makes, so a rank whose call
        differs gets the same error as the others)."""
        signature = self.signatures[timeout is not None]
        signature.shm[-1] = self.plan.carry_word()
        signature.carried = None
        _plans.BoundCall.agree(self, timeout)
        self.carried = signature.carried

    def run(self, timeout: float | None) -> np.ndarray:
        carried, self.carried = self.carried, None
        plan = self.plan
        if carried is not None and plan.carries:
            return plan.run_carried(carried, timeout)
        return plan.run(timeout)

    def free(self) -> None:
        self.plan.free()


def allreduce(sendbuf, recvbuf, op, comm, algorithm, topology, check_args, timeout, params):
    """``mpiallreduce.allreduce(..., reproducible=True)``: a plan bound once per set of arrays.

    A repeated call with the same arrays (and communicator, op, algorithm, topology and
    parameters) skips the local checks and the binding, as plain calls do: both go through
    :func:`._plans.cached_call`.
    """
    return _plans.cached_call("reproducible", _bind, sendbuf, recvbuf, op, comm, algorithm,
                              topology, check_args, timeout, params)


def _bind(slot, sendbuf, recvbuf, op, comm, algorithm, topology, check_args, timeout, params):
    """A reproducible allreduce the call cache does not hold (:func:`._plans.cached_call`,
    whose arguments these are): checked, bound, run and kept."""
    # a one-value call's value rides in the check, as a cached call's does (_Entry.agree):
    # ranks whose caches differ still run alike
    carry = _Carry()
    call = _prepare("allreduce", sendbuf, recvbuf, op, comm, algorithm, topology, check_args,
                    timeout, params, carry)
    if call.recv.size == 0:
        return call.recv
    state = comm_state(call.comm)
    deadline = None if timeout is None else time.monotonic() + timeout
    bound = ReproduciblePlan(call, state, explicit=False, timeout=None, deadline=deadline,
                             what="allreduce")

    def run():
        if carry.words is not None and bound.carries:
            return bound.run_carried(carry.words, timeout)
        return bound.run(timeout)

    key = _plans.call_key(slot, comm, sendbuf, op, algorithm, topology, params)
    if key is not None and _plans.cacheable(sendbuf, recvbuf, call) and state.calls.put(
            key, _Entry(bound, call, state, (comm, sendbuf, recvbuf, op, topology))):
        return run()
    try:
        return run()
    finally:
        bound.free()


def plan(sendbuf, recvbuf, op, comm, algorithm, topology, check_args, timeout, params):
    """``mpiallreduce.plan(..., reproducible=True)``: a persistent :class:`ReproduciblePlan`."""
    call = _prepare("plan", sendbuf, recvbuf, op, comm, algorithm, topology, check_args,
                    timeout, params)
    deadline = None if timeout is None else time.monotonic() + timeout
    return ReproduciblePlan(call, comm_state(call.comm), explicit=True, timeout=timeout,
                            deadline=deadline, what="plan")


def iallreduce(sendbuf, recvbuf, op, comm, algorithm, topology, check_args, timeout, params):
    """``mpiallreduce.iallreduce(..., reproducible=True)``: a plan started once, then freed."""
    from .nonblocking import Request, start

    call = _prepare("iallreduce", sendbuf, recvbuf, op, comm, algorithm, topology, check_args,
                    timeout, params)
    if call.recv.size == 0:
        return Request(call.recv)
    deadline = None if timeout is None else time.monotonic() + timeout
    bound = ReproduciblePlan(call, comm_state(call.comm), explicit=True, timeout=timeout,
                             deadline=deadline, what="iallreduce")
    try:
        return start(bound, timeout)  # runs whole, now (see nonblocking.start)
    finally:
        bound.free()


# -- whole vectors: sum, dot, norm2 ----------------------------------------------------------------

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
    from . import api  # (a cycle at import time: api imports this module)

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
    agree(state.checker, what, signature, error, ALGORITHMS)
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
    api.allreduce(MPI.IN_PLACE, words, comm=comm, algorithm=algorithm, check=False)
    nranks = comm.Get_size()
    results = []
    for index in range(len(components)):
        part = words[index * width:(index + 1) * width]
        flags = [int(count > 0) for count in part[EXACT_WORDS:].tolist()]
        results.append((_decode(part[:EXACT_WORDS], nranks), -1074, *flags))
    return results


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
        values as addition gives them (docs/usage.md, "Reproducible sums").

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
