"""mar.Comm takes every buffer mpi4py takes and gives what mpi4py gives, on every rank alike.

Each buffer kind goes through every routed method (Allreduce, Iallreduce, Allreduce_init,
Reduce_scatter, Reduce_scatter_block, Allgather), in place and out, with and without an explicit
count and datatype; the result (or the exception: type and message) is compared with plain
mpi4py's on the same kind of object holding the same values. Then the cases where ranks could
decide differently: an export that fails on one rank only, receive sizes that differ by rank.
Run under mpirun with --with-mpi.
"""

from __future__ import annotations

import array
import ctypes
import functools

import numpy as np
import pytest
from conftest import DLPackOnly
from mpi4py import MPI

import mpiallreduce as mar

#: How mar.Comm takes a buffer does not depend on the communicator's size: -n 1 to 4 (one rank,
#: even, odd, a power of two) cover it, and the 900-case matrix is skipped above that (every
#: rank alike) to keep `make test` short.
pytestmark = [pytest.mark.mpi,
              pytest.mark.skipif(MPI.COMM_WORLD.Get_size() > 4,
                                 reason="buffer handling is size-independent: covered at -n 1-4")]


# -- buffer kinds: each makes an object over float64 values and a float64 view of its memory ----

def _capsule_new():
    new = ctypes.pythonapi.PyCapsule_New
    new.restype = ctypes.py_object
    new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    return new


_ZEROS = (ctypes.c_char * 256)()  # a DLManagedTensor of zeros: device type 0, which none has


def _raising(kind):
    def __dlpack__(self, **kwargs):
        raise kind(f"{type(self).__name__}: this producer's DLPack export fails")
    return __dlpack__


def _misnamed_capsule(self, **kwargs):
    return _capsule_new()(ctypes.addressof(_ZEROS), b"not_a_dltensor", None)


def _zeroed_capsule(self, **kwargs):
    return _capsule_new()(ctypes.addressof(_ZEROS), b"dltensor", None)


def _exporter(name: str, dlpack):
    """An array.array (a working buffer protocol) whose DLPack export is ``dlpack``."""
    return type(name, (array.array,), {"__dlpack__": dlpack,
                                       "__dlpack_device__": lambda self: (1, 0)})


BROKEN_DLPACK = {f"dlpack raises {kind.__name__}": _exporter(f"Raises{kind.__name__}",
                                                            _raising(kind))
                 for kind in (BufferError, TypeError, RuntimeError, SystemError)}
BROKEN_DLPACK["dlpack misnamed capsule"] = _exporter("MisnamedCapsule", _misnamed_capsule)
BROKEN_DLPACK["dlpack zeroed capsule"] = _exporter("ZeroedCapsule", _zeroed_capsule)


class NoExport:
    """Neither export works: no buffer protocol, and a DLPack export that raises."""

    def __init__(self, kind=RuntimeError):
        self.kind = kind

    def __dlpack__(self, **kwargs):
        raise self.kind("NoExport: this producer's DLPack export fails")

    def __dlpack_device__(self):
        return (1, 0)


class ArrayInterfaceOnly:
    """NumPy reads it (``__array_interface__``), mpi4py does not."""

    def __init__(self, array):
        self._array = array
        self.__array_interface__ = array.__array_interface__


class NumPyCannotView(DLPackOnly):
    """A DLPack producer whose export NumPy's from_dlpack cannot take and mpi4py's can (it
    refuses the ``dl_device`` argument NumPy passes), as a device tensor may be."""

    def __dlpack__(self, **kwargs):
        if "dl_device" in kwargs:
            raise BufferError("NumPyCannotView: no export for NumPy")
        return super().__dlpack__(**kwargs)


def _numpy(values):
    return values, values


def _two_d(values, order):
    if values.size % 2:
        return values, values
    return (values.reshape(2, -1) if order == "C" else values.reshape(-1, 2).T), values


def _view(values):
    big = np.full(values.size + 3, -7.0)
    mem = big[2:2 + values.size]
    mem[:] = values
    return mem, mem


def _readonly(values):
    obj = values.view()
    obj.flags.writeable = False
    return obj, values


