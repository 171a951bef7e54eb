"""Public entry points: argument checks, cross-rank agreement, dispatch to a Plan."""

from __future__ import annotations

import time
import zlib
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np
from mpi4py import MPI

from . import algorithms, select
from .errors import CollectiveTimeout
from .executor import Layout, NativePlan, Plan, check_timeout, poll, scratch_size
from .ops import DTYPES, OP_NAMES, Reducer, reducer
from .partition import block, block_counts
from .topology import Topology

#: every name ``algorithm=`` accepts.
ALGORITHMS: tuple[str, ...] = tuple(algorithms.REGISTRY) + ("native", "auto")
#: the names each related collective's ``algorithm=`` accepts ("auto" means "native" for now).
COLLECTIVE_ALGORITHMS: dict[str, tuple[str, ...]] = {
    collective: tuple(registry) + ("native", "auto")
    for collective, registry in algorithms.COLLECTIVES.items()}
_NO_OP = -3  # op field of collectives that combine nothing

_UNKNOWN = -9  # signature field a rank could not determine (its own input was bad)


# -- per-communicator state: a private duplicate, attached as an MPI attribute ------------------

@dataclass
class _CommState:
    """What mpiallreduce keeps per user communicator: a private Dup, reusable scratch, and
    the communicator's topology once an algorithm has needed it.

    ``broken`` is set when a collective on it timed out: messages of that call may still be in
    flight on the private Dup and would match a later call's, so later calls refuse to run.
    ``stale`` keeps the requests abandoned then (MPI cannot cancel a collective one).
    """

    private: MPI.Intracomm
    scratch: dict = field(default_factory=dict)
    topology: Topology | None = None
    broken: str | None = None
    stale: list = field(default_factory=list)

    def default_topology(self) -> Topology:
        """Return ``Topology.from_comm`` of the communicator (collective the first time only)."""
        if self.topology is None:
            self.topology = Topology.from_comm(self.private)
        return self.topology

    def mark_broken(self, reason: str, pending=()) -> None:
        self.broken = reason
        self.stale.extend(pending)

    def scratch_for(self, dtype: np.dtype, size: int) -> np.ndarray:
        buf = self.scratch.get(dtype)
        if buf is None or buf.size < size:
            buf = self.scratch[dtype] = np.empty(max(size, 1), dtype=dtype)
        return buf


def _delete_state(comm, keyval, state) -> None:
    if not MPI.Is_finalized():
        state.private.Free()


_KEYVAL = MPI.Comm.Create_keyval(delete_fn=_delete_state)


def _state(comm: MPI.Intracomm) -> _CommState:
    """Return comm's state, duplicating it on first use (collective, like MPI_Comm_dup)."""
    state = comm.Get_attr(_KEYVAL)
    if state is None:
        state = _CommState(comm.Dup())
        comm.Set_attr(_KEYVAL, state)
    return state


# -- local checks ----------------------------------------------------------------------------------

def _check_comm(comm, what: str = "mpiallreduce") -> None:
    if not isinstance(comm, MPI.Comm):
        raise TypeError(f"comm must be an mpi4py communicator, got {type(comm).__name__}")
    if comm == MPI.COMM_NULL:
        raise ValueError("comm is MPI.COMM_NULL (a freed or null communicator)")
    if comm.Is_inter():
        raise TypeError("comm is an intercommunicator; mpiallreduce needs an intracommunicator")
    state = comm.Get_attr(_KEYVAL)
    if state is not None and state.broken:
        raise ValueError(f"{what}: an earlier collective on this communicator timed out "
                         f"({state.broken}); its messages may still be in flight, so this "
                         f"communicator cannot carry more mpiallreduce calls (free it, or Abort)")


