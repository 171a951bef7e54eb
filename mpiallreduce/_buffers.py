"""What mar.Comm can hand to mpiallreduce: mpi4py buffer specs read as NumPy views, and the
datatypes and ops mpiallreduce reduces.

Buffers are read as mpi4py reads them (the buffer protocol, then DLPack: ``_checks.view``).
Each parser (:func:`reduction`, :func:`scatter`, :func:`gather`) returns the flat views
mpiallreduce runs on, or None where MPI should decide (a datatype mpiallreduce does not reduce, a
count past the buffer, aliased buffers...): the caller then hands the original arguments to
mpi4py, which computes or raises exactly as it always does. A buffer this rank cannot take
raises :class:`Unviewable`, which the ranks share in the agreement (``Comm._route`` in
:mod:`mpiallreduce.comm`, then :func:`settle`) so that every rank goes to MPI together.
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI
from mpi4py.util import dtlib

from ._checks import view
from .ops import DTYPES, reducer
from .partition import block_counts

#: predefined datatypes whose reduction mpiallreduce computes (MPI's C integer, floating,
#: complex and logical types, and Fortran's complex ones, which hold a pair of C floats or
#: doubles and which SUM and PROD combine as C's): MPI handle -> NumPy dtype. Anything else goes
#: to MPI.
_DATATYPE_NAMES = (
    "SIGNED_CHAR", "SHORT", "INT", "LONG", "LONG_LONG", "UNSIGNED_CHAR", "UNSIGNED_SHORT",
    "UNSIGNED", "UNSIGNED_LONG", "UNSIGNED_LONG_LONG", "INT8_T", "INT16_T", "INT32_T", "INT64_T",
    "UINT8_T", "UINT16_T", "UINT32_T", "UINT64_T", "FLOAT", "DOUBLE", "C_FLOAT_COMPLEX",
    "C_DOUBLE_COMPLEX", "C_COMPLEX", "C_BOOL", "CXX_BOOL", "CXX_FLOAT_COMPLEX",
    "CXX_DOUBLE_COMPLEX", "COMPLEX", "DOUBLE_COMPLEX", "COMPLEX8", "COMPLEX16")


def _datatype_table() -> dict[int, np.dtype]:
    table = {}
    for name in _DATATYPE_NAMES:
        datatype = getattr(MPI, name, MPI.DATATYPE_NULL)
        if datatype == MPI.DATATYPE_NULL:
            continue
        try:
            dtype = dtlib.to_numpy_dtype(datatype)
        except (KeyError, ValueError):
            continue
        if dtype in DTYPE_SET and dtype.itemsize == datatype.Get_size():
            table[datatype.handle] = dtype
    return table


#: every NumPy dtype mpiallreduce reduces, as a set (a membership test on the hot path).
DTYPE_SET = frozenset(DTYPES)
#: the NumPy dtype of each MPI datatype handle mpiallreduce reduces
DTYPE_OF = _datatype_table()


def _unpack(spec):
    """Split an mpi4py buffer spec into (buffer, count, displacement, datatype); None: not one."""
    if not isinstance(spec, (list, tuple)):
        return spec, None, 0, None
    if len(spec) == 2:
        buf, second = spec
        if isinstance(second, (MPI.Datatype, str)):
            return buf, None, 0, second
        count, displ = second if isinstance(second, (list, tuple)) else (second, 0)
        return buf, count, displ, None
    if len(spec) == 3:
        buf, count, datatype = spec
        count, displ = count if isinstance(count, (list, tuple)) else (count, 0)
        return buf, count, displ, datatype
    if len(spec) == 4:
        return spec
    return None


class Unviewable(Exception):
    """This rank cannot take its buffer as mpiallreduce needs it (NumPy cannot view it, or it is
    read-only where written, or strided): the call goes to MPI, and every rank must agree.

    The message says whether mpi4py itself reads the buffer (its own export, tried here on the
    object alone); ranks exchange it in the agreement, and :func:`settle` acts on it.
    """

    def __init__(self, message: str, probe: Exception | None = None):
        super().__init__(message)
        self.probe = probe  # what mpi4py raises for this rank's buffer; None: it reads it
        self.dtype = None  # the datatype's NumPy dtype when the spec names one

    @classmethod
    def of(cls, buf, writable: bool) -> Unviewable:
        try:
            MPI.buffer.frombuffer(buf, readonly=not writable)
        except Exception as exc:  # noqa: BLE001 - what mpi4py raises for this buffer
            # kept without its traceback: its frames hold the buffer (a capsule, for DLPack),
            # and an exception kept with them makes a cycle only the garbage collector frees
            return cls(f"{_UNREADABLE} ({type(exc).__name__}: {exc})", bare(exc))
        return cls(_READABLE)


def bare(exc: BaseException) -> BaseException:
    """``exc`` without its traceback and chained exceptions (which hold frames)."""
    exc.__context__ = exc.__cause__ = None
    return exc.with_traceback(None)


_READABLE = "mpi4py reads this rank's buffer"
_UNREADABLE = "mpi4py cannot read this rank's buffer"


def settle(agreed: Unviewable, probe: Exception | None) -> None:
    """Act on the agreement's verdict that some rank cannot take its buffer (every rank sees the
    same message): return to run the call through MPI, or raise.

    Where some ranks' buffers are ones mpi4py cannot read either and other ranks' are fine, MPI
    would raise on the former and leave the latter waiting: every rank raises instead (a rank
    whose buffer mpi4py cannot read raises what mpi4py raises). Where every rank's buffer is
    such a one, and alike, MPI raises its own error on every rank.
    """
    text = str(agreed)
    if _UNREADABLE in text and not text.startswith(_UNREADABLE):
        if probe is not None:
            raise probe
        raise BufferError(text) from None


def might_route(dtype, op) -> bool:
    """Could the other ranks route this call to mpiallreduce, from the facts every rank shares
    (the datatype, when the spec names it, and the op; op None: a collective without one)?"""
    if op is None:
        return True
    if dtype is not None:
        return reducible(op, dtype) is not None
    return any(reducible(op, dtype) is not None for dtype in DTYPES)


def _flat(buf, writable: bool) -> np.ndarray:
    """View ``buf``'s memory as a flat NumPy array without copying, in its storage order.

    Raises Unviewable where mpiallreduce cannot take it: no view (``_checks.view``, the buffer
    protocol first, as mpi4py reads it), read-only where written, or strided.
    """
    try:
        array = view(buf, "buffer")
    except TypeError:
        raise Unviewable.of(buf, writable) from None
    if writable and not array.flags.writeable:
        raise Unviewable.of(buf, writable)
    # An elementwise collective reads memory in storage order, as MPI does: Fortran order too.
    if array.flags.c_contiguous:
        return array.reshape(-1)
    if array.flags.f_contiguous:
        return array.reshape(-1, order="F")
    raise Unviewable.of(buf, writable)


def _implicit_datatype(dtype: np.dtype) -> int:
    """The handle of the datatype mpi4py infers for a buffer of ``dtype`` (no datatype given)."""
    handle = _IMPLICIT.get(dtype)
    if handle is None:
        handle = _IMPLICIT[dtype] = dtlib.from_numpy_dtype(dtype).handle
    return handle


_IMPLICIT: dict[np.dtype, int] = {}


def message(spec, writable: bool, blocks: int = 1) -> tuple[np.ndarray, int] | None:
    """Return (1-D view of the message's elements, its datatype's handle), or None where MPI
    should decide.

    None for anything mpiallreduce does not reduce or whose use MPI defines differently (a
    datatype outside :data:`DTYPE_OF`, a count past the buffer), so the caller hands the
    original arguments to mpi4py, which computes or raises exactly as it always does.
    ``blocks``: an explicit count counts elements per block (mpi4py's ``BufSpecB``: the
    receive buffer of ``Allgather``), so the message holds ``count * blocks``.
    """
    parts = _unpack(spec)
    if parts is None:
        return None
    buf, count, displ, datatype = parts
    if datatype is None:
        flat = _flat(buf, writable)
        dtype = flat.dtype
        if dtype not in DTYPE_SET:
            return None
        handle = _implicit_datatype(dtype)
    else:
        if isinstance(datatype, str):
            try:
                datatype = MPI.Datatype.fromcode(datatype)
            except (KeyError, ValueError):
                return None
        if not isinstance(datatype, MPI.Datatype):
            return None
        handle = datatype.handle
        dtype = DTYPE_OF.get(handle)
        if dtype is None:
            return None
        try:
            flat = _flat(buf, writable)
        except Unviewable as exc:
            exc.dtype = dtype
            raise
    if flat.dtype != dtype or count is not None:
        # an empty buffer has no memory to view: an empty message of the datatype
        flat = np.empty(0, dtype=dtype) if flat.size == 0 else flat.view(np.uint8)
        try:
            if count is None:
                if flat.size % dtype.itemsize:
                    return None
                count, displ = flat.size // dtype.itemsize, 0
            else:
                count *= blocks
            count, displ = int(count), int(displ)
        except (TypeError, ValueError):
            return None
        start, stop = displ * dtype.itemsize, (displ + count) * dtype.itemsize
        if count < 0 or displ < 0 or stop > flat.nbytes:
            return None
        flat = flat[start:stop].view(dtype)
    return flat, handle


def _send(spec, dtype: np.dtype, blocks: int = 1) -> tuple[np.ndarray, int] | None:
    """Parse the send side as :func:`message` does; where this rank cannot take it, the
    :class:`Unviewable` carries the receive side's dtype for the agreement."""
    try:
        return message(spec, writable=False, blocks=blocks)
    except Unviewable as exc:
        exc.dtype = dtype
        raise


