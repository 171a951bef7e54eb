"""The elementwise reproducible sum (``allreduce(..., reproducible=True)``): :class:`ReproduciblePlan`.

How it works, and its accuracy: :mod:`mpiallreduce.reproducible`.
"""

from __future__ import annotations

import struct
import time
import weakref
from dataclasses import replace
from functools import partial

import numpy as np
from mpi4py import MPI

from .. import _plans, shm
from ..executor import _PlanBase
from ..ops import exact_sum, reducer
from . import _exact
from .formats import _TOP64, FORMATS, MAX_CONTRIBUTIONS, _float_view, _Format, word_bits

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
#: element: 1 MiB) stay in the core's L2 cache (2 MiB here). Measured on 1M float64 elements in
#: one process, blocks of 32K or 64K converted to words fastest: one pass per operation over the
#: whole array leaves the cache, and smaller blocks pay NumPy's cost per call more often.
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
                                     nranks, state, deadline, what, shared=True,
                                     learned=False) == "shm")
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
                                       timeout=None, deadline=deadline, what=what, learned=False)
        self._inner = _plans.build(replace(words_call, recv=self._words.reshape(-1)), state,
                                   explicit=explicit, persistent=True, timeout=None,
                                   deadline=deadline, what=what, shared=pooled,
                                   learned=False)
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
        self.fused = nranks > 1 and _plans.resolve(call, nranks, state, deadline, what,
                                                    learned=False) == "shm"
        if self.fused:  # shm: the run reads the peers' values where they wrote them, and checks
            # the arguments itself (its signature, reproducible marked, folds the check's in)
            self._inner = _plans.build_shm(call, state, explicit=explicit, timeout=timeout,
                                           deadline=deadline, what=what, exact=True,
                                           signature=_Agreed(call).signature)
        else:
            self._inner = _plans.build(replace(words_call, recv=self._words), state,
                                       explicit=explicit, persistent=True, timeout=None,
                                       deadline=deadline, what=what, learned=False)
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
                                   deadline=deadline, what=what, learned=False)
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


class _Agreed:
    """A checked call whose signature also says ``reproducible`` (ranks must agree on it)."""

    def __init__(self, call):
        self.call = call

    def signature(self, timeout) -> list[int]:
        fields = self.call.signature(timeout)
        fields[6] = (fields[6] ^ 0x52455052) & 0x7FFFFFFF  # the parameters field, marked
        return fields
