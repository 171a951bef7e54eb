"""Reduction operators: MPI op -> local combine (NumPy ufunc fast path, Op.Reduce_local otherwise)."""

from __future__ import annotations

import contextvars
import math
from dataclasses import dataclass
from fractions import Fraction
from functools import cache, partial

import numpy as np
from mpi4py import MPI

from .schedule import RECEIVED_FIRST

_INTS = tuple(np.dtype(t) for t in ("int8", "int16", "int32", "int64",
                                     "uint8", "uint16", "uint32", "uint64"))
_FLOATS = (np.dtype("float32"), np.dtype("float64"))
_COMPLEX = (np.dtype("complex64"), np.dtype("complex128"))
_BOOL = (np.dtype("bool"),)
#: every dtype mpiallreduce moves and reduces (the NumPy types with a predefined MPI datatype).
DTYPES = _INTS + _FLOATS + _COMPLEX + _BOOL


class _Average:
    """Marker for ``mar.AVG``: sum across ranks, then divide by the number of ranks."""

    def __repr__(self) -> str:
        return "mpiallreduce.AVG"

    def __reduce__(self):
        return "AVG"


#: Average across ranks (sum, then divide by p), as torch.distributed and Horovod offer.
AVG = _Average()

# name, op, ufunc, dtypes MPI defines it for (MPI-4.1 §6.9.2)
_PREDEFINED = (
    ("SUM", MPI.SUM, np.add, _INTS + _FLOATS + _COMPLEX),
    ("PROD", MPI.PROD, np.multiply, _INTS + _FLOATS + _COMPLEX),
    ("MIN", MPI.MIN, np.minimum, _INTS + _FLOATS),
    ("MAX", MPI.MAX, np.maximum, _INTS + _FLOATS),
    ("LAND", MPI.LAND, np.logical_and, _INTS + _BOOL),
    ("LOR", MPI.LOR, np.logical_or, _INTS + _BOOL),
    ("LXOR", MPI.LXOR, np.logical_xor, _INTS + _BOOL),
    ("BAND", MPI.BAND, np.bitwise_and, _INTS),
    ("BOR", MPI.BOR, np.bitwise_or, _INTS),
    ("BXOR", MPI.BXOR, np.bitwise_xor, _INTS),
)
#: stable index of each op, shared by every rank (for the cross-rank agreement check).
OP_NAMES = tuple(name for name, *_ in _PREDEFINED) + ("AVG",)


@dataclass(frozen=True)
class Reducer:
    """How to combine two buffers for one (op, dtype): ``combine(received, local, order)``."""

    name: str
    mpi_op: MPI.Op
    ufunc: np.ufunc | None
    commutative: bool
    average: bool
    index: int  # position in OP_NAMES, or -1 (user op, commutative) / -2 (not commutative)

    def combine(self, received: np.ndarray, local: np.ndarray, order: str) -> None:
        """Reduce ``received`` into ``local`` in place, as ``received ∘ local`` or ``local ∘ received``.

        ``received`` is scratch and may be overwritten (the non-commutative user-op path does).
        """
        if self.ufunc is not None:
            first, second = (received, local) if order == RECEIVED_FIRST else (local, received)
            self._into(first, second, local)()  # as a bound run combines: IEEE, no warning
        elif order == RECEIVED_FIRST:
            self.mpi_op.Reduce_local(received, local)  # local = received ∘ local
        else:
            self.mpi_op.Reduce_local(local, received)  # received = local ∘ received
            np.copyto(local, received)


    def _into(self, first: np.ndarray, second: np.ndarray, out: np.ndarray):
        """Return the bound ``ufunc(first, second, out)``: ``out`` positional where NumPy
        allows it (cheaper per call than the keyword; maximum/minimum deprecate it).

        A float or complex sum or product runs with NumPy's floating-point errors ignored
        (:func:`quietly`): past the largest float it is an infinity, inf - inf a NaN, as IEEE
        and MPI say, with no warning whatever the caller's NumPy error state.
        """
        if self.ufunc in (np.maximum, np.minimum):
            return partial(self.ufunc, first, second, out=out)
        if self.ufunc in IEEE_NOISY and out.dtype.kind in "fc":
            return quietly(self.ufunc, first, second, out)
        return partial(self.ufunc, first, second, out)

    def bind(self, received: np.ndarray, local: np.ndarray, out: np.ndarray, order: str,
             shared: bool = False) -> tuple:
        """Return argument-free calls that set ``out = received ∘ local`` (or ``local ∘
        received``), bound once so a plan's run only calls them.

        ``local`` is ``out`` itself, or the caller's sendbuf where the result buffer does not
        hold this rank's contribution yet (then nothing is copied in first). ``received`` is
        scratch and may be overwritten, or ``out`` itself where the message landed in the
        result (out of place, before the plan wrote the range). ``shared``: a peer reads
        ``out`` (the plan sends from it) and the result is small enough (see
        :data:`SCRATCH_COMBINE`): the result is computed into ``received``, then copied.
        """
        same = _same_memory(local, out)
        if self.ufunc is not None:
            first, second = (received, local) if order == RECEIVED_FIRST else (local, received)
            if shared and out.nbytes >= SCRATCH_COMBINE[0] \
                    and not _same_memory(received, out):
                # single-copy transports (Open MPI's CMA) read the sender's memory, so the
                # peer's cache holds ``out``'s lines: a ufunc storing into them pays an
                # ownership upgrade per line, several times slower than writing our own
                # scratch and copying it back with memcpy's store stream
                return (self._into(first, second, received), partial(np.copyto, out, received))
            return (self._into(first, second, out),)
        reduce_local = self.mpi_op.Reduce_local
        if order == RECEIVED_FIRST:  # Reduce_local(a, b) sets b = a ∘ b
            load = () if same else (partial(np.copyto, out, local),)
            return load + (partial(reduce_local, received, out),)
        return (partial(reduce_local, local, received), partial(np.copyto, out, received))


