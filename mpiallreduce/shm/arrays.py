"""Shared arrays: NumPy arrays in a node's shared window (:func:`shared_empty`), which the
shm transport reads and writes in place on every rank (no copy in or out).

:func:`shared_empty` is public (``mpiallreduce.shared_empty``), yet the transport imports
nothing above it: it finds a communicator's state through the lookup the package registers
at import (:func:`serve_states`, the module's one hook).
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from ..ops import DTYPES
from .node import Node, SharedBlock, node_of

#: ``check_comm(comm)`` (raises for anything but a live intracommunicator) and
#: ``state_of(comm, timeout, what)`` (a communicator's state, made on first use: collective),
#: registered by the package (:func:`serve_states`).
_check_comm = _state_of = None


def serve_states(check_comm, state_of) -> None:
    """Register how :func:`shared_empty` checks a communicator and finds its state (the face's
    ``_checks.check_comm`` and ``_state.state``). Called once, by ``mpiallreduce/__init__``."""
    global _check_comm, _state_of
    _check_comm, _state_of = check_comm, state_of


class SharedArray(np.ndarray):
    """A NumPy array in a node's shared window (:func:`shared_empty`); ``free()`` releases it.

    ``mpiallreduce`` reads peers' shared arrays directly: no copy in or out. Free it (or leave
    the ``with`` block) on every rank together, once no plan uses it; do not touch it (or views
    of it) afterwards.
    """

    _block: SharedBlock | None = None

    def __array_finalize__(self, obj):
        self._block = getattr(obj, "_block", None)

    def free(self) -> None:
        """Release the array's memory on every rank (collective)."""
        if self._block is not None:
            self._block.free()

    @property
    def freed(self) -> bool:
        return self._block is None or self._block.freed

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.free()


def shared_empty(shape, dtype=float, comm=None, order: str = "C") -> SharedArray:
    """Return an uninitialised array in the node's shared memory (collective on ``comm``).

    Pass it to :func:`mpiallreduce.allreduce` (``algorithm="shm"`` or ``auto``) on a one-node
    communicator and the ranks reduce straight from each other's arrays. Same shape and dtype
    on every rank. Free it with ``free()`` or a ``with`` block, or with the communicator.
    """
    comm = MPI.COMM_WORLD if comm is None else comm
    _check_comm(comm)
    dtype = np.dtype(dtype)
    if dtype not in DTYPES:
        raise TypeError(f"dtype {dtype} has no predefined MPI datatype here; use one of "
                        f"{', '.join(d.name for d in DTYPES)}")
    if order not in ("C", "F"):
        raise ValueError(f"order must be 'C' or 'F', got {order!r}")
    shape = tuple(int(n) for n in np.atleast_1d(shape)) if np.ndim(shape) else (int(shape),)
    if any(n < 0 for n in shape):
        raise ValueError(f"negative dimensions are not allowed: {shape}")
    state = _state_of(comm, None, "shared_empty")
    state.refuse_if_broken("shared_empty")
    node = node_of(state, None, "shared_empty")
    count = int(np.prod(shape, dtype=np.int64))
    memory = node.new_block(count * dtype.itemsize)
    array = np.ndarray(shape, dtype=dtype, buffer=memory.segments[node.rank],
                       order=order).view(SharedArray)
    array._block = memory
    return array


def shared_zeros(shape, dtype=float, comm=None, order: str = "C") -> SharedArray:
    """As :func:`shared_empty`, filled with zeros."""
    array = shared_empty(shape, dtype, comm, order)
    array.fill(0)
    return array


def placement(array: np.ndarray | None, node: Node) -> SharedBlock | None:
    """The shared memory ``array`` lies in, where it is a shared array of ``node``; else None."""
    memory = getattr(array, "_block", None)
    if memory is None or memory.node is not node:
        return None
    return memory