def _bytes(obj):
    return obj, np.frombuffer(obj, dtype=np.float64)


def _exported(cls, values):
    return _bytes(cls("d", values.tolist()))


KINDS = {
    "numpy": _numpy,
    "numpy C 2-D": lambda v: _two_d(v, "C"),
    "numpy Fortran": lambda v: _two_d(v, "F"),
    "numpy view": _view,
    "numpy read-only": _readonly,
    "array.array": lambda v: _bytes(array.array("d", v.tolist())),
    "bytearray": lambda v: _bytes(bytearray(v.tobytes())),
    "memoryview": lambda v: (memoryview(v), v),
    "memoryview of bytes": lambda v: _bytes(memoryview(bytearray(v.tobytes()))),
    "MPI.buffer": lambda v: (MPI.buffer(v), v),
    "MPI.memory": lambda v: (MPI.memory.frombuffer(v), v),
    "__array_interface__ only": lambda v: (ArrayInterfaceOnly(v), v),
    "DLPack only": lambda v: (DLPackOnly(v), v),
    **{name: functools.partial(_exported, cls) for name, cls in BROKEN_DLPACK.items()},
    "no export": lambda v: (NoExport(), v),
}
#: kinds whose implicit datatype is bytes (their format is "B"): reduced with MAX, which cannot
#: overflow (Open MPI's op/avx saturates 8-bit sums where C, and mpiallreduce, wrap)
BYTE_KINDS = {"bytearray", "memoryview of bytes", "MPI.buffer", "MPI.memory"}
FORMS = ("implicit", "datatype", "count")
METHODS = ("Allreduce", "Iallreduce", "Allreduce_init", "Reduce_scatter",
           "Reduce_scatter none", "Reduce_scatter_block", "Allgather")


def _spec(obj, form: str, count: int):
    if form == "implicit":
        return obj
    if form == "datatype":
        return [obj, MPI.DOUBLE]
    return [obj, count, MPI.DOUBLE]


def _values(comm, size: int, seed: int) -> np.ndarray:
    """Small integers as doubles: every summation order gives the same bits."""
    return (np.arange(size) * (seed + 3) % 11 + comm.rank).astype(np.float64)


def _outcome(comm, method: str, kind: str, form: str, in_place: bool):
    """Run ``method`` on ``comm`` with fresh objects of ``kind``; return ('ok', result bytes) or
    ('raised', exception type, message)."""
    p = comm.Get_size()
    block = 3
    sizes = {"Allreduce": (2 * p + 2, 2 * p + 2), "Iallreduce": (2 * p + 2, 2 * p + 2),
             "Allreduce_init": (2 * p + 2, 2 * p + 2),
             "Reduce_scatter": (p * block, block), "Reduce_scatter none": (p * block, block),
             "Reduce_scatter_block": (p * block, block), "Allgather": (block, p * block)}
    send_size, recv_size = sizes[method]
    if in_place:
        recv_size = max(send_size, recv_size)
    make = KINDS[kind]
    send, _ = make(_values(comm, send_size, 1))
    recv_values = _values(comm, recv_size, 2)
    recv, memory = make(recv_values.copy())
    op = MPI.MAX if form == "implicit" and kind in BYTE_KINDS else MPI.SUM
    # mpi4py counts per block: Allgather's receive buffer, Reduce_scatter_block's buffers
    count = block if method in ("Allgather", "Reduce_scatter_block") else recv_size
    send_count = block if method == "Reduce_scatter_block" else send_size
    sendbuf = MPI.IN_PLACE if in_place else _spec(send, form, send_count)
    recvbuf = _spec(recv, form, count)
    try:
        if method == "Allreduce":
            comm.Allreduce(sendbuf, recvbuf, op)
        elif method == "Iallreduce":
            comm.Iallreduce(sendbuf, recvbuf, op).Wait()
        elif method == "Allreduce_init":
            request = comm.Allreduce_init(sendbuf, recvbuf, op)
            for _ in range(2):
                request.Start()
                request.Wait()
            request.Free()
        elif method == "Reduce_scatter":
            comm.Reduce_scatter(sendbuf, recvbuf, [block] * p, op)
        elif method == "Reduce_scatter none":
            comm.Reduce_scatter(sendbuf, recvbuf, None, op)
        elif method == "Reduce_scatter_block":
            comm.Reduce_scatter_block(sendbuf, recvbuf, op)
        else:
            comm.Allgather(sendbuf, recvbuf)
    except Exception as exc:  # noqa: BLE001 - the outcome is what is compared
        return ("raised", type(exc), str(exc))
    return ("ok", memory.tobytes())


