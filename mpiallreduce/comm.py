"""mar.Comm: an mpi4py intracommunicator whose reductions and gathers run mpiallreduce.

``comm = mar.Comm(MPI.COMM_WORLD, algorithm="ring")`` is a ``MPI.Intracomm`` on the same MPI
communicator. ``Allreduce``, ``Iallreduce``, ``Allreduce_init``, ``Reduce_scatter_block``,
``Reduce_scatter`` (MPI's block layout) and ``Allgather`` go through :func:`mpiallreduce.allreduce`
and its related collectives; every other method is mpi4py's own. Buffers are read as mpi4py
reads them (the buffer protocol, then DLPack). Whatever mpiallreduce cannot take goes to MPI
unchanged, so it behaves exactly as plain mpi4py: a derived or pair datatype (``MPI.DOUBLE_INT``
with ``MAXLOC``), a predefined op MPI does not define for the datatype, a malformed spec (mpi4py
then raises its own exception), a buffer NumPy cannot view.

Ranks route alike: what the datatype and op decide (the same on every rank, as MPI requires)
each rank decides alone; a rank that cannot take its buffer joins the agreement the others run
(``check=True``), so every rank goes to MPI together (:class:`_Unviewable`); ``Reduce_scatter``
with ``recvcounts=None`` gathers the counts first, as mpi4py does.
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI
from mpi4py.util import dtlib

from ._agree import prepare
from ._checks import view
from ._plans import fresh_arrays
from .api import ALGORITHMS, allgather, allreduce, iallreduce, plan, reduce_scatter
from .ops import DTYPES, reducer
from .partition import block_counts
from .reproducible import covers

#: predefined datatypes whose reduction mpiallreduce computes (MPI's C integer, floating,
#: complex and logical types): MPI handle -> NumPy dtype. Anything else goes to MPI.
_DATATYPE_NAMES = (
    "SIGNED_CHAR", "SHORT", "INT", "LONG", "LONG_LONG", "UNSIGNED_CHAR", "UNSIGNED_SHORT",
    "UNSIGNED", "UNSIGNED_LONG", "UNSIGNED_LONG_LONG", "INT8_T", "INT16_T", "INT32_T", "INT64_T",
    "UINT8_T", "UINT16_T", "UINT32_T", "UINT64_T", "FLOAT", "DOUBLE", "C_FLOAT_COMPLEX",
    "C_DOUBLE_COMPLEX", "C_COMPLEX", "C_BOOL", "CXX_BOOL", "CXX_FLOAT_COMPLEX",
    "CXX_DOUBLE_COMPLEX")


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
        if dtype in _DTYPES and dtype.itemsize == datatype.Get_size():
            table[datatype.handle] = dtype
    return table


_DTYPES = frozenset(DTYPES)
_DTYPE_OF = _datatype_table()

#: what the related collectives run for each allreduce algorithm: its own phases where it has
#: them, else "auto" (which is MPI's collective today).
_PARTS = {"ring": ("ring", "ring"), "ring_segmented": ("ring", "ring"),
          "rabenseifner": ("recursive_halving", "recursive_doubling"),
          "recursive_doubling": ("auto", "recursive_doubling"), "cascade": ("ring", "ring"),
          "native": ("native", "native")}


# -- buffer specs -----------------------------------------------------------------------------------

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


class _Unviewable(Exception):
    """This rank cannot take its buffer as mpiallreduce needs it (NumPy cannot view it, or it is
    read-only where written, or strided): the call goes to MPI, and every rank must agree.

    The message says whether mpi4py itself reads the buffer (its own export, tried here on the
    object alone); ranks exchange it in the agreement (see ``Comm._settle``).
    """

    def __init__(self, message: str, probe: Exception | None = None):
        super().__init__(message)
        self.probe = probe  # what mpi4py raises for this rank's buffer; None: it reads it
        self.dtype = None  # the datatype's NumPy dtype when the spec names one

    @classmethod
    def of(cls, buf, writable: bool) -> _Unviewable:
        try:
            MPI.buffer.frombuffer(buf, readonly=not writable)
        except Exception as exc:  # noqa: BLE001 - what mpi4py raises for this buffer
            return cls(f"{_UNREADABLE} ({type(exc).__name__}: {exc})", exc)
        return cls(_READABLE)


_READABLE = "mpi4py reads this rank's buffer"
_UNREADABLE = "mpi4py cannot read this rank's buffer"


def _settle(agreed: _Unviewable, probe: Exception | None) -> None:
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


def _might_route(dtype, op) -> bool:
    """Could the other ranks route this call to mpiallreduce, from the facts every rank shares
    (the datatype, when the spec names it, and the op; op None: a collective without one)?"""
    if op is None:
        return True
    if dtype is not None:
        return _reducible(op, dtype) is not None
    return any(_reducible(op, dtype) is not None for dtype in DTYPES)


def _flat(buf, writable: bool) -> np.ndarray:
    """View ``buf``'s memory as a flat NumPy array without copying, in its storage order.

    Raises _Unviewable where mpiallreduce cannot take it: no view (``_checks.view``, the buffer
    protocol first, as mpi4py reads it), read-only where written, or strided.
    """
    try:
        array = view(buf, "buffer")
    except TypeError:
        raise _Unviewable.of(buf, writable) from None
    if writable and not array.flags.writeable:
        raise _Unviewable.of(buf, writable)
    # An elementwise collective reads memory in storage order, as MPI does: Fortran order too.
    if array.flags.c_contiguous:
        return array.reshape(-1)
    if array.flags.f_contiguous:
        return array.reshape(-1, order="F")
    raise _Unviewable.of(buf, writable)


def _implicit_datatype(dtype: np.dtype) -> int:
    """The handle of the datatype mpi4py infers for a buffer of ``dtype`` (no datatype given)."""
    handle = _IMPLICIT.get(dtype)
    if handle is None:
        handle = _IMPLICIT[dtype] = dtlib.from_numpy_dtype(dtype).handle
    return handle


_IMPLICIT: dict[np.dtype, int] = {}


def _message(spec, writable: bool, blocks: int = 1) -> tuple[np.ndarray, int] | None:
    """Return (1-D view of the message's elements, its datatype's handle), or None where MPI
    should decide.

    None for anything mpiallreduce does not reduce or whose use MPI defines differently (a
    datatype outside :data:`_DTYPE_OF`, a count past the buffer), so the caller hands the
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
        if dtype not in _DTYPES:
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
        dtype = _DTYPE_OF.get(handle)
        if dtype is None:
            return None
        try:
            flat = _flat(buf, writable)
        except _Unviewable as exc:
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