def _as_array(obj, name: str, writable: bool) -> np.ndarray:
    """View ``obj`` as a NumPy array without copying; raise for anything we cannot use."""
    if isinstance(obj, np.ndarray):
        array = obj
    elif hasattr(obj, "__dlpack__"):
        try:
            array = np.from_dlpack(obj)
        except (BufferError, RuntimeError, TypeError, ValueError) as exc:
            raise TypeError(f"{name}: cannot view this DLPack object on the CPU ({exc})") from None
    else:
        try:
            array = np.asarray(memoryview(obj))
        except (TypeError, BufferError):
            raise TypeError(f"{name} must be a NumPy array or expose the buffer protocol, "
                            f"got {type(obj).__name__}") from None
    if not array.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous (got strides {array.strides}); "
                         f"pass np.ascontiguousarray({name})")
    if writable and not array.flags.writeable:
        raise ValueError(f"{name} is read-only; the result needs a writable buffer")
    if array.dtype not in DTYPES:
        raise TypeError(f"{name} has dtype {array.dtype}, which has no predefined MPI datatype "
                        f"here; use one of {', '.join(d.name for d in DTYPES)}")
    return array


def _check_algorithm(name, red: Reducer | None, collective: str = "allreduce") -> None:
    names = COLLECTIVE_ALGORITHMS[collective]
    if not isinstance(name, str) or name not in names:
        what = "algorithm" if collective == "allreduce" else f"{collective} algorithm"
        raise ValueError(f"unknown {what} {name!r}; choose one of {', '.join(names)}")
    if name in ("native", "auto") or red is None or red.commutative:
        return
    registry = algorithms.COLLECTIVES[collective]
    if registry[name].commutative_only:
        keep = [n for n, a in registry.items() if not a.commutative_only]
        raise ValueError(f"algorithm {name!r} reorders operands and needs a commutative op; "
                         f"for a non-commutative op use one of {', '.join(keep + ['native'])}")


def _check_params(name: str, params: dict, collective: str = "allreduce") -> None:
    """Raise TypeError for builder parameters the chosen algorithm does not take."""
    if not params:
        return
    accepted = ([] if name in ("native", "auto") else
                [k for k in algorithms.get(name, collective).params
                 if k not in ("itemsize", "root", "ordered")])
    unknown = sorted(set(params) - set(accepted))
    if unknown:
        takes = f"takes {', '.join(accepted)}" if accepted else "takes no parameters"
        raise TypeError(f"algorithm {name!r} got unexpected parameter(s) {', '.join(unknown)}; "
                        f"it {takes}")


@dataclass
class _Call:
    """A checked collective call: buffers, op, and everything needed to build its plan."""

    send: np.ndarray | None  # None: in place
    recv: np.ndarray
    reducer: Reducer | None  # None: a collective that combines nothing
    algorithm: str  # as requested ("auto" not yet resolved)
    topology: object
    comm: MPI.Intracomm
    params: dict = field(default_factory=dict)
    collective: str = "allreduce"
    count: int | None = None  # elements of the whole vector, when not recv.size
    root: int = 0

    @property
    def signature(self) -> list[int]:
        count = self.recv.size if self.count is None else self.count
        op = _NO_OP if self.reducer is None else self.reducer.index
        params = zlib.crc32(repr(sorted(self.params.items())).encode()) & 0x7FFFFFFF
        # a topology that differs between ranks gives mismatched schedules: a hang
        topology = (-1 if self.topology is None
                    else zlib.crc32(repr(self.topology.levels).encode()) & 0x7FFFFFFF)
        return [0, count, DTYPES.index(self.recv.dtype), op,
                COLLECTIVE_ALGORITHMS[self.collective].index(self.algorithm), self.root, params,
                topology]


def _local_checks(sendbuf, recvbuf, op, comm, algorithm, topology, params=None) -> _Call:
    if sendbuf is MPI.IN_PLACE:
        if recvbuf is None:
            raise ValueError("sendbuf is MPI.IN_PLACE, so recvbuf must hold the input and result")
        recv = _as_array(recvbuf, "recvbuf", writable=True)
        send = None
    else:
        send = _as_array(sendbuf, "sendbuf", writable=False)
        if recvbuf is None:
            recv = np.empty_like(send)
        else:
            recv = _as_array(recvbuf, "recvbuf", writable=True)
            if recv.dtype != send.dtype:
                raise TypeError(f"recvbuf has dtype {recv.dtype} but sendbuf has {send.dtype}; "
                                f"they must match")
            if recv.shape != send.shape:
                raise ValueError(f"recvbuf has shape {recv.shape} but sendbuf has {send.shape}; "
                                 f"they must match")
            if send.size and np.may_share_memory(send, recv):
                raise ValueError("sendbuf and recvbuf overlap; pass MPI.IN_PLACE as sendbuf "
                                 "to reduce in place")
    red = reducer(op, recv.dtype)
    _check_algorithm(algorithm, red)
    if topology is not None:
        if not isinstance(topology, Topology):
            raise TypeError(f"topology must be a mpiallreduce Topology (Topology.from_comm, "
                            f"Topology.simulated, Topology.from_nodes), got "
                            f"{type(topology).__name__}")
        topology.check_size(comm.Get_size())
    _check_params(algorithm, params or {})
    return _Call(send, recv, red, algorithm, topology, comm, dict(params or {}))