@pytest.mark.parametrize("in_place", [False, True], ids=["out", "in-place"])
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("method", METHODS)
def test_every_buffer_kind_gives_what_mpi4py_gives(method, kind, form, in_place):
    world = MPI.COMM_WORLD
    expected = _outcome(world, method, kind, form, in_place)
    got = _outcome(mar.Comm(world, "ring"), method, kind, form, in_place)
    # every rank saw the same outcome (so nobody is left waiting in a collective)
    outcomes = world.allgather((got[0], got == expected))
    assert got == expected
    assert outcomes == [(got[0], True)] * world.Get_size()


def test_the_matrix_covers_results_and_errors():
    """The matrix is not vacuous: most cases compute, and the ones mpi4py refuses are there."""
    world = MPI.COMM_WORLD
    computed = [_outcome(world, "Allreduce", kind, "datatype", False)[0] for kind in KINDS]
    assert computed.count("ok") == len(KINDS) - 3  # read-only, __array_interface__, no export
    assert _outcome(world, "Allreduce", "no export", "implicit", False)[0] == "raised"
    assert _outcome(world, "Allreduce", "__array_interface__ only", "datatype", False)[0] \
        == "raised"


# -- what mar.Comm routes where ---------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["numpy", "array.array", "bytearray", "memoryview", "MPI.buffer",
                                  "DLPack only", *BROKEN_DLPACK])
def test_buffers_numpy_views_go_through_mpiallreduce(kind, monkeypatch):
    """The buffer protocol first, DLPack only without it: these reach mar.allreduce."""
    from mpiallreduce import comm as comm_module

    calls = []
    real = comm_module.allreduce
    monkeypatch.setattr(comm_module, "allreduce", lambda *a, **k: calls.append(1) or real(*a, **k))
    world = MPI.COMM_WORLD
    send, _ = KINDS[kind](_values(world, 5, 1))
    recv, memory = KINDS[kind](np.zeros(5))
    mar.Comm(world, "ring").Allreduce([send, MPI.DOUBLE], [recv, MPI.DOUBLE], MPI.SUM)
    assert calls == [1]
    reference = np.empty(5)
    world.Allreduce(_values(world, 5, 1), reference)
    assert np.array_equal(memory, reference)


# -- ranks that could decide differently --------------------------------------------------------------

@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("method", ["Allreduce", "Iallreduce", "Allreduce_init",
                                    "Reduce_scatter_block", "Allgather"])
@pytest.mark.parametrize("side", ["send", "recv"])
def test_numpy_view_fails_on_one_rank_only_every_rank_goes_to_mpi(method, side):
    """Rank 0's buffer is one NumPy cannot view and mpi4py can: every rank goes to MPI."""
    world = MPI.COMM_WORLD
    p = world.Get_size()
    send_size, recv_size = {"Reduce_scatter_block": (2 * p, 2), "Allgather": (2, 2 * p)}.get(
        method, (5, 5))
    results = []
    for comm in (world, mar.Comm(world, "ring")):
        send, recv = _values(world, send_size, 1), np.zeros(recv_size)
        wrapped = {"send": send, "recv": recv}
        if world.rank == 0:
            wrapped[side] = NumPyCannotView(wrapped[side])
        if method == "Allreduce":
            comm.Allreduce(wrapped["send"], wrapped["recv"])
        elif method == "Iallreduce":
            comm.Iallreduce(wrapped["send"], wrapped["recv"]).Wait()
        elif method == "Allreduce_init":
            request = comm.Allreduce_init(wrapped["send"], wrapped["recv"])
            request.Start()
            request.Wait()
            request.Free()
        elif method == "Reduce_scatter_block":
            comm.Reduce_scatter_block(wrapped["send"], wrapped["recv"])
        else:
            comm.Allgather(wrapped["send"], wrapped["recv"])
        results.append(recv.copy())
    assert np.array_equal(results[1], results[0])


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("method", ["Allreduce", "Iallreduce", "Allreduce_init",
                                    "Reduce_scatter_block", "Reduce_scatter none", "Allgather"])