def _pair(sendbuf, recvbuf) -> tuple[np.ndarray | None, np.ndarray] | None:
    """Parse a (sendbuf, recvbuf) pair of the same dtype; sendbuf None means MPI.IN_PLACE."""
    recv = _message(recvbuf, writable=True)
    if recv is None:
        return None
    if sendbuf is MPI.IN_PLACE:
        return None, recv[0]
    try:
        send = _message(sendbuf, writable=False)
    except _Unviewable as exc:
        exc.dtype = recv[0].dtype
        raise
    if send is None or send[1] != recv[1]:
        return None
    if send[0].size and recv[0].size and np.may_share_memory(send[0], recv[0]):
        return None  # aliased buffers: MPI's error
    return send[0], recv[0]


def _same_elements(view: np.ndarray, array) -> bool:
    """Is ``view`` (a parsed message) all of ``array``'s elements, in its memory order?"""
    return (isinstance(array, np.ndarray) and view.dtype == array.dtype
            and view.size == array.size and array.size > 0
            and (array.flags.c_contiguous or array.flags.f_contiguous)
            and view.ctypes.data == array.ctypes.data)


_REDUCERS: dict = {}  # (predefined op handle, dtype) -> Reducer or None
_BY_OBJECT: dict = {}  # (id of a predefined op object, dtype) -> (op, Reducer or None): hot path


