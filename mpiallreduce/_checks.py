"""Buffer coercion and the local argument checks, made before any message is sent."""

from __future__ import annotations

import numbers
import zlib
from dataclasses import dataclass, field

import numpy as np
from mpi4py import MPI

from . import algorithms, select
from ._dlpack import from_dlpack
from .ops import DTYPES, Reducer, native_deviates, reducer
from .topology import Topology

#: every name ``algorithm=`` accepts.
#: "shm" is the node-local shared-memory transport (:mod:`.shm`), not a schedule.
ALGORITHMS: tuple[str, ...] = tuple(algorithms.REGISTRY) + ("shm", "native", "auto")
#: the names each related collective's ``algorithm=`` accepts ("auto" means "native" for now).
COLLECTIVE_ALGORITHMS: dict[str, tuple[str, ...]] = {
    collective: tuple(registry) + ("native", "auto")
    for collective, registry in algorithms.COLLECTIVES.items()}
COLLECTIVE_ALGORITHMS["allreduce"] = ALGORITHMS
#: algorithms that are no schedule: they take no parameters and keep rank order for any op.
UNSCHEDULED = ("shm", "native", "auto")
_NO_OP = -3  # op field of collectives that combine nothing


def check_comm(comm) -> None:
    """Raise for anything but a live intracommunicator."""
    if not isinstance(comm, MPI.Comm):
        raise TypeError(f"comm must be an mpi4py communicator, got {type(comm).__name__}")
    if comm == MPI.COMM_NULL:
        raise ValueError("comm is MPI.COMM_NULL (a freed or null communicator)")
    if comm.Is_inter():
        raise TypeError("comm is an intercommunicator; mpiallreduce needs an intracommunicator")


def view(obj, name: str) -> np.ndarray:
    """View ``obj``'s memory as a NumPy array without copying, through the exports mpi4py reads.

    In mpi4py's order: the buffer protocol, then DLPack (CPU memory) for an object without a
    working buffer protocol, read as mpi4py reads it (:mod:`._dlpack`: one export, the capsule
    not consumed). An export is foreign code and may raise anything (``SystemError``
    from a broken DLPack capsule included): every failure is a ``TypeError`` naming ``name``.
    """
    if isinstance(obj, np.ndarray):
        return obj
    # Failures are kept as text: an exception kept in a local holds its traceback, whose
    # frames hold the local (a cycle that keeps the caller's buffers until garbage collection)
    try:
        return np.asarray(memoryview(obj))
    except Exception as exc:  # noqa: BLE001 - a foreign export may raise any kind
        failure = f"{type(exc).__name__}: {exc}"
    try:
        dlpack = hasattr(obj, "__dlpack__")
    except Exception:  # noqa: BLE001 - an attribute lookup is foreign code too
        dlpack = False
    if not dlpack:
        raise TypeError(f"{name} must be a NumPy array or expose the buffer protocol, "
                        f"got {type(obj).__name__}") from None
    try:
        return from_dlpack(obj)
    except Exception as exc:  # noqa: BLE001 - a foreign export may raise any kind
        failure = (f"{name}: NumPy cannot view this {type(obj).__name__} on the CPU (buffer "
                   f"protocol: {failure}; DLPack: {type(exc).__name__}: {exc})")
    _refuse_tensor(obj, name)
    raise TypeError(failure)


def _refuse_tensor(obj, name: str) -> None:
    """Say what to do with a torch tensor DLPack could not hand over (without importing torch)."""
    if not any(k.__name__ == "Tensor" and k.__module__ == "torch" for k in type(obj).__mro__):
        return
    if obj.device.type != "cpu":
        raise TypeError(f"{name} is a torch tensor on {obj.device}; mpiallreduce reduces CPU "
                        f"memory: pass {name}.cpu() and copy the result back (.copy_())")
    if obj.requires_grad:
        raise TypeError(f"{name} is a torch tensor that requires grad; pass {name}.detach() "
                        f"(the same memory)")
    if not obj.is_contiguous():
        raise ValueError(f"{name} is a non-contiguous torch tensor (strides {obj.stride()}); "
                         f"pass {name}.contiguous() and copy the result back (.copy_()), or "
                         f"reduce the tensor it is a view of")
    if str(obj.dtype) == "torch.bfloat16":
        raise TypeError(f"{name} is a bfloat16 torch tensor, which has no MPI datatype; pass "
                        f"{name}.float(), or reduce it with mar.torch's hooks (bfloat16 words, "
                        f"float32 adds)")