def test_a_buffer_mpi4py_cannot_read_on_one_rank_raises_on_every_rank(method):
    """Where plain mpi4py raises on rank 0 and leaves the others waiting, every rank raises."""
    world = MPI.COMM_WORLD
    comm = mar.Comm(world, "ring")
    p = world.Get_size()
    send_size, recv_size = {"Reduce_scatter_block": (2 * p, 2), "Reduce_scatter none": (2 * p, 2),
                            "Allgather": (2, 2 * p)}.get(method, (5, 5))
    send, recv = _values(world, send_size, 1), np.zeros(recv_size)
    if world.rank == 0:
        recv = NoExport()
    calls = {"Allreduce": lambda: comm.Allreduce(send, recv),
             "Iallreduce": lambda: comm.Iallreduce(send, recv).Wait(),
             "Allreduce_init": lambda: comm.Allreduce_init(send, recv),
             "Reduce_scatter_block": lambda: comm.Reduce_scatter_block(send, recv),
             "Reduce_scatter none": lambda: comm.Reduce_scatter(send, recv, None),
             "Allgather": lambda: comm.Allgather(send, recv)}
    with pytest.raises((RuntimeError, BufferError)) as raised:
        calls[method]()
    if world.rank == 0:  # what mpi4py raises for it
        assert type(raised.value) is RuntimeError and "NoExport" in str(raised.value)
    else:
        assert "rank 0" in str(raised.value)
    world.Barrier()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("layout", ["block", "other"])
def test_reduce_scatter_receive_sizes_differ_by_rank(layout):
    """recvcounts=None: each rank's count is its recvbuf's, gathered as mpi4py gathers them."""
    world = MPI.COMM_WORLD
    p, rank = world.Get_size(), world.Get_rank()
    counts = (mar.partition.block_counts(2 * p + 1, p) if layout == "block"
              else [(r * 2) % 3 + 1 for r in range(p)])  # 1, 3, 2, 1, ...: 2/1/3 rotated
    total = sum(counts)
    x = _values(world, total, 1)
    expected = np.full(counts[rank], -1.0)
    world.Reduce_scatter(x, expected, None, MPI.SUM)
    for algorithm in ("ring", "recursive_doubling", "native"):
        out = np.full(counts[rank], -1.0)
        mar.Comm(world, algorithm).Reduce_scatter(x, out, None, MPI.SUM)
        assert np.array_equal(out, expected)


# -- mar.allreduce, plans and iallreduce: a buffer NumPy cannot view is a TypeError everywhere ------

@pytest.mark.parametrize("kind", [BufferError, TypeError, RuntimeError, SystemError, ValueError])
@pytest.mark.parametrize("entry", ["allreduce", "plan", "iallreduce"])
@pytest.mark.parametrize("where", ["every rank", "rank 0"])
def test_a_buffer_numpy_cannot_view_is_a_type_error_on_every_rank(kind, entry, where):
    world = MPI.COMM_WORLD
    x = _values(world, 4, 1)
    if where == "every rank" or world.rank == 0:
        x = NoExport(kind)
    call = {"allreduce": lambda: mar.allreduce(x, comm=world),
            "plan": lambda: mar.plan(x, comm=world),
            "iallreduce": lambda: mar.iallreduce(x, comm=world).wait()}[entry]
    with pytest.raises(TypeError, match="NoExport"):
        call()
    world.Barrier()


def test_the_buffer_protocol_comes_first_in_mar_allreduce():
    world = MPI.COMM_WORLD
    for cls in BROKEN_DLPACK.values():
        x = cls("d", _values(world, 6, 1).tolist())
        out = cls("d", [0.0] * 6)
        mar.allreduce(x, out, comm=world, algorithm="ring")
        expected = np.empty(6)
        world.Allreduce(_values(world, 6, 1), expected)
        assert np.array_equal(np.frombuffer(out), expected)