def _reducible(op, dtype: np.dtype):
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


# -- requests ---------------------------------------------------------------------------------------

class _Request:
    """mpi4py's request interface over an mpiallreduce request (``mar.iallreduce``).

    Offers ``Wait``/``Test``/``Free`` and the lowercase ``wait``/``test``. It is not an
    ``MPI.Request``: pass it to ``Wait()``, not to ``MPI.Request.Waitall``.
    """

    def __init__(self, request=None):
        self._request = request  # an mpiallreduce request with wait()/test()
        self._done = request is None

    def Wait(self, status=None) -> bool:
        """Complete the collective."""
        if not self._done:
            self._request.wait()
            self._done = True
        return True

    def Test(self, status=None) -> bool:
        """Return whether the collective is complete."""
        if not self._done:
            self._done = bool(self._request.test())
        return self._done

    def Free(self) -> None:
        """Complete the collective (the other ranks' parts need this rank's), then drop it."""
        self.Wait()

    def wait(self, status=None):
        self.Wait(status)

    def test(self, status=None):
        return self.Test(status), None

    def __bool__(self) -> bool:
        return not self._done


class _Persistent(_Request):
    """A persistent allreduce over :func:`mpiallreduce.plan`: Start/Wait/Test, as ``Prequest``.

    The plan is built (and, with ``check``, agreed across ranks) when the request is made, as
    ``MPI_Allreduce_init`` is collective. ``Start`` starts the plan (``Plan.start``); an
    inactive request completes at once, as MPI's does.
    """

    def __init__(self, bound):
        super().__init__()
        self._plan = bound

    def Start(self) -> None:
        if not self._done:
            raise ValueError("Start on an active persistent request; Wait for it first")
        self._request = self._plan.start()
        self._done = False

    def Free(self) -> None:
        self.Wait()
        self._plan.free()

    def __bool__(self) -> bool:
        return True


# -- the communicator -------------------------------------------------------------------------------