def as_array(obj, name: str, writable: bool) -> np.ndarray:
    """View ``obj`` as a NumPy array without copying; raise for anything MPI could not read.

    The view is :func:`view`'s (any export failure is a ``TypeError``). C- and
    Fortran-contiguous arrays are accepted (MPI reads either as its memory order); a strided
    view, a non-native byte order or a dtype without a predefined MPI datatype is an error that
    names the fix.
    """
    array = view(obj, name)
    flags = array.flags
    if not (flags.c_contiguous or flags.f_contiguous):
        raise ValueError(f"{name} must be contiguous (C or Fortran order; got strides "
                         f"{array.strides}); pass np.ascontiguousarray({name})")
    if writable and not flags.writeable:
        raise ValueError(f"{name} is read-only; the result needs a writable buffer")
    if not array.dtype.isnative:
        raise TypeError(f"{name} has dtype {array.dtype.str}, not in this machine's byte order, "
                        f"which MPI cannot reduce; pass {name}.astype({name}.dtype."
                        f"newbyteorder('='))")
    if array.dtype not in DTYPES:
        raise TypeError(f"{name} has dtype {array.dtype}, which has no predefined MPI datatype "
                        f"here; use one of {', '.join(d.name for d in DTYPES)}")
    return array


def _order(array: np.ndarray) -> str:
    return "C" if array.flags.c_contiguous else "F"


def check_algorithm(name, red: Reducer | None, collective: str = "allreduce") -> None:
    names = COLLECTIVE_ALGORITHMS[collective]
    if not isinstance(name, str) or name not in names:
        what = "algorithm" if collective == "allreduce" else f"{collective} algorithm"
        raise ValueError(f"unknown {what} {name!r}; choose one of {', '.join(names)}")
    if name in UNSCHEDULED or red is None or red.commutative:
        return
    registry = algorithms.COLLECTIVES[collective]
    if registry[name].commutative_only:
        keep = [n for n, a in registry.items() if not a.commutative_only]
        keep += [n for n in UNSCHEDULED if n in names and n != "auto"]
        raise ValueError(f"algorithm {name!r} reorders operands and needs a commutative op; "
                         f"for a non-commutative op use one of {', '.join(keep)}")


def check_params(name: str, params: dict, collective: str = "allreduce") -> None:
    """Raise TypeError for builder parameters the chosen algorithm does not take."""
    if not params:
        return
    accepted = ([] if name in UNSCHEDULED else
                [k for k in algorithms.get(name, collective).params
                 if k not in ("itemsize", "root", "ordered")])
    unknown = sorted(set(params) - set(accepted))
    if unknown:
        takes = f"takes {', '.join(accepted)}" if accepted else "takes no parameters"
        raise TypeError(f"algorithm {name!r} got unexpected parameter(s) {', '.join(unknown)}; "
                        f"it {takes}")


def check_topology(topology, comm) -> None:
    if topology is None:
        return
    if not isinstance(topology, Topology):
        raise TypeError(f"topology must be a mpiallreduce Topology (Topology.from_comm, "
                        f"Topology.simulated, Topology.from_nodes), got {type(topology).__name__}")
    topology.check_size(comm.Get_size())


def plain_timeout(timeout):
    """A NumPy (or other) real number of seconds as a float, so that a repeated call finds its
    plan (a ``np.float64`` timeout made every call bind two new plans); anything else as it is,
    for the checks to refuse on every rank."""
    if isinstance(timeout, numbers.Real) and not isinstance(timeout, bool):
        return float(timeout)
    return timeout