def _describe(field_name: str, value: int, names: tuple[str, ...] = ALGORITHMS) -> str:
    if value == _UNKNOWN:
        return "unknown (bad input)"
    if field_name == "dtype":
        return DTYPES[value].name
    if field_name == "op":
        return {-1: "a commutative user op", -2: "a non-commutative user op"}.get(
            value, OP_NAMES[value] if 0 <= value < len(OP_NAMES) else str(value))
    if field_name == "algorithm":
        return names[value]
    if field_name == "algorithm parameters":
        return f"parameters with checksum {value}"
    if field_name == "topology":
        return "no topology" if value == -1 else f"a topology with checksum {value}"
    if field_name == "timeout":
        return "a timeout" if value else "no timeout"
    return str(value)


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


#: what the ranks agree on: a bad-input flag, then the fields every rank must pass alike
#: (whether a timeout is set decides between blocking and non-blocking native collectives,
#: which MPI never matches with each other).
_FIELDS = ("", "count", "dtype", "op", "algorithm", "root", "algorithm parameters", "topology",
           "timeout")


def _gather_signatures(state: _CommState, what: str, mine: np.ndarray,
                       timeout: float | None) -> np.ndarray:
    """Allgather every rank's signature on the private Dup, within ``timeout`` if one is set."""
    private = state.private
    table = np.empty((private.Get_size(), mine.size), dtype=np.int64)
    request = private.Iallgather(mine, table)  # never blocking: every rank must call the same kind
    if timeout is None:
        request.Wait()
    elif not poll([request], time.monotonic() + timeout):
        reason = (f"{what} on rank {private.Get_rank()}: the argument check did not complete "
                  f"within {timeout:g} s; some rank of the communicator has not made this "
                  f"call (no data has moved yet)")
        state.mark_broken(reason, [request])
        raise CollectiveTimeout(reason)
    return table


def _agree(state: _CommState, what: str, signature: list[int], error: Exception | None,
           names: tuple[str, ...] = ALGORITHMS, timeout: float | None = None) -> None:
    """Raise the same exception on every rank if any rank's input was bad or ranks disagree."""
    table = _gather_signatures(state, what, np.array(signature, dtype=np.int64), timeout)
    failed = [int(r) for r in np.flatnonzero(table[:, 0])]
    if failed:
        # every rank got past the Iallgather, so this second collective cannot hang
        reports = state.private.allgather(None if error is None else (type(error), str(error)))
        if error is not None and len(failed) == len(reports) and len(set(reports)) == 1:
            raise error  # the same bad input everywhere: the plain local message
        groups: dict[tuple, list[int]] = {}
        for rank in failed:
            groups.setdefault(reports[rank], []).append(rank)
        kind = reports[failed[0]][0]
        raise kind(f"{what}: bad input on " + "; ".join(
            f"{_ranks(ranks)}: {message}" for (_, message), ranks in groups.items())) from error
    problems = []
    for column, name in enumerate(_FIELDS):
        if column == 0 or (table[:, column] == table[0, column]).all():
            continue
        groups = {}
        for rank, value in enumerate(table[:, column]):
            groups.setdefault(int(value), []).append(rank)
        problems.append(f"{name} differs: " + "; ".join(
            f"{_describe(name, value, names)} on {_ranks(ranks)}"
            for value, ranks in groups.items()))
    if problems:
        raise ValueError(f"{what} called with different arguments on different ranks: "
                         + "; ".join(problems))


