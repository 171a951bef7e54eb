"""Public entry points: argument checks, cross-rank agreement, dispatch to a Plan."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np
from mpi4py import MPI

from . import algorithms, select
from .executor import NativePlan, Plan, scratch_size
from .ops import DTYPES, OP_NAMES, Reducer, reducer

#: every name ``algorithm=`` accepts.
ALGORITHMS: tuple[str, ...] = tuple(algorithms.REGISTRY) + ("native", "auto")

_UNKNOWN = -9  # signature field a rank could not determine (its own input was bad)


# -- per-communicator state: a private duplicate, attached as an MPI attribute ------------------

@dataclass
class _CommState:
    """What mpiallreduce keeps per user communicator: a private Dup and reusable scratch."""

    private: MPI.Intracomm
    scratch: dict = field(default_factory=dict)

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

def _check_comm(comm) -> None:
    if not isinstance(comm, MPI.Comm):
        raise TypeError(f"comm must be an mpi4py communicator, got {type(comm).__name__}")
    if comm == MPI.COMM_NULL:
        raise ValueError("comm is MPI.COMM_NULL (a freed or null communicator)")
    if comm.Is_inter():
        raise TypeError("comm is an intercommunicator; mpiallreduce needs an intracommunicator")


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
        except TypeError:
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


def _check_algorithm(name, red: Reducer) -> None:
    if not isinstance(name, str) or name not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {name!r}; choose one of {', '.join(ALGORITHMS)}")
    if name in ("native", "auto") or red.commutative:
        return
    if algorithms.get(name).commutative_only:
        keep = [n for n, a in algorithms.REGISTRY.items() if not a.commutative_only]
        raise ValueError(f"algorithm {name!r} reorders operands and needs a commutative op; "
                         f"for a non-commutative op use one of {', '.join(keep + ['native'])}")


@dataclass
class _Call:
    """A checked collective call: buffers, op, and everything needed to build its plan."""

    send: np.ndarray | None  # None: in place
    recv: np.ndarray
    reducer: Reducer
    algorithm: str  # as requested ("auto" not yet resolved)
    topology: object
    comm: MPI.Intracomm

    @property
    def signature(self) -> list[int]:
        return [0, self.recv.size, DTYPES.index(self.recv.dtype), self.reducer.index,
                ALGORITHMS.index(self.algorithm)]


def _local_checks(sendbuf, recvbuf, op, comm, algorithm, topology) -> _Call:
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
    return _Call(send, recv, red, algorithm, topology, comm)


def _describe(field_name: str, value: int) -> str:
    if value == _UNKNOWN:
        return "unknown (bad input)"
    if field_name == "dtype":
        return DTYPES[value].name
    if field_name == "op":
        return {-1: "a commutative user op", -2: "a non-commutative user op"}.get(
            value, OP_NAMES[value] if 0 <= value < len(OP_NAMES) else str(value))
    if field_name == "algorithm":
        return ALGORITHMS[value]
    return str(value)


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _agree(private: MPI.Intracomm, what: str, signature: list[int],
           error: Exception | None) -> None:
    """Raise the same exception on every rank if any rank's input was bad or ranks disagree."""
    mine = np.array(signature, dtype=np.int64)
    table = np.empty((private.Get_size(), mine.size), dtype=np.int64)
    private.Allgather(mine, table)
    failed = [int(r) for r in np.flatnonzero(table[:, 0])]
    if failed:
        messages = private.allgather(None if error is None else (type(error), str(error)))
        kind, message = messages[failed[0]]
        if error is not None and len(failed) == 1:
            raise error
        raise kind(f"{what}: bad input on {_ranks(failed)}; rank {failed[0]}: {message}")
    problems = []
    for column, name in enumerate(("", "count", "dtype", "op", "algorithm")):
        if column == 0 or (table[:, column] == table[0, column]).all():
            continue
        groups: dict[int, list[int]] = {}
        for rank, value in enumerate(table[:, column]):
            groups.setdefault(int(value), []).append(rank)
        problems.append(f"{name} differs: " + "; ".join(
            f"{_describe(name, value)} on {_ranks(ranks)}" for value, ranks in groups.items()))
    if problems:
        raise ValueError(f"{what} called with different arguments on different ranks: "
                         + "; ".join(problems))


def _prepare(what, sendbuf, recvbuf, op, comm, algorithm, topology, check) -> _Call:
    """Run the local checks and, with ``check``, the cross-rank agreement."""
    comm = MPI.COMM_WORLD if comm is None else comm
    _check_comm(comm)
    if not check:
        call = _local_checks(sendbuf, recvbuf, op, comm, algorithm, topology)
        _state(comm)
        return call
    call = error = None
    try:
        call = _local_checks(sendbuf, recvbuf, op, comm, algorithm, topology)
        signature = call.signature
    except (TypeError, ValueError) as exc:
        error, signature = exc, [1] + [_UNKNOWN] * 4
    _agree(_state(comm).private, what, signature, error)
    return call


@lru_cache(maxsize=256)
def _steps(name: str, rank: int, nranks: int, count: int, topology):
    return algorithms.get(name).steps(rank, nranks, count, topology=topology)


def _build(call: _Call, persistent: bool, timeout: float | None) -> Plan:
    state = _state(call.comm)
    private = state.private
    nranks, rank = private.Get_size(), private.Get_rank()
    name = call.algorithm
    if name == "auto":
        name = select.choose(nranks, call.recv.nbytes, call.reducer, call.topology)
    if name == "native":
        return NativePlan(private, call.send, call.recv, call.reducer, timeout=timeout)
    steps = _steps(name, rank, nranks, call.recv.size, call.topology)
    scratch = None
    if not persistent:
        scratch = state.scratch_for(call.recv.dtype, scratch_size(steps))
    return Plan(private, steps, call.send, call.recv, call.reducer, name,
                persistent=persistent, scratch=scratch, timeout=timeout)


# -- public functions -------------------------------------------------------------------------------

def allreduce(sendbuf, recvbuf=None, op=MPI.SUM, comm=None, algorithm="auto", topology=None,
              check=True, timeout=None):
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
        topology: a ``Topology`` for the hierarchical algorithms (default: from ``comm``).
        check: agree on count, dtype, op and algorithm across ranks first (one small native
            collective) so a mismatch raises the same ValueError everywhere instead of hanging.
        timeout: seconds before :class:`CollectiveTimeout` (default: wait forever).

    Returns:
        The result array (``recvbuf`` when given).
    """
    call = _prepare("allreduce", sendbuf, recvbuf, op, comm, algorithm, topology, check)
    if call.recv.size == 0:
        return call.recv
    return _build(call, persistent=False, timeout=timeout).run()


def plan(sendbuf, recvbuf=None, op=MPI.SUM, comm=None, algorithm="auto", topology=None,
         check=True, timeout=None) -> Plan:
    """Bind an allreduce to its buffers once; ``run()`` repeats it with no allocation.

    Arguments as :func:`allreduce`. The cross-rank ``check`` runs once, here; ``run()`` trusts
    the buffers' contents and shapes thereafter. Use as a context manager or call ``free()``.
    """
    call = _prepare("plan", sendbuf, recvbuf, op, comm, algorithm, topology, check)
    return _build(call, persistent=True, timeout=timeout)
