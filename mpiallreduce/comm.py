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
(``check=True``), so every rank goes to MPI together (``_buffers.Unviewable``);
``Reduce_scatter`` with ``recvcounts=None`` gathers the counts first, as mpi4py does.

Here: the class and its routing of each call. Reading mpi4py's buffer specs, and which datatypes
and ops mpiallreduce takes: :mod:`mpiallreduce._buffers`; the request objects ``Iallreduce`` and
``Allreduce_init`` return: :mod:`mpiallreduce._requests`.
"""

from __future__ import annotations

import time
import warnings
import weakref

import numpy as np
from mpi4py import MPI

from . import _form, _hooks
from ._agree import prepare
from ._buffers import (
    DTYPE_OF,
    DTYPE_SET,
    Unviewable,
    bare,
    gather,
    message,
    might_route,
    reducible,
    reduction,
    scatter,
    settle,
    whole,
)
from ._checks import Call, check_topology
from ._lru import LRU
from ._plans import fresh_arrays, shape_key
from ._requests import CommPrequest, CommRequest
from ._state import SHAPES, existing, fail_on
from ._waiting import MPI_CANNOT_SAY, wait_or_fail
from .api import ALGORITHMS, allgather, allreduce, iallreduce, plan, reduce_scatter
from .executor import MAX_MESSAGE
from .native_plan import NativePlan
from .ops import native_deviates
from .reproducible import covers
from .select import persistent_native

#: what the related collectives run for each allreduce algorithm: its own phases where it has
#: them, else "auto" (which is MPI's collective today).
_PARTS = {"ring": ("ring", "ring"), "ring_segmented": ("ring", "ring"),
          "rabenseifner": ("recursive_halving", "recursive_doubling"),
          "recursive_doubling": ("auto", "recursive_doubling"), "cascade": ("ring", "ring"),
          "native": ("native", "native")}


#: mpi4py's blocking collectives that a timeout covers through their non-blocking form (each
#: ``X`` runs as ``Ix`` polled to the deadline), and the pickle-based ones built on them
_WITH_DEADLINE = ("Barrier", "Bcast", "Gather", "Gatherv", "Scatter", "Scatterv", "Allgatherv",
                  "Alltoall", "Alltoallv", "Alltoallw", "Reduce", "Scan", "Exscan")
_OBJECTS_WITH_DEADLINE = ("barrier", "bcast", "allgather", "allreduce")
#: what a timeout cannot cover: mpi4py runs these with blocking calls of its own
_NO_DEADLINE = ("gather", "scatter", "alltoall", "reduce", "scan", "exscan", "the neighbourhood "
                "collectives", "point-to-point messages")

#: calls of a case (count, dtype, op) that ``Allreduce`` runs as MPI's own collective, after
#: the argument check, before it binds a plan for the case: a count called once (a test
#: suite calls hundreds so) costs no plan, and a count called again gets one (see Comm._first)
PLAN_AFTER = 1
#: cases a communicator counts; past them it forgets every count and remembered call at once
CASES = 4096
#: the algorithms whose first calls run MPI's collective: auto (its choice needs a plan) and
#: native (the same call either way)
_FIRST_NATIVE = ("auto", "native")


class _Cases:
    """A communicator's count of ``Allreduce`` calls per case (count, dtype, op) made through
    ``mar.Comm`` objects, up to :data:`PLAN_AFTER`, kept on the MPI communicator so that every
    ``mar.Comm`` of it counts together (ranks may call through different objects), and those
    objects, whose remembered calls go when the counts go (see ``Comm._first``)."""

    __slots__ = ("counts", "comms")

    def __init__(self):
        self.counts: dict = {}
        # id -> mar.Comm, held weakly (an mpi4py communicator has no hash of its own)
        self.comms = weakref.WeakValueDictionary()

    def forget(self) -> None:
        """Drop every count, and every remembered call of every ``mar.Comm`` of it."""
        self.counts.clear()
        for comm in list(self.comms.values()):
            comm._forget_calls()


#: the attribute of an MPI communicator that holds its :class:`_Cases`
_CASES_KEYVAL = MPI.Comm.Create_keyval()


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
            ``timeout`` apply to the related collectives too. ``timeout`` also covers mpi4py's
            own blocking collectives (``Barrier``, ``Bcast``, ``Gather(v)``, ``Scatter(v)``,
            ``Allgatherv``, ``Alltoall(v/w)``, ``Reduce``, ``Scan``, ``Exscan``: each runs as
            its non-blocking form waited to the deadline) and the pickled ``barrier``,
            ``bcast``, ``allgather`` and ``allreduce`` (mpi4py's allgather-then-reduce form,
            the same result); the other pickled collectives cannot honour it, and the
            constructor warns once that they wait as mpi4py's do.

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
        # id(recvbuf) -> an Allreduce routed as it came (see Allreduce); (id(dtype), size, in
        # place, id(op)) -> (Shape, op, the plain view it was found with, dtype: held, so its id
        # stays its own): each at most 64, least recently stored out first
        # (the hit paths read the dicts, ``_calls`` and ``_shapes``, the compiled one too)
        self._call_lru, self._shape_lru = LRU(64), LRU(64)
        self._calls, self._shapes = self._call_lru.entries, self._shape_lru.entries
        # Iallreduce's calls routed as they came, apart from Allreduce's: an entry there is
        # no proof that Allreduce's case has a plan (see _first)
        self._icall_lru = LRU(64)
        self._cases = None  # the communicator's _Cases, found on its first call
        self._first_native = (algorithm in _FIRST_NATIVE and not self._params
                              and self._args[3] is None and PLAN_AFTER > 0)
        # the last pair of arrays seen once (see Allreduce), updated in place: a list, whose
        # items cost less to set than an attribute of this object
        self._previous = [None, None]
        self._settings = dict(options, reduce_scatter_algorithm=reduce_scatter_algorithm,
                              allgather_algorithm=allgather_algorithm)
        if self._args[3] is not None:
            # Only with a timeout: a Comm without one runs mpi4py's methods with no extra frame
            for name in _WITH_DEADLINE:
                setattr(self, name, self._deadlined(name))
            for name in _OBJECTS_WITH_DEADLINE:
                setattr(self, name, getattr(self, f"_{name}_within"))
            global _warned
            if not _warned:
                _warned = True
                warnings.warn(f"mar.Comm(timeout=...): {', '.join(_NO_DEADLINE)} run as "
                              f"mpi4py's, with no deadline", stacklevel=2)

    # -- mpi4py's own collectives under this communicator's timeout ----------------------------

    def _mpi(self, name: str, *args):
        """Run mpi4py's collective ``name`` (what mpiallreduce hands to MPI): blocking, or with
        this communicator's timeout, its non-blocking form waited to the deadline."""
        timeout = self._args[3]
        if timeout is None:
            return getattr(MPI.Intracomm, name)(self, *args)
        return self._wait(name, timeout, getattr(MPI.Intracomm, _nonblocking(name))(self, *args))

    def _deadlined(self, name: str):
        def collective(*args, **kwargs):
            return self._wait(name, self._args[3],
                              getattr(MPI.Intracomm, _nonblocking(name))(self, *args, **kwargs))
        collective.__name__ = collective.__qualname__ = name
        collective.__doc__ = getattr(MPI.Intracomm, name).__doc__
        return collective

    def _wait(self, name: str, timeout: float, request: MPI.Request) -> None:
        """Wait for ``request`` up to ``timeout`` seconds; past it, CollectiveTimeout (and the
        communicator takes no more mpiallreduce calls: its messages may still be in flight)."""
        deadline = time.monotonic() + timeout
        plain = self._plain()
        wait_or_fail([request], deadline, lambda reason, pending: fail_on(plain, reason, pending),
                     lambda: (f"{name} on rank {self.Get_rank()}: MPI's collective did not "
                              f"complete within {timeout:g} s; some rank has not made this call "
                              f"({MPI_CANNOT_SAY})"))

    def _objects(self, obj, name: str) -> list:
        """Every rank's ``obj``, in rank order: pickled, then two allgathers under the
        deadline (mpi4py's naive form of its pickled collectives)."""
        data = np.frombuffer(MPI.pickle.dumps(obj), dtype=np.uint8)
        sizes = np.empty(self.Get_size(), dtype=np.int64)
        timeout = self._args[3]
        self._wait(name, timeout, MPI.Intracomm.Iallgather(
            self, [np.array([data.size], dtype=np.int64), MPI.INT64_T], [sizes, MPI.INT64_T]))
        offsets = np.concatenate(([0], np.cumsum(sizes)))
        gathered = np.empty(int(offsets[-1]), dtype=np.uint8)
        self._wait(name, timeout, MPI.Intracomm.Iallgatherv(
            self, [data, MPI.BYTE], [gathered, (sizes, offsets[:-1]), MPI.BYTE]))
        return [MPI.pickle.loads(gathered[start:stop].tobytes())
                for start, stop in zip(offsets[:-1], offsets[1:])]

    def _barrier_within(self) -> None:
        self._wait("barrier", self._args[3], MPI.Intracomm.Ibarrier(self))

    def _bcast_within(self, obj, root: int = 0):
        data = MPI.pickle.dumps(obj) if self.Get_rank() == root else b""
        size = np.array([len(data)], dtype=np.int64)
        self._wait("bcast", self._args[3], MPI.Intracomm.Ibcast(self, [size, MPI.INT64_T], root))
        buf = np.frombuffer(data, dtype=np.uint8) if self.Get_rank() == root \
            else np.empty(int(size[0]), dtype=np.uint8)
        self._wait("bcast", self._args[3], MPI.Intracomm.Ibcast(self, [buf, MPI.BYTE], root))
        return obj if self.Get_rank() == root else MPI.pickle.loads(buf.tobytes())

    def _allgather_within(self, sendobj) -> list:
        return self._objects(sendobj, "allgather")

    def _allreduce_within(self, sendobj, op=MPI.SUM):
        items = self._objects(sendobj, "allreduce")
        result = items[0]
        for item in items[1:]:
            result = op(result, item)
        return result

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
            self._forget_calls()
            self._cases = None
        return view

    def _forget_calls(self) -> None:
        """Drop every remembered call (see :meth:`_first`)."""
        self._call_lru.clear()
        self._shape_lru.clear()
        self._icall_lru.clear()

    def _cases_of(self, plain: MPI.Intracomm) -> _Cases:
        """The communicator's :class:`_Cases` (made on its first call), this object among its
        ``comms``."""
        cases = plain.Get_attr(_CASES_KEYVAL)
        if cases is None:
            cases = _Cases()
            plain.Set_attr(_CASES_KEYVAL, cases)
        cases.comms[id(self)] = self
        self._cases = cases
        return cases

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
        ``mar.allreduce``'s own plan cache (keyed by the same objects) hits. With ``auto`` or
        ``native``, the first call of a case (count, dtype, op) runs MPI's own collective after
        the argument check, and binds no plan (:meth:`_first`).
        """
        # _known's test, inline: the method call measured 8% of a repeated call's routing
        # (scripts/drop_in_cost.py --routing-only)
        entry = self._calls.get(id(recvbuf))
        try:
            if entry is not None and entry[1] is recvbuf and entry[0] is sendbuf \
                    and entry[2] is op and recvbuf.dtype is entry[3] and entry[4] == self:
                if self._params:
                    allreduce(sendbuf, recvbuf, op, entry[4], *self._args,
                              **self._params_for(op, recvbuf))
                else:  # spelled out: a * or ** call costs more than the routing itself
                    allreduce(sendbuf, recvbuf, op, entry[4], entry[5], entry[6], entry[7],
                              entry[8])
                return None
            if type(recvbuf) is np.ndarray:
                # a fresh pair of arrays per call, as dot products are written: the shape that
                # mar.allreduce found for an earlier call like it runs it on them at once
                known = self._shapes.get((id(recvbuf.dtype), recvbuf.size,
                                          sendbuf is MPI.IN_PLACE, id(op)))
                if known is not None and known[0].live and known[1] is op \
                        and known[2] == self and fresh_arrays(sendbuf, recvbuf):
                    previous = self._previous
                    if previous[1] is not recvbuf or previous[0] is not sendbuf:
                        previous[0], previous[1] = sendbuf, recvbuf
                        known[0].call(sendbuf, recvbuf, self._args[2])
                        return None
            if type(recvbuf) is np.ndarray and recvbuf.dtype in DTYPE_SET \
                    and fresh_arrays(sendbuf, recvbuf) \
                    and reducible(op, recvbuf.dtype) is not None:
                # plain NumPy arrays, C-contiguous, of the same shape: no spec to parse (a fresh
                # pair per call, as dot products are written, is known by its shape there)
                plain = self._view
                if plain is None or plain.handle != self.handle:
                    plain = self._plain()
                if plain is not None:
                    previous = self._previous
                    if self._first_native and self._first(sendbuf, recvbuf, op, plain):
                        previous[0], previous[1] = sendbuf, recvbuf
                        return None
                    if previous[1] is recvbuf and previous[0] is sendbuf:
                        self._remember(sendbuf, recvbuf, op, plain)  # the same arrays again
                    else:
                        previous[0], previous[1] = sendbuf, recvbuf
                    params = self._params_for(op, recvbuf)
                    allreduce(sendbuf, recvbuf, op, plain, *self._args, **params)
                    self._find_shape(sendbuf, recvbuf, op, plain, params)
                    return None
            route = self._route(lambda: self._with_plain(reduction(sendbuf, recvbuf, op)), op,
                                "allreduce")
            if route is None:
                return self._mpi("Allreduce", sendbuf, recvbuf, op)
            plain, send, recv = route
            if self._first_native \
                    and self._first(MPI.IN_PLACE if send is None else send, recv, op, plain):
                return None
            if whole(send, recv, sendbuf, recvbuf):
                # whole arrays (Fortran order too): the objects themselves from now on
                self._remember(sendbuf, recvbuf, op, plain)
                allreduce(sendbuf, recvbuf, op, plain, *self._args,
                          **self._params_for(op, recvbuf))
                return None
            send = MPI.IN_PLACE if send is None else send
            params = self._params_for(op, recv)
            allreduce(send, recv, op, plain, *self._args, **params)
            # a spec made per call (``[memory, count, datatype]``, as array libraries wrap their
            # tensors): the compiled form runs the next one like it by this shape
            self._find_shape(send, recv, op, plain, params)
            return None
        except Unviewable as agreed:
            settle(agreed, None)
        return self._mpi("Allreduce", sendbuf, recvbuf, op)

    def _first(self, sendbuf, recvbuf: np.ndarray, op, plain) -> bool:
        """Run a call of a case seen fewer than :data:`PLAN_AFTER` times before as MPI's own
        ``Allreduce``, after the argument check, and count it; False (nothing run): the case
        repeats, or MPI's result is not the one ``auto`` gives (8/16-bit sums Open MPI
        saturates), or the op is mpiallreduce's AVG or a user op: bind a plan as always.

        Every rank must take the same path for the same call: one rank binding a plan (its
        run may be a schedule's messages or shm's window) while another runs MPI's collective
        would hang or mix data. So the decision reads only facts the argument check makes
        every rank's: the case (count, dtype, op) and the communicator's count of earlier
        calls of that case (:class:`_Cases`), which every rank keeps alike:

        - every rank makes the same ``Allreduce`` calls on the communicator in the same order
          with the same case (MPI's rule, and the check's), through whichever ``mar.Comm``;
        - a call is counted only once it ran here, and a call that raises, raises on every
          rank (the check shares any rank's error), so no rank counts a call another does not;
        - the counts are dropped only all at once, at the same call everywhere (the call that
          brings a new case past :data:`CASES`), and with them every remembered call of every
          ``mar.Comm`` of the communicator (``_calls``, ``_shapes``);
        - a call finds a remembered call (``_calls``, ``_shapes``, or ``mar.allreduce``'s
          caches, which only a ``mar.Comm``'s own view reaches) without coming here only
          where it was remembered at a call that bound a plan, so only once its case's count
          reached PLAN_AFTER, which then holds on every rank.

        What each rank's caches hold (arrays reused on one rank, fresh on another, entries
        evicted) decides only how a case that has a plan finds it, never whether it has one.
        """
        reducer = reducible(op, recvbuf.dtype)
        dtype = recvbuf.dtype
        if reducer.index < 0 or reducer.average or (
                self._algorithm == "auto" and native_deviates(reducer.name, dtype)):
            return False
        case = (recvbuf.size, dtype.str, reducer.index)
        cases = self._cases or self._cases_of(plain)
        counts = cases.counts
        calls = counts.get(case, 0)
        if calls >= PLAN_AFTER:
            return False
        self._native(sendbuf, recvbuf, reducer, plain)
        if not calls and len(counts) >= CASES:
            cases.forget()
        counts[case] = calls + 1
        return True

    def _native(self, sendbuf, recvbuf: np.ndarray, reducer, plain) -> None:
        """The argument check (with ``check``: ``mar.allreduce``'s, so a mismatch raises the
        same error on every rank, whatever path the others' calls take), then MPI's
        ``Allreduce`` on mpiallreduce's duplicate of the communicator (a plan of its own where
        a trace records the run, or the count exceeds one MPI message)."""
        algorithm, topology, check = self._args[0], self._args[1], self._args[2]

        def checked(comm) -> Call:
            # the arrays passed Allreduce's own tests (fresh_arrays, or a parsed spec), which
            # are what _checks.allreduce_call would test of them: the topology is left
            check_topology(topology, comm)
            return Call(None if sendbuf is MPI.IN_PLACE else sendbuf, recvbuf, reducer,
                        algorithm, topology, comm)

        call = prepare("allreduce", plain, check, checked)
        if call.recv.size == 0:
            return
        state = existing(plain)
        if _hooks.tracer is None and call.recv.size <= MAX_MESSAGE:
            state.private.Allreduce(MPI.IN_PLACE if call.send is None else call.send, call.recv,
                                    call.reducer.mpi_op)
            return
        native = NativePlan(state.private, call.send, call.recv, call.reducer, state=state)
        try:
            native.run()
        finally:
            native.free()

    def _params_for(self, op, array) -> dict:
        """The keyword arguments of a routed call: ``reproducible`` only where it applies."""
        if self._reproducible and not covers(op, array.dtype):
            return self._exact
        return self._params

    def _known(self, sendbuf, recvbuf, op) -> tuple | None:
        """The entry :meth:`_remember` kept for an ``Iallreduce`` with these very objects, or
        None."""
        entry = self._icall_lru.entries.get(id(recvbuf))
        if entry is not None and entry[1] is recvbuf and entry[0] is sendbuf \
                and entry[2] is op and recvbuf.dtype is entry[3] and entry[4] == self:
            return entry
        return None

    def _find_shape(self, sendbuf, recvbuf, op, plain, params: dict) -> None:
        """Keep the shape mar.allreduce remembered for this call (fresh arrays), if any: the
        next call like it, without a timeout, runs it directly (``_plans.Shape.call``), and
        the shape's ``live`` tells when the call cache has dropped it."""
        if self._args[3] is not None:
            return
        try:
            shape = SHAPES.get(shape_key(plain, sendbuf, recvbuf, op, self._algorithm,
                                         self._args[1], params))
        except TypeError:  # a parameter value that cannot be hashed: mar.allreduce kept none
            return
        if shape is not None:
            self._shape_lru.put((id(recvbuf.dtype), recvbuf.size, sendbuf is MPI.IN_PLACE,
                                 id(op)), (shape, op, plain, recvbuf.dtype))

    def _remember(self, sendbuf, recvbuf, op, plain, calls: LRU | None = None) -> None:
        """Keep an Allreduce (into ``calls``: an Iallreduce) routed with its own objects (they
        stay alive, so their ids stay theirs); a new element type of recvbuf or a new handle
        parses the call again (the entry holds the plain view it was routed with, whose handle
        was this communicator's: ``view == self`` compares the handles without making a
        Python int of each)."""
        (self._call_lru if calls is None else calls).put(
            id(recvbuf), (sendbuf, recvbuf, op, recvbuf.dtype, plain, *self._args))

    def Iallreduce(self, sendbuf, recvbuf, op=MPI.SUM):
        """Start a reduce to all with :func:`mpiallreduce.iallreduce`; return a request to
        ``Wait``/``Test`` (mpi4py's request interface, not an ``MPI.Request``)."""
        try:
            entry = self._known(sendbuf, recvbuf, op)
            if entry is not None:
                return CommRequest(iallreduce(sendbuf, recvbuf, op, entry[4], *self._args,
                                              **self._params_for(op, recvbuf)))
            route = self._route(lambda: self._with_plain(reduction(sendbuf, recvbuf, op)), op,
                                "iallreduce")
            if route is not None:
                plain, send, recv = route
                if whole(send, recv, sendbuf, recvbuf):
                    # as Allreduce: the objects
                    self._remember(sendbuf, recvbuf, op, plain, self._icall_lru)
                    send, recv = (None if sendbuf is MPI.IN_PLACE else sendbuf), recvbuf
                return CommRequest(iallreduce(MPI.IN_PLACE if send is None else send, recv, op,
                                              plain, *self._args, **self._params_for(op, recv)))
        except Unviewable as agreed:
            settle(agreed, None)
        return super().Iallreduce(sendbuf, recvbuf, op)

    def Allreduce_init(self, sendbuf, recvbuf, op=MPI.SUM, info=MPI.INFO_NULL):
        """Make a persistent reduce to all (a bound :func:`mpiallreduce.plan`): Start, Wait, Free.

        Algorithm ``"native"`` returns MPI's own persistent request, and so does ``"auto"``
        where it would run ``shm`` on a small message and MPI's request measured faster
        (:func:`.select.persistent_native`; after the plan's argument check, so bad input
        still raises on every rank).
        """
        if self._algorithm == "native":
            return super().Allreduce_init(sendbuf, recvbuf, op, info)
        try:
            route = self._route(lambda: self._with_plain(reduction(sendbuf, recvbuf, op)), op,
                                "plan")
            if route is not None:
                plain, send, recv = route
                params = self._params_for(op, recv)
                bound = plan(MPI.IN_PLACE if send is None else send, recv, op, plain,
                             *self._args, **params)
                if self._native_persistent(bound, op, recv, params):
                    bound.free()
                    return super().Allreduce_init(sendbuf, recvbuf, op, info)
                return CommPrequest(bound)
        except Unviewable as agreed:
            settle(agreed, None)
        return super().Allreduce_init(sendbuf, recvbuf, op, info)

    def _native_persistent(self, bound, op, recv: np.ndarray, params: dict) -> bool:
        """Should ``Allreduce_init`` hand back MPI's own request instead of ``bound``? Decided
        from what every rank agreed: ``auto`` chose ``shm``, no timeout (MPI's request cannot
        keep one), not reproducible, an MPI op whose native result is C's (not 8/16-bit sums
        that Open MPI saturates), and a size where MPI's request measured faster."""
        return (self._algorithm == "auto" and bound.algorithm == "shm"
                and self._args[3] is None and not params.get("reproducible")
                and isinstance(op, MPI.Op) and op != MPI.OP_NULL
                and not native_deviates(bound.reducer.name, recv.dtype)
                and persistent_native(self.Get_size(), recv.nbytes))

    def Reduce_scatter_block(self, sendbuf, recvbuf, op=MPI.SUM) -> None:
        """Reduce, then scatter equal blocks: rank r gets block r, as mpi4py's."""
        if self._scatter_routed(sendbuf, recvbuf, None, op, block=True):
            return None
        return self._mpi("Reduce_scatter_block", sendbuf, recvbuf, op)

    def Reduce_scatter(self, sendbuf, recvbuf, recvcounts=None, op=MPI.SUM) -> None:
        """Reduce, then scatter blocks of ``recvcounts``: MPI's block layout goes through
        mpiallreduce (``partition.block``: the first n % p blocks one longer), others to MPI.

        ``recvcounts=None`` takes every rank's count from its ``recvbuf``, gathered as mpi4py
        gathers them (one ``Allgather``), so ranks may pass receive buffers of different sizes.
        """
        if recvcounts is None and sendbuf is not MPI.IN_PLACE:
            recvcounts = self._receive_counts(recvbuf)
            if recvcounts is None:
                return self._mpi("Reduce_scatter", sendbuf, recvbuf, None, op)
        if self._scatter_routed(sendbuf, recvbuf, recvcounts, op, block=False):
            return None
        return self._mpi("Reduce_scatter", sendbuf, recvbuf, recvcounts, op)

    def _scatter_routed(self, sendbuf, recvbuf, recvcounts, op, block: bool) -> bool:
        """Run a reduce-scatter through mpiallreduce where it takes it; False: MPI runs it."""
        try:
            route = self._route(
                lambda: self._with_plain(scatter(sendbuf, recvbuf, recvcounts, op, self.Get_size(),
                                                 self.Get_rank(), block=block)),
                op, "reduce_scatter")
            if route is not None:
                self._reduce_scatter(*route, op)
                return True
        except Unviewable as agreed:
            settle(agreed, None)
        return False

    def Allgather(self, sendbuf, recvbuf) -> None:
        """Gather to all: block r of ``recvbuf`` (p equal blocks) from rank r, as mpi4py's."""
        try:
            route = self._route(lambda: self._with_plain(gather(sendbuf, recvbuf, self.Get_size())),
                                None, "allgather")
            if route is not None:
                plain, send, recv = route
                allgather(MPI.IN_PLACE if send is None else send, recv, comm=plain,
                          algorithm=self._ag_algorithm, **self._related)
                return None
        except Unviewable as agreed:
            settle(agreed, None)
        return self._mpi("Allgather", sendbuf, recvbuf)

    # -- argument routing ----------------------------------------------------------------------

    def _route(self, parse, op, what: str):
        """Return ``parse()`` (the arguments mpiallreduce runs, or None: MPI runs the call).

        Where this rank cannot take its buffer (:class:`Unviewable`) while the others may
        (the facts every rank shares, datatype and op, say mpiallreduce), it joins the
        agreement they run (``check=True``) with that as its bad input, so every rank learns
        it; then every rank goes to MPI, or raises where some rank's buffer is one mpi4py
        cannot read either (it would raise there and leave the others waiting in MPI).
        """
        try:
            return parse()
        except Unviewable as exc:
            local = bare(exc)  # kept past the except clause: no traceback (a frame cycle)
        if not might_route(local.dtype, op):
            return None  # the others go to MPI without agreeing, as the shared facts say
        plain = self._plain()
        if plain is None or not self._args[2]:
            return None

        def refuse(comm):
            raise local

        try:
            prepare(what, plain, True, refuse, timeout=self._args[3])
        except Unviewable as agreed:
            settle(agreed, local.probe)
        finally:
            local = None  # raised again above, it holds these frames (and refuse's cell) again
        return None

    def _receive_counts(self, recvbuf) -> list[int] | None:
        """Every rank's receive count, gathered as mpi4py gathers them for ``recvcounts=None``;
        None where some rank's receive buffer is one mpiallreduce does not take (MPI runs)."""
        if self._plain() is None:
            return None
        probe = None
        try:
            recv = message(recvbuf, writable=True)
            mine = -1 if recv is None else recv[0].size
        except Unviewable as exc:
            probe = exc.probe
            mine = -1 if probe is None else -2  # -2: mpi4py cannot read it either
        counts = np.empty(self.Get_size(), dtype=np.int64)
        self._mpi("Allgather", np.array([mine], dtype=np.int64), counts)
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

    def _with_plain(self, parsed):
        """``(plain view, *parsed)``: the arguments mpiallreduce runs; None (nothing parsed, or no
        plain view): MPI runs the call."""
        if parsed is None:
            return None
        plain = self._plain()
        return None if plain is None else (plain, *parsed)

    def _reduce_scatter(self, plain, source, output, commutative, op) -> None:
        algorithm = self._rs_algorithm
        if not commutative and not self._rs_explicit:
            algorithm = "auto"  # the derived phases reorder operands; MPI keeps rank order
        reduce_scatter(source, output, op, comm=plain, algorithm=algorithm, **self._related)

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


_warned = False  # the constructor's warning about collectives a timeout cannot cover: once


if _form.compiled is not None:
    # the compiled twin of Allreduce's first branch (a call with the objects of an earlier one,
    # the one repeated in a solver's loop): no Python frame between the caller and the run
    _form.compiled.install_comm(Comm.Allreduce, Unviewable, settle, DTYPE_OF)
    _form.compiled.comm_allreduce.__doc__ = Comm.Allreduce.__doc__
    _form.compiled.comm_allreduce.__wrapped__ = Comm.Allreduce
    Comm.Allreduce = _form.compiled.comm_allreduce


def _nonblocking(name: str) -> str:
    """The name of mpi4py's non-blocking form of collective ``name`` (``Bcast`` -> ``Ibcast``)."""
    return "I" + name[0].lower() + name[1:]