def _prepare(what, comm, check, local_checks, collective="allreduce", timeout=None) -> _Call:
    """Run ``local_checks(comm)`` and, with ``check``, the cross-rank agreement."""
    comm = MPI.COMM_WORLD if comm is None else comm
    _check_comm(comm, what)
    if not check:
        check_timeout(timeout)
        call = local_checks(comm)
        _state(comm)
        return call
    call = error = bound = None
    try:
        check_timeout(timeout)
        bound = timeout  # the check itself keeps to a valid timeout, even if other input is bad
        call = local_checks(comm)
        signature = call.signature + [timeout is not None]
    except (TypeError, ValueError) as exc:
        error, signature = exc, [1] + [_UNKNOWN] * (len(_FIELDS) - 1)
    _agree(_state(comm), what, signature, error, COLLECTIVE_ALGORITHMS[collective], bound)
    return call


@lru_cache(maxsize=256)
def _steps(name: str, rank: int, nranks: int, count: int, topology, params: tuple = (),
           collective: str = "allreduce"):
    algorithm = algorithms.get(name, collective)
    return algorithm.steps(rank, nranks, count, topology=topology,
                           **{**algorithm.params, **dict(params)})


def _builder_params(name: str, call: _Call, collective: str = "allreduce") -> tuple:
    """The builder parameters of a call: the user's, plus the dtype's itemsize and whether rank
    order must be kept, where the builder takes them."""
    params = dict(call.params)
    accepted = algorithms.get(name, collective).params
    if "itemsize" in accepted:
        params["itemsize"] = call.recv.itemsize
    if "ordered" in accepted:
        # an algorithm that keeps rank order only in some cases is told whether it must;
        # it raises ValueError (identically on every rank, before any message) when it cannot
        params["ordered"] = call.reducer is not None and not call.reducer.commutative
    return tuple(sorted(params.items()))


def _build(call: _Call, persistent: bool, timeout: float | None) -> Plan:
    state = _state(call.comm)
    private = state.private
    nranks, rank = private.Get_size(), private.Get_rank()
    name = call.algorithm
    if name == "auto":
        name = select.choose(nranks, call.recv.nbytes, call.reducer, call.topology)
    if name == "native":
        return NativePlan(private, call.send, call.recv, call.reducer, timeout=timeout,
                          on_timeout=state.mark_broken)
    algorithm = algorithms.get(name)
    topology = call.topology
    if algorithm.uses_topology and topology is None:
        # Every rank reaches this point for the same algorithm, so from_comm's collectives match.
        topology = state.default_topology()
    steps = _steps(name, rank, nranks, call.recv.size, topology, _builder_params(name, call))
    scratch = None
    if not persistent:
        scratch = state.scratch_for(call.recv.dtype, scratch_size(steps))
    return Plan(private, steps, call.send, call.recv, call.reducer, name,
                persistent=persistent, scratch=scratch, timeout=timeout,
                on_timeout=state.mark_broken)


# -- public functions -------------------------------------------------------------------------------

def allreduce(sendbuf, recvbuf=None, op=MPI.SUM, comm=None, algorithm="auto", topology=None,
              check=True, timeout=None, **params):
    """Combine ``sendbuf`` from every rank with ``op`` and return the result on every rank.

    A drop-in for ``comm.Allreduce(sendbuf, recvbuf, op)`` that runs one of mpiallreduce's
    schedules (or MPI's own, ``algorithm="native"``).

    Args:
        sendbuf: C-contiguous array (or buffer-protocol / CPU DLPack object), or ``MPI.IN_PLACE``.
        recvbuf: result array of the same shape and dtype; ``None`` allocates one. In place, it
            holds the input and receives the result.
        op: a predefined ``MPI.Op`` valid for the dtype, ``mpiallreduce.AVG``, or a user op from
            ``MPI.Op.Create`` (non-commutative ones keep MPI's rank order).
        comm: any intracommunicator (default ``MPI.COMM_WORLD``).
        algorithm: one of ``ALGORITHMS``; ``"auto"`` picks by size, op and topology.
        topology: a ``Topology`` for ``hierarchical``/``cascade`` (default:
            ``Topology.from_comm(comm)``, computed once per communicator, which honours
            ``MPIALLREDUCE_RANKS_PER_NODE``). Its size must be the communicator's.
        check: agree on count, dtype, op, algorithm, parameters, topology and whether a
            timeout is set across ranks
            first (one small ``Iallgather``) so a mismatch raises the same ValueError
            everywhere instead of hanging.
        timeout: seconds before :class:`CollectiveTimeout` (default: wait forever); give it
            on every rank or none. After a timeout, mpiallreduce refuses further calls on
            ``comm`` on the ranks that timed out (stale messages may be in flight).
        params: parameters of the named algorithm's schedule, e.g. ``segment_bytes=`` for
            ``ring_segmented``; a parameter the algorithm does not take is a TypeError.

    Returns:
        The result array (``recvbuf`` when given).
    """
    call = _prepare("allreduce", comm, check, lambda comm: _local_checks(
        sendbuf, recvbuf, op, comm, algorithm, topology, params), timeout=timeout)
    if call.recv.size == 0:
        return call.recv
    return _build(call, persistent=False, timeout=timeout).run()