@dataclass
class Call:
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

    def signature(self, timeout) -> list[int]:
        """The fields every rank must pass alike, as integers (see :mod:`._agree`)."""
        count = self.recv.size if self.count is None else self.count
        op = _NO_OP if self.reducer is None else self.reducer.index
        params = zlib.crc32(repr(sorted(self.params.items())).encode()) & 0x7FFFFFFF
        # a topology that differs between ranks gives mismatched schedules: a hang
        topology = (-1 if self.topology is None
                    else zlib.crc32(repr(self.topology.levels).encode()) & 0x7FFFFFFF)
        # auto's choice depends on the tuning table each rank reads (the same file everywhere),
        # on whether this process's MPI saturates 8/16-bit sums (op/avx picks its code by CPU
        # features, so nodes of a mixed cluster could differ) and, on one node, on whether the
        # call is in place and whether in place on a shared array (select.one_node_choice):
        # ranks that differ would run different algorithms and wait for each other
        table = inputs = 0
        if self.algorithm == "auto" and self.collective == "allreduce":
            table = select.digest()
            inputs = (int(native_deviates(self.reducer.name, self.recv.dtype))
                      | (2 if self.send is None else 0)
                      | (4 if self.send is None and in_shared_memory(self.recv) else 0))
        return [0, count, DTYPES.index(self.recv.dtype), op,
                COLLECTIVE_ALGORITHMS[self.collective].index(self.algorithm), self.root, params,
                topology, int(timeout is not None), table, inputs]


def in_shared_memory(array: np.ndarray) -> bool:
    """Whether ``array`` lies in a live shared array (``mpiallreduce.shared_empty``)."""
    block = getattr(array, "_block", None)
    return block is not None and not block.freed


def allreduce_call(sendbuf, recvbuf, op, comm, algorithm, topology, params=None) -> Call:
    """Check an allreduce's arguments on this rank; return the Call or raise."""
    if sendbuf is MPI.IN_PLACE:
        if recvbuf is None:
            raise ValueError("sendbuf is MPI.IN_PLACE, so recvbuf must hold the input and result")
        recv = as_array(recvbuf, "recvbuf", writable=True)
        send = None
    else:
        send = as_array(sendbuf, "sendbuf", writable=False)
        if recvbuf is None:
            recv = np.empty_like(send)  # the same shape and memory order
        else:
            recv = as_array(recvbuf, "recvbuf", writable=True)
            if recv.dtype != send.dtype:
                raise TypeError(f"recvbuf has dtype {recv.dtype} but sendbuf has {send.dtype}; "
                                f"they must match")
            if recv.shape != send.shape:
                raise ValueError(f"recvbuf has shape {recv.shape} but sendbuf has {send.shape}; "
                                 f"they must match")
            if send.ndim > 1 and send.size > 1 and _order(send) != _order(recv):
                raise ValueError(f"sendbuf is {_order(send)}-ordered but recvbuf is "
                                 f"{_order(recv)}-ordered; MPI pairs elements by memory position, "
                                 f"so pass both in the same order (np.ascontiguousarray or "
                                 f"np.asfortranarray)")
            if send.size and np.may_share_memory(send, recv):
                raise ValueError("sendbuf and recvbuf overlap; pass MPI.IN_PLACE as sendbuf "
                                 "to reduce in place")
    red = reducer(op, recv.dtype)
    check_algorithm(algorithm, red)
    check_topology(topology, comm)
    check_params(algorithm, params or {})
    return Call(send, recv, red, algorithm, topology, comm, dict(params or {}))


def matching_recv(recvbuf, send: np.ndarray, size: int, what: str) -> np.ndarray:
    """Return recvbuf checked against ``send``'s dtype and the ``size`` it must have (or a new one)."""
    if recvbuf is None:
        return np.empty(size, dtype=send.dtype)
    recv = as_array(recvbuf, "recvbuf", writable=True)
    if recv.dtype != send.dtype:
        raise TypeError(f"recvbuf has dtype {recv.dtype} but sendbuf has {send.dtype}; "
                        f"they must match")
    if recv.size != size:
        raise ValueError(f"recvbuf has {recv.size} elements; {what} needs {size}")
    if size and np.may_share_memory(send, recv):
        raise ValueError("sendbuf and recvbuf overlap; pass separate buffers")
    return recv


def no_in_place(sendbuf, what: str) -> None:
    if sendbuf is MPI.IN_PLACE:
        raise ValueError(f"{what} does not take MPI.IN_PLACE; pass sendbuf and recvbuf")