def _overlap(a: np.ndarray, b: np.ndarray) -> bool:
    """Do two non-empty messages share memory (aliased buffers: MPI's error, so MPI runs)?"""
    return bool(a.size and b.size and np.may_share_memory(a, b))


def reduction(sendbuf, recvbuf, op) -> tuple[np.ndarray | None, np.ndarray] | None:
    """Return (send, recv) of an allreduce mpiallreduce takes (send None: ``MPI.IN_PLACE``), or
    None where MPI should decide."""
    recv = message(recvbuf, writable=True)
    if recv is None:
        return None
    send = None
    if sendbuf is not MPI.IN_PLACE:
        parsed = _send(sendbuf, recv[0].dtype)
        if parsed is None or parsed[1] != recv[1] or parsed[0].size != recv[0].size \
                or _overlap(parsed[0], recv[0]):
            return None
        send = parsed[0]
    if reducible(op, recv[0].dtype) is None:
        return None
    return send, recv[0]


def scatter(sendbuf, recvbuf, recvcounts, op, nranks: int, rank: int, block: bool):
    """Return (input, this rank's output, commutative) of a reduce-scatter in MPI's block layout
    (``partition.block``: the first n % p blocks one longer), or None where MPI should decide.

    ``block``: ``Reduce_scatter_block`` (equal blocks; counted per block in place), else
    ``Reduce_scatter`` with ``recvcounts``.
    """
    in_place = sendbuf is MPI.IN_PLACE
    if not block:
        # the counts are the same on every rank (MPI's rule; gathered when None): decided
        # before any buffer is looked at, so every rank decides alike
        if recvcounts is None:
            return None
        try:
            counts = [int(c) for c in recvcounts]
        except (TypeError, ValueError):
            return None
        if len(counts) != nranks or counts != block_counts(sum(counts), nranks):
            return None
    # in place, recvbuf holds every block on input (counted per block by Reduce_scatter_block)
    recv = message(recvbuf, writable=True, blocks=nranks if in_place and block else 1)
    if recv is None:
        return None
    recv, datatype = recv
    red = reducible(op, recv.dtype)
    if red is None:
        return None
    if in_place:
        source = recv  # this rank's block of the result lands in front
    else:
        send = _send(sendbuf, recv.dtype, blocks=nranks if block else 1)
        if send is None or send[1] != datatype:
            return None
        source = send[0]
    if block:
        if in_place and recv.size % nranks:
            return None
        counts = [recv.size // nranks if in_place else recv.size] * nranks
    total = sum(counts)
    if source.size != total or recv.size < counts[rank] \
            or (not in_place and recv.size != counts[rank]):
        return None
    if not in_place and _overlap(source, recv):
        return None
    if in_place:
        source = source.copy()  # reduce_scatter reads the whole input while writing block r
    return source, recv[:counts[rank]], red.commutative


def gather(sendbuf, recvbuf, nranks: int) -> tuple[np.ndarray | None, np.ndarray] | None:
    """Return (send, recv) of an allgather into ``nranks`` equal blocks (send None:
    ``MPI.IN_PLACE``), or None where MPI should decide."""
    recv = message(recvbuf, writable=True, blocks=nranks)
    if recv is None or recv[0].size % nranks:
        return None
    recv, datatype = recv
    send = None
    if sendbuf is not MPI.IN_PLACE:
        parsed = _send(sendbuf, recv.dtype)
        if parsed is None or parsed[1] != datatype or parsed[0].size * nranks != recv.size \
                or _overlap(parsed[0], recv):
            return None
        send = parsed[0]
    return send, recv


def whole(send: np.ndarray | None, recv: np.ndarray, sendbuf, recvbuf) -> bool:
    """Are the parsed messages all of ``sendbuf``'s and ``recvbuf``'s elements (NumPy arrays of
    one shape, whole, Fortran order too), so the objects themselves can stand for the call?"""
    return _same_elements(recv, recvbuf) and (
        sendbuf is MPI.IN_PLACE or (_same_elements(send, sendbuf)
                                    and sendbuf.shape == recvbuf.shape))


def _same_elements(parsed: np.ndarray, array) -> bool:
    """Is ``parsed`` (a parsed message) all of ``array``'s elements, in its memory order?"""
    return (isinstance(array, np.ndarray) and parsed.dtype == array.dtype
            and parsed.size == array.size and array.size > 0
            and (array.flags.c_contiguous or array.flags.f_contiguous)
            and parsed.ctypes.data == array.ctypes.data)


_REDUCERS: dict = {}  # (predefined op handle, dtype) -> Reducer or None
_BY_OBJECT: dict = {}  # (id of a predefined op object, dtype) -> (op, Reducer or None): hot path


def reducible(op, dtype: np.dtype):
    """Return mpiallreduce's Reducer for (op, dtype), or None where MPI should decide."""
    hit = _BY_OBJECT.get((id(op), dtype))
    if hit is not None and hit[0] is op:
        return hit[1]
    key = (op.handle, dtype) if isinstance(op, MPI.Op) and op.is_predefined else None
    if key in _REDUCERS:
        red = _REDUCERS[key]
    else:
        try:
            red = reducer(op, dtype)
        except (TypeError, ValueError):
            red = None
        if key is None:
            return red
        _REDUCERS[key] = red
    if len(_BY_OBJECT) < 1024:
        _BY_OBJECT[id(op), dtype] = (op, red)  # holds op, so its id stays its own
    return red