def plan(sendbuf, recvbuf=None, op=MPI.SUM, comm=None, algorithm="auto", topology=None,
         check=True, timeout=None, **params) -> Plan:
    """Bind an allreduce to its buffers once; ``run()`` repeats it with no allocation.

    Arguments as :func:`allreduce`. The cross-rank ``check`` runs once, here; ``run()`` trusts
    the buffers' contents and shapes thereafter. Use as a context manager or call ``free()``.
    """
    call = _prepare("plan", comm, check, lambda comm: _local_checks(
        sendbuf, recvbuf, op, comm, algorithm, topology, params), timeout=timeout)
    return _build(call, persistent=True, timeout=timeout)


# -- related collectives: the same phase builders and executor -------------------------------------

def _matching_recv(recvbuf, send: np.ndarray, size: int, what: str) -> np.ndarray:
    """Return recvbuf checked against ``send``'s dtype and the ``size`` it must have (or a new one)."""
    if recvbuf is None:
        return np.empty(size, dtype=send.dtype)
    recv = _as_array(recvbuf, "recvbuf", writable=True)
    if recv.dtype != send.dtype:
        raise TypeError(f"recvbuf has dtype {recv.dtype} but sendbuf has {send.dtype}; "
                        f"they must match")
    if recv.size != size:
        raise ValueError(f"recvbuf has {recv.size} elements; {what} needs {size}")
    if size and np.may_share_memory(send, recv):
        raise ValueError("sendbuf and recvbuf overlap; pass separate buffers")
    return recv


def _no_in_place(sendbuf, what: str) -> None:
    if sendbuf is MPI.IN_PLACE:
        raise ValueError(f"{what} does not take MPI.IN_PLACE; pass sendbuf and recvbuf")


def _run(call: _Call, count: int, layout: Layout, native, timeout) -> np.ndarray:
    """Run a related collective: MPI's own (``native``) or a schedule through a Plan.

    ``native(private, nonblocking)`` calls MPI's collective, or starts its non-blocking form
    and returns the request (when a timeout is set).

    ``auto`` means ``native`` for these collectives, for the reason given in :mod:`.select`.
    """
    state = _state(call.comm)
    private = state.private
    result = call.recv.reshape(-1)
    if call.algorithm in ("native", "auto"):
        if count and timeout is None:
            native(private, False)
        elif count:
            # non-blocking and polled; the check agreed that every rank has a timeout, since
            # MPI never matches a blocking collective with a non-blocking one
            request = native(private, True)
            if not poll([request], time.monotonic() + timeout):
                reason = (f"native {call.collective} on rank {private.Get_rank()}: not complete "
                          f"within {timeout:g} s (MPI does not say which rank is missing)")
                state.mark_broken(reason, [request])
                raise CollectiveTimeout(reason)
        if count and call.reducer is not None and call.reducer.average:
            np.divide(result, private.Get_size(), out=result)
        return call.recv
    if count == 0:
        return call.recv
    steps = _steps(call.algorithm, private.Get_rank(), private.Get_size(), count, None,
                   _builder_params(call.algorithm, call, call.collective) + (
                       (("root", call.root),) if call.collective == "bcast" else ()),
                   call.collective)
    scratch = state.scratch_for(call.recv.dtype, scratch_size(steps))
    return Plan(private, steps, call.send, call.recv, call.reducer,
                f"{call.collective} {call.algorithm}", persistent=False, scratch=scratch,
                timeout=timeout, layout=layout, on_timeout=state.mark_broken).run()


