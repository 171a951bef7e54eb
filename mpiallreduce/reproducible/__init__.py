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
large sizes (2x the data with 2 words, 3x with 3; docs/howto/numerics.md, "Reproducible sums"). Why not
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

# the package's names as its importers use them (api, comm, tests, scripts, docs)
from .calls import _bind, _Entry, allreduce, iallreduce, plan  # noqa: F401
from .elementwise import (  # noqa: F401
    BLOCK,
    GATHER_RANKS,
    OVERFLOW_SCALE,
    PAIR_RANKS,
    SMALL,
    ReproduciblePlan,
)
from .formats import FORMATS, MAX_CONTRIBUTIONS, WORD_BITS, _round, check, covers, word_bits  # noqa: F401
from .vectors import EXACT_WORD_BITS, EXACT_WORDS, dot, norm2, sum  # noqa: F401

__all__ = ["ReproduciblePlan", "dot", "norm2", "sum"]