#: the ufuncs whose float and complex results NumPy reports: overflow (past the largest
#: float) and invalid (inf - inf, 0 * inf). MIN and MAX report nothing, integer arrays wrap
#: silently, and AVG's division by the number of ranks can neither overflow nor be invalid.
IEEE_NOISY = (np.add, np.multiply)


def _quiet_context() -> contextvars.Context | None:
    """A context in which NumPy ignores floating-point errors, or None under NumPy 1.

    NumPy 2 keeps its error state in a context variable, which ``errstate`` sets in the
    current context: entered inside a context of its own (and never left), it holds there
    alone, so a call run in that context (``Context.run``, cheap: it is C) ignores the
    errors while the caller's state, global and in every other context, stays as it is.
    ``np.errstate`` around each call costs more than an 8-byte run.
    """
    if int(np.__version__.split(".")[0]) < 2:
        return None  # NumPy 1 keeps the state per thread: errstate would change the caller's
    context = contextvars.Context()
    context.run(np.errstate(all="ignore").__enter__)
    return context


_QUIET = _quiet_context()


def quietly(func, *args):
    """Return ``func(*args)`` bound to run with NumPy's floating-point errors ignored, leaving
    the caller's error state as it is.

    Each bound call runs in a copy of its own of the quiet context (a context cannot be
    entered by two threads at once, and two plans may run in two threads); under NumPy 1, in
    ``np.errstate(all="ignore")`` (slower: it sets and restores the thread's state per call).
    """
    if _QUIET is None:
        return partial(np.errstate(all="ignore")(func), *args)
    return partial(_QUIET.copy().run, func, *args)


#: (least bytes of a combine, most bytes of the whole result) between which a reduction into
#: a range peers read (the plan sends from it) is computed into the received scratch and
#: copied back. Under Open MPI 5's single-copy CMA path (messages over 4 KiB) the peer's cache
#: holds the lines it read, and a ufunc storing into them pays an ownership upgrade per line.
#: Measured at 2 ranks, Xeon with 2 MiB L2 per core: right after a peer read the range,
#: ``np.add(out, received, out)`` was slower than the same add through scratch at every size
#: from 4 KiB to 1 MiB; whole in-place runs (ring, rabenseifner, recursive_doubling) gain from
#: it up to a 1 MiB result, nothing at 2 MiB, and lose at 8 MiB, where the lines have left the
#: peer's cache before they are written again.
SCRATCH_COMBINE = (4 << 10, 1 << 20)


def _same_memory(a: np.ndarray, b: np.ndarray) -> bool:
    """Are ``a`` and ``b`` views of exactly the same elements?"""
    return a is b or (a.shape == b.shape and a.strides == b.strides
                      and a.__array_interface__["data"][0] == b.__array_interface__["data"][0])


def dtype_name(dtype: np.dtype) -> str:
    return np.dtype(dtype).name