def reduce_scatter(sendbuf, recvbuf=None, op=MPI.SUM, comm=None, algorithm="auto", check=True,
                   timeout=None):
    """Combine the full vector ``sendbuf`` across ranks; rank r gets block r of the result.

    Blocks follow :func:`mpiallreduce.partition.block` (the first ``n % p`` blocks one element
    longer), as ``comm.Reduce_scatter(sendbuf, recvbuf, block_counts(n, p), op)``.

    Args:
        sendbuf: this rank's full vector of n elements (any C-contiguous shape; read flat).
        recvbuf: this rank's block, ``block(n, p, rank)`` in size; ``None`` allocates it (1-D).
        op, comm, check, timeout: as for :func:`allreduce`.
        algorithm: ``"ring"``, ``"recursive_halving"`` (both commutative ops only),
            ``"native"`` or ``"auto"``.

    Returns:
        The result block (``recvbuf`` when given).
    """
    def local_checks(comm):
        _no_in_place(sendbuf, "reduce_scatter")
        send = _as_array(sendbuf, "sendbuf", writable=False)
        lo, hi = block(send.size, comm.Get_size(), comm.Get_rank())
        recv = _matching_recv(recvbuf, send, hi - lo,
                              f"block {comm.Get_rank()} of {send.size} split {comm.Get_size()} ways")
        red = reducer(op, send.dtype)
        _check_algorithm(algorithm, red, "reduce_scatter")
        return _Call(send, recv, red, algorithm, None, comm, collective="reduce_scatter",
                     count=send.size)

    call = _prepare("reduce_scatter", comm, check, local_checks, "reduce_scatter", timeout)
    n, p = call.send.size, call.comm.Get_size()
    lo, hi = block(n, p, call.comm.Get_rank())
    work = np.empty(n, dtype=call.send.dtype) if call.algorithm not in ("native", "auto") else None
    layout = None if work is None else Layout(
        (work,), ((call.send.reshape(-1), work),), ((work[lo:hi], call.recv.reshape(-1)),))
    native = lambda private, nonblocking: (
        private.Ireduce_scatter if nonblocking else private.Reduce_scatter)(
        call.send, call.recv, block_counts(n, p), call.reducer.mpi_op)
    return _run(call, n, layout, native, timeout)


def allgather(sendbuf, recvbuf, comm=None, algorithm="auto", check=True, timeout=None):
    """Gather every rank's block into ``recvbuf`` on every rank.

    Rank r contributes block r of ``recvbuf`` (``block(n, p, r)`` elements, n = recvbuf.size),
    as ``comm.Allgatherv(sendbuf, [recvbuf, block_counts(n, p)])``.

    Args:
        sendbuf: this rank's block, or ``MPI.IN_PLACE`` when it already sits in ``recvbuf``.
        recvbuf: the full result vector (required: its size says how many elements are gathered).
        comm, check, timeout: as for :func:`allreduce`.
        algorithm: ``"ring"``, ``"recursive_doubling"``, ``"native"`` or ``"auto"``.

    Returns:
        ``recvbuf``.
    """
    def local_checks(comm):
        if recvbuf is None:
            raise ValueError("allgather needs recvbuf: its size is the count gathered")
        recv = _as_array(recvbuf, "recvbuf", writable=True)
        lo, hi = block(recv.size, comm.Get_size(), comm.Get_rank())
        send = None
        if sendbuf is not MPI.IN_PLACE:
            send = _as_array(sendbuf, "sendbuf", writable=False)
            if send.dtype != recv.dtype:
                raise TypeError(f"recvbuf has dtype {recv.dtype} but sendbuf has {send.dtype}; "
                                f"they must match")
            if send.size != hi - lo:
                raise ValueError(f"sendbuf has {send.size} elements; rank {comm.Get_rank()} "
                                 f"contributes block {comm.Get_rank()} of {recv.size} split "
                                 f"{comm.Get_size()} ways: {hi - lo}")
        _check_algorithm(algorithm, None, "allgather")
        return _Call(send, recv, None, algorithm, None, comm, collective="allgather")

    call = _prepare("allgather", comm, check, local_checks, "allgather", timeout)
    n, p = call.recv.size, call.comm.Get_size()
    result = call.recv.reshape(-1)
    lo, hi = block(n, p, call.comm.Get_rank())
    load = () if call.send is None else ((call.send.reshape(-1), result[lo:hi]),)
    send = MPI.IN_PLACE if call.send is None else call.send
    native = lambda private, nonblocking: (private.Iallgatherv if nonblocking else
                                           private.Allgatherv)(send, [result, block_counts(n, p)])
    return _run(call, n, Layout((result,), load), native, timeout)


