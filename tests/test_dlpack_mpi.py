"""DLPack producers and the drop-in: read as mpi4py reads them, nothing kept in cycles.

mar.Comm must survive mpi4py's own test suite: NumPy's ``from_dlpack`` would consume the
suite's DLPack producer's capsules (mpi4py never does), and exceptions kept in locals would
hold the buffers' frames in reference cycles until a garbage collection ran the producer's
destructors at the wrong moment. ``scripts/mpi4py_suite.py`` runs that suite; these tests pin the causes.
"""

from __future__ import annotations

import ctypes
import gc

import numpy as np
import pytest
from conftest import assert_on_every_rank
from mpi4py import MPI

import mpiallreduce as mar
from mpiallreduce._checks import view

_is_valid = ctypes.pythonapi.PyCapsule_IsValid
_is_valid.argtypes = [ctypes.py_object, ctypes.c_char_p]
_is_valid.restype = ctypes.c_int


class Producer:
    """A CPU tensor seen only through DLPack (no buffer protocol), counting its exports."""

    def __init__(self, array: np.ndarray):
        self.array = array
        self.capsules = []

    def __dlpack_device__(self):
        return self.array.__dlpack_device__()

    def __dlpack__(self, **kwargs):
        capsule = self.array.__dlpack__(**kwargs)
        self.capsules.append(capsule)
        return capsule

    def unconsumed(self) -> bool:
        """Is every capsule handed out still named as the producer named it (not ``used_``)?"""
        return all(_is_valid(c, b"dltensor_versioned") or _is_valid(c, b"dltensor")
                   for c in self.capsules)


def test_view_reads_a_dlpack_producer_once_and_leaves_its_capsule_unconsumed():
    array = np.arange(6, dtype=np.float32).reshape(2, 3)
    producer = Producer(array)
    viewed = view(producer, "buffer")
    assert len(producer.capsules) == 1
    assert producer.unconsumed()  # np.from_dlpack renames it used_dltensor_versioned
    assert viewed.dtype == array.dtype and viewed.shape == array.shape
    assert np.shares_memory(viewed, array)
    viewed[0, 0] = 42
    assert array[0, 0] == 42


@pytest.mark.parametrize("dtype", ["bool", "int8", "uint16", "int32", "int64", "float32",
                                   "float64", "complex64", "complex128"])
def test_view_maps_each_dlpack_type_as_numpy_does(dtype):
    array = np.ones(5, dtype=dtype)
    viewed = view(Producer(array), "buffer")
    assert viewed.dtype == array.dtype and np.shares_memory(viewed, array)


def test_view_of_an_empty_or_fortran_ordered_producer():
    assert view(Producer(np.empty((0, 3))), "buffer").shape == (0, 3)
    fortran = np.asfortranarray(np.arange(6.0).reshape(2, 3))
    viewed = view(Producer(fortran), "buffer")
    assert viewed.flags.f_contiguous and np.shares_memory(viewed, fortran)


def test_view_refuses_a_strided_producer_with_a_type_error():
    with pytest.raises(TypeError, match="not contiguous"):
        view(Producer(np.arange(10.0)[::2]), "buffer")


@pytest.mark.mpi
@pytest.mark.parametrize("algorithm", ["ring", "recursive_doubling", "auto"])
def test_comm_allreduce_exports_each_producer_once_unconsumed(algorithm):
    world = MPI.COMM_WORLD
    comm = mar.Comm(world, algorithm)
    x = np.arange(7, dtype=np.float64) + world.rank
    send, recv = Producer(x.copy()), Producer(np.zeros(7))
    comm.Allreduce([send, MPI.DOUBLE], [recv, MPI.DOUBLE], MPI.SUM)
    expected = np.empty(7)
    world.Allreduce(x, expected, MPI.SUM)
    good = (np.array_equal(recv.array, expected) and len(send.capsules) == 1
            and len(recv.capsules) == 1 and send.unconsumed() and recv.unconsumed())
    assert_on_every_rank(world, None if good else
                         f"rank {world.rank}, {algorithm}: result {recv.array} (native {expected}), exports "
                         f"{len(send.capsules)}/{len(recv.capsules)}, unconsumed "
                         f"{send.unconsumed()}/{recv.unconsumed()}")


def _our_frames_in_garbage(call) -> list[str]:
    """Run ``call`` and return the names of mpiallreduce's frames it left in reference cycles."""
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        call()
        gc.collect()
        return [f"{o.f_code.co_name} ({o.f_code.co_filename.rsplit('/', 1)[-1]})"
                for o in gc.garbage
                if type(o).__name__ == "frame" and "mpiallreduce" in o.f_code.co_filename]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()


@pytest.mark.mpi
def test_calls_that_go_to_mpi_leave_no_frames_in_cycles():
    # each goes through the agreement with an Unviewable on every rank, then to MPI: mpi4py's
    # suite passes None for Allgather's sendbuf (IN_PLACE to mpi4py), and the exceptions of
    # that path held the parsed views (a DLPack capsule) in frames only the collector frees
    world = MPI.COMM_WORLD
    comm = mar.Comm(world, "ring")
    buf = np.full((world.size, 3), -1.0)
    buf[world.rank] = world.rank

    def allgather_none():
        comm.Allgather(None, [Producer(buf), MPI.DOUBLE])

    left = _our_frames_in_garbage(allgather_none)
    expected = np.repeat(np.arange(world.size, dtype=float), 3).reshape(world.size, 3)
    good = not left and np.array_equal(buf, expected)
    assert_on_every_rank(world, None if good else f"rank {world.rank}: frames left in cycles: "
                         f"{left}; result {buf.tolist()}")