def check_dtype(dtype: np.dtype, argument: str = "sendbuf") -> None:
    """Raise TypeError unless ``dtype`` is one mpiallreduce can move and reduce."""
    if np.dtype(dtype) not in DTYPES:
        raise TypeError(f"{argument} has dtype {np.dtype(dtype)}, which has no predefined MPI "
                        f"datatype here; use one of {', '.join(dtype_name(d) for d in DTYPES)}")


def reducer(op, dtype: np.dtype) -> Reducer:
    """Return the Reducer for ``op`` on ``dtype`` or raise TypeError if MPI does not define it."""
    dtype = np.dtype(dtype)
    check_dtype(dtype)
    if op is AVG:
        if dtype not in _FLOATS + _COMPLEX:
            raise TypeError(f"op AVG is not defined for dtype {dtype}: it divides by the number "
                            f"of ranks; use a floating or complex dtype, or SUM")
        return Reducer("AVG", MPI.SUM, np.add, True, True, OP_NAMES.index("AVG"))
    if not isinstance(op, MPI.Op):
        raise TypeError(f"op must be an mpi4py MPI.Op or mpiallreduce.AVG, got {op!r}")
    if op == MPI.OP_NULL:
        raise ValueError("op is MPI.OP_NULL (a freed or null op)")
    for index, (name, mpi_op, ufunc, dtypes) in enumerate(_PREDEFINED):
        if op == mpi_op:
            if dtype not in dtypes:
                allowed = ", ".join(dtype_name(d) for d in dtypes)
                raise TypeError(f"op MPI.{name} is not defined for dtype {dtype}; "
                                f"MPI defines it for {allowed}")
            return Reducer(name, mpi_op, ufunc, True, False, index)
    if op.is_predefined:
        name = next((f"MPI.{n}" for n in ("MAXLOC", "MINLOC", "REPLACE", "NO_OP")
                     if op == getattr(MPI, n, None)), repr(op))
        raise TypeError(f"predefined op {name} is not supported by mpiallreduce; use one of "
                        f"{', '.join(OP_NAMES)} or a user op from MPI.Op.Create")
    commutative = op.Is_commutative()
    return Reducer("user", op, None, commutative, False, -1 if commutative else -2)


#: the integer dtypes whose SUM/PROD overflow so easily that a saturating native op shows.
NARROW_INTS = tuple(np.dtype(t) for t in ("int8", "uint8", "int16", "uint16"))


@cache
def native_deviates(name: str, dtype: np.dtype) -> bool:
    """Does MPI's own ``name`` op (SUM or PROD) on 8/16-bit ``dtype`` overflow non-modularly?

    MPI defines integer arithmetic as C's (modular for unsigned types, wrapping in practice
    for signed ones). Open MPI's ``op/avx`` component saturates SUM on these types instead for
    vectorised lengths (upstream open-mpi/ompi#8045, closed as won't fix); MPICH wraps. The probe
    is local and costs no message: ``Op.Reduce_local`` runs the same op functions as Open MPI's
    collectives, on lengths that take the vector path and its scalar tail.
    """
    dtype = np.dtype(dtype)
    if name not in ("SUM", "PROD") or dtype not in NARROW_INTS:
        return False
    op, ufunc = (MPI.SUM, np.add) if name == "SUM" else (MPI.PROD, np.multiply)
    info = np.iinfo(dtype)
    for length in (1, 7, 64, 257, 1031):
        for value in (info.max - 1, info.min + 1):
            if value == 0:
                continue
            received = np.full(length, value, dtype=dtype)
            local = received.copy()
            op.Reduce_local(received, local)
            with np.errstate(over="ignore"):
                if not np.array_equal(local, ufunc(received, received)):
                    return True
    return False


def exact_sum(values) -> float:
    """The correctly rounded sum of the floats ``values`` (in any order: the same bits), with
    IEEE addition's special values: NaN (the default quiet NaN) if any is NaN or both
    infinities occur, an infinity alone gives it, a sum beyond the largest float an infinity of
    its sign, and -0 only when every value is -0."""
    try:
        total = math.fsum(values)
    except OverflowError:  # a partial sum beyond the largest float: exactly, in rationals
        special = [v for v in values if not math.isfinite(v)]
        if special:  # NaN, or infinities: of one sign, that one, else NaN
            return special[0] if len(set(special)) == 1 and special[0] == special[0] else math.nan
        exact = sum(map(Fraction, values))
        try:
            return float(exact)
        except OverflowError:
            return math.inf if exact > 0 else -math.inf
    except ValueError:  # +inf and -inf
        return math.nan
    if total == 0.0:
        return -0.0 if all(math.copysign(1.0, v) < 0 for v in values) else 0.0
    return math.nan if total != total else total