def bcast(buf, root=0, comm=None, algorithm="auto", check=True, timeout=None):
    """Broadcast ``buf`` from ``root`` to every rank, in place, as ``comm.Bcast(buf, root)``.

    Args:
        buf: the vector: input on the root, output everywhere (writable on every rank).
        root: the rank that holds the data.
        comm, check, timeout: as for :func:`allreduce`.
        algorithm: ``"binomial"``, ``"scatter_allgather"`` (van de Geijn: binomial scatter then
            ring allgather, for large messages), ``"native"`` or ``"auto"``.

    Returns:
        ``buf``.
    """
    def local_checks(comm):
        array = _as_array(buf, "buf", writable=True)
        if isinstance(root, bool) or not isinstance(root, (int, np.integer)) \
                or not 0 <= root < comm.Get_size():
            raise ValueError(f"root must be a rank of comm (0..{comm.Get_size() - 1}), got {root!r}")
        _check_algorithm(algorithm, None, "bcast")
        return _Call(None, array, None, algorithm, None, comm, collective="bcast",
                     root=int(root))

    call = _prepare("bcast", comm, check, local_checks, "bcast", timeout)
    native = lambda private, nonblocking: (private.Ibcast if nonblocking else private.Bcast)(
        call.recv, call.root)
    return _run(call, call.recv.size, Layout((call.recv.reshape(-1),)), native, timeout)


def alltoall(sendbuf, recvbuf=None, comm=None, algorithm="auto", check=True, timeout=None):
    """Send block j of ``sendbuf`` to rank j; block i of ``recvbuf`` comes from rank i.

    As ``comm.Alltoall(sendbuf, recvbuf)``: the n elements of ``sendbuf`` (n divisible by p)
    are p equal blocks.

    Args:
        sendbuf: this rank's n elements (any C-contiguous shape; read flat).
        recvbuf: n elements of the same dtype; ``None`` allocates one shaped like sendbuf.
        comm, check, timeout: as for :func:`allreduce`.
        algorithm: ``"pairwise"`` (p-1 exchanges with rank ± s), ``"native"`` or ``"auto"``.

    Returns:
        The result array (``recvbuf`` when given).
    """
    def local_checks(comm):
        _no_in_place(sendbuf, "alltoall")
        send = _as_array(sendbuf, "sendbuf", writable=False)
        if send.size % comm.Get_size():
            raise ValueError(f"sendbuf has {send.size} elements, not a multiple of the "
                             f"{comm.Get_size()} ranks: alltoall sends equal blocks")
        recv = (np.empty_like(send) if recvbuf is None
                else _matching_recv(recvbuf, send, send.size, "alltoall"))
        _check_algorithm(algorithm, None, "alltoall")
        return _Call(send, recv, None, algorithm, None, comm, collective="alltoall")

    call = _prepare("alltoall", comm, check, local_checks, "alltoall", timeout)
    n, p, rank = call.send.size, call.comm.Get_size(), call.comm.Get_rank()
    send, result = call.send.reshape(-1), call.recv.reshape(-1)
    lo, hi = block(n, p, rank)
    layout = Layout((send, result), ((send[lo:hi], result[lo:hi]),))
    native = lambda private, nonblocking: (private.Ialltoall if nonblocking else
                                           private.Alltoall)(call.send, call.recv)
    return _run(call, 2 * n, layout, native, timeout)