class Comm(MPI.Intracomm):
    """An ``MPI.Intracomm`` whose reductions and gathers run mpiallreduce's algorithms.

    Args:
        comm: the intracommunicator to wrap (not copied: the same MPI communicator, so messages
            and collectives of the two objects mix as on one communicator).
        algorithm: the allreduce algorithm, one of :data:`mpiallreduce.ALGORITHMS`.
        reduce_scatter_algorithm, allgather_algorithm: for ``Reduce_scatter(_block)`` and
            ``Allgather``; default: the allreduce algorithm's own phases where it has them
            (``ring`` -> ring and ring, ``rabenseifner`` -> recursive halving and recursive
            doubling), else ``"auto"``.
        options: as :func:`mpiallreduce.allreduce` takes them: ``check``, ``timeout``,
            ``topology`` and the algorithm's parameters (``segment_bytes=``...). ``check`` and
            ``timeout`` apply to the related collectives too.

    ``Dup``, ``Split``, ``Create`` and friends return ``Comm`` objects with the same options.
    """

    def __new__(cls, comm=None, algorithm="auto", **options):
        return super().__new__(cls, comm)

    def __init__(self, comm=None, algorithm="auto", *, reduce_scatter_algorithm=None,
                 allgather_algorithm=None, **options):
        if not isinstance(algorithm, str) or algorithm not in ALGORITHMS:
            raise ValueError(f"unknown algorithm {algorithm!r}; choose one of "
                             f"{', '.join(ALGORITHMS)}")
        rs_default, ag_default = _PARTS.get(algorithm, ("auto", "auto"))
        self._algorithm = algorithm
        self._rs_algorithm = reduce_scatter_algorithm or rs_default
        self._rs_explicit = reduce_scatter_algorithm is not None
        self._ag_algorithm = allgather_algorithm or ag_default
        self._options = options
        self._related = {k: v for k, v in options.items() if k in ("check", "timeout")}
        self._view = None  # the plain view mpiallreduce gets, made once (see _plain)
        # mar.allreduce's arguments after the buffers and op, positional, and the parameters
        self._args = (self._algorithm, options.get("topology"), options.get("check", True),
                      options.get("timeout"))
        self._params = {k: v for k, v in options.items()
                        if k not in ("topology", "check", "timeout")}
        # reproducible=True applies to float SUM/AVG; other calls are exact already and go
        # without it (mar.allreduce would refuse them)
        self._reproducible = bool(self._params.get("reproducible"))
        self._exact = {k: v for k, v in self._params.items() if k != "reproducible"}
        self._calls: dict = {}  # id(recvbuf) -> an Allreduce routed as it came: see Allreduce
        self._previous = (None, None)  # the last pair of arrays seen once: see Allreduce
        self._settings = dict(options, reduce_scatter_algorithm=reduce_scatter_algorithm,
                              allgather_algorithm=allgather_algorithm)

    def __repr__(self) -> str:
        return f"mpiallreduce.Comm(handle={self.handle:#x}, algorithm={self._algorithm!r})"

    @property
    def algorithm(self) -> str:
        """The allreduce algorithm this communicator's collectives use."""
        return self._algorithm

    def _plain(self) -> MPI.Intracomm | None:
        """A plain mpi4py view of this communicator for mpiallreduce (None: MPI should decide).

        mpiallreduce's own native paths call ``Allreduce`` and friends on (a duplicate of) the
        communicator it gets; a plain view keeps those MPI's.
        """
        if self == MPI.COMM_NULL:
            return None  # MPI raises its own error for a null communicator
        view = self._view
        if view is None or view.handle != self.handle:
            # one object per handle: mpiallreduce caches plans by the communicator's identity
            view = self._view = MPI.Intracomm(self)
            self._calls.clear()
        return view

    def _adopt(self, comm):
        """Wrap a communicator made from this one with the same options."""
        if not isinstance(comm, MPI.Intracomm) or comm == MPI.COMM_NULL \
                or isinstance(comm, MPI.Topocomm):
            return comm
        return Comm(comm, self._algorithm, **self._settings)

    # -- collectives through mpiallreduce ------------------------------------------------------

    def Allreduce(self, sendbuf, recvbuf, op=MPI.SUM) -> None:
        """Reduce to all, as ``MPI.Intracomm.Allreduce``, with this communicator's algorithm.

        A call with the objects of an earlier call that went to ``mar.allreduce`` as they were
        (NumPy arrays, whole) goes there at once: one lookup by ``recvbuf``'s identity, and
        ``mar.allreduce``'s own plan cache (keyed by the same objects) hits.
        """
        entry = self._calls.get(id(recvbuf))
        try:
            if entry is not None and entry[1] is recvbuf and entry[0] is sendbuf \
                    and entry[2] is op and recvbuf.dtype is entry[3] and entry[4] == self.handle:
                if self._params:
                    allreduce(sendbuf, recvbuf, op, entry[5], *self._args,
                              **self._params_for(op, recvbuf))
                else:  # spelled out: a * or ** call costs more than the routing itself
                    allreduce(sendbuf, recvbuf, op, entry[5], entry[6], entry[7], entry[8],
                              entry[9])
                return None
            if type(recvbuf) is np.ndarray and recvbuf.dtype in _DTYPES \
                    and fresh_arrays(sendbuf, recvbuf) \
                    and _reducible(op, recvbuf.dtype) is not None:
                # plain NumPy arrays, C-contiguous, of the same shape: no spec to parse (a fresh
                # pair per call, as dot products are written, is known by its shape there)
                plain = self._view
                if plain is None or plain.handle != self.handle:
                    plain = self._plain()
                if plain is not None:
                    previous = self._previous
                    if previous[1] is recvbuf and previous[0] is sendbuf:
                        self._remember(sendbuf, recvbuf, op, plain)  # the same arrays again
                    else:
                        self._previous = (sendbuf, recvbuf)
                    allreduce(sendbuf, recvbuf, op, plain, *self._args,
                              **self._params_for(op, recvbuf))
                    return None
            route = self._route(lambda: self._reduction(sendbuf, recvbuf, op), op, "allreduce")
            if route is None:
                return super().Allreduce(sendbuf, recvbuf, op)
            plain, send, recv = route
            if _same_elements(recv, recvbuf) and (
                    sendbuf is MPI.IN_PLACE or (_same_elements(send, sendbuf)
                                                and sendbuf.shape == recvbuf.shape)):
                # whole arrays (Fortran order too): the objects themselves from now on
                self._remember(sendbuf, recvbuf, op, plain)
                allreduce(sendbuf, recvbuf, op, plain, *self._args,
                          **self._params_for(op, recvbuf))
                return None
            allreduce(MPI.IN_PLACE if send is None else send, recv, op, plain, *self._args,
                      **self._params_for(op, recv))
            return None
        except _Unviewable as agreed:
            _settle(agreed, None)
        return super().Allreduce(sendbuf, recvbuf, op)

    def _params_for(self, op, array) -> dict:
        """The keyword arguments of a routed call: ``reproducible`` only where it applies."""
        if self._reproducible and not covers(op, array.dtype):
            return self._exact
        return self._params

    def _remember(self, sendbuf, recvbuf, op, plain) -> None:
        """Keep an Allreduce routed with its own objects (they stay alive, so their ids stay
        theirs); a new element type of recvbuf or a new handle parses the call again."""
        calls = self._calls
        if len(calls) >= 64:
            calls.clear()
        calls[id(recvbuf)] = (sendbuf, recvbuf, op, recvbuf.dtype, self.handle, plain,
                              *self._args)

    def Iallreduce(self, sendbuf, recvbuf, op=MPI.SUM):
        """Start a reduce to all with :func:`mpiallreduce.iallreduce`; return a request to
        ``Wait``/``Test`` (mpi4py's request interface, not an ``MPI.Request``)."""
        try:
            entry = self._calls.get(id(recvbuf))
            if entry is not None and entry[1] is recvbuf and entry[0] is sendbuf \
                    and entry[2] is op and recvbuf.dtype is entry[3] and entry[4] == self.handle:
                return _Request(iallreduce(sendbuf, recvbuf, op, entry[5], *self._args,
                                           **self._params_for(op, recvbuf)))
            route = self._route(lambda: self._reduction(sendbuf, recvbuf, op), op, "iallreduce")
            if route is not None:
                plain, send, recv = route
                if _same_elements(recv, recvbuf) and (
                        sendbuf is MPI.IN_PLACE or (_same_elements(send, sendbuf)
                                                    and sendbuf.shape == recvbuf.shape)):
                    self._remember(sendbuf, recvbuf, op, plain)  # as Allreduce: the objects
                    send, recv = (None if sendbuf is MPI.IN_PLACE else sendbuf), recvbuf
                return _Request(iallreduce(MPI.IN_PLACE if send is None else send, recv, op,
                                           plain, *self._args, **self._params_for(op, recv)))
        except _Unviewable as agreed:
            _settle(agreed, None)
        return super().Iallreduce(sendbuf, recvbuf, op)

    def Allreduce_init(self, sendbuf, recvbuf, op=MPI.SUM, info=MPI.INFO_NULL):
        """Make a persistent reduce to all (a bound :func:`mpiallreduce.plan`): Start, Wait, Free.

        Algorithm ``"native"`` returns MPI's own persistent request.
        """
        if self._algorithm == "native":
            return super().Allreduce_init(sendbuf, recvbuf, op, info)
        try:
            route = self._route(lambda: self._reduction(sendbuf, recvbuf, op), op, "plan")
            if route is not None:
                plain, send, recv = route
                return _Persistent(plan(MPI.IN_PLACE if send is None else send, recv, op,
                                        plain, *self._args, **self._params_for(op, recv)))
        except _Unviewable as agreed:
            _settle(agreed, None)
        return super().Allreduce_init(sendbuf, recvbuf, op, info)

    def Reduce_scatter_block(self, sendbuf, recvbuf, op=MPI.SUM) -> None:
        """Reduce, then scatter equal blocks: rank r gets block r, as mpi4py's."""
        try:
            route = self._route(lambda: self._scatter(sendbuf, recvbuf, None, op, block=True),
                                op, "reduce_scatter")
            if route is not None:
                self._reduce_scatter(*route, op)
                return None
        except _Unviewable as agreed:
            _settle(agreed, None)
        return super().Reduce_scatter_block(sendbuf, recvbuf, op)

    def Reduce_scatter(self, sendbuf, recvbuf, recvcounts=None, op=MPI.SUM) -> None:
        """Reduce, then scatter blocks of ``recvcounts``: MPI's block layout goes through
        mpiallreduce (``partition.block``: the first n % p blocks one longer), others to MPI.

        ``recvcounts=None`` takes every rank's count from its ``recvbuf``, gathered as mpi4py
        gathers them (one ``Allgather``), so ranks may pass receive buffers of different sizes.
        """
        if recvcounts is None and sendbuf is not MPI.IN_PLACE:
            recvcounts = self._receive_counts(recvbuf)
            if recvcounts is None:
                return super().Reduce_scatter(sendbuf, recvbuf, None, op)
        try:
            route = self._route(
                lambda: self._scatter(sendbuf, recvbuf, recvcounts, op, block=False), op,
                "reduce_scatter")
            if route is not None:
                self._reduce_scatter(*route, op)
                return None
        except _Unviewable as agreed:
            _settle(agreed, None)
        return super().Reduce_scatter(sendbuf, recvbuf, recvcounts, op)

    def Allgather(self, sendbuf, recvbuf) -> None:
        """Gather to all: block r of ``recvbuf`` (p equal blocks) from rank r, as mpi4py's."""
        try:
            route = self._route(lambda: self._gather(sendbuf, recvbuf), None, "allgather")
            if route is not None:
                plain, send, recv = route
                allgather(MPI.IN_PLACE if send is None else send, recv, comm=plain,
                          algorithm=self._ag_algorithm, **self._related)
                return None
        except _Unviewable as agreed:
            _settle(agreed, None)
        return super().Allgather(sendbuf, recvbuf)

    # -- argument routing ----------------------------------------------------------------------

    def _route(self, parse, op, what: str):
        """Return ``parse()`` (the arguments mpiallreduce runs, or None: MPI runs the call).

        Where this rank cannot take its buffer (:class:`_Unviewable`) while the others may
        (the facts every rank shares, datatype and op, say mpiallreduce), it joins the
        agreement they run (``check=True``) with that as its bad input, so every rank learns
        it; then every rank goes to MPI, or raises where some rank's buffer is one mpi4py
        cannot read either (it would raise there and leave the others waiting in MPI).
        """
        try:
            return parse()
        except _Unviewable as exc:
            local = exc
        if not _might_route(local.dtype, op):
            return None  # the others go to MPI without agreeing, as the shared facts say
        plain = self._plain()
        if plain is None or not self._args[2]:
            return None

        def refuse(comm):
            raise local

        try:
            prepare(what, plain, True, refuse, timeout=self._args[3])
        except _Unviewable as agreed:
            _settle(agreed, local.probe)
        return None

    def _receive_counts(self, recvbuf) -> list[int] | None:
        """Every rank's receive count, gathered as mpi4py gathers them for ``recvcounts=None``;
        None where some rank's receive buffer is one mpiallreduce does not take (MPI runs)."""
        if self._plain() is None:
            return None
        probe = None
        try:
            recv = _message(recvbuf, writable=True)
            mine = -1 if recv is None else recv[0].size
        except _Unviewable as exc:
            probe = exc.probe
            mine = -1 if probe is None else -2  # -2: mpi4py cannot read it either
        counts = np.empty(self.Get_size(), dtype=np.int64)
        MPI.Intracomm.Allgather(self, np.array([mine], dtype=np.int64), counts)
        unreadable = counts == -2
        if unreadable.any() and not unreadable.all():
            # MPI would raise on those ranks and leave the others waiting: raise everywhere
            if probe is not None:
                raise probe
            ranks = np.flatnonzero(unreadable).tolist()
            raise BufferError(f"Reduce_scatter: mpi4py cannot read the receive buffer on "
                              f"{'rank' if len(ranks) == 1 else 'ranks'} "
                              f"{', '.join(map(str, ranks))}")
        return None if (counts < 0).any() else counts.tolist()

    def _reduction(self, sendbuf, recvbuf, op):
        """(plain comm, send or None, recv) for an allreduce mpiallreduce takes, else None."""
        pair = _pair(sendbuf, recvbuf)
        if pair is None or (pair[0] is not None and pair[0].size != pair[1].size):
            return None
        if _reducible(op, pair[1].dtype) is None:
            return None
        plain = self._plain()
        return None if plain is None else (plain, *pair)

    def _scatter(self, sendbuf, recvbuf, recvcounts, op, block: bool):
        """(plain, input, output, commutative) for a reduce-scatter in block layout, else None."""
        nranks, rank = self.Get_size(), self.Get_rank()
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
        recv = _message(recvbuf, writable=True, blocks=nranks if in_place and block else 1)
        if recv is None:
            return None
        recv, datatype = recv
        red = _reducible(op, recv.dtype)
        if red is None:
            return None
        if in_place:
            source = recv  # this rank's block of the result lands in front
        else:
            try:
                send = _message(sendbuf, writable=False, blocks=nranks if block else 1)
            except _Unviewable as exc:
                exc.dtype = recv.dtype
                raise
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
        if not in_place and source.size and recv.size \
                and np.may_share_memory(source, recv):
            return None
        plain = self._plain()
        if plain is None:
            return None
        if in_place:
            source = source.copy()  # reduce_scatter reads the whole input while writing block r
        return plain, source, recv[:counts[rank]], red.commutative

    def _reduce_scatter(self, plain, source, output, commutative, op) -> None:
        algorithm = self._rs_algorithm
        if not commutative and not self._rs_explicit:
            algorithm = "auto"  # the derived phases reorder operands; MPI keeps rank order
        reduce_scatter(source, output, op, comm=plain, algorithm=algorithm, **self._related)

    def _gather(self, sendbuf, recvbuf):
        recv = _message(recvbuf, writable=True, blocks=self.Get_size())
        if recv is None or recv[0].size % self.Get_size():
            return None
        recv, datatype = recv
        send = None
        if sendbuf is not MPI.IN_PLACE:
            try:
                parsed = _message(sendbuf, writable=False)
            except _Unviewable as exc:
                exc.dtype = recv.dtype
                raise
            if parsed is None or parsed[1] != datatype \
                    or parsed[0].size * self.Get_size() != recv.size:
                return None
            send = parsed[0]
            if send.size and np.may_share_memory(send, recv):
                return None
        plain = self._plain()
        return None if plain is None else (plain, send, recv)

    # -- communicators made from this one keep routing through mpiallreduce --------------------

    def Dup(self, info=None):
        return self._adopt(super().Dup(info))

    def Dup_with_info(self, info):
        return self._adopt(super().Dup_with_info(info))

    def Clone(self):
        return self._adopt(super().Clone())

    def Idup(self, info=None):
        comm, request = super().Idup(info)
        return self._adopt(comm), request

    def Idup_with_info(self, info):
        comm, request = super().Idup_with_info(info)
        return self._adopt(comm), request

    def Split(self, color=0, key=0):
        return self._adopt(super().Split(color, key))

    def Split_type(self, split_type, key=0, info=MPI.INFO_NULL):
        return self._adopt(super().Split_type(split_type, key, info))

    def Create(self, group):
        return self._adopt(super().Create(group))

    def Create_group(self, group, tag=0):
        return self._adopt(super().Create_group(group, tag))
