"""Read a DLPack producer's memory as mpi4py reads it: one export, the capsule never consumed.

``np.from_dlpack`` *consumes* the capsule (renames it ``used_dltensor`` and later calls the
producer's deleter itself); mpi4py does not: it asks for one capsule (DLPack 1.0 first, then
0.x), reads the tensor's fields, and keeps the capsule as the owner of the memory, so the
producer's own capsule destructor frees it when the last view goes. A producer written for
mpi4py (mpi4py's own test suite has one) may only survive mpi4py's way: consumed by NumPy it
corrupts reference counts and the process crashes later, in garbage collection. mar.Comm is a
drop-in for mpi4py, so mpiallreduce reads DLPack exactly as mpi4py does, here.

The layout follows dlpack.h (v1.0): ``DLManagedTensorVersioned`` for a ``dltensor_versioned``
capsule, ``DLManagedTensor`` for a ``dltensor`` one.
"""

from __future__ import annotations

import ctypes

import numpy as np

_CPU = 1  # kDLCPU
_INT, _UINT, _FLOAT, _COMPLEX, _BOOL = 0, 1, 2, 5, 6  # DLDataTypeCode
_READ_ONLY = 1  # DLPACK_FLAG_BITMASK_READ_ONLY


class _DataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _Tensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device_type", ctypes.c_int32),
                ("device_id", ctypes.c_int32), ("ndim", ctypes.c_int32), ("dtype", _DataType),
                ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class _Managed(ctypes.Structure):  # DLManagedTensor (DLPack 0.x)
    _fields_ = [("dl_tensor", _Tensor), ("manager_ctx", ctypes.c_void_p),
                ("deleter", ctypes.c_void_p)]


class _ManagedVersioned(ctypes.Structure):  # DLManagedTensorVersioned (DLPack 1.x)
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32),
                ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p),
                ("flags", ctypes.c_uint64), ("dl_tensor", _Tensor)]


_is_valid = ctypes.pythonapi.PyCapsule_IsValid
_is_valid.argtypes = [ctypes.py_object, ctypes.c_char_p]
_is_valid.restype = ctypes.c_int
_get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_get_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_get_pointer.restype = ctypes.c_void_p

#: (code, bits) -> NumPy type character, as mpi4py maps DLPack types to buffer formats
_CHARS = {(_BOOL, 8): "?", (_FLOAT, 16): "e", (_FLOAT, 32): "f", (_FLOAT, 64): "d",
          (_COMPLEX, 64): "F", (_COMPLEX, 128): "D"}
for _char in "bhilq":
    _CHARS.setdefault((_INT, 8 * np.dtype(_char).itemsize), _char)
    _CHARS.setdefault((_UINT, 8 * np.dtype(_char.upper()).itemsize), _char.upper())
_CHARS.setdefault((_FLOAT, 8 * np.dtype("g").itemsize), "g")
_CHARS.setdefault((_COMPLEX, 8 * np.dtype("G").itemsize), "G")


class _Owner:
    """Holds the capsule (and so the producer's memory) for as long as a view of it lives."""

    __slots__ = ("__array_interface__", "capsule")

    def __init__(self, capsule, interface: dict):
        self.capsule = capsule
        self.__array_interface__ = interface


def _dtype(dtype: _DataType) -> np.dtype:
    code, bits, lanes = dtype.code, dtype.bits, dtype.lanes
    if lanes == 2 and code == _FLOAT:  # a complex number as two floats, as mpi4py reads it
        code, bits, lanes = _COMPLEX, 2 * bits, 1
    char = _CHARS.get((code, bits)) if lanes == 1 else None
    if char is None:
        raise BufferError(f"dlpack: no NumPy type for DLPack type code {dtype.code}, "
                          f"{dtype.bits} bits, {dtype.lanes} lanes")
    return np.dtype(char)


def from_dlpack(obj) -> np.ndarray:
    """View ``obj``'s DLPack export (CPU memory, C or Fortran contiguous) as a NumPy array.

    One ``__dlpack__`` call, as mpi4py makes it; the capsule is left unconsumed and owned by
    the array, so the producer frees its memory its own way. Raises what the producer raises,
    or ``BufferError`` (another device, a layout MPI cannot read, a type NumPy has not).
    """
    dlpack = obj.__dlpack__
    device_type, _ = obj.__dlpack_device__()
    if device_type != _CPU:
        raise BufferError(f"dlpack: device type {device_type} is not the CPU's "
                          f"(copy the tensor to the CPU first)")
    try:  # DLPack 1.0 first, then 0.x, as mpi4py asks
        capsule, name = dlpack(max_version=(1, 0), copy=False), b"dltensor_versioned"
    except TypeError:
        capsule, name = dlpack(), b"dltensor"
    if not _is_valid(capsule, name):
        raise BufferError("dlpack: invalid capsule object")
    pointer = _get_pointer(capsule, name)
    if name == b"dltensor":
        tensor, readonly = _Managed.from_address(pointer).dl_tensor, False
    else:
        managed = _ManagedVersioned.from_address(pointer)
        if managed.major != 1:
            raise BufferError(f"dlpack: unsupported version {managed.major}.{managed.minor}")
        tensor, readonly = managed.dl_tensor, bool(managed.flags & _READ_ONLY)
    dtype = _dtype(tensor.dtype)
    shape = tuple(tensor.shape[i] for i in range(tensor.ndim))
    strides = None
    if tensor.strides and tensor.ndim:
        strides = tuple(tensor.strides[i] * dtype.itemsize for i in range(tensor.ndim))
    if any(n == 0 for n in shape):
        return np.empty(shape, dtype)
    if not tensor.data:
        raise BufferError("dlpack: data pointer is NULL")
    array = np.asarray(_Owner(capsule, {
        "version": 3, "typestr": dtype.str, "shape": shape, "strides": strides,
        "data": (tensor.data + tensor.byte_offset, readonly)}))
    if not (array.flags.c_contiguous or array.flags.f_contiguous):
        raise BufferError("dlpack: buffer is not contiguous")
    return array
